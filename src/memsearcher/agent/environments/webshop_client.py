"""A shop over HTTP: ``WebShopHTTPEnv`` acts on a WebShop server and reads its pages as text.

The server is either this project's shop (``shop_server``) or princeton-nlp's WebShop, run by
the user (``web_agent_site/app.py``, port 3000). The env is a small browser, as WebShop's own
``WebAgentSiteEnv`` (``web_agent_site_env.py``) drives selenium:

- ``search[kw]`` fills ``input#search_input`` and submits its form (POST; the server
  redirects to the results);
- ``click[text]`` follows the clickable with that text: a ``.btn`` submits its form (POST),
  an ``a.product-link`` is followed (GET), an ``input[type=radio]`` loads its ``data-url``
  (GET; WebShop's page script does this on click);
- a page with ``#reward pre`` is the done page: its number is the reward and the episode ends.

Observations are WebShop's ``text`` mode (``WebAgentTextEnv.convert_html_to_text`` with
``simple=True``): the visible strings of the page, stripped, joined by ``" [SEP] "``;
clickables are read as its ``get_available_actions`` reads them (``.btn`` and
``.product-link`` texts lower-cased, radio values). Actions are parsed and refused as
``ShopEnv`` refuses them (``shop.check_action``), with the same messages.

Where this differs from WebShop's text env:

- whitespace-only strings are dropped (WebShop keeps any that is not exactly ``"\\n"``, which
  gives empty ``[SEP]`` fields); text is read with the stdlib ``html.parser``, not
  BeautifulSoup;
- ``search`` is possible only where the page has a search box, as in a browser (WebShop's
  ``SimServer`` runs a search from any page); the search button is not listed as a clickable
  (WebShop lists it, then refuses ``click[search]``);
- radio values are lower-cased like the other clickables (WebShop keeps their case, so a
  value with capitals cannot be clicked there);
- an invalid action, or a page the server refuses, shows the page again after a line saying
  why and counts as a step; after ``max_steps`` steps the episode ends with reward 0.

Against ``ShopEnv`` on the same shop, observations are equal action for action except after
Buy Now: this env shows the done page (as WebShop does), ``ShopEnv`` the item page; ``info``
at Buy Now holds ``bought`` and ``options`` read off the done page, not the reward's parts.

Verified here only against this project's server on 127.0.0.1 (tests/test_shop_server.py).
princeton-nlp's server could not be run here (no internet, no product data): the routes, the
form, the element ids and classes and the ``#reward`` page are taken from its source, not from
a run against it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urljoin

from memsearcher.agent.environments.base import ActionRefused, Page, ShopAction, observed
from memsearcher.agent.environments.shop import (
    EPISODE_OVER,
    SEP,
    ShopSessions,
    check_action,
    invalid_observation,
)
from memsearcher.errors import MemSearcherError
from memsearcher.types import QAExample

if TYPE_CHECKING:
    import httpx

__all__ = [
    "Clickable",
    "WebPage",
    "WebShopEnvironment",
    "WebShopHTTPEnv",
    "episode_session",
    "fixed_sessions",
    "goal_range",
    "read_page",
]

logger = logging.getLogger(__name__)

MAX_PAGE_BYTES = 8 << 20
"""Largest page read; WebShop's pages are a few kilobytes."""
_HIDDEN = {"style", "script", "head", "title", "meta", "[document]"}
"""Tags whose text WebShop's ``tag_visible`` leaves out."""
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source"}
_PRE_IDS = {"reward", "asin", "options"}
"""Ids on the done page whose ``<pre>`` holds a value."""


@dataclass(frozen=True)
class Clickable:
    """What a click does: a request."""

    method: str
    url: str


@dataclass
class WebPage:
    """What the env reads off one page."""

    url: str
    texts: list[str] = field(default_factory=list)
    """Visible strings, stripped, in page order."""
    clickables: dict[str, Clickable] = field(default_factory=dict)
    search: tuple[Clickable, str] | None = None
    """The search form's request and its text field's name, if the page has a search box."""
    instruction: list[str] = field(default_factory=list)
    """Strings of ``#instruction-text``."""
    values: dict[str, str] = field(default_factory=dict)
    """Id -> text of its ``<pre>``, for the done page's ``reward``, ``asin``, ``options``."""


