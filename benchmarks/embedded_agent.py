"""The embedded agent on held-out Wikipedia questions: the packaged models side by side.

MemSearcher and ReAct answer the held-out questions of benchmarks/data/embedded-wiki-questions.jsonl
(written by hand about entities of the embedded Wikipedia, answers copyable from the passages,
never trained on: tests/test_embedded_agent.py checks) with ``embedded`` (SmolLM2-135M with the
recipe's SFT, turn-1 and GRPO adapters merged: the default), ``embedded-protocol`` (the protocol
adapter, the default until 2026-12-07) and ``embedded-base`` (the raw model), greedy, on the
embedded BM25 index. It prints EM, F1, the format-failure rate, searches per question, the
share of questions with at least one search, the mean context per turn and the seconds of each
run, and writes the same as JSON.

    python benchmarks/embedded_agent.py [--questions 58] [--models embedded embedded-protocol]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from memsearcher.agent import AgentConfig
from memsearcher.data.flashrag import read_examples
from memsearcher.eval.predictions import read_predictions
from memsearcher.eval.run import EvalConfig, run_eval
from memsearcher.llm import load_llm
from memsearcher.retrieval import open_retriever

HELDOUT = Path(__file__).parent / "data" / "embedded-wiki-questions.jsonl"
MODELS = ("embedded", "embedded-protocol", "embedded-base")
AGENTS = ("memsearcher", "react")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=0, help="first N questions (0: all)")
    parser.add_argument("--out", default="runs/bench-embedded-agent")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--memory-tokens", type=int, default=96)
    parser.add_argument("--top-n", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args()

    examples = read_examples(HELDOUT)
    if args.questions:
        examples = examples[: args.questions]
    retriever = open_retriever(None)
    rows = []
    for model in args.models:
        llm = load_llm(model, device="cpu", batch_size=len(examples))
        for agent in AGENTS:
            budgets = AgentConfig(
                max_turns=args.max_turns,
                max_new_tokens=args.max_new_tokens,
                memory_tokens=args.memory_tokens,
                top_n=args.top_n,
                max_top_n=max(args.top_n, AgentConfig.max_top_n),
            )
            config = EvalConfig(agent, budgets, batch_size=len(examples))
            out = Path(args.out) / f"{model}-{agent}"
            started = time.perf_counter()
            summary = run_eval({"heldout": examples}, llm, retriever, config, out, progress=False)
            seconds = time.perf_counter() - started
            rows.append(_row(model, agent, summary["datasets"]["heldout"], out, seconds))
            print(_line(rows[-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(rows, indent=2) + "\n", "utf-8")
    print(f"\n{len(examples)} held-out questions; results in {args.out}/results.json")


def _row(model: str, agent: str, summary: dict[str, Any], out: Path, seconds: float) -> dict:
    records = list(read_predictions(out / "heldout" / "predictions.jsonl"))
    return {
        "model": model,
        "agent": agent,
        "questions": len(records),
        "em": summary["em"],
        "f1": summary["f1"],
        "format_failure_rate": summary["format_failure_rate"],
        "searches_per_question": summary["searches_per_question"],
        "searched_share": sum(r["searches"] > 0 for r in records) / max(len(records), 1),
        "end_reasons": summary.get("end_reasons"),
        "mean_context_tokens": summary["prompt_tokens_per_turn"]["mean"],
        "seconds": round(seconds, 1),
    }


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['model']:<14} {row['agent']:<12} EM {row['em']:.3f}  F1 {row['f1']:.3f}  "
        f"format failures {row['format_failure_rate']:.1%}  searches/q "
        f"{row['searches_per_question']:.2f}  >=1 search {row['searched_share']:.1%}  "
        f"context/turn {row['mean_context_tokens']:.0f}  ({row['seconds']} s)"
    )


if __name__ == "__main__":
    main()
