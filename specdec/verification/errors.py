"""The one error of verification: inputs that do not fit the method (a ValueError → INVALID_ARGUMENT).

Its own module so that the method registry can raise it without importing torch.
"""


class VerificationError(ValueError):
    """The inputs do not fit the method (shapes, missing draft rows, bad parameters)."""
