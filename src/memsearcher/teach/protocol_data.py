"""The protocol data: oracle trajectories that teach a model the agent protocol.

The packaged SmolLM2-135M-Instruct never writes the agent protocol on its own. It learns it from
oracle trajectories run through the real agents (MemSearcher and ReAct), the default prompts,
SmolLM2's own chat template and a real BM25 index, so every mask and template token is what
inference sees. Two sources:

- synthetic worlds (`memsearcher.data.synthetic`), one per seed, so fictional names rarely
  repeat and the model learns to copy names rather than recall them; the synthetic oracle
  (`memsearcher.teach.oracle`) follows each question's chain of hops through what BM25 returns;
- the embedded Wikipedia (`memsearcher.teach.wiki`): questions read off passages, answered by
  the Wikipedia oracle.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from memsearcher.agent import AgentConfig, Templates, run_lockstep, start_episodes
from memsearcher.data.synthetic import WorldConfig, generate_world, write_world
from memsearcher.eval.metrics import exact_match
from memsearcher.llm.base import SamplingParams, Tokenizer
from memsearcher.llm.scripted import Reply, ScriptedLLM
from memsearcher.retrieval.base import Retriever
from memsearcher.retrieval.corpus import Passage
from memsearcher.teach.config import ProtocolDataConfig
from memsearcher.teach.oracle import AGENTS, oracle_policy
from memsearcher.teach.wiki import (
    SENTENCE,
    WikiQuestion,
    overlaps_heldout,
    read_heldout,
    split_questions,
    wiki_oracle,
    wiki_questions,
)
from memsearcher.types import Hit, QAExample, Trajectory

__all__ = [
    "ClippedRetriever",
    "answered_right",
    "answerable",
    "build_protocol_data",
    "flaw_rates",
    "wiki_splits",
    "world_rl_questions",
]


def wiki_splits(config: ProtocolDataConfig) -> dict[str, list[WikiQuestion]]:
    """The embedded Wikipedia's questions, less those that touch the held-out file, split by
    starting entity (`split_questions`)."""
    from memsearcher.retrieval.embedded import embedded_passages

    candidates = wiki_questions([(p.title, p.text) for p in embedded_passages()])
    if config.heldout:
        overlaps = overlaps_heldout(read_heldout(config.heldout))
        candidates = [q for q in candidates if not overlaps(q)]
    return split_questions(candidates, (config.test_share, config.rl_share), config.seed)


def build_protocol_data(
    config: ProtocolDataConfig, out: str | Path, tokenizer: Tokenizer, echo: Callable[[str], None]
) -> dict[str, Any]:
    """Write the teachers' trajectories of both agents to ``out`` (JSONL): the synthetic
    worlds' and the train split of the Wikipedia questions (`wiki_splits`). Return counts,
    with the flaw rates the data show (also written beside ``out`` as ``.stats.json``)."""
    from memsearcher.retrieval import open_retriever
    from memsearcher.retrieval.bm25 import build_bm25

    rng = random.Random(config.seed)
    flaws = config.flaws
    templates = Templates()
    kept: list[Trajectory] = []
    stats: dict[str, Any] = {"worlds": config.worlds}
    with tempfile.TemporaryDirectory(prefix="memsearcher-worlds-") as scratch:
        for number in range(config.worlds):
            world = generate_world(replace(WorldConfig(), seed=config.seed + 1000 + number))
            paths = write_world(world, Path(scratch) / f"world-{number}")
            index = build_bm25(paths["corpus"], Path(scratch) / f"index-{number}", overwrite=True)
            train = [q.to_example() for q in world.split("train")]
            for agent in AGENTS:
                chosen = rng.sample(train, min(config.questions_per_world, len(train)))
                replies = (oracle_policy(chosen), oracle_policy(chosen, flaws))
                kept += _taught(agent, chosen, replies, tokenizer, index, config, templates)
            shutil.rmtree(Path(scratch) / f"index-{number}", ignore_errors=True)
    stats["synthetic_trajectories"] = len(kept)

    wiki_train = wiki_splits(config)["train"]
    bridges = [q for q in wiki_train if len(q.chain) > 1]  # few, and what GRPO improves: all
    one_hop = [q for q in wiki_train if len(q.chain) == 1]
    candidates = bridges + _balanced(
        one_hop, config.wiki_questions - len(bridges), config.max_share, rng
    )
    stats["wiki_candidates"] = len(candidates)
    retriever = ClippedRetriever(open_retriever(None), config.passage_words)
    wiki: list[Trajectory] = []
    for agent in AGENTS:
        examples = [q.to_example() for q in candidates]
        replies = (wiki_oracle(candidates), wiki_oracle(candidates, flaws))
        wiki += _taught(agent, examples, replies, tokenizer, retriever, config, templates)
        for copy in range(1, config.bridge_copies):  # the few two-hop questions again
            redrawn = replace(flaws, seed=flaws.seed + copy)
            replies = (wiki_oracle(bridges), wiki_oracle(bridges, redrawn))
            examples = [q.to_example() for q in bridges]
            wiki += _taught(agent, examples, replies, tokenizer, retriever, config, templates)
    stats["wiki_trajectories"] = len(wiki)
    stats["wiki_kinds"] = _count(t.example.metadata["kind"] for t in wiki)
    stats["flaws"] = {"stated": asdict(flaws), "measured": flaw_rates(wiki)}
    kept += wiki
    rng.shuffle(kept)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(out.name + ".tmp")
    with staging.open("w", encoding="utf-8") as lines:
        lines.writelines(json.dumps(t.to_dict(), ensure_ascii=False) + "\n" for t in kept)
    stats["trajectories"] = len(kept)
    stats["sequences"] = sum(len(t.sequences) for t in kept)
    stats["tokens"] = sum(len(s.input_ids) for t in kept for s in t.sequences)
    stats["trained_tokens"] = sum(sum(s.loss_mask) for t in kept for s in t.sequences)
    out.with_suffix(".stats.json").write_text(json.dumps(stats, indent=2) + "\n", "utf-8")
    staging.rename(out)  # last: the data's presence says that its stats are there too
    echo(f"protocol data: {json.dumps(stats)}")
    return stats


def answerable(
    questions: Sequence[WikiQuestion],
    tokenizer: Tokenizer,
    retriever: Retriever,
    agent: AgentConfig,
) -> list[WikiQuestion]:
    """The ``questions`` the ideal teacher answers right as MemSearcher through ``retriever``
    with the settings ``agent``: every hop's passage comes back when its entity is searched."""
    examples = [q.to_example() for q in questions]
    right = answered_right(examples, wiki_oracle(questions), tokenizer, retriever, agent)
    return [question for question, ok in zip(questions, right, strict=True) if ok]


