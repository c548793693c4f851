"""What the loop reports to its observers (tracing, metrics): the hooks, as Protocols.

The loop (orchestrator.speculation) calls these; orchestrator.tracing and orchestrator.metrics
implement them. Kept apart from both so the loop needs no OpenTelemetry to type its calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from specdec.generation import GenerationResult, IterationRecord


class IterationProbe(Protocol):
    """Per-iteration hooks (entered by RequestProbe.iteration). Times are time.perf_counter()."""

    def call_started(self, kind: str, op: str, start: float) -> Any:
        """A drafter (kind "draft") or verifier (kind "verify") call begins; op = draft | lookahead |
        score | verify | verify-rows (a lean verify resent with the draft rows it asked for).

        Runs in the task that awaits the call, so a span made current here is the caller's
        context during the call (and travels in its gRPC metadata). Returns a token.
        """

    def call_finished(self, token: Any, end: float, error: BaseException | None) -> None:
        """The call of `token` ended (in the same task, right after it)."""

    def finished(self, record: IterationRecord, depth: int) -> None:
        """The iteration's IterationRecord, and the depth of the draft tree it verified."""


class RequestProbe(Protocol):
    def iteration(self, index: int, start: float) -> AbstractContextManager[IterationProbe]:
        """Entered around one iteration (started at perf_counter `start`); its calls run inside."""

    def finished(self, result: GenerationResult | None, error: BaseException | None) -> None:
        """The run ended: its GenerationResult, or the error (both None: the consumer left)."""


class LoopObserver(Protocol):
    """What orchestrator.speculation.Orchestrator(observer=...) calls (tracing, metrics).

    epoch maps the loop's time.perf_counter() readings to epoch seconds (IterationRecord's
    scale), so spans and records carry the very same instants.
    """

    def request_started(self, request_id: str, epoch: Callable[[float], float],
                        attributes: Mapping[str, Any]) -> RequestProbe | None: ...
