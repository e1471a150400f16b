"""The shop demo (``memsearcher demo --env shop``): a small model from scratch learns to shop.

The same recipe as the QA demo (``demo.pipeline``), in MEM1's second domain: a seeded shop
(``environments.shop_world``), a byte-level BPE with each product id one token and a Llama
from scratch, an imperfect teacher (``teach.shop``) whose trajectories in all three agents'
protocols are SFT's data, then RL (GRPO for each agent, and PPO with a critic for MEM1, its
own recipe), and evaluation of untrained, SFT and RL on the tested shop's held-out ``test``
instructions: mean reward, success rate, steps and peak tokens.

SFT reads other shops, never the one it is tested on: shops of other seeds whose product ids
are the tested shop's, dealt out anew (`deal_ids`). Every id token is trained, and no id can
be remembered as the answer to an instruction, only read off a page. RL shops in one more
such shop (``rl_shop: fresh``), or in the tested shop on its ``rl`` instructions (``tested``);
the evaluation acts in the tested shop, on instructions whose target products neither SFT nor
RL saw.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from memsearcher.agent import AgentConfig, run_lockstep
from memsearcher.agent.environments.shop import (
    ShopEnv,
    ShopEnvironment,
    ShopSearch,
    instruction_example,
    solve,
)
from memsearcher.agent.environments.shop_world import (
    CATEGORIES,
    SPLITS,
    Catalogue,
    ShopConfig,
    deal_ids,
    generate_catalogue,
)
from memsearcher.agent.shop_agents import SHOP_AGENTS, ShopTemplates, start_shop_episodes
from memsearcher.config import require
from memsearcher.demo.copying import name_token_accuracy, warm_up_copying
from memsearcher.demo.model import ModelSize, save_demo_model
from memsearcher.demo.pipeline import Stages, load_model, read_metric, sft_config
from memsearcher.demo.shop_report import RL_SHOPS, format_curve, reward_gain
from memsearcher.eval.run import EvalConfig, run_eval, shop_summary
from memsearcher.llm import load_tokenizer
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.rl.config import CriticConfig, GRPOConfig, ModelConfig, OptimConfig
from memsearcher.rl.train_grpo import train_grpo
from memsearcher.rl.train_sft import train_sft
from memsearcher.teach.shop import ShopFlaws, search_keywords, shop_policy

__all__ = [
    "DEMO_SHOP_TEMPLATES",
    "SHOP_OUTPUTS",
    "SHOP_PRESETS",
    "ShopDemoConfig",
    "evaluate_shop_models",
    "run_shop_demo",
]

AGENTS = tuple(SHOP_AGENTS)
"""memsearcher, react, mem1."""

METHODS = {"grpo": "grpo", "gae": "ppo"}
"""The name of an RL run's method by its advantage: GRPO, or PPO with a critic (GAE)."""

DEMO_SHOP_TEMPLATES = {
    "memsearcher_system": (
        "Shop for the instruction. Think in <think> </think>, then act in <action> </action>: "
        "search[...] or click[...]. After each page, rewrite your memory in <memory> </memory>."
    ),
    "memsearcher_page": "<page> {page} </page>\nUpdate memory.",
    "react_system": (
        "Shop for the instruction. Think in <think> </think>, then act in <action> </action>: "
        "search[...] or click[...]."
    ),
    "mem1_user": (
        "Shop for the instruction. Keep your notes in <think> </think>, then act in <action> "
        "</action>: search[...] or click[...]. Start page: {page}"
    ),
    "mem1_information": "\n<information>{hint} {page}</information>\n",
    "mem1_hint": "{turns_left} turns left.",
    "mem1_last_hint": "Last turn: buy.",
}
"""Short shop prompts for the small model (the protocol's tags, fewer instruction words)."""


