"""The ``index`` and ``retriever`` commands. Heavy imports stay inside the handlers so that
``memsearcher --help`` stays fast."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.retrieval.bm25 import BM25Config
from memsearcher.retrieval.dense import FAISS_KINDS, EncoderConfig, FaissConfig
from memsearcher.retrieval.hybrid import FUSIONS, HybridConfig


def add_index_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "index", help="build and query retrieval indexes", description="Retrieval indexes."
    )
    actions = parser.add_subparsers(dest="index_command", required=True, metavar="ACTION")

    build = actions.add_parser(
        "build",
        help="build an index folder from a JSONL corpus",
        description="Build an index from a wiki-18 style JSONL corpus "
        '({"id", "contents"} or {"id", "title", "text"} per line).',
    )
    build.add_argument("--corpus", required=True, help="the JSONL corpus file")
    build.add_argument("--out", required=True, help="the index folder to create")
    build.add_argument("--kind", choices=("bm25", "dense", "hybrid"), default="bm25")
    build.add_argument(
        "--overwrite", action="store_true",
        help="replace an existing index folder (only one this command built; nothing else)",
    )  # fmt: skip
    build.add_argument("--skip-bad-rows", action="store_true", help="log and skip bad rows")
    build.add_argument("--no-progress", action="store_true", help="no progress bars")
    bm25, enc, fa = BM25Config(), EncoderConfig(), FaissConfig()
    group = build.add_argument_group("bm25")
    group.add_argument("--k1", type=float, default=bm25.k1)
    group.add_argument("--b", type=float, default=bm25.b)
    group.add_argument("--method", default=bm25.method, help="lucene, robertson or atire")
    group.add_argument("--stemmer", default=bm25.stemmer, help='a Snowball language or "none"')
    group.add_argument("--stopwords", default=bm25.stopwords, help='"en" or "none"')
    group = build.add_argument_group("dense encoder")
    group.add_argument(
        "--encoder",
        default=enc.name,
        help='"embedded" (all-MiniLM-L6-v2, shipped), a hub id such as intfloat/e5-base-v2, '
        "or a local folder",
    )
    group.add_argument("--query-prefix", default=None, help="default: from the encoder")
    group.add_argument("--passage-prefix", default=None, help="default: from the encoder")
    group.add_argument("--max-length", type=int, default=enc.max_length)
    group.add_argument("--batch-size", type=int, default=enc.batch_size)
    group.add_argument(
        "--device", action="append", default=[], help="torch device; repeat for several GPUs"
    )
    group.add_argument("--half", action="store_true", help="float16 encoder (GPU)")
    group = build.add_argument_group("dense FAISS index")
    group.add_argument("--faiss", choices=FAISS_KINDS, default=fa.kind)
    group.add_argument("--hnsw-m", type=int, default=fa.hnsw_m)
    group.add_argument("--ef-construction", type=int, default=fa.ef_construction)
    group.add_argument("--ef-search", type=int, default=fa.ef_search)
    group.add_argument("--nlist", type=int, default=fa.nlist, help="default: about sqrt(N)")
    group.add_argument(
        "--nprobe", type=int, default=fa.nprobe, help="default: 32, or 16 with --rerank"
    )
    group.add_argument("--pq-m", type=int, default=fa.pq_m, help="bytes per vector code")
    group.add_argument("--pq-bits", type=int, default=fa.pq_bits)
    group.add_argument("--opq", action="store_true", help="learn an OPQ rotation")
    group.add_argument(
        "--rerank", action="store_true",
        help="ivfpq: re-rank candidates exactly from the float16 embeddings, memory-mapped "
        "(keeps the embeddings file: 2 x dim bytes a passage on disk)",
    )  # fmt: skip
    group.add_argument(
        "--candidates", type=int, default=fa.candidates, help="--rerank: candidates per query"
    )
    group.add_argument("--train-size", type=int, default=fa.train_size)
    group.add_argument(
        "--keep-embeddings", action="store_true", help="keep the float16 embeddings for reuse"
    )
    group.add_argument(
        "--embeddings-from", default=None, help="reuse the kept embeddings of this dense index"
    )
    group = build.add_argument_group("hybrid")
    group.add_argument("--fusion", choices=sorted(FUSIONS), default=HybridConfig.fusion)
    group.add_argument("--dense-weight", type=float, default=HybridConfig.dense_weight)
    group.add_argument("--depth", type=int, default=HybridConfig.depth)
    build.set_defaults(func=_build)

    search = actions.add_parser("search", help="search an index folder, for a quick look")
    search.add_argument("index", help="an index folder")
    search.add_argument("query", nargs="+", help="one or more queries")
    search.add_argument("--top-n", type=int, default=5)
    search.add_argument("--json", action="store_true", help="print JSON lines")
    search.set_defaults(func=_search)

    info = actions.add_parser("info", help="print an index's manifest")
    info.add_argument("index", help="an index folder")
    info.set_defaults(func=_info)


def add_retriever_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "retriever", help="serve an index over HTTP", description="The retrieval server."
    )
    actions = parser.add_subparsers(dest="retriever_command", required=True, metavar="ACTION")
    serve = actions.add_parser(
        "serve",
        help="serve an index (MemSearcher /search, /batch_search; Search-R1 /retrieve)",
        description="Serve an index folder over HTTP; the OpenAPI schema at /openapi.json.",
    )
    serve.add_argument("--index", default=None, help="index folder (default: embedded BM25)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1, help="server processes")
    # defaults live in ServerConfig; importing it here would load fastapi for every command
    serve.add_argument("--max-top-n", type=int, help="largest top_n (default 100)")
    serve.add_argument("--max-queries", type=int, help="queries per request (default 512)")
    serve.add_argument("--max-body-bytes", type=int, help="request body limit (default 1 MiB)")
    serve.add_argument(
        "--max-pending-queries", type=int, help="queries waiting at once; more get 503 (2048)"
    )
    serve.add_argument("--max-response-bytes", type=int, help="largest answer (default 8 MiB)")
    serve.add_argument(
        "--cache-size", type=int,
        help="answers kept in an LRU, repeated queries searched once (4096; 0: no cache)",
    )  # fmt: skip
    serve.add_argument("--mmap", action="store_true", help="memory-map the index files")
    serve.add_argument("--ef-search", type=int, default=None, help="override (HNSW)")
    serve.add_argument("--nprobe", type=int, default=None, help="override (IVF)")
    serve.add_argument("--candidates", type=int, default=None, help="override (re-ranking IVF-PQ)")
    serve.add_argument("--device", action="append", default=[], help="encoder device(s)")
    serve.add_argument("--gpu", action="store_true", help="FAISS on all GPUs (faiss-gpu)")
    serve.add_argument("--access-log", action="store_true")
    add_http_arguments(serve)
    serve.set_defaults(func=_serve)


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """Options both servers share: read timeouts and the /docs page."""
    group = parser.add_argument_group("connections")
    # defaults live in memsearcher.serving.Timeouts (importing it here would load fastapi)
    group.add_argument("--header-timeout", type=float, help="seconds to send headers (10)")
    group.add_argument("--body-timeout", type=float, help="seconds to send a body (30)")
    group.add_argument(
        "--idle-timeout", type=float, help="seconds a kept-alive connection waits (5)"
    )
    group.add_argument(
        "--docs", action="store_true",
        help="serve /docs (the page loads its JavaScript from a CDN, so it needs the internet)",
    )  # fmt: skip


def timeouts_from(args: argparse.Namespace) -> Any:
    """The ``Timeouts`` the options of :func:`add_http_arguments` give."""
    from memsearcher.serving import Timeouts

    given = {k: getattr(args, f"{k}_timeout") for k in ("header", "body", "idle")}
    return Timeouts(**{k: v for k, v in given.items() if v is not None})


def _none(value: str | None) -> str | None:
    return None if value is None or value.lower() == "none" else value


def _build(args: argparse.Namespace) -> int:
    from memsearcher.retrieval.bm25 import build_bm25
    from memsearcher.retrieval.corpus import check_corpus_path
    from memsearcher.retrieval.dense import build_dense
    from memsearcher.retrieval.hybrid import build_hybrid

    corpus = check_corpus_path(args.corpus)
    if os.path.abspath(args.out) == os.path.abspath(corpus):
        raise MemSearcherError(f"--out {args.out} is the corpus file; name a folder for the index")

    bm25 = BM25Config(
        k1=args.k1, b=args.b, method=args.method,
        stemmer=_none(args.stemmer), stopwords=_none(args.stopwords),
    )  # fmt: skip
    encoder = EncoderConfig(
        name=args.encoder, query_prefix=args.query_prefix, passage_prefix=args.passage_prefix,
        max_length=args.max_length, batch_size=args.batch_size, devices=tuple(args.device),
        half=args.half,
    )  # fmt: skip
    index = FaissConfig(
        kind=args.faiss, hnsw_m=args.hnsw_m, ef_construction=args.ef_construction,
        ef_search=args.ef_search, nlist=args.nlist, nprobe=args.nprobe, pq_m=args.pq_m,
        pq_bits=args.pq_bits, opq=args.opq, rerank=args.rerank, candidates=args.candidates,
        train_size=args.train_size,
    )  # fmt: skip
    common: dict[str, Any] = {
        "progress": not args.no_progress,
        "on_error": "skip" if args.skip_bad_rows else "raise",
        "overwrite": args.overwrite,
    }
    built: Any
    if args.kind == "bm25":
        built = build_bm25(args.corpus, args.out, bm25, **common)
    elif args.kind == "dense":
        built = build_dense(
            args.corpus, args.out, encoder, index, keep_embeddings=args.keep_embeddings,
            embeddings_from=args.embeddings_from, **common,
        )  # fmt: skip
    else:
        config = HybridConfig(args.fusion, args.dense_weight, args.depth)
        built = build_hybrid(args.corpus, args.out, config, bm25, encoder, index, **common)
    manifest = built.manifest
    print(
        f"built {manifest['kind']} index {args.out}: {manifest['passages']} passages "
        f"in {manifest['build_seconds']:.1f} s"
    )
    return 0


def _search(args: argparse.Namespace) -> int:
    from memsearcher.retrieval import load_index
    from memsearcher.text import sanitize_text

    retriever = load_index(args.index)
    # argv bytes that are not UTF-8 arrive as lone surrogates (Python's surrogateescape)
    queries = [sanitize_text(query) for query in args.query]
    for query, hits in zip(queries, retriever.search(queries, args.top_n), strict=True):
        if args.json:
            record = {"query": query, "hits": [h.__dict__ for h in hits]}
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"# {query}")
            for i, hit in enumerate(hits, start=1):
                line = f"Doc {i} (Title: {hit.title}) {' '.join(hit.text.split())}"
                print(f"{hit.score:8.3f}  {line[:200]}")
            if not hits:
                print("(no hits)")
    return 0


def _info(args: argparse.Namespace) -> int:
    from memsearcher.retrieval.manifest import read_manifest

    json.dump(read_manifest(args.index), sys.stdout, indent=2, ensure_ascii=False)
    print()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from memsearcher.retrieval.server import ServerConfig, serve

    load: dict[str, Any] = {}
    if args.mmap:
        load["mmap"] = True
    for key in ("ef_search", "nprobe", "candidates"):
        if getattr(args, key) is not None:
            load[key] = getattr(args, key)
    if args.device:
        load["devices"] = args.device
    if args.gpu:
        load["gpu"] = True
    names = ("max_top_n", "max_queries", "max_body_bytes", "max_pending_queries",
             "max_response_bytes", "cache_size")  # fmt: skip
    limits = {k: getattr(args, k) for k in names}
    config = ServerConfig(**{k: v for k, v in limits.items() if v is not None})
    serve(
        args.index, args.host, args.port, args.workers, config, load, args.access_log,
        timeouts_from(args), args.docs,
    )  # fmt: skip
    return 0
