"""Multi-context GRPO (DESIGN.md section 6), top to bottom.

Each step: roll out G trajectories for each of this rank's questions; score them; normalize the
rewards within each group; give every turn sequence its trajectory's advantage; compute the old
(and reference) log-probs; run PPO epochs over mini-batches with gradient accumulation; log;
checkpoint. MemSearcher and ReAct share this path: a ReAct trajectory is one sequence.

PPO with a critic (``advantage: gae``, MEM1's algorithm) has a loop of its own,
`memsearcher.rl.train_ppo`; `train_grpo` hands such a config over to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from memsearcher.rl.advantages import degenerate_groups, group_advantages, question_of
from memsearcher.rl.checkpoint import save_checkpoint
from memsearcher.rl.config import GRPOConfig
from memsearcher.rl.distributed import any_rank, even_out, reduce_mean
from memsearcher.rl.learner import (
    accumulate_gradients,
    has_signal,
    learner_batches,
    learner_metrics,
    learner_sequences,
    mini_batches,
    response_logprobs_of,
)
from memsearcher.rl.optim import optimizer_step
from memsearcher.rl.rollout import roll_out, rollout_metrics, save_samples
from memsearcher.rl.setup import set_up

__all__ = ["train_grpo"]


def train_grpo(
    config: GRPOConfig, resume: bool | int = False, echo: Callable[[str], None] | None = None
) -> Any:
    """Train and return the trained model; checkpoints are ``config.output_dir/step-N``."""
    if config.advantage == "gae":
        from memsearcher.rl.train_ppo import train_ppo

        return train_ppo(config, resume, echo)
    run = set_up(config, resume, echo, needs_ref=config.beta > 0)
    model, runtime, compute = run.model, run.runtime, run.precision.compute
    group = config.group_size
    per_rank = config.questions_per_step // runtime.world_size
    # with one update a step, the old weights are the ones being updated: the update's own
    # log-probs, detached, can stand for the old ones, and a forward pass is saved
    on_policy = config.reuse_logprobs and config.updates_per_step == 1
    bar = tqdm(total=run.total_steps, initial=run.start, disable=not runtime.is_main, desc="grpo")

    for step in range(run.start + 1, run.total_steps + 1):
        step_start = time.perf_counter()
        # 1. Rollouts: this rank's shard of the step's questions, a whole group per rank.
        trajectories = roll_out(config, step, run.task, run.llm, run.precision, runtime)
        rollout_time = time.perf_counter() - step_start

        # 2. Rewards, then group-relative advantages.
        rewards = torch.tensor([run.reward_fn(t) for t in trajectories], dtype=torch.float32)
        advantages, metrics = group_advantages(rewards, group, config.normalize_std)
        metrics.update(rollout_metrics(trajectories, rewards))

        # 3. Learner sequences: every turn of trajectory j carries A_j.
        keep = list(range(len(trajectories)))
        if config.filter_degenerate:
            degenerate = degenerate_groups(rewards, group)
            keep = [j for j in keep if not degenerate[question_of(j, group)]]
        sequences, adv_all, traj_all = learner_sequences(trajectories, advantages, keep)
        lengths = [len(s.input_ids) for s in sequences]

        # 4. Old log-probs from the current weights (as veRL), and reference log-probs.
        old = None if on_policy else response_logprobs_of(
            model, sequences, config, run.pad_id, compute)  # fmt: skip
        ref = None
        if config.beta > 0:
            ref = response_logprobs_of(
                run.reference or model, sequences, config, run.pad_id, compute,
                adapters_off=run.lora,
            )  # fmt: skip

        # 5. PPO epochs over mini-batches of questions; accumulate, then one optimizer step.
        # A mini-batch with no learning signal on any rank is skipped by all of them: a
        # zero-gradient step would still move the weights along Adam's moments.
        learner_start = time.perf_counter()
        model.train()
        sums: dict[str, float] = {}
        batches = []
        updates = skipped = 0
        for members in mini_batches(traj_all, per_rank, group, config, step):
            if not any_rank(has_signal(members, adv_all, config.beta), runtime):
                skipped += 1
                continue
            micro = learner_batches(
                sequences, members, lengths, traj_all, run.pad_id, config, run.mask_kind
            )
            micro = even_out(micro, run.learner, runtime)
            parts = accumulate_gradients(
                run.learner, micro, old, ref, adv_all, traj_all, config, runtime, compute
            )
            parts["train/grad_norm"] = optimizer_step(
                model, run.optimizer, run.scheduler, config.optim
            )
            for key, value in parts.items():
                sums[key] = sums.get(key, 0.0) + value
            batches += micro
            updates += 1
        model.eval()

        # 6. Log, samples, checkpoint.
        learner_time = time.perf_counter() - learner_start
        metrics.update(learner_metrics(sums, updates, skipped, batches, learner_time,
                                       run.scheduler))  # fmt: skip
        metrics["time/rollout"] = rollout_time
        metrics["time/learner"] = learner_time
        metrics["time/step"] = time.perf_counter() - step_start
        metrics = reduce_mean(metrics, runtime)
        if step % config.log_every == 0 or step == run.total_steps:
            run.log.log(step, run.total_steps, metrics)
        if runtime.is_main and config.sample_every and step % config.sample_every == 0:
            path = run.output / "samples" / f"step-{step}.jsonl"
            save_samples(path, trajectories, rewards)
        if step % config.save_every == 0 or step == run.total_steps:
            state = {"kind": "grpo", "data_position": step * config.questions_per_step}
            save_checkpoint(run.output, step, model, run.tokenizer, run.optimizer,
                            run.scheduler, state, runtime)  # fmt: skip
        bar.update(1)
    bar.close()
    run.log.close()
    return model
