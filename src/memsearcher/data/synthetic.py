"""A seeded fictional world for the offline demo: passages, multi-hop questions, oracle plans.

The world has people, cities, countries, organizations and works, linked by five relations.
Every fact is one sentence of one passage, written the same way everywhere ("Vela Morin was born
in Tarsk."), so a question's chain of hops can be followed by searching for each entity in turn
and reading one sentence from what comes back. Nothing made up here exists, so a model can only
answer by searching.

Distractors make retrieval and reading non-trivial: every person has a near-namesake (same first
name, last name one letter apart), works share title words, and the passages of works repeat
their author's name, so a search for a person also brings back passages about other facts.

Questions are 1 to 3 hops. Splits are drawn by starting entity, so no question of the ``rl``,
``dev`` or ``test`` split starts from an entity that a ``train`` (SFT) question starts from: a
model must copy names it was never trained to write, not recall them.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from memsearcher.errors import MemSearcherError
from memsearcher.types import QAExample

__all__ = [
    "RELATIONS",
    "SPLITS",
    "Hop",
    "Question",
    "World",
    "WorldConfig",
    "generate_world",
    "rename_world",
    "write_world",
]

RELATIONS: dict[str, str] = {
    "author": "{subject} was written by {object}.",
    "born_in": "{subject} was born in {object}.",
    "employer": "{subject} works for {object}.",
    "based_in": "{subject} is based at {object}.",
    "country": "{subject} is a city within {object}.",
}
"""Each relation's fact sentence, exactly as passages (and oracle memories) write it.

The word before the object differs between relations, and no other sentence of the world puts
that word before a name, so the object of a fact can be copied by matching its last word. With
"in" before three relations' objects (and years), a city's passages said "is a city in X" next to
"born in <city>" and "based in <city>", and the demo model copied the wrong name (docs/demo.md)."""

SPLITS = ("train", "rl", "dev", "test")
"""Question splits: SFT questions, GRPO questions, dev and held-out test."""

# Question templates per starting kind: (relations followed in order, question text).
_QUESTIONS: dict[str, list[tuple[tuple[str, ...], str]]] = {
    "person": [
        (("born_in",), "Where was {x} born?"),
        (("employer",), "Which organization does {x} work for?"),
        (("born_in", "country"), "In which country was {x} born?"),
        (("employer", "based_in"), "In which city is the employer of {x} based?"),
        (("employer", "based_in", "country"), "In which country is the employer of {x} based?"),
    ],
    "work": [
        (("author",), "Who wrote {x}?"),
        (("author", "born_in"), "Where was the author of {x} born?"),
        (("author", "employer"), "Which organization does the author of {x} work for?"),
        (("author", "born_in", "country"), "In which country was the author of {x} born?"),
        (
            ("author", "employer", "based_in"),
            "In which city is the employer of the author of {x} based?",
        ),
    ],
    "org": [
        (("based_in",), "In which city is {x} based?"),
        (("based_in", "country"), "In which country is {x} based?"),
    ],
    "city": [
        (("country",), "In which country is {x}?"),
    ],
}

_ONSETS = [
    "b",
    "br",
    "c",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "k",
    "kl",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "st",
    "t",
    "tr",
    "v",
    "z",
]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o"]
_CODAS = ["", "", "n", "r", "l", "s", "k", "m", "th"]
_OCCUPATIONS = [
    "painter",
    "poet",
    "sculptor",
    "engineer",
    "historian",
    "composer",
    "chemist",
    "architect",
]
_ORG_KINDS = ["Guild", "Institute", "Company", "Society", "Academy", "Foundation"]
_GENRES = ["novel", "play", "poem", "essay", "opera", "memoir"]
_ADJECTIVES = [
    "Silent",
    "Golden",
    "Hidden",
    "Broken",
    "Last",
    "Northern",
    "Quiet",
    "Burning",
    "Distant",
    "Iron",
]
_NOUNS = [
    "Harbor",
    "Garden",
    "River",
    "Crown",
    "Letter",
    "Winter",
    "Tower",
    "Voyage",
    "Mirror",
    "Forest",
    "Bridge",
    "Song",
]
_RIVERS = ["Amber", "Slate", "Willow", "Copper", "Reed"]


@dataclass(frozen=True)
class WorldConfig:
    """Sizes of the generated world."""

    seed: int = 0
    """Seeds every choice; the same seed gives the same world, byte for byte."""
    people: int = 60
    """People (each also gets a near-namesake distractor, who is a person too)."""
    cities: int = 24
    """Cities."""
    countries: int = 8
    """Countries."""
    orgs: int = 16
    """Organizations."""
    works: int = 80
    """Works (novels, plays, ...), each by one person."""
    questions_per_entity: int = 0
    """Question templates drawn per starting entity (0: all of them). Fewer questions over more
    entities make a model copy names rather than memorize them."""
    rl_fraction: float = 0.15
    """Share held out from SFT for reinforcement learning: the ``rl`` split."""
    dev_fraction: float = 0.05
    """Share that forms the dev split."""
    test_fraction: float = 0.2
    """Share that forms the test split (held-out evaluation)."""


@dataclass(frozen=True)
class Hop:
    """One step of a question's chain: search ``entity``, read ``relation``, get ``target``."""

    entity: str
    relation: str
    target: str

    @property
    def fact(self) -> str:
        return RELATIONS[self.relation].format(subject=self.entity, object=self.target)


