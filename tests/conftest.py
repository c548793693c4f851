"""Options of the whole suite: the torch device of the tests that take one.

Tests marked `device` load their models on SPECDEC_TEST_DEVICE (tests.helpers.device_under_test):
"cpu" by default, so they run here; on a GPU machine `SPECDEC_TEST_DEVICE=cuda pytest -m device`
(or `pytest --test-device cuda -m device`) runs the same assertions on CUDA (docs/gpu.md).
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import TEST_DEVICE_VARIABLE, device_under_test


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--test-device", default=None, metavar="DEVICE",
                     help=f"torch device of the tests marked `device` (sets ${TEST_DEVICE_VARIABLE}; "
                          "default cpu): cpu, cuda, cuda:N or mps")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"device: loads its models on ${TEST_DEVICE_VARIABLE} (default cpu; "
                                       "cuda on a GPU machine): select them with -m device")
    given = config.getoption("--test-device")
    if given:
        os.environ[TEST_DEVICE_VARIABLE] = given  # subprocesses of the tests see it too
    try:
        device = device_under_test()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if device.startswith("cuda"):  # a device that is not there is an error, never a silent CPU run
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            raise pytest.UsageError(f"{TEST_DEVICE_VARIABLE}={device}: torch {torch.__version__} sees "
                                    f"{count} CUDA device(s)")


def pytest_report_header(config: pytest.Config) -> str:
    return f"test device: {device_under_test()} (${TEST_DEVICE_VARIABLE}; tests marked `device`)"


# ------------------------------------------------------------------------------------------------
# Tiers. `python -m pytest` runs every test (the README's command; CI runs it). The quick tier,
# `python -m pytest -m "not slow"`, leaves out every test that starts a process: a test is slow when
# it is marked so, or when its module or a tests/ module it imports names a way to start one
# (PROCESS_STARTERS), or it uses a fixture that starts one (PROCESS_FIXTURES). In the quick tier a
# test that starts a process all the same fails, naming itself: a new slow test cannot slip in.

PROCESS_STARTERS = re.compile(r"subprocess\.(?:run|Popen|check_output|check_call|call)\(|\bPopen\(|"
                              r"\brun_dry\(|create_subprocess_(?:exec|shell)|multiprocessing|\bSupervisor\(|"
                              r"apply_chat_template\(\w+, \w+|ChatTemplateRenderer\(|ApplyChatTemplate|"
                              r"run_cli\(|UpProcess|start_new_session|\bdump_dom\(|\bscreenshot\(")
PROCESS_FIXTURES = frozenset({"redis_url"})  # session fixtures: started before the guard below
# Started once per process by shared state, whichever test comes first, and cheap: not a slow test's
# mark (platform's processor probe; a verifier's chat-template child, reused afterwards).
QUICK_PROCESSES = ("uname", "specdec.runtime.chat_template")
_LOCAL_IMPORT = re.compile(r"^\s*from (tests(?:\.\w+)*|\.\w*) import", re.MULTILINE)
TESTS_ROOT = Path(__file__).resolve().parent


def _source(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


@functools.cache
def helpers_start_processes(path: Path, depth: int = 2) -> bool:
    """Whether a tests/ module that the module at `path` imports (to `depth`) can start a process."""
    for name in _LOCAL_IMPORT.findall(_source(path)):
        if name.startswith("."):
            base = path.parent / Path(*name.lstrip(".").split(".")) if name.strip(".") else path.parent
        else:
            base = TESTS_ROOT.parent / Path(*name.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file() and candidate != path and (
                    PROCESS_STARTERS.search(_source(candidate))
                    or (depth > 1 and helpers_start_processes(candidate, depth - 1))):
                return True
    return False


@functools.cache
def module_helpers_start_processes(path: Path) -> bool:
    """Whether a top-level function or class of a test module other than its tests and fixtures (a
    helper the tests call) can start a process."""
    source = _source(path)
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name.startswith(("test_", "Test")) or any(
                    "fixture" in ast.unparse(decorator) for decorator in getattr(node, "decorator_list", ())):
                continue
            if PROCESS_STARTERS.search(ast.get_source_segment(source, node) or ""):
                return True
    return False


def starts_processes(item: pytest.Item) -> bool:
    """Whether a test can start a process: through a tests/ module its module imports, a helper of
    its module, its own code or a fixture it uses (their source), or a fixture known to
    (PROCESS_FIXTURES). Processes started inside product code are not seen here: the quick tier's
    guard below names such a test, and it is marked slow where it is written."""
    path = Path(str(item.path))
    if helpers_start_processes(path) or module_helpers_start_processes(path):
        return True
    fixtures = set(getattr(item, "fixturenames", ()))
    if PROCESS_FIXTURES & fixtures:
        return True
    functions = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for definitions in (info.name2fixturedefs.values() if info is not None else ()):
        functions += [definition.func for definition in definitions]
    for function in functions:
        try:
            code = inspect.getsource(function) if function is not None else ""
        except (OSError, TypeError):
            code = ""
        if PROCESS_STARTERS.search(code):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None and starts_processes(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _quick_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """In a run that deselects slow tests, a test starting a process fails (see the tiers above)."""
    if "not slow" not in (request.config.option.markexpr or "") or request.node.get_closest_marker("slow"):
        yield
        return
    started: list[str] = []
    original = subprocess.Popen.__init__

    def recording(self, args, *rest, **kwargs):
        if not any(name in str(args) for name in QUICK_PROCESSES):
            started.append(str(args)[:120])
        original(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} started a process ({started[0]}) but is not marked slow: "
                    "the quick tier starts none. Mark it slow (pytest.mark.slow), or name what it "
                    "uses in tests/conftest.py's PROCESS_STARTERS / PROCESS_FIXTURES.", pytrace=False)
