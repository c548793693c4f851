"""Session/result store: request records (so a request can be read back and resumed) + calibration.

One interface, two backends: in memory (default, one process) and Redis (shared by orchestrator
replicas, survives an orchestrator's death). Records are stored as JSON in both, so the memory
backend round-trips exactly what Redis would. Both keep a record for `ttl_seconds` after its last
write; the memory backend also keeps at most `max_requests` records (the least recently written go
first), so its memory is bounded.

A new request's record is created atomically (`create_request`: never over an existing one), a
resumed request's record is taken over by compare-and-set (`replace_request`), and progress is
written with `put_request`, only by the run that holds the record (`holder`): a run that lost it
(say one that stalled past its lease while another resumed the request) is refused. Any Redis
failure becomes StoreUnavailable, whose message names the store but neither its URL nor the
low-level error: those go to the log, once per outage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from specdec.errors import StoreUnavailable
from specdec.rpc.security import ANONYMOUS

log = logging.getLogger(__name__)

REQUEST_STATUSES = ("running", "done", "failed")
DEFAULT_TTL_SECONDS = 86400
MAX_MEMORY_REQUESTS = 10_000
STORE_DOWN = "request store (Redis) unavailable"


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


class Store(Protocol):
    async def create_request(self, record: RequestRecord) -> bool:
        """Store a new request's record; False (nothing written) when its request_id already has one."""
        ...

    async def put_request(self, record: RequestRecord) -> bool:
        """Write a request's progress (sets record.updated_at; renews the TTL); False (nothing
        written) when the stored record is held by another run (a different, non-empty holder)."""
        ...

    async def replace_request(self, record: RequestRecord, *, if_updated_at: float) -> bool:
        """Write the record only if the stored one is still the version written at `if_updated_at`
        (compare-and-set: of two runs taking a record over, one wins); False otherwise."""
        ...

    async def get_request(self, request_id: str) -> RequestRecord | None: ...

    async def add_calibration(self, pair: str, counts: Mapping[str, int]) -> None:
        """Add counts to the model pair's running acceptance statistics."""
        ...

    async def get_calibration(self, pair: str) -> dict[str, int]: ...

    async def ping(self) -> None:
        """Raise StoreUnavailable when the store cannot be reached (health checks)."""
        ...

    async def close(self) -> None: ...


