"""The int8 GEMM chosen per call by rows, shape and CPU: rows stay bitwise the same across the switch
to either wide kernel, the choice follows the measurement, and it is kept per CPU key in the specdec
home."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from specdec.runtime.int8 import (
    ACTIVATION_LEVELS,
    FBGEMM,
    INT_MM,
    ONEDNN,
    VNNI,
    Int8Product,
    RowwiseInt8Linear,
    fbgemm_available,
    onednn_available,
    quantize_linears,
    quantize_rows,
    use_invariant_attention,
    vnni_available,
)
from specdec.runtime.int8_kernels import (
    KERNELS_ENV,
    MAX_SWEEP_BYTES,
    SWEEP_BYTES,
    best_wide,
    choose_kernels,
    cpu_key,
    crossover,
    measure,
    products,
    sweep_bytes,
    wide_kernels,
)
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="this torch build has no fbgemm")
NO_VNNI = "specdec's VNNI kernel needs AVX-512 VNNI and a C compiler"
WIDE = [INT_MM, pytest.param(ONEDNN, marks=pytest.mark.skipif(
    not onednn_available(), reason="this torch build has no oneDNN quantised linear")),
    pytest.param(VNNI, marks=pytest.mark.skipif(not vnni_available(), reason=NO_VNNI))]


@pytest.mark.parametrize("kernel", WIDE)
def test_rows_are_bitwise_the_same_on_either_side_of_the_switch(kernel):
    torch.manual_seed(2)
    linear = torch.nn.Linear(160, 72)
    layer = RowwiseInt8Linear.from_linear(linear)
    layer.product.run_wide_from(4, kernel)  # 1–3 rows: fbgemm; 4 and more: the wide kernel
    x = torch.randn(11, 160) * torch.rand(11, 1) * 4
    wide = layer(x)
    assert layer.product.kernel_for(11) == kernel and layer.product.kernel_for(3) == FBGEMM
    for i in range(11):
        assert torch.equal(layer(x[i:i + 1]), wide[i:i + 1])  # one row: the other kernel
    assert torch.equal(layer(x[2:5]), wide[2:5])
    layer.product.run_wide_from(None)
    assert layer.product._codes_t is layer.product._onednn is layer.product._vnni is None  # the copy goes too
    assert torch.equal(layer(x), wide)


@pytest.mark.parametrize("kernel", WIDE)
def test_every_kernel_rounds_sums_beyond_float32s_integers_alike(kernel):
    """Sums past 2^24 (a float32 holds them only to a few units) come out of each kernel as the
    same float: every code at its extreme, one sign, over the default target's widest input."""
    torch.manual_seed(0)
    inputs = 8960
    weight = torch.randn(6, inputs).sign()  # every weight code ±127
    product = Int8Product(weight, FBGEMM)
    rows = torch.stack([weight[0] * ACTIVATION_LEVELS, -weight[1] * ACTIVATION_LEVELS,
                        torch.randint(-ACTIVATION_LEVELS, ACTIVATION_LEVELS + 1, (inputs,)).float()])
    exact = rows.double() @ product.weight_codes().double().t()
    assert exact.abs().max() > 2 ** 24  # the case this test is for
    product.run_wide_from(1, kernel)
    assert torch.equal(product.gemm(rows, kernel), product.gemm(rows, FBGEMM))


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN quantised linear")
def test_onednn_takes_the_codes_in_a_form_it_sums_exactly_on_this_cpu():
    """Unsigned codes (+ 64) are exact everywhere; signed ones saturate without VNNI (an AVX2 EPYC),
    and the form the probe picks must be exact over the default target's widest input."""
    from specdec.runtime.int8 import _onednn_linear, onednn_input_zero_point

    torch.manual_seed(1)
    inputs, outputs = 8960, 24
    weight = (torch.randn(outputs, inputs).sign() * 127).to(torch.int8)
    codes = torch.randint(-ACTIVATION_LEVELS, ACTIVATION_LEVELS + 1, (5, inputs)).float()
    codes[0], codes[1] = ACTIVATION_LEVELS, weight[0].float().sign() * ACTIVATION_LEVELS
    exact = (codes.double() @ weight.double().t()).float()  # float(int32 sum), the kernels' epilogue
    packed = torch.ops.onednn.qlinear_prepack(weight, [1, inputs])
    ones, zeros = torch.ones(outputs), torch.zeros(outputs, dtype=torch.long)
    assert torch.equal(_onednn_linear(codes, 64, packed, ones, zeros), exact)
    signed_exact = torch.equal(_onednn_linear(codes, 0, packed, ones, zeros), exact)
    assert onednn_input_zero_point() == (0 if signed_exact else 64)


