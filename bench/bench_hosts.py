"""Drafter and verifier a round trip away: tok/s against the one-way delay, with and without look-ahead.

The product's point is drafter and verifier on their own hosts. Here the three services each get a
network namespace of their own (bench/netns.py), as if on three hosts: the drafter's and the
verifier's are linked to the orchestrator's by a veth pair each, and the benchmark (in the root
namespace) reaches the orchestrator's over a third pair; each pair is a /30 of 10.213.0.0/24, a
subnet only these namespaces use. This sandbox has no `tc netem`, so the delay is a userspace
relay (`python -m bench.delay_proxy`) run in the orchestrator's namespace in front of each engine:
every byte between the orchestrator and an engine crosses the relay (--delays-ms each way) and a
veth pair. The engines start as `specdec up` starts them (`specdec serve drafter|verifier` with
up's default cores and threads, a fresh engine token, ready files), each under `ip netns exec`,
listening on its namespace's address; for each delay the benchmark starts relays and an
orchestrator (`specdec serve orchestrator`) in the orchestrator's namespace, and sends every
request to it. All namespaces and veths are deleted at the end, also on an error or Ctrl-C.

Namespaces need root and `ip` (iproute2). Without them the benchmark says so and runs on loopback
(--no-netns chooses that; --netns insists on namespaces): `specdec up` starts the engines, and for
each delay a second orchestrator reaches them through relays on 127.0.0.1 (threads of this
process); up's own orchestrator stays idle.

    python -m bench.bench_hosts                                   # 0, 0.5 and 2 ms, open prompts
    python -m bench.bench_hosts --delays-ms 0,2 --rounds 2 --out bench/results/hosts-DATE
    python -m bench.bench_hosts --no-netns                        # all on loopback, one namespace

Configurations per delay (each prompt, in this order):
    model        draft_source "model" with the look-ahead (pipeline on, the default): the drafter
                 pre-drafts the next block while the verifier checks this one
    model-seq    the same with pipeline off: draft, then verify, one after the other
    default      a request with no knobs (draft source hybrid: model-free drafts, the model, or
                 target-only steps, whichever pays)

Reported (hosts.md, results.json; both say which network ran, namespaces or loopback, and its
addresses): tok/s (median over prompts and rounds), iterations and milliseconds per iteration, and
what one round trip through the relay costs (2 × delay, plus the relay's own time): a Health call
through the verifier's relay before each delay's runs, from the benchmark (with namespaces: across
the root ↔ orchestrator pair, the relay and the orchestrator ↔ verifier pair).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import netns
from bench.delay_proxy import DelayProxy, split_address
from bench.machine import cpu_model
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

CONFIGS = {"model": ("model", True), "model-seq": ("model", False), "default": (None, None)}
ROOT = Path(__file__).resolve().parents[1]
NAMESPACES, LOOPBACK = "namespaces", "loopback"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def start_orchestrator(
    drafter: str,
    verifier: str,
    token_file: Path,
    folder: Path,
    name: str,
    timeout_s: float = 120.0,
    *,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> tuple[subprocess.Popen, str]:
    """`specdec serve orchestrator` on `host`, any free port (run under `prefix`, e.g. `ip netns exec
    NAME`); returns it and its address once its ready file says it listens."""
    ready = folder / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    env = {**os.environ, "SPECDEC_USE_CALIBRATION": "false", "HF_HUB_OFFLINE": "1"}
    argv = [*prefix, sys.executable, "-m", "specdec.cli", "serve", "orchestrator", "--drafter", drafter]
    argv += ["--verifier", verifier, "--host", host, "--port", "0", "--engine-token-file", str(token_file)]
    with (folder / f"{name}.log").open("w") as log:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            [*argv, "--ready-file", str(ready)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
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
    request = GenerationRequest(
        prompt_ids=list(ids),
        max_new_tokens=max_new_tokens,
        stop_token_ids=[],
        sampling=SamplingParams(temperature=temperature),
        draft_source=source,
        pipeline=pipeline,
    )
    client = AsyncClient(address, timeout_s=900)
    try:
        began = time.perf_counter()
        result = await client.generate(request)
        seconds = time.perf_counter() - began
    finally:
        await client.close()
    iterations = result.stats.iterations
    return {
        "tokens": len(result.token_ids),
        "seconds": seconds,
        "iterations": iterations,
        "tok_s": len(result.token_ids) / seconds,
        "ms_per_iteration": 1e3 * seconds / max(1, iterations),
    }


def measure(
    address: str, health_address: str, prompts: dict[str, list[int]], args: argparse.Namespace, delay: float
) -> tuple[list[dict[str, Any]], float]:
    """One delay's runs against the orchestrator at `address` (the relays in place): the round trip
    of a health check through the relay at `health_address`, a warm-up, then every prompt and
    configuration for --rounds rounds."""
    round_trip = asyncio.run(round_trip_ms(health_address))
    say(f"delay {delay:g} ms each way: a health check through the relay takes {round_trip:.2f} ms")
    first = next(iter(prompts.values()))
    for config in CONFIGS:  # warm-up, not counted
        asyncio.run(one(address, first, config, args.warmup_tokens, args.temperature))
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for item_id, ids in prompts.items():
            for config in CONFIGS:
                row = asyncio.run(one(address, ids, config, args.max_new_tokens, args.temperature))
                row.update(delay_ms=delay, config=config, prompt=item_id, round=rnd)
                rows.append(row)
                say(
                    f"{delay:g} ms {config:9s} {item_id}: {row['tok_s']:.2f} tok/s, "
                    f"{row['iterations']} iterations, {row['ms_per_iteration']:.1f} ms each"
                )
    return rows, round_trip


def run_loopback(args: argparse.Namespace, prompts: dict[str, list[int]]) -> dict[str, Any]:
    """`specdec up` on loopback; per delay, relays (threads here) and a second orchestrator."""
    from bench.bench_serving import SpecdecServer

    up_args = ["--draft", args.draft, "--target", args.target, "--dtype", args.dtype]
    server = SpecdecServer("up", up_args, args.out)
    say(f"starting specdec up ({args.draft} → {args.target}, {args.dtype}) on loopback")
    server.start()
    rows: list[dict[str, Any]] = []
    round_trips: dict[str, float] = {}
    network: dict[str, Any] = {"mode": LOOPBACK, "engines": {}, "relays": {}}
    try:
        token_file = Path(server.info["log_dir"]) / "engine.token"  # up's engines accept its bearer token
        network["engines"] = {"drafter": server.info["drafter"], "verifier": server.info["verifier"]}
        for delay in args.delays_ms:
            drafter = DelayProxy(split_address(server.info["drafter"]), delay / 1e3).start()
            verifier = DelayProxy(split_address(server.info["verifier"]), delay / 1e3).start()
            name = f"orchestrator-{delay:g}ms"
            try:
                process, address = start_orchestrator(
                    drafter.address, verifier.address, token_file, args.out, name
                )
                try:
                    network["relays"][f"{delay:g}"] = {
                        "drafter": drafter.address,
                        "verifier": verifier.address,
                        "orchestrator": address,
                    }
                    delay_rows, round_trips[f"{delay:g}"] = measure(
                        address, verifier.address, prompts, args, delay
                    )
                    rows += delay_rows
                finally:
                    stop(process)
            finally:
                drafter.stop()
                verifier.stop()
    finally:
        server.stop()
    return {"rows": rows, "round_trip_ms": round_trips, "network": network}


def engine_placement() -> dict[str, list[str]]:
    """The cores and threads `specdec up` gives drafter and verifier by default (specdec.cli.up): the
    drafter the first quarter of the cores (at least one), the verifier all of them
    (--verifier-shares-cores), with its own share of threads while a drafter call runs beside it."""
    from specdec.cli import processes

    drafter, verifier = processes.default_core_split()
    shared = sorted(set(drafter) | set(verifier))
    return {
        "drafter": ["--cores", processes.format_cores(drafter)],
        "verifier": ["--cores", processes.format_cores(shared), "--threads", str(len(shared))]
        + ["--threads-beside-drafter", str(len(verifier))],
    }


def wait_listening(child: Any, timeout_s: float) -> str:
    """The address in the child's ready file once it is there; bounded by `timeout_s`. (Not
    processes.wait_ready: its health check would dial an engine's address from the root namespace,
    which has no route to it.)"""
    from specdec.cli import processes

    deadline = time.monotonic() + timeout_s
    while True:
        info = processes.read_ready_file(child.ready_file)
        if info and info.get("address"):
            child.address, child.info = str(info["address"]), info
            return child.address
        if not child.alive():
            raise RuntimeError(processes.describe_exit(child))
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{child.name} did not start listening within {timeout_s:g} s (log: {child.log_path})"
            )
        time.sleep(0.1)


def start_in(
    net: netns.Network,
    role: str,
    name: str,
    argv: list[str],
    folder: Path,
    supervisor: Any,
    cores: list[int] | None = None,
) -> Any:
    """`argv` as `name` in `role`'s namespace, started (and later stopped) by `supervisor` as `up`
    starts its children (own session, parent-death signal, pinned, log and ready file in `folder`)."""
    from specdec.cli import processes

    ready = folder / f"{name}.ready.json"
    child = processes.Child(
        name=name,
        argv=[*net.exec(role), *argv, "--ready-file", str(ready)],
        ready_file=ready,
        log_path=folder / f"{name}.log",
        cores=cores,
    )
    supervisor.children.append(child)
    return processes.spawn(child, cwd=ROOT)


def run_namespaces(
    args: argparse.Namespace, prompts: dict[str, list[int]], net: netns.Network
) -> dict[str, Any]:
    """Engines in their namespaces; per delay, relays and an orchestrator in the orchestrator's."""
    from specdec.cli import processes
    from specdec.models import resolve_model
    from specdec.rpc.security import write_token_file

    hub = net.hub
    network: dict[str, Any] = {"mode": NAMESPACES, **net.describe(), "engines": {}, "relays": {}}
    say("network namespaces: " + "; ".join(network["links"]))
    token_file = write_token_file(args.out / "engine.token", secrets.token_urlsafe(32))
    placement = engine_placement()
    network["cores"] = {role: placement[role][1] for role in placement}  # as `specdec up` pins them
    engines = processes.Supervisor(args.out)
    rows: list[dict[str, Any]] = []
    round_trips: dict[str, float] = {}
    try:
        say(f"starting drafter and verifier ({args.draft} → {args.target}, {args.dtype}) in their namespaces")
        children = {}
        for role, model in (("drafter", args.draft), ("verifier", args.target)):
            serve = ["serve", role, "--model", str(resolve_model(model)), "--host", net.address[role]]
            serve += ["--port", "0", "--device", "cpu", "--dtype", args.dtype]
            serve += ["--auth-token-file", str(token_file)]
            argv = processes.cli_command(*serve, *placement[role])
            cores = processes.parse_cores(placement[role][1])
            children[role] = start_in(net, role, role, argv, args.out, engines, cores)
        for role, child in children.items():
            network["engines"][role] = wait_listening(child, args.startup_timeout)
            cores = network["cores"][role]
            say(f"{role} listening on {child.address} in {net.namespaces[role]} (cores {cores})")
        for delay in args.delays_ms:
            per_delay = processes.Supervisor(args.out)
            relays: dict[str, str] = {}
            process = None
            try:
                for role, child in children.items():
                    relay_argv = [sys.executable, "-m", "bench.delay_proxy", "--target", child.address]
                    relay_argv += ["--delay-ms", f"{delay:g}", "--host", net.address[hub]]
                    relay = start_in(net, hub, f"relay-{role}-{delay:g}ms", relay_argv, args.out, per_delay)
                    relays[role] = wait_listening(relay, 30.0)
                    processes.wait_healthy(
                        relays[role],
                        args.startup_timeout,
                        name=f"{role} through its relay",
                        alive=lambda c=child, r=relay: c.alive() and r.alive(),
                    )
                process, address = start_orchestrator(
                    relays["drafter"],
                    relays["verifier"],
                    token_file,
                    args.out,
                    f"orchestrator-{delay:g}ms",
                    host=net.address[hub],
                    prefix=net.exec(hub),
                )
                network["relays"][f"{delay:g}"] = {**relays, "orchestrator": address}
                delay_rows, round_trips[f"{delay:g}"] = measure(
                    address, relays["verifier"], prompts, args, delay
                )
                rows += delay_rows
            finally:
                if process is not None:
                    stop(process)
                per_delay.stop()
    finally:
        engines.stop()
        token_file.unlink(missing_ok=True)
    return {"rows": rows, "round_trip_ms": round_trips, "network": network}


