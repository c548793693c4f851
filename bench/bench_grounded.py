"""Grounded prompts, side by side: where the answer copies from the input (code edits, renames,
extraction, summaries, RAG, YAML ↔ JSON), from an earlier turn (multi-turn), or from recent
requests (an agent loop), model-free drafts should pay; on open-ended prompts they should cost
nothing. Plain HF decoding, HF prompt lookup, HF assisted generation, and `specdec up` with each
draft source, per workload (bench/grounded_prompts.py) and temperature.

    python -m bench.bench_grounded --rounds 2 --max-new-tokens 128 --temperatures 0,1 \\
        --out bench/results/grounded-DATE
    python -m bench.bench_grounded --configs hf,specdec,lookup --workloads grounded --per-kind 1 --rounds 1

Configurations (--configs picks a subset; they always run in this order):

    hf            transformers `generate` on the target in this process (same precision as the
                  servers, --dtype, with --hf-threads torch threads; the machine's cores by default)
    hf-lookup     the same with `prompt_lookup_num_tokens=--lookup-tokens` (HF's prompt lookup)
    hf-assisted   the same with the draft model as `assistant_model` (HF's speculative decoding)
    specdec       `specdec up` (server A: draft model and target), a request with no knobs and no
                  seed: the server's defaults, draft source hybrid (per iteration a model-free draft
                  when it pays, else the draft model, else a target-only step)
    lookup        server A, draft_source "lookup" (n-grams of the request's own prompt and output)
    suffix        server A, draft_source "suffix" (the request's tokens and a cache of recent requests)
    model         server A, draft_source "model" (the draft model only, as before model-free drafts)
    drafter-none  server B, `specdec up --drafter none` (no draft model, the verifier on every core),
                  a request with no knobs: hybrid, so model-free drafts or target-only steps
    target-only   server B, method "autoregressive": a target-only step per token, what plain HF
                  does, through the services (their overhead per token, beside hf's)

Each round starts the servers its configurations need (both, by default) and walks every prompt
once: for each prompt, each temperature, each configuration once, in the order above. So every
ratio to hf compares runs made seconds apart on the same prompt (an idle server's four processes
took about 1.5 % of one core together, sampled over 8 s windows while the other server ran).
`--servers-apart` keeps the two servers from ever running at once instead: phase A starts server A
and walks every prompt with the HF rows and server A's configurations, then stops it; phase B
starts server B and walks the same prompts with drafter-none and target-only, whose × hf then
compares with runs made minutes earlier (on a noisy host the drift between phases is as large as
the differences measured: bench/RESULTS.md, "The same text"). A server is started only when one of
its configurations is selected. Each start is followed by one warm-up request per configuration
(--warmup-tokens tokens, not counted); the HF rows warm up once, in the first round. The servers
start with SPECDEC_USE_CALIBRATION=false (no saved calibration: the controller learns over a round,
as bench_mixed's does).

Agent loop: a family is one file and one system prompt with four small instructions, sent as four
consecutive turns; each configuration walks a family's turns in order before the next
configuration starts on it (the interleaving unit is the family, not the prompt). Turn 1 and turns
≥ 2 are reported as separate rows: the suffix cache has seen the family's earlier turns only from
turn 2 on.

The suffix cache is shared by every request of an orchestrator, and the same prompt runs several
times per server (every configuration, temperature and round): at T = 0 an exact answer is the
same every time, so a later run would copy an earlier run's answer from the cache. To measure what
a new prompt gets, the servers run with SPECDEC_SUFFIX_CACHE_REQUESTS set to the longest agent
family (4; a user's default is 256), and before each run of a configuration that reads the cache
(specdec, suffix, drafter-none; for the agent loop, before each pass over a family) the harness
sends that many one-token filler requests with draft_source "suffix", which push everything else
out of the cache (oldest first). `--no-cache-flush` leaves the servers' cache at its default and
sends no fillers (repeats then copy from earlier runs).

Caches are also partitioned by `cache_salt` (the engines' prefix caches and the suffix cache,
docs/algorithms.md §16), and each pass of a configuration over a unit (a prompt, an agent family)
sends its own salt: an agent family's turns ≥ 2 find its turn 1's prompt and answer in the prefix
caches, as a user's would, and no run finds what another configuration, temperature or round left.
Results record each request's `cached_tokens`.

Sampling: each temperature of --temperatures (0: greedy), no top-k/top-p, no stop tokens: every run
makes --max-new-tokens tokens (results record where the first EOS came, `eos_at`). HF rows get
seed 1000·round + prompt; specdec requests carry no seed.

Reported per workload × temperature × configuration (grounded.md, results.json):
    tok/s         median over prompts and rounds of new tokens / wall seconds of the request (the
                  gRPC call for the servers; generate() for HF), prompt prefill included
    × hf          median over prompts and rounds of tok/s / the hf run's tok/s on the same prompt,
                  temperature and round
    by source     per draft source (model, lookup, suffix): drafts (iterations that verified one of
                  its drafts), mean accepted tokens per draft (stats.sources[s].mean_accepted over
                  the rows, summed) and acceptance (accepted / drafted tokens), and the share of
                  iterations by source (IterationRecord.source; "none" = target-only steps)

--serving-clients N adds a serving level: N closed-loop clients (bench.bench_serving's load
generator) send the grounded prompts for --serving-seconds against default `up` and against
`up --drafter none` (and, with --serving-configs target-only, the latter with every request taking
target-only steps), per temperature, each level on a freshly started server (default suffix cache;
a level repeats a prompt only after it has sent them all, counted in `repeats`); aggregate tok/s,
request tok/s p50, latency p50, TTFT p50, ITL (the gaps between a request's streamed chunks) p50 and
p99. With --serving-fresh every request carries a salt of its own (`cache_salt`), so no request
finds another's prompt or answer in the prefix or suffix caches: a repeated prompt costs what a new
one does, and a faster server's extra repeats do not speed it up further. The servers run with
`--metrics-port 0`, and the level
reads the verifier's batching counters before and after: passes, calls and query rows per pass
(padding included), the padding's share, seconds per pass and output tokens per row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.greedy_text import agreement, render_agreement
from bench.grounded_prompts import AGENT_FAMILIES, WORKLOADS, Item, prompt_ids, render_text, workload_items
from bench.machine import cpu_model
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

CONFIGS = ("hf", "hf-lookup", "hf-assisted", "specdec", "lookup", "suffix", "model", "drafter-none",
           "target-only")
HF_CONFIGS = ("hf", "hf-lookup", "hf-assisted")
SERVER_CONFIGS = {"A": ("specdec", "lookup", "suffix", "model"), "B": ("drafter-none", "target-only")}
CONFIG_SERVER = {config: server for server, configs in SERVER_CONFIGS.items() for config in configs}
REQUEST_SOURCE = {"specdec": None, "lookup": "lookup", "suffix": "suffix", "model": "model",
                  "drafter-none": None, "target-only": None}  # request's draft_source (None: the server's)
REQUEST_METHOD = {"target-only": "autoregressive"}  # the request's method (absent: the server's default)
# The serving level's servers: default `up`, `up --drafter none`, and the latter with every request
# taking target-only steps (what the passes carry without any draft).
SERVING_CONFIGS = ("specdec", "drafter-none", "target-only")
SERVING_SERVERS = {"specdec": "A", "drafter-none": "B", "target-only": "B"}
# Engine counters read from each server's /metrics before and after a level (role verifier): what
# its passes carried. And the orchestrator's, for the tokens those passes made.
VERIFIER_COUNTERS = ("specdec_batches_total", "specdec_batch_calls_total", "specdec_batch_tokens_total",
                     "specdec_batch_positions_total", "specdec_batch_seconds_total")
ORCHESTRATOR_COUNTERS = ("specdec_emitted_tokens_total", "specdec_iterations_total",
                         "specdec_source_drafted_tokens_total", "specdec_source_accepted_tokens_total",
                         "specdec_source_drafts_total")
CACHE_CONFIGS = ("specdec", "suffix", "drafter-none")  # read and fill the suffix cache (hybrid: unseeded)
SOURCES = ("model", "lookup", "suffix")
CACHE_REQUESTS = max(len(tasks) for *_, tasks in AGENT_FAMILIES)
# The rows of the tables: workloads, the agent loop split at its first turn.
ROWS = ("grounded", "multiturn", "agent, turn 1", "agent, turns ≥ 2", "open")
KIND_ROWS = ("kind:grounded/", "kind:open/")  # per-kind rows below the workloads
FILLER = "Filler request {n}: say OK."
WARMUP_TEXT = "Write one sentence about the sea."

Say = Callable[[str], None]


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def row_of(item: Item) -> str:
    if item.workload == "agent":
        return ROWS[2] if item.turn == 0 else ROWS[3]
    return item.workload


def units(items: dict[str, list[Item]]) -> list[list[Item]]:
    """What one configuration runs back to back: one prompt, or one agent family's turns in order."""
    out: list[list[Item]] = []
    for workload_items_ in items.values():
        for item in workload_items_:
            if item.family is not None and out and out[-1][0].family == item.family:
                out[-1].append(item)
            else:
                out.append([item])
    return out


