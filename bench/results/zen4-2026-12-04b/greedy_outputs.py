"""Our target's greedy continuations (128 tokens, `up --drafter none`, target-only) of the grounded
and open prompts, into greedy_outputs.json beside this file (replay_drafts.py reads them).

    PYTHONPATH=. python bench/results/zen4-2026-12-04b/greedy_outputs.py
"""

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from bench.bench_grounded import start_server
from bench.grounded_prompts import prompt_ids, workload_items
from specdec.client import AsyncClient
from specdec.generation import GenerationRequest
from specdec.models import resolve_model
from specdec.sampling_params import SamplingParams

HERE = Path(__file__).parent


async def generate(address: str, items: dict, tokenizer) -> dict:
    client = AsyncClient(address, timeout_s=600)
    out = {}
    try:
        for workload_items_ in items.values():
            for item in workload_items_:
                ids = prompt_ids(item, tokenizer, 1024)
                request = GenerationRequest(prompt_ids=list(ids), max_new_tokens=128,
                                            sampling=SamplingParams(temperature=0.0), stop_token_ids=[],
                                            method="autoregressive", request_id="o" + item.id,
                                            cache_salt="o" + item.id)
                result = await client.generate(request)
                out[item.id] = {"prompt": list(ids), "output": list(result.token_ids)}
                print(item.id, len(ids), flush=True)
    finally:
        await client.close()
    return out


def main() -> None:
    args = argparse.Namespace(draft="qwen2.5-coder-0.5b", target="qwen2.5-coder-1.5b", dtype="int8",
                              extra_up_args="", out=Path(tempfile.mkdtemp(prefix="greedy-")), trace=False)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.target)))
    server = start_server("B", "B", args, None, print)
    try:
        items = workload_items(["grounded", "open"], 1)
        out = asyncio.run(generate(server.info["orchestrator"], items, tokenizer))
    finally:
        server.stop()
    (HERE / "greedy_outputs.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
