"""Step "loop": the real loop end to end, drafter and verifier as separate processes on the one GPU.

Each pair's drafter and verifier run in processes of their own (bench.device.serve_shape: random
weights, captured passes, the real gRPC servers on 127.0.0.1); this process runs the
orchestrator's loop through its gRPC clients, one request at a time, T = 1:

- target-only decoding (`autoregressive`) through the same verifier: the fair baseline;
- `token` with k = 2, 4, 8 (drafts from the draft model, `draft_rows` "parked": the rows stay at
  the drafter).

Pairs (SPECDEC_LOOP_PAIRS, default both):
- "random": the 0.5B shape → the 7B shape (the draft's vocabulary padded to the target's, as
  Qwen2.5's checkpoints share one tokenizer). Independent random weights agree little (α ≈ 0.5
  measured 2026-11-27), far below real pairs (α ≈ 0.9 for the CPU default pair);
- "self": the 7B shape's own first two layers (same seed: the same embeddings, layers and head) →
  the 7B shape. Measured 2026-11-27: α ≈ 0.4, no closer than the random pair;
- "damped" (default with "random"): the same draft → the 7B shape whose layers 2.. have their
  output projections scaled by 0.05 (bench.device.shapes.build_model's `damp`), so those layers
  add little to the residual stream and the draft agrees about as a real pair does (α ≈ 0.9 for
  the CPU default pair). The target's pass costs what the 7B's costs: same shapes, same kernels.

Per k it reports tokens/s (median of the requests), α per token (solved from the mean accepted
drafts per iteration, Σ_{i=1..k} α^i, as docs/algorithms.md §7 models it), the speedup over the
baseline, and beside it §7's projection at that α from this run's pass times (step "captured"
for the random pair; the drafter's own reported forward time for the self pair):

    S(k) = E[tokens/iter](α, k) · T_p(1) / (k · T_q + T_p(k + 1))

(no loop overhead in it: the gap between the two is what the loop costs). The loop overhead per
iteration is the iteration's wall time less k · T_q + T_p(k + 1).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.device.common import StepArgs, StepResult, log, ms, run_step, table
from bench.device.fidelity import Service

PAIRS = {  # name: (draft shape, its kept layers or None, target shape, shared vocabulary, target damping)
    "random": ("qwen2.5-0.5b", None, "qwen2.5-7b", 152064, None),
    "self": ("qwen2.5-7b", 2, "qwen2.5-7b", 152064, None),
    "damped": ("qwen2.5-7b", 2, "qwen2.5-7b", 152064, "2:0.05"),
}
TINY_PAIRS = {"random": ("tiny-draft", None, "tiny-target", 512, None),
              "self": ("tiny-target", 1, "tiny-target", 512, None),
              "damped": ("tiny-target", 1, "tiny-target", 512, "1:0.05")}
DEFAULT_PAIRS = ("random", "damped")
KS, TINY_KS = (2, 4, 8), (2,)
NEW_TOKENS, TINY_NEW_TOKENS = 128, 16
REQUESTS, TINY_REQUESTS = 3, 1
PROMPT_LEN = 64


def describe(pair: tuple) -> str:
    draft, keep, target, _, damp = pair
    damped = " (its layers {}.. with output projections ×{})".format(*damp.split(":")) if damp else ""
    return f"{draft}{f'[:{keep}]' if keep else ''} → {target}{damped}"


def per_token_alpha(accepted_per_iteration: float, k: int) -> float:
    """α with Σ_{i=1..k} α^i = the mean accepted drafts per iteration (bisection; 0 ≤ α ≤ 1)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if sum(mid ** i for i in range(1, k + 1)) < accepted_per_iteration:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def service(work: Path, role: str, shape: str, keep: int | None, vocab: int, args: StepArgs,
            damp: str | None = None) -> Service:
    argv = [sys.executable, "-m", "bench.device.serve_shape", "--role", role, "--shape", shape,
            "--vocab-size", str(vocab), "--device", args.device,
            "--dtype", "bfloat16" if args.cuda else "float32"]
    if keep is not None:
        argv += ["--keep-layers", str(keep)]
    if damp is not None:
        argv += ["--damp", damp]
    return Service(work, f"{role}-{shape}{'-' + str(keep) if keep else ''}{'-damped' if damp else ''}", argv)


