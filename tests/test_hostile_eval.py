"""Eval into folders it does not own: a user's files in --out, dataset names that are paths.

The real CLI on the embedded model and BM25 index, on real files; a refusal must come before
any question is answered and name the file, and nothing may be written outside --out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memsearcher.cli import main

ROW = {"id": "q0", "question": "Who wrote Hamlet?", "golden_answers": ["William Shakespeare"]}
SMALL = ["--max-turns", "1", "--max-new-tokens", "8", "--memory-tokens", "8", "--no-progress"]


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "data" / "nq" / "test.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(ROW) + "\n", encoding="utf-8")
    return path.parent.parent


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("summary.json", "not json at all\n"),
        ("summary.json", '{"title": "my notes"}\n'),
        ("summary.json", '{"datasets": {"hotpotqa": 1}}\n'),
        ("summary.json", "[1, 2]\n"),
        ("settings.json", '{"editor.fontSize": 14\n'),
        ("settings.json", '["a list"]\n'),
    ],
)
def test_a_foreign_run_file_in_out_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str
) -> None:
    data = _data(tmp_path)
    out = tmp_path / "mine"
    out.mkdir()
    (out / name).write_text(text, encoding="utf-8")
    before = _files(out)
    args = ["eval", "--data", str(data), "--datasets", "nq", "--out", str(out), *SMALL]
    for _ in range(2):  # and the same on a rerun
        assert main(args) == 2
        assert str(out / name) in capsys.readouterr().err
        after = {k: v for k, v in _files(out).items() if k != ".lock"}  # eval's own, empty
        assert after == before  # no question answered, the user's file untouched


def test_a_dataset_given_as_a_path_writes_nothing_outside_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _data(tmp_path)
    before = _files(tmp_path / "data")
    out = tmp_path / "run"
    args = ["eval", "--data", str(data), "--datasets", str(data / "nq"), "--out", str(out)]
    assert main([*args, *SMALL]) == 2
    assert "--datasets" in capsys.readouterr().err
    assert _files(tmp_path / "data") == before
    assert not (out / "nq").exists()
