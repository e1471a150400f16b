"""The packed-trajectory learner: packed log-probs equal per-turn log-probs, for every mask
kind, on a real tiny transformers model and real agent trajectories; later tokens change no
earlier log-prob; and the release's 0/1 float mask is caught by the same check."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from tiny_model import save_tiny_model

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.replay import search_then_answer
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import SamplingParams, Tokenizer
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.base import Retriever
from memsearcher.rl.batching import response_logprobs
from memsearcher.rl.packing import (
    MASK_KINDS,
    PackedBatch,
    allowed,
    collate_packed,
    pack,
    packed_logprobs,
    shared_prefix,
)
from memsearcher.types import QAExample, TokenSequence

TOLERANCE = 1e-5
# (mask kind, attention implementation the model is loaded with)
CASES = [("bool", "sdpa"), ("additive", "eager"), ("additive", "sdpa"), ("flex", "flex_attention")]
assert {kind for kind, _ in CASES} == set(MASK_KINDS)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def load(folder: Path, attention: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=attention
    ).eval()


@pytest.fixture(scope="module")
def trajectories(llm: HFModel, retriever: Retriever) -> list[list[TokenSequence]]:
    """Real turn sequences: MemSearcher and MEM1 with 1 to 3 searches, and one ReAct
    trajectory (a single sequence: packing is the identity), short enough for a fast test."""
    tokenizer: Tokenizer = llm.tokenizer
    config = AgentConfig(max_turns=5, memory_tokens=64, max_new_tokens=64, top_n=1)
    out = []
    for agent, searches in [("memsearcher", 2), ("mem1", 3), ("mem1", 1), ("react", 1)]:
        example = QAExample(f"{agent}{searches}", "Who founded the city of Rome?", ("x",))
        reply = search_then_answer(searches, "x", memory_words=12)
        (episode,) = start_episodes(agent, [example], tokenizer, config)
        (trajectory,) = run_lockstep(
            [episode], ScriptedLLM(tokenizer, reply), retriever, SamplingParams()
        )
        assert trajectory.end_reason == "answer"
        out.append(list(trajectory.sequences))
    return out


def reference(model: torch.nn.Module, trajectories: Sequence[Sequence[TokenSequence]]) -> list:
    """Per-turn log-probs: every turn its own (unpacked) sequence, as the learner does now."""
    flat = [s for t in trajectories for s in t]
    return response_logprobs(model, flat, token_budget=100_000, pad_id=0)


def max_gap(model: torch.nn.Module, batch: PackedBatch, expected: list, kind: str | None) -> float:
    with torch.no_grad():
        got = packed_logprobs(model, batch, kind=kind)
    flat = [s for p in batch.packs for s in p.sequences]
    gaps = [
        (g - e)[torch.tensor(s.loss_mask, dtype=torch.bool)].abs().max().item()
        for g, e, s in zip(got, expected, flat, strict=True)
    ]
    return max(gaps)


@pytest.fixture
def eager_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers compiles flex attention on first use, which takes minutes on this CPU; its
    singleton wrapper is handed the uncompiled (unfused, same math) function instead. The
    compiled kernel is not what this test checks: the BlockMask is."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as integration

    wrapper = integration.WrappedFlexAttention
    monkeypatch.setattr(wrapper, "_instance", None)
    monkeypatch.setattr(wrapper, "_is_flex_compiled", True)
    monkeypatch.setattr(wrapper, "training", False, raising=False)
    monkeypatch.setattr(wrapper, "_compiled_flex_attention", staticmethod(flex_attention))


@pytest.mark.slow
@pytest.mark.parametrize("kind, attention", CASES)
def test_packed_equals_per_turn(
    kind: str,
    attention: str,
    tiny_folder: Path,
    trajectories: list[list[TokenSequence]],
    eager_flex: None,
) -> None:
    model = load(tiny_folder, attention)
    # the reference runs the plain per-turn learner on the default attention, same weights
    expected = reference(load(tiny_folder, "sdpa"), trajectories)
    batch = collate_packed([pack(t) for t in trajectories], pad_id=0, kind=kind)
    assert max_gap(model, batch, expected, kind) < TOLERANCE
    # fewer tokens than the turns separately: the prefix is counted once per trajectory
    per_turn = sum(len(s.input_ids) for t in trajectories for s in t)
    assert batch.real_tokens < per_turn


@pytest.mark.slow
def test_the_release_mistakes_are_caught(
    tiny_folder: Path, trajectories: list[list[TokenSequence]]
) -> None:
    """The same check fails for MEM1's release: a 0/1 float mask (the model adds it, so it
    masks nothing), and positions that run on instead of restarting in each segment."""
    model = load(tiny_folder, "sdpa")
    expected = reference(model, trajectories)
    good = collate_packed([pack(t) for t in trajectories], pad_id=0, kind="bool")
    assert max_gap(model, good, expected, "bool") < TOLERANCE
    zero_one = allowed(good.segment_ids).to(torch.float32)  # 1 = attend, 0 = not, added as is
    release = PackedBatch(**{**good.__dict__, "attention_mask": zero_one})
    assert max_gap(model, release, expected, None) > 1e-2
    running = torch.arange(good.input_ids.shape[1]).expand_as(good.position_ids)
    positions = PackedBatch(**{**good.__dict__, "position_ids": running.contiguous()})
    assert max_gap(model, positions, expected, None) > 1e-3


@pytest.mark.slow
def test_later_tokens_change_no_earlier_logprob(
    tiny_folder: Path, trajectories: list[list[TokenSequence]]
) -> None:
    model = load(tiny_folder, "sdpa")
    turns = trajectories[1]  # MEM1, four turns
    assert len(turns) == 4

    def logprobs(sequences: list[TokenSequence]) -> list[torch.Tensor]:
        batch = collate_packed([pack(sequences)], pad_id=0, kind="bool")
        with torch.no_grad():
            return packed_logprobs(model, batch, kind="bool")

    before = logprobs(turns)
    for turn in (1, 3):  # a middle turn and the last one
        response = list(turns[turn].response_ids)
        j = len(response) // 2
        response[j] = (response[j] + 7) % 1000
        changed = [*turns]
        changed[turn] = TokenSequence(
            turns[turn].prompt_ids, tuple(response), turns[turn].loss_mask
        )
        after = logprobs(changed)
        for k in range(4):
            if k != turn:  # other turns do not see it, earlier or later
                torch.testing.assert_close(after[k], before[k], atol=1e-6, rtol=0)
        torch.testing.assert_close(after[turn][:j], before[turn][:j], atol=1e-6, rtol=0)
        assert (after[turn][j:] - before[turn][j:]).abs().max() > 1e-4


def test_pack_by_hand() -> None:
    """Prefix [1, 2] shared; turn 0: prompt [1, 2, 3], response [4, 5]; turn 1: prompt
    [1, 2], response [6] (it starts with its response, predicted from the prefix's end)."""
    turns = [TokenSequence((1, 2, 3), (4, 5), (1, 1)), TokenSequence((1, 2), (6,), (1,))]
    assert shared_prefix(turns) == 2
    packed = pack(turns)
    assert packed.input_ids == (1, 2, 3, 4, 5, 6)
    assert packed.position_ids == (0, 1, 2, 3, 4, 2)
    assert packed.segment_ids == (0, 0, 1, 1, 1, 2)
    assert packed.response_starts == (3, 5)
    assert packed.sources() == [2, 3, 1]
    mask = allowed(torch.tensor([list(packed.segment_ids) + [-1]]))[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 0],  # turn 1 sees the prefix and itself, not turn 0
        [0, 0, 0, 0, 0, 0, 1],  # padding sees only itself
    ]


def test_a_mask_the_backend_misreads_is_refused(tiny_folder: Path) -> None:
    model = load(tiny_folder, "eager")
    batch = collate_packed([pack([TokenSequence((1, 2), (3,), (1,))])], pad_id=0, kind="bool")
    with pytest.raises(MemSearcherError, match=r"'bool' mask needs attention \['sdpa'\]"):
        packed_logprobs(model, batch, kind="bool")
    with pytest.raises(MemSearcherError, match="unknown mask kind 'dense'"):
        collate_packed(batch.packs, pad_id=0, kind="dense")
