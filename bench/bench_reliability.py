"""Reliability figures: kill -9 each service while clients generate, and a memory soak.

    python -m bench.bench_reliability kill --clients 8 --out bench/results/reliability-DATE/
    python -m bench.bench_reliability soak --clients 8 --minutes 10 --out bench/results/reliability-DATE/

The three services run as separate `specdec serve` processes (specdec.cli.processes, the code
`specdec up` uses), the orchestrator's store in a real redis-server on a free port. Models: tiny
random ones built from a config (the default: what is measured here is the services' behaviour,
not the models'), or any pair by --draft/--target.

kill: three phases, each with N concurrent streaming clients (seeded, T = 1, EOS ignored):
  drafter       kill -9 the drafter mid-request: every request must complete, and (ERSD, whose
                target-only steps draw the same races) equal the seeded target-only run.
  verifier      kill -9 the verifier mid-request: how long until each client gets its status (and
                which), until the orchestrator's health says NOT_SERVING, and, after the verifier is
                restarted on its port, until it says SERVING again (the orchestrator is not restarted).
  orchestrator  kill -9 the orchestrator mid-request (Redis store): restart it, Resume every request;
                the tokens a client had received must be a prefix of the resumed result, and the
                result must equal the uninterrupted seeded run.
soak: N closed-loop clients for --minutes; the RSS of each service every --sample-seconds; the
  growth over the second half (least-squares slope, MB/min) says whether memory is flat.

Hostile clients (issue 29; bench/reliability_hostile.py, each bounded to a few minutes, --quick to
about one; each result has a `goals` section, true or false as measured):
  slow-reader    4 HTTP connections × n=16 SSE streams and 8 gRPC streams that never read, beside a
                 well-behaved client: its delay against its baseline, slots held, whether the
                 non-readers are cut after --stream-idle-timeout and can be resumed.
  abort-storm    1,000 SSE streams dropped after their first event + 10 closed with the openai
                 package's stream.close(): specdec_active_requests and engine sessions before / after.
  template-bomb  nested-loop, 10 MB and 1 GB-output caller templates to ApplyChatTemplate on a
                 verifier without a token, Tokenize calls beside: answers, latencies, RSS (the
                 harness kills a verifier past 3 GB RSS).
  log-flood      1,000 malformed and 300 unauthenticated HTTP requests: log bytes per request,
                 tracebacks, whether keep-alive survived.
  supervisor     `specdec up`; kill -9 drafter, verifier, orchestrator twice each while seeded clients
                 stream: requests lost, resumed outputs vs the undisturbed run, recovery, `up` alive.
  redis-hang     SIGSTOP the store's redis-server 8 s and 20 s during streams, then kill -9 and restart
                 it: in-flight outcomes, new requests meanwhile, recovery, resumed exactness.
  hostile        all six, one after the other.

Figures go to OUT/MODE.json and .md; docs/reliability.md quotes them with this command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.cli import processes
from specdec.rpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

STARTUP_TIMEOUT_S = 240.0
# The hostile-client scenarios (bench.reliability_hostile.SCENARIOS, named here to keep imports one-way).
HOSTILE = ("slow-reader", "abort-storm", "template-bomb", "log-flood", "supervisor", "redis-hang")
CALL_TIMEOUT_S = 300.0
Say = Callable[[str], None]


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# the services
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10.0
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@dataclass
class Models:
    draft: Path
    target: Path


def tiny_models(root: Path) -> Models:
    from specdec.runtime.tiny import save_tiny_model

    def save(name: str, seed: int) -> Path:
        return save_tiny_model(root / name, vocab_size=32, seed=seed, hidden_size=32,
                               max_position_embeddings=2048)

    return Models(draft=save("draft", 1), target=save("target", 2))


class Stack:
    """Drafter, verifier and orchestrator as `specdec serve` processes on free ports."""

    def __init__(self, models: Models, workdir: Path, *, store_url: str | None, threads: int = 1,
                 engine_args: Sequence[str] = (), orchestrator_args: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.supervisor = processes.Supervisor(workdir / "logs")
        self.env = {**os.environ, **(env or {})}
        self.models = models
        self.store_url = store_url
        self.threads = threads
        self.engine_args = list(engine_args)
        self.orchestrator_args = list(orchestrator_args)
        self.children: dict[str, processes.Child] = {}

    def start(self) -> None:
        common = ["--port", "0", "--threads", str(self.threads), *self.engine_args]
        for role, model in (("drafter", self.models.draft), ("verifier", self.models.target)):
            self.children[role] = self.supervisor.start(self.supervisor.child(
                role, [role, "--model", str(model), *common]), self.env)
        for role in ("drafter", "verifier"):
            processes.wait_ready(self.children[role], STARTUP_TIMEOUT_S)
        args = ["orchestrator", "--drafter", self.address("drafter"), "--verifier", self.address("verifier"),
                "--port", "0", *self.orchestrator_args]
        if self.store_url:
            args += ["--store-url", self.store_url]
        self.children["orchestrator"] = self.supervisor.start(self.supervisor.child("orchestrator", args),
                                                              self.env)
        processes.wait_ready(self.children["orchestrator"], STARTUP_TIMEOUT_S)

    def address(self, role: str) -> str:
        address = self.children[role].address
        assert address is not None
        return address

    def kill(self, role: str) -> float:
        """SIGKILL the service; returns the monotonic time of the kill."""
        child = self.children[role]
        assert child.process is not None
        child.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        child.process.wait(timeout=30)
        return killed_at

    def restart(self, role: str, wait: bool = True) -> processes.Child:
        """Start a killed service again on the port it had (its peers keep the address)."""
        fresh = self.supervisor.restart(self.children[role], self.env)
        fresh.address = self.children[role].address
        self.children[role] = fresh
        if wait:
            processes.wait_ready(fresh, STARTUP_TIMEOUT_S)
        return fresh

    def rss_mb(self) -> dict[str, float]:
        import psutil

        out = {}
        for role, child in self.children.items():
            with contextlib.suppress(psutil.NoSuchProcess, TypeError):
                out[role] = psutil.Process(child.pid).memory_info().rss / 2**20
        return out

    def stop(self) -> None:
        self.supervisor.stop(grace=5.0)


# ----------------------------------------------------------------------------------------------
# clients
# ----------------------------------------------------------------------------------------------
@dataclass
class Stream:
    """What one streaming client saw."""

    client: int
    request_id: str
    tokens: list[int] = field(default_factory=list)
    result: list[int] | None = None
    status: str = "OK"
    details: str = ""
    ended_at: float = 0.0  # monotonic


def request(client: int, *, request_id: str, method: str, max_new_tokens: int, prompt_ids: Sequence[int],
            seed: int) -> generation_pb2.GenerationRequest:
    return generation_pb2.GenerationRequest(
        prompt_ids=common_pb2.TokenIds(ids=list(prompt_ids)), max_new_tokens=max_new_tokens,
        stop_token_ids=common_pb2.TokenIds(ids=[]), seed=seed, method=method, request_id=request_id,
        sampling=common_pb2.SamplingParams(temperature=1.0))


async def stream_one(address: str, req: generation_pb2.GenerationRequest, client: int,
                     started: asyncio.Event | None = None, timeout_s: float = CALL_TIMEOUT_S) -> Stream:
    out = Stream(client, req.request_id)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        try:
            async for chunk in stub.GenerateStream(req, timeout=timeout_s):
                out.tokens += list(chunk.token_ids)
                if started is not None and out.tokens:
                    started.set()
                if chunk.HasField("result"):
                    out.result = list(chunk.result.token_ids)
        except grpc.aio.AioRpcError as exc:
            out.status, out.details = exc.code().name, exc.details() or ""
    out.ended_at = time.monotonic()
    return out


async def generate_ids(address: str, req: generation_pb2.GenerationRequest) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return list((await stub.Generate(req, timeout=CALL_TIMEOUT_S)).token_ids)


async def resume_ids(address: str, request_id: str, lease_timeout_s: float = 60.0) -> tuple[list[int], float]:
    """Resume a request (as a client would: ABORTED means its dead run's lease has not run out yet,
    so try again shortly); returns its token ids and the seconds until the whole result was back
    (lease wait and the rest of the generation)."""
    started = time.monotonic()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        while True:
            try:
                reply = await stub.Resume(generation_pb2.ResumeRequest(request_id=request_id),
                                          timeout=CALL_TIMEOUT_S)
                return list(reply.token_ids), time.monotonic() - started
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.ABORTED or time.monotonic() - started > lease_timeout_s:
                    raise
            await asyncio.sleep(0.25)


async def health(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def wait_health(address: str, wanted: str, timeout_s: float) -> float | None:
    """Seconds until the health check says `wanted` (None: not within timeout_s)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await health(address) == wanted:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    return None


