"""Continuous batching: the forward passes of concurrent calls from different sessions run as one.

Each session keeps its own KV cache (specdec.runtime.kv.TreeKVCache) with its own length and
its own tree mask. A call that needs a pass hands its cache and plan to the engine's
ForwardBatcher and waits. There is no scheduler thread: the first waiting call that finds the
model idle leads. It takes the queued plans (first come, first served, up to max_batch_tokens
query positions), runs them as one pass, and hands every cache its new entries and rows; the
plans that arrived meanwhile form the next pass. So at one client nothing waits. With many,
each pass carries everything that queued up while the previous one ran.

A batched pass lays the caches out left-padded in one batch:

    row b: [ padding | session b's cached entries | padding queries | session b's new entries ]
           <------------ longest cache ------------><--------- most new entries --------->

The mask lets each new entry see exactly what its own cache's plan allows; padding is seen by
no one, and a padding query sees only itself (so no attention row is empty). Position ids are
the session's own. Keeping the new entries last gives every session its rows as a suffix of
the pass's, so one `logits_to_keep` serves all. The verification rules run per session on
those rows afterwards, so batching changes no output beyond floating-point rounding
(docs/algorithms.md §13). The sessions' caches are copied into the batch once, into buffers with
room for the new entries; afterwards each session appends only its new entries to its own cache.
(Handing each session a fresh copy of its whole cache, as this once did, cost more than the
forward itself at 4–8 calls a pass.)

Where the model's attention allows (specdec.runtime.ragged) a pass is ragged instead: the calls'
new entries lie end to end in one row, with no padding, and each session's attention runs over its
own keys. Then a prompt's prefill chunks (TreeKVCache.prefill) join other sessions' passes too,
one chunk a pass, so a decoding session waits at most one chunk's rows for another's prompt (the
padded layout prefills each chunk in a pass of its own, between batched passes). While other
sessions decode, the chunk is cut to what adds a set share of a decode pass's measured time
(`prefill_chunk_tokens`): a whole chunk (256 rows on a CPU whose wide int8 kernel starts there)
made the 8-client passes it joined 4× a decode pass, and their tokens waited that long.

Threads: every pass runs on one thread, the engine's ComputeThread, whichever call leads it: a
process whose torch work moves between threads runs it far slower (specdec.runtime.compute_thread).
An engine that shares its cores with the drafter (`up`: the verifier may use the
drafter's core while the drafter has nothing to do) runs a pass with all its threads only when
every call in it said the drafter is idle (`wide`), else with `ThreadWidths.beside_drafter`. The
thread count changes no row: int8 rows are computed per row (docs/algorithms.md §14).
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.compute_thread import ComputeThread
from specdec.runtime.kv import (
    ExtendPlan,
    TreeKVCache,
    additive_mask,
    growing_cache,
    growing_layer_class,
    model_device_dtype,
)
from specdec.runtime.lean_forward import causal_lm_logits
from specdec.runtime.pass_time import PassTimeModel
from specdec.runtime.ragged import RaggedPass, Segment, use_ragged_attention


def _common_pool(batch: list[_Job]):
    """The KVPool every job's cache has a slot in (specdec.runtime.kv_pool), else None."""
    pools = {id(getattr(job.kv, "pool", None)) for job in batch if getattr(job.kv, "pooled", False)}
    if len(pools) != 1 or not all(getattr(job.kv, "pooled", False) for job in batch):
        return None
    return batch[0].kv.pool  # type: ignore[union-attr]


