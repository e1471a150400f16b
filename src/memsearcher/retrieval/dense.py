"""Dense retrieval: sentence-transformers encoders and FAISS (flat, HNSW, IVF-PQ).

Building runs in two passes. Pass 1 streams the corpus through the encoder into a float16
embeddings file (N x dim), the expensive part (hours for wiki-18 with E5 on one GPU). Pass 2 builds
the FAISS index from that file in chunks. Keep the embeddings (``keep_embeddings``) and other
FAISS variants can be built from them later (``embeddings_from``) without encoding again.

Embeddings are L2-normalized and compared by inner product, i.e. cosine similarity. Query and
passage prefixes (E5's ``query: `` / ``passage: ``) are resolved once at build time, from the
user, the encoder's own prompt config, or a table of known families, and stored in the manifest
so every later query is encoded exactly like the index expects.

faiss and sentence-transformers are optional: ``pip install 'memsearcher[dense]'``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from memsearcher.errors import MemSearcherError
from memsearcher.retrieval.base import check_search_args
from memsearcher.retrieval.corpus import CorpusError, OnError, PassageStore, scan_corpus
from memsearcher.retrieval.encoder import (
    EMBEDDED_ENCODER,
    Encoder,
    EncoderConfig,
    embedded_encoder_path,
    require,
    resolve_prefixes,
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
from memsearcher.retrieval.rerank import (
    RERANK_FILE,
    embeddings_in,
    ivf_payload_bytes,
    mapped_bytes,
    memory_record,
    open_embeddings,
    open_rerank_file,
    rss_anon_bytes,
    write_rerank_file,
)
from memsearcher.types import Hit

logger = logging.getLogger(__name__)

FAISS_FILE = "index.faiss"
EMBEDDINGS_FILE = "embeddings.f16"


@dataclass(frozen=True)
class FaissConfig:
    """The FAISS index and its parameters."""

    kind: str = "flat"
    """A key of ``FAISS_KINDS``: exact "flat", graph "hnsw", or compressed "ivfpq"."""
    hnsw_m: int = 32
    """HNSW: neighbours per node (memory grows by 2 x 4 x M bytes per vector)."""
    ef_construction: int = 128
    """HNSW: candidate list while building (higher: better graph, slower build)."""
    ef_search: int = 64
    """HNSW: candidate list while searching (higher: better recall, slower)."""
    nlist: int | None = None
    """IVF: number of clusters; None picks about sqrt(N), a power of two."""
    nprobe: int | None = None
    """IVF: clusters visited per query; None: 32, or ``RERANK_NPROBE`` with ``rerank``."""
    pq_m: int = 48
    """PQ: bytes per vector code (must divide the dimension)."""
    pq_bits: int = 8
    """PQ: bits per sub-quantizer code."""
    opq: bool = False
    """IVF-PQ: learn a rotation first (OPQ), for better recall at the same size."""
    rerank: bool = False
    """IVF-PQ: keep the float16 embeddings and re-rank candidates by exact inner products read
    through a memory map (``memsearcher.retrieval.rerank``): flat's answers at IVF-PQ's memory."""
    candidates: int = 50
    """Re-rank: candidates the codes return per query (at least top_n are always taken)."""
    train_size: int = 100_000
    """IVF-PQ: at most this many vectors train the quantizers."""
    threads: int | None = None
    """FAISS OpenMP threads; None leaves FAISS's default (all cores)."""

    def __post_init__(self) -> None:
        if self.kind not in FAISS_KINDS:
            raise IndexFolderError(f"unknown FAISS index {self.kind!r}; known: {FAISS_KINDS}")
        if self.rerank and self.kind != "ivfpq":
            raise IndexFolderError(f"rerank applies to ivfpq indexes, not {self.kind}")
        if self.candidates < 1 or self.search_nprobe < 1:
            raise IndexFolderError("candidates and nprobe must be at least 1")

    @property
    def search_nprobe(self) -> int:
        if self.nprobe is not None:
            return self.nprobe
        return RERANK_NPROBE if self.rerank else 32


