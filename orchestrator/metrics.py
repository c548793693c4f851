"""Prometheus metrics of the orchestrator loop and of the engine services (prometheus-client).

Orchestrator (OrchestratorMetrics, a LoopObserver: orchestrator.speculation calls it). `model` is the
served model name (OrchestratorMetrics(model=...) or set_model(...), read at each observation):
  specdec_requests_total{model,method,outcome}      finished runs; outcome = finish reason | error | abandoned
  specdec_active_requests{model,method}             runs in progress
  specdec_request_seconds{model,method}             histogram of run wall time
  specdec_time_to_first_token_seconds{model,method} histogram: run start → end of the iteration that
                                                    emitted the first token (fresh runs only)
  specdec_inter_token_latency_seconds{model,method} histogram, one observation per output token after
                                                    the first: an iteration emitting n tokens g seconds
                                                    after the previous emission observes g/n n times
                                                    (the first iteration's extra tokens observe 0)
  specdec_prompt_tokens_total{model}                prompt tokens of the runs started (not resumed ones)
  specdec_generation_tokens_total{model}            tokens that reached the output
  specdec_iterations_total{method,drafted}          iterations; method = what ran ("autoregressive"
                                                    for target-only steps), drafted = true | false
  specdec_fallback_iterations_total                 target-only because the drafter was down
  specdec_drafted_tokens_total{model,method}        draft tokens the verifier checked
  specdec_accepted_tokens_total{model,method}       of those, accepted
  specdec_emitted_tokens_total{model,method}        tokens that reached the output (→ tokens/s)
  specdec_position_drafted_total{method,position}   iterations whose draft reached depth position+1
  specdec_position_accepted_total{method,position}  … and whose accepted path did (acceptance by
                                                    position = accepted / drafted)
  specdec_source_drafts_total{model,source}         iterations that verified a draft, by where it came
                                                    from: source = model (the draft model) | lookup (the
                                                    request's own n-grams) | suffix (recent requests);
                                                    target-only iterations are no draft of any source
  specdec_source_drafted_tokens_total{model,source} draft tokens the verifier checked, by source
  specdec_source_accepted_tokens_total{model,source} of those, accepted (acceptance rate by source =
                                                    accepted / drafted)
  specdec_source_accepted_length{model,source}      histogram: accepted tokens per draft (mean accepted
                                                    length = _sum / _count; _count = drafts)
  specdec_iteration_seconds{method}                 histogram of iteration wall time
  specdec_draft_call_seconds{method}                histogram of drafter calls, as the loop saw them
  specdec_verify_call_seconds{method}               histogram of verifier calls (score and verify)
  specdec_draft_busy_seconds_total{method}          time the drafter was busy
  specdec_verify_busy_seconds_total{method}         time the verifier was busy
  specdec_overlap_seconds_total{method}             time both were busy (overlap ratio: / verify busy)
  specdec_iteration_overlap_ratio{method}           histogram of that ratio per iteration
  specdec_admitted_requests                         requests holding a slot (at most --max-active-requests),
                                                    read at scrape time (watch_orchestrator)
  specdec_queued_requests                           requests waiting for a slot
  specdec_rejected_requests_total                   requests refused (Overloaded) after --queue-timeout
  specdec_request_slots                             the limit, --max-active-requests
  specdec_paused_streams                            streams paused without a slot (reader behind)
  specdec_idle_closed_streams_total                 streams closed after --stream-idle-timeout unread
  specdec_caller_refused_requests_total             requests refused by --max-requests-per-caller
  specdec_dependency_up{dependency}                 verifier / drafter / store answering and compatible
  specdec_serving                                   1 while gRPC health says SERVING (orchestrator.health)
  specdec_drafter_timeouts_total                    drafter calls abandoned after their deadline
vLLM-compatible spec-decode counters (same names, label model_name, as vLLM exposes them; mapping and
differences in docs/observability.md), all counting iterations that verified at least one draft token:
  vllm:spec_decode_num_drafts_total{model_name}           such iterations (= specdec_iterations_total
                                                          {drafted="true"})
  vllm:spec_decode_num_draft_tokens_total{model_name}     = specdec_drafted_tokens_total
  vllm:spec_decode_num_accepted_tokens_total{model_name}  = specdec_accepted_tokens_total
  vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name,position}
                                                          = specdec_position_accepted_total (a position
                                                          shows once a draft reached that depth)
Engines (EngineMetrics, a ServiceObserver: the service adapters call it; label role = drafter | verifier):
  specdec_engine_calls_total{role,rpc,outcome}      Draft / Lookahead / Score / Verify calls; outcome ok |
                                                    session_gone | invalid | overloaded | cancelled | error
  specdec_engine_call_seconds{role,rpc}             histogram of the engine call in its worker thread
  specdec_forward_seconds{role,rpc}                 histogram of model forward time per call
  specdec_verification_seconds{method}              histogram of the verification step (verifier)
  specdec_reused_tokens_total{role}                 committed tokens whose KV entries were reused
  specdec_active_sessions{role}                     sessions (KV caches) held, read at scrape time
  specdec_session_evictions_total{role}             sessions dropped by LRU or TTL
  specdec_session_expirations_total{role}           the TTL part of the evictions
  specdec_session_budget_evictions_total{role}      the part made to keep the KV tokens within the budget
  specdec_session_rejections_total{role}            calls refused (Overloaded): no room for a new session
                                                    within --admission-timeout
  specdec_session_waiting_calls{role}               calls waiting for room for a new session
  specdec_kv_tokens{role}                           KV-cache tokens the sessions hold
  specdec_kv_budget_tokens{role}                    the budget (--kv-cache-mb in tokens; 0 = none)
  specdec_sessions_created_total{role}, specdec_sessions_released_total{role}
  specdec_batch_queue_depth{role}                   forward jobs waiting for a batched pass (batching on)
  specdec_batches_total{role}                       batched forward passes run
  specdec_batch_calls_total{role}                   forward jobs those passes served (/ batches = batch size)
  specdec_batch_tokens_total{role}                  query positions in those passes, padding included
  specdec_batch_positions_total{role}               of those, the calls' own (tokens − positions = padding)
  specdec_batch_seconds_total{role}                 time those passes ran (/ batches = seconds per pass)
  specdec_score_hits_total, specdec_late_scores_total   verifier: early scores used / too late
  specdec_ahead_scores_total                        verifier: target-only passes run ahead (score_ahead)
  specdec_draft_rows_requests_total                 verifier: lean verifies that asked for draft rows
  specdec_prefix_cache_lookups_total{role}          prefix-cache lookups (--prefix-cache-mb)
  specdec_prefix_cache_hits_total{role}             of those, lookups that found blocks (/ lookups = hit rate)
  specdec_prefix_cache_queried_tokens_total{role}   tokens of the blocks looked up (partial: when found)
  specdec_prefix_cache_hit_tokens_total{role}       of those, tokens found (their prefill saved)
  specdec_prefix_cache_stored_blocks_total{role}    blocks stored
  specdec_prefix_cache_evictions_total{role}        blocks evicted, least recently used first
  specdec_prefix_cache_blocks{role}, specdec_prefix_cache_bytes{role}   what it holds
  specdec_prefix_cache_budget_bytes{role}           its budget
HTTP API (HttpMetrics: orchestrator.openai_http's middleware records it; route = /v1/completions |
/v1/chat/completions | /v1/models | /health | other, so unknown paths cannot grow the label set):
  specdec_http_requests_total{route,status}         HTTP requests answered, by status code (413s and
                                                    401s included; a stream counts once, when it ends)
  specdec_http_request_seconds{route}               histogram: request received → last byte sent
                                                    (streams included, so this is a stream's length)
  specdec_http_active_requests{route}               requests in progress (open streams included)
and the process_* collector of prometheus-client. Each server serves its registry on /metrics
(start_metrics_server). Nothing is recorded when no metrics object is installed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specdec.defaults import DraftSource

if TYPE_CHECKING:
    from specdec.generation import GenerationResult, IterationRecord

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# Time to first token: a prefill plus one iteration, from milliseconds (tiny models) to minutes (long
# prompts on CPU). Inter-token latency: an iteration's time shared by its tokens (0: same iteration).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                40.0, 80.0, 160.0)
ITL_BUCKETS = (0.0, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.5, 0.75, 1.0, 2.5, 5.0)
# Accepted tokens per draft: whole numbers, from 0 to a long model-free draft (up to
# model_free_max_nodes: the accepted path of a long copy can be tens of tokens).
ACCEPTED_LENGTH_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0, 48.0,
                           64.0)
DEFAULT_MODEL = "default"


def new_registry(process: bool = True) -> CollectorRegistry:
    """A registry of our own (not prometheus-client's global one), with the process collector."""
    registry = CollectorRegistry()
    if process:
        ProcessCollector(registry=registry)
    return registry


def _makers(registry: CollectorRegistry) -> tuple[Any, Any, Any]:
    """counter(name, help, *labels), gauge(...), histogram(..., buckets=LATENCY_BUCKETS) on registry."""

    def counter(name: str, text: str, *labels: str) -> Counter:
        return Counter(name, text, list(labels), registry=registry)

    def gauge(name: str, text: str, *labels: str) -> Gauge:
        return Gauge(name, text, list(labels), registry=registry)

    def histogram(name: str, text: str, *labels: str,
                  buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(name, text, list(labels), buckets=buckets, registry=registry)

    return counter, gauge, histogram


# ============================================================================ orchestrator


class Admitting(Protocol):
    """What /metrics reads of the orchestrator (also `dependency_status()` when it has one)."""

    def admission_stats(self) -> dict[str, int]: ...


class Counting(Protocol):
    """What /metrics reads of an engine."""

    def stats(self) -> Mapping[str, float]: ...


class OrchestratorMetrics:
    """LoopObserver recording requests and iterations (pass as Orchestrator(observer=...)).

    model: the served model name, the `model` label of the request and token metrics and the
    `model_name` label of the vLLM-compatible counters. The CLI may learn it only once the
    orchestrator has met its verifier: set_model() then applies to every later observation.
    """

    def __init__(self, registry: CollectorRegistry, model: str = DEFAULT_MODEL) -> None:
        self.registry = registry
        self.model = _model_name(model)
        counter, gauge, histogram = _makers(registry)
        self.requests = counter("specdec_requests", "Request runs finished, by method and outcome (finish "
                                "reason, error or abandoned).", "model", "method", "outcome")
        self.active_requests = gauge("specdec_active_requests", "Request runs in progress.", "model",
                                     "method")
        self.request_seconds = histogram("specdec_request_seconds", "Wall time of a request run.", "model",
                                         "method", buckets=REQUEST_BUCKETS)
        self.ttft = histogram("specdec_time_to_first_token_seconds", "Time from the start of a request run "
                              "to the end of the iteration that emitted its first token (runs that resume "
                              "a request with tokens are not counted).", "model", "method",
                              buckets=TTFT_BUCKETS)
        self.itl = histogram("specdec_inter_token_latency_seconds", "Per output token after the first: the "
                             "time since the previous emission shared by the tokens an iteration emitted "
                             "(g/n for each of n tokens; 0 for the first iteration's extra tokens).",
                             "model", "method", buckets=ITL_BUCKETS)
        self.prompt_tokens = counter("specdec_prompt_tokens", "Prompt tokens (target tokenizer) of the "
                                     "request runs started (a resumed run does not count them again).",
                                     "model")
        self.generation_tokens = counter("specdec_generation_tokens", "Generated tokens that reached the "
                                         "output.", "model")
        self.iterations = counter("specdec_iterations", "Speculation iterations, by the method that ran and "
                                  "whether a draft was verified.", "method", "drafted")
        self.fallback_iterations = counter("specdec_fallback_iterations", "Target-only iterations run "
                                           "because the drafter was unavailable.")
        self.drafted_tokens = counter("specdec_drafted_tokens", "Draft tokens checked by the verifier.",
                                      "model", "method")
        self.accepted_tokens = counter("specdec_accepted_tokens", "Draft tokens accepted.", "model", "method")
        self.emitted_tokens = counter("specdec_emitted_tokens", "Tokens that reached the output.", "model",
                                      "method")
        self.position_drafted = counter("specdec_position_drafted", "Iterations whose draft reached depth "
                                        "position+1.", "method", "position")
        self.position_accepted = counter("specdec_position_accepted", "Iterations whose accepted path "
                                         "reached depth position+1.", "method", "position")
        self.iteration_seconds = histogram("specdec_iteration_seconds", "Wall time of an iteration.",
                                           "method")
        self.draft_call_seconds = histogram("specdec_draft_call_seconds", "Drafter calls as the orchestrator "
                                            "saw them (network included).", "method")
        self.verify_call_seconds = histogram("specdec_verify_call_seconds", "Verifier calls (score and "
                                             "verify) as the orchestrator saw them.", "method")
        self.draft_busy = counter("specdec_draft_busy_seconds", "Time the drafter was busy.", "method")
        self.verify_busy = counter("specdec_verify_busy_seconds", "Time the verifier was busy.", "method")
        self.overlap = counter("specdec_overlap_seconds", "Time drafter and verifier were both busy.",
                               "method")
        # By draft source (IterationRecord.source): what each source drafted and how much was accepted.
        self.source_drafts = counter("specdec_source_drafts", "Iterations that verified a draft, by draft "
                                     "source (model, lookup, suffix).", "model", "source")
        self.source_drafted_tokens = counter("specdec_source_drafted_tokens", "Draft tokens checked by the "
                                             "verifier, by draft source.", "model", "source")
        self.source_accepted_tokens = counter("specdec_source_accepted_tokens", "Draft tokens accepted, by "
                                              "draft source.", "model", "source")
        self.source_accepted_length = histogram("specdec_source_accepted_length", "Accepted tokens per "
                                                "draft, by draft source (mean accepted length: sum/count).",
                                                "model", "source", buckets=ACCEPTED_LENGTH_BUCKETS)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.overlap_ratio = histogram("specdec_iteration_overlap_ratio", "Per iteration: overlap / verifier "
                                       "busy time.", "method", buckets=RATIO_BUCKETS)
        # vLLM's spec-decode counters under vLLM's names and label (dashboards built for vLLM work as they
        # are); prometheus-client adds the _total vLLM's exposition shows. Mapping: docs/observability.md.
        self.vllm_drafts = counter("vllm:spec_decode_num_drafts", "Iterations that verified at least one "
                                   "draft token (vLLM: number of spec decoding drafts).", "model_name")
        self.vllm_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                         "model_name")
        self.vllm_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                            "model_name")
        self.vllm_accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position (depth along the accepted "
                                             "path).", "model_name", "position")
        self.admission = _StatsCollector(_ADMISSION_STATS)
        registry.register(self.admission)
        self.dependencies = _StatsCollector(_DEPENDENCY_STATS, label="dependency")
        registry.register(self.dependencies)
        self.health = _StatsCollector(_HEALTH_STATS)
        registry.register(self.health)

    def watch_orchestrator(self, orchestrator: Admitting) -> None:
        """Report orchestrator.admission_stats() (request slots: running, queued, refused) and, when it has
        them, its dependencies' states (orchestrator.health) at every scrape."""
        self.admission.add((), orchestrator.admission_stats)
        status = getattr(orchestrator, "dependency_status", None)
        if status is None:
            return
        for name in ("verifier", "drafter", "store"):
            self.dependencies.add((name,), lambda name=name: _dependency_up(status(), name))
        self.health.add((), lambda: _health_values(status()))

    def set_model(self, name: str) -> None:
        """The served model name for every observation from now on (runs in progress included)."""
        self.model = _model_name(name)

    # LoopObserver
    def request_started(self, request_id: str, epoch: Callable[[float], float],
                        attributes: Mapping[str, Any]) -> _RequestMetrics:
        method, model = str(attributes.get("method", "")), self.model
        self.child(self.active_requests, model, method).inc()
        resumed = int(attributes.get("resumed_tokens", 0) or 0)
        if not resumed:
            self.child(self.prompt_tokens, model).inc(max(0, int(attributes.get("prompt_tokens", 0) or 0)))
        return _RequestMetrics(self, method, model, epoch(time.perf_counter()), resumed=resumed > 0)

    def child(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), cached: labels() takes a lock and builds a key on every call."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def record_iteration(self, record: IterationRecord, depth: int) -> None:
        method, child, model = record.method, self.child, self.model
        draft_s = [e - s for s, e in record.draft_intervals]
        verify_s = [e - s for s, e in record.verify_intervals]
        child(self.iterations, method, "true" if record.drafted else "false").inc()
        if record.fallback:
            self.fallback_iterations.inc()
        child(self.emitted_tokens, model, method).inc(len(record.emitted))
        child(self.generation_tokens, model).inc(len(record.emitted))
        child(self.iteration_seconds, method).observe(max(0.0, record.end - record.start))
        for seconds in draft_s:
            child(self.draft_call_seconds, method).observe(seconds)
        for seconds in verify_s:
            child(self.verify_call_seconds, method).observe(seconds)
        verify_total = sum(verify_s)
        child(self.draft_busy, method).inc(sum(draft_s))
        child(self.verify_busy, method).inc(verify_total)
        child(self.overlap, method).inc(record.overlap_seconds)
        if verify_total > 0:
            child(self.overlap_ratio, method).observe(min(1.0, record.overlap_seconds / verify_total))
        if record.drafted:
            accepted_depth = min(record.accepted, depth)
            child(self.drafted_tokens, model, method).inc(record.num_drafted)
            child(self.accepted_tokens, model, method).inc(record.accepted)
            child(self.vllm_drafts, model).inc()
            child(self.vllm_draft_tokens, model).inc(record.num_drafted)
            child(self.vllm_accepted_tokens, model).inc(record.accepted)
            source = draft_source(record)
            child(self.source_drafts, model, source).inc()
            child(self.source_drafted_tokens, model, source).inc(record.num_drafted)
            child(self.source_accepted_tokens, model, source).inc(record.accepted)
            child(self.source_accepted_length, model, source).observe(record.accepted)
            for position in range(depth):
                child(self.position_drafted, method, str(position)).inc()
                per_pos = child(self.vllm_accepted_per_pos, model, str(position))  # 0 until accepted there
                if position < accepted_depth:
                    child(self.position_accepted, method, str(position)).inc()
                    per_pos.inc()


