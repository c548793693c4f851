"""Where a one-token pass's time goes on the device: plain HF against the engines' cache paths.

The device check's T(n) came out nearly flat in model size on an H100 (1.5B and 7B shapes both
~43 ms at n = 1; bench/RESULTS.md, "GPU check"), which points at host-side cost, not the GPU. This
script separates it, per shape, after a 512-token context, n = 1, bfloat16:

- plain HF: `model(ids, past_key_values=DynamicCache)`, no mask, the cache cropped back each time;
- TreeKVCache.forward: the engines' cache with its explicit additive 4D mask, no batcher;
- TreeKVCache + ForwardBatcher: what the engines run (the device check's T(n));

then torch.profiler over a few TreeKVCache.forward passes: the top host operators and the device syncs.

    python -m bench.device.profile_pass --out DIR [--models qwen2.5-1.5b,qwen2.5-7b] [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

CONTEXT = 512
REPEATS = 20
WARMUP = 3


def profile_shape(name: str, device: str, out: Path, context: int) -> dict:
    import torch
    from transformers import DynamicCache

    from bench.device.common import median_seconds, synchronize
    from bench.device.shapes import build_model
    from specdec.runtime.batch_config import BatchConfig
    from specdec.runtime.batching import ForwardBatcher
    from specdec.runtime.kv import TreeKVCache
    from specdec.trees import sequence_parents

    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    model = build_model(name, device, dtype)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (context,), generator=generator).tolist()
    token = [int(torch.randint(0, vocab, (1,), generator=generator))]
    result: dict = {"model": name, "layers": model.config.num_hidden_layers, "context": context}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True)
        ids = torch.tensor([token], device=device)
        result["plain_hf"] = median_seconds(
            lambda: model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1),
            device, REPEATS, warmup=WARMUP, after=lambda: cache.crop(-1),
        )
        alone = TreeKVCache(model)
        alone.prefill(prompt)
        result["tree_cache"] = median_seconds(
            lambda: alone.extend(token, sequence_parents(1)), device, REPEATS, warmup=WARMUP,
            after=lambda: alone.truncate(context),
        )
        batched = TreeKVCache(model, runner=ForwardBatcher(model, BatchConfig()))
        batched.prefill(prompt)
        result["tree_cache_batcher"] = median_seconds(
            lambda: batched.extend(token, sequence_parents(1)), device, REPEATS, warmup=WARMUP,
            after=lambda: batched.truncate(context),
        )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(5):  # on this thread (the batcher runs passes on its compute thread)
                alone.extend(token, sequence_parents(1))
                alone.truncate(context)
            synchronize(device)
        averages = prof.key_averages()
        by_cpu = averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
        (out / f"profile-{name}.txt").write_text(by_cpu)
        counts = {e.key: e.count for e in averages}
        result["per_pass_counts"] = {
            key: counts.get(key, 0) / 5
            for key in ("cudaStreamSynchronize", "cudaMemcpyAsync", "cudaLaunchKernel", "aten::item",
                        "aten::_local_scalar_dense", "aten::to", "aten::copy_")
        }
        top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
        result["top_self_cpu_ms_per_pass"] = {e.key: round(e.self_cpu_time_total / 1000 / 5, 3) for e in top}
    return result


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="qwen2.5-1.5b,qwen2.5-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", type=int, default=CONTEXT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.models.split(","):
        results.append(profile_shape(name, args.device, args.out, args.context))
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        r = results[-1]
        print(
            f"{name} ({r['layers']} layers): plain HF {1000 * r['plain_hf']:.2f} ms, tree cache "
            f"{1000 * r['tree_cache']:.2f} ms, + batcher {1000 * r['tree_cache_batcher']:.2f} ms; "
            f"per pass {r['per_pass_counts']}",
            flush=True,
        )
        print("  top self CPU ms/pass:", r["top_self_cpu_ms_per_pass"], flush=True)
    (args.out / "profile.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
