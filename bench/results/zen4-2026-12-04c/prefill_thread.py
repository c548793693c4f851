"""Does a pass run slower on a worker thread than on the main thread? One process per thread kind,
alternated by the driver below, so the host's drift between processes falls on both alike.

    PYTHONPATH=. python bench/results/zen4-2026-12-04c/prefill_thread.py drive 427 4

A child (`main` or `compute`) loads plain HF's per-tensor int8 target and ours on the thread it
measures, warms both, then times `passes` prefills of each alternately and prints one JSON line.
"""

import json
import statistics
import subprocess
import sys
import time

PASSES = 3


def child(where: str, n: int) -> None:
    import torch

    import specdec.runtime.kv as kv_module
    from bench.bench_grounded import load_hf_target
    from specdec.models import resolve_model
    from specdec.runtime.compute_thread import ComputeThread

    torch.set_num_threads(2)
    compute = ComputeThread(threads=2) if where == "compute" else None
    if compute is not None:
        torch.set_num_threads(1)  # as an engine: every other thread serial

    def on_thread(function):
        return compute.call(function) if compute is not None else function()

    model = resolve_model("qwen2.5-coder-1.5b")
    hf = on_thread(lambda: load_hf_target(model, "int8-per-tensor", 2))
    ours = on_thread(lambda: load_hf_target(model, "int8", 2))
    vocab = ours.info.vocab_size
    prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(n)]

    def hf_pass() -> None:
        with torch.inference_mode():
            hf.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)

    def ours_pass() -> None:
        kv = kv_module.TreeKVCache(ours.model)
        with torch.inference_mode():
            kv.prefill(prompt)

    times: dict[str, list[float]] = {"hf": [], "ours": []}
    for rnd in range(PASSES + 1):  # pass 0 warms up
        for name, run in (("hf", hf_pass), ("ours", ours_pass)):
            began = time.perf_counter()
            on_thread(run)
            if rnd:
                times[name].append(time.perf_counter() - began)
    print(json.dumps({"where": where, **{k: statistics.median(v) for k, v in times.items()},
                      "raw": times}))


def drive(n: int, rounds: int) -> None:
    results: dict[str, list[dict]] = {"main": [], "compute": []}
    for rnd in range(rounds):
        order = ("main", "compute") if rnd % 2 == 0 else ("compute", "main")
        for where in order:
            out = subprocess.run([sys.executable, __file__, where, str(n)], check=True,
                                 capture_output=True, text=True).stdout.strip().splitlines()[-1]
            row = json.loads(out)
            results[where].append(row)
            print(rnd, where, f"hf {row['hf']:.3f}  ours {row['ours']:.3f}", flush=True)
    for where, rows in results.items():
        print(where, "median hf", f"{statistics.median(r['hf'] for r in rows):.3f}",
              "ours", f"{statistics.median(r['ours'] for r in rows):.3f}")


if __name__ == "__main__":
    if sys.argv[1] == "drive":
        drive(int(sys.argv[2]), int(sys.argv[3]))
    else:
        child(sys.argv[1], int(sys.argv[2]))
