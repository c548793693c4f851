"""One speculation iteration run through the enumerating RandomSource, and the exact law of the
first L output tokens of repeated iterations (tests/core/test_fidelity_exact.py explains the method).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specdec.drafting import draft_tree
from specdec.methods import get_method
from specdec.randomness import RandomSource
from specdec.verification.base import MethodParams, VerifyResult
from specdec.verification.dispatch import verify
from specdec.verification.rd import leading_heads

from .helpers_enumeration import enumerate_outcomes, max_abs_difference
from .helpers_toy_models import SAMPLING_VARIANTS, Warped, random_markov

VerifyFn = Callable[..., VerifyResult]

TOLERANCE = 1e-12


def sequence_shape(k: int) -> tuple[int, ...]:
    return tuple(range(-1, k - 1))


def one_iteration(
    method: str,
    shape: Sequence[int],
    target: Warped,
    draft: Warped,
    prefix: Sequence[int],
    source: RandomSource,
    a: float = 1.0,
    k_max: int = 0,
    strategy: str = "sample",
    seed: int = 0,
    verify_fn: VerifyFn = verify,
) -> tuple[int, ...]:
    """One speculation iteration after `prefix`; returns the emitted tokens (`verify_fn` has the
    signature of specdec.verification.dispatch.verify)."""
    params = MethodParams(a=a, k_max=k_max, seed=seed, position=len(prefix))
    if method == "rd":
        shape = sequence_shape(leading_heads(a, k_max, source))
    tree, _ = draft_tree(
        shape, lambda path: draft.probs([*prefix, *path]), strategy, source, seed=seed, position=len(prefix)
    )
    contexts = [list(prefix)] + [[*prefix, *tree.path_tokens(i)] for i in range(len(tree))]
    target_rows = target.rows_for(contexts)
    draft_rows = draft.rows_for(contexts) if get_method(method).needs_rows(params, len(tree)) else None
    return tuple(verify_fn(method, tree, target_rows, draft_rows, params, source).tokens)


def exact_output_distribution(
    method: str, shape: Sequence[int], target: Warped, draft: Warped, length: int, **kwargs
) -> dict[tuple[int, ...], float]:
    """Exact distribution of the first `length` output tokens of repeated iterations.

    One iteration's outcome depends on the prefix only through the models' states (their last
    `order` tokens), so each state is enumerated once.
    """
    memory = max(target.order, draft.order)
    per_state: dict[tuple[int, ...], dict[tuple[int, ...], float]] = {}

    def iteration(prefix: tuple[int, ...]) -> dict[tuple[int, ...], float]:
        state = prefix[len(prefix) - memory :] if memory else ()
        if state not in per_state:
            per_state[state] = enumerate_outcomes(
                lambda source: one_iteration(method, shape, target, draft, prefix, source, **kwargs)
            )
        return per_state[state]

    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    finished: dict[tuple[int, ...], float] = {}
    while frontier:
        following: dict[tuple[int, ...], float] = {}
        for prefix, probability in frontier.items():
            for emitted, p_emitted in iteration(prefix).items():
                extended = prefix + emitted
                bucket = finished if len(extended) >= length else following
                key = extended[:length]
                bucket[key] = bucket.get(key, 0.0) + probability * p_emitted
        frontier = following
    return finished


def toy_pair(order: int, vocab: int, variant: str, seed: int = 0) -> tuple[Warped, Warped]:
    sampling = SAMPLING_VARIANTS[variant]
    target = Warped(random_markov(vocab, order, seed=1000 + seed), sampling)
    draft = Warped(random_markov(vocab, order, seed=2000 + seed, sharpness=2.5), sampling)
    return target, draft


def fidelity_error(
    method: str, shape: Sequence[int], order: int, variant: str, length: int = 3, vocab: int = 4, **kw
) -> float:
    target, draft = toy_pair(order, vocab, variant)
    got = exact_output_distribution(method, shape, target, draft, length, **kw)
    assert abs(sum(got.values()) - 1.0) < TOLERANCE
    return max_abs_difference(got, target.sequence_distribution(length))
