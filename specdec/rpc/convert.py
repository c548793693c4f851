"""Dataclass ⇄ protobuf message conversions: the one place that knows both shapes.

The services and clients are thin because everything about the wire format lives here.
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
    DraftRequest,
    DraftResult,
    InvalidRequest,
    LookaheadBranch,
    LookaheadRequest,
    LookaheadResult,
    ModelInfo,
    ScoreRequest,
    VerifyOutcome,
    VerifyRequest,
)
from specdec.generation import (
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    IterationRecord,
)
from specdec.rpc.v1 import common_pb2, drafter_pb2, generation_pb2, verifier_pb2
from specdec.sampling import SamplingParams
from specdec.trees import sequence_parents
from specdec.verification.base import MethodParams
from specdec.verification.errors import VerificationError
from specdec.verification.lean import check_lean

UINT64_MAX = 2**64 - 1
MAX_TENSOR_DIMS = 8
_F32_LE = np.dtype("<f4")


def _uint64(value: int, name: str) -> int:
    value = int(value)
    if not 0 <= value <= UINT64_MAX:
        raise InvalidRequest(f"{name} must lie in [0, 2**64), got {value}")
    return value


def _ints(values, name: str) -> list[int]:
    """Plain Python ints (protobuf rejects numpy/torch scalars and bools silently coerce)."""
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{name} must be a list of integers: {exc}") from None


# ---------------------------------------------------------------- sampling / method params


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=float(params.temperature), top_k=int(params.top_k), top_p=float(params.top_p)
    )


def sampling_from_proto(msg: common_pb2.SamplingParams, present: bool = True) -> SamplingParams:
    """Unset fields (or an absent message) take the dataclass defaults; ranges are checked there."""
    if not present:
        return SamplingParams()
    defaults = SamplingParams()
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
    )


def method_params_to_proto(params: MethodParams) -> common_pb2.MethodParams:
    return common_pb2.MethodParams(
        a=float(params.a),
        k_max=int(params.k_max),
        seed=_uint64(params.seed, "params.seed"),
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


# ------------------------------------------------------------------------------- model info


def model_info_to_proto(info: ModelInfo) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=info.model_id,
        vocab_size=int(info.vocab_size),
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        max_context=int(info.max_context),
        eos_token_ids=_ints(info.eos_token_ids, "eos_token_ids"),
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
    return drafter_pb2.DraftRequest(
        session_id=req.session_id,
        base_len=int(req.base_len),
        append=_ints(req.append, "append"),
        shape_parents=_ints(req.shape_parents, "shape_parents"),
        sampling=sampling_to_proto(req.sampling),
        seed=_uint64(req.seed, "seed"),
        strategy=req.strategy,
        want_distributions=bool(req.want_distributions),
        include_leaf_rows=bool(req.include_leaf_rows),
    )


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
    )


def draft_result_to_proto(result: DraftResult) -> drafter_pb2.DraftResult:
    msg = drafter_pb2.DraftResult(
        tokens=_ints(result.tokens, "tokens"),
        parents=_ints(result.parents, "parents"),
        forward_seconds=float(result.forward_seconds),
        reused_tokens=int(result.reused_tokens),
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
    )


def lookahead_request_to_proto(req: LookaheadRequest) -> drafter_pb2.LookaheadRequest:
    return drafter_pb2.LookaheadRequest(
        session_id=req.session_id,
        base_len=int(req.base_len),
        append=_ints(req.append, "append"),
        k=int(req.k),
        sampling=sampling_to_proto(req.sampling),
        seed=_uint64(req.seed, "seed"),
        strategy=req.strategy,
        want_distributions=bool(req.want_distributions),
        bonus_guesses=int(req.bonus_guesses),
        rejection_guesses=int(req.rejection_guesses),
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
    )


def lookahead_result_to_proto(result: LookaheadResult) -> drafter_pb2.LookaheadResult:
    msg = drafter_pb2.LookaheadResult(
        forward_seconds=float(result.forward_seconds), reused_tokens=int(result.reused_tokens)
    )
    for branch in result.branches:
        entry = msg.branches.add(
            replaces_last=bool(branch.replaces_last),
            token=int(branch.token),
            tokens=_ints(branch.draft.tokens, "tokens"),
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
                           reused_tokens=msg.reused_tokens)


# ------------------------------------------------------------------------------ score/verify


def score_request_to_proto(req: ScoreRequest) -> verifier_pb2.ScoreRequest:
    return verifier_pb2.ScoreRequest(
        session_id=req.session_id,
        base_len=int(req.base_len),
        append=_ints(req.append, "append"),
        tree_tokens=_ints(req.tree_tokens, "tree_tokens"),
        tree_parents=_ints(req.tree_parents, "tree_parents"),
        sampling=sampling_to_proto(req.sampling),
    )


def score_request_from_proto(msg: verifier_pb2.ScoreRequest) -> ScoreRequest:
    return ScoreRequest(
        session_id=msg.session_id,
        base_len=msg.base_len,
        append=list(msg.append),
        tree_tokens=list(msg.tree_tokens),
        tree_parents=list(msg.tree_parents),
        sampling=sampling_from_proto(msg.sampling, msg.HasField("sampling")),
    )


def verify_request_to_proto(req: VerifyRequest) -> verifier_pb2.VerifyRequest:
    msg = verifier_pb2.VerifyRequest(
        session_id=req.session_id,
        base_len=int(req.base_len),
        append=_ints(req.append, "append"),
        tree_tokens=_ints(req.tree_tokens, "tree_tokens"),
        tree_parents=_ints(req.tree_parents, "tree_parents"),
        method=req.method,
        params=method_params_to_proto(req.params),
        sampling=sampling_to_proto(req.sampling),
    )
    if req.draft_probs is not None:
        msg.draft_probs.CopyFrom(tensor_to_proto(req.draft_probs, "draft_probs"))
    msg.draft_token_probs.extend(float(v) for v in req.draft_token_probs)
    msg.draft_row_indices.extend(_ints(req.draft_row_indices, "draft_row_indices"))
    if req.draft_row_values is not None:
        msg.draft_row_values.CopyFrom(tensor_to_proto(req.draft_row_values, "draft_row_values"))
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
    )
    lean = req.lean_draft()
    if lean is not None:
        try:
            check_lean(len(req.tree_tokens), lean)
        except VerificationError as exc:
            raise InvalidRequest(str(exc)) from None
    return req


def verify_outcome_to_proto(outcome: VerifyOutcome) -> verifier_pb2.VerifyOutcome:
    return verifier_pb2.VerifyOutcome(
        tokens=_ints(outcome.tokens, "tokens"),
        accepted_nodes=_ints(outcome.accepted_nodes, "accepted_nodes"),
        accept_flags=[bool(f) for f in outcome.accept_flags],
        num_drafted=int(outcome.num_drafted),
        committed_len=int(outcome.committed_len),
        forward_seconds=float(outcome.forward_seconds),
        verify_seconds=float(outcome.verify_seconds),
        reused_tokens=int(outcome.reused_tokens),
        extra={str(k): float(v) for k, v in outcome.extra.items()},
        draft_rows_needed=_ints(outcome.draft_rows_needed, "draft_rows_needed"),
    )


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
        extra=dict(msg.extra),
        draft_rows_needed=list(msg.draft_rows_needed),
    )


# -------------------------------------------------------------------------------- generation


def generation_request_to_proto(req: GenerationRequest) -> generation_pb2.GenerationRequest:
    msg = generation_pb2.GenerationRequest(
        max_new_tokens=int(req.max_new_tokens),
        sampling=sampling_to_proto(req.sampling),
        stop=list(req.stop),
        method=req.method,
    )
    if req.prompt is not None:
        msg.prompt = req.prompt
    if req.prompt_ids is not None:
        msg.prompt_ids.SetInParent()
        msg.prompt_ids.ids.extend(_ints(req.prompt_ids, "prompt_ids"))
    if req.stop_token_ids is not None:
        msg.stop_token_ids.SetInParent()
        msg.stop_token_ids.ids.extend(_ints(req.stop_token_ids, "stop_token_ids"))
    if req.seed is not None:
        msg.seed = _uint64(req.seed, "seed")
    if req.k is not None:
        msg.k = int(req.k)
    if req.a is not None:
        msg.a = float(req.a)
    if req.request_id is not None:
        msg.request_id = req.request_id
    if req.tree_budget is not None:
        msg.tree_budget = int(req.tree_budget)
    if req.pipeline is not None:
        msg.pipeline = bool(req.pipeline)
    if req.pipeline_max_k is not None:
        msg.pipeline_max_k = int(req.pipeline_max_k)
    if req.pipeline_bonus_guesses is not None:
        msg.pipeline_bonus_guesses = int(req.pipeline_bonus_guesses)
    if req.pipeline_rejection_guesses is not None:
        msg.pipeline_rejection_guesses = int(req.pipeline_rejection_guesses)
    return msg


def generation_request_from_proto(msg: generation_pb2.GenerationRequest) -> GenerationRequest:
    defaults = GenerationRequest()
    return GenerationRequest(
        prompt=msg.prompt if msg.HasField("prompt") else None,
        prompt_ids=list(msg.prompt_ids.ids) if msg.HasField("prompt_ids") else None,
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else defaults.max_new_tokens,
        sampling=sampling_from_proto(msg.sampling, msg.HasField("sampling")),
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids.ids) if msg.HasField("stop_token_ids") else None,
        seed=msg.seed if msg.HasField("seed") else None,
        method=msg.method if msg.HasField("method") else defaults.method,
        k=msg.k if msg.HasField("k") else None,
        a=msg.a if msg.HasField("a") else None,
        request_id=msg.request_id if msg.HasField("request_id") else None,
        tree_budget=msg.tree_budget if msg.HasField("tree_budget") else None,
        pipeline=msg.pipeline if msg.HasField("pipeline") else None,
        pipeline_max_k=msg.pipeline_max_k if msg.HasField("pipeline_max_k") else None,
        pipeline_bonus_guesses=(
            msg.pipeline_bonus_guesses if msg.HasField("pipeline_bonus_guesses") else None
        ),
        pipeline_rejection_guesses=(
            msg.pipeline_rejection_guesses if msg.HasField("pipeline_rejection_guesses") else None
        ),
    )


def resume_request_to_proto(request_id: str) -> generation_pb2.ResumeRequest:
    return generation_pb2.ResumeRequest(request_id=_resume_id(request_id))


def resume_request_from_proto(msg: generation_pb2.ResumeRequest) -> str:
    """The request_id to resume (an empty one names no request: INVALID_ARGUMENT)."""
    return _resume_id(msg.request_id)


def _resume_id(request_id: str) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequest("request_id: give the id of the stored request to resume")
    return request_id


def generation_stats_to_proto(stats: GenerationStats) -> generation_pb2.GenerationStats:
    return generation_pb2.GenerationStats(
        iterations=int(stats.iterations),
        drafted_iterations=int(stats.drafted_iterations),
        drafted_tokens=int(stats.drafted_tokens),
        accepted_tokens=int(stats.accepted_tokens),
        new_tokens=int(stats.new_tokens),
        seconds=float(stats.seconds),
        draft_seconds=float(stats.draft_seconds),
        verify_seconds=float(stats.verify_seconds),
        overlap_seconds=float(stats.overlap_seconds),
        accepted_per_position=_ints(stats.accepted_per_position, "accepted_per_position"),
        drafted_per_position=_ints(stats.drafted_per_position, "drafted_per_position"),
        fallback_iterations=int(stats.fallback_iterations),
        tokens_per_second=float(stats.tokens_per_second),
        acceptance_rate=float(stats.acceptance_rate),
        pre_drafts_used=int(stats.pre_drafts_used),
        pre_drafts_dropped=int(stats.pre_drafts_dropped),
        pre_draft_bonus_hits=_ints(stats.pre_draft_bonus_hits, "pre_draft_bonus_hits"),
        pre_draft_rejection_hits=_ints(stats.pre_draft_rejection_hits, "pre_draft_rejection_hits"),
    )


def generation_stats_from_proto(msg: generation_pb2.GenerationStats) -> GenerationStats:
    """The derived fields (tokens_per_second, acceptance_rate) are recomputed, not read."""
    return GenerationStats(
        iterations=msg.iterations,
        drafted_iterations=msg.drafted_iterations,
        drafted_tokens=msg.drafted_tokens,
        accepted_tokens=msg.accepted_tokens,
        new_tokens=msg.new_tokens,
        seconds=msg.seconds,
        draft_seconds=msg.draft_seconds,
        verify_seconds=msg.verify_seconds,
        overlap_seconds=msg.overlap_seconds,
        accepted_per_position=list(msg.accepted_per_position),
        drafted_per_position=list(msg.drafted_per_position),
        fallback_iterations=msg.fallback_iterations,
        pre_drafts_used=msg.pre_drafts_used,
        pre_drafts_dropped=msg.pre_drafts_dropped,
        pre_draft_bonus_hits=list(msg.pre_draft_bonus_hits),
        pre_draft_rejection_hits=list(msg.pre_draft_rejection_hits),
    )


def _intervals(intervals) -> list[generation_pb2.Interval]:
    return [generation_pb2.Interval(start=float(start), end=float(end)) for start, end in intervals]


def iteration_record_to_proto(record: IterationRecord) -> generation_pb2.IterationRecord:
    msg = generation_pb2.IterationRecord(
        request_id=record.request_id,
        index=int(record.index),
        position=int(record.position),
        method=record.method,
        k=int(record.k),
        drafted=bool(record.drafted),
        num_drafted=int(record.num_drafted),
        accepted=int(record.accepted),
        emitted=_ints(record.emitted, "emitted"),
        fallback=bool(record.fallback),
        start=float(record.start),
        end=float(record.end),
        draft_intervals=_intervals(record.draft_intervals),
        verify_intervals=_intervals(record.verify_intervals),
        overlap_seconds=float(record.overlap_seconds),
    )
    if record.a is not None:
        msg.a = float(record.a)
    if record.heads is not None:
        msg.heads = int(record.heads)
    return msg


def iteration_record_from_proto(msg: generation_pb2.IterationRecord) -> IterationRecord:
    return IterationRecord(
        request_id=msg.request_id,
        index=msg.index,
        position=msg.position,
        method=msg.method,
        a=msg.a if msg.HasField("a") else None,
        k=msg.k,
        heads=msg.heads if msg.HasField("heads") else None,
        drafted=msg.drafted,
        num_drafted=msg.num_drafted,
        accepted=msg.accepted,
        emitted=list(msg.emitted),
        fallback=msg.fallback,
        start=msg.start,
        end=msg.end,
        draft_intervals=[(i.start, i.end) for i in msg.draft_intervals],
        verify_intervals=[(i.start, i.end) for i in msg.verify_intervals],
        overlap_seconds=msg.overlap_seconds,
    )


def generation_result_to_proto(result: GenerationResult) -> generation_pb2.GenerationResult:
    return generation_pb2.GenerationResult(
        request_id=result.request_id,
        token_ids=_ints(result.token_ids, "token_ids"),
        text=result.text,
        finish_reason=result.finish_reason,
        seed=_uint64(result.seed, "seed"),
        method=result.method,
        stats=generation_stats_to_proto(result.stats),
        iterations=[iteration_record_to_proto(r) for r in result.iterations],
        started_at=float(result.started_at),
    )


def generation_result_from_proto(msg: generation_pb2.GenerationResult) -> GenerationResult:
    return GenerationResult(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        finish_reason=msg.finish_reason,
        seed=msg.seed,
        method=msg.method,
        stats=generation_stats_from_proto(msg.stats),
        iterations=[iteration_record_from_proto(r) for r in msg.iterations],
        started_at=msg.started_at,
    )


def generation_chunk_to_proto(chunk: GenerationChunk) -> generation_pb2.GenerationChunk:
    msg = generation_pb2.GenerationChunk(token_ids=_ints(chunk.token_ids, "token_ids"), text=chunk.text)
    if chunk.result is not None:
        msg.result.CopyFrom(generation_result_to_proto(chunk.result))
    return msg


def generation_chunk_from_proto(msg: generation_pb2.GenerationChunk) -> GenerationChunk:
    return GenerationChunk(
        token_ids=list(msg.token_ids),
        text=msg.text,
        result=generation_result_from_proto(msg.result) if msg.HasField("result") else None,
    )
