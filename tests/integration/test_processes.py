"""specdec.cli.processes with stand-in children (plain Python sleepers): supervision, stopping,
no orphans, health waiting. Fast: no model and no torch in the children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from specdec.cli import processes
from specdec.cli.processes import Child, ProcessError, Supervisor

from .helpers import invoke_cli, pid_alive, wait_gone

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
STUBBORN = [sys.executable, "-c", textwrap.dedent("""
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print('ready', flush=True)
    time.sleep(120)
""")]


def _child(supervisor: Supervisor, name: str, argv: list[str]) -> Child:
    return Child(name=name, argv=argv, ready_file=supervisor.log_dir / f"{name}.ready.json",
                 log_path=supervisor.log_dir / f"{name}.log")


def test_parse_and_format_cores() -> None:
    assert processes.parse_cores("0,2-3, 5") == [0, 2, 3, 5]
    assert processes.parse_cores("") is None and processes.parse_cores(None) is None
    for bad in ("a", "3-1", "-1", "1-x"):
        with pytest.raises(ValueError):
            processes.parse_cores(bad)
    assert processes.format_cores([3, 1]) == "1,3" and processes.format_cores(None) == "any"


@pytest.mark.parametrize("cores, drafter, verifier", [
    ([0], [0], [0]), ([0, 1], [0], [1]), ([0, 1, 2, 3], [0], [1, 2, 3]),
    (list(range(8)), [0, 1], list(range(2, 8))),
])
def test_default_core_split(cores, drafter, verifier) -> None:
    assert processes.default_core_split(cores) == (drafter, verifier)


def test_pin_rejects_unavailable_cores() -> None:
    with pytest.raises(ProcessError, match="not available"):
        processes.pin_current_process([10_000])


def test_watch_reports_the_child_that_died_and_stop_leaves_nothing(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    try:
        first = supervisor.start(_child(supervisor, "first", SLEEPER))
        second = supervisor.start(_child(supervisor, "second", SLEEPER))
        second.process.send_signal(signal.SIGKILL)
        started = time.monotonic()
        assert supervisor.watch(poll=0.05) is second
        assert time.monotonic() - started < 10
        message = processes.describe_exit(second)
        assert f"second (pid {second.pid}) was killed by SIGKILL" in message
        assert first.alive()
    finally:
        supervisor.stop(grace=5)
    assert wait_gone([first.pid, second.pid], 5) == []


def test_children_get_two_malloc_arenas_unless_told_otherwise(tmp_path, monkeypatch) -> None:
    """Engine processes run many worker threads; with glibc's default of one arena per thread the
    memory of ragged batched passes stays spread over them (bench/RESULTS.md: 13.2 vs 7.7 GB at 32
    clients). A value the user set is passed on."""
    probe = [sys.executable, "-c", "import os; print(os.environ.get('MALLOC_ARENA_MAX'), flush=True)"]
    supervisor = Supervisor(tmp_path)
    try:
        for name, value in (("default", None), ("user", "8")):
            if value is None:
                monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
            else:
                monkeypatch.setenv("MALLOC_ARENA_MAX", value)
            child = supervisor.start(_child(supervisor, name, probe))
            assert child.process.wait(timeout=30) == 0
            assert child.log_path.read_text().strip() == (value or "2")
    finally:
        supervisor.stop(grace=5)


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    child = supervisor.start(_child(supervisor, "stubborn", STUBBORN))
    deadline = time.monotonic() + 30
    while "ready" not in child.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    supervisor.stop(grace=0.5)
    assert time.monotonic() - started < 10
    assert child.returncode() == -signal.SIGKILL


def test_watch_returns_none_when_a_stop_is_requested(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    try:
        supervisor.start(_child(supervisor, "sleeper", SLEEPER))
        threading.Timer(0.2, supervisor.stop_requested.set).start()
        assert supervisor.watch(poll=0.05) is None
    finally:
        supervisor.stop(grace=5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_children_do_not_outlive_a_killed_supervisor(tmp_path) -> None:
    """Even SIGKILL on the supervisor (no chance to clean up) leaves no orphan behind."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from specdec.cli.processes import Child, Supervisor
        supervisor = Supervisor({str(tmp_path)!r})
        child = supervisor.start(Child("sleeper", {SLEEPER!r}, Path({str(tmp_path)!r}) / "r.json",
                                       Path({str(tmp_path)!r}) / "sleeper.log"))
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=Path(processes.__file__).resolve().parents[2])  # the repo root
    child_pid = None
    try:
        child_pid = int(parent.stdout.readline())
        assert pid_alive(child_pid)
        parent.kill()
        parent.wait(timeout=10)
        assert wait_gone([child_pid], 10) == [], "the child outlived its supervisor"
    finally:
        if parent.poll() is None:
            parent.kill()
        if child_pid and pid_alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_wait_ready_reports_a_child_that_exits_early(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    try:
        child = supervisor.start(_child(supervisor, "crasher", [
            sys.executable, "-c", "import sys; print('cannot load the model'); sys.exit(3)"]))
        with pytest.raises(ProcessError, match=r"(?s)crasher \(pid \d+\) exited with code 3.*cannot load"):
            processes.wait_ready(child, timeout=30)
    finally:
        supervisor.stop(grace=5)


def test_wait_healthy_is_bounded_and_checks_the_real_health_service(tmp_path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(ProcessError, match="did not pass its health check"):
        processes.wait_healthy(address, timeout=1.0)
    assert time.monotonic() - started < 5

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(ProcessError, match="NOT_SERVING"):
            processes.wait_healthy(f"127.0.0.1:{port}", timeout=1.0)
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        processes.wait_healthy(f"127.0.0.1:{port}", timeout=10.0)
    finally:
        server.stop(None)


def test_port_in_use_sees_a_grpc_listener() -> None:
    """gRPC binds with SO_REUSEPORT: a second server would bind the same port without an error."""
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert processes.port_in_use("127.0.0.1", port)
        assert not processes.port_in_use("127.0.0.1", 0)

        result = invoke_cli("up", "--port", str(port), "--drafter-port", "0", "--verifier-port", "0")
        assert result.exit_code == 1
        assert f"127.0.0.1:{port} is already in use" in result.stderr and "--port" in result.stderr
    finally:
        server.stop(None)
    assert not processes.port_in_use("127.0.0.1", port)


def test_a_stop_signal_while_the_main_thread_holds_the_events_lock_does_not_hang(tmp_path) -> None:
    """A second Ctrl-C (or a signal inside Event.wait) arrives while the main thread holds
    stop_requested's lock; the handler must return and the stop still be requested."""
    import signal
    import threading

    supervisor = Supervisor(tmp_path)
    previous = signal.getsignal(signal.SIGTERM)
    supervisor.install_signal_handlers()
    try:
        handler = signal.getsignal(signal.SIGTERM)
        with supervisor.stop_requested._cond:  # what Event.wait / Event.set hold
            done = threading.Event()
            caller = threading.Thread(target=lambda: (handler(signal.SIGTERM, None), done.set()))
            caller.start()
            assert done.wait(5), "the signal handler blocked on the event's lock"
        assert supervisor.stop_requested.wait(5)
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_spawning_beside_live_grpc_threads_never_runs_grpc_fork_handlers(tmp_path) -> None:
    """A child spawned while this process has gRPC threads must not be fork()ed: gRPC's fork handlers
    would run and could restart its poller in the child, which close_fds then breaks (the child
    aborts before exec: grpc/grpc#43055, seen once as `up`'s orchestrator dying of SIGABRT). gRPC
    logs when a fork reaches its handlers while a call is in flight; with vfork nothing reaches them."""
    script = textwrap.dedent(f"""
        import sys, threading
        from concurrent import futures
        from pathlib import Path
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from specdec.cli.processes import Child, Supervisor
        server = grpc.server(futures.ThreadPoolExecutor(2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{{port}}"))
        done = threading.Event()
        def calls():
            while not done.is_set():
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        threading.Thread(target=calls, daemon=True).start()
        supervisor = Supervisor(Path({str(tmp_path)!r}))
        codes = []
        for i in range(30):
            child = supervisor.start(Child(f"c{{i}}", [sys.executable, "-S", "-c", "pass"],
                                           Path({str(tmp_path)!r}) / f"c{{i}}.json",
                                           Path({str(tmp_path)!r}) / f"c{{i}}.log"))
            codes.append(child.process.wait(timeout=30))
        done.set()
        print(codes, flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=Path(processes.__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str([0] * 30)
    assert "fork() handlers" not in result.stderr, "a child was fork()ed through gRPC's fork handlers"


def test_a_missing_program_still_fails_in_the_parent(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    with pytest.raises(FileNotFoundError, match="no-such-program"):
        supervisor.start(_child(supervisor, "missing", ["no-such-program-xyz", "--help"]))
    with pytest.raises(FileNotFoundError):
        supervisor.start(_child(supervisor, "missing2", ["./no/such/path"]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_a_child_whose_supervisor_is_gone_before_the_signal_is_armed_never_runs(tmp_path) -> None:
    """The launcher checks that its parent is the supervisor that started it: one that died before
    the signal was armed would leave an orphan otherwise."""
    marker = tmp_path / "ran"
    argv = processes.die_with_parent([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], os.environ)
    assert subprocess.run(argv, timeout=30).returncode == 0 and marker.exists()  # its parent: runs
    marker.unlink()
    argv[argv.index(str(os.getpid()))] = "1"  # a launcher whose supervisor was another process
    assert subprocess.run(argv, timeout=30).returncode == 128 + signal.SIGTERM
    assert not marker.exists()
