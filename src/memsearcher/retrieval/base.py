"""The retriever protocol: a batch of queries in, ranked passages out."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Protocol, TypeGuard

from memsearcher.errors import MemSearcherError
from memsearcher.types import Hit


class SearchRefused(MemSearcherError):
    """A retriever refused these queries (a server's 4xx): the fault is in the request, not in
    the retriever, so the agent drivers end only the episode that asked (``"search_error"``)."""


class Retriever(Protocol):
    """Anything that ranks passages for queries: a local index or an HTTP client."""

    def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        """For each query, up to ``top_n`` hits, best first."""
        ...


class AsyncRetriever(Protocol):
    """A retriever whose ``search`` is a coroutine (``AsyncHTTPRetriever``)."""

    async def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]: ...


def is_async(retriever: Retriever | AsyncRetriever) -> TypeGuard[AsyncRetriever]:
    """Whether ``retriever.search`` is a coroutine (both kinds have a ``search``)."""
    return inspect.iscoroutinefunction(retriever.search)


def check_search_args(queries: Sequence[str], top_n: int) -> None:
    """Reject the two classic misuses: one string for a batch, and a non-positive ``top_n``."""
    if isinstance(queries, str):
        raise TypeError("queries must be a sequence of strings, not one string")
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise ValueError(f"top_n must be a positive integer, got {top_n!r}")
