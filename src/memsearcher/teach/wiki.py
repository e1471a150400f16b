"""Questions read off the embedded Wikipedia, with their chains of passages, and their teacher.

A fact is read off one sentence of a passage by a pattern ("X is the capital of Y." gives
capital_of: Y). A one-hop question asks for one fact of the passage's entity ("Of which country
or region is X the capital?"); a two-hop bridge question asks for a fact of the passage that
the first fact's object names ("Who wrote Hamlet?" -> William Shakespeare, whose passage says
he was English: "What nationality is the writer of Hamlet?"). Each question keeps its chain of
facts, so the teacher knows which sentence to look for at each hop and which words answer.

Splits go by the starting entity, and a train or rl question that shares a fact with a test
question's chain is dropped. Passages whose titles the held-out benchmark asks about are never
used.

The teacher (`wiki_oracle`) searches each hop's entity, keeps the sentences found as its
memory, and answers with the words of the last one, with the flaws it is given
(`TeacherFlaws`): answering a two-hop question after its first hop, and searching the answer's
category instead of the entity.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memsearcher.agent.base import MEMORY_STOP
from memsearcher.agent.prompts import TOOL_NAME
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.scripted import Reply
from memsearcher.teach.oracle import TeacherFlaws
from memsearcher.types import QAExample

__all__ = [
    "SENTENCE",
    "SPLITS",
    "WikiFact",
    "WikiQuestion",
    "entity_split",
    "overlaps_heldout",
    "read_heldout",
    "split_questions",
    "wiki_facts",
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
_MAKERS = {
    # verb: (question, the maker's noun in a bridge question, the answer's category)
    "written": ("Who wrote {x}?", "writer", "writer"),
    "composed": ("Who composed {x}?", "composer", "composer"),
    "directed": ("Who directed {x}?", "director", "film director"),
    "painted": ("Who painted {x}?", "painter", "painter"),
    "designed": ("Who designed {x}?", "designer", "architect"),
    "invented": ("Who invented {x}?", "inventor", "inventor"),
    "founded": ("Who founded {x}?", "founder", "founder"),
}
_WORKS = {
    # "X is a novel by Y": the work's noun gives the verb
    "novel": "written", "play": "written", "poem": "written", "book": "written",
    "tragedy": "written", "comedy": "written", "opera": "composed", "symphony": "composed",
    "ballet": "composed", "film": "directed", "painting": "painted",
}  # fmt: skip
_NOT_PLACE = re.compile(r"(?:North|South|East|West|Central)|[A-Z][a-z]*ern")
"""Compass words that a place pattern stops at in "Central, Eastern and Southern Europe"."""
_PLACE = r"(?P<answer>[A-Z][\w'-]+(?: (?:of )?[A-Z][\w'-]+){0,3})(?=[,.;]| region\b| and | \()"


@dataclass(frozen=True)
class WikiFact:
    """One fact of one passage: its entity's ``kind`` of relation to ``answer``, as one
    ``sentence`` of the passage says it."""

    title: str
    entity: str
    kind: str
    answer: str
    sentence: str
    verb: str = ""
    """made_by only: written, composed, ... (the question's verb)."""


_ANSWER_NAME = _NAME.replace("(", "(?P<answer>", 1)
PRONOUNS = frozenset({"It", "He", "She", "They", "This", "These", "That", "Those", "There"})
"""Capitalized words a name pattern matches at a sentence's start that name nothing:
"It is the capital and largest city of Catalonia." is no answer to "What is its capital?"."""

# (kind, pattern over one sentence that names the entity); the group "answer" is the answer,
# copied as it is written, and the group "verb" (made_by) or "work" its verb.
_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("nationality", re.compile(rf"^[^.]*? (?:is|was) an? (?P<answer>{_DEMONYMS}) [a-z]")),
    (
        "capital_of",
        re.compile(r"(?:is|was) the capital(?: city)?(?: and (?:the )?largest city)? of " + _PLACE),
    ),
    (
        "its_capital",
        re.compile(
            r"(?:^|[Ii]ts |[Tt]he (?:national )?)capital(?: and (?:largest|most populous) city)? "
            r"is " + _ANSWER_NAME
        ),
    ),
    (
        "its_capital",
        re.compile(
            rf"^{_ANSWER_NAME} is (?:the (?:country's |national )?|its )capital(?: and| city|,|\.)"
        ),
    ),
    ("founded_year", re.compile(r"(?P<verb>founded|established) in (?P<answer>\d{4})")),
    ("made_by", re.compile(r"(?P<verb>" + "|".join(_MAKERS) + r") by " + _ANSWER_NAME)),
    (
        "made_by",
        re.compile(
            r"(?:is|was) an? (?:[a-z]+ )*?(?P<work>" + "|".join(_WORKS) + r") "
            r"(?:written |composed |directed |painted )?by " + _ANSWER_NAME
        ),
    ),
    (
        "located_in",
        re.compile(
            r"(?:is|was) (?:an?|the) (?:[\w-]+ ){0,3}?(?:city|town|village|river|lake|mountain|"
            r"island|province|state|municipality|port|country|region) (?:[a-z]+ )*?in (?:the )?"
            + _PLACE
        ),
    ),
    ("located_in", re.compile(r"\b(?:located|situated) (?:[a-z]+ )?in (?:the )?" + _PLACE)),
    ("headquartered_in", re.compile(r"\b(?:headquartered|based) in (?:the )?" + _PLACE)),
    ("born_in", re.compile(r"\bborn (?:[^.,]{0,40}? )?in " + _PLACE)),
    ("named_after", re.compile(r"\bnamed (?:after|for) (?:the )?" + _ANSWER_NAME)),
]

