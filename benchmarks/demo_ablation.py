"""The demo's ablations: SFT and GRPO variants, each scored on the held-out test questions.

docs/demo.md ("What we found") lists the runs made with this script and what they gave. Each
subcommand works in one folder, so a GRPO variant starts from an SFT run's model:

    python benchmarks/demo_ablation.py sft OUT --seed 0 [--vocab 2048] [--steps 600]
        [--max-hops 3] [--world '{"people": 150, ...}'] [--test 200] [--heads 2]
        [--warmup 600] [--early 0.5] [--names-as-text]
    python benchmarks/demo_ablation.py grpo OUT --model OUT/sft/step-600/model --name g1
        [--steps 16] [--save-every 8] [--test 200] [--set key=value ...]
    python benchmarks/demo_ablation.py eval OUT --model DIR --split rl [--agent memsearcher]

``sft`` writes the world, index, a fresh tokenizer and model (each entity one token unless
--names-as-text), its copy warm-up, the teacher's trajectories (of the ``train`` questions with
at most --max-hops hops, answering early at rate --early) and trains on them, then scores both
agents; --warmup 0 --early 0 --names-as-text is the demo before issue 17. It trains on the
world's own ``train`` questions; the demo itself now trains on renamed copies (docs/demo.md).
``grpo`` trains on OUT/world/rl.jsonl (the world's own rl questions; the demo itself now trains
GRPO on a renamed copy) with the demo's GRPO settings (overridable) and scores every saved step.
Scores are greedy EM on the first --test questions of the split.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from memsearcher.agent import Templates, run_lockstep, start_episodes
from memsearcher.data.flashrag import read_examples
from memsearcher.data.synthetic import generate_world, write_world
from memsearcher.demo.copying import warm_up_copying
from memsearcher.demo.model import save_demo_model
from memsearcher.demo.pipeline import (
    AGENTS,
    PRESETS,
    evaluate_questions,
    grpo_config,
    sft_config,
)
from memsearcher.demo.templates import DEMO_TEMPLATES, tokenizer_texts
from memsearcher.llm import load_tokenizer
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval import load_index
from memsearcher.retrieval.bm25 import build_bm25
from memsearcher.rl.config import GRPOConfig, config_to_dict, load_config
from memsearcher.rl.train_grpo import train_grpo
from memsearcher.rl.train_sft import train_sft
from memsearcher.teach.oracle import TeacherFlaws, oracle_policy

DEMO = PRESETS["full"]


def score(out: Path, model: str, agent: str, split: str, limit: int, target: Path) -> None:
    questions = read_examples(out / "world" / f"{split}.jsonl")[:limit]
    llm = HFModel.from_pretrained(model, device="cpu", batch_size=128)
    templates = Templates(**DEMO_TEMPLATES)
    summary = evaluate_questions(llm, agent, split, questions, load_index(out / "index"),
                                 templates, DEMO, target)  # fmt: skip
    by_hops = {h: round(em, 3) for h, em in summary["em_by_hops"].items()}
    print(f"{model} {agent} {split} ({len(questions)} q): EM {summary['em']:.3f} {by_hops}")


def run_sft(args: argparse.Namespace) -> None:
    out = Path(args.out)
    world = generate_world(replace(DEMO.world, seed=args.seed, **json.loads(args.world)))
    paths = write_world(world, out / "world")
    index = build_bm25(paths["corpus"], out / "index", overwrite=True)
    (out / "templates.yaml").write_text(yaml.safe_dump(DEMO_TEMPLATES), encoding="utf-8")
    train = [e for e in read_examples(paths["train"]) if len(e.metadata["hops"]) <= args.max_hops]
    size = replace(DEMO.model, vocab=args.vocab, heads=args.heads)
    names = () if args.names_as_text else world.names
    init = save_demo_model(out / "init", tokenizer_texts(world), size, args.seed, names)
    if args.warmup:
        warm_up_copying(init, world.names, args.warmup, args.seed)
    tokenizer = load_tokenizer(str(init))
    flaws = TeacherFlaws(early_answer=args.early, seed=args.seed)
    with (out / "oracle.jsonl").open("w", encoding="utf-8") as lines:
        for agent in AGENTS:
            episodes = start_episodes(agent, train, tokenizer, DEMO.agent,
                                      Templates(**DEMO_TEMPLATES))  # fmt: skip
            oracle = ScriptedLLM(tokenizer, oracle_policy(train, flaws))
            for t in run_lockstep(episodes, oracle, index, SamplingParams()):
                lines.write(json.dumps(t.to_dict()) + "\n")
    steps = replace(DEMO, sft_steps=args.steps)
    train_sft(sft_config(steps, out / "oracle.jsonl", init, out / "sft", args.seed))
    print(f"SFT on {len(train)} questions")
    model = str(out / "sft" / f"step-{args.steps}" / "model")
    for agent in AGENTS:
        score(out, model, agent, "test", args.test, out / "eval" / agent)


def run_grpo(args: argparse.Namespace) -> None:
    out = Path(args.out)
    # the demo's GRPO settings as a preset (NAME.yaml), --set on top; the trainer logs the
    # effective config in its run folder
    steps = replace(DEMO, grpo_steps=args.steps)
    base = grpo_config(
        steps, args.agent, out, out / "templates.yaml", Path(args.model), out / args.name, seed=0
    )
    preset = out / f"{args.name}.yaml"
    preset.write_text(yaml.safe_dump(config_to_dict(base)), encoding="utf-8")
    train_grpo(load_config(GRPOConfig, preset, [f"save_every={args.save_every}", *args.set]))
    rows = [json.loads(line) for line in (out / args.name / "metrics.jsonl").open()]
    print("reward per step:", " ".join(f"{r['reward/mean']:.2f}" for r in rows))
    for step in range(args.save_every, args.steps + 1, args.save_every):
        model = str(out / args.name / f"step-{step}" / "model")
        score(out, model, args.agent, "test", args.test, out / args.name / "eval" / str(step))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sft = commands.add_parser("sft", help="world, model, oracle data, SFT, scores")
    sft.add_argument("out")
    sft.add_argument("--seed", type=int, default=0)
    sft.add_argument("--vocab", type=int, default=DEMO.model.vocab)
    sft.add_argument("--steps", type=int, default=DEMO.sft_steps)
    sft.add_argument("--max-hops", type=int, default=3, help="SFT on questions up to N hops")
    sft.add_argument("--world", default="{}", help="WorldConfig fields as JSON")
    sft.add_argument("--test", type=int, default=DEMO.test_questions)
    sft.add_argument("--heads", type=int, default=DEMO.model.heads)
    sft.add_argument("--warmup", type=int, default=DEMO.copy_warmup_steps, help="copy warm-up")
    sft.add_argument("--early", type=float, default=DEMO.flaws.early_answer,
                     help="the teacher's early-answer rate")  # fmt: skip
    sft.add_argument("--names-as-text", action="store_true", help="names as plain BPE text")
    sft.set_defaults(func=run_sft)
    grpo = commands.add_parser("grpo", help="GRPO from a model on OUT's rl questions, scores")
    grpo.add_argument("out")
    grpo.add_argument("--model", required=True)
    grpo.add_argument("--name", required=True, help="run folder under OUT")
    grpo.add_argument("--agent", choices=AGENTS, default="memsearcher")
    grpo.add_argument("--steps", type=int, default=DEMO.grpo_steps)
    grpo.add_argument("--save-every", type=int, default=8)
    grpo.add_argument("--test", type=int, default=DEMO.test_questions)
    override = "a GRPOConfig override (repeatable), e.g. --set optim.lr=1e-4"
    grpo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=override)
    grpo.set_defaults(func=run_grpo)
    evaluate = commands.add_parser("eval", help="score one model on one split of OUT")
    evaluate.add_argument("out")
    evaluate.add_argument("--model", required=True)
    evaluate.add_argument("--split", default="test")
    evaluate.add_argument("--agent", choices=AGENTS, default="memsearcher")
    evaluate.add_argument("--test", type=int, default=10**9, help="first N questions")
    evaluate.set_defaults(
        func=lambda a: score(Path(a.out), a.model, a.agent, a.split, a.test,
                             Path(a.out) / "eval-ablation" / Path(a.model).name / a.split)
    )  # fmt: skip
    args: Any = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
