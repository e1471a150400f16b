"""MemSearcher, ReAct and MEM1 on multi-objective tasks of the demo world, N = 1, 2, 4, 8.

Everything is the demo's (docs/demo.md): a generated world and its BM25 index, a from-scratch
model and tokenizer, SFT on the oracle's trajectories. Here the oracle writes all three
protocols, on tasks of one and of two questions (MEM1 trains on two), and one SFT model serves
the three agents. Each agent then answers N-objective tasks composed from the held-out test
questions (greedy), and the table gives the summed EM (count rule, 0..N), the peak context of a
trajectory, turns and time per task. The claim under test is MEM1's Figure 1: the constant-
memory agents' peak context stays about flat as N grows, ReAct's grows with every search.

    python benchmarks/mem1_objectives.py [--out runs/mem1-objectives] [--tasks 24] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import yaml

from memsearcher.agent import AgentConfig, Templates, run_lockstep, start_episodes
from memsearcher.data.compose import compose
from memsearcher.data.flashrag import read_examples
from memsearcher.data.synthetic import generate_world, write_world
from memsearcher.demo.model import save_demo_model
from memsearcher.demo.pipeline import PRESETS, sft_config
from memsearcher.demo.templates import DEMO_MEM1_TEMPLATES, DEMO_TEMPLATES, tokenizer_texts
from memsearcher.eval.report import draw_objective_plots, format_table, load_rows
from memsearcher.eval.run import EvalConfig, run_eval
from memsearcher.llm import load_tokenizer
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.bm25 import build_bm25
from memsearcher.rl.train_sft import train_sft
from memsearcher.teach.oracle import oracle_policy

AGENTS = ("memsearcher", "react", "mem1")
OBJECTIVES = (1, 2, 4, 8)
# room for the facts of several chains in the memory / internal state, and turns for N of them
AGENT = AgentConfig(max_turns=8, memory_tokens=256, max_new_tokens=256, top_n=3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/mem1-objectives")
    parser.add_argument("--tasks", type=int, default=24, help="test tasks per N")
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    demo = replace(PRESETS["full"], sft_steps=args.sft_steps, agent=AGENT)

    world = generate_world(replace(demo.world, seed=args.seed))
    paths = write_world(world, out / "world")
    index = build_bm25(paths["corpus"], out / "index", overwrite=True)
    templates = Templates(**DEMO_TEMPLATES, **DEMO_MEM1_TEMPLATES)
    (out / "templates.yaml").write_text(yaml.safe_dump({**DEMO_TEMPLATES, **DEMO_MEM1_TEMPLATES}))
    train, test = read_examples(paths["train"]), read_examples(paths["test"])
    sft_tasks = compose(train, 1, args.seed) + compose(train, 2, args.seed)
    texts = tokenizer_texts(world) + list(DEMO_MEM1_TEMPLATES.values())
    texts += ["<think> </think>\n<search> </search>", "<answer> ; </answer>", "<information>"]
    init = save_demo_model(out / "models" / "init", texts, demo.model, args.seed)
    tokenizer = load_tokenizer(str(init))

    data = out / "oracle.jsonl"
    oracle = ScriptedLLM(tokenizer, oracle_policy(sft_tasks))
    with data.open("w", encoding="utf-8") as lines:
        for agent in AGENTS:
            config = replace(AGENT, max_turns=8)
            episodes = start_episodes(agent, sft_tasks, tokenizer, config, templates)
            for t in run_lockstep(episodes, oracle, index, SamplingParams()):
                lines.write(json.dumps(t.to_dict()) + "\n")
    timings["world, model, oracle"] = time.perf_counter() - started

    begun = time.perf_counter()
    train_sft(sft_config(demo, data, init, out / "sft", args.seed))
    model_path = out / "sft" / f"step-{args.sft_steps}" / "model"
    timings["sft"] = time.perf_counter() - begun

    begun = time.perf_counter()
    llm = HFModel.from_pretrained(str(model_path), device="cpu", batch_size=128)
    runs = []
    for n in OBJECTIVES:
        tasks = compose(test, n, args.seed)[: args.tasks]
        for agent in AGENTS:
            # 3 hops at most per question, and one turn to answer
            budgets = replace(AGENT, max_turns=3 * n + 1)
            config = EvalConfig(agent, budgets, batch_size=len(tasks))
            run = out / "eval" / f"{agent}-n{n}"
            run_eval({"test": tasks}, llm, index, config, run, templates, progress=False)
            runs.append(run)
    timings["evaluation"] = time.perf_counter() - begun

    rows = load_rows(runs)
    print(format_table(rows))
    draw_objective_plots(rows, out / "plots")
    timings["total"] = time.perf_counter() - started
    print("\n| N | agent | EM (summed) | peak tokens mean | peak tokens max | turns | fmt fail |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in sorted(rows, key=lambda r: (r["objectives"], AGENTS.index(r["agent"]))):
        summary = json.loads((out / "eval" / row["run"] / "summary.json").read_text())
        peak = summary["datasets"]["test"]["peak_tokens"]
        print(
            f"| {row['objectives']:g} | {row['agent']} | {row['em']:.3f} | {peak['mean']:.0f} | "
            f"{peak['max']:.0f} | {row['mean_turns']:.2f} | {row['format_failure_rate']:.1%} |"
        )
    print("\ntimings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    (out / "timings.json").write_text(json.dumps(timings, indent=2))


if __name__ == "__main__":
    main()
