"""Ragged batched passes (specdec.runtime.ragged): the calls' new entries end to end, no padding.

At int8 a session's rows and cache entries from a ragged pass are bitwise those of a pass of its
own, prefill chunks included; a failed pass leaves every cache as it was; a pass takes at most one
prefill chunk, cut while others decode to a share of their pass; a model whose attention cannot be
wrapped keeps the padded layout.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import random
import threading
import time

import pytest
import torch

from specdec.runtime import batching as batching_module
from specdec.runtime import kv as kv_module
from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import MIN_PREFILL_CHUNK, PASS_SECONDS_WEIGHT, ForwardBatcher, _Job
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.loading import quantize_int8
from specdec.runtime.pass_time import PassTimeModel
from specdec.runtime.ragged import RAGGED_PREFIX, use_ragged_attention
from specdec.runtime.scoring import commit_path, prepare, score_tree, tree_block
from specdec.runtime.tiny import build_tiny_model
from tests.engine.test_batching import in_threads
from tests.runtime.test_scoring import random_tree

VOCAB = 48
JOIN_S = 60


@pytest.fixture(scope="module")
def int8_model():
    torch.set_num_threads(1)
    return quantize_int8(build_tiny_model(vocab_size=VOCAB, seed=7, hidden_size=64, num_layers=2,
                                          max_position_embeddings=512))


def _plan_tree(kv: TreeKVCache, committed, tree):
    _, pending = prepare(kv, committed)[:2]
    return len(pending), kv.plan(pending + list(tree.tokens), tree_block(len(pending), tree),
                                 rows_from=len(pending) - 1)


def _entries(kv: TreeKVCache):
    return [(keys.clone(), values.clone()) for keys, values in kv.layer_states()]


def _same(one, other) -> bool:
    """Whether two caches' entries (as `_entries` gives them) are bitwise equal."""
    return len(one) == len(other) and all(torch.equal(a, b) for pair in zip(one, other, strict=True)
                                          for a, b in zip(*pair, strict=True))


def test_a_ragged_pass_is_bitwise_each_sessions_own_pass_at_int8(int8_model):
    """Four sessions of different cache lengths, trees and a prefill chunk share ragged passes;
    twins of them run every pass alone. Rows and cache entries agree bitwise, step after step."""
    model = int8_model
    batcher = ForwardBatcher(model, BatchConfig(window_ms=0))
    assert batcher.joins_prefill and model.config._attn_implementation.startswith(RAGGED_PREFIX)
    rng = random.Random(11)
    shared = [TreeKVCache(model, runner=batcher) for _ in range(4)]
    alone = [TreeKVCache(model) for _ in range(4)]
    committed = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 40, 1, 17)]
    with torch.inference_mode():
        for step in range(3):
            trees = [random_tree(rng, rng.randrange(0, 6), VOCAB) for _ in shared]
            batch, twins = [], []
            for kv, twin, seq, tree in zip(shared, alone, committed, trees, strict=True):
                pending_len, plan = _plan_tree(kv, seq, tree)
                batch.append(_Job(kv=kv, plan=plan))
                twins.append((twin, _plan_tree(twin, seq, tree), pending_len))
            # A fifth session's prefill chunk rides along (no logits for it).
            chunk_kv, chunk_twin = TreeKVCache(model, runner=batcher), TreeKVCache(model)
            chunk = [rng.randrange(VOCAB) for _ in range(9 + step)]
            batch.append(_Job(kv=chunk_kv, plan=chunk_kv.plan(chunk, list(range(-1, len(chunk) - 1)),
                                                              len(chunk) - 1), prefill=True))
            batcher._execute(batch)
            assert all(job.error is None for job in batch)
            assert batch[-1].logits is None and batch[0].pass_rows == sum(job.positions for job in batch)
            chunk_kv.apply(batch[-1].plan)
            chunk_twin.extend_chain(chunk)
            assert _same(_entries(chunk_kv), _entries(chunk_twin))
            for job, (twin, (_, twin_plan), pending_len), seq, tree in zip(batch, twins, committed, trees,
                                                                          strict=False):
                kv = job.kv
                kv.apply(job.plan)
                expected = twin.forward(twin_plan)
                twin.apply(twin_plan)
                assert torch.equal(job.logits, expected), step
                assert _same(_entries(kv), _entries(twin))
                node = rng.randrange(-1, len(tree))
                path = [] if node < 0 else tree.path_to(node)
                commit_path(kv, pending_len, path)
                commit_path(twin, pending_len, path)
                seq.extend(tree.tokens[n] for n in path)
                seq.append(rng.randrange(VOCAB))


