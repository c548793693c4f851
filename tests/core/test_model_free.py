"""specdec.model_free: prompt lookup and the suffix cache against hand-made cases and a brute-force
reference (the naive O(L) scan of the same rules), incremental indexing against a from-scratch build,
rewinds, eviction, the tree invariants, the bounded work of a propose, and the memory per cached token."""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections.abc import Sequence

import numpy as np
import pytest

from specdec import model_free
from specdec.model_free import (
    DEPTH_OFFSET,
    LOOKUP_OCCURRENCES,
    MAX_MATCH,
    SUFFIX_OCCURRENCES,
    PromptLookup,
    Proposal,
    SuffixCache,
)

# ---- brute-force references ------------------------------------------------------------------------


def reference_lookup(seq: Sequence[int], min_ngram: int, max_ngram: int, max_tokens: int) -> Proposal | None:
    """PromptLookup.propose by a naive scan."""
    seq = list(seq)
    length = len(seq)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        key = seq[length - n :]
        ends = [e for e in range(length - 1, n - 1, -1) if seq[e - n : e] == key][:LOOKUP_OCCURRENCES]
        if ends:
            break
    else:
        return None
    rows = [seq[e : e + max_tokens] for e in ends]
    chain, alive, probs = rows[0], rows, []
    for i, token in enumerate(chain):
        present = [row for row in alive if len(row) > i]
        alive = [row for row in present if row[i] == token]
        probs.append((len(alive) + 1) / (len(present) + 2))
    return Proposal(tuple(chain), tuple(range(-1, len(chain) - 1)), tuple(probs), n, "lookup")


def _match(seq: list[int], end: int, context: list[int]) -> int:
    m = 0
    while m < min(MAX_MATCH, len(context), end) and seq[end - m - 1] == context[len(context) - m - 1]:
        m += 1
    return m


def reference_tree(sources: list[list[int]], context: list[int], sizes: Sequence[int], own: bool,
                   max_depth: int) -> tuple[int, dict[tuple[int, ...], float]] | None:
    """One suffix-cache source by a naive scan: (match_len, {root-to-node path: path prob}) of the
    whole tree (no node budget, no probability floor). `sources` oldest first; own: the request's
    own tokens, whose end is excluded as an occurrence and cuts continuations as unknown."""
    for n in sorted(sizes, reverse=True):
        if n > min(len(context), MAX_MATCH):
            continue
        key = context[len(context) - n :]
        occurrences = [(s, e) for s, seq in enumerate(sources) for e in range(n, len(seq) + 1)
                       if seq[e - n : e] == key and not (own and e == len(seq))]
        occurrences = occurrences[::-1][:SUFFIX_OCCURRENCES]  # most recent first
        if not occurrences:
            continue
        matched = [_match(sources[s], e, context) for s, e in occurrences]
        best = max(matched)
        if best >= n:
            break
    else:
        return None
    depth = min(max_depth, best + DEPTH_OFFSET)
    rows = [sources[s][e : e + depth] for (s, e), m in zip(occurrences, matched, strict=True) if m == best]
    count: dict[tuple[int, ...], int] = {}
    unknown: dict[tuple[int, ...], int] = {}
    for row in rows:
        for d in range(len(row) + 1):
            count[tuple(row[:d])] = count.get(tuple(row[:d]), 0) + 1
        if own and len(row) < depth:
            unknown[tuple(row)] = unknown.get(tuple(row), 0) + 1
    paths: dict[tuple[int, ...], float] = {}
    for prefix in sorted(count, key=len):
        if prefix:
            parent = prefix[:-1]
            prob = count[prefix] / (count[parent] - unknown.get(parent, 0))
            paths[prefix] = (paths[parent] if parent else 1.0) * prob
    return best, paths


def tree_paths(proposal: Proposal) -> dict[tuple[int, ...], float]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(proposal.tokens, proposal.parents, strict=True):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return dict(zip(paths, proposal.path_probs(), strict=True))