class _Reader(HTMLParser):
    def __init__(self, page: WebPage) -> None:
        super().__init__(convert_charrefs=True)
        self.page = page
        self.stack: list[tuple[str, dict[str, str]]] = []
        self.form = Clickable("GET", page.url)
        self.open: list[tuple[int, Clickable, list[str]]] = []
        """Clickables being read: the depth of the tag that holds one, its request, its text
        so far."""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if tag == "form":
            self.form = Clickable(a.get("method", "get").upper(), self._url(a.get("action", "")))
        if tag == "input" and a.get("id") == "search_input":
            self.page.search = (self.form, a.get("name", "search_query"))
        if tag == "input" and a.get("type", "").lower() == "radio":
            self.page.clickables[a.get("value", "").lower()] = Clickable(
                "GET", self._url(a.get("data-url", ""))
            )
        if "btn" in classes:
            self.open.append((len(self.stack), self.form, []))
        elif "product-link" in classes:
            link = Clickable("GET", self._url(a.get("href", "")))
            self.open.append((len(self.stack), link, []))
        if tag not in _VOID:
            self.stack.append((tag, a))

    def handle_endtag(self, tag: str) -> None:
        if tag not in (t for t, _ in self.stack):
            return  # a stray end tag (WebShop's results page closes <h4> with </h5>)
        while self.stack and self.stack.pop()[0] != tag:
            pass
        while self.open and self.open[-1][0] >= len(self.stack):
            _, clickable, text = self.open.pop()
            self.page.clickables[" ".join(text).lower()] = clickable

    def handle_data(self, data: str) -> None:
        parent = self.stack[-1][0] if self.stack else "[document]"
        text = data.strip()
        if parent in _HIDDEN or not text:
            return
        self.page.texts.append(text)
        for _, _, buffer in self.open:
            buffer.append(text)
        ids = [a["id"] for _, a in self.stack if a.get("id")]
        if "instruction-text" in ids:
            self.page.instruction.append(text)
        # a <pre> holds the value of the nearest element with an id around it (WebShop's done
        # page leaves its asin <h4> open, around the target's <pre>s that follow)
        if parent == "pre" and ids and ids[-1] in _PRE_IDS:
            self.page.values.setdefault(ids[-1], text)

    def _url(self, link: str) -> str:
        return urljoin(self.page.url, link)


def read_page(html: str, url: str) -> WebPage:
    """What WebShop's envs read off the page ``html`` found at ``url``."""
    page = WebPage(url)
    reader = _Reader(page)
    reader.feed(html)
    reader.close()
    return page


