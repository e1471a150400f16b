"""The async driver: each episode runs on its own, and the server does the batching.

An HTTP backend (vLLM, SGLang, llama.cpp) batches whatever requests are in flight, so the best
a client can do is keep many of them in flight and never wait for the slowest trajectory of a
round, as the lockstep driver must. Every episode is an asyncio task; a semaphore bounds how
many run at once. With a synchronous retriever (a local index), searches from all tasks are
merged into batched calls in one worker thread, so the index is never called from two threads at
once; an async retriever (``AsyncHTTPRetriever``) is awaited directly, and its server batches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from functools import partial
from operator import itemgetter
from typing import cast

from memsearcher.agent.base import Episode, Generate, Search, TurnCallback
from memsearcher.llm.base import AsyncLLM, Completion, SamplingParams, derive_seed
from memsearcher.retrieval.base import AsyncRetriever, Retriever, SearchRefused, is_async
from memsearcher.types import Hit, Trajectory, Turn
from memsearcher.worker import QueueWorker

logger = logging.getLogger(__name__)

DoneCallback = Callable[[int, Trajectory], None]
ErrorCallback = Callable[[int, Exception], None]


class _Direct:
    """An async retriever, one query per call: its server does the batching."""

    def __init__(self, retriever: AsyncRetriever) -> None:
        self.retriever = retriever

    async def __aenter__(self) -> _Direct:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def search(self, query: str, top_n: int) -> list[Hit]:
        return (await self.retriever.search([query], top_n))[0]


class SearchBatcher(QueueWorker[tuple[str, int, asyncio.Future[list[Hit]]]]):
    """Merges the searches waiting at any moment into one ``retriever.search`` call per
    ``top_n``, run in a single worker thread."""

    def __init__(self, retriever: Retriever, max_queries: int = 256) -> None:
        super().__init__("search")
        self.retriever = retriever
        self.max_queries = max_queries

    async def search(self, query: str, top_n: int) -> list[Hit]:
        future: asyncio.Future[list[Hit]] = asyncio.get_running_loop().create_future()
        await self.queue.put((query, top_n, future))
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


async def drive(
    episode: Episode,
    generate: Callable[[Generate], Awaitable[Completion]],
    search: Callable[[Search], Awaitable[Sequence[Hit]]],
    on_turn: Callable[[Turn], None] | None = None,
) -> Trajectory:
    """Run one episode to its end, asking ``generate`` and ``search`` for what it requests;
    ``on_turn(turn)`` sees each turn as it closes.

    The one loop over the episode protocol (``next_request`` / ``on_generation`` /
    ``on_search`` / ``result``) that every async caller shares: ``run_async`` below, and the veRL
    agent loop (``memsearcher.integrations.verl``), whose generations go to veRL's servers.
    """
    reported = 0
    while (request := episode.next_request()) is not None:
        if isinstance(request, Generate):
            episode.on_generation(await generate(request))
        elif isinstance(request, Search):
            try:
                hits = await search(request)
            except SearchRefused as error:  # this episode's query, not the run, is at fault
                episode.end("search_error", str(error))
            else:
                episode.on_search(hits[: request.top_n])
        while on_turn is not None and reported < len(episode.turns):
            on_turn(episode.turns[reported])
            reported += 1
    return episode.result()


async def run_async(
    episodes: Sequence[Episode],
    llm: AsyncLLM,
    retriever: Retriever | AsyncRetriever,
    sampling: SamplingParams,
    concurrency: int = 64,
    on_done: DoneCallback | None = None,
    on_error: ErrorCallback | None = None,
    on_turn: TurnCallback | None = None,
) -> list[Trajectory]:
    """Run every episode to its end, at most ``concurrency`` at once; trajectories come back in
    order, ``on_turn(index, turn)`` sees each turn as it closes, and ``on_done(index,
    trajectory)`` hears of each episode as soon as it ends.

    An episode that raises stops the whole run, unless ``on_error(index, error)`` is given: then
    only that episode is dropped (it is missing from the returned list) and the others go on.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency)

    async def run_one(
        index: int, episode: Episode, searcher: SearchBatcher | _Direct
    ) -> Trajectory | None:
        if on_error is None:
            return await run_episode(index, episode, searcher)
        try:
            return await run_episode(index, episode, searcher)
        except Exception as error:
            on_error(index, error)
            return None

    async def run_episode(
        index: int, episode: Episode, searcher: SearchBatcher | _Direct
    ) -> Trajectory:
        calls = 0

        async def generate(request: Generate) -> Completion:
            nonlocal calls
            # episode i's call k has its own stream, whatever the scheduling
            seed = sampling.seed
            if seed is not None:
                seed = derive_seed(seed, index, calls)
            params = replace(
                sampling, max_new_tokens=request.max_new_tokens, stop=request.stop, seed=seed
            )
            calls += 1
            return await llm.agenerate(request.prompt_ids, params)

        async def search(request: Search) -> list[Hit]:
            return await searcher.search(request.query, request.top_n)

        async with gate:
            report = None if on_turn is None else partial(on_turn, index)
            trajectory = await drive(episode, generate, search, report)
        if on_done is not None:
            on_done(index, trajectory)
        return trajectory

    # (a TypeGuard narrows only its true branch before Python 3.13's TypeIs, hence the cast)
    searcher: SearchBatcher | _Direct = (
        _Direct(retriever) if is_async(retriever) else SearchBatcher(cast(Retriever, retriever))
    )
    async with searcher:
        tasks = [
            asyncio.create_task(run_one(i, episode, searcher)) for i, episode in enumerate(episodes)
        ]
        try:
            return [t for t in await asyncio.gather(*tasks) if t is not None]
        finally:
            for task in tasks:
                task.cancel()