def check_tree(proposal: Proposal) -> None:
    """The invariants every proposal keeps (DraftTree's too: siblings carry distinct tokens)."""
    assert len(proposal.tokens) == len(proposal.parents) == len(proposal.probs) == len(proposal) > 0
    siblings: set[tuple[int, int]] = set()
    for i, (token, parent, prob) in enumerate(zip(proposal.tokens, proposal.parents, proposal.probs,
                                                  strict=True)):
        assert -1 <= parent < i
        assert 0.0 < prob <= 1.0
        assert (parent, token) not in siblings
        siblings.add((parent, token))
    path = proposal.path_probs()
    for i, parent in enumerate(proposal.parents):
        assert path[i] <= (path[parent] if parent >= 0 else 1.0)
    assert proposal.expected_accepted() == pytest.approx(sum(path))


# ---- Proposal --------------------------------------------------------------------------------------

TREE = Proposal(
    tokens=(10, 20, 11, 12, 21, 13),
    parents=(-1, -1, 0, 2, 1, 2),
    probs=(0.8, 0.2, 0.5, 1.0, 0.9, 0.25),
    match_len=3,
    source="suffix",
)


def test_proposal_path_probs_expected_and_depth() -> None:
    assert TREE.path_probs() == pytest.approx([0.8, 0.2, 0.4, 0.4, 0.18, 0.1])
    assert TREE.expected_accepted() == pytest.approx(2.08)
    assert TREE.depth() == 4 - 1  # 10 -> 11 -> 12
    assert len(TREE) == 6
    check_tree(TREE)


def test_proposal_rejects_bad_trees() -> None:
    with pytest.raises(ValueError):
        Proposal((1, 2), (-1, 1), (0.5, 0.5), 1, "suffix")  # a node its own parent
    with pytest.raises(ValueError):
        Proposal((1,), (-1,), (0.0,), 1, "suffix")
    with pytest.raises(ValueError):
        Proposal((1,), (-1,), (1.5,), 1, "suffix")
    with pytest.raises(ValueError):
        Proposal((1, 2), (-1,), (0.5, 0.5), 1, "suffix")


def test_truncated_keeps_the_best_nodes_closed_under_parents() -> None:
    top3 = TREE.truncated(3)
    assert top3 is not None
    check_tree(top3)
    # path probs 0.8 (10), 0.4 (10 11), 0.4 (10 11 12): the tie goes to the lower index, a parent first
    assert tree_paths(top3) == pytest.approx({(10,): 0.8, (10, 11): 0.4, (10, 11, 12): 0.4})
    floor = TREE.truncated(10, min_path_prob=0.19)
    assert floor is not None
    assert set(tree_paths(floor)) == {(10,), (20,), (10, 11), (10, 11, 12)}
    assert TREE.truncated(10) == TREE
    assert TREE.truncated(0) is None
    assert TREE.truncated(5, min_path_prob=0.9) is None
    for max_nodes in range(1, 8):
        for floor_prob in (0.0, 0.1, 0.3, 0.5):
            cut = TREE.truncated(max_nodes, floor_prob)
            if cut is None:
                continue
            check_tree(cut)
            assert len(cut) <= max_nodes
            assert min(cut.path_probs()) >= floor_prob
            assert set(tree_paths(cut)) <= set(tree_paths(TREE))


def test_chain_is_the_greedy_path() -> None:
    chain = TREE.chain()
    assert chain.tokens == (10, 11, 12)  # 10 (0.8 > 0.2), then 11, then 12 (1.0 > 0.25 for 13 under 11)
    assert chain.parents == (-1, 0, 1)
    assert chain.probs == (0.8, 0.5, 1.0)
    assert (chain.match_len, chain.source) == (3, "suffix")
    assert chain.depth() == len(chain)
    assert chain.chain() == chain


# ---- hashing ---------------------------------------------------------------------------------------


