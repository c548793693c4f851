"""Abandoned and unread SSE streams through the real uvicorn server: a stream closed after its first
event (a raw socket, or the `openai` package's stream.close()) frees its run, its request slot and both
engines' sessions at once, with the active-requests gauge back to zero, however many are aborted;
clients that never read do not keep a well-behaved client waiting (their runs pause without a slot);
one left unread past the idle timeout is closed and resumes exactly; a caller over its cap gets 429."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import openai
import pytest

from .conftest import CHAT_TEMPLATE, MODEL, make_orchestrator, serve

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]

# Streams aborted in the many-aborts test (the harness used 1,000: SPECDEC_TEST_ABORTS=1000).
ABORTS = int(os.environ.get("SPECDEC_TEST_ABORTS", "50"))
WAIT_S = 30.0  # bound of every wait (never reached unless something is broken)
LONG = 1500  # new tokens of a stream that is never read to its end (the tiny models' window is 2048)
IDLE_TOKENS = 800  # more than an unread stream's buffers hold (below), fewer than LONG: a shorter test
NON_READERS = 4  # connections that never read...
SAMPLES = 4  # ...each asking for this many streams (n): the harness had 4 x 16
# The server's sockets' send buffer: small, so that a stream its client does not read blocks after
# uvicorn's own 64 KiB (about 400 events) rather than after the megabytes Linux would grow it to.
SEND_BUFFER = 4096


async def _wait_until(condition, what: str, wait_s: float = WAIT_S) -> None:
    try:
        async with asyncio.timeout(wait_s):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {wait_s} s: {what}") from None


def _body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "t1", "max_tokens": LONG, "stream": True,
                       "ignore_eos": True, **fields}).encode()


class RawStream:
    """A raw HTTP/1.1 connection that has sent a streamed completion request; it reads only when told
    (no asyncio stream buffering on its side: what it does not read stays in the kernel's buffers)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = b""

    @classmethod
    async def open(cls, port: int, body: bytes, *, receive_buffer: int | None = None) -> RawStream:
        sock = socket.socket()
        if receive_buffer is not None:  # a small window, so that a client that never reads fills it soon
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nhost: test\r\n"
                                      b"content-type: application/json\r\n"
                                      b"content-length: %d\r\n\r\n" % len(body) + body)
        return cls(sock)

    async def first_event(self) -> dict:
        """Read up to the end of the first SSE event (and no further than one recv past it)."""
        async with asyncio.timeout(WAIT_S):
            while b"\n\n" not in self.data.partition(b"data: ")[2]:
                self.data += await asyncio.get_running_loop().sock_recv(self.sock, 4096)
        return json.loads(self.data.partition(b"data: ")[2].partition(b"\n\n")[0])

    async def read_to_end(self) -> None:
        """Read until the server closes the connection."""
        async with asyncio.timeout(WAIT_S):
            while await asyncio.get_running_loop().sock_recv(self.sock, 65536):
                pass

    def close(self) -> None:
        self.sock.close()


class Stack:
    """An orchestrator with metrics served over HTTP, and what must come back to zero."""

    def __init__(self, engines, **config) -> None:
        from orchestrator.metrics import OrchestratorMetrics, new_registry

        self.engines = engines
        self.registry = new_registry(process=False)
        self.orchestrator = make_orchestrator(engines, pipeline=False, chat_template=CHAT_TEMPLATE, **config)
        self.orchestrator.observer = OrchestratorMetrics(self.registry)
        self.baseline = self.sessions()
        self.created = engines[1].stats()["created"]
        self.released = engines[1].stats()["released"]

    async def __aenter__(self) -> Stack:
        self.server = await serve(self.orchestrator, served_model_name=MODEL)
        self.port = self.server.port
        for listening in self.server._server.servers:  # accepted connections inherit a small send
            for sock in listening.sockets:              # buffer, so an unread stream blocks soon
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop(1.0)
        await self.orchestrator.close()

    def sessions(self) -> tuple[int, int]:
        return tuple(engine.stats()["active_sessions"] for engine in self.engines)

    def active_gauge(self) -> float:
        return sum(sample.value for metric in self.registry.collect()
                   if metric.name == "specdec_active_requests" for sample in metric.samples)

    def freed(self) -> bool:
        stats = self.orchestrator.admission_stats()
        return (stats["active"] == stats["paused"] == stats["waiting"] == 0
                and self.sessions() == self.baseline and self.active_gauge() == 0)

    async def assert_all_freed(self) -> None:
        await _wait_until(self.freed, f"slots, sessions and the gauge back to zero: "
                                      f"{self.orchestrator.admission_stats()}, sessions {self.sessions()} "
                                      f"(baseline {self.baseline}), gauge {self.active_gauge()}")


