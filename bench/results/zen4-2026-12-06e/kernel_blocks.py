"""The VNNI kernel's blocks before (6 rows x 4 vectors over 64-output panels, commit 55d17f2) and
now (12 rows x 2 vectors over 32-output panels), on 28 layers' gate+up and down weights in turn (as
a pass streams them), alternated; ms per 28 layers, min / median of 7; the outputs checked equal.
PFS=512,1024 also times the current source with a software prefetch that many bytes ahead (tried,
dropped). Run from the repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06e/kernel_blocks.py [rows,rows,...]
"""
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec.runtime import int8

torch.set_num_threads(2)
work = Path(tempfile.mkdtemp())
BUILD = ["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
(work / "old.c").write_text(subprocess.run(
    ["git", "show", "55d17f2:specdec/runtime/int8_gemm_kernel.c"], check=True, capture_output=True,
    text=True).stdout)
subprocess.run([*BUILD, str(work / "old.c"), "-o", str(work / "old.so")], check=True)
(work / "pf.c").write_text(Path("specdec/runtime/int8_gemm_kernel.c").read_text().replace(
    "        DOT(0) DOT(1)", "#ifdef PF\n        _mm_prefetch((const char *)w + PF, _MM_HINT_T0);\n"
    "        _mm_prefetch((const char *)w + PF + 64, _MM_HINT_T0);\n#endif\n        DOT(0) DOT(1)", 1))
i64, pointer = ctypes.c_int64, ctypes.c_void_p
ARGUMENTS = [pointer, i64, i64, pointer, i64, pointer, pointer, ctypes.c_int]


def load(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    library.specdec_int8_gemm.argtypes = ARGUMENTS
    return library


libraries = [("old", load(work / "old.so"), 64), ("new", int8._vnni_library(), 32)]
for distance in filter(None, os.environ.get("PFS", "").split(",")):
    subprocess.run([*BUILD, f"-DPF={distance}", str(work / "pf.c"), "-o", str(work / f"pf{distance}.so")],
                   check=True)
    libraries.append((f"pf{distance}", load(work / f"pf{distance}.so"), 32))


def pack(codes: torch.Tensor, scale: torch.Tensor, panel: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = codes.shape
    padded_n, padded_k = -(-n // panel) * panel, -(-k // 4) * 4
    wide = torch.zeros(padded_n, padded_k, dtype=torch.int16)
    wide[:n, :k] = codes.to(torch.int16)
    unsigned = (wide + 128).to(torch.uint8).reshape(padded_n // panel, panel // 16, 16, padded_k // 4, 4)
    padded_scale = torch.zeros(padded_n)
    padded_scale[:n] = scale
    return unsigned.permute(0, 3, 1, 2, 4).contiguous(), padded_scale


def call(library: ctypes.CDLL, codes: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor], n: int):
    packed, scale = weight
    out = torch.empty(codes.shape[0], n)
    library.specdec_int8_gemm(codes.data_ptr(), codes.shape[0], codes.shape[1], packed.data_ptr(), n,
                              scale.data_ptr(), out.data_ptr(), 2)
    return out


layers = []  # per layer: [(outputs, {panel: packed weight})] for gate+up and down
for _ in range(28):
    weights = []
    for n, k in ((17920, 1536), (1536, 8960)):
        codes, scale = int8.quantize_weight(torch.randn(n, k))
        weights.append((n, {panel: pack(codes, scale, panel) for panel in (64, 32)}))
    layers.append(weights)
row_counts = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 4, 6, 8, 10, 12, 16, 24]
for rows in row_counts:
    inputs = {k: int8.quantize_rows(torch.randn(rows, k))[0].contiguous() for k in (1536, 8960)}
    for n, packed in layers[0]:
        k = packed[32][0].shape[1] * 4
        outputs = [call(library, inputs[k], packed[panel], n) for _, library, panel in libraries]
        assert all(torch.equal(outputs[0], other) for other in outputs[1:])
    times = {name: [] for name, _, _ in libraries}
    for _ in range(7):
        for name, library, panel in libraries:
            began = time.perf_counter()
            for weights in layers:
                for n, packed in weights:
                    call(library, inputs[packed[panel][0].shape[1] * 4], packed[panel], n)
            times[name].append((time.perf_counter() - began) * 1e3)
    print(rows, {name: f"{min(t):.1f}/{statistics.median(t):.1f}" for name, t in times.items()}, flush=True)
