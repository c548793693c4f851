"""The KV pool (specdec.runtime.kv_pool) without a GPU: its passes run eagerly here, with the same
inputs (slot ids, write indices, masks, padding) the captured graphs take on CUDA."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import ForwardBatcher
from specdec.runtime.kv import CacheError, TreeKVCache
from specdec.runtime.kv_pool import (
    MAX_CAPTURED_ROWS,
    KVPool,
    PoolConfig,
    PooledTreeKVCache,
    bucket,
    engine_pool,
    renew_session_cache,
)
from specdec.runtime.tiny import build_tiny_model
from specdec.trees import sequence_parents

ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_tiny_model(vocab_size=40, seed=5, hidden_size=32, num_layers=2, max_position_embeddings=512)


def eager_pool(model, **kwargs) -> KVPool:
    return KVPool(model, PoolConfig(capture=False, **{"slots": 3, "slot_tokens": 64, **kwargs}))


def random_walk(a: TreeKVCache, b: TreeKVCache, steps: int, seed: int) -> None:
    """Trees extended, one path settled, now and then a rollback: both caches give the same rows."""
    rng = random.Random(seed)
    for step in range(steps):
        n = rng.randint(1, 6)
        tokens = [rng.randrange(40) for _ in range(n)]
        parents = [rng.randint(-1, j - 1) for j in range(n)]
        rows_from = rng.randrange(n)
        torch.testing.assert_close(b.extend(tokens, parents, rows_from), a.extend(tokens, parents, rows_from),
                                   atol=ATOL, rtol=0)
        path = a.path_to(rng.randrange(a.block_len))
        a.settle(path)
        b.settle(path)
        if step % 5 == 4:
            keep = rng.randint(1, a.prefix_len)
            a.truncate(keep)
            b.truncate(keep)
        assert a.prefix == b.prefix and b.physical_len() == a.physical_len()


def test_a_pooled_cache_gives_the_eager_caches_rows_through_trees_settles_and_rollbacks(model):
    pool = eager_pool(model)
    eager, pooled = TreeKVCache(model), pool.new_cache()
    assert isinstance(pooled, PooledTreeKVCache) and pooled.pooled
    prompt = list(range(1, 30))
    eager.prefill(prompt)
    pooled.prefill(prompt)
    random_walk(eager, pooled, 12, seed=1)
    assert pooled.pooled  # still within its slot


def test_a_session_that_outgrows_its_slot_moves_to_an_eager_cache_and_gives_the_slot_back(model):
    pool = eager_pool(model, slots=1, slot_tokens=40)
    eager, pooled = TreeKVCache(model), pool.new_cache()
    eager.prefill(list(range(1, 30)))
    pooled.prefill(list(range(1, 30)))
    assert pool.free_slots == 0
    random_walk(eager, pooled, 14, seed=2)  # grows past 40 entries on the way
    assert not pooled.pooled and pool.free_slots == 1
    random_walk(eager, pooled, 3, seed=3)  # and goes on exactly on the eager cache


def test_a_prompt_longer_than_a_prefill_chunk_is_prefilled_in_chunks(model, monkeypatch):
    monkeypatch.setattr("specdec.runtime.kv_pool.PREFILL_CHUNK", 7)
    pool = eager_pool(model)
    eager, pooled = TreeKVCache(model), pool.new_cache()
    prompt = [random.Random(4).randrange(40) for _ in range(31)]
    eager.prefill(prompt)
    pooled.prefill(prompt)
    assert pool.passes["eager"] == 5
    torch.testing.assert_close(pooled.extend_chain([3, 4]), eager.extend_chain([3, 4]), atol=ATOL, rtol=0)


def test_padding_to_bucket_shapes_leaves_the_real_rows_unchanged(model):
    """What a captured pass does to a pass: more batch rows, query rows and context columns, all masked."""
    pool = eager_pool(model, slots=4, slot_tokens=64)
    caches = [pool.new_cache() for _ in range(3)]
    rng = random.Random(5)
    for i, cache in enumerate(caches):
        cache.prefill([rng.randrange(40) for _ in range(10 + 5 * i)])
    plans = [c.plan([rng.randrange(40) for _ in range(n)], sequence_parents(n), 0)
             for c, n in zip(caches, (1, 3, 2), strict=True)]
    rows = [c.row(p) for c, p in zip(caches, plans, strict=True)]
    exact = pool.run(rows)
    for cache in caches:
        cache.truncate(cache.prefix_len)  # the pass wrote entries beyond each length: harmless
    padded = pool.run(rows, pad_to=(4, 8, 64))
    alone = [pool.run([row])[0] for row in rows]
    for got, want, lone in zip(padded, exact, alone, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(lone, want, atol=ATOL, rtol=0)
    with pytest.raises(CacheError, match="does not hold"):
        pool.run(rows, pad_to=(2, 8, 64))


def test_a_broken_mask_is_caught_by_the_same_comparison(model):
    """The negative control: a row that may see one entry it must not see changes its logits."""
    pool = eager_pool(model)
    cache = pool.new_cache()
    cache.prefill(list(range(1, 12)))
    plan = cache.plan([5, 6, 7], [-1, -1, 0], 0)  # entry 1 must not see entry 0
    right = pool.run([cache.row(plan)])[0]
    leaky = cache.row(plan)
    leaky.allowed = leaky.allowed.clone()
    leaky.allowed[1, 11] = True
    wrong = pool.run([leaky])[0]
    assert (wrong[1] - right[1]).abs().max() > 1e-3
    torch.testing.assert_close(wrong[0], right[0], atol=ATOL, rtol=0)


def test_the_batcher_runs_pooled_sessions_in_one_pool_pass(model):
    pool = eager_pool(model)
    batcher = ForwardBatcher(model, BatchConfig(window_ms=0))
    caches = [pool.new_cache(runner=batcher) for _ in range(3)]
    for i, cache in enumerate(caches):
        cache.prefill(list(range(1, 8 + i)))
    from specdec.runtime.batching import _Job

    jobs = [_Job(kv=c, plan=c.plan([1, 2], [-1, 0], 0)) for c in caches]
    before = dict(pool.passes)
    batcher._execute(jobs)
    assert pool.passes["eager"] == before["eager"] + 1  # one pass for the three sessions
    for job in jobs:
        assert job.error is None and job.logits is not None and job.logits.shape == (2, 40)
        expected = TreeKVCache(model)
        expected.prefill(job.kv.prefix)
        torch.testing.assert_close(job.logits, expected.extend([1, 2], [-1, 0], 0), atol=ATOL, rtol=0)


def test_slots_run_out_into_eager_caches_and_come_back_when_caches_go(model):
    pool = eager_pool(model, slots=2)
    first, second, third = pool.new_cache(), pool.new_cache(), pool.new_cache()
    assert isinstance(first, PooledTreeKVCache) and isinstance(second, PooledTreeKVCache)
    assert not isinstance(third, PooledTreeKVCache)  # the fallback: an eager cache
    del first
    gc.collect()
    assert pool.free_slots == 1
    renewed = renew_session_cache(second, model, pool)  # the old slot goes back before the new one
    assert isinstance(renewed, PooledTreeKVCache) and pool.free_slots == 1


def test_buckets_and_captured_shapes():
    assert bucket(5, (1, 2, 4, 8)) == 8 and bucket(1, (1, 2)) == 1 and bucket(9, (1, 2, 4, 8)) is None
    config = PoolConfig(slot_tokens=3000)
    assert config.kv_buckets == (256, 512, 1024, 2048, 3000)
    assert all(b * q <= MAX_CAPTURED_ROWS for b, q, _ in config.captured_shapes())
    assert (1, 64, 3000) in config.captured_shapes() and (8, 64, 256) not in config.captured_shapes()
    with pytest.raises(ValueError):
        PoolConfig(query_buckets=(4, 2))
    with pytest.raises(ValueError):
        PoolConfig(slots=0)


def test_no_pool_off_cuda_unless_asked_to_run_it_eagerly(model):
    assert engine_pool(model, None) is None
    assert engine_pool(model, PoolConfig()) is None  # capture asked for, on the CPU: eager caches
    pool = engine_pool(model, PoolConfig(capture=False, slots=1, slot_tokens=16))
    assert isinstance(pool, KVPool) and pool.capture().graphs == 0
