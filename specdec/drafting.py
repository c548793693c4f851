"""Choosing draft tokens from draft distributions — shared by the drafter engine and the tests.

Two strategies:
  sample  children of a node are drawn from Q *without replacement* (draw, zero it out,
          renormalise, draw again), so the first child is an ordinary sample from Q;
  race    ERSD: children are the first m arrivals of the node's position-keyed race under Q.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.races import race, race_arrivals
from specdec.randomness import RandomSource
from specdec.trees import DraftTree


def select_children(
    q_row: torch.Tensor,
    m: int,
    strategy: str,
    source: RandomSource | None = None,
    race_e: torch.Tensor | None = None,
) -> list[int]:
    """Up to m distinct tokens for the children of one node (fewer if Q has less support)."""
    if strategy == "race":
        if race_e is None:
            raise ValueError("race strategy needs the node's race vector")
        return race_arrivals(race_e, q_row, m)
    if strategy != "sample":
        raise ValueError(f"unknown draft strategy {strategy!r}")
    if source is None:
        raise ValueError("sample strategy needs a RandomSource")
    remaining = q_row.detach().to("cpu", torch.float64).clone()
    chosen: list[int] = []
    for _ in range(m):
        total = float(remaining.sum())
        if total <= 0:
            break
        token = source.categorical(remaining / total)
        chosen.append(token)
        remaining[token] = 0.0
    return chosen


def draft_tree(
    shape_parents: Sequence[int],
    q_of_path: Callable[[list[int]], torch.Tensor],
    strategy: str,
    source: RandomSource | None = None,
    seed: int = 0,
    position: int = 0,
) -> tuple[DraftTree, dict[int, torch.Tensor]]:
    """Fill a tree shape with tokens, one node's children at a time (reference implementation).

    `q_of_path(tokens)` returns the warped draft row after the committed prefix + `tokens`.
    Returns the tree (nodes renumbered if Q's support ran out) and the rows used, keyed by
    node index (-1 = root). The drafter engine batches the forward passes level by level but
    selects children with the same `select_children`, in the same node order.
    """
    want: dict[int, int] = {}
    for parent in shape_parents:
        want[parent] = want.get(parent, 0) + 1
    tokens: list[int] = []
    parents: list[int] = []
    rows: dict[int, torch.Tensor] = {}
    old_to_new: dict[int, int] = {-1: -1}
    depth_of: dict[int, int] = {-1: 0}
    # Shape nodes are in topological order; expand each shape parent when its first child appears.
    expanded: dict[int, list[int]] = {}
    for shape_index, shape_parent in enumerate(shape_parents):
        new_parent = old_to_new.get(shape_parent)
        if new_parent is None:  # the parent was dropped (support ran out): drop the subtree
            continue
        if shape_parent not in expanded:
            path = [] if new_parent < 0 else [tokens[i] for i in _path(parents, new_parent)]
            row = q_of_path(path)
            rows[new_parent] = row
            e = race(seed, position + depth_of[new_parent], row.shape[-1]) if strategy == "race" else None
            expanded[shape_parent] = select_children(row, want[shape_parent], strategy, source, e)
        choices = expanded[shape_parent]
        if not choices:
            continue
        token = choices.pop(0)
        old_to_new[shape_index] = len(tokens)
        depth_of[len(tokens)] = depth_of[new_parent] + 1
        tokens.append(token)
        parents.append(new_parent)
    return DraftTree(tuple(tokens), tuple(parents)), rows


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def guess_tokens(
    logits: torch.Tensor,
    warped: torch.Tensor,
    m: int,
    strategy: str,
    race_e: torch.Tensor | None = None,
    exclude: int | None = None,
) -> list[int]:
    """The m likeliest tokens of one position, for pipelined look-ahead guesses (never `exclude`).

    `warped` (the warped draft row) is read by the "race" strategy only.

    "sample": by the drafter's logits, highest first (ties: lowest id), so greedy and top-k
    rows, whose warped support is one or few tokens, still yield m guesses. "race": the first
    arrivals of the verifier's race at that position under the warped draft row (ERSD's target
    token is that race's winner under P, so the draft's early arrivals are its best guesses),
    then by logits when the row's support holds fewer than m tokens. Guesses only decide which
    pre-drafts are made, never what is emitted.
    """
    if m <= 0:
        return []
    wanted = m + (exclude is not None)
    if strategy not in ("race", "sample"):
        raise ValueError(f"unknown draft strategy {strategy!r}")
    order: list[int] = []
    if strategy == "race":
        if race_e is None:
            raise ValueError("race guesses need the position's race vector")
        order = race_arrivals(race_e, warped, wanted)
    if len(order) < wanted:  # "sample", or a race row whose support is smaller (greedy, top-k)
        values = logits.detach().to("cpu", torch.float32)
        top = torch.topk(values, min(wanted + len(order), values.numel())).indices.tolist()
        ranked = sorted(top, key=lambda t: (-float(values[t]), t))  # ties: lowest id first
        order += [t for t in ranked if t not in order][: wanted - len(order)]
    return [int(t) for t in order if t != exclude][:m]
