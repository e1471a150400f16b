"""The oracle: ideal trajectories in the exact agent protocol, for SFT on the synthetic world.

It is a `ScriptedLLM` reply function, so trajectories come out of the real agents, the real
tokenizer and the real retriever, with every mask and chat-template token as in training. It
knows each question's chain of relations, never its answer: at each turn it reads, from the
passages the retriever actually returned, the fact sentences that follow the chain from the
question's entity ("X was written by Y.", then "Y was born in Z."). A hop whose passage was not
retrieved stays unknown, so the oracle scores EM 1.0 only if every hop is retrievable at the
top-n it runs with: that is what the tests check.

It speaks all three protocols (MemSearcher, ReAct, and MEM1, whose internal state ``<think>``
carries the facts found so far), and answers multi-objective tasks
(`memsearcher.data.compose`): it follows each objective's chain in turn and answers all of them
at once, separated by ";".
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from memsearcher.agent.base import MEMORY_STOP
from memsearcher.agent.prompts import TOOL_NAME
from memsearcher.data.synthetic import RELATIONS, Hop, hops_of
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.scripted import Reply
from memsearcher.types import QAExample

__all__ = ["AGENTS", "TeacherFlaws", "oracle_policy", "protocol_texts", "read_chain"]

AGENTS = ("memsearcher", "react")
"""The agents whose trajectories the teachers write for SFT (MEM1's are written on demand)."""

_QUESTION = re.compile(r"<question> (.*?) </question>", re.DOTALL)


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


@dataclass(frozen=True)
class TeacherFlaws:
    """How an imperfect demonstrator departs from the ideal agent (every rate 0: the ideal one).

    The paper's SFT data comes from a teacher never optimized for the agent's role; the demo's
    analogue is this oracle with flaws that hold for any entity, so a policy that reward
    improves on one question improves on all. Each draw is fixed by (seed, question, hops read),
    so the same state always gets the same choice and a seed gives the same data.
    """

    early_answer: float = 0.0
    """Chance, at each turn where part of a chain is read but not all of it, of answering
    with the last entity read instead of searching on."""
    category_query: float = 0.0
    """Chance that the first search of a question asks for the answer's category ("nationality",
    "composer") instead of its entity, and the answer is then copied from what came back (the
    Wikipedia teacher, `memsearcher.teach.wiki`; the synthetic one has no categories)."""
    seed: int = 0
    """Seeds the draws."""

    def answers_early(self, question: str, hops_read: int) -> bool:
        if not self.early_answer or hops_read == 0:
            return False
        return random.Random(f"{self.seed}|{question}|{hops_read}").random() < self.early_answer

    def queries_category(self, question: str) -> bool:
        if not self.category_query:
            return False
        draw = random.Random(f"{self.seed}|{question}|category").random()
        return draw < self.category_query


def oracle_policy(examples: Sequence[QAExample], flaws: TeacherFlaws = TeacherFlaws()) -> Reply:
    """Reply as the ideal agent for the synthetic ``examples`` (their metadata holds the hops;
    a composed task's objectives hold theirs), with ``flaws`` if any.

    Act: search the first entity of the first chain not yet resolved, or answer once all are.
    Memory update (MemSearcher), or internal state (MEM1): the fact sentences of the chains
    read so far, nothing else.
    """
    tasks = {e.question: _chains(e) for e in examples}

    def reply(prompt: str, params: SamplingParams) -> str:
        question = _task(prompt, tasks)
        evidence = prompt[prompt.rindex(question) + len(question) :]
        found = [
            read_chain(h[0].entity, [hop.relation for hop in h], evidence) for h in tasks[question]
        ]
        facts = " ".join(fact for chain in found for fact, _ in chain)
        if MEMORY_STOP[0] in params.stop:
            return f"<memory> {facts} </memory>"
        pending = [(h, f) for h, f in zip(tasks[question], found, strict=True) if len(f) < len(h)]
        mem1 = "</search>" in params.stop
        if not pending:
            answer = "; ".join(chain[-1][1] for chain in found)
            return _mem1(facts, "answer", answer) if mem1 else _answer(answer)
        hops, chain = pending[0]
        if len(tasks[question]) == 1 and flaws.answers_early(question, len(chain)):
            return _answer(chain[-1][1])
        entity = chain[-1][1] if chain else hops[0].entity
        return _mem1(facts, "search", entity) if mem1 else _act(entity)

    return reply


def _chains(example: QAExample) -> list[tuple[Hop, ...]]:
    objectives = example.metadata.get("objectives")
    if objectives:
        return [hops_of(o.get("metadata", {})) for o in objectives]
    return [hops_of(example.metadata)]


def _task(prompt: str, tasks: dict[str, list[tuple[Hop, ...]]]) -> str:
    """The task whose question the prompt shows: the ``<question>`` text when it is one, else
    the longest known question in the prompt (MEM1's prompt, or a multi-objective wrapper)."""
    tagged = _QUESTION.findall(prompt)
    if tagged and tagged[-1] in tasks:
        return str(tagged[-1])
    return max((q for q in tasks if q in prompt), key=len)


def _mem1(facts: str, action: str, content: str) -> str:
    return f"<think> {facts or 'Nothing found yet.'} </think>\n<{action}> {content} </{action}>"


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
