"""The int8 GEMM chosen per call by rows, shape and CPU: rows stay bitwise the same across the switch,
the choice follows the measurement, and it is kept per CPU key in the specdec home."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from specdec.runtime.int8 import (
    ACTIVATION_LEVELS,
    FBGEMM,
    INT_MM,
    Int8Product,
    RowwiseInt8Linear,
    fbgemm_available,
    quantize_linears,
    use_invariant_attention,
)
from specdec.runtime.int8_kernels import KERNELS_ENV, choose_kernels, cpu_key, crossover, measure, products
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="this torch build has no fbgemm")


def test_rows_are_bitwise_the_same_on_either_side_of_the_switch():
    torch.manual_seed(2)
    linear = torch.nn.Linear(160, 72)
    layer = RowwiseInt8Linear.from_linear(linear)
    layer.product.run_int_mm_from(4)  # 1–3 rows: fbgemm; 4 and more: _int_mm
    x = torch.randn(11, 160) * torch.rand(11, 1) * 4
    wide = layer(x)
    assert layer.product.kernel_for(11) == INT_MM and layer.product.kernel_for(3) == FBGEMM
    for i in range(11):
        assert torch.equal(layer(x[i:i + 1]), wide[i:i + 1])  # one row: the other kernel
    assert torch.equal(layer(x[2:5]), wide[2:5])
    layer.product.run_int_mm_from(None)
    assert layer.product._codes_t is None  # the second weight copy goes with the switch
    assert torch.equal(layer(x), wide)


def test_weight_codes_round_trip_through_fbgemm_packing():
    weight = torch.randn(40, 24)
    fbgemm, int_mm = Int8Product(weight, FBGEMM), Int8Product(weight, INT_MM)
    assert torch.equal(fbgemm.weight_codes(), int_mm.weight_codes())
    assert fbgemm.shape == (24, 40)


@pytest.mark.parametrize(("timings", "expected"), [
    ({16: (1.0, 2.0), 64: (4.0, 5.0), 256: (16.0, 6.0)}, 256),   # the AMX Xeon's shape
    ({16: (1.0, 0.5), 64: (4.0, 2.0), 256: (16.0, 6.0)}, 16),
    ({16: (1.0, 2.0), 64: (4.0, 3.0), 256: (16.0, 17.0)}, None),  # wins in the middle only
    ({16: (1.0, 0.95), 64: (4.0, 3.9), 256: (16.0, 15.0)}, None),  # within the noise margin
    ({}, None),
])
def test_crossover_is_where_int_mm_wins_from_there_on(timings, expected):
    assert crossover(timings) == expected


def test_measure_times_both_kernels_and_leaves_the_product_as_it_was():
    product = Int8Product(torch.randn(48, 32))
    timings = measure(product, rows_grid=(1, 4), repeats=1)
    assert sorted(timings) == [1, 4] and all(a > 0 and b > 0 for a, b in timings.values())
    assert product.int_mm_from_rows is None and product._codes_t is None


def _model():
    torch.set_num_threads(2)
    model = quantize_linears(build_tiny_model(vocab_size=40, seed=5, hidden_size=64, num_layers=2,
                                              max_position_embeddings=128))
    use_invariant_attention(model)
    return model


def test_choice_is_measured_once_per_cpu_and_shape_and_kept(tmp_path, monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    cache = tmp_path / "int8-kernels.json"
    calls = []

    def fake_measure(product):  # _int_mm wins from 64 rows for the widest shape only
        calls.append(product.shape)
        wide = product.shape[1] == max(p.shape[1] for p in switchable)
        return {16: (1.0, 2.0), 64: (4.0, 1.0 if wide else 5.0)}

    model = _model()
    head = model.get_output_embeddings().product
    switchable = [p for p in products(model) if p is not head]
    choice = choose_kernels(model, cache, measure_fn=fake_measure)
    assert len(calls) == len(choice) == len({p.shape for p in switchable})  # one per shape, no head
    assert head.int_mm_from_rows is None
    assert {p.int_mm_from_rows for p in switchable} == {None, 64}
    assert model.specdec_int8_wide_rows == 64  # a prefill runs in chunks at least this wide
    saved = json.loads(cache.read_text())
    assert saved[cpu_key()] == choice
    calls.clear()
    again = _model()
    assert choose_kernels(again, cache, measure_fn=fake_measure) == choice and calls == []


def test_forced_modes_and_a_bad_value(tmp_path, monkeypatch):
    model = _model()
    monkeypatch.setenv(KERNELS_ENV, "int_mm")
    choice = choose_kernels(model, tmp_path / "k.json")
    assert set(choice.values()) == {1} and not (tmp_path / "k.json").exists()
    monkeypatch.setenv(KERNELS_ENV, "fbgemm")
    assert set(choose_kernels(model, None).values()) == {None}
    assert model.specdec_int8_wide_rows is None
    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match=KERNELS_ENV):
        choose_kernels(model, None)


def test_a_model_gives_the_same_logits_whichever_kernel_each_pass_runs(monkeypatch):
    """Whole passes: fbgemm only against _int_mm for every pass of 3 rows and more."""
    context = [3, 17, 5, 29, 11, 8, 30, 2, 19, 7]
    logits = {}
    for mode in ("fbgemm", "mixed"):
        model = _model()
        for product in products(model):
            product.run_int_mm_from(3 if mode == "mixed" else None)
        kv = TreeKVCache(model)
        with torch.inference_mode():
            kv.prefill(context[:6])  # 6 rows: _int_mm in the mixed model
            rows = kv.extend(context[6:], [-1, 0, 1, 2])  # 4 rows
            kv.settle([0, 1, 2, 3])
            last = kv.extend_chain([1])  # 1 row: fbgemm in both
        logits[mode] = (rows, last)
    assert torch.equal(logits["fbgemm"][0], logits["mixed"][0])
    assert torch.equal(logits["fbgemm"][1], logits["mixed"][1])


def test_the_activation_levels_are_summed_exactly_on_this_cpu():
    """Codes in [-63, 63] shifted by 64 keep AVX2's u8 × s8 pair sums inside int16; on VNNI and AMX
    (no int16 step) 127 would be exact too, but every CPU keeps 63 so a model's numbers are the
    same on every host. The worst case (every product at its extreme, one sign) against exact int32."""
    torch.manual_seed(0)
    levels, inputs = ACTIVATION_LEVELS, 1536
    weight = torch.randint(-127, 128, (8, inputs), dtype=torch.int8)
    product = Int8Product(weight.float(), FBGEMM)  # per-channel scale: codes are weight·127/absmax
    codes_w = product.weight_codes().double()
    rows = torch.stack([torch.full((inputs,), float(levels)), torch.full((inputs,), float(-levels)),
                        torch.where(codes_w[0] > 0, float(levels), float(-levels))])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = product.gemm(rows, FBGEMM).double()
    exact = (rows.double() @ codes_w.t()) * product.weight_scale.double()
    assert torch.equal(out, exact.float().double())
