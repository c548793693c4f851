"""Fixtures of the security tests: a throwaway PKI (built once per session) and a token file."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import pki as pki_module
from .pki import Pki

TOKEN = "s3cr3t-client-token-0123456789abcdef"
ENGINE_TOKEN = "s3cr3t-engine-token-fedcba9876543210"


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    if not pki_module.available():
        pytest.skip("needs the cryptography package or the openssl command to make certificates")
    return pki_module.make_pki(tmp_path_factory.mktemp("pki"))


def write_token(path: Path, token: str) -> Path:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def token_file(tmp_path) -> Path:
    return write_token(tmp_path / "client.token", TOKEN)


@pytest.fixture
def engine_token_file(tmp_path) -> Path:
    return write_token(tmp_path / "engine.token", ENGINE_TOKEN)
