"""Frozen records shared by every subsystem: questions, hits, turns, trajectories."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class QAExample:
    """One question with its gold answers (FlashRAG fields)."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def objectives(self) -> tuple[tuple[str, ...], ...]:
        """The gold answers of each objective, in order.

        A composed multi-objective task (MEM1's; ``memsearcher.data.compose``) lists its
        questions under ``metadata["objectives"]``; any other example is one objective.
        """
        composed = self.metadata.get("objectives")
        if not composed:
            return (self.golden_answers,)
        return tuple(tuple(objective["golden_answers"]) for objective in composed)


@dataclass(frozen=True)
class Hit:
    """One retrieved passage."""

    id: str
    title: str
    text: str
    score: float = 0.0

    @property
    def contents(self) -> str:
        """The passage in wiki-18 form: a quoted title line, then the text."""
        return f'"{self.title}"\n{self.text}'


@dataclass(frozen=True)
class TokenSequence:
    """One training sequence: a prompt and a response with a per-token loss mask.

    ``loss_mask[k]`` is 1 where the model generated ``response_ids[k]`` and 0 where the
    environment inserted it (tool responses, chat-template glue between calls).
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.response_ids) != len(self.loss_mask):
            raise ValueError(
                f"response has {len(self.response_ids)} tokens but the mask has "
                f"{len(self.loss_mask)}"
            )

    @property
    def input_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.response_ids


@dataclass(frozen=True)
class Turn:
    """What happened in one turn of a trajectory (one action, and for MemSearcher one memory
    update)."""

    index: int
    prompt_tokens: int
    """Tokens in the context the model saw when it chose this turn's action."""
    generated_tokens: int
    """Tokens the model generated in this turn (action plus memory update)."""
    sequence_index: int
    """Which of the trajectory's training sequences holds this turn."""
    action_text: str
    thought: str | None = None
    query: str | None = None
    hits: tuple[Hit, ...] = ()
    memory_text: str | None = None
    """The raw memory-update generation, if this turn had one."""
    memory: str | None = None
    """The memory after this turn (MemSearcher only)."""
    answer: str | None = None
    error: str | None = None
    """The parse failure that ended the trajectory in this turn, if any."""
    repeated_query: str | None = None
    """A query searched before in the episode, written again in this turn and not searched:
    the agent was asked for its answer instead (``AgentConfig.answer_on_repeat``), or the
    episode ended there (``AgentConfig.repeat_ends``)."""


EndReason = Literal[
    "answer",
    "format_error",
    "max_turns",
    "length",
    "context_limit",
    "search_error",
    "cancelled",
    "repeated_query",
]
"""Why an episode ended; ``"cancelled"``: a server dropped it (its client hung up), and nobody
sees that trajectory; ``"repeated_query"``: it searched a query again under
``AgentConfig.repeat_ends``."""


@dataclass(frozen=True)
class Trajectory:
    """A whole episode of one agent on one question."""

    example: QAExample
    agent: str
    turns: tuple[Turn, ...]
    sequences: tuple[TokenSequence, ...]
    end_reason: EndReason
    answer: str | None = None
    error: str | None = None
    environment_reward: float | None = None
    """The environment's reward at the end (the shop's, at Buy Now); None where the answer is
    scored against the gold answers (search QA). Not the trainer's reward, which a reward
    function reads off the trajectory (``rl.rewards``) and samples files store as ``reward``."""

    @property
    def well_formed(self) -> bool:
        """True when the trajectory ended with a parsed answer and no format fault."""
        return self.end_reason == "answer" and self.answer is not None

    @property
    def num_searches(self) -> int:
        return sum(1 for turn in self.turns if turn.query is not None)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["well_formed"] = self.well_formed
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        example = QAExample(
            id=data["example"]["id"],
            question=data["example"]["question"],
            golden_answers=tuple(data["example"]["golden_answers"]),
            metadata=dict(data["example"].get("metadata", {})),
        )
        turns = tuple(
            Turn(**{**t, "hits": tuple(Hit(**h) for h in t.get("hits", ()))}) for t in data["turns"]
        )
        sequences = tuple(
            TokenSequence(
                prompt_ids=tuple(s["prompt_ids"]),
                response_ids=tuple(s["response_ids"]),
                loss_mask=tuple(s["loss_mask"]),
            )
            for s in data["sequences"]
        )
        return cls(
            example=example,
            agent=data["agent"],
            turns=turns,
            sequences=sequences,
            end_reason=data["end_reason"],
            answer=data.get("answer"),
            error=data.get("error"),
            environment_reward=data.get("environment_reward"),
        )
