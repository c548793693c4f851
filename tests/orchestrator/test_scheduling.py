"""Pure scheduling functions: shapes, depth caps, RD coins, calibrated rank acceptance."""

from __future__ import annotations

import pytest

from orchestrator import scheduling
from orchestrator.config import OrchestratorConfig
from specdec.trees import DraftTree, max_depth, optimal_tree_shape, sequence_parents
from tests.orchestrator.helpers import make_run, plan_of


def test_cap_depth_drops_deep_nodes_and_renumbers():
    shape = [-1, -1, 0, 0, 2, 1, 4]  # depths 1, 1, 2, 2, 3, 2, 4
    capped = scheduling.cap_depth(shape, 2)
    assert capped == [-1, -1, 0, 0, 1]
    DraftTree(tuple(range(len(capped))), tuple(capped))  # parents precede children
    assert max_depth(capped) == 2
    assert scheduling.cap_depth(shape, 10) == shape
    assert scheduling.cap_depth(shape, 0) == []


def test_tree_budget_for_methods():
    config = OrchestratorConfig(default_tree_budget=7)
    assert scheduling.tree_budget_for("gsd-tree", None, None, config) == 7
    assert scheduling.tree_budget_for("gsd-tree", 5, None, config) == 5
    assert scheduling.tree_budget_for("gsd-tree", 5, 9, config) == 9
    assert scheduling.tree_budget_for("ersd", 5, None, config) is None
    assert scheduling.tree_budget_for("ersd", 5, 6, config) == 6
    assert scheduling.tree_budget_for("ersd", 5, None, OrchestratorConfig(ersd_tree_budget=4)) == 4
    assert scheduling.tree_budget_for("token", 5, 6, config) is None


def test_rd_coins_are_seeded_and_follow_a():
    assert all(scheduling.rd_leading_heads(0.0, 3, seed, 7) == 0 for seed in range(20))
    assert all(scheduling.rd_leading_heads(1.0, 3, seed, 7) == 3 for seed in range(20))
    draws = [scheduling.rd_leading_heads(0.5, 3, seed, 11) for seed in range(2000)]
    assert draws == [scheduling.rd_leading_heads(0.5, 3, seed, 11) for seed in range(2000)]
    # P(K = 0) = 1 - a = 0.5, P(K = 3) = a^3 = 0.125
    assert abs(draws.count(0) / 2000 - 0.5) < 0.05
    assert abs(draws.count(3) / 2000 - 0.125) < 0.03
    assert scheduling.rd_leading_heads(0.5, 3, 1, 11) in range(4)


def test_rank_acceptance_from_calibration():
    default = [0.6, 0.2, 0.1]
    counts = {"rank_trials@0": 100, "rank_hits@0": 70, "rank_trials@1": 10, "rank_hits@1": 5,
              "rank_trials@2": 50, "rank_hits@2": 5, "rank_trials@3": 50, "rank_hits@3": 1}
    assert scheduling.rank_acceptance_from_calibration(counts, default, 0) == default
    got = scheduling.rank_acceptance_from_calibration(counts, default, 20)
    assert got == pytest.approx([0.7, 0.2, 0.1, 0.02])
    # a rank beyond the configured list with too few samples ends the list
    few = {"rank_trials@0": 5, "rank_hits@0": 1}
    assert scheduling.rank_acceptance_from_calibration(few, [0.5], 20) == [0.5]


def test_default_k():
    config = OrchestratorConfig(default_k=3, default_tree_budget=9)
    assert scheduling.default_k("token", config) == 3
    assert scheduling.default_k("rd", config) == 3
    assert scheduling.default_k("gsd-tree", config) == 9


def test_config_from_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_DEFAULT_K", "6")
    monkeypatch.setenv("SPECDEC_DEFAULT_METHOD", "ersd")
    monkeypatch.setenv("SPECDEC_STORE_URL", "redis://example:6379/0")
    config = OrchestratorConfig()
    assert (config.default_k, config.default_method, config.store_url) == (6, "ersd", "redis://example:6379/0")
    with pytest.raises(ValueError):
        OrchestratorConfig(default_method="nope")
    with pytest.raises(ValueError):
        OrchestratorConfig(rank_acceptance=[1.5])


def test_depth_cap():
    assert scheduling.depth_cap(10, []) == 1 << 30
    assert scheduling.depth_cap(10, [0, 16]) == 5  # 0: no limit; one slot for the extra token
    assert scheduling.depth_cap(10, [64, 12]) == 1
    assert scheduling.depth_cap(10, [11]) == 0


def test_plan_of_a_sequence_method():
    pipelined = OrchestratorConfig(pipeline=True)
    plan = plan_of(make_run(method="block", k=4, config=pipelined), 9, depth_cap=3)
    assert (plan.shape, plan.k, plan.pipelined) == ([-1, 0, 1], 4, True)
    assert (plan.params.seed, plan.params.position) == (7, 9)
    assert not plan_of(make_run(method="token", k=2), 9, depth_cap=8).pipelined


def test_plan_of_a_tree():
    run = make_run(method="ersd", tree_budget=6, config=OrchestratorConfig(pipeline=True))
    plan = plan_of(run, 3, depth_cap=2)
    assert plan.shape == scheduling.cap_depth(optimal_tree_shape(list(run.settings.rank_acceptance), 6), 2)
    assert (plan.k, plan.pipelined) == (6, False)  # trees are never pipelined


def test_plan_of_rd_follows_its_coins():
    config = OrchestratorConfig(pipeline=True)
    for seed in range(12):
        run = make_run(method="rd", k=3, a=0.5, seed=seed, config=config)
        plan = plan_of(run, 5, depth_cap=2)
        heads = scheduling.rd_leading_heads(0.5, 2, seed, 5)  # k_max = min(k, depth cap)
        assert (plan.shape, plan.k) == (sequence_parents(heads), 3)
        assert (plan.params.a, plan.params.k_max) == (0.5, 2)
        assert plan.pipelined == (heads == 2)


def test_no_plan_without_a_draft():
    assert plan_of(make_run(method="autoregressive"), 3, depth_cap=8) is None
    assert plan_of(make_run(method="token"), 3, depth_cap=0) is None
