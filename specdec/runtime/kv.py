"""A per-session KV cache that can hold a token tree and roll back to any prefix.

Layout of the cache entries along the sequence dimension:

    [ prefix (linear: entry i holds token i) | block (a tree hanging off the prefix's end) ]

Every forward pass appends entries to the block. A block entry names its parent block entry
(-1 = the end of the prefix), so committed tokens not yet cached are a chain in the block and
draft-tree nodes hang off that chain. An entry attends to the whole prefix plus its own
ancestors and itself, at position id len(prefix) + depth − 1 — exactly what the model would
compute for that root-to-node path on its own. After the step, `settle(path)` keeps one chain
of the block as the new end of the prefix (gathering entries along the sequence dimension) and
drops the rest; `truncate(n)` rolls back to a shorter prefix. No accepted token is recomputed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specdec.runtime.lean_forward import causal_lm_logits
from specdec.runtime.prefix_cache import PrefixLink, block_keys, next_key, root_key
from specdec.trees import common_prefix, sequence_parents


class CacheError(RuntimeError):
    """Inconsistent use of the cache (a bug in the caller, not a bad request)."""


@dataclass
class ExtendPlan:
    """One extension of a cache, worked out before it runs (alone or in a batched pass)."""

    tokens: list[int]
    parents: list[int]
    rows_from: int
    allowed: torch.Tensor  # bool [n_new, cached entries + n_new]: which entries each new one sees
    positions: list[int]  # position id of each new entry
    visible: torch.Tensor  # the block's ancestor-or-self matrix once the entries are in
    depths: list[int]  # depth of every block entry once the entries are in


class ForwardRunner(Protocol):
    """Runs caches' passes for them (specdec.runtime.batching.ForwardBatcher)."""

    def extend(self, kv: TreeKVCache, plan: ExtendPlan) -> torch.Tensor: ...

    def alone(self, run: Callable[[], None]) -> None: ...

    @property
    def joins_prefill(self) -> bool: ...

    def prefill(self, kv: TreeKVCache, plan: ExtendPlan) -> None: ...

    def prefill_chunk_tokens(self, kv: TreeKVCache, whole: int) -> int: ...

    def prefill_turn(self, pending: int | None = None, kv: TreeKVCache | None = None
                     ) -> AbstractContextManager[None]: ...

    @property
    def prefill_turn_tokens(self) -> int: ...


# A prompt is prefilled in passes of at most this many tokens: 512 on every device. On the CPU each
# pass reads every weight once more, so fewer, wider passes are cheaper: on a 2-vCPU Zen 4 EPYC
# (fbgemm at every width) a 427-token prompt on the served path took 2.266 s in 128-token chunks
# and 2.139 s in 512-token ones, against 2.105 s for the model's own forward in one pass, as plain
# HF's generate runs it (bench/results/zen4-2026-12-06/prefill-chunk.txt); on an AMX Xeon
# (oneDNN's quantised linear) 1.27 s against 1.51 s at 128. (128 was the CPU's chunk while
# attention ran in float64, whose [heads, chunk, context] scores then cost more than the extra
# weight reads.) Fewer while other sessions decode beside the chunk
# (ForwardBatcher.prefill_chunk_tokens, applied to every pending run: scoring.prefill_head). Either
# way a long prompt's attention scores are [heads, chunk, context], not [heads, context, context];
# the rows are bitwise those of one pass at int8 (§14).
PREFILL_CHUNK = 512


def prefill_chunk(device: torch.device | str, model: Any = None) -> int:
    """Tokens per prefill pass; on the CPU at least as many as the int8 model's faster wide kernel
    needs (specdec.runtime.int8_kernels sets the row count where it takes over)."""
    wide = getattr(model, "specdec_int8_wide_rows", None) if torch.device(device).type == "cpu" else None
    return max(PREFILL_CHUNK, wide) if isinstance(wide, int) else PREFILL_CHUNK


def model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    """Device of the model and the float dtype its attention masks use."""
    parameter = next(model.parameters())
    return parameter.device, parameter.dtype


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, the dtype's most negative value elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


