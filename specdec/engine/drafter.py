"""The drafter engine: a draft model, per-session caches, and the drafting strategies.

`draft` fills the requested tree shape with tokens. Children are chosen with
`specdec.drafting.select_children` in exactly the node order of the reference
`specdec.drafting.draft_tree`, from the same random stream, so the engine's drafts are the
reference's drafts; only the forward passes are batched. Rows are computed lazily: when a
node's row is needed, every node whose token is already known and whose row will be needed is
forwarded in the same pass, which is one pass per tree level (one per token for a sequence,
i.e. plain autoregressive drafting on the cache).

Afterwards the cache keeps the committed tokens plus the tree's first root-to-leaf path (the
most likely one to be accepted), so the next call, whose committed tokens extend by the
accepted drafts, reuses those entries by longest common prefix.

`lookahead` serves pipelined speculation: in one call it computes the rows at the end of the
block under verification, picks the guessed continuations, forwards them together, and drafts
a sequence after each, every branch with the random stream a fresh `draft` from that context
would use (seed, "draft", context length).

What a strategy changes (where draws come from: a seeded stream or ERSD's races) is one entry of
`STRATEGIES`, read once per call; the drafting code itself never branches on the strategy's name.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from specdec.drafting import guess_tokens, select_children
from specdec.engine.api import (
    DRAFT_STRATEGIES,
    MAX_LOOKAHEAD_GUESSES,
    MAX_LOOKAHEAD_K,
    MAX_TREE_NODES,
    DraftRequest,
    DraftResult,
    DraftRowsRequest,
    LookaheadBranch,
    LookaheadRequest,
    LookaheadResult,
)
from specdec.engine.core import EngineCore
from specdec.engine.sessions import (
    SessionConfig,
    advance,
    check_context,
    check_partition,
    check_tokens,
)
from specdec.errors import InvalidRequest, SessionGone
from specdec.races import race
from specdec.randomness import TorchRandomSource, categorical_from_uniform
from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.kv_pool import PoolConfig, PooledTreeKVCache
from specdec.runtime.loading import LoadedModel
from specdec.runtime.prefix_cache import PrefixStore
from specdec.runtime.scoring import prepare
from specdec.sampling import SamplingParams, warp_logits
from specdec.trees import DraftTree, max_depth, sequence_parents
from specdec.verification.lean import token_probs


@dataclass
class DrafterSession:
    kv: TreeKVCache
    committed: list[int] = field(default_factory=list)
    # The rows of the session's last lean draft (rows id, [n + 1, V] on the CPU): DraftRows reads them.
    parked: tuple[int, torch.Tensor] | None = None


class DrafterEngine(EngineCore[DrafterSession]):
    def __init__(
        self, loaded: LoadedModel, sessions: SessionConfig | None = None, clock=time.monotonic,
        batching: BatchConfig | None = None, kv_pool: PoolConfig | None = None,
        prefix_cache: PrefixStore | None = None,
    ) -> None:
        """`kv_pool`: on CUDA, sessions' caches live in one preallocated pool and passes replay
        captured CUDA graphs (specdec.runtime.kv_pool); None, or a model off CUDA: eager caches.
        `prefix_cache`: KV blocks of earlier sessions' prefixes that a new context starts from
        (specdec.runtime.prefix_cache); None: every context is prefilled."""
        super().__init__(loaded, lambda kv: DrafterSession(kv=kv), sessions=sessions, clock=clock,
                         batching=batching, kv_pool=kv_pool, prefix_cache=prefix_cache)
        # Sessions with parked lean rows, read without the session's lock (a look-ahead may hold it);
        # an evicted or released session drops out with its rows.
        self._parked: weakref.WeakValueDictionary[str, DrafterSession] = weakref.WeakValueDictionary()
        self._rows_ids = itertools.count(1)

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, request: DraftRequest) -> DraftResult:
        shape = _check_request(request)
        vocab = self.loaded.info.vocab_size
        depth = max_depth(shape)
        # Before any work on the call (the session's lock, reading `append`): appended tokens that
        # alone cannot fit the context window are refused by their count.
        check_context(len(request.append) + depth, self.loaded.info.max_context)
        with self.sessions.use(request.session_id, request.base_len) as session, self._batcher.member():
            committed = advance(session.committed, request.session_id, request.base_len, request.append)
            check_tokens("append", request.append, vocab)
            check_context(len(committed) + depth, self.loaded.info.max_context)
            session.committed = committed
            session.kv.set_partition(request.cache_partition)
            try:
                return self._draft(session, committed, shape, request)
            except BaseException:
                session.kv = self._replace_cache(session.kv)  # never keep a cache in an unknown state
                raise

    def _draft(
        self, session: DrafterSession, committed: list[int], shape: list[int], request: DraftRequest
    ) -> DraftResult:
        """Fill the tree (rows a level per pass), keep its first path in the cache, answer."""
        cache = _TimedCache(session.kv)
        reused, pending, restored = cache.prepare(committed)  # may prefill a long run of new tokens
        root_logits = cache.extend_chain(pending)[-1]
        if _drafts_on_device(session.kv, shape, request):
            tokens, rows = _draft_chain_on_device(cache, root_logits, len(shape), request, len(committed))
            # Lean rows stay on the device until DraftRows asks for some.
            probs = (rows if request.lean_rows else rows.to("cpu")) if request.want_distributions else None
            result = DraftResult(tokens=tokens, parents=sequence_parents(len(tokens)), draft_probs=probs,
                                 forward_seconds=cache.seconds, reused_tokens=reused, cached_tokens=restored)
            if request.lean_rows and probs is not None:
                self._park(session, request.session_id, result)
            return result
        tree = _TreeFill(cache, request.sampling, shape, root_slot=len(pending) - 1, root_logits=root_logits)
        tree.fill(STRATEGIES[request.strategy], request.seed, len(committed), self.loaded.info.vocab_size)
        if request.include_leaf_rows:
            tree.forward_leaves()
        draft_probs = tree.rows_on_cpu(self.loaded.info.vocab_size) if request.want_distributions else None
        # Keep the committed tokens and the first root-to-leaf path that is in the cache.
        cache.kv.settle(list(range(len(pending))) + tree.first_path())
        result = DraftResult(tokens=tree.tokens, parents=tree.parents, draft_probs=draft_probs,
                             forward_seconds=cache.seconds, reused_tokens=reused, cached_tokens=restored)
        if request.lean_rows and draft_probs is not None:
            self._park(session, request.session_id, result)
        return result

    def _park(self, session: DrafterSession, session_id: str, result: DraftResult) -> None:
        """Lean rows: the rows stay here (DraftRows reads them) and the result carries each node's q
        of its token and the rows' id instead."""
        assert result.draft_probs is not None
        rows_id = next(self._rows_ids)
        session.parked = (rows_id, result.draft_probs)
        self._parked[session_id] = session
        tree = DraftTree(tuple(result.tokens), tuple(result.parents))
        result.token_probs = token_probs(tree, result.draft_probs)
        result.rows_id, result.draft_probs = rows_id, None

    @torch.inference_mode()
    def draft_rows(self, request: DraftRowsRequest) -> torch.Tensor:
        """Rows [len(rows), V] of a session's last lean draft (SessionGone once they are gone)."""
        session = self._parked.get(request.session_id)
        parked = session.parked if session is not None else None
        if parked is None or parked[0] != request.rows_id:
            raise SessionGone(f"session {request.session_id!r} holds no draft rows {request.rows_id} "
                              "(released, evicted, or drafted again since)")
        probs = parked[1]
        outside = [r for r in request.rows if not 0 <= r < probs.shape[0]]
        if outside:
            raise InvalidRequest(f"rows {outside[:8]} lie outside the draft's rows [0, {probs.shape[0]})")
        return probs[list(request.rows)].to("cpu")  # rows drafted on a GPU stay there until asked for

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def lookahead(self, request: LookaheadRequest) -> LookaheadResult:
        _check_lookahead(request)
        info = self.loaded.info
        check_context(len(request.append) + 1 + request.k, info.max_context)  # before any work, as in draft
        with self.sessions.use(request.session_id, request.base_len) as session, self._batcher.member():
            context = advance(session.committed, request.session_id, request.base_len, request.append)
            check_tokens("append", request.append, info.vocab_size)
            if request.rejection_guesses and len(context) < 2:
                raise InvalidRequest("rejection_guesses: the context must hold the prefix and the block")
            check_context(len(context) + 1 + request.k, info.max_context)
            session.committed = context
            session.kv.set_partition(request.cache_partition)
            try:
                return self._lookahead(session, context, request)
            except BaseException:
                session.kv = self._replace_cache(session.kv)  # never keep a cache in an unknown state
                raise

    def _lookahead(
        self, session: DrafterSession, context: list[int], request: LookaheadRequest
    ) -> LookaheadResult:
        """Rows at the end of C, the guessed hypotheses, a sequence drafted after each; the cache
        keeps C and the likeliest bonus branch."""
        cache = _TimedCache(session.kv)
        vocab = self.loaded.info.vocab_size
        races = _Races(STRATEGIES[request.strategy], request.seed, vocab)
        # Rows after C (bonus guesses) and, when asked, after C[:-1] (rejection guesses): one pass.
        with_previous = request.rejection_guesses > 0
        reused, pending, restored = cache.prepare(context[:-1] if with_previous else context)
        if with_previous:
            pending = pending + [context[-1]]
        n_pending = len(pending)
        logits = cache.extend(pending, sequence_parents(n_pending), n_pending - (2 if with_previous else 1))
        hypotheses = _hypotheses(logits, context, request, races, last=n_pending - 1)
        if _branches_on_device(cache.kv, hypotheses, request):
            branches = _draft_branches_on_device(cache, hypotheses, request)
        else:
            branches = _draft_branches(cache, hypotheses, request, races)

        keep = list(range(n_pending))
        if hypotheses and not hypotheses[0].replaces_last:
            keep += branches[0].slots
        cache.kv.settle(keep)
        return LookaheadResult(
            branches=[branch.result(hypothesis, vocab, request.want_distributions)
                      for hypothesis, branch in zip(hypotheses, branches, strict=True)],
            forward_seconds=cache.seconds, reused_tokens=reused, cached_tokens=restored)