def test_switching_between_wide_kernels_keeps_one_copy():
    product = Int8Product(torch.randn(40, 24))
    product.run_wide_from(8, INT_MM)
    assert product._codes_t is not None and product.wide_kernel == INT_MM
    if onednn_available():
        product.run_wide_from(8, ONEDNN)
        assert product._codes_t is None and product._onednn is not None
    if vnni_available():
        product.run_wide_from(8, VNNI)
        assert product._codes_t is product._onednn is None and product._vnni is not None
        product.run_wide_from(8, INT_MM)
        assert product._vnni is None and product._codes_t is not None
    with pytest.raises(ValueError, match="wide kernel"):
        product.run_wide_from(8, FBGEMM)


@pytest.mark.skipif(not vnni_available(), reason=NO_VNNI)
@pytest.mark.parametrize(("inputs", "outputs"), [(160, 72), (150, 70), (8, 64), (1536, 130)])
def test_the_vnni_kernel_gives_fbgemms_rows_at_every_count_and_ragged_shapes(inputs, outputs):
    """int8_gemm_kernel.c blocks rows by 12 and outputs by 32 and pads inputs to a multiple of 4:
    every count of rows (whole blocks, a partial one, several), inputs and outputs off those
    multiples, and both thread counts give fbgemm's numbers bitwise."""
    torch.manual_seed(inputs + outputs)
    weight = torch.randn(outputs, inputs) * torch.rand(outputs, 1)
    product, reference = Int8Product(weight), Int8Product(weight)
    product.run_wide_from(1, VNNI)
    for rows in (1, 2, 5, 6, 7, 11, 12, 13, 24, 25, 31):
        codes, _ = quantize_rows(torch.randn(rows, inputs) * torch.rand(rows, 1) * 3)
        expected = reference.gemm(codes, FBGEMM)
        for threads in (1, 2):
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                assert torch.equal(product.gemm(codes, VNNI), expected), (rows, threads)
            finally:
                torch.set_num_threads(previous)


@pytest.mark.skipif(not vnni_available(), reason=NO_VNNI)
@pytest.mark.parametrize(("inputs", "outputs"), [(160, 72), (17, 33), (1536, 130), (3, 5)])
def test_the_vnni_call_quantises_its_rows_as_quantize_rows_does(inputs, outputs):
    """A VNNI call quantises the float rows inside the kernel: the product and the row scales are
    bitwise quantize_rows' codes through the kernel, for rows of any magnitude, an all-zero row,
    rows whose quotients land on ties (integers, halves), inputs off a multiple of 16, and a call
    through the layer gives fbgemm's rows."""
    from specdec.runtime.int8 import _vnni_quantize_gemm

    torch.manual_seed(inputs)
    weight = torch.randn(outputs, inputs)
    product, reference = Int8Product(weight), Int8Product(weight)
    product.run_wide_from(1, VNNI)
    for rows in (1, 5, 12, 13, 31):
        magnitudes = 10.0 ** torch.randint(-20, 20, (rows, 1)).float()
        for x in (torch.randn(rows, inputs) * magnitudes, (torch.randn(rows, inputs) * 40).round() / 2):
            x[0] = 0.0
            codes, row_scale = quantize_rows(x)
            product_rows, scales = _vnni_quantize_gemm(x, *product._vnni, outputs)
            assert torch.equal(scales, row_scale) and torch.equal(product_rows, product.gemm(codes, VNNI))
            assert torch.equal(product(x)[0], reference.gemm(codes, FBGEMM)), rows


