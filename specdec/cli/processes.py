"""Process management for `specdec up`: spawn, pin, health-wait, supervise and stop the services.

Kept apart from the CLI so that the CLI stays a parser/adapter and so that tests can start the
same child processes the way `up` does. Children:
- run `python -m specdec.cli serve <role> ...` (the very command a user would run by hand);
- get their own session (a terminal Ctrl-C reaches only the supervisor, which then stops them in
  order) and, on Linux, a parent-death signal (armed by a launcher they exec first: die_with_parent),
  so they never outlive a supervisor that was killed;
- report where they listen through a small JSON "ready file", which lets them bind port 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_ORCHESTRATOR_PORT = 50050
DEFAULT_DRAFTER_PORT = 50051
DEFAULT_VERIFIER_PORT = 50052
DEFAULT_HTTP_PORT = 8000  # `up`'s OpenAI-compatible HTTP API (vLLM's and TGI's usual port)
DEFAULT_ORCHESTRATOR_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_ORCHESTRATOR_PORT}"

_PR_SET_PDEATHSIG = 1


class ProcessError(RuntimeError):
    """A child failed to start, died, or did not become healthy in time (message says which)."""


# ---------------------------------------------------------------- cores and pinning


def parse_cores(text: str | None) -> list[int] | None:
    """'0,2-3' → [0, 2, 3]; None/'' → None (no pinning). Raises ValueError on bad syntax."""
    if text is None or not text.strip():
        return None
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            low, high = (int(x) for x in part.split("-", 1))
            if high < low:
                raise ValueError(f"bad core range {part!r}")
            cores.update(range(low, high + 1))
        else:
            cores.add(int(part))
    if any(core < 0 for core in cores):
        raise ValueError(f"core numbers must be >= 0, got {text!r}")
    return sorted(cores)


def format_cores(cores: Iterable[int] | None) -> str:
    return ",".join(str(c) for c in sorted(cores)) if cores is not None else "any"


def available_cores() -> list[int]:
    """Cores this process may run on (sched_getaffinity where the OS has it)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def default_core_split(cores: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """Disjoint (drafter, verifier) core sets: the small draft model gets a quarter (at least one).

    With a single core both get it (nothing to split); with two cores it is one each.
    """
    cores = sorted(cores) if cores is not None else available_cores()
    if len(cores) < 2:
        return list(cores), list(cores)
    n_draft = max(1, len(cores) // 4)
    return list(cores[:n_draft]), list(cores[n_draft:])


def pin_current_process(cores: Sequence[int]) -> None:
    """Restrict this process (all its threads) to `cores`; clear error if the OS lacks it."""
    if not hasattr(os, "sched_setaffinity"):
        raise ProcessError("pinning to cores (--cores) needs os.sched_setaffinity (Linux)")
    allowed = set(available_cores())
    unknown = [c for c in cores if c not in allowed]
    if unknown:
        raise ProcessError(f"cores {unknown} are not available to this process (available: "
                           f"{format_cores(allowed)})")
    os.sched_setaffinity(0, set(cores))


# ---------------------------------------------------------------- ready files and health


def write_ready_file(path: str | Path, payload: dict) -> None:
    """Atomically write JSON (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ready-", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        json.dump(payload, handle)
    os.replace(tmp, path)


def read_ready_file(path: str | Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def port_in_use(host: str, port: int) -> bool:
    """Whether host:port is taken. gRPC binds with SO_REUSEPORT, so a second server on a busy port
    would start "fine" and silently share its traffic; a plain bind without that flag tells."""
    import socket

    if port == 0:
        return False
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT leftovers of a restart
        try:
            sock.bind((host.strip("[]"), port))
        except OSError:
            return True
    return False


def check_health(address: str, timeout: float = 1.0, service: str = "", security: Any = None) -> str:
    """One gRPC health Check → status name ('SERVING', …); raises grpc.RpcError when unreachable.

    `security` (specdec.rpc.security.ClientSecurity): TLS / mTLS of a server that serves them
    (health needs no token); None = plaintext.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = security.sync_channel(address) if security is not None else grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_healthy(address: str, timeout: float, *, alive: Callable[[], bool] | None = None,
                 name: str = "service", interval: float = 0.1, abort: threading.Event | None = None,
                 security: Any = None) -> None:
    """Poll the gRPC health check until SERVING; bounded by `timeout` seconds.

    `alive` lets the caller stop waiting early when the process behind the address has died;
    `abort` when the user asked to stop; `security` as for check_health.
    """
    import grpc

    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        if abort is not None and abort.is_set():
            raise ProcessError(f"stopped while waiting for {name}")
        if alive is not None and not alive():
            raise ProcessError(f"{name} exited before passing its health check at {address}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProcessError(f"{name} at {address} did not pass its health check within {timeout:.0f}s "
                               f"(last: {last})")
        try:
            status = check_health(address, timeout=min(1.0, max(remaining, 0.05)), security=security)
            if status == "SERVING":
                return
            last = status
        except grpc.RpcError as error:
            last = f"{error.code().name}: {error.details()}"
        time.sleep(interval)


# ---------------------------------------------------------------- children


# The parent-death signal is armed by a small launcher the child execs first, not by a preexec_fn:
# a preexec_fn makes subprocess fork() instead of vfork(), so gRPC's fork handlers run and, in a
# supervisor whose health checks left gRPC threads behind, restart its poller in the child, whose
# descriptors close_fds then closes: the child aborted before exec ("epoll_wait error: Bad file
# descriptor", grpc/grpc#43055; it killed `up`'s orchestrator once in a CI run). The launcher arms
# PR_SET_PDEATHSIG (kept across exec), checks that the parent that started it is still its parent
# (it may have died before the signal was armed: then it exits as if signalled), then execs the
# child's own argv in its place.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    f"ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, signal.SIGTERM, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(128 + signal.SIGTERM)\n"
    "os.execv(sys.argv[2], sys.argv[3:])\n"
)


def die_with_parent(argv: Sequence[str], env: Mapping[str, str], cwd: str | Path | None = None) -> list[str]:
    """argv that runs `argv` with a SIGTERM armed for when this process dies (Linux; elsewhere argv
    itself). The program is looked up here (on env's PATH, or from cwd when it names a path), so a
    missing one still raises FileNotFoundError in the parent, as Popen does."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    if os.sep in argv[0]:
        program: str | None = str(Path(cwd or ".", argv[0]).absolute())
        if not os.access(program, os.X_OK):
            program = None
    else:
        program = shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if program is None:
        raise FileNotFoundError(f"no such program: {argv[0]!r}")
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), program, *argv]


def cli_command(*args: str) -> list[str]:
    """argv that runs this package's CLI with the current interpreter (no install needed)."""
    return [sys.executable, "-m", "specdec.cli", *args]


@dataclass
class Child:
    """One supervised service process."""

    name: str
    argv: list[str]
    ready_file: Path
    log_path: Path
    cores: list[int] | None = None
    process: subprocess.Popen | None = None
    address: str | None = None
    info: dict = field(default_factory=dict)  # the child's ready file (address, pid, metrics_url, …)
    _log_handle: object | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def returncode(self) -> int | None:
        return self.process.poll() if self.process else None

    def log_tail(self, lines: int = 15, max_bytes: int = 16384) -> str:
        """The last lines of the child's log (read from its end: logs of long runs grow)."""
        try:
            with open(self.log_path, "rb") as handle:
                handle.seek(max(0, handle.seek(0, os.SEEK_END) - max_bytes))
                text = handle.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


def describe_exit(child: Child, lines: int = 15) -> str:
    """'drafter (pid 12) exited with code 1' / '… was killed by SIGKILL', plus the last `lines` of its log."""
    code = child.returncode()
    if code is None:
        how = "is still running"
    elif code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    message = f"{child.name} (pid {child.pid}) {how}"
    tail = child.log_tail(lines) if lines > 0 else ""
    if tail:
        message += f"; last lines of {child.log_path}:\n{tail}"
    return message


def exit_reason(child: Child) -> str:
    """describe_exit in one line (a supervisor's console): a signal says why by itself; an exit code
    comes with the last line of the child's log (usually its error), then where the log is."""
    message = describe_exit(child, lines=0)
    code = child.returncode()
    last = child.log_tail(1).strip() if code is not None and code > 0 else ""
    if last:
        message += f" ({last})"
    return f"{message}; log: {child.log_path}"


# glibc gives each thread that allocates its own malloc arena (up to 8 per core). The engines' worker
# pools run batched passes of ever-different sizes on many threads, and the memory those free stays
# in each thread's arena: at 32 clients `up` grew from 5.9 to 13.2 GB in 90 s, and to 7.7 GB with 2
# arenas, at the same throughput (bench/RESULTS.md, "Serving with pre-drafted only"). A value set
# by the user wins.
CHILD_ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "MALLOC_ARENA_MAX": "2"}


