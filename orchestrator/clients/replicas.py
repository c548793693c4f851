"""Several replicas of an engine behind one address, e.g. a Kubernetes headless Service.

An address whose host is a DNS name is resolved every `refresh_s` (all its A/AAAA records: a
headless Service lists one per ready pod); a client is kept per endpoint. Every call that names a
session goes to the replica that rendezvous hashing picks for the run's session (the id up to any
"~" suffix, so a run's retired drafter sessions stay beside it), so each request's KV cache lives on
one replica and endpoints joining or leaving move only the sessions that hashed to them. A moved
session is simply unknown to its new replica: the engine answers SessionGone and the orchestrator
resends the context (orchestrator.sessions), exactly as after an engine restart.

A replica that answers UNAVAILABLE is left out for `down_s`, and the call is made once more on the
next pick (where the session is unknown, so it comes back as SessionGone and is resent). Calls
without a session (Info, Tokenize, Decode, ApplyChatTemplate) go round the endpoints, so the health
monitor's Info rounds look at every replica over time. All replicas must serve the same model; a
replica that differs is found by that round like a restarted engine.

An address whose host is an IP literal (or localhost) is one server: `engine_client` returns the
plain client for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import torch

from specdec.engine.api import (
    DraftRequest,
    DraftResult,
    DraftRowsRequest,
    LookaheadRequest,
    LookaheadResult,
    ModelInfo,
    ScoreRequest,
    VerifyOutcome,
    VerifyRequest,
)
from specdec.errors import PeerUnavailable
from specdec.generation import ChatMessage
from specdec.rpc.grpc_support import format_address
from specdec.rpc.security import ClientSecurity

log = logging.getLogger(__name__)

T = TypeVar("T")
Resolver = Callable[[str, int], Awaitable[list[str]]]
DEFAULT_REFRESH_S = 5.0
DEFAULT_DOWN_S = 2.0


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of host:port or [v6]:port; ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve_all(host: str, port: int) -> list[str]:
    """Every address of `host` (sorted, without duplicates), as host:port endpoints."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({format_address(info[4][0], port) for info in infos})


def rendezvous(key: str, endpoints: list[str]) -> str:
    """The endpoint with the highest hash of (key, endpoint): stable while it stays, and a change of
    the set moves only the keys of the endpoints that came or went."""
    return max(endpoints, key=lambda e: hashlib.blake2b(f"{key}|{e}".encode(), digest_size=8).digest())


def session_key(session_id: str) -> str:
    return session_id.split("~", 1)[0]


class Replicas:
    """The endpoints of one address, a client for each, and which one a call goes to."""

    def __init__(self, role: str, address: str, make_client: Callable[[str], Any], *,
                 refresh_s: float = DEFAULT_REFRESH_S, down_s: float = DEFAULT_DOWN_S,
                 resolve: Resolver = resolve_all) -> None:
        self.role = role
        self.address = address
        self.host, self.port = split_address(address)
        self._make_client = make_client
        self._resolve = resolve
        self.refresh_s = refresh_s
        self.down_s = down_s
        self._endpoints: list[str] = []
        self._resolved_at = float("-inf")
        self._clients: dict[str, Any] = {}
        self._down_until: dict[str, float] = {}
        self._turn = 0
        self._lock = asyncio.Lock()

    async def endpoints(self) -> list[str]:
        """The endpoints now (re-resolved when older than refresh_s); PeerUnavailable when none."""
        if time.monotonic() - self._resolved_at >= self.refresh_s:
            async with self._lock:
                if time.monotonic() - self._resolved_at >= self.refresh_s:
                    await self._refresh()
        if not self._endpoints:
            error = PeerUnavailable(f"{self.address}: no endpoints (DNS gives no address for {self.host})")
            error.address, error.public = self.address, f"{self.role} unavailable (no replica)"
            raise error
        return self._endpoints

    async def _refresh(self) -> None:
        try:
            found = await self._resolve(self.host, self.port)
        except OSError as exc:  # DNS down: keep what we had, try again at the next refresh
            log.warning("resolving %s failed: %s", self.address, exc)
            found = self._endpoints
        self._resolved_at = time.monotonic()
        if found != self._endpoints:
            log.info("%s: endpoints %s", self.address, ", ".join(found) or "none")
        for gone in set(self._clients) - set(found):
            client = self._clients.pop(gone)
            asyncio.get_running_loop().create_task(client.close())
        self._endpoints = list(found)

    def client(self, endpoint: str) -> Any:
        if endpoint not in self._clients:
            self._clients[endpoint] = self._make_client(endpoint)
        return self._clients[endpoint]

    def _up(self, endpoints: list[str]) -> list[str]:
        now = time.monotonic()
        up = [e for e in endpoints if self._down_until.get(e, 0.0) <= now]
        return up or endpoints  # all down: try them anyway rather than fail without a call

    async def for_session(self, session_id: str, call: Callable[[Any], Awaitable[T]]) -> T:
        """`call(client)` on the session's replica; once more on the next pick if that one is down."""
        endpoints = await self.endpoints()
        endpoint = rendezvous(session_key(session_id), self._up(endpoints))
        try:
            return await call(self.client(endpoint))
        except PeerUnavailable:
            others = [e for e in self._up(endpoints) if e != endpoint]
            self._mark_down(endpoint)
            if not others:
                raise
            return await call(self.client(rendezvous(session_key(session_id), others)))

    async def any(self, call: Callable[[Any], Awaitable[T]]) -> T:
        """`call(client)` on the endpoints in turn until one answers (PeerUnavailable: none did)."""
        endpoints = self._up(await self.endpoints())
        self._turn += 1
        error: PeerUnavailable | None = None
        for i in range(len(endpoints)):
            endpoint = endpoints[(self._turn + i) % len(endpoints)]
            try:
                return await call(self.client(endpoint))
            except PeerUnavailable as exc:
                self._mark_down(endpoint)
                error = exc
        assert error is not None
        raise error

    def _mark_down(self, endpoint: str) -> None:
        self._down_until[endpoint] = time.monotonic() + self.down_s

    async def is_serving(self, timeout_s: float = 2.0) -> bool:
        """Whether any replica passes its health check."""
        try:
            endpoints = await self.endpoints()
        except PeerUnavailable:
            return False
        checks = [self.client(e).is_serving(timeout_s) for e in endpoints]
        return any(await asyncio.gather(*checks))

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(client.close() for client in clients), return_exceptions=True)


