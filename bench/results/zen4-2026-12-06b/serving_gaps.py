"""The 8-client runs side by side: aggregate tok/s, TTFT p50, ITL p50 and p99 and their ratio, and the
long gaps between a request's tokens — over the run, and for the first wave (the 8 requests that
start together on a fresh server, where chunks sized before anyone decoded held the first prompt done)
— and the verifier's rows that were prompt rows: all rows less the steps' (one a verify pass, the
iterations, plus the drafted tokens).

    python bench/results/zen4-2026-12-06b/serving_gaps.py bench/results/zen4-2026-12-06b/serving/{A1,B1,B2,A2}
"""

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    print("| run | agg tok/s | TTFT p50 s | ITL p50 s | ITL p99 s | p99/p50 | gaps > 2 s "
          "| first wave: longest gap, s | done | prompt rows |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in sys.argv[1:]:
        level = json.loads((Path(run) / "results.json").read_text())["serving"]["levels"][0]
        records = sorted(level["records"], key=lambda r: r["start"])
        first_wave = [r for r in records if r["start"] < 1.0]
        gaps = [g for r in records for g in r["gaps"]]
        longest_first = max((max(r["gaps"]) for r in first_wave if r["gaps"]), default=0.0)
        counters = level["passes"]["counters"]
        steps = sum(v for k, v in counters.items() if k.startswith("specdec_iterations_total"))
        steps += sum(v for k, v in counters.items() if k.startswith("specdec_source_drafted_tokens_total"))
        prompt_share = 1 - steps / counters["specdec_batch_tokens_total"]
        print(f"| {Path(run).name} | {level['aggregate_tok_s']:.2f} | {level['ttft_p50_s']:.1f} "
              f"| {level['itl_p50_s']:.3f} | {level['itl_p99_s']:.3f} "
              f"| {level['itl_p99_s'] / level['itl_p50_s']:.1f} | {sum(g > 2 for g in gaps)} "
              f"| {longest_first:.1f} | {level['requests']} | {prompt_share:.0%} |")
        ttfts = [r["ttft"] for r in first_wave]
        print(f"|   first wave TTFT, s: {', '.join(f'{t:.1f}' for t in sorted(ttfts))} "
              f"(median {statistics.median(ttfts):.1f}) ||||||||||")


if __name__ == "__main__":
    main()
