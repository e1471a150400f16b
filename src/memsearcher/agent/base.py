"""What both agents share: their config, the requests they make, and the episode bookkeeping.

An agent is a pure step machine. An episode asks for one thing at a time (`Generate`, or an
action on its environment: `Search` for search QA, ``agent.environments``); a driver runs the
request and hands back the result. Episodes never call a model or an environment themselves,
so one driver can batch many of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from memsearcher.agent.environments import Action, Search
from memsearcher.agent.parsing import (
    FinalAnswer,
    ParseFailure,
    ToolCall,
    parse_action,
    parse_memory,
)
from memsearcher.agent.prompts import TOOL_NAME, Templates
from memsearcher.config import count
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import Completion, Tokenizer
from memsearcher.text import sanitize_text
from memsearcher.types import EndReason, QAExample, TokenSequence, Trajectory, Turn

MAX_TURNS = 1000
"""More turns than any search episode needs (the paper evaluates with 20); each is a model call
and, in training, a sequence held until the step's update."""
MAX_GENERATION_TOKENS = 1 << 20
"""A generation budget past a million tokens exceeds the context of the models we run."""
MAX_TOP_N = 1000
"""Passages per search; a thousand passages do not fit in any prompt."""


@dataclass(frozen=True)
class AgentConfig:
    """How an agent runs one question."""

    max_turns: int = 5
    """Turns before the episode is cut (5 in training, 20 in the paper's evaluation)."""
    memory_tokens: int = 1024
    """Generation budget of a memory update, and so the memory's size cap (MemSearcher)."""
    max_new_tokens: int = 512
    """Generation budget of one action (think, then a tool call or an answer)."""
    top_n: int = 5
    """Passages per search when the tool call does not say."""
    max_top_n: int = 10
    """Upper bound on a ``top_n`` the model asks for."""
    answer_on_repeat: bool = False
    """A query the episode has searched already is not searched again: the agent is asked for
    its answer instead (the action is replaced by ``Templates.answer_lead`` and the model
    writes the answer after it). An aid for greedy decoding, where a repeated query that leaves
    the memory as it was is a loop to the turn limit. MemSearcher and ReAct only."""
    repeat_ends: bool = False
    """A query the episode has searched already ends it (end reason ``"repeated_query"``, so no
    answer and reward 0), the repeated action scored with the rest. For RL: in sampled rollouts
    a repeat is often followed by a right answer and earns its full reward, so nothing teaches
    the policy away from the repeat that greedy decoding turns into a loop (the shop's
    ``repeat_ends`` does the same for invalid actions). MemSearcher and ReAct only."""

    def __post_init__(self) -> None:
        count(self, "max_turns", MAX_TURNS)
        for name in ("memory_tokens", "max_new_tokens"):
            count(self, name, MAX_GENERATION_TOKENS)
        for name in ("top_n", "max_top_n"):
            count(self, name, MAX_TOP_N)
        if self.top_n > self.max_top_n:
            raise ValueError(f"top_n ({self.top_n}) exceeds max_top_n ({self.max_top_n})")
        if self.answer_on_repeat and self.repeat_ends:
            raise ValueError("answer_on_repeat and repeat_ends both take a repeated query: set one")


def check_trainable(config: AgentConfig, key: str) -> None:
    """Refuse, under the config key ``key``, agent settings a trainer cannot score."""
    if config.answer_on_repeat:
        raise MemSearcherError(
            f"{key}.answer_on_repeat is for inference: in training it would drop the repeated "
            "query from the sequence, so the policy would never be scored for it"
        )