# ---------------------------------------------------------------------------------- strategies


@dataclass(frozen=True)
class DraftStrategy:
    """What a drafting strategy changes in this engine: where its draws come from (the choice itself
    is specdec.drafting's, by `name`). "sample" draws from a seeded stream keyed on the context
    length, as the reference does; "race" (ERSD) reads each position's fixed race (specdec.races)
    and ranks look-ahead guesses by arrival under the warped row."""

    name: str
    source: Callable[[int, int], TorchRandomSource | None]  # (seed, context length) → stream, if any
    race: Callable[[int, int, int], torch.Tensor | None]  # (seed, position, vocab) → race, if any
    guesses_on_warped_rows: bool  # look-ahead guesses read the warped row (else the logits alone)


def _seeded_stream(seed: int, length: int) -> TorchRandomSource:
    return TorchRandomSource.from_seed(seed, "draft", length)


STRATEGIES: dict[str, DraftStrategy] = {
    "sample": DraftStrategy("sample", source=_seeded_stream, race=lambda seed, position, vocab: None,
                            guesses_on_warped_rows=False),
    "race": DraftStrategy("race", source=lambda seed, length: None, race=race, guesses_on_warped_rows=True),
}
assert tuple(STRATEGIES) == DRAFT_STRATEGIES, "the engine's table and the declared names must agree"