@dataclass(frozen=True)
class ShopDemoConfig:
    """Sizes and budgets of one shop demo run."""

    shop: ShopConfig = field(
        default_factory=lambda: ShopConfig(families_per_category=16, instructions_per_product=4)
    )
    """The tested shop (its seed is replaced by the run's seed); SFT's shops have its sizes."""
    model: ModelSize = field(default_factory=lambda: ModelSize(max_positions=4096))
    """The from-scratch model; ReAct's longest teacher trajectories reach about 3,200 tokens."""
    flaws: ShopFlaws = field(
        default_factory=lambda: ShopFlaws(vague_search=0.3, first_result=0.3, skip_options=0.3)
    )
    """How the SFT teacher departs from the ideal shopper (its seed is replaced per shop)."""
    sft_shops: int = 3
    """Shops of other seeds, with the tested shop's ids dealt out anew, whose instructions (all
    splits) the teacher shops for SFT."""
    max_steps: int = 15
    """Actions an episode may take (the shop's step limit and the agents' turn limit)."""
    agent: AgentConfig = field(
        default_factory=lambda: AgentConfig(max_turns=15, memory_tokens=96, max_new_tokens=96)
    )
    """Turn budget and token caps, for training and evaluation alike."""
    copy_warmup_steps: int = 800
    """Updates of the copy warm-up (`memsearcher.demo.copying`) before SFT: lists of product
    ids repeated. Without it, SFT's model opened no product it was shown (docs/environments.md).
    """
    sft_steps: int = 400
    """SFT updates on the teacher's trajectories of all three agents (loss 9.1 -> 0.07 on seed
    0; the measured runs of docs/environments.md used 400)."""
    sft_sequences_per_step: int = 32
    """Turn sequences per SFT update."""
    sft_lr: float = 2e-3
    """Peak SFT learning rate (cosine, after a short warm-up)."""
    rl_runs: tuple[tuple[str, str], ...] = (
        ("memsearcher", "grpo"),
        ("mem1", "grpo"),
        ("mem1", "gae"),
        ("react", "grpo"),
    )
    """(agent, advantage) of each RL run from the SFT model: ``grpo``, or ``gae`` (PPO with a
    critic, MEM1's own algorithm)."""
    rl_steps: int = 16
    """RL steps per run (on the instructions ``rl_shop`` names)."""
    rl_questions_per_step: int = 16
    """Instructions per RL step."""
    group_size: int = 4
    """Episodes per instruction (GRPO's group)."""
    rl_lr: float = 2e-4
    """RL learning rate (the actor's; the critic's is ten times it)."""
    beta: float = 0.05
    """Weight of the KL penalty to the SFT model."""
    temperature: float = 0.4
    """Rollout sampling temperature (and the sampled evaluation's). Measured on seed 0, GRPO's
    greedy gain over SFT was MemSearcher -0.03 / +0.02 / -0.14 at 0.7 / 0.4 / 0.2, MEM1 -0.08 /
    +0.06 at 0.7 / 0.4 (docs/environments.md, with seed 1)."""
    rl_repeat_ends: bool = True
    """In RL's rollouts, an invalid action written again right after itself ends the episode
    with reward 0 (`ShopEnv`'s ``repeat_ends``; evaluation keeps the plain shop). Greedy
    decoding repeats it to the step limit, as a memory agent's prompt does not change; sampled
    rollouts escape often enough that RL did not learn to leave it (docs/environments.md)."""
    rl_shop: str = "fresh"
    """Where RL shops: ``fresh``, every instruction of a shop of another seed that neither SFT
    nor evaluation uses, its products under the tested shop's ids dealt anew (GRPO's
    ``shop_ids_from``), so that no target product RL trains on is tested; ``tested``,
    the tested shop's ``rl`` instructions. Measured on seed 0 from one SFT model, GRPO's greedy
    gain over SFT: MemSearcher +0.193 fresh, -0.005 tested; MEM1 +0.111, -0.017
    (docs/environments.md)."""
    test_instructions: int = 200
    """Held-out test instructions evaluated per (method, agent), at most."""

    def __post_init__(self) -> None:
        require(self, "rl_shop", self.rl_shop in RL_SHOPS, f"one of {list(RL_SHOPS)}")


SHOP_PRESETS: dict[str, ShopDemoConfig] = {
    "full": ShopDemoConfig(),
    "quick": ShopDemoConfig(
        shop=ShopConfig(families_per_category=2, instructions_per_product=2),
        model=ModelSize(vocab=768, hidden=64, layers=2),
        sft_shops=1,
        copy_warmup_steps=5,
        sft_steps=20,
        rl_steps=1,
        rl_questions_per_step=2,
        group_size=2,
        test_instructions=8,
    ),
}
"""``full`` shows learning; ``quick`` checks every stage end to end in CI."""

