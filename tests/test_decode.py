"""The backend's own sampler: exactly softmax(logits / T) within the top-p nucleus."""

from __future__ import annotations

import torch

from memsearcher.llm.decode import sample_next


def test_greedy_is_the_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 2.0, 1.0]])
    assert sample_next(logits, 0.0).tolist() == [1, 0]


def test_draws_follow_softmax_over_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(20_000, 1)
    generator = torch.Generator().manual_seed(0)
    draws = sample_next(logits, 0.5, generator=generator)
    freq = torch.bincount(draws, minlength=3).float() / draws.numel()
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / 0.5, dim=0)  # 0.867 0.117 0.016
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)


def test_top_p_keeps_the_smallest_nucleus_that_reaches_it() -> None:
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.8 keeps the first two (0.5 + 0.3 reaches
    0.8), renormalized to 0.625 / 0.375; top_p 0.81 needs the third as well."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(20_000, 1)
    generator = torch.Generator().manual_seed(1)
    freq = torch.bincount(sample_next(logits, 1.0, 0.8, generator), minlength=4) / 20_000
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.01, rtol=0)
    freq = torch.bincount(sample_next(logits, 1.0, 0.81, generator), minlength=4) / 20_000
    assert freq[2] > 0.1 and freq[3] == 0


def test_a_seeded_generator_repeats_its_draws() -> None:
    logits = torch.zeros(8, 50)
    first = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(3))
    again = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(first, again)


def test_a_shared_prompt_prefix_computed_once_decodes_the_same_tokens(llm) -> None:  # type: ignore[no-untyped-def]
    """The real SmolLM2 checkpoint on MemSearcher's real first prompts (the system prompt is
    shared, the questions are not, and their lengths differ): greedy decoding gives the same
    tokens with the prefix computed once as with every prompt whole."""
    from memsearcher.agent import AgentConfig, start_episodes
    from memsearcher.llm.base import SamplingParams
    from memsearcher.llm.decode import _shared_length, decode
    from memsearcher.types import QAExample

    questions = ["Who wrote Hamlet?", "Of which country is Oslo the capital?", "Who painted it?"]
    examples = [QAExample(str(i), q, ("x",)) for i, q in enumerate(questions)]
    episodes = start_episodes("memsearcher", examples, llm.tokenizer, AgentConfig())
    prompts = [list(e.next_request().prompt_ids) for e in episodes]  # type: ignore[union-attr]
    assert _shared_length(prompts) > 300  # the system prompt and the question's opening tag
    assert _shared_length(prompts[:1]) == 0 and _shared_length([[1] * 20, [2] * 20]) == 0
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    eos, pad = llm.tokenizer.eos_token_ids, llm.tokenizer.pad_token_id
    whole = decode(llm.model, prompts, params, eos, pad, lambda _: False)
    shared = decode(llm.model, prompts, params, eos, pad, lambda _: False, share_prefix=True)
    assert shared == whole and sum(len(row) for row in whole) > 30