@pytest.mark.skipif(not vnni_available(), reason=NO_VNNI)
def test_a_vnni_call_with_other_codes_than_quantize_rows_fails_the_comparison():
    """The negative check of the test above: codes rounded half away from zero (not to even) give
    other products on tie rows, and the comparison sees it."""
    from specdec.runtime.int8 import _vnni_quantize_gemm

    torch.manual_seed(5)
    product = Int8Product(torch.randn(40, 64))
    product.run_wide_from(1, VNNI)
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1:] = 63.0, torch.arange(63).float() % 8 + 0.5  # scale 1: every other code a tie
    away = torch.sign(x) * torch.floor(x.abs() + 0.5)
    assert not torch.equal(product.gemm(away, VNNI), _vnni_quantize_gemm(x, *product._vnni, 40)[0])


@pytest.mark.parametrize("kernel", [INT_MM, pytest.param(VNNI, marks=pytest.mark.skipif(
    not vnni_available(), reason=NO_VNNI))])
def test_from_one_row_fbgemms_copy_goes_and_comes_back_from_the_wide_layout(kernel):
    """No call reaches fbgemm when the wide kernel runs from one row: its copy of the weight goes
    (one int8 copy held, not two) and a later switch gets it back, the same codes."""
    torch.manual_seed(3)
    weight = torch.randn(70, 150)
    product, reference = Int8Product(weight), Int8Product(weight)
    codes = reference.weight_codes()
    rows, _ = quantize_rows(torch.randn(5, 150))
    product.run_wide_from(1, kernel)
    assert product._packed is None and torch.equal(product.weight_codes(), codes)
    assert product.kernel_for(0) == product.kernel_for(1) == kernel  # no call rebuilds fbgemm's copy
    assert torch.equal(product.gemm(rows, kernel), reference.gemm(rows, FBGEMM))
    product.run_wide_from(4, kernel)  # fbgemm runs 1-3 rows again
    assert product._packed is not None
    assert torch.equal(product.gemm(rows[:2], FBGEMM), reference.gemm(rows[:2], FBGEMM))
    product.run_wide_from(1, kernel)
    product.run_wide_from(None)
    assert product._codes_t is product._vnni is None and torch.equal(product.weight_codes(), codes)
    assert torch.equal(product.gemm(rows, FBGEMM), reference.gemm(rows, FBGEMM))
    if onednn_available():  # oneDNN's packed weight gives no codes back: fbgemm's copy stays
        product.run_wide_from(1, ONEDNN)
        assert product._packed is not None


def test_the_vnni_kernel_is_refused_where_it_does_not_run(monkeypatch, tmp_path):
    from specdec.runtime import int8, int8_kernels

    monkeypatch.setattr(int8, "vnni_available", lambda: False)
    monkeypatch.setattr(int8_kernels, "vnni_available", lambda: False)
    assert VNNI not in wide_kernels()
    with pytest.raises(ValueError, match="VNNI"):
        Int8Product(torch.randn(8, 8)).run_wide_from(4, VNNI)
    monkeypatch.setenv(KERNELS_ENV, "vnni")
    with pytest.raises(ValueError, match="AVX-512 VNNI"):
        choose_kernels(_model(), tmp_path / "k.json")


def test_weight_codes_round_trip_through_fbgemm_packing():
    weight = torch.randn(40, 24)
    fbgemm, int_mm = Int8Product(weight, FBGEMM), Int8Product(weight, INT_MM)
    assert torch.equal(fbgemm.weight_codes(), int_mm.weight_codes())
    assert fbgemm.shape == (24, 40)


def _timings(*rows_fbgemm_int_mm):
    return {rows: {FBGEMM: a, INT_MM: b} for rows, a, b in rows_fbgemm_int_mm}


