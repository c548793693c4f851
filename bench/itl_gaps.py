"""Where a serving level's gaps between tokens come from, read from its trace (`--trace-file`).

    python -m bench.itl_gaps trace-serving-specdec-T0.jsonl [--top 20]

A gap is the time between two iterations of one request that emitted tokens (as a streaming client
sees it, without the network; the first token is TTFT, not a gap). Printed: the gap percentiles (as
bench.bench_serving computes ITL), the gaps by the iteration's draft source, and the longest gaps,
each with how many verifier calls ended with it and how long the longest of them took (calls of one
batched pass end within 50 ms, so a gap that many requests share is one slow pass), and the prompts
the verifier was taking in meanwhile (calls in flight that sent more than 16 new tokens). This is
how the 256-row prefill chunks behind ITL p99 were found (bench/RESULTS.md, "Prefill chunks sized
by the decode pass").
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bench.bench_serving import percentile

SAME_PASS_NS = 50_000_000  # verifier calls that end this close together ran in one pass (their replies
# reach the orchestrator some milliseconds apart)
PROMPT_TOKENS = 16  # a verifier call that sends more new tokens than this takes in a prompt


@dataclass(frozen=True)
class Gap:
    seconds: float
    end_ns: int
    request: str
    source: str  # the iteration's draft source; "target-only" without one


def read_spans(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def gaps(spans: Iterable[dict]) -> list[Gap]:
    """Every request's gaps between consecutive iterations that emitted tokens."""
    iterations: dict[str, list[dict]] = defaultdict(list)
    for span in spans:
        if span["name"] == "specdec.iteration" and span["attributes"].get("specdec.emitted", 0) > 0:
            iterations[span["parent_span_id"]].append(span)
    out: list[Gap] = []
    for spans_of_request in iterations.values():
        ordered = sorted(spans_of_request, key=lambda span: span["end_ns"])
        for before, after in zip(ordered, ordered[1:], strict=False):
            attributes = after["attributes"]
            out.append(Gap((after["end_ns"] - before["end_ns"]) / 1e9, after["end_ns"],
                           str(attributes.get("specdec.request_id", "")),
                           str(attributes.get("specdec.source") or "target-only")))
    return out


def report(spans: list[dict], top: int) -> str:
    found = gaps(spans)
    if not found:
        return "no gaps: the trace has no request with two iterations that emitted tokens"
    seconds = [gap.seconds for gap in found]
    p99 = percentile(seconds, 99)
    lines = [f"{len(found)} gaps: p50 {percentile(seconds, 50):.3f} s, p90 {percentile(seconds, 90):.3f} s, "
             f"p99 {p99:.3f} s, max {max(seconds):.3f} s", "", "by draft source:"]
    by_source: dict[str, list[float]] = defaultdict(list)
    for gap in found:
        by_source[gap.source].append(gap.seconds)
    for source, values in sorted(by_source.items()):
        lines.append(f"  {source}: {len(values)} gaps, median {statistics.median(values):.3f} s, "
                     f"p99 {percentile(values, 99):.3f} s")
    verifies = [span for span in spans if span["name"] == "verifier.verify"]

    def prompts_in_flight(gap: Gap) -> list[int]:
        return [span["attributes"].get("specdec.append_tokens", 0) for span in verifies
                if span["start_ns"] < gap.end_ns < span["end_ns"] + SAME_PASS_NS
                and span["attributes"].get("specdec.append_tokens", 0) > PROMPT_TOKENS]

    tail = [gap for gap in found if gap.seconds >= p99]
    lines.append(f"gaps from p99 up: {len(tail)}, of them {sum(bool(prompts_in_flight(g)) for g in tail)} "
                 "while the verifier took in a prompt")
    lines += ["", f"the {top} longest gaps: the verifier calls that ended with them (one pass), and the "
              "prompts taken in meanwhile:"]
    for gap in sorted(found, key=lambda g: -g.seconds)[:top]:
        together = [span for span in verifies if abs(span["end_ns"] - gap.end_ns) <= SAME_PASS_NS]
        longest = max(((span["end_ns"] - span["start_ns"]) / 1e9 for span in together), default=0.0)
        prompts = prompts_in_flight(gap)
        lines.append(f"  {gap.seconds:.2f} s  {gap.source:<11} {gap.request}: {len(together)} calls ended "
                     f"with it (longest {longest:.2f} s); prompts in flight {len(prompts)} "
                     f"({sum(prompts)} tokens)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.itl_gaps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="a trace file of `specdec up --trace-file` (.jsonl or .jsonl.gz)")
    p.add_argument("--top", type=int, default=20, help="how many of the longest gaps to show")
    args = p.parse_args(argv)
    if not args.trace.is_file():
        p.error(f"no such trace file: {args.trace}")
    print(report(read_spans(args.trace), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
