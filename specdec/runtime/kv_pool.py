"""One preallocated KV cache for all of an engine's sessions, and passes of static shape over it.

Why: on a GPU an eager pass is bound by the host (≈35 operators a layer, each launched from
Python: docs/gpu.md). A pass whose every tensor has a fixed shape and address can be captured
once as a CUDA graph and replayed with one launch. That needs the cache to stop growing and
moving, so the pool holds it:

    keys[layer], values[layer]: [slots + 1, kv_heads, slot_tokens + max_query, head_dim]

Each session owns one slot (PooledTreeKVCache); slot entry i is the session's physical cache
entry i, exactly as in specdec.runtime.kv.TreeKVCache. The extra slot is scratch: padding rows of
a batched pass write there. The `max_query` tail of every slot takes the writes of padding
queries, so they never land on a real entry.

A pass is described by inputs, never by Python state, so one captured graph serves every session:

    input_ids, position_ids  [B, q]     the new entries' tokens and position ids
    slot_ids                 [B]        which slot each batch row reads and appends to
    write_index              [B, q]     where in its slot each new entry goes
    mask                     [B, 1, q, kv]  additive: what each new entry may attend to

B, q and kv are bucketed (PoolConfig): a pass is padded up to the smallest bucket that holds it.
Padding queries see only slot entry 0 (so no attention row is empty) and nobody sees them; the
real rows are what an unpadded pass computes, up to the rounding of a longer masked reduction
(docs/algorithms.md §14 says how far that moves a row; the device check measures it).
Passes outside every bucket (long prefills) run eagerly over the same pool.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specdec.runtime.batch_config import DEFAULT_POOL_SLOTS, DEFAULT_SLOT_TOKENS
from specdec.runtime.kv import CacheError, ExtendPlan, TreeKVCache, additive_mask, model_device_dtype
from specdec.runtime.lean_forward import causal_lm_logits
from specdec.runtime.prefix_cache import PrefixLink, PrefixStore

log = logging.getLogger(__name__)

DEFAULT_QUERY_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8)
MAX_CAPTURED_ROWS = 128  # B × q of the largest captured pass (its logits buffer is B × q × vocab)
PREFILL_CHUNK = 512  # a long prefill runs eagerly in chunks of this many tokens


@dataclass(frozen=True)
class PoolConfig:
    """How big the pool is and which pass shapes are captured.

    slots: sessions held at once (more sessions get an eager cache: the fallback);
    slot_tokens: entries one session may hold (a longer one moves to an eager cache);
    capture: capture CUDA graphs at start (CUDA only; False runs the same passes eagerly).
    """

    slots: int = DEFAULT_POOL_SLOTS
    slot_tokens: int = DEFAULT_SLOT_TOKENS
    query_buckets: tuple[int, ...] = DEFAULT_QUERY_BUCKETS
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    context_buckets: tuple[int, ...] | None = None  # None: powers of two from 256 to slot_tokens
    capture: bool = True

    def __post_init__(self) -> None:
        if self.slots < 1 or self.slot_tokens < 1:
            raise ValueError(f"the pool needs >= 1 slot of >= 1 token, got {self.slots} × {self.slot_tokens}")
        for name in ("query_buckets", "batch_buckets"):
            buckets = getattr(self, name)
            if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
                raise ValueError(f"{name} must be increasing positive sizes, got {buckets}")

    @property
    def kv_buckets(self) -> tuple[int, ...]:
        if self.context_buckets is not None:
            sizes = {min(c, self.slot_tokens) for c in self.context_buckets} | {self.slot_tokens}
            return tuple(sorted(sizes))
        buckets, size = [], 256
        while size < self.slot_tokens:
            buckets.append(size)
            size *= 2
        return (*buckets, self.slot_tokens)

    @property
    def max_query(self) -> int:
        return self.query_buckets[-1]

    def captured_shapes(self) -> list[tuple[int, int, int]]:
        """(B, q, kv) of every pass captured at start."""
        return [(b, q, kv) for b in self.batch_buckets for q in self.query_buckets
                if b * q <= MAX_CAPTURED_ROWS for kv in self.kv_buckets]


def bucket(size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= size, None when none is."""
    return next((b for b in buckets if b >= size), None)


