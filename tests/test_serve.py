"""The agent API, started by the CLI (`memsearcher serve`) on 127.0.0.1 with the embedded model
and BM25 index: answers with trajectories, 4xx JSON for bad requests (each followed by a good
request, to show the server still answers), a fuzz test, the bound on pending questions, and
both streamed forms (read with the official ``openai`` client for chat completions)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from _servers import free_port, running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

MAX_PENDING = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "memsearcher.cli", "serve", "--port", str(port)]
    command += ["--max-turns", "2", "--max-new-tokens", "24", "--memory-tokens", "24"]
    command += ["--max-pending", str(MAX_PENDING), "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with running(command, f"{url}/health", log, env):
        yield url


@pytest.fixture
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


def assert_still_answers(http: httpx.Client) -> None:
    response = http.get("/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_answer_returns_the_trajectory(http: httpx.Client) -> None:
    response = http.post("/v1/answer", json={"question": "Who wrote Hamlet?", "max_turns": 1})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) >= {"answer", "end_reason", "error", "turns", "searches", "trajectory"}
    trajectory = body["trajectory"]
    assert trajectory["example"]["question"] == "Who wrote Hamlet?"
    assert "sequences" not in trajectory
    assert body["turns"] == len(trajectory["turns"]) <= 1
    assert (body["answer"] is None) == (body["end_reason"] != "answer")
    with_tokens = http.post("/v1/answer", json={"question": "Who wrote Hamlet?", "max_turns": 1,
                                                "include_tokens": True}).json()  # fmt: skip
    assert with_tokens["trajectory"]["sequences"][0]["prompt_ids"]
    # greedy decoding: the same question gets the same answer
    assert with_tokens["trajectory"]["turns"] == trajectory["turns"]


def test_chat_completions(http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "ignored"}, {"role": "user", "content": "Who?"}]
    response = http.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(body["choices"][0]["message"]["content"], str)
    assert body["usage"]["prompt_tokens"] > 0
    assert http.get("/v1/models").json()["data"][0]["id"] == "memsearcher"


@pytest.mark.parametrize(
    ("path", "payload", "status"),
    [
        ("/v1/answer", {}, 422),
        ("/v1/answer", {"question": ""}, 422),
        ("/v1/answer", {"question": "   "}, 422),
        ("/v1/answer", {"question": 7}, 422),
        ("/v1/answer", {"question": ["a", "b"]}, 422),
        ("/v1/answer", {"question": "x" * 2001}, 422),
        ("/v1/answer", {"question": "q?", "max_turns": 0}, 422),
        ("/v1/answer", {"question": "q?", "max_turns": 3}, 422),  # over the server's 2
        ("/v1/answer", {"question": "q?", "top_n": 1000}, 422),
        ("/v1/answer", {"question": "q?", "surprise": 1}, 422),
        ("/v1/answer", [1, 2], 422),
        ("/v1/chat/completions", {"messages": []}, 422),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "q"}], "stream_options": {}},
            422,
        ),  # stream_options without stream
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "q"}], "stream": "yes"},
            422,
        ),  # fmt: skip
        ("/v1/answer", {"question": "q?", "stream": 1}, 422),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": "q"}]}, 422),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "q"}]}, 422),
    ],
)
def test_bad_requests_get_4xx_json(
    http: httpx.Client, path: str, payload: Any, status: int
) -> None:
    response = http.post(path, json=payload)
    assert response.status_code == status, response.text
    assert "detail" in response.json()
    assert_still_answers(http)


def test_bad_bodies_get_4xx_json(http: httpx.Client) -> None:
    cases = [
        (b"{not json", {"content-type": "application/json"}, 422),
        (b'{"question": "\xff"}', {"content-type": "application/json"}, 400),
        (b"question=hi", {"content-type": "application/x-www-form-urlencoded"}, 415),
        (b'{"question": "' + b"a" * 70_000 + b'"}', {"content-type": "application/json"}, 413),
    ]
    for body, headers, status in cases:
        response = http.post("/v1/answer", content=body, headers=headers)
        assert response.status_code == status, response.text
        assert "detail" in response.json()
    assert http.get("/v1/nothing").status_code == 404
    assert http.get("/v1/answer").status_code == 405
    assert_still_answers(http)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.one_of(
        st.dictionaries(st.text(max_size=8), st.none() | st.integers() | st.text(max_size=8)),
        st.lists(st.integers(), max_size=3),
        st.integers(),
        st.text(max_size=20),
    ).filter(lambda p: not (isinstance(p, dict) and isinstance(p.get("question"), str)))
)
def test_fuzzed_payloads_never_crash_the_server(http: httpx.Client, payload: Any) -> None:
    response = http.post("/v1/answer", json=payload)
    assert 400 <= response.status_code < 500
    assert "detail" in response.json()


def test_pending_questions_are_bounded(server: str, http: httpx.Client) -> None:
    def ask(i: int) -> int:
        with httpx.Client(base_url=server, timeout=300) as client:
            question = {"question": f"What is the number {i}?", "max_turns": 1}
            return client.post("/v1/answer", json=question).status_code

    with ThreadPoolExecutor(MAX_PENDING + 3) as pool:
        statuses = list(pool.map(ask, range(MAX_PENDING + 3)))
    assert statuses.count(503) >= 1 and statuses.count(200) >= 1
    assert set(statuses) <= {200, 503}
    assert http.post("/v1/answer", json={"question": "Who?", "max_turns": 1}).status_code == 200


# -- streaming ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def roomy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Budgets the embedded model answers in (a search, a memory, then the answer), and one
    question at a time: a stream lasts long enough for its client to leave mid-way."""
    port = free_port()
    command = [sys.executable, "-m", "memsearcher.cli", "serve", "--port", str(port)]
    command += ["--max-turns", "2", "--max-new-tokens", "64", "--memory-tokens", "48"]
    command += ["--max-pending", str(MAX_PENDING), "--max-batch", "1", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path_factory.mktemp("serve") / "roomy.log"
    url = f"http://127.0.0.1:{port}"
    with running(command, f"{url}/health", log, env):
        yield url


def openai_client(url: str) -> openai.OpenAI:
    # no retries: a 503 must reach the test, not be retried away
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)


