"""The demo's prompts, and the text its tokenizer is trained on."""

from __future__ import annotations

from memsearcher.data.synthetic import World
from memsearcher.teach.oracle import protocol_texts

__all__ = ["DEMO_MEM1_TEMPLATES", "DEMO_TEMPLATES", "tokenizer_texts"]

DEMO_TEMPLATES = {
    "memsearcher_system": (
        "Answer the question. Think in <think> </think>, then search with <tool_call> "
        "</tool_call> or answer with \\boxed{{}}. After a search, rewrite your memory in "
        "<memory> </memory>."
    ),
    "memsearcher_tool_response": "<tool_response>\n{passages}\n</tool_response>\nUpdate memory.",
    "react_system": (
        "Answer the question. Think in <think> </think>, then search with <tool_call> "
        "</tool_call> or answer with \\boxed{{}}."
    ),
}
"""Short prompts for the demo's small model (the protocol's tags, fewer instruction words)."""

DEMO_MEM1_TEMPLATES = {
    "mem1_user": (
        "Answer the questions. Think in <think> </think> and keep there every fact found so "
        "far, then search with <search> </search> or answer with <answer> </answer>, the "
        "answers separated by ;. Questions: {questions}"
    ),
    "multi_question": "Answer all {count}, separated by ; in one \\boxed{{}}: {questions}",
}
"""The demo's short MEM1 prompt and multi-objective instruction, for runs of all three agents
on multi-objective tasks (``benchmarks/mem1_objectives.py``); the demo pipeline itself trains
MemSearcher and ReAct on single questions with `DEMO_TEMPLATES` alone."""


def tokenizer_texts(world: World) -> list[str]:
    """Everything the demo model will read or write in ``world``: its passages and questions,
    the oracle's protocol phrases and the demo's prompts (the BPE tokenizer's training text)."""
    texts = [text for _, text in world.passages] + [q.question for q in world.questions]
    texts += protocol_texts([q.to_example() for q in world.questions])
    return texts + list(DEMO_TEMPLATES.values())
