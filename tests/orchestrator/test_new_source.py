"""A new model-free draft source is one ModelFreeProposer subclass plus one PROPOSERS entry, with no
edit to the loop, the hybrid or the engines (docs/algorithms.md §8 walks through this example).

"Count up" proposes the next `depth` tokens after the last committed one, each one more than the one
before (mod the vocabulary): a sequence no model made. Through the real orchestrator and verifier
engine, with no drafter at all, its drafts are verified under token verification (draw-and-descend for
deterministic drafts) and ERSD, and the output passes the chi-square test against the target's exact
law. (The negative controls for deterministic drafts, a broken rule failing the same test, are in
test_model_free_drafting.py.)
"""

from __future__ import annotations

import os

import pytest

from orchestrator.clients.inprocess import InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.drafting import PROPOSERS
from orchestrator.drafting.model_free import Budget, ModelFreeProposer
from orchestrator.speculation import Orchestrator
from specdec.engine.verifier import VerifierEngine
from specdec.errors import InvalidRequest
from specdec.generation import GenerationRequest
from specdec.model_free import Proposal
from specdec.runtime.loading import load_model
from specdec.runtime.tiny import save_tiny_model
from specdec.sampling import SamplingParams
from tests.orchestrator.helpers import LENGTH, P_THRESHOLD, PROMPT, exact_distribution, p_values, sample

SAMPLES = int(os.environ.get("SPECDEC_FIDELITY_SAMPLES", "1000"))
VOCAB = 6
SAMPLING = SamplingParams(1.0)
TOY = "count-up"


class CountUp(ModelFreeProposer):
    """The whole source: a name and `propose`."""

    source = TOY

    def propose(self, committed: list[int], budget: Budget) -> Proposal | None:
        depth = min(3, budget.max_nodes, budget.max_depth)
        tokens = tuple((committed[-1] + i) % VOCAB for i in range(1, depth + 1))
        return Proposal(tokens=tokens, parents=tuple(range(-1, depth - 1)), probs=(0.5,) * depth,
                        match_len=1, source=TOY)


@pytest.fixture
def toy_source(monkeypatch):
    """The one registry entry."""
    monkeypatch.setitem(PROPOSERS, TOY, lambda run, context: CountUp(max_nodes=8))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("new-source")
    return load_model(save_tiny_model(root / "target", vocab_size=VOCAB, seed=111, num_layers=1), threads=1)


def _orchestrator(target) -> tuple[Orchestrator, list]:
    verifier = InProcessVerifierClient(VerifierEngine(target))
    orch = Orchestrator(None, verifier, OrchestratorConfig(pipeline=False))
    records: list = []
    orch.on_iteration = records.append
    return orch, records


async def test_a_new_source_is_asked_for_by_name_and_drafts(target, toy_source):
    orch, records = _orchestrator(target)
    request = GenerationRequest(prompt_ids=PROMPT, max_new_tokens=LENGTH, sampling=SAMPLING, method="token",
                                stop_token_ids=[], draft_source=TOY, seed=3)
    result = await orch.generate(request)
    assert len(result.token_ids) == LENGTH and result.stats.sources[TOY].drafted_tokens > 0
    assert all(r.source in (TOY, "") for r in records) and any(r.num_drafted for r in records)
    with pytest.raises(InvalidRequest, match="draft_source: unknown source 'count-down'"):
        await orch.generate(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=2, draft_source="count-down"))
    await orch.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["token", "ersd"])
async def test_a_new_source_keeps_the_target_law(target, toy_source, method):
    orch, records = _orchestrator(target)
    samples = await sample(orch, method, {"draft_source": TOY}, SAMPLING, range(SAMPLES))
    assert sum(r.num_drafted for r in records if r.source == TOY) > SAMPLES, "the source drafted"
    joint, first = p_values(samples, exact_distribution(target.model, PROMPT, SAMPLING, VOCAB))
    assert min(joint, first) > P_THRESHOLD, f"{method}: chi-square p = {joint:.2e} / {first:.2e}"
    await orch.close()
