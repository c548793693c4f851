"""Step "overhead": what one speculation iteration costs besides the models, through the product's
services on loopback, with draft = target (same shape, same seed, so the same weights: every draft
is accepted up to the device's rounding).

The drafter and verifier engines run behind their real gRPC servers (drafter_service /
verifier_service, in this process, on 127.0.0.1) and the orchestrator's loop talks to them through
its gRPC clients, as `specdec up` wires them, minus the process boundaries. For k = 1, 2, 4, 8, one
and several concurrent requests, sequential and pipelined, per iteration:

    model        the engines' reported forward (+ verification) seconds of the iteration's calls
    engine       the engine calls' wall time in their worker threads, minus model
    hops         the client's view of each call minus the engine call (gRPC, proto conversion,
                 (de)serialisation, thread hand-offs), summed over the iteration's calls
    between      iteration wall time with no drafter or verifier call in flight: the orchestrator's
                 own CPU (planning, records, stop checks)
    syncs        host-device synchronisations per iteration, counted by torch's sync debug mode on
                 the same engine calls made directly (CUDA only)

bench.bench_iteration splits calls along OpenTelemetry spans, which the device image cannot record
(no OpenTelemetry there); the servers' engine-call observers (specdec.rpc.grpc_support.run_observed)
and timed clients give the same engine / hops split without spans. The draft rows stay at the
drafter (`draft_rows` parked): a verify carries one q per node, and rows only after a rejection.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from bench.device.common import StepArgs, StepResult, log, ms, run_step, table
from bench.device.shapes import REAL_SELF_PAIR_MODEL, TINY_SELF_PAIR_MODEL, loaded_model

FULL = {"ks": (1, 4, 8), "concurrency": (1, 8), "max_new_tokens": 32}
TINY = {"ks": (2,), "concurrency": (1, 2), "max_new_tokens": 6}
PROMPT_LEN = 64


@dataclass
class Calls:
    """Engine-side (observer) and client-side seconds of every call, by rpc name."""

    engine: list[float] = field(default_factory=list)
    model: list[float] = field(default_factory=list)
    client: list[float] = field(default_factory=list)

    def clear(self) -> None:
        self.engine.clear()
        self.model.clear()
        self.client.clear()


class EngineObserver:
    """specdec.rpc.grpc_support.run_observed's observer: the real start/end of each engine call."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def observe(self, rpc: str, request: Any, result: Any, error: Any, start_ns: int, end_ns: int) -> None:
        self.calls.engine.append((end_ns - start_ns) / 1e9)
        model = getattr(result, "forward_seconds", 0.0) + getattr(result, "verify_seconds", 0.0)
        self.calls.model.append(float(model))


class TimedClient:
    """An engine client whose model calls are timed as the orchestrator sees them."""

    TIMED = ("draft", "lookahead", "score", "verify")

    def __init__(self, inner: Any, calls: Calls) -> None:
        self._inner = inner
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name not in self.TIMED:
            return attribute

        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await attribute(*args, **kwargs)
            finally:
                self._calls.client.append(time.perf_counter() - start)

        return timed


def count_syncs(drafter: Any, verifier: Any, k: int, vocab: int, iterations: int, cuda: bool) -> float | None:
    """Host-device synchronisations per iteration (draft k, verify with method token), counted with
    torch.cuda.set_sync_debug_mode("warn") on direct engine calls; None off CUDA (the same calls run,
    so the dry run exercises them, but there is nothing to count)."""
    import torch

    from specdec.engine.api import DraftRequest, VerifyRequest
    from specdec.sampling import SamplingParams
    from specdec.trees import sequence_parents
    from specdec.verification.base import MethodParams

    sampling = SamplingParams(1.0)
    committed = torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    d_known = v_known = 0
    session = f"syncs-{k}"

    def iteration(i: int) -> None:
        nonlocal d_known, v_known
        draft = drafter.draft(
            DraftRequest(
                session,
                d_known,
                committed[d_known:],
                sequence_parents(k),
                sampling,
                seed=i,
                want_distributions=True,
            )
        )
        d_known = len(committed)
        outcome = verifier.verify(
            VerifyRequest(
                session,
                v_known,
                committed[v_known:],
                draft.tokens,
                draft.parents,
                "token",
                MethodParams(seed=i),
                sampling,
                draft_probs=draft.draft_probs,
            )
        )
        v_known = len(committed)
        committed.extend(outcome.tokens)

    iteration(0)  # prefill outside the count
    seen = 0

    def count(*_args: Any, **_kwargs: Any) -> None:
        nonlocal seen
        seen += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        before = warnings.showwarning
        warnings.showwarning = count
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(1, iterations + 1):
                iteration(i)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = before
    drafter.release(session)
    verifier.release(session)
    return seen / iterations if cuda else None