def test_numpy_and_python_ngram_hashes_agree() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 200_000, 300).astype(np.int32)
    for n in (1, 2, 3, 4, 8, 16):
        vectorised = model_free._hashes(tokens, n, n, len(tokens)).tolist()
        assert vectorised == [model_free._hash(tokens[e - n : e].tolist()) for e in range(n, len(tokens) + 1)]
    tail = tokens.tolist()
    assert model_free._tail_hashes(tail, (1, 2, 4, 8, 16)) == {
        n: model_free._hash(tail[len(tail) - n :]) for n in (1, 2, 4, 8, 16)
    }


def test_ngram_hashes_are_distinct_on_small_alphabets() -> None:
    """Every n-gram of up to 5 tokens over 4 tokens (and of up to 2 over 300): no two share a hash,
    across sizes too; a last token's low bits must reach the hash's kept top bits."""
    grams = [tuple(g) for n in range(1, 6) for g in np.ndindex(*(4,) * n)]
    grams += [(a,) for a in range(300)] + [(a, b) for a in range(300) for b in range(300)]
    grams = list(set(grams))
    assert len({model_free._hash(g) for g in grams}) == len(grams)


# ---- prompt lookup ---------------------------------------------------------------------------------


def lookup(tokens: Sequence[int], **kwargs: int) -> Proposal | None:
    pl = PromptLookup(**kwargs)
    pl.sync(tokens)
    return pl.propose()


def test_lookup_longest_ngram_wins() -> None:
    # ... 7 8 9 -> 1 (a 3-gram), and 9 -> 5 more recently (a 1-gram): the 3-gram's continuation wins
    seq = [7, 8, 9, 1, 2, 9, 5, 6, 7, 8, 9]
    proposal = lookup(seq)
    assert proposal is not None
    assert proposal.match_len == 3
    assert proposal.tokens[:3] == (1, 2, 9)
    assert proposal.source == "lookup"


def test_lookup_takes_the_most_recent_occurrence() -> None:
    seq = [1, 2, 3, 1, 2, 4, 0, 1, 2]
    proposal = lookup(seq, max_tokens=3)
    assert proposal is not None
    assert proposal.match_len == 2
    assert proposal.tokens == (4, 0, 1)  # after the second "1 2", not the first
    # two occurrences: at position 0 both are present and disagree -> (1 + 1) / (2 + 2); then one
    assert proposal.probs == pytest.approx((2 / 4, 2 / 3, 2 / 3))
    assert proposal.parents == (-1, 0, 1)


def test_lookup_continuation_stops_at_the_end() -> None:
    seq = [5, 6, 7, 5, 6]
    proposal = lookup(seq, max_tokens=10)
    assert proposal is not None
    assert proposal.tokens == (7, 5, 6)  # the copy runs into the sequence's own end and stops
    assert proposal.match_len == 2


def test_lookup_probability_formula_counts_agreeing_occurrences() -> None:
    # "1" is followed by 2 3 (three times, most recent last) and by 2 4 and by 5 once each
    seq = [1, 2, 4, 1, 5, 1, 2, 3, 1, 2, 3, 1, 2, 3, 9, 1]
    proposal = lookup(seq, max_ngram=1, max_tokens=3)
    assert proposal is not None
    assert proposal.tokens == (2, 3, 9)
    # position 0: all 5 occurrences present, 4 say 2; position 1: the 4, 3 say 3; position 2: the 3,
    # the last one says 9 and the two others 1
    assert proposal.probs == pytest.approx((5 / 7, 4 / 6, 2 / 5))
    assert proposal == reference_lookup(seq, 1, 1, 3)


def test_lookup_min_and_max_ngram_are_respected() -> None:
    seq = [4, 5, 6, 7, 0, 4, 5, 6, 7]
    assert lookup(seq, max_ngram=2).match_len == 2
    assert lookup(seq, max_ngram=8).match_len == 4
    only_unigram = [1, 2, 3, 1]
    assert lookup(only_unigram, min_ngram=1).match_len == 1
    assert lookup(only_unigram, min_ngram=2) is None
    assert lookup([1, 2, 3]) is None
    assert lookup([]) is None
    assert lookup([1]) is None


