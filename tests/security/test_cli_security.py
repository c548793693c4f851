"""The security options of `specdec serve *`, `up` and `generate`: listed in --help, and a bad
combination or file stops the command with one line before any model loads (the model paths here
do not exist, so a check that came after loading would report the model instead)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from specdec.cli import app

from .conftest import TOKEN, write_token

ENV = {"COLUMNS": "220", "NO_COLOR": "1", "SPECDEC_TOKEN": ""}
SERVER_FLAGS = ("--tls-cert", "--tls-key", "--tls-client-ca", "--tls-require-client-cert")
CLIENT_FLAGS = ("--tls-ca", "--tls-client-cert", "--tls-client-key", "--tls-server-name")


def _flags(*path: str) -> set[str]:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return {opt for param in command.params for opt in param.opts}


@pytest.mark.parametrize("path, expected", [
    (("serve", "drafter"), (*SERVER_FLAGS, "--auth-token-file")),
    (("serve", "verifier"), (*SERVER_FLAGS, "--auth-token-file")),
    (("serve", "orchestrator"), (*SERVER_FLAGS, *CLIENT_FLAGS, "--auth-token-file", "--engine-token-file")),
    (("up",), (*SERVER_FLAGS, *CLIENT_FLAGS, "--auth-token-file")),
    (("generate",), (*CLIENT_FLAGS, "--token-file")),
])
def test_every_command_has_its_security_flags(path, expected) -> None:
    assert set(expected) <= _flags(*path)
    result = CliRunner().invoke(app, [*path, "--help"], env=ENV)
    assert result.exit_code == 0
    for flag in expected:
        assert flag in result.output


def _run(*args: str):
    return CliRunner().invoke(app, list(args), env=ENV)


def _one_line_error(result, code: int, *fragments: str) -> None:
    assert result.exit_code == code, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.output and "model" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


def test_engine_flag_combinations_exit_2_before_loading(pki, tmp_path) -> None:
    model = str(tmp_path / "no-model")
    cases = [
        (["--tls-cert", str(pki.server_cert)], "--tls-cert needs --tls-key"),
        (["--tls-key", str(pki.server_key)], "--tls-key needs --tls-cert"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-require-client-cert"],
         "--tls-require-client-cert needs --tls-client-ca"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca",
          str(pki.ca)], "--tls-client-ca needs --tls-require-client-cert"),
        (["--tls-client-ca", str(pki.ca), "--tls-require-client-cert"], "needs --tls-cert and --tls-key"),
    ]
    for role in ("drafter", "verifier"):
        for flags, message in cases:
            _one_line_error(_run("serve", role, "--model", model, "--port", "0", *flags), 2, message)


def test_engine_bad_files_exit_1_before_loading(pki, tmp_path) -> None:
    model = str(tmp_path / "no-model")
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    cases = [
        (["--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(pki.server_key)],
         "--tls-cert", "no such file"),
        (["--tls-cert", str(pki.server_key), "--tls-key", str(pki.server_key)],
         "--tls-cert", "not a PEM file with a certificate"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.client_key)],
         "--tls-key", "is not the private key of --tls-cert"),
        (["--auth-token-file", str(tmp_path / "nope.token")], "--auth-token-file", "no such file"),
        (["--auth-token-file", str(empty)], "--auth-token-file", "empty"),
    ]
    for flags, *fragments in cases:
        _one_line_error(_run("serve", "verifier", "--model", model, "--port", "0", *flags), 1, *fragments)


def test_orchestrator_checks_both_sides_before_connecting(pki, tmp_path) -> None:
    bad_token = tmp_path / "bad.token"
    bad_token.write_text(f"{TOKEN} second-word\n")
    base = ["serve", "orchestrator", "--port", "0", "--peer-timeout", "0.1"]
    _one_line_error(_run(*base, "--tls-client-cert", str(pki.client_cert)), 2,
                    "--tls-client-cert needs --tls-client-key")
    _one_line_error(_run(*base, "--tls-server-name", "drafter.internal"), 2,
                    "--tls-server-name needs --tls-ca")
    _one_line_error(_run(*base, "--tls-require-client-cert"), 2, "--tls-require-client-cert needs")
    result = _run(*base, "--engine-token-file", str(bad_token))
    _one_line_error(result, 1, "--engine-token-file", "one word of printable ASCII")
    assert TOKEN not in result.output


def test_generate_checks_its_flags_and_hides_the_token(pki, tmp_path) -> None:
    _one_line_error(_run("generate", "--tls-client-key", str(pki.client_key), "p"), 2,
                    "--tls-client-key needs --tls-client-cert")
    _one_line_error(_run("generate", "--tls-ca", str(tmp_path / "nope.pem"), "p"), 1,
                    "--tls-ca", "no such file")
    bad = tmp_path / "bad.token"
    bad.write_text(f"{TOKEN} {TOKEN}")
    result = _run("generate", "--token-file", str(bad), "p")
    _one_line_error(result, 1, "--token-file")
    assert TOKEN not in result.output
    result = CliRunner().invoke(app, ["generate", "p"], env={**ENV, "SPECDEC_TOKEN": f"{TOKEN} x"})
    _one_line_error(result, 1, "$SPECDEC_TOKEN")
    assert TOKEN not in result.output


def test_up_needs_the_ca_and_client_cert_its_checks_use(pki, tmp_path) -> None:
    models = ["--draft", str(tmp_path / "no-draft"), "--target", str(tmp_path / "no-target"), "--port", "0",
              "--drafter-port", "0", "--verifier-port", "0"]
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    _one_line_error(_run("up", *models, *tls), 2, "--tls-cert with `up` needs --tls-ca")
    _one_line_error(_run("up", *models, "--tls-ca", str(pki.ca)), 2, "need --tls-cert and --tls-key")
    _one_line_error(_run("up", *models, *tls, "--tls-ca", str(pki.ca), "--tls-client-ca", str(pki.ca),
                         "--tls-require-client-cert"), 2, "needs --tls-client-cert and --tls-client-key")
    token = write_token(tmp_path / "t", TOKEN)
    result = _run("up", *models, *tls, "--tls-ca", str(pki.server_key), "--auth-token-file", str(token))
    _one_line_error(result, 1, "--tls-ca", "not a PEM file with a certificate")
