"""The verifier engine: the target model, per-session caches, scoring and verification.

`verify` scores the committed tokens not yet cached plus the whole draft tree in one forward
pass (specdec.runtime.scoring), warps the target rows with the request's sampling parameters,
runs the verification method next to them (the rows never leave this process), keeps the
accepted path in the cache and commits accepted path + extra token. The extra token is
committed but not cached: it is the first pending token of the next call.

`score` runs the same forward pass early (before the drafter's distributions exist) and parks
its rows; a `verify` for the same committed sequence and tree uses them instead of recomputing.
Both hold the session's lock, so a verify that arrives while its score is still running waits
for it. A score that arrives after its verify (possible over the network) is ignored.

A lean verify (docs/algorithms.md §12) whose rule reaches a draft row it was not given commits
nothing: it parks its forward pass (and warped rows) the same way and answers
`draft_rows_needed`. The retry — the same request plus those rows — reuses them and re-runs the
rule with the same seeded source, keyed on the committed length, so it decides exactly as the
full rows would have.

A verify with `text` set also returns the text of the tokens it emits (specdec.runtime.detokenize:
a few short decodes per token, after the session's lock), so the caller needs no Decode round trip
over the whole output each iteration.

Scoring ahead. A verify with `score_ahead` set, once it has committed, starts the pass of the
target-only step that follows (nothing appended, no draft) on a thread of its own and parks its rows
as an early score would; the next verify takes them when it asks for exactly that step (same
committed sequence, empty tree), so the verifier's next pass runs while the outcome travels to the
caller and the next request travels back (~5 ms a step on a 2-vCPU CPU, bench/RESULTS.md "Scoring
ahead"). The parked rows are that verify's own pass run earlier, so the output is unchanged. A
verify that asks for anything else waits for the pass to end and then runs its own (the ahead pass
is lost): the caller asks only where its next call is surely that step (a target-only request). A
session released or moved on meanwhile drops the pass unrun.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from specdec.engine.api import (
    MAX_TREE_NODES,
    ScoreRequest,
    TextCursor,
    VerifyOutcome,
    VerifyRequest,
)
from specdec.engine.core import EngineCore
from specdec.engine.sessions import (
    SessionConfig,
    advance,
    check_context,
    check_partition,
    check_tokens,
)
from specdec.errors import ContextTooLong, InvalidRequest, SessionGone
from specdec.generation import CHAT_ROLES, ChatMessage
from specdec.methods import DETERMINISTIC_METHOD_NAMES, Method, verification_method
from specdec.randomness import TorchRandomSource
from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import PassShape, ThreadWidths
from specdec.runtime.chat_template import ChatTemplateRenderer, TemplateLimits
from specdec.runtime.compute_thread import serial_torch
from specdec.runtime.detokenize import check_cursor, detokenize
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.kv_pool import PoolConfig
from specdec.runtime.loading import LoadedModel
from specdec.runtime.prefix_cache import PrefixStore
from specdec.runtime.scoring import TreeScore, commit_path, score_tree
from specdec.runtime.text_bounds import max_bytes_per_token
from specdec.sampling import SamplingParams, warp_logits
from specdec.trees import DraftTree, DraftTreeError
from specdec.verification.base import (
    MethodParams,
    VerificationError,
    VerifyResult,
    check_rows,
    greedy_descent,
)
from specdec.verification.dispatch import verify
from specdec.verification.lean import DraftRowsNeeded, LeanDraft, check_lean

log = logging.getLogger(__name__)

DraftRows = torch.Tensor | LeanDraft | None  # full rows, a lean draft, or none (the method reads none)


@dataclass
class _Scored:
    key: tuple
    score: TreeScore
    forward_seconds: float
    warped: tuple[SamplingParams, torch.Tensor] | None = None  # target rows a lean verify warped


@dataclass
class VerifierSession:
    kv: TreeKVCache
    committed: list[int] = field(default_factory=list)
    scored: _Scored | None = None  # rows of an early score, waiting for their verify
    last_verified: tuple | None = None  # key of the last verify (to ignore a late score)


def _key(committed: list[int], tree: DraftTree) -> tuple:
    return (tuple(committed), tree.tokens, tree.parents)


class VerifierEngine(EngineCore[VerifierSession]):
    def __init__(
        self,
        loaded: LoadedModel,
        sessions: SessionConfig | None = None,
        clock=time.monotonic,
        verify_fn: Callable | None = None,
        batching: BatchConfig | None = None,
        threads: ThreadWidths | None = None,
        template_limits: TemplateLimits | None = None,
        kv_pool: PoolConfig | None = None,
        prefix_cache: PrefixStore | None = None,
    ) -> None:
        """`verify_fn` defaults to specdec.verification.dispatch.verify (tests may swap it).
        `threads`: a verifier that shares cores with the drafter runs a pass with all its threads only
        when the request says the drafter is idle (VerifyRequest.drafter_idle); None: never changes them.
        `template_limits`: what a caller-supplied chat template may cost (specdec.runtime.chat_template).
        `kv_pool`: on CUDA, sessions' caches live in one preallocated pool and passes replay captured
        CUDA graphs (specdec.runtime.kv_pool); None, or a model off CUDA: eager caches.
        `prefix_cache`: KV blocks of earlier sessions' prefixes that a new prompt starts from
        (specdec.runtime.prefix_cache); None: every prompt is prefilled."""
        super().__init__(loaded, lambda kv: VerifierSession(kv=kv), sessions=sessions, clock=clock,
                         batching=batching, threads=threads, kv_pool=kv_pool, prefix_cache=prefix_cache)
        self._verify = verify_fn or verify
        self._tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to share across threads
        # The most bytes a text that fits the context window can have (specdec.runtime.text_bounds),
        # None where the tokenizer gives no such bound: tokenize refuses longer texts unread.
        per_token = max_bytes_per_token(loaded.tokenizer)
        context = loaded.info.max_context
        self.max_text_bytes: int | None = per_token * context if per_token and context > 0 else None
        self.score_hits = 0  # verifies that used an earlier score's rows
        self.late_scores = 0  # scores ignored because their verify had already run
        self.draft_rows_requests = 0  # lean verifies answered with draft_rows_needed
        self.ahead_scores = 0  # target-only passes run ahead of their verify (score_ahead)
        self._ahead: ThreadPoolExecutor | None = None  # runs them (started on first use)
        self._ahead_lock = threading.Lock()
        # Renders templates that callers send (not the model's own) in a killable child process.
        self.template_renderer = ChatTemplateRenderer(template_limits)

    # plain calls ----------------------------------------------------------------------------
    def _own_stats(self) -> dict[str, int]:
        """Score reuse and lean-row requests."""
        return {"score_hits": self.score_hits, "late_scores": self.late_scores,
                "draft_rows_requests": self.draft_rows_requests, "ahead_scores": self.ahead_scores}

    def tokenize(self, text: str) -> list[int]:
        """Ids of `text` with the tokenizer's own conventions (add_special_tokens=True).

        That adds a BOS token only for tokenizers configured to (Llama-style); Qwen2 and the
        tiny word-level tokenizers add nothing. No chat template is applied.
        """
        if not isinstance(text, str):
            raise InvalidRequest("text must be a string")
        self._check_text_size(text)
        with self._tokenizer_lock:
            ids = self.loaded.tokenizer.encode(text, add_special_tokens=True)
        return [int(t) for t in ids]

    def apply_chat_template(self, messages: list[ChatMessage], chat_template: str | None = None) -> list[int]:
        """Prompt ids of a chat: the tokenizer's chat template (or `chat_template`, a Jinja text)
        rendered with the assistant's turn opened (add_generation_prompt=True), then encoded.

        InvalidRequest when there is no template or it fails on these messages; every content is
        bounded like a Tokenize text first, and so is the rendered prompt."""
        if not messages:
            raise InvalidRequest("messages: the chat is empty")
        for index, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{index}].role: {message.role!r} is not one of "
                                     f"{', '.join(CHAT_ROLES)}")
            self._check_text_size(message.content)
        tokenizer = self.loaded.tokenizer
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequest(
                "messages: the target model's tokenizer has no chat template; send a prompt instead, "
                "or start the orchestrator with --chat-template FILE")
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        if chat_template and chat_template != getattr(tokenizer, "chat_template", None):
            # A caller's template is untrusted code: bounded in size, time, memory and output, rendered
            # outside this process and without the tokenizer lock (Tokenize never waits for it).
            variables = {key: value for key, value in tokenizer.special_tokens_map.items()
                         if isinstance(value, (str, list))}
            text = self.template_renderer.render(chat_template, conversation, variables)
        else:
            try:
                with self._tokenizer_lock:
                    text = tokenizer.apply_chat_template(conversation, chat_template=template,
                                                         tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # noqa: BLE001 - a Jinja error of the template on these messages
                raise InvalidRequest(f"messages: the chat template failed: {exc}") from None
        self._check_text_size(text)
        with self._tokenizer_lock:
            # The template writes any BOS itself: encoding must not add special tokens again.
            ids = tokenizer.encode(text, add_special_tokens=False)
        return [int(t) for t in ids]

    def decode(self, token_ids: list[int]) -> str:
        """The output text of the ids, as VerifyOutcome.text_* give it: special tokens (EOS, chat
        markers) are no text, as in vLLM's and OpenAI's outputs."""
        context = self.loaded.info.max_context
        if context > 0 and len(token_ids) > context:
            raise InvalidRequest(f"token_ids: {len(token_ids)} ids, more than the context window of "
                                 f"{context} tokens can hold")
        check_tokens("token_ids", token_ids, self.loaded.info.vocab_size)
        return self._decode_output(token_ids)

    def _check_text_size(self, text: str) -> None:
        """ContextTooLong for a text too long to fit the context window, before encoding it: its
        characters first (no copy), its UTF-8 bytes only when they could be over the limit."""
        limit = self.max_text_bytes
        if limit is None or len(text) * 4 <= limit:  # at most 4 bytes a character
            return
        # str.isascii is O(1) (CPython knows a string's widest character); else encode only a text
        # that its characters alone do not already put over the limit.
        exact = text.isascii() or len(text) <= limit
        size = len(text.encode("utf-8", "surrogatepass")) if exact and not text.isascii() else len(text)
        if size > limit:
            context = self.loaded.info.max_context
            raise ContextTooLong(
                f"text: {'' if exact else 'at least '}{size} UTF-8 bytes cannot fit the "
                f"context window of {context} tokens (this tokenizer's tokens stand for at most "
                f"{limit // context} bytes each, so at most {limit} bytes fit)"
            )

    # scoring --------------------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, request: ScoreRequest) -> None:
        """Run the forward pass for (committed + tree) now; returns when its rows are parked."""
        tree = self._tree(request.tree_tokens, request.tree_parents)
        _check_sampling(request.sampling)
        check_partition(request.cache_partition)
        self._check_length(request.append, tree)
        with self.sessions.use(request.session_id, request.base_len) as session, self._batcher.member():
            committed = self._committed(session, request.session_id, request.base_len, request.append, tree)
            session.kv.set_partition(request.cache_partition)
            key = _key(committed, tree)
            if session.last_verified == key:
                self.late_scores += 1
                return
            # The caller now counts `committed` as what this session holds (its mirror moved
            # on), so record it even before the verify that follows.
            session.committed = committed
            self._park(session, committed, tree, key)

    def _park(self, session: VerifierSession, committed: list[int], tree: DraftTree, key: tuple) -> bool:
        """Run the pass for (committed + tree) and park its rows under `key` for the verify that asks
        for it, unless they are parked already; True when it ran the pass."""
        if session.scored is not None and session.scored.key == key:
            return False
        session.scored = None
        score, seconds = self._forward(session, committed, tree)
        session.scored = _Scored(key, score, seconds)
        return True

    @torch.inference_mode()
    def verify(self, request: VerifyRequest) -> VerifyOutcome:
        """Score (or take the early Score's rows), verify and commit; see the module docstring.
        request.want_features is accepted but answered with features=None: the scoring pass returns
        logits only (specdec.runtime.scoring), so the draft-head channel is declared, not yet filled."""
        tree = self._tree(request.tree_tokens, request.tree_parents)
        _check_sampling(request.sampling)
        check_partition(request.cache_partition)
        self._check_length(request.append, tree)
        try:
            method = verification_method(request.method)
        except VerificationError as exc:
            raise InvalidRequest(f"method: {exc}") from exc
        if not isinstance(request.params, MethodParams):
            raise InvalidRequest("params must be a MethodParams")
        draft = self._draft_rows(request, method, tree)
        with (self.sessions.use(request.session_id, request.base_len) as session, self._batcher.member(),
              self._batcher.drafter_idle(request.drafter_idle)):
            committed = self._committed(session, request.session_id, request.base_len, request.append, tree)
            session.kv.set_partition(request.cache_partition)
            if request.text is not None:
                try:
                    check_cursor(request.text, len(committed))
                except ValueError as exc:
                    raise InvalidRequest(f"text: {exc}") from None
            key = _key(committed, tree)
            scored, session.scored = session.scored, None
            if scored is not None and scored.key != key:
                scored = None
            reused = scored is not None
            shapes: list[PassShape] = []  # an early Score call's pass is not this call's
            if scored is not None:
                score, forward_seconds = scored.score, scored.forward_seconds
                self.score_hits += 1
            else:
                with self._batcher.shapes() as shapes:
                    score, forward_seconds = self._forward(session, committed, tree)

            began = time.perf_counter()
            # The engine knows the committed length; ERSD's races are keyed on it.
            params = dataclasses.replace(request.params, position=len(committed))
            target_rows: torch.Tensor | None = None
            try:
                greedy_walk = request.sampling.greedy and method.descends(request.deterministic)
                if greedy_walk and self._verify is verify:
                    # Greedy rows decide a descend rule by their argmax alone; a rule swapped in (tests)
                    # sees every call.
                    result = greedy_descent(tree, score.logits)
                else:
                    warped = scored.warped if scored is not None else None
                    if warped is not None and warped[0] == request.sampling:
                        target_rows = warped[1]
                    else:
                        target_rows = warp_logits(score.logits, request.sampling)
                    result = self._rule(request, tree, target_rows, draft, params)
            except VerificationError as exc:
                raise InvalidRequest(f"verification failed: {exc}") from exc
            except DraftRowsNeeded as need:
                # Nothing decided: park the pass for the retry (its time is counted here, once) and
                # hold `committed`, as `score` does (docs/algorithms.md §12).
                session.scored = _Scored(key, score, 0.0, (request.sampling, target_rows))
                session.committed = committed
                self.draft_rows_requests += 1
                return VerifyOutcome(
                    tokens=[], accepted_nodes=[], accept_flags=[], num_drafted=len(tree),
                    committed_len=len(committed), forward_seconds=forward_seconds,
                    verify_seconds=time.perf_counter() - began, reused_tokens=score.reused,
                    pending_tokens=score.pending_len, score_reused=reused,
                    draft_rows_needed=list(need.rows), text_cursor=request.text,
                )
            verify_seconds = time.perf_counter() - began

            try:
                commit_path(session.kv, score.pending_len, result.accepted_nodes)
            except BaseException:
                session.kv = self._replace_cache(session.kv)
                raise
            session.committed = ids = committed + [int(t) for t in result.tokens]
            session.last_verified = key
            outcome = VerifyOutcome(
                tokens=[int(t) for t in result.tokens],
                accepted_nodes=[int(n) for n in result.accepted_nodes],
                accept_flags=[bool(f) for f in result.accept_flags],
                num_drafted=len(tree),
                committed_len=len(session.committed),
                forward_seconds=forward_seconds,
                verify_seconds=verify_seconds,
                reused_tokens=score.reused,
                cached_tokens=score.restored,  # once: the retry of a lean verify decides, as here
                pending_tokens=score.pending_len,
                score_reused=reused,
                **_pass_shape(shapes),
            )
        if request.score_ahead:  # before the text: the pass starts as soon as the lock is free
            self._start_ahead(request, len(ids))
        if request.text is not None:  # after the session's lock: other calls of the session go on
            self._add_text(outcome, ids, request.text)
        return outcome

    def _rule(self, request: VerifyRequest, tree: DraftTree, target_rows: torch.Tensor, draft: DraftRows,
              params: MethodParams) -> VerifyResult:
        """The method's rule on the warped rows (its rule for model-free drafts when deterministic),
        with the random source keyed on the committed length (params.position)."""
        source = TorchRandomSource.from_seed(params.seed, "verify", params.position)
        if request.deterministic:
            return self._verify(request.method, tree, target_rows, None, params, source, deterministic=True)
        return self._verify(request.method, tree, target_rows, _to_device(draft, target_rows.device), params,
                            source)

    # scoring ahead (module docstring) --------------------------------------------------------
    def _start_ahead(self, request: VerifyRequest, committed_len: int) -> None:
        with self._ahead_lock:
            if self._ahead is None:  # one thread: a session's ahead passes run in order
                self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier-ahead",
                                                 initializer=serial_torch)
            self._ahead.submit(self._score_ahead, request.session_id, committed_len, request.cache_partition,
                               request.drafter_idle)

    @torch.inference_mode()
    def _score_ahead(self, session_id: str, committed_len: int, partition: str, drafter_idle: bool) -> None:
        """Park the rows of the target-only step after `committed_len` tokens, unless the session has
        moved on, been released, or already holds them. Never raises: the next verify then runs the
        pass itself."""
        tree = DraftTree.empty()
        try:
            with (self.sessions.use(session_id, committed_len) as session, self._batcher.member(),
                  self._batcher.drafter_idle(drafter_idle)):
                committed = session.committed
                key = _key(committed, tree)
                if len(committed) != committed_len or session.last_verified == key:
                    return
                check_context(len(committed), self.loaded.info.max_context)
                session.kv.set_partition(partition)
                if self._park(session, committed, tree, key):
                    self.ahead_scores += 1
        except (SessionGone, ContextTooLong):
            return
        except Exception:  # noqa: BLE001 - an optimisation: the next verify runs the pass itself
            log.exception("a pass scored ahead failed; the next verify of session %s runs it", session_id)

    def _add_text(self, outcome: VerifyOutcome, ids: list[int], cursor: TextCursor) -> None:
        """Fill the outcome's text fields (specdec.runtime.detokenize) from the committed `ids` (this
        call's own list: nothing changes it in place). The tokens are committed already, so a failure
        here only leaves the text out (text_cursor None: the caller decodes the ids instead)."""
        try:
            step = detokenize(self._decode_output, ids, cursor, len(outcome.tokens))
        except Exception:  # noqa: BLE001 - never lose a committed outcome over its text
            log.exception("incremental detokenization failed; the outcome goes without text")
            return
        outcome.text_pieces, outcome.text_tails, outcome.text_cursor = step.pieces, step.tails, step.cursor
        if step.fallbacks:
            outcome.text_fallbacks = step.fallbacks

    def _decode_output(self, ids) -> str:
        """Output text as the user sees it: special tokens (EOS, …) are no text. One short decode per
        lock hold, so a tokenize or decode of another session waits for microseconds at most."""
        with self._tokenizer_lock:
            return self.loaded.tokenizer.decode(
                [int(t) for t in ids], skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # helpers --------------------------------------------------------------------------------
    def _check_length(self, append: list[int], tree: DraftTree) -> None:
        """A call whose appended tokens alone cannot fit the context window, refused by their count:
        before the session's lock, reading them or any forward pass. (base_len is checked against the
        session: one beyond it means SessionGone, resend the context.)"""
        check_context(len(append) + tree.max_depth, self.loaded.info.max_context)

    def _forward(
        self, session: VerifierSession, committed: list[int], tree: DraftTree
    ) -> tuple[TreeScore, float]:
        began = time.perf_counter()
        try:
            score = score_tree(session.kv, committed, tree)
        except BaseException:
            session.kv = self._replace_cache(session.kv)  # never keep a cache in an unknown state
            raise
        return score, time.perf_counter() - began

    def _committed(
        self, session: VerifierSession, session_id: str, base_len: int, append: list[int], tree: DraftTree
    ) -> list[int]:
        committed = advance(session.committed, session_id, base_len, append)
        check_tokens("append", append, self.loaded.info.vocab_size)
        check_context(len(committed) + tree.max_depth, self.loaded.info.max_context)
        return committed

    def _tree(self, tokens: list[int], parents: list[int]) -> DraftTree:
        if len(tokens) > MAX_TREE_NODES:
            raise InvalidRequest(
                f"tree_tokens holds {len(tokens)} nodes; at most {MAX_TREE_NODES} are allowed "
                "(the verifier's cap)"
            )
        if len(tokens) != len(parents):
            raise InvalidRequest(f"tree_parents has {len(parents)} entries for {len(tokens)} tree_tokens")
        check_tokens("tree_tokens", tokens, self.loaded.info.vocab_size)
        try:
            return DraftTree(tuple(tokens), tuple(parents))
        except DraftTreeError as exc:
            raise InvalidRequest(f"tree_parents: {exc}") from exc

    def _draft_rows(self, request: VerifyRequest, method: Method, tree: DraftTree) -> DraftRows:
        """The request's draft rows (full or lean) where the method reads them, checked before any
        forward pass."""
        lean = request.lean_draft()
        vocab = self.loaded.info.vocab_size
        if request.deterministic:
            if not method.takes_deterministic_drafts:
                raise InvalidRequest(f"deterministic: method {method.name!r} has no exact rule for "
                                     f"model-free drafts; use one of {', '.join(DETERMINISTIC_METHOD_NAMES)}")
            if lean is not None or request.draft_probs is not None:
                raise InvalidRequest("deterministic: a model-free draft carries no draft rows "
                                     "(draft_probs, draft_token_probs, draft_row_*)")
            return None
        try:
            if not method.needs_rows(request.params, len(tree)):
                return None
            if lean is not None:
                return check_lean(len(tree), lean, vocab)
            return check_rows(tree, request.draft_probs, "draft", vocab)
        except VerificationError as exc:
            raise InvalidRequest(f"{'lean draft' if lean is not None else 'draft_probs'}: {exc}") from exc


def _pass_shape(shapes: list[PassShape]) -> dict[str, int]:
    """VerifyOutcome's pass_calls and pass_rows: what the call's forward pass carried, so the
    orchestrator can tell a batch's cost from its own draft's (orchestrator.adaptation.SourceEstimates).
    No pass of its own (an early Score's rows): the defaults, 1 call and rows unknown."""
    if not shapes:
        return {}
    return {"pass_calls": max(shape.calls for shape in shapes),
            "pass_rows": sum(shape.rows for shape in shapes)}


def _to_device(draft: DraftRows, device: torch.device) -> DraftRows:
    """The draft rows on the target rows' device."""
    if isinstance(draft, torch.Tensor):
        return draft.to(device)
    if isinstance(draft, LeanDraft) and draft.row_values is not None:
        return dataclasses.replace(draft, row_values=draft.row_values.to(device))
    return draft


def _check_sampling(sampling: object) -> None:
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequest("sampling must be a SamplingParams")