@dataclass
class PoolRow:
    """One session's share of a pass: its slot, cached entries, and new entries."""

    slot: int
    cached: int  # entries already in the slot (the new ones go right after)
    tokens: list[int]
    positions: list[int]
    allowed: torch.Tensor  # bool [n, cached + n]
    rows_from: int = 0
    # The new entries' tokens as a long [n] tensor on the pool's device, in place of `tokens`: a
    # token sampled on the device goes into the pass without the host reading it.
    device_tokens: torch.Tensor | None = None


@dataclass
class CaptureReport:
    graphs: int = 0
    seconds: float = 0.0
    graph_bytes: int = 0  # device memory the graphs' pool took
    pool_bytes: int = 0  # the KV pool itself
    shapes: list[tuple[int, int, int]] = field(default_factory=list)


class _PassCache:
    """past_key_values of one pass: appends the new entries into their slots, hands attention the
    first `kv` entries of each row's slot (a gather, so slot ids can be graph inputs)."""

    def __init__(self, pool: KVPool, slot_ids: torch.Tensor, write_index: torch.Tensor, kv: int) -> None:
        self.pool, self.slot_ids, self.write_index, self.kv = pool, slot_ids, write_index, kv

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        rows = self.slot_ids[:, None]
        # [B, q] indices around a sliced head dimension: the indexed view is [B, q, heads, dim].
        keys[rows, :, self.write_index] = key_states.transpose(1, 2).to(keys.dtype)
        values[rows, :, self.write_index] = value_states.transpose(1, 2).to(values.dtype)
        return (keys[:, :, : self.kv].index_select(0, self.slot_ids),
                values[:, :, : self.kv].index_select(0, self.slot_ids))

    def get_seq_length(self, layer_idx: int = 0) -> int:  # position ids are always given
        return 0


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]


