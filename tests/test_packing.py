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


@pytest.fixture(scope="module")
def smollm() -> torch.nn.Module:
    """The shipped SmolLM2-135M checkpoint with its own config (tied embeddings, its rope base,
    sdpa attention by default), cut to its first layer, with LoRA adapters on every
    projection as the embedded recipe trains it, so a CPU test can take gradients. The
    adapters' B start random rather than zero, so every adapter weight has a gradient."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from memsearcher.llm.embedded import embedded_model_path

    base = AutoModelForCausalLM.from_pretrained(
        embedded_model_path(), num_hidden_layers=1, dtype=torch.float32
    )
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=projections))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.02)
    return model.train()


def learner_step(
    model: torch.nn.Module,
    trajectories: list[list[TokenSequence]],
    learner: str,
    advantage: str,
    wrong_positions: bool = False,
) -> tuple[list[torch.Tensor], dict[str, float], int]:
    """What a trainer step's learner does with one mini-batch of these trajectories: cut it
    into micro-batches (`learner_batches`) and accumulate the policy loss's gradient, with old
    log-probs off the current ones, so ratios and the KL term are not trivial; returns the
    gradient, the loss metrics and the tokens processed."""
    import dataclasses

    from memsearcher.rl.config import GRPOConfig
    from memsearcher.rl.distributed import Runtime
    from memsearcher.rl.learner import accumulate_gradients, learner_batches
    from memsearcher.rl.packing import PackedMicroBatch, mask_kind_of

    sequences = [s for t in trajectories for s in t]
    trajectory_ids = torch.tensor([j for j, t in enumerate(trajectories) for _ in t])
    noise = torch.Generator().manual_seed(0)
    old = [0.2 * torch.randn(len(s.response_ids), generator=noise) - 2.0 for s in sequences]
    ref = [lp - 0.1 for lp in old]
    advantages: torch.Tensor | list[torch.Tensor]
    if advantage == "grpo":  # one per trajectory, on all its turns
        advantages = torch.linspace(-1.0, 1.0, len(trajectories))[trajectory_ids]
    else:  # PPO: per token, with an entropy bonus
        advantages = [torch.randn(len(s.response_ids), generator=noise) for s in sequences]
    config = GRPOConfig(
        advantage=advantage, learner=learner, beta=0.05, entropy_coef=0.01,
        micro_batch_tokens=1500, clip_low=0.2, clip_high=0.3,
    )  # fmt: skip
    kind = mask_kind_of(model) if learner == "packed" else None
    lengths = [len(s.input_ids) for s in sequences]
    members = list(range(len(sequences)))
    micro = learner_batches(sequences, members, lengths, trajectory_ids, 0, config, kind)
    assert all(isinstance(b, PackedMicroBatch) == (learner == "packed") for b in micro)
    if wrong_positions:  # MEM1's release: positions run on through the packed row
        micro = [
            dataclasses.replace(b, packed=dataclasses.replace(b.packed, position_ids=torch.arange(
                b.packed.input_ids.shape[1]).expand_as(b.packed.input_ids).contiguous()))
            for b in micro if isinstance(b, PackedMicroBatch)
        ]  # fmt: skip
    one = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    metrics = accumulate_gradients(model, micro, old, ref, advantages, trajectory_ids, config, one)
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return grads, metrics, sum(b.padded_tokens for b in micro)


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_the_packed_learner_gives_the_per_turn_gradient(
    smollm: torch.nn.Module, trajectories: list[list[TokenSequence]], advantage: str
) -> None:
    """``learner: packed`` in a trainer's learner step gives the per-turn gradient and loss
    to 1e-5, on real MemSearcher, MEM1 and ReAct trajectories and a real checkpoint: GRPO with
    the KL term, and PPO's per-token advantages with the entropy bonus; with fewer tokens."""
    per_turn, turn_metrics, turn_tokens = learner_step(smollm, trajectories, "per-turn", advantage)
    packed, packed_metrics, packed_tokens = learner_step(smollm, trajectories, "packed", advantage)
    assert packed_tokens < turn_tokens
    for key, value in turn_metrics.items():
        assert packed_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for got, want in zip(packed, per_turn, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # negative control: positions that run on through the row give another gradient
    wrong, _, _ = learner_step(smollm, trajectories, "packed", advantage, wrong_positions=True)
    assert max((a - b).abs().max().item() for a, b in zip(wrong, per_turn, strict=True)) > 1e-4
