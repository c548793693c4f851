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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from orchestrator.clients.base import DrafterClient, VerifierClient
from orchestrator.config import DraftRowsMode
from orchestrator.failover import DrafterDown
from specdec.engine.api import (
    DraftRequest,
    DraftResult,
    LookaheadRequest,
    LookaheadResult,
    Overloaded,
    PeerUnavailable,
    ScoreRequest,
    SessionGone,
    VerifyOutcome,
    VerifyRequest,
)
from specdec.methods import get_method
from specdec.verification.lean import token_probs

if TYPE_CHECKING:
    import torch

    from orchestrator.run import Run, Timeline
    from specdec.trees import DraftTree
    from specdec.verification.base import MethodParams

log = logging.getLogger(__name__)

T = TypeVar("T")
RELEASE_TIMEOUT_S = 5.0

SessionCall = Callable[[int, list[int]], Awaitable[T]]  # (base_len, append) -> the service's answer


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def draft_rows(draft: DraftResult, n: int) -> torch.Tensor:
    """The first n draft rows of a drafter's answer (an error when it sent fewer)."""
    if draft.draft_probs is None or draft.draft_probs.shape[0] < n:
        raise RuntimeError("drafter returned no draft distributions although they were requested")
    return draft.draft_probs[:n]


@dataclass
class SessionMirror:
    """What one service's session holds of the run's committed sequence, as far as the loop knows."""

    held: list[int] = field(default_factory=list)

    async def call(self, target: list[int], fn: SessionCall[T]) -> T:
        """fn(base_len, append) so that the service holds `target`; resend all once on SessionGone."""
        held = self.held
        base = common_prefix(held, target)
        try:
            try:
                result = await fn(base, target[base:])
            except SessionGone:
                base = 0
                result = await fn(0, list(target))
        except BaseException:
            self.held = held[:base]  # the old mirror or `target`: both start with held[:base]
            raise
        self.held = list(target)
        return result


