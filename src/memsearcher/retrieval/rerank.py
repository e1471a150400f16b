"""Exact re-ranking of compressed-index candidates from float16 vectors on disk.

A two-stage dense index keeps only IVF-PQ codes in RAM (``pq_m`` bytes, an 8-byte id and the
8-byte corpus offset a passage) and re-ranks the ``candidates`` it returns by exact inner
products against the float16 embeddings file the build writes anyway, read through a memory
map. Only the candidates' rows are touched (``candidates x dim x 2`` bytes a query), and the
mapping is a shared read-only file mapping, so server workers share one copy in the page cache
and the kernel may evict it under pressure; it is never counted as the index's resident memory.

FAISS's own refine stage (``IndexRefine`` with a float16 ``IndexScalarQuantizer``) was measured
against this in ``benchmarks/retrieval_rerank.py``; see docs/retrieval.md for why this one is
used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from memsearcher.retrieval.manifest import IndexFolderError


def open_embeddings(path: Path, rows: int, dim: int) -> np.ndarray:
    """The ``rows x dim`` float16 embeddings file, memory-mapped read-only (shared)."""
    if rows == 0:
        return np.zeros((0, dim), np.float16)
    if not path.is_file() or path.stat().st_size != rows * dim * 2:
        raise IndexFolderError(f"{path}: expected {rows} x {dim} float16 embeddings")
    return np.memmap(path, dtype=np.float16, mode="r", shape=(rows, dim))


def rerank_rows(
    embeddings: np.ndarray, queries: np.ndarray, candidates: np.ndarray, k: int
) -> np.ndarray:
    """The ``k`` best of each query's candidate rows by exact inner product; -1 pads."""
    found, _ = rerank(embeddings, queries, candidates, k)
    return found


def rerank(
    embeddings: np.ndarray, queries: np.ndarray, candidates: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows and exact scores of the ``k`` best candidates per query, best first.

    ``queries`` (Q, dim) float32; ``candidates`` (Q, C) rows, -1 where the first stage found
    fewer. Returns (Q, min(k, C)) rows (-1 pads) and float32 scores (-inf pads).
    """
    q, c = candidates.shape
    k = min(k, c)
    valid = candidates >= 0  # (Q, C)
    # one sorted gather reads each needed page once, in file order
    wanted, back = np.unique(np.where(valid, candidates, 0), return_inverse=True)
    vectors = np.asarray(embeddings[wanted], dtype=np.float32)  # (U, dim)
    gathered = vectors[back.reshape(q, c)]  # (Q, C, dim)
    scores = np.einsum("qcd,qd->qc", gathered, queries, dtype=np.float32)
    scores[~valid] = -np.inf
    best = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # (Q, k)
    rows = np.take_along_axis(candidates, best, axis=1)
    top = np.take_along_axis(scores, best, axis=1)
    rows[~np.isfinite(top)] = -1
    return rows, top


def ivf_payload_bytes(index: Any) -> int:
    """Bytes of an IVF index's per-vector payload: the codes and the 8-byte ids."""
    import faiss

    ivf = faiss.extract_index_ivf(index)
    return int(ivf.ntotal) * (int(ivf.code_size) + 8)


def memory_record(index_bytes: int, payload_bytes: int, rows: int, dim: int) -> dict[str, Any]:
    """Resident and disk bytes of a two-stage index, in total and a passage.

    Resident: the FAISS index file (codes, ids, and the fixed coarse and product quantizers)
    plus the 8-byte corpus offsets. A passage: codes, id and offset; the quantizers are fixed
    and listed apart. Disk adds the float16 re-rank file, which is read through the page cache.
    """
    per = max(rows, 1)
    offsets = 8 * rows
    rerank_file = 2 * dim * rows
    return {
        "resident_bytes": index_bytes + offsets,
        "resident_bytes_per_passage": round((payload_bytes + offsets) / per, 1),
        "resident_fixed_bytes": index_bytes - payload_bytes,
        "rerank_file_bytes": rerank_file,
        "disk_bytes": index_bytes + offsets + rerank_file,
        "disk_bytes_per_passage": round((index_bytes + offsets + rerank_file) / per, 1),
    }


def mapped_bytes(path: Path) -> dict[str, int]:
    """This process's resident and anonymous (private copy) bytes of its mappings of ``path``,
    from /proc/self/smaps (Linux); an empty dict elsewhere. Resident pages of a shared file
    mapping are page cache, shared with every process that maps the file."""
    return smaps_of("self", path)


def smaps_of(pid: int | str, path: Path) -> dict[str, int]:
    """Rss and Anonymous bytes of process ``pid``'s mappings of ``path`` (Linux)."""
    smaps = Path(f"/proc/{pid}/smaps")
    if not smaps.is_file():
        return {}
    target = os.path.realpath(path)
    totals = {"rss": 0, "anonymous": 0, "mappings": 0}
    inside = False
    for line in smaps.read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == target
            totals["mappings"] += inside
        elif inside and fields[0] in ("Rss:", "Anonymous:"):
            totals[fields[0][:-1].lower()] += int(fields[1]) * 1024
    return totals


def rss_anon_bytes() -> int | None:
    """This process's anonymous resident memory (Linux), or None."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return None
    for line in status.read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return None