@pytest.mark.parametrize(("timings", "expected"), [
    (_timings((16, 1.0, 2.0), (64, 4.0, 5.0), (256, 16.0, 6.0)), 256),   # the AMX Xeon's shape
    (_timings((16, 1.0, 0.5), (64, 4.0, 2.0), (256, 16.0, 6.0)), 16),
    (_timings((16, 1.0, 2.0), (64, 4.0, 3.0), (256, 16.0, 17.0)), None),  # wins in the middle only
    (_timings((16, 1.0, 0.95), (64, 4.0, 3.9), (256, 16.0, 15.0)), None),  # within the noise margin
    (_timings((16, 1.0, 0.6), (64, 4.0, 3.9), (256, 16.0, 16.4)), 16),  # wins narrow, level wide (VNNI)
    (_timings((16, 1.0, 0.6), (64, 4.0, 3.9), (256, 16.0, 17.0)), None),  # loses at the widest count
    (_timings((1, 1.0, 1.03), (4, 1.0, 0.99), (16, 1.0, 0.6)), 1),  # level below a win: one kernel
    (_timings((1, 1.0, 1.08), (4, 1.0, 0.99), (16, 1.0, 0.6)), 4),  # slower at one row: fbgemm there
    (_timings((1, 1.0, 0.97), (4, 1.0, 0.99)), None),  # level everywhere, no win: no switch
    ({}, None),
])
def test_crossover_is_where_the_wide_kernel_wins_from_there_on(timings, expected):
    assert crossover(timings, INT_MM) == expected


def test_the_wide_kernel_is_the_one_that_makes_the_measured_calls_cheapest():
    # the AMX Xeon's gate-and-up product at 2 threads (ms): oneDNN's qlinear from 9 rows on
    xeon = {1: {FBGEMM: 0.58, INT_MM: 2.6, ONEDNN: 0.65}, 9: {FBGEMM: 0.84, INT_MM: 2.7, ONEDNN: 0.65},
            128: {FBGEMM: 8.2, INT_MM: 8.8, ONEDNN: 2.1}, 256: {FBGEMM: 15.6, INT_MM: 13.3, ONEDNN: 4.6}}
    assert best_wide(xeon) == (ONEDNN, 9)
    # the fastest at the widest count loses to fbgemm below it, the other wins from 16 rows on
    later = {16: {FBGEMM: 1.0, INT_MM: 0.5, ONEDNN: 0.3}, 64: {FBGEMM: 4.0, INT_MM: 2.0, ONEDNN: 5.0},
             256: {FBGEMM: 16.0, INT_MM: 6.0, ONEDNN: 5.0}}
    assert best_wide(later) == (INT_MM, 16)
    assert best_wide({16: {FBGEMM: 1.0, INT_MM: 2.0}}) is None and best_wide({}) is None


def test_measure_times_every_kernel_and_leaves_the_product_as_it_was():
    product = Int8Product(torch.randn(48, 32))
    timings = measure(product, rows_grid=(1, 4), repeats=1, exhaustive=True)
    assert sorted(timings) == [1, 4]
    assert all(set(by_kernel) == {FBGEMM, *wide_kernels()} and min(by_kernel.values()) > 0
               for by_kernel in timings.values())
    assert product.wide_from_rows is None and product._codes_t is None and product._onednn is None
    product.run_wide_from(2, INT_MM)
    measure(product, rows_grid=(1,), repeats=1)
    assert (product.wide_kernel, product.wide_from_rows) == (INT_MM, 2) and product._codes_t is not None


