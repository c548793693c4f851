"""Batch-invariant int8 linear layers: int8 weights per output channel, int8 activations per row.

Why per row: a per-tensor activation scale (torch.ao's dynamic quantisation) makes a row's logits
depend on the other rows of its pass (draft tokens, tree nodes, other sessions), so speculation
and batching would move the output law. Here each row is quantised with its own scale, the
int8 × int8 products are summed in int32 (exact, so in any order), and the float epilogue is one
product per element: a row's output is bitwise the same whatever else is in the pass
(docs/algorithms.md §14).

Four kernels compute the same numbers bitwise (a test checks it): fbgemm's int8 GEMM, fastest for
one row on every CPU measured, reached through one operator of the deprecated quantised tensor
API; `torch._int_mm` (oneDNN's s8 × s8 GEMM), which stays when that operator is gone; oneDNN's
quantised linear (`torch.ops.onednn.qlinear_pointwise`, the operator torch's x86 int8 compiler
path uses), which runs on AMX tiles where the CPU has it: 4× fbgemm's speed for a 128-row pass on
an AMX Xeon; and specdec's own `int8_gemm_kernel.c` on AVX-512 VNNI (1.2–1.9× fbgemm's speed for
9–64 rows on a Zen 4 EPYC). A product may run fbgemm below a row count and a wide kernel from it,
per call (specdec.runtime.int8_kernels measures which and where on this CPU).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import warnings

import torch

from specdec.runtime.c_kernels import KernelUnavailable, compiled
from specdec.runtime.fixed_attention import (
    ATTENTION_ENV,
    FIXED_ORDER,
    attention_choice,
    fixed_order_attention,
    supports,
)
from specdec.runtime.huge_pages import on_huge_pages

log = logging.getLogger(__name__)

ACTIVATION_LEVELS = 63  # codes in [-63, 63]: AVX2's u8×s8 pair sums (vpmaddubsw) stay within int16
WEIGHT_LEVELS = 127
_ACTIVATION_ZERO_POINT = 64  # the fbgemm operator takes unsigned codes: code + 64 in [1, 127]
FBGEMM, INT_MM, ONEDNN, VNNI = "fbgemm", "int_mm", "onednn", "vnni"
WIDE_KERNELS = (INT_MM, ONEDNN, VNNI)  # what a product may switch to from some row count on
VNNI_SOURCE = "int8_gemm_kernel.c"
VNNI_PANEL = 32  # outputs per packed panel of int8_gemm_kernel.c


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")


def onednn_available() -> bool:
    """Whether this torch has oneDNN's quantised linear (x86 builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.cache
