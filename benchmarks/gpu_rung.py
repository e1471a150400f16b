"""The GPU rung (DESIGN.md section 9): our own multi-context GRPO trainer on a real model shape.

No weights reach the lent GPU, so the model is a randomly initialized Qwen2 built from the real
Qwen2.5-1.5B or -3B config values (`SHAPES`, tied embeddings as the real ones, vocabulary
151936), with the embedded SmolLM2 tokenizer (its 49152 ids are a subset of the model's; ids
past them decode to nothing). ``--shape tiny`` is a small Qwen2 for the CPU and the test suite.
The questions and the BM25 index are the offline demo's synthetic world (`data.synthetic`).

What the numbers are, and are not:

- **A random model does not follow the protocol.** Every rollout is one turn that writes
  ``--max-new-tokens`` of noise (an EOS is a rare draw) and ends as a format failure; rewards
  are 0, so with ``beta > 0`` the update is the KL term's only. The trainer still runs its
  whole step (rollouts, rewards, advantages, old and reference log-probs, the update, the
  checkpoint), which is what is timed: ``--steps`` steps of `train_grpo`, unchanged.
- **Decoder**: our decoder (`llm.decode` through `HFModel`) against transformers' ``generate``
  on the same prompts (the step's first-action contexts, G per question), the same weights,
  autocast and budget, plain softmax(logits / T) sampling, EOS as the only stop, side by side
  in this run; generated tokens per second and their ratio. Rows of a random model rarely end
  early, so this measures the per-token cost of the two loops, not our decoder's gain from
  ending rows leaving the batch (`benchmarks/rollout_stragglers.py` measures that).
- **Learner layouts**: protocol trajectories (0 to 4 searches, replayed by a scripted policy
  over the same index, since the random model's own are one turn) trained through the trained
  model as one forward and backward pass each way: per turn (`rl.batching`) and packed, one
  sequence per trajectory (`rl.packing`, sdpa with a bool mask); tokens/s counts the per-turn
  real tokens, the work both layouts do (as `benchmarks/packing.py`).
- **Peak memory**: ``torch.cuda.max_memory_allocated`` over the trainer's steps (n/a on a CPU).
- **MFU**: 6 * parameters * tokens / seconds / peak, the usual estimate (attention's quadratic
  term left out), against ``--peak-tflops`` (default on CUDA: 989, the H200's dense bf16);
  n/a on a CPU unless the flag is given. The trainer's update counts its padded tokens.

    python benchmarks/gpu_rung.py --shape 1.5b --device cuda --out gpu_rung.json
    python benchmarks/gpu_rung.py --shape tiny  # CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.base import Generate
from memsearcher.agent.replay import search_then_answer
from memsearcher.data.synthetic import WorldConfig, generate_world, write_world
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFModel, HFTokenizer
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval import open_retriever
from memsearcher.retrieval.bm25 import build_bm25
from memsearcher.rl.batching import collate, plan_micro_batches, sequence_logprobs
from memsearcher.rl.config import GRPOConfig, load_config
from memsearcher.rl.packing import collate_packed, pack, packed_logprobs
from memsearcher.rl.policy import autocast
from memsearcher.rl.train_grpo import train_grpo
from memsearcher.types import QAExample, TokenSequence

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    # config.json of Qwen/Qwen2.5-1.5B and Qwen/Qwen2.5-3B (both tie their embeddings)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, vocab_size=151936),
}  # fmt: skip
DEFAULTS = {"tiny": (2, 2, 32), "1.5b": (8, 5, 512), "3b": (8, 5, 512)}
"""Questions per step, G and new tokens per generation when not given: the paper's G and
budget on a GPU (40 rollouts a step), a few seconds a step on a CPU for the tiny shape."""
H200_BF16_TFLOPS = 989.0
"""NVIDIA's dense (no sparsity) bf16 peak of the H200 SXM."""


