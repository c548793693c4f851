"""Hostile clients (issue 29): six scenarios in which one client, or one fault, could hurt everyone.

Run through `python -m bench.bench_reliability SCENARIO [--quick]` (see its --help). Each scenario
starts what it needs (`specdec serve` processes or `specdec up`, a real redis-server, tiny random
models, float32 on loopback), measures, and returns a JSON-able dict with a `goals` section: each
goal is true or false as measured, so a fix that has not landed shows up as a false goal, never as
a skip. A flag a fix adds (`--stream-idle-timeout`, `--insecure-engine`, ...) is passed only once
the service's --help lists it; `flags` in the result says which were there.

  slow-reader    4 HTTP connections each asking n=16 SSE streams and M gRPC streams, none of which
                 reads, while a well-behaved client sends requests: its latency against its baseline
                 alone, the request slots held, whether the non-readers are cut after the idle
                 timeout, and whether they can be resumed.
  abort-storm    1,000 SSE streams aborted after their first event (raw sockets) and 10 closed through
                 the openai package's stream.close(): engine sessions, sessions released and the
                 specdec_active_requests gauge before and after.
  template-bomb  a nested-loop, a 10 MB and a 1 GB-output caller template to ApplyChatTemplate on a
                 verifier started without a token, with Tokenize calls beside: their latencies, the
                 bomb's answer, the verifier's RSS before and after (the harness kills a verifier past
                 an RSS cap, so the machine survives the "before").
  log-flood      1,000 malformed HTTP requests and 300 unauthenticated ones on keep-alive connections:
                 log bytes per bad request, tracebacks, and whether keep-alive survived.
  supervisor     `specdec up` on tiny models; kill -9 each service (drafter, verifier, orchestrator)
                 twice while seeded clients stream: requests lost, resumed outputs against the
                 undisturbed run, recovery times, whether `up` kept running.
  redis-hang     SIGSTOP the store's redis-server for 8 s and 20 s during streams, then kill -9 and
                 restart it: in-flight outcomes, a new request's latency during the hang, resumed
                 exactness, recovery time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench import bench_reliability as br
from specdec.cli import processes
from specdec.rpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc, verifier_pb2

MODEL_NAME = "tiny"  # --served-model-name of the HTTP door
PROMPT_TEXT = "t1 t2 t3 t4"
ENGINE_ARGS = ["--dtype", "float32", "--no-batching"]
SCENARIOS = ("slow-reader", "abort-storm", "template-bomb", "log-flood", "supervisor", "redis-hang")
HANG_OUTAGE_GRACE_S = 30.0  # redis-hang: the orchestrator's --store-outage-grace (its default)


# ----------------------------------------------------------------------------------------------
# sizes: full (the recorded figures) and quick (the tests)
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Size:
    """How big each scenario runs; `quick` keeps every one within about a minute."""

    http_nonreaders: int = 4          # slow-reader: HTTP connections, n=16 streams each
    http_n: int = 16
    grpc_nonreaders: int = 8
    nonreader_tokens: int = 1500
    victim_requests: int = 8
    victim_tokens: int = 32
    idle_timeout_s: float = 10.0       # --stream-idle-timeout, where the orchestrator has it
    aborted_streams: int = 1000        # abort-storm
    abort_concurrency: int = 50
    openai_closes: int = 10
    bomb_timeout_s: float = 60.0       # template-bomb: the bomb's deadline
    bomb_rss_cap_mb: float = 3072.0
    bad_requests: int = 1000           # log-flood
    unauthenticated: int = 300
    kill_rounds: int = 2               # supervisor
    kill_clients: int = 4
    kill_tokens: int = 200
    hangs_s: tuple[float, ...] = (8.0, 20.0)  # redis-hang: each well within HANG_OUTAGE_GRACE_S
    hang_clients: int = 4
    hang_tokens: int = 200


FULL = Size()
QUICK = Size(http_nonreaders=2, http_n=4, grpc_nonreaders=2, nonreader_tokens=1000, victim_requests=3,
             idle_timeout_s=3.0, aborted_streams=60, abort_concurrency=20, openai_closes=3,
             bomb_timeout_s=20.0, bad_requests=100, unauthenticated=30, kill_rounds=1, kill_clients=2,
             kill_tokens=64, hangs_s=(3.0,), hang_clients=2, hang_tokens=64)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
@functools.cache
def help_text(*command: str) -> str:
    """`specdec <command> --help` (wide), to see which flags the services have by now."""
    out = subprocess.run(processes.cli_command(*command, "--help"), capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "250", "TERM": "dumb"})
    return out.stdout + out.stderr


def has_flag(flag: str, *command: str) -> bool:
    return flag in help_text(*command)


def scrape(url: str | None) -> dict[str, float]:
    """A /metrics page summed over labels: {metric name: value}; {} when there is none."""
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name.split("{", 1)[0]] += float(value)
    return dict(out)


def pick(metrics: dict[str, float], *names: str) -> dict[str, float | None]:
    return {name: metrics.get(name) for name in names}


def summary(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "median": None, "max": None}
    return {"n": len(values), "median": round(statistics.median(values), 4), "max": round(max(values), 4)}


def http_address(stack: br.Stack) -> tuple[str, int]:
    url = stack.children["orchestrator"].info["http_url"]
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def send_queue_bytes(port: int) -> int | None:
    """Bytes the kernel holds unsent on the server's side of connections from `port` (`ss`'s Send-Q):
    what a non-reading client has had written for it without the server's writes blocking."""
    if shutil.which("ss") is None:
        return None
    out = subprocess.run(["ss", "-tnH", "state", "established", f"sport = :{port}"], capture_output=True,
                         text=True, timeout=10).stdout
    return sum(int(line.split()[1]) for line in out.splitlines() if len(line.split()) > 2)


def metrics_url(stack: br.Stack, role: str) -> str | None:
    return stack.children[role].info.get("metrics_url")


def completion_body(*, max_tokens: int, n: int = 1, stream: bool = True, seed: int | None = None) -> bytes:
    # ignore_eos: every stream runs its max_tokens (a tiny random model meets EOS early otherwise)
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT_TEXT, "max_tokens": max_tokens, "n": n,
                            "stream": stream, "temperature": 1.0, "ignore_eos": True}
    if seed is not None:
        body["seed"] = seed
    return json.dumps(body).encode()


def http_request(host: str, port: int, body: bytes, *, path: str = "/v1/completions",
                 token: str | None = None) -> bytes:
    headers = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
               f"Content-Length: {len(body)}"]
    if token:
        headers.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + body


async def stream_with_timeout(address: str, req: generation_pb2.GenerationRequest, client: int,
                              started: asyncio.Event | None, timeout_s: float) -> br.Stream:
    """br.stream_one bounded by the harness: a stream that hangs past timeout_s ends as HARNESS_TIMEOUT."""
    try:
        return await asyncio.wait_for(br.stream_one(address, req, client, started, timeout_s=timeout_s),
                                      timeout_s + 5.0)
    except TimeoutError:
        out = br.Stream(client, req.request_id, status="HARNESS_TIMEOUT")
        out.ended_at = time.monotonic()
        return out


