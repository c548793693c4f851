"""The int8 precision's RMS norms and gated-MLP middles in one C pass a row (layer_kernels.c).

transformers computes a Llama-family RMS norm in six torch operators and the gated MLP's middle
(each half of the shared gate-and-up product scaled by its row's scale, then silu(gate) · up) in
four; in a decode step each is a call with its own dispatch overhead (57 norms and 28 middles a pass
of the default target), and in a prefill each is a pass over [rows, 8960] floats. One C call a row
block does either. Every row is computed in one fixed order from that row alone, so rows stay
bitwise the same in every pass shape (tests/runtime/test_layer_kernels.py); the numbers differ from
torch's in the last bits, so `use_layer_kernels` swaps a model's modules once, at load, and every
pass of that model runs them. Without a C compiler (or with SPECDEC_LAYER_KERNELS=0) the torch
modules stay.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from specdec.defaults import switched_off
from specdec.runtime.c_kernels import KernelUnavailable, compiled
from specdec.runtime.int8 import RowwiseInt8Linear

log = logging.getLogger(__name__)

SOURCE = "layer_kernels.c"
ENV = "SPECDEC_LAYER_KERNELS"
# transformers' classes whose forward is exactly these computations (weight · normalised x in
# float32; down(silu(gate(x)) · up(x))): other norms (Gemma's 1 + weight) and MLPs keep theirs
RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
GATED_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")


@functools.cache
def load_kernels() -> ctypes.CDLL | None:
    """layer_kernels.c built for this CPU; None where it cannot be built (the torch modules stay)."""
    try:
        library = compiled(SOURCE, "layer-kernels")
    except KernelUnavailable as error:
        log.info("the layer kernels are not available: %s", error)
        return None
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    library.specdec_rms_norm.argtypes = [pointer, i64, i64, pointer, ctypes.c_float, pointer, ctypes.c_int]
    library.specdec_rms_norm.restype = None
    library.specdec_silu_mul.argtypes = [pointer, pointer, i64, i64, pointer, ctypes.c_int]
    library.specdec_silu_mul.restype = None
    return library


class RowRMSNorm(torch.nn.Module):
    """weight · x / sqrt(mean(x²) + eps) over the last dimension, float32, one C pass a row."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().float().contiguous(), requires_grad=False)
        self.variance_epsilon = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.to(torch.float32).contiguous()
        out = torch.empty_like(rows)
        width = rows.shape[-1]
        load_kernels().specdec_rms_norm(rows.data_ptr(), rows.numel() // width if width else 0, width,
                                        self.weight.data_ptr(), self.variance_epsilon, out.data_ptr(),
                                        torch.get_num_threads())
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class GatedInt8MLP(torch.nn.Module):
    """down(silu(gate(x)) · up(x)) over the int8 layers' shared gate-and-up product: the product and
    the row scales from one GEMM, the middle in one C pass, then the down projection."""

    def __init__(self, gate_proj: RowwiseInt8Linear, up_proj: RowwiseInt8Linear,
                 down_proj: RowwiseInt8Linear):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.inner = gate_proj.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product, row_scale = self.gate_proj.product.all_columns(x)
        rows = product.shape[0]
        middle = torch.empty(rows, self.inner, dtype=torch.float32)
        load_kernels().specdec_silu_mul(product.data_ptr(), row_scale.contiguous().data_ptr(), rows,
                                        self.inner, middle.data_ptr(), torch.get_num_threads())
        return self.down_proj(middle.view(*x.shape[:-1], self.inner))


def _gated_int8(mlp: torch.nn.Module) -> bool:
    """Whether `mlp` is a gated MLP over quantize_linears' shared gate-and-up product (gate's columns
    first, no biases, float32 out, SiLU between)."""
    gate, up, down = (getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    if not all(isinstance(layer, RowwiseInt8Linear) for layer in (gate, up, down)):
        return False
    act = getattr(mlp, "act_fn", None)
    return (gate.product is up.product and gate.columns is not None and up.columns is not None
            and gate.columns.start == 0 and up.columns.start == gate.out_features == up.out_features
            and gate.product.shape[1] == 2 * gate.out_features
            and gate.bias is None and up.bias is None
            and gate.output_dtype == up.output_dtype == torch.float32
            and type(act).__name__ in ("SiLU", "SiLUActivation"))


def use_layer_kernels(model: torch.nn.Module) -> int:
    """Swap `model`'s Llama-family RMS norms and int8 gated MLPs for the C ones (in place, once, at
    load); returns how many modules were swapped (0: none here, no compiler, or SPECDEC_LAYER_KERNELS=0)."""
    if switched_off(ENV) or load_kernels() is None:
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if kind in RMS_NORMS and isinstance(getattr(child, "weight", None), torch.Tensor):
                setattr(parent, name, RowRMSNorm(child.weight, child.variance_epsilon))
            elif kind in GATED_MLPS and _gated_int8(child):
                setattr(parent, name, GatedInt8MLP(child.gate_proj, child.up_proj, child.down_proj))
            else:
                continue
            swapped += 1
    log.info("layer kernels: %d norms and gated MLPs run in C", swapped)
    return swapped
