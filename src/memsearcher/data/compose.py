"""Multi-objective tasks, MEM1's way: N questions of one dataset joined into one task.

MEM1 (MIT-MI/MEM1, ``gen_data/data_process/qa_search_*_multi.py``) takes N consecutive
questions of a FlashRAG dataset, adds a question mark where one is missing, and joins them with
"; ". The answer is split on ";" and scored position by position, 0 if the count differs
(`memsearcher.eval.metrics.objective_sum`). Here the questions are first shuffled with a seed,
so a composition is a pure function of (file, N, seed).

A composed task is a normal FlashRAG row: ``question`` is the joined questions,
``golden_answers`` holds one canonical joined answer (the first gold of each objective, so that
tools which know nothing of objectives still read a valid row), and ``metadata["objectives"]``
lists each objective's ``id``, ``question``, ``golden_answers`` and original ``metadata``
(`QAExample.objectives` reads it).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.folders import check_output_file
from memsearcher.types import QAExample

__all__ = ["compose", "write_examples"]


def _as_question(text: str) -> str:
    text = text.strip()
    return text if text.endswith("?") else text + "?"


def compose(examples: Sequence[QAExample], objectives: int, seed: int) -> list[QAExample]:
    """``len(examples) // objectives`` tasks of ``objectives`` questions each.

    The questions are shuffled with ``random.Random(seed)``, then cut into consecutive groups
    of N; the leftover questions (fewer than N) are dropped. Each question is used at most once.
    """
    if objectives < 1:
        raise MemSearcherError(f"objectives must be >= 1, got {objectives}")
    if len(examples) < objectives:
        raise MemSearcherError(
            f"cannot compose {objectives}-objective tasks from {len(examples)} questions"
        )
    for example in examples:
        if "objectives" in example.metadata:
            raise MemSearcherError(f"{example.id!r} is already a composed task")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    tasks = []
    for start in range(0, len(order) - objectives + 1, objectives):
        group = [examples[i] for i in order[start : start + objectives]]
        tasks.append(
            QAExample(
                id="+".join(e.id for e in group),
                question="; ".join(_as_question(e.question) for e in group),
                golden_answers=("; ".join(e.golden_answers[0] for e in group),),
                metadata={
                    "objectives": [
                        {
                            "id": e.id,
                            "question": e.question,
                            "golden_answers": list(e.golden_answers),
                            "metadata": e.metadata,
                        }
                        for e in group
                    ],
                    "compose_seed": seed,
                },
            )
        )
    return tasks


def write_examples(
    path: str | Path, examples: Sequence[QAExample], overwrite: bool = False
) -> Path:
    """``examples`` as a FlashRAG JSONL file, written whole (a temporary file, then a rename)."""
    path = Path(path)
    check_output_file(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        for example in examples:
            row: dict[str, Any] = {
                "id": example.id,
                "question": example.question,
                "golden_answers": list(example.golden_answers),
                "metadata": example.metadata,
            }
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path
