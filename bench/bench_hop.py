"""What a long-lived stream per session would save over unary calls: one gRPC hop, measured alone.

Issue 37 asks for "a long-lived stream per session instead of unary calls where that pays". The
loop makes one Verify call per iteration (and a Lookahead call beside it when the draft model
drafts), each a unary call on a channel that stays open. A bidirectional stream per session would
send the same messages on one HTTP/2 stream opened once. This benchmark measures the difference on
loopback with grpc.aio on both sides, as the services run: a unary echo against a message echoed
on an open stream, with a payload the size of a target-only Verify request and its outcome, and
the same through a server interceptor that does what ours do per call (reads the metadata).

    python -m bench.bench_hop                      # 2000 calls each, alternated in blocks
    python -m bench.bench_hop --calls 5000 --payload-bytes 1024 --json

Reported: the median and p90 round trip of each, in microseconds, and the saving per iteration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

SERVICE = "specdec.bench.Hop"


class _ReadsMetadata(grpc.aio.ServerInterceptor):
    """Per call, what the services' interceptors do at the least: look at the caller's metadata."""

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        dict(details.invocation_metadata or ())
        return await continuation(details)


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def _echo_stream(requests: AsyncIterator[bytes],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request


def _handlers() -> grpc.GenericRpcHandler:
    same = {"request_deserializer": None, "response_serializer": None}
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(_echo, **same),
        "Stream": grpc.stream_stream_rpc_method_handler(_echo_stream, **same),
    })


async def _unary_block(channel: grpc.aio.Channel, payload: bytes, calls: int) -> list[float]:
    call = channel.unary_unary(f"/{SERVICE}/Unary")
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        await call(payload, metadata=(("authorization", "Bearer x"),), timeout=10)
        times.append(time.perf_counter() - began)
    return times


async def _stream_block(channel: grpc.aio.Channel, payload: bytes, calls: int) -> list[float]:
    stream = channel.stream_stream(f"/{SERVICE}/Stream")(metadata=(("authorization", "Bearer x"),))
    times = []
    try:
        for _ in range(calls):
            began = time.perf_counter()
            await stream.write(payload)
            await stream.read()
            times.append(time.perf_counter() - began)
    finally:
        await stream.done_writing()
    return times


async def measure(calls: int, payload_bytes: int, blocks: int,
                  intercepted: bool) -> dict[str, dict[str, float]]:
    server = grpc.aio.server(interceptors=[_ReadsMetadata()] if intercepted else [])
    server.add_generic_rpc_handlers((_handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    payload = b"x" * payload_bytes
    results: dict[str, list[float]] = {"unary": [], "stream": []}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await _unary_block(channel, payload, 50)  # warm-up: the connection, both paths
            await _stream_block(channel, payload, 50)
            per_block = max(1, calls // blocks)
            for _ in range(blocks):  # alternated, so drift on a shared machine falls on both
                results["unary"] += await _unary_block(channel, payload, per_block)
                results["stream"] += await _stream_block(channel, payload, per_block)
    finally:
        await server.stop(None)
    return {name: {"median_us": 1e6 * statistics.median(times),
                   "p90_us": 1e6 * statistics.quantiles(times, n=10)[-1], "calls": len(times)}
            for name, times in results.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_hop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="round trips of each kind (default 2000)")
    p.add_argument("--payload-bytes", type=int, default=256,
                   help="bytes each way (default 256: a target-only Verify and its outcome)")
    p.add_argument("--blocks", type=int, default=10, help="alternated blocks of each kind (default 10)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    if args.calls < 1 or args.payload_bytes < 0 or args.blocks < 1:
        p.error("--calls and --blocks must be >= 1 and --payload-bytes >= 0")
    out = {}
    for intercepted in (False, True):
        name = "with a metadata interceptor" if intercepted else "bare"
        out[name] = asyncio.run(measure(args.calls, args.payload_bytes, args.blocks, intercepted))
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print("| server | unary call, median µs (p90) | message on an open stream, median µs (p90) "
          "| saved a hop, µs |")
    print("|---|---:|---:|---:|")
    for name, cells in out.items():
        unary, stream = cells["unary"], cells["stream"]
        print(f"| {name} | {unary['median_us']:.0f} ({unary['p90_us']:.0f}) | {stream['median_us']:.0f} "
              f"({stream['p90_us']:.0f}) | {unary['median_us'] - stream['median_us']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
