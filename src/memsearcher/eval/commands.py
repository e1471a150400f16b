"""``memsearcher eval`` (run or resume an evaluation) and ``memsearcher eval report``.

Heavy imports stay inside the handlers so that ``memsearcher --help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import TYPE_CHECKING, Any

from memsearcher.agent.options import add_agent_arguments, agent_config_from
from memsearcher.llm.options import add_model_arguments, open_llm

if TYPE_CHECKING:
    from memsearcher.eval.run import EvalConfig


def add_eval_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval",
        help="evaluate an agent on FlashRAG benchmarks (resumable), or compare runs",
        description="Answer every question of FlashRAG-format datasets and score them (EM, F1, "
        "ACC). Rerun with the same --out to resume. 'eval report DIR ...' compares runs.",
    )
    parser.add_argument("--data", help="a FlashRAG .jsonl/.parquet file, or a FlashRAG folder")
    parser.add_argument(
        "--datasets", default=None, help="comma-separated names inside --data (default: all found)"
    )
    parser.add_argument("--out", help="run folder (predictions, summary); reused to resume")
    parser.add_argument("--limit", type=int, default=None, help="first N questions per dataset")
    parser.add_argument(
        "--objectives",
        type=int,
        default=None,
        help="join N questions into each task (MEM1's multi-objective QA), scored with the "
        "count rule; --limit then counts tasks",
    )
    parser.add_argument(
        "--compose-seed", type=int, default=0, help="shuffle seed of --objectives (default: 0)"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--index", default=None, help="index folder (default: embedded BM25)")
    where.add_argument("--retriever", default=None, help="retrieval server URL or index folder")
    parser.add_argument(
        "--driver",
        choices=("lockstep", "async"),
        default=None,
        help="default: async for --backend openai, else lockstep",
    )
    parser.add_argument("--concurrency", type=int, default=64, help="async driver: in flight")
    shop = parser.add_argument_group("shop (--env shop or webshop)")
    shop.add_argument(
        "--env",
        choices=("search", "shop", "webshop"),
        default="search",
        help="search: QA over a retriever (--data); shop: the generated shop's instructions "
        "(no --data), scored by the shop's reward; webshop: the sessions of a WebShop server "
        "(--webshop-url), scored by its reward",
    )
    shop.add_argument("--shop-seed", type=int, default=0, help="the shop's seed (default: 0)")
    shop.add_argument(
        "--shop-families",
        type=int,
        default=None,
        help="target products per category (default: the shop's own, 8)",
    )
    shop.add_argument(
        "--split", choices=("train", "rl", "test"), default="test", help="default: test"
    )
    shop.add_argument(
        "--webshop-url",
        default=None,
        help="--env webshop: the server (princeton-nlp's WebShop, or ours: python -m "
        "memsearcher.agent.environments.shop_server), e.g. http://127.0.0.1:3000",
    )
    shop.add_argument(
        "--sessions",
        default="0:500",
        help="--env webshop: sessions fixed_A .. fixed_{B-1} as A:B (default: 0:500, "
        "WebShop's usual test goals)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_agent_arguments(parser)
    add_model_arguments(parser)
    parser.set_defaults(func=run_eval_command)

    actions = parser.add_subparsers(dest="eval_action", metavar="ACTION")
    report = actions.add_parser(
        "report",
        help="compare evaluation runs in a table and plot tokens per turn",
        description="Print EM/F1/ACC and context sizes of runs across datasets, and draw the "
        "prompt tokens of each turn; for runs at several numbers of objectives (--objectives), "
        "also peak tokens and EM against N, one line per agent.",
    )
    report.add_argument("runs", nargs="+", metavar="DIR", help="run folders (eval --out)")
    report.add_argument("--plots", default="eval-report", help="folder for the plots")
    report.add_argument("--no-plots", action="store_true", help="print the table only")
    report.add_argument("--json", action="store_true", help="print the rows as JSON")
    report.add_argument(
        "--html",
        default=None,
        metavar="OUT.html",
        help="also write one self-contained page: the table, the plots, and a question browser "
        "with each run's trajectory side by side",
    )
    report.set_defaults(func=run_report_command)


def run_eval_command(args: argparse.Namespace) -> int:
    from memsearcher.agent import load_templates
    from memsearcher.data.flashrag import load_benchmarks
    from memsearcher.errors import MemSearcherError
    from memsearcher.eval.run import run_eval
    from memsearcher.retrieval import open_retriever

    if args.env in ("shop", "webshop"):
        return run_shop_eval(args)
    if not args.data or not args.out:
        raise MemSearcherError("eval needs --data and --out (or: eval report DIR ...)")
    names = [n.strip() for n in args.datasets.split(",") if n.strip()] if args.datasets else None
    driver = args.driver or ("async" if args.backend == "openai" else "lockstep")
    config = _eval_config(args, driver=driver, concurrency=args.concurrency)
    if args.objectives is None:
        datasets = load_benchmarks(args.data, names, args.limit)
    else:
        from memsearcher.data.compose import compose

        datasets = {
            name: compose(examples, args.objectives, args.compose_seed)[: args.limit]
            for name, examples in load_benchmarks(args.data, names).items()
        }
    templates = load_templates(args.templates)
    retriever_spec = args.index or args.retriever
    retriever = open_retriever(retriever_spec)
    llm = open_llm(args)
    info = {
        "model": args.model,
        "backend": args.backend,
        "served_model": args.served_model,
        "retriever": retriever_spec or "embedded",
        "templates": args.templates,
    }
    if args.objectives is not None:  # absent otherwise, so earlier runs still resume
        info.update(objectives=args.objectives, compose_seed=args.compose_seed)
    if args.chat_template_kwargs:  # the same
        info["chat_template_kwargs"] = args.chat_template_kwargs
    summary = run_eval(
        datasets, llm, retriever, config, args.out, templates, info, not args.no_progress
    )
    from memsearcher.eval.report import format_table, rows_from_summary

    print(format_table(rows_from_summary(args.out, summary)))
    print(f"predictions and summary.json in {args.out}", file=sys.stderr)
    return 0


def run_shop_eval(args: argparse.Namespace) -> int:
    """``eval --env shop``: every instruction of a split of the generated shop, in its pages,
    into the same run folder layout (``OUT/shop-<split>/predictions.jsonl``, summary.json);
    ``eval --env webshop``: the sessions of a WebShop server (``OUT/webshop/``)."""
    from memsearcher.agent.prompts import read_templates
    from memsearcher.agent.shop_agents import ShopTemplates
    from memsearcher.errors import MemSearcherError
    from memsearcher.eval.run import run_eval

    env = args.env
    if not args.out:
        raise MemSearcherError(f"eval --env {env} needs --out")
    given = [f"--{k}" for k in ("data", "index", "retriever", "objectives")
             if getattr(args, k) is not None]  # fmt: skip
    if given:
        raise MemSearcherError(
            f"eval --env {env} takes no {', '.join(given)}: the shop brings its instructions "
            "and search"
        )
    templates = read_templates(args.templates, ShopTemplates)
    driver = args.driver or ("async" if args.backend == "openai" else "lockstep")
    config = _eval_config(args, driver=driver, concurrency=args.concurrency, environment=env)
    info: dict[str, object] = {
        "model": args.model,
        "backend": args.backend,
        "served_model": args.served_model,
    }
    with contextlib.ExitStack() as closing:
        name, examples, environment, where = _shop_tasks(args, closing)
        info.update(where)
        llm = open_llm(args)
        if args.templates:  # absent otherwise, so earlier runs still resume
            info["templates"] = args.templates
        if args.chat_template_kwargs:
            info["chat_template_kwargs"] = args.chat_template_kwargs
        summary = run_eval(
            {name: examples}, llm, environment, config, args.out, templates, info,
            not args.no_progress,
        )  # fmt: skip
    shop = summary["datasets"][name].get("shop")
    if shop is not None:
        long = shop["peak_prompt_tokens_long"]
        print(
            f"{name}: {len(examples)} instructions, reward {shop['mean_reward']:.4f}, "
            f"success {shop['success_rate']:.4f}, steps {shop['mean_steps']:.2f}, "
            f"peak prompt tokens {shop['peak_prompt_tokens']['mean']:.0f} "
            f"(episodes of >= 8 steps: "
            f"{'none' if long is None else format(long['mean'], '.0f')})"
        )
    print(f"predictions and summary.json in {args.out}", file=sys.stderr)
    return 0


def _shop_tasks(
    args: argparse.Namespace, closing: contextlib.ExitStack
) -> tuple[str, list[Any], Any, dict[str, Any]]:
    """``eval --env shop`` or ``webshop``: the dataset's name, its tasks, the environment
    they act in, and the settings that name them; a server's connections close with
    ``closing``."""
    from memsearcher.agent.tasks import command_line_shop

    tasks, environment = command_line_shop(args, args.split)
    closing.callback(environment.close)
    if args.env == "webshop":
        where = {"webshop": {"url": args.webshop_url, "sessions": args.sessions}}
        return "webshop", tasks, environment, where
    sizes = {} if args.shop_families is None else {"families_per_category": args.shop_families}
    where = {"shop": {"seed": args.shop_seed, **sizes, "split": args.split}}
    return f"shop-{args.split}", tasks, environment, where


def run_report_command(args: argparse.Namespace) -> int:
    from memsearcher.eval.report import (
        draw_objective_plots,
        draw_token_plots,
        format_table,
        load_rows,
    )

    rows = load_rows(args.runs)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(rows))
    if not args.no_plots:
        for path in draw_token_plots(rows, args.plots) + draw_objective_plots(rows, args.plots):
            print(f"plot: {path}", file=sys.stderr)
    if args.html:
        from memsearcher.eval.html import write_html

        page = write_html(rows, args.runs, args.html, plots=not args.no_plots)
        print(f"html: {page} ({page.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


def _eval_config(args: argparse.Namespace, **settings: Any) -> EvalConfig:
    """The run's `EvalConfig` from the shared flags and ``settings``, its sampling settings
    checked before anything is loaded."""
    from memsearcher.errors import MemSearcherError
    from memsearcher.eval.run import EvalConfig

    try:
        config = EvalConfig(
            agent=args.agent,
            agent_config=agent_config_from(args),
            temperature=args.temperature,
            seed=args.seed,
            batch_size=args.batch_size,
            **settings,
        )
        config.sampling  # noqa: B018  # validates the sampling settings
    except ValueError as error:
        raise MemSearcherError(str(error)) from error
    return config
