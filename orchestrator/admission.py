"""Admission: how many requests run at once, and who waits (the orchestrator's request slots)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from specdec.errors import Overloaded


class RequestSlots:
    """Admission: at most `limit` requests hold a slot at once; the others wait in arrival order,
    each for at most `timeout_s`, then get Overloaded. A freed slot passes straight to the first
    waiter, so a newcomer never overtakes the queue. Used from one event loop."""

    def __init__(self, limit: int, timeout_s: float) -> None:
        if limit < 1:
            raise ValueError(f"max_active_requests must be >= 1, got {limit}")
        self.limit = limit
        self.timeout_s = timeout_s
        self.active = 0  # slots held
        self.rejected = 0  # requests refused after waiting timeout_s
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the body (released however the body ends)."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    async def acquire(self) -> None:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.timeout_s):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # the slot was handed over just as the wait ran out: keep it
            self._forget(waiter)
            self.rejected += 1
            raise Overloaded(
                f"orchestrator busy: {self.active} requests running and {self.waiting} waiting (waited "
                f"{self.timeout_s:g} s for a slot); retry later or raise --max-active-requests"
            ) from None
        except BaseException:  # cancelled while waiting: pass on a slot already handed over
            self._forget(waiter)
            if waiter.done() and not waiter.cancelled():
                self.release()
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: `active` stays
                return
        self.active -= 1

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
