"""Request-level sampling parameters, checked on construction: what a request carries.

Apart from the warping itself (specdec.sampling, which needs torch) so that the request types and the
light client (specdec.client) can name them without importing torch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

# The smallest temperature above 0. Far below it nothing is left to sample (one token holds all the
# mass but for exact ties), and a value that underflows the logits' float32 (1e-46 becomes 0) turns
# the warped rows into NaN; so smaller positive temperatures are refused, and 0 asks for greedy.
MIN_TEMPERATURE = 1e-4


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    """Request-level sampling parameters.

    temperature: 0 means greedy (one-hot on the argmax, ties to the lowest token id); otherwise at
    least MIN_TEMPERATURE (1e-4), below which a positive temperature is refused (use 0 for greedy).
    top_k: 0 disables the filter. top_p: 1.0 disables the filter; must lie in (0, 1].
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise SamplingParamsError(f"{name} must be a real number, got {value!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise SamplingParamsError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise SamplingParamsError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature:g}; "
                "use 0 for greedy"
            )
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
