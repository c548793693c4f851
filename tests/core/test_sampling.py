"""Property tests for specdec.sampling: the warping every drafter and verifier must agree on.

Tie rules being checked (the intended behaviour, also in warp_logits' docstring):
- greedy: one-hot on the LOWEST token id among the maxima;
- top-k: every token whose scaled logit equals the k-th largest is kept (so more than k tokens
  survive only on ties at the k-th value) — order-independent, identical on every machine;
- top-p: the smallest prefix, in descending-probability order with equal probabilities ordered
  by token id, whose mass reaches top_p (the token that crosses the threshold is kept).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from specdec.sampling import MIN_TEMPERATURE, SamplingParams, SamplingParamsError, warp_logits

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.float64]


@st.composite
def logits_rows(draw, max_vocab: int = 24, low: float = -5.0, high: float = 5.0, tie_prone: bool = False):
    rows = draw(st.integers(1, 3))
    vocab = draw(st.integers(1, max_vocab))
    if tie_prone:  # few distinct values → many exact ties
        values = st.sampled_from([-1.0, 0.0, 0.5, 2.0])
    else:
        values = st.floats(low, high, allow_nan=False, allow_infinity=False)
    data = draw(st.lists(st.lists(values, min_size=vocab, max_size=vocab), min_size=rows, max_size=rows))
    return np.array(data, dtype=np.float64)


def params_strategy(vocab_hint: int = 24):
    return st.builds(
        SamplingParams,
        temperature=st.one_of(st.just(0.0), st.floats(0.25, 4.0)),
        top_k=st.integers(0, vocab_hint + 2),
        top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0, exclude_min=True)),
    )


def _base_probs(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = logits / temperature
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


# ---------------------------------------------------------------------------------------------
@SETTINGS
@given(logits=logits_rows(), params=params_strategy(), dtype=st.sampled_from(DTYPES))
def test_probabilities_are_a_distribution_in_the_input_dtype(logits, params, dtype):
    out = warp_logits(torch.tensor(logits, dtype=dtype), params)
    assert out.dtype == dtype and out.shape == logits.shape
    assert torch.all(out >= 0)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(out.sum(dim=-1), torch.ones(out.shape[0], dtype=dtype), atol=tol)
    # rows are warped independently
    for i in range(logits.shape[0]):
        assert torch.equal(warp_logits(torch.tensor(logits[i], dtype=dtype), params), out[i])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_logits_are_warped_in_float32(dtype):
    out = warp_logits(torch.tensor([0.0, 1.0, 2.0], dtype=dtype), SamplingParams(temperature=0.8))
    assert out.dtype == torch.float32
    assert float(out.sum()) == pytest.approx(1.0, abs=1e-6)


@SETTINGS
@given(logits=logits_rows(tie_prone=True), top_k=st.integers(0, 5), top_p=st.floats(0.1, 1.0),
       dtype=st.sampled_from(DTYPES))
def test_greedy_is_one_hot_on_the_lowest_index_argmax(logits, top_k, top_p, dtype):
    params = SamplingParams(temperature=0.0, top_k=top_k, top_p=top_p)
    out = warp_logits(torch.tensor(logits, dtype=dtype), params)
    for row, probs in zip(logits, out, strict=True):
        expected = int(np.flatnonzero(row == row.max())[0])
        assert probs[expected] == 1.0
        assert float(probs.sum()) == 1.0


@SETTINGS
@given(logits=logits_rows(tie_prone=True), data=st.data(), temperature=st.floats(0.25, 4.0),
       dtype=st.sampled_from(DTYPES))
def test_top_k_keeps_the_k_largest_and_only_ties_beyond(logits, data, temperature, dtype):
    vocab = logits.shape[1]
    k = data.draw(st.integers(1, vocab))
    out = warp_logits(torch.tensor(logits, dtype=dtype), SamplingParams(temperature=temperature, top_k=k))
    base = _base_probs(logits, temperature)
    for row, probs, ref in zip(logits, out.double().numpy(), base, strict=True):
        kth = np.sort(row)[::-1][k - 1]
        keep = row >= kth
        assert set(np.flatnonzero(probs > 0)) == set(np.flatnonzero(keep))
        assert keep.sum() == k or np.sum(row == kth) > 1  # more than k only on ties at the k-th value
        expected = np.where(keep, ref, 0.0) / np.where(keep, ref, 0.0).sum()
        np.testing.assert_allclose(probs, expected, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-7)


def test_top_k_tie_rule_examples():
    out = warp_logits(torch.tensor([1.0, 1.0, 1.0, 0.0]), SamplingParams(top_k=2))
    assert torch.allclose(out, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))
    out = warp_logits(torch.tensor([3.0, 1.0, 2.0]), SamplingParams(top_k=5))  # k >= V: no filter
    assert torch.all(out > 0)


@SETTINGS
@given(logits=logits_rows(), temperature=st.floats(0.25, 4.0), top_k=st.integers(0, 8),
       top_p=st.floats(0.02, 0.999), dtype=st.sampled_from(DTYPES))
def test_top_p_keeps_the_smallest_prefix_reaching_p(logits, temperature, top_k, top_p, dtype):
    rows = torch.tensor(logits, dtype=dtype)
    before = warp_logits(rows, SamplingParams(temperature=temperature, top_k=top_k))
    out = warp_logits(rows, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    for probs_before, probs in zip(before.double().numpy(), out.double().numpy(), strict=True):
        order = sorted(range(len(probs_before)), key=lambda i: (-probs_before[i], i))
        cum = np.cumsum(probs_before[order])
        # stay away from float round-off at the threshold itself
        assume(np.all(np.abs(cum - top_p) > 1e-5))
        size = int(np.argmax(cum >= top_p)) + 1 if cum[-1] >= top_p else len(order)
        kept = set(order[:size])
        assert set(np.flatnonzero(probs > 0)) == {i for i in kept if probs_before[i] > 0}
        if size > 1:
            assert cum[size - 2] < top_p <= cum[size - 1]  # smallest such prefix
        expected = np.zeros_like(probs_before)
        expected[list(kept)] = probs_before[list(kept)]
        np.testing.assert_allclose(probs, expected / expected.sum(), rtol=1e-5, atol=1e-7)


def test_top_p_examples_ties_and_order_of_filters():
    # equal probabilities: prefix in token-id order; 0.25 + 0.25 reaches 0.5 exactly
    out = warp_logits(torch.zeros(4, dtype=torch.float64), SamplingParams(top_p=0.5))
    assert out.tolist() == [0.5, 0.5, 0.0, 0.0]
    # temperature → top-k → top-p: probs (.4, .3, .2, .1); top-k 2 renormalises to (4/7, 3/7) and
    # 4/7 alone already reaches 0.5, whereas top-p on the unfiltered row would keep two tokens
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64))
    assert warp_logits(logits, SamplingParams(top_k=2, top_p=0.5)).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert torch.allclose(warp_logits(logits, SamplingParams(top_p=0.5)),
                          torch.tensor([4 / 7, 3 / 7, 0, 0], dtype=torch.float64))
    # a dominant token alone
    assert warp_logits(torch.tensor([10.0, 0.0, 0.0]), SamplingParams(top_p=0.9)).tolist() == [1.0, 0.0, 0.0]


@SETTINGS
@given(logits=logits_rows(), temperature=st.floats(0.05, 20.0))
def test_temperature_scales_logits(logits, temperature):
    out = warp_logits(torch.tensor(logits), SamplingParams(temperature=temperature))
    np.testing.assert_allclose(out.numpy(), _base_probs(logits, temperature), rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_smallest_temperature_is_not_nan(dtype):
    # regression: logits / T overflowed to inf and softmax returned NaN for valid T > 0
    logits = torch.tensor([100.0, 300.0, -5.0], dtype=dtype)
    out = warp_logits(logits, SamplingParams(temperature=MIN_TEMPERATURE))
    assert out.tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("temperature", [1e-46, 1e-40, 1e-310, MIN_TEMPERATURE / 2])
def test_temperature_below_the_bound_is_refused(temperature):
    # 1e-46 underflows float32 to 0: the rows became "not a distribution (sum nan)" (issue 14)
    with pytest.raises(SamplingParamsError, match=r"temperature must be 0 \(greedy\) or at least 0.0001"):
        SamplingParams(temperature=temperature)
    assert SamplingParams(temperature=0.0).greedy


def test_minus_infinity_logits_get_zero_probability():
    logits = torch.tensor([0.0, -math.inf, 1.0, -math.inf])
    for params in (SamplingParams(), SamplingParams(temperature=0.5, top_k=3, top_p=0.95)):
        out = warp_logits(logits, params)
        assert out[1] == 0 and out[3] == 0 and float(out.sum()) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
BAD_FIELDS = st.one_of(
    st.tuples(st.just("temperature"), st.one_of(
        st.floats(max_value=-1e-300), st.just(math.nan), st.just(math.inf), st.just(-math.inf),
        st.just("1.0"), st.none())),
    st.tuples(st.just("top_k"), st.one_of(st.integers(max_value=-1), st.floats(0.5, 5.5), st.just(True),
                                          st.just("3"))),
    st.tuples(st.just("top_p"), st.one_of(
        st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True), st.just(math.nan),
        st.just(math.inf), st.none())),
)


@SETTINGS
@given(bad=BAD_FIELDS)
def test_invalid_params_raise_naming_the_field(bad):
    field, value = bad
    assume(not (field == "top_k" and isinstance(value, float) and value.is_integer()))
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})


@SETTINGS
@given(params=params_strategy())
def test_valid_params_are_accepted_and_hashable(params):
    assert SamplingParams(params.temperature, params.top_k, params.top_p) == params
    assert hash(params) == hash(SamplingParams(params.temperature, params.top_k, params.top_p))
    assert params.greedy == (params.temperature == 0.0)
    assert issubclass(SamplingParamsError, ValueError)
