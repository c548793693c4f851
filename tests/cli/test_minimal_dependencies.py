"""The services start with only the packages a GPU machine's image has (issue 30; docs/gpu.md "What the
services need"): `specdec serve drafter`, `serve verifier` and a gRPC-only `serve orchestrator` run
in processes where OpenTelemetry, Redis, FastAPI/uvicorn/starlette, openai, gguf, locust and
kubernetes cannot be imported (a sys.meta_path finder refuses them), get healthy, and answer a
Generate. pydantic is the exception the device check carries as wheels (bench/device/wheels.txt):
the CLI's typer requires it and the orchestrator's settings are pydantic-settings; the engines'
own code imports none of it (test_the_engine_serve_path_imports_without_pydantic). Asking such
a process for a feature whose package is missing (--http-port, --otlp-endpoint, --trace-file, a
redis:// store) stops it with one line naming the flag and the package, exit 2.

The import blocker stands in for a bare virtual environment (building one offline from the pip
cache is not possible here); the device machine's image is the real thing (docs/gpu.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import device_under_test, wait_for_ready_file

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240.0  # torch + transformers on a busy 2-core machine; only reached when broken
CLI_TIMEOUT_S = 120.0
# Top-level modules of packages the device machine's image lacks (/work/.library/device/KINDS.md)
# and that no service may need unless a feature asks for them.
BLOCKED = ("opentelemetry", "redis", "fastapi", "uvicorn",
           "starlette", "openai", "gguf", "locust", "kubernetes", "kubernetes_validate")
# Carried to the device as wheels (typer requires pydantic; the orchestrator's settings are
# pydantic-settings): refused only where a test says so.
PYDANTIC = ("pydantic", "pydantic_core", "pydantic_settings")
RUN_CLI = 'runpy.run_module("specdec.cli", run_name="__main__", alter_sys=True)'


def _bootstrap(then: str = RUN_CLI, *, also_block: tuple[str, ...] = ()) -> str:
    """Python code that installs a finder refusing BLOCKED (a refused import says so in its
    message), then runs `then`; by default `python -m specdec.cli ARGS` (sys.argv[0] is then the
    CLI's __main__.py, as for the real program)."""
    return f"""
import runpy, sys
BLOCKED = frozenset({BLOCKED + also_block!r})

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Blocker())
{then}
"""


pytestmark = pytest.mark.timeout(int(3 * STARTUP_TIMEOUT_S) + 120)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SPECDEC_STORE"))}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", COLUMNS="200", NO_COLOR="1", TERM="dumb")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _argv(*args: str, also_block: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-c", _bootstrap(also_block=also_block), *args]


def _run(*args: str, also_block: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_argv(*args, also_block=also_block), capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL)


class Service:
    """One `specdec serve ROLE` process with the blocker; its log in a file, stopped in teardown."""

    def __init__(self, workdir: Path, role: str, *args: str) -> None:
        self.role = role
        self.ready_file = workdir / f"{role}.ready.json"
        self.log_path = workdir / f"{role}.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                _argv("serve", role, "--host", "127.0.0.1", "--port", "0",
                      "--ready-file", str(self.ready_file), *args),
                stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> str:
        """host:port once the ready file is written (the orchestrator writes it once SERVING)."""
        info = wait_for_ready_file(self.ready_file, self.process, f"serve {self.role}", self.log,
                                   STARTUP_TIMEOUT_S)
        return f"127.0.0.1:{info['port']}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@pytest.fixture
def services(tmp_path: Path) -> Iterator[list[Service]]:
    started: list[Service] = []
    yield started
    for service in reversed(started):
        service.stop()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from specdec.runtime.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("tiny-pair")
    draft = save_tiny_model(root / "draft", vocab_size=8, seed=1)
    return draft, save_tiny_model(root / "target", vocab_size=8, seed=2)


