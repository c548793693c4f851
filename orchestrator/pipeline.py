"""Pipelined look-ahead: the next block is pre-drafted while the verifier checks this one.

Pipelining (config `pipeline`, request `pipeline`; PEARL-style post-verify). For sequence
drafts (methods whose record is `pipelinable`: token, block, ersd without a tree, and rd
iterations whose K equals k_max) the drafter does not wait for the verifier: while the verifier
checks block n = x_1..x_k drafted from the committed prefix c, one drafter `lookahead` call
computes the drafter's rows at the end of c + x, guesses what the verifier will commit, and
drafts block n+1 after each guess:
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
true; an in-flight call is not cancelled, as the engine would finish it anyway). A late
look-ahead delays neither the verified block nor the next iteration past its own deadline: like
every drafter call it is cancelled after max(drafter_timeout_floor_s, drafter_timeout_multiple ×
its expected time) (orchestrator.sessions), the block the verifier committed is kept, and the
next block is drafted afresh (in a new drafter session) or the iteration runs target-only.
Why this is exact (docs/algorithms.md §8, "Pipelining / look-ahead pre-drafts"): a draft block
is a function of its context and of the drafter's randomness, which is keyed on (seed, "draft",
context length) for sampled drafts and on (seed, position) races for ersd — never on the
verifier's draws, on the guesses made, or on the decision to use it. A kept pre-draft has
context equal to the committed prefix, so it is precisely the block a fresh draft from that
prefix would be (same context, same stream): distributed like a fresh draft given the past, and
the acceptance rules are unchanged, hence the law of the output is unchanged. Which guesses are
made only decides whether the block is pre-drafted or drafted afresh. With a seed, pipelined and
sequential runs even emit the same tokens (up to floating-point differences of the drafter's
batched passes, which can move a sampled draft token but never the output's law).

Pre-drafted only (config `predrafted_only`, requests whose draft length is picked online). A
block is verified only when a pre-draft for the committed prefix came true. Otherwise the iteration
is a target-only step, and meanwhile the drafter looks ahead from that prefix: it guesses the
step's token and drafts after each guess, so the next iteration finds a pre-draft when a guess comes
true. No iteration then waits for a fresh draft after a miss (drafter catch-up, k passes, then the
verifier's), and the drafter stays in step with the committed text, so a request that drafts opens
at no extra cost: the drafter takes in the prompt while the verifier does. Exact for the same
reason as the look-ahead: whether an iteration drafts is decided from the committed prefix and the
drafter's own guesses, before anything of that iteration is verified, and the block verified is
exactly a fresh draft from its prefix (docs/algorithms.md §8).

Adaptive draft length (`pipeline_max_k` > 0; methods whose record has `adaptive_length`: token
and ersd). The look-ahead drafts one token after each guess, then the first bonus guess's block
keeps growing, one token per drafter call, until the verifier answers (or the cap is reached);
the next block is whatever was drafted by then, so the drafter is never idle while the target
works. The block's length is decided by the clock, i.e. by when the verifier answers, never by
the values of the tokens in the block, and token verification and ERSD are exact for any draft
length fixed independently of the draft's values (docs/algorithms.md §8, "Adaptive draft
length"); so the law of the output is unchanged. Seeded runs are then reproducible in law only,
not token for token (the lengths depend on timing).
Block verification and rd pre-draft fixed-length blocks instead (`pipeline_max_k` is ignored):
a grown pre-draft x̃_1..x̃_m from context c' draws x̃_{j+1} in a one-token drafter call keyed on
(seed, "draft", |c'| + j), and block verification's τ also reads the drafts after position
τ + 1. Given τ = a, the next fresh draft is keyed on (seed, "draft", |c'| + a + 1), the stream
that drew x̃_{a+2}, and its uniform is no longer uniform given τ = a: on an exact toy the next
token's law moves from (1/3, 2/3) to (1/2, 1/2) (docs/algorithms.md §8). Token verification's
and ERSD's decision at position a + 1 never reads x̃_{a+2}, so they are unaffected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from orchestrator import scheduling
from orchestrator.accounting import bump_at
from orchestrator.failover import DrafterDown
from orchestrator.sessions import draft_rows
from specdec.engine.api import DraftResult, VerifyOutcome
from specdec.trees import DraftTree, sequence_parents

if TYPE_CHECKING:
    from orchestrator.run import Run, Timeline
    from orchestrator.sessions import RunSessions

log = logging.getLogger(__name__)


@dataclass
class PreDraft:
    """A block drafted ahead from a speculative context (see "Pipelining" above)."""

    context: list[int]  # the committed sequence it assumes: c + x + b, or c + x_1..x_{k-1} + r
    draft: DraftResult
    rejection: bool = False  # assumes x_k rejected (r emitted) rather than all accepted
    rank: int = 0  # rank of its guess among the guesses of its kind


def adaptive(run: Run) -> bool:
    """Pre-drafts of this run grow until the verifier answers (only where that is exact: above)."""
    return run.pipeline_max_k > 0 and run.spec.adaptive_length


def bonus_guesses(run: Run, k: int) -> int:
    """The run's setting, or automatic: 2 for one-token blocks, 1 for longer ones (OrchestratorConfig)."""
    if run.bonus_guesses is not None:
        return run.bonus_guesses
    return 2 if k == 1 else 1


