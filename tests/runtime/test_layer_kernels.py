"""The C RMS norm and gated-MLP middle of the int8 precision: each row computed from itself alone
(bitwise the same at any row count and thread count, so int8 rows stay pass-invariant), close to
torch's float32 numbers, and swapped into a model only where the module computes exactly that."""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.int8 import RowwiseInt8Linear, quantize_linears
from specdec.runtime.layer_kernels import (
    ENV,
    GatedInt8MLP,
    RowRMSNorm,
    load_kernels,
    use_layer_kernels,
)
from specdec.runtime.loading import quantize_int8
from specdec.runtime.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="no C compiler: the torch modules stay")


def _threads(n: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    return previous


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("width", [16, 37, 1536])
def test_a_norm_row_is_its_own_whatever_the_rows_and_threads_beside_it(width):
    torch.manual_seed(width)
    x = torch.randn(40, width) * torch.rand(40, 1) * 10
    norm = RowRMSNorm(torch.rand(width) + 0.5, 1e-6)
    expected = torch.stack([norm(row[None])[0] for row in x])  # each row alone, one thread's path
    for threads in (1, 2):
        previous = _threads(threads)
        try:
            for rows in (1, 7, 16, 40):  # below and above the threaded row count
                assert torch.equal(norm(x[:rows]), expected[:rows]), (threads, rows)
        finally:
            torch.set_num_threads(previous)
    assert torch.allclose(expected, torch_rms_norm(x, norm.weight, 1e-6), rtol=1e-5, atol=1e-6)


def test_the_mlp_middle_is_silu_of_the_scaled_gate_times_the_scaled_up_row_by_row():
    from specdec.runtime.layer_kernels import load_kernels as kernels

    torch.manual_seed(1)
    inner = 45  # not a multiple of 16: the last chunk is partial
    product = torch.randn(70, 2 * inner) * 30
    product[0, :inner] = torch.tensor([-200.0, -90.0, 0.0, 90.0, 200.0] * 9)  # exp's clamps, both ends
    scale = torch.rand(70, 1) + 0.01

    def middle(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], inner)
        kernels().specdec_silu_mul(rows.data_ptr(), scales.data_ptr(), rows.shape[0], inner, out.data_ptr(),
                                   torch.get_num_threads())
        return out

    alone = torch.cat([middle(product[r:r + 1].contiguous(), scale[r:r + 1].contiguous()) for r in range(70)])
    for threads in (1, 2):
        previous = _threads(threads)
        try:
            assert torch.equal(middle(product, scale), alone), threads
        finally:
            torch.set_num_threads(previous)
    gate, up = product[:, :inner] * scale, product[:, inner:] * scale
    assert torch.allclose(alone, torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-6)
    assert torch.isfinite(alone).all()


def _tiny_int8(seed: int = 3):
    model = build_tiny_model(vocab_size=48, seed=seed, hidden_size=64, num_layers=3,
                             max_position_embeddings=256, logit_scale=1.0)
    return quantize_linears(model, kv_dtype=torch.float32)


def test_a_model_swaps_its_norms_and_gated_mlps_and_keeps_its_outputs_close():
    reference, model = _tiny_int8(), _tiny_int8()
    assert use_layer_kernels(model) == 3 * 2 + 1 + 3  # two norms a layer, the final norm, an MLP a layer
    assert isinstance(model.model.norm, RowRMSNorm) and isinstance(model.model.layers[0].mlp, GatedInt8MLP)
    assert isinstance(model.model.layers[0].mlp.down_proj, RowwiseInt8Linear)
    ids = torch.randint(0, 48, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = (m(input_ids=ids).logits.float() for m in (reference, model))
    # int8 rounding can turn a last-bit difference into a code step now and then: close, not equal
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_nothing_is_swapped_when_turned_off_or_for_other_modules(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    assert use_layer_kernels(_tiny_int8()) == 0
    monkeypatch.delenv(ENV)
    float_model = build_tiny_model(vocab_size=48, hidden_size=64)  # MLPs of float nn.Linear: norms only
    assert use_layer_kernels(float_model) == 2 * 2 + 1

    class GemmaRMSNorm(torch.nn.Module):  # another formula (1 + weight) under a weight attribute
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.zeros(16)), 1e-6

    holder = torch.nn.Sequential(GemmaRMSNorm())
    assert use_layer_kernels(holder) == 0 and type(holder[0]).__name__ == "GemmaRMSNorm"


def test_int8_loading_runs_the_layer_kernels_and_rows_stay_pass_invariant():
    """quantize_int8 (every int8 engine's load) swaps them in; the invariance check of
    test_int8_invariance passes through them with every row bitwise its one-token reference."""
    from tests.runtime.test_int8_invariance import differences, tiny

    with torch.no_grad():
        model = quantize_int8(tiny())
        assert isinstance(model.model.layers[0].mlp, GatedInt8MLP)
        assert isinstance(model.model.layers[0].input_layernorm, RowRMSNorm)
        found = differences(model)
    assert all(unequal == 0 for unequal, _ in found.values()), found
