"""Batch-invariant int8 linear layers: int8 weights per output channel, int8 activations per row.

Why per row: a per-tensor activation scale (torch.ao's dynamic quantisation) makes a row's logits
depend on the other rows of its pass (draft tokens, tree nodes, other sessions), so speculation
and batching would move the output law. Here each row is quantised with its own scale, the
int8 × int8 products are summed in int32 (exact, so in any order), and the float epilogue is one
product per element: a row's output is bitwise the same whatever else is in the pass
(docs/algorithms.md §14).

Two kernels compute the same numbers bitwise (a test checks it): fbgemm's int8 GEMM, the only fast
int8 GEMM of torch 2.13 on AVX2 CPUs, reached through one operator of the deprecated quantised
tensor API; and `torch._int_mm`, the fallback where that operator is gone (30× slower here).
"""

from __future__ import annotations

import warnings

import torch

ACTIVATION_LEVELS = 63  # codes in [-63, 63]: AVX2's u8×s8 pair sums (vpmaddubsw) stay within int16
WEIGHT_LEVELS = 127
_ACTIVATION_ZERO_POINT = 64  # the fbgemm operator takes unsigned codes: code + 64 in [1, 127]
FBGEMM, INT_MM = "fbgemm", "int_mm"


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row codes (float tensor of integers in [-63, 63]) and each row's scale."""
    absmax = x.abs().amax(-1, keepdim=True)  # 5-8x faster here than vector_norm(inf) or aminmax
    scale = absmax.clamp_min(torch.finfo(x.dtype).tiny) / ACTIVATION_LEVELS
    codes = torch.div(x, scale).round_()  # |x / scale| <= 63 up to an ulp: rounds into [-63, 63]
    return codes, scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 codes [N, K] and their float32 scales [N]."""
    scale = weight.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / WEIGHT_LEVELS
    codes = torch.round(weight / scale[:, None]).clamp_(-WEIGHT_LEVELS, WEIGHT_LEVELS).to(torch.int8)
    return codes, scale.float()


class RowwiseInt8Linear(torch.nn.Module):
    """y = (s_row · s_col) · Σ int8·int8 + bias; a row's y depends on that row alone."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None,
                 output_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.output_dtype = output_dtype
        kernel = kernel or (FBGEMM if fbgemm_available() else INT_MM)
        if kernel not in (FBGEMM, INT_MM):
            raise ValueError(f"kernel must be {FBGEMM} or {INT_MM}, got {kernel!r}")
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        codes, scale = quantize_weight(weight.detach().float())
        self.register_buffer("weight_scale", scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float().clone(), False)
        if kernel == FBGEMM:
            with warnings.catch_warnings():  # quantised tensors are deprecated; only this packs for fbgemm
                warnings.simplefilter("ignore")
                qweight = torch._make_per_channel_quantized_tensor(
                    codes, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0)
                self._packed = torch.ops.quantized.linear_prepack(qweight, None)
            self._codes_t = None
        else:
            self._packed = None
            self._codes_t = codes.t().contiguous()  # [K, N], as torch._int_mm takes it

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, kernel: str | None = None,
                    output_dtype: torch.dtype = torch.float32) -> RowwiseInt8Linear:
        return cls(linear.weight, linear.bias, kernel, output_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        codes, row_scale = quantize_rows(rows)
        if self._packed is not None:
            # scale 1.0: the operator's own quantisation of the codes is exact, its output is
            # float(int32 sum) · weight_scale, as the int_mm branch computes it
            product = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                codes, 1.0, _ACTIVATION_ZERO_POINT, self._packed)
        else:
            product = torch._int_mm(codes.to(torch.int8), self._codes_t).float() * self.weight_scale
        if self.output_dtype != product.dtype:
            product, row_scale = product.to(self.output_dtype), row_scale.to(self.output_dtype)
        if self.bias is None:
            out = product.mul_(row_scale)
        else:
            out = torch.addcmul(self.bias.to(self.output_dtype), product, row_scale)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={self.kernel}")


KV_PROJECTIONS = ("k_proj", "v_proj")  # transformers' names of the layers whose outputs are cached


def quantize_linears(model: torch.nn.Module, kernel: str | None = None,
                     kv_dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """Replace every nn.Linear of `model` by a RowwiseInt8Linear (in place; returns the model).

    The key and value projections give `kv_dtype`: float64 by default, so the KV cache holds
    float64 and the float64 attention below reads it without a cast per pass (2× the cache's
    bytes; casting a float32 cache every pass measured slower).
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                dtype = kv_dtype if name in KV_PROJECTIONS else torch.float32
                setattr(parent, name, RowwiseInt8Linear.from_linear(child, kernel, dtype))
    return model


def kv_element_size(model: torch.nn.Module) -> int | None:
    """Bytes per cached key/value element of a model made by quantize_linears, else None."""
    sizes = {m.output_dtype.itemsize for name, m in model.named_modules()
             if isinstance(m, RowwiseInt8Linear) and name.rsplit(".", 1)[-1] in KV_PROJECTIONS}
    return max(sizes) if sizes else None


# ----------------------------------------------------------------------------------------------
# attention: the float part of an int8 model, computed so that rounding cannot see the pass

INVARIANT_ATTENTION = "specdec_sdpa_float64"


def _float64_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention computed in float64 and rounded back to the inputs' dtype.

    The float32 kernel's sums depend on how many queries and keys a pass holds (blocking, vector
    tails, padding), by about 1e-7; the next layer's per-row int8 rounding turns such a difference
    into a whole quantisation step now and then, so rows drift by up to a few logits. In float64
    the kernel's differences (~1e-16) vanish when rounded to float32, except for values within
    1e-16 of a float32 rounding midpoint, so a row's attention output is the same in every pass.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.double()
    output, weights = sdpa_attention_forward(module, query.double(), key.double(), value.double(),
                                             attention_mask, **kwargs)
    return output.float(), weights


def use_invariant_attention(model: torch.nn.Module) -> None:
    """Register the float64 sdpa under its own name (with sdpa's masks) and switch `model` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(INVARIANT_ATTENTION, _float64_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(INVARIANT_ATTENTION, sdpa_mask)
    model.set_attn_implementation(INVARIANT_ATTENTION)
