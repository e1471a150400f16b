"""`memsearcher ask`: one question, shown turn by turn."""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import TextIO

from memsearcher.agent.options import add_agent_arguments
from memsearcher.llm.options import add_model_arguments
from memsearcher.types import Trajectory, Turn


def add_ask_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "ask",
        help="answer one question with the agent, showing each turn",
        description="Answer one question, showing each turn: the thought, the query, the hits, "
        "the rewritten memory and the context size.",
    )
    parser.add_argument("question")
    parser.add_argument(
        "--retriever", default=None, help="index folder or http(s) URL (default: embedded BM25)"
    )
    add_agent_arguments(parser, max_turns=5)
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the trajectory as JSON")
    parser.set_defaults(func=run_ask)


def run_ask(args: argparse.Namespace) -> int:
    import sys

    from memsearcher.agent import load_templates, run_lockstep, start_episodes
    from memsearcher.agent.options import agent_config_from, sampling_from
    from memsearcher.errors import MemSearcherError
    from memsearcher.llm.options import open_llm
    from memsearcher.retrieval import open_retriever
    from memsearcher.text import sanitize_text
    from memsearcher.types import QAExample

    if not args.question.strip():
        raise MemSearcherError("the question is empty")
    config = agent_config_from(args)  # bad options fail before the model loads
    sampling = sampling_from(args)
    templates = load_templates(args.templates)
    retriever = open_retriever(args.retriever)
    llm = open_llm(args)
    # argv bytes that are not UTF-8 arrive as lone surrogates (Python's surrogateescape)
    question = sanitize_text(args.question.strip())
    example = QAExample(id="ask", question=question, golden_answers=())
    episodes = start_episodes(
        args.agent, [example], llm.tokenizer, config, templates, llm.max_context_tokens
    )
    out = sys.stdout
    on_turn = None if args.json else (lambda _, turn: print_turn(turn, out))
    (trajectory,) = run_lockstep(episodes, llm, retriever, sampling, on_turn=on_turn)
    if args.json:
        json.dump(trajectory.to_dict(), out, ensure_ascii=False)
        out.write("\n")
    else:
        print_outcome(trajectory, out)
    return 0


def _block(label: str, text: str, width: int = 100) -> str:
    body = textwrap.shorten(" ".join(text.split()), width=600, placeholder=" ...") or "(empty)"
    lines = textwrap.wrap(body, width=width - 12) or [""]
    return "\n".join(f"  {label if i == 0 else '':<9} {line}" for i, line in enumerate(lines))


def print_turn(turn: Turn, out: TextIO) -> None:
    print(
        f"Turn {turn.index + 1}  (context {turn.prompt_tokens} tokens, "
        f"generated {turn.generated_tokens})",
        file=out,
    )
    if turn.repeated_query is not None:
        repeated = f"{turn.repeated_query} (searched before: answer asked for)"
        print(_block("repeated", repeated), file=out)
    if turn.thought is not None:
        print(_block("think", turn.thought), file=out)
    if turn.query is not None:
        print(_block("search", turn.query), file=out)
        titles = " | ".join(hit.title for hit in turn.hits) or "(no hits)"
        print(_block("hits", titles), file=out)
    if turn.memory_text is not None and turn.error is None:
        print(_block("memory", turn.memory or ""), file=out)
    if turn.error is not None:
        print(_block("wrote", turn.memory_text or turn.action_text), file=out)
        print(_block("error", turn.error), file=out)
    out.flush()


def print_outcome(trajectory: Trajectory, out: TextIO) -> None:
    if trajectory.answer is not None:
        print(f"Answer: {trajectory.answer}", file=out)
    else:
        reason = trajectory.end_reason.replace("_", " ")
        detail = f": {trajectory.error}" if trajectory.error else ""
        print(f"No answer ({reason}{detail})", file=out)
