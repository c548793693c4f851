"""Verify's text over gRPC: a real verifier engine (tiny random model, byte-level BPE) behind a
server answers the same tokens, pieces, tails and cursors as the engine called in-process, and the
text put together is the one-shot decode of the output."""

from __future__ import annotations

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from orchestrator.clients.grpc_client import GrpcVerifierClient  # noqa: E402
from orchestrator.clients.inprocess import InProcessVerifierClient  # noqa: E402
from specdec.engine.api import TextCursor, VerifyRequest  # noqa: E402
from specdec.engine.verifier import VerifierEngine  # noqa: E402
from specdec.rpc.grpc_support import stop_server  # noqa: E402
from specdec.runtime.loading import load_model  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.trees import sequence_parents  # noqa: E402
from specdec.verification.base import MethodParams  # noqa: E402
from tests.bpe_helpers import save_byte_level_model  # noqa: E402
from verifier_service.server import start_verifier_server  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> VerifierEngine:
    directory = save_byte_level_model(tmp_path_factory.mktemp("bpe-grpc") / "model", max_context=128)
    return VerifierEngine(load_model(directory, threads=1))


async def run(client, session: str, prompt: list[int], vocab: int, k: int = 3) -> list[tuple]:
    """Verifies of random drafts until 60 output tokens, each carrying the last cursor."""
    rng, committed, told = random.Random(7), list(prompt), 0
    cursor, seen = TextCursor(len(prompt), len(prompt), len(prompt)), []
    while len(committed) - len(prompt) < 60:
        draft = [rng.randrange(vocab) for _ in range(k)]
        out = await client.verify(VerifyRequest(
            session, told, committed[told:], draft, sequence_parents(k), "token", MethodParams(seed=3),
            SamplingParams(temperature=1.0), draft_probs=torch.full((k + 1, vocab), 1.0 / vocab),
            text=cursor))
        seen.append((out.tokens, out.text_pieces, out.text_tails, out.text_cursor))
        committed += out.tokens
        told, cursor = len(committed), out.text_cursor
    return seen


async def test_text_over_grpc_equals_in_process(engine) -> None:
    tokenizer, vocab = engine.loaded.tokenizer, engine.info().vocab_size
    prompt = tokenizer.encode("Q: 東京?", add_special_tokens=False)
    server, port = await start_verifier_server(engine)
    client = GrpcVerifierClient(f"127.0.0.1:{port}", timeout_s=30)
    try:
        remote = await run(client, "remote", prompt, vocab)
    finally:
        await client.close()
        await stop_server(server, 0.5)
    local = await run(InProcessVerifierClient(engine), "local", prompt, vocab)
    assert remote == local
    output = [t for tokens, *_ in remote for t in tokens]
    text = "".join(piece for _, pieces, _, _ in remote for piece in pieces) + remote[-1][2][-1]
    assert text == tokenizer.decode(output, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert all(isinstance(cursor, TextCursor) for *_, cursor in remote)
