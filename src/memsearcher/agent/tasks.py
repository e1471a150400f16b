"""The environments an agent can act in, by name: `ENVIRONMENTS`, the one registry that
evaluation (``eval --env``) and the trainers (``environment`` in the RL config) read.

An entry says how an agent's episodes start in the environment, which prompts they use, how a
training run opens its questions and the environment they act in, and whether the environment
gives a reward of its own. Adding an environment is its module in ``agent/environments/`` (with
a function that starts each agent's episodes in it) and an entry here (docs/architecture.md).

- ``search``: questions of a FlashRAG file (``data``), answered by searching a retriever
  (``retriever``), as every agent was built to.
- ``shop``: the instructions of one split of the generated shop (``shop``), or of several
  joined by ``+`` (``shop_split``, e.g. ``train+rl``), acted on in `ShopEnvironment`, rewarded
  by the shop at Buy Now.
- ``webshop``: the goals of a WebShop server (``webshop_url``, ``webshop_goals``), acted
  on over HTTP in `WebShopEnvironment`, rewarded by the server at Buy Now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from memsearcher.agent import start_episodes
from memsearcher.agent.base import AgentConfig, Episode
from memsearcher.agent.environments import Environment
from memsearcher.agent.environments.shop import (
    ShopEnvironment,
    ShopSearch,
    ShopSessions,
    instruction_example,
)
from memsearcher.agent.environments.shop_world import (
    Catalogue,
    ShopConfig,
    deal_ids,
    generate_catalogue,
)
from memsearcher.agent.environments.webshop_client import (
    WebShopEnvironment,
    fixed_sessions,
    goal_range,
)
from memsearcher.agent.prompts import Templates
from memsearcher.agent.shop_agents import ShopTemplates, start_shop_episodes
from memsearcher.data.flashrag import read_examples
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import Tokenizer
from memsearcher.retrieval import open_retriever
from memsearcher.retrieval.base import Retriever
from memsearcher.types import QAExample

__all__ = [
    "ENVIRONMENTS",
    "EnvironmentKind",
    "Opened",
    "command_line_shop",
    "environment_kind",
    "shop_catalogue",
]

StartEpisodes = Callable[
    [str, Sequence[QAExample], Tokenizer, AgentConfig | None, Any, int | None],
    Sequence[Episode[Any]],
]
"""``(agent, examples, tokenizer, agent config, templates, max context tokens)`` -> one fresh
episode each; None for the config or the templates means the environment's defaults."""

Opened = tuple[list[QAExample], Environment[Any, Any] | Retriever]
"""A training run's questions, and what their episodes act on."""


@dataclass(frozen=True)
class EnvironmentKind:
    """One entry of `ENVIRONMENTS`."""

    start_episodes: StartEpisodes
    templates: type[Any]
    """The dataclass of its prompts; a ``templates`` file overrides any field
    (`prompts.read_templates`)."""
    open: Callable[[Any], Opened]
    """A training run's questions and environment, from the run's config (the fields it
    reads are the environment's own settings, `SearchSettings` and `ShopSettings` here)."""
    own_reward: bool
    """Whether an episode ends with the environment's reward (``reward: environment``);
    else the trainers score its answer."""


class SearchSettings(Protocol):
    data: str
    retriever: str | None
    retriever_cache: int


class ShopSettings(Protocol):
    shop: ShopConfig
    shop_split: str
    shop_repeat_ends: bool
    shop_ids_from: int | None


def open_search(settings: SearchSettings) -> Opened:
    """The questions of ``data``, over the retriever ``retriever`` names."""
    questions = read_examples(settings.data)
    if not questions:
        raise MemSearcherError(f"{settings.data}: no questions to train on")
    return questions, open_retriever(settings.retriever, settings.retriever_cache)


def shop_catalogue(shop: ShopConfig, ids_from: int | None = None) -> Catalogue:
    """The shop ``shop`` generates; with ``ids_from``, its products under the ids of the shop
    of that seed, dealt by its own seed."""
    catalogue = generate_catalogue(shop)
    if ids_from is not None:
        owner = generate_catalogue(replace(shop, seed=ids_from))
        catalogue = deal_ids(catalogue, [product.asin for product in owner.products], shop.seed)
    return catalogue


def open_shop(settings: ShopSettings) -> Opened:
    """The instructions of ``shop_split`` (one split, or several joined by ``+``) of the shop
    ``shop`` generates, in sessions of that shop over its own BM25; with ``shop_ids_from``, its
    products under the ids of the shop of that seed (`shop_catalogue`)."""
    catalogue = shop_catalogue(settings.shop, settings.shop_ids_from)
    splits = settings.shop_split.split("+")
    questions = [instruction_example(i) for s in splits for i in catalogue.split(s)]
    if not questions:
        raise MemSearcherError(
            f"shop_split: the shop of {settings.shop} has no {settings.shop_split!r} instructions"
        )
    search = ShopSearch(catalogue.products)
    return questions, ShopEnvironment(catalogue, search, repeat_ends=settings.shop_repeat_ends)


class WebShopSettings(Protocol):
    webshop_url: str
    webshop_goals: tuple[int, int]


def open_webshop(settings: WebShopSettings) -> Opened:
    """The goals ``webshop_goals`` (``[A, B)``) of the WebShop server at ``webshop_url``, each
    read once for its instruction."""
    environment = WebShopEnvironment(settings.webshop_url)
    return environment.examples(fixed_sessions(*settings.webshop_goals)), environment


@dataclass
class _CommandLineShop:
    """`ShopSettings` and `WebShopSettings` from a command line's flags."""

    shop: ShopConfig
    shop_split: str
    shop_ids_from: int | None
    webshop_url: str
    webshop_goals: tuple[int, int]
    shop_repeat_ends: bool = False


def command_line_shop(args: Any, shop_split: str) -> tuple[list[QAExample], ShopSessions]:
    """The first ``args.limit`` tasks of the shop ``args.env`` names, and the environment they
    act in (to close: a WebShop one holds connections), from the flags ``eval --env`` and
    ``verl prepare --env`` share: for ``shop``, the instructions of ``shop_split`` of the shop
    of ``--shop-seed`` and ``--shop-families`` (and ``--shop-ids-from``); for ``webshop``, the
    goals ``--sessions A:B`` of the server at ``--webshop-url``."""
    if args.env == "webshop" and not args.webshop_url:
        raise MemSearcherError("--env webshop needs --webshop-url")
    sizes = {} if args.shop_families is None else {"families_per_category": args.shop_families}
    first, end = goal_range(args.sessions) if args.env == "webshop" else (0, 1)
    if args.limit is not None:
        end = min(end, first + args.limit)
    settings = _CommandLineShop(
        ShopConfig(seed=args.shop_seed, **sizes),
        shop_split,
        getattr(args, "shop_ids_from", None),
        args.webshop_url or "",
        (first, end),
    )
    tasks, environment = ENVIRONMENTS[args.env].open(settings)
    assert isinstance(environment, ShopSessions), args.env
    return tasks[: args.limit], environment


ENVIRONMENTS: dict[str, EnvironmentKind] = {
    "search": EnvironmentKind(start_episodes, Templates, open_search, False),
    "shop": EnvironmentKind(start_shop_episodes, ShopTemplates, open_shop, True),
    "webshop": EnvironmentKind(start_shop_episodes, ShopTemplates, open_webshop, True),
}


def environment_kind(name: str) -> EnvironmentKind:
    if name not in ENVIRONMENTS:
        raise MemSearcherError(
            f"unknown environment {name!r}; choose one of {sorted(ENVIRONMENTS)}"
        )
    return ENVIRONMENTS[name]
