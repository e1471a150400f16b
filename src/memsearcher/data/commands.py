"""``memsearcher data compose``: MEM1's multi-objective tasks from a FlashRAG file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_data_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "data", help="prepare QA data", description="Prepare FlashRAG-format QA data."
    )
    actions = parser.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    compose = actions.add_parser(
        "compose",
        help="join N questions into one multi-objective task (MEM1)",
        description="Shuffle the questions of one FlashRAG file with --seed, join each N "
        "consecutive ones into a task ('q1?; q2?'), and write the tasks as FlashRAG JSONL. "
        "Leftover questions (fewer than N) are dropped.",
    )
    compose.add_argument("--data", required=True, help="a FlashRAG .jsonl or .parquet file")
    compose.add_argument("--objectives", type=int, required=True, help="questions per task (N)")
    compose.add_argument("--seed", type=int, default=0, help="shuffle seed (default: 0)")
    compose.add_argument("--limit", type=int, default=None, help="keep the first K tasks")
    compose.add_argument("--out", required=True, help="the JSONL file to write")
    compose.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    compose.set_defaults(func=_compose)


def _compose(args: argparse.Namespace) -> int:
    from memsearcher.data.compose import compose, write_examples
    from memsearcher.data.flashrag import read_examples
    from memsearcher.folders import check_output_file

    check_output_file(Path(args.out), args.overwrite, [Path(args.data)])
    tasks = compose(read_examples(args.data), args.objectives, args.seed)[: args.limit]
    path = write_examples(args.out, tasks, overwrite=args.overwrite)
    print(f"{len(tasks)} tasks of {args.objectives} questions in {path}", file=sys.stderr)
    return 0
