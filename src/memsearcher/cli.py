"""The `memsearcher` command line. Logging is configured here and nowhere else."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from memsearcher.api.commands import add_serve_command
from memsearcher.ask import add_ask_command
from memsearcher.data.commands import add_data_command
from memsearcher.demo.commands import add_demo_command
from memsearcher.errors import MemSearcherError
from memsearcher.eval.commands import add_eval_command
from memsearcher.integrations.verl.commands import add_verl_command
from memsearcher.recipe.commands import add_recipe_command
from memsearcher.retrieval.commands import add_index_command, add_retriever_command
from memsearcher.rl.commands import add_train_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memsearcher",
        description="A search agent with a compact memory, trained with multi-context GRPO.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(commands)
    return parser


# Each entry adds one sub-command whose parser sets `func` (args -> exit code).
COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_ask_command,
    add_index_command,
    add_retriever_command,
    add_train_command,
    add_eval_command,
    add_data_command,
    add_serve_command,
    add_demo_command,
    add_recipe_command,
    add_verl_command,
]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # read by huggingface_hub and transformers when they are first imported
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return int(args.func(args) or 0)
    except MemSearcherError as error:
        print(f"memsearcher: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
