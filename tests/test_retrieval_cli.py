"""`memsearcher index build|search|info`, run in-process through the real CLI entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memsearcher.cli import main
from memsearcher.retrieval.corpus import Passage, write_corpus
from memsearcher.retrieval.embedded import embedded_passages


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    passages = [Passage(p.id, p.title, p.text[:200]) for p in embedded_passages()[:400:10]]
    write_corpus(tmp_path / "corpus.jsonl", passages)
    return tmp_path / "corpus.jsonl"


def test_build_search_info_bm25(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bm25"
    code = main(["index", "build", "--corpus", str(corpus), "--out", str(out), "--no-progress"])
    assert code == 0
    assert "built bm25 index" in capsys.readouterr().out
    assert main(["index", "search", str(out), "Academy Awards film", "--top-n", "2"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# Academy Awards film\n") and "Doc 1 (Title: " in printed
    assert main(["index", "search", str(out), "zzqqxx", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"query": "zzqqxx", "hits": []}
    assert main(["index", "info", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "bm25"


def test_user_errors_exit_2(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = [
        "index",
        "build",
        "--corpus",
        str(tmp_path / "no.jsonl"),
        "--out",
        str(tmp_path / "x"),
    ]
    assert main(missing) == 2
    assert "corpus file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "ok"}\n{"id": 2, "contents": null}\n')
    assert main(["index", "build", "--corpus", str(bad), "--out", str(tmp_path / "y")]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err
    skip = ["index", "build", "--corpus", str(bad), "--out", str(tmp_path / "y"), "--skip-bad-rows"]
    assert main([*skip, "--no-progress"]) == 0
    assert main(["index", "search", str(tmp_path), "q"]) == 2
    assert "not an index folder" in capsys.readouterr().err
    assert main(["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "z"),
                 "--method", "bm99"]) == 2  # fmt: skip


@pytest.mark.slow
def test_build_dense_with_progress_bar(corpus: Path, tmp_path: Path) -> None:
    """The real console script, as a user runs it: progress bars on stderr."""
    out = tmp_path / "dense"
    command = [sys.executable, "-m", "memsearcher.cli", "index", "build", "--corpus", str(corpus)]
    command += ["--out", str(out), "--kind", "dense", "--faiss", "hnsw", "--hnsw-m", "8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "dense: encode" in done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["dense"]["faiss"]["kind"] == "hnsw" and manifest["dense"]["faiss"]["hnsw_m"] == 8
    )
    search = [sys.executable, "-m", "memsearcher.cli", "index", "search", str(out), "a film"]
    found = subprocess.run(search, capture_output=True, text=True, timeout=300, check=False)
    assert found.returncode == 0 and "Doc 1 (Title: " in found.stdout
