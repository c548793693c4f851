"""A target-only request running alone has the verifier score each next step ahead
(Orchestrator._scores_ahead, VerifyRequest.score_ahead) over a real gRPC verifier: the output is the
one it has without, the steps take the parked rows, and a run asks for no pass it will not use."""

from __future__ import annotations

import pytest

from orchestrator.clients.grpc_client import GrpcVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from specdec.generation import GenerationRequest
from specdec.sampling_params import SamplingParams

from .engine_servers import EngineServer

pytestmark = pytest.mark.timeout(120)
TOKENS = 20


def _request(name: str, method: str, temperature: float, tokens: int = TOKENS) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=tokens, stop_token_ids=[], method=method,
                             sampling=SamplingParams(temperature=temperature), seed=5, request_id=name)


async def _generate(engine, requests: list[GenerationRequest], **config) -> tuple[list[list[int]], dict]:
    """The requests' tokens in turn on a fresh orchestrator over a gRPC verifier, and what the verifier
    engine's ahead counters moved by."""
    verifier = await EngineServer("verifier").start(engine)
    orchestrator = Orchestrator(None, GrpcVerifierClient(verifier.address, timeout_s=30),
                                OrchestratorConfig(pipeline=False, **config))
    before = {"ahead": engine.ahead_scores, "hits": engine.score_hits}
    try:
        outputs = [list((await orchestrator.generate(request)).token_ids) for request in requests]
    finally:
        await orchestrator.close()
        await verifier.stop()
    if engine._ahead is not None:  # the thread scoring ahead has finished what was asked of it
        engine._ahead.submit(lambda: None).result(timeout=30)
    return outputs, {"ahead": engine.ahead_scores - before["ahead"],
                     "hits": engine.score_hits - before["hits"]}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_target_only_steps_scored_ahead_emit_the_same_tokens(engines, temperature):
    engine = engines["verifier"]
    plain, moved = await _generate(engine, [_request(f"plain-{temperature}", "autoregressive", temperature)],
                                   score_ahead=False)
    assert moved == {"ahead": 0, "hits": 0}
    ahead, moved = await _generate(engine, [_request(f"ahead-{temperature}", "autoregressive", temperature)])
    assert ahead == plain and len(ahead[0]) == TOKENS
    # Asked for every step with a next one to come (TOKENS - 1 of TOKENS); a verify that overtook its
    # pass (a busy machine) runs its own, so at least one hit, and no pass asked for at the end.
    assert 1 <= moved["ahead"] <= TOKENS - 1
    assert 1 <= moved["hits"] <= moved["ahead"]


async def test_speculative_and_one_token_requests_score_nothing_ahead(engines):
    engine = engines["verifier"]
    requests = [_request("spec", "ersd", 0.0), _request("one", "autoregressive", 0.0, 1)]
    _, moved = await _generate(engine, requests)
    assert moved == {"ahead": 0, "hits": 0}
