"""Two-stage dense retrieval benchmark: IVF-PQ codes in RAM, exact re-ranking from float16 on disk.

    python benchmarks/retrieval_rerank.py --rerank-cache ~/.cache/ms-windows
    python benchmarks/retrieval_rerank.py --windows 4096 --rerank-generated 8000 \
        --rerank-queries 100 --nprobe 4,8 --candidates 20,50    # a smoke run

``benchmarks/retrieval.py`` runs this too, after its own sections (``--skip-rerank``).

Real vectors: the ~10k embedded Wikipedia summaries split into sentence windows (every run of 1,
2 and 3 consecutive sentences, titled), encoded with the packaged all-MiniLM-L6-v2. Encoding is
slow on a small CPU, so the vectors are cached under ``--rerank-cache`` in chunks and a run resumes
where the last one stopped. Queries: the eval files' questions (``configs/data``), "what is
<title>?" questions, and single sentences taken from the passages. Recall@k is the share of
flat's (exact) top k that a setting returns; queries/s are search alone on encoded queries,
re-ranking included.

Generated vectors (normalized mixtures of two real vectors plus noise) extend the collection
to ``--rerank-generated`` vectors, and the same settings run on a generated collection of the
real one's size, to show how far generated vectors are from real ones.

Each re-ranked setting is measured two ways over the same candidates: FAISS's own refine stage
(``IndexRefine`` over a float16 ``IndexScalarQuantizer`` memory-mapped from the re-rank file,
``k_factor`` = candidates / 10: what ``--rerank`` serves), and a numpy gather-and-dot over an
``np.memmap`` of the float16 file; on the sentence queries also FAISS's refine with the float16
codes in RAM.
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
from memsearcher.retrieval.rerank import (
    open_embeddings,
    open_rerank_file,
    rerank_rows,
    write_rerank_file,
)

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = re.compile(r"(?<=[.!?])\s+")
CHUNK = 2048


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def best_time(fn: Callable[[], Any], repeat: int = 3) -> tuple[float, Any]:
    """Fastest of ``repeat`` runs (the usual way to time on a shared machine) and the result."""
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
    return float(
        np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(found, truth, strict=True)])
    )


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
    faiss_in_ram: bool,
) -> list[dict[str, Any]]:
    """Flat, then IVF-PQ alone and re-ranked at several nprobe and candidate counts, each
    re-rank two ways: FAISS's IndexRefine over the memory-mapped re-rank file (what
    ``--rerank`` serves) and a numpy gather-and-dot over the same rows."""
    import faiss

    n, dim = vectors.shape
    emb_path = work / "bench.f16"
    rerank_path = work / "bench-rerank.faiss"
    np.ascontiguousarray(vectors, dtype=np.float16).tofile(emb_path)
    write_rerank_file(emb_path, rerank_path, n, dim)
    emb = open_embeddings(emb_path, n, dim)
    flat = faiss.IndexFlatIP(dim)
    flat.add(np.asarray(vectors, dtype=np.float32))
    flat_seconds, (_, truth) = best_time(lambda: flat.search(queries, 10))
    flat_qps = len(queries) / flat_seconds
    rows: list[dict[str, Any]] = [{
        "set": label, "setting": "flat", "recall@5": 1.0, "recall@10": 1.0, "qps": flat_qps,
        "resident_bpp": 4 * dim + 8, "disk_bpp": 4 * dim + 8,
    }]  # fmt: skip
    flat.reset()  # free its float32 copy
    for pq_m, opq in args.pq:
        log(f"{label}: IVF-PQ{pq_m} opq={opq} over {n}")
        index, build = build_ivfpq(vectors, pq_m, opq, args.rerank_train_size)
        size = index_bytes(index, work)
        resident = size / n + 8  # codes, ids, quantizers; + 8-byte corpus offsets
        ivf = faiss.extract_index_ivf(index)
        name = f"{'OPQ+' if opq else ''}PQ{pq_m}"
        stages = {"FAISS refine, mmap": faiss.IndexRefine(index, open_rerank_file(rerank_path))}
        if faiss_in_ram:
            in_ram = faiss.IndexScalarQuantizer(
                dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT
            )
            in_ram.add(np.asarray(vectors, dtype=np.float32))
            stages["FAISS refine, in RAM"] = faiss.IndexRefine(index, in_ram)
        for nprobe in args.nprobe:
            ivf.nprobe = nprobe
            for candidates in [0, *args.candidates]:
                ways: dict[str, Callable[[], np.ndarray]] = {}
                if not candidates:

                    def codes_only(index: Any = index) -> np.ndarray:
                        return np.asarray(index.search(queries, 10)[1])

                    ways["codes only"] = codes_only
                else:
                    for how, refined in stages.items():

                        def faiss_way(refined: Any = refined, c: int = candidates) -> np.ndarray:
                            refined.k_factor = max(c, 10) / 10
                            return refined.search(queries, 10)[1]

                        ways[how] = faiss_way

                    def numpy_way(c: int = candidates, index: Any = index) -> np.ndarray:
                        found = index.search(queries, max(c, 10))[1]
                        return rerank_rows(emb, queries, found, 10)

                    ways["numpy memmap"] = numpy_way
                for how, way in ways.items():
                    seconds, found = best_time(way)
                    in_memory = how.endswith("in RAM")
                    rows.append({
                        "set": label, "setting": f"{name} nprobe={nprobe}", "rerank": how,
                        "candidates": candidates or None,
                        "recall@5": recall(found, truth, 5),
                        "recall@10": recall(found, truth, 10),
                        "qps": len(queries) / seconds, "build_seconds": build,
                        "resident_bpp": resident + (2 * dim if in_memory else 0),
                        "disk_bpp": resident + (2 * dim if candidates else 0),
                    })  # fmt: skip
    for row in rows:
        row["x_flat"] = row["qps"] / flat_qps
    emb_path.unlink()
    rerank_path.unlink()
    return rows


def cold_row(
    label: str, vectors: np.ndarray, queries: np.ndarray, pq_m: int, nprobe: int,
    candidates: int, args: argparse.Namespace, work: Path,
) -> dict[str, Any]:  # fmt: skip
    """One run of the served path (FAISS refine, mmap) with the re-rank file dropped from the
    page cache first (``posix_fadvise(DONTNEED)`` on that file only): the first queries after
    a restart, as far as this machine's storage shows it."""
    import faiss

    n, dim = vectors.shape
    emb_path, path = work / "cold.f16", work / "cold.faiss"
    np.ascontiguousarray(vectors, dtype=np.float16).tofile(emb_path)
    write_rerank_file(emb_path, path, n, dim)
    emb_path.unlink()
    index, _ = build_ivfpq(vectors, pq_m, False, args.rerank_train_size)
    faiss.extract_index_ivf(index).nprobe = nprobe
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    refined = faiss.IndexRefine(index, open_rerank_file(path))
    refined.k_factor = candidates / 10
    started = time.perf_counter()
    refined.search(queries, 10)
    seconds = time.perf_counter() - started
    path.unlink()
    return {"set": label, "setting": f"PQ{pq_m} nprobe={nprobe}", "rerank": "cold page cache",
            "candidates": candidates, "qps": len(queries) / seconds}  # fmt: skip


