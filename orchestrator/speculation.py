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
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import torch

from orchestrator import pipeline, scheduling
from orchestrator.accounting import CALIBRATION_FLUSH_ITERATIONS, account, flush_calibration
from orchestrator.adaptation import DraftLength, Observation, PairEstimates
from orchestrator.clients.base import DrafterClient, VerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.failover import Backoff, DrafterDown, both, connect_drafter
from orchestrator.output import absorb, context_full, text_delta
from orchestrator.run import Run, Timeline, adaptable, check_prompt, check_request, new_run
from orchestrator.sessions import RunSessions, draft_rows
from orchestrator.store import Store, open_store
from specdec.engine.api import (
    DraftResult,
    InvalidRequest,
    ModelInfo,
    Overloaded,
    PeerUnavailable,
    VerifyOutcome,
)
from specdec.generation import GenerationChunk, GenerationRequest, GenerationResult, IterationRecord
from specdec.methods import TARGET_ONLY_VERIFICATION, get_method
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams

if TYPE_CHECKING:
    from orchestrator.tracing import IterationProbe, LoopObserver, RequestProbe

log = logging.getLogger(__name__)


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
        self.admission = RequestSlots(self.config.max_active_requests, self.config.queue_timeout_s)

    # lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Read both services' info; refuse a pair whose vocabularies differ.

        An unreachable drafter is not an error: generation runs target-only until it answers
        (its info is checked then).
        """
        self.target_info = await self.verifier.info()
        if self.drafter is not None:
            await self._connect_drafter()

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
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await _last_result(self.generate_stream(request))

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The request's chunks; it first waits for a request slot (Overloaded when none frees up in
        time), held until the stream ends or is closed."""
        async with self.admission.slot():
            if self.target_info is None:
                await self.start()
            run = await self._new_run(request)
            async for chunk in self._drive(run):
                yield chunk

    async def resume(self, request_id: str) -> GenerationResult:
        """Continue a stored request from its stored tokens (a finished one is returned as is)."""
        return await _last_result(self.resume_stream(request_id))

    async def resume_stream(self, request_id: str) -> AsyncIterator[GenerationChunk]:
        """As generate_stream, from a stored request (it takes a request slot the same way)."""
        async with self.admission.slot():
            if self.target_info is None:
                await self.start()
            record = await self.store.get_request(request_id)
            if record is None:
                raise InvalidRequest(f"request_id: no stored request {request_id!r}")
            run = Run.from_record(record)
            if record.status == "done":
                run.finish_reason = record.finish_reason or "length"
                run.text = record.text
                yield GenerationChunk([], "", run.result())
                return
            run.text = await self.verifier.decode(run.generated) if run.generated else ""
            run.text_sent = len(run.text)
            async for chunk in self._drive(run):
                yield chunk

    def admission_stats(self) -> dict[str, int]:
        """Requests running, waiting for a slot, refused so far, and the limit (read by /metrics)."""
        slots = self.admission
        return {"active": slots.active, "waiting": slots.waiting, "rejected": slots.rejected,
                "limit": slots.limit}

    # request set-up ----------------------------------------------------------------------------
    async def _new_run(self, request: GenerationRequest) -> Run:
        target = self.target_info
        assert target is not None
        method = check_request(request, self.config, target)
        prompt_ids = await self._prompt_ids(request)
        check_prompt(prompt_ids, target)
        run = new_run(request, method=method, prompt_ids=prompt_ids,
                      rank_acceptance=await self._rank_acceptance(method), config=self.config, target=target)
        await self._save(run, "running")
        return run

    async def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_ids and request.prompt:
            raise InvalidRequest("prompt: give either prompt text or prompt_ids, not both")
        if request.prompt_ids:
            return [int(t) for t in request.prompt_ids]
        if request.prompt:
            ids = await self.verifier.tokenize(request.prompt)
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
        sessions = RunSessions(run, self.drafter, self.verifier, draft_rows=self.config.draft_rows)
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
            except Exception:  # the store may be what failed
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
        committed = run.committed
        position = len(committed)
        timeline = Timeline(probe)
        record = IterationRecord(request_id=run.request_id, index=run.stats.iterations, position=position,
                                 method=run.method, a=run.a)
        if run.adaptive:
            run.k = self._draft_length(run).choose()
        # Decide what to draft; None: a target-only step (by method, k = 0, or no draft fits the context).
        plan = scheduling.plan_iteration(run, position, self._depth_cap(position))
        tree, outcome = DraftTree.empty(), None
        if plan is not None and await self._drafter_ready():
            record.k, record.heads = plan.k, plan.heads
            try:
                tree, probs = await self._draft(run, sessions, committed, plan, timeline)
                outcome = await self._verify(run, sessions, committed, tree, probs, plan, timeline)
            except DrafterDown as exc:  # nothing was verified: drop the attempt
                self._drafter_lost(exc.cause)
        if outcome is None:  # target-only, by plan or because the drafter is away (record.fallback)
            tree = DraftTree.empty()
            record.method, record.k, record.heads = "autoregressive", 0, None
            record.fallback = plan is not None
            outcome = await self._target_only(sessions, committed, timeline)
        if not outcome.tokens:
            raise RuntimeError("verifier emitted no token")
        # Accept what the verifier emitted, up to the first stop condition.
        emitted = await absorb(run, outcome.tokens, decode=self.verifier.decode,
                               max_context=self._max_context())
        if run.finish_reason is not None or record.method != run.method:
            pipeline.drop_predraft(run)  # the run ended, or a target-only step took its place
        account(run, record, tree=tree, outcome=outcome, emitted=emitted, started=started, timeline=timeline)
        self._learn(run, record, timeline)
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
        if not next_k:
            return await verify
        return await pipeline.verify_and_look_ahead(run, sessions, committed, tree, verify, next_k=next_k,
                                                    timeline=timeline, on_drafter_lost=self._drafter_lost)

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
            run.draft_length = DraftLength(self._pair_estimates(run), k_max=config.max_k,
                                           start_k=config.default_k, probe_every=config.adaptive_probe_every)
        return run.draft_length

    def _learn(self, run: Run, record: IterationRecord, timeline: Timeline) -> None:
        """Every finished iteration of a sequence method teaches the pair's estimates (requests with a
        fixed k too), and an adaptive request's own acceptance; a step forced by a lost drafter, or
        a target-only step the request did not choose, says nothing about speculation."""
        if record.fallback or run.tree_budget is not None or not adaptable(run.method, self.config):
            return
        if record.method != run.method and not run.adaptive:
            return
        observation = Observation(
            drafted=record.num_drafted, accepted=record.accepted, wall_seconds=record.end - record.start,
            verify_seconds=timeline.verify_seconds(), draft_seconds=timeline.draft_seconds(),
        )
        self._pair_estimates(run).observe(observation)
        if run.adaptive:
            self._draft_length(run).observe(observation)

    # the drafter's availability (failover.py) --------------------------------------------------
    async def _drafter_ready(self) -> bool:
        """Whether to draft now: a drafter, not backing off after a loss, its info read and checked."""
        if self.drafter is None or self._backoff.waiting:
            return False
        return self.draft_info is not None or await self._connect_drafter()

    async def _connect_drafter(self) -> bool:
        """Read and check the drafter's info (its pair's calibration applied); False when it is away."""
        assert self.drafter is not None and self.target_info is not None
        try:
            self.draft_info, self.config = await connect_drafter(self.drafter, self.target_info, self.config)
        except PeerUnavailable as exc:
            self._drafter_lost(exc)
            return False
        return True

    def _drafter_lost(self, exc: Exception) -> None:
        self._backoff.lost(exc, self.config.drafter_retry_seconds)

    # context windows ---------------------------------------------------------------------------
    def _max_context(self) -> int:
        return self.target_info.max_context if self.target_info else 0

    def _depth_cap(self, committed_len: int) -> int:
        infos = (self.target_info, self.draft_info)
        return scheduling.depth_cap(committed_len, (info.max_context for info in infos if info is not None))

    # records and observers ---------------------------------------------------------------------
    async def _save(self, run: Run, status: str, error: str | None = None) -> None:
        await self.store.put_request(run.to_record(status, error))

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
                "temperature": run.sampling.temperature,
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
