"""Where an iteration's time goes: drafter and verifier compute, engine and server overhead, wire and
(de)serialisation, the orchestrator between calls, and waiting — over real gRPC, on this machine.

    python -m bench.bench_iteration                      # the default pair, `specdec up` defaults
    python -m bench.bench_iteration --k 2 --k 4 --prompts 4 --max-new-tokens 48 --out bench/results/iteration

It starts `specdec up --trace-file F` (drafter and verifier pinned to their own cores, as a user
gets it), sends each prompt once per configuration (sequentially, one client), stops the services
(spans are flushed) and splits every traced call along its nested spans:

    specdec.draft / specdec.verify   the loop's view of one drafter / verifier call
      └ CLIENT rpc span              the gRPC call in the orchestrator process
          └ SERVER rpc span          the handler in the engine's process
              └ drafter.* / verifier.verify   the engine call (worker thread)
                  └ *.forward, verifier.verification   model compute, the verification rule

    wait      = loop span − CLIENT span   (waiting for an abandoned look-ahead to finish, since a
                                           run's drafter calls never overtake each other; the
                                           session mirror; timing)
    wire      = CLIENT − SERVER           (grpc's (de)serialisation of the bytes, the socket, scheduling)
    handler   = SERVER − engine           (proto ↔ dataclass conversion, hand-off to the worker thread)
    engine    = engine − compute          (sessions, KV bookkeeping, warping rows, tensor copies)
    compute   = forward (+ verification)

Per iteration: wall time, the time some call was in flight, and the rest (the orchestrator between
calls: stop conditions, the untraced Decode RPC for the text, records). A micro-benchmark of the
draft rows' conversion and protobuf (de)serialisation (float32, V = the target's vocabulary) gives
the cost of moving one drafted token's row once. Tracing itself costs about 0.75 ms of CPU per RPC
(bench/results/tracing.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.machine import cpu_model
from orchestrator.intervals import covered
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

ROOT = Path(__file__).resolve().parent.parent
PROSE = [
    "The history of the printing press begins",
    "Write a short story about a lighthouse keeper who",
]
CALLS = {  # loop span → (client rpc names, engine span names)
    "specdec.draft": ("Draft", "Lookahead"),
    "specdec.verify": ("Verify", "Score"),
}


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores"


def prompts(count: int) -> list[str]:
    from specdec.prompts import load_prompts

    code = [p.text for p in load_prompts("humaneval", max(1, count - len(PROSE)))]
    return (code + PROSE)[:count]


def start_up(trace: Path | None, ready: Path, log: Path, args: list[str]) -> subprocess.Popen:
    """`specdec up` on free ports, its HTTP door too (spans to `trace` when given); returns once it is
    ready."""
    argv = [
        sys.executable,
        "-m",
        "specdec.cli",
        "up",
        "--port",
        "0",
        "--drafter-port",
        "0",
        "--verifier-port",
        "0",
        "--http-port",
        "0",
        "--ready-file",
        str(ready),
        *(["--trace-file", str(trace)] if trace is not None else []),
        *args,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("w") as sink:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            argv, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    deadline = time.monotonic() + 900
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"`specdec up` did not start:\n{log.read_text()}")
        time.sleep(0.5)
    time.sleep(0.5)
    return process


def stop_up(process: subprocess.Popen) -> None:
    """Ctrl-C for `up`: it stops its three services gracefully, and each flushes its spans."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


async def run_requests(
    address: str, texts: list[str], ks: list[int], max_new_tokens: int, seed: int
) -> list[dict]:
    from specdec.client import AsyncClient
    from specdec.generation import GenerationRequest

    client = AsyncClient(address, timeout_s=900)
    rows = []
    try:
        for i, text in enumerate(texts):
            for k in ks:
                request = GenerationRequest(
                    prompt=text,
                    max_new_tokens=max_new_tokens,
                    seed=seed + i if k else None,  # k = 0: what `specdec generate` sends (online k)
                    k=k or None,
                    request_id=f"k{k}-p{i}-{seed}",
                )
                result = await client.generate(request)
                s = result.stats
                rows.append(
                    {
                        "request_id": result.request_id,
                        "k": k,
                        "prompt": i,
                        "tokens": s.new_tokens,
                        "seconds": s.seconds,
                        "iterations": s.iterations,
                        "acceptance": s.acceptance_rate,
                        "pre_drafts_used": s.pre_drafts_used,
                    }
                )
                print(
                    f"prompt {i} k={k or 'default'}: {s.new_tokens} tokens in {s.seconds:.2f}s, "
                    f"{s.iterations} iterations",
                    file=sys.stderr,
                )
    finally:
        await client.close()
    return rows


