"""Helpers shared by the orchestrator tests: fault-injecting client wrappers, plain-forward
references (no KV cache, no engine) to compare the real code path with, and the statistics of
the fidelity tests (exact enumeration of the target's law, chi-square p-values)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path

import torch

from orchestrator.config import OrchestratorConfig
from orchestrator.run import Run, new_run
from orchestrator.speculation import Orchestrator
from specdec.engine.api import ModelInfo
from specdec.errors import PeerUnavailable
from specdec.generation import GenerationRequest
from specdec.races import race, race_winner
from specdec.runtime.loading import LoadedModel, load_model
from specdec.runtime.tiny import save_tiny_model
from specdec.sampling import SamplingParams, warp_logits
from specdec.verification import fidelity

# ------------------------------------------------------------------------------------------------
# a run without services (unit tests of the loop's parts)

TARGET_INFO = ModelInfo(model_id="target", vocab_size=6, tokenizer_fingerprint="f", max_context=128,
                        eos_token_ids=(5,))


def make_run(prompt_ids: list[int] | None = None, config: OrchestratorConfig | None = None, **request) -> Run:
    """The run of GenerationRequest(**request) as the orchestrator would start it (method "token")."""
    config = config or OrchestratorConfig(pipeline=False)
    req = GenerationRequest(prompt_ids=list(prompt_ids or [1, 2, 3]), seed=request.pop("seed", 7), **request)
    return new_run(req, method=req.method or "token", prompt_ids=list(req.prompt_ids or []),
                   rank_acceptance=list(config.rank_acceptance), config=config, target=TARGET_INFO)


class _NoLag:
    """Sessions whose engines hold everything already (what a plan reads of the run's sessions)."""

    def lag(self, committed, *, drafting: bool) -> int:
        return 0


def plan_of(run: Run, position: int, depth_cap: int, config: OrchestratorConfig | None = None):
    """The plan the run's proposer makes for an iteration starting at `position` where
    drafts of at most `depth_cap` tokens fit (no engine involved)."""
    from orchestrator.adaptation import PairEstimates
    from orchestrator.drafting import DraftingContext, proposer_for
    from orchestrator.drafting.base import Step
    from orchestrator.timeline import Timeline

    proposer = proposer_for(run, DraftingContext(config or OrchestratorConfig(), PairEstimates))
    committed = list(range(position))
    step = Step(run, _NoLag(), committed, Timeline(), lambda at: depth_cap - (at - position),  # type: ignore[arg-type]
                lambda exc: None)
    return proposer.plan(step)


class VirtualClock:
    """A stand-in for time.perf_counter whose time moves only when told (plus 1 µs a reading, so
    that it never stands still): a timed decision then sees the slowed passes' cost and none of the
    host's load, and a test of it cannot flake on a busy machine."""

    TICK = 1e-6

    def __init__(self) -> None:
        self._now = 0.0
        self._lock = threading.Lock()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds

    def __call__(self) -> float:
        with self._lock:
            self._now += self.TICK
            return self._now


def slowed_model(path: Path, seconds: float, clock: VirtualClock | None = None) -> LoadedModel:
    """A fresh one-thread load of `path` that sleeps `seconds` before each forward pass (0: none),
    to give a tiny model the timing of a big one; with `clock`, the pass advances that clock by
    `seconds` instead of sleeping."""
    loaded = load_model(path, threads=1)
    if seconds:
        pause = time.sleep if clock is None else clock.advance
        loaded.model.register_forward_pre_hook(lambda module, args: pause(seconds))
    return loaded


# ------------------------------------------------------------------------------------------------
# fault-injecting client wrappers


class FlakyDrafter:
    """Raises PeerUnavailable (or `error`) on the drafter calls (draft, lookahead) whose 0-based
    number is in `down_calls`."""

    def __init__(self, inner, down_calls: set[int], error: type[Exception] = PeerUnavailable) -> None:
        self.inner = inner
        self.error = error
        self.address = "flaky-drafter"
        self.down_calls = down_calls
        self.calls = 0
        self.refused = 0

    async def info(self):
        return await self.inner.info()

    def _maybe_down(self) -> None:
        number = self.calls
        self.calls += 1
        if number in self.down_calls:
            self.refused += 1
            raise self.error(f"{self.address} is down (injected)")

    async def draft(self, request):
        self._maybe_down()
        return await self.inner.draft(request)

    async def lookahead(self, request):
        self._maybe_down()
        return await self.inner.lookahead(request)

    async def draft_rows(self, request):  # a lean draft's rows: not a drafting call
        return await self.inner.draft_rows(request)

    async def release(self, session_id):
        await self.inner.release(session_id)

    async def close(self):
        await self.inner.close()


class ForgetfulClient:
    """Releases the caller's session in the engine before every `every`-th call of `method`,
    so the call meets SessionGone and the orchestrator has to resend the context."""

    def __init__(self, inner, method: str, every: int) -> None:
        self.inner = inner
        self.address = f"forgetful-{inner.address}"
        self.method = method
        self.every = every
        self.calls = 0
        self.forgotten = 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        async def call(request):
            self.calls += 1
            if self.calls % self.every == 0:
                if self.inner.engine.release(request.session_id):
                    self.forgotten += 1
            return await attr(request)

        return call


# ------------------------------------------------------------------------------------------------
# plain-forward references (no KV cache, no engine)


def target_rows(model, prefix: list[int], sampling: SamplingParams) -> torch.Tensor:
    """Warped next-token rows after every prefix position of `prefix` (one plain forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0].float()
    return warp_logits(logits, sampling)


def race_reference(model, prompt: list[int], n: int, seed: int, sampling: SamplingParams) -> list[int]:
    """Target-only decoding that emits argmin e_pos/P_pos at every position (docs/algorithms.md §4)."""
    seq = list(prompt)
    for _ in range(n):
        row = target_rows(model, seq, sampling)[-1]
        seq.append(race_winner(race(seed, len(seq), row.shape[-1]), row))
    return seq[len(prompt):]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Hugging Face generate, greedy, EOS disabled (the plain target the cache must reproduce)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=0)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        # An explicit mask: otherwise generate treats prompt tokens equal to pad_token_id (0) as padding.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------------------------
# fidelity statistics (test_fidelity.py, test_pipeline.py)

PROMPT = [0, 3]
LENGTH = 3
CONCURRENCY = 4
P_THRESHOLD = 1e-3


def exact_distribution(model, prompt: list[int], sampling: SamplingParams, vocab: int) -> dict[tuple, float]:
    """P(x1 x2 x3 | prompt) for every continuation, from one batched plain forward."""
    pairs = list(itertools.product(range(vocab), repeat=LENGTH - 1))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + list(p) for p in pairs])).logits.double()
    rows = warp_logits(logits, sampling)
    n = len(prompt)
    out: dict[tuple, float] = {}
    for i, (a, b) in enumerate(pairs):
        for c in range(vocab):
            out[(a, b, c)] = float(rows[i, n - 1, a] * rows[i, n, b] * rows[i, n + 1, c])
    return out


async def sample(orch: Orchestrator, method: str, knobs: dict, sampling: SamplingParams,
                 seeds) -> list[tuple]:
    async def one(seed: int) -> tuple:
        request = GenerationRequest(prompt_ids=PROMPT, max_new_tokens=LENGTH, sampling=sampling, seed=seed,
                                    method=method, stop_token_ids=[], **knobs)
        result = await orch.generate(request)
        assert len(result.token_ids) == LENGTH
        return tuple(result.token_ids)

    seeds = list(seeds)
    out: list[tuple] = []
    for start in range(0, len(seeds), CONCURRENCY):
        out += await asyncio.gather(*(one(s) for s in seeds[start:start + CONCURRENCY]))
    return out


def p_values(samples: list[tuple], exact: dict[tuple, float]) -> tuple[float, float]:
    """Chi-square p-values of the joint continuation and of the first token's marginal.

    The joint test sees every kind of error; the first-token test spends its power on the
    first emitted token (the verification step itself), where most rule errors show first.
    """
    first: dict[tuple, float] = {}
    for key, p in exact.items():
        first[key[:1]] = first.get(key[:1], 0.0) + p
    return chi_square_p(samples, exact), chi_square_p([s[:1] for s in samples], first)


def chi_square_p(samples: list[tuple], exact: dict[tuple, float]) -> float:
    """fidelity.chi_square_p (specdec.verification), after checking every sample is in the support."""
    assert set(samples) <= set(exact), "a sample outside the support"
    return fidelity.chi_square_p(samples, exact)


def load_int8_pair(root: Path, vocab_size: int, seeds: tuple[int, int]) -> list[LoadedModel]:
    """A tiny (draft, target) pair at int8 (64 wide, 2 layers, unscaled logits) under `root`, 2 threads."""
    return [load_model(save_tiny_model(root / name, vocab_size=vocab_size, seed=seed, hidden_size=64,
                                       num_layers=2, logit_scale=1.0), dtype="int8", threads=2)
            for name, seed in zip(("draft", "target"), seeds, strict=True)]
