"""The benchmark's own plot: measured tokens/s per configuration (bench_tps.png).

The analysis plots (speedup vs k, tokens/s vs a, tokens vs budget) are the product's:
specdec.plots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_bench(results: dict[str, Any], path: Path | str) -> Path:
    rows = results["summary"]
    names = [r["name"] for r in rows]
    tps = [r.get("decode_tokens_per_second") or 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(7.0, 0.35 * len(rows) + 1.5))
    ax.barh(names[::-1], tps[::-1], color=["C0" if r["kind"] != "baseline" else "grey" for r in rows][::-1])
    ax.set_xlabel("decode tokens/s (median over repeats, prefill excluded)")
    ax.set_title(f"{results['settings']['draft']} → {results['settings']['target']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
