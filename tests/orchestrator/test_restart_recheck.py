"""Engines re-checked after a restart (issue 14): a drafter restarted with a model of another
vocabulary turns requests target-only (exact: the output of a target-only run with the same seed),
with one log line and an "incompatible" dependency state, until a drafter that fits is back; one
restarted with a shorter context caps later drafts; a verifier restarted with another vocabulary makes
the orchestrator NOT_SERVING (requests UNAVAILABLE "verifier incompatible …") until one that fits is
back — never an orchestrator restart. Real gRPC engine servers restarted on the same port."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient
from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.server import start_orchestrator_server
from orchestrator.speculation import Orchestrator
from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.generation import GenerationRequest
from specdec.rpc.grpc_support import stop_server
from specdec.rpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from specdec.runtime.loading import load_model
from specdec.runtime.tiny import save_tiny_model
from specdec.sampling import SamplingParams

from .engine_servers import EngineServer, health_status, wait_health

pytestmark = pytest.mark.timeout(180)

SHORT_CONTEXT = 12
VOCAB = 6  # the vocabulary of conftest's models (the verifier's)
GREEDY = SamplingParams(temperature=0.0)


def _request(seed: int = 7, n: int = 12, **knobs) -> GenerationRequest:
    knobs.setdefault("k", 2)
    return GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=n, seed=seed, method="token",
                             stop_token_ids=[], **knobs)


@pytest.fixture(scope="module")
def short_drafter(tmp_path_factory) -> DrafterEngine:
    """The draft model's weights with a context window of SHORT_CONTEXT (same vocabulary)."""
    path = save_tiny_model(tmp_path_factory.mktemp("short") / "draft", vocab_size=VOCAB,
                           seed=202, max_position_embeddings=SHORT_CONTEXT)
    return DrafterEngine(load_model(path, threads=1))


@pytest.fixture(scope="module")
def vocab5_verifier(model_dirs) -> VerifierEngine:
    return VerifierEngine(load_model(model_dirs["vocab5"], threads=1))


def _config(**fields) -> OrchestratorConfig:
    return OrchestratorConfig(**{"pipeline": False, "drafter_retry_seconds": 0.2, "adaptive_k": False,
                                 "health_interval_s": 0.2, **fields})


def _incompatible_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("drafter incompatible")]


async def test_a_drafter_restarted_with_another_vocabulary_means_target_only(engines, caplog):
    verifier = await EngineServer("verifier").start(engines["verifier"])
    drafter = await EngineServer("drafter").start(engines["draft"])
    orch = Orchestrator(GrpcDrafterClient(drafter.address, timeout_s=30),
                        GrpcVerifierClient(verifier.address, timeout_s=30), _config())
    reference = Orchestrator(None, GrpcVerifierClient(verifier.address, timeout_s=30), _config())
    try:
        assert (await orch.generate(_request())).stats.drafted_iterations > 0

        await drafter.restart(engines["vocab5"])  # vocab_size 5 against the verifier's 6
        with caplog.at_level(logging.WARNING, logger="orchestrator.health"):
            for seed in (7, 8, 9):
                result = await orch.generate(_request(seed))
                alone = await reference.generate(_request(seed))
                assert result.token_ids == alone.token_ids, seed  # exact: as target-only
                assert result.stats.drafted_iterations == 0 and len(result.token_ids) == 12
                await asyncio.sleep(0.25)  # past the back-off: the drafter's info is read again
        status = orch.dependency_status()
        assert status["serving"] is True and status["drafter"]["state"] == "incompatible"
        assert "vocabulary mismatch" in status["drafter"]["detail"]
        assert "vocab_size 5" in status["drafter"]["detail"]
        assert len(_incompatible_lines(caplog)) == 1, caplog.text  # one line per change

        await drafter.restart(engines["draft"])  # the right model again
        for _ in range(50):  # bounded: the back-off is 0.2 s, each request takes a fraction of it
            result = await orch.generate(_request(10))
            if result.stats.drafted_iterations > 0:
                break
            await asyncio.sleep(0.1)
        assert result.stats.drafted_iterations > 0, "drafting did not resume"
        assert orch.dependency_status()["drafter"]["state"] == "ok"
    finally:
        await orch.close()
        await reference.close()
        await verifier.stop()
        await drafter.stop()