def test_measure_takes_a_pool_of_the_shapes_products_in_turn_and_leaves_each_as_it_was(monkeypatch):
    """Calls read their weights as a pass does, one product after another (a pool big enough to
    outgrow the caches); the pool's products end with the kernels they had, the others untouched."""
    from specdec.runtime import int8_kernels

    group = [Int8Product(torch.randn(48, 32)) for _ in range(4)]
    group[1].run_wide_from(1, INT_MM)  # fbgemm's copy let go: measuring needs it back
    group[3].run_wide_from(2, INT_MM)
    monkeypatch.setattr(int8_kernels, "sweep_bytes", lambda: 2 * 48 * 32)  # a pool of two
    used = []

    def seconds(product, codes, kernel):
        used.append((group.index(product), kernel, product.wide_kernel))
        return 1e-3
    monkeypatch.setattr(int8_kernels, "_seconds", seconds)
    measure(group, rows_grid=(1, 4), repeats=2, kernels=[INT_MM], exhaustive=True)
    order = [index for index, _, _ in used]
    assert set(order) == {0, 1}  # the pool: the first two
    assert all(a != b for a, b in zip(order, order[1:], strict=False))  # never one weight twice running
    assert all(wide == INT_MM for _, kernel, wide in used if kernel == INT_MM)  # its weight held
    assert [(p.wide_kernel, p.wide_from_rows) for p in group] == [
        (None, None), (INT_MM, 1), (None, None), (INT_MM, 2)]
    assert group[0]._codes_t is None and group[1]._packed is None  # as each was


@pytest.mark.parametrize(("sizes", "expected"), [
    ({"index0": "48K", "index2": "1024K", "index3": "32768K"}, 64 << 20),  # the Zen 4's L3, twice
    ({"index3": "2G"}, MAX_SWEEP_BYTES),
    ({}, SWEEP_BYTES),
    ({"index0": "unreadable"}, SWEEP_BYTES),
])
def test_a_sweep_reads_twice_the_largest_cache(tmp_path, sizes, expected):
    for index, size in sizes.items():
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert sweep_bytes(tmp_path) == expected


class _Clock:
    """Stands in for int8_kernels._seconds: each (rows, kernel) call "takes" a set time, the first
    call of a wide kernel at a count `first_extra` more (oneDNN's primitive), and every call is kept."""

    def __init__(self, table, first_extra=0.0):
        self.table, self.first_extra, self.calls = table, first_extra, []

    def __call__(self, product, codes, kernel):
        rows = codes.shape[0]
        first = kernel != FBGEMM and (rows, kernel) not in self.calls
        self.calls.append((rows, kernel))
        return self.table[rows][kernel] + (self.first_extra if first else 0.0)


def test_a_wide_kernel_is_compared_with_the_fbgemm_calls_beside_it(monkeypatch):
    """fbgemm's first round ran at a quiet moment (20 % faster than all later calls); the wide
    kernel is level with fbgemm's calls alternated with it at 1 and 4 rows and wins at 16. Against
    the quiet round it would lose at 4 rows and run from 16 only; compared with the calls beside
    it, it runs from one row."""
    from specdec.runtime import int8_kernels

    kernel = INT_MM
    later = {1: 1.0, 4: 1.2, 16: 2.0}

    def clock(product, codes, which):
        rows = codes.shape[0]
        if which == FBGEMM:
            return 1e-4 * later[rows] * (0.8 if quiet[0] else 1.0)
        quiet[0] = False  # the wide kernel's first call: the quiet moment is over
        return 1e-4 * later[rows] * (0.6 if rows == 16 else 0.98)

    quiet = [True]
    monkeypatch.setattr(int8_kernels, "_seconds", clock)
    timings = measure(Int8Product(torch.randn(48, 32)), rows_grid=(1, 4, 16), repeats=2, kernels=[kernel])
    ratios = [round(timings[rows][kernel] / timings[rows][FBGEMM], 2) for rows in (1, 4, 16)]
    assert ratios == [0.98, 0.98, 0.6]
    assert crossover(timings, kernel) == 1


