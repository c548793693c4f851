"""Minimal fake engines and orchestrator for the transport tests (no models).

The session id of a request picks a behaviour, so one fake covers every error class.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import torch

from specdec.engine.api import (
    DraftRequest,
    DraftResult,
    ModelInfo,
    ScoreRequest,
    VerifyOutcome,
    VerifyRequest,
)
from specdec.errors import ContextTooLong, EngineError, InvalidRequest, PeerUnavailable, SessionGone
from specdec.generation import GenerationChunk, GenerationRequest, GenerationResult, GenerationStats
from specdec.rpc.security import ANONYMOUS
from specdec.sampling import SamplingParamsError
from specdec.verification.base import VerificationError

VOCAB = 6
SECRET = "secret-internal-detail"

# behaviour → exception raised by the engine
ERRORS: dict[str, BaseException] = {
    "invalid": InvalidRequest("shape_parents: parent 3 of node 1 is not an earlier node"),
    "context": ContextTooLong("append: context of 300 tokens exceeds max_context 128"),
    "sampling": SamplingParamsError("top_p must lie in (0, 1], got 2.0"),
    "verification": VerificationError("draft distributions are required by this method"),
    "value": ValueError("tree_tokens: token 9 is outside the vocabulary (6)"),
    "gone": SessionGone("session 'gone' is unknown; resend the context"),
    "engine": EngineError("kv cache in an unexpected state"),
    "crash": RuntimeError(f"{SECRET} at /srv/model.py line 12"),
}


class Behaviours:
    def __init__(self) -> None:
        self.release_event = threading.Event()  # lets a "slow" call finish early
        self.calls: list[tuple[str, object]] = []

    def act(self, session_id: str) -> None:
        if session_id in ERRORS:
            raise ERRORS[session_id]
        if session_id == "slow":
            self.release_event.wait(5.0)


class FakeDrafter(Behaviours):
    def __init__(self, big_rows: int = 0) -> None:
        super().__init__()
        self.big_rows = big_rows

    def info(self) -> ModelInfo:
        return ModelInfo("fake-draft", VOCAB, "fp-1", 128, (VOCAB - 1,))

    def draft(self, request: DraftRequest) -> DraftResult:
        self.calls.append(("draft", request))
        self.act(request.session_id)
        n = len(request.shape_parents)
        if request.session_id == "big":
            probs = torch.rand(self.big_rows, 1000)
        elif request.want_distributions:
            probs = torch.softmax(torch.arange(float((n + 1) * VOCAB)).reshape(n + 1, VOCAB) / 7, dim=-1)
        else:
            probs = None
        return DraftResult(
            tokens=[(i + 1) % VOCAB for i in range(n)],
            parents=list(request.shape_parents),
            draft_probs=probs,
            forward_seconds=0.25,
            reused_tokens=request.base_len,
        )

    def release(self, session_id: str) -> bool:
        self.calls.append(("release", session_id))
        self.act(session_id)
        return True


class FakeVerifier(Behaviours):
    def info(self) -> ModelInfo:
        return ModelInfo("fake-target", VOCAB, "fp-1", 128, (VOCAB - 1,), "cpu", "float32")

    def score(self, request: ScoreRequest) -> None:
        self.calls.append(("score", request))
        self.act(request.session_id)

    def verify(self, request: VerifyRequest) -> VerifyOutcome:
        self.calls.append(("verify", request))
        self.act(request.session_id)
        n = len(request.tree_tokens)
        return VerifyOutcome(
            tokens=[*request.tree_tokens, 1],
            accepted_nodes=list(range(n)),
            accept_flags=[True] * n,
            num_drafted=n,
            committed_len=request.base_len + len(request.append) + n + 1,
            forward_seconds=0.5,
            verify_seconds=0.125,
            reused_tokens=3,
            pass_calls=2, pass_rows=9, pending_tokens=1, score_reused=True, text_fallbacks=3,
        )

    def tokenize(self, text: str) -> list[int]:
        self.calls.append(("tokenize", text))
        self.act(text)
        return [int(word[1:]) for word in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        self.calls.append(("decode", token_ids))
        return " ".join(f"t{i}" for i in token_ids)

    def release(self, session_id: str) -> bool:
        self.calls.append(("release", session_id))
        self.act(session_id)
        return True


class FakeOrchestrator:
    """generate/generate_stream shaped like orchestrator.speculation's; the prompt picks a behaviour."""

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []
        self.owners: list[str] = []  # the caller identity of each call (specdec.rpc.security)
        self.callers: list[str | None] = []  # the per-caller cap's key each call was given
        self.stream_closed = asyncio.Event()

    def _result(self, request: GenerationRequest) -> GenerationResult:
        ids = list(request.prompt_ids or [])[: request.max_new_tokens]
        stats = GenerationStats(
            iterations=2,
            drafted_tokens=4,
            accepted_tokens=3,
            new_tokens=len(ids),
            seconds=0.5,
            accepted_per_position=[2, 1],
            drafted_per_position=[2, 2],
        )
        return GenerationResult(
            request.request_id or "r-1",
            ids,
            " ".join(f"t{i}" for i in ids),
            "length",
            request.seed if request.seed is not None else 7,
            request.method or "token",  # what the real one runs by default
            stats,
        )

    def _check(self, request: GenerationRequest) -> None:
        self.requests.append(request)
        if request.prompt == "unavailable":
            raise PeerUnavailable("127.0.0.1:1 unavailable: verifier down")
        if request.prompt == "invalid":
            raise InvalidRequest("max_new_tokens must be >= 1")
        if request.prompt == "crash":
            raise RuntimeError(SECRET)

    async def generate(self, request: GenerationRequest, *, owner: str = ANONYMOUS,
                       caller: str | None = None) -> GenerationResult:
        self.owners.append(owner)
        self.callers.append(caller)
        self._check(request)
        await asyncio.sleep(0)
        return self._result(request)

    async def generate_stream(self, request: GenerationRequest, *, owner: str = ANONYMOUS,
                              caller: str | None = None):
        self.owners.append(owner)
        self.callers.append(caller)
        self._check(request)
        try:
            result = self._result(request)
            for i, token in enumerate(result.token_ids):
                if request.prompt == "midstream" and i == 1:
                    raise SessionGone("verifier lost the session twice")
                if request.prompt == "endless":
                    await asyncio.sleep(0.01)
                yield GenerationChunk([token], f"t{token}")
            while request.prompt == "endless":
                await asyncio.sleep(0.01)
                yield GenerationChunk([0], "t0")
            yield GenerationChunk([], "", replace(result))
        finally:
            self.stream_closed.set()
