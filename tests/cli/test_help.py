"""`specdec --help` for every command: exit 0 and every option is explained, with its default.

Runs the typer app in-process (CliRunner): no model, no server, a fraction of a second.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import typer
from typer.testing import CliRunner

from specdec.cli import app
from specdec.defaults import DEFAULT_DRAFT_MODEL
from specdec.methods import METHOD_NAMES
from tests.integration.helpers import cli_env


# typer ships its own copy of click: check by duck type, not against the click package's classes.
def _is_group(command) -> bool:
    return hasattr(command, "commands")


def _is_option(param) -> bool:
    return param.param_type_name == "option"


def _all_commands(command, path: list[str]) -> list[list[str]]:
    """Every command and group of the app (the ones mounted from other modules included)."""
    found = [path]
    if _is_group(command):
        for name, sub in command.commands.items():
            found += _all_commands(sub, [*path, name])
    return found


COMMANDS = _all_commands(typer.main.get_command(app), [])


def _command(path: list[str]):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def _help(path: list[str]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "220", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    # One line of text: whitespace and rich's panel borders (where a help wraps) collapse to one space.
    return re.sub(r"[\s│]+", " ", result.output)


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "specdec")
def test_help_mentions_every_option(path: list[str]) -> None:
    text = _help(path)
    command = _command(path)
    assert command.help, f"{path} has no help text"
    for param in command.params:
        if _is_option(param):
            for opt in param.opts:
                pattern = rf"(?<![\w-]){re.escape(opt)}(?![\w-])"
                assert re.search(pattern, text), f"{opt} missing from {path} --help"
            assert param.help, f"{param.opts[0]} of {path} has no help"
    if _is_group(command):
        for name in command.commands:
            assert name in text


@pytest.mark.parametrize("path", [["up"], ["generate"], ["serve", "drafter"], ["serve", "verifier"],
                                  ["serve", "orchestrator"]])
def test_help_shows_defaults(path: list[str]) -> None:
    text = _help(path)
    for param in _command(path).params:
        if _is_option(param) and param.show_default is not False and not param.is_flag \
                and param.default is not None:
            assert f"[default: {param.default}]" in text, f"{param.opts[0]} default missing ({path})"


def test_the_main_commands_are_there() -> None:
    for path in (["up"], ["generate"], ["models", "install"], ["models", "list"], ["serve", "drafter"],
                 ["serve", "verifier"], ["serve", "orchestrator"]):
        assert path in COMMANDS


def test_generate_help_names_methods_and_default_address() -> None:
    text = _help(["generate"])
    for method in METHOD_NAMES:
        assert method in text
    assert "127.0.0.1:50050" in text


def test_the_request_defaults_in_the_help_are_the_orchestrators() -> None:
    """`serve orchestrator` and `up` declare --default-method/-k/-a once (specdec.cli.options), and every
    help that names a default of a request's knobs states the orchestrator's own."""
    from orchestrator.config import OrchestratorConfig
    from specdec.cli import options

    fields = OrchestratorConfig.model_fields  # the declared defaults ($SPECDEC_* aside)
    built_in = {"method": fields["default_method"].default, "k": fields["default_k"].default,
                "a": f"{fields['default_a'].default:g}"}
    for path in (["serve", "orchestrator"], ["up"]):
        text = _help(path)
        assert f"$SPECDEC_DEFAULT_METHOD, else {built_in['method']}." in text
        assert re.search(rf"\$SPECDEC_DEFAULT_K, else .*?else {built_in['k']}\.", text), path
        assert re.search(rf"\$SPECDEC_DEFAULT_A, else .*?else {built_in['a']}\.", text), path
        for name, declared in (("--default-method", options.DefaultMethodOpt),
                               ("--default-k", options.DefaultKOpt), ("--default-a", options.DefaultAOpt)):
            (param,) = [p for p in _command(path).params if name in p.opts]
            assert param.help == declared.__metadata__[0].help, (path, name)
    text = _help(["generate"])
    assert f"--default-method; {built_in['method']} unless set" in text
    assert f"--default-k; {built_in['k']} unless set" in text
    assert f"{fields['default_tree_budget'].default} nodes for gsd-tree" in text
    assert f"--default-a; {built_in['a']} unless set" in text


def test_bad_usage_exits_2_without_traceback() -> None:
    runner = CliRunner()
    for args in (["generate", "--draft", "x"], ["generate", "--prompt-ids", "1,a"],
                 ["generate", "p", "--prompt", "q"], ["up", "--drafter-cores", "x"]):
        result = runner.invoke(app, args, env={"COLUMNS": "220"})
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output


def test_up_reports_missing_model_with_the_install_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))  # an empty model store
    # Free ports: the default ones may be held by another test of a parallel run, or the machine.
    ports = ["--port", "0", "--http-port", "0", "--drafter-port", "0", "--verifier-port", "0"]
    result = CliRunner().invoke(app, ["up", *ports], env={"COLUMNS": "220"})
    assert result.exit_code == 1
    assert "not installed" in result.output
    assert f"specdec models install {DEFAULT_DRAFT_MODEL}" in result.output
    result = CliRunner().invoke(app, ["up", *ports, "--draft", str(tmp_path / "nope")],
                                env={"COLUMNS": "220"})
    assert result.exit_code == 1 and "no such file or directory" in result.output


def test_models_list_and_install_without_a_network(tmp_path, monkeypatch) -> None:
    import json

    from specdec import models

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))  # an empty model store
    result = CliRunner().invoke(app, ["models", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["name"] for row in rows] == list(models.REGISTRY)
    assert not any(row["installed"] for row in rows)
    assert {row["role"] for row in rows} >= {"default draft", "default target"}
    result = CliRunner().invoke(app, ["models", "install", "no-such-model"])
    assert result.exit_code == 2 and "unknown model" in result.stderr


@pytest.mark.skipif(shutil.which("specdec") is None, reason="installed by `pip install -e .`")
def test_console_script_runs() -> None:
    result = subprocess.run(["specdec", "generate", "--help"], capture_output=True, text=True, timeout=60,
                            env=cli_env())
    assert result.returncode == 0 and "--max-new-tokens" in result.stdout


def test_generate_with_a_missing_model_is_one_line(tmp_path) -> None:
    result = CliRunner().invoke(app, ["generate", "--draft", str(tmp_path / "nope"), "--target",
                                          str(tmp_path / "nope"), "t1"], env={"COLUMNS": "220"})
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "no such file or directory" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("path", [["up"], ["serve", "drafter"], ["serve", "verifier"], ["generate", "p"]])
def test_a_bad_dtype_is_a_usage_error_before_any_model_loads(path) -> None:
    result = CliRunner().invoke(app, [*path, "--dtype", "int4"], env={"COLUMNS": "220"})
    assert result.exit_code == 2, result.output
    assert "is not one of auto, float32, bfloat16, float16, int8" in result.output
    assert "Traceback" not in result.output


def test_the_precision_line_says_what_auto_picked() -> None:
    from specdec.cli.options import precision_line

    line = precision_line("auto", drafter="cpu", verifier="cuda:0")
    assert line.startswith("precision: drafter int8 (auto on cpu), verifier bfloat16 (auto on cuda:0);")
    assert "float32 (--dtype)" in precision_line("float32", verifier="cpu")
