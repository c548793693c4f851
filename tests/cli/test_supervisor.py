"""`specdec up` as a supervisor (issue 29): a service that dies is restarted on its ports after a
back-off, the drafter is optional past its restart limit, and `up` ends only on Ctrl-C / SIGTERM,
a first start that fails, or a vital service past --restarts.

The first tests drive `Supervisor.supervise` with stand-in children (plain Python sleepers: fast,
no torch); the last ones kill -9 each service of a real `up` on tiny models, in file order (the
drafter last: it leaves the drafter down for good).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from specdec.cli import processes
from specdec.cli.processes import Child, RestartPolicy, Supervisor, SupervisorEvent

# A stand-in service: writes its ready file with the ports it was given (or made-up ones for 0), then
# sleeps; when a file READY_FILE.crash exists it says why on its output and exits 3 at once.
STAND_IN = textwrap.dedent("""
    import json, os, sys, time
    args = sys.argv[1:]
    def value(flag):
        return args[args.index(flag) + 1]
    if os.path.exists(value("--ready-file") + ".crash"):
        print("starting"); print("error: the model is gone", flush=True); sys.exit(3)
    port = int(value("--port")) or 40000 + os.getpid() % 20000
    http = int(value("--http-port")) or 20000 + os.getpid() % 20000
    ready = {"address": f"127.0.0.1:{port}", "pid": os.getpid(), "http_url": f"http://127.0.0.1:{http}"}
    tmp = value("--ready-file") + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(ready, handle)
    os.replace(tmp, value("--ready-file"))
    time.sleep(120)