def rerank_section(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from memsearcher.retrieval.dense import Encoder, EncoderConfig

    windows, real, rate = encoded_windows(args.rerank_cache, args.windows)
    n = len(real)
    log(f"{n} real vectors ({rate:.0f} passages/s encoded this run)")
    encoder = Encoder(EncoderConfig())
    sets = query_sets(windows, args.rerank_queries, args.seed)
    encoded = {name: encoder.queries(texts) for name, texts in sets.items()}
    rows: list[dict[str, Any]] = []
    for name, queries in encoded.items():
        rows += two_stage_rows(f"real/{name}", real, queries, args, work, name == "sentences")
    # generated vectors: as many as the real ones (to compare), and more (to extrapolate)
    questions = encoded["questions"]
    same = generated_vectors(real, n, args.seed)
    rows += two_stage_rows("generated/questions", same, questions, args, work, False)
    if args.rerank_generated > n:
        big = np.concatenate(
            [real, generated_vectors(real, args.rerank_generated - n, args.seed + 1)]
        )
        small_args = argparse.Namespace(**{**vars(args), "candidates": [50, 100]})
        rows += two_stage_rows(f"real+generated {len(big)}/questions", big, questions,
                               small_args, work, False)  # fmt: skip
    pq_m, nprobe, candidates = args.cold_setting
    rows.append(cold_row("real/sentences", real, encoded["sentences"], pq_m, nprobe,
                         candidates, args, work))  # fmt: skip
    return {
        "real_vectors": n,
        "dim": int(real.shape[1]),
        "encode_passages_per_second": rate,
        "queries": {name: len(q) for name, q in encoded.items()},
        "rows": rows,
    }


def print_rows(section: dict[str, Any]) -> None:
    print(f"\n== two-stage dense: {section['real_vectors']:,} real MiniLM vectors "
          f"(dim {section['dim']}), queries {section['queries']} ==")  # fmt: skip
    head = ("set", "setting", "re-rank", "cands", "R@5", "R@10", "q/s", "x flat", "res B/p",
            "disk B/p")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(" --- " for _ in head) + "|")
    for r in section["rows"]:

        def num(key: str, fmt: str, r: dict[str, Any] = r) -> str:
            return format(r[key], fmt) if r.get(key) is not None else ""

        print("| " + " | ".join([
            r["set"], r["setting"], r.get("rerank", ""), str(r.get("candidates") or ""),
            num("recall@5", ".3f"),
            num("recall@10", ".3f"), num("qps", ",.0f"), num("x_flat", ".1f"),
            num("resident_bpp", ".0f"), num("disk_bpp", ".0f"),
        ]) + " |")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cache = Path(tempfile.gettempdir()) / "ms-windows"
    parser.add_argument("--rerank-cache", type=Path, default=cache,
                        help="encoded sentence windows are cached here")  # fmt: skip
    parser.add_argument("--windows", type=int, default=1_000_000, help="at most this many")
    parser.add_argument("--rerank-queries", type=int, default=1000)
    parser.add_argument("--rerank-generated", type=int, default=300_000)
    parser.add_argument("--pq", type=lambda s: [(int(x.strip("o")), x.endswith("o"))
                        for x in s.split(",")], default=[(48, False), (64, False)],
                        help="PQ bytes, comma separated; an o suffix adds OPQ")  # fmt: skip
    parser.add_argument("--nprobe", type=lambda s: [int(x) for x in s.split(",")],
                        default=[4, 8, 16, 32])  # fmt: skip
    parser.add_argument("--candidates", type=lambda s: [int(x) for x in s.split(",")],
                        default=[20, 50, 100, 200])  # fmt: skip
    parser.add_argument(
        "--cold-setting",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[48, 8, 50],
        help="pq_m,nprobe,candidates of the cold run",
    )
    parser.add_argument("--rerank-train-size", type=int, default=50_000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="memsearcher-rerank-"))
    section = rerank_section(args, work)
    print_rows(section)
    if args.json:
        args.json.write_text(json.dumps(section, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
