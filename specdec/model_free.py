"""Model-free draft proposers: prompt lookup and a suffix cache (no draft model, no torch, no I/O).

Both propose the tokens that followed earlier occurrences of the context's last tokens: prompt
lookup in the request's own tokens (like HF `generate(prompt_lookup_num_tokens=...)`), the suffix
cache also in recent finished requests (in the spirit of SuffixDecoding). The orchestrator asks
once per iteration from its single asyncio thread, so a proposal must cost far less than a gRPC
round trip whatever the sequence or cache length; everything below is built for that.

Structures
  token store     a sequence's tokens in a growable int32 numpy buffer (4 bytes a token), padded
                  with -1s so that the 66 tokens before or after any position are one row of a
                  strided window view. The global cache is ONE such stream, every cached request
                  followed by a -1 sentinel, addressed by global positions that only grow (an
                  index entry never needs rewriting): a backward match or a continuation stops at
                  a sentinel, and evicting the oldest requests (FIFO) only moves a floor up.
  n-gram index    for a few n-gram sizes (prompt lookup: every n in [min_ngram, max_ngram]; suffix
                  cache: the "anchor" sizes 1, 2, 4, 8, ... up to max_ngram) every position's
                  n-gram is indexed by a 62-bit polynomial hash, as (hash, end position) pairs in
                  sorted numpy "runs" (16 bytes an entry): a log-structured index. A request's new
                  tokens go into a small dict (exact tuple keys, O(sizes) per token) until 256 are
                  pending, then into a run built by vectorised hashing and one sort; a finished
                  request becomes a run at once. Runs merge (searchsorted + scatter, no sort) while
                  the newer is at least half the older, up to MAX_RUN entries, so N entries
                  sit in O(N / MAX_RUN + log N) runs and no merge pauses the loop for long. Equal
                  hashes are kept by ascending position, so "the most recent occurrences" are the
                  tail of one `searchsorted` range per run, newest run first: a lookup reads at
                  most the occurrences it returns (16 or 64), never a whole occurrence list, and
                  one `searchsorted` per run serves every anchor size at once. A hash hit is only a
                  candidate: each is verified by comparing tokens. (Bounded on purpose: a longer
                  match older than the 64 most recent occurrences of its anchor n-gram is missed.)
  match length    the candidates' match lengths come from one vectorised backward comparison of
                  the window before each with the context's last 64 tokens.
  eviction        lazy: an entry at or below the floor is dead; a lookup stops at the first dead
                  entry (older ones are older still); runs wholly below the floor are dropped at
                  once, and once as many tokens died as live, the runs are filtered and the stream
                  cut (amortised O(1) per evicted token).
  sync            takes the whole committed sequence and indexes only what is new; a sequence that
                  is shorter, or whose last 32 previously seen tokens changed, is a rewind and is
                  rebuilt (comparing the whole prefix would cost O(L) per call). Token ids must be
                  in [0, 2**31).
  Few Python objects live long (numpy arrays, one small dict per active request), so the cache
  adds next to nothing to the garbage collector's full passes over the orchestrator's heap.

Costs (python -m bench.bench_model_free: CPU time of the calling thread, medians over 2000
iterations; a 30k-token context, a 262k-token cache of 1k-token requests with code-like
repetition; measured on a shared, loaded 2-core VM about 2-3x slower at plain Python than a
current server core, so expect a half to a third of these there):
  SuffixCache.propose                        0.2-0.3 ms (p99 0.7-1.0 ms); 50k repeats: 0.17 ms
  PromptLookup.propose                       0.07-0.1 ms (p99 ~0.2 ms)
  sync of 1-4 new tokens                     ~0.03 ms
  start, or finish, of a 30k-token request   ~15 ms (hashing and one sort, vectorised); a finish of
                                             a 1k-token request ~1.7 ms mean, 15-30 ms at most
                                             (the largest merge)
  memory, the cache                          ~82 bytes per cached token (~94 at the peak;
                                             tracemalloc, which sees numpy's buffers): 4 anchors x
                                             16 bytes of index entries, the token, eviction and
                                             growth slack (~104 for a 64k-token cache)
  memory, an active request / prompt lookup  ~72 bytes per token (4 sizes)

Probabilities. A lookup draft is a chain; its per-token estimate is the agreement of up to 16
recent occurrences, Laplace-smoothed: (agree + 1) / (total + 2). A suffix draft is a tree of the
continuations of the occurrences that match the context longest (up to 64, most recent first),
frequency-scored like SuffixDecoding: count(child) / count(parent). An occurrence whose
continuation was cut by the end of the request's own tokens says nothing about what follows and
leaves the counts below that point, while a cached request that ended there counts against every
continuation (it went nowhere). Note that a single occurrence gives probability 1 at every node.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

_B = 0x9E3779B97F4A7C15  # odd multiplier of the n-gram hash, mod 2**64
_MASK = (1 << 64) - 1
_B_NP = np.uint64(_B)
_ONE_NP = np.uint64(1)
_TWO_NP = np.uint64(2)

FLUSH_POSITIONS = 256  # a request's pending positions kept in its dict before they become a sorted run
TAIL_CHECK = 32  # tokens compared by sync to tell an extension from a rewind (a full compare is O(L))
LOOKUP_OCCURRENCES = 16  # occurrences a prompt-lookup draft's agreement is counted over
SUFFIX_OCCURRENCES = 64  # occurrences a suffix draft's tree is built from
MAX_MATCH = 64  # a match is measured back this far at most
DEPTH_OFFSET = 2  # a suffix draft is at most match_len + DEPTH_OFFSET deep (and max_depth)
WIDTH = MAX_MATCH + DEPTH_OFFSET  # the fixed window of a token buffer (a match, a continuation)
MAX_RUN = 1 << 18  # entries of the largest run merges build (bounds one merge's pause)
_SENTINEL = np.array([-1], dtype=np.int32)
_NO_TOKEN = np.array([-3], dtype=np.int32)


@dataclass(frozen=True)
class Proposal:
    """A model-free draft: a tree of tokens (a sequence is a chain) with each node's estimated chance
    of being right once its parent was reached.

    Nodes are in topological order (parents[i] < i, -1: a child of the root, the committed prefix)
    and siblings carry distinct tokens, as specdec.trees.DraftTree requires.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    probs: tuple[float, ...]
    match_len: int
    source: str

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.parents) == len(self.probs):
            raise ValueError("tokens, parents and probs differ in length")
        for i, (parent, prob) in enumerate(zip(self.parents, self.probs, strict=True)):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must precede their children")
            if not 0.0 < prob <= 1.0:
                raise ValueError(f"node {i} has probability {prob}, outside (0, 1]")

    def __len__(self) -> int:
        return len(self.tokens)

    def path_probs(self) -> list[float]:
        """Per node: the estimated chance that it is accepted (the product of probs from the root)."""
        out: list[float] = []
        for parent, prob in zip(self.parents, self.probs, strict=True):
            out.append(prob if parent < 0 else out[parent] * prob)
        return out

    def expected_accepted(self) -> float:
        """Expected accepted tokens if the estimates are right: what a draft is worth, to compare
        sources and to weigh against the verify rows it costs."""
        return sum(self.path_probs())

    def truncated(self, max_nodes: int, min_path_prob: float = 0.0) -> Proposal | None:
        """The best nodes by path prob (at most max_nodes, each >= min_path_prob), as a tree.

        A node's path prob is at most its parent's, so ranking by (path prob desc, index) puts
        every parent before its children: the chosen set is closed under parents. None when
        nothing is left.
        """
        if max_nodes < 1:
            return None
        path = self.path_probs()
        ranked = sorted(range(len(path)), key=lambda i: (-path[i], i))
        keep = sorted(i for i in ranked[:max_nodes] if path[i] >= min_path_prob)
        if not keep:
            return None
        where = {old: new for new, old in enumerate(keep)}
        return Proposal(
            tokens=tuple(self.tokens[i] for i in keep),
            parents=tuple(-1 if self.parents[i] < 0 else where[self.parents[i]] for i in keep),
            probs=tuple(self.probs[i] for i in keep),
            match_len=self.match_len,
            source=self.source,
        )

    def chain(self) -> Proposal:
        """The single most likely root-to-leaf path (greedy by probs; ties: the lower index), for a
        method that verifies sequences only."""
        children: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]  # slot 0: the root
        for i, parent in enumerate(self.parents):
            children[parent + 1].append(i)
        path: list[int] = []
        kids = children[0]
        while kids:
            best = max(kids, key=lambda i: (self.probs[i], -i))
            path.append(best)
            kids = children[best + 1]
        return Proposal(
            tokens=tuple(self.tokens[i] for i in path),
            parents=tuple(range(-1, len(path) - 1)),
            probs=tuple(self.probs[i] for i in path),
            match_len=self.match_len,
            source=self.source,
        )

    def depth(self) -> int:
        """The longest root-to-leaf path length (0 for an empty proposal)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return max(depths, default=0)


# ---- token buffers, hashing and runs ------------------------------------------------------------


class _Buffer:
    """Tokens by position at index `position - base` of an int32 array, with at least WIDTH -1s
    before the first kept position and after the last written one, so that a fixed-width window
    before or after any stored position is a row of one strided view (no bounds checks). -1 never
    equals a token: a backward match stops there, a continuation is cut there."""

    __slots__ = ("data", "base", "end", "_windows")

    def __init__(self) -> None:
        self.data = np.full(4 * WIDTH, -1, dtype=np.int32)
        self.base = -WIDTH
        self.end = 0  # the next position to write
        self._windows: np.ndarray | None = None

    def append(self, tokens: np.ndarray, keep_from: int = 0) -> None:
        """Write `tokens` at the next positions; growing drops positions below `keep_from`."""
        count = len(tokens)
        at = self.end - self.base
        if at + count + WIDTH > len(self.data):
            self.reallocate(keep_from, count)
            at = self.end - self.base
        self.data[at : at + count] = tokens
        self.end += count

    def reallocate(self, keep_from: int, extra: int = 0) -> None:
        """A new array with room for `extra` more tokens, holding positions from `keep_from` on."""
        keep = max(keep_from, self.base + WIDTH)
        live = self.end - keep
        data = np.full(2 * (live + extra) + 3 * WIDTH, -1, dtype=np.int32)
        data[WIDTH : WIDTH + live] = self.data[keep - self.base : self.end - self.base]
        self.data, self.base, self._windows = data, keep - WIDTH, None

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self.data[start - self.base : stop - self.base]

    def windows(self) -> np.ndarray:
        """Row i: the WIDTH tokens from index i (a strided view, rebuilt after a reallocation)."""
        if self._windows is None:
            self._windows = np.lib.stride_tricks.sliding_window_view(self.data, WIDTH)
        return self._windows

    def match_lengths(self, ends: list[int], probe: np.ndarray) -> list[int]:
        """Per end position e: how many of the tokens at e - 1, e - 2, ... equal `probe`'s, in
        order: `probe` is the context's last cap <= MAX_MATCH tokens reversed then a -3 that matches
        nothing (_probe), so the first mismatch always exists. One vectorised comparison."""
        rows = self.windows()[np.array(ends) - (self.base + WIDTH)]  # positions e - WIDTH .. e - 1
        return (rows[:, WIDTH - 1 : WIDTH - len(probe) - 1 : -1] != probe).argmax(axis=1).tolist()

    def continuations(self, ends: list[int], depth: int) -> list[list[int]]:
        """The tokens at e .. e + depth - 1 per end position e (depth <= WIDTH), each cut at its
        first -1."""
        rows = self.windows()[np.array(ends) - self.base][:, :depth].tolist()
        return [row[: row.index(-1)] if -1 in row else row for row in rows]


def _probe(tail: np.ndarray) -> np.ndarray:
    """The context's last tokens, most recent first, then a -3 (see _Buffer.match_lengths)."""
    return np.concatenate((tail[::-1], _NO_TOKEN))


