"""The answer cache on a GRPO-like stream of search batches: the time with it over the time without.

    python benchmarks/retrieval_cache.py                        # the embedded Wikipedia, BM25
    python benchmarks/retrieval_cache.py --cache-samples RUN    # replay a run's saved rounds

``benchmarks/retrieval.py`` runs this too, on its generated corpus (``--skip-cache``,
``--cache-only``).

The stream is what the lockstep driver sends (`memsearcher.agent.driver.run_lockstep`): per
step, ``--cache-rounds`` batches; in round 1 the G samples of each question send the same query
(a group starts from one question), in later rounds every sample its own. Queries are 3-6 word
windows of random passages, a fresh set every step. ``--cache-samples`` replays a training run's
saved rounds instead (`benchmarks/repeated_queries.py` reads the same files): their queries, as
they were batched. Each side runs the whole stream ``--cache-repeat`` times, the two in turn, the
cached one from an empty cache each time; the ratio is of the best CPU times (wall times are
printed beside them), and both sides must return the same hits.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from repeated_queries import rounds_of
from retrieval_rerank import log

from memsearcher.retrieval.bm25 import build_bm25
from memsearcher.retrieval.cache import DEFAULT_CACHE_SIZE, CachedRetriever
from memsearcher.retrieval.corpus import write_corpus
from memsearcher.retrieval.embedded import embedded_passages


def grpo_stream(corpus: Path, args: argparse.Namespace) -> list[list[str]]:
    """The batches of ``args.cache_steps`` steps: Q questions x G samples x R rounds."""
    rng = np.random.default_rng(args.seed + 2)
    lines = corpus.read_bytes().splitlines()
    q, g = args.cache_questions, args.cache_group
    need = args.cache_steps * q * (1 + g * (args.cache_rounds - 1))
    pool = []
    for row in rng.choice(len(lines), need, replace=need > len(lines)):
        words = json.loads(lines[row])["contents"].split("\n", 1)[1].split()
        start = rng.integers(0, max(1, len(words) - 6))
        pool.append(" ".join(words[start : start + rng.integers(3, 7)]))
    fresh = iter(pool)
    batches = []
    for _ in range(args.cache_steps):
        batches.append([query for query in (next(fresh) for _ in range(q)) for _ in range(g)])
        batches += [[next(fresh) for _ in range(q * g)] for _ in range(args.cache_rounds - 1)]
    return batches


def replayed_stream(run: Path) -> list[list[str]]:
    files = sorted((run / "samples").glob("step-*.jsonl"), key=lambda p: int(p.stem[5:]))
    return [queries for path in files for queries in rounds_of(path)]


def cache_section(args: argparse.Namespace, corpus: Path, work: Path) -> dict[str, Any]:
    log(f"cache: BM25 over {corpus.name}")
    index = build_bm25(corpus, work / "cache-index", overwrite=True)
    replay = args.cache_samples is not None
    batches = replayed_stream(args.cache_samples) if replay else grpo_stream(corpus, args)
    top_n = args.cache_top_n
    queries = sum(len(b) for b in batches)
    distinct_per_batch = sum(len(set(b)) for b in batches)
    log(f"cache: {len(batches)} batches, {queries} queries")

    def plain() -> list[Any]:
        return [index.search(batch, top_n) for batch in batches]

    def cached() -> tuple[list[Any], dict[str, Any]]:
        retriever = CachedRetriever(index, args.cache_size)
        return [retriever.search(batch, top_n) for batch in batches], retriever.stats()

    expected = plain()  # also warms the index's pages for both sides
    # the sides alternate, and CPU time is what counts: on a shared machine another job's burst
    # lands on whichever side runs during it, and moved single best-of-N wall times by 2x here
    best = {"without": [float("inf")] * 2, "with": [float("inf")] * 2}
    for _ in range(args.cache_repeat):
        for side, run in (("without", plain), ("with", cached)):
            wall, cpu = time.perf_counter(), time.process_time()
            result = run()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            best[side] = [min(best[side][0], cpu), min(best[side][1], wall)]
            if side == "with":
                answers, stats = result
                if answers != expected:
                    raise SystemExit("the cache changed an answer")
    return {
        "stream": f"replayed {args.cache_samples}" if replay else "generated GRPO-like",
        "passages": len(index),
        "batches": len(batches),
        "queries": queries,
        "repeated_within_batch": 1 - distinct_per_batch / queries,
        "backend_share": stats["misses"] / queries,
        "top_n": top_n,
        "capacity": args.cache_size,
        "cpu_seconds_without": best["without"][0],
        "cpu_seconds_with": best["with"][0],
        "ratio": best["with"][0] / best["without"][0],
        "wall_seconds_without": best["without"][1],
        "wall_seconds_with": best["with"][1],
        "wall_ratio": best["with"][1] / best["without"][1],
    }


def print_section(c: dict[str, Any]) -> None:
    print(f"\n== answer cache, BM25 over {c['passages']:,} passages, {c['stream']} stream ==")
    print(f"{c['batches']} batches, {c['queries']} queries, top_n {c['top_n']}; "
          f"repeated within a batch {c['repeated_within_batch']:.1%}, searched by the index "
          f"with the cache {c['backend_share']:.1%} (capacity {c['capacity']})")  # fmt: skip
    print(f"CPU time without the cache {c['cpu_seconds_without']:.3f} s, with "
          f"{c['cpu_seconds_with']:.3f} s: time ratio with/without {c['ratio']:.2f} "
          f"(wall: {c['wall_seconds_without']:.3f} s, {c['wall_seconds_with']:.3f} s, "
          f"{c['wall_ratio']:.2f})")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("answer cache")
    group.add_argument("--cache-samples", type=Path, default=None,
                       help="replay this training run's samples/ rounds")  # fmt: skip
    group.add_argument("--cache-steps", type=int, default=8)
    group.add_argument("--cache-questions", type=int, default=32, help="questions per step")
    group.add_argument("--cache-group", type=int, default=5, help="samples per question (G)")
    group.add_argument("--cache-rounds", type=int, default=3, help="search rounds per step")
    group.add_argument("--cache-top-n", type=int, default=5)
    group.add_argument("--cache-size", type=int, default=DEFAULT_CACHE_SIZE)
    group.add_argument("--cache-repeat", type=int, default=5, help="best of this many runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="memsearcher-cache-"))
    corpus = work / "embedded.jsonl"
    write_corpus(corpus, embedded_passages())
    started = time.perf_counter()
    section = cache_section(args, corpus, work)
    log(f"cache: {time.perf_counter() - started:.0f} s")
    print_section(section)
    if args.json:
        args.json.write_text(json.dumps(section, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
