"""OpenAI response bodies: completions, chat completions, their stream chunks, usage and errors.

Plain dicts shaped as the OpenAI API reference gives them (what the `openai` package parses);
the ids are the orchestrator's request ids behind OpenAI's prefixes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from orchestrator.openai_http.schemas import finish_reason
from specdec.generation import GenerationResult

# gRPC status name → (HTTP status, OpenAI error type). The status comes from
# specdec.rpc.status.status_for, so HTTP and gRPC clients see the same refusal.
HTTP_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "conflict_error"),
    "ABORTED": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "FAILED_PRECONDITION": (503, "service_unavailable_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "INTERNAL": (500, "internal_error"),
}


def error_body(message: str, error_type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def usage(results: Sequence[GenerationResult], prompts: int) -> dict[str, Any]:
    """Prompt tokens counted once per distinct prompt (n samples share one), completion tokens summed;
    `prompt_tokens_details.cached_tokens`: of the prompt tokens, those the verifier's prefix cache held."""
    per_prompt = len(results) // max(prompts, 1)
    firsts = results[::per_prompt] if per_prompt else []
    prompt_tokens = sum(r.prompt_tokens for r in firsts)
    cached_tokens = sum(min(r.stats.cached_tokens, r.prompt_tokens) for r in firsts)
    completion_tokens = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(response_id: str, created: int, model: str, results: Sequence[GenerationResult],
               prompts: int) -> dict[str, Any]:
    choices = [{"index": i, "text": r.text, "finish_reason": finish_reason(r.finish_reason), "logprobs": None}
               for i, r in enumerate(results)]
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(results, prompts), "system_fingerprint": None}


def chat_completion(response_id: str, created: int, model: str, results: Sequence[GenerationResult],
                    ) -> dict[str, Any]:
    choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                "finish_reason": finish_reason(r.finish_reason), "logprobs": None}
               for i, r in enumerate(results)]
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(results, 1), "system_fingerprint": None}


class StreamChunks:
    """The `data:` events of one streamed response, completions or chat."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool) -> None:
        self.head = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model}
        self.chat = chat

    def first(self, index: int) -> str:
        """Chat only: the assistant's role, before any content (as OpenAI sends it)."""
        return self._event([{"index": index, "delta": {"role": "assistant", "content": ""},
                             "finish_reason": None, "logprobs": None}])

    def text(self, index: int, text: str, reason: str | None = None) -> str:
        mapped = finish_reason(reason) if reason is not None else None
        if self.chat:
            delta = {"content": text} if text else {}
            return self._event([{"index": index, "delta": delta, "finish_reason": mapped, "logprobs": None}])
        return self._event([{"index": index, "text": text, "finish_reason": mapped, "logprobs": None}])

    def usage(self, results: Sequence[GenerationResult], prompts: int) -> str:
        return self._event([], usage=usage(results, prompts))

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({**self.head, "choices": choices, **extra})


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


DONE = sse("[DONE]")
