"""Drafts by source (model, lookup, suffix): the Prometheus metrics with a `source` label, the
iteration span's `specdec.source`, and the dashboard's panels over them. Records are fed to the
observers directly (no model, no loop)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orchestrator import metrics
from orchestrator.tracing import ITERATION_SPAN, Tracing
from specdec.generation import IterationRecord

from .test_dashboard import DASHBOARD, exported_sample_names, metric_names

# (source, drafted, num_drafted, accepted): what each iteration of one request did
ITERATIONS = [
    ("lookup", True, 10, 8),
    ("model", True, 4, 1),
    ("", False, 0, 0),  # target-only: no draft of any source
    ("lookup", True, 6, 2),
    ("suffix", True, 12, 12),
    ("", True, 3, 3),  # drafted before sources existed: the draft model's, as the statistics count it
    ("model", True, 4, 4),
]


def _record(index: int, source: str, drafted: bool, num_drafted: int, accepted: int) -> IterationRecord:
    return IterationRecord(request_id="req", index=index, position=index, method="token", k=4,
                           drafted=drafted, num_drafted=num_drafted, accepted=accepted,
                           emitted=[1] * (accepted + 1), start=float(index), end=index + 0.5, source=source)


def _feed(observer) -> None:
    probe = observer.request_started("req", lambda perf: 0.0, {"method": "token", "prompt_tokens": 3})
    for index, (source, drafted, num_drafted, accepted) in enumerate(ITERATIONS):
        with probe.iteration(index, float(index)) as iteration:
            iteration.finished(_record(index, source, drafted, num_drafted, accepted), min(accepted, 4))
    probe.finished(None, None)


def test_metrics_count_drafts_tokens_and_accepted_length_by_source():
    registry = metrics.new_registry(process=False)
    _feed(metrics.OrchestratorMetrics(registry, model="tiny"))
    value = registry.get_sample_value

    expected = {"lookup": (2, 16, 10, [8, 2]), "model": (3, 11, 8, [1, 3, 4]), "suffix": (1, 12, 12, [12])}
    for source, (drafts, drafted, accepted, lengths) in expected.items():
        labels = {"model": "tiny", "source": source}
        assert value("specdec_source_drafts_total", labels) == drafts
        assert value("specdec_source_drafted_tokens_total", labels) == drafted
        assert value("specdec_source_accepted_tokens_total", labels) == accepted
        assert value("specdec_source_accepted_length_count", labels) == drafts
        assert value("specdec_source_accepted_length_sum", labels) == sum(lengths)
        # the mean accepted length: sum / count
        mean = value("specdec_source_accepted_length_sum", labels) / value(
            "specdec_source_accepted_length_count", labels)
        assert mean == pytest.approx(sum(lengths) / len(lengths))
        for bound in (0.0, 2.0, 8.0, 16.0):
            assert value("specdec_source_accepted_length_bucket", {**labels, "le": str(bound)}) == sum(
                length <= bound for length in lengths)
    # target-only iterations are no source's draft: no "" series, and nothing else appeared
    assert value("specdec_source_drafts_total", {"model": "tiny", "source": ""}) is None
    sources = {s.labels["source"] for family in registry.collect() if family.name == "specdec_source_drafts"
               for s in family.samples}
    assert sources == set(expected)
    # summed over sources they are the existing totals, which keep working as before
    assert sum(value("specdec_source_drafts_total", {"model": "tiny", "source": s}) for s in expected) == \
        value("specdec_iterations_total", {"method": "token", "drafted": "true"}) == 6
    assert value("specdec_iterations_total", {"method": "token", "drafted": "false"}) == 1
    assert sum(e[1] for e in expected.values()) == \
        value("specdec_drafted_tokens_total", {"model": "tiny", "method": "token"}) == 39
    assert sum(e[2] for e in expected.values()) == \
        value("specdec_accepted_tokens_total", {"model": "tiny", "method": "token"}) == \
        value("vllm:spec_decode_num_accepted_tokens_total", {"model_name": "tiny"}) == 30


def test_iteration_spans_carry_the_source():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _feed(Tracing(provider, "specdec-test").loop_observer())
    spans = sorted((s for s in exporter.get_finished_spans() if s.name == ITERATION_SPAN),
                   key=lambda s: s.attributes["specdec.iteration"])
    assert [s.attributes.get("specdec.source") for s in spans] == [
        "lookup", "model", None, "lookup", "suffix", "model", "model"]  # target-only: no attribute
    assert [s.attributes["specdec.num_drafted"] for s in spans] == [it[2] for it in ITERATIONS]


def test_dashboard_shows_acceptance_length_and_drafts_by_source():
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    exported = exported_sample_names()
    wanted = {"Acceptance rate by draft source": {"specdec_source_accepted_tokens_total",
                                                  "specdec_source_drafted_tokens_total"},
              "Mean accepted length by draft source": {"specdec_source_accepted_length_sum",
                                                       "specdec_source_accepted_length_count"},
              "Drafts / s by draft source": {"specdec_source_drafts_total"}}
    for title, names in wanted.items():
        exprs = [t["expr"] for t in panels[title]["targets"]]
        assert any("by (source)" in e for e in exprs), title
        used = set().union(*(metric_names(e) for e in exprs))
        assert names <= used <= exported, (title, used)
    # the chart's copy is the same file (a link), so the chart ships the same panels
    chart_copy = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "specdec" / "dashboards" / \
        "specdec-dashboard.json"
    assert json.loads(chart_copy.read_text()) == json.loads(DASHBOARD.read_text())
