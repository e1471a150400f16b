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
- an episode ends with reward 0 when ``max_steps`` actions pass without buying;
- with ``repeat_ends``, an invalid action written again right after itself, on the page it left
  unchanged, ends the episode with reward 0 (an option for RL's rollouts, off by default: a
  memory agent's prompt is then the same as the turn before, so a greedy decoder would write
  it again to the step limit, and sampling seldom pays for it).
"""

from __future__ import annotations

import re
import tempfile
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from memsearcher.agent.environments.base import (
    ActionRefused,
    AsyncEnvironment,
    Environment,
    Page,
    ShopAction,
    observed,
)
from memsearcher.agent.environments.shop_reward import shop_reward
from memsearcher.agent.environments.shop_world import (
    CATEGORIES,
    Catalogue,
    Goal,
    Instruction,
    Product,
)
from memsearcher.errors import MemSearcherError
from memsearcher.retrieval.bm25 import BM25Index, build_bm25
from memsearcher.retrieval.corpus import Passage, write_corpus
from memsearcher.types import QAExample

__all__ = [
    "BACK_TO_SEARCH",
    "BUY_NOW",
    "NEXT_PAGE",
    "PREV_PAGE",
    "SEP",
    "Element",
    "PageState",
    "ShopEnv",
    "ShopEnvironment",
    "ShopSearch",
    "available_actions",
    "check_action",
    "invalid_observation",
    "page_elements",
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
class PageState:
    """Where a shopper is: which page, and what it shows."""

    page: str = "search"
    """search, results or item; "done" only as where Buy Now leads."""
    query: str = ""
    results: list[str] = field(default_factory=list)
    page_number: int = 1
    asin: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    """Option name -> value clicked on the current item page."""


@dataclass(frozen=True)
class Element:
    """One thing a page shows, in page order: the one definition of the pages, which the text
    mode (``ShopEnv``) and the HTML (``shop_server``) are both rendered from.

    ``kind`` is ``text``, ``instruction``, ``search`` (the search box and its button),
    ``button``, ``link`` (a product id) or ``radio`` (an option value; ``name`` is its option).
    A clickable's ``goto`` is the state its click leads to."""

    kind: str
    text: str
    goto: PageState | None = None
    name: str = ""

    @property
    def texts(self) -> list[str]:
        """Its visible strings, as WebShop's text mode reads them off the HTML."""
        return ["Instruction:", self.text] if self.kind == "instruction" else [self.text]


def page_elements(
    state: PageState, products: Mapping[str, Product], instruction: str
) -> list[Element]:
    """The page ``state`` shows, laid out as WebShop's templates lay it out."""
    head = Element("instruction", instruction)
    if state.page == "search":
        return [Element("text", "WebShop"), head, Element("search", "Search")]
    back = Element("button", BACK_TO_SEARCH, PageState())
    if state.page == "results":
        number, total = state.page_number, len(state.results)
        elements = [head, back, Element("text", f"Page {number} (Total results: {total})")]
        if number > 1:
            elements.append(Element("button", PREV_PAGE, replace(state, page_number=number - 1)))
        if number * PRODUCT_WINDOW < total:
            elements.append(Element("button", NEXT_PAGE, replace(state, page_number=number + 1)))
        start = (number - 1) * PRODUCT_WINDOW
        for asin in state.results[start : start + PRODUCT_WINDOW]:
            product = products[asin]
            item = replace(state, page="item", asin=asin, options={})
            elements.append(Element("link", asin, item))
            elements += [Element("text", product.title), Element("text", f"${product.price:.2f}")]
        return elements
    assert state.asin is not None
    product = products[state.asin]
    prev = replace(state, page="results", asin=None, options={})
    elements = [head, back, Element("button", PREV_PAGE, prev)]
    for name, values in product.options.items():
        elements.append(Element("text", name))
        for value in values:
            chosen = replace(state, options={**state.options, name: value})
            elements.append(Element("radio", value, chosen, name))
    elements += [Element("text", product.title), Element("text", f"Price: ${product.price:.2f}")]
    elements.append(Element("button", BUY_NOW, replace(state, page="done")))
    return elements


