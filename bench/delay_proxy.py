"""A TCP relay that delays every byte by a fixed one-way time: hosts a few hops apart, on one machine.

`tc netem` is not available in this sandbox, so the benchmark puts one of these between the
orchestrator and each engine. Each direction of a connection is a queue of (due time, chunk): a
chunk read at t is written at t + delay, in order, so the relay adds latency without limiting
bandwidth (the benchmark's messages are small). It runs its own event loop in a thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

CHUNK = 1 << 16


class DelayProxy:
    """Listens on 127.0.0.1:`port` (0: any free port) and relays to `target` with `delay_s` each way."""

    def __init__(self, target: tuple[str, int], delay_s: float, port: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.target, self.delay_s, self.clock = target, delay_s, clock
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> DelayProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", self.port), self._loop).result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        for reader, writer in ((client_reader, server_writer), (server_reader, client_writer)):
            task = asyncio.ensure_future(self._pipe(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    break
                wait = due - self.clock()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()

        delivery = asyncio.ensure_future(deliver())
        try:
            while chunk := await reader.read(CHUNK):
                queue.put_nowait((self.clock() + self.delay_s, chunk))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            queue.put_nowait((0.0, b""))
            try:
                await asyncio.wait_for(delivery, timeout=max(1.0, 4 * self.delay_s))
            except (TimeoutError, ConnectionError, asyncio.CancelledError):
                delivery.cancel()
            writer.close()
