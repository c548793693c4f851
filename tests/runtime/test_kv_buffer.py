"""The cache layers append into spare room instead of copying a session's whole cache per pass."""

from __future__ import annotations

import torch

from specdec.runtime.kv import TreeKVCache, _append


def test_append_writes_in_place_while_there_is_room():
    first = _append(None, torch.tensor([]), torch.ones(1, 2, 3, 4))
    assert first.shape[-2] >= 3 + 64  # room to grow
    keys = first[..., :3, :]
    second = _append(first, keys, torch.full((1, 2, 2, 4), 2.0))
    assert second is first  # no copy
    expected = torch.cat([torch.ones(1, 2, 3, 4), torch.full((1, 2, 2, 4), 2.0)], -2)
    assert torch.equal(second[..., :5, :], expected)
    # a view of someone else's tensor (a batched pass handed the states back) is copied once
    foreign = torch.zeros(1, 2, 5, 4)
    third = _append(first, foreign, torch.ones(1, 2, 1, 4))
    assert third is not first
    assert torch.equal(third[..., :6, :], torch.cat([foreign, torch.ones(1, 2, 1, 4)], -2))


def test_a_cache_grows_past_its_room_and_rolls_back(tiny):
    model = tiny.model
    kv, fresh = TreeKVCache(model), TreeKVCache(model)
    tokens = [i % 8 for i in range(150)]  # more than the first buffer's room
    for start in range(0, 150, 10):
        kv.extend_chain(tokens[start:start + 10])
        kv.settle(list(range(10)))
    kv.truncate(100)  # a rollback, then new entries written over the old ones
    row = kv.extend_chain([5, 6])
    fresh.prefill(tokens[:100])
    assert torch.allclose(row, fresh.extend_chain([5, 6]), atol=1e-5)
    layer = kv.cache.layers[0]
    assert layer.keys.shape[-2] == 102 and layer.keys.data_ptr() == layer._key_buffer.data_ptr()
