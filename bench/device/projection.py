"""Step "projection": a projected speedup per model pair, from the GPU's measured times. A projection,
not a measurement: no real checkpoint ran, and acceptance comes from the CPU.

docs/algorithms.md §7 with the timed denominators and the loop's measured overhead:

    S(k) = E[tokens/iter](α, k) · T_p(1) / (k · T_q + T_p(k + 1) + O(k))

T_p(n): the target shape's pass of n tokens (step "timings", interpolated between measured n);
T_q: the draft shape's per-token drafter step (step "timings"); O(k): wall minus model time per
iteration of the draft = target loop (step "overhead", one request, sequential; nearest measured k).
α: acceptance of the real default pair (Qwen2.5-Coder 0.5B → 1.5B) measured on the CPU
(bench/results/precision.md, 2026-11-22: bfloat16, α = 1 − TV = 0.916 on sampled continuations); it
stands in for every pair here, 0.5B → 7B and the Llama pair included (unmeasured: a larger target
usually agrees less with the same draft). Beside it the speed-of-light bound (Pankratov & Alistarh,
specdec.theory.speed_of_light_bound) on tokens per pass of Pcap = k + 1 positions, from the target
entropy moments μ, μ₂ of the CPU analysis (bench/results/analysis.json, int8), turned into a speedup
with free drafting: SoL · T_p(1) / (T_p(k + 1) + O(k)).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.device.common import StepArgs, StepResult, run_step, table
from bench.device.shapes import REAL_PAIRS, TINY_PAIRS

ROOT = Path(__file__).resolve().parents[2]
ALPHA = 0.916  # bench/results/precision.md (2026-11-22): the bfloat16 default pair on the CPU
ALPHA_SOURCE = "bench/results/precision.md (2026-11-22, CPU, bfloat16 pair, 1 − TV)"
ANALYSIS = ROOT / "bench" / "results" / "analysis.json"
KS = (1, 2, 3, 4, 6, 8)


def entropy_moments() -> tuple[float, float, str]:
    """(μ, μ₂, where from): the CPU analysis of the default pair (int8 target rows)."""
    analysis = json.loads(ANALYSIS.read_text())
    return (
        float(analysis["entropy"]["mu"]),
        float(analysis["entropy"]["mu2"]),
        f"{ANALYSIS.relative_to(ROOT)} ({analysis['meta']['target_id']})",
    )


def interpolate(times: dict[str, float], n: int) -> float:
    """T(n) piecewise linear between measured sizes, flat below the smallest, last slope beyond."""
    import numpy as np

    sizes = sorted(int(s) for s in times)
    values = [times[str(s)] for s in sizes]
    if n > sizes[-1] and len(sizes) > 1:
        slope = (values[-1] - values[-2]) / (sizes[-1] - sizes[-2])
        return values[-1] + max(0.0, slope) * (n - sizes[-1])
    return float(np.interp(n, sizes, values))


def overhead_of(rows: list[dict], k: int) -> float:
    """Wall minus model seconds per iteration at the measured k nearest to `k` (one request, sequential)."""
    plain = [r for r in rows if r["concurrency"] == 1 and not r["pipelined"]] or rows
    nearest = min(plain, key=lambda r: (abs(r["k"] - k), r["k"]))
    return max(0.0, nearest["wall"] - nearest["model"])


def step(args: StepArgs) -> StepResult:
    from specdec.theory import expected_tokens_per_iteration, speed_of_light_bound

    timings = args.earlier("timings")
    overhead = args.earlier("overhead")
    if timings is None or overhead is None:
        raise RuntimeError(
            "needs the results of steps timings and overhead (one of them failed or did not run)"
        )
    models = timings["data"]["models"]
    rows_overhead = overhead["data"]["rows"]
    mu, mu2, moments_source = entropy_moments()
    pairs = [p for p in (TINY_PAIRS if args.tiny else REAL_PAIRS) if p[0] in models and p[1] in models]
    if not pairs:
        raise RuntimeError("no pair has both shapes timed")
    table_rows, data = [], {}
    for draft, target in pairs:
        t_p = models[target]["pass"]
        t_q = models[draft]["draft_step"]["per_token"]
        t_p1 = interpolate(t_p, 1)
        for k in KS:
            tokens = expected_tokens_per_iteration(ALPHA, k)
            o_k = overhead_of(rows_overhead, k)
            verify = interpolate(t_p, k + 1)
            s_free = tokens * t_p1 / (k * t_q + verify)
            s = tokens * t_p1 / (k * t_q + verify + o_k)
            try:
                sol = speed_of_light_bound(mu, mu2, k + 1)
                sol_speedup = sol * t_p1 / (verify + o_k)
            except ValueError:  # the bound holds only for Pcap >= 1 + μ₂/μ²
                sol, sol_speedup = None, None
            key = f"{draft}->{target}"
            data.setdefault(key, []).append(
                {
                    "k": k,
                    "expected_tokens": tokens,
                    "t_p1": t_p1,
                    "t_q": t_q,
                    "t_verify": verify,
                    "overhead": o_k,
                    "speedup_no_overhead": s_free,
                    "speedup": s,
                    "sol_tokens": sol,
                    "sol_speedup": sol_speedup,
                }
            )
            table_rows.append(
                [
                    key,
                    k,
                    f"{tokens:.2f}",
                    f"{1000 * t_p1:.2f}",
                    f"{1000 * t_q:.2f}",
                    f"{1000 * verify:.2f}",
                    f"{1000 * o_k:.2f}",
                    f"{s_free:.2f}",
                    f"**{s:.2f}**",
                    "–" if sol is None else f"{sol:.2f}",
                    "–" if sol_speedup is None else f"{sol_speedup:.2f}",
                ]
            )
    best = {key: max(values, key=lambda v: v["speedup"]) for key, values in data.items()}
    findings = [
        f"PROJECTED {key}: {b['speedup']:.2f}x at k = {b['k']} (α = {ALPHA} assumed)"
        for key, b in best.items()
    ]
    threshold = 1 + mu2 / mu**2
    text = (
        f"**Projected, not measured.** α = {ALPHA} from {ALPHA_SOURCE} for every pair; μ = {mu:.3f}, "
        f"μ₂ = {mu2:.3f} from {moments_source} (the bound needs Pcap = k + 1 ≥ {threshold:.2f}). Times "
        f"from this run's steps timings and overhead (ms).\n\n"
        + table(
            [
                "pair",
                "k",
                "E[tokens/iter]",
                "T_p(1)",
                "T_q",
                "T_p(k+1)",
                "O(k)",
                "S without O",
                "S projected",
                "SoL tokens/pass",
                "SoL speedup",
            ],
            table_rows,
        )
    )
    return StepResult(
        text,
        {"alpha": ALPHA, "alpha_source": ALPHA_SOURCE, "mu": mu, "mu2": mu2, "pairs": data, "best": best},
        findings,
    )


if __name__ == "__main__":
    sys.exit(run_step(step, description=__doc__))
