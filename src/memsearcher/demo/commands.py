"""``memsearcher demo [--env search|shop] [--out DIR] [--quick] [--seed N]``: the whole system,
offline, on a CPU: search QA on a synthetic world, or shopping in the offline shop."""

from __future__ import annotations

import argparse
from pathlib import Path

from memsearcher.folders import claim_folder


def add_demo_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="train and evaluate MemSearcher against ReAct on a synthetic world (offline, CPU)",
        description="Generate a synthetic multi-hop world and its BM25 index, train a small "
        "model from scratch (a copy warm-up, SFT on an imperfect teacher's trajectories on renamed "
        "copies of the world, then multi-context GRPO), evaluate "
        "untrained / SFT / SFT+GRPO for MemSearcher and ReAct on held-out questions, and "
        "write a markdown report with plots.",
    )
    parser.add_argument(
        "--env", choices=("search", "shop"), default="search",
        help="search: QA on a synthetic world, MemSearcher against ReAct (default); shop: the "
        "offline shop, MemSearcher, MEM1 and ReAct (docs/environments.md)",
    )  # fmt: skip
    parser.add_argument(
        "--out", help="output folder (default: demo-run, or demo-shop with --env shop)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a few minutes' version: checks every stage, "
        "too small to show learning"
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="world, model and training seed")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace an earlier demo run in --out (only a folder the demo made)",
    )  # fmt: skip
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from memsearcher.demo.pipeline import OUTPUTS, PRESETS, run_demo
    from memsearcher.demo.report import format_grpo_questions, format_results, write_report

    if args.env == "shop":
        return _run_shop(args)
    out = Path(args.out or "demo-run")
    # An earlier run's stages would resume or append, so it is replaced whole; a folder the
    # demo did not make is never touched, whatever its entries are called.
    claim_folder(out, "demo", "a demo run", OUTPUTS.__contains__, args.overwrite)
    results = run_demo(out, PRESETS["quick" if args.quick else "full"], args.seed)
    report = write_report(out, results)
    print(format_results(results))
    print(f"\n{format_grpo_questions(results)}")
    print(f"\nreport: {report}  (total {results['timings']['total']} s)")
    return 0


def _run_shop(args: argparse.Namespace) -> int:
    from memsearcher.demo.shop import SHOP_OUTPUTS, SHOP_PRESETS, run_shop_demo
    from memsearcher.demo.shop_report import format_decoding, write_shop_report

    out = Path(args.out or "demo-shop")
    claim_folder(out, "demo-shop", "a shop demo run", SHOP_OUTPUTS.__contains__, args.overwrite)
    results = run_shop_demo(out, SHOP_PRESETS["quick" if args.quick else "full"], args.seed)
    report = write_shop_report(out, results)
    print("greedy:\n" + format_decoding(results["evaluations"], results["gains"]))
    sampled = results["sampled"]
    print(f"\nsampled at temperature {sampled['temperature']}:")
    print(format_decoding(sampled["evaluations"], sampled["gains"]))
    print(f"\nreport: {report}  (total {results['timings']['total']} s)")
    return 0
