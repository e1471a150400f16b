"""The answer cache (`memsearcher.retrieval.cache`) on a real BM25 index, in process and behind
the real retrieval server on 127.0.0.1."""

from __future__ import annotations

import os
import sys
from typing import Any

import httpx
import pytest
from _servers import free_port, running
from _wrappers import CountingRetriever

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.replay import search_then_answer
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval import CachedRetriever, Retriever, open_retriever, with_cache
from memsearcher.retrieval.bm25 import BM25Index, build_bm25
from memsearcher.retrieval.corpus import write_corpus
from memsearcher.retrieval.embedded import embedded_passages
from memsearcher.rl.config import GRPOConfig
from memsearcher.types import QAExample

FIRST = "Stanley Kubrick science fiction film"
LATER = ["Eiffel Tower", "capital of Japan", "Amazon river", "Mount Everest height"]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> BM25Index:
    root = tmp_path_factory.mktemp("cached")
    write_corpus(root / "corpus.jsonl", embedded_passages()[:2000])
    return build_bm25(root / "corpus.jsonl", root / "index")


def test_answers_equal_the_index_s(index: BM25Index) -> None:
    cached = CachedRetriever(index, capacity=64)
    queries = [FIRST] * 5 + LATER + [FIRST, LATER[0]]
    for top_n in (1, 3, 5, 3):
        assert cached.search(queries, top_n) == index.search(queries, top_n)
        assert cached.search(queries, top_n) == index.search(queries, top_n)  # from the cache


def test_a_group_s_repeated_query_is_searched_once(index: BM25Index) -> None:
    backend = CountingRetriever(index)
    cached = CachedRetriever(backend, capacity=64)
    group = [FIRST] * 5 + [LATER[0]] * 5  # two questions, G=5, everyone's first query alike
    cached.search(group, 3)
    assert backend.batches == [[FIRST, LATER[0]]]
    assert cached.stats() == {"size": 2, "capacity": 64, "hits": 8, "misses": 2}
    cached.search([LATER[1], FIRST, LATER[1]], 3)  # the next round: one new query
    assert backend.batches[1:] == [[LATER[1]]]
    cached.search(group, 3)
    assert len(backend.batches) == 2  # all answered from the cache
    assert cached.stats() == {"size": 3, "capacity": 64, "hits": 20, "misses": 3}


def test_top_n_is_part_of_the_key(index: BM25Index) -> None:
    backend = CountingRetriever(index)
    cached = CachedRetriever(backend, capacity=64)
    three = cached.search([FIRST], 3)[0]
    five = cached.search([FIRST], 5)[0]
    assert len(three) == 3 and len(five) == 5
    assert five == index.search([FIRST], 5)[0]
    assert len(backend.batches) == 2


def test_the_least_recently_used_answer_goes_first(index: BM25Index) -> None:
    backend = CountingRetriever(index)
    cached = CachedRetriever(backend, capacity=2)
    a, b, c = LATER[:3]
    cached.search([a], 2)
    cached.search([b], 2)
    cached.search([a], 2)  # a is now the most recent; b the least
    cached.search([c], 2)  # over capacity: b goes
    assert cached.stats()["size"] == 2
    calls = len(backend.batches)
    cached.search([a, c], 2)
    assert len(backend.batches) == calls  # both still held
    cached.search([b], 2)
    assert backend.batches[-1] == [b]  # b was evicted and is searched again
    assert cached.stats() == {"size": 2, "capacity": 2, "hits": 3, "misses": 4}


def test_a_batch_larger_than_the_capacity_still_answers_all(index: BM25Index) -> None:
    cached = CachedRetriever(index, capacity=2)
    assert cached.search(LATER, 2) == index.search(LATER, 2)
    assert cached.stats()["size"] == 2


def test_callers_cannot_change_a_cached_answer(index: BM25Index) -> None:
    cached = CachedRetriever(index, capacity=8)
    first = cached.search([FIRST, FIRST], 3)
    first[0].clear()
    first[1].reverse()
    assert cached.search([FIRST], 3) == index.search([FIRST], 3)


