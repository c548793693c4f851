"""The orchestrator's request loop: speculation iterations over a drafter and a verifier client.

Per iteration it decides what to draft (scheduling.py), runs drafter and verifier calls —
concurrently wherever the method allows (RD's no-draft step and the drafter's extra pass) —,
applies the stop conditions, records the iteration, and saves the request to the store.

Exactness never depends on anything decided here: every iteration's emitted tokens are
distributed as the target's given the committed prefix, whatever the method, k, a, tree shape,
or whether the drafter answered. Each iteration's randomness is keyed on (seed, position of its
first token), positions only grow, so a discarded attempt (drafter lost mid-iteration) or a
resumed request draws fresh, independent randomness for what it emits.

Session protocol (specdec.engine.api): for each service the loop keeps a mirror of the committed
sequence that service holds and sends base_len = common prefix of mirror and truth, append =
the rest. After a failed call the mirror shrinks to what the service holds in either case.

Pipelining (config `pipeline`, request `pipeline`; PEARL-style post-verify). For sequence
drafts (token, block, ersd without a tree, and rd iterations whose K equals k_max) the drafter
does not wait for the verifier: while the verifier checks block n = x_1..x_k drafted from the
committed prefix c, one drafter `lookahead` call computes the drafter's rows at the end of
c + x, guesses what the verifier will commit, and drafts block n+1 after each guess:
  - bonus guesses: c + x + b for the `pipeline_bonus_guesses` likeliest b under the drafter's row
    after c + x, by default 2 when the next block is one token, else 1 (all k accepted, bonus b;
    for ersd the first arrivals of that position's race under the drafter's row, coupled with
    the verifier's race under the target's);
  - rejection guesses (not rd): c + x_1..x_{k-1} + r for the `pipeline_rejection_guesses`
    likeliest r != x_k at the last position (x_k rejected, r emitted from the residual).
When the verifier answers, the pre-drafted block whose assumed context is exactly the new
committed sequence is kept, the others are dropped (the drafter's session resyncs by common
prefix on its next call). When the verification shows that no guess can come true (a rejection
before the last guessed position), the look-ahead is abandoned: the run's next drafter call
waits for it (a run's drafter calls never overtake each other, so the session mirror stays
true; an in-flight call is not cancelled, as the engine would finish it anyway).
Why this is exact: a draft block is a function of its context and of the drafter's randomness,
which is keyed on (seed, "draft", context length) for sampled drafts and on (seed, position)
races for ersd — never on the verifier's draws, on the guesses made, or on the decision to use
it. A kept pre-draft has context equal to the committed prefix, so it is precisely the block a
fresh draft from that prefix would be (same context, same stream): distributed like a fresh
draft given the past, and the acceptance rules are unchanged, hence the law of the output is
unchanged. Which guesses are made only decides whether the block is pre-drafted or drafted
afresh. With a seed, pipelined and sequential runs even emit the same tokens (up to
floating-point differences of the drafter's batched passes, which can move a sampled draft
token but never the output's law).

Adaptive draft length (`pipeline_max_k` > 0; token, block, ersd). The look-ahead drafts one
token after each guess, then the first bonus guess's block keeps growing, one token per drafter
call, until the verifier answers (or the cap is reached); the next block is whatever was
drafted by then, so the drafter is never idle while the target works. The block's length is
decided by the clock, i.e. by when the verifier answers, never by the values of the tokens in
the block, and every acceptance rule is exact for any draft length
fixed independently of the draft's values; so the law of the output is unchanged. Seeded runs
are then reproducible in law only, not token for token (the lengths depend on timing).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

import torch

from orchestrator import scheduling
from orchestrator.clients.base import DrafterClient, VerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.intervals import overlap
from orchestrator.store import RequestRecord, Store, open_store
from specdec.calibration import load_calibration
from specdec.engine.api import (
    DraftRequest,
    DraftResult,
    InvalidRequest,
    LookaheadRequest,
    LookaheadResult,
    ModelInfo,
    PeerUnavailable,
    ScoreRequest,
    SessionGone,
    VerifyOutcome,
    VerifyRequest,
)
from specdec.generation import (
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    IterationRecord,
)
from specdec.methods import METHOD_NAMES, METHODS
from specdec.sampling import SamplingParams
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams

log = logging.getLogger(__name__)

T = TypeVar("T")
RELEASE_TIMEOUT_S = 5.0
CALIBRATION_FLUSH_ITERATIONS = 64  # long requests add their counts to the store this often
MAX_GUESSES = 16  # per kind, per look-ahead (the drafter engine's limit)


class _DrafterDown(Exception):
    """The drafter could not be reached during an iteration (its PeerUnavailable, wrapped)."""

    def __init__(self, cause: PeerUnavailable) -> None:
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class _PreDraft:
    """A block drafted ahead from a speculative context (see "Pipelining" above)."""

    context: list[int]  # the committed sequence it assumes: c + x + b, or c + x_1..x_{k-1} + r
    draft: DraftResult
    rejection: bool = False  # assumes x_k rejected (r emitted) rather than all accepted
    rank: int = 0  # rank of its guess among the guesses of its kind


@dataclass
class _Run:
    """State of one run of a request (a resumed request starts a new run)."""

    request_id: str
    session_id: str
    prompt_ids: list[int]
    generated: list[int]
    method: str
    k: int
    a: float | None
    tree_budget: int | None
    sampling: SamplingParams
    max_new_tokens: int
    stop: list[str]
    stop_ids: frozenset[int]
    seed: int
    stats: GenerationStats
    rank_acceptance: list[float]
    drafter_mirror: list[int] = field(default_factory=list)
    verifier_mirror: list[int] = field(default_factory=list)
    iterations: list[IterationRecord] = field(default_factory=list)
    calibration: Counter = field(default_factory=Counter)
    finish_reason: str | None = None
    text: str = ""
    text_sent: int = 0
    perf0: float = field(default_factory=time.perf_counter)
    epoch0: float = field(default_factory=time.time)
    probe: Any = None  # the observer's RequestProbe of this run (tracing, metrics), if any
    pipeline: bool = False
    pipeline_max_k: int = 0  # > 0: adaptive pre-draft length (see "Adaptive draft length")
    bonus_guesses: int | None = None  # None: automatic by block length (_bonus_guesses)
    rejection_guesses: int = 0
    predraft: _PreDraft | None = None  # the next block, drafted while the last one was verified
    drafter_pending: asyncio.Task | None = None  # an abandoned pre-draft still in its drafter call

    @property
    def committed(self) -> list[int]:
        return self.prompt_ids + self.generated

    def epoch(self, perf: float) -> float:
        return self.epoch0 + (perf - self.perf0)

    def params(self) -> dict[str, Any]:
        """The request's resolved knobs as JSON (what `resume` needs to continue identically)."""
        return {
            "method": self.method,
            "k": self.k,
            "a": self.a,
            "tree_budget": self.tree_budget,
            "max_new_tokens": self.max_new_tokens,
            "sampling": asdict(self.sampling),
            "stop": list(self.stop),
            "stop_token_ids": sorted(self.stop_ids),
            "rank_acceptance": list(self.rank_acceptance),
            "pipeline": self.pipeline,
            "pipeline_max_k": self.pipeline_max_k,
            "bonus_guesses": self.bonus_guesses,
            "rejection_guesses": self.rejection_guesses,
        }


