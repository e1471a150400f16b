"""The oracle: ideal trajectories in the exact agent protocol, for SFT on the synthetic world.

It is a `ScriptedLLM` reply function, so trajectories come out of the real agents, the real
tokenizer and the real retriever, with every mask and chat-template token as in training. It
knows each question's chain of relations, never its answer: at each turn it reads, from the
passages the retriever actually returned, the fact sentences that follow the chain from the
question's entity ("X was written by Y.", then "Y was born in Z."). A hop whose passage was not
retrieved stays unknown, so the oracle scores EM 1.0 only if every hop is retrievable at the
top-n it runs with: that is what the tests check.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from memsearcher.agent.base import MEMORY_STOP
from memsearcher.agent.prompts import TOOL_NAME
from memsearcher.data.synthetic import RELATIONS, World, hops_of
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.scripted import Reply
from memsearcher.types import QAExample

__all__ = ["DEMO_TEMPLATES", "oracle_policy", "protocol_texts", "read_chain", "tokenizer_texts"]

_QUESTION = re.compile(r"<question> (.*?) </question>", re.DOTALL)

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


def read_chain(entity: str, relations: Sequence[str], evidence: str) -> list[tuple[str, str]]:
    """Follow ``relations`` from ``entity`` through the fact sentences found in ``evidence``.

    Returns (fact sentence, object) for each hop found, stopping at the first missing one.
    """
    found = []
    for relation in relations:
        subject, tail = RELATIONS[relation].split("{subject}")[1].split("{object}")
        pattern = rf"(?<![\w-]){re.escape(entity)}{re.escape(subject)}([^.\n]+?){re.escape(tail)}"
        match = re.search(pattern, evidence)
        if match is None:
            break
        entity = match.group(1)
        found.append((match.group(0), entity))
    return found


def oracle_policy(examples: Sequence[QAExample]) -> Reply:
    """Reply as the ideal agent for the synthetic ``examples`` (their metadata holds the hops).

    Act: search the first entity of the chain not yet resolved, or answer once all are.
    Memory update: the fact sentences of the chain read so far, nothing else.
    """
    chains = {e.question: hops_of(e.metadata) for e in examples}

    def reply(prompt: str, params: SamplingParams) -> str:
        questions = _QUESTION.findall(prompt)
        hops = chains[questions[-1]]
        evidence = prompt[prompt.rindex("<question>") :]
        found = read_chain(hops[0].entity, [h.relation for h in hops], evidence)
        if MEMORY_STOP[0] in params.stop:
            return f"<memory> {' '.join(fact for fact, _ in found)} </memory>"
        if len(found) == len(hops):
            return _answer(found[-1][1])
        return _act(found[-1][1] if found else hops[0].entity)

    return reply


def _act(entity: str) -> str:
    call = {"name": TOOL_NAME, "arguments": {"query": entity}}
    return (
        f"<think> I need to look up {entity}. </think>\n<tool_call>{json.dumps(call)}</tool_call>"
    )


def _answer(answer: str) -> str:
    return f"<think> I know the answer. </think>\nThe answer is \\boxed{{{answer}}}"


def protocol_texts(examples: Sequence[QAExample]) -> list[str]:
    """What the oracle writes for ``examples`` along their gold chains: tokenizer training text,
    so that the protocol's tags and phrases become a few tokens each."""
    texts = []
    for example in examples:
        hops = hops_of(example.metadata)
        facts = []
        for number, hop in enumerate(hops, start=1):
            facts.append(hop.fact)
            texts += [_act(hop.entity), f"<memory> {' '.join(facts)} </memory>"]
            texts.append(f"Doc {number} (Title: {hop.entity}) {hop.fact}")
        texts.append(_answer(hops[-1].target))
    return texts


def tokenizer_texts(world: World) -> list[str]:
    """Everything the demo model will read or write in ``world``: its passages and questions,
    the oracle's protocol phrases and the demo's prompts (the BPE tokenizer's training text)."""
    texts = [text for _, text in world.passages] + [q.question for q in world.questions]
    texts += protocol_texts([q.to_example() for q in world.questions])
    return texts + list(DEMO_TEMPLATES.values())