async def resume_until(address: str, request_id: str,
                       deadline_s: float) -> tuple[list[int] | None, str, float]:
    """Resume a request as a patient client would (retrying ABORTED, UNAVAILABLE and a hang until
    deadline_s): (its tokens or None, the last status, seconds taken)."""
    started = time.monotonic()
    status = "NONE"
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        while time.monotonic() - started < deadline_s:
            remaining = max(1.0, deadline_s - (time.monotonic() - started))
            try:
                reply = await stub.Resume(generation_pb2.ResumeRequest(request_id=request_id),
                                          timeout=min(remaining, 60.0))
                return list(reply.token_ids), "OK", time.monotonic() - started
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
                if exc.code() not in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED):
                    break
            await asyncio.sleep(0.25)
    return None, status, time.monotonic() - started


async def timed_generate(address: str, req: generation_pb2.GenerationRequest,
                         timeout_s: float) -> tuple[str, float, list[int]]:
    """(status, seconds, token ids) of one Generate."""
    start = time.monotonic()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        try:
            reply = await stub.Generate(req, timeout=timeout_s)
            return "OK", time.monotonic() - start, list(reply.token_ids)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, time.monotonic() - start, []


def seeded(request_id: str, seed: int, tokens: int, method: str = "ersd") -> generation_pb2.GenerationRequest:
    return br.request(0, request_id=request_id, method=method, max_new_tokens=tokens, prompt_ids=(1, 2, 3, 4),
                      seed=seed)


def unique(prefix: str) -> str:
    return f"{prefix}-{time.time_ns()}"


# ----------------------------------------------------------------------------------------------
# slow-reader
# ----------------------------------------------------------------------------------------------
def _ending(data: bytes) -> str:
    """How an SSE body read to its end ended: 'completed' ([DONE] after the results), 'cut' (closed
    without [DONE], or an error event before it: the door closed the streams, e.g. idle)."""
    if b"[DONE]" not in data or b'"error"' in data:
        return "cut"
    return "completed"


class NonReader:
    """A raw HTTP connection that asks for SSE streams, reads the headers and the first event (for the
    response id), then never reads again: its receive buffer is kept small so the server feels it."""

    def __init__(self, host: str, port: int, body: bytes) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(60.0)
        self.sock.connect((host, port))
        self.sock.sendall(http_request(host, port, body))
        self.head = b""
        self.response_id = ""
        self.status = 0

    def read_first_event(self) -> None:
        while len(self.head) < 65536:
            chunk = self.sock.recv(1)  # byte by byte: read nothing past the first event
            if not chunk:
                break
            self.head += chunk
            if self.head.endswith(b"\n\n") and b"data:" in self.head:
                break
        with contextlib.suppress(ValueError, IndexError):
            self.status = int(self.head.split(b" ", 2)[1])
        for line in self.head.decode(errors="replace").splitlines():
            if line.startswith("data:"):
                with contextlib.suppress(ValueError):
                    self.response_id = json.loads(line[5:]).get("id", "")

    def finish(self, within_s: float) -> str:
        """Read what is there now: 'cut' (closed without [DONE]), 'completed' ([DONE]) or 'open'."""
        self.sock.settimeout(0.5)
        data, deadline = b"", time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                break
            except OSError:
                return "cut"
            if not chunk:
                return _ending(data)
            data += chunk
            if b"[DONE]" in data:
                return _ending(data)
        return "open"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


async def until_no_slot_is_held(metrics: str | None, since: float, *, min_s: float, max_s: float) -> float:
    """Seconds from `since` until the orchestrator's admitted requests read 0 (at least `min_s`, at
    most `max_s`: a regression that keeps slots held runs the victim beside them and fails its goal)."""
    await asyncio.sleep(max(0.0, since + min_s - time.monotonic()))
    while time.monotonic() - since < max_s:
        if (await asyncio.to_thread(scrape, metrics)).get("specdec_admitted_requests") == 0:
            break
        await asyncio.sleep(0.2)
    return time.monotonic() - since


