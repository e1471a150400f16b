"""Question-answer data in FlashRAG JSONL form: ``{"id", "question", "golden_answers"}``."""

from __future__ import annotations

import json
from pathlib import Path

from memsearcher.errors import MemSearcherError
from memsearcher.types import QAExample

__all__ = ["read_qa"]


def read_qa(path: str | Path) -> list[QAExample]:
    """Every example of a FlashRAG JSONL file, in file order.

    ``golden_answers`` may be a list or a single string; other keys go to ``metadata``. A bad
    line raises `MemSearcherError` naming the file and the line.
    """
    path = Path(path)
    if not path.is_file():
        raise MemSearcherError(f"{path}: no such question file")
    examples: list[QAExample] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            examples.append(_parse(line, f"{path}:{number}"))
    if not examples:
        raise MemSearcherError(f"{path}: no questions in the file")
    return examples


def _parse(line: str, where: str) -> QAExample:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise MemSearcherError(f"{where}: not JSON ({error.msg})") from None
    if not isinstance(record, dict):
        raise MemSearcherError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [key for key in ("id", "question", "golden_answers") if key not in record]
    if missing:
        raise MemSearcherError(f"{where}: missing {', '.join(missing)}")
    answers = record["golden_answers"]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise MemSearcherError(f"{where}: golden_answers must be a string or a list of strings")
    if not isinstance(record["question"], str) or not record["question"].strip():
        raise MemSearcherError(f"{where}: question must be a non-empty string")
    metadata = {k: v for k, v in record.items() if k not in ("id", "question", "golden_answers")}
    return QAExample(str(record["id"]), record["question"], tuple(answers), metadata)
