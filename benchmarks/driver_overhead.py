"""Generated tokens/s of the lockstep driver against raw batched generation, same backend.

The driver runs the agent on the real embedded SmolLM2-135M with the real BM25 index and records
every generate call it makes (prompts and sampling params, with their seeds). The same calls are
then replayed straight into the backend (`HFModel.generate`), and into transformers'
`model.generate` on the same left-padded batches. Seeded sampling makes the driver and the
replay generate the same tokens, so the ratio isolates the driver's own cost: rendering
prompts, tokenizing, parsing, searching and bookkeeping. Runs alternate and the best of
``--repeats`` is kept, since the machine is shared.

    python benchmarks/driver_overhead.py [--questions 8] [--max-new-tokens 64] [--agent memsearcher]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.llm import load_llm
from memsearcher.llm.base import Completion, SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.retrieval import embedded_corpus_path, load_embedded_retriever, read_corpus
from memsearcher.types import QAExample


class Recorder:
    def __init__(self, llm: HFModel) -> None:
        self.llm, self.tokenizer, self.max_context_tokens = (
            llm,
            llm.tokenizer,
            llm.max_context_tokens,
        )
        self.calls: list[tuple[list[Sequence[int]], SamplingParams]] = []
        self.tokens = 0

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        self.calls.append((list(prompts), params))
        out = self.llm.generate(prompts, params)
        self.tokens += sum(len(c.token_ids) for c in out)
        return out


def run_driver(llm: HFModel, agent: str, examples: list[QAExample], config: AgentConfig):
    recorder, retriever = Recorder(llm), load_embedded_retriever()
    episodes = start_episodes(agent, examples, llm.tokenizer, config, None, llm.max_context_tokens)
    start = time.perf_counter()
    trajectories = run_lockstep(
        episodes, recorder, retriever, SamplingParams(temperature=1.0, seed=0)
    )
    return time.perf_counter() - start, recorder, trajectories


def run_backend(llm: HFModel, calls) -> tuple[float, int]:
    start, tokens = time.perf_counter(), 0
    for prompts, params in calls:
        tokens += sum(len(c.token_ids) for c in llm.generate(prompts, params))
    return time.perf_counter() - start, tokens


@torch.no_grad()
def run_transformers(llm: HFModel, calls) -> tuple[float, int]:
    """transformers' generate on the same padded batches (EOS stops rows; no stop strings)."""
    pad = llm.tokenizer.pad_token_id
    start, tokens = time.perf_counter(), 0
    for prompts, params in calls:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(params.seed)
        out = llm.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=params.max_new_tokens,
            do_sample=True,
            temperature=params.temperature,
            top_k=0,
            pad_token_id=pad,
        )
        generated = out[:, width:]
        tokens += int((generated != pad).sum()) + int((generated == pad).any(dim=1).sum())
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--agent", default="memsearcher", choices=["memsearcher", "react"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    llm = load_llm("embedded", device="cpu")
    assert isinstance(llm, HFModel)
    examples = []
    for passage in read_corpus(embedded_corpus_path()):
        examples.append(QAExample(passage.id, f"What is {passage.title} known for?", ("x",)))
        if len(examples) == args.questions:
            break
    config = AgentConfig(max_turns=3, max_new_tokens=args.max_new_tokens, memory_tokens=64)

    best: dict[str, tuple[float, int]] = {}
    for _ in range(args.repeats):
        seconds, recorder, trajectories = run_driver(llm, args.agent, examples, config)
        runs = {
            "driver": (seconds, recorder.tokens),
            "backend": run_backend(llm, recorder.calls),
            "transformers": run_transformers(llm, recorder.calls),
        }
        for name, (s, t) in runs.items():
            if name not in best or t / s > best[name][1] / best[name][0]:
                best[name] = (s, t)

    turns = sum(len(t.turns) for t in trajectories)
    print(
        f"{args.agent}, {len(examples)} questions, {len(recorder.calls)} generate calls, "
        f"{turns} turns, threads={torch.get_num_threads()}"
    )
    for name, (seconds, tokens) in best.items():
        print(f"{name:>13}: {tokens:6d} tokens in {seconds:6.2f} s = {tokens / seconds:7.1f} tok/s")
    rate = {name: t / s for name, (s, t) in best.items()}
    print(
        f"ratio driver / backend generate: {rate['driver'] / rate['backend']:.3f}  (target >= 0.85)"
    )
    print(f"ratio driver / transformers generate: {rate['driver'] / rate['transformers']:.3f}")


if __name__ == "__main__":
    main()