""")
FAST = {"first_delay_s": 0.05, "max_delay_s": 0.4}  # back-offs of the stand-in tests
BOUND_S = 20.0  # every wait of the stand-in tests


def _stand_in(supervisor: Supervisor, name: str) -> Child:
    ready = supervisor.log_dir / f"{name}.ready.json"
    argv = [sys.executable, "-c", STAND_IN, "--port", "0", "--http-port", "0", "--ready-file", str(ready)]
    child = supervisor.start(Child(name=name, argv=argv, ready_file=ready,
                                   log_path=supervisor.log_dir / f"{name}.log"))
    deadline = time.monotonic() + BOUND_S
    while not (info := processes.read_ready_file(ready)):
        assert time.monotonic() < deadline and child.alive(), child.log_tail()
        time.sleep(0.02)
    child.address, child.info = info["address"], info
    return child


class _Run:
    """`supervise` in a thread, its events collected, waits bounded."""

    def __init__(self, supervisor: Supervisor, policies: dict[str, RestartPolicy], *,
                 healthy=lambda child: True, startup_timeout: float = BOUND_S) -> None:
        self.supervisor = supervisor
        self.events: list[SupervisorEvent] = []
        self.result: list[Child | None] = []
        self.thread = threading.Thread(target=lambda: self.result.append(supervisor.supervise(
            policies, self.events.append, startup_timeout=startup_timeout, healthy=healthy, poll=0.02)),
            daemon=True)
        self.thread.start()

    def kinds(self, name: str) -> list[str]:
        return [e.kind for e in self.events if e.child.name == name]

    def wait_for(self, name: str, kinds: list[str]) -> None:
        deadline = time.monotonic() + BOUND_S
        while self.kinds(name)[:len(kinds)] != kinds:
            assert time.monotonic() < deadline, self.events
            time.sleep(0.02)

    def finish(self) -> Child | None:
        self.supervisor.stop_requested.set()
        self.thread.join(BOUND_S)
        assert not self.thread.is_alive()
        return self.result[0]


def test_the_back_off_doubles_to_its_cap_and_starts_over_after_healthy_running() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=30.0, reset_after_s=60.0)
    delays, delay = [], 0.0
    for _ in range(9):
        delay = policy.next_delay(delay, healthy_for=1.0)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert policy.next_delay(30.0, healthy_for=60.0) == 0.5


def test_a_killed_service_comes_back_on_its_ports(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    try:
        verifier = _stand_in(supervisor, "verifier")
        other = _stand_in(supervisor, "orchestrator")
        run = _Run(supervisor, {"verifier": RestartPolicy(**FAST)})
        os.kill(verifier.pid, signal.SIGKILL)
        run.wait_for("verifier", ["died", "restarting", "healthy"])
        died, _, healthy = run.events
        assert re.search(r"verifier \(pid \d+\) was killed by SIGKILL; log: .*verifier\.log$", died.reason)
        assert died.delay == 0.05 and healthy.restarts == 1
        fresh = supervisor.children[0]
        assert fresh is healthy.child and fresh.pid != verifier.pid and fresh.alive()
        assert fresh.address == verifier.address and fresh.info["http_url"] == verifier.info["http_url"]
        assert other.alive() and supervisor.children[1] is other  # the others were left alone
        assert run.finish() is None  # a stop request ends it, nothing else did
    finally:
        supervisor.stop(grace=5)


def test_past_its_limit_an_optional_service_stays_down_and_the_rest_runs_on(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    try:
        drafter = _stand_in(supervisor, "drafter")
        verifier = _stand_in(supervisor, "verifier")
        run = _Run(supervisor, {"drafter": RestartPolicy(limit=1, fatal=False, **FAST)})
        os.kill(drafter.pid, signal.SIGKILL)
        run.wait_for("drafter", ["died", "restarting", "healthy"])
        os.kill(supervisor.children[0].pid, signal.SIGKILL)
        run.wait_for("drafter", ["died", "restarting", "healthy", "gave_up"])
        time.sleep(0.3)  # several more looks: nothing restarts it, nothing ends
        assert run.kinds("drafter") == ["died", "restarting", "healthy", "gave_up"]
        assert run.thread.is_alive() and verifier.alive()
        assert run.finish() is None
    finally:
        supervisor.stop(grace=5)


def test_past_its_limit_a_vital_service_ends_supervision_with_its_exit_reason(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    try:
        verifier = _stand_in(supervisor, "verifier")
        drafter = _stand_in(supervisor, "drafter")
        run = _Run(supervisor, {"verifier": RestartPolicy(limit=1, **FAST)})
        Path(f"{verifier.ready_file}.crash").touch()  # its restart fails: the death past the limit
        os.kill(verifier.pid, signal.SIGKILL)
        run.thread.join(BOUND_S)
        assert not run.thread.is_alive() and run.result == [supervisor.children[0]]
        assert run.kinds("verifier") == ["died", "restarting", "gave_up"]
        gave_up = run.events[-1]
        assert re.search(r"verifier \(pid \d+\) exited with code 3 \(error: the model is gone\); log: ",
                         gave_up.reason), gave_up.reason
        assert drafter.alive()  # `up` stops the others itself (Supervisor.stop)
    finally:
        supervisor.stop(grace=5)


def test_a_restart_that_never_gets_healthy_is_stopped_and_tried_again_later(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    try:
        verifier = _stand_in(supervisor, "verifier")
        run = _Run(supervisor, {"verifier": RestartPolicy(**FAST)}, healthy=lambda child: False,
                   startup_timeout=0.3)
        os.kill(verifier.pid, signal.SIGKILL)
        run.wait_for("verifier", ["died", "restarting", "died", "restarting"])
        died = [e for e in run.events if e.kind == "died"]
        assert "did not pass its health check within 0.3 s of its restart" in died[1].reason
        assert [e.delay for e in died[:2]] == [0.05, 0.1]  # doubled: it never ran healthy in between
        assert not died[1].child.alive()  # stopped, not left behind
        assert run.finish() is None
    finally:
        supervisor.stop(grace=5)


def test_up_restarts_every_service_without_limit_and_only_the_drafter_may_stay_down() -> None:
    import typer

    from specdec.cli import app
    from specdec.cli.up import restart_policies

    params = typer.main.get_command(app).commands["up"].make_context("up", []).params
    assert params["drafter_restarts"] is None and params["restarts"] is None  # no limit by default
    policies = restart_policies(params["drafter_restarts"], params["restarts"])
    assert all(policy.limit is None for policy in policies.values())
    assert not policies["drafter"].fatal and policies["verifier"].fatal and policies["orchestrator"].fatal
    limited = restart_policies(1, 2)
    assert (limited["drafter"].limit, limited["verifier"].limit, limited["orchestrator"].limit) == (1, 2, 2)


# ------------------------------------------------------------------------------ the real thing

RECOVERY_S = 120.0  # a restarted service loads torch and its model again on 2 busy cores
MODEL = "tiny"
PROMPT = "t1 t2 t3 t1 t2"


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """A real `up` on tiny models: one torch thread each, every port chosen by the OS, metrics on, a
    drafter restarted once at most (the issue's `--drafter-restarts 1`)."""
    from specdec.runtime.tiny import save_tiny_model
    from tests.integration.helpers import TINY_CONTEXT, UpProcess

    root = tmp_path_factory.mktemp("supervisor")
    draft = save_tiny_model(root / "draft", vocab_size=8, seed=1, max_position_embeddings=TINY_CONTEXT)
    target = save_tiny_model(root / "target", vocab_size=8, seed=2, max_position_embeddings=TINY_CONTEXT)
    process = UpProcess(root, "--draft", str(draft), "--target", str(target), "--drafter-threads", "1",
                        "--verifier-threads", "1", "--metrics-port", "0", "--served-model-name", MODEL,
                        "--drafter-restarts", "1")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def _info(up) -> dict:
    return json.loads(up.ready_file.read_text())


def _restarts(info: dict, name: str) -> int | None:
    return info.get("restarts", {}).get(name)


def _wait_info(up, condition, what: str) -> dict:
    """`up`'s ready file once `condition` holds of it (bounded); `up` must keep running meanwhile."""
    deadline = time.monotonic() + RECOVERY_S
    while True:
        assert up.process.poll() is None, f"`up` exited ({up.process.returncode}) waiting for {what}:\n" \
                                          f"{up.stderr()}"
        info = processes.read_ready_file(up.ready_file)
        if info and condition(info):
            return info
        assert time.monotonic() < deadline, f"no {what} within {RECOVERY_S:g} s:\n{up.stderr()}"
        time.sleep(0.2)


def _complete(http_url: str) -> str:
    """One completion through the HTTP door, retried (bounded) while the service is still coming back."""
    import openai

    deadline = time.monotonic() + RECOVERY_S
    with openai.OpenAI(base_url=f"{http_url}/v1", api_key="x", max_retries=0, timeout=60.0) as client:
        while True:
            try:
                reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
                return reply.choices[0].text
            except (openai.APIConnectionError, openai.APIStatusError) as exc:
                if time.monotonic() > deadline:
                    raise AssertionError(f"no completion within {RECOVERY_S:g} s: {exc}") from exc
                time.sleep(0.5)


def _drafter_up(up, want: float) -> None:
    """Wait (bounded) until the orchestrator's /metrics has specdec_dependency_up of the drafter at `want`."""
    url = _info(up)["metrics"]["orchestrator"]
    deadline, value = time.monotonic() + 30.0, None
    while value != want:
        assert time.monotonic() < deadline, f"specdec_dependency_up{{drafter}} is {value}, not {want}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        found = re.search(r'^specdec_dependency_up\{[^}]*dependency="drafter"[^}]*\} (\S+)$', text, re.M)
        value = float(found.group(1)) if found else None
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_verifier_killed_under_up_comes_back_and_serves(up) -> None:
    before = _info(up)
    assert _complete(before["http"])
    os.kill(before["pids"]["verifier"], signal.SIGKILL)
    after = _wait_info(up, lambda info: _restarts(info, "verifier") == 1, "verifier restart")
    assert after["pids"]["verifier"] != before["pids"]["verifier"]
    assert processes.check_health(before["verifier"], timeout=10.0) == "SERVING"  # on its port again
    assert _complete(before["http"])
    stderr = up.stderr()
    assert f"verifier (pid {before['pids']['verifier']}) was killed by SIGKILL" in stderr
    assert "verifier healthy again on" in stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_orchestrator_killed_under_up_comes_back_on_its_ports(up) -> None:
    before = _info(up)
    own = processes.read_ready_file(up.log_dir / "orchestrator.ready.json")
    os.kill(before["pids"]["orchestrator"], signal.SIGKILL)
    after = _wait_info(up, lambda info: _restarts(info, "orchestrator") == 1, "orchestrator restart")
    assert after["pids"]["orchestrator"] != before["pids"]["orchestrator"]
    again = processes.read_ready_file(up.log_dir / "orchestrator.ready.json")
    assert (again["address"], again["http_url"], again["metrics_url"]) == \
        (own["address"], own["http_url"], own["metrics_url"])  # gRPC, HTTP and /metrics ports kept
    assert processes.check_health(before["orchestrator"], timeout=10.0) == "SERVING"
    assert _complete(before["http"])
    assert f"orchestrator (pid {before['pids']['orchestrator']}) was killed by SIGKILL" in up.stderr()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_drafter_killed_past_its_restarts_leaves_up_serving_target_only(up) -> None:
    before = _info(up)
    _drafter_up(up, 1.0)
    os.kill(before["pids"]["drafter"], signal.SIGKILL)
    first = _wait_info(up, lambda info: _restarts(info, "drafter") == 1 and "drafter" in info["pids"],
                       "drafter restart")
    _drafter_up(up, 1.0)  # back, and the orchestrator drafts with it again
    os.kill(first["pids"]["drafter"], signal.SIGKILL)  # past --drafter-restarts 1
    _wait_info(up, lambda info: _restarts(info, "drafter") == 1 and "drafter" not in info["pids"],
               "the drafter given up")
    _drafter_up(up, 0.0)
    assert _complete(before["http"])  # target-only steps
    time.sleep(1.0)
    assert up.process.poll() is None
    stderr = " ".join(up.stderr().split())
    assert "--drafter-restarts 1 reached): the orchestrator goes on target-only" in stderr
    up.stop()
    assert up.process.returncode == 0, up.stderr()
    assert "all services stopped" in up.stderr_path.read_text()
