"""In-process transport: the client protocols served by engines living in this process.

Every engine call runs in a worker thread of the client's own pool, so the drafter's and the
verifier's forward passes overlap exactly as they would on two machines (torch releases the
GIL in its kernels). The engines are thread-safe (a lock per session and per model), so
nothing is serialised here. The workers run torch with one thread, as a served engine's gRPC
workers do: each engine's passes run on its model's ComputeThread, and a worker with more torch
threads would start an OpenMP team of its own (specdec.runtime.compute_thread).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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
from specdec.runtime.compute_thread import serial_torch

WORKERS = 8  # concurrent calls into one engine (the in-process CLI runs one request; tests a few)


class _InProcessClient:
    def __init__(self, engine: Any, address: str) -> None:
        self.engine = engine
        self.address = address
        self._workers = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix=address,
                                           initializer=serial_torch)

    async def _call(self, method: str, *args: Any) -> Any:
        call = functools.partial(getattr(self.engine, method), *args)
        return await asyncio.get_running_loop().run_in_executor(self._workers, call)

    async def info(self) -> ModelInfo:
        return await self._call("info")

    async def release(self, session_id: str) -> None:
        await self._call("release", session_id)

    async def close(self) -> None:
        self._workers.shutdown(wait=False)


class InProcessDrafterClient(_InProcessClient):
    def __init__(self, engine: Any, address: str = "inprocess:drafter") -> None:
        super().__init__(engine, address)

    async def draft(self, request: DraftRequest) -> DraftResult:
        return await self._call("draft", request)

    async def lookahead(self, request: LookaheadRequest) -> LookaheadResult:
        return await self._call("lookahead", request)

    async def draft_rows(self, request: DraftRowsRequest) -> torch.Tensor:
        return await self._call("draft_rows", request)


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
