"""Turn the spans of a run into a timeline a person can look at, and into Chrome/Perfetto JSON.

Input: spans in the JSON-lines schema of orchestrator.tracing (a `--trace-file`, or what
`specdec trace-collect` received), or an OpenTelemetry Collector file-exporter file (OTLP/JSON);
load_spans (specdec.cli.span_files) reads either. Output:
- a self-contained HTML page (inline CSS and SVG, no script, no network): summary figures,
  per request a Gantt-style timeline of drafter vs verifier calls per iteration (engine
  forward passes inside them when the services' spans are there, overlap marked), accepted
  vs drafted tokens per iteration, and a table of every iteration. Counts are exposed in the
  DOM (`#report[data-requests][data-iterations]`, one `g.iteration` per drawn iteration).
- Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev): every span as a complete event,
  one process per service, one thread per request and lane.
"""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from orchestrator.intervals import intersections, overlap
from orchestrator.tracing import DRAFT_SPAN, ITERATION_SPAN, REQUEST_SPAN, VERIFY_SPAN

ENGINE_SUFFIXES = (".forward", ".verification", ".score")  # verifier.score: a forward pass, nothing else
MAX_DRAWN_REQUESTS = 50
PX_PER_ITERATION = 18
MIN_WIDTH, MAX_WIDTH = 1300, 24000
LABEL_W = 120
LANE_H = 24


# ============================================================================ model


@dataclass
class Call:
    kind: str  # draft | verify
    op: str  # draft | score | verify
    start_ns: int
    end_ns: int
    engine: list[tuple[str, int, int]] = field(default_factory=list)  # (name, start, end) service spans

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass
class Iteration:
    index: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    calls: list[Call] = field(default_factory=list)

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attributes.get(f"specdec.{name}", default)

    @property
    def accepted(self) -> int:
        return int(self.attr("accepted", 0) or 0)

    @property
    def num_drafted(self) -> int:
        return int(self.attr("num_drafted", 0) or 0)

    @property
    def emitted(self) -> int:
        return int(self.attr("emitted", 0) or 0)

    @property
    def drafted(self) -> bool:
        return bool(self.attr("drafted", False))

    def busy(self, kind: str) -> float:
        value = self.attr(f"{kind}_seconds")
        if value is not None:
            return float(value)
        return sum(c.seconds for c in self.calls if c.kind == kind)

    @property
    def overlap(self) -> float:
        value = self.attr("overlap_seconds")
        if value is not None:
            return float(value)
        return overlap_seconds([(c.start_ns, c.end_ns) for c in self.calls if c.kind == "draft"],
                               [(c.start_ns, c.end_ns) for c in self.calls if c.kind == "verify"]) / 1e9


@dataclass
class RequestRun:
    trace_id: str
    request_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    iterations: list[Iteration] = field(default_factory=list)

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attributes.get(f"specdec.{name}", default)

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def overlap_seconds(a: Iterable[tuple[int, int]], b: Iterable[tuple[int, int]]) -> float:
    return overlap(a, b)


def build_runs(spans: Sequence[dict[str, Any]]) -> list[RequestRun]:
    """Request runs with their iterations and calls (and the services' spans under the calls)."""
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        children[span.get("parent_span_id")].append(span)

    def descendants(span_id: str) -> Iterable[dict[str, Any]]:
        stack = list(children.get(span_id, ()))
        while stack:
            span = stack.pop()
            yield span
            stack.extend(children.get(span["span_id"], ()))

    runs = []
    for span in spans:
        if span.get("name") != REQUEST_SPAN:
            continue
        attrs = span.get("attributes", {})
        run = RequestRun(span["trace_id"], str(attrs.get("specdec.request_id", span["span_id"])),
                         int(span["start_ns"]), int(span["end_ns"]), attrs)
        for child in children.get(span["span_id"], ()):
            if child.get("name") != ITERATION_SPAN:
                continue
            cattrs = child.get("attributes", {})
            iteration = Iteration(int(cattrs.get("specdec.iteration", len(run.iterations))),
                                  int(child["start_ns"]), int(child["end_ns"]), cattrs)
            for call_span in children.get(child["span_id"], ()):
                name = call_span.get("name")
                if name not in (DRAFT_SPAN, VERIFY_SPAN):
                    continue
                kind = "draft" if name == DRAFT_SPAN else "verify"
                call = Call(kind, str(call_span.get("attributes", {}).get("specdec.call", kind)),
                            int(call_span["start_ns"]), int(call_span["end_ns"]))
                for below in descendants(call_span["span_id"]):
                    if below.get("name", "").endswith(ENGINE_SUFFIXES):
                        call.engine.append((below["name"], int(below["start_ns"]), int(below["end_ns"])))
                call.engine.sort(key=lambda e: e[1])
                iteration.calls.append(call)
            iteration.calls.sort(key=lambda c: c.start_ns)
            run.iterations.append(iteration)
        run.iterations.sort(key=lambda it: (it.index, it.start_ns))
        runs.append(run)
    runs.sort(key=lambda r: r.start_ns)
    return runs


