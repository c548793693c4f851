"""Session/result store: request records (so a request can be read back and resumed) + calibration.

One interface, two backends: in memory (default, one process) and Redis (shared by orchestrator
replicas, survives an orchestrator's death). Records are stored as JSON in both, so the memory
backend round-trips exactly what Redis would. Both keep a record for `ttl_seconds` after its last
write; the memory backend also keeps at most `max_requests` records (the least recently written go
first), so its memory is bounded.

Request ids are scoped to their owner (the caller's identity): a record lives under
(owner, request_id) (`request_key`), so one identity's id neither collides with nor reveals
another's. A new request's record is created atomically (`create_request`: never over an existing
one of its owner), a resumed request's record is taken over by compare-and-set (`replace_request`),
and progress is written with `put_request`, only by the run that holds the record (`holder`): a run
that lost it (say one that stalled past its lease while another resumed the request) is refused.

Every Redis operation is bounded by `timeout_seconds` as a whole (connecting, the pool, scripts and
pipelines included), so a hung Redis fails a call within the bound instead of stalling it; a call
that meets a dropped pooled connection (Redis restarted) is retried once on a fresh one. Any Redis
failure becomes StoreUnavailable, whose message names the store but neither its URL nor the
low-level error: those go to the log, once per outage. `StoreOutage` is how long a run generates on
while its saves fail (orchestrator.speculation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

from orchestrator.records import RequestRecord
from specdec.defaults import ANONYMOUS
from specdec.errors import StoreUnavailable

log = logging.getLogger(__name__)

DEFAULT_TTL_SECONDS = 86400
MAX_MEMORY_REQUESTS = 10_000
STORE_DOWN = "request store (Redis) unavailable"
DEFAULT_STORE_TIMEOUT_S = 2.0  # one Redis operation, as a whole (config.store_timeout_s)
DEFAULT_OUTAGE_GRACE_S = 30.0  # a run generates on while its saves fail (config.store_outage_grace_s)


def request_key(owner: str, request_id: str) -> str:
    """Where the record of `owner`'s request_id lives, in both stores.

    Anonymous requests keep the key records had before ids were scoped (request:<id>), so they stay
    resumable across the upgrade; an identity's are under owned:<owner> <id>. A request_id holds no
    space (request_checks.check_request_id), so the last space splits the two unambiguously, and
    the namespaces differ, so no anonymous id can name an identity's record.
    """
    if owner == ANONYMOUS:
        return f"request:{request_id}"
    return f"owned:{owner} {request_id}"


class Store(Protocol):
    async def create_request(self, record: RequestRecord) -> bool:
        """Store a new request's record; False (nothing written) when its owner already has a record
        of that request_id (another owner's record of the same id is another record)."""
        ...

    async def put_request(self, record: RequestRecord) -> bool:
        """Write a request's progress (sets record.updated_at; renews the TTL); False (nothing
        written) when the stored record is held by another run (a different, non-empty holder)."""
        ...

    async def replace_request(self, record: RequestRecord, *, if_updated_at: float) -> bool:
        """Write the record only if the stored one is still the version written at `if_updated_at`
        (compare-and-set: of two runs taking a record over, one wins); False otherwise."""
        ...

    async def get_request(self, request_id: str, owner: str = ANONYMOUS) -> RequestRecord | None:
        """`owner`'s record of request_id (the records of other owners are never seen)."""
        ...

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
        # request_key(owner, request_id) → (expiry on the clock, JSON); least recently written
        # first, which is also soonest to expire, since every write sets expiry = now + ttl.
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
        key = request_key(record.owner, record.request_id)
        self._requests.pop(key, None)
        self._requests[key] = (self._clock() + self.ttl_seconds, record.to_json())
        while len(self._requests) > self.max_requests:
            self._requests.popitem(last=False)

    def _read(self, owner: str, request_id: str) -> RequestRecord | None:
        self._expire()
        entry = self._requests.get(request_key(owner, request_id))
        return RequestRecord.from_json(entry[1]) if entry is not None else None

    async def create_request(self, record: RequestRecord) -> bool:
        if self._read(record.owner, record.request_id) is not None:
            return False
        self._write(record)
        return True

    async def put_request(self, record: RequestRecord) -> bool:
        stored = self._read(record.owner, record.request_id)
        if stored is not None and stored.holder not in ("", record.holder):
            return False
        self._write(record)
        return True

    async def replace_request(self, record: RequestRecord, *, if_updated_at: float) -> bool:
        stored = self._read(record.owner, record.request_id)
        if stored is None or stored.updated_at != if_updated_at:
            return False
        self._write(record)
        return True

    async def get_request(self, request_id: str, owner: str = ANONYMOUS) -> RequestRecord | None:
        return self._read(owner, request_id)

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
    """Redis backend: one JSON string per request (with a TTL) and one hash per model pair.

    timeout_seconds bounds each operation as a whole (asyncio.timeout: a script or a pipeline is
    several round trips, each of which a socket timeout alone would allow in full), and each socket
    connect and read within it. The connections of Redis.from_url retry nothing by default, so a
    pooled connection that a restarted Redis had dropped failed its call; here a ConnectionError is
    retried once, at once, on a fresh connection (redis-py's Retry), and a timeout never: a hung
    Redis costs one bound, not several.
    """

    def __init__(self, url: str, ttl_seconds: int = DEFAULT_TTL_SECONDS, prefix: str = "specdec",
                 timeout_seconds: float = DEFAULT_STORE_TIMEOUT_S) -> None:
        import redis.asyncio as redis_asyncio
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import RedisError, WatchError

        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds}")
        self.url = url
        self.ttl_seconds = ttl_seconds
        self.prefix = prefix
        self.timeout_seconds = timeout_seconds
        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        self._watch_error = WatchError
        self._down = False  # in an outage (logged once when it starts, once when it ends)
        self._redis = redis_asyncio.Redis.from_url(
            url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)), retry_on_error=[],
        )
        self._put_script = self._redis.register_script(_PUT_IF_HOLDER)

    def _request_key(self, owner: str, request_id: str) -> str:
        return f"{self.prefix}:{request_key(owner, request_id)}"

    def _calibration_key(self, pair: str) -> str:
        return f"{self.prefix}:calibration:{pair}"

    @contextlib.asynccontextmanager
    async def _reachable(self) -> AsyncIterator[None]:
        """Bound the operation by timeout_seconds; turn a Redis failure (or the bound) into
        StoreUnavailable; log an outage's start and end once each."""
        try:
            async with asyncio.timeout(self.timeout_seconds):
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
        async with self._reachable():
            created = await self._redis.set(self._request_key(record.owner, record.request_id),
                                            record.to_json(), ex=self.ttl_seconds, nx=True)
        return bool(created)

    async def put_request(self, record: RequestRecord) -> bool:
        record.updated_at = time.time()
        async with self._reachable():
            written = await self._put_script(keys=[self._request_key(record.owner, record.request_id)],
                                             args=[record.to_json(), record.holder, self.ttl_seconds])
        return bool(written)

    async def replace_request(self, record: RequestRecord, *, if_updated_at: float) -> bool:
        key = self._request_key(record.owner, record.request_id)
        async with self._reachable():
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

    async def get_request(self, request_id: str, owner: str = ANONYMOUS) -> RequestRecord | None:
        async with self._reachable():
            text = await self._redis.get(self._request_key(owner, request_id))
        return RequestRecord.from_json(text) if text is not None else None

    async def add_calibration(self, pair: str, counts: Mapping[str, int]) -> None:
        if not counts:
            return
        key = self._calibration_key(pair)
        async with self._reachable():
            async with self._redis.pipeline(transaction=True) as pipe:
                for name, value in counts.items():
                    pipe.hincrby(key, name, int(value))
                await pipe.execute()

    async def get_calibration(self, pair: str) -> dict[str, int]:
        async with self._reachable():
            raw = await self._redis.hgetall(self._calibration_key(pair))
        return {_text(k): int(v) for k, v in raw.items()}

    async def ping(self) -> None:
        async with self._reachable():
            await self._redis.ping()

    async def close(self) -> None:
        try:
            await self._redis.aclose()
        except self._errors:  # closing a connection to a dead server is not worth an error
            log.debug("closing the Redis connection failed", exc_info=True)