async def slow_reader(workdir: Path, models: br.Models, size: Size, progress: br.Say) -> dict[str, Any]:
    idle_flag = has_flag("--stream-idle-timeout", "serve", "orchestrator")
    cap_flag = has_flag("--max-requests-per-caller", "serve", "orchestrator")
    args = ["--http-port", "0", "--served-model-name", MODEL_NAME, "--metrics-port", "0"]
    if idle_flag:
        args += ["--stream-idle-timeout", str(size.idle_timeout_s)]
    # The setting's variable too: it works wherever the config has the setting, flag or not.
    env = {"SPECDEC_STREAM_IDLE_TIMEOUT_S": str(size.idle_timeout_s)}
    stack = br.Stack(models, workdir, store_url=None, engine_args=ENGINE_ARGS, orchestrator_args=args,
                     env=env)
    progress("slow-reader: starting drafter, verifier, orchestrator (HTTP door, metrics) …")
    try:
        stack.start()
        address, (host, port) = stack.address("orchestrator"), http_address(stack)
        orch_metrics = metrics_url(stack, "orchestrator")

        async def victim(n: int, phase: str, deadline_s: float) -> list[tuple[str, float]]:
            out = []
            stop_at = time.monotonic() + deadline_s
            for i in range(n):
                if time.monotonic() > stop_at:
                    out.append(("NOT_SENT (phase time over)", 0.0))
                    continue
                req = seeded(unique(f"victim-{phase}-{i}"), 100 + i, size.victim_tokens, method="token")
                status, seconds, _ = await timed_generate(address, req, max(1.0, stop_at - time.monotonic()))
                out.append((status, seconds))
            return out

        progress("  the well-behaved client alone …")
        await victim(1, "warmup", 60.0)
        alone = await victim(size.victim_requests, "alone", 120.0)
        alone_s = [s for status, s in alone if status == "OK"]
        baseline = statistics.median(alone_s) if alone_s else float("nan")
        progress(f"  alone: median {baseline:.3f} s")

        progress(f"  opening {size.http_nonreaders} HTTP non-readers (n={size.http_n}) and "
                 f"{size.grpc_nonreaders} gRPC non-readers …")
        opened = time.monotonic()
        sockets = [NonReader(host, port, completion_body(max_tokens=size.nonreader_tokens, n=size.http_n))
                   for _ in range(size.http_nonreaders)]
        await asyncio.gather(*(asyncio.to_thread(s.read_first_event) for s in sockets))
        options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(size.grpc_nonreaders)]
        grpc_ids = [unique(f"nonreader-{i}") for i in range(size.grpc_nonreaders)]
        calls = [generation_pb2_grpc.GenerationServiceStub(ch).GenerateStream(
            seeded(rid, 500 + i, size.nonreader_tokens, method="token"), timeout=600.0)
            for i, (ch, rid) in enumerate(zip(channels, grpc_ids, strict=True))]
        # Their buffers fill, then their runs pause and hand their slots back: the victim is measured
        # from there on (while they still generate, it shares the engines with them, which is fair use).
        settled_s = await until_no_slot_is_held(orch_metrics, opened, min_s=2.0, max_s=30.0)
        progress(f"  non-readers hold no slot after {settled_s:.1f} s")
        slots_sampled: list[float] = []

        async def sample_slots(stop: asyncio.Event) -> None:
            while not stop.is_set():
                m = await asyncio.to_thread(scrape, orch_metrics)
                slots_sampled.append(m.get("specdec_admitted_requests", float("nan")))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)

        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_slots(stop))
        progress("  the well-behaved client beside them …")
        phase_s = max(3 * size.idle_timeout_s, 30.0)
        beside = await victim(size.victim_requests, "beside", phase_s)
        beside_s = [s for status, s in beside if status == "OK"]
        queued_bytes = send_queue_bytes(port)
        # Past the idle timeout, plus the HTTP door's grace for a blocked write (5 s) and a margin, the
        # non-readers should have been cut.
        wait_until = opened + size.idle_timeout_s + 10.0
        await asyncio.sleep(max(0.0, wait_until - time.monotonic()))
        stop.set()
        await sampler
        after_timeout = scrape(orch_metrics)
        progress("  reading what the non-readers were left with …")
        http_outcomes = await asyncio.gather(*(asyncio.to_thread(s.finish, 3.0) for s in sockets))
        grpc_outcomes = []
        for call in calls:
            try:
                async def drain(c: Any = call) -> str:
                    async for _ in c:
                        pass
                    return "completed"
                grpc_outcomes.append(await asyncio.wait_for(drain(), 3.0))
            except grpc.aio.AioRpcError as exc:
                grpc_outcomes.append(exc.code().name)
            except TimeoutError:
                call.cancel()
                grpc_outcomes.append("open")
        for s in sockets:
            s.close()
        for ch in channels:
            await ch.close()
        progress("  resuming a sample of the non-readers …")
        # An HTTP stream's choice i is stored as <id without "cmpl-">-<i>, resumable over gRPC.
        http_ids = [f"{s.response_id.split('-', 1)[-1]}-0" for s in sockets[:2] if s.response_id]
        resume_ids = grpc_ids[:2] + http_ids
        answers = await asyncio.gather(*(resume_until(address, rid, 120.0) for rid in resume_ids))
        resumed = [{"request_id": rid, "status": status, "tokens": len(tokens or []),
                    "seconds": round(seconds, 3)}
                   for rid, (tokens, status, seconds) in zip(resume_ids, answers, strict=True)]
        after = scrape(orch_metrics)
    finally:
        stack.stop()
    delay = (statistics.median(beside_s) - baseline) if beside_s else None
    cut = sum(o == "cut" for o in http_outcomes) + sum(o not in ("completed", "open") for o in grpc_outcomes)
    nonreaders = len(http_outcomes) + len(grpc_outcomes)
    complete = [r for r in resumed if r["status"] == "OK" and r["tokens"] == size.nonreader_tokens]
    return {
        "flags": {"--stream-idle-timeout": idle_flag, "--max-requests-per-caller": cap_flag},
        "nonreaders": {"http_connections": size.http_nonreaders, "streams_each": size.http_n,
                       "grpc_streams": size.grpc_nonreaders, "max_tokens": size.nonreader_tokens,
                       "http_statuses": [s.status for s in sockets]},
        "nonreaders_settled_s": round(settled_s, 2),
        "victim_alone_s": summary(alone_s), "victim_beside_s": summary(beside_s),
        "victim_beside_statuses": dict(collections.Counter(status for status, _ in beside)),
        "victim_median_delay_s": None if delay is None else round(delay, 4),
        "slots_held_while_open": summary([s for s in slots_sampled if s == s]),
        "slots_held_after_idle_timeout": after_timeout.get("specdec_admitted_requests"),
        "http_bytes_queued_in_the_kernel_after_the_victim": queued_bytes,
        "active_requests_after_idle_timeout": after_timeout.get("specdec_active_requests"),
        "http_outcomes": dict(collections.Counter(http_outcomes)),
        "grpc_outcomes": dict(collections.Counter(grpc_outcomes)),
        "resumed": resumed, "active_requests_at_end": after.get("specdec_active_requests"),
        "goals": {
            # The figure: delayed by no more than one request's time (its own median alone),
            # with 0.1 s of slack for a busy 2-core machine.
            "victim_delayed_at_most_one_request": bool(
                beside_s and len(beside_s) == len(beside) and delay is not None
                and delay <= baseline + 0.1),
            "nonreaders_cut_after_idle_timeout": cut == nonreaders,
            "nonreaders_resumable": len(complete) == len(resume_ids) and bool(resume_ids),
        },
    }


# ----------------------------------------------------------------------------------------------
# abort-storm
# ----------------------------------------------------------------------------------------------
async def _abort_one(host: str, port: int, body: bytes) -> str:
    """One SSE stream, dropped (RST) as soon as its first event arrived: its HTTP status or an error."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 30.0)
    try:
        writer.write(http_request(host, port, body))
        await writer.drain()
        status = (await asyncio.wait_for(reader.readline(), 60.0)).split(b" ")[1].decode()
        while True:
            line = await asyncio.wait_for(reader.readline(), 60.0)
            if not line or line.startswith(b"data:"):
                break
        return status
    except (TimeoutError, OSError, IndexError) as exc:
        return type(exc).__name__
    finally:
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()


def _openai_close(base_url: str, count: int) -> list[str]:
    """`count` streams through the official client, each closed (stream.close()) after one event."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60.0)
    out = []
    for _ in range(count):
        try:
            stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT_TEXT, max_tokens=400,
                                               stream=True, temperature=1.0, extra_body={"ignore_eos": True})
            next(iter(stream))
            stream.close()
            out.append("closed")
        except openai.OpenAIError as exc:
            out.append(type(exc).__name__)
    client.close()
    return out


ABORT_METRICS = ("specdec_active_requests", "specdec_http_active_requests", "specdec_admitted_requests")
ENGINE_METRICS = ("specdec_active_sessions", "specdec_sessions_created_total",
                  "specdec_sessions_released_total")


