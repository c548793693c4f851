"""gRPC adapter around a verifier engine: parse, call the engine off the loop, encode, map errors.

The engine (specdec.engine.verifier.VerifierEngine or anything with VerifierBackend's methods) is
synchronous; calls run in a worker pool so the event loop keeps serving health checks and
other sessions. Tokenize and Decode have a pool of their own: a long text never waits in front
of the forward passes of Score and Verify (with --no-batching their pool has one worker). An
ApplyChatTemplate with the caller's own template runs in a third pool (its render is bounded and
happens in a child process, specdec.runtime.chat_template), so a template that takes its full time
never holds a Tokenize or Decode thread. Errors map to status codes as documented in
specdec/rpc/grpc_support.py.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Protocol, Unpack

import grpc

from specdec.engine.api import ModelInfo, ScoreRequest, VerifyOutcome, VerifyRequest
from specdec.errors import Overloaded
from specdec.generation import ChatMessage
from specdec.rpc import convert, engine_service, generation_convert
from specdec.rpc.engine_service import EngineServerOptions, start_engine_service
from specdec.rpc.grpc_support import EngineServicer, add_on_stop, guarded, run_blocking, run_observed
from specdec.rpc.v1 import verifier_pb2, verifier_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name
# Threads of the Tokenize/Decode pool. The engine encodes one text at a time (its tokenizer lock):
# the second thread lets a Decode queue there rather than behind the engine's passes.
TEXT_WORKERS = 2
# Threads of the pool of ApplyChatTemplate calls that bring their own template (each waits on a child
# process for at most its render timeout), and how many such calls may be in flight before more are
# refused with RESOURCE_EXHAUSTED rather than queued without end.
TEMPLATE_WORKERS = 2
MAX_TEMPLATE_CALLS = 16


class VerifierBackend(Protocol):
    """What the VerifierService calls on its engine (specdec.engine.verifier.VerifierEngine), so that
    a stand-in engine in a test needs these and no more. Calls run in worker threads; an optional
    `batching.workers` sizes their pool (specdec.rpc.grpc_support.engine_workers)."""

    def info(self) -> ModelInfo: ...

    def release(self, session_id: str) -> bool: ...

    def score(self, request: ScoreRequest) -> None: ...

    def verify(self, request: VerifyRequest) -> VerifyOutcome: ...

    def tokenize(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[ChatMessage],
                            chat_template: str | None = None) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


# Refuses token ids beyond the context window or a `tree_tokens` over the verifier's cap.
check_counts = functools.partial(engine_service.check_counts, role="verifier", tree_field="tree_tokens")


class VerifierServicer(EngineServicer, verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, engine: VerifierBackend, executor: Executor | None = None,
                 observers: Sequence[Any] = (), text_executor: Executor | None = None,
                 template_executor: Executor | None = None) -> None:
        """`text_executor` runs Tokenize and Decode (default: `executor`, with the engine's passes);
        `template_executor` runs ApplyChatTemplate calls that bring a template (default: `text_executor`)."""
        super().__init__(engine, executor, observers)
        self.text_executor = text_executor if text_executor is not None else executor
        self.template_executor = template_executor if template_executor is not None else self.text_executor
        self._template_calls = 0  # in flight in template_executor (event-loop side: no lock needed)

    @guarded
    async def Score(self, request: verifier_pb2.ScoreRequest, context) -> verifier_pb2.ScoreResponse:
        check_counts(self.engine, "append", len(request.append), len(request.tree_tokens))
        req = convert.score_request_from_proto(request)
        await run_observed(self.executor, self.observers, "Score", req, self.engine.score, req)
        return verifier_pb2.ScoreResponse()

    @guarded
    async def Verify(self, request: verifier_pb2.VerifyRequest, context) -> verifier_pb2.VerifyOutcome:
        check_counts(self.engine, "append", len(request.append), len(request.tree_tokens))
        req = convert.verify_request_from_proto(request)
        outcome = await run_observed(self.executor, self.observers, "Verify", req, self.engine.verify, req)
        return convert.verify_outcome_to_proto(outcome)

    @guarded
    async def Tokenize(self, request: verifier_pb2.TokenizeRequest, context) -> verifier_pb2.TokenizeResponse:
        ids = await run_blocking(self.text_executor, self.engine.tokenize, request.text)
        return verifier_pb2.TokenizeResponse(token_ids=[int(i) for i in ids])

    @guarded
    async def ApplyChatTemplate(self, request: verifier_pb2.ChatTemplateRequest,
                                context) -> verifier_pb2.TokenizeResponse:
        check_counts(self.engine, "messages", len(request.messages))
        messages = generation_convert.chat_messages_from_proto(request.messages)
        template = request.chat_template if request.HasField("chat_template") else None
        if not template:
            ids = await run_blocking(self.text_executor, self.engine.apply_chat_template, messages, None)
            return verifier_pb2.TokenizeResponse(token_ids=[int(i) for i in ids])
        if self._template_calls >= MAX_TEMPLATE_CALLS:
            raise Overloaded(f"chat templates: {MAX_TEMPLATE_CALLS} calls with their own template are "
                             "already waiting to render; retry later")
        self._template_calls += 1
        try:
            ids = await run_blocking(self.template_executor, self.engine.apply_chat_template, messages,
                                     template)
        finally:
            self._template_calls -= 1
        return verifier_pb2.TokenizeResponse(token_ids=[int(i) for i in ids])

    @guarded
    async def Decode(self, request: verifier_pb2.DecodeRequest, context) -> verifier_pb2.DecodeResponse:
        check_counts(self.engine, "token_ids", len(request.token_ids))
        text = await run_blocking(self.text_executor, self.engine.decode, list(request.token_ids))
        return verifier_pb2.DecodeResponse(text=text)


async def start_verifier_server(
    engine: VerifierBackend, host: str = "127.0.0.1", port: int = 0, **options: Unpack[EngineServerOptions]
) -> tuple[grpc.aio.Server, int]:
    """Start a VerifierService (+ health, reflection) for `engine`; returns (server, bound port).

    The options (worker pool, message size, interceptors, observers, credentials) are the drafter's
    too: specdec.rpc.engine_service.start_engine_service says what each does. Tokenize and Decode
    run in a pool of their own (TEXT_WORKERS threads), ApplyChatTemplate calls with their own
    template in another (TEMPLATE_WORKERS threads).
    """
    text_executor = ThreadPoolExecutor(max_workers=TEXT_WORKERS, thread_name_prefix="verifier-text")
    template_executor = ThreadPoolExecutor(max_workers=TEMPLATE_WORKERS,
                                           thread_name_prefix="verifier-template")
    try:
        server, bound = await start_engine_service(
            engine,
            "verifier",
            lambda executor, observers: VerifierServicer(
                engine, executor, observers, text_executor, template_executor
            ),
            verifier_pb2_grpc.add_VerifierServiceServicer_to_server,
            SERVICE_NAME,
            host,
            port,
            **options,
        )
    except BaseException:
        text_executor.shutdown(wait=False)
        template_executor.shutdown(wait=False)
        raise
    add_on_stop(server, functools.partial(text_executor.shutdown, wait=False))
    add_on_stop(server, functools.partial(template_executor.shutdown, wait=False))
    return server, bound
