from __future__ import annotations

import math

import pytest
import torch

from memsearcher.rl.loss import AGGREGATIONS, policy_loss, token_logprobs

CLIP_LOW, CLIP_HIGH = 0.2, 0.3  # trust region [0.8, 1.3]


# One sequence of three tokens with ratios 1.1 (inside), 1.5 (above), 0.5 (below).
#
# A = +2, per token -min(r * A, clip(r) * A) = max(-r * A, -clip(r) * A):
#   r=1.1: max(-2.2, -2.2) = -2.2  unclipped, d/dlogp = -A r = -2.2
#   r=1.5: max(-3.0, -2.6) = -2.6  clipped,   d/dlogp = 0
#   r=0.5: max(-1.0, -1.6) = -1.0  unclipped, d/dlogp = -A r = -1.0
#   token-mean loss (-2.2 - 2.6 - 1.0) / 3 = -5.8 / 3, gradients / 3
# A = -1:
#   r=1.1: max(1.1, 1.1) = 1.1  unclipped, d/dlogp = 1.1
#   r=1.5: max(1.5, 1.3) = 1.5  unclipped, d/dlogp = 1.5
#   r=0.5: max(0.5, 0.8) = 0.8  clipped,   d/dlogp = 0
#   token-mean loss (1.1 + 1.5 + 0.8) / 3 = 3.4 / 3
@pytest.mark.parametrize(
    ("advantage", "expected_loss", "expected_grad"),
    [
        (2.0, -5.8 / 3, [-2.2 / 3, 0.0, -1.0 / 3]),
        (-1.0, 3.4 / 3, [1.1 / 3, 1.5 / 3, 0.0]),
    ],
)
def test_hand_computed_1x3(
    advantage: float, expected_loss: float, expected_grad: list[float]
) -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ratios = torch.tensor([[1.1, 1.5, 0.5]], dtype=torch.float64)
    logprobs = (old + ratios.log()).requires_grad_()
    loss, metrics = policy_loss(
        logprobs,
        old,
        torch.tensor([advantage], dtype=torch.float64),
        torch.ones(1, 3),
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
    )
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([expected_grad], dtype=torch.float64))
    assert metrics["train/clip_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["train/ratio_mean"].item() == pytest.approx(3.1 / 3)
    assert metrics["train/pg_loss"].item() == pytest.approx(expected_loss)
    assert "train/kl" not in metrics
    assert all(not value.requires_grad for value in metrics.values())


def _naive_loss(
    logprobs: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref: torch.Tensor,
    beta: float,
    aggregation: str,
    trajectory_ids: list[int],
) -> float:
    """Per-token loop in plain Python floats; returns the aggregated loss."""
    batch, length = logprobs.shape
    token_losses: list[list[float]] = []  # masked tokens only, per sequence
    for b in range(batch):
        row = []
        for t in range(length):
            if mask[b, t] == 0:
                continue
            lp, ol, rf, a = (
                logprobs[b, t].item(),
                old[b, t].item(),
                ref[b, t].item(),
                advantages[b].item(),
            )
            ratio = math.exp(lp - ol)
            clipped = min(max(ratio, 1 - CLIP_LOW), 1 + CLIP_HIGH)
            pg = -min(ratio * a, clipped * a)
            d = min(max(rf - lp, -20.0), 20.0)  # veRL's low_var_kl bounds
            kl = min(math.exp(d) - d - 1, 10.0)
            row.append(pg + beta * kl)
        token_losses.append(row)
    if aggregation == "token-mean":
        flat = [x for row in token_losses for x in row]
        return sum(flat) / len(flat)
    if aggregation == "sequence-mean":
        means = [sum(row) / len(row) for row in token_losses if row]
        return sum(means) / len(means)
    assert aggregation == "trajectory-mean"
    by_trajectory: dict[int, list[float]] = {}
    for row, trajectory in zip(token_losses, trajectory_ids, strict=True):
        by_trajectory.setdefault(trajectory, []).extend(row)
    means = [sum(xs) / len(xs) for xs in by_trajectory.values() if xs]
    return sum(means) / len(means)


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_matches_naive_loop(aggregation: str, beta: float) -> None:
    generator = torch.Generator().manual_seed(0)
    batch, length = 7, 9
    # Trajectory 3 has only an all-masked sequence: it must drop out of the means.
    trajectory_ids = [5, 5, 1, 1, 1, 3, 8]
    for _ in range(10):
        old = -3 * torch.rand(batch, length, generator=generator, dtype=torch.float64)
        # log-ratios up to +-0.5 put many tokens outside [0.8, 1.3].
        logprobs = old + torch.rand(batch, length, generator=generator, dtype=torch.float64) - 0.5
        ref = old + 0.3 * torch.randn(batch, length, generator=generator, dtype=torch.float64)
        advantages = torch.randn(batch, generator=generator, dtype=torch.float64)
        mask = (torch.rand(batch, length, generator=generator) < 0.7).to(torch.float64)
        mask[5] = 0.0
        mask[0, 0] = 1.0
        loss, metrics = policy_loss(
            logprobs,
            old,
            advantages,
            mask,
            CLIP_LOW,
            CLIP_HIGH,
            ref_logprobs=ref,
            beta=beta,
            aggregation=aggregation,
            trajectory_ids=torch.tensor(trajectory_ids),
        )
        expected = _naive_loss(
            logprobs, old, advantages, mask, ref, beta, aggregation, trajectory_ids
        )
        assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
        assert metrics["train/kl"].item() >= 0.0


def test_gradient_is_the_policy_gradient() -> None:
    # Ratio 1, no clipping: loss = -(1/N) sum_k A_b(k) exp(logp_k - old_k), so
    # d loss / d logp_k = -A_b / N for every masked token, 0 elsewhere.
    logprobs = torch.tensor([[-0.3, -1.2, -2.0], [-0.7, -0.1, -4.0]], requires_grad=True)
    advantages = torch.tensor([1.5, -0.5])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # N = 5
    loss, metrics = policy_loss(logprobs, logprobs.detach(), advantages, mask, 0.2, 0.2)
    loss.backward()
    expected = torch.tensor([[-1.5 / 5, -1.5 / 5, 0.0], [0.5 / 5, 0.5 / 5, 0.5 / 5]])
    torch.testing.assert_close(logprobs.grad, expected)
    assert metrics["train/clip_fraction"].item() == 0.0
    assert metrics["train/ratio_mean"].item() == 1.0


def test_gradient_to_logits_of_a_linear_policy() -> None:
    # For logp = log softmax(z)[y], d logp / d z = onehot(y) - softmax(z); with the gradient
    # above, d loss / d z = -A (onehot(y) - softmax(z)) / N at masked tokens, 0 elsewhere.
    generator = torch.Generator().manual_seed(1)
    batch, length, dim, vocab = 2, 4, 3, 6
    features = torch.randn(batch, length, dim, generator=generator, dtype=torch.float64)
    weight = torch.randn(dim, vocab, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, length), generator=generator)
    advantages = torch.tensor([0.8, -1.3], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]], dtype=torch.float64)

    logits = features @ weight  # (B, T, V)
    logits.retain_grad()
    logprobs = token_logprobs(logits, targets)
    loss, _ = policy_loss(logprobs, logprobs.detach(), advantages, mask, 0.2, 0.2)
    loss.backward()

    onehot = torch.nn.functional.one_hot(targets, vocab).to(torch.float64)
    n_tokens = mask.sum()
    expected = (
        -advantages[:, None, None]
        * (onehot - logits.detach().softmax(-1))
        * mask[..., None]
        / n_tokens
    )
    torch.testing.assert_close(logits.grad, expected)
    torch.testing.assert_close(weight.grad, torch.einsum("btd,btv->dv", features, expected))


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_masked_tokens_get_exactly_zero_gradient(aggregation: str) -> None:
    generator = torch.Generator().manual_seed(2)
    logprobs = -torch.rand(3, 5, generator=generator)
    old = logprobs + 0.1 * torch.randn(3, 5, generator=generator)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 1, 0, 1], [0, 0, 0, 1, 1]])
    # Garbage at masked positions: exp(1e4 - (-1e4)) overflows if it is ever evaluated.
    logprobs = torch.where(mask.bool(), logprobs, torch.tensor(1e4)).requires_grad_()
    old = torch.where(mask.bool(), old, torch.tensor(-1e4))
    ref = torch.where(mask.bool(), old, torch.tensor(3e4))
    loss, metrics = policy_loss(
        logprobs,
        old,
        torch.tensor([1.0, -2.0, 0.5]),
        mask,
        0.2,
        0.2,
        ref_logprobs=ref,
        beta=0.1,
        aggregation=aggregation,
        trajectory_ids=torch.tensor([0, 1, 1]),
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(value) for value in metrics.values())
    assert logprobs.grad is not None
    assert torch.equal(logprobs.grad[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert (logprobs.grad[mask == 1] != 0).all()


def test_trajectory_mean_weighs_trajectories_equally() -> None:
    # Trajectory 0: one sequence of 2 tokens; trajectory 1: three sequences of 4 tokens.
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0] * 4, [1.0] * 4, [1.0] * 4])
    trajectory_ids = torch.tensor([0, 1, 1, 1])
    advantages = torch.ones(4)

    def weight_per_trajectory(aggregation: str) -> list[float]:
        logprobs = torch.full((4, 4), -1.0, requires_grad=True)
        loss, _ = policy_loss(
            logprobs,
            logprobs.detach(),
            advantages,
            mask,
            0.2,
            0.2,
            aggregation=aggregation,
            trajectory_ids=trajectory_ids,
        )
        loss.backward()
        assert logprobs.grad is not None
        per_sequence = logprobs.grad.abs().sum(dim=1)
        return [per_sequence[0].item(), per_sequence[1:].sum().item()]

    # Each trajectory: |A| * 1/2 in total, spread over its own tokens.
    assert weight_per_trajectory("trajectory-mean") == pytest.approx([0.5, 0.5])
    # 14 tokens in all, each 1/14: 2/14 against 12/14.
    assert weight_per_trajectory("token-mean") == pytest.approx([2 / 14, 12 / 14])


