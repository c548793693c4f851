"""A request's run: its settings (what the stored record keeps, fixed for the run), its state (what
the loop produces) and the round trip through the store (a resumed request starts a new run).

Who writes what: RunSettings is frozen. RunState is written by the loop (tokens, text, finish,
statistics); a drafting strategy keeps its own fields on itself (orchestrator.drafting).
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from orchestrator import scheduling
from orchestrator.config import OrchestratorConfig
from orchestrator.records import RequestRecord
from specdec.defaults import ANONYMOUS, DraftSource
from specdec.engine.api import ModelInfo, TextCursor
from specdec.generation import (
    ChatMessage,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    IterationRecord,
    stats_from_values,
    stats_values,
)
from specdec.methods import Method, get_method
from specdec.sampling import SamplingParams

if TYPE_CHECKING:
    from orchestrator.probes import RequestProbe

T = TypeVar("T")


@dataclass(frozen=True)
class RunSettings:
    """A request's resolved knobs: what its stored record keeps and a resumed run continues with."""

    request_id: str
    prompt_ids: tuple[int, ...]
    method: str
    k: int  # draft length, RD k_max or tree budget (an adaptive run's opening value)
    a: float | None
    tree_budget: int | None
    sampling: SamplingParams
    max_new_tokens: int
    stop: tuple[str, ...]
    stop_ids: frozenset[int]
    seed: int
    rank_acceptance: tuple[float, ...]
    pipeline: bool = False
    pipeline_max_k: int = 0  # > 0: pre-drafts grow where the method allows it (drafting.model)
    bonus_guesses: int | None = None  # None: automatic by block length (drafting.model)
    rejection_guesses: int = 0
    adaptive: bool = False  # k is re-picked every iteration (orchestrator.adaptation)
    chat: bool = False  # the prompt came from a chat template (GenerationRequest.messages)
    owner: str = ANONYMOUS  # the identity the request's record is bound to (RequestRecord.owner)
    draft_source: str = DraftSource.MODEL  # where drafts come from (orchestrator.drafting.PROPOSERS)
    seeded: bool = False  # the request named its seed: its random streams may be shared with other requests
    cache_salt: str = ""  # with `owner`, the engines' prefix-cache partition (GenerationRequest.cache_salt)

    @property
    def cache_partition(self) -> str:
        """Where the engines' prefix caches put this request's blocks and look for its prompt: the caller's
        identity and its salt, so no block crosses tenants (specdec.runtime.prefix_cache)."""
        return cache_partition(self.owner, self.cache_salt)

    @property
    def spec(self) -> Method:
        """The method's registry record (how it drafts, whether it pipelines, …)."""
        return get_method(self.method)

    def params(self) -> dict[str, Any]:
        """The knobs as JSON (RequestRecord.params)."""
        return {
            "method": self.method, "k": self.k, "a": self.a, "tree_budget": self.tree_budget,
            "max_new_tokens": self.max_new_tokens, "sampling": asdict(self.sampling), "stop": list(self.stop),
            "stop_token_ids": sorted(self.stop_ids), "rank_acceptance": list(self.rank_acceptance),
            "pipeline": self.pipeline, "pipeline_max_k": self.pipeline_max_k,
            "bonus_guesses": self.bonus_guesses, "rejection_guesses": self.rejection_guesses,
            "adaptive": self.adaptive, "chat": self.chat, "draft_source": self.draft_source,
            "seeded": self.seeded, "cache_salt": self.cache_salt,
        }

    @classmethod
    def from_record(cls, record: RequestRecord) -> RunSettings:
        p = record.params
        return cls(
            request_id=record.request_id, prompt_ids=tuple(record.prompt_ids), method=p["method"], k=p["k"],
            a=p["a"], tree_budget=p["tree_budget"], sampling=SamplingParams(**p["sampling"]),
            max_new_tokens=p["max_new_tokens"], stop=tuple(p["stop"]),
            stop_ids=frozenset(p["stop_token_ids"]),
            seed=record.seed, rank_acceptance=tuple(p["rank_acceptance"]),
            pipeline=bool(p.get("pipeline", False)), pipeline_max_k=int(p.get("pipeline_max_k", 0)),
            bonus_guesses=p.get("bonus_guesses", 1),  # runs stored before guesses existed had one
            rejection_guesses=int(p.get("rejection_guesses", 0)), adaptive=bool(p.get("adaptive", False)),
            chat=bool(p.get("chat", False)), owner=record.owner,
            # runs stored before draft sources drafted by model
            draft_source=str(p.get("draft_source", DraftSource.MODEL)),
            seeded=bool(p.get("seeded", True)),  # unknown for older records: the careful answer
            cache_salt=str(p.get("cache_salt", "")),
        )


@dataclass
class RunState:
    """What a run has produced so far: written by the loop alone."""

    generated: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    iterations: list[IterationRecord] = field(default_factory=list)
    calibration: Counter = field(default_factory=Counter)  # acceptance counts not yet in the store
    finish_reason: str | None = None
    text: str = ""  # the output's settled text (orchestrator.output)
    text_tail: str = ""  # the unsettled end, as a one-shot decode shows it (e.g. "\ufffd")
    text_sent: int = 0  # characters of `text` already streamed
    text_cursor: TextCursor | None = None  # where the verifier's incremental decoding stands
    perf0: float = field(default_factory=time.perf_counter)
    epoch0: float = field(default_factory=time.time)


