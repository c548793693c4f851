"""specdec.analysis: the measurements (rank acceptance, window simulation, timing) and the
structure of an analysis of tiny random models. Numbers of the tiny pair are not asserted, except
where the theory fixes them exactly."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from specdec import theory
from specdec.analysis import (
    Analysis,
    PromptRows,
    Timing,
    _interpolate,
    monotone,
    rank_acceptance,
    simulate_sequence_tokens,
    tree_level_widths,
    warped_rows,
)
from specdec.sampling import SamplingParams
from specdec.trees import max_depth


def _random_rows(n: int, vocab: int, seed: int, sharp: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, vocab, generator=g) * sharp
    p = torch.softmax(base, dim=-1)
    q = torch.softmax(base + torch.randn(n, vocab, generator=g), dim=-1)
    return p, q


def _tolerance(rate: float, trials: int) -> float:
    return 5.0 * math.sqrt(max(rate * (1 - rate), 1e-4) / trials) + 1e-9


# ------------------------------------------------------------------------------------ rank acceptance


def test_first_rank_matches_exact_acceptance() -> None:
    p, q = _random_rows(40, 12, seed=1)
    samples = 400
    r_gsd, lumped = rank_acceptance(p, q, "gsd", ranks=4, samples=samples, seed=0, tail_mass=0.0)
    r_ersd, _ = rank_acceptance(p, q, "ersd", ranks=4, samples=samples, seed=1, tail_mass=0.0)
    exact_gsd = float(np.mean(theory.acceptance_rate(p, q)))
    exact_ersd = float(np.mean(theory.ersd_acceptance(p, q)))
    trials = samples * p.shape[0]
    assert lumped == 0.0
    assert abs(r_gsd[0] - exact_gsd) < _tolerance(exact_gsd, trials)
    assert abs(r_ersd[0] - exact_ersd) < _tolerance(exact_ersd, trials)
    assert r_gsd.sum() <= 1.0 + 1e-12 and r_ersd.sum() <= 1.0 + 1e-12


def _exact_gsd_second_rank(p: np.ndarray, q: np.ndarray) -> float:
    """R(2) of recursive rejection by enumeration: first child x1 rejected, second x2 accepted."""
    total = 0.0
    for x1 in range(len(q)):
        reject = q[x1] * (1.0 - min(1.0, p[x1] / q[x1]))
        if reject <= 0:
            continue
        p2 = np.clip(p - q, 0, None)
        p2 = p2 / p2.sum()
        q2 = q.copy()
        q2[x1] = 0.0
        q2 = q2 / q2.sum()
        total += reject * sum(q2[x] * min(1.0, p2[x] / q2[x]) for x in range(len(q)) if q2[x] > 0)
    return total


def test_second_rank_of_recursive_rejection_matches_enumeration() -> None:
    p, q = _random_rows(1, 5, seed=7, sharp=1.0)
    samples = 40_000
    r, _ = rank_acceptance(p, q, "gsd", ranks=3, samples=samples, seed=2, tail_mass=0.0)
    exact = _exact_gsd_second_rank(p[0].double().numpy(), q[0].double().numpy())
    assert abs(r[1] - exact) < _tolerance(exact, samples)


def test_races_always_find_the_winner_among_all_arrivals() -> None:
    """With as many ranks as tokens and q > 0 everywhere, P's winner is one of Q's arrivals."""
    p, q = _random_rows(10, 6, seed=3)
    r, _ = rank_acceptance(p, q, "ersd", ranks=6, samples=128, seed=0, tail_mass=0.0)
    assert r.sum() == pytest.approx(1.0, abs=1e-12)


def test_identical_models_accept_the_first_child() -> None:
    p, _ = _random_rows(8, 9, seed=4)
    for kind in ("gsd", "ersd"):
        r, _ = rank_acceptance(p, p.clone(), kind, ranks=3, samples=64, seed=0)
        assert r[0] == pytest.approx(1.0) and r[1:].sum() == pytest.approx(0.0)


def test_large_vocabulary_is_compacted_with_small_lumped_mass() -> None:
    p, q = _random_rows(3, 5000, seed=5, sharp=3.0)
    r, lumped = rank_acceptance(p, q, "gsd", ranks=2, samples=32, seed=0, tail_mass=1e-4)
    assert 0.0 <= lumped <= 1e-4 + 1e-9
    assert 0.0 <= r[0] <= 1.0


def test_rank_acceptance_rejects_bad_input() -> None:
    p, q = _random_rows(2, 4, seed=0)
    with pytest.raises(ValueError):
        rank_acceptance(p, q, "tree")
    with pytest.raises(ValueError):
        rank_acceptance(p, q[:1], "gsd")


def test_monotone_is_a_running_minimum() -> None:
    assert monotone([0.5, 0.2, 0.3, 0.1]) == [0.5, 0.2, 0.2, 0.1]


# ------------------------------------------------------------------------------- window simulation


def _rows_from(p: torch.Tensor, q: torch.Tensor) -> list[PromptRows]:
    return [PromptRows([0], list(range(p.shape[0])), p, q)]


def test_window_simulation_with_identical_rows_accepts_everything() -> None:
    p, _ = _random_rows(12, 7, seed=8)
    for method in ("token", "block"):
        assert simulate_sequence_tokens(_rows_from(p, p.clone()), method, k=3, samples=2) == pytest.approx(
            4.0
        )


def test_window_simulation_stays_in_range_and_needs_enough_rows() -> None:
    p, q = _random_rows(10, 7, seed=9)
    for method in ("token", "block"):
        value = simulate_sequence_tokens(_rows_from(p, q), method, k=4, samples=4)
        assert 1.0 <= value <= 5.0
    with pytest.raises(ValueError):
        simulate_sequence_tokens(_rows_from(p, q), "token", k=10)


def test_block_beats_token_on_the_papers_toy_pair() -> None:
    """Sun et al.'s context-free toy (P = (1/3, 2/3), Q = (2/3, 1/3), k = 2): 1 + 11/9 vs 1 + 10/9."""
    n = 3
    p = torch.tensor([[1 / 3, 2 / 3]] * n, dtype=torch.float64)
    q = torch.tensor([[2 / 3, 1 / 3]] * n, dtype=torch.float64)
    rows = _rows_from(p, q)
    token = simulate_sequence_tokens(rows, "token", k=2, samples=1200, seed=1)
    block = simulate_sequence_tokens(rows, "block", k=2, samples=1200, seed=1)
    assert token == pytest.approx(1 + 10 / 9, abs=0.08)  # ≈ 3.5 standard errors
    assert block == pytest.approx(1 + 11 / 9, abs=0.08)


