"""specdec.rpc.security without servers: credential files and their errors, token files, what a
repr shows, and the exposure warning."""

from __future__ import annotations

import logging
import stat
import subprocess

import pytest

from specdec.rpc.security import (
    ClientSecurity,
    ServerSecurity,
    TokenAuthInterceptor,
    channel_credentials,
    exposure_warning,
    is_loopback,
    read_token_file,
    server_credentials,
    warn_if_exposed,
    write_token_file,
)

from .conftest import TOKEN, write_token

# ------------------------------------------------------------------------------ token files


def test_read_token_file_strips_whitespace(tmp_path) -> None:
    path = tmp_path / "t"
    path.write_text(f"\n  {TOKEN}  \n")
    path.chmod(0o600)
    assert read_token_file(path) == TOKEN


@pytest.mark.parametrize("content, expected", [
    ("", "the file is empty"),
    (" \n\t\n", "the file is empty"),
    ("two words-of-secret", "one word of printable ASCII"),
    ("sécret-token", "one word of printable ASCII"),
])
def test_bad_token_files_name_the_flag_never_the_token(tmp_path, content, expected) -> None:
    path = tmp_path / "t"
    path.write_text(content)
    with pytest.raises(ValueError) as raised:
        read_token_file(path, "--engine-token-file")
    message = str(raised.value)
    assert message.startswith(f"--engine-token-file {path}: ") and expected in message
    for word in content.split():
        assert word not in message


def test_missing_token_file(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"^--auth-token-file .*nope: no such file$"):
        read_token_file(tmp_path / "nope")
    with pytest.raises(ValueError, match="is a directory"):
        read_token_file(tmp_path)


def test_a_token_file_others_can_read_is_warned_about(tmp_path, caplog) -> None:
    path = tmp_path / "t"
    path.write_text(TOKEN)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert read_token_file(path) == TOKEN
    assert "chmod 600" in caplog.text and TOKEN not in caplog.text
    for private in (0o600, 0o640, 0o440):  # the owner, or its group (a Kubernetes Secret's fsGroup)
        caplog.clear()
        path.chmod(private)
        with caplog.at_level(logging.WARNING):
            read_token_file(path)
        assert caplog.text == "", oct(private)


def test_write_token_file_is_private_and_replaces(tmp_path) -> None:
    path = write_token(tmp_path / "t", "old-token")
    path.chmod(0o644)
    write_token_file(path, "new-token")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_token_file(path) == "new-token"


# ------------------------------------------------------------------------------ certificates


def test_good_credentials_load(pki) -> None:
    assert server_credentials(pki.server_cert, pki.server_key) is not None
    assert server_credentials(pki.server_cert, pki.server_key, pki.ca, require_client_cert=True) is not None
    assert channel_credentials(pki.ca) is not None
    assert channel_credentials(pki.ca, pki.client_cert, pki.client_key) is not None


def test_bad_server_files_name_the_flag(pki, tmp_path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate at all\n")
    cases = [
        ((tmp_path / "nope.pem", pki.server_key), r"^--tls-cert .*nope\.pem: no such file$"),
        ((garbage, pki.server_key), r"^--tls-cert .*garbage\.pem: not a PEM file with a certificate"),
        ((pki.server_cert, pki.server_cert), r"^--tls-key .*server\.pem: not a PEM file with a private key"),
        ((pki.server_cert, pki.client_key), r"^--tls-key .*client\.key is not the private key of --tls-cert"),
        ((pki.server_cert, pki.server_key, garbage, True), r"^--tls-client-ca .*garbage\.pem: not a PEM"),
    ]
    for args, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            server_credentials(*args)


def test_bad_server_combinations(pki) -> None:
    with pytest.raises(ValueError, match="^--tls-require-client-cert needs --tls-client-ca"):
        server_credentials(pki.server_cert, pki.server_key, None, require_client_cert=True)
    with pytest.raises(ValueError, match="^--tls-client-ca needs --tls-require-client-cert"):
        server_credentials(pki.server_cert, pki.server_key, pki.ca)
    with pytest.raises(ValueError, match="^--tls-cert needs --tls-key"):
        ServerSecurity(cert=pki.server_cert)
    with pytest.raises(ValueError, match="^--tls-key needs --tls-cert"):
        ServerSecurity(key=pki.server_key)
    with pytest.raises(ValueError, match=r"^--tls-client-ca needs --tls-cert and --tls-key"):
        ServerSecurity(client_ca=pki.ca, require_client_cert=True)


def test_bad_client_files_and_combinations(pki, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"^--tls-ca .*nope: no such file$"):
        channel_credentials(tmp_path / "nope")
    with pytest.raises(ValueError, match="^--tls-client-cert needs --tls-client-key$"):
        channel_credentials(pki.ca, pki.client_cert, None)
    with pytest.raises(ValueError, match="^--tls-client-key needs --tls-client-cert$"):
        ClientSecurity(pki.ca, client_key=pki.client_key)
    with pytest.raises(ValueError, match="^--tls-server-name needs --tls-ca"):
        ClientSecurity(server_name="drafter.internal")
    with pytest.raises(ValueError, match=r"^--tls-client-key .*server\.key is not the private key"):
        channel_credentials(pki.ca, pki.client_cert, pki.server_key)


def _encrypt(key, out) -> bool:
    try:
        from cryptography.hazmat.primitives import serialization
    except ImportError:
        try:
            subprocess.run(["openssl", "pkey", "-in", str(key), "-aes256", "-passout", "pass:pw", "-out",
                            str(out)], check=True, capture_output=True, timeout=30)
        except (OSError, subprocess.CalledProcessError):
            return False
        return True
    loaded = serialization.load_pem_private_key(key.read_bytes(), password=None)
    out.write_bytes(loaded.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"pw")))
    return True


