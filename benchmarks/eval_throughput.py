"""Questions/s of the async driver over the HTTP backend against the lockstep driver.

Same model (the embedded SmolLM2-135M), same questions, same agent settings, greedy decoding:

- ``lockstep / hf``: the lockstep driver over the in-process transformers backend (batched);
- ``lockstep / http``: the lockstep driver over the OpenAI-compatible HTTP backend;
- ``async / http``: the async driver over the HTTP backend, ``--concurrency`` episodes in flight.

The server is llama-cpp-python's OpenAI server (``llama_cpp.server``) on 127.0.0.1, serving the
packaged GGUF on the CPU. It runs one request at a time (no continuous batching), so on it the
async driver can only win by overlapping searches, prompt building and HTTP round trips with
generation; on a batching server (vLLM, SGLang) in-flight requests share forward passes.

    python benchmarks/eval_throughput.py [--questions 8] [--concurrency 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.async_driver import run_async
from memsearcher.llm import load_llm
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.embedded import packaged_gguf
from memsearcher.llm.openai_http import OpenAIHTTPModel
from memsearcher.retrieval import load_embedded_retriever
from memsearcher.types import QAExample

QUESTIONS = [
    "Who wrote Hamlet?",
    "What is the capital of France?",
    "Which planet is known as the red planet?",
    "Who painted the Mona Lisa?",
    "In which country is the Amazon river?",
    "Who developed the theory of relativity?",
    "What is the largest ocean on Earth?",
    "Who was the first person to walk on the Moon?",
    "Which element has the chemical symbol O?",
    "What language is spoken in Brazil?",
    "Who composed the Fifth Symphony?",
    "What is the tallest mountain in the world?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, threads: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(packaged_gguf())]
    command += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096"]
    command += ["--n_threads", str(threads), "--model_alias", "smollm2"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit("llama_cpp.server exited; is llama-cpp-python[server] installed?")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    sys.exit("llama_cpp.server did not start in 120 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--memory-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2, help="server and torch threads")
    parser.add_argument("--agent", default="memsearcher", choices=("memsearcher", "react"))
    args = parser.parse_args()

    examples = [
        QAExample(str(i), QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS)), ("x",))
        for i in range(args.questions)
    ]
    config = AgentConfig(
        max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens,
        memory_tokens=args.memory_tokens,
    )
    sampling = SamplingParams()
    retriever = load_embedded_retriever()
    import torch

    torch.set_num_threads(args.threads)
    hf = load_llm("embedded", device="cpu")
    port = free_port()
    server = start_server(port, args.threads)
    rows = []
    try:
        http = OpenAIHTTPModel(f"http://127.0.0.1:{port}/v1", hf.tokenizer, concurrency=64)

        def episodes(llm: object) -> list:
            tokenizer, limit = hf.tokenizer, hf.max_context_tokens
            return start_episodes(args.agent, examples, tokenizer, config, None, limit)

        def timed(name: str, run: object) -> None:
            start = time.perf_counter()
            trajectories = run()  # type: ignore[operator]
            seconds = time.perf_counter() - start
            turns = sum(len(t.turns) for t in trajectories)
            rows.append((name, len(trajectories) / seconds, seconds, turns))

        async def concurrent() -> list:
            try:
                return await run_async(
                    episodes(http), http, retriever, sampling, concurrency=args.concurrency
                )
            finally:
                await http.aclose()

        http.generate([hf.tokenizer.encode("warm up")], SamplingParams(max_new_tokens=2))
        timed("lockstep / hf", lambda: run_lockstep(episodes(hf), hf, retriever, sampling))
        timed("lockstep / http", lambda: run_lockstep(episodes(http), http, retriever, sampling))
        timed(f"async / http (c={args.concurrency})", lambda: asyncio.run(concurrent()))
    finally:
        server.terminate()
        server.wait()

    print(
        f"{args.questions} questions, agent {args.agent}, max_turns {args.max_turns}, "
        f"max_new_tokens {args.max_new_tokens}, {args.threads} threads, "
        f"cpus {os.cpu_count()}"
    )
    print(f"{'driver / backend':<28} {'questions/s':>12} {'seconds':>9} {'turns':>6}")
    for name, rate, seconds, turns in rows:
        print(f"{name:<28} {rate:>12.3f} {seconds:>9.1f} {turns:>6}")


if __name__ == "__main__":
    main()