# ----------------------------------------------------------------------------------------------
# kill -9
# ----------------------------------------------------------------------------------------------
@dataclass
class KillSettings:
    clients: int = 8
    max_new_tokens: int = 400
    prompt_ids: tuple[int, ...] = (1, 2, 3, 4)


async def _clients(stack: Stack, settings: KillSettings, phase: str, method: str) -> tuple[
        list[asyncio.Task[Stream]], asyncio.Event]:
    """Start the phase's streaming clients; the event is set once one of them has received tokens."""
    started = asyncio.Event()
    tasks = [asyncio.create_task(stream_one(stack.address("orchestrator"), request(
        i, request_id=f"{phase}-{i}", method=method, max_new_tokens=settings.max_new_tokens,
        prompt_ids=settings.prompt_ids, seed=1000 + i), i, started)) for i in range(settings.clients)]
    await asyncio.wait_for(started.wait(), CALL_TIMEOUT_S)
    return tasks, started


def first_difference(a: Sequence[int] | None, b: Sequence[int]) -> int | None:
    """The first position where two outputs differ (None: equal)."""
    if a is None:
        return 0
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def kill_drafter(stack: Stack, settings: KillSettings) -> dict[str, Any]:
    """ERSD with the drafter killed mid-request vs the seeded target-only run. ERSD's output equals
    target-only race decoding exactly in exact arithmetic; through real engines a multi-token verify
    pass and a one-token pass can differ in the last float bits and, rarely, flip a race. So the same
    requests also run once with the drafter alive (the control): the kill must add no difference of
    its own (each killed run equals target-only, or first differs where its control does)."""
    address = stack.address("orchestrator")

    def req(client: int, request_id: str, method: str) -> generation_pb2.GenerationRequest:
        return request(client, request_id=request_id, method=method, max_new_tokens=settings.max_new_tokens,
                       prompt_ids=settings.prompt_ids, seed=1000 + client)

    references = await asyncio.gather(*(generate_ids(address, req(i, f"drafter-ref-{i}", "autoregressive"))
                                        for i in range(settings.clients)))
    controls = await asyncio.gather(*(generate_ids(address, req(i, f"drafter-control-{i}", "ersd"))
                                      for i in range(settings.clients)))
    tasks, _ = await _clients(stack, settings, "drafter", "ersd")
    stack.kill("drafter")
    streams = await asyncio.gather(*tasks)
    stack.restart("drafter")
    completed = [s.status == "OK" and s.result is not None and len(s.result) == settings.max_new_tokens
                 for s in streams]
    killed_diff = [first_difference(s.result, ref) for s, ref in zip(streams, references, strict=True)]
    control_diff = [first_difference(c, ref) for c, ref in zip(controls, references, strict=True)]
    unexplained = [k is not None and (c is None or k < c)
                   for k, c in zip(killed_diff, control_diff, strict=True)]
    return {"clients": len(streams), "completed": sum(completed),
            "equal_to_target_only": sum(d is None for d in killed_diff),
            "control_equal_to_target_only": sum(d is None for d in control_diff),
            "first_differences": {"killed": killed_diff, "control": control_diff},
            "differences_the_kill_added": sum(unexplained),
            "statuses": sorted({s.status for s in streams})}


