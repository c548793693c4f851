"""Turning logits into the warped next-token distribution every component agrees on.

Drafter and verifier must apply *identical* warping (temperature → top-k → top-p → softmax),
otherwise the lossless guarantee is about a distribution nobody samples from. Keeping the one
function here is how that is enforced.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

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


def greedy_one_hot(logits: torch.Tensor) -> torch.Tensor:
    """One-hot rows on the argmax; torch.argmax returns the first (lowest id) maximum."""
    index = torch.argmax(logits, dim=-1, keepdim=True)
    out = torch.zeros_like(logits)
    out.scatter_(-1, index, 1.0)
    return out


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Warped probabilities for logits of shape [..., V] (float32 or float64 kept; others → float32).

    Top-k keeps every token whose scaled logit is >= the k-th largest, so tokens tied with the
    k-th value are all kept (order-independent; more than k survive only on such ties).
    Top-p keeps the smallest set of most-likely tokens whose mass reaches top_p (the token that
    crosses the threshold is kept); ties in probability are ordered by token id so the result is
    the same on every machine.
    """
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if params.greedy:
        return greedy_one_hot(logits)
    # Shift by the row max before dividing: the same softmax, but a tiny temperature cannot
    # overflow the logits to inf (inf - inf = NaN probabilities).
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    # Stable sort by descending probability keeps equal probabilities in token-id order.
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)
