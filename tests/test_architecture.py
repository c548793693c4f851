"""The layering holds: import-linter's contracts (pyproject.toml) pass on the tree, and they fail on a
tree that breaks them; the core imports no I/O framework at run time either."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports(cwd: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    executable = shutil.which("lint-imports")
    if executable is None:
        pytest.fail("lint-imports is not installed (import-linter is in the dev extra)")
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run(
        [executable, "--no-cache", "--config", str(cwd / "pyproject.toml")],
        cwd=cwd, capture_output=True, text=True, timeout=300, env=env,
    )


def test_import_contracts_are_kept() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"Contracts: (\d+) kept, 0 broken", result.stdout), result.stdout[-2000:]


def _fake_tree(root: Path, core_imports: str) -> None:
    """The project's package names with one module each; the core module imports `core_imports`."""
    for package, body in {
        "specdec": "",
        "specdec/cli": "import orchestrator\n",
        "specdec/rpc": "import specdec.methods\n",
        "specdec/client": "import specdec.rpc\n",
        "orchestrator": "import drafter_service, verifier_service\n",
        "drafter_service": "import specdec.rpc\n",
        "verifier_service": "import specdec.rpc\n",
    }.items():
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text(body)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    core = next(c for c in config["contracts"] if c.get("containers") == ["specdec"])["layers"][-1]
    for name in (n.strip() for n in core.split(":")):
        (root / "specdec" / f"{name}.py").write_text(core_imports if name == "methods" else "")
    loop = next(c for c in config["contracts"] if c.get("containers") == ["orchestrator"])["layers"]
    for name in (n.strip() for layer in loop for n in re.split(r"[:|]", layer)):
        (root / "orchestrator" / f"{name}.py").write_text("")  # the orchestrator's modules, empty
    for contract in config["contracts"]:  # and the project's modules a contract names, empty
        for dotted in contract.get("forbidden_modules", []):
            if dotted.split(".")[0] in config["root_packages"]:
                _ensure_module(root, dotted)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")


def _ensure_module(root: Path, dotted: str) -> None:
    """An empty module at `dotted` in the fake tree; a parent that is a module file becomes a package."""
    *parents, name = dotted.split(".")
    path = root
    for part in parents:
        path = path / part
        as_file = path.with_suffix(".py")
        if as_file.exists():
            path.mkdir(exist_ok=True)
            (path / "__init__.py").write_text(as_file.read_text())
            as_file.unlink()
        path.mkdir(exist_ok=True)
    if not (path / name).is_dir() and not (path / f"{name}.py").exists():
        (path / f"{name}.py").write_text("")


@pytest.mark.parametrize(
    "violation", ["import orchestrator\n", "import specdec.rpc\n", "import grpc\n", "import bench\n"]
)
def test_contracts_catch_a_core_module_importing_upwards(tmp_path: Path, violation: str) -> None:
    """A negative control: the same contracts on a tree whose core imports upwards must fail."""
    _fake_tree(tmp_path, "")
    assert _lint_imports(tmp_path, tmp_path).returncode == 0  # the clean fake tree passes
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    _fake_tree(tmp_path, violation)
    result = _lint_imports(tmp_path, tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout[-2000:]


def test_contracts_catch_the_light_client_importing_numpy(tmp_path: Path) -> None:
    """A negative control for the light client's contract: torch / numpy through any chain breaks it."""
    _fake_tree(tmp_path, "")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "specdec" / "client" / "__init__.py").write_text("import specdec.methods\n")
    (tmp_path / "specdec" / "methods.py").write_text("import numpy\n")
    result = _lint_imports(tmp_path, tmp_path)
    assert result.returncode != 0, result.stdout[-2000:]
    broken = "The light client imports no torch, transformers or numpy BROKEN"
    assert broken in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("module", ["specdec/engine.py", "drafter_service/__init__.py",
                                    "verifier_service/__init__.py"])
def test_contracts_catch_an_engine_importing_the_orchestrator(tmp_path: Path, module: str) -> None:
    """A negative control for the engines' contract: an engine, or either engine service, that
    imports the orchestrator breaks it by name (whatever else it breaks besides)."""
    _fake_tree(tmp_path, "")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    target = tmp_path / module
    target.write_text(target.read_text() + "import orchestrator\n")
    result = _lint_imports(tmp_path, tmp_path)
    assert result.returncode != 0, result.stdout[-2000:]
    broken = "The engines and their services import no orchestrator BROKEN"
    assert broken in result.stdout, result.stdout[-2000:]


def test_core_imports_no_io_frameworks() -> None:
    """Importing the core must not pull in grpc, redis or OpenTelemetry."""
    code = (
        "import sys, specdec, specdec.verification.dispatch, specdec.methods, specdec.theory, specdec.trees, "
        "specdec.races, specdec.drafting, specdec.engine.api, specdec.generation\n"
        "bad = [m for m in ('grpc', 'redis', 'opentelemetry') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


TYPE_LEVEL_IMPORT = ("from typing import TYPE_CHECKING\n\n"
                     "if TYPE_CHECKING:\n    from orchestrator.drafting import base\n")


@pytest.mark.parametrize("module, violation", [
    ("sessions.py", "from orchestrator import speculation\n"),  # a session calling back up into the loop
    ("run.py", TYPE_LEVEL_IMPORT),  # a run typed by a strategy: a circle hidden behind TYPE_CHECKING
    ("drafting/model.py", "from orchestrator import engine_link\n"),  # siblings stay independent
])
def test_the_orchestrator_contract_catches_an_upward_or_type_level_import(
    tmp_path: Path, module: str, violation: str
) -> None:
    """A negative control for the orchestrator's layers: the real packages, one import added."""
    for package in ("specdec", "orchestrator", "drafter_service", "verifier_service", "bench"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "orchestrator" / module
    target.write_text(target.read_text() + "\n" + violation)
    result = _lint_imports(tmp_path, tmp_path)
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Inside orchestrator" in result.stdout and "BROKEN" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("violation", ["import grpc\n", "import orchestrator.clients.grpc_client\n",
                                       "import orchestrator.store\n"])
def test_the_proposers_contract_catches_a_transport_import(tmp_path: Path, violation: str) -> None:
    """A negative control for "Proposers import no transport", on the real packages: a proposer that
    imports gRPC, the gRPC client, or the store (and through it Redis) breaks it by name."""
    for package in ("specdec", "orchestrator", "drafter_service", "verifier_service", "bench"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "orchestrator" / "drafting" / "model_free.py"
    target.write_text(target.read_text() + "\n" + violation)
    result = _lint_imports(tmp_path, tmp_path)
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Proposers import no transport BROKEN" in result.stdout, result.stdout[-2000:]
