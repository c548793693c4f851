"""Fixtures of the HTTP API tests: an in-process orchestrator over tiny models, served by the real
uvicorn server on loopback, and the official `openai` package's async client pointed at it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402

VOCAB = 8
CONTEXT = 2048
TOKEN = "http-test-token"
MODEL = "tiny-target"
# The tiny word-level tokenizer knows only t0..t7: a template made of those words.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}t1 {% else %}t2 {% endif %}"
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t3{% endif %}")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    from specdec.runtime.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("http-models")
    return (save_tiny_model(root / "draft", vocab_size=VOCAB, seed=11, max_position_embeddings=CONTEXT),
            save_tiny_model(root / "target", vocab_size=VOCAB, seed=12, max_position_embeddings=CONTEXT))


@pytest.fixture(scope="session")
def engines(tiny_pair):
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine
    from specdec.runtime.loading import load_model

    draft, target = tiny_pair
    return DrafterEngine(load_model(draft, threads=1)), VerifierEngine(load_model(target, threads=1))


def make_orchestrator(engines, **config):
    from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
    from orchestrator.config import OrchestratorConfig
    from orchestrator.speculation import Orchestrator

    drafter, verifier = engines
    return Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier),
                        OrchestratorConfig(**config))


async def serve(orchestrator, **app_options):
    from orchestrator.openai_http.app import create_app
    from orchestrator.openai_http.server import start_http_server

    await orchestrator.start()
    return await start_http_server(create_app(orchestrator, **app_options), "127.0.0.1", 0)


@pytest_asyncio.fixture
async def http_server(engines) -> AsyncIterator[tuple[str, object]]:
    """(base URL, orchestrator) of a served orchestrator with a chat template and a token."""
    orchestrator = make_orchestrator(engines, chat_template=CHAT_TEMPLATE, pipeline=False)
    server = await serve(orchestrator, served_model_name=MODEL, tokens=[TOKEN])
    try:
        yield f"http://127.0.0.1:{server.port}", orchestrator
    finally:
        await server.stop(1.0)
        await orchestrator.close()


@pytest_asyncio.fixture
async def client(http_server):
    import openai

    base, _ = http_server
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=60) as client:
        yield client
