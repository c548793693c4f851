"""The OpenAI request bodies this server accepts, and how each becomes GenerationRequests.

Standard fields (`max_tokens`, `temperature`, `top_p`, `n`, `stop`, `seed`, `stream`) keep the OpenAI
meaning. Extra body fields, as vLLM takes them (`extra_body=` in the `openai` package): `top_k`,
`ignore_eos`, `cache_salt`, and the speculative knobs `method`, `k`, `a`, `pipeline`, `draft_source`.
Fields that would change the distribution the output is drawn from (penalties, logit_bias) or need what the
service does not compute (logprobs, echo, tools) are refused with a 400 naming the field, never
silently ignored; unknown fields are ignored, as OpenAI-compatible servers do.

Types are strict where vLLM and OpenAI are: an integer field takes a JSON integer (or a number
without a fraction), never a string or a boolean; a number field takes a finite JSON number; a
boolean field takes true or false; `draft_source` one of DRAFT_SOURCES' names. pydantic's lax mode
would read `"10"` as 10 and `true` as 1.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Field, Strict
from pydantic_core import PydanticCustomError

from specdec.defaults import DRAFT_SOURCES
from specdec.errors import InvalidRequest
from specdec.generation import CHAT_ROLES, ChatMessage, GenerationRequest
from specdec.sampling import SamplingParams

# At most this many completions (prompts x n) in one HTTP request: each holds a request slot.
MAX_CHOICES = 16
# `max_tokens` left out of a completions request: OpenAI's default for /v1/completions.
DEFAULT_COMPLETION_TOKENS = 16
# top_k travels as a protobuf int32 to the engines: larger is refused here, naming the field.
MAX_TOP_K = 2**31 - 1


def json_kind(value: Any) -> str:
    """A value's JSON type, for messages ("got a string")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    kinds = ((str, "a string"), (int, "an integer"), (float, "a number"), (list, "an array"),
             (dict, "an object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def _json_integer(value: Any) -> Any:
    """Only numbers reach int parsing (which refuses a fraction): not "10", not true."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticCustomError("int_type", "must be an integer, got {kind}", {"kind": json_kind(value)})
    if isinstance(value, float) and value.is_integer():
        return int(value)  # 1e20 is an integer too; pydantic would call it "exceeded maximum size"
    return value


def _json_number(value: Any) -> Any:
    """Only numbers reach float parsing: not "0.5", not true."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticCustomError("float_type", "must be a number, got {kind}", {"kind": json_kind(value)})
    return value


def _draft_source(value: Any) -> Any:
    """A name among DRAFT_SOURCES (null: the orchestrator's setting); anything else names the field."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise PydanticCustomError("string_type", "must be a string, got {kind}", {"kind": json_kind(value)})
    if value not in DRAFT_SOURCES:
        got = repr(value if len(value) <= 40 else value[:40] + "…")  # a body's string, echoed short
        raise PydanticCustomError("draft_source", "must be one of {choices}, got {got}",
                                  {"choices": ", ".join(DRAFT_SOURCES), "got": got})
    return value


JsonInt = Annotated[int, BeforeValidator(_json_integer)]
JsonFloat = Annotated[float, BeforeValidator(_json_number), AllowInfNan(False)]
JsonBool = Annotated[bool, Strict()]
DraftSource = Annotated[str | None, BeforeValidator(_draft_source)]


class StreamOptions(BaseModel):
    include_usage: JsonBool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: JsonInt | None = Field(None, ge=1)
    temperature: JsonFloat | None = Field(None, ge=0.0)
    top_p: JsonFloat | None = Field(None, gt=0.0, le=1.0)
    n: JsonInt = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: JsonInt | None = Field(None, ge=0, lt=2**64)
    stream: JsonBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: JsonFloat | None = None
    frequency_penalty: JsonFloat | None = None
    logit_bias: dict[str, JsonFloat] | None = None
    # extra body fields (vLLM's convention for what OpenAI has no field for); None (or an empty
    # method) leaves method, k, a, pipeline and draft_source to the orchestrator's settings
    top_k: JsonInt | None = Field(None, ge=-1, le=MAX_TOP_K)
    ignore_eos: JsonBool = False
    method: str | None = None
    k: JsonInt | None = Field(None, ge=0)
    a: JsonFloat | None = None
    pipeline: JsonBool | None = None
    draft_source: DraftSource = None
    # vLLM's prefix-cache salt: requests share cached prompt blocks only with the same caller and salt
    # (checked by orchestrator.request_checks.check_cache_salt).
    cache_salt: Annotated[str, Strict()] | None = None

    def refuse_unsupported(self) -> None:
        """A 400 for a field that would change what is sampled, or asks for what is not computed."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidRequest(f"{name}: penalties are not supported (the output follows the target "
                                     "model's own distribution exactly)")
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported (the output follows the target model's own "
                                 "distribution exactly)")

    def generation_request(self, max_tokens: int | None, **prompt: Any) -> GenerationRequest:
        """The GenerationRequest of one prompt (the i-th of n samples varies only its seed)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerationRequest(
            **prompt,
            max_new_tokens=max_tokens if max_tokens is not None else GenerationRequest.max_new_tokens,
            sampling=SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=max(self.top_k or 0, 0),  # vLLM's -1 means off, as 0 does here
                top_p=1.0 if self.top_p is None else self.top_p),
            stop=stop, stop_token_ids=[] if self.ignore_eos else None, seed=self.seed,
            method=self.method or None, k=self.k, a=self.a, pipeline=self.pipeline,
            draft_source=self.draft_source, cache_salt=self.cache_salt)


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[JsonInt] | list[str | list[JsonInt]]
    echo: JsonBool = False
    logprobs: JsonInt | None = None
    best_of: JsonInt | None = None
    suffix: str | None = None

    def prompts(self) -> list[dict[str, Any]]:
        """The prompts as GenerationRequest fields: one text or id list each (a batch is a list of them)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [{"prompt": prompt}]
        if not prompt:
            raise InvalidRequest("prompt: the prompt is empty")
        if all(isinstance(item, int) for item in prompt):
            return [{"prompt_ids": list(prompt)}]
        return [{"prompt": item} if isinstance(item, str) else {"prompt_ids": list(item)} for item in prompt]

    def generation_requests(self) -> list[GenerationRequest]:
        self.refuse_unsupported()
        if self.echo:
            raise InvalidRequest("echo is not supported")
        if self.logprobs is not None:
            raise InvalidRequest("logprobs is not supported")
        if self.suffix:
            raise InvalidRequest("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of: only best_of = n is supported (no ranking by logprobs)")
        max_tokens = self.max_tokens if self.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        return _samples([self.generation_request(max_tokens, **prompt) for prompt in self.prompts()], self.n)


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ChatContentPart] | None = None

    def as_message(self, index: int) -> ChatMessage:
        if self.role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{index}].role: {self.role!r} is not one of "
                                 f"{', '.join(CHAT_ROLES)}")
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise InvalidRequest(f"messages[{index}].content: only text parts are supported")
            content = "".join(part.text or "" for part in content)
        return ChatMessage(role=self.role, content=content or "")


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions. Without max_tokens a chat runs to the end of the assistant's turn (or
    the orchestrator's max_new_tokens_limit)."""

    messages: list[ChatMessageIn]
    max_completion_tokens: JsonInt | None = Field(None, ge=1)
    logprobs: JsonBool | None = None
    top_logprobs: JsonInt | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def generation_requests(self, default_max_tokens: int) -> list[GenerationRequest]:
        self.refuse_unsupported()
        if self.logprobs or self.top_logprobs:
            raise InvalidRequest(f"{'logprobs' if self.logprobs else 'top_logprobs'} is not supported")
        if self.tools:
            raise InvalidRequest("tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequest("response_format: only {\"type\": \"text\"} is supported")
        if not self.messages:
            raise InvalidRequest("messages: the chat is empty")
        messages = [message.as_message(index) for index, message in enumerate(self.messages)]
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return _samples([self.generation_request(max_tokens, messages=messages)], self.n)


def _samples(requests: list[GenerationRequest], n: int) -> list[GenerationRequest]:
    """n samples of each prompt, in OpenAI's choice order; sample j of a seeded request uses seed + j."""
    if len(requests) * n > MAX_CHOICES:
        raise InvalidRequest(f"n: {len(requests)} prompt(s) x n = {n} is {len(requests) * n} completions; "
                             f"at most {MAX_CHOICES} are allowed in one request")
    samples = []
    for request in requests:
        for j in range(n):
            seed = None if request.seed is None else (request.seed + j) % 2**64
            samples.append(GenerationRequest(**{**request.__dict__, "seed": seed}))
    return samples


# What the orchestrator's checks call a field the HTTP body names otherwise.
_PARAM_ALIASES = {"max_new_tokens": "max_tokens", "prompt_ids": "prompt"}
# A message that names its field first: "n: …", "top_k must …", "echo is not supported",
# "messages[0].role: …".
_FIELD_FIRST = re.compile(r"([A-Za-z_]\w*)((?:\[\d+\]|\.[A-Za-z_]\w*)*)(?=:| must | is | are )")


def param_of(message: str, *, chat: bool) -> str | None:
    """The body field a refusal's message names first (OpenAI's error `param`), if it is one."""
    match = _FIELD_FIRST.match(message)
    if match is None:
        return None
    root = _PARAM_ALIASES.get(match[1], match[1])
    if chat and root == "prompt":  # a chat's prompt is its messages
        root = "messages"
    fields = (ChatCompletionRequest if chat else CompletionRequest).model_fields
    return root + match[2] if root in fields else None


FinishReason = Literal["stop", "length"]


def finish_reason(reason: str) -> FinishReason:
    """OpenAI's spelling: the end of the model's turn and a stop string are both "stop"."""
    return "length" if reason == "length" else "stop"
