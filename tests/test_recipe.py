"""The embedded agent's recipe end to end at a tiny size: a tiny Llama (with SmolLM2's
tokenizer) in place of SmolLM2-135M, two SFT steps, one GRPO step per agent, a few questions;
the real teacher, BM25 index, trainers, merges, evaluation and report. Then a rerun, which finds
every stage done and changes nothing, and the refusals of a folder the recipe did not make."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_model import save_tiny_model

from memsearcher.cli import main
from memsearcher.data.flashrag import read_examples
from memsearcher.errors import MemSearcherError
from memsearcher.recipe.config import RecipeConfig
from memsearcher.recipe.embedded_agent import claim_out
from memsearcher.teach.config import ProtocolDataConfig

ROOT = Path(__file__).parents[1]
BUILD = ProtocolDataConfig(
    heldout=str(ROOT / "benchmarks" / "data" / "embedded-wiki-questions.jsonl")
)


def tiny_overrides(tmp_path: Path) -> list[str]:
    tiny = save_tiny_model(tmp_path / "tiny")
    lora = ["lora_rank=4", "lora_alpha=8", "lora_targets=[q_proj, v_proj]"]
    return [
        f"out={tmp_path / 'run'}", "agents=[memsearcher, react]",
        "rl_one_hop=2", "test_one_hop=2", "evaluation_limit=3", "bootstrap=200",
        "rl_worlds=1", "rl_world_questions=2",
        "select_every=1", "select_worlds=1", "select_world_questions=2", "grpo.save_every=1",
        "evaluation={max_turns: 2, memory_tokens: 16, max_new_tokens: 16, top_n: 2}",
        "build.worlds=1", "build.questions_per_world=2", "build.wiki_questions=12",
        f"sft.model.path={tiny}", "sft.steps=2", "sft.sequences_per_step=2", "sft.save_every=1",
        "turn1_steps=1", "turn1_lr=5e-4",
        "sft.optim.lr=1e-3", *[f"sft.model.{o}" for o in lora],
        "grpo.steps=1", "grpo.questions_per_step=1", "grpo.mini_batch_questions=1",
        "grpo.group_size=2", "grpo.agent={max_turns: 2, memory_tokens: 16, max_new_tokens: 16, "
        "top_n: 2}", *[f"grpo.model.{o}" for o in lora],
    ]  # fmt: skip


@pytest.mark.slow
def test_the_recipe_runs_end_to_end_at_a_tiny_size_and_resumes(tmp_path: Path) -> None:
    args = ["recipe", "embedded-agent", "--config", str(ROOT / "configs" / "embedded-agent.yaml")]
    overrides = tiny_overrides(tmp_path)
    assert main([*args, *overrides]) == 0
    run = tmp_path / "run"
    results = json.loads((run / "results.json").read_text())
    assert set(results["evaluations"]) == {
        f"{m}/{a}" for m in ("sft", "grpo") for a in ("memsearcher", "react")
    }
    for summary in results["evaluations"].values():
        assert set(summary["datasets"]) == {"heldout", "test"}
    assert set(results["analysis"]["gains"]) == {"memsearcher", "react"}
    assert set(results["analysis"]["agents"]) == {"sft", "grpo"}  # MemSearcher minus ReAct
    rl = read_examples(run / "data" / "questions" / "rl.jsonl")
    test = read_examples(run / "data" / "questions" / "test.jsonl")
    assert {e.metadata["hops"] for e in test} == {1, 2} and rl
    assert not {e.id for e in rl} & {e.id for e in test}
    # GRPO trains on the rl split and a world's multi-hop questions, over both corpora
    grpo = read_examples(run / "data" / "questions" / "grpo.jsonl")
    assert grpo[: len(rl)] == rl and {e.id.split("-")[0] for e in grpo[len(rl) :]} == {"world1"}
    # the second SFT pass trains on turn 1 of the Wikipedia trajectories, from the SFT model;
    # GRPO starts from its model
    turn1 = json.loads((run / "sft-turn1" / "config.json").read_text())
    assert turn1["model"]["path"] == str(run / "models" / "sft") and turn1["steps"] == 1
    assert turn1["data"] == str(run / "data" / "turn1.jsonl") and turn1["optim"]["lr"] == 5e-4
    assert_turn1_data(run / "data" / "protocol.jsonl", run / "data" / "turn1.jsonl")
    for agent in ("memsearcher", "react"):
        trained = json.loads((run / f"grpo-{agent}" / "config.json").read_text())
        assert trained["data"].endswith("grpo.jsonl")
        assert trained["retriever"] == str(run / "data" / "rl-index")
        assert trained["model"]["path"] == str(run / "models" / "sft-turn1")
    for name in ("sft", "sft-turn1", "grpo-memsearcher", "grpo-react"):
        adapter = run / "adapters" / name
        assert (adapter / "adapter_model.safetensors").is_file(), name
        assert (adapter / "README.md").read_text().startswith("# SmolLM2-135M-Instruct")
        assert (run / "models" / name / "config.json").is_file(), name
    # the checkpoint kept is scored on questions of a world that neither SFT nor GRPO saw
    select = read_examples(run / "data" / "questions" / "select.jsonl")
    assert select and {e.id.split("-")[0] for e in select} == {"world2"}
    report = (run / "report.md").read_text()
    assert "GRPO minus SFT" in report and "| grpo | memsearcher | test |" in report
    assert "## The checkpoint kept (react)" in report
    assert "MemSearcher minus ReAct" in report and "| grpo | pooled |" in report
    assert (run / "reward_per_step.png").stat().st_size > 0

    # a rerun of the same config finds every stage done: nothing is trained again
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*.safetensors")}
    assert main([*args, *overrides]) == 0
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*.safetensors")} == before

    # more GRPO steps: GRPO trains on from its step-1 checkpoints, and what one step made is
    # moved aside, then made again from step 2 and evaluated
    assert main([*args, *overrides, "grpo.steps=2"]) == 0
    aside = run / "superseded" / "grpo-1-steps"
    for agent in ("memsearcher", "react"):
        assert (run / f"grpo-{agent}" / "step-2").is_dir()
        for kind in ("models", "adapters", "eval"):
            assert (aside / kind / f"grpo-{agent}").is_dir(), (kind, agent)
            assert (run / kind / f"grpo-{agent}").is_dir(), (kind, agent)
    assert (run / "eval" / "grpo-react" / "summary.json").is_file()
    # each checkpoint is scored on the selection questions, and the best one (the earliest
    # on a tie) is the one merged, exported and evaluated
    for agent in ("memsearcher", "react"):
        selection = json.loads((run / f"grpo-{agent}" / "selection.json").read_text())
        assert selection["questions"] == len(select) and set(selection["em"]) == {"1", "2"}
        best = max(selection["em"].values())
        assert selection["chosen"] == min(int(s) for s, em in selection["em"].items() if em == best)
        kept = run / f"grpo-{agent}" / f"step-{selection['chosen']}" / "model"
        merged = json.loads(
            (run / "models" / f"grpo-{agent}" / "memsearcher_adapter.json").read_text()
        )
        assert [m["adapter"] for m in merged] == [str(kept)]
        exported = load_file(run / "adapters" / f"grpo-{agent}" / "adapter_model.safetensors")
        trained = load_file(kept / "adapter_model.safetensors")
        assert all(torch.equal(exported[k], trained[k].half()) for k in trained)
        assert not (run / "select" / f"{agent}-step2-model").exists()  # merged, then removed

    # the same folder with another config is refused, naming what changed
    assert main([*args, *overrides, "grpo.steps=2", "sft.steps=3"]) == 2


def assert_turn1_data(protocol: Path, turn1: Path) -> None:
    """``turn1`` holds, for every Wikipedia trajectory of ``protocol`` in order, the trajectory
    with turn 1's sequence alone: MemSearcher's turn after its first search (not its first
    turn), ReAct's one sequence."""
    wiki = [
        row for row in map(json.loads, protocol.open()) if row["example"]["id"].startswith("wiki-")
    ]
    rows = [json.loads(line) for line in turn1.open()]
    assert [row["example"] for row in rows] == [row["example"] for row in wiki] and rows
    agents = set()
    for row, whole in zip(rows, wiki, strict=True):
        agents.add(whole["agent"])
        turn = next(t for t in whole["turns"] if t["index"] == 1)
        assert row["sequences"] == [whole["sequences"][turn["sequence_index"]]]
        if whole["agent"] == "memsearcher":
            assert row["sequences"][0] != whole["sequences"][0]
    assert agents == {"memsearcher", "react"}