async def serve_and_measure(
    args: StepArgs, plan: dict, drafter: Any, verifier: Any, vocab: int
) -> list[dict]:
    from drafter_service.server import start_drafter_server
    from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient
    from orchestrator.config import OrchestratorConfig
    from orchestrator.intervals import covered
    from orchestrator.speculation import Orchestrator
    from specdec.generation import GenerationRequest
    from specdec.rpc.grpc_support import stop_server
    from specdec.sampling import SamplingParams
    from verifier_service.server import start_verifier_server

    calls = Calls()
    observer = EngineObserver(calls)
    d_server, d_port = await start_drafter_server(drafter, observers=[observer])
    v_server, v_port = await start_verifier_server(verifier, observers=[observer])
    records: list[Any] = []
    orchestrator = Orchestrator(
        TimedClient(GrpcDrafterClient(f"127.0.0.1:{d_port}", timeout_s=120), calls),
        TimedClient(GrpcVerifierClient(f"127.0.0.1:{v_port}", timeout_s=120), calls),
        OrchestratorConfig(draft_source="model", draft_rows="parked"),
        on_iteration=records.append,
    )
    rows: list[dict] = []
    generator = __import__("random").Random(3)
    try:
        await orchestrator.start()
        for pipelined in (False, True):
            for concurrency in plan["concurrency"]:
                for k in plan["ks"]:
                    if args.left_s() < 10:
                        log(f"overhead: budget spent before k={k} c={concurrency} pipelined={pipelined}")
                        continue

                    def request(i: int, k: int = k, pipelined: bool = pipelined) -> GenerationRequest:
                        prompt = [generator.randrange(vocab - 1) for _ in range(PROMPT_LEN)]
                        return GenerationRequest(
                            prompt_ids=prompt,
                            max_new_tokens=plan["max_new_tokens"],
                            sampling=SamplingParams(1.0),
                            stop_token_ids=[],
                            seed=100 + i,
                            method="token",
                            k=k,
                            pipeline=pipelined,
                            draft_source="model",
                        )

                    await orchestrator.generate(request(0))  # warm-up of this configuration's shapes
                    records.clear()
                    calls.clear()
                    start = time.perf_counter()
                    results = await asyncio.gather(
                        *(orchestrator.generate(request(i)) for i in range(concurrency))
                    )
                    wall = time.perf_counter() - start
                    iterations = max(1, len(records))
                    tokens = sum(len(r.token_ids) for r in results)
                    drafted = sum(r.stats.drafted_tokens for r in results)
                    accepted = sum(r.stats.accepted_tokens for r in results)
                    iteration_walls = [r.end - r.start for r in records]
                    busy = [
                        covered(
                            [
                                (max(r.start, a), min(r.end, b))
                                for a, b in (*r.draft_intervals, *r.verify_intervals)
                                if a < r.end
                            ]
                        )
                        for r in records
                    ]
                    hops = sum(calls.client) - sum(calls.engine)
                    rows.append(
                        {
                            "k": k,
                            "concurrency": concurrency,
                            "pipelined": pipelined,
                            "iterations": iterations,
                            "tokens": tokens,
                            "seconds": wall,
                            "tokens_per_s": tokens / wall,
                            "acceptance": accepted / drafted if drafted else 0.0,
                            "tokens_per_iteration": tokens / iterations,
                            "wall": statistics.mean(iteration_walls) if iteration_walls else 0.0,
                            "model": sum(calls.model) / iterations,
                            "engine": (sum(calls.engine) - sum(calls.model)) / iterations,
                            "hops": hops / iterations,
                            "between": statistics.mean(
                                w - b for w, b in zip(iteration_walls, busy, strict=True)
                            )
                            if records
                            else 0.0,
                            "calls_per_iteration": len(calls.client) / iterations,
                        }
                    )
                    log(f"overhead: k={k} c={concurrency} pipelined={pipelined}: {tokens / wall:.1f} tok/s")
    finally:
        await orchestrator.close()
        await stop_server(d_server, 0.0)
        await stop_server(v_server, 0.0)
    return rows


