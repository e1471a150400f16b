"""Learner throughput and padding: length-bucketed micro-batches against naive padded batches.

The sequences are real agent turn sequences: the replay policy (a random number of searches
per question, 0 to 4) drives MemSearcher and ReAct through the real embedded tokenizer and BM25
index, so lengths vary as in training (flat MemSearcher turns, growing ReAct conversations).
Both layouts run the same forward and backward pass (`sequence_logprobs`, then a masked sum)
over the same sequences with the same number of micro-batches; the naive one takes sequences
in rollout order, as a plain padded DataLoader would. Reported: padding share of processed
tokens, and real (non-pad) tokens per second, best of ``--repeats``.

Then the shared prompt prefix (``share_prefix``): the same micro-batches planned within each
agent (whose sequences share a system prompt), run whole and with the prefix computed once per
micro-batch, side by side; the ratio of their times is printed. Real tokens count every row's
prompt, so both rows report the same work.

Last, the bucketed layout again under bfloat16 autocast (``model.autocast: bfloat16``, the
trainers' key), in the same run: the ratio to float32 says what a CPU's bf16 units (AVX-512
BF16, AMX) give the learner; on a CPU without them it is no faster. ``--lora 16`` trains a
rank-16 LoRA instead of every weight, loaded as the embedded agent's recipe loads its policy
(`load_policy`, on the targets of ``configs/embedded-agent.yaml``), and
``--rows`` times only the rows named (the 135M model's full set takes an hour on two cores).

    python benchmarks/learner.py [--questions 24] [--budget 6144] [--model embedded|tiny]
        [--lora 16] [--rows bucketed,bfloat16]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.replay import search_then_answer
from memsearcher.config import load_config
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFTokenizer
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.recipe.config import RecipeConfig
from memsearcher.retrieval import load_embedded_retriever
from memsearcher.rl.batching import (
    MicroBatch,
    collate,
    padding_share,
    plan_micro_batches,
    sequence_logprobs,
)
from memsearcher.rl.distributed import init_runtime
from memsearcher.rl.policy import load_policy, resolve_precision
from memsearcher.types import QAExample, TokenSequence

RECIPE = Path(__file__).parent.parent / "configs" / "embedded-agent.yaml"


def agent_sequences(tokenizer: HFTokenizer, questions: int, seed: int) -> list[TokenSequence]:
    rng = random.Random(seed)
    retriever = load_embedded_retriever()
    config = AgentConfig(max_turns=5, memory_tokens=256, max_new_tokens=128, top_n=3)
    sequences: list[TokenSequence] = []
    for agent in ("memsearcher", "react"):
        for i in range(questions):
            searches = rng.randint(0, 4)
            example = QAExample(str(i), f"Who founded the city number {i}?", ("x",))
            llm = ScriptedLLM(tokenizer, search_then_answer(searches, "x", memory_words=60))
            episodes = start_episodes(agent, [example], tokenizer, config)
            (trajectory,) = run_lockstep(episodes, llm, retriever, SamplingParams())
            sequences += trajectory.sequences
    rng.shuffle(sequences)  # rollout order interleaves agents and turn counts
    return sequences


ROWS = ("bucketed", "naive", "by-agent", "shared", "bfloat16")
"""The layouts timed: bucketed, naive and per-agent micro-batches in float32, the per-agent ones
with the prefix shared, and the bucketed ones under bfloat16 autocast."""


def time_pass(
    model: torch.nn.Module, batches: list[MicroBatch], repeats: int, compute: str | None = None
) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in batches:
            logprobs = sequence_logprobs(model, batch, compute=compute)
            (logprobs * batch.loss_mask).sum().backward()
        model.zero_grad(set_to_none=True)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=24, help="per agent")
    parser.add_argument("--budget", type=int, default=6144, help="padded tokens per micro-batch")
    parser.add_argument("--model", choices=["embedded", "tiny"], default="tiny")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank; 0: train every weight")
    parser.add_argument(
        "--rows", default=",".join(ROWS), help="comma-separated, of " + ",".join(ROWS)
    )
    args = parser.parse_args(argv)
    wanted = args.rows.split(",")
    if unknown := set(wanted) - set(ROWS):
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memsearcher.llm.embedded import embedded_model_path

    folder = embedded_model_path()
    if args.model == "tiny":
        sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
        from tiny_model import save_tiny_model

        folder = save_tiny_model(Path(tempfile.mkdtemp()) / "tiny", hidden=128, layers=4)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if args.lora:  # loaded as the recipe loads its policy, so the rows time what it trains
        recipe = load_config(RecipeConfig, RECIPE)
        config = replace(recipe.grpo.model, path=str(folder), lora_rank=args.lora,
                         lora_alpha=2 * args.lora, device="cpu")  # fmt: skip
        model, _ = load_policy(config, init_runtime("cpu"), resolve_precision(config, "cpu"))
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    sequences = agent_sequences(HFTokenizer(tokenizer), args.questions, args.seed)
    lengths = [len(s.input_ids) for s in sequences]
    pad = tokenizer.pad_token_id

    ours = [collate(sequences, p, pad) for p in plan_micro_batches(lengths, args.budget)]
    size = -(-len(sequences) // len(ours))  # same number of micro-batches, in rollout order
    naive = [
        collate(sequences, range(i, min(i + size, len(sequences))), pad)
        for i in range(0, len(sequences), size)
    ]
    real = sum(lengths)
    print(
        f"{len(sequences)} sequences, {real} tokens (lengths {min(lengths)}..{max(lengths)}), "
        f"{len(ours)} micro-batches, model {args.model}, LoRA rank {args.lora}, "
        f"{torch.get_num_threads()} threads"
    )
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, sequence in enumerate(sequences):
        groups.setdefault(sequence.input_ids[:64], []).append(index)
    plans = [
        plan
        for group in groups.values()
        for plan in plan_micro_batches(lengths, args.budget, [[i] for i in group])
    ]
    whole = [collate(sequences, plan, pad) for plan in plans]
    shared = [collate(sequences, plan, pad, share_prefix=True) for plan in plans]
    seconds: dict[str, float] = {}
    layouts = {"bucketed": ours, "naive": naive, "by-agent": whole, "shared": shared,
               "bfloat16": ours}  # fmt: skip
    for name in wanted:
        batches = layouts[name]
        compute = "bfloat16" if name == "bfloat16" else None
        seconds[name] = time_pass(model, batches, args.repeats, compute)
        processed = sum(b.padded_tokens for b in batches)
        print(
            f"{name:9s} padding {padding_share(batches):6.1%} of {processed} processed tokens; "
            f"{real / seconds[name]:8.0f} real tokens/s (fwd+bwd, {seconds[name]:.2f}s)"
        )
    if "shared" in seconds and "by-agent" in seconds:
        ratio = seconds["shared"] / seconds["by-agent"]
        print(f"shared prefix / whole rows (same micro-batches): {ratio:.2f}x the time")
    if "bfloat16" in seconds and "bucketed" in seconds:
        ratio = seconds["bucketed"] / seconds["bfloat16"]
        print(f"float32 / bfloat16 autocast (bucketed micro-batches): {ratio:.2f}x")


if __name__ == "__main__":
    main()
