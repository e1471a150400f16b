"""The demo's SFT step on a CPU: where its time goes, and the levers measured side by side.

The data are the demo's own: its world from ``--seed``, its tokenizer and from-scratch Llama
(the init model: a step costs the same whatever the weights), ``--worlds`` renamed copies
(the demo reads 6; the sequences are alike) and the imperfect teacher's trajectories of both
agents through the real agents and BM25 index, as `memsearcher.demo.pipeline.run_demo` builds
them. Then, in one run, variants alternate ``--repeats`` times and each reports the median
seconds of a step as a ratio to the first:

- ``trainer``: `train_sft` itself at the demo's settings (`sft_config`), ``--steps`` updates,
  time/step from its metrics.jsonl (the first step left out), fp32 and ``model.autocast``;
- ``step``: the trainer's step alone (its micro-batches, `sequence_logprobs`, the masked sum,
  clipping and AdamW), each variant on a copy of the same model and the same draws: fp32,
  bf16 autocast, the decoder under `torch.compile`, and the step's 32 sequences as one padded
  micro-batch instead of length buckets;
- threads: each variant again under ``torch.set_num_threads(1)``.

``--profile`` prints the top ops by self CPU time of one fp32 step and one bf16 step.

    nice -n 5 python benchmarks/sft_step.py [--seed 0] [--worlds 2] [--steps 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from memsearcher.agent import Templates, run_lockstep, start_episodes
from memsearcher.data.flashrag import read_examples
from memsearcher.data.synthetic import generate_world, rename_world, write_world
from memsearcher.demo.copying import copy_sequences, fact_lookups, question_lookups
from memsearcher.demo.model import save_demo_model
from memsearcher.demo.pipeline import PRESETS, sft_config
from memsearcher.demo.templates import DEMO_TEMPLATES, tokenizer_texts
from memsearcher.llm import load_tokenizer
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.bm25 import BM25Index, build_bm25
from memsearcher.rl.batching import MicroBatch, collate, plan_micro_batches, sequence_logprobs
from memsearcher.rl.config import ModelConfig
from memsearcher.rl.seeding import draw
from memsearcher.rl.train_sft import read_trajectories, train_sft
from memsearcher.teach.oracle import AGENTS, oracle_policy
from memsearcher.types import TokenSequence

DEMO = PRESETS["full"]


def demo_sft_data(work: Path, seed: int, worlds: int) -> tuple[Path, Path]:
    """The demo's init model and teacher trajectories (``worlds`` renamed copies) in ``work``."""
    world = generate_world(replace(DEMO.world, seed=seed))
    model = save_demo_model(work / "init", tokenizer_texts(world), DEMO.model, seed, world.names)
    tokenizer = load_tokenizer(str(model))
    templates = Templates(**DEMO_TEMPLATES)
    data = work / "trajectories.jsonl"
    with data.open("w", encoding="utf-8") as lines:
        for copy_number in range(worlds):
            files = write_world(rename_world(world, copy_number), work / f"world-{copy_number}")
            index = build_bm25(files["corpus"], work / f"world-{copy_number}" / "index")
            questions = read_examples(files["train"])
            flaws = replace(DEMO.flaws, seed=seed)
            teacher = ScriptedLLM(tokenizer, oracle_policy(questions, flaws))
            for agent in AGENTS:
                episodes = start_episodes(agent, questions, tokenizer, DEMO.agent, templates)
                for t in run_lockstep(episodes, teacher, index, SamplingParams()):
                    lines.write(json.dumps(t.to_dict()) + "\n")
    return model, data


def trainable(data: Path) -> list[TokenSequence]:
    """The sequences `train_sft` trains on (well-formed trajectories, a loss mask with a 1)."""
    return [
        s for t in read_trajectories(data) if t.well_formed for s in t.sequences if any(s.loss_mask)
    ]


