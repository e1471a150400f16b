"""A deterministic policy that speaks the agent protocol, for `ScriptedLLM`.

It searches a fixed number of times, keeps a growing note of what it read as its memory, then
answers. Benchmarks use it to reach many turns (the untrained 135M model rarely gets past the
first), and tests use it to exercise turn limits and memory caps. It reads only the prompt text,
so the same policy drives MemSearcher and ReAct; for MEM1 (asked to stop at ``</search>``) the
note is its internal state ``<think>``, and the action is a ``<search>`` or an ``<answer>``.
"""

from __future__ import annotations

import json
import re

from memsearcher.agent.base import MEMORY_STOP
from memsearcher.agent.prompts import TOOL_NAME
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.scripted import Reply

_SEARCHES_SO_FAR = re.compile(r"Searches so far: (\d+)\.")
_MEMORY = re.compile(r"</question>\n\n<memory> (.*?) </memory>", re.DOTALL)
_QUESTION = re.compile(r"<question> (.*?) </question>", re.DOTALL)
_FIRST_DOC = re.compile(r"Doc 1 \(Title: [^)]*\) ([^\n]*)")
_MEM1_STATE = re.compile(r"<think> Searches so far: (\d+)\. (.*?) </think>", re.DOTALL)
_MEM1_QUESTIONS = re.compile(r"Questions: (.*?)(?:<\|im_end\|>|\n)")


def search_then_answer(searches: int, answer: str, memory_words: int = 300) -> Reply:
    """Search ``searches`` times (query ``<question> part k``), then answer ``answer``.

    Each memory update appends the first 25 words of the top hit to the memory, dropping the
    oldest words past ``memory_words``.
    """

    def reply(prompt: str, params: SamplingParams) -> str:
        if "</search>" in params.stop:
            return _mem1_step(prompt, searches, answer, memory_words)
        if MEMORY_STOP[0] in params.stop:
            return _memory_update(prompt, memory_words)
        done = max(_searches_in_memory(prompt), prompt.count("Doc 1 (Title:"))
        if done >= searches:
            return f"<think> I have read enough. </think>\nThe answer is \\boxed{{{answer}}}"
        question = _QUESTION.findall(prompt)[-1] if _QUESTION.search(prompt) else ""
        call = {"name": TOOL_NAME, "arguments": {"query": f"{question} part {done + 1}"}}
        return (
            f"<think> Search {done + 1} of {searches}. </think>\n"
            f"<tool_call>{json.dumps(call)}</tool_call>"
        )

    return reply


def _searches_in_memory(prompt: str) -> int:
    found = _SEARCHES_SO_FAR.findall(prompt)
    return int(found[-1]) if found else 0


def _memory_update(prompt: str, memory_words: int) -> str:
    memories = _MEMORY.findall(prompt)
    previous = _SEARCHES_SO_FAR.sub("", memories[-1]).split() if memories else []
    docs = _FIRST_DOC.findall(prompt)
    fact = docs[-1].split()[:25] if docs else []
    words = (previous + fact)[-memory_words:]
    count = _searches_in_memory(prompt) + 1
    return f"<memory> Searches so far: {count}. {' '.join(words)} </memory>"


def _mem1_step(prompt: str, searches: int, answer: str, memory_words: int) -> str:
    """MEM1: the internal state counts the searches and keeps the same note as the memory."""
    states = _MEM1_STATE.findall(prompt)
    done, previous = (int(states[-1][0]), states[-1][1].split()) if states else (0, [])
    docs = _FIRST_DOC.findall(prompt)
    fact = docs[-1].split()[:25] if docs and states else []
    note = " ".join((previous + fact)[-memory_words:])
    if done >= searches:
        return f"<think> Searches so far: {done}. {note} </think>\n<answer> {answer} </answer>"
    found = _MEM1_QUESTIONS.findall(prompt)
    question = found[-1].strip() if found else ""
    return (
        f"<think> Searches so far: {done + 1}. {note} </think>\n"
        f"<search> {question} part {done + 1} </search>"
    )
