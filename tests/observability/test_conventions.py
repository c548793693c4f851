"""The field's conventions: a model label, TTFT / inter-token latency, prompt and generation token
counters, vLLM's spec-decode counters, and the OpenTelemetry GenAI attributes on request spans."""

from __future__ import annotations

import urllib.request

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orchestrator import metrics
from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.speculation import Orchestrator
from orchestrator.tracing import REQUEST_SPAN, Tracing, combine_observers, openai_finish_reason
from specdec.generation import GenerationRequest, IterationRecord
from specdec.sampling import SamplingParams

from .conftest import VOCAB
from .helpers import scrape, total

PROMPT = [1, 2, 3]


def _request(method: str, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(PROMPT), max_new_tokens=kw.pop("max_new_tokens", 12),
                             method=method, seed=kw.pop("seed", 3),
                             stop_token_ids=kw.pop("stop_token_ids", []), **kw)


def _orchestrator(engines, observer) -> Orchestrator:
    drafter, verifier = engines
    return Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier), observer=observer)


def _scrape_text(registry) -> tuple[dict, str]:
    server = metrics.start_metrics_server(0, registry=registry)
    try:
        samples = scrape(server.url)
        with urllib.request.urlopen(server.url, timeout=10) as response:  # loopback only
            text = response.read().decode()
    finally:
        server.close()
    return samples, text


def _emissions(result) -> list[tuple[float, int]]:
    """(end, tokens) of the iterations that emitted tokens, in order."""
    return [(r.end, len(r.emitted)) for r in result.iterations if r.emitted]


# ------------------------------------------------------------------------------ metrics


async def test_model_label_latency_histograms_and_token_counters(engines):
    registry = metrics.new_registry(process=False)
    om = metrics.OrchestratorMetrics(registry, model="tiny-target")
    orch = _orchestrator(engines, om)
    first = [await orch.generate(_request("token", k=3)), await orch.generate(_request("rd", k=3, a=0.5))]
    om.set_model("renamed")  # e.g. learnt from the verifier after the metrics were built
    second = await orch.generate(_request("gsd-tree", k=6, seed=2))
    await orch.close()
    samples, _ = _scrape_text(registry)

    for model, results in (("tiny-target", first), ("renamed", [second])):
        assert total(samples, "specdec_requests_total", model=model) == len(results)
        assert total(samples, "specdec_prompt_tokens_total", model=model) == len(PROMPT) * len(results)
        new_tokens = sum(r.stats.new_tokens for r in results)
        assert new_tokens > len(results)
        assert total(samples, "specdec_generation_tokens_total", model=model) == new_tokens
        assert total(samples, "specdec_emitted_tokens_total", model=model) == new_tokens
        assert total(samples, "specdec_active_requests", model=model) == 0
        for result in results:
            labels = {"model": model, "method": result.method}
            emissions = _emissions(result)
            (first_end, _), (last_end, _) = emissions[0], emissions[-1]
            # one TTFT per fresh request, inside [first iteration's length, first emission - run start]
            assert total(samples, "specdec_time_to_first_token_seconds_count", **labels) == 1
            ttft = total(samples, "specdec_time_to_first_token_seconds_sum", **labels)
            first_record = result.iterations[0]
            assert first_record.end - first_record.start <= ttft + 1e-6
            assert ttft <= first_end - result.started_at + 1e-6
            # one ITL per token after the first; together they span first emission → last emission
            assert total(samples, "specdec_inter_token_latency_seconds_count", **labels) == \
                result.stats.new_tokens - 1
            assert total(samples, "specdec_inter_token_latency_seconds_sum", **labels) == pytest.approx(
                last_end - first_end, abs=1e-6)
            assert total(samples, "specdec_request_seconds_count", **labels) == 1
    assert total(samples, "specdec_requests_total", model="default") == 0
    with pytest.raises(ValueError, match="model"):
        om.set_model("  ")


async def test_vllm_spec_decode_counters_agree_with_ours(engines):
    registry = metrics.new_registry(process=False)
    om = metrics.OrchestratorMetrics(registry, model="tiny-target")
    orch = _orchestrator(engines, om)
    results = [await orch.generate(_request("token", k=3)), await orch.generate(_request("rd", k=3, a=0.5)),
               await orch.generate(_request("gsd-tree", k=6, seed=2))]
    await orch.close()
    samples, text = _scrape_text(registry)

    drafted_iterations = sum(r.stats.drafted_iterations for r in results)
    assert drafted_iterations > 0
    assert total(samples, "vllm:spec_decode_num_drafts_total", model_name="tiny-target") == drafted_iterations
    assert total(samples, "vllm:spec_decode_num_drafts_total") == \
        total(samples, "specdec_iterations_total", drafted="true")
    assert total(samples, "vllm:spec_decode_num_draft_tokens_total", model_name="tiny-target") == \
        total(samples, "specdec_drafted_tokens_total") == sum(r.stats.drafted_tokens for r in results)
    assert total(samples, "vllm:spec_decode_num_accepted_tokens_total", model_name="tiny-target") == \
        total(samples, "specdec_accepted_tokens_total") == sum(r.stats.accepted_tokens for r in results)
    positions = {dict(labels)["position"] for (name, labels) in samples
                 if name == "specdec_position_drafted_total"}
    assert positions and positions == {dict(labels)["position"] for (name, labels) in samples
                                       if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    for position in positions:
        ours = total(samples, "specdec_position_accepted_total", position=position)
        assert total(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="tiny-target",
                     position=position) == ours
    # the exposition carries vLLM's very names (colons, _total) and label
    assert 'vllm:spec_decode_num_drafts_total{model_name="tiny-target"}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-target",position="0"}' in text


# ------------------------------------------------------------------------------ spans


def _tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, "specdec-test"), exporter


