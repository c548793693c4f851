"""Fixed-order float32 attention: the int8 precision's pass-invariant attention without float64.

The int8 model's rows are bitwise the same in every pass shape only if its attention output is
(docs/algorithms.md §14). float64 sdpa gets there by making the BLAS's order differences vanish on
rounding, at 1.4–2.1× float32's time and twice the cache's bytes. `attention_kernel.c` gets there
by fixing every sum's order from what the row itself sees (its docstring says how), in float32.

The kernel is C, built once per machine with the system's C compiler into the specdec home and
called through ctypes (specdec.runtime.c_kernels). Without a compiler (or with `SPECDEC_ATTENTION=float64`)
the int8 precision keeps the float64 attention; both are invariant, but they are not the same
model, so a process uses one (see `attention_choice`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from specdec.runtime.c_kernels import KernelUnavailable, compiled

log = logging.getLogger(__name__)

ATTENTION_ENV = "SPECDEC_ATTENTION"
FIXED_ORDER = "fixed-order"  # the C kernel (the default where it builds)
FLOAT64 = "float64"  # float64 sdpa (specdec.runtime.int8)
ATTENTION_CHOICES = ("auto", FIXED_ORDER, FLOAT64)
SOURCE = "attention_kernel.c"
NO_MASK, FLOAT_MASK, BOOL_MASK = 0, 1, 2


@functools.cache
def load_kernel() -> ctypes.CDLL:
    """The compiled kernel, built on first use (specdec.runtime.c_kernels); else KernelUnavailable
    saying why."""
    kernel = compiled(SOURCE, "fixed-order-attention")
    function = kernel.specdec_fixed_order_attention
    i64, i32 = ctypes.c_int64, ctypes.c_int
    function.argtypes = ([ctypes.c_void_p, i64, i64, i64] * 3
                         + [ctypes.c_void_p, i32, i64, i64, ctypes.c_void_p]
                         + [i32] * 6 + [ctypes.c_float, i32])
    function.restype = i32
    return kernel


def attention_choice() -> str:
    """`fixed-order` or `float64`: $SPECDEC_ATTENTION if set, else the kernel where it builds."""
    wanted = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if wanted not in ATTENTION_CHOICES:
        raise ValueError(f"{ATTENTION_ENV} must be one of {', '.join(ATTENTION_CHOICES)}, got {wanted!r}")
    if wanted == FLOAT64:
        return FLOAT64
    try:
        load_kernel()
    except KernelUnavailable as error:
        if wanted == FIXED_ORDER:
            raise
        log.warning("int8 attention falls back to float64 (slower): %s", error)
        return FLOAT64
    return FIXED_ORDER


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
             kwargs: dict) -> bool:
    """Whether the kernel computes this call: float32 on the CPU, grouped heads, no dropout,
    soft-capping or sliding window, a 4-D mask with one head (or none)."""
    return (query.dtype == key.dtype == value.dtype == torch.float32 and query.device.type == "cpu"
            and query.shape[1] % key.shape[1] == 0
            and not kwargs.get("dropout") and kwargs.get("softcap") is None
            and kwargs.get("sliding_window") is None
            and (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)))


def fixed_order_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v for query [B, H, R, D], key/value [B, Hkv, L, D], mask
    [B or 1, 1, R, L] (additive float or boolean; None: causal). Returns [B, R, H, D] float32."""
    batch, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if attention_mask is None:
        kind, mask, mask_batch, mask_row = NO_MASK, None, 0, 0
    else:
        if attention_mask.shape[-2:] != (rows, length):
            raise ValueError(f"mask {tuple(attention_mask.shape)} does not fit {rows} rows × {length} keys")
        if attention_mask.dtype == torch.bool:
            kind = BOOL_MASK
        else:
            kind = FLOAT_MASK
            if attention_mask.dtype != torch.float32:
                attention_mask = attention_mask.float()
        if attention_mask.stride(-1) != 1:
            attention_mask = attention_mask.contiguous()
        mask = attention_mask
        mask_batch = attention_mask.stride(0) if attention_mask.shape[0] > 1 else 0
        mask_row = attention_mask.stride(2)
    out = torch.empty(batch, rows, heads, dim, dtype=torch.float32)
    scale = dim ** -0.5 if scaling is None else scaling
    status = load_kernel().specdec_fixed_order_attention(
        query.data_ptr(), query.stride(0), query.stride(1), query.stride(2),
        key.data_ptr(), key.stride(0), key.stride(1), key.stride(2),
        value.data_ptr(), value.stride(0), value.stride(1), value.stride(2),
        None if mask is None else mask.data_ptr(), kind, mask_batch, mask_row,
        out.data_ptr(), batch, heads, kv_heads, rows, length, dim, scale,
        max(1, min(torch.get_num_threads(), batch * kv_heads * rows)))
    if status != 0:
        raise MemoryError("the fixed-order attention kernel could not allocate its scratch memory")
    return out
