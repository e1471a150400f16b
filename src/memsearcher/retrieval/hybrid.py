"""Hybrid retrieval: BM25 and dense candidates fused into one ranking.

A hybrid folder holds a complete BM25 index (``bm25/``) and dense index (``dense/``) of the same
corpus. Each side proposes ``depth`` candidates; a fusion function from ``FUSIONS`` merges them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memsearcher.retrieval.base import check_search_args
from memsearcher.retrieval.bm25 import BM25Config, BM25Index, build_bm25
from memsearcher.retrieval.corpus import CorpusError, OnError
from memsearcher.retrieval.dense import DenseIndex, EncoderConfig, FaissConfig, build_dense
from memsearcher.retrieval.manifest import (
    IndexFolderError,
    building,
    new_manifest,
    read_manifest,
    write_manifest,
)
from memsearcher.types import Hit

Ranked = tuple[np.ndarray, np.ndarray]  # (rows, scores), best first


def fuse_rrf(lists: Sequence[Ranked], weights: Sequence[float], k: float = 60.0) -> Ranked:
    """Reciprocal rank fusion (Cormack et al., SIGIR 2009): sum of w / (k + rank), rank from 1.

    Scale-free, so BM25's unbounded scores and cosine similarities need no calibration.
    """
    fused: dict[int, float] = {}
    for (rows, _), weight in zip(lists, weights, strict=True):
        for rank, row in enumerate(rows.tolist(), start=1):
            fused[row] = fused.get(row, 0.0) + weight / (k + rank)
    return _sorted(fused)


def fuse_linear(lists: Sequence[Ranked], weights: Sequence[float]) -> Ranked:
    """Weighted sum of min-max normalized scores; a candidate missing from a list gets 0 there."""
    fused: dict[int, float] = {}
    for (rows, scores), weight in zip(lists, weights, strict=True):
        if len(rows) == 0:
            continue
        low, high = float(scores.min()), float(scores.max())
        span = high - low
        normed = (scores - low) / span if span > 0 else np.ones_like(scores)
        for row, score in zip(rows.tolist(), normed.tolist(), strict=True):
            fused[row] = fused.get(row, 0.0) + weight * score
    return _sorted(fused)


def _sorted(fused: dict[int, float]) -> Ranked:
    # ties broken by row number, so fusion is deterministic
    items = sorted(fused.items(), key=lambda item: (-item[1], item[0]))
    rows = np.array([row for row, _ in items], dtype=np.int64)
    return rows, np.array([score for _, score in items], dtype=np.float32)


FUSIONS: dict[str, Callable[[Sequence[Ranked], Sequence[float]], Ranked]] = {
    "rrf": fuse_rrf,
    "linear": fuse_linear,
}


@dataclass(frozen=True)
class HybridConfig:
    """How BM25 and dense rankings are combined."""

    fusion: str = "rrf"
    """A key of ``FUSIONS``."""
    dense_weight: float = 0.5
    """Weight of the dense ranking; BM25 gets 1 - dense_weight."""
    depth: int = 50
    """Candidates taken from each side before fusing (at least top_n)."""

    def __post_init__(self) -> None:
        if self.fusion not in FUSIONS:
            raise IndexFolderError(f"unknown fusion {self.fusion!r}; known: {sorted(FUSIONS)}")
        if not 0 <= self.dense_weight <= 1 or self.depth < 1:
            raise IndexFolderError("need 0 <= dense_weight <= 1 and depth >= 1")


def build_hybrid(
    corpus: str | Path,
    out: str | Path,
    config: HybridConfig | None = None,
    bm25: BM25Config | None = None,
    encoder: EncoderConfig | None = None,
    index: FaissConfig | None = None,
    *,
    progress: bool = False,
    on_error: OnError = "raise",
    overwrite: bool = False,
) -> HybridIndex:
    """Build the BM25 and dense halves of a hybrid index in ``out`` and open it."""
    corpus, out = Path(corpus), Path(out)
    if not corpus.is_file():
        raise CorpusError(f"corpus file not found: {corpus}")
    config = config or HybridConfig()
    started = time.perf_counter()
    with building(out, overwrite) as tmp:
        sparse = build_bm25(corpus, tmp / "bm25", bm25, progress=progress, on_error=on_error)
        dense = build_dense(
            corpus, tmp / "dense", encoder, index, progress=progress, on_error=on_error
        )
        if len(sparse) != len(dense):
            raise IndexFolderError("the BM25 and dense halves disagree on the passage count")
        manifest = new_manifest(
            "hybrid",
            corpus=sparse.manifest["corpus"],
            passages=len(sparse),
            hybrid=asdict(config),
            parts={"bm25": "bm25", "dense": "dense"},
            build_seconds=round(time.perf_counter() - started, 3),
        )
        write_manifest(tmp, manifest)
    return HybridIndex.load(out, corpus=corpus)


class HybridIndex:
    """A hybrid index folder, opened for search."""

    kind = "hybrid"

    def __init__(
        self, folder: Path, manifest: dict[str, Any], sparse: BM25Index, dense: DenseIndex
    ) -> None:
        self.folder = folder
        self.manifest = manifest
        self.sparse = sparse
        self.dense = dense
        self.config = HybridConfig(**manifest["hybrid"])
        self.store = sparse.store

    @classmethod
    def load(
        cls,
        folder: str | Path,
        corpus: str | Path | None = None,
        *,
        mmap: bool = False,
        **dense_options: Any,
    ) -> HybridIndex:
        folder = Path(folder)
        manifest = read_manifest(folder)
        if manifest["kind"] != cls.kind:
            raise IndexFolderError(f"{folder} holds a {manifest['kind']} index, not hybrid")
        sparse = BM25Index.load(folder / manifest["parts"]["bm25"], corpus, mmap=mmap)
        dense = DenseIndex.load(
            folder / manifest["parts"]["dense"], corpus, mmap=mmap, **dense_options
        )
        return cls(folder, manifest, sparse, dense)

    def __len__(self) -> int:
        return len(self.store)

    def search_rows(self, queries: Sequence[str], top_n: int) -> list[Ranked]:
        check_search_args(queries, top_n)
        depth = max(top_n, self.config.depth)
        fuse = FUSIONS[self.config.fusion]
        weights = (1 - self.config.dense_weight, self.config.dense_weight)
        pairs = zip(
            self.sparse.search_rows(queries, depth),
            self.dense.search_rows(queries, depth),
            strict=True,
        )
        results = []
        for sparse, dense in pairs:
            rows, scores = fuse((sparse, dense), weights)
            results.append((rows[:top_n], scores[:top_n]))
        return results

    def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        return [self.store.hits(r, s) for r, s in self.search_rows(queries, top_n)]
