"""Agents as step machines, and the drivers that run them."""

from __future__ import annotations

from collections.abc import Sequence

from memsearcher.agent.base import AgentConfig, Episode, Generate, Request
from memsearcher.agent.driver import run_lockstep
from memsearcher.agent.environments import (
    Action,
    AsyncEnvironment,
    Environment,
    Observation,
    Search,
    SearchEnvironment,
)
from memsearcher.agent.mem1 import Mem1Episode
from memsearcher.agent.memory_agent import MemSearcherEpisode
from memsearcher.agent.prompts import Templates, load_templates
from memsearcher.agent.react import ReActEpisode
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import Tokenizer
from memsearcher.types import QAExample

__all__ = [
    "AGENTS",
    "Action",
    "AgentConfig",
    "AsyncEnvironment",
    "Environment",
    "Episode",
    "Generate",
    "Mem1Episode",
    "MemSearcherEpisode",
    "Observation",
    "ReActEpisode",
    "Request",
    "Search",
    "SearchEnvironment",
    "Templates",
    "agent_type",
    "load_templates",
    "run_lockstep",
    "start_episodes",
]

AGENTS: dict[str, type[Episode]] = {
    "memsearcher": MemSearcherEpisode,
    "react": ReActEpisode,
    "mem1": Mem1Episode,
}


def agent_type(agent: str) -> type[Episode]:
    """The episode class registered as ``agent``; a clear error naming the others if none is."""
    if agent not in AGENTS:
        raise MemSearcherError(f"unknown agent {agent!r}; choose one of {sorted(AGENTS)}")
    return AGENTS[agent]


def start_episodes(
    agent: str,
    examples: Sequence[QAExample],
    tokenizer: Tokenizer,
    config: AgentConfig | None = None,
    templates: Templates | None = None,
    max_context_tokens: int | None = None,
) -> list[Episode]:
    """One fresh episode of ``agent`` per example."""
    episode_type = agent_type(agent)
    config = config or AgentConfig()
    templates = templates or Templates()
    return [
        episode_type(example, tokenizer, config, templates, max_context_tokens)
        for example in examples
    ]
