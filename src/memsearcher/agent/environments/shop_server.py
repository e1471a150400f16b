"""The offline shop served over WebShop's HTTP protocol: its URL routes and its page structure.

WebShop's Flask app (``web_agent_site/app.py``) serves these routes, and so does this one:

    GET       /<session_id>                                           the search page
    POST      /<session_id>  (form: search_query=...)                 303 to the results
    GET|POST  /search_results/<session_id>/<keywords>/<page>
    GET|POST  /item_page/<session_id>/<asin>/<keywords>/<page>/<options>
    GET|POST  /done/<session_id>/<asin>/<options>                     the reward

``keywords`` is a Python list literal of the lower-cased query split on spaces, and
``options`` a dict literal of option name -> value (WebShop writes them with ``url_for``, which
puts ``str(list)`` and ``str(dict)`` in the path; both are read back with
``ast.literal_eval``). A session is ``fixed_<index>``, as in WebShop, indexing the instructions
served (or, by WebShop's rule, any id with ``fixed`` in it and the index after its last ``_``:
``fixed-a1b2_3``); WebShop gives any other session a random goal, this server answers 404.

The HTML carries exactly what WebShop's envs read off a page (``web_agent_text_env.py``,
``web_agent_site_env.py``): the instruction in ``#instruction-text h4``, the search box
``input#search_input`` (``name="search_query"``) in a POST form, buttons with class ``btn``
inside POST forms, product ids as ``a.product-link``, option values as
``input[type=radio]`` with ``value`` and ``data-url`` (the page with that option chosen; a
browser follows it by script), and on the done page the reward in ``#reward pre``. The pages
themselves come from ``shop.page_elements``, the same definition ``ShopEnv`` renders as text;
search is ``ShopSearch`` and the reward ``shop_reward``, so neither is written twice.

fastapi and uvicorn are optional: ``pip install 'memsearcher[server]'``.
"""

from __future__ import annotations

import argparse
import ast
import html
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import parse_qs, quote

from memsearcher.agent.environments.shop import PageState, ShopSearch, page_elements
from memsearcher.agent.environments.shop_reward import shop_reward
from memsearcher.agent.environments.shop_world import (
    SPLITS,
    Catalogue,
    Instruction,
    Product,
    ShopConfig,
    generate_catalogue,
)
from memsearcher.errors import MemSearcherError
from memsearcher.serving import HostGuard, Timeouts, add_error_handlers, allowed_hosts, run_server

try:
    import fastapi
    from fastapi.responses import HTMLResponse, RedirectResponse
except ImportError as error:  # only the server needs these; say how to get them
    raise MemSearcherError(
        f"the shop server needs fastapi and uvicorn ({error}): pip install 'memsearcher[server]'"
    ) from None

__all__ = ["create_app", "main", "page_html", "page_url"]

MAX_FORM_BYTES = 16 << 10
"""Largest search form body; WebShop's search box holds one line of keywords."""
MAX_LITERAL_CHARS = 4096
"""Longest ``keywords`` or ``options`` path segment read with ``literal_eval``."""
_SESSION = re.compile(r"[\w-]{0,64}fixed[\w-]{0,64}_(\d{1,9})")
"""WebShop's rule: an id with ``fixed`` in it and a number after its last ``_`` names that
goal (``fixed_3``, and ``fixed-a1b2_3`` for an episode of its own: `episode_session`)."""


def page_url(session: str, state: PageState) -> str:
    """The path WebShop's ``url_for`` gives the page ``state`` shows (Buy Now: ``/done``)."""
    keywords = quote(str(state.query.split(" ")), safe="")
    options = quote(str(state.options), safe="")
    if state.page == "search":
        return f"/{session}"
    if state.page == "results":
        return f"/search_results/{session}/{keywords}/{state.page_number}"
    if state.page == "item":
        return f"/item_page/{session}/{state.asin}/{keywords}/{state.page_number}/{options}"
    return f"/done/{session}/{state.asin}/{options}"


def page_html(
    session: str, state: PageState, products: Mapping[str, Product], instruction: str
) -> str:
    """The page ``state`` shows, as HTML in the structure of WebShop's templates."""
    body: list[str] = []
    for element in page_elements(state, products, instruction):
        text = html.escape(element.text)
        url = html.escape(page_url(session, element.goto)) if element.goto else ""
        if element.kind == "instruction":
            body.append(f'<div id="instruction-text"><h4>Instruction:<br>{text}</h4></div>')
        elif element.kind == "search":
            body.append(
                f'<form method="post" action="{html.escape(page_url(session, PageState()))}">'
                '<input id="search_input" type="text" name="search_query" required>'
                f'<button class="btn btn-success" type="submit">{text}</button></form>'
            )
        elif element.kind == "button":
            body.append(
                f'<form method="post" action="{url}">'
                f'<button type="submit" class="btn btn-primary">{text}</button></form>'
            )
        elif element.kind == "link":
            body.append(
                f'<h4 class="product-asin"><a class="product-link" href="{url}">{text}</a></h4>'
            )
        elif element.kind == "radio":
            name = html.escape(element.name)
            radio = f"radio_{name}_{text}".replace(" ", "_")
            body.append(
                f'<input type="radio" id="{radio}" name="{name}" value="{text}" data-url="{url}">'
                f'<label for="{radio}">{text}</label>'
            )
        else:
            body.append(f"<h4>{text}</h4>")
    return _document("\n".join(body))