def load_spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def seconds(span: dict) -> float:
    return (span["end_ns"] - span["start_ns"]) / 1e9


def breakdown(spans: list[dict], request_k: dict[str, int]) -> dict[int, dict[str, Any]]:
    """Per k: mean seconds per call of each component, per call kind, and per-iteration figures."""
    children: dict[str | None, list[dict]] = defaultdict(list)
    by_id = {}
    for span in spans:
        by_id[span["span_id"]] = span
        children[span["parent_span_id"]].append(span)

    def child(span: dict, names: tuple[str, ...], kind: str | None = None) -> dict | None:
        for c in children.get(span["span_id"], []):
            if c["name"].rsplit("/", 1)[-1] in names or c["name"] in names:
                if kind is None or c.get("kind") == kind:
                    return c
        return None

    def request_of(span: dict) -> str | None:
        while span is not None:
            if span["name"] == "specdec.request":
                return span["attributes"].get("specdec.request_id")
            span = by_id.get(span["parent_span_id"])
        return None

    out: dict[int, dict[str, Any]] = defaultdict(
        lambda: {"calls": defaultdict(lambda: defaultdict(list)), "iterations": defaultdict(list)}
    )
    for span in spans:
        if span["name"] == "specdec.iteration":
            k = request_k.get(request_of(span) or "", -1)
            calls = [c for c in children.get(span["span_id"], []) if c["name"] in CALLS]
            # Clipped to the iteration: an abandoned look-ahead ends during the next one.
            lo, hi = span["start_ns"], span["end_ns"]
            busy = (
                covered([(max(lo, c["start_ns"]), min(hi, c["end_ns"])) for c in calls if c["start_ns"] < hi])
                / 1e9
            )
            it = out[k]["iterations"]
            it["wall"].append(seconds(span))
            it["in a call"].append(busy)
            it["between calls"].append(seconds(span) - busy)
            it["tokens"].append(span["attributes"].get("specdec.emitted", 0))
        if span["name"] not in CALLS:
            continue
        k = request_k.get(request_of(span) or "", -1)
        rpc = child(span, CALLS[span["name"]], "CLIENT")
        if rpc is None:
            continue
        op = rpc["name"].rsplit("/", 1)[-1]
        server = child(rpc, (op,), "SERVER")
        engine = server and next(iter(children.get(server["span_id"], [])), None)
        compute = 0.0
        if engine is not None:
            compute = sum(
                seconds(c)
                for c in children.get(engine["span_id"], [])
                if c["name"].endswith((".forward", ".verification"))
            )
        row = out[k]["calls"][op]
        row["loop"].append(seconds(span) - seconds(rpc))
        row["wire"].append(seconds(rpc) - (seconds(server) if server else 0.0))
        row["handler"].append((seconds(server) - seconds(engine)) if server and engine else 0.0)
        row["engine"].append((seconds(engine) - compute) if engine else 0.0)
        row["compute"].append(compute)
        row["total"].append(seconds(span))
    return out


def rows_cost(vocab: int, k: int, repeats: int = 20) -> dict[str, float]:
    """Seconds to move a drafted block's k + 1 float32 rows once: engine → proto → bytes → proto →
    tensor (what a Draft reply and again a Verify request pay)."""
    import torch

    from specdec.engine.api import DraftResult
    from specdec.rpc import convert
    from specdec.rpc.v1 import drafter_pb2
    from specdec.trees import sequence_parents

    probs = torch.softmax(torch.randn(k + 1, vocab), dim=-1)
    result = DraftResult(tokens=list(range(k)), parents=sequence_parents(k), draft_probs=probs)
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        t0 = time.perf_counter()
        msg = convert.draft_result_to_proto(result)
        t1 = time.perf_counter()
        data = msg.SerializeToString()
        t2 = time.perf_counter()
        back = drafter_pb2.DraftResult.FromString(data)
        t3 = time.perf_counter()
        convert.draft_result_from_proto(back)
        t4 = time.perf_counter()
        for name, value in (
            ("to proto", t1 - t0),
            ("serialise", t2 - t1),
            ("parse", t3 - t2),
            ("from proto", t4 - t3),
        ):
            times[name].append(value)
    out = {name: statistics.median(v) for name, v in times.items()}
    out["bytes"] = float(len(data))
    return out


