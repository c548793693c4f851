"""In-process transport: the client protocols served by engines living in this process.

Every engine call runs in a worker thread (`asyncio.to_thread`), so the drafter's and the
verifier's forward passes overlap exactly as they would on two machines (torch releases the
GIL in its kernels). The engines are thread-safe (a lock per session and per model), so
nothing is serialised here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from specdec.engine.api import (
    DraftRequest,
    DraftResult,
    LookaheadRequest,
    LookaheadResult,
    ModelInfo,
    ScoreRequest,
    VerifyOutcome,
    VerifyRequest,
)
from specdec.generation import ChatMessage


class _InProcessClient:
    def __init__(self, engine: Any, address: str) -> None:
        self.engine = engine
        self.address = address

    async def _call(self, method: str, *args: Any) -> Any:
        return await asyncio.to_thread(getattr(self.engine, method), *args)

    async def info(self) -> ModelInfo:
        return await self._call("info")

    async def release(self, session_id: str) -> None:
        await self._call("release", session_id)

    async def close(self) -> None:
        return None


class InProcessDrafterClient(_InProcessClient):
    def __init__(self, engine: Any, address: str = "inprocess:drafter") -> None:
        super().__init__(engine, address)

    async def draft(self, request: DraftRequest) -> DraftResult:
        return await self._call("draft", request)

    async def lookahead(self, request: LookaheadRequest) -> LookaheadResult:
        return await self._call("lookahead", request)


class InProcessVerifierClient(_InProcessClient):
    def __init__(self, engine: Any, address: str = "inprocess:verifier") -> None:
        super().__init__(engine, address)

    async def score(self, request: ScoreRequest) -> None:
        await self._call("score", request)

    async def verify(self, request: VerifyRequest) -> VerifyOutcome:
        return await self._call("verify", request)

    async def tokenize(self, text: str) -> list[int]:
        return await self._call("tokenize", text)

    async def apply_chat_template(self, messages: list[ChatMessage], chat_template: str | None = None,
                                  ) -> list[int]:
        return await self._call("apply_chat_template", messages, chat_template)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._call("decode", token_ids)
