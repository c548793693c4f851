"""A request's run: the request checked and resolved into run state, the run's timeline of
service calls, and the round trip through the store (a resumed request starts a new run from its
stored record)."""

from __future__ import annotations

import math
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from orchestrator import scheduling
from orchestrator.accounting import stats_dict
from orchestrator.config import OrchestratorConfig
from orchestrator.intervals import overlap
from orchestrator.store import RequestRecord
from specdec.engine.api import InvalidRequest, ModelInfo
from specdec.generation import GenerationRequest, GenerationResult, GenerationStats, IterationRecord
from specdec.methods import METHOD_NAMES, METHODS, Method, get_method
from specdec.rpc.security import ANONYMOUS
from specdec.sampling import SamplingParams

if TYPE_CHECKING:
    from orchestrator.adaptation import DraftLength
    from orchestrator.pipeline import PreDraft
    from orchestrator.tracing import IterationProbe, RequestProbe

T = TypeVar("T")
MAX_GUESSES = 16  # per kind, per look-ahead (the drafter engine's limit)
CallKind = Literal["draft", "verify"]


@dataclass
class Run:
    """State of one run of a request (a resumed request starts a new run)."""

    request_id: str
    session_id: str
    prompt_ids: list[int]
    generated: list[int]
    method: str
    k: int
    a: float | None
    tree_budget: int | None
    sampling: SamplingParams
    max_new_tokens: int
    stop: list[str]
    stop_ids: frozenset[int]
    seed: int
    stats: GenerationStats
    rank_acceptance: list[float]
    iterations: list[IterationRecord] = field(default_factory=list)
    calibration: Counter = field(default_factory=Counter)
    finish_reason: str | None = None
    text: str = ""
    text_sent: int = 0
    perf0: float = field(default_factory=time.perf_counter)
    epoch0: float = field(default_factory=time.time)
    probe: RequestProbe | None = None  # the observer's probe of this run (tracing, metrics), if any
    pipeline: bool = False
    pipeline_max_k: int = 0  # > 0: adaptive pre-draft length where the method allows it (pipeline.py)
    bonus_guesses: int | None = None  # None: automatic by block length (pipeline.bonus_guesses)
    rejection_guesses: int = 0
    predraft: PreDraft | None = None  # the next block, drafted while the last one was verified
    adaptive: bool = False  # k is re-picked every iteration (orchestrator.adaptation)
    draft_length: DraftLength | None = None  # the adaptive request's chooser (set on its first iteration)
    owner: str = ANONYMOUS  # the identity the request's record is bound to (RequestRecord.owner)
    chat: bool = False  # the prompt came from a chat template (GenerationRequest.messages)

    @property
    def committed(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def spec(self) -> Method:
        """The method's registry record (what it drafts, whether it pipelines, …)."""
        return get_method(self.method)

    def epoch(self, perf: float) -> float:
        return self.epoch0 + (perf - self.perf0)

    def params(self) -> dict[str, Any]:
        """The request's resolved knobs as JSON (what `resume` needs to continue identically)."""
        return {
            "method": self.method,
            "k": self.k,
            "a": self.a,
            "tree_budget": self.tree_budget,
            "max_new_tokens": self.max_new_tokens,
            "sampling": asdict(self.sampling),
            "stop": list(self.stop),
            "stop_token_ids": sorted(self.stop_ids),
            "rank_acceptance": list(self.rank_acceptance),
            "pipeline": self.pipeline,
            "pipeline_max_k": self.pipeline_max_k,
            "bonus_guesses": self.bonus_guesses,
            "rejection_guesses": self.rejection_guesses,
            "adaptive": self.adaptive,
            "chat": self.chat,
        }

    def to_record(self, status: str, error: str | None = None) -> RequestRecord:
        return RequestRecord(
            request_id=self.request_id,
            status=status,
            prompt_ids=self.prompt_ids,
            token_ids=self.generated,
            params=self.params(),
            seed=self.seed,
            stats=stats_dict(self.stats),
            finish_reason=self.finish_reason if status == "done" else None,
            text=self.text,
            error=error,
            owner=self.owner,
            holder=self.session_id,  # this run writes the record (RequestRecord.holder)
        )

    @classmethod
    def from_record(cls, record: RequestRecord) -> Run:
        """A new run that continues a stored request from its stored tokens (with a new session)."""
        p = record.params
        return cls(
            request_id=record.request_id,
            session_id=new_session_id(record.request_id),
            prompt_ids=list(record.prompt_ids),
            generated=list(record.token_ids),
            method=p["method"],
            k=p["k"],
            a=p["a"],
            tree_budget=p["tree_budget"],
            sampling=SamplingParams(**p["sampling"]),
            max_new_tokens=p["max_new_tokens"],
            stop=list(p["stop"]),
            stop_ids=frozenset(p["stop_token_ids"]),
            seed=record.seed,
            stats=GenerationStats(**record.stats) if record.stats else GenerationStats(),
            rank_acceptance=list(p["rank_acceptance"]),
            pipeline=bool(p.get("pipeline", False)),
            pipeline_max_k=int(p.get("pipeline_max_k", 0)),
            bonus_guesses=p.get("bonus_guesses", 1),  # runs stored before guesses existed had one
            rejection_guesses=int(p.get("rejection_guesses", 0)),
            adaptive=bool(p.get("adaptive", False)),
            chat=bool(p.get("chat", False)),
            owner=record.owner,
        )

    def result(self) -> GenerationResult:
        return GenerationResult(
            request_id=self.request_id,
            token_ids=list(self.generated),
            text=self.text,
            finish_reason=self.finish_reason or "length",
            seed=self.seed,
            method=self.method,
            stats=self.stats,
            iterations=list(self.iterations),
            started_at=self.epoch0,
            prompt_tokens=len(self.prompt_ids),
        )


def new_session_id(request_id: str) -> str:
    """A fresh session per run: a resumed request never shares caches with its dead predecessor."""
    return f"{request_id}/{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------------------------------------
# a request becomes a run


def check_request(request: GenerationRequest, config: OrchestratorConfig, target: ModelInfo) -> str:
    """Refuse a request with an InvalidRequest that names the field; returns its method.

    Sizes come first, each read in constant time or bounded by its limit (config: max_prompt_bytes,
    max_request_id_chars, max_stop_strings, …), so an oversized request costs nothing further.
    """
    _check_request_id(request.request_id, config.max_request_id_chars)
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
    if request.a is not None and not (
        isinstance(request.a, (int, float)) and math.isfinite(request.a) and 0.0 <= request.a <= 1.0
    ):
        raise InvalidRequest(f"a must lie in [0, 1], got {request.a!r}")
    if request.a is not None and not spec.coins:
        users = " and ".join(name for name in METHOD_NAMES if get_method(name).coins)
        raise InvalidRequest(f"a: only {users} uses a; leave it unset for method {method}")
    if not isinstance(request.sampling, SamplingParams):  # its own constructor checks the ranges
        raise InvalidRequest("sampling must be a SamplingParams")
    if any(not isinstance(s, str) or not s for s in stop):
        raise InvalidRequest("stop strings must be non-empty strings")
    longest = max(map(len, stop), default=0)
    if longest > config.max_stop_chars:
        raise InvalidRequest(f"stop: a stop string of {longest} characters; at most {config.max_stop_chars} "
                             "are allowed")
    _check_ids("stop_token_ids", _stop_ids(request, target), target.vocab_size)
    if request.pipeline is not None and not isinstance(request.pipeline, bool):
        raise InvalidRequest(f"pipeline must be a boolean or None, got {request.pipeline!r}")
    _check_range("pipeline_max_k", request.pipeline_max_k, config.max_k, low=0)
    _check_range("pipeline_bonus_guesses", request.pipeline_bonus_guesses, MAX_GUESSES)
    _check_range("pipeline_rejection_guesses", request.pipeline_rejection_guesses, MAX_GUESSES, low=0)
    if request.seed is not None and not isinstance(request.seed, int):
        raise InvalidRequest(f"seed must be an integer, got {request.seed!r}")
    return method


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


def _check_request_id(request_id: str | None, limit: int) -> None:
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


def new_run(
    request: GenerationRequest, *, method: str, prompt_ids: list[int], rank_acceptance: list[float],
    config: OrchestratorConfig, target: ModelInfo,
) -> Run:
    """The run of a checked request: its knobs resolved against the configuration."""
    request_id = request.request_id or uuid.uuid4().hex
    return Run(
        request_id=request_id,
        session_id=new_session_id(request_id),
        prompt_ids=prompt_ids,
        generated=[],
        method=method,
        k=request.k if request.k is not None else scheduling.default_k(method, config),
        a=(float(_pick(request.a, config.default_a)) if get_method(method).coins else None),
        tree_budget=scheduling.tree_budget_for(method, request.k, request.tree_budget, config),
        sampling=request.sampling,
        max_new_tokens=request.max_new_tokens,
        stop=list(request.stop or []),
        stop_ids=frozenset(int(t) for t in _stop_ids(request, target)),
        seed=request.seed if request.seed is not None else secrets.randbits(63),
        stats=GenerationStats(),
        rank_acceptance=rank_acceptance,
        pipeline=_pick(request.pipeline, config.pipeline),
        pipeline_max_k=min(config.max_k, _pick(request.pipeline_max_k, config.pipeline_max_k)),
        bonus_guesses=_pick(request.pipeline_bonus_guesses, config.pipeline_bonus_guesses),
        rejection_guesses=_pick(request.pipeline_rejection_guesses, config.pipeline_rejection_guesses),
        adaptive=(config.adaptive_k and request.k is None and request.seed is None
                  and request.tree_budget is None and adaptable(method, config)),
        chat=bool(request.messages),
    )


def adaptable(method: str, config: OrchestratorConfig) -> bool:
    """Whether the method's draft length can be picked online: a plain sequence draft (token, block,
    ersd without a tree budget); RD's coins and tree budgets have their own knobs."""
    spec = get_method(method)
    return (spec.speculative and spec.drafts_sequences and not spec.coins
            and scheduling.tree_budget_for(method, None, None, config) is None)


def _stop_ids(request: GenerationRequest, target: ModelInfo) -> Sequence[int]:
    return target.eos_token_ids if request.stop_token_ids is None else tuple(request.stop_token_ids)


def _pick(value: T | None, default: T) -> T:
    return default if value is None else value


def _check_range(name: str, value: int | None, limit: int, low: int = 1) -> None:
    if value is not None and (not isinstance(value, int) or not low <= value <= limit):
        raise InvalidRequest(f"{name} must lie in {low}..{limit}, got {value!r}")


def _check_ids(name: str, ids: Sequence[int], vocab: int) -> None:
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"{name}: token ids {bad[:8]} lie outside the vocabulary [0, {vocab})")


# ------------------------------------------------------------------------------------------------
# the timeline of an iteration's calls


class Timeline:
    """Real start/end of every drafter and verifier call of one iteration."""

    def __init__(self, probe: IterationProbe | None = None) -> None:
        self.draft: list[tuple[float, float]] = []
        self.verify: list[tuple[float, float]] = []
        self.probe = probe  # the observer's probe of the iteration (a span per call), if any

    async def timed(self, kind: CallKind, call: Awaitable[T], op: str | None = None) -> T:
        probe = self.probe
        start = time.perf_counter()
        token = probe.call_started(kind, op or kind, start) if probe is not None else None
        error: BaseException | None = None
        try:
            return await call
        except BaseException as exc:
            error = exc
            raise
        finally:
            end = time.perf_counter()
            (self.draft if kind == "draft" else self.verify).append((start, end))
            if probe is not None:
                probe.call_finished(token, end, error)

    def draft_seconds(self) -> float:
        return sum(end - start for start, end in self.draft)

    def verify_seconds(self) -> float:
        return sum(end - start for start, end in self.verify)

    def overlap_seconds(self) -> float:
        return overlap(self.draft, self.verify)
