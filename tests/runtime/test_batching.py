"""Batched passes give every session the rows (and cache) a pass of its own would have.

Sessions with different cache lengths, pending blocks and trees share passes; each session's
rows must match the plain forward of its own root-to-node paths, and its cache must go on
working afterwards (the next step reuses the entries the batched pass handed back).
"""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest
import torch

from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import MIN_PREFILL_CHUNK, PASS_SECONDS_WEIGHT, ForwardBatcher, _Job
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.scoring import commit_path, prepare, score_tree, tree_block
from specdec.trees import DraftTree
from tests.runtime.test_scoring import assert_rows_match, random_tree

JOIN_S = 60


def _plan_tree(kv: TreeKVCache, committed: list[int], tree: DraftTree):
    """What score_tree would run, as a plan (the cache is brought to `committed` first)."""
    reused, pending, _ = prepare(kv, committed)
    tokens = pending + list(tree.tokens)
    return pending, kv.plan(tokens, tree_block(len(pending), tree), rows_from=len(pending) - 1)


def test_batched_pass_rows_equal_each_sessions_own_paths(tiny):
    model, vocab = tiny.model, tiny.info.vocab_size
    rng = random.Random(5)
    batcher = ForwardBatcher(model, BatchConfig(window_ms=0))
    kvs = [TreeKVCache(model, runner=batcher) for _ in range(4)]
    committed = [[rng.randrange(vocab) for _ in range(length)] for length in (3, 17, 1, 9)]
    for step in range(3):
        trees = [random_tree(rng, rng.randrange(0, 6), vocab) for _ in kvs]
        jobs = []
        for kv, seq, tree in zip(kvs, committed, trees, strict=True):
            pending, plan = _plan_tree(kv, seq, tree)
            jobs.append((kv, plan, len(pending)))
        # One batched pass for all four sessions (what the leader does with a full queue).
        batch = [_Job(kv=kv, plan=plan) for kv, plan, _ in jobs]
        batcher._execute(batch)
        for (kv, plan, pending_len), job, seq, tree in zip(jobs, batch, committed, trees, strict=True):
            assert job.error is None
            kv.apply(plan)
            assert_rows_match(model, seq, tree, job.logits)
            # Accept a random path, then extend the sequence as a verifier would.
            node = rng.randrange(-1, len(tree))
            path = [] if node < 0 else tree.path_to(node)
            commit_path(kv, pending_len, path)
            seq.extend(tree.tokens[n] for n in path)
            seq.append(rng.randrange(vocab))
        assert batcher.stats.largest_batch == 4, step


def test_threads_share_passes_and_each_gets_its_own_rows(tiny):
    """Concurrent score_tree calls through the batcher: passes are shared, rows stay exact. Every
    prompt is at most MIN_PREFILL_CHUNK tokens, so no cut beside the others' decoding can split one
    into a prefill chunk: one call per session and step (a 17-token prompt was cut whenever the
    others' plans were queued before it was sized, a call more: the flake of a loaded run)."""
    model, vocab = tiny.model, tiny.info.vocab_size
    batcher = ForwardBatcher(model, BatchConfig(window_ms=50))
    failures: list[BaseException] = []
    start = threading.Barrier(6)

    def session(index: int) -> None:
        rng = random.Random(index)
        kv = TreeKVCache(model, runner=batcher)
        seq = [rng.randrange(vocab) for _ in range(2 + 2 * index)]
        assert len(seq) <= MIN_PREFILL_CHUNK
        try:
            start.wait(timeout=JOIN_S)
            for _ in range(4):
                with batcher.member():
                    tree = random_tree(rng, rng.randrange(1, 5), vocab)
                    score = score_tree(kv, seq, tree)
                    assert_rows_match(model, seq, tree, score.logits)
                    commit_path(kv, score.pending_len, tree.path_to(0))
                seq.extend(tree.tokens[n] for n in tree.path_to(0))
                seq.append(rng.randrange(vocab))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads), "a session hung"
    assert not failures, failures[0]
    assert batcher.stats.batch_calls == 24
    assert batcher.stats.largest_batch > 1, batcher.stats


def test_max_batch_tokens_bounds_a_pass(tiny):
    model = tiny.model
    batcher = ForwardBatcher(model, BatchConfig(max_batch_tokens=6, window_ms=0))
    kvs = [TreeKVCache(model, runner=batcher) for _ in range(4)]
    jobs = [_Job(kv=kv, plan=kv.plan([1, 2, 3], [-1, 0, 1], 2)) for kv in kvs]
    batcher._queue.extend(jobs)
    first = batcher._take()
    assert first == jobs[:2]  # 2 sessions x 3 positions = 6; a third would make 9
    assert batcher._take() == jobs[2:]