def rejection_guesses(run: Run) -> int:
    """rd looks ahead only where its next coins give a full block, known for the bonus guess alone."""
    return 0 if run.spec.coins else run.rejection_guesses


def has_predraft(run: Run, committed: list[int], k: int) -> bool:
    """Whether take_predraft(run, committed, k) returns a block: one whose context came true and
    whose length fits (k, or any up to the cap when adaptive)."""
    predraft = run.predraft
    if predraft is None or predraft.context != committed:
        return False
    length = len(predraft.draft.tokens)
    return 0 < length <= run.pipeline_max_k if adaptive(run) else length == k


def take_predraft(run: Run, committed: list[int], k: int) -> DraftResult | None:
    """The pre-drafted block for `committed`, if its context came true (any length when adaptive)."""
    if not has_predraft(run, committed, k):
        drop_predraft(run)
        return None
    predraft, run.predraft = run.predraft, None
    assert predraft is not None
    run.stats.pre_drafts_used += 1
    hits = run.stats.pre_draft_rejection_hits if predraft.rejection else run.stats.pre_draft_bonus_hits
    bump_at(hits, predraft.rank)
    return predraft.draft


def drop_predraft(run: Run) -> None:
    if run.predraft is not None:
        run.predraft = None
        run.stats.pre_drafts_dropped += 1


def next_block(
    run: Run, committed: list[int], tree: DraftTree, k: int, depth_cap: Callable[[int], int]
) -> int:
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
    next_k = min(run.k, depth_cap(position))
    if adaptive(run):  # the cap of a growing pre-draft
        left = run.max_new_tokens - len(run.generated) - len(tree) - 1
        next_k = min(run.pipeline_max_k, depth_cap(position), left)
    if next_k <= 0:
        return 0
    if run.spec.coins:
        assert run.a is not None
        if scheduling.rd_leading_heads(run.a, next_k, run.seed, position) != next_k:
            return 0
    return next_k


