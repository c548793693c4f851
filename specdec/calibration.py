"""A model pair's calibration: what `specdec analyze` measured, kept as the orchestrator's defaults.

Stored as JSON in ``$SPECDEC_HOME/calibration/<pair-key>.json``. The orchestrator reads it with
`load_calibration(draft_id, target_id)` and takes `orchestrator_defaults()` as its defaults for
that pair (k, tree budget, a, rank acceptance); a request's own values still win. The numbers
depend on the sampling parameters they were measured at, which the file records.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from specdec.defaults import specdec_home

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 1


@dataclass
class Calibration:
    draft_id: str
    target_id: str
    sampling: dict[str, Any]  # SamplingParams fields the numbers were measured at
    alpha: float  # token acceptance 1 − TV, mean over measured positions
    ersd_alpha: float  # ERSD first-token acceptance
    t_p: float  # seconds per target decoding step
    t_q: float  # seconds per draft decoding step
    best_k: int  # sequence draft length (token / block / ersd), from measured timings
    tree_budget: int  # gsd-tree node budget
    a: float  # RD drafting probability
    rd_k_max: int  # RD cap on drafted tokens
    rank_acceptance: list[float]  # R(j) of recursive rejection (gsd-tree), non-increasing
    ersd_rank_acceptance: list[float] = field(default_factory=list)
    ersd_tree_budget: int | None = None
    lemma_4_3_holds: bool | None = None
    rows: int = 0  # measured positions behind the numbers
    created_at: float = 0.0
    version: int = CALIBRATION_VERSION

    @property
    def c(self) -> float:
        return self.t_p / self.t_q

    @property
    def lam(self) -> float:
        return self.t_q / self.t_p

    def orchestrator_defaults(self) -> dict[str, Any]:
        """OrchestratorConfig fields this calibration sets (names as in orchestrator.config)."""
        return {
            "default_k": int(self.best_k),
            "default_tree_budget": int(self.tree_budget),
            "default_a": float(self.a),
            "rank_acceptance": [float(r) for r in self.rank_acceptance],
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_analysis(cls, analysis: Any) -> Calibration:
        """Built from a specdec.analysis.Analysis (or its to_dict() form)."""
        from specdec.analysis import Analysis, monotone

        data = analysis if isinstance(analysis, Analysis) else Analysis.from_dict(analysis)
        plan = data.plan
        schedule = plan["rd"]["schedule"]
        return cls(
            draft_id=str(data.meta["draft_id"]),
            target_id=str(data.meta["target_id"]),
            sampling=dict(data.meta["sampling"]),
            alpha=float(data.acceptance["alpha"]),
            ersd_alpha=float(data.acceptance["ersd_alpha"]),
            t_p=data.timing.t_p,
            t_q=data.timing.t_q,
            best_k=int(plan["sequence"]["best_k_timed"]),
            tree_budget=int(plan["tree"]["gsd"]["budget"]),
            a=float(schedule["a"]),
            rd_k_max=int(schedule["k_max"]),
            rank_acceptance=[r for r in monotone(data.rank_acceptance["gsd"]) if r > 0] or [0.0],
            ersd_rank_acceptance=[r for r in monotone(data.rank_acceptance["ersd"]) if r > 0],
            ersd_tree_budget=int(plan["tree"]["ersd"]["budget"]),
            lemma_4_3_holds=bool(plan["rd"]["lemma_4_3_holds"]),
            rows=int(data.meta.get("rows", 0)),
            created_at=time.time(),
        )


def pair_key(draft_id: str, target_id: str) -> str:
    """File-name-safe key of a (draft, target) pair; the same ids always give the same key."""

    def clean(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("._") or "model"

    return f"{clean(draft_id)}__{clean(target_id)}"


def calibration_dir(home: Path | str | None = None) -> Path:
    return specdec_home(home) / "calibration"


def calibration_path(draft_id: str, target_id: str, home: Path | str | None = None) -> Path:
    return calibration_dir(home) / f"{pair_key(draft_id, target_id)}.json"


def save_calibration(calibration: Calibration, home: Path | str | None = None) -> Path:
    """Write atomically (a reader never sees half a file); returns the path."""
    path = calibration_path(calibration.draft_id, calibration.target_id, home)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(calibration.to_dict(), handle, indent=2)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_calibration(draft_id: str, target_id: str, home: Path | str | None = None) -> Calibration | None:
    """The stored calibration of the pair, or None when there is none or it cannot be read."""
    path = calibration_path(draft_id, target_id, home)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable calibration %s: %s", path, exc)
        return None
    try:
        calibration = Calibration.from_dict(data)
        _check(calibration)
    except (TypeError, ValueError) as exc:
        log.warning("ignoring invalid calibration %s: %s", path, exc)
        return None
    if calibration.draft_id != draft_id or calibration.target_id != target_id:
        log.warning(
            "ignoring calibration %s: it is for %s|%s", path, calibration.draft_id, calibration.target_id
        )
        return None
    return calibration


def _check(c: Calibration) -> None:
    if c.version != CALIBRATION_VERSION:
        raise ValueError(f"version {c.version}, expected {CALIBRATION_VERSION}")
    if not (
        isinstance(c.best_k, int)
        and c.best_k >= 1
        and isinstance(c.tree_budget, int)
        and c.tree_budget >= 1
        and isinstance(c.rd_k_max, int)
        and c.rd_k_max >= 1
    ):
        raise ValueError("best_k, tree_budget and rd_k_max must be integers >= 1")
    if not 0.0 <= float(c.a) <= 1.0 or not 0.0 <= float(c.alpha) <= 1.0:
        raise ValueError("a and alpha must lie in [0, 1]")
    if not c.rank_acceptance or any(not 0.0 <= float(r) <= 1.0 for r in c.rank_acceptance):
        raise ValueError("rank_acceptance must be a non-empty list of probabilities")
    if not (float(c.t_p) > 0 and float(c.t_q) > 0):
        raise ValueError("t_p and t_q must be > 0")
