"""Tenants: several callers' tokens (and client certificates) mapped to tenant names.

A tenants file (`--tenants-file`, a Kubernetes Secret in the chart) holds one tenant credential a line:

    # name      credential
    team-a      3q2+7w...
    team-a      Zx9...
    team-b      cn:billing-client

A credential is a bearer token (one word of printable ASCII; a tenant may have several, e.g. during a
rotation) or `cn:` and the subject common name of a client certificate (mTLS, either door). Lines
starting with `#` and blank lines are skipped.

Every token in it is accepted (besides --auth-token-file's), and a caller proven by one is the
tenant `tenant:<name>`: its requests' records, its per-caller cap (--max-requests-per-caller) and its
partition of the prefix and suffix caches (docs/algorithms.md §16) are the tenant's, whichever of
its credentials it used. Callers not named here keep their own identity (a token's digest).
Errors name the flag and the line, never a token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.rpc.security import _read_file, digest

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
COMMON_NAME_PREFIX = "cn:"


@dataclass(frozen=True)
class Tenants:
    """Credentials → tenant names. `tokens`: the bearer tokens to accept."""

    tokens: tuple[str, ...] = field(default=(), repr=False)
    by_token_digest: dict[str, str] = field(default_factory=dict, repr=False)
    by_common_name: dict[str, str] = field(default_factory=dict)

    def identity(self, caller: str, common_name: str | None = None) -> str:
        """The tenant identity of a caller ("token:<digest>" from security.caller_identity), or the
        caller's own when no line names its credential."""
        if caller.startswith("token:"):
            name = self.by_token_digest.get(caller[len("token:"):])
            if name is not None:
                return f"tenant:{name}"
        if common_name is not None and common_name in self.by_common_name:
            return f"tenant:{self.by_common_name[common_name]}"
        return caller

    @property
    def names(self) -> set[str]:
        return set(self.by_token_digest.values()) | set(self.by_common_name.values())


def parse_tenants(text: str, where: str) -> Tenants:
    """The tenants of a file's text; ValueError naming `where` and the line (never a token)."""
    tokens: list[str] = []
    by_digest: dict[str, str] = {}
    by_cn: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = "" if raw.lstrip().startswith("#") else raw.strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{where} line {number}: expected `NAME CREDENTIAL` (two words)")
        name, credential = parts
        if not NAME.match(name):
            raise ValueError(f"{where} line {number}: a tenant name is 1-64 letters, digits, '_', '.' or "
                             "'-', starting with a letter or digit")
        if not credential.isascii() or not credential.isprintable():
            raise ValueError(f"{where} line {number}: a credential must be printable ASCII")
        if credential.startswith(COMMON_NAME_PREFIX):
            common_name = credential[len(COMMON_NAME_PREFIX):]
            if not common_name or by_cn.get(common_name, name) != name:
                raise ValueError(f"{where} line {number}: the common name is empty or names another tenant")
            by_cn[common_name] = name
            continue
        key = digest(credential)
        if key in by_digest:
            raise ValueError(f"{where} line {number}: this token is already on an earlier line")
        by_digest[key] = name
        tokens.append(credential)
    if not by_digest and not by_cn:
        raise ValueError(f"{where}: no tenant in the file (expected lines `NAME TOKEN` or "
                         "`NAME cn:COMMON_NAME`)")
    return Tenants(tuple(tokens), by_digest, by_cn)


def read_tenants_file(path: Path | str, flag: str = "--tenants-file") -> Tenants:
    data = _read_file(path, flag)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not UTF-8 text") from None
    return parse_tenants(text, f"{flag} {Path(path).expanduser()}")


def common_name(context: Any) -> str | None:
    """The subject common name of a grpc.aio call's verified client certificate, if any."""
    try:
        auth = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - not every context implements it
        return None
    names = auth.get("x509_common_name") or []
    if not names:
        return None
    value = names[0]
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