@dataclass
class Summary:
    requests: int
    iterations: int
    drafted_iterations: int
    new_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    wall_seconds: float
    request_seconds: float
    draft_busy: float
    verify_busy: float
    overlap: float
    methods: list[str]

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def overlap_share(self) -> float:
        """Share of the verifier's busy time during which the drafter was busy too."""
        return self.overlap / self.verify_busy if self.verify_busy > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.request_seconds if self.request_seconds > 0 else 0.0


def summarize(runs: Sequence[RequestRun]) -> Summary:
    iterations = [it for run in runs for it in run.iterations]
    return Summary(
        requests=len(runs),
        iterations=len(iterations),
        drafted_iterations=sum(it.drafted for it in iterations),
        new_tokens=sum(it.emitted for it in iterations),
        drafted_tokens=sum(it.num_drafted for it in iterations if it.drafted),
        accepted_tokens=sum(it.accepted for it in iterations if it.drafted),
        wall_seconds=(max(r.end_ns for r in runs) - min(r.start_ns for r in runs)) / 1e9 if runs else 0.0,
        request_seconds=sum(r.seconds for r in runs),
        draft_busy=sum(it.busy("draft") for it in iterations),
        verify_busy=sum(it.busy("verify") for it in iterations),
        overlap=sum(it.overlap for it in iterations),
        methods=sorted({str(r.attr("method", "?")) for r in runs}),
    )


# ============================================================================ HTML

