"""How often a GRPO rollout round searches a query it already searched (issue 30, item 9).

    python benchmarks/repeated_queries.py RUN_DIR [RUN_DIR ...]   # runs saved with sample_every
    python benchmarks/repeated_queries.py --demo DEMO_DIR --steps 2 OUT_DIR
        # first re-run a finished demo's GRPO stage from its SFT model, saving samples, into OUT_DIR

Reads ``RUN_DIR/samples/step-*.jsonl`` (`memsearcher.rl.rollout.save_samples`). The lockstep
driver (`memsearcher.agent.driver.run_lockstep`) sends every search of a round as one
``retriever.search(queries, top_n)`` batch, with one ``top_n`` (the largest asked), and every
episode spends the same generation calls per turn, so round k of a step holds the k-th search
of each of the step's trajectories that got that far. A (query, top_n) pair therefore repeats
within a round exactly when its query does; the share printed is 1 - distinct / queries, what
deduplicating the batch saves. "Seen earlier in the run" counts queries any earlier round of the
run already searched: what an unbounded cache would add on top (the same top_n assumed: the
samples do not keep it, and the model may ask for another).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any


def rounds_of(samples: Path) -> list[list[str]]:
    """The queries of each lockstep round of one step's sample file, in round order."""
    rounds: list[list[str]] = []
    for line in samples.read_text(encoding="utf-8").splitlines():
        queries = [t["query"] for t in json.loads(line)["turns"] if t.get("query") is not None]
        for k, query in enumerate(queries):
            if len(rounds) <= k:
                rounds.append([])
            rounds[k].append(query)
    return rounds


def measure(run: Path) -> dict[str, Any]:
    """Per round: queries, distinct queries, the repeated share, and queries seen earlier."""
    files = sorted(
        (run / "samples").glob("step-*.jsonl"),
        key=lambda p: int(re.sub(r"\D", "", p.stem) or 0),
    )
    if not files:
        raise SystemExit(f"{run}: no samples/step-*.jsonl (train with sample_every=1)")
    seen: set[str] = set()
    rows = []
    for path in files:
        for k, queries in enumerate(rounds_of(path), start=1):
            distinct = set(queries)
            rows.append(
                {
                    "step": path.stem,
                    "round": k,
                    "queries": len(queries),
                    "distinct": len(distinct),
                    "repeated": 1 - len(distinct) / len(queries),
                    "seen_earlier": sum(q in seen for q in queries) / len(queries),
                }
            )
            seen |= distinct
    total = sum(r["queries"] for r in rows)
    if not total:  # e.g. an untrained policy that never writes a well-formed search
        raise SystemExit(f"{run}: its samples hold no search")
    return {
        "run": str(run),
        "rounds": rows,
        "mean_repeated": sum(r["repeated"] for r in rows) / len(rows),
        "pooled_repeated": 1 - sum(r["distinct"] for r in rows) / total,
        "mean_seen_earlier": sum(r["seen_earlier"] for r in rows) / len(rows),
        "queries": total,
        "searched_with_unbounded_cache": len(seen) / total,
    }


def rerun_demo_grpo(demo: Path, out: Path, steps: int, agent: str, preset: str) -> None:
    """The demo's GRPO stage for ``agent`` (`memsearcher.demo.pipeline.grpo_config`) from the
    SFT model in ``demo``, for ``steps`` steps, saving every step's samples into ``out`` (the
    demo itself saves none)."""
    from memsearcher.demo.pipeline import PRESETS, grpo_config
    from memsearcher.rl.train_grpo import train_grpo

    config = PRESETS[preset]
    seed = json.loads((demo / "sft" / "config.json").read_text(encoding="utf-8"))["seed"]
    model = demo / "sft" / f"step-{config.sft_steps}" / "model"
    world, templates = demo / "grpo-world", demo / "templates.yaml"
    grpo = grpo_config(config, agent, world, templates, model, out, seed)
    train_grpo(replace(grpo, steps=steps, sample_every=1, save_every=steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="training output folders")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--demo", type=Path, default=None, help="a finished demo's --out folder")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps to re-run (--demo)")
    parser.add_argument("--agent", default="memsearcher", help="whose GRPO stage (--demo)")
    parser.add_argument("--preset", default="full", help="the demo's preset (--demo)")
    args = parser.parse_args()
    if args.demo is not None:
        if len(args.runs) != 1:
            raise SystemExit("--demo takes one output folder")
        rerun_demo_grpo(args.demo, args.runs[0], args.steps, args.agent, args.preset)
    reports = [measure(run) for run in args.runs]
    for report in reports:
        print(f"{report['run']}")
        print(f"  {'step':<10} {'round':>5} {'queries':>8} {'distinct':>8} {'repeated':>9} "
              f"{'seen before':>11}")  # fmt: skip
        for r in report["rounds"]:
            print(f"  {r['step']:<10} {r['round']:>5} {r['queries']:>8} {r['distinct']:>8} "
                  f"{r['repeated']:>9.1%} {r['seen_earlier']:>11.1%}")  # fmt: skip
        print(f"  mean repeated share per round {report['mean_repeated']:.1%} "
              f"(pooled {report['pooled_repeated']:.1%} of {report['queries']} queries); "
              f"seen in an earlier round {report['mean_seen_earlier']:.1%}")  # fmt: skip
        print(f"  with batches deduplicated and an unbounded cache the index would search "
              f"{report['searched_with_unbounded_cache']:.1%} of the queries")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
