"""Two-stage dense retrieval benchmark: IVF-PQ codes in RAM, exact re-ranking from float16 on disk.

    python benchmarks/retrieval_rerank.py --cache /work/wt/issue16-out/windows
    python benchmarks/retrieval_rerank.py --windows 5000 --generated 20000   # a smoke run

Real vectors: the ~10k embedded Wikipedia summaries split into sentence windows (every run of 1,
2 and 3 consecutive sentences, titled), encoded with the packaged all-MiniLM-L6-v2. Encoding is
slow on a small CPU, so the vectors are cached under ``--cache`` in chunks and a run resumes
where the last one stopped. Queries: the eval files' questions (``configs/data``), "what is
<title>?" questions, and single sentences taken from the passages. Recall@k is the share of
flat's (exact) top k that a setting returns; queries/s are search alone on encoded queries,
re-ranking included.

Generated vectors (normalized mixtures of two real vectors plus noise) extend the collection to
``--generated`` vectors, and the same settings run on a generated collection of the real one's
size, to show how far generated vectors are from real ones.

The report also measures FAISS's own refine stage (``IndexRefine`` with a float16
``IndexScalarQuantizer``, ``k_factor``), against the numpy gather-and-dot over the memory map that
``memsearcher.retrieval.rerank`` uses.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/retrieval.py

import argparse
import json
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from memsearcher.retrieval.corpus import Passage
from memsearcher.retrieval.embedded import embedded_passages
from memsearcher.retrieval.rerank import open_embeddings, rerank_rows

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = re.compile(r"(?<=[.!?])\s+")
CHUNK = 2048


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def best_time(fn: Callable[[], Any], repeat: int = 3) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return best, result


# ------------------------------------------------------------------------------- real vectors


def sentence_windows() -> list[Passage]:
    """Every run of 1, 2 and 3 consecutive sentences of every summary, titled; in a fixed
    order (all 1-sentence windows first), so a prefix of the list is a fair sample."""
    by_size: list[list[Passage]] = [[], [], []]
    for passage in embedded_passages():
        sentences = [s for s in SENTENCE.split(passage.text) if s]
        for size in (1, 2, 3):
            for start in range(len(sentences) - size + 1):
                text = " ".join(sentences[start : start + size])
                by_size[size - 1].append(Passage("", passage.title, text))
    windows = [w for group in by_size for w in group]
    return [Passage(str(i), w.title, w.text) for i, w in enumerate(windows)]


def encoded_windows(cache: Path, limit: int) -> tuple[list[Passage], np.ndarray, float]:
    """The first ``limit`` windows and their MiniLM vectors (float16), encoding only chunks not
    cached yet; also the measured encoding rate (passages/s, nan when all were cached)."""
    from memsearcher.retrieval.dense import Encoder, EncoderConfig, _passage_text

    windows = sentence_windows()[:limit]
    cache.mkdir(parents=True, exist_ok=True)
    encoder: Encoder | None = None
    parts, encoded, seconds = [], 0, 0.0
    for start in range(0, len(windows), CHUNK):
        batch = windows[start : start + CHUNK]
        path = cache / f"chunk-{start:07d}-{len(batch)}.npy"
        if not path.is_file():
            encoder = encoder or Encoder(EncoderConfig())
            started = time.perf_counter()
            vectors = encoder.passages([_passage_text(p.title, p.text) for p in batch])
            seconds += time.perf_counter() - started
            encoded += len(batch)
            np.save(path, vectors.astype(np.float16))
            log(f"encoded {start + len(batch)}/{len(windows)} ({encoded / seconds:.0f}/s)")
        parts.append(np.load(path))
    rate = encoded / seconds if encoded else float("nan")
    return windows, np.concatenate(parts), rate


def generated_vectors(real: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``n`` normalized mixtures of two real vectors plus noise (as benchmarks/retrieval.py)."""
    rng = np.random.default_rng(seed)
    parts = []
    for start in range(0, n, 100_000):
        size = min(100_000, n - start)
        a, b = rng.integers(0, len(real), (2, size))
        mix = rng.uniform(0.5, 1.0, (size, 1)).astype(np.float32)
        v = mix * real[a].astype(np.float32) + (1 - mix) * real[b].astype(np.float32)
        v += rng.standard_normal(v.shape, dtype=np.float32) * (0.25 / np.sqrt(v.shape[1]))
        parts.append((v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float16))
    return np.concatenate(parts)


def query_sets(windows: list[Passage], n: int, seed: int) -> dict[str, list[str]]:
    rng = np.random.default_rng(seed)
    questions = []
    for path in sorted((ROOT / "configs" / "data").glob("*.jsonl")):
        questions += [json.loads(line)["question"] for line in path.read_text().splitlines()]
    titles = sorted({w.title for w in windows})
    picked = rng.choice(len(titles), min(n, len(titles)), replace=False)
    questions += [f"what is {titles[i]}?" for i in picked]
    sentences = []
    for i in rng.choice(len(windows), n, replace=False):
        parts = [s for s in SENTENCE.split(windows[i].text) if s]
        sentences.append(parts[rng.integers(0, len(parts))])
    return {"questions": questions[:n], "sentences": sentences}


# ----------------------------------------------------------------------------------- settings


