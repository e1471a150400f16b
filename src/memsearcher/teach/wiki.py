"""Questions read off the embedded Wikipedia, the held-out filter, and the Wikipedia oracle.

Question/answer pairs are read off a passage's own sentences by a few patterns ("X is the
capital of Y." -> "Of which country is X the capital?", Y). The oracle searches X's name, keeps
the sentence that holds the answer as its memory, and answers with the words of that sentence.
Passages whose titles the held-out benchmark asks about are never used for questions here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memsearcher.agent.base import MEMORY_STOP
from memsearcher.agent.prompts import TOOL_NAME
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.scripted import Reply
from memsearcher.types import QAExample

__all__ = [
    "SENTENCE",
    "WikiQuestion",
    "overlaps_heldout",
    "read_heldout",
    "wiki_oracle",
    "wiki_questions",
]

_DEMONYMS = (
    "American|English|British|French|German|Italian|Japanese|Canadian|Australian|Russian|"
    "Spanish|Chinese|Indian|Dutch|Swedish|Scottish|Irish|Greek|Polish|Austrian|Swiss|Brazilian|"
    "Mexican|Norwegian|Danish|Belgian|Korean|South Korean|Argentine|Portuguese|Hungarian|Czech|"
    "Finnish|Welsh|Israeli|Egyptian|Turkish|Iranian|Persian|Roman|Ancient Greek|Soviet"
)
_NAME = r"([A-Z][\w'.-]+(?: (?:de |von |van |da )?[A-Z][\w'.-]+){0,3})"
_VERBS = {
    "written": "Who wrote {x}?",
    "composed": "Who composed {x}?",
    "directed": "Who directed {x}?",
    "painted": "Who painted {x}?",
    "designed": "Who designed {x}?",
    "invented": "Who invented {x}?",
    "founded": "Who founded {x}?",
}

# (kind, pattern over one sentence that names the entity, question template); group 1 or the
# named group "answer" is the answer, copied as it is written.
_PATTERNS: list[tuple[str, re.Pattern[str], Callable[[re.Match[str]], str]]] = [
    (
        "nationality",
        re.compile(rf"^[^.]*? (?:is|was) an? (?P<answer>{_DEMONYMS}) [a-z]"),
        lambda m: "What nationality is {x}?",
    ),
    (
        "capital_of",
        re.compile(
            r"(?:is|was) the capital(?: and (?:the )?largest city)? of "
            r"(?P<answer>[A-Z][\w'-]+(?: [A-Z][\w'-]+){0,2})[,.]"
        ),
        lambda m: "Of which country or region is {x} the capital?",
    ),
    (
        "its_capital",
        re.compile(
            r"[Ii]ts capital(?: and largest city)? is " + _NAME.replace("(", "(?P<answer>", 1)
        ),
        lambda m: "What is the capital of {x}?",
    ),
    (
        "founded_year",
        re.compile(r"(?P<verb>founded|established) in (?P<answer>\d{4})"),
        lambda m: "In what year was {x} " + m.group("verb") + "?",
    ),
    (
        "made_by",
        re.compile(
            r"(?P<verb>" + "|".join(_VERBS) + r") by " + _NAME.replace("(", "(?P<answer>", 1)
        ),
        lambda m: _VERBS[m.group("verb")],
    ),
    (
        "located_in",
        re.compile(
            r"(?:is|was) an? (?:[a-z]+ )?(?:city|town|village|river|lake|mountain|island|"
            r"province|state|municipality|port) (?:[a-z]+ )*?in (?:the )?"
            r"(?P<answer>[A-Z][\w'-]+(?: [A-Z][\w'-]+){0,2})[,.]"
        ),
        lambda m: "Where is {x}?",
    ),
]
SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


@dataclass(frozen=True)
class WikiQuestion:
    """A question read off one passage: its title, the sentence holding the answer."""

    title: str
    entity: str
    kind: str
    question: str
    answer: str
    sentence: str

    def to_example(self) -> QAExample:
        metadata = {"title": self.title, "entity": self.entity, "kind": self.kind,
                    "sentence": self.sentence}  # fmt: skip
        return QAExample(f"wiki-{self.kind}-{self.title}", self.question, (self.answer,), metadata)


def wiki_questions(passages: Sequence[tuple[str, str]], exclude: set[str]) -> list[WikiQuestion]:
    """Every question the patterns read off ``passages`` (title, text), at most one per
    passage and kind, skipping titles in ``exclude``."""
    out = []
    for title, text in passages:
        if title in exclude:
            continue
        entity = re.sub(r"\s*\(.*\)$", "", title).strip()
        if len(entity) < 3:
            continue
        for kind, pattern, template in _PATTERNS:
            for sentence in SENTENCE.split(text)[:4]:
                match = pattern.search(sentence)
                if match is None or len(sentence.split()) > 60:
                    continue
                answer = match.group("answer").strip().rstrip(".,")
                if (
                    answer in entity
                    or entity in answer
                    or re.fullmatch(_DEMONYMS, answer)
                    and (kind == "made_by")
                ):
                    continue
                question = template(match).format(x=entity)
                out.append(WikiQuestion(title, entity, kind, question, answer, sentence.strip()))
                break
    return out


def read_heldout(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a held-out FlashRAG file (each with ``metadata.title``)."""
    with Path(path).open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def overlaps_heldout(heldout: Sequence[dict[str, Any]]) -> Callable[[WikiQuestion], bool]:
    """Whether a question touches one of the ``heldout`` rows: the same text, the same passage,
    or a held-out passage's subject as its entity or answer (so "What is the capital of
    Norway?" is not trained when "Of which country is Oslo the capital?" is held out)."""
    texts = {row["question"] for row in heldout}
    titles = {row["metadata"]["title"] for row in heldout}
    subjects = titles | {re.sub(r"\s*\(.*\)$", "", title) for title in titles}

    def overlaps(question: WikiQuestion) -> bool:
        return (
            question.question in texts
            or question.title in titles
            or question.entity in subjects
            or question.answer in subjects
        )

    return overlaps


def wiki_oracle(questions: Sequence[WikiQuestion]) -> Reply:
    """The ideal agent for ``questions``: search the entity; keep the answer's sentence as the
    memory once a passage that holds it has come back; then answer with the answer's words.
    Like the synthetic oracle, it reads the prompt only, never the gold answer directly: an
    answer is written only when its sentence is in the memory or the tool responses."""
    by_question = {q.question: q for q in questions}
    tagged = re.compile(r"<question> (.*?) </question>", re.DOTALL)

    def reply(prompt: str, params: SamplingParams) -> str:
        question = by_question[tagged.findall(prompt)[-1]]
        evidence = prompt[prompt.rindex("</question>") :]
        found = question.sentence in evidence
        if MEMORY_STOP[0] in params.stop:
            return f"<memory> {question.sentence if found else ''} </memory>"
        if found:
            return (
                f"<think> I know the answer. </think>\nThe answer is \\boxed{{{question.answer}}}"
            )
        call = {"name": TOOL_NAME, "arguments": {"query": question.entity}}
        return (
            f"<think> I need to look up {question.entity}. </think>\n"
            f"<tool_call>{json.dumps(call, ensure_ascii=False)}</tool_call>"
        )

    return reply
