"""Careless and hostile clients against the real uvicorn server: every refusal has OpenAI's error
body with the field at fault, keeps the keep-alive connection, and costs the log one short line at
most (rate-limited, no traceback); a body over the limit gets 413 however it is sent."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from orchestrator.openai_http.errors import LINES_PER_SECOND, RefusalLog

from .conftest import MODEL, TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}
GOOD = {"model": MODEL, "prompt": "t1", "max_tokens": 2}


def client_port(response: httpx.Response) -> int | None:
    """The local port of the connection that carried `response` (same port: same connection);
    None when that connection is closed already (the server dropped it after answering)."""
    try:
        return response.extensions["network_stream"].get_extra_info("client_addr")[1]
    except OSError:
        return None


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and body["error"]["type"], body
    return body["error"]


# (method, path, headers, body, status, param): each a mistake a client makes
REFUSALS = [
    ("POST", "/v1/completions", JSON, GOOD, 401, None),  # no token
    ("POST", "/v1/completions", {**JSON, "Authorization": "Bearer wrong"}, b"{not json", 401, None),
    ("GET", "/nowhere", AUTH, None, 404, None),
    ("GET", "/v1/completions", AUTH, None, 405, None),
    ("POST", "/v1/completions", {**AUTH, **JSON}, b'{"model": "tiny', 400, None),  # not JSON
    ("POST", "/v1/completions", {**AUTH, **JSON}, b'{"model": "\xff\xfe"}', 400, None),  # not UTF-8
    ("POST", "/v1/completions", {**AUTH, **JSON}, b"[1, 2]", 400, None),
    ("POST", "/v1/completions", {**AUTH, **JSON}, b"", 400, None),
    ("POST", "/v1/completions", {**AUTH, **JSON}, {"prompt": "t1"}, 400, "model"),
    ("POST", "/v1/completions", {**AUTH, **JSON}, b'{"model": "x", "prompt": "t1", "temperature": NaN}',
     400, "temperature"),
    ("POST", "/v1/completions", {**AUTH, **JSON}, {**GOOD, "model": "nope"}, 404, None),
    ("POST", "/v1/chat/completions", {**AUTH, **JSON}, {"model": MODEL, "messages": [{"content": "t1"}]},
     400, "messages[0].role"),
    ("POST", "/v1/chat/completions", {**AUTH, **JSON},
     {"model": MODEL, "messages": [{"role": "wizard", "content": "t1"}]}, 400, "messages[0].role"),
    ("POST", "/v1/chat/completions", {**AUTH, **JSON}, {"model": MODEL, "messages": "t1"}, 400, "messages"),
    ("POST", "/v1/completions", {**AUTH, **JSON}, b"x" * (9 * 2**20), 413, None),
]


def _request(http: httpx.AsyncClient, base: str, method: str, path: str, headers: dict,
             body: object) -> object:
    content = body if isinstance(body, bytes) else None
    json_body = body if not isinstance(body, bytes) else None
    return http.request(method, f"{base}{path}", headers=headers, content=content, json=json_body)


@pytest.mark.asyncio
async def test_every_refusal_has_the_openai_error_body_and_keeps_the_connection(http_server) -> None:
    base, _ = http_server
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        ports = set()
        for method, path, headers, body, status, param in REFUSALS:
            response = await _request(http, base, method, path, headers, body)
            error = assert_openai_error(response, status)
            assert error["param"] == param, (path, body, error)
            assert "detail" not in response.text
            port = client_port(response)
            assert port is not None, f"the server closed the connection after a {status}"
            ports.add(port)
        done = await http.post(f"{base}/v1/completions", json=GOOD, headers=AUTH)
        assert done.status_code == 200
        ports.add(client_port(done))
    assert len(ports) == 1, f"{len(ports)} connections for {len(REFUSALS) + 1} requests: a refusal closed one"


async def _chunks(total: int, size: int = 2**20) -> AsyncIterator[bytes]:
    for _ in range(total // size):
        yield b"x" * size


@pytest.mark.asyncio
async def test_a_chunked_body_over_the_limit_gets_413(http_server) -> None:
    """No Content-Length: the limit is found as the body streams in, and answered with 413 (it was
    a 400 "error parsing the body"); the connection serves the next request."""
    base, _ = http_server
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        response = await http.post(f"{base}/v1/completions", content=_chunks(20 * 2**20),
                                   headers={**AUTH, **JSON})
        assert "content-length" not in response.request.headers
        assert response.request.headers["transfer-encoding"] == "chunked"
        error = assert_openai_error(response, 413)
        assert error["code"] == "request_too_large"
        after = await http.get(f"{base}/v1/models", headers=AUTH)
        assert after.status_code == 200


@contextlib.contextmanager
def server_log() -> Iterator[io.StringIO]:
    """What the server writes to its log, tracebacks included, as a log file would hold it: the
    HTTP door's loggers at INFO and uvicorn's (whatever other tests made of its propagation)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    loggers = [logging.getLogger("orchestrator.openai_http"), logging.getLogger("uvicorn.error")]
    ours, level = loggers[0], loggers[0].level
    ours.setLevel(logging.INFO)
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield stream
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        ours.setLevel(level)


