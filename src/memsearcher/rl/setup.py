"""What both RL loops (`train_grpo`, `train_ppo`) build before their first step: the ranks,
the task (its questions, their environment, how their episodes start), the reward, the policy
with its rollout backend, optimizer and schedule (resumed from the last checkpoint if asked),
the KL reference and the metrics log."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memsearcher.config import config_to_dict, default_dict
from memsearcher.errors import MemSearcherError
from memsearcher.llm.hf import HFModel
from memsearcher.rl.checkpoint import check_run_folder, resume_step
from memsearcher.rl.config import GRPOConfig
from memsearcher.rl.distributed import Runtime, init_runtime, wrap_for_training
from memsearcher.rl.metrics_log import MetricsLog
from memsearcher.rl.optim import make_optimizer, make_scheduler
from memsearcher.rl.packing import mask_kind_of
from memsearcher.rl.policy import Precision, frozen_copy, load_policy, resolve_precision
from memsearcher.rl.rewards import get_reward
from memsearcher.rl.seeding import seed_everything
from memsearcher.rl.tasks import Task, open_task
from memsearcher.types import Trajectory

__all__ = ["RLRun", "set_up"]


@dataclass
class RLRun:
    """Everything a loop's steps use, built once."""

    runtime: Runtime
    output: Path
    task: Task
    """The questions, the environment they are acted on in, and how their episodes start."""
    reward_fn: Callable[[Trajectory], float]
    precision: Precision
    model: Any
    """The policy as the rollouts and the checkpoints see it."""
    tokenizer: Any
    """Its HF tokenizer (saved with every checkpoint)."""
    learner: Any
    """The policy as the ranks train it (DDP / FSDP wrapped, or the model itself)."""
    llm: HFModel
    reference: Any
    """The frozen KL reference of full fine-tuning; None with LoRA (its adapters switch off)
    or without a KL term."""
    optimizer: Any
    scheduler: Any
    mask_kind: str | None
    """The packed learner's attention mask kind (`packing.mask_kind_of`); None per turn."""
    total_steps: int
    start: int
    """The last step already done (0: a fresh run)."""
    log: MetricsLog

    @property
    def lora(self) -> bool:
        return hasattr(self.model, "disable_adapter")

    @property
    def pad_id(self) -> int:
        return self.llm.tokenizer.pad_token_id


def set_up(
    config: GRPOConfig, resume: bool | int, echo: Callable[[str], None] | None, needs_ref: bool
) -> RLRun:
    """Check what the ranks need of ``config``, then build the run; ``needs_ref``: whether the
    loop reads reference log-probs."""
    runtime = init_runtime(config.model.device)
    if config.questions_per_step % (
        runtime.world_size * config.updates_per_step // config.ppo_epochs
    ):
        raise MemSearcherError(
            f"questions_per_step ({config.questions_per_step}) must split evenly over "
            f"{runtime.world_size} ranks and their mini-batches"
        )
    if config.share_prefix and runtime.world_size > 1:
        raise MemSearcherError(
            "share_prefix runs two forward passes per micro-batch, which DDP/FSDP cannot "
            "synchronize; set share_prefix: false under distributed launch"
        )
    seed_everything(config.seed)
    output = Path(config.output_dir)
    check_run_folder(output, config_to_dict(config), resume, runtime, default_dict(type(config)))
    task = open_task(config)
    precision = resolve_precision(config.model, runtime.device.type)
    model, tokenizer = load_policy(config.model, runtime, precision)
    # Full fine-tuning keeps a frozen copy of the start as the KL reference; LoRA gets it for
    # free by switching its adapters off.
    lora = hasattr(model, "disable_adapter")
    reference = frozen_copy(model, precision) if needs_ref and not lora else None
    llm = HFModel(
        model, tokenizer, config.model.rollout_batch_size, config.share_prefix,
        config.model.chat_template_kwargs,
    )  # fmt: skip
    mask_kind = mask_kind_of(model) if config.learner == "packed" else None
    learner = wrap_for_training(model, runtime, config.model.distributed)
    optimizer = make_optimizer(model, config.optim)
    total_steps = config.steps or math.ceil(len(task.questions) / config.questions_per_step)
    scheduler = make_scheduler(optimizer, config.optim, total_steps * config.updates_per_step)
    start = resume_step(output, resume, model, optimizer, scheduler, runtime)
    log = MetricsLog(output, runtime, config.tensorboard, echo, start)
    log.config(config_to_dict(config))
    return RLRun(
        runtime=runtime,
        output=output,
        task=task,
        reward_fn=get_reward(config.reward),
        precision=precision,
        model=model,
        tokenizer=tokenizer,
        learner=learner,
        llm=llm,
        reference=reference,
        optimizer=optimizer,
        scheduler=scheduler,
        mask_kind=mask_kind,
        total_steps=total_steps,
        start=start,
        log=log,
    )
