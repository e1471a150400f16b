"""Agents as step machines, and the drivers that run them."""

from __future__ import annotations

from collections.abc import Sequence

from memsearcher.agent.base import AgentConfig, Episode, Generate, Request, Search
from memsearcher.agent.driver import run_lockstep
from memsearcher.agent.memory_agent import MemSearcherEpisode
from memsearcher.agent.prompts import Templates, load_templates
from memsearcher.agent.react import ReActEpisode
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import Tokenizer
from memsearcher.types import QAExample

__all__ = [
    "AGENTS",
    "AgentConfig",
    "Episode",
    "Generate",
    "MemSearcherEpisode",
    "ReActEpisode",
    "Request",
    "Search",
    "Templates",
    "load_templates",
    "run_lockstep",
    "start_episodes",
]

AGENTS: dict[str, type[Episode]] = {"memsearcher": MemSearcherEpisode, "react": ReActEpisode}


def start_episodes(
    agent: str,
    examples: Sequence[QAExample],
    tokenizer: Tokenizer,
    config: AgentConfig | None = None,
    templates: Templates | None = None,
    max_context_tokens: int | None = None,
) -> list[Episode]:
    """One fresh episode of ``agent`` per example."""
    if agent not in AGENTS:
        raise MemSearcherError(f"unknown agent {agent!r}; choose one of {sorted(AGENTS)}")
    episode_type = AGENTS[agent]
    config = config or AgentConfig()
    templates = templates or Templates()
    return [
        episode_type(example, tokenizer, config, templates, max_context_tokens)
        for example in examples
    ]
