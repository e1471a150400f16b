"""The learner's side of both RL loops (`train_grpo`, `train_ppo`): turn sequences with their
advantages, mini-batches of questions, micro-batches, and gradient accumulation of the policy
loss over them, plus the per-step learner metrics and checkpoints both loops write."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from typing import Any

import torch

from memsearcher.rl.advantages import broadcast_to_turns, question_of
from memsearcher.rl.batching import (
    MicroBatch,
    blank_batch,
    collate,
    padding_share,
    plan_micro_batches,
    response_logprobs,
    right_aligned,
    sequence_logprobs,
)
from memsearcher.rl.config import GRPOConfig
from memsearcher.rl.distributed import Runtime, gathered, no_sync, sum_over_ranks
from memsearcher.rl.loss import AGGREGATIONS, policy_loss
from memsearcher.rl.packing import (
    PackedMicroBatch,
    collate_trajectories,
    pack,
    packed_sequence_logprobs,
)
from memsearcher.types import TokenSequence, Trajectory

__all__ = [
    "LOSS_METRICS",
    "accumulate_gradients",
    "has_signal",
    "learner_batches",
    "learner_metrics",
    "learner_sequences",
    "mini_batches",
    "response_logprobs_of",
]

LOSS_METRICS = ("train/loss", "train/pg_loss", "train/clip_fraction", "train/ratio_mean")


def learner_sequences(
    trajectories: list[Trajectory], advantages: torch.Tensor, keep: Iterable[int]
) -> tuple[list[TokenSequence], torch.Tensor, torch.Tensor]:
    """The turn sequences of the kept trajectories, each trajectory's advantage broadcast to
    its turns (`broadcast_to_turns`), and which trajectory each sequence came from: (S,), (S,).
    """
    kept = [j for j in keep if trajectories[j].sequences]  # none if it ended before acting
    turns = [len(trajectories[j].sequences) for j in kept]
    sequences = [s for j in kept for s in trajectories[j].sequences]
    if not kept:
        return sequences, torch.zeros(0), torch.zeros(0, dtype=torch.long)
    index = torch.tensor(kept, dtype=torch.long)  # (K,)
    return (
        sequences,
        broadcast_to_turns(advantages[index], turns),  # (S,)
        broadcast_to_turns(index, turns),  # (S,)
    )


def mini_batches(
    trajectory_ids: torch.Tensor, per_rank: int, group: int, config: GRPOConfig, step: int
) -> Iterator[list[int]]:
    """Sequence indices of each mini-batch of every PPO epoch: this rank's questions shuffled
    per epoch and dealt into ``updates_per_step / ppo_epochs`` mini-batches, each question with
    all the turns of all its trajectories."""
    minis = config.questions_per_step // config.mini_batch_questions
    questions = question_of(trajectory_ids, group).tolist()  # (S,)
    for epoch in range(config.ppo_epochs):
        order = list(range(per_rank))
        random.Random(f"{config.seed}/{step}/{epoch}").shuffle(order)
        for mini in range(minis):
            chosen = set(order[mini::minis])
            yield [s for s, question in enumerate(questions) if question in chosen]


def has_signal(members: list[int], advantages: torch.Tensor, beta: float) -> bool:
    """Whether these sequences give a gradient: a non-zero advantage, or the KL term."""
    return bool(members) and (beta > 0 or bool((advantages[members] != 0).any()))


def learner_batches(
    sequences: list[TokenSequence],
    members: list[int],
    lengths: list[int],
    trajectory_ids: torch.Tensor,
    pad_id: int,
    config: GRPOConfig,
    mask_kind: str | None = None,
) -> list[MicroBatch]:
    """A mini-batch's sequences cut into micro-batches; a rank with none of the mini-batch
    gets one `blank_batch`, so that it still joins the ranks' gradient all-reduce. With
    ``learner: packed``, each trajectory is one packed row with a ``mask_kind`` mask
    (`packing.mask_kind_of` the model)."""
    if not members:
        return [blank_batch(pad_id)]
    if config.learner == "packed":
        assert mask_kind is not None, "learner: packed needs the model's mask kind"
        trajectories = _units(members, trajectory_ids.tolist(), "trajectory-mean")
        packs = [pack([sequences[s] for s in t]) for t in trajectories]
        plans = plan_micro_batches([len(p.input_ids) for p in packs], config.micro_batch_tokens)
        return [
            collate_trajectories(
                sequences,
                [trajectories[t] for t in plan],
                [packs[t] for t in plan],
                pad_id,
                mask_kind,
            )  # fmt: skip
            for plan in plans
        ]
    units = _units(members, trajectory_ids.tolist(), config.aggregation)
    plans = plan_micro_batches(lengths, config.micro_batch_tokens, units)
    return [collate(sequences, plan, pad_id, config.share_prefix) for plan in plans]


def accumulate_gradients(
    learner: Any,
    batches: list[MicroBatch],
    old: list[torch.Tensor] | None,
    ref: list[torch.Tensor] | None,
    advantages: torch.Tensor | list[torch.Tensor],
    trajectory_ids: torch.Tensor,
    config: GRPOConfig,
    runtime: Runtime,
    compute: str | None = None,
) -> dict[str, float]:
    """Backward passes over the micro-batches of one mini-batch, each weighted by its share of
    the units (`loss.Aggregation.units`) of the whole mini-batch *over all ranks*, so that the
    gradient, once DDP/FSDP averages the ranks, is that of the policy loss over the whole
    mini-batch; returns the loss metrics weighted the same way (their mean over ranks is the
    mini-batch's). Every rank must call this.

    ``old``/``ref``: per sequence, response log-probs (``old`` None: on-policy, the pass's own
    log-probs, detached, so the ratio is exactly 1); ``trajectory_ids``: (S,);
    ``advantages``: (S,), one per sequence (GRPO), or per sequence its response's (PPO).
    With ``config.entropy_coef`` > 0 the loss subtracts that times the aggregated entropy.
    """
    units = AGGREGATIONS[config.aggregation].units

    def count(batch: MicroBatch) -> float:
        if not batch.loss_mask.any():  # a blank pass (`blank_batch`, `even_out`)
            return 0.0
        return units(batch.loss_mask, trajectory_ids[list(batch.indices)])

    total = sum_over_ranks(sum(count(b) for b in batches), runtime)
    # the same keys on every rank, blank or not, for `reduce_mean`
    keys = [*LOSS_METRICS, *(["train/kl"] if ref is not None else [])]
    keys += ["train/entropy"] if config.entropy_coef > 0 else []
    aggregate = AGGREGATIONS[config.aggregation].reduce
    sums = dict.fromkeys(keys, 0.0)
    for k, batch in enumerate(batches):
        index = list(batch.indices)
        weight = count(batch) * runtime.world_size / max(total, 1.0)
        with no_sync(learner, sync=k == len(batches) - 1):
            entropy: list[torch.Tensor] | None = [] if config.entropy_coef > 0 else None
            if isinstance(batch, PackedMicroBatch):
                logprobs = packed_sequence_logprobs(
                    learner, batch, config.temperature, compute, entropy
                )  # (B, R)
            else:
                logprobs = sequence_logprobs(learner, batch, config.temperature, compute, entropy)
            if weight == 0:  # a pass that only keeps the ranks' collectives in step
                (logprobs.sum() * 0.0).backward()
                continue
            device = logprobs.device
            if isinstance(advantages, torch.Tensor):
                batch_advantages = advantages[index]  # (B,)
            else:
                batch_advantages = right_aligned(advantages, batch)  # (B, R)
            loss, parts = policy_loss(
                logprobs,
                logprobs.detach() if old is None else right_aligned(old, batch).to(device),
                batch_advantages.to(device),
                batch.loss_mask.to(device),
                config.clip_low,
                config.clip_high,
                ref_logprobs=None if ref is None else right_aligned(ref, batch).to(device),
                beta=config.beta,
                aggregation=config.aggregation,
                trajectory_ids=trajectory_ids[index].to(device),
            )
            if entropy:
                mask = batch.loss_mask.to(device)
                bonus = aggregate(entropy[0], mask, trajectory_ids[index].to(device))
                loss = loss - config.entropy_coef * bonus
                parts["train/entropy"] = bonus.detach()
            (loss * weight).backward()
        for key, part in {"train/loss": loss.detach(), **parts}.items():
            sums[key] += float(part) * weight
    return sums


def _units(members: list[int], seq_traj: list[int], aggregation: str) -> list[list[int]]:
    """Sequences that must share a micro-batch: a trajectory's, for trajectory-mean."""
    if aggregation != "trajectory-mean":
        return [[s] for s in members]
    by_trajectory: dict[int, list[int]] = {}
    for s in members:
        by_trajectory.setdefault(seq_traj[s], []).append(s)
    return list(by_trajectory.values())


def response_logprobs_of(
    model: Any,
    sequences: list[TokenSequence],
    config: GRPOConfig,
    pad_id: int,
    compute: str | None,
    adapters_off: bool = False,
) -> list[torch.Tensor]:
    """`batching.response_logprobs` of ``model`` with ``config``'s budget, temperature and
    prefix sharing; with ``adapters_off``, of a LoRA model with its adapters switched off (the
    KL reference)."""
    with gathered(model), model.disable_adapter() if adapters_off else nullcontext():
        return response_logprobs(
            model, sequences, config.micro_batch_tokens, pad_id, config.temperature, compute,
            config.share_prefix,
        )  # fmt: skip


def learner_metrics(
    sums: dict[str, float], updates: int, skipped: int, batches: list[MicroBatch], seconds: float,
    scheduler: Any,
) -> dict[str, float]:  # fmt: skip
    """The step's learner metrics: the updates' mean loss parts, skipped updates, the lr, the
    padding share and tokens per second of the passes."""
    metrics = {key: total / updates for key, total in sums.items()}
    metrics["train/skipped_updates"] = float(skipped)
    metrics["train/lr"] = float(scheduler.get_last_lr()[0])
    metrics["train/padding_share"] = padding_share(batches)
    metrics["train/tokens_per_s"] = sum(b.padded_tokens for b in batches) / seconds
    return metrics
