"""`specdec serve drafter` and `serve verifier` are one command made twice: the same options and
help, their own engine, default model and default port."""

from __future__ import annotations

import typer

from specdec.cli import app
from specdec.cli.processes import DEFAULT_DRAFTER_PORT, DEFAULT_VERIFIER_PORT
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL


def _serve(role: str):
    return typer.main.get_command(app).commands["serve"].commands[role]


def _options(command) -> dict[str, tuple]:
    return {param.name: (tuple(param.opts), param.help, param.default) for param in command.params}


def test_drafter_and_verifier_differ_only_in_their_defaults() -> None:
    drafter, verifier = _options(_serve("drafter")), _options(_serve("verifier"))
    assert list(drafter) == list(verifier)
    differ = {name for name in drafter if drafter[name] != verifier[name]}
    assert differ == {"model", "port"}
    for name in differ:  # same flags and help, other default
        assert drafter[name][:2] == verifier[name][:2]
    assert (drafter["model"][2], drafter["port"][2]) == (DEFAULT_DRAFT_MODEL, DEFAULT_DRAFTER_PORT)
    assert (verifier["model"][2], verifier["port"][2]) == (DEFAULT_TARGET_MODEL, DEFAULT_VERIFIER_PORT)


def test_each_names_its_own_model_in_its_help() -> None:
    assert "draft model" in _serve("drafter").help and "DrafterService" in _serve("drafter").help
    assert "target model" in _serve("verifier").help and "VerifierService" in _serve("verifier").help


def test_serve_reports_a_missing_model_in_one_line(tmp_path) -> None:
    from typer.testing import CliRunner

    for role in ("drafter", "verifier"):
        result = CliRunner().invoke(app, ["serve", role, "--model", str(tmp_path / "nope"), "--port", "0"],
                                    env={"COLUMNS": "220"})
        assert result.exit_code == 1, result.output
        assert result.stderr.startswith(f"error: {role} model ")
        assert "no such file or directory" in result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
