"""Both agents with the real embedded model and the real embedded BM25 index.

The untrained 135M model rarely follows the protocol, so what is checked is the mechanics on
whatever it writes: every token of every sequence is either the model's own output (mask 1) or
inserted by the environment (mask 0), and sequences decode to the turn's conversation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

import pytest

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.llm.base import Completion, SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.retrieval.base import Retriever
from memsearcher.rl.rewards import trajectory_reward
from memsearcher.types import QAExample, Trajectory

QUESTIONS = [
    QAExample("q1", "Who wrote Hamlet?", ("William Shakespeare",)),
    QAExample("q2", "What is the capital of France?", ("Paris",)),
    QAExample("q3", "In which country is the Amazon river?", ("Brazil", "Peru")),
]
CONFIG = AgentConfig(max_turns=3, max_new_tokens=48, memory_tokens=48)


class RecordingLLM:
    def __init__(self, llm: HFModel) -> None:
        self.llm, self.completions = llm, []  # type: ignore[var-annotated]
        self.tokenizer, self.max_context_tokens = llm.tokenizer, llm.max_context_tokens

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        out = self.llm.generate(prompts, params)
        self.completions += [c.token_ids for c in out]
        return out


def run(agent: str, llm: HFModel, retriever: Retriever, seed: int) -> tuple[list[Trajectory], list]:
    recording = RecordingLLM(llm)
    episodes = start_episodes(agent, QUESTIONS, llm.tokenizer, CONFIG, None, llm.max_context_tokens)
    sampling = SamplingParams(temperature=1.0, seed=seed)
    return run_lockstep(episodes, recording, retriever, sampling), recording.completions


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["memsearcher", "react"])
def test_agent_end_to_end(agent: str, llm: HFModel, retriever: Retriever) -> None:
    trajectories, completions = run(agent, llm, retriever, seed=0)
    assert [t.example.id for t in trajectories] == ["q1", "q2", "q3"]
    for trajectory in trajectories:
        assert trajectory.agent == agent and trajectory.turns and trajectory.sequences
        assert trajectory.end_reason in {"answer", "format_error", "max_turns", "length"}
        assert 0.0 <= trajectory_reward(trajectory) <= 1.0
        assert (trajectory.end_reason == "answer") == (trajectory.answer is not None)
        for sequence in trajectory.sequences:
            model_tokens = [
                tok for tok, m in zip(sequence.response_ids, sequence.loss_mask, strict=True) if m
            ]
            # the model's tokens are the concatenation of some of its completions, in order
            assert any(
                tuple(model_tokens) == sum((completions[i] for i in chosen), ())
                for chosen in _ordered_subsets(completions, tuple(model_tokens))
            )
            text = llm.tokenizer.decode(sequence.input_ids)
            assert text.startswith("<|im_start|>system\n")
            assert trajectory.example.question in text
        for turn in trajectory.turns:
            assert turn.action_text in llm.tokenizer.decode(
                trajectory.sequences[turn.sequence_index].response_ids
            )
    # the same seed gives the same trajectories
    again, _ = run(agent, llm, retriever, seed=0)
    assert again == trajectories


def _ordered_subsets(completions: list, target: tuple) -> list[list[int]]:
    """Index lists of completions whose concatenation could be ``target`` (greedy match)."""
    chosen, position = [], 0
    for i, ids in enumerate(completions):
        if ids and target[position : position + len(ids)] == ids:
            chosen.append(i)
            position += len(ids)
    return [chosen] if position == len(target) else []


@pytest.mark.slow
def test_cli_ask(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ}
    command = [sys.executable, "-m", "memsearcher.cli", "ask", "Who wrote Hamlet?"]
    command += ["--max-turns", "2", "--top-n", "3"]  # turn 1 is what is checked
    shown = subprocess.run(
        command + ["--max-new-tokens", "48"], capture_output=True, text=True, env=env, timeout=300
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("Turn 1  (context ")
    assert "Answer: " in shown.stdout or "No answer (" in shown.stdout
    # the default model (SmolLM2 + the protocol adapter) completes a search turn
    turn_1 = shown.stdout.split("Turn 2")[0].splitlines()
    for label in ("think", "search", "hits", "memory"):
        assert any(line.split()[:1] == [label] for line in turn_1), (label, shown.stdout)
    as_json = subprocess.run(
        command + ["--json", "--agent", "react", "--max-new-tokens", "48"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert as_json.returncode == 0, as_json.stderr
    trajectory = json.loads(as_json.stdout)
    assert trajectory["agent"] == "react" and trajectory["turns"]
    assert Trajectory.from_dict(trajectory).example.question == "Who wrote Hamlet?"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ask", "  "], "the question is empty"),
        (["ask", "q", "--max-turns", "0"], "max_turns must be an integer in [1, 1000]"),
        (["ask", "q", "--retriever", "/no/such/index"], "no such index folder"),
    ],
)
def test_cli_ask_rejects_bad_input(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "memsearcher.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
