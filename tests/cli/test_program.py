"""The `specdec` program itself: importing it has no side effect on the environment, `--help` stays
light (no torch, transformers or grpc), and only the program (not an in-process caller) exits early."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec.cli import app, common
from tests.integration.helpers import ROOT, cli_env

HEAVY = ("torch", "transformers", "grpc")

IMPORT_EVERY_MODULE = """
import importlib, json, os, pkgutil, sys
before = dict(os.environ)
import specdec.cli
names = [m.name for m in pkgutil.iter_modules(specdec.cli.__path__) if m.name != "__main__"]
for name in names:
    importlib.import_module("specdec.cli." + name)
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print(json.dumps({"modules": names, "changed": changed}))
"""


def _env_without(*names: str) -> dict[str, str]:
    env = cli_env()
    for name in names:
        env.pop(name, None)
    return env


def test_importing_the_cli_changes_no_environment_variable() -> None:
    import json

    env = _env_without("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS")
    result = subprocess.run([sys.executable, "-c", IMPORT_EVERY_MODULE], capture_output=True, text=True,
                            timeout=120, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"main", "generate", "serve", "up", "models", "options", "common"} <= set(report["modules"])
    assert report["changed"] == []


def _imported_top_level(stderr: str) -> set[str]:
    """Top-level packages named by `python -X importtime` (its lines end with '| module.name')."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.mark.parametrize("argv", [
    ["-m", "specdec.cli", "--help"],
    ["-m", "specdec.cli", "generate", "--help"],
    ["-m", "specdec.cli", "serve", "drafter", "--help"],
    ["-m", "specdec.cli", "up", "--help"],
    # what the `specdec` console script runs (specdec.cli:app)
    ["-c", "import sys; sys.argv[0] = 'specdec'; from specdec.cli import app; app()", "--help"],
], ids=lambda argv: " ".join(argv[2:]) if argv[0] == "-c" else " ".join(argv[1:]))
def test_help_imports_no_heavy_package(argv: list[str]) -> None:
    result = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True,
                            timeout=120, env=cli_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Usage:" in result.stdout
    imported = _imported_top_level(result.stderr)
    assert "typer" in imported  # the probe sees the imports
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_a_command_sets_the_environment_defaults_when_it_runs(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "placeholder")  # restored (here: unset or its old value) afterwards
    monkeypatch.delenv("HF_HUB_OFFLINE")
    runner = CliRunner()
    # The cheapest command that gets past the root callback: a usage error inside `generate`.
    assert runner.invoke(app, ["generate", "--draft", "x", "p"]).exit_code == 2
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # a value the user set wins
    assert runner.invoke(app, ["generate", "--draft", "x", "p"]).exit_code == 2
    assert os.environ["HF_HUB_OFFLINE"] == "0"


def test_only_the_program_exits_early(monkeypatch) -> None:
    """exit_now skips the interpreter's teardown for `specdec` / `python -m specdec.cli`, never for tests."""
    main_file = Path(common.__file__).with_name("__main__.py")
    for argv0, expected in ((str(main_file), True), ("/usr/local/bin/specdec", True),
                            (sys.argv[0], False), ("-c", False)):
        monkeypatch.setattr(sys, "argv", [argv0])
        assert common.running_as_program() is expected, argv0
