"""The fixed-order float32 attention kernel (specdec.runtime.fixed_attention, attention_kernel.c).

It must compute attention (against float64 arithmetic, to float32's precision) and give a row
bitwise the same output whatever else its call holds: other rows and sessions, keys it does not
see at any buffer position (padding, side branches), a cache view of any capacity, any thread
count. The model-level checks (every pass shape of the int8 model) are in test_int8_invariance.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from specdec.runtime import c_kernels, fixed_attention
from specdec.runtime.fixed_attention import (
    ATTENTION_ENV,
    FIXED_ORDER,
    FLOAT64,
    KernelUnavailable,
    attention_choice,
    fixed_order_attention,
    load_kernel,
)

NEG = torch.finfo(torch.float32).min


def causal_mask(rows: int, length: int, batch: int = 1) -> torch.Tensor:
    """Additive float mask: row r sees keys 0 .. length - rows + r."""
    mask = torch.zeros(batch, 1, rows, length)
    for r in range(rows):
        mask[:, :, r, length - rows + r + 1:] = NEG
    return mask


def float64_reference(query, key, value, mask) -> torch.Tensor:
    group = query.shape[1] // key.shape[1]
    keys, values = (t.repeat_interleave(group, 1).double() for t in (key, value))
    scores = query.double() @ keys.transpose(-1, -2) * query.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + (mask.double() if mask.is_floating_point()
                           else torch.zeros_like(mask, dtype=torch.float64).masked_fill(~mask, -torch.inf))
    return (torch.softmax(scores, -1) @ values).transpose(1, 2)


def tensors(batch=1, heads=6, kv_heads=2, rows=5, length=40, dim=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, rows, dim, generator=generator),
            torch.randn(batch, kv_heads, length, dim, generator=generator),
            torch.randn(batch, kv_heads, length, dim, generator=generator))


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 32), (4, 4, 8), (2, 1, 24), (12, 2, 128)])
@pytest.mark.parametrize("mask_kind", ["float", "bool", "none"])
def test_it_computes_attention(heads, kv_heads, dim, mask_kind):
    query, key, value = tensors(batch=2, heads=heads, kv_heads=kv_heads, rows=7, length=33, dim=dim)
    mask = {"float": causal_mask(7, 33, batch=2), "bool": causal_mask(7, 33, batch=2) == 0,
            "none": None}[mask_kind]
    out = fixed_order_attention(query, key, value, mask)
    assert out.shape == (2, 7, heads, dim) and out.dtype == torch.float32
    expected = float64_reference(query, key, value, causal_mask(7, 33, batch=2))
    assert torch.allclose(out.double(), expected, atol=2e-6, rtol=0)


def test_a_broadcast_mask_an_additive_bias_and_a_row_that_sees_nothing():
    query, key, value = tensors(batch=3, rows=4, length=20)
    mask = causal_mask(4, 20)  # batch 1, broadcast over 3
    mask[0, 0, 1, :5] += 0.75  # a bias on seen keys is added to their scores
    mask[0, 0, 2, :] = NEG  # a padding row: sees nothing, gives zeros (its row is never read)
    out = fixed_order_attention(query, key, value, mask)
    expected = float64_reference(query, key, value, mask.masked_fill(mask < -1e30, -torch.inf))
    for row in (0, 1, 3):
        assert torch.allclose(out[:, row].double(), expected[:, row], atol=2e-6, rtol=0)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))


def test_a_row_is_bitwise_the_same_whatever_else_its_call_holds():
    """The row alone (one query, the keys it sees) against the same row: among other rows, with
    unseen keys inserted before, between and after its keys (a tree's side branches and left
    padding move its keys' buffer positions), beside other sessions, in a cache view of larger
    capacity, and on one thread or two."""
    torch.manual_seed(1)
    heads, kv_heads, dim, seen_keys = 12, 2, 128, 61
    query = torch.randn(1, heads, 1, dim)
    keys, values = torch.randn(1, kv_heads, seen_keys, dim), torch.randn(1, kv_heads, seen_keys, dim)
    alone = fixed_order_attention(query, keys, values, None)[0, 0]

    # 9 rows, ours is row 4; 23 unseen keys scattered among ours; 3 sessions, ours is the second
    rows, ours, batch, session = 9, 4, 3, 1
    length = seen_keys + 23
    positions = sorted(torch.randperm(length)[:seen_keys].tolist())
    big_query = torch.randn(batch, heads, rows, dim)
    big_query[session, :, ours] = query[0, :, 0]
    capacity = torch.randn(batch, kv_heads, length + 17, dim)  # a cache buffer, narrowed below
    big_values = torch.randn(batch, kv_heads, length + 17, dim)
    capacity[session, :, positions] = keys[0]
    big_values[session, :, positions] = values[0]
    mask = torch.where(torch.rand(batch, 1, rows, length) < 0.6, 0.0, NEG)
    mask[session, 0, ours] = NEG
    mask[session, 0, ours, positions] = 0.0
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = fixed_order_attention(big_query, capacity[:, :, :length], big_values[:, :, :length], mask)
        finally:
            torch.set_num_threads(previous)
        assert torch.equal(out[session, ours], alone)


def test_lanes_are_numbered_by_what_a_row_sees_not_by_buffer_position():
    """The negative control: unseen keys inserted among a row's keys do change float32 sums taken
    by buffer position (here torch's own float32 attention), so the check above can fail."""
    torch.manual_seed(2)
    changed = 0
    for _ in range(10):
        query, keys, values = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)
        padded_keys = torch.cat([torch.randn(1, 2, 7, 64), keys], 2)
        padded_values = torch.cat([torch.randn(1, 2, 7, 64), values], 2)
        mask = torch.zeros(1, 1, 1, 307)
        mask[..., :7] = NEG
        plain = torch.nn.functional.scaled_dot_product_attention(query, keys, values)
        padded = torch.nn.functional.scaled_dot_product_attention(query, padded_keys, padded_values,
                                                                  attn_mask=mask)
        changed += not torch.equal(plain, padded)
        ours = fixed_order_attention(query, keys, values, None)
        ours_padded = fixed_order_attention(query, padded_keys, padded_values, mask)
        assert torch.equal(ours, ours_padded)
    assert changed > 0


def test_the_choice_and_its_errors(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(ATTENTION_ENV, "float64")
    assert attention_choice() == FLOAT64
    monkeypatch.setenv(ATTENTION_ENV, "bogus")
    with pytest.raises(ValueError, match=ATTENTION_ENV):
        attention_choice()
    monkeypatch.setenv(ATTENTION_ENV, "fixed-order")
    assert attention_choice() == FIXED_ORDER

    # no compiler: `auto` keeps float64 and says so; `fixed-order` is an error that says why
    load_kernel.cache_clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    try:
        with pytest.raises(KernelUnavailable, match="no-such-cc"):
            attention_choice()
        monkeypatch.setenv(ATTENTION_ENV, "auto")
        with caplog.at_level(logging.WARNING, logger=fixed_attention.__name__):
            assert attention_choice() == FLOAT64
        assert "falls back to float64" in caplog.text
    finally:
        load_kernel.cache_clear()


def test_it_is_built_once_into_the_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    load_kernel.cache_clear()
    try:
        load_kernel()
        built = list((tmp_path / "kernels").glob("fixed-order-attention-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        load_kernel.cache_clear()
        load_kernel()  # a later start loads the file it finds
        assert built[0].stat().st_mtime_ns == stamp
    finally:
        load_kernel.cache_clear()


def test_a_call_it_cannot_compute_is_refused_not_answered_in_another_arithmetic():
    from specdec.runtime.int8 import _fixed_order_sdpa

    query, key, value = tensors()
    with pytest.raises(NotImplementedError, match="float64"):
        _fixed_order_sdpa(None, query, key.double(), value.double(), None)
    with pytest.raises(NotImplementedError, match="softcap"):
        _fixed_order_sdpa(None, query, key, value, None, softcap=30.0)


def _compiler_script(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_a_compiler_without_openmp_builds_a_one_thread_kernel(monkeypatch, tmp_path, caplog):
    real = c_kernels.compiler()
    monkeypatch.setenv("CC", _compiler_script(
        tmp_path / "cc-no-openmp",
        f'case "$*" in *-fopenmp*) echo "no OpenMP here" >&2; exit 1;; esac\nexec {real} "$@"\n'))
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    load_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=c_kernels.__name__):
            load_kernel()
        assert "without OpenMP" in caplog.text and "no OpenMP here" in caplog.text
        query, key, value = tensors(rows=4)
        out = fixed_order_attention(query, key, value, causal_mask(4, 40))
        assert torch.allclose(out.double(), float64_reference(query, key, value, causal_mask(4, 40)),
                              atol=2e-6, rtol=0)
    finally:
        load_kernel.cache_clear()


def test_a_compiler_that_fails_says_what_it_said(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", _compiler_script(tmp_path / "cc-broken", 'echo "broken compiler" >&2\nexit 1\n'))
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    load_kernel.cache_clear()
    try:
        with pytest.raises(KernelUnavailable, match="broken compiler"):
            load_kernel()
    finally:
        load_kernel.cache_clear()


@pytest.mark.parametrize("dim", [64, 128, 40])
def test_heads_computed_together_equal_each_head_alone(dim):
    """Scores of four heads share their lane sums and values of two heads share their reads:
    each head's numbers are still the ones it gets alone (the same sums in the same order)."""
    query, key, value = tensors(heads=7, kv_heads=1, rows=3, length=50, dim=dim, seed=4)
    together = fixed_order_attention(query, key, value, causal_mask(3, 50))
    for head in range(7):
        alone = fixed_order_attention(query[:, head:head + 1], key, value, causal_mask(3, 50))
        assert torch.equal(together[:, :, head], alone[:, :, 0])

