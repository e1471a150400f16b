"""Multi-context GRPO and SFT: rewards, advantages, loss, learner batches and the two loops.

The loops are imported on first use, so that importing the configs (as the CLI does for every
command) does not pull in the trainers' dependencies.
"""

from __future__ import annotations

from typing import Any

from memsearcher.rl.config import GRPOConfig, ModelConfig, OptimConfig, SFTConfig, load_config

__all__ = [
    "GRPOConfig",
    "ModelConfig",
    "OptimConfig",
    "SFTConfig",
    "load_config",
    "read_trajectories",
    "train_grpo",
    "train_sft",
]

_LAZY = {
    "train_grpo": "memsearcher.rl.train_grpo",
    "train_sft": "memsearcher.rl.train_sft",
    "read_trajectories": "memsearcher.rl.train_sft",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'memsearcher.rl' has no attribute {name!r}")
