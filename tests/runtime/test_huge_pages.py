"""Weights copied into a mapping advised for huge pages: the same values and shape, still an ordinary
tensor the kernels read; small tensors, and SPECDEC_HUGE_PAGES=0, keep the tensor as it is."""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.huge_pages import ENV, HUGE_PAGE_BYTES, on_huge_pages
from specdec.runtime.int8 import VNNI, Int8Product, vnni_available


def test_a_large_weight_is_copied_whole_and_outlives_the_original():
    original = torch.randint(0, 256, (3, HUGE_PAGE_BYTES // 2 + 7), dtype=torch.uint8)
    expected = original.clone()
    copy = on_huge_pages(original)
    assert copy.data_ptr() != original.data_ptr() and copy.is_contiguous()
    del original
    assert torch.equal(copy, expected) and copy.dtype == torch.uint8
    floats = torch.randn(HUGE_PAGE_BYTES // 4 + 3)
    assert torch.equal(on_huge_pages(floats), floats)


def test_small_tensors_and_the_switch_keep_the_tensor(monkeypatch):
    small = torch.zeros(100, dtype=torch.uint8)
    assert on_huge_pages(small) is small
    monkeypatch.setenv(ENV, "0")
    large = torch.zeros(HUGE_PAGE_BYTES, dtype=torch.uint8)
    assert on_huge_pages(large) is large


@pytest.mark.skipif(not vnni_available(), reason="specdec's VNNI kernel needs AVX-512 VNNI and a C compiler")
def test_the_vnni_kernel_reads_a_weight_on_huge_pages():
    torch.manual_seed(0)
    weight = torch.randn(1536, 1400)  # 2.2 MB packed: over one huge page
    product, reference = Int8Product(weight), Int8Product(weight)
    product.run_wide_from(1, VNNI)
    x = torch.randn(5, 1400)
    assert torch.equal(product(x)[0], reference(x)[0])
