"""An engine's prefix cache: KV entries of token prefixes that any later session may start from.

Entries are kept in blocks of BLOCK_TOKENS tokens at block-aligned positions. A block's key is a
chained SHA-256: key(i) = H(key(i − 1) ‖ tokens of block i), with key(−1) = H(partition). So a key
names the partition and every token from position 0 to the block's end, which are all a block's
keys and values depend on (docs/algorithms.md §16). A lookup walks the prompt's blocks from the
start and stops at the first miss: the hit is the longest cached block-aligned prefix, then as much
of the partial block stored after it as the prompt agrees with. A session stores partial blocks when
it ends (`tail_key`: its last one, and its last full block less a token), so a conversation's next
turn, which resends that session's tokens and more, goes on from its last cached entry instead of
its last block boundary.

Sessions copy a hit into their own cache (a contiguous buffer, or a slot of the CUDA pool), so the
attention kernels, the captured graphs and the pass-invariant attention of int8 models see the same
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

from specdec.trees import common_prefix

BLOCK_TOKENS = 16
# Layer states of one block: per layer (keys, values), each [1, kv heads, BLOCK_TOKENS, head dim].
LayerStates = list[tuple[torch.Tensor, torch.Tensor]]


def root_key(partition: str) -> bytes:
    """The key before a prefix's first block: the partition alone."""
    return hashlib.sha256(b"specdec-prefix\x00" + partition.encode("utf-8")).digest()


def next_key(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The key of the block of `tokens` that follows the block (or root) keyed `previous`."""
    return hashlib.sha256(previous + array("q", tokens).tobytes()).digest()


def tail_key(previous: bytes) -> bytes:
    """The key of the partial block stored after the block keyed `previous` (one per block: the
    block itself holds its tokens, and a lookup takes as many of them as the prompt agrees with, so
    a session whose last tokens the next prompt does not resend still gives the rest)."""
    return hashlib.sha256(b"specdec-tail\x00" + previous).digest()


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
    token_ids: tuple[int, ...] = ()  # a partial block's tokens (its key does not name them)

    @property
    def tokens(self) -> int:
        """Entries held: the store's block size, or fewer for a session's last, partial block."""
        return self.states[0][0].shape[-2]


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

    def lookup(self, keys: Sequence[bytes], tokens: Sequence[int] = (), previous: bytes | None = None
               ) -> list[PrefixBlock]:
        """The stored blocks of the longest run of `keys` from the first (a chain's keys in order).

        Given `previous`, the key before `keys[0]`, and `tokens`, the tokens from `keys[0]`'s block
        on, the run may end in a partial block: the one stored after where the full blocks stopped
        (`tail_key`: a session's last block, stored when it ended), as far as `tokens` agree with it.
        """
        with self._lock:
            found: list[PrefixBlock] = []
            used: list[bytes] = []
            for key in keys:
                block = self._blocks.get(key)
                if block is None:
                    break
                found.append(block)
                used.append(key)
            tail = 0
            if previous is not None:
                key = tail_key(used[-1] if used else previous)
                block = self._blocks.get(key)
                if block is not None:
                    tail = common_prefix(block.token_ids, tokens[len(found) * self.block_tokens:])
                    if tail:
                        found.append(block if tail == block.tokens else PrefixBlock(
                            [(k[..., :tail, :], v[..., :tail, :]) for k, v in block.states], 0))
                        used.append(key)
            for key in reversed(used):  # the head of the chain ends most recently used
                self._blocks.move_to_end(key)
            if keys or tail:
                self.lookups += 1
                self.hits += bool(found)
                self.queried_tokens += len(keys) * self.block_tokens + tail
                self.hit_tokens += sum(block.tokens for block in found)
            return found

    def store(self, key: bytes, states: LayerStates, token_ids: tuple[int, ...] = ()) -> bool:
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
            self._blocks[key] = PrefixBlock(states, nbytes, token_ids)
            self.bytes += nbytes
            self.stored_blocks += 1
            return True

    def store_tail(self, previous: bytes, tokens: Sequence[int], states: LayerStates) -> bool:
        """Keep a session's last, partial block (fewer tokens than a block) after the block keyed
        `previous`, in place of the one stored there before (the most recent conversation wins)."""
        if not 0 < len(tokens) < self.block_tokens:
            raise ValueError(f"a partial block holds 1 to {self.block_tokens - 1} tokens, got {len(tokens)}")
        key = tail_key(previous)
        with self._lock:
            stored = self._blocks.get(key)
            if stored is not None and stored.token_ids == tuple(tokens):
                self._blocks.move_to_end(key)
                return False
            if stored is not None:
                del self._blocks[key]
                self.bytes -= stored.nbytes
        return self.store(key, states, tuple(int(t) for t in tokens))

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