class KVPool:
    """The engine's preallocated cache and its passes (captured on CUDA, eager elsewhere)."""

    def __init__(self, model, config: PoolConfig | None = None) -> None:
        self.model = model
        self.config = config or PoolConfig()
        self.device, self.dtype = model_device_dtype(model)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if any(t != "full_attention" for t in getattr(text, "layer_types", None) or ()):
            raise CacheError("the KV pool holds full-attention layers only (this model has sliding layers)")
        layers = text.num_hidden_layers
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.vocab = model.config.vocab_size
        self.scratch = self.config.slots  # the padding rows' slot
        length = self.config.slot_tokens + self.config.max_query
        shape = (self.config.slots + 1, kv_heads, length, head_dim)
        # Plain tensors even when built under inference mode: passes run on the engine's compute
        # thread, where inference mode (thread-local) may be off, and must write into them.
        with torch.inference_mode(False):
            self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)]
            self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)]
        self._free = list(range(self.config.slots))
        self._lock = threading.Lock()
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._logits: torch.Tensor | None = None  # every graph's output buffer [B, q, V]
        self.report = CaptureReport(pool_bytes=2 * layers * shape[0] * shape[1] * shape[2] * shape[3]
                                    * self.keys[0].element_size())
        self.passes = {"captured": 0, "eager": 0}

    # slots -------------------------------------------------------------------------------------
    def acquire(self) -> int | None:
        with self._lock:
            return self._free.pop(0) if self._free else None

    def release(self, slot: int) -> None:
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def new_cache(self, lock: threading.Lock | None = None, runner=None) -> TreeKVCache:
        """A session's cache: a slot of the pool when one is free, else an eager cache."""
        slot = self.acquire()
        if slot is None:
            return TreeKVCache(self.model, lock=lock, runner=runner)
        return PooledTreeKVCache(self, slot, lock=lock, runner=runner)

    # passes ------------------------------------------------------------------------------------
    def run(self, rows: Sequence[PoolRow], pad_to: tuple[int, int, int] | None = None) -> list[torch.Tensor]:
        """One pass over `rows` (distinct slots); float32 logits of each row's entries rows_from.. .

        The pass replays the graph of the smallest captured (B, q, kv) that holds it, else runs
        eagerly at its exact shape, or padded to `pad_to` (tests: padding without a GPU)."""
        if not rows or len({r.slot for r in rows}) != len(rows):
            raise CacheError("a pool pass needs >= 1 row and distinct slots")
        config = self.config
        widest = max(len(r.tokens) for r in rows)
        longest = max(r.cached + len(r.tokens) for r in rows)
        if longest > config.slot_tokens:
            raise CacheError(f"a pass reaching {longest} entries does not fit a slot of {config.slot_tokens}")
        b, q, kv = (bucket(len(rows), config.batch_buckets), bucket(widest, config.query_buckets),
                    bucket(longest, config.kv_buckets))
        graph = self._graphs.get((b, q, kv)) if b and q and kv else None
        if graph is None:  # no captured shape holds it: the exact shape (or pad_to), eagerly
            b, q, kv = pad_to or (len(rows), widest, longest)
            if b < len(rows) or q < widest or kv < longest or kv > config.slot_tokens:
                raise CacheError(f"pad_to {pad_to} does not hold {len(rows)} rows of {widest} "
                                 f"up to {longest}")
        inputs = self._inputs(rows, b, q, kv)
        if graph is not None:
            for name, tensor in inputs.items():
                graph.inputs[name].copy_(tensor, non_blocking=True)
            graph.graph.replay()
            assert self._logits is not None
            logits = self._logits[:b, :q]
            self.passes["captured"] += 1
        else:
            with torch.no_grad():
                logits = self._forward(inputs, kv)
            self.passes["eager"] += 1
        # Copies: a captured pass's logits live in one buffer the next replay overwrites (at float32,
        # .float() alone would hand out a view of it), and callers keep rows across passes.
        return [logits[i, r.rows_from:len(r.tokens)].to(torch.float32, copy=True) for i, r in enumerate(rows)]

    def run_chain(self, slot: int, cached: int, token: torch.Tensor, passes: int,
                  next_token: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        """`passes` passes of one new entry each after a slot's first `cached` entries, every entry
        seeing all entries before it and itself (a chain whose position ids are its slot indices),
        with no host sync: pass i's token is a 0-d long device tensor, `token` for the first and
        then what `next_token(i, logits)` returns for pass i's float32 logits row [V].

        Why: a drafter's k tokens are k dependent passes; sampling on the device and feeding the
        token straight into the next replay keeps the host from waiting on the GPU k times. The
        slot's bookkeeping is the caller's (it records the entries once it has read the tokens)."""
        if cached + passes > self.config.slot_tokens:
            raise CacheError(f"a chain reaching {cached + passes} entries does not fit a slot of "
                             f"{self.config.slot_tokens}")
        for i in range(passes):
            entry = cached + i
            kv = bucket(entry + 1, self.config.kv_buckets)
            graph = self._graphs.get((1, 1, kv)) if kv is not None else None
            if graph is None:  # as in run: the exact shape, eagerly
                kv = entry + 1
            inputs = graph.inputs if graph is not None else self._dummy_inputs(1, 1, kv)
            inputs["input_ids"].copy_(token.reshape(1, 1))
            inputs["position_ids"].fill_(entry)
            inputs["slot_ids"].fill_(slot)
            inputs["write_index"].fill_(entry)
            inputs["mask"].fill_(torch.finfo(self.dtype).min)
            inputs["mask"][..., : entry + 1] = 0
            if graph is not None:
                graph.graph.replay()
                assert self._logits is not None
                logits = self._logits[0, 0]
                self.passes["captured"] += 1
            else:
                with torch.no_grad():
                    logits = self._forward(inputs, kv)[0, 0]
                self.passes["eager"] += 1
            # A copy: the next replay overwrites the graph's logits buffer.
            token = next_token(i, logits.to(torch.float32, copy=True))

    def _inputs(self, rows: Sequence[PoolRow], b: int, q: int, kv: int) -> dict[str, torch.Tensor]:
        """The pass's input tensors (built on the host, moved in one go)."""
        slot_tokens = self.config.slot_tokens
        input_ids = torch.zeros((b, q), dtype=torch.long)
        positions = torch.zeros((b, q), dtype=torch.long)
        slot_ids = torch.full((b,), self.scratch, dtype=torch.long)
        # Padding queries write past the slot's last entry (the slot's tail), each to its own place.
        write_index = slot_tokens + torch.arange(q, dtype=torch.long).repeat(b, 1)
        allowed = torch.zeros((b, q, kv), dtype=torch.bool)
        allowed[:, :, 0] = True  # padding sees entry 0 (finite, whatever it holds)
        for i, row in enumerate(rows):
            n, c = len(row.tokens), row.cached
            if row.allowed.shape != (n, c + n):
                raise CacheError(f"a row's mask is {tuple(row.allowed.shape)}, expected {(n, c + n)}")
            input_ids[i, :n] = torch.tensor(row.tokens, dtype=torch.long)
            positions[i, :n] = torch.tensor(row.positions, dtype=torch.long)
            slot_ids[i] = row.slot
            write_index[i, :n] = torch.arange(c, c + n)
            allowed[i, :n] = False
            allowed[i, :n, : c + n] = row.allowed
        tensors = {"input_ids": input_ids, "position_ids": positions, "slot_ids": slot_ids,
                   "write_index": write_index, "mask": additive_mask(allowed, self.dtype)[:, None]}
        pinned = self.device.type == "cuda"
        moved = {name: (t.pin_memory() if pinned else t).to(self.device, non_blocking=pinned)
                 for name, t in tensors.items()}
        for i, row in enumerate(rows):
            if row.device_tokens is not None:
                moved["input_ids"][i, : len(row.tokens)].copy_(row.device_tokens)
        return moved

    def _forward(self, inputs: dict[str, torch.Tensor], kv: int) -> torch.Tensor:
        cache = _PassCache(self, inputs["slot_ids"], inputs["write_index"], kv)
        return causal_lm_logits(self.model, inputs["input_ids"], inputs["mask"], inputs["position_ids"],
                                cache, 0)

    def prefill(self, slot: int, cached: int, tokens: Sequence[int]) -> None:
        """Append a causal run of committed tokens (a prompt) to a slot, in eager chunks."""
        tokens = list(tokens)
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start:start + PREFILL_CHUNK]
            c, n = cached + start, len(chunk)
            allowed = torch.ones((n, c + n), dtype=torch.bool)
            allowed[:, c:] = torch.ones((n, n), dtype=torch.bool).tril()
            row = PoolRow(slot, c, chunk, list(range(c, c + n)), allowed, rows_from=n - 1)
            inputs = self._inputs([row], 1, n, c + n)
            with torch.no_grad():
                self._forward(inputs, c + n)
            self.passes["eager"] += 1

    # capture -----------------------------------------------------------------------------------
    def capture(self, shapes: Sequence[tuple[int, int, int]] | None = None) -> CaptureReport:
        """Capture every pass shape as a CUDA graph (CUDA only; a no-op elsewhere)."""
        if self.device.type != "cuda" or not self.config.capture:
            return self.report
        shapes = list(shapes if shapes is not None else self.config.captured_shapes())
        began = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        widest_b = max(b for b, _, _ in shapes)
        widest_q = max(q for _, q, _ in shapes)
        with torch.inference_mode(False):
            self._logits = torch.empty((widest_b, widest_q, self.vocab), dtype=self.dtype, device=self.device)
        memory = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # No garbage collection while capturing: a finalizer that frees another engine's graphs (an
        # earlier pool, as in tests) would destroy a graph mid-capture, which CUDA refuses. Collected
        # first, then held off until the last graph is in.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        # Plain tensors (not inference ones): replays copy into the inputs from the compute thread.
        try:
            with torch.cuda.stream(stream), torch.inference_mode(False), torch.no_grad():
                for b, q, kv in sorted(shapes, reverse=True):  # largest first: the pool's size is set once
                    inputs = self._dummy_inputs(b, q, kv)
                    for _ in range(2):  # warm-up outside capture (lazy inits, cuBLAS workspaces)
                        self._forward(inputs, kv)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=memory, stream=stream,
                                          capture_error_mode="thread_local"):
                        self._logits[:b, :q].copy_(self._forward(inputs, kv))
                    self._graphs[(b, q, kv)] = _Graph(graph, inputs)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.report.graphs = len(self._graphs)
        self.report.shapes = sorted(self._graphs)
        self.report.seconds = time.perf_counter() - began
        self.report.graph_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info("captured %d pass shapes in %.1f s, %.0f MiB of graph memory (KV pool %.0f MiB)",
                 self.report.graphs, self.report.seconds, self.report.graph_bytes / 2**20,
                 self.report.pool_bytes / 2**20)
        return self.report

    def _dummy_inputs(self, b: int, q: int, kv: int) -> dict[str, torch.Tensor]:
        """Inputs of a harmless pass of shape (b, q, kv): every row writes to the scratch slot."""
        rows = []  # no real rows: all padding, all in the scratch slot
        inputs = self._inputs(rows, b, q, kv)
        return {name: tensor.clone() for name, tensor in inputs.items()}


