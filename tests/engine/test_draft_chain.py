"""A sequence draft on a pooled cache runs its k passes chained on the device (no host sync between
them: specdec.engine.drafter._draft_chain_on_device, KVPool.run_chain). It must draft exactly what
the node-by-node fill drafts from the same stream: the same tokens, the same rows, the same cache.
On the CPU the pool runs eagerly, so the comparisons here are bitwise."""

from __future__ import annotations

import pytest
import torch

from specdec.engine import drafter as drafter_module
from specdec.engine.api import DraftRequest, LookaheadRequest
from specdec.engine.drafter import DrafterEngine, _drafts_on_device, _pick
from specdec.randomness import TorchRandomSource, categorical_from_uniform
from specdec.sampling import SamplingParams
from specdec.trees import sequence_parents
from tests.engine.conftest import small_pool
from tests.helpers import device_under_test

SAMPLINGS = {
    "t1": SamplingParams(1.0),
    "t07-topk": SamplingParams(0.7, top_k=3),
    "topp": SamplingParams(1.3, top_p=0.6),
    "greedy": SamplingParams(0.0),
}


def _engines(draft_model, device: str = "cpu") -> tuple[DrafterEngine, DrafterEngine]:
    return (DrafterEngine(draft_model, kv_pool=small_pool(device)),
            DrafterEngine(draft_model, kv_pool=small_pool(device)))


def _request(session: str, base: int, append: list[int], k: int, sampling: SamplingParams, seed: int,
             **extra) -> DraftRequest:
    return DraftRequest(session_id=session, base_len=base, append=append, shape_parents=sequence_parents(k),
                        sampling=sampling, seed=seed, want_distributions=True, **extra)


def _kv(engine: DrafterEngine, session: str):
    with engine.sessions.use(session, 1) as state:
        return state.kv


def _node_by_node(monkeypatch) -> None:
    monkeypatch.setattr(drafter_module, "_drafts_on_device", lambda *args: False)


def _draft_both(chained: DrafterEngine, filled: DrafterEngine, request: DraftRequest, monkeypatch):
    first = chained.draft(request)
    with monkeypatch.context() as patch:
        _node_by_node(patch)
        second = filled.draft(request)
    return first, second