def test_lookup_max_tokens_argument() -> None:
    pl = PromptLookup(max_tokens=4)
    pl.sync([1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    assert pl.propose().tokens == (3, 4, 5, 6)
    assert pl.propose(2).tokens == (3, 4)
    assert pl.propose(100).tokens == (3, 4, 5, 6, 7, 8, 1, 2)  # beyond the window path
    assert pl.propose(0) is None


@pytest.mark.parametrize("config", [(1, 4, 10), (2, 3, 5), (1, 1, 70), (3, 6, 16)])
def test_lookup_matches_the_reference_incrementally_and_from_scratch(config: tuple[int, int, int]) -> None:
    min_ngram, max_ngram, max_tokens = config
    rng = random.Random(sum(config))
    for _ in range(3):
        vocab = rng.choice([2, 3, 5, 12])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(300, 900))]
        incremental = PromptLookup(min_ngram=min_ngram, max_ngram=max_ngram, max_tokens=max_tokens)
        length = 0
        while length < len(seq):
            length = min(len(seq), length + rng.choice([1, 1, 2, 3, 7, 40, 300]))
            incremental.sync(seq[:length])
            scratch = PromptLookup(min_ngram=min_ngram, max_ngram=max_ngram, max_tokens=max_tokens)
            scratch.sync(seq[:length])
            expected = reference_lookup(seq[:length], min_ngram, max_ngram, max_tokens)
            assert incremental.propose() == expected
            assert scratch.propose() == expected


def test_lookup_rewind_rebuilds() -> None:
    rng = random.Random(5)
    seq = [rng.randrange(4) for _ in range(600)]
    other = seq[:500] + [rng.randrange(4) for _ in range(50)]
    pl = PromptLookup()
    pl.sync(seq)
    for rewound in (seq[:450], seq[:599], other, seq[:10], [], seq):
        pl.sync(rewound)
        assert pl.propose() == reference_lookup(rewound, 1, 4, 10)
    # a change just before the end (the tail the extension check compares)
    changed = seq[:-3] + [(seq[-3] + 1) % 4] + seq[-2:] + [1, 2]
    pl.sync(changed)
    assert pl.propose() == reference_lookup(changed, 1, 4, 10)


def test_a_changed_token_is_a_rewind() -> None:
    pl = PromptLookup()
    cache = SuffixCache()
    pl.sync([1, 2, 3, 4, 5])
    cache.sync("r", [1, 2, 3, 4, 5])
    changed = [1, 2, 3, 4, 9, 1, 2, 3, 4]  # longer, but not an extension
    pl.sync(changed)
    cache.sync("r", changed)
    assert pl.propose().tokens[0] == 9
    assert cache.propose("r", max_nodes=4).tokens[0] == 9


def test_lookup_work_is_bounded_on_a_long_repeat() -> None:
    pl = PromptLookup()
    pl.sync([7] * 50_000)
    pl._examined[0] = 0
    proposal = pl.propose()
    assert proposal is not None and proposal.match_len == 4
    assert proposal.tokens == (7,)  # the most recent earlier occurrence ends one token before the end
    assert proposal.probs == pytest.approx((17 / 18,))
    assert pl._examined[0] <= LOOKUP_OCCURRENCES


def test_lookup_rejects_bad_settings_and_tokens() -> None:
    with pytest.raises(ValueError):
        PromptLookup(min_ngram=0)
    with pytest.raises(ValueError):
        PromptLookup(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError):
        PromptLookup(max_tokens=0)
    with pytest.raises(ValueError):
        PromptLookup().sync([1, -1])


# ---- suffix cache ----------------------------------------------------------------------------------


