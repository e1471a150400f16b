"""What the RL loops train on (``GRPOConfig.environment``): the task records, the environment
their episodes act in, and how an episode of the configured agent starts, as the environment's
entry in `memsearcher.agent.tasks.ENVIRONMENTS` opens them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from memsearcher.agent import Episode
from memsearcher.agent.environments import Environment
from memsearcher.agent.prompts import read_templates
from memsearcher.agent.tasks import environment_kind
from memsearcher.llm.base import Tokenizer
from memsearcher.retrieval.base import Retriever
from memsearcher.rl.config import GRPOConfig
from memsearcher.types import QAExample

__all__ = ["Task", "open_task"]

StartEpisodes = Callable[[Sequence[QAExample], Tokenizer, "int | None"], list[Episode[Any]]]
"""``(examples, tokenizer, max_context_tokens) -> one fresh episode each`` of the run's agent,
with its agent config and templates."""


@dataclass
class Task:
    """The questions of a run, what their episodes act on, and how an episode starts."""

    questions: list[QAExample]
    environment: Environment[Any, Any] | Retriever
    start_episodes: StartEpisodes


def open_task(config: GRPOConfig) -> Task:
    """The task of the environment ``config.environment`` names (`agent.tasks.ENVIRONMENTS`),
    with the run's agent, agent config and templates."""
    kind = environment_kind(config.environment)
    templates = read_templates(config.templates, kind.templates)
    questions, environment = kind.open(config)

    def start(
        examples: Sequence[QAExample], tokenizer: Tokenizer, max_context_tokens: int | None
    ) -> list[Episode[Any]]:
        return list(
            kind.start_episodes(
                config.agent_name, examples, tokenizer, config.agent, templates, max_context_tokens
            )
        )

    return Task(questions, environment, start)