def available_actions(elements: list[Element]) -> dict[str, Any]:
    """WebShop's ``get_available_actions`` of a page: whether ``search[...]`` is possible, and
    the lower-cased texts that ``click[...]`` accepts."""
    return {
        "has_search_bar": any(e.kind == "search" for e in elements),
        "clickables": [e.text.lower() for e in elements if e.goto is not None],
    }


def check_action(
    action: str, available: Mapping[str, Any]
) -> tuple[tuple[str, str] | None, str | None]:
    """``(parsed action, None)`` when ``action`` can be taken on a page that offers
    ``available``; ``(None, why not)`` otherwise. Both environments ask this, so they refuse
    the same actions with the same words."""
    parsed = parse_action(action)
    if parsed is None:
        return None, "write search[keywords] or click[one of the clickables]"
    kind, argument = parsed
    if kind == "search" and not available["has_search_bar"]:
        return None, "search is only on the search page; click[back to search] first"
    if kind == "search" and not argument:
        return None, "search[...] needs keywords"
    if kind == "click" and argument not in available["clickables"]:
        return None, f"{argument!r} is not a clickable on this page"
    return parsed, None


def invalid_observation(why: str, page: str) -> str:
    """What an invalid action shows: the reason, then the page again."""
    return f"Invalid action: {why}.{SEP}{page}"


EPISODE_OVER = "the episode is over"


class ShopEnv:
    """One episode of one instruction: ``reset()``, then ``step(action)`` until done."""

    def __init__(
        self,
        catalogue: Catalogue,
        search: ShopSearch,
        instruction: Instruction,
        max_steps: int = 15,
        repeat_ends: bool = False,
    ) -> None:
        self.products = {p.asin: p for p in catalogue.products}
        self.search = search
        self.instruction = instruction
        self.max_steps = max_steps
        self.repeat_ends = repeat_ends
        self.state = PageState()
        self.steps = 0
        self.done = False
        self.last_invalid: str | None = None

    @property
    def goal(self) -> Goal:
        return self.instruction.goal

    def reset(self) -> str:
        """Start on the search page; returns its text."""
        self.state, self.steps, self.done = PageState(), 0, False
        self.last_invalid = None
        return self.observation()

    def elements(self) -> list[Element]:
        return page_elements(self.state, self.products, self.instruction.text)

    def available_actions(self) -> dict[str, Any]:
        """WebShop's ``get_available_actions``: whether ``search[...]`` is possible, and the
        lower-cased texts that ``click[...]`` accepts."""
        return available_actions(self.elements())

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Apply ``action``; returns (observation, reward, done, info). Never raises on a bad
        action: the observation says what was wrong and ``info["valid"]`` is False. At Buy Now,
        ``info`` also holds ``bought`` (the id), ``options`` and the reward's parts; at the step
        limit, ``truncated``; where ``repeat_ends`` ends the episode, ``repeated``."""
        if self.done:
            over = invalid_observation(EPISODE_OVER, self.observation())
            return over, 0.0, True, {"valid": False}
        self.steps += 1
        info: dict[str, Any] = {}
        reward = 0.0
        parsed, error = check_action(action, self.available_actions())
        if parsed is not None and parsed[0] == "search":
            self.state = PageState("results", parsed[1], self.search.search(parsed[1]))
        elif parsed is not None:
            reward, info = self._click(parsed[1])
        if error is not None and self.repeat_ends and action == self.last_invalid:
            self.done = True
            info["repeated"] = True
        self.last_invalid = action if error is not None else None
        if not self.done and self.steps >= self.max_steps:
            self.done = True
            info["truncated"] = True
        observation = self.observation()
        if error is not None:
            observation = invalid_observation(error, observation)
        return observation, reward, self.done, {"valid": error is None, **info}

    def observation(self) -> str:
        """The current page in WebShop's ``text`` mode."""
        return SEP.join(text for element in self.elements() for text in element.texts)

    def _click(self, target: str) -> tuple[float, dict[str, Any]]:
        goto = {e.text.lower(): e.goto for e in self.elements() if e.goto is not None}[target]
        if goto.page != "done":
            self.state = goto
            return 0.0, {}
        assert goto.asin is not None
        reward, parts = shop_reward(self.products[goto.asin], goto.options, self.goal)
        self.done = True  # the page stays the item page: the episode is over
        return reward, {"bought": goto.asin, "options": dict(goto.options), **parts}


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


