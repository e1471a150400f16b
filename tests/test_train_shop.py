"""GRPO and PPO on the offline shop (``environment: shop``), end to end on CPU.

The policy is the tiny real Llama of `tiny_model.py`, the shop the real generated one with its
BM25, the loop, learner and checkpoints the real ones. An untrained tiny model never writes a
valid ``<action>``, so its episodes all end on a format error with reward 0: the first test
samples from it and checks exactly that. To see reward, pages and updates, the other tests
have the rollouts' text written by a scripted model instead (``ScriptedLLM``, the only stand-in
here, and only for what a tiny model cannot write): in each group one episode may play the
oracle's plan (reward 1), one buy without choosing options (a partial reward), one babble (a
format error); the learner then trains the tiny model on those tokens as on any rollout.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _servers import shop_server
from safetensors.torch import load_file
from tiny_model import save_tiny_model
from transformers import AutoTokenizer

from memsearcher.agent.environments.shop import SEP, ShopEnv, ShopSearch, solve
from memsearcher.agent.environments.shop_world import Catalogue, ShopConfig, generate_catalogue
from memsearcher.agent.parsing import ParseFailure, parse_shop_action
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.rl import rollout
from memsearcher.rl import train_grpo as train_grpo_module
from memsearcher.rl.checkpoint import latest_checkpoint
from memsearcher.rl.config import GRPOConfig, load_config
from memsearcher.rl.train_grpo import train_grpo
from memsearcher.types import TokenSequence

SHOP = ShopConfig(seed=0, families_per_category=1)  # 30 products, 4 rl instructions


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def catalogue() -> Catalogue:
    return generate_catalogue(SHOP)


def shop_config(tiny: Path, out: Path, *overrides: str) -> GRPOConfig:
    return load_config(
        GRPOConfig,
        None,
        [
            "environment=shop",
            "reward=environment",
            "shop.families_per_category=1",
            f"output_dir={out}",
            f"model.path={tiny}",
            "model.device=cpu",
            "steps=1",
            "questions_per_step=2",
            "mini_batch_questions=2",
            "group_size=3",
            "agent.max_new_tokens=48",
            "agent.memory_tokens=16",
            "agent.max_turns=6",
            "optim.lr=1e-3",
            "micro_batch_tokens=4096",
            "beta=0.01",
            "sample_every=1",
            "tensorboard=false",
            *overrides,
        ],
    )


def read_samples(out: Path, step: int = 1) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "samples" / f"step-{step}.jsonl").open()]


def test_grpo_samples_the_real_policy_in_the_shop_and_saves(tiny: Path, tmp_path: Path) -> None:
    """With the shop's prompts from a file (`ShopTemplates` fields), as a small model needs."""
    out = tmp_path / "out"
    templates = tmp_path / "shop.yaml"
    templates.write_text('memsearcher_system: "Shop: act in <action> </action>."\n')
    train_grpo(shop_config(tiny, out, "agent.max_new_tokens=8", f"templates={templates}"))
    assert latest_checkpoint(out) == out / "step-1"
    samples = read_samples(out)
    assert len(samples) == 2 * 3
    decode = AutoTokenizer.from_pretrained(tiny).decode
    for sample in samples:
        prompt = decode(sample["sequences"][0]["prompt_ids"])
        assert "Shop: act in <action> </action>." in prompt and "web shop" not in prompt
        assert sample["example"]["metadata"]["environment"] == "shop"
        assert sample["example"]["id"].startswith("rl-")  # the default split
        assert sample["reward"] == pytest.approx(sample["environment_reward"] or 0.0)
        assert sample["end_reason"] in ("format_error", "length")  # it never writes an action


def scripted_shop(catalogue: Catalogue, seed: int = 0) -> Any:
    """A reply function for any of the three agents: an episode's first prompt draws its
    role, which its thoughts (and MemSearcher's memory) carry on with the steps done."""
    search = ShopSearch(catalogue.products)
    plans: dict[str, dict[str, list[str]]] = {}
    for instruction in catalogue.instructions:
        plan = solve(ShopEnv(catalogue, search, instruction))
        options = {f"click[{v}]" for v in instruction.goal.options.values()}
        hasty = [a for a in plan if a not in options]
        plans[instruction.text] = {"oracle": plan, "hasty": hasty}
    rng = random.Random(seed)
    instruction_text = re.compile("Instruction:" + re.escape(SEP) + "(.*?)" + re.escape(SEP))

    def reply(prompt: str, params: SamplingParams) -> str:
        known = re.findall(r"<(memory|think)> (oracle|hasty|babble) step (\d+)", prompt)
        if known:  # a memory counts the steps done; a thought, the step it took
            tag, role, step = known[-1]
            done = int(step) + (tag == "think")
        else:
            role, done = rng.choice(["oracle", "hasty", "babble"]), 0
        if "</memory>" in params.stop:
            return f"<memory> {role} step {done} </memory>"
        if role == "babble":
            return "I would like to buy something nice."
        plan = plans[instruction_text.findall(prompt)[0]][role]
        return f"<think> {role} step {done} </think>\n<action> {plan[done]} </action>"

    return reply