class WebShopHTTPEnv:
    """One episode on a WebShop server at ``base_url``, in session ``session`` (``fixed_<i>``,
    or ``i``): ``reset()``, then ``step(action)`` until done; the API of ``ShopEnv``. A
    ``client`` passed in must follow redirects (a search is answered with one) and stays
    open; a ``with`` block closes the env's own connections."""

    def __init__(
        self,
        base_url: str,
        session: str | int,
        max_steps: int = 15,
        timeout: float = 30.0,
        client: httpx.Client | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.session = f"fixed_{session}" if isinstance(session, int) else session
        self.max_steps = max_steps
        self._httpx = _import_httpx()
        self.owns_client = client is None
        self.http = client or self._httpx.Client(timeout=timeout, follow_redirects=True)
        self.page = WebPage(self.base_url)
        self.instruction_text = ""
        self.steps = 0
        self.done = False

    def close(self) -> None:
        if self.owns_client:
            self.http.close()

    def __enter__(self) -> WebShopHTTPEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> str:
        """Open the session's search page; returns its text. Raises ``MemSearcherError`` when
        the server cannot be reached, refuses the session, or sends no WebShop page."""
        url = f"{self.base_url}/{quote(self.session, safe='')}"
        try:
            self.page = self._fetch(Clickable("GET", url), {})
        except _Refused as refused:
            raise _Refused(f"{url}: {refused}") from None
        if self.page.search is None or not self.page.instruction:
            raise _Refused(f"{url} is not a WebShop search page (no #search_input)")
        words = self.page.instruction
        self.instruction_text = " ".join(words[1:] if words[0] == "Instruction:" else words)
        self.steps, self.done = 0, False
        return self.observation()

    def observation(self) -> str:
        """The current page in WebShop's ``text`` mode."""
        return SEP.join(self.page.texts)

    def available_actions(self) -> dict[str, Any]:
        """WebShop's ``get_available_actions``: whether ``search[...]`` is possible, and the
        lower-cased texts that ``click[...]`` accepts."""
        has_search_bar = self.page.search is not None
        clickables = [c for c in self.page.clickables if not (has_search_bar and c == "search")]
        return {"has_search_bar": has_search_bar, "clickables": clickables}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Apply ``action``; returns (observation, reward, done, info), as ``ShopEnv.step``.
        A bad action, or a request the server answers with an error, gives the page again
        after a line saying why; ``info["valid"]`` is False. Raises ``MemSearcherError`` only
        when the server cannot be reached."""
        if self.done:
            over = invalid_observation(EPISODE_OVER, self.observation())
            return over, 0.0, True, {"valid": False}
        self.steps += 1
        info: dict[str, Any] = {}
        reward = 0.0
        parsed, error = check_action(action, self.available_actions())
        try:
            if parsed is not None and parsed[0] == "search":
                assert self.page.search is not None
                form, name = self.page.search
                self.page = self._fetch(form, {name: parsed[1]})
            elif parsed is not None:
                self.page = self._fetch(self.page.clickables[parsed[1]], {})
        except _Refused as refused:
            error = str(refused)
        if error is None and "reward" in self.page.values:
            reward, info = self._bought()
        if not self.done and self.steps >= self.max_steps:
            self.done = True
            info["truncated"] = True
        observation = self.observation()
        if error is not None:
            observation = invalid_observation(error, observation)
        return observation, reward, self.done, {"valid": error is None, **info}

    def _bought(self) -> tuple[float, dict[str, Any]]:
        self.done = True
        values = self.page.values
        try:
            reward = float(values["reward"])
            options = json.loads(values.get("options", "{}"))
        except ValueError as error:
            raise MemSearcherError(f"{self.page.url}: unreadable done page ({error})") from None
        return reward, {"bought": values.get("asin"), "options": options}

    def _fetch(self, clickable: Clickable, form: dict[str, str]) -> WebPage:
        try:
            if clickable.method == "POST":
                response = self.http.post(clickable.url, data=form)
            else:
                response = self.http.get(clickable.url, params=form or None)
        except self._httpx.HTTPError as error:
            raise MemSearcherError(
                f"cannot reach the WebShop server at {clickable.url}: {error}"
            ) from None
        if response.status_code != 200:
            raise _Refused(f"the server answered {response.status_code}: {_detail(response)}")
        if len(response.content) > MAX_PAGE_BYTES:
            raise _Refused(f"the page is over {MAX_PAGE_BYTES} bytes")
        return read_page(response.text, str(response.url))


def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError as error:  # httpx comes with the server extra; say how to get it
        raise MemSearcherError(
            f"WebShop over HTTP needs httpx ({error}): pip install 'memsearcher[server]'"
        ) from None
    return httpx


class _Refused(MemSearcherError):
    """The server answered, but not with a page (or not with a session's start page)."""


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json()["detail"])[:300]
    except (ValueError, KeyError, TypeError):
        return response.text[:300]


class WebShopEnvironment(ShopSessions):
    """A WebShop server behind the environment protocol, as `ShopEnvironment` puts our shop:
    each session a `WebShopHTTPEnv` on the goal it names, browsing in a server session of the
    episode's own (`episode_session`). All share one connection pool, its own or ``client``
    (which must follow redirects and stays open: ``with`` closes only its own). The lockstep
    driver's actions run one after another; the async driver's in the event loop's thread
    pool, several at once. A session the server refuses is refused for its episode alone; a
    server that cannot be reached raises `MemSearcherError` (eval records the episodes as
    failed, to run again on a rerun; training stops)."""

    def __init__(
        self,
        base_url: str,
        max_steps: int = 15,
        timeout: float = 30.0,
        client: httpx.Client | None = None,
    ) -> None:
        super().__init__()
        self.base_url, self.max_steps = base_url, max_steps
        self.owns_client = client is None
        self.http = client or _import_httpx().Client(timeout=timeout, follow_redirects=True)

    def close(self) -> None:
        if self.owns_client:
            self.http.close()

    def __enter__(self) -> WebShopEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def act_one(self, action: ShopAction) -> Page:
        return observed(await asyncio.to_thread(self.act_now, action))

    def open(self, name: str) -> tuple[WebShopHTTPEnv, str]:
        env = WebShopHTTPEnv(self.base_url, episode_session(name), self.max_steps, client=self.http)
        try:
            return env, env.reset()
        except _Refused as refused:
            raise ActionRefused(str(refused)) from None

    def examples(self, sessions: Sequence[str]) -> list[QAExample]:
        """One task each of ``sessions``, its question the instruction the server shows on
        the session's start page. The target is not shown before the purchase, so a task
        has no gold answer: its measure is the server's reward (EM, F1 and ACC score 0)."""
        tasks = []
        for session in sessions:
            env = WebShopHTTPEnv(self.base_url, session, self.max_steps, client=self.http)
            try:
                env.reset()
            except _Refused as refused:
                raise MemSearcherError(f"session {session}: {refused}") from None
            metadata = {"environment": "webshop", "server": self.base_url}
            tasks.append(QAExample(session, env.instruction_text, (), metadata))
        return tasks


_FIXED = re.compile(r"fixed_(\d{1,9})")


def episode_session(name: str) -> str:
    """The server session an episode opens for the goal of session ``name``: ``fixed_<i>``
    becomes ``fixed-<random>_<i>``, a session of its own for the same goal (WebShop's
    ``app.py`` gives any id that contains ``fixed`` the goal ``int(id.split('_')[-1])``, and
    our server does the same), so that episodes of one goal in flight at once, a GRPO group's,
    never share one: two purchases at once in one WebShop session can fail (its ``done``
    deletes the session's logger). Any other name is used as it is."""
    match = _FIXED.fullmatch(name)
    return f"fixed-{uuid.uuid4().hex[:12]}_{match.group(1)}" if match else name


def goal_range(text: str) -> tuple[int, int]:
    """``"A:B"`` -> ``(A, B)``, WebShop's goals ``A`` .. ``B - 1`` (its usual test split is
    ``0:500``)."""
    first, colon, end = text.partition(":")
    try:
        a, b = int(first), int(end)
    except ValueError:
        a = b = -1
    if not colon or not 0 <= a < b:
        raise MemSearcherError(f"sessions {text!r}: give A:B, with 0 <= A < B (e.g. 0:500)")
    return a, b


def fixed_sessions(first: int, end: int) -> list[str]:
    """The sessions of WebShop's goals ``first`` .. ``end - 1``."""
    return [f"fixed_{i}" for i in range(first, end)]
