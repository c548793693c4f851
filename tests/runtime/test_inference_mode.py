"""Passes run in torch's inference mode, and a cache they grew still works from any thread.

The batcher runs every pass in inference mode (cheaper dispatch per op, specdec.runtime.batching),
so a session's buffers and its logits are inference tensors. torch refuses an in-place update of
one outside inference mode; the cache's own writes (a settle's move, an append) therefore enter it
themselves. Without that, a verifier settling a side branch from its worker thread would fail.
"""

from __future__ import annotations

import threading

import torch

from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import ForwardBatcher
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.scoring import commit_path, score_tree
from specdec.trees import DraftTree

JOIN_S = 60


def test_a_pass_runs_in_inference_mode_and_its_rows_match_a_plain_pass(tiny):
    model, vocab = tiny.model, tiny.info.vocab_size
    batched = TreeKVCache(model, runner=ForwardBatcher(model, BatchConfig(window_ms=0)))
    plain = TreeKVCache(model)
    committed = [(7 * i + 3) % vocab for i in range(9)]
    tree = DraftTree((1 % vocab, 2 % vocab, 3 % vocab), (-1, 0, -1))
    with torch.no_grad():  # what a caller outside the engine holds: not inference mode
        ours = score_tree(batched, committed, tree)
        theirs = score_tree(plain, committed, tree)
    assert ours.logits.is_inference()
    assert not theirs.logits.is_inference()
    assert torch.equal(ours.logits, theirs.logits)  # the mode changes dispatch, not arithmetic
    assert batched.layer_states()[0][0].is_inference()


def test_a_cache_grown_in_inference_mode_settles_a_side_branch_from_another_thread(tiny):
    """The failing case before the cache's writes entered inference mode: a settle that moves a
    side branch's entries into place (an in-place copy) on a thread not in inference mode."""
    model, vocab = tiny.model, tiny.info.vocab_size
    batched = TreeKVCache(model, runner=ForwardBatcher(model, BatchConfig(window_ms=0)))
    plain = TreeKVCache(model)
    committed = [(5 * i + 1) % vocab for i in range(6)]
    tree = DraftTree((4 % vocab, 5 % vocab, 6 % vocab), (-1, -1, 1))  # node 2 hangs off node 1
    errors: list[BaseException] = []

    def settle_side_branch() -> None:
        try:
            with torch.no_grad():
                for kv in (batched, plain):
                    score = score_tree(kv, committed, tree)
                    commit_path(kv, score.pending_len, [1, 2])  # not the block's first entries: a move
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    worker = threading.Thread(target=settle_side_branch)
    worker.start()
    worker.join(JOIN_S)
    assert not worker.is_alive()
    assert errors == []
    assert batched.prefix == plain.prefix == committed + [5 % vocab, 6 % vocab]
    for (keys, values), (plain_keys, plain_values) in zip(batched.layer_states(), plain.layer_states(),
                                                          strict=True):
        assert torch.equal(keys, plain_keys) and torch.equal(values, plain_values)
    with torch.no_grad():  # and the next pass over the settled cache agrees too
        nxt = DraftTree((7 % vocab,), (-1,))
        assert torch.equal(score_tree(batched, batched.prefix, nxt).logits,
                           score_tree(plain, plain.prefix, nxt).logits)
