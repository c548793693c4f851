"""`serve drafter|verifier` on a non-loopback address needs an engine token or mTLS, or an explicit
--insecure-engine (issue 29): an open engine runs anyone's chat template and reads any session.

The refusal comes before any model loads (the model paths here do not exist: a start that got past
the check fails on the model with exit 1 instead of the usage error's 2).
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specdec.cli import app

ROLES = ("drafter", "verifier")


def _serve(role: str, tmp_path, *extra: str):
    return CliRunner().invoke(app, ["serve", role, "--model", str(tmp_path / "nope"), "--port", "0", *extra],
                              env={"COLUMNS": "220"})


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "engine.example"])
def test_an_open_engine_on_a_non_loopback_host_is_refused_in_one_line(role, host, tmp_path) -> None:
    result = _serve(role, tmp_path, "--host", host)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {role}: --host {host} is not a loopback address")
    assert "--auth-token-file" in result.stderr and "--insecure-engine" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output


@pytest.mark.parametrize("role", ROLES)
def test_a_token_loopback_or_insecure_engine_gets_past_the_check(role, tmp_path) -> None:
    token = tmp_path / "engine.token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    for extra in (["--host", "0.0.0.0", "--auth-token-file", str(token)],
                  ["--host", "0.0.0.0", "--insecure-engine"],
                  ["--host", "127.0.0.1"], ["--host", "localhost"], ["--host", "::1"]):
        result = _serve(role, tmp_path, *extra)
        assert result.exit_code == 1, (extra, result.output)  # the missing model, after the check
        assert f"error: {role} model " in result.stderr, (extra, result.stderr)
