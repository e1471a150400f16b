"""A scripted policy short enough for a tiny model to learn in a few dozen SFT steps."""

from __future__ import annotations

from memsearcher.llm.base import SamplingParams
from memsearcher.llm.scripted import Reply

QUERY = "landmarks of the city"
CALL = f'{{"name": "wikipedia_search", "arguments": {{"query": "{QUERY}"}}}}'


def search_once_then_answer(answer: str) -> Reply:
    """Search once with a fixed query, then answer ``answer``, in the protocol of the agent
    asking: MEM1's when ``</search>`` is among the stops, else MemSearcher's (which keeps a
    fixed memory) and ReAct's. A turn after the search sees the query (MEM1's previous
    response, ReAct's conversation) or the memory (MemSearcher's)."""

    def reply(prompt: str, params: SamplingParams) -> str:
        if "</memory>" in params.stop:
            return "<memory> noted </memory>"
        searched = QUERY in prompt or "<memory> noted </memory>" in prompt
        if "</search>" in params.stop:
            if searched:
                return f"<think> done </think>\n<answer> {answer} </answer>"
            return f"<think> search </think>\n<search> {QUERY} </search>"
        if searched:
            return f"<think> done </think>\n\\boxed{{{answer}}}"
        return f"<think> search </think>\n<tool_call>{CALL}</tool_call>"

    return reply
