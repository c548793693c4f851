"""The prefix cache (specdec.runtime.prefix_cache): blocks keyed by partition and every token before
their end, least recently used out first within a byte budget; a session that starts from cached
blocks gets bitwise the rows of a cold prefill at int8, within rounding at float32; partitions keep
a tenant's prompts out of another's reach (the membership probe)."""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.kv import TreeKVCache
from specdec.runtime.loading import quantize_int8
from specdec.runtime.prefix_cache import PrefixLink, PrefixStore, block_keys, root_key
from specdec.runtime.scoring import commit_path, score_tree
from specdec.runtime.tiny import build_tiny_model
from specdec.trees import DraftTree

VOCAB = 48
BLOCK = 8


def _states(value: float, layers: int = 2, tokens: int = BLOCK) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 1, tokens, 4), float(value)), torch.full((1, 1, tokens, 4), -float(value)))
            for _ in range(layers)]


BLOCK_BYTES = 2 * 2 * BLOCK * 4 * 4  # layers x (keys, values) x tokens x dim x float32


# --------------------------------------------------------------------------- the store alone


def test_keys_name_the_partition_and_every_token_before_the_blocks_end():
    tokens = list(range(3 * BLOCK + 5))
    keys = block_keys("a", tokens, BLOCK)
    assert len(keys) == 3  # full blocks only
    assert block_keys("a", tokens[:2 * BLOCK], BLOCK) == keys[:2]  # a prefix's keys are the prefix of keys
    changed = [99] + tokens[1:]
    assert not set(block_keys("a", changed, BLOCK)) & set(keys)  # an early token changes every later key
    assert not set(block_keys("b", tokens, BLOCK)) & set(keys)  # so does the partition


def test_lookup_finds_the_longest_stored_run_from_the_first_block():
    store = PrefixStore(max_bytes=10 * BLOCK_BYTES, block_tokens=BLOCK)
    keys = block_keys("", list(range(4 * BLOCK)), BLOCK)
    for index in (0, 1, 3):  # block 2 missing
        assert store.store(keys[index], _states(index))
    found = store.lookup(keys)
    assert [float(block.states[0][0][0, 0, 0, 0]) for block in found] == [0.0, 1.0]
    assert store.lookup(keys[1:]) and not store.lookup(keys[2:])
    stats = store.stats()
    assert stats["prefix_cache_lookups"] == 3 and stats["prefix_cache_hits"] == 2
    assert stats["prefix_cache_hit_tokens"] == 3 * BLOCK and stats["prefix_cache_bytes"] == 3 * BLOCK_BYTES
    assert not store.store(keys[0], _states(5))  # stored once


def test_a_partial_block_goes_on_from_where_the_full_blocks_stop():
    store = PrefixStore(max_bytes=10 * BLOCK_BYTES, block_tokens=BLOCK)
    tokens = list(range(3 * BLOCK + 5))
    keys = block_keys("", tokens, BLOCK)
    store.store(keys[0], _states(0))
    store.store_tail(keys[0], tokens[BLOCK:BLOCK + 5], _states(7, tokens=5))  # block 1 is missing
    found = store.lookup(keys, tokens, root_key(""))
    assert [block.tokens for block in found] == [BLOCK, 5] and float(found[1].states[0][0][0, 0, 0, 0]) == 7.0
    assert [block.tokens for block in store.lookup(keys)] == [BLOCK]  # without the tokens: full blocks only
    other = tokens[:BLOCK + 3] + [99] + tokens[BLOCK + 4:]  # the prompt parts from the tail's 4th token
    assert [b.tokens for b in store.lookup(block_keys("", other, BLOCK), other, root_key(""))] == [BLOCK, 3]
    assert [b.tokens for b in store.lookup(keys[:1], tokens[:BLOCK + 2], root_key(""))] == [BLOCK, 2]  # short
    store.store_tail(root_key(""), tokens[:3], _states(8, tokens=3))
    assert [b.tokens for b in store.lookup([], tokens[:5], root_key(""))] == [3]  # a tail from the root
    assert not store.lookup([], tokens[:3], root_key("b"))  # another partition's root
    assert store.stats()["prefix_cache_hit_tokens"] == (BLOCK + 5) + BLOCK + (BLOCK + 3) + (BLOCK + 2) + 3
    assert not store.store_tail(root_key(""), tokens[:3], _states(9, tokens=3))  # the same tail: kept
    assert store.store_tail(root_key(""), [5, 6], _states(9, tokens=2))  # another: replaces it
    assert [b.tokens for b in store.lookup([], [5, 6, 7], root_key(""))] == [2]
    assert store.bytes == BLOCK_BYTES * (1 + 5 / BLOCK + 2 / BLOCK) and len(store) == 3
    with pytest.raises(ValueError, match="partial block"):
        store.store_tail(root_key(""), tokens[:BLOCK], _states(1))


