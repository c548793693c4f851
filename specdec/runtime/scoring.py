"""Scoring a committed sequence + a draft tree in one forward pass, on a reusable cache.

`score_tree` brings the cache to the committed sequence (reusing the longest common prefix,
always re-forwarding at least the last committed token, whose logits give row 0) and scores
the tree's nodes in the same pass. The returned logits follow the verification row layout:
row 0 after the committed prefix, row i + 1 after the path root → node i. `commit_path`
then keeps the committed tokens and the accepted nodes in the cache and drops the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specdec.runtime.kv import TreeKVCache
from specdec.trees import DraftTree, sequence_parents


@dataclass
class TreeScore:
    logits: torch.Tensor  # float32 [n + 1, V], verification row layout
    pending_len: int  # committed tokens forwarded with the tree in this pass (>= 1)
    reused: int  # committed tokens whose cache entries were reused
    restored: int = 0  # of which taken from the engine's prefix cache in this call


# Longer runs of uncached committed tokens are prefilled in a pass of their own, off the CPU (a
# captured pass's query buckets stay small); on the CPU up to a prefill chunk goes with the tree in
# one pass (TreeKVCache.pending_limit): a pass of few rows costs about a whole weight read there.
MAX_PENDING = 32


class Prepared(NamedTuple):
    reused: int  # committed tokens whose entries the cache holds (restored ones included)
    pending: list[int]  # committed tokens still to forward (at least the last)
    restored: int  # entries taken from the engine's prefix cache (specdec.runtime.prefix_cache)


def prepare(kv: TreeKVCache, committed: Sequence[int], max_pending: int | None = None) -> Prepared:
    """Roll the cache back to the longest reusable prefix of `committed`, then extend it with the
    engine's cached blocks of the rest (TreeKVCache.restore_prefix), and prefill all but the
    pending run of what is left (`prefill_head`)."""
    reused, restored = reuse(kv, committed)
    return Prepared(reused, prefill_head(kv, committed[reused:], max_pending), restored)


def reuse(kv: TreeKVCache, committed: Sequence[int]) -> tuple[int, int]:
    """Bring the cache to the longest prefix of `committed` it holds or can restore from the engine's
    prefix cache, the last committed token left out: (tokens reused, of which restored)."""
    if not committed:
        raise ValueError("the committed sequence must hold at least one token")
    kv.truncate(min(kv.common_prefix(committed), len(committed) - 1))
    restored = kv.restore_prefix(committed[:-1])
    return kv.prefix_len, restored


def prefill_head(kv: TreeKVCache, new: Sequence[int], max_pending: int | None = None) -> list[int]:
    """Prefill the head of `new` (the uncached committed tokens) and return the pending run that goes
    with the tree in the next pass.

    The last committed token is always pending so that its logits
    (the distribution of the next token) come out of the next forward pass. When more than
    `max_pending` tokens are uncached (a new prompt), all but a tail are prefilled first in chunks
    with the model's plain causal mask, so no [q, kv] tree mask the size of the prompt is built.
    The tail (1 to `max_pending` tokens, fewer where the runner cuts prefill chunks beside other
    sessions; the cut applies to any run of pending tokens, so a short prompt or a chat turn's new
    tokens do not ride whole in a pass that other sessions' steps wait for) goes with the tree in
    the next pass: the prompt's last, partial chunk and the draft
    share one pass, where prefilling all but the last token cost one pass more per new prompt (a
    whole decode step; rows are bitwise the same either way at int8, docs/algorithms.md §14).
    In steady state one or a few tokens are pending and everything is one pass.
    """
    pending = list(new)
    if len(pending) > 1:
        limit = max(1, max_pending if max_pending is not None else kv.pending_limit(MAX_PENDING))
        cut = kv.chunk_tokens(limit)  # the limit, or fewer beside other sessions' passes
        if len(pending) > cut:
            tail = (len(pending) - 1) % cut + 1
            kv.prefill(pending[:-tail])
            pending = pending[-tail:]
    return pending


def tree_block(pending_len: int, tree: DraftTree) -> list[int]:
    """Block parents for `pending` (a chain) followed by the tree's nodes (hanging off its end)."""
    parents = sequence_parents(pending_len)
    parents += [pending_len - 1 if p < 0 else pending_len + p for p in tree.parents]
    return parents


def score_tree(
    kv: TreeKVCache, committed: Sequence[int], tree: DraftTree, max_pending: int | None = None
) -> TreeScore:
    """One forward pass over the pending committed tokens and every tree node. A new prompt's run
    is sized and carried in the runner's prefill turn (TreeKVCache.pending_turn)."""
    reused, restored = reuse(kv, committed)
    with kv.pending_turn(len(committed) - reused):
        pending = prefill_head(kv, committed[reused:], max_pending)
        tokens = pending + list(tree.tokens)
        logits = kv.extend(tokens, tree_block(len(pending), tree), rows_from=len(pending) - 1)
    return TreeScore(logits=logits, pending_len=len(pending), reused=reused, restored=restored)


def commit_path(kv: TreeKVCache, pending_len: int, accepted_nodes: Sequence[int]) -> None:
    """Keep the pending tokens and the accepted nodes (a root-to-node path) in the cache."""
    kv.settle(list(range(pending_len)) + [pending_len + int(node) for node in accepted_nodes])
