"""AdamW and its learning-rate schedules."""

from __future__ import annotations

from typing import Any

import torch

from memsearcher.rl.config import OptimConfig
from memsearcher.rl.schedules import SCHEDULES

__all__ = ["make_optimizer", "make_scheduler", "optimizer_step"]


def make_optimizer(model: Any, config: OptimConfig) -> torch.optim.Optimizer:
    parameters = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )


def make_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, total_updates: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps`` updates, then a `SCHEDULES` shape (the name was
    checked when ``config`` was built)."""
    shape = SCHEDULES[config.schedule]
    warmup = config.warmup_steps

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        return shape((update - warmup) / max(1, total_updates - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optimizer_step(model: Any, optimizer: Any, scheduler: Any, config: OptimConfig) -> float:
    """Clip the accumulated gradient to ``max_grad_norm`` (0: no clipping), step, advance the
    schedule, clear the gradients; returns the norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.requires_grad],
        config.max_grad_norm or float("inf"),
    )
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm.item())
