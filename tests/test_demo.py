"""The demo's synthetic world, its oracle, and the `memsearcher demo --quick` run end to end.

Real parts throughout: the generator's files, a real BM25 index of them, a byte-level BPE
tokenizer trained here, and the real agents driving the oracle through `ScriptedLLM`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from memsearcher.agent import Templates, run_lockstep, start_episodes
from memsearcher.agent.parsing import ParseFailure, parse_action, parse_memory
from memsearcher.data.flashrag import read_examples
from memsearcher.data.synthetic import (
    RELATIONS,
    SPLITS,
    WorldConfig,
    generate_world,
    rename_world,
    write_world,
)
from memsearcher.demo.behaviour import BEHAVIOURS, behaviour
from memsearcher.demo.copying import copy_sequences, fact_lookups
from memsearcher.demo.model import build_tokenizer, save_demo_model
from memsearcher.demo.pipeline import OUTPUTS, PRESETS
from memsearcher.demo.templates import DEMO_TEMPLATES, tokenizer_texts
from memsearcher.errors import MemSearcherError
from memsearcher.eval.metrics import exact_match
from memsearcher.folders import MARKER
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFTokenizer
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.bm25 import build_bm25
from memsearcher.rl.rewards import get_reward
from memsearcher.teach.oracle import TeacherFlaws, oracle_policy

DEMO = PRESETS["full"]


def test_the_same_seed_gives_the_same_world_byte_for_byte(tmp_path: Path) -> None:
    first = write_world(generate_world(WorldConfig(seed=7)), tmp_path / "a")
    second = write_world(generate_world(WorldConfig(seed=7)), tmp_path / "b")
    other = write_world(generate_world(WorldConfig(seed=8)), tmp_path / "c")
    for name in ("corpus", *SPLITS):
        assert first[name].read_bytes() == second[name].read_bytes(), name
        assert first[name].read_bytes() != other[name].read_bytes(), name


def test_a_renamed_world_is_the_same_for_a_seed_and_moves_every_name_within_its_kind(
    tmp_path: Path,
) -> None:
    world = generate_world(DEMO.world)
    first, again, other = (rename_world(world, k) for k in (3, 3, 4))
    files = [write_world(w, tmp_path / name) for w, name in ((first, "a"), (again, "b"),
                                                           (other, "c"))]  # fmt: skip
    for name in ("corpus", *SPLITS):
        assert files[0][name].read_bytes() == files[1][name].read_bytes(), name
        assert files[0][name].read_bytes() != files[2][name].read_bytes(), name
    for kind, names in world.entities.items():  # a permutation of each kind
        assert sorted(first.entities[kind]) == sorted(names), kind
    assert first.names == world.names
    moved = sum(a != b for a, b in zip(world.entities["person"], first.entities["person"],
                                       strict=True))  # fmt: skip
    assert moved > 0.9 * len(world.entities["person"])
    pairs = first.entities["person"]  # near-namesakes stay pairs: same first name
    assert all(pairs[i].split()[0] == pairs[i + 1].split()[0] for i in range(0, len(pairs), 2))
    # same shapes: question k asks the same relations, with its names swapped
    for q, r in zip(world.questions, first.questions, strict=True):
        assert [h.relation for h in q.hops] == [h.relation for h in r.hops]
        assert q.split == r.split and r.hops[-1].target == r.answer
    facts = {h.fact for q in world.questions for h in q.hops}
    renamed = {h.fact for q in first.questions for h in q.hops}
    assert len(facts & renamed) < 0.05 * len(facts)  # almost no name keeps its facts


def test_the_oracle_answers_every_renamed_question_with_its_own_index(tmp_path: Path) -> None:
    renamed = rename_world(generate_world(DEMO.world), 0)
    paths = write_world(renamed, tmp_path / "world")
    index = build_bm25(paths["corpus"], tmp_path / "index")
    tokenizer = HFTokenizer(build_tokenizer(tokenizer_texts(renamed), 512, renamed.names))
    examples = read_examples(paths["train"])
    episodes = start_episodes("memsearcher", examples, tokenizer, DEMO.agent,
                              Templates(**DEMO_TEMPLATES))  # fmt: skip
    oracle = ScriptedLLM(tokenizer, oracle_policy(examples))
    trajectories = run_lockstep(episodes, oracle, index, SamplingParams())
    assert all(exact_match(t.answer or "", t.example.golden_answers) == 1 for t in trajectories)


def test_questions_do_not_leak_answers_and_splits_do_not_share_start_entities() -> None:
    world = generate_world(DEMO.world)
    starts: dict[str, set[str]] = {split: set() for split in SPLITS}
    for q in world.questions:
        assert q.answer not in q.question
        assert 1 <= len(q.hops) <= 3
        assert q.hops[-1].target == q.answer
        starts[q.split].add(q.hops[0].entity)
    for held_out in ("rl", "dev", "test"):
        assert starts["train"].isdisjoint(starts[held_out])
    assert {len(q.hops) for q in world.split("test")} == {1, 2, 3}


def test_the_world_has_near_namesakes_and_shared_title_words() -> None:
    world = generate_world(DEMO.world)
    people = [title for title, text in world.passages if " was born in " in text]
    first_names: dict[str, list[str]] = {}
    for name in people:
        first_names.setdefault(name.split()[0], []).append(name.split()[1])
    near = 0
    for lasts in first_names.values():
        for a in lasts:
            near += any(
                len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1
                for b in lasts
            )
    assert near == len(people)  # everyone has a namesake one letter away
    titles = [title for title, text in world.passages if " was written by " in text]
    words = [w for t in titles for w in t.split() if w != "The"]
    assert len(set(words)) < len(words) / 3  # titles share their words


def test_every_fact_is_one_sentence_of_the_subjects_passage() -> None:
    world = generate_world(DEMO.world)
    passages = dict(world.passages)
    for q in world.questions:
        for hop in q.hops:
            assert hop.fact in passages[hop.entity]
            assert hop.fact == RELATIONS[hop.relation].format(subject=hop.entity,
                                                               object=hop.target)  # fmt: skip


def test_the_word_before_a_name_tells_which_relation_it_is_the_object_of() -> None:
    # a fact's object is copied by matching the word before it: that word must belong to one
    # relation, and stand before no other name anywhere in the world's text
    world = generate_world(DEMO.world)
    relation_of = {t.split("{object}")[0].split()[-1]: r for r, t in RELATIONS.items()}
    assert len(relation_of) == len(RELATIONS)  # one word per relation
    names = "|".join(re.escape(n) for n in sorted(world.names, key=len, reverse=True))
    facts = {RELATIONS[h.relation].format(subject=h.entity, object=h.target): h.relation
             for q in world.questions for h in q.hops}  # fmt: skip
    seen = 0
    for _, text in world.passages:
        for sentence in re.findall(r"[^.]+\.", text):
            for match in re.finditer(rf"(\w+) (?:{names})\b", sentence):
                if match.group(1) in relation_of:
                    seen += 1
                    assert facts.get(sentence.strip()) == relation_of[match.group(1)], sentence
    assert seen > len(world.passages) / 2


@pytest.fixture(scope="module")
def world_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("world")
    world = generate_world(DEMO.world)
    paths = write_world(world, folder / "world")
    texts = tokenizer_texts(world)
    return {
        "paths": paths,
        "index": build_bm25(paths["corpus"], folder / "index"),
        "tokenizer": HFTokenizer(build_tokenizer(texts, DEMO.model.vocab, world.names)),
        "world": world,
    }


def test_every_name_is_one_token_wherever_it_stands(world_files: dict[str, Any]) -> None:
    """After a space, a quote or at the start: the same single token, so a copy is one token."""
    tokenizer = world_files["tokenizer"]
    for name in world_files["world"].names:
        (token,) = tokenizer.encode(name)
        for context in (f"in {name}.", f'{{"query": "{name}"}}', f"<memory> {name} was"):
            assert token in tokenizer.encode(context), (name, context)
            assert tokenizer.decode(tokenizer.encode(context)) == context


def test_the_demo_model_takes_a_head_width_apart_from_its_width(tmp_path: Path) -> None:
    """``ModelSize.head_dim`` reaches the saved config, and the folder loads as any checkpoint."""
    from transformers import AutoModelForCausalLM

    texts = ["Where was Dramne born?"] * 4
    size = replace(DEMO.model, vocab=300, layers=1)
    for head_dim, q_width in ((None, size.hidden), (64, size.heads * 64)):
        wide = replace(size, head_dim=head_dim)
        model = AutoModelForCausalLM.from_pretrained(
            save_demo_model(tmp_path / str(head_dim), texts, wide, 0)
        )
        assert model.model.layers[0].self_attn.q_proj.out_features == q_width
        assert model.model.layers[0].self_attn.o_proj.in_features == q_width
        assert model.config.head_dim == q_width // size.heads


def test_fact_lookups_ask_for_a_fact_among_sentences_about_its_neighbours(
    world_files: dict[str, Any],
) -> None:
    """Each lookup shows the passages the agent would read for a hop's entity and the start of
    the hop's fact; the reply is the fact, read from those passages. In most of them another
    name of the object's kind stands in the passages too, so copying the nearest name of the
    right kind is not enough."""
    world = world_files["world"]
    lookups = fact_lookups(world, world_files["index"], DEMO.agent.top_n)
    facts = {hop.fact: hop for q in world.split("train") for hop in q.hops}
    assert len(lookups) > 200
    kind_of = {name: kind for kind, names in world.entities.items() for name in names}
    with_distractor = 0
    for message, reply in lookups:
        hop = facts[reply]
        passages, start = message.removeprefix("Fact in:\n").rsplit("\n", 1)
        assert passages.startswith("Doc 1 (Title: ") and reply in passages
        assert reply == f"{start} {hop.target}." and hop.target not in start
        kind = kind_of[hop.target]
        others = {n for n in world.entities[kind] if n != hop.target and n in passages}
        with_distractor += bool(others)
    assert with_distractor / len(lookups) > 0.5


def test_copy_sequences_draw_each_kind_with_equal_chance(world_files: dict[str, Any]) -> None:
    """Name lists and each lookup kind, a third each within three binomial sd; every reply is
    the one its message asks for, and only the reply is trained."""
    tokenizer = world_files["tokenizer"].hf
    lookups = [[("Name in: A question?", "Reply one")], [("Fact in: passages", "Reply two")]]
    rows = copy_sequences(tokenizer, world_files["world"].names, 1500, seed=5, lookups=lookups)
    kinds = {"Reply one": 0, "Reply two": 0, "Repeat": 0}
    for ids, mask in rows:
        start = mask.index(1)
        assert set(mask[start:]) == {1} and set(mask[:start]) == {0}
        prompt, reply = tokenizer.decode(ids[:start]), tokenizer.decode(ids[start:])
        if "Repeat: " in prompt:
            kinds["Repeat"] += 1
            assert prompt.split("Repeat: ")[1].startswith(reply.removesuffix("<|im_end|>\n"))
        else:
            kinds[reply.removesuffix("<|im_end|>\n")] += 1
    for count in kinds.values():
        assert abs(count / len(rows) - 1 / 3) < 3 * (2 / 9 / len(rows)) ** 0.5, kinds


def _teacher_runs(
    world_files: dict[str, Any], flaws: TeacherFlaws, agent: str = "memsearcher"
) -> list[Any]:
    examples = read_examples(world_files["paths"]["train"])
    tokenizer = world_files["tokenizer"]
    episodes = start_episodes(agent, examples, tokenizer, DEMO.agent, Templates(**DEMO_TEMPLATES))
    teacher = ScriptedLLM(tokenizer, oracle_policy(examples, flaws))
    return run_lockstep(episodes, teacher, world_files["index"], SamplingParams())


@pytest.mark.parametrize("rate", [0.2, 0.5])
def test_the_imperfect_teacher_answers_early_at_its_stated_rate(
    world_files: dict[str, Any], rate: float
) -> None:
    """Every turn where the chain is read in part is a draw: answer now (wrong) or search on.
    The share answered must match the rate within three binomial standard deviations."""
    draws = early = 0
    for t in _teacher_runs(world_files, TeacherFlaws(early_answer=rate, seed=3)):
        hops = [h["entity"] for h in t.example.metadata["hops"]]
        searched = [turn.query for turn in t.turns if turn.query]
        assert searched == hops[: len(searched)]  # every search it makes is the right one
        partial_turns = len(searched) - 1 if len(searched) == len(hops) else len(searched)
        draws += partial_turns
        answered_early = len(searched) < len(hops)
        early += answered_early
        if answered_early:
            assert t.answer == t.example.metadata["hops"][len(searched) - 1]["target"]
    assert draws > 300
    assert abs(early / draws - rate) < 3 * (rate * (1 - rate) / draws) ** 0.5


def test_the_teacher_is_the_same_for_a_seed_and_behaviour_reads_it(
    world_files: dict[str, Any],
) -> None:
    flawed = TeacherFlaws(early_answer=0.5, seed=1)
    first = [t.to_dict() for t in _teacher_runs(world_files, flawed)]
    assert first == [t.to_dict() for t in _teacher_runs(world_files, flawed)]
    other = [t.to_dict() for t in _teacher_runs(world_files, replace(flawed, seed=2))]
    assert first != other

    def measured(trajectories: list[Any]) -> dict[str, float]:
        return behaviour([{"prediction": t["answer"], "trajectory": t} for t in trajectories])

    ideal = measured([t.to_dict() for t in _teacher_runs(world_files, TeacherFlaws())])
    assert ideal == {"early_answers": 0.0, "first_query_copied": 1.0, "searches_per_hop": 1.0,
                     "memory_complete": 1.0}  # fmt: skip
    flawed_behaviour = measured(first)
    assert 0.1 < flawed_behaviour["early_answers"] < 0.5  # 1-hop questions cannot be early
    assert flawed_behaviour["searches_per_hop"] < 1.0
    assert flawed_behaviour["memory_complete"] == 1.0


@pytest.mark.parametrize("agent", ["memsearcher", "react"])
def test_the_oracle_answers_every_question_with_the_real_retriever(
    world_files: dict[str, Any], agent: str
) -> None:
    """At the demo's top-n, every hop of every question is retrievable and readable."""
    examples = [e for split in SPLITS for e in read_examples(world_files["paths"][split])]
    tokenizer = world_files["tokenizer"]
    episodes = start_episodes(agent, examples, tokenizer, DEMO.agent, Templates(**DEMO_TEMPLATES))
    oracle = ScriptedLLM(tokenizer, oracle_policy(examples))
    trajectories = run_lockstep(episodes, oracle, world_files["index"], SamplingParams())
    reward = get_reward("graded")
    misses = [t.example.question for t in trajectories
              if exact_match(t.answer or "", t.example.golden_answers) < 1]  # fmt: skip
    assert misses == []
    for t in trajectories:
        chain = t.example.metadata["hops"]
        hops = len(chain)
        assert t.well_formed and reward(t) == 1.0
        assert [turn.query for turn in t.turns[:-1]] == [
            h["entity"] for h in t.example.metadata["hops"]
        ]
        assert len(t.turns) == hops + 1
        assert len(t.sequences) == (hops + 1 if agent == "memsearcher" else 1)
        for turn in t.turns:
            action = parse_action(turn.action_text or "")
            assert not isinstance(action, ParseFailure), turn.action_text
            if turn.query is not None and agent == "memsearcher":
                memory = parse_memory(turn.memory_text or "")
                assert not isinstance(memory, ParseFailure) and memory == turn.memory
        if agent == "memsearcher":  # the final memory holds exactly the chain's facts
            facts = [RELATIONS[h["relation"]].format(subject=h["entity"], object=h["target"])
                     for h in chain]  # fmt: skip
            assert t.turns[-1].memory == " ".join(facts)


