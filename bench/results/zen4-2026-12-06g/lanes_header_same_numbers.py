"""The fixed-order kernels before the shared header (lanes.h) and after: bitwise the same outputs.

Builds attention_kernel.c and layer_kernels.c as of commit 43973f2 (each with its own lanes, lane
sum and exponential) and as in this tree, then runs both on 300 random attention shapes (group
sizes 1-7, head dimensions 7-128, float masks hiding a fifth of the keys, queries scaled up to 40)
and 200 norm and gated-middle shapes (widths 17-8960, magnitudes 1e-3 to 1e4). Prints how many
differ (0 and 0 on the Zen 4 EPYC with gcc 12). Run from the repo root (a few seconds):

    PYTHONPATH=. python bench/results/zen4-2026-12-06g/lanes_header_same_numbers.py
"""

import ctypes
import random
import subprocess
import tempfile
from pathlib import Path

import torch

from specdec.runtime import fixed_attention, layer_kernels
from specdec.runtime.c_kernels import FLAGS, OPENMP, compiler

BEFORE = "43973f2"
RUNTIME = Path("specdec/runtime")


def build(directory: Path, source: str) -> ctypes.CDLL:
    out = directory / source.replace(".c", ".so")
    subprocess.run([str(compiler()), *FLAGS, OPENMP, str(directory / source), "-o", str(out)], check=True)
    return ctypes.CDLL(str(out))


def libraries(directory: Path) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    attention, layers = build(directory, "attention_kernel.c"), build(directory, "layer_kernels.c")
    attention.specdec_fixed_order_attention.argtypes = \
        fixed_attention.load_kernel().specdec_fixed_order_attention.argtypes
    attention.specdec_fixed_order_attention.restype = ctypes.c_int
    for name in ("specdec_rms_norm", "specdec_silu_mul"):
        getattr(layers, name).argtypes = getattr(layer_kernels.load_kernels(), name).argtypes
    return attention, layers


def attention_with(library: ctypes.CDLL, *arguments) -> torch.Tensor:
    saved = fixed_attention.load_kernel
    fixed_attention.load_kernel = lambda: library
    try:
        return fixed_attention.fixed_order_attention(*arguments)
    finally:
        fixed_attention.load_kernel = saved


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        before, after = Path(scratch, "before"), Path(scratch, "after")
        before.mkdir()
        after.mkdir()
        for name in ("attention_kernel.c", "layer_kernels.c"):
            shown = subprocess.run(["git", "show", f"{BEFORE}:{RUNTIME / name}"], check=True,
                                   capture_output=True)
            (before / name).write_bytes(shown.stdout)
        for name in ("attention_kernel.c", "layer_kernels.c", "lanes.h"):
            (after / name).write_bytes((RUNTIME / name).read_bytes())
        builds = {"before": libraries(before), "after": libraries(after)}
        rng = random.Random(0)
        torch.manual_seed(0)
        differ = 0
        for _ in range(300):
            kv_heads, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 4, 6, 7])
            dim, rows = rng.choice([128, 64, 80, 16, 24, 7]), rng.randrange(1, 12)
            length = rng.randrange(rows, 300)
            query = torch.randn(2, kv_heads * group, rows, dim) * rng.choice([0.1, 1, 10, 40])
            key, value = torch.randn(2, kv_heads, length, dim), torch.randn(2, kv_heads, length, dim)
            mask = torch.where(torch.rand(2, 1, rows, length) < 0.2, torch.finfo(torch.float32).min,
                               torch.randn(2, 1, rows, length))
            outs = [attention_with(builds[name][0], query, key, value, mask, None) for name in builds]
            differ += not torch.equal(*outs)
        print(f"attention: {differ} of 300 shapes differ")
        differ = 0
        for _ in range(200):
            rows, cols = rng.randrange(1, 40), rng.choice([1536, 8960, 17, 33, 256])
            magnitude = rng.choice([1e-3, 1, 30, 1e4])
            x, weight = torch.randn(rows, cols) * magnitude, torch.randn(cols)
            product, row_scale = torch.randn(rows, 2 * cols) * magnitude, torch.rand(rows) * 3
            results = []
            for _, layers in builds.values():
                normed, middle = torch.empty(rows, cols), torch.empty(rows, cols)
                layers.specdec_rms_norm(x.data_ptr(), rows, cols, weight.data_ptr(), 1e-6,
                                        normed.data_ptr(), 2)
                layers.specdec_silu_mul(product.data_ptr(), row_scale.data_ptr(), rows, cols,
                                        middle.data_ptr(), 2)
                results.append((normed, middle))
            differ += not all(torch.equal(a, b) for a, b in zip(*results, strict=True))
        print(f"norms and gated middles: {differ} of 200 shapes differ")


if __name__ == "__main__":
    main()
