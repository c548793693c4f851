"""One client's huge request must not stall the others beyond its own fair share (issue 14).

A real drafter, verifier and orchestrator on loopback gRPC (tiny models, batching on, in this process;
every forward pass takes at least PASS_S, as a bigger model's would, so the big request's length does
not depend on the machine): one client asks for a prompt of BIG_PROMPT tokens and BIG_NEW new ones
(the context nearly full) while three clients send small requests. Each request has one engine call
in flight at a time and the engines batch the passes of concurrent calls, so a small request's latency
grows by a bounded factor, not by the big request's length. The bound is generous (≤ 5 × alone + 2 s,
for 2 busy cores), and the second test shows it has teeth: an orchestrator that runs one request at a
time (a monopoly) breaks it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from drafter_service.server import start_drafter_server  # noqa: E402
from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient  # noqa: E402
from orchestrator.config import OrchestratorConfig  # noqa: E402
from orchestrator.server import start_orchestrator_server  # noqa: E402
from orchestrator.speculation import Orchestrator  # noqa: E402
from specdec.client import AsyncClient  # noqa: E402
from specdec.engine.drafter import DrafterEngine  # noqa: E402
from specdec.engine.verifier import VerifierEngine  # noqa: E402
from specdec.generation import GenerationRequest  # noqa: E402
from specdec.rpc.grpc_support import stop_server  # noqa: E402
from specdec.runtime.batch_config import BatchConfig  # noqa: E402
from specdec.runtime.loading import LoadedModel, load_model  # noqa: E402
from verifier_service.server import start_verifier_server  # noqa: E402

from .helpers import TINY_CONTEXT  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

VOCAB = 8
BIG_PROMPT = 600
BIG_NEW = TINY_CONTEXT - BIG_PROMPT - 24  # the context nearly full
PASS_S = 0.004  # the least time of a forward pass
SMALL_NEW = 8
SMALL_CLIENTS = 3
FACTOR, SLACK_S = 5.0, 2.0  # allowed: FACTOR × the small requests' latency alone + SLACK_S
WAIT_S = 30.0  # bound of a wait for the orchestrator's state (never reached unless something is broken)


def _slowed(path) -> LoadedModel:
    loaded = load_model(path, threads=1)
    loaded.model.register_forward_pre_hook(lambda module, args: time.sleep(PASS_S))
    return loaded


@pytest.fixture(scope="module")
def engines(tiny_models):
    batching = BatchConfig(enabled=True)
    return (DrafterEngine(_slowed(tiny_models.draft), batching=batching),
            VerifierEngine(_slowed(tiny_models.target), batching=batching))


async def _serve(engines, **config) -> tuple[AsyncClient, Orchestrator, Callable[[], Awaitable[None]]]:
    """Drafter, verifier and orchestrator servers; returns a client, the orchestrator and what stops
    them all."""
    drafter_server, dport = await start_drafter_server(engines[0])
    verifier_server, vport = await start_verifier_server(engines[1])
    orch = Orchestrator(GrpcDrafterClient(f"127.0.0.1:{dport}"), GrpcVerifierClient(f"127.0.0.1:{vport}"),
                        OrchestratorConfig(**config))
    server, port = await start_orchestrator_server(orch)
    client = AsyncClient(f"127.0.0.1:{port}", timeout_s=180)

    async def close() -> None:
        await client.close()
        await stop_server(server, 1.0)
        await orch.close()
        await stop_server(drafter_server, 1.0)
        await stop_server(verifier_server, 1.0)

    return client, orch, close


def _small(i: int) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1 + i % 6, 2, 3, 4, 5, 6], max_new_tokens=SMALL_NEW, seed=100 + i,
                             stop_token_ids=[])


def _big() -> GenerationRequest:
    prompt = [(5 * i + 1) % (VOCAB - 1) for i in range(BIG_PROMPT)]
    return GenerationRequest(prompt_ids=prompt, max_new_tokens=BIG_NEW, seed=1, stop_token_ids=[])


async def _timed(client: AsyncClient, request: GenerationRequest) -> float:
    start = time.monotonic()
    result = await client.generate(request)
    assert len(result.token_ids) == request.max_new_tokens
    return time.monotonic() - start


async def _small_latency(client: AsyncClient, round_: int) -> float:
    """The slowest of SMALL_CLIENTS concurrent small requests."""
    latencies = await asyncio.gather(*(_timed(client, _small(round_ * 10 + i)) for i in range(SMALL_CLIENTS)))
    return max(latencies)


async def _running(orch: Orchestrator, count: int, what: str) -> None:
    """Wait (bounded) until `count` requests hold the orchestrator's slots."""
    deadline = time.monotonic() + WAIT_S
    while orch.admission_stats()["active"] != count:
        assert time.monotonic() < deadline, f"not within {WAIT_S:g} s: {what} ({orch.admission_stats()})"
        await asyncio.sleep(0.01)


async def _with_big(client: AsyncClient, orch: Orchestrator) -> tuple[float, float]:
    """(the slowest small request, the big one) when the small ones come just after the big one."""
    await _running(orch, 0, "the earlier small requests ended")
    began = time.monotonic()
    big = asyncio.create_task(_timed(client, _big()))
    # The big request holds its slot (it is in its prefill, or past it) before the small ones come,
    # however long its trip through gRPC takes on this machine; and no sooner than 50 ms after it left.
    await _running(orch, 1, "the big request admitted")
    await asyncio.sleep(max(0.0, 0.05 - (time.monotonic() - began)))
    small = await _small_latency(client, 5)
    return small, await big


async def _alone(client: AsyncClient) -> float:
    await _small_latency(client, 0)  # warm-up (first calls, channels)
    return min([await _small_latency(client, 1), await _small_latency(client, 2)])


async def test_a_huge_request_does_not_stall_small_ones(engines):
    client, orch, close = await _serve(engines)
    try:
        alone = await _alone(client)
        small, big = await _with_big(client, orch)
    finally:
        await close()
    seen = f"small {small:.2f} s beside the big one ({big:.1f} s), alone {alone:.2f} s"
    assert small <= FACTOR * alone + SLACK_S, seen


async def test_the_bound_fails_when_one_request_holds_the_engines(engines):
    """The same load on an orchestrator that runs one request at a time: the small requests wait for the
    whole big one, far past the bound (the check above can fail)."""
    client, orch, close = await _serve(engines, max_active_requests=1, queue_timeout_s=120.0)
    try:
        alone = await _alone(client)
        small, big = await _with_big(client, orch)
    finally:
        await close()
    seen = f"monopoly: small {small:.2f} s beside the big one ({big:.1f} s), alone {alone:.2f} s"
    assert small > FACTOR * alone + SLACK_S, seen