async def kill_verifier(stack: Stack, settings: KillSettings) -> dict[str, Any]:
    address = stack.address("orchestrator")
    tasks, _ = await _clients(stack, settings, "verifier", "token")
    killed_at = stack.kill("verifier")
    not_serving_s = await wait_health(address, "NOT_SERVING", 30.0)
    streams = await asyncio.gather(*tasks)
    to_status = [s.ended_at - killed_at for s in streams]
    restarted_at = time.monotonic()
    stack.restart("verifier")
    verifier_ready_s = time.monotonic() - restarted_at
    serving_s = await wait_health(address, "SERVING", 60.0)
    after = await stream_one(address, request(0, request_id="verifier-after", method="token",
                                               max_new_tokens=16, prompt_ids=settings.prompt_ids, seed=7), 0)
    leaked = [s.details for s in streams if stack.address("verifier") in s.details]
    return {
        "clients": len(streams), "statuses": sorted({s.status for s in streams}),
        "seconds_to_status": {"median": statistics.median(to_status), "max": max(to_status)},
        "seconds_to_not_serving": not_serving_s, "verifier_restart_seconds": verifier_ready_s,
        "seconds_to_serving_after_restart": serving_s, "request_after_restart": after.status,
        "messages_with_the_verifier_address": len(leaked),
        "example_message": streams[0].details,
    }


