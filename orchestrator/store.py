"""Session/result store: request records (so a request can be read back and resumed) + calibration.

One interface, two backends: in memory (default, one process) and Redis (shared by orchestrator
replicas, survives an orchestrator's death). Records are stored as JSON in both, so the memory
backend round-trips exactly what Redis would.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

REQUEST_STATUSES = ("running", "done", "failed")


@dataclass
class RequestRecord:
    """What a request has produced so far, enough to resume it exactly.

    params holds the request's knobs as plain JSON (method, k, a, tree_budget, max_new_tokens,
    sampling, stop, stop_token_ids); stats is GenerationStats as a dict.
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

    def to_json(self) -> str:
        return json.dumps(vars(self), separators=(",", ":"))  # fields are plain JSON values

    @classmethod
    def from_json(cls, text: str | bytes) -> RequestRecord:
        return cls(**json.loads(text))


class Store(Protocol):
    async def put_request(self, record: RequestRecord) -> None: ...

    async def get_request(self, request_id: str) -> RequestRecord | None: ...

    async def add_calibration(self, pair: str, counts: Mapping[str, int]) -> None:
        """Add counts to the model pair's running acceptance statistics."""
        ...

    async def get_calibration(self, pair: str) -> dict[str, int]: ...

    async def close(self) -> None: ...


class MemoryStore:
    """In-process store (the default): nothing survives the process."""

    def __init__(self) -> None:
        self._requests: dict[str, str] = {}
        self._calibration: dict[str, dict[str, int]] = {}

    async def put_request(self, record: RequestRecord) -> None:
        record.updated_at = time.time()
        self._requests[record.request_id] = record.to_json()

    async def get_request(self, request_id: str) -> RequestRecord | None:
        text = self._requests.get(request_id)
        return RequestRecord.from_json(text) if text is not None else None

    async def add_calibration(self, pair: str, counts: Mapping[str, int]) -> None:
        table = self._calibration.setdefault(pair, {})
        for key, value in counts.items():
            table[key] = table.get(key, 0) + int(value)

    async def get_calibration(self, pair: str) -> dict[str, int]:
        return dict(self._calibration.get(pair, {}))

    async def close(self) -> None:
        return None


class RedisStore:
    """Redis backend: one JSON string per request (with a TTL) and one hash per model pair."""

    def __init__(self, url: str, ttl_seconds: int = 86400, prefix: str = "specdec",
                 timeout_seconds: float = 5.0) -> None:
        import redis.asyncio as redis_asyncio

        self.url = url
        self.ttl_seconds = ttl_seconds
        self.prefix = prefix
        self._redis = redis_asyncio.Redis.from_url(
            url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds
        )

    def _request_key(self, request_id: str) -> str:
        return f"{self.prefix}:request:{request_id}"

    def _calibration_key(self, pair: str) -> str:
        return f"{self.prefix}:calibration:{pair}"

    async def put_request(self, record: RequestRecord) -> None:
        record.updated_at = time.time()
        await self._redis.set(self._request_key(record.request_id), record.to_json(), ex=self.ttl_seconds)

    async def get_request(self, request_id: str) -> RequestRecord | None:
        text = await self._redis.get(self._request_key(request_id))
        return RequestRecord.from_json(text) if text is not None else None

    async def add_calibration(self, pair: str, counts: Mapping[str, int]) -> None:
        if not counts:
            return
        key = self._calibration_key(pair)
        async with self._redis.pipeline(transaction=True) as pipe:
            for name, value in counts.items():
                pipe.hincrby(key, name, int(value))
            await pipe.execute()

    async def get_calibration(self, pair: str) -> dict[str, int]:
        raw = await self._redis.hgetall(self._calibration_key(pair))
        return {_text(k): int(v) for k, v in raw.items()}

    async def close(self) -> None:
        await self._redis.aclose()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def open_store(url: str | None, ttl_seconds: int = 86400) -> Store:
    """None → MemoryStore; redis:// (or rediss://, unix://) → RedisStore."""
    if not url:
        return MemoryStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url, ttl_seconds=ttl_seconds)
    raise ValueError(f"store_url must be empty or a redis:// URL, got {url!r}")
