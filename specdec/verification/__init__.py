"""Verification methods behind one entry point, `verify`.

token     Leviathan et al. / Chen et al. token-by-token rejection (sequence drafts).
block     Sun et al. block verification (sequence drafts; optimal, never worse than token).
ersd      exponential races (sequence, batch or tree; needs no draft distributions).
gsd-tree  multi-candidate trees, recursive rejection of children drawn without replacement.
rd        randomised drafting with per-position coins (k >= 1, including the no-draft step).
"""

from specdec.verification.base import (
    METHODS,
    MethodParams,
    VerificationError,
    VerifyResult,
    residual,
)
from specdec.verification.methods import needs_draft_probs, verify

__all__ = [
    "METHODS",
    "MethodParams",
    "VerificationError",
    "VerifyResult",
    "needs_draft_probs",
    "residual",
    "verify",
]
