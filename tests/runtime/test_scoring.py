"""Tree scoring on the reusable cache equals plain forward passes of every root-to-node path.

This is what makes the product lossless: if a tree node's logits were not exactly the model's
logits after its own path (wrong mask, wrong position ids, stale or misplaced cache entries),
every verification method would be verifying against the wrong distribution.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.runtime.kv import CacheError, TreeKVCache
from specdec.runtime.scoring import commit_path, score_tree
from specdec.trees import DraftTree

ATOL = 1e-4


def plain_last_logits(model, sequence: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([sequence])).logits[0, -1].float()


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    tokens: list[int] = []
    parents: list[int] = []
    used: dict[int, set[int]] = {}
    for i in range(n):
        parent = rng.randrange(-1, i)
        free = [t for t in range(vocab) if t not in used.setdefault(parent, set())]
        if not free:
            parent = -1 if i == 0 else i - 1
            free = [t for t in range(vocab) if t not in used.setdefault(parent, set())]
        token = rng.choice(free)
        used[parent].add(token)
        tokens.append(token)
        parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


def assert_rows_match(model, committed: list[int], tree: DraftTree, logits: torch.Tensor) -> None:
    assert logits.shape == (len(tree) + 1, model.config.vocab_size)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], plain_last_logits(model, committed), atol=ATOL, rtol=0)
    for node in range(len(tree)):
        expected = plain_last_logits(model, committed + tree.path_tokens(node))
        torch.testing.assert_close(logits[node + 1], expected, atol=ATOL, rtol=0, msg=f"node {node}")


@pytest.mark.parametrize("max_pending", [32, 2], ids=["one-pass", "prefill"])
def test_tree_rows_equal_plain_paths_across_iterations(tiny, max_pending):
    """Several speculation steps on one cache: partial acceptance, rollback, reuse.

    With max_pending=2 the longer runs of uncached tokens (the prompt, the rewind) go through
    the separate causal prefill pass first.
    """
    model, vocab = tiny.model, tiny.info.vocab_size
    rng = random.Random(7)
    kv = TreeKVCache(model)
    committed = [rng.randrange(vocab) for _ in range(5)]
    fork = -1
    for step in range(8):
        tree = DraftTree.empty() if step == 3 else random_tree(rng, rng.randint(1, 9), vocab)
        score = score_tree(kv, committed, tree, max_pending=max_pending)
        assert_rows_match(model, committed, tree, score.logits)
        assert score.pending_len <= max_pending
        # The previous step left committed[:-1] cached, so exactly one token is pending.
        if step > 0 and step != 6:
            assert score.reused == len(committed) - 1 and score.pending_len == 1
        if step == 6:  # after the rewind, reuse stops exactly at the fork
            # 4 uncached: at max_pending 2 all but a tail of (4 - 1) % 2 + 1 = 2 are prefilled first
            assert score.reused == fork
            assert score.pending_len == (2 if max_pending == 2 else 4)
        # Accept the path to a random node (or nothing), then one extra token.
        node = rng.randrange(-1, len(tree))
        accepted = tree.path_to(node) if node >= 0 else []
        commit_path(kv, score.pending_len, accepted)
        committed = committed + [tree.tokens[i] for i in accepted] + [rng.randrange(vocab)]
        assert kv.prefix == committed[:-1]
        assert kv.physical_len() == len(committed) - 1
        if step == 5:  # the caller rewinds (e.g. a resend after divergence): reuse stops at the fork
            fork = len(committed) - 4
            committed = committed[:fork] + [(committed[fork] + 1) % vocab, 2, 3, 1]


def test_many_pending_tokens_and_deep_chain(tiny):
    model = tiny.model
    kv = TreeKVCache(model)
    committed = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    tree = DraftTree.sequence([4, 5, 6, 7, 1, 2])
    score = score_tree(kv, committed, tree)
    assert score.pending_len == len(committed) and score.reused == 0
    assert_rows_match(model, committed, tree, score.logits)
    commit_path(kv, score.pending_len, [0, 1, 2, 3, 4, 5])  # full acceptance is a plain crop
    committed = committed + list(tree.tokens) + [0]
    assert kv.prefix == committed[:-1]
    score = score_tree(kv, committed, DraftTree.star([1, 2, 3]))
    assert score.reused == len(committed) - 1
    assert_rows_match(model, committed, DraftTree.star([1, 2, 3]), score.logits)


@pytest.mark.parametrize("n", [9, 16, 17, 30])
def test_a_new_prompt_costs_its_chunks_and_no_pass_more(tiny, n, monkeypatch):
    """A prompt of n uncached tokens takes ceil(n / chunk) passes in all: all but a tail of
    (n - 1) % chunk + 1 tokens in prefill chunks, the tail with the tree (prefilling all but the
    last token took a pass more whenever n - 1 was not a multiple of the chunk), and the rows are
    the plain paths' rows."""
    import specdec.runtime.kv as kv_module

    chunk = 8
    monkeypatch.setattr(kv_module, "PREFILL_CHUNK", chunk)
    model, vocab = tiny.model, tiny.info.vocab_size
    rng = random.Random(n)
    committed = [rng.randrange(vocab) for _ in range(n)]
    tree = random_tree(rng, 5, vocab)
    passes = []
    hook = model.register_forward_hook(lambda *_: passes.append(1))
    try:
        kv = TreeKVCache(model)
        score = score_tree(kv, committed, tree)
    finally:
        hook.remove()
    assert score.pending_len == (n - 1) % chunk + 1 and score.reused == 0
    assert len(passes) == -(-n // chunk)
    assert_rows_match(model, committed, tree, score.logits)
    commit_path(kv, score.pending_len, [])
    assert kv.prefix == committed


def test_a_wrong_mask_is_detected(tiny):
    """Control: scoring a star's siblings as one causal chain (the classic masking bug) is caught."""
    model = tiny.model
    committed = [3, 1, 4]
    star = DraftTree.star([2, 5, 6])
    kv = TreeKVCache(model)
    logits = kv.extend_chain(committed + list(star.tokens), rows_from=len(committed) - 1)
    with pytest.raises(AssertionError):
        assert_rows_match(model, committed, star, logits)


def test_settled_cache_equals_a_fresh_prefill(tiny):
    """Gathering a non-contiguous accepted path leaves exactly the entries of a plain prefill."""
    model = tiny.model
    committed = [5, 2, 7, 1]
    tree = DraftTree((3, 4, 6, 0, 2), (-1, -1, 1, 1, 3))
    kv = TreeKVCache(model)
    score = score_tree(kv, committed, tree)
    commit_path(kv, score.pending_len, tree.path_to(4))  # nodes 1, 3, 4: not the block's first entries
    expected_tokens = committed + tree.path_tokens(4)
    assert kv.prefix == expected_tokens
    fresh = TreeKVCache(model)
    fresh.extend_chain(expected_tokens)
    fresh.settle(list(range(len(expected_tokens))))
    for mine, ref in zip(kv.cache.layers, fresh.cache.layers, strict=True):
        torch.testing.assert_close(mine.keys, ref.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(mine.values, ref.values, atol=ATOL, rtol=0)


def test_greedy_decoding_through_the_cache_equals_generate(tiny):
    model = tiny.model
    for prompt in ([1, 2, 3], [4], [0, 5, 6, 7, 1]):
        kv = TreeKVCache(model)
        sequence = list(prompt)
        for _ in range(16):
            score = score_tree(kv, sequence, DraftTree.empty())
            commit_path(kv, score.pending_len, [])
            sequence.append(int(torch.argmax(score.logits[0])))
        ids = torch.tensor([prompt])
        # An explicit mask: token 0 is also the pad id, which generate would otherwise mask out.
        reference = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0].tolist()
        assert sequence == reference


def test_truncate_then_extend(tiny):
    model = tiny.model
    kv = TreeKVCache(model)
    kv.extend_chain([1, 2, 3, 4, 5])
    kv.settle([0, 1, 2, 3, 4])
    kv.truncate(2)
    assert kv.prefix == [1, 2] and kv.physical_len() == 2
    logits = kv.extend_chain([6, 7])
    torch.testing.assert_close(logits[-1], plain_last_logits(model, [1, 2, 6, 7]), atol=ATOL, rtol=0)


def test_cache_misuse_raises(tiny):
    kv = TreeKVCache(tiny.model)
    kv.extend([1, 2, 3], [-1, -1, 0])
    with pytest.raises(CacheError):
        kv.settle([1, 2])  # entry 2 hangs off entry 0, not 1
    with pytest.raises(CacheError):
        kv.extend([4], [5])  # parent must exist
    with pytest.raises(CacheError):
        kv.extend_chain([4])  # the block is not empty
    kv.settle([0, 2])
    assert kv.prefix == [1, 3]
    with pytest.raises(CacheError):
        kv.truncate(3)


def test_low_precision_rows_are_float32(tiny_dir):
    from specdec.runtime.loading import load_model

    loaded = load_model(tiny_dir, dtype="bfloat16")
    assert loaded.info.dtype == "bfloat16" and loaded.dtype == torch.bfloat16
    kv = TreeKVCache(loaded.model)
    score = score_tree(kv, [1, 2, 3], DraftTree.sequence([4, 5]))
    assert score.logits.dtype == torch.float32 and score.logits.shape == (3, 8)
    reference = plain_last_logits(loaded.model, [1, 2, 3, 4])
    torch.testing.assert_close(score.logits[1], reference, atol=0.1, rtol=0)
