"""Helpers of the observability tests: an OTLP/gRPC receiver, service processes, /metrics scrapes.

Every wait is bounded; every process started here is stopped in teardown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_for_ready_file

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240.0  # importing torch on a busy 2-core machine can take tens of seconds


# ------------------------------------------------------------------------------ OTLP receiver


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace receiver (TraceService.Export), written against the proto only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[dict[str, Any]] = []
        self.exports = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Export(self, request, context):  # noqa: N802 - the proto's name
        spans = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    spans.append({
                        "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex() or None, "name": span.name,
                        "start_ns": span.start_time_unix_nano, "end_ns": span.end_time_unix_nano,
                        "attributes": {kv.key: _value(kv.value) for kv in span.attributes},
                        "service": resource.get("service.name", ""), "status_code": span.status.code,
                    })
        with self._lock:
            self.exports += 1
            self.spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, predicate, timeout_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.stop(grace=1).wait(5)


# ------------------------------------------------------------------------------ span trees


def by_id(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["span_id"]: s for s in spans}


def ancestors(span: dict[str, Any], index: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Parent, grandparent, … as far as the spans go."""
    out = []
    current = index.get(span.get("parent_span_id") or "")
    while current is not None and len(out) < 64:
        out.append(current)
        current = index.get(current.get("parent_span_id") or "")
    return out


def named(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"] == name]


# ------------------------------------------------------------------------------ processes


def node_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("OTEL_"):
            del env[key]
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OTEL_BSP_SCHEDULE_DELAY="200", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class Node:
    """tests/observability/helpers_node.py as a child process (ready file, log file, SIGTERM stop)."""

    def __init__(self, workdir: Path, role: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.role = role
        self.ready_file = workdir / f"{role}.ready.json"
        self.log_path = workdir / f"{role}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.observability.helpers_node", role,
             "--ready-file", str(self.ready_file), *args],
            cwd=ROOT, env=env or node_env(), stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        self.info: dict[str, Any] = {}

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> dict[str, Any]:
        self.info = wait_for_ready_file(self.ready_file, self.process, self.role, self.log, timeout_s)
        return self.info

    @property
    def address(self) -> str:
        return self.info["address"]

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait (the node flushes its spans); SIGKILL if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()
        return self.process.returncode


# ------------------------------------------------------------------------------ /metrics


def scrape(url: str, timeout_s: float = 10.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a Prometheus text endpoint: (sample name, sorted labels) → value."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # loopback only
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))
