"""A request's checks before any work: every size and range, each refused with an InvalidRequest
that names the field (the caps are OrchestratorConfig's)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from orchestrator.config import OrchestratorConfig
from orchestrator.run import stop_ids
from specdec.defaults import DRAFT_SOURCES, DraftSource
from specdec.engine.api import MAX_LOOKAHEAD_GUESSES, ModelInfo
from specdec.errors import InvalidRequest
from specdec.generation import GenerationRequest
from specdec.methods import (
    DETERMINISTIC_METHOD_NAMES,
    METHOD_NAMES,
    METHODS,
    check_drafting_probability,
    get_method,
)
from specdec.sampling import SamplingParams
from specdec.verification.errors import VerificationError


def check_request(request: GenerationRequest, config: OrchestratorConfig, target: ModelInfo, *,
                  has_drafter: bool = True, sources: Collection[str] = DRAFT_SOURCES) -> str:
    """Refuse a request with an InvalidRequest that names the field; returns its method. `sources`: the
    draft sources the orchestrator can build (orchestrator.drafting.PROPOSERS).

    Sizes come first, each read in constant time or bounded by its limit (config: max_prompt_bytes,
    max_request_id_chars, max_stop_strings, …), so an oversized request costs nothing further.
    """
    check_request_id(request.request_id, config.max_request_id_chars)
    _check_prompt_size(request, config, target)
    stop = request.stop or []
    _check_count("stop", stop, config.max_stop_strings, "stop strings")
    if request.stop_token_ids is not None:
        _check_count("stop_token_ids", request.stop_token_ids, config.max_stop_token_ids, "ids")
    method = request.method or config.default_method
    if method not in METHODS:
        raise InvalidRequest(f"method: unknown method {method!r}; choose one of {', '.join(METHOD_NAMES)}")
    spec = get_method(method)
    _check_range("max_new_tokens", request.max_new_tokens, config.max_new_tokens_limit)
    _check_range("k", request.k, config.max_tree_budget if spec.k_is_tree_budget else config.max_k)
    _check_range("tree_budget", request.tree_budget, config.max_tree_budget)
    if request.a is not None:
        try:
            check_drafting_probability(request.a)
        except VerificationError as exc:
            raise InvalidRequest(f"a: {exc}") from None
    if request.a is not None and not spec.takes_a:
        users = " and ".join(name for name in METHOD_NAMES if get_method(name).takes_a)
        raise InvalidRequest(f"a: only {users} uses a; leave it unset for method {method}")
    if not isinstance(request.sampling, SamplingParams):  # its own constructor checks the ranges
        raise InvalidRequest("sampling must be a SamplingParams")
    if any(not isinstance(s, str) or not s for s in stop):
        raise InvalidRequest("stop strings must be non-empty strings")
    longest = max(map(len, stop), default=0)
    if longest > config.max_stop_chars:
        raise InvalidRequest(f"stop: a stop string of {longest} characters; at most {config.max_stop_chars} "
                             "are allowed")
    _check_ids("stop_token_ids", stop_ids(request, target), target.vocab_size)
    if request.pipeline is not None and not isinstance(request.pipeline, bool):
        raise InvalidRequest(f"pipeline must be a boolean or None, got {request.pipeline!r}")
    _check_range("pipeline_max_k", request.pipeline_max_k, config.max_k, low=0)
    guesses = MAX_LOOKAHEAD_GUESSES
    _check_range("pipeline_bonus_guesses", request.pipeline_bonus_guesses, guesses)
    _check_range("pipeline_rejection_guesses", request.pipeline_rejection_guesses, guesses, low=0)
    if request.seed is not None and not isinstance(request.seed, int):
        raise InvalidRequest(f"seed must be an integer, got {request.seed!r}")
    _check_draft_source(request.draft_source, method, has_drafter=has_drafter, sources=sources)
    check_cache_salt(request.cache_salt)
    return method


# A cache salt names a partition of the engines' prefix caches: any printable text up to this long.
MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: object) -> None:
    """None, or a non-empty string of at most MAX_CACHE_SALT_CHARS printable characters (a salt
    travels to both engines with every call: nothing unbounded or unprintable goes)."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise InvalidRequest("cache_salt must be a non-empty string (or unset)")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt: {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS} are "
                             "allowed")
    if not salt.isprintable():
        raise InvalidRequest("cache_salt must hold printable characters only")


