"""The parquet rows veRL trains on, written from FlashRAG questions, and read back by the loop.

veRL's ``RLHFDataset`` reads a parquet file and hands every column of a row to the agent loop's
``run(**row)``. One row per question:

- ``data_source``: the dataset's name (``nq``, ``hotpotqa``, ...); veRL groups validation metrics
  by it;
- ``agent_name``: which entry of the agent-loop YAML runs the row (``memsearcher``, ``react``...);
- ``prompt``: the question as one user message. veRL requires this column (it measures prompt
  length with it and passes it on as ``raw_prompt``); our agents build their own context from
  the question, so its wording does not matter;
- ``ability``: ``fact-reasoning``, as in Search-R1's data;
- ``reward_model``: ``{"style": "rule", "ground_truth": {"target": [golds]}}``, Search-R1's
  layout, so its scorers read our files too; veRL shows ``ground_truth`` in validation dumps;
- ``extra_info``: ``{"split", "index", "id", "question", "golden_answers", "objectives"}``:
  what the loop reads back (:func:`example_from_row`); ``index`` is the row number, which veRL
  uses to tell the samples of one question apart; ``objectives`` lists a composed task's
  objectives (``memsearcher.data.compose``: ``id``, ``question``, ``golden_answers`` each; empty
  for a plain question), whose golds its rewards score against, not the joined answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.types import QAExample

__all__ = ["ABILITY", "example_from_row", "verl_rows", "write_parquet"]

ABILITY = "fact-reasoning"


def verl_rows(
    datasets: Mapping[str, Sequence[QAExample]], agent: str, split: str
) -> list[dict[str, Any]]:
    """One veRL row per question, dataset by dataset, numbered from 0 across all of them."""
    rows: list[dict[str, Any]] = []
    for name, examples in datasets.items():
        for example in examples:
            golds = list(example.golden_answers)
            rows.append(
                {
                    "data_source": name,
                    "agent_name": agent,
                    "prompt": [{"role": "user", "content": example.question}],
                    "ability": ABILITY,
                    "reward_model": {"style": "rule", "ground_truth": {"target": golds}},
                    "extra_info": {
                        "split": split,
                        "index": len(rows),
                        "id": example.id,
                        "question": example.question,
                        "golden_answers": golds,
                        "objectives": _objectives(example),
                    },
                }
            )
    return rows


def _objectives(example: QAExample) -> list[dict[str, Any]]:
    """A composed task's objectives, without their own metadata (a parquet column needs one
    type in every row, and free-form metadata has none)."""
    return [
        {
            "id": str(objective.get("id", "")),
            "question": objective["question"],
            "golden_answers": list(objective["golden_answers"]),
        }
        for objective in example.metadata.get("objectives", [])
    ]


def write_parquet(rows: Sequence[Mapping[str, Any]], out: str | Path) -> Path:
    """Write ``rows`` as one parquet file, atomically (a temporary name, then a rename)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise MemSearcherError(
            "writing parquet needs pyarrow: pip install 'memsearcher[eval]'"
        ) from None
    if not rows:
        raise MemSearcherError("no questions to write")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    pq.write_table(pa.Table.from_pylist(list(rows)), partial)
    partial.replace(out)
    return out


def example_from_row(row: Mapping[str, Any], needs_gold: bool = True) -> QAExample:
    """The question of one veRL row, as ``run(**row)`` receives it; a task scored by its
    environment (``needs_gold`` False: a WebShop session) may come without golden answers.

    veRL's dataset reads parquet lists back as NumPy arrays, so lists are taken as any sequence.
    """
    info = row.get("extra_info")
    if not isinstance(info, Mapping):
        raise MemSearcherError(
            "the veRL row has no 'extra_info' mapping; write the data with `memsearcher verl "
            "prepare`"
        )
    missing = [key for key in ("question", "golden_answers") if key not in info]
    if missing:
        raise MemSearcherError(
            f"the veRL row's extra_info lacks {', '.join(missing)} (it has {sorted(info)}); "
            "write the data with `memsearcher verl prepare`"
        )
    question, golds = info["question"], info["golden_answers"]
    if isinstance(golds, str):
        golds = [golds]
    if not isinstance(question, str) or not question.strip() or (needs_gold and len(golds) == 0):
        raise MemSearcherError(
            f"the veRL row {info.get('id')!r} needs a question and at least one golden answer"
        )
    metadata = {"data_source": str(row.get("data_source", "")), "index": info.get("index")}
    objectives = info.get("objectives")
    if objectives is not None and len(objectives) > 0:
        metadata["objectives"] = [_objective(o, info.get("id")) for o in objectives]
    return QAExample(
        id=str(info.get("id", info.get("index", ""))),
        question=question.strip(),
        golden_answers=tuple(str(g) for g in golds),
        metadata=metadata,
    )


def _objective(objective: Any, task: Any) -> dict[str, Any]:
    golds = objective.get("golden_answers") if isinstance(objective, Mapping) else None
    if golds is None or isinstance(golds, str) or len(golds) == 0:
        raise MemSearcherError(
            f"the veRL row {task!r} has an objective without golden answers: {objective!r}"
        )
    return {
        "id": str(objective.get("id", "")),
        "question": str(objective.get("question", "")),
        "golden_answers": [str(g) for g in golds],
    }