def spawn(child: Child, env: dict[str, str] | None = None, cwd: str | Path | None = None) -> Child:
    """Start the child with its output in its log file (ready file cleared first)."""
    child.ready_file.unlink(missing_ok=True)
    child.log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(child.log_path, "ab", buffering=0)  # noqa: SIM115 - closed in Supervisor.stop
    child._log_handle = log
    full_env = {**CHILD_ENV_DEFAULTS, **(os.environ if env is None else env)}
    child.process = subprocess.Popen(
        die_with_parent(child.argv, full_env, cwd), stdin=subprocess.DEVNULL, stdout=log,
        stderr=subprocess.STDOUT, env=full_env, cwd=cwd, start_new_session=True,
    )
    if child.cores is not None and hasattr(os, "sched_setaffinity"):
        # The child pins itself too (--cores); doing it here as well closes the window before it does.
        with contextlib.suppress(OSError):
            os.sched_setaffinity(child.process.pid, set(child.cores))
    return child


def wait_ready(child: Child, timeout: float, abort: threading.Event | None = None,
               security: Any = None) -> str:
    """Wait for the child's ready file, then for its health check (over `security`, as for
    check_health); returns its address."""
    deadline = time.monotonic() + timeout
    while True:
        if abort is not None and abort.is_set():
            raise ProcessError(f"stopped while waiting for {child.name}")
        payload = read_ready_file(child.ready_file)
        if payload and payload.get("address"):
            child.address = str(payload["address"])
            child.info = payload
            break
        if not child.alive():
            raise ProcessError(describe_exit(child))
        if time.monotonic() > deadline:
            raise ProcessError(f"{child.name} did not start listening within {timeout:.0f}s "
                               f"(log: {child.log_path})")
        time.sleep(0.05)
    try:
        wait_healthy(child.address, max(1.0, deadline - time.monotonic()), alive=child.alive, name=child.name,
                     abort=abort, security=security)
    except ProcessError as error:
        if not child.alive():
            raise ProcessError(describe_exit(child)) from error
        raise
    return child.address


