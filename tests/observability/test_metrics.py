"""Prometheus metrics: the loop's counters agree with the generation statistics, the engines'
counters move with their calls, and /metrics serves them."""

from __future__ import annotations

import pytest

from orchestrator import metrics
from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.speculation import Orchestrator
from specdec.cli.observability import setup_observability
from specdec.engine.api import DraftRequest
from specdec.engine.sessions import SessionConfig
from specdec.generation import GenerationRequest
from specdec.sampling import SamplingParams

from .helpers import scrape, total


def _request(method: str, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=kw.pop("max_new_tokens", 14), method=method,
                             seed=kw.pop("seed", 3), stop_token_ids=[], **kw)


async def test_loop_metrics_agree_with_the_statistics(engines):
    registry = metrics.new_registry()
    om = metrics.OrchestratorMetrics(registry)
    drafter, verifier = engines
    orch = Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier), observer=om)
    results = [await orch.generate(_request("token", k=3)),
               await orch.generate(_request("rd", k=3, a=0.5, seed=8)),
               await orch.generate(_request("gsd-tree", k=6, seed=2))]
    with pytest.raises(Exception, match="prompt"):
        await orch.generate(GenerationRequest(prompt_ids=[99], method="token"))  # out of vocabulary
    await orch.close()
    server = metrics.start_metrics_server(0, registry=registry)
    try:
        samples = scrape(server.url)
    finally:
        server.close()

    for result in results:
        method, stats = result.method, result.stats
        records = result.iterations
        assert total(samples, "specdec_requests_total", method=method, outcome=result.finish_reason) == 1
        assert total(samples, "specdec_emitted_tokens_total", method=method) == stats.new_tokens
        assert total(samples, "specdec_drafted_tokens_total", method=method) == stats.drafted_tokens
        assert total(samples, "specdec_accepted_tokens_total", method=method) == stats.accepted_tokens
        assert total(samples, "specdec_iterations_total", method=method) == stats.iterations
        assert total(samples, "specdec_iterations_total", method=method, drafted="true") == \
            stats.drafted_iterations == sum(r.drafted for r in records)
        for position, count in enumerate(stats.drafted_per_position):
            assert total(samples, "specdec_position_drafted_total", method=method,
                         position=str(position)) == count
        for position, count in enumerate(stats.accepted_per_position):
            assert total(samples, "specdec_position_accepted_total", method=method,
                         position=str(position)) == count
        assert total(samples, "specdec_overlap_seconds_total", method=method) == pytest.approx(
            stats.overlap_seconds, abs=1e-6)
        assert total(samples, "specdec_verify_busy_seconds_total", method=method) == pytest.approx(
            stats.verify_seconds, abs=1e-6)
        assert total(samples, "specdec_iteration_seconds_count", method=method) == stats.iterations
        assert total(samples, "specdec_draft_call_seconds_count", method=method) == sum(
            len(r.draft_intervals) for r in records)
    # by draft source: the same counts as the statistics' (GenerationStats.sources)
    names = {name for result in results for name in result.stats.sources}
    assert names  # these runs drafted (with the draft model at least)
    for name in names:
        mine = [r.stats.sources[name] for r in results if name in r.stats.sources]
        assert total(samples, "specdec_source_drafts_total", source=name) == sum(s.drafts for s in mine)
        assert total(samples, "specdec_source_drafted_tokens_total", source=name) == sum(
            s.drafted_tokens for s in mine)
        assert total(samples, "specdec_source_accepted_tokens_total", source=name) == sum(
            s.accepted_tokens for s in mine)
        assert total(samples, "specdec_source_accepted_length_sum", source=name) == sum(
            s.accepted_tokens for s in mine)
    assert total(samples, "specdec_source_drafts_total") == total(samples, "specdec_iterations_total",
                                                                  drafted="true")
    # RD's no-draft steps overlap drafter and verifier: the ratio histogram saw them
    assert total(samples, "specdec_iteration_overlap_ratio_count", method="rd") > 0
    # the bad request never became a run (refused before it started): counted nowhere
    assert total(samples, "specdec_requests_total") == len(results)
    assert total(samples, "specdec_active_requests") == 0
    assert total(samples, "process_cpu_seconds_total") > 0


