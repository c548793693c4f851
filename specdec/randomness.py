"""Where every random draw of the algorithms comes from.

The verification and drafting code never calls torch's RNG directly: it asks a `RandomSource`
for a Bernoulli or a categorical draw. In production that is a seeded torch generator; in the
exact-enumeration tests the very same code runs against a source that branches on every
choice, so the tests check the real code path rather than a re-derivation of it.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch


class RandomSource(Protocol):
    def bernoulli(self, p: float) -> bool:
        """True with probability p (p <= 0 never, p >= 1 always)."""
        ...

    def categorical(self, probs: torch.Tensor) -> int:
        """A token id drawn from the 1-D distribution `probs` (non-negative, sums to 1)."""
        ...


def derive_seed(seed: int, *labels: object) -> int:
    """A 63-bit seed for a named stream of a request (e.g. ("verify", position)).

    Derived by hashing so that streams are independent of each other and the same on every
    machine and process — a request with a seed replays exactly.
    """
    text = "\x1f".join([str(int(seed))] + [str(label) for label in labels])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def make_generator(seed: int, *labels: object) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(derive_seed(seed, *labels))
    return generator


class TorchRandomSource:
    """RandomSource backed by a CPU torch.Generator (draws stay on the CPU on every device)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    @classmethod
    def from_seed(cls, seed: int, *labels: object) -> TorchRandomSource:
        return cls(make_generator(seed, *labels))

    def bernoulli(self, p: float) -> bool:
        if p <= 0.0:
            return False
        if p >= 1.0:
            return True
        return bool(torch.rand((), generator=self.generator, dtype=torch.float64).item() < p)

    def categorical(self, probs: torch.Tensor) -> int:
        probs = probs.detach().to("cpu", torch.float64)
        # Inverse-CDF with one uniform: exact for the float64 distribution given and cheap for
        # large vocabularies (one cumsum + one binary search).
        cdf = torch.cumsum(probs, dim=0)
        u = torch.rand((), generator=self.generator, dtype=torch.float64) * cdf[-1]
        index = int(torch.searchsorted(cdf, u, right=True).item())
        index = min(index, probs.numel() - 1)
        # Never return a zero-probability token (possible only at float edges).
        while probs[index] <= 0 and index > 0:
            index -= 1
        return index


def categorical_from_uniform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`TorchRandomSource.categorical`'s pick for the uniform `u` in [0, 1) (the same rule, tested
    equal), row by row for float64 distributions `probs` [..., V] and uniforms `u` [...], as long
    tensors on probs' device and with no host sync: the drafter samples k tokens on the GPU with it
    from uniforms of the requests' streams (specdec.engine.drafter).

    The downward search past zero-probability tokens becomes one masked max over the vocabulary:
    cheap on a GPU, so the CPU's own draw keeps its loop.
    """
    cdf = torch.cumsum(probs, dim=-1)
    bound = (u.to(cdf.device) * cdf[..., -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, bound, right=True).clamp(max=probs.shape[-1] - 1)
    ids = torch.arange(probs.shape[-1], device=probs.device)
    return torch.where((probs > 0) & (ids <= index), ids, 0).amax(dim=-1)
