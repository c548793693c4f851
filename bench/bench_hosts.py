"""Drafter and verifier a round trip away: tok/s against the one-way delay, with and without look-ahead.

The product's point is drafter and verifier on their own hosts. This sandbox has no `tc netem`, so
the delay is a userspace relay (bench/delay_proxy.py) in front of each engine: `specdec up` starts
the drafter and the verifier as a user gets them (pinned to their cores), and for each delay the
benchmark starts a second orchestrator (`specdec serve orchestrator`) that reaches both engines
through relays adding --delays-ms each way. Every request goes to that orchestrator; up's own
orchestrator stays idle.

    python -m bench.bench_hosts                                   # 0, 0.5 and 2 ms, open prompts
    python -m bench.bench_hosts --delays-ms 0,2 --rounds 2 --out bench/results/hosts-DATE

Configurations per delay (each prompt, in this order):
    model        draft_source "model" with the look-ahead (pipeline on, the default): the drafter
                 pre-drafts the next block while the verifier checks this one
    model-seq    the same with pipeline off: draft, then verify, one after the other
    default      a request with no knobs (draft source hybrid: model-free drafts, the model, or
                 target-only steps, whichever pays)

Reported: tok/s (median over prompts and rounds), iterations and milliseconds per iteration, and
what the relay adds to one round trip (2 × delay, plus the relay's own time, measured with a Health
call through it before each delay's runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.delay_proxy import DelayProxy
from bench.machine import cpu_model
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

CONFIGS = {"model": ("model", True), "model-seq": ("model", False), "default": (None, None)}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def start_orchestrator(drafter: str, verifier: str, token_file: Path, folder: Path, name: str,
                       timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    ready = folder / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    log = (folder / f"{name}.log").open("w")
    env = {**os.environ, "SPECDEC_USE_CALIBRATION": "false", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "orchestrator", "--drafter", drafter, "--verifier",
         verifier, "--port", "0", "--engine-token-file", str(token_file), "--ready-file", str(ready)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"orchestrator {name} did not start; see {folder / (name + '.log')}")
        time.sleep(0.2)
    return process, json.loads(ready.read_text())["address"]


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


async def round_trip_ms(address: str, repeats: int = 20) -> float:
    """Median milliseconds of a gRPC health check through the relay (the relay's added latency)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


async def one(address: str, ids: list[int], config: str, max_new_tokens: int, temperature: float) -> dict:
    from specdec.client import AsyncClient
    from specdec.generation import GenerationRequest
    from specdec.sampling_params import SamplingParams

    source, pipeline = CONFIGS[config]
    request = GenerationRequest(prompt_ids=list(ids), max_new_tokens=max_new_tokens, stop_token_ids=[],
                                sampling=SamplingParams(temperature=temperature), draft_source=source,
                                pipeline=pipeline)
    client = AsyncClient(address, timeout_s=900)
    try:
        began = time.perf_counter()
        result = await client.generate(request)
        seconds = time.perf_counter() - began
    finally:
        await client.close()
    iterations = result.stats.iterations
    return {"tokens": len(result.token_ids), "seconds": seconds, "iterations": iterations,
            "tok_s": len(result.token_ids) / seconds, "ms_per_iteration": 1e3 * seconds / max(1, iterations)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.bench_serving import SpecdecServer
    from bench.grounded_prompts import prompt_ids, workload_items
    from specdec.models import resolve_model
    from specdec.runtime.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(args.target))
    items = workload_items(["open"], args.per_kind)["open"]
    prompts = {item.id: prompt_ids(item, tokenizer, 1024) for item in items}
    up_args = ["--draft", args.draft, "--target", args.target, "--dtype", args.dtype]
    server = SpecdecServer("up", up_args, args.out)
    say(f"starting specdec up ({args.draft} → {args.target}, {args.dtype})")
    server.start()
    rows: list[dict[str, Any]] = []
    round_trips: dict[str, float] = {}
    try:
        token_file = Path(server.info["log_dir"]) / "engine.token"  # up's engines accept its bearer token
        for delay in args.delays_ms:
            drafter = DelayProxy(_host_port(server.info["drafter"]), delay / 1e3).start()
            verifier = DelayProxy(_host_port(server.info["verifier"]), delay / 1e3).start()
            name = f"orchestrator-{delay:g}ms"
            process, address = start_orchestrator(drafter.address, verifier.address, token_file, args.out,
                                                  name)
            try:
                round_trips[f"{delay:g}"] = asyncio.run(round_trip_ms(verifier.address))
                say(f"delay {delay:g} ms each way: a health check through the relay takes "
                    f"{round_trips[f'{delay:g}']:.2f} ms")
                first = next(iter(prompts.values()))
                for config in CONFIGS:  # warm-up, not counted
                    asyncio.run(one(address, first, config, args.warmup_tokens, args.temperature))
                for rnd in range(args.rounds):
                    for item_id, ids in prompts.items():
                        for config in CONFIGS:
                            row = asyncio.run(one(address, ids, config, args.max_new_tokens,
                                                  args.temperature))
                            row.update(delay_ms=delay, config=config, prompt=item_id, round=rnd)
                            rows.append(row)
                            say(f"{delay:g} ms {config:9s} {item_id}: {row['tok_s']:.2f} tok/s, "
                                f"{row['iterations']} iterations, {row['ms_per_iteration']:.1f} ms each")
            finally:
                stop(process)
                drafter.stop()
                verifier.stop()
    finally:
        server.stop()
    return {"rows": rows, "round_trip_ms": round_trips}


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row in rows:
        cell = out.setdefault(f"{row['delay_ms']:g}", {}).setdefault(row["config"], {"tok_s": [], "ms": []})
        cell["tok_s"].append(row["tok_s"])
        cell["ms"].append(row["ms_per_iteration"])
    return {delay: {config: {"tok_s": statistics.median(v["tok_s"]),
                             "ms_per_iteration": statistics.median(v["ms"]), "runs": len(v["tok_s"])}
                    for config, v in configs.items()}
            for delay, configs in out.items()}


def render(results: dict[str, Any], meta: dict[str, Any]) -> str:
    summary = summarize(results["rows"])
    lines = [f"# Drafter and verifier a round trip away ({meta['date']})", "",
             f"Command: `{meta['command']}`", "",
             f"Machine: {meta['machine']}. {meta['draft']} → {meta['target']} at {meta['dtype']}, "
             f"{meta['max_new_tokens']} tokens, T = {meta['temperature']:g}, open prompts, "
             f"{meta['rounds']} round(s).", "",
             "| one-way delay | health check through the relay | " + " | ".join(
                 f"{c} tok/s (ms/iteration)" for c in CONFIGS) + " |",
             "|---:|---:|" + "---:|" * len(CONFIGS)]
    for delay, configs in summary.items():
        cells = [f"{configs[c]['tok_s']:.2f} ({configs[c]['ms_per_iteration']:.1f})" if c in configs else "–"
                 for c in CONFIGS]
        lines.append(f"| {delay} ms | {results['round_trip_ms'].get(delay, float('nan')):.2f} ms | "
                     + " | ".join(cells) + " |")
    lines += ["", "model: draft model with the look-ahead (pipeline); model-seq: the same without it; "
              "default: a request with no knobs (hybrid)."]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.bench_hosts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays-ms", type=lambda s: [float(x) for x in s.split(",") if x.strip()],
                   default=[0.0, 0.5, 2.0], help="one-way delays to run, comma-separated (default 0,0.5,2)")
    p.add_argument("--draft", default=DEFAULT_DRAFT_MODEL)
    p.add_argument("--target", default=DEFAULT_TARGET_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--per-kind", type=int, default=1, help="open prompts per kind (code, chat, prose)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=None, help="folder for hosts.md, results.json and logs")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if any(d < 0 for d in args.delays_ms) or not args.delays_ms:
        parser().error("--delays-ms must list delays ≥ 0")
    args.out = args.out or Path(tempfile.mkdtemp(prefix="specdec-hosts-"))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{cpu_model()}, {os.cpu_count()} cores",
            "command": "python -m bench.bench_hosts " + " ".join(argv), "draft": args.draft,
            "target": args.target,
            "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "rounds": args.rounds}
    results = run(args)
    text = render(results, meta)
    (args.out / "hosts.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, **results}, indent=1))
    print(text)
    say(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
