"""Clipped policy loss of multi-context GRPO (DESIGN.md section 6) and token log-probabilities.

Shapes: B turn sequences in the mini-batch, T response tokens (padded), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["AGGREGATIONS", "KL_MAX", "Aggregation", "policy_loss", "token_logprobs"]

# veRL's low_var_kl bounds: the log-ratio is clamped to +-20 before exp() and the k3 value to
# +-10 (verl/trainer/ppo/core_algos.py, kl_penalty), so one token whose reference probability is
# vanishingly small cannot dominate the loss or overflow.
LOG_RATIO_MAX = 20.0
KL_MAX = 10.0


def token_mean(
    loss_tok: torch.Tensor, mask: torch.Tensor, trajectory_ids: torch.Tensor | None
) -> torch.Tensor:
    """Sum over every masked token of the batch / number of masked tokens."""
    return (loss_tok * mask).sum() / mask.sum().clamp(min=1.0)


def sequence_mean(
    loss_tok: torch.Tensor, mask: torch.Tensor, trajectory_ids: torch.Tensor | None
) -> torch.Tensor:
    """Mean over each sequence's masked tokens, then over the sequences that have any."""
    counts = mask.sum(dim=1)  # (B,)
    per_sequence = (loss_tok * mask).sum(dim=1) / counts.clamp(min=1.0)  # (B,)
    present = (counts > 0).to(loss_tok.dtype)  # (B,)
    return (per_sequence * present).sum() / present.sum().clamp(min=1.0)


def trajectory_mean(
    loss_tok: torch.Tensor, mask: torch.Tensor, trajectory_ids: torch.Tensor | None
) -> torch.Tensor:
    """Mean over each trajectory's masked tokens across all its sequences, then over trajectories.

    Every trajectory weighs the same however many turns it took, which removes the length bias
    DESIGN.md section 6 names as open.
    """
    if trajectory_ids is None:
        raise ValueError("aggregation 'trajectory-mean' needs trajectory_ids (B,)")
    if trajectory_ids.shape != loss_tok.shape[:1]:
        raise ValueError(
            f"trajectory_ids must be ({loss_tok.shape[0]},), got {tuple(trajectory_ids.shape)}"
        )
    unique, inverse = torch.unique(trajectory_ids, return_inverse=True)  # (n,), (B,)
    n = unique.numel()
    zeros = loss_tok.new_zeros(n)
    sums = zeros.index_add(0, inverse, (loss_tok * mask).sum(dim=1))  # (n,)
    counts = zeros.index_add(0, inverse, mask.sum(dim=1))  # (n,)
    per_trajectory = sums / counts.clamp(min=1.0)  # (n,)
    present = (counts > 0).to(loss_tok.dtype)  # (n,)
    return (per_trajectory * present).sum() / present.sum().clamp(min=1.0)


def _tokens(mask: torch.Tensor, trajectory_ids: torch.Tensor) -> float:
    return float(mask.sum())


def _sequences(mask: torch.Tensor, trajectory_ids: torch.Tensor) -> float:
    return float((mask.sum(dim=1) > 0).sum())


def _trajectories(mask: torch.Tensor, trajectory_ids: torch.Tensor) -> float:
    return float(trajectory_ids[mask.sum(dim=1) > 0].unique().numel())


@dataclass(frozen=True)
class Aggregation:
    """How token losses become one scalar, and the unit it averages over."""

    reduce: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    """(loss_tok (B, T), mask (B, T), trajectory_ids (B,) or None) -> the scalar loss."""
    units: Callable[[torch.Tensor, torch.Tensor], float]
    """(mask (B, T), trajectory_ids (B,)) -> how many units a batch holds, so that summing
    ``reduce`` over micro-batches weighted by ``units / total units`` gives ``reduce`` of their
    union (gradient accumulation, and ranks)."""


AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": Aggregation(token_mean, _tokens),
    "sequence-mean": Aggregation(sequence_mean, _sequences),
    "trajectory-mean": Aggregation(trajectory_mean, _trajectories),
}