def test_prefill_chunks_join_other_sessions_passes_and_match_a_prefill_alone(int8_model, monkeypatch):
    """One session prefills a long prompt in chunks while others decode: the chunks ride in the
    decoders' passes (at most one a pass), and the prompt's cache is bitwise a prefill of its own."""
    monkeypatch.setattr(kv_module, "PREFILL_CHUNK", 16)
    model = int8_model
    model.specdec_int8_wide_rows = None
    batcher = ForwardBatcher(model, BatchConfig(window_ms=20))
    seen: list[list[bool]] = []
    execute = batcher._execute

    def recording(batch):
        seen.append([job.prefill for job in batch])
        execute(batch)

    batcher._execute = recording
    prompt = [(5 * i + 1) % VOCAB for i in range(100)]
    stop = threading.Event()
    failures: list[BaseException] = []
    start = threading.Barrier(3)

    def decoder(seed: int) -> None:
        rng = random.Random(seed)
        kv = TreeKVCache(model, runner=batcher)
        seq = [rng.randrange(VOCAB) for _ in range(5)]
        try:
            with torch.inference_mode(), batcher.member():
                start.wait(timeout=JOIN_S)
                for _ in range(200):
                    if stop.is_set():
                        break
                    kv.extend_chain(seq[kv.prefix_len:] if kv.prefix_len < len(seq) else seq[-1:])
                    kv.settle(range(kv.block_len))
                    seq.append(rng.randrange(VOCAB))
        except BaseException as exc:  # noqa: BLE001 (reported below)
            failures.append(exc)

    threads = [threading.Thread(target=decoder, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    kv = TreeKVCache(model, runner=batcher)
    try:
        with torch.inference_mode(), batcher.member():
            start.wait(timeout=JOIN_S)
            kv.prefill(prompt)
    finally:
        stop.set()
        for thread in threads:
            thread.join(JOIN_S)
    assert not failures, failures
    with torch.inference_mode():
        own = TreeKVCache(model)
        own.prefill(prompt)
    assert kv.prefix == own.prefix == prompt
    for (k1, v1), (k2, v2) in zip(kv.layer_states(), own.layer_states(), strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    with_chunks = [kinds for kinds in seen if any(kinds)]
    assert len(with_chunks) == 7  # 100 tokens in chunks of 16
    assert all(sum(kinds) == 1 for kinds in with_chunks)
    assert any(len(kinds) > 1 for kinds in with_chunks), seen  # chunks shared passes with decoders


@pytest.fixture(scope="module")
def sdpa_model(tiny_dir):
    from specdec.runtime.loading import load_model

    return load_model(tiny_dir, attn_implementation="sdpa").model


def test_a_failed_ragged_pass_leaves_every_cache_as_it_was(sdpa_model):
    model = sdpa_model
    batcher = ForwardBatcher(model, BatchConfig(window_ms=0))
    assert batcher.joins_prefill
    kvs = [TreeKVCache(model, runner=batcher) for _ in range(2)]
    for kv in kvs:
        kv.extend_chain([1, 2, 3])
        kv.settle(range(3))
    before = [_entries(kv) for kv in kvs]
    broken = kvs[1].cache.layers[1]
    original = broken.update

    def fail(*args, **kwargs):
        raise RuntimeError("a layer failed midway")

    broken.update = fail  # layer 0 of both sessions and layer 1 of session 0 have appended by then
    jobs = [_Job(kv=kv, plan=kv.plan([4, 5], [-1, 0], 1)) for kv in kvs]
    batcher._execute(jobs)
    assert all(isinstance(job.error, RuntimeError) for job in jobs)
    broken.update = original
    for kv, entries in zip(kvs, before, strict=True):
        assert kv.physical_len() == 3
        assert _same(_entries(kv), entries)
        logits = kv.extend_chain([4, 5])
        with torch.no_grad():
            plain = model(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits[0, -1:].float()
        torch.testing.assert_close(logits, plain, atol=1e-4, rtol=0)


def test_a_pass_takes_one_prefill_chunk_and_fills_its_budget_with_the_calls_own_rows(sdpa_model):
    model = sdpa_model
    batcher = ForwardBatcher(model, BatchConfig(max_batch_tokens=12, window_ms=0))
    assert batcher.joins_prefill
    kvs = [TreeKVCache(model, runner=batcher) for _ in range(6)]
    chunks = [_Job(kv=kv, plan=kv.plan([1] * 4, [-1, 0, 1, 2], 3), prefill=True) for kv in kvs[:2]]
    decodes = [_Job(kv=kv, plan=kv.plan([1, 2, 3], [-1, 0, 1], 2)) for kv in kvs[2:]]
    batcher._queue.extend([chunks[0], chunks[1], *decodes])
    first = batcher._take()
    assert first == [chunks[0], decodes[0], decodes[1]]  # 4 + 3 + 3 rows; the second chunk waits
    assert batcher._take() == [chunks[1], decodes[2], decodes[3]]


def test_eager_attention_keeps_the_padded_layout(tiny_dir):
    from specdec.runtime.loading import load_model

    eager = load_model(tiny_dir, attn_implementation="eager").model
    assert not use_ragged_attention(eager)
    assert not ForwardBatcher(eager, BatchConfig()).joins_prefill
    assert not ForwardBatcher(load_model(tiny_dir).model, BatchConfig(layout="padded")).joins_prefill
    with pytest.raises(ValueError, match="layout"):
        BatchConfig(layout="diagonal")


def test_wrapping_changes_no_other_pass(tiny_dir):
    """The wrapped attention runs the model's own function when no ragged pass asks otherwise."""
    from specdec.runtime.loading import load_model

    model = load_model(tiny_dir).model
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert use_ragged_attention(model) and use_ragged_attention(model)  # once, then as it is
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)



def _decoded_once(batcher: ForwardBatcher, model) -> TreeKVCache:
    """A session that has just had a decode pass in `batcher` (it counts as decoding)."""
    kv = TreeKVCache(model, runner=batcher)
    with torch.inference_mode():
        kv.extend_chain([1, 2, 3], rows_from=0)  # every row's logits: a step, no prompt rows
    return kv


def _fitted(batcher: ForwardBatcher, fixed: float, per_row: float) -> None:
    """Give `batcher` a pass-time line of `fixed` s + `per_row` s a row (as if fitted)."""
    batcher._pass_time = PassTimeModel(fixed=fixed, per_row=per_row)


@pytest.mark.parametrize("share, cut", [(1.0, 80), (0.5, 40), (0.1, MIN_PREFILL_CHUNK), (0.0, 256)])
def test_a_chunk_beside_a_decoding_session_adds_its_share_of_a_decode_pass(int8_model, share, cut):
    """A decoder's pass of 0.4 s (0.385 s fixed, 5 ms for each of its 3 rows) and 5 ms a row: at
    share 1 a chunk of 80 rows, at 0.5 of 40, never below MIN_PREFILL_CHUNK; share 0 or nobody else
    decoding: the whole chunk. Before the line is fitted the fixed cost counts as nothing (share ×
    the decoders' 3 rows: at most MIN_PREFILL_CHUNK here), never the whole chunk."""
    batcher = ForwardBatcher(int8_model, BatchConfig(window_ms=0, prefill_chunk_share=share))
    prompt = TreeKVCache(int8_model, runner=batcher)
    assert batcher.prefill_chunk_tokens(prompt, 256) == 256  # nobody decodes yet
    with torch.inference_mode():
        prompt.prefill([1, 2, 3, 4])
    assert batcher.prefill_chunk_tokens(prompt, 256) == 256  # a prompt's prefill makes no one wait
    decoder = _decoded_once(batcher, int8_model)
    assert not batcher._pass_time.fitted and batcher._decode_rows == 3  # widths 4 and 3: too alike
    unfitted = 256 if share == 0 else MIN_PREFILL_CHUNK
    assert batcher.prefill_chunk_tokens(prompt, 256) == unfitted
    _fitted(batcher, 0.385, 0.005)
    assert batcher.prefill_chunk_tokens(prompt, 256) == cut
    assert batcher.prefill_chunk_tokens(prompt, 64) == min(64, cut)
    assert batcher.prefill_chunk_tokens(decoder, 256) == 256  # its own decoding makes no one wait
    _fitted(batcher, 0.385, 0.0)  # rows cost nothing measurable (a GPU's flat pass): whole
    assert batcher.prefill_chunk_tokens(prompt, 256) == 256
    _fitted(batcher, 0.385, 0.005)
    del decoder
    gc.collect()
    assert batcher.prefill_chunk_tokens(prompt, 256) == 256  # released: no one decodes any more


def test_a_prompts_tail_riding_with_a_draft_counts_as_prompt_rows(int8_model):
    """A verify pass that carries a prompt's tail (pending tokens before the last: no logits) has
    only the draft's rows as decode rows: were the tail counted, the decoders' rows would grow with
    every new prompt and the cut beside them with it (chunks of hundreds of rows, multi-second stalls
    for the decoders). Every pass, whatever it carries, goes into the fitted line."""
    batcher = ForwardBatcher(int8_model, BatchConfig(window_ms=0))
    _decoded_once(batcher, int8_model)
    assert batcher._decode_rows == 3 and batcher._pass_time.weight == 1
    committed = [(7 * i + 2) % VOCAB for i in range(40)]
    tree = random_tree(random.Random(5), 3, VOCAB)
    with torch.inference_mode():
        score = score_tree(TreeKVCache(int8_model, runner=batcher), committed, tree)
    assert score.pending_len == 40  # alone: the whole prompt rides with the draft
    # 39 prompt rows; the last pending token's row and the tree's 3 nodes are decode rows
    assert batcher._decode_rows == pytest.approx(3 + PASS_SECONDS_WEIGHT * (4 - 3))
    assert batcher._pass_time.weight > 1 and batcher._pass_time.fitted  # widths 3 and 43


def _beside_a_decoder(model, monkeypatch, share: float):
    """A batcher with 64-token chunks, a session that has just decoded in it (3 rows), a pass with no
    fixed cost (so the cut is MIN_PREFILL_CHUNK at any share up to 5), and the prefill chunks' sizes
    as they are submitted: (batcher, sizes, decoder)."""
    monkeypatch.setattr(kv_module, "PREFILL_CHUNK", 64)
    monkeypatch.setattr(model, "specdec_int8_wide_rows", None, raising=False)
    batcher = ForwardBatcher(model, BatchConfig(window_ms=0, prefill_chunk_share=share))
    seen: list[int] = []
    prefill = batcher.prefill

    def recording(kv, plan):
        seen.append(len(plan.tokens))
        prefill(kv, plan)

    monkeypatch.setattr(batcher, "prefill", recording)
    decoder = _decoded_once(batcher, model)
    _fitted(batcher, 0.0, 1e-3)
    return batcher, seen, decoder


@pytest.mark.parametrize("share, sizes", [(1.0, [16, 16, 16, 16, 6]), (0.0, [64, 6])])
def test_a_prompt_beside_a_decoder_goes_in_cut_chunks_and_gets_the_cache_of_whole_ones(
        int8_model, monkeypatch, share, sizes):
    """With a decoder waiting, a 70-token prompt goes in chunks of MIN_PREFILL_CHUNK (a decode pass
    measured as all but free) instead of 64 (the negative control: share 0); at int8 its cache and
    next row are bitwise those of a prefill of its own in whole chunks."""
    model = int8_model
    batcher, seen, decoder = _beside_a_decoder(model, monkeypatch, share)
    prompt = [(3 * i + 2) % VOCAB for i in range(70)]
    with torch.inference_mode():
        kv = TreeKVCache(model, runner=batcher)
        kv.prefill(prompt)
        own = TreeKVCache(model)
        own.prefill(prompt)
        assert seen == sizes and kv.prefix == own.prefix == prompt
        assert _same(_entries(kv), _entries(own))
        assert torch.equal(kv.extend_chain([5]), own.extend_chain([5]))
    assert decoder.prefix_len == 0  # still alive (and decoding) through the prefill


@pytest.mark.parametrize("share, sizes, tail", [(1.0, [16, 16], 8), (0.0, [], 40)])
def test_a_short_pending_run_beside_a_decoder_is_cut_too(int8_model, monkeypatch, share, sizes, tail):
    """A pending run shorter than a chunk (a chat turn's new tokens, a short prompt) would ride whole
    in the verify pass that a decoding session waits for; beside a decoder the runner's cut applies
    to it as to a long prompt: two prefill chunks of MIN_PREFILL_CHUNK, and the tail (8 tokens) goes
    with the tree. Share 0 (no cut, the negative control): all 40 with the tree. Either way the
    rows are bitwise those of a session alone."""
    model = int8_model
    batcher, seen, decoder = _beside_a_decoder(model, monkeypatch, share)
    committed = [(5 * i + 3) % VOCAB for i in range(40)]
    tree = random_tree(random.Random(3), 4, VOCAB)
    with torch.inference_mode():
        kv = TreeKVCache(model, runner=batcher)
        score = score_tree(kv, committed, tree)
        own = score_tree(TreeKVCache(model), committed, tree)
    assert seen == sizes and score.pending_len == tail and own.pending_len == 40
    assert torch.equal(score.logits, own.logits)
    assert decoder.prefix_len == 0  # still alive (and decoding) through it


def test_the_prefill_chunk_share_is_checked():
    with pytest.raises(ValueError, match="prefill_chunk_share"):
        BatchConfig(prefill_chunk_share=-0.5)
    with pytest.raises(ValueError, match="prefill_chunk_share"):
        BatchConfig(prefill_chunk_share=17)
    assert BatchConfig().prefill_chunk_share == 2.0


def _wait_until(condition, seconds: float = JOIN_S) -> bool:
    """Poll `condition` for at most `seconds`: whether it came true."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _two_prompts(model, batcher: ForwardBatcher, monkeypatch, prompt: list[int],
                 tree=None) -> tuple[list[str], bool, dict[str, TreeKVCache]]:
    """Prompt a starts its prefill (with `tree`: its first verify, score_tree) and its first pass is
    held until prompt b has asked for its turn (or, with no turns, sized its first chunk); then both
    finish. (Events in order: "size X" when a chunk of X is sized, "pass X,Y" when a pass starts;
    whether b was sized while a's pass was held; the caches by name.)"""
    events: list[str] = []
    sizing, execute = batcher.prefill_chunk_tokens, batcher._execute
    held, release = threading.Event(), threading.Event()

    def sized(kv, whole):
        events.append(f"size {kv.name}")
        return sizing(kv, whole)

    def run(batch):
        events.append("pass " + ",".join(job.kv.name for job in batch if job.kv is not None))
        if not held.is_set():
            held.set()
            assert release.wait(JOIN_S)
        execute(batch)

    monkeypatch.setattr(batcher, "prefill_chunk_tokens", sized)
    monkeypatch.setattr(batcher, "_execute", run)
    caches = {name: TreeKVCache(model, runner=batcher) for name in "ab"}
    for name, kv in caches.items():
        kv.name = name

    def prefill(name):
        with torch.inference_mode():
            if tree is None:
                caches[name].prefill(prompt)
            else:
                caches[name].score = score_tree(caches[name], prompt, tree)

    first = threading.Thread(target=prefill, args=("a",))
    first.start()
    assert held.wait(JOIN_S)
    second = threading.Thread(target=prefill, args=("b",))
    second.start()
    assert _wait_until(lambda: len(batcher._prefill_line) == 2 or "size b" in events)
    sized_early = "size b" in events
    release.set()
    first.join(JOIN_S)
    second.join(JOIN_S)
    assert not first.is_alive() and not second.is_alive()
    if tree is None:
        assert caches["a"].prefix == caches["b"].prefix == prompt
    return events, sized_early, caches


@pytest.mark.parametrize("turns", [True, False])
def test_a_prompts_chunk_is_sized_in_its_turn_after_the_chunk_before_it_ran(int8_model, monkeypatch, turns):
    """Two prompts prefill at once. The second's chunk is sized only once the first's has run, so
    its cut sees the decoders of the pass it joins (sized when queued, chunks of prompts that came
    together were all whole). Negative control, the turn taken away: the second is sized while
    the first's pass is still held."""
    batcher = ForwardBatcher(int8_model, BatchConfig(window_ms=0))
    if not turns:
        monkeypatch.setattr(batcher, "prefill_turn", contextlib.nullcontext)
    prompt = [(3 * i + 1) % VOCAB for i in range(20)]
    events, sized_early, _ = _two_prompts(int8_model, batcher, monkeypatch, prompt)
    assert sized_early is not turns
    if turns:
        assert events == ["size a", "pass a", "size b", "pass b"]


@pytest.mark.parametrize("turns", [True, False])
def test_a_short_prompts_run_is_sized_in_its_turn_after_the_pass_before_it(int8_model, monkeypatch, turns):
    """Two 40-token prompts (under a chunk: each would ride whole with its first draft) arrive
    together. In turns, b's run is sized once a's verify pass has run, so a decodes beside it and b
    is cut: two chunks of MIN_PREFILL_CHUNK, then its tail of 8 with the tree, and a's next step
    waits for a chunk, not for a whole prompt. Negative control, no turns: b is sized while a's pass
    is held, sees no decoder and rides whole (40 pending tokens). Either way b's rows are bitwise
    those of a session alone."""
    batcher = ForwardBatcher(int8_model, BatchConfig(window_ms=0))
    if not turns:
        monkeypatch.setattr(batcher, "prefill_turn", lambda pending=None, kv=None: contextlib.nullcontext())
    prompt = [(7 * i + 5) % VOCAB for i in range(40)]
    tree = random_tree(random.Random(9), 3, VOCAB)
    events, sized_early, caches = _two_prompts(int8_model, batcher, monkeypatch, prompt, tree)
    assert sized_early is not turns
    assert events[:3] == ["size a", "pass a", "size b"]  # a's pass starts first either way
    assert caches["a"].score.pending_len == 40
    assert caches["b"].score.pending_len == (8 if turns else 40)
    with torch.inference_mode():
        own = score_tree(TreeKVCache(int8_model), prompt, tree)
    assert torch.equal(caches["b"].score.logits, own.logits)


@pytest.mark.parametrize("pending, decoding, waits", [
    (MIN_PREFILL_CHUNK, False, False),  # a step's few tokens: never in line
    (MIN_PREFILL_CHUNK + 1, False, True),  # a prompt's run with nobody decoding yet (a wave)
    (100, True, False),  # a chat turn's message that the decoders let in whole (cut: 160)
    (200, True, True),  # a run the decoders' cut would shorten: sized in its turn
    (3000, False, False),  # longer than a turn: its prefill takes turns of its own
])
def test_which_runs_wait_for_the_prefill_turn(int8_model, pending, decoding, waits):
    """While another call holds the prefill turn, a call's run of new tokens waits in line only where
    its size depends on when it is sized: a run that a cut could shorten and that the decoders in
    view (a pass of 0.4 s, 5 ms a row: 160 rows at share 2) would not let in whole, or any such run
    while nobody decodes yet. A thread that holds the turn takes it again at once."""
    batcher = ForwardBatcher(int8_model, BatchConfig(window_ms=0))
    decoder = _decoded_once(batcher, int8_model) if decoding else None
    _fitted(batcher, 0.385, 0.005)
    session = TreeKVCache(int8_model, runner=batcher)
    with batcher.prefill_turn(), batcher.prefill_turn(pending=pending, kv=session):
        pass  # held: no wait either way
    taken = threading.Event()

    def other():
        with batcher.prefill_turn(pending=pending, kv=session):
            taken.set()

    with batcher.prefill_turn():
        thread = threading.Thread(target=other)
        thread.start()
        if waits:
            assert _wait_until(lambda: len(batcher._prefill_line) == 2)
            assert not taken.is_set()
        else:
            assert taken.wait(JOIN_S)
    thread.join(JOIN_S)
    assert not thread.is_alive() and taken.is_set() and not batcher._prefill_line
    assert decoder is None or decoder.prefix_len == 0  # alive (decoding) throughout


def test_sessions_with_prompts_of_every_kind_at_once_get_their_own_rows(int8_model, monkeypatch):
    """Six sessions at once, each a prompt (a step's 3 tokens, a short run that takes the turn, runs
    of several chunks within a turn and longer than a turn) and then four steps with draft trees,
    a chat turn's message half way: nothing hangs (every thread joins), the line empties, and every
    row is bitwise what the session gets alone (§14)."""
    monkeypatch.setattr(kv_module, "PREFILL_CHUNK", 32)
    monkeypatch.setattr(int8_model, "specdec_int8_wide_rows", None, raising=False)
    monkeypatch.setattr(batching_module, "PREFILL_TURN_TOKENS", 96)
    batcher = ForwardBatcher(int8_model, BatchConfig(window_ms=5))
    lengths = [3, 20, 40, 90, 150, 200]  # 150 and 200: longer than a turn, their prefill takes turns

    def script(index: int) -> list[tuple[list[int], object]]:
        rng = random.Random(index)
        committed = [rng.randrange(VOCAB) for _ in range(lengths[index])]
        steps = []
        for step in range(5):
            if step == 2:  # a chat turn's new message
                committed = committed + [rng.randrange(VOCAB) for _ in range(24)]
            steps.append((list(committed), random_tree(rng, 1 + step % 4, VOCAB)))
            committed = committed + [rng.randrange(VOCAB)]
        return steps

    def session(kv: TreeKVCache, index: int) -> list[torch.Tensor]:
        rows = []
        with torch.inference_mode():
            for committed, tree in script(index):
                score = score_tree(kv, committed, tree)
                rows.append(score.logits)
                commit_path(kv, score.pending_len, [])
        return rows

    def run(index: int) -> list[torch.Tensor]:
        with batcher.member():
            return session(TreeKVCache(int8_model, runner=batcher), index)

    got = in_threads([functools.partial(run, index) for index in range(len(lengths))])  # joins all
    assert not batcher._prefill_line
    for index in range(len(lengths)):
        alone = session(TreeKVCache(int8_model), index)
        assert all(torch.equal(a, b) for a, b in zip(got[index], alone, strict=True)), index


@pytest.mark.parametrize("turn_tokens, order", [(2048, "aaabbb"), (16, "aabbab")])
def test_prompts_prefill_first_come_first_served_a_turn_at_a_time(int8_model, monkeypatch, turn_tokens,
                                                                  order):
    """Two 24-token prompts in 8-token chunks: the first prompt's chunks all go before the second's
    (its first token comes a whole prefill sooner; one chunk each in turn would give "ababab"), up
    to a turn's tokens: at 16, two chunks and then the other prompt's turn."""
    monkeypatch.setattr(kv_module, "PREFILL_CHUNK", 8)
    monkeypatch.setattr(int8_model, "specdec_int8_wide_rows", None, raising=False)
    monkeypatch.setattr(batching_module, "PREFILL_TURN_TOKENS", turn_tokens)
    batcher = ForwardBatcher(int8_model, BatchConfig(window_ms=0))
    prompt = [(5 * i + 4) % VOCAB for i in range(24)]
    events, sized_early, _ = _two_prompts(int8_model, batcher, monkeypatch, prompt)
    assert not sized_early
    assert "".join(event[-1] for event in events if event.startswith("pass")) == order


def test_a_prompt_waiting_for_its_turn_does_not_hold_a_pass_for_its_window(int8_model):
    """A call waiting for a prefill turn has no plan to bring this pass: a decoder's pass does not
    wait the gather window (1 s here) for it."""
    batcher = ForwardBatcher(int8_model, BatchConfig(window_ms=1000, window_share=0))
    decoder, waiting = (TreeKVCache(int8_model, runner=batcher) for _ in range(2))

    def prefill():
        with batcher.member(), torch.inference_mode():
            waiting.prefill([(5 * i + 2) % VOCAB for i in range(20)])

    with batcher.prefill_turn():
        thread = threading.Thread(target=prefill)
        thread.start()
        assert _wait_until(lambda: len(batcher._prefill_line) == 2)
        began = time.monotonic()
        with batcher.member(), torch.inference_mode():
            decoder.extend_chain([4, 5, 6], rows_from=0)
        took = time.monotonic() - began
    thread.join(JOIN_S)
    assert not thread.is_alive() and waiting.prefix_len == 20
    assert took < 0.5, f"the decoder's pass waited {took:.2f} s for a call waiting in line"