_ONE_HOP: dict[str, Callable[[WikiFact], str]] = {
    "nationality": lambda f: f"What nationality is {f.entity}?",
    "capital_of": lambda f: f"Of which country or region is {f.entity} the capital?",
    "its_capital": lambda f: f"What is the capital of {f.entity}?",
    "founded_year": lambda f: f"In what year was {f.entity} {f.verb}?",
    "made_by": lambda f: _MAKERS[f.verb][0].format(x=f.entity),
    "located_in": lambda f: f"Where is {f.entity}?",
    "headquartered_in": lambda f: f"Where is {f.entity} headquartered?",
    "born_in": lambda f: f"Where was {f.entity} born?",
    "named_after": lambda f: f"Who is {f.entity} named after?",
}
"""The question of a one-hop fact, by kind."""

_TWO_HOP: dict[tuple[str, str], Callable[[WikiFact, WikiFact], str]] = {
    ("made_by", "nationality"): lambda a, b: (
        f"What nationality is the {_MAKERS[a.verb][1]} of {a.entity}?"
    ),
    ("made_by", "born_in"): lambda a, b: f"Where was the {_MAKERS[a.verb][1]} of {a.entity} born?",
    ("located_in", "its_capital"): lambda a, b: (
        f"What is the capital of the country or region where {a.entity} is?"
    ),
    ("located_in", "located_in"): lambda a, b: (
        f"Where is the country or region in which {a.entity} lies?"
    ),
    ("located_in", "capital_of"): lambda a, b: (
        f"Of which country or region is the place where {a.entity} is the capital?"
    ),
    ("named_after", "nationality"): lambda a, b: (
        f"What nationality is the person {a.entity} is named after?"
    ),
    ("named_after", "born_in"): lambda a, b: (
        f"Where was the person {a.entity} is named after born?"
    ),
    ("headquartered_in", "its_capital"): lambda a, b: (
        f"What is the capital of the country or region where {a.entity} is headquartered?"
    ),
    ("born_in", "its_capital"): lambda a, b: (
        f"What is the capital of the country or region where {a.entity} was born?"
    ),
    ("born_in", "capital_of"): lambda a, b: (
        f"Of which country or region is the place where {a.entity} was born the capital?"
    ),
    ("born_in", "located_in"): lambda a, b: f"Where is the place where {a.entity} was born?",
    ("headquartered_in", "capital_of"): lambda a, b: (
        f"Of which country or region is the city where {a.entity} is headquartered the capital?"
    ),
    ("headquartered_in", "located_in"): lambda a, b: (
        f"Where is the city in which {a.entity} is headquartered?"
    ),
    ("capital_of", "located_in"): lambda a, b: (
        f"Where is the country or region whose capital is {a.entity}?"
    ),
}
"""The question of a bridge (first fact's kind, second fact's kind); the second fact belongs
to the passage the first one's answer names."""

CATEGORIES = {
    "nationality": "nationality",
    "capital_of": "country",
    "its_capital": "capital city",
    "founded_year": "year of foundation",
    "located_in": "geographic region",
    "headquartered_in": "headquarters",
    "born_in": "birthplace",
    "named_after": "eponym",
}
"""What the category-searching teacher searches for, by the kind of the answer's fact
(made_by: the maker's category of `_MAKERS`)."""

SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
SPLITS = ("train", "rl", "test")


