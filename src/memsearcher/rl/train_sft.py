"""Supervised fine-tuning on agent trajectories: the paper's distillation baseline.

The input is trajectory JSONL as the agent writes it (one ``Trajectory.to_dict()`` per line).
Every turn sequence is trained on its own loss mask, so tokens the environment inserted (tool
responses, template glue) are never learned. The loss is the mean negative log-likelihood over
the masked tokens of each optimizer step, over all ranks together.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from memsearcher.config import config_to_dict, default_dict
from memsearcher.errors import MemSearcherError
from memsearcher.rl.batching import micro_batches, padding_share, sequence_logprobs
from memsearcher.rl.checkpoint import check_run_folder, resume_step, save_checkpoint
from memsearcher.rl.config import SFTConfig
from memsearcher.rl.distributed import (
    even_out,
    init_runtime,
    no_sync,
    reduce_mean,
    sum_over_ranks,
    wrap_for_training,
)
from memsearcher.rl.metrics_log import MetricsLog
from memsearcher.rl.optim import make_optimizer, make_scheduler, optimizer_step
from memsearcher.rl.policy import load_policy, resolve_precision
from memsearcher.rl.seeding import draw, seed_everything
from memsearcher.types import TokenSequence, Trajectory

__all__ = ["read_trajectories", "train_sft"]


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Trajectories from JSONL; a bad line raises `MemSearcherError` naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise MemSearcherError(f"{path}: no such trajectory file")
    out = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                out.append(Trajectory.from_dict(json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
                raise MemSearcherError(f"{path}:{number}: not a trajectory ({error})") from None
    return out


PROMPT_KEY_TOKENS = 64
"""Sequences whose first this many tokens agree share a system prompt (and one agent)."""


def _prompt_groups(
    sequences: list[TokenSequence], chosen: list[int], share_prefix: bool
) -> list[list[int]]:
    """``chosen`` as one group, or with ``share_prefix`` grouped by their opening tokens, so
    that each micro-batch holds sequences that start alike (one agent's system prompt)."""
    if not share_prefix:
        return [chosen]
    groups: dict[tuple[int, ...], list[int]] = {}
    for index in chosen:
        groups.setdefault(sequences[index].input_ids[:PROMPT_KEY_TOKENS], []).append(index)
    return list(groups.values())


def train_sft(
    config: SFTConfig, resume: bool | int = False, echo: Callable[[str], None] | None = None
) -> Any:
    """Train and return the trained model; checkpoints are ``config.output_dir/step-N``."""
    runtime = init_runtime(config.model.device)
    if config.share_prefix and runtime.world_size > 1:
        raise MemSearcherError(
            "share_prefix runs two forward passes per micro-batch, which DDP/FSDP cannot "
            "synchronize; set share_prefix: false under distributed launch"
        )
    if config.sequences_per_step % runtime.world_size:
        raise MemSearcherError(
            f"sequences_per_step ({config.sequences_per_step}) must split evenly over "
            f"{runtime.world_size} ranks"
        )
    seed_everything(config.seed)
    output = Path(config.output_dir)
    check_run_folder(output, config_to_dict(config), resume, runtime, default_dict(type(config)))
    trajectories = read_trajectories(config.data)
    sequences: list[TokenSequence] = [
        s
        for t in trajectories
        if t.well_formed or not config.only_well_formed
        for s in t.sequences
        if any(s.loss_mask)
        and (not config.max_sequence_tokens or len(s.input_ids) <= config.max_sequence_tokens)
    ]
    if not sequences:
        raise MemSearcherError(f"{config.data}: no trainable sequences")
    lengths = [len(s.input_ids) for s in sequences]
    precision = resolve_precision(config.model, runtime.device.type)
    model, hf_tokenizer = load_policy(config.model, runtime, precision)
    pad_id = hf_tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else hf_tokenizer.eos_token_id
    learner = wrap_for_training(model, runtime, config.model.distributed)
    optimizer = make_optimizer(model, config.optim)
    total_steps = config.steps or math.ceil(
        config.epochs * len(sequences) / config.sequences_per_step
    )
    scheduler = make_scheduler(optimizer, config.optim, total_steps)
    start = resume_step(output, resume, model, optimizer, scheduler, runtime)
    log = MetricsLog(output, runtime, config.tensorboard, echo, start)
    log.config(config_to_dict(config))
    bar = tqdm(total=total_steps, initial=start, disable=not runtime.is_main, desc="sft")
    model.train()

    for step in range(start + 1, total_steps + 1):
        step_start = time.perf_counter()
        chosen = draw(
            len(sequences),
            (step - 1) * config.sequences_per_step,
            config.sequences_per_step,
            config.seed,
        )
        mine = chosen[runtime.rank :: runtime.world_size]
        groups = _prompt_groups(sequences, mine, config.share_prefix)
        batches = micro_batches(sequences, lengths, groups, config.micro_batch_tokens, pad_id,
                                config.share_prefix)  # fmt: skip
        batches = even_out(batches, learner, runtime)
        tokens = sum(float(b.loss_mask.sum()) for b in batches)
        # every token of the step weighs the same on every rank: divide by the tokens over all
        # ranks, times world_size since DDP/FSDP average the ranks' gradients
        scale = runtime.world_size / max(sum_over_ranks(tokens, runtime), 1.0)
        nll = 0.0
        for k, batch in enumerate(batches):
            with no_sync(learner, sync=k == len(batches) - 1):
                logprobs = sequence_logprobs(learner, batch, 1.0, precision.compute)
                mask = batch.loss_mask.to(logprobs.device)  # (B, R)
                loss = -(logprobs * mask).sum() * scale
                loss.backward()
            nll += float(loss.detach())
        grad_norm = optimizer_step(model, optimizer, scheduler, config.optim)

        elapsed = time.perf_counter() - step_start
        metrics = {
            "train/loss": nll,
            "train/grad_norm": grad_norm,
            "train/lr": float(scheduler.get_last_lr()[0]),
            "train/tokens": tokens,
            "train/padding_share": padding_share(batches),
            "train/tokens_per_s": sum(b.padded_tokens for b in batches) / elapsed,
            "time/step": elapsed,
        }
        metrics = reduce_mean(metrics, runtime)
        if step % config.log_every == 0 or step == total_steps:
            log.log(step, total_steps, metrics)
        if step % config.save_every == 0 or step == total_steps:
            state = {"kind": "sft", "data_position": step * config.sequences_per_step}
            save_checkpoint(output, step, model, hf_tokenizer, optimizer, scheduler, state, runtime)
        bar.update(1)
    bar.close()
    log.close()
    return model
