"""/metrics can ask for a bearer token and speak TLS (issue 29 item 7), and says so when it is open
on a non-loopback address beside a protected service port. Real HTTP(S) on loopback, every request
under a timeout."""

from __future__ import annotations

import logging
import ssl
import urllib.error
import urllib.request

import pytest
import typer

from specdec.cli.observability import ObservabilityOptions, child_args, setup_observability
from tests.security import pki as pki_module

TOKEN = "metrics-token-0123456789abcdef"
TIMEOUT_S = 10


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if not pki_module.available():
        pytest.skip("needs the cryptography package or the openssl command to make certificates")
    return pki_module.make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "metrics.token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def _get(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_token_is_required_on_metrics(token_file) -> None:
    options = ObservabilityOptions(metrics_port=0, metrics_token_file=token_file)
    obs = options.setup("verifier")
    try:
        url = obs.ready_info()["metrics_url"]
        assert url.startswith("http://127.0.0.1:")
        assert _get(url)[0] == 401
        status, body = _get(url, "wrong-token")
        assert status == 401 and "--metrics-token-file" in body
        status, body = _get(url, TOKEN)
        assert status == 200 and "specdec_" in body
    finally:
        obs.shutdown()


def test_metrics_over_tls_with_the_service_certificate(pki, token_file) -> None:
    options = ObservabilityOptions(metrics_port=0, metrics_token_file=token_file, metrics_tls=True,
                                   tls_cert=pki.server_cert, tls_key=pki.server_key)
    obs = options.setup("orchestrator", protected=True)
    try:
        url = obs.ready_info()["metrics_url"]
        assert url.startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(pki.ca))
        status, body = _get(url, TOKEN, trusted)
        assert status == 200 and "specdec_" in body
        assert _get(url, None, trusted)[0] == 401
        with pytest.raises(OSError):  # plain HTTP to a TLS port gets no metrics (reset or refused)
            _get(url.replace("https://", "http://"), TOKEN)
        # A client that connects and never handshakes does not stall the others.
        import socket

        with socket.create_connection(("127.0.0.1", obs.metrics_port), timeout=TIMEOUT_S):
            assert _get(url, TOKEN, trusted)[0] == 200
    finally:
        obs.shutdown()


def test_metrics_tls_needs_the_service_certificate() -> None:
    with pytest.raises(typer.Exit) as caught:
        ObservabilityOptions(metrics_port=0, metrics_tls=True)
    assert caught.value.exit_code == 2


def test_an_unreadable_token_file_exits_before_anything_starts(tmp_path) -> None:
    empty = tmp_path / "empty.token"
    empty.write_text("")
    empty.chmod(0o600)
    with pytest.raises(typer.Exit) as caught:
        ObservabilityOptions(metrics_port=0, metrics_token_file=empty)
    assert caught.value.exit_code == 1


def test_an_open_metrics_port_beside_a_protected_service_is_a_warning(caplog, token_file) -> None:
    caplog.set_level(logging.WARNING, logger="specdec.cli.observability")
    for host, protected, token, warned in (("0.0.0.0", True, None, True),
                                           ("0.0.0.0", False, None, False),   # nothing protected anyway
                                           ("127.0.0.1", True, None, False),  # loopback
                                           ("0.0.0.0", True, TOKEN, False)):  # the endpoint has a token
        caplog.clear()
        obs = setup_observability("drafter", metrics_port=0, metrics_host=host, protected=protected,
                                  metrics_token=token)
        obs.shutdown()
        lines = [r.getMessage() for r in caplog.records if "/metrics" in r.getMessage()]
        assert bool(lines) == warned, (host, protected, token, lines)
        if warned:
            assert "--metrics-token-file" in lines[0] and "0.0.0.0" in lines[0]


def test_up_passes_the_metrics_protection_to_its_children(tmp_path, token_file) -> None:
    args = child_args("verifier", metrics_port=9464, metrics_token_file=token_file, metrics_tls=True)
    assert args == ["--metrics-port", "9466", "--metrics-token-file", str(token_file.resolve()),
                    "--metrics-tls"]