FAISS_KINDS = ("flat", "hnsw", "ivfpq")
RERANK_NPROBE = 16
"""Default nprobe of re-ranking indexes, from benchmarks/retrieval_rerank.py (docs/retrieval.md):
re-ranking recovers what the codes misorder, so fewer clusters are needed than without it."""


def _passage_text(title: str, text: str) -> str:
    # the FlashRAG / Search-R1 E5 indexes embed the contents field: title line, then text
    return f"{title}\n{text}" if title else text


def _encode_corpus(
    corpus: Path, folder: Path, encoder: Encoder, chunk: int, progress: bool, on_error: OnError
) -> tuple[np.ndarray, int]:
    """Pass 1: embeddings of every passage into ``folder/EMBEDDINGS_FILE``; returns the offsets
    and the dimension."""
    from tqdm.auto import tqdm

    offsets: list[int] = []
    dim = 0
    batch: list[str] = []
    bar = tqdm(total=None, unit="passage", desc="dense: encode", disable=not progress)
    with (folder / EMBEDDINGS_FILE).open("wb") as out:

        def flush() -> None:
            nonlocal dim
            vectors = encoder.passages(batch)
            dim = vectors.shape[1]
            out.write(vectors.astype(np.float16).tobytes())
            bar.update(len(batch))
            batch.clear()

        for offset, passage in scan_corpus(corpus, on_error):
            offsets.append(offset)
            batch.append(_passage_text(passage.title, passage.text))
            if len(batch) == chunk:
                flush()
        if batch:
            flush()
    bar.close()
    return np.asarray(offsets, dtype=np.int64), dim


def _open_embeddings(folder: Path, rows: int, dim: int) -> np.ndarray:
    if (folder / RERANK_FILE).is_file():  # a re-ranking index keeps them there
        return embeddings_in(folder / RERANK_FILE, rows, dim)
    return open_embeddings(folder / EMBEDDINGS_FILE, rows, dim)


