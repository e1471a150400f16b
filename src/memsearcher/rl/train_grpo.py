"""Multi-context GRPO (DESIGN.md section 6), top to bottom.

Each step: roll out G trajectories for each of this rank's questions; score them; normalize the
rewards within each group; give every turn sequence its trajectory's advantage; recompute the
old (and reference) log-probs; run PPO epochs over mini-batches with gradient accumulation;
log; checkpoint. MemSearcher and ReAct share this path: a ReAct trajectory is one sequence.

With ``advantage: gae`` the same loop is PPO with a critic (MEM1's algorithm): advantages come
per token from GAE over each trajectory's turns instead of per group, and the critic takes one
update of its clipped value loss beside every policy update (`memsearcher.rl.critic`).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from memsearcher.agent import load_templates, run_lockstep, start_episodes
from memsearcher.data.flashrag import read_examples
from memsearcher.errors import MemSearcherError
from memsearcher.eval.metrics import exact_match
from memsearcher.llm.base import SamplingParams, derive_seed
from memsearcher.llm.hf import HFModel
from memsearcher.retrieval import open_retriever
from memsearcher.rl.advantages import broadcast_to_turns, degenerate_groups, group_advantages
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
from memsearcher.rl.checkpoint import resume_step, save_checkpoint
from memsearcher.rl.config import GRPOConfig, config_to_dict
from memsearcher.rl.critic import critic_gradients, gae_targets, response_values
from memsearcher.rl.distributed import (
    Runtime,
    any_rank,
    even_out,
    gathered,
    init_runtime,
    no_sync,
    reduce_mean,
    sum_over_ranks,
    wrap_for_training,
)
from memsearcher.rl.loss import AGGREGATIONS, policy_loss
from memsearcher.rl.metrics_log import MetricsLog
from memsearcher.rl.optim import make_optimizer, make_scheduler, optimizer_step
from memsearcher.rl.policy import (
    Precision,
    autocast,
    disable_dropout,
    frozen_copy,
    load_policy,
    resolve_precision,
)
from memsearcher.rl.rewards import get_reward
from memsearcher.rl.seeding import draw, seed_everything
from memsearcher.rl.value import Critic, load_critic
from memsearcher.types import TokenSequence, Trajectory

__all__ = ["accumulate_gradients", "learner_sequences", "train_grpo"]

LOSS_METRICS = ("train/loss", "train/pg_loss", "train/clip_fraction", "train/ratio_mean")


def train_grpo(
    config: GRPOConfig, resume: bool = False, echo: Callable[[str], None] | None = None
) -> Any:
    """Train and return the trained model; checkpoints are ``config.output_dir/step-N``."""
    if config.aggregation not in AGGREGATIONS:
        raise MemSearcherError(
            f"unknown aggregation {config.aggregation!r}; choose from {sorted(AGGREGATIONS)}"
        )
    runtime = init_runtime(config.model.device)
    if config.questions_per_step % (
        runtime.world_size * config.updates_per_step // config.ppo_epochs
    ):
        raise MemSearcherError(
            f"questions_per_step ({config.questions_per_step}) must split evenly over "
            f"{runtime.world_size} ranks and their mini-batches"
        )
    seed_everything(config.seed)
    output = Path(config.output_dir)
    questions = read_examples(config.data)
    if not questions:
        raise MemSearcherError(f"{config.data}: no questions to train on")
    reward_fn = get_reward(config.reward)
    templates = load_templates(config.templates)
    retriever = open_retriever(config.retriever)
    precision = resolve_precision(config.model, runtime.device.type)
    model, hf_tokenizer = load_policy(config.model, runtime, precision)
    # Full fine-tuning keeps a frozen copy of the start as the KL reference; LoRA gets it for
    # free by switching its adapters off.
    lora = hasattr(model, "disable_adapter")
    gae = config.advantage == "gae"
    on_policy = config.updates_per_step == 1 and not gae  # GAE's KL reward reads old log-probs
    if config.share_prefix and runtime.world_size > 1:
        raise MemSearcherError(
            "share_prefix runs two forward passes per micro-batch, which DDP/FSDP cannot "
            "synchronize; set share_prefix: false under distributed launch"
        )
    needs_ref = config.beta > 0 or (gae and config.critic.kl_reward > 0)
    reference = frozen_copy(model, precision) if needs_ref and not lora else None
    llm = HFModel(model, hf_tokenizer, batch_size=config.model.rollout_batch_size)
    pad_id = llm.tokenizer.pad_token_id
    learner = wrap_for_training(model, runtime, config.model.distributed)
    optimizer = make_optimizer(model, config.optim)
    total_steps = config.steps or math.ceil(len(questions) / config.questions_per_step)
    scheduler = make_scheduler(optimizer, config.optim, total_steps * config.updates_per_step)
    start = resume_step(output, resume, model, optimizer, scheduler, runtime)
    if gae:
        critic, critic_learner, critic_optimizer, critic_scheduler = setup_critic(
            config, runtime, precision, total_steps * config.updates_per_step
        )
        critic_state = (critic_learner.model, critic_optimizer, critic_scheduler)
        if resume_step(output / "critic", resume, *critic_state, runtime) != start:
            raise MemSearcherError(
                f"{output / 'critic'}: the critic's last checkpoint is not of step {start}, the "
                "policy's; resume from a step where both were saved"
            )
    log = MetricsLog(output, runtime, config.tensorboard, echo, start)
    log.config(config_to_dict(config))
    group = config.group_size
    per_rank = config.questions_per_step // runtime.world_size
    bar = tqdm(total=total_steps, initial=start, disable=not runtime.is_main, desc="grpo")

    for step in range(start + 1, total_steps + 1):
        step_start = time.perf_counter()
        # 1. Rollouts: this rank's shard of the step's questions, a whole group per rank, the
        # G trajectories of a question adjacent; a seed stream of its own per (step, rank).
        step_ids = draw(
            len(questions),
            (step - 1) * config.questions_per_step,
            config.questions_per_step,
            config.seed,
        )
        mine = [questions[i] for i in step_ids[runtime.rank :: runtime.world_size]]
        model.eval()
        episodes = start_episodes(
            config.agent_name,
            [q for q in mine for _ in range(group)],
            llm.tokenizer,
            config.agent,
            templates,
            llm.max_context_tokens,
        )
        sampling = SamplingParams(
            temperature=config.temperature, seed=derive_seed(config.seed, step, runtime.rank)
        )
        with gathered(model), autocast(precision.compute, runtime.device):
            trajectories = run_lockstep(episodes, llm, retriever, sampling)
        rollout_time = time.perf_counter() - step_start

        # 2. Rewards, then group-relative advantages (with GAE, for the metrics only).
        rewards = torch.tensor([reward_fn(t) for t in trajectories], dtype=torch.float32)
        advantages, metrics = group_advantages(rewards, group, config.normalize_std)
        metrics.update(rollout_metrics(trajectories, rewards))

        # 3. Learner sequences: every turn of trajectory j carries A_j.
        keep = list(range(len(trajectories)))
        if config.filter_degenerate:
            degenerate = degenerate_groups(rewards, group)
            keep = [j for j in keep if not degenerate[j // group]]
        sequences, adv_all, traj_all = learner_sequences(trajectories, advantages, keep)
        lengths = [len(s.input_ids) for s in sequences]

        # 4. Old log-probs from the current weights (as veRL), and reference log-probs. With
        # one update a step, the old weights are the ones being updated: the update's own
        # log-probs, detached, are the old ones, and a forward pass is saved.
        old: list[torch.Tensor] | None = None
        if not on_policy:
            with gathered(model):
                old = response_logprobs(
                    model, sequences, config.micro_batch_tokens, pad_id, config.temperature,
                    precision.compute, config.share_prefix,
                )  # fmt: skip
        ref: list[torch.Tensor] | None = None
        if needs_ref:
            with gathered(model), model.disable_adapter() if lora else nullcontext():
                ref = response_logprobs(
                    reference if reference is not None else model,
                    sequences,
                    config.micro_batch_tokens,
                    pad_id,
                    config.temperature,
                    precision.compute,
                    config.share_prefix,
                )
        per_token: list[torch.Tensor] | torch.Tensor = adv_all
        if gae:  # PPO: per-token advantages and returns from the critic's values
            with gathered(critic.model):
                values = response_values(
                    critic, sequences, config.micro_batch_tokens, pad_id, precision.compute
                )
            assert old is not None  # GAE is never on_policy: its KL reward reads them
            per_token, returns, reward_parts = gae_targets(
                sequences, traj_all, rewards, values, config.critic, old, ref
            )
            metrics.update(reward_parts)

        # 5. PPO epochs over mini-batches of questions; accumulate, then one optimizer step.
        # A mini-batch with no learning signal on any rank is skipped by all of them: a
        # zero-gradient step would still move the weights along Adam's moments.
        learner_start = time.perf_counter()
        model.train()
        sums: dict[str, float] = {}
        batches = []
        updates = skipped = 0
        for members in mini_batches(traj_all, per_rank, group, config, step):
            if not gae and not any_rank(has_signal(members, adv_all, config.beta), runtime):
                skipped += 1
                continue
            micro = learner_batches(sequences, members, lengths, traj_all, pad_id, config)
            micro = even_out(micro, learner, runtime)
            parts = accumulate_gradients(
                learner, micro, old, ref, per_token, traj_all, config, runtime, precision.compute
            )
            parts["train/grad_norm"] = optimizer_step(model, optimizer, scheduler, config.optim)
            if gae:
                parts.update(
                    critic_gradients(
                        critic_learner, micro, values, returns, config.critic, runtime,
                        precision.compute,
                    )
                )  # fmt: skip
                norm = optimizer_step(
                    critic.model, critic_optimizer, critic_scheduler, config.optim
                )
                parts["critic/grad_norm"] = norm
            for key, value in parts.items():
                sums[key] = sums.get(key, 0.0) + value
            batches += micro
            updates += 1
        model.eval()

        # 6. Log, samples, checkpoint.
        learner_time = time.perf_counter() - learner_start
        metrics.update({key: total / updates for key, total in sums.items()})
        metrics["train/skipped_updates"] = float(skipped)
        metrics["train/lr"] = float(scheduler.get_last_lr()[0])
        metrics["train/padding_share"] = padding_share(batches)
        metrics["train/tokens_per_s"] = sum(b.padded_tokens for b in batches) / learner_time
        metrics["time/rollout"] = rollout_time
        metrics["time/learner"] = learner_time
        metrics["time/step"] = time.perf_counter() - step_start
        metrics = reduce_mean(metrics, runtime)
        if step % config.log_every == 0 or step == total_steps:
            log.log(step, total_steps, metrics)
        if runtime.is_main and config.sample_every and step % config.sample_every == 0:
            save_samples(output / "samples" / f"step-{step}.jsonl", trajectories[:group], rewards)
        if step % config.save_every == 0 or step == total_steps:
            state = {"kind": "grpo", "data_position": step * config.questions_per_step}
            save_checkpoint(output, step, model, hf_tokenizer, optimizer, scheduler, state, runtime)
            if gae:
                save_checkpoint(
                    output / "critic", step, critic_learner.model, hf_tokenizer,
                    critic_optimizer, critic_scheduler, state, runtime,
                )  # fmt: skip
        bar.update(1)
    bar.close()
    log.close()
    return model


def setup_critic(
    config: GRPOConfig, runtime: Runtime, precision: Precision, updates: int
) -> tuple[Critic, Critic, torch.optim.Optimizer, Any]:
    """The critic as it scores rollouts and as the ranks train it (one set of weights), its
    AdamW at ``critic.lr`` (the policy's other optimizer settings) and its schedule."""
    path = config.critic.path or config.model.path
    if path == "embedded":
        from memsearcher.llm.embedded import embedded_model_path

        path = str(embedded_model_path())
    model = load_critic(path, str(runtime.device), precision.weights).model
    disable_dropout(model)
    optim = replace(config.optim, lr=config.critic.lr)
    optimizer = make_optimizer(model, optim)
    scheduler = make_scheduler(optimizer, optim, updates)
    learner = Critic(wrap_for_training(model, runtime, config.model.distributed))
    return Critic(model), learner, optimizer, scheduler


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
    question_of = (trajectory_ids // group).tolist()  # (S,)
    for epoch in range(config.ppo_epochs):
        order = list(range(per_rank))
        random.Random(f"{config.seed}/{step}/{epoch}").shuffle(order)
        for mini in range(minis):
            chosen = set(order[mini::minis])
            yield [s for s, question in enumerate(question_of) if question in chosen]


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
) -> list[MicroBatch]:
    """A mini-batch's sequences cut into micro-batches; a rank with none of the mini-batch
    gets one `blank_batch`, so that it still joins the ranks' gradient all-reduce."""
    if not members:
        return [blank_batch(pad_id)]
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
            logprobs = sequence_logprobs(
                learner, batch, config.temperature, compute, entropy
            )  # (B, R)
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


def rollout_metrics(trajectories: list[Trajectory], rewards: torch.Tensor) -> dict[str, float]:
    """Reward, answer and shape statistics of one step's trajectories."""
    turns = [len(t.turns) for t in trajectories]
    prompts = [turn.prompt_tokens for t in trajectories for turn in t.turns]
    em = [
        exact_match(t.answer, t.example.golden_answers) if t.well_formed and t.answer else 0.0
        for t in trajectories
    ]
    n = len(trajectories)
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std(correction=0).item(),
        "reward/em": sum(em) / n,
        "rollout/format_failure": sum(t.end_reason == "format_error" for t in trajectories) / n,
        "rollout/well_formed": sum(t.well_formed for t in trajectories) / n,
        "rollout/turns": sum(turns) / n,
        "rollout/prompt_tokens": sum(prompts) / max(1, len(prompts)),
        "rollout/searches": sum(t.num_searches for t in trajectories) / n,
        "rollout/sequences": float(sum(len(t.sequences) for t in trajectories)),
    }


def save_samples(path: Path, trajectories: list[Trajectory], rewards: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for trajectory, reward in zip(trajectories, rewards.tolist(), strict=False):
            record: dict[str, Any] = {"reward": reward, **trajectory.to_dict()}
            out.write(json.dumps(record) + "\n")