async def abort_storm(workdir: Path, models: br.Models, size: Size, progress: br.Say) -> dict[str, Any]:
    args = ["--http-port", "0", "--served-model-name", MODEL_NAME, "--metrics-port", "0"]
    stack = br.Stack(models, workdir, store_url=None, engine_args=[*ENGINE_ARGS, "--metrics-port", "0"],
                     orchestrator_args=args)
    progress("abort-storm: starting drafter, verifier, orchestrator (HTTP door, metrics) …")
    try:
        stack.start()
        host, port = http_address(stack)

        def snapshot() -> dict[str, Any]:
            orchestrator = scrape(metrics_url(stack, "orchestrator"))
            snap: dict[str, Any] = {"orchestrator": pick(orchestrator, *ABORT_METRICS)}
            for role in ("drafter", "verifier"):
                snap[role] = pick(scrape(metrics_url(stack, role)), *ENGINE_METRICS)
            return snap

        before = snapshot()
        progress(f"  {size.aborted_streams} SSE streams, dropped after their first event "
                 f"({size.abort_concurrency} at a time) …")
        gate = asyncio.Semaphore(size.abort_concurrency)
        body = completion_body(max_tokens=400)
        done = 0
        start = time.monotonic()

        async def one() -> str:
            nonlocal done
            async with gate:
                status = await _abort_one(host, port, body)
            done += 1
            if done % 100 == 0:
                progress(f"    {done} aborted")
            return status

        statuses = await asyncio.gather(*(one() for _ in range(size.aborted_streams)))
        storm_s = time.monotonic() - start
        after_raw = snapshot()

        async def until_zero(limit_s: float) -> tuple[float | None, list[dict[str, Any]]]:
            """Seconds until no run is active and the engines hold no more sessions than before."""
            since, timeline = time.monotonic(), []
            while time.monotonic() - since < limit_s:
                snap = await asyncio.to_thread(snapshot)
                active = snap["orchestrator"]["specdec_active_requests"]
                sessions = {r: snap[r]["specdec_active_sessions"] for r in ("drafter", "verifier")}
                timeline.append({"t": round(time.monotonic() - since, 2), "active_requests": active,
                                 "engine_sessions": sessions})
                held_before = {r: before[r]["specdec_active_sessions"] or 0 for r in ("drafter", "verifier")}
                if (active or 0) == 0 and all((sessions[r] or 0) <= held_before[r] for r in held_before):
                    return time.monotonic() - since, timeline
                await asyncio.sleep(0.1)
            return None, timeline

        zero_after_raw, timeline_raw = await until_zero(15.0)
        progress(f"  {size.openai_closes} streams closed through the openai package …")
        base_url = f"http://{host}:{port}/v1"
        closes = await asyncio.to_thread(_openai_close, base_url, size.openai_closes)
        at_once = snapshot()
        zero_after, timeline = await until_zero(15.0)
        after = snapshot()
        # Still serving: one more stream, read to its end.
        ok_status, ok_seconds, _ = await timed_generate(stack.address("orchestrator"),
                                                        seeded(unique("after-storm"), 1, 16, "token"), 60.0)
    finally:
        stack.stop()

    def created_minus_released(snap: dict[str, Any], role: str) -> float | None:
        c, r = snap[role]["specdec_sessions_created_total"], snap[role]["specdec_sessions_released_total"]
        return None if c is None or r is None else c - r

    return {
        "aborted_streams": size.aborted_streams, "storm_seconds": round(storm_s, 2),
        "first_event_statuses": dict(collections.Counter(statuses)),
        "openai_stream_close": dict(collections.Counter(closes)),
        "before": before, "after_raw_aborts": after_raw, "at_once": at_once, "after": after,
        "timeline_after_raw_aborts": timeline_raw, "timeline_after_closes": timeline,
        "seconds_until_back_to_zero_after_raw_aborts": None if zero_after_raw is None
        else round(zero_after_raw, 2),
        "sessions_created_during": {r: (after[r]["specdec_sessions_created_total"] or 0)
                                    - (before[r]["specdec_sessions_created_total"] or 0)
                                    for r in ("drafter", "verifier")},
        "seconds_until_back_to_zero_after_closes": None if zero_after is None else round(zero_after, 2),
        "sessions_not_released": {r: created_minus_released(after, r) for r in ("drafter", "verifier")},
        "request_after_storm": {"status": ok_status, "seconds": round(ok_seconds, 3)},
        "goals": {
            # "At once": within a second of the last abort (a disconnect is noticed asynchronously).
            "back_to_zero_within_1s_after_raw_aborts": zero_after_raw is not None and zero_after_raw <= 1.0,
            "back_to_zero_within_1s_after_closes": zero_after is not None and zero_after <= 1.0,
            "engine_sessions_back_to_before": all(
                (after[r]["specdec_active_sessions"] or 0) <= (before[r]["specdec_active_sessions"] or 0)
                for r in ("drafter", "verifier")),
            "still_serving": ok_status == "OK",
        },
    }


# ----------------------------------------------------------------------------------------------
# template-bomb
# ----------------------------------------------------------------------------------------------
BOMBS = {
    "nested loops (10^10 iterations)":
        "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
    "10 MB template": "{{ messages[0]['content'] }}" + "x" * (10 * 2**20),
    "1 GB output ('x' * 10**9)": "{{ 'x' * 1000000000 }}",
}


class RssWatch:
    """Samples a process's RSS every 50 ms; SIGKILLs it past `cap_mb` (the machine must survive the
    'before' of a memory bomb)."""

    def __init__(self, pid: int, cap_mb: float) -> None:
        self.pid, self.cap_mb = pid, cap_mb
        self.peak_mb = 0.0
        self.killed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                rss = psutil.Process(self.pid).memory_info().rss / 2**20
            except psutil.Error:
                return
            self.peak_mb = max(self.peak_mb, rss)
            if rss > self.cap_mb:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.killed = True
                return
            self._stop.wait(0.05)

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _rss_mb(pid: int | None) -> float | None:
    import psutil

    try:
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    except (psutil.Error, TypeError, ValueError):
        return None


