"""What an agent did on the synthetic world, read from its evaluation records.

EM says whether the answer was right; these say how the agent got there, so the demo's report
can show what GRPO changed: whether it answers before the chain is complete, copies the
question's entity into its first query, searches once per hop, and keeps the facts it has read
in its memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from memsearcher.data.synthetic import hops_of

__all__ = ["BEHAVIOURS", "behaviour"]

BEHAVIOURS = {
    "early_answers": "answers given after fewer searches than the chain has hops",
    "first_query_copied": "first query is exactly the question's entity",
    "searches_per_hop": "searches made per hop of the chain",
    "memory_complete": "memories that keep every chain fact read so far (MemSearcher)",
}
"""The behaviour metrics, by key, with what each one counts."""


def behaviour(records: Iterable[dict[str, Any]]) -> dict[str, float | None]:
    """The `BEHAVIOURS` over evaluation records (``predictions.jsonl`` rows, which carry the
    trajectory and the question's hop chain); ``memory_complete`` is None for an agent without
    a memory."""
    answered = early = copied = searches = hops_total = kept = memories = questions = 0
    for record in records:
        trajectory = record["trajectory"]
        hops = hops_of(trajectory["example"]["metadata"])
        turns = trajectory["turns"]
        queries = [t["query"] for t in turns if t.get("query")]
        questions += 1
        hops_total += len(hops)
        searches += len(queries)
        copied += bool(queries) and queries[0] == hops[0].entity
        if record.get("prediction") is not None:
            answered += 1
            early += len(queries) < len(hops)
        evidence = ""
        for turn in turns:
            evidence += " ".join(hit["text"] for hit in turn.get("hits", ()))
            if turn.get("memory_text") is None or turn.get("memory") is None:
                continue
            facts = [hop.fact for hop in hops if hop.fact in evidence]
            memories += 1
            kept += all(fact in turn["memory"] for fact in facts)
    return {
        "early_answers": early / max(answered, 1),
        "first_query_copied": copied / max(questions, 1),
        "searches_per_hop": searches / max(hops_total, 1),
        "memory_complete": kept / memories if memories else None,
    }
