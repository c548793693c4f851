"""One default path (issue 27): a request that names no method or k runs with the orchestrator's
configured defaults, whichever door it comes through — the generated gRPC stub, the OpenAI HTTP API
(the official `openai` package), the Python client and `specdec generate --address` — and a method
the request names wins. One real orchestrator over tiny models serves gRPC and HTTP on loopback, as
`specdec serve orchestrator --default-method ersd --default-k 3 --http-port …` would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

pytestmark = pytest.mark.timeout(240)

PROMPT = "t1 t2 t3"
MODEL = "tiny-target"
DEFAULT_METHOD = "ersd"  # not the built-in default (token): only the configuration can pick it
DEFAULT_K = 3  # nor is this the built-in k (2)
TOKENS = 6
RPC_TIMEOUT_S = 60.0
# Sequential speculation (records then show k as asked), and no saved calibration of the pair.
SETTINGS = {"pipeline": False, "use_calibration": False}


@pytest.fixture(scope="module")
def engines(tiny_models):
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine
    from specdec.runtime.loading import load_model

    return (DrafterEngine(load_model(tiny_models.draft, threads=1)),
            VerifierEngine(load_model(tiny_models.target, threads=1)))


@dataclass
class Doors:
    grpc: str  # host:port of the GenerationService
    http: str  # base URL of the OpenAI-compatible API
    registry: Any  # the orchestrator's Prometheus metrics (what /metrics serves), labelled by method


@contextlib.asynccontextmanager
async def serving(engines, **config: Any) -> AsyncIterator[Doors]:
    """One orchestrator with `config`, served over gRPC and HTTP at once (as `serve orchestrator
    --http-port` does), with its metrics on a registry of its own."""
    from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
    from orchestrator.config import OrchestratorConfig
    from orchestrator.metrics import OrchestratorMetrics, new_registry
    from orchestrator.openai_http.app import create_app
    from orchestrator.openai_http.server import start_http_server
    from orchestrator.server import start_orchestrator_server
    from orchestrator.speculation import Orchestrator
    from specdec.client import AsyncClient
    from specdec.rpc.grpc_support import stop_server

    drafter, verifier = engines
    registry = new_registry(process=False)
    orchestrator = Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier),
                                OrchestratorConfig(**config), observer=OrchestratorMetrics(registry, MODEL))
    grpc_server = http_server = None
    await orchestrator.start()
    try:
        grpc_server, port = await start_orchestrator_server(orchestrator)
        app = create_app(orchestrator, served_model_name=MODEL)
        http_server = await start_http_server(app, "127.0.0.1", 0)
        address = f"127.0.0.1:{port}"
        async with AsyncClient(address) as probe:
            for _ in range(200):  # bounded: the health monitor's first round sets SERVING
                if await probe.health() == "SERVING":
                    break
                await asyncio.sleep(0.02)
        yield Doors(address, f"http://127.0.0.1:{http_server.port}", registry)
    finally:
        if http_server is not None:
            await http_server.stop(1.0)
        if grpc_server is not None:
            await stop_server(grpc_server, 0.5)
        await orchestrator.close()


def runs_by_method(registry) -> dict[str, float]:
    """Finished runs per method label (specdec_requests_total, all outcomes)."""
    counts: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "specdec_requests_total":
                method = sample.labels["method"]
                counts[method] = counts.get(method, 0.0) + sample.value
    return counts


async def one_more_run(registry, before: dict[str, float]) -> str:
    """The method of the single run that finished since `before` (the count moves as the run ends,
    which may be a moment after the answer left)."""
    deadline = time.monotonic() + 10.0
    while True:
        now = runs_by_method(registry)
        moved = {m: now[m] - before.get(m, 0.0) for m in now if now[m] != before.get(m, 0.0)}
        if moved or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    assert len(moved) == 1 and next(iter(moved.values())) == 1, moved
    return next(iter(moved))


def assert_ran(result, method: str, k: int | None = None) -> None:
    """The result names `method`, and its speculative iterations ran it (the model's with draft length k)."""
    assert result.method == method, result.method
    speculative = [r for r in result.iterations if r.method != "autoregressive"]
    assert speculative and all(r.method == method for r in speculative), [r.method for r in result.iterations]
    if k is not None:  # the draft model's length (a model-free draft's size is the proposal's)
        model = [r for r in speculative if r.source == "model"]
        assert all(r.k == k for r in model), [(r.source, r.k) for r in speculative]


# ------------------------------------------------------------------------------------- the doors


async def via_grpc_stub(doors: Doors, **fields: Any):
    """The generated stub alone: a GenerationRequest message with only the fields given."""
    import grpc

    from specdec.rpc import generation_convert
    from specdec.rpc.v1 import generation_pb2, generation_pb2_grpc

    message = generation_pb2.GenerationRequest(prompt=PROMPT, max_new_tokens=TOKENS, seed=7, **fields)
    async with grpc.aio.insecure_channel(doors.grpc) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        reply = await stub.Generate(message, timeout=RPC_TIMEOUT_S)
    return generation_convert.generation_result_from_proto(reply)


async def via_client(doors: Doors, **fields: Any) -> tuple[Any, Any]:
    """specdec.client.Client (blocking, in a thread): generate and generate_stream's last chunk."""
    from specdec.client import Client

    def run() -> tuple[Any, Any]:
        with Client(doors.grpc, timeout_s=RPC_TIMEOUT_S) as client:
            result = client.generate(PROMPT, max_new_tokens=TOKENS, seed=7, **fields)
            chunks = list(client.generate_stream(PROMPT, max_new_tokens=TOKENS, seed=8, **fields))
        return result, chunks[-1].result

    return await asyncio.to_thread(run)


async def via_http(doors: Doors, extra_body: dict[str, Any] | None = None) -> str:
    """A completion through the official `openai` package; returns the method that ran (the
    orchestrator's metrics count each finished run under its method)."""
    import openai

    before = runs_by_method(doors.registry)
    async with openai.AsyncOpenAI(base_url=f"{doors.http}/v1", api_key="unused", max_retries=0,
                                  timeout=RPC_TIMEOUT_S) as client:
        completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, seed=7,
                                                     extra_body=extra_body)
    assert completion.choices[0].text and completion.usage.completion_tokens > 0
    return await one_more_run(doors.registry, before)


