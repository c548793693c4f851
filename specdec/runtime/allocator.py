"""Keep freed memory in the process so a pass's large temporaries are not page-faulted anew.

glibc serves an allocation above its mmap threshold (128 KiB, rising to at most 32 MiB as large
blocks are freed) with a fresh mmap and unmaps it on free; a heap top above the trim threshold is
returned to the kernel. Every pass allocates the same large temporaries again (a prefill's MLP
product, the vocabulary row, the race), so each one pays page faults: on the 2-vCPU EPYC a fresh
[500, 17920] float32 tensor cost 12 ms to allocate and fill against 1.2 ms from the heap, a third
of a 500-token prefill's elementwise time. Raising both thresholds keeps those blocks for the next
pass (a resident size that stays at its peak, as jemalloc's or tcmalloc's would).

Opt out with SPECDEC_MALLOC_TUNING=0; a user's own GLIBC_TUNABLES or MALLOC_*_ settings win.

Loading is the exception: quantising a model frees gigabytes of float weights (copies and the
file's tensors) that no pass will ask for again, and with the thresholds raised they stay in the
heap. So a load ends with `release_freed_memory`: the default int8 target's process then holds
2.9 GB instead of 8.5 GB.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

from specdec.defaults import switched_off

log = logging.getLogger(__name__)

TUNING_ENV = "SPECDEC_MALLOC_TUNING"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the heap and go back to it
TRIM_THRESHOLD = (1 << 31) - 1  # free heap memory is returned to the kernel only above 2 GiB
_lock = threading.Lock()
_tuned: bool | None = None


def _user_tuned() -> bool:
    return bool(os.environ.get("GLIBC_TUNABLES")) or any(
        name.startswith("MALLOC_") and name.endswith("_") for name in os.environ)


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True where they are now raised."""
    global _tuned
    with _lock:
        if _tuned is not None:
            return _tuned
        _tuned = False
        if switched_off(TUNING_ENV) or _user_tuned():
            return False
        try:  # the process's own symbols: glibc's mallopt where libc is glibc (find_library forks ldconfig)
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to tune
            return False
        _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        if not _tuned:
            log.info("glibc refused the malloc thresholds; large temporaries are mapped per pass")
        return _tuned


def release_freed_memory() -> bool:
    """Return the heap's free memory to the kernel now (glibc's malloc_trim; after a load, whose
    freed float weights no pass reuses). True where it released something."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc: its allocator keeps its own policy
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
