"""Saved analyser calibration becomes the orchestrator's defaults for that model pair."""

from __future__ import annotations

from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from specdec.calibration import Calibration, save_calibration
from specdec.engine.api import ModelInfo


class InfoOnly:
    """A client that only answers Info (start() needs nothing else)."""

    address = "fake"

    def __init__(self, model_id: str) -> None:
        self._info = ModelInfo(model_id=model_id, vocab_size=8, tokenizer_fingerprint="f", max_context=64)

    async def info(self) -> ModelInfo:
        return self._info

    async def close(self) -> None:
        return None


def calibration(draft: str, target: str) -> Calibration:
    return Calibration(
        draft_id=draft,
        target_id=target,
        sampling={"temperature": 1.0, "top_k": 0, "top_p": 1.0},
        alpha=0.7,
        ersd_alpha=0.65,
        t_p=0.4,
        t_q=0.15,
        best_k=3,
        tree_budget=5,
        a=0.8,
        rd_k_max=3,
        rank_acceptance=[0.7, 0.2],
    )


async def test_calibration_sets_defaults_but_explicit_fields_win(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    save_calibration(calibration("draft-x", "target-y"), home=tmp_path)

    orchestrator = Orchestrator(InfoOnly("draft-x"), InfoOnly("target-y"), OrchestratorConfig(default_a=0.25))
    await orchestrator.start()
    assert orchestrator.config.default_k == 3
    assert orchestrator.config.default_tree_budget == 5
    assert orchestrator.config.rank_acceptance == [0.7, 0.2]
    assert orchestrator.config.default_a == 0.25  # set explicitly: not overridden
    await orchestrator.close()


async def test_other_pairs_and_opt_out_keep_the_configured_defaults(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    save_calibration(calibration("draft-x", "target-y"), home=tmp_path)

    other = Orchestrator(InfoOnly("draft-z"), InfoOnly("target-y"), OrchestratorConfig())
    await other.start()
    assert other.config.default_k == OrchestratorConfig().default_k
    opted_out = Orchestrator(
        InfoOnly("draft-x"), InfoOnly("target-y"), OrchestratorConfig(use_calibration=False)
    )
    await opted_out.start()
    assert opted_out.config.default_k == OrchestratorConfig().default_k
    await other.close()
    await opted_out.close()


def test_describe_defaults_says_where_they_come_from(tmp_path, monkeypatch) -> None:
    """What `serve orchestrator` / `up` print on start: the defaults and their source."""
    from orchestrator.failover import calibrated_config, describe_defaults
    from specdec.engine.api import ModelInfo

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    draft, target = ModelInfo("draft-x", 8, "f", 64), ModelInfo("target-y", 8, "f", 64)
    config = OrchestratorConfig()
    assert describe_defaults(config, None, target).endswith("(built-in; the drafter is not connected yet)")
    assert describe_defaults(config, None, target, has_drafter=False).endswith(
        "(built-in; no drafter: model-free drafts or target-only steps)")
    line = describe_defaults(config, draft, target)
    built_in = (
        f"defaults: method token, drafts model, k online from {config.default_k} "
        "(requests without k or seed), a 0.5, "
        "pipeline on (built-in; no calibration at "
    )
    assert line.startswith(built_in)
    assert str(tmp_path / "calibration") in line
    save_calibration(calibration("draft-x", "target-y"), home=tmp_path)
    line = describe_defaults(calibrated_config(config, draft, target), draft, target)
    assert line.startswith("defaults: method token, drafts model, k online from 3 "
                           "(requests without k or seed), a 0.8, "
                           "pipeline on (calibration ")
    opted_out = OrchestratorConfig(use_calibration=False, adaptive_k=False)
    line = describe_defaults(opted_out, draft, target)
    assert line.startswith("defaults: method token, drafts model, k 2, a 0.5")
    assert "calibration disabled" in line
