"""``memsearcher recipe embedded-agent [--config FILE] [--print-config] [key=value ...]``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm


def add_recipe_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "recipe",
        help="run a whole training recipe (data, SFT, GRPO, evaluation, report)",
        description="Run a whole training recipe into its folder. Every stage resumes from "
        "what an earlier, interrupted run of the same config left there.",
    )
    recipes = parser.add_subparsers(dest="recipe", required=True, metavar="RECIPE")
    sub = recipes.add_parser(
        "embedded-agent",
        help="SmolLM2-135M: SFT on an imperfect teacher, then GRPO, over the embedded Wikipedia",
        description="Build the teacher's data and the Wikipedia question splits, train the SFT "
        "adapter, train GRPO adapters for each agent from it, evaluate SFT and SFT+GRPO on the "
        "held-out and test questions, and write OUT/report.md (docs/embedded-agent.md).",
    )
    sub.add_argument("--config", default=None, help="YAML preset (configs/embedded-agent.yaml)")
    sub.add_argument("--print-config", action="store_true", help="print the config and exit")
    sub.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="override a field: grpo.steps=10"
    )
    sub.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from memsearcher.config import config_to_dict, load_config
    from memsearcher.recipe.config import RecipeConfig
    from memsearcher.recipe.embedded_agent import run_recipe
    from memsearcher.recipe.report import write_report

    config = load_config(RecipeConfig, args.config, args.overrides)
    if args.print_config:
        print(json.dumps(config_to_dict(config), indent=2))
        return 0
    results = run_recipe(config, echo=tqdm.write)
    report = write_report(Path(config.out), results)
    print(f"report: {report}")
    return 0