def step(args: StepArgs) -> StepResult:
    import torch

    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine
    from specdec.runtime.kv_pool import PoolConfig

    dtype = "bfloat16" if args.cuda else "float32"
    name = TINY_SELF_PAIR_MODEL if args.tiny else REAL_SELF_PAIR_MODEL
    plan = TINY if args.tiny else FULL
    if not args.cuda:
        torch.set_num_threads(1)
    # Two engines, two builds with one seed: the same weights, as two services would load them.
    draft_model = loaded_model(name, args.device, dtype, seed=0)
    # The services' CUDA default: captured passes over a KV pool (on the CPU the same pool, eagerly).
    pool = PoolConfig(slots=12, slot_tokens=256 if args.tiny else 512, capture=args.cuda)
    drafter = DrafterEngine(draft_model, kv_pool=pool)
    verifier = VerifierEngine(loaded_model(name, args.device, dtype, seed=0, tokenizer=draft_model.tokenizer),
                              kv_pool=pool)
    vocab = verifier.info().vocab_size
    syncs: dict[int, float | None] = {}
    for k in plan["ks"]:
        syncs[k] = count_syncs(drafter, verifier, k, vocab, 3, args.cuda)
    rows = asyncio.run(serve_and_measure(args, plan, drafter, verifier, vocab))
    for row in rows:
        row["syncs"] = syncs[row["k"]]
    header = [
        "k",
        "requests",
        "pipelined",
        "tok/s",
        "accept",
        "tok/iter",
        "wall",
        "model",
        "engine",
        "hops",
        "between",
        "syncs",
    ]
    body = [
        [
            r["k"],
            r["concurrency"],
            "yes" if r["pipelined"] else "no",
            f"{r['tokens_per_s']:.1f}",
            f"{r['acceptance']:.3f}",
            f"{r['tokens_per_iteration']:.2f}",
            ms(r["wall"]),
            ms(r["model"]),
            ms(r["engine"]),
            ms(r["hops"]),
            ms(r["between"]),
            "n/a" if r["syncs"] is None else f"{r['syncs']:.1f}",
        ]
        for r in rows
    ]
    text = (
        f"Draft = target = {name} (random weights, seed 0, built twice), {dtype} on {args.device}; "
        f"method token, T = 1, prompts of {PROMPT_LEN} random tokens, {plan['max_new_tokens']} new tokens "
        "per request; drafter and verifier behind their gRPC servers on 127.0.0.1 in this process, "
        "captured passes over a KV pool (CUDA), draft rows parked at the drafter. "
        "Per iteration, mean ms (with several requests the iterations overlap, so wall > 1/rate):\n\n"
        + table(header, body)
        + "\n\nmodel: engines' forward + verification seconds; engine: engine call wall minus model; hops: "
        "client-side call time minus engine call (gRPC, conversion, threads); between: no call "
        "in flight (orchestrator CPU); syncs: host-device synchronisations (direct engine calls)."
    )
    sequential = [r for r in rows if r["concurrency"] == 1 and not r["pipelined"]]
    findings = [
        f"k={r['k']}: overhead (wall - model) {ms(r['wall'] - r['model'])} ms per iteration, "
        f"acceptance {r['acceptance']:.3f}"
        for r in sequential
    ]
    if not rows:
        raise RuntimeError("no configuration measured within the budget")
    return StepResult(text, {"model": name, "dtype": dtype, "rows": rows}, findings)


if __name__ == "__main__":
    sys.exit(run_step(step, description=__doc__))
