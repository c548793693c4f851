"""End to end over the three-process pipeline (tiny models slowed to 30 ms per forward pass).

drafter, verifier and orchestrator run as separate processes wired the way the CLI wires them
(setup_observability); they export spans over OTLP/gRPC to a receiver in this test, and serve
/metrics. The test process is a traced client of the orchestrator, so every request is one
trace across four processes.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from orchestrator.intervals import intersections
from orchestrator.tracing import DRAFT_SPAN, ITERATION_SPAN, REQUEST_SPAN, VERIFY_SPAN, configure_tracing
from specdec.generation import GenerationRequest, GenerationResult

from .helpers import Node, OtlpReceiver, ancestors, by_id, named, node_env, scrape, total
from .test_dashboard import DASHBOARD, metric_names, queries

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SLEEP_S = 0.03
GENERATE = "/specdec.v1.GenerationService/Generate"
GENERATE_STREAM = "/specdec.v1.GenerationService/GenerateStream"


@dataclass
class Run:
    results: dict[str, GenerationResult] = field(default_factory=dict)
    spans: list[dict] = field(default_factory=list)
    before: dict[str, dict] = field(default_factory=dict)
    after: dict[str, dict] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)


def _request(method: str, n: int, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3, 4], max_new_tokens=n, method=method, seed=7,
                             stop_token_ids=[], **kw)


async def _client_requests(address: str, endpoint: str) -> dict[str, GenerationResult]:
    from specdec.client import AsyncClient

    tracing = configure_tracing("specdec-test-client", otlp_endpoint=endpoint)
    client = AsyncClient(address, interceptors=tracing.client_interceptors(), timeout_s=300)
    try:
        results = {
            "rd_a0": await client.generate(_request("rd", 6, k=2, a=0.0)),
            "rd_a1": await client.generate(_request("rd", 6, k=2, a=1.0, pipeline=False)),
        }
        async for chunk in client.generate_stream(_request("token", 8, k=3)):
            if chunk.result is not None:
                results["token"] = chunk.result
    finally:
        await client.close()
        await asyncio.to_thread(tracing.shutdown)
    return results


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_dirs) -> Run:
    workdir: Path = tmp_path_factory.mktemp("obs-pipeline")
    receiver = OtlpReceiver()
    env = node_env()
    common = ["--otlp-endpoint", receiver.endpoint, "--metrics-port", "0"]
    nodes: dict[str, Node] = {}
    out = Run()
    try:
        for role, model in (("drafter", "draft"), ("verifier", "target")):
            nodes[role] = Node(workdir, role, "--model", str(tiny_dirs[model]), "--sleep", str(SLEEP_S),
                               *common, env=env)
        for node in nodes.values():
            node.wait_ready()
        nodes["orchestrator"] = Node(workdir, "orchestrator", "--drafter", nodes["drafter"].address,
                                     "--verifier", nodes["verifier"].address, *common, env=env)
        nodes["orchestrator"].wait_ready()
        urls = {role: node.info["metrics_url"] for role, node in nodes.items()}
        out.before = {role: scrape(url) for role, url in urls.items()}
        out.results = asyncio.run(_client_requests(nodes["orchestrator"].address, receiver.endpoint))
        out.after = {role: scrape(url) for role, url in urls.items()}
    finally:
        for role in ("orchestrator", "drafter", "verifier"):  # SIGTERM: each flushes its spans on the way out
            if role in nodes:
                out.exit_codes[role] = nodes[role].stop()
        out.spans = receiver.snapshot()
        receiver.stop()
    return out


def test_services_stopped_cleanly(run):
    assert run.exit_codes == {"orchestrator": 0, "drafter": 0, "verifier": 0}


def test_one_trace_per_request_across_four_processes(run):
    spans = run.spans
    index = by_id(spans)
    services = {s["service"] for s in spans}
    assert {"specdec-orchestrator", "specdec-drafter", "specdec-verifier", "specdec-test-client"} <= services
    requests = named(spans, REQUEST_SPAN)
    assert len(requests) == len(run.results)
    for name, result in run.results.items():
        [request] = [s for s in requests if s["attributes"]["specdec.request_id"] == result.request_id]
        assert request["service"] == "specdec-orchestrator"
        # test client span → orchestrator server span → specdec.request
        chain = ancestors(request, index)
        rpc = GENERATE_STREAM if name == "token" else GENERATE
        assert [s["name"] for s in chain] == [rpc, rpc], chain
        assert [s["service"] for s in chain] == ["specdec-orchestrator", "specdec-test-client"]
        trace = [s for s in spans if s["trace_id"] == request["trace_id"]]
        assert {s["service"] for s in trace} == {"specdec-orchestrator", "specdec-drafter",
                                                 "specdec-verifier", "specdec-test-client"}
        iterations = [s for s in named(trace, ITERATION_SPAN) if s["parent_span_id"] == request["span_id"]]
        assert len(iterations) == result.stats.iterations == len(result.iterations)
        # every engine span sits under a call span of an iteration of this request, through the gRPC spans
        for engine_name, call, service in (("drafter.draft", DRAFT_SPAN, "specdec-drafter"),
                                           ("drafter.forward", DRAFT_SPAN, "specdec-drafter"),
                                           ("verifier.verify", VERIFY_SPAN, "specdec-verifier"),
                                           ("verifier.verification", VERIFY_SPAN, "specdec-verifier")):
            found = named(trace, engine_name)
            assert found, (name, engine_name)
            for span in found:
                assert span["service"] == service
                up = ancestors(span, index)
                names = [s["name"] for s in up]
                assert call in names and ITERATION_SPAN in names
                assert names.index(call) < names.index(ITERATION_SPAN)
                assert up[names.index(ITERATION_SPAN)]["parent_span_id"] == request["span_id"]
                served = [s for s in up if s["service"] == service and s["name"].startswith("/specdec.v1.")]
                # the service's own gRPC server span, child of the orchestrator's client span
                assert served, names
                assert index[served[0]["parent_span_id"]]["service"] == "specdec-orchestrator"
        drafted = sum(r.drafted for r in result.iterations)
        forward = named(trace, "drafter.forward")
        assert len(forward) == sum(len(r.draft_intervals) for r in result.iterations) >= drafted


def _iterations_of(run, name):
    result = run.results[name]
    [request] = [s for s in named(run.spans, REQUEST_SPAN)
                 if s["attributes"]["specdec.request_id"] == result.request_id]
    return result, [s for s in named(run.spans, ITERATION_SPAN) if s["parent_span_id"] == request["span_id"]]


def _span_overlap(run, iteration) -> float:
    calls = [s for s in run.spans if s["parent_span_id"] == iteration["span_id"]]
    drafts = [(s["start_ns"], s["end_ns"]) for s in named(calls, DRAFT_SPAN)]
    verifies = [(s["start_ns"], s["end_ns"]) for s in named(calls, VERIFY_SPAN)]
    return sum(e - s for s, e in intersections(drafts, verifies)) / 1e9


def test_rd_without_drafts_overlaps_most_of_the_verify_time(run):
    result, iterations = _iterations_of(run, "rd_a0")
    assert iterations and all(not s["attributes"]["specdec.drafted"] for s in iterations)
    overlap = sum(s["attributes"]["specdec.overlap_seconds"] for s in iterations)
    verify = sum(s["attributes"]["specdec.verify_seconds"] for s in iterations)
    assert overlap > 0.5 * verify, (overlap, verify)
    assert overlap == pytest.approx(result.stats.overlap_seconds, rel=1e-6)
    # the same figure from the call spans' own start/end
    assert sum(_span_overlap(run, s) for s in iterations) == pytest.approx(overlap, abs=1e-5)


def test_rd_always_drafting_has_no_overlap_when_not_pipelined(run):
    result, iterations = _iterations_of(run, "rd_a1")
    assert iterations and all(s["attributes"]["specdec.heads"] == 2 for s in iterations)
    assert sum(s["attributes"]["specdec.overlap_seconds"] for s in iterations) <= 1e-9
    assert sum(_span_overlap(run, s) for s in iterations) <= 1e-9
    assert result.stats.verify_seconds > 0


def test_metrics_move_with_the_run(run):
    before, after = run.before, run.after
    results = list(run.results.values())
    iterations = sum(r.stats.iterations for r in results)

    def delta(process, name, **labels):
        return total(after[process], name, **labels) - total(before[process], name, **labels)

    assert delta("orchestrator", "specdec_requests_total") == len(results)
    assert delta("orchestrator", "specdec_iterations_total") == iterations
    assert delta("orchestrator", "specdec_emitted_tokens_total") == sum(r.stats.new_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert delta("orchestrator", "specdec_accepted_tokens_total") == accepted
    assert delta("orchestrator", "specdec_overlap_seconds_total", method="rd") > 0
    assert delta("orchestrator", "specdec_iterations_total", method="rd", drafted="false") == \
        run.results["rd_a0"].stats.iterations
    # Count the orchestrator's draft-call spans: a pipelined look-ahead call still running when its
    # iteration ended is traced but not among the iteration's recorded intervals.
    draft_calls = len([s for s in named(run.spans, DRAFT_SPAN) if s["service"] == "specdec-orchestrator"])
    assert draft_calls >= sum(len(rec.draft_intervals) for r in results for rec in r.iterations)
    # Pipelined iterations look ahead with one Lookahead call (the loop's span says which call it was).
    lookaheads = len([s for s in named(run.spans, DRAFT_SPAN) if s["service"] == "specdec-orchestrator"
                      and s["attributes"].get("specdec.call") == "lookahead"])
    assert lookaheads > 0
    assert delta("drafter", "specdec_engine_calls_total", rpc="Lookahead", outcome="ok") == lookaheads
    drafts = delta("drafter", "specdec_engine_calls_total", rpc="Draft", outcome="ok")
    assert drafts == draft_calls - lookaheads
    assert delta("drafter", "specdec_forward_seconds_sum", role="drafter") >= SLEEP_S * draft_calls
    # A lean verify that met a rejection is resent with the draft rows it asked for (docs/algorithms.md
    # §12): one more Verify call, a loop span of its own.
    retries = delta("verifier", "specdec_draft_rows_requests_total", role="verifier")
    assert retries == len([s for s in named(run.spans, VERIFY_SPAN) if s["service"] == "specdec-orchestrator"
                           and s["attributes"].get("specdec.call") == "verify-rows"])
    assert delta("verifier", "specdec_engine_calls_total", rpc="Verify", outcome="ok") == iterations + retries
    assert delta("verifier", "specdec_sessions_created_total", role="verifier") >= len(results)
    for role in ("drafter", "verifier"):
        assert ("specdec_active_sessions", (("role", role),)) in after[role]
    assert total(after["orchestrator"], "specdec_active_requests") == 0
    # every metric the Grafana dashboard queries is served by one of the three endpoints
    served = {name for samples in after.values() for name, _ in samples}
    dashboard = json.loads(DASHBOARD.read_text())
    for expr in queries(dashboard):
        assert metric_names(expr) <= served, expr
