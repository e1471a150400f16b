"""Wrappers the agent tests put around a real LLM or retriever, to count or steer its calls."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from memsearcher.llm.base import Completion, SamplingParams, Tokenizer
from memsearcher.retrieval.base import Retriever
from memsearcher.types import Hit


class Delegating:
    """Stands in for ``llm``: its tokenizer and context length; subclasses add the calls."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    @property
    def tokenizer(self) -> Tokenizer:
        return self.llm.tokenizer

    @property
    def max_context_tokens(self) -> int:
        return self.llm.max_context_tokens


class OnePromptAtATime(Delegating):
    """``llm`` (any backend with ``generate``), one prompt per call, callable from both
    drivers: awaited, it runs in a thread, and counts the calls in flight."""

    def __init__(self, llm: Any) -> None:
        super().__init__(llm)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        with self.lock:
            return [self.llm.generate([p], params)[0] for p in prompts]

    async def agenerate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            (completion,) = await asyncio.to_thread(self.generate, [prompt_ids], params)
            return completion
        finally:
            self.in_flight -= 1


class CountingRetriever:
    """``retriever``, keeping every batch of queries it was asked."""

    def __init__(self, retriever: Retriever) -> None:
        self.retriever = retriever
        self.batches: list[list[str]] = []

    def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        self.batches.append(list(queries))
        return self.retriever.search(queries, top_n)