class _Races:
    """A strategy's races by position, each drawn once per call (bonus branches share theirs)."""

    def __init__(self, strategy: DraftStrategy, seed: int, vocab: int) -> None:
        self.strategy, self.seed, self.vocab = strategy, seed, vocab
        self._by_position: dict[int, torch.Tensor | None] = {}

    def at(self, position: int) -> torch.Tensor | None:
        if position not in self._by_position:
            self._by_position[position] = self.strategy.race(self.seed, position, self.vocab)
        return self._by_position[position]


# ---------------------------------------------------------------------------------- passes


class _TimedCache:
    """A session's cache for one call, adding up the time of the forward passes run on it."""

    def __init__(self, kv: TreeKVCache) -> None:
        self.kv = kv
        self.seconds = 0.0

    def prepare(self, committed: list[int]) -> tuple[int, list[int], int]:
        began = time.perf_counter()
        try:
            return prepare(self.kv, committed)
        finally:
            self.seconds += time.perf_counter() - began

    def extend(self, tokens: list[int], parents: list[int], rows_from: int = 0) -> torch.Tensor:
        began = time.perf_counter()
        try:
            return self.kv.extend(tokens, parents, rows_from)
        finally:
            self.seconds += time.perf_counter() - began

    def extend_chain(self, tokens: list[int]) -> torch.Tensor:
        began = time.perf_counter()
        try:
            return self.kv.extend_chain(tokens)
        finally:
            self.seconds += time.perf_counter() - began


