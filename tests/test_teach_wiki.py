"""The real-text question builder and its teacher: questions read off the embedded Wikipedia
with their chains of passages, the splits, and the imperfect teacher's stated flaw rates, with
the real embedded BM25 index and the real agents driving the teacher through `ScriptedLLM`."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.eval.metrics import exact_match
from memsearcher.llm import load_tokenizer
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.embedded import embedded_model_path
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.base import Retriever
from memsearcher.retrieval.embedded import embedded_passages
from memsearcher.teach.config import ProtocolDataConfig
from memsearcher.teach.oracle import TeacherFlaws
from memsearcher.teach.protocol_data import answerable, flaw_rates, wiki_splits
from memsearcher.teach.wiki import (
    PRONOUNS,
    WikiQuestion,
    entity_split,
    wiki_facts,
    wiki_oracle,
    wiki_questions,
)

ROOT = Path(__file__).parents[1]
HELDOUT = ROOT / "benchmarks" / "data" / "embedded-wiki-questions.jsonl"
TEACHER = AgentConfig(max_turns=4, memory_tokens=128, max_new_tokens=128, top_n=3)


@pytest.fixture(scope="module")
def passages() -> list[tuple[str, str]]:
    return [(p.title, p.text) for p in embedded_passages()]


@pytest.fixture(scope="module")
def splits() -> dict[str, list[WikiQuestion]]:
    return wiki_splits(ProtocolDataConfig(heldout=str(HELDOUT)))


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(str(embedded_model_path()))


def test_the_builder_is_deterministic_and_every_chain_is_read_off_its_passages(
    passages: list[tuple[str, str]],
) -> None:
    questions = wiki_questions(passages)
    assert questions == wiki_questions(passages)
    texts = dict(passages)
    two_hop = [q for q in questions if len(q.chain) == 2]
    assert len(two_hop) > 150 and len(questions) - len(two_hop) > 1500
    for question in questions:
        for fact in question.chain:
            assert fact.sentence in texts[fact.title] and fact.answer in fact.sentence
        assert question.answer == question.chain[-1].answer
    for question in two_hop:  # the bridge: the first answer names the second passage
        first, second = question.chain
        assert first.answer in (second.title, second.entity)
        assert second.title != first.title and question.answer != question.entity
    assert len({q.question for q in questions}) > 0.9 * len(questions)


def test_splits_go_by_starting_entity_and_no_test_fact_is_trained(
    splits: dict[str, list[WikiQuestion]], passages: list[tuple[str, str]]
) -> None:
    entities = {name: {q.entity for q in questions} for name, questions in splits.items()}
    assert not entities["train"] & entities["test"] and not entities["rl"] & entities["test"]
    assert not entities["train"] & entities["rl"]
    tested = {fact for q in splits["test"] for fact in q.chain}
    for name in ("train", "rl"):
        assert all(not tested.intersection(q.chain) for q in splits[name]), name
    for name in ("train", "rl", "test"):
        assert any(len(q.chain) == 2 for q in splits[name]), name
    # the negative control: without the fact rule, training would hold test facts
    loose = entity_split(wiki_questions(passages), (0.25, 0.35), seed=0)
    assert any(tested.intersection(q.chain) for q in loose["train"] + loose["rl"])


def test_the_teacher_answers_the_chains_it_keeps_searching_once_a_hop(
    splits: dict[str, list[WikiQuestion]],
    tokenizer,
    retriever: Retriever,  # type: ignore[no-untyped-def]
) -> None:
    two_hop = [q for q in splits["test"] if len(q.chain) == 2]
    kept = answerable(two_hop, tokenizer, retriever, TEACHER)
    assert len(kept) >= 0.6 * len(two_hop)  # at top 3, most bridges come back (33 of 48 today)
    for agent in ("memsearcher", "react"):  # and ReAct's teacher answers the same ones
        trajectories = _teach(agent, kept, TeacherFlaws(), tokenizer, retriever)
        for trajectory in trajectories:
            assert exact_match(trajectory.answer or "", trajectory.example.golden_answers)
            assert trajectory.num_searches == 2, trajectory.example.question
            first, bridge = (t.query for t in trajectory.turns if t.query)
            assert first == trajectory.example.metadata["entity"]
            assert bridge == trajectory.example.metadata["chain"][0]["answer"]


def test_the_teachers_flaws_hold_their_stated_rates_within_sampling_error(
    splits: dict[str, list[WikiQuestion]],
    tokenizer,
    retriever: Retriever,  # type: ignore[no-untyped-def]
) -> None:
    everything = [q for questions in splits.values() for q in questions]
    questions = [q for q in everything if len(q.chain) == 2]
    questions += [q for q in everything if len(q.chain) == 1][::8]
    kept = answerable(questions, tokenizer, retriever, TEACHER)
    flaws = TeacherFlaws(early_answer=0.5, category_query=0.25, seed=3)
    trajectories = [
        t
        for agent in ("memsearcher", "react")
        for t in _teach(agent, kept, flaws, tokenizer, retriever)
        if t.end_reason == "answer"
    ]
    rates = flaw_rates(trajectories)
    for name, count in (
        ("category_query", "trajectories"),
        ("early_answer", "two_hop_trajectories"),
    ):
        stated, n = getattr(flaws, name), rates[count]
        assert n > 100, name
        assert abs(rates[name] - stated) < 3 * math.sqrt(stated * (1 - stated) / n), (name, rates)
    # an early answer is the bridge entity, and a category search copies a title: both wrong
    for trajectory in trajectories:
        chain = trajectory.example.metadata["chain"]
        if len(chain) == 2 and trajectory.answer == chain[0]["answer"]:
            assert not exact_match(trajectory.answer or "", trajectory.example.golden_answers)
    # the ideal teacher shows neither flaw
    ideal = flaw_rates(_teach("memsearcher", kept, TeacherFlaws(), tokenizer, retriever))
    assert ideal["category_query"] == 0 and ideal["early_answer"] == 0


def _teach(agent, questions, flaws, tokenizer, retriever):  # type: ignore[no-untyped-def]
    llm = ScriptedLLM(tokenizer, wiki_oracle(questions, replace(flaws)))
    examples = [q.to_example() for q in questions]
    episodes = start_episodes(agent, examples, tokenizer, TEACHER)
    return run_lockstep(episodes, llm, retriever, SamplingParams())


def test_a_pronoun_is_never_an_answer(passages: list[tuple[str, str]]) -> None:
    """ "It is the capital and largest city of Catalonia." (Barcelona's passage) once gave an
    its_capital fact whose answer was "It", and with it the test question "What is the capital
    of the country or region where Antoni Gaudí is?" -> "It"."""
    sentence = "It is the capital and largest city of the autonomous community of Catalonia."
    facts = wiki_facts([("Barcelona", f"Barcelona is a city in Spain. {sentence}")])
    assert [fact.kind for fact in facts] == ["located_in"]
    answers = {fact.answer for fact in wiki_facts(passages)}
    assert not answers & PRONOUNS


def test_grpo_world_questions_come_from_worlds_the_sft_data_never_saw() -> None:
    from memsearcher.data.synthetic import WorldConfig, generate_world
    from memsearcher.teach.protocol_data import world_rl_questions

    config = ProtocolDataConfig(worlds=3, seed=5)  # SFT's worlds: seeds 1005, 1006, 1007
    passages, examples = world_rl_questions(config, worlds=2, per_world=3)
    after = [generate_world(WorldConfig(seed=seed)) for seed in (1008, 1009)]
    assert [(p.title, p.text) for p in passages] == [p for w in after for p in w.passages]
    assert len(examples) == 6 and len({e.id for e in examples}) == 6
    assert all(len(e.metadata["hops"]) > 1 for e in examples)
    assert world_rl_questions(config, 2, 3) == (passages, examples)
