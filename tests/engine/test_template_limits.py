"""Caller-supplied chat templates are bounded (issue 29 item 3): size, render time, output, memory.

A template someone sends with ApplyChatTemplate is Jinja code; before these limits two nested
`range(100000)` loops kept the verifier's text threads busy for hours and every Tokenize timed out.
Now the render runs in a child process killed past its deadline, and the other calls keep being
served while it runs. Every wait here is bounded (gRPC deadlines, pytest-timeout).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from specdec.engine.verifier import VerifierEngine
from specdec.errors import InvalidRequest
from specdec.generation import ChatMessage
from specdec.rpc.grpc_support import stop_server
from specdec.rpc.v1 import verifier_pb2, verifier_pb2_grpc
from specdec.runtime.chat_template import ChatTemplateRenderer, TemplateLimits
from verifier_service.server import start_verifier_server

# Caller templates render in a child process: the whole module is slow (tests/conftest.py, tiers).
pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

GOOD = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
# Each bomb can hit one limit only, whatever the CPU's speed: the time bomb loops 10^10 times and
# emits nothing (its memory stays flat: no output accumulates), the memory bomb doubles a string 40
# times (16 TB) within milliseconds. A bomb that emitted "x" per iteration hit the 512 MB cap before
# a 3 s timeout on a fast CPU (an AMX Xeon) and the timeout first on a slower one (issue 41).
TIME_BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MEMORY_BOMB = ("{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}"
               "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}")
CHAT = [ChatMessage("user", "t1 t2")]
TIMEOUT_S = 1.0
# A fresh child imports transformers (seconds on a busy machine); that wait is not the render's.
START_S = 60.0


@pytest.fixture(scope="module")
def engine(target_model):
    engine = VerifierEngine(target_model, template_limits=TemplateLimits(timeout_s=TIMEOUT_S,
                                                                         max_output_bytes=64 * 1024))
    yield engine
    engine.template_renderer.close()


def test_a_caller_template_renders_as_transformers_does(engine) -> None:
    tokenizer = engine.loaded.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "t1 t2"}], chat_template=GOOD,
                                         tokenize=False, add_generation_prompt=True)
    expected = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    assert engine.apply_chat_template(CHAT, GOOD) == expected
    assert engine.template_renderer.renders >= 1  # it went through the bounded child, not in-process


def test_a_template_over_the_size_limit_is_refused_unread(engine) -> None:
    with pytest.raises(InvalidRequest, match=r"chat_template: 65537 UTF-8 bytes; at most 65536"):
        engine.apply_chat_template(CHAT, "x" * 65537)


def test_a_nested_loop_is_stopped_at_the_timeout(engine) -> None:
    engine.apply_chat_template(CHAT, GOOD)  # a started child: what follows times the render alone
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"longer than 1 s .*--chat-template-timeout"):
        engine.apply_chat_template(CHAT, TIME_BOMB)
    assert time.monotonic() - started < TIMEOUT_S + 2.0
    assert engine.apply_chat_template(CHAT, GOOD)  # the next render gets a fresh child


def test_a_huge_output_is_refused_naming_the_limit(engine) -> None:
    huge = "{% for i in range(10000) %}{{ 'abcdefghij' }}{% endfor %}"  # 100,000 bytes > 64 KiB
    with pytest.raises(InvalidRequest, match=r"rendered prompt has 100000 UTF-8 bytes; at most 65536"):
        engine.apply_chat_template(CHAT, huge)


def test_a_template_error_is_an_invalid_argument_not_a_crash(engine) -> None:
    with pytest.raises(InvalidRequest, match="chat template failed: TemplateError: no"):
        engine.apply_chat_template(CHAT, "{{ raise_exception('no') }}")


def test_memory_is_capped() -> None:
    renderer = ChatTemplateRenderer(TemplateLimits(timeout_s=20.0, max_memory_mb=64))
    try:
        started = time.monotonic()
        with pytest.raises(InvalidRequest, match=r"64 MB of memory"):
            renderer.render(MEMORY_BOMB, [{"role": "user", "content": "hi"}], {})
        assert time.monotonic() - started < START_S
    finally:
        renderer.close()


def test_the_time_bomb_cannot_hit_the_memory_cap() -> None:
    """How a faster CPU is simulated here: under the smallest memory cap (16 MB) the time bomb still
    stops at its timeout, so its memory does not grow with the iterations a CPU gets through."""
    renderer = ChatTemplateRenderer(TemplateLimits(timeout_s=TIMEOUT_S, max_memory_mb=16))
    try:
        renderer.render(GOOD, [{"role": "user", "content": "hi"}], {})  # a started child
        with pytest.raises(InvalidRequest, match=r"--chat-template-timeout"):
            renderer.render(TIME_BOMB, [{"role": "user", "content": "hi"}], {})
    finally:
        renderer.close()


@pytest.fixture
def slow_engine(target_model):
    """Renders may take 3 s: a Tokenize queued behind one would wait far past the 1 s bound below."""
    engine = VerifierEngine(target_model, template_limits=TemplateLimits(timeout_s=3.0))
    yield engine
    engine.template_renderer.close()


async def test_tokenize_is_served_while_two_bombs_render(slow_engine) -> None:
    """The issue's measurement: two bombs in flight (one for each limit), Tokenize calls still answer
    at once, each bomb gets INVALID_ARGUMENT naming the limit that stopped it, and the verifier serves
    templates again afterwards."""
    engine = slow_engine
    await asyncio.to_thread(engine.apply_chat_template, CHAT, GOOD)  # start the child first
    server, port = await start_verifier_server(engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = verifier_pb2_grpc.VerifierServiceStub(channel)
    try:
        bombs = {}
        for limit, template in (("--chat-template-timeout", TIME_BOMB), ("MB of memory", MEMORY_BOMB)):
            request = verifier_pb2.ChatTemplateRequest(chat_template=template)
            request.messages.add(role="user", content="t1 t2")
            bombs[limit] = asyncio.ensure_future(stub.ApplyChatTemplate(request, timeout=START_S))
        await asyncio.sleep(0.2)
        slowest = 0.0
        for _ in range(10):
            started = time.monotonic()
            response = await stub.Tokenize(verifier_pb2.TokenizeRequest(text="t1 t2 t3"), timeout=5.0)
            slowest = max(slowest, time.monotonic() - started)
            assert list(response.token_ids)
            await asyncio.sleep(0.05)
        assert slowest < 1.0, f"a Tokenize waited {slowest:.2f} s behind the template renders"
        for limit, bomb in bombs.items():
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await bomb
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert limit in (caught.value.details() or ""), (limit, caught.value.details())
        good = verifier_pb2.ChatTemplateRequest(chat_template=GOOD)
        good.messages.add(role="user", content="t1 t2")
        answer = await stub.ApplyChatTemplate(good, timeout=START_S)
        assert list(answer.token_ids) == engine.apply_chat_template(CHAT, GOOD)
    finally:
        await channel.close()
        await stop_server(server, 0.5)