def _finish_hash(h: int, n: int) -> int:
    """Mix the size in, then one more multiply so that every token reaches the kept top 62 bits."""
    return (((h ^ n) * _B) & _MASK) >> 2


def _hash(window: Sequence[int]) -> int:
    """The 62-bit hash of one n-gram, read from its last token back; `_hashes` is the numpy twin."""
    h = 0
    for token in reversed(window):
        h = (h * _B + token + 1) & _MASK
    return _finish_hash(h, len(window))


def _tail_hashes(tail: Sequence[int], sizes: Sequence[int]) -> dict[int, int]:
    """_hash of the last n tokens of `tail` for each n in `sizes` (n <= len(tail)), in one backward
    pass: the hashes of nested suffixes share their prefix of the computation."""
    wanted = set(sizes)
    out: dict[int, int] = {}
    h = 0
    for n, token in enumerate(reversed(tail[len(tail) - max(sizes, default=0) :]), 1):
        h = (h * _B + token + 1) & _MASK
        if n in wanted:
            out[n] = _finish_hash(h, n)
    return out


def _hashes(tokens: np.ndarray, n: int, first_end: int, last_end: int) -> np.ndarray:
    """Hashes of the n-grams tokens[e - n:e] for e in [first_end, last_end] (n <= first_end)."""
    count = last_end - first_end + 1
    shifted = tokens[first_end - n : last_end].astype(np.uint64) + _ONE_NP
    h = np.zeros(count, dtype=np.uint64)
    for j in range(n - 1, -1, -1):  # the last token first, as in _hash; wraps mod 2**64
        h = h * _B_NP + shifted[j : j + count]
    return (((h ^ np.uint64(n)) * _B_NP) >> _TWO_NP).astype(np.int64)


