"""Features that need Python packages the services can run without, checked before anything starts.

The drafter, the verifier and a gRPC-only orchestrator need only torch, transformers, grpcio (with
its health checking) and protobuf (docs/gpu.md, "What the services need"). The HTTP API, the
Redis store and the metrics endpoint import their packages when asked for; asked for without
them, the command stops with one line naming the flag and the packages (exit 2, a usage error)
instead of a traceback later.
Tracing is checked where it is set up (orchestrator.tracing.TracingUnavailable).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.cli.common import fail


@dataclass(frozen=True)
class Extra:
    """A feature, how it is asked for, and what it imports (module → the package that installs it)."""

    feature: str
    modules: dict[str, str]


# starlette and pydantic come with fastapi: a missing one is fixed by installing fastapi.
HTTP_API = Extra("the OpenAI-compatible HTTP API", {"fastapi": "fastapi", "uvicorn": "uvicorn",
                                                    "starlette": "fastapi", "pydantic": "fastapi"})
REDIS_STORE = Extra("the Redis store", {"redis": "redis"})
OTLP_RECEIVER = Extra("the OTLP span receiver", {"opentelemetry.proto": "opentelemetry-proto"})
METRICS = Extra("the Prometheus /metrics endpoint", {"prometheus_client": "prometheus-client"})


def require(extra: Extra, asked_by: str, instead: str) -> None:
    """Exit 2 with one line when a package of `extra` is missing; `asked_by` names the flag (or the
    variable) that asked for it, `instead` how to run without it."""
    from orchestrator.tracing import missing_packages

    absent = missing_packages(extra.modules)
    if absent:
        raise fail(f"{asked_by} ({extra.feature}) needs the Python package(s) {', '.join(absent)}, not "
                   f"installed: pip install {' '.join(absent)}, or {instead}", 2)


def is_redis_url(url: str | None) -> bool:
    """Whether a store URL names Redis (redis://, rediss://, unix://: what orchestrator.store opens)."""
    return bool(url) and url.startswith(("redis://", "rediss://", "unix://"))
