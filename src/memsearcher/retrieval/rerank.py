"""Exact re-ranking of compressed-index candidates from float16 vectors on disk.

A two-stage dense index keeps only IVF-PQ codes in RAM (``pq_m`` bytes, an 8-byte id and the
8-byte corpus offset a passage) and re-ranks the ``candidates`` they return by exact inner
products against the float16 embeddings, read through a memory map. Only the candidates' rows
are touched (``candidates x dim x 2`` bytes a query); the mapping is shared and read-only, so
server workers share one copy in the page cache, which the kernel may evict under pressure; it
is never counted as the index's resident memory.

The second stage is FAISS's own: ``IndexRefine`` over the IVF-PQ and a float16
``IndexScalarQuantizer`` whose codes are the embeddings, memory-mapped with
``IO_FLAG_MMAP_IFC``. The re-rank file (``RERANK_FILE``) is that scalar-quantizer index: FAISS's
header, then the float16 rows exactly as the build's embeddings file holds them, written by
streaming (FAISS's own writer would need every vector in RAM). ``rerank`` below is the same
computation as a numpy gather-and-dot over a memory map: measured in
``benchmarks/retrieval_rerank.py``, it returned the same rows 1.3-2.3x slower (numpy's
float16 conversion is slow), so it is kept as the reference the tests check against.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from memsearcher.retrieval.manifest import IndexFolderError

RERANK_FILE = "rerank.faiss"


def write_rerank_file(embeddings: Path, out: Path, rows: int, dim: int) -> None:
    """Write ``out``, a FAISS float16 scalar-quantizer index of the ``rows x dim`` float16
    file ``embeddings``, by streaming: FAISS's header for an empty index with its vector count
    and code size patched, then the rows. Read back memory-mapped to check it."""
    import faiss

    empty = faiss.IndexScalarQuantizer(
        dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT
    )
    header = bytearray(faiss.serialize_index(empty).tobytes())
    # layout (faiss/impl/index_write.cpp): "IxSQ", d (int32), ntotal (int64), ..., and last the
    # codes vector: its byte count (uint64), then the bytes, here empty
    header[8:16] = np.int64(rows).tobytes()
    header[-8:] = np.uint64(rows * dim * 2).tobytes()
    with out.open("wb") as f, embeddings.open("rb") as source:
        f.write(header)
        while block := source.read(1 << 24):
            f.write(block)
    check = open_rerank_file(out)
    if check.ntotal != rows or check.d != dim:
        raise IndexFolderError(f"{out}: FAISS read back {check.ntotal} x {check.d}")
    if rows and not np.array_equal(
        check.reconstruct(rows - 1), np.asarray(embeddings_in(out, rows, dim)[-1], np.float32)
    ):
        raise IndexFolderError(f"{out}: FAISS reads other vectors than were written")


def open_rerank_file(path: Path) -> Any:
    """The re-rank index, its codes memory-mapped (shared, read-only), not read into RAM."""
    import faiss

    return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC)


def embeddings_in(path: Path, rows: int, dim: int) -> np.ndarray:
    """The float16 rows of a re-rank file, memory-mapped (they are its last bytes)."""
    size = rows * dim * 2
    if not path.is_file() or path.stat().st_size < size:
        raise IndexFolderError(f"{path}: expected {rows} x {dim} float16 embeddings")
    if rows == 0:
        return np.zeros((0, dim), np.float16)
    offset = path.stat().st_size - size
    return np.memmap(path, dtype=np.float16, mode="r", offset=offset, shape=(rows, dim))


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


def memory_record(
    index_bytes: int, payload_bytes: int, rows: int, rerank_file: int
) -> dict[str, Any]:
    """Resident and disk bytes of a two-stage index, in total and a passage.

    Resident: the FAISS index file (codes, ids, and the fixed coarse and product quantizers)
    plus the 8-byte corpus offsets. A passage: codes, id and offset; the quantizers are fixed
    and listed apart. Disk adds the re-rank file (``rerank_file`` bytes), read through the page
    cache.
    """
    per = max(rows, 1)
    offsets = 8 * rows
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
