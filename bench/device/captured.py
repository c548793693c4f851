"""Step "captured": eager passes against captured ones (CUDA graphs over the KV pool) at real shapes.

Per model shape (random weights, bfloat16 on CUDA; bench.device.shapes), one session after a
CONTEXT-token prompt:

- T(n) eager: the engines' growing cache (specdec.runtime.kv.TreeKVCache), n = 1 … 64 new tokens;
- T(n) captured: the same passes through a slot of specdec.runtime.kv_pool.KVPool, replaying the
  graph of the bucket that holds the pass; the capture's time and memory;
- rows: a captured pass of n tokens (padded to its buckets) against the eager unpadded pass (max
  |Δ logit| and max total variation of the softmax rows), and four sessions in one captured
  batched pass against each alone;
- the drafter's k-token call (DrafterEngine.draft, T = 1, k = 4 and 8): eager, over the pool node by
  node (a host round trip per token), and over the pool with its passes chained on the device.

Medians after warm-up, the device synchronised around each timing.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

from bench.device.common import StepArgs, StepResult, log, median_seconds, ms, run_step, table
from bench.device.shapes import loaded_model

CONTEXT = 512
PASS_SIZES = (1, 2, 4, 8, 16, 32, 64)
DRAFT_KS = (4, 8)
MODELS = ("qwen2.5-0.5b", "qwen2.5-7b")
TINY = {"context": 48, "pass_sizes": (1, 2, 8), "draft_ks": (2,), "models": ("tiny-draft", "tiny-target")}


def pool_config(args: StepArgs, context: int, widest: int):
    """Buckets enough for this step (one kv bucket above the context): seconds to capture, not minutes."""
    from specdec.runtime.kv_pool import PoolConfig

    kv = 1 << (context + widest - 1).bit_length()
    return PoolConfig(slots=6, slot_tokens=kv, query_buckets=(1, 2, 4, 8, 16, 32, 64)[: widest.bit_length()],
                      batch_buckets=(1, 4), context_buckets=(kv,), capture=args.cuda)


def total_variation(a, b) -> float:
    return float(0.5 * (a.float().softmax(-1) - b.float().softmax(-1)).abs().sum(-1).max())


def time_model(name: str, args: StepArgs, dtype: str, repeats: int) -> dict:
    import torch

    from specdec.runtime.kv import TreeKVCache
    from specdec.runtime.kv_pool import KVPool
    from specdec.runtime.tiny import build_tokenizer
    from specdec.trees import sequence_parents

    context = TINY["context"] if args.tiny else CONTEXT
    pass_sizes = TINY["pass_sizes"] if args.tiny else PASS_SIZES
    loaded = loaded_model(name, args.device, dtype, tokenizer=build_tokenizer(16))
    model = loaded.model
    vocab = int(model.get_output_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    def pass_times(kv) -> dict[int, float]:  # T(n) of one session's chain passes after the prompt
        kv.prefill(prompt)
        blocks = {n: tokens(n) for n in pass_sizes}
        return {n: median_seconds(lambda b=block: kv.extend(b, sequence_parents(len(b))), args.device,
                                  repeats, warmup=2, after=lambda: kv.truncate(context))
                for n, block in blocks.items()}

    prompt = tokens(context)
    out: dict = {"rows": {}}
    eager = TreeKVCache(model)
    out["eager"] = pass_times(eager)

    pool = KVPool(model, pool_config(args, context, max(pass_sizes)))
    report = pool.capture()
    out["capture"] = {"graphs": report.graphs, "seconds": round(report.seconds, 3),
                      "graph_mib": round(report.graph_bytes / 2**20, 1),
                      "pool_mib": round(report.pool_bytes / 2**20, 1)}
    pooled = pool.new_cache()
    out["captured"] = pass_times(pooled)
    out["passes"] = dict(pool.passes)

    # Rows: padded captured passes against the unpadded eager pass (3 and 8 new tokens).
    for n in (3, 8):
        block = tokens(n)
        a = eager.extend(block, sequence_parents(n), 0)
        b = pooled.extend(block, sequence_parents(n), 0)
        eager.truncate(context)
        pooled.truncate(context)
        out["rows"][f"alone n={n}"] = {"max_abs": float((a - b).abs().max()), "max_tv": total_variation(a, b)}
    # Four sessions in one captured batched pass against each alone.
    caches = [pool.new_cache() for _ in range(4)]
    for i, cache in enumerate(caches):
        cache.prefill(prompt[: context - 7 * i])
    blocks = [tokens(3) for _ in caches]
    alone = []
    for cache, block in zip(caches, blocks, strict=True):
        alone.append(cache.extend(block, sequence_parents(3), 0))
        cache.truncate(cache.prefix_len)
    plans = [c.plan(b, sequence_parents(3), 0) for c, b in zip(caches, blocks, strict=True)]
    together = pool.run([c.row(p) for c, p in zip(caches, plans, strict=True)])
    out["rows"]["batched 4x3"] = {
        "max_abs": max(float((a - b).abs().max()) for a, b in zip(alone, together, strict=True)),
        "max_tv": max(total_variation(a, b) for a, b in zip(alone, together, strict=True)),
    }
    out["passes_after_rows"] = dict(pool.passes)
    del caches, pooled, eager, pool
    gc.collect()

    pooled_config = pool_config(args, context, 16)
    out["draft"] = {"eager": draft_calls(loaded, args, None, context, repeats),
                    "captured": draft_calls(loaded, args, pooled_config, context, repeats),
                    "captured, node by node": draft_calls(loaded, args, pooled_config, context, repeats,
                                                          chained=False)}
    del loaded, model
    gc.collect()
    if args.cuda:
        torch.cuda.empty_cache()
    return out


def draft_calls(loaded, args: StepArgs, config, context: int, repeats: int, chained: bool = True) -> dict:
    """Median seconds of one DrafterEngine.draft call of k tokens (T = 1), after a prefilled context.
    Over a pool the k passes are chained on the device (no host sync between them); `chained=False`
    times the node-by-node fill instead (a host round trip per token: the path before)."""
    import torch

    from specdec.engine import drafter as drafter_module
    from specdec.engine.api import DraftRequest
    from specdec.engine.drafter import DrafterEngine

    if not chained:
        real, drafter_module._drafts_on_device = drafter_module._drafts_on_device, lambda *_: False
        try:
            return draft_calls(loaded, args, config, context, repeats)
        finally:
            drafter_module._drafts_on_device = real
    from specdec.sampling import SamplingParams
    from specdec.trees import sequence_parents

    engine = DrafterEngine(loaded, kv_pool=config)
    vocab = engine.info().vocab_size
    generator = torch.Generator().manual_seed(1)
    out = {}
    for k in TINY["draft_ks"] if args.tiny else DRAFT_KS:
        committed = torch.randint(0, vocab, (context,), generator=generator).tolist()
        known, walls = 0, []
        for i in range(repeats + 2):
            request = DraftRequest(f"k{k}", known, committed[known:], sequence_parents(k),
                                   SamplingParams(1.0), seed=i)
            start = time.perf_counter()
            result = engine.draft(request)
            wall = time.perf_counter() - start
            known = len(committed)
            committed.append(result.tokens[0])
            if i >= 2:
                walls.append(wall)
        engine.release(f"k{k}")
        out[k] = statistics.median(walls)
    return out


def step(args: StepArgs) -> StepResult:
    import torch

    dtype = "bfloat16" if args.cuda else "float32"
    names = TINY["models"] if args.tiny else MODELS
    repeats = 3 if args.tiny else 10
    pass_sizes = TINY["pass_sizes"] if args.tiny else PASS_SIZES
    if not args.cuda:
        torch.set_num_threads(1)
    results: dict[str, dict] = {}
    for name in names:
        if args.left_s() < (5 if args.tiny else 45):
            break
        log(f"captured: {name}")
        with torch.inference_mode():
            results[name] = time_model(name, args, dtype, repeats)
    if not results:
        raise RuntimeError("no model timed within the budget")
    lines = [f"Precision {dtype} on {args.device}; medians of {repeats} (ms); random weights.", ""]
    rows = []
    for name, r in results.items():
        rows.append([f"{name} eager", *[ms(r["eager"][n]) for n in pass_sizes]])
        rows.append([f"{name} captured", *[ms(r["captured"][n]) for n in pass_sizes]])
    lines += ["T(n), one session's pass of n new tokens:", "",
              table(["model / path", *[f"n={n}" for n in pass_sizes]], rows), ""]
    lines += ["Capture (this step's buckets):", "",
              table(["model", "graphs", "seconds", "graph MiB", "KV pool MiB"],
                    [[name, r["capture"]["graphs"], r["capture"]["seconds"], r["capture"]["graph_mib"],
                      r["capture"]["pool_mib"]] for name, r in results.items()]), ""]
    lines += ["Rows, captured (padded to buckets) against eager unpadded / alone:", "",
              table(["model", "comparison", "max abs Δ logit", "max TV"],
                    [[name, what, f"{v['max_abs']:.3g}", f"{v['max_tv']:.3g}"]
                     for name, r in results.items() for what, v in r["rows"].items()]), ""]
    ks = TINY["draft_ks"] if args.tiny else DRAFT_KS
    paths = ("eager", "captured, node by node", "captured")
    lines += ["DrafterEngine.draft, one call of k tokens (ms; captured: the k passes chained on the device, "
              "node by node: a host round trip per token):", "",
              table(["model", *[f"{path} k={k}" for path in paths for k in ks]],
                    [[name, *[ms(r["draft"][path][k]) for path in paths for k in ks]]
                     for name, r in results.items()])]
    findings = []
    for name, r in results.items():
        e1, c1, c8 = r["eager"][1], r["captured"][1], r["captured"][pass_sizes[-1] if args.tiny else 8]
        findings.append(f"{name}: T(1) eager {ms(e1)} ms → captured {ms(c1)} ms; captured T(8)/T(1) = "
                        f"{c8 / c1:.2f}; worst row TV {max(v['max_tv'] for v in r['rows'].values()):.3g}")
    return StepResult("\n".join(lines), {"dtype": dtype, "models": results}, findings)


if __name__ == "__main__":
    sys.exit(run_step(step, description=__doc__))
