"""PNG plots of an analysis (`specdec analyze`, and the benchmark harness), drawn from its JSON dictionary.

- speedup_vs_k.png       predicted speedup of sequence drafting vs draft length k
- tps_vs_a.png           randomised drafting: tokens/s relative to the target alone vs a
                         (the shape of Toner et al.'s Fig. 4), measured points overlaid
- tokens_vs_budget.png   expected tokens per iteration vs draft budget for sequence, batch and
                         optimal trees, with the Tunstall and speed-of-light bounds (ERSD Fig. 3)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _finite_pairs(xs, ys):
    pairs = [(x, y) for x, y in zip(xs, ys, strict=False) if y is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _title(analysis: dict[str, Any]) -> str:
    meta = analysis["meta"]
    t = meta.get("sampling", {}).get("temperature")
    return (
        f"{meta['draft_id']} → {meta['target_id']}  (T={t}, α={analysis['acceptance']['alpha']:.3f}, "
        f"c={analysis['timing']['c']:.2f})"
    )


def plot_speedup_vs_k(analysis: dict[str, Any], path: Path) -> Path:
    curve = analysis["curves"]["speedup_vs_k"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(curve["k"], curve["token_formula"], "o-", label="token, formula (1−α^{k+1})/((1−α)(1+k/c))")
    ax.plot(curve["k"], curve["token_timed"], "s--", label="token, measured T_p(k+1)")
    ax.plot(curve["k"], curve["ersd_formula"], "^-", label="ERSD sequence, formula")
    if curve.get("block_sim_k"):
        ax.plot(curve["block_sim_k"], curve["block_sim_formula"], "D", label="block (simulated on rows)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup over target alone")
    ax.set_title(_title(analysis), fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tps_vs_a(
    analysis: dict[str, Any], path: Path, measured: list[tuple[float, float]] | None = None
) -> Path:
    curve = analysis["curves"]["tps_vs_a"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(curve["a"], curve["relative_tps_k1"], "-", label="RD, k_max = 1 (Toner et al.)")
    ax.plot(curve["a"], curve["relative_tps_best_k"], "-", label=f"RD, k_max = {curve['k_max']}")
    rd = analysis["plan"]["rd"]
    ax.axvline(rd["schedule"]["a"], color="C1", ls=":", lw=1, label=f"best a = {rd['schedule']['a']:.3f}")
    if measured:
        xs, ys = zip(*sorted(measured), strict=False)
        ax.plot(xs, ys, "ko", label="measured (bench)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("draft probability a")
    ax.set_ylabel("tokens/s relative to the target alone")
    ax.set_title(_title(analysis) + f", λ={analysis['timing']['lambda']:.2f}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tokens_vs_budget(analysis: dict[str, Any], path: Path) -> Path:
    curve = analysis["curves"]["tokens_vs_budget"]
    b = curve["budget"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(b, curve["sequence_gsd"], "-", label="sequence, GSD")
    ax.plot(b, curve["sequence_ersd"], "--", label="sequence, ERSD")
    ax.plot(b, curve["batch_gsd"], "-", label="batch, GSD")
    ax.plot(b, curve["batch_ersd"], "--", label="batch, ERSD")
    ax.plot(b, curve["tree_gsd"], "-", lw=2, label="optimal tree, GSD")
    ax.plot(b, curve["tree_ersd"], "--", lw=2, label="optimal tree, ERSD")
    for kind, color in (("gsd", "C4"), ("ersd", "C5")):
        # Each bound holds for trees under its own acceptance model R (GSD and ERSD differ).
        xs, ys = _finite_pairs(b, curve[f"tunstall_refined_{kind}"])
        if xs:
            ax.plot(xs, ys, ":", color=color, label=f"Tunstall bound (Lemma 4.2, {kind.upper()} R)")
    xs, ys = _finite_pairs(b, curve["speed_of_light"])
    if xs:
        ax.plot(xs, ys, "-.", color="r", label="speed of light (Thm 1)")
    ax.set_xlabel("draft budget (nodes)")
    ax.set_ylabel("expected tokens per iteration")
    ax.set_title(_title(analysis), fontsize=8)
    top = max(max(curve["tree_gsd"]), max(curve["tree_ersd"]), max(curve["sequence_gsd"]))
    ax.set_ylim(0.9, top * 1.6)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_analysis(
    analysis: dict[str, Any], directory: Path | str, measured_rd: list[tuple[float, float]] | None = None
) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return [
        plot_speedup_vs_k(analysis, directory / "speedup_vs_k.png"),
        plot_tps_vs_a(analysis, directory / "tps_vs_a.png", measured_rd),
        plot_tokens_vs_budget(analysis, directory / "tokens_vs_budget.png"),
    ]
