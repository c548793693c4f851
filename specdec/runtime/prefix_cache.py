"""An engine's prefix cache: KV entries of token prefixes that any later session may start from.

Entries are kept in blocks of BLOCK_TOKENS tokens at block-aligned positions. A block's key is a
chained SHA-256: key(i) = H(key(i − 1) ‖ tokens of block i), with key(−1) = H(partition). So a key
names the partition and every token from position 0 to the block's end, which are all a block's
keys and values depend on (docs/algorithms.md §16). A lookup walks the prompt's blocks from the
start and stops at the first miss: the hit is the longest cached block-aligned prefix.

Sessions copy a hit into their own cache (a contiguous buffer, or a slot of the CUDA pool), so the
attention kernels, the captured graphs and the exact float64 attention of int8 models see the same
layout as ever; the copy costs a memory move, against a forward pass for a miss. Blocks are
immutable once stored: a session that took a block holds a reference to its tensors, so eviction
only drops the store's reference and never touches what a live session uses.

Eviction is least recently used, bounded by bytes. A lookup touches its blocks last-to-first, so a
chain's first blocks are the most recently used of it: the tail of a prefix goes before its head,
and a stored block's parent is (nearly) always stored too.

The partition keeps tenants apart: a block stored under one partition cannot be found from another,
so one tenant cannot learn from a faster first token or from `cached_tokens` that another sent a
prompt (the membership probe of tests/runtime/test_prefix_cache.py).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK_TOKENS = 16
# Layer states of one block: per layer (keys, values), each [1, kv heads, BLOCK_TOKENS, head dim].
LayerStates = list[tuple[torch.Tensor, torch.Tensor]]


def root_key(partition: str) -> bytes:
    """The key before a prefix's first block: the partition alone."""
    return hashlib.sha256(b"specdec-prefix\x00" + partition.encode("utf-8")).digest()


def next_key(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The key of the block of `tokens` that follows the block (or root) keyed `previous`."""
    return hashlib.sha256(previous + array("q", tokens).tobytes()).digest()


def block_keys(partition: str, tokens: Sequence[int], block: int = BLOCK_TOKENS) -> list[bytes]:
    """Keys of every full block of `tokens`, in order."""
    keys, key = [], root_key(partition)
    for begin in range(0, len(tokens) - block + 1, block):
        key = next_key(key, tokens[begin:begin + block])
        keys.append(key)
    return keys


@dataclass(frozen=True)
class PrefixBlock:
    states: LayerStates
    nbytes: int


class PrefixStore:
    """Blocks of KV entries by key, least recently used evicted first, within `max_bytes`.

    Thread-safe: engines' sessions look up and store from their worker threads.
    """

    def __init__(self, max_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[bytes, PrefixBlock] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.bytes = 0
        self.lookups = 0  # lookups of at least one full block
        self.hits = 0  # lookups that found at least one block
        self.queried_tokens = 0  # tokens of full blocks looked up
        self.hit_tokens = 0  # tokens found
        self.stored_blocks = 0
        self.evictions = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blocks

    def lookup(self, keys: Sequence[bytes]) -> list[PrefixBlock]:
        """The stored blocks of the longest run of `keys` from the first (a chain's keys in order)."""
        with self._lock:
            found: list[PrefixBlock] = []
            for key in keys:
                block = self._blocks.get(key)
                if block is None:
                    break
                found.append(block)
            for key in reversed(keys[:len(found)]):  # the head of the chain ends most recently used
                self._blocks.move_to_end(key)
            if keys:
                self.lookups += 1
                self.hits += bool(found)
                self.queried_tokens += len(keys) * self.block_tokens
                self.hit_tokens += len(found) * self.block_tokens
            return found

    def store(self, key: bytes, states: LayerStates) -> bool:
        """Keep a block (its tensors must be the store's own: nothing may write them afterwards).
        False when it is there already or cannot fit at all."""
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in states)
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return False
            if nbytes > self.max_bytes:
                return False
            while self.bytes + nbytes > self.max_bytes:
                _, evicted = self._blocks.popitem(last=False)
                self.bytes -= evicted.nbytes
                self.evictions += 1
            self._blocks[key] = PrefixBlock(states, nbytes)
            self.bytes += nbytes
            self.stored_blocks += 1
            return True

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.bytes = 0

    def stats(self) -> dict[str, int]:
        """Counters and gauges for /metrics (prefix_cache_* in orchestrator.metrics)."""
        with self._lock:
            return {
                "prefix_cache_lookups": self.lookups,
                "prefix_cache_hits": self.hits,
                "prefix_cache_queried_tokens": self.queried_tokens,
                "prefix_cache_hit_tokens": self.hit_tokens,
                "prefix_cache_blocks": len(self._blocks),
                "prefix_cache_bytes": self.bytes,
                "prefix_cache_budget_bytes": self.max_bytes,
                "prefix_cache_stored_blocks": self.stored_blocks,
                "prefix_cache_evictions": self.evictions,
            }


@dataclass
class PrefixLink:
    """A session cache's tie to the engine's store: the partition its blocks go under, and the keys
    of its prefix's full blocks already known to be stored (so each block is hashed and copied once)."""

    store: PrefixStore
    partition: str = ""
    published: list[bytes] | None = None

    def __post_init__(self) -> None:
        self.published = self.published or []

    def repartition(self, partition: str) -> None:
        """A call under another partition: what was published under the old one is not this one's."""
        if partition != self.partition:
            self.partition, self.published = partition, []