async def test_streams_closed_after_their_first_event_free_everything(engines) -> None:
    async with Stack(engines) as stack:
        began = time.monotonic()
        for _ in range(ABORTS):
            stream = await RawStream.open(stack.port, _body())
            await stream.first_event()
            stream.close()  # gone after the first event, as the harness did
        await stack.assert_all_freed()
        stats = stack.engines[1].stats()  # every session made was released (none left to expire)
        assert stats["released"] - stack.released == stats["created"] - stack.created > 0
        assert time.monotonic() - began < WAIT_S + ABORTS  # far below the engines' 600 s TTL


@pytest.mark.slow  # starts processes (tests/conftest.py, tiers)
async def test_an_openai_stream_closed_frees_everything(engines) -> None:
    async with Stack(engines) as stack:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="x",
                                      max_retries=0, timeout=60) as client:
            for chat in (False, True):
                create = client.chat.completions.create if chat else client.completions.create
                prompt = {"messages": [{"role": "user", "content": "t1"}]} if chat else {"prompt": "t1"}
                stream = await create(model=MODEL, max_tokens=LONG, stream=True, n=3,
                                      extra_body={"ignore_eos": True}, **prompt)
                async with asyncio.timeout(WAIT_S):
                    await anext(stream.__aiter__())
                await stream.close()
        await stack.assert_all_freed()
        stats = stack.engines[1].stats()  # every session made was released (none left to expire)
        assert stats["released"] - stack.released == stats["created"] - stack.created > 0


async def test_clients_that_never_read_do_not_keep_others_waiting(engines) -> None:
    """The issue's case, scaled down: connections that ask for n streams each and never read, as many
    streams as there are request slots. Once their writes block, their runs pause without a slot, so a
    well-behaved request waits for no one (before: it waited until --queue-timeout, then got 429)."""
    slots = NON_READERS * SAMPLES
    async with Stack(engines, max_active_requests=slots, queue_timeout_s=2 * WAIT_S,
                     stream_idle_timeout_s=0) as stack:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="x",
                                      max_retries=0, timeout=120) as client:
            async def well_behaved() -> float:
                began = time.perf_counter()
                done = await client.completions.create(model=MODEL, prompt="t1", max_tokens=32,
                                                       extra_body={"ignore_eos": True})
                assert done.usage.completion_tokens == 32
                return time.perf_counter() - began

            alone = await well_behaved()
            connections = [await RawStream.open(stack.port, _body(n=SAMPLES), receive_buffer=4096)
                           for _ in range(NON_READERS)]
            try:
                await _wait_until(lambda: stack.orchestrator.admission_stats()["paused"] == slots,
                                  "every unread stream paused without its slot", 3 * WAIT_S)
                assert stack.orchestrator.admission_stats()["active"] == 0
                busy = await asyncio.wait_for(well_behaved(), WAIT_S)
                assert busy < 2 * alone + 1.0, (busy, alone)  # delayed by at most one request's time
            finally:
                for connection in connections:
                    connection.close()
        await stack.assert_all_freed()


@pytest.mark.slow  # waits out an idle timeout: 12 s (tests/conftest.py, tiers)
async def test_an_unread_stream_is_closed_after_the_idle_timeout_and_resumes_exactly(engines) -> None:
    seeded = {"seed": 4, "temperature": 1.0}
    async with Stack(engines, stream_idle_timeout_s=1.0) as stack:
        orchestrator = stack.orchestrator
        stream = await RawStream.open(stack.port, _body(max_tokens=IDLE_TOKENS, **seeded),
                                      receive_buffer=4096)
        try:
            request_id = (await stream.first_event())["id"].removeprefix("cmpl-") + "-0"
            await _wait_until(lambda: orchestrator.admission_stats()["idle_closed"] == 1,
                              "the unread stream's run closed")
            await stack.assert_all_freed()
            record = await orchestrator.store.get_request(request_id)
            assert record.status == "running" and record.lease_until == 0.0 and record.token_ids
            await stream.read_to_end()  # the server closes the connection too, after its grace
        finally:
            stream.close()
        resumed = await orchestrator.resume(request_id)
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="x",
                                      max_retries=0, timeout=120) as client:
            whole = await client.completions.create(model=MODEL, prompt="t1", max_tokens=IDLE_TOKENS,
                                                    extra_body={"ignore_eos": True}, **seeded)
        assert len(resumed.token_ids) == IDLE_TOKENS and resumed.text == whole.choices[0].text


async def test_a_caller_over_its_cap_gets_429(engines) -> None:
    async with Stack(engines, max_requests_per_caller=2) as stack:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="x",
                                      max_retries=0, timeout=60) as client:
            with pytest.raises(openai.RateLimitError) as caught:  # n=3 from one address: one too many
                await client.completions.create(model=MODEL, prompt="t1", max_tokens=4, n=3)
            assert caught.value.status_code == 429
            assert "--max-requests-per-caller (2)" in caught.value.body["message"]
            done = await client.completions.create(model=MODEL, prompt="t1", max_tokens=4, n=2)
            assert len(done.choices) == 2
        assert stack.orchestrator.admission_stats()["caller_refused"] == 1
        await stack.assert_all_freed()