def phases(configs: Sequence[str], apart: bool = False) -> list[tuple[tuple[str, ...], list[str]]]:
    """(servers to start, configurations) per phase of a round, in run order. Together (default): one
    phase with every server the configurations need; apart: server A's (with the HF rows), then B's,
    so two servers never run at once; no servers: the HF rows only."""
    ordered = [c for c in CONFIGS if c in configs]
    if not apart:
        servers = tuple(s for s in SERVER_CONFIGS if any(CONFIG_SERVER.get(c) == s for c in ordered))
        return [(servers, ordered)] if ordered else []
    out: list[tuple[tuple[str, ...], list[str]]] = []
    first = [c for c in ordered if CONFIG_SERVER.get(c) != "B"]
    if first:
        out.append((("A",) if any(CONFIG_SERVER.get(c) == "A" for c in first) else (), first))
    second = [c for c in ordered if CONFIG_SERVER.get(c) == "B"]
    if second:
        out.append((("B",), second))
    return out


def generations(args: argparse.Namespace, items: dict[str, list[Item]]) -> int:
    """Measured generations of a run (warm-ups and fillers left out)."""
    return args.rounds * len(args.temperatures) * len(args.configs) * sum(len(v) for v in items.values())


# ----------------------------------------------------------------------------------------------
# one generation
# ----------------------------------------------------------------------------------------------
def hf_generation_config(max_new_tokens: int, temperature: float, lookup_tokens: int | None = None):
    """bench.run's HF settings: no EOS stop, no repetition penalty, pure sampling at T (greedy at 0);
    `lookup_tokens`: prompt lookup with that many tokens per draft."""
    from transformers import GenerationConfig

    greedy = temperature == 0
    kwargs: dict[str, Any] = {"do_sample": not greedy, "max_new_tokens": max_new_tokens, "min_new_tokens": 0,
                              "eos_token_id": [], "pad_token_id": 0, "repetition_penalty": 1.0}
    if not greedy:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    if lookup_tokens is not None:
        kwargs["prompt_lookup_num_tokens"] = lookup_tokens
    return GenerationConfig(**kwargs)