def engine_pool(model, config: PoolConfig | None, compute=None) -> KVPool | None:
    """An engine's pool (captured on `compute`, the thread that runs its passes), or None: no config,
    or a capturing config for a model off CUDA (the CPU keeps the eager growing cache by default; a
    config with capture=False builds the pool anywhere and runs its passes eagerly: tests, dry runs)."""
    device, _ = model_device_dtype(model)
    if config is None or (config.capture and device.type != "cuda"):
        return None
    pool = KVPool(model, config)
    (compute.call if compute is not None else (lambda f: f()))(pool.capture)
    return pool


def new_session_cache(model, pool: KVPool | None, runner=None, prefix_store: PrefixStore | None = None,
                      partition: str = "") -> TreeKVCache:
    """A session's cache: a slot of `pool` when there is one with a slot free, else eager; tied to the
    engine's prefix cache when it has one."""
    kv = pool.new_cache(runner=runner) if pool is not None else TreeKVCache(model, runner=runner)
    if prefix_store is not None:
        kv.prefix_link = PrefixLink(prefix_store, partition)
    return kv


def renew_session_cache(old: TreeKVCache, model, pool: KVPool | None, runner=None) -> TreeKVCache:
    """A fresh cache for a session whose cache is in an unknown state (its slot goes back first)."""
    if isinstance(old, PooledTreeKVCache):
        old.close()
    link = old.prefix_link
    if link is None:
        return new_session_cache(model, pool, runner)
    return new_session_cache(model, pool, runner, link.store, link.partition)


