"""What both engines are made of: a loaded model, the batcher that runs every session's passes, the
sessions' caches (growing buffers, or slots of a CUDA pool), the prefix cache and the session store.
The drafter and the verifier add their calls on top (specdec.engine.drafter, .verifier).

The calls that touch tensors (verify, score, draft, draft_rows, lookahead, release) run in torch's
inference mode, as the passes do (specdec.runtime.batching): torch then skips its autograd and
view-tracking dispatch on each op of the call's own work (warping rows, the verification rule, the
cache's bookkeeping)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from specdec.engine.api import ModelInfo
from specdec.engine.sessions import SessionConfig, SessionStore
from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import ForwardBatcher, ThreadWidths
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.kv_pool import KVPool, PoolConfig, engine_pool, new_session_cache, renew_session_cache
from specdec.runtime.loading import LoadedModel
from specdec.runtime.prefix_cache import PrefixStore

S = TypeVar("S")


class EngineCore(Generic[S]):
    """The model, its batcher, caches and sessions; `make_session` wraps a fresh cache in the
    engine's session type."""

    def __init__(self, loaded: LoadedModel, make_session: Callable[[TreeKVCache], S], *,
                 sessions: SessionConfig | None = None, clock=time.monotonic,
                 batching: BatchConfig | None = None, threads: ThreadWidths | None = None,
                 kv_pool: PoolConfig | None = None, prefix_cache: PrefixStore | None = None) -> None:
        self.loaded = loaded
        self.prefix_cache = prefix_cache
        self.batching = batching or BatchConfig()
        # Runs every session's passes; concurrent calls from different sessions share them.
        self._batcher = ForwardBatcher(loaded.model, self.batching, threads=threads, compute=loaded.compute)
        self.pool: KVPool | None = engine_pool(loaded.model, kv_pool, self._batcher.compute)
        self._make_session = make_session
        self.sessions: SessionStore[S] = SessionStore(
            self._new_session, sessions, clock, size_of=lambda session: session.kv.physical_len())

    def _new_session(self) -> S:
        # The batcher runs one pass at a time on the model (no lock needed besides).
        return self._make_session(self._new_cache())

    def _replace_cache(self, old: TreeKVCache) -> TreeKVCache:
        return renew_session_cache(old, self.loaded.model, self.pool, self._batcher)

    def _new_cache(self) -> TreeKVCache:
        return new_session_cache(self.loaded.model, self.pool, self._batcher, self.prefix_cache)

    def info(self) -> ModelInfo:
        return self.loaded.info

    @torch.inference_mode()
    def release(self, session_id: str) -> bool:
        return self.sessions.release(session_id, None if self.prefix_cache is None else _store_tail)

    def stats(self) -> dict[str, int]:
        """Counters for metrics: the session store's (sessions, evictions, …), the batcher's, the
        prefix cache's and the engine's own (`_own_stats`)."""
        stats = {**self.sessions.stats(), **self._batcher.counters(), **self._own_stats()}
        if self.prefix_cache is not None:
            stats.update(self.prefix_cache.stats())
        return stats

    def _own_stats(self) -> dict[str, int]:
        return {}


def _store_tail(session) -> None:
    """A released session's last, partial block goes to the prefix cache: the next turn of its
    conversation resends these tokens (TreeKVCache.publish_tail)."""
    session.kv.publish_tail()