def test_k3_kl_is_nonnegative_and_zero_at_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    logprobs = -3 * torch.rand(200, 1, generator=generator, dtype=torch.float64)
    ref = -3 * torch.rand(200, 1, generator=generator, dtype=torch.float64)
    for b in range(200):
        _, metrics = policy_loss(
            logprobs[b : b + 1],
            logprobs[b : b + 1],
            torch.zeros(1, dtype=torch.float64),
            torch.ones(1, 1),
            0.2,
            0.2,
            ref_logprobs=ref[b : b + 1],
        )
        assert metrics["train/kl"].item() >= 0.0
    loss, metrics = policy_loss(
        logprobs,
        logprobs,
        torch.ones(200, dtype=torch.float64),
        torch.ones(200, 1),
        0.2,
        0.2,
        ref_logprobs=logprobs.clone(),
        beta=0.5,
    )
    assert metrics["train/kl"].item() == 0.0
    assert loss.item() == metrics["train/pg_loss"].item()


def test_k3_kl_gradient() -> None:
    # With A = 0 only the KL term is left: loss = beta/N sum_k exp(d_k) - d_k - 1 with
    # d_k = ref_k - logp_k, so d loss / d logp_k = beta (1 - exp(ref_k - logp_k)) / N.
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    beta = 0.3
    loss, metrics = policy_loss(
        logprobs,
        logprobs.detach(),
        torch.zeros(2, dtype=torch.float64),
        mask,
        0.2,
        0.2,
        ref_logprobs=ref,
        beta=beta,
    )
    loss.backward()
    d = (ref - logprobs.detach()) * mask
    expected = beta * (1 - d.exp()) * mask / 3
    torch.testing.assert_close(logprobs.grad, expected)
    # d = [-0.5, 1.0, 0.0]: k3 = e^-0.5 + 0.5 - 1, e - 2, 0.
    expected_kl = (math.exp(-0.5) - 0.5 + (math.e - 2)) / 3
    assert metrics["train/kl"].item() == pytest.approx(expected_kl)
    assert loss.item() == pytest.approx(beta * expected_kl)


