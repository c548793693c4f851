"""The HTTP port over TLS and mTLS, with the certificates of the gRPC port (docs/http.md § Security):
the `openai` package completes over HTTPS when it trusts the CA, and a client without a certificate
is refused when client certificates are required."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from tests.security import pki as pki_module

from .conftest import MODEL, make_orchestrator

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if not pki_module.available():
        pytest.skip("needs the cryptography package or the openssl command to make certificates")
    return pki_module.make_pki(tmp_path_factory.mktemp("http-pki"))


async def _served(engines, tls):
    from orchestrator.openai_http.app import create_app
    from orchestrator.openai_http.server import start_http_server

    orchestrator = make_orchestrator(engines, pipeline=False)
    await orchestrator.start()
    app = create_app(orchestrator, served_model_name=MODEL)
    server = await start_http_server(app, "127.0.0.1", 0, tls=tls)
    return orchestrator, server


async def test_https_with_the_servers_certificate(engines, pki) -> None:
    from orchestrator.openai_http.server import HttpTls

    orchestrator, server = await _served(engines, HttpTls(str(pki.server_cert), str(pki.server_key)))
    base = f"https://127.0.0.1:{server.port}/v1"
    try:
        trusting = httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(pki.ca)))
        async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0,
                                      http_client=trusting) as client:
            done = await client.completions.create(model=MODEL, prompt="t1", max_tokens=3,
                                                   extra_body={"ignore_eos": True})
            assert done.usage.completion_tokens == 3
        async with httpx.AsyncClient() as untrusting:  # the system CAs do not know this one
            with pytest.raises(httpx.ConnectError):
                await untrusting.get(f"https://127.0.0.1:{server.port}/health")
    finally:
        await server.stop(1.0)
        await orchestrator.close()


async def test_mtls_refuses_a_client_without_a_certificate(engines, pki) -> None:
    from orchestrator.openai_http.server import HttpTls

    tls = HttpTls(str(pki.server_cert), str(pki.server_key), str(pki.ca), require_client_cert=True)
    orchestrator, server = await _served(engines, tls)
    url = f"https://127.0.0.1:{server.port}/health"
    try:
        with_cert = ssl.create_default_context(cafile=str(pki.ca))
        with_cert.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        async with httpx.AsyncClient(verify=with_cert) as client:
            assert (await client.get(url)).status_code == 200
        without = ssl.create_default_context(cafile=str(pki.ca))
        async with httpx.AsyncClient(verify=without) as client:
            with pytest.raises((httpx.ReadError, httpx.ConnectError, httpx.RemoteProtocolError)):
                await client.get(url)
    finally:
        await server.stop(1.0)
        await orchestrator.close()


@contextlib.asynccontextmanager
async def _mtls_door(pki, tenants) -> AsyncIterator[tuple[int, ssl.SSLContext, list[str]]]:
    """An HTTP door requiring client certificates over a backend that keeps each request's owner:
    (its port, a client context holding the client certificate, the owners seen)."""
    from orchestrator.openai_http.app import create_app
    from orchestrator.openai_http.server import HttpTls, start_http_server
    from tests.http.test_draft_source import RecordingBackend

    seen: list[str] = []

    class Owners(RecordingBackend):
        async def generate(self, request, *, owner, caller):
            seen.append(owner)
            return await super().generate(request, owner=owner, caller=caller)

    tls = HttpTls(str(pki.server_cert), str(pki.server_key), str(pki.ca), require_client_cert=True)
    with_cert = ssl.create_default_context(cafile=str(pki.ca))
    with_cert.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    server = await start_http_server(create_app(Owners(), served_model_name=MODEL, tenants=tenants),
                                     "127.0.0.1", 0, tls=tls)
    try:
        yield server.port, with_cert, seen
    finally:
        await server.stop(1.0)


async def test_an_mtls_client_is_its_certificates_tenant(pki) -> None:
    """A client certificate's common name maps to its tenant on the HTTP door as on the gRPC one
    (the `openai` package, which always sends its api_key as a bearer token; the tenants file names
    the certificate, not that token)."""
    from specdec.rpc.tenants import parse_tenants

    async with _mtls_door(pki, parse_tenants("team-m cn:orchestrator\n", "t")) as (port, with_cert, seen):
        async with httpx.AsyncClient(verify=with_cert) as http, openai.AsyncOpenAI(
                base_url=f"https://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                http_client=http) as client:
            await client.completions.create(model=MODEL, prompt="t1", max_tokens=1)
    assert seen == ["tenant:team-m"]


async def test_without_a_token_the_certificate_is_the_caller(pki) -> None:
    from specdec.rpc.security import digest
    from specdec.rpc.tenants import parse_tenants

    pem = ssl.DER_cert_to_PEM_cert(ssl.PEM_cert_to_DER_cert(pki.client_cert.read_text()))
    body = {"model": MODEL, "prompt": "t1", "max_tokens": 1}
    owners = []
    for tenants in (None, parse_tenants("team-m cn:orchestrator\n", "t")):
        async with _mtls_door(pki, tenants) as (port, with_cert, seen):
            async with httpx.AsyncClient(verify=with_cert) as http:
                response = await http.post(f"https://127.0.0.1:{port}/v1/completions", json=body)
            assert response.status_code == 200, response.text
        owners += seen
    assert owners == [f"cert:{digest(pem)}", "tenant:team-m"]
