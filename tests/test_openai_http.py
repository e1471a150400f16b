"""The OpenAI-compatible HTTP backend and the async driver, against a real server on 127.0.0.1:
llama-cpp-python's OpenAI server (``llama_cpp.server``) serving the embedded SmolLM2 GGUF on the
CPU. That server takes text prompts only and strips stop strings without saying so, which is the
hardest case for the backend's mapping back onto token ids.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _servers import free_port, running

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.async_driver import run_async
from memsearcher.cli import main
from memsearcher.eval.predictions import read_predictions
from memsearcher.llm.base import Completion, SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.llm.openai_http import (
    OpenAIHTTPError,
    OpenAIHTTPModel,
    parse_chatml,
    to_completion,
)
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.base import Retriever
from memsearcher.retrieval.client import AsyncHTTPRetriever
from memsearcher.types import QAExample

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python[server] is not installed (scripts/setup.sh installs it)",
)


def test_parse_chatml_by_hand() -> None:
    text = (
        "<|im_start|>system\nYou search.<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n"
        "<|im_start|>assistant\n<think>x</think><|im_end|>\n<|im_start|>user\n"
        "<tool_response>d</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert parse_chatml(text) == [
        {"role": "system", "content": "You search."},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "<think>x</think>"},
        {"role": "user", "content": "<tool_response>d</tool_response>"},
    ]
    with pytest.raises(OpenAIHTTPError, match="ChatML"):
        parse_chatml("[INST] hi [/INST]")


def test_choices_map_onto_the_completion_contract(llm: HFModel) -> None:
    """Hand-written choices in the shapes vLLM and llama-cpp-python answer with."""
    tok = llm.tokenizer
    eos = min(tok.eos_token_ids)
    stop = SamplingParams(stop=("</tool_call>",))
    call = '<think>x</think><tool_call>{"name": "s"}</tool_call>'
    body = call[: -len("</tool_call>")]
    ids = tok.encode(call)
    # vLLM: token ids and the kept stop string
    vllm = {"text": call, "finish_reason": "stop", "stop_reason": "</tool_call>", "token_ids": ids}
    assert to_completion(vllm, {}, stop, call, tok) == Completion(tuple(ids), "stop")
    # vLLM, stopped by EOS: token ids already end with it, or get it
    natural = {"text": "hi", "finish_reason": "stop", "stop_reason": None}
    assert to_completion(
        {**natural, "token_ids": [*tok.encode("hi"), eos]}, {}, stop, "hi", tok
    ) == (Completion((*tok.encode("hi"), eos), "stop"))
    assert to_completion(natural, {}, stop, "hi", tok) == Completion(
        (*tok.encode("hi"), eos), "stop"
    )
    # a server that kept the stop string but sent no ids: text cut right after it
    kept = {"text": call + " more", "finish_reason": "stop"}
    assert to_completion(kept, {}, stop, call + " more", tok).token_ids == tuple(ids)
    # llama-cpp-python: stop string stripped, no stop_reason, usage counts its tokens
    stripped = {"text": body, "finish_reason": "stop"}
    usage = {"completion_tokens": len(ids)}
    assert to_completion(stripped, usage, stop, body, tok) == Completion(tuple(ids), "stop")
    # ... and stopped by EOS (not counted): the stop string is not made up
    usage = {"completion_tokens": len(tok.encode(body))}
    assert to_completion(stripped, usage, stop, body, tok).token_ids[-1] == eos
    # llama-cpp-python with logprobs: the token pieces still hold the stop string
    pieces = {**stripped, "logprobs": {"tokens": ["<think>x</think>", call[16:] + " more"]}}
    assert to_completion(pieces, {}, stop, body, tok) == Completion(tuple(ids), "stop")
    # cut by the budget
    cut = to_completion({"text": body, "finish_reason": "length"}, {}, stop, body, tok)
    assert cut == Completion(tuple(tok.encode(body)), "length")


def test_unreachable_server_is_a_clear_error(llm: HFModel) -> None:
    with pytest.raises(OpenAIHTTPError, match="cannot reach"):
        OpenAIHTTPModel(f"http://127.0.0.1:{free_port()}/v1", llm.tokenizer, retries=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from memsearcher.llm.embedded import packaged_gguf

    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(packaged_gguf())]
    command += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048"]
    command += ["--n_threads", "1", "--model_alias", "smollm2"]
    # one token per forward pass: llama.cpp's logits depend on how a prompt is split into
    # batches, and its prefix cache splits the same prompt differently depending on what came
    # before (a repeated prompt replays its last token alone). "Name a color." then decodes
    # "The color ..." or "Alec 2: ..." greedily, by request order. Single-token batches make
    # greedy decoding independent of the cache, at no measurable cost on this model.
    command += ["--n_batch", "1", "--n_ubatch", "1"]
    log = tmp_path_factory.mktemp("llama") / "server.log"
    url = f"http://127.0.0.1:{port}/v1"
    with running(command, f"{url}/models", log, {**os.environ, "OMP_NUM_THREADS": "1"}):
        yield url


@pytest.fixture(scope="module")
def search_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The retrieval server on the embedded BM25 index."""
    port = free_port()
    command = [sys.executable, "-m", "memsearcher.cli", "retriever", "serve", "--port", str(port)]
    log = tmp_path_factory.mktemp("retriever") / "server.log"
    url = f"http://127.0.0.1:{port}"
    with running(command, f"{url}/health", log, dict(os.environ)):
        yield url