def _health(address: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


@pytest.mark.slow
def test_the_three_services_serve_without_the_optional_packages(tiny_pair, tmp_path, services) -> None:
    draft, target = tiny_pair
    device = device_under_test()
    engine_args = ("--device", device, "--dtype", "float32", "--threads", "1")
    services.append(Service(tmp_path, "drafter", "--model", str(draft), *engine_args))
    services.append(Service(tmp_path, "verifier", "--model", str(target), *engine_args))
    drafter, verifier = (service.wait_ready() for service in services)
    services.append(Service(tmp_path, "orchestrator", "--drafter", drafter, "--verifier", verifier,
                            "--draft-source", "model"))
    orchestrator = services[-1].wait_ready()
    for address in (drafter, verifier, orchestrator):
        assert _health(address) == "SERVING", address

    import grpc

    from specdec.rpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    request = generation_pb2.GenerationRequest(prompt_ids=common_pb2.TokenIds(ids=[1, 2, 3]),
                                               max_new_tokens=6, method="token", k=2, seed=7)
    with grpc.insecure_channel(orchestrator) as channel:
        result = generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=120)
    assert 1 <= len(result.token_ids) <= 6
    assert all(0 <= token < 8 for token in result.token_ids)
    for service in services:
        assert "blocked by the test" not in service.log(), service.log()


@pytest.mark.parametrize(("flags", "names"), [
    (("--http-port", "0"), ("--http-port", "fastapi", "uvicorn")),
    (("--otlp-endpoint", "127.0.0.1:4317"), ("--otlp-endpoint", "opentelemetry-sdk",
                                             "opentelemetry-exporter-otlp")),
    (("--trace-file", "{tmp}/spans.jsonl"), ("--trace-file", "opentelemetry-sdk")),
    (("--store-url", "redis://127.0.0.1:1/0"), ("--store-url", "redis")),
    (("--metrics-port", "0"), ("--metrics-port", "prometheus-client")),  # in the GPU image, but optional
])
def test_a_feature_without_its_package_is_one_usage_error(flags, names, tmp_path) -> None:
    """Checked before anything starts: no engine needs to run for the orchestrator to refuse."""
    result = _run("serve", "orchestrator", "--port", "0", "--drafter", "127.0.0.1:1",
                  "--verifier", "127.0.0.1:1", *(flag.format(tmp=tmp_path) for flag in flags),
                  also_block=("prometheus_client",))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith("error: orchestrator: " if flags[0].endswith(("-endpoint", "-file"))
                                    else "error: "), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    for name in (*names, "not installed"):
        assert name in result.stderr, (name, result.stderr)


def test_trace_collect_without_opentelemetry_is_one_usage_error(tmp_path) -> None:
    result = _run("trace-collect", "--port", "0", "--out", str(tmp_path / "spans.jsonl"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert "trace-collect" in result.stderr and "opentelemetry-proto" in result.stderr, result.stderr


def _run_code(code: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=CLI_TIMEOUT_S, env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_engine_serve_path_imports_without_pydantic() -> None:
    """Everything `serve drafter` and `serve verifier` import, and tracing's no-op path, with pydantic
    refused as well (typer's option parsing, which needs it, is not run here)."""
    modules = ("specdec.cli.main", "specdec.cli.serve", "drafter_service.server", "verifier_service.server",
               "specdec.engine.drafter", "specdec.engine.verifier", "specdec.runtime.loading",
               "specdec.rpc.grpc_support", "specdec.rpc.security", "orchestrator.tracing")
    then = textwrap.dedent(f"""
        import importlib, json
        for name in {modules!r}:
            importlib.import_module(name)
        from orchestrator.tracing import configure_tracing
        print(json.dumps({{"tracing": configure_tracing("x") is None,
                          "pydantic": "pydantic" in sys.modules}}))
        """)
    outcome = _run_code(_bootstrap(then, also_block=PYDANTIC))
    assert outcome == {"tracing": True, "pydantic": False}


def test_the_blocker_blocks() -> None:
    """The finder really refuses what it names (else the tests above would prove nothing)."""
    then = textwrap.dedent("""
        import json
        out = {}
        for name in BLOCKED:
            try:
                __import__(name)
                out[name] = "imported"
            except ModuleNotFoundError as exc:
                out[name] = str(exc)
        print(json.dumps(out))
        """)
    outcome = _run_code(_bootstrap(then, also_block=PYDANTIC))
    assert all("blocked by the test" in message for message in outcome.values()), outcome
    assert set(outcome) == set(BLOCKED) | set(PYDANTIC)
