"""The built-in defaults a fresh install runs with, and where specdec keeps its files.

Light on purpose (no torch, grpc or transformers): the CLI reads it for `--help`, the
transport for its message limit, the model registry and the benchmark for the default pair.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DRAFT_MODEL = "qwen2.5-coder-0.5b"  # names in specdec.models.REGISTRY
DEFAULT_TARGET_MODEL = "qwen2.5-coder-1.5b"
DEFAULT_MAX_MESSAGE_MB = 64.0  # gRPC send/receive limit of every channel and server


def specdec_home(home: Path | str | None = None) -> Path:
    """Root of everything specdec keeps on disk (models, converted caches, wheels, datasets,
    calibration): `home` if given, else $SPECDEC_HOME, else ~/.cache/specdec."""
    if home is None:
        home = os.environ.get("SPECDEC_HOME") or Path.home() / ".cache" / "specdec"
    return Path(home).expanduser()
