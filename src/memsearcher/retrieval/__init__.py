"""Retrieval: corpora, BM25 and dense indexes, and an HTTP server and client.

Every backend implements :class:`Retriever` (``search(queries, top_n)``); :func:`open_retriever`
turns a user's ``--retriever`` value into one. How hits are written out for the model is the
agent's (`memsearcher.agent.prompts.format_hits`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.retrieval.base import Retriever, SearchRefused
from memsearcher.retrieval.cache import DEFAULT_CACHE_SIZE, CachedRetriever, with_cache
from memsearcher.retrieval.corpus import CorpusError, Passage, read_corpus
from memsearcher.retrieval.embedded import embedded_corpus_path, load_embedded_retriever
from memsearcher.retrieval.manifest import IndexFolderError, read_manifest

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "CachedRetriever",
    "CorpusError",
    "IndexFolderError",
    "Passage",
    "Retriever",
    "SearchRefused",
    "embedded_corpus_path",
    "load_embedded_retriever",
    "load_index",
    "open_retriever",
    "read_corpus",
    "with_cache",
]


def _loaders() -> dict[str, Callable[..., Any]]:
    # imported here: the dense and hybrid loaders pull in faiss and sentence-transformers
    from memsearcher.retrieval.bm25 import BM25Index
    from memsearcher.retrieval.dense import DenseIndex
    from memsearcher.retrieval.hybrid import HybridIndex

    return {"bm25": BM25Index.load, "dense": DenseIndex.load, "hybrid": HybridIndex.load}


def load_index(path: str | Path, **options: Any) -> Retriever:
    """Open any index folder, by the kind its manifest names."""
    manifest = read_manifest(path)
    loaders = _loaders()
    kind = manifest["kind"]
    if kind not in loaders:
        raise IndexFolderError(f"{path}: unknown index kind {kind!r}; known: {sorted(loaders)}")
    retriever: Retriever = loaders[kind](path, **options)
    return retriever


def open_retriever(spec: str | None, cache_size: int = 0) -> Retriever:
    """``None``: the embedded BM25; an ``http(s)://`` URL: a retrieval server; else an index
    folder. ``cache_size`` > 0 puts it behind a :class:`CachedRetriever` of that many answers."""
    retriever: Retriever
    if spec is None:
        retriever = load_embedded_retriever()
    elif spec.startswith(("http://", "https://")):
        from memsearcher.retrieval.client import HTTPRetriever

        retriever = HTTPRetriever(spec)
    elif not Path(spec).exists():
        raise MemSearcherError(f"--retriever {spec}: not a URL and no such index folder")
    else:
        retriever = load_index(spec)
    return with_cache(retriever, cache_size)