def test_measure_stops_a_wide_kernel_where_it_loses_and_a_fallback_loop_after_one_call(monkeypatch):
    from specdec.runtime import int8_kernels

    # _int_mm: a fallback loop (AVX2); the other wins at 256 and 64 rows, loses at 16
    fast = ONEDNN if onednn_available() else INT_MM
    slow = INT_MM if fast == ONEDNN else None
    table = {rows: {FBGEMM: rows * 1e-4, fast: (0.5 if rows >= 64 else 1.5) * rows * 1e-4,
                    INT_MM if slow else "none": rows * 1e-2} for rows in (1, 4, 16, 64, 256)}
    clock = _Clock(table, first_extra=1e-3)
    monkeypatch.setattr(int8_kernels, "_seconds", clock)
    product = Int8Product(torch.randn(48, 32))
    kernels = [fast] + ([slow] if slow else [])
    timings = measure(product, rows_grid=(1, 4, 16, 64, 256), repeats=3, kernels=kernels)
    assert [rows for rows in (256, 64, 16, 4, 1) if fast in timings[rows]] == [256, 64, 16]
    assert timings[64][fast] == table[64][fast]  # the fastest call, the slow first one not counted
    assert crossover(timings, fast) == 64 and best_wide(timings) == (fast, 64)
    # stopped at the loss, timed twice over (the first call, then two rounds of 3) before it counted
    assert clock.calls.count((16, fast)) == 7 and (4, fast) not in clock.calls
    if slow:
        assert clock.calls.count((256, slow)) == 1 and [r for r in timings if slow in timings[r]] == [256]
    # fbgemm's calls alternate with the wide kernel's at the same count
    at_64 = [kernel for rows, kernel in clock.calls if rows == 64]
    assert at_64[-6:] == [FBGEMM, fast] * 3
    clock.calls.clear()
    everything = measure(product, rows_grid=(1, 4, 16, 64, 256), repeats=1, kernels=kernels, exhaustive=True)
    assert all(set(by_kernel) == {FBGEMM, *kernels} for by_kernel in everything.values())
    assert product.wide_from_rows is None


def test_engines_starting_together_take_turns_the_second_reading_the_first_ones_choice(tmp_path, monkeypatch):
    import threading

    monkeypatch.delenv(KERNELS_ENV, raising=False)
    cache = tmp_path / "int8-kernels.json"
    measuring, release, calls = threading.Event(), threading.Event(), []

    def slow_measure(group, kernels):
        calls.append(group[0].shape)
        measuring.set()
        assert release.wait(30)
        return _timings((16, 1.0, 2.0))

    first_model, second_model = _model(), _model()
    results = {}
    first = threading.Thread(target=lambda: results.setdefault(
        "first", choose_kernels(first_model, cache, measure_fn=slow_measure)))
    first.start()
    assert measuring.wait(30)
    second = threading.Thread(target=lambda: results.setdefault(
        "second", choose_kernels(second_model, cache, measure_fn=slow_measure)))
    second.start()
    second.join(0.5)
    assert second.is_alive() and "second" not in results  # waiting on the lock, not measuring
    shapes = len(calls)
    release.set()
    first.join(30)
    second.join(30)
    assert not first.is_alive() and not second.is_alive()
    assert results["first"] == results["second"]
    assert len(calls) == len({p.shape for p in products(first_model)}) >= shapes  # the first one's only


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

    # _int_mm wins from 64 rows for the widest layer only; the head from 1
    def fake_measure(group, kernels):
        product = group[0]
        assert {id(p) for p in group} == {id(p) for p in products(model) if p.shape == product.shape}
        calls.append(product.shape)
        if product is head:
            return _timings((1, 2.0, 1.0), (64, 8.0, 4.0))
        wide = product.shape[1] == max(p.shape[1] for p in layers)
        return _timings((16, 1.0, 2.0), (64, 4.0, 1.0 if wide else 5.0))

    model = _model()
    head = model.get_output_embeddings().product
    layers = [p for p in products(model) if p is not head]
    choice = choose_kernels(model, cache, measure_fn=fake_measure)
    assert len(calls) == len(choice) == len({p.shape for p in products(model)})  # one per shape
    assert (head.wide_kernel, head.wide_from_rows) == (INT_MM, 1)
    assert {p.wide_from_rows for p in layers} == {None, 64}
    assert model.specdec_int8_wide_rows == 64  # a prefill runs in chunks this wide; the head not counted
    assert model.specdec_int8_wide_kernel is None  # the layers do not agree (some stay on fbgemm)
    saved = json.loads(cache.read_text())
    assert saved[cpu_key()] == {shape: (None if c is None else list(c)) for shape, c in choice.items()}
    calls.clear()
    again = _model()
    assert choose_kernels(again, cache, measure_fn=fake_measure) == choice and calls == []


