"""The retrieval server: one index behind the HTTP endpoints of MemSearcher and Search-R1.

    POST /search        {"query": str, "top_n": 5, "return_score": false}   (MemSearcher)
    POST /batch_search  {"query": [str, ...], "top_n": 5, "return_score": false}
    POST /retrieve      {"queries": [str, ...], "topk": 3, "return_scores": true}  (Search-R1)
    GET  /health

Concurrent requests are queued and searched together: one worker thread takes everything
waiting as one batch (one encoder forward pass and one FAISS search for dense indexes), so
batching adds no delay when the server is idle and grows with load. Inputs, queued work and
answers are bounded (``ServerConfig``: more pending queries than ``max_pending_queries`` get
503 with Retry-After, an answer over ``max_response_bytes`` gets 422), clients that send too
slowly are cut off (``memsearcher.serving.Timeouts``), and every bad request gets a 4xx with a
JSON ``detail``. Queries and passages pass through ``memsearcher.text.sanitize_text``.

fastapi and uvicorn are optional: ``pip install 'memsearcher[server]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.retrieval.base import Retriever
from memsearcher.retrieval.cache import DEFAULT_CACHE_SIZE, CachedRetriever, with_cache
from memsearcher.serving import (
    BodyGuard,
    HostGuard,
    Timeouts,
    add_error_handlers,
    allowed_hosts,
    run_server,
    unless_gone,
)
from memsearcher.text import sanitize_text
from memsearcher.types import Hit
from memsearcher.worker import QueueWorker

try:
    import fastapi
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
except ImportError as error:  # only the server needs these; say how to get them
    raise MemSearcherError(
        f"the retrieval server needs fastapi and uvicorn ({error}): "
        "pip install 'memsearcher[server]'"
    ) from None

logger = logging.getLogger(__name__)

ENV_INDEX = "MEMSEARCHER_SERVE_INDEX"
ENV_OPTIONS = "MEMSEARCHER_SERVE_OPTIONS"


@dataclass(frozen=True)
class ServerConfig:
    """Bounds on requests and batching."""

    max_top_n: int = 100
    """Largest top_n / topk a request may ask for."""
    max_queries: int = 512
    """Most queries in one batch request."""
    max_query_chars: int = 4096
    """Longest query, in characters."""
    max_body_bytes: int = 1 << 20
    """Largest request body; larger ones get 413."""
    max_batch_queries: int = 512
    """Most queries searched in one index call when requests are batched together."""
    max_pending_queries: int = 2048
    """Queries waiting or being searched at once; a request that would pass it gets 503."""
    max_response_bytes: int = 8 << 20
    """Largest answer; a request whose answer would be larger gets 422."""
    cache_size: int = DEFAULT_CACHE_SIZE
    """Answers kept in an LRU (`memsearcher.retrieval.cache`), and each distinct query of a
    batch searched once; 0: neither. /health shows its size, hits and misses."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            low = 0 if name == "cache_size" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise MemSearcherError(
                    f"server setting {name} must be an integer >= {low}, got {value!r}"
                )
        if self.max_pending_queries < self.max_queries:
            raise MemSearcherError(
                f"max_pending_queries ({self.max_pending_queries}) must be at least max_queries "
                f"({self.max_queries}), or a full-size request could never be admitted"
            )


class SearchRequest(BaseModel):
    """MemSearcher's tool call: its arguments are posted as they are, so extra keys pass."""

    model_config = ConfigDict(extra="ignore")
    query: StrictStr = Field(description="The search query.")
    top_n: StrictInt = Field(5, ge=1, description="Passages (at most max_top_n, see /health).")
    return_score: StrictBool = Field(False, description="Also return the scores.")


class BatchSearchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    query: list[StrictStr] = Field(min_length=1, description="The search queries.")
    top_n: StrictInt = Field(5, ge=1, description="Passages per query (at most max_top_n).")
    return_score: StrictBool = Field(False, description="Also return the scores.")


class RetrieveRequest(BaseModel):
    """Search-R1's retrieval request."""

    model_config = ConfigDict(extra="ignore")
    queries: list[StrictStr] = Field(min_length=1, description="The search queries.")
    topk: StrictInt = Field(3, ge=1, description="Passages per query (at most max_top_n).")
    return_scores: StrictBool = Field(True, description="Return {document, score} pairs.")


def _doc(hit: Hit) -> dict[str, str]:
    return {"id": hit.id, "contents": hit.contents}