SHOP_OUTPUTS = {
    "shop.json": "the tested shop's config and its instructions per split",
    "templates.yaml": "the demo's short shop prompts",
    "models": "init/: the tokenizer trained here and a randomly initialized Llama; copy/: the "
    "same model after its copy warm-up (where SFT starts)",
    "teacher": "trajectories.jsonl: the teacher's trajectories of all three agents (SFT data)",
    "sft": "the SFT run (metrics.jsonl, step-N/model)",
    "rl": "<method>-<agent>/: each RL run (grpo, or ppo: PPO with a critic)",
    "eval": "<method>-<agent>/: predictions and summary on the test instructions, greedy",
    "eval-sampled": "the same, sampled at the RL rollouts' temperature",
    "results.json": "every number of the run",
    "report.md": "the report",
}
"""Every entry the shop demo writes into its folder, with what it holds."""

Echo = Callable[[str], None]

DECODINGS = {"greedy": "eval", "sampled": "eval-sampled"}
"""How the test instructions are decoded, and the folder each evaluation goes to: greedily,
and sampled at the RL rollouts' temperature. Greedy decoding can trap a memory agent: after an
action that changes nothing (an invalid click), its next prompt is the same, so is its next
action, to the turn limit. Sampling escapes, as in RL's own rollouts."""


def other_shop(seed: int, k: int) -> int:
    """The seed of the run's ``k``-th shop other than the tested one: SFT's shops are 0 ..
    ``sft_shops`` - 1, RL's fresh shop the next."""
    return seed * 1000 + 1 + k


def keyword_lookups(catalogues: Sequence[Catalogue]) -> list[tuple[str, str]]:
    """An instruction of ``catalogues`` and the ideal shopper's search for it: copying the
    product's words out of the instruction is the first thing every episode does."""
    return [(f"Search for: {i.text}", search_keywords(i.goal)) for c in catalogues
            for i in c.instructions]  # fmt: skip


