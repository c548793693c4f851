"""`specdec generate` turns its options into one GenerationRequest (built once) and one GenerateRun;
samples differ only in their seed. No model and no server: the runner is replaced by a recorder."""

from __future__ import annotations

from dataclasses import fields

import pytest
from typer.testing import CliRunner

from specdec.cli import app
from specdec.cli import generate as cli_generate
from specdec.cli.generate import GenerateRun, build_request, sample_request
from specdec.cli.observability import ObservabilityOptions
from specdec.cli.processes import DEFAULT_ORCHESTRATOR_ADDRESS
from specdec.generation import GenerationRequest
from specdec.sampling import SamplingParams

ENV = {"COLUMNS": "200", "NO_COLOR": "1", "SPECDEC_ADDRESS": None}

EVERY_OPTION = dict(
    prompt="def f", prompt_ids=None, max_new_tokens=7, temperature=0.5, top_k=3, top_p=0.9,
    stop=["a", "b"], ignore_eos=True, seed=5, method="rd", k=6, tree_budget=9, a=0.3, pipeline=False,
    pipeline_max_k=4, bonus_guesses=2, rejection_guesses=1, draft_source="lookup", cache_salt="salt",
)
EVERY_FIELD = GenerationRequest(
    prompt="def f", prompt_ids=None, max_new_tokens=7, sampling=SamplingParams(0.5, 3, 0.9), stop=["a", "b"],
    stop_token_ids=[], seed=5, method="rd", k=6, a=0.3, tree_budget=9, pipeline=False, pipeline_max_k=4,
    pipeline_bonus_guesses=2, pipeline_rejection_guesses=1, draft_source="lookup", cache_salt="salt",
)
EVERY_FLAG = ["--max-new-tokens", "7", "--temperature", "0.5", "--top-k", "3", "--top-p", "0.9",
              "--stop", "a", "--stop", "b", "--ignore-eos", "--seed", "5", "--method", "rd", "--k", "6",
              "--tree-budget", "9", "--a", "0.3", "--no-pipeline", "--pipeline-max-k", "4",
              "--bonus-guesses", "2", "--rejection-guesses", "1", "--draft-source", "lookup",
              "--cache-salt", "salt"]


@pytest.fixture
def recorded(monkeypatch) -> dict:
    """Replace the runner; record every request built and what the runner was given."""
    record: dict = {"built": [], "runs": []}
    real_build = cli_generate.build_request

    def build(**options):
        request = real_build(**options)
        record["built"].append(request)
        return request

    async def run_samples(request, run):
        record["runs"].append((request, run))
        return 0

    monkeypatch.setattr(cli_generate, "build_request", build)
    monkeypatch.setattr(cli_generate, "run_samples", run_samples)
    return record


def test_build_request_maps_every_option() -> None:
    assert build_request(**EVERY_OPTION) == EVERY_FIELD
    keeps_eos = build_request(**{**EVERY_OPTION, "ignore_eos": False, "stop": None})
    assert keeps_eos.stop_token_ids is None and keeps_eos.stop == []  # None: the target's EOS ids


def test_every_request_field_has_an_option() -> None:
    """A new GenerationRequest field needs a `generate` option (or an entry here saying why not)."""
    not_options = {"request_id"}  # set by the orchestrator
    request = build_request(**EVERY_OPTION)
    chat = build_request(**{**EVERY_OPTION, "chat": True, "system": "be brief"})  # the prompt as a chat
    defaults = GenerationRequest()
    unset = {f.name for f in fields(GenerationRequest)
             if getattr(request, f.name) == getattr(defaults, f.name) == getattr(chat, f.name)}
    unset -= {"prompt_ids"}
    assert unset <= not_options, f"generate sets no value for {sorted(unset - not_options)}"


def test_chat_sends_the_prompt_as_the_users_turn(recorded) -> None:
    from specdec.generation import ChatMessage

    result = CliRunner().invoke(app, ["generate", "--chat", "--system", "be brief", "hello"], env=ENV)
    assert result.exit_code == 0, result.output
    ((request, _),) = recorded["runs"]
    assert request.prompt is None
    assert request.messages == [ChatMessage("system", "be brief"), ChatMessage("user", "hello")]
    for bad in (["--system", "x", "hello"], ["--chat", "--prompt-ids", "1,2"]):
        result = CliRunner().invoke(app, ["generate", *bad], env=ENV)
        assert result.exit_code == 2, (bad, result.output)


def test_the_command_builds_the_request_once(recorded) -> None:
    result = CliRunner().invoke(app, ["generate", *EVERY_FLAG, "--num-samples", "3", "--json", "--stream",
                                      "--address", "host:1", "--timeout", "5", "def f"], env=ENV)
    assert result.exit_code == 0, result.output
    assert recorded["built"] == [EVERY_FIELD]
    ((request, run),) = recorded["runs"]
    assert request is recorded["built"][0]
    assert run == GenerateRun(address="host:1", timeout=5.0, num_samples=3, as_json=True, stream=True)


