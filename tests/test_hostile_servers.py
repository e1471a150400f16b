"""Both servers, run for real on 127.0.0.1, against what happens around them rather than in the
requests: a corpus rewritten under a running server, clients that hang up while their work
waits, a client that asks for an upload it will never be allowed to send.

Each test starts its own server (a BM25 index over 300 embedded passages; the agent server with
the tiny random-weight model of tests/tiny_model.py), so a test that breaks one breaks no
other. Every loop is bounded in count and in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from _servers import connect, free_port, running, until_closed
from tiny_model import save_tiny_model

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.async_driver import drive
from memsearcher.agent.base import Episode, Generate, Search
from memsearcher.cli import main
from memsearcher.llm.base import Completion, SamplingParams
from memsearcher.llm.embedded import embedded_model_path
from memsearcher.llm.scripted import Reply, ScriptedLLM
from memsearcher.llm.tokenizer import load_tokenizer
from memsearcher.retrieval.client import AsyncHTTPRetriever, HTTPRetriever
from memsearcher.retrieval.corpus import write_corpus
from memsearcher.retrieval.embedded import embedded_passages
from memsearcher.rl.rewards import trajectory_reward
from memsearcher.rl.rollout import rollout_metrics
from memsearcher.types import Hit, QAExample, Trajectory


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


@contextlib.contextmanager
def serve_retriever(folder: Path, *options: str) -> Iterator[str]:
    """The base URL of a retrieval server on ``folder``'s index, while the block runs."""
    port = free_port()
    command = [sys.executable, "-m", "memsearcher.cli", "retriever", "serve", "--port", str(port)]
    command += ["--index", str(folder / "index"), *options]
    url = f"http://127.0.0.1:{port}"
    with running(command, f"{url}/health", folder / "retrieval.log", _env(), 60):
        yield url


@pytest.fixture
def retriever(own_index: Path) -> Iterator[str]:
    with serve_retriever(own_index) as url:
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


def test_a_corpus_replaced_by_a_rename_keeps_serving_what_the_index_was_built_from(
    retriever: str, own_index: Path
) -> None:
    corpus = own_index / "corpus.jsonl"
    query = {"query": "the film of a", "top_n": 20}
    before = httpx.post(f"{retriever}/search", json=query, timeout=10)
    new = corpus.with_name("corpus.new")
    new.write_bytes(corpus.read_bytes()[:100])
    new.replace(corpus)  # the open file is untouched: its passages still match the index
    after = httpx.post(f"{retriever}/search", json=query, timeout=10)
    assert after.status_code == 200 and after.json() == before.json()


# -- clients that hang up -----------------------------------------------------------------------


