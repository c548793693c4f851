"""Contract between the orchestrator and the drafter / verifier engines.

The engines (specdec.engine.drafter, specdec.engine.verifier) hold per-session token lists and
KV caches and are plain Python objects; the gRPC services wrap them 1:1 and the in-process
transport calls them directly, so both transports run the same code.

Session protocol (both engines): the caller tracks what it last told a service about the
committed sequence. Each call carries `base_len` (how many tokens of that earlier committed
sequence still stand — commits only grow, so it is the old committed length) and `append` (the
committed tokens since). The engine's committed sequence becomes
`session.committed[:base_len] + append`. If the session is unknown, or holds fewer than
`base_len` committed tokens, the engine raises SessionGone and the caller resends everything
with base_len = 0. Engines reuse KV entries by longest common prefix with whatever they have
cached (including their own earlier draft tokens), so accepted tokens are never recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import (
    InvalidRequest,
)
from specdec.sampling import SamplingParams
from specdec.verification.base import MethodParams
from specdec.verification.lean import LeanDraft

DRAFT_STRATEGIES = ("sample", "race")
# Caps on what one engine call may ask for, checked before any work (INVALID_ARGUMENT naming the field
# and the cap). The orchestrator's own limits keep below them (orchestrator.config: max_k <=
# MAX_LOOKAHEAD_K, max_tree_budget <= MAX_TREE_NODES), so only a caller that bypasses it meets them.
MAX_TREE_NODES = 1024  # nodes of a draft tree: Draft's shape, Score's and Verify's tree
MAX_LOOKAHEAD_K = 128  # draft length after each Lookahead guess (each step is one drafter pass)
MAX_LOOKAHEAD_GUESSES = 16  # bonus guesses, and rejection guesses, of one Lookahead
BOTH_DRAFT_FORMS = ("draft_probs: give the draft rows either full (draft_probs) or lean (draft_token_probs, "
                    "draft_row_indices, draft_row_values), not both")


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_context: int
    eos_token_ids: tuple[int, ...] = ()
    device: str = "cpu"
    dtype: str = "float32"


@dataclass(frozen=True, eq=False)  # eq by identity: a tensor has no single truth value to compare by
class DraftFeatures:
    """The target's hidden states at some committed positions: what an EAGLE- or Medusa-style draft
    head conditions on (it predicts the next tokens from the target's last hidden layer, not from a
    draft model's own pass). A declared channel: asked for with VerifyRequest.want_features, carried
    back in VerifyOutcome.features and forward in DraftRequest.features, so a head can be added
    without touching the protos, convert.py or the servers again. Today's engines do not fill it
    (VerifierEngine answers features=None: the scoring pass returns logits only) and the model
    drafter ignores it.

    `positions`: absolute indexes into the session's committed sequence, ascending (the tokens whose
    target pass produced the states: the accepted path and the pending tokens forwarded with it; the
    extra token has no state yet). `hidden`: float32 [len(positions), hidden_size], the last layer."""

    positions: tuple[int, ...]
    hidden: torch.Tensor

    def __post_init__(self) -> None:
        if self.hidden.dim() != 2 or self.hidden.shape[0] != len(self.positions):
            raise InvalidRequest(f"features.hidden must be [{len(self.positions)}, hidden_size] (one row per "
                                 f"position), got {list(self.hidden.shape)}")


@dataclass
class DraftRequest:
    session_id: str
    base_len: int
    append: list[int]
    # Shape of the draft as parent indices (see specdec.trees): [-1, 0, 1, ...] is a sequence of
    # k tokens, [-1] * m a star; [] asks for no tokens (RD's no-draft step: only row 0).
    shape_parents: list[int]
    sampling: SamplingParams
    seed: int
    strategy: str = "sample"  # "sample": draws from Q (without replacement among siblings); "race": ERSD
    want_distributions: bool = False
    # Also compute the rows after the leaves (one extra forward pass); needed by RD when K < k_max.
    include_leaf_rows: bool = False
    # With want_distributions: park the rows at the drafter and answer each node's q of its token
    # (DraftResult.token_probs); a verify fetches whole rows only on a rejection (DraftRowsRequest).
    lean_rows: bool = False
    # The engine's prefix cache shares KV blocks only within one partition (the orchestrator sends the
    # caller's tenant and cache salt; specdec.runtime.prefix_cache).
    cache_partition: str = ""
    # The verifier's hidden states from the last verify (VerifyOutcome.features), for a draft head;
    # None: none sent. Declared only: the model drafter ignores them.
    features: DraftFeatures | None = None


@dataclass
class DraftResult:
    tokens: list[int]
    parents: list[int]
    # [n + 1, V] float32 warped draft rows in the specdec.verification layout when requested
    # (rows after leaves are zero unless include_leaf_rows); None otherwise.
    draft_probs: torch.Tensor | None = None
    forward_seconds: float = 0.0
    reused_tokens: int = 0  # committed tokens whose KV entries were reused
    # lean_rows: per node, q of its token in its parent's row (specdec.verification.lean.token_probs
    # of the parked rows, bit for bit), and the id that names the parked rows in DraftRowsRequest.
    token_probs: list[float] | None = None
    rows_id: int = 0
    cached_tokens: int = 0  # committed tokens whose KV entries came from the prefix cache in this call


@dataclass
class DraftRowsRequest:
    """Rows of a lean draft, parked at the drafter (DraftRequest.lean_rows)."""

    session_id: str
    rows_id: int
    rows: list[int]  # indices in the [n + 1, V] layout


@dataclass
class LookaheadRequest:
    """Pre-draft the next block for several guesses of what the verifier will commit.

    Used by pipelined speculation while the verifier checks the block that ends the session's
    context C (= committed prefix + block; base_len/append as for DraftRequest). Hypotheses:
    C + [b] for the `bonus_guesses` likeliest next tokens b after C (every draft accepted, bonus
    b), then C[:-1] + [r] for the `rejection_guesses` likeliest tokens r != C[-1] at the last
    block position (the last draft rejected, r emitted instead). After each hypothesis the
    engine drafts `k` tokens exactly as `draft` would from that context (same rows up to
    floating-point batching, same random stream), so the branch whose context comes true is the
    fresh draft. "Likeliest" is by the drafter's logits for strategy "sample", and the order of
    arrival in the verifier's race at that position under the drafter's row for "race" (ERSD).
    """

    session_id: str
    base_len: int
    append: list[int]
    k: int
    sampling: SamplingParams
    seed: int
    strategy: str = "sample"
    want_distributions: bool = False
    bonus_guesses: int = 1
    rejection_guesses: int = 0
    cache_partition: str = ""  # as DraftRequest.cache_partition


@dataclass
class LookaheadBranch:
    replaces_last: bool  # the hypothesis is C[:-1] + [token] (True) or C + [token] (False)
    token: int
    draft: DraftResult  # a sequence drafted after the hypothesis (rows [n + 1, V], leaf row zero)


@dataclass
class LookaheadResult:
    branches: list[LookaheadBranch]  # bonus guesses first (likeliest first), then rejection guesses
    forward_seconds: float = 0.0
    reused_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class ScoreRequest:
    """Start the target forward pass over (committed + tree) before draft rows are known."""

    session_id: str
    base_len: int
    append: list[int]
    tree_tokens: list[int]
    tree_parents: list[int]
    sampling: SamplingParams
    cache_partition: str = ""  # as DraftRequest.cache_partition


@dataclass(frozen=True)
class TextCursor:
    """Where the caller's output text stands, for a verify that also returns the text of the tokens
    it emits (incremental detokenization, specdec.runtime.detokenize): absolute indexes into the
    session's committed sequence, so the engine keeps no text state and a resent session keeps them.

    `start`: the first output token (the prompt's length); the text is that of committed[start:].
    `read`: tokens in [start, read) are settled, their text is entirely in the caller's text.
    `prefix` (<= read): where the decode window starts (TGI/vLLM's prefix_offset): the tokens
    before `read` that the next tokens are decoded next to, for context.
    """

    start: int
    prefix: int
    read: int


@dataclass
class VerifyRequest:
    """The draft side comes full (`draft_probs`, [n + 1, V]) or lean (docs/algorithms.md §12): per
    node the draft probability of its token in its parent's row, plus the rows given so far; the
    engine then answers `draft_rows_needed` when the rule reaches another row. Not both forms."""

    session_id: str
    base_len: int
    append: list[int]
    tree_tokens: list[int]
    tree_parents: list[int]
    method: str
    params: MethodParams
    sampling: SamplingParams
    draft_probs: torch.Tensor | None = None
    # The lean form: float64 q per node (specdec.verification.lean.token_probs), the rows carried
    # and their raw float32 values [len(draft_row_indices), V].
    draft_token_probs: list[float] = field(default_factory=list)
    draft_row_indices: list[int] = field(default_factory=list)
    draft_row_values: torch.Tensor | None = None
    # Also return the text of the emitted tokens (VerifyOutcome.text_*), from this cursor (the
    # last outcome's text_cursor; TextCursor(n, n, n) for a prompt of n tokens). None: no text.
    text: TextCursor | None = None
    # A model-free draft (prompt lookup, suffix cache): every node's draft distribution is one-hot at
    # its token, so no draft rows come; the method's rule for deterministic drafts decides
    # (specdec.methods.Method.deterministic_rule).
    deterministic: bool = False
    # No drafter call runs beside this pass: a verifier sharing its cores with the drafter may use all
    # its threads for it (VerifierEngine threads_beside_drafter).
    drafter_idle: bool = False
    cache_partition: str = ""  # as DraftRequest.cache_partition
    # Also return the target's hidden states for a draft head (VerifyOutcome.features). Off by default:
    # no cost unless asked. The engine may still answer None (today's VerifierEngine always does).
    want_features: bool = False
    # After committing, score the target-only step that follows and park its rows for the next verify
    # (VerifierEngine's module docstring, "Scoring ahead"): the next pass starts without waiting for a
    # round trip through the caller. For a caller whose next call is surely that step.
    score_ahead: bool = False

    @property
    def lean(self) -> bool:
        """Whether the request uses the lean form (an empty one carries no draft at all)."""
        return bool(self.draft_token_probs or self.draft_row_indices) or self.draft_row_values is not None

    def lean_draft(self) -> LeanDraft | None:
        """The lean form as a LeanDraft (None: the request uses the full form or none); a request
        that uses both forms is refused. Its form is checked by lean.check_lean."""
        if not self.lean:
            return None
        if self.draft_probs is not None:
            raise InvalidRequest(BOTH_DRAFT_FORMS)
        return LeanDraft(tuple(self.draft_token_probs), tuple(self.draft_row_indices), self.draft_row_values)


@dataclass
class VerifyOutcome:
    """tokens is empty exactly when draft_rows_needed is not: a lean verify reached draft rows it
    was not given; nothing was committed, and the same request with those rows too decides.

    The pass-shape fields tell the orchestrator what this call's forward pass cost, beside its own
    draft (orchestrator.adaptation.SourceEstimates): `pass_calls` calls were batched into it and it
    carried `pass_rows` query rows (padding included; specdec.runtime.batching). Both describe a pass
    of this call's own: when it reused an earlier pass (an early Score, a lean retry) pass_calls is 1
    and pass_rows None (unknown).

    The text fields answer a request with `text` set (else they are empty / None). With `settled`
    the caller's text of committed[start:read] (request.text's cursor), for each n in
    1..len(tokens): settled + "".join(text_pieces[:n]) + text_tails[n - 1] is the one-shot
    decode of the output up to token n (skip_special_tokens=True: special tokens such as EOS add
    no text; clean_up_tokenization_spaces=False). So a caller that keeps fewer tokens (a stop
    token, max_new_tokens) still knows its text exactly.
    """

    tokens: list[int]  # accepted path + one extra token; the engine has committed them
    accepted_nodes: list[int]
    accept_flags: list[bool]
    num_drafted: int
    committed_len: int  # session's committed length after this call
    forward_seconds: float = 0.0
    verify_seconds: float = 0.0
    reused_tokens: int = 0
    pass_calls: int = 1  # calls batched into this call's forward pass (1: alone, or no pass of its own)
    pass_rows: int | None = None  # query rows of that pass, padding included; None: no pass of its own
    pending_tokens: int = 0  # committed tokens forwarded with the tree (the last extra token + uncached ones)
    score_reused: bool = False  # the rows came from an earlier Score call (its time was counted there)
    text_fallbacks: int = 0  # text steps decoded from the output's start (specdec.runtime.detokenize)
    draft_rows_needed: list[int] = field(default_factory=list)
    # One per emitted token: the text it settles ("" while it ends mid-character or adds nothing).
    text_pieces: list[str] = field(default_factory=list)
    # One per emitted token: the unsettled text after it, as a decode shows it (often "\ufffd" for
    # a partial character; usually ""). It may still change: only pieces are final.
    text_tails: list[str] = field(default_factory=list)
    # The cursor after every emitted token: the next verify's request.text. None when no text was
    # asked for, or (never expected) the engine could not make it: decode the ids instead.
    text_cursor: TextCursor | None = None
    cached_tokens: int = 0  # committed tokens whose KV entries came from the prefix cache in this call
    # With request.want_features, when the engine can: the target's hidden states for the positions
    # this call's pass forwarded and kept (DraftFeatures). None: not asked, or not available.
    features: DraftFeatures | None = None