def vocab_size(target: str) -> int:
    """The target's vocabulary (config.json), the width of every draft row on the wire."""
    from specdec.models import resolve_model
    from specdec.runtime.loading import resolve_model_dir

    path = Path(target) if Path(target).exists() else resolve_model(target)
    config = json.loads((resolve_model_dir(path) / "config.json").read_text())
    return int(config["vocab_size"])


def ms(values: list[float]) -> str:
    return f"{1000 * statistics.mean(values):.1f}" if values else "–"


def render(
    results: dict[int, dict[str, Any]],
    requests: list[dict],
    cost: dict[int, dict[str, float]],
    meta: dict[str, Any],
) -> str:
    lines = [
        f"# Iteration breakdown ({meta['date']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['machine']}. `specdec up` defaults otherwise (precision {meta['dtype']}, "
        "pipelined, drafter and verifier pinned to their own cores), tracing on.",
        "",
    ]
    for k in sorted(results):
        data = results[k]
        reqs = [r for r in requests if r["k"] == k]
        tok = sum(r["tokens"] for r in reqs)
        secs = sum(r["seconds"] for r in reqs)
        label = f"k = {k}" if k else "default k"
        its = data["iterations"]
        lines += [
            f"## {label}: {tok} tokens in {secs:.1f} s ({tok / secs if secs else 0:.2f} tok/s), "
            f"{len(its['wall'])} iterations, acceptance "
            f"{statistics.mean(r['acceptance'] for r in reqs):.2f}",
            "",
            "| per call (mean ms) | calls | compute | engine | handler | wire | wait + loop | total |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for op, row in sorted(data["calls"].items()):
            lines.append(
                f"| {op} | {len(row['total'])} | {ms(row['compute'])} | {ms(row['engine'])} | "
                f"{ms(row['handler'])} | {ms(row['wire'])} | {ms(row['loop'])} | {ms(row['total'])} |"
            )
        lines += [
            "",
            "| per iteration (mean ms) | wall | some call in flight | between calls |",
            "|---|---:|---:|---:|",
            f"| all | {ms(its['wall'])} | {ms(its['in a call'])} | {ms(its['between calls'])} |",
            "",
        ]
    lines += [
        f"## Moving draft rows (float32, one block of k drafts = k + 1 rows, V = {meta['vocab']}), median ms",
        "",
        "| k | bytes | to proto | serialise | parse | from proto | one hop total |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, c in sorted(cost.items()):
        hop = c["to proto"] + c["serialise"] + c["parse"] + c["from proto"]
        lines.append(
            f"| {k} | {c['bytes'] / 1e6:.2f} MB | {1000 * c['to proto']:.2f} | {1000 * c['serialise']:.2f} | "
            f"{1000 * c['parse']:.2f} | {1000 * c['from proto']:.2f} | {1000 * hop:.2f} |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--draft", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--target", default=DEFAULT_TARGET_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--k", type=int, action="append",
                        help="draft lengths to run (0 = the default: no k, no seed: the online draft length)")
    parser.add_argument("--prompts", type=int, default=4, help="HumanEval prompts plus two prose openings")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for breakdown.md, breakdown.json, spans"
    )
    args = parser.parse_args(argv)
    ks = args.k or [0]
    out = args.out or Path(tempfile.mkdtemp(prefix="specdec-iteration-"))
    out.mkdir(parents=True, exist_ok=True)
    trace, ready = out / "spans.jsonl", out / "up.ready.json"
    for path in (trace, ready):
        path.unlink(missing_ok=True)
    up_args = ["--draft", args.draft, "--target", args.target, "--dtype", args.dtype]
    process = start_up(trace, ready, out / "up.log", up_args)
    try:
        info = json.loads(ready.read_text())
        requests = asyncio.run(
            run_requests(info["orchestrator"], prompts(args.prompts), ks, args.max_new_tokens, args.seed)
        )
    finally:
        stop_up(process)
    spans = load_spans(trace)
    request_k = {r["request_id"]: r["k"] for r in requests}
    results = breakdown(spans, request_k)
    vocab = vocab_size(args.target)
    cost = {k: rows_cost(int(vocab), k) for k in (1, 2, 4)}
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "dtype": args.dtype,
        "vocab": vocab,
        "command": "python -m bench.bench_iteration " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    text = render(results, requests, cost, meta)
    (out / "breakdown.md").write_text(text)
    (out / "breakdown.json").write_text(
        json.dumps(
            {"meta": meta, "requests": requests, "rows_cost": cost, "results": results},
            indent=1,
            default=dict,
        )
    )
    print(text)
    print(f"written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