class _Timeline:
    """Real start/end of every drafter and verifier call of one iteration."""

    def __init__(self, probe: Any = None) -> None:
        self.draft: list[tuple[float, float]] = []
        self.verify: list[tuple[float, float]] = []
        self.probe = probe  # the observer's IterationProbe (a span per call), if any

    async def timed(self, kind: str, call: Awaitable[T], op: str | None = None) -> T:
        probe = self.probe
        start = time.perf_counter()
        token = probe.call_started(kind, op or kind, start) if probe is not None else None
        error: BaseException | None = None
        try:
            return await call
        except BaseException as exc:
            error = exc
            raise
        finally:
            end = time.perf_counter()
            (self.draft if kind == "draft" else self.verify).append((start, end))
            if probe is not None:
                probe.call_finished(token, end, error)

    def draft_seconds(self) -> float:
        return sum(end - start for start, end in self.draft)

    def verify_seconds(self) -> float:
        return sum(end - start for start, end in self.verify)

    def overlap_seconds(self) -> float:
        return overlap(self.draft, self.verify)


class Orchestrator:
    """Generation over one drafter (None = target only) and one verifier.

    on_iteration, if given, is called with every IterationRecord as soon as it is complete;
    the records are also on GenerationResult.iterations. observer, if given, is a
    orchestrator.tracing.LoopObserver (spans and metrics of requests, iterations and calls).
    """

    def __init__(
        self,
        drafter: DrafterClient | None,
        verifier: VerifierClient,
        config: OrchestratorConfig | None = None,
        store: Store | None = None,
        on_iteration: Callable[[IterationRecord], None] | None = None,
        observer: Any = None,
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
        self._drafter_retry_at = 0.0  # monotonic time before which the drafter is not tried

    # lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Read both services' info; refuse a pair whose vocabularies differ.

        An unreachable drafter is not an error: generation runs target-only until it answers
        (its info is checked then).
        """
        self.target_info = await self.verifier.info()
        if self.drafter is not None:
            try:
                info = await self.drafter.info()
            except PeerUnavailable as exc:
                self._drafter_unavailable(exc)
            else:
                self._accept_drafter(info)

    async def close(self) -> None:
        for client in (self.drafter, self.verifier):
            if client is not None:
                await client.close()
        await self.store.close()

    def _accept_drafter(self, info: ModelInfo) -> None:
        target = self.target_info
        assert target is not None
        if info.vocab_size != target.vocab_size or info.tokenizer_fingerprint != target.tokenizer_fingerprint:
            raise InvalidRequest(
                f"vocabulary mismatch: drafter {info.model_id!r} has vocab_size {info.vocab_size} and "
                f"tokenizer {info.tokenizer_fingerprint[:12]}, verifier {target.model_id!r} has vocab_size "
                f"{target.vocab_size} and tokenizer {target.tokenizer_fingerprint[:12]}"
            )
        self.draft_info = info
        if self.config.use_calibration:
            self._apply_calibration(info, target)

    def _apply_calibration(self, draft: ModelInfo, target: ModelInfo) -> None:
        """Saved analyser results for this pair become the defaults of fields not set explicitly."""
        calibration = load_calibration(draft.model_id, target.model_id)
        if calibration is None:
            return
        explicit = self.config.model_fields_set
        updates = {k: v for k, v in calibration.orchestrator_defaults().items() if k not in explicit}
        if updates:
            self.config = self.config.model_copy(update=updates)
            log.info("calibration of %s → %s applied: %s", draft.model_id, target.model_id, updates)

    def _drafter_unavailable(self, exc: Exception) -> None:
        log.warning("drafter unavailable (%s); target-only steps, retry in %.1fs", exc,
                    self.config.drafter_retry_seconds)
        self._drafter_retry_at = time.monotonic() + self.config.drafter_retry_seconds

    async def _drafter_ready(self) -> bool:
        if self.drafter is None or time.monotonic() < self._drafter_retry_at:
            return False
        if self.draft_info is None:
            try:
                info = await self.drafter.info()
            except PeerUnavailable as exc:
                self._drafter_unavailable(exc)
                return False
            self._accept_drafter(info)
        return True

    @property
    def pair_key(self) -> str:
        draft = self.draft_info.model_id if self.draft_info else "-"
        target = self.target_info.model_id if self.target_info else "-"
        return f"{draft}|{target}"

    # public API --------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await _last_result(self.generate_stream(request))

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if self.target_info is None:
            await self.start()
        run = await self._new_run(request)
        async for chunk in self._drive(run):
            yield chunk

    async def resume(self, request_id: str) -> GenerationResult:
        """Continue a stored request from its stored tokens (a finished one is returned as is)."""
        return await _last_result(self.resume_stream(request_id))

    async def resume_stream(self, request_id: str) -> AsyncIterator[GenerationChunk]:
        if self.target_info is None:
            await self.start()
        record = await self.store.get_request(request_id)
        if record is None:
            raise InvalidRequest(f"request_id: no stored request {request_id!r}")
        run = self._run_from_record(record)
        if record.status == "done":
            run.finish_reason = record.finish_reason or "length"
            run.text = record.text
            yield GenerationChunk([], "", self._result(run))
            return
        run.text = await self.verifier.decode(run.generated) if run.generated else ""
        run.text_sent = len(run.text)
        async for chunk in self._drive(run):
            yield chunk

    # request set-up ----------------------------------------------------------------------------
    async def _new_run(self, request: GenerationRequest) -> _Run:
        config = self.config
        target = self.target_info
        assert target is not None
        method = request.method or config.default_method
        if method not in METHODS:
            raise InvalidRequest(
                f"method: unknown method {method!r}; choose one of {', '.join(METHOD_NAMES)}"
            )
        _check_range("max_new_tokens", request.max_new_tokens, config.max_new_tokens_limit)
        # k is the draft length, except for gsd-tree where it is the tree budget.
        _check_range("k", request.k, config.max_tree_budget if method == "gsd-tree" else config.max_k)
        _check_range("tree_budget", request.tree_budget, config.max_tree_budget)
        if request.a is not None and not (
            isinstance(request.a, (int, float)) and math.isfinite(request.a) and 0.0 <= request.a <= 1.0
        ):
            raise InvalidRequest(f"a must lie in [0, 1], got {request.a!r}")
        if not isinstance(request.sampling, SamplingParams):  # its own constructor checks the ranges
            raise InvalidRequest("sampling must be a SamplingParams")
        stop = list(request.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequest("stop strings must be non-empty strings")
        stop_ids = target.eos_token_ids if request.stop_token_ids is None else tuple(request.stop_token_ids)
        _check_ids("stop_token_ids", stop_ids, target.vocab_size)
        if request.pipeline is not None and not isinstance(request.pipeline, bool):
            raise InvalidRequest(f"pipeline must be a boolean or None, got {request.pipeline!r}")
        _check_range("pipeline_max_k", request.pipeline_max_k, config.max_k, low=0)
        _check_range("pipeline_bonus_guesses", request.pipeline_bonus_guesses, MAX_GUESSES)
        _check_range("pipeline_rejection_guesses", request.pipeline_rejection_guesses, MAX_GUESSES, low=0)
        if request.seed is not None and not isinstance(request.seed, int):
            raise InvalidRequest(f"seed must be an integer, got {request.seed!r}")

        prompt_ids = await self._prompt_ids(request)
        _check_ids("prompt_ids", prompt_ids, target.vocab_size)
        if target.max_context and len(prompt_ids) >= target.max_context:
            raise InvalidRequest(
                f"prompt: {len(prompt_ids)} tokens leave no room in the target's context window of "
                f"{target.max_context} tokens"
            )

        k = request.k if request.k is not None else scheduling.default_k(method, config)
        rank_acceptance = list(config.rank_acceptance)
        if config.calibration_min_samples > 0 and method in ("gsd-tree", "ersd"):
            counts = await self.store.get_calibration(self.pair_key)
            prefix = f"{method}:"
            rank_acceptance = scheduling.rank_acceptance_from_calibration(
                {key[len(prefix):]: v for key, v in counts.items() if key.startswith(prefix)},
                rank_acceptance,
                config.calibration_min_samples,
            )
        request_id = request.request_id or uuid.uuid4().hex
        run = _Run(
            request_id=request_id,
            session_id=_session_id(request_id),
            prompt_ids=prompt_ids,
            generated=[],
            method=method,
            k=k,
            a=_rd_a(method, request.a, config),
            tree_budget=scheduling.tree_budget_for(method, request.k, request.tree_budget, config),
            sampling=request.sampling,
            max_new_tokens=request.max_new_tokens,
            stop=stop,
            stop_ids=frozenset(int(t) for t in stop_ids),
            seed=request.seed if request.seed is not None else secrets.randbits(63),
            stats=GenerationStats(),
            rank_acceptance=rank_acceptance,
            pipeline=config.pipeline if request.pipeline is None else request.pipeline,
            pipeline_max_k=min(config.max_k, _pick(request.pipeline_max_k, config.pipeline_max_k)),
            bonus_guesses=_pick(request.pipeline_bonus_guesses, config.pipeline_bonus_guesses),
            rejection_guesses=_pick(request.pipeline_rejection_guesses, config.pipeline_rejection_guesses),
        )
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

    def _run_from_record(self, record: RequestRecord) -> _Run:
        p = record.params
        return _Run(
            request_id=record.request_id,
            session_id=_session_id(record.request_id),
            prompt_ids=list(record.prompt_ids),
            generated=list(record.token_ids),
            method=p["method"],
            k=p["k"],
            a=p["a"],
            tree_budget=p["tree_budget"],
            sampling=SamplingParams(**p["sampling"]),
            max_new_tokens=p["max_new_tokens"],
            stop=list(p["stop"]),
            stop_ids=frozenset(p["stop_token_ids"]),
            seed=record.seed,
            stats=GenerationStats(**record.stats) if record.stats else GenerationStats(),
            rank_acceptance=list(p["rank_acceptance"]),
            pipeline=bool(p.get("pipeline", False)),
            pipeline_max_k=int(p.get("pipeline_max_k", 0)),
            bonus_guesses=p.get("bonus_guesses", 1),  # runs stored before guesses existed had one
            rejection_guesses=int(p.get("rejection_guesses", 0)),
        )

    # the loop ----------------------------------------------------------------------------------
    async def _drive(self, run: _Run) -> AsyncIterator[GenerationChunk]:
        """Iterate until a stop condition; one chunk per iteration, the last carries the result.

        The record is saved before each chunk is yielded. A consumer that goes away (or an
        orchestrator that dies) leaves it "running" with everything produced so far: resumable.
        """
        seconds_before = run.stats.seconds
        error: BaseException | None = None
        if self.observer is not None:
            run.probe = self._observe_start(run)
        try:
            if self._context_full(run):  # e.g. a resumed request that already filled the window
                run.finish_reason = "length"
                await self._save(run, "done")
                yield GenerationChunk([], _text_delta(run, True), self._result(run))
                return
            while True:
                before = len(run.generated)
                await self._iteration(run)
                run.stats.seconds = seconds_before + time.perf_counter() - run.perf0
                final = run.finish_reason is not None
                await self._save(run, "done" if final else "running")
                if run.stats.iterations % CALIBRATION_FLUSH_ITERATIONS == 0:
                    await self._flush_calibration(run)
                yield GenerationChunk(run.generated[before:], _text_delta(run, final),
                                      self._result(run) if final else None)
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
            await self._finish_run(run)
            if run.probe is not None:
                self._observe_end(run, error)

    def _observe_start(self, run: _Run) -> Any:
        try:
            return self.observer.request_started(run.request_id, run.epoch, {
                "method": run.method, "k": run.k, "a": run.a, "tree_budget": run.tree_budget,
                "max_new_tokens": run.max_new_tokens, "prompt_tokens": len(run.prompt_ids),
                "resumed_tokens": len(run.generated), "seed": run.seed, "session_id": run.session_id,
                "temperature": run.sampling.temperature,
            })
        except Exception:  # observability never fails a request
            log.exception("observer failed at the start of request %s", run.request_id)
            return None

    def _observe_end(self, run: _Run, error: BaseException | None) -> None:
        try:
            run.probe.finished(self._result(run) if error is None and run.finish_reason else None, error)
        except Exception:
            log.exception("observer failed at the end of request %s", run.request_id)

    async def _finish_run(self, run: _Run) -> None:
        if run.drafter_pending is not None:
            try:
                async with asyncio.timeout(RELEASE_TIMEOUT_S):
                    await self._settle_drafter(run)
            except TimeoutError:
                log.debug("an abandoned pre-draft of %s is still running", run.session_id)
        for client in (self.drafter, self.verifier):
            if client is None:
                continue
            try:
                async with asyncio.timeout(RELEASE_TIMEOUT_S):
                    await client.release(run.session_id)
            except Exception as exc:  # a lost session is no loss: the engines evict it anyway
                log.debug("release of session %s failed: %s", run.session_id, exc)
        await self._flush_calibration(run)

    async def _flush_calibration(self, run: _Run) -> None:
        """Add the run's acceptance counts to the model pair's running statistics in the store."""
        if not run.calibration:
            return
        counts = dict(run.calibration)
        run.calibration.clear()
        try:
            await self.store.add_calibration(self.pair_key, counts)
        except Exception:  # statistics are not worth failing a request for
            log.exception("could not store calibration counts")

    def _context_full(self, run: _Run) -> bool:
        max_context = self.target_info.max_context if self.target_info else 0
        return bool(max_context) and len(run.prompt_ids) + len(run.generated) >= max_context

    def _depth_cap(self, committed_len: int) -> int:
        """Deepest draft that fits both context windows with the extra token committed after it."""
        caps = [1 << 30]
        for info in (self.target_info, self.draft_info):
            if info is not None and info.max_context:
                caps.append(info.max_context - committed_len - 1)
        return max(0, min(caps))

    async def _iteration(self, run: _Run) -> None:
        if run.probe is None:
            await self._iterate(run, None)
            return
        started = time.perf_counter()
        with run.probe.iteration(run.stats.iterations, started) as probe:  # its span is current inside
            await self._iterate(run, probe, started)

    async def _iterate(self, run: _Run, probe: Any, started: float | None = None) -> None:
        committed = run.committed
        position = len(committed)
        timeline = _Timeline(probe)
        if started is None:
            started = time.perf_counter()
        record = IterationRecord(request_id=run.request_id, index=run.stats.iterations, position=position,
                                 method=run.method, a=run.a)
        depth_cap = self._depth_cap(position)
        speculative = run.method != "autoregressive" and depth_cap > 0
        tree: DraftTree | None = None
        outcome: VerifyOutcome | None = None
        if speculative and await self._drafter_ready():
            try:
                tree, outcome = await self._speculate(run, committed, depth_cap, timeline, record)
            except _DrafterDown as exc:
                # Nothing was verified: drop the attempt and take a target-only step instead.
                self._drafter_unavailable(exc.cause)
        if outcome is None:
            tree = DraftTree.empty()
            record.method, record.k, record.heads = "autoregressive", 0, None
            record.fallback = speculative
            # Race sampling keyed on (seed, position): ERSD with the same seed emits the same token.
            params = MethodParams(seed=run.seed, position=position)
            outcome = await self._verify(run, committed, tree, "ersd", params, None, timeline)
        assert tree is not None
        if not outcome.tokens:
            raise RuntimeError("verifier emitted no token")
        emitted = await self._absorb(run, outcome.tokens)
        if run.predraft is not None and (run.finish_reason is not None or record.method != run.method):
            self._drop_predraft(run)

        record.drafted = len(tree) > 0
        record.num_drafted = len(tree)
        record.accepted = len(outcome.accepted_nodes)
        record.emitted = emitted
        record.start, record.end = run.epoch(started), run.epoch(time.perf_counter())
        record.draft_intervals = [(run.epoch(s), run.epoch(e)) for s, e in timeline.draft]
        record.verify_intervals = [(run.epoch(s), run.epoch(e)) for s, e in timeline.verify]
        record.overlap_seconds = timeline.overlap_seconds()
        self._account(run, record, tree, outcome, timeline)
        run.iterations.append(record)
        if self.on_iteration is not None:
            try:
                self.on_iteration(record)
            except Exception:
                log.exception("on_iteration callback failed")
        if probe is not None:
            try:
                probe.finished(record, tree.max_depth)
            except Exception:
                log.exception("observer failed at the end of an iteration")

    async def _speculate(
        self, run: _Run, committed: list[int], depth_cap: int, timeline: _Timeline, record: IterationRecord
    ) -> tuple[DraftTree, VerifyOutcome]:
        position = len(committed)
        method = run.method
        if method == "rd":
            return await self._speculate_rd(run, committed, depth_cap, timeline, record)
        if run.tree_budget is not None:  # gsd-tree, or ersd with a tree budget
            shape = scheduling.tree_shape(run.rank_acceptance, run.tree_budget)
            shape = scheduling.cap_depth(shape, depth_cap)
            record.k = run.tree_budget
        else:
            shape = scheduling.sequence_shape(min(run.k, depth_cap))
            record.k = run.k
        race = method == "ersd"
        if run.pipeline and run.tree_budget is None and method in ("token", "block", "ersd"):
            k = min(run.k, depth_cap)
            params = MethodParams(seed=run.seed, position=position)
            return await self._speculate_pipelined(run, committed, k, method, params, timeline)
        draft = await self._draft(run, committed, shape, "race" if race else "sample", not race, timeline)
        tree = DraftTree(tuple(draft.tokens), tuple(draft.parents))
        params = MethodParams(seed=run.seed, position=position)
        outcome = await self._verify(run, committed, tree, method, params, draft.draft_probs, timeline)
        return tree, outcome

    async def _speculate_rd(
        self, run: _Run, committed: list[int], depth_cap: int, timeline: _Timeline, record: IterationRecord
    ) -> tuple[DraftTree, VerifyOutcome]:
        """Randomised drafting with per-position coins (ALGORITHMS.md §5)."""
        assert run.a is not None
        position = len(committed)
        k_max = min(run.k, depth_cap)
        heads = scheduling.rd_leading_heads(run.a, k_max, run.seed, position)
        record.k, record.heads = run.k, heads
        params = MethodParams(a=run.a, k_max=k_max, seed=run.seed, position=position)
        if run.pipeline and heads == k_max:
            return await self._speculate_pipelined(run, committed, k_max, "rd", params, timeline)
        if heads == 0:
            # No draft: Q_1 and P_1 are computed concurrently on the same prefix.
            tree = DraftTree.empty()
            draft, _ = await _both(
                self._draft(run, committed, [], "sample", True, timeline),
                self._score(run, committed, tree, timeline),
            )
            probs = _rows(draft, 1)
        else:
            shape = scheduling.sequence_shape(heads)
            draft = await self._draft(run, committed, shape, "sample", True, timeline)
            tree = DraftTree(tuple(draft.tokens), tuple(draft.parents))
            if len(tree) != heads:
                raise RuntimeError(f"drafter returned {len(tree)} tokens for an RD sequence of {heads}")
            probs = _rows(draft, heads + 1)
            if heads < k_max:
                # Position K+1 had tails: the drafter's pass for Q_{K+1} overlaps the target's pass.
                extra, _ = await _both(
                    self._draft(run, committed + list(tree.tokens), [], "sample", True, timeline),
                    self._score(run, committed, tree, timeline),
                )
                probs = torch.cat([probs[:heads], _rows(extra, 1).to(probs.dtype)])
        outcome = await self._verify(run, committed, tree, "rd", params, probs, timeline)
        return tree, outcome

    async def _speculate_pipelined(
        self, run: _Run, committed: list[int], k: int, method: str, params: MethodParams, timeline: _Timeline
    ) -> tuple[DraftTree, VerifyOutcome]:
        """One sequence iteration that verifies block n while pre-drafting block n+1 (module docstring).

        Block n is the pre-draft made during the previous iteration when its assumed context is
        the committed prefix, else a fresh draft.
        """
        race_strategy = method == "ersd"
        strategy, want = ("race", False) if race_strategy else ("sample", True)
        draft = self._take_predraft(run, committed, k)
        if draft is None:
            draft = await self._draft(run, committed, scheduling.sequence_shape(k), strategy, want, timeline)
        tree = DraftTree(tuple(draft.tokens), tuple(draft.parents))
        probs = draft.draft_probs
        if method == "rd":
            if len(tree) != k:
                raise RuntimeError(f"drafter returned {len(tree)} tokens for an RD sequence of {k}")
            probs = _rows(draft, k + 1)
        next_k = self._next_block(run, committed, tree, method, k)
        if next_k == 0:
            outcome = await self._verify(run, committed, tree, method, params, probs, timeline)
            return tree, outcome
        context = committed + list(tree.tokens)
        abandon, answered = asyncio.Event(), asyncio.Event()
        grow = answered if _adaptive(run) else None
        look_ahead = self._predraft(run, context, next_k, strategy, want, timeline, abandon, grow)
        task = asyncio.create_task(look_ahead)
        try:
            outcome = await self._verify(run, committed, tree, method, params, probs, timeline)
        except BaseException:
            abandon.set()
            run.drafter_pending = task
            await self._settle_drafter(run)
            raise
        answered.set()
        # A guess can come true only if every draft before the last guessed position was accepted.
        guessed_from = len(tree) - (1 if _rejection_guesses(run) else 0)
        if len(outcome.accepted_nodes) < guessed_from:
            abandon.set()
            run.drafter_pending = task  # the next drafter call waits for it
            run.stats.pre_drafts_dropped += 1
            return tree, outcome
        try:
            predrafts = await task
        except _DrafterDown as exc:  # block n is verified; only the look-ahead is lost
            self._drafter_unavailable(exc.cause)
            return tree, outcome
        except Exception as exc:  # the verifier committed block n already: do not fail for the look-ahead
            log.warning("pre-draft failed (%s: %s); drafting afresh next iteration", type(exc).__name__, exc)
            run.stats.pre_drafts_dropped += 1
            return tree, outcome
        truth = committed + list(outcome.tokens)
        run.predraft = next((p for p in predrafts if p.context == truth), None)
        if run.predraft is None:
            run.stats.pre_drafts_dropped += 1
        return tree, outcome

    def _next_block(self, run: _Run, committed: list[int], tree: DraftTree, method: str, k: int) -> int:
        """Length of the block to pre-draft for the context c + x + b, or 0 when not worth it.

        Not worth it when the drafter stopped short, when full acceptance would end the request
        (length, or a stop token among the drafts), or — for rd — when the coins of that position
        do not give K = k_max (that iteration would not draft a full sequence).
        """
        if len(tree) != k or any(t in run.stop_ids for t in tree.tokens):
            return 0
        if len(run.generated) + len(tree) + 1 >= run.max_new_tokens:
            return 0
        position = len(committed) + len(tree) + 1
        next_k = min(run.k, self._depth_cap(position))
        if _adaptive(run):  # the cap of a growing pre-draft
            left = run.max_new_tokens - len(run.generated) - len(tree) - 1
            next_k = min(run.pipeline_max_k, self._depth_cap(position), left)
        if next_k <= 0:
            return 0
        if method == "rd":
            assert run.a is not None
            if scheduling.rd_leading_heads(run.a, next_k, run.seed, position) != next_k:
                return 0
        return next_k

    async def _predraft(
        self, run: _Run, context: list[int], k: int, strategy: str, want: bool, timeline: _Timeline,
        abandon: asyncio.Event, grow_until: asyncio.Event | None = None,
    ) -> list[_PreDraft]:
        """Guess what the verifier commits after `context` and draft k tokens after each guess.

        With `grow_until`, the guesses get one token each, then the first bonus guess's block
        grows one token per call until that event is set (or k tokens). Returns [] when
        abandoned (no guess can come true any more) before the blocks were drafted.
        """
        result = await self._lookahead(run, context, 1 if grow_until is not None else k, strategy, want,
                                       timeline)
        if abandon.is_set():
            return []
        ranks = {False: 0, True: 0}
        predrafts = []
        for branch in result.branches:
            assumed = (context[:-1] if branch.replaces_last else context) + [int(branch.token)]
            kind = branch.replaces_last
            predrafts.append(_PreDraft(assumed, branch.draft, kind, ranks[kind]))
            ranks[kind] += 1
        if grow_until is None or not predrafts or predrafts[0].rejection:
            return predrafts
        first = predrafts[0]
        steps = [first.draft]
        one = scheduling.sequence_shape(1)
        while len(steps) < k and len(steps[-1].tokens) == 1 and not (grow_until.is_set() or abandon.is_set()):
            grown = first.context + [step.tokens[0] for step in steps]
            steps.append(await self._draft(run, grown, one, strategy, want, timeline))
        if abandon.is_set():
            return []
        steps = [step for step in steps if len(step.tokens) == 1]  # the drafter stops short at a full context
        if steps:
            predrafts[0] = _PreDraft(first.context, _chain(steps, want), False, 0)
        return predrafts

    def _take_predraft(self, run: _Run, committed: list[int], k: int) -> DraftResult | None:
        """The pre-drafted block for `committed`, if its context came true (any length when adaptive)."""
        predraft, run.predraft = run.predraft, None
        if predraft is None:
            return None
        length = len(predraft.draft.tokens)
        fits = 0 < length <= run.pipeline_max_k if _adaptive(run) else length == k
        if predraft.context != committed or not fits:
            run.stats.pre_drafts_dropped += 1
            return None
        run.stats.pre_drafts_used += 1
        hits = run.stats.pre_draft_rejection_hits if predraft.rejection else run.stats.pre_draft_bonus_hits
        _bump_at(hits, predraft.rank)
        return predraft.draft

    async def _settle_drafter(self, run: _Run) -> None:
        """Wait for an abandoned pre-draft's drafter call (its result and errors do not matter)."""
        task, run.drafter_pending = run.drafter_pending, None
        if task is None or task is asyncio.current_task():
            return
        try:
            await task
        except Exception as exc:
            log.debug("abandoned pre-draft ended with %s: %s", type(exc).__name__, exc)

    def _drop_predraft(self, run: _Run) -> None:
        if run.predraft is not None:
            run.predraft = None
            run.stats.pre_drafts_dropped += 1

    # service calls -----------------------------------------------------------------------------
    async def _session_call(
        self, run: _Run, mirror_name: str, target: list[int], call: Callable[[int, list[int]], Awaitable[T]]
    ) -> T:
        """call(base_len, append) so that the service holds `target`; resend all once on SessionGone."""
        mirror: list[int] = getattr(run, mirror_name)
        base = _common_prefix(mirror, target)
        try:
            try:
                result = await call(base, target[base:])
            except SessionGone:
                base = 0
                result = await call(0, list(target))
        except BaseException:
            # The service holds either the old mirror or target (if it applied the call before
            # failing); both start with mirror[:base].
            setattr(run, mirror_name, mirror[:base])
            raise
        setattr(run, mirror_name, list(target))
        return result

    async def _draft(
        self, run: _Run, target: list[int], shape: Sequence[int], strategy: str, want: bool,
        timeline: _Timeline,
    ) -> DraftResult:
        drafter = self.drafter
        assert drafter is not None

        def call(base: int, append: list[int]) -> Awaitable[DraftResult]:
            return drafter.draft(DraftRequest(
                session_id=run.session_id, base_len=base, append=append, shape_parents=list(shape),
                sampling=run.sampling, seed=run.seed, strategy=strategy, want_distributions=want,
            ))

        return await self._drafter_call(run, target, call, timeline, "draft")

    async def _lookahead(
        self, run: _Run, context: list[int], k: int, strategy: str, want: bool, timeline: _Timeline
    ) -> LookaheadResult:
        drafter = self.drafter
        assert drafter is not None

        def call(base: int, append: list[int]) -> Awaitable[LookaheadResult]:
            return drafter.lookahead(LookaheadRequest(
                session_id=run.session_id, base_len=base, append=append, k=k, sampling=run.sampling,
                seed=run.seed, strategy=strategy, want_distributions=want,
                bonus_guesses=_bonus_guesses(run, k), rejection_guesses=_rejection_guesses(run),
            ))

        return await self._drafter_call(run, context, call, timeline, "lookahead")

    async def _drafter_call(
        self, run: _Run, target: list[int], call: Callable[[int, list[int]], Awaitable[T]],
        timeline: _Timeline, op: str,
    ) -> T:
        """One drafter call that leaves the drafter holding `target`: after any abandoned pre-draft
        (a run's drafter calls never overtake each other), timed, a lost drafter as _DrafterDown."""

        async def settled_call() -> T:
            await self._settle_drafter(run)
            return await self._session_call(run, "drafter_mirror", target, call)

        try:
            return await timeline.timed("draft", settled_call(), op)
        except PeerUnavailable as exc:
            raise _DrafterDown(exc) from exc

    async def _score(self, run: _Run, committed: list[int], tree: DraftTree, timeline: _Timeline) -> None:
        def call(base: int, append: list[int]) -> Awaitable[None]:
            return self.verifier.score(ScoreRequest(
                session_id=run.session_id, base_len=base, append=append, tree_tokens=list(tree.tokens),
                tree_parents=list(tree.parents), sampling=run.sampling,
            ))

        await timeline.timed("verify", self._session_call(run, "verifier_mirror", committed, call), "score")

    async def _verify(
        self, run: _Run, committed: list[int], tree: DraftTree, method: str, params: MethodParams,
        draft_probs: torch.Tensor | None, timeline: _Timeline,
    ) -> VerifyOutcome:
        def call(base: int, append: list[int]) -> Awaitable[VerifyOutcome]:
            return self.verifier.verify(VerifyRequest(
                session_id=run.session_id, base_len=base, append=append, tree_tokens=list(tree.tokens),
                tree_parents=list(tree.parents), method=method, params=params, sampling=run.sampling,
                draft_probs=draft_probs,
            ))

        outcome = await timeline.timed("verify", self._session_call(run, "verifier_mirror", committed, call))
        run.verifier_mirror = committed + list(outcome.tokens)  # the verifier committed them
        return outcome

    # stop conditions and output ----------------------------------------------------------------
    async def _absorb(self, run: _Run, tokens: list[int]) -> list[int]:
        """Add an iteration's tokens to the output, applying every stop condition; returns what was kept."""
        before = len(run.generated)
        kept = list(tokens[: run.max_new_tokens - before])
        for i, token in enumerate(kept):
            if token in run.stop_ids:
                del kept[i + 1:]
                run.finish_reason = "eos"
                break
        run.generated.extend(kept)
        if run.finish_reason is None and len(run.generated) >= run.max_new_tokens:
            run.finish_reason = "length"
        text = await self.verifier.decode(run.generated)
        if run.stop and _find_stop(text, run.stop) is not None:
            text = await self._cut_at_stop(run, before, text)
            run.finish_reason = "stop"
        run.text = text
        if run.finish_reason is None and self._context_full(run):
            run.finish_reason = "length"
        return run.generated[before:]

    async def _cut_at_stop(self, run: _Run, before: int, full_text: str) -> str:
        """Keep the fewest new tokens whose text contains a stop string; the text ends before it."""
        for n in range(before + 1, len(run.generated) + 1):
            text = full_text if n == len(run.generated) else await self.verifier.decode(run.generated[:n])
            hit = _find_stop(text, run.stop)
            if hit is not None:
                del run.generated[n:]
                return text[:hit]
        raise AssertionError("unreachable: the full text holds a stop string")

    def _account(
        self, run: _Run, record: IterationRecord, tree: DraftTree, outcome: VerifyOutcome, timeline: _Timeline
    ) -> None:
        stats = run.stats
        stats.iterations += 1
        stats.new_tokens = len(run.generated)
        stats.draft_seconds += timeline.draft_seconds()
        stats.verify_seconds += timeline.verify_seconds()
        stats.overlap_seconds += record.overlap_seconds
        if record.fallback:
            stats.fallback_iterations += 1
        if not record.drafted:
            return
        accepted = len(outcome.accepted_nodes)
        stats.drafted_iterations += 1
        stats.drafted_tokens += len(tree)
        stats.accepted_tokens += accepted
        _bump(stats.drafted_per_position, tree.max_depth)
        _bump(stats.accepted_per_position, accepted)
        cal, prefix = run.calibration, f"{record.method}:"
        cal[prefix + "iterations"] += 1
        cal[prefix + "drafted_tokens"] += len(tree)
        cal[prefix + "accepted_tokens"] += accepted
        for depth in range(1, tree.max_depth + 1):
            cal[f"{prefix}drafted@{depth - 1}"] += 1
        for depth in range(1, accepted + 1):
            cal[f"{prefix}accepted@{depth - 1}"] += 1
        # Rank statistics R(j): at each decided node, which ranked child (if any) was accepted.
        node = -1
        for depth in range(tree.max_depth + 1):
            children = tree.children(node)
            if not children:
                break
            for rank in range(len(children)):
                cal[f"{prefix}rank_trials@{rank}"] += 1
            chosen = outcome.accepted_nodes[depth] if depth < accepted else None
            if chosen is None or chosen not in children:
                break
            cal[f"{prefix}rank_hits@{children.index(chosen)}"] += 1
            node = chosen

    def _result(self, run: _Run) -> GenerationResult:
        return GenerationResult(
            request_id=run.request_id,
            token_ids=list(run.generated),
            text=run.text,
            finish_reason=run.finish_reason or "length",
            seed=run.seed,
            method=run.method,
            stats=run.stats,
            iterations=list(run.iterations),
            started_at=run.epoch0,
        )

    async def _save(self, run: _Run, status: str, error: str | None = None) -> None:
        await self.store.put_request(RequestRecord(
            request_id=run.request_id,
            status=status,
            prompt_ids=run.prompt_ids,
            token_ids=run.generated,
            params=run.params(),
            seed=run.seed,
            stats=_stats_dict(run.stats),
            finish_reason=run.finish_reason if status == "done" else None,
            text=run.text,
            error=error,
        ))


# helpers ---------------------------------------------------------------------------------------
def _stats_dict(stats: GenerationStats) -> dict[str, Any]:
    """GenerationStats as JSON values (dataclasses.asdict deep-copies, which costs on every iteration)."""
    return {f.name: (list(v) if isinstance(v := getattr(stats, f.name), list) else v) for f in fields(stats)}


def _session_id(request_id: str) -> str:
    """A fresh session per run: a resumed request never shares caches with its dead predecessor."""
    return f"{request_id}/{uuid.uuid4().hex[:8]}"


async def _last_result(stream: AsyncIterator[GenerationChunk]) -> GenerationResult:
    result = None
    async for chunk in stream:
        if chunk.result is not None:
            result = chunk.result
    if result is None:
        raise RuntimeError("generation stream ended without a result")
    return result


async def _both(first: Awaitable[Any], second: Awaitable[Any]) -> tuple[Any, Any]:
    """Run two calls concurrently and wait for both; a verifier error wins over a lost drafter."""
    results = await asyncio.gather(first, second, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        errors.sort(key=lambda e: isinstance(e, _DrafterDown))
        raise errors[0]
    return results[0], results[1]


def _pick(value: T | None, default: T) -> T:
    return default if value is None else value


def _adaptive(run: _Run) -> bool:
    """Pre-drafts of this run grow until the verifier answers (rd keeps its coin-fixed lengths)."""
    return run.pipeline_max_k > 0 and run.method != "rd"


def _bonus_guesses(run: _Run, k: int) -> int:
    """The run's setting, or automatic: 2 for one-token blocks, 1 for longer ones (OrchestratorConfig)."""
    if run.bonus_guesses is not None:
        return run.bonus_guesses
    return 2 if k == 1 else 1


def _rejection_guesses(run: _Run) -> int:
    """rd looks ahead only where its next coins give a full block, known for the bonus guess alone."""
    return 0 if run.method == "rd" else run.rejection_guesses


def _chain(steps: Sequence[DraftResult], want: bool) -> DraftResult:
    """One sequence draft from one-token drafts made one after another (rows in the same layout)."""
    tokens = [step.tokens[0] for step in steps]
    probs = None
    if want:
        first_rows = [_rows(step, 1) for step in steps]
        probs = torch.cat(first_rows + [torch.zeros_like(first_rows[0])])  # the leaf row stays zero
    return DraftResult(
        tokens=tokens,
        parents=list(range(-1, len(tokens) - 1)),
        draft_probs=probs,
        forward_seconds=sum(step.forward_seconds for step in steps),
    )


def _rows(draft: DraftResult, n: int) -> torch.Tensor:
    if draft.draft_probs is None or draft.draft_probs.shape[0] < n:
        raise RuntimeError("drafter returned no draft distributions although they were requested")
    return draft.draft_probs[:n]


def _rd_a(method: str, a: float | None, config: OrchestratorConfig) -> float | None:
    if method != "rd":
        return None
    return float(a) if a is not None else config.default_a


def _check_range(name: str, value: int | None, limit: int, low: int = 1) -> None:
    if value is not None and (not isinstance(value, int) or not low <= value <= limit):
        raise InvalidRequest(f"{name} must lie in {low}..{limit}, got {value!r}")


def _check_ids(name: str, ids: Sequence[int], vocab: int) -> None:
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"{name}: token ids {bad[:8]} lie outside the vocabulary [0, {vocab})")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _bump(counts: list[int], upto: int) -> None:
    """counts[i] += 1 for i < upto, growing the list as needed."""
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1


def _bump_at(counts: list[int], index: int) -> None:
    """counts[index] += 1, growing the list as needed."""
    if len(counts) <= index:
        counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += 1


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _text_delta(run: _Run, final: bool) -> str:
    """The not-yet-streamed text that can no longer change (held back: a possible stop-string
    start, and an incomplete character at the end)."""
    text = run.text
    end = len(text)
    if not final:
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        hold = 0
        for stop in run.stop:
            for n in range(min(len(stop) - 1, end), hold, -1):
                if text.endswith(stop[:n], 0, end):
                    hold = n
                    break
        end -= hold
    delta = text[run.text_sent:end] if end > run.text_sent else ""
    run.text_sent = max(run.text_sent, end)
    return delta


