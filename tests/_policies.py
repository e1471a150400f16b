"""Scripted policies: one short enough for a tiny model to learn in a few dozen SFT steps,
and a shopper that plays given plans in any agent's shop protocol."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from memsearcher.agent.environments.shop import SEP
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


def follow_plans(plans: Mapping[str, Sequence[str]]) -> Reply:
    """Take the actions of the plan of the instruction on the page, keyed by its text, in the
    shop protocol of any agent: each thought says the step it takes (``<think> step N``), which
    MEM1's last response and ReAct's conversation show again, and MemSearcher's memory counts
    the steps done (``<memory> step N``)."""
    instruction = re.compile("Instruction:" + re.escape(SEP) + "(.*?)" + re.escape(SEP))

    def reply(prompt: str, params: SamplingParams) -> str:
        known = re.findall(r"<(memory|think)> step (\d+)", prompt)
        done = int(known[-1][1]) + (known[-1][0] == "think") if known else 0
        if "</memory>" in params.stop:
            return f"<memory> step {done} </memory>"
        plan = plans[instruction.findall(prompt)[0]]
        return f"<think> step {done} </think>\n<action> {plan[done]} </action>"

    return reply