def send_request(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A raw connection that has sent one whole JSON POST and reads nothing."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\ncontent-type: application/json\r\n"
    sock.sendall(f"{head}content-length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_searches_whose_clients_left_free_their_places(own_index: Path) -> None:
    # 4 x 2,048 queries of 100 passages fill the pending places, and take seconds each
    limits = ["--max-queries", "2048", "--max-pending-queries", "8192"]
    with serve_retriever(own_index, *limits) as url:
        big = {"query": [f"film music war {i}" for i in range(2048)], "top_n": 100}
        socks = [send_request(url, "/batch_search", big) for _ in range(4)]
        assert wait_for(lambda: pending(url) == 8192)
        for sock in socks:
            sock.close()
        started = time.monotonic()
        answer = httpx.post(f"{url}/search", json={"query": "film"}, timeout=30)
        assert answer.status_code == 200, answer.text  # not 503: nobody waits for that work
        assert time.monotonic() - started < 10
        assert pending(url) == 0


@pytest.fixture
def agent(own_index: Path) -> Iterator[str]:
    port = free_port()
    model = save_tiny_model(own_index / "tiny")
    command = [sys.executable, "-m", "memsearcher.cli", "serve", "--port", str(port)]
    command += ["--model", str(model), "--index", str(own_index / "index"), "--device", "cpu"]
    command += ["--max-turns", "1", "--max-new-tokens", "256", "--memory-tokens", "8"]
    command += ["--max-batch", "1"]  # questions wait for each other: time for clients to leave
    url = f"http://127.0.0.1:{port}"
    with running(command, f"{url}/health", own_index / "agent.log", _env(), 120):
        yield url


def pending(url: str) -> int:
    return int(httpx.get(f"{url}/health", timeout=10).json()["pending"])


def wait_for(condition: Callable[[], bool], seconds: float = 5) -> bool:
    """Whether ``condition()`` holds within ``seconds``, asked every 50 ms."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_questions_whose_clients_left_free_their_places(agent: str) -> None:
    socks = [send_request(agent, "/v1/answer", {"question": f"Who {i}?"}) for i in range(8)]
    assert wait_for(lambda: pending(agent) == 8)
    for sock in socks:
        sock.close()
    assert wait_for(lambda: pending(agent) == 0, 1), f"{pending(agent)} still pending"


# -- searches the server refuses, in a rollout --------------------------------------------------


def ask_for(queries: dict[str, str]) -> Reply:
    """A scripted policy: search once with the query named for the question, then answer."""

    def reply(prompt: str, params: SamplingParams) -> str:
        if "</memory>" in params.stop:
            return "<memory> noted </memory>"
        if "<memory> noted </memory>" in prompt:
            return "<think> done </think>\n\\boxed{Paris}"
        (query,) = [q for question, q in queries.items() if question in prompt]
        call = json.dumps({"name": "wikipedia_search", "arguments": {"query": query}})
        return f"<think> search </think>\n<tool_call>{call}</tool_call>"

    return reply


def episodes_and_model(queries: dict[str, str]) -> tuple[list[Episode], ScriptedLLM]:
    tokenizer = load_tokenizer(str(embedded_model_path()))
    examples = [QAExample(f"q{i}", q, ("Paris",)) for i, q in enumerate(queries)]
    config = AgentConfig(max_turns=3, max_new_tokens=2048)  # room for a 5,000-character query
    episodes = start_episodes("memsearcher", examples, tokenizer, config)
    return episodes, ScriptedLLM(tokenizer, ask_for(queries))


def roll_out(url: str, queries: dict[str, str]) -> list[Trajectory]:
    """One lockstep round of the memsearcher agent over HTTP, as train_grpo runs it."""
    episodes, llm = episodes_and_model(queries)
    with HTTPRetriever(url, retries=0) as retriever:
        return run_lockstep(episodes, llm, retriever, SamplingParams())


async def drive_async(url: str, queries: dict[str, str]) -> list[Trajectory]:
    """The same round through the async episode loop (run_async, veRL) and the async client."""
    episodes, llm = episodes_and_model(queries)

    async def generate(request: Generate) -> Completion:
        params = SamplingParams(max_new_tokens=request.max_new_tokens, stop=request.stop)
        return llm.generate([request.prompt_ids], params)[0]

    async with AsyncHTTPRetriever(url, retries=0) as retriever:

        async def search(request: Search) -> list[Hit]:
            return (await retriever.search([request.query], request.top_n))[0]

        return [await drive(episode, generate, search) for episode in episodes]


def test_an_over_long_query_is_cut_to_the_servers_limit(retriever: str) -> None:
    queries = {f"Question {i}?": "landmarks of the city" for i in range(3)}
    queries["Question 3?"] = "landmarks " * 500  # 5,000 characters: over max_query_chars
    trajectories = roll_out(retriever, queries)
    assert [t.end_reason for t in trajectories] == ["answer"] * 4
    assert all(t.turns[0].hits for t in trajectories)


def test_a_refused_search_ends_only_its_own_episode(own_index: Path) -> None:
    # answers over 1,000 bytes are refused: 'landmarks' finds 5 passages, 'zzqxv' none
    with serve_retriever(own_index, "--max-response-bytes", "1000") as url:
        queries = {"Question 0?": "zzqxv", "Question 1?": "landmarks of the city"}
        trajectories = roll_out(url, queries)
    assert [t.end_reason for t in trajectories] == ["answer", "search_error"]
    assert "max_response_bytes" in (trajectories[1].error or "")
    rewards = torch.tensor([trajectory_reward(t) for t in trajectories])
    assert rewards.tolist() == [1.0, 0.0]
    assert rollout_metrics(trajectories, rewards)["rollout/search_error"] == 0.5


def test_a_refused_search_ends_only_its_own_episode_in_the_async_loop(own_index: Path) -> None:
    with serve_retriever(own_index, "--max-response-bytes", "1000") as url:
        queries = {"Question 0?": "zzqxv", "Question 1?": "landmarks of the city"}
        trajectories = asyncio.run(drive_async(url, queries))
    assert [t.end_reason for t in trajectories] == ["answer", "search_error"]


# -- requests refused before any app sees them ---------------------------------------------------


def answer_to(url: str, raw: bytes) -> bytes:
    """What the server sends back to ``raw`` until it closes, or 5 s pass (then: what came)."""
    with connect(url) as sock:
        sock.sendall(raw)
        return until_closed(sock, 5)[0]


def test_an_upload_over_the_limit_is_refused_before_it_starts(retriever: str) -> None:
    head = "POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    raw = f"{head}content-length: 1000000000\r\nexpect: 100-continue\r\n\r\n".encode()
    answer = answer_to(retriever, raw)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]  # no "100 Continue" first
    assert b"application/json" in answer and b"over 1048576 bytes" in answer


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n",
        # a head still unfinished past h11's 16 KiB: sent in one piece here, trickled in the wild
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nx-big: " + b"a" * 70_000,
    ],
    ids=["request line", "two Host headers", "oversized header"],
)
def test_requests_the_parser_refuses_get_json(retriever: str, raw: bytes) -> None:
    answer = answer_to(retriever, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head.lower(), answer[:300]
    assert "detail" in json.loads(body)