def hf_run(target, draft, config: str, ids: list[int], max_new_tokens: int, temperature: float, seed: int,
           lookup_tokens: int) -> tuple[list[int], float]:
    """New tokens and wall seconds of one HF generate: plain, prompt lookup, or assisted by `draft`."""
    import torch

    generation_config = hf_generation_config(max_new_tokens, temperature,
                                             lookup_tokens if config == "hf-lookup" else None)
    kwargs: dict[str, Any] = {}
    if config == "hf-assisted":
        draft.model.generation_config = hf_generation_config(max_new_tokens, temperature)
        kwargs["assistant_model"] = draft.model
    prompt = torch.tensor([ids], device=target.device)
    torch.manual_seed(seed)
    began = time.perf_counter()
    with torch.no_grad():
        out = target.model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                    generation_config=generation_config, **kwargs)
    seconds = time.perf_counter() - began
    return out[0, len(ids):].tolist(), seconds


def source_counts(result) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """A result's drafts by source (stats.sources) and its iterations by source ("none": nothing drafted)."""
    sources = {name: {"drafts": s.drafts, "drafted_tokens": s.drafted_tokens,
                      "accepted_tokens": s.accepted_tokens} for name, s in result.stats.sources.items()}
    iterations: dict[str, int] = defaultdict(int)
    for record in result.iterations:
        iterations[record.source or "none"] += 1
    return sources, dict(iterations)


async def specdec_run(client, config: str, ids: list[int], max_new_tokens: int, temperature: float,
                      request_id: str, cache_salt: str | None = None) -> dict[str, Any]:
    from specdec.generation import GenerationRequest
    from specdec.sampling_params import SamplingParams

    request = GenerationRequest(prompt_ids=list(ids), max_new_tokens=max_new_tokens,
                                sampling=SamplingParams(temperature=temperature), stop_token_ids=[],
                                draft_source=REQUEST_SOURCE[config], method=REQUEST_METHOD.get(config),
                                request_id=request_id, cache_salt=cache_salt or request_id)
    began = time.perf_counter()
    result = await client.generate(request)
    seconds = time.perf_counter() - began
    sources, iterations = source_counts(result)
    return {"token_ids": list(result.token_ids), "seconds": seconds, "iterations": result.stats.iterations,
            "cached_tokens": result.stats.cached_tokens, "sources": sources,
            "iterations_by_source": iterations, "method": result.method}


async def flush_cache(client, count: int, tag: str) -> None:
    """`count` one-token requests that enter the suffix cache: what was there before is evicted."""
    from specdec.generation import GenerationRequest
    from specdec.sampling_params import SamplingParams

    for n in range(count):
        request = GenerationRequest(prompt=FILLER.format(n=n), max_new_tokens=1, stop_token_ids=[],
                                    sampling=SamplingParams(temperature=0.0), draft_source="suffix",
                                    request_id=f"{tag}-{n}")
        await client.generate(request)


