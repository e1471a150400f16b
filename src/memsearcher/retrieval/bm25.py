"""BM25 over a JSONL corpus, searched by bm25s.

The index is bm25s's own: a sparse document-by-term matrix of precomputed BM25 scores, so a
query is a sum of a few columns and a top-k. We write that matrix ourselves instead of calling
``bm25s.BM25.index``, which needs every token id of the corpus in Python lists at once (about
20 GB for the 21M passages of wiki-18). Here the corpus streams in chunks whose (term, doc, tf)
triples are spilled to disk, and a second pass counting-sorts them by term straight into
memory-mapped ``.npy`` files. The scores are bm25s's (same formulas, same float32 rounding);
``tests/test_retrieval_bm25.py`` checks that against ``bm25s.BM25.index``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from memsearcher.retrieval.base import check_search_args
from memsearcher.retrieval.corpus import (
    OnError,
    PassageStore,
    check_corpus_path,
    scan_corpus,
)
from memsearcher.retrieval.manifest import (
    OFFSETS,
    IndexFolderError,
    building,
    corpus_record,
    new_manifest,
    open_store,
    read_manifest,
    write_manifest,
)
from memsearcher.types import Hit

logger = logging.getLogger(__name__)

LIBRARY_DIR = "bm25s"
_SPLIT = re.compile(r"(?u)\b\w\w+\b").findall  # bm25s's default token pattern
T = TypeVar("T")


def _idf_lucene(df: np.ndarray, n: int) -> np.ndarray:
    return np.log(1 + (n - df + 0.5) / (df + 0.5))


def _idf_robertson(df: np.ndarray, n: int) -> np.ndarray:
    return np.log(np.maximum((n - df + 0.5) / (df + 0.5), 1.0))


def _idf_atire(df: np.ndarray, n: int) -> np.ndarray:
    return np.log(n / np.maximum(df, 1))


def _tfc_robertson(tf: np.ndarray, norm: np.ndarray, k1: float) -> np.ndarray:
    return tf / (k1 * norm + tf)


def _tfc_atire(tf: np.ndarray, norm: np.ndarray, k1: float) -> np.ndarray:
    return tf * (k1 + 1) / (tf + k1 * norm)


# BM25 variants as bm25s names them (Kamphuis et al., ECIR 2020): idf and term-frequency parts.
METHODS: dict[str, tuple[Callable[..., np.ndarray], Callable[..., np.ndarray]]] = {
    "lucene": (_idf_lucene, _tfc_robertson),
    "robertson": (_idf_robertson, _tfc_robertson),
    "atire": (_idf_atire, _tfc_atire),
}


def _bm25s() -> Any:
    """The bm25s module, imported so that it leaves the GPUs to the model.

    When JAX is installed, importing bm25s imports it and runs a top-k on JAX's default device
    (for its own top-k, which we do not use), and JAX then takes 75% of a GPU's memory. On a
    lent H200 that made two GRPO trainers fail with CUDA out of memory before their first
    step (105 GiB of 140 held by JAX, none by PyTorch). So JAX is told to allocate as it goes,
    unless the user set ``XLA_PYTHON_CLIENT_PREALLOCATE`` themselves.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import bm25s

    return bm25s


def _stopwords(name: str | None) -> frozenset[str]:
    english = _bm25s().stopwords.STOPWORDS_EN
    table: dict[str, Iterable[str]] = {"en": english, "english": english, "none": ()}
    key = (name or "none").lower()
    if key not in table:
        raise IndexFolderError(f"unknown stopword list {name!r}; known: {sorted(table)}")
    return frozenset(table[key])