def save_random_model(shape: str, folder: Path, device: str, seed: int) -> tuple[Path, int]:
    """A randomly initialized Qwen2 of ``shape`` with the embedded tokenizer, saved as an HF
    folder (bfloat16 on disk: half the bytes; the trainer loads float32 master weights)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from memsearcher.llm.embedded import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    config = Qwen2Config(
        **{"vocab_size": len(tokenizer), **SHAPES[shape]},
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initializing 3B weights on a CPU takes minutes
        model = Qwen2ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    return folder, params


def synthetic_world(folder: Path, seed: int) -> tuple[Path, Path, list[QAExample]]:
    """The demo's world: its questions for GRPO (FlashRAG JSONL), and a BM25 index of it."""
    world = generate_world(WorldConfig(seed=seed))
    paths = write_world(world, folder / "world")
    build_bm25(paths["corpus"], folder / "index")
    return paths["rl"], folder / "index", [q.to_example() for q in world.split("rl")]


def decoder_ratio(
    folder: Path, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, float]:
    """Generated tokens/s of our decoder and of transformers' generate, side by side."""
    from transformers import GenerationConfig

    llm = HFModel.from_pretrained(str(folder), args.device, "float32", batch_size=len(prompts))
    device, tokenizer = llm.device, llm.tokenizer
    pad, width = tokenizer.pad_token_id, max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    eos = sorted(tokenizer.eos_token_ids)

    def ours(budget: int) -> int:
        params = SamplingParams(max_new_tokens=budget, temperature=1.0, seed=args.seed)
        return sum(len(c.token_ids) for c in llm.generate(prompts, params))

    def theirs(budget: int) -> int:
        config = GenerationConfig(
            max_new_tokens=budget, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            eos_token_id=eos, pad_token_id=pad, repetition_penalty=1.0,
        )  # fmt: skip
        output = llm.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        rows = output[:, width:].tolist()
        return sum(len(llm._finish(row, SamplingParams(budget)).token_ids) for row in rows)

    rates = {}
    with torch.no_grad(), autocast(args.compute, device):
        for name, run in (("ours", ours), ("transformers", theirs)):
            run(4)  # warm-up: kernels, allocator
            synchronize(device)
            start = time.perf_counter()
            tokens = run(args.max_new_tokens)
            synchronize(device)
            rates[name] = tokens / (time.perf_counter() - start)
    return {
        "prompts": len(prompts),
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "ours_tokens_per_s": rates["ours"],
        "transformers_tokens_per_s": rates["transformers"],
        "ours_over_transformers": rates["ours"] / rates["transformers"],
    }


def replayed_trajectories(
    tokenizer: HFTokenizer, questions: list[QAExample], retriever: Any, seed: int
) -> list[list[TokenSequence]]:
    """MemSearcher trajectories of 0 to 4 searches each, from the scripted protocol policy."""
    rng = random.Random(seed)
    config = AgentConfig(max_turns=6, memory_tokens=256, max_new_tokens=128, top_n=3)
    out = []
    for example in questions:
        reply = search_then_answer(rng.randint(0, 4), example.golden_answers[0], memory_words=60)
        (episode,) = start_episodes("memsearcher", [example], tokenizer, config)
        llm = ScriptedLLM(tokenizer, reply)
        (trajectory,) = run_lockstep([episode], llm, retriever, SamplingParams())
        out.append(list(trajectory.sequences))
    return out


