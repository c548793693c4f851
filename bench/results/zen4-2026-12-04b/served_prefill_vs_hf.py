"""Target-only through `up --drafter none` against plain HF (torch.ao per-tensor int8, 2 threads)
on one grounded prompt: the prefill (a 1-token request; the first iteration of a 64-token one) and
the later steps, alternated round by round.

    PYTHONPATH=. python bench/results/zen4-2026-12-04b/served_prefill_vs_hf.py extract 4 [HF_DTYPE]

HF_DTYPE: int8-per-tensor (the default, plain HF's fastest) or int8 (our model under HF's generate).
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_grounded import hf_run, load_hf_target, start_server
from bench.grounded_prompts import prompt_ids, workload_items
from specdec.client import AsyncClient
from specdec.generation import GenerationRequest
from specdec.models import resolve_model
from specdec.sampling_params import SamplingParams


async def ours(address: str, ids: list[int], new_tokens: int, tag: str) -> tuple[float, list[float]]:
    client = AsyncClient(address, timeout_s=600)
    try:
        request = GenerationRequest(prompt_ids=list(ids), max_new_tokens=new_tokens,
                                    sampling=SamplingParams(temperature=0.0), stop_token_ids=[],
                                    method="autoregressive", request_id=tag, cache_salt=tag)
        began = time.perf_counter()
        result = await client.generate(request)
        return time.perf_counter() - began, [r.end - r.start for r in result.iterations]
    finally:
        await client.close()


def main() -> None:
    kind, rounds = sys.argv[1], int(sys.argv[2])
    hf_dtype = sys.argv[3] if len(sys.argv) > 3 else "int8-per-tensor"
    out = Path(tempfile.mkdtemp(prefix="served-prefill-"))
    args = argparse.Namespace(draft="qwen2.5-coder-0.5b", target="qwen2.5-coder-1.5b", dtype="int8",
                              extra_up_args="", out=out, trace=False)
    torch.set_num_threads(2)
    target = load_hf_target(resolve_model(args.target), hf_dtype, 2)
    item = next(i for i in workload_items(["grounded"], 1)["grounded"] if i.kind == kind)
    ids = prompt_ids(item, target.tokenizer, 1024)
    print("prompt tokens", len(ids), flush=True)
    server = start_server("B", "B", args, None, print)
    address = server.info["orchestrator"]
    try:
        hf_run(target, None, "hf", ids, 4, 0.0, 0, 10)
        asyncio.run(ours(address, ids, 4, "warm"))
        rows = []
        for r in range(rounds):
            _, hf1 = hf_run(target, None, "hf", ids, 1, 0.0, 0, 10)
            _, hf64 = hf_run(target, None, "hf", ids, 64, 0.0, 0, 10)
            ours1, _ = asyncio.run(ours(address, ids, 1, f"a{r}"))
            ours64, iterations = asyncio.run(ours(address, ids, 64, f"b{r}"))
            row = {"hf_prefill": hf1, "hf_step": (hf64 - hf1) / 63, "hf64": hf64, "ours1": ours1,
                   "ours_first_iteration": iterations[0], "ours_step": statistics.median(iterations[1:]),
                   "ours64": ours64}
            print({k: round(v, 4) for k, v in row.items()}, flush=True)
            rows.append(row)
        for key in rows[0]:
            print(key, round(statistics.median(r[key] for r in rows), 4))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