@dataclass(eq=False)
class _Job:
    kv: TreeKVCache | None = None  # None: a pass that runs alone (`run`)
    plan: ExtendPlan | None = None
    run: Callable[[], None] | None = None
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False
    wide: bool = False  # the caller said no drafter call runs beside it (ThreadWidths)
    prefill: bool = False  # a prompt's prefill chunk: no logits wanted (ragged passes only)
    pass_calls: int = 0  # the pass that served it: calls in it, and query rows (padding included)
    pass_rows: int = 0

    @property
    def positions(self) -> int:
        return len(self.plan.tokens) if self.plan is not None else 0

    @property
    def prompt_rows(self) -> int:
        """Rows the pass only caches, no logits wanted: a prefill chunk's, and a call's pending
        committed tokens before its last (a prompt's tail riding with a draft). They are a prompt's
        rows, not a step's, for the times prefill_chunk_tokens reads."""
        if self.plan is None:
            return 0
        return self.positions if self.prefill else self.plan.rows_from


@dataclass(frozen=True)
class ThreadWidths:
    """torch threads of a pass: `wide` when every caller's drafter is idle, else `beside_drafter`."""

    wide: int
    beside_drafter: int

    def for_pass(self, wide: bool) -> int:
        return self.wide if wide else self.beside_drafter


@dataclass
class BatchStats:
    batches: int = 0  # passes run (a pass with one call included)
    batch_calls: int = 0  # plans those passes served
    batch_tokens: int = 0  # query positions in those passes, padding included
    batch_positions: int = 0  # of those, the calls' own positions (the rest is padding)
    batch_seconds: float = 0.0  # time those passes ran
    largest_batch: int = 0


@dataclass(frozen=True)
class PassShape:
    """One batched pass a call's forward work ran in: why its time is what it is. A call alone in its
    pass sees calls 1 and rows = its positions; beside others, every call of the pass waited for all
    `rows` (each padded to the widest call's positions)."""

    calls: int  # calls the pass served
    rows: int  # query rows of the pass, padding included (a ragged pass has none)


# Weight of the newest batched pass in the mean pass time behind the gather window: a pass that
# carries a prefill chunk (3× a decode pass here) moves the window by a fifth of the difference.
# The same weight keeps the mean decode rows of a pass (prefill_chunk_tokens).
PASS_SECONDS_WEIGHT = 0.2
# The fewest prompt tokens a cut prefill chunk carries: below this an int8 pass's rows cost more
# each (the weights are read for few rows) and a prompt would take many passes.
MIN_PREFILL_CHUNK = 16
# The most prompt tokens one prompt prefills before the next one in line has its turn
# (ForwardBatcher.prefill_turn): four whole chunks, so a prompt of up to 2048 tokens goes in one turn.
PREFILL_TURN_TOKENS = 2048


def _decayed(mean: float | None, sample: float) -> float:
    """`mean` moved PASS_SECONDS_WEIGHT of the way to `sample` (the first sample as it is)."""
    return sample if mean is None else mean + PASS_SECONDS_WEIGHT * (sample - mean)