@dataclass(frozen=True)
class Question:
    """A question with its gold answer and the chain of hops that reaches it."""

    id: str
    question: str
    answer: str
    hops: tuple[Hop, ...]
    split: str

    def to_example(self) -> QAExample:
        return QAExample(
            self.id,
            self.question,
            (self.answer,),
            {"hops": [asdict(hop) for hop in self.hops]},
        )


@dataclass(frozen=True)
class World:
    """Passages (title, text) and questions of one generated world."""

    config: WorldConfig
    passages: tuple[tuple[str, str], ...]
    questions: tuple[Question, ...]
    entities: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Every entity's full name by kind: person (near-namesakes side by side), city, country,
    org, work."""

    @property
    def names(self) -> tuple[str, ...]:
        """Every entity's name, sorted."""
        return tuple(sorted(name for names in self.entities.values() for name in names))

    def split(self, name: str) -> list[Question]:
        return [q for q in self.questions if q.split == name]


class _Names:
    """Made-up, pronounceable, never-repeated names."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: int) -> str:
        while True:
            parts = [
                self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                for _ in range(syllables)
            ]
            word = "".join(parts).capitalize()
            if word not in self.used and len(word) > 3:
                self.used.add(word)
                return word

    def near(self, word: str) -> str:
        """A new word one letter away from ``word``."""
        while True:
            i = self.rng.randrange(1, len(word))
            letter = self.rng.choice("aeiou" if word[i] in "aeiou" else "lnrstkm")
            candidate = word[:i] + letter + word[i + 1 :]
            if candidate != word and candidate not in self.used:
                self.used.add(candidate)
                return candidate


def generate_world(config: WorldConfig = WorldConfig()) -> World:
    """The world of ``config.seed``: deterministic for a given config."""
    if min(config.people, config.cities, config.countries, config.orgs, config.works) < 2:
        raise MemSearcherError("every entity kind needs at least 2 members")
    rng = random.Random(config.seed)
    names = _Names(rng)
    countries = [names.word(2) + "ia" for _ in range(config.countries)]
    cities = [names.word(2) for _ in range(config.cities)]
    orgs = [f"{names.word(2)} {rng.choice(_ORG_KINDS)}" for _ in range(config.orgs)]
    people = []
    for _ in range(config.people):
        first, last = names.word(2), names.word(2)
        people += [f"{first} {last}", f"{first} {names.near(last)}"]
    works = _titles(rng, config.works)

    facts: dict[tuple[str, str], str] = {}
    for city in cities:
        facts[city, "country"] = rng.choice(countries)
    for org in orgs:
        facts[org, "based_in"] = rng.choice(cities)
    for person in people:
        facts[person, "born_in"] = rng.choice(cities)
        facts[person, "employer"] = rng.choice(orgs)
    for work in works:
        facts[work, "author"] = rng.choice(people)

    passages = _passages(rng, facts, countries, cities, orgs, people, works)
    starts = {"person": people, "work": works, "org": orgs, "city": cities}
    questions = _questions(rng, config, facts, starts)
    entities = {"person": people, "city": cities, "country": countries, "org": orgs, "work": works}
    return World(
        config, tuple(passages), tuple(questions), {k: tuple(v) for k, v in entities.items()}
    )


def rename_world(world: World, seed: int) -> World:
    """The same world with its names shuffled within each kind (near-namesake pairs move as
    pairs): every passage, question and fact keeps its shape, and no name keeps its facts. SFT
    on renamed copies cannot be learned by remembering which name goes with which fact."""
    rng = random.Random(f"rename|{world.config.seed}|{seed}")
    mapping: dict[str, str] = {}
    for kind, names in world.entities.items():
        group = 2 if kind == "person" else 1
        units = [names[i : i + group] for i in range(0, len(names), group)]
        shuffled = rng.sample(units, len(units))
        for old, new in zip(units, shuffled, strict=True):
            mapping.update(zip(old, new, strict=True))
    pattern = re.compile("|".join(re.escape(n) for n in sorted(mapping, key=len, reverse=True)))

    def swap(text: str) -> str:
        return pattern.sub(lambda match: mapping[match.group(0)], text)

    passages = tuple((swap(title), swap(text)) for title, text in world.passages)
    questions = tuple(
        replace(
            q,
            question=swap(q.question),
            answer=swap(q.answer),
            hops=tuple(Hop(swap(h.entity), h.relation, swap(h.target)) for h in q.hops),
        )
        for q in world.questions
    )
    entities = {kind: tuple(mapping[n] for n in names) for kind, names in world.entities.items()}
    return World(world.config, passages, questions, entities)


def _titles(rng: random.Random, count: int) -> list[str]:
    pairs = [(a, n) for a in _ADJECTIVES for n in _NOUNS]
    if count > len(pairs) * 2:
        raise MemSearcherError(f"at most {len(pairs) * 2} works, got {count}")
    rng.shuffle(pairs)
    titles = [f"The {a} {n}" for a, n in pairs[:count]]
    # past the plain titles, "of the" titles reuse the same words: more shared-word distractors
    titles += [
        f"The {n} of the {a} {m}"
        for (a, n), m in zip(pairs, rng.choices(_NOUNS, k=count), strict=False)
    ]
    return titles[:count]


def _passages(
    rng: random.Random,
    facts: dict[tuple[str, str], str],
    countries: list[str],
    cities: list[str],
    orgs: list[str],
    people: list[str],
    works: list[str],
) -> list[tuple[str, str]]:
    def fact(subject: str, relation: str) -> str:
        return RELATIONS[relation].format(subject=subject, object=facts[subject, relation])

    passages = []
    for country in countries:
        river = rng.choice(_RIVERS)
        passages.append((country, f"{country} is a country. Its largest river is the {river}."))
    for city in cities:
        river = rng.choice(_RIVERS)
        passages.append((city, f"{fact(city, 'country')} {city} lies on the {river} river."))
    for org in orgs:
        year = rng.randint(1700, 1990)
        passages.append((org, f"{org} dates from {year}. {fact(org, 'based_in')}"))
    for person in people:
        job = _a(rng.choice(_OCCUPATIONS))
        text = f"{person} is {job}. {fact(person, 'born_in')} {fact(person, 'employer')}"
        passages.append((person, text))
    for work in works:
        genre, year = _a(rng.choice(_GENRES)), rng.randint(1800, 2020)
        text = f"{work} is {genre}. {fact(work, 'author')} It dates from {year}."
        passages.append((work, text))
    rng.shuffle(passages)
    return passages


def _a(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def _questions(
    rng: random.Random,
    config: WorldConfig,
    facts: dict[tuple[str, str], str],
    starts: dict[str, list[str]],
) -> list[Question]:
    questions: list[Question] = []
    for kind, entities in starts.items():
        for entity in entities:
            split = _draw_split(rng, config)
            templates = _QUESTIONS[kind]
            if 0 < config.questions_per_entity < len(templates):
                templates = rng.sample(templates, config.questions_per_entity)
            for relations, text in templates:
                hops, subject = [], entity
                for relation in relations:
                    target = facts[subject, relation]
                    hops.append(Hop(subject, relation, target))
                    subject = target
                number = len(questions)
                question = text.format(x=entity)
                questions.append(
                    Question(f"{split}-{number}", question, subject, tuple(hops), split)
                )
    rng.shuffle(questions)
    return questions


def _draw_split(rng: random.Random, config: WorldConfig) -> str:
    roll = rng.random()
    if roll < config.test_fraction:
        return "test"
    if roll < config.test_fraction + config.dev_fraction:
        return "dev"
    if roll < config.test_fraction + config.dev_fraction + config.rl_fraction:
        return "rl"
    return "train"


def write_world(world: World, folder: str | Path) -> dict[str, Path]:
    """Write ``corpus.jsonl``, ``{train,rl,dev,test}.jsonl`` (FlashRAG) and ``world.json``.

    Question rows carry their hop chain under ``metadata`` so the oracle can replay them.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"corpus": folder / "corpus.jsonl"}
    with paths["corpus"].open("w", encoding="utf-8") as out:
        for number, (title, text) in enumerate(world.passages):
            row = {"id": str(number), "contents": f'"{title}"\n{text}'}
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    for split in SPLITS:
        paths[split] = folder / f"{split}.jsonl"
        with paths[split].open("w", encoding="utf-8") as out:
            for q in world.split(split):
                example = q.to_example()
                line = {"id": example.id, "question": example.question,
                        "golden_answers": list(example.golden_answers),
                        "metadata": example.metadata}  # fmt: skip
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
    paths["world"] = folder / "world.json"
    paths["world"].write_text(json.dumps(asdict(world.config), indent=2) + "\n")
    return paths


def hops_of(metadata: dict[str, object]) -> tuple[Hop, ...]:
    """The hop chain stored in a question row's metadata by `write_world`."""
    raw = metadata.get("hops")
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise MemSearcherError("question metadata has no 'hops' chain (not a synthetic world?)")
    return tuple(Hop(**hop) for hop in raw)
