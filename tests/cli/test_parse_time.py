"""Choices are checked when the command line is parsed, before any model loads (usage error, exit 2);
help groups the options in panels and shows flags as flags; every `serve` option can come from a
SPECDEC_* environment variable (specdec/cli/commands.py). In-process (CliRunner): no model loads."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from specdec.cli import app
from specdec.cli.commands import HELP_PANELS, env_name

from .test_help import COMMANDS, _command, _is_option

ENV = {"COLUMNS": "220", "NO_COLOR": "1"}
MAIN_COMMANDS = [["up"], ["generate"], ["serve", "drafter"], ["serve", "verifier"], ["serve", "orchestrator"]]


def _invoke(args: list[str], **env: str):
    return CliRunner().invoke(app, args, env={**ENV, **env})


@pytest.mark.parametrize("args, says", [
    (["serve", "drafter", "--device", "gpu"], "'gpu' is not a device: cpu, cuda, cuda:N or mps"),
    (["serve", "verifier", "--device", "cuda"], "sees no CUDA device"),
    (["up", "--verifier-device", "cuda:0"], "sees no CUDA device"),
    (["analyze", "--device", "tpu"], "'tpu' is not a device"),
    (["up", "--default-method", "speculative"], "'speculative' is not one of token, block"),
    (["serve", "orchestrator", "--default-method", "nope"], "'nope' is not one of"),
    (["generate", "p", "--method", "nope"], "'nope' is not one of"),
    (["analyze", "--dtype", "int4"], "'int4' is not one of auto"),
])
def test_bad_choices_are_usage_errors_before_any_model_loads(args, says) -> None:
    result = _invoke(args)
    assert result.exit_code == 2, result.output
    assert says in re.sub(r"\s+", " ", result.output.replace("│", " "))
    assert "Traceback" not in result.output


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "specdec")
def test_flags_show_as_flags(path) -> None:
    result = _invoke([*path, "--help"])
    assert result.exit_code == 0
    assert "<bool>" not in result.output and "BOOLEAN" not in result.output


@pytest.mark.parametrize("path", MAIN_COMMANDS, ids=" ".join)
def test_every_option_of_the_main_commands_sits_in_a_panel(path) -> None:
    command = _command(path)
    params = command.get_params(command.context_class(command))
    loose = [p.opts[0] for p in params if _is_option(p) and p.name != "help" and not p.rich_help_panel]
    assert loose == [], f"options of {path} outside any help panel: {loose}"
    text = _invoke([*path, "--help"]).output
    shown = [panel for panel in HELP_PANELS if f"─ {panel} " in text]
    assert len(shown) >= 3, shown


@pytest.mark.parametrize("role", ["drafter", "verifier", "orchestrator"])
def test_every_serve_option_has_an_environment_variable(role) -> None:
    command = _command(["serve", role])
    text = _invoke(["serve", role, "--help"]).output
    for param in command.params:
        if _is_option(param):
            assert env_name(param).startswith("SPECDEC_")
            assert env_name(param) in text, f"{env_name(param)} not in serve {role} --help"


def test_serve_reads_its_options_from_the_environment() -> None:
    command = _command(["serve", "orchestrator"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_HTTP_PORT", "8123")
        patch.setenv("SPECDEC_ADAPTIVE_K", "false")
        patch.setenv("SPECDEC_SERVED_MODEL_NAME", "coder")
        ctx = command.make_context("orchestrator", ["--served-model-name", "from-flag"])
    assert ctx.params["http_port"] == 8123 and ctx.params["adaptive_k"] is False
    assert ctx.params["served_model_name"] == "from-flag"  # the command line wins
    result = _invoke(["serve", "orchestrator"], SPECDEC_HTTP_PORT="eighty")
    assert result.exit_code == 2 and "SPECDEC_HTTP_PORT" in result.output


def test_environment_variables_are_not_read_outside_serve() -> None:
    command = _command(["up"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_HTTP_PORT", "8123")
        ctx = command.make_context("up", [])
    assert ctx.params["http_port"] == 8000