async def kill_orchestrator(stack: Stack, settings: KillSettings) -> dict[str, Any]:
    tasks, _ = await _clients(stack, settings, "orchestrator", "token")
    await asyncio.sleep(0.5)  # let every client get some tokens
    stack.kill("orchestrator")
    streams = await asyncio.gather(*tasks)
    restarted_at = time.monotonic()
    stack.restart("orchestrator")
    restart_s = time.monotonic() - restarted_at
    address = stack.address("orchestrator")
    answers = await asyncio.gather(*(resume_ids(address, s.request_id) for s in streams))
    resumed = [ids for ids, _ in answers]
    references = await asyncio.gather(*(generate_ids(address, request(
        s.client, request_id=f"orchestrator-ref-{s.client}", method="token",
        max_new_tokens=settings.max_new_tokens, prompt_ids=settings.prompt_ids, seed=1000 + s.client))
        for s in streams))
    received = [len(s.tokens) for s in streams]
    prefix = [r[: len(s.tokens)] == s.tokens for s, r in zip(streams, resumed, strict=True)]
    equal = [r == ref for r, ref in zip(resumed, references, strict=True)]
    return {"clients": len(streams), "statuses_at_kill": sorted({s.status for s in streams}),
            "tokens_received_before_kill": {"min": min(received), "max": max(received)},
            "orchestrator_restart_seconds": restart_s,
            "seconds_to_resumed_result": {"max": max(wait for _, wait in answers)},
            "resumed_complete": sum(len(r) == settings.max_new_tokens for r in resumed),
            "received_tokens_are_a_prefix": sum(prefix), "equal_to_uninterrupted_run": sum(equal)}


async def run_kill(stack: Stack, settings: KillSettings, progress: Say = say) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, phase in (("drafter", kill_drafter), ("verifier", kill_verifier),
                        ("orchestrator", kill_orchestrator)):
        progress(f"kill -9 {name} with {settings.clients} clients generating …")
        results[name] = await phase(stack, settings)
        progress(f"  {json.dumps(results[name])}")
    return results


