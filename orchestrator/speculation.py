"""The orchestrator's request loop: speculation iterations over a drafter and a verifier client.

One iteration (`Orchestrator._iterate`) reads top to bottom: decide what to draft
(scheduling.plan_iteration) → draft, or take the block pre-drafted while the last one was
verified (pipeline.py) → one target pass verifies it (the next block is pre-drafted meanwhile
when pipelined) → the emitted tokens pass the stop conditions (output.py) → the record, the
statistics and the calibration counts (accounting.py). A drafter lost mid-iteration turns the
iteration into a target-only step (failover.py). Calls to both services follow the session
protocol (sessions.py); a request's checks, state and stored record are in run.py.

Exactness never depends on anything decided here (docs/algorithms.md §8): every iteration's
emitted tokens are distributed as the target's given the committed prefix, whatever the method,
k, a, tree shape, or whether the drafter answered. Each iteration's randomness is keyed on
(seed, position of its first token), positions only grow, so a discarded attempt (drafter lost
mid-iteration) or a resumed request draws fresh, independent randomness for what it emits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, TypeVar

import torch

from orchestrator import health, pipeline, scheduling
from orchestrator.accounting import CALIBRATION_FLUSH_ITERATIONS, account, flush_calibration
from orchestrator.adaptation import (
    OPENING,
    PREDRAFTED_OPENING,
    STEADY_CATCH_UP,
    DrafterCallTimes,
    DraftLength,
    Observation,
    PairEstimates,
)
from orchestrator.clients.base import DrafterClient, VerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.failover import (
    Backoff,
    DrafterChanged,
    DrafterDown,
    DrafterIncompatible,
    DrafterSlow,
    both,
    drafter_deadline,
    pair_config,
    vocabulary_mismatch,
)
from orchestrator.health import Dependencies, VerifierIncompatible, VerifierNotReady, verifier_change
from orchestrator.output import absorb, context_full, text_delta
from orchestrator.run import Run, Timeline, adaptable, check_prompt, check_request, new_run
from orchestrator.sessions import RunSessions, draft_rows
from orchestrator.store import RequestRecord, Store, open_store
from specdec.engine.api import (
    AlreadyExists,
    DraftResult,
    EngineError,
    InvalidRequest,
    ModelInfo,
    NotFound,
    Overloaded,
    PeerUnavailable,
    StillRunning,
    StoreUnavailable,
    VerifyOutcome,
)
from specdec.generation import GenerationChunk, GenerationRequest, GenerationResult, IterationRecord
from specdec.methods import TARGET_ONLY_VERIFICATION, get_method
from specdec.rpc.security import ANONYMOUS
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams

if TYPE_CHECKING:
    from orchestrator.tracing import IterationProbe, LoopObserver, RequestProbe

log = logging.getLogger(__name__)

T = TypeVar("T")
RECHECK_S = 0.25  # a request re-checks a verifier not seen answering at most this often (ensure_serving)


class Orchestrator:
    """Generation over one drafter (None = target only) and one verifier.

    on_iteration, if given, is called with every IterationRecord as soon as it is complete;
    the records are also on GenerationResult.iterations. observer, if given, is a
    orchestrator.tracing.LoopObserver (spans and metrics of requests, iterations and calls).
    At most config.max_active_requests requests run at once (`admission`, RequestSlots).
    """

    def __init__(
        self,
        drafter: DrafterClient | None,
        verifier: VerifierClient,
        config: OrchestratorConfig | None = None,
        *,
        store: Store | None = None,
        on_iteration: Callable[[IterationRecord], None] | None = None,
        observer: LoopObserver | None = None,
    ) -> None:
        self.drafter = drafter
        self.verifier = verifier
        self.config = config or OrchestratorConfig()
        if store is None:
            store = open_store(self.config.store_url, self.config.request_ttl_seconds)
        self.store = store
        self.on_iteration = on_iteration
        self.observer = observer
        self.target_info: ModelInfo | None = None
        self.draft_info: ModelInfo | None = None
        self._backoff = Backoff()
        self._estimates: dict[str, PairEstimates] = {}  # per model pair and method (adaptation.py)
        # Faults and health (health.py): what health, /metrics and the request gate read.
        self.dependencies = Dependencies(drafter=drafter is not None)
        self.refused: InvalidRequest | None = None  # why start() refused the pair (vocabulary mismatch)
        self._baseline: ModelInfo | None = None  # the verifier's info at start: later infos must fit it
        self._base_config = self.config  # before any pair's calibration (re-applied when a model changes)
        self._drafter_recheck = False  # re-read the drafter's info before drafting again
        self._call_times = DrafterCallTimes()  # the expected time, hence the deadline, of drafter calls
        self._checks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Task]] = {}  # shared checks
        self._verifier_checked = 0.0  # monotonic time of the last re-read of the verifier's info
        self.admission = RequestSlots(self.config.max_active_requests, self.config.queue_timeout_s)

    # lifecycle ---------------------------------------------------------------------------------
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
                self._drafter_lost(exc)
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
        await self.store.close()

    @property
    def pair_key(self) -> str:
        draft = self.draft_info.model_id if self.draft_info else "-"
        target = self.target_info.model_id if self.target_info else "-"
        return f"{draft}|{target}"

    # public API --------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest, *, owner: str = ANONYMOUS) -> GenerationResult:
        return await _last_result(self.generate_stream(request, owner=owner))

    async def generate_stream(
        self, request: GenerationRequest, *, owner: str = ANONYMOUS
    ) -> AsyncIterator[GenerationChunk]:
        """The request's chunks; it first waits for a request slot (Overloaded when none frees up in
        time), held until the stream ends or is closed. Its record is created bound to `owner` (the
        caller's identity, specdec.rpc.security): a request_id that already has one is refused
        (AlreadyExists), whoever owns it, and its stored progress is left as it was."""
        async with self.admission.slot():
            if self.target_info is None:
                await self.start()
            run = await self._new_run(request, owner)
            async with contextlib.aclosing(self._run(run)) as chunks:  # closed with this stream
                async for chunk in chunks:
                    yield chunk

    async def resume(self, request_id: str, *, owner: str = ANONYMOUS) -> GenerationResult:
        """Continue a stored request from its stored tokens (a finished one is returned as is)."""
        return await _last_result(self.resume_stream(request_id, owner=owner))

    async def resume_stream(
        self, request_id: str, *, owner: str = ANONYMOUS
    ) -> AsyncIterator[GenerationChunk]:
        """As generate_stream, from `owner`'s stored request (it takes a request slot the same way).

        The first chunk carries the tokens stored so far, so the chunks put together are the whole
        output. NotFound when `owner` has no such request (another owner's reads the same);
        StillRunning while a live run holds the record's lease (docs/reliability.md).
        """
        async with self.admission.slot():
            if self.target_info is None:
                await self.start()
            record = await self.store.get_request(request_id)
            if record is None or record.owner != owner:
                raise NotFound(f"request_id: no stored request {request_id!r}")
            run = Run.from_record(record)
            if record.status == "done":
                run.finish_reason = record.finish_reason or "length"
                run.text = record.text
                yield GenerationChunk(list(run.generated), run.text, run.result())
                return
            run.text = await self.verifier.decode(run.generated) if run.generated else ""
            run.text_sent = len(run.text)
            await self._claim(run, record)
            stored = GenerationChunk(list(run.generated), run.text) if run.generated else None
            async with contextlib.aclosing(self._run(run, stored)) as chunks:
                async for chunk in chunks:
                    yield chunk

    def admission_stats(self) -> dict[str, int]:
        """Requests running, waiting for a slot, refused so far, and the limit (read by /metrics)."""
        slots = self.admission
        return {"active": slots.active, "waiting": slots.waiting, "rejected": slots.rejected,
                "limit": slots.limit}

    # request set-up ----------------------------------------------------------------------------
    async def _new_run(self, request: GenerationRequest, owner: str) -> Run:
        target = self.target_info
        assert target is not None
        method = check_request(request, self.config, target)
        prompt_ids = await self._prompt_ids(request)
        check_prompt(prompt_ids, target)
        run = new_run(request, method=method, prompt_ids=prompt_ids,
                      rank_acceptance=await self._rank_acceptance(method), config=self.config, target=target)
        run.owner = owner
        if not await self.store.create_request(self._record(run, "running")):
            raise AlreadyExists(f"request_id {run.request_id!r} already exists; Resume continues it")
        return run

    async def _claim(self, run: Run, record: RequestRecord) -> None:
        """Take a stored request over for this run: refused while another run holds its lease, and
        by compare-and-set, so of two Resumes racing for it one wins."""
        now = time.time()
        if record.lease_until > now:
            raise StillRunning(
                f"request_id {run.request_id!r} is still running (last progress "
                f"{now - record.updated_at:.1f} s ago); Resume it once it has stopped, or after "
                f"{record.lease_until - now:.1f} s without progress"
            )
        claimed = self._record(run, "running")
        if not await self.store.replace_request(claimed, if_updated_at=record.updated_at):
            raise StillRunning(f"request_id {run.request_id!r} was taken over by another run just now")

    async def _run(self, run: Run, first: GenerationChunk | None = None) -> AsyncIterator[GenerationChunk]:
        """`first`, then the run's chunks. A run closed before its end (its client went away) hands
        its lease back at once, so the request can be resumed without waiting for the lease to pass."""
        stream = self._drive(run)
        ended = False
        try:
            if first is not None:
                yield first
            async for chunk in stream:
                yield chunk
            ended = True
        except Exception:
            ended = True  # _drive recorded the failure, which holds no lease
            raise
        finally:
            await stream.aclose()
            if not ended and run.finish_reason is None:
                await self._release(run)

    async def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_ids and request.prompt:
            raise InvalidRequest("prompt: give either prompt text or prompt_ids, not both")
        if request.prompt_ids:
            return [int(t) for t in request.prompt_ids]
        if request.messages:  # checked (check_request): the only prompt, within the size limits
            ids = await self.verifier.apply_chat_template(list(request.messages), self.config.chat_template)
            if ids:
                return list(ids)
        if request.prompt:  # its size was checked first (check_request: max_prompt_bytes)
            try:
                ids = await self.verifier.tokenize(request.prompt)
            except InvalidRequest as exc:  # e.g. too long for the context: the client sent a prompt
                raise InvalidRequest(f"prompt: {str(exc).removeprefix('text: ')}") from None
            if ids:
                return list(ids)
        raise InvalidRequest("prompt: the prompt is empty (give prompt text or prompt_ids)")

    async def _rank_acceptance(self, method: str) -> list[float]:
        """R(j) for tree shapes: configured, or measured for this pair once there are enough samples."""
        config = self.config
        rank_acceptance = list(config.rank_acceptance)
        if config.calibration_min_samples <= 0 or not get_method(method).drafts_trees:
            return rank_acceptance
        counts = await self.store.get_calibration(self.pair_key)
        prefix = f"{method}:"
        return scheduling.rank_acceptance_from_calibration(
            {key[len(prefix):]: v for key, v in counts.items() if key.startswith(prefix)},
            rank_acceptance,
            config.calibration_min_samples,
        )

    # the loop ----------------------------------------------------------------------------------
    async def _drive(self, run: Run) -> AsyncIterator[GenerationChunk]:
        """Iterate until a stop condition; one chunk per iteration, the last carries the result.

        The record is saved before each chunk is yielded. A consumer that goes away (or an
        orchestrator that dies) leaves it "running" with everything produced so far: resumable.
        """
        seconds_before = run.stats.seconds
        # watch=self: deadlines of drafter calls, re-checks of restarted engines (sessions.EngineWatch)
        sessions = RunSessions(run, self.drafter, self.verifier, draft_rows=self.config.draft_rows,
                               watch=self)
        error: BaseException | None = None
        if self.observer is not None:
            run.probe = self._observe_start(run, self.observer)
        try:
            if context_full(run, self._max_context()):  # e.g. a resumed request that filled the window
                run.finish_reason = "length"
                await self._save(run, "done")
                yield GenerationChunk([], text_delta(run, True), run.result())
                return
            while True:
                before = len(run.generated)
                await self._iteration(run, sessions)
                run.stats.seconds = seconds_before + time.perf_counter() - run.perf0
                final = run.finish_reason is not None
                await self._save(run, "done" if final else "running")
                if run.stats.iterations % CALIBRATION_FLUSH_ITERATIONS == 0:
                    await flush_calibration(run, self.store, self.pair_key)
                yield GenerationChunk(run.generated[before:], text_delta(run, final),
                                      run.result() if final else None)
                if final:
                    return
        except Exception as exc:
            error = exc
            try:
                await self._save(run, "failed", error=f"{type(exc).__name__}: {exc}")
            except StoreUnavailable:  # the store is what failed (it logs its outage once); raise exc
                pass
            except Exception:
                log.exception("could not record the failure of request %s", run.request_id)
            raise
        finally:
            await sessions.close()
            await flush_calibration(run, self.store, self.pair_key)
            if run.probe is not None:
                self._observe_end(run, run.probe, error)

    async def _iteration(self, run: Run, sessions: RunSessions) -> None:
        started = time.perf_counter()
        if run.probe is None:
            await self._iterate(run, sessions, None, started)
            return
        with run.probe.iteration(run.stats.iterations, started) as probe:  # its span is current inside
            await self._iterate(run, sessions, probe, started)

    async def _iterate(
        self, run: Run, sessions: RunSessions, probe: IterationProbe | None, started: float
    ) -> None:
        """One iteration: decide → draft (or take the pre-draft) → verify → stop conditions → account."""
        await self.ensure_serving()  # a verifier lost or changed under the run fails it (UNAVAILABLE)
        committed = run.committed
        position = len(committed)
        timeline = Timeline(probe)
        record = IterationRecord(request_id=run.request_id, index=run.stats.iterations, position=position,
                                 method=run.method, a=run.a)
        if run.adaptive:
            run.k = self._draft_length(run).choose()
        # Decide what to draft; None: a target-only step (by method, k = 0, or no draft fits the context).
        plan = scheduling.plan_iteration(run, position, self._depth_cap(position))
        steady = sessions.lag(committed, drafting=plan is not None) <= STEADY_CATCH_UP
        tree, outcome, looked_ahead = DraftTree.empty(), None, False
        if plan is not None and await self._drafter_ready():
            record.k, record.heads = plan.k, plan.heads
            try:
                if self._awaits_predraft(run, plan, committed):
                    looked_ahead = True
                    outcome = await self._step_looking_ahead(run, sessions, committed, timeline)
                else:
                    tree, probs = await self._draft(run, sessions, committed, plan, timeline)
                    outcome = await self._verify(run, sessions, committed, tree, probs, plan, timeline)
            except DrafterDown as exc:  # nothing was verified: drop the attempt
                self._drafter_lost(exc.cause)
        if looked_ahead:  # a target-only step beside a look-ahead: it keeps the k it asked for
            record.method, record.heads = "autoregressive", None
        elif outcome is None:  # target-only, by plan or because the drafter is away (record.fallback)
            tree = DraftTree.empty()
            record.method, record.k, record.heads = "autoregressive", 0, None
            record.fallback = plan is not None
            outcome = await self._target_only(sessions, committed, timeline)
        if not outcome.tokens:
            raise RuntimeError("verifier emitted no token")
        # Accept what the verifier emitted, up to the first stop condition.
        emitted = await absorb(run, outcome.tokens, decode=self.verifier.decode,
                               max_context=self._max_context())
        if run.finish_reason is not None or (record.method != run.method and not looked_ahead):
            pipeline.drop_predraft(run)  # the run ended, or a target-only step took its place
        account(run, record, tree=tree, outcome=outcome, emitted=emitted, started=started, timeline=timeline)
        self._learn(run, record, timeline, steady=steady)
        self._report(record, probe, tree.max_depth)

    async def _draft(
        self, run: Run, sessions: RunSessions, committed: list[int], plan: scheduling.Plan, timeline: Timeline
    ) -> tuple[DraftTree, torch.Tensor | None]:
        """The iteration's draft tree and its rows: the block pre-drafted for this very prefix when
        there is one (pipeline.py), else a fresh draft of the planned shape."""
        draft = pipeline.take_predraft(run, committed, len(plan.shape)) if plan.pipelined else None
        if draft is None and plan.shape:
            draft = await sessions.draft(committed, shape=plan.shape, timeline=timeline)
        if plan.heads is not None:
            return await _rd_draft(sessions, committed, draft, plan, timeline)
        assert draft is not None
        return DraftTree(tuple(draft.tokens), tuple(draft.parents)), draft.draft_probs

    async def _verify(
        self, run: Run, sessions: RunSessions, committed: list[int], tree: DraftTree,
        probs: torch.Tensor | None, plan: scheduling.Plan, timeline: Timeline,
    ) -> VerifyOutcome:
        """One target pass over committed + tree with the method's rule; when pipelined, the drafter
        pre-drafts the next block meanwhile (pipeline.py)."""
        next_k = 0
        if plan.pipelined:
            next_k = pipeline.next_block(run, committed, tree, len(plan.shape), self._depth_cap)
        verify = sessions.verify(committed, tree, method=run.method, params=plan.params, draft_probs=probs,
                                 timeline=timeline)
        return await pipeline.verify_and_look_ahead(run, sessions, committed, tree, verify, next_k=next_k,
                                                    timeline=timeline, on_drafter_lost=self._drafter_lost)

    def _awaits_predraft(self, run: Run, plan: scheduling.Plan, committed: list[int]) -> bool:
        """A pre-drafted-only request without a pre-draft for this prefix takes a target-only step
        while the drafter looks ahead (pipeline.py, "Pre-drafted only")."""
        return (self.config.predrafted_only and run.adaptive and plan.pipelined and plan.heads is None
                and not pipeline.adaptive(run) and not pipeline.has_predraft(run, committed, len(plan.shape)))

    async def _step_looking_ahead(
        self, run: Run, sessions: RunSessions, committed: list[int], timeline: Timeline
    ) -> VerifyOutcome:
        """A target-only step; meanwhile the drafter guesses its token and drafts run.k after each."""
        pipeline.drop_predraft(run)  # a pre-draft of another prefix or length
        step = self._target_only(sessions, committed, timeline)
        next_k = pipeline.next_block(run, committed, DraftTree.empty(), 0, self._depth_cap)
        return await pipeline.verify_and_look_ahead(run, sessions, committed, DraftTree.empty(), step,
                                                    next_k=next_k, timeline=timeline,
                                                    on_drafter_lost=self._drafter_lost)

    async def _target_only(
        self, sessions: RunSessions, committed: list[int], timeline: Timeline
    ) -> VerifyOutcome:
        """One token from the target alone: race sampling keyed on (seed, position), so a seeded ERSD
        run and a seeded target-only run emit the same token (docs/algorithms.md §4)."""
        params = MethodParams(seed=sessions.run.seed, position=len(committed))
        return await sessions.verify(committed, DraftTree.empty(), method=TARGET_ONLY_VERIFICATION,
                                     params=params, draft_probs=None, timeline=timeline)

    # online draft length (adaptation.py) -------------------------------------------------------
    def _pair_estimates(self, run: Run) -> PairEstimates:
        return self._estimates.setdefault(f"{self.pair_key}|{run.method}", PairEstimates())

    def _draft_length(self, run: Run) -> DraftLength:
        if run.draft_length is None:
            config = self.config
            predrafted = config.predrafted_only and run.pipeline
            run.draft_length = DraftLength(self._pair_estimates(run), k_max=config.max_k,
                                           start_k=config.default_k, probe_every=config.adaptive_probe_every,
                                           opening=PREDRAFTED_OPENING if predrafted else OPENING)
        return run.draft_length

    def _learn(self, run: Run, record: IterationRecord, timeline: Timeline, *, steady: bool) -> None:
        """Every finished iteration of a sequence method teaches the pair's estimates (requests with a
        fixed k too), and an adaptive request's own acceptance; a step forced by a lost drafter, or
        a target-only step the request did not choose, says nothing about speculation. The times of
        an iteration that began with a prefill (`steady` False) are not a sample of W(k)."""
        if record.fallback or run.tree_budget is not None or not adaptable(run.method, self.config):
            return
        if record.method != run.method and not run.adaptive:
            return
        observation = Observation(
            drafted=record.num_drafted, accepted=record.accepted, wall_seconds=record.end - record.start,
            verify_seconds=timeline.verify_seconds(), draft_seconds=timeline.draft_seconds(), steady=steady,
            setting=run.k if run.adaptive else None,
            switched=run.adaptive and self._draft_length(run).switched,
        )
        self._pair_estimates(run).observe(observation)
        if run.adaptive:
            self._draft_length(run).observe(observation)

    # the drafter's availability (failover.py) --------------------------------------------------
    async def _drafter_ready(self) -> bool:
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
            self._drafter_lost(exc)
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

    def _drafter_lost(self, exc: Exception) -> None:
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

    def drafter_deadline(self, passes: int, catch_up: int) -> float:
        expected = self._call_times.expected(passes, catch_up, self.config.drafter_timeout_floor_s)
        return drafter_deadline(expected, self.config)

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
    def _max_context(self) -> int:
        return self.target_info.max_context if self.target_info else 0

    def _depth_cap(self, committed_len: int) -> int:
        infos = (self.target_info, self.draft_info)
        return scheduling.depth_cap(committed_len, (info.max_context for info in infos if info is not None))

    # records and observers ---------------------------------------------------------------------
    async def _save(self, run: Run, status: str, error: str | None = None) -> None:
        """Write the run's progress; a run whose record another run has taken over (it stalled past
        its lease and the request was resumed) stops here with StillRunning."""
        if not await self.store.put_request(self._record(run, status, error)) and status != "failed":
            raise StillRunning(f"request_id {run.request_id!r} was taken over by another run (Resume) "
                               f"after this run made no progress for its lease")

    def _record(
        self, run: Run, status: str, error: str | None = None, *, lease: bool = True
    ) -> RequestRecord:
        """The run's record; a running one is leased to this run for resume_lease_seconds from now."""
        record = run.to_record(status, error)
        if status == "running" and lease:
            record.lease_until = time.time() + self.config.resume_lease_seconds
        return record

    async def _release(self, run: Run) -> None:
        """Save the run's progress with no lease (a Resume may take it over at once)."""
        try:
            await self.store.put_request(self._record(run, "running", lease=False))
        except StoreUnavailable:  # logged by the store; the lease then runs out by itself
            pass
        except Exception:
            log.exception("could not release the record of request %s", run.request_id)

    def _report(self, record: IterationRecord, probe: IterationProbe | None, depth: int) -> None:
        if self.on_iteration is not None:
            try:
                self.on_iteration(record)
            except Exception:
                log.exception("on_iteration callback failed")
        if probe is not None:
            try:
                probe.finished(record, depth)
            except Exception:
                log.exception("observer failed at the end of an iteration")

    def _observe_start(self, run: Run, observer: LoopObserver) -> RequestProbe | None:
        try:
            return observer.request_started(run.request_id, run.epoch, {
                "method": run.method, "k": run.k, "a": run.a, "tree_budget": run.tree_budget,
                "max_new_tokens": run.max_new_tokens, "prompt_tokens": len(run.prompt_ids),
                "resumed_tokens": len(run.generated), "seed": run.seed, "session_id": run.session_id,
                "temperature": run.sampling.temperature, "top_p": run.sampling.top_p,
                "top_k": run.sampling.top_k, "chat": run.chat,
            })
        except Exception:  # observability never fails a request
            log.exception("observer failed at the start of request %s", run.request_id)
            return None

    def _observe_end(self, run: Run, probe: RequestProbe, error: BaseException | None) -> None:
        try:
            probe.finished(run.result() if error is None and run.finish_reason else None, error)
        except Exception:
            log.exception("observer failed at the end of request %s", run.request_id)


