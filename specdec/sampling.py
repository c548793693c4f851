"""Turning logits into the warped next-token distribution every component agrees on.

Drafter and verifier must apply *identical* warping (temperature → top-k → top-p → softmax),
otherwise the lossless guarantee is about a distribution nobody samples from. Keeping the one
function here is how that is enforced.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.sampling_params import MIN_TEMPERATURE, SamplingParams, SamplingParamsError

__all__ = ["MIN_TEMPERATURE", "SamplingParams", "SamplingParamsError", "greedy_one_hot", "row_argmax",
           "warp_logits"]


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row ([..., V] → [...], int64): the first (lowest id) maximum, a NaN
    counting as the maximum, as torch.argmax has it. CPU float32/float64 rows go through numpy's
    argmax, the same answer about ten times as fast here (11 against 127 µs a 152k-token row, one
    EPYC thread)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.asarray(np.argmax(logits.detach().numpy(), axis=-1))).to(torch.int64)
    return torch.argmax(logits, dim=-1)


def greedy_one_hot(logits: torch.Tensor) -> torch.Tensor:
    """One-hot rows on the argmax (row_argmax: the first, lowest id, maximum)."""
    index = row_argmax(logits).unsqueeze(-1)
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