class _Run:
    """One sorted batch of index entries: hashes ascending, equal hashes by ascending end position."""

    __slots__ = ("hashes", "ends", "first", "last")

    def __init__(self, hashes: np.ndarray, ends: np.ndarray) -> None:
        self.hashes = hashes
        self.ends = ends
        self.first = int(ends.min())
        self.last = int(ends.max())

    def __len__(self) -> int:
        return len(self.ends)


def _build_run(tokens: np.ndarray, sizes: Sequence[int], first_end: int, last_end: int,
               offset: int = 0) -> _Run | None:
    """Index the n-grams of `tokens` ending at local positions first_end..last_end (each n-gram
    inside `tokens`), storing end positions shifted by `offset`. Concatenated size by size with
    ascending ends, a stable sort by hash keeps equal hashes by position (equal hashes of two
    sizes would be a 62-bit collision)."""
    hashes: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    for n in sizes:
        lo = max(first_end, n)
        if lo > last_end:
            continue
        hashes.append(_hashes(tokens, n, lo, last_end))
        ends.append(np.arange(lo + offset, last_end + offset + 1, dtype=np.int64))
    if not hashes:
        return None
    h = np.concatenate(hashes)
    order = np.argsort(h, kind="stable")
    return _Run(h[order], np.concatenate(ends)[order])