# ---------------------------------------------------------------------------------- draft trees


class _TreeFill:
    """One draft tree as it is filled, in exactly specdec.drafting.draft_tree's node order, with rows
    from the cache. Rows are computed lazily: when a node's row is needed, every node whose token is
    known and whose row will be needed goes into the same pass (one pass per tree level)."""

    def __init__(self, cache: _TimedCache, params: SamplingParams, shape: list[int], root_slot: int,
                 root_logits: torch.Tensor) -> None:
        self.cache, self.params, self.shape = cache, params, shape
        self.want: dict[int, int] = {}  # shape node → children it asks for
        for parent in shape:
            self.want[parent] = self.want.get(parent, 0) + 1
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.shape_of: list[int] = []  # new node → its shape index
        self.slot: dict[int, int] = {-1: root_slot}  # new node → block entry in the cache
        self.rows: dict[int, torch.Tensor] = {-1: _warp(root_logits, params)}

    def fill(self, strategy: DraftStrategy, seed: int, position: int, vocab: int) -> None:
        """The reference's loop: each shape node's children chosen once, from its parent's row; a
        node whose parent was dropped (the support ran out) is dropped with its subtree."""
        source = strategy.source(seed, position)
        depth_of: dict[int, int] = {-1: 0}
        old_to_new: dict[int, int] = {-1: -1}
        expanded: dict[int, list[int]] = {}
        for shape_index, shape_parent in enumerate(self.shape):
            new_parent = old_to_new.get(shape_parent)
            if new_parent is None:
                continue
            if shape_parent not in expanded:
                e = strategy.race(seed, position + depth_of[new_parent], vocab)
                expanded[shape_parent] = select_children(self.row_of(new_parent), self.want[shape_parent],
                                                         strategy.name, source, e)
            choices = expanded[shape_parent]
            if not choices:
                continue
            node = len(self.tokens)
            old_to_new[shape_index] = node
            depth_of[node] = depth_of[new_parent] + 1
            self.tokens.append(choices.pop(0))
            self.parents.append(new_parent)
            self.shape_of.append(shape_index)

    def row_of(self, node: int) -> torch.Tensor:
        if node not in self.rows:
            # Everything known that will need a row goes into this pass (its parents are cached).
            self.forward([n for n in range(len(self.tokens))
                          if n not in self.slot and self.want.get(self.shape_of[n], 0) > 0])
        return self.rows[node]

    def forward(self, nodes: list[int]) -> None:
        first = self.cache.kv.block_len
        parents = [self.slot[self.parents[n]] for n in nodes]
        logits = self.cache.extend([self.tokens[n] for n in nodes], parents)
        warped = _warp(logits, self.params)
        for j, node in enumerate(nodes):
            self.slot[node] = first + j
            self.rows[node] = warped[j]

    def forward_leaves(self) -> None:
        """The rows after the nodes not forwarded yet (RD's rows after the leaves)."""
        leaves = [n for n in range(len(self.tokens)) if n not in self.slot]
        if leaves:
            self.forward(leaves)

    def rows_on_cpu(self, vocab: int) -> torch.Tensor:
        """[n + 1, V] in the specdec.verification layout (row 0 the root's), zero where not computed."""
        return _rows_on_cpu({node + 1: row for node, row in self.rows.items()}, len(self.tokens) + 1, vocab)

    def first_path(self) -> list[int]:
        """Cache entries of the first root-to-leaf path, as far as it was forwarded."""
        first_child: dict[int, int] = {}
        for node, parent in enumerate(self.parents):
            first_child.setdefault(parent, node)
        path, node = [], -1
        while node in first_child and first_child[node] in self.slot:
            node = first_child[node]
            path.append(self.slot[node])
        return path


# ---------------------------------------------------------------------------------- chains on the device


def _chains_alone(kv: TreeKVCache) -> bool:
    """A pooled session whose engine serves no other call right now. A chain runs its k passes alone,
    so beside other sessions the node-by-node fill is kept: its passes batch with theirs (k passes
    for all of them, where chains would take k passes each)."""
    runner = kv.runner
    return (isinstance(kv, PooledTreeKVCache) and kv.pooled
            and (runner is None or getattr(runner, "sole_member", True)))