def test_capacity_zero_means_no_wrapper(index: BM25Index) -> None:
    assert with_cache(index, 0) is index
    assert isinstance(open_retriever(str(index.folder), cache_size=3), CachedRetriever)
    assert isinstance(open_retriever(str(index.folder)), BM25Index)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="capacity"):
            CachedRetriever(index, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="one string"):
        CachedRetriever(index).search(FIRST, 3)  # one string for a batch
    with pytest.raises(ValueError, match="retriever_cache"):
        GRPOConfig(retriever_cache=-1)
    assert GRPOConfig(retriever_cache=0).retriever_cache == 0


def test_server_health_shows_the_cache(index: BM25Index, tmp_path: Any) -> None:
    port = free_port()
    env = {**os.environ, "MEMSEARCHER_HOME": str(tmp_path / "home")}
    command = [sys.executable, "-m", "memsearcher.cli", "retriever", "serve"]
    command += ["--index", str(index.folder), "--port", str(port), "--cache-size", "2"]
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with (
        running(command, f"{url}/health", log, env, timeout=60),
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        assert http.get("/health").json()["cache"] == {
            "size": 0, "capacity": 2, "hits": 0, "misses": 0
        }  # fmt: skip
        queries = [FIRST, FIRST, LATER[0]]
        body = http.post("/batch_search", json={"query": queries, "top_n": 3}).json()
        assert [[d["id"] for d in docs] for docs in body] == [
            [h.id for h in hits] for hits in index.search(queries, 3)
        ]
        cache = http.get("/health").json()["cache"]
        assert cache == {"size": 2, "capacity": 2, "hits": 1, "misses": 2}
        http.post("/search", json={"query": LATER[1], "top_n": 3})
        http.post("/search", json={"query": FIRST, "top_n": 3})  # evicted by LATER[1]
        health = http.get("/health").json()
        assert health["cache"] == {"size": 2, "capacity": 2, "hits": 1, "misses": 4}
        assert health["limits"]["cache_size"] == 2


def test_server_without_a_cache(index: BM25Index) -> None:
    from fastapi.testclient import TestClient

    from memsearcher.retrieval.server import ServerConfig, create_app

    backend = CountingRetriever(index)
    with TestClient(create_app(backend, ServerConfig(cache_size=0))) as client:
        client.post("/batch_search", json={"query": [FIRST, FIRST], "top_n": 2})
        assert client.get("/health").json()["cache"] == {"capacity": 0}
    assert backend.batches == [[FIRST, FIRST]]


def test_a_run_from_before_the_cache_resumes_and_may_change_its_size() -> None:
    from memsearcher.config import changed_keys, config_to_dict
    from memsearcher.rl.checkpoint import FREE_ON_RESUME

    current = config_to_dict(GRPOConfig(retriever_cache=16))
    older = {k: v for k, v in current.items() if k != "retriever_cache"}
    for saved in (older, config_to_dict(GRPOConfig())):
        assert changed_keys(saved, current) == ["retriever_cache"]
        assert "retriever_cache" in FREE_ON_RESUME  # the answers are the same at any size


def test_a_lockstep_grpo_group_gets_the_same_trajectories_from_fewer_searches(
    llm: HFModel, retriever: Retriever
) -> None:
    questions = [
        QAExample("q1", "Who wrote Hamlet?", ("William Shakespeare",)),
        QAExample("q2", "Who painted the Mona Lisa?", ("Leonardo da Vinci",)),
    ]
    group = [q for q in questions for _ in range(4)]  # G = 4, adjacent as in roll_out
    runs = {}
    for cache in (0, 64):
        counting = CountingRetriever(retriever)
        episodes = start_episodes("memsearcher", group, llm.tokenizer, AgentConfig())
        scripted = ScriptedLLM(llm.tokenizer, search_then_answer(searches=2, answer="x"))
        trajectories = run_lockstep(
            episodes, scripted, with_cache(counting, cache), SamplingParams()
        )
        runs[cache] = ([t.to_dict() for t in trajectories], counting.batches)
    assert runs[64][0] == runs[0][0]
    assert [len(b) for b in runs[0][1]] == [8, 8]  # every sample's query, each round
    assert [len(b) for b in runs[64][1]] == [2, 2]  # one search per distinct query