class StoreOutage:
    """How long the store has been failing one run's saves.

    A run generates on through a short outage (its record dirty, its chunks held back until a save
    succeeds) and stops once the store has failed it for `grace_s` (orchestrator.speculation).
    """

    def __init__(self, grace_s: float = DEFAULT_OUTAGE_GRACE_S, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self._clock = clock
        self.since: float | None = None  # when the first failed save of this outage was seen

    @property
    def active(self) -> bool:
        return self.since is not None

    def lasted(self) -> float:
        """Seconds since the outage's first failed save (0 when there is none)."""
        return 0.0 if self.since is None else self._clock() - self.since

    def left(self) -> float:
        """Seconds of grace left (the whole grace when there is no outage)."""
        if self.since is None:
            return self.grace_s
        return max(0.0, self.grace_s - (self._clock() - self.since))

    def failed(self) -> None:
        """A save failed: start the outage's clock; StoreUnavailable once the grace has passed."""
        now = self._clock()
        if self.since is None:
            self.since = now
        if now - self.since >= self.grace_s:
            raise StoreUnavailable(
                f"{STORE_DOWN} for {now - self.since:.1f} s (store_outage_grace_s {self.grace_s:g}): the "
                "request stopped; Resume continues it from its last saved progress once the store is back"
            )

    def ended(self) -> None:
        self.since = None


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


def open_store(url: str | None, ttl_seconds: int = DEFAULT_TTL_SECONDS,
               timeout_seconds: float = DEFAULT_STORE_TIMEOUT_S) -> Store:
    """None → MemoryStore; redis:// (or rediss://, unix://) → RedisStore, each operation bounded by
    timeout_seconds; both keep records ttl_seconds."""
    if not url:
        return MemoryStore(ttl_seconds=ttl_seconds)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url, ttl_seconds=ttl_seconds, timeout_seconds=timeout_seconds)
    raise ValueError(f"store_url must be empty or a redis:// URL, got {redacted_url(url)!r}")
