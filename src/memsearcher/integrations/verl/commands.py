"""``memsearcher verl prepare``: FlashRAG questions, or a shop's instructions, to the parquet
veRL trains on."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_verl_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "verl",
        help="train on veRL: write its data files (see docs/training.md)",
        description="Helpers for training our agents on veRL. The training itself runs with "
        "`python -m memsearcher.integrations.verl.main` (configs/verl/).",
    )
    actions = parser.add_subparsers(dest="verl_command", required=True, metavar="ACTION")
    prepare = actions.add_parser(
        "prepare",
        help="FlashRAG JSONL/parquet questions (or a shop's instructions) to veRL's parquet",
        description="Write one veRL row per question (data_source, agent_name, prompt, "
        "reward_model with the golden answers, extra_info with the question); with --env shop "
        "or webshop, one per instruction of the generated shop or of a WebShop server's "
        "sessions, for the loops of configs/verl/agent_loop_shop.yaml.",
    )
    prepare.add_argument("--data", help="a FlashRAG file, or a FlashRAG folder (--env search)")
    prepare.add_argument(
        "--env", choices=("search", "shop", "webshop"), default="search", help="default: search"
    )
    prepare.add_argument("--shop-seed", type=int, default=0, help="--env shop: (default: 0)")
    prepare.add_argument(
        "--shop-families", type=int, default=None, help="--env shop: products per category"
    )
    prepare.add_argument(
        "--shop-split", default="rl", help="--env shop: train, rl or test, or joined by +"
    )
    prepare.add_argument(
        "--shop-ids-from", type=int, default=None, help="--env shop: as the loop's shop_ids_from"
    )
    prepare.add_argument("--webshop-url", default=None, help="--env webshop: the server")
    prepare.add_argument("--sessions", default="1500:12087", help="--env webshop: A:B")
    prepare.add_argument(
        "--datasets", default=None, help="comma-separated names inside --data (default: all)"
    )
    prepare.add_argument("--agent", default="memsearcher", help="agent_name of every row")
    prepare.add_argument("--split", default="train", help="written to extra_info.split")
    prepare.add_argument("--limit", type=int, default=None, help="first N questions per dataset")
    prepare.add_argument("--out", required=True, help="the parquet file to write")
    prepare.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    prepare.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from memsearcher.agent import AGENTS
    from memsearcher.agent.tasks import command_line_shop
    from memsearcher.data.flashrag import load_benchmarks
    from memsearcher.errors import MemSearcherError
    from memsearcher.folders import check_output_file
    from memsearcher.integrations.verl.data import verl_rows, write_parquet

    if args.agent not in AGENTS:
        raise MemSearcherError(f"--agent {args.agent!r}: choose one of {sorted(AGENTS)}")
    if (args.env == "search") != bool(args.data):
        raise MemSearcherError("--data is for --env search, and needed there")
    check_output_file(Path(args.out), args.overwrite, [Path(args.data)] if args.data else [])
    if args.env == "search":
        names = [n for n in args.datasets.split(",") if n] if args.datasets else None
        datasets = load_benchmarks(args.data, names, args.limit)
    else:
        tasks, environment = command_line_shop(args, args.shop_split)
        environment.close()
        datasets = {args.env: tasks}
    rows = verl_rows(datasets, args.agent, args.split)
    out = write_parquet(rows, args.out)
    counts = ", ".join(f"{name} {len(examples)}" for name, examples in datasets.items())
    print(f"wrote {len(rows)} rows ({counts}) for agent {args.agent} to {out}")
    return 0
