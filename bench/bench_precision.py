"""What each weight precision costs and changes, for one draft/target pair on this machine.

For every precision (float32, int8 dynamic quantisation, bfloat16, ...) it loads both models at
that precision and reports: forward time of n new tokens on a cached context (T_p(n), T_q(n),
the analyser's own timing code), α = 1 − TV between the target's and the draft's rows at that
precision, and how far the target moved from the float32 target (mean total variation between
their rows). All rows are taken along the same continuations, sampled once from the float32
target, so the numbers compare like with like.

Why: speculation pays only when a pass over k + 1 tokens costs little more than one; on a CPU
that depends on the precision more than on anything else, and a precision is another target
distribution, so the benchmark's baseline must use the same one.

Usage: python -m bench.bench_precision [--precisions float32,int8,bfloat16] [--num-prompts 2]
       [--tokens 24] [--out bench/results/precision.md]   (pin it: taskset -c 1 ...)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from bench.run import DEFAULT_DRAFT, DEFAULT_TARGET, _resolve, machine_description

SIZES = (1, 2, 3, 5, 9, 17)


def _tv(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p.double() - q.double()).abs().sum(-1)


def main(argv: list[str] | None = None) -> int:
    from specdec import analysis
    from specdec.prompts import load_prompts, prompt_ids
    from specdec.runtime.loading import PRECISIONS, load_model
    from specdec.sampling import SamplingParams

    description = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m bench.bench_precision", description=description)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--precisions", default="float32,int8,bfloat16")
    parser.add_argument("--prompts", default="humaneval", choices=("humaneval", "mtbench", "builtin"))
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=24, help="continuation tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (the fastest counts)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "precision.md"))
    args = parser.parse_args(argv)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        parser.error(f"unknown precision(s) {unknown}; choose from {', '.join(PRECISIONS)}")
    if "float32" not in precisions:
        precisions.insert(0, "float32")  # the reference the others are compared with
    torch.set_num_threads(1)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    draft_path, target_path = _resolve(args.draft, None), _resolve(args.target, None)
    sampling = SamplingParams(1.0)

    reference = load_model(target_path, dtype="float32", threads=1)
    prompts = load_prompts(args.prompts, args.num_prompts)
    ids = [prompt_ids(p, reference.tokenizer, 256) for p in prompts]
    say(f"sampling {args.tokens} tokens per prompt from the float32 target")
    continuations = [
        analysis.sample_continuation(reference.model, prompt, args.tokens, sampling, seed=args.seed + i)
        for i, prompt in enumerate(ids)
    ]
    reference_rows = [
        analysis.warped_rows(reference.model, prompt, cont, sampling)
        for prompt, cont in zip(ids, continuations, strict=True)
    ]
    del reference
    gc.collect()
    context = ids[0] + continuations[0]

    rows = []
    for precision in precisions:
        say(f"{precision}: loading, timing, rows")
        began = time.perf_counter()
        target = load_model(target_path, dtype=precision, threads=1)
        draft = load_model(draft_path, dtype=precision, threads=1)
        load_seconds = time.perf_counter() - began
        timing = analysis.measure_timing(target.model, draft.model, context, SIZES, repeats=args.repeats)
        alphas, drifts = [], []
        for prompt, cont, ref in zip(ids, continuations, reference_rows, strict=True):
            p = analysis.warped_rows(target.model, prompt, cont, sampling)
            q = analysis.warped_rows(draft.model, prompt, cont, sampling)
            alphas.append(1.0 - _tv(p, q))
            drifts.append(_tv(p, ref))
        rows.append({
            "precision": precision,
            "load_s": load_seconds,
            "timing": timing,
            "alpha": float(torch.cat(alphas).mean()),
            "drift": float(torch.cat(drifts).mean()),
        })
        del target, draft
        gc.collect()

    machine = machine_description(1)
    lines = [
        "# Precision: speed and distribution of the default pair",
        "",
        "```",
        "python -m bench.bench_precision " + " ".join(argv if argv is not None else sys.argv[1:]),
        "```",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores visible, one torch thread per model, "
        f"torch {machine['torch']}, transformers {machine['transformers']}. Draft `{args.draft}`, target "
        f"`{args.target}`; {len(ids)} {args.prompts} prompt(s) × {args.tokens} continuation tokens sampled "
        f"from the float32 target at T = 1; timing on a {len(context)}-token cached context, fastest of "
        f"{args.repeats}.",
        "",
        "| precision | target T_p(1) | T_p(3) | T_p(9) | T_p(17) | T_p(9) / T_p(1) | draft T_q(1) | T_q(9) "
        "| α = 1 − TV(p, q) | TV(target, float32 target) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        t: analysis.Timing = row["timing"]
        lines.append(
            f"| {row['precision']} | {t.target_time(1) * 1000:.0f} ms | {t.target_time(3) * 1000:.0f} ms "
            f"| {t.target_time(9) * 1000:.0f} ms | {t.target_time(17) * 1000:.0f} ms "
            f"| {t.target_time(9) / t.target_time(1):.2f} | {t.draft_time(1) * 1000:.0f} ms "
            f"| {t.draft_time(9) * 1000:.0f} ms | {row['alpha']:.3f} | {row['drift']:.3f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