async def measure(addresses: tuple[str, str], vocab: int, args: StepArgs) -> list[dict]:
    from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient
    from orchestrator.config import OrchestratorConfig
    from orchestrator.speculation import Orchestrator
    from specdec.generation import GenerationRequest
    from specdec.sampling import SamplingParams

    records: list = []
    orchestrator = Orchestrator(GrpcDrafterClient(addresses[0], timeout_s=120),
                                GrpcVerifierClient(addresses[1], timeout_s=120),
                                OrchestratorConfig(draft_source="model", draft_rows="parked"),
                                on_iteration=records.append)
    generator = __import__("random").Random(5)
    new_tokens = TINY_NEW_TOKENS if args.tiny else NEW_TOKENS
    requests = TINY_REQUESTS if args.tiny else REQUESTS
    rows = []
    await orchestrator.start()
    try:
        for method, k in [("autoregressive", 0), *[("token", k) for k in (TINY_KS if args.tiny else KS)]]:
            if args.left_s() < 15:
                log(f"loop: budget spent before {method} k={k}")
                continue

            def request(seed: int, method: str = method, k: int = k) -> GenerationRequest:
                prompt = [generator.randrange(vocab - 1) for _ in range(PROMPT_LEN)]
                return GenerationRequest(prompt_ids=prompt, max_new_tokens=new_tokens,
                                         sampling=SamplingParams(1.0), stop_token_ids=[], seed=seed,
                                         method=method, k=k or None, pipeline=False, draft_source="model")

            await orchestrator.generate(request(0))  # warm-up
            rates, drafted, accepted, walls, iterations, drafting, draft_s = [], 0, 0, [], 0, 0, 0.0
            for i in range(requests):
                records.clear()
                start = time.perf_counter()
                result = await orchestrator.generate(request(1 + i))
                wall = time.perf_counter() - start
                rates.append(len(result.token_ids) / wall)
                drafted += result.stats.drafted_tokens
                accepted += result.stats.accepted_tokens
                walls += [r.end - r.start for r in records]
                iterations += len(records)
                drafting += result.stats.drafted_iterations
                draft_s += result.stats.draft_seconds
            rows.append({"method": method, "k": k, "tokens_per_s": statistics.median(rates),
                         "acceptance": accepted / drafted if drafted else None,
                         "alpha": per_token_alpha(accepted / drafting, k) if drafting else None,
                         "draft_call_s": draft_s / drafting if drafting else None,
                         "iteration_s": statistics.median(walls) if walls else None,
                         "tokens_per_iteration": requests * new_tokens / max(1, iterations)})
            log(f"loop: {method} k={k}: {rows[-1]['tokens_per_s']:.1f} tok/s")
    finally:
        await orchestrator.close()
    return rows


def projection(alpha: float, k: int, t_p: dict[int, float], t_q: float) -> float:
    from specdec.theory import expected_tokens_per_iteration

    return expected_tokens_per_iteration(alpha, k) * t_p[1] / (k * t_q + t_p[padded(k + 1, t_p)])


def padded(n: int, t_p: dict[int, float]) -> int:
    """The measured pass size a pass of n tokens pads to (its captured bucket)."""
    return min((size for size in t_p if size >= n), default=max(t_p))


def pass_times(args: StepArgs, draft: str, target: str) -> dict | None:
    """Captured T(n) of both shapes from step "captured" of this run (None when it did not run)."""
    captured = args.earlier("captured")
    models = captured["data"]["models"] if captured is not None else {}
    if draft not in models or target not in models:
        return None
    return {"draft": {int(n): t for n, t in models[draft]["captured"].items()},
            "target": {int(n): t for n, t in models[target]["captured"].items()}}