def answered_right(
    examples: Sequence[QAExample],
    reply: Reply,
    tokenizer: Tokenizer,
    retriever: Retriever,
    agent: AgentConfig,
) -> list[bool]:
    """Whether the teacher ``reply`` answers each of ``examples`` right as MemSearcher through
    ``retriever`` with the settings ``agent``."""
    llm = ScriptedLLM(tokenizer, reply)
    episodes = start_episodes("memsearcher", examples, tokenizer, agent)
    trajectories = run_lockstep(episodes, llm, retriever, SamplingParams())
    return [
        t.end_reason == "answer" and bool(exact_match(t.answer or "", t.example.golden_answers))
        for t in trajectories
    ]


def world_rl_questions(
    config: ProtocolDataConfig, worlds: int, per_world: int
) -> tuple[list[Passage], list[QAExample]]:
    """Every passage of ``worlds`` synthetic worlds after the SFT data's (seeds from
    ``seed + 1000 + config.worlds`` on: worlds SFT never saw, whose invented names rarely
    repeat those it did), and ``per_world`` multi-hop questions of each one's rl split. Ids
    carry the world, as question ids repeat across worlds."""
    rng = random.Random(config.seed + 1)
    passages: list[Passage] = []
    examples: list[QAExample] = []
    for number in range(config.worlds, config.worlds + worlds):
        world = generate_world(replace(WorldConfig(), seed=config.seed + 1000 + number))
        passages += [Passage(f"world{number}-{i}", title, text)
                     for i, (title, text) in enumerate(world.passages)]  # fmt: skip
        multi_hop = [q.to_example() for q in world.split("rl") if len(q.hops) > 1]
        chosen = rng.sample(multi_hop, min(per_world, len(multi_hop)))
        examples += [replace(e, id=f"world{number}-{e.id}") for e in chosen]
    return passages, examples