_CSS = """
:root { --draft:#4c78a8; --draft-fwd:#1f3f66; --verify:#f58518; --verify-fwd:#9c4a00; --verif:#e45756;
        --overlap:#2ca02c; --accepted:#54a24b; --rejected:#c9c9c9; --ink:#222; --muted:#666; }
* { box-sizing: border-box; }
body { font: 14px/1.4 system-ui, -apple-system, "DejaVu Sans", sans-serif; color: var(--ink); margin: 0;
       background: #fafafa; }
header { padding: 16px 24px 8px; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 24px 0 6px; }
.muted { color: var(--muted); }
main { padding: 0 24px 32px; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 8px 0 4px; }
.card { background: #fff; border: 1px solid #e3e3e3; border-radius: 6px; padding: 8px 12px;
        min-width: 130px; }
.card .v { font-size: 20px; font-weight: 600; }
.card .k { font-size: 12px; color: var(--muted); }
.request { background: #fff; border: 1px solid #e3e3e3; border-radius: 6px; padding: 8px 12px;
           margin: 14px 0; }
.scroll { overflow-x: auto; }
.legend { display: flex; gap: 14px; flex-wrap: wrap; font-size: 12px; margin: 6px 0; }
.legend i { display: inline-block; width: 14px; height: 10px; margin-right: 4px; vertical-align: middle; }
svg text { font: 11px system-ui, "DejaVu Sans", sans-serif; fill: var(--ink); }
svg .lane-label { font-weight: 600; }
table { border-collapse: collapse; font-size: 12px; margin-top: 6px; }
th, td { border-bottom: 1px solid #eee; padding: 2px 8px; text-align: right; }
th { background: #f3f3f3; position: sticky; top: 0; }
td.l, th.l { text-align: left; }
details summary { cursor: pointer; color: var(--muted); margin-top: 6px; }
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _ms(seconds: float) -> str:
    """A duration as a person reads it: 12.3 ms, 4.56 s."""
    return f"{seconds:.2f} s" if seconds >= 1.0 else f"{seconds * 1000:.1f} ms"


def _tick_step(span_ns: int, target: int = 10) -> int:
    """A round tick spacing (1, 2 or 5 × 10^n ns) giving about `target` ticks."""
    raw = max(1.0, span_ns / target)
    power = 10 ** int(math.floor(math.log10(raw)))
    for factor in (1, 2, 5, 10):
        if factor * power >= raw:
            return int(factor * power)
    return int(10 * power)


def _tick_label(offset_ns: int, step_ns: int) -> str:
    if step_ns >= 1_000_000_000:
        return f"{offset_ns / 1e9:g} s"
    if step_ns >= 1_000_000:
        return f"{offset_ns / 1e6:g} ms"
    return f"{offset_ns / 1e3:g} µs"


def _card(value: str, key: str, ident: str | None = None) -> str:
    ident_attr = f' id="{ident}"' if ident else ""
    return (f'<div class="card"><div class="v"{ident_attr}>{_e(value)}</div>'
            f'<div class="k">{_e(key)}</div></div>')


def _legend() -> str:
    items = [("var(--draft)", "drafter call"), ("var(--draft-fwd)", "drafter forward pass"),
             ("var(--verify)", "verifier call (score / verify)"),
             ("var(--verify-fwd)", "verifier forward pass"),
             ("var(--verif)", "verification"), ("var(--overlap)", "overlap (both busy)"),
             ("var(--accepted)", "accepted tokens"), ("var(--rejected)", "drafted, rejected")]
    return '<div class="legend">' + "".join(f'<span><i style="background:{c}"></i>{_e(t)}</span>'
                                            for c, t in items) + "</div>"


def _gantt(run: RequestRun, number: int) -> str:
    """SVG: lanes iteration / drafter / verifier / overlap / accepted on a real time axis."""
    iterations = run.iterations
    t0 = min([run.start_ns] + [it.start_ns for it in iterations])
    t1 = max([run.end_ns] + [it.end_ns for it in iterations])
    span_ns = max(1, t1 - t0)
    width = max(MIN_WIDTH, min(MAX_WIDTH, LABEL_W + 40 + PX_PER_ITERATION * len(iterations)))
    plot_w = width - LABEL_W - 40  # room for the last tick's label
    lanes = ["iteration", "drafter", "verifier", "overlap", "accepted"]
    axis_h = 22
    height = axis_h + LANE_H * len(lanes) + 8 + 2 * LANE_H  # the accepted lane is three lanes high

    def x(t: int) -> float:
        return LABEL_W + (t - t0) / span_ns * plot_w

    def w(a: int, b: int) -> float:
        return max(0.6, (b - a) / span_ns * plot_w)

    def lane_y(name: str) -> float:
        return axis_h + LANE_H * lanes.index(name)

    out = [f'<svg class="gantt" data-request="{_e(run.request_id)}" width="{width}" height="{height}" '
           f'xmlns="http://www.w3.org/2000/svg" role="img" aria-label="timeline of request {number}">']
    # time axis
    step = _tick_step(span_ns)
    for offset in range(0, span_ns + 1, step):
        xi = x(t0 + offset)
        out.append(f'<line x1="{xi:.1f}" y1="{axis_h - 4}" x2="{xi:.1f}" y2="{height}" stroke="#eee"/>')
        label = _tick_label(offset, step)
        out.append(f'<text x="{xi:.1f}" y="{axis_h - 8}" text-anchor="middle">{label}</text>')
    for name in lanes:
        label = {"accepted": "accepted / drafted"}.get(name, name)
        out.append(f'<text class="lane-label" x="6" y="{lane_y(name) + 16}">{_e(label)}</text>')
    max_bar = max([1] + [max(it.num_drafted, it.accepted, 1) for it in iterations])
    acc_h = 3 * LANE_H - 6
    acc_base = lane_y("accepted") + 3 * LANE_H - 2
    for n, it in enumerate(iterations):
        xi, wi = x(it.start_ns), w(it.start_ns, it.end_ns)
        tip = (f"iteration {it.index} · {it.attr('method', '?')} · drafted {it.num_drafted} · accepted "
               f"{it.accepted} · emitted {it.emitted} · k {it.attr('k', 0)} · "
               f"draft {_ms(it.busy('draft'))} · verify {_ms(it.busy('verify'))} · overlap {_ms(it.overlap)}")
        out.append(f'<g class="iteration" data-index="{it.index}" data-accepted="{it.accepted}" '
                   f'data-drafted="{int(it.drafted)}" data-overlap-ms="{it.overlap * 1000:.3f}">'
                   f'<title>{_e(tip)}</title>')
        fill = "#f1f1f1" if n % 2 == 0 else "#e2e2e2"
        out.append(f'<rect x="{xi:.2f}" y="{lane_y("iteration") + 3}" width="{wi:.2f}" height="{LANE_H - 6}" '
                   f'fill="{fill}" stroke="#bbb" stroke-width="0.5"/>')
        if wi >= 16:
            out.append(f'<text x="{xi + wi / 2:.1f}" y="{lane_y("iteration") + 16}" '
                       f'text-anchor="middle">{it.index}</text>')
        for call in it.calls:
            lane = "drafter" if call.kind == "draft" else "verifier"
            color = "var(--draft)" if call.kind == "draft" else "var(--verify)"
            y = lane_y(lane) + 3
            out.append(f'<rect class="call {call.kind}" x="{x(call.start_ns):.2f}" y="{y}" '
                       f'width="{w(call.start_ns, call.end_ns):.2f}" height="{LANE_H - 6}" fill="{color}">'
                       f'<title>{_e(call.op)} {_ms(call.seconds)}</title></rect>')
            for name, start, end in call.engine:
                inner = ("var(--verif)" if name.endswith(".verification")
                         else "var(--draft-fwd)" if call.kind == "draft" else "var(--verify-fwd)")
                out.append(f'<rect class="engine" x="{x(start):.2f}" y="{y + 5}" width="{w(start, end):.2f}" '
                           f'height="{LANE_H - 16}" fill="{inner}"><title>{_e(name)} '
                           f'{_ms((end - start) / 1e9)}</title></rect>')
        drafts = [(c.start_ns, c.end_ns) for c in it.calls if c.kind == "draft"]
        verifies = [(c.start_ns, c.end_ns) for c in it.calls if c.kind == "verify"]
        for start, end in intersections(drafts, verifies):
            out.append(f'<rect class="overlap" x="{x(start):.2f}" y="{lane_y("overlap") + 3}" '
                       f'width="{w(start, end):.2f}" height="{LANE_H - 6}" fill="var(--overlap)"/>')
        if it.drafted:
            hd = acc_h * it.num_drafted / max_bar
            out.append(f'<rect x="{xi:.2f}" y="{acc_base - hd:.1f}" width="{wi:.2f}" height="{hd:.1f}" '
                       f'fill="var(--rejected)"/>')
        ha = acc_h * it.accepted / max_bar
        if ha > 0:
            out.append(f'<rect class="accepted" x="{xi:.2f}" y="{acc_base - ha:.1f}" width="{wi:.2f}" '
                       f'height="{ha:.1f}" fill="var(--accepted)"/>')
        if wi >= 12 and it.drafted:
            top = acc_base - max(ha, acc_h * it.num_drafted / max_bar) - 3
            out.append(f'<text x="{xi + wi / 2:.1f}" y="{top:.1f}" text-anchor="middle">{it.accepted}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def _iteration_table(run: RequestRun) -> str:
    head = ("<tr><th>#</th><th class='l'>method</th><th>drafted</th><th>k</th><th>heads</th><th>accepted</th>"
            "<th>emitted</th><th>draft</th><th>verify</th><th>overlap</th><th>overlap share</th></tr>")
    rows = []
    for it in run.iterations:
        verify = it.busy("verify")
        share = it.overlap / verify if verify > 0 else 0.0
        heads = it.attr("heads")
        rows.append(
            f"<tr><td>{it.index}</td><td class='l'>{_e(it.attr('method', '?'))}</td>"
            f"<td>{it.num_drafted if it.drafted else '–'}</td><td>{_e(it.attr('k', 0))}</td>"
            f"<td>{'' if heads is None else _e(heads)}</td><td>{it.accepted}</td><td>{it.emitted}</td>"
            f"<td>{_ms(it.busy('draft'))}</td><td>{_ms(verify)}</td><td>{_ms(it.overlap)}</td>"
            f"<td>{100 * share:.0f}%</td></tr>")
    return f"<details><summary>every iteration</summary><table>{head}{''.join(rows)}</table></details>"


def render_html(spans: Sequence[dict[str, Any]], title: str = "specdec timeline",
                sources: Sequence[str] = (), max_requests: int = MAX_DRAWN_REQUESTS) -> str:
    """The self-contained HTML page of a run's spans."""
    runs = build_runs(spans)
    s = summarize(runs)
    drawn = runs[:max_requests]
    cards = "".join([
        _card(str(s.requests), "requests", "request-count"),
        _card(str(s.iterations), "iterations", "iteration-count"),
        _card(str(s.new_tokens), "new tokens", "token-count"),
        _card(f"{s.tokens_per_second:.1f}", "tokens / s (per request)"),
        _card(f"{s.accepted_tokens}/{s.drafted_tokens}", "accepted / drafted"),
        _card(f"{100 * s.acceptance:.0f}%", "acceptance rate"),
        _card(f"{s.drafted_iterations}/{s.iterations}", "drafted iterations"),
        _card(_ms(s.draft_busy), "drafter busy"),
        _card(_ms(s.verify_busy), "verifier busy"),
        _card(_ms(s.overlap), "overlap"),
        _card(f"{100 * s.overlap_share:.0f}%", "overlap share of verifier time", "overlap-share"),
    ])
    sections = []
    for number, run in enumerate(drawn, 1):
        a = run.attr("a")
        knobs = [f"method {run.attr('method', '?')}", f"k {run.attr('k', '?')}"]
        if a is not None:
            knobs.append(f"a {a}")
        if run.attr("tree_budget") is not None:
            knobs.append(f"tree budget {run.attr('tree_budget')}")
        new_tokens = run.attr("new_tokens", sum(i.emitted for i in run.iterations))
        stats = (f"{len(run.iterations)} iterations · {new_tokens} tokens in {run.seconds:.2f} s · "
                 f"finish {run.attr('finish_reason', '?')}")
        sections.append(
            f'<section class="request" data-request="{_e(run.request_id)}" '
            f'data-iterations="{len(run.iterations)}">'
            f"<h2>request {number}: <code>{_e(run.request_id)}</code></h2>"
            f'<div class="muted">{_e(" · ".join(knobs))} — {_e(stats)} · trace '
            f"<code>{_e(run.trace_id)}</code></div>{_legend()}<div class='scroll'>{_gantt(run, number)}</div>"
            f"{_iteration_table(run)}</section>")
    if len(runs) > len(drawn):
        sections.append(f'<p class="muted">{len(runs) - len(drawn)} more requests are in the summary but not '
                        f"drawn (--max-requests).</p>")
    if not runs:
        sections.append('<p class="muted">No specdec.request spans found: was tracing on for the '
                        "orchestrator (--trace-file or an OTLP endpoint)?</p>")
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    source_text = ", ".join(sources) if sources else "spans"
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>{_e(title)}</title>"
        f"<style>{_CSS}</style></head><body>"
        f"<header><h1>{_e(title)}</h1><div class='muted'>{len(spans)} spans from {_e(source_text)} · methods "
        f"{_e(', '.join(s.methods) or '–')} · generated {generated}</div></header>"
        f'<main id="report" data-requests="{s.requests}" data-iterations="{s.iterations}" '
        f'data-drawn-iterations="{sum(len(r.iterations) for r in drawn)}">'
        f'<div class="cards">{cards}</div>{"".join(sections)}</main></body></html>'
    )


