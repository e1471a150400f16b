"""PPO's critic inside the trainer (``advantage: gae``, MEM1's algorithm).

`train_ppo` runs GRPO's rollouts and learner with three changes, all here:

- `response_values`: the critic's value of every response token of every turn sequence, before
  the update (the "old" values);
- `gae_targets`: per-token advantages and returns by GAE over each trajectory's turns laid end
  to end (`memsearcher.rl.ppo`), with the trajectory's score on its last action token and,
  optionally, the KL to the reference as a per-token reward penalty;
- `critic_gradients`: the clipped value loss, token-mean over a mini-batch of all ranks,
  accumulated as the policy's gradients are.

The critic is a second copy of the policy's start with a scalar head (`value.load_critic`),
trained by its own AdamW at its own learning rate, checkpointed under ``OUTPUT/critic/``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from memsearcher.rl.batching import MicroBatch, collate, plan_micro_batches, right_aligned
from memsearcher.rl.config import CriticConfig
from memsearcher.rl.distributed import Runtime, no_sync, sum_over_ranks
from memsearcher.rl.policy import autocast
from memsearcher.rl.ppo import from_rows, gae, masked_whiten, to_rows, token_rewards, value_loss
from memsearcher.rl.value import Critic, token_values
from memsearcher.types import TokenSequence

__all__ = ["CRITIC_METRICS", "critic_gradients", "gae_targets", "response_values"]

CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clip_fraction", "critic/values_mean")


@torch.no_grad()
def response_values(
    critic: Critic,
    sequences: Sequence[TokenSequence],
    token_budget: int,
    pad_id: int,
    compute: str | None = None,
) -> list[torch.Tensor]:
    """Per sequence, the (len(response),) values before each response token (0 at mask 0),
    on the CPU; laid out as `batching.response_logprobs` lays out log-probs."""
    device = next(critic.parameters()).device
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    lengths = [len(s.input_ids) for s in sequences]
    for plan in plan_micro_batches(lengths, token_budget):
        batch = _on(collate(sequences, plan, pad_id), device)
        with autocast(compute, device):
            values = token_values(critic, batch).float().cpu()  # (B, R)
        for row, index in enumerate(plan):
            out[index] = values[row, values.shape[1] - len(sequences[index].response_ids) :]
    return out


def gae_targets(
    sequences: Sequence[TokenSequence],
    trajectory_ids: torch.Tensor,
    scores: torch.Tensor,
    values: Sequence[torch.Tensor],
    config: CriticConfig,
    old: Sequence[torch.Tensor] | None = None,
    ref: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """Per sequence, (len(response),) advantages and returns, and reward metrics.

    ``trajectory_ids``: (S,), the trajectory of each sequence, a trajectory's sequences
    adjacent and in turn order (`learner.learner_sequences`); ``scores``: one reward per
    trajectory, indexed by those ids. ``old``/``ref``: response log-probs, for the KL penalty
    ``config.kl_reward * (old - ref)`` on every action token (MEM1: 0.001).
    """
    if not sequences:  # a rank whose trajectories all ended before acting: same metric keys
        none = {"reward/score_mean": 0.0}
        if config.kl_reward > 0:
            none.update({"reward/kl": 0.0, "reward/kl_coef": config.kl_reward})
        return [], [], none
    kept, turns = torch.unique_consecutive(trajectory_ids, return_counts=True)
    turns_list = turns.tolist()
    masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in sequences]
    mask = to_rows(masks, turns_list)  # (N, T)
    kl = None
    if config.kl_reward > 0:
        if old is None or ref is None:
            raise ValueError("kl_reward > 0 needs the old and reference log-probs")
        kl = to_rows([o - r for o, r in zip(old, ref, strict=True)], turns_list)  # (N, T)
    rewards, metrics = token_rewards(scores[kept].float(), mask, kl, config.kl_reward)
    advantages, returns = gae(rewards, to_rows(values, turns_list), mask, config.gamma, config.lam)
    if config.whiten and mask.sum() >= 2:
        advantages = masked_whiten(advantages, mask)
    lengths = [len(s.response_ids) for s in sequences]
    return (
        from_rows(advantages, lengths, turns_list),
        from_rows(returns, lengths, turns_list),
        metrics,
    )


def critic_gradients(
    critic: Critic,
    batches: list[MicroBatch],
    old_values: Sequence[torch.Tensor],
    returns: Sequence[torch.Tensor],
    config: CriticConfig,
    runtime: Runtime,
    compute: str | None = None,
) -> dict[str, float]:
    """Backward passes of the clipped value loss over one mini-batch's micro-batches (the
    policy's), each weighted by its share of the mini-batch's action tokens over all ranks, so
    the accumulated gradient is the token-mean over the whole mini-batch. Every rank calls it.
    """
    device = next(critic.parameters()).device
    total = sum_over_ranks(sum(float(b.loss_mask.sum()) for b in batches), runtime)
    sums = dict.fromkeys(CRITIC_METRICS, 0.0)
    for k, batch in enumerate(batches):
        tokens = float(batch.loss_mask.sum())
        weight = tokens * runtime.world_size / max(total, 1.0)
        with no_sync(critic.model, sync=k == len(batches) - 1), autocast(compute, device):
            values = token_values(critic, _on(batch, device))  # (B, R)
            if weight == 0:  # a blank pass that keeps the ranks' collectives in step
                (values.sum() * 0.0).backward()
                continue
            loss, parts = value_loss(
                values,
                right_aligned(old_values, batch).to(device),
                right_aligned(returns, batch).to(device),
                batch.loss_mask.to(device),
                config.value_clip,
            )
        (loss * weight).backward()
        for key, part in parts.items():
            sums[key] += float(part) * weight
    return sums


def _on(batch: MicroBatch, device: torch.device) -> Any:
    """The batch's model inputs on ``device`` (targets and mask stay where they are)."""
    return MicroBatch(
        indices=batch.indices,
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        targets=batch.targets,
        loss_mask=batch.loss_mask,
    )
