"""The tree stays ruff-clean (the style rule of the project, enforced where CI sees it)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean() -> None:
    probe = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True)
    if probe.returncode != 0:
        pytest.fail("ruff is not installed (it is in the dev extra)")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
