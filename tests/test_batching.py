"""Learner batching: the plan respects the budget, and padded log-probs equal unpadded ones."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from tiny_model import save_tiny_model

from memsearcher.rl.batching import (
    collate,
    padding_share,
    plan_micro_batches,
    response_logprobs,
    right_aligned,
    sequence_logprobs,
    shared_prefix,
)
from memsearcher.rl.loss import token_logprobs
from memsearcher.types import TokenSequence


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def random_sequences(n: int, seed: int = 0) -> list[TokenSequence]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = tuple(rng.randrange(1, 1000) for _ in range(rng.randint(3, 40)))
        response = tuple(rng.randrange(1, 1000) for _ in range(rng.randint(1, 20)))
        mask = tuple(rng.choice((0, 1, 1)) for _ in response)
        out.append(TokenSequence(prompt, response, mask))
    return out


def test_plan_covers_every_sequence_once_and_respects_the_budget() -> None:
    lengths = [random.Random(i).randint(5, 100) for i in range(200)]
    plans = plan_micro_batches(lengths, token_budget=400)
    assert sorted(i for plan in plans for i in plan) == list(range(200))
    for plan in plans:
        width = max(lengths[i] for i in plan)
        assert len(plan) * width <= 400
        assert min(lengths[i] for i in plan) >= 0.9 * width  # no row more than 10% padding


def test_plan_keeps_units_together_and_lets_an_oversized_unit_through() -> None:
    lengths = [10, 10, 50, 30, 500]
    units = [[0, 2], [1, 3], [4]]
    plans = plan_micro_batches(lengths, token_budget=120, units=units)
    assert [4] in plans
    for unit in units:
        assert any(set(unit) <= set(plan) for plan in plans)


def test_padding_share_by_hand() -> None:
    sequences = [TokenSequence((1, 2), (3,), (1,)), TokenSequence((1,), (2, 3, 4, 5), (1, 1, 0, 1))]
    batch = collate(sequences, [0, 1], pad_id=0)
    # widths 3 and 5 in a 2 x 5 batch: 2 of 10 tokens are padding
    assert padding_share([batch]) == pytest.approx(0.2)
    assert batch.targets.tolist() == [[0, 1, 2, 3], [2, 3, 4, 5]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1], [1, 1, 0, 1]]


def test_batched_logprobs_equal_one_sequence_at_a_time(tiny: torch.nn.Module) -> None:
    sequences = random_sequences(6)
    batch = collate(sequences, range(6), pad_id=0)
    with torch.no_grad():
        batched = sequence_logprobs(tiny, batch)  # (B, R)
        for row, sequence in enumerate(sequences):
            ids = torch.tensor([sequence.input_ids])
            logits = tiny(input_ids=ids).logits[:, :-1]
            alone = token_logprobs(logits, ids[:, 1:])[0, -len(sequence.response_ids) :]
            got = batched[row, -len(sequence.response_ids) :]
            mask = torch.tensor(sequence.loss_mask, dtype=torch.bool)
            torch.testing.assert_close(got[mask], alone[mask], atol=1e-5, rtol=1e-5)
            assert torch.all(got[~mask] == 0)  # never computed: no logits for masked tokens


def test_logprob_gradient_flows(tiny: torch.nn.Module) -> None:
    batch = collate(random_sequences(2), [0, 1], pad_id=0)
    logprobs = sequence_logprobs(tiny, batch)
    (logprobs * batch.loss_mask).sum().backward()
    grads = [p.grad for p in tiny.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    tiny.zero_grad(set_to_none=True)


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean", "trajectory-mean"])
def test_accumulated_gradient_equals_the_whole_mini_batch(
    tiny: torch.nn.Module, aggregation: str
) -> None:
    """Split into micro-batches of one or two sequences (sequences of a trajectory split
    apart where the aggregation allows it), the weighted backward passes sum to the gradient
    of `policy_loss` over the whole mini-batch at once. Masked-token counts differ per
    sequence, so a wrong weight would show."""
    from memsearcher.rl.config import GRPOConfig
    from memsearcher.rl.distributed import Runtime
    from memsearcher.rl.learner import _units, accumulate_gradients
    from memsearcher.rl.loss import policy_loss

    sequences = random_sequences(6, seed=3)
    trajectory_ids = torch.tensor([0, 0, 1, 2, 2, 2])
    advantages = torch.tensor([0.5, 0.5, -1.0, 1.5, 1.5, 1.5])
    config = GRPOConfig(aggregation=aggregation, beta=0.1, clip_low=0.2, clip_high=0.3)
    with torch.no_grad():
        whole = collate(sequences, range(6), pad_id=0)
        base = sequence_logprobs(tiny, whole)
    # old and reference log-probs off the current ones, so ratios and KL are not trivial
    noise = torch.Generator().manual_seed(0)
    old = [base[i, base.shape[1] - len(s.response_ids) :] + 0.3 * torch.randn(
        len(s.response_ids), generator=noise) for i, s in enumerate(sequences)]  # fmt: skip
    ref = [value - 0.2 for value in old]

    def gradient() -> list[torch.Tensor]:
        grads = [p.grad.clone() for p in tiny.parameters()]  # type: ignore[union-attr]
        tiny.zero_grad(set_to_none=True)
        return grads

    logprobs = sequence_logprobs(tiny, whole)
    loss, _ = policy_loss(
        logprobs, right_aligned(old, whole), advantages, whole.loss_mask, 0.2, 0.3,
        ref_logprobs=right_aligned(ref, whole), beta=0.1, aggregation=aggregation,
        trajectory_ids=trajectory_ids,
    )  # fmt: skip
    loss.backward()
    expected = gradient()

    units = _units(list(range(6)), trajectory_ids.tolist(), aggregation)
    plans = plan_micro_batches([len(s.input_ids) for s in sequences], 1, units)
    assert len(plans) > 2
    micro = [collate(sequences, plan, pad_id=0) for plan in plans]
    one = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    metrics = accumulate_gradients(tiny, micro, old, ref, advantages, trajectory_ids, config, one)
    for got, want in zip(gradient(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-6)
    assert metrics["train/loss"] == pytest.approx(loss.item(), rel=1e-5)


def prefixed_sequences(seed: int = 0, system: int = 40) -> list[TokenSequence]:
    """Rows that start with one shared "system prompt", then prompts and responses of their own
    of different lengths (so the rows are padded differently)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 1000) for _ in range(system)]
    rows = []
    for _ in range(5):
        prompt = shared + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 30))]
        response = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 25))]
        mask = [rng.choice((0, 1, 1)) for _ in response]
        rows.append(TokenSequence(tuple(prompt), tuple(response), tuple(mask)))
    return rows