async def template_bomb(workdir: Path, models: br.Models, size: Size, progress: br.Say) -> dict[str, Any]:
    insecure = has_flag("--insecure-engine", "serve", "verifier")
    args = ["verifier", "--model", str(models.target), "--port", "0", "--threads", "1", *ENGINE_ARGS]
    if insecure:
        args.append("--insecure-engine")
    supervisor = processes.Supervisor(workdir / "bomb-logs")
    cases = []
    try:
        for name, template in BOMBS.items():
            child = supervisor.start(supervisor.child("verifier", args))
            progress(f"template-bomb: a fresh verifier (no token{', --insecure-engine' if insecure else ''}) "
                     f"for: {name} …")
            try:
                processes.wait_ready(child, br.STARTUP_TIMEOUT_S)
            except processes.ProcessError as exc:
                cases.append({"name": name, "status": "VERIFIER_DID_NOT_START",
                              "detail": " ".join(str(exc).split())[-300:]})
                continue
            address = child.address
            assert address is not None
            async with grpc.aio.insecure_channel(address, options=[
                    ("grpc.max_send_message_length", 64 * 2**20),
                    ("grpc.max_receive_message_length", 64 * 2**20)]) as channel:
                tokenize = channel.unary_unary("/specdec.v1.VerifierService/Tokenize",
                                               request_serializer=verifier_pb2.TokenizeRequest.SerializeToString,
                                               response_deserializer=verifier_pb2.TokenizeResponse.FromString)
                apply = channel.unary_unary("/specdec.v1.VerifierService/ApplyChatTemplate",
                                            request_serializer=verifier_pb2.ChatTemplateRequest.SerializeToString,
                                            response_deserializer=verifier_pb2.TokenizeResponse.FromString)
                alone = []
                for _ in range(10):
                    t = time.monotonic()
                    await tokenize(verifier_pb2.TokenizeRequest(text=PROMPT_TEXT), timeout=30.0)
                    alone.append(time.monotonic() - t)
                rss_before = _rss_mb(child.pid)
                beside: list[float] = []
                beside_status: list[str] = []
                stop = asyncio.Event()

                async def tokenizer_client(stop: asyncio.Event, tokenize: Any, beside: list[float],
                                           beside_status: list[str]) -> None:
                    while not stop.is_set():
                        t = time.monotonic()
                        try:
                            await tokenize(verifier_pb2.TokenizeRequest(text=PROMPT_TEXT), timeout=10.0)
                            beside_status.append("OK")
                        except grpc.aio.AioRpcError as exc:
                            beside_status.append(exc.code().name)
                        beside.append(time.monotonic() - t)
                        await asyncio.sleep(0.1)

                others = asyncio.create_task(tokenizer_client(stop, tokenize, beside, beside_status))
                request = verifier_pb2.ChatTemplateRequest(
                    messages=[common_pb2.ChatMessage(role="user", content="hi")], chat_template=template)
                assert child.pid is not None
                with RssWatch(child.pid, size.bomb_rss_cap_mb) as watch:
                    t = time.monotonic()
                    try:
                        reply = await apply(request, timeout=size.bomb_timeout_s)
                        status, detail = "OK", f"{len(reply.token_ids)} token ids"
                    except grpc.aio.AioRpcError as exc:
                        status, detail = exc.code().name, " ".join((exc.details() or "").split())[:200]
                    bomb_s = time.monotonic() - t
                    await asyncio.sleep(1.0)  # the Tokenize calls just after the bomb's answer
                    stop.set()
                    await others
                alive = child.alive()
                rss_after = _rss_mb(child.pid) if alive else None
            case = {"name": name, "template_bytes": len(template), "status": status, "detail": detail,
                    "seconds": round(bomb_s, 3), "killed_by_harness_rss_cap": watch.killed,
                    "verifier_alive_after": alive, "rss_mb_before": rss_before, "rss_mb_after": rss_after,
                    "rss_mb_peak": round(watch.peak_mb, 1), "tokenize_alone_s": summary(alone),
                    "tokenize_beside_s": summary(beside),
                    "tokenize_beside_statuses": dict(collections.Counter(beside_status))}
            progress(f"  {json.dumps(case)}")
            cases.append(case)
            supervisor.stop(grace=2.0)
            supervisor = processes.Supervisor(workdir / "bomb-logs")
    finally:
        supervisor.stop(grace=2.0)
    # DEADLINE_EXCEEDED is the harness's own deadline running out: no answer, so no refusal.
    refused = [c for c in cases if c.get("status") in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED",
                                                        "FAILED_PRECONDITION")]
    return {
        "flags": {"--insecure-engine": insecure}, "rss_cap_mb": size.bomb_rss_cap_mb,
        "bomb_deadline_s": size.bomb_timeout_s, "cases": cases,
        "goals": {
            "bombs_refused_with_a_status": len(refused) == len(BOMBS),
            "bombs_answered_within_10s": all(c.get("seconds", 1e9) <= 10.0 for c in cases),
            "verifier_survived": all(c.get("verifier_alive_after") and not c.get("killed_by_harness_rss_cap")
                                     for c in cases),
            "tokenize_beside_under_1s": all((c.get("tokenize_beside_s") or {}).get("max") is not None
                                            and c["tokenize_beside_s"]["max"] <= 1.0 for c in cases),
            "rss_growth_under_256mb": all(c.get("rss_mb_after") is not None
                                          and c.get("rss_mb_before") is not None
                                          and c["rss_mb_after"] - c["rss_mb_before"] < 256 for c in cases),
        },
    }


# ----------------------------------------------------------------------------------------------
# log-flood
# ----------------------------------------------------------------------------------------------
def bad_bodies() -> list[tuple[str, bytes, str]]:
    """(kind, body, content type) of requests the HTTP door must refuse with a 4xx."""
    ok = {"model": MODEL_NAME, "prompt": PROMPT_TEXT, "max_tokens": 4}
    return [
        ("not JSON", b"{not json", "application/json"),
        ("wrong type", json.dumps({**ok, "max_tokens": "many"}).encode(), "application/json"),
        ("no prompt", json.dumps({"model": MODEL_NAME}).encode(), "application/json"),
        ("unknown model", json.dumps({**ok, "model": "nope"}).encode(), "application/json"),
        ("n too large", json.dumps({**ok, "n": 1000}).encode(), "application/json"),
        ("negative temperature", json.dumps({**ok, "temperature": -1}).encode(), "application/json"),
        ("not an object", b"[1, 2, 3]", "application/json"),
    ]


