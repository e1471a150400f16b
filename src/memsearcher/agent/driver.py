"""Drivers run many episodes against a model and a retriever.

The lockstep driver suits in-process backends: each round, every episode that wants the model
goes into one batched `generate` call per request shape, and every query of the round goes into
one batched search.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from memsearcher.agent.base import Episode, Generate, Search, TurnCallback
from memsearcher.llm.base import LLM, SamplingParams, derive_seed
from memsearcher.retrieval.base import Retriever, SearchRefused
from memsearcher.types import Hit, Trajectory

logger = logging.getLogger(__name__)


def run_lockstep(
    episodes: Sequence[Episode],
    llm: LLM,
    retriever: Retriever,
    sampling: SamplingParams,
    on_turn: TurnCallback | None = None,
) -> list[Trajectory]:
    """Run every episode to its end and return their trajectories in order.

    ``sampling`` gives temperature, top-p and the base seed; each episode's request sets the
    token budget and stop strings. Call k of a run uses seed ``derive_seed(sampling.seed, k)``,
    so a seeded run is reproducible and no two calls share a stream. ``on_turn(episode_index,
    turn)`` sees each turn as it closes.
    """
    seen_turns = [0] * len(episodes)
    calls = 0

    def report() -> None:
        for i, episode in enumerate(episodes):
            while on_turn is not None and seen_turns[i] < len(episode.turns):
                on_turn(i, episode.turns[seen_turns[i]])
                seen_turns[i] += 1

    while True:
        generations: dict[tuple[int, tuple[str, ...]], list[int]] = defaultdict(list)
        searches: list[int] = []
        for i, episode in enumerate(episodes):
            request = episode.next_request()
            if isinstance(request, Generate):
                generations[(request.max_new_tokens, request.stop)].append(i)
            elif isinstance(request, Search):
                searches.append(i)
        if not generations and not searches:
            break
        for (max_new_tokens, stop), members in generations.items():
            seed = None if sampling.seed is None else derive_seed(sampling.seed, calls)
            params = replace(sampling, max_new_tokens=max_new_tokens, stop=stop, seed=seed)
            prompts = [_generate_request(episodes[i]).prompt_ids for i in members]
            completions = llm.generate(prompts, params)
            calls += 1
            for i, completion in zip(members, completions, strict=True):
                episodes[i].on_generation(completion)
        if searches:
            requests = [_search_request(episodes[i]) for i in searches]
            queries, top_n = [r.query for r in requests], max(r.top_n for r in requests)
            for i, request, hits in zip(
                searches, requests, search_apart(retriever, queries, top_n), strict=True
            ):
                if isinstance(hits, SearchRefused):
                    episodes[i].end("search_error", str(hits))
                else:
                    episodes[i].on_search(hits[: request.top_n])
        report()
    report()
    return [episode.result() for episode in episodes]


def search_apart(
    retriever: Retriever, queries: Sequence[str], top_n: int
) -> list[list[Hit] | SearchRefused]:
    """``retriever.search(queries, top_n)``; if the retriever refuses the batch, each query
    alone, so that a refused query (one the server will not take) fails alone."""
    try:
        return list(retriever.search(queries, top_n))
    except SearchRefused as error:
        if len(queries) == 1:
            return [error]
    return [search_apart(retriever, [query], top_n)[0] for query in queries]


def _generate_request(episode: Episode) -> Generate:
    request = episode.next_request()
    assert isinstance(request, Generate)
    return request


def _search_request(episode: Episode) -> Search:
    request = episode.next_request()
    assert isinstance(request, Search)
    return request
