"""HTTP clients for the retrieval server: ``HTTPRetriever`` implements the same ``Retriever``
protocol as a local index, ``AsyncHTTPRetriever`` is its asyncio twin.

It posts to ``/batch_search`` (so it also works against MemSearcher-style servers), retries
connection failures, timeouts, 429 and 5xx answers with exponential backoff, and turns anything
it cannot recover from into a :class:`MemSearcherError` that names the server. Before its first
search it reads the server's limits from ``/health`` (a server without them is taken as it
comes): queries longer than ``max_query_chars`` are cut to it, as a model's runaway query should
cost its episode some words, not the whole rollout, and batches hold ``max_queries`` at most. A
request the server still refuses (4xx) is a :class:`RequestRefused`, which the agent drivers
turn into a ``"search_error"`` end of the one episode that asked.

httpx is optional: ``pip install 'memsearcher[server]'``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.retrieval.base import SearchRefused, check_search_args
from memsearcher.retrieval.corpus import split_contents
from memsearcher.text import sanitize_text
from memsearcher.types import Hit

logger = logging.getLogger(__name__)

_ENDPOINTS = ("/search", "/batch_search", "/retrieve", "/health")
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RetrievalServerError(MemSearcherError):
    """The retrieval server could not be reached, or refused a request."""


class RequestRefused(RetrievalServerError, SearchRefused):
    """The retrieval server refused a request (4xx other than 408 and 429)."""


def base_url(url: str) -> str:
    """The server root of ``url``; an endpoint URL (``.../search``) is accepted too."""
    url = url.rstrip("/")
    for endpoint in _ENDPOINTS:
        if url.endswith(endpoint):
            return url[: -len(endpoint)]
    return url


class _Retry(Exception):
    """A failure worth another try (connection trouble, 408/429/5xx)."""


class _Client:
    """What the sync and async clients share: retry timing, answers, and batch splitting."""

    def __init__(
        self, url: str, retries: int, backoff: float, max_backoff: float, max_queries: int
    ) -> None:
        try:
            import httpx
        except ImportError as error:
            raise MemSearcherError(
                f"the retrieval client needs httpx ({error}): pip install 'memsearcher[server]'"
            ) from None
        self._httpx = httpx
        self.url = base_url(url)
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_queries = max_queries
        self.max_query_chars: int | None = None
        self.limits_read = False

    def _delay(self, attempt: int) -> float:
        # full jitter (AWS architecture blog, "Exponential Backoff And Jitter", 2015): many
        # rollout workers retrying a restarted server do not come back in lockstep
        cap = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
        return random.uniform(cap / 2, cap)

    def _answer(self, response: Any, path: str) -> Any:
        if response.status_code in _RETRY_STATUS:
            raise _Retry(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code >= 400:
            raise RequestRefused(
                f"retrieval server {self.url}{path} refused the request: "
                f"HTTP {response.status_code} {_detail(response)}"
            )
        try:
            return response.json()
        except ValueError:
            raise RetrievalServerError(
                f"retrieval server {self.url}{path} answered with non-JSON: {response.text[:200]!r}"
            ) from None

    def _gave_up(self, last: str) -> RetrievalServerError:
        return RetrievalServerError(
            f"retrieval server {self.url} unreachable after {self.retries + 1} tries: {last}"
        )

    def _use_limits(self, health: Any) -> None:
        limits = health.get("limits") if isinstance(health, dict) else None
        limits = limits if isinstance(limits, dict) else {}  # another kind of server
        self.max_query_chars = limits.get("max_query_chars")
        self.max_queries = min(self.max_queries, limits.get("max_queries", self.max_queries))
        self.limits_read = True

    def _batches(
        self, queries: Sequence[str], top_n: int
    ) -> tuple[list[list[Hit]], list[tuple[list[int], dict[str, Any]]]]:
        """Empty results, and the /batch_search payloads that fill them. Blank queries get no
        hits without asking the server (which rejects them)."""
        check_search_args(queries, top_n)
        if self.max_query_chars is not None:
            queries = [q[: self.max_query_chars] for q in queries]
        live = [i for i, q in enumerate(queries) if q.strip()]
        batches = []
        for start in range(0, len(live), self.max_queries):
            chunk = live[start : start + self.max_queries]
            payload = {"query": [queries[i] for i in chunk], "top_n": top_n, "return_score": True}
            batches.append((chunk, payload))
        return [[] for _ in queries], batches

    def _fill(self, results: list[list[Hit]], chunk: list[int], data: Any) -> None:
        try:
            docs, scores = data
            for i, hits, hit_scores in zip(chunk, docs, scores, strict=True):
                results[i] = [_hit(d, s) for d, s in zip(hits, hit_scores, strict=True)]
        except (TypeError, ValueError, KeyError) as error:
            raise RetrievalServerError(
                f"retrieval server {self.url} answered /batch_search in an unexpected shape "
                f"({error})"
            ) from None


class HTTPRetriever(_Client):
    """Search through a retrieval server: ``HTTPRetriever("http://127.0.0.1:8000")``."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        retries: int = 4,
        backoff: float = 0.25,
        max_backoff: float = 8.0,
        max_queries: int = 256,
    ) -> None:
        super().__init__(url, retries, backoff, max_backoff, max_queries)
        timeouts = self._httpx.Timeout(timeout, connect=min(timeout, 5.0))
        self._client = self._httpx.Client(base_url=self.url, timeout=timeouts)

    def __enter__(self) -> HTTPRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def _request(self, method: str, path: str, payload: Any = None) -> Any:
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self._delay(attempt))
            try:
                response = self._client.request(method, path, json=payload)
                return self._answer(response, path)
            except self._httpx.TransportError as error:  # refused, reset, timed out
                last = f"{type(error).__name__}: {error}"
            except _Retry as error:
                last = str(error)
            logger.debug("retrieval request failed (try %d): %s", attempt + 1, last)
        raise self._gave_up(last)

    def health(self) -> dict[str, Any]:
        data: dict[str, Any] = self._request("GET", "/health")
        return data

    def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        if not self.limits_read:
            try:
                self._use_limits(self.health())
            except RequestRefused:  # no /health: a server of another kind, limits unknown
                self._use_limits({})
        results, batches = self._batches(queries, top_n)
        for chunk, payload in batches:
            self._fill(results, chunk, self._request("POST", "/batch_search", payload))
        return results