@pytest.mark.asyncio
async def test_a_thousand_bad_requests_write_a_few_short_lines(http_server) -> None:
    """500 requests without a token and 500 that are not JSON once wrote 4.27 MB of tracebacks."""
    base, _ = http_server
    began = time.monotonic()
    with server_log() as log:
        async with httpx.AsyncClient(timeout=60) as http:
            async def no_token() -> None:
                assert (await http.post(f"{base}/v1/completions", json=GOOD)).status_code == 401

            async def not_json() -> None:
                response = await http.post(f"{base}/v1/completions", content=b"{oops",
                                           headers={**AUTH, **JSON})
                assert response.status_code == 400

            async def client(calls: int) -> None:  # 20 keep-alive clients at once, each in turn
                for i in range(calls):
                    await (no_token() if i % 2 else not_json())

            await asyncio.gather(*(client(50) for _ in range(20)))
            elapsed = time.monotonic() - began
            await asyncio.sleep(1.05)  # a new rate window: its first line counts what the last one left out
            await no_token()
            await not_json()
    text = log.getvalue()
    assert "Traceback" not in text and "Exception in ASGI application" not in text
    lines = text.splitlines()
    # bounded by time, not by the requests: two kinds, LINES_PER_SECOND each, short lines
    assert len(lines) <= 2 * LINES_PER_SECOND * (int(elapsed) + 3), (len(lines), elapsed)
    long = [line for line in lines if "openai_http" in line and len(line) > 300]
    assert not long, f"a refusal's line is short: {long[:3]}"
    assert len(text) < 4.27e6 / 20, len(text)
    assert any("401" in line and "refusals not logged" in line for line in lines), text
    assert any("400" in line and "refusals not logged" in line for line in lines), text
    assert all(" ERROR " not in line for line in lines), text


def test_the_refusal_log_is_rate_limited_per_status() -> None:
    now = [0.0]
    records: list[logging.LogRecord] = []
    logger = logging.getLogger("tests.http.refusals")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        refusals = RefusalLog(logger, per_second=2, clock=lambda: now[0])
        written = [refusals.record(400, "POST", "/v1/completions", "bad\nline", ValueError("x"))
                   for _ in range(5)]
        assert written == [True, True, False, False, False]
        assert refusals.record(401, "GET", "/v1/models", "no token")  # its own kind, its own budget
        now[0] = 1.5
        assert refusals.record(400, "POST", "/v1/completions", "bad")
        try:
            raise RuntimeError("a bug")
        except RuntimeError as exc:
            assert refusals.record(500, "POST", "/v1/completions", "internal error", exc)
    finally:
        logger.removeHandler(handler)
    levels = [record.levelno for record in records]
    assert levels == [logging.INFO, logging.INFO, logging.WARNING, logging.INFO, logging.ERROR]
    assert "3 more 400 refusals not logged" in records[3].getMessage()
    assert "\n" not in records[0].getMessage()  # client text is quoted: it cannot forge log lines
    assert [record.exc_info is not None for record in records] == [False, False, False, False, True]
