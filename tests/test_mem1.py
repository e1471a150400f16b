"""The MEM1 agent: its turns, its context rule, its hint, and exact per-turn sequences.

As in test_agents.py, the model side is `ScriptedLLM` with the replay policy; the tokenizer,
chat template and BM25 index are the real embedded ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_agents import Recording, run

from memsearcher.agent import AGENTS, AgentConfig, Templates, agent_type, start_episodes
from memsearcher.agent.mem1 import MEM1_STOP
from memsearcher.agent.parsing import (
    FinalAnswer,
    ParsedAction,
    ParseFailure,
    ToolCall,
    parse_mem1_action,
)
from memsearcher.agent.prompts import format_hits, mem1_hint
from memsearcher.agent.replay import search_then_answer
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import SamplingParams, Tokenizer
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.base import Retriever
from memsearcher.types import QAExample, Trajectory

QUESTIONS = [
    QAExample("q1", "Who wrote Hamlet?", ("William Shakespeare",)),
    QAExample("q2", "What is the capital of France?", ("Paris",)),
]


@pytest.fixture(scope="module")
def tokenizer(llm: HFModel) -> Tokenizer:
    return llm.tokenizer


def mem1_conversation(tokenizer: Tokenizer, trajectory: Trajectory, t: int, max_turns: int) -> str:
    """Turn t of a MEM1 trajectory as text, built from the turn records alone: the user
    message, then turn t-1's response and its observation, then turn t's response."""
    templates = Templates()
    user = templates.mem1_user.format(questions=trajectory.example.question)
    text = tokenizer.render_chat([{"role": "user", "content": user}], True)
    if t > 0:
        previous = trajectory.turns[t - 1]
        observation = templates.mem1_information.format(
            hint=mem1_hint(templates, max_turns - t), passages=format_hits(previous.hits)
        )
        text += previous.action_text + observation
    return text + trajectory.turns[t].action_text


def test_mem1_turn_sequences_decode_to_each_turns_conversation(
    tokenizer: Tokenizer, retriever: Retriever
) -> None:
    reply = search_then_answer(searches=3, answer="William Shakespeare")
    config = AgentConfig(max_turns=6)
    trajectories, llm = run("mem1", tokenizer, retriever, reply, config, QUESTIONS)
    generated = [c.token_ids for _, _, completions in llm.calls for c in completions]
    assert [p.stop for _, p, _ in llm.calls] == [("</search>", "</answer>")] * 4
    for trajectory in trajectories:
        assert trajectory.agent == "mem1" and trajectory.end_reason == "answer"
        assert trajectory.answer == "William Shakespeare"
        assert len(trajectory.turns) == len(trajectory.sequences) == 4
        question = trajectory.example.question
        assert [t.query for t in trajectory.turns] == [
            f"{question} part {k}" for k in (1, 2, 3)
        ] + [None]
        for t, (turn, sequence) in enumerate(
            zip(trajectory.turns, trajectory.sequences, strict=True)
        ):
            assert turn.sequence_index == t
            assert tokenizer.decode(sequence.input_ids) == mem1_conversation(
                tokenizer, trajectory, t, config.max_turns
            )
            # the response is exactly one completion of the model, all of it trained
            assert sequence.response_ids in generated
            assert sequence.loss_mask == (1,) * len(sequence.response_ids)
            assert turn.prompt_tokens == len(sequence.prompt_ids)
            assert turn.generated_tokens == len(sequence.response_ids)
            if t > 0:  # the previous response enters the context as its own generated ids
                previous = trajectory.sequences[t - 1]
                first = len(trajectory.sequences[0].prompt_ids)
                assert sequence.prompt_ids[:first] == trajectory.sequences[0].prompt_ids
                assert sequence.prompt_ids[first : first + len(previous.response_ids)] == (
                    previous.response_ids
                )
        # the hint counts down, and the internal state is the only memory carried forward
        texts = [tokenizer.decode(s.prompt_ids) for s in trajectory.sequences]
        assert "[HINT]You have 5 turns left.[/HINT]" in texts[1]
        assert "[HINT]You have 3 turns left.[/HINT]" in texts[3]
        for tag in ("<information>", "<think>", "<search>"):  # beyond the instructions' own
            assert texts[3].count(tag) - texts[0].count(tag) == 1


def test_mem1_last_turn_hint_and_turn_limit(tokenizer: Tokenizer, retriever: Retriever) -> None:
    reply = search_then_answer(searches=100, answer="never")
    trajectories, _ = run("mem1", tokenizer, retriever, reply, AgentConfig(max_turns=3))
    for trajectory in trajectories:
        assert trajectory.end_reason == "max_turns" and trajectory.answer is None
        assert len(trajectory.turns) == len(trajectory.sequences) == 3
        last_prompt = tokenizer.decode(trajectory.sequences[2].prompt_ids)
        assert "You have 1 turn left. You must answer the question in the next turn." in (
            last_prompt
        )


def test_mem1_context_stays_flat(tokenizer: Tokenizer, retriever: Retriever) -> None:
    """MEM1's context is bounded by prompt + one response + one observation, whatever the
    turn; ReAct's grows with every turn (same policy, same searches)."""
    reply = search_then_answer(searches=6, answer="x", memory_words=40)
    config = AgentConfig(max_turns=8)
    contexts = {}
    for agent in ("mem1", "react"):
        (trajectory,), _ = run(agent, tokenizer, retriever, reply, config, QUESTIONS[:1])
        assert trajectory.end_reason == "answer"
        contexts[agent] = [t.prompt_tokens for t in trajectory.turns]
    mem1, react = contexts["mem1"], contexts["react"]
    assert max(mem1[1:]) - min(mem1[1:]) < 150  # only the note and the passages vary
    assert react[-1] > 3 * react[1]


