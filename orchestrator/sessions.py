"""A run's sessions on the drafter and the verifier: the session protocol of specdec.engine.api.

For each service the loop keeps a mirror of the committed sequence that service holds
(`SessionMirror`) and sends base_len = common prefix of mirror and truth, append = the rest; the
engine sets committed = committed[:base_len] + append, or raises SessionGone, upon which the call
is resent once with base_len = 0. After a failed call the mirror shrinks to mirror[:base_len]:
the service holds either the old mirror or the target (if it applied the call before failing),
and both start so. After `verify` the verifier's mirror is committed + the emitted tokens. A
run's drafter calls never overtake each other (an abandoned pre-draft still in its call is
waited for). The protocol decides only which KV entries are reused, never which tokens an engine
conditions on (docs/algorithms.md §8, "Session protocol").

Lean draft rows (docs/algorithms.md §12): in "lean" mode a verify of a method with `lean_rows`
sends each node's q(x̃) and the rows known to be read (`rows_up_front`) instead of all rows; when
the verifier answers draft_rows_needed (it then holds `committed` and nothing more), the same
verify is resent with those rows added, as a call of its own on the timeline ("verify-rows").
In "parked" mode a fresh draft asked with `park_rows` goes lean on the drafter's side too: the
drafter sends the q(x̃) and keeps its rows (`ParkedRows`); a verify fetches the rows it needs from
there (a call of the verify on the timeline, op "draft-rows"), so no [n + 1, V] block crosses the
wire unless a rule reads it.

Faults (orchestrator.failover, orchestrator.health), through the run's `watch` (the orchestrator):
each drafter call has a deadline and is cancelled past it (DrafterSlow); the drafter session it was
on is then retired — the engine may still apply the cancelled call, so the run goes on in a new
drafter session (released with the others at the end) and never reads a state it cannot know. An
engine that forgot the run's session (SessionGone) may have restarted: its info is re-read before
the context is resent, and a drafter that changed (another vocabulary, a shorter context) or
refuses a call with InvalidRequest after a change ends the iteration's drafting (DrafterDown); a
verifier that changed fails the request (UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from orchestrator.clients.base import DrafterClient, VerifierClient
from orchestrator.config import DraftRowsMode
from orchestrator.failover import DrafterChanged, DrafterDown, DrafterIncompatible, DrafterSlow
from orchestrator.run import Run
from orchestrator.timeline import Timeline
from orchestrator.turn_close import TurnClose
from specdec.engine.api import (
    DraftRequest,
    DraftResult,
    DraftRowsRequest,
    LookaheadRequest,
    LookaheadResult,
    ScoreRequest,
    TextCursor,
    VerifyOutcome,
    VerifyRequest,
)
from specdec.errors import EngineError, InvalidRequest, Overloaded, PeerUnavailable, SessionGone
from specdec.methods import TARGET_ONLY_VERIFICATION, get_method
from specdec.trees import DraftTree, common_prefix, max_depth
from specdec.verification.base import MethodParams
from specdec.verification.lean import token_probs

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

T = TypeVar("T")
RELEASE_TIMEOUT_S = 5.0

SessionCall = Callable[[int, list[int]], Awaitable[T]]  # (base_len, append) -> the service's answer
OnGone = Callable[[], Awaitable[None]]  # before a resend after SessionGone; raises to give up instead


class EngineWatch(Protocol):
    """What a run reports to, and asks of, the orchestrator about its engines (module docstring)."""

    # Drafter calls running now, over every run (a verify sent meanwhile is not "drafter idle").
    drafter_calls: int

    @property
    def target_vocab_size(self) -> int | None:
        """The verifier's vocabulary size: a drafter's answer must fit it."""
        ...

    def drafter_deadline(self, passes: int, catch_up: int) -> float:
        """Seconds a drafter call of `passes` forward passes after `catch_up` new tokens may take."""
        ...

    def drafter_expected(self, passes: int, catch_up: int) -> float:
        """Seconds a drafter call of `passes` forward passes after `catch_up` new tokens should take."""
        ...

    def drafter_took(self, passes: int, catch_up: int, seconds: float, cut_off: bool = False) -> None: ...

    def verifier_took(self, passes: int, catch_up: int, seconds: float) -> None: ...

    async def drafter_changed(self) -> EngineError | None:
        """Re-read the drafter's info (it may have restarted): why not to draft now, or None."""
        ...

    async def verifier_changed(self) -> None:
        """Re-read the verifier's info; raise (PeerUnavailable) when it may not be used."""
        ...

    def verifier_lost(self, exc: PeerUnavailable) -> None:
        """A verifier call failed as unreachable."""
        ...