class _Connection(http.client.HTTPConnection):
    """No Nagle: headers and body go out at once (else each request waits out a delayed ACK)."""

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _flood(host: str, port: int, count: int, token: str | None,
           kinds: list[tuple[str, bytes, str]]) -> dict[str, Any]:
    """`count` bad requests on one keep-alive connection: statuses, and how often the server closed it."""
    conn = _Connection(host, port, timeout=30)
    statuses: collections.Counter[int] = collections.Counter()
    closed = 0
    conn.connect()
    for i in range(count):
        kind, body, ctype = kinds[i % len(kinds)]
        headers = {"Content-Type": ctype}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        sock_before = conn.sock
        try:
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            reply = conn.getresponse()
            reply.read()
        except (http.client.HTTPException, OSError):  # closed without saying so: count it, go on
            closed += 1
            statuses[0] += 1
            conn.close()
            conn.connect()
            continue
        statuses[reply.status] += 1
        if reply.will_close or conn.sock is None or conn.sock is not sock_before:
            closed += 1
            conn.close()
            conn.connect()
    conn.close()
    return {"requests": count, "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "connection_closed_by_server": closed}


async def log_flood(workdir: Path, models: br.Models, size: Size, progress: br.Say) -> dict[str, Any]:
    token = "hostile-bench-token"
    token_file = workdir / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    args = ["--http-port", "0", "--served-model-name", MODEL_NAME, "--auth-token-file", str(token_file)]
    stack = br.Stack(models, workdir, store_url=None, engine_args=ENGINE_ARGS, orchestrator_args=args)
    progress("log-flood: starting drafter, verifier, orchestrator (HTTP door with a token) …")
    try:
        stack.start()
        host, port = http_address(stack)
        log_path = stack.children["orchestrator"].log_path
        await asyncio.sleep(1.0)
        size_before = log_path.stat().st_size
        progress(f"  {size.bad_requests} bad requests (with the token) …")
        t = time.monotonic()
        bad = await asyncio.to_thread(_flood, host, port, size.bad_requests, token, bad_bodies())
        bad["seconds"] = round(time.monotonic() - t, 2)
        await asyncio.sleep(1.0)
        size_mid = log_path.stat().st_size
        progress(f"  {size.unauthenticated} unauthenticated requests …")
        t = time.monotonic()
        unauth = await asyncio.to_thread(_flood, host, port, size.unauthenticated, None,
                                         [("no token", completion_body(max_tokens=4, stream=False),
                                           "application/json")])
        unauth["seconds"] = round(time.monotonic() - t, 2)
        await asyncio.sleep(1.0)
        size_after = log_path.stat().st_size
        with open(log_path, "rb") as handle:
            handle.seek(size_before)
            flood_log = handle.read().decode(errors="replace")
        # And a good request still works.
        good = await asyncio.to_thread(_good_request, host, port, token)
    finally:
        stack.stop()
    lines = flood_log.splitlines()
    bad["log_bytes"], unauth["log_bytes"] = size_mid - size_before, size_after - size_mid
    total = size.bad_requests + size.unauthenticated
    return {
        "bad": bad, "unauthenticated": unauth,
        "log_bytes_per_bad_request": round((size_after - size_before) / total, 2),
        "log_lines": len(lines), "tracebacks": flood_log.count("Traceback"),
        "log_sample": lines[:5], "good_request_after": good,
        "goals": {
            "log_bytes_per_bad_request_under_100": (size_after - size_before) / total < 100,
            "no_traceback": "Traceback" not in flood_log,
            "keep_alive_survived": bad["connection_closed_by_server"] == 0
            and unauth["connection_closed_by_server"] == 0,
            "all_4xx": all(400 <= int(code) < 500 for code in [*bad["statuses"], *unauth["statuses"]]),
            "good_request_after": good == 200,
        },
    }


def _good_request(host: str, port: int, token: str) -> int:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request("POST", "/v1/completions", body=completion_body(max_tokens=4, stream=False),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    reply = conn.getresponse()
    reply.read()
    conn.close()
    return reply.status


# ----------------------------------------------------------------------------------------------
# supervisor
# ----------------------------------------------------------------------------------------------
async def _streams_through(address: str, ids: Sequence[str], tokens: int,
                           timeout_s: float) -> tuple[list[asyncio.Task[br.Stream]], bool]:
    """Seeded ERSD streams (seed 1000 + i), started; whether every one of them received tokens in time.

    The fault comes only once each stream has its first token (or has ended): a stream is in flight
    once its record is stored, and its first chunk goes out only after a save. One that has not got
    that far is still a new request, which a hung store fails at once (UNAVAILABLE, no record, so
    Resume finds nothing) and a killed orchestrator never stored. Waiting for the first stream alone
    let the fault land before the other's record on a loaded host: 1 lost, not a grace overrun.
    """
    started = [asyncio.Event() for _ in ids]
    tasks = [asyncio.create_task(stream_with_timeout(address, seeded(rid, 1000 + i, tokens), i, started[i],
                                                     timeout_s)) for i, rid in enumerate(ids)]

    async def begun(event: asyncio.Event, task: asyncio.Task[br.Stream]) -> None:
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()

    try:
        await asyncio.wait_for(asyncio.gather(*map(begun, started, tasks)), 60.0)
    except TimeoutError:
        pass
    return tasks, all(event.is_set() for event in started)


async def _finish(address: str, streams: Sequence[br.Stream], references: Sequence[list[int]], tokens: int,
                  deadline_s: float) -> dict[str, Any]:
    """Resume every stream that did not complete; compare each final output with its reference."""
    broken = [s for s in streams if not (s.status == "OK" and s.result is not None)]
    answers = dict(zip([s.request_id for s in broken], await asyncio.gather(
        *(resume_until(address, s.request_id, deadline_s) for s in broken)), strict=True))
    finals = [s.result if s.request_id not in answers else answers[s.request_id][0] for s in streams]
    resume_statuses = [status for _, status, _ in answers.values()]
    resume_seconds = [seconds for _, _, seconds in answers.values()]
    complete = [f is not None and len(f) == tokens for f in finals]
    equal = [f == ref for f, ref in zip(finals, references, strict=True)]
    prefix = [f is not None and f[:len(s.tokens)] == s.tokens for f, s in zip(finals, streams, strict=True)]
    return {"stream_statuses": dict(collections.Counter(s.status for s in streams)),
            "completed_without_resume": sum(s.status == "OK" for s in streams),
            "resume_statuses": dict(collections.Counter(resume_statuses)),
            "resume_seconds": summary(resume_seconds),
            "lost": sum(not c for c in complete), "equal_to_undisturbed_run": sum(equal),
            "received_tokens_a_prefix": sum(prefix)}


async def supervisor(workdir: Path, models: br.Models, size: Size, progress: br.Say) -> dict[str, Any]:
    with RedisProcess(workdir / "redis") as redis:
        ready, logs = workdir / "up.ready.json", workdir / "up-logs"
        argv = processes.cli_command(
            "up", "--draft", str(models.draft), "--target", str(models.target), "--dtype", "float32",
            "--no-batching", "--no-pin", "--port", "0", "--drafter-port", "0", "--verifier-port", "0",
            "--no-http", "--store-url", redis.url, "--ready-file", str(ready), "--log-dir", str(logs))
        env = {**os.environ, **processes.CHILD_ENV_DEFAULTS, "SPECDEC_RESUME_LEASE_SECONDS": "2"}
        progress("supervisor: specdec up (tiny models, Redis store) …")
        up_log = open(workdir / "up.log", "wb")  # noqa: SIM115 - closed below
        up = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=up_log, stderr=subprocess.STDOUT,
                              env=env, start_new_session=True)
        phases: list[dict[str, Any]] = []
        try:
            deadline = time.monotonic() + br.STARTUP_TIMEOUT_S
            while processes.read_ready_file(ready) is None:
                if up.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"specdec up did not start: {(workdir / 'up.log').read_text()[-2000:]}")
                await asyncio.sleep(0.2)
            info = processes.read_ready_file(ready) or {}
            address = info["orchestrator"]
            addresses = {"orchestrator": address, "drafter": info["drafter"], "verifier": info["verifier"]}
            progress(f"  up is serving on {address}; the undisturbed runs …")
            references = [(await timed_generate(address, seeded(unique(f"sup-ref-{i}"), 1000 + i,
                                                                size.kill_tokens), 300.0))[2]
                          for i in range(size.kill_clients)]
            for round_ in range(size.kill_rounds):
                for role in ("drafter", "verifier", "orchestrator"):
                    if up.poll() is not None:
                        phases.append({"role": role, "round": round_ + 1, "skipped": "specdec up had exited"})
                        continue
                    progress(f"  kill -9 the {role} (round {round_ + 1}) while {size.kill_clients} clients "
                             "stream …")
                    ids = [unique(f"sup-{role}-{round_}-{i}") for i in range(size.kill_clients)]
                    tasks, began = await _streams_through(address, ids, size.kill_tokens, 120.0)
                    pid = (processes.read_ready_file(logs / f"{role}.ready.json") or {}).get("pid")
                    if pid:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                    await asyncio.sleep(0.3)  # past the kill: its health check cannot answer SERVING now
                    back_task = asyncio.create_task(br.wait_health(addresses[role], "SERVING", 90.0))
                    streams = await asyncio.gather(*tasks)
                    back = await back_task
                    serving = await br.wait_health(address, "SERVING", 30.0)
                    outcome = await _finish(address, streams, references, size.kill_tokens, 90.0)
                    phase = {"role": role, "round": round_ + 1, "streams_had_begun": began, "killed_pid": pid,
                             "seconds_until_back": None if back is None else round(0.3 + back, 2),
                             "orchestrator_serving_after_s": None if serving is None else round(serving, 2),
                             "up_running": up.poll() is None, **outcome}
                    progress(f"    {json.dumps(phase)}")
                    phases.append(phase)
        finally:
            up_running = up.poll() is None
            if up_running:
                up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=30)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait(timeout=10)
            up_log.close()
    ran = [p for p in phases if "skipped" not in p]
    return {
        "clients": size.kill_clients, "tokens": size.kill_tokens, "rounds": size.kill_rounds,
        "phases": phases,
        "up_kept_running": up_running, "up_exit_code": up.returncode,
        "up_log_tail": (workdir / "up.log").read_text(errors="replace")[-1500:],
        "goals": {
            "up_kept_running": up_running and len(ran) == len(phases),
            "no_request_lost": bool(ran) and all(p["lost"] == 0 for p in ran),
            "resumed_equal_to_undisturbed": bool(ran) and all(
                p["equal_to_undisturbed_run"] == size.kill_clients for p in ran),
            "every_service_back": bool(ran) and all(p["seconds_until_back"] is not None for p in ran),
        },
    }


