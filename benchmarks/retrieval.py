"""Retrieval benchmark: our BM25 against rank_bm25 and raw bm25s; FAISS ANN against flat.

    python benchmarks/retrieval.py                       # the full run (tens of minutes)
    python benchmarks/retrieval.py --bm25-passages 20000 --compare-passages 5000 \
        --dense-vectors 20000 --encode-passages 500      # a smoke run

BM25 runs on generated passages: 100 words each (the wiki-18 passage length) drawn from the
unigram distribution of the embedded Wikipedia summaries, titled with two drawn words. Queries
are 3-6 words taken from random passages, so each has a known source passage.

Dense runs on real text: the embedded summaries are encoded with the packaged all-MiniLM-L6-v2
(that build is timed as a real ``build_dense``). Encoding a million passages on a small CPU takes
hours, so the collection is grown to ``--dense-vectors`` with generated vectors: normalized
mixtures of two real passage vectors plus noise. Queries are real encoded questions (titles
turned into "what is ..." questions). FAISS's speed and recall depend on the vectors, not on
where they came from, but the generated ones are an approximation of a real corpus and the
report says so.

The two-stage rows (IVF-PQ candidates re-ranked from float16 vectors on disk) run on real
sentence windows: see benchmarks/retrieval_rerank.py, which also runs alone.

The answer cache's row (time with it over time without, on a GRPO-like stream of search
batches, on the ``--compare-passages`` corpus) is benchmarks/retrieval_cache.py, which also runs
alone; ``--cache-only`` runs just that row here.
"""

from __future__ import annotations

import os

# FAISS's OpenMP threads spin while waiting; on a small shared machine that made k-means several
# times slower than one thread. Must be set before any OpenMP runtime loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import retrieval_cache  # benchmarks/retrieval_cache.py: the answer cache's row
import retrieval_rerank  # benchmarks/retrieval_rerank.py: the two-stage rows
from retrieval_rerank import best_time, log

from memsearcher.retrieval.bm25 import BM25Config, Tokenizer, build_bm25
from memsearcher.retrieval.corpus import Passage, write_corpus
from memsearcher.retrieval.embedded import embedded_passages

WORDS_PER_PASSAGE = 100


# ---------------------------------------------------------------------------- corpus generation


def word_distribution() -> tuple[np.ndarray, np.ndarray]:
    counts: Counter[str] = Counter()
    for passage in embedded_passages():
        counts.update(w for w in passage.text.lower().split() if w.isalpha())
    words, freqs = zip(*counts.most_common(), strict=True)
    p = np.asarray(freqs, dtype=np.float64)
    return np.asarray(words, dtype=object), p / p.sum()


def generate_corpus(path: Path, n: int, seed: int) -> None:
    if path.is_file():
        return
    words, p = word_distribution()
    rng = np.random.default_rng(seed)

    def passages() -> Any:
        for start in range(0, n, 10_000):
            size = min(10_000, n - start)
            body = rng.choice(len(words), size=(size, WORDS_PER_PASSAGE), p=p)
            heads = rng.choice(len(words), size=(size, 2), p=p)
            for i in range(size):
                title = " ".join(words[heads[i]]).title()
                yield Passage(str(start + i), title, " ".join(words[body[i]]))

    write_corpus(path, passages())


def generate_queries(path: Path, n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed + 1)
    lines = path.read_bytes().splitlines()
    queries = []
    for row in rng.choice(len(lines), n, replace=False):
        words = json.loads(lines[row])["contents"].split("\n", 1)[1].split()
        start = rng.integers(0, len(words) - 6)
        queries.append(" ".join(words[start : start + rng.integers(3, 7)]))
    return queries


def head_corpus(source: Path, target: Path, n: int) -> None:
    if target.is_file():
        return
    with source.open("rb") as f, target.open("wb") as out:
        for i, line in enumerate(f):
            if i == n:
                break
            out.write(line)


# ---------------------------------------------------------------------------------------- BM25