def draft_source(record: IterationRecord) -> str:
    """The `source` label of a drafted iteration: its record's source; a record that drafted without
    naming one (written before sources existed) drafted with the model, as the statistics count it."""
    return record.source or DraftSource.MODEL


def _model_name(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model: the served model name must be a non-empty string, got {name!r}")
    return name.strip()


class _RequestMetrics:
    """One run: its start, and the instant of its last emission (for TTFT and inter-token latency).

    Times are the loop's epoch seconds (IterationRecord.end's scale). A run that resumes a request
    with tokens has no first token of its own: no TTFT, and its first gap counts from the run's start.
    """

    def __init__(self, owner: OrchestratorMetrics, method: str, model: str, start_epoch: float,
                 resumed: bool = False) -> None:
        self.owner = owner
        self.method = method
        self.model = model  # at the start: the active gauge goes down under the label it went up with
        self.started = time.perf_counter()
        self.last_emission: float | None = start_epoch if resumed else None
        self.start_epoch = start_epoch

    @contextmanager
    def iteration(self, index: int, start: float) -> Iterator[_IterationMetrics]:
        yield _IterationMetrics(self.owner, self)

    def emitted(self, record: IterationRecord) -> None:
        """TTFT and inter-token latency of the tokens this iteration emitted."""
        count = len(record.emitted)
        if count == 0:
            return
        owner, model = self.owner, self.owner.model
        itl = owner.child(owner.itl, model, self.method)
        if self.last_emission is None:  # the first token: the others came with it
            owner.child(owner.ttft, model, self.method).observe(max(0.0, record.end - self.start_epoch))
            gap, count = 0.0, count - 1
        else:
            gap = max(0.0, record.end - self.last_emission) / count
        for _ in range(count):
            itl.observe(gap)
        self.last_emission = record.end

    def finished(self, result: GenerationResult | None, error: BaseException | None) -> None:
        owner, model = self.owner, self.owner.model
        owner.child(owner.active_requests, self.model, self.method).dec()
        if error is not None:
            outcome = "error"
        else:
            outcome = result.finish_reason if result is not None else "abandoned"
        owner.requests.labels(model, self.method, outcome).inc()
        owner.child(owner.request_seconds, model, self.method).observe(time.perf_counter() - self.started)


class _IterationMetrics:
    def __init__(self, owner: OrchestratorMetrics, request: _RequestMetrics) -> None:
        self.owner = owner
        self.request = request

    def call_started(self, kind: str, op: str, start: float) -> None:
        return None

    def call_finished(self, token: None, end: float, error: BaseException | None) -> None:
        return None

    def finished(self, record: IterationRecord, depth: int) -> None:
        self.owner.record_iteration(record, depth)
        self.request.emitted(record)


# ============================================================================ HTTP API

HTTP_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")


def http_route(path: str) -> str:
    """The `route` label of a request path: a known route, else "other" (a bounded label set)."""
    trimmed = path.rstrip("/") or "/"
    return trimmed if trimmed in HTTP_ROUTES else "other"


class HttpMetrics:
    """Requests of the OpenAI-compatible HTTP API by route and status (module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        counter, gauge, histogram = _makers(registry)
        self.requests = counter("specdec_http_requests", "HTTP requests answered, by route and status code.",
                                "route", "status")
        self.seconds = histogram("specdec_http_request_seconds", "HTTP request received to the last byte "
                                 "of its response (a stream's whole length).", "route",
                                 buckets=REQUEST_BUCKETS)
        self.active = gauge("specdec_http_active_requests", "HTTP requests in progress (open streams "
                            "included).", "route")

    def started(self, route: str) -> None:
        self.active.labels(route).inc()

    def finished(self, route: str, status: int, seconds: float) -> None:
        self.active.labels(route).dec()
        self.requests.labels(route, str(status)).inc()
        self.seconds.labels(route).observe(seconds)


# ============================================================================ engines


class EngineMetrics:
    """Metrics of engine services; observer(role) is the ServiceObserver a servicer takes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        counter, _, histogram = _makers(registry)
        self.calls = counter("specdec_engine_calls", "Engine calls (Draft, Lookahead, Score, Verify) by "
                             "outcome (ok, session_gone, invalid, cancelled, error).",
                             "role", "rpc", "outcome")
        self.call_seconds = histogram("specdec_engine_call_seconds", "Engine call time in its worker thread "
                                      "(session lock wait included).", "role", "rpc")
        self.forward_seconds = histogram("specdec_forward_seconds", "Model forward-pass time of one call.",
                                         "role", "rpc")
        self.verification_seconds = histogram("specdec_verification_seconds", "Time of the verification "
                                              "step (after the forward pass).", "method")
        self.reused_tokens = counter("specdec_reused_tokens", "Committed tokens whose KV entries were "
                                     "reused.", "role")
        self.sessions = _StatsCollector(_SESSION_STATS, label="role")
        registry.register(self.sessions)

    def observer(self, role: str) -> _EngineObserver:
        return _EngineObserver(self, role)

    def watch_engine(self, role: str, engine: Counting) -> None:
        """Report engine.stats() (sessions, evictions, KV tokens, batches, …) under role at every scrape."""
        self.sessions.add((role,), engine.stats)


class _EngineObserver:
    def __init__(self, owner: EngineMetrics, role: str) -> None:
        self.owner = owner
        self.role = role

    def observe(self, rpc: str, request: Any, result: Any, error: BaseException | None,
                start_ns: int, end_ns: int) -> None:
        owner, role = self.owner, self.role
        owner.calls.labels(role, rpc, call_outcome(error)).inc()
        seconds = max(0, end_ns - start_ns) / 1e9
        owner.call_seconds.labels(role, rpc).observe(seconds)
        if error is not None:
            return
        if rpc == "Score":  # a forward pass and nothing else
            owner.forward_seconds.labels(role, rpc).observe(seconds)
            return
        if result is None:
            return
        if rpc == "Verify":
            if not result.score_reused:  # else counted in its Score call
                owner.forward_seconds.labels(role, rpc).observe(result.forward_seconds)
            method = str(getattr(request, "method", ""))
            owner.verification_seconds.labels(method).observe(result.verify_seconds)
        else:
            owner.forward_seconds.labels(role, rpc).observe(result.forward_seconds)
        owner.reused_tokens.labels(role).inc(max(0, int(result.reused_tokens)))


def call_outcome(error: BaseException | None) -> str:
    """ok | session_gone (the caller resends its context: protocol, no failure) | invalid | overloaded
    (no room for a new session: load, not a fault) | cancelled | error."""
    if error is None:
        return "ok"
    name = type(error).__name__
    if name == "SessionGone":
        return "session_gone"
    if name == "Overloaded":
        return "overloaded"
    if name == "CancelledError":
        return "cancelled"
    if isinstance(error, ValueError):  # InvalidRequest and the other bad-argument errors
        return "invalid"
    return "error"


# engine.stats() key → (metric name, help, type); an engine may report only some of the keys.
_SESSION_STATS = {
    "active_sessions": ("specdec_active_sessions", "Sessions (KV caches) held by the engine.", "gauge"),
    "evictions": ("specdec_session_evictions", "Sessions dropped by LRU or TTL eviction.", "counter"),
    "expirations": ("specdec_session_expirations", "Sessions dropped after the TTL without use.", "counter"),
    "budget_evictions": ("specdec_session_budget_evictions", "Idle sessions evicted to keep the KV tokens "
                         "within the budget (--kv-cache-mb).", "counter"),
    "rejections": ("specdec_session_rejections", "Calls refused with RESOURCE_EXHAUSTED: every session was "
                   "busy and the budget full for --admission-timeout.", "counter"),
    "waiting": ("specdec_session_waiting_calls", "Calls waiting for room for a new session.", "gauge"),
    "kv_tokens": ("specdec_kv_tokens", "KV-cache tokens held by the sessions (as of their last call).",
                  "gauge"),
    "kv_budget_tokens": ("specdec_kv_budget_tokens", "KV-cache token budget of the sessions (--kv-cache-mb; "
                         "0 = none).", "gauge"),
    "queue_depth": ("specdec_batch_queue_depth", "Forward jobs waiting for a batched pass.", "gauge"),
    "batches": ("specdec_batches", "Batched forward passes run.", "counter"),
    "batch_calls": ("specdec_batch_calls", "Forward jobs served by batched passes (/ batches = mean batch "
                    "size).", "counter"),
    "batch_tokens": ("specdec_batch_tokens", "Query positions in batched passes, padding included.",
                     "counter"),
    "batch_positions": ("specdec_batch_positions", "Of those, the calls' own positions (the rest is "
                        "padding).", "counter"),
    "batch_seconds": ("specdec_batch_seconds", "Time the batched passes ran.", "counter"),
    "created": ("specdec_sessions_created", "Sessions created.", "counter"),
    "released": ("specdec_sessions_released", "Sessions released by their caller.", "counter"),
    "score_hits": ("specdec_score_hits", "Verifies that used the rows of an early Score call.", "counter"),
    "late_scores": ("specdec_late_scores", "Score calls ignored because their verify had run.", "counter"),
    "ahead_scores": ("specdec_ahead_scores", "Target-only passes run ahead of their Verify (score_ahead; "
                     "score_hits counts those used).", "counter"),
    "draft_rows_requests": ("specdec_draft_rows_requests", "Lean verifies answered with draft_rows_needed "
                            "(the orchestrator resends them with those rows).", "counter"),
    "prefix_cache_lookups": ("specdec_prefix_cache_lookups", "Prefix-cache lookups (a new context of at "
                             "least one uncached block).", "counter"),
    "prefix_cache_hits": ("specdec_prefix_cache_hits", "Of those, lookups that found at least one block "
                          "(/ lookups = hit rate).", "counter"),
    "prefix_cache_queried_tokens": ("specdec_prefix_cache_queried_tokens", "Tokens of the full blocks looked "
                                    "up, and of the partial blocks found.", "counter"),
    "prefix_cache_hit_tokens": ("specdec_prefix_cache_hit_tokens", "Of those, tokens found, whose prefill "
                                "was saved (/ queried = token hit rate).", "counter"),
    "prefix_cache_blocks": ("specdec_prefix_cache_blocks", "Blocks the prefix cache holds.", "gauge"),
    "prefix_cache_bytes": ("specdec_prefix_cache_bytes", "Bytes the prefix cache holds.", "gauge"),
    "prefix_cache_budget_bytes": ("specdec_prefix_cache_budget_bytes", "The prefix cache's budget "
                                  "(--prefix-cache-mb).", "gauge"),
    "prefix_cache_stored_blocks": ("specdec_prefix_cache_stored_blocks", "Blocks stored.", "counter"),
    "prefix_cache_evictions": ("specdec_prefix_cache_evictions", "Blocks evicted, least recently used "
                               "first, to stay within the budget.", "counter"),
}


# orchestrator.admission_stats() key → (metric name, help, type)
_DEPENDENCY_STATS = {
    "up": ("specdec_dependency_up", "1 while the dependency answers and is compatible, else 0 (a drafter "
           "down or incompatible means target-only steps; the verifier or store down means NOT_SERVING).",
           "gauge"),
}
_HEALTH_STATS = {
    "serving": ("specdec_serving", "1 while the orchestrator's gRPC health says SERVING.", "gauge"),
    "drafter_timeouts": ("specdec_drafter_timeouts", "Drafter calls abandoned after their deadline "
                         "(the iteration ran target-only).", "counter"),
}


def _dependency_up(status: Mapping[str, Any], name: str) -> dict[str, float]:
    entry = status.get(name)
    if not isinstance(entry, Mapping) or entry.get("state") == "absent":
        return {}  # e.g. no store configured, no drafter: no series
    return {"up": 1.0 if entry.get("state") == "ok" else 0.0}


def _health_values(status: Mapping[str, Any]) -> dict[str, float]:
    return {"serving": 1.0 if status.get("serving") else 0.0,
            "drafter_timeouts": float(status.get("drafter_timeouts", 0))}


_ADMISSION_STATS = {
    "active": ("specdec_admitted_requests", "Requests holding one of the --max-active-requests slots.",
               "gauge"),
    "waiting": ("specdec_queued_requests", "Requests waiting for a slot.", "gauge"),
    "rejected": ("specdec_rejected_requests", "Requests refused with RESOURCE_EXHAUSTED after waiting "
                 "--queue-timeout for a slot.", "counter"),
    "limit": ("specdec_request_slots", "Requests that may run at once (--max-active-requests).", "gauge"),
    "paused": ("specdec_paused_streams", "Streams paused without a slot: their reader has not taken the "
               "last chunk.", "gauge"),
    "idle_closed": ("specdec_idle_closed_streams", "Streams closed (resumable) after their reader took "
                    "nothing for --stream-idle-timeout.", "counter"),
    "caller_refused": ("specdec_caller_refused_requests", "Requests refused with RESOURCE_EXHAUSTED by "
                       "--max-requests-per-caller.", "counter"),
}


class _StatsCollector(Collector):
    """Metrics read from stats() dicts at scrape time (no bookkeeping in the engines' or the loop's
    path): `table` maps a key of the dicts to (metric name, help, gauge | counter). Keys a source
    does not report are skipped, and a source that fails is left out of that scrape."""

    def __init__(self, table: Mapping[str, tuple[str, str, str]], label: str | None = None) -> None:
        self._table = table
        self._labels = [label] if label else []
        self._sources: dict[tuple[str, ...], Callable[[], Mapping[str, Any]]] = {}
        self._lock = threading.Lock()

    def add(self, labels: tuple[str, ...], stats: Callable[[], Mapping[str, Any]]) -> None:
        """Read stats() under these label values (one per label; a source added again replaces it)."""
        with self._lock:
            self._sources[labels] = stats

    def _families(self) -> dict[str, Any]:
        families = {}
        for key, (name, text, kind) in self._table.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            families[key] = family(name, text, labels=self._labels)
        return families

    def describe(self) -> Iterator[Any]:
        yield from self._families().values()

    def collect(self) -> Iterator[Any]:
        families = self._families()
        with self._lock:
            sources = dict(self._sources)
        for labels, stats in sources.items():
            try:
                values = stats()
            except Exception:  # a scrape must not fail because of one source
                continue
            for key, family in families.items():
                if key in values:
                    family.add_metric(list(labels), float(values[key]))
        yield from families.values()


# ============================================================================ /metrics


@dataclass
class MetricsServer:
    """A running /metrics endpoint (prometheus-client's HTTP server in a daemon thread)."""

    server: Any
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(port: int, host: str = "127.0.0.1",
                         registry: CollectorRegistry | None = None) -> MetricsServer:
    """Serve `registry` (default: DEFAULT_REGISTRY) on http://host:port/metrics; port 0 = any free port."""
    from prometheus_client import start_http_server

    server, thread = start_http_server(port, addr=host, registry=registry or DEFAULT_REGISTRY)
    return MetricsServer(server, thread, host, int(server.server_address[1]))


# The registry a server process uses unless it builds its own (one role per process).
DEFAULT_REGISTRY = new_registry()
