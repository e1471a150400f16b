"""Wrappers the agent tests put around a real LLM or retriever, to count or steer its calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memsearcher.llm.base import Tokenizer
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


class CountingRetriever:
    """``retriever``, keeping every batch of queries it was asked."""

    def __init__(self, retriever: Retriever) -> None:
        self.retriever = retriever
        self.batches: list[list[str]] = []

    def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        self.batches.append(list(queries))
        return self.retriever.search(queries, top_n)
