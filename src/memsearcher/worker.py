"""A queue drained by one task into one worker thread: the lifecycle every batcher shares.

The retrieval server, the agent API and the async agent driver each merge the requests waiting
at a moment into one call on a worker thread; they differ only in what they merge (``_run``).
A server bounds the work waiting for its worker (``max_pending``) and turns :class:`Busy` into
503 with Retry-After, so a flood of requests waits in clients' backoff, not in its memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from memsearcher.errors import MemSearcherError

__all__ = ["Busy", "QueueWorker"]

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
Worker = TypeVar("Worker", bound="QueueWorker[Any]")


class Busy(MemSearcherError):
    """More work is waiting than the worker takes; the servers answer 503 with Retry-After."""


class QueueWorker(ABC, Generic[Item]):
    """A queue of ``Item``, one worker thread, and the task that feeds it (written by ``_run``).

    ``start``/``stop`` run it from inside an event loop (a server's lifespan), or ``async with``.
    """

    def __init__(self, thread_name: str, max_pending: int | None = None) -> None:
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self.task: asyncio.Task[None] | None = None
        self.max_pending = max_pending
        self.pending = 0

    @contextlib.contextmanager
    def admit(self, weight: int = 1) -> Iterator[None]:
        """Count ``weight`` units of work (questions, queries) as pending for the ``with``
        block; raise :class:`Busy` if that would pass ``max_pending``."""
        if self.max_pending is not None and self.pending + weight > self.max_pending:
            raise Busy(
                f"the server is busy ({self.pending} pending, at most {self.max_pending}); "
                "retry later"
            )
        self.pending += weight
        try:
            yield
        finally:
            self.pending -= weight

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def run_apart(
        self,
        items: list[Any],
        run: Callable[[list[Any]], Awaitable[None]],
        future: Callable[[Any], asyncio.Future[Any]],
    ) -> None:
        """``run(items)`` as one call; if it raises, run each item alone, so that a bad item
        (a question, a query) fails alone and its neighbours still get their answers. An item
        that fails alone gets the error in ``future(item)``; this never raises, or the worker
        loop would die and every later request hang."""
        if len(items) > 1:
            try:
                await run(items)
                return
            except Exception as error:
                logger.warning(
                    "a batch of %d failed (%s); running them one by one", len(items), error
                )
        for item in items:
            try:
                await run([item])
            except Exception as error:
                logger.exception("a request failed")
                if not future(item).done():
                    future(item).set_exception(error)

    async def __aenter__(self: Worker) -> Worker:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @abstractmethod
    async def _run(self) -> None:
        """Take requests from ``self.queue`` forever, running them on ``self.executor``."""