def _merge(older: _Run, newer: _Run, floor: int) -> _Run:
    """One run of both, merged without a sort: each newer entry lands after the older entries of
    equal or lower hash (every end of `newer` is above every end of `older`, so equal hashes stay
    by position). Entries at or below `floor` are dropped."""
    if older.first <= floor:
        keep = older.ends > floor
        if not keep.any():
            return newer
        older = _Run(older.hashes[keep], older.ends[keep])
    total = len(older) + len(newer)
    slots = older.hashes.searchsorted(newer.hashes, side="right") + np.arange(len(newer))
    from_older = np.ones(total, dtype=bool)
    from_older[slots] = False
    hashes = np.empty(total, dtype=np.int64)
    ends = np.empty(total, dtype=np.int64)
    hashes[slots] = newer.hashes
    ends[slots] = newer.ends
    hashes[from_older] = older.hashes
    ends[from_older] = older.ends
    return _Run(hashes, ends)


def _add_run(runs: list[_Run], run: _Run | None, floor: int = -1) -> None:
    """Append a run and merge while the newest is at least half the size of the one before (up to
    MAX_RUN entries): sizes fall geometrically, so N entries sit in O(N / MAX_RUN + log N) runs, each
    entry is merged O(log N) times, and no single merge stalls the event loop for long."""
    if run is None:
        return
    runs.append(run)
    while (len(runs) >= 2 and len(runs[-2]) <= 2 * len(runs[-1])
           and len(runs[-2]) + len(runs[-1]) <= MAX_RUN):
        newer = runs.pop()
        runs.append(_merge(runs.pop(), newer, floor))


def _anchors(tail: list[int], sizes: Sequence[int]) -> list[tuple[int, tuple[int, ...], int]]:
    """(n, n-gram, hash) of the context's last n tokens per size that fits, longest first."""
    fitting = [n for n in sizes if n <= len(tail)]
    hashes = _tail_hashes(tail, fitting)
    return [(n, tuple(tail[len(tail) - n :]), hashes[n]) for n in reversed(fitting)]


