"""The int8 kernels' rate on one layer of the default target's shape (1536 inputs, 8960 outputs: its
MLP's gate or up alone) at 1, 128 and 512 rows, 2 threads, the fastest of 7 calls: fbgemm
(what every pass here runs), oneDNN's quantised linear (one call at 128 rows, none at 512: it is a
slow loop on this CPU) and `torch._int_mm` (the wide kernels specdec.runtime.int8_kernels measures).
GOPS count 2 ops a multiply-add, as vnni_peak.c does.

    PYTHONPATH=. python bench/results/zen4-2026-12-06b/int8_gemm_rate.py
"""

import time
import warnings

import torch

from specdec.runtime.int8 import FBGEMM, INT_MM, ONEDNN, Int8Product, quantize_rows

warnings.simplefilter("ignore")
torch.set_num_threads(2)
K, N = 1536, 8960
weight = torch.randn(N, K) / 40
onednn = Int8Product(weight)
onednn.run_wide_from(1, ONEDNN)
int_mm = Int8Product(weight)
int_mm.run_wide_from(1, INT_MM)
def fastest(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return min(times)


for rows in (1, 128, 512):
    codes, _ = quantize_rows(torch.randn(rows, K))
    for name, product in ((FBGEMM, onednn), (ONEDNN, onednn), (INT_MM, int_mm)):
        if name == INT_MM and rows < 17:
            continue  # _int_mm takes at least 17 rows
        if name == ONEDNN and rows > 128:
            continue  # a reference loop here: ~19 s a call at 128 rows, ~74 s at 512
        repeats = 1 if name == ONEDNN and rows > 1 else 7
        best = fastest(lambda product=product, name=name, codes=codes: product.gemm(codes, name), repeats)
        print(f"{rows:4d} rows  {name:7s} {best * 1e3:10.2f} ms  {2 * rows * K * N / best / 1e9:6.0f} GOPS",
              flush=True)