class ShopSessions(Environment[ShopAction, Page], AsyncEnvironment[ShopAction, Page]):
    """What a shop behind the environment protocol does with its sessions: the empty action
    opens one (`open`, on the goal the session's name gives before any ``#``, so that the
    episodes of a GRPO group each shop in a session of their own) and shows its start page,
    each other action steps it, and a session is closed when its episode ends. Opening a
    session again starts it afresh, so an episode cut short (a format error) leaves nothing
    behind once its name is used again. For the async driver an action runs in the event
    loop itself, unless a subclass says otherwise."""

    def __init__(self) -> None:
        self.sessions: dict[str, Any] = {}
        """Session name -> its env (`ShopEnv`'s API: ``step(action)``)."""

    @abstractmethod
    def open(self, name: str) -> tuple[Any, str]:
        """A new env on the goal ``name`` names, and its start page; raises `ActionRefused`
        for this episode alone."""

    def act(self, actions: Sequence[ShopAction]) -> list[Page | ActionRefused]:
        return [self.act_now(action) for action in actions]

    async def act_one(self, action: ShopAction) -> Page:
        return observed(self.act_now(action))

    def act_now(self, action: ShopAction) -> Page | ActionRefused:
        if not action.text:
            try:
                env, start = self.open(action.session.partition("#")[0])
            except ActionRefused as refused:
                return refused
            self.sessions[action.session] = env
            return Page(start)
        env = self.sessions.get(action.session)
        if env is None:
            return ActionRefused(f"session {action.session!r} was never opened")
        observation, reward, done, info = env.step(action.text)
        if done:
            del self.sessions[action.session]
        return Page(observation, reward, done, info.get("bought"))

    def close(self) -> None:
        """Frees what the shop holds outside the process: nothing here (a server's
        environment closes its connections)."""


class ShopEnvironment(ShopSessions):
    """The shop behind the environment protocol: one `ShopEnv` a session, on the instruction
    the session names (`ShopAction`). ``max_steps`` and ``repeat_ends`` are `ShopEnv`'s. The
    async driver's actions run in the event loop: a page is a lookup, a search a few
    milliseconds over the shop's few hundred products."""

    def __init__(
        self,
        catalogue: Catalogue,
        search: ShopSearch,
        max_steps: int = 15,
        repeat_ends: bool = False,
    ) -> None:
        super().__init__()
        self.catalogue, self.search, self.max_steps = catalogue, search, max_steps
        self.repeat_ends = repeat_ends
        self.instructions = {i.id: i for i in catalogue.instructions}

    def open(self, name: str) -> tuple[ShopEnv, str]:
        instruction = self.instructions.get(name)
        if instruction is None:  # the tasks are another shop's: no episode could run
            raise MemSearcherError(
                f"no instruction {name!r} in this shop (seed {self.catalogue.config.seed}):"
                " were the tasks made from a shop of another seed or size?"
            )
        env = ShopEnv(self.catalogue, self.search, instruction, self.max_steps, self.repeat_ends)
        return env, env.reset()


def instruction_example(instruction: Instruction) -> QAExample:
    """An instruction as the task record the agents and drivers take: its text as the
    question, its target product as the gold answer."""
    return QAExample(
        id=instruction.id,
        question=instruction.text,
        golden_answers=(instruction.goal.asin,),
        metadata={"environment": "shop", "split": instruction.split},
    )