@pytest.mark.parametrize("turn1_steps", [0, 1])
def test_ship_copies_the_adapters_grpo_stacks_on(tmp_path: Path, turn1_steps: int) -> None:
    """The package gets the SFT adapter, the turn-1 one when the recipe made a second pass, and
    MemSearcher's GRPO adapter, each with its card."""
    from memsearcher.llm.embedded import GRPO_ADAPTER, SFT_ADAPTER, TURN1_ADAPTER
    from memsearcher.recipe.adapters import ship

    config = RecipeConfig(out=str(tmp_path / "run"), build=BUILD, sft=_lora(),
                          grpo=_lora_grpo(), turn1_steps=turn1_steps)  # fmt: skip
    files = ("adapter_config.json", "adapter_model.safetensors", "README.md")
    for name in ("sft", "sft-turn1", "grpo-memsearcher"):
        (tmp_path / "run" / "adapters" / name).mkdir(parents=True)
        for file in files:
            (tmp_path / "run" / "adapters" / name / file).write_text(f"{name}/{file}")
    package = tmp_path / "package"
    flaws = {"stated": {"category_query": 0.25, "early_answer": 0.1},
             "measured": {"category_query": 0.263, "trajectories": 570, "early_answer": 0.107,
                          "two_hop_trajectories": 220}}  # fmt: skip
    data = {"trajectories": 1050, "synthetic_trajectories": 480, "wiki_trajectories": 570}
    gain = {"gain": 0.137, "low": 0.072, "high": 0.201, "questions": 139}
    gap = {"gain": -0.273, "low": -0.455, "high": -0.091, "questions": 33}
    results = {"data": {**data, "flaws": flaws},
               "analysis": {"runs": {}, "gains": {"memsearcher": {"pooled": gain}},
                            "agents": {"grpo": {"test, 2-hop": gap}}}}  # fmt: skip
    ship(config, package, results)
    shipped = {SFT_ADAPTER.name: "sft", GRPO_ADAPTER.name: "grpo-memsearcher"}
    if turn1_steps:
        shipped[TURN1_ADAPTER.name] = "sft-turn1"
    assert {p.name for p in package.iterdir()} == set(shipped)
    for folder, name in shipped.items():
        for file in files:
            text = (package / folder / file).read_text()
            if folder == GRPO_ADAPTER.name and file == "README.md":
                # the GRPO card carries the run's results: flaw rates, the gain's interval
                card, results_part = text.split("\n", 1)
                assert card == f"{name}/{file}" and "## Results" in results_part
                assert "early answer after the first hop of a two-hop question 0.1 / 0.107" in text
                assert "| memsearcher | pooled | 139 | +0.137 | [+0.072, +0.201] |" in text
                assert "| grpo | test, 2-hop | 33 | -0.273 | [-0.455, -0.091] |" in text
            else:
                assert text == f"{name}/{file}"


