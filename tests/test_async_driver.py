"""The async driver with the real embedded model and BM25 index.

The transformers backend is made awaitable by running its ``generate`` in a thread, one prompt
per call; the lockstep driver gets the same one-prompt calls, so greedy decoding must give both
drivers the same trajectories (batched prompts would add padding, which may change float sums).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from _wrappers import CountingRetriever, Delegating, OnePromptAtATime

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.async_driver import run_async
from memsearcher.agent.environments import SearchEnvironment
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import Completion, SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.retrieval.base import Retriever
from memsearcher.types import Hit, QAExample, Turn

QUESTIONS = [
    QAExample("a", "Who wrote Hamlet?", ("Shakespeare",)),
    QAExample("b", "What is the capital of France?", ("Paris",)),
    QAExample("c", "Which planet is red?", ("Mars",)),
    QAExample("d", "Who painted the Mona Lisa?", ("Leonardo",)),
]
CONFIG = AgentConfig(max_turns=2, max_new_tokens=32, memory_tokens=32)


@pytest.mark.slow
def test_async_driver_agrees_with_lockstep(llm: HFModel, retriever: Retriever) -> None:
    backend = OnePromptAtATime(llm)
    counting = CountingRetriever(retriever)
    greedy = SamplingParams()

    def episodes() -> list:
        return start_episodes(
            "memsearcher", QUESTIONS, llm.tokenizer, CONFIG, None, llm.max_context_tokens
        )

    finished: list[str] = []
    told: list[tuple[int, Turn]] = []
    concurrent = asyncio.run(
        run_async(
            episodes(),
            backend,
            counting,
            greedy,
            concurrency=2,
            on_done=lambda i, t: finished.append(t.example.id),
            on_turn=lambda i, turn: told.append((i, turn)),
        )
    )
    lockstep = run_lockstep(episodes(), backend, retriever, greedy)
    assert [t.example.id for t in concurrent] == ["a", "b", "c", "d"]
    assert sorted(finished) == ["a", "b", "c", "d"]
    for i, trajectory in enumerate(concurrent):  # every turn told once, in order
        assert [turn for j, turn in told if j == i] == list(trajectory.turns)
    assert [t.to_dict() for t in concurrent] == [t.to_dict() for t in lockstep]
    assert backend.most_in_flight <= 2
    assert sum(map(len, counting.batches)) == sum(t.num_searches for t in concurrent)


def test_async_driver_rejects_bad_concurrency(llm: HFModel, retriever: Retriever) -> None:
    episodes = start_episodes("memsearcher", QUESTIONS[:1], llm.tokenizer, CONFIG)
    with pytest.raises(ValueError, match="concurrency"):
        asyncio.run(run_async(episodes, OnePromptAtATime(llm), retriever, SamplingParams(), 0))


def test_an_environment_for_the_lockstep_driver_only_is_refused(
    llm: HFModel, retriever: Retriever
) -> None:
    episodes = start_episodes("memsearcher", QUESTIONS[:1], llm.tokenizer, CONFIG)
    lockstep_only = SearchEnvironment(retriever)  # an Environment with no act_one
    with pytest.raises(MemSearcherError, match="SearchEnvironment acts for the lockstep driver"):
        asyncio.run(run_async(episodes, OnePromptAtATime(llm), lockstep_only, SamplingParams()))


class FailingRetriever:
    def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        raise RuntimeError("index is gone")


class ScriptedSearch(Delegating):
    """Writes a tool call, whatever the prompt: every episode asks for a search."""

    async def agenerate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        text = '<think>t</think><tool_call>{"name": "wikipedia_search", "arguments": '
        text += '{"query": "Hamlet"}}</tool_call>'
        return Completion(tuple(self.llm.tokenizer.encode(text)), "stop")


def test_a_failing_search_reaches_the_caller(llm: HFModel) -> None:
    episodes = start_episodes("memsearcher", QUESTIONS, llm.tokenizer, CONFIG)
    with pytest.raises(RuntimeError, match="index is gone"):
        asyncio.run(run_async(episodes, ScriptedSearch(llm), FailingRetriever(), SamplingParams()))


class AskingServer(ScriptedSearch):
    """An async backend whose context length, like an HTTP model's, would ask a server."""

    @property
    def max_context_tokens(self) -> int:
        raise ConnectionError("nothing listens")


def test_async_backends_are_told_apart_without_touching_their_properties(
    llm: HFModel, retriever: Retriever
) -> None:
    from memsearcher.llm.base import is_async as is_async_llm
    from memsearcher.retrieval.base import is_async as is_async_retriever
    from memsearcher.retrieval.client import AsyncHTTPRetriever, HTTPRetriever

    assert is_async_llm(AskingServer(llm)) and not is_async_llm(llm)
    assert is_async_retriever(AsyncHTTPRetriever("http://127.0.0.1:9"))
    assert not is_async_retriever(HTTPRetriever("http://127.0.0.1:9"))
    assert not is_async_retriever(retriever)
