"""trace-report: the timeline model, the HTML page (checked in headless Chromium), Chrome/Perfetto JSON."""

from __future__ import annotations

import json
import os
import re
import struct

import pytest
from typer.testing import CliRunner

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.speculation import Orchestrator
from orchestrator.tracing import configure_tracing, read_spans
from specdec.cli.observability import trace_app
from specdec.cli.trace_report import (
    build_runs,
    chrome_trace,
    dump_dom,
    find_browser,
    render_html,
    screenshot,
    summarize,
)
from specdec.generation import GenerationRequest


def _span(name, span_id, parent, start_ms, end_ms, **attributes):
    return {"trace_id": "t" * 32, "span_id": span_id, "parent_span_id": parent, "name": name,
            "start_ns": int(start_ms * 1e6), "end_ns": int(end_ms * 1e6), "attributes": attributes,
            "service": "specdec-orchestrator", "kind": "INTERNAL", "status": "UNSET"}


SYNTHETIC = [
    _span("specdec.request", "r", None, 0, 100, **{"specdec.request_id": "req-1", "specdec.method": "rd"}),
    # iteration 0: no draft; drafter [5, 30] alongside the verifier's score [10, 40], then verify [40, 50]
    _span("specdec.iteration", "i0", "r", 0, 50, **{"specdec.iteration": 0, "specdec.drafted": False,
                                                   "specdec.accepted": 0, "specdec.emitted": 1}),
    _span("specdec.draft", "d0", "i0", 5, 30, **{"specdec.call": "draft"}),
    _span("specdec.verify", "v0", "i0", 10, 40, **{"specdec.call": "score"}),
    _span("specdec.verify", "v1", "i0", 40, 50, **{"specdec.call": "verify"}),
    _span("verifier.forward", "f0", "v1x", 41, 45),  # under a span that is not here: ignored
    # iteration 1: draft 3, then verify; 2 accepted
    _span("specdec.iteration", "i1", "r", 50, 100, **{"specdec.iteration": 1, "specdec.drafted": True,
                                                     "specdec.num_drafted": 3, "specdec.accepted": 2,
                                                     "specdec.emitted": 3}),
    _span("specdec.draft", "d1", "i1", 50, 70),
    _span("specdec.verify", "v2", "i1", 70, 100),
    _span("/specdec.v1.VerifierService/Verify", "c2", "v2", 71, 99, ),
    _span("verifier.verify", "e2", "c2", 72, 98),
    _span("verifier.forward", "e3", "e2", 72, 90),
]


def test_runs_and_summary_from_spans():
    [run] = build_runs(SYNTHETIC)
    assert run.request_id == "req-1" and [it.index for it in run.iterations] == [0, 1]
    first, second = run.iterations
    assert [c.op for c in first.calls] == ["draft", "score", "verify"]
    assert first.overlap == pytest.approx(0.020)  # [10, 30]: no attribute, so from the call spans
    assert first.busy("verify") == pytest.approx(0.040) and first.busy("draft") == pytest.approx(0.025)
    assert second.calls[1].engine == [("verifier.forward", 72_000_000, 90_000_000)]  # found two levels down
    summary = summarize([run])
    assert (summary.iterations, summary.drafted_iterations, summary.new_tokens) == (2, 1, 4)
    assert (summary.drafted_tokens, summary.accepted_tokens) == (3, 2)
    assert summary.overlap_share == pytest.approx(0.020 / 0.070)


def test_chrome_trace_events_nest_per_thread():
    trace = chrome_trace(SYNTHETIC)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(SYNTHETIC)
    assert min(e["ts"] for e in events) == 0 and all(e["dur"] >= 0 for e in events)
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"req-1 iterations", "req-1 draft calls", "req-1 verify calls"} <= threads
    by_tid: dict = {}
    for e in events:
        by_tid.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for intervals in by_tid.values():  # trace viewers need events of one thread nested or disjoint
        intervals.sort(key=lambda iv: (iv[0], -iv[1]))
        for (_, e1), (s2, e2) in zip(intervals, intervals[1:], strict=False):
            assert e1 <= s2 or e2 <= e1, intervals
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert [c["args"]["accepted"] for c in counters] == [0, 2]


@pytest.fixture
async def traced_spans(engines, tmp_path):
    """Spans of a real in-process run: an RD request and a token request."""
    tracing = configure_tracing("specdec-orchestrator", trace_file=tmp_path / "spans.jsonl")
    drafter, verifier = engines
    orch = Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier),
                        observer=tracing.loop_observer())
    results = []
    for method, a in (("rd", 0.5), ("token", None)):
        request = GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=12, method=method, k=3, a=a, seed=4,
                                    stop_token_ids=[])
        results.append(await orch.generate(request))
    await orch.close()
    tracing.shutdown()
    return tmp_path / "spans.jsonl", results


def _need_browser() -> None:
    if find_browser() is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Chromium (Debian package `chromium`) for the timeline tests")
        pytest.skip("no Chromium installed (apt-get install chromium)")


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.timeout(300)
async def test_timeline_page_renders_in_chromium(traced_spans, tmp_path):
    _need_browser()
    path, results = traced_spans
    iterations = sum(r.stats.iterations for r in results)
    page = tmp_path / "timeline.html"
    page.write_text(render_html(read_spans(path), sources=[path.name]))
    dom = dump_dom(page)
    assert re.search(rf'id="report"[^>]*data-iterations="{iterations}"', dom), dom[:2000]
    assert re.search(r'id="report"[^>]*data-requests="2"', dom)
    assert len(re.findall(r'<g class="iteration"', dom)) == iterations
    assert re.search(rf'id="iteration-count"[^>]*>{iterations}<', dom)
    for result in results:
        section = rf'data-request="{result.request_id}" data-iterations="{result.stats.iterations}"'
        assert re.search(section, dom)
    drafts = sum(len(record.draft_intervals) for result in results for record in result.iterations)
    assert dom.count('class="call draft"') == drafts
    png = tmp_path / "timeline.png"
    screenshot(page, png, width=1200, height=800)
    assert _png_size(png) == (1200, 800) and png.stat().st_size > 10_000  # a page, not a blank image


def test_trace_report_command(traced_spans, tmp_path):
    path, results = traced_spans
    out, chrome = tmp_path / "out" / "t.html", tmp_path / "t.json"
    args = ["trace-report", str(path), "--out", str(out), "--chrome", str(chrome)]
    done = CliRunner().invoke(trace_app, args)
    assert done.exit_code == 0, done.output
    iterations = sum(r.stats.iterations for r in results)
    assert f"2 requests, {iterations} iterations" in done.output
    html = out.read_text()
    assert f'data-iterations="{iterations}"' in html
    # self-contained: no script, nothing fetched from anywhere
    assert "<script" not in html and "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    events = json.loads(chrome.read_text())["traceEvents"]
    assert sum(e["name"] == "specdec.iteration" for e in events) == iterations
    missing = CliRunner().invoke(trace_app, ["trace-report", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 1 and "no such file" in missing.output