def test_a_finished_requests_continuation_is_proposed_for_the_same_context() -> None:
    cache = SuffixCache()
    cache.start("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    cache.sync("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    cache.finish("a")
    assert (cache.cached_requests, cache.cached_tokens) == (1, 12)
    cache.start("b", [30, 3, 4, 5])
    proposal = cache.propose("b", max_nodes=16)
    assert proposal is not None
    assert proposal.source == "suffix" and proposal.match_len == 3
    assert proposal.tokens == (6, 7, 8, 9, 10)  # depth match_len + DEPTH_OFFSET
    assert proposal.parents == (-1, 0, 1, 2, 3)
    assert proposal.probs == (1.0,) * 5
    assert cache.propose("b", max_nodes=2).tokens == (6, 7)
    assert cache.propose("b", max_nodes=16, max_depth=1).tokens == (6,)
    # a longer match earns a deeper draft
    cache.sync("b", [30, 3, 4, 5, 6, 7, 8, 9])
    assert cache.propose("b", max_nodes=16).tokens == (10, 11, 12)  # the request ended there


def test_frequency_scoring_of_diverging_requests() -> None:
    cache = SuffixCache()
    for key, tail in (("a", [7, 8]), ("b", [9, 8]), ("c", [7, 8])):
        cache.start(key, [1, 2, 3, 4, 5, 6] + tail)
        cache.finish(key)
    cache.start("new", [1, 2, 3, 4, 5, 6])
    proposal = cache.propose("new", max_nodes=16, min_path_prob=0.0)
    assert proposal is not None and proposal.match_len == 6
    check_tree(proposal)
    assert tree_paths(proposal) == pytest.approx({(7,): 2 / 3, (9,): 1 / 3, (7, 8): 2 / 3, (9, 8): 1 / 3})
    assert (proposal.tokens, proposal.parents) == ((7, 8, 9, 8), (-1, 0, -1, 2))  # best first
    # min_path_prob drops the rare branch; a chain of the likely one is left
    likely = cache.propose("new", max_nodes=16, min_path_prob=0.5)
    assert likely.tokens == (7, 8) and likely.probs == pytest.approx((2 / 3, 1.0))
    assert proposal.chain() == likely


def test_a_cached_request_that_ended_counts_against_continuations() -> None:
    cache = SuffixCache()
    for key, seq in (("a", [1, 2, 3]), ("b", [1, 2, 3, 4])):
        cache.start(key, seq)
        cache.finish(key)
    cache.start("new", [9, 1, 2, 3])
    proposal = cache.propose("new", max_nodes=16, min_path_prob=0.0)
    assert proposal.tokens == (4,) and proposal.probs == pytest.approx((0.5,))


def test_active_requests_are_isolated_until_they_finish() -> None:
    cache = SuffixCache()
    cache.start("a", [1, 2, 3, 4, 5, 6, 1, 2, 3])  # repeats itself: "a" proposes to itself
    own = cache.propose("a", max_nodes=8)
    assert own is not None and own.tokens[0] == 4
    cache.start("b", [50, 1, 2, 3])
    assert cache.propose("b", max_nodes=8) is None  # "a" is active: not visible to "b"
    cache.sync("a", [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5])
    assert cache.propose("b", max_nodes=8) is None
    cache.finish("a")
    assert cache.propose("a", max_nodes=8) is None  # no longer active
    shared = cache.propose("b", max_nodes=8)
    assert shared is not None and shared.tokens[0] == 4


def test_the_better_of_own_and_cached_wins() -> None:
    cache = SuffixCache()
    for key, tail in (("a", 8), ("b", 9)):  # the cache disagrees with itself after 1 2 3
        cache.start(key, [1, 2, 3, tail, 0, 0])
        cache.finish(key)
    cache.start("new", [1, 2, 3, 7, 7, 1, 2, 3])  # its own history is unanimous
    proposal = cache.propose("new", max_nodes=16, min_path_prob=0.0)
    assert proposal.tokens[0] == 7 and proposal.probs[0] == 1.0


def test_eviction_by_requests_and_by_tokens_oldest_first() -> None:
    cache = SuffixCache(max_requests=2)
    for i in range(3):
        cache.start(i, [100 + i, 1, 2, 200 + i])
        cache.finish(i)
    assert cache.cached_requests == 2
    cache.start("q0", [100, 1, 2])
    cache.start("q1", [101, 1, 2])
    # the longest match of "100 1 2" went with request 0; "1 2" alone now leads to 201 and 202 only
    paths = tree_paths(cache.propose("q0", max_nodes=8, min_path_prob=0.0))
    assert (200,) not in paths and set(paths) == {(201,), (202,)}
    assert cache.propose("q1", max_nodes=8, min_path_prob=0.0).tokens == (201,)  # match 3 beats match 2

    cache = SuffixCache(max_tokens=10)
    for i in range(3):
        cache.start(i, [100 + i, 1, 2, 200 + i])
        cache.finish(i)
    assert (cache.cached_requests, cache.cached_tokens) == (2, 8)
    cache.start("q", [1, 2])
    assert set(tree_paths(cache.propose("q", max_nodes=8, min_path_prob=0.0))) == {(201,), (202,)}


def test_an_evicted_request_is_gone_before_any_compaction() -> None:
    """Evicted entries linger in the runs until compaction; a lookup must stop at them, including
    the evicted request's very last n-gram, which ends exactly at the floor."""
    cache = SuffixCache(max_requests=2)
    for key, seq in (("a", [1, 2, 3, 4]), ("b", [3, 4, 7]), ("c", [8, 9])):
        cache.start(key, seq)
        cache.finish(key)
    assert cache._dead == 4 and cache.cached_requests == 2  # not compacted yet
    cache.start("q", [3, 4])
    proposal = cache.propose("q", max_nodes=8, min_path_prob=0.0)
    assert proposal.tokens == (7,) and proposal.probs == (1.0,)  # "a" ended after 3 4: no longer counts


def test_a_request_longer_than_the_cache_keeps_its_last_tokens() -> None:
    cache = SuffixCache(max_tokens=5)
    cache.start("a", [1, 2, 3, 4, 5, 6, 7, 8])
    cache.finish("a")
    assert (cache.cached_requests, cache.cached_tokens) == (1, 5)
    cache.start("q", [2, 3])
    assert cache.propose("q", max_nodes=8) is None  # 1 2 3 were dropped
    cache.start("r", [4, 5])
    assert cache.propose("r", max_nodes=8).tokens == (6, 7, 8)


@pytest.mark.parametrize("settings", [{"max_requests": 0}, {"max_tokens": 0}])
def test_cache_off(settings: dict[str, int]) -> None:
    cache = SuffixCache(**settings)
    cache.start("a", [1, 2, 3, 4])
    cache.finish("a")
    assert (cache.cached_requests, cache.cached_tokens) == (0, 0)
    cache.start("b", [1, 2])
    assert cache.propose("b", max_nodes=8) is None


def test_request_lifecycle_edges() -> None:
    cache = SuffixCache()
    cache.finish("unknown")  # no-op
    assert cache.propose("unknown", max_nodes=8) is None
    cache.sync("x", [1, 2, 1])  # an unknown key starts
    assert cache.propose("x", max_nodes=8).tokens == (2, 1)
    assert cache.propose("x", max_nodes=0) is None
    cache.start("x", [5, 6])  # a re-start replaces
    assert cache.propose("x", max_nodes=8) is None
    cache.start("empty", [])
    assert cache.propose("empty", max_nodes=8) is None
    cache.finish("empty")
    assert cache.cached_requests == 0
    with pytest.raises(ValueError):
        SuffixCache(max_ngram=0)
    with pytest.raises(ValueError):
        SuffixCache(max_requests=-1)


def test_suffix_incremental_sync_equals_a_fresh_start() -> None:
    rng = random.Random(8)
    for vocab in (2, 4, 9):
        seq = [rng.randrange(vocab) for _ in range(1200)]
        cache = SuffixCache()
        length = 0
        while length < len(seq):
            length = min(len(seq), length + rng.choice([1, 3, 8, 50, 300]))
            cache.sync("r", seq[:length])
            fresh = SuffixCache()
            fresh.start("r", seq[:length])
            for budget in (4, 64):
                assert cache.propose("r", max_nodes=budget) == fresh.propose("r", max_nodes=budget)


def test_suffix_rewind_rebuilds() -> None:
    rng = random.Random(11)
    seq = [rng.randrange(3) for _ in range(700)]
    cache = SuffixCache()
    cache.sync("r", seq)
    for rewound in (seq[:650], seq[:300] + [2, 2, 2, 1], seq):
        cache.sync("r", rewound)
        fresh = SuffixCache()
        fresh.start("r", rewound)
        assert cache.propose("r", max_nodes=32) == fresh.propose("r", max_nodes=32)


def _reference_propose(own: list[int], cached: list[list[int]], sizes: Sequence[int], max_depth: int):
    """(source, match_len, paths) the suffix cache should propose with no node budget or floor, or
    None; source None when the two sources tie too closely for the choice to be pinned down."""
    mine = reference_tree([own], own, sizes, True, max_depth)
    theirs = reference_tree(cached, own, sizes, False, max_depth) if cached else None
    if mine is None and theirs is None:
        return None
    if theirs is None:
        return ("own", *mine)
    if mine is None:
        return ("cached", *theirs)
    a, b = sum(mine[1].values()), sum(theirs[1].values())
    if abs(a - b) < 1e-9:
        return (None, mine, theirs)
    return ("own", *mine) if a > b else ("cached", *theirs)


def _assert_like_reference(proposal: Proposal | None, expected) -> None:
    if expected is None:
        assert proposal is None
        return
    assert proposal is not None
    check_tree(proposal)
    if expected[0] is None:
        candidates = [expected[1], expected[2]]
    else:
        candidates = [expected[1:]]
    assert any(proposal.match_len == m and tree_paths(proposal) == pytest.approx(paths)
               for m, paths in candidates), (proposal, expected)


@pytest.mark.parametrize("seed", range(4))
def test_suffix_cache_matches_the_reference_through_syncs_finishes_and_evictions(seed: int) -> None:
    """Random requests from a small vocabulary: the index (dicts, runs, merges, lazy eviction,
    compaction, stream reallocation) must give exactly the naive scan's trees, every step."""
    rng = random.Random(seed)
    max_ngram = rng.choice([4, 8, 5])
    max_requests, max_tokens = rng.choice([(3, 10_000), (100, 700), (6, 400)])
    sizes = model_free._anchor_sizes(max_ngram)
    cache = SuffixCache(max_requests=max_requests, max_tokens=max_tokens, max_ngram=max_ngram,
                        max_depth=rng.choice([4, 16]))
    live: list[list[int]] = []  # the reference's cache, oldest first
    vocab = rng.choice([3, 4, 6])
    for request in range(14):
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(20, 420))]
        length = rng.randrange(1, 12)
        cache.start(request, seq[:length])
        while length < len(seq):
            length = min(len(seq), length + rng.choice([1, 2, 5, 30, 260]))
            cache.sync(request, seq[:length])
            expected = _reference_propose(seq[:length], live, sizes, cache.max_depth)
            _assert_like_reference(cache.propose(request, max_nodes=10_000, min_path_prob=0.0), expected)
        cache.finish(request)
        live.append(seq[-max_tokens:])
        while len(live) > max_requests or sum(map(len, live)) > max_tokens:
            live.pop(0)
        assert (cache.cached_requests, cache.cached_tokens) == (len(live), sum(map(len, live)))


