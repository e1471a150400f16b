"""A scripted policy short enough for a tiny model to learn in a few dozen SFT steps."""

from __future__ import annotations

from memsearcher.llm.base import SamplingParams
from memsearcher.llm.scripted import Reply

CALL = '{"name": "wikipedia_search", "arguments": {"query": "landmarks of the city"}}'


def search_once_then_answer(answer: str) -> Reply:
    """Search once with a fixed query, keep a fixed memory, then answer ``answer``."""

    def reply(prompt: str, params: SamplingParams) -> str:
        if "</memory>" in params.stop:
            return "<memory> noted </memory>"
        if "<memory> noted </memory>" in prompt:
            return f"<think> done </think>\n\\boxed{{{answer}}}"
        return f"<think> search </think>\n<tool_call>{CALL}</tool_call>"

    return reply
