"""Multi-objective QA (MEM1): the composer, the count rule, the rewards, and all three agents
answering N-objective tasks through the real eval loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memsearcher.agent import AgentConfig, Templates, run_lockstep, start_episodes
from memsearcher.agent.replay import search_then_answer
from memsearcher.cli import main
from memsearcher.data.compose import compose, write_examples
from memsearcher.data.flashrag import read_examples
from memsearcher.errors import MemSearcherError
from memsearcher.eval.metrics import exact_match, f1_score, objective_sum, split_answers
from memsearcher.eval.predictions import read_predictions
from memsearcher.eval.run import EvalConfig, run_eval
from memsearcher.llm.base import SamplingParams, Tokenizer
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.base import Retriever
from memsearcher.rl.rewards import REWARDS
from memsearcher.types import QAExample, Trajectory

FIVE = [
    QAExample("a", "Who wrote Hamlet", ("William Shakespeare", "Shakespeare")),
    QAExample("b", "What is the capital of France?", ("Paris",)),
    QAExample("c", "Which planet is red?", ("Mars",)),
    QAExample("d", "Who painted the Mona Lisa", ("Leonardo da Vinci",)),
    QAExample("e", "What is 2+2?", ("4", "four")),
]


# -- composer -------------------------------------------------------------------------------


def test_compose_by_hand() -> None:
    # random.Random(0).shuffle([0, 1, 2, 3, 4]) == [2, 1, 0, 4, 3]: tasks (c, b), (a, e); d
    # is left over
    tasks = compose(FIVE, objectives=2, seed=0)
    assert [t.id for t in tasks] == ["c+b", "a+e"]
    assert tasks[1].question == "Who wrote Hamlet?; What is 2+2?"  # a "?" added where missing
    assert tasks[1].golden_answers == ("William Shakespeare; 4",)
    assert tasks[1].objectives == (("William Shakespeare", "Shakespeare"), ("4", "four"))
    assert [o["id"] for o in tasks[1].metadata["objectives"]] == ["a", "e"]
    assert tasks[0].metadata["objectives"][0]["question"] == "Which planet is red?"
    # deterministic for a seed, another seed another order
    assert compose(FIVE, 2, 0) == tasks
    assert [t.id for t in compose(FIVE, 2, 1)] == ["c+d", "e+a"]  # [2, 3, 4, 0, 1]
    # N = 1 keeps every question, each as a one-objective task
    singles = compose(FIVE, 1, 0)
    assert sorted(t.id for t in singles) == ["a", "b", "c", "d", "e"]
    assert all(len(t.objectives) == 1 for t in singles)
    assert [t.id for t in compose(FIVE, 5, 3)][0].count("+") == 4


def test_compose_refuses_bad_input() -> None:
    with pytest.raises(MemSearcherError, match="objectives must be >= 1"):
        compose(FIVE, 0, 0)
    with pytest.raises(MemSearcherError, match="from 5 questions"):
        compose(FIVE, 6, 0)
    with pytest.raises(MemSearcherError, match="already a composed task"):
        compose(compose(FIVE, 2, 0), 2, 0)


def test_compose_cli_round_trips_through_flashrag(tmp_path: Path) -> None:
    source = write_examples(tmp_path / "nq.jsonl", FIVE)
    out = tmp_path / "nq-x2.jsonl"
    args = ["data", "compose", "--data", str(source), "--objectives", "2", "--out", str(out)]
    assert main(args) == 0
    assert read_examples(out) == compose(FIVE, 2, 0)
    assert main(args) == 2  # never overwrites unasked
    assert main([*args[:-1], str(source), "--overwrite"]) == 2  # nor its own input
    assert main([*args, "--overwrite", "--seed", "1", "--limit", "1"]) == 0
    assert [e.id for e in read_examples(out)] == ["c+d"]


@pytest.mark.parametrize(
    "objectives, message",
    [
        ([], "non-empty list"),
        ([{"question": "q?"}], "objective 1: 'golden_answers' must be"),
        ([{"question": "q?", "golden_answers": []}], "objective 1: 'golden_answers' must be"),
        ([{"question": "q?", "golden_answers": ["x"]}, "no"], "objective 2 needs"),
    ],
)
def test_bad_objectives_are_named(tmp_path: Path, objectives: list, message: str) -> None:
    row = {"id": "t", "question": "q?", "golden_answers": ["x"]}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({**row, "metadata": {"objectives": objectives}}) + "\n")
    with pytest.raises(MemSearcherError, match=rf"bad.jsonl:1: .*{message}"):
        read_examples(path)


# -- the count rule -------------------------------------------------------------------------

GOLDS = [("William Shakespeare", "Shakespeare"), ("Paris",), ("Mars",)]


@pytest.mark.parametrize(
    "prediction, em",
    [
        ("Shakespeare; Paris; Mars", 3.0),
        ("the Shakespeare ;paris.;  MARS ", 3.0),  # normalized per position
        ("Shakespeare; London; Mars", 2.0),
        ("Paris; Shakespeare; Mars", 1.0),  # positions matter
        ("Shakespeare; Paris", 0.0),  # too few: the count rule
        ("Shakespeare; Paris; Mars; Venus", 0.0),  # too many
        ("Shakespeare; Paris; Mars;", 0.0),  # a trailing ';' is a fourth (empty) answer
        ("", 0.0),
    ],
)
def test_count_rule_exact_match(prediction: str, em: float) -> None:
    assert objective_sum(prediction, GOLDS, exact_match) == em


def test_count_rule_f1_by_hand() -> None:
    # "William Shakespeare" vs golds: F1 1.0; "Paris France" vs "Paris": p 1/2, r 1 -> 2/3;
    # "red Mars" vs "Mars": 2/3 as well
    assert objective_sum("William Shakespeare; Paris France; red Mars", GOLDS, f1_score) == (
        pytest.approx(1 + 2 / 3 + 2 / 3)
    )
    assert objective_sum("Paris France; red Mars", GOLDS, f1_score) == 0.0
    assert split_answers(" a ;b; ") == ["a", "b", ""]
    # one objective: a plain answer scores as the single-question metric does
    assert objective_sum("paris", [("Paris",)], exact_match) == exact_match("paris", ["Paris"])


def _trajectory(example: QAExample, answer: str | None, reason: str = "answer") -> Trajectory:
    return Trajectory(example, "mem1", (), (), reason, answer)  # type: ignore[arg-type]


def test_multi_rewards() -> None:
    (task,) = compose(FIVE[:3], 3, 0)  # order [0, 2, 1]: a, c, b
    assert task.id == "a+c+b"
    golds = task.objectives
    answer = "; ".join(g[0] for g in golds)
    assert REWARDS["multi-em"](_trajectory(task, answer)) == 3.0
    assert REWARDS["multi-f1"](_trajectory(task, answer)) == 3.0
    wrong_count = "; ".join(g[0] for g in golds[:2])
    assert REWARDS["multi-em"](_trajectory(task, wrong_count)) == 0.0
    assert REWARDS["multi-em"](_trajectory(task, answer, "format_error")) == 0.0
    # a plain question is one objective
    assert REWARDS["multi-em"](_trajectory(FIVE[1], "paris")) == 1.0
    assert REWARDS["multi-em"](_trajectory(FIVE[1], "paris; paris")) == 0.0


# -- the three agents on N-objective tasks ----------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(llm: HFModel) -> Tokenizer:
    return llm.tokenizer


@pytest.mark.parametrize("agent", ["memsearcher", "react", "mem1"])
def test_every_agent_answers_n_objectives(
    agent: str, tokenizer: Tokenizer, retriever: Retriever, tmp_path: Path
) -> None:
    tasks = compose(FIVE[:4], 2, 0)  # order [2, 0, 1, 3]: tasks (c, a) and (b, d)
    answers = {"c+a": "Mars; Shakespeare", "b+d": "Paris; Picasso"}

    def reply(prompt: str, params: SamplingParams) -> str:
        key = "c+a" if "Which planet is red?; Who wrote Hamlet?" in prompt else "b+d"
        return search_then_answer(1, answers[key])(prompt, params)

    llm = ScriptedLLM(tokenizer, reply)
    config = EvalConfig(agent, AgentConfig(max_turns=3), batch_size=2)
    summary = run_eval({"toy": tasks}, llm, retriever, config, tmp_path, progress=False)
    toy = summary["datasets"]["toy"]
    assert toy["questions"] == 2 and toy["objectives"] == 2.0
    assert toy["em"] == (2.0 + 1.0) / 2  # summed per task, then averaged over tasks
    records = {r["id"]: r for r in read_predictions(tmp_path / "toy" / "predictions.jsonl")}
    assert records["c+a"]["em"] == 2.0
    assert records["b+d"]["em"] == 1.0 and records["b+d"]["f1"] == 1.0
    for record in records.values():
        trajectory = Trajectory.from_dict(record["trajectory"])
        assert record["peak_tokens"] == max(len(s.input_ids) for s in trajectory.sequences)
        assert record["seconds"] >= 0
    assert toy["peak_tokens"]["max"] == max(r["peak_tokens"] for r in records.values())
    assert toy["seconds_per_question"] is not None
    # the questions and, for MemSearcher and ReAct, the instruction to box all answers
    first = Trajectory.from_dict(records["c+a"]["trajectory"]).sequences[0]
    prompt = tokenizer.decode(first.prompt_ids)
    assert "Which planet is red?; Who wrote Hamlet?" in prompt
    if agent != "mem1":
        assert Templates().multi_question.format(count=2, questions=tasks[0].question) in prompt


def test_single_questions_are_shown_as_before(tokenizer: Tokenizer, retriever: Retriever) -> None:
    llm = ScriptedLLM(tokenizer, search_then_answer(0, "Paris"))
    (episode,) = start_episodes("memsearcher", FIVE[1:2], tokenizer, AgentConfig())
    (trajectory,) = run_lockstep([episode], llm, retriever, SamplingParams())
    prompt = tokenizer.decode(trajectory.sequences[0].prompt_ids)
    assert "<question> What is the capital of France? </question>" in prompt


def test_report_plots_peak_tokens_against_n(
    tokenizer: Tokenizer, retriever: Retriever, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One search per objective: ReAct's peak context grows with N, MEM1's and MemSearcher's
    stay flat (the scripted note is capped, as a trained memory would be)."""
    questions = [QAExample(f"q{i}", f"Question number {i}?", ("x",)) for i in range(8)]
    runs = []
    for agent in ("memsearcher", "react", "mem1"):
        for n in (1, 2, 4):
            reply = search_then_answer(n, "; ".join(["x"] * n), memory_words=30)
            config = EvalConfig(agent, AgentConfig(max_turns=n + 1, top_n=3))
            out = tmp_path / f"{agent}-{n}"
            tasks = compose(questions, n, 0)[:2]
            llm = ScriptedLLM(tokenizer, reply)
            run_eval({"toy": tasks}, llm, retriever, config, out, progress=False)
            runs.append(str(out))
    from memsearcher.eval.report import load_rows, objective_points

    rows = load_rows(runs)
    assert all(r["em"] == r["objectives"] for r in rows)  # every answer right: EM = N
    peaks = {agent: dict(points) for agent, points in objective_points(rows, "peak_tokens").items()}
    assert peaks["react"][4.0] > 2 * peaks["react"][1.0]
    for agent in ("memsearcher", "mem1"):
        assert peaks[agent][4.0] < 1.3 * peaks[agent][1.0]
    plots = tmp_path / "plots"
    assert main(["eval", "report", *runs, "--plots", str(plots)]) == 0
    table = capsys.readouterr().out
    assert "peak tok" in table and "4.000" in table  # summed EM of a 4-objective row
    for name in ("peak_tokens_by_objectives.png", "em_by_objectives.png"):
        assert (plots / name).stat().st_size > 1000