def test_the_recipe_refuses_a_folder_it_did_not_make(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(MemSearcherError, match="no recipe run made it"):
        _claim(out, RecipeConfig(out=str(out), build=BUILD, sft=_lora(), grpo=_lora_grpo()))
    assert (out / "notes.txt").read_text() == "keep me"


def test_the_recipe_needs_steps_and_lets_only_output_keys_change(tmp_path: Path) -> None:
    from memsearcher.rl.config import GRPOConfig, ModelConfig, SFTConfig

    # steps=0 means "one epoch" to a trainer, which the recipe could never resume by step
    with pytest.raises(ValueError, match="steps must be > 0"):
        RecipeConfig(build=BUILD, sft=SFTConfig(model=ModelConfig(lora_rank=4)), grpo=_lora_grpo())
    with pytest.raises(ValueError, match="steps must be > 0"):
        grpo = GRPOConfig(model=ModelConfig(lora_rank=4), questions_per_step=4,
                          mini_batch_questions=4, steps=0)  # fmt: skip
        RecipeConfig(build=BUILD, sft=_lora(), grpo=grpo)
    with pytest.raises(ValueError, match="turn1_steps must be >= 0"):
        RecipeConfig(build=BUILD, sft=_lora(), grpo=_lora_grpo(), turn1_steps=-1)
    with pytest.raises(ValueError, match="turn1_lr must be > 0"):
        RecipeConfig(build=BUILD, sft=_lora(), grpo=_lora_grpo(), turn1_lr=0.0)
    # the selection scores saved checkpoints: every select_every-th step must have one
    every_two = replace(_lora_grpo(), save_every=2)
    with pytest.raises(
        ValueError, match=r"select_every must be a multiple of grpo.save_every \(2\)"
    ):
        RecipeConfig(build=BUILD, sft=_lora(), grpo=every_two, select_every=3)
    RecipeConfig(build=BUILD, sft=_lora(), grpo=every_two, select_every=4)
    out = tmp_path / "run"
    config = RecipeConfig(out=str(out), build=BUILD, sft=_lora(), grpo=_lora_grpo())
    _claim(out, config)
    _claim(out, replace(config, ship=str(tmp_path / "adapters"), bootstrap=50))  # output only
    with pytest.raises(MemSearcherError, match="rl_one_hop"):
        _claim(out, replace(config, rl_one_hop=3))


def test_a_recipe_folder_made_before_a_config_key_existed_resumes(tmp_path: Path) -> None:
    """A key added to a config since a run began (here the agents' ``answer_on_repeat``) is
    absent from its marker; the run behaved as the key's default, so it resumes."""
    out = tmp_path / "run"
    config = RecipeConfig(out=str(out), build=BUILD, sft=_lora(), grpo=_lora_grpo())
    _claim(out, config)
    marker = json.loads((out / "recipe.json").read_text())
    del marker["evaluation"]["answer_on_repeat"], marker["grpo"]["agent"]["answer_on_repeat"]
    (out / "recipe.json").write_text(json.dumps(marker))
    _claim(out, config)
    with pytest.raises(MemSearcherError, match=r"evaluation\.answer_on_repeat"):
        _claim(out, replace(config, evaluation=replace(config.evaluation, answer_on_repeat=True)))


def test_more_grpo_steps_train_on_and_set_aside_what_the_shorter_run_made(
    tmp_path: Path,
) -> None:
    """A researcher whose reward still rises asks the same run for more GRPO steps: GRPO trains
    on from its checkpoints, and what the shorter run made (merged models, adapters,
    evaluations, the report) must not be found done and reported as the longer run's; it is
    moved aside, never deleted. Fewer steps, or any other change, stay refused."""
    out = tmp_path / "run"
    config = RecipeConfig(out=str(out), build=BUILD, sft=_lora(), grpo=_lora_grpo())
    _claim(out, config)
    made = ["models/grpo-memsearcher", "adapters/grpo-react", "eval/grpo-memsearcher"]
    kept = ["models/sft", "eval/sft-memsearcher", "grpo-memsearcher/step-1"]
    for name in made + kept:
        (out / name).mkdir(parents=True)
        (out / name / "file").write_text(name)
    (out / "report.md").write_text("one step")
    (out / "timings.json").write_text('{"GRPO (react)": 60.0}')

    longer = replace(config, grpo=replace(config.grpo, steps=3))
    _claim(out, longer)
    aside = out / "superseded" / "grpo-1-steps"
    for name in made:
        assert not (out / name).exists(), name
        assert (aside / name / "file").read_text() == name
    for name in kept:
        assert (out / name / "file").read_text() == name
    assert (aside / "report.md").read_text() == "one step" and not (out / "report.md").exists()
    assert (aside / "timings.json").read_text() == (out / "timings.json").read_text()
    assert json.loads((out / "recipe.json").read_text())["grpo"]["steps"] == 3
    _claim(out, longer)  # the longer run resumed: nothing else moves
    with pytest.raises(MemSearcherError, match=r"grpo\.steps"):
        _claim(out, config)  # back to fewer steps
    with pytest.raises(MemSearcherError, match="rl_one_hop"):
        _claim(out, replace(longer, rl_one_hop=3, grpo=replace(config.grpo, steps=5)))


def test_more_grpo_steps_move_nothing_unless_all_can_move(tmp_path: Path) -> None:
    """A shorter run's results already set aside (an earlier try, restored by hand) are never
    overwritten, and nothing moves at all; a decaying schedule cannot train on as a fresh
    run would, so it is refused."""
    out = tmp_path / "run"
    config = RecipeConfig(out=str(out), build=BUILD, sft=_lora(), grpo=_lora_grpo())
    _claim(out, config)
    for name in ("models/grpo-memsearcher", "eval/grpo-react"):
        (out / name).mkdir(parents=True)
    earlier = out / "superseded" / "grpo-1-steps" / "eval" / "grpo-react"
    earlier.mkdir(parents=True)
    longer = replace(config, grpo=replace(config.grpo, steps=2))
    with pytest.raises(MemSearcherError, match="nothing was moved"):
        _claim(out, longer)
    assert (out / "models" / "grpo-memsearcher").is_dir() and (out / "eval" / "grpo-react").is_dir()
    assert json.loads((out / "recipe.json").read_text())["grpo"]["steps"] == 1

    cosine = replace(config.grpo, optim=replace(config.grpo.optim, schedule="cosine"))
    decaying = tmp_path / "cosine"
    _claim(decaying, replace(config, out=str(decaying), grpo=cosine))
    with pytest.raises(MemSearcherError, match="constant schedule"):
        _claim(decaying, replace(config, out=str(decaying), grpo=replace(cosine, steps=2)))


def test_an_interrupted_stage_keeps_its_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recipe's stages resume from checkpoints, so a run stopped mid-stage (Ctrl-C) and
    started again is a normal way to build it: the time spent before the stop must count in
    timings.json, which the report prints, or a resumed stage reports only its last part. (A
    killed process: the next test.)"""
    from types import SimpleNamespace

    from memsearcher.recipe import embedded_agent, run_folder

    # a stand-in clock and data stage: a real Ctrl-C cannot be timed exactly, and the recipe
    # counts only stages of 5 s or more
    clock = iter([10.0, 130.0])
    stand_in = SimpleNamespace(perf_counter=lambda: next(clock), time=lambda: 0.0)
    monkeypatch.setattr(run_folder, "time", stand_in)

    def stopped(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded_agent, "build_data", stopped)
    out = tmp_path / "run"
    config = RecipeConfig(out=str(out), build=BUILD, sft=_lora(), grpo=_lora_grpo())
    with pytest.raises(KeyboardInterrupt):
        embedded_agent.run_recipe(config, echo=lambda line: None)
    assert json.loads((out / "timings.json").read_text()) == {"data": 120.0}
    assert not (out / "stage.running.json").exists()


def test_a_killed_stage_keeps_its_time_up_to_its_last_write(tmp_path: Path) -> None:
    """A process killed inside a stage (SIGKILL: no ``finally`` runs, as when a session or a
    machine ends) leaves the stage's start behind; the next run credits the stage with the time
    up to the last file the killed run wrote (here set 42 s after the start), and only once."""
    import os
    import signal
    import subprocess
    import sys

    from memsearcher.recipe.run_folder import StageClock

    out = tmp_path / "run"
    out.mkdir()
    (out / "timings.json").write_text(json.dumps({"data": 3.0, "SFT": 100.0}))
    script = (
        "import sys, time\nfrom pathlib import Path\n"
        "from memsearcher.recipe.run_folder import StageClock\n"
        "out = Path(sys.argv[1])\n"
        "with StageClock(out).stage('SFT'):\n"
        "    (out / 'step-1').write_text('checkpoint')\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script, str(out)], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    child.send_signal(signal.SIGKILL)
    child.wait()
    started = json.loads((out / "stage.running.json").read_text())["started"]
    os.utime(out / "step-1", (started + 42, started + 42))

    clock = StageClock(out)
    assert clock.seconds == {"data": 3.0, "SFT": 142.0}
    assert json.loads((out / "timings.json").read_text()) == clock.seconds
    assert not (out / "stage.running.json").exists()
    assert StageClock(out).seconds == {"data": 3.0, "SFT": 142.0}  # credited once

    (out / "stage.running.json").write_text('{"stage": "SFT", "sta')  # not the recipe's writing
    with pytest.raises(MemSearcherError, match="stage.running.json is not a stage's start"):
        StageClock(out)
    assert (out / "stage.running.json").exists()  # left for the user to look at


def _lora():  # type: ignore[no-untyped-def]
    from memsearcher.rl.config import ModelConfig, SFTConfig

    return SFTConfig(model=ModelConfig(lora_rank=4), steps=1)


def _lora_grpo():  # type: ignore[no-untyped-def]
    from memsearcher.rl.config import GRPOConfig, ModelConfig

    return GRPOConfig(model=ModelConfig(lora_rank=4), questions_per_step=4, mini_batch_questions=4,
                      steps=1)  # fmt: skip


def _claim(out: Path, config: RecipeConfig) -> None:
    assert Path(config.out) == out
    claim_out(config)