def step_batches(
    sequences: list[TokenSequence],
    step: int,
    pad_id: int,
    seed: int,
    one_batch: bool,
    per_step: int = DEMO.sft_sequences_per_step,
) -> list[MicroBatch]:
    """Step ``step``'s micro-batches as `train_sft` plans them, or its draw as one batch."""
    chosen = draw(len(sequences), (step - 1) * per_step, per_step, seed)
    if one_batch:
        return [collate(sequences, chosen, pad_id)]
    lengths = [len(s.input_ids) for s in sequences]
    budget = sft_config(DEMO, Path(), Path(), Path(), seed).micro_batch_tokens
    plans = plan_micro_batches(lengths, budget, [[i] for i in chosen])
    return [collate(sequences, plan, pad_id) for plan in plans]


class Learner:
    """A model and its AdamW, stepped as `train_sft` steps them (loss, clipping, optimizer)."""

    def __init__(self, model: Any, compute: str | None, compiled: bool) -> None:
        self.model = copy.deepcopy(model)
        if compiled:  # the decoder only: the output layer's pre-hook stays eager
            self.model.model.compile(dynamic=True)
        self.compute = compute
        optim = sft_config(DEMO, Path(), Path(), Path(), 0).optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay
        )
        self.max_grad_norm = optim.max_grad_norm

    def step(self, batches: list[MicroBatch]) -> float:
        tokens = sum(float(b.loss_mask.sum()) for b in batches)
        nll = 0.0
        for batch in batches:
            logprobs = sequence_logprobs(self.model, batch, 1.0, self.compute)
            loss = -(logprobs * batch.loss_mask).sum() / tokens
            loss.backward()
            nll += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return nll


def threads(count: int, run: Callable[[], float]) -> float:
    """``run()`` under ``count`` intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return run()
    finally:
        torch.set_num_threads(before)


def side_by_side(
    variants: dict[str, Callable[[], float]], rounds: int
) -> dict[str, tuple[float, float]]:
    """Per variant, the median of what its ``run()`` returns (seconds a step) and the median
    over rounds of its ratio to the first variant's seconds in the same round; the variants
    alternate within each of ``rounds``, so load from other work falls on all of them alike."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            seconds[name].append(run())
    first = next(iter(seconds.values()))
    return {
        name: (
            statistics.median(values),
            statistics.median(f / v for f, v in zip(first, values, strict=True)),
        )
        for name, values in seconds.items()
    }


def report(title: str, results: dict[str, tuple[float, float]], tokens: float) -> None:
    print(f"\n{title} (median s a step; speed-up: median of per-round ratios to the first row)")
    for name, (seconds, ratio) in results.items():
        print(f"  {name:34s} {seconds:6.3f} s  {ratio:5.2f}x  {tokens / seconds:8.0f} tokens/s")
    sys.stdout.flush()


def trainer_seconds(
    model: Path, data: Path, work: Path, steps: int, seed: int, **fields: Any
) -> Callable[[], float]:
    """A `train_sft` run at the demo's settings with ``fields`` of its ModelConfig; returns
    a function that runs it again into a fresh folder and returns its median time/step."""

    def run() -> float:
        config = sft_config(replace(DEMO, sft_steps=steps), data, model, work, seed)
        config = replace(
            config,
            output_dir=tempfile.mkdtemp(prefix="sft-", dir=work),
            model=ModelConfig(path=str(model), device="cpu", **fields),
        )
        train_sft(config)
        rows = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").open()]
        return statistics.median([r["time/step"] for r in rows if "time/step" in r][1:])

    return run


def step_seconds(
    learner: Learner, draws: list[list[MicroBatch]], per: float = 1.0
) -> Callable[[], float]:
    """A function that steps ``learner`` on the next of ``draws`` (cycling) and returns the
    seconds it took, divided by ``per``."""
    turn = iter(range(10**9))

    def run() -> float:
        batches = draws[next(turn) % len(draws)]
        start = time.perf_counter()
        learner.step(batches)
        return (time.perf_counter() - start) / per

    return run