def test_disabled_batching_runs_plans_one_at_a_time(tiny):
    model = tiny.model
    batcher = ForwardBatcher(model, BatchConfig(enabled=False))
    kvs = [TreeKVCache(model, runner=batcher) for _ in range(3)]
    jobs = [_Job(kv=kv, plan=kv.plan([1], [-1], 0)) for kv in kvs]
    batcher._queue.extend(jobs)
    assert [batcher._take() for _ in jobs] == [[job] for job in jobs]


def test_a_failed_pass_reaches_every_caller_and_the_batcher_goes_on(tiny):
    model = tiny.model
    batcher = ForwardBatcher(model, BatchConfig(window_ms=0))
    kvs = [TreeKVCache(model, runner=batcher) for _ in range(2)]
    bad = kvs[0].plan([1], [-1], 0)
    bad.tokens = [10**6]  # an id outside the embedding: the pass fails
    jobs = [_Job(kv=kvs[0], plan=bad), _Job(kv=kvs[1], plan=kvs[1].plan([1], [-1], 0))]
    batcher._execute(jobs)
    assert all(isinstance(job.error, (IndexError, RuntimeError)) for job in jobs)
    fresh = TreeKVCache(model, runner=batcher)
    assert fresh.extend([1, 2], [-1, 0], 1).shape == (1, tiny.info.vocab_size)


