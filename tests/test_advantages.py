from __future__ import annotations

import math
import statistics

import pytest
import torch

from memsearcher.rl.advantages import broadcast_to_turns, degenerate_groups, group_advantages

EPS = 1e-6

# Three groups of three:
#   [1, 2, 3]        mean 2, deviations [-1, 0, 1], sample std sqrt((1 + 0 + 1) / 2) = 1
#   [0.1, 0.1, 0.1]  all equal: degenerate, 0 for everyone
#   [0, 0, 3]        mean 1, deviations [-1, -1, 2], sample std sqrt((1 + 1 + 4) / 2) = sqrt(3)
#                    (the population std would be sqrt(2): the test tells them apart)
REWARDS = torch.tensor([1.0, 2.0, 3.0, 0.1, 0.1, 0.1, 0.0, 0.0, 3.0])


def test_hand_computed_with_std() -> None:
    advantages, metrics = group_advantages(REWARDS, group_size=3)
    s3 = math.sqrt(3.0)
    expected = torch.tensor(
        [
            -1 / (1 + EPS),
            0.0,
            1 / (1 + EPS),
            0.0,
            0.0,
            0.0,
            -1 / (s3 + EPS),
            -1 / (s3 + EPS),
            2 / (s3 + EPS),
        ]
    )
    torch.testing.assert_close(advantages, expected)
    # All advantages: [-1, 0, 1, 0, 0, 0, -1/s3, -1/s3, 2/s3] (eps aside); they sum to 0,
    # squares sum to 1 + 1 + 1/3 + 1/3 + 4/3 = 4, population variance 4/9, std 2/3.
    assert metrics["advantage/mean"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["advantage/std"] == pytest.approx(2 / 3, rel=1e-5)
    assert metrics["advantage/abs_max"] == pytest.approx(2 / s3, rel=1e-5)
    assert metrics["rollout/degenerate_groups"] == 1.0
    assert metrics["rollout/degenerate_fraction"] == pytest.approx(1 / 3)


def test_hand_computed_without_std() -> None:
    advantages, metrics = group_advantages(REWARDS, group_size=3, normalize_std=False)
    expected = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, -1.0, -1.0, 2.0])
    torch.testing.assert_close(advantages, expected)
    # Squares sum to 1 + 1 + 1 + 1 + 4 = 8 over 9 values: std sqrt(8/9).
    assert metrics["advantage/std"] == pytest.approx(math.sqrt(8 / 9), rel=1e-6)
    assert metrics["advantage/abs_max"] == pytest.approx(2.0)


def test_degenerate_group_is_exactly_zero() -> None:
    # The float mean of three 0.1s is not exactly 0.1; the result must still be exactly 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 1.0])
    for normalize_std in (True, False):
        advantages, metrics = group_advantages(rewards, 3, normalize_std=normalize_std)
        assert torch.equal(advantages, torch.zeros(6))
        assert not torch.isnan(advantages).any()
        assert metrics["rollout/degenerate_fraction"] == 1.0
    assert degenerate_groups(rewards, 3).tolist() == [True, True]


def test_group_size_one_is_degenerate() -> None:
    advantages, metrics = group_advantages(torch.tensor([0.3, 1.0]), group_size=1)
    assert torch.equal(advantages, torch.zeros(2))
    assert metrics["rollout/degenerate_groups"] == 2.0


def test_integer_rewards_are_accepted() -> None:
    advantages, _ = group_advantages(torch.tensor([0, 1]), group_size=2, normalize_std=False)
    torch.testing.assert_close(advantages, torch.tensor([-0.5, 0.5]))


def _naive(rewards: list[float], group_size: int, normalize_std: bool) -> list[float]:
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        if all(r == group[0] for r in group):
            out.extend([0.0] * group_size)
            continue
        mean = sum(group) / group_size
        std = statistics.stdev(group) if normalize_std else None
        for r in group:
            out.append((r - mean) / (std + EPS) if std is not None else r - mean)
    return out


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("group_size", [2, 5, 8])
def test_matches_naive_loop(group_size: int, normalize_std: bool) -> None:
    generator = torch.Generator().manual_seed(group_size)
    for trial in range(20):
        num_groups = 1 + trial % 7
        # Binary rewards make degenerate groups common; continuous ones exercise the std.
        if trial % 2:
            rewards = torch.randint(0, 2, (num_groups * group_size,), generator=generator)
            rewards = rewards.to(torch.float64)
        else:
            rewards = torch.rand(num_groups * group_size, generator=generator, dtype=torch.float64)
        advantages, metrics = group_advantages(rewards, group_size, normalize_std=normalize_std)
        expected = _naive(rewards.tolist(), group_size, normalize_std)
        torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64))
        naive_degenerate = [
            len(set(rewards.tolist()[i : i + group_size])) == 1
            for i in range(0, len(rewards), group_size)
        ]
        assert degenerate_groups(rewards, group_size).tolist() == naive_degenerate
        assert metrics["rollout/degenerate_groups"] == sum(naive_degenerate)


def test_broadcast_to_turns() -> None:
    advantages = torch.tensor([0.5, -1.0, 2.0])
    out = broadcast_to_turns(advantages, [1, 3, 2])
    assert out.tolist() == [0.5, -1.0, -1.0, -1.0, 2.0, 2.0]


@pytest.mark.parametrize(
    ("rewards", "group_size", "message"),
    [
        (torch.zeros(5), 2, "not a multiple"),
        (torch.zeros(4), 0, "group_size must be >= 1"),
        (torch.zeros(0), 2, "empty"),
        (torch.zeros(2, 2), 2, "1-D"),
    ],
)
def test_group_advantages_rejects_bad_input(
    rewards: torch.Tensor, group_size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, group_size)


def test_broadcast_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="trajectory 1 has 0 sequences"):
        broadcast_to_turns(torch.zeros(3), [2, 0, 1])
    with pytest.raises(ValueError, match="2 turn counts for 3 advantages"):
        broadcast_to_turns(torch.zeros(3), [1, 1])