class _Replicated:
    """What both engine clients do the same over replicas: Info, Release, health, close."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self.address = replicas.address

    async def info(self) -> ModelInfo:
        return await self.replicas.any(lambda c: c.info())

    async def release(self, session_id: str) -> None:
        await self.replicas.for_session(session_id, lambda c: c.release(session_id))

    async def is_serving(self, timeout_s: float = 2.0) -> bool:
        return await self.replicas.is_serving(timeout_s)

    async def close(self) -> None:
        await self.replicas.close()


class ReplicatedDrafterClient(_Replicated):
    """DrafterClient over the replicas of one drafter address."""

    async def draft(self, request: DraftRequest) -> DraftResult:
        return await self.replicas.for_session(request.session_id, lambda c: c.draft(request))

    async def lookahead(self, request: LookaheadRequest) -> LookaheadResult:
        return await self.replicas.for_session(request.session_id, lambda c: c.lookahead(request))

    async def draft_rows(self, request: DraftRowsRequest) -> torch.Tensor:
        return await self.replicas.for_session(request.session_id, lambda c: c.draft_rows(request))


class ReplicatedVerifierClient(_Replicated):
    """VerifierClient over the replicas of one verifier address."""

    async def score(self, request: ScoreRequest) -> None:
        await self.replicas.for_session(request.session_id, lambda c: c.score(request))

    async def verify(self, request: VerifyRequest) -> VerifyOutcome:
        return await self.replicas.for_session(request.session_id, lambda c: c.verify(request))

    async def tokenize(self, text: str) -> list[int]:
        return await self.replicas.any(lambda c: c.tokenize(text))

    async def apply_chat_template(self, messages: list[ChatMessage], chat_template: str | None = None,
                                  ) -> list[int]:
        return await self.replicas.any(lambda c: c.apply_chat_template(messages, chat_template))

    async def decode(self, token_ids: list[int]) -> str:
        return await self.replicas.any(lambda c: c.decode(token_ids))


def engine_client(role: str, address: str, *, security: ClientSecurity | None = None,
                  refresh_s: float = DEFAULT_REFRESH_S, resolve: Resolver = resolve_all,
                  **options: Any) -> Any:
    """The client of the drafter or verifier at `address`: the plain gRPC client for an IP literal,
    else the replicated one over every address the name resolves to. Over TLS, the replicas' IPs are
    checked against the name of the address (or security.server_name), as a single channel would."""
    from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient

    plain, replicated = ((GrpcDrafterClient, ReplicatedDrafterClient) if role == "drafter"
                         else (GrpcVerifierClient, ReplicatedVerifierClient))
    host, _ = split_address(address)
    if is_ip(host) or host == "localhost":  # one server (localhost's v4 and v6 addresses are the same one)
        return plain(address, security=security, **options)
    if security is not None and security.uses_tls and security.server_name is None:
        security = dataclasses.replace(security, server_name=host)
    replicas = Replicas(role, address, lambda endpoint: plain(endpoint, security=security, **options),
                        refresh_s=refresh_s, resolve=resolve)
    return replicated(replicas)
