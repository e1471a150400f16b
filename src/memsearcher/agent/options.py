"""The agent's command-line options, declared once for every command that runs the agent
(``eval``, ``ask``, ``serve``), and the `AgentConfig` and sampling they describe."""

from __future__ import annotations

import argparse

from memsearcher.agent import AGENTS, AgentConfig, agent_type
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import SamplingParams


def add_agent_arguments(parser: argparse.ArgumentParser, max_turns: int = 20) -> None:
    """``--agent``, the budgets, sampling and ``--templates``; ``max_turns``: this command's
    default (``ask`` shows a short episode, ``serve`` takes it as the upper bound too)."""
    group = parser.add_argument_group("agent")
    group.add_argument(
        "--agent",
        default="memsearcher",
        help="memsearcher (default), react or mem1: a key of memsearcher.agent.AGENTS",
    )
    group.add_argument("--max-turns", type=int, default=max_turns, help=f"default: {max_turns}")
    group.add_argument("--memory-tokens", type=int, default=1024)
    group.add_argument("--max-new-tokens", type=int, default=512)
    group.add_argument("--top-n", type=int, default=5)
    group.add_argument(
        "--answer-on-repeat",
        action="store_true",
        help="a query searched already is not searched again: the model is asked for its "
        "answer (memsearcher and react; a greedy loop on one query ends there)",
    )
    group.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--templates", default=None, help="YAML/JSON file overriding prompts")


def agent_config_from(args: argparse.Namespace) -> AgentConfig:
    """The `AgentConfig` of the options; an unknown agent or a bad budget is refused here,
    before any model loads."""
    if args.answer_on_repeat and not agent_type(args.agent).answers_on_repeat:
        honoured = " and ".join(name for name, cls in AGENTS.items() if cls.answers_on_repeat)
        raise MemSearcherError(f"--answer-on-repeat is for {honoured}, not {args.agent}")
    agent_type(args.agent)
    try:
        return AgentConfig(
            max_turns=args.max_turns,
            memory_tokens=args.memory_tokens,
            max_new_tokens=args.max_new_tokens,
            top_n=args.top_n,
            max_top_n=max(args.top_n, AgentConfig.max_top_n),
            answer_on_repeat=args.answer_on_repeat,
        )
    except ValueError as error:
        raise MemSearcherError(str(error)) from error


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(temperature=args.temperature, seed=args.seed)
    except ValueError as error:
        raise MemSearcherError(str(error)) from error
