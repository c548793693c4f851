"""Cost of tracing and metrics: the same generations with observability off and on.

Modes (interleaved round by round, so that drift of a shared machine hits all of them alike):
  off       no observer, no interceptors (what runs unless --trace-file / OTLP / --metrics-port)
  metrics   Prometheus metrics of the loop and the engines
  file      tracing to a JSON-lines --trace-file (loop spans, gRPC spans, engine spans)
  otlp      tracing over OTLP/gRPC to `specdec trace-collect` in another process
  all       file tracing + metrics
Transports: inprocess (engines in this process) and grpc (drafter and verifier servers in this
process, every call over loopback gRPC with the interceptors, like the real deployment minus
the process boundary). Default models: tiny random ones (forward passes of ~1 ms, so the
per-iteration overhead shows at its largest); --draft/--target take real model folders.

Usage: python bench/bench_tracing.py [--rounds 5] [--requests 4] [--tokens 32] [--method token]
       [--transport inprocess grpc] [--draft DIR --target DIR] [--out bench/results/tracing.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for _key in [k for k in os.environ if k.startswith("OTEL_")]:
    del os.environ[_key]  # the benchmark decides where spans go

import torch  # noqa: E402

from orchestrator import metrics  # noqa: E402
from orchestrator.speculation import Orchestrator  # noqa: E402
from orchestrator.tracing import combine_observers, configure_tracing  # noqa: E402
from specdec.generation import GenerationRequest  # noqa: E402

MODES = ("off", "metrics", "file", "otlp", "all")


@dataclass
class Sample:
    iterations: int = 0
    tokens: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    spans: int = 0


@dataclass
class Result:
    per_round: dict[str, list[Sample]] = field(default_factory=lambda: {m: [] for m in MODES})


class Collector:
    """`trace-collect` in its own process (the OTLP receiver of the otlp mode)."""

    def __init__(self, workdir: Path) -> None:
        self.out = workdir / "otlp.jsonl"
        ready = workdir / "collect.ready.json"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specdec.cli.observability", "trace-collect", "--port", "0", "--out",
             str(self.out), "--ready-file", str(ready), "--duration", "3600"],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 120
        while not ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("trace-collect did not start")
            time.sleep(0.1)
        self.endpoint = f"127.0.0.1:{json.loads(ready.read_text())['port']}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


async def _run_mode(mode: str, transport: str, engines, requests, workdir: Path, collector: Collector | None,
                    round_no: int) -> Sample:
    from drafter_service.server import start_drafter_server
    from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient
    from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
    from specdec.rpc.grpc_support import stop_server
    from verifier_service.server import start_verifier_server

    drafter, verifier = engines
    tracing = None
    trace_file = workdir / f"{mode}-{transport}-{round_no}.jsonl"
    if mode in ("file", "all"):
        tracing = configure_tracing("specdec-bench", trace_file=trace_file)
    elif mode == "otlp":
        assert collector is not None
        tracing = configure_tracing("specdec-bench", otlp_endpoint=collector.endpoint)
    om = em = None
    if mode in ("metrics", "all"):
        registry = metrics.new_registry()
        om, em = metrics.OrchestratorMetrics(registry), metrics.EngineMetrics(registry)
        em.watch_engine("drafter", drafter)
        em.watch_engine("verifier", verifier)
    observer = combine_observers(tracing.loop_observer() if tracing else None, om)
    servers = []
    if transport == "grpc":
        server_icpt = tracing.server_interceptors() if tracing else []
        client_icpt = tracing.client_interceptors() if tracing else []

        def observers(role: str) -> list:
            return [o for o in (tracing.service_observer(role) if tracing else None,
                                em.observer(role) if em else None) if o is not None]

        dserver, dport = await start_drafter_server(drafter, interceptors=server_icpt,
                                                    observers=observers("drafter"))
        vserver, vport = await start_verifier_server(verifier, interceptors=server_icpt,
                                                     observers=observers("verifier"))
        servers = [dserver, vserver]
        dclient = GrpcDrafterClient(f"127.0.0.1:{dport}", interceptors=client_icpt)
        vclient = GrpcVerifierClient(f"127.0.0.1:{vport}", interceptors=client_icpt)
    else:
        dclient, vclient = InProcessDrafterClient(drafter), InProcessVerifierClient(verifier)
    orch = Orchestrator(dclient, vclient, observer=observer)
    await orch.start()
    sample = Sample()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for request in requests:
        result = await orch.generate(request)
        sample.iterations += result.stats.iterations
        sample.tokens += result.stats.new_tokens
    sample.wall, sample.cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    await orch.close()
    for server in servers:
        await stop_server(server, 0)
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)  # flushing is outside the timed part, as in a server
    if trace_file.exists():
        sample.spans = sum(1 for _ in trace_file.open())
    return sample


def _load_engines(draft: str | None, target: str | None, workdir: Path):
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine
    from specdec.runtime.loading import load_model

    if draft is None or target is None:
        from specdec.runtime.tiny import save_tiny_model

        draft = str(save_tiny_model(workdir / "draft", vocab_size=8, seed=1, max_position_embeddings=1024))
        target = str(save_tiny_model(workdir / "target", vocab_size=8, seed=2, max_position_embeddings=1024))
    engines = DrafterEngine(load_model(draft, threads=1)), VerifierEngine(load_model(target, threads=1))
    return (*engines, draft, target)


def _row(mode: str, samples: list[Sample], base: list[Sample]) -> str:
    def per_iter(s: Sample, attr: str) -> float:
        return getattr(s, attr) / s.iterations * 1000

    wall = statistics.median(per_iter(s, "wall") for s in samples)
    cpu = statistics.median(per_iter(s, "cpu") for s in samples)
    base_wall = statistics.median(per_iter(s, "wall") for s in base)
    base_cpu = statistics.median(per_iter(s, "cpu") for s in base)
    tps = statistics.median(s.tokens / s.wall for s in samples)
    spans = statistics.median(s.spans / s.iterations for s in samples) if samples[0].spans else 0.0
    cells = [mode, f"{wall:.3f}", f"{100 * (wall / base_wall - 1):+.1f}%",
             f"{1000 * (wall - base_wall):+.0f}", f"{cpu:.3f}",
             f"{100 * (cpu / base_cpu - 1):+.1f}%", f"{1000 * (cpu - base_cpu):+.0f}",
             f"{tps:.1f}", f"{spans:.1f}"]
    return "| " + " | ".join(cells) + " |"


# ---------------------------------------------------------------------------- micro-benchmarks


def _fake_record(index: int):
    from specdec.generation import IterationRecord

    now = time.time()
    return IterationRecord(request_id="bench", index=index, position=10 + index, method="token", k=4,
                           drafted=True, num_drafted=4, accepted=2, emitted=[1, 2, 3], start=now,
                           end=now + 0.01, draft_intervals=[(now, now + 0.004)],
                           verify_intervals=[(now + 0.004, now + 0.01)], overlap_seconds=0.0)


def _time_loop_hooks(observer, iterations: int) -> tuple[float, float]:
    """(wall, CPU) µs per iteration in the loop's observer hooks (one draft and one verify call).

    CPU time is the whole process's, so the batch span processor's export thread counts too.
    """
    wall0, cpu0 = time.perf_counter(), time.process_time()
    probe = observer.request_started("bench", lambda perf: perf, {"method": "token", "k": 4})
    for index in range(iterations):
        start = time.perf_counter()
        with probe.iteration(index, start) as it:
            for kind in ("draft", "verify"):
                token = it.call_started(kind, kind, time.perf_counter())
                it.call_finished(token, time.perf_counter(), None)
            it.finished(_fake_record(index), 4)
    probe.finished(None, None)
    if hasattr(observer, "flush"):
        observer.flush()  # the export of these spans is part of their cost
    return ((time.perf_counter() - wall0) / iterations * 1e6,
            (time.process_time() - cpu0) / iterations * 1e6)


async def _time_rpc(engine, interceptors: tuple[list, list], observers: list,
                    calls: int) -> tuple[float, float]:
    """(wall, CPU) µs per unary gRPC round trip (Info) on loopback, client and server in this process."""
    from drafter_service.server import start_drafter_server
    from orchestrator.clients.grpc_client import GrpcDrafterClient
    from specdec.rpc.grpc_support import stop_server

    server, port = await start_drafter_server(engine, interceptors=interceptors[0], observers=observers)
    client = GrpcDrafterClient(f"127.0.0.1:{port}", interceptors=interceptors[1])
    try:
        for _ in range(20):
            await client.info()
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            await client.info()
        return ((time.perf_counter() - wall0) / calls * 1e6, (time.process_time() - cpu0) / calls * 1e6)
    finally:
        await client.close()
        await stop_server(server, 0)


class _Flushing:
    """A loop observer whose spans are flushed at the end of a timing (their export included)."""

    def __init__(self, inner, tracing) -> None:
        self.inner, self.tracing = inner, tracing

    def request_started(self, request_id, epoch, attributes):
        return self.inner.request_started(request_id, epoch, attributes)

    def flush(self) -> None:
        self.tracing.force_flush()


def micro_benchmarks(engine, workdir: Path, repeats: int = 5) -> list[str]:
    from orchestrator.tracing import LoopTracer

    tracing = configure_tracing("specdec-bench", trace_file=workdir / "micro.jsonl")
    om = metrics.OrchestratorMetrics(metrics.new_registry())
    loop_cases = {
        "loop hooks per iteration: a do-nothing observer (the calls themselves)": _NullObserver(),
        "loop hooks per iteration: tracing (request + iteration + 2 call spans) to a trace file":
            _Flushing(LoopTracer(tracing.tracer), tracing),
        "loop hooks per iteration: metrics": om,
    }
    rpc_cases = {
        "unary gRPC round trip on loopback, no interceptors": (([], []), []),
        "unary gRPC round trip, tracing interceptors on both sides (client + server span)":
            ((tracing.server_interceptors(), tracing.client_interceptors()), []),
    }
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in [*loop_cases, *rpc_cases]}
    for _ in range(repeats):  # interleaved, so that load changes hit every case alike
        for name, observer in loop_cases.items():
            timings[name].append(_time_loop_hooks(observer, 2000))
        for name, (interceptors, observers) in rpc_cases.items():
            timings[name].append(asyncio.run(_time_rpc(engine, interceptors, observers, 300)))
    tracing.shutdown()
    out = ["## hooks and RPCs alone", "",
           "The same costs without any model work, so that machine noise does not hide them: medians "
           f"of {repeats} interleaved repeats, the loop hooks over 2000 synthetic iterations (spans flushed "
           "to the file within the timing), the RPCs over 300 `Info` calls with client and server in one "
           "process.", "",
           "| what | wall µs | CPU µs |", "|---|---:|---:|"]
    for name, values in timings.items():
        wall = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        out.append(f"| {name} | {wall:.0f} | {cpu:.0f} |")
    return out + [""]


class _NullObserver:
    """The cheapest possible LoopObserver: what the hook calls cost by themselves."""

    def request_started(self, request_id, epoch, attributes):
        return self

    def iteration(self, index, start):
        import contextlib

        return contextlib.nullcontext(self)

    def call_started(self, kind, op, start):
        return None

    def call_finished(self, token, end, error):
        return None

    def finished(self, *args):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--method", default="token")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--transport", nargs="+", default=["inprocess", "grpc"],
                        choices=["inprocess", "grpc"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--draft")
    parser.add_argument("--target")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--no-micro", action="store_true", help="Skip the hooks-and-RPCs micro-benchmarks.")
    args = parser.parse_args()
    torch.set_num_threads(1)

    workdir = Path(tempfile.mkdtemp(prefix="specdec-bench-tracing-"))
    drafter, verifier, draft, target = _load_engines(args.draft, args.target, workdir)
    a = 0.5 if args.method == "rd" else None
    requests = [GenerationRequest(prompt_ids=[1, 2, 3, 4 + i % 3], max_new_tokens=args.tokens,
                                  method=args.method, k=args.k, a=a, seed=100 + i, stop_token_ids=[])
                for i in range(args.requests)]
    collector = Collector(workdir) if "otlp" in args.modes else None
    results: dict[str, Result] = {t: Result() for t in args.transport}
    load0 = os.getloadavg()
    try:
        for transport in args.transport:  # warm-up (imports, first gRPC channel, allocator)
            asyncio.run(_run_mode("off", transport, (drafter, verifier), requests[:1], workdir, collector,
                                  -1))
        for round_no in range(args.rounds):
            for transport in args.transport:
                for mode in args.modes:
                    sample = asyncio.run(_run_mode(mode, transport, (drafter, verifier), requests, workdir,
                                                   collector, round_no))
                    results[transport].per_round[mode].append(sample)
                    ms = sample.wall / sample.iterations * 1000
                    print(f"round {round_no} {transport:9s} {mode:7s} {ms:.3f} ms/iteration "
                          f"({sample.iterations} iterations)", file=sys.stderr)
    finally:
        if collector is not None:
            collector.stop()

    lines = [
        "# Cost of tracing and metrics",
        "",
        f"Command: `{' '.join(['python bench/bench_tracing.py', *sys.argv[1:]])}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} logical cores, torch {torch.__version__} "
        f"(1 thread), Python {platform.python_version()}; load average at the start {load0[0]:.1f}, "
        f"{load0[1]:.1f}, {load0[2]:.1f} (a shared machine: CPU time is the steadier figure).",
        f"Models: draft `{Path(draft).name}`, target `{Path(target).name}`"
        + (" (tiny random Qwen2, vocab 8: forward passes of about a millisecond, the worst case for a fixed "
           "per-iteration overhead)" if args.draft is None else "") + ".",
        f"Workload per mode and round: {args.requests} requests × {args.tokens} new tokens, method "
        f"{args.method}, k {args.k}; {args.rounds} rounds, modes interleaved within each round; figures are "
        "medians over rounds. Span export (batch processor thread) is not excluded: it runs concurrently, "
        "as it would in a server; only the final flush at shutdown is outside the timed part. CPU time is "
        "this process's (all its threads; the otlp mode's collector runs in another process).",
        "",
    ]
    for transport, result in results.items():
        base = result.per_round["off"] if "off" in result.per_round and result.per_round["off"] else None
        lines += [f"## transport: {transport}", "",
                  "| mode | wall ms / iteration | vs off | wall µs / iteration | CPU ms / iteration | vs off "
                  "| CPU µs / iteration | tokens / s | spans / iteration |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for mode in args.modes:
            samples = result.per_round[mode]
            if samples and base:
                lines.append(_row(mode, samples, base))
        lines.append("")
    if not args.no_micro:
        lines += micro_benchmarks(drafter, workdir)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