@pytest.fixture
def remote(server: str, llm: HFModel) -> OpenAIHTTPModel:
    return OpenAIHTTPModel(server, llm.tokenizer, concurrency=4)


def prompt(llm: HFModel, text: str) -> list[int]:
    chat = [{"role": "user", "content": text}]
    return llm.tokenizer.encode(llm.tokenizer.render_chat(chat, add_generation_prompt=True))


@pytest.mark.slow
@needs_llama_cpp
def test_completions_map_back_to_the_completion_contract(
    remote: OpenAIHTTPModel, llm: HFModel
) -> None:
    assert remote.model == "smollm2"
    eos = llm.tokenizer.eos_token_ids
    say_hi = prompt(llm, "Say hello.")
    # stopped by itself: ends with EOS, no stop string
    (done,) = remote.generate([say_hi], SamplingParams(max_new_tokens=64))
    if done.finish_reason == "stop":
        assert done.token_ids[-1] in eos
    # cut by the budget
    (cut,) = remote.generate([say_hi], SamplingParams(max_new_tokens=3))
    assert cut.finish_reason == "length" and 1 <= len(cut.token_ids) <= 4
    # a stop string the server strips comes back, once, at the end
    (stopped,) = remote.generate([say_hi], SamplingParams(max_new_tokens=64, stop=("e",)))
    text = llm.tokenizer.decode(stopped.token_ids)
    assert stopped.finish_reason == "stop" and text.endswith("e") and text.count("e") == 1
    assert not remote.token_prompts  # llama-cpp-python refused token ids; text was sent
    # greedy decoding is reproducible, and a batch keeps its order
    questions = [prompt(llm, q) for q in ("Name a color.", "Name a fruit.", "Say hello.")]
    params = SamplingParams(max_new_tokens=8)
    first, second = remote.generate(questions, params), remote.generate(questions, params)
    assert first == second
    assert first[2].token_ids[:3] == cut.token_ids[:3]


@pytest.mark.slow
@needs_llama_cpp
def test_chat_mode(server: str, llm: HFModel) -> None:
    chat = OpenAIHTTPModel(server, llm.tokenizer, api="chat")
    (completion,) = chat.generate([prompt(llm, "Say hello.")], SamplingParams(max_new_tokens=6))
    assert completion.finish_reason in ("stop", "length") and completion.token_ids


@pytest.mark.slow
@needs_llama_cpp
def test_async_driver_matches_lockstep_over_http(
    remote: OpenAIHTTPModel, retriever: Retriever
) -> None:
    examples = [
        QAExample("a", "Who wrote Hamlet?", ("Shakespeare",)),
        QAExample("b", "What is the capital of France?", ("Paris",)),
        QAExample("c", "Which planet is red?", ("Mars",)),
    ]
    config = AgentConfig(max_turns=2, max_new_tokens=32, memory_tokens=32)
    sampling = SamplingParams()  # greedy: the drivers must agree
    tokenizer, limit = remote.tokenizer, remote.max_context_tokens

    def episodes() -> list:
        return start_episodes("memsearcher", examples, tokenizer, config, None, limit)

    finished: list[int] = []

    async def run() -> list:
        try:
            return await run_async(
                episodes(), remote, retriever, sampling, 2, lambda i, _: finished.append(i)
            )
        finally:
            await remote.aclose()

    concurrent = asyncio.run(run())
    lockstep = run_lockstep(episodes(), remote, retriever, sampling)
    assert sorted(finished) == [0, 1, 2]
    assert [t.example.id for t in concurrent] == ["a", "b", "c"]
    assert [t.turns for t in concurrent] == [t.turns for t in lockstep]


class AsyncScripted:
    """A protocol-following policy (see llm/scripted.py), so that every episode searches: the
    untrained model rarely does. Searches go to the real retrieval server."""

    def __init__(self, llm: HFModel) -> None:
        def reply(prompt: str, params: SamplingParams) -> str:
            if params.stop == ("</memory>",):
                return "<memory>Hamlet is a play by Shakespeare.</memory>"
            if "Hamlet is a play" in prompt:
                return "<think>known</think> \\boxed{Shakespeare}"
            call = {"name": "wikipedia_search", "arguments": {"query": "Hamlet play"}}
            return f"<think>search</think><tool_call>{json.dumps(call)}</tool_call>"

        self.scripted = ScriptedLLM(llm.tokenizer, reply)
        self.tokenizer, self.max_context_tokens = llm.tokenizer, llm.max_context_tokens

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        await asyncio.sleep(0)
        return self.scripted.generate([prompt_ids], params)[0]


