"""Public request/response types of the orchestrator (the gRPC GenerationService mirrors them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.sampling import SamplingParams

GENERATION_METHODS = ("token", "block", "ersd", "gsd-tree", "rd", "autoregressive")


@dataclass
class GenerationRequest:
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None  # None → the target's EOS ids
    seed: int | None = None  # None → a random seed, reported back in the result
    method: str = "token"
    k: int | None = None  # draft length (sequence methods) / tree budget (trees); None → default
    a: float | None = None  # RD drafting probability; None → calibrated or default
    request_id: str | None = None


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

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]  # new tokens only
    text: str
    finish_reason: str  # "length" | "eos" | "stop"
    seed: int
    method: str
    stats: GenerationStats


@dataclass
class GenerationChunk:
    """One streamed piece: the new tokens of an iteration and their text; the last has `result`."""

    token_ids: list[int]
    text: str
    result: GenerationResult | None = None
