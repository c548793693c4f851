"""Drafter failover parts (orchestrator.failover): error precedence of concurrent calls, the
back-off, and the vocabulary check. The fallback itself runs in test_loop.py."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.failover import Backoff, DrafterDown, both, check_vocabulary
from specdec.engine.api import ModelInfo
from specdec.errors import InvalidRequest, PeerUnavailable


async def _value(v, delay=0.0):
    await asyncio.sleep(delay)
    return v


async def _raise(exc, delay=0.0):
    await asyncio.sleep(delay)
    raise exc


async def test_both_returns_both_results():
    assert await both(_value(1, 0.01), _value("two")) == (1, "two")


@pytest.mark.parametrize("drafter_first", [True, False])
async def test_a_verifier_error_wins_over_a_lost_drafter(drafter_first):
    lost = DrafterDown(PeerUnavailable("drafter:1 is down"))
    broken = RuntimeError("verifier broke")
    calls = (_raise(lost), _raise(broken, 0.01)) if drafter_first else (_raise(broken), _raise(lost, 0.01))
    with pytest.raises(RuntimeError, match="verifier broke"):
        await both(*calls)
    with pytest.raises(DrafterDown) as caught:  # alone, the lost drafter shows (→ target-only step)
        await both(_raise(lost), _value(None))
    assert isinstance(caught.value.cause, PeerUnavailable)


def test_backoff():
    backoff = Backoff()
    assert not backoff.waiting
    backoff.lost(PeerUnavailable("down"), 0.0)
    assert not backoff.waiting
    backoff.lost(PeerUnavailable("down"), 30.0)
    assert backoff.waiting


def test_vocabulary_check():
    target = ModelInfo("t", vocab_size=8, tokenizer_fingerprint="abc", max_context=64)
    check_vocabulary(ModelInfo("d", vocab_size=8, tokenizer_fingerprint="abc", max_context=32), target)
    for draft in (ModelInfo("d", 9, "abc", 64), ModelInfo("d", 8, "xyz", 64)):
        with pytest.raises(InvalidRequest, match="vocabulary mismatch"):
            check_vocabulary(draft, target)

