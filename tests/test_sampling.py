"""The distribution rollouts are drawn from is the one the learner models, and seed streams
never collide.

The checkpoint here carries generation defaults of the kinds released checkpoints ship:
Qwen2.5-Instruct's (repetition_penalty 1.05, top_k 20, top_p 0.8, temperature 0.7, do_sample),
with the penalty raised to 1.3 so that a tiny random model shows it, plus no_repeat_ngram_size
and an epsilon cutoff at the value transformers' docs suggest. transformers fills every field a
passed generation config leaves unset from them, which would make HF rollouts penalized and
truncated while the learner's log-probs are plain softmax(logits / T).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from tiny_model import save_tiny_model

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.replay import search_then_answer
from memsearcher.llm.base import (
    NEUTRAL_PROCESSORS,
    Completion,
    SamplingParams,
    Tokenizer,
    derive_seed,
)
from memsearcher.llm.hf import HFModel
from memsearcher.llm.openai_http import OpenAIHTTPModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.base import Retriever
from memsearcher.types import QAExample

CHECKPOINT_DEFAULTS = {
    "do_sample": True,
    "repetition_penalty": 1.3,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
    "no_repeat_ngram_size": 3,
    "epsilon_cutoff": 6e-4,
}


@pytest.fixture(scope="module")
def shipped_defaults(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    """A tiny real model saved with a generation_config that carries sampling defaults."""
    from transformers import GenerationConfig

    folder = save_tiny_model(tmp_path_factory.mktemp("shipped-defaults"), seed=1)
    config = GenerationConfig.from_pretrained(folder)
    for key, value in CHECKPOINT_DEFAULTS.items():
        setattr(config, key, value)
    config.save_pretrained(folder)
    llm = HFModel.from_pretrained(str(folder), device="cpu")
    assert llm.model.generation_config.repetition_penalty == 1.3  # the defaults are there
    return llm


def prompts(n: int, length: int = 12) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(5, 2000, (length,), generator=generator).tolist() for _ in range(n)]


@torch.no_grad()
def plain_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """argmax of the raw logits, one token at a time: greedy with no logits processor."""
    ids = list(prompt)
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_greedy_ignores_the_checkpoints_repetition_penalty(shipped_defaults: HFModel) -> None:
    # A random tiny model repeats itself, which is where a repetition penalty bites.
    params = SamplingParams(max_new_tokens=24)
    completions = shipped_defaults.generate(prompts(4), params)
    for prompt, completion in zip(prompts(4), completions, strict=True):
        want = plain_greedy(shipped_defaults.model, prompt, len(completion.token_ids))
        assert list(completion.token_ids) == want


def test_sampling_is_not_truncated_by_the_checkpoints_defaults(shipped_defaults: HFModel) -> None:
    """Sampled at T=1 from a near-uniform random model, most tokens fall outside the 20 most
    likely ones; the checkpoint's top_k=20, top_p=0.8 or epsilon cutoff (every token of a
    near-uniform 49k vocabulary is below 6e-4) would keep every one inside."""
    batch = prompts(16, length=8)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    completions = shipped_defaults.generate(batch, params)
    outside = total = 0
    with torch.no_grad():
        for prompt, completion in zip(batch, completions, strict=True):
            ids = torch.tensor([prompt + list(completion.token_ids)])
            logits = shipped_defaults.model(input_ids=ids).logits[0]  # (L, V)
            for k, token in enumerate(completion.token_ids):
                top = logits[len(prompt) + k - 1].topk(20).indices
                outside += int(token not in top.tolist())
                total += 1
    assert total >= 100
    assert outside / total > 0.5, f"{outside}/{total} sampled tokens outside the top 20"


def test_the_checkpoints_generation_config_is_restored(shipped_defaults: HFModel) -> None:
    shipped_defaults.generate(prompts(1), SamplingParams(max_new_tokens=2))
    assert shipped_defaults.model.generation_config.repetition_penalty == 1.3
    assert shipped_defaults.model.generation_config.top_k == 20


def test_http_payload_switches_the_servers_defaults_off(llm: HFModel) -> None:
    """llama-cpp-python's server applies repeat_penalty 1.1, top_k 40 and min_p 0.05 unless
    told otherwise; vLLM applies a checkpoint's generation_config to fields a request omits."""
    remote = OpenAIHTTPModel.__new__(OpenAIHTTPModel)
    remote.model = "m"
    payload = remote._sampling(SamplingParams(temperature=1.0, seed=2**40 + 7))
    assert payload["repetition_penalty"] == payload["repeat_penalty"] == 1.0
    assert payload["top_k"] == 0 and payload["min_p"] == 0.0
    assert payload["presence_penalty"] == payload["frequency_penalty"] == 0.0
    assert set(NEUTRAL_PROCESSORS) <= set(payload)
    assert 0 <= payload["seed"] < 2**31


def test_derived_seeds_do_not_collide_over_ranks_calls_and_rows() -> None:
    """8 ranks x 10 generate calls x 32 rows, as the trainer and the vLLM backend derive them.
    (``base + rank + call`` shares 15 of 17 values over 8 ranks x 10 calls.)"""
    seeds = set()
    for rank in range(8):
        base = derive_seed(0, 1, rank)  # config seed 0, step 1
        for call in range(10):
            call_seed = derive_seed(base, call)
            seeds.add(call_seed)
            seeds.update(derive_seed(call_seed, row) for row in range(32))
    assert len(seeds) == 8 * 10 * 33
    assert all(0 <= s < 2**63 for s in seeds)


class SeedRecorder(ScriptedLLM):
    """A scripted search-then-answer policy that notes the seed of every generate call."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer, search_then_answer(1, "Shakespeare"))
        self.seeds: list[int | None] = []

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        self.seeds.append(params.seed)
        return super().generate(prompts, params)


def test_lockstep_calls_of_neighbouring_base_seeds_do_not_share_a_stream(
    llm: HFModel, retriever: Retriever
) -> None:
    """Two runs whose base seeds differ by one (two ranks, as the trainer had them) used to
    share every seed but one: call k + 1 of the first was call k of the second."""
    calls = {}
    for base in (100, 101):
        recorder = SeedRecorder(llm.tokenizer)
        examples = [QAExample("q", "Who wrote Hamlet?", ("Shakespeare",))]
        episodes = start_episodes("memsearcher", examples, llm.tokenizer, AgentConfig())
        run_lockstep(episodes, recorder, retriever, SamplingParams(temperature=1.0, seed=base))
        calls[base] = recorder.seeds
    assert len(calls[100]) == 3  # action, memory, answer
    assert not set(calls[100]) & set(calls[101])
