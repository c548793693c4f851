"""A minimal speculative-decoding loop over the two engines, following the session protocol.

Test-only: it is the smallest client that exercises every engine path (reuse, partial
acceptance, RD's no-draft and extra-pass steps, trees) the way the orchestrator will.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from specdec.engine.api import DraftRequest, VerifyRequest
from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.sampling import SamplingParams
from specdec.verification.base import MethodParams


@dataclass
class LoopStats:
    iterations: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_reused: list[int] = field(default_factory=list)
    verify_reused: list[int] = field(default_factory=list)
    lengths_before: list[int] = field(default_factory=list)  # committed length at each iteration's start


def speculate(
    drafter: DrafterEngine,
    verifier: VerifierEngine,
    session_id: str,
    prompt: list[int],
    max_new: int,
    method: str,
    shape: list[int],
    sampling: SamplingParams,
    draft_sampling: SamplingParams | None = None,
    seed: int = 0,
    a: float = 1.0,
    k_max: int = 0,
    coin_seed: int = 0,
) -> tuple[list[int], LoopStats]:
    """Generate `max_new` tokens (the last iteration may overshoot; the result is cut)."""
    committed = list(prompt)
    told_drafter = told_verifier = 0  # committed length each engine knows
    stats = LoopStats()
    coins = random.Random(coin_seed)
    while len(committed) - len(prompt) < max_new:
        stats.lengths_before.append(len(committed))
        this_shape, leaf_rows = list(shape), False
        if method == "rd":  # leading heads of Bernoulli(a) coins, capped at k_max
            heads = 0
            while heads < k_max and coins.random() < a:
                heads += 1
            this_shape, leaf_rows = list(range(-1, heads - 1)), heads < k_max
        draft = drafter.draft(
            DraftRequest(
                session_id,
                told_drafter,
                committed[told_drafter:],
                this_shape,
                draft_sampling or sampling,
                seed,
                strategy="race" if method == "ersd" else "sample",
                want_distributions=method != "ersd",
                include_leaf_rows=leaf_rows,
            )
        )
        told_drafter = len(committed)
        outcome = verifier.verify(
            VerifyRequest(
                session_id,
                told_verifier,
                committed[told_verifier:],
                draft.tokens,
                draft.parents,
                method,
                MethodParams(a=a, k_max=k_max, seed=seed, position=len(committed)),
                sampling,
                draft.draft_probs,
            )
        )
        told_verifier = len(committed)
        assert outcome.tokens[:-1] == [draft.tokens[i] for i in outcome.accepted_nodes]
        committed += outcome.tokens
        assert outcome.committed_len == len(committed)
        stats.iterations += 1
        stats.drafted += len(draft.tokens)
        stats.accepted += len(outcome.accepted_nodes)
        stats.draft_reused.append(draft.reused_tokens)
        stats.verify_reused.append(outcome.reused_tokens)
    return committed[len(prompt) : len(prompt) + max_new], stats


def committed_of(engine: VerifierEngine, session_id: str) -> list[int]:
    """The tokens the engine holds as committed for a session."""
    with engine.sessions.use(session_id, 1) as session:
        return list(session.committed)
