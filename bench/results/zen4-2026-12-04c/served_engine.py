"""The set-up prefill_chunks.py and prefill_tail.py share: both targets loaded on one ComputeThread
(2 torch threads, every other thread serial), and the ragged batcher a served verifier runs."""

import torch

from bench.bench_grounded import load_hf_target
from specdec.models import resolve_model
from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import ForwardBatcher
from specdec.runtime.compute_thread import ComputeThread


def served_engine():
    """(compute thread, our int8 target, plain HF's per-tensor target, our target's batcher)."""
    compute = ComputeThread(threads=2)
    model = resolve_model("qwen2.5-coder-1.5b")
    ours = compute.call(lambda: load_hf_target(model, "int8", 2))
    hf = compute.call(lambda: load_hf_target(model, "int8-per-tensor", 2))
    torch.set_num_threads(1)
    return compute, ours, hf, ForwardBatcher(ours.model, BatchConfig(), compute=compute)