# ============================================================================ Chrome / Perfetto


def _request_of(spans: Sequence[dict[str, Any]]) -> dict[str, str]:
    """span_id → request id of its nearest specdec.request ancestor (spans outside any request: '')."""
    by_id = {s["span_id"]: s for s in spans}
    memo: dict[str, str] = {}

    def find(span_id: str) -> str:
        path = []
        current: str | None = span_id
        result = ""
        while current is not None and current in by_id:
            if current in memo:
                result = memo[current]
                break
            path.append(current)
            span = by_id[current]
            if span.get("name") == REQUEST_SPAN:
                result = str(span.get("attributes", {}).get("specdec.request_id", current))
                break
            current = span.get("parent_span_id")
        for node in path:
            memo[node] = result
        return result

    return {s["span_id"]: find(s["span_id"]) for s in spans}


def _lane(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> str:
    """Spans of one lane never overlap each other except by nesting (what trace viewers need)."""
    name = span.get("name", "")
    if name == REQUEST_SPAN:
        return "request"
    if name == ITERATION_SPAN:
        return "iterations"
    current: dict[str, Any] | None = span
    while current is not None:  # under a draft / verify call span (this process or the caller's)
        if current.get("name") == DRAFT_SPAN:
            return "draft calls"
        if current.get("name") == VERIFY_SPAN:
            return "verify calls"
        current = by_id.get(current.get("parent_span_id") or "")
    return "other"


def chrome_trace(spans: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Trace-event JSON: complete events (ph X, µs), one pid per service, one tid per request × lane."""
    spans = [s for s in spans if s.get("end_ns", 0) >= s.get("start_ns", 0)]
    if not spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(s["start_ns"] for s in spans)
    by_id = {s["span_id"]: s for s in spans}
    request_of = _request_of(spans)
    pids: dict[str, int] = {}
    tids: dict[tuple[int, str], int] = {}
    events: list[dict[str, Any]] = []
    for span in sorted(spans, key=lambda s: (s["start_ns"], -s["end_ns"])):
        service = span.get("service") or "unknown"
        pid = pids.setdefault(service, len(pids) + 1)
        request = request_of.get(span["span_id"], "")
        lane = _lane(span, by_id)
        thread = f"{request[:12]} {lane}" if request else lane
        tid = tids.setdefault((pid, thread), len(tids) + 1)
        args = {k: v for k, v in span.get("attributes", {}).items()}
        args.update(trace_id=span["trace_id"], span_id=span["span_id"], status=span.get("status", "UNSET"))
        events.append({"name": span.get("name", "?"), "cat": span.get("kind", "INTERNAL").lower(),
                       "ph": "X", "ts": (span["start_ns"] - t0) / 1000,
                       "dur": (span["end_ns"] - span["start_ns"]) / 1000, "pid": pid, "tid": tid,
                       "args": args})
        if span.get("name") == ITERATION_SPAN:
            attrs = span.get("attributes", {})
            events.append({"name": "tokens", "ph": "C", "ts": (span["end_ns"] - t0) / 1000, "pid": pid,
                           "args": {"accepted": attrs.get("specdec.accepted", 0),
                                    "drafted": attrs.get("specdec.num_drafted", 0)}})
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": service}}
            for service, pid in pids.items()]
    meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}}
             for (pid, thread), tid in tids.items()]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"source": "specdec trace-report", "epoch_ns_at_zero": t0}}


def write_chrome_trace(spans: Sequence[dict[str, Any]], path: Any) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(chrome_trace(spans), handle, separators=(",", ":"))


# ============================================================================ headless Chromium

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BROWSER_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars")


def find_browser() -> str | None:
    """A headless-capable Chromium on PATH (Debian: `apt-get install chromium`), or None."""
    import shutil

    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def run_browser(page: Any, *args: str, timeout_s: float = 120.0, browser: str | None = None) -> str:
    """Run headless Chromium on a local page with a fresh profile; returns its stdout.

    Raises RuntimeError when no browser is installed or it fails, TimeoutError when it hangs.
    """
    import subprocess
    import tempfile
    from pathlib import Path

    browser = browser or find_browser()
    if browser is None:
        raise RuntimeError("no Chromium found on PATH (Debian: apt-get install chromium)")
    url = Path(page).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="specdec-chromium-") as profile:
        argv = [browser, *BROWSER_FLAGS, f"--user-data-dir={profile}", *args, url]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{browser} did not finish within {timeout_s:.0f}s") from None
    if done.returncode != 0:
        raise RuntimeError(f"{browser} exited with {done.returncode}: {done.stderr.strip()[-500:]}")
    return done.stdout


def screenshot(page: Any, png: Any, width: int = 1400, height: int = 900, timeout_s: float = 120.0) -> None:
    """PNG of the page as headless Chromium renders it at width × height."""
    from pathlib import Path

    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    run_browser(page, f"--window-size={width},{height}", f"--screenshot={png}", timeout_s=timeout_s)
    if not png.exists() or png.stat().st_size == 0:
        raise RuntimeError(f"the browser wrote no screenshot to {png}")


def dump_dom(page: Any, timeout_s: float = 120.0) -> str:
    """The DOM after headless Chromium loaded the page (what a person's browser would show)."""
    return run_browser(page, "--dump-dom", timeout_s=timeout_s)