def run_pair(name: str, pair: tuple, args: StepArgs) -> tuple[list[dict], list[list], list[str]]:
    draft, keep, target, vocab, damp = pair
    work = Path(tempfile.mkdtemp(prefix=f"specdec-device-loop-{name}-"))
    services = [service(work, "drafter", draft, keep, vocab, args),
                service(work, "verifier", target, None, vocab, args, damp)]
    try:
        deadline = time.monotonic() + max(10.0, args.left_s() - 30)
        addresses = services[0].address(deadline), services[1].address(deadline)
        log(f"loop {name}: services ready at {addresses}")
        rows = asyncio.run(measure(addresses, vocab, args))
    finally:
        for one in services:
            one.stop()
            log(f"loop {name}: {one.name}: {one.log_path.read_text(errors='replace')[-400:]}")
    base = next((r for r in rows if r["method"] == "autoregressive"), None)
    times = pass_times(args, draft if keep is None else target, target)
    table_rows, findings = [], []
    for r in rows:
        r["pair"] = name
        speedup = r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        proj = overhead = None
        t_p = times["target"] if times else None
        if keep is None and times:
            t_q = times["draft"][1]
        else:  # the self-draft's step is not timed alone: the Draft call's time per token (hop included)
            t_q = r["draft_call_s"] / r["k"] if r["k"] and r["draft_call_s"] else None
        if t_p is not None and r["k"] and r["alpha"] is not None and t_q is not None:
            proj = r["projection"] = projection(r["alpha"], r["k"], t_p, t_q)
            overhead = r["overhead_s"] = r["iteration_s"] - r["k"] * t_q - t_p[padded(r["k"] + 1, t_p)]
        elif t_p is not None and not r["k"]:
            overhead = r["overhead_s"] = r["iteration_s"] - t_p[1]
        alpha = "–" if r["alpha"] is None else f"{r['alpha']:.3f}"
        table_rows.append([name, r["method"], r["k"] or "–", f"{r['tokens_per_s']:.1f}", alpha,
                           f"{r['tokens_per_iteration']:.2f}", ms(r["iteration_s"]), ms(overhead),
                           "–" if speedup is None else f"{speedup:.2f}×",
                           "–" if proj is None else f"{proj:.2f}×"])
        if r["k"] and speedup is not None:
            findings.append(f"loop {describe(pair)} k={r['k']}: {r['tokens_per_s']:.1f} tok/s, α {alpha}, "
                            f"{speedup:.2f}× target-only" + (f" (projection {proj:.2f}×)" if proj else ""))
    return rows, table_rows, findings


def step(args: StepArgs) -> StepResult:
    pairs = TINY_PAIRS if args.tiny else PAIRS
    chosen = [p for p in os.environ.get("SPECDEC_LOOP_PAIRS", ",".join(DEFAULT_PAIRS)).split(",") if p]
    all_rows, table_rows, findings = [], [], []
    for name in chosen:
        if args.left_s() < 30:
            findings.append(f"loop {name}: not run (budget spent)")
            continue
        rows, lines, found = run_pair(name, pairs[name], args)
        all_rows += rows
        table_rows += lines
        findings += found
    described = "; ".join(f"{name}: {describe(pairs[name])}" for name in chosen)
    markdown = "\n".join([
        f"Pairs ({described}), random weights, T = 1, {PROMPT_LEN}-token prompts; drafter and verifier in "
        "separate processes on one GPU, captured passes, the orchestrator's loop over gRPC on 127.0.0.1 in "
        "this process, draft rows parked at the drafter (`draft_rows` parked); median of the requests' "
        "tok/s. α per token from the accepted drafts per iteration; T_p from step captured (the target "
        "shape, when it ran); T_q from step captured for the random pair, the Draft call's time / k (hop "
        "included) for the self pair.", "",
        table(["pair", "method", "k", "tok/s", "α", "tok/iter", "iteration ms", "loop overhead ms", "speedup",
               "projection §7"], table_rows)])
    return StepResult(markdown, {"rows": all_rows}, findings)


if __name__ == "__main__":
    sys.exit(run_step(step, description=__doc__))
