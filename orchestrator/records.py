"""A request's stored record: what it has produced so far, enough to resume it exactly. Its own
module, light on purpose (no store backend, no transport), so the run (orchestrator.run) and everything
that reads a run need neither Redis nor gRPC."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from specdec.defaults import ANONYMOUS

REQUEST_STATUSES = ("running", "done", "failed")


@dataclass
class RequestRecord:
    """What a request has produced so far, enough to resume it exactly.

    params holds the request's knobs as plain JSON (method, k, a, tree_budget, max_new_tokens,
    sampling, stop, stop_token_ids); stats is GenerationStats as a dict. owner is the identity that
    created the request (specdec.rpc.security.caller_identity; records from before owners existed
    read as ANONYMOUS). holder names the run that writes the record (its session id); lease_until
    (epoch seconds) is how long that run holds it: renewed with every write of progress, 0 once the
    run has stopped; Resume refuses a record under lease, and takes it over (a new holder) otherwise.
    """

    request_id: str
    status: str  # one of REQUEST_STATUSES; "running" also covers a request whose orchestrator died
    prompt_ids: list[int]
    token_ids: list[int]
    params: dict[str, Any]
    seed: int
    stats: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    updated_at: float = 0.0
    owner: str = ANONYMOUS
    holder: str = ""
    lease_until: float = 0.0

    def to_json(self) -> str:
        return json.dumps(vars(self), separators=(",", ":"))  # fields are plain JSON values

    @classmethod
    def from_json(cls, text: str | bytes) -> RequestRecord:
        """The record; keys this version does not know (a newer writer's) are ignored."""
        data = json.loads(text)
        return cls(**{key: value for key, value in data.items() if key in _RECORD_FIELDS})


_RECORD_FIELDS = frozenset(f.name for f in dataclasses.fields(RequestRecord))