@pytest.mark.parametrize(
    "text, kind",
    [
        ("no think <search> x </search>", "missing_think"),
        ("<think> a </think> nothing", "no_action"),
        ("<think> a </think><search> x </search><answer> y </answer>", "ambiguous_action"),
        ("<think> a </think><search> x </search><search> y </search>", "multiple_actions"),
        ("<think> a </think><search> x", "unclosed_action"),
        ("<think> a </think><search>  </search>", "empty_query"),
        ("<think> a </think><answer> </answer>", "empty_answer"),
    ],
)
def test_mem1_format_failures(
    text: str, kind: str, tokenizer: Tokenizer, retriever: Retriever
) -> None:
    parsed = parse_mem1_action(text)
    assert isinstance(parsed, ParseFailure) and parsed.kind == kind
    if any(text.index(stop) + len(stop) < len(text) for stop in MEM1_STOP if stop in text):
        return  # generation stops at the first </search> or </answer>: the agent never sees it
    (trajectory,), _ = run(
        "mem1", tokenizer, retriever, lambda p, s: text, AgentConfig(), QUESTIONS[:1]
    )
    assert trajectory.end_reason == "format_error" and trajectory.error.startswith(kind)
    assert trajectory.sequences[0].loss_mask == (1,) * len(trajectory.sequences[0].response_ids)


def test_mem1_parser_reads_actions() -> None:
    search = parse_mem1_action(
        "<think> <search> in thought </search> </think>\n<search> q </search>"
    )
    assert not isinstance(search, ParseFailure)
    assert search.action == ToolCall(query="q", top_n=None)
    answer = parse_mem1_action("<think> s </think> <answer> Paris; 1889 </answer>")
    assert not isinstance(answer, ParseFailure)
    assert answer.think == "s" and answer.action == FinalAnswer("Paris; 1889")


def test_mem1_is_registered_and_unknown_agents_are_named() -> None:
    assert agent_type("mem1") is AGENTS["mem1"]
    with pytest.raises(MemSearcherError, match=r"'mem1', 'memsearcher', 'react'"):
        agent_type("mem2")


def test_mem1_length_cut(tokenizer: Tokenizer, retriever: Retriever) -> None:
    long_state = "<think> " + "fact " * 200
    llm = Recording(ScriptedLLM(tokenizer, lambda p, s: long_state))
    episodes = start_episodes("mem1", QUESTIONS[:1], tokenizer, AgentConfig(max_new_tokens=32))
    (trajectory,) = _run(episodes, llm, retriever)
    assert trajectory.end_reason == "length"
    assert len(trajectory.sequences[0].response_ids) == 32


def _run(episodes: Sequence, llm: Recording, retriever: Retriever) -> list[Trajectory]:
    from memsearcher.agent import run_lockstep

    return run_lockstep(episodes, llm, retriever, SamplingParams())


_PIECES = st.sampled_from(
    ["<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>", " ", "a", ";", "\n"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=14).map("".join) | st.text(max_size=60))
def test_mem1_parser_never_raises(text: str) -> None:
    result = parse_mem1_action(text)
    assert isinstance(result, ParsedAction | ParseFailure)
    if isinstance(result, ParsedAction):
        after = text[text.index("</think>") :]
        assert after.count("<search>") + after.count("<answer>") == 1


@pytest.mark.parametrize("command", [["ask", "Who?"], ["eval", "--data", "x", "--out", "y"]])
def test_an_unknown_agent_fails_before_anything_loads(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from memsearcher.cli import main

    assert main([*command, "--agent", "mem2"]) == 2
    assert "unknown agent 'mem2'; choose one of ['mem1', 'memsearcher', 'react']" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("command", [["ask", "Who?"], ["eval", "--data", "x", "--out", "y"]])
def test_answer_on_repeat_is_refused_for_mem1(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """MEM1 writes its own actions (``<search>``, ``<answer>``); the option would do nothing."""
    from memsearcher.cli import main

    assert main([*command, "--agent", "mem1", "--answer-on-repeat"]) == 2
    assert "--answer-on-repeat is for memsearcher and react, not mem1" in capsys.readouterr().err