@pytest.mark.device
@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("leaf_rows", [False, True], ids=["rows", "leaf-rows"])
def test_a_chained_draft_equals_the_node_by_node_fill_call_after_call(device_draft_model, sampling, leaf_rows,
                                                                      monkeypatch):
    """On CUDA both replay the same captured (1, 1, kv) graphs; only the picks' float64 sums and
    cumsum run on the GPU in the chain (a different pick needs a uniform within rounding of a bound)."""
    chained, filled = _engines(device_draft_model, device_under_test())
    chains = []
    real_run_chain = type(chained.pool).run_chain
    monkeypatch.setattr(type(chained.pool), "run_chain",
                        lambda pool, *args: (chains.append(args[3]), real_run_chain(pool, *args))[1])
    base, append = 0, [1, 2, 3, 4, 5]
    for call, k in enumerate((4, 1, 6, 3)):
        request = _request("s", base, append, k, sampling, seed=11 + call, include_leaf_rows=leaf_rows)
        a, b = _draft_both(chained, filled, request, monkeypatch)
        assert a.tokens == b.tokens and a.parents == b.parents
        assert torch.equal(a.draft_probs, b.draft_probs)
        assert a.reused_tokens == b.reused_tokens
        # The caches hold the same entries: the next call reuses the same prefix from either.
        kv_a, kv_b = (_kv(engine, "s") for engine in (chained, filled))
        assert kv_a.prefix == kv_b.prefix and kv_a.length == kv_b.length
        for state_a, state_b in zip(kv_a.layer_states(), kv_b.layer_states(), strict=True):
            assert all(torch.equal(x, y) for x, y in zip(state_a, state_b, strict=True))
        # Accept the first half of the draft and a token of our own, as a verify would.
        base += len(append)
        append = a.tokens[: len(a.tokens) // 2] + [call % 8]
    # Every call chained its passes (k - 1 of them, k with leaf rows), none of the fill's did.
    assert chains == [k - 1 + leaf_rows for k in (4, 1, 6, 3)]


def test_the_chain_is_used_only_for_seeded_sequences_on_a_slot_with_room(draft_model):
    engine = DrafterEngine(draft_model, kv_pool=small_pool("cpu"))
    engine.draft(_request("s", 0, [1, 2, 3], 2, SAMPLINGS["t1"], seed=1))
    kv = _kv(engine, "s")
    chain = _request("s", 0, [], 4, SAMPLINGS["t1"], seed=1)
    assert _drafts_on_device(kv, chain.shape_parents, chain)
    tree = _request("s", 0, [], 4, SAMPLINGS["t1"], seed=1)
    tree.shape_parents = [-1, -1, 0, 1]
    assert not _drafts_on_device(kv, tree.shape_parents, tree)
    race = _request("s", 0, [], 4, SAMPLINGS["t1"], seed=1, strategy="race")
    assert not _drafts_on_device(kv, race.shape_parents, race)
    room = kv.pool.config.slot_tokens - kv.length
    fits = _request("s", 0, [], room + 1, SAMPLINGS["t1"], 1)
    assert _drafts_on_device(kv, fits.shape_parents, fits)
    too_long = _request("s", 0, [], room + 2, SAMPLINGS["t1"], 1)
    assert not _drafts_on_device(kv, too_long.shape_parents, too_long)
    eager = DrafterEngine(draft_model)  # no pool: the growing cache keeps the fill
    eager.draft(_request("e", 0, [1, 2, 3], 2, SAMPLINGS["t1"], seed=1))
    assert not _drafts_on_device(_kv(eager, "e"), chain.shape_parents, chain)


def test_beside_another_call_the_fill_is_kept_so_the_passes_batch(draft_model, monkeypatch):
    engine = DrafterEngine(draft_model, kv_pool=small_pool("cpu"))
    chains = []
    real_run_chain = type(engine.pool).run_chain
    monkeypatch.setattr(type(engine.pool), "run_chain",
                        lambda pool, *args: (chains.append(args[3]), real_run_chain(pool, *args))[1])
    engine.draft(_request("s", 0, [1, 2, 3], 4, SAMPLINGS["t1"], seed=1))
    assert chains == [3]
    with engine._batcher.member():  # another call holds its session meanwhile
        engine.draft(_request("s", 3, [4], 4, SAMPLINGS["t1"], seed=2))
        engine.lookahead(_lookahead_request(session_id="l"))
    assert chains == [3]
    engine.draft(_request("s", 4, [5], 4, SAMPLINGS["t1"], seed=3))
    assert chains == [3, 3]


def test_lean_rows_of_a_chained_draft_are_the_fill_s_and_are_read_back_from_the_drafter(draft_model,
                                                                                      monkeypatch):
    chained, filled = _engines(draft_model)
    request = _request("s", 0, [3, 1, 4, 1, 5], 5, SAMPLINGS["t1"], seed=7, lean_rows=True)
    a, b = _draft_both(chained, filled, request, monkeypatch)
    assert a.tokens == b.tokens and a.token_probs == b.token_probs and a.draft_probs is None
    from specdec.engine.api import DraftRowsRequest

    rows_a = chained.draft_rows(DraftRowsRequest("s", a.rows_id, [0, 2, 5]))
    rows_b = filled.draft_rows(DraftRowsRequest("s", b.rows_id, [0, 2, 5]))
    assert rows_a.device.type == "cpu" and torch.equal(rows_a, rows_b)


def test_a_row_without_support_ends_the_chain_where_it_ends_the_fill(draft_model, monkeypatch):
    real_warp = drafter_module._warp
    calls = {"n": 0}

    def dying_warp(logits, params):  # the third row drafted has no support
        calls["n"] += 1
        row = real_warp(logits, params)
        return torch.zeros_like(row) if calls["n"] == 3 else row

    monkeypatch.setattr(drafter_module, "_warp", dying_warp)
    chained, filled = _engines(draft_model)
    request = _request("s", 0, [2, 7, 1, 6], 5, SAMPLINGS["t1"], seed=3)
    a = chained.draft(request)
    calls["n"] = 0
    with monkeypatch.context() as patch:
        _node_by_node(patch)
        b = filled.draft(request)
    assert a.tokens == b.tokens and len(a.tokens) == 2
    assert torch.equal(a.draft_probs, b.draft_probs)
    kv_a, kv_b = _kv(chained, "s"), _kv(filled, "s")
    assert kv_a.prefix == kv_b.prefix and kv_a.length == kv_b.length == 4 + 2


def test_a_broken_draw_is_caught_by_the_same_comparison(draft_model, monkeypatch):
    """Negative control: chains and branches that draw the row's mode instead of the stream's pick
    must differ from the fill."""
    monkeypatch.setattr(drafter_module, "categorical_from_uniform", lambda probs, u: torch.argmax(probs))
    chained, filled = _engines(draft_model)
    differ = branches_differ = 0
    for seed in range(12):
        request = _request(f"s{seed}", 0, [1, 2, 3], 6, SAMPLINGS["t1"], seed=seed)
        a, b = _draft_both(chained, filled, request, monkeypatch)
        differ += a.tokens != b.tokens
        ahead = _lookahead_request(session_id=f"l{seed}", seed=seed)
        one = chained.lookahead(ahead)
        with monkeypatch.context() as patch:
            _node_by_node_branches(patch)
            other = filled.lookahead(ahead)
        branches_differ += [x.draft.tokens for x in one.branches] != [x.draft.tokens for x in other.branches]
        for engine in (chained, filled):  # the pool's slots come back (3 of them)
            engine.release(f"s{seed}")
            engine.release(f"l{seed}")
    assert differ >= 4 and branches_differ >= 4, (differ, branches_differ)


@pytest.mark.parametrize("zeros", ["none", "middle", "tail"])
def test_the_device_pick_is_the_cpu_draw_for_the_same_uniform(zeros, monkeypatch):
    generator = torch.Generator().manual_seed(5)
    for trial in range(200):
        probs = torch.rand(50, generator=generator, dtype=torch.float64)
        if zeros == "middle":
            probs[10:40] = 0
        elif zeros == "tail":
            probs[30:] = 0
        probs /= probs.sum()
        u = torch.rand((), generator=TorchRandomSource.from_seed(trial, "pick").generator,
                       dtype=torch.float64)
        drawn = TorchRandomSource.from_seed(trial, "pick").categorical(probs)
        assert int(categorical_from_uniform(probs, u)) == drawn
    # The edge: the largest uniform below 1 lands at the last entry, past the mass when the tail is 0.
    edge = torch.tensor(1.0 - 2.0 ** -53, dtype=torch.float64)
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: edge)
    drawn = TorchRandomSource.from_seed(0, "x").categorical(probs)
    assert int(categorical_from_uniform(probs, edge)) == drawn
    monkeypatch.undo()
    assert int(_pick(torch.zeros(8), torch.tensor(0.5, dtype=torch.float64))) == -1


