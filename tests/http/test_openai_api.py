"""The OpenAI-compatible HTTP API through the official `openai` package, against the real uvicorn
server over an in-process orchestrator on tiny models: outputs equal the orchestrator's own for the
same request, streams put together equal the whole answer, and refusals get OpenAI's statuses."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from specdec.generation import ChatMessage, GenerationRequest
from specdec.sampling import SamplingParams

from .conftest import MODEL, TOKEN, make_orchestrator, serve

pytestmark = pytest.mark.asyncio

GREEDY = SamplingParams(temperature=0.0)
LONG = 1500  # new tokens a stream is asked for and never gets to (the tiny models' window is 2048)


async def direct(orchestrator, **fields):
    """What the orchestrator itself answers (the reference for the HTTP answer)."""
    return await orchestrator.generate(GenerationRequest(**fields))


async def test_models_lists_the_served_name(client) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] > 0


async def test_completion_equals_the_orchestrators_answer(client, http_server) -> None:
    _, orchestrator = http_server
    response = await client.completions.create(model=MODEL, prompt="t1 t2 t3", max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True})
    reference = await direct(orchestrator, prompt="t1 t2 t3", max_new_tokens=12, sampling=GREEDY,
                             stop_token_ids=[])
    choice = response.choices[0]
    assert choice.text == reference.text and choice.finish_reason == "length"
    assert response.id.startswith("cmpl-") and response.model == MODEL
    assert response.usage.prompt_tokens == 3 and response.usage.completion_tokens == 12
    assert response.usage.total_tokens == 15


async def test_seeded_samples_of_a_prompt_batch(client, http_server) -> None:
    _, orchestrator = http_server
    response = await client.completions.create(
        model=MODEL, prompt=[[1, 2], "t4 t5"], n=2, seed=7, max_tokens=6,
        extra_body={"method": "token", "k": 2, "ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for index, prompt in enumerate([{"prompt_ids": [1, 2]}, {"prompt": "t4 t5"}]):
        for j in range(2):
            reference = await direct(orchestrator, **prompt, max_new_tokens=6, seed=7 + j, method="token",
                                     k=2, stop_token_ids=[])
            assert response.choices[2 * index + j].text == reference.text
    assert response.usage.prompt_tokens == 4 and response.usage.completion_tokens == 24


async def test_chat_applies_the_template(client, http_server) -> None:
    _, orchestrator = http_server
    messages = [{"role": "system", "content": "t4"}, {"role": "user", "content": "t5 t6"}]
    response = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                    temperature=0)
    reference = await direct(orchestrator, messages=[ChatMessage(**m) for m in messages], max_new_tokens=8,
                             sampling=GREEDY)
    message = response.choices[0].message
    assert message.role == "assistant" and message.content == reference.text
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    # t1 t4 t2 t5 t6 t3: the template's words around the contents
    assert response.usage.prompt_tokens == 6 == reference.prompt_tokens


async def test_a_chat_answer_ended_by_eos_holds_no_eos_text(client) -> None:
    """The end-of-sequence token (t7, a special token) ends the answer but is no text, as with vLLM
    and OpenAI: `"content": "t4 t2"`, never `"t4 t2 t7"`."""
    messages = [{"role": "user", "content": "t5 t6"}]
    for seed in range(60):  # bounded: an eighth of the tokens is EOS, so most answers end with it
        response = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                        temperature=1.0, seed=seed)
        choice = response.choices[0]
        if choice.finish_reason == "stop":
            break
    else:
        pytest.fail("no answer ended with EOS")
    assert "t7" not in choice.message.content.split(), choice.message.content
    assert response.usage.completion_tokens >= 1


async def test_streamed_completion_puts_together_the_whole_answer(client) -> None:
    whole = await client.completions.create(model=MODEL, prompt="t1 t2", max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True})
    stream = await client.completions.create(model=MODEL, prompt="t1 t2", max_tokens=10, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    pieces, reasons, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == whole.choices[0].text
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert usage is not None and usage.completion_tokens == 10


async def test_streamed_chat_starts_with_the_role_and_ends_with_done(http_server) -> None:
    base, _ = http_server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "t4"}], "max_tokens": 6,
            "temperature": 0, "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        whole = (await http.post(f"{base}/v1/chat/completions", json={**body, "stream": False},
                                 headers={"Authorization": f"Bearer {TOKEN}"})).json()
        async with http.stream("POST", f"{base}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {TOKEN}"}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == whole["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert {e["object"] for e in events} == {"chat.completion.chunk"}


@pytest.mark.parametrize("fields, where, param", [
    ({"temperature": -1}, "temperature", "temperature"),
    ({"extra_body": {"method": "nope"}}, "method", "method"),
    ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty"),
    ({"logprobs": 2}, "logprobs", "logprobs"),
    ({"n": 40}, "n:", "n"),
    ({"extra_body": {"a": 0.5, "method": "token"}}, "a:", "a"),
    ({"extra_body": {"top_k": 10**12}}, "top_k", "top_k"),  # past the engines' int32
    # strict types, as vLLM and OpenAI: no strings, booleans or fractions where an integer is due
    ({"extra_body": {"max_tokens": "10"}}, "integer, got a string", "max_tokens"),
    ({"extra_body": {"max_tokens": 2.5}}, "max_tokens", "max_tokens"),
    ({"extra_body": {"max_tokens": True}}, "integer, got a boolean", "max_tokens"),
    ({"extra_body": {"n": "2"}}, "n:", "n"),
    ({"extra_body": {"seed": "7"}}, "seed", "seed"),
    ({"extra_body": {"top_k": 2.5}}, "top_k", "top_k"),
    ({"extra_body": {"temperature": "0.5"}}, "number, got a string", "temperature"),
    ({"extra_body": {"top_p": True}}, "top_p", "top_p"),
    ({"extra_body": {"ignore_eos": "yes"}}, "ignore_eos", "ignore_eos"),
    ({"extra_body": {"stream": "false"}}, "stream", "stream"),
    ({"extra_body": {"prompt": [1, True]}}, "prompt", "prompt"),
])
async def test_bad_parameters_get_400_naming_the_field(client, fields, where, param) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=MODEL, prompt="t1", max_tokens=2, **fields)
    assert caught.value.status_code == 400
    assert where in caught.value.body["message"]
    assert caught.value.body["type"] == "invalid_request_error"
    assert caught.value.body["param"] is not None and caught.value.body["param"].startswith(param)


async def test_integers_may_be_written_without_a_fraction(client) -> None:
    """2.0 is a JSON integer's value (vLLM takes it too); only a fraction is refused."""
    response = await client.completions.create(model=MODEL, prompt="t1", max_tokens=2, temperature=0,
                                               extra_body={"max_tokens": 2.0, "ignore_eos": True})
    assert response.usage.completion_tokens == 2