def _drafts_on_device(kv: TreeKVCache, shape: list[int], request: DraftRequest) -> bool:
    """Whether this draft runs as k chained passes on the pool with no host sync between them
    (_draft_chain_on_device): a sequence drafted from a seeded stream by a session that holds a
    pool slot with room, while no other session drafts (_chains_alone). Trees, races (ERSD draws its
    races on the CPU) and eager caches keep the node-by-node fill."""
    if not _chains_alone(kv) or request.strategy != "sample":
        return False
    passes = len(shape) - 1 + int(request.include_leaf_rows)
    return (len(shape) >= 1 and shape == sequence_parents(len(shape))
            and kv.length + passes <= kv.pool.config.slot_tokens)


def _draft_chain_on_device(cache: _TimedCache, root_logits: torch.Tensor, k: int, request: DraftRequest,
                           position: int) -> tuple[list[int], torch.Tensor]:
    """A sequence of k tokens after the root row, its passes chained on the device.

    The same draws as the node-by-node fill: token i is the inverse-CDF pick of the i-th uniform of
    the request's stream (seed, "draft", context length) in row i, normalised in float64 as
    specdec.drafting.select_children does; each pick is fed to the next pass on the device
    (KVPool.run_chain) and the host reads the k tokens once, at the end. A row with no support ends
    the sequence there, as it does in the reference. Returns the tokens and the rows [n + 1, V] on
    the device (specdec.verification's layout; the row after the last token only with leaf rows).
    """
    kv = cache.kv
    assert isinstance(kv, PooledTreeKVCache) and kv.slot is not None
    source = STRATEGIES["sample"].source(request.seed, position)
    assert source is not None
    uniforms = torch.rand(k, generator=source.generator, dtype=torch.float64)  # = k draws in turn
    passes = k - 1 + int(request.include_leaf_rows)
    rows: list[torch.Tensor] = []
    picks: list[torch.Tensor] = []

    def sample(logits: torch.Tensor) -> torch.Tensor:
        rows.append(_warp(logits, request.sampling))
        if len(picks) < k:
            picks.append(_pick(rows[-1], uniforms[len(picks)]))
        return picks[-1].clamp(min=0)  # a dead row's -1 still feeds a valid (unused) token

    def run() -> None:
        nonlocal uniforms
        uniforms = uniforms.to(root_logits.device)  # one copy, before the passes (none during them)
        with torch.no_grad():
            first = sample(root_logits)
            kv.pool.run_chain(kv.slot, kv.length, first, passes, lambda _, logits: sample(logits))

    began = time.perf_counter()
    kv.alone(run)
    tokens = [int(t) for t in torch.stack(picks).tolist()]  # the one wait for the device
    if -1 in tokens:  # the support ran out: the sequence stops before that row's pick
        tokens = tokens[: tokens.index(-1)]
    forwarded = min(len(tokens), passes)
    start = kv.block_len
    if forwarded:  # record the entries the chain wrote (the ones after a dead row are dropped)
        kv.apply(kv.plan(tokens[:forwarded], [start - 1, *range(start, start + forwarded - 1)]))
    kv.settle([*range(start), *range(start, start + forwarded)])
    count = len(tokens) + 1
    out = torch.zeros((count, rows[0].shape[-1]), dtype=torch.float32, device=rows[0].device)
    out[: min(count, len(rows))] = torch.stack(rows[:count])
    cache.seconds += time.perf_counter() - began
    return tokens, out


def _pick(row: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """select_children's one draw from `row` for the uniform `u`, on the row's device: -1 when the row
    has no support."""
    remaining = row.to(torch.float64)
    total = remaining.sum()
    token = categorical_from_uniform(remaining / total, u)
    return torch.where(total > 0, token, -1)


# ---------------------------------------------------------------------------------- look-ahead


class _Hypothesis(NamedTuple):
    replaces_last: bool  # C[:-1] + [token] (True) or C + [token]
    token: int
    parent: int  # block entry the guess follows
    length: int  # length of the hypothesis context


@dataclass
class _Branch:
    """A sequence drafted after one hypothesis: its tokens, their rows, its block entries (guess first)."""

    tokens: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)

    def result(self, hypothesis: _Hypothesis, vocab: int, want_distributions: bool) -> LookaheadBranch:
        probs = _rows_on_cpu(dict(enumerate(self.rows)), len(self.tokens) + 1, vocab) \
            if want_distributions else None
        draft = DraftResult(tokens=self.tokens, parents=sequence_parents(len(self.tokens)), draft_probs=probs)
        return LookaheadBranch(replaces_last=hypothesis.replaces_last, token=hypothesis.token, draft=draft)