def profile(learner: Learner, batches: list[MicroBatch], rows: int) -> None:
    """Top ops by self CPU time of one step of ``learner``, after one step to warm up."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    learner.step(batches)
    with profiler(activities=[ProfilerActivity.CPU]) as prof:
        learner.step(batches)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"\nprofile: compute={learner.compute}, {len(batches)} micro-batches, "
          f"{total / 1e6:.3f} s of self CPU time")  # fmt: skip
    for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:rows]:
        share = event.self_cpu_time_total / total
        print(f"  {event.key[:44]:44s} {share:6.1%} {event.count:6d} calls")


def copy_rows(work: Path, seed: int, worlds: int, count: int) -> list[tuple[list[int], list[int]]]:
    """``count`` of the demo's copy warm-up sequences (names, question entities and facts out
    of retrieved passages, as `run_demo` mixes them), from the demo model's tokenizer."""
    from transformers import AutoTokenizer

    world = generate_world(replace(DEMO.world, seed=seed))
    renamed = [rename_world(world, k) for k in range(worlds)]
    facts = []
    for k, copy_world in enumerate(renamed):
        index = BM25Index.load(work / f"world-{k}" / "index")
        facts += fact_lookups(copy_world, index, DEMO.agent.top_n)
    tokenizer = AutoTokenizer.from_pretrained(work / "init")
    lookups = [question_lookups(renamed), facts]
    return copy_sequences(tokenizer, world.names, count, seed, lookups=lookups)


