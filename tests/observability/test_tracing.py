"""Tracing: configuration from options and OTEL_* variables, the loop's spans, propagation over gRPC."""

from __future__ import annotations

import pytest

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from orchestrator.tracing import (
    DRAFT_SPAN,
    ITERATION_SPAN,
    REQUEST_SPAN,
    VERIFY_SPAN,
    combine_observers,
    configure_tracing,
    otlp_settings,
    read_spans,
)
from specdec.generation import GenerationRequest

from .helpers import ancestors, by_id, named

PROMPT = [1, 2, 3, 4]


def _request(method: str, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(PROMPT), max_new_tokens=kw.pop("max_new_tokens", 12),
                             method=method, seed=kw.pop("seed", 5), stop_token_ids=[], **kw)


# ------------------------------------------------------------------------------ configuration


def test_tracing_is_off_unless_configured(monkeypatch, tmp_path):
    assert configure_tracing("specdec-test") is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert configure_tracing("specdec-test") is None  # an endpoint, but export switched off
    assert otlp_settings("127.0.0.1:1") is None
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert configure_tracing("specdec-test", trace_file=tmp_path / "x.jsonl") is None


def test_otlp_settings_follow_the_standard_variables(monkeypatch):
    assert otlp_settings() is None
    assert otlp_settings("collector:4317") == ("grpc", "collector:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert otlp_settings() == ("http/protobuf", None)  # the exporter reads the endpoint itself
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    assert otlp_settings() == ("grpc", None)  # the per-signal variable wins
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    with pytest.raises(ValueError, match="protocol"):
        otlp_settings()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL")
    assert otlp_settings() is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")  # asked for: the exporter's default endpoint
    assert otlp_settings() == ("grpc", None)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert otlp_settings("collector:4317") is None


def test_service_name_and_file_sink(monkeypatch, tmp_path):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    tracing = configure_tracing("specdec-orchestrator", trace_file=tmp_path / "spans.jsonl",
                                role="orchestrator")
    assert tracing is not None and tracing.service_name == "from-env"
    with tracing.tracer.start_as_current_span("outer", attributes={"n": 3, "ok": True, "ids": [1, 2]}):
        with tracing.tracer.start_as_current_span("inner"):
            pass
    tracing.shutdown()
    spans = read_spans(tmp_path / "spans.jsonl")
    assert [s["name"] for s in spans] == ["outer", "inner"]
    outer, inner = spans
    assert inner["parent_span_id"] == outer["span_id"] and outer["parent_span_id"] is None
    assert inner["trace_id"] == outer["trace_id"] and len(outer["trace_id"]) == 32
    assert outer["attributes"] == {"n": 3, "ok": True, "ids": [1, 2]}
    assert outer["service"] == "from-env" and outer["resource"]["specdec.role"] == "orchestrator"
    assert outer["start_ns"] <= inner["start_ns"] <= inner["end_ns"] <= outer["end_ns"]


# ------------------------------------------------------------------------------ the loop's spans


async def _traced_run(engines, tmp_path, requests, observer_extra=None):
    tracing = configure_tracing("specdec-test", trace_file=tmp_path / "spans.jsonl")
    drafter, verifier = engines
    observer = combine_observers(tracing.loop_observer(), observer_extra)
    # Sequential: every call then ends inside its iteration, so spans and records match one to one
    # (a pipelined look-ahead still running at the iteration's end has a span but no record interval).
    orch = Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier),
                        OrchestratorConfig(pipeline=False), observer=observer)
    try:
        results = [await orch.generate(r) for r in requests]
    finally:
        await orch.close()
        tracing.shutdown()
    return results, read_spans(tmp_path / "spans.jsonl")


async def test_request_iteration_and_call_spans_match_the_records(engines, tmp_path):
    requests = [_request("token", k=3), _request("rd", k=3, a=0.5, seed=9), _request("gsd-tree", k=6)]
    results, spans = await _traced_run(engines, tmp_path, requests)
    index = by_id(spans)
    assert len(named(spans, REQUEST_SPAN)) == len(results)
    for result in results:
        [req] = [s for s in named(spans, REQUEST_SPAN)
                 if s["attributes"]["specdec.request_id"] == result.request_id]
        assert req["attributes"]["specdec.method"] == result.method
        assert req["attributes"]["specdec.iterations"] == result.stats.iterations
        assert req["attributes"]["specdec.new_tokens"] == len(result.token_ids)
        iterations = sorted(
            (s for s in named(spans, ITERATION_SPAN) if s["parent_span_id"] == req["span_id"]),
            key=lambda s: s["attributes"]["specdec.iteration"])
        assert len(iterations) == result.stats.iterations == len(result.iterations)
        for span, record in zip(iterations, result.iterations, strict=True):
            a = span["attributes"]
            assert a["specdec.iteration"] == record.index
            assert (a["specdec.drafted"], a["specdec.k"], a["specdec.accepted"]) == (
                record.drafted, record.k, record.accepted)
            assert a["specdec.emitted"] == len(record.emitted)
            assert not any("token_ids" in key for key in a)  # no generated content in traces
            assert a["specdec.method"] == record.method
            assert a["specdec.overlap_seconds"] == pytest.approx(record.overlap_seconds)
            if result.method == "rd":
                assert a["specdec.a"] == 0.5 and a["specdec.heads"] == record.heads
            calls = [s for s in spans if s["parent_span_id"] == span["span_id"]]
            drafts, verifies = named(calls, DRAFT_SPAN), named(calls, VERIFY_SPAN)
            assert len(drafts) == len(record.draft_intervals)
            assert len(verifies) == len(record.verify_intervals)
            for call in calls:
                assert span["start_ns"] <= call["start_ns"] <= call["end_ns"] <= span["end_ns"]
            # the very instants of the record (its intervals are listed in the order the calls ended)
            for spans_of_kind, intervals in ((drafts, record.draft_intervals),
                                             (verifies, record.verify_intervals)):
                got = sorted((s["start_ns"], s["end_ns"]) for s in spans_of_kind)
                assert got == sorted((round(a * 1e9), round(b * 1e9)) for a, b in intervals)
            assert (span["start_ns"], span["end_ns"]) == (round(record.start * 1e9), round(record.end * 1e9))
            assert ancestors(span, index)[0] is req
    assert sum(r.stats.iterations for r in results) == len(named(spans, ITERATION_SPAN))