def flaw_rates(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """How often the Wikipedia teacher's flaws show in its ``trajectories``: the share whose
    first search asked for the answer's category, and, among the two-hop ones that did not,
    the share answered with the bridge entity after the first hop; with the counts behind each."""
    astray = [_first_query(t) == t.example.metadata["category"] for t in trajectories]
    bridged = [
        t.answer == t.example.metadata["chain"][0]["answer"]
        for t, lost in zip(trajectories, astray, strict=True)
        if t.example.metadata["hops"] == 2 and not lost
    ]
    return {
        "category_query": sum(astray) / max(len(astray), 1),
        "trajectories": len(astray),
        "early_answer": sum(bridged) / max(len(bridged), 1),
        "two_hop_trajectories": len(bridged),
    }


def _first_query(trajectory: Trajectory) -> str | None:
    return next((turn.query for turn in trajectory.turns if turn.query), None)


class ClippedRetriever:
    """A retriever whose passages are cut to their first sentences (at most ``words`` words):
    the embedded Wikipedia's leads run to 500 characters, and on two CPU cores every token of
    a tool response costs SFT time while teaching nothing (loss mask 0). The oracle needs the
    answer's sentence in what it read, so a cut that drops it drops the trajectory."""

    def __init__(self, retriever: Retriever, words: int) -> None:
        self.retriever, self.words = retriever, words

    def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        found = self.retriever.search(queries, top_n)
        if not self.words:
            return found
        return [[replace(hit, text=self.clip(hit.text)) for hit in hits] for hits in found]

    def clip(self, text: str) -> str:
        kept: list[str] = []
        for sentence in SENTENCE.split(text):
            if kept and len(" ".join(kept + [sentence]).split()) > self.words:
                break
            kept.append(sentence)
        return " ".join(kept)


def _taught(
    agent: str,
    examples: Sequence[QAExample],
    replies: tuple[Reply, Reply],
    tokenizer: Tokenizer,
    retriever: Retriever,
    config: ProtocolDataConfig,
    templates: Templates,
) -> list[Trajectory]:
    """The teacher's trajectories of ``agent`` on the ``examples`` the ideal teacher (the first
    of ``replies``) answers right through ``retriever``: a hop the retriever missed leaves it
    without the fact, and such a question is dropped. The flawed teacher (the second) then
    answers those; every trajectory it ends with an answer is kept, right or not."""
    ideal = _run(agent, examples, replies[0], tokenizer, retriever, config, templates)
    kept = [
        t
        for t in ideal
        if t.end_reason == "answer"
        and exact_match(t.answer or "", t.example.golden_answers)
        and len(t.turns) > 1
    ]
    if not (config.early_answer or config.category_query):
        return kept
    answerable = [t.example for t in kept]
    flawed = _run(agent, answerable, replies[1], tokenizer, retriever, config, templates)
    return [t for t in flawed if t.end_reason == "answer"]


def _run(
    agent: str,
    examples: Sequence[QAExample],
    reply: Reply,
    tokenizer: Tokenizer,
    retriever: Retriever,
    config: ProtocolDataConfig,
    templates: Templates,
) -> list[Trajectory]:
    llm = ScriptedLLM(tokenizer, reply)
    episodes = start_episodes(agent, examples, tokenizer, config.agent, templates)
    return run_lockstep(episodes, llm, retriever, SamplingParams())


def _balanced(
    questions: list[WikiQuestion], count: int, max_share: float, rng: random.Random
) -> list[WikiQuestion]:
    """Up to ``count`` questions, no kind more than ``max_share`` of them, one per title."""
    if count <= 0:
        return []
    rng.shuffle(questions)
    cap = max(1, int(count * max_share))
    taken: dict[str, int] = {}
    titles: set[str] = set()
    out = []
    for question in questions:
        if taken.get(question.kind, 0) >= cap or question.title in titles:
            continue
        taken[question.kind] = taken.get(question.kind, 0) + 1
        titles.add(question.title)
        out.append(question)
        if len(out) == count:
            break
    return out


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return dict(sorted(counts.items()))
