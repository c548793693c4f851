"""`specdec up` with mTLS on every port and a client token, end to end (three real processes on
tiny random models): only a client with the CA, a client certificate and the token generates, and
nobody but the orchestrator can call the engines, whose token `up` made and keeps to itself."""

from __future__ import annotations

import stat

import grpc
import pytest

from orchestrator.clients.grpc_client import GrpcDrafterClient
from specdec.cli.processes import check_health
from specdec.engine.api import DraftRequest
from specdec.errors import Unauthenticated
from specdec.rpc.security import ClientSecurity
from specdec.sampling import SamplingParams
from tests.integration.helpers import TINY_CONTEXT, UpProcess, invoke_cli, json_lines

from .conftest import TOKEN, write_token

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def secured_up(pki, tmp_path_factory):
    from specdec.runtime.tiny import save_tiny_model

    workdir = tmp_path_factory.mktemp("up-tls")
    draft = save_tiny_model(workdir / "draft", vocab_size=8, seed=1, max_position_embeddings=TINY_CONTEXT)
    target = save_tiny_model(workdir / "target", vocab_size=8, seed=2, max_position_embeddings=TINY_CONTEXT)
    token = write_token(workdir / "client.token", TOKEN)
    up = UpProcess(workdir, "--draft", str(draft), "--target", str(target), "--no-pin",
                   "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                   "--tls-ca", str(pki.ca),
                   "--tls-client-ca", str(pki.ca), "--tls-require-client-cert",
                   "--tls-client-cert", str(pki.client_cert), "--tls-client-key", str(pki.client_key),
                   "--auth-token-file", str(token))
    up.token_file = token
    try:
        up.wait_ready()
        yield up
    finally:
        up.stop()


def _client_flags(pki) -> list[str]:
    return ["--tls-ca", str(pki.ca), "--tls-client-cert", str(pki.client_cert), "--tls-client-key",
            str(pki.client_key)]


def test_up_serves_mtls_and_the_token_and_hides_the_engines(secured_up, pki) -> None:
    info = secured_up.info
    with_cert = ClientSecurity(pki.ca, pki.client_cert, pki.client_key)
    for name in ("drafter", "verifier", "orchestrator"):
        assert check_health(info[name], timeout=10.0, security=with_cert) == "SERVING", name
        with pytest.raises(grpc.RpcError) as raised:  # a plaintext client gets no answer
            check_health(info[name], timeout=5.0)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError):  # TLS without a client certificate: refused as well
        check_health(info["orchestrator"], timeout=5.0, security=ClientSecurity(pki.ca))

    request = ["generate", "--address", info["orchestrator"], "--prompt-ids", "1,2,3", "-n", "4",
               "--seed", "1", "--json", "--ignore-eos", *_client_flags(pki)]
    refused = invoke_cli(*request)
    assert refused.exit_code == 1 and "UNAUTHENTICATED" in refused.stderr and "--token-file" in refused.stderr
    served = invoke_cli(*request, "--token-file", str(secured_up.token_file))
    assert served.exit_code == 0, served.output
    (line,) = json_lines(served.stdout)
    assert len(line["token_ids"]) == 4

    # The example command `up` prints carries the flags a client needs.
    shown = secured_up.stderr()
    assert f"--tls-ca {pki.ca}" in shown and f"--token-file {secured_up.token_file}" in shown

    # The engine token: a private file in the log folder that no client is told about.
    engine_token = secured_up.log_dir / "engine.token"
    assert stat.S_IMODE(engine_token.stat().st_mode) == 0o600
    assert engine_token.read_text().strip() not in secured_up.stderr()


async def test_up_engines_refuse_a_direct_draft(secured_up, pki) -> None:
    """Even with a valid client certificate and the client token, Draft on the drafter is refused."""
    for token in (None, TOKEN):
        security = ClientSecurity(pki.ca, pki.client_cert, pki.client_key, token=token)
        async with GrpcDrafterClient(secured_up.info["drafter"], timeout_s=30, security=security) as client:
            with pytest.raises(Unauthenticated):
                await client.draft(DraftRequest("intruder", 0, [1, 2], [-1, 0], SamplingParams(), 1))
            with pytest.raises(Unauthenticated):
                await client.release("someone-elses-session")
            assert await client.is_serving()  # health stays open (over mTLS)


def test_stopping_up_removes_the_engine_token(secured_up) -> None:
    engine_token = secured_up.log_dir / "engine.token"
    engine_secret = engine_token.read_text().strip()
    secured_up.stop()
    assert secured_up.process.returncode == 0, secured_up.stderr_path.read_text(errors="replace")
    assert not engine_token.exists()
    logs = [path.read_text(errors="replace") for path in secured_up.log_dir.glob("*.log")]
    logs.append(secured_up.stderr_path.read_text(errors="replace"))
    assert len(logs) == 4 and all(TOKEN not in log and engine_secret not in log for log in logs)