def _hypotheses(
    logits: torch.Tensor, context: list[int], request: LookaheadRequest, races: _Races, last: int
) -> list[_Hypothesis]:
    """Bonus guesses after C (logits[-1]), then, when asked, replacements of C[-1] (logits[0])."""
    strategy, params = races.strategy, request.sampling

    def guesses(row_logits: torch.Tensor, m: int, position: int, exclude: int | None) -> list[int]:
        # "sample" ranks by logits: the softmax over the vocabulary is only needed for races.
        warped = _warp(row_logits, params) if strategy.guesses_on_warped_rows else row_logits
        return guess_tokens(row_logits, warped, m, strategy.name, races.at(position), exclude)

    hypotheses = [_Hypothesis(False, t, last, len(context) + 1)
                  for t in guesses(logits[-1], request.bonus_guesses, len(context), None)]
    if request.rejection_guesses > 0:
        replacements = guesses(logits[0], request.rejection_guesses, len(context) - 1, context[-1])
        hypotheses += [_Hypothesis(True, t, last - 1, len(context)) for t in replacements]
    return hypotheses


def _draft_branches(
    cache: _TimedCache, hypotheses: list[_Hypothesis], request: LookaheadRequest, races: _Races
) -> list[_Branch]:
    """Draft up to k tokens after every hypothesis, all branches' next tokens in one pass a step, each
    branch with the stream a fresh draft from its context would use."""
    strategy, params = races.strategy, request.sampling
    branches = [_Branch() for _ in hypotheses]
    sources = [strategy.source(request.seed, h.length) for h in hypotheses]
    active = list(range(len(hypotheses))) if request.k > 0 else []
    step_tokens = [h.token for h in hypotheses]
    step_parents = [h.parent for h in hypotheses]
    depth = 0
    while active:
        first = cache.kv.block_len
        step_logits = cache.extend(step_tokens, step_parents)
        still: list[int] = []
        for j, index in enumerate(active):
            branch = branches[index]
            branch.slots.append(first + j)
            row = _warp(step_logits[j], params)
            e = races.at(hypotheses[index].length + depth)
            choice = select_children(row, 1, strategy.name, sources[index], e)
            if not choice:  # the draft's support ran out: the branch stops short
                continue
            branch.tokens.append(choice[0])
            branch.rows.append(row)
            if len(branch.tokens) < request.k:
                still.append(index)
        depth += 1
        active = still
        step_tokens = [branches[b].tokens[-1] for b in active]
        step_parents = [branches[b].slots[-1] for b in active]
    return branches


def _branches_on_device(kv: TreeKVCache, hypotheses: list[_Hypothesis], request: LookaheadRequest) -> bool:
    """Whether the look-ahead's branches run their k passes chained on the device
    (_draft_branches_on_device): seeded streams, a pool slot with room for every branch's k entries."""
    if not _chains_alone(kv) or request.strategy != "sample":
        return False
    return bool(hypotheses) and request.k > 0 and \
        kv.length + len(hypotheses) * request.k <= kv.pool.config.slot_tokens