# ----------------------------------------------------------------------------------------------
# redis-hang
# ----------------------------------------------------------------------------------------------
class RedisProcess:
    """A redis-server on a fixed free port that can be paused (SIGSTOP), killed and restarted with its
    data (append-only file, fsync always: a restart keeps every stored record)."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        self.binary, self.workdir, self.port = binary, workdir, br.free_port()
        self.proc: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10.0
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port),
                                                                         timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(timeout=10)

    def __enter__(self) -> RedisProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def _probe_during(address: str, seconds: float, label: str) -> list[dict[str, Any]]:
    """New 8-token requests, one after another, for `seconds`: what a new client meets meanwhile."""
    out: list[dict[str, Any]] = []
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        at = time.monotonic() - start
        status, took, _ = await timed_generate(address, seeded(unique(f"probe-{label}"), 7, 8, "token"),
                                               timeout_s=seconds + 30.0)
        out.append({"at_s": round(at, 2), "status": status, "seconds": round(took, 3)})
        await asyncio.sleep(0.5)
    return out


async def _until_new_request_works(address: str, limit_s: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        status, _, _ = await timed_generate(address, seeded(unique("recover"), 7, 4, "token"), 10.0)
        if status == "OK":
            return time.monotonic() - start
        await asyncio.sleep(0.1)
    return None


async def redis_hang(workdir: Path, models: br.Models, size: Size, progress: br.Say) -> dict[str, Any]:
    phases = []
    with RedisProcess(workdir / "redis") as redis:
        # The goals hold for hangs shorter than the store's outage grace (each stop lasts its
        # hang plus the last probe's store timeout, up to about 2.5 s more): set it here, not
        # left to a SPECDEC_STORE_OUTAGE_GRACE_S in the environment.
        stack = br.Stack(models, workdir, store_url=redis.url, engine_args=ENGINE_ARGS,
                         orchestrator_args=["--store-outage-grace", f"{HANG_OUTAGE_GRACE_S:g}"],
                         env={"SPECDEC_RESUME_LEASE_SECONDS": "2"})
        progress("redis-hang: starting drafter, verifier, orchestrator (Redis store) …")
        try:
            stack.start()
            address = stack.address("orchestrator")
            references = [(await timed_generate(address, seeded(unique(f"redis-ref-{i}"), 1000 + i,
                                                                size.hang_tokens), 300.0))[2]
                          for i in range(size.hang_clients)]
            for fault in [*(f"SIGSTOP {s:g} s" for s in size.hangs_s), "kill -9 and restart"]:
                progress(f"  {fault} while {size.hang_clients} clients stream …")
                ids = [unique(f"redis-{len(phases)}-{i}") for i in range(size.hang_clients)]
                tasks, began = await _streams_through(address, ids, size.hang_tokens, 120.0)
                if fault.startswith("SIGSTOP"):
                    hang = float(fault.split()[1])
                    redis.signal(signal.SIGSTOP)
                    probes = await _probe_during(address, hang, "hang")
                    redis.signal(signal.SIGCONT)
                else:
                    redis.kill()
                    probes = await _probe_during(address, 2.0, "down")
                    redis.start()
                back_at = time.monotonic()
                recovery = await _until_new_request_works(address, 60.0)
                streams = await asyncio.gather(*tasks)
                outcome = await _finish(address, streams, references, size.hang_tokens, 60.0)
                phase = {"fault": fault, "streams_had_begun": began, "new_requests_meanwhile": probes,
                         "seconds_until_a_new_request_works": None if recovery is None
                         else round(recovery, 2),
                         "in_flight_seconds_after_fault": summary([s.ended_at - back_at for s in streams]),
                         **outcome}
                progress(f"    {json.dumps(phase)}")
                phases.append(phase)
        finally:
            stack.stop()
    return {
        "clients": size.hang_clients, "tokens": size.hang_tokens, "phases": phases,
        "goals": {
            # A new request meets a bounded wait: an answer (OK or UNAVAILABLE) within 5 s.
            "new_requests_answered_within_5s": all(p["seconds"] <= 5.0 for ph in phases
                                                   for p in ph["new_requests_meanwhile"]),
            "no_in_flight_hang": all("HARNESS_TIMEOUT" not in ph["stream_statuses"] for ph in phases),
            # Streams in flight ride out a hang or restart shorter than the store's outage grace.
            "in_flight_streams_completed": all(ph["completed_without_resume"] == size.hang_clients
                                               for ph in phases),
            "recovered_within_5s": all(ph["seconds_until_a_new_request_works"] is not None
                                       and ph["seconds_until_a_new_request_works"] <= 5.0 for ph in phases),
            "resumed_exact": all(ph["lost"] == 0 and ph["equal_to_undisturbed_run"] == size.hang_clients
                                 for ph in phases),
        },
    }


# ----------------------------------------------------------------------------------------------
# running and reporting
# ----------------------------------------------------------------------------------------------
Scenario = Callable[[Path, br.Models, Size, br.Say], Awaitable[dict[str, Any]]]
RUNNERS: dict[str, Scenario] = {"slow-reader": slow_reader, "abort-storm": abort_storm,
                                "template-bomb": template_bomb, "log-flood": log_flood,
                                "supervisor": supervisor, "redis-hang": redis_hang}


def run_scenario(name: str, *, quick: bool = False, models: br.Models | None = None,
                 progress: br.Say = br.say) -> dict[str, Any]:
    """One scenario in a temporary folder: its results, with `seconds` (its wall time)."""
    size = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix=f"specdec-{name}-") as tmp:
        workdir = Path(tmp)
        if models is None:
            progress("building tiny models …")
            models = br.tiny_models(workdir / "models")
        start = time.monotonic()
        results = asyncio.run(RUNNERS[name](workdir, models, size, progress))
    results["seconds"] = round(time.monotonic() - start, 1)
    results["size"] = "quick" if quick else "full"
    return results


def render(name: str, results: dict[str, Any]) -> str:
    """A short markdown table per scenario (docs/reliability.md quotes these)."""
    rows: list[tuple[str, str]] = []
    r = results
    if name == "slow-reader":
        n = r["nonreaders"]
        rows = [("non-readers", f"{n['http_connections']} HTTP × n={n['streams_each']} SSE + "
                                f"{n['grpc_streams']} gRPC streams of {n['max_tokens']} tokens"),
                ("well-behaved client alone (median / max s)", _mm(r["victim_alone_s"])),
                ("… beside the non-readers (median / max s)", _mm(r["victim_beside_s"])),
                ("… sent when the non-readers held no slot (s)", str(r.get("nonreaders_settled_s", "—"))),
                ("… its statuses beside them", _counts(r["victim_beside_statuses"])),
                ("request slots held while they were open (median / max)", _mm(r["slots_held_while_open"])),
                ("slots held after the idle timeout", str(r["slots_held_after_idle_timeout"])),
                ("SSE bytes the server's kernel held unsent for the HTTP non-readers (Send-Q)",
                 str(r.get("http_bytes_queued_in_the_kernel_after_the_victim"))),
                ("HTTP non-readers after the idle timeout", _counts(r["http_outcomes"])),
                ("gRPC non-readers after the idle timeout", _counts(r["grpc_outcomes"])),
                ("resumed (sample)", ", ".join(f"{x['status']} {x['tokens']} tokens" for x in r["resumed"]))]
    elif name == "abort-storm":
        b, a, o = r["before"], r["after"], r["at_once"]
        rows = [("streams aborted after the first event", f"{r['aborted_streams']} raw + "
                 f"{_counts(r['openai_stream_close'])} (openai stream.close()) in {r['storm_seconds']} s"),
                ("specdec_active_requests before / after the raw aborts / after the closes / end",
                 " / ".join(_n(x["orchestrator"]["specdec_active_requests"])
                            for x in (b, r["after_raw_aborts"], o, a))),
                ("seconds until back to zero after the raw aborts / after the closes",
                 f"{r['seconds_until_back_to_zero_after_raw_aborts']} / "
                 f"{r['seconds_until_back_to_zero_after_closes']}"),
                *((f"{role}: sessions held before / after; created during; created − released",
                   f"{_n(b[role]['specdec_active_sessions'])} / {_n(a[role]['specdec_active_sessions'])}; "
                   f"{_n(r['sessions_created_during'][role])}; {_n(r['sessions_not_released'][role])}")
                  for role in ("drafter", "verifier")),
                ("a request after the storm", f"{r['request_after_storm']['status']} in "
                 f"{r['request_after_storm']['seconds']} s")]
    elif name == "template-bomb":
        rows = [(c["name"], f"{c['status']} after {c.get('seconds', '—')} s ({c.get('detail', '')}); RSS "
                 f"{c.get('rss_mb_before')} → {c.get('rss_mb_after')} MB (peak {c.get('rss_mb_peak')}"
                 f"{', killed at the harness cap' if c.get('killed_by_harness_rss_cap') else ''}); Tokenize "
                 f"beside: {_mm(c.get('tokenize_beside_s') or {})} s, alone "
                 f"{_mm(c.get('tokenize_alone_s') or {})} s")
                for c in r["cases"]]
    elif name == "log-flood":
        rows = [(label, f"{x['requests']}: {_counts(x['statuses'])}, {x['log_bytes']} log bytes, closed by "
                        f"the server {x['connection_closed_by_server']}×")
                for label, x in (("bad requests (token sent)", r["bad"]),
                                 ("unauthenticated", r["unauthenticated"]))]
        rows += [("log bytes per bad request", str(r["log_bytes_per_bad_request"])),
                 ("tracebacks in the log", str(r["tracebacks"])),
                 ("a good request afterwards", str(r["good_request_after"]))]
    elif name == "supervisor":
        for p in r["phases"]:
            label = f"kill -9 {p['role']} (round {p['round']})"
            if "skipped" in p:
                rows.append((label, p["skipped"]))
                continue
            rows.append((label, f"streams {_counts(p['stream_statuses'])}; lost {p['lost']}; equal to the "
                         f"undisturbed run {p['equal_to_undisturbed_run']}/{r['clients']}; back after "
                         f"{p['seconds_until_back']} s; resumes {_counts(p['resume_statuses']) or '—'}; "
                         f"up running: {p['up_running']}"))
        rows.append(("`up` kept running", f"{r['up_kept_running']} (exit code {r['up_exit_code']})"))
    elif name == "redis-hang":
        for p in r["phases"]:
            probes = p["new_requests_meanwhile"]
            rows.append((p["fault"], f"in flight: {_counts(p['stream_statuses'])}; new requests meanwhile: "
                         f"{_counts(collections.Counter(x['status'] for x in probes))}, max "
                         f"{max((x['seconds'] for x in probes), default=0):.2f} s; a new request works "
                         f"{p['seconds_until_a_new_request_works']} s after; lost {p['lost']}, equal to the "
                         f"undisturbed run {p['equal_to_undisturbed_run']}/{r['clients']}"))
    goals = ", ".join(f"{k}: {'yes' if v else '**no**'}" for k, v in r["goals"].items())
    lines = ["| | measured |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "", f"Goals: {goals}."]
    return "\n".join(lines) + "\n"


def _mm(s: dict[str, Any]) -> str:
    return "—" if not s or s.get("median") is None else f"{s['median']:.3f} / {s['max']:.3f}"


def _n(value: float | None) -> str:
    """A metric's value (absent: no series yet, i.e. 0)."""
    return "0" if value is None else f"{value:g}"


def _counts(counts: dict[Any, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


if __name__ == "__main__":  # pragma: no cover - python -m bench.bench_reliability is the entry point
    sys.exit("run: python -m bench.bench_reliability SCENARIO (--help)")