def network_mode(choice: bool | None) -> str:
    """--netns (True), --no-netns (False) or neither (None: namespaces where they can be made)."""
    if choice is False:
        return LOOPBACK
    reason = netns.unavailable_reason()
    if reason is None:
        return NAMESPACES
    if choice:
        raise SystemExit(f"--netns: {reason}")
    say(
        f"no network namespaces here ({reason}): running on loopback instead, all in one namespace "
        "(--no-netns chooses this without trying; --netns makes it an error)"
    )
    return LOOPBACK


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.grounded_prompts import prompt_ids, workload_items
    from specdec.models import resolve_model
    from specdec.runtime.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(args.target))
    items = workload_items(["open"], args.per_kind)["open"]
    prompts = {item.id: prompt_ids(item, tokenizer, args.max_prompt_tokens) for item in items}
    if network_mode(args.netns) == LOOPBACK:
        return run_loopback(args, prompts)
    with netns.network("orchestrator", ("drafter", "verifier")) as net:
        return run_namespaces(args, prompts, net)


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row in rows:
        cell = out.setdefault(f"{row['delay_ms']:g}", {}).setdefault(row["config"], {"tok_s": [], "ms": []})
        cell["tok_s"].append(row["tok_s"])
        cell["ms"].append(row["ms_per_iteration"])
    return {
        delay: {
            config: {
                "tok_s": statistics.median(v["tok_s"]),
                "ms_per_iteration": statistics.median(v["ms"]),
                "runs": len(v["tok_s"]),
            }
            for config, v in configs.items()
        }
        for delay, configs in out.items()
    }