@pytest.mark.slow
def test_async_driver_awaits_the_retrieval_server(search_server: str, llm: HFModel) -> None:
    examples = [QAExample(str(i), "Who wrote Hamlet?", ("Shakespeare",)) for i in range(6)]
    config = AgentConfig(max_turns=3)
    episodes = start_episodes("memsearcher", examples, llm.tokenizer, config)

    async def run() -> list:
        async with AsyncHTTPRetriever(search_server) as searcher:
            return await run_async(episodes, AsyncScripted(llm), searcher, SamplingParams(), 3)

    trajectories = asyncio.run(run())
    for trajectory in trajectories:
        assert trajectory.answer == "Shakespeare" and trajectory.num_searches == 1
        assert len(trajectory.turns[0].hits) == config.top_n
        assert any("Hamlet" in hit.title + hit.text for hit in trajectory.turns[0].hits)


@pytest.mark.slow
@needs_llama_cpp
def test_eval_cli_over_http(server: str, search_server: str, tmp_path: Path) -> None:
    """Model and retriever both behind HTTP: every search and generation is concurrent."""
    data = tmp_path / "bamboogle" / "test.jsonl"
    data.parent.mkdir()
    rows = [
        {"id": "1", "question": "Who wrote Hamlet?", "golden_answers": ["Shakespeare"]},
        {"id": "2", "question": "What is the capital of France?", "golden_answers": ["Paris"]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "run"
    args = ["eval", "--data", str(tmp_path), "--out", str(out), "--backend", "openai"]
    args += ["--base-url", server, "--max-turns", "2", "--max-new-tokens", "32"]
    args += ["--memory-tokens", "32", "--concurrency", "2", "--no-progress"]
    args += ["--retriever", search_server, "--max-context", "2048"]
    assert main(args) == 0
    records = read_predictions(out / "bamboogle" / "predictions.jsonl")
    assert sorted(r["id"] for r in records) == ["1", "2"]
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["settings"]["backend"] == "openai"
    assert summary["settings"]["retriever"] == search_server
    assert summary["datasets"]["bamboogle"]["questions"] == 2


@pytest.mark.slow
@needs_llama_cpp
def test_serve_over_an_http_model(server: str, tmp_path: Path) -> None:
    """memsearcher serve --backend openai: each question is its own task on the model server."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    port = free_port()
    command = [sys.executable, "-m", "memsearcher.cli", "serve", "--port", str(port)]
    command += ["--backend", "openai", "--base-url", server, "--max-turns", "2"]
    command += ["--max-new-tokens", "24", "--memory-tokens", "24"]
    url = f"http://127.0.0.1:{port}"
    with running(command, f"{url}/health", tmp_path / "serve.log", dict(os.environ)):

        def ask(question: str) -> httpx.Response:
            return httpx.post(f"{url}/v1/answer", json={"question": question}, timeout=300)

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, ["Who wrote Hamlet?", "Where is Paris?", "Why?"]))
        for response in answers:
            assert response.status_code == 200, response.text
            assert response.json()["turns"] >= 1
        assert httpx.post(f"{url}/v1/answer", json={"question": ""}).status_code == 422


@pytest.mark.slow
@needs_llama_cpp
def test_requests_are_retried_while_the_server_restarts(llm: HFModel, tmp_path: Path) -> None:
    """The server goes away between two calls and comes back on the same port a little later:
    the second call waits through refused connections (retries with backoff) and succeeds."""
    import subprocess
    import threading
    import time

    from memsearcher.llm.embedded import packaged_gguf

    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(packaged_gguf())]
    command += ["--host", "127.0.0.1", "--port", str(port), "--n_threads", "1"]
    url = f"http://127.0.0.1:{port}/v1"
    params = SamplingParams(max_new_tokens=2)
    with running(command, f"{url}/models", tmp_path / "first.log", dict(os.environ)):
        remote = OpenAIHTTPModel(url, llm.tokenizer, retries=20, backoff=0.5, max_backoff=2.0)
        assert remote.generate([prompt(llm, "Hi.")], params)[0].token_ids
    restarted: list[subprocess.Popen] = []

    def restart() -> None:
        time.sleep(1.5)
        log = (tmp_path / "second.log").open("w")
        restarted.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))

    thread = threading.Thread(target=restart)
    thread.start()
    try:
        (completion,) = remote.generate([prompt(llm, "Hi.")], params)
        assert completion.token_ids
    finally:
        thread.join()
        for process in restarted:
            process.terminate()
            process.wait(timeout=15)