def raw_bm25s(corpus: Path) -> tuple[Any, float, Callable[[list[str]], Any]]:
    """bm25s used as its README says: tokenize with stopwords and a stemmer, index, retrieve."""
    import bm25s
    import Stemmer

    stemmer = Stemmer.Stemmer("english")
    texts = []
    with corpus.open(encoding="utf-8") as f:
        for line in f:
            title, text = json.loads(line)["contents"].split("\n", 1)
            texts.append(f"{title.strip(chr(34))} {text}")
    started = time.perf_counter()
    model = bm25s.BM25()
    model.index(bm25s.tokenize(texts, "en", stemmer=stemmer, show_progress=False),
                show_progress=False)  # fmt: skip
    seconds = time.perf_counter() - started
    del texts

    def search(queries: list[str]) -> Any:
        tokens = bm25s.tokenize(queries, "en", stemmer=stemmer, show_progress=False)
        return model.retrieve(tokens, k=5, show_progress=False)

    return model, seconds, search


def rank_bm25_model(corpus: Path, tokenize: Tokenizer) -> tuple[Any, float, list[str]]:
    from rank_bm25 import BM25Okapi

    docs, ids = [], []
    with corpus.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            title, text = row["contents"].split("\n", 1)
            docs.append(tokenize(f"{title.strip(chr(34))} {text}") or [""])
            ids.append(row["id"])
    started = time.perf_counter()
    model = BM25Okapi(docs, k1=1.5, b=0.75)
    return model, time.perf_counter() - started, ids


