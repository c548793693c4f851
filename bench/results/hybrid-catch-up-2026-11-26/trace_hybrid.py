"""Per-iteration timings of the default hybrid against suffix-only on one `specdec up` (server A of
bench.bench_grounded: the draft model beside the target), grounded and open prompts at T = 0.

    PYTHONPATH=. python bench/results/hybrid-catch-up-2026-11-26/trace_hybrid.py code-edit,rename,code,chat

(from the repository root). Each prompt kind named runs twice as each configuration, the suffix
cache flushed before each run as bench_grounded does; one line per request, and every iteration's
drafter and verifier intervals in iterations.json under --out (default ./trace-hybrid).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from bench import bench_grounded as bg
from bench.grounded_prompts import prompt_ids, workload_items
from specdec.models import resolve_model

CONFIGS = ("specdec", "suffix")


def iteration_row(record, t0: float) -> dict:
    return {"source": record.source or "none", "k": record.k, "nd": record.num_drafted,
            "acc": record.accepted, "n": len(record.emitted),
            "start": record.start - t0, "end": record.end - t0,
            "draft": [(a - t0, b - t0) for a, b in record.draft_intervals],
            "verify": [(a - t0, b - t0) for a, b in record.verify_intervals]}


def line(row: dict) -> str:
    its = row["its"]
    by: dict[str, list[float]] = {}
    for it in its:
        count = by.setdefault(it["source"], [0, 0.0, 0])
        count[0] += 1
        count[1] += it["end"] - it["start"]
        count[2] += it["n"]
    parts = " ".join(f"{s}: {c} its {t:.2f}s {n} tok ({t / c * 1000:.0f} ms/it)"
                     for s, (c, t, n) in by.items())
    return (f"{row['item']} {row['config']} rep{row['rep']}: total {row['total']:.2f}s "
            f"prompt {row['prompt']} {parts}")


async def trace(address: str, kinds: list[str], target: str) -> list[dict]:
    from specdec.client import AsyncClient
    from specdec.generation import GenerationRequest
    from specdec.sampling_params import SamplingParams

    items = [i for w in workload_items(["grounded", "open"], 1).values() for i in w if i.kind in kinds]
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(target)))
    client = AsyncClient(address, timeout_s=600)
    out = []
    try:
        for item in items:
            ids = prompt_ids(item, tokenizer)
            await bg.specdec_run(client, "specdec", ids, 8, 0.0, f"warm-{item.id}")
            for rep in range(2):
                for config in CONFIGS:
                    await bg.flush_cache(client, bg.CACHE_REQUESTS, f"flush-{config}-{rep}-{item.id}")
                    request = GenerationRequest(prompt_ids=list(ids), max_new_tokens=128, stop_token_ids=[],
                                                sampling=SamplingParams(temperature=0.0),
                                                draft_source=bg.REQUEST_SOURCE[config],
                                                request_id=f"{config}-{rep}-{item.id}")
                    t0 = time.time()
                    result = await client.generate(request)
                    row = {"item": item.id, "config": config, "rep": rep, "total": time.time() - t0,
                           "prompt": len(ids), "its": [iteration_row(r, t0) for r in result.iterations]}
                    out.append(row)
                    print(line(row), flush=True)
    finally:
        await client.close()
    return out


def main(argv: list[str]) -> None:
    kinds = argv[0].split(",")
    args = bg.parser().parse_args(["--configs", ",".join(CONFIGS), "--workloads", "grounded,open",
                                   "--per-kind", "1", "--rounds", "1", "--temperatures", "0", *argv[1:]])
    args.out = args.out or Path("trace-hybrid")
    args.out.mkdir(parents=True, exist_ok=True)
    spec = bg.start_server("A", "A", args, bg.CACHE_REQUESTS, print)
    try:
        rows = asyncio.run(trace(spec.info["orchestrator"], kinds, args.target))
    finally:
        spec.stop()
    (args.out / "iterations.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