async def test_a_bad_chat_role_and_an_empty_chat_get_400(client) -> None:
    with pytest.raises(openai.BadRequestError, match="role"):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "t1"}])
    with pytest.raises(openai.BadRequestError, match="empty"):
        await client.chat.completions.create(model=MODEL, messages=[])


async def test_token_guards_every_route_but_health(http_server) -> None:
    base, _ = http_server
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0) as intruder:
        with pytest.raises(openai.AuthenticationError):
            await intruder.models.list()
        with pytest.raises(openai.AuthenticationError):
            await intruder.completions.create(model=MODEL, prompt="t1", max_tokens=2)
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{base}/health")).status_code == 200
        response = await http.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "t1"})
        assert response.status_code == 401 and TOKEN not in response.text


async def test_an_unknown_model_gets_404(client) -> None:
    with pytest.raises(openai.NotFoundError, match="nope"):
        await client.completions.create(model="nope", prompt="t1", max_tokens=2)


async def test_a_body_over_the_limit_gets_413(http_server) -> None:
    base, _ = http_server
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(f"{base}/v1/completions", content=b"x" * (9 * 2**20),
                                   headers={"Authorization": f"Bearer {TOKEN}",
                                            "Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


async def test_chat_without_a_template_is_a_clear_400(engines) -> None:
    orchestrator = make_orchestrator(engines)
    server = await serve(orchestrator)
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                                      max_retries=0) as client:
            with pytest.raises(openai.BadRequestError, match="no chat template.*--chat-template"):
                await client.chat.completions.create(model=orchestrator.target_info.model_id,
                                                     messages=[{"role": "user", "content": "t1"}])
    finally:
        await server.stop(1.0)
        await orchestrator.close()


async def test_the_next_turn_reports_its_cached_tokens_and_a_salt_keeps_them_apart(tiny_pair) -> None:
    """The prefix cache through the HTTP door: a conversation's next turn (the first turn's prompt, its
    answer and a new message, under one cache_salt) reports in its usage every token of the first
    request that its sessions held, to the answer's end: full blocks and partial ones. Another salt
    finds nothing, and a bad salt is a 400 naming the field."""
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine
    from specdec.runtime.loading import load_model
    from specdec.runtime.prefix_cache import PrefixStore

    block = 8
    draft, target = tiny_pair
    engines = (DrafterEngine(load_model(draft, threads=1), prefix_cache=PrefixStore(1 << 24, block)),
               VerifierEngine(load_model(target, threads=1), prefix_cache=PrefixStore(1 << 24, block)))
    orchestrator = make_orchestrator(engines, pipeline=False)
    server = await serve(orchestrator, served_model_name=MODEL)
    first = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]

    async def ask(client, prompt: list[int], salt: object) -> int:
        response = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                   extra_body={"ignore_eos": True, "cache_salt": salt})
        return response.usage.prompt_tokens_details.cached_tokens

    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                                      max_retries=0, timeout=60) as client:
            assert await ask(client, first, "a") == 0
            # the same greedy answer, its tokens (under a salt of its own)
            answer = (await direct(orchestrator, prompt_ids=first, max_new_tokens=12, sampling=GREEDY,
                                   stop_token_ids=[], cache_salt="reference")).token_ids
            second = first + answer + [5, 6, 1]
            held = len(first) + len(answer) - 1  # all but the last answer token (no pass may have taken it)
            assert await ask(client, second, "a") >= held > held // block * block  # the partial block counts
            assert await ask(client, second, "b") == 0
            with pytest.raises(openai.BadRequestError, match="cache_salt"):
                await ask(client, second, "")
    finally:
        await server.stop(1.0)
        await orchestrator.close()