def eos_at(tokens: list[int], eos_ids: set[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in eos_ids), None)


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """os.environ with `values` set (None: unset) for what starts inside, restored afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def up_args(server: str, args: argparse.Namespace) -> list[str]:
    extra = shlex.split(args.extra_up_args)
    if server == "A":
        return ["--draft", args.draft, "--target", args.target, "--dtype", args.dtype, *extra]
    return ["--drafter", "none", "--target", args.target, "--dtype", args.dtype, *extra]


PER_TENSOR = "int8-per-tensor"  # torch.ao's dynamic int8 (one activation scale a pass): plain HF's fastest


def load_hf_target(path, dtype: str, threads: int):
    """The target for the HF rows: a specdec precision, or int8-per-tensor (what a user of plain HF
    runs for speed on a CPU: `quantize_dynamic` on every Linear, float32 attention)."""
    import warnings

    import torch

    from specdec.runtime.loading import load_model

    if dtype != PER_TENSOR:
        return load_model(path, dtype=dtype, threads=threads)
    loaded = load_model(path, dtype="float32", threads=threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded.model = torch.ao.quantization.quantize_dynamic(loaded.model, {torch.nn.Linear},
                                                              dtype=torch.qint8, inplace=True)
    return loaded


def start_server(server: str, name: str, args: argparse.Namespace, cache_requests: int | None, progress: Say,
                 extra: Sequence[str] = ()):
    from bench.bench_serving import SpecdecServer

    if getattr(args, "trace", False):  # each server's spans in a file of its own (the breakdown)
        extra = [*extra, "--trace-file", str(args.out / f"trace-{name}.jsonl")]

    spec = SpecdecServer(name, [*up_args(server, args), *extra], args.out)
    progress(f"[{name}] starting: specdec up {shlex.join(spec.up_args)}"
             + (f" (SPECDEC_SUFFIX_CACHE_REQUESTS={cache_requests})" if cache_requests is not None else ""))
    began = time.perf_counter()
    with environment(SPECDEC_USE_CALIBRATION="false",
                     SPECDEC_SUFFIX_CACHE_REQUESTS=None if cache_requests is None else str(cache_requests)):
        spec.start()
    progress(f"[{name}] ready in {time.perf_counter() - began:.1f} s (draft source "
             f"{spec.info.get('draft_source') or 'default'})")
    return spec


class Harness:
    """The loaded HF models, the prompts' ids and the rows measured so far."""

    def __init__(self, args: argparse.Namespace, progress: Say) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from specdec.models import resolve_model
        from specdec.runtime.loading import load_model

        hf_logging.disable_progress_bar()
        torch.set_num_threads(args.hf_threads)
        self.args, self.progress = args, progress
        self.target = load_hf_target(resolve_model(args.target), args.hf_dtype or args.dtype, args.hf_threads)
        self.draft = None
        if "hf-assisted" in args.configs:
            self.draft = load_model(resolve_model(args.draft), dtype=args.dtype, threads=args.hf_threads)
        self.tokenizer = self.target.tokenizer
        self.items = workload_items(args.workloads, args.per_kind)
        self.ids = {item.id: prompt_ids(item, self.tokenizer, args.max_prompt_tokens)
                    for items in self.items.values() for item in items}
        self.index = {item_id: i for i, item_id in enumerate(self.ids)}
        eos = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        self.eos_ids = eos | set(_as_list(getattr(self.target.model.generation_config, "eos_token_id", None)))
        self.walk = units(self.items)
        self.cache_requests = CACHE_REQUESTS if args.cache_flush else None
        self.details: list[dict[str, Any]] = []
        self.hf_warm = False
        self.requests = 0

    def describe(self) -> str:
        lengths = sorted(len(v) for v in self.ids.values())
        return (f"{len(self.ids)} prompts ({', '.join(f'{w} {len(v)}' for w, v in self.items.items())}), "
                f"{lengths[0]}–{lengths[-1]} tokens (median {statistics.median(lengths):g}); "
                f"{generations(self.args, self.items)} measured generations of "
                f"{self.args.max_new_tokens} tokens")

    def request_id(self, tag: str) -> str:
        self.requests += 1
        return f"grounded-{os.getpid()}-{tag}-{self.requests}"

    def hf(self, config: str, ids: list[int], max_new_tokens: int, temperature: float, seed: int):
        return hf_run(self.target, self.draft, config, ids, max_new_tokens, temperature, seed,
                      self.args.lookup_tokens)

    async def phase(self, rnd: int, configs: list[str], addresses: dict[str, str]) -> None:
        """One phase of a round: warm-up, then every unit × temperature × configuration, each
        configuration's requests to its server's orchestrator (`addresses`: server → address)."""
        from specdec.client import AsyncClient

        args = self.args
        clients = {server: AsyncClient(address, timeout_s=args.request_timeout)
                   for server, address in addresses.items()}
        try:
            first = self.ids[self.walk[0][0].id]
            for config in configs:  # warm-up, not counted
                if config not in HF_CONFIGS:
                    await specdec_run(clients[CONFIG_SERVER[config]], config, first, args.warmup_tokens,
                                      args.temperatures[0], self.request_id("warmup"))
                elif not self.hf_warm:
                    self.hf(config, first, args.warmup_tokens, args.temperatures[0], 0)
            self.hf_warm = self.hf_warm or any(c in HF_CONFIGS for c in configs)
            for unit in self.walk:
                for temperature in args.temperatures:
                    for config in configs:
                        client = clients.get(CONFIG_SERVER.get(config, ""))
                        if config in CACHE_CONFIGS and self.cache_requests is not None:
                            await flush_cache(client, self.cache_requests, self.request_id("flush"))
                        # One prefix-cache partition per pass over a unit: an agent family's later turns
                        # find its earlier ones, no run finds another configuration's or round's.
                        salt = self.request_id(f"salt-{config}")
                        for item in unit:
                            row = await self.one(client, config, item, temperature, rnd, salt)
                            self.details.append(row)
                            self.progress(brief(row))
        finally:
            for client in clients.values():
                await client.close()

    async def one(self, client, config: str, item: Item, temperature: float, rnd: int,
                  salt: str | None = None) -> dict[str, Any]:
        args, ids = self.args, self.ids[item.id]
        if config in HF_CONFIGS:
            seed = 1000 * rnd + self.index[item.id]
            tokens, seconds = self.hf(config, ids, args.max_new_tokens, temperature, seed)
            measured: dict[str, Any] = {"token_ids": tokens, "seconds": seconds}
        else:
            measured = await specdec_run(client, config, ids, args.max_new_tokens, temperature,
                                         self.request_id(config), salt)
        tokens = measured["token_ids"]  # kept: bench.greedy_text compares the configurations' texts
        return {"round": rnd, "config": config, "temperature": temperature, "item": item.id,
                "workload": item.workload, "kind": item.kind, "row": row_of(item), "turn": item.turn,
                "prompt_tokens": len(ids), "tokens": len(tokens), "tok_s": len(tokens) / measured["seconds"],
                "eos_at": eos_at(tokens, self.eos_ids), **measured}

    def results(self) -> dict[str, Any]:
        return {"summary": summarize(self.details, self.args.configs, self.args.temperatures),
                "greedy_text": agreement(self.details, self.args.configs), "details": self.details}


def run(args: argparse.Namespace, progress: Say = say) -> dict[str, Any]:
    """Every round's phases (their servers started and stopped around them), then the serving level."""
    harness = Harness(args, progress)
    progress(harness.describe())
    for rnd in range(args.rounds):
        for servers, configs in phases(args.configs, getattr(args, "servers_apart", False)):
            specs = {}
            try:
                for server in servers:
                    specs[server] = start_server(server, f"{server}-r{rnd}", args, harness.cache_requests,
                                                 progress)
                asyncio.run(harness.phase(rnd, configs, {s: spec.info["orchestrator"]
                                                         for s, spec in specs.items()}))
            finally:
                for spec in specs.values():
                    progress(f"[{spec.name}] stopping")
                    spec.stop()
            (args.out / "results.json").write_text(json.dumps(harness.results(), indent=1))  # partial results
    results = harness.results()
    if getattr(args, "trace", False):
        results["breakdown"] = iteration_breakdown(args.out)
    if args.serving_clients:
        grounded = harness.items.get("grounded") or workload_items(["grounded"], args.per_kind)["grounded"]
        results["serving"] = serving(args, grounded, harness.tokenizer, progress)
    return results


