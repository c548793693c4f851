"""Mixed prompts, side by side: plain HF decoding, HF assisted generation, and `specdec up` as a new
user gets it (no flags, no calibration) and tuned, per prompt category (code, chat, prose).

    python -m bench.bench_mixed                                   # 4 prompts per category, 3 rounds
    python -m bench.bench_mixed --per-category 4 --rounds 3 --max-new-tokens 48 --out bench/results/mixed

Every round walks the prompts; for each prompt every configuration runs once, in a fixed order, so
slow phases of a shared machine hit all of them alike (medians per category and configuration):

    hf            transformers `generate` on the target in this process (same precision, --hf-threads)
    hf-assisted   the same with the draft as `assistant_model` (HF's speculative decoding)
    specdec       `specdec up` over gRPC, a request with no knobs and no seed (the server's defaults:
                  online draft length, pipelined token verification)
    tuned         the same server, a request naming method token and --tuned-k (fixed k)
    target-only   the same server, method autoregressive (the floor that adaptation must not lose to)

The server is started once with `--dtype` and SPECDEC_USE_CALIBRATION=false (a first start: no
saved calibration), so its controller learns over the run as a shared service would; one warm-up
round (first prompt of each category, every configuration) is not counted. Sampling: temperature 1,
no top-k/top-p, no stop tokens (every run makes --max-new-tokens tokens). mixed.md also splits the
specdec rows' iterations by kind (drafted, target-only step beside a look-ahead, plain step), with
their median wall time against the target-only row's step: what an iteration at k costs here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.bench_iteration import PROSE, start_up, stop_up
from bench.machine import cpu_model
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

CATEGORIES = ("code", "chat", "prose")
CONFIGS = ("hf", "hf-assisted", "specdec", "tuned", "target-only")
MORE_PROSE = [
    "In the spring of 1848, a wave of revolutions swept across Europe. It began",
    "The old bridge over the river had stood for three hundred years, and the people of the town",
]


def category_prompts(per_category: int) -> dict[str, list[Any]]:
    from specdec.prompts import Prompt, load_prompts

    prose = [Prompt(f"prose/{i}", text) for i, text in enumerate(PROSE + MORE_PROSE)]
    return {
        "code": load_prompts("humaneval", per_category),
        "chat": load_prompts("mtbench", per_category),
        "prose": prose[:per_category],
    }


def hf_run(target, draft, ids: list[int], max_new_tokens: int, seed: int) -> float:
    """Tokens per second of HF generate (assisted when `draft` is given): bench.run's HF runner with
    its sampling defaults (T = 1, no top-k/top-p, no stop tokens)."""
    from bench.run import BenchSettings, run_hf

    record = run_hf(target, draft, ids, BenchSettings(max_new_tokens=max_new_tokens), seed, draft is not None)
    return record.tokens / record.seconds


async def specdec_run(
    client, ids: list[int], max_new_tokens: int, config: str, tuned_k: int
) -> dict[str, Any]:
    from specdec.generation import GenerationRequest

    knobs: dict[str, Any] = {}
    if config == "tuned":
        knobs = {"method": "token", "k": tuned_k}
    elif config == "target-only":
        knobs = {"method": "autoregressive"}
    request = GenerationRequest(
        prompt_ids=list(ids), max_new_tokens=max_new_tokens, stop_token_ids=[], **knobs
    )
    began = time.perf_counter()
    result = await client.generate(request)
    seconds = time.perf_counter() - began
    ks = [r.k for r in result.iterations]
    return {
        "kinds": iteration_kinds(result.iterations),
        "tok_s": len(result.token_ids) / seconds,
        "iterations": result.stats.iterations,
        "acceptance": result.stats.acceptance_rate,
        "mean_k": sum(ks) / len(ks) if ks else 0.0,
        "target_only_steps": sum(1 for r in result.iterations if r.method == "autoregressive"),
    }


ITERATION_KINDS = ("drafted", "step beside a look-ahead", "step")


def iteration_kinds(records: list[Any]) -> dict[str, list[float]]:
    """Wall seconds of a request's iterations by kind, its first (the prompt's prefill) left out:

    drafted                   a block was verified (num_drafted > 0)
    step beside a look-ahead  a target-only step while the drafter looked ahead (k asked > 0)
    step                      a target-only step alone (k = 0)

    Their ratio to a step bounds what speculation can gain here: at k = 1 an iteration yields
    1 + α tokens when drafted and 1 otherwise.
    """
    out: dict[str, list[float]] = {kind: [] for kind in ITERATION_KINDS}
    for r in records[1:]:
        kind = "drafted" if r.num_drafted > 0 else "step beside a look-ahead" if r.k > 0 else "step"
        out[kind].append(r.end - r.start)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers.utils import logging as hf_logging

    from specdec.client import AsyncClient
    from specdec.prompts import prompt_ids
    from specdec.runtime.loading import load_model

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.hf_threads)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    from specdec.models import resolve_model

    target = load_model(resolve_model(args.target), dtype=args.dtype, threads=args.hf_threads)
    draft = load_model(resolve_model(args.draft), dtype=args.dtype, threads=args.hf_threads)
    prompts = {
        c: [prompt_ids(p, target.tokenizer, 256) for p in ps]
        for c, ps in category_prompts(args.per_category).items()
    }

    out = args.out
    ready = out / "up.ready.json"
    ready.unlink(missing_ok=True)
    os.environ["SPECDEC_USE_CALIBRATION"] = "false"
    process = start_up(
        None, ready, out / "up.log", ["--draft", args.draft, "--target", args.target, "--dtype", args.dtype]
    )
    samples: dict[tuple[str, str], list[float]] = defaultdict(list)
    iteration_walls: dict[tuple[str, str], list[float]] = defaultdict(list)
    details: list[dict[str, Any]] = []
    try:
        address = json.loads(ready.read_text())["orchestrator"]

        async def one(client, category: str, ids: list[int], config: str, seed: int) -> dict[str, Any]:
            if config == "hf":
                return {"tok_s": hf_run(target, None, ids, args.max_new_tokens, seed)}
            if config == "hf-assisted":
                return {"tok_s": hf_run(target, draft, ids, args.max_new_tokens, seed)}
            return await specdec_run(client, ids, args.max_new_tokens, config, args.tuned_k)

        async def drive() -> None:
            client = AsyncClient(address, timeout_s=900)
            try:
                say("warm-up round")
                for category in CATEGORIES:
                    for config in CONFIGS:
                        await one(client, category, prompts[category][0], config, 0)
                for rnd in range(args.rounds):
                    for i in range(args.per_category):
                        for category in CATEGORIES:
                            ids = prompts[category][i]
                            for config in CONFIGS:
                                row = await one(client, category, ids, config, 1000 * rnd + i)
                                samples[(category, config)].append(row["tok_s"])
                                for kind, walls in row.pop("kinds", {}).items():
                                    iteration_walls[(config, kind)] += walls
                                details.append(
                                    {"round": rnd, "prompt": i, "category": category, "config": config, **row}
                                )
                                extra = "".join(
                                    f", {k} {v:.2f}" for k, v in row.items() if k != "tok_s" and v is not None
                                )
                                say(f"round {rnd} {category}/{i} {config}: {row['tok_s']:.2f} tok/s{extra}")
            finally:
                await client.close()

        asyncio.run(drive())
    finally:
        stop_up(process)
    table = {
        category: {config: statistics.median(samples[(category, config)]) for config in CONFIGS}
        for category in CATEGORIES
    }
    walls = {
        config: {kind: iteration_walls[(config, kind)] for kind in ITERATION_KINDS}
        for config in CONFIGS if any(iteration_walls[(config, kind)] for kind in ITERATION_KINDS)
    }
    return {"table": table, "details": details, "iteration_walls": walls}


def render(results: dict[str, Any], meta: dict[str, Any]) -> str:
    table = results["table"]
    lines = [
        f"Machine: {meta['machine']}. Precision {meta['dtype']}, {meta['max_new_tokens']} new tokens, T = 1, "
        f"{meta['per_category']} prompts per category × {meta['rounds']} rounds (medians). "
        f"Date {meta['date']}.",
        f"Command: `{meta['command']}`",
        "",
        "| category | " + " | ".join(CONFIGS) + " | specdec vs hf | tuned vs hf | specdec vs target-only |",
        "|---|" + "---:|" * (len(CONFIGS) + 3),
    ]
    for category in CATEGORIES:
        row = table[category]
        cells = " | ".join(f"{row[c]:.2f}" for c in CONFIGS)
        lines.append(
            f"| {category} | {cells} | {row['specdec'] / row['hf']:.2f}× | {row['tuned'] / row['hf']:.2f}× | "
            f"{row['specdec'] / row['target-only']:.2f}× |"
        )
    lines.append("")
    lines.append(
        "tok/s per configuration (higher is better); hf and hf-assisted run in the harness's "
        f"process with {meta['hf_threads']} thread(s), the three specdec rows through one `specdec up`."
    )
    lines += render_iteration_walls(results.get("iteration_walls", {}))
    return "\n".join(lines) + "\n"


def render_iteration_walls(walls: dict[str, dict[str, list[float]]]) -> list[str]:
    """Median wall time per iteration kind and configuration (iteration_kinds), against the
    target-only configuration's step."""
    if not walls:
        return []
    steps = walls.get("target-only", {}).get("step", [])
    base = statistics.median(steps) if steps else None
    lines = ["", "Iteration wall time by kind (median ms, count; × the target-only step):", "",
             "| configuration | " + " | ".join(ITERATION_KINDS) + " |",
             "|---|" + "---:|" * len(ITERATION_KINDS)]
    for config, kinds in walls.items():
        cells = []
        for kind in ITERATION_KINDS:
            values = kinds.get(kind, [])
            if not values:
                cells.append("–")
                continue
            median = statistics.median(values)
            ratio = f", {median / base:.2f}×" if base else ""
            cells.append(f"{median * 1000:.0f} ({len(values)}{ratio})")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--draft", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--target", default=DEFAULT_TARGET_MODEL)
    parser.add_argument("--dtype", default="int8", help="precision of every configuration (default int8)")
    parser.add_argument(
        "--per-category", type=int, default=4, help="prompts per category (code, chat, prose)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--tuned-k", type=int, default=2, help="draft length of the tuned row (method token)")
    parser.add_argument("--hf-threads", type=int, default=1, help="torch threads of the in-process HF rows")
    parser.add_argument("--out", type=Path, default=None, help="folder for mixed.md and mixed.json")
    args = parser.parse_args(argv)
    args.out = args.out or Path(tempfile.mkdtemp(prefix="specdec-mixed-"))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "per_category": args.per_category,
        "rounds": args.rounds,
        "hf_threads": args.hf_threads,
        "command": "python -m bench.bench_mixed " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    results = run(args)
    text = render(results, meta)
    (args.out / "mixed.md").write_text(text)
    (args.out / "mixed.json").write_text(json.dumps({"meta": meta, **results}, indent=1))
    print(text)
    print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