class Batcher(QueueWorker[tuple[list[str], int, asyncio.Future[list[list[Hit]]]]]):
    """Runs searches in one worker thread, merging whatever requests are waiting into one call
    per distinct ``top_n``."""

    def __init__(self, retriever: Retriever, max_queries: int, max_pending: int | None = None):
        super().__init__("retriever", max_pending)
        self.retriever = retriever
        self.max_queries = max_queries

    async def search(self, queries: list[str], top_n: int) -> list[list[Hit]]:
        with self.admit(len(queries)):
            future: asyncio.Future[list[list[Hit]]] = asyncio.get_running_loop().create_future()
            await self.queue.put((queries, top_n, future))
            return await future

    async def _run(self) -> None:
        while True:
            batch = [await self.queue.get()]
            size = len(batch[0][0])
            while size < self.max_queries and not self.queue.empty():
                batch.append(self.queue.get_nowait())
                size += len(batch[-1][0])
            groups: dict[int, list[tuple[list[str], asyncio.Future[list[list[Hit]]]]]] = {}
            for queries, top_n, future in batch:
                groups.setdefault(top_n, []).append((queries, future))
            for top_n, group in groups.items():
                items = [item for item in group if not item[1].done()]  # some clients left
                await self.run_apart(items, partial(self._search_group, top_n), itemgetter(1))

    async def _search_group(
        self, top_n: int, items: list[tuple[list[str], asyncio.Future[list[list[Hit]]]]]
    ) -> None:
        merged = [q for queries, _ in items for q in queries]
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self.executor, self.retriever.search, merged, top_n)
        if len(results) != len(merged):
            raise RuntimeError(f"{len(results)} results for {len(merged)} queries")
        start = 0
        for queries, future in items:
            if not future.done():  # a client that went away cancelled its future
                future.set_result(results[start : start + len(queries)])
            start += len(queries)


def create_app(
    retriever: Retriever,
    config: ServerConfig | None = None,
    info: dict[str, Any] | None = None,
    hosts: frozenset[str] | None = None,
    docs: bool = False,
) -> fastapi.FastAPI:
    """The FastAPI application serving ``retriever``: it answers requests for ``hosts`` only
    (None: any Host); ``docs`` serves /docs, a page that loads its scripts from a CDN."""
    config = config or ServerConfig()
    info = dict(info or {})
    searcher = with_cache(retriever, config.cache_size)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        app.state.batcher = Batcher(searcher, config.max_batch_queries, config.max_pending_queries)
        app.state.batcher.start()
        yield
        await app.state.batcher.stop()

    app = fastapi.FastAPI(
        title="memsearcher retrieval server",
        description="Passage search for MemSearcher and Search-R1 clients.",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url=None,
    )
    add_error_handlers(app)

    def check(queries: Sequence[str], top_n: int) -> list[str]:
        if top_n > config.max_top_n:
            raise fastapi.HTTPException(422, f"top_n must be at most {config.max_top_n}")
        if len(queries) > config.max_queries:
            raise fastapi.HTTPException(422, f"at most {config.max_queries} queries per request")
        for i, query in enumerate(queries):
            if not query.strip():
                raise fastapi.HTTPException(422, f"query {i} is empty")
            if len(query) > config.max_query_chars:
                raise fastapi.HTTPException(
                    422, f"query {i} is longer than {config.max_query_chars} characters"
                )
        return [sanitize_text(query) for query in queries]

    async def search(http: fastapi.Request, queries: list[str], top_n: int) -> list[list[Hit]]:
        work = app.state.batcher.search(check(queries, top_n), top_n)
        results: list[list[Hit]] = await unless_gone(http, work)
        return results

    def respond(body: Any) -> JSONResponse:
        response = JSONResponse(body)
        if len(response.body) > config.max_response_bytes:
            raise fastapi.HTTPException(
                422,
                f"the answer would be {len(response.body)} bytes, over this server's "
                f"max_response_bytes ({config.max_response_bytes}); ask for fewer queries or "
                "a smaller top_n",
            )
        return response

    @app.post("/search", summary="Search one query (MemSearcher)")
    async def search_one(request: SearchRequest, http: fastapi.Request) -> Any:
        """Returns ``[{"id", "contents"}, ...]``, or ``[[docs], [scores]]`` with
        ``return_score``."""
        hits = (await search(http, [request.query], request.top_n))[0]
        docs = [_doc(h) for h in hits]
        body = [docs, [h.score for h in hits]] if request.return_score else docs
        return respond(body)

    @app.post("/batch_search", summary="Search several queries (MemSearcher)")
    async def batch_search(request: BatchSearchRequest, http: fastapi.Request) -> Any:
        """Returns one list of ``{"id", "contents"}`` per query, or ``[[lists of docs],
        [lists of scores]]`` with ``return_score``."""
        results = await search(http, request.query, request.top_n)
        docs = [[_doc(h) for h in hits] for hits in results]
        if request.return_score:
            return respond([docs, [[h.score for h in hits] for hits in results]])
        return respond(docs)

    @app.post("/retrieve", summary="Search several queries (Search-R1)")
    async def retrieve(request: RetrieveRequest, http: fastapi.Request) -> Any:
        """Returns ``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}``,
        or plain documents without ``return_scores``."""
        results = await search(http, request.queries, request.topk)
        if request.return_scores:
            result: list[Any] = [
                [{"document": _doc(h), "score": h.score} for h in hits] for hits in results
            ]
        else:
            result = [[_doc(h) for h in hits] for hits in results]
        return respond({"result": result})

    @app.get("/health", summary="Liveness and what is being served")
    async def health() -> Any:
        """Also the index's memory: resident bytes (a passage, and fixed), disk bytes, and for
        re-ranking indexes the page cache this worker maps of the re-rank file, apart; and this
        worker's answer cache: entries held, capacity, hits and misses."""
        memory = getattr(retriever, "memory", None)
        extra = {"memory": memory()} if callable(memory) else {}
        cache = searcher.stats() if isinstance(searcher, CachedRetriever) else {"capacity": 0}
        pending = app.state.batcher.pending
        return JSONResponse(
            {"status": "ok", **info, **extra, "pending": pending, "cache": cache,
             "limits": asdict(config)}
        )  # fmt: skip

    app.add_middleware(BodyGuard, max_bytes=config.max_body_bytes)
    app.add_middleware(HostGuard, hosts=hosts)  # added last, so it runs first
    return app