def test_a_start_that_finds_every_choice_saved_does_not_wait_on_a_measuring_engine(tmp_path, monkeypatch):
    import threading

    from specdec.runtime.file_lock import file_lock

    monkeypatch.delenv(KERNELS_ENV, raising=False)
    cache = tmp_path / "int8-kernels.json"
    choice = choose_kernels(_model(), cache, measure_fn=lambda group, kernels: _timings((16, 1.0, 2.0)))
    results = {}
    with file_lock(cache.with_name(f".{cache.name}.lock")):  # another engine measuring its shapes
        start = threading.Thread(target=lambda: results.setdefault("choice", choose_kernels(
            _model(), cache, measure_fn=lambda group, kernels: pytest.fail("measured again"))))
        start.start()
        start.join(30)
        assert not start.is_alive() and results["choice"] == choice


def test_a_fallback_loop_found_on_the_smallest_shape_is_not_timed_on_the_others(tmp_path, monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    asked = []

    def fake_measure(group, kernels):  # _int_mm 50 times fbgemm's time (AVX2's fallback loop)
        asked.append((group[0].shape[0] * group[0].shape[1], list(kernels)))
        return {64: {FBGEMM: 1.0, **{kernel: 50.0 if kernel == INT_MM else 2.0 for kernel in kernels}}}

    model = _model()
    choose_kernels(model, tmp_path / "k.json", measure_fn=fake_measure)
    sizes = [size for size, _ in asked]
    assert sizes == sorted(sizes) and len(asked) > 1  # smallest first
    assert INT_MM in asked[0][1] and all(INT_MM not in kernels for _, kernels in asked[1:])
    assert all(ONEDNN in kernels for _, kernels in asked) == (ONEDNN in wide_kernels())


def test_forced_modes_and_a_bad_value(tmp_path, monkeypatch):
    model = _model()
    monkeypatch.setenv(KERNELS_ENV, "int_mm")
    choice = choose_kernels(model, tmp_path / "k.json")
    assert set(choice.values()) == {(INT_MM, 1)} and not (tmp_path / "k.json").exists()
    assert model.specdec_int8_wide_kernel == INT_MM
    if onednn_available():
        monkeypatch.setenv(KERNELS_ENV, "onednn")
        assert set(choose_kernels(model, None).values()) == {(ONEDNN, 1)}
    if vnni_available():
        monkeypatch.setenv(KERNELS_ENV, "vnni")
        assert set(choose_kernels(model, None).values()) == {(VNNI, 1)}
    monkeypatch.setenv(KERNELS_ENV, "fbgemm")
    assert set(choose_kernels(model, None).values()) == {None}
    assert model.specdec_int8_wide_rows is None
    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match=KERNELS_ENV):
        choose_kernels(model, None)


def test_a_model_gives_the_same_logits_whichever_kernel_each_pass_runs(monkeypatch):
    """Whole passes: fbgemm only against a wide kernel for every pass of 3 rows and more."""
    context = [3, 17, 5, 29, 11, 8, 30, 2, 19, 7]
    logits = {}
    modes = ("fbgemm", *wide_kernels())
    for mode in modes:
        model = _model()
        for product in products(model):
            product.run_wide_from(None if mode == FBGEMM else 3, mode)
        kv = TreeKVCache(model)
        with torch.inference_mode():
            kv.prefill(context[:6])  # 6 rows: _int_mm in the mixed model
            rows = kv.extend(context[6:], [-1, 0, 1, 2])  # 4 rows
            kv.settle([0, 1, 2, 3])
            last = kv.extend_chain([1])  # 1 row: fbgemm in both
        logits[mode] = (rows, last)
    for mode in modes[1:]:
        assert torch.equal(logits["fbgemm"][0], logits[mode][0]), mode
        assert torch.equal(logits["fbgemm"][1], logits[mode][1]), mode


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
