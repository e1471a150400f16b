"""Both servers, run for real on 127.0.0.1, against what happens around them rather than in the
requests: a corpus rewritten under a running server, clients that hang up while their work
waits, a client that asks for an upload it will never be allowed to send.

Each test starts its own server (a BM25 index over 300 embedded passages; the agent server with
the tiny random-weight model of tests/tiny_model.py), so a test that breaks one breaks no
other. Every loop is bounded in count and in time.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _servers import free_port, running

from memsearcher.cli import main
from memsearcher.retrieval.corpus import write_corpus
from memsearcher.retrieval.embedded import embedded_passages


def _env() -> dict[str, str]:
    src = str(Path(__file__).parent.parent / "src")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src}


@pytest.fixture
def own_index(tmp_path: Path) -> Path:
    """A folder with a private corpus and its BM25 index, for tests that change them."""
    write_corpus(tmp_path / "corpus.jsonl", embedded_passages()[:300])
    assert main(["index", "build", "--corpus", str(tmp_path / "corpus.jsonl"), "--out",
                 str(tmp_path / "index"), "--no-progress"]) == 0  # fmt: skip
    return tmp_path


@pytest.fixture
def retriever(own_index: Path) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "memsearcher.cli", "retriever", "serve", "--port", str(port)]
    command += ["--index", str(own_index / "index")]
    url = f"http://127.0.0.1:{port}"
    with running(command, f"{url}/health", own_index / "retrieval.log", _env(), 60):
        yield url


# -- a corpus that changes under a running server --------------------------------------------------


def test_a_corpus_rewritten_in_place_fails_requests_not_the_server(
    retriever: str, own_index: Path
) -> None:
    corpus = own_index / "corpus.jsonl"
    first = httpx.post(f"{retriever}/search", json={"query": "film"}, timeout=10)
    assert first.status_code == 200 and first.json()
    head = corpus.read_bytes()[:100]
    with corpus.open("wb") as f:  # what `head -c 100 corpus.jsonl > corpus.jsonl` does
        f.write(head)
    many = {"query": "the film of a", "top_n": 100}  # some past the first page: SIGBUS in a map
    for _ in range(2):  # the server lives on and says why, every time
        answer = httpx.post(f"{retriever}/search", json=many, timeout=10)
        assert answer.status_code == 500, answer.text[:300]
        assert "changed" in answer.json()["detail"] and "corpus.jsonl" in answer.json()["detail"]
    assert httpx.get(f"{retriever}/health", timeout=10).status_code == 200
