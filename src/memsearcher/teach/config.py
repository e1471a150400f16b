"""Configs of the teachers: what the protocol data is built from."""

from __future__ import annotations

from dataclasses import dataclass, field

from memsearcher.agent.base import AgentConfig, check_trainable
from memsearcher.config import require
from memsearcher.teach.oracle import TeacherFlaws

__all__ = ["ProtocolDataConfig"]


@dataclass(frozen=True)
class ProtocolDataConfig:
    """Oracle trajectories that teach a model the protocol (`memsearcher.teach.protocol_data`)."""

    worlds: int = 40
    """Synthetic worlds, one per seed, so that fictional names rarely repeat."""
    questions_per_world: int = 6
    """Training questions drawn per world and agent."""
    wiki_questions: int = 400
    """Questions read off embedded Wikipedia passages (before dropping the retriever's misses),
    each run by both agents."""
    bridge_copies: int = 1
    """Times each two-hop Wikipedia question of the train split is taught per agent, each time
    with flaws drawn afresh. Two-hop questions are few (about 30 in the train split, against
    hundreds of one-hop ones); taught once each, SFT learned to answer after one search."""
    passage_words: int = 50
    """Wikipedia passages are cut to their first sentences, at most this many words (0: whole
    passages), to keep SFT sequences short on a CPU."""
    max_share: float = 0.3
    """Largest share of one kind of Wikipedia question (nationality questions abound)."""
    heldout: str = ""
    """A FlashRAG file of held-out questions: passages with their ``metadata.title`` are never
    used for training questions ("" excludes none)."""
    test_share: float = 0.25
    """Share of the Wikipedia questions' starting entities held out as the test split."""
    rl_share: float = 0.35
    """Share of the starting entities kept for GRPO (the rl split); the rest is SFT's."""
    early_answer: float = 0.0
    """The teacher's chance of answering a multi-hop question with the entity a partly read
    chain has reached (`TeacherFlaws.early_answer`); 0: never."""
    category_query: float = 0.0
    """The Wikipedia teacher's chance of searching the answer's category first and copying
    what came back (`TeacherFlaws.category_query`); 0: never."""
    seed: int = 0
    """Seeds the worlds, the splits and the draws."""
    agent: AgentConfig = field(
        default_factory=lambda: AgentConfig(
            max_turns=4, memory_tokens=128, max_new_tokens=128, top_n=3
        )
    )
    """The agents' settings while the oracle runs (top_n passages per search)."""

    def __post_init__(self) -> None:
        check_trainable(self.agent, "agent")  # the teacher's trajectories are SFT's data
        require(self, "worlds", self.worlds >= 0, ">= 0")
        require(self, "questions_per_world", self.questions_per_world >= 0, ">= 0")
        require(self, "wiki_questions", self.wiki_questions >= 0, ">= 0")
        require(self, "bridge_copies", self.bridge_copies >= 1, ">= 1")
        require(self, "max_share", 0 < self.max_share <= 1, "in (0, 1]")
        for name in ("test_share", "rl_share", "early_answer", "category_query"):
            require(self, name, 0 <= getattr(self, name) <= 1, "in [0, 1]")
        require(self, "rl_share", self.test_share + self.rl_share <= 1,
                "at most 1 - test_share")  # fmt: skip

    @property
    def flaws(self) -> TeacherFlaws:
        """The teachers' flaws, drawn with this config's seed."""
        return TeacherFlaws(self.early_answer, self.category_query, self.seed)
