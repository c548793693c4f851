"""fbgemm against specdec's VNNI kernel per default-target weight shape and row count, calls
alternated on the same rows (random weights; 2 threads). Run from the repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06d/gemm_rows.py
"""
import statistics
import time

import torch

from specdec.runtime.int8 import FBGEMM, VNNI, Int8Product, quantize_rows

torch.set_num_threads(2)
print("ms per call, min / median of 15 alternated calls: fbgemm | vnni")
for inputs, outputs in ((1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536), (1536, 151936)):
    product = Int8Product(torch.randn(outputs, inputs))
    product.run_wide_from(1, VNNI)
    cells = []
    for rows in (1, 4, 9, 16, 33, 64, 128, 256):
        codes, _ = quantize_rows(torch.randn(rows, inputs))
        assert torch.equal(product.gemm(codes, FBGEMM), product.gemm(codes, VNNI))
        times = {FBGEMM: [], VNNI: []}
        for _ in range(15):
            for kernel in times:
                began = time.perf_counter()
                product.gemm(codes, kernel)
                times[kernel].append(time.perf_counter() - began)
        cells.append(f"{rows}: " + " | ".join(
            f"{min(t) * 1e3:.2f}/{statistics.median(t) * 1e3:.2f}" for t in times.values()))
    print(f"{inputs} x {outputs}:", "; ".join(cells), flush=True)
