"""A TCP relay that delays every byte by a fixed one-way time: hosts a few hops apart, on one machine.

`tc netem` is not available in this sandbox, so the benchmark puts one of these between the
orchestrator and each engine. Each direction of a connection is a queue of (due time, chunk): a
chunk read at t is written at t + delay, in order, so the relay adds latency without limiting
bandwidth (the benchmark's messages are small). It runs its own event loop in a thread.

As a process of its own (bench/bench_hosts.py runs one in the orchestrator's network namespace, in
front of each engine), until SIGTERM or Ctrl-C:

    python -m bench.delay_proxy --target 10.213.0.6:50051 --delay-ms 2 --host 10.213.0.66 \
        --ready-file relay.ready.json      # JSON {address, host, port, pid} once listening
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from specdec.cli.processes import write_ready_file

CHUNK = 1 << 16


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of host:port or [v6]:port (ValueError otherwise). The product's own parser
    (orchestrator.clients.replicas.split_address) imports torch, which a relay process has no use for."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


class DelayProxy:
    """Listens on `host`:`port` (0: any free port) and relays to `target` with `delay_s` each way."""

    def __init__(
        self,
        target: tuple[str, int],
        delay_s: float,
        port: int = 0,
        clock: Callable[[], float] = time.monotonic,
        host: str = "127.0.0.1",
    ) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.target, self.delay_s, self.clock = target, delay_s, clock
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> DelayProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, self.host, self.port), self._loop
        ).result(timeout=10)
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
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.delay_proxy",
        description="Relay TCP from --host:--port to --target, each byte delayed --delay-ms each way; "
        "runs until SIGTERM or Ctrl-C.",
    )
    p.add_argument("--target", required=True, help="HOST:PORT to relay to")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay in milliseconds (default 0)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default 0: any free port)")
    p.add_argument(
        "--ready-file", type=Path, default=None, help="once listening, write JSON {address, host, port, pid}"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.delay_ms < 0:
        parser().error(f"--delay-ms must be >= 0, got {args.delay_ms:g}")
    try:
        target = split_address(args.target)
    except ValueError:
        parser().error(f"--target must be HOST:PORT, got {args.target!r}")
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    with DelayProxy(
        target, args.delay_ms / 1e3, port=args.port, host=args.host
    ) as proxy:
        if args.ready_file is not None:
            payload = {"address": proxy.address, "host": proxy.host, "port": proxy.port, "pid": os.getpid()}
            write_ready_file(args.ready_file, payload)
        print(f"relaying {proxy.address} -> {args.target}, {args.delay_ms:g} ms each way", flush=True)
        while not stopping.wait(0.5):
            pass
    if args.ready_file is not None:
        args.ready_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
