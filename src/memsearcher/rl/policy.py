"""The trainable policy: its precision, how it is loaded, and its frozen KL reference.

Precision rule (docs/training.md, "Sampling and precision"): trainable weights stay float32 by
default and forward passes run under autocast (bfloat16 on CUDA). AdamW steps at the paper's
lr 1e-6 are far below half the bfloat16 spacing of a typical weight (|w| / 512), so bfloat16
*trainable* weights would not move at all; `check_precision` refuses that combination.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from memsearcher.errors import MemSearcherError
from memsearcher.rl.config import ModelConfig
from memsearcher.rl.distributed import Runtime

__all__ = [
    "Precision",
    "autocast",
    "disable_dropout",
    "frozen_copy",
    "load_policy",
    "resolve_precision",
]


@dataclass(frozen=True)
class Precision:
    """How the policy sits in memory and computes."""

    weights: torch.dtype
    """Dtype of the parameters (the optimizer's master weights)."""
    compute: str | None
    """Autocast dtype of forward passes (rollouts, log-probs, the update); None: the weights'."""


def resolve_precision(config: ModelConfig, device_type: str) -> Precision:
    """``model.dtype`` and ``model.autocast`` on a device of type ``device_type``."""
    compute = config.autocast
    if compute == "auto":
        bf16 = (
            device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        )
        compute = "bfloat16" if bf16 else None
    return Precision(weights=getattr(torch, config.dtype), compute=compute)


def autocast(compute: str | None, device: torch.device) -> AbstractContextManager[Any]:
    """Forward passes in the ``compute`` dtype; a no-op when it is None."""
    if compute is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, compute))


def load_policy(config: ModelConfig, runtime: Runtime, precision: Precision) -> tuple[Any, Any]:
    """The trainable model (LoRA-wrapped if asked) on this rank's device, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memsearcher.llm.embedded import resolve_model

    path = resolve_model(config.path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=precision.weights)
    except OSError as error:
        raise MemSearcherError(f"cannot load model {path!r}: {error}") from error
    disable_dropout(model)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if config.lora_rank > 0:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise MemSearcherError("LoRA needs peft: pip install 'memsearcher[train]'") from None
        lora = LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            target_modules=list(config.lora_targets),
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    model.to(runtime.device)
    return model, tokenizer


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off everywhere: with it, log-probs of the same weights differ between the
    old-policy pass and the update, and the ratio is no longer 1 on-policy (TRL's
    ``disable_dropout`` does the same)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            setattr(module, "attention_dropout", 0.0)  # noqa: B010


def frozen_copy(model: Any, precision: Precision) -> Any:
    """A frozen copy of the initial model, the KL reference of full fine-tuning.

    Held in the compute dtype when forward passes run under autocast: autocast rounds the
    weights to that dtype for every matmul anyway, and at 3B the float32 copy would be 12 GB
    per GPU of the DDP budget for nothing.
    """
    reference = copy.deepcopy(model).eval()
    if precision.compute is not None:
        reference.to(getattr(torch, precision.compute))
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    return reference