async def test_engine_metrics_move_with_calls_over_grpc(tiny_loaded):
    """The engine observers behind real servers; evictions and sessions read at scrape time."""
    from drafter_service.server import start_drafter_server
    from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine
    from specdec.rpc.grpc_support import stop_server
    from verifier_service.server import start_verifier_server

    drafter = DrafterEngine(tiny_loaded["draft"], SessionConfig(max_sessions=1))
    verifier = VerifierEngine(tiny_loaded["target"])
    d_obs = setup_observability("drafter", metrics_port=0)
    v_obs = setup_observability("verifier", metrics_port=0)
    d_obs.watch_engine(drafter)
    v_obs.watch_engine(verifier)
    assert d_obs.tracing is None and d_obs.server_interceptors == []  # tracing stays off
    dserver, dport = await start_drafter_server(drafter, observers=d_obs.service_observers)
    vserver, vport = await start_verifier_server(verifier, observers=v_obs.service_observers)
    try:
        before = scrape(d_obs.metrics_server.url)
        assert total(before, "specdec_engine_calls_total") == 0
        assert total(before, "specdec_active_sessions", role="drafter") == 0
        orch = Orchestrator(GrpcDrafterClient(f"127.0.0.1:{dport}"), GrpcVerifierClient(f"127.0.0.1:{vport}"))
        result = await orch.generate(_request("rd", k=2, a=0.0, max_new_tokens=5))  # score + verify steps
        await orch.close()
        # two direct sessions on a drafter that keeps one: the first is evicted
        for session in ("s1", "s2"):
            drafter.draft(DraftRequest(session, 0, [1, 2], [-1], SamplingParams(), seed=1))
        d, v = scrape(d_obs.metrics_server.url), scrape(v_obs.metrics_server.url)
    finally:
        await stop_server(dserver, 0)
        await stop_server(vserver, 0)
        d_obs.shutdown()
        v_obs.shutdown()
    iterations = result.stats.iterations
    assert total(d, "specdec_engine_calls_total", role="drafter", rpc="Draft", outcome="ok") == iterations
    assert total(d, "specdec_forward_seconds_count", role="drafter", rpc="Draft") == iterations
    assert total(d, "specdec_forward_seconds_sum", role="drafter") > 0
    assert total(d, "specdec_session_evictions_total", role="drafter") == 1
    assert total(d, "specdec_sessions_created_total", role="drafter") == 3
    assert total(d, "specdec_active_sessions", role="drafter") == 1  # s2 (the run's session was released)
    assert total(v, "specdec_engine_calls_total", role="verifier", rpc="Score", outcome="ok") == iterations
    # the first Verify of a session may meet SessionGone and be resent: ok calls = iterations
    assert total(v, "specdec_engine_calls_total", role="verifier", rpc="Verify", outcome="ok") == iterations
    assert total(v, "specdec_verification_seconds_count", method="rd") == iterations
    assert total(v, "specdec_score_hits_total", role="verifier") == iterations
    assert total(v, "specdec_sessions_released_total", role="verifier") == 1
    assert total(v, "specdec_active_sessions", role="verifier") == 0
    assert not [k for k in d if k[0].startswith("specdec_requests")]  # orchestrator metrics live elsewhere


def test_metrics_port_in_use_is_a_clear_error():
    first = metrics.start_metrics_server(0)
    try:
        with pytest.raises(OSError, match="could not serve metrics"):
            setup_observability("orchestrator", metrics_port=first.port)
    finally:
        first.close()


def test_call_outcomes_tell_protocol_from_failure():
    import asyncio

    from specdec.errors import InvalidRequest, SessionGone

    assert metrics.call_outcome(None) == "ok"
    assert metrics.call_outcome(SessionGone("resend")) == "session_gone"
    assert metrics.call_outcome(InvalidRequest("k")) == "invalid"
    assert metrics.call_outcome(asyncio.CancelledError()) == "cancelled"
    assert metrics.call_outcome(RuntimeError("boom")) == "error"