# ----------------------------------------------------------------------------------------------
# soak
# ----------------------------------------------------------------------------------------------
def slope_mb_per_minute(samples: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) samples, in MB per minute."""
    if len(samples) < 2:
        return 0.0
    xs, ys = [s for s, _ in samples], [m for _, m in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


async def run_soak(stack: Stack, *, clients: int, seconds: float, sample_seconds: float, max_new_tokens: int,
                   progress: Say = say) -> dict[str, Any]:
    address = stack.address("orchestrator")
    done, errors = 0, 0
    stop_at = time.monotonic() + seconds
    samples: list[tuple[float, dict[str, float]]] = []

    async def client(i: int) -> None:
        nonlocal done, errors
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            req = request(i, request_id=f"soak-{i}-{n}", method="token", max_new_tokens=max_new_tokens,
                          prompt_ids=(1, 2, 3, 1 + i % 6), seed=n)
            out = await stream_one(address, req, i)
            done += out.status == "OK"
            errors += out.status != "OK"

    async def sampler() -> None:
        start = time.monotonic()
        while time.monotonic() < stop_at:
            samples.append((time.monotonic() - start, stack.rss_mb()))
            progress(f"  soak t={samples[-1][0]:.0f}s rss MB {samples[-1][1]} done {done} errors {errors}")
            await asyncio.sleep(sample_seconds)
        samples.append((time.monotonic() - start, stack.rss_mb()))

    await asyncio.gather(sampler(), *(client(i) for i in range(clients)))
    half = [s for s in samples if s[0] >= samples[-1][0] / 2]
    roles = sorted(samples[0][1])
    return {
        "clients": clients, "seconds": seconds, "requests": done, "errors": errors,
        "rss_mb": {role: {"first": samples[0][1].get(role), "last": samples[-1][1].get(role),
                          "max": max(s[1].get(role, 0.0) for s in samples),
                          "slope_second_half_mb_per_min": slope_mb_per_minute(
                              [(t, s[role]) for t, s in half if role in s])} for role in roles},
        "samples": [{"t": t, **s} for t, s in samples],
    }


# ----------------------------------------------------------------------------------------------
# abuse
# ----------------------------------------------------------------------------------------------
@dataclass
class AbuseCase:
    name: str
    status: str
    seconds: float
    detail: str
    victim_p50_s: float | None = None  # another client's small requests while the case ran
    victim_max_s: float | None = None


async def _call(channel: grpc.aio.Channel, path: str, payload: bytes, timeout_s: float) -> tuple[str, str]:
    """One unary call with raw bytes (the caller serialises): its status name and details."""
    method = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    try:
        await method(payload, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or ""
    return "OK", ""


def abuse_payloads(stack: Stack) -> list[tuple[str, str, str, bytes]]:
    """(name, service role, method path, request bytes) of the abuse cases reproduced in issue 14."""
    from specdec.rpc.v1 import drafter_pb2

    def generate(**fields: Any) -> bytes:
        base: dict[str, Any] = {"prompt_ids": common_pb2.TokenIds(ids=[1, 2, 3]), "max_new_tokens": 8}
        base.update(fields)
        return generation_pb2.GenerationRequest(**base).SerializeToString()

    def text_prompt(mb: int) -> bytes:
        prompt = "t1 " * (mb * 2**20 // 3)
        return generation_pb2.GenerationRequest(prompt=prompt, max_new_tokens=8).SerializeToString()

    gen = "/specdec.v1.GenerationService/Generate"
    release = common_pb2.ReleaseRequest(session_id="victim/1").SerializeToString()
    lookahead = drafter_pb2.LookaheadRequest(session_id="abuse", base_len=0, append=[1, 2, 3], k=1000,
                                             bonus_guesses=16, rejection_guesses=16)
    return [
        ("direct Lookahead(k=1000, 16 + 16 guesses) on the drafter", "drafter",
         "/specdec.v1.DrafterService/Lookahead", lookahead.SerializeToString()),
        ("Release of a session the caller does not own, on the verifier", "verifier",
         "/specdec.v1.VerifierService/Release", release),
        ("20 MB text prompt", "orchestrator", gen, text_prompt(20)),
        ("50 MB text prompt", "orchestrator", gen, text_prompt(50)),
        ("8 MB request_id", "orchestrator", gen, generate(request_id="r" * 8 * 2**20)),
        ("200,000 stop strings", "orchestrator", gen, generate(stop=[f"s{i}" for i in range(200_000)])),
        ("malformed request bytes", "orchestrator", gen, b"\xff\xff\xff\xff garbage"),
        ("temperature 1e-46", "orchestrator", gen,
         generate(sampling=common_pb2.SamplingParams(temperature=1e-46))),
        ("a with the token method", "orchestrator", gen, generate(method="token", a=0.5)),
    ]


async def _victim(address: str, stop: asyncio.Event, latencies: list[float]) -> None:
    """Small requests one after another until `stop`: what another user sees meanwhile."""
    n = 0
    while not stop.is_set():
        n += 1
        start = time.monotonic()
        await generate_ids(address, request(0, request_id=f"victim-{time.time_ns()}-{n}", method="token",
                                            max_new_tokens=8, prompt_ids=(1, 2, 3), seed=n))
        latencies.append(time.monotonic() - start)


async def run_abuse(stack: Stack, progress: Say = say) -> dict[str, Any]:
    address = stack.address("orchestrator")
    baseline: list[float] = []
    stop = asyncio.Event()
    victim = asyncio.create_task(_victim(address, stop, baseline))
    await asyncio.sleep(3.0)
    stop.set()
    await victim
    cases = []
    for name, role, path, payload in abuse_payloads(stack):
        latencies: list[float] = []
        stop = asyncio.Event()
        victim = asyncio.create_task(_victim(address, stop, latencies))
        await asyncio.sleep(0.2)
        async with grpc.aio.insecure_channel(stack.address(role), options=[
                ("grpc.max_send_message_length", 128 * 2**20)]) as channel:
            start = time.monotonic()
            status, detail = await _call(channel, path, payload, 120.0)
            seconds = time.monotonic() - start
        await asyncio.sleep(0.5)  # the victim's next request, after the case
        stop.set()
        await victim
        case = AbuseCase(name, status, seconds, " ".join(detail.split())[:160],
                         statistics.median(latencies) if latencies else None, max(latencies, default=None))
        progress(f"  {case}")
        cases.append(vars(case))
    return {"victim_baseline_p50_s": statistics.median(baseline), "victim_baseline_max_s": max(baseline),
            "cases": cases}


def render_abuse(results: dict[str, Any]) -> str:
    lines = [f"Another client's 8-token requests alone: median {results['victim_baseline_p50_s']:.3f} s, "
             f"max {results['victim_baseline_max_s']:.3f} s.", "",
             "| case | status | time (s) | other client meanwhile: median / max (s) | message |",
             "|---|---|---:|---|---|"]
    for c in results["cases"]:
        victim = (f"{c['victim_p50_s']:.3f} / {c['victim_max_s']:.3f}" if c["victim_p50_s"] is not None
                  else "—")
        lines.append(f"| {c['name']} | {c['status']} | {c['seconds']:.3f} | {victim} | {c['detail']} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def render_kill(results: dict[str, Any]) -> str:
    d, v, o = results["drafter"], results["verifier"], results["orchestrator"]
    lines = [
        "| service killed (-9) | outcome |", "|---|---|",
        f"| drafter | {d['completed']}/{d['clients']} requests completed; {d['equal_to_target_only']}/"
        f"{d['clients']} equal to the seeded target-only run (the same requests with the drafter alive: "
        f"{d['control_equal_to_target_only']}/{d['clients']}); differences the kill added: "
        f"{d['differences_the_kill_added']} |",
        f"| verifier | clients got {', '.join(v['statuses'])} after {v['seconds_to_status']['median']:.2f} s "
        f"(median; max {v['seconds_to_status']['max']:.2f} s); NOT_SERVING after "
        f"{_s(v['seconds_to_not_serving'])}; SERVING {_s(v['seconds_to_serving_after_restart'])} after the "
        f"restarted verifier was up (no orchestrator restart); next request {v['request_after_restart']}; "
        f"{v['messages_with_the_verifier_address']} messages named the verifier's address |",
        f"| orchestrator (Redis store) | clients got {', '.join(o['statuses_at_kill'])} after "
        f"{o['tokens_received_before_kill']['min']}–{o['tokens_received_before_kill']['max']} tokens; "
        f"after a restart, Resume (retried while ABORTED: the dead run's lease had not run out) returned "
        f"every result within {o['seconds_to_resumed_result']['max']:.1f} s; completed "
        f"{o['resumed_complete']}/{o['clients']}; received tokens a "
        f"prefix in {o['received_tokens_are_a_prefix']}/{o['clients']}; equal to the uninterrupted run in "
        f"{o['equal_to_uninterrupted_run']}/{o['clients']} |",
    ]
    return "\n".join(lines) + "\n"


def render_soak(results: dict[str, Any]) -> str:
    lines = [f"{results['clients']} clients for {results['seconds'] / 60:.1f} min: {results['requests']} "
             f"requests, {results['errors']} errors", "",
             "| service | RSS first (MB) | RSS last (MB) | max (MB) | slope, second half (MB/min) |",
             "|---|---:|---:|---:|---:|"]
    for role, r in results["rss_mb"].items():
        lines.append(f"| {role} | {r['first']:.0f} | {r['last']:.0f} | {r['max']:.0f} | "
                     f"{r['slope_second_half_mb_per_min']:+.2f} |")
    return "\n".join(lines) + "\n"


def _s(value: float | None) -> str:
    return "never (timeout)" if value is None else f"{value:.2f} s"


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.bench_reliability", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("kill", "soak", "abuse", *HOSTILE, "hostile"),
                   help="What to measure (described above); hostile runs the six hostile-client scenarios.")
    p.add_argument("--quick", action="store_true",
                   help="Hostile scenarios: a reduced size (about a minute each; what the tests run).")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="Tokens per request (default: 400 for kill, 32 for soak).")
    p.add_argument("--minutes", type=float, default=10.0, help="soak: how long.")
    p.add_argument("--sample-seconds", type=float, default=15.0, help="soak: RSS sampling period.")
    p.add_argument("--draft", type=Path, default=None, help="Draft model directory (default: tiny).")
    p.add_argument("--target", type=Path, default=None, help="Target model directory (default: tiny).")
    p.add_argument("--engine-args", default="--dtype float32 --no-batching",
                   help="`serve drafter|verifier` arguments. float32 and unbatched by default, as the "
                   "recorded figures were measured; seeded outputs compare token for token (so they do "
                   "at the batch-invariant int8 default, docs/algorithms.md §14).")
    p.add_argument("--out", type=Path, default=None, help="Write MODE.json and MODE.md here.")
    return p


def run_hostile(args: argparse.Namespace, argv: Sequence[str] = (), progress: Say = say) -> dict[str, Any]:
    """One hostile-client scenario, or all six (mode hostile), each with its own services."""
    from bench import reliability_hostile as hostile

    names = HOSTILE if args.mode == "hostile" else (args.mode,)
    models = Models(args.draft, args.target) if args.draft and args.target else None
    everything: dict[str, Any] = {}
    command = "python -m bench.bench_reliability " + " ".join(argv)
    for name in names:
        progress(f"=== {name} ===")
        results = hostile.run_scenario(name, quick=args.quick, models=models, progress=progress)
        report = hostile.render(name, results)
        everything[name] = results
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name}.json").write_text(json.dumps({"mode": name, "command": command,
                                                               "results": results}, indent=2))
            (args.out / f"{name}.md").write_text(f"`{command}`\n\n{report}")
        progress(report)
    return everything


def run(args: argparse.Namespace, argv: Sequence[str] = (), progress: Say = say) -> dict[str, Any]:
    if args.mode in (*HOSTILE, "hostile"):
        return run_hostile(args, argv, progress)
    with tempfile.TemporaryDirectory(prefix="specdec-reliability-") as tmp:
        workdir = Path(tmp)
        if args.draft and args.target:
            models = Models(args.draft, args.target)
        else:
            progress("building tiny models …")
            models = tiny_models(workdir / "models")
        with redis_server(workdir) as url:
            stack = Stack(models, workdir, store_url=url, engine_args=args.engine_args.split())
            try:
                progress("starting drafter, verifier, orchestrator …")
                stack.start()
                if args.mode == "kill":
                    settings = KillSettings(clients=args.clients, max_new_tokens=args.max_new_tokens or 400)
                    results = asyncio.run(run_kill(stack, settings, progress))
                    report = render_kill(results)
                elif args.mode == "abuse":
                    results = asyncio.run(run_abuse(stack, progress))
                    report = render_abuse(results)
                else:
                    soak = run_soak(stack, clients=args.clients, seconds=args.minutes * 60,
                                    sample_seconds=args.sample_seconds,
                                    max_new_tokens=args.max_new_tokens or 32, progress=progress)
                    results = asyncio.run(soak)
                    report = render_soak(results)
            finally:
                stack.stop()
    results = {"mode": args.mode, "settings": {k: str(v) for k, v in vars(args).items()}, "results": results}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.mode}.json").write_text(json.dumps(results, indent=2))
        command = "python -m bench.bench_reliability " + " ".join(argv)
        (args.out / f"{args.mode}.md").write_text(f"`{command}`\n\n{report}")
    progress(report)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run(parser().parse_args(argv), argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
