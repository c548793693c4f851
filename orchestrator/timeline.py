"""The timeline of one iteration's service calls: real start and end of every drafter and verifier
call, reported to the iteration's probe as they happen."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Literal, TypeVar

from orchestrator.intervals import overlap
from orchestrator.probes import IterationProbe

T = TypeVar("T")
CallKind = Literal["draft", "verify"]


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