def _vnni_library() -> ctypes.CDLL | None:
    """int8_gemm_kernel.c built for this CPU, where it has AVX-512 VNNI and a C compiler; else None."""
    try:
        library = compiled(VNNI_SOURCE, "int8-gemm")
    except KernelUnavailable as error:
        log.info("the VNNI int8 kernel is not available: %s", error)
        return None
    if not library.specdec_int8_gemm_available():  # built without AVX-512 VNNI
        return None
    i64 = ctypes.c_int64
    library.specdec_int8_gemm.argtypes = [ctypes.c_void_p, i64, i64, ctypes.c_void_p, i64,
                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    library.specdec_int8_gemm.restype = ctypes.c_int
    library.specdec_int8_quantize_gemm.argtypes = [ctypes.c_void_p, i64, i64, ctypes.c_float, ctypes.c_void_p,
                                                   i64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                   ctypes.c_int]
    library.specdec_int8_quantize_gemm.restype = ctypes.c_int
    return library


def vnni_available() -> bool:
    """Whether int8_gemm_kernel.c runs here (x86-64 with AVX-512 VNNI and a C compiler)."""
    return _vnni_library() is not None


def pack_for_vnni(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight codes [N, K] and scales [N] in int8_gemm_kernel.c's layout: unsigned codes
    w + 128 in panels of 32 outputs, each a run of [K / 4][2 vectors][16 outputs][4 inputs], zero
    weights past N and K; the scales padded with zeros to the panels."""
    outputs, inputs = codes.shape
    padded_n = -(-outputs // VNNI_PANEL) * VNNI_PANEL
    padded_k = -(-inputs // 4) * 4
    wide = torch.zeros(padded_n, padded_k, dtype=torch.int16)
    wide[:outputs, :inputs] = codes.to(torch.int16)
    unsigned = (wide + 128).to(torch.uint8)
    vectors = VNNI_PANEL // 16
    packed = unsigned.reshape(padded_n // VNNI_PANEL, vectors, 16, padded_k // 4, 4).permute(0, 3, 1, 2, 4)
    padded_scale = torch.zeros(padded_n, dtype=torch.float32)
    padded_scale[:outputs] = scale
    return packed.contiguous(), padded_scale


def _vnni_gemm(codes: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, outputs: int) -> torch.Tensor:
    """float(Σ_k codes · W) · scale [rows, outputs] by int8_gemm_kernel.c (the GIL let go)."""
    library = _vnni_library()
    assert library is not None, "the VNNI kernel runs only where vnni_available()"
    codes = codes.to(torch.float32).contiguous()
    rows, inputs = codes.shape
    out = torch.empty(rows, outputs, dtype=torch.float32)
    if rows and library.specdec_int8_gemm(codes.data_ptr(), rows, inputs, packed.data_ptr(), outputs,
                                          scale.data_ptr(), out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("the VNNI int8 kernel could not allocate its scratch rows")
    return out


def _vnni_quantize_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                        outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(x) and _vnni_gemm of its codes in one C call (bitwise the same product and
    row scales): (product [rows, outputs], row scales [rows, 1])."""
    library = _vnni_library()
    assert library is not None, "the VNNI kernel runs only where vnni_available()"
    x = x.to(torch.float32).contiguous()
    rows, inputs = x.shape
    out = torch.empty(rows, outputs, dtype=torch.float32)
    row_scale = torch.empty(rows, 1, dtype=torch.float32)
    if rows and library.specdec_int8_quantize_gemm(x.data_ptr(), rows, inputs, float(ACTIVATION_LEVELS),
                                                   packed.data_ptr(), outputs, scale.data_ptr(),
                                                   out.data_ptr(), row_scale.data_ptr(),
                                                   torch.get_num_threads()):
        raise MemoryError("the VNNI int8 kernel could not allocate its scratch rows")
    return out, row_scale


def _onednn_linear(codes: torch.Tensor, zero_point: int, packed: torch.Tensor, scale: torch.Tensor,
                   weight_zero_points: torch.Tensor) -> torch.Tensor:
    """float(Σ codes · W) · scale per output channel by oneDNN's quantised linear, the codes taken
    as signed (zero point 0) or shifted into unsigned ones (any other zero point)."""
    x = codes.to(torch.int8) if zero_point == 0 else (codes + zero_point).to(torch.uint8)
    return torch.ops.onednn.qlinear_pointwise(
        x, 1.0, zero_point, packed, scale, weight_zero_points, None, 1.0, 0, torch.float32, "none", [], "")


@functools.cache
def onednn_input_zero_point() -> int | None:
    """How oneDNN's quantised linear takes the codes on this CPU so that it sums them exactly: 0
    (signed, the form measured on the AMX Xeon) where that is exact, else 64 (unsigned, fbgemm's
    form); None where neither is (the kernel is then never chosen).

    Without VNNI, oneDNN shifts signed codes by 128 into unsigned ones and sums u8 × s8 pairs in
    int16 (vpmaddubsw), which saturates at 191 · 127 · 2: on an AVX2 EPYC its rows came out wrong
    by several per cent. Codes + 64 stay in [1, 127], within int16, as for fbgemm. Checked once, on
    the codes that saturate first (every one at its extreme).
    """
    if not onednn_available():
        return None
    inputs, outputs = 256, 16
    weight = torch.full((outputs, inputs), WEIGHT_LEVELS, dtype=torch.int8)
    weight[outputs // 2:] = -WEIGHT_LEVELS
    codes = torch.full((3, inputs), float(ACTIVATION_LEVELS))
    codes[1] = -ACTIVATION_LEVELS
    codes[2, ::2] = -ACTIVATION_LEVELS
    exact = codes.double() @ weight.double().t()
    packed = torch.ops.onednn.qlinear_prepack(weight, [1, inputs])
    ones, no_zero_points = torch.ones(outputs), torch.zeros(outputs, dtype=torch.long)
    for zero_point in (0, _ACTIVATION_ZERO_POINT):
        if torch.equal(_onednn_linear(codes, zero_point, packed, ones, no_zero_points).double(), exact):
            return zero_point
    log.warning("oneDNN's quantised linear does not sum int8 codes exactly on this CPU: not used")
    return None


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


class Int8Product:
    """The int8 GEMM of one weight: Σ_k codes_mk · W_nk · s_n for a block of row codes.

    Projections of the same input (q, k and v; gate and up) share one: one quantisation of the
    input and one GEMM for all of them, each taking its columns (a column of the product does not
    depend on the others, so this is bitwise what separate layers compute).
    """

    def __init__(self, weight: torch.Tensor, kernel: str | None = None, members: int = 1):
        kernel = kernel or (FBGEMM if fbgemm_available() else INT_MM)
        if kernel not in (FBGEMM, INT_MM):
            raise ValueError(f"kernel must be {FBGEMM} or {INT_MM}, got {kernel!r}")
        self.kernel = kernel
        codes, self.weight_scale = quantize_weight(weight.detach().float())
        self.shape = (int(codes.shape[1]), int(codes.shape[0]))  # (K, N): input and output features
        self._packed = self._codes_t = self._onednn = None
        self._vnni: tuple[torch.Tensor, torch.Tensor] | None = None  # (packed codes, padded scales)
        self._onednn_zero_point = 0  # how oneDNN takes the codes here (onednn_input_zero_point)
        # From this many rows on a call runs `wide_kernel`, below it fbgemm (None: one kernel only)
        self.wide_from_rows: int | None = None
        self.wide_kernel: str | None = None
        self._no_zero_points = torch.zeros(self.shape[1], dtype=torch.long)  # oneDNN's weight zero points
        if kernel == FBGEMM:
            self._packed = self._fbgemm_pack(codes)
        else:
            self._codes_t = codes.t().contiguous()  # [K, N], as torch._int_mm takes it
        self.members = members
        self._last = threading.local()  # per thread: (input, its version, product, row scale, uses)

    def _fbgemm_pack(self, codes: torch.Tensor):
        """fbgemm's packed weight for int8 codes [N, K]."""
        with warnings.catch_warnings():  # quantised tensors are deprecated; only this packs for fbgemm
            warnings.simplefilter("ignore")
            zero_points = torch.zeros_like(self.weight_scale, dtype=torch.long)
            scale = self.weight_scale.double()
            qweight = torch._make_per_channel_quantized_tensor(codes, scale, zero_points, 0)
            return torch.ops.quantized.linear_prepack(qweight, None)

    def weight_codes(self) -> torch.Tensor:
        """The int8 weight codes [N, K], from whichever layout is held."""
        if self._codes_t is not None:
            return self._codes_t.t()
        if self._packed is None and self._vnni is not None:
            inputs, outputs = self.shape
            panels, groups = self._vnni[0].shape[:2]
            unsigned = self._vnni[0].permute(0, 2, 3, 1, 4).reshape(panels * VNNI_PANEL, groups * 4)
            return (unsigned.to(torch.int16) - 128).to(torch.int8)[:outputs, :inputs]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.int_repr()

    def run_wide_from(self, rows: int | None, kernel: str = INT_MM) -> None:
        """Calls of at least `rows` rows run `kernel` (_int_mm, oneDNN's or the VNNI kernel), smaller
        ones fbgemm (None: fbgemm only).

        Every kernel gives every row bitwise the same (exact int32 sums, one float product), so
        the switch is invisible in the output; it costs a second copy of the int8 weight, in the
        wide kernel's layout, kept only where it is used. From one row on no call reaches fbgemm, so
        its copy goes where the wide layout gives the codes back (_int_mm's, the VNNI kernel's),
        and comes back from them if a call or a later switch needs it.
        """
        if self.kernel != FBGEMM:
            raise ValueError("this product has no fbgemm weight to switch from")
        if rows is not None and kernel not in WIDE_KERNELS:
            raise ValueError(f"a wide kernel is one of {', '.join(WIDE_KERNELS)}, got {kernel!r}")
        if rows is not None and kernel == VNNI and not vnni_available():
            raise ValueError("the VNNI int8 kernel does not run here (no AVX-512 VNNI, or no C compiler)")
        fbgemm_called = rows is None or rows > 1 or kernel == ONEDNN  # oneDNN's copy gives no codes back
        built = {INT_MM: self._codes_t, VNNI: self._vnni, ONEDNN: self._onednn}.get(kernel)
        # the codes (an unpack) only where a layout is to be made
        codes = self.weight_codes() if (fbgemm_called and self._packed is None) or (
            rows is not None and built is None) else None
        if fbgemm_called and self._packed is None:
            self._packed = self._fbgemm_pack(codes)
        if rows is None:
            self._codes_t = self._onednn = self._vnni = None
        elif kernel == INT_MM:
            self._onednn = self._vnni = None
            if self._codes_t is None:
                self._codes_t = codes.t().contiguous()
        elif kernel == VNNI:
            self._codes_t = self._onednn = None
            if self._vnni is None:
                packed, padded_scale = pack_for_vnni(codes, self.weight_scale)
                self._vnni = (on_huge_pages(packed), padded_scale)  # streamed every pass: fewer TLB misses
        else:
            self._vnni = None
            self._onednn_zero_point = onednn_input_zero_point()
            if self._onednn_zero_point is None:
                raise ValueError("oneDNN's quantised linear does not sum int8 codes exactly on this CPU")
            self._codes_t = None
            if self._onednn is None:
                self._onednn = torch.ops.onednn.qlinear_prepack(codes.contiguous(), [1, self.shape[0]])
        if not fbgemm_called:
            self._packed = None  # no call reaches fbgemm: its copy comes back from the codes when needed
        self.wide_from_rows, self.wide_kernel = rows, (None if rows is None else kernel)

    def gemm(self, codes: torch.Tensor, kernel: str) -> torch.Tensor:
        """Σ_k codes_mk · W_nk · s_n [rows, N] float32 by `kernel` (its weight must be held)."""
        if kernel == FBGEMM:
            if self._packed is None:  # let go by a switch from one row (run_wide_from); a measurement's call
                self._packed = self._fbgemm_pack(self.weight_codes())
            # scale 1.0: the operator's own quantisation of the codes is exact, its output is
            # float(int32 sum) · weight_scale, as the int_mm branch computes it
            return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                codes, 1.0, _ACTIVATION_ZERO_POINT, self._packed)
        if kernel == VNNI:
            assert self._vnni is not None, "run_wide_from(rows, VNNI) first"
            return _vnni_gemm(codes, *self._vnni, self.shape[1])
        if kernel == ONEDNN:
            # input scale 1.0, weight zero points 0: float(int32 sum) · weight_scale per output
            # channel, the same one product as the other kernels
            return _onednn_linear(codes, self._onednn_zero_point, self._onednn, self.weight_scale,
                                  self._no_zero_points)
        # int32 × float32 promotes per element: float(sum) · scale, one pass and one rounding
        return torch._int_mm(codes.to(torch.int8), self._codes_t) * self.weight_scale

    def kernel_for(self, rows: int) -> str:
        if self.kernel != FBGEMM:
            return self.kernel
        threshold = self.wide_from_rows  # with fbgemm's copy let go, every call (even of no rows)
        wide = threshold is not None and (rows >= threshold or self._packed is None)
        return self.wide_kernel if wide else FBGEMM

    def all_columns(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(product [rows, N] float32, row scales [rows, 1]) for input `x` (any leading shape),
        computed now: for a caller that takes every member's columns at once (no sharing)."""
        rows = x.reshape(-1, x.shape[-1])
        kernel = self.kernel_for(rows.shape[0])
        if kernel == VNNI:  # quantised inside the kernel's call: bitwise quantize_rows' codes
            assert self._vnni is not None, "run_wide_from(rows, VNNI) first"
            return _vnni_quantize_gemm(rows, *self._vnni, self.shape[1])
        codes, row_scale = quantize_rows(rows.float())
        return self.gemm(codes, kernel), row_scale

    def __call__(self, x: torch.Tensor, member: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(product [rows, N] float32, row scales [rows, 1]) for input `x` (any leading shape).

        A shared product is computed once for its members (`member`: which one asks); each may
        scale its own columns in place, so a member asking twice for one input gets a fresh one.
        """
        last = getattr(self._last, "entry", None)
        version = None if x.is_inference() else x._version  # inference tensors keep no counter
        if last is not None and last[0] is x and last[1] == version and member not in last[4]:
            last[4].add(member)
            if len(last[4]) >= self.members:  # every member has its columns: let the tensors go
                self._last.entry = None
            return last[2], last[3]
        product, row_scale = self.all_columns(x)
        # holding `x` keeps its identity (and memory) from being reused until the siblings ran
        self._last.entry = [x, version, product, row_scale, {member}] if self.members > 1 else None
        return product, row_scale


class RowwiseInt8Linear(torch.nn.Module):
    """y = (s_row · s_col) · Σ int8·int8 + bias; a row's y depends on that row alone."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None,
                 output_dtype: torch.dtype = torch.float32, *, product: Int8Product | None = None,
                 columns: slice | None = None):
        super().__init__()
        self.output_dtype = output_dtype
        self.out_features, self.in_features = weight.shape
        self.product = product or Int8Product(weight, kernel)
        self.columns = columns  # this layer's columns of a shared product (None: all of its own)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float().clone(), False)

    @property
    def kernel(self) -> str:
        return self.product.kernel

    @property
    def weight_scale(self) -> torch.Tensor:
        scale = self.product.weight_scale
        return scale if self.columns is None else scale[self.columns]

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, kernel: str | None = None,
                    output_dtype: torch.dtype = torch.float32) -> RowwiseInt8Linear:
        return cls(linear.weight, linear.bias, kernel, output_dtype)

    @classmethod
    def sharing_input(cls, linears: list[torch.nn.Linear], dtypes: list[torch.dtype],
                      kernel: str | None = None) -> list[RowwiseInt8Linear]:
        """Layers for projections that always take the same input, over one shared product."""
        product = Int8Product(torch.cat([linear.weight for linear in linears]), kernel, len(linears))
        layers, start = [], 0
        for linear, dtype in zip(linears, dtypes, strict=True):
            stop = start + linear.out_features
            layers.append(cls(linear.weight, linear.bias, kernel, dtype, product=product,
                              columns=slice(start, stop)))
            start = stop
        return layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.columns is not None
        product, row_scale = self.product(x, self.columns.start if shared else 0)
        if shared:  # this layer's columns alone: scaling them in place leaves the siblings' as they are
            product = product[:, self.columns]
        if self.output_dtype != product.dtype:
            product, row_scale = product.to(self.output_dtype), row_scale.to(self.output_dtype)
        if self.bias is None:
            out = product.mul_(row_scale)
        else:
            out = torch.addcmul(self.bias.to(self.output_dtype), product, row_scale)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        shared = "" if self.columns is None else f", columns={self.columns.start}:{self.columns.stop}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={self.kernel}{shared}")


KV_PROJECTIONS = ("k_proj", "v_proj")  # transformers' names of the layers whose outputs are cached


SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # transformers' names


def quantize_linears(model: torch.nn.Module, kernel: str | None = None,
                     kv_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Replace every nn.Linear of `model` by a RowwiseInt8Linear (in place; returns the model).

    The key and value projections give `kv_dtype`, by default what this machine's invariant
    attention reads (`invariant_kv_dtype`): float32 for the fixed-order kernel; float64 for the
    float64 attention, which then reads the cache without a cast per pass (2× the cache's bytes;
    casting a float32 cache every pass measured slower). Projections of one input
    (SHARED_INPUTS) share one quantisation and one GEMM.
    """
    if kv_dtype is None:
        kv_dtype = invariant_kv_dtype(attention_choice())

    def dtype(name: str) -> torch.dtype:
        return kv_dtype if name in KV_PROJECTIONS else torch.float32

    for parent in list(model.modules()):
        children = {name: child for name, child in parent.named_children() if type(child) is torch.nn.Linear}
        for names in SHARED_INPUTS:
            if all(name in children for name in names) and len(
                    {children[name].in_features for name in names}) == 1:
                layers = RowwiseInt8Linear.sharing_input([children.pop(name) for name in names],
                                                         [dtype(name) for name in names], kernel)
                for name, layer in zip(names, layers, strict=True):
                    setattr(parent, name, layer)
        for name, child in children.items():
            setattr(parent, name, RowwiseInt8Linear.from_linear(child, kernel, dtype(name)))
    return model


def kv_element_size(model: torch.nn.Module) -> int | None:
    """Bytes per cached key/value element of a model made by quantize_linears, else None."""
    sizes = {m.output_dtype.itemsize for name, m in model.named_modules()
             if isinstance(m, RowwiseInt8Linear) and name.rsplit(".", 1)[-1] in KV_PROJECTIONS}
    return max(sizes) if sizes else None


# ----------------------------------------------------------------------------------------------
# attention: the float part of an int8 model, computed so that rounding cannot see the pass

INVARIANT_ATTENTION = "specdec_sdpa_float64"  # the names transformers knows them by
FIXED_ORDER_ATTENTION = "specdec_fixed_order"
# A one-row pass takes the grouped products from this many keys on: per layer, 12 query heads over
# 2 key/value heads, 0.94 against 1.54 ms at 1,500 keys, level at 400 (Zen 4 EPYC, 2 threads)
GROUPED_ONE_ROW_FROM_KEYS = 512


def invariant_kv_dtype(attention: str) -> torch.dtype:
    """The cache dtype the invariant attention `attention` (fixed_attention's names) reads."""
    return torch.float32 if attention == FIXED_ORDER else torch.float64


def _fixed_order_sdpa(module, query, key, value, attention_mask, scaling: float | None = None,
                      **kwargs):
    """The fixed-order float32 kernel (specdec.runtime.fixed_attention) as a transformers
    attention function. A call it cannot compute raises: answering it in float64 instead would
    give that pass's rows other values than the same rows in other passes."""
    if not supports(query, key, value, attention_mask, kwargs):
        raise NotImplementedError(
            f"the fixed-order attention does not compute this call (query {query.dtype} "
            f"{tuple(query.shape)}, mask {None if attention_mask is None else tuple(attention_mask.shape)}, "
            f"options {sorted(k for k, v in kwargs.items() if v is not None)}); "
            f"set {ATTENTION_ENV}=float64")
    return fixed_order_attention(query, key, value, attention_mask, scaling), None


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
        if ((query.shape[2] > 1 or key.shape[2] >= GROUPED_ONE_ROW_FROM_KEYS) and attention_mask.dim() == 4
                and attention_mask.shape[-1] == key.shape[2]
                and query.shape[1] % key.shape[1] == 0):
            return _grouped_float64_attention(query, key, value, attention_mask, kwargs.get("scaling")), None
    output, weights = sdpa_attention_forward(module, query.double(), key.double(), value.double(),
                                             attention_mask, **kwargs)
    return output.float(), weights


def _grouped_float64_attention(query, key, value, mask, scaling: float | None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v in float64 as two batched products, query heads grouped by
    their key/value head (no repeated keys): on this CPU faster than the float64 sdpa kernel for
    masked multi-row passes. Output [batch, rows, heads, dim] in float32, as sdpa's."""
    batch, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    grouped = query.double().reshape(batch, kv_heads, group * rows, dim)
    scores = torch.matmul(grouped, key.double().transpose(-1, -2)).mul_(scale)
    scores = scores.view(batch, kv_heads, group, rows, length).add_(mask[:, :, None])
    weights = torch.softmax(scores, dim=-1).view(batch, kv_heads, group * rows, length)
    output = torch.matmul(weights, value.double()).view(batch, heads, rows, dim)
    return output.transpose(1, 2).contiguous().float()


def use_invariant_attention(model: torch.nn.Module, attention: str | None = None) -> str:
    """Switch `model` to a pass-invariant attention (registered under its own name, with sdpa's
    masks) and return which: `attention` (fixed_attention's FIXED_ORDER or FLOAT64), by default
    this machine's (fixed_attention.attention_choice)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    attention = attention_choice() if attention is None else attention
    name, function = ((FIXED_ORDER_ATTENTION, _fixed_order_sdpa) if attention == FIXED_ORDER
                      else (INVARIANT_ATTENTION, _float64_sdpa))
    AttentionInterface.register(name, function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    log.info("int8 attention: %s", attention)
    return attention
