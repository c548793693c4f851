"""The built-in defaults a fresh install runs with, and where specdec keeps its files.

Light on purpose (no torch, grpc or transformers): the CLI reads it for `--help`, the
transport for its message limit, the model registry and the benchmark for the default pair.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path

DEFAULT_DRAFT_MODEL = "qwen2.5-coder-0.5b"  # names in specdec.models.REGISTRY
DEFAULT_TARGET_MODEL = "qwen2.5-coder-1.5b"
DEFAULT_MAX_MESSAGE_MB = 64.0  # gRPC send/receive limit of every channel and server
# The identity of a caller with no credential (no token, no client certificate): what its request
# records are bound to (specdec.rpc.security.caller_identity). Here so that layers without a
# transport (the run, its record) can name it.
ANONYMOUS = "anonymous"

# What the orchestrator runs a request that names no method, k, a or pipeline with (the fields of
# orchestrator.config.OrchestratorConfig take them; `--default-*` and SPECDEC_DEFAULT_* override
# them there). Here so that the CLI's help states them without importing pydantic.
DEFAULT_METHOD = "token"  # a name in specdec.methods.METHOD_NAMES
DEFAULT_K = 2  # draft length of sequence methods, RD's k_max (why 2: OrchestratorConfig.default_k)
DEFAULT_TREE_BUDGET = 8  # node budget of gsd-tree
DEFAULT_A = 0.5  # RD drafting probability
DEFAULT_PIPELINE = True  # pre-draft the next block while the verifier checks this one


class DraftSource(StrEnum):
    """Where drafts come from: the one declaration of the source names (orchestrator.drafting's
    registry has one proposer per model-free source). HYBRID picks per iteration between a
    model-free draft, the draft model and a target-only step; the others use one source only."""

    HYBRID = "hybrid"
    MODEL = "model"  # the draft model; the others are model-free (IterationRecord.source)
    LOOKUP = "lookup"  # the request's own n-grams
    SUFFIX = "suffix"  # the request's tokens and a cache of recent requests


DRAFT_SOURCES: tuple[str, ...] = tuple(DraftSource)
MODEL_FREE_SOURCES: tuple[str, ...] = (DraftSource.LOOKUP, DraftSource.SUFFIX)
DEFAULT_DRAFT_SOURCE = DraftSource.HYBRID

# Weight precisions a model can be loaded in (specdec.runtime.loading). "int8": every nn.Linear
# with int8 weights per channel and int8 activations per row, pass-invariant attention (CPU only;
# batch-invariant, specdec.runtime.int8). Each precision is its own target model: the output is
# distributed exactly as the loaded precision's model.
PRECISIONS = ("float32", "bfloat16", "float16", "int8")
AUTO_PRECISION = "auto"  # the fast precision of the device (fast_precision)


def fast_precision(device: str) -> str:
    """The precision `--dtype auto` picks: int8 on a CPU (about 1.6x the speed of float32 for a
    9-token target pass here, bench/results/precision.md), bfloat16 on a CUDA GPU, else float32."""
    kind = device.split(":", 1)[0].strip().lower()
    if kind == "cpu":
        return "int8"
    if kind == "cuda":
        return "bfloat16"
    return "float32"


def resolve_precision(dtype: str, device: str) -> str:
    """`dtype` itself, or the device's fast precision for "auto"; a ValueError naming the choices."""
    if dtype == AUTO_PRECISION:
        return fast_precision(device)
    if dtype not in PRECISIONS:
        raise ValueError(f"dtype must be one of {', '.join((AUTO_PRECISION, *PRECISIONS))}, got {dtype!r}")
    return dtype


def specdec_home(home: Path | str | None = None) -> Path:
    """Root of everything specdec keeps on disk (models, converted caches, wheels, datasets,
    calibration): `home` if given, else $SPECDEC_HOME, else ~/.cache/specdec."""
    if home is None:
        home = os.environ.get("SPECDEC_HOME") or Path.home() / ".cache" / "specdec"
    return Path(home).expanduser()


def switched_off(variable: str) -> bool:
    """Whether an on-by-default switch (SPECDEC_LAYER_KERNELS, SPECDEC_HUGE_PAGES, ...) is set to
    0, false, no or off in the environment."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")
