"""Served target-only steps with the verifier scoring ahead ("on", the default) and without ("off",
SPECDEC_SCORE_AHEAD=false): ms per iteration, and the verifier's idle time per iteration (the request's
wall time less its passes' time, from the verifier's /metrics), on three prompts, servers in turn.

    PYTHONPATH=. python bench/results/zen4-2026-12-04/score_ahead.py OUT on1,off1,off2,on2
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from bench.bench_serving import SpecdecServer

PROMPTS = ["The history of the printing press begins", "def quicksort(items):",
           "Write a short story about a lighthouse keeper who"]
COUNTERS = ("specdec_batch_seconds_total", "specdec_ahead_scores_total", "specdec_score_hits_total",
            "specdec_batches_total")


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {name: sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
            for name in COUNTERS}


async def serve(spec: SpecdecServer, temperature: float) -> list[tuple[float, list[int]]]:
    from specdec.client import AsyncClient
    from specdec.generation import GenerationRequest
    from specdec.sampling_params import SamplingParams

    client = AsyncClient(spec.info["orchestrator"], timeout_s=300)
    url = spec.info["metrics"]["verifier"]
    rows = []
    for i, prompt in enumerate(PROMPTS):
        before = scrape(url)
        request = GenerationRequest(prompt=prompt, max_new_tokens=64,
                                    sampling=SamplingParams(temperature=temperature),
                                    seed=7 if temperature else None, stop_token_ids=[],
                                    method="autoregressive", request_id=f"p{i}-{time.time()}",
                                    cache_salt=f"s{i}-{time.time()}")
        began = time.perf_counter()
        result = await client.generate(request)
        wall = time.perf_counter() - began
        after = scrape(url)
        moved = {name: after[name] - before[name] for name in COUNTERS}
        iterations = result.stats.iterations
        idle_ms = (wall - moved["specdec_batch_seconds_total"]) / iterations * 1e3
        print(f"   {spec.name} prompt {i}: {wall / iterations * 1e3:.1f} ms/it, "
              f"verifier idle {idle_ms:.2f} ms/it, passes {moved['specdec_batches_total']:.0f}, "
              f"ahead {moved['specdec_ahead_scores_total']:.0f}, "
              f"hits {moved['specdec_score_hits_total']:.0f}", flush=True)
        rows.append((idle_ms, list(result.token_ids)))
    await client.close()
    return rows


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in sys.argv[2].split(","):
        if name.startswith("off"):
            os.environ["SPECDEC_SCORE_AHEAD"] = "false"
        spec = SpecdecServer(name, ["--drafter", "none", "--target", "qwen2.5-coder-1.5b", "--dtype", "int8",
                                    "--metrics-port", "0"], out)
        spec.start()
        os.environ.pop("SPECDEC_SCORE_AHEAD", None)
        try:
            results[name] = asyncio.run(serve(spec, float(os.environ.get("T", "0"))))
        finally:
            spec.stop()
        idle = statistics.median(row[0] for row in results[name])
        print(f"{name}: verifier idle median {idle:.1f} ms/it", flush=True)
    first = next(iter(results.values()))
    same = all(rows[i][1] == first[i][1] for rows in results.values() for i in range(len(PROMPTS)))
    print("identical tokens across servers:", same)


if __name__ == "__main__":
    main()
