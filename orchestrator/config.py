"""Orchestrator settings (environment variables with the SPECDEC_ prefix, e.g. SPECDEC_DEFAULT_K=6).

Everything here is a default or a limit; a request may override method, k, tree budget and a.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from specdec.defaults import (
    DEFAULT_A,
    DEFAULT_DRAFT_SOURCE,
    DEFAULT_K,
    DEFAULT_METHOD,
    DEFAULT_PIPELINE,
    DEFAULT_TREE_BUDGET,
    DRAFT_SOURCES,
)
from specdec.engine.api import MAX_LOOKAHEAD_K, MAX_TREE_NODES
from specdec.methods import METHOD_NAMES

DraftRowsMode = Literal["lean", "parked", "full"]
DRAFT_ROWS_MODES: tuple[str, ...] = get_args(DraftRowsMode)


class OrchestratorConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_", extra="ignore")

    # The values live in specdec.defaults (the CLI states them in its help without pydantic).
    default_method: str = DEFAULT_METHOD
    # Draft length of sequence methods (token, block, ersd) and RD's k_max when a request gives no k
    # (and no calibration of the pair sets it). 2: the analyser's best k for the default int8 pair on
    # both development CPUs, and measured faster than 4 through `specdec up` (7.8 vs 5.8 tok/s,
    # bench/RESULTS.md "Where an iteration's time goes"; issue 15's table: 0.97x vs 0.72x plain HF).
    default_k: int = Field(DEFAULT_K, ge=1)
    # Node budget of gsd-tree when a request gives neither tree_budget nor k.
    default_tree_budget: int = Field(DEFAULT_TREE_BUDGET, ge=1)
    # ERSD drafts a tree of this many nodes when set (and the request gives no tree_budget);
    # None keeps ERSD on a sequence of k tokens.
    ersd_tree_budget: int | None = Field(None, ge=1)
    default_a: float = Field(DEFAULT_A, ge=0.0, le=1.0)
    # 0th-order acceptance model R(j) of the j-th ranked child (docs/algorithms.md §6) for tree shapes.
    rank_acceptance: list[float] = Field(default_factory=lambda: [0.6, 0.2, 0.1, 0.05])
    # Shape trees from the measured rank acceptance of the model pair once this many decisions
    # per rank were recorded (0 = never; seeded requests then replay exactly across deployments).
    calibration_min_samples: int = Field(0, ge=0)
    # Take k, tree budget, a and rank acceptance from `specdec analyze --save` for this model pair
    # (fields set explicitly, by argument or SPECDEC_* variable, always win).
    use_calibration: bool = True

    # Where drafts come from when a request names no draft_source (orchestrator.drafting, DRAFT_SOURCES).
    # "hybrid": per iteration a model-free draft when its expected gain pays for its verify rows, else
    # the draft model, else a target-only step; with no drafter (`up --drafter none`) model-free or
    # target-only. "model" / "lookup" / "suffix": that source alone.
    draft_source: str = DEFAULT_DRAFT_SOURCE
    # lookup: n-grams of the request's own prompt and output, longest first from max to min size; a
    # draft copies at most lookup_max_tokens tokens that followed the most recent match.
    lookup_min_ngram: int = Field(1, ge=1, le=16)
    lookup_max_ngram: int = Field(4, ge=1, le=16)
    lookup_max_tokens: int = Field(10, ge=1, le=MAX_LOOKAHEAD_K)
    # suffix: the request's tokens plus a cache of recent requests' prompts and outputs, shared by the
    # requests of this orchestrator process (per replica) with the same caller and cache_salt (the
    # prefix caches' partition), bounded by requests and tokens per partition (oldest evicted first),
    # at most suffix_cache_partitions partitions (the least recently used one dropped first). A draft
    # is a tree of at most suffix_max_nodes nodes.
    suffix_cache_requests: int = Field(256, ge=0)
    suffix_cache_tokens: int = Field(262_144, ge=0)
    suffix_cache_partitions: int = Field(16, ge=1)
    suffix_max_nodes: int = Field(16, ge=1, le=MAX_TREE_NODES)
    # The hybrid (timed requests) lets those two caps grow up to this many nodes while the measured
    # verifier pass of such a draft costs at most two target-only steps (adaptation.DRAFT_COST_STEPS):
    # cheap wide passes (AMX, a GPU) draft longer, expensive ones keep the caps. 0 keeps the caps.
    model_free_max_nodes: int = Field(64, ge=0, le=MAX_TREE_NODES)
    # A served orchestrator (`specdec serve orchestrator`, `up`) first generates this many tokens of a
    # private warm-up request once its engines answer, so that the first user's request finds the
    # pass and call times measured (Orchestrator.warm_up; 0: none). Out of metrics, traces and the
    # caches users share; its acceptance is forgotten, its timings kept.
    warm_up_tokens: int = Field(24, ge=0, le=1024)

    # Pipelined speculation (orchestrator.drafting.model): while the verifier checks a
    # block, the drafter already drafts the next one from the prefix that full acceptance would
    # give. Sequence methods only (token, block, ersd without a tree; rd when K = k_max). A
    # request may override it (GenerationRequest.pipeline). On by default: drafter and verifier
    # have their own devices/cores, so the drafter's look-ahead costs at most the tail of one
    # drafter call when it is dropped; on the default pair it measured faster than sequential
    # speculation for every method (bench/RESULTS.md).
    pipeline: bool = DEFAULT_PIPELINE
    # Pipelined token/ersd: a pre-drafted block keeps growing until the verifier answers, up to
    # this many tokens (0 = pre-drafts have the draft length k). A fresh draft (after a rejection)
    # still has length k. Block and rd ignore it (growth would not be exact for them: methods'
    # `adaptive_length`, orchestrator.drafting.model). Request override: GenerationRequest.pipeline_max_k.
    pipeline_max_k: int = Field(0, ge=0)
    # Pipelined look-ahead guesses (one drafter call drafts after each; the verifier's answer
    # picks at most one): the likeliest bonus tokens after the block, and the likeliest
    # replacements of its last token should the verifier reject it (not for rd). More guesses,
    # more pre-drafts come true, but each guess adds a node to every drafter pass of the
    # look-ahead. None (auto): 2 bonus guesses for one-token blocks (the look-ahead is two
    # drafter passes and the second guess costs little), 1 for longer blocks (extra guesses made
    # the drafter, not the verifier, the bottleneck on the default pair: bench/RESULTS.md).
    # Request overrides: GenerationRequest.pipeline_bonus_guesses / pipeline_rejection_guesses.
    pipeline_bonus_guesses: int | None = Field(None, ge=1, le=16)
    pipeline_rejection_guesses: int = Field(0, ge=0, le=16)

    # Online draft length (orchestrator.adaptation): requests that name neither k nor a seed get the
    # k, down to 0 (target-only steps), that the measured acceptance and call times of this model
    # pair say is fastest, re-picked as they run; default_k is where it starts. Sequence methods
    # (token, block, ersd without a tree). Seeded requests keep default_k so they replay exactly.
    adaptive_k: bool = True
    # Pre-drafted only (orchestrator.drafting.model, pre-drafted only): an adaptive pipelined request
    # verifies a draft only when its look-ahead's pre-draft came true; otherwise the iteration is a
    # target-only step while the drafter looks ahead from the new prefix, so no iteration waits for
    # a fresh draft (on the default int8 pair one costs ~1.7 target steps; bench/RESULTS.md). False:
    # draft afresh after a miss, as requests with a fixed k do.
    predrafted_only: bool = True
    # Hybrid drafting (`up`'s default source): the draft model drafts only while at most this many
    # requests run at once; beyond, the hybrid's iterations are model-free or target-only. Where the
    # drafter shares the verifier's cores (`up` on one machine) its passes beside a busy verifier cost
    # the verifier more than they save (bench/RESULTS.md, "Draft model under load"); vLLM's
    # --speculative-disable-by-batch-size is the same knob. 0: no limit. Seeded requests (replay)
    # never look at it.
    draft_model_max_requests: int = Field(0, ge=0)
    # A chat request that ends with no other request running passes its turn's close (the answer's
    # last token and the chat template's end of the turn) through the target before its session is
    # released, so the next turn's first pass computes only the new message (orchestrator.turn_close).
    close_chat_turns: bool = True
    # A target-only request (method autoregressive) running alone asks the verifier to score its next
    # step ahead (VerifyRequest.score_ahead): the next pass starts while the outcome and the next call
    # travel, instead of after (bench/RESULTS.md, "Scoring ahead").
    score_ahead: bool = True
    # At k = 0, a speculative iteration after this many target-only steps of the pair (all requests)
    # checks whether drafting pays again (each probe costs the drafter's catch-up over the context).
    adaptive_probe_every: int = Field(64, ge=1)

    # Limits of a request, checked before any work on it (INVALID_ARGUMENT naming the field and the
    # limit). max_k and max_tree_budget stay within the engines' own caps (specdec.engine.api).
    max_k: int = Field(16, ge=1, le=MAX_LOOKAHEAD_K)
    max_tree_budget: int = Field(64, ge=1, le=MAX_TREE_NODES)
    max_new_tokens_limit: int = Field(4096, ge=1)
    # A text prompt of more UTF-8 bytes is refused before the verifier tokenizes it. 2 MiB is about
    # 500k tokens of ordinary text (~4 bytes a token), 16x the default pair's 32k-token window, and
    # tokenizes in about 2 s on one core; raise it for a model with a longer window.
    max_prompt_bytes: int = Field(2 * 2**20, ge=1)
    # request_id: printable ASCII without spaces (it names the stored record), at most this long.
    max_request_id_chars: int = Field(128, ge=1)
    # Stop strings (every iteration matches each against the text's tail) and stop token ids.
    max_stop_strings: int = Field(16, ge=0)
    max_stop_chars: int = Field(256, ge=1)
    max_stop_token_ids: int = Field(256, ge=0)
    # A chat (GenerationRequest.messages): at most this many turns; their contents count against
    # max_prompt_bytes together, as one prompt text would.
    max_chat_messages: int = Field(1024, ge=1)
    # A Jinja chat template (the text of --chat-template FILE) used instead of the target
    # tokenizer's own; None: the tokenizer's (a model without one refuses chats).
    chat_template: str | None = None

    # Admission: at most this many requests run at once (each holds a KV session in both engines);
    # later ones wait in arrival order for a slot, up to queue_timeout_s, then fail with Overloaded
    # (RESOURCE_EXHAUSTED): a bounded queue instead of every request slowing down, or the engines
    # evicting each other's sessions, under a burst.
    max_active_requests: int = Field(64, ge=1)
    queue_timeout_s: float = Field(60.0, ge=0.0)
    # A caller (its token or certificate, else its address) may have at most this many requests open at
    # once, queued and paused ones included; more are refused at once with Overloaded (RESOURCE_EXHAUSTED,
    # HTTP 429). 0: no cap, the default, since anonymous clients behind one address (loopback, a proxy,
    # a NAT) would share one cap; set it where callers have tokens or certificates.
    max_requests_per_caller: int = Field(0, ge=0)
    # Streamed responses (gRPC GenerateStream/ResumeStream, HTTP SSE): a run whose reader has not
    # taken its last chunk pauses between iterations and hands its request slot on (admission.paced);
    # a reader that takes nothing, or a write to it that does not complete, for this many seconds gets
    # its stream closed, its run freed (lease, sessions) and resumable. 0: never closed for idleness
    # (paused streams still give their slots back).
    stream_idle_timeout_s: float = Field(30.0, ge=0.0)

    # After the drafter was unreachable, run target-only steps and retry it this often.
    drafter_retry_seconds: float = Field(1.0, ge=0.0)
    # None: in-memory store; "redis://host:port/db": Redis.
    store_url: str | None = None
    # A request's record (what Resume continues) is kept this long after its last progress, by both
    # stores (the in-memory one also keeps at most orchestrator.store.MAX_MEMORY_REQUESTS records).
    request_ttl_seconds: int = Field(86400, ge=1)
    # A running request's record is leased to its run for this long after every write of progress
    # (each iteration); Resume refuses it meanwhile (StillRunning → ABORTED), so two runs never
    # write one record. A record left by a dead orchestrator can be resumed once the lease runs out;
    # one whose run was closed (client gone) at once. Keep it well above an iteration's duration.
    resume_lease_seconds: float = Field(10.0, gt=0.0)
    # Each store (Redis) operation as a whole, connecting included: a hung Redis fails a call after
    # this long (UNAVAILABLE) instead of stalling it (docs/reliability.md "When Redis hangs").
    store_timeout_s: float = Field(2.0, gt=0.0)
    # A running request whose saves fail generates on, its chunks held back until a save succeeds;
    # after this long without one it stops UNAVAILABLE, resumable from its last saved progress.
    store_outage_grace_s: float = Field(30.0, ge=0.0)

    # How Verify carries the draft rows (docs/algorithms.md §12). "lean": for the methods whose rule
    # reads whole rows only on a rejection (token, rd, gsd-tree; the registry's `lean_rows`), each
    # node's q(x̃) alone, and a row only when the verifier asks for it (one more round trip on a
    # rejection) — instead of k + 1 rows of V float32 every iteration. Same tokens for a seeded
    # request either way. "parked": lean, and the drafter keeps the rows too (it sends q(x̃) alone and
    # the orchestrator fetches a row from it on a rejection): no rows cross the network at all on an
    # iteration without one, but a drafter restart between a draft and its verify's rejection fails
    # that request (the rows are gone and the rule cannot be redone without them). "full": every
    # row, every time.
    draft_rows: DraftRowsMode = "lean"

    # Faults and health (docs/reliability.md, "Faults and health"). The health monitor of a served
    # orchestrator checks the verifier, the drafter and the store this often (orchestrator.health).
    health_interval_s: float = Field(1.0, gt=0.0)
    # A drafter call (draft, look-ahead) is abandoned after max(floor, multiple × its expected time)
    # (measured: adaptation.DrafterCallTimes), and that iteration falls back to a target-only step.
    # The floor keeps tiny models on a busy machine from tripping it.
    drafter_timeout_multiple: float = Field(4.0, ge=1.0)
    drafter_timeout_floor_s: float = Field(1.0, gt=0.0)

    @field_validator("default_method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        if value not in METHOD_NAMES:
            raise ValueError(f"default_method must be one of {', '.join(METHOD_NAMES)}, got {value!r}")
        return value

    @field_validator("draft_source")
    @classmethod
    def _known_source(cls, value: str) -> str:
        if value not in DRAFT_SOURCES:
            raise ValueError(f"draft_source must be one of {', '.join(DRAFT_SOURCES)}, got {value!r}")
        return value

    @field_validator("rank_acceptance")
    @classmethod
    def _rates(cls, value: list[float]) -> list[float]:
        if not value or any(not 0.0 <= r <= 1.0 for r in value):
            raise ValueError("rank_acceptance must be a non-empty list of probabilities in [0, 1]")
        return value
