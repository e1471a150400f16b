"""FlashRAG benchmark files: JSONL or parquet rows of ``id``, ``question``, ``golden_answers``.

A dataset name resolves inside a data folder the way FlashRAG lays out its release:
``DIR/<name>/test.jsonl``, except HotpotQA, 2WikiMultihopQA and MuSiQue, whose test answers
are hidden and which are evaluated on ``dev.jsonl``. A ``.parquet`` file of the same stem is
accepted where the JSONL is missing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.text import normalize_answer, parse_json, sanitize_text
from memsearcher.types import QAExample

__all__ = [
    "BENCHMARKS",
    "DEV_SPLIT",
    "load_benchmarks",
    "read_examples",
    "resolve_dataset",
]

BENCHMARKS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
"""The seven QA benchmarks of the paper's table, in its column order."""
DEV_SPLIT = frozenset({"hotpotqa", "2wikimultihopqa", "musique"})
"""Benchmarks evaluated on their dev split (FlashRAG's choice, followed by the paper)."""


def _example(row: Mapping[str, Any], where: str) -> QAExample:
    try:
        raw_id, question, golds = row["id"], row["question"], row["golden_answers"]
    except (KeyError, TypeError):
        raise MemSearcherError(
            f"{where}: a FlashRAG row needs 'id', 'question' and 'golden_answers'"
        ) from None
    if not isinstance(question, str) or not question.strip():
        raise MemSearcherError(f"{where}: 'question' must be a non-empty string")
    answers = _golds([golds] if isinstance(golds, str) else golds, where)
    metadata = row.get("metadata") or {}
    if isinstance(metadata, Mapping) and "objectives" in metadata:
        _check_objectives(metadata["objectives"], where)
    return QAExample(
        id=sanitize_text(str(raw_id)),
        question=sanitize_text(question.strip()),
        golden_answers=answers,
        metadata=dict(metadata) if isinstance(metadata, Mapping) else {},
    )


def _golds(golds: Any, where: str) -> tuple[str, ...]:
    """The gold answers that can be scored: strings that normalize to something. A gold such as
    "" or "the" would equal an empty prediction, so it is left out; a question left with no
    gold is refused (a real answer such as the band "The The" normalizes to nothing too, so
    one such gold beside others does not sink a benchmark's file)."""
    if not isinstance(golds, list) or not golds:
        raise MemSearcherError(f"{where}: 'golden_answers' must be a non-empty list of strings")
    for gold in golds:
        if not isinstance(gold, str):
            raise MemSearcherError(f"{where}: golden answer {gold!r:.40} is not a string")
    scored = tuple(sanitize_text(gold) for gold in golds if normalize_answer(gold))
    if not scored:
        raise MemSearcherError(
            f"{where}: golden answer {golds[0]!r:.40} normalizes to nothing (no word left once "
            "case, punctuation and articles go), so no answer could be scored against it"
        )
    return scored


def _check_objectives(objectives: Any, where: str) -> None:
    """A composed task's objectives (`memsearcher.data.compose`): each a question and its
    non-empty list of gold answers."""
    if not isinstance(objectives, list) or not objectives:
        raise MemSearcherError(f"{where}: metadata 'objectives' must be a non-empty list")
    for number, objective in enumerate(objectives, start=1):
        if not isinstance(objective, Mapping) or not isinstance(objective.get("question"), str):
            raise MemSearcherError(
                f"{where}: objective {number} needs a 'question' string and a non-empty "
                "'golden_answers' list of strings"
            )
        _golds(objective.get("golden_answers"), f"{where}: objective {number}")


def _jsonl_rows(path: Path) -> Iterable[tuple[str, Any]]:
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise MemSearcherError(f"{where}: not valid UTF-8 ({error.reason})") from None
            if not line.strip():
                continue
            try:
                row = parse_json(line)
            except ValueError as error:
                raise MemSearcherError(f"{where}: {error}") from None
            yield where, row


def _parquet_rows(path: Path) -> Iterable[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MemSearcherError(
            f"reading {path} needs pyarrow: pip install 'memsearcher[eval]'"
        ) from None
    # to_pylist turns list columns into Python lists (pandas would give numpy arrays)
    for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield f"{path}: row {number}", row


def read_examples(path: str | Path, limit: int | None = None) -> list[QAExample]:
    """The questions of one FlashRAG file (``.jsonl`` or ``.parquet``), first ``limit`` only.

    Ids must be unique within a file: an evaluation run resumes by id. A file without a single
    question is an error. Text passes through :func:`memsearcher.text.sanitize_text`.
    """
    path = Path(path)
    if not path.is_file():
        raise MemSearcherError(f"no such data file: {path}")
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
    examples: list[QAExample] = []
    seen: set[str] = set()
    for where, row in rows:
        if limit is not None and len(examples) >= limit:
            break
        example = _example(row, where)
        if example.id in seen:
            raise MemSearcherError(f"{where}: duplicate id {example.id!r}")
        seen.add(example.id)
        examples.append(example)
    if not examples and limit != 0:
        raise MemSearcherError(f"{path} holds no questions")
    return examples


def resolve_dataset(folder: str | Path, name: str) -> Path:
    """The file FlashRAG evaluates ``name`` on, inside ``folder``."""
    split = "dev" if name in DEV_SPLIT else "test"
    base = Path(folder) / name
    for candidate in (base / f"{split}.jsonl", base / f"{split}.parquet"):
        if candidate.is_file():
            return candidate
    raise MemSearcherError(f"dataset {name!r}: no {base / split}.jsonl (or .parquet)")


def load_benchmarks(
    data: str | Path, names: Sequence[str] | None = None, limit: int | None = None
) -> dict[str, list[QAExample]]:
    """Datasets by name from ``data``: one file (named after its folder, or its stem when the
    stem is not a split name) or a FlashRAG folder (``names``, or every benchmark present)."""
    data = Path(data)
    if data.is_file():
        if names:
            raise MemSearcherError("--datasets selects folders inside a data folder, not a file")
        name = data.parent.name if data.stem in {"test", "dev", "train"} else data.stem
        return {name or data.stem: read_examples(data, limit)}
    if not data.is_dir():
        raise MemSearcherError(f"--data {data}: no such file or folder")
    if not names:
        names = [n for n in BENCHMARKS if (data / n).is_dir()]
        if not names:
            raise MemSearcherError(
                f"{data} holds none of the benchmarks {', '.join(BENCHMARKS)}; "
                "name them with --datasets"
            )
    return {name: read_examples(resolve_dataset(data, name), limit) for name in names}
