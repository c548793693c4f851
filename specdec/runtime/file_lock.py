"""An exclusive lock on a file, held across processes: two engines starting at once on one host
take turns at work only one of them should do (a model's conversion, a kernel measurement)."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing) for the block; the kernel drops it
    if the process dies, so a crash leaves nothing to clean up."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
