"""The real retrieval server, started by the CLI in a subprocess on 127.0.0.1.

Every endpoint with the request and response shapes of DESIGN section 7, bad input answered
with a 4xx JSON reason (each followed by a good request, to show the server still serves), a
fuzz test, a concurrent load test, and the HTTP client against the same server.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _servers import free_port, running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memsearcher.retrieval import open_retriever
from memsearcher.retrieval.bm25 import BM25Index, build_bm25
from memsearcher.retrieval.client import AsyncHTTPRetriever, HTTPRetriever, RetrievalServerError
from memsearcher.retrieval.corpus import write_corpus
from memsearcher.retrieval.embedded import embedded_passages
from memsearcher.types import Hit

QUERY = "Stanley Kubrick science fiction film"


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> BM25Index:
    root = tmp_path_factory.mktemp("served")
    write_corpus(root / "corpus.jsonl", embedded_passages()[:2000])
    return build_bm25(root / "corpus.jsonl", root / "index")


@pytest.fixture(scope="module")
def server(index: BM25Index, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("log") / "server.log"
    env = {**os.environ, "MEMSEARCHER_HOME": str(index.folder.parent / "home")}
    command = [sys.executable, "-m", "memsearcher.cli", "retriever", "serve"]
    command += ["--index", str(index.folder), "--port", str(port), "--max-top-n", "50"]
    with running(command, f"http://127.0.0.1:{port}/health", log, env, timeout=60):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=30) as client:
        yield client


def assert_serving(http: httpx.Client) -> None:
    response = http.post("/search", json={"query": QUERY, "top_n": 2})
    assert response.status_code == 200
    assert len(response.json()) == 2


def assert_doc(doc: Any) -> None:
    assert isinstance(doc, dict) and set(doc) == {"id", "contents"}
    assert isinstance(doc["id"], str) and doc["contents"].startswith('"')
    assert "\n" in doc["contents"]


def test_health(http: httpx.Client, index: BM25Index) -> None:
    body = http.get("/health").json()
    assert body["status"] == "ok" and body["kind"] == "bm25"
    assert body["passages"] == len(index)


def test_search(http: httpx.Client, index: BM25Index) -> None:
    docs = http.post("/search", json={"query": QUERY}).json()
    assert isinstance(docs, list) and len(docs) == 5  # top_n defaults to 5
    for doc in docs:
        assert_doc(doc)
    assert docs[0]["contents"].startswith('"2001: A Space Odyssey"\n')
    expected = index.search([QUERY], 3)[0]
    body = http.post("/search", json={"query": QUERY, "top_n": 3, "return_score": True}).json()
    docs, scores = body
    assert [d["id"] for d in docs] == [h.id for h in expected]
    assert scores == pytest.approx([h.score for h in expected])
    # MemSearcher posts the tool call's arguments as they are; unknown keys are ignored
    assert http.post("/search", json={"query": QUERY, "top_n": 1, "x": 1}).status_code == 200


def test_batch_search(http: httpx.Client) -> None:
    queries = [QUERY, "Eiffel Tower", "capital of Japan"]
    lists = http.post("/batch_search", json={"query": queries, "top_n": 4}).json()
    assert len(lists) == 3 and all(1 <= len(docs) <= 4 for docs in lists)
    assert len(lists[0]) == 4
    for docs in lists:
        for doc in docs:
            assert_doc(doc)
    docs, scores = http.post(
        "/batch_search", json={"query": queries, "top_n": 2, "return_score": True}
    ).json()
    assert len(docs) == len(scores) == 3
    assert all(len(s) == 2 and s[0] >= s[1] for s in scores)
    assert [d["id"] for d in docs[0]] == [d["id"] for d in lists[0][:2]]


def test_retrieve(http: httpx.Client) -> None:
    body = http.post("/retrieve", json={"queries": [QUERY, "Eiffel Tower"]}).json()
    assert set(body) == {"result"} and len(body["result"]) == 2
    for results in body["result"]:
        assert len(results) == 3  # Search-R1's topk defaults to 3
        for item in results:
            assert set(item) == {"document", "score"} and isinstance(item["score"], float)
            assert_doc(item["document"])
    plain = http.post(
        "/retrieve", json={"queries": [QUERY], "topk": 2, "return_scores": False}
    ).json()
    for doc in plain["result"][0]:
        assert_doc(doc)


def test_openapi_lists_exactly_the_endpoints(http: httpx.Client) -> None:
    schema = http.get("/openapi.json").json()
    assert set(schema["paths"]) == {"/search", "/batch_search", "/retrieve", "/health"}
    # /docs loads its scripts from a CDN, which an offline user cannot reach: off unless --docs
    assert http.get("/docs").status_code == 404 and http.get("/redoc").status_code == 404


BAD_JSON: list[tuple[str, Any]] = [
    ("/search", {"query": ""}),
    ("/search", {"query": "   \n\t"}),
    ("/search", {"query": 42}),
    ("/search", {"query": None}),
    ("/search", {"query": ["a list"]}),
    ("/search", {}),
    ("/search", {"top_n": 3}),
    ("/search", {"query": "x", "top_n": -1}),
    ("/search", {"query": "x", "top_n": 0}),
    ("/search", {"query": "x", "top_n": 10**12}),
    ("/search", {"query": "x", "top_n": 51}),
    ("/search", {"query": "x", "top_n": "many"}),
    ("/search", {"query": "x", "top_n": 2.5}),
    ("/search", {"query": "x" * 5000}),
    ("/search", []),
    ("/search", None),
    ("/search", "just a string"),
    ("/batch_search", {"query": []}),
    ("/batch_search", {"query": "not a list"}),
    ("/batch_search", {"query": ["fine", ""]}),
    ("/batch_search", {"query": ["fine", 7]}),
    ("/batch_search", {"query": ["q"] * 513}),
    ("/retrieve", {"queries": []}),
    ("/retrieve", {"queries": [None]}),
    ("/retrieve", {"query": ["wrong field name"]}),
    ("/retrieve", {"queries": ["x"], "topk": -5}),
    # loose types are refused, not coerced
    ("/search", {"query": "x", "top_n": "5"}),
    ("/search", {"query": "x", "top_n": True}),
    ("/search", {"query": "x", "top_n": 5.0}),
    ("/search", {"query": "x", "return_score": "yes"}),
    ("/search", {"query": "x", "return_score": 1}),
    ("/batch_search", {"query": ["x"], "top_n": "2"}),
    ("/retrieve", {"queries": ["x"], "topk": "3"}),
    ("/retrieve", {"queries": ["x"], "return_scores": "no"}),
]


@pytest.mark.parametrize(("path", "payload"), BAD_JSON)
def test_bad_json_gets_4xx(http: httpx.Client, path: str, payload: Any) -> None:
    response = http.post(path, json=payload)
    assert 400 <= response.status_code < 500, response.text
    assert "detail" in response.json()
    assert_serving(http)


JSON = {"content-type": "application/json"}
BAD_BODIES: list[tuple[str, bytes, dict[str, str], int]] = [
    ("invalid JSON", b'{"query": "x",', JSON, 422),
    ("not JSON at all", b"hello", JSON, 422),
    ("NaN top_n", b'{"query": "x", "top_n": NaN}', JSON, 422),
    ("1e400 top_n", b'{"query": "x", "top_n": 1e400}', JSON, 422),
    ("nested 100k deep", b'{"query": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON, 400),
    ("non-UTF-8", b'{"query": "caf\xe9"}', JSON, 400),
    ("UTF-16", '{"query": "x"}'.encode("utf-16"), JSON, 400),
    ("text/plain", b'{"query": "x"}', {"content-type": "text/plain"}, 415),
    ("form", b"query=x", {"content-type": "application/x-www-form-urlencoded"}, 415),
    ("no content type", b'{"query": "x"}', {}, 415),
    ("10 MB", b'{"query": "' + b"a" * 10_000_000 + b'"}', JSON, 413),
]


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
def test_bad_bodies_get_4xx(
    http: httpx.Client, body: bytes, headers: dict[str, str], status: int
) -> None:
    response = http.post("/search", content=body, headers=headers)
    assert response.status_code == status, response.text
    assert "detail" in response.json()
    assert_serving(http)


def test_truncated_json_says_where_it_broke(http: httpx.Client) -> None:
    response = http.post("/search", content=b'{"query": "x", "top_n": ', headers=JSON)
    (error,) = response.json()["detail"]
    assert response.status_code == 422
    assert error["msg"] == "not valid JSON: Expecting value (at character 24)"


def test_only_loopback_names_reach_a_loopback_server(http: httpx.Client, server: str) -> None:
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.nip.io", ""):
        response = http.get("/health", headers={"host": host})
        assert response.status_code == 421, host
        assert "bound to loopback" in response.json()["detail"]
    port = server.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        assert http.get("/health", headers={"host": host}).status_code == 200, host


def test_wrong_method_and_path(http: httpx.Client) -> None:
    assert http.get("/search").status_code == 405
    assert http.post("/nowhere", json={"query": "x"}).status_code == 404
    assert_serving(http)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
payloads = st.fixed_dictionaries(
    {},
    optional={
        "query": json_values | st.text() | st.lists(st.text(), max_size=4),
        "queries": json_values | st.lists(st.text(), max_size=4),
        "top_n": json_values | st.integers(-5, 200),
        "topk": json_values | st.integers(-5, 200),
        "return_score": json_values,
        "return_scores": json_values,
    },
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(path=st.sampled_from(["/search", "/batch_search", "/retrieve"]), payload=payloads)
def test_fuzzed_requests_never_500(http: httpx.Client, path: str, payload: Any) -> None:
    response = http.post(path, json=payload)
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text
    response.json()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.binary(max_size=300))
def test_fuzzed_bytes_never_500(http: httpx.Client, body: bytes) -> None:
    response = http.post("/batch_search", content=body, headers=JSON)
    assert 400 <= response.status_code < 500 or response.status_code == 200, response.text
    response.json()


@pytest.mark.slow
def test_concurrent_clients(server: str) -> None:
    """32 clients, 2,000 requests over all three search endpoints: no errors, bounded time."""
    clients, total = 32, 2000
    deadline = time.monotonic() + 240
    errors: list[str] = []
    done = [0] * clients
    requests = [
        ("/search", {"query": QUERY, "top_n": 3}),
        ("/batch_search", {"query": ["Eiffel Tower", "jazz music"], "top_n": 2}),
        ("/retrieve", {"queries": ["capital of Japan"], "topk": 3}),
    ]

    def worker(k: int) -> None:
        with httpx.Client(base_url=server, timeout=60) as client:
            for i in range(k, total, clients):
                if time.monotonic() > deadline:
                    errors.append("deadline passed")
                    return
                path, payload = requests[i % len(requests)]
                try:
                    response = client.post(path, json=payload)
                    if response.status_code != 200 or not response.json():
                        errors.append(f"{path}: HTTP {response.status_code}")
                except httpx.HTTPError as error:
                    errors.append(f"{path}: {error!r}")
                done[k] += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert sum(done) == total


def test_client_matches_index(server: str, index: BM25Index) -> None:
    queries = [QUERY, "Eiffel Tower", "  ", "capital of Japan"]
    with HTTPRetriever(server) as client:
        remote = client.search(queries, 4)
        assert client.health()["kind"] == "bm25"
    local = index.search(queries, 4)
    assert remote[2] == []
    for mine, theirs in zip(remote, local, strict=True):
        assert [(h.id, h.title, h.text) for h in mine] == [(h.id, h.title, h.text) for h in theirs]
        assert [h.score for h in mine] == pytest.approx([h.score for h in theirs])
    retriever = open_retriever(f"{server}/search")  # an endpoint URL works too
    assert isinstance(retriever, HTTPRetriever) and retriever.url == server
    assert retriever.search([QUERY], 1)[0][0].title == "2001: A Space Odyssey"


def test_client_errors(server: str) -> None:
    with HTTPRetriever(server) as client, pytest.raises(RetrievalServerError, match="422"):
        client.search([QUERY], 51)  # over the server's --max-top-n
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    client = HTTPRetriever(dead, retries=2, backoff=0.05)
    with client, pytest.raises(RetrievalServerError, match="unreachable after 3 tries"):
        client.search([QUERY], 3)
    assert time.monotonic() - started < 10


def test_async_client(server: str, index: BM25Index) -> None:
    queries = [[QUERY], ["Eiffel Tower", ""], ["capital of Japan"]] * 10

    async def run() -> list[list[list[Any]]]:
        async with AsyncHTTPRetriever(server, max_queries=1) as client:
            assert (await client.health())["status"] == "ok"
            return await asyncio.gather(*(client.search(q, 3) for q in queries))

    for batch, results in zip(queries, asyncio.run(run()), strict=True):
        assert [[h.id for h in hits] for hits in results] == [
            [h.id for h in hits] for hits in index.search(batch, 3)
        ]

    async def dead() -> None:
        async with AsyncHTTPRetriever(f"http://127.0.0.1:{free_port()}", retries=1) as client:
            await client.search([QUERY], 3)

    with pytest.raises(RetrievalServerError, match="unreachable after 2 tries"):
        asyncio.run(dead())


def test_client_large_batches_are_split(server: str, index: BM25Index) -> None:
    queries = [f"{QUERY} {i}" for i in range(30)]
    with HTTPRetriever(server, max_queries=7) as client:
        assert len(client.search(queries, 1)) == 30


def test_serve_rejects_bad_setups(tmp_path: Path, index: BM25Index) -> None:
    from memsearcher.cli import main

    assert main(["retriever", "serve", "--index", str(tmp_path / "nope")]) == 2
    assert main(["retriever", "serve", "--index", str(index.folder), "--nprobe", "4"]) == 2


class Recording:
    """A retriever that records each call's batch, is slow, and fails on one query."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def search(self, queries: Any, top_n: int) -> list[list[Hit]]:
        if "boom" in queries:
            raise RuntimeError("index on fire")
        self.calls.append(len(queries))
        time.sleep(0.05)
        return [[Hit(str(i), "T", q, 1.0)] for i, q in enumerate(queries)]