def test_eviction_is_least_recently_used_within_the_bytes_and_keeps_a_chains_head():
    store = PrefixStore(max_bytes=3 * BLOCK_BYTES, block_tokens=BLOCK)
    chain = block_keys("", list(range(3 * BLOCK)), BLOCK)
    other = block_keys("other", list(range(BLOCK)), BLOCK)
    for key in chain:
        store.store(key, _states(1))
    store.lookup(chain)  # touched last-to-first: the head of the chain ends most recently used
    store.store(other[0], _states(2))  # one must go: the chain's tail, not its head
    assert chain[0] in store and chain[1] in store and chain[2] not in store
    assert store.stats()["prefix_cache_evictions"] == 1 and store.bytes == 3 * BLOCK_BYTES
    assert not PrefixStore(max_bytes=BLOCK_BYTES - 1, block_tokens=BLOCK).store(chain[0], _states(1))


def test_an_evicted_block_stays_whole_for_the_session_that_took_it():
    store = PrefixStore(max_bytes=BLOCK_BYTES, block_tokens=BLOCK)
    first, second = block_keys("", list(range(2 * BLOCK)), BLOCK)
    store.store(first, _states(3))
    taken = store.lookup([first])[0]
    store.store(second, _states(4))  # evicts `first`
    assert first not in store and float(taken.states[1][1][0, 0, 0, 0]) == -3.0


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixStore(max_bytes=-1)
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixStore(max_bytes=1, block_tokens=0)


# --------------------------------------------------------------------------- through a session's cache


def _model(int8: bool):
    torch.manual_seed(0)
    model = build_tiny_model(vocab_size=VOCAB, seed=11, hidden_size=64, num_layers=2,
                             max_position_embeddings=512, logit_scale=1.0)
    return quantize_int8(model) if int8 else model


def _cache(model, store: PrefixStore | None, partition: str = "") -> TreeKVCache:
    kv = TreeKVCache(model)
    if store is not None:
        kv.prefix_link = PrefixLink(store, partition)
    return kv


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(5 * i + 3 + salt) % VOCAB for i in range(n)]


TREE = DraftTree((1, 2, 3), (-1, 0, 0))


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "float32"])
def test_a_hit_gives_the_rows_of_a_cold_prefill(int8):
    """int8: bitwise (rows depend on their prefix alone, docs/algorithms.md §14 and §16); float32: the cached
    entries come from other pass shapes, within rounding."""
    model = _model(int8)
    store = PrefixStore(max_bytes=1 << 30, block_tokens=BLOCK)
    first_turn = _prompt(70)
    next_turn = first_turn + _prompt(23, salt=1)
    with torch.inference_mode():
        writer = _cache(model, store)
        score = score_tree(writer, first_turn, TREE)  # prefilled and published
        commit_path(writer, score.pending_len, [])
        assert score.restored == 0 and len(store) == 69 // BLOCK

        reader = _cache(model, store)
        warm = score_tree(reader, next_turn, TREE)
        cold = score_tree(_cache(model, None), next_turn, TREE)
    assert warm.restored == 64 and warm.reused == cold.reused + 64 == 64
    if int8:
        assert torch.equal(warm.logits, cold.logits)
        for (k1, v1), (k2, v2) in zip(reader.layer_states(), _cache_states(model, next_turn), strict=True):
            assert torch.equal(k1[..., :64, :], k2[..., :64, :])
            assert torch.equal(v1[..., :64, :], v2[..., :64, :])
    else:
        torch.testing.assert_close(warm.logits, cold.logits, rtol=0, atol=1e-4)


def _cache_states(model, tokens):
    kv = _cache(model, None)
    with torch.inference_mode():
        kv.prefill(tokens)
    return kv.layer_states()


