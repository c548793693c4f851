"""specdec core: exact speculative decoding, free of any I/O.

Importing this package never imports grpc, redis or OpenTelemetry; the services and the
orchestrator are thin adapters around what lives here.
"""

from specdec.randomness import RandomSource, TorchRandomSource, derive_seed, make_generator
from specdec.sampling import SamplingParams, warp_logits
from specdec.trees import DraftTree

__all__ = [
    "DraftTree",
    "RandomSource",
    "SamplingParams",
    "TorchRandomSource",
    "derive_seed",
    "make_generator",
    "warp_logits",
]
