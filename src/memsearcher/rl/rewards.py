"""Trajectory rewards for GRPO: pure functions of a finished trajectory, kept in a registry.

The default ``"graded"`` reward is the reference one (DESIGN.md section 5):

- 0.0 if the trajectory is not well formed (a turn failed to parse, no final answer, the
  memory block was missing, or generation was cut by length; ``Trajectory.well_formed``);
- otherwise the answer's token F1 (``memsearcher.eval.metrics.f1_score``, max over golds) if
  it is positive;
- otherwise 0.1, a small bonus for a well-formed but wrong answer.

Quirk, kept on purpose because it is the reference behaviour: a well-formed answer with a
tiny positive F1 (say 0.05) scores *below* the 0.1 given to a well-formed answer with no
overlap at all. The reward is therefore not monotone in F1 on (0, 0.1).

``"em"`` and ``"f1"`` are plain variants for ablations: exact match (1.0/0.0) and F1, both 0.0
for a trajectory that is not well formed.

``"multi-em"`` is MEM1's reward on multi-objective tasks (``memsearcher.data.compose``): the
number of objectives answered exactly, 0 unless the answer gives exactly N answers separated by
";" (the count rule of MEM1's evaluation, which its training reward lacks); ``"multi-f1"`` sums
token F1 the same way. A plain question is one objective.

``"environment"`` is the reward the environment itself gives (``Trajectory.environment_reward``:
the shop's WebShop reward at Buy Now), 0.0 where it gave none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memsearcher.eval.metrics import exact_match, f1_score, objective_sum
from memsearcher.types import Trajectory

__all__ = ["REWARDS", "environment_reward", "get_reward", "graded_reward", "trajectory_reward"]

WRONG_ANSWER_REWARD = 0.1
"""Reward for a well-formed answer whose F1 is zero."""


def graded_reward(
    prediction: str | None, golden_answers: Sequence[str], well_formed: bool
) -> float:
    """The reference reward: 0 if malformed or unanswered, else F1 if positive, else 0.1."""
    if not well_formed or prediction is None:
        return 0.0
    f1 = f1_score(prediction, golden_answers)
    return f1 if f1 > 0 else WRONG_ANSWER_REWARD


def trajectory_reward(trajectory: Trajectory) -> float:
    """The graded reward of a trajectory's final answer."""
    return graded_reward(
        trajectory.answer, trajectory.example.golden_answers, trajectory.well_formed
    )


def em_reward(trajectory: Trajectory) -> float:
    """1.0 for a well-formed exact match, else 0.0."""
    if not trajectory.well_formed or trajectory.answer is None:
        return 0.0
    return exact_match(trajectory.answer, trajectory.example.golden_answers)


def f1_reward(trajectory: Trajectory) -> float:
    """The answer's token F1 if the trajectory is well formed, else 0.0 (no 0.1 floor)."""
    if not trajectory.well_formed or trajectory.answer is None:
        return 0.0
    return f1_score(trajectory.answer, trajectory.example.golden_answers)


def multi_em_reward(trajectory: Trajectory) -> float:
    """Objectives answered exactly, with the count rule; 0.0 if not well formed (MEM1)."""
    if not trajectory.well_formed or trajectory.answer is None:
        return 0.0
    return objective_sum(trajectory.answer, trajectory.example.objectives, exact_match)


def multi_f1_reward(trajectory: Trajectory) -> float:
    """Summed token F1 over the objectives, with the count rule; 0.0 if not well formed."""
    if not trajectory.well_formed or trajectory.answer is None:
        return 0.0
    return objective_sum(trajectory.answer, trajectory.example.objectives, f1_score)


def environment_reward(trajectory: Trajectory) -> float:
    """The environment's own reward (the shop's at Buy Now); 0.0 where it gave none (the
    episode ended on a format error, or at the agent's turn limit)."""
    return trajectory.environment_reward or 0.0


REWARDS: dict[str, Callable[[Trajectory], float]] = {
    "graded": trajectory_reward,
    "em": em_reward,
    "f1": f1_reward,
    "multi-em": multi_em_reward,
    "multi-f1": multi_f1_reward,
    "environment": environment_reward,
}


def get_reward(name: str) -> Callable[[Trajectory], float]:
    """The reward function registered under ``name``."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(
            f"unknown reward {name!r}; choose one of: {', '.join(sorted(REWARDS))}"
        ) from None
