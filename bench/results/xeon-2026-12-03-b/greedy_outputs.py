"""Greedy outputs of the default target (specdec int8 through HF generate) for bench_grounded's
grounded and open prompts: python greedy_outputs.py PER_KIND TOKENS OUT.json (suffix_replay.py
reads them)."""

import json
import sys

import torch

from bench.bench_grounded import hf_run
from bench.grounded_prompts import prompt_ids, workload_items
from specdec.models import resolve_model
from specdec.runtime.loading import load_model


def main() -> None:
    per_kind, tokens, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(2)
    target = load_model(resolve_model("qwen2.5-coder-1.5b"), dtype="int8", threads=2)
    out = []
    for workload, items in workload_items(["grounded", "open"], per_kind).items():
        for item in items:
            ids = prompt_ids(item, target.tokenizer)
            new, seconds = hf_run(target, None, "hf", ids, tokens, 0.0, 0, 10)
            out.append({"id": item.id, "workload": workload, "kind": item.kind, "prompt": ids, "output": new})
            print(item.id, len(ids), f"{seconds:.1f}s", flush=True)
    with open(out_path, "w") as file:
        json.dump(out, file)


if __name__ == "__main__":
    main()
