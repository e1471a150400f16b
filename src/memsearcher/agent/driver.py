"""Drivers run many episodes against a model and an environment.

The lockstep driver suits in-process backends: each round, every episode that wants the model
goes into one batched `generate` call per request shape, and every action of the round goes
to the environment in one call (for search QA: one batched search).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from memsearcher.agent.base import Episode, Generate, TurnCallback
from memsearcher.agent.environments import Action, ActionRefused, Environment, as_environment
from memsearcher.llm.base import LLM, SamplingParams, derive_seed
from memsearcher.retrieval.base import Retriever
from memsearcher.types import Trajectory

logger = logging.getLogger(__name__)


def run_lockstep(
    episodes: Sequence[Episode],
    llm: LLM,
    environment: Environment[Any, Any] | Retriever,
    sampling: SamplingParams,
    on_turn: TurnCallback | None = None,
) -> list[Trajectory]:
    """Run every episode to its end and return their trajectories in order.

    ``environment`` takes the episodes' actions (a retriever: search QA over it).
    ``sampling`` gives temperature, top-p and the base seed; each episode's request sets the
    token budget and stop strings. Call k of a run uses seed ``derive_seed(sampling.seed, k)``,
    so a seeded run is reproducible and no two calls share a stream. ``on_turn(episode_index,
    turn)`` sees each turn as it closes.
    """
    environment = as_environment(environment)
    seen_turns = [0] * len(episodes)
    calls = 0

    def report() -> None:
        for i, episode in enumerate(episodes):
            while on_turn is not None and seen_turns[i] < len(episode.turns):
                on_turn(i, episode.turns[seen_turns[i]])
                seen_turns[i] += 1

    while True:
        generations: dict[tuple[int, tuple[str, ...]], list[int]] = defaultdict(list)
        acting: list[int] = []
        for i, episode in enumerate(episodes):
            request = episode.next_request()
            if isinstance(request, Generate):
                generations[(request.max_new_tokens, request.stop)].append(i)
            elif request is not None:
                acting.append(i)
        if not generations and not acting:
            break
        for (max_new_tokens, stop), members in generations.items():
            seed = None if sampling.seed is None else derive_seed(sampling.seed, calls)
            params = replace(sampling, max_new_tokens=max_new_tokens, stop=stop, seed=seed)
            prompts = [_generate_request(episodes[i]).prompt_ids for i in members]
            completions = llm.generate(prompts, params)
            calls += 1
            for i, completion in zip(members, completions, strict=True):
                episodes[i].on_generation(completion)
        if acting:
            actions = [_action(episodes[i]) for i in acting]
            for i, observation in zip(acting, environment.act(actions), strict=True):
                if isinstance(observation, ActionRefused):
                    episodes[i].end("search_error", str(observation))
                else:
                    episodes[i].on_observation(observation)
        report()
    report()
    return [episode.result() for episode in episodes]


def _generate_request(episode: Episode) -> Generate:
    request = episode.next_request()
    assert isinstance(request, Generate)
    return request


def _action(episode: Episode) -> Action:
    request = episode.next_request()
    assert request is not None and not isinstance(request, Generate)
    return request
