"""One client interface, two transports (gRPC and in-process).

The orchestrator only ever talks to these protocols. The in-process transport calls the
engines directly (in worker threads, so drafter and verifier still run concurrently); the gRPC
transport sends the same requests over the wire. Errors surface as the engine exceptions of
specdec.engine.api (InvalidRequest, SessionGone, PeerUnavailable, …) on both transports.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specdec.engine.api import (
    DraftRequest,
    DraftResult,
    DraftRowsRequest,
    LookaheadRequest,
    LookaheadResult,
    ModelInfo,
    ScoreRequest,
    VerifyOutcome,
    VerifyRequest,
)
from specdec.generation import ChatMessage


class DrafterClient(Protocol):
    address: str

    async def info(self) -> ModelInfo: ...

    async def draft(self, request: DraftRequest) -> DraftResult: ...

    async def lookahead(self, request: LookaheadRequest) -> LookaheadResult: ...

    async def draft_rows(self, request: DraftRowsRequest) -> torch.Tensor: ...

    async def release(self, session_id: str) -> None: ...

    async def close(self) -> None: ...


class VerifierClient(Protocol):
    address: str

    async def info(self) -> ModelInfo: ...

    async def score(self, request: ScoreRequest) -> None: ...

    async def verify(self, request: VerifyRequest) -> VerifyOutcome: ...

    async def tokenize(self, text: str) -> list[int]:
        """Prompt text → ids with the target's tokenizer (the orchestrator holds no model files)."""
        ...

    async def apply_chat_template(self, messages: list[ChatMessage], chat_template: str | None = None,
                                  ) -> list[int]:
        """A chat → prompt ids with the target tokenizer's chat template (or `chat_template`)."""
        ...

    async def decode(self, token_ids: list[int]) -> str: ...

    async def release(self, session_id: str) -> None: ...

    async def close(self) -> None: ...