@dataclass(frozen=True)
class WikiQuestion:
    """A question and its chain of facts: one fact (one hop) or two (a bridge)."""

    question: str
    chain: tuple[WikiFact, ...]

    @property
    def title(self) -> str:
        """The passage of the first hop."""
        return self.chain[0].title

    @property
    def entity(self) -> str:
        """The entity the question starts from."""
        return self.chain[0].entity

    @property
    def answer(self) -> str:
        return self.chain[-1].answer

    @property
    def kind(self) -> str:
        """The chain's kinds, joined by ">" (``made_by>nationality``)."""
        return ">".join(fact.kind for fact in self.chain)

    @property
    def category(self) -> str:
        """What a search for the answer's category asks for."""
        last = self.chain[-1]
        return _MAKERS[last.verb][2] if last.kind == "made_by" else CATEGORIES[last.kind]

    def to_example(self) -> QAExample:
        metadata = {
            "title": self.title,
            "entity": self.entity,
            "kind": self.kind,
            "hops": len(self.chain),
            "category": self.category,
            "sentence": self.chain[0].sentence,
            "chain": [
                {
                    "title": f.title,
                    "entity": f.entity,
                    "kind": f.kind,
                    "answer": f.answer,
                    "sentence": f.sentence,
                }  # fmt: skip
                for f in self.chain
            ],
        }
        titles = "|".join(f.title for f in self.chain)
        return QAExample(f"wiki-{self.kind}-{titles}", self.question, (self.answer,), metadata)


def _entity(title: str) -> str:
    return re.sub(r"\s*\(.*\)$", "", title).strip()


def wiki_facts(passages: Sequence[tuple[str, str]]) -> list[WikiFact]:
    """Every fact the patterns read off the first six sentences of ``passages`` (title,
    text), at most one per passage and kind."""
    out = []
    for title, text in passages:
        entity = _entity(title)
        if len(entity) < 3:
            continue
        sentences = [s for s in SENTENCE.split(text)[:6] if len(s.split()) <= 60]
        kinds: set[str] = set()
        for kind, pattern in _PATTERNS:
            if kind in kinds:
                continue
            for sentence in sentences:
                match = pattern.search(sentence)
                if match is None:
                    continue
                answer = match.group("answer").strip().rstrip(".,")
                groups = match.groupdict()
                verb = groups.get("verb") or _WORKS.get(groups.get("work") or "", "")
                if answer in entity or entity in answer or answer in PRONOUNS:
                    continue
                if _NOT_PLACE.fullmatch(answer):
                    continue
                if kind == "made_by" and re.fullmatch(_DEMONYMS, answer):
                    continue
                out.append(WikiFact(title, entity, kind, answer, sentence.strip(), verb))
                kinds.add(kind)
                break
    return out


def wiki_questions(
    passages: Sequence[tuple[str, str]],
    exclude: set[str] = frozenset(),  # type: ignore[assignment]
) -> list[WikiQuestion]:
    """Every one-hop and two-hop question of ``passages``, none starting from a title in
    ``exclude``. A bridge needs the first fact's answer to be a passage's title (or its
    entity, the title less a parenthesis) and that passage to hold a fact of a kind the
    bridge templates join; a chain that comes back to its start is dropped."""
    exclude = set(exclude)
    facts = wiki_facts(passages)
    by_title: dict[str, list[WikiFact]] = {}
    for fact in facts:
        by_title.setdefault(fact.title, []).append(fact)
    titles: dict[str, str] = {}
    for title in by_title:
        titles.setdefault(title, title)
        titles.setdefault(_entity(title), title)
    out = []
    for fact in facts:
        if fact.title in exclude:
            continue
        out.append(WikiQuestion(_ONE_HOP[fact.kind](fact), (fact,)))
        target = titles.get(fact.answer)
        if target is None or target == fact.title:
            continue
        for second in by_title[target]:
            template = _TWO_HOP.get((fact.kind, second.kind))
            question = template(fact, second) if template else ""
            if question and second.answer not in (fact.entity, fact.title):
                out.append(WikiQuestion(question, (fact, second)))
    return out


def _bucket(entity: str, seed: int) -> float:
    """A uniform draw in [0, 1) fixed by (seed, entity), the same on every machine."""
    digest = hashlib.sha256(f"{seed}|{entity}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def entity_split(
    questions: Iterable[WikiQuestion], shares: tuple[float, float], seed: int
) -> dict[str, list[WikiQuestion]]:
    """``questions`` split by starting entity alone (see `split_questions`)."""
    test_share, rl_share = shares
    split: dict[str, list[WikiQuestion]] = {name: [] for name in SPLITS}
    for question in questions:
        draw = _bucket(question.entity, seed)
        name = "test" if draw < test_share else "rl" if draw < test_share + rl_share else "train"
        split[name].append(question)
    return split


