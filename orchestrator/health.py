"""Dependency-aware health: what the orchestrator last saw of its verifier, drafter and store, the
task that keeps a served orchestrator's gRPC health status in line with it, and the gate that
answers requests UNAVAILABLE while the verifier is not there.

SERVING (for "" and specdec.v1.GenerationService) iff
  - the verifier answers and is compatible: the vocabulary and tokenizer it had when the orchestrator
    started (token ids of running and stored requests mean the same then); a new context window or
    model id of the same vocabulary is taken over, and
  - the configured store answers (`store.ping()`): with Redis down every request would fail
    UNAVAILABLE naming the store, so a load balancer should send them elsewhere.
A drafter that is down, late or incompatible never makes the orchestrator NOT_SERVING: generation
goes on target-only, which is exact (orchestrator.failover); it shows in `Dependencies.status()`
(read by /metrics) and in one log line per change.

The monitor checks every `health_interval_s` (OrchestratorConfig): the standard health Check of
each engine (answered by the engine's server, not its model worker, so a busy engine is not a
down one), then its Info, compared with what the orchestrator works with (an engine restarted with
another model, even between two rounds, is seen at the next). Requests also report what they see
(a lost verifier, an engine that forgot a session, a drafter answer outside the vocabulary), so the
status can change between two rounds; a change is pushed to the health status at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from specdec.engine.api import ModelInfo
from specdec.errors import PeerUnavailable, StoreUnavailable
from specdec.rpc.grpc_support import set_health
from specdec.rpc.refusal import refusing
from specdec.rpc.status import status_for

log = logging.getLogger(__name__)

OK = "ok"
UNREACHABLE = "unreachable"
INCOMPATIBLE = "incompatible"
UNKNOWN = "unknown"  # not checked yet, or seen failing and not re-checked since
ABSENT = "absent"  # no drafter configured
STATES = (OK, UNREACHABLE, INCOMPATIBLE, UNKNOWN, ABSENT)
PROBE_TIMEOUT_S = 2.0  # a health Check or Info the monitor sends


class VerifierNotReady(PeerUnavailable):
    """The verifier does not answer (yet, or any more): UNAVAILABLE, retry shortly."""


class VerifierIncompatible(PeerUnavailable):
    """The verifier answers with another vocabulary or tokenizer than it had when the orchestrator
    started: UNAVAILABLE until one that fits answers."""


@dataclass
class DependencyState:
    """One dependency as last seen: its state (STATES), why, and since when (monotonic)."""

    name: str
    state: str = UNKNOWN
    detail: str = ""
    since: float = field(default_factory=time.monotonic)

    @property
    def ok(self) -> bool:
        return self.state == OK

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "detail": self.detail,
                "seconds": round(time.monotonic() - self.since, 3)}


class Dependencies:
    """The verifier, drafter and store as the orchestrator last saw them.

    `update` logs each change once (a warning when a dependency goes bad, info when it recovers) and
    tells the listeners (the health monitor pushes the new status at once)."""

    def __init__(self, *, drafter: bool) -> None:
        self.verifier = DependencyState("verifier")
        self.drafter = DependencyState("drafter", UNKNOWN if drafter else ABSENT)
        self.store = DependencyState("store")
        self.drafter_timeouts = 0  # drafter calls abandoned past their deadline, since start
        self._listeners: list[Callable[[], None]] = []

    def listen(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` after every change; returns the function that stops it."""
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback) if callback in self._listeners else None

    def update(self, dependency: DependencyState, state: str, detail: str = "") -> bool:
        """Set a dependency's state and why; True when the state changed (then logged once and
        announced; so is another reason for an incompatible engine), False when only the why did."""
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}")
        before = dependency.state
        if before == state and (state != INCOMPATIBLE or dependency.detail == detail):
            dependency.detail = detail
            return False
        dependency.state, dependency.detail, dependency.since = state, detail, time.monotonic()
        what = f"{dependency.name} {state}" + (f": {detail}" if detail else "")
        if state == OK:
            log.info("%s (was %s)", what, before)
        else:
            log.warning("%s", what)
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:  # a listener never breaks the caller
                log.exception("dependency listener failed")
        return True

    @property
    def serving(self) -> bool:
        """SERVING: the verifier answers and fits, and the store is not known to be down."""
        return self.verifier.ok and self.store.state != UNREACHABLE

    def status(self) -> dict[str, Any]:
        """{"serving": bool, "verifier" | "drafter" | "store": {"state", "detail", "seconds"},
        "drafter_timeouts": int} (read by /metrics)."""
        return {"serving": self.serving, "verifier": self.verifier.as_dict(),
                "drafter": self.drafter.as_dict(), "store": self.store.as_dict(),
                "drafter_timeouts": self.drafter_timeouts}


