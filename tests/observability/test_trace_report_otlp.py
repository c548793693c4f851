"""trace-report reads an OpenTelemetry Collector file-exporter file (OTLP/JSON) as it reads its own
JSON lines, and refuses files without spans or with broken lines in one clear line."""

from __future__ import annotations

import base64
import json
import math
import re

import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from typer.testing import CliRunner

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.speculation import Orchestrator
from orchestrator.tracing import configure_tracing
from specdec.cli.observability import trace_app
from specdec.cli.span_files import SpanFileError, load_spans, otlp_json_spans
from specdec.cli.trace_report import build_runs, chrome_trace, render_html, summarize
from specdec.generation import GenerationRequest

ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(node):
    """protobuf's JSON mapping writes bytes as base64; OTLP/JSON (the Collector) writes ids as hex."""
    if isinstance(node, dict):
        return {k: (base64.b64decode(v).hex() if k in ID_FIELDS and isinstance(v, str) else _hex_ids(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_hex_ids(v) for v in node]
    return node


def _collector_lines(spans, collector_style: bool = True) -> list[str]:
    """One export per line, encoded by OpenTelemetry's own OTLP encoder; split in two exports."""
    lines = []
    for part in (spans[: len(spans) // 2], spans[len(spans) // 2:]):
        message = encode_spans(part)  # an ExportTraceServiceRequest
        if collector_style:  # enums as numbers, ids as hex: what the Collector's file exporter writes
            data = _hex_ids(json_format.MessageToDict(message, use_integers_for_enums=True))
        else:  # protobuf's own JSON mapping: enum names, base64 ids
            data = json_format.MessageToDict(message)
        lines.append(json.dumps(data, separators=(",", ":")))
    return lines


@pytest.fixture(scope="module")
def run_files(tmp_path_factory, tiny_loaded):
    """The spans of a real in-process run, written by --trace-file's sink and as Collector OTLP/JSON."""
    import asyncio

    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine

    tmp = tmp_path_factory.mktemp("otlp-report")
    tracing = configure_tracing("specdec-orchestrator", trace_file=tmp / "native.jsonl")
    memory = InMemorySpanExporter()
    tracing.provider.add_span_processor(SimpleSpanProcessor(memory))

    async def generate():
        orch = Orchestrator(InProcessDrafterClient(DrafterEngine(tiny_loaded["draft"])),
                            InProcessVerifierClient(VerifierEngine(tiny_loaded["target"])),
                            observer=tracing.loop_observer())
        results = []
        for method, a in (("rd", 0.5), ("token", None)):
            results.append(await orch.generate(GenerationRequest(
                prompt_ids=[1, 2, 3], max_new_tokens=10, method=method, k=3, a=a, seed=4, stop_token_ids=[])))
        await orch.close()
        return results

    results = asyncio.run(generate())
    tracing.shutdown()
    spans = memory.get_finished_spans()
    otlp = tmp / "collector.jsonl"
    metrics_line = json.dumps({"resourceMetrics": [{"resource": {}, "scopeMetrics": []}]})
    otlp.write_text("\n".join([_collector_lines(spans)[0], metrics_line, _collector_lines(spans)[1]]) + "\n")
    proto_json = tmp / "protobuf.jsonl"
    proto_json.write_text("\n".join(_collector_lines(spans, collector_style=False)) + "\n")
    return {"native": tmp / "native.jsonl", "otlp": otlp, "protobuf": proto_json, "results": results}


def test_otlp_json_gives_the_same_spans_and_report(run_files):
    native, otlp = load_spans(run_files["native"]), load_spans(run_files["otlp"])
    assert len(native) > 10 and len(otlp) == len(native)
    by_id = {s["span_id"]: s for s in native}
    for span in otlp:
        assert span == by_id[span["span_id"]]  # every field: ids, kind, times, typed attributes, status
    assert load_spans(run_files["protobuf"]) == otlp  # base64 ids and enum names read alike
    assert summarize(build_runs(otlp)) == summarize(build_runs(native))
    iterations = sum(r.stats.iterations for r in run_files["results"])
    assert summarize(build_runs(otlp)).iterations == iterations
    assert chrome_trace(otlp) == chrome_trace(native)

    def page(spans):
        return re.sub(r"generated [^<]*", "", render_html(spans, sources=["x"]))

    assert page(otlp) == page(native)


def test_trace_report_command_reads_a_collector_file(run_files, tmp_path):
    out = tmp_path / "t.html"
    done = CliRunner().invoke(trace_app, ["trace-report", str(run_files["otlp"]), "--out", str(out)])
    assert done.exit_code == 0, done.output
    iterations = sum(r.stats.iterations for r in run_files["results"])
    assert f"2 requests, {iterations} iterations" in done.output
    assert f'data-iterations="{iterations}"' in out.read_text()


def _report(*paths) -> tuple[int, str]:
    done = CliRunner().invoke(trace_app, ["trace-report", *map(str, paths), "--out", str(paths[0]) + ".html"])
    return done.exit_code, done.output


def test_files_without_spans_fail_with_one_line(tmp_path, run_files):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, output = _report(empty)
    assert code == 1 and output.count("\n") == 1
    assert output.startswith(f"error: {empty}: no spans found") and "resourceSpans" in output

    metrics_only = tmp_path / "metrics.jsonl"
    metrics_only.write_text('{"resourceMetrics": []}\n{"resourceSpans": []}\n\n')
    code, output = _report(metrics_only)
    assert code == 1 and f"{metrics_only}: no spans found" in output

    one_empty = _report(run_files["native"], empty)  # every file named must hold spans
    assert one_empty[0] == 1 and str(empty) in one_empty[1]
    assert not (tmp_path / "empty.jsonl.html").exists()


def test_broken_lines_name_the_line(tmp_path, run_files):
    broken = tmp_path / "broken.jsonl"
    lines = run_files["otlp"].read_text().splitlines()
    broken.write_text(lines[0] + "\n" + lines[2][:40] + "\n")
    code, output = _report(broken)
    assert code == 1 and output.count("\n") == 1
    assert output.startswith(f"error: {broken}:2: not JSON")

    bad_id = tmp_path / "bad-id.jsonl"
    export = {"resourceSpans": [{"scopeSpans": [{"spans": [{"spanId": "xyz"}]}]}]}
    bad_id.write_text(json.dumps(export) + "\n")
    code, output = _report(bad_id)
    assert code == 1 and f"{bad_id}:1: not valid OTLP/JSON" in output and "spanId" in output

    array = tmp_path / "array.jsonl"
    array.write_text("[1, 2]\n")
    with pytest.raises(SpanFileError, match=r"array.jsonl:1: a JSON list"):
        load_spans(array)


def test_hand_written_collector_line():
    """The OTLP/JSON details a Collector writes: int64 as strings, hex ids, numeric enums, typed values."""
    line = {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "specdec-verifier"}}]},
        "scopeSpans": [{"scope": {"name": "specdec", "version": "1"}, "spans": [{
            "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "EEE19B7EC3C1B174",
            "parentSpanId": "", "name": "verifier.verify", "kind": 3, "flags": 256,
            "startTimeUnixNano": "1544712660000000000", "endTimeUnixNano": "1544712661000000000",
            "attributes": [
                {"key": "specdec.accepted", "value": {"intValue": "3"}},
                {"key": "specdec.share", "value": {"doubleValue": 0.25}},
                {"key": "specdec.nan", "value": {"doubleValue": "NaN"}},
                {"key": "specdec.derived", "value": {"boolValue": True}},
                {"key": "specdec.ids", "value": {"arrayValue": {"values": [
                    {"intValue": "1"}, {"intValue": 2}]}}},
                {"key": "specdec.map", "value": {"kvlistValue": {"values": [
                    {"key": "a", "value": {"stringValue": "b"}}]}}},
                {"key": "specdec.empty", "value": {}}],
            "events": [{"timeUnixNano": "1544712660500000000", "name": "exception",
                        "attributes": [{"key": "exception.type", "value": {"stringValue": "ValueError"}}]}],
            "status": {"code": 2, "message": "boom"}}]}]}]}
    [span] = otlp_json_spans(line)
    assert span["trace_id"] == "5b8efff798038103d269b633813fc60c" and span["span_id"] == "eee19b7ec3c1b174"
    assert span["parent_span_id"] is None and span["kind"] == "CLIENT"
    assert span["service"] == "specdec-verifier"
    assert (span["start_ns"], span["end_ns"]) == (1544712660000000000, 1544712661000000000)
    attrs = span["attributes"]
    assert attrs["specdec.accepted"] == 3 and attrs["specdec.share"] == 0.25
    assert math.isnan(attrs["specdec.nan"])
    assert attrs["specdec.derived"] is True and attrs["specdec.ids"] == [1, 2]
    assert attrs["specdec.map"] == {"a": "b"} and attrs["specdec.empty"] is None
    assert span["events"] == [{"name": "exception", "time_ns": 1544712660500000000,
                               "attributes": {"exception.type": "ValueError"}}]
    assert (span["status"], span["status_message"], span["scope"]) == ("ERROR", "boom", "specdec")
