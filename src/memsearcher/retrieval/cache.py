"""A retriever wrapper that searches each distinct query of a batch once and keeps recent answers.

The G samples of a GRPO group start from the same question and often send the same first query
in the same lockstep round (benchmarks/repeated_queries.py measures how often; docs/retrieval.md
has the numbers). :class:`CachedRetriever` sends the backend each distinct (query, top_n) once
per batch and keeps the last ``capacity`` answers in an LRU, so a later round or step that asks
again is answered from memory.

An index does not change while it is open (the folders are written once, atomically, and
loaded read-only), so an answer stays right for as long as the wrapper lives; the key holds
``top_n`` because the hits for 3 are not the hits for 5. Hits are frozen dataclasses and every
call gets lists of its own, so a caller that edits its lists cannot reach the cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from memsearcher.retrieval.base import Retriever, check_search_args
from memsearcher.types import Hit

__all__ = ["DEFAULT_CACHE_SIZE", "CachedRetriever", "with_cache"]

DEFAULT_CACHE_SIZE = 4096
"""Answers kept: at 5 wiki-18 passages an answer, about 4 MB of text."""


class CachedRetriever:
    """``retriever`` with batch deduplication and an LRU of ``capacity`` (query, top_n)
    answers; ``stats()`` counts hits (queries answered without the backend: repeats within a
    batch and cached answers) and misses (queries the backend searched)."""

    def __init__(self, retriever: Retriever, capacity: int = DEFAULT_CACHE_SIZE) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"cache capacity must be an integer >= 1, got {capacity!r}")
        self.retriever = retriever
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._answers: OrderedDict[tuple[str, int], tuple[Hit, ...]] = OrderedDict()
        # the server and the async driver search from one worker thread; the lock is for a
        # caller that shares one wrapper between threads, and for /health reading the counters
        self._lock = threading.Lock()

    def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        check_search_args(queries, top_n)
        found: dict[str, tuple[Hit, ...]] = {}
        missing = []
        with self._lock:
            for query in dict.fromkeys(queries):
                answer = self._answers.get((query, top_n))
                if answer is None:
                    missing.append(query)
                else:
                    self._answers.move_to_end((query, top_n))
                    found[query] = answer
        if missing:
            results = self.retriever.search(missing, top_n)
            if len(results) != len(missing):
                raise RuntimeError(f"{len(results)} results for {len(missing)} queries")
            found.update((query, tuple(hits)) for query, hits in zip(missing, results, strict=True))
        with self._lock:
            self.misses += len(missing)
            self.hits += len(queries) - len(missing)
            for query in missing:
                self._answers[(query, top_n)] = found[query]
                self._answers.move_to_end((query, top_n))
            while len(self._answers) > self.capacity:
                self._answers.popitem(last=False)
        return [list(found[query]) for query in queries]

    def stats(self) -> dict[str, Any]:
        """What /health shows: entries held, capacity, hits and misses so far."""
        with self._lock:
            return {
                "size": len(self._answers),
                "capacity": self.capacity,
                "hits": self.hits,
                "misses": self.misses,
            }


def with_cache(retriever: Retriever, capacity: int) -> Retriever:
    """``retriever`` behind a :class:`CachedRetriever` of ``capacity`` answers; 0: as it is
    (no cache and no deduplication)."""
    if capacity == 0:
        return retriever
    return CachedRetriever(retriever, capacity)
