"""What the RL loops train on (``GRPOConfig.environment``): the task records, the environment
their episodes act in, and how an episode of the configured agent starts. One function a
kind, in the `TASKS` registry.

- ``search``: FlashRAG questions (``data``), answered by searching a retriever (``retriever``).
- ``shop``: the instructions of one split of the generated shop (``shop``, ``shop_split``),
  acted on in `ShopEnvironment`; the reward is the shop's (``reward: environment``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from memsearcher.agent import Episode, load_templates, start_episodes
from memsearcher.agent.environments import Environment
from memsearcher.agent.environments.shop import ShopEnvironment, ShopSearch, instruction_example
from memsearcher.agent.environments.shop_world import generate_catalogue
from memsearcher.agent.prompts import read_templates
from memsearcher.agent.shop_agents import ShopTemplates, start_shop_episodes
from memsearcher.data.flashrag import read_examples
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import Tokenizer
from memsearcher.retrieval import open_retriever
from memsearcher.retrieval.base import Retriever
from memsearcher.rl.config import GRPOConfig
from memsearcher.types import QAExample

__all__ = ["TASKS", "Task", "open_task"]

StartEpisodes = Callable[[Sequence[QAExample], Tokenizer, "int | None"], list[Episode[Any]]]
"""``(examples, tokenizer, max_context_tokens) -> one fresh episode each`` of the run's agent,
with its agent config and templates."""


@dataclass
class Task:
    """The questions of a run, what their episodes act on, and how an episode starts."""

    questions: list[QAExample]
    environment: Environment[Any, Any] | Retriever
    start_episodes: StartEpisodes


def search_task(config: GRPOConfig) -> Task:
    """FlashRAG questions over a retriever: the search QA every agent was built for."""
    questions = read_examples(config.data)
    if not questions:
        raise MemSearcherError(f"{config.data}: no questions to train on")
    templates = load_templates(config.templates)

    def start(
        examples: Sequence[QAExample], tokenizer: Tokenizer, max_context_tokens: int | None
    ) -> list[Episode[Any]]:
        return start_episodes(
            config.agent_name, examples, tokenizer, config.agent, templates, max_context_tokens
        )

    return Task(questions, open_retriever(config.retriever, config.retriever_cache), start)


def shop_task(config: GRPOConfig) -> Task:
    """The instructions of ``config.shop_split`` of the shop ``config.shop`` generates, in
    sessions of that shop over its own BM25."""
    catalogue = generate_catalogue(config.shop)
    questions = [instruction_example(i) for i in catalogue.split(config.shop_split)]
    if not questions:
        raise MemSearcherError(
            f"shop_split: the shop of {config.shop} has no {config.shop_split!r} instructions"
        )
    templates = read_templates(config.templates, ShopTemplates)

    def start(
        examples: Sequence[QAExample], tokenizer: Tokenizer, max_context_tokens: int | None
    ) -> list[Episode[Any]]:
        return list(
            start_shop_episodes(
                config.agent_name, examples, tokenizer, config.agent, templates, max_context_tokens
            )
        )

    environment = ShopEnvironment(catalogue, ShopSearch(catalogue.products))
    return Task(questions, environment, start)


TASKS: dict[str, Callable[[GRPOConfig], Task]] = {"search": search_task, "shop": shop_task}


def open_task(config: GRPOConfig) -> Task:
    """The task ``config.environment`` names (checked against `TASKS` by the config)."""
    return TASKS[config.environment](config)