def run_shop_demo(
    out: str | Path, config: ShopDemoConfig, seed: int, echo: Echo = print
) -> dict[str, Any]:
    """Run every stage into ``out`` and return the results (also saved as results.json)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    stage = Stages(echo, "[shop demo]")
    timings = stage.seconds

    with stage("shops"):
        shop = generate_catalogue(replace(config.shop, seed=seed))
        ids = [p.asin for p in shop.products]
        sft_shops = [
            deal_ids(generate_catalogue(replace(config.shop, seed=other_shop(seed, k))), ids, k)
            for k in range(config.sft_shops)
        ]
        splits = {s: [i.id for i in shop.split(s)] for s in ("train", "rl", "test")}
        shop_file = {"config": asdict(shop.config), "instructions": splits}
        (out / "shop.json").write_text(json.dumps(shop_file, indent=1) + "\n", encoding="utf-8")
        templates_file = out / "templates.yaml"
        templates_file.write_text(yaml.safe_dump(DEMO_SHOP_TEMPLATES), encoding="utf-8")
        templates = ShopTemplates(**DEMO_SHOP_TEMPLATES)
        search = ShopSearch(shop.products)

    with stage("tokenizer and model"):
        texts = list(DEMO_SHOP_TEMPLATES.values())
        for catalogue in (shop, *sft_shops[:1]):
            texts += _shop_texts(catalogue, ShopSearch(catalogue.products))
        init = save_demo_model(out / "models" / "init", texts, config.model, seed, ids)
        tokenizer = load_tokenizer(str(init))

    with stage("copy warm-up"):
        warm = out / "models" / "copy"
        shutil.copytree(init, warm, dirs_exist_ok=True)
        lookups = [keyword_lookups(sft_shops)]
        losses = warm_up_copying(warm, ids, config.copy_warmup_steps, seed, lookups=lookups)
        if losses:
            echo(f"[shop demo] copy warm-up loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    with stage("teacher trajectories"):
        sft_data = out / "teacher" / "trajectories.jsonl"
        sft_data.parent.mkdir(parents=True, exist_ok=True)
        teacher: dict[str, Any] = {"flaws": asdict(config.flaws), "shops": config.sft_shops}
        records: dict[str, list[dict[str, Any]]] = {agent: [] for agent in AGENTS}
        with sft_data.open("w", encoding="utf-8") as lines:
            for k, catalogue in enumerate(sft_shops):
                flaws = replace(config.flaws, seed=seed * 1000 + k)
                reply = shop_policy(catalogue, flaws)
                environment = ShopEnvironment(
                    catalogue, ShopSearch(catalogue.products), config.max_steps
                )
                examples = [instruction_example(i) for i in catalogue.instructions]
                for agent in AGENTS:
                    episodes = start_shop_episodes(
                        agent, examples, tokenizer, config.agent, templates
                    )
                    model = ScriptedLLM(tokenizer, reply)
                    trajectories = run_lockstep(episodes, model, environment, SamplingParams())
                    lines.writelines(json.dumps(t.to_dict()) + "\n" for t in trajectories)
                    records[agent] += [_record(t) for t in trajectories]
        for agent, rows in records.items():
            teacher[agent] = shop_summary(rows)
        # the ideal shopper on the test instructions: the copy probe's held-out id tokens
        test = [instruction_example(i) for i in shop.split("test")][: config.test_instructions]
        environment = ShopEnvironment(shop, search, config.max_steps)
        episodes = start_shop_episodes("memsearcher", test, tokenizer, config.agent, templates)
        ideal = ScriptedLLM(tokenizer, shop_policy(shop))
        ideal_runs = run_lockstep(episodes, ideal, environment, SamplingParams())
        probe = [sequence for t in ideal_runs for sequence in t.sequences]
        id_tokens = {tokenizer.encode(asin)[0] for asin in ids}

    with stage("SFT"):
        train_sft(sft_config(config, sft_data, warm, out / "sft", seed))
        sft_model = out / "sft" / f"step-{config.sft_steps}" / "model"
        losses = read_metric(out / "sft", "train/loss")
        echo(f"[shop demo] SFT loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        copy_probe: dict[str, float] = {}
        for name, path in (("init", init), ("warm-up", warm), ("sft", sft_model)):
            correct, total = name_token_accuracy(load_model(path), probe, id_tokens)
            copy_probe[name] = correct / max(total, 1)
        copy_probe["id_tokens"] = total
        echo(f"[shop demo] copy probe (held-out id tokens, teacher-forced): {copy_probe}")

    rl_models: dict[tuple[str, str], Path] = {}
    rewards: dict[str, list[float]] = {}
    for agent, advantage in config.rl_runs:
        method = METHODS[advantage]
        with stage(f"{method} ({agent})"):
            output = out / "rl" / f"{method}-{agent}"
            rl = _rl_config(config, agent, advantage, templates_file, sft_model, output, seed)
            train_grpo(rl)
            curve = rewards[f"{method}/{agent}"] = read_metric(output, "reward/mean")
            echo(f"[shop demo] {method} ({agent}) reward per step: {format_curve(curve)}")
            rl_models[method, agent] = output / f"step-{config.rl_steps}" / "model"

    with stage("evaluation"):
        runs = [(method, agent, path) for method, path in (("untrained", init), ("sft", sft_model))
                for agent in AGENTS]  # fmt: skip
        runs += [(method, agent, path) for (method, agent), path in rl_models.items()]
        evaluated = {
            decoding: evaluate_shop_models(out, config, seed, runs, decoding, echo)
            for decoding in DECODINGS
        }

    results = {
        "seed": seed,
        "config": asdict(config),
        "shop": {"products": len(shop.products), **{s: len(v) for s, v in splits.items()}},
        "teacher": teacher,
        "copy_probe": copy_probe,
        "rl_rewards": rewards,
        "evaluations": evaluated["greedy"]["evaluations"],
        "gains": evaluated["greedy"]["gains"],
        "sampled": evaluated["sampled"],
        "timings": {**timings, "total": round(time.perf_counter() - started, 1)},
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


def _shop_texts(catalogue: Catalogue, search: ShopSearch) -> list[str]:
    """The pages and actions of the ideal shopper on every instruction of ``catalogue``, and
    the results of a search for each product type: the tokenizer's training text."""
    texts = []
    for instruction in catalogue.instructions:
        env = ShopEnv(catalogue, search, instruction)
        actions = solve(ShopEnv(catalogue, search, instruction))
        texts.append(env.reset())
        for action in actions:
            texts += [action, env.step(action)[0]]
    for kind in {c.kind for c in CATEGORIES.values()}:
        env = ShopEnv(catalogue, search, catalogue.instructions[0])
        env.reset()
        texts.append(env.step(f"search[{kind}]")[0])
    return texts


