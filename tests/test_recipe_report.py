"""The recipe's report maths on records written by hand: the paired bootstrap, the behaviour
counts, one record per question when an evaluation retried an error, and GRPO's rollouts by
block of steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memsearcher.eval.report import paired_bootstrap
from memsearcher.recipe.report import (
    agent_gaps,
    analyse,
    behaviour,
    format_rollouts,
    rollouts,
)
from memsearcher.types import QAExample, Trajectory, Turn

HAMLET = [{"entity": "Hamlet", "answer": "William Shakespeare"},
          {"entity": "William Shakespeare", "answer": "English"}]  # fmt: skip
OSLO = [{"entity": "Oslo", "answer": "Norway"}]


def record(qid: str, chain: list[dict[str, Any]], queries: list[str], memories: list[str | None],
           prediction: str | None, em: float) -> dict[str, Any]:  # fmt: skip
    turns = [{"query": q, "memory": m} for q, m in zip(queries, memories, strict=True)]
    return {
        "id": qid,
        "prediction": prediction,
        "em": em,
        "f1": em,
        "end_reason": "answer" if prediction is not None else "max_turns",
        "searches": len(queries),
        "prompt_tokens": [300] * (len(queries) + 1),
        "trajectory": {
            "agent": "memsearcher",
            "example": {"metadata": {"chain": chain}},
            "turns": [*turns, {"query": None, "memory": None}],
        },
    }


def test_paired_bootstrap_mean_and_interval() -> None:
    constant = paired_bootstrap([0.5] * 10, resamples=500)
    assert constant == {"questions": 10, "gain": 0.5, "low": 0.5, "high": 0.5}
    spread = paired_bootstrap([1.0, 0.0, 0.0, 0.0], resamples=2000)
    assert spread["gain"] == 0.25
    assert 0.0 <= spread["low"] < 0.25 < spread["high"] <= 1.0
    assert paired_bootstrap([], resamples=10)["gain"] is None


def test_behaviour_counts_what_each_key_says() -> None:
    two_hop = record("h", HAMLET, ["Hamlet", "William Shakespeare"],
                     ["Hamlet was written by William Shakespeare.", "He was English."],
                     "English", 1.0)  # fmt: skip
    one_hop = record("o", OSLO, ["capital city"], ["Oslo is a city."], "Norway", 1.0)
    assert behaviour([two_hop, one_hop]) == {
        "searches_per_hop": 3 / 3,
        "early_answers": 0.0,
        "first_query_entity": 0.5,  # "capital city" is not Oslo
        "memory_keeps_bridge": 0.5,  # the second memory dropped "William Shakespeare"
    }
    early = record("e", HAMLET, ["Hamlet"], ["Hamlet is a play."], "Danish", 0.0)
    assert behaviour([early])["early_answers"] == 1.0
    assert behaviour([early])["memory_keeps_bridge"] == 0.0


def test_a_retried_error_counts_once(tmp_path: Path) -> None:
    error = {"id": "h", "error": "boom", "prediction": None, "em": 0.0, "f1": 0.0,
             "end_reason": "error", "searches": 0, "trajectory": None}  # fmt: skip
    answered = record("h", HAMLET, ["Hamlet", "William Shakespeare"],
                      ["by William Shakespeare", "English"], "English", 1.0)  # fmt: skip
    before = record("h", HAMLET, ["Hamlet"], ["Hamlet is a play."], "Danish", 0.0)
    for run, rows in (("sft-memsearcher", [before]), ("grpo-memsearcher", [error, answered])):
        folder = tmp_path / "eval" / run / "test"
        folder.mkdir(parents=True)
        lines = "".join(json.dumps(row) + "\n" for row in rows)
        (folder / "predictions.jsonl").write_text(lines, encoding="utf-8")
    analysis = analyse(tmp_path, ["memsearcher"], bootstrap=100)
    after = analysis["runs"]["grpo/memsearcher"]["test"]
    assert after["questions"] == 1 and after["em"] == 1.0
    assert analysis["gains"]["memsearcher"]["test"]["gain"] == pytest.approx(1.0)


def test_agent_gaps_pair_memsearcher_and_react_by_question_and_by_hops() -> None:
    """MemSearcher minus ReAct at a stage: by dataset, and by hops where a dataset mixes
    them; a question only one agent answered is left out."""
    ours = [record("h", HAMLET, ["Hamlet"], ["m"], "Danish", 0.0),
            record("o", OSLO, ["Oslo"], ["m"], "Norway", 1.0),
            record("p", OSLO, ["Oslo"], ["m"], "Norway", 1.0)]  # fmt: skip
    react = [record("h", HAMLET, ["Hamlet", "Shakespeare"], ["", ""], "English", 1.0),
             record("o", OSLO, ["Oslo"], [""], "Oslo", 0.0)]  # fmt: skip
    heldout = [record("q", OSLO, ["Oslo"], ["m"], "Norway", 1.0)]
    records = {"grpo/memsearcher": {"test": ours, "heldout": heldout},
               "grpo/react": {"test": react, "heldout": heldout},
               "sft/memsearcher": {"test": ours}}  # fmt: skip
    gaps = agent_gaps(records, bootstrap=200)
    assert set(gaps) == {"grpo"}  # sft was not evaluated as ReAct
    assert {k: (g["questions"], g["gain"]) for k, g in gaps["grpo"].items()} == {
        "test": (2, 0.0),
        "test, 1-hop": (1, 1.0),
        "test, 2-hop": (1, -1.0),
        "heldout": (1, 0.0),
        "pooled": (3, 0.0),
    }


def sample(example: QAExample, queries: list[str], answer: str | None) -> dict[str, Any]:
    """A line of GRPO's samples file: the trainer's reward, then the trajectory's fields."""
    turns = [Turn(k, 300, 20, k, "", query=q) for k, q in enumerate(queries)]
    turns.append(Turn(len(queries), 300, 10, len(queries), "", answer=answer))
    trajectory = Trajectory(example, "memsearcher", tuple(turns), (), "answer", answer)
    return {"reward": 0.5, **trajectory.to_dict()}


