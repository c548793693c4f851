"""What a batched pass costs by its rows: seconds ≈ fixed + per_row · rows, fitted over recent passes.

The prefill cut (ForwardBatcher.prefill_chunk_tokens) needs two figures: D, what the decoding
sessions' own pass takes, and r, what one more prompt row adds. Both used to be decaying means read
from passes of one kind each: D from passes without prompt rows, r from passes with them. Under a
burst of new prompts every pass carries a chunk, so D was never measured and the chunks stayed whole
beside decoders (8 fresh clients: 5–12 s between a request's first and second token). A line fitted
to every pass, whatever it carries, gives both at once: r is its slope, D is the line at the
decoders' rows (docs/algorithms.md §13).

The fit is least squares with each older pass weighted down by DECAY (the host's speed drifts), and
it is only trusted when the passes it weighs differ in width (MIN_SPREAD rows of standard
deviation): passes of one width say nothing about a row's cost. The last trusted line is kept while
later passes are too alike to fit (a pass's cost per row is a property of the model and the machine,
so it stays good for a while).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.95  # weight of a pass one pass older than the newest (about the last 20 passes count)
MIN_SPREAD = 8.0  # rows: the weighted standard deviation of the fitted passes' widths must reach this


@dataclass
class PassTimeModel:
    """seconds ≈ fixed + per_row · rows over recent passes; `fitted` once passes of different widths
    were seen. per_row ≥ 0 and fixed ≥ 0 (a slope from noise below zero means rows are all but free)."""

    weight: float = 0.0  # decayed sums: Σw, Σw·x, Σw·y, Σw·x², Σw·x·y (x = rows, y = seconds)
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0
    fixed: float | None = None  # the last trusted line
    per_row: float | None = None

    @property
    def fitted(self) -> bool:
        return self.per_row is not None

    def add(self, rows: int, seconds: float) -> None:
        """Weigh in one pass of `rows` query rows that took `seconds`; refit when the widths differ."""
        self.weight = DECAY * self.weight + 1.0
        self.sum_x = DECAY * self.sum_x + rows
        self.sum_y = DECAY * self.sum_y + seconds
        self.sum_xx = DECAY * self.sum_xx + rows * rows
        self.sum_xy = DECAY * self.sum_xy + rows * seconds
        mean_x, mean_y = self.sum_x / self.weight, self.sum_y / self.weight
        variance = self.sum_xx / self.weight - mean_x * mean_x
        if variance < MIN_SPREAD * MIN_SPREAD or not math.isfinite(variance):
            return
        slope = (self.sum_xy / self.weight - mean_x * mean_y) / variance
        self.per_row = max(slope, 0.0)
        self.fixed = max(mean_y - self.per_row * mean_x, 0.0)

    def seconds(self, rows: float) -> float | None:
        """The line at `rows` (None before it is fitted)."""
        if self.per_row is None or self.fixed is None:
            return None
        return self.fixed + self.per_row * rows