def test_concurrent_requests_are_batched_and_failures_contained() -> None:
    from fastapi.testclient import TestClient

    from memsearcher.retrieval.server import create_app

    retriever = Recording()
    with TestClient(create_app(retriever), raise_server_exceptions=False) as client:
        failed = client.post("/search", json={"query": "boom"})
        assert failed.status_code == 500  # an index fault, not bad input
        assert failed.json() == {"detail": "internal error: RuntimeError"}  # JSON, not text
        answers: list[Any] = []

        def ask(i: int) -> None:
            answers.append(client.post("/search", json={"query": f"q{i}", "top_n": 1}).json())

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    assert sorted(a[0]["contents"] for a in answers) == sorted(f'"T"\nq{i}' for i in range(16))
    assert sum(retriever.calls) == 16 and max(retriever.calls) > 1  # merged into fewer calls


class Gated:
    """A real index whose searches wait until ``open`` is set, so that requests pile up, and
    that fails on a query holding "boom" (faults injected by hand: a real index has neither)."""

    def __init__(self, inner: BM25Index) -> None:
        self.inner = inner
        self.open = threading.Event()
        self.calls: list[int] = []

    def search(self, queries: Any, top_n: int) -> list[list[Hit]]:
        assert self.open.wait(30)
        self.calls.append(len(queries))
        if any("boom" in q for q in queries):
            raise RuntimeError("index on fire")
        return self.inner.search(queries, top_n)