def split_questions(
    questions: Iterable[WikiQuestion], shares: tuple[float, float], seed: int
) -> dict[str, list[WikiQuestion]]:
    """``questions`` split by their starting entity: a share ``shares[0]`` of the entities to
    test, ``shares[1]`` to rl, the rest to train. A train or rl question that uses a fact of
    any test question's chain (as its first hop or its bridge) is dropped, so that no fact a
    test question needs is ever a training question's."""
    split = entity_split(questions, shares, seed)
    tested = {fact for question in split["test"] for fact in question.chain}
    for name in ("train", "rl"):
        split[name] = [q for q in split[name] if not tested.intersection(q.chain)]
    return split


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
        return question.question in texts or any(
            fact.title in titles or fact.entity in subjects or fact.answer in subjects
            for fact in question.chain
        )

    return overlaps


_TAGGED = re.compile(r"<question> (.*?) </question>", re.DOTALL)
_FIRST_HIT = re.compile(r"Doc 1 \(Title: (.*?)\) (.*)")
_MEMORY = re.compile(r"<memory> (.*?) </memory>", re.DOTALL)


def wiki_oracle(questions: Sequence[WikiQuestion], flaws: TeacherFlaws | None = None) -> Reply:
    """The teacher for ``questions``: search the entity of the first hop not yet read; keep
    the sentences read so far as the memory; once the last hop's sentence has come back,
    answer with its answer's words. Like the synthetic oracle, it reads the prompt only, never
    the gold answer directly: an answer is written only when its sentence is in the memory or
    the tool responses.

    With ``flaws``: after the first hop of a two-hop chain it may answer with the bridge entity
    (``early_answer``); and its first search may ask for the answer's category
    (``category_query``), after which it copies the title of the first passage that came back
    as its answer, as a model that searches its prior does."""
    flaws = flaws or TeacherFlaws()
    by_question = {q.question: q for q in questions}
    copied: dict[tuple[str, str], str] = {}  # (question, memory) -> the title it came from

    def reply(prompt: str, params: SamplingParams) -> str:
        question = by_question[_TAGGED.findall(prompt)[-1]]
        evidence = prompt[prompt.rindex("</question>") :]
        read = _hops_read(question, evidence)
        facts = " ".join(fact.sentence for fact in question.chain[:read])
        astray = read == 0 and flaws.queries_category(question.question)
        if MEMORY_STOP[0] in params.stop:
            hit = _FIRST_HIT.search(evidence)
            if astray and hit:
                memory = SENTENCE.split(hit.group(2))[0].strip()
                copied[(question.question, memory)] = hit.group(1)
                return f"<memory> {memory} </memory>"
            return f"<memory> {facts} </memory>"
        if read == len(question.chain):
            return _answer(question.answer)
        if read and flaws.answers_early(question.question, read):
            return _answer(question.chain[read - 1].answer)
        if astray:
            title = _copied_title(question.question, evidence, copied)
            if title is not None:
                return _answer(title)
            return _search(question.category)
        return _search(question.chain[read - 1].answer if read else question.entity)

    return reply


def _hops_read(question: WikiQuestion, evidence: str) -> int:
    """How many hops of the chain the teacher has read: hop k's sentence is in ``evidence``,
    and for a bridge hop, it came back from a search of the bridge entity (that query is in the
    evidence) or is already in the memory. So the teacher searches every hop, even when the
    first search happens to bring back the bridge's passage too, as an agent that cannot know
    which passage answers a hop it has not asked about."""
    memory = _MEMORY.search(evidence)
    kept = memory.group(1) if memory else ""
    read = 0
    for number, fact in enumerate(question.chain):
        asked = number == 0 or _query(question.chain[number - 1].answer) in evidence
        if fact.sentence not in evidence or not (asked or fact.sentence in kept):
            break
        read += 1
    return read


def _query(query: str) -> str:
    return f'"query": {json.dumps(query, ensure_ascii=False)}'


def _copied_title(question: str, evidence: str, copied: dict[tuple[str, str], str]) -> str | None:
    """The title a category search brought back, once it has: from the tool response in a
    ReAct history, or from the memory the teacher wrote of it (MemSearcher)."""
    hit = _FIRST_HIT.search(evidence)
    if hit:
        return hit.group(1)
    for (asked, memory), title in copied.items():
        if asked == question and f"<memory> {memory} </memory>" in evidence:
            return title
    return None


def _search(query: str) -> str:
    call = {"name": TOOL_NAME, "arguments": {"query": query}}
    return (
        f"<think> I need to look up {query}. </think>\n"
        f"<tool_call>{json.dumps(call, ensure_ascii=False)}</tool_call>"
    )


def _answer(answer: str) -> str:
    return f"<think> I know the answer. </think>\nThe answer is \\boxed{{{answer}}}"