class PooledTreeKVCache(TreeKVCache):
    """A TreeKVCache whose entries live in a slot of a KVPool (same bookkeeping, fixed storage).

    A session that outgrows its slot moves to an eager cache (its entries copied into a growing
    DynamicCache) and gives the slot back; so does nothing else. The slot goes back to the pool
    when the cache is dropped (evicted, released, replaced after an error).
    """

    def __init__(self, pool: KVPool, slot: int, lock: threading.Lock | None = None, runner=None) -> None:
        super().__init__(pool.model, lock=lock, runner=runner)
        self.pool = pool
        self.slot: int | None = slot
        self.length = 0  # physical entries in the slot
        self._give_back = weakref.finalize(self, pool.release, slot)

    def close(self) -> None:
        """Give the slot back now (the cache must not be used afterwards)."""
        self.slot = None
        self._give_back()

    @property
    def pooled(self) -> bool:
        return self.slot is not None

    def physical_len(self) -> int:
        return self.length if self.pooled else super().physical_len()

    def pending_limit(self, elsewhere: int) -> int:
        return elsewhere if self.pooled else super().pending_limit(elsewhere)  # the captured buckets

    def _keep_first(self, length: int) -> None:
        if not self.pooled:
            return super()._keep_first(length)
        self.length = min(self.length, length)

    def _move_into_place(self, start: int, path: list[int]) -> None:
        if not self.pooled:
            return super()._move_into_place(start, path)
        source = torch.tensor(path, dtype=torch.long, device=self.pool.device) + start
        for keys, values in zip(self.pool.keys, self.pool.values, strict=True):
            slot_keys, slot_values = keys[self.slot], values[self.slot]
            slot_keys[:, start:start + len(path)] = slot_keys[:, source]
            slot_values[:, start:start + len(path)] = slot_values[:, source]

    def plan(self, tokens: Sequence[int], parents: Sequence[int], rows_from: int = 0) -> ExtendPlan:
        if self.pooled and self.length + len(tokens) > self.pool.config.slot_tokens:
            self._spill()
        return super().plan(tokens, parents, rows_from)

    def row(self, plan: ExtendPlan) -> PoolRow:
        assert self.slot is not None
        return PoolRow(self.slot, self.length, plan.tokens, plan.positions, plan.allowed, plan.rows_from)

    def forward(self, plan: ExtendPlan) -> torch.Tensor:
        if not self.pooled:
            return super().forward(plan)
        return self.pool.run([self.row(plan)])[0]

    def _count_appended(self, n: int) -> None:
        if self.pooled:
            self.length += n

    def prefill(self, tokens: Sequence[int]) -> None:
        if self.pooled and self.length + len(tokens) > self.pool.config.slot_tokens:
            self._spill()
        if not self.pooled:
            return super().prefill(tokens)
        if self.block_len:
            raise CacheError("prefill needs an empty block")
        if not tokens:
            return
        assert self.slot is not None
        slot, cached = self.slot, self.length

        def run() -> None:
            self.pool.prefill(slot, cached, tokens)

        self.alone(run)
        self.length += len(tokens)
        self.prefix = self.prefix + [int(t) for t in tokens]
        self.publish()

    def append_prefix(self, tokens: Sequence[int], states: Sequence[tuple[torch.Tensor, torch.Tensor]]
                      ) -> None:
        if self.pooled and self.length + len(tokens) > self.pool.config.slot_tokens:
            self._spill()
        super().append_prefix(tokens, states)

    def layer_states(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        if not self.pooled:
            return super().layer_states()
        if not self.length:
            return [None] * len(self.pool.keys)
        return [(k[self.slot:self.slot + 1, :, :self.length], v[self.slot:self.slot + 1, :, :self.length])
                for k, v in zip(self.pool.keys, self.pool.values, strict=True)]

    def append_layer_entries(self, states: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not self.pooled:
            return super().append_layer_entries(states)
        n = states[0][0].shape[-2]
        if self.length + n > self.pool.config.slot_tokens:
            self._spill()
            return super().append_layer_entries(states)
        end = self.length + n
        for keys, values, (new_keys, new_values) in zip(self.pool.keys, self.pool.values, states,
                                                        strict=True):
            keys[self.slot, :, self.length:end] = new_keys[0]
            values[self.slot, :, self.length:end] = new_values[0]
        # The length grows in _count_appended() (apply after a batched pass, append_prefix after a restore).

    def _spill(self) -> None:
        """Move this session's entries out of the pool into an eager cache (it outgrew its slot)."""
        assert self.slot is not None
        states = [(k[self.slot:self.slot + 1, :, :self.length].clone(),
                   v[self.slot:self.slot + 1, :, :self.length].clone())
                  for k, v in zip(self.pool.keys, self.pool.values, strict=True)]
        self.close()
        if self.length:
            super().append_layer_entries(states)
        log.info("a session outgrew its KV slot (%d entries): it continues on an eager cache", self.length)
