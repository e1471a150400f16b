"""PPO with a critic (MEM1's algorithm), top to bottom: the GRPO loop's rollouts, with
per-token advantages from GAE over each trajectory's turns against a learned value model.

Each step: roll out G trajectories for each of this rank's questions; score them; compute the
old and reference log-probs and the critic's values; GAE gives every action token its
advantage and return (`memsearcher.rl.critic`); PPO epochs over mini-batches, the critic taking
one update of its clipped value loss beside every policy update; log; checkpoint (the critic's
under ``output_dir/critic``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from tqdm import tqdm

from memsearcher.errors import MemSearcherError
from memsearcher.rl.advantages import group_advantages
from memsearcher.rl.checkpoint import load_checkpoint, save_checkpoint
from memsearcher.rl.config import GRPOConfig
from memsearcher.rl.critic import critic_gradients, gae_targets, response_values
from memsearcher.rl.distributed import Runtime, even_out, gathered, reduce_mean, wrap_for_training
from memsearcher.rl.learner import (
    accumulate_gradients,
    learner_batches,
    learner_metrics,
    learner_sequences,
    mini_batches,
    response_logprobs_of,
)
from memsearcher.rl.optim import make_optimizer, make_scheduler, optimizer_step
from memsearcher.rl.policy import Precision, disable_dropout
from memsearcher.rl.rollout import roll_out, rollout_metrics, save_samples
from memsearcher.rl.setup import set_up
from memsearcher.rl.value import Critic, load_critic

__all__ = ["setup_critic", "train_ppo"]


def train_ppo(
    config: GRPOConfig, resume: bool | int = False, echo: Callable[[str], None] | None = None
) -> Any:
    """Train and return the trained policy; checkpoints are ``config.output_dir/step-N`` and
    the critic's ``config.output_dir/critic/step-N``, saved first, so that the policy's
    step-N says both are there; a resumed run loads the critic of the policy's step."""
    config = replace(config, advantage="gae")
    needs_ref = config.beta > 0 or config.critic.kl_reward > 0
    run = set_up(config, resume, echo, needs_ref)
    model, runtime, compute = run.model, run.runtime, run.precision.compute
    updates_total = run.total_steps * config.updates_per_step
    critic, critic_learner, critic_optimizer, critic_scheduler = setup_critic(
        config, runtime, run.precision, updates_total
    )
    critic_state = (critic_learner.model, critic_optimizer, critic_scheduler)
    if run.start:
        saved = run.output / "critic" / f"step-{run.start}"
        if not (saved / "state.json").is_file():
            raise MemSearcherError(
                f"--resume: no checkpoint in {run.output / 'critic'} for step {run.start}, the "
                "policy's last; resume from a step where both were saved"
            )
        load_checkpoint(saved, *critic_state, runtime)
    group = config.group_size
    per_rank = config.questions_per_step // runtime.world_size
    bar = tqdm(total=run.total_steps, initial=run.start, disable=not runtime.is_main, desc="ppo")

    for step in range(run.start + 1, run.total_steps + 1):
        step_start = time.perf_counter()
        # 1. Rollouts, as GRPO's.
        trajectories = roll_out(config, step, run.task, run.llm, run.precision, runtime)
        rollout_time = time.perf_counter() - step_start

        # 2. Rewards (group-relative advantages only for the metrics), every trajectory kept.
        rewards = torch.tensor([run.reward_fn(t) for t in trajectories], dtype=torch.float32)
        advantages, metrics = group_advantages(rewards, group, config.normalize_std)
        metrics.update(rollout_metrics(trajectories, rewards))
        sequences, _, traj_all = learner_sequences(
            trajectories, advantages, range(len(trajectories))
        )
        lengths = [len(s.input_ids) for s in sequences]

        # 3. Old and reference log-probs, the critic's values, then GAE: per-token advantages
        # and returns.
        old = response_logprobs_of(model, sequences, config, run.pad_id, compute)
        ref = None
        if needs_ref:
            ref = response_logprobs_of(
                run.reference or model, sequences, config, run.pad_id, compute,
                adapters_off=run.lora,
            )  # fmt: skip
        with gathered(critic.model):
            values = response_values(
                critic, sequences, config.micro_batch_tokens, run.pad_id, compute
            )
        per_token, returns, reward_parts = gae_targets(
            sequences, traj_all, rewards, values, config.critic, old, ref
        )
        metrics.update(reward_parts)

        # 4. PPO epochs over mini-batches of questions: a policy update and a critic update.
        learner_start = time.perf_counter()
        model.train()
        sums: dict[str, float] = {}
        batches = []
        updates = 0
        for members in mini_batches(traj_all, per_rank, group, config, step):
            micro = learner_batches(
                sequences, members, lengths, traj_all, run.pad_id, config, run.mask_kind
            )
            micro = even_out(micro, run.learner, runtime)
            parts = accumulate_gradients(
                run.learner, micro, old, ref, per_token, traj_all, config, runtime, compute
            )
            parts["train/grad_norm"] = optimizer_step(
                model, run.optimizer, run.scheduler, config.optim
            )
            parts.update(critic_gradients(critic_learner, micro, values, returns,
                                          config.critic, runtime, compute))  # fmt: skip
            parts["critic/grad_norm"] = optimizer_step(
                critic.model, critic_optimizer, critic_scheduler, config.optim
            )
            for key, value in parts.items():
                sums[key] = sums.get(key, 0.0) + value
            batches += micro
            updates += 1
        model.eval()

        # 5. Log, samples, checkpoints of the policy and the critic.
        learner_time = time.perf_counter() - learner_start
        metrics.update(learner_metrics(sums, updates, 0, batches, learner_time, run.scheduler))
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
            save_checkpoint(run.output / "critic", step, critic_learner.model, run.tokenizer,
                            critic_optimizer, critic_scheduler, state, runtime)  # fmt: skip
            save_checkpoint(run.output, step, model, run.tokenizer, run.optimizer,
                            run.scheduler, state, runtime)  # fmt: skip
        bar.update(1)
    bar.close()
    run.log.close()
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
