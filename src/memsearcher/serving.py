"""What both HTTP servers (``retriever serve`` and ``serve``) share, in front of their apps.

- :class:`BodyGuard`: JSON bodies only (415, a missing Content-Type included), bounded (413),
  in UTF-8 (400), checked before anything parses them.
- :class:`HostGuard`: a server bound to loopback answers only requests addressed to a loopback
  name (421 otherwise), so a web page cannot reach it by DNS rebinding.
- :class:`TimedH11Protocol`: uvicorn's HTTP/1.1 protocol with read timeouts, which uvicorn
  lacks: a client that connects and sends nothing, trickles its headers, or trickles its body
  gets 408 and is disconnected, and a kept-alive connection waits ``idle`` seconds at most.
- :func:`unless_gone`: a request's work is cancelled as soon as its client hangs up, so that
  work nobody waits for stops holding a place in the queue.
- JSON answers for a full queue (:class:`memsearcher.worker.Busy`: 503 with Retry-After), for
  invalid requests (422, saying where the JSON broke) and for faults (500): never plain text.

fastapi and uvicorn are optional: ``pip install 'memsearcher[server]'``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from memsearcher.errors import MemSearcherError
from memsearcher.worker import Busy

try:
    import h11
    import uvicorn
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from uvicorn.protocols.http.h11_impl import H11Protocol
except ImportError as error:  # only the servers need these; say how to get them
    raise MemSearcherError(
        f"the servers need fastapi and uvicorn ({error}): pip install 'memsearcher[server]'"
    ) from None

__all__ = [
    "BodyGuard",
    "ClientGone",
    "HostGuard",
    "TimedH11Protocol",
    "Timeouts",
    "add_error_handlers",
    "allowed_hosts",
    "fault_detail",
    "run_server",
    "unless_gone",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ENV_TIMEOUTS = "MEMSEARCHER_HTTP_TIMEOUTS"
"""How ``run_server`` hands the timeouts to the protocol in every worker process."""


@dataclass(frozen=True)
class Timeouts:
    """How long a client may take to send a request."""

    header: float = 10.0
    """Seconds to send the request line and headers, from connecting (or, on a kept-alive
    connection, from the request's first byte)."""
    body: float = 30.0
    """Seconds to send the body, once the headers are in."""
    idle: float = 5.0
    """Seconds a kept-alive connection may wait for its next request."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise MemSearcherError(f"the {name} timeout must be > 0 seconds, got {value}")


async def reject(
    send: Send, status: int, detail: str, headers: dict[str, str] | None = None
) -> None:
    """Answer with a JSON ``detail``, from ASGI middleware (before any app runs)."""
    body = json.dumps({"detail": detail}).encode()
    fields = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    fields += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": fields})
    await send({"type": "http.response.body", "body": body})


class BodyGuard:
    """ASGI middleware: bound the body, insist on JSON in UTF-8, before any parsing.

    An oversized body is still read (and dropped, up to a hard cap) before the 413 goes out:
    answering mid-upload makes most clients fail with a broken pipe instead of reading it. A
    client that asks first (``Expect: 100-continue``) with a Content-Length over the bound gets
    the 413 at once instead of ``100 Continue`` (which uvicorn sends on the first read), and
    never uploads.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype != b"application/json" and not ctype.endswith(b"+json"):
            said = f"Content-Type {ctype.decode('latin-1')!r}" if ctype else "no Content-Type"
            await reject(send, 415, f"send the request as JSON (Content-Type: application/json); "
                         f"this one has {said}")  # fmt: skip
            return
        length = headers.get(b"content-length", b"")
        if headers.get(b"expect", b"").lower() == b"100-continue" and (
            length.isdigit() and int(length) > self.max_bytes
        ):
            detail = f"request body over {self.max_bytes} bytes"
            await reject(send, 413, detail, {"connection": "close"})
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
            await reject(send, 413, f"request body over {self.max_bytes} bytes")
            return
        payload = b"".join(chunks)
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError as error:
            await reject(send, 400, f"request body is not valid UTF-8 ({error.reason})")
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": payload, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def allowed_hosts(bind: str) -> frozenset[str] | None:
    """The Host names a server bound to ``bind`` answers: loopback names when it is bound to
    loopback, None (any name) otherwise."""
    name = bind.strip("[]").lower()
    try:
        loopback = ipaddress.ip_address(name).is_loopback
    except ValueError:
        loopback = name == "localhost"
    return frozenset({"127.0.0.1", "localhost", "::1", name}) if loopback else None


def host_name(header: str) -> str:
    """The name in a Host header, without its port: ``[::1]:8000`` -> ``::1``."""
    if header.startswith("["):
        return header[1:].partition("]")[0].lower()
    return header.rpartition(":")[0].lower() if header.count(":") == 1 else header.lower()


class HostGuard:
    """ASGI middleware: 421 for a request whose Host header names none of ``hosts``."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.hosts is not None:
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if host_name(header) not in self.hosts:
                await reject(
                    send, 421, f"this server is bound to loopback and answers requests for "
                    f"{', '.join(sorted(self.hosts))}, not for Host {header!r}",
                )  # fmt: skip
                return
        await self.app(scope, receive, send)


class ClientGone(MemSearcherError):
    """The client hung up before its answer was ready."""


async def _disconnected(receive: Receive) -> None:
    # once the body is read, uvicorn's receive() waits until the connection is lost
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """The result of ``work``, or :class:`ClientGone` as soon as the client hangs up first.

    The work is then cancelled: a request still queued leaves the queue and its place (the 503
    bound) is free at once. Work already running in a worker thread cannot be stopped from here;
    it runs on until it checks (the agent service ends a dropped question at the end of its
    turn), and its answer is dropped.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # nothing, if it is done
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone("the client hung up; its request was dropped")


def fault_detail(error: Exception) -> str:
    """What a client is told of a fault: our own errors are written for the operator (a corpus
    that changed under the index); anything else may carry internals, so only its type."""
    said = f": {error}" if isinstance(error, MemSearcherError) else ""
    return f"internal error: {type(error).__name__}{said}"


def add_error_handlers(app: Any) -> None:
    """JSON for every failure: validation (422), a full queue (503), a client that hung up
    (499, sent to nobody), anything else (500)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Any, error: RequestValidationError) -> Any:
        # the offending input is left out: echoing a 1 MB string back helps nobody
        detail = []
        for e in error.errors():
            msg = e.get("msg", "")
            if e.get("type") == "json_invalid":  # say what broke, and where
                where = e.get("loc", ("body", "?"))[-1]
                msg = f"not valid JSON: {e.get('ctx', {}).get('error', msg)} (at character {where})"
            detail.append({"loc": list(e.get("loc", ())), "msg": msg, "type": e.get("type", "")})
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(ClientGone)
    async def gone(request: Any, error: ClientGone) -> Any:
        logger.info("%s %s: %s", request.method, request.url.path, error)
        return JSONResponse({"detail": str(error)}, 499)  # nginx's "client closed request"

    @app.exception_handler(Busy)
    async def busy(request: Any, error: Busy) -> Any:
        return JSONResponse({"detail": str(error)}, 503, headers={"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def failed(request: Any, error: Exception) -> Any:
        return JSONResponse({"detail": fault_detail(error)}, 500)


def _timeouts_from_env() -> Timeouts:
    return Timeouts(**json.loads(os.environ.get(ENV_TIMEOUTS) or "{}"))


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on whatever part of a request is on its way.

    uvicorn closes a kept-alive connection after ``timeout_keep_alive`` but restarts that clock
    on every byte, and sets none before the first request or during a body: a client sending a
    byte a second holds a connection forever. Here the head and the body each get one deadline.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeouts = _timeouts_from_env()
        # read by uvicorn's call_later after each response, which takes float seconds too
        self.timeout_keep_alive = self.timeouts.idle  # type: ignore[assignment]
        self.deadline: asyncio.TimerHandle | None = None
        self.awaiting: str | None = None  # "headers" or "body" while a deadline runs

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers", self.timeouts.header)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what h11 cannot parse (a garbage request line, two Host headers,
        a head over the size limit), in JSON like every other refusal, not text/plain."""
        body = json.dumps({"detail": f"{msg} (HTTP/1.1 could not parse it)"}).encode()
        fields = [("content-type", "application/json"), ("content-length", str(len(body)))]
        for event in (
            h11.Response(
                status_code=400, headers=[*fields, ("connection", "close")], reason="Bad Request"
            ),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _follow(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self.awaiting != "body":
                self._arm("body", self.timeouts.body)
        elif state is h11.IDLE and self.conn.trailing_data[0]:  # part of a request's head
            if self.awaiting != "headers":
                self._arm("headers", self.timeouts.header)
        elif not (state is h11.IDLE and self.awaiting == "headers"):
            self._disarm()  # a whole request is in, or uvicorn's keep-alive clock runs

    def _arm(self, what: str, seconds: float) -> None:
        self._disarm()
        self.awaiting = what
        self.deadline = self.loop.call_later(seconds, self._expired, what, seconds)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline, self.awaiting = None, None

    def _expired(self, what: str, seconds: float) -> None:
        self.deadline, self.awaiting = None, None
        if self.transport.is_closing():
            return
        cycle = self.cycle if what == "body" else None
        if cycle is not None:  # the app waiting for this body hears that the client is gone
            cycle.disconnected = True
            cycle.message_event.set()
        if cycle is None or not cycle.response_started:
            body = json.dumps({"detail": f"request {what} not received within {seconds:g} s"})
            head = (
                "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write((head + body).encode())
        self.transport.close()


def run_server(app: Any, host: str, port: int, timeouts: Timeouts, **options: Any) -> None:
    """``uvicorn.run`` with :class:`TimedH11Protocol`; ``app`` is an app, or the import string
    of a factory (with ``factory=True``), for several worker processes."""
    os.environ[ENV_TIMEOUTS] = json.dumps(asdict(timeouts))
    uvicorn.run(app, host=host, port=port, http=TimedH11Protocol, **options)
