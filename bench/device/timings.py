"""Step "timings": the product's forward passes at real sizes with random weights (bfloat16 on CUDA).

Per model shape (bench.device.shapes, built on the device, no download), through the engines' own
cache and batcher (specdec.runtime.kv.TreeKVCache run by specdec.runtime.batching.ForwardBatcher):

- T(n): one session's pass of n new tokens (a chain, the verifier's k + 1 pass) after a prefilled
  context, n = 1, 2, 4, ..., 64; the pass is rolled back after each timing;
- tree passes: n nodes of a binary tree under the tree mask;
- batched passes: s sessions (contexts of different lengths) x t new tokens in one pass, as the
  batcher lays them out (ForwardBatcher._batched_pass: the product's layout, without the gather
  window's wait);
- the drafter's per-token step: DrafterEngine.draft of a k-token sequence (sampling included) / k.

Medians over repeats after warm-up, the device synchronised around each timing.
"""

from __future__ import annotations

import gc
import statistics
import sys

from bench.device.common import StepArgs, StepResult, log, median_seconds, ms, run_step, table
from bench.device.shapes import REAL_MODELS, TINY_MODELS, loaded_model, parameters_b

CONTEXT = 512  # committed tokens before each timed pass
PASS_SIZES = (1, 2, 4, 8, 16, 32, 64)
TREE_SIZES = (4, 8, 16, 32, 64)
BATCH_SHAPES = ((2, 1), (4, 1), (8, 1), (4, 4), (8, 4), (4, 8), (8, 8))  # (sessions, tokens each)
DRAFT_K = 8
# The dry run keeps every kind of pass but few sizes (the CPU is shared with other work).
TINY_CONTEXT, TINY_PASS_SIZES, TINY_TREE_SIZES, TINY_BATCH_SHAPES = 64, (1, 2, 8), (4, 8), ((2, 1), (4, 4))


def sizes(tiny: bool) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...]]:
    """(context, pass sizes, tree sizes, batch shapes) of a full or a dry run."""
    if tiny:
        return TINY_CONTEXT, TINY_PASS_SIZES, TINY_TREE_SIZES, TINY_BATCH_SHAPES
    return CONTEXT, PASS_SIZES, TREE_SIZES, BATCH_SHAPES


