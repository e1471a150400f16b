"""The async driver: each episode runs on its own, and the server does the batching.

An HTTP backend (vLLM, SGLang, llama.cpp) batches whatever requests are in flight, so the best
a client can do is keep many of them in flight and never wait for the slowest trajectory of a
round, as the lockstep driver must. Every episode is an asyncio task; a semaphore bounds how
many run at once. Each action goes to the environment on its own (``agent.environments``): with
a synchronous retriever (a local index), searches from all tasks are merged into batched calls
in one worker thread, so the index is never called from two threads at once; an async
retriever (``AsyncHTTPRetriever``) is awaited directly, and its server batches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from memsearcher.agent.base import Episode, Generate, TurnCallback
from memsearcher.agent.environments import (
    ActionRefused,
    AsyncEnvironment,
    as_async_environment,
)
from memsearcher.llm.base import AsyncLLM, Completion, SamplingParams, derive_seed
from memsearcher.retrieval.base import AsyncRetriever, Retriever
from memsearcher.types import Trajectory, Turn

logger = logging.getLogger(__name__)

DoneCallback = Callable[[int, Trajectory], None]
ErrorCallback = Callable[[int, Exception], None]


async def drive(
    episode: Episode,
    generate: Callable[[Generate], Awaitable[Completion]],
    act: Callable[[Any], Awaitable[Any]],
    on_turn: Callable[[Turn], None] | None = None,
) -> Trajectory:
    """Run one episode to its end, asking ``generate`` and ``act`` for what it requests;
    ``on_turn(turn)`` sees each turn as it closes.

    The one loop over the episode protocol (``next_request`` / ``on_generation`` /
    ``on_observation`` / ``result``) that every async caller shares: ``run_async`` below, and
    the veRL agent loop (``memsearcher.integrations.verl``), whose generations go to veRL's
    servers.
    """
    reported = 0
    while (request := episode.next_request()) is not None:
        if isinstance(request, Generate):
            episode.on_generation(await generate(request))
        else:
            try:
                observation = await act(request)
            except ActionRefused as error:  # this episode's action, not the run, is at fault
                episode.end("search_error", str(error))
            else:
                episode.on_observation(observation)
        while on_turn is not None and reported < len(episode.turns):
            on_turn(episode.turns[reported])
            reported += 1
    return episode.result()


async def run_async(
    episodes: Sequence[Episode],
    llm: AsyncLLM,
    environment: AsyncEnvironment | Retriever | AsyncRetriever,
    sampling: SamplingParams,
    concurrency: int = 64,
    on_done: DoneCallback | None = None,
    on_error: ErrorCallback | None = None,
    on_turn: TurnCallback | None = None,
) -> list[Trajectory]:
    """Run every episode to its end, at most ``concurrency`` at once; trajectories come back in
    order, ``on_turn(index, turn)`` sees each turn as it closes, and ``on_done(index,
    trajectory)`` hears of each episode as soon as it ends. ``environment`` takes the actions
    (a retriever: search QA over it, `as_async_environment`).

    An episode that raises stops the whole run, unless ``on_error(index, error)`` is given: then
    only that episode is dropped (it is missing from the returned list) and the others go on.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency)

    async def run_one(index: int, episode: Episode) -> Trajectory | None:
        if on_error is None:
            return await run_episode(index, episode)
        try:
            return await run_episode(index, episode)
        except Exception as error:
            on_error(index, error)
            return None

    async def run_episode(index: int, episode: Episode) -> Trajectory:
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

        async with gate:
            report = None if on_turn is None else partial(on_turn, index)
            trajectory = await drive(episode, generate, acting.act_one, report)
        if on_done is not None:
            on_done(index, trajectory)
        return trajectory

    async with as_async_environment(environment) as acting:
        tasks = [asyncio.create_task(run_one(i, episode)) for i, episode in enumerate(episodes)]
        try:
            return [t for t in await asyncio.gather(*tasks) if t is not None]
        finally:
            for task in tasks:
                task.cancel()