def warm_up_step(model: Any, optimizer: Any, rows: list[tuple[list[int], list[int]]], pad: int):
    """One update of `warm_up_copying`'s own loop (its body, copied): right-padded rows, the
    HF loss over every position, clipping at 1."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor(
        [
            [t if m else -100 for t, m in zip(ids, mask, strict=True)] + [-100] * (width - len(ids))
            for ids, mask in rows
        ]
    )
    loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def as_sequences(rows: list[tuple[list[int], list[int]]]) -> list[TokenSequence]:
    """Copy rows as turn sequences: the prompt up to the reply, the reply trained."""
    return [
        TokenSequence(tuple(ids[: m.index(1)]), tuple(ids[m.index(1) :]), tuple(m[m.index(1) :]))
        for ids, m in rows
    ]


def copy_warm_up(base: Any, work: Path, args: argparse.Namespace, pad: int) -> None:
    """The copy warm-up's own loop against the SFT trainer's step on the same rows."""
    batch = 32  # `warm_up_copying`'s default, as the demo runs it
    rows = copy_rows(work, args.seed, args.worlds, batch * args.steps)
    draws = [rows[k * batch : (k + 1) * batch] for k in range(args.steps)]
    sequences = as_sequences(rows)
    budget = sft_config(DEMO, Path(), Path(), Path(), args.seed).micro_batch_tokens
    bucketed = [
        [collate(sequences, plan, pad) for plan in plan_micro_batches(
            [len(s.input_ids) for s in sequences], budget,
            [[i] for i in range(k * batch, (k + 1) * batch)])]
        for k in range(args.steps)
    ]  # fmt: skip
    padded = sum(len(d) * max(len(ids) for ids, _ in d) for d in draws) / len(draws)
    real = sum(len(ids) for ids, _ in rows) / len(draws)
    ours = statistics.median(sum(b.padded_tokens for b in d) for d in bucketed)
    print(
        f"\ncopy warm-up: {real:.0f} real tokens a step; its loop pads them to {padded:.0f}, "
        f"the trainer's buckets to {ours:.0f}"
    )
    own = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(own.parameters(), lr=1e-3, weight_decay=0.0)
    turn = iter(range(10**9))

    def own_loop() -> float:
        rows = draws[next(turn) % len(draws)]
        start = time.perf_counter()
        warm_up_step(own, optimizer, rows, pad)
        return time.perf_counter() - start

    variants = {
        "its own loop (HF loss, padded)": own_loop,
        "the SFT trainer's step": step_seconds(Learner(base, None, False), bucketed),
    }
    report("copy warm-up", side_by_side(variants, args.repeats * args.steps), real)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worlds", type=int, default=2, help="renamed copies (the demo: 6)")
    parser.add_argument("--steps", type=int, default=6, help="steps a variant a round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of alternation")
    parser.add_argument("--work", type=Path, help="keep the data here (default: a temp dir)")
    parser.add_argument(
        "--variants",
        default="trainer,step,bf16,threads,copy",
        help="comma-separated, of: trainer (train_sft itself), step (fp32, buckets or one batch), "
        "bf16, threads, compile, larger (64 sequences a step), copy (the copy warm-up)",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    variants_wanted = set(args.variants.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)

    work = args.work or Path(tempfile.mkdtemp())
    work.mkdir(parents=True, exist_ok=True)
    begun = time.perf_counter()
    if (work / "trajectories.jsonl").is_file():
        model, data = work / "init", work / "trajectories.jsonl"
    else:
        model, data = demo_sft_data(work, args.seed, args.worlds)
    sequences = trainable(data)
    lengths = sorted(len(s.input_ids) for s in sequences)
    print(
        f"{len(sequences)} sequences of {args.worlds} renamed copies (lengths {lengths[0]}.."
        f"{lengths[-1]}, median {lengths[len(lengths) // 2]}), built in "
        f"{time.perf_counter() - begun:.0f} s; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}"
    )

    from transformers import AutoModelForCausalLM, AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(model).pad_token_id
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    base.train()
    steps = range(2, args.steps + 2)
    bucketed = [step_batches(sequences, s, pad_id, args.seed, False) for s in steps]
    padded = [step_batches(sequences, s, pad_id, args.seed, True) for s in steps]
    tokens = statistics.median(sum(b.padded_tokens for b in d) for d in bucketed)
    print(
        f"a step: {statistics.median(len(d) for d in bucketed)} micro-batches, "
        f"{tokens:.0f} padded tokens bucketed, "
        f"{statistics.median(padded[k][0].padded_tokens for k in range(len(padded)))} as one"
    )

    if args.profile:
        for compute in (None, "bfloat16"):
            profile(Learner(base, compute, False), bucketed[0], 18)

    if "trainer" in variants_wanted:
        trainer = {
            "train_sft fp32": trainer_seconds(model, data, work, args.steps + 1, args.seed),
            "train_sft autocast bf16": trainer_seconds(
                model, data, work, args.steps + 1, args.seed, autocast="bfloat16"
            ),
        }
        report("train_sft at the demo's settings", side_by_side(trainer, args.repeats), tokens)

    if variants_wanted & {"step", "bf16", "threads", "compile", "larger"}:
        learners = {
            "fp32, buckets (the trainer)": (Learner(base, None, False), bucketed),
            "fp32, one padded batch": (Learner(base, None, False), padded),
        }
        if "bf16" in variants_wanted:
            learners["bf16 autocast, buckets"] = (Learner(base, "bfloat16", False), bucketed)
            learners["bf16 autocast, one padded batch"] = (Learner(base, "bfloat16", False), padded)
        if "compile" in variants_wanted:
            learners["fp32 compiled, buckets"] = (Learner(base, None, True), bucketed)
            learners["fp32 compiled, one padded batch"] = (Learner(base, None, True), padded)
        for name, (learner, draws) in learners.items():  # warm-up: the compile happens here
            start = time.perf_counter()
            for batches in draws:
                learner.step(batches)
            print(f"warm-up of {name}: {time.perf_counter() - start:.1f} s for {len(draws)} steps")
        variants = {name: step_seconds(*pair) for name, pair in learners.items()}
        if "larger" in variants_wanted:  # fewer, larger steps: the same sequences' seconds
            per_step = 2 * DEMO.sft_sequences_per_step
            draws = [step_batches(sequences, s, pad_id, args.seed, False, per_step) for s in steps]
            learner = Learner(base, None, False)
            learner.step(draws[0])
            name = f"fp32, buckets, {per_step} sequences a step (s per 32)"
            variants[name] = step_seconds(learner, draws, per_step / DEMO.sft_sequences_per_step)
        if "threads" in variants_wanted:
            for name in ("fp32, buckets (the trainer)", "fp32, one padded batch"):
                run = step_seconds(*learners[name])
                variants[f"{name}, 1 thread"] = lambda run=run: threads(1, run)
        rounds = args.repeats * args.steps
        report("the trainer's step alone", side_by_side(variants, rounds), tokens)
    if "copy" in variants_wanted:
        copy_warm_up(base, work, args, pad_id)


if __name__ == "__main__":
    main()