async def test_a_full_server_answers_429(engines) -> None:
    orchestrator = make_orchestrator(engines, max_active_requests=1, queue_timeout_s=0.0, pipeline=False)
    server = await serve(orchestrator, served_model_name=MODEL)
    await orchestrator.admission.acquire()  # a running request holds the only request slot
    held = True
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                                      max_retries=0) as client:
            with pytest.raises(openai.RateLimitError) as caught:
                await client.completions.create(model=MODEL, prompt="t1", max_tokens=2)
            assert caught.value.status_code == 429 and "overloaded" in caught.value.body["message"]
            orchestrator.admission.release()
            held = False
            done = await client.completions.create(model=MODEL, prompt="t1", max_tokens=2)
            assert done.usage.completion_tokens >= 1
    finally:
        if held:
            orchestrator.admission.release()
        await server.stop(1.0)
        await orchestrator.close()


async def test_a_closed_stream_stops_its_generation_and_frees_its_slot(engines) -> None:
    orchestrator = make_orchestrator(engines, pipeline=False)
    server = await serve(orchestrator, served_model_name=MODEL)
    base = f"http://127.0.0.1:{server.port}"
    body = {"model": MODEL, "prompt": "t1", "max_tokens": LONG, "stream": True, "ignore_eos": True}
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{base}/v1/completions", json=body) as held:
                assert held.status_code == 200
                first = await anext(held.aiter_lines())
        response_id = json.loads(first.removeprefix("data: "))["id"]
        for _ in range(500):  # bounded: the server sees the disconnect and closes the run
            if orchestrator.admission_stats()["active"] == 0:
                break
            await asyncio.sleep(0.02)
        assert orchestrator.admission_stats()["active"] == 0
        record = await orchestrator.store.get_request(response_id.removeprefix("cmpl-") + "-0")
        assert record is not None and record.status != "done" and len(record.token_ids) < LONG
    finally:
        await server.stop(1.0)
        await orchestrator.close()


class _NotServing:
    """An orchestrator whose verifier is down (what ensure_serving raises then)."""

    config = None
    target_info = None

    async def ensure_serving(self) -> None:
        from specdec.errors import PeerUnavailable

        raise PeerUnavailable("verifier not ready")


async def test_not_serving_gives_503_on_health_and_requests() -> None:
    from orchestrator.openai_http.app import create_app
    from orchestrator.openai_http.server import start_http_server

    server = await start_http_server(create_app(_NotServing(), served_model_name=MODEL), "127.0.0.1", 0)
    try:
        async with httpx.AsyncClient() as http:
            health = await http.get(f"http://127.0.0.1:{server.port}/health")
            assert health.status_code == 503 and "verifier not ready" in health.text
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                                      max_retries=0) as client:
            with pytest.raises(openai.InternalServerError) as caught:
                await client.completions.create(model=MODEL, prompt="t1", max_tokens=2)
            assert caught.value.status_code == 503
    finally:
        await server.stop(1.0)
