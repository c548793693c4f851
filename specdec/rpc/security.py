"""Who is calling: the identity a request is bound to (its bearer token or its client certificate).

Identities are one-way digests, so a stored record never holds a secret and a log line naming an
identity reveals nothing usable.
"""

from __future__ import annotations

import hashlib
from typing import Any

ANONYMOUS = "anonymous"
AUTHORIZATION_HEADER = "authorization"
BEARER_PREFIX = "bearer "


def bearer_token(metadata: Any) -> str | None:
    """The token of an `authorization: Bearer <token>` entry in a call's metadata, if any."""
    for key, value in metadata or ():
        if key.lower() == AUTHORIZATION_HEADER:
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            if text.lower().startswith(BEARER_PREFIX):
                return text[len(BEARER_PREFIX):].strip() or None
    return None


def digest(secret: str | bytes) -> str:
    data = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(data).hexdigest()[:24]


def caller_identity(context: Any) -> str:
    """The caller of a grpc.aio call: "token:<digest>", else "cert:<digest>" of its verified client
    certificate (mTLS), else ANONYMOUS (a plaintext or server-only-TLS caller without a token)."""
    token = bearer_token(context.invocation_metadata())
    if token is not None:
        return f"token:{digest(token)}"
    try:
        auth = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - not every context implements it
        auth = {}
    certs = auth.get("x509_pem_cert") or []
    if certs:
        return f"cert:{digest(certs[0])}"
    return ANONYMOUS
