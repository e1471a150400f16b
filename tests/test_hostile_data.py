"""Bad bytes on disk (issue 26): rows the JSON parser cannot take, golds that cannot be scored.
Each reaches the real reader or the real index build through real files, and must come back as
a clear error naming file and line (or a skipped row under ``--skip-bad-rows``), never a crash.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memsearcher.cli import main
from memsearcher.data.flashrag import read_examples
from memsearcher.errors import MemSearcherError
from memsearcher.eval.run import prediction_record
from memsearcher.types import QAExample, Trajectory

HUGE_INT = '{"id": ' + "7" * 5000 + ', "contents": "\\"Huge\\"\\nan id past the parser"}'
DEEP = "[" * 200_000 + "]" * 200_000
UNPARSEABLE = pytest.mark.parametrize("row", [HUGE_INT, DEEP], ids=["5000-digit-int", "deep"])


def _corpus(tmp_path: Path, bad: str) -> Path:
    rows = [json.dumps({"id": str(i), "contents": f'"T{i}"\nzebra {i}'}) for i in range(3)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join([rows[0], bad, *rows[1:]]) + "\n", encoding="utf-8")
    return path


@UNPARSEABLE
def test_an_unparseable_corpus_row_is_a_bad_row(
    tmp_path: Path, row: str, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _corpus(tmp_path, row)
    build = ["index", "build", "--corpus", str(corpus), "--no-progress"]
    assert main([*build, "--out", str(tmp_path / "a")]) == 2
    assert f"{corpus}:2: not valid JSON" in capsys.readouterr().err
    assert main([*build, "--out", str(tmp_path / "b"), "--skip-bad-rows"]) == 0
    capsys.readouterr()
    assert main(["index", "search", str(tmp_path / "b"), "zebra", "--top-n", "9", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert sorted(h["id"] for h in hits) == ["0", "1", "2"]


@UNPARSEABLE
def test_an_unparseable_question_row_names_file_and_line(tmp_path: Path, row: str) -> None:
    path = tmp_path / "test.jsonl"
    good = json.dumps({"id": "q1", "question": "who?", "golden_answers": ["x"]})
    path.write_text(f"{good}\n{row}\n", encoding="utf-8")
    with pytest.raises(MemSearcherError, match=rf"{path}:2: not valid JSON"):
        read_examples(path)


@pytest.mark.parametrize(
    ("golds", "wrong"),
    [([""], "normalizes to nothing"), (["the"], "normalizes to nothing"),
     ([None], "not a string"), (["Paris", 7], "not a string"), ("  ", "normalizes to nothing")],
)  # fmt: skip
def test_golds_that_cannot_be_scored_are_refused(tmp_path: Path, golds: object, wrong: str) -> None:
    path = tmp_path / "dev.jsonl"
    good = json.dumps({"id": "q1", "question": "who?", "golden_answers": ["x"]})
    bad = json.dumps({"id": "q2", "question": "what?", "golden_answers": golds})
    path.write_text(f"{good}\n{bad}\n", encoding="utf-8")
    with pytest.raises(MemSearcherError, match=rf"{path}:2: golden answer .*{wrong}"):
        read_examples(path)


def test_a_gold_that_normalizes_to_nothing_beside_others_is_left_out(tmp_path: Path) -> None:
    path = tmp_path / "dev.jsonl"
    row = {"id": "q", "question": "which band?", "golden_answers": ["The The", "", "Matt Johnson"]}
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    assert read_examples(path)[0].golden_answers == ("Matt Johnson",)


def test_an_objective_gold_that_cannot_be_scored_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dev.jsonl"
    objectives = [
        {"question": "a?", "golden_answers": ["x"]},
        {"question": "b?", "golden_answers": ["an"]},
    ]
    row = {
        "id": "q",
        "question": "a? b?",
        "golden_answers": ["x; y"],
        "metadata": {"objectives": objectives},
    }
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(MemSearcherError, match=rf"{path}:1: objective 2: golden answer .*nothing"):
        read_examples(path)


@pytest.mark.parametrize("golds", [("",), ("the",), ("a", "Paris")])
def test_an_unanswered_question_scores_zero(golds: tuple[str, ...]) -> None:
    example = QAExample(id="q", question="where?", golden_answers=golds)
    unanswered = Trajectory(
        example=example, agent="memsearcher", turns=(), sequences=(), end_reason="format_error"
    )
    record = prediction_record("nq", unanswered)
    assert (record["prediction"], record["em"], record["f1"], record["acc"]) == (
        None,
        0.0,
        0.0,
        0.0,
    )