@dataclass
class Run:
    """One run of a request: its settings, its state, its engine sessions' id and its observer."""

    settings: RunSettings
    state: RunState
    session_id: str
    probe: RequestProbe | None = None  # the observer's probe of this run (tracing, metrics), if any
    # Its caller reads the chunks as they come (a stream, not a unary call): the time to its first
    # token is what that caller waits on, so the hybrid's first pass carries no draft while the run is
    # the only one (drafting.hybrid, "The first token").
    streamed: bool = False
    # A chat's turns as the caller sent them (not stored: a resumed run has none), for the close of
    # its turn once it ends (orchestrator.turn_close).
    messages: tuple[ChatMessage, ...] = ()

    @property
    def request_id(self) -> str:
        return self.settings.request_id

    @property
    def committed(self) -> list[int]:
        return [*self.settings.prompt_ids, *self.state.generated]

    @property
    def finished(self) -> bool:
        return self.state.finish_reason is not None

    def epoch(self, perf: float) -> float:
        return self.state.epoch0 + (perf - self.state.perf0)

    def to_record(self, status: str, error: str | None = None) -> RequestRecord:
        state = self.state
        return RequestRecord(
            request_id=self.request_id, status=status, prompt_ids=list(self.settings.prompt_ids),
            token_ids=state.generated, params=self.settings.params(), seed=self.settings.seed,
            stats=stats_values(state.stats), finish_reason=state.finish_reason if status == "done" else None,
            text=state.text + state.text_tail, error=error, owner=self.settings.owner,
            holder=self.session_id,  # this run writes the record (RequestRecord.holder)
        )

    @classmethod
    def from_record(cls, record: RequestRecord) -> Run:
        """A new run that continues a stored request from its stored tokens (with a new session)."""
        stats = stats_from_values(record.stats) if record.stats else GenerationStats()
        return cls(RunSettings.from_record(record), RunState(generated=list(record.token_ids), stats=stats),
                   new_session_id(record.request_id))

    def result(self) -> GenerationResult:
        settings, state = self.settings, self.state
        return GenerationResult(
            request_id=self.request_id, token_ids=list(state.generated), text=state.text + state.text_tail,
            finish_reason=state.finish_reason or "length", seed=settings.seed, method=settings.method,
            stats=state.stats, iterations=list(state.iterations), started_at=state.epoch0,
            prompt_tokens=len(settings.prompt_ids),
        )


def cache_partition(owner: str, cache_salt: str = "") -> str:
    """The engines' prefix-cache and the suffix cache's partition of a caller and its salt."""
    return f"{owner}\x1f{cache_salt}"


def new_session_id(request_id: str) -> str:
    """A fresh session per run: a resumed request never shares caches with its dead predecessor."""
    return f"{request_id}/{uuid.uuid4().hex[:8]}"


def new_run(
    request: GenerationRequest, *, method: str, prompt_ids: list[int], rank_acceptance: Sequence[float],
    config: OrchestratorConfig, target: ModelInfo, owner: str = ANONYMOUS,
) -> Run:
    """The run of a checked request (orchestrator.request_checks): its knobs resolved against the
    configuration."""
    request_id = request.request_id or uuid.uuid4().hex
    settings = RunSettings(
        request_id=request_id,
        prompt_ids=tuple(prompt_ids),
        method=method,
        k=request.k if request.k is not None else scheduling.default_k(method, config),
        a=(float(_pick(request.a, config.default_a)) if get_method(method).takes_a else None),
        tree_budget=scheduling.tree_budget_for(method, request.k, request.tree_budget, config),
        sampling=request.sampling,
        max_new_tokens=request.max_new_tokens,
        stop=tuple(request.stop or ()),
        stop_ids=frozenset(int(t) for t in stop_ids(request, target)),
        seed=request.seed if request.seed is not None else secrets.randbits(63),
        rank_acceptance=tuple(rank_acceptance),
        pipeline=_pick(request.pipeline, config.pipeline),
        pipeline_max_k=min(config.max_k, _pick(request.pipeline_max_k, config.pipeline_max_k)),
        bonus_guesses=_pick(request.pipeline_bonus_guesses, config.pipeline_bonus_guesses),
        rejection_guesses=_pick(request.pipeline_rejection_guesses, config.pipeline_rejection_guesses),
        adaptive=(config.adaptive_k and request.k is None and request.seed is None
                  and request.tree_budget is None and adaptable(method, config)),
        chat=bool(request.messages),
        owner=owner,
        draft_source=draft_source_for(request.draft_source, method, config),
        seeded=request.seed is not None,
        cache_salt=request.cache_salt or "",
    )
    start = len(prompt_ids)
    return Run(settings, RunState(text_cursor=TextCursor(start, start, start)), new_session_id(request_id),
               messages=tuple(request.messages or ()))


def adaptable(method: str, config: OrchestratorConfig) -> bool:
    """Whether the method's draft length can be picked online: a plain sequence draft (token, block,
    ersd without a tree budget); RD's coins and tree budgets have their own knobs."""
    spec = get_method(method)
    return (spec.drafting == "sequence" and spec.drafts_sequences
            and scheduling.tree_budget_for(method, None, None, config) is None)


def draft_source_for(requested: str | None, method: str, config: OrchestratorConfig) -> str:
    """The request's draft source (checked by request_checks), else the configured one where the method
    has an exact rule for model-free drafts; RD's coins draft from the model (with no drafter, its
    plans become target-only steps)."""
    if requested is not None:
        return requested
    if not get_method(method).takes_deterministic_drafts:
        return DraftSource.MODEL
    return config.draft_source


def stop_ids(request: GenerationRequest, target: ModelInfo) -> Sequence[int]:
    """The request's stop token ids, else the target's end-of-sequence ids."""
    return target.eos_token_ids if request.stop_token_ids is None else tuple(request.stop_token_ids)


def _pick(value: T | None, default: T) -> T:
    return default if value is None else value