@pytest.fixture
def scripted_rollouts(monkeypatch: pytest.MonkeyPatch, catalogue: Catalogue) -> None:
    """The rollouts' text from `scripted_shop`, in the real driver and the real shop."""
    real = rollout.run_lockstep
    reply = scripted_shop(catalogue)

    def run_lockstep(episodes: Any, llm: Any, environment: Any, sampling: Any) -> Any:
        return real(episodes, ScriptedLLM(llm.tokenizer, reply), environment, sampling)

    monkeypatch.setattr(rollout, "run_lockstep", run_lockstep)


def replayed_reward(catalogue: Catalogue, sample: dict[str, Any]) -> float:
    """What the shop gives for the sample's actions, replayed in a fresh `ShopEnv`."""
    (instruction,) = [i for i in catalogue.instructions if i.id == sample["example"]["id"]]
    env = ShopEnv(catalogue, ShopSearch(catalogue.products), instruction)
    env.reset()
    reward = 0.0
    for turn in sample["turns"]:
        step = parse_shop_action(turn["action_text"])
        if not isinstance(step, ParseFailure):
            _, reward, _, _ = env.step(step.action)
    return reward


def test_grpo_trains_on_the_shops_reward_with_pages_at_mask_0(
    tiny: Path,
    tmp_path: Path,
    catalogue: Catalogue,
    scripted_rollouts: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    learned: list[list[TokenSequence]] = []
    real_sequences = train_grpo_module.learner_sequences

    def learner_sequences(*args: Any) -> Any:
        result = real_sequences(*args)
        learned.append(result[0])
        return result

    monkeypatch.setattr(train_grpo_module, "learner_sequences", learner_sequences)
    out = tmp_path / "out"
    train_grpo(shop_config(tiny, out, "steps=2", "save_every=1"))
    assert latest_checkpoint(out) == out / "step-2"

    samples = read_samples(out) + read_samples(out, 2)
    rewards = [s["reward"] for s in samples]
    for sample in samples:
        assert sample["reward"] == pytest.approx(sample["environment_reward"] or 0.0)
        assert sample["reward"] == pytest.approx(replayed_reward(catalogue, sample))
    assert 1.0 in rewards and 0.0 in rewards and any(0 < r < 1 for r in rewards)
    # episodes of one instruction never shared a session: each oracle bought with reward 1
    for sample in samples:
        if sample["turns"] and "oracle" in (sample["turns"][0]["thought"] or ""):
            assert sample["reward"] == 1.0 and sample["end_reason"] == "answer"

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    mean = sum(rewards[:6]) / 6
    assert metrics[0]["reward/mean"] == pytest.approx(mean, abs=1e-6)
    assert any(m["train/grad_norm"] > 0 for m in metrics)
    start = load_file(tiny / "model.safetensors")
    end = load_file(out / "step-2" / "model" / "model.safetensors")
    assert any(not torch.equal(start[k], v) for k, v in end.items() if k in start)

    decode = AutoTokenizer.from_pretrained(tiny).decode
    pages = 0
    for sequences in learned:
        for s in sequences:
            masked = [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if not m]
            written = [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if m]
            assert "Instruction:" not in decode(written)  # a page is never the model's
            pages += decode(masked).count("Instruction:")
    assert pages > 0


@pytest.fixture(scope="module")
def webshop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`SHOP`'s rl instructions served over WebShop's HTTP protocol, as fixed_0, fixed_1..."""
    log = tmp_path_factory.mktemp("log") / "shop.log"
    with shop_server(SHOP.seed, SHOP.families_per_category, "rl", log) as url:
        yield url


def test_grpo_trains_on_a_webshop_servers_reward(
    tiny: Path, tmp_path: Path, catalogue: Catalogue, scripted_rollouts: None, webshop: str
) -> None:
    """``environment: webshop``: the rl instructions from the server, each sample's reward
    the one the local shop gives for its actions; a group's episodes browse one server session
    side by side, and each oracle among them buys with reward 1."""
    out = tmp_path / "out"
    overrides = ["environment=webshop", f"webshop_url={webshop}", "webshop_goals=[0,4]"]
    train_grpo(shop_config(tiny, out, *overrides))
    assert latest_checkpoint(out) == out / "step-1"
    rl = catalogue.split("rl")
    samples = read_samples(out)
    assert len(samples) == 2 * 3
    for sample in samples:
        index = int(sample["example"]["id"].removeprefix("fixed_"))
        assert sample["example"]["question"] == rl[index].text
        local = {**sample, "example": {**sample["example"], "id": rl[index].id}}
        assert sample["reward"] == pytest.approx(replayed_reward(catalogue, local))
        if sample["turns"] and "oracle" in (sample["turns"][0]["thought"] or ""):
            assert sample["reward"] == 1.0 and sample["end_reason"] == "answer"
    assert 1.0 in [s["reward"] for s in samples]


def test_ppo_with_a_critic_trains_on_the_shop_through_the_same_setup(
    tiny: Path, tmp_path: Path, catalogue: Catalogue, scripted_rollouts: None
) -> None:
    out = tmp_path / "out"
    train_grpo(shop_config(tiny, out, "advantage=gae", "critic.lr=1e-3", "agent_name=mem1"))
    assert latest_checkpoint(out) == out / "step-1"
    samples = read_samples(out)
    for sample in samples:
        assert sample["agent"] == "mem1"
        assert sample["reward"] == pytest.approx(sample["environment_reward"] or 0.0)
        assert sample["reward"] == pytest.approx(replayed_reward(catalogue, sample))
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["train/grad_norm"] > 0