# ------------------------------------------------------------------------------------ look-ahead


def _lookahead_request(**kwargs) -> LookaheadRequest:
    values = dict(session_id="s", base_len=0, append=[1, 2, 3, 4, 5, 6, 2], k=3, sampling=SAMPLINGS["t1"],
                  seed=7, want_distributions=True, bonus_guesses=3, rejection_guesses=2)
    values.update(kwargs)
    return LookaheadRequest(**values)


def _node_by_node_branches(monkeypatch) -> None:
    monkeypatch.setattr(drafter_module, "_branches_on_device", lambda *args: False)


@pytest.mark.device
@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_chained_look_ahead_branches_equal_the_node_by_node_ones(device_draft_model, sampling, monkeypatch):
    chained, filled = _engines(device_draft_model, device_under_test())
    calls = []
    real = drafter_module._draft_branches_on_device
    monkeypatch.setattr(drafter_module, "_draft_branches_on_device",
                        lambda *args: (calls.append(1), real(*args))[1])
    base, append = 0, [1, 2, 3, 4, 5, 6, 2]
    for call in range(3):
        request = _lookahead_request(base_len=base, append=append, sampling=sampling, seed=20 + call)
        a = chained.lookahead(request)
        with monkeypatch.context() as patch:
            _node_by_node_branches(patch)
            b = filled.lookahead(request)
        assert len(a.branches) == len(b.branches) == 5
        for one, other in zip(a.branches, b.branches, strict=True):
            assert (one.replaces_last, one.token) == (other.replaces_last, other.token)
            assert one.draft.tokens == other.draft.tokens
            assert torch.equal(one.draft.draft_probs, other.draft.draft_probs)
        kv_a, kv_b = _kv(chained, "s"), _kv(filled, "s")
        assert kv_a.prefix == kv_b.prefix and kv_a.length == kv_b.length
        for state_a, state_b in zip(kv_a.layer_states(), kv_b.layer_states(), strict=True):
            assert all(torch.equal(x, y) for x, y in zip(state_a, state_b, strict=True))
        # The first bonus branch is accepted whole, as a pipelined iteration would take it.
        base += len(append)
        append = [a.branches[0].token, *a.branches[0].draft.tokens]
    assert len(calls) == 3


