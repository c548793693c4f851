"""Plain HF's greedy continuations (torch.ao per-tensor int8, 64 tokens) of the prompts in
greedy_outputs.json, into hf_greedy_outputs.json, with where each first differs from ours.

    PYTHONPATH=. python bench/results/zen4-2026-12-04b/hf_greedy_outputs.py
"""

import json
from pathlib import Path

import torch

from bench.bench_grounded import hf_run, load_hf_target
from bench.greedy_text import agreed_prefix
from specdec.models import resolve_model

HERE = Path(__file__).parent


def main() -> None:
    torch.set_num_threads(2)
    target = load_hf_target(resolve_model("qwen2.5-coder-1.5b"), "int8-per-tensor", 2)
    ours = json.loads((HERE / "greedy_outputs.json").read_text())
    out = {}
    for item, entry in ours.items():
        tokens, _ = hf_run(target, None, "hf", entry["prompt"], 64, 0.0, 0, 10)
        out[item] = {"prompt": entry["prompt"], "output": tokens}
        print(item, "first difference at", agreed_prefix(tokens, entry["output"][:64]), flush=True)
    (HERE / "hf_greedy_outputs.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