def _check_draft_source(source: object, method: str, *, has_drafter: bool, sources: Collection[str]) -> None:
    """A named draft source exists, has an exact rule under the method, and has its drafter."""
    if source is None:
        return
    if source not in sources:
        raise InvalidRequest(f"draft_source: unknown source {source!r}; choose one of {', '.join(sources)}")
    spec = get_method(method)
    if source != DraftSource.MODEL and not spec.takes_deterministic_drafts:
        raise InvalidRequest(
            f"draft_source {source!r} with method {method!r}: {method} has no exact rule for model-free "
            f"drafts (docs/algorithms.md §15); use draft_source 'model', or a method among "
            f"{', '.join(DETERMINISTIC_METHOD_NAMES)}"
        )
    if source == DraftSource.MODEL and not has_drafter:
        raise InvalidRequest("draft_source 'model': this deployment runs without a draft model; choose one "
                             f"of {', '.join(s for s in sources if s != DraftSource.MODEL)}")


def check_prompt(prompt_ids: Sequence[int], target: ModelInfo) -> None:
    _check_prompt_tokens(len(prompt_ids), target)  # first: constant time
    _check_ids("prompt_ids", prompt_ids, target.vocab_size)


def _check_prompt_tokens(count: int, target: ModelInfo) -> None:
    if target.max_context and count >= target.max_context:
        raise InvalidRequest(
            f"prompt: {count} tokens leave no room in the target's context window of "
            f"{target.max_context} tokens"
        )


def _check_prompt_size(request: GenerationRequest, config: OrchestratorConfig, target: ModelInfo) -> None:
    """Prompt ids beyond the context window, or a text over max_prompt_bytes, before any work on them
    (the text is encoded only when its characters alone cannot tell)."""
    if request.prompt_ids is not None:
        _check_prompt_tokens(len(request.prompt_ids), target)
    if request.messages is not None:
        _check_chat(request, config)
    text, limit = request.prompt, config.max_prompt_bytes
    if not isinstance(text, str) or len(text) * 4 <= limit:  # at most 4 UTF-8 bytes a character
        return
    exact = text.isascii() or len(text) <= limit  # isascii is O(1); encode only a text that may pass
    size = len(text.encode("utf-8", "surrogatepass")) if exact and not text.isascii() else len(text)
    if size > limit:
        raise InvalidRequest(f"prompt: {'' if exact else 'at least '}{size} UTF-8 bytes; at most {limit} "
                             "are allowed (max_prompt_bytes)")


def _check_chat(request: GenerationRequest, config: OrchestratorConfig) -> None:
    """A chat is the only prompt, within max_chat_messages turns of string contents that together
    stay within max_prompt_bytes (the roles are checked where the template is: the verifier)."""
    messages = request.messages or []
    if request.prompt is not None or request.prompt_ids is not None:
        raise InvalidRequest("messages: give a chat, prompt text or prompt_ids, only one of them")
    if not messages:
        raise InvalidRequest("messages: the chat is empty")
    _check_count("messages", messages, config.max_chat_messages, "messages")
    size = 0
    for index, message in enumerate(messages):
        if not isinstance(getattr(message, "role", None), str) or not isinstance(
                getattr(message, "content", None), str):
            raise InvalidRequest(f"messages[{index}]: a message needs a string role and a string content")
        size += len(message.content)  # characters: a lower bound of the bytes, exact for ASCII
        if size > config.max_prompt_bytes:
            raise InvalidRequest(f"messages: more than {config.max_prompt_bytes} characters in all; at most "
                                 f"{config.max_prompt_bytes} UTF-8 bytes are allowed (max_prompt_bytes)")


def check_request_id(request_id: str | None, limit: int) -> None:
    """A request_id's type, length (before anything else reads it) and characters; empty: none given."""
    if not request_id:
        return  # a fresh id is made
    if not isinstance(request_id, str):
        raise InvalidRequest(f"request_id must be a string, got {type(request_id).__name__}")
    if len(request_id) > limit:
        raise InvalidRequest(f"request_id: {len(request_id)} characters; at most {limit} are allowed")
    if not all("!" <= ch <= "~" for ch in request_id):
        raise InvalidRequest("request_id: only printable ASCII characters without spaces are allowed")


def _check_count(name: str, values: Sequence[Any], limit: int, what: str) -> None:
    if len(values) > limit:
        raise InvalidRequest(f"{name}: {len(values)} {what}; at most {limit} are allowed")


def _check_range(name: str, value: int | None, limit: int, low: int = 1) -> None:
    if value is not None and (not isinstance(value, int) or not low <= value <= limit):
        raise InvalidRequest(f"{name} must lie in {low}..{limit}, got {value!r}")


def _check_ids(name: str, ids: Sequence[int], vocab: int) -> None:
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"{name}: token ids {bad[:8]} lie outside the vocabulary [0, {vocab})")