def test_chained_branches_are_the_fresh_chained_drafts_of_their_hypotheses(draft_model):
    context = [1, 2, 3, 4, 5, 6, 2]
    engine = DrafterEngine(draft_model, kv_pool=small_pool("cpu"))
    result = engine.lookahead(_lookahead_request(append=context))
    fresh = DrafterEngine(draft_model, kv_pool=small_pool("cpu"))
    for i, branch in enumerate(result.branches):
        hypothesis = (context[:-1] if branch.replaces_last else context) + [branch.token]
        reference = fresh.draft(_request(f"ref-{i}", 0, hypothesis, 3, SAMPLINGS["t1"], seed=7))
        assert branch.draft.tokens == reference.tokens
        torch.testing.assert_close(branch.draft.draft_probs, reference.draft_probs, atol=1e-5, rtol=1e-4)


def test_a_branch_without_support_stops_and_leaves_the_others_as_they_were(draft_model, monkeypatch):
    """As in the fill, a branch whose row has no support ends before that row's pick; its later
    entries stay in the passes, masked, so the other branches draft what they draft without it."""
    clean, dying = _engines(draft_model)
    expected = clean.lookahead(_lookahead_request())
    real_warp = drafter_module._warp
    steps = []

    def dying_warp(logits, params):  # the second step's row of the second branch has no support
        rows = real_warp(logits, params)
        if rows.dim() == 2 and rows.shape[0] == 5:
            steps.append(len(steps))
            if len(steps) == 2:
                rows = rows.clone()
                rows[1] = 0
        return rows

    monkeypatch.setattr(drafter_module, "_warp", dying_warp)
    got = dying.lookahead(_lookahead_request())
    assert [len(b.draft.tokens) for b in got.branches] == [3, 1, 3, 3, 3]
    assert got.branches[1].draft.tokens == expected.branches[1].draft.tokens[:1]
    for j in (0, 2, 3, 4):
        assert got.branches[j].draft.tokens == expected.branches[j].draft.tokens
        assert torch.equal(got.branches[j].draft.draft_probs, expected.branches[j].draft.draft_probs)
    assert _kv(dying, "s").prefix == _kv(clean, "s").prefix