@dataclass(frozen=True)
class BM25Config:
    """How to tokenize and score."""

    k1: float = 1.5
    """Term-frequency saturation (bm25s's default)."""
    b: float = 0.75
    """Length normalization."""
    method: str = "lucene"
    """BM25 variant, a key of ``METHODS``."""
    stopwords: str | None = "en"
    """Stopword list dropped before stemming: "en" (bm25s's English list) or None."""
    stemmer: str | None = "english"
    """PyStemmer (Snowball) language, or None for no stemming."""
    chunk_size: int = 20_000
    """Passages tokenized per chunk while building (bounds build memory)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise IndexFolderError(f"unknown BM25 method {self.method!r}; known: {sorted(METHODS)}")
        if self.k1 < 0 or not 0 <= self.b <= 1:
            raise IndexFolderError(f"need k1 >= 0 and 0 <= b <= 1, got k1={self.k1} b={self.b}")


class Tokenizer:
    """bm25s's pipeline: lower-case, words of 2+ word characters, drop stopwords, stem.

    PyStemmer objects are not thread-safe, so each thread gets its own.
    """

    def __init__(self, stopwords: str | None = "en", stemmer: str | None = "english") -> None:
        self.stop = _stopwords(stopwords)
        self.language = stemmer
        self._local = threading.local()
        if stemmer is not None:
            self._stemmer()  # fail now, not on the first query, if the language is unknown

    def _stemmer(self) -> Callable[[list[str]], list[str]]:
        stem = getattr(self._local, "stem", None)
        if stem is None:
            import Stemmer

            try:
                stem = Stemmer.Stemmer(self.language).stemWords
            except KeyError:
                raise IndexFolderError(
                    f"unknown stemmer language {self.language!r}; known: {Stemmer.algorithms()}"
                ) from None
            self._local.stem = stem
        return stem

    def __call__(self, text: str) -> list[str]:
        words = [w for w in _SPLIT(text.lower()) if w not in self.stop]
        if self.language is None or not words:
            return words
        return self._stemmer()(words)


def _chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@dataclass
class _Pass1:
    offsets: list[np.ndarray]
    doc_lens: list[np.ndarray]
    spills: list[Path]
    df: np.ndarray
    vocab: dict[str, int]


def _tokenize_corpus(
    corpus: Path, spill: Path, config: BM25Config, progress: bool, on_error: OnError
) -> _Pass1:
    """Pass 1: tokenize in chunks; spill each chunk's (term, doc, tf) triples to disk."""
    from tqdm.auto import tqdm

    tokenize = Tokenizer(config.stopwords, config.stemmer)
    state = _Pass1([], [], [], np.zeros(0, dtype=np.int64), {})
    vocab = state.vocab
    n_docs = 0
    size = corpus.stat().st_size
    bar = tqdm(
        total=size, unit="B", unit_scale=True, desc="bm25: tokenize",
        disable=not progress,
    )  # fmt: skip
    done = 0
    for chunk in _chunks(scan_corpus(corpus, on_error), config.chunk_size):
        ids: list[int] = []
        lens = np.empty(len(chunk), dtype=np.int64)
        for i, (_, passage) in enumerate(chunk):
            # an empty document gets bm25s's empty token, so lengths and averages match bm25s
            tokens = tokenize(f"{passage.title} {passage.text}") or [""]
            ids.extend([vocab.setdefault(t, len(vocab)) for t in tokens])
            lens[i] = len(tokens)
        # one (doc, term) key per token; unique() gives term frequencies, sorted by doc then term
        width = len(vocab)
        keys = np.repeat(np.arange(len(chunk), dtype=np.int64), lens) * width + np.asarray(ids)
        keys, tf = np.unique(keys, return_counts=True)
        terms = (keys % width).astype(np.int32)
        docs = (keys // width + n_docs).astype(np.int32)
        path = spill / f"chunk{len(state.spills):06d}.npz"
        np.savez(path, terms=terms, docs=docs, tf=tf.astype(np.int32))
        state.spills.append(path)
        state.df = np.pad(state.df, (0, width - len(state.df)))
        state.df += np.bincount(terms, minlength=width)
        state.offsets.append(np.fromiter((o for o, _ in chunk), np.int64, len(chunk)))
        state.doc_lens.append(lens)
        n_docs += len(chunk)
        bar.update(chunk[-1][0] - done)
        done = chunk[-1][0]
    bar.update(size - done)
    bar.close()
    return state


def _write_matrix(folder: Path, state: _Pass1, config: BM25Config, progress: bool) -> int:
    """Pass 2: score every (term, doc) pair and counting-sort the triples into CSC arrays."""
    from tqdm.auto import tqdm

    doc_lens = np.concatenate(state.doc_lens) if state.doc_lens else np.zeros(0, np.int64)
    n_docs, n_terms = len(doc_lens), len(state.df)
    avg_len = float(doc_lens.mean()) if n_docs else 1.0
    idf_fn, tfc_fn = METHODS[config.method]
    idf = idf_fn(state.df.astype(np.float64), n_docs).astype(np.float32)
    nnz = int(state.df.sum())
    indptr = np.zeros(n_terms + 1, dtype=np.int64)
    np.cumsum(state.df, out=indptr[1:])
    folder.mkdir()
    open_memmap = np.lib.format.open_memmap
    data = open_memmap(folder / "data.csc.index.npy", "w+", np.float32, (nnz,))
    indices = open_memmap(folder / "indices.csc.index.npy", "w+", np.int32, (nnz,))
    heads = indptr[:-1].copy()
    for path in tqdm(state.spills, desc="bm25: score", disable=not progress):
        with np.load(path) as chunk:
            terms, docs, tf = chunk["terms"], chunk["docs"], chunk["tf"]
        norm = (1 - config.b) + config.b * doc_lens[docs] / avg_len
        # float64 term part times float32 idf, rounded once to float32: bm25s's arithmetic
        scores = idf[terms].astype(np.float64) * tfc_fn(tf.astype(np.float64), norm, config.k1)
        order = np.argsort(terms, kind="stable")  # stable: docs stay ascending within a term
        terms = terms[order]
        uniq, first, counts = np.unique(terms, return_index=True, return_counts=True)
        slots = np.repeat(heads[uniq] - first, counts) + np.arange(len(terms))
        data[slots] = scores[order].astype(np.float32)
        indices[slots] = docs[order]
        heads[uniq] += counts
        path.unlink()
    data.flush()
    indices.flush()
    del data, indices
    np.save(folder / "indptr.csc.index.npy", indptr)
    vocab = json.dumps(state.vocab, ensure_ascii=False)
    (folder / "vocab.index.json").write_text(vocab, encoding="utf-8")
    params = {
        "k1": config.k1, "b": config.b, "delta": 0.5, "method": config.method,
        "idf_method": config.method, "dtype": "float32", "int_dtype": "int32",
        "num_docs": n_docs, "version": _bm25s().__version__, "backend": "numpy",
    }  # fmt: skip
    (folder / "params.index.json").write_text(json.dumps(params, indent=4), encoding="utf-8")
    return nnz


def build_bm25(
    corpus: str | Path,
    out: str | Path,
    config: BM25Config | None = None,
    *,
    progress: bool = False,
    on_error: OnError = "raise",
    overwrite: bool = False,
) -> BM25Index:
    """Build a BM25 index of ``corpus`` in the folder ``out`` and open it."""
    config = config or BM25Config()
    corpus, out = check_corpus_path(corpus), Path(out)
    started = time.perf_counter()
    with building(out, overwrite) as tmp:
        spill = tmp / "spill"
        spill.mkdir()
        state = _tokenize_corpus(corpus, spill, config, progress, on_error)
        nnz = _write_matrix(tmp / LIBRARY_DIR, state, config, progress)
        shutil.rmtree(spill)
        offsets = np.concatenate(state.offsets) if state.offsets else np.zeros(0, np.int64)
        np.save(tmp / OFFSETS, offsets)
        manifest = new_manifest(
            "bm25",
            corpus=corpus_record(corpus, len(offsets), out),
            passages=len(offsets),
            bm25={**asdict(config), "vocab_size": len(state.vocab), "nonzeros": nnz},
            build_seconds=round(time.perf_counter() - started, 3),
        )
        write_manifest(tmp, manifest)
    logger.info("built BM25 index %s: %d passages", out, len(offsets))
    return BM25Index.load(out, corpus=corpus)


class BM25Index:
    """A BM25 index folder, opened for search."""

    kind = "bm25"

    def __init__(
        self, folder: Path, manifest: dict[str, Any], model: Any, store: PassageStore
    ) -> None:
        self.folder = folder
        self.manifest = manifest
        self.model = model
        self.store = store
        config = manifest["bm25"]
        self.tokenize = Tokenizer(config["stopwords"], config["stemmer"])

    @classmethod
    def load(
        cls, folder: str | Path, corpus: str | Path | None = None, mmap: bool = False
    ) -> BM25Index:
        """Open an index folder. ``mmap`` leaves the score matrix on disk (shared page cache
        between server workers, little resident memory) at some cost in query speed."""
        folder = Path(folder)
        manifest = read_manifest(folder)
        if manifest["kind"] != cls.kind:
            raise IndexFolderError(f"{folder} holds a {manifest['kind']} index, not bm25")
        store = open_store(folder, manifest, corpus)
        model = _bm25s().BM25.load(str(folder / LIBRARY_DIR), mmap=mmap)
        if model.scores["num_docs"] != len(store):
            raise IndexFolderError(
                f"index {folder} is damaged: {model.scores['num_docs']} scored documents "
                f"for {len(store)} passages"
            )
        return cls(folder, manifest, model, store)

    def __len__(self) -> int:
        return len(self.store)

    def search_rows(
        self, queries: Sequence[str], top_n: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Row numbers and scores of the best ``top_n`` passages for each query.

        Passages that share no term with the query score 0 and are left out, so a query of
        only stopwords or unknown words gets no rows.
        """
        check_search_args(queries, top_n)
        vocab = self.model.vocab_dict
        results = []
        for query in queries:
            tokens = [t for t in self.tokenize(query) if t in vocab]
            if not tokens:
                results.append((np.zeros(0, np.int64), np.zeros(0, np.float32)))
                continue
            # bm25s scores; the top-k is ours. bm25s's np.argpartition(scores, -k) degrades
            # to ~0.7 s on 1M scores that are mostly 0 (numpy's introselect with duplicates),
            # so select among the matching passages only, which are few and distinct.
            scores = self.model.get_scores(tokens)
            rows = np.flatnonzero(scores > 0)
            if len(rows) > top_n:
                rows = rows[np.argpartition(-scores[rows], top_n - 1)[:top_n]]
            rows = rows[np.lexsort((rows, -scores[rows]))]  # by score, ties by row
            results.append((rows, scores[rows]))
        return results

    def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        return [self.store.hits(r, s) for r, s in self.search_rows(queries, top_n)]
