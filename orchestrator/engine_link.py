"""The orchestrator's link to its engines: their model info, availability and health, and what a
run's sessions report to and ask of them (sessions.EngineWatch).

It holds the drafter's back-off after a loss, the expected times (hence deadlines) of drafter
calls, the dependency states that health checks and /metrics read, and the model pair's
configuration (re-calibrated when an engine comes back with another model). Faults and their
handling: orchestrator.failover, orchestrator.health.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from orchestrator import health, scheduling
from orchestrator.adaptation import DrafterCallTimes
from orchestrator.clients.base import DrafterClient, VerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.failover import (
    Backoff,
    DrafterChanged,
    DrafterIncompatible,
    DrafterSlow,
    drafter_deadline,
    pair_config,
    vocabulary_mismatch,
)
from orchestrator.health import Dependencies, VerifierIncompatible, VerifierNotReady, verifier_change
from orchestrator.store import Store
from specdec.engine.api import ModelInfo
from specdec.errors import EngineError, InvalidRequest, PeerUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
RECHECK_S = 0.25  # a request re-checks a verifier not seen answering at most this often (ensure_serving)


class EngineLink:
    """One drafter (None = target only) and one verifier, as the orchestrator sees them."""

    def __init__(self, drafter: DrafterClient | None, verifier: VerifierClient, config: OrchestratorConfig,
                 store: Store) -> None:
        self.drafter = drafter
        self.drafter_calls = 0  # drafter calls running now, over every run (sessions.EngineWatch)
        self.verifier = verifier
        self.config = config  # the model pair's: calibrated by pair_config once both infos are read
        self.store = store  # its health is checked with the engines' (check_dependencies)
        self.target_info: ModelInfo | None = None
        self.draft_info: ModelInfo | None = None
        # Faults and health (health.py): what health, /metrics and the request gate read.
        self.dependencies = Dependencies(drafter=drafter is not None)
        self.refused: InvalidRequest | None = None  # why start() refused the pair (vocabulary mismatch)
        self._backoff = Backoff()
        self._baseline: ModelInfo | None = None  # the verifier's info at start: later infos must fit it
        self._base_config = config  # before any pair's calibration (re-applied when a model changes)
        self._drafter_recheck = False  # re-read the drafter's info before drafting again
        self._call_times = DrafterCallTimes()  # the expected time, hence the deadline, of drafter calls
        self._checks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Task]] = {}  # shared checks
        self._verifier_checked = 0.0  # monotonic time of the last re-read of the verifier's info

    async def start(self) -> None:
        """Read both services' info; refuse a pair whose vocabularies differ (InvalidRequest, also
        kept on `refused`; the orchestrator stays unstarted).

        An unreachable verifier: VerifierNotReady (UNAVAILABLE; the health monitor or the next
        request tries again). An unreachable drafter is not an error: generation runs target-only
        until it answers (its info is checked then).
        """
        deps = self.dependencies
        try:
            target = await self.verifier.info()
        except PeerUnavailable as exc:
            deps.update(deps.verifier, health.UNREACHABLE, str(exc))
            raise VerifierNotReady("verifier not ready: it does not answer yet; retry shortly") from None
        if self._baseline is not None and (change := verifier_change(target, self._baseline)) is not None:
            deps.update(deps.verifier, health.INCOMPATIBLE, change)
            raise VerifierIncompatible(change)
        draft = None
        if self.drafter is not None:
            try:
                draft = await self.drafter.info()
            except PeerUnavailable as exc:
                self.drafter_lost(exc)
            else:
                mismatch = vocabulary_mismatch(draft, target)
                if mismatch is not None:
                    deps.update(deps.drafter, health.INCOMPATIBLE, mismatch)
                    self.refused = InvalidRequest(mismatch)
                    raise self.refused
        self.refused = None
        self._baseline = self._baseline or target
        self.target_info = target
        if draft is not None:
            self._use_drafter(draft)
        deps.update(deps.verifier, health.OK)

    async def close(self) -> None:
        for client in (self.drafter, self.verifier):
            if client is not None:
                await client.close()

    @property
    def pair_key(self) -> str:
        draft = self.draft_info.model_id if self.draft_info else "-"
        target = self.target_info.model_id if self.target_info else "-"
        return f"{draft}|{target}"

    # the drafter's availability (failover.py) --------------------------------------------------
    async def drafter_ready(self) -> bool:
        """Whether to draft now: a drafter, not backing off after a loss, its info read and checked
        (again after it was lost or seen changing: it may have restarted with another model)."""
        if self.drafter is None or self._backoff.waiting:
            return False
        if self.draft_info is None or self._drafter_recheck:
            return await self._connect_drafter()
        return True

    async def _connect_drafter(self) -> bool:
        """(Re-)read the drafter's info and check it against the verifier's; True when it may draft.

        Unreachable: back off. Another vocabulary or tokenizer (a drafter restarted with another
        model): target-only steps, its info re-read after each back-off; its dependency state (one log
        line per change) says why. Whatever its context window, it caps the drafts (`_depth_cap`).
        One read serves every request that asks meanwhile.
        """
        return await self._once("drafter", self._read_drafter)

    async def _read_drafter(self) -> bool:
        assert self.drafter is not None and self.target_info is not None
        try:
            async with asyncio.timeout(health.PROBE_TIMEOUT_S):
                info = await self.drafter.info()
        except PeerUnavailable as exc:
            self.drafter_lost(exc)
            return False
        except TimeoutError:  # too busy to answer its Info: no use drafting with it for a while
            log.debug("the drafter's Info did not answer within %g s", health.PROBE_TIMEOUT_S)
            self._backoff.wait(self.config.drafter_retry_seconds)
            return False
        mismatch = vocabulary_mismatch(info, self.target_info)
        if mismatch is not None:
            deps = self.dependencies
            deps.update(deps.drafter, health.INCOMPATIBLE, f"{mismatch}; target-only steps")
            self._backoff.wait(self.config.drafter_retry_seconds)
            self._drafter_recheck = True
            return False
        self._use_drafter(info)
        return True

    def _use_drafter(self, info: ModelInfo) -> None:
        """Draft with this drafter from now on (its pair's calibration applied): it answered and fits."""
        assert self.target_info is not None
        if info != self.draft_info:
            if self.draft_info is not None:
                log.info("the drafter is now %s (context window %d)", info.model_id, info.max_context)
            self.draft_info = info
            self.config = pair_config(self._base_config, info, self.target_info)
        self._drafter_recheck = False
        deps = self.dependencies
        if not deps.drafter.ok:
            self._backoff.clear()  # it is back: draft at once
            deps.update(deps.drafter, health.OK)

    def drafter_lost(self, exc: Exception) -> None:
        """Back off after a lost, overloaded, late or changed drafter (failover.DrafterLoss)."""
        retry = self.config.drafter_retry_seconds
        deps = self.dependencies
        if isinstance(exc, DrafterChanged):  # its new info is in use already: only this iteration fell back
            return
        if isinstance(exc, DrafterIncompatible):  # logged once, by its dependency state
            self._backoff.wait(retry)
            self._drafter_recheck = True
            return
        if isinstance(exc, PeerUnavailable):  # it may come back as another drafter: re-read its info then
            self._backoff.wait(retry)
            self._drafter_recheck = True
            deps.update(deps.drafter, health.UNREACHABLE, f"{exc}; target-only, retry every {retry:g} s")
            return
        if isinstance(exc, DrafterSlow):
            deps.drafter_timeouts += 1
        self._backoff.lost(exc, retry)


    # engines re-checked after a restart, health (health.py) -------------------------------------
    async def ensure_serving(self) -> None:
        """Raise VerifierNotReady or VerifierIncompatible (UNAVAILABLE) unless the verifier was last
        seen answering and fitting. One not seen so is looked at again first (one check for every
        request that asks meanwhile, at most every RECHECK_S), so requests never wait for the health
        monitor's next round; the pair refused at start raises its InvalidRequest."""
        if self.dependencies.verifier.ok:
            return
        if self.target_info is None:
            await self._once("start", self.start)
            return
        if time.monotonic() - self._verifier_checked >= RECHECK_S:
            await self._once("verifier", self._recheck_verifier)
        self._raise_unless_verifier_ok()

    async def check_dependencies(self) -> bool:
        """One round of the health monitor (health.HealthMonitor): the verifier and the drafter (their
        health check, then their info: an engine restarted with another model is seen within a round
        even when its requests did not notice; a drafter is never a reason for NOT_SERVING) and the
        store (`ping`). Returns whether to report SERVING."""
        deps = self.dependencies
        if self.target_info is None:
            with contextlib.suppress(PeerUnavailable, InvalidRequest):  # in deps / `refused`
                await self._once("start", self.start)
        elif not await health.answers(self.verifier):
            deps.update(deps.verifier, health.UNREACHABLE, "no answer to its health check")
        else:
            await self._once("verifier", self._recheck_verifier)
        if self.drafter is not None and self.target_info is not None:
            if not await health.answers(self.drafter):
                deps.update(deps.drafter, health.UNREACHABLE, "no answer to its health check; target-only")
                self._drafter_recheck = True
            else:
                await self._connect_drafter()
        await health.check_store(self.store, deps)
        return deps.serving

    def dependency_status(self) -> dict:
        """The dependencies as last seen (health.Dependencies.status; read by /metrics)."""
        return self.dependencies.status()

    async def _recheck_verifier(self) -> None:
        """Re-read the verifier's info: OK when it has the vocabulary and tokenizer it had at start (a
        new context window or model id is taken over), else incompatible; unreachable when it does not
        answer. An Info that does not answer in time (a busy verifier) changes nothing."""
        deps = self.dependencies
        self._verifier_checked = time.monotonic()
        try:
            async with asyncio.timeout(health.PROBE_TIMEOUT_S):
                info = await self.verifier.info()
        except PeerUnavailable as exc:
            deps.update(deps.verifier, health.UNREACHABLE, str(exc))
            return
        except TimeoutError:
            return
        assert self._baseline is not None
        change = verifier_change(info, self._baseline)
        if change is not None:
            deps.update(deps.verifier, health.INCOMPATIBLE, change)
            return
        if info != self.target_info:
            log.info("the verifier is now %s (context window %d)", info.model_id, info.max_context)
            self.target_info = info
            if self.draft_info is not None:
                self.config = pair_config(self._base_config, self.draft_info, info)
        deps.update(deps.verifier, health.OK)

    def _raise_unless_verifier_ok(self) -> None:
        state = self.dependencies.verifier
        if state.state == health.INCOMPATIBLE:
            raise VerifierIncompatible(state.detail)
        if not state.ok:
            raise VerifierNotReady("verifier not ready: it does not answer; retry shortly")

    async def _once(self, key: str, check: Callable[[], Awaitable[T]]) -> T:
        """check() once for every caller that asks while it runs (e.g. one Info for a burst)."""
        loop = asyncio.get_running_loop()
        entry = self._checks.get(key)
        if entry is None or entry[0] is not loop or entry[1].done():
            entry = (loop, loop.create_task(check()))
            self._checks[key] = entry
        return await asyncio.shield(entry[1])

    # sessions.EngineWatch: what runs report and ask about the engines
    @property
    def target_vocab_size(self) -> int | None:
        return self.target_info.vocab_size if self.target_info is not None else None

    def drafter_expected(self, passes: int, catch_up: int) -> float:
        return self._call_times.expected(passes, catch_up, self.config.drafter_timeout_floor_s)

    def drafter_deadline(self, passes: int, catch_up: int) -> float:
        return drafter_deadline(self.drafter_expected(passes, catch_up), self.config)

    def drafter_took(self, passes: int, catch_up: int, seconds: float, cut_off: bool = False) -> None:
        self._call_times.observe(passes, catch_up, seconds, cut_off=cut_off)

    def verifier_took(self, passes: int, catch_up: int, seconds: float) -> None:
        self._call_times.observe_verifier(passes, catch_up, seconds)

    async def drafter_changed(self) -> EngineError | None:
        """The drafter forgot a session or refused a call: re-read its info. Why the iteration must not
        draft (it is away, incompatible, or changed: e.g. a shorter context), or None (as it was)."""
        before = self.draft_info
        if not await self._connect_drafter():
            state = self.dependencies.drafter
            if state.state == health.INCOMPATIBLE:
                return DrafterIncompatible(state.detail)
            return PeerUnavailable("drafter unavailable")
        info = self.draft_info
        if info != before and info is not None:
            return DrafterChanged(f"the drafter is now {info.model_id!r} (context window {info.max_context})")
        return None

    async def verifier_changed(self) -> None:
        """The verifier forgot a session (it may have restarted): re-read its info; raise
        VerifierIncompatible / VerifierNotReady when it may not be used."""
        await self._once("verifier", self._recheck_verifier)
        self._raise_unless_verifier_ok()

    def verifier_lost(self, exc: PeerUnavailable) -> None:
        """A verifier call failed as unreachable: not SERVING until it is seen answering again."""
        if isinstance(exc, (VerifierNotReady, VerifierIncompatible)):
            return
        deps = self.dependencies
        if deps.verifier.ok:
            deps.update(deps.verifier, health.UNKNOWN, f"a call failed: {exc}")


    # context windows ---------------------------------------------------------------------------
    def max_context(self) -> int:
        return self.target_info.max_context if self.target_info else 0

    def depth_cap(self, committed_len: int) -> int:
        infos = (self.target_info, self.draft_info)
        return scheduling.depth_cap(committed_len, (info.max_context for info in infos if info is not None))
