"""A queue drained by one task into one worker thread: the lifecycle every batcher shares.

The retrieval server, the agent API and the async agent driver each merge the requests waiting
at a moment into one call on a worker thread; they differ only in what they merge (``_run``).
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

__all__ = ["QueueWorker"]

Item = TypeVar("Item")
Worker = TypeVar("Worker", bound="QueueWorker[Any]")


class QueueWorker(ABC, Generic[Item]):
    """A queue of ``Item``, one worker thread, and the task that feeds it (written by ``_run``).

    ``start``/``stop`` run it from inside an event loop (a server's lifespan), or ``async with``.
    """

    def __init__(self, thread_name: str) -> None:
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self: Worker) -> Worker:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @abstractmethod
    async def _run(self) -> None:
        """Take requests from ``self.queue`` forever, running them on ``self.executor``."""
