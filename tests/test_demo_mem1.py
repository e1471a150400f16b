"""The demo's oracle in MEM1's protocol and on multi-objective tasks, through the real agents,
tokenizer and BM25 index of a generated world."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from memsearcher.agent import Templates, run_lockstep, start_episodes
from memsearcher.agent.parsing import ParseFailure, parse_mem1_action
from memsearcher.data.compose import compose
from memsearcher.data.flashrag import read_examples
from memsearcher.data.synthetic import RELATIONS, WorldConfig, generate_world, write_world
from memsearcher.demo.model import build_tokenizer
from memsearcher.demo.pipeline import PRESETS
from memsearcher.demo.templates import DEMO_MEM1_TEMPLATES, DEMO_TEMPLATES, tokenizer_texts
from memsearcher.eval.metrics import exact_match, objective_sum
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFTokenizer
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.bm25 import build_bm25
from memsearcher.teach.oracle import oracle_policy

DEMO = PRESETS["full"]
TEMPLATES = Templates(**DEMO_TEMPLATES, **DEMO_MEM1_TEMPLATES)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder: Path = tmp_path_factory.mktemp("world")
    generated = generate_world(replace(WorldConfig(), seed=3))
    paths = write_world(generated, folder / "world")
    return {
        "test": read_examples(paths["test"])[:60],
        "index": build_bm25(paths["corpus"], folder / "index"),
        "tokenizer": HFTokenizer(build_tokenizer(tokenizer_texts(generated), DEMO.model.vocab)),
    }


def test_the_oracle_speaks_mem1(world: dict[str, Any]) -> None:
    examples, tokenizer = world["test"], world["tokenizer"]
    episodes = start_episodes("mem1", examples, tokenizer, DEMO.agent, TEMPLATES)
    oracle = ScriptedLLM(tokenizer, oracle_policy(examples))
    trajectories = run_lockstep(episodes, oracle, world["index"], SamplingParams())
    for t in trajectories:
        hops = t.example.metadata["hops"]
        assert exact_match(t.answer or "", t.example.golden_answers) == 1.0
        assert [turn.query for turn in t.turns[:-1]] == [h["entity"] for h in hops]
        assert len(t.sequences) == len(hops) + 1
        for turn in t.turns:
            assert not isinstance(parse_mem1_action(turn.action_text), ParseFailure)
        # the last internal state is exactly the chain's facts: it is the only memory
        facts = [RELATIONS[h["relation"]].format(subject=h["entity"], object=h["target"])
                 for h in hops]  # fmt: skip
        assert t.turns[-1].thought == " ".join(facts)


@pytest.mark.parametrize("agent", ["memsearcher", "react", "mem1"])
def test_the_oracle_answers_every_objective(world: dict[str, Any], agent: str) -> None:
    tasks = compose(world["test"], 3, seed=0)
    tokenizer = world["tokenizer"]
    # three objectives hold three chains of facts: more room than the single-question demo
    config = replace(DEMO.agent, max_turns=12, memory_tokens=256, max_new_tokens=256)
    episodes = start_episodes(agent, tasks, tokenizer, config, TEMPLATES)
    oracle = ScriptedLLM(tokenizer, oracle_policy(tasks))
    trajectories = run_lockstep(episodes, oracle, world["index"], SamplingParams())
    for t in trajectories:
        assert t.end_reason == "answer", t.error
        assert objective_sum(t.answer or "", t.example.objectives) == 3.0
        hops = sum(len(o["metadata"]["hops"]) for o in t.example.metadata["objectives"])
        assert 1 <= t.num_searches <= hops  # a fact read on the way saves a search
