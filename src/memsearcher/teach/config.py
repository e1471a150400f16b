"""Configs of the teachers: what the protocol data is built from."""

from __future__ import annotations

from dataclasses import dataclass, field

from memsearcher.agent.base import AgentConfig
from memsearcher.config import require

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
    passage_words: int = 50
    """Wikipedia passages are cut to their first sentences, at most this many words (0: whole
    passages), to keep SFT sequences short on a CPU."""
    max_share: float = 0.3
    """Largest share of one kind of Wikipedia question (nationality questions abound)."""
    heldout: str = ""
    """A FlashRAG file of held-out questions: passages with their ``metadata.title`` are never
    used for training questions ("" excludes none)."""
    seed: int = 0
    """Seeds the worlds and the draws."""
    agent: AgentConfig = field(
        default_factory=lambda: AgentConfig(
            max_turns=4, memory_tokens=128, max_new_tokens=128, top_n=3
        )
    )
    """The agents' settings while the oracle runs (top_n passages per search)."""

    def __post_init__(self) -> None:
        require(self, "worlds", self.worlds >= 0, ">= 0")
        require(self, "questions_per_world", self.questions_per_world >= 0, ">= 0")
        require(self, "wiki_questions", self.wiki_questions >= 0, ">= 0")
        require(self, "max_share", 0 < self.max_share <= 1, "in (0, 1]")