def test_k3_kl_is_bounded_as_verls_low_var_kl() -> None:
    """A token the reference finds far likelier (or far less likely) than the policy: the k3
    value is clamped to 10 (after the log-ratio to +-20), so it stays finite, adds no gradient
    and cannot swamp the other tokens; unbounded, exp(60) overflows float32 to inf."""
    logprobs = torch.tensor([[-70.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-10.0, -1.5, -1.0 - 60.0]])
    loss, metrics = policy_loss(
        logprobs, logprobs.detach(), torch.zeros(1), torch.ones(1, 3), 0.2, 0.2,
        ref_logprobs=ref, beta=1.0,
    )  # fmt: skip
    loss.backward()
    assert logprobs.grad is not None and torch.isfinite(logprobs.grad).all()
    # d = [60 -> 20, -0.5, -60 -> -20]: k3 = 10 (clamped), e^-0.5 + 0.5 - 1, 10 (clamped)
    middle = math.exp(-0.5) + 0.5 - 1
    assert metrics["train/kl"].item() == pytest.approx((10 + middle + 10) / 3)
    assert loss.item() == pytest.approx((10 + middle + 10) / 3)
    expected = torch.tensor([[0.0, (1 - math.exp(-0.5)) / 3, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_token_logprobs_matches_log_softmax() -> None:
    generator = torch.Generator().manual_seed(4)
    logits = 5 * torch.randn(3, 7, 11, generator=generator)
    targets = torch.randint(0, 11, (3, 7), generator=generator)
    for temperature in (1.0, 0.7, 1.3):
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[..., None])
        torch.testing.assert_close(
            token_logprobs(logits, targets, temperature), expected.squeeze(-1)
        )
    half = token_logprobs(logits.to(torch.bfloat16), targets)
    assert half.dtype == torch.float32
    reference = torch.log_softmax(logits.to(torch.bfloat16).float(), -1).gather(
        -1, targets[..., None]
    )
    torch.testing.assert_close(half, reference.squeeze(-1))


def test_rejects_bad_arguments() -> None:
    x = torch.zeros(2, 3)
    args = (x, x, torch.zeros(2), torch.ones(2, 3), 0.2, 0.2)
    with pytest.raises(ValueError, match="sequence-mean.*token-mean.*trajectory-mean"):
        policy_loss(*args, aggregation="sum")
    with pytest.raises(ValueError, match="needs trajectory_ids"):
        policy_loss(*args, aggregation="trajectory-mean")
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(*args, beta=0.1)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(x, x, torch.zeros(3), torch.ones(2, 3), 0.2, 0.2)
    with pytest.raises(ValueError, match="loss_mask has shape"):
        policy_loss(x, x, torch.zeros(2), torch.ones(2, 4), 0.2, 0.2)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0.0)


def test_per_token_advantages_equal_broadcast_ones() -> None:
    """(B, T) advantages (PPO) that repeat each row's value give the (B,) result exactly; a
    token's own advantage drives its gradient; masked positions (even NaN) change nothing."""
    generator = torch.Generator().manual_seed(3)
    logprobs = (-torch.rand(2, 4, generator=generator, dtype=torch.float64)).requires_grad_()
    old = logprobs.detach() + 0.05 * torch.randn(2, 4, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.float64)
    per_row = torch.tensor([0.7, -1.2], dtype=torch.float64)
    broadcast, _ = policy_loss(logprobs, old, per_row, mask, 0.2, 0.2)
    tokens = per_row[:, None].expand(2, 4).clone()
    tokens[0, 2] = float("nan")  # masked: must not leak
    per_token, _ = policy_loss(logprobs, old, tokens, mask, 0.2, 0.2)
    assert per_token.item() == pytest.approx(broadcast.item(), rel=1e-12)
    varied = torch.tensor([[1.0, -2.0, 0.0, 3.0], [0.0, 0.5, -0.5, 2.0]], dtype=torch.float64)
    loss, _ = policy_loss(logprobs, logprobs.detach(), varied, mask, 0.2, 0.2)
    loss.backward()
    # at ratio 1 the token-mean gradient is -A_k / (masked tokens)
    torch.testing.assert_close(logprobs.grad, -varied * mask / mask.sum())
