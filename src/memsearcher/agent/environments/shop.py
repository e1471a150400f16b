"""The offline shop as an environment: WebShop's text mode, its actions, its reward.

WebShop (``web_agent_site/envs/web_agent_text_env.py``) serves HTML pages from a Flask app and,
in its ``text`` observation mode, gives the agent each page's visible strings joined by
``[SEP]``. The agent acts with ``search[keywords]`` (on the search page) and ``click[text]`` on
a clickable: ``Back to Search``, ``< Prev``, ``Next >``, a product id, an option value, ``Buy
Now``. Search returns the top 50 products of a BM25 index (pyserini), ten to a page. Buying
ends the episode with the reward of ``shop_reward``; every other step earns 0.

``ShopEnv`` renders the same pages as text directly, with no HTML or server, and searches with
the project's own BM25 (``retrieval/bm25.py``, bm25s's scores). It differs from WebShop in:

- the item page has no Description / Features / Reviews sub-pages and shows no rating: the
  title carries every attribute;
- ``search[...]`` is accepted on the search page only (WebShop runs it from any page), so the
  agent goes ``Back to Search`` as a person would;
- an invalid action gives the current page again, after a line saying why, and counts as a
  step (WebShop gives the page again, silently);
- an episode ends with reward 0 when ``max_steps`` actions pass without buying.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memsearcher.agent.environments.base import ActionRefused, Environment, Page, ShopAction
from memsearcher.agent.environments.shop_reward import shop_reward
from memsearcher.agent.environments.shop_world import (
    CATEGORIES,
    Catalogue,
    Goal,
    Instruction,
    Product,
)
from memsearcher.retrieval.bm25 import BM25Index, build_bm25
from memsearcher.retrieval.corpus import Passage, write_corpus
from memsearcher.types import QAExample

__all__ = [
    "BACK_TO_SEARCH",
    "BUY_NOW",
    "NEXT_PAGE",
    "PREV_PAGE",
    "SEP",
    "ShopEnv",
    "ShopEnvironment",
    "ShopSearch",
    "parse_action",
    "instruction_example",
    "solve",
]

SEP = " [SEP] "
BACK_TO_SEARCH = "Back to Search"
NEXT_PAGE = "Next >"
PREV_PAGE = "< Prev"
BUY_NOW = "Buy Now"
SEARCH_RETURN_N = 50
"""Products a search returns (WebShop's ``SEARCH_RETURN_N``)."""
PRODUCT_WINDOW = 10
"""Products per results page (WebShop's ``PRODUCT_WINDOW``)."""

_ACTION = re.compile(r"\s*(\w+)\[(.*)\]\s*", re.DOTALL)


def parse_action(action: str) -> tuple[str, str] | None:
    """``("search" | "click", argument)`` of ``search[...]`` / ``click[...]``, lower-cased as
    WebShop compares them; None for anything else."""
    match = _ACTION.fullmatch(action)
    if match is None or match.group(1).lower() not in ("search", "click"):
        return None
    return match.group(1).lower(), match.group(2).strip().lower()


class ShopSearch:
    """BM25 over product titles and departments, built in ``folder`` (a temporary one if
    None, removed with this object)."""

    def __init__(self, products: tuple[Product, ...], folder: str | Path | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="shop-bm25-") if folder is None else None
        root = Path(self._tmp.name if self._tmp else str(folder))
        root.mkdir(parents=True, exist_ok=True)
        self.asins = [p.asin for p in products]
        passages = [Passage(p.asin, p.title, " ".join(p.breadcrumb)) for p in products]
        write_corpus(root / "products.jsonl", passages)
        self.index: BM25Index = build_bm25(root / "products.jsonl", root / "bm25", overwrite=True)

    def search(self, query: str, top_n: int = SEARCH_RETURN_N) -> list[str]:
        """Ids of the best ``top_n`` products for ``query``, best first."""
        ((rows, _),) = self.index.search_rows([query], top_n)
        return [self.asins[row] for row in rows]


@dataclass
class _State:
    page: str = "search"
    """Which page is shown: search, results or item."""
    query: str = ""
    results: list[str] = field(default_factory=list)
    page_number: int = 1
    asin: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    """Option name -> value clicked on the current item page."""


class ShopEnv:
    """One episode of one instruction: ``reset()``, then ``step(action)`` until done."""

    def __init__(
        self,
        catalogue: Catalogue,
        search: ShopSearch,
        instruction: Instruction,
        max_steps: int = 15,
    ) -> None:
        self.products = {p.asin: p for p in catalogue.products}
        self.search = search
        self.instruction = instruction
        self.max_steps = max_steps
        self.state = _State()
        self.steps = 0
        self.done = False

    @property
    def goal(self) -> Goal:
        return self.instruction.goal

    def reset(self) -> str:
        """Start on the search page; returns its text."""
        self.state, self.steps, self.done = _State(), 0, False
        return self.observation()

    def available_actions(self) -> dict[str, Any]:
        """WebShop's ``get_available_actions``: whether ``search[...]`` is possible, and the
        lower-cased texts that ``click[...]`` accepts."""
        state = self.state
        clickables: list[str] = []
        if state.page == "results":
            clickables.append(BACK_TO_SEARCH)
            if state.page_number > 1:
                clickables.append(PREV_PAGE)
            if state.page_number * PRODUCT_WINDOW < len(state.results):
                clickables.append(NEXT_PAGE)
            clickables.extend(self._window())
        elif state.page == "item":
            assert state.asin is not None
            clickables += [BACK_TO_SEARCH, PREV_PAGE]
            for values in self.products[state.asin].options.values():
                clickables.extend(values)
            clickables.append(BUY_NOW)
        return {
            "has_search_bar": state.page == "search",
            "clickables": [c.lower() for c in clickables],
        }

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Apply ``action``; returns (observation, reward, done, info). Never raises on a bad
        action: the observation says what was wrong and ``info["valid"]`` is False. At Buy Now,
        ``info`` also holds ``bought`` (the id), ``options`` and the reward's parts; at the step
        limit, ``truncated``."""
        if self.done:
            return self._invalid("the episode is over"), 0.0, True, {"valid": False}
        self.steps += 1
        info: dict[str, Any]
        parsed = parse_action(action)
        error: str | None
        reward, info = 0.0, {}
        if parsed is None:
            error = "write search[keywords] or click[one of the clickables]"
        elif parsed[0] == "search":
            error = self._search(parsed[1])
        else:
            error, reward, info = self._click(parsed[1])
        if not self.done and self.steps >= self.max_steps:
            self.done = True
            info["truncated"] = True
        observation = self.observation() if error is None else self._invalid(error)
        return observation, reward, self.done, {"valid": error is None, **info}

    def observation(self) -> str:
        """The current page in WebShop's ``text`` mode."""
        state = self.state
        head = ["Instruction:", self.instruction.text]
        if state.page == "search":
            return SEP.join(["WebShop", *head, "Search"])
        if state.page == "results":
            texts = [*head, BACK_TO_SEARCH]
            texts.append(f"Page {state.page_number} (Total results: {len(state.results)})")
            clickables = self.available_actions()["clickables"]
            texts += [b for b in (PREV_PAGE, NEXT_PAGE) if b.lower() in clickables]
            for asin in self._window():
                product = self.products[asin]
                texts += [asin, product.title, f"${product.price:.2f}"]
            return SEP.join(texts)
        assert state.asin is not None
        product = self.products[state.asin]
        texts = [*head, BACK_TO_SEARCH, PREV_PAGE]
        for name, values in product.options.items():
            texts += [name, *values]
        texts += [product.title, f"Price: ${product.price:.2f}", BUY_NOW]
        return SEP.join(texts)

    def _window(self) -> list[str]:
        start = (self.state.page_number - 1) * PRODUCT_WINDOW
        return self.state.results[start : start + PRODUCT_WINDOW]

    def _invalid(self, why: str) -> str:
        return f"Invalid action: {why}.{SEP}{self.observation()}"

    def _search(self, query: str) -> str | None:
        if self.state.page != "search":
            return "search is only on the search page; click[back to search] first"
        if not query:
            return "search[...] needs keywords"
        self.state = _State("results", query, self.search.search(query))
        return None

    def _click(self, target: str) -> tuple[str | None, float, dict[str, Any]]:
        state = self.state
        if target not in self.available_actions()["clickables"]:
            return f"{target!r} is not a clickable on this page", 0.0, {}
        if target == BACK_TO_SEARCH.lower():
            self.state = _State()
        elif target == NEXT_PAGE.lower():
            state.page_number += 1
        elif target == PREV_PAGE.lower():
            if state.page == "item":
                state.page, state.asin, state.options = "results", None, {}
            else:
                state.page_number -= 1
        elif target == BUY_NOW.lower():
            assert state.asin is not None
            reward, parts = shop_reward(self.products[state.asin], state.options, self.goal)
            self.done = True
            return None, reward, {"bought": state.asin, "options": dict(state.options), **parts}
        elif state.page == "results":
            state.page, state.asin, state.options = "item", target.upper(), {}
        else:
            assert state.asin is not None
            for name, values in self.products[state.asin].options.items():
                if target in values:
                    state.options[name] = target
        return None, 0.0, {}


def solve(env: ShopEnv) -> list[str]:
    """The oracle: reset ``env``, search for the goal's type and attributes, page to the target
    product (searching its exact title if it is not among the results), click the goal's
    options, buy. Returns the actions taken."""
    goal = env.goal
    actions: list[str] = []

    def act(action: str) -> None:
        actions.append(action)
        env.step(action)

    env.reset()
    act(f"search[{' '.join([*goal.attributes, CATEGORIES[goal.category].kind])}]")
    target = goal.asin.lower()
    while target not in env.available_actions()["clickables"]:
        if NEXT_PAGE.lower() in env.available_actions()["clickables"]:
            act(f"click[{NEXT_PAGE}]")
            continue
        act(f"click[{BACK_TO_SEARCH}]")
        act(f"search[{env.products[goal.asin].title}]")
        break
    act(f"click[{goal.asin}]")
    for value in goal.options.values():
        act(f"click[{value}]")
    act(f"click[{BUY_NOW}]")
    return actions


class ShopEnvironment(Environment[ShopAction, Page]):
    """The shop behind the environment protocol: one `ShopEnv` session per instruction id,
    opened by the empty action (its start page), then stepped by each action. A session that
    ended is closed, so a new episode of the same instruction starts afresh."""

    def __init__(self, catalogue: Catalogue, search: ShopSearch, max_steps: int = 15) -> None:
        self.catalogue, self.search, self.max_steps = catalogue, search, max_steps
        self.instructions = {i.id: i for i in catalogue.instructions}
        self.sessions: dict[str, ShopEnv] = {}

    def act(self, actions: Sequence[ShopAction]) -> list[Page | ActionRefused]:
        return [self._act(action) for action in actions]

    def _act(self, action: ShopAction) -> Page | ActionRefused:
        if not action.text:
            instruction = self.instructions.get(action.session)
            if instruction is None:
                return ActionRefused(f"no instruction {action.session!r} in this shop")
            env = ShopEnv(self.catalogue, self.search, instruction, self.max_steps)
            self.sessions[action.session] = env
            return Page(env.reset())
        env_or_none = self.sessions.get(action.session)
        if env_or_none is None:
            return ActionRefused(f"session {action.session!r} was never opened")
        observation, reward, done, info = env_or_none.step(action.text)
        if done:
            del self.sessions[action.session]
        return Page(observation, reward, done, info.get("bought"))


def instruction_example(instruction: Instruction) -> QAExample:
    """An instruction as the task record the agents and drivers take: its text as the
    question, its target product as the gold answer."""
    return QAExample(
        id=instruction.id,
        question=instruction.text,
        golden_answers=(instruction.goal.asin,),
        metadata={"environment": "shop", "split": instruction.split},
    )
