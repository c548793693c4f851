"""A request's run (orchestrator.run): resolution of its knobs, and the round trip through the
store record that `resume` starts a new run from."""

from __future__ import annotations

import json

from orchestrator.config import OrchestratorConfig
from orchestrator.run import Run
from orchestrator.store import RequestRecord
from specdec.sampling import SamplingParams
from tests.orchestrator.helpers import TARGET_INFO, make_run


def test_knobs_resolve_against_the_config():
    config = OrchestratorConfig(default_k=3, default_a=0.25, default_tree_budget=9, pipeline=True,
                                pipeline_max_k=5)
    token = make_run(config=config, method="token").settings
    assert (token.k, token.a, token.tree_budget) == (3, None, None)
    assert (token.pipeline, token.pipeline_max_k) == (True, 5)
    assert token.stop_ids == frozenset(TARGET_INFO.eos_token_ids)
    rd = make_run(config=config, method="rd", k=2, pipeline=False, stop_token_ids=[1]).settings
    assert (rd.k, rd.a, rd.pipeline, rd.stop_ids) == (2, 0.25, False, frozenset({1}))
    assert make_run(config=config, method="rd", a=1.0).settings.a == 1.0
    tree = make_run(config=config, method="gsd-tree").settings
    assert (tree.k, tree.tree_budget) == (9, 9)
    assert make_run(config=config, method="ersd", tree_budget=4).settings.tree_budget == 4


def test_the_record_round_trip_continues_the_run():
    run = make_run(method="rd", k=3, a=0.5, max_new_tokens=20, stop=["zz"], seed=2**62 + 1,
                   sampling=SamplingParams(temperature=0.7, top_k=3), pipeline=True,
                   pipeline_bonus_guesses=2, pipeline_rejection_guesses=1)
    run.state.generated = [4, 0, 5]
    run.state.text = "t4 t0 t5"
    run.state.stats.iterations, run.state.stats.accepted_per_position = 2, [1, 1]
    run.state.finish_reason = "length"
    record = RequestRecord.from_json(run.to_record("running").to_json())  # as the store keeps it
    assert record.finish_reason is None and record.status == "running"
    assert run.to_record("done").finish_reason == "length"
    again = Run.from_record(record)
    assert again.settings == run.settings
    params = again.settings.params()
    assert params == run.settings.params() and json.loads(json.dumps(params)) == params
    assert again.state.generated == run.state.generated
    assert again.state.stats == run.state.stats
    assert again.request_id == run.request_id and again.session_id != run.session_id  # a new session


def test_records_from_before_the_guesses_resume_with_one_bonus_guess():
    record = make_run().to_record("running")
    for key in ("pipeline", "pipeline_max_k", "bonus_guesses", "rejection_guesses"):
        del record.params[key]
    old = Run.from_record(record).settings
    assert (old.pipeline, old.pipeline_max_k, old.bonus_guesses, old.rejection_guesses) == (False, 0, 1, 0)