def done_html(asin: str, options: dict[str, str], reward: float) -> str:
    """WebShop's done page, as far as its envs read it: the reward in ``#reward pre``."""
    return _document(
        "<h1>Thank you for shopping with us!</h1>\n"
        f'<h4 id="asin">asin<pre>{html.escape(asin)}</pre></h4>\n'
        f'<h4 id="options">options<pre>{html.escape(json.dumps(options))}</pre></h4>\n'
        f'<h3 id="reward">Your score (min 0.0, max 1.0)<pre>{reward}</pre></h3>'
    )


def _document(body: str) -> str:
    head = "<!DOCTYPE html>\n<html>\n<head><title>WebShop</title></head>\n"
    return f"{head}<body>\n{body}\n</body>\n</html>\n"


def _literal(text: str, kind: type, what: str) -> Any:
    """A list or dict literal of strings from a path segment, or 422."""
    if len(text) > MAX_LITERAL_CHARS:
        raise fastapi.HTTPException(422, f"{what} is longer than {MAX_LITERAL_CHARS} characters")
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        value = None
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    if not isinstance(value, kind) or not all(isinstance(item, str) for item in items):
        raise fastapi.HTTPException(422, f"{what} must be a {kind.__name__} literal of strings")
    return value


def _keywords(text: str) -> str:
    """The query of a ``keywords`` segment: a list literal, or one bare keyword (WebShop's
    ``convert_web_app_string_to_var``)."""
    words = _literal(text, list, "keywords") if text.startswith("[") else [text]
    return " ".join(words)


def _page(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 10_000:
        raise fastapi.HTTPException(422, f"page must be a number from 1, got {text[:40]!r}")
    return int(text)


def create_app(
    catalogue: Catalogue,
    search: ShopSearch,
    instructions: Sequence[Instruction],
    hosts: frozenset[str] | None = None,
) -> fastapi.FastAPI:
    """The shop's FastAPI application: session ``fixed_<i>`` shops for ``instructions[i]``;
    it answers requests for ``hosts`` only (None: any Host)."""
    products = {p.asin: p for p in catalogue.products}
    app = fastapi.FastAPI(
        title="memsearcher shop (WebShop's protocol)", docs_url=None, redoc_url=None
    )
    add_error_handlers(app)

    def instruction(session: str) -> Instruction:
        match = _SESSION.fullmatch(session)
        if match is None or int(match.group(1)) >= len(instructions):
            raise fastapi.HTTPException(
                404,
                f"unknown session {session[:80]!r}: this shop serves fixed_0 .. "
                f"fixed_{len(instructions) - 1}",
            )
        return instructions[int(match.group(1))]

    def product(asin: str) -> Any:
        if asin not in products:
            raise fastapi.HTTPException(404, f"no product {asin[:40]!r} in this shop")
        return products[asin]

    def page(session: str, state: PageState) -> HTMLResponse:
        text = instruction(session).text
        return HTMLResponse(page_html(session, state, products, text))

    @app.api_route("/{session_id}", methods=["GET", "POST"])
    async def index(session_id: str, request: fastapi.Request) -> Any:
        instruction(session_id)
        if request.method == "POST":
            if int(request.headers.get("content-length") or 0) > MAX_FORM_BYTES:
                raise fastapi.HTTPException(413, f"a search form is at most {MAX_FORM_BYTES} bytes")
            form = parse_qs((await request.body())[:MAX_FORM_BYTES].decode("utf-8", "replace"))
            if form.get("search_query"):
                # a path segment cannot hold "/" (the router decodes %2F first); the index
                # tokenizes on it anyway, so the results are the same
                query = form["search_query"][0].lower().replace("/", " ")
                state = PageState("results", query)
                # 303: the browser GETs the results, as Flask's redirect after a POST form
                return RedirectResponse(page_url(session_id, state), status_code=303)
        return page(session_id, PageState())

    @app.api_route("/search_results/{session_id}/{keywords}/{number}", methods=["GET", "POST"])
    def search_results(session_id: str, keywords: str, number: str) -> HTMLResponse:
        query = _keywords(keywords)
        return page(session_id, PageState("results", query, search.search(query), _page(number)))

    @app.api_route(
        "/item_page/{session_id}/{asin}/{keywords}/{number}/{options}", methods=["GET", "POST"]
    )
    def item_page(
        session_id: str, asin: str, keywords: str, number: str, options: str
    ) -> HTMLResponse:
        product(asin)
        chosen = _literal(options, dict, "options")
        state = PageState("item", _keywords(keywords), [], _page(number), asin, chosen)
        return page(session_id, state)

    @app.api_route("/done/{session_id}/{asin}/{options}", methods=["GET", "POST"])
    def done(session_id: str, asin: str, options: str) -> HTMLResponse:
        goal = instruction(session_id).goal
        chosen = _literal(options, dict, "options")
        reward, _ = shop_reward(product(asin), chosen, goal)
        return HTMLResponse(done_html(asin, chosen, reward))

    app.add_middleware(HostGuard, hosts=hosts)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m memsearcher.agent.environments.shop_server``: serve a generated shop until
    interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the shop's seed (ShopConfig.seed)")
    parser.add_argument("--families-per-category", type=int, default=8)
    parser.add_argument(
        "--split",
        choices=SPLITS,
        default=None,
        help="serve one split's instructions (default: all)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3000, help="WebShop's port")
    args = parser.parse_args(argv)
    config = ShopConfig(seed=args.seed, families_per_category=args.families_per_category)
    catalogue = generate_catalogue(config)
    instructions = catalogue.split(args.split) if args.split else list(catalogue.instructions)
    app = create_app(
        catalogue, ShopSearch(catalogue.products), instructions, allowed_hosts(args.host)
    )
    run_server(app, args.host, args.port, Timeouts(), log_level="warning")


if __name__ == "__main__":
    main()
