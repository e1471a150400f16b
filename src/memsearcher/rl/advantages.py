"""Group-relative advantages for multi-context GRPO (DESIGN.md section 6).

Every trajectory of a group answers the same question; its advantage is its reward measured
against the group's. A trajectory is trained as several turn sequences, and each of them
carries the trajectory's advantage unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

__all__ = ["broadcast_to_turns", "degenerate_groups", "group_advantages", "question_of"]


Index = TypeVar("Index", int, torch.Tensor)


def question_of(trajectory: Index, group_size: int) -> Index:
    """The question each trajectory answers. Rollouts lay out the G trajectories of a question
    in adjacent rows, so trajectory j answers question j // G: the layout every grouped
    function here (``view(-1, G)``) and every loop assumes."""
    return trajectory // group_size


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D (num_groups * group_size,), got {tuple(rewards.shape)}"
        )
    if rewards.numel() == 0:
        raise ValueError("rewards is empty")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"len(rewards)={rewards.numel()} is not a multiple of group_size={group_size}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    return rewards.view(-1, group_size)  # (N, G)


def degenerate_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(num_groups,) bool: True where every reward of the group is the same.

    Such a group carries no learning signal; a group of one is always degenerate.
    """
    grouped = _grouped(rewards, group_size)  # (N, G)
    return (grouped == grouped[:, :1]).all(dim=1)  # (N,)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A_j = (R_j - mean(R_group)) / (std(R_group) + eps), or R_j - mean without std.

    ``rewards`` is (num_groups * group_size,), ordered group by group. Returns the advantages
    in the same order and a metrics dict. A degenerate group (all rewards equal) gets exactly 0
    for every member: the subtraction alone could leave rounding residue, e.g. three rewards of
    0.1 whose float mean is not exactly 0.1.
    """
    grouped = _grouped(rewards, group_size)  # (N, G)
    degenerate = (grouped == grouped[:, :1]).all(dim=1)  # (N,)
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # (N, G)
    if normalize_std and group_size > 1:
        # Sample std (Bessel, correction=1), as veRL's compute_grpo_outcome_advantage
        # (verl/trainer/ppo/core_algos.py: torch.std over the group's scores) and TRL's
        # GRPOTrainer (rewards.view(-1, num_generations).std(dim=1)) both do.
        std = grouped.std(dim=1, correction=1, keepdim=True)  # (N, 1)
        centred = centred / (std + eps)
    advantages = torch.where(degenerate[:, None], torch.zeros_like(centred), centred)  # (N, G)
    advantages = advantages.reshape(-1)  # (N * G,)

    num_groups = grouped.shape[0]
    num_degenerate = int(degenerate.sum().item())
    metrics = {
        "advantage/mean": advantages.mean().item(),
        # Population std so that a single trajectory gives 0, not NaN.
        "advantage/std": advantages.std(correction=0).item(),
        "advantage/abs_max": advantages.abs().max().item(),
        "rollout/degenerate_groups": float(num_degenerate),
        "rollout/degenerate_fraction": num_degenerate / num_groups,
    }
    return advantages, metrics


def broadcast_to_turns(
    advantages: torch.Tensor, turns_per_trajectory: Sequence[int]
) -> torch.Tensor:
    """(sum(turns),): each trajectory's advantage repeated once per turn sequence, in order."""
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be 1-D, got shape {tuple(advantages.shape)}")
    if len(turns_per_trajectory) != advantages.numel():
        raise ValueError(
            f"{len(turns_per_trajectory)} turn counts for {advantages.numel()} advantages"
        )
    for index, turns in enumerate(turns_per_trajectory):
        if turns < 1:
            raise ValueError(f"trajectory {index} has {turns} sequences; each needs at least 1")
    repeats = torch.tensor(list(turns_per_trajectory), dtype=torch.long, device=advantages.device)
    return advantages.repeat_interleave(repeats)  # (sum(turns),)
