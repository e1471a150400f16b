"""Prompt tokens per turn for MemSearcher and ReAct on the same questions.

How the agents are driven: the untrained 135M model seldom writes a valid tool call, so both
agents run with `ScriptedLLM` and the replay policy `search_then_answer` (7 searches, then an
answer at turn 8). Each memory update keeps the first 25 words of the top hit, up to
``--memory-words``. Everything measured is the agents' own context construction: the real
SmolLM2 chat template and tokenizer, the real templates, and real BM25 hits from the embedded
Wikipedia index.

    python benchmarks/context_growth.py [--questions 20] [--turns 8] [--memory-tokens 1024]
"""

from __future__ import annotations

import argparse
import statistics

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.replay import search_then_answer
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.embedded import embedded_model_path
from memsearcher.llm.hf import HFTokenizer
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval import embedded_corpus_path, load_embedded_retriever, read_corpus
from memsearcher.types import QAExample


def questions(count: int) -> list[QAExample]:
    """Questions about the first ``count`` articles of the embedded corpus."""
    examples = []
    for passage in read_corpus(embedded_corpus_path()):
        examples.append(QAExample(passage.id, f"What is {passage.title} known for?", ("x",)))
        if len(examples) == count:
            break
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--memory-tokens", type=int, default=1024)
    parser.add_argument("--memory-words", type=int, default=300)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(embedded_model_path()))
    retriever = load_embedded_retriever()
    llm = ScriptedLLM(
        tokenizer, search_then_answer(args.turns - 1, "x", args.memory_words), 1_000_000
    )
    config = AgentConfig(max_turns=args.turns, memory_tokens=args.memory_tokens)
    examples = questions(args.questions)

    per_turn: dict[str, list[float]] = {}
    for agent in ("memsearcher", "react"):
        episodes = start_episodes(agent, examples, tokenizer, config, None, 1_000_000)
        trajectories = run_lockstep(episodes, llm, retriever, SamplingParams())
        assert all(len(t.turns) == args.turns and t.end_reason == "answer" for t in trajectories)
        per_turn[agent] = [
            statistics.mean(t.turns[k].prompt_tokens for t in trajectories)
            for k in range(args.turns)
        ]

    first = per_turn["memsearcher"][0]  # template + question + empty memory
    print(f"prompt tokens per turn, mean over {len(examples)} questions (replay policy)")
    print(f"{'turn':>4} {'memsearcher':>12} {'react':>8} {'react/mem':>10}")
    for k in range(args.turns):
        mem, react = per_turn["memsearcher"][k], per_turn["react"][k]
        print(f"{k + 1:>4} {mem:>12.0f} {react:>8.0f} {react / mem:>10.2f}")
    print(
        f"total over {args.turns} turns: memsearcher {sum(per_turn['memsearcher']):.0f}, "
        f"react {sum(per_turn['react']):.0f}"
    )
    bound = first + args.memory_tokens
    peak = max(per_turn["memsearcher"])
    print(
        f"memsearcher bound (template + question + memory cap): {bound:.0f}; "
        f"peak {peak:.0f} -> {'within' if peak <= bound else 'EXCEEDS'}"
    )
    if args.turns >= 5:
        ratio = per_turn["react"][4] / per_turn["memsearcher"][4]
        print(f"ratio react/memsearcher at turn 5: {ratio:.2f}")


if __name__ == "__main__":
    main()
