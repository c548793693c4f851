"""`specdec up --drafter none` (or `--draft none`) and `serve orchestrator --drafter none`: no draft
model, no drafter process; the verifier gets every core; the orchestrator drafts model-free
(--draft-source) or takes target-only steps.

The option checks run in-process (CliRunner: no model loads); one test starts the real `up` on a tiny
target model and generates through it.
"""

from __future__ import annotations

import os
import re
import socket

import pytest
from typer.testing import CliRunner

from specdec.cli import app
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

ENV = {"COLUMNS": "220", "NO_COLOR": "1"}


def _invoke(args: list[str], **env: str):
    return CliRunner().invoke(app, args, env={**ENV, **env})


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("│", " "))


@pytest.fixture
def empty_store(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "store"))  # no model installed
    monkeypatch.delenv("SPECDEC_DRAFT_SOURCE", raising=False)
    return tmp_path


def test_help_explains_no_drafter_and_the_draft_source() -> None:
    text = _flat(_invoke(["up", "--help"]).output)
    assert "--drafter" in text and "[default: local]" in text
    assert "none: no draft model is loaded and no drafter process starts" in text
    assert "path; none: no draft model (the same as --drafter none)" in text
    assert "--draft-source" in text and "$SPECDEC_DRAFT_SOURCE, else hybrid" in text
    serve = _flat(_invoke(["serve", "orchestrator", "--help"]).output)
    assert "none: no drafter at all (no draft model anywhere)" in serve
    assert "--draft-source" in serve and "SPECDEC_DRAFT_SOURCE" in serve


@pytest.mark.parametrize(("args", "env", "says"), [
    (["--drafter", "none", "--draft-source", "model"], {}, "--drafter none with --draft-source model"),
    (["--draft", "none", "--draft-source", "model"], {}, "that draft source needs the draft model"),
    (["--drafter", "none"], {"SPECDEC_DRAFT_SOURCE": "model"},
     "--drafter none with $SPECDEC_DRAFT_SOURCE=model"),
    (["--drafter", "none", "--drafter-cores", "0"], {}, "so --drafter-cores would not be used"),
    (["--drafter", "none", "--draft", "/some/draft", "--drafter-threads", "2"], {},
     "so --draft, --drafter-threads would not be used"),
    (["--drafter", "none", "--drafter-device", "cpu:0"], {}, "so --drafter-device would not be used"),
    (["--drafter", "nothing"], {}, "'nothing' is not one of local, none"),
    (["--draft-source", "ngram"], {}, "'ngram' is not one of hybrid, model, lookup, suffix"),
    ([], {"SPECDEC_DRAFT_SOURCE": "ngram"}, "$SPECDEC_DRAFT_SOURCE='ngram' is not one of"),
])
def test_usage_errors_come_before_the_models(empty_store, args, env, says) -> None:
    """Exit 2 with one clear line, although no model is installed (models are checked after usage)."""
    result = _invoke(["up", *args], **env)
    assert result.exit_code == 2, result.output
    assert says in _flat(result.output)
    assert "not installed" not in result.output and "Traceback" not in result.output


def test_only_the_target_model_must_be_installed(empty_store) -> None:
    for args in (["--drafter", "none"], ["--draft", "none"], ["--draft", "none", "--draft-source", "suffix"]):
        result = _invoke(["up", *args])
        assert result.exit_code == 1, result.output
        assert f"target model '{DEFAULT_TARGET_MODEL}' is not installed" in result.output
        assert DEFAULT_DRAFT_MODEL not in result.output
    # The default model is not an error when named explicitly (the default of --draft).
    result = _invoke(["up", "--drafter", "none", "--draft", DEFAULT_DRAFT_MODEL])
    assert result.exit_code == 1 and "target model" in result.output


