"""Per default-target shape, 28 distinct weights (random) called in turn as a pass reads them:
fbgemm against the VNNI kernel, ms per 28 calls, median of 7 alternated sweeps (2 threads). Run
from the repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06e/stream_shapes.py
"""
import statistics
import time

import torch

from specdec.runtime.int8 import FBGEMM, VNNI, Int8Product, quantize_rows
from specdec.runtime.int8_kernels import NEVER

torch.set_num_threads(2)
for n, k in ((1536, 8960), (1536, 1536), (2048, 1536), (17920, 1536)):
    layers = [Int8Product(torch.randn(n, k)) for _ in range(28)]
    for product in layers:
        product.run_wide_from(NEVER, VNNI)  # both layouts held: fbgemm's and the kernel's
    out = []
    for rows in (1, 2, 4, 6, 8, 10, 12, 16):
        a, _ = quantize_rows(torch.randn(rows, k))
        res = {FBGEMM: [], VNNI: []}
        for _ in range(7):
            for kernel in res:
                t = time.perf_counter()
                for product in layers:
                    product.gemm(a, kernel)
                res[kernel].append((time.perf_counter() - t) * 1e3)
        out.append(f"{rows}: {statistics.median(res[FBGEMM]):.1f}|{statistics.median(res[VNNI]):.1f}")
    print(f"{k}->{n}", "; ".join(out), flush=True)
