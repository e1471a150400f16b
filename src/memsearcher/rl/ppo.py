"""PPO with a critic over multi-turn trajectories (MEM1's algorithm), as pure functions.

A trajectory is trained as several turn sequences (`memsearcher.types.TokenSequence`), and its
actions are the mask-1 tokens of all of them, in turn order. GAE runs over that chain: the
trajectory's turn sequences are laid end to end into one row (`to_rows`), their environment
tokens (mask 0) skipped, and the results cut back into turns (`from_rows`).

Shapes: N trajectories, T tokens per row (the concatenated response windows of a trajectory's
turns, padded with mask 0), V vocabulary.

MEM1 (MIT-MI/MEM1, ``train_ppo.sh`` and ``verl/trainer/ppo``) runs veRL's PPO with gamma =
lambda = 1, the KL to the reference as a per-token reward penalty (coefficient 0.001), the
outcome score on the last token, whitened advantages, a clipped value loss and an entropy bonus
of 0.001. With gamma = lambda = 1 every action token's return is the trajectory's score minus the
KL penalties from that token on, and its advantage is that return minus the token's value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "entropy_from_logits",
    "from_rows",
    "gae",
    "masked_whiten",
    "to_rows",
    "token_rewards",
    "value_loss",
]


def to_rows(per_sequence: Sequence[torch.Tensor], turns: Sequence[int]) -> torch.Tensor:
    """(N, T): each trajectory's turn sequences end to end, right-padded with zeros.

    ``per_sequence``: one 1-D tensor per turn sequence (its response window), trajectory by
    trajectory in turn order; ``turns``: how many sequences each trajectory has.
    """
    if sum(turns) != len(per_sequence):
        raise ValueError(
            f"turns add up to {sum(turns)}, but there are {len(per_sequence)} sequences"
        )
    rows, start = [], 0
    for count in turns:
        rows.append(torch.cat([t.reshape(-1) for t in per_sequence[start : start + count]]))
        start += count
    width = max((row.numel() for row in rows), default=0)
    dtype = per_sequence[0].dtype if per_sequence else torch.float32
    out = torch.zeros((len(rows), width), dtype=dtype)
    for n, row in enumerate(rows):
        out[n, : row.numel()] = row
    return out


def from_rows(
    rows: torch.Tensor, lengths: Sequence[int], turns: Sequence[int]
) -> list[torch.Tensor]:
    """The inverse of `to_rows`: per turn sequence, its (lengths[s],) slice of its row."""
    if sum(turns) != len(lengths):
        raise ValueError(f"turns add up to {sum(turns)}, but there are {len(lengths)} lengths")
    out, s = [], 0
    for n, count in enumerate(turns):
        offset = 0
        for length in lengths[s : s + count]:
            out.append(rows[n, offset : offset + length])
            offset += length
        s += count
    return out


def token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(N, T) rewards: ``scores[n]`` on row n's last mask-1 token, minus ``kl_coef * kl`` on
    every mask-1 token (KL in the reward, as MEM1 and veRL's PPO do).

    scores: (N,); mask, kl: (N, T). ``kl`` is a per-token estimate of KL(pi_old || pi_ref),
    e.g. ``old_logprobs - ref_logprobs``; MEM1's release clamps it at 0, which this does not.
    A row without any mask-1 token gets no reward.
    """
    if scores.shape != mask.shape[:1]:
        raise ValueError(f"scores must be ({mask.shape[0]},), got {tuple(scores.shape)}")
    valid = mask.bool()  # (N, T)
    rewards = torch.zeros(mask.shape, dtype=torch.float32)
    positions = torch.arange(mask.shape[1]).expand(mask.shape)  # (N, T)
    last = torch.where(valid, positions, -1).max(dim=1).values  # (N,)
    has = last >= 0
    rewards[has.nonzero(as_tuple=True)[0], last[has]] = scores[has].float()
    metrics = {"reward/score_mean": scores.float().mean().item() if scores.numel() else 0.0}
    if kl is not None:
        if kl.shape != mask.shape:
            raise ValueError(f"kl must be {tuple(mask.shape)}, got {tuple(kl.shape)}")
        penalty = torch.where(valid, kl.float(), 0.0)  # (N, T)
        rewards = rewards - kl_coef * penalty
        metrics["reward/kl"] = (penalty.sum() / valid.sum().clamp(min=1)).item()
        metrics["reward/kl_coef"] = kl_coef
    return rewards, metrics


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al., 2016) over the mask-1 tokens.

    rewards, values, mask: (N, T). Returns advantages and returns, (N, T), zero where mask is 0.
    Mask-0 tokens (the environment's) are not steps: a token's next value is that of the next
    mask-1 token of its row, 0 after the last, and the recursion passes over them (veRL's
    multi-turn GAE does the same). With gamma = lambda = 1 and the reward on the last token,
    every advantage is the row's return minus the token's own value.
    """
    if not rewards.shape == values.shape == mask.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape)} must have one shape"
        )
    valid = mask.bool()
    rewards, values = rewards.float(), values.detach().float()
    next_value = torch.zeros(rewards.shape[0])  # (N,)
    running = torch.zeros(rewards.shape[0])  # (N,)
    advantages = torch.zeros_like(rewards)  # (N, T)
    for t in reversed(range(rewards.shape[1])):
        step = valid[:, t]  # (N,)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        updated = delta + gamma * lam * running
        running = torch.where(step, updated, running)
        next_value = torch.where(step, values[:, t], next_value)
        advantages[:, t] = torch.where(step, updated, 0.0)
    returns = torch.where(valid, advantages + values, 0.0)
    return advantages, returns


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the mask-1 entries (unbiased variance, as veRL's
    ``masked_whiten``, which MEM1's GAE applies to advantages); 0 where mask is 0."""
    valid = mask.bool()
    count = valid.sum()
    if count < 2:
        raise ValueError("whitening needs at least two mask-1 entries")
    mean = x[valid].mean()
    var = ((x[valid] - mean) ** 2).sum() / (count - 1)
    return torch.where(valid, (x - mean) * torch.rsqrt(var + eps), 0.0)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss, token-mean over mask-1 tokens.

    values, old_values, returns, mask: (B, T). The new value may move at most ``clip`` from the
    old one before its error stops counting: 0.5 * max((v - R)^2, (clip(v, old +- clip) - R)^2)
    (TRL's and veRL's ``compute_value_loss``).
    """
    if not values.shape == old_values.shape == returns.shape == mask.shape:
        raise ValueError("values, old_values, returns and mask must have one shape")
    if clip < 0:
        raise ValueError(f"clip must be >= 0, got {clip}")
    valid = mask.bool()
    old = old_values.detach()
    clipped = old + torch.clamp(values - old, -clip, clip)  # (B, T)
    unclipped_loss = (values - returns.detach()) ** 2  # (B, T)
    clipped_loss = (clipped - returns.detach()) ** 2  # (B, T)
    zero = torch.zeros((), dtype=values.dtype)
    per_token = torch.where(valid, torch.maximum(unclipped_loss, clipped_loss), zero)
    count = valid.sum().clamp(min=1)
    loss = 0.5 * per_token.sum() / count
    with torch.no_grad():
        metrics = {
            "critic/vf_loss": loss.detach(),
            "critic/vf_clip_fraction": ((clipped_loss > unclipped_loss) & valid).sum() / count,
            "critic/values_mean": torch.where(valid, values, zero).sum() / count,
        }
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V) -> (B, T): the entropy of softmax(logits), for the entropy bonus."""
    logits = logits.float()
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)