@torch.inference_mode()  # the buffers of a pass in inference mode are inference tensors (batching)
def _append(buffer: torch.Tensor | None, current: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`new` appended to `current` inside `buffer` (a fresh one, with spare room, when it cannot)."""
    length, extra = (current.shape[-2] if current.dim() == new.dim() else 0), new.shape[-2]
    in_place = (buffer is not None and current.numel() and current.data_ptr() == buffer.data_ptr()
                and current.stride() == buffer.stride() and current.shape[:-2] == new.shape[:-2]
                and buffer.dtype == new.dtype and length + extra <= buffer.shape[-2])
    if not in_place:
        room = length + extra + max(64, (length + extra) // 4)
        buffer = new.new_empty((*new.shape[:-2], room, new.shape[-1]))
        if length:
            buffer[..., :length, :].copy_(current)
    assert buffer is not None
    buffer[..., length:length + extra, :].copy_(new)
    return buffer


@functools.cache
def growing_layer_class():
    """transformers' DynamicLayer, appending into spare room instead of concatenating.

    DynamicLayer copies a session's whole cache on every pass (torch.cat), O(context) per layer
    per pass; here a pass writes only its new entries (the buffer grows by a quarter when full).
    Views handed out stay valid until the next pass of the session, which is all a pass needs.
    """
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        _key_buffer: torch.Tensor | None = None
        _value_buffer: torch.Tensor | None = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            length = self.get_seq_length() + key_states.shape[-2]
            self._key_buffer = _append(self._key_buffer, self.keys, key_states)
            self._value_buffer = _append(self._value_buffer, self.values, value_states)
            self.keys = self._key_buffer[..., :length, :]
            self.values = self._value_buffer[..., :length, :]
            return self.keys, self.values

    return GrowingLayer


def growing_cache(config):
    """A DynamicCache whose layers append in place (growing_layer_class) where they are plain
    DynamicLayers: a session's cache, and a batched pass's cache of many sessions."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if all(type(layer).__name__ == "DynamicLayer" for layer in getattr(cache, "layers", ())):
        growing = growing_layer_class()
        cache.layers = [growing() for _ in cache.layers]
    return cache


class TreeKVCache:
    def __init__(
        self, model, lock: threading.Lock | None = None, runner: ForwardRunner | None = None
    ) -> None:
        self.model = model
        self.lock = lock  # held around forward passes (one pass at a time per model) when given
        # Runs this cache's passes, possibly batched with other caches' (specdec.runtime.batching);
        # None: each pass runs here, under `lock`.
        self.runner = runner
        # The engine's prefix cache (specdec.runtime.prefix_cache): where the prefix's full blocks
        # are published and a new prompt's cached blocks come from; None: no prefix cache.
        self.prefix_link: PrefixLink | None = None
        self.cache = growing_cache(model.config)
        self.prefix: list[int] = []
        self.block_tokens: list[int] = []
        self.block_parents: list[int] = []
        self._block_depths: list[int] = []
        # Bool [b, b]: ancestor-or-self among block entries; grown as entries are appended.
        self._block_visible = torch.zeros((0, 0), dtype=torch.bool)

    # state ------------------------------------------------------------------------------------
    @property
    def prefix_len(self) -> int:
        return len(self.prefix)

    @property
    def block_len(self) -> int:
        return len(self.block_tokens)

    def physical_len(self) -> int:
        return self.cache.get_seq_length()

    def pending_limit(self, elsewhere: int) -> int:
        """Most uncached committed tokens a pass takes with a draft tree: a prefill chunk on the CPU,
        `elsewhere` on other devices (more are prefilled first, specdec.runtime.scoring.prefill_head)."""
        device, _ = model_device_dtype(self.model)
        return prefill_chunk(device, self.model) if device.type == "cpu" else elsewhere

    def common_prefix(self, tokens: Sequence[int]) -> int:
        """Length of the longest common prefix of `tokens` and the cached prefix."""
        return common_prefix(self.prefix, tokens)

    def depth(self, entry: int) -> int:
        return self._block_depths[entry]

    def path_to(self, entry: int) -> list[int]:
        """Block entries from the prefix's end down to `entry` (inclusive)."""
        path = []
        while entry >= 0:
            path.append(entry)
            entry = self.block_parents[entry]
        return path[::-1]

    # rollback -----------------------------------------------------------------------------------
    def truncate(self, length: int) -> None:
        """Drop the block and keep only the first `length` prefix entries."""
        if not 0 <= length <= self.prefix_len:
            raise CacheError(f"cannot truncate a prefix of {self.prefix_len} entries to {length}")
        self._keep_first(length)
        self.prefix = self.prefix[:length]
        self._clear_block()
        if self.prefix_link is not None:
            del self.prefix_link.published[length // self.prefix_link.store.block_tokens:]

    def settle(self, path: Sequence[int]) -> None:
        """Make the chain of block entries `path` (from the prefix's end down) part of the prefix.

        Every other block entry is dropped. When the chain is the block's first entries in
        order (a sequence draft, fully accepted) this is a plain crop; otherwise the kept
        entries are first copied into place along the sequence dimension (O(path) per layer).
        """
        path = [int(e) for e in path]
        for i, entry in enumerate(path):
            expected_parent = path[i - 1] if i > 0 else -1
            if not 0 <= entry < self.block_len or self.block_parents[entry] != expected_parent:
                raise CacheError(f"block entries {path} are not a chain from the prefix's end")
        start = self.prefix_len
        if path != list(range(len(path))):
            self._move_into_place(start, path)
        self._keep_first(start + len(path))
        self.prefix = self.prefix + [self.block_tokens[e] for e in path]
        self._clear_block()
        self.publish()

    def _clear_block(self) -> None:
        self.block_tokens = []
        self.block_parents = []
        self._block_depths = []
        self._block_visible = torch.zeros((0, 0), dtype=torch.bool)

    def _layers(self):
        layers = getattr(self.cache, "layers", None)
        if layers is None:
            raise CacheError("this transformers version's DynamicCache has no .layers")
        return layers

    def _keep_first(self, length: int) -> None:
        for layer in self._layers():
            if getattr(layer, "is_sliding", False):
                raise CacheError("sliding-window attention layers are not supported by the tree cache")
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            if layer.keys.shape[-2] > length:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    @torch.inference_mode()  # as _append: the buffers may be inference tensors
    def _move_into_place(self, start: int, path: list[int]) -> None:
        """Copy the kept block entries to start, start + 1, ... (only the block's tail is touched)."""
        for layer in self._layers():
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            source = torch.tensor(path, dtype=torch.long, device=layer.keys.device) + start
            # Advanced indexing copies the source first, so overlapping ranges are safe.
            layer.keys[..., start : start + len(path), :] = layer.keys[..., source, :]
            layer.values[..., start : start + len(path), :] = layer.values[..., source, :]

    # forward ----------------------------------------------------------------------------------
    def extend(self, tokens: Sequence[int], parents: Sequence[int], rows_from: int = 0) -> torch.Tensor:
        """Forward new block entries in one pass; return float32 logits of entries rows_from.. [m, V].

        `parents[j]` is a block entry index (an existing one, or a new one earlier in this call)
        or -1 for the prefix's end. Only the logits of the new entries from `rows_from` on are
        projected to the vocabulary (long committed chains need just their last row). With a
        runner (specdec.runtime.batching) the pass may be shared with other sessions' caches.
        """
        plan = self.plan(tokens, parents, rows_from)
        logits = self.runner.extend(self, plan) if self.runner is not None else self.forward(plan)
        self.apply(plan)
        return logits

    def plan(self, tokens: Sequence[int], parents: Sequence[int], rows_from: int = 0) -> ExtendPlan:
        """Check an extension and work out its attention mask and positions (nothing runs yet)."""
        n_new = len(tokens)
        if n_new == 0 or len(parents) != n_new:
            raise CacheError(
                f"extend needs >= 1 entry and one parent each ({n_new} tokens, {len(parents)} parents)"
            )
        if not 0 <= rows_from < n_new:
            raise CacheError(f"rows_from must lie in [0, {n_new}), got {rows_from}")
        if self.physical_len() != self.prefix_len + self.block_len:
            raise CacheError("cache entries and bookkeeping disagree")
        old_b = self.block_len
        new_b = old_b + n_new
        visible = torch.zeros((new_b, new_b), dtype=torch.bool)
        visible[:old_b, :old_b] = self._block_visible
        depths = list(self._block_depths)
        for j, parent in enumerate(parents):
            entry = old_b + j
            parent = int(parent)
            if not -1 <= parent < entry:
                raise CacheError(f"new block entry {entry} has parent {parent}")
            visible[entry, entry] = True
            if parent >= 0:
                visible[entry] |= visible[parent]
            depths.append(1 if parent < 0 else depths[parent] + 1)
        prefix_len = self.prefix_len
        allowed = torch.cat(
            [torch.ones((n_new, prefix_len), dtype=torch.bool), visible[old_b:new_b, :new_b]], dim=1
        )
        positions = [prefix_len + d - 1 for d in depths[old_b:]]
        return ExtendPlan([int(t) for t in tokens], [int(p) for p in parents], rows_from, allowed,
                          positions, visible, depths)

    def forward(self, plan: ExtendPlan) -> torch.Tensor:
        """Run `plan` on this cache alone (appending its entries); logits of rows rows_from.. [m, V]."""
        device, dtype = model_device_dtype(self.model)
        n_new = len(plan.tokens)
        with self.lock or nullcontext(), torch.no_grad():
            logits = causal_lm_logits(
                self.model,
                torch.tensor([plan.tokens], dtype=torch.long, device=device),
                # Additive float mask: eager attention adds it to the scores, sdpa accepts it as is.
                additive_mask(plan.allowed, dtype)[None, None].to(device),
                torch.tensor([plan.positions], dtype=torch.long, device=device),
                self.cache,
                n_new - plan.rows_from,
            )
        return logits[0].float()

    def _count_appended(self, n: int) -> None:
        """`n` entries were written past the cached ones (a growing cache counts its own; a pooled
        slot keeps its length itself)."""

    def apply(self, plan: ExtendPlan) -> None:
        """Record the entries a pass appended for `plan` (after `forward` or a batched pass)."""
        self._count_appended(len(plan.tokens))
        self.block_tokens.extend(plan.tokens)
        self.block_parents.extend(plan.parents)
        self._block_depths = plan.depths
        self._block_visible = plan.visible
        if self.physical_len() != self.prefix_len + self.block_len:
            raise CacheError("the model did not append one cache entry per input token")

    def cache_layers(self) -> Sequence[Any]:
        """The cache's layers: a ragged pass appends a session's new entries to them itself
        (specdec.runtime.ragged)."""
        return self._layers()

    def drop_entries_after(self, length: int) -> None:
        """Drop entries past `length` that no plan recorded (a ragged pass that failed midway)."""
        self._keep_first(length)

    def layer_states(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Keys and values [1, heads, entries, dim] per layer (None where a layer holds nothing yet)."""
        return [
            (layer.keys, layer.values) if getattr(layer, "keys", None) is not None and layer.keys.numel()
            else None
            for layer in self._layers()
        ]

    def append_layer_entries(self, states: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append new entries, keys and values [1, heads, n, dim] per layer, after the cached ones (a
        batched pass hands a session its new entries: copied into the session's own buffers)."""
        layers = self._layers()
        if len(states) != len(layers):
            raise CacheError(f"{len(states)} layer states for a cache of {len(layers)} layers")
        for layer, (keys, values) in zip(layers, states, strict=True):
            layer.update(keys, values)

    def prefill(self, tokens: Sequence[int]) -> None:
        """Append committed tokens straight to the prefix (empty block only), with no explicit mask.

        For long runs of tokens (a prompt): the model's own causal masking is used, so no
        [q, kv] mask is materialised, and only one row is projected to the vocabulary.
        """
        if self.block_len:
            raise CacheError("prefill needs an empty block")
        if not tokens:
            return
        device, _ = model_device_dtype(self.model)
        whole = prefill_chunk(device, self.model)
        tokens = [int(t) for t in tokens]
        runner = self._joining_runner()
        # Where chunks join other sessions' passes, the prompt prefills in its turn, so each chunk is
        # sized with the decoders of the pass it joins in view, and prompts go first come, first
        # served, a turn's worth of tokens at a time (ForwardBatcher.prefill_turn).
        turn_tokens = runner.prefill_turn_tokens if runner is not None else len(tokens)
        begin = 0
        while begin < len(tokens):
            with runner.prefill_turn() if runner is not None else nullcontext():
                end = min(len(tokens), begin + turn_tokens)
                while begin < end:
                    size = min(self.chunk_tokens(whole), end - begin)
                    self._prefill_chunk(tokens[begin:begin + size], device)
                    begin += size

    def _joining_runner(self) -> ForwardRunner | None:
        """The runner where prefill chunks join other sessions' passes (ragged passes), else None."""
        runner = self.runner
        return runner if runner is not None and getattr(runner, "joins_prefill", False) else None

    def pending_turn(self, new_tokens: int) -> AbstractContextManager[None]:
        """The runner's prefill turn for a call with `new_tokens` uncached committed tokens, held by
        the caller from sizing them to the end of the pass that carries their tail
        (scoring.score_tree): a new prompt's run is then sized, like a prompt's chunk, with the
        decoders of its pass in view, one prompt at a time (ForwardBatcher.prefill_turn says which
        runs take it)."""
        runner = self._joining_runner()
        return nullcontext() if runner is None else runner.prefill_turn(pending=new_tokens, kv=self)

    def chunk_tokens(self, whole: int) -> int:
        """The next prefill chunk's tokens: `whole`, or fewer where the chunk joins other sessions'
        passes and the runner cuts it so that they do not wait long (ForwardBatcher.prefill_chunk_tokens)."""
        runner = self._joining_runner()
        return whole if runner is None else max(1, min(whole, runner.prefill_chunk_tokens(self, whole)))

    def _prefill_chunk(self, tokens: list[int], device: torch.device) -> None:
        runner = self._joining_runner()
        if runner is not None:
            # The chunk joins other sessions' passes as a chain at the prefix's end (ragged passes).
            plan = self.plan(tokens, sequence_parents(len(tokens)), len(tokens) - 1)
            runner.prefill(self, plan)
            self.apply(plan)
            self.settle(range(len(tokens)))
            return
        # Each chunk runs alone (its causal mask is the model's own, no [q, kv] mask materialised
        # here); other sessions' passes may run between two chunks.
        self.alone(lambda: self.causal_pass(tokens, device))
        self.prefix = self.prefix + tokens
        if self.physical_len() != self.prefix_len:
            raise CacheError("the model did not append one cache entry per input token")
        self.publish()

    def alone(self, run: Callable[[], None]) -> None:
        """Run `run` (passes with masks of their own) between batched passes: through the runner when
        there is one, else here."""
        if self.runner is not None:
            self.runner.alone(run)
        else:
            run()

    def causal_pass(self, tokens: list[int], device: torch.device) -> None:
        """Append `tokens`' entries after the cached ones in one pass with the model's own causal
        mask and one logits row (a prefill chunk of its own; the bookkeeping is the caller's)."""
        start = self.physical_len()
        with self.lock or nullcontext(), torch.no_grad():
            self.model(
                input_ids=torch.tensor([tokens], dtype=torch.long, device=device),
                position_ids=torch.arange(start, start + len(tokens), device=device)[None],
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
            )

    def extend_chain(self, tokens: Sequence[int], rows_from: int | None = None) -> torch.Tensor:
        """Append a causal chain at the prefix's end (empty block only); by default only the last row."""
        if self.block_len:
            raise CacheError("extend_chain needs an empty block")
        n = len(tokens)
        return self.extend(tokens, sequence_parents(n), n - 1 if rows_from is None else rows_from)

    # prefix cache ---------------------------------------------------------------------------------
    def set_partition(self, partition: str) -> None:
        """The prefix-cache partition of this call's session (specdec.runtime.prefix_cache)."""
        if self.prefix_link is not None:
            self.prefix_link.repartition(partition)

    def restore_prefix(self, tokens: Sequence[int]) -> int:
        """Extend the prefix along `tokens` (committed tokens, beginning with the prefix) with the
        engine's cached blocks, as far as they go (empty block only); returns the tokens gained.

        Only worth a lookup when at least a block's worth of `tokens` is not cached here. The
        entries from the last block boundary on are taken from the store too: at int8 they are
        bitwise what this cache holds (docs/algorithms.md §16), elsewhere within rounding.
        """
        link = self.prefix_link
        if link is None or self.block_len:
            return 0
        size, have = link.store.block_tokens, self.prefix_len
        if len(tokens) - have < size or self.common_prefix(tokens) < have:
            return 0
        first = have // size
        keys = block_keys(link.partition, tokens, size)
        found = link.store.lookup(keys[first:], tokens[first * size:],
                                  keys[first - 1] if first else root_key(link.partition))
        end = first * size + sum(block.tokens for block in found)
        if end <= have:
            return 0
        self.truncate(first * size)
        states = [(torch.cat([block.states[i][0] for block in found], dim=-2),
                   torch.cat([block.states[i][1] for block in found], dim=-2))
                  for i in range(len(found[0].states))]
        self.append_prefix(tokens[first * size:end], states)
        link.published[:] = keys[:end // size]  # this prefix's full blocks up to `end` are offered
        return end - have

    def append_prefix(self, tokens: Sequence[int], states: Sequence[tuple[torch.Tensor, torch.Tensor]]
                      ) -> None:
        """Append entries computed elsewhere (keys and values [1, heads, n, dim] per layer) as prefix
        tokens (empty block only)."""
        if self.block_len:
            raise CacheError("append_prefix needs an empty block")
        self.append_layer_entries(states)
        self._count_appended(len(tokens))
        self.prefix = self.prefix + [int(t) for t in tokens]
        if self.physical_len() != self.prefix_len:
            raise CacheError("appended entries and tokens disagree")

    def publish(self) -> None:
        """Offer the prefix's full blocks not offered yet to the engine's prefix cache (copies of
        them: this cache goes on changing its own buffers)."""
        link = self.prefix_link
        if link is None:
            return
        size, published = link.store.block_tokens, link.published
        full = self.prefix_len // size
        if len(published) >= full:
            return
        key = published[-1] if published else root_key(link.partition)
        states = None
        for index in range(len(published), full):
            begin, end = index * size, (index + 1) * size
            key = next_key(key, self.prefix[begin:end])
            if key not in link.store:
                states = states or self.layer_states()
                link.store.store(key, [(keys[..., begin:end, :].clone(), values[..., begin:end, :].clone())
                                       for keys, values in states])  # type: ignore[misc]
            published.append(key)

    def publish_tail(self) -> None:
        """Offer the prefix's last, partial block too, and its last full block less a token as a
        partial one (once the session ends: a conversation's next turn resends these tokens, and
        finds them under `tail_key` after the full blocks). The second is for a next prompt that
        parts from the prefix inside its last full block: a session may hold tokens past the answer
        its client got (a draft accepted beyond the length limit or the stop token)."""
        link = self.prefix_link
        if link is None:
            return
        self.publish()
        size, published, states = link.store.block_tokens, link.published, None
        for index in (len(published) - 1, len(published)):
            begin, end = index * size, min(index * size + size - 1, self.prefix_len)
            if index < 0 or begin >= end:
                continue
            states = states or self.layer_states()
            link.store.store_tail(published[index - 1] if index else root_key(link.partition),
                                  self.prefix[begin:end],
                                  [(keys[..., begin:end, :].clone(), values[..., begin:end, :].clone())
                                   for keys, values in states])  # type: ignore[misc]