class _Found:
    """The verified occurrences of the longest anchor that has any: their ends and match lengths."""

    __slots__ = ("n", "ends", "matched")

    def __init__(self, n: int, ends: list[int], matched: list[int]) -> None:
        self.n, self.ends, self.matched = n, ends, matched


def _find(buffer: _Buffer, runs: list[_Run], recent: dict[tuple[int, ...], list[int]] | None,
          anchors: list[tuple[int, tuple[int, ...], int]], probe: np.ndarray, want: int, *,
          floor: int = -1, ceiling: int | None = None, counter: list[int] | None = None) -> _Found | None:
    """The up to `want` most recent occurrences of the longest anchor n-gram that occurred (ends
    e < ceiling and > floor; the dict `recent` holds the newest, then the runs newest first), with
    their match lengths against `probe` (_probe); a hash hit matching fewer than n is dropped.

    One `searchsorted` per run finds every anchor's range at once; a range's newest entries are
    its tail, so at most `want + 1` entries are read per run and anchor tried. Reading stops at
    the first end <= floor: everything older is evicted too.
    """
    keys = np.array([h + d for _, _, h in anchors for d in (0, 1)], dtype=np.int64)
    newest_first = runs[::-1]
    ranges = [run.hashes.searchsorted(keys).tolist() for run in newest_first]
    for a, (n, key, _) in enumerate(anchors):
        out: list[int] = []
        if recent:
            for end in reversed(recent.get(key, ())):
                if ceiling is None or end < ceiling:
                    out.append(end)
                    if len(out) >= want:
                        break
        for run, bounds in zip(newest_first, ranges, strict=True):
            lo, hi = bounds[2 * a], bounds[2 * a + 1]
            if lo == hi or len(out) >= want:
                continue
            take = want - len(out) + (ceiling is not None)
            for end in run.ends[max(lo, hi - take) : hi][::-1].tolist():
                if end <= floor:
                    break
                if ceiling is not None and end >= ceiling:
                    continue
                out.append(end)
                if len(out) >= want:
                    break
            else:
                continue
            break
        if counter is not None:
            counter[0] += len(out)
        if not out:
            continue
        matched = buffer.match_lengths(out, probe)
        if max(matched) >= n:
            return _Found(n, out, matched)
    return None


def _check_tokens(fresh: np.ndarray) -> None:
    if len(fresh) and int(fresh.min()) < 0:
        raise ValueError("token ids must be non-negative")


# ---- one request's tokens and their index --------------------------------------------------------


