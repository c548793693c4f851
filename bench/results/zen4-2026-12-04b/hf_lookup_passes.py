"""HF prompt lookup's passes on each grounded prompt (rows per target pass: the prompt's pass carries
a 10-token draft, then 11 rows a verify or 1 a step) at plain HF's per-tensor int8, T = 0.

    PYTHONPATH=. python bench/results/zen4-2026-12-04b/hf_lookup_passes.py extract,code-edit,rag,rename
"""

import sys

import torch

from bench.bench_grounded import hf_run, load_hf_target
from bench.grounded_prompts import prompt_ids, workload_items
from specdec.models import resolve_model


def main() -> None:
    torch.set_num_threads(2)
    target = load_hf_target(resolve_model("qwen2.5-coder-1.5b"), "int8-per-tensor", 2)
    items = workload_items(["grounded"], 1)["grounded"]
    rows: list[int] = []

    def count(module, args, kwargs, out) -> None:
        rows.append(kwargs["input_ids"].shape[-1])

    target.model.register_forward_hook(count, with_kwargs=True)
    for kind in sys.argv[1].split(","):
        item = next(i for i in items if i.kind == kind)
        ids = prompt_ids(item, target.tokenizer, 1024)
        rows.clear()
        _, seconds = hf_run(target, None, "hf-lookup", ids, 64, 0.0, 0, 10)
        print(kind, len(ids), f"{seconds:.2f} s", "passes", len(rows), "rows", rows)


if __name__ == "__main__":
    main()