async def verify_and_look_ahead(
    run: Run, sessions: RunSessions, committed: list[int], tree: DraftTree, verify: Awaitable[VerifyOutcome],
    *, next_k: int, timeline: Timeline, on_drafter_lost: Callable[[Exception], None],
) -> VerifyOutcome:
    """Await `verify` (block n = tree after committed) while pre-drafting block n+1 of next_k
    tokens; keeps on `run.predraft` the block whose guess came true, if any (next_k = 0: no
    look-ahead, just `verify`)."""
    if not next_k:
        return await verify
    abandon, answered = asyncio.Event(), asyncio.Event()
    rejections = rejection_guesses(run) if len(tree) else 0  # a target-only step has no block to reject
    look_ahead = predraft(run, sessions, committed + list(tree.tokens), next_k, rejections=rejections,
                          timeline=timeline, abandon=abandon, grow_until=answered if adaptive(run) else None)
    task = asyncio.create_task(look_ahead)
    try:
        outcome = await verify
    except BaseException:
        abandon.set()
        sessions.defer(task)
        await sessions.settle_drafter()
        raise
    answered.set()
    # A guess can come true only if every draft before the last guessed position was accepted.
    guessed_from = len(tree) - (1 if rejections else 0)
    if len(outcome.accepted_nodes) < guessed_from:
        abandon.set()
        sessions.defer(task)  # the next drafter call waits for it
        run.stats.pre_drafts_dropped += 1
        return outcome
    try:
        predrafts = await task
    except DrafterDown as exc:  # block n is verified; only the look-ahead is lost
        on_drafter_lost(exc.cause)
        return outcome
    except Exception as exc:  # the verifier committed block n already: do not fail for the look-ahead
        log.warning("pre-draft failed (%s: %s); drafting afresh next iteration", type(exc).__name__, exc)
        run.stats.pre_drafts_dropped += 1
        return outcome
    truth = committed + list(outcome.tokens)
    run.predraft = next((p for p in predrafts if p.context == truth), None)
    if run.predraft is None:
        run.stats.pre_drafts_dropped += 1
    return outcome


async def predraft(
    run: Run, sessions: RunSessions, context: list[int], k: int, *, rejections: int, timeline: Timeline,
    abandon: asyncio.Event, grow_until: asyncio.Event | None = None,
) -> list[PreDraft]:
    """Guess what the verifier commits after `context` and draft k tokens after each guess.

    With `grow_until`, the guesses get one token each, then the first bonus guess's block
    grows one token per call until that event is set (or k tokens). Returns [] when
    abandoned (no guess can come true any more) before the blocks were drafted.
    """
    first_k = 1 if grow_until is not None else k
    result = await sessions.lookahead(context, k=first_k, bonus_guesses=bonus_guesses(run, first_k),
                                      rejection_guesses=rejections, timeline=timeline)
    if abandon.is_set():
        return []
    ranks = {False: 0, True: 0}
    predrafts = []
    for branch in result.branches:
        assumed = (context[:-1] if branch.replaces_last else context) + [int(branch.token)]
        kind = branch.replaces_last
        predrafts.append(PreDraft(assumed, branch.draft, kind, ranks[kind]))
        ranks[kind] += 1
    if grow_until is None or not predrafts or predrafts[0].rejection:
        return predrafts
    first = predrafts[0]
    steps = [first.draft]
    one = sequence_parents(1)
    while len(steps) < k and len(steps[-1].tokens) == 1 and not (grow_until.is_set() or abandon.is_set()):
        grown = first.context + [step.tokens[0] for step in steps]
        steps.append(await sessions.draft(grown, shape=one, timeline=timeline))
    if abandon.is_set():
        return []
    steps = [step for step in steps if len(step.tokens) == 1]  # the drafter stops short at a full context
    if steps:
        predrafts[0] = PreDraft(first.context, chain(steps, want_rows=sessions.want_rows), False, 0)
    return predrafts


def chain(steps: Sequence[DraftResult], *, want_rows: bool) -> DraftResult:
    """One sequence draft from one-token drafts made one after another (rows in the same layout)."""
    tokens = [step.tokens[0] for step in steps]
    probs = None
    if want_rows:
        first_rows = [draft_rows(step, 1) for step in steps]
        probs = torch.cat(first_rows + [torch.zeros_like(first_rows[0])])  # the leaf row stays zero
    return DraftResult(
        tokens=tokens,
        parents=sequence_parents(len(tokens)),
        draft_probs=probs,
        forward_seconds=sum(step.forward_seconds for step in steps),
    )
