"""Toy language models small enough to enumerate: random context-dependent Markov chains.

A model of order m over V tokens has one probability row per context of its last m tokens
(contexts shorter than m — the start of a sequence — get rows of their own). `Warped` applies
the project's warping (specdec.sampling.warp_logits on the log-probabilities) so that every
test sees exactly the distributions the real system would: T = 1, T = 0 (greedy), top-k, top-p.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.sampling import SamplingParams, warp_logits


@dataclass(frozen=True)
class MarkovModel:
    order: int
    vocab: int
    rows: dict[tuple[int, ...], torch.Tensor]  # context state -> raw probabilities (float64)

    def state(self, context: Sequence[int]) -> tuple[int, ...]:
        """The part of the context the model looks at."""
        if self.order == 0:
            return ()
        return tuple(context[-self.order :])

    def raw(self, context: Sequence[int]) -> torch.Tensor:
        return self.rows[self.state(context)]


def _contexts(order: int, vocab: int) -> list[tuple[int, ...]]:
    return [c for n in range(order + 1) for c in itertools.product(range(vocab), repeat=n)]


def random_markov(vocab: int, order: int, seed: int, sharpness: float = 1.5) -> MarkovModel:
    """Rows softmax(sharpness · N(0, 1)): larger sharpness, more peaked rows; every entry > 0."""
    generator = torch.Generator().manual_seed(seed)
    rows = {
        context: torch.softmax(sharpness * torch.randn(vocab, generator=generator, dtype=torch.float64), 0)
        for context in _contexts(order, vocab)
    }
    return MarkovModel(order, vocab, rows)


def anti_model(model: MarkovModel, power: float = 2.0) -> MarkovModel:
    """A terrible drafter: rows proportional to p^-power (most mass where the target has least)."""
    rows = {}
    for context, row in model.rows.items():
        inverted = row.pow(-power)
        rows[context] = inverted / inverted.sum()
    return MarkovModel(model.order, model.vocab, rows)


def constant_model(probs: Sequence[float]) -> MarkovModel:
    """A context-free model (order 0), e.g. the paper's two-token toy."""
    row = torch.tensor(list(probs), dtype=torch.float64)
    return MarkovModel(0, len(probs), {(): row / row.sum()})


@dataclass
class Warped:
    """A model seen through one set of sampling parameters (rows cached per state)."""

    model: MarkovModel
    sampling: SamplingParams = field(default_factory=SamplingParams)
    _cache: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def vocab(self) -> int:
        return self.model.vocab

    @property
    def order(self) -> int:
        return self.model.order

    def probs(self, context: Sequence[int]) -> torch.Tensor:
        state = self.model.state(context)
        row = self._cache.get(state)
        if row is None:
            row = warp_logits(torch.log(self.model.rows[state]), self.sampling).to(torch.float64)
            self._cache[state] = row
        return row

    def rows_for(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.stack([self.probs(c) for c in contexts])

    def sequence_probability(self, sequence: Sequence[int], prefix: Sequence[int] = ()) -> float:
        context = list(prefix)
        probability = 1.0
        for token in sequence:
            probability *= float(self.probs(context)[token])
            context.append(token)
        return probability

    def sequence_distribution(self, length: int, prefix: Sequence[int] = ()) -> dict[tuple[int, ...], float]:
        """Exact probabilities of every continuation of `length` tokens with positive mass."""
        out: dict[tuple[int, ...], float] = {}
        for sequence in itertools.product(range(self.vocab), repeat=length):
            probability = self.sequence_probability(sequence, prefix)
            if probability > 0.0:
                out[sequence] = probability
        return out


# The warping variants every fidelity test runs through.
SAMPLING_VARIANTS: dict[str, SamplingParams] = {
    "T=1": SamplingParams(temperature=1.0),
    "T=0": SamplingParams(temperature=0.0),
    "T=0.7,top-k=3": SamplingParams(temperature=0.7, top_k=3),
    "top-p=0.8": SamplingParams(temperature=1.0, top_p=0.8),
}