def test_the_oracle_never_reads_the_answer(world_files: dict[str, Any]) -> None:
    """With passages that lack the last hop's fact, the oracle cannot answer."""
    examples = read_examples(world_files["paths"]["test"])[:20]
    reply = oracle_policy(examples)
    for example in examples:
        hops = example.metadata["hops"]
        first = hops[0]["entity"]
        prompt = f"<question> {example.question} </question>\n\n<memory>  </memory>"
        action = reply(prompt, SamplingParams(stop=("</tool_call>",)))
        assert re.search(rf'"query": "{re.escape(first)}"', action)
        assert example.golden_answers[0] not in action


@pytest.mark.slow
def test_demo_quick_runs_every_stage_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "memsearcher.cli", "demo", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["evaluations"]) == {
        f"{m}/{a}" for m in ("untrained", "sft", "sft+grpo") for a in ("memsearcher", "react")
    }
    teacher = results["teacher"]
    assert teacher["flaws"] == {**asdict(PRESETS["quick"].flaws), "seed": 0}
    for agent in ("memsearcher", "react"):  # the flaw costs the teacher its early answers
        assert teacher[agent]["early_answers"] > 0 and teacher[agent]["em"] < 1.0
    assert set(results["copy_probe"]) == {"warm-up", "sft", "name_tokens"}
    assert teacher["worlds"] == PRESETS["quick"].sft_worlds
    assert sorted(p.name for p in (out / "oracle").glob("world-*")) == ["world-0", "world-1"]
    assert results["evaluations"]["sft/memsearcher"]["behaviour"].keys() == BEHAVIOURS.keys()
    assert set(results["grpo_questions"]) == {
        f"{m}/{a}" for m in ("sft", "sft+grpo") for a in ("memsearcher", "react")
    }
    # GRPO's questions are a renamed copy's rl split, asked of the copy's own index
    world = generate_world(replace(PRESETS["quick"].world, seed=0))
    copy = rename_world(world, PRESETS["quick"].grpo_world).split("rl")
    copy_rl = read_examples(out / "grpo-world" / "world" / "rl.jsonl")
    assert [e.question for e in copy_rl] == [q.question for q in copy]
    moved = [a.question != b.question for a, b in zip(copy, world.split("rl"), strict=True)]
    assert sum(moved) > len(moved) / 2
    asked = out / "eval" / "sft+grpo-memsearcher" / "rl" / "predictions.jsonl"
    asked_questions = {json.loads(line)["question"] for line in asked.open()}
    assert asked_questions <= {e.question for e in copy_rl}
    assert (out / "grpo-world" / "index").is_dir()
    summary = json.loads((out / "eval" / "sft+grpo-memsearcher" / "summary.json").read_text())
    assert set(summary["datasets"]) == {"test", "rl"}  # both evaluations kept, neither lost
    assert (
        summary["datasets"]["rl"]["em"] == results["grpo_questions"]["sft+grpo/memsearcher"]["em"]
    )
    report = (out / "report.md").read_text()
    assert "EM on GRPO's questions" in report
    for key, evaluation in results["evaluations"].items():  # EM by chain adds up to EM
        chains = evaluation["em_by_chain"].values()
        assert sum(c["questions"] for c in chains) == evaluation["questions"], key
        weighted = sum(c["em"] * c["questions"] for c in chains) / evaluation["questions"]
        assert weighted == pytest.approx(evaluation["em"]), key
    for chain, counts in results["evaluations"]["sft/react"]["em_by_chain"].items():
        assert f"| {chain.replace('>', ' > ')} | {counts['questions']} |" in report
    for name in ("report.md", "reward_per_step.png", "em_by_method.png",
                 "prompt_tokens_per_turn.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    # report.html: every run of the demo side by side, every question each one answered
    page = (out / "report.html").read_text()
    data = json.loads(page.split('type="application/json">')[1].split("</script>")[0])
    assert [r["label"] for r in data["runs"]] == [
        f"{m}-{a}" for m in ("untrained", "sft", "sft+grpo") for a in ("memsearcher", "react")
    ]
    tested = out / "eval" / "sft-react" / "test" / "predictions.jsonl"
    assert {q["id"] for q in data["questions"] if q["dataset"] == "test"} == {
        json.loads(line)["id"] for line in tested.open()
    }
    assert "| sft+grpo | memsearcher |" in done.stdout
    for agent in ("memsearcher", "react"):
        model = out / f"grpo-{agent}" / f"step-{PRESETS['quick'].grpo_steps}" / "model"
        assert (model / "model.safetensors").is_file() and (model / "tokenizer.json").is_file()
    assert results["config"]["sft_steps"] == PRESETS["quick"].sft_steps
    # OUTPUTS names every entry the demo writes, and nothing it does not
    assert {p.name for p in out.iterdir()} == {*OUTPUTS, MARKER}

    # a second run into the same folder starts clean: nothing resumed or appended
    again = subprocess.run(
        [sys.executable, "-m", "memsearcher.cli", "demo", "--quick", "--out", str(out),
         "--seed", "1", "--overwrite"],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "results.json").read_text())["seed"] == 1
    metrics = (out / "grpo-memsearcher" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == PRESETS["quick"].grpo_steps


def test_grpo_cannot_train_on_a_copy_sft_read() -> None:
    with pytest.raises(MemSearcherError, match="GRPO must train on a copy SFT never read"):
        replace(DEMO, grpo_world=DEMO.sft_worlds - 1)
    assert replace(DEMO, grpo_world=DEMO.sft_worlds).grpo_world == DEMO.sft_worlds


def test_demo_refuses_a_folder_it_did_not_write_and_loses_nothing(tmp_path: Path) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_text("keep me")
    for out, message in ((tmp_path, "was not made by a demo run"), (mine, "is a file")):
        done = subprocess.run(
            [sys.executable, "-m", "memsearcher.cli", "demo", "--quick", "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr
    assert mine.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [mine]