class RunSessions:
    """One run's calls to its drafter and verifier sessions: mirrored, timed on the iteration's
    timeline, a lost drafter raised as DrafterDown. How the drafter drafts (strategy, whether it
    returns its rows) and how the rows reach the verifier (`draft_rows`: "lean" | "full", the
    config's setting) follow from the run's method record, here and nowhere else."""

    def __init__(
        self, run: Run, drafter: DrafterClient | None, verifier: VerifierClient, *,
        draft_rows: DraftRowsMode = "lean",
    ) -> None:
        self.run = run
        self.drafter = drafter
        self.verifier = verifier
        self.draft_rows = draft_rows
        self.drafter_mirror = SessionMirror()
        self.verifier_mirror = SessionMirror()
        self.drafter_pending: asyncio.Task | None = None  # an abandoned pre-draft still in its call
        spec = get_method(run.method)
        self.strategy = spec.draft_strategy or "sample"  # target-only runs never draft
        self.want_rows = spec.needs_draft_rows

    # drafter -----------------------------------------------------------------------------------
    async def draft(self, context: list[int], *, shape: Sequence[int], timeline: Timeline) -> DraftResult:
        """Draft a tree of `shape` (parent indices) after `context`."""
        drafter, run = self._drafter(), self.run

        def call(base: int, append: list[int]) -> Awaitable[DraftResult]:
            return drafter.draft(DraftRequest(
                session_id=run.session_id, base_len=base, append=append, shape_parents=list(shape),
                sampling=run.sampling, seed=run.seed, strategy=self.strategy,
                want_distributions=self.want_rows,
            ))

        return await self._drafter_call(context, call, timeline, "draft")

    async def lookahead(
        self, context: list[int], *, k: int, bonus_guesses: int, rejection_guesses: int, timeline: Timeline
    ) -> LookaheadResult:
        """Guess what the verifier commits after `context` and draft k tokens after each guess."""
        drafter, run = self._drafter(), self.run

        def call(base: int, append: list[int]) -> Awaitable[LookaheadResult]:
            return drafter.lookahead(LookaheadRequest(
                session_id=run.session_id, base_len=base, append=append, k=k, sampling=run.sampling,
                seed=run.seed, strategy=self.strategy, want_distributions=self.want_rows,
                bonus_guesses=bonus_guesses, rejection_guesses=rejection_guesses,
            ))

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

    def _drafter(self) -> DrafterClient:
        assert self.drafter is not None
        return self.drafter

    async def _drafter_call(self, target: list[int], call: SessionCall[T], timeline: Timeline, op: str) -> T:
        """One drafter call that leaves the drafter holding `target`: after any abandoned pre-draft
        (a run's drafter calls never overtake each other), timed, a lost drafter as DrafterDown."""

        async def settled_call() -> T:
            await self.settle_drafter()
            return await self.drafter_mirror.call(target, call)

        try:
            return await timeline.timed("draft", settled_call(), op)
        except (PeerUnavailable, Overloaded) as exc:  # an overloaded drafter is shed like a lost one
            raise DrafterDown(exc) from exc

    # verifier ----------------------------------------------------------------------------------
    async def score(self, committed: list[int], tree: DraftTree, *, timeline: Timeline) -> None:
        """Start the target's pass over committed + tree before the draft rows are known."""
        run, verifier = self.run, self.verifier

        def call(base: int, append: list[int]) -> Awaitable[None]:
            return verifier.score(ScoreRequest(
                session_id=run.session_id, base_len=base, append=append, tree_tokens=list(tree.tokens),
                tree_parents=list(tree.parents), sampling=run.sampling,
            ))

        await timeline.timed("verify", self.verifier_mirror.call(committed, call), "score")

    async def verify(
        self, committed: list[int], tree: DraftTree, *, method: str, params: MethodParams,
        draft_probs: torch.Tensor | None, timeline: Timeline,
    ) -> VerifyOutcome:
        """One target pass over committed + tree and `method`'s rule; the verifier commits the tokens.

        Lean (docs/algorithms.md §12): resent with the rows the verifier names until it decides.
        Every retry must add rows of the [n + 1, V] layout, so there are at most n + 1 of them.
        The outcome's forward and verification seconds are those of all rounds.
        """
        run, verifier = self.run, self.verifier
        spec = get_method(method)
        lean = draft_probs is not None and self.draft_rows == "lean" and spec.lean_rows
        probs = token_probs(tree, draft_probs) if lean else []
        rows = set(spec.rows_up_front(params, len(tree))) if lean else set()

        def call(base: int, append: list[int]) -> Awaitable[VerifyOutcome]:
            request = VerifyRequest(
                session_id=run.session_id, base_len=base, append=append, tree_tokens=list(tree.tokens),
                tree_parents=list(tree.parents), method=method, params=params, sampling=run.sampling,
            )
            if lean:
                request.draft_token_probs = probs
                request.draft_row_indices = sorted(rows)
                request.draft_row_values = draft_probs[sorted(rows)] if rows else None
            else:
                request.draft_probs = draft_probs
            return verifier.verify(request)

        outcome = await timeline.timed("verify", self.verifier_mirror.call(committed, call))
        forward_seconds, verify_seconds = outcome.forward_seconds, outcome.verify_seconds
        while outcome.draft_rows_needed:
            asked = set(outcome.draft_rows_needed)
            if not lean or not asked.isdisjoint(rows) or not asked <= set(range(len(tree) + 1)):
                raise RuntimeError(f"verifier asked for draft rows {sorted(asked)} of a {len(tree)}-node "
                                   f"{'lean' if lean else 'full'} verify that carried {sorted(rows)}")
            rows |= asked
            retry = self.verifier_mirror.call(committed, call)  # it holds committed: base_len = all of it
            outcome = await timeline.timed("verify", retry, "verify-rows")
            forward_seconds += outcome.forward_seconds
            verify_seconds += outcome.verify_seconds
        self.verifier_mirror.held = committed + list(outcome.tokens)  # the verifier committed them
        return dataclasses.replace(outcome, forward_seconds=forward_seconds, verify_seconds=verify_seconds)

    # the end of the run ------------------------------------------------------------------------
    async def close(self) -> None:
        """Wait (briefly) for an abandoned pre-draft, then release both sessions; never raises."""
        if self.drafter_pending is not None:
            try:
                async with asyncio.timeout(RELEASE_TIMEOUT_S):
                    await self.settle_drafter()
            except TimeoutError:
                log.debug("an abandoned pre-draft of %s is still running", self.run.session_id)
        for client in (self.drafter, self.verifier):
            if client is None:
                continue
            try:
                async with asyncio.timeout(RELEASE_TIMEOUT_S):
                    await client.release(self.run.session_id)
            except Exception as exc:  # a lost session is no loss: the engines evict it anyway
                log.debug("release of session %s failed: %s", self.run.session_id, exc)
