"""The offline default retriever, index loading by manifest, and the one hit format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memsearcher.agent.prompts import format_hits
from memsearcher.errors import MemSearcherError
from memsearcher.retrieval import (
    embedded_corpus_path,
    load_embedded_retriever,
    open_retriever,
    read_corpus,
)
from memsearcher.retrieval.bm25 import BM25Index
from memsearcher.types import Hit


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEMSEARCHER_HOME", str(tmp_path))
    return tmp_path


def test_format_hits() -> None:
    hits = [Hit("1", "Paris", "Capital of France.", 3.0), Hit("2", "Lyon", "A city\n\nin France.")]
    assert format_hits(hits) == (
        "Doc 1 (Title: Paris) Capital of France.\nDoc 2 (Title: Lyon) A city in France."
    )
    assert format_hits([]) == ""


def test_embedded_corpus_written_once(home: Path) -> None:
    path = embedded_corpus_path()
    assert path.parent == home / "corpora"
    first = json.loads(path.open(encoding="utf-8").readline())
    assert set(first) == {"id", "contents"} and first["contents"].startswith('"')
    passages = list(read_corpus(path))
    assert len(passages) > 9000
    assert len({p.id for p in passages}) == len(passages)
    stamp = path.stat().st_mtime_ns
    assert embedded_corpus_path() == path and path.stat().st_mtime_ns == stamp
    assert not [p for p in path.parent.iterdir() if p != path]  # no temp file left


def test_embedded_retriever_cached(home: Path) -> None:
    retriever = load_embedded_retriever()
    assert isinstance(retriever, BM25Index)
    assert retriever.folder.parent == home / "indexes"
    assert load_embedded_retriever() is retriever
    assert open_retriever(None) is retriever
    hits = retriever.search(["Stanley Kubrick science fiction film 1968"], 5)[0]
    assert "2001: A Space Odyssey" in [h.title for h in hits]
    assert format_hits(hits).startswith("Doc 1 (Title: ")


def test_embedded_index_rebuilt_when_stale(home: Path) -> None:
    folder = load_embedded_retriever().folder  # type: ignore[attr-defined]
    (folder / "manifest.json").write_text("{broken", encoding="utf-8")
    from memsearcher.retrieval import embedded

    embedded._cache.clear()
    retriever = load_embedded_retriever()
    assert retriever.search(["Eiffel Tower Paris"], 1)[0]


def test_open_retriever_folder_and_errors(home: Path) -> None:
    folder = load_embedded_retriever().folder  # type: ignore[attr-defined]
    assert isinstance(open_retriever(str(folder)), BM25Index)
    with pytest.raises(MemSearcherError, match="no such index folder"):
        open_retriever(str(home / "nope"))


def test_two_processes_build_it_at_once(home: Path) -> None:
    code = (
        "from memsearcher.retrieval import load_embedded_retriever as load\n"
        "print(load().search(['Eiffel Tower Paris'], 1)[0][0].title)"
    )
    env = {**os.environ, "MEMSEARCHER_HOME": str(home)}
    runs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    assert outputs == ["Eiffel Tower\n", "Eiffel Tower\n"]
    assert [p.name for p in (home / "indexes").iterdir()] == ["wiki-summaries-en-v1-bm25"]
    assert [p.name for p in (home / "corpora").iterdir()] == ["wiki-summaries-en-v1.jsonl"]
