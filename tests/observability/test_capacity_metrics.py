"""Capacity metrics: the engines' KV budget, admission and batching stats and the orchestrator's
request slots, read at scrape time; keys an engine does not report are left out, not errors."""

from __future__ import annotations

import re
from pathlib import Path

from orchestrator import metrics
from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from specdec.engine.api import DraftRequest
from specdec.engine.sessions import SessionConfig
from specdec.errors import Overloaded
from specdec.sampling import SamplingParams

DOCS = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


class FakeEngine:
    """Reports only some keys (an engine without batching, or one before this change)."""

    def __init__(self, stats: dict[str, float]) -> None:
        self._stats = stats

    def stats(self) -> dict[str, float]:
        return self._stats


class BrokenEngine:
    def stats(self) -> dict[str, float]:
        raise RuntimeError("engine gone")


def test_batching_and_budget_stats_become_metrics_and_missing_keys_are_skipped():
    registry = metrics.new_registry(process=False)
    em = metrics.EngineMetrics(registry)
    em.watch_engine("verifier", FakeEngine({"queue_depth": 2, "batches": 5, "batch_calls": 12,
                                            "batch_tokens": 40, "kv_tokens": 300, "kv_budget_tokens": 1000}))
    em.watch_engine("drafter", FakeEngine({"active_sessions": 1}))
    em.watch_engine("broken", BrokenEngine())
    value = registry.get_sample_value
    assert value("specdec_batch_queue_depth", {"role": "verifier"}) == 2
    assert value("specdec_batches_total", {"role": "verifier"}) == 5
    assert value("specdec_batch_calls_total", {"role": "verifier"}) == 12
    assert value("specdec_batch_tokens_total", {"role": "verifier"}) == 40
    assert value("specdec_kv_tokens", {"role": "verifier"}) == 300
    assert value("specdec_kv_budget_tokens", {"role": "verifier"}) == 1000
    assert value("specdec_active_sessions", {"role": "drafter"}) == 1
    assert value("specdec_batches_total", {"role": "drafter"}) is None  # not reported: absent
    assert value("specdec_active_sessions", {"role": "broken"}) is None


def test_an_engine_with_a_budget_reports_tokens_evictions_and_rejections(tiny_loaded):
    from specdec.engine.drafter import DrafterEngine

    registry = metrics.new_registry(process=False)
    em = metrics.EngineMetrics(registry)
    drafter = DrafterEngine(tiny_loaded["draft"], SessionConfig(max_kv_tokens=6, admission_timeout_s=0))
    em.watch_engine("drafter", drafter)
    for session in ("s1", "s2"):  # 6 context tokens each: one session fills the budget
        drafter.draft(DraftRequest(session, 0, [1, 2, 3, 4, 5, 6], [-1], SamplingParams(), seed=1))
    with drafter.sessions.use("s2", 1):  # the only session left, busy, holding the budget
        try:
            drafter.draft(DraftRequest("s3", 0, [1, 2], [-1], SamplingParams(), seed=1))
            raise AssertionError("a full budget held by a busy session admitted a new one")
        except Overloaded:
            pass
    value = registry.get_sample_value
    labels = {"role": "drafter"}
    assert value("specdec_session_waiting_calls", labels) == 0
    assert value("specdec_kv_budget_tokens", labels) == 6
    assert value("specdec_kv_tokens", labels) == drafter.stats()["kv_tokens"] >= 6
    assert value("specdec_session_budget_evictions_total", labels) == 1  # s1 made way for s2
    assert value("specdec_session_evictions_total", labels) == 1
    assert value("specdec_session_rejections_total", labels) == 1  # s3
    drafter.sessions.close()


async def test_the_orchestrator_reports_its_request_slots(tiny_loaded):
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine

    registry = metrics.new_registry(process=False)
    om = metrics.OrchestratorMetrics(registry)
    orch = Orchestrator(InProcessDrafterClient(DrafterEngine(tiny_loaded["draft"])),
                        InProcessVerifierClient(VerifierEngine(tiny_loaded["target"])),
                        OrchestratorConfig(max_active_requests=3, queue_timeout_s=0), observer=om)
    om.watch_orchestrator(orch)
    value = registry.get_sample_value
    assert value("specdec_request_slots") == 3 and value("specdec_admitted_requests") == 0
    for _ in range(3):
        await orch.admission.acquire()
    assert value("specdec_admitted_requests") == 3 and value("specdec_queued_requests") == 0
    try:
        await orch.admission.acquire()
    except Overloaded:
        pass
    assert value("specdec_rejected_requests_total") == 1
    await orch.close()


def test_dependency_states_are_on_metrics():
    registry = metrics.new_registry(process=False)
    om = metrics.OrchestratorMetrics(registry)

    class Orchestrator:
        def admission_stats(self) -> dict:
            return {}

        def dependency_status(self) -> dict:
            return {"serving": False, "verifier": {"state": "unreachable"}, "drafter": {"state": "ok"},
                    "store": {"state": "absent"}, "drafter_timeouts": 3}

    om.watch_orchestrator(Orchestrator())
    value = registry.get_sample_value
    assert value("specdec_dependency_up", {"dependency": "verifier"}) == 0
    assert value("specdec_dependency_up", {"dependency": "drafter"}) == 1
    assert value("specdec_dependency_up", {"dependency": "store"}) is None
    assert value("specdec_serving") == 0 and value("specdec_drafter_timeouts_total") == 3


def test_an_overloaded_engine_call_has_its_own_outcome():
    assert metrics.call_outcome(Overloaded("KV budget full")) == "overloaded"


def test_the_capacity_metrics_are_documented():
    docs = DOCS.read_text()
    module_doc = metrics.__doc__ or ""
    tables = [metrics._SESSION_STATS, metrics._ADMISSION_STATS, metrics._DEPENDENCY_STATS,
              metrics._HEALTH_STATS]
    for table in tables:
        for name, _, kind in table.values():
            exposed = name + ("_total" if kind == "counter" else "")
            assert exposed in module_doc, f"{exposed} missing from orchestrator/metrics.py's docstring"
    for name in ("specdec_kv_tokens", "specdec_kv_budget_tokens", "specdec_session_budget_evictions_total",
                 "specdec_session_waiting_calls", "specdec_session_rejections_total",
                 "specdec_batch_queue_depth", "specdec_batches_total", "specdec_batch_calls_total",
                 "specdec_batch_tokens_total", "specdec_admitted_requests", "specdec_queued_requests",
                 "specdec_rejected_requests_total", "specdec_request_slots"):
        assert re.search(rf"`{name}[{{`]", docs), f"{name} missing from docs/observability.md"