def render(results: dict[str, Any], meta: dict[str, Any]) -> str:
    summary = summarize(results["rows"])
    lines = [
        f"# Drafter and verifier a round trip away ({meta['date']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['machine']}. {meta['draft']} → {meta['target']} at {meta['dtype']}, "
        f"{meta['max_new_tokens']} tokens, T = {meta['temperature']:g}, open prompts, "
        f"{meta['rounds']} round(s).",
        "",
        *([describe_network(results["network"]), ""] if results.get("network") else []),
        "| one-way delay | health check through the relay | "
        + " | ".join(f"{c} tok/s (ms/iteration)" for c in CONFIGS)
        + " |",
        "|---:|---:|" + "---:|" * len(CONFIGS),
    ]
    for delay, configs in summary.items():
        cells = [
            f"{configs[c]['tok_s']:.2f} ({configs[c]['ms_per_iteration']:.1f})" if c in configs else "–"
            for c in CONFIGS
        ]
        lines.append(
            f"| {delay} ms | {results['round_trip_ms'].get(delay, float('nan')):.2f} ms | "
            + " | ".join(cells)
            + " |"
        )
    lines += [
        "",
        "model: draft model with the look-ahead (pipeline); model-seq: the same without it; "
        "default: a request with no knobs (hybrid).",
    ]
    return "\n".join(lines)


