"""The first requests of a fresh server: what a new user's first request costs against the same
prompt once the server has served one other request (issue 37, item 5).

    python -m bench.bench_first_request --rounds 2 --out bench/results/first-request-DATE

Per round, per order of the two prompts (--prompts, one grounded and one open by default), a fresh
`specdec up` (the defaults a user gets, no saved calibration) serves three requests in turn: prompt
A, prompt B, then prompt A again. Each request carries a salt of its own (`cache_salt`), so neither
the prefix caches nor the suffix cache hold anything of an earlier request: the third request is a
new prompt to the caches, served by a server that has run two requests. Rows: per prompt, its
seconds as a server's first request against its seconds as the third, and what the requests did
(iterations by draft source). The two orders alternate which prompt comes first.

Sampling: T = --temperature (0 by default), --max-new-tokens tokens, no stop tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.bench_grounded import prompt_ids, specdec_run, start_server
from bench.grounded_prompts import Item, workload_items
from bench.machine import cpu_model
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

DEFAULT_PROMPTS = ("grounded/code-edit", "open/code")


def pick_items(names: list[str]) -> list[Item]:
    """Items by `workload/kind` (the first prompt of that kind)."""
    picked = []
    for name in names:
        workload, _, kind = name.partition("/")
        items = workload_items([workload], 1).get(workload, [])
        match = next((item for item in items if item.kind == kind), None)
        if match is None:
            known = ", ".join(f"{workload}/{item.kind}" for item in items)
            raise SystemExit(f"--prompts: no prompt {name!r} (known: {known})")
        picked.append(match)
    return picked


async def serve_three(address: str, order: list[tuple[Item, list[int]]], args: argparse.Namespace,
                      tag: str) -> list[dict[str, Any]]:
    """Prompt A, prompt B, prompt A again on one server, each with a salt of its own."""
    from specdec.client import AsyncClient

    client = AsyncClient(address, timeout_s=args.request_timeout)
    rows = []
    try:
        for position, (item, ids) in enumerate([*order, order[0]], start=1):
            request_id = f"{tag}-{position}"
            row = await specdec_run(client, "specdec", ids, args.max_new_tokens, args.temperature,
                                    request_id, cache_salt=request_id)
            row.pop("token_ids")
            rows.append({"position": position, "item": item.id, "prompt_tokens": len(ids), **row})
            print(f"  {tag} #{position} {item.id}: {row['seconds']:.2f} s, {row['iterations']} iterations "
                  f"{row['iterations_by_source']}", flush=True)
    finally:
        await client.close()
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from specdec.models import resolve_model
    from specdec.runtime.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(args.target))
    items = pick_items(args.prompts)
    ids = {item.id: prompt_ids(item, tokenizer, args.max_prompt_tokens) for item in items}
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for flip in (False, True):
            order = [(item, ids[item.id]) for item in (items[::-1] if flip else items)]
            name = f"r{rnd}{'b' if flip else 'a'}"
            server = start_server("A", name, args, None, print)  # `up` with the draft model, uncalibrated
            try:
                served = asyncio.run(serve_three(server.info["orchestrator"], order, args, name))
            finally:
                server.stop()
            rows += [{"round": rnd, "server": name, **row} for row in served]
    return {"meta": {"cpu": cpu_model(), "draft": args.draft, "target": args.target, "dtype": args.dtype,
                     "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                     "extra_up_args": args.extra_up_args, "command": args.command},
            "rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per prompt: seconds as a fresh server's first request and as its third (medians)."""
    out: dict[str, Any] = {}
    for item in sorted({row["item"] for row in rows}):
        first = [row["seconds"] for row in rows if row["item"] == item and row["position"] == 1]
        third = [row["seconds"] for row in rows if row["item"] == item and row["position"] == 3]
        out[item] = {"first_s": first, "third_s": third,
                     "first_over_third": (statistics.median(first) / statistics.median(third)
                                          if first and third else None)}
    return out


def render(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [f"# First requests of a fresh server ({meta['cpu']})", "", f"    {meta['command']}", "",
             "| prompt | as the first request, s | as the third, s | first ÷ third |", "|---|---|---|---:|"]
    for item, row in results["summary"].items():
        ratio = row["first_over_third"]
        lines.append(f"| {item} | {', '.join(f'{s:.2f}' for s in row['first_s'])} | "
                     f"{', '.join(f'{s:.2f}' for s in row['third_s'])} | "
                     f"{'–' if ratio is None else f'{ratio:.2f}'} |")
    lines += ["", "| server | # | prompt | s | iterations | by source |", "|---|---:|---|---:|---:|---|"]
    for row in results["rows"]:
        lines.append(f"| {row['server']} | {row['position']} | {row['item']} | {row['seconds']:.2f} | "
                     f"{row['iterations']} | {row['iterations_by_source']} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.bench_first_request", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="rounds; each starts two fresh servers (default 2)")
    p.add_argument("--prompts", type=lambda s: s.split(","), default=list(DEFAULT_PROMPTS),
                   help="two prompts as workload/kind (default grounded/code-edit,open/code)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--draft", default=DEFAULT_DRAFT_MODEL)
    p.add_argument("--target", default=DEFAULT_TARGET_MODEL)
    p.add_argument("--dtype", default="int8")
    p.add_argument("--extra-up-args", default="", help="more `specdec up` arguments, as one string")
    p.add_argument("--max-prompt-tokens", type=int, default=1024,
                   help="a longer prompt keeps its last this many tokens (default 1024)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/first-request"))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    args.command = shlex.join(["python", "-m", "bench.bench_first_request", *argv])
    if len(args.prompts) != 2:
        raise SystemExit("--prompts takes two prompts")
    results = run(args)
    (args.out / "first_request.json").write_text(json.dumps(results, indent=1))
    (args.out / "first_request.md").write_text(render(results))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