def bm25_section(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    big = work / f"synthetic-{args.bm25_passages}.jsonl"
    small = work / f"synthetic-{args.compare_passages}.jsonl"
    log(f"generating {args.bm25_passages} passages")
    generate_corpus(big, args.bm25_passages, args.seed)
    head_corpus(big, small, args.compare_passages)
    # separate functions, so each size's models are freed before the next is built
    return {"compare": bm25_compare(args, work, small), "scale": bm25_scale(args, work, big)}


def bm25_compare(args: argparse.Namespace, work: Path, small: Path) -> dict[str, Any]:
    """Ours, raw bm25s and rank_bm25 on the same passages and queries."""
    tokenize = Tokenizer("en", "english")
    queries = generate_queries(small, args.queries, args.seed)
    log(f"BM25 at {args.compare_passages}: building ours")
    started = time.perf_counter()
    ours = build_bm25(small, work / "bm25-small", overwrite=True)
    ours_build = time.perf_counter() - started
    robertson = build_bm25(
        small, work / "bm25-small-robertson", BM25Config(method="robertson"), overwrite=True
    )
    t_ours, hits = best_time(lambda: ours.search(queries, 5))
    _, raw_build, raw_search = raw_bm25s(small)
    t_raw, _ = best_time(lambda: raw_search(queries))
    log("BM25: rank_bm25")
    rb, rb_build, rb_ids = rank_bm25_model(small, tokenize)
    rb_queries = queries[: args.rank_bm25_queries]

    row_of = {pid: row for row, pid in enumerate(rb_ids)}

    def rank_bm25_search() -> list[np.ndarray]:
        out = []
        for q in rb_queries:
            out.append(rb.get_scores(tokenize(q)))  # all scores: ties are judged below
        return out

    def agreement(ours: list[list[Any]], theirs: list[np.ndarray]) -> float:
        """Share of queries whose top-5 is also a top-5 under rank_bm25's scores: the same
        passages, or passages tied with them (equal length, equal counts tie often)."""
        same = []
        for hits, scores in zip(ours, theirs, strict=True):
            best = np.sort(scores[scores > 0])[::-1][:5]
            mine = np.sort(scores[[row_of[h.id] for h in hits]])[::-1]
            same.append(len(mine) == len(best) and np.allclose(mine, best, rtol=1e-5))
        return float(np.mean(same))

    t_rb, rb_scores = best_time(rank_bm25_search, repeat=1)
    qps_rb = len(rb_queries) / t_rb
    same = agreement(hits[: len(rb_queries)], rb_scores)
    # rank_bm25's Okapi idf, log((N - df + .5) / (df + .5)), goes negative for terms in over half
    # the passages and is then replaced by epsilon * mean idf; Robertson's idf (bm25s) clamps it
    # at 0 instead. Setting those replaced entries to 0 is rank_bm25 with epsilon=0.
    floor = rb.epsilon * rb.average_idf
    rb.idf = {w: (0.0 if v == floor else v) for w, v in rb.idf.items()}
    _, rb_scores = best_time(rank_bm25_search, repeat=1)
    same_rob = agreement(robertson.search(rb_queries, 5), rb_scores)
    return {
        "passages": args.compare_passages,
        "queries": len(queries),
        "rank_bm25_queries": len(rb_queries),
        "qps": {
            "ours": len(queries) / t_ours,
            "bm25s_raw": len(queries) / t_raw,
            "rank_bm25": qps_rb,
        },
        "speedup_vs_rank_bm25": len(queries) / t_ours / qps_rb,
        "ours_vs_raw_bm25s": (len(queries) / t_ours) / (len(queries) / t_raw),
        "same_top5_vs_rank_bm25": same,  # ours lucene, rank_bm25 defaults
        "same_top5_vs_rank_bm25_robertson_idf": same_rob,
        "build_seconds": {"ours": ours_build, "bm25s_raw": raw_build, "rank_bm25": rb_build},
    }


def bm25_scale(args: argparse.Namespace, work: Path, big: Path) -> dict[str, Any]:
    """Ours against raw bm25s at the large size."""
    queries = generate_queries(big, args.scale_queries, args.seed)
    log(f"BM25 at {args.bm25_passages}: building ours")
    started = time.perf_counter()
    ours = build_bm25(big, work / "bm25-big", overwrite=True, progress=args.progress)
    ours_build = time.perf_counter() - started
    t_ours, hits = best_time(lambda: ours.search(queries, 5))
    log(f"BM25 at {args.bm25_passages}: raw bm25s")
    model, raw_build, raw_search = raw_bm25s(big)
    t_raw, _ = best_time(lambda: raw_search(queries), repeat=1)  # slow: one run is enough
    index_bytes = sum(p.stat().st_size for p in (work / "bm25-big" / "bm25s").iterdir())
    return {
        "passages": args.bm25_passages,
        "queries": len(queries),
        "qps": {"ours": len(queries) / t_ours, "bm25s_raw": len(queries) / t_raw},
        "ours_vs_raw_bm25s": (len(queries) / t_ours) / (len(queries) / t_raw),
        "build_seconds": {"ours": ours_build, "bm25s_raw": raw_build},
        "index_bytes_per_passage": (index_bytes + 8 * args.bm25_passages) / args.bm25_passages,
    }


# --------------------------------------------------------------------------------------- dense


def dense_section(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import faiss

    from memsearcher.retrieval.dense import (
        Encoder,
        EncoderConfig,
        FaissConfig,
        build_dense,
        build_faiss,
        embeddings_of,
    )

    passages = embedded_passages()[: args.encode_passages]
    corpus = work / f"summaries-{len(passages)}.jsonl"
    write_corpus(corpus, passages)
    log(f"dense: encoding {len(passages)} real passages (flat index, embedded MiniLM)")
    real = build_dense(
        corpus, work / "dense-real", keep_embeddings=True, overwrite=True, progress=args.progress
    )
    encode_rate = len(passages) / real.manifest["encode_seconds"]
    vectors = np.asarray(embeddings_of(real.folder), dtype=np.float32)
    rng = np.random.default_rng(args.seed)
    extra = args.dense_vectors - len(vectors)
    if extra > 0:
        log(f"dense: generating {extra} vectors from the real ones")
        parts = [vectors]
        for start in range(0, extra, 100_000):
            size = min(100_000, extra - start)
            a, b = rng.integers(0, len(vectors), (2, size))
            mix = rng.uniform(0.5, 1.0, (size, 1)).astype(np.float32)
            v = mix * vectors[a] + (1 - mix) * vectors[b]
            v += rng.standard_normal(v.shape, dtype=np.float32) * (0.25 / np.sqrt(v.shape[1]))
            parts.append(v / np.linalg.norm(v, axis=1, keepdims=True))
        vectors = np.concatenate(parts)
    n, dim = vectors.shape
    encoder = Encoder(EncoderConfig())
    titles = [p.title for p in rng.choice(np.array(passages, dtype=object), args.dense_queries)]
    questions = [f"what is {t}?" for t in titles]
    started = time.perf_counter()
    queries = encoder.queries(questions)
    query_encode_rate = len(questions) / (time.perf_counter() - started)

    def measure(config: FaissConfig, sweep: list[dict[str, int]]) -> list[dict[str, Any]]:
        started = time.perf_counter()
        index = build_faiss(vectors, config, progress=False)
        build = time.perf_counter() - started
        path = work / "bench.faiss"
        faiss.write_index(index, str(path))
        size = path.stat().st_size
        rows = []
        for params in sweep or [{}]:
            if "ef_search" in params:
                index.hnsw.efSearch = params["ef_search"]
            if "nprobe" in params:
                faiss.extract_index_ivf(index).nprobe = params["nprobe"]
            seconds, (_, found) = best_time(lambda: index.search(queries, 5))
            rows.append({
                "kind": config.kind, **params,
                **({"pq_m": config.pq_m, "opq": config.opq} if config.kind == "ivfpq" else {}),
                "qps": len(queries) / seconds, "found": found,
                "build_seconds": build, "bytes_per_passage": size / n + 8,
            })  # fmt: skip
        return rows

    log(f"dense: flat over {n} vectors")
    results = measure(FaissConfig(kind="flat"), [])
    truth = results[0]["found"]
    log("dense: hnsw")
    results += measure(
        FaissConfig(kind="hnsw", hnsw_m=32, ef_construction=128),
        [{"ef_search": e} for e in (32, 64, 128, 256)],
    )
    for pq_m, opq in ((48, False), (64, False), (64, True)):
        log(f"dense: ivfpq PQ{pq_m} opq={opq}")
        results += measure(
            FaissConfig(kind="ivfpq", pq_m=pq_m, opq=opq, train_size=args.train_size),
            [{"nprobe": p} for p in (8, 32, 64)],
        )
    flat_qps = results[0]["qps"]
    for row in results:
        found = row.pop("found")
        row["recall@5"] = float(
            np.mean([len(set(a) & set(b)) / 5 for a, b in zip(found, truth, strict=True)])
        )
        row["speedup_vs_flat"] = row["qps"] / flat_qps
    return {
        "vectors": n,
        "real_vectors": min(n, len(passages)),
        "dim": dim,
        "queries": len(queries),
        "encode_passages_per_second": encode_rate,
        "encode_queries_per_second": query_encode_rate,
        "settings": results,
    }


# ---------------------------------------------------------------------------------------- main


def print_report(report: dict[str, Any]) -> None:
    if "bm25" not in report:
        return
    c, s = report["bm25"]["compare"], report["bm25"]["scale"]
    print(f"\n== BM25, {c['passages']:,} generated passages, {c['queries']} queries, top-5 ==")
    print(f"{'':28}{'queries/s':>12}{'build s':>10}")
    for name, label in (("ours", "memsearcher BM25"), ("bm25s_raw", "bm25s (raw)"),
                        ("rank_bm25", "rank_bm25 (BM25Okapi)")):  # fmt: skip
        print(f"{label:28}{c['qps'][name]:>12,.0f}{c['build_seconds'][name]:>10.1f}")
    print(f"ours / rank_bm25 speed:     {c['speedup_vs_rank_bm25']:,.0f}x  (target >= 100x)")
    print(f"ours / raw bm25s speed:     {c['ours_vs_raw_bm25s']:.2f}  (target >= 0.90)")
    print(
        f"same top-5 as rank_bm25:    {c['same_top5_vs_rank_bm25']:.1%} (lucene idf), "
        f"{c['same_top5_vs_rank_bm25_robertson_idf']:.1%} (both Robertson idf: ours "
        "method=robertson, rank_bm25 epsilon=0)"
        f"  (target >= 95%, {c['rank_bm25_queries']} queries)"
    )
    print(f"\n== BM25, {s['passages']:,} generated passages, {s['queries']} queries ==")
    for name, label in (("ours", "memsearcher BM25"), ("bm25s_raw", "bm25s (raw)")):
        print(f"{label:28}{s['qps'][name]:>12,.0f}{s['build_seconds'][name]:>10.1f}")
    print(f"ours / raw bm25s speed:     {s['ours_vs_raw_bm25s']:.2f}  (target >= 0.90)")
    print(f"index bytes per passage:    {s['index_bytes_per_passage']:.0f}")
    d = report.get("dense")
    if d:
        print(
            f"\n== dense, {d['vectors']:,} vectors of dim {d['dim']} "
            f"({d['real_vectors']:,} encoded, the rest generated), {d['queries']} queries =="
        )
        print(
            f"encoder on this CPU: {d['encode_passages_per_second']:.0f} passages/s, "
            f"{d['encode_queries_per_second']:.0f} queries/s"
        )
        print(f"{'setting':24}{'recall@5':>9}{'queries/s':>11}{'x flat':>8}"
              f"{'build s':>9}{'bytes/passage':>15}")  # fmt: skip
        for row in d["settings"]:
            knob = (
                f"ef_search={row['ef_search']}" if "ef_search" in row
                else f"nprobe={row['nprobe']}" if "nprobe" in row else ""
            )  # fmt: skip
            pq = f" {'OPQ+' if row.get('opq') else ''}PQ{row['pq_m']}" if "pq_m" in row else ""
            name = f"{row['kind']}{pq} {knob}"
            print(
                f"{name:24}{row['recall@5']:>9.3f}{row['qps']:>11,.0f}"
                f"{row['speedup_vs_flat']:>8.1f}{row['build_seconds']:>9.1f}"
                f"{row['bytes_per_passage']:>15,.0f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bm25-passages", type=int, default=1_000_000)
    parser.add_argument("--compare-passages", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--rank-bm25-queries", type=int, default=200)
    parser.add_argument("--scale-queries", type=int, default=300)
    parser.add_argument("--encode-passages", type=int, default=10_000)
    parser.add_argument("--dense-vectors", type=int, default=500_000)
    parser.add_argument("--dense-queries", type=int, default=1000)
    parser.add_argument("--train-size", type=int, default=50_000)
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--skip-rerank", action="store_true", help="no two-stage section")
    parser.add_argument("--skip-cache", action="store_true", help="no answer-cache row")
    parser.add_argument("--cache-only", action="store_true", help="only the answer-cache row")
    retrieval_rerank.add_arguments(parser)
    retrieval_cache.add_arguments(parser)
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (kept)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="memsearcher-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if not args.cache_only:
        report["bm25"] = bm25_section(args, work)
        if not args.skip_dense:
            report["dense"] = dense_section(args, work)
        if not args.skip_rerank:
            report["rerank"] = retrieval_rerank.rerank_section(args, work)
    if not args.skip_cache:
        small = work / f"synthetic-{args.compare_passages}.jsonl"
        generate_corpus(small, args.compare_passages, args.seed)
        report["cache"] = retrieval_cache.cache_section(args, small, work)
    print_report(report)
    if "rerank" in report:
        retrieval_rerank.print_rows(report["rerank"])
    if "cache" in report:
        retrieval_cache.print_section(report["cache"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
