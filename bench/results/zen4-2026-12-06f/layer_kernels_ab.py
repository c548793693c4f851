"""In one process: the layer kernels' modules against transformers' own over the same int8 linears,
swapped round by round (the order alternating); one-row and ten-row passes after a 500-token prompt,
the median of 8 passes a round. Run from the repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06f/layer_kernels_ab.py 8
"""

import sys

import torch
import transformers.models.qwen2.modeling_qwen2 as qwen2

from bench.bench_grounded import load_hf_target
from bench.bench_pass import swap_report, swapped_in_one_process
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
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

    def switch(label: str) -> None:
        for (parent, name), module in tables[label].items():
            setattr(parent, name, module)

    times = swapped_in_one_process(model, vocab, ("torch", "C"), switch, rounds, (1, 10))
    print("\n".join(swap_report(times, ("torch", "C"), ("torch modules", "C kernels"), (1, 10))))

if __name__ == "__main__":
    main(int(sys.argv[1]))
