"""A lost, late or changed drafter: target-only steps meanwhile, a back-off before the next try,
and the checks a drafter passes when it (re)appears.

Exact by docs/algorithms.md §8 ("Drafter down → target-only step"): if the drafter fails during
an iteration nothing has been verified, so the attempt is dropped and the iteration becomes
`verify(TARGET_ONLY_VERIFICATION, empty tree)` at the same position — exact on its own, and its
randomness is keyed on that position like any iteration's. Only a verified block is ever kept.

The same holds for the three other ways an iteration loses its drafter:
  - late (DrafterSlow): a call past its deadline, max(drafter_timeout_floor_s,
    drafter_timeout_multiple × its expected time) (`drafter_deadline`; the expected time is
    measured, adaptation.DrafterCallTimes), is cancelled. Whether a call is late depends on the
    clock, never on the tokens it would return, so dropping it changes no law;
  - changed (DrafterIncompatible): a drafter that restarted with another vocabulary or tokenizer
    than the verifier's is not used (target-only until one that fits answers; its info is re-read
    after every back-off);
  - restarted with a shorter context: its new window caps the depth of later drafts (the
    iteration that found out falls back).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

from orchestrator.config import OrchestratorConfig
from specdec.calibration import calibration_path, load_calibration
from specdec.engine.api import ModelInfo
from specdec.errors import EngineError, InvalidRequest, Overloaded, PeerUnavailable

log = logging.getLogger(__name__)

A = TypeVar("A")
B = TypeVar("B")


class DrafterSlow(EngineError):
    """A drafter call ran past its deadline and was cancelled (`drafter_deadline`)."""


class DrafterIncompatible(EngineError):
    """The drafter answers with a vocabulary or tokenizer unlike the verifier's (it restarted with
    another model): it is not used until it answers with one that fits."""


class DrafterChanged(EngineError):
    """The drafter's info changed under a run (it restarted, e.g. with a shorter context): the
    iteration that found out falls back; later ones plan with the new info."""


# What makes an iteration give up its drafter (see the module docstring).
DrafterLoss = PeerUnavailable | Overloaded | DrafterSlow | DrafterIncompatible | DrafterChanged


class DrafterDown(Exception):
    """The drafter could not be reached, refused the call as Overloaded, was late, or changed,
    during an iteration (its error, wrapped): either way the run goes on target-only while the
    orchestrator backs off."""

    def __init__(self, cause: DrafterLoss) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Backoff:
    """After the drafter was lost: when to try it again."""

    def __init__(self) -> None:
        self._retry_at = 0.0  # monotonic time before which the drafter is not tried

    def lost(self, exc: Exception, retry_seconds: float) -> None:
        log.warning("drafter unavailable (%s); target-only steps, retry in %.1fs", exc, retry_seconds)
        self.wait(retry_seconds)

    def wait(self, retry_seconds: float) -> None:
        """Back off without a log line (the caller logged why, once)."""
        self._retry_at = time.monotonic() + retry_seconds

    def clear(self) -> None:
        """The drafter is back: try it at once."""
        self._retry_at = 0.0

    @property
    def waiting(self) -> bool:
        return time.monotonic() < self._retry_at


def drafter_deadline(expected_s: float, config: OrchestratorConfig) -> float:
    """Seconds a drafter call may take before it is abandoned: a bounded multiple of its expected
    time, never below the floor (tiny models on a busy CI machine stall for more than their calls)."""
    return max(config.drafter_timeout_floor_s, config.drafter_timeout_multiple * expected_s)


def pair_config(config: OrchestratorConfig, draft: ModelInfo, target: ModelInfo) -> OrchestratorConfig:
    """The configuration for this model pair: `config` with the pair's saved calibration, if enabled.
    Give it the configuration as built (before any pair's calibration) each time the pair changes."""
    return calibrated_config(config, draft, target) if config.use_calibration else config


def vocabulary_mismatch(draft: ModelInfo, target: ModelInfo) -> str | None:
    """Why the drafter cannot draft for the verifier (vocabulary or tokenizer), or None when it can."""
    if draft.vocab_size == target.vocab_size and draft.tokenizer_fingerprint == target.tokenizer_fingerprint:
        return None
    return (f"vocabulary mismatch: drafter {draft.model_id!r} has vocab_size {draft.vocab_size} and "
            f"tokenizer {draft.tokenizer_fingerprint[:12]}, verifier {target.model_id!r} has vocab_size "
            f"{target.vocab_size} and tokenizer {target.tokenizer_fingerprint[:12]}")


def check_vocabulary(draft: ModelInfo, target: ModelInfo) -> None:
    """InvalidRequest when the pair cannot work together (the start-up check: the pair is refused)."""
    mismatch = vocabulary_mismatch(draft, target)
    if mismatch is not None:
        raise InvalidRequest(mismatch)


def describe_defaults(config: OrchestratorConfig, draft: ModelInfo | None, target: ModelInfo, *,
                      has_drafter: bool = True) -> str:
    """Where the defaults of requests that set nothing come from, in one line a user can read on start:
    the values, and whether the pair's saved calibration (its file) or the built-in settings gave them."""
    k = (f"k online from {config.default_k} (requests without k or seed)" if config.adaptive_k
         else f"k {config.default_k}")
    pipeline = "on" if config.pipeline else "off"
    values = (f"method {config.default_method}, drafts {config.draft_source}, {k}, a {config.default_a:g}, "
              f"pipeline {pipeline}")
    if not has_drafter:
        return f"defaults: {values} (built-in; no drafter: model-free drafts or target-only steps)"
    if draft is None:
        return f"defaults: {values} (built-in; the drafter is not connected yet)"
    path = calibration_path(draft.model_id, target.model_id)
    if not config.use_calibration:
        return f"defaults: {values} (built-in; calibration disabled)"
    if load_calibration(draft.model_id, target.model_id) is None:
        return f"defaults: {values} (built-in; no calibration at {path})"
    return f"defaults: {values} (calibration {path}; settings given explicitly win)"


def calibrated_config(config: OrchestratorConfig, draft: ModelInfo, target: ModelInfo) -> OrchestratorConfig:
    """Saved analyser results for this pair become the defaults of fields not set explicitly."""
    calibration = load_calibration(draft.model_id, target.model_id)
    if calibration is None:
        return config
    explicit = config.model_fields_set
    updates = {k: v for k, v in calibration.orchestrator_defaults().items() if k not in explicit}
    if not updates:
        return config
    log.info("calibration of %s → %s applied: %s", draft.model_id, target.model_id, updates)
    return config.model_copy(update=updates)


async def both(first: Awaitable[A], second: Awaitable[B]) -> tuple[A, B]:
    """Run two calls concurrently and wait for both; a verifier error wins over a lost drafter
    (the iteration then fails rather than falling back to a target-only step)."""
    results = await asyncio.gather(first, second, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        errors.sort(key=lambda e: isinstance(e, DrafterDown))
        raise errors[0]
    return results[0], results[1]  # type: ignore[return-value]