def test_the_drafter_port_is_not_checked_without_a_drafter(tmp_path, monkeypatch) -> None:
    """Models, then ports: the drafter's port may be taken (no drafter binds it); the verifier's may not."""
    from specdec.runtime.tiny import save_tiny_model

    monkeypatch.delenv("SPECDEC_DRAFT_SOURCE", raising=False)
    target = save_tiny_model(tmp_path / "target", vocab_size=8, seed=2, max_position_embeddings=64)
    with socket.socket() as drafter_port, socket.socket() as verifier_port:
        drafter_port.bind(("127.0.0.1", 0))
        verifier_port.bind(("127.0.0.1", 0))
        result = _invoke(["up", "--drafter", "none", "--target", str(target), "--port", "0",
                          "--http-port", "0", "--drafter-port", str(drafter_port.getsockname()[1]),
                          "--verifier-port", str(verifier_port.getsockname()[1])])
    assert result.exit_code == 1, result.output
    assert "choose another --verifier-port" in _flat(result.output)


@pytest.mark.parametrize(("args", "env"), [
    (["--drafter", "none", "--draft-source", "model"], {}),
    (["--drafter", "NONE"], {"SPECDEC_DRAFT_SOURCE": "model"}),
])
def test_serve_orchestrator_refuses_the_model_source_without_a_drafter(args, env) -> None:
    result = _invoke(["serve", "orchestrator", "--port", "0", *args], **env)
    assert result.exit_code == 2, result.output
    assert "that source needs a drafter" in _flat(result.output)


def test_serve_orchestrator_reads_the_draft_source_option_and_variable() -> None:
    import typer

    from specdec.cli.serve import serve_app

    command = typer.main.get_command(serve_app).commands["orchestrator"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_DRAFT_SOURCE", "suffix")
        assert command.make_context("orchestrator", []).params["draft_source"] == "suffix"
        ctx = command.make_context("orchestrator", ["--draft-source", "lookup", "--drafter", "none"])
    assert ctx.params["draft_source"] == "lookup" and ctx.params["drafter"] == "none"
    result = _invoke(["serve", "orchestrator"], SPECDEC_DRAFT_SOURCE="ngram")
    assert result.exit_code == 2 and "SPECDEC_DRAFT_SOURCE" in result.output


# ------------------------------------------------------------------------------ the real thing


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_without_a_drafter_runs_two_processes_and_generates(tmp_path) -> None:
    from specdec.cli.processes import available_cores, check_health, format_cores
    from specdec.runtime.tiny import save_tiny_model
    from tests.integration.helpers import TINY_CONTEXT, UpProcess, json_lines, pid_alive, run_cli, wait_gone

    target = save_tiny_model(tmp_path / "target", vocab_size=8, seed=2, max_position_embeddings=TINY_CONTEXT)
    up = UpProcess(tmp_path, "--drafter", "none", "--target", str(target), "--draft-source", "suffix")
    try:
        info = up.wait_ready()
        assert info["drafter"] is None and info["draft_source"] == "suffix"
        assert set(info["pids"]) == {"verifier", "orchestrator"}
        for name in ("verifier", "orchestrator"):
            assert check_health(info[name], timeout=10.0) == "SERVING", name
        cores = available_cores()
        assert sorted(os.sched_getaffinity(info["pids"]["verifier"])) == cores  # every core, not a share
        stderr = _flat(up.stderr())
        assert f"the verifier gets all {len(cores)} core(s) ({format_cores(cores)}) and {len(cores)} torch " \
               "thread(s)" in stderr
        assert "drafts: suffix" in stderr
        log = (up.log_dir / "orchestrator.log").read_text()
        assert "without a drafter (--drafter none): draft source suffix" in log
        assert "serving (no drafter) →" in _flat(log)
        result = run_cli("generate", "--address", info["orchestrator"], "--json", "--seed", "7",
                         "--max-new-tokens", "8", "--ignore-eos", "t1 t2 t3 t1 t2 t3")
        assert result.returncode == 0, result.stderr
        (line,) = json_lines(result.stdout)
        assert len(line["token_ids"]) == 8 and all(0 <= t < 8 for t in line["token_ids"])
        pids = list(info["pids"].values())
    finally:
        up.stop()
    assert up.process.returncode == 0, up.stderr()
    assert not up.ready_file.exists()
    assert wait_gone(pids, 15) == [] and not any(pid_alive(p) for p in pids)
