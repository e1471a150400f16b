"""The predictions file of an evaluation run: one JSON line a finished question.

Lines are appended and flushed one question at a time (`PredictionWriter`); a torn last line
(the process died mid-write) is ignored on reading and cut before the next append. An id saved
more than once counts by its last line (`latest_records`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.eval.metrics import exact_match, f1_score, objective_sum, sub_exact_match
from memsearcher.types import QAExample, Trajectory

logger = logging.getLogger(__name__)

__all__ = [
    "PredictionWriter",
    "error_record",
    "latest_records",
    "peak_tokens",
    "prediction_record",
    "read_predictions",
]

METRICS = {"em": exact_match, "f1": f1_score, "acc": sub_exact_match}


def _scores(example: QAExample, prediction: str | None) -> dict[str, float]:
    """EM, F1 and ACC; a composed multi-objective task sums them over its objectives with the
    count rule (`objective_sum`), so its scores range over 0..N. No answer scores 0, even
    against a gold that normalizes to "" (one not read through `read_examples`); so does a
    task with no gold answer (a WebShop session, whose target the server does not show: the
    environment's reward is its measure)."""
    if prediction is None or not example.objectives[0]:
        return dict.fromkeys(METRICS, 0.0)
    if "objectives" not in example.metadata:
        return {k: metric(prediction, example.golden_answers) for k, metric in METRICS.items()}
    return {k: objective_sum(prediction, example.objectives, m) for k, m in METRICS.items()}


def peak_tokens(trajectory: Trajectory) -> int:
    """The largest context of the trajectory: its longest training sequence, the tokens
    generated into it included (MEM1's "peak tokens")."""
    return max((len(s.input_ids) for s in trajectory.sequences), default=0)


def prediction_record(
    dataset: str, trajectory: Trajectory, seconds: float | None = None
) -> dict[str, Any]:
    """One line of ``predictions.jsonl``: the scores, the per-turn counts and the trajectory.

    ``seconds``: this question's share of the run's wall time (see `_answer_missing`).
    """
    example = trajectory.example
    # the environment's reward, where the task has one (the shop's; absent for search QA)
    reward = {"reward": trajectory.environment_reward or 0.0} if _rewarded(example) else {}
    return {
        "id": example.id,
        "dataset": dataset,
        "question": example.question,
        "golden_answers": list(example.golden_answers),
        "prediction": trajectory.answer,
        **_scores(example, trajectory.answer),
        "objectives": len(example.objectives),
        "end_reason": trajectory.end_reason,
        "turns": len(trajectory.turns),
        "searches": trajectory.num_searches,
        "prompt_tokens": [turn.prompt_tokens for turn in trajectory.turns],
        "peak_tokens": peak_tokens(trajectory),
        "seconds": seconds,
        **reward,
        "trajectory": trajectory.to_dict(),
    }


def _rewarded(example: QAExample) -> bool:
    return example.metadata.get("environment") in ("shop", "webshop")


def error_record(dataset: str, example: QAExample, error: BaseException) -> dict[str, Any]:
    """The line of a question whose run failed: it scores 0 and a rerun tries it again."""
    return {
        "id": example.id,
        "dataset": dataset,
        "question": example.question,
        "golden_answers": list(example.golden_answers),
        "prediction": None,
        "em": 0.0,
        "f1": 0.0,
        "acc": 0.0,
        "objectives": len(example.objectives),
        "end_reason": "error",
        "error": f"{type(error).__name__}: {error}"[:1000],
        "turns": 0,
        "searches": 0,
        "prompt_tokens": [],
        **({"reward": 0.0} if _rewarded(example) else {}),
        "trajectory": None,
    }


def latest_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per id, the last one saved (a retried error is followed by its answer)."""
    return list({record["id"]: record for record in records}.values())


def read_predictions(path: str | Path) -> list[dict[str, Any]]:
    """The saved records, ignoring a torn last line; a bad line elsewhere is an error."""
    path = Path(path)
    if not path.is_file():
        return []
    # bytes, not text: a write cut mid-character must not make the whole file unreadable
    lines = path.read_bytes().split(b"\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line.decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError):
            if number == len(lines):  # no newline after it: the write was cut short
                logger.warning("%s: ignoring a torn last line", path)
                break
            raise MemSearcherError(
                f"{path}:{number}: not JSON; the predictions are damaged"
            ) from None
    return records


def _truncate_torn_tail(path: Path) -> None:
    """Make the file end on a line break before appending: a last line without one is cut off,
    unless it is a whole record (the crash came just before its newline), which is kept."""
    if not path.is_file():
        return
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end == len(data):
        return
    try:
        json.loads(data[end:].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        with path.open("r+b") as file:
            file.truncate(end)
    else:  # read_predictions counted it as done, so it must stay
        with path.open("ab") as file:
            file.write(b"\n")


class PredictionWriter:
    """Appends records to a predictions file, one flushed and synced line per question."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _truncate_torn_tail(path)
        self.file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()
