"""The shop demo (``memsearcher demo --env shop``): its shops for SFT, and the ``--quick`` run
end to end from the command line, with the real teacher, tokenizer, trainers and shop."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from memsearcher.agent.environments.shop_world import ShopConfig, generate_catalogue
from memsearcher.demo.shop import (
    AGENTS,
    SHOP_OUTPUTS,
    SHOP_PRESETS,
    ShopDemoConfig,
    keyword_lookups,
)
from memsearcher.demo.shop_report import format_decoding, reward_gain
from memsearcher.eval.report import paired_bootstrap
from memsearcher.folders import MARKER

QUICK = SHOP_PRESETS["quick"]


def test_the_keyword_warm_up_copies_each_instruction_into_the_teachers_search() -> None:
    from memsearcher.teach.shop import search_keywords

    catalogue = generate_catalogue(ShopConfig(families_per_category=2))
    lookups = keyword_lookups([catalogue])
    assert len(lookups) == len(catalogue.instructions)
    for (message, reply), instruction in zip(lookups, catalogue.instructions, strict=True):
        assert message == f"Search for: {instruction.text}"
        assert reply == search_keywords(instruction.goal)
        assert all(word in instruction.text for word in reply.split())


def _save_rewards(out: Path, method: str, rewards: list[tuple[str, float]]) -> None:
    folder = out / "eval" / f"{method}-mem1" / "test"
    folder.mkdir(parents=True)
    lines = [json.dumps({"id": i, "reward": reward}) for i, reward in rewards]
    (folder / "predictions.jsonl").write_text("\n".join(lines) + "\n")


def test_rls_gain_pairs_each_instruction_with_sfts_reward_on_it(tmp_path: Path) -> None:
    _save_rewards(tmp_path, "sft", [("a", 1.0), ("b", 0.5), ("c", 0.0)])
    _save_rewards(tmp_path, "grpo", [("c", 0.5), ("a", 1.0), ("b", 1.0)])  # another order
    gain = reward_gain(tmp_path, "grpo", "mem1", resamples=2000)
    assert gain["questions"] == 3
    assert abs(gain["gain"] - 1.0 / 3) < 1e-12  # (0 + 0.5 + 0.5) / 3
    assert gain["low"] == 0.0 and gain["high"] == 0.5  # no instruction lost reward


def test_rls_gain_counts_each_instruction_once_and_only_where_sft_has_it(tmp_path: Path) -> None:
    _save_rewards(tmp_path, "sft", [("a", 1.0), ("b", 0.5)])
    # "a" was retried after an error (its last record counts); "d" SFT never evaluated
    _save_rewards(tmp_path, "grpo", [("a", 0.0), ("b", 1.0), ("a", 1.0), ("d", 1.0)])
    gain = reward_gain(tmp_path, "grpo", "mem1", resamples=2000)
    assert gain["questions"] == 2
    assert gain["gain"] == 0.25  # (0 + 0.5) / 2
    nothing_shared = paired_bootstrap([], resamples=10)
    report = format_decoding({}, {"grpo/mem1": gain, "grpo/memsearcher": nothing_shared})
    assert "- grpo/mem1: +0.250" in report
    assert "- grpo/memsearcher: no instruction evaluated for both RL and SFT" in report


def test_shop_demo_quick_runs_every_stage_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "shop"
    done = subprocess.run(
        [sys.executable, "-m", "memsearcher.cli", "demo", "--env", "shop", "--quick",
         "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    methods = {f"{m}/{a}" for m in ("untrained", "sft") for a in AGENTS}
    methods |= {f"{'ppo' if adv == 'gae' else adv}/{a}" for a, adv in QUICK.rl_runs}
    assert set(results["evaluations"]) == methods
    test = json.loads((out / "shop.json").read_text())["instructions"]["test"]
    for key, evaluation in results["evaluations"].items():
        records = [
            json.loads(line)
            for line in (out / "eval" / key.replace("/", "-") / "test" / "predictions.jsonl")
            .read_text()
            .splitlines()
        ]
        assert [r["id"] for r in records] == test[: QUICK.test_instructions], key
        rewards = [r["reward"] or 0.0 for r in records]
        assert evaluation["mean_reward"] == sum(rewards) / len(rewards), key
    rl_runs = methods - {f"{m}/{a}" for m in ("untrained", "sft") for a in AGENTS}
    assert set(results["gains"]) == rl_runs
    for key, gain in results["gains"].items():  # RL's reward minus SFT's, paired by instruction
        agent = key.split("/")[1]
        difference = (results["evaluations"][key]["mean_reward"]
                      - results["evaluations"][f"sft/{agent}"]["mean_reward"])  # fmt: skip
        assert gain["questions"] == len(test[: QUICK.test_instructions])
        assert abs(gain["gain"] - difference) < 1e-9, key
        assert gain["low"] <= gain["gain"] <= gain["high"]
    sampled = results["sampled"]  # every model again, sampled at the rollouts' temperature
    assert set(sampled["evaluations"]) == methods and set(sampled["gains"]) == rl_runs
    actions = {  # what the untrained model wrote, greedy and sampled
        folder: [
            [turn["action_text"] for turn in json.loads(line)["trajectory"]["turns"]]
            for line in (out / folder / "untrained-react" / "test" / "predictions.jsonl")
            .read_text()
            .splitlines()
        ]
        for folder in ("eval", "eval-sampled")
    }
    assert actions["eval"] != actions["eval-sampled"]
    teacher = results["teacher"]
    assert teacher["flaws"] == asdict(QUICK.flaws)
    for agent in AGENTS:  # the flaws cost the teacher reward, and it still buys
        assert 0.3 < teacher[agent]["mean_reward"] < 1.0
    assert set(results["rl_rewards"]) == rl_runs
    for run in (out / "rl").iterdir():  # RL's shop ends a repeated invalid action; eval's not
        assert json.loads((run / "config.json").read_text())["shop_repeat_ends"] is True
    probe = results["copy_probe"]
    assert probe["id_tokens"] > 0 and all(0 <= probe[k] <= 1 for k in ("init", "warm-up", "sft"))
    report = (out / "report.md").read_text()
    assert f"after SFT {probe['sft']:.3f}" in report
    assert "RL minus SFT, mean reward" in report and "## Sampled at temperature" in report
    assert "every instruction of one more shop of another seed" in report  # rl_shop: fresh
    assert "| sft | memsearcher |" in report and "| ppo | mem1 |" in report
    assert "| ppo | mem1 |" in done.stdout
    assert {p.name for p in out.iterdir()} == {*SHOP_OUTPUTS, MARKER}


def test_rl_on_a_fresh_shop_trains_on_no_instruction_sft_or_evaluation_uses(
    tmp_path: Path,
) -> None:
    """``rl_shop: fresh``: RL's instructions (all splits) come from the shop after SFT's, under
    the tested shop's ids: a shop neither SFT nor evaluation uses, and every target is an id the
    model's vocabulary holds. ``tested`` keeps the tested shop's rl split."""
    import yaml

    from memsearcher.demo.shop import DEMO_SHOP_TEMPLATES, _rl_config, other_shop
    from memsearcher.rl.tasks import open_task

    templates = tmp_path / "templates.yaml"
    templates.write_text(yaml.safe_dump(DEMO_SHOP_TEMPLATES))
    assert ShopDemoConfig().rl_shop == "fresh"  # the default
    config = QUICK
    seed = 3
    rl = _rl_config(config, "memsearcher", "grpo", templates, tmp_path, tmp_path, seed)
    assert (rl.shop_split, rl.shop_ids_from) == ("train+rl+test", seed)
    used = {seed, *(other_shop(seed, k) for k in range(config.sft_shops))}  # tested, SFT's
    assert rl.shop.seed == other_shop(seed, config.sft_shops) and rl.shop.seed not in used
    trained = open_task(rl).questions
    fresh = generate_catalogue(rl.shop)
    every = [i.text for split in ("train", "rl", "test") for i in fresh.split(split)]
    assert [q.question for q in trained] == every and len(every) == len(fresh.instructions)
    tested = generate_catalogue(replace(config.shop, seed=seed))
    assert {q.golden_answers[0] for q in trained} <= {p.asin for p in tested.products}
    on_tested = replace(QUICK, rl_shop="tested")
    plain = _rl_config(on_tested, "memsearcher", "grpo", templates, tmp_path, tmp_path, seed)
    assert (plain.shop.seed, plain.shop_split, plain.shop_ids_from) == (seed, "rl", None)
    with pytest.raises(ValueError, match="rl_shop must be one of"):
        replace(QUICK, rl_shop="other")