def recall(found: np.ndarray, truth: np.ndarray, k: int) -> float:
    return float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(found, truth)]))


def build_ivfpq(vectors: np.ndarray, pq_m: int, opq: bool, train_size: int) -> tuple[Any, float]:
    from memsearcher.retrieval.dense import FaissConfig, build_faiss

    config = FaissConfig(kind="ivfpq", pq_m=pq_m, opq=opq, train_size=train_size)
    started = time.perf_counter()
    index = build_faiss(vectors, config, progress=False)
    return index, time.perf_counter() - started


def index_bytes(index: Any, work: Path) -> int:
    import faiss

    path = work / "bench.faiss"
    faiss.write_index(index, str(path))
    return path.stat().st_size


def two_stage_rows(
    label: str,
    vectors: np.ndarray,
    queries: np.ndarray,
    args: argparse.Namespace,
    work: Path,
    faiss_refine: bool,
) -> list[dict[str, Any]]:
    """Flat, then IVF-PQ alone and re-ranked at several nprobe and candidate counts."""
    import faiss

    n, dim = vectors.shape
    emb_path = work / f"{label}.f16"
    np.ascontiguousarray(vectors, dtype=np.float16).tofile(emb_path)
    emb = open_embeddings(emb_path, n, dim)
    flat = faiss.IndexFlatIP(dim)
    flat.add(np.asarray(vectors, dtype=np.float32))
    flat_seconds, (_, truth) = best_time(lambda: flat.search(queries, 10))
    flat_qps = len(queries) / flat_seconds
    rows: list[dict[str, Any]] = [{
        "set": label, "setting": "flat", "recall@5": 1.0, "recall@10": 1.0, "qps": flat_qps,
        "resident_bpp": 4 * dim + 8, "disk_bpp": 4 * dim + 8,
    }]  # fmt: skip
    del flat
    for pq_m, opq in args.pq:
        log(f"{label}: IVF-PQ{pq_m} opq={opq} over {n}")
        index, build = build_ivfpq(vectors, pq_m, opq, args.train_size)
        size = index_bytes(index, work)
        resident = size / n + 8  # codes, ids, quantizers; + 8-byte corpus offsets
        ivf = faiss.extract_index_ivf(index)
        name = f"{'OPQ+' if opq else ''}PQ{pq_m}"
        for nprobe in args.nprobe:
            ivf.nprobe = nprobe
            for candidates in [0, *args.candidates]:

                def search(c: int = candidates) -> np.ndarray:
                    _, found = index.search(queries, max(c, 10))
                    return rerank_rows(emb, queries, found, 10) if c else found

                seconds, found = best_time(search)
                rows.append({
                    "set": label, "setting": f"{name} nprobe={nprobe}",
                    "candidates": candidates or None,
                    "recall@5": recall(found, truth, 5), "recall@10": recall(found, truth, 10),
                    "qps": len(queries) / seconds, "build_seconds": build,
                    "resident_bpp": resident,
                    "disk_bpp": resident + (2 * dim if candidates else 0),
                })  # fmt: skip
        if faiss_refine:
            rows += faiss_refine_rows(label, index, vectors, queries, truth, args, work)
    for row in rows:
        row["x_flat"] = row["qps"] / flat_qps
    emb_path.unlink()
    return rows


def faiss_refine_rows(
    label: str,
    index: Any,
    vectors: np.ndarray,
    queries: np.ndarray,
    truth: np.ndarray,
    args: argparse.Namespace,
    work: Path,
) -> list[dict[str, Any]]:
    """FAISS's own refine stage over the same IVF-PQ: ``IndexRefine`` with float16 scalar
    codes (the same precision as our file), in RAM and, where this FAISS can, memory-mapped."""
    import faiss

    n, dim = vectors.shape
    refine = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
    refine.add(np.asarray(vectors, dtype=np.float32))
    both = faiss.IndexRefine(index, refine)
    path = work / "refine.faiss"
    faiss.write_index(both, str(path))
    loaded = {"in RAM": both}
    mmap_flag = getattr(faiss, "IO_FLAG_MMAP_IFC", None)
    if mmap_flag is not None:
        loaded["mmap"] = faiss.read_index(str(path), mmap_flag)
    rows = []
    ivf = faiss.extract_index_ivf(index)
    name = f"PQ{ivf.pq.M if hasattr(ivf, 'pq') else '?'}"
    for how, refined in loaded.items():
        for nprobe in args.nprobe:
            ivf_of = faiss.extract_index_ivf(refined)
            ivf_of.nprobe = nprobe
            for candidates in args.candidates:
                refined.k_factor = candidates / 10
                seconds, (_, found) = best_time(lambda r=refined: r.search(queries, 10))
                rows.append({
                    "set": label, "setting": f"FAISS IndexRefine {how} {name} nprobe={nprobe}",
                    "candidates": candidates,
                    "recall@5": recall(found, truth, 5), "recall@10": recall(found, truth, 10),
                    "qps": len(queries) / seconds,
                    "resident_bpp": path.stat().st_size / n + 8 - (2 * dim if how == "mmap" else 0),
                    "disk_bpp": path.stat().st_size / n + 8,
                })  # fmt: skip
    path.unlink()
    return rows