async def _rd_draft(
    sessions: RunSessions, committed: list[int], draft: DraftResult | None, plan: scheduling.Plan,
    timeline: Timeline,
) -> tuple[DraftTree, torch.Tensor]:
    """RD's draft (docs/algorithms.md §5): the K drafted tokens with Q_1..Q_K, and, when position
    K + 1 had tails (K < k_max), Q_{K+1} from a drafter pass that runs concurrently with the
    target's scoring pass (for K = 0 that pass is the iteration's only drafter call)."""
    heads, k_max = plan.heads, plan.params.k_max
    assert heads is not None
    tree, rows = DraftTree.empty(), None
    if heads > 0:
        assert draft is not None
        tree = DraftTree(tuple(draft.tokens), tuple(draft.parents))
        if len(tree) != heads:
            raise RuntimeError(f"drafter returned {len(tree)} tokens for an RD sequence of {heads}")
        rows = draft_rows(draft, heads + 1)
    if heads < k_max:
        extra, _ = await both(sessions.draft(committed + list(tree.tokens), shape=[], timeline=timeline),
                              sessions.score(committed, tree, timeline=timeline))
        last = draft_rows(extra, 1)
        rows = last if rows is None else torch.cat([rows[:heads], last.to(rows.dtype)])
    assert rows is not None
    return tree, rows