def binary_tree(n: int) -> list[int]:
    """Parents of an n-node binary tree (node i's parent (i - 1) // 2; the roots' parent the prefix)."""
    return [-1 if i < 2 else (i - 2) // 2 for i in range(n)]


def time_passes(model, args: StepArgs, repeats: int) -> dict:
    """The pass timings of one model: single, tree and batched passes."""
    import torch

    from specdec.runtime.batch_config import BatchConfig
    from specdec.runtime.batching import ForwardBatcher, _Job
    from specdec.runtime.kv import TreeKVCache
    from specdec.trees import sequence_parents

    context, pass_sizes, tree_sizes, batch_shapes = sizes(args.tiny)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    batcher = ForwardBatcher(model, BatchConfig())
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    def session(context: int) -> TreeKVCache:
        kv = TreeKVCache(model, runner=batcher)
        kv.prefill(tokens(context))
        return kv

    kv = session(context)
    out: dict = {
        "params_b": round(parameters_b(model), 4),
        "vocab": vocab,
        "context": context,
        "pass": {},
        "tree": {},
        "batched": {},
    }
    for n in pass_sizes:
        block = tokens(n)
        out["pass"][n] = median_seconds(
            lambda b=block: kv.extend(b, sequence_parents(len(b))),
            args.device,
            repeats,
            warmup=2,
            after=lambda: kv.truncate(context),
        )
    for n in tree_sizes:
        block = tokens(n)
        out["tree"][n] = median_seconds(
            lambda b=block: kv.extend(b, binary_tree(len(b))),
            args.device,
            repeats,
            warmup=1,
            after=lambda: kv.truncate(context),
        )
    for sessions, width in batch_shapes:
        caches = [session(context + 16 * i) for i in range(sessions)]
        lengths = [c.prefix_len for c in caches]

        def batched(caches=caches, width=width) -> None:
            jobs = [_Job(kv=c, plan=c.plan(tokens(width), sequence_parents(width))) for c in caches]
            for job, logits in zip(jobs, batcher._batched_pass(jobs), strict=True):
                job.kv.apply(job.plan)
                job.logits = logits

        def rollback(caches=caches, lengths=lengths) -> None:
            for c, length in zip(caches, lengths, strict=True):
                c.truncate(length)

        out["batched"][f"{sessions}x{width}"] = median_seconds(
            batched, args.device, repeats, warmup=1, after=rollback
        )
    return out


def time_model(name: str, args: StepArgs, dtype: str, repeats: int) -> dict:
    """Passes, then the drafter's step, of shape `name`; the model is freed before the next one."""
    import torch

    from specdec.runtime.tiny import build_tokenizer

    # The drafter never reads its tokenizer: a small one saves building 150k words per shape.
    loaded = loaded_model(name, args.device, dtype, tokenizer=build_tokenizer(16))
    out = time_passes(loaded.model, args, repeats)
    gc.collect()  # the timed sessions' caches
    out["draft_step"] = draft_step(loaded, args, repeats)
    del loaded
    gc.collect()
    if args.cuda:
        torch.cuda.empty_cache()
    return out


def draft_step(loaded, args: StepArgs, repeats: int) -> dict:
    """Seconds per drafted token of DrafterEngine.draft (k = DRAFT_K, sampling at T = 1), and the share
    of it the engine reports as model time."""
    import time

    import torch

    from specdec.engine.api import DraftRequest
    from specdec.engine.drafter import DrafterEngine
    from specdec.sampling import SamplingParams
    from specdec.trees import sequence_parents

    engine = DrafterEngine(loaded)
    vocab = engine.info().vocab_size
    generator = torch.Generator().manual_seed(1)
    committed = torch.randint(0, vocab, (sizes(args.tiny)[0],), generator=generator).tolist()
    known = 0
    walls, models = [], []
    for i in range(repeats + 1):
        request = DraftRequest(
            "timing", known, committed[known:], sequence_parents(DRAFT_K), SamplingParams(1.0), seed=i
        )
        start = time.perf_counter()
        result = engine.draft(request)
        wall = time.perf_counter() - start
        known = len(committed)
        committed.append(result.tokens[0])  # commit one drafted token: the next call reuses the rest
        if i:  # the first call prefilled the context
            walls.append(wall / DRAFT_K)
            models.append(result.forward_seconds / DRAFT_K)
    engine.release("timing")
    return {"k": DRAFT_K, "per_token": statistics.median(walls), "model_per_token": statistics.median(models)}


def step(args: StepArgs) -> StepResult:
    import torch

    dtype = "bfloat16" if args.cuda else "float32"
    names = TINY_MODELS if args.tiny else REAL_MODELS
    repeats = 3 if args.tiny else 10
    context, pass_sizes, tree_sizes, batch_shapes = sizes(args.tiny)
    if not args.cuda:
        torch.set_num_threads(1)  # the dry run: one thread, as the CPU services run
    results: dict[str, dict] = {}
    skipped: list[str] = []
    for name in names:
        if args.left_s() < (5 if args.tiny else 40):
            skipped.append(name)
            continue
        log(f"timings: {name}")
        with torch.inference_mode():
            results[name] = time_model(name, args, dtype, repeats)
    lines = [
        f"Precision {dtype} on {args.device}; context {context} tokens; medians of {repeats} "
        f"repeats (ms). Random weights, {'tiny shapes (dry run)' if args.tiny else 'real shapes'}.",
        "",
    ]
    lines.append("T(n), one session's pass of n new tokens:\n")
    lines.append(
        table(
            ["model", "params (B)", *[f"n={n}" for n in pass_sizes]],
            [[name, r["params_b"], *[ms(r["pass"][n]) for n in pass_sizes]] for name, r in results.items()],
        )
    )
    lines.append("\nTree passes (n nodes, binary tree, tree mask):\n")
    lines.append(
        table(
            ["model", *[f"n={n}" for n in tree_sizes]],
            [[name, *[ms(r["tree"][n]) for n in tree_sizes]] for name, r in results.items()],
        )
    )
    lines.append(f"\nBatched passes (sessions x new tokens each; contexts {context}, {context + 16}, ...):\n")
    shapes = [f"{s}x{t}" for s, t in batch_shapes]
    lines.append(
        table(
            ["model", *shapes],
            [[name, *[ms(r["batched"][s]) for s in shapes]] for name, r in results.items()],
        )
    )
    lines.append(f"\nDrafter per-token step (DrafterEngine.draft, k = {DRAFT_K}, T = 1, divided by k):\n")
    lines.append(
        table(
            ["model", "wall ms / token", "model ms / token"],
            [
                [name, ms(r["draft_step"]["per_token"]), ms(r["draft_step"]["model_per_token"])]
                for name, r in results.items()
            ],
        )
    )
    if skipped:
        lines.append(f"\nNot timed (budget spent): {', '.join(skipped)}.")
    findings = [
        f"T(1) {name}: {ms(r['pass'][1])} ms, T(8)/T(1) = {r['pass'][8] / r['pass'][1]:.2f}"
        for name, r in results.items()
    ]
    if not results:
        raise RuntimeError("no model timed within the budget")
    return StepResult("\n".join(lines), {"dtype": dtype, "models": results, "skipped": skipped}, findings)


if __name__ == "__main__":
    sys.exit(run_step(step, description=__doc__))