class AsyncHTTPRetriever(_Client):
    """The asyncio twin of :class:`HTTPRetriever`, for drivers that keep many searches in
    flight: ``await retriever.search(queries, top_n)``."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        retries: int = 4,
        backoff: float = 0.25,
        max_backoff: float = 8.0,
        max_queries: int = 256,
        max_connections: int = 64,
    ) -> None:
        super().__init__(url, retries, backoff, max_backoff, max_queries)
        httpx = self._httpx
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            limits=httpx.Limits(max_connections=max_connections),
        )

    async def __aenter__(self) -> AsyncHTTPRetriever:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _request(self, method: str, path: str, payload: Any = None) -> Any:
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self._delay(attempt))
            try:
                response = await self._client.request(method, path, json=payload)
                return self._answer(response, path)
            except self._httpx.TransportError as error:
                last = f"{type(error).__name__}: {error}"
            except _Retry as error:
                last = str(error)
            logger.debug("retrieval request failed (try %d): %s", attempt + 1, last)
        raise self._gave_up(last)

    async def health(self) -> dict[str, Any]:
        data: dict[str, Any] = await self._request("GET", "/health")
        return data

    async def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        if not self.limits_read:
            try:
                self._use_limits(await self.health())
            except RequestRefused:  # no /health: a server of another kind, limits unknown
                self._use_limits({})
        results, batches = self._batches(queries, top_n)
        answers = await asyncio.gather(
            *(self._request("POST", "/batch_search", payload) for _, payload in batches)
        )
        for (chunk, _), data in zip(batches, answers, strict=True):
            self._fill(results, chunk, data)
        return results


def _hit(doc: dict[str, Any], score: float) -> Hit:
    if "contents" in doc:
        title, text = split_contents(doc["contents"])
    else:
        title, text = doc.get("title", ""), doc["text"]
    # a server is outside: its text gets the same rule as a corpus read here
    return Hit(
        id=sanitize_text(str(doc["id"])),
        title=sanitize_text(title),
        text=sanitize_text(text),
        score=float(score),
    )


def _detail(response: Any) -> str:
    try:
        return str(response.json().get("detail", ""))[:500]
    except (ValueError, AttributeError):
        return str(response.text[:200])
