"""Cached TTFT ÷ the new tokens alone, per turn and run, from the runs' results.json (bench_prefix);
the runs are folders here. Run from the repo root:

    python bench/results/first-token-2026-12-02/ratios.py A1 B1 A2 B2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.prefix_ratios import main  # noqa: E402

if __name__ == "__main__":
    main([str(Path(__file__).parent / run) for run in sys.argv[1:]])