def iteration_breakdown(folder: Path) -> dict[str, Any]:
    """Per configuration, milliseconds per iteration and per call from the servers' spans
    (bench.bench_iteration.breakdown: compute = forward + verification, engine, handler, wire, loop)."""
    from bench.bench_iteration import breakdown, load_spans

    spans = [span for path in sorted(folder.glob("trace-*.jsonl")) for span in load_spans(path)]
    configs: dict[str, str] = {}
    for span in spans:
        request = span["attributes"].get("specdec.request_id") if span["name"] == "specdec.request" else None
        parts = (request or "").split("-")
        if len(parts) >= 4 and parts[0] == "grounded":
            configs[request] = "-".join(parts[2:-1])
    out: dict[str, Any] = {}
    for config, figures in breakdown(spans, configs).items():
        if config not in CONFIGS:
            continue
        iterations = figures["iterations"]
        out[config] = {
            "iterations": len(iterations["wall"]),
            "iteration_ms": _median([1e3 * x for x in iterations["wall"]]),
            "between_calls_ms": _median([1e3 * x for x in iterations["between calls"]]),
            "calls": {op: {part: _median([1e3 * x for x in values]) for part, values in parts.items()}
                      | {"count": len(parts["total"])} for op, parts in figures["calls"].items()},
        }
    return out