def _record(trajectory: Any) -> dict[str, Any]:
    """A trajectory as the fields `shop_summary` reads."""
    return {
        "reward": trajectory.environment_reward,
        "turns": len(trajectory.turns),
        "prompt_tokens": [turn.prompt_tokens for turn in trajectory.turns],
    }


def _rl_config(
    config: ShopDemoConfig,
    agent: str,
    advantage: str,
    templates: Path,
    model: Path,
    output: Path,
    seed: int,
) -> GRPOConfig:
    """The RL run of ``agent`` from ``model`` on the tested shop's ``rl`` instructions, or on
    a fresh shop's (`ShopDemoConfig.rl_shop`: the seed after SFT's shops')."""
    fresh = config.rl_shop == "fresh"
    return GRPOConfig(
        environment="shop",
        reward="environment",
        shop=replace(config.shop, seed=other_shop(seed, config.sft_shops) if fresh else seed),
        shop_split="+".join(SPLITS) if fresh else "rl",
        shop_ids_from=seed if fresh else None,
        shop_repeat_ends=config.rl_repeat_ends,
        output_dir=str(output),
        agent_name=agent,
        advantage=advantage,
        filter_degenerate=advantage == "grpo",
        templates=str(templates),
        seed=seed,
        steps=config.rl_steps,
        questions_per_step=config.rl_questions_per_step,
        mini_batch_questions=config.rl_questions_per_step,
        group_size=config.group_size,
        share_prefix=True,
        reuse_logprobs=True,
        temperature=config.temperature,
        beta=config.beta,
        save_every=config.rl_steps,
        sample_every=0,
        tensorboard=False,
        model=ModelConfig(path=str(model), device="cpu", rollout_batch_size=128),
        optim=OptimConfig(lr=config.rl_lr),
        critic=CriticConfig(lr=10 * config.rl_lr),
        agent=config.agent,
    )


def evaluate_shop_models(
    out: Path,
    config: ShopDemoConfig,
    seed: int,
    runs: Sequence[tuple[str, str, Path]],
    decoding: str,
    echo: Echo = print,
) -> dict[str, Any]:
    """Each (method, agent, model) of ``runs`` on the tested shop's test instructions, decoded
    greedily or sampled (`DECODINGS`), into ``out/<folder>/<method>-<agent>``: the shop's
    metrics per run, and each RL run's reward gain over SFT's (`reward_gain`)."""
    shop = generate_catalogue(replace(config.shop, seed=seed))
    test = [instruction_example(i) for i in shop.split("test")][: config.test_instructions]
    environment = ShopEnvironment(shop, ShopSearch(shop.products), config.max_steps)
    templates = ShopTemplates(**DEMO_SHOP_TEMPLATES)
    folder = DECODINGS[decoding]
    temperature = config.temperature if decoding == "sampled" else 0.0
    evaluations: dict[str, Any] = {}
    loaded: dict[Path, HFModel] = {}
    for method, agent, path in runs:
        if path not in loaded:
            loaded[path] = HFModel.from_pretrained(str(path), device="cpu", batch_size=128)
        evaluation = EvalConfig(
            agent=agent, agent_config=config.agent, environment="shop", batch_size=len(test),
            temperature=temperature, seed=seed,
        )  # fmt: skip
        target = out / folder / f"{method}-{agent}"
        summary = run_eval(
            {"test": test}, loaded[path], environment, evaluation, target, templates,
            progress=False,
        )  # fmt: skip
        result = summary["datasets"]["test"]
        evaluations[f"{method}/{agent}"] = {
            **result["shop"],
            "format_failure_rate": result["format_failure_rate"],
            "mean_turns": result["mean_turns"],
        }
        mean = result["shop"]["mean_reward"]
        echo(f"[shop demo] {decoding:>7} {method:>16} {agent:<11} reward {mean:.3f}")
    gains = {
        f"{method}/{agent}": reward_gain(out, method, agent, folder)
        for method, agent, _ in runs
        if method not in ("untrained", "sft")
    }
    return {"temperature": temperature, "evaluations": evaluations, "gains": gains}