class SwitchingDrafter(InProcessDrafterClient):
    """An in-process drafter whose engine is swapped for another when `switch()` is called: a drafter
    restarted mid-request (the new engine knows none of the run's sessions)."""

    def __init__(self, engine, then) -> None:
        super().__init__(engine)
        self.then = then

    def switch(self) -> None:
        self.engine = self.then


@pytest.mark.parametrize("then", ["vocab5", "short"])
async def test_a_drafter_restarted_mid_request(engines, short_drafter, then):
    """SessionGone from the restarted drafter: its info is read before the context is resent; the
    request completes, exactly as the target alone would (greedy), drafting where the drafter fits."""
    replacement = short_drafter if then == "short" else engines[then]
    drafter = SwitchingDrafter(engines["draft"], replacement)
    orch = Orchestrator(drafter, InProcessVerifierClient(engines["verifier"]), _config(),
                        on_iteration=lambda record: drafter.switch() if record.index == 1 else None)
    result = await orch.generate(_request(n=20, sampling=GREEDY))
    alone = await Orchestrator(None, InProcessVerifierClient(engines["verifier"]), _config()).generate(
        _request(n=20, sampling=GREEDY))
    assert result.token_ids == alone.token_ids
    records = result.iterations
    assert records[0].drafted and records[1].drafted
    assert records[2].fallback, "the iteration that met the restarted drafter falls back"
    if then == "vocab5":
        assert not any(r.drafted for r in records[2:])
        assert orch.dependency_status()["drafter"]["state"] == "incompatible"
    else:
        assert orch.draft_info is not None and orch.draft_info.max_context == SHORT_CONTEXT
        # Later drafts fit the new window: every drafted node ends before it (its extra token included).
        assert all(r.position + r.num_drafted + 1 <= SHORT_CONTEXT for r in records[3:] if r.drafted)
        assert any(r.drafted for r in records[3:]), "the shorter drafter is still used where it fits"
        assert not any(r.fallback for r in records[3:])
        assert orch.dependency_status()["drafter"]["state"] == "ok"


async def test_a_verifier_restarted_with_another_vocabulary_is_not_serving(engines, vocab5_verifier):
    verifier = await EngineServer("verifier").start(engines["verifier"])
    orch = Orchestrator(None, GrpcVerifierClient(verifier.address, timeout_s=30), _config())
    server, port = await start_orchestrator_server(orch)
    request = generation_pb2.GenerationRequest(prompt_ids=common_pb2.TokenIds(ids=[1, 2]), max_new_tokens=4)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            await wait_health(port, "SERVING")
            await stub.Generate(request, timeout=30)

            # Restarted at once with another vocabulary: the monitor's next round reads its info.
            await verifier.restart(vocab5_verifier)
            took = await wait_health(port, "NOT_SERVING", timeout_s=10)
            assert took < 3.0
            for _ in range(3):
                start = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Generate(request, timeout=30)
                assert time.monotonic() - start < 1.5
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                details = caught.value.details()
                assert details.startswith("verifier incompatible") and "vocab_size 5" in details, details
                assert verifier.address not in details
                await asyncio.sleep(0.3)
            assert await health_status(port) == "NOT_SERVING"
            assert orch.dependency_status()["verifier"]["state"] == "incompatible"

            await verifier.restart(engines["verifier"])
            await wait_health(port, "SERVING", timeout_s=10)
            result = await stub.Generate(request, timeout=30)
            assert len(result.token_ids) >= 1
    finally:
        await stop_server(server, 0.5)
        await orch.close()
        await verifier.stop()
