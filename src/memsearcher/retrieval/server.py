"""The retrieval server: one index behind the HTTP endpoints of MemSearcher and Search-R1.

    POST /search        {"query": str, "top_n": 5, "return_score": false}   (MemSearcher)
    POST /batch_search  {"query": [str, ...], "top_n": 5, "return_score": false}
    POST /retrieve      {"queries": [str, ...], "topk": 3, "return_scores": true}  (Search-R1)
    GET  /health

Concurrent requests are queued and searched together: one worker thread takes everything
waiting as one batch (one encoder forward pass and one FAISS search for dense indexes), so
batching adds no delay when the server is idle and grows with load. Inputs are bounded
(``ServerConfig``) and every bad request gets a 4xx with a JSON ``detail``.

fastapi and uvicorn are optional: ``pip install 'memsearcher[server]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.retrieval.base import Retriever
from memsearcher.types import Hit
from memsearcher.worker import QueueWorker

try:
    import fastapi
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field, StrictStr
except ImportError as error:  # only the server needs these; say how to get them
    raise MemSearcherError(
        f"the retrieval server needs fastapi and uvicorn ({error}): "
        "pip install 'memsearcher[server]'"
    ) from None

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

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


class SearchRequest(BaseModel):
    """MemSearcher's tool call: its arguments are posted as they are, so extra keys pass."""

    model_config = ConfigDict(extra="ignore")
    query: StrictStr = Field(description="The search query.")
    top_n: int = Field(5, ge=1, description="Passages to return (at most max_top_n, see /health).")
    return_score: bool = Field(False, description="Also return the scores.")


class BatchSearchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    query: list[StrictStr] = Field(min_length=1, description="The search queries.")
    top_n: int = Field(5, ge=1, description="Passages per query (at most the server's max_top_n).")
    return_score: bool = Field(False, description="Also return the scores.")


class RetrieveRequest(BaseModel):
    """Search-R1's retrieval request."""

    model_config = ConfigDict(extra="ignore")
    queries: list[StrictStr] = Field(min_length=1, description="The search queries.")
    topk: int = Field(3, ge=1, description="Passages per query (at most the server's max_top_n).")
    return_scores: bool = Field(True, description="Return {document, score} pairs.")


def _doc(hit: Hit) -> dict[str, str]:
    return {"id": hit.id, "contents": hit.contents}


class Batcher(QueueWorker[tuple[list[str], int, asyncio.Future[list[list[Hit]]]]]):
    """Runs searches in one worker thread, merging whatever requests are waiting into one call
    per distinct ``top_n``."""

    def __init__(self, retriever: Retriever, max_queries: int) -> None:
        super().__init__("retriever")
        self.retriever = retriever
        self.max_queries = max_queries

    async def search(self, queries: list[str], top_n: int) -> list[list[Hit]]:
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
            for top_n, items in groups.items():
                try:
                    await self._search_group(top_n, items)
                except Exception as error:  # this loop must outlive any failure, or all hang
                    logger.exception("search failed")
                    for _, future in items:
                        if not future.done():
                            future.set_exception(error)

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


