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
"""

from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass, field

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
    ModelInfo,
)
from specdec.engine.sessions import (
    SessionConfig,
    SessionStore,
    advance,
    check_context,
    check_partition,
    check_tokens,
)
from specdec.errors import InvalidRequest, SessionGone
from specdec.races import race
from specdec.randomness import TorchRandomSource
from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import ForwardBatcher
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.kv_pool import KVPool, PoolConfig, engine_pool, new_session_cache, renew_session_cache
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


class DrafterEngine:
    def __init__(
        self, loaded: LoadedModel, sessions: SessionConfig | None = None, clock=time.monotonic,
        batching: BatchConfig | None = None, kv_pool: PoolConfig | None = None,
        prefix_cache: PrefixStore | None = None,
    ) -> None:
        """`kv_pool`: on CUDA, sessions' caches live in one preallocated pool and passes replay
        captured CUDA graphs (specdec.runtime.kv_pool); None, or a model off CUDA: eager caches.
        `prefix_cache`: KV blocks of earlier sessions' prefixes that a new context starts from
        (specdec.runtime.prefix_cache); None: every context is prefilled."""
        self.loaded = loaded
        self.prefix_cache = prefix_cache
        self.batching = batching or BatchConfig()
        # Runs every session's passes; concurrent calls from different sessions share them.
        self._batcher = ForwardBatcher(loaded.model, self.batching, compute=loaded.compute)
        self.pool: KVPool | None = engine_pool(loaded.model, kv_pool, self._batcher.compute)
        self.sessions: SessionStore[DrafterSession] = SessionStore(
            self._new_session, sessions, clock, size_of=lambda session: session.kv.physical_len())
        # Sessions with parked lean rows, read without the session's lock (a look-ahead may hold it);
        # an evicted or released session drops out with its rows.
        self._parked: weakref.WeakValueDictionary[str, DrafterSession] = weakref.WeakValueDictionary()
        self._rows_ids = itertools.count(1)

    def _new_session(self) -> DrafterSession:
        # The batcher runs one pass at a time on the model (no lock needed besides).
        return DrafterSession(kv=self._new_cache())

    def _replace_cache(self, old: TreeKVCache) -> TreeKVCache:
        return renew_session_cache(old, self.loaded.model, self.pool, self._batcher)

    def _new_cache(self) -> TreeKVCache:
        return new_session_cache(self.loaded.model, self.pool, self._batcher, self.prefix_cache)

    def info(self) -> ModelInfo:
        return self.loaded.info

    def release(self, session_id: str) -> bool:
        return self.sessions.release(session_id)

    def stats(self) -> dict[str, int]:
        """Counters for metrics: the session store's (sessions, evictions, …), the batcher's and the
        prefix cache's."""
        stats = {**self.sessions.stats(), **self._batcher.counters()}
        if self.prefix_cache is not None:
            stats.update(self.prefix_cache.stats())
        return stats

    # ------------------------------------------------------------------------------------------
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
        kv = session.kv
        params = request.sampling
        position = len(committed)
        vocab = self.loaded.info.vocab_size
        forward_seconds = 0.0

        start = time.perf_counter()
        reused, pending, restored = prepare(kv, committed)  # may prefill a long run of new tokens
        root_logits = kv.extend_chain(pending)[-1]
        forward_seconds += time.perf_counter() - start

        want: dict[int, int] = {}
        for parent in shape:
            want[parent] = want.get(parent, 0) + 1
        tokens: list[int] = []
        parents: list[int] = []
        shape_of: list[int] = []  # new node → its shape index
        slot: dict[int, int] = {-1: len(pending) - 1}  # new node → block entry in the cache
        rows: dict[int, torch.Tensor] = {-1: _warp(root_logits, params)}
        depth_of: dict[int, int] = {-1: 0}
        old_to_new: dict[int, int] = {-1: -1}
        expanded: dict[int, list[int]] = {}
        source = (
            TorchRandomSource.from_seed(request.seed, "draft", position)
            if request.strategy == "sample"
            else None
        )

        def forward(nodes: list[int]) -> None:
            nonlocal forward_seconds
            first = kv.block_len
            began = time.perf_counter()
            logits = kv.extend([tokens[n] for n in nodes], [slot[parents[n]] for n in nodes])
            forward_seconds += time.perf_counter() - began
            warped = _warp(logits, params)
            for j, node in enumerate(nodes):
                slot[node] = first + j
                rows[node] = warped[j]

        def row_of(node: int) -> torch.Tensor:
            if node not in rows:
                # Everything known that will need a row goes into this pass (its parents are cached).
                forward([n for n in range(len(tokens)) if n not in slot and want.get(shape_of[n], 0) > 0])
            return rows[node]

        # Same loop as specdec.drafting.draft_tree, with rows coming from the cache.
        for shape_index, shape_parent in enumerate(shape):
            new_parent = old_to_new.get(shape_parent)
            if new_parent is None:  # the parent was dropped (support ran out): drop the subtree
                continue
            if shape_parent not in expanded:
                row = row_of(new_parent)
                e = (
                    race(request.seed, position + depth_of[new_parent], vocab)
                    if request.strategy == "race"
                    else None
                )
                expanded[shape_parent] = select_children(row, want[shape_parent], request.strategy, source, e)
            choices = expanded[shape_parent]
            if not choices:
                continue
            node = len(tokens)
            old_to_new[shape_index] = node
            depth_of[node] = depth_of[new_parent] + 1
            tokens.append(choices.pop(0))
            parents.append(new_parent)
            shape_of.append(shape_index)

        if request.include_leaf_rows:
            leaves = [n for n in range(len(tokens)) if n not in slot]
            if leaves:
                forward(leaves)

        draft_probs = _rows_on_cpu({node + 1: row for node, row in rows.items()}, len(tokens) + 1, vocab) \
            if request.want_distributions else None

        # Keep the committed tokens and the first root-to-leaf path that is in the cache.
        first_child: dict[int, int] = {}
        for node, parent in enumerate(parents):
            first_child.setdefault(parent, node)
        path, node = [], -1
        while node in first_child and first_child[node] in slot:
            node = first_child[node]
            path.append(slot[node])
        kv.settle(list(range(len(pending))) + path)

        if request.lean_rows and draft_probs is not None:  # the rows stay here (DraftRows)
            rows_id = next(self._rows_ids)
            session.parked = (rows_id, draft_probs)
            self._parked[request.session_id] = session
            probs = token_probs(DraftTree(tuple(tokens), tuple(parents)), draft_probs)
            return DraftResult(tokens=tokens, parents=parents, forward_seconds=forward_seconds,
                               reused_tokens=reused, token_probs=probs, rows_id=rows_id,
                               cached_tokens=restored)
        return DraftResult(
            tokens=tokens,
            parents=parents,
            draft_probs=draft_probs,
            forward_seconds=forward_seconds,
            reused_tokens=reused,
            cached_tokens=restored,
        )


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
        return probs[list(request.rows)]

    # ------------------------------------------------------------------------------------------
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
        kv = session.kv
        params, strategy, seed = request.sampling, request.strategy, request.seed
        vocab = self.loaded.info.vocab_size
        forward_seconds = 0.0

        def forward(tokens: list[int], parents: list[int], rows_from: int = 0) -> torch.Tensor:
            nonlocal forward_seconds
            began = time.perf_counter()
            logits = kv.extend(tokens, parents, rows_from)
            forward_seconds += time.perf_counter() - began
            return logits

        # Rows after C (bonus guesses) and, when asked, after C[:-1] (rejection guesses): one pass.
        with_previous = request.rejection_guesses > 0
        began = time.perf_counter()
        reused, pending, restored = prepare(kv, context[:-1] if with_previous else context)
        forward_seconds += time.perf_counter() - began
        if with_previous:
            pending = pending + [context[-1]]
        n_pending = len(pending)
        logits = forward(pending, sequence_parents(n_pending), n_pending - (2 if with_previous else 1))
        last = n_pending - 1

        races: dict[int, torch.Tensor] = {}  # by position: bonus branches share theirs

        def race_at(position: int) -> torch.Tensor | None:
            if strategy != "race":
                return None
            if position not in races:
                races[position] = race(seed, position, vocab)
            return races[position]

        def guesses(row_logits: torch.Tensor, m: int, position: int, exclude: int | None) -> list[int]:
            # "sample" ranks by logits: the softmax over the vocabulary is only needed for races.
            warped = _warp(row_logits, params) if strategy == "race" else row_logits
            return guess_tokens(row_logits, warped, m, strategy, race_at(position), exclude)

        # (replaces_last, token, parent block entry, length of the hypothesis context)
        hypotheses = [(False, t, last, len(context) + 1)
                      for t in guesses(logits[-1], request.bonus_guesses, len(context), None)]
        if with_previous:
            replacements = guesses(logits[0], request.rejection_guesses, len(context) - 1, context[-1])
            hypotheses += [(True, t, last - 1, len(context)) for t in replacements]

        drafts: list[list[int]] = [[] for _ in hypotheses]
        rows: list[list[torch.Tensor]] = [[] for _ in hypotheses]
        slots: list[list[int]] = [[] for _ in hypotheses]  # block entries of each branch, guess first
        sources = [TorchRandomSource.from_seed(seed, "draft", length) if strategy == "sample" else None
                   for *_, length in hypotheses]
        active = list(range(len(hypotheses))) if request.k > 0 else []
        step_tokens = [token for _, token, _, _ in hypotheses]
        step_parents = [parent for _, _, parent, _ in hypotheses]
        depth = 0
        while active:
            first = kv.block_len
            step_logits = forward(step_tokens, step_parents)
            still: list[int] = []
            for j, branch in enumerate(active):
                slots[branch].append(first + j)
                row = _warp(step_logits[j], params)
                e = race_at(hypotheses[branch][3] + depth)
                choice = select_children(row, 1, strategy, sources[branch], e)
                if not choice:  # the draft's support ran out: the branch stops short
                    continue
                drafts[branch].append(choice[0])
                rows[branch].append(row)
                if len(drafts[branch]) < request.k:
                    still.append(branch)
            depth += 1
            active = still
            step_tokens = [drafts[b][-1] for b in active]
            step_parents = [slots[b][-1] for b in active]

        # Keep C and the first branch's forwarded entries (the likeliest hypothesis).
        keep = list(range(n_pending))
        if hypotheses and not hypotheses[0][0]:
            keep += slots[0]
        kv.settle(keep)

        branches = []
        for (replaces_last, token, _, _), tokens, branch_rows in zip(hypotheses, drafts, rows, strict=True):
            probs = _rows_on_cpu(dict(enumerate(branch_rows)), len(tokens) + 1, vocab) \
                if request.want_distributions else None
            draft = DraftResult(tokens=tokens, parents=sequence_parents(len(tokens)), draft_probs=probs)
            branches.append(LookaheadBranch(replaces_last=replaces_last, token=token, draft=draft))
        return LookaheadResult(branches=branches, forward_seconds=forward_seconds, reused_tokens=reused,
                               cached_tokens=restored)


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
    if request.strategy not in DRAFT_STRATEGIES:
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
