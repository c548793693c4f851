"""The OTLP receiver (`specdec trace-collect`) writes the same JSON lines as the --trace-file sink."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from orchestrator.tracing import configure_tracing, read_spans
from specdec.cli.trace_collector import start_collector

from .helpers import ROOT, node_env


def _emit(tracing) -> None:
    """A small nested trace with every attribute type, one error and one event."""
    tracer = tracing.tracer
    with tracer.start_as_current_span("root", attributes={"s": "x", "i": 7, "f": 0.25, "b": False,
                                                           "ints": [1, 2, 3], "strs": ["a", "b"]}):
        with tracer.start_as_current_span("child") as child:
            child.add_event("mark", {"n": 1})
        with pytest.raises(ValueError), tracer.start_as_current_span("failing"):
            raise ValueError("boom")


async def test_otlp_and_file_sinks_agree(tmp_path):
    server, port, collector = await start_collector(port=0, out=tmp_path / "received.jsonl")
    try:
        tracing = configure_tracing("specdec-test", trace_file=tmp_path / "file.jsonl",
                                    otlp_endpoint=f"127.0.0.1:{port}", role="drafter")
        assert tracing is not None and len(tracing.exporters) == 2
        _emit(tracing)
        await __import__("asyncio").to_thread(tracing.shutdown)  # the exporter blocks; the server is here
        assert await collector.wait_for(lambda spans: len(spans) >= 3, timeout_s=20)
    finally:
        await server.stop(0)
    from_file = {s["span_id"]: s for s in read_spans(tmp_path / "file.jsonl")}
    received = {s["span_id"]: s for s in read_spans(tmp_path / "received.jsonl")}
    assert len(from_file) == 3 and from_file.keys() == received.keys()
    for span_id, span in from_file.items():
        assert received[span_id] == span  # every field: ids, links, times, attributes, events, status
    root = next(s for s in from_file.values() if s["name"] == "root")
    assert root["attributes"]["ints"] == [1, 2, 3] and root["resource"]["specdec.role"] == "drafter"
    failing = next(s for s in from_file.values() if s["name"] == "failing")
    assert failing["status"] == "ERROR" and failing["events"][0]["name"] == "exception"


@pytest.mark.timeout(180)
def test_trace_collect_command_receives_and_stops_by_itself(tmp_path):
    out, ready = tmp_path / "spans.jsonl", tmp_path / "collect.ready.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli.observability", "trace-collect", "--port", "0",
         "--out", str(out), "--ready-file", str(ready), "--max-spans", "3", "--duration", "120"],
        cwd=ROOT, env=node_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "trace-collect did not start"
            time.sleep(0.1)
        port = json.loads(ready.read_text())["port"]
        tracing = configure_tracing("specdec-test", otlp_endpoint=f"127.0.0.1:{port}")
        _emit(tracing)
        tracing.shutdown()
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    assert process.returncode == 0, output
    assert "received 3 spans" in output
    assert sorted(s["name"] for s in read_spans(out)) == ["child", "failing", "root"]
    assert not ready.exists()  # removed on the way out
    assert os.path.getsize(out) > 0