def test_hash_collisions_are_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every n-gram of a size hashed alike, the runs return all of that size: the token
    comparison alone must keep the proposals exact (sequences short enough that no lookup hits its
    bound). (Sizes keep distinct hashes: a cross-size collision, ~2**-62 a lookup, could count one
    position twice.)"""
    monkeypatch.setattr(model_free, "_hashes", lambda tokens, n, lo, hi: np.full(hi - lo + 1, n, np.int64))
    monkeypatch.setattr(model_free, "_tail_hashes", lambda tail, sizes: {n: n for n in sizes})
    monkeypatch.setattr(model_free, "FLUSH_POSITIONS", 4)
    rng = random.Random(2)
    cache = SuffixCache(max_tokens=50)
    live: list[list[int]] = []
    for request in range(6):
        seq = [rng.randrange(3) for _ in range(rng.randrange(10, 30))]
        for length in [*range(1, len(seq), 3), len(seq)]:
            cache.sync(request, seq[:length])
            expected = _reference_propose(seq[:length], live, (1, 2, 4, 8), 16)
            _assert_like_reference(cache.propose(request, max_nodes=10_000, min_path_prob=0.0), expected)
        cache.finish(request)
        live.append(seq)
        while sum(map(len, live)) > 50:
            live.pop(0)


def test_suffix_tree_invariants_under_budgets() -> None:
    rng = random.Random(3)
    mixed = SuffixCache(max_ngram=8)  # own tokens and the cache compete
    for i in range(30):
        mixed.start(i, [rng.randrange(5) for _ in range(200)])
        mixed.finish(i)
    own_only = SuffixCache(max_ngram=8)
    tokens = [rng.randrange(5) for _ in range(100)]
    for _ in range(60):
        tokens.append(rng.randrange(5))
        mixed.sync("q", tokens)
        own_only.sync("q", tokens)
        full = own_only.propose("q", max_nodes=10_000, min_path_prob=0.0)
        assert full is not None
        full_paths = tree_paths(full)
        for max_nodes, floor, max_depth in ((1, 0.0, None), (5, 0.1, None), (16, 0.3, 3), (64, 0.05, 16)):
            for cache in (mixed, own_only):
                proposal = cache.propose("q", max_nodes=max_nodes, min_path_prob=floor, max_depth=max_depth)
                if proposal is None:
                    continue
                check_tree(proposal)
                assert len(proposal) <= max_nodes
                assert min(proposal.path_probs()) >= floor
                assert proposal.depth() <= min(max_depth or 16, proposal.match_len + DEPTH_OFFSET)
                if cache is own_only and max_depth is None:
                    # best-first: the budgeted tree is the best part of the whole one
                    paths = tree_paths(proposal)
                    assert paths == pytest.approx({path: full_paths[path] for path in paths})
                    dropped = [p for path, p in full_paths.items() if path not in paths and p >= floor]
                    if dropped:
                        assert len(proposal) == max_nodes and max(dropped) <= min(paths.values()) + 1e-12


def test_suffix_propose_work_is_bounded_on_a_long_repeat() -> None:
    cache = SuffixCache()
    cache.start("old", [7] * 20_000)
    cache.finish("old")
    cache.start("r", [7] * 50_000)
    cache._examined[0] = 0
    proposal = cache.propose("r", max_nodes=16)
    assert proposal is not None
    assert proposal.tokens == (7,) * 16 and proposal.probs == (1.0,) * 16
    assert proposal.match_len == MAX_MATCH
    assert cache._examined[0] <= 2 * SUFFIX_OCCURRENCES
    cache.start("s", [8] + [7] * 30)
    cache._examined[0] = 0
    assert cache.propose("s", max_nodes=16).tokens == (7,) * 16
    assert cache._examined[0] <= 2 * SUFFIX_OCCURRENCES


def test_memory_per_cached_token_is_small() -> None:
    rng = np.random.default_rng(0)
    requests = [rng.integers(0, 32_000, 1024).tolist() for _ in range(96)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = SuffixCache(max_tokens=65_536)
        for i, tokens in enumerate(requests):
            cache.start(i, tokens)
            cache.finish(i)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.cached_tokens == 64 * 1024
    assert used / cache.cached_tokens < 200  # ~104 measured (the target: 300)
