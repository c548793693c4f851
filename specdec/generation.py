"""Public request/response types of generation (the gRPC GenerationService mirrors them).

They sit in the core, below the transport, so that both transports, the orchestrator and the
clients share one definition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from specdec.sampling_params import SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a chat; the target tokenizer's chat template turns a list of them into a prompt."""

    role: str  # one of CHAT_ROLES
    content: str


@dataclass
class GenerationRequest:
    """What to generate. The prompt is exactly one of: text, token ids, or a chat (`messages`)."""

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None  # None → the target's EOS ids
    seed: int | None = None  # None → a random seed, reported back in the result
    # None here and below: the orchestrator's setting (OrchestratorConfig.default_method, default_k,
    # default_a, pipeline), whichever door (gRPC, HTTP, client, CLI) the request came through;
    # GenerationResult.method says what ran.
    method: str | None = None  # a name in specdec.methods.METHOD_NAMES
    k: int | None = None  # draft length (sequence methods) / tree budget (trees)
    a: float | None = None  # RD drafting probability; None → calibrated or default
    request_id: str | None = None  # the stored record's id (None → a fresh one); never reused (AlreadyExists)
    # Node budget of a draft tree: gsd-tree (falls back to k, then the configured default) and
    # ersd (set → a tree of this many nodes; None → a sequence of k tokens).
    tree_budget: int | None = None
    # Pre-draft the next block while the verifier checks this one (token, block, ersd; rd when
    # K = k_max); None → the orchestrator's `pipeline` setting.
    pipeline: bool | None = None
    # Pipelined mode, token and ersd: 0 → every pre-drafted block has the draft length k;
    # n > 0 → a pre-draft keeps growing until the verifier answers, up to n tokens (adaptive
    # draft length, PEARL-style; block and rd keep length k, docs/algorithms.md §8).
    # None → the orchestrator's `pipeline_max_k` setting.
    pipeline_max_k: int | None = None
    # Pipelined mode: pre-draft the next block after this many guesses of the bonus token (all
    # drafts accepted) and after this many guesses of the token that replaces a rejected last
    # draft; a block is used only when its guess comes true. None → the orchestrator's settings
    # (bonus guesses: automatic by block length, see OrchestratorConfig).
    pipeline_bonus_guesses: int | None = None
    pipeline_rejection_guesses: int | None = None
    # A chat instead of prompt / prompt_ids: rendered by the chat template, ending with the
    # assistant's turn (add_generation_prompt), into the prompt ids.
    messages: list[ChatMessage] | None = None
    # Where drafts come from (orchestrator.drafting, DRAFT_SOURCES): "hybrid" (per iteration: a
    # model-free draft when it pays, else the draft model, else a target-only step), "model",
    # "lookup" (n-grams of the request's own tokens), "suffix" (a cache of recent requests too).
    # None → the orchestrator's draft_source setting.
    draft_source: str | None = None
    # Requests share the engines' prefix caches only with the same caller and the same salt (checked by
    # orchestrator.request_checks); None: the caller's shared cache.
    cache_salt: str | None = None


@dataclass
class SourceStats:
    """What one draft source drafted for a request, and how much of it was accepted."""

    drafts: int = 0  # iterations that verified a draft from this source
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted tokens per draft (the mean accepted length)."""
        return self.accepted_tokens / self.drafts if self.drafts else 0.0


@dataclass
class GenerationStats:
    iterations: int = 0
    drafted_iterations: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    overlap_seconds: float = 0.0  # time drafter and verifier were both busy
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    fallback_iterations: int = 0  # iterations run target-only because the drafter was down
    pre_drafts_used: int = 0  # pipelined blocks whose assumed context came true (verified as drafted)
    pre_drafts_dropped: int = 0  # pipelined blocks dropped: their assumed context did not come true
    pre_draft_bonus_hits: list[int] = field(default_factory=list)  # used pre-drafts by bonus-guess rank
    pre_draft_rejection_hits: list[int] = field(default_factory=list)  # … by replacement-guess rank
    sources: dict[str, SourceStats] = field(default_factory=dict)  # by draft source (model, lookup, suffix)
    cached_tokens: int = 0  # prompt tokens the verifier took from its prefix cache (not prefilled)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def add(self, other: GenerationStats) -> None:
        """Add `other`'s counts to these: numbers summed, per-position and per-rank lists summed
        element by element, per-source counts by source. How the loop takes in an iteration's
        counts, which accounting and the drafting strategies return rather than write."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "sources":
                for name, counts in theirs.items():
                    into = mine.setdefault(name, SourceStats())
                    for c in fields(SourceStats):
                        setattr(into, c.name, getattr(into, c.name) + getattr(counts, c.name))
            elif isinstance(mine, list):
                if len(mine) < len(theirs):
                    mine.extend([0] * (len(theirs) - len(mine)))
                for i, count in enumerate(theirs):
                    mine[i] += count
            else:
                setattr(self, f.name, mine + theirs)


