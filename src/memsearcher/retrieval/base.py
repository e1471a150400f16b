"""The retriever protocol: a batch of queries in, ranked passages out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from memsearcher.types import Hit


class Retriever(Protocol):
    """Anything that ranks passages for queries: a local index or an HTTP client."""

    def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        """For each query, up to ``top_n`` hits, best first."""
        ...
