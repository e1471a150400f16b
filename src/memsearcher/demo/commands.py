"""``memsearcher demo [--out DIR] [--quick] [--seed N]``: the whole system, offline, on a CPU."""

from __future__ import annotations

import argparse
from pathlib import Path

from memsearcher.errors import MemSearcherError


def add_demo_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="train and evaluate MemSearcher against ReAct on a synthetic world (offline, CPU)",
        description="Generate a synthetic multi-hop world and its BM25 index, train a small "
        "model from scratch (SFT on oracle trajectories, then multi-context GRPO), evaluate "
        "untrained / SFT / SFT+GRPO for MemSearcher and ReAct on held-out questions, and "
        "write a markdown report with plots.",
    )
    parser.add_argument("--out", default="demo-run", help="output folder (default: demo-run)")
    parser.add_argument(
        "--quick", action="store_true", help="a few minutes' version: checks every stage, "
        "too small to show learning"
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="world, model and training seed")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from memsearcher.demo.pipeline import PRESETS, run_demo
    from memsearcher.demo.report import format_results, write_report

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not (out / "world").is_dir():
        raise MemSearcherError(f"--out {out} holds files that are not a demo run; choose another")
    results = run_demo(out, PRESETS["quick" if args.quick else "full"], args.seed)
    report = write_report(out, results)
    print(format_results(results))
    print(f"\nreport: {report}  (total {results['timings']['total']} s)")
    return 0
