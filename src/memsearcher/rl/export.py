"""The LoRA adapter a training run leaves, exported as the package ships it: float16
safetensors, a config without a local base path, and a model card that records the run."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from memsearcher.errors import MemSearcherError

__all__ = ["export_adapter", "machine"]


def export_adapter(model_dir: str | Path, target: str | Path, card: str, base: str) -> Path:
    """Copy the LoRA adapter a checkpoint saved in ``model_dir`` to ``target`` as float16
    safetensors, with its config (``base`` as the base model, no local path) and the model
    card ``card`` (markdown) as README.md."""
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
    config["base_model_name_or_path"] = base
    config["inference_mode"] = True
    (target / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
    (target / "README.md").write_text(card, encoding="utf-8")
    return target


def machine() -> str:
    """The machine a run was timed on, for model cards and reports."""
    import torch

    return f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads"