def verifier_change(info: ModelInfo, baseline: ModelInfo) -> str | None:
    """Why a verifier that answers with `info` cannot take over from `baseline` (its info when the
    orchestrator started), or None when it can: the vocabulary and tokenizer must be the same."""
    same_tokenizer = info.tokenizer_fingerprint == baseline.tokenizer_fingerprint
    if info.vocab_size == baseline.vocab_size and same_tokenizer:
        return None
    return (f"verifier incompatible: {info.model_id!r} has vocab_size {info.vocab_size} and tokenizer "
            f"{info.tokenizer_fingerprint[:12]}, the orchestrator started with {baseline.model_id!r} "
            f"(vocab_size {baseline.vocab_size}, tokenizer {baseline.tokenizer_fingerprint[:12]})")


async def answers(client: Any, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether an engine answers: its standard health Check (gRPC clients' `is_serving`), else its
    Info (in-process clients)."""
    is_serving = getattr(client, "is_serving", None)
    if is_serving is not None:
        return bool(await is_serving(timeout_s))
    try:
        async with asyncio.timeout(timeout_s):
            await client.info()
    except (PeerUnavailable, TimeoutError):
        return False
    return True


async def check_store(store: Any, dependencies: Dependencies) -> None:
    """`store.ping()` (a store without one always answers): StoreUnavailable → unreachable."""
    ping = getattr(store, "ping", None)
    if ping is None:
        dependencies.update(dependencies.store, OK)
        return
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            await ping()
    except StoreUnavailable as exc:
        dependencies.update(dependencies.store, UNREACHABLE, str(exc))
    except TimeoutError:
        dependencies.update(dependencies.store, UNREACHABLE, f"no answer within {PROBE_TIMEOUT_S:g} s")
    except Exception as exc:  # noqa: BLE001 - an unexpected failure is a store that does not work
        log.debug("store ping failed", exc_info=exc)
        dependencies.update(dependencies.store, UNREACHABLE, type(exc).__name__)
    else:
        dependencies.update(dependencies.store, OK)


class Monitored(Protocol):
    """What the monitor needs of the orchestrator (orchestrator.speculation.Orchestrator)."""

    dependencies: Dependencies

    async def check_dependencies(self) -> bool: ...

    async def ensure_serving(self) -> None: ...


class HealthMonitor:
    """Keeps a server's health status for "" and `service_names` equal to the orchestrator's
    `check_dependencies()`: one round every `interval_s`, and a push as soon as a dependency changes."""

    def __init__(self, orchestrator: Monitored, interval_s: float, service_names: Sequence[str]) -> None:
        if interval_s <= 0:
            raise ValueError(f"health_interval_s must be > 0, got {interval_s}")
        self.orchestrator = orchestrator
        self.interval_s = interval_s
        self.service_names = tuple(service_names)
        self.rounds = 0
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._unlisten: Callable[[], None] | None = None

    async def start(self, server: grpc.aio.Server) -> None:
        """NOT_SERVING until the first round says otherwise, then the rounds in the background."""
        await set_health(server, False, self.service_names)
        self._wake = asyncio.Event()
        self._unlisten = self.orchestrator.dependencies.listen(self._wake.set)
        self._task = asyncio.create_task(self._run(server), name="specdec-health-monitor")

    def stop(self) -> None:
        """Stop the rounds (the server's on_stop; the server reports NOT_SERVING by itself then)."""
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self, server: grpc.aio.Server) -> None:
        wake = self._wake
        assert wake is not None
        loop = asyncio.get_running_loop()
        while True:
            wake.clear()
            try:
                serving = await self.orchestrator.check_dependencies()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one failed round
                log.exception("health check round failed")
                serving = False
            self.rounds += 1
            if not await set_health(server, serving, self.service_names):
                return  # the server is stopping: its status is NOT_SERVING for good
            next_round = loop.time() + self.interval_s
            while (left := next_round - loop.time()) > 0:
                try:
                    async with asyncio.timeout(left):
                        await wake.wait()
                except TimeoutError:
                    break
                wake.clear()  # a dependency changed: report it now, the round comes as usual
                if not await set_health(server, self.orchestrator.dependencies.serving, self.service_names):
                    return


class ServingGate(grpc.aio.ServerInterceptor):
    """Answers calls of the services under `prefix` with UNAVAILABLE (the orchestrator's reason, e.g.
    "verifier not ready …", no internal address) while `ensure_serving()` refuses, before any work
    (a pair refused at start: INVALID_ARGUMENT, as a request would get)."""

    def __init__(self, orchestrator: Monitored, prefix: str) -> None:
        self.orchestrator = orchestrator
        self.prefix = prefix

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefix):
            return handler
        try:
            await self.orchestrator.ensure_serving()
        except Exception as exc:  # noqa: BLE001 - answered with its status, like any request error
            code, message = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.error("the serving check of %s failed", handler_call_details.method, exc_info=exc)
            return refusing(handler, code, message)
        return handler
