"""Dataclass ⇄ protobuf message conversions: the one place that knows both shapes.

The services and clients are thin because everything about the wire format lives here. The
generation messages (and sampling) are converted in specdec.rpc.generation_convert, which needs no
torch (the light client uses it).
Decoding validates what the type system of protobuf cannot: tensor byte sizes against their
shape, sampling parameters (through the dataclass), and integer ranges on encode (uint64
seeds), raising InvalidRequest / SamplingParamsError with the field named, which the servers
turn into INVALID_ARGUMENT.

Tensors travel as dense little-endian float32 bytes + shape, and only float32 tensors are
accepted: the drafter samples from exactly the float32 rows it sends, so the verifier checks
against the very numbers the draws came from (a lossy cast here would break exactness).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specdec.engine.api import (
    DraftFeatures,
    DraftRequest,
    DraftResult,
    DraftRowsRequest,
    InvalidRequest,
    LookaheadBranch,
    LookaheadRequest,
    LookaheadResult,
    ModelInfo,
    ScoreRequest,
    TextCursor,
    VerifyOutcome,
    VerifyRequest,
)
from specdec.rpc.generation_convert import (
    sampling_from_proto,
    sampling_to_proto,
    to_ints,
    to_uint64,
)
from specdec.rpc.v1 import common_pb2, drafter_pb2, verifier_pb2
from specdec.trees import sequence_parents
from specdec.verification.base import MethodParams
from specdec.verification.errors import VerificationError
from specdec.verification.lean import check_lean

MAX_TENSOR_DIMS = 8
_F32_LE = np.dtype("<f4")


# --------------------------------------------------------------------------- method params


def method_params_to_proto(params: MethodParams) -> common_pb2.MethodParams:
    return common_pb2.MethodParams(
        a=float(params.a),
        k_max=int(params.k_max),
        seed=to_uint64(params.seed, "params.seed"),
        position=int(params.position),
    )


def method_params_from_proto(msg: common_pb2.MethodParams, present: bool = True) -> MethodParams:
    if not present:
        return MethodParams()
    a = msg.a if msg.HasField("a") else MethodParams().a
    if not math.isfinite(a):
        raise InvalidRequest(f"params.a must be finite, got {a}")
    return MethodParams(a=a, k_max=msg.k_max, seed=msg.seed, position=msg.position)


# ---------------------------------------------------------------------------------- tensors


def tensor_to_proto(tensor: torch.Tensor, name: str = "tensor") -> common_pb2.Tensor:
    if tensor.dtype != torch.float32:
        raise TypeError(f"{name}: only float32 tensors go on the wire (exactness), got {tensor.dtype}")
    array = tensor.detach().to("cpu").contiguous().numpy().astype(_F32_LE, copy=False)
    return common_pb2.Tensor(shape=list(tensor.shape), data_f32=array.tobytes())


def tensor_from_proto(msg: common_pb2.Tensor, name: str = "tensor") -> torch.Tensor:
    """Decode and validate: dims non-negative and few, byte length = product(shape) * 4."""
    shape = [int(d) for d in msg.shape]
    if len(shape) > MAX_TENSOR_DIMS or any(d < 0 for d in shape):
        raise InvalidRequest(
            f"{name}.shape must have at most {MAX_TENSOR_DIMS} non-negative dims, got {shape}"
        )
    count = math.prod(shape)
    if len(msg.data_f32) != count * 4:
        raise InvalidRequest(
            f"{name}.data_f32 must hold product(shape) * 4 = {count * 4} bytes for shape {shape}, "
            f"got {len(msg.data_f32)}"
        )
    array = np.frombuffer(msg.data_f32, dtype=_F32_LE).astype(np.float32)  # copy: writable, native order
    return torch.from_numpy(array).reshape(shape)


def _optional_tensor(msg, field: str, name: str) -> torch.Tensor | None:
    return tensor_from_proto(getattr(msg, field), name) if msg.HasField(field) else None


# ---------------------------------------------------------------------------- draft features


def draft_features_to_proto(features: DraftFeatures) -> common_pb2.DraftFeatures:
    return common_pb2.DraftFeatures(
        positions=[int(p) for p in features.positions],
        hidden=tensor_to_proto(features.hidden, "features.hidden"),
    )


def draft_features_from_proto(msg: common_pb2.DraftFeatures) -> DraftFeatures:
    """Checks that `hidden` has one row per position (DraftFeatures does)."""
    hidden = tensor_from_proto(msg.hidden, "features.hidden")
    return DraftFeatures(positions=tuple(msg.positions), hidden=hidden)


def _optional_features(msg) -> DraftFeatures | None:
    return draft_features_from_proto(msg.features) if msg.HasField("features") else None


# ------------------------------------------------------------------------------- model info


def model_info_to_proto(info: ModelInfo) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=info.model_id,
        vocab_size=int(info.vocab_size),
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        max_context=int(info.max_context),
        eos_token_ids=to_ints(info.eos_token_ids, "eos_token_ids"),
        device=info.device,
        dtype=info.dtype,
    )


def model_info_from_proto(msg: common_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model_id=msg.model_id,
        vocab_size=msg.vocab_size,
        tokenizer_fingerprint=msg.tokenizer_fingerprint,
        max_context=msg.max_context,
        eos_token_ids=tuple(msg.eos_token_ids),
        device=msg.device,
        dtype=msg.dtype,
    )


# ------------------------------------------------------------------------------------ draft


def draft_request_to_proto(req: DraftRequest) -> drafter_pb2.DraftRequest:
    msg = drafter_pb2.DraftRequest(
        session_id=req.session_id,
        base_len=int(req.base_len),
        append=to_ints(req.append, "append"),
        shape_parents=to_ints(req.shape_parents, "shape_parents"),
        sampling=sampling_to_proto(req.sampling),
        seed=to_uint64(req.seed, "seed"),
        strategy=req.strategy,
        want_distributions=bool(req.want_distributions),
        include_leaf_rows=bool(req.include_leaf_rows),
        lean_rows=bool(req.lean_rows),
        cache_partition=req.cache_partition,
    )
    if req.features is not None:
        msg.features.CopyFrom(draft_features_to_proto(req.features))
    return msg


def draft_request_from_proto(msg: drafter_pb2.DraftRequest) -> DraftRequest:
    return DraftRequest(
        session_id=msg.session_id,
        base_len=msg.base_len,
        append=list(msg.append),
        shape_parents=list(msg.shape_parents),
        sampling=sampling_from_proto(msg.sampling, msg.HasField("sampling")),
        seed=msg.seed,
        strategy=msg.strategy if msg.HasField("strategy") else "sample",
        want_distributions=msg.want_distributions,
        include_leaf_rows=msg.include_leaf_rows,
        lean_rows=msg.lean_rows,
        cache_partition=msg.cache_partition,
        features=_optional_features(msg),
    )


def draft_result_to_proto(result: DraftResult) -> drafter_pb2.DraftResult:
    msg = drafter_pb2.DraftResult(
        tokens=to_ints(result.tokens, "tokens"),
        parents=to_ints(result.parents, "parents"),
        forward_seconds=float(result.forward_seconds),
        reused_tokens=int(result.reused_tokens),
        token_probs=[float(p) for p in result.token_probs or ()],
        rows_id=to_uint64(result.rows_id, "rows_id"),
        cached_tokens=int(result.cached_tokens),
    )
    if result.draft_probs is not None:
        msg.draft_probs.CopyFrom(tensor_to_proto(result.draft_probs, "draft_probs"))
    return msg


def draft_result_from_proto(msg: drafter_pb2.DraftResult) -> DraftResult:
    return DraftResult(
        tokens=list(msg.tokens),
        parents=list(msg.parents),
        draft_probs=_optional_tensor(msg, "draft_probs", "draft_probs"),
        forward_seconds=msg.forward_seconds,
        reused_tokens=msg.reused_tokens,
        token_probs=list(msg.token_probs) if msg.rows_id else None,
        rows_id=msg.rows_id,
        cached_tokens=msg.cached_tokens,
    )


def draft_rows_request_to_proto(req: DraftRowsRequest) -> drafter_pb2.DraftRowsRequest:
    return drafter_pb2.DraftRowsRequest(session_id=req.session_id, rows_id=to_uint64(req.rows_id, "rows_id"),
                                        rows=to_ints(req.rows, "rows"))


def draft_rows_request_from_proto(msg: drafter_pb2.DraftRowsRequest) -> DraftRowsRequest:
    return DraftRowsRequest(session_id=msg.session_id, rows_id=msg.rows_id, rows=list(msg.rows))


def lookahead_request_to_proto(req: LookaheadRequest) -> drafter_pb2.LookaheadRequest:
    return drafter_pb2.LookaheadRequest(
        session_id=req.session_id,
        base_len=int(req.base_len),
        append=to_ints(req.append, "append"),
        k=int(req.k),
        sampling=sampling_to_proto(req.sampling),
        seed=to_uint64(req.seed, "seed"),
        strategy=req.strategy,
        want_distributions=bool(req.want_distributions),
        bonus_guesses=int(req.bonus_guesses),
        rejection_guesses=int(req.rejection_guesses),
        cache_partition=req.cache_partition,
    )


def lookahead_request_from_proto(msg: drafter_pb2.LookaheadRequest) -> LookaheadRequest:
    return LookaheadRequest(
        session_id=msg.session_id,
        base_len=msg.base_len,
        append=list(msg.append),
        k=msg.k,
        sampling=sampling_from_proto(msg.sampling, msg.HasField("sampling")),
        seed=msg.seed,
        strategy=msg.strategy if msg.HasField("strategy") else "sample",
        want_distributions=msg.want_distributions,
        bonus_guesses=msg.bonus_guesses if msg.HasField("bonus_guesses") else 1,
        rejection_guesses=msg.rejection_guesses,
        cache_partition=msg.cache_partition,
    )


def lookahead_result_to_proto(result: LookaheadResult) -> drafter_pb2.LookaheadResult:
    msg = drafter_pb2.LookaheadResult(
        forward_seconds=float(result.forward_seconds), reused_tokens=int(result.reused_tokens),
        cached_tokens=int(result.cached_tokens),
    )
    for branch in result.branches:
        entry = msg.branches.add(
            replaces_last=bool(branch.replaces_last),
            token=int(branch.token),
            tokens=to_ints(branch.draft.tokens, "tokens"),
        )
        probs = branch.draft.draft_probs
        if probs is not None:  # the leaf row is zero by the layout: not worth its bytes
            entry.draft_rows.CopyFrom(tensor_to_proto(probs[: len(branch.draft.tokens)], "draft_rows"))
    return msg


def lookahead_result_from_proto(msg: drafter_pb2.LookaheadResult) -> LookaheadResult:
    branches = []
    for i, entry in enumerate(msg.branches):
        tokens = list(entry.tokens)
        probs = None
        if entry.HasField("draft_rows"):
            rows = tensor_from_proto(entry.draft_rows, f"branches[{i}].draft_rows")
            if rows.dim() != 2 or rows.shape[0] != len(tokens):
                raise InvalidRequest(
                    f"branches[{i}].draft_rows must be [{len(tokens)}, V], got {list(rows.shape)}"
                )
            probs = torch.cat([rows, rows.new_zeros((1, rows.shape[1]))])
        draft = DraftResult(tokens=tokens, parents=sequence_parents(len(tokens)), draft_probs=probs)
        branches.append(LookaheadBranch(replaces_last=entry.replaces_last, token=entry.token, draft=draft))
    return LookaheadResult(branches=branches, forward_seconds=msg.forward_seconds,
                           reused_tokens=msg.reused_tokens, cached_tokens=msg.cached_tokens)


# ------------------------------------------------------------------------------ score/verify


def score_request_to_proto(req: ScoreRequest) -> verifier_pb2.ScoreRequest:
    return verifier_pb2.ScoreRequest(
        session_id=req.session_id,
        base_len=int(req.base_len),
        append=to_ints(req.append, "append"),
        tree_tokens=to_ints(req.tree_tokens, "tree_tokens"),
        tree_parents=to_ints(req.tree_parents, "tree_parents"),
        sampling=sampling_to_proto(req.sampling),
        cache_partition=req.cache_partition,
    )


def score_request_from_proto(msg: verifier_pb2.ScoreRequest) -> ScoreRequest:
    return ScoreRequest(
        session_id=msg.session_id,
        base_len=msg.base_len,
        append=list(msg.append),
        tree_tokens=list(msg.tree_tokens),
        tree_parents=list(msg.tree_parents),
        sampling=sampling_from_proto(msg.sampling, msg.HasField("sampling")),
        cache_partition=msg.cache_partition,
    )


def verify_request_to_proto(req: VerifyRequest) -> verifier_pb2.VerifyRequest:
    msg = verifier_pb2.VerifyRequest(
        session_id=req.session_id,
        base_len=int(req.base_len),
        append=to_ints(req.append, "append"),
        tree_tokens=to_ints(req.tree_tokens, "tree_tokens"),
        tree_parents=to_ints(req.tree_parents, "tree_parents"),
        method=req.method,
        params=method_params_to_proto(req.params),
        sampling=sampling_to_proto(req.sampling),
        deterministic=bool(req.deterministic),
        drafter_idle=bool(req.drafter_idle),
        cache_partition=req.cache_partition,
        want_features=bool(req.want_features),
        score_ahead=bool(req.score_ahead),
    )
    if req.draft_probs is not None:
        msg.draft_probs.CopyFrom(tensor_to_proto(req.draft_probs, "draft_probs"))
    msg.draft_token_probs.extend(float(v) for v in req.draft_token_probs)
    msg.draft_row_indices.extend(to_ints(req.draft_row_indices, "draft_row_indices"))
    if req.draft_row_values is not None:
        msg.draft_row_values.CopyFrom(tensor_to_proto(req.draft_row_values, "draft_row_values"))
    if req.text is not None:
        msg.text.CopyFrom(text_cursor_to_proto(req.text))
    return msg


def verify_request_from_proto(msg: verifier_pb2.VerifyRequest) -> VerifyRequest:
    """Also checks the lean draft fields' form (docs/algorithms.md §12); the vocabulary is the engine's."""
    req = VerifyRequest(
        session_id=msg.session_id,
        base_len=msg.base_len,
        append=list(msg.append),
        tree_tokens=list(msg.tree_tokens),
        tree_parents=list(msg.tree_parents),
        method=msg.method,
        params=method_params_from_proto(msg.params, msg.HasField("params")),
        sampling=sampling_from_proto(msg.sampling, msg.HasField("sampling")),
        draft_probs=_optional_tensor(msg, "draft_probs", "draft_probs"),
        draft_token_probs=list(msg.draft_token_probs),
        draft_row_indices=list(msg.draft_row_indices),
        draft_row_values=_optional_tensor(msg, "draft_row_values", "draft_row_values"),
        text=text_cursor_from_proto(msg.text) if msg.HasField("text") else None,
        deterministic=msg.deterministic,
        drafter_idle=msg.drafter_idle,
        cache_partition=msg.cache_partition,
        want_features=msg.want_features,
        score_ahead=msg.score_ahead,
    )
    lean = req.lean_draft()
    if lean is not None:
        try:
            check_lean(len(req.tree_tokens), lean)
        except VerificationError as exc:
            raise InvalidRequest(str(exc)) from None
    return req


def verify_outcome_to_proto(outcome: VerifyOutcome) -> verifier_pb2.VerifyOutcome:
    msg = verifier_pb2.VerifyOutcome(
        tokens=to_ints(outcome.tokens, "tokens"),
        accepted_nodes=to_ints(outcome.accepted_nodes, "accepted_nodes"),
        accept_flags=[bool(f) for f in outcome.accept_flags],
        num_drafted=int(outcome.num_drafted),
        committed_len=int(outcome.committed_len),
        forward_seconds=float(outcome.forward_seconds),
        verify_seconds=float(outcome.verify_seconds),
        reused_tokens=int(outcome.reused_tokens),
        cached_tokens=int(outcome.cached_tokens),
        pass_calls=int(outcome.pass_calls),
        pass_rows=None if outcome.pass_rows is None else int(outcome.pass_rows),
        pending_tokens=int(outcome.pending_tokens),
        score_reused=bool(outcome.score_reused),
        text_fallbacks=int(outcome.text_fallbacks),
        draft_rows_needed=to_ints(outcome.draft_rows_needed, "draft_rows_needed"),
        text_pieces=list(outcome.text_pieces),
        text_tails=list(outcome.text_tails),
    )
    if outcome.text_cursor is not None:
        msg.text_cursor.CopyFrom(text_cursor_to_proto(outcome.text_cursor))
    if outcome.features is not None:
        msg.features.CopyFrom(draft_features_to_proto(outcome.features))
    return msg


def verify_outcome_from_proto(msg: verifier_pb2.VerifyOutcome) -> VerifyOutcome:
    return VerifyOutcome(
        tokens=list(msg.tokens),
        accepted_nodes=list(msg.accepted_nodes),
        accept_flags=list(msg.accept_flags),
        num_drafted=msg.num_drafted,
        committed_len=msg.committed_len,
        forward_seconds=msg.forward_seconds,
        verify_seconds=msg.verify_seconds,
        reused_tokens=msg.reused_tokens,
        cached_tokens=msg.cached_tokens,
        pass_calls=msg.pass_calls if msg.HasField("pass_calls") else 1,
        pass_rows=msg.pass_rows if msg.HasField("pass_rows") else None,
        pending_tokens=msg.pending_tokens,
        score_reused=msg.score_reused,
        text_fallbacks=msg.text_fallbacks,
        draft_rows_needed=list(msg.draft_rows_needed),
        text_pieces=list(msg.text_pieces),
        text_tails=list(msg.text_tails),
        text_cursor=text_cursor_from_proto(msg.text_cursor) if msg.HasField("text_cursor") else None,
        features=_optional_features(msg),
    )


def text_cursor_to_proto(cursor: TextCursor) -> verifier_pb2.TextCursor:
    return verifier_pb2.TextCursor(start=int(cursor.start), prefix=int(cursor.prefix), read=int(cursor.read))


def text_cursor_from_proto(msg: verifier_pb2.TextCursor) -> TextCursor:
    """Values as sent; the engine checks them against the session (0 <= start <= prefix <= read <=
    committed length)."""
    return TextCursor(start=msg.start, prefix=msg.prefix, read=msg.read)