async def via_cli(doors: Doors, *flags: str) -> dict[str, Any]:
    """`specdec generate --address … --json` (in a thread: it runs its own event loop)."""
    from typer.testing import CliRunner

    from specdec.cli import app

    args = ["generate", "--address", doors.grpc, "--json", "--seed", "7", "-n", str(TOKENS), *flags, PROMPT]
    env = {"COLUMNS": "200", "NO_COLOR": "1", "SPECDEC_ADDRESS": None, "SPECDEC_TOKEN": None}
    result = await asyncio.to_thread(CliRunner().invoke, app, args, env=env)
    assert result.exit_code == 0, result.output
    (line,) = [json.loads(text) for text in result.stdout.splitlines() if text.startswith("{")]
    return line


# ------------------------------------------------------------------------------------- the tests


async def test_a_request_naming_no_method_gets_the_configured_default_through_every_door(engines) -> None:
    async with serving(engines, default_method=DEFAULT_METHOD, default_k=DEFAULT_K, **SETTINGS) as doors:
        assert_ran(await via_grpc_stub(doors), DEFAULT_METHOD, DEFAULT_K)
        result, streamed = await via_client(doors)
        assert_ran(result, DEFAULT_METHOD, DEFAULT_K)
        assert_ran(streamed, DEFAULT_METHOD, DEFAULT_K)
        assert await via_http(doors) == DEFAULT_METHOD
        assert await via_http(doors, {"method": ""}) == DEFAULT_METHOD  # empty: left to the server too
        line = await via_cli(doors)
        assert line["method"] == DEFAULT_METHOD


async def test_a_method_the_request_names_wins_over_the_default(engines) -> None:
    async with serving(engines, default_method=DEFAULT_METHOD, default_k=DEFAULT_K, **SETTINGS) as doors:
        assert_ran(await via_grpc_stub(doors, method="token", k=1), "token", 1)
        result, streamed = await via_client(doors, method="token")
        assert_ran(result, "token", DEFAULT_K)  # no k: the default k still applies
        assert_ran(streamed, "token", DEFAULT_K)
        assert await via_http(doors, {"method": "token"}) == "token"
        line = await via_cli(doors, "--method", "block", "--k", "2")
        assert line["method"] == "block"


async def test_without_configuration_the_built_in_default_runs(engines) -> None:
    """The same requests on an orchestrator configured with nothing: the built-in defaults
    (specdec.defaults, which OrchestratorConfig and the CLI's help take)."""
    from specdec.defaults import DEFAULT_K as BUILT_IN_K
    from specdec.defaults import DEFAULT_METHOD as BUILT_IN_METHOD

    async with serving(engines, **SETTINGS) as doors:
        assert_ran(await via_grpc_stub(doors), BUILT_IN_METHOD, BUILT_IN_K)
        assert await via_http(doors) == BUILT_IN_METHOD