def stop_process(process: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM, wait up to `grace` seconds, then SIGKILL; always reaps the process."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


# ---------------------------------------------------------------- restarts


@dataclass(frozen=True)
class RestartPolicy:
    """How a supervisor restarts one service that died: after a back-off that doubles from
    `first_delay_s` up to `max_delay_s` (a crash loop neither spins nor floods the log), back to
    `first_delay_s` once the service had run `reset_after_s` seconds; at most `limit` restarts in all
    (None: no limit). Past the limit, a `fatal` service ends supervision; another stays down."""

    limit: int | None = None
    fatal: bool = True
    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    reset_after_s: float = 60.0

    def next_delay(self, previous: float, healthy_for: float) -> float:
        """The back-off before the next restart, after `previous` and `healthy_for` seconds of running."""
        if previous <= 0 or healthy_for >= self.reset_after_s:
            return self.first_delay_s
        return min(previous * 2, self.max_delay_s)


@dataclass
class SupervisorEvent:
    """What `Supervisor.supervise` tells its caller: `kind` is died (a restart follows in `delay`
    seconds), restarting (the new process is up, not yet healthy), healthy (it passed its health
    check) or gave_up (past its policy's limit: left down, or the end when the policy is fatal)."""

    kind: str
    child: Child
    restarts: int  # restarts of this service so far
    policy: RestartPolicy
    reason: str = ""  # died, gave_up: why (exit_reason)
    delay: float = 0.0  # died: seconds before the restart


_RUNNING, _WAITING, _STARTING, _DOWN = "running", "waiting", "starting", "down"


@dataclass
class _Watched:
    """A supervised service's state between two looks (Supervisor.supervise)."""

    policy: RestartPolicy
    phase: str = _RUNNING
    restarts: int = 0
    delay: float = 0.0
    due: float = 0.0  # waiting: when to restart
    deadline: float = 0.0  # starting: when to give the restart up
    healthy_since: float | None = field(default_factory=time.monotonic)


def _answers_health(child: Child, security: Any) -> bool:
    """One short gRPC health Check of a (re)started child: SERVING or not (never raises)."""
    import grpc

    try:
        return check_health(child.address or "", timeout=1.0, security=security) == "SERVING"
    except grpc.RpcError:
        return False


def _url_port(url: Any) -> int | None:
    """The port of an http(s) URL from a child's ready file (None when there is none)."""
    from urllib.parse import urlsplit

    if not isinstance(url, str):
        return None
    try:
        return urlsplit(url).port
    except ValueError:
        return None


class Supervisor:
    """A set of children started together and stopped together (reverse start order)."""

    def __init__(self, log_dir: str | Path | None = None) -> None:
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="specdec-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.stop_requested = threading.Event()

    def child(self, name: str, serve_args: Sequence[str], cores: list[int] | None = None) -> Child:
        """Describe a `specdec serve ...` child with its ready and log files under log_dir."""
        ready = self.log_dir / f"{name}.ready.json"
        argv = cli_command("serve", *serve_args, "--ready-file", str(ready))
        log_path = self.log_dir / f"{name}.log"
        return Child(name=name, argv=argv, ready_file=ready, log_path=log_path, cores=cores)

    def start(self, child: Child, env: dict[str, str] | None = None) -> Child:
        self.children.append(child)
        return spawn(child, env=env)

    def restart(self, dead: Child, env: dict[str, str] | None = None) -> Child:
        """Start a dead child again in its place, on the ports it had bound (its peers and clients keep
        the addresses, also of its HTTP API and /metrics when those were chosen by the OS)."""
        argv = list(dead.argv)
        for flag, port in (("--port", dead.address.rsplit(":", 1)[1] if dead.address else None),
                           ("--http-port", _url_port(dead.info.get("http_url"))),
                           ("--metrics-port", _url_port(dead.info.get("metrics_url")))):
            if port is not None and flag in argv:
                argv[argv.index(flag) + 1] = str(port)
        if dead._log_handle is not None:
            with contextlib.suppress(Exception):
                dead._log_handle.close()
        fresh = Child(name=dead.name, argv=argv, ready_file=dead.ready_file, log_path=dead.log_path,
                      cores=dead.cores, address=dead.address, info=dict(dead.info))
        self.children[self.children.index(dead)] = fresh
        return spawn(fresh, env=env)

    def first_dead(self) -> Child | None:
        for child in self.children:
            if child.process is not None and child.process.poll() is not None:
                return child
        return None

    def watch(self, poll: float = 0.2) -> Child | None:
        """Block until a stop is requested (→ None) or a child exits (→ that child)."""
        while not self.stop_requested.is_set():
            dead = self.first_dead()
            if dead is not None:
                return dead
            self.stop_requested.wait(poll)
        return None

    def supervise(self, policies: Mapping[str, RestartPolicy], on_event: Callable[[SupervisorEvent], None],
                  *, startup_timeout: float, security: Any = None,
                  healthy: Callable[[Child], bool] | None = None, poll: float = 0.2) -> Child | None:
        """Keep the children running until a stop is requested (→ None): each one that dies is started
        again on its ports after its policy's back-off (`restart`), and healthy again once its ready
        file is there and its health check says SERVING (`healthy`, by default one gRPC Check over
        `security`). Every death, restart, recovery and give-up is told to `on_event`.

        Returns the child whose death ends supervision: one past its policy's limit whose policy is
        `fatal` (a non-fatal one is left down). A restart that does not get healthy within
        `startup_timeout` seconds is stopped and counts as another death."""
        check = healthy or (lambda child: _answers_health(child, security))
        states = {child.name: _Watched(policies.get(child.name, RestartPolicy())) for child in self.children}
        while not self.stop_requested.is_set():
            for child in list(self.children):  # a restart replaces its child in the list
                state = states.setdefault(child.name, _Watched(policies.get(child.name, RestartPolicy())))
                if self._supervise_one(child, state, on_event, startup_timeout, check):
                    return child
            self.stop_requested.wait(poll)
        return None

    def _supervise_one(self, child: Child, state: _Watched, on_event: Callable[[SupervisorEvent], None],
                       startup_timeout: float, check: Callable[[Child], bool]) -> bool:
        """One look at one child (restarting it when its back-off is over); True: supervision ends."""
        now = time.monotonic()
        policy = state.policy
        if state.phase == _RUNNING and not child.alive():
            return self._died(child, state, on_event, exit_reason(child), now)
        if state.phase == _STARTING:
            if not child.alive():
                return self._died(child, state, on_event, exit_reason(child), now)
            payload = read_ready_file(child.ready_file)
            if payload and payload.get("address"):
                child.address, child.info = str(payload["address"]), payload
                if check(child):
                    state.phase, state.healthy_since = _RUNNING, time.monotonic()
                    on_event(SupervisorEvent("healthy", child, state.restarts, policy))
                    return False
            if now > state.deadline:
                reason = (f"{child.name} (pid {child.pid}) did not pass its health check within "
                          f"{startup_timeout:g} s of its restart; log: {child.log_path}")
                if child.process is not None:
                    stop_process(child.process, grace=2.0)
                return self._died(child, state, on_event, reason, now)
        if state.phase == _WAITING and now >= state.due:
            fresh = self.restart(child)
            state.restarts += 1
            state.phase, state.deadline = _STARTING, time.monotonic() + startup_timeout
            on_event(SupervisorEvent("restarting", fresh, state.restarts, policy))
        return False

    def _died(self, child: Child, state: _Watched, on_event: Callable[[SupervisorEvent], None],
              reason: str, now: float) -> bool:
        """A death: schedule the restart after the back-off, or give up (True: supervision ends)."""
        policy = state.policy
        if policy.limit is not None and state.restarts >= policy.limit:
            state.phase = _DOWN
            on_event(SupervisorEvent("gave_up", child, state.restarts, policy, reason=reason))
            return policy.fatal
        healthy_for = now - state.healthy_since if state.healthy_since is not None else 0.0
        state.delay = policy.next_delay(state.delay, healthy_for)
        state.phase, state.due, state.healthy_since = _WAITING, now + state.delay, None
        on_event(SupervisorEvent("died", child, state.restarts, policy, reason=reason, delay=state.delay))
        return False

    def stop(self, grace: float = 10.0) -> None:
        """Stop every child: the newest first (the orchestrator: it drains its requests while the
        services it talks to still answer), then all the others together."""
        running = [c for c in reversed(self.children) if c.process is not None]
        if running:
            stop_process(running[0].process, grace)
        for child in running[1:]:
            if child.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGTERM)
        for child in running[1:]:
            stop_process(child.process, grace)
        for child in self.children:
            if child._log_handle is not None:
                with contextlib.suppress(Exception):
                    child._log_handle.close()
            child.ready_file.unlink(missing_ok=True)

    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM → request a stop (main thread only).

        The handler runs on the main thread between two bytecodes, possibly while that thread holds
        stop_requested's lock (inside Event.wait, or inside a first handler's set on a second
        Ctrl-C): Event.set there would wait for itself forever. So a short thread sets it.
        """
        def handler(signum, frame):  # noqa: ARG001
            if not self.stop_requested.is_set():
                threading.Thread(target=self.stop_requested.set, name="stop-request", daemon=True).start()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
