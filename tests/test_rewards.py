"""Each branch of the trajectory rewards, on real Trajectory records."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memsearcher.rl.rewards import (
    REWARDS,
    environment_reward,
    get_reward,
    graded_reward,
    trajectory_reward,
)
from memsearcher.types import EndReason, QAExample, Trajectory


def make_trajectory(
    answer: str | None,
    golden_answers: tuple[str, ...] = ("Paris",),
    end_reason: EndReason = "answer",
) -> Trajectory:
    example = QAExample(
        id="q0", question="What is the capital of France?", golden_answers=golden_answers
    )
    return Trajectory(
        example=example,
        agent="memsearcher",
        turns=(),
        sequences=(),
        end_reason=end_reason,
        answer=answer,
    )


# About 0.05: [paris, x * 38] vs [paris]: common 1, p = 1/39, r = 1,
# f1 = 2*(1/39)/(40/39) = 2/40 = 0.05.
TINY_OVERLAP = "Paris " + " ".join(["x"] * 38)


@pytest.mark.parametrize(
    ("trajectory", "expected"),
    [
        # Malformed: 0.0 even though the answer is right.
        (make_trajectory("Paris", end_reason="format_error"), 0.0),
        (make_trajectory("Paris", end_reason="length"), 0.0),
        # No final answer: not well formed, 0.0.
        (make_trajectory(None), 0.0),
        (make_trajectory(None, end_reason="max_turns"), 0.0),
        # Correct after normalization: F1 = 1.0.
        (make_trajectory("paris."), 1.0),
        # Partial: [barack, obama] vs [obama], p = 1/2, r = 1, f1 = 2*(1/2)/(3/2) = 2/3.
        (make_trajectory("Barack Obama", ("Obama",)), 2 / 3),
        # Well formed but wrong: the 0.1 floor.
        (make_trajectory("London"), 0.1),
        # The yes/no rule makes F1 zero, so this too is a wrong answer: 0.1.
        (make_trajectory("yes", ("yes indeed",)), 0.1),
        # The quirk: tiny positive F1 is returned as is, below the 0.1 floor.
        (make_trajectory(TINY_OVERLAP), 0.05),
    ],
)
def test_graded_reward_branches(trajectory: Trajectory, expected: float) -> None:
    assert trajectory_reward(trajectory) == pytest.approx(expected)


def test_tiny_overlap_scores_below_a_wrong_answer() -> None:
    # Reference behaviour, kept on purpose (see the module docstring).
    tiny = trajectory_reward(make_trajectory(TINY_OVERLAP))
    wrong = trajectory_reward(make_trajectory("London"))
    assert 0.0 < tiny < wrong == pytest.approx(0.1)


def test_graded_reward_on_fields() -> None:
    assert graded_reward(None, ["Paris"], well_formed=True) == 0.0
    assert graded_reward("Paris", ["Paris"], well_formed=False) == 0.0
    assert graded_reward("Paris", ["Paris"], well_formed=True) == 1.0
    assert graded_reward("Rome", ["Paris"], well_formed=True) == pytest.approx(0.1)


def test_graded_reward_needs_golds() -> None:
    with pytest.raises(ValueError, match="golden_answers is empty"):
        graded_reward("Paris", [], well_formed=True)


@pytest.mark.parametrize(
    ("trajectory", "em", "f1"),
    [
        (make_trajectory("Paris"), 1.0, 1.0),
        # [barack, obama] vs [obama]: f1 = 2/3 (see above); not an exact match.
        (make_trajectory("Barack Obama", ("Obama",)), 0.0, 2 / 3),
        # Neither variant has the 0.1 floor.
        (make_trajectory("London"), 0.0, 0.0),
        (make_trajectory("Paris", end_reason="format_error"), 0.0, 0.0),
        (make_trajectory(None), 0.0, 0.0),
    ],
)
def test_em_and_f1_variants(trajectory: Trajectory, em: float, f1: float) -> None:
    assert REWARDS["em"](trajectory) == em
    assert REWARDS["f1"](trajectory) == pytest.approx(f1)


def test_registry() -> None:
    assert set(REWARDS) == {"graded", "em", "f1", "multi-em", "multi-f1", "environment"}
    assert get_reward("graded") is trajectory_reward
    for name, fn in REWARDS.items():
        assert get_reward(name) is fn


def test_unknown_reward_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="'nope'.*em, environment, f1, graded"):
        get_reward("nope")


@given(st.text(max_size=40), st.lists(st.text(max_size=20), min_size=1, max_size=3))
def test_graded_reward_range(prediction: str, golds: list[str]) -> None:
    reward = graded_reward(prediction, golds, well_formed=True)
    assert 0.0 < reward <= 1.0
    assert graded_reward(prediction, golds, well_formed=False) == 0.0


def test_the_environment_reward_is_the_environments_and_0_where_it_gave_none() -> None:
    bought = replace(make_trajectory("B0001"), environment_reward=0.75)
    assert environment_reward(bought) == 0.75
    assert environment_reward(replace(bought, environment_reward=0.0)) == 0.0
    # a format error before Buy Now: the shop gave nothing, whatever the answer says
    assert environment_reward(make_trajectory("Paris", end_reason="format_error")) == 0.0
    assert get_reward("environment") is environment_reward
