"""The HTTP API's own metrics, through the real uvicorn server: every answer counts by route and
status (refusals too, 413 before the app sees the body), streams count when they end, unknown
paths share one label, and nothing stays in progress."""

from __future__ import annotations

import httpx
import pytest
import pytest_asyncio

from .conftest import MODEL, TOKEN, make_orchestrator


@pytest_asyncio.fixture
async def metered(engines):
    from prometheus_client import CollectorRegistry

    from orchestrator.metrics import HttpMetrics
    from orchestrator.openai_http.app import create_app
    from orchestrator.openai_http.server import start_http_server

    registry = CollectorRegistry()
    orchestrator = make_orchestrator(engines, pipeline=False)
    await orchestrator.start()
    server = await start_http_server(create_app(orchestrator, served_model_name=MODEL, tokens=[TOKEN]),
                                     "127.0.0.1", 0, max_body_bytes=4096, metrics=HttpMetrics(registry))
    try:
        yield f"http://127.0.0.1:{server.port}", registry
    finally:
        await server.stop(1.0)
        await orchestrator.close()


def requests(registry, route: str, status: int) -> float:
    labels = {"route": route, "status": str(status)}
    return registry.get_sample_value("specdec_http_requests_total", labels) or 0.0


@pytest.mark.asyncio
async def test_requests_count_by_route_and_status(metered) -> None:
    base, registry = metered
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = {"model": MODEL, "prompt": "t1 t2", "max_tokens": 4}
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await http.post(f"{base}/v1/completions", json=body, headers=auth)).status_code == 200
        assert (await http.post(f"{base}/v1/completions", json=body)).status_code == 401  # no token
        bad = {**body, "temperature": -1}
        assert (await http.post(f"{base}/v1/completions", json=bad, headers=auth)).status_code == 400
        huge = {**body, "prompt": "t1 " * 4000}
        assert (await http.post(f"{base}/v1/completions", json=huge, headers=auth)).status_code == 413
        async with http.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                               headers=auth) as stream:
            assert stream.status_code == 200
            assert [line async for line in stream.aiter_lines() if line][-1] == "data: [DONE]"
        assert (await http.get(f"{base}/nowhere/{'x' * 40}", headers=auth)).status_code == 404
        assert (await http.get(f"{base}/v1/models", headers=auth)).status_code == 200
    route = "/v1/completions"
    assert requests(registry, route, 200) == 2  # the whole answer and the stream
    assert requests(registry, route, 401) == 1
    assert requests(registry, route, 400) == 1
    assert requests(registry, route, 413) == 1
    assert requests(registry, "other", 404) == 1  # the path itself is not a label value
    assert requests(registry, "/v1/models", 200) == 1
    assert registry.get_sample_value("specdec_http_request_seconds_count", {"route": route}) == 5
    assert registry.get_sample_value("specdec_http_request_seconds_sum", {"route": route}) > 0
    for name in (route, "/v1/models", "other"):
        assert registry.get_sample_value("specdec_http_active_requests", {"route": name}) == 0


def test_routes_are_a_bounded_label_set() -> None:
    from orchestrator.metrics import http_route

    assert http_route("/v1/chat/completions") == "/v1/chat/completions"
    assert http_route("/v1/chat/completions/") == "/v1/chat/completions"
    assert http_route("/health") == "/health"
    assert http_route("/v1/completions/../../etc") == "other"
    assert http_route("") == "other"
