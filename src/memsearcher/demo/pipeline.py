"""The whole demo, stage by stage: world, index, model, oracle SFT data, SFT, GRPO, evaluation.

Everything is written under one output folder, each stage to its own entry (:data:`OUTPUTS`
says what each holds), so a run can be read afterwards; every model is a normal HF folder that
`memsearcher ask/eval` can load.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import yaml

from memsearcher.agent import AgentConfig, Templates, run_lockstep, start_episodes
from memsearcher.agent.base import check_trainable
from memsearcher.data.flashrag import read_examples
from memsearcher.data.synthetic import (
    SPLITS,
    World,
    WorldConfig,
    generate_world,
    hops_of,
    rename_world,
    write_world,
)
from memsearcher.demo.behaviour import behaviour
from memsearcher.demo.copying import (
    fact_lookups,
    name_token_accuracy,
    question_lookups,
    warm_up_copying,
)
from memsearcher.demo.model import ModelSize, save_demo_model
from memsearcher.demo.templates import DEMO_TEMPLATES, tokenizer_texts
from memsearcher.errors import MemSearcherError
from memsearcher.eval.metrics import exact_match
from memsearcher.eval.predictions import read_predictions
from memsearcher.eval.run import EvalConfig, run_eval
from memsearcher.llm import load_tokenizer
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.bm25 import BM25Index, build_bm25
from memsearcher.rl.config import GRPOConfig, ModelConfig, OptimConfig, SFTConfig
from memsearcher.rl.train_grpo import train_grpo
from memsearcher.rl.train_sft import train_sft
from memsearcher.teach.oracle import AGENTS, TeacherFlaws, oracle_policy
from memsearcher.types import QAExample

__all__ = [
    "AGENTS",
    "PRESETS",
    "DemoConfig",
    "evaluate_questions",
    "grpo_config",
    "run_demo",
    "load_model",
    "read_metric",
    "sft_config",
]


@dataclass(frozen=True)
class DemoConfig:
    """Sizes and budgets of one demo run."""

    world: WorldConfig = field(default_factory=WorldConfig)
    """The synthetic world (its seed is replaced by the run's seed)."""
    model: ModelSize = field(default_factory=ModelSize)
    """The from-scratch model."""
    copy_warmup_steps: int = 800
    """Updates of the copy warm-up (`memsearcher.demo.copying`) before SFT."""
    fact_warmup: bool = True
    """Whether a third of the warm-up copies a fact sentence out of retrieved passages
    (`fact_lookups`), the copy every memory update makes. Off, the warm-up is names and
    question entities only: faster, and (measured before the world's relation words were made
    distinct) MemSearcher ended behind ReAct in seed 0 (docs/demo.md)."""
    flaws: TeacherFlaws = field(default_factory=lambda: TeacherFlaws(early_answer=0.5))
    """How the SFT teacher departs from the ideal agent (its seed is replaced by the run's)."""
    sft_worlds: int = 6
    """Renamed copies of the world (`rename_world`) whose train questions the teacher answers
    for SFT."""
    agent: AgentConfig = field(
        default_factory=lambda: AgentConfig(
            max_turns=5, memory_tokens=64, max_new_tokens=64, top_n=3
        )
    )
    """Turn budget, memory cap and passages per search, for training and evaluation alike."""
    sft_steps: int = 900
    """SFT updates on the oracle trajectories of both agents."""
    sft_sequences_per_step: int = 32
    """Turn sequences per SFT update."""
    sft_lr: float = 2e-3
    """Peak SFT learning rate (cosine, after a short warm-up)."""
    grpo_world: int = 100
    """The renamed copy of the world (`rename_world`) whose ``rl`` questions and index GRPO
    trains on, well past SFT's copies (0 to ``sft_worlds`` - 1). Its names are the world's
    own, each moved to other facts, so reward can teach how to find an answer but not which
    name answers the world's questions (docs/demo.md)."""
    grpo_steps: int = 16
    """GRPO steps per agent, on the ``rl`` split (entities SFT never started from)."""
    grpo_questions_per_step: int = 24
    """Questions per GRPO step."""
    group_size: int = 4
    """Trajectories per question (G)."""
    grpo_lr: float = 2e-4
    """GRPO learning rate (5e-4 collapsed the policy onto one memorized name; see docs/demo.md)."""
    grpo_beta: float = 0.05
    """Weight of the KL penalty to the SFT model, which keeps GRPO's noisy steps anchored."""
    temperature: float = 0.7
    """Rollout sampling temperature (and of the log-probabilities, so updates stay on-policy)."""
    test_questions: int = 200
    """Held-out test questions evaluated per (method, agent)."""

    def __post_init__(self) -> None:
        check_trainable(self.agent, "agent")  # refused here, not after SFT has run
        if self.grpo_world < self.sft_worlds:
            raise MemSearcherError(
                f"grpo_world ({self.grpo_world}) is one of SFT's renamed copies (0 to "
                f"{self.sft_worlds - 1}): GRPO must train on a copy SFT never read"
            )


PRESETS: dict[str, DemoConfig] = {
    "full": DemoConfig(),
    "quick": DemoConfig(
        world=WorldConfig(people=16, cities=8, countries=4, orgs=6, works=20),
        model=ModelSize(vocab=768, hidden=64, layers=2),
        copy_warmup_steps=20,
        sft_worlds=2,
        sft_steps=40,
        grpo_steps=2,
        grpo_questions_per_step=8,
        test_questions=40,
    ),
}
"""``full`` is the README's main job; ``quick`` checks every stage end to end in CI."""

OUTPUTS = {
    "world": "corpus.jsonl, train/rl/dev/test.jsonl (FlashRAG), world.json",
    "index": "the BM25 index of the world",
    "templates.yaml": "the demo's short prompts",
    "models": "init/: the tokenizer trained here and a randomly initialized Llama; copy/: the "
    "same model after its copy warm-up (where SFT starts)",
    "oracle": "the imperfect teacher's trajectories of both agents (the SFT data), on renamed "
    "copies of the world (world-K/), each with its own index",
    "grpo-world": "the renamed copy whose rl questions GRPO trains on (world/, index/)",
    "sft": "the SFT run (metrics.jsonl, step-N/model)",
    **{f"grpo-{agent}": f"the GRPO run of {agent}" for agent in AGENTS},
    "eval": "<method>-<agent>/: predictions and summary on the test (and rl) questions",
    "results.json": "every number of the run",
    "report.md": "the report (written by `memsearcher.demo.report.write_report`)",
    "report.html": "one self-contained page: the eval table and plots of every run, and a "
    "question browser with each run's trajectory side by side",
    "reward_per_step.png": "the report's plot of GRPO's mean reward per step",
    "em_by_method.png": "the report's plot of EM by method and agent",
    "prompt_tokens_per_turn.png": "the report's plot of prompt tokens per turn",
}
"""Every entry the demo writes into its folder, with what it holds."""

Echo = Callable[[str], None]


class Stages:
    """Times a run's named stages (``with stages("SFT"): ...``), echoing each start and end."""

    def __init__(self, echo: Echo, prefix: str) -> None:
        self.echo, self.prefix = echo, prefix
        self.seconds: dict[str, float] = {}
        """Seconds of each finished stage, by name."""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        begun = time.perf_counter()
        self.echo(f"{self.prefix} {name} ...")
        yield
        self.seconds[name] = round(time.perf_counter() - begun, 1)
        self.echo(f"{self.prefix} {name}: {self.seconds[name]} s")


def run_demo(out: str | Path, config: DemoConfig, seed: int, echo: Echo = print) -> dict[str, Any]:
    """Run every stage into ``out`` and return the results (also saved as results.json)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    stage = Stages(echo, "[demo]")
    timings = stage.seconds

    with stage("world and index"):
        world = generate_world(replace(config.world, seed=seed))
        paths = write_world(world, out / "world")
        index = build_bm25(paths["corpus"], out / "index", overwrite=True)
        templates_file = out / "templates.yaml"
        templates_file.write_text(yaml.safe_dump(DEMO_TEMPLATES), encoding="utf-8")
        templates = Templates(**DEMO_TEMPLATES)
        test = read_examples(paths["test"])[: config.test_questions]

    with stage("tokenizer and model"):
        init = save_demo_model(
            out / "models" / "init", tokenizer_texts(world), config.model, seed, world.names
        )

    with stage("renamed worlds"):
        # SFT reads renamed copies of the world, never the world itself: no fact of the world
        # evaluated on is ever trained on, and a name can only be copied, not recalled
        renamed = [
            _renamed_copy(world, copy, out / "oracle" / f"world-{copy}", "train")
            for copy in range(config.sft_worlds)
        ]
        # GRPO, too, trains on a copy: on the world's own rl questions, reward could also teach
        # which names answer it (their answers are drawn from the test answers' names)
        grpo_folder = out / "grpo-world"
        grpo_copy = _renamed_copy(world, config.grpo_world, grpo_folder, "rl")
        rl = grpo_copy.questions[: config.test_questions]

    with stage("copy warm-up"):
        warm = out / "models" / "copy"
        shutil.copytree(init, warm, dirs_exist_ok=True)
        lookups = [question_lookups([c.world for c in renamed])]
        if config.fact_warmup:
            top_n = config.agent.top_n
            lookups.append([f for c in renamed for f in fact_lookups(c.world, c.index, top_n)])
        losses = warm_up_copying(warm, world.names, config.copy_warmup_steps, seed, lookups=lookups)
        if losses:
            echo(f"[demo] copy warm-up loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    with stage("teacher trajectories"):
        tokenizer = load_tokenizer(str(init))
        flaws = replace(config.flaws, seed=seed)
        sft_data = out / "oracle" / "trajectories.jsonl"
        sft_data.parent.mkdir(parents=True, exist_ok=True)
        teacher_summary: dict[str, Any] = {"flaws": asdict(flaws), "worlds": config.sft_worlds}
        runs: dict[str, list[Any]] = {agent: [] for agent in AGENTS}
        with sft_data.open("w", encoding="utf-8") as lines:
            for copy in renamed:
                teacher = ScriptedLLM(tokenizer, oracle_policy(copy.questions, flaws))
                for agent in AGENTS:
                    episodes = start_episodes(
                        agent, copy.questions, tokenizer, config.agent, templates
                    )
                    trajectories = run_lockstep(episodes, teacher, copy.index, SamplingParams())
                    runs[agent] += trajectories
                    lines.writelines(json.dumps(t.to_dict()) + "\n" for t in trajectories)
        for agent, trajectories in runs.items():
            scores = [exact_match(t.answer or "", t.example.golden_answers) for t in trajectories]
            records = [{"prediction": t.answer, "trajectory": t.to_dict()} for t in trajectories]
            teacher_summary[agent] = {"em": sum(scores) / len(scores), **behaviour(records)}
        # the ideal agent on the test questions: the copy probe's held-out name tokens
        ideal = ScriptedLLM(tokenizer, oracle_policy(test))
        episodes = start_episodes("memsearcher", test, tokenizer, config.agent, templates)
        ideal_runs = run_lockstep(episodes, ideal, index, SamplingParams())
        probe = [s for t in ideal_runs for s in t.sequences]
        name_ids = {tokenizer.encode(name)[0] for name in world.names}

    with stage("SFT"):
        train_sft(sft_config(config, sft_data, warm, out / "sft", seed))
        sft_model = out / "sft" / f"step-{config.sft_steps}" / "model"
        losses = read_metric(out / "sft", "train/loss")
        echo(f"[demo] SFT loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        copy_probe = {}
        for name, path in (("warm-up", warm), ("sft", sft_model)):
            correct, total = name_token_accuracy(load_model(path), probe, name_ids)
            copy_probe[name] = correct / max(total, 1)
        copy_probe["name_tokens"] = total
        echo(f"[demo] copy probe (held-out name tokens, teacher-forced): {copy_probe}")

    grpo_models = {}
    for agent in AGENTS:
        with stage(f"GRPO ({agent})"):
            output = out / f"grpo-{agent}"
            grpo = grpo_config(config, agent, grpo_folder, templates_file, sft_model, output, seed)
            train_grpo(grpo)
            rewards = " ".join(f"{r:.2f}" for r in read_metric(output, "reward/mean"))
            echo(f"[demo] GRPO ({agent}) reward per step: {rewards}")
            grpo_models[agent] = output / f"step-{config.grpo_steps}" / "model"

    with stage("evaluation"):
        models = {"untrained": {a: init for a in AGENTS}, "sft": {a: sft_model for a in AGENTS},
                  "sft+grpo": grpo_models}  # fmt: skip
        evaluations: dict[str, dict[str, Any]] = {}
        loaded: dict[Path, HFModel] = {}  # the untrained and SFT models serve both agents
        for method, per_agent in models.items():
            for agent, path in per_agent.items():
                if path not in loaded:
                    loaded[path] = HFModel.from_pretrained(str(path), device="cpu", batch_size=128)
                target = out / "eval" / f"{method}-{agent}"
                summary = evaluate_questions(
                    loaded[path], agent, "test", test, index, templates, config, target
                )
                records = read_predictions(target / "test" / "predictions.jsonl")
                summary["behaviour"] = behaviour(records)
                evaluations[f"{method}/{agent}"] = summary
                echo(f"[demo] {method:>9} {agent:<11} EM {summary['em']:.3f}")
        # The same models on GRPO's own questions (held out from SFT, trained on by GRPO): what
        # GRPO learned there, next to how much of it carries over to the test questions.
        grpo_questions: dict[str, dict[str, Any]] = {}
        for method in ("sft", "sft+grpo"):
            for agent, path in models[method].items():
                target = out / "eval" / f"{method}-{agent}"
                summary = evaluate_questions(
                    loaded[path], agent, "rl", rl, grpo_copy.index, templates, config, target
                )
                grpo_questions[f"{method}/{agent}"] = summary
                echo(f"[demo] {method:>9} {agent:<11} EM {summary['em']:.3f} on GRPO's questions")

    results = {
        "seed": seed,
        "config": asdict(config),
        "world": {"passages": len(world.passages), **{s: len(world.split(s)) for s in SPLITS}},
        "teacher": teacher_summary,
        "copy_probe": copy_probe,
        "evaluations": evaluations,
        "grpo_questions": grpo_questions,
        "timings": {**timings, "total": round(time.perf_counter() - started, 1)},
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


class SFTBudget(Protocol):
    """What a demo's config says of its SFT run (the QA demo's and the shop demo's)."""

    @property
    def sft_steps(self) -> int: ...
    @property
    def sft_sequences_per_step(self) -> int: ...
    @property
    def sft_lr(self) -> float: ...


def sft_config(config: SFTBudget, data: Path, init: Path, output: Path, seed: int) -> SFTConfig:
    """A demo's SFT run: ``config``'s steps and learning rate on ``data``, from ``init``."""
    return SFTConfig(
        data=str(data),
        output_dir=str(output),
        seed=seed,
        steps=config.sft_steps,
        sequences_per_step=config.sft_sequences_per_step,
        save_every=config.sft_steps,
        tensorboard=False,
        model=ModelConfig(path=str(init), device="cpu"),
        optim=OptimConfig(lr=config.sft_lr, warmup_steps=20, schedule="cosine"),
    )


def grpo_config(
    config: DemoConfig,
    agent: str,
    world: Path,
    templates: Path,
    model: Path,
    output: Path,
    seed: int,
) -> GRPOConfig:
    """The demo's GRPO run for ``agent`` from ``model``, on the ``rl`` questions and index of
    the world folder ``world`` (world/rl.jsonl, index/), with the prompts in ``templates``."""
    return GRPOConfig(
        data=str(world / "world" / "rl.jsonl"),
        output_dir=str(output),
        agent_name=agent,
        retriever=str(world / "index"),
        templates=str(templates),
        seed=seed,
        steps=config.grpo_steps,
        questions_per_step=config.grpo_questions_per_step,
        mini_batch_questions=config.grpo_questions_per_step,
        group_size=config.group_size,
        share_prefix=True,
        reuse_logprobs=True,
        temperature=config.temperature,
        beta=config.grpo_beta,
        save_every=config.grpo_steps,
        sample_every=0,
        tensorboard=False,
        model=ModelConfig(path=str(model), device="cpu", rollout_batch_size=128),
        optim=OptimConfig(lr=config.grpo_lr),
        agent=config.agent,
    )


@dataclass(frozen=True)
class RenamedCopy:
    """A renamed copy of the world as written to disk, with one split's questions."""

    world: World
    questions: list[QAExample]
    index: BM25Index


def _renamed_copy(world: World, copy: int, where: Path, split: str) -> RenamedCopy:
    """Write renamed copy ``copy`` of ``world`` and its BM25 index into ``where`` (world/,
    index/); return the copy, its ``split`` questions and the index."""
    renamed = rename_world(world, copy)
    files = write_world(renamed, where / "world")
    index = build_bm25(files["corpus"], where / "index", overwrite=True)
    return RenamedCopy(renamed, read_examples(files[split]), index)


def load_model(path: Path) -> Any:
    """A demo model saved at ``path``, for probing (transformers, on the CPU)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def read_metric(run: Path, key: str) -> list[float]:
    """Every logged value of ``key`` in a training run's metrics.jsonl, in step order."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open(encoding="utf-8")]
    return [row[key] for row in rows if key in row]


def evaluate_questions(
    llm: HFModel,
    agent: str,
    split: str,
    questions: list[Any],
    index: Any,
    templates: Templates,
    config: DemoConfig,
    out: Path,
) -> dict[str, Any]:
    """Greedy evaluation of ``agent`` on ``questions`` into ``out/<split>/``, with the demo's
    turn settings; the summary of that split, plus EM by number of hops and by question chain
    (its relations, joined by ">"; with the number of questions)."""
    evaluation = EvalConfig(agent=agent, agent_config=config.agent, batch_size=len(questions))
    summary = run_eval({split: questions}, llm, index, evaluation, out, templates, progress=False)
    result: dict[str, Any] = summary["datasets"][split]
    chains = {e.id: [hop.relation for hop in hops_of(e.metadata)] for e in questions}
    by_hops: dict[str, list[float]] = {}
    by_chain: dict[str, list[float]] = {}
    for record in read_predictions(out / split / "predictions.jsonl"):
        chain = chains[record["id"]]
        by_hops.setdefault(str(len(chain)), []).append(record["em"])
        by_chain.setdefault(">".join(chain), []).append(record["em"])
    result["em_by_hops"] = {h: sum(v) / len(v) for h, v in sorted(by_hops.items())}
    result["em_by_chain"] = {
        c: {"em": sum(v) / len(v), "questions": len(v)} for c, v in sorted(by_chain.items())
    }
    return result