class BodyGuard:
    """ASGI middleware: bound the body, insist on JSON in UTF-8, before any parsing.

    An oversized body is still read (and dropped, up to a hard cap) before the 413 goes out:
    answering mid-upload makes most clients fail with a broken pipe instead of reading it.
    """

    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype and ctype != b"application/json" and not ctype.endswith(b"+json"):
            await _reject(send, 415, "send the request as JSON (Content-Type: application/json)")
            return
        chunks, size, drained = [], 0, 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            if size + len(body) <= self.max_bytes:
                chunks.append(body)
                size += len(body)
            else:
                size = self.max_bytes + 1
                drained += len(body)
            if not message.get("more_body", False) or drained > 64 * self.max_bytes:
                break
        if size > self.max_bytes:
            await _reject(send, 413, f"request body over {self.max_bytes} bytes")
            return
        payload = b"".join(chunks)
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError as error:
            await _reject(send, 400, f"request body is not valid UTF-8 ({error.reason})")
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": payload, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _reject(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def create_app(
    retriever: Retriever, config: ServerConfig | None = None, info: dict[str, Any] | None = None
) -> fastapi.FastAPI:
    """The FastAPI application serving ``retriever``."""
    config = config or ServerConfig()
    info = dict(info or {})

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        app.state.batcher = Batcher(retriever, config.max_batch_queries)
        app.state.batcher.start()
        yield
        await app.state.batcher.stop()

    app = fastapi.FastAPI(
        title="memsearcher retrieval server",
        description="Passage search for MemSearcher and Search-R1 clients.",
        lifespan=lifespan,
    )

    def check(queries: Sequence[str], top_n: int) -> None:
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

    async def search(queries: list[str], top_n: int) -> list[list[Hit]]:
        check(queries, top_n)
        results: list[list[Hit]] = await app.state.batcher.search(queries, top_n)
        return results

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Any, error: RequestValidationError) -> Any:
        # the offending input is left out: echoing a 1 MB string back helps nobody
        detail = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in error.errors()
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.post("/search", summary="Search one query (MemSearcher)")
    async def search_one(request: SearchRequest) -> Any:
        """Returns ``[{"id", "contents"}, ...]``, or ``[[docs], [scores]]`` with
        ``return_score``."""
        hits = (await search([request.query], request.top_n))[0]
        docs = [_doc(h) for h in hits]
        body = [docs, [h.score for h in hits]] if request.return_score else docs
        return JSONResponse(body)

    @app.post("/batch_search", summary="Search several queries (MemSearcher)")
    async def batch_search(request: BatchSearchRequest) -> Any:
        """Returns one list of ``{"id", "contents"}`` per query, or ``[[lists of docs],
        [lists of scores]]`` with ``return_score``."""
        results = await search(request.query, request.top_n)
        docs = [[_doc(h) for h in hits] for hits in results]
        if request.return_score:
            return JSONResponse([docs, [[h.score for h in hits] for hits in results]])
        return JSONResponse(docs)

    @app.post("/retrieve", summary="Search several queries (Search-R1)")
    async def retrieve(request: RetrieveRequest) -> Any:
        """Returns ``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}``,
        or plain documents without ``return_scores``."""
        results = await search(request.queries, request.topk)
        if request.return_scores:
            result: list[Any] = [
                [{"document": _doc(h), "score": h.score} for h in hits] for hits in results
            ]
        else:
            result = [[_doc(h) for h in hits] for hits in results]
        return JSONResponse({"result": result})

    @app.get("/health", summary="Liveness and what is being served")
    async def health() -> Any:
        return JSONResponse({"status": "ok", **info, "limits": asdict(config)})

    app.add_middleware(BodyGuard, max_bytes=config.max_body_bytes)
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
    ``{"server": {...}, "load": {...}}`` options from ``$MEMSEARCHER_SERVE_OPTIONS``.
    """
    from memsearcher.retrieval import load_embedded_retriever, load_index

    options = json.loads(os.environ.get(ENV_OPTIONS) or "{}")
    folder = os.environ.get(ENV_INDEX)
    retriever = load_index(folder, **options.get("load", {})) if folder else None
    retriever = retriever or load_embedded_retriever()
    return create_app(retriever, ServerConfig(**options.get("server", {})), _index_info(retriever))


def serve(
    index: str | Path | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: int = 1,
    config: ServerConfig | None = None,
    load_options: dict[str, Any] | None = None,
    access_log: bool = False,
) -> None:
    """Serve an index folder (None: the embedded BM25) until interrupted."""
    from memsearcher.retrieval.encoder import require
    from memsearcher.retrieval.manifest import read_manifest

    uvicorn = require("uvicorn", "server")

    load_options = dict(load_options or {})
    if index is not None:
        kind = read_manifest(index)["kind"]  # fail here, with a clear message, not in workers
        dense_only = sorted(set(load_options) - {"mmap"})
        if kind == "bm25" and dense_only:
            raise MemSearcherError(f"{dense_only} apply to dense and hybrid indexes, not bm25")
    os.environ[ENV_INDEX] = str(Path(index).resolve()) if index is not None else ""
    os.environ[ENV_OPTIONS] = json.dumps(
        {"server": asdict(config or ServerConfig()), "load": load_options}
    )
    uvicorn.run(
        "memsearcher.retrieval.server:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        access_log=access_log,
        log_level="info",
    )