def test_an_encrypted_key_is_refused_without_prompting(pki, tmp_path) -> None:
    encrypted = tmp_path / "encrypted.key"
    if not _encrypt(pki.server_key, encrypted):
        pytest.skip("cannot encrypt a key here")
    with pytest.raises(ValueError, match=r"^--tls-key .*encrypted\.key: encrypted private keys are not"):
        server_credentials(pki.server_cert, encrypted)


# ------------------------------------------------------------------------------ no secret in a repr


def test_reprs_hide_tokens(pki) -> None:
    client = ClientSecurity(pki.ca, token=TOKEN)
    server = ServerSecurity(pki.server_cert, pki.server_key, tokens=(TOKEN,))
    for shown in (repr(client), repr(server), repr(client.interceptors()), str(server.interceptors())):
        assert TOKEN not in shown
    assert "ca.pem" in repr(client)  # paths are no secret


def test_token_interceptor_compares_tokens() -> None:
    door = TokenAuthInterceptor(["a-token", "rotated-token"])
    assert door.accepts("a-token") and door.accepts("rotated-token")
    assert not door.accepts(None) and not door.accepts("") and not door.accepts("a-toke")
    assert not door.accepts("a-token-longer") and not door.accepts("ä-token")
    for tokens in ([], [""]):
        with pytest.raises(ValueError, match="non-empty token"):
            TokenAuthInterceptor(tokens)


def test_client_security_defaults_to_plaintext(pki) -> None:
    assert not ClientSecurity().uses_tls and ClientSecurity().credentials is None
    assert ClientSecurity().interceptors() == []
    assert ClientSecurity(pki.ca).uses_tls and ClientSecurity(tls=True).uses_tls
    assert ClientSecurity(pki.ca, server_name="x").options() == [("grpc.ssl_target_name_override", "x")]
    assert len(ClientSecurity(token=TOKEN).interceptors()) == 4  # one per call kind


# ------------------------------------------------------------------------------ exposure


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST", True), ("0.0.0.0", False), ("::", False), ("[::]", False), ("", False),
    ("10.1.2.3", False), ("203.0.113.7", False), ("2001:db8::1", False), ("example.com", False),
    ("myhost", False),
])
def test_is_loopback(host, loopback) -> None:
    assert is_loopback(host) is loopback


def test_warns_for_a_wildcard_without_tls_or_token(caplog) -> None:
    logger = logging.getLogger("test.exposure")
    with caplog.at_level(logging.WARNING, logger="test.exposure"):
        message = warn_if_exposed("0.0.0.0", tls=False, token=False, role="drafter", logger=logger)
    assert message is not None and caplog.records[-1].levelno == logging.WARNING
    assert caplog.records[-1].getMessage() == message and len(caplog.records) == 1
    assert "0.0.0.0" in message and "Draft" in message and "--auth-token-file" in message
    assert "--tls-cert" in message and "--host 127.0.0.1" in message


def test_says_what_is_missing() -> None:
    no_tls = exposure_warning("10.0.0.5", tls=False, token=True, role="orchestrator")
    assert no_tls is not None and "without TLS" in no_tls and "plaintext" in no_tls
    assert "--auth-token-file" not in no_tls
    no_token = exposure_warning("::", tls=True, token=False, role="orchestrator")
    assert no_token is not None and "without authentication" in no_token and "--tls-cert" not in no_token
    assert exposure_warning("0.0.0.0", tls=True, token=True, role="verifier") is None


def test_no_warning_on_loopback(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        for host in ("127.0.0.1", "::1", "localhost"):
            assert warn_if_exposed(host, tls=False, token=False, role="verifier") is None
    assert caplog.records == []
