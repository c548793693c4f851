"""Draft trees: the one shape every drafting strategy produces and every method verifies.

A tree holds n draft nodes in topological order: `tokens[i]` is node i's token and
`parents[i]` its parent node (-1 = the root, i.e. the committed prefix). A sequence is a path
(parents = -1, 0, 1, ...), a batch of m alternatives for one position is a star (all -1).
Children of a node are ordered by node index, which is their rank (first drawn / first race
arrival first) — recursive rejection and ERSD rely on that order.

Depth is 1-based: a child of the root has depth 1. Scoring a tree on top of a cached prefix of
length L puts node i at position id L + depth(i) - 1, and lets it attend to the whole prefix,
its ancestors and itself.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class DraftTreeError(ValueError):
    """The tree's tokens/parents are inconsistent."""


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    _children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _depths: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tokens = tuple(int(t) for t in self.tokens)
        parents = tuple(int(p) for p in self.parents)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        if len(tokens) != len(parents):
            raise DraftTreeError(f"{len(tokens)} tokens but {len(parents)} parents")
        children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]  # slot 0 = root
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise DraftTreeError(f"node {i} has parent {parent}; parents must precede their children")
            children[parent + 1].append(i)
        depths = node_depths(parents)
        for i, kids in enumerate(children):
            seen = [tokens[c] for c in kids]
            if len(set(seen)) != len(seen):
                raise DraftTreeError(f"node {i - 1} has repeated child tokens {seen}")
        object.__setattr__(self, "_children", tuple(tuple(k) for k in children))
        object.__setattr__(self, "_depths", tuple(depths))

    # construction -------------------------------------------------------------------------
    @classmethod
    def sequence(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(tuple(tokens), tuple(sequence_parents(len(tokens))))

    @classmethod
    def star(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(tuple(tokens), tuple([-1] * len(tokens)))

    @classmethod
    def empty(cls) -> DraftTree:
        return cls((), ())

    # structure ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> tuple[int, ...]:
        return self._depths

    @property
    def max_depth(self) -> int:
        return max(self._depths, default=0)

    def children(self, node: int) -> tuple[int, ...]:
        """Children of `node` in rank order; node = -1 is the root."""
        return self._children[node + 1]

    def is_leaf(self, node: int) -> bool:
        return not self.children(node)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (empty for the root)."""
        path: list[int] = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path_to(node)]

    def is_sequence(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    # scoring ------------------------------------------------------------------------------
    def ancestor_mask(self) -> torch.Tensor:
        """Bool [n, n]: entry (i, j) is True when node j is node i or one of its ancestors."""
        n = len(self)
        mask = torch.zeros((n, n), dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            mask[i, i] = True
            if parent >= 0:
                mask[i] |= mask[parent]
        return mask

    def attention_mask(self, prefix_len: int) -> torch.Tensor:
        """Bool [n, prefix_len + n]: what each node may attend to (whole prefix + its path)."""
        n = len(self)
        return torch.cat([torch.ones((n, prefix_len), dtype=torch.bool), self.ancestor_mask()], dim=1)

    def position_ids(self, prefix_len: int) -> torch.Tensor:
        """Long [n]: prefix_len + depth - 1 for every node."""
        return torch.tensor([prefix_len + d - 1 for d in self._depths], dtype=torch.long)


def sequence_parents(length: int) -> list[int]:
    """Parent indices of a path of `length` nodes: [-1, 0, 1, …] (each node's parent is the one before)."""
    return list(range(-1, length - 1))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node of a parent list (a child of the root has depth 1; parents come first)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def max_depth(parents: Sequence[int]) -> int:
    """Depth of the deepest node (0 for an empty tree): how many tokens the longest path drafts."""
    return max(node_depths(parents), default=0)


def optimal_tree_shape(rank_acceptance: Sequence[float], budget: int) -> list[int]:
    """Parent indices of the best tree with `budget` nodes under a 0th-order acceptance model.

    `rank_acceptance[j]` is the measured probability that a node's (j+1)-th ranked child is
    accepted. A node's value is the product of these along its path; the best tree of a given
    size is the set of the `budget` highest-valued nodes (values shrink going down or right, so
    that set is always a tree). Built greedily with a heap: popping a node offers its first
    child and its next sibling. Node order is pop order, so parents precede children and
    siblings keep rank order.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    rates = [float(r) for r in rank_acceptance]
    if not rates or budget == 0:
        return []
    if any(not 0.0 <= r <= 1.0 for r in rates):
        raise ValueError("rank acceptance probabilities must lie in [0, 1]")
    parents: list[int] = []
    # heap entries: (-value, tie-break counter, parent node index, rank, parent value)
    counter = 0
    heap: list[tuple[float, int, int, int, float]] = [(-rates[0], counter, -1, 0, 1.0)]
    while heap and len(parents) < budget:
        neg_value, _, parent, rank, parent_value = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent)
        value = -neg_value
        counter += 1
        heapq.heappush(heap, (-(value * rates[0]), counter, node, 0, value))
        if rank + 1 < len(rates):
            counter += 1
            heapq.heappush(heap, (-(parent_value * rates[rank + 1]), counter, parent, rank + 1, parent_value))
    return parents


def expected_accepted(parents: Sequence[int], rank_acceptance: Sequence[float]) -> float:
    """Expected number of accepted draft nodes of a tree under the 0th-order model."""
    value: list[float] = []
    sibling_rank: dict[int, int] = {}
    for parent in parents:
        rank = sibling_rank.get(parent, 0)
        sibling_rank[parent] = rank + 1
        base = 1.0 if parent < 0 else value[parent]
        value.append(base * (rank_acceptance[rank] if rank < len(rank_acceptance) else 0.0))
    return float(sum(value))
