"""How engines batch forward passes across sessions (specdec.runtime.batching does it).

Kept apart from the batcher so the CLI can read the defaults without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BATCH_TOKENS = 512
DEFAULT_BATCH_WINDOW_MS = 10.0
# ... or this share of a recent batched pass's time, where that is longer (ForwardBatcher.window_seconds).
DEFAULT_BATCH_WINDOW_SHARE = 0.1
# While other sessions decode, a prompt's prefill chunk adds at most this share of a decode pass's time
# to the pass it joins (ForwardBatcher.prefill_chunk_tokens); 0: whole chunks always. 2 since the
# decode pass is timed without the prompt tails that ride with drafts: at 1 and 0.7 prompts under
# load crawled at ~25 rows a pass (8 clients: TTFT p50 19.5 s against 3.2-3.7 s at 2; bench/RESULTS.md,
# "One chunk of 512").
DEFAULT_PREFILL_CHUNK_SHARE = 2.0
MAX_PREFILL_CHUNK_SHARE = 16.0
# The KV pool of captured passes on CUDA (specdec.runtime.kv_pool): sessions held, entries each.
DEFAULT_POOL_SLOTS = 8
DEFAULT_SLOT_TOKENS = 4096
# Engine calls that may run at once in a batching engine's worker pool (each waits for its pass).
BATCHING_WORKERS = 64
# How a batched pass lays out its calls' new entries (specdec.runtime.batching).
BATCH_LAYOUTS = ("ragged", "padded")
DEFAULT_BATCH_LAYOUT = "ragged"


@dataclass(frozen=True)
class BatchConfig:
    """How an engine batches the forward passes of concurrent calls from different sessions.

    enabled: False runs every pass on its own, one engine call at a time (the pre-batching engine).
    max_batch_tokens: at most this many query rows in one pass (padding included); a call that
    alone exceeds it runs alone. window_ms: how long a pass that could take more work waits for
    calls still on their way: calls holding a session, and the sessions of the last two passes that
    have not queued again (specdec.runtime.batching); window_share: or this share of a recent pass's
    time, where that is longer (0: window_ms alone). prefill_chunk_share: while other sessions
    decode, a prompt's prefill chunk is cut so that it adds at most this share of a decode pass's
    measured time to the pass it joins (0: whole chunks). layout: "ragged" lays the calls' new entries
    end to end (no padding) and lets a prompt's prefill chunks join other sessions' passes, where
    the model's attention allows (specdec.runtime.ragged); "padded" pads every call to the widest
    and prefills each chunk in a pass of its own (the layout before ragged passes).
    """

    enabled: bool = True
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    window_ms: float = DEFAULT_BATCH_WINDOW_MS
    layout: str = DEFAULT_BATCH_LAYOUT
    window_share: float = DEFAULT_BATCH_WINDOW_SHARE
    prefill_chunk_share: float = DEFAULT_PREFILL_CHUNK_SHARE

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if not 0 <= self.window_ms <= 1000:
            raise ValueError(f"window_ms must lie in [0, 1000], got {self.window_ms}")
        if not 0 <= self.window_share <= 1:
            raise ValueError(f"window_share must lie in [0, 1], got {self.window_share}")
        if not 0 <= self.prefill_chunk_share <= MAX_PREFILL_CHUNK_SHARE:
            raise ValueError(f"prefill_chunk_share must lie in [0, {MAX_PREFILL_CHUNK_SHARE:g}], "
                             f"got {self.prefill_chunk_share}")
        if self.layout not in BATCH_LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(BATCH_LAYOUTS)}, got {self.layout!r}")

    @property
    def workers(self) -> int:
        """Threads the engine's server should run calls in (1 = calls one at a time)."""
        return BATCHING_WORKERS if self.enabled else 1
