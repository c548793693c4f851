"""Issue 14, cheap limits before work, on the engines' gRPC services with tiny real models: caps on
what one call may ask for, checked before any work; a text that cannot fit the context window
refused before tokenizing; Tokenize off the queue of the forward passes."""

from __future__ import annotations

import asyncio
import os
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402
import pytest  # noqa: E402

from drafter_service.server import start_drafter_server  # noqa: E402
from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient  # noqa: E402
from orchestrator.config import OrchestratorConfig  # noqa: E402
from specdec.engine.api import (
    MAX_LOOKAHEAD_GUESSES,
    MAX_LOOKAHEAD_K,
    MAX_TREE_NODES,
    LookaheadRequest,
    ScoreRequest,
    VerifyRequest,
)
from specdec.engine.drafter import DrafterEngine  # noqa: E402
from specdec.engine.verifier import VerifierEngine  # noqa: E402
from specdec.errors import InvalidRequest
from specdec.rpc.grpc_support import stop_server  # noqa: E402
from specdec.rpc.v1 import drafter_pb2  # noqa: E402
from specdec.runtime.loading import load_model  # noqa: E402
from specdec.runtime.tiny import save_tiny_model  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.verification.base import MethodParams  # noqa: E402
from tests.bpe_helpers import save_byte_level_model  # noqa: E402
from verifier_service.server import start_verifier_server  # noqa: E402

pytestmark = pytest.mark.timeout(180)

CONTEXT = 128  # the word-level pair's window
FAST_S = 1.0  # "at once": generous for a loopback call on a busy 2-core machine


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    word = load_model(save_tiny_model(root / "word", vocab_size=8, seed=5, max_position_embeddings=CONTEXT),
                      threads=1)
    byte_level = load_model(save_byte_level_model(root / "bpe", max_context=64), threads=1)
    return {"word": word, "bpe": byte_level}


async def _raw(address: str, path: str, payload: bytes) -> tuple[grpc.StatusCode, str, float]:
    """One call with the caller's own bytes: (status, details, seconds)."""
    options = [("grpc.max_send_message_length", 64 * 2**20)]
    async with grpc.aio.insecure_channel(address, options=options) as ch:
        method = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
        start = time.monotonic()
        try:
            await method(payload, timeout=60.0)
            code, details = grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
        return code, details, time.monotonic() - start


@pytest.fixture
async def drafter(models):
    server, port = await start_drafter_server(DrafterEngine(models["word"]))
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await stop_server(server, 0.5)


