"""Scheduling arithmetic as pure functions: default sizes, RD coins, depth caps, calibration.

None of these choices can change the output distribution (every method is exact for every k,
a and tree shape; docs/algorithms.md §8, "Scheduling"); they only decide how much work an
iteration does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from orchestrator.config import OrchestratorConfig
from specdec.methods import get_method
from specdec.randomness import TorchRandomSource
from specdec.verification.rd import leading_heads


def depth_cap(committed_len: int, max_contexts: Iterable[int]) -> int:
    """Deepest draft that fits every context window (0: no limit) with the extra token committed
    after it."""
    caps = [1 << 30] + [limit - committed_len - 1 for limit in max_contexts if limit]
    return max(0, min(caps))


def default_k(method: str, config: OrchestratorConfig) -> int:
    """Draft length (or RD k_max, or tree budget) when the request gives none."""
    spec = get_method(method)
    if not spec.speculative:
        return 0
    return config.default_tree_budget if spec.k_is_tree_budget else config.default_k


def tree_budget_for(
    method: str, k: int | None, tree_budget: int | None, config: OrchestratorConfig
) -> int | None:
    """Node budget of the draft tree, or None when the method drafts a sequence.

    A tree-only method (gsd-tree) always drafts a tree (tree_budget, else k, else the default);
    a method that drafts either (ersd) drafts a tree only when a budget is asked for (request or
    config), otherwise a sequence of k tokens.
    """
    spec = get_method(method)
    if not spec.drafts_trees:
        return None
    if not spec.drafts_sequences:
        return tree_budget or k or config.default_tree_budget
    return tree_budget or config.ersd_tree_budget


def rd_leading_heads(a: float, k_max: int, seed: int, position: int) -> int:
    """K for the RD iteration starting at `position`: leading heads of Bernoulli(a) coins, ≤ k_max.

    The coins come from their own stream keyed on (seed, "coins", position), so they are
    independent of the drafts and of the verification draws, and a seeded request replays.
    """
    return leading_heads(a, k_max, TorchRandomSource.from_seed(seed, "coins", position))


def cap_depth(shape: Sequence[int], max_depth: int) -> list[int]:
    """Drop the nodes deeper than `max_depth` (and their subtrees), renumbering the rest.

    Used near the end of the context window, where deeper drafts would not fit.
    """
    if max_depth <= 0:
        return []
    new_index: dict[int, int] = {-1: -1}
    depth: dict[int, int] = {-1: 0}
    out: list[int] = []
    for node, parent in enumerate(shape):
        if parent not in new_index:
            continue
        d = depth[parent] + 1
        if d > max_depth:
            continue
        depth[node] = d
        new_index[node] = len(out)
        out.append(new_index[parent])
    return out


def rank_acceptance_from_calibration(
    counts: Mapping[str, int], default: Sequence[float], min_samples: int
) -> list[float]:
    """Measured R(j) = P(the accepted child has rank j) where at least min_samples were seen.

    Ranks with too few observations keep the configured value; min_samples = 0 disables it.
    """
    rates = [float(r) for r in default]
    if min_samples <= 0:
        return rates
    j = 0
    while (trials := counts.get(f"rank_trials@{j}", 0)) > 0:
        measured = trials >= min_samples
        if j == len(rates):
            if not measured:
                break
            rates.append(0.0)
        if measured:
            rates[j] = min(1.0, max(0.0, counts.get(f"rank_hits@{j}", 0) / trials))
        j += 1
    return rates
