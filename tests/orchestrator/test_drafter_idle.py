"""VerifyRequest.drafter_idle: true for a pass no drafter call runs beside (a model-free draft, a
target-only step with no look-ahead), false for a pipelined pass whose look-ahead starts with it."""

from __future__ import annotations

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from specdec.generation import GenerationRequest
from specdec.sampling import SamplingParams

KEEPS_DRAFT_SOURCE_DEFAULT = True  # tests/orchestrator/conftest.py


class RecordingVerifier(InProcessVerifierClient):
    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.idle: list[bool] = []

    async def verify(self, request):
        self.idle.append(request.drafter_idle)
        return await super().verify(request)


def _request(source: str) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=12, method="token",
                             sampling=SamplingParams(1.0), seed=3, stop_token_ids=[], draft_source=source,
                             pipeline=True, k=2)


async def test_model_free_passes_say_the_drafter_is_idle(engines):
    verifier = RecordingVerifier(engines["verifier"])
    orch = Orchestrator(None, verifier, OrchestratorConfig())
    await orch.generate(_request("lookup"))
    assert verifier.idle and all(verifier.idle)


async def test_pipelined_passes_say_the_drafter_is_busy(engines):
    verifier = RecordingVerifier(engines["verifier"])
    orch = Orchestrator(InProcessDrafterClient(engines["draft"]), verifier, OrchestratorConfig())
    await orch.generate(_request("model"))
    assert False in verifier.idle  # the look-ahead runs beside those passes