def _request_spans(exporter: InMemorySpanExporter) -> dict[str, dict]:
    return {s.attributes["specdec.request_id"]: dict(s.attributes)
            for s in exporter.get_finished_spans() if s.name == REQUEST_SPAN}


async def test_request_spans_carry_genai_attributes(engines):
    tracing, exporter = _tracing()
    observer = tracing.loop_observer()
    tracing.set_model("tiny-target")  # after the observer was taken: it still applies
    orch = _orchestrator(engines, combine_observers(observer, metrics.OrchestratorMetrics(
        metrics.new_registry(process=False))))
    sampled = await orch.generate(_request("token", k=3, max_new_tokens=10, seed=7,
                                           sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=5)))
    stopped = await orch.generate(_request("rd", k=3, a=0.5, stop_token_ids=list(range(VOCAB))))
    await orch.close()
    spans = _request_spans(exporter)

    a = spans[sampled.request_id]
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.provider.name"] == a["gen_ai.system"] == "specdec"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "tiny-target"
    assert a["gen_ai.response.id"] == sampled.request_id
    assert a["gen_ai.request.max_tokens"] == 10 and a["gen_ai.request.seed"] == 7
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert a["gen_ai.usage.input_tokens"] == len(PROMPT) == sampled.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == len(sampled.token_ids) == 10
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",) and sampled.finish_reason == "length"
    assert a["specdec.method"] == "token"  # beside specdec.*, not instead
    for name in ("gen_ai.request.top_p", "gen_ai.request.top_k"):  # only once the loop passes them
        assert a.get(name) in (None, 0.9 if name.endswith("top_p") else 5)

    b = spans[stopped.request_id]
    assert stopped.finish_reason == "eos"  # every token stops it: eos → OpenAI's "stop"
    assert tuple(b["gen_ai.response.finish_reasons"]) == ("stop",)
    assert b["gen_ai.usage.output_tokens"] == len(stopped.token_ids) >= 1


def _record(index: int, emitted: int) -> IterationRecord:
    return IterationRecord(request_id="r", index=index, position=index, method="token", emitted=[1] * emitted,
                           start=float(index), end=index + 0.5)


def test_genai_attributes_from_the_loop_attributes():
    """What the loop passes at the start (a chat, top_p, top_k) and a run that ends without a result."""
    tracing, exporter = _tracing()
    probe = tracing.loop_observer().request_started("req-9", lambda perf: perf, {
        "method": "token", "chat": True, "top_p": 0.5, "top_k": 4, "temperature": 0.0, "max_new_tokens": 8,
        "prompt_tokens": 6, "resumed_tokens": 3, "seed": 11})
    for index, emitted in enumerate((2, 1)):
        with probe.iteration(index, float(index)) as iteration:
            iteration.finished(_record(index, emitted), 0)
    probe.finished(None, None)  # the consumer left: no result
    a = _request_spans(exporter)["req-9"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "default"
    assert (a["gen_ai.request.top_p"], a["gen_ai.request.top_k"]) == (0.5, 4)
    assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.usage.input_tokens"] == 6
    assert a["gen_ai.usage.output_tokens"] == 3 + 2 + 1  # resumed tokens and this run's
    assert "gen_ai.response.finish_reasons" not in a and a["specdec.finish_reason"] == "abandoned"
    assert [openai_finish_reason(r) for r in ("eos", "stop", "length")] == ["stop", "stop", "length"]
    with pytest.raises(ValueError, match="model"):
        tracing.set_model("")


def test_resumed_runs_count_no_prompt_and_no_first_token():
    registry = metrics.new_registry(process=False)
    om = metrics.OrchestratorMetrics(registry)
    probe = om.request_started("r", lambda perf: 0.0, {"method": "token", "prompt_tokens": 5,
                                                       "resumed_tokens": 4})
    with probe.iteration(0, 0.0) as iteration:
        iteration.finished(_record(0, 2), 0)  # ends at 0.5, the run started at 0.0
    probe.finished(None, None)
    value = registry.get_sample_value
    labels = {"model": "default", "method": "token"}
    assert value("specdec_prompt_tokens_total", {"model": "default"}) is None  # never counted
    assert value("specdec_time_to_first_token_seconds_count", labels) is None
    assert value("specdec_inter_token_latency_seconds_count", labels) == 2
    assert value("specdec_inter_token_latency_seconds_sum", labels) == pytest.approx(0.5)
    assert value("specdec_requests_total", {**labels, "outcome": "abandoned"}) == 1


def test_dashboard_shows_time_to_first_token_and_inter_token_latency():
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "specdec-dashboard.json"
    panels = {p["title"]: p for p in json.loads(path.read_text())["panels"]}
    for title, metric in (("Time to first token (p50 / p95)", "specdec_time_to_first_token_seconds"),
                          ("Inter-token latency (p50 / p95)", "specdec_inter_token_latency_seconds")):
        exprs = [t["expr"] for t in panels[title]["targets"]]
        assert any(f"{metric}_bucket" in e for e in exprs) and any(f"{metric}_count" in e for e in exprs)