def test_pending_queries_are_bounded_with_503(index: BM25Index) -> None:
    from fastapi.testclient import TestClient

    from memsearcher.retrieval.server import ServerConfig, create_app

    gated = Gated(index)
    config = ServerConfig(max_queries=8, max_pending_queries=10)
    statuses: list[int] = []
    with TestClient(create_app(gated, config), raise_server_exceptions=False) as client:

        def ask(n: int) -> None:
            response = client.post("/batch_search", json={"query": [QUERY] * n, "top_n": 1})
            statuses.append(response.status_code)

        first = threading.Thread(target=ask, args=(8,))
        first.start()
        batcher = client.app.state.batcher  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while batcher.pending < 8:  # the first request is in, held by the index
            assert time.monotonic() < deadline
            time.sleep(0.01)
        busy = client.post("/batch_search", json={"query": [QUERY] * 3, "top_n": 1})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert "busy" in busy.json()["detail"]
        gated.open.set()
        first.join(30)
        assert client.post("/batch_search", json={"query": [QUERY] * 8}).status_code == 200
    assert statuses == [200]


def test_a_failing_request_does_not_fail_the_requests_merged_with_it(index: BM25Index) -> None:
    from fastapi.testclient import TestClient

    from memsearcher.retrieval.server import create_app

    gated = Gated(index)
    answers: dict[str, int] = {}
    with TestClient(create_app(gated), raise_server_exceptions=False) as client:

        def ask(query: str) -> None:
            answers[query] = client.post("/search", json={"query": query}).status_code

        threads = [threading.Thread(target=ask, args=(q,)) for q in ("warm", "a", "boom", "b")]
        threads[0].start()
        time.sleep(0.5)  # the first search holds the worker; the others queue behind it
        for thread in threads[1:]:
            thread.start()
        time.sleep(0.5)
        gated.open.set()
        for thread in threads:
            thread.join(30)
    assert answers == {"warm": 200, "a": 200, "boom": 500, "b": 200}
    assert gated.calls[:2] == [1, 3]  # merged, failed, then one by one
