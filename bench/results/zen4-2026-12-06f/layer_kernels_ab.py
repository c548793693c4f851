"""In one process: the layer kernels' modules against transformers' own over the same int8 linears,
swapped round by round (the order alternating); one-row and ten-row passes after a 500-token prompt,
the median of 8 passes a round. Run from the repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06f/layer_kernels_ab.py 8
"""

import statistics
import sys
import time

import torch
import transformers.models.qwen2.modeling_qwen2 as qwen2

from bench.bench_grounded import load_hf_target
from bench.bench_pass import prompt_ids
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.layer_kernels import GatedInt8MLP, RowRMSNorm


def torch_twin(module: torch.nn.Module, config) -> torch.nn.Module | None:
    """transformers' module computing what `module` does, over the same weights and int8 linears."""
    if isinstance(module, RowRMSNorm):
        twin = qwen2.Qwen2RMSNorm(module.weight.shape[0], module.variance_epsilon)
        twin.weight = module.weight
        return twin
    if isinstance(module, GatedInt8MLP):
        twin = qwen2.Qwen2MLP(config)
        twin.gate_proj, twin.up_proj, twin.down_proj = module.gate_proj, module.up_proj, module.down_proj
        return twin
    return None


def main(rounds: int) -> None:
    loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
    model, vocab = loaded.model, loaded.info.vocab_size
    tables: dict[str, dict] = {"C": {}, "torch": {}}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            twin = torch_twin(child, model.config)
            if twin is not None:
                tables["C"][(parent, name)], tables["torch"][(parent, name)] = child, twin
    times: dict[tuple[str, int], list[float]] = {(label, n): [] for label in tables for n in (1, 10)}
    with torch.inference_mode():
        kv = TreeKVCache(model)
        kv.prefill(prompt_ids(vocab, 500))
        for round_ in range(rounds):
            for label in ("torch", "C") if round_ % 2 == 0 else ("C", "torch"):
                for (parent, name), module in tables[label].items():
                    setattr(parent, name, module)
                for n in (1, 10):
                    tokens, parents = [t % vocab for t in range(600, 600 + n)], list(range(-1, n - 1))
                    passes = []
                    for _ in range(8):
                        began = time.perf_counter()
                        kv.extend(tokens, parents)
                        kv.settle([])
                        passes.append(time.perf_counter() - began)
                    times[(label, n)].append(statistics.median(passes))
    for n in (1, 10):
        plain, fused = times[("torch", n)], times[("C", n)]
        ratios = ", ".join(f"{c / t:.2f}" for t, c in zip(plain, fused, strict=True))
        print(f"T({n}): torch modules {1e3 * statistics.median(plain):.1f} ms, C kernels "
              f"{1e3 * statistics.median(fused):.1f} ms; per round C/torch: {ratios}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