def _draft_branches_on_device(
    cache: _TimedCache, hypotheses: list[_Hypothesis], request: LookaheadRequest
) -> list[_Branch]:
    """_draft_branches' draws with its passes chained on the device: every step passes each branch's
    last token (the hypotheses first) and picks its next one from the branch's own stream on the GPU
    (_pick, as _draft_chain_on_device does), and the host reads the picks once, at the end.

    The steps are planned on the host as the node-by-node fill plans them (the tokens of steps after
    the first are written into the block's bookkeeping once read). A branch whose row has no support
    stops there, as in the fill; its later entries stay in the block, masked from every other branch,
    and are dropped when the cache settles.
    """
    kv = cache.kv
    assert isinstance(kv, PooledTreeKVCache)
    strategy, params, k, width = STRATEGIES["sample"], request.sampling, request.k, len(hypotheses)
    streams = [strategy.source(request.seed, h.length) for h in hypotheses]
    uniforms = torch.stack([torch.rand(k, generator=s.generator, dtype=torch.float64)  # type: ignore[union-attr]
                            for s in streams])
    firsts: list[int] = []  # each step's first block entry
    rows: list[torch.Tensor] = []  # each step's warped rows [width, V]
    picks: list[torch.Tensor] = []  # each step's picks [width] (-1: no support)

    def run() -> None:
        device_uniforms = uniforms.to(kv.pool.device)
        tokens, parents, fed = [h.token for h in hypotheses], [h.parent for h in hypotheses], None
        with torch.no_grad():
            for depth in range(k):
                firsts.append(kv.block_len)
                plan = kv.plan(tokens, parents)
                row = kv.row(plan)
                row.device_tokens = fed
                logits = kv.pool.run([row])[0]
                kv.apply(plan)
                rows.append(_warp(logits, params))
                picks.append(torch.stack([_pick(rows[-1][j], device_uniforms[j, depth])
                                          for j in range(width)]))
                fed = picks[-1].clamp(min=0)
                parents = list(range(firsts[-1], firsts[-1] + width))
                tokens = [0] * width  # placeholders: the picks are read after the last step

    began = time.perf_counter()
    kv.alone(run)
    picked = torch.stack(picks, dim=1).tolist()  # [width, k]: the one wait for the device
    for depth in range(1, k):  # the block's bookkeeping gets the tokens the passes were fed
        for j in range(width):
            kv.block_tokens[firsts[depth] + j] = max(0, int(picked[j][depth - 1]))
    branches = []
    for j in range(width):
        tokens = [int(t) for t in picked[j]]
        alive = tokens.index(-1) if -1 in tokens else k
        branches.append(_Branch(tokens=tokens[:alive], rows=[rows[d][j] for d in range(alive)],
                                slots=[firsts[d] + j for d in range(min(alive + 1, k))]))
    cache.seconds += time.perf_counter() - began
    return branches


def _rows_on_cpu(rows: dict[int, torch.Tensor], count: int, vocab: int) -> torch.Tensor:
    """[count, V] float32 on the CPU: rows[i] at i, zeros elsewhere (from a GPU: one copy to the host)."""
    out = torch.zeros((count, vocab), dtype=torch.float32)
    if rows and next(iter(rows.values())).device.type != "cpu":
        indices = sorted(rows)
        out[indices] = torch.stack([rows[i].to(torch.float32) for i in indices]).cpu()
        return out
    for i, row in rows.items():
        out[i] = row
    return out


def _warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return warp_logits(logits.float(), params)


def _check_drafting(request: DraftRequest | LookaheadRequest) -> None:
    """The fields every drafting request has: strategy, sampling parameters, seed."""
    if request.strategy not in STRATEGIES:
        raise InvalidRequest(f"strategy must be one of {DRAFT_STRATEGIES}, got {request.strategy!r}")
    if not isinstance(request.sampling, SamplingParams):
        raise InvalidRequest("sampling must be a SamplingParams")
    if not isinstance(request.seed, int):
        raise InvalidRequest(f"seed must be an integer, got {request.seed!r}")
    check_partition(request.cache_partition)


def _check_request(request: DraftRequest) -> list[int]:
    _check_drafting(request)
    if len(request.shape_parents) > MAX_TREE_NODES:
        raise InvalidRequest(f"shape_parents holds {len(request.shape_parents)} nodes; at most "
                             f"{MAX_TREE_NODES} are allowed (the drafter's cap)")
    shape = [int(p) for p in request.shape_parents]
    for i, parent in enumerate(shape):
        if not -1 <= parent < i:
            raise InvalidRequest(
                f"shape_parents[{i}] = {parent}; parents must precede their children (-1 = root)"
            )
    return shape


def _check_lookahead(request: LookaheadRequest) -> None:
    _check_drafting(request)
    if not isinstance(request.k, int) or not 0 <= request.k <= MAX_LOOKAHEAD_K:
        raise InvalidRequest(f"k must lie in 0..{MAX_LOOKAHEAD_K} (the drafter's cap), got {request.k!r}")
    for name in ("bonus_guesses", "rejection_guesses"):
        value = getattr(request, name)
        if not isinstance(value, int) or not 0 <= value <= MAX_LOOKAHEAD_GUESSES:
            raise InvalidRequest(f"{name} must lie in 0..{MAX_LOOKAHEAD_GUESSES} (the drafter's cap), "
                                 f"got {value!r}")
    if request.bonus_guesses + request.rejection_guesses == 0:
        raise InvalidRequest("bonus_guesses + rejection_guesses must be at least 1")