def learner_layouts(
    model: Any, trajs: list[list[TokenSequence]], pad: int, args: argparse.Namespace
) -> dict[str, float]:
    """Seconds of one forward and backward pass over ``trajs`` per turn and packed."""
    flat = [s for t in trajs for s in t]
    packs = [pack(t) for t in trajs]
    per_turn = [
        collate(flat, plan, pad)
        for plan in plan_micro_batches([len(s.input_ids) for s in flat], args.budget)
    ]
    packed = [
        collate_packed([packs[i] for i in plan], pad, "bool")
        for plan in plan_micro_batches([len(p.input_ids) for p in packs], args.budget)
    ]

    def per_turn_pass() -> None:
        for batch in per_turn:
            (sequence_logprobs(model, batch) * batch.loss_mask).sum().backward()

    def packed_pass() -> None:
        for batch in packed:
            sum(lp.sum() for lp in packed_logprobs(model, batch, kind="bool")).backward()

    device = next(model.parameters()).device
    real = sum(len(s.input_ids) for s in flat)
    out: dict[str, float] = {"real_tokens": real, "trajectories": len(trajs), "turns": len(flat)}
    for name, run, batches in (("per_turn", per_turn_pass, per_turn),
                               ("packed", packed_pass, packed)):  # fmt: skip
        best = float("inf")
        for _ in range(args.repeats):
            synchronize(device)
            start = time.perf_counter()
            with autocast(args.compute, device):
                run()
            synchronize(device)
            best = min(best, time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        out[f"{name}_tokens_per_s"] = real / best
        out[f"{name}_processed_tokens"] = sum(b.padded_tokens for b in batches)
    out["packed_over_per_turn"] = out["packed_tokens_per_s"] / out["per_turn_tokens_per_s"]
    return out


def trainer_figures(output: Path, steps: int) -> dict[str, Any]:
    """Per-step rollout and update rates from the run's metrics and sample files."""
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").open()]
    rollout, update = [], []
    for step, m in enumerate(metrics, start=1):
        samples = (output / "samples" / f"step-{step}.jsonl").read_text().splitlines()
        tokens = sum(t["generated_tokens"] for line in samples for t in json.loads(line)["turns"])
        rollout.append(tokens / m["time/rollout"])
        update.append(m["train/tokens_per_s"])
    return {
        "steps": len(metrics),
        "step_seconds": [m["time/step"] for m in metrics],
        "rollout_tokens_per_s": rollout,
        "update_padded_tokens_per_s": update,
        "reward_mean": [m["reward/mean"] for m in metrics],
        "turns_mean": [m["rollout/turns"] for m in metrics],
    }


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps of the trainer")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="compute (autocast) dtype; auto: bfloat16 on CUDA, float32 on a "
                        "CPU (as the trainer's model.autocast); weights stay float32")  # fmt: skip
    parser.add_argument("--batch", type=int, help="questions per step (default: by shape)")
    parser.add_argument("--group", type=int, help="trajectories per question, G (by shape)")
    parser.add_argument("--max-new-tokens", type=int, help="per generation (by shape)")
    parser.add_argument("--budget", type=int, default=16384, help="padded tokens per pass")
    parser.add_argument("--repeats", type=int, default=2, help="of the learner layouts' passes")
    peak_help = f"bf16 peak for MFU; unset: {H200_BF16_TFLOPS} (H200) on CUDA, n/a on a CPU"
    parser.add_argument("--peak-tflops", type=float, default=None, help=peak_help)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    args = parser.parse_args(argv)
    for key, value in zip(("batch", "group", "max_new_tokens"), DEFAULTS[args.shape], strict=True):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    args.compute = None if args.dtype == "float32" else args.dtype

    work = Path(tempfile.mkdtemp(prefix="gpu-rung-"))
    try:  # the 3B shape's checkpoint is 36 GB of a 64 GB disk
        figures = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Build, decode, train and time; the figures of `main`."""
    from transformers import AutoTokenizer

    cuda = torch.device(args.device).type == "cuda"
    peak = args.peak_tflops or (H200_BF16_TFLOPS if cuda else None)
    started = time.perf_counter()
    folder, params = save_random_model(args.shape, work / "model", args.device, args.seed)
    data, index, questions = synthetic_world(work, args.seed)
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(folder))
    print(
        f"{args.shape}: {params / 1e6:.1f}M parameters (random init), {args.device}, "
        f"{args.dtype}; {len(questions)} questions, {args.batch} x G={args.group} a step"
    )

    # 1. Our decoder against transformers' generate on one step's first-action prompts.
    step_questions = questions[: args.batch]
    episodes = start_episodes(
        "memsearcher", [q for q in step_questions for _ in range(args.group)], tokenizer,
        AgentConfig(max_new_tokens=args.max_new_tokens),
    )  # fmt: skip
    requests = [e.next_request() for e in episodes]
    prompts = [list(r.prompt_ids) for r in requests if isinstance(r, Generate)]
    decoder = decoder_ratio(folder, prompts, args)
    release(args.device)  # the decoders' model, before the trainer loads its own
    print(f"rollout: ours {decoder['ours_tokens_per_s']:.0f} tokens/s, transformers generate "
          f"{decoder['transformers_tokens_per_s']:.0f} tokens/s: "
          f"{decoder['ours_over_transformers']:.2f}x ({len(prompts)} prompts)")  # fmt: skip

    # 2. The trainer's own steps, unchanged.
    config = load_config(
        GRPOConfig,
        None,
        [f"data={data}", f"retriever={index}", f"output_dir={work / 'grpo'}",
         f"model.path={folder}", f"model.device={args.device}",
         f"model.autocast={args.compute or 'null'}", f"model.rollout_batch_size={len(prompts)}",
         f"steps={args.steps}", f"questions_per_step={args.batch}",
         f"mini_batch_questions={args.batch}", f"group_size={args.group}",
         f"agent.max_new_tokens={args.max_new_tokens}", f"micro_batch_tokens={args.budget}",
         "tensorboard=false", "sample_every=1", f"save_every={args.steps}", f"seed={args.seed}"],
    )  # fmt: skip
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = train_grpo(config)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    trainer = trainer_figures(work / "grpo", args.steps)
    seconds = ", ".join(f"{s:.1f}" for s in trainer["step_seconds"])
    rollout, update = trainer["rollout_tokens_per_s"], trainer["update_padded_tokens_per_s"]
    print(
        f"trainer: {trainer['steps']} steps of {seconds} s; rollout {min(rollout):.0f}-"
        f"{max(rollout):.0f} tokens/s, update {min(update):.0f}-{max(update):.0f} padded "
        "tokens/s"
    )

    # 3. Learner layouts on protocol trajectories, through the trained model.
    retriever = open_retriever(str(index))
    trajs = replayed_trajectories(
        tokenizer, questions[: args.batch * args.group], retriever, args.seed
    )
    learner = learner_layouts(model, trajs, tokenizer.pad_token_id, args)
    print(f"learner: per-turn {learner['per_turn_tokens_per_s']:.0f} tokens/s, packed "
          f"{learner['packed_tokens_per_s']:.0f} tokens/s ({learner['packed_over_per_turn']:.2f}x; "
          f"{learner['real_tokens']:.0f} tokens in {learner['turns']:.0f} turns)")  # fmt: skip

    def mfu(tokens_per_s: float) -> float | None:
        return None if peak is None else 6 * params * tokens_per_s / (peak * 1e12)

    update_rate = sum(trainer["update_padded_tokens_per_s"]) / trainer["steps"]
    figures = {
        "shape": args.shape,
        "model": {"parameters": params, **SHAPES[args.shape]},
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": args.dtype,
        "steps": args.steps,
        "batch": args.batch,
        "group": args.group,
        "max_new_tokens": args.max_new_tokens,
        "decoder": decoder,
        "trainer": trainer,
        "learner": learner,
        "peak_memory_gib": peak_gib,
        "peak_tflops": peak,
        "mfu": {
            "update": mfu(update_rate),
            "per_turn": mfu(learner["per_turn_tokens_per_s"]),
            "packed": mfu(learner["packed_tokens_per_s"]),
        },
        "seconds": time.perf_counter() - started,
    }
    memory = "n/a (CPU)" if peak_gib is None else f"{peak_gib:.1f} GiB"
    utilization = "n/a (no peak given)" if peak is None else ", ".join(
        f"{k} {v:.1%}" for k, v in figures["mfu"].items() if v is not None
    )  # fmt: skip
    print(f"peak memory {memory}; MFU {utilization}; {figures['seconds']:.0f} s in all")
    return figures


if __name__ == "__main__":
    main()
