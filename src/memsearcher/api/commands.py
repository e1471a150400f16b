"""``memsearcher serve``: the agent behind an HTTP API. Heavy imports stay in the handler."""

from __future__ import annotations

import argparse

from memsearcher.agent.options import add_agent_arguments
from memsearcher.llm.options import add_model_arguments, open_llm
from memsearcher.retrieval.commands import add_http_arguments, timeouts_from


def add_serve_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="answer questions with the agent over HTTP (POST /v1/answer)",
        description="Serve the search agent: POST /v1/answer returns the answer and the "
        "trajectory; POST /v1/chat/completions answers the last user message; GET / is a "
        "trajectory viewer to open in a browser.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--index", default=None, help="index folder (default: embedded BM25)")
    where.add_argument("--retriever", default=None, help="retrieval server URL or index folder")
    parser.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--max-pending", type=int, default=64, help="more get 503")
    parser.add_argument("--max-batch", type=int, default=16, help="questions per batch")
    parser.add_argument("--name", default="memsearcher", help="model name in the API")
    add_agent_arguments(parser)  # --max-turns is the default and the upper bound
    add_model_arguments(parser)
    add_http_arguments(parser)
    parser.set_defaults(func=run_serve)


def build_service(args: argparse.Namespace) -> tuple[object, str]:
    """The app the options describe, and the name it serves under."""
    from memsearcher.agent import load_templates
    from memsearcher.agent.options import agent_config_from, sampling_from
    from memsearcher.api.app import AgentService, ServeConfig, create_app
    from memsearcher.errors import MemSearcherError
    from memsearcher.retrieval import open_retriever
    from memsearcher.serving import allowed_hosts

    agent_config = agent_config_from(args)  # bad options fail before the model loads
    sampling = sampling_from(args)
    try:
        config = ServeConfig(
            max_turns=args.max_turns, max_pending=args.max_pending, max_batch=args.max_batch
        )
    except ValueError as error:
        raise MemSearcherError(str(error)) from error
    templates = load_templates(args.templates)
    retriever = open_retriever(args.index or args.retriever)
    llm = open_llm(args)
    service = AgentService(llm, retriever, args.agent, agent_config, sampling, config, templates)
    return create_app(service, args.name, allowed_hosts(args.host), args.docs), args.name


def run_serve(args: argparse.Namespace) -> int:
    from memsearcher.serving import run_server

    timeouts = timeouts_from(args)
    app, _ = build_service(args)
    # one process: the model lives in it, and the service batches the requests itself
    run_server(app, args.host, args.port, timeouts, log_level="info", access_log=False)
    return 0