class MemoryStore:
    """In-process store (the default): nothing survives the process.

    Records expire `ttl_seconds` after their last write, and past `max_requests` records the least
    recently written is dropped (expiry is checked on access, so no background task is needed).
    """

    def __init__(self, ttl_seconds: float = DEFAULT_TTL_SECONDS, max_requests: int = MAX_MEMORY_REQUESTS,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.ttl_seconds = ttl_seconds
        self.max_requests = max_requests
        self._clock = clock
        # request_id → (expiry on the clock, JSON); least recently written first, which is also
        # soonest to expire, since every write sets expiry = now + ttl.
        self._requests: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._calibration: dict[str, dict[str, int]] = {}

    def __len__(self) -> int:
        self._expire()
        return len(self._requests)

    def _expire(self) -> None:
        now = self._clock()
        while self._requests:
            expiry, _ = next(iter(self._requests.values()))
            if expiry > now:
                break
            self._requests.popitem(last=False)

    def _write(self, record: RequestRecord) -> None:
        record.updated_at = time.time()
        self._requests.pop(record.request_id, None)
        self._requests[record.request_id] = (self._clock() + self.ttl_seconds, record.to_json())
        while len(self._requests) > self.max_requests:
            self._requests.popitem(last=False)

    def _read(self, request_id: str) -> RequestRecord | None:
        self._expire()
        entry = self._requests.get(request_id)
        return RequestRecord.from_json(entry[1]) if entry is not None else None

    async def create_request(self, record: RequestRecord) -> bool:
        if self._read(record.request_id) is not None:
            return False
        self._write(record)
        return True

    async def put_request(self, record: RequestRecord) -> bool:
        stored = self._read(record.request_id)
        if stored is not None and stored.holder not in ("", record.holder):
            return False
        self._write(record)
        return True

    async def replace_request(self, record: RequestRecord, *, if_updated_at: float) -> bool:
        stored = self._read(record.request_id)
        if stored is None or stored.updated_at != if_updated_at:
            return False
        self._write(record)
        return True

    async def get_request(self, request_id: str) -> RequestRecord | None:
        return self._read(request_id)

    async def add_calibration(self, pair: str, counts: Mapping[str, int]) -> None:
        table = self._calibration.setdefault(pair, {})
        for key, value in counts.items():
            table[key] = table.get(key, 0) + int(value)

    async def get_calibration(self, pair: str) -> dict[str, int]:
        return dict(self._calibration.get(pair, {}))

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


# put_request in one step: write KEYS[1] = ARGV[1] (EX ARGV[3]) unless the stored record names another
# holder than ARGV[2]; 1 if written.
_PUT_IF_HOLDER = """
local stored = redis.call('GET', KEYS[1])
if stored then
  local ok, record = pcall(cjson.decode, stored)
  if ok and type(record) == 'table' then
    local holder = record['holder']
    if type(holder) == 'string' and holder ~= '' and holder ~= ARGV[2] then
      return 0
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
return 1
"""


class RedisStore:
    """Redis backend: one JSON string per request (with a TTL) and one hash per model pair."""

    def __init__(self, url: str, ttl_seconds: int = DEFAULT_TTL_SECONDS, prefix: str = "specdec",
                 timeout_seconds: float = 5.0) -> None:
        import redis.asyncio as redis_asyncio
        from redis.exceptions import RedisError, WatchError

        self.url = url
        self.ttl_seconds = ttl_seconds
        self.prefix = prefix
        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        self._watch_error = WatchError
        self._down = False  # in an outage (logged once when it starts, once when it ends)
        self._redis = redis_asyncio.Redis.from_url(
            url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds
        )
        self._put_script = self._redis.register_script(_PUT_IF_HOLDER)

    def _request_key(self, request_id: str) -> str:
        return f"{self.prefix}:request:{request_id}"

    def _calibration_key(self, pair: str) -> str:
        return f"{self.prefix}:calibration:{pair}"

    @contextlib.contextmanager
    def _reachable(self) -> Iterator[None]:
        """Turn a Redis failure into StoreUnavailable; log an outage's start and end once each."""
        try:
            yield
        except self._errors as exc:
            if not self._down:
                self._down = True
                log.warning("request store (Redis at %s) unavailable: %s: %s", redacted_url(self.url),
                            type(exc).__name__, exc)
            raise StoreUnavailable(STORE_DOWN) from None
        if self._down:
            self._down = False
            log.warning("request store (Redis at %s) reachable again", redacted_url(self.url))

    async def create_request(self, record: RequestRecord) -> bool:
        record.updated_at = time.time()
        with self._reachable():
            created = await self._redis.set(self._request_key(record.request_id), record.to_json(),
                                            ex=self.ttl_seconds, nx=True)
        return bool(created)

    async def put_request(self, record: RequestRecord) -> bool:
        record.updated_at = time.time()
        with self._reachable():
            written = await self._put_script(keys=[self._request_key(record.request_id)],
                                             args=[record.to_json(), record.holder, self.ttl_seconds])
        return bool(written)

    async def replace_request(self, record: RequestRecord, *, if_updated_at: float) -> bool:
        key = self._request_key(record.request_id)
        with self._reachable():
            async with self._redis.pipeline(transaction=True) as pipe:
                await pipe.watch(key)
                text = await pipe.get(key)
                if text is None or RequestRecord.from_json(text).updated_at != if_updated_at:
                    return False
                record.updated_at = time.time()
                pipe.multi()
                pipe.set(key, record.to_json(), ex=self.ttl_seconds)
                try:
                    await pipe.execute()
                except self._watch_error:  # written by someone else since the read
                    return False
        return True

    async def get_request(self, request_id: str) -> RequestRecord | None:
        with self._reachable():
            text = await self._redis.get(self._request_key(request_id))
        return RequestRecord.from_json(text) if text is not None else None

    async def add_calibration(self, pair: str, counts: Mapping[str, int]) -> None:
        if not counts:
            return
        key = self._calibration_key(pair)
        with self._reachable():
            async with self._redis.pipeline(transaction=True) as pipe:
                for name, value in counts.items():
                    pipe.hincrby(key, name, int(value))
                await pipe.execute()

    async def get_calibration(self, pair: str) -> dict[str, int]:
        with self._reachable():
            raw = await self._redis.hgetall(self._calibration_key(pair))
        return {_text(k): int(v) for k, v in raw.items()}

    async def ping(self) -> None:
        with self._reachable():
            await self._redis.ping()

    async def close(self) -> None:
        try:
            await self._redis.aclose()
        except self._errors:  # closing a connection to a dead server is not worth an error
            log.debug("closing the Redis connection failed", exc_info=True)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def redacted_url(url: str) -> str:
    """The URL without its password (for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def open_store(url: str | None, ttl_seconds: int = DEFAULT_TTL_SECONDS) -> Store:
    """None → MemoryStore; redis:// (or rediss://, unix://) → RedisStore; both keep records ttl_seconds."""
    if not url:
        return MemoryStore(ttl_seconds=ttl_seconds)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url, ttl_seconds=ttl_seconds)
    raise ValueError(f"store_url must be empty or a redis:// URL, got {redacted_url(url)!r}")
