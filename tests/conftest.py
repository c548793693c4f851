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

# A served orchestrator's start-up warm-up request (OrchestratorConfig.warm_up_tokens) would add its
# engine calls, sessions and spans to every test that counts them; the tests of the warm-up turn it on.
os.environ.setdefault("SPECDEC_WARM_UP_TOKENS", "0")


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
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of a parallel run (see "Parallel runs" below)
        one_torch_thread_per_worker()


def pytest_report_header(config: pytest.Config) -> str:
    return f"test device: {device_under_test()} (${TEST_DEVICE_VARIABLE}; tests marked `device`)"


# ------------------------------------------------------------------------------------------------
# Parallel runs. A run of the suite (or of folders or files of it) goes to pytest-xdist workers,
# $SPECDEC_TEST_WORKERS of them (default 2, CI's cores; 0 or 1: this one process): most tests of the
# engines wait more than they compute (tiny models; a pass waits its gather window for others to
# join), so two workers on two cores finish in about half the time. It stays in one process when
# the command chose (-n / --dist / -p no:xdist), when it names single tests (`file::test`), with
# --pdb, -s (a worker's output is not shown) or --collect-only, on a GPU test device (one CUDA
# context), or without pytest-xdist installed (the dev extras have it).
# Each worker runs its torch passes on one thread (its share of the cores; the suite's in-process
# models load with threads=1 anyway) and has its own session fixtures (models, engines, a
# redis-server on a free port). Tests of one module that share a module- or class-scoped fixture
# starting processes (an `up`, servers, the CLI samples of tests/cli/test_int8_law.py) run on one
# worker, as one xdist group (`--dist loadgroup`, `shared_process_fixture` below), so those
# processes start once.

WORKERS_VARIABLE = "SPECDEC_TEST_WORKERS"
DEFAULT_WORKERS = 2


def default_workers(config: pytest.Config) -> int:
    """How many xdist workers this run gets when its command line does not say (0: none)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or hasattr(config, "workerinput"):
        return 0  # a worker itself
    if not config.pluginmanager.hasplugin("xdist"):
        return 0
    option = config.option
    if option.numprocesses is not None or option.dist != "no" or option.tx or option.distload:
        return 0  # the command chose
    if option.collectonly or option.usepdb or option.capture == "no":
        return 0
    if config.args and all("::" in arg for arg in config.args):
        return 0  # single tests: a worker's start would cost more than it saves
    try:
        if (config.getoption("--test-device") or device_under_test()) != "cpu":
            return 0
        workers = int(os.environ.get(WORKERS_VARIABLE) or DEFAULT_WORKERS)
    except ValueError as exc:
        raise pytest.UsageError(f"${WORKERS_VARIABLE}: {exc}") from None
    return workers if workers > 1 else 0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Before pytest-xdist reads its options (its hook is tryfirst too, and runs after this one)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # a worker parses the command line, not the options chosen here
        if workerinput.get(LOADGROUP_KEY):
            config.option.loadgroup = True  # the groups below reach the scheduler
        return
    workers = default_workers(config)
    if workers:
        config.option.numprocesses = workers
        config.option.dist = "loadgroup"
        config.pluginmanager.register(TellWorkers(), "specdec-xdist-workers")


LOADGROUP_KEY = "specdec_loadgroup"


class TellWorkers:
    """Registered only with pytest-xdist (its hook)."""

    @staticmethod
    def pytest_configure_node(node) -> None:
        node.workerinput[LOADGROUP_KEY] = True


def one_torch_thread_per_worker() -> None:
    import torch

    torch.set_num_threads(1)


def shared_process_fixture(item: pytest.Item) -> bool:
    """Whether `item` uses a fixture shared by several tests (module, class or package scope) whose
    code can start a process: its module's tests then run on one worker."""
    info = getattr(item, "_fixtureinfo", None)
    for definitions in (info.name2fixturedefs.values() if info is not None else ()):
        for definition in definitions:
            if definition.scope not in ("module", "class", "package"):
                continue
            try:
                code = inspect.getsource(definition.func)
            except (OSError, TypeError):
                continue
            where = Path(inspect.getfile(definition.func))
            if PROCESS_STARTERS.search(code) or helpers_start_processes(where) or \
                    module_helpers_start_processes(where):
                return True
    return False


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
# mark (platform's processor probe; a verifier's chat-template child, reused afterwards; the C
# compiler building the int8 attention kernel, once per machine, ~0.2 s; matplotlib's font list,
# once per machine).
QUICK_PROCESSES = ("uname", "specdec.runtime.chat_template", "attention_kernel.c", "fc-list")
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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None and starts_processes(item):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("xdist_group") is None and shared_process_fixture(item):
            item.add_marker(pytest.mark.xdist_group(Path(str(item.path)).relative_to(TESTS_ROOT).as_posix()))


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