def _fits(result: DraftResult | LookaheadResult, vocab_size: int) -> bool:
    """Whether a drafter's answer lies in the verifier's vocabulary (token ids and row width)."""
    if isinstance(result, LookaheadResult):
        return all(0 <= b.token < vocab_size and _fits(b.draft, vocab_size) for b in result.branches)
    rows = result.draft_probs
    return all(0 <= t < vocab_size for t in result.tokens) and (rows is None or rows.shape[-1] == vocab_size)


@dataclass(frozen=True)
class ParkedRows:
    """A lean draft's rows, kept by the drafter (DraftRequest.lean_rows): each node's q of its token
    came with the draft; whole rows are fetched (DrafterClient.draft_rows) only where a rule reads
    them. Losing them (a drafter restart) before the verify decides fails the request: the rule has
    already drawn against q and cannot redo the step without them."""

    token_probs: list[float]
    count: int  # rows in the [n + 1, V] layout
    session_id: str  # the drafter session that drafted them
    rows_id: int


DRAFT_ROWS_TIMEOUT_S = 30.0


def draft_rows(draft: DraftResult, n: int) -> torch.Tensor:
    """The first n draft rows of a drafter's answer (an error when it sent fewer)."""
    if draft.draft_probs is None or draft.draft_probs.shape[0] < n:
        raise RuntimeError("drafter returned no draft distributions although they were requested")
    return draft.draft_probs[:n]


@dataclass
class SessionMirror:
    """What one service's session holds of the run's committed sequence, as far as the loop knows."""

    held: list[int] = field(default_factory=list)

    def behind(self, target: Sequence[int]) -> int:
        """Tokens of `target` the service must still take in (after the common prefix it holds)."""
        return len(target) - common_prefix(self.held, target)

    async def call(self, target: list[int], fn: SessionCall[T], on_gone: OnGone | None = None) -> T:
        """fn(base_len, append) so that the service holds `target`; resend all once on SessionGone
        (after `on_gone()`, which may raise instead)."""
        held = self.held
        base = common_prefix(held, target)
        try:
            try:
                result = await fn(base, target[base:])
            except SessionGone:
                base = 0
                if on_gone is not None:
                    await on_gone()
                result = await fn(0, list(target))
        except BaseException:
            self.held = held[:base]  # the old mirror or `target`: both start with held[:base]
            raise
        self.held = list(target)
        return result