class RequestSlots:
    """Admission: at most `limit` requests hold a slot at once; the others wait in arrival order,
    each for at most `timeout_s`, then get Overloaded. A freed slot passes straight to the first
    waiter, so a newcomer never overtakes the queue. Used from one event loop."""

    def __init__(self, limit: int, timeout_s: float) -> None:
        if limit < 1:
            raise ValueError(f"max_active_requests must be >= 1, got {limit}")
        self.limit = limit
        self.timeout_s = timeout_s
        self.active = 0  # slots held
        self.rejected = 0  # requests refused after waiting timeout_s
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the body (released however the body ends)."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    async def acquire(self) -> None:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.timeout_s):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # the slot was handed over just as the wait ran out: keep it
            self._forget(waiter)
            self.rejected += 1
            raise Overloaded(
                f"orchestrator busy: {self.active} requests running and {self.waiting} waiting (waited "
                f"{self.timeout_s:g} s for a slot); retry later or raise --max-active-requests"
            ) from None
        except BaseException:  # cancelled while waiting: pass on a slot already handed over
            self._forget(waiter)
            if waiter.done() and not waiter.cancelled():
                self.release()
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: `active` stays
                return
        self.active -= 1

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)


async def _last_result(stream: AsyncIterator[GenerationChunk]) -> GenerationResult:
    result = None
    async for chunk in stream:
        if chunk.result is not None:
            result = chunk.result
    if result is None:
        raise RuntimeError("generation stream ended without a result")
    return result