def test_generated_tokens_enter_the_cache_as_they_settle():
    """A chat's next turn hits the previous turn's prompt and its answer: settled tokens are published."""
    model = _model(True)
    store = PrefixStore(max_bytes=1 << 30, block_tokens=BLOCK)
    prompt = _prompt(20)
    with torch.inference_mode():
        kv = _cache(model, store)
        committed = list(prompt)
        for _ in range(12):  # one token committed per step, as a target-only run does
            score = score_tree(kv, committed, DraftTree((), ()))
            token = int(score.logits[0].argmax())
            commit_path(kv, score.pending_len, [])
            committed.append(token)
        follow = committed + _prompt(9, salt=2)
        reader = _cache(model, store)
        warm = score_tree(reader, follow, DraftTree((), ()))
    assert warm.restored == (len(committed) - 1) // BLOCK * BLOCK == 24


def _chat_turn(kv: TreeKVCache, prompt: list[int], steps: int) -> list[int]:
    """Target-only steps from `prompt` (greedy): the committed tokens, prompt and answer."""
    committed = list(prompt)
    for _ in range(steps):
        score = score_tree(kv, committed, DraftTree((), ()))
        commit_path(kv, score.pending_len, [])
        committed.append(int(score.logits[0].argmax()))
    return committed


@pytest.mark.parametrize("ended", [True, False], ids=["tail-stored", "no-tail"])
def test_the_next_turn_goes_on_from_an_ended_sessions_last_entry(ended):
    """A session that ends stores its last, partial block (and its last full block less a token as a
    partial one): the next turn restores every entry the session held that it agrees with (all but
    the answer's last token, which no pass took in), bitwise a cold prefill's at int8. Without them,
    the next turn stops at the last block boundary it agrees with."""
    model = _model(True)
    store = PrefixStore(max_bytes=1 << 30, block_tokens=BLOCK)
    with torch.inference_mode():
        kv = _cache(model, store)
        committed = _chat_turn(kv, _prompt(20), 9)
        assert kv.prefix_len == len(committed) - 1 == 28
        if ended:
            kv.publish_tail()
            kv.publish_tail()  # once
        follow = committed + _prompt(9, salt=2)
        reader = _cache(model, store)
        warm = score_tree(reader, follow, TREE)
        cold = score_tree(_cache(model, None), follow, TREE)
        # A next turn that resends fewer of the session's tokens (it held tokens past the answer its
        # client got: a draft accepted beyond the length limit) takes what agrees, also where it parts
        # from the session inside the session's last full block.
        cut = committed[:26] + _prompt(9, salt=3)
        shorter = score_tree(_cache(model, store), cut, TREE)
        inside = committed[:20] + _prompt(9, salt=3)
        earlier = score_tree(_cache(model, store), inside, TREE)
    assert len(store) == 3 + 2 * ended  # the full blocks, and two partial ones
    assert warm.restored == (28 if ended else 24) and shorter.restored == (26 if ended else 24)
    assert earlier.restored == (20 if ended else 16)
    assert torch.equal(warm.logits, cold.logits)
    for (k1, v1), (k2, v2) in zip(reader.layer_states(), _cache_states(model, follow), strict=True):
        assert torch.equal(k1[..., :warm.reused, :], k2[..., :warm.reused, :])
        assert torch.equal(v1[..., :warm.reused, :], v2[..., :warm.reused, :])


def test_a_session_that_already_holds_the_prefix_takes_nothing():
    model = _model(True)
    store = PrefixStore(max_bytes=1 << 30, block_tokens=BLOCK)
    prompt = _prompt(40)
    with torch.inference_mode():
        kv = _cache(model, store)
        commit_path(kv, score_tree(kv, prompt, TREE).pending_len, [])
        again = score_tree(kv, prompt + [1, 2, 3], TREE)
    assert again.restored == 0 and again.reused == 40