def describe_network(network: dict[str, Any]) -> str:
    """The report's line on where the services ran and at which addresses."""
    engines = network.get("engines", {})
    relays = "; ".join(
        f"{delay} ms: " + ", ".join(f"{role} {address}" for role, address in where.items())
        for delay, where in network.get("relays", {}).items()
    )
    if network["mode"] != NAMESPACES:
        return (
            f"Network: loopback, one namespace (127.0.0.1): `specdec up`'s drafter at "
            f"{engines.get('drafter')} and verifier at {engines.get('verifier')}, reached through "
            f"relays in the benchmark's process (relays and orchestrator per delay: {relays})."
        )
    names, address = network["namespaces"], network["addresses"]
    return (
        f"Network: namespaces, one per service, linked by veth pairs in {network['subnet']}: the "
        f"orchestrator in `{names['orchestrator']}` at {address['orchestrator']} (the benchmark's "
        f"client in the root namespace at {network['client']}), the drafter in `{names['drafter']}` at "
        f"{engines.get('drafter')} (its link's other end {network['hub_side']['drafter']}), the verifier "
        f"in `{names['verifier']}` at {engines.get('verifier')} (other end "
        f"{network['hub_side']['verifier']}). The relays run in the orchestrator's namespace, so every "
        f"byte between the orchestrator and an engine crosses a relay and a veth pair (relays and "
        f"orchestrator per delay: {relays}). The health check goes from the root namespace across the "
        f"root ↔ orchestrator pair, through the verifier's relay, to the verifier."
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_hosts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--delays-ms",
        type=lambda s: [float(x) for x in s.split(",") if x.strip()],
        default=[0.0, 0.5, 2.0],
        help="one-way delays to run, comma-separated (default 0,0.5,2)",
    )
    p.add_argument("--draft", default=DEFAULT_DRAFT_MODEL)
    p.add_argument("--target", default=DEFAULT_TARGET_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--per-kind", type=int, default=1, help="open prompts per kind (code, chat, prose)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--max-prompt-tokens", type=int, default=1024, help="keep each prompt's last N tokens (default 1024)"
    )
    p.add_argument(
        "--netns",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each service in its own network namespace, linked by veth pairs (needs root and "
        "`ip`); --no-netns: all on loopback. Default: namespaces where they can be made, "
        "else loopback (said on start)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds each engine may take to load and listen (namespaces; default 600)",
    )
    p.add_argument("--out", type=Path, default=None, help="folder for hosts.md, results.json and logs")
    return p


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if any(d < 0 for d in args.delays_ms) or not args.delays_ms:
        parser().error("--delays-ms must list delays ≥ 0")
    args.out = args.out or Path(tempfile.mkdtemp(prefix="specdec-hosts-"))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "command": "python -m bench.bench_hosts " + " ".join(argv),
        "draft": args.draft,
        "target": args.target,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "rounds": args.rounds,
    }
    main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM tears down (processes, namespaces) as Ctrl-C does
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        results = run(args)
    except KeyboardInterrupt:
        say("interrupted: every process it started is stopped, and namespaces it made are deleted")
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    meta["network"] = results["network"]["mode"]
    text = render(results, meta)
    (args.out / "hosts.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, **results}, indent=1))
    print(text)
    say(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