def render_breakdown(breakdown_: dict[str, Any]) -> list[str]:
    lines = ["", "## Per iteration (medians, ms; from the servers' spans)", "",
             "| configuration | iterations | iteration | between calls | call | calls | compute | engine "
             "| handler | wire | loop | call total |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for config, row in breakdown_.items():
        for op, call in sorted(row["calls"].items()):
            lines.append(
                f"| {config} | {row['iterations']} | {_cell(row['iteration_ms'])} | "
                f"{_cell(row['between_calls_ms'])} | {op} | {call['count']} | {_cell(call['compute'])} | "
                f"{_cell(call['engine'])} | {_cell(call['handler'])} | {_cell(call['wire'])} | "
                f"{_cell(call['loop'])} | {_cell(call['total'])} |")
    lines += ["", "compute: the engine's forward pass(es) and verification rule; engine: the engine call "
              "around them (sessions, KV bookkeeping, rows); handler: proto ↔ dataclass and the hand-off "
              "to the worker thread; wire: gRPC (de)serialisation, the socket and scheduling; loop: the "
              "orchestrator's span around the RPC (waiting for an earlier call of the run, timing); "
              "between calls: the iteration's time with no call in flight."]
    return lines


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def brief(row: dict[str, Any]) -> str:
    extra = ""
    if "sources" in row:
        drafted = ", ".join(f"{name} {s['accepted_tokens']}/{s['drafted_tokens']} in {s['drafts']}"
                            for name, s in sorted(row["sources"].items()))
        extra = f", {row['iterations']} iterations" + (f", accepted/drafted {drafted}" if drafted else "")
    return (f"round {row['round']} {row['item']} T={row['temperature']:g} {row['config']}: "
            f"{row['tok_s']:.2f} tok/s ({row['tokens']} tokens in {row['seconds']:.1f} s{extra})")


# ----------------------------------------------------------------------------------------------
# the serving level
# ----------------------------------------------------------------------------------------------
def serving(args: argparse.Namespace, items: list[Item], tokenizer, progress: Say) -> dict[str, Any]:
    """--serving-clients closed-loop clients on the grounded prompts, against default `up` (specdec)
    and `up --drafter none`, one level per temperature, each on a freshly started server."""
    from bench.bench_serving import Case, Sampling, SpecdecBackend, prompt_cycle, run_level, warm_up
    from bench.bench_serving import summarize as summarize_level

    cases = [Case(item.id, render_text(item, tokenizer),
                  tuple(prompt_ids(item, tokenizer, args.max_prompt_tokens))) for item in items]
    warm_ids = tuple(tokenizer(WARMUP_TEXT, add_special_tokens=False)["input_ids"])
    warm_case = Case("warm-up", WARMUP_TEXT, warm_ids)
    out: dict[str, Any] = {"clients": args.serving_clients, "seconds": args.serving_seconds,
                           "prompts": len(cases), "levels": []}
    for name in SERVING_CONFIGS:
        if name not in args.serving_configs:
            continue
        for temperature in args.temperatures:
            spec = start_server(SERVING_SERVERS[name], f"serving-{name}-T{temperature:g}", args, None,
                                progress, extra=["--metrics-port", "0"])
            try:
                sampling = Sampling(args.max_new_tokens, temperature, None, REQUEST_METHOD.get(name),
                                    salt_per_request=args.serving_fresh)
                timeout_s = args.serving_seconds + args.drain_timeout + 60
                backend = SpecdecBackend(spec.info["orchestrator"], sampling, timeout_s, f"{spec.name}")
                warm = asyncio.run(warm_up(backend, warm_case, timeout_s))
                if warm.error is not None:
                    raise SystemExit(f"[{spec.name}] warm-up request failed: {warm.error}")
                progress(f"[{spec.name}] {args.serving_clients} clients for {args.serving_seconds:g} s …")
                before = scrape_counters(spec.info)
                level = asyncio.run(run_level(backend, prompt_cycle(cases), args.serving_clients,
                                              args.serving_seconds, args.drain_timeout, progress))
                passes = pass_summary(before, scrape_counters(spec.info))
            finally:
                spec.stop()
            summary = summarize_level(level.records, level.elapsed, {})
            summary.update(config=name, temperature=temperature, passes=passes, fresh=args.serving_fresh,
                           command=shlex.join(["specdec", "up", *spec.up_args]),
                           repeats=max(0, len(level.records) - len(cases)),
                           records=[asdict(r) for r in level.records])
            out["levels"].append(summary)
            progress(f"[{spec.name}] {summary['aggregate_tok_s']:.2f} tok/s aggregate, "
                     f"{summary['requests']} done, {summary['errors']} errors")
    return out


def scrape_counters(info: dict[str, Any]) -> dict[str, float]:
    """The verifier's VERIFIER_COUNTERS (role verifier) and the orchestrator's ORCHESTRATOR_COUNTERS,
    each summed over its labels but `source` and `drafted` ("name{source}"), from `up`'s /metrics."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = defaultdict(float)
    urls = info.get("metrics") or {}
    for service, wanted in (("verifier", VERIFIER_COUNTERS), ("orchestrator", ORCHESTRATOR_COUNTERS)):
        if service not in urls:
            continue
        with urlopen(urls[service], timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in wanted or sample.labels.get("role", "verifier") != "verifier":
                    continue
                part = sample.labels.get("source") or sample.labels.get("drafted")
                out[f"{sample.name}{{{part}}}" if part else sample.name] += sample.value
    return dict(out)


def pass_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the verifier's batched passes carried over a level (the counters' differences): passes,
    calls per pass, query rows per pass (padding included), the padding's share, seconds per pass,
    and the orchestrator's emitted tokens per query row (how much of the passes' work became output)."""
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    passes = delta.get("specdec_batches_total", 0.0)
    rows = delta.get("specdec_batch_tokens_total", 0.0)
    positions = delta.get("specdec_batch_positions_total", 0.0)
    seconds = delta.get("specdec_batch_seconds_total", 0.0)
    emitted = delta.get("specdec_emitted_tokens_total", 0.0)
    drafted = {key.split("{")[1].rstrip("}"): value for key, value in delta.items()
               if key.startswith("specdec_source_drafted_tokens_total{")}
    accepted = {key.split("{")[1].rstrip("}"): value for key, value in delta.items()
                if key.startswith("specdec_source_accepted_tokens_total{")}
    return {
        "counters": delta,
        "passes": passes,
        "calls_per_pass": delta.get("specdec_batch_calls_total", 0.0) / passes if passes else None,
        "rows_per_pass": rows / passes if passes else None,
        "padding_share": 1.0 - positions / rows if rows else None,
        "seconds_per_pass": seconds / passes if passes else None,
        "rows_per_second": rows / seconds if seconds else None,
        "emitted_per_row": emitted / rows if rows else None,
        "emitted_per_position": emitted / positions if positions else None,
        "acceptance_by_source": {s: accepted.get(s, 0.0) / d for s, d in drafted.items() if d},
    }


# ----------------------------------------------------------------------------------------------
# the summary and the tables
# ----------------------------------------------------------------------------------------------
def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(details: list[dict[str, Any]], configs: Sequence[str], temperatures: Sequence[float]
              ) -> dict[str, Any]:
    """Per temperature ("0", "1"), table row (ROWS, then "kind:<workload>/<kind>") and configuration:
    n, tok/s median, median ratio to hf (same prompt, temperature and round), drafts by source and
    iterations by source (summed over the rows)."""
    hf = {(d["round"], d["item"], d["temperature"]): d["tok_s"] for d in details if d["config"] == "hf"}
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for d in details:
        t = f"{d['temperature']:g}"
        groups[(t, d["row"], d["config"])].append(d)
        groups[(t, f"kind:{d['workload']}/{d['kind']}", d["config"])].append(d)
    out: dict[str, Any] = {}
    for (t, row, config), rows in groups.items():
        ratios = [d["tok_s"] / hf[key] for d in rows
                  if (key := (d["round"], d["item"], d["temperature"])) in hf and hf[key] > 0]
        sources: dict[str, dict[str, float]] = {}
        for name in sorted({name for d in rows for name in d.get("sources", {})}):
            counts = [d["sources"].get(name, {}) for d in rows if "sources" in d]
            drafts = sum(c.get("drafts", 0) for c in counts)
            drafted = sum(c.get("drafted_tokens", 0) for c in counts)
            accepted = sum(c.get("accepted_tokens", 0) for c in counts)
            sources[name] = {"drafts": drafts, "drafted_tokens": drafted, "accepted_tokens": accepted,
                             "mean_accepted": accepted / drafts if drafts else 0.0,
                             "acceptance": accepted / drafted if drafted else 0.0}
        iterations: dict[str, int] = defaultdict(int)
        for d in rows:
            for name, count in d.get("iterations_by_source", {}).items():
                iterations[name] += count
        out.setdefault(t, {}).setdefault(row, {})[config] = {
            "n": len(rows),
            "tok_s": _median([d["tok_s"] for d in rows]),
            "ratio": _median(ratios) if config != "hf" else (1.0 if rows else None),
            "sources": sources,
            "iterations_by_source": dict(iterations),
            "eos_runs": sum(d.get("eos_at") is not None for d in rows),
        }
    return {"configs": list(configs), "temperatures": [f"{t:g}" for t in temperatures], "table": out}


def _cell(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{format(value, spec)}{suffix}"


def _rows(table: dict[str, Any]) -> list[str]:
    """The workload rows, then the kinds of the workloads that have several (grounded, open)."""
    main = [r for r in ROWS if r in table]
    kinds = sorted(r for r in table if r.startswith(KIND_ROWS))
    return main + kinds


def render_tables(summary: dict[str, Any]) -> list[str]:
    configs = summary["configs"]
    lines: list[str] = []
    for t in summary["temperatures"]:
        table = summary["table"].get(t, {})
        if not table:
            continue
        rows = _rows(table)
        main_rows = [r for r in rows if not r.startswith("kind:")]
        lines += ["", f"### T = {t}", "",
                  "tok/s (median; in brackets × hf, the median of per-run ratios to hf on the same prompt, "
                  "temperature and round):", "",
                  "| workload | " + " | ".join(configs) + " |", "|---|" + "---:|" * len(configs)]
        for row in rows:
            cells = []
            for config in configs:
                entry = table[row].get(config)
                if entry is None or entry["tok_s"] is None:
                    cells.append("–")
                elif config == "hf" or entry["ratio"] is None:
                    cells.append(f"{entry['tok_s']:.2f}")
                else:
                    cells.append(f"{entry['tok_s']:.2f} ({entry['ratio']:.2f}×)")
            label = row.removeprefix("kind:")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        runs = [e for row in main_rows for e in table[row].values()]
        eos = sum(e["eos_runs"] for e in runs)
        if eos:
            lines += ["", f"{eos} of {sum(e['n'] for e in runs)} runs produced an EOS token (and went on "
                      "past it: no stop tokens; results.json has each run's eos_at)."]
        server_configs = [c for c in configs if c not in HF_CONFIGS]
        if not server_configs:
            continue
        lines += ["", "Drafts by source (server rows): per source, mean accepted tokens per draft / "
                  "acceptance (drafts); iterations: share by source, none = target-only steps.", "",
                  "| workload | config | " + " | ".join(SOURCES) + " | iterations |",
                  "|---|---|" + "---:|" * len(SOURCES) + "---|"]
        for row in main_rows:
            for config in server_configs:
                entry = table[row].get(config)
                if entry is None:
                    continue
                cells = []
                for name in SOURCES:
                    s = entry["sources"].get(name)
                    cells.append("–" if not s or not s["drafts"] else
                                 f"{s['mean_accepted']:.2f} / {s['acceptance']:.2f} ({s['drafts']})")
                total = sum(entry["iterations_by_source"].values())
                shares = ", ".join(f"{name} {count / total:.0%}"
                                   for name, count in sorted(entry["iterations_by_source"].items(),
                                                             key=lambda kv: -kv[1])) if total else "–"
                lines.append(f"| {row} | {config} | " + " | ".join(cells) + f" | {shares} |")
    return lines


def render_serving(serving_results: dict[str, Any]) -> list[str]:
    r = serving_results
    caches = ("every request its own cache salt (no shared prefix or suffix cache entries)"
              if any(level.get("fresh") for level in r["levels"]) else "default suffix cache")
    lines = ["", f"### Serving: {r['clients']} closed-loop clients, {r['seconds']:g} s per level, "
             f"{r['prompts']} grounded prompts, each level on a fresh server ({caches})", "",
             "| config | T | agg tok/s | req tok/s p50 | latency p50 s | TTFT p50 s | ITL p50 s | ITL p99 s "
             "| done | errors | repeats |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for level in r["levels"]:
        lines.append(f"| {level['config']} | {level['temperature']:g} | {level['aggregate_tok_s']:.2f} | "
                     f"{_cell(level['request_tok_s_p50'])} | {_cell(level['latency_p50_s'])} | "
                     f"{_cell(level.get('ttft_p50_s'), '.1f')} | {_cell(level.get('itl_p50_s'), '.3f')} | "
                     f"{_cell(level.get('itl_p99_s'), '.3f')} | {level['requests']} | {level['errors']} | "
                     f"{level['repeats']} |")
    with_passes = [level for level in r["levels"] if level.get("passes")]
    if with_passes:
        lines += ["", "What the verifier's batched passes carried over each level (its /metrics before and "
                  "after; prefill chunks that run in passes of their own, as the padded layout runs them, "
                  "are not in them): calls and query rows per pass "
                  "(padding included), the padding's share of the rows, seconds per pass, and output tokens "
                  "per row.", "",
                  "| config | T | passes | calls/pass | rows/pass | padding | s/pass | rows/s | tokens/row |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for level in with_passes:
            p = level["passes"]
            lines.append(f"| {level['config']} | {level['temperature']:g} | {p['passes']:.0f} | "
                         f"{_cell(p['calls_per_pass'])} | {_cell(p['rows_per_pass'], '.1f')} | "
                         f"{_cell(p['padding_share'], '.0%')} | {_cell(p['seconds_per_pass'], '.3f')} | "
                         f"{_cell(p['rows_per_second'], '.0f')} | {_cell(p['emitted_per_row'])} |")
    return lines


def _cache_note(meta: dict[str, Any]) -> str:
    if not meta["rounds"] or not set(meta["configs"]) & set(CACHE_CONFIGS):
        return ""
    if meta["cache_flush"]:
        return (f"; suffix cache flushed before each run that reads it (SPECDEC_SUFFIX_CACHE_REQUESTS="
                f"{meta['cache_requests']}, {meta['cache_requests']} fillers)")
    return "; suffix cache left as it is (default size, no fillers: repeats copy earlier runs)"


def render(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"# Grounded prompts ({meta['date']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['machine']}. Models: {meta['draft']} → {meta['target']}, precision {meta['dtype']}; "
        f"{meta['max_new_tokens']} new tokens (no EOS stop), T = {', '.join(meta['temperatures'])}; "
        f"{meta['rounds']} round(s), {meta['per_kind']} prompt(s) per kind, workloads "
        f"{', '.join(meta['workloads'])}; HF rows with {meta['hf_threads']} thread(s) at "
        f"{meta.get('hf_dtype', meta['dtype'])}"
        + _cache_note(meta) + ".",
    ]
    lines += render_tables(results["summary"])
    lines += render_agreement(results.get("greedy_text"))
    if results.get("breakdown"):
        lines += render_breakdown(results["breakdown"])
    if results.get("serving"):
        lines += render_serving(results["serving"])
    lines += [
        "",
        "Rows: grounded (code edits, renames, extraction, summaries, RAG, YAML ↔ JSON), multiturn "
        "(the answer repeats an earlier assistant turn), agent (one file and tool protocol, four small "
        "instructions as consecutive turns: turn 1 cold, turns ≥ 2 after the family's earlier turns), "
        "open (HumanEval, MT-bench, prose); below them the same per kind. specdec, lookup, suffix, "
        "model: one `specdec up` with the draft model (requests naming draft_source; specdec names "
        "none); drafter-none and target-only: `specdec up --drafter none`, "
        + ("in a phase of its own after the first server's in each round (--servers-apart)."
           if meta.get("servers_apart") else "up beside the first one: every configuration runs on "
           "a prompt before the next prompt starts."),
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the command line
# ----------------------------------------------------------------------------------------------
def _choices(known: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        chosen = [x.strip() for x in text.split(",") if x.strip()]
        unknown = sorted(set(chosen) - set(known))
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; known: {', '.join(known)}")
        return [x for x in known if x in chosen]  # the fixed order

    return parse


def parse_temperatures(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"temperatures must be numbers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"temperatures must be ≥ 0, got {text!r}")
    return values


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.bench_grounded", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=_choices(CONFIGS, "configuration(s)"), default=list(CONFIGS),
                   help=f"comma-separated subset of {','.join(CONFIGS)} (default: all)")
    p.add_argument("--workloads", type=_choices(WORKLOADS, "workload(s)"), default=list(WORKLOADS),
                   help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)")
    p.add_argument("--temperatures", type=parse_temperatures, default=[0.0, 1.0],
                   help="comma-separated sampling temperatures, 0 = greedy (default 0,1)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2,
                   help="walks over every prompt (0: only the serving level)")
    p.add_argument("--per-kind", type=int, default=2,
                   help="prompts per grounded kind, multi-turn chats, agent families (each 4 turns; at most "
                        "3 of each) and prompts per open category (default 2)")
    p.add_argument("--draft", default=DEFAULT_DRAFT_MODEL)
    p.add_argument("--target", default=DEFAULT_TARGET_MODEL)
    p.add_argument("--dtype", default="int8", help="precision of every configuration (default int8)")
    p.add_argument("--hf-threads", type=int, default=default_threads(),
                   help="torch threads of the in-process HF rows (default: the machine's cores)")
    p.add_argument("--hf-dtype", default=None,
                   help=f"precision of the HF rows (default: --dtype, the same model and so the same "
                        f"greedy text as specdec's); {PER_TENSOR}: torch.ao's dynamic int8, what plain HF "
                        "users run for speed on a CPU (another text: bench/greedy_text.py)")
    p.add_argument("--trace", action="store_true",
                   help="servers write spans; the report adds a per-iteration breakdown per configuration")
    p.add_argument("--lookup-tokens", type=int, default=10, help="hf-lookup's prompt_lookup_num_tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=1024,
                   help="longer prompts keep their last tokens")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens of each warm-up request")
    p.add_argument("--cache-flush", action=argparse.BooleanOptionalAction, default=True,
                   help="evict the suffix cache before each run that reads it (see above; default on)")
    p.add_argument("--extra-up-args", default="", help="extra `specdec up` flags for both servers")
    p.add_argument("--servers-apart", action="store_true",
                   help="never run the two servers at once: server B's configurations in a phase of their "
                        "own after A's (their × hf then compares runs minutes apart; see above)")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--serving-clients", type=int, default=0,
                   help="also run this many concurrent clients on the grounded prompts (0: no serving level)")
    p.add_argument("--serving-seconds", type=float, default=300.0,
                   help="how long the serving level starts requests")
    p.add_argument("--serving-configs", type=_choices(SERVING_CONFIGS, "serving configuration(s)"),
                   default=["specdec", "drafter-none"],
                   help="servers of the serving level: specdec (default `up`), drafter-none, target-only "
                        "(`up --drafter none`, every request method autoregressive); default the first two")
    p.add_argument("--serving-fresh", action="store_true",
                   help="every serving request carries its own cache_salt: no request finds another's "
                        "prompt or answer in the prefix or suffix caches")
    p.add_argument("--drain-timeout", type=float, default=900.0,
                   help="seconds the serving level's requests in flight may take after its time is up")
    p.add_argument("--out", type=Path, default=None, help="folder for results.json and grounded.md")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    positive = ("max_new_tokens", "per_kind", "hf_threads", "lookup_tokens", "max_prompt_tokens",
                "warmup_tokens")
    for name in positive:
        if getattr(args, name) < 1:
            parser().error(f"--{name.replace('_', '-')} must be ≥ 1")
    if args.rounds < 0 or args.serving_clients < 0:
        parser().error("--rounds and --serving-clients must be ≥ 0")
    args.out = args.out or Path(tempfile.mkdtemp(prefix="specdec-grounded-"))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {default_threads()} cores",
        "command": "python -m bench.bench_grounded " + shlex.join(argv),
        "draft": args.draft,
        "target": args.target,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "temperatures": [f"{t:g}" for t in args.temperatures],
        "rounds": args.rounds,
        "per_kind": args.per_kind,
        "workloads": args.workloads,
        "configs": args.configs,
        "hf_threads": args.hf_threads,
        "hf_dtype": args.hf_dtype or args.dtype,
        "lookup_tokens": args.lookup_tokens,
        "cache_flush": args.cache_flush,
        "servers_apart": args.servers_apart,
        "cache_requests": CACHE_REQUESTS,
    }
    results = run(args)
    text = render(results, meta)
    (args.out / "grounded.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, **results}, indent=1))
    print(text)
    say(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