@dataclass(frozen=True)
class Generate:
    """Continue ``prompt_ids`` with the model."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    stop: tuple[str, ...]


Request = Generate | Action

TurnCallback = Callable[[int, Turn], None]
"""``on_turn(episode_index, turn)``: how a driver reports each turn as it closes."""

ACTION_STOP = ("</tool_call>",)
MEMORY_STOP = ("</memory>",)


@dataclass
class _Draft:
    """The turn being built."""

    index: int
    prompt_tokens: int
    sequence_index: int
    generated_tokens: int = 0
    fields: dict[str, Any] = field(default_factory=dict)


ObservationT = TypeVar("ObservationT")


class Episode(ABC, Generic[ObservationT]):
    """One agent on one question: the bookkeeping shared by MemSearcher and ReAct.

    It keeps the current training sequence (prompt, response, loss mask), the finished
    sequences and turns, and how the episode ended. Subclasses decide what comes next.
    """

    agent_name = "agent"
    answers_on_repeat = False
    """Whether the episode honours ``AgentConfig.answer_on_repeat`` and ``repeat_ends`` (its
    actions go through `take_action`); one that would ignore them refuses them."""

    def __init__(
        self,
        example: QAExample,
        tokenizer: Tokenizer,
        config: AgentConfig,
        templates: Templates,
        max_context_tokens: int | None,
    ) -> None:
        for option in ("answer_on_repeat", "repeat_ends"):
            if getattr(config, option) and not self.answers_on_repeat:
                raise MemSearcherError(
                    f"{option}: {type(self).__name__} writes its own actions, which the "
                    "option cannot see"
                )
        self.example = example
        self.tokenizer = tokenizer
        self.config = config
        self.templates = templates
        self.max_context_tokens = max_context_tokens
        self.turns: list[Turn] = []
        self.sequences: list[TokenSequence] = []
        self.prompt_ids: list[int] = []
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.draft: _Draft | None = None
        self.pending: Request | None = None
        self.end_reason: EndReason | None = None
        self.answer: str | None = None
        self.error: str | None = None
        self.environment_reward: float | None = None
        """The environment's reward at the end, where it gives one (the shop)."""
        self.lead = ""
        """Text the episode wrote at the head of the pending action (`ask_for_answer`)."""
        self.begin()

    # -- the driver's side ------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.end_reason is not None

    def next_request(self) -> Request | None:
        """What the episode needs now; None once it has ended."""
        return None if self.done else self.pending

    @abstractmethod
    def begin(self) -> None:
        """Build the first context and request the first generation."""

    @abstractmethod
    def on_generation(self, completion: Completion) -> None:
        """Take the model's output for the pending `Generate`."""

    @abstractmethod
    def on_observation(self, observation: ObservationT) -> None:
        """Take the environment's observation for the pending action (search QA: the hits
        of the pending `Search`)."""

    def result(self) -> Trajectory:
        if self.end_reason is None:
            raise RuntimeError("the episode has not ended yet")
        return Trajectory(
            example=self.example,
            agent=self.agent_name,
            turns=tuple(self.turns),
            sequences=tuple(self.sequences),
            end_reason=self.end_reason,
            answer=self.answer,
            error=self.error,
            environment_reward=self.environment_reward,
        )

    # -- helpers for the agents ---------------------------------------------------------------

    def render_prompt(self, messages: Sequence[dict[str, str]]) -> None:
        """Start a new training sequence whose prompt is ``messages`` in the chat template.

        Questions, passages and memories are text from outside: a special token written in them
        (``<|im_end|>``) stays text, so it cannot end a message or open a turn.
        """
        self.prompt_ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        self.response_ids, self.loss_mask = [], []

    def context_ids(self) -> tuple[int, ...]:
        return tuple(self.prompt_ids + self.response_ids)

    def request_generation(self, max_new_tokens: int, stop: tuple[str, ...]) -> None:
        context = self.context_ids()
        if (
            self.max_context_tokens is not None
            and len(context) + max_new_tokens > self.max_context_tokens
        ):
            self.end(
                "context_limit",
                f"context of {len(context)} tokens plus {max_new_tokens} "
                f"new ones exceeds the model's {self.max_context_tokens}",
            )
            return
        self.pending = Generate(context, max_new_tokens, stop)

    def take_generation(self, completion: Completion) -> str:
        """Append generated tokens (mask 1); return their text without a trailing EOS."""
        ids = list(completion.token_ids)
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        assert self.draft is not None
        self.draft.generated_tokens += len(ids)
        while ids and ids[-1] in self.tokenizer.eos_token_ids:
            ids.pop()
        return sanitize_text(self.tokenizer.decode(ids))

    def insert_user_message(self, content: str) -> None:
        """Close the assistant message, add a user message, open the next assistant message.

        The glue comes from the model's own chat template, and all of it has loss mask 0;
        ``content`` stays text, as in :meth:`render_prompt`.
        """
        sentinel = "\x00memsearcher-sentinel\x00"
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": sentinel},
            {"role": "user", "content": content},
        ]
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True, after=1)
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)

    def start_turn(self) -> None:
        self.draft = _Draft(
            index=len(self.turns),
            prompt_tokens=len(self.prompt_ids) + len(self.response_ids),
            sequence_index=len(self.sequences),
        )

    def close_turn(self) -> None:
        assert self.draft is not None
        draft, self.draft = self.draft, None
        self.turns.append(
            Turn(
                index=draft.index,
                prompt_tokens=draft.prompt_tokens,
                generated_tokens=draft.generated_tokens,
                sequence_index=draft.sequence_index,
                **draft.fields,
            )
        )

    def close_sequence(self) -> None:
        if self.response_ids:
            self.sequences.append(
                TokenSequence(
                    tuple(self.prompt_ids), tuple(self.response_ids), tuple(self.loss_mask)
                )
            )
        self.prompt_ids, self.response_ids, self.loss_mask = [], [], []

    def end(self, reason: EndReason, error: str | None = None) -> None:
        """Finish the episode, keeping the partial turn and sequence for training."""
        if self.draft is not None and "action_text" not in self.draft.fields:
            self.draft = None  # ended before the model acted: no turn took place
        if self.draft is not None:
            if error is not None:
                self.draft.fields["error"] = error
            self.close_turn()
        self.close_sequence()
        self.end_reason, self.error, self.pending = reason, error, None

    def take_memory(self, completion: Completion) -> str | None:
        """Record a memory update; return the new memory, or end the episode on a fault."""
        text = self.take_generation(completion)
        assert self.draft is not None
        self.draft.fields["memory_text"] = text
        memory = parse_memory(text)
        if isinstance(memory, ParseFailure):
            if completion.finish_reason == "length" and memory.kind == "unclosed_memory":
                detail = f"memory exceeded its cap of {self.config.memory_tokens} tokens"
            else:
                detail = memory.detail
            self.end("format_error", f"{memory.kind}: {detail}")
            return None
        self.draft.fields["memory"] = memory
        return memory

    def take_action(self, completion: Completion) -> ToolCall | None:
        """Record an action; end the episode on an answer or a fault, else return the call
        (or, with ``answer_on_repeat``, ask for the answer in place of a repeated query; with
        ``repeat_ends``, end the episode on it)."""
        start, lead = len(self.response_ids), self.lead
        self.lead = ""
        text = lead + self.take_generation(completion)
        assert self.draft is not None
        self.draft.fields["action_text"] = text
        parsed = parse_action(text, tool_name=TOOL_NAME)
        if isinstance(parsed, ParseFailure):
            if completion.finish_reason == "length":
                self.end("length", f"action cut at {self.config.max_new_tokens} tokens")
            else:
                self.end("format_error", f"{parsed.kind}: {parsed.detail}")
            return None
        if not lead:  # the lead's thought is the episode's, not the model's
            self.draft.fields["thought"] = parsed.think
        if isinstance(parsed.action, FinalAnswer):
            self.draft.fields["answer"] = parsed.action.answer
            if completion.finish_reason == "length":
                self.end("length", f"answer cut at {self.config.max_new_tokens} tokens")
            else:
                self.answer = parsed.action.answer
                self.end("answer")
            return None
        call = parsed.action
        if lead:  # a tool call after the answer's lead: the model did not answer when asked
            self.end("format_error", "a tool call where the answer was asked for")
            return None
        if self.config.answer_on_repeat and _searched(call.query, self.turns):
            self.ask_for_answer(start, call.query)
            return None
        if self.config.repeat_ends and _searched(call.query, self.turns):
            self.draft.fields["repeated_query"] = call.query
            self.end("repeated_query", f"searched before: {call.query}")
            return None
        self.draft.fields["query"] = call.query
        top_n = min(call.top_n or self.config.top_n, self.config.max_top_n)
        self.pending = Search(call.query, top_n)
        return call

    def ask_for_answer(self, start: int, query: str) -> None:
        """Drop the action that began at ``start`` in the response (its tokens no longer count
        as the turn's) and request it again after ``Templates.answer_lead`` (loss mask 0: the
        episode wrote it, not the model)."""
        assert self.draft is not None
        lead = self.templates.answer_lead.format()
        self.draft.generated_tokens -= len(self.response_ids) - start
        self.draft.fields.update(repeated_query=query, action_text=lead, thought=None)
        del self.response_ids[start:], self.loss_mask[start:]
        ids = self.tokenizer.encode(lead)
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.lead = lead
        self.request_generation(self.config.max_new_tokens, ACTION_STOP)


def _searched(query: str, turns: Sequence[Turn]) -> bool:
    """Whether ``query`` was searched in ``turns``, case and spacing aside (and whatever
    ``top_n`` either asked for)."""
    key = " ".join(query.split()).casefold()
    return any(t.query is not None and " ".join(t.query.split()).casefold() == key for t in turns)