async def test_direct_lookahead_beyond_the_caps_is_refused_at_once(drafter) -> None:
    """The issue's abuse: Lookahead(k=1000, 16 + 16 guesses) kept a drafter busy for 71 s."""
    abuse = drafter_pb2.LookaheadRequest(session_id="abuse", base_len=0, append=[1, 2, 3], k=1000,
                                         bonus_guesses=16, rejection_guesses=16)
    path = "/specdec.v1.DrafterService/Lookahead"
    code, details, seconds = await _raw(drafter, path, abuse.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith("k must lie in 0..128") and "1000" in details
    assert seconds < FAST_S
    async with GrpcDrafterClient(drafter, timeout_s=60) as client:
        for field in ("bonus_guesses", "rejection_guesses"):
            with pytest.raises(InvalidRequest, match=f"{field} must lie in 0..{MAX_LOOKAHEAD_GUESSES}"):
                await client.lookahead(LookaheadRequest("s", 0, [1, 2, 3], 2, SamplingParams(), 0,
                                                        **{field: MAX_LOOKAHEAD_GUESSES + 1}))
        # The most the orchestrator can ask for (its max_k, every guess) is within the caps.
        k = OrchestratorConfig().max_k
        result = await client.lookahead(LookaheadRequest("most", 0, [1, 2, 3], k, SamplingParams(), 0,
                                                         bonus_guesses=16, rejection_guesses=16))
        # 16 + 16 asked; a vocabulary of 8 has 8 bonus tokens and 7 replacements to guess
        assert len(result.branches) == 15 and max(len(b.draft.tokens) for b in result.branches) == k
        assert k <= MAX_LOOKAHEAD_K


async def test_draft_caps_and_oversized_append_are_refused_before_reading(drafter) -> None:
    tree = drafter_pb2.DraftRequest(session_id="big-tree", base_len=0, append=[1],
                                    shape_parents=[-1] * (MAX_TREE_NODES + 1))
    code, details, _ = await _raw(drafter, "/specdec.v1.DrafterService/Draft", tree.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "shape_parents" in details and "1024" in details
    # 8 million appended ids (a 16 MB message): refused by their count, not read or run.
    huge = drafter_pb2.DraftRequest(session_id="huge", base_len=0, append=[1] * 8_000_000, shape_parents=[-1])
    code, details, seconds = await _raw(drafter, "/specdec.v1.DrafterService/Draft", huge.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"append: 8000000 tokens; the context window holds {CONTEXT}"
    assert seconds < 5.0  # mostly the 16 MB on the wire; reading it into a list took seconds more


async def test_verifier_caps(models) -> None:
    server, port = await start_verifier_server(VerifierEngine(models["word"]))
    try:
        async with GrpcVerifierClient(f"127.0.0.1:{port}", timeout_s=60) as client:
            n = MAX_TREE_NODES + 1
            with pytest.raises(InvalidRequest, match=f"tree_tokens holds {n} nodes; at most 1024"):
                await client.score(ScoreRequest("s", 0, [1], [1] * n, [-1] * n, SamplingParams()))
            with pytest.raises(InvalidRequest, match="append: 129 tokens; the context window holds 128"):
                await client.verify(VerifyRequest("s", 0, [1] * (CONTEXT + 1), [], [], "ersd", MethodParams(),
                                                  SamplingParams()))
            with pytest.raises(InvalidRequest, match="token_ids: 129 tokens"):
                await client.decode([1] * (CONTEXT + 1))
            assert await client.decode([1, 2]) == "t1 t2"
    finally:
        await stop_server(server, 0.5)


async def test_tokenize_refuses_a_text_that_cannot_fit_before_encoding_it(models, monkeypatch) -> None:
    engine = VerifierEngine(models["bpe"])
    # Byte-level BPE: its longest token is 16 bytes ("=" * 16), so at most 64 x 16 bytes fit.
    assert engine.max_text_bytes == 64 * 16
    tokenizer = engine.loaded.tokenizer
    encoded: list[int] = []
    real_encode = tokenizer.encode

    def encode(text, **kwargs):
        encoded.append(len(text))
        return real_encode(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    server, port = await start_verifier_server(engine)
    try:
        async with GrpcVerifierClient(f"127.0.0.1:{port}", timeout_s=60) as client:
            assert len(await client.tokenize("=" * 1024)) == 64  # at the bound: 64 tokens, it fits
            with pytest.raises(InvalidRequest) as caught:
                await client.tokenize("=" * 1025)  # 65 tokens at best
            assert str(caught.value) == (
                "text: 1025 UTF-8 bytes cannot fit the context window of 64 tokens (this tokenizer's "
                "tokens stand for at most 16 bytes each, so at most 1024 bytes fit)")
            start = time.monotonic()
            with pytest.raises(InvalidRequest, match="text: at least 20000000 UTF-8 bytes"):
                await client.tokenize("é" * 20_000_000)  # 40 MB: its 20M characters alone are too many
            assert time.monotonic() - start < 5.0  # the transfer; the check itself reads no byte
    finally:
        await stop_server(server, 0.5)
    assert encoded == [1024]  # the refused texts never reached the tokenizer


async def test_tokenize_runs_off_the_queue_of_the_forward_passes(models, monkeypatch) -> None:
    """With one engine worker (as --no-batching), a Score/Verify of another session completes while
    a long Tokenize is still running."""
    engine = VerifierEngine(models["word"])
    tokenizer = engine.loaded.tokenizer
    entered, release = threading.Event(), threading.Event()
    real_encode = tokenizer.encode

    def slow_encode(text, **kwargs):
        entered.set()
        release.wait(60.0)  # bounded: a broken test still ends
        return real_encode(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    server, port = await start_verifier_server(engine, max_workers=1)
    try:
        async with GrpcVerifierClient(f"127.0.0.1:{port}", timeout_s=60) as client:
            tokenize = asyncio.ensure_future(client.tokenize("t1 t2 t3"))
            assert await asyncio.to_thread(entered.wait, 30.0), "Tokenize never started"
            sampling = SamplingParams()
            score = ScoreRequest("other", 0, [1, 2, 3], [4], [-1], sampling)
            await asyncio.wait_for(client.score(score), 20.0)
            verify = VerifyRequest("other", 0, [1, 2, 3], [4], [-1], "ersd", MethodParams(seed=1), sampling)
            outcome = await asyncio.wait_for(client.verify(verify), 20.0)
            assert outcome.tokens and not tokenize.done()
            release.set()
            assert await asyncio.wait_for(tokenize, 20.0) == [1, 2, 3]
    finally:
        release.set()
        await stop_server(server, 0.5)
