"""gRPC transport of the engine client protocols (orchestrator.clients.base).

Each client is a specdec.rpc.channel.GrpcClient (deadlines on every call, fail fast when the peer is
down, status codes mapped back to the exceptions the in-process transport raises, TLS / token from a
ClientSecurity). The client of the orchestrator's GenerationService is specdec.client.AsyncClient.
"""

from __future__ import annotations

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
from specdec.rpc import convert, generation_convert
from specdec.rpc.channel import GrpcClient
from specdec.rpc.channel import encode_request as _encode
from specdec.rpc.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc


class GrpcDrafterClient(GrpcClient):
    """DrafterClient over gRPC."""

    _stub_class = drafter_pb2_grpc.DrafterServiceStub
    _service_name = "specdec.v1.DrafterService"
    _role = "drafter"

    async def info(self) -> ModelInfo:
        return convert.model_info_from_proto(await self._unary("Info", common_pb2.InfoRequest()))

    async def draft(self, request: DraftRequest) -> DraftResult:
        msg = _encode(convert.draft_request_to_proto, request)
        return convert.draft_result_from_proto(await self._unary("Draft", msg))

    async def lookahead(self, request: LookaheadRequest) -> LookaheadResult:
        msg = _encode(convert.lookahead_request_to_proto, request)
        return convert.lookahead_result_from_proto(await self._unary("Lookahead", msg))

    async def draft_rows(self, request: DraftRowsRequest) -> torch.Tensor:
        msg = _encode(convert.draft_rows_request_to_proto, request)
        return convert.tensor_from_proto(await self._unary("DraftRows", msg), "rows")

    async def release(self, session_id: str) -> None:
        await self._unary("Release", common_pb2.ReleaseRequest(session_id=session_id))


class GrpcVerifierClient(GrpcClient):
    """VerifierClient over gRPC."""

    _stub_class = verifier_pb2_grpc.VerifierServiceStub
    _service_name = "specdec.v1.VerifierService"
    _role = "verifier"

    async def info(self) -> ModelInfo:
        return convert.model_info_from_proto(await self._unary("Info", common_pb2.InfoRequest()))

    async def score(self, request: ScoreRequest) -> None:
        await self._unary("Score", _encode(convert.score_request_to_proto, request))

    async def verify(self, request: VerifyRequest) -> VerifyOutcome:
        msg = _encode(convert.verify_request_to_proto, request)
        return convert.verify_outcome_from_proto(await self._unary("Verify", msg))

    async def tokenize(self, text: str) -> list[int]:
        response = await self._unary("Tokenize", verifier_pb2.TokenizeRequest(text=text))
        return list(response.token_ids)

    async def apply_chat_template(self, messages: list[ChatMessage], chat_template: str | None = None,
                                  ) -> list[int]:
        msg = _encode(lambda chat: verifier_pb2.ChatTemplateRequest(
            messages=generation_convert.chat_messages_to_proto(chat), chat_template=chat_template), messages)
        return list((await self._unary("ApplyChatTemplate", msg)).token_ids)

    async def decode(self, token_ids: list[int]) -> str:
        msg = _encode(lambda ids: verifier_pb2.DecodeRequest(token_ids=[int(i) for i in ids]), token_ids)
        return (await self._unary("Decode", msg)).text

    async def release(self, session_id: str) -> None:
        await self._unary("Release", common_pb2.ReleaseRequest(session_id=session_id))