class _Sequence:
    """One request's committed tokens and the index of its n-grams of `sizes`, kept incrementally:
    the dict `recent` holds the n-grams ending after `_indexed` (exact tuple keys), the runs those
    ending at or before it."""

    __slots__ = ("sizes", "buffer", "runs", "recent", "_indexed")

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes
        self._reset()

    def _reset(self) -> None:
        self.buffer = _Buffer()
        self.runs: list[_Run] = []
        self.recent: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0

    @property
    def length(self) -> int:
        return self.buffer.end

    def view(self) -> np.ndarray:
        return self.buffer.tokens(0, self.buffer.end)

    def _extends(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` extends what was synced, judged by the last TAIL_CHECK tokens seen: a
        rewind changes the tail, and comparing the whole prefix would cost O(L) per call."""
        old = self.length
        start = max(0, old - TAIL_CHECK)
        return list(tokens[start:old]) == self.buffer.tokens(start, old).tolist()

    def sync(self, tokens: Sequence[int]) -> None:
        new_len = len(tokens)
        old = self.length
        if new_len < old or (old and not self._extends(tokens)):
            self._reset()
            old = 0
        if new_len == old:
            return
        fresh = np.asarray(tokens[old:new_len], dtype=np.int32)
        _check_tokens(fresh)
        self.buffer.append(fresh)
        if new_len - self._indexed >= FLUSH_POSITIONS:
            _add_run(self.runs, _build_run(self.view(), self.sizes, self._indexed + 1, new_len))
            self.recent.clear()
            self._indexed = new_len
            return
        shift = max(0, old - self.sizes[-1])
        window = self.buffer.tokens(shift, new_len).tolist()
        recent = self.recent
        for end in range(old + 1, new_len + 1):
            for n in self.sizes:
                if n > end:
                    break
                key = tuple(window[end - n - shift : end - shift])
                slot = recent.get(key)
                if slot is None:
                    recent[key] = [end]
                else:
                    slot.append(end)


    def find(self, anchors: list[tuple[int, tuple[int, ...], int]], probe: np.ndarray, want: int,
             counter: list[int] | None = None) -> _Found | None:
        """The longest anchor n-gram ending the sequence that occurred earlier in it (_find)."""
        return _find(self.buffer, self.runs, self.recent, anchors, probe, want, ceiling=self.length,
                     counter=counter)

def _anchor_sizes(max_ngram: int) -> tuple[int, ...]:
    sizes = {max_ngram}
    n = 1
    while n < max_ngram:
        sizes.add(n)
        n *= 2
    return tuple(sorted(sizes))


# ---- prompt lookup -------------------------------------------------------------------------------


class PromptLookup:
    """n-gram lookup over one request's own tokens (prompt + output so far).

    Every n in [min_ngram, max_ngram] is indexed, so the longest matching n and its most recent
    occurrences are exact (not approximated through anchors); a propose reads at most 17
    occurrences per n tried and copies at most max_tokens tokens.
    """

    def __init__(self, *, min_ngram: int = 1, max_ngram: int = 4, max_tokens: int = 10) -> None:
        if not 1 <= min_ngram <= max_ngram <= MAX_MATCH:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram <= {MAX_MATCH}, got {min_ngram}, {max_ngram}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_tokens = max_tokens
        self._seq = _Sequence(tuple(range(min_ngram, max_ngram + 1)))
        self._examined = [0]  # occurrences read by propose calls, all told (tests bound the work with it)

    def sync(self, tokens: Sequence[int]) -> None:
        """Take the request's whole committed sequence; only what is new since the last sync is
        indexed (O(new tokens x sizes)); a sequence that does not extend the last one (a rewind,
        judged by its length and its last 32 tokens) rebuilds the index."""
        self._seq.sync(tokens)

    def propose(self, max_tokens: int | None = None) -> Proposal | None:
        """The continuation after the most recent earlier occurrence of the longest matching n-gram
        ending the sequence (n from max_ngram down to min_ngram), as a chain of up to max_tokens
        tokens stopping at the sequence's end; None when nothing matches.

        Each token's prob is the agreement of up to 16 most recent occurrences of that n-gram that
        still agree with the chain so far: (agree + 1) / (total + 2), total counting those that
        have a token there. match_len = n.
        """
        limit = self.max_tokens if max_tokens is None else max_tokens
        seq = self._seq
        length = seq.length
        if limit < 1 or length < 2:
            return None
        tail = seq.buffer.tokens(max(0, length - self.max_ngram), length)
        sizes = range(self.min_ngram, min(self.max_ngram, length - 1) + 1)
        found = seq.find(_anchors(tail.tolist(), sizes), _probe(tail), LOOKUP_OCCURRENCES, self._examined)
        if found is None:
            return None
        n = found.n
        ends = [end for end, m in zip(found.ends, found.matched, strict=True) if m >= n]
        if limit <= WIDTH:
            rows = [row[:limit] for row in seq.buffer.continuations(ends, limit)]
        else:
            view = seq.view()
            rows = [view[end : end + limit].tolist() for end in ends]
        chain = rows[0]
        alive = rows
        probs: list[float] = []
        for i, token in enumerate(chain):
            present = [row for row in alive if len(row) > i]
            alive = [row for row in present if row[i] == token]
            probs.append((len(alive) + 1) / (len(present) + 2))
        return Proposal(tuple(chain), tuple(range(-1, len(chain) - 1)), tuple(probs), n, "lookup")


# ---- suffix cache --------------------------------------------------------------------------------

_UNKNOWN = -2  # ends a continuation cut by the end of the request's own tokens (not a real end)


def _grow_tree(rows: list[list[int]], max_nodes: int, min_path_prob: float,
               match_len: int) -> Proposal | None:
    """A frequency-scored tree of the continuations `rows`, expanded best-first by path prob.

    The trie counts the rows through each node; a child's prob is its count over its parent's,
    less the rows that stopped at the parent for want of data (a trailing _UNKNOWN): those say
    nothing about what follows, while a row that stopped because its request ended counts against
    every continuation.
    """
    root: list = [0, 0, {}]  # [rows through the node, rows stopped there unknown, children]
    for row, weight in Counter(map(tuple, rows)).items():
        node = root
        node[0] += weight
        unknown = row and row[-1] == _UNKNOWN
        for token in row[:-1] if unknown else row:
            child = node[2].get(token)
            if child is None:
                child = node[2][token] = [weight, 0, {}]
            else:
                child[0] += weight
            node = child
        if unknown:
            node[1] += weight
    heap: list = []
    serial = 0

    def push(node: list, index: int, path_prob: float) -> None:
        nonlocal serial
        denominator = node[0] - node[1]
        for token, child in node[2].items():
            prob = child[0] / denominator
            if path_prob * prob >= min_path_prob:
                heapq.heappush(heap, (-path_prob * prob, serial, token, prob, child, index))
                serial += 1

    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    push(root, -1, 1.0)
    while heap and len(tokens) < max_nodes:
        negative, _, token, prob, child, parent = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        probs.append(prob)
        if child[2]:
            push(child, len(tokens) - 1, -negative)
    if not tokens:
        return None
    return Proposal(tuple(tokens), tuple(parents), tuple(probs), match_len, "suffix")


class SuffixCaches:
    """One SuffixCache per partition (a caller identity and cache salt), so a request's drafts never
    copy another tenant's text; at most `max_partitions` are kept, the least recently used one's
    dropped first (its requests' text is then simply not proposed any more)."""

    def __init__(self, max_partitions: int = 16, **limits: int) -> None:
        if max_partitions < 1:
            raise ValueError("max_partitions must be >= 1")
        self.max_partitions = max_partitions
        self.limits = limits
        self._caches: OrderedDict[str, SuffixCache] = OrderedDict()

    def of(self, partition: str) -> SuffixCache:
        cache = self._caches.get(partition)
        if cache is None:
            cache = self._caches[partition] = SuffixCache(**self.limits)
            while len(self._caches) > self.max_partitions:
                self._caches.popitem(last=False)
        self._caches.move_to_end(partition)
        return cache

    def drop(self, partition: str) -> None:
        """Forget one partition's cache (no-op when it has none)."""
        self._caches.pop(partition, None)

    def __len__(self) -> int:
        return len(self._caches)


class SuffixCache:
    """Each active request's own tokens plus a bounded cache of recent finished requests' prompts and
    outputs, shared by all requests of one orchestrator process; proposes frequency-scored trees.

    Active requests are indexed apart (one request's tokens reach another only once it finishes);
    the cache is one sentinel-separated token stream with one log-structured index (module doc).
    """

    def __init__(self, *, max_requests: int = 256, max_tokens: int = 262_144, max_ngram: int = 8,
                 max_depth: int = 16) -> None:
        if max_requests < 0 or max_tokens < 0:
            raise ValueError("max_requests and max_tokens must be >= 0")
        if not 1 <= max_ngram <= MAX_MATCH or max_depth < 1:
            raise ValueError(f"need 1 <= max_ngram <= {MAX_MATCH} and max_depth >= 1")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self.max_depth = max_depth
        self._sizes = _anchor_sizes(max_ngram)
        self._active: dict[Hashable, _Sequence] = {}
        self._stream = _Buffer()  # the cached requests, each followed by a -1 sentinel
        self._runs: list[_Run] = []
        self._cached: deque[tuple[int, int]] = deque()  # (start, end) per cached request, oldest first
        self._cached_tokens = 0
        self._floor = -1  # index entries ending at or below it are evicted
        self._dead = 0  # tokens evicted since the last compaction
        self._examined = [0]  # occurrences read by propose calls, all told (tests bound the work with it)

    # requests ---------------------------------------------------------------------------------
    def start(self, key: Hashable, prompt: Sequence[int]) -> None:
        """An active request (a re-start of an active key replaces it)."""
        seq = _Sequence(self._sizes)
        seq.sync(prompt)
        self._active[key] = seq

    def sync(self, key: Hashable, tokens: Sequence[int]) -> None:
        """The request's whole committed sequence (like PromptLookup.sync); an unknown key starts."""
        seq = self._active.get(key)
        if seq is None:
            self.start(key, tokens)
        else:
            seq.sync(tokens)

    def finish(self, key: Hashable) -> None:
        """Free the request's active state and put its tokens (the last max_tokens of them) into the
        cache, evicting the oldest cached requests while over max_requests or max_tokens. Unknown
        key: no-op; max_requests = 0 or max_tokens = 0: nothing is cached."""
        seq = self._active.pop(key, None)
        if seq is None or seq.length == 0 or self.max_requests == 0 or self.max_tokens == 0:
            return
        tokens = seq.view()[-self.max_tokens :]
        count = len(tokens)
        start = self._stream.end
        self._stream.append(tokens, keep_from=self._floor)
        self._stream.append(_SENTINEL, keep_from=self._floor)
        _add_run(self._runs, _build_run(tokens, self._sizes, 1, count, offset=start), self._floor)
        self._cached.append((start, start + count))
        self._cached_tokens += count
        self._evict()

    @property
    def cached_requests(self) -> int:
        return len(self._cached)

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    # cache upkeep ------------------------------------------------------------------------------
    def _evict(self) -> None:
        while self._cached and (len(self._cached) > self.max_requests
                                or self._cached_tokens > self.max_tokens):
            start, end = self._cached.popleft()
            self._cached_tokens -= end - start
            self._dead += end - start
            self._floor = end  # its sentinel's position; the next request starts after it
        while self._runs and self._runs[0].last <= self._floor:
            self._runs.pop(0)
        if self._dead > self._cached_tokens:
            self._compact()

    def _compact(self) -> None:
        """Drop evicted entries from the runs and the evicted prefix from the stream."""
        floor = self._floor
        runs: list[_Run] = []
        for run in self._runs:
            if run.first <= floor:
                keep = run.ends > floor
                if not keep.any():
                    continue
                run = _Run(run.hashes[keep], run.ends[keep])
            runs.append(run)
        self._runs = runs
        self._stream.reallocate(floor)
        self._dead = 0

    # proposing ---------------------------------------------------------------------------------
    def propose(self, key: Hashable, *, max_nodes: int, max_depth: int | None = None,
                min_path_prob: float = 0.1) -> Proposal | None:
        """The better (by expected_accepted) of a tree from the request's own tokens and one from the
        cache; None when nothing matches (or the key is not active).

        In each source: the longest anchor n-gram ending the context that occurred (up to 64 most
        recent occurrences), each occurrence's match measured back up to 64 tokens; the
        occurrences with the longest match give their continuations to a trie, expanded best-first
        by path prob within max_nodes, min_path_prob and a depth of min(max_depth, match_len + 2):
        a longer match earns a deeper draft.
        """
        seq = self._active.get(key)
        if seq is None or seq.length == 0 or max_nodes < 1:
            return None
        depth = self.max_depth if max_depth is None else max_depth
        if depth < 1:
            return None
        length = seq.length
        tail = seq.buffer.tokens(max(0, length - MAX_MATCH), length)
        anchors = _anchors(tail.tolist(), self._sizes)
        probe = _probe(tail)
        own = self._tree(seq.find(anchors, probe, SUFFIX_OCCURRENCES, self._examined), seq.buffer,
                         True, max_nodes, depth, min_path_prob)
        if not self._runs or (own is not None and own.expected_accepted() >= max_nodes):
            return own  # nothing cached, or nothing could beat a draft all of whose nodes are sure
        found = _find(self._stream, self._runs, None, anchors, probe, SUFFIX_OCCURRENCES, floor=self._floor,
                      counter=self._examined)
        cached = self._tree(found, self._stream, False, max_nodes, depth, min_path_prob)
        if cached is None or (own is not None and own.expected_accepted() >= cached.expected_accepted()):
            return own
        return cached

    @staticmethod
    def _tree(found: _Found | None, buffer: _Buffer, own: bool, max_nodes: int, max_depth: int,
              min_path_prob: float) -> Proposal | None:
        """One source's tree from the occurrences with the longest match: in the request's own
        tokens a continuation cut by their end is unknown, in the cache a sentinel ends a request
        for real."""
        if found is None:
            return None
        best = max(found.matched)
        ends = [end for end, m in zip(found.ends, found.matched, strict=True) if m == best]
        depth = min(max_depth, best + DEPTH_OFFSET)
        rows = buffer.continuations(ends, depth)
        if own:
            for row in rows:
                if len(row) < depth:
                    row.append(_UNKNOWN)
        return _grow_tree(rows, max_nodes, min_path_prob, best)