def default_nlist(rows: int) -> int:
    """About sqrt(N) clusters, a power of two, at least 39 training points each."""
    if rows < 2 * 39:
        return 1
    nlist = 2 ** round(math.log2(math.sqrt(rows)))
    return int(max(1, min(nlist, 65536, rows // 39)))


def _make_faiss(config: FaissConfig, dim: int, rows: int) -> Any:
    faiss = require("faiss")
    ip = faiss.METRIC_INNER_PRODUCT
    if config.kind == "flat":
        return faiss.IndexFlatIP(dim)
    if config.kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, config.hnsw_m, ip)
        index.hnsw.efConstruction = config.ef_construction
        return index
    if dim % config.pq_m:
        raise IndexFolderError(f"pq_m={config.pq_m} must divide the dimension {dim}")
    if min(rows, config.train_size) < 39 * 2**config.pq_bits:
        logger.warning(
            "IVF-PQ with %d-bit codes trains poorly on fewer than %d vectors (have %d)",
            config.pq_bits, 39 * 2**config.pq_bits, min(rows, config.train_size),
        )  # fmt: skip
    nlist = config.nlist or default_nlist(rows)
    rotation = f"OPQ{config.pq_m}," if config.opq else ""
    # "np": no polysemous training, which index_factory runs for 8-bit codes by default; it
    # only serves Hamming-threshold search, which we never use, and took 217 s of a 218 s
    # build of 1,000 vectors here
    spec = f"{rotation}IVF{nlist},PQ{config.pq_m}x{config.pq_bits}np"
    return faiss.index_factory(dim, spec, ip)


def build_faiss(
    embeddings: np.ndarray, config: FaissConfig, progress: bool, chunk: int = 65536
) -> Any:
    """Pass 2: a FAISS index over the embeddings, trained on a sample where it needs training."""
    from tqdm.auto import tqdm

    faiss = require("faiss")
    if config.threads:
        faiss.omp_set_num_threads(config.threads)
    rows, dim = embeddings.shape
    index = _make_faiss(config, dim, rows)
    if not index.is_trained:
        pick = np.random.default_rng(0).choice(rows, min(rows, config.train_size), replace=False)
        index.train(np.asarray(embeddings[np.sort(pick)], dtype=np.float32))
    for start in tqdm(range(0, rows, chunk), desc=f"dense: {config.kind}", disable=not progress):
        index.add(np.asarray(embeddings[start : start + chunk], dtype=np.float32))
    return index


def _apply_search_params(index: Any, params: dict[str, Any]) -> None:
    faiss = require("faiss")
    if "ef_search" in params and hasattr(index, "hnsw"):
        index.hnsw.efSearch = int(params["ef_search"])
    if "nprobe" in params:
        with contextlib.suppress(RuntimeError):  # RuntimeError: not an IVF index
            faiss.extract_index_ivf(index).nprobe = int(params["nprobe"])


def build_dense(
    corpus: str | Path,
    out: str | Path,
    encoder: EncoderConfig | None = None,
    index: FaissConfig | None = None,
    *,
    keep_embeddings: bool = False,
    embeddings_from: str | Path | None = None,
    chunk: int = 4096,
    progress: bool = False,
    on_error: OnError = "raise",
    overwrite: bool = False,
) -> DenseIndex:
    """Build a dense index of ``corpus`` in the folder ``out`` and open it.

    ``embeddings_from`` names a dense index of the same corpus built with ``keep_embeddings``:
    its encoder and embeddings are reused and only the FAISS index is built.
    """
    corpus, out = Path(corpus), Path(out)
    encoder_config = encoder or EncoderConfig()
    faiss_config = index or FaissConfig()
    if not corpus.is_file():
        raise CorpusError(f"corpus file not found: {corpus}")
    started = time.perf_counter()
    with building(out, overwrite) as tmp:
        if embeddings_from is not None:
            offsets, dim, encoder_record = _reuse_embeddings(Path(embeddings_from), corpus, tmp)
            encode_seconds = 0.0
        else:
            model = Encoder(encoder_config)
            offsets, dim = _encode_corpus(corpus, tmp, model, chunk, progress, on_error)
            np.save(tmp / OFFSETS, offsets)
            encoder_record = {
                **asdict(encoder_config),
                "query_prefix": model.query_prefix,
                "passage_prefix": model.passage_prefix,
            }
            encode_seconds = time.perf_counter() - started
        if dim == 0:
            dim = 1  # an empty corpus; FAISS still wants a dimension
        faiss = require("faiss")
        embeddings = _open_embeddings(tmp, len(offsets), dim)
        built = time.perf_counter()
        faiss_index = build_faiss(embeddings, faiss_config, progress)
        faiss.write_index(faiss_index, str(tmp / FAISS_FILE))
        del embeddings
        if faiss_config.rerank:  # the embeddings move into the re-rank file
            write_rerank_file(tmp / EMBEDDINGS_FILE, tmp / RERANK_FILE, len(offsets), dim)
            keep_embeddings = True
            (tmp / EMBEDDINGS_FILE).unlink()
        elif not keep_embeddings:
            (tmp / EMBEDDINGS_FILE).unlink()
        index_bytes = (tmp / FAISS_FILE).stat().st_size
        rerank_file = tmp / RERANK_FILE
        rerank_bytes = rerank_file.stat().st_size if rerank_file.is_file() else 0
        rows = len(offsets)
        faiss_record = {
            **asdict(faiss_config),
            "nprobe": faiss_config.search_nprobe,
            "nlist": _nlist(faiss_index),
            "description": type(faiss_index).__name__,
        }
        manifest = new_manifest(
            "dense",
            corpus=corpus_record(corpus, rows, out),
            passages=rows,
            dense={
                "encoder": encoder_record,
                "dim": dim,
                "metric": "inner_product",
                "normalized": True,
                "faiss": faiss_record,
                "kept_embeddings": keep_embeddings,
                "index_bytes": index_bytes,
                "bytes_per_passage": round((index_bytes + 8 * rows) / max(rows, 1), 1),
                "memory": _memory(faiss_index, index_bytes, rows, rerank_bytes),
            },
            encode_seconds=round(encode_seconds, 3),
            index_seconds=round(time.perf_counter() - built, 3),
            build_seconds=round(time.perf_counter() - started, 3),
        )
        write_manifest(tmp, manifest)
    return DenseIndex.load(out, corpus=corpus)


def _reuse_embeddings(
    source: Path, corpus: Path, folder: Path
) -> tuple[np.ndarray, int, dict[str, Any]]:
    """Copy the kept embeddings of another dense index of the same corpus into ``folder``."""
    donor = read_manifest(source)
    if donor["kind"] != "dense" or not donor["dense"].get("kept_embeddings"):
        raise IndexFolderError(f"{source} is not a dense index that kept its embeddings")
    open_store(source, donor, corpus).close()  # checks it indexed this very corpus
    shutil.copyfile(source / OFFSETS, folder / OFFSETS)
    embeddings = _open_embeddings(source, donor["passages"], donor["dense"]["dim"])
    with (folder / EMBEDDINGS_FILE).open("wb") as out:
        for start in range(0, len(embeddings), 65536):
            out.write(np.ascontiguousarray(embeddings[start : start + 65536]).tobytes())
    return np.load(folder / OFFSETS), donor["dense"]["dim"], donor["dense"]["encoder"]


def _memory(index: Any, index_bytes: int, rows: int, rerank_bytes: int) -> dict[str, Any]:
    """Resident and disk bytes (see ``rerank.memory_record``); the whole index is resident for
    kinds other than IVF-PQ."""
    payload = ivf_payload_bytes(index) if _nlist(index) is not None else index_bytes
    record = memory_record(index_bytes, payload, rows, rerank_bytes)
    return {**record, "rerank_file": RERANK_FILE if rerank_bytes else None}


def _nlist(index: Any) -> int | None:
    faiss = require("faiss")
    try:
        return int(faiss.extract_index_ivf(index).nlist)
    except RuntimeError:
        return None


@dataclass
class DenseIndex:
    """A dense index folder, opened for search."""

    folder: Path
    manifest: dict[str, Any]
    index: Any
    encoder: Encoder
    store: PassageStore
    search_params: dict[str, Any] = field(default_factory=dict)
    refine: Any = None
    """Re-ranking indexes: the float16 re-rank index (codes memory-mapped); else None."""
    load_rss_anon_bytes: int | None = None
    """Anonymous memory that reading the FAISS index and offsets added to this process."""
    kind = "dense"

    @classmethod
    def load(
        cls,
        folder: str | Path,
        corpus: str | Path | None = None,
        *,
        ef_search: int | None = None,
        nprobe: int | None = None,
        candidates: int | None = None,
        devices: Sequence[str] | None = None,
        gpu: bool = False,
        mmap: bool = False,
    ) -> DenseIndex:
        """Open a dense index. ``ef_search`` / ``nprobe`` / ``candidates`` override the built
        settings; ``devices`` the encoder's devices; ``gpu`` moves the FAISS index to all GPUs
        (needs a GPU build of FAISS); ``mmap`` maps the index file instead of reading it
        (server workers then share one copy through the page cache). A re-ranking index's
        embeddings are always memory-mapped, shared the same way."""
        folder = Path(folder)
        manifest = read_manifest(folder)
        if manifest["kind"] != cls.kind:
            raise IndexFolderError(f"{folder} holds a {manifest['kind']} index, not dense")
        faiss = require("faiss")
        before = rss_anon_bytes()
        store = open_store(folder, manifest, corpus)
        flags = faiss.IO_FLAG_MMAP if mmap else 0
        index = faiss.read_index(str(folder / FAISS_FILE), flags)
        if index.ntotal != len(store):
            raise IndexFolderError(
                f"index {folder} is damaged: {index.ntotal} vectors for {len(store)} passages"
            )
        record = manifest["dense"]
        refine = None
        if record["faiss"].get("rerank"):
            refine = open_rerank_file(folder / RERANK_FILE)
            if refine.ntotal != len(store):
                raise IndexFolderError(f"{folder / RERANK_FILE} is damaged: wrong row count")
        after = rss_anon_bytes()
        if gpu:
            if not hasattr(faiss, "index_cpu_to_all_gpus"):
                raise MemSearcherError("gpu=True needs a GPU build of FAISS (faiss-gpu)")
            index = faiss.index_cpu_to_all_gpus(index)  # the codes; re-ranking stays on the CPU
        config = record["encoder"]
        encoder_config = EncoderConfig(
            **{k: v for k, v in config.items() if k in EncoderConfig.__dataclass_fields__}
        )
        encoder_config = replace(encoder_config, devices=tuple(devices or ()))
        encoder = Encoder(encoder_config)
        encoder.query_prefix = config["query_prefix"]  # exactly what the passages were built with
        encoder.passage_prefix = config["passage_prefix"]
        params = {
            "ef_search": record["faiss"]["ef_search"] if ef_search is None else ef_search,
            "nprobe": record["faiss"]["nprobe"] if nprobe is None else nprobe,
        }
        if refine is not None:
            built = record["faiss"]["candidates"]
            params["candidates"] = built if candidates is None else candidates
        _apply_search_params(index, params)  # to the codes, before IndexRefine wraps them
        if refine is not None:
            index = faiss.IndexRefine(index, refine)
        grown = None if before is None or after is None else after - before
        return cls(folder, manifest, index, encoder, store, params, refine, grown)

    def __len__(self) -> int:
        return len(self.store)

    def search_vectors(
        self, vectors: np.ndarray, top_n: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Rows and inner-product scores of the ``top_n`` nearest passages to each vector."""
        k = min(top_n, len(self))
        if k == 0 or len(vectors) == 0:
            return [(np.zeros(0, np.int64), np.zeros(0, np.float32)) for _ in vectors]
        if self.refine is not None:  # IndexRefine: the codes' top k x k_factor, re-ranked
            # + 0.5: FAISS takes int(k * k_factor) in float32
            self.index.k_factor = (max(k, int(self.search_params["candidates"])) + 0.5) / k
        scores, rows = self.index.search(vectors, k)
        return [(r[r >= 0], s[r >= 0]) for r, s in zip(rows, scores, strict=True)]

    def memory(self) -> dict[str, Any]:
        """The manifest's resident and disk figures, and what this process measures now: the
        anonymous memory loading the index took, and the re-rank file's pages mapped here
        (page cache, shared by every process that maps the file; reported apart)."""
        record = dict(self.manifest["dense"].get("memory") or {})
        record["load_rss_anon_bytes"] = self.load_rss_anon_bytes
        record["pid"] = os.getpid()
        if self.refine is not None:
            mapped = mapped_bytes(self.folder / RERANK_FILE)
            record["rerank_file_mapped_rss_bytes"] = mapped.get("rss")
            record["rerank_file_private_bytes"] = mapped.get("anonymous")
        return record

    def search_rows(
        self, queries: Sequence[str], top_n: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        check_search_args(queries, top_n)
        if not queries:
            return []
        return self.search_vectors(self.encoder.queries(queries), top_n)

    def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        return [self.store.hits(r, s) for r, s in self.search_rows(queries, top_n)]


def embeddings_of(folder: str | Path) -> np.ndarray:
    """The kept float16 embeddings of a dense index folder (memory-mapped)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    record = manifest.get("dense", {})
    if not record.get("kept_embeddings"):
        raise IndexFolderError(f"{folder} did not keep its embeddings")
    return _open_embeddings(folder, manifest["passages"], record["dim"])


__all__ = [
    "EMBEDDED_ENCODER",
    "DenseIndex",
    "Encoder",
    "EncoderConfig",
    "resolve_prefixes",
    "FaissConfig",
    "build_dense",
    "embedded_encoder_path",
    "embeddings_of",
]