@pytest.mark.parametrize("rows_from", [0, 2])
def test_rows_from_is_honoured_per_session(tiny, rows_from):
    model, vocab = tiny.model, tiny.info.vocab_size
    batcher = ForwardBatcher(model, BatchConfig(window_ms=0))
    a, b = TreeKVCache(model, runner=batcher), TreeKVCache(model, runner=batcher)
    plans = [a.plan([1, 2, 3], [-1, 0, 1], rows_from), b.plan([4], [-1], 0)]
    jobs = [_Job(kv=a, plan=plans[0]), _Job(kv=b, plan=plans[1])]
    batcher._execute(jobs)
    assert jobs[0].logits.shape == (3 - rows_from, vocab)
    assert jobs[1].logits.shape == (1, vocab)
    with torch.no_grad():
        plain = model(input_ids=torch.tensor([[1, 2, 3]])).logits[0].float()
    torch.testing.assert_close(jobs[0].logits, plain[rows_from:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_each_call_learns_the_shape_of_the_pass_it_ran_in(tiny, layout):
    """PassShape: a padded pass of 3 calls, the widest with 4 positions, carries 3 × 4 = 12 rows
    (padding included), a ragged one their 1 + 4 + 2 = 7, and every call of it is told so; a call
    alone is told its own positions. The counters keep the calls' own positions apart from the
    padding."""
    model = tiny.model
    batcher = ForwardBatcher(model, BatchConfig(window_ms=0, layout=layout))
    rows = 7 if batcher.joins_prefill else 12  # eager attention has no ragged passes
    assert batcher.joins_prefill == (layout == "ragged" and tiny.model.config._attn_implementation != "eager")
    kvs = [TreeKVCache(model, runner=batcher) for _ in range(3)]
    widths = (1, 4, 2)
    batch = [_Job(kv=kv, plan=kv.plan(list(range(1, n + 1)), list(range(-1, n - 1)), n - 1))
             for kv, n in zip(kvs, widths, strict=True)]
    batcher._execute(batch)
    assert [(job.pass_calls, job.pass_rows) for job in batch] == [(3, rows)] * 3
    counters = batcher.counters()
    assert (counters["batch_tokens"], counters["batch_positions"]) == (rows, 7)
    assert counters["batch_seconds"] > 0

    alone = TreeKVCache(model, runner=batcher)
    with batcher.shapes() as shapes:
        alone.extend([1, 2, 3], [-1, 0, 1], 2)
    assert [(shape.calls, shape.rows) for shape in shapes] == [(1, 3)]
    with batcher.shapes() as outer:
        with batcher.shapes() as inner:
            alone.extend([4], [-1], 0)
        alone.extend([5, 6], [-1, 0], 1)
    assert [(s.calls, s.rows) for s in inner] == [(1, 1)]
    assert [(s.calls, s.rows) for s in outer] == [(1, 2)]


def test_a_pass_waits_briefly_for_the_sessions_of_the_last_passes(tiny):
    """Sessions that ran in the last passes are expected back: a leader with only some of them queued
    waits (at most the window) for the rest, so clients do not settle into alternating halves; one
    that does not come back costs at most the window."""
    model = tiny.model
    batcher = ForwardBatcher(model, BatchConfig(window_ms=1000))
    kvs = [TreeKVCache(model, runner=batcher) for _ in range(2)]
    _shared_pass(batcher, kvs)
    before = batcher.stats.batches
    seconds = _second_call_late(kvs)
    assert batcher.stats.batches == before + 1, "the two calls shared one pass"
    assert seconds < 1.5

    # Only session 0 comes back now: the leader waits out the window once or twice, then runs alone.
    quick = ForwardBatcher(model, BatchConfig(window_ms=100))
    pair = [TreeKVCache(model, runner=quick) for _ in range(2)]
    _shared_pass(quick, pair)
    began = time.monotonic()
    for token in range(2, 6):
        pair[0].extend([token], [-1], 0)
    assert time.monotonic() - began < 0.25 * 4 + 1.0
    assert quick.stats.batches == 5


def test_a_released_session_is_not_waited_for(tiny):
    """A session whose request ended (released: nothing holds its cache) will not come back: the next
    pass does not wait the window for it. A live one that ran in the last passes is still waited for
    (the test above)."""
    model = tiny.model
    batcher = ForwardBatcher(model, BatchConfig(window_ms=1000))
    ended, next_request = TreeKVCache(model, runner=batcher), TreeKVCache(model, runner=batcher)
    _shared_pass(batcher, [ended])
    batcher._queue.append(_Job(kv=next_request, plan=next_request.plan([1], [-1], 0)))
    assert batcher._sessions_on_their_way(), "a live session of the last pass is expected back"
    batcher._queue.clear()
    del ended
    gc.collect()
    began = time.monotonic()
    next_request.extend([1], [-1], 0)
    assert time.monotonic() - began < 0.5, "the pass waited for a released session"


def _shared_pass(batcher: ForwardBatcher, kvs: list[TreeKVCache]) -> list[_Job]:
    """One batched pass in which every cache appends one token; its jobs."""
    jobs = [_Job(kv=kv, plan=kv.plan([1], [-1], 0)) for kv in kvs]
    batcher._execute(jobs)
    for job in jobs:
        assert job.error is None and job.kv is not None and job.plan is not None
        job.kv.apply(job.plan)
    return jobs


def _second_call_late(kvs: list[TreeKVCache], late_s: float = 0.2) -> float:
    """Cache 0 appends a token now and cache 1 `late_s` later, from another thread; seconds until
    both calls returned."""

    def late_second() -> None:
        time.sleep(late_s)
        kvs[1].extend([2], [-1], 0)

    thread = threading.Thread(target=late_second)
    thread.start()
    began = time.monotonic()
    kvs[0].extend([2], [-1], 0)
    thread.join(JOIN_S)
    return time.monotonic() - began


@pytest.mark.parametrize("share", [1.0, 0.0])
def test_the_window_grows_with_the_passes_by_its_share(tiny, share):
    """The gather window is the longer of window_ms and window_share × the recent passes' mean time:
    with passes of ~0.9 s and share 1, a call 0.2 s late still joins the pass; with share 0 (window_ms
    0) the leader does not wait and the late call gets a pass of its own."""
    model = tiny.model
    batcher = ForwardBatcher(model, BatchConfig(window_ms=0, window_share=share))
    kvs = [TreeKVCache(model, runner=batcher) for _ in range(2)]
    jobs = _shared_pass(batcher, kvs)
    start = batcher._pass_seconds  # the real pass's time (tiny model: milliseconds)
    for _ in range(10):  # ten slow passes' worth of time: the mean moves a fifth of the way each
        batcher._count(jobs, 1.0, False)
    mean = 1.0 - (1 - PASS_SECONDS_WEIGHT) ** 10 * (1.0 - start)
    assert batcher.window_seconds() == pytest.approx(share * mean, rel=1e-6)
    before = batcher.stats.batches
    _second_call_late(kvs)
    assert batcher.stats.batches == before + (1 if share else 2)


def test_the_window_share_is_checked():
    with pytest.raises(ValueError, match="window_share"):
        BatchConfig(window_share=1.5)
    assert BatchConfig().window_share == 0.1 and BatchConfig().window_ms == 10.0