# ------------------------------------------------------------------------------------------- timing


def test_timing_interpolation_and_ratios() -> None:
    t = Timing({1: 0.4, 3: 0.6, 9: 1.2}, {1: 0.1, 2: 0.12})
    assert t.c == pytest.approx(4.0) and t.lam == pytest.approx(0.25)
    assert t.target_time(2) == pytest.approx(0.5)
    assert t.target_time(17) == pytest.approx(1.2 + 0.1 * 8)
    assert _interpolate({1: 0.3}, 5) == 0.3
    assert Timing.from_dict(t.to_dict()).target_seconds == t.target_seconds


def test_tree_helpers() -> None:
    parents = [-1, -1, 0, 0, 2]
    assert max_depth(parents) == 3
    assert tree_level_widths(parents) == [2, 2, 1]
    assert max_depth([]) == 0


def test_warped_rows_are_the_models_next_token_distributions(tiny_models) -> None:
    model = tiny_models["target"].model
    sampling = SamplingParams(0.7, top_k=4)
    prompt, continuation = [1, 2], [3, 0, 5]
    rows = warped_rows(model, prompt, continuation, sampling)
    from specdec.sampling import warp_logits

    for i in range(len(continuation)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + continuation[:i]])).logits[0, -1].float()
        assert torch.allclose(rows[i], warp_logits(logits, sampling), atol=1e-5)