class ForwardBatcher:
    """Runs the passes of many TreeKVCaches over one model, batching concurrent ones."""

    def __init__(self, model, config: BatchConfig | None = None, clock=time.monotonic,
                 threads: ThreadWidths | None = None, compute: ComputeThread | None = None) -> None:
        """`compute`: the thread every pass runs on, whichever call leads it (the one that loaded the
        model, so the process keeps one OpenMP team: specdec.runtime.compute_thread); None: its own."""
        self.model = model
        self.compute = compute or ComputeThread()
        self.config = config or BatchConfig()
        self.clock = clock
        self.threads = threads  # None: the process's thread count, never changed here
        # Whether passes are ragged (specdec.runtime.ragged); else padded.
        self._ragged = (self.config.enabled and self.config.layout == "ragged"
                        and use_ragged_attention(model))
        self._caller = threading.local()  # the calling thread's `wide` (drafter_idle)
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._running = False
        self._members = 0  # calls holding a session: each may queue a plan soon
        # The sessions (caches) of the last two batched passes: their next calls are on their way.
        # Held weakly: a session released since (its request ended) is no longer waited for.
        self._recent: tuple[weakref.WeakSet[TreeKVCache], weakref.WeakSet[TreeKVCache]] = (
            weakref.WeakSet(), weakref.WeakSet())
        self._pass_seconds = 0.0  # a decaying mean of the batched passes' times (the gather window)
        # For prefill_chunk_tokens: a pass's time by its rows (fitted over every pass), a decaying
        # mean of the decode rows (rows other than _Job.prompt_rows) of the passes that had any,
        # and the sessions that decoded in the last two such passes (held weakly, as _recent: a
        # released session drops out).
        self._pass_time = PassTimeModel()
        self._decode_rows: float | None = None
        # Prompts waiting for their next prefill chunk's turn (prefill_turn); the first holds it.
        self._prefill_line: deque[object] = deque()
        self._recent_decoders: tuple[weakref.WeakSet[TreeKVCache], weakref.WeakSet[TreeKVCache]] = (
            weakref.WeakSet(), weakref.WeakSet())

    # the engines' side ------------------------------------------------------------------------
    @contextmanager
    def member(self) -> Iterator[None]:
        """Hold while a call holds its session: a leader may wait briefly for its plan."""
        with self._cond:
            self._members += 1
        try:
            yield
        finally:
            with self._cond:
                self._members -= 1
                self._cond.notify_all()

    @property
    def sole_member(self) -> bool:
        """Whether at most one call holds a session now (the caller's own, inside `member`): then no
        other session's pass could join this one's, and a drafter may chain its passes alone."""
        with self._cond:
            return self._members <= 1 or not self.config.enabled

    @contextmanager
    def drafter_idle(self, idle: bool) -> Iterator[None]:
        """The passes this thread asks for meanwhile say whether the drafter is idle (ThreadWidths)."""
        before = getattr(self._caller, "wide", False)
        self._caller.wide = idle
        try:
            yield
        finally:
            self._caller.wide = before

    def counters(self) -> dict[str, float]:
        """queue_depth (plans waiting for a pass), batches, batch_calls, batch_tokens, batch_positions,
        batch_seconds (for metrics)."""
        with self._cond:
            stats = self.stats
            return {"queue_depth": len(self._queue), "batches": stats.batches,
                    "batch_calls": stats.batch_calls, "batch_tokens": stats.batch_tokens,
                    "batch_positions": stats.batch_positions, "batch_seconds": stats.batch_seconds}

    @contextmanager
    def shapes(self) -> Iterator[list[PassShape]]:
        """Collect the shapes of the passes this thread's calls ran in meanwhile (PassShape)."""
        before = getattr(self._caller, "shapes", None)
        collected: list[PassShape] = []
        self._caller.shapes = collected
        try:
            yield collected
        finally:
            self._caller.shapes = before

    def extend(self, kv: TreeKVCache, plan: ExtendPlan) -> torch.Tensor:
        """Run `plan` on `kv` (with others' plans when they are waiting); its logits rows."""
        job = self._submit(_Job(kv=kv, plan=plan))
        assert job.logits is not None
        return job.logits

    def alone(self, run: Callable[[], None]) -> None:
        """Run `run` (a pass with its own mask, e.g. a prompt's prefill) between batched passes."""
        self._submit(_Job(run=run))

    @property
    def joins_prefill(self) -> bool:
        """Whether a prompt's prefill chunks join other sessions' passes (ragged passes)."""
        return self._ragged

    def prefill(self, kv: TreeKVCache, plan: ExtendPlan) -> None:
        """Run a prefill chunk's `plan` (a chain at the prefix's end) in a ragged pass with other
        sessions' plans; no logits (only when `joins_prefill`)."""
        if not self._ragged:
            raise RuntimeError("prefill chunks join passes only in ragged passes")
        self._submit(_Job(kv=kv, plan=plan, prefill=True))

    def prefill_chunk_tokens(self, kv: TreeKVCache, whole: int) -> int:
        """How many prompt tokens `kv`'s next prefill chunk should carry (at most `whole`). While
        other sessions decode (rows in the last two passes with decode rows, or a call queued), the
        chunk joins their pass and they wait for it: it is cut to adding at most
        BatchConfig.prefill_chunk_share × D, never below MIN_PREFILL_CHUNK. D is the fitted pass
        time (PassTimeModel) at the decoders' rows, and a row adds the fit's slope r, so the cut is
        share × (fixed / r + decode rows) rows. Before the fit (passes of one width only) the fixed
        cost counts as nothing: share × decode rows. Alone, or at share 0: `whole`; where rows cost
        nothing measurable (r = 0), `whole` too. The cut changes no row at int8 (a prefix's rows do
        not depend on the passes it took, §14)."""
        cut = self._cut_beside_decoders(kv)
        return whole if cut is None else max(MIN_PREFILL_CHUNK, min(whole, cut))

    def _cut_beside_decoders(self, kv: TreeKVCache | None) -> int | None:
        """The prompt rows a pass of other sessions' decoders takes beside them
        (prefill_chunk_tokens), unbounded where rows cost nothing measurable; None while no other
        session decodes, or where nothing is cut (padded passes, share 0)."""
        share = self.config.prefill_chunk_share
        with self._cond:
            decode_rows = max(1.0, self._decode_rows or 1.0)
            decode, per_row = self._pass_time.seconds(decode_rows), self._pass_time.per_row
            decoding = [session for passed in self._recent_decoders for session in passed]
            decoding += [job.kv for job in self._queue if job.kv is not None and not job.prefill]
            others = any(session is not kv for session in decoding)
        if not (self._ragged and share > 0 and others):
            return None
        if decode is None or per_row is None:  # no line yet: the fixed cost counts as nothing
            return int(share * decode_rows)
        if per_row <= 0:
            return sys.maxsize
        return int(share * decode / per_row)

    @property
    def prefill_turn_tokens(self) -> int:
        """The most prompt tokens one prefill turn takes before the next prompt in line has its turn."""
        return PREFILL_TURN_TOKENS

    @contextmanager
    def prefill_turn(self, pending: int | None = None, kv: TreeKVCache | None = None) -> Iterator[None]:
        """Hold while prefilling up to `prefill_turn_tokens` of a prompt: prompts take turns, in the
        order they asked, one at a time, so each chunk is sized when it is about to join a pass, with
        the decoders of that moment in view. Sized when queued, the chunks of prompts that came
        together were all whole (nobody decoded yet) and then held the first prompt's decoding for a
        whole chunk each (8 fresh clients: 5–12 s after its first token). First come, first served
        (not a chunk each in turn): prompts that came together get their first tokens one after the
        other instead of all at the end; the turn's bound keeps a very long prompt from holding up
        the rest for its whole prefill.

        `pending`: the run of new committed tokens of a call on `kv` (a short prompt, a chat turn's
        message), held from its sizing (scoring.prefill_head) to the end of the pass that carries its tail
        with the draft. Sized on arrival, the short prompts of a wave all rode whole, several to a
        pass, while the first one done waited (2–6 s after its first token). No turn, and no wait
        behind a prompt's prefill, for a run no cut can shorten (at most MIN_PREFILL_CHUNK: a decode
        step's few tokens), for one longer than a turn (its prefill takes its own turns), or for one
        that other sessions' decoding lets into their pass whole already (a chat turn's message
        under load: sized with decoders in view, it would not be cut in its turn either). A thread
        that holds the turn holds it again at once (the call's prefill inside its turn)."""
        if getattr(self._caller, "holds_turn", False):  # this thread's call holds the turn already
            yield
            return
        if pending is not None and (not MIN_PREFILL_CHUNK < pending <= self.prefill_turn_tokens
                                    or pending <= (self._cut_beside_decoders(kv) or 0)):
            yield
            return
        me = object()
        with self._cond:
            self._prefill_line.append(me)
            try:
                while self._prefill_line[0] is not me:
                    self._cond.wait()
            except BaseException:
                self._prefill_line.remove(me)
                self._cond.notify_all()
                raise
        self._caller.holds_turn = True
        try:
            yield
        finally:
            self._caller.holds_turn = False
            with self._cond:
                self._prefill_line.popleft()
                self._cond.notify_all()

    # leading ----------------------------------------------------------------------------------
    def _submit(self, job: _Job) -> _Job:
        job.wide = getattr(self._caller, "wide", False)
        with self._cond:
            self._queue.append(job)
            self._cond.notify_all()
            while not job.done:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                batch = self._take()
                self._cond.release()
                try:
                    self.compute.call(self._execute, batch)
                finally:
                    self._cond.acquire()
                    self._running = False
                    for taken in batch:
                        taken.done = True
                    self._cond.notify_all()
        if job.error is not None:
            raise job.error
        collected = getattr(self._caller, "shapes", None)
        if collected is not None and job.kv is not None:
            collected.append(PassShape(job.pass_calls, job.pass_rows))
        return job

    def _take(self) -> list[_Job]:
        """The next pass's jobs (called with the lock held; may wait up to the gather window)."""
        config = self.config
        window = self.window_seconds()
        if config.enabled and window > 0:
            deadline = self.clock() + window
            # Other calls hold sessions but have not queued yet, or sessions of the last passes have
            # not come back yet: give them a moment to join. Without the second, clients that missed
            # one pass kept missing every other one: their next calls always arrived while the
            # pass of the rest ran, and 8 clients went as two batches of 4 in turn
            # (bench/RESULTS.md, "Serving: batch-aware drafts").
            while ((self._members_with_a_plan_to_come() > len(self._queue) or self._sessions_on_their_way())
                   and self._queued_positions() < config.max_batch_tokens
                   and (left := deadline - self.clock()) > 0):
                self._cond.wait(left)
        first = self._queue[0]
        if first.kv is None or not config.enabled:
            self._queue.pop(0)
            return [first]
        batch: list[_Job] = []
        widest = rows = 0
        chunks = 0
        for job in list(self._queue):
            if job.kv is None:
                continue  # runs alone, later
            if job.prefill and chunks:
                continue  # one prefill chunk a pass: the others' next tokens wait one chunk at most
            wider = max(widest, job.positions)
            wanted = rows + job.positions if self._ragged else wider * (len(batch) + 1)
            if batch and wanted > config.max_batch_tokens:
                break
            batch.append(job)
            widest, rows, chunks = wider, rows + job.positions, chunks + job.prefill
            self._queue.remove(job)
        return batch

    def window_seconds(self) -> float:
        """How long a pass may wait for calls on their way: BatchConfig.window_ms, or the window's share
        of a recent pass where that is longer. A call that misses a pass waits for the whole next
        one, so the wait that pays grows with the pass: on a CPU (passes of 0.4 s for 8 clients) a
        10 ms window let 4 of 8 calls join a pass, 40 ms let 6 (bench/RESULTS.md, "The gather
        window"); on a GPU's 10 ms passes the floor decides."""
        config = self.config
        return max(config.window_ms / 1000, config.window_share * self._pass_seconds)

    def _members_with_a_plan_to_come(self) -> int:
        """Members less those waiting for a prefill turn (prefill_turn): theirs cannot come before
        the turn's chunk has run, so a pass that waited for them would wait its whole window."""
        return self._members - max(0, len(self._prefill_line) - 1)

    def _queued_positions(self) -> int:
        return sum(job.positions for job in self._queue)

    def _sessions_on_their_way(self) -> bool:
        """Whether a session of the last two batched passes has no plan queued (its next call is
        probably on its way back from the caller); never while a pass that runs alone is first."""
        if not self._queue or self._queue[0].kv is None:
            return False
        queued = {id(job.kv) for job in self._queue if job.kv is not None}
        return any(id(session) not in queued for passed in self._recent for session in passed)

    @torch.inference_mode()
    def _execute(self, batch: list[_Job]) -> None:
        # Inference mode, not just no_grad: torch skips its autograd and view-tracking dispatch on
        # each of a pass's ~3,000 ops. A served 1-row pass of the default target took 90-91 ms
        # under no_grad against 85-87 ms (2-vCPU AMX Xeon, bench/RESULTS.md, "Inference mode").
        # The caches' buffers and the logits become inference tensors: whatever changes them in
        # place runs in inference mode too (specdec.runtime.kv's writes, the engines' calls).
        began = time.perf_counter()
        ragged = False
        if self.threads is not None:
            threads = self.threads.for_pass(all(job.wide for job in batch))
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        try:
            if batch[0].kv is None:
                assert batch[0].run is not None
                batch[0].run()
            elif len(batch) == 1 and not batch[0].prefill:
                job = batch[0]
                assert job.kv is not None and job.plan is not None
                job.logits = job.kv.forward(job.plan)
            elif (pool := _common_pool(batch)) is not None:  # one pass over the pool's slots
                rows = [job.kv.row(job.plan) for job in batch]  # type: ignore[union-attr]
                for job, logits in zip(batch, pool.run(rows), strict=True):
                    job.logits = logits
            elif self._ragged and not any(getattr(job.kv, "pooled", False) for job in batch):
                ragged = True
                for job, logits in zip(batch, self._ragged_pass(batch), strict=True):
                    job.logits = logits
            else:
                for job, logits in zip(batch, self._batched_pass(batch), strict=True):
                    job.logits = logits
        except BaseException as exc:  # every caller of the pass sees its failure
            for job in batch:
                job.error = exc
        if batch[0].kv is not None:
            self._count(batch, time.perf_counter() - began, ragged)

    def _count(self, batch: list[_Job], seconds: float, ragged: bool) -> None:
        self._recent = (self._recent[1], weakref.WeakSet(job.kv for job in batch if job.kv is not None))
        decoders = weakref.WeakSet(job.kv for job in batch if job.kv is not None and not job.prefill)
        if decoders:  # a pass of prefill chunks alone leaves the last decoders waiting, not gone
            self._recent_decoders = (self._recent_decoders[1], decoders)
        self._pass_seconds = _decayed(self._pass_seconds, seconds)
        positions = [job.positions for job in batch]
        rows = sum(positions) if ragged else len(batch) * max(positions)
        self._pass_time.add(rows, seconds)
        decode_rows = sum(job.positions - job.prompt_rows for job in batch if not job.prefill)
        if decode_rows:
            self._decode_rows = _decayed(self._decode_rows, decode_rows)
        for job in batch:
            job.pass_calls, job.pass_rows = len(batch), rows
        stats = self.stats
        stats.batches += 1
        stats.batch_calls += len(batch)
        stats.batch_tokens += rows
        stats.batch_positions += sum(positions)
        stats.batch_seconds += seconds
        stats.largest_batch = max(stats.largest_batch, len(batch))

    # the batched pass -------------------------------------------------------------------------
    def _batched_pass(self, batch: list[_Job]) -> list[torch.Tensor]:
        device, dtype = model_device_dtype(self.model)
        kvs = [job.kv for job in batch]
        plans = [job.plan for job in batch]
        assert all(kv is not None for kv in kvs) and all(plan is not None for plan in plans)
        cached = [kv.physical_len() for kv in kvs]  # type: ignore[union-attr]
        news = [len(plan.tokens) for plan in plans]  # type: ignore[union-attr]
        longest, widest, size = max(cached), max(news), len(batch)

        cache = growing_cache(self.model.config)
        growing = growing_layer_class()
        if longest:
            # The sessions' entries, left-padded, in buffers with room for the pass's new entries:
            # the model appends them in place (no copy of the batch's cache per layer).
            states = [kv.layer_states() for kv in kvs]  # type: ignore[union-attr]
            for index, layer in enumerate(cache.layers):
                template = next(s[index] for s in states if s[index] is not None)[0]
                shape = (size, template.shape[1], longest + widest, template.shape[3])
                keys = template.new_zeros(shape)
                values = template.new_zeros(shape)
                for b, state in enumerate(states):
                    if state[index] is not None:
                        keys[b, :, longest - cached[b]:longest] = state[index][0][0]
                        values[b, :, longest - cached[b]:longest] = state[index][1][0]
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys[..., :longest, :], values[..., :longest, :]
                if isinstance(layer, growing):
                    layer._key_buffer, layer._value_buffer = keys, values

        total = longest + widest
        input_ids = torch.zeros((size, widest), dtype=torch.long)
        positions = torch.zeros((size, widest), dtype=torch.long)
        allowed = torch.zeros((size, widest, total), dtype=torch.bool)
        allowed[:, torch.arange(widest), longest + torch.arange(widest)] = True  # padding sees itself
        keep = 0
        for b, plan in enumerate(plans):
            assert plan is not None
            n, c = news[b], cached[b]
            input_ids[b, widest - n:] = torch.tensor(plan.tokens, dtype=torch.long)
            positions[b, widest - n:] = torch.tensor(plan.positions, dtype=torch.long)
            rows = slice(widest - n, widest)
            allowed[b, rows, :] = False
            allowed[b, rows, longest - c:longest] = plan.allowed[:, :c]
            allowed[b, rows, total - n:] = plan.allowed[:, c:]
            keep = max(keep, n - plan.rows_from)

        with torch.no_grad():
            logits = causal_lm_logits(self.model, input_ids.to(device),
                                      additive_mask(allowed, dtype)[:, None].to(device),
                                      positions.to(device), cache, keep).float()

        results = []
        for b, (kv, plan) in enumerate(zip(kvs, plans, strict=True)):
            assert kv is not None and plan is not None
            n = news[b]
            # Each session's cached entries are unchanged: it appends only its new ones.
            kv.append_layer_entries([(layer.keys[b:b + 1, :, total - n:total],
                                      layer.values[b:b + 1, :, total - n:total]) for layer in cache.layers])
            results.append(logits[b, keep - (n - plan.rows_from):])
        return results

    def _ragged_pass(self, batch: list[_Job]) -> list[torch.Tensor | None]:
        """The calls' new entries end to end in one row (specdec.runtime.ragged); each session's
        entries are appended to its own cache during the pass. Logits rows per call (None for a
        prefill chunk)."""
        device, dtype = model_device_dtype(self.model)
        segments: list[Segment] = []
        tokens: list[int] = []
        positions: list[int] = []
        keep: list[int] = []
        for job in batch:
            kv, plan = job.kv, job.plan
            assert kv is not None and plan is not None
            start, n = len(tokens), len(plan.tokens)
            segments.append(Segment(kv.cache_layers(), slice(start, start + n),
                                    additive_mask(plan.allowed, dtype)[None, None].to(device)))
            tokens += plan.tokens
            positions += plan.positions
            if not job.prefill:
                keep += range(start + plan.rows_from, start + n)
        lengths = [job.kv.physical_len() for job in batch]  # type: ignore[union-attr]
        try:
            with torch.no_grad():
                all_logits = causal_lm_logits(
                    self.model,
                    torch.tensor([tokens], dtype=torch.long, device=device),
                    # A placeholder: the model passes a ready 4D mask on as it is, and the ragged
                    # attention reads each segment's own mask instead.
                    torch.zeros((1, 1, 1, 1), dtype=dtype, device=device),
                    torch.tensor([positions], dtype=torch.long, device=device),
                    None,
                    torch.tensor(keep, dtype=torch.long, device=device),
                    ragged=RaggedPass(segments),
                )
        except BaseException:
            for job, length in zip(batch, lengths, strict=True):  # entries some layers appended
                job.kv.drop_entries_after(length)  # type: ignore[union-attr]
            raise
        logits = all_logits[0].float()
        results: list[torch.Tensor | None] = []
        row = 0
        for job in batch:
            if job.prefill:
                results.append(None)
                continue
            assert job.plan is not None
            wanted = len(job.plan.tokens) - job.plan.rows_from
            results.append(logits[row:row + wanted])
            row += wanted
        return results