async def test_tracing_does_not_change_the_output(engines, tmp_path):
    request = _request("ersd", k=3, seed=21, max_new_tokens=16)
    traced, _ = await _traced_run(engines, tmp_path, [request])
    drafter, verifier = engines
    plain_orch = Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier))
    plain = await plain_orch.generate(request)
    assert traced[0].token_ids == plain.token_ids


class _Broken:
    """An observer whose end-of-iteration and end-of-request hooks raise."""

    def __init__(self) -> None:
        self.calls = 0

    def request_started(self, request_id, epoch, attributes):
        return self

    def iteration(self, index, start):
        import contextlib

        return contextlib.nullcontext(self)

    def call_started(self, kind, op, start):
        return None

    def call_finished(self, token, end, error):
        raise RuntimeError("observer bug")

    def finished(self, *args):
        self.calls += 1
        raise RuntimeError("observer bug")


async def test_a_failing_observer_does_not_fail_the_request(engines, tmp_path):
    broken = _Broken()
    results, spans = await _traced_run(engines, tmp_path, [_request("token", k=2)], observer_extra=broken)
    # every iteration's and the request's `finished` raised, and every call's call_finished
    assert results[0].stats.iterations > 0 and broken.calls == results[0].stats.iterations + 1
    assert len(named(spans, ITERATION_SPAN)) == results[0].stats.iterations  # tracing unaffected


# ------------------------------------------------------------------------------ over gRPC


async def test_trace_context_crosses_grpc_into_the_services(engines, tmp_path):
    """Servers and clients in this process, but every call over loopback gRPC with the interceptors."""
    from drafter_service.server import start_drafter_server
    from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient
    from specdec.rpc.grpc_support import stop_server
    from verifier_service.server import start_verifier_server

    tracing = configure_tracing("specdec-test", trace_file=tmp_path / "spans.jsonl")
    drafter, verifier = engines
    dserver, dport = await start_drafter_server(drafter, interceptors=tracing.server_interceptors(),
                                                observers=[tracing.service_observer("drafter")])
    vserver, vport = await start_verifier_server(verifier, interceptors=tracing.server_interceptors(),
                                                 observers=[tracing.service_observer("verifier")])
    dclient = GrpcDrafterClient(f"127.0.0.1:{dport}", interceptors=tracing.client_interceptors())
    vclient = GrpcVerifierClient(f"127.0.0.1:{vport}", interceptors=tracing.client_interceptors())
    orch = Orchestrator(dclient, vclient, observer=tracing.loop_observer())
    try:
        assert await vclient.is_serving()  # health checks are not traced
        result = await orch.generate(_request("rd", k=2, a=0.0, max_new_tokens=4))
        with pytest.raises(Exception, match="method"):  # errors keep their mapping with interceptors
            await orch.generate(_request("nonsense"))
    finally:
        await orch.close()
        await stop_server(dserver, 0)
        await stop_server(vserver, 0)
        tracing.shutdown()
    spans = read_spans(tmp_path / "spans.jsonl")
    index = by_id(spans)
    assert not [s for s in spans if "Health" in s["name"] or "Decode" in s["name"]]  # not traced
    assert named(spans, "/specdec.v1.VerifierService/Verify")  # the data path is
    [request] = named(spans, REQUEST_SPAN)
    assert len(named(spans, ITERATION_SPAN)) == result.stats.iterations
    for name, rpc, call in (("drafter.forward", "/specdec.v1.DrafterService/Draft", DRAFT_SPAN),
                            ("verifier.score", "/specdec.v1.VerifierService/Score", VERIFY_SPAN),
                            ("verifier.verification", "/specdec.v1.VerifierService/Verify", VERIFY_SPAN)):
        found = named(spans, name)
        assert found, name
        for span in found:
            chain = [s["name"] for s in ancestors(span, index)]
            # engine span(s) → server span → client span → call span → iteration → request
            assert chain[-3:] == [call, ITERATION_SPAN, REQUEST_SPAN], chain
            assert chain.count(rpc) == 2, chain  # SERVER and CLIENT span of the RPC
            assert {s["trace_id"] for s in ancestors(span, index)} == {request["trace_id"]}
    assert all(s["attributes"]["specdec.derived"] for s in named(spans, "verifier.verification"))