# ----------------------------------------------------------------------------- the whole analysis


def test_analysis_structure(tiny_analysis) -> None:
    analysis, rows = tiny_analysis
    data = analysis.to_dict()
    json.dumps(data, allow_nan=False)  # strict JSON
    assert set(data) == {
        "meta",
        "acceptance",
        "entropy",
        "rank_acceptance",
        "timing",
        "block_simulation",
        "rd_alpha",
        "plan",
        "bounds",
        "curves",
    }
    acc = data["acceptance"]
    for key in ("alpha", "alpha_per_position", "alpha_per_prompt", "tv", "d_hm", "ersd_alpha", "kl"):
        assert key in acc
    assert len(acc["alpha_per_position"]) == max(len(r) for r in rows)
    assert acc["d_hm"] <= acc["ersd_alpha"] + 1e-9 <= acc["alpha"] + 2e-9  # ERSD Lemma 3.1
    assert data["timing"]["c"] * data["timing"]["lambda"] == pytest.approx(1.0)
    for kind in ("gsd", "ersd"):
        assert len(data["rank_acceptance"][kind]) == 8
    plan = data["plan"]
    assert {"sequence", "tree", "rd", "methods"} <= set(plan)
    assert plan["sequence"]["pays_timed"] == (plan["sequence"]["speedup_timed"] > 1.0)
    assert set(plan["methods"]) == {"token", "block", "ersd", "gsd-tree", "ersd-tree", "rd", "rd-k1"}
    for method in plan["methods"].values():
        assert method["expected_tokens"] >= 1.0 and method["speedup_formula"] > 0
    assert 0.0 <= plan["rd"]["schedule"]["a"] <= 1.0
    assert isinstance(plan["rd"]["lemma_4_3_holds"], bool)
    assert max_depth(plan["tree"]["gsd"]["parents"]) == plan["tree"]["gsd"]["depth"]
    for key in (
        "tunstall_gsd",
        "tunstall_ersd",
        "tunstall_refined_ersd",
        "speed_of_light",
        "speed_of_light_asymptotic",
    ):
        assert key in data["bounds"]
    curves = data["curves"]
    assert len(curves["speedup_vs_k"]["token_formula"]) == 6
    assert len(curves["tps_vs_a"]["relative_tps_k1"]) == len(curves["tps_vs_a"]["a"])
    assert len(curves["tokens_vs_budget"]["tree_gsd"]) == 8
    # optimal trees are never worse than a sequence or a star of the same budget
    tokens = curves["tokens_vs_budget"]
    for b in range(8):
        assert tokens["tree_gsd"][b] >= tokens["batch_gsd"][b] - 1e-12
    again = Analysis.from_dict(json.loads(json.dumps(data)))
    assert again.predict("token", k=3) == analysis.predict("token", k=3)


def test_predictions_follow_the_formulas(tiny_analysis) -> None:
    analysis, _ = tiny_analysis
    alpha, t = analysis.acceptance["alpha"], analysis.timing
    for k in (1, 3, 5):
        assert analysis.predict("token", k=k)["speedup_formula"] == pytest.approx(
            theory.speedup(alpha, k, t.c)
        )
    # RD at a = 1 is token verification with k = k_max, at a = 0 target-only decoding
    rd1 = analysis.predict("rd", a=1.0, k=3)
    assert rd1["speedup_formula"] == pytest.approx(theory.speedup(analysis.alpha_of_a(1.0), 3, t.c))
    assert analysis.predict("rd", a=0.0, k=3)["expected_tokens"] == pytest.approx(1.0)
    assert analysis.predict("autoregressive")["speedup_formula"] == 1.0
    with pytest.raises(ValueError):
        analysis.predict("nope")


def test_analysis_and_calibration_stay_free_of_io_frameworks() -> None:
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, specdec.analysis, specdec.calibration\n"
        "bad = [m for m in ('grpc', 'redis', 'opentelemetry') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert result.returncode == 0, result.stderr