def test_the_defaults_are_the_request_defaults(recorded) -> None:
    """Options left out leave the request's defaults, and those of the orchestrator (None)."""
    result = CliRunner().invoke(app, ["generate", "p"], env=ENV)
    assert result.exit_code == 0, result.output
    ((request, run),) = recorded["runs"]
    assert request == GenerationRequest(prompt="p")
    # no --method / --k / --a / --pipeline / --draft-source: nothing is sent, the orchestrator decides
    assert (request.method, request.k, request.a, request.pipeline, request.draft_source) == (None,) * 5
    assert run == GenerateRun(address=DEFAULT_ORCHESTRATOR_ADDRESS, observability=ObservabilityOptions())
    assert not run.in_process


def test_in_process_settings_and_prompt_ids(recorded, tmp_path, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device is checked at parse time
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    trace = tmp_path / "spans.jsonl"
    result = CliRunner().invoke(app, ["generate", "--draft", "d", "--target", "t", "--device", "cuda",
                                      "--dtype", "int8", "--threads", "2", "--trace-file", str(trace),
                                      "--prompt-ids", "1, 2,3"], env=ENV)
    assert result.exit_code == 0, result.output
    ((request, run),) = recorded["runs"]
    assert request.prompt is None and request.prompt_ids == [1, 2, 3]
    assert run.in_process and (run.draft, run.target, run.device, run.dtype, run.threads) == (
        "d", "t", "cuda", "int8", 2)
    assert run.observability == ObservabilityOptions(trace_file=trace)


def test_samples_vary_only_the_seed() -> None:
    request = build_request(**EVERY_OPTION)
    samples = [sample_request(request, i) for i in range(3)]
    assert [s.seed for s in samples] == [5, 6, 7]
    for sample in samples:
        assert sample == GenerationRequest(**{**vars(request), "seed": sample.seed})
    assert request.seed == 5  # the request itself is left alone
    random = build_request(**{**EVERY_OPTION, "seed": None})
    assert [sample_request(random, i).seed for i in range(3)] == [None] * 3  # each reports its own


def test_bad_sampling_is_one_line_before_any_connection(recorded) -> None:
    result = CliRunner().invoke(app, ["generate", "--temperature", "-1", "p"], env=ENV)
    assert result.exit_code == 1
    assert result.stderr.startswith("error: INVALID_ARGUMENT: temperature") and result.stderr.count("\n") == 1
    assert recorded["runs"] == []


@pytest.mark.parametrize("args", [["p", "--prompt", "q"], ["p", "--prompt-ids", "1"], ["--prompt-ids", "1,x"],
                                  ["--draft", "d", "p"], ["--num-samples", "0", "p"],
                                  ["--draft-source", "ngram", "p"]])
def test_usage_errors_exit_2_and_build_nothing(recorded, args) -> None:
    result = CliRunner().invoke(app, ["generate", *args], env=ENV)
    assert result.exit_code == 2, result.output
    assert recorded["built"] == [] and recorded["runs"] == []


def test_in_process_mode_passes_the_draft_source_too(recorded) -> None:
    """Server and in-process mode send the same request: --draft-source is a request field in both."""
    result = CliRunner().invoke(app, ["generate", "--draft", "d", "--target", "t", "--draft-source", "suffix",
                                      "--method", "token", "p"], env=ENV)
    assert result.exit_code == 0, result.output
    ((request, run),) = recorded["runs"]
    assert run.in_process and (request.draft_source, request.method) == ("suffix", "token")


def _result(sources: dict | None = None, drafted: int = 64, accepted: int = 50):
    from specdec.generation import GenerationResult, GenerationStats

    stats = GenerationStats(iterations=12, new_tokens=62, seconds=2.0, drafted_tokens=drafted,
                            accepted_tokens=accepted, sources=sources or {})
    return GenerationResult(request_id="r", token_ids=[1] * 62, text="x", finish_reason="length", seed=3,
                            method="token", stats=stats)


def test_the_summary_line_shows_acceptance_by_source() -> None:
    from specdec.generation import SourceStats

    plain = cli_generate._stats_line(_result())
    assert plain == ("62 tokens in 2.00s (31.0 tok/s) · token · 12 iterations · accepted 50/64 (78%) · "
                     "finish length · seed 3")  # no sources: the line as it was
    line = cli_generate._stats_line(_result({
        "model": SourceStats(drafts=4, drafted_tokens=20, accepted_tokens=10),
        "lookup": SourceStats(drafts=8, drafted_tokens=44, accepted_tokens=40),
        "suffix": SourceStats()}))  # no draft: left out
    assert line == plain.replace(" · finish", " · lookup 40/44 (91%, 5.0/draft) · model 10/20 (50%, "
                                              "2.5/draft) · finish")
    assert cli_generate._stats_line(_result({}, drafted=0, accepted=0)) == (
        "62 tokens in 2.00s (31.0 tok/s) · token · 12 iterations · finish length · seed 3")


def test_the_json_line_has_acceptance_by_source() -> None:
    import json

    from specdec.generation import SourceStats

    line = cli_generate.result_json(_result({"lookup": SourceStats(8, 44, 40)}), 0)
    assert json.loads(json.dumps(line))["stats"]["sources"] == {"lookup": {
        "drafts": 8, "drafted_tokens": 44, "accepted_tokens": 40, "acceptance_rate": 40 / 44,
        "mean_accepted": 5.0}}
    assert cli_generate.result_json(_result(), 0)["stats"]["sources"] == {}