def test_the_membership_probe_sees_another_partitions_prompt_only_without_isolation():
    """Tenant A sends a prompt; tenant B probes with the same prompt. Without isolation (one partition)
    B's call comes back with cached tokens and forwards fewer tokens (a faster first token); under its
    own partition B sees exactly what a cold cache would."""
    model = _model(True)
    secret = _prompt(64, salt=5)

    def probe(shared: bool) -> tuple[int, int]:
        store = PrefixStore(max_bytes=1 << 30, block_tokens=BLOCK)
        forwarded = []
        with torch.inference_mode():
            writer = _cache(model, store, partition="tenant-a")
            commit_path(writer, score_tree(writer, secret, TREE).pending_len, [])
            prober = _cache(model, store, partition="tenant-a" if shared else "tenant-b")
            prefill, extend = prober.prefill, prober.extend

            def counting_prefill(tokens):
                forwarded.append(len(tokens))
                prefill(tokens)

            def counting_extend(tokens, parents, rows_from=0):
                forwarded.append(len(tokens))
                return extend(tokens, parents, rows_from)

            prober.prefill, prober.extend = counting_prefill, counting_extend  # type: ignore[method-assign]
            score = score_tree(prober, secret, TREE)
        return score.restored, sum(forwarded)

    assert probe(shared=True)[0] > 0 and probe(shared=True)[1] < probe(shared=False)[1]
    restored, forwarded = probe(shared=False)
    assert restored == 0 and forwarded == len(secret) + len(TREE)  # all of it, as a cold cache


def test_a_session_moved_to_another_partition_publishes_under_it():
    model = _model(True)
    store = PrefixStore(max_bytes=1 << 30, block_tokens=BLOCK)
    prompt, later = _prompt(33), _prompt(33) + [1] * BLOCK
    with torch.inference_mode():
        kv = _cache(model, store, partition="a")
        commit_path(kv, score_tree(kv, prompt, TREE).pending_len, [])
        kv.set_partition("b")
        commit_path(kv, score_tree(kv, later, TREE).pending_len, [])
    assert all(key in store for key in block_keys("a", prompt, BLOCK))
    assert all(key in store for key in block_keys("b", later, BLOCK))


def test_negative_control_keys_that_forget_earlier_blocks_restore_wrong_entries(monkeypatch):
    """The bitwise check above catches a broken key: when a block's key names only its own tokens, a
    prompt whose second block was seen after another first block takes that block's entries, computed
    in the other context, and its rows move."""
    from specdec.runtime import kv as kv_module
    from specdec.runtime import prefix_cache as prefix_module

    def forgetful(previous: bytes, tokens) -> bytes:
        return prefix_module.root_key("") + bytes(str(list(tokens)), "ascii")

    monkeypatch.setattr(prefix_module, "next_key", forgetful)
    monkeypatch.setattr(kv_module, "next_key", forgetful)
    model = _model(True)
    store = PrefixStore(max_bytes=1 << 30, block_tokens=BLOCK)
    first_a, first_b, second = _prompt(BLOCK, salt=1), _prompt(BLOCK, salt=2), _prompt(BLOCK, salt=3)
    probe = first_b + second + _prompt(5, salt=4)
    with torch.inference_mode():
        for seen in (first_a + second + [1], first_b + [7] * BLOCK + [1]):  # block 2 after A; B's block 1
            kv = _cache(model, store)
            commit_path(kv, score_tree(kv, seen, TREE).pending_len, [])
        warm = score_tree(_cache(model, store), probe, TREE)
        cold = score_tree(_cache(model, None), probe, TREE)
    assert warm.restored == 2 * BLOCK  # B's first block, then A's second: a wrong hit
    assert not torch.equal(warm.logits, cold.logits)


def test_a_pooled_session_restores_into_its_slot_and_publishes_from_it():
    """The CUDA pool's slots take cached blocks as the growing cache does (here the pool runs eagerly on
    the CPU): the rows after a restore are those of an eager cache, within float32 rounding."""
    from specdec.runtime.kv_pool import KVPool, PoolConfig, new_session_cache

    model = _model(False)
    pool = KVPool(model, PoolConfig(capture=False, slots=2, slot_tokens=256))
    store = PrefixStore(max_bytes=1 << 30, block_tokens=BLOCK)
    first_turn, next_turn = _prompt(40), _prompt(40) + _prompt(11, salt=3)
    with torch.inference_mode():
        writer = new_session_cache(model, pool, prefix_store=store)
        assert writer.pooled  # type: ignore[attr-defined]
        commit_path(writer, score_tree(writer, first_turn, TREE).pending_len, [])
        assert len(store) == 40 // BLOCK  # published from the slot
        reader = new_session_cache(model, pool, prefix_store=store)
        warm = score_tree(reader, next_turn, TREE)
        cold = score_tree(_cache(model, None), next_turn, TREE)
    assert reader.pooled and warm.restored == 40  # type: ignore[attr-defined]
    torch.testing.assert_close(warm.logits, cold.logits, rtol=0, atol=1e-4)