def test_grpo_rollouts_are_described_by_block_and_by_source(tmp_path: Path) -> None:
    wiki = QAExample("wiki-h", "Hamlet's author's nationality?", ("English",), {"chain": HAMLET})
    hops = [{"entity": "Tarsk", "relation": "author", "target": "Vel Orm"},
            {"entity": "Vel Orm", "relation": "born_in", "target": "Brask"}]  # fmt: skip
    world = QAExample("world3-rl-1", "Where was Tarsk's author born?", ("Brask",), {"hops": hops})
    samples = tmp_path / "samples"
    samples.mkdir()
    steps = {
        1: [sample(wiki, ["Hamlet"], "Danish"), sample(world, ["Tarsk"], "Vel Orm")],
        2: [sample(wiki, ["Hamlet", "William Shakespeare"], "English")],
        3: [sample(world, ["Tarsk", "Vel Orm"], "Brask")],
    }
    for step, rows in steps.items():
        lines = "".join(json.dumps(row) + "\n" for row in rows)
        (samples / f"step-{step}.jsonl").write_text(lines, encoding="utf-8")
    blocks = {(b["steps"], b["source"]): b for b in rollouts(tmp_path, block=2)}
    assert set(blocks) == {("1-2", "wikipedia"), ("1-2", "worlds"), ("3-4", "worlds")}
    first = blocks[("1-2", "wikipedia")]
    assert first["questions"] == 2 and first["em"] == 0.5
    assert first["by_hops"]["2"]["searches_per_question"] == 1.5
    assert first["behaviour"]["early_answers"] == 0.5  # "Danish" after one search
    # a world's hops are its chain: answering the bridge after one search is early
    assert blocks[("1-2", "worlds")]["behaviour"]["early_answers"] == 1.0
    assert blocks[("1-2", "worlds")]["em"] == 0.0
    assert blocks[("3-4", "worlds")]["em"] == 1.0
    assert blocks[("3-4", "worlds")]["behaviour"]["first_query_entity"] == 1.0
    assert "| 1-2 | wikipedia | 2 | 0.500 |" in format_rollouts(list(blocks.values()))
