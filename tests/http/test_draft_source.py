"""`draft_source`, an extra body field like `method` and `pipeline`: it reaches the GenerationRequest
when it names a source, and anything else is a 400 naming it. No model: the app runs over a backend
that records what it is asked (httpx's ASGI transport, no server)."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import pytest

from orchestrator.openai_http.app import create_app
from orchestrator.openai_http.schemas import ChatCompletionRequest, CompletionRequest
from specdec.defaults import DRAFT_SOURCES
from specdec.generation import GenerationRequest, GenerationResult, GenerationStats

MODEL = "m"


@dataclass
class _Limit:
    max_new_tokens_limit: int = 64


@dataclass
class RecordingBackend:
    """An OpenAIBackend that answers every request with one token and keeps the requests."""

    config: _Limit = field(default_factory=_Limit)
    requests: list[GenerationRequest] = field(default_factory=list)

    async def ensure_serving(self) -> None:
        return None

    async def generate(self, request: GenerationRequest, *, owner: str, caller: str) -> GenerationResult:
        self.requests.append(request)
        return GenerationResult(request_id="r", token_ids=[1], text="t1", finish_reason="length", seed=0,
                                method=request.method or "token", stats=GenerationStats(new_tokens=1))

    def generate_stream(self, request, *, owner, caller):  # not used here
        raise NotImplementedError


async def _post(backend: RecordingBackend, path: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=create_app(backend, served_model_name=MODEL))
    async with httpx.AsyncClient(transport=transport, base_url="http://door") as client:
        return await client.post(path, json={"model": MODEL, **body})


@pytest.mark.parametrize("source", DRAFT_SOURCES)
async def test_a_named_source_reaches_the_request(source) -> None:
    backend = RecordingBackend()
    response = await _post(backend, "/v1/completions", {"prompt": "t1", "max_tokens": 1, "n": 2,
                                                        "draft_source": source, "method": "token"})
    assert response.status_code == 200, response.text
    assert [r.draft_source for r in backend.requests] == [source, source]  # every sample
    chat = await _post(backend, "/v1/chat/completions", {"messages": [{"role": "user", "content": "t1"}],
                                                         "draft_source": source})
    assert chat.status_code == 200, chat.text
    assert backend.requests[-1].draft_source == source and backend.requests[-1].messages


async def test_left_out_or_null_is_the_orchestrators_setting() -> None:
    backend = RecordingBackend()
    for extra in ({}, {"draft_source": None}):
        response = await _post(backend, "/v1/completions", {"prompt": "t1", "max_tokens": 1, **extra})
        assert response.status_code == 200, response.text
    assert [r.draft_source for r in backend.requests] == [None, None]


@pytest.mark.parametrize("value, says", [
    ("ngram", "must be one of hybrid, model, lookup, suffix, got 'ngram'"),
    ("", "must be one of"),
    ("LOOKUP", "got 'LOOKUP'"),  # exact names, as the orchestrator takes them
    (1, "must be a string, got an integer"),
    (True, "must be a string, got a boolean"),
    (["lookup"], "must be a string, got an array"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_anything_else_is_a_400_naming_the_field(path, value, says) -> None:
    backend = RecordingBackend()
    chat = {"messages": [{"role": "user", "content": "t1"}]}
    prompt = {"prompt": "t1"} if path == "/v1/completions" else chat
    response = await _post(backend, path, {**prompt, "draft_source": value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "draft_source" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("draft_source: ") and says in error["message"]
    assert backend.requests == []  # refused before anything ran


def test_the_schemas_map_the_field() -> None:
    completion = CompletionRequest.model_validate({"model": MODEL, "prompt": [1, 2],
                                                   "draft_source": "suffix"})
    assert [r.draft_source for r in completion.generation_requests()] == ["suffix"]
    chat = ChatCompletionRequest.model_validate({"model": MODEL, "draft_source": "lookup",
                                                 "messages": [{"role": "user", "content": "t1"}]})
    assert [r.draft_source for r in chat.generation_requests(8)] == ["lookup"]