def test_chat_stream_assembles_the_plain_answer(roomy_server: str) -> None:
    client = openai_client(roomy_server)
    messages: Any = [{"role": "user", "content": "Who painted The Starry Night?"}]
    plain = client.chat.completions.create(model="memsearcher", messages=messages)
    stream = client.chat.completions.create(
        model="memsearcher", messages=messages, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    *with_choices, last = chunks
    assert last.choices == [] and last.usage == plain.usage  # greedy: the same trajectory
    assert all(c.usage is None and len(c.choices) == 1 for c in with_choices)
    deltas = [c.choices[0].delta for c in with_choices]
    assert deltas[0].role == "assistant" and not deltas[0].content
    finish = [c.choices[0].finish_reason for c in with_choices]
    assert finish[-1] == plain.choices[0].finish_reason == "stop" and not any(finish[:-1])
    reasoning = [(d.model_extra or {}).get("reasoning_content") for d in deltas]
    thinking = [i for i, text in enumerate(reasoning) if text]
    answer = [i for i, d in enumerate(deltas) if d.content]
    assert "".join(deltas[i].content or "" for i in answer) == plain.choices[0].message.content
    # a reasoning delta a turn, every one before the answer
    assert len(thinking) == (plain.model_extra or {})["memsearcher"]["turns"] >= 1
    assert answer and max(thinking) < min(answer)
    assert reasoning[thinking[0]].startswith("Turn 1 (context ")


def test_answer_stream_ends_with_the_plain_result(http: httpx.Client) -> None:
    question = {"question": "Who wrote Hamlet?", "max_turns": 2}
    plain = http.post("/v1/answer", json=question).json()
    with http.stream("POST", "/v1/answer", json={**question, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/x-ndjson"
        events = [json.loads(line) for line in response.iter_lines() if line]
    *turns, result = events
    for body in (plain, result["result"]):
        body["trajectory"]["example"].pop("id")  # a fresh id a request
    assert result == {"event": "result", "result": plain}
    assert [e["event"] for e in turns] == ["turn"] * plain["turns"]
    assert [e["turn"] for e in turns] == plain["trajectory"]["turns"]


def pending(url: str) -> int:
    return int(httpx.get(f"{url}/health", timeout=30).json()["pending"])


def test_clients_that_hang_up_mid_stream_free_their_places(roomy_server: str) -> None:
    client = openai_client(roomy_server)
    messages: Any = [{"role": "user", "content": "Who painted The Starry Night?"}]
    streams = [
        client.chat.completions.create(model="memsearcher", messages=messages, stream=True)
        for _ in range(MAX_PENDING)
    ]
    for stream in streams:
        assert next(iter(stream)).choices[0].delta.role == "assistant"
    assert pending(roomy_server) == MAX_PENDING  # one on the model, one waiting for it
    # a full server says so before any stream starts
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="memsearcher", messages=messages, stream=True)
    assert refused.value.status_code == 503 and "detail" in refused.value.response.json()
    for stream in streams:
        stream.close()
    deadline = time.monotonic() + 5
    while pending(roomy_server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pending(roomy_server) == 0