def stats_values(stats: Any) -> dict[str, Any]:
    """The stored fields of a GenerationStats as plain values, read by name off `stats`.

    `stats` is the dataclass or its wire message (generation_pb2.GenerationStats, which names its
    fields the same), so this is the one place that walks what a GenerationStats holds and every
    conversion (the proto both ways, the benchmark's records) follows a new field without an edit.
    Counters come back as int, seconds as float, per-position lists as lists and `sources` as
    {name: {SourceStats field: value}}; the derived rates are not stored fields and are left out.
    """
    values: dict[str, Any] = {}
    for f in fields(GenerationStats):
        value = getattr(stats, f.name)
        if f.name == "sources":
            counts = [g.name for g in fields(SourceStats)]
            value = {name: {c: int(getattr(s, c)) for c in counts} for name, s in value.items()}
        elif f.default is MISSING:  # a list (default_factory): element checks are the caller's
            value = list(value)
        else:
            value = type(f.default)(value)
        values[f.name] = value
    return values


def stats_from_values(values: Mapping[str, Any]) -> GenerationStats:
    """stats_values' form back (a form without per-source counts has none)."""
    values = dict(values)
    sources = {name: SourceStats(**s) for name, s in values.pop("sources", {}).items()}
    return GenerationStats(**values, sources=sources)


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]  # new tokens only
    text: str
    finish_reason: str  # "length" | "eos" | "stop"
    seed: int
    method: str  # the method that ran: the request's, or the orchestrator's default
    stats: GenerationStats
    iterations: list[IterationRecord] = field(default_factory=list)  # the request's timeline
    started_at: float = 0.0  # epoch seconds when the (last) run of the request began
    prompt_tokens: int = 0  # the prompt's length in target tokens


@dataclass
class GenerationChunk:
    """One streamed piece: the new tokens of an iteration and their text; the last has `result`.
    A resumed stream's first piece carries the tokens stored before it, so the pieces of any stream
    put together are the whole output."""

    token_ids: list[int]
    text: str
    result: GenerationResult | None = None


@dataclass
class IterationRecord:
    """One speculation iteration as it happened (what the trace and the timeline show).

    Times are epoch seconds (time.time() scale, measured with perf_counter); intervals are the
    real start/end of each drafter call and of each verifier call (score and verify) that ended
    within the iteration. A pipelined look-ahead call abandoned while still running (its block
    cannot be used) ends during the next iteration: the trace shows it, these lists do not.
    """

    request_id: str
    index: int  # counts the request's iterations, across resumed runs
    position: int  # committed length before the iteration = absolute index of its first new token
    method: str  # what ran: the request's method, or "autoregressive" for a target-only step
    a: float | None = None  # RD drafting probability (rd only)
    k: int = 0  # draft size asked for: draft length, RD k_max or tree budget (0 = none)
    heads: int | None = None  # RD leading heads K (rd only)
    drafted: bool = False  # the verifier checked at least one draft token
    num_drafted: int = 0
    accepted: int = 0
    emitted: list[int] = field(default_factory=list)  # new tokens that reached the output
    fallback: bool = False  # target-only because the drafter was unavailable
    start: float = 0.0
    end: float = 0.0
    draft_intervals: list[tuple[float, float]] = field(default_factory=list)
    verify_intervals: list[tuple[float, float]] = field(default_factory=list)
    overlap_seconds: float = 0.0
    source: str = ""  # where the draft came from: "model", "lookup", "suffix"; "" when nothing was drafted
