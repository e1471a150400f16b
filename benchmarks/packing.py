"""Packed trajectories against per-turn sequences: tokens processed and learner tokens/s.

The trajectories are real agent trajectories: the replay policy (0 to 4 searches per question)
drives MemSearcher, MEM1 and ReAct through the real embedded tokenizer and BM25 index. The same
trajectories are then trained two ways, with the same forward and backward pass (log-probs of
the loss-mask-1 tokens, then a masked sum) under the same padded-token budget per micro-batch:

- per-turn: every turn sequence on its own, length-bucketed (`memsearcher.rl.batching`);
- packed: one sequence per trajectory, the shared prefix once (`memsearcher.rl.packing`), for
  each mask kind the model's attention takes (sdpa: bool and additive; eager: additive).

Reported: tokens processed (padding included), and learner tokens/s counted as the per-turn
real tokens (the work both layouts do) per second, best of ``--repeats``; ReAct trajectories
are one sequence, so packing only changes how they are padded. ``trainer/per-turn`` and
``trainer/packed`` time one GRPO update as the trainer runs it with ``learner:`` set either way
(`learner_batches`, then `accumulate_gradients`: the clipped policy loss with the KL term).

    python benchmarks/packing.py [--questions 12] [--budget 8192] [--model tiny|embedded]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.replay import search_then_answer
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFTokenizer
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval import load_embedded_retriever
from memsearcher.rl.batching import collate, plan_micro_batches, sequence_logprobs
from memsearcher.rl.packing import collate_packed, pack, packed_logprobs
from memsearcher.types import QAExample, TokenSequence


def trajectories(
    tokenizer: HFTokenizer, agent: str, questions: int, seed: int
) -> list[list[TokenSequence]]:
    rng = random.Random(seed)
    retriever = load_embedded_retriever()
    config = AgentConfig(max_turns=6, memory_tokens=256, max_new_tokens=128, top_n=3)
    out = []
    for i in range(questions):
        example = QAExample(str(i), f"Who founded the city number {i}?", ("x",))
        reply = search_then_answer(rng.randint(0, 4), "x", memory_words=60)
        (episode,) = start_episodes(agent, [example], tokenizer, config)
        llm = ScriptedLLM(tokenizer, reply)
        (trajectory,) = run_lockstep([episode], llm, retriever, SamplingParams())
        out.append(list(trajectory.sequences))
    return out


def best_time(step: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def per_turn_pass(model: torch.nn.Module, trajs: list[list[TokenSequence]], budget: int):
    flat = [s for t in trajs for s in t]
    plans = plan_micro_batches([len(s.input_ids) for s in flat], budget)
    batches = [collate(flat, plan, 0) for plan in plans]

    def step() -> None:
        for batch in batches:
            (sequence_logprobs(model, batch) * batch.loss_mask).sum().backward()
        model.zero_grad(set_to_none=True)

    return step, sum(b.padded_tokens for b in batches), len(batches)


def packed_pass(model: torch.nn.Module, trajs: list[list[TokenSequence]], budget: int, kind: str):
    packs = [pack(t) for t in trajs]
    plans = plan_micro_batches([len(p.input_ids) for p in packs], budget)
    batches = [collate_packed([packs[i] for i in plan], 0, kind) for plan in plans]

    def step() -> None:
        for batch in batches:
            sum(lp.sum() for lp in packed_logprobs(model, batch, kind=kind)).backward()
        model.zero_grad(set_to_none=True)

    return step, sum(b.padded_tokens for b in batches), len(batches)


def trainer_pass(model: torch.nn.Module, trajs: list[list[TokenSequence]], budget: int,
                 learner: str):  # fmt: skip
    """One GRPO update as `train_grpo` runs it: `learner_batches`, then
    `accumulate_gradients` (policy loss with the KL term) and a zero_grad."""
    from memsearcher.rl.config import GRPOConfig
    from memsearcher.rl.distributed import Runtime
    from memsearcher.rl.learner import accumulate_gradients, learner_batches
    from memsearcher.rl.packing import mask_kind_of

    sequences = [s for t in trajs for s in t]
    ids = torch.tensor([j for j, t in enumerate(trajs) for _ in t])
    advantages = torch.linspace(-1.0, 1.0, len(trajs))[ids]
    old = [torch.full((len(s.response_ids),), -2.0) for s in sequences]
    config = GRPOConfig(learner=learner, micro_batch_tokens=budget, beta=0.01)
    kind = mask_kind_of(model) if learner == "packed" else None
    one = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    members = list(range(len(sequences)))
    lengths = [len(s.input_ids) for s in sequences]
    batches = learner_batches(sequences, members, lengths, ids, 0, config, kind)

    def step() -> None:
        micro = learner_batches(sequences, members, lengths, ids, 0, config, kind)
        accumulate_gradients(model, micro, old, old, advantages, ids, config, one)
        model.zero_grad(set_to_none=True)

    return step, sum(b.padded_tokens for b in batches), len(batches)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=12, help="per agent")
    parser.add_argument("--budget", type=int, default=8192, help="padded tokens per micro-batch")
    parser.add_argument("--model", choices=["embedded", "tiny"], default="tiny")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--agents", default="memsearcher,mem1,react")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memsearcher.llm.embedded import embedded_model_path

    folder = embedded_model_path()
    if args.model == "tiny":
        sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
        from tiny_model import save_tiny_model

        folder = save_tiny_model(Path(tempfile.mkdtemp()) / "tiny", hidden=128, layers=4)
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(folder))
    models = {
        attention: AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation=attention
        )
        for attention in ("sdpa", "eager")
    }
    print(f"model {args.model}, {torch.get_num_threads()} threads, budget {args.budget} tokens")
    for agent in args.agents.split(","):
        trajs = trajectories(tokenizer, agent, args.questions, args.seed)
        real = sum(len(s.input_ids) for t in trajs for s in t)
        turns = sum(len(t) for t in trajs)
        print(f"\n{agent}: {len(trajs)} trajectories, {turns} turn sequences, {real} tokens")
        runs = [("per-turn", "sdpa", *per_turn_pass(models["sdpa"], trajs, args.budget))]
        for attention, kind in (("sdpa", "bool"), ("sdpa", "additive"), ("eager", "additive")):
            runs.append(
                (
                    f"packed/{kind}",
                    attention,
                    *packed_pass(models[attention], trajs, args.budget, kind),
                )
            )
        for learner in ("per-turn", "packed"):
            runs.append((f"trainer/{learner}", "sdpa",
                         *trainer_pass(models["sdpa"], trajs, args.budget, learner)))  # fmt: skip
        base = 1.0
        for name, attention, step, processed, count in runs:
            seconds = best_time(step, args.repeats)
            rate = real / seconds
            if name.endswith("per-turn"):  # each family's ratios are against its per-turn
                base = rate
            print(
                f"  {name:16s} {attention:5s} {processed:7d} tokens processed in {count:2d} "
                f"micro-batches; {rate:7.0f} tokens/s ({rate / base:.2f}x), {seconds:.2f} s"
            )


if __name__ == "__main__":
    main()
