"""One target's pass times in this checkout: prefill of a prompt, T(1) and T(9) after it.

Run it from two checkouts in turn (before and after a change) to compare them on one machine:

    python -m bench.bench_pass --json             # this checkout, the default target
    for i in 1 2; do (cd ../before && python -m bench.bench_pass --json); \
        python -m bench.bench_pass --json; done

Each figure is the median of --repeats passes in one process (2 threads by default). The prompt is
a fixed code-like token sequence of --prompt-tokens tokens, so both checkouts run the same passes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_pass", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="model (default: the default target)")
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="int8", choices=("int8", "int8-per-tensor", "float32"),
                   help="int8: specdec's batch-invariant int8; int8-per-tensor: torch.ao's dynamic int8, "
                        "plain HF's fastest on a CPU (the peer's pass)")
    p.add_argument("--json", action="store_true", help="one JSON line instead of text")
    args = p.parse_args(argv)

    import torch

    from bench.bench_grounded import load_hf_target
    from specdec.defaults import DEFAULT_TARGET_MODEL
    from specdec.models import resolve_model
    from specdec.runtime.kv import TreeKVCache

    loaded = load_hf_target(resolve_model(args.target or DEFAULT_TARGET_MODEL), args.precision, args.threads)
    vocab = loaded.info.vocab_size  # the same ids in every checkout; modulo a small test vocabulary
    prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(args.prompt_tokens)]
    prefill, one, nine = [], [], []
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):
            kv = TreeKVCache(loaded.model)
            began = time.perf_counter()
            kv.prefill(prompt)
            prefill.append(time.perf_counter() - began)
            for token in range(3):
                began = time.perf_counter()
                kv.extend_chain([(500 + token) % vocab])
                one.append(time.perf_counter() - began)
                kv.settle([0])
            began = time.perf_counter()
            kv.extend([t % vocab for t in range(600, 609)], list(range(-1, 8)))
            nine.append(time.perf_counter() - began)
            if repeat == 0:  # warm-up
                prefill, one, nine = [], [], []
    result = {"prefill_s": statistics.median(prefill), "t1_ms": 1e3 * statistics.median(one),
              "t9_ms": 1e3 * statistics.median(nine), "prompt_tokens": args.prompt_tokens,
              "precision": args.precision}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"prefill of {args.prompt_tokens} tokens {result['prefill_s']:.3f} s; "
              f"T(1) {result['t1_ms']:.1f} ms; T(9) {result['t9_ms']:.1f} ms (after the prompt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