class RunSessions:
    """One run's calls to its drafter and verifier sessions: mirrored, timed on the iteration's
    timeline, a lost drafter raised as DrafterDown. How the drafter drafts (strategy, whether it
    returns its rows) and how the rows reach the verifier (`draft_rows`: "lean" | "parked" | "full",
    the config's setting) follow from the run's method record, here and nowhere else."""

    def __init__(
        self, run: Run, drafter: DrafterClient | None, verifier: VerifierClient, *,
        draft_rows: DraftRowsMode = "lean", watch: EngineWatch | None = None,
    ) -> None:
        self.run = run
        self.drafter = drafter
        self.verifier = verifier
        self.draft_rows = draft_rows
        self.watch = watch  # deadlines of drafter calls, re-checks of restarted engines (None: neither)
        self.drafter_mirror = SessionMirror()
        self.verifier_mirror = SessionMirror()
        self.drafter_session = run.session_id  # a new one after a call was abandoned (module docstring)
        self.retired_sessions: list[str] = []
        self.drafter_pending: asyncio.Task | None = None  # an abandoned pre-draft still in its call
        self.drafter_calls = 0  # this run's drafter calls running now (counted here without a watch)
        spec = get_method(run.settings.method)
        self.strategy = spec.draft_strategy or "sample"  # target-only runs never draft
        self.want_rows = spec.needs_draft_rows
        self.lean_drafts = spec.needs_draft_rows and spec.lean_rows  # rows may stay at the drafter

    def lag(self, committed: Sequence[int], *, drafting: bool) -> int:
        """Committed tokens the verifier (and the drafter, when `drafting`) must first take in before
        the next pass: a request's prompt, a drafter's catch-up after target-only steps."""
        lag = self.verifier_mirror.behind(committed)
        if drafting and self.drafter is not None:
            lag = max(lag, self.drafter_mirror.behind(committed))
        return lag

    def drafter_catch_up_seconds(self, committed: Sequence[int]) -> float:
        """What the drafter's next call spends taking in the committed tokens it has not seen, beyond
        its passes (nan: no drafter, or nothing measures its calls)."""
        if self.drafter is None or self.watch is None:
            return math.nan
        behind = self.drafter_mirror.behind(committed)
        return self.watch.drafter_expected(1, behind) - self.watch.drafter_expected(1, 0)

    # drafter -----------------------------------------------------------------------------------
    async def draft(self, context: list[int], *, shape: Sequence[int], timeline: Timeline,
                    park_rows: bool = False) -> DraftResult:
        """Draft a tree of `shape` (parent indices) after `context`. `park_rows`: in lean mode, for a
        method whose rows go lean, the drafter keeps its rows and answers token_probs (see `parked`)."""
        drafter, run = self._drafter(), self.run.settings
        lean_rows = park_rows and self.lean_drafts and self.draft_rows == "parked"

        def call(base: int, append: list[int]) -> Awaitable[DraftResult]:
            return self._deadlined(drafter.draft(DraftRequest(
                session_id=self.drafter_session, base_len=base, append=append, shape_parents=list(shape),
                sampling=run.sampling, seed=run.seed, strategy=self.strategy,
                want_distributions=self.want_rows, lean_rows=lean_rows, cache_partition=run.cache_partition,
            )), passes=max(1, max_depth(shape)), catch_up=len(append))

        return await self._drafter_call(context, call, timeline, "draft")

    def parked(self, result: DraftResult) -> ParkedRows | None:
        """The parked rows of a lean draft that just came back (None for a draft with its rows)."""
        if not result.rows_id or result.token_probs is None:
            return None
        return ParkedRows(list(result.token_probs), len(result.tokens) + 1, self.drafter_session,
                          result.rows_id)

    async def _fetch_rows(self, parked: ParkedRows, rows: list[int], timeline: Timeline) -> torch.Tensor:
        """Rows of a parked lean draft, from the drafter that holds them."""
        if self.drafter is None:
            raise PeerUnavailable("the drafter that holds a lean draft's rows is gone; the request fails")
        request = DraftRowsRequest(session_id=parked.session_id, rows_id=parked.rows_id, rows=rows)
        try:
            async with asyncio.timeout(DRAFT_ROWS_TIMEOUT_S):
                # A step of the verify (it waits on it), though the drafter answers: op "draft-rows".
                values = await timeline.timed("verify", self.drafter.draft_rows(request), "draft-rows")
        except (TimeoutError, SessionGone, PeerUnavailable) as exc:
            raise PeerUnavailable(f"the drafter lost the rows of a lean draft before its verify decided "
                                  f"({type(exc).__name__}: {exc}); the request fails") from exc
        if tuple(values.shape[:1]) != (len(rows),):
            raise PeerUnavailable(f"the drafter sent {tuple(values.shape)} rows for {len(rows)} asked")
        return values

    async def lookahead(
        self, context: list[int], *, k: int, bonus_guesses: int, rejection_guesses: int, timeline: Timeline
    ) -> LookaheadResult:
        """Guess what the verifier commits after `context` and draft k tokens after each guess."""
        drafter, run = self._drafter(), self.run.settings

        def call(base: int, append: list[int]) -> Awaitable[LookaheadResult]:
            return self._deadlined(drafter.lookahead(LookaheadRequest(
                session_id=self.drafter_session, base_len=base, append=append, k=k, sampling=run.sampling,
                seed=run.seed, strategy=self.strategy, want_distributions=self.want_rows,
                bonus_guesses=bonus_guesses, rejection_guesses=rejection_guesses,
                cache_partition=run.cache_partition,
            )), passes=k + 1, catch_up=len(append))

        return await self._drafter_call(context, call, timeline, "lookahead")

    def defer(self, task: asyncio.Task) -> None:
        """An abandoned drafter call: the run's next drafter call waits for it."""
        self.drafter_pending = task

    async def settle_drafter(self) -> None:
        """Wait for an abandoned pre-draft's drafter call (its result and errors do not matter)."""
        task, self.drafter_pending = self.drafter_pending, None
        if task is None or task is asyncio.current_task():
            return
        try:
            await task
        except Exception as exc:
            log.debug("abandoned pre-draft ended with %s: %s", type(exc).__name__, exc)

    def abandoned_call_running(self) -> bool:
        """This run's abandoned pre-draft is still in its drafter call: a pass sent now shares the
        drafter's cores with it (drafter_idle is False) though the run chose no drafter work."""
        task = self.drafter_pending
        return task is not None and not task.done()

    def drafter_idle(self) -> bool:
        """No drafter call runs now, of this run or another: a pass sent now may use the drafter's
        cores (VerifyRequest.drafter_idle)."""
        counter = self.watch if self.watch is not None else self
        return counter.drafter_calls == 0

    def _drafter(self) -> DrafterClient:
        assert self.drafter is not None
        return self.drafter

    async def _drafter_call(self, target: list[int], call: SessionCall[T], timeline: Timeline, op: str) -> T:
        """One drafter call that leaves the drafter holding `target`: after any abandoned pre-draft
        (a run's drafter calls never overtake each other), timed, with a deadline, a lost, late or
        changed drafter as DrafterDown."""

        async def settled_call() -> T:
            await self.settle_drafter()
            counter = self.watch if self.watch is not None else self
            counter.drafter_calls += 1
            try:
                return await self.drafter_mirror.call(target, call, self._drafter_gone)
            finally:
                counter.drafter_calls -= 1

        try:
            result = await timeline.timed("draft", settled_call(), op)
        except DrafterSlow as exc:
            self._retire_drafter_session()
            raise DrafterDown(exc) from exc
        except (PeerUnavailable, Overloaded, DrafterIncompatible, DrafterChanged) as exc:
            raise DrafterDown(exc) from exc  # an overloaded drafter is shed like a lost one
        except InvalidRequest as exc:  # e.g. a context beyond a restarted drafter's shorter window
            change = await self._drafter_change()
            if change is None:
                raise  # the drafter is as it was: a real error
            raise DrafterDown(change) from exc
        vocab = self.watch.target_vocab_size if self.watch is not None else None
        if vocab is not None and not _fits(result, vocab):  # a drafter restarted with another vocabulary
            self.drafter_mirror = SessionMirror()
            change = await self._drafter_change()
            raise DrafterDown(change or DrafterIncompatible(f"the drafter answered {op} with tokens or rows "
                                                            f"outside the verifier's vocabulary of {vocab}"))
        return result

    async def _deadlined(self, call: Awaitable[T], *, passes: int, catch_up: int) -> T:
        """Await a drafter call, cancelled past its deadline (DrafterSlow); its time is reported."""
        watch = self.watch
        if watch is None:
            return await call
        deadline = watch.drafter_deadline(passes, catch_up)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(deadline):
                result = await call
        except TimeoutError:
            watch.drafter_took(passes, catch_up, deadline, cut_off=True)
            raise DrafterSlow(f"a drafter call ({passes} passes after {catch_up} new tokens) ran past its "
                              f"{deadline:.2f} s deadline and was abandoned") from None
        watch.drafter_took(passes, catch_up, time.perf_counter() - started)
        return result

    async def _drafter_change(self) -> EngineError | None:
        """Re-read the drafter's info through the watch: why not to draft now, or None (also without one)."""
        return await self.watch.drafter_changed() if self.watch is not None else None

    async def _drafter_gone(self) -> None:
        """The drafter forgot the run's session: if it restarted as another drafter, do not resend."""
        change = await self._drafter_change()
        if change is not None:
            raise change

    def _retire_drafter_session(self) -> None:
        """Go on in a fresh drafter session: the abandoned call may still change the old one."""
        self.retired_sessions.append(self.drafter_session)
        self.drafter_session = f"{self.run.session_id}~{len(self.retired_sessions)}"
        self.drafter_mirror = SessionMirror()

    # verifier ----------------------------------------------------------------------------------
    async def score(self, committed: list[int], tree: DraftTree, *, timeline: Timeline) -> None:
        """Start the target's pass over committed + tree before the draft rows are known."""
        run, verifier = self.run, self.verifier

        def call(base: int, append: list[int]) -> Awaitable[None]:
            return verifier.score(ScoreRequest(
                session_id=run.session_id, base_len=base, append=append, tree_tokens=list(tree.tokens),
                tree_parents=list(tree.parents), sampling=run.settings.sampling,
                cache_partition=run.settings.cache_partition,
            ))

        await self._verifier_call(committed, call, timeline, "score")

    async def pass_turn_close(self, close: TurnClose) -> None:
        """Pass a chat turn's close through the target (orchestrator.turn_close): the session then
        holds the run's first `close.base` tokens and `close.append`, keys and values computed and
        settled (a verify of no draft: its sampled token is dropped with the session)."""
        target = [*self.run.committed[:close.base], *close.append]
        await self.verify(target, DraftTree.empty(), method=TARGET_ONLY_VERIFICATION,
                          params=MethodParams(seed=self.run.settings.seed, position=len(target)),
                          draft_probs=None, timeline=Timeline())

    async def verify(
        self, committed: list[int], tree: DraftTree, *, method: str, params: MethodParams,
        draft_probs: torch.Tensor | ParkedRows | None, timeline: Timeline, text: TextCursor | None = None,
        deterministic: bool = False, drafter_idle: bool = False, score_ahead: bool = False,
    ) -> VerifyOutcome:
        """One target pass over committed + tree and `method`'s rule; the verifier commits the tokens.

        `text`: the run's TextCursor, for the emitted tokens' text (orchestrator.output).
        `deterministic`: a model-free draft; no draft rows go (VerifyRequest.deterministic).
        `drafter_idle`: no drafter call runs beside this pass (VerifyRequest.drafter_idle).
        `score_ahead`: the next call is this run's target-only step (VerifyRequest.score_ahead).
        Lean (docs/algorithms.md §12): resent with the rows the verifier names until it decides.
        Every retry must add rows of the [n + 1, V] layout, so there are at most n + 1 of them.
        The outcome's forward and verification seconds are those of all rounds.
        """
        run, verifier = self.run, self.verifier
        spec = get_method(method)
        parked = draft_probs if isinstance(draft_probs, ParkedRows) else None
        lean = parked is not None or (
            draft_probs is not None and self.draft_rows in ("lean", "parked") and spec.lean_rows)
        if parked is not None:
            probs = parked.token_probs
        else:
            probs = token_probs(tree, draft_probs) if lean else []  # type: ignore[arg-type]
        rows = set(spec.rows_up_front(params, len(tree))) if lean else set()
        values: torch.Tensor | None = None

        async def gather() -> None:  # the values of `rows`, from the parked draft or the rows at hand
            nonlocal values
            if not rows:
                values = None
            elif parked is not None:
                values = await self._fetch_rows(parked, sorted(rows), timeline)
            else:
                values = draft_probs[sorted(rows)]  # type: ignore[index]

        def call(base: int, append: list[int]) -> Awaitable[VerifyOutcome]:
            request = VerifyRequest(
                session_id=run.session_id, base_len=base, append=append, tree_tokens=list(tree.tokens),
                tree_parents=list(tree.parents), method=method, params=params, sampling=run.settings.sampling,
                text=text, deterministic=deterministic, drafter_idle=drafter_idle,
                cache_partition=run.settings.cache_partition, score_ahead=score_ahead,
            )
            if lean:
                request.draft_token_probs = probs
                request.draft_row_indices = sorted(rows)
                request.draft_row_values = values
            else:
                request.draft_probs = draft_probs  # type: ignore[assignment]
            return verifier.verify(request)

        await gather()
        catch_up = self.verifier_mirror.behind(committed)
        started = time.perf_counter()
        outcome = await self._verifier_call(committed, call, timeline)
        if self.watch is not None:
            self.watch.verifier_took(1, catch_up, time.perf_counter() - started)
        forward_seconds, verify_seconds = outcome.forward_seconds, outcome.verify_seconds
        while outcome.draft_rows_needed:
            asked = set(outcome.draft_rows_needed)
            if not lean or not asked.isdisjoint(rows) or not asked <= set(range(len(tree) + 1)):
                raise RuntimeError(f"verifier asked for draft rows {sorted(asked)} of a {len(tree)}-node "
                                   f"{'lean' if lean else 'full'} verify that carried {sorted(rows)}")
            rows |= asked
            await gather()
            outcome = await self._verifier_call(committed, call, timeline, "verify-rows")  # base_len = all
            forward_seconds += outcome.forward_seconds
            verify_seconds += outcome.verify_seconds
        self.verifier_mirror.held = committed + list(outcome.tokens)  # the verifier committed them
        return dataclasses.replace(outcome, forward_seconds=forward_seconds, verify_seconds=verify_seconds)

    async def _verifier_call(
        self, target: list[int], call: SessionCall[T], timeline: Timeline, op: str | None = None
    ) -> T:
        """One verifier call that leaves the verifier holding `target`, timed; a lost verifier is
        reported to the watch (health: not SERVING until it is seen again) and raised."""
        mirrored = self.verifier_mirror.call(target, call, self._verifier_gone)
        try:
            return await timeline.timed("verify", mirrored, op)
        except PeerUnavailable as exc:
            if self.watch is not None:
                self.watch.verifier_lost(exc)
            raise

    async def _verifier_gone(self) -> None:
        """The verifier forgot the run's session: if it restarted as another model, fail the run."""
        if self.watch is not None:
            await self.watch.verifier_changed()

    # the end of the run ------------------------------------------------------------------------
    async def close(self) -> None:
        """Wait (briefly) for an abandoned pre-draft, then release every session; never raises."""
        if self.drafter_pending is not None:
            try:
                async with asyncio.timeout(RELEASE_TIMEOUT_S):
                    await self.settle_drafter()
            except TimeoutError:
                log.debug("an abandoned pre-draft of %s is still running", self.run.session_id)
        sessions: list[tuple[DrafterClient | VerifierClient, str]] = []
        if self.drafter is not None:
            sessions += [(self.drafter, s) for s in (*self.retired_sessions, self.drafter_session)]
        sessions.append((self.verifier, self.run.session_id))
        for client, session_id in sessions:
            try:
                async with asyncio.timeout(RELEASE_TIMEOUT_S):
                    await client.release(session_id)
            except Exception as exc:  # a lost session is no loss: the engines evict it anyway
                log.debug("release of session %s failed: %s", session_id, exc)
