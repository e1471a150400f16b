"""The embedded agent: its held-out questions, its SFT data, the packaged protocol adapter, and
a full search turn by the real model (SmolLM2-135M + adapter) on the real embedded index."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.config import load_config
from memsearcher.llm import load_tokenizer
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.embedded import (
    STACKS,
    embedded_agent_path,
    embedded_model_path,
    resolve_model,
)
from memsearcher.recipe.config import RecipeConfig
from memsearcher.retrieval import open_retriever
from memsearcher.retrieval.embedded import embedded_passages
from memsearcher.rl.train_sft import read_trajectories
from memsearcher.teach.protocol_data import build_protocol_data, wiki_splits
from memsearcher.teach.wiki import overlaps_heldout, read_heldout, wiki_questions
from memsearcher.types import QAExample

ROOT = Path(__file__).parents[1]
HELDOUT = ROOT / "benchmarks" / "data" / "embedded-wiki-questions.jsonl"
KNOWN = QAExample("hamlet", "Who wrote Hamlet?", ("William Shakespeare",))


def test_heldout_questions_are_answerable_from_their_passages() -> None:
    rows = read_heldout(HELDOUT)
    assert len(rows) >= 50
    assert len({row["question"] for row in rows}) == len(rows)
    passages = {p.title: p.text for p in embedded_passages()}
    for row in rows:
        text = passages[row["metadata"]["title"]].lower()
        assert any(answer.lower() in text for answer in row["golden_answers"]), row


def test_sft_data_never_touches_the_heldout_questions(tmp_path: Path) -> None:
    config = load_config(RecipeConfig, ROOT / "configs" / "embedded-agent.yaml")
    assert Path(config.build.heldout) == HELDOUT.relative_to(ROOT)
    rows = read_heldout(HELDOUT)
    titles = {row["metadata"]["title"] for row in rows}
    texts = {row["question"] for row in rows}
    # without the filter, the patterns would ask about held-out passages: the filter bites
    overlaps = overlaps_heldout(rows)
    candidates = wiki_questions([(p.title, p.text) for p in embedded_passages()], set())
    assert any(q.title in titles for q in candidates)
    assert all(overlaps(q) for q in candidates if q.title in titles or q.question in texts)

    # every two-hop question of the train split is taught, then one-hop ones up to
    # wiki_questions: leave room for some of those whatever the config's split shares
    small = replace(config.build, worlds=1, questions_per_world=4, bridge_copies=2)
    bridges = sum(len(q.chain) > 1 for q in wiki_splits(small)["train"])
    small = replace(small, wiki_questions=bridges + 20)
    tokenizer = load_tokenizer(str(embedded_model_path()))
    data = tmp_path / "protocol.jsonl"
    stats = build_protocol_data(small, data, tokenizer, lambda _: None)
    trajectories = read_trajectories(data)
    assert stats["wiki_trajectories"] > bridges + 20 and stats["synthetic_trajectories"] > 0
    assert {t.agent for t in trajectories} == {"memsearcher", "react"}
    # two-hop questions are taught bridge_copies times per agent (the retriever's misses
    # dropped), one-hop questions once
    taught = Counter(
        (t.agent, t.example.question, len(t.example.metadata["chain"]))
        for t in trajectories
        if "chain" in t.example.metadata
    )
    assert {n for (_, _, hops), n in taught.items() if hops == 1} == {1}
    assert max(n for (_, _, hops), n in taught.items() if hops == 2) == 2
    subjects = titles | {title.split(" (")[0] for title in titles}
    test = wiki_splits(small)["test"]
    tested = {(f.title, f.kind) for q in test for f in q.chain}
    test_entities = {q.entity for q in test}
    for trajectory in trajectories:
        example = trajectory.example
        assert example.question not in texts
        assert example.metadata.get("title") not in titles
        assert example.metadata.get("entity") not in subjects
        # nor the test split: not its starting entities, not a fact any test chain needs
        assert example.metadata.get("entity") not in test_entities
        for fact in example.metadata.get("chain", []):
            assert (fact["title"], fact["kind"]) not in tested
            assert fact["title"] not in titles and fact["answer"] not in subjects
        assert trajectory.end_reason == "answer" and trajectory.turns[0].query
        decoded = tokenizer.decode(trajectory.sequences[0].input_ids)
        assert decoded.startswith("<|im_start|>system\nAnswer the question by searching")


@pytest.mark.parametrize("name", sorted(STACKS))
def test_shipped_adapters_load_offline(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each packaged agent is the raw model with its adapters merged in order, computing what
    peft computes with the same adapters applied one after the other."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    stack = STACKS[name]
    for adapter in stack:
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] > 0
        assert (adapter / "adapter_model.safetensors").stat().st_size < 20_000_000
        assert (adapter / "README.md").is_file()
    merged_path = Path(resolve_model(name))
    assert merged_path == embedded_agent_path(stack)
    assert resolve_model("embedded-base") == str(embedded_model_path())
    assert resolve_model("some/hub-id") == "some/hub-id"

    merged = AutoModelForCausalLM.from_pretrained(merged_path, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32)
    raw = AutoModelForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32)
    for adapter in stack:
        reference = PeftModel.from_pretrained(reference, str(adapter)).merge_and_unload()
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1789, 30, 2]])
    with torch.no_grad():
        ours, theirs, plain = merged(ids).logits, reference(ids).logits, raw(ids).logits
    # our merge (plain safetensors arithmetic) computes what peft computes with the adapters on
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-3)
    assert (ours - plain).abs().max() > 0.1  # and the adapters change the model


@pytest.mark.slow
def test_adapter_completes_a_search_turn() -> None:
    """The mask-0 path with a real model: a tool call, the tool response (mask 0), a memory."""
    from memsearcher.llm.hf import HFModel

    llm = HFModel.from_pretrained(resolve_model("embedded"), device="cpu")
    # one turn is all the check needs: act, search, memory (then the turn limit ends it)
    config = AgentConfig(max_turns=1, max_new_tokens=48, memory_tokens=64, top_n=3)
    episodes = start_episodes("memsearcher", [KNOWN], llm.tokenizer, config)
    (trajectory,) = run_lockstep(episodes, llm, open_retriever(None), SamplingParams())
    first = trajectory.turns[0]
    assert first.query and first.hits and first.error is None
    assert first.memory  # the rewritten memory, parsed from <memory> ... </memory>
    sequence = trajectory.sequences[first.sequence_index]
    spans = _spans(sequence.response_ids, sequence.loss_mask)
    assert [mask for mask, _ in spans] == [1, 0, 1]
    action, inserted, memory = (llm.tokenizer.decode(ids) for _, ids in spans)
    assert "<tool_call>" in action and "<tool_response>" not in action
    assert "<tool_response>" in inserted and first.hits[0].title in inserted
    assert memory.strip().startswith("<memory>") and memory.strip().endswith("</memory>")


def _spans(ids: tuple[int, ...], mask: tuple[int, ...]) -> list[tuple[int, list[int]]]:
    spans: list[tuple[int, list[int]]] = []
    for token, m in zip(ids, mask, strict=True):
        if spans and spans[-1][0] == m:
            spans[-1][1].append(token)
        else:
            spans.append((m, [token]))
    return spans