def _check_shapes(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got {tuple(logprobs.shape)}")
    named = {"old_logprobs": old_logprobs, "loss_mask": loss_mask}
    if ref_logprobs is not None:
        named["ref_logprobs"] = ref_logprobs
    for name, tensor in named.items():
        if tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, logprobs {tuple(logprobs.shape)}"
            )
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must be ({logprobs.shape[0]},), one per sequence (GRPO), or "
            f"{tuple(logprobs.shape)}, one per token (PPO), got {tuple(advantages.shape)}"
        )


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    aggregation: str = "token-mean",
    trajectory_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate plus k3 KL to the reference, aggregated to a scalar.

    logprobs, old_logprobs, ref_logprobs, loss_mask: (B, T); advantages: (B,), broadcast over T
    (GRPO), or (B, T), one per token (PPO with GAE, `memsearcher.rl.ppo`); trajectory_ids: (B,),
    which trajectory each sequence belongs to (for 'trajectory-mean').
    Positions with loss_mask 0 get exactly zero gradient whatever logprobs holds there.
    Metrics are detached; "train/kl" is present only when ref_logprobs is given.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose from {sorted(AGGREGATIONS)}")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logprobs")
    _check_shapes(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs)

    valid = loss_mask.bool()  # (B, T)
    mask = valid.to(logprobs.dtype)  # (B, T)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = advantages.detach().to(logprobs.dtype)
    adv = adv[:, None] if adv.dim() == 1 else torch.where(valid, adv, zero)  # (B, 1) or (B, T)

    # torch.where, not a multiply by the mask: exp() of a huge masked difference would be inf,
    # and inf * 0 is NaN in both the value and the gradient.
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), zero)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    pg_unclipped = -adv * ratio  # (B, T)
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    # The clipped branch wins only outside the trust region; there its gradient is 0.
    clipped = pg_clipped > pg_unclipped  # (B, T)
    pg_tok = torch.where(clipped, pg_clipped, pg_unclipped)  # (B, T)
    loss_tok = pg_tok

    kl_tok = None
    if ref_logprobs is not None:
        # k3 estimator of KL(pi_theta || pi_ref), Schulman, "Approximating KL divergence" (2020),
        # bounded as veRL's low_var_kl.
        ref_minus = torch.where(valid, ref_logprobs.detach() - logprobs, zero)  # (B, T)
        ref_minus = ref_minus.clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)  # (B, T)
        kl_tok = (torch.exp(ref_minus) - ref_minus - 1.0).clamp(-KL_MAX, KL_MAX)  # (B, T)
        if beta > 0:
            loss_tok = loss_tok + beta * kl_tok

    loss_tok = torch.where(valid, loss_tok, zero)  # (B, T)
    aggregate = AGGREGATIONS[aggregation].reduce
    loss = aggregate(loss_tok, mask, trajectory_ids)

    with torch.no_grad():
        n_tokens = mask.sum().clamp(min=1.0)
        metrics = {
            "train/pg_loss": aggregate(torch.where(valid, pg_tok, zero), mask, trajectory_ids),
            "train/clip_fraction": (clipped & valid).to(logprobs.dtype).sum() / n_tokens,
            "train/ratio_mean": (ratio * mask).sum() / n_tokens,
        }
        if kl_tok is not None:
            metrics["train/kl"] = (kl_tok * mask).sum() / n_tokens
    return loss, {name: value.detach() for name, value in metrics.items()}


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[targets]: (B, T, V), (B, T) -> (B, T).

    Computed as logit[target] - logsumexp(logits) one sequence at a time, so that the
    temporaries (and the float32 upcast of bf16 logits) are one (T, V) slice, never a full
    (B, T, V) log-softmax; TRL's selective_log_softmax takes the same route.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got {tuple(logits.shape)}")
    if targets.shape != logits.shape[:2]:
        raise ValueError(f"targets must be {tuple(logits.shape[:2])}, got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = []
    for row_logits, row_targets in zip(logits, targets, strict=True):  # (T, V), (T,)
        row = row_logits.to(dtype)
        if temperature != 1.0:
            row = row / temperature
        picked = row.gather(-1, row_targets[:, None]).squeeze(-1)  # (T,)
        rows.append(picked - torch.logsumexp(row, dim=-1))  # (T,)
    if not rows:
        return logits.new_zeros(targets.shape, dtype=dtype)
    return torch.stack(rows)  # (B, T)
