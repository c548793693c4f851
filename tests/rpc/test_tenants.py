"""Tenants (specdec.rpc.tenants): a file of `NAME TOKEN` / `NAME cn:COMMON_NAME` lines; every token is
accepted, and a caller proven by one is its tenant on both doors (records, caps, cache partitions)."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from orchestrator.openai_http.app import OpenAIFrontDoor
from orchestrator.server import _caller
from specdec.cli.options import server_security
from specdec.rpc.security import ANONYMOUS, digest
from specdec.rpc.tenants import parse_tenants, read_tenants_file

FILE = """# tenants of the shared service
team-a   tok-a-1
team-a   tok-a-2
team-b   tok-b
team-c   cn:billing-client
"""


def test_tokens_and_common_names_map_to_their_tenant():
    tenants = parse_tenants(FILE, "tenants")
    assert set(tenants.tokens) == {"tok-a-1", "tok-a-2", "tok-b"}
    assert tenants.names == {"team-a", "team-b", "team-c"}
    assert tenants.identity(f"token:{digest('tok-a-1')}") == tenants.identity(f"token:{digest('tok-a-2')}") \
        == "tenant:team-a"
    assert tenants.identity(f"token:{digest('tok-b')}") == "tenant:team-b"
    assert tenants.identity("cert:abc", common_name="billing-client") == "tenant:team-c"
    other = f"token:{digest('someone-else')}"
    assert tenants.identity(other) == other and tenants.identity(ANONYMOUS) == ANONYMOUS


@pytest.mark.parametrize(("text", "says"), [
    ("team-a\n", "line 1: expected `NAME CREDENTIAL`"),
    ("team a s3cr3t\n", "line 1: expected `NAME CREDENTIAL`"),
    ("-bad s3cr3t\n", "line 1: a tenant name"),
    ("team-a s3cr3t\nteam-b s3cr3t\n", "line 2: this token is already on an earlier line"),
    ("team-a cn:x\nteam-b cn:x\n", "line 2: the common name"),
    ("# nothing\n\n", "no tenant"),
    ("team-a s3cr3tö\n", "line 1: a credential must be printable ASCII"),
])
def test_a_bad_file_is_refused_with_its_line_and_never_the_token(text, says):
    with pytest.raises(ValueError, match=says) as caught:
        parse_tenants(text, "--tenants-file t.txt")
    assert "s3cr3t" not in str(caught.value)


def test_the_server_accepts_the_tenants_tokens_besides_its_own(tmp_path):
    tenants, token = tmp_path / "tenants", tmp_path / "token"
    tenants.write_text(FILE)
    token.write_text("admin-token\n")
    for path in (tenants, token):
        path.chmod(0o600)
    security = server_security(tls_cert=None, tls_key=None, tls_client_ca=None, tls_require_client_cert=False,
                               auth_token_file=token, tenants_file=tenants)
    assert set(security.tokens) == {"admin-token", "tok-a-1", "tok-a-2", "tok-b"}
    assert security.tenants == read_tenants_file(tenants) and security.authenticated


class _Context:
    def __init__(self, token: str | None, common_name: str | None = None) -> None:
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        self.common_name = common_name

    def invocation_metadata(self):
        return self.metadata

    def auth_context(self):
        return {"x509_common_name": [self.common_name.encode()]} if self.common_name else {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"


def _http(token: str | None) -> Request:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return Request({"type": "http", "headers": headers, "client": ("127.0.0.1", 5000)})


def test_both_doors_name_the_tenant():
    tenants = parse_tenants(FILE, "tenants")
    def owner(context: _Context, tenants=None) -> str:
        who = _caller(context, tenants)  # type: ignore[arg-type]
        assert who["caller"] == who["owner"]  # a named caller is capped as itself
        return who["owner"]

    assert owner(_Context("tok-a-2"), tenants) == "tenant:team-a"
    assert owner(_Context(None, "billing-client"), tenants) == "tenant:team-c"
    assert owner(_Context("tok-b")) == f"token:{digest('tok-b')}"  # no tenants
    assert _caller(_Context(None)) == {"owner": ANONYMOUS, "caller": "peer:ipv4:127.0.0.1"}  # type: ignore[arg-type]
    door = OpenAIFrontDoor(object(), tokens=tenants.tokens, tenants=tenants)  # type: ignore[arg-type]
    assert door.owner(_http("tok-a-1")) == "tenant:team-a" and door.owner(_http("tok-b")) == "tenant:team-b"
    with pytest.raises(Exception, match="token"):
        door.owner(_http("not-a-tenant"))
