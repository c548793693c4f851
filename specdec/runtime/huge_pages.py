"""Weights a pass streams, kept in memory advised for transparent huge pages.

A decode pass of the default target reads 1.5 GB of int8 weights, one layer after another; in 4 KiB
pages that is ~375,000 pages a pass, each a TLB miss and a page walk. Advised with MADV_HUGEPAGE,
Linux backs the buffer's 2 MiB-aligned ranges with huge pages (where transparent huge pages are
`always` or `madvise`, the common defaults): on the Zen 4 EPYC, 28 layers' MLP weights streamed by
the VNNI kernel took 20.7 against 23.9 ms at one row, 21.6 against 25.2 at four and 32.8 against
35.1 at ten (bench/results/zen4-2026-12-06f/huge_pages.py). The buffer is an anonymous mapping of
the tensor's own size (no rounding up: only its aligned interior gets huge pages), so no memory is
added. Elsewhere (no madvise, another OS, SPECDEC_HUGE_PAGES=0) the tensor stays as it is.
"""

from __future__ import annotations

import logging
import mmap

import torch

from specdec.defaults import switched_off

log = logging.getLogger(__name__)

ENV = "SPECDEC_HUGE_PAGES"
HUGE_PAGE_BYTES = 2 << 20  # x86-64's transparent huge page; smaller tensors gain nothing


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU `tensor` in an anonymous mapping advised for huge pages (the copy
    keeps the mapping alive), else `tensor` itself."""
    size = tensor.numel() * tensor.element_size()
    if (size < HUGE_PAGE_BYTES or tensor.device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE")
            or switched_off(ENV)):
        return tensor
    try:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as error:  # no transparent huge pages here: the pages stay small
        log.debug("no huge pages for a %d-byte weight: %s", size, error)
        return tensor
    copy = torch.frombuffer(region, dtype=torch.uint8, count=size).view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    return copy
