"""Admission: how many requests run at once, and who waits (the orchestrator's request slots); how many
one caller may have open (CallerLimit); and streams whose reader stops reading, which hand their slot
back while paused and are closed once idle too long (paced)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from specdec.defaults import ANONYMOUS
from specdec.errors import Overloaded
from specdec.generation import GenerationChunk

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """Who a door serves: `owner`, the identity the request's record is bound to, and `key`, what the
    per-caller cap counts the call under (the owner, or "peer:<address>" for an anonymous caller, so
    anonymous callers are capped per address). Passed to the orchestrator with every call."""

    owner: str
    key: str

    @classmethod
    def of(cls, owner: str, address: str) -> Caller:
        return cls(owner, owner if owner != ANONYMOUS else f"peer:{address}")


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
        self.paused = 0  # streams paused without a slot (their reader has not taken the last chunk)
        self.idle_closed = 0  # streams closed after their reader took nothing for the idle timeout
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


# The HTTP door gives up on a write to a client that reads nothing this long after the idle timeout:
# by then the orchestrator has closed the stream's runs itself (counted in idle_closed), and the door
# closes the connection it was still writing to. (gRPC's streaming handlers stay async generators, so
# grpc does the writing: a client there gets the stream's end, StreamIdle, when it reads again.)
DOOR_GRACE_S = 5.0


def door_write_timeout(idle_timeout_s: float) -> float | None:
    """How long a front door's write to a client may wait (None: no limit, as idle_timeout_s = 0)."""
    return idle_timeout_s + DOOR_GRACE_S if idle_timeout_s > 0 else None


class StreamIdle(Overloaded):
    """A stream whose reader took nothing for the idle timeout was closed to free its request
    (→ RESOURCE_EXHAUSTED); its stored progress stays resumable."""


class CallerLimit:
    """At most `limit` requests open at once per caller key (0: no cap). Over it a request is refused
    at once with Overloaded (RESOURCE_EXHAUSTED / HTTP 429), before it waits for a slot, so that one
    caller cannot fill the queue. Used from one event loop."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"max_requests_per_caller must be >= 0, got {limit}")
        self.limit = limit
        self.refused = 0
        self._open: Counter[str] = Counter()

    def open_requests(self, key: str) -> int:
        return self._open[key]

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        """Count one request of `key` for the body; Overloaded when `key` already has `limit` open."""
        if self.limit and self._open[key] >= self.limit:
            self.refused += 1
            who = key.removeprefix("peer:") if key.startswith("peer:") else "this caller's identity"
            raise Overloaded(
                f"too many requests from one caller: {who} already has {self._open[key]} requests "
                f"open, the most --max-requests-per-caller ({self.limit}) allows; retry when one has ended"
            )
        self._open[key] += 1
        try:
            yield
        finally:
            self._open[key] -= 1
            if self._open[key] <= 0:
                del self._open[key]


@dataclass
class _End:
    """What ends a paced stream: nothing (the source ended) or the error the reader gets."""

    error: BaseException | None = None


async def paced(source: AsyncIterator[GenerationChunk], slots: RequestSlots, *, idle_timeout_s: float,
                name: str = "") -> AsyncIterator[GenerationChunk]:
    """`source`'s chunks, produced in a task of their own while this stream's reader reads them.

    The source (a request's run) advances only while it holds one of `slots`. Once its reader has not
    taken the previous chunk when the next one is ready, the source pauses between chunks and hands its
    slot to the next request waiting; it takes a slot again (in arrival order) when the reader reads
    on, and continues where it stopped: only timing changes, so the output is what it would have been.
    A reader that takes nothing for `idle_timeout_s` (0: no limit) has its source closed (a run hands
    its lease back and releases its sessions: resumable) and then gets StreamIdle. Closing this stream
    closes the source at once; the task is cancelled once, so a reader cancelled again while it waits
    cannot cut the source's clean-up short. A chunk with a result is the last: the source's remaining
    clean-up runs without a slot. The task runs in a copy of the reader's context (trace context)."""
    queue: asyncio.Queue[GenerationChunk | _End] = asyncio.Queue()
    taken = asyncio.Event()
    finishing = False  # past the last chunk or closing after an idle timeout: not to be cancelled

    async def pump() -> None:
        nonlocal finishing
        holding = False
        try:
            await slots.acquire()
            holding = True
            while True:
                chunk = await anext(source, None)
                if chunk is None:
                    break
                queue.put_nowait(chunk)
                if chunk.result is not None:  # the last chunk: the clean-up runs without the slot
                    finishing = True
                    slots.release()
                    holding = False
                    await anext(source, None)
                    break
                if queue.qsize() > 1:  # the reader has not taken the previous chunk: pause
                    slots.release()
                    holding = False
                    await _wait_for_reader(queue, taken, slots, idle_timeout_s)
                    await slots.acquire()
                    holding = True
            queue.put_nowait(_End())
        except StreamIdle as exc:
            finishing = True
            await source.aclose()  # the run hands its lease back: Resume continues it at once
            slots.idle_closed += 1
            log.info("closed stream %s: its reader took nothing for %g s", name, idle_timeout_s)
            queue.put_nowait(_End(exc))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(_End(exc))
        finally:
            if holding:
                slots.release()
            await source.aclose()

    task = asyncio.create_task(pump(), name=f"stream {name}".strip())
    try:
        while True:
            item = await queue.get()
            taken.set()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        if not task.done() and not finishing:
            task.cancel()  # once: a run mid-iteration stops there, a paused one closes from its chunk
        try:
            await asyncio.shield(task)  # this reader cancelled again meanwhile: the task cleans up alone
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not task.done() or (current is not None and current.cancelling()):
                raise


async def _wait_for_reader(queue: asyncio.Queue, taken: asyncio.Event, slots: RequestSlots,
                           idle_timeout_s: float) -> None:
    """Wait, counted as paused, until the reader has taken all but the newest chunk; StreamIdle after
    idle_timeout_s (0: never) without it taking one."""
    slots.paused += 1
    try:
        while queue.qsize() > 1:
            taken.clear()
            try:
                async with asyncio.timeout(idle_timeout_s or None):
                    await taken.wait()
            except TimeoutError:
                raise StreamIdle(
                    f"stream closed: its reader took nothing for {idle_timeout_s:g} s "
                    f"(--stream-idle-timeout); Resume its request_id to continue it"
                ) from None
    finally:
        slots.paused -= 1