def _index_info(retriever: Retriever) -> dict[str, Any]:
    manifest: dict[str, Any] = getattr(retriever, "manifest", {}) or {}
    folder = getattr(retriever, "folder", None)
    return {
        "kind": manifest.get("kind", type(retriever).__name__),
        "passages": manifest.get("passages"),
        "index": str(folder) if folder else None,
    }


def app_from_env() -> fastapi.FastAPI:
    """App factory for uvicorn (``--factory``), so each worker process loads the index itself.

    Reads the index folder from ``$MEMSEARCHER_SERVE_INDEX`` (empty: the embedded BM25) and
    ``{"server": {...}, "load": {...}, "host": str, "docs": bool}`` options from
    ``$MEMSEARCHER_SERVE_OPTIONS``.
    """
    from memsearcher.retrieval import load_embedded_retriever, load_index

    options = json.loads(os.environ.get(ENV_OPTIONS) or "{}")
    folder = os.environ.get(ENV_INDEX)
    retriever = load_index(folder, **options.get("load", {})) if folder else None
    retriever = retriever or load_embedded_retriever()
    return create_app(
        retriever,
        ServerConfig(**options.get("server", {})),
        _index_info(retriever),
        allowed_hosts(options.get("host", "127.0.0.1")),
        bool(options.get("docs", False)),
    )


def serve(
    index: str | Path | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: int = 1,
    config: ServerConfig | None = None,
    load_options: dict[str, Any] | None = None,
    access_log: bool = False,
    timeouts: Timeouts | None = None,
    docs: bool = False,
) -> None:
    """Serve an index folder (None: the embedded BM25) until interrupted."""
    from memsearcher.retrieval.manifest import read_manifest

    load_options = dict(load_options or {})
    if index is not None:
        kind = read_manifest(index)["kind"]  # fail here, with a clear message, not in workers
        dense_only = sorted(set(load_options) - {"mmap"})
        if kind == "bm25" and dense_only:
            raise MemSearcherError(f"{dense_only} apply to dense and hybrid indexes, not bm25")
    os.environ[ENV_INDEX] = str(Path(index).resolve()) if index is not None else ""
    os.environ[ENV_OPTIONS] = json.dumps(
        {
            "server": asdict(config or ServerConfig()),
            "load": load_options,
            "host": host,
            "docs": docs,
        }
    )
    run_server(
        "memsearcher.retrieval.server:app_from_env",
        host,
        port,
        timeouts or Timeouts(),
        factory=True,
        workers=workers,
        access_log=access_log,
        log_level="info",
    )
