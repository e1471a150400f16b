"""The environment protocol: what an episode's actions act on, and what comes back.

An episode is a step machine (``agent.base``): it starts from its task's observation (for
search QA, the question), then asks for one thing at a time, a generation (`Generate`) or an
action on its environment (an `Action`), and takes the answer back: a completion, or an
observation (`Episode.on_observation`). It ends when the model answers, fails, or runs out of
turns, and the reward is read off the finished trajectory (``memsearcher.rl.rewards``).

The drivers never look inside an action: the lockstep driver hands every action of a round to
the environment in one call (`Environment.act`), so an environment that batches (a search
index) gets a batch; the async driver awaits each action on its own
(`AsyncEnvironment.act_one`), and the environment merges what is in flight.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from memsearcher.retrieval.base import SearchRefused
from memsearcher.types import Hit

__all__ = [
    "Action",
    "ActionRefused",
    "AsyncEnvironment",
    "Environment",
    "Observation",
    "Page",
    "Search",
    "ShopAction",
    "observed",
]


@dataclass(frozen=True)
class Search:
    """Search QA's action: one query against the retriever, for ``top_n`` passages."""

    query: str
    top_n: int


@dataclass(frozen=True)
class ShopAction:
    """The shop's action (``environments.shop``): WebShop's ``search[...]`` or ``click[...]``
    in one session; the empty text opens the session on its start page.

    A session is named ``"<instruction id>"`` or ``"<instruction id>#<k>"``: the shop opens it
    on the instruction before the ``#``, so several episodes of one instruction (a GRPO
    group) each shop in a session of their own."""

    session: str
    text: str


@dataclass(frozen=True)
class Page:
    """The shop's observation: a page in WebShop's text mode, the reward (0 until Buy Now)
    and whether the episode is over."""

    text: str
    reward: float = 0.0
    done: bool = False
    bought: str | None = None
    """The id of the product bought, on the page that ends the episode at Buy Now."""


Action = Search | ShopAction
"""What an episode asks its environment to do."""

Observation = Sequence[Hit] | Page
"""What the environment gives back for an action: passages, or a page."""

ActionRefused = SearchRefused
"""The environment refuses this action alone (a query the retrieval server will not take): the
driver ends only the episode that asked (``"search_error"``), and the others go on."""


ActionT = TypeVar("ActionT", contravariant=True)
ObservationT = TypeVar("ObservationT", covariant=True)


class Environment(ABC, Generic[ActionT, ObservationT]):
    """Acts for the lockstep driver: every action of a round in one call."""

    @abstractmethod
    def act(self, actions: Sequence[ActionT]) -> list[ObservationT | ActionRefused]:
        """One observation per action, in order, or the refusal of an action that fails alone."""


def observed(result: ObservationT | ActionRefused) -> ObservationT:
    """One result of `Environment.act` as `AsyncEnvironment.act_one` gives it: the
    observation, or the refusal raised."""
    if isinstance(result, ActionRefused):
        raise result
    return result


class AsyncEnvironment(ABC, Generic[ActionT, ObservationT]):
    """Acts for the async driver, one action per call; ``async with`` it around a run."""

    @abstractmethod
    async def act_one(self, action: ActionT) -> ObservationT:
        """The observation of ``action``; raises `ActionRefused` if it fails alone."""

    async def __aenter__(self) -> AsyncEnvironment[ActionT, ObservationT]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None
