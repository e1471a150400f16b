"""The rollout side of both RL loops: a step's questions sampled into trajectories, their
metrics, and sample files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from memsearcher.agent import run_lockstep
from memsearcher.eval.metrics import exact_match
from memsearcher.llm.base import SamplingParams, derive_seed
from memsearcher.llm.hf import HFModel
from memsearcher.rl.config import GRPOConfig
from memsearcher.rl.distributed import Runtime, gathered
from memsearcher.rl.policy import Precision, autocast
from memsearcher.rl.seeding import draw
from memsearcher.rl.tasks import Task
from memsearcher.types import Trajectory

__all__ = ["roll_out", "rollout_metrics", "save_samples"]


def roll_out(
    config: GRPOConfig,
    step: int,
    task: Task,
    llm: HFModel,
    precision: Precision,
    runtime: Runtime,
) -> list[Trajectory]:
    """This rank's shard of step ``step``'s questions, G trajectories each, sampled with the
    current weights in the task's environment; a question's G trajectories are adjacent
    (`advantages.question_of`), and each (step, rank) draws from a seed stream of its own."""
    questions = task.questions
    step_ids = draw(
        len(questions),
        (step - 1) * config.questions_per_step,
        config.questions_per_step,
        config.seed,
    )
    mine = [questions[i] for i in step_ids[runtime.rank :: runtime.world_size]]
    llm.model.eval()
    episodes = task.start_episodes(
        [q for q in mine for _ in range(config.group_size)],
        llm.tokenizer,
        llm.max_context_tokens,
    )
    sampling = SamplingParams(
        temperature=config.temperature, seed=derive_seed(config.seed, step, runtime.rank)
    )
    with gathered(llm.model), autocast(precision.compute, runtime.device):
        return run_lockstep(episodes, llm, task.environment, sampling)


def rollout_metrics(trajectories: list[Trajectory], rewards: torch.Tensor) -> dict[str, float]:
    """Reward, answer and shape statistics of one step's trajectories."""
    turns = [len(t.turns) for t in trajectories]
    prompts = [turn.prompt_tokens for t in trajectories for turn in t.turns]
    em = [
        exact_match(t.answer, golds) if t.well_formed and t.answer and golds else 0.0
        for t in trajectories
        for golds in [t.example.golden_answers]  # none for a WebShop session
    ]
    n = len(trajectories)
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std(correction=0).item(),
        "reward/em": sum(em) / n,
        "rollout/format_failure": sum(t.end_reason == "format_error" for t in trajectories) / n,
        "rollout/search_error": sum(t.end_reason == "search_error" for t in trajectories) / n,
        "rollout/repeated_query": sum(t.end_reason == "repeated_query" for t in trajectories) / n,
        "rollout/well_formed": sum(t.well_formed for t in trajectories) / n,
        "rollout/turns": sum(turns) / n,
        "rollout/prompt_tokens": sum(prompts) / max(1, len(prompts)),
        "rollout/searches": sum(t.num_searches for t in trajectories) / n,
        "rollout/sequences": float(sum(len(t.sequences) for t in trajectories)),
    }


def save_samples(path: Path, trajectories: list[Trajectory], rewards: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for trajectory, reward in zip(trajectories, rewards.tolist(), strict=True):
            record: dict[str, Any] = {"reward": reward, **trajectory.to_dict()}
            out.write(json.dumps(record) + "\n")
