"""A fifth draft shape plugs in as one object plus one registry entry (SHAPES), with no edit to the loop.

"Repeat the last token" drafts k copies of the last committed token, with no draft model at all (the
orchestrator here has no drafter). Its drafts are deterministic, so they are exact under ERSD (a
draft token is accepted exactly when it is the target's race winner, docs/algorithms.md §4) and
under token verification with one-hot draft rows (x̃ accepted with probability p(x̃), the residual
is p without x̃). Through the real orchestrator and verifier engine the output passes the
chi-square test against the target's exact law; the same strategy sending uniform rows instead of
its one-hot ones (a lie about q) must fail it, which shows the test can notice.
"""

from __future__ import annotations

import os

import pytest
import torch

from orchestrator.clients.inprocess import InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.drafting import SHAPES
from orchestrator.drafting.base import Draft, Plan, Step
from orchestrator.drafting.shapes import ShapeBase
from orchestrator.speculation import Orchestrator
from specdec.engine.verifier import VerifierEngine
from specdec.methods import METHODS, Method
from specdec.runtime.loading import load_model
from specdec.runtime.tiny import save_tiny_model
from specdec.sampling import SamplingParams
from specdec.trees import DraftTree, sequence_parents
from tests.orchestrator.helpers import P_THRESHOLD, PROMPT, exact_distribution, p_values, sample

pytestmark = pytest.mark.slow

SAMPLES = int(os.environ.get("SPECDEC_FIDELITY_SAMPLES", "1000"))
VOCAB = 6


class RepeatLast(ShapeBase):
    """Drafts k copies of the last committed token; rows: "one-hot" (the truth), "uniform" (a lie)."""

    def __init__(self, k: int, rows: str | None) -> None:
        self.k = k
        self.rows = rows

    def plan(self, step: Step) -> Plan | None:
        length = min(self.k, step.depth_cap(step.position))
        if length <= 0:
            return None
        return Plan(sequence_parents(length), self.k, step.params(), needs_drafter=False)

    async def draft(self, step: Step, plan: Plan, ready=None) -> Draft:
        n, last = len(plan.shape), step.committed[-1]
        rows = None
        if self.rows is not None:
            rows = torch.full((n + 1, VOCAB), 1.0 / VOCAB, dtype=torch.float64)
            if self.rows == "one-hot":
                rows[:n] = 0.0
                rows[:n, last] = 1.0
        tree = DraftTree((last,) * n, tuple(sequence_parents(n)))
        return Draft(tree, rows, step.settings.method, plan.params, plan=plan)


def _register(monkeypatch, name: str, rule: str, rows: str | None) -> None:
    """The shape's one registry entry, and the method that drafts with it."""
    monkeypatch.setitem(SHAPES, name, lambda run, context: RepeatLast(run.settings.k, rows))
    token_rule = rule.endswith("verify_token")
    monkeypatch.setitem(METHODS, name, Method(
        name=name, summary="repeat the last token (test)", rule=rule, drafting=name,
        needs_draft_rows=token_rule, needs_random_source=token_rule,
        draft_strategy="sample" if token_rule else "race", draft_shapes=frozenset({"sequence"}),
    ))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("fifth-strategy")
    return load_model(save_tiny_model(root / "target", vocab_size=VOCAB, seed=111, num_layers=1), threads=1)


@pytest.mark.parametrize("name, rule, rows, exact", [
    ("repeat-ersd", "specdec.verification.ersd:verify_ersd", None, True),
    ("repeat-token", "specdec.verification.token:verify_token", "one-hot", True),
    ("repeat-token-lying", "specdec.verification.token:verify_token", "uniform", False),
])
async def test_a_fifth_strategy_plugs_in_and_stays_exact(target, monkeypatch, name, rule, rows, exact):
    _register(monkeypatch, name, rule, rows)
    orch = Orchestrator(None, InProcessVerifierClient(VerifierEngine(target)), OrchestratorConfig())
    drafted = []
    orch.on_iteration = lambda record: drafted.append(record.num_drafted)
    samples = await sample(orch, name, {"k": 2}, SamplingParams(1.0), range(SAMPLES))
    assert sum(drafted) > SAMPLES, "the strategy drafted (with no drafter at all)"
    joint, first = p_values(samples, exact_distribution(target.model, PROMPT, SamplingParams(1.0), VOCAB))
    if exact:
        assert min(joint, first) > P_THRESHOLD, f"{name}: chi-square p = {joint:.2e} / {first:.2e}"
    else:
        assert min(joint, first) < P_THRESHOLD, f"a lie about q passed: p = {joint:.2e} / {first:.2e}"
