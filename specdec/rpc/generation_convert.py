"""Generation messages ⇄ dataclasses (GenerationRequest, …Result, …Chunk, …Stats, ChatMessage), and
the sampling parameters and integer checks they share with the engine messages (specdec.rpc.convert).

Apart from the engine conversions (tensors: torch, numpy) so that the light client (specdec.client)
converts without importing torch. Encoding checks what protobuf would take silently or refuse with an
obscure error (ids that are not integers, seeds beyond uint64), raising InvalidRequest naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from specdec.errors import InvalidRequest
from specdec.generation import (
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    IterationRecord,
    stats_from_values,
    stats_values,
)
from specdec.rpc.v1 import common_pb2, generation_pb2
from specdec.sampling_params import SamplingParams

UINT64_MAX = 2**64 - 1


def to_uint64(value: int, name: str) -> int:
    """`value` as a uint64 field takes it; InvalidRequest naming `name` when out of range."""
    value = int(value)
    if not 0 <= value <= UINT64_MAX:
        raise InvalidRequest(f"{name} must lie in [0, 2**64), got {value}")
    return value


def to_ints(values: Iterable[Any], name: str) -> list[int]:
    """Plain Python ints (protobuf rejects numpy/torch scalars and bools silently coerce)."""
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{name} must be a list of integers: {exc}") from None


# ------------------------------------------------------------------------------- sampling


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


# -------------------------------------------------------------------------------- generation


def generation_request_to_proto(req: GenerationRequest) -> generation_pb2.GenerationRequest:
    msg = generation_pb2.GenerationRequest(
        max_new_tokens=int(req.max_new_tokens),
        sampling=sampling_to_proto(req.sampling),
        stop=list(req.stop),
    )
    if req.method is not None:  # unset: the orchestrator's default method
        msg.method = req.method
    if req.prompt is not None:
        msg.prompt = req.prompt
    if req.prompt_ids is not None:
        msg.prompt_ids.SetInParent()
        msg.prompt_ids.ids.extend(to_ints(req.prompt_ids, "prompt_ids"))
    if req.stop_token_ids is not None:
        msg.stop_token_ids.SetInParent()
        msg.stop_token_ids.ids.extend(to_ints(req.stop_token_ids, "stop_token_ids"))
    if req.seed is not None:
        msg.seed = to_uint64(req.seed, "seed")
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
    if req.messages is not None:
        msg.messages.extend(chat_messages_to_proto(req.messages))
    if req.draft_source is not None:
        msg.draft_source = req.draft_source
    if req.cache_salt is not None:
        msg.cache_salt = req.cache_salt
    return msg


def chat_messages_to_proto(messages: list[ChatMessage]) -> list[common_pb2.ChatMessage]:
    return [common_pb2.ChatMessage(role=m.role, content=m.content) for m in messages]


def chat_messages_from_proto(messages: Iterable[common_pb2.ChatMessage]) -> list[ChatMessage]:
    return [ChatMessage(role=m.role, content=m.content) for m in messages]


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
        method=msg.method if msg.HasField("method") else None,
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
        messages=chat_messages_from_proto(msg.messages) if msg.messages else None,
        draft_source=msg.draft_source if msg.HasField("draft_source") else None,
        cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None,
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
    """Every stored field by name (specdec.generation.stats_values), plus the derived rates."""
    values = stats_values(stats)
    sources = values.pop("sources")
    plain = {name: to_ints(v, name) if isinstance(v, list) else v for name, v in values.items()}
    return generation_pb2.GenerationStats(
        **plain,
        tokens_per_second=float(stats.tokens_per_second),
        acceptance_rate=float(stats.acceptance_rate),
        sources={name: generation_pb2.SourceStats(**counts) for name, counts in sources.items()},
    )


def generation_stats_from_proto(msg: generation_pb2.GenerationStats) -> GenerationStats:
    """The derived fields (tokens_per_second, acceptance_rate) are recomputed, not read."""
    return stats_from_values(stats_values(msg))


def _intervals(intervals: Iterable[tuple[float, float]]) -> list[generation_pb2.Interval]:
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
        emitted=to_ints(record.emitted, "emitted"),
        fallback=bool(record.fallback),
        start=float(record.start),
        end=float(record.end),
        draft_intervals=_intervals(record.draft_intervals),
        verify_intervals=_intervals(record.verify_intervals),
        overlap_seconds=float(record.overlap_seconds),
        source=record.source,
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
        source=msg.source,
    )


def generation_result_to_proto(result: GenerationResult) -> generation_pb2.GenerationResult:
    return generation_pb2.GenerationResult(
        request_id=result.request_id,
        token_ids=to_ints(result.token_ids, "token_ids"),
        text=result.text,
        finish_reason=result.finish_reason,
        seed=to_uint64(result.seed, "seed"),
        method=result.method,
        stats=generation_stats_to_proto(result.stats),
        iterations=[iteration_record_to_proto(r) for r in result.iterations],
        started_at=float(result.started_at),
        prompt_tokens=int(result.prompt_tokens),
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
        prompt_tokens=msg.prompt_tokens,
    )


def generation_chunk_to_proto(chunk: GenerationChunk) -> generation_pb2.GenerationChunk:
    msg = generation_pb2.GenerationChunk(token_ids=to_ints(chunk.token_ids, "token_ids"), text=chunk.text)
    if chunk.result is not None:
        msg.result.CopyFrom(generation_result_to_proto(chunk.result))
    return msg


def generation_chunk_from_proto(msg: generation_pb2.GenerationChunk) -> GenerationChunk:
    return GenerationChunk(
        token_ids=list(msg.token_ids),
        text=msg.text,
        result=generation_result_from_proto(msg.result) if msg.HasField("result") else None,
    )
