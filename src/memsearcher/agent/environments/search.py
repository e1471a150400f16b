"""Search QA as an environment: its action is `Search`, its observation the passages the
retriever returns. `SearchEnvironment` serves the lockstep driver; for the async driver,
`BatchedSearch` merges the searches in flight over a local index and `DirectSearch` awaits an
async HTTP client, whose server batches. A retriever handed to a driver is taken as its search
environment (`as_environment`, `as_async_environment`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial
from operator import itemgetter
from typing import Any, cast

from memsearcher.agent.environments.base import ActionRefused, AsyncEnvironment, Environment, Search
from memsearcher.errors import MemSearcherError
from memsearcher.retrieval.base import AsyncRetriever, Retriever, SearchRefused, is_async
from memsearcher.types import Hit
from memsearcher.worker import QueueWorker

__all__ = [
    "BatchedSearch",
    "DirectSearch",
    "SearchEnvironment",
    "as_async_environment",
    "as_environment",
]


class SearchEnvironment(Environment[Search, Sequence[Hit]]):
    """Search QA over a retriever: a round's queries go as one ``retriever.search`` call, with
    the largest ``top_n`` asked, and each action keeps its own ``top_n`` of the hits."""

    def __init__(self, retriever: Retriever) -> None:
        self.retriever = retriever

    def act(self, actions: Sequence[Search]) -> list[Sequence[Hit] | ActionRefused]:
        if not actions:
            return []
        queries, top_n = [a.query for a in actions], max(a.top_n for a in actions)
        results = _search_apart(self.retriever, queries, top_n)
        return [
            hits if isinstance(hits, SearchRefused) else hits[: action.top_n]
            for action, hits in zip(actions, results, strict=True)
        ]


def _search_apart(
    retriever: Retriever, queries: Sequence[str], top_n: int
) -> list[list[Hit] | SearchRefused]:
    """``retriever.search(queries, top_n)``; if the retriever refuses the batch, each query
    alone, so that a refused query (one the server will not take) fails alone."""
    try:
        return list(retriever.search(queries, top_n))
    except SearchRefused as error:
        if len(queries) == 1:
            return [error]
    return [_search_apart(retriever, [query], top_n)[0] for query in queries]


class DirectSearch(AsyncEnvironment[Search, Sequence[Hit]]):
    """Search QA over an async retriever, one query per call: its server does the batching."""

    def __init__(self, retriever: AsyncRetriever) -> None:
        self.retriever = retriever

    async def act_one(self, action: Search) -> Sequence[Hit]:
        return (await self.retriever.search([action.query], action.top_n))[0]


class BatchedSearch(
    QueueWorker[tuple[str, int, asyncio.Future[list[Hit]]]], AsyncEnvironment[Search, Sequence[Hit]]
):
    """Search QA over a local index for many tasks at once: the searches waiting at any moment
    go as one ``retriever.search`` call per ``top_n``, run in a single worker thread, so the
    index is never called from two threads at once (``async with`` starts and stops the
    thread)."""

    def __init__(self, retriever: Retriever, max_queries: int = 256) -> None:
        super().__init__("search")
        self.retriever = retriever
        self.max_queries = max_queries

    async def act_one(self, action: Search) -> Sequence[Hit]:
        future: asyncio.Future[list[Hit]] = asyncio.get_running_loop().create_future()
        await self.queue.put((action.query, action.top_n, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            while len(batch) < self.max_queries and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            groups: dict[int, list[tuple[str, asyncio.Future[list[Hit]]]]] = {}
            for query, top_n, future in batch:
                groups.setdefault(top_n, []).append((query, future))
            for top_n, items in groups.items():
                await self.run_apart(items, partial(self._search, loop, top_n), itemgetter(1))

    async def _search(
        self,
        loop: asyncio.AbstractEventLoop,
        top_n: int,
        items: list[tuple[str, asyncio.Future[list[Hit]]]],
    ) -> None:
        queries = [query for query, _ in items]
        results = await loop.run_in_executor(self.executor, self.retriever.search, queries, top_n)
        for (_, future), hits in zip(items, results, strict=True):
            if not future.done():
                future.set_result(hits)


def as_environment(where: Environment[Any, Any] | Retriever) -> Environment[Any, Any]:
    """``where`` itself if it is an environment; a retriever is search QA over it."""
    return where if isinstance(where, Environment) else SearchEnvironment(where)


def as_async_environment(
    where: AsyncEnvironment[Any, Any] | Retriever | AsyncRetriever,
) -> AsyncEnvironment[Any, Any]:
    """``where`` itself if it is an async environment; an async retriever is searched directly,
    a synchronous one through a `BatchedSearch`. An environment with no ``act_one`` is
    refused."""
    if isinstance(where, AsyncEnvironment):
        return where
    if isinstance(where, Environment):
        raise MemSearcherError(
            f"{type(where).__name__} acts for the lockstep driver only (no act_one)"
        )
    # (a TypeGuard narrows only its true branch before Python 3.13's TypeIs, hence the cast)
    return DirectSearch(where) if is_async(where) else BatchedSearch(cast(Retriever, where))