@pytest.mark.parametrize("lora", [False, True])
def test_a_shared_prefix_computed_once_gives_the_whole_rows_logprobs_and_gradients(
    tmp_path_factory: pytest.TempPathFactory, lora: bool
) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path_factory.mktemp("tiny-prefix"))
    model = AutoModelForCausalLM.from_pretrained(folder).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # a fresh adapter is zero: give the test something to see
                torch.nn.init.normal_(parameter, std=0.05)
    rows = prefixed_sequences()
    whole = collate(rows, range(len(rows)), pad_id=0)
    shared = collate(rows, range(len(rows)), pad_id=0, share_prefix=True)
    assert shared.prefix == 40
    assert shared.padded_tokens < whole.padded_tokens
    results = []
    for batch in (whole, shared):
        logprobs = sequence_logprobs(model, batch)
        logprobs.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        results.append((logprobs.detach(), grads))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-5, rtol=1e-4)

    # negative control: a prefix one token past what the rows share changes the log-probs
    wrong = dataclasses.replace(shared, prefix=shared.prefix + 1)
    assert (sequence_logprobs(model, wrong).detach() - a).abs().max() > 1e-3


def test_the_shared_prefix_stops_before_every_rows_last_prompt_token() -> None:
    rows = prefixed_sequences(system=40)
    short = TokenSequence(rows[0].prompt_ids[:20], (5, 6), (1, 1))  # a prompt inside the prefix
    assert shared_prefix([*rows, short]) == 19
    assert shared_prefix([rows[0], TokenSequence((999, 1, 2), (3,), (1,))]) == 0  # none shared
    assert shared_prefix(rows) >= 40


def test_on_policy_the_passes_own_logprobs_stand_for_the_old_ones(tiny: torch.nn.Module) -> None:
    """With one update a step, `accumulate_gradients` without old log-probs (it takes its own,
    detached) gives the gradient it gives with old log-probs recomputed from the same weights,
    and a ratio of exactly 1; old log-probs off the current ones give another gradient."""
    from memsearcher.rl.config import GRPOConfig
    from memsearcher.rl.distributed import Runtime
    from memsearcher.rl.learner import accumulate_gradients

    sequences = random_sequences(5, seed=4)
    trajectory_ids = torch.arange(5)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75])
    config = GRPOConfig(beta=0.0, questions_per_step=4, mini_batch_questions=4)
    one = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    micro = [collate(sequences, plan, pad_id=0) for plan in plan_micro_batches(
        [len(s.input_ids) for s in sequences], 40)]  # fmt: skip
    recomputed = response_logprobs(tiny, sequences, 40, pad_id=0)

    def gradient(old: list[torch.Tensor] | None) -> tuple[list[torch.Tensor], dict[str, float]]:
        metrics = accumulate_gradients(tiny, micro, old, None, advantages, trajectory_ids,
                                       config, one)  # fmt: skip
        grads = [p.grad.clone() for p in tiny.parameters()]  # type: ignore[union-attr]
        tiny.zero_grad(set_to_none=True)
        return grads, metrics

    own, metrics = gradient(None)
    assert metrics["train/ratio_mean"] == 1.0 and metrics["train/clip_fraction"] == 0.0
    for a, b in zip(own, gradient(recomputed)[0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    shifted = [value - 0.5 for value in recomputed]  # negative control: off-policy old ones
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(own, gradient(shifted)[0], strict=True))
