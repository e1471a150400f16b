"""Which model can the demo afford? The from-scratch demo model against SmolLM2-135M with LoRA.

Both run the demo's real work on the same real sequences: oracle MemSearcher turn sequences of
the synthetic world (each tokenized by its own model's tokenizer), one training pass (forward,
masked log-likelihood, backward) in micro-batches of 16 sequences, and one batched greedy
generation of 32 new tokens for 32 prompts. Reported: training tokens/s, generation tokens/s,
and the ratio demo model / SmolLM2 for each, measured one after the other in one run.

    python benchmarks/demo_model.py [--sequences 64] [--lora-rank 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from memsearcher.agent import Templates, run_lockstep, start_episodes
from memsearcher.data.flashrag import read_examples
from memsearcher.data.synthetic import generate_world, write_world
from memsearcher.demo.model import save_demo_model
from memsearcher.demo.pipeline import PRESETS
from memsearcher.demo.templates import DEMO_TEMPLATES, tokenizer_texts
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.embedded import embedded_model_path
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.bm25 import build_bm25
from memsearcher.rl.batching import collate, plan_micro_batches, sequence_logprobs
from memsearcher.teach.oracle import oracle_policy
from memsearcher.types import TokenSequence


def oracle_sequences(model: HFModel, work: Path, count: int) -> list[TokenSequence]:
    config = PRESETS["full"]
    paths = {k: work / "world" / f"{k}.jsonl" for k in ("corpus", "train")}
    examples = read_examples(paths["train"])[: count // 2]
    episodes = start_episodes(
        "memsearcher", examples, model.tokenizer, config.agent, Templates(**DEMO_TEMPLATES)
    )
    llm = ScriptedLLM(model.tokenizer, oracle_policy(examples))
    index = build_bm25(paths["corpus"], work / "index", overwrite=True)
    trajectories = run_lockstep(episodes, llm, index, SamplingParams())
    return [s for t in trajectories for s in t.sequences][:count]


def train_tokens_per_s(model: Any, sequences: list[TokenSequence], pad_id: int) -> float:
    lengths = [len(s.input_ids) for s in sequences]
    plans = plan_micro_batches(lengths, 10**9, [[i] for i in range(len(sequences))])
    plans = [p[k : k + 16] for p in plans for k in range(0, len(p), 16)]
    batches = [collate(sequences, plan, pad_id) for plan in plans]
    model.train()
    start = time.perf_counter()
    for batch in batches:
        logprobs = sequence_logprobs(model, batch, 1.0, None)
        (-(logprobs * batch.loss_mask).sum()).backward()
    return sum(lengths) / (time.perf_counter() - start)


def generate_tokens_per_s(model: HFModel, sequences: list[TokenSequence]) -> float:
    prompts = [s.prompt_ids for s in sequences[:32]]
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    start = time.perf_counter()
    completions = model.generate(prompts, params)
    return sum(len(c.token_ids) for c in completions) / (time.perf_counter() - start)


def measure(name: str, model: HFModel, work: Path, count: int) -> dict[str, float]:
    sequences = oracle_sequences(model, work, count)
    pad_id = model.tokenizer.pad_token_id
    result = {
        "train_tokens_per_s": train_tokens_per_s(model.model, sequences, pad_id),
        "generate_tokens_per_s": generate_tokens_per_s(model, sequences),
        "parameters_m": sum(p.numel() for p in model.model.parameters()) / 1e6,
        "mean_sequence_tokens": sum(len(s.input_ids) for s in sequences) / len(sequences),
    }
    print(name, {k: round(v, 1) for k, v in result.items()}, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = PRESETS["full"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        world = generate_world(config.world)
        write_world(world, work / "world")
        folder = save_demo_model(work / "demo-model", tokenizer_texts(world), config.model, seed=0)
        demo = measure("demo model", HFModel.from_pretrained(str(folder), device="cpu"), work,
                       args.sequences)  # fmt: skip

        from peft import LoraConfig, get_peft_model

        smol = HFModel.from_pretrained(str(embedded_model_path()), device="cpu")
        lora = LoraConfig(r=args.lora_rank, lora_alpha=32, target_modules=["q_proj", "v_proj"])
        smol.model = get_peft_model(smol.model, lora)  # generation and training both use it
        smollm = measure(f"SmolLM2-135M + LoRA r={args.lora_rank}", smol, work, args.sequences)
    for key in ("train_tokens_per_s", "generate_tokens_per_s"):
        print(f"{key}: demo model / SmolLM2+LoRA = {demo[key] / smollm[key]:.1f}x")


if __name__ == "__main__":
    main()
