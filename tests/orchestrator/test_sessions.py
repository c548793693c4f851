"""The session protocol's mirror (orchestrator.sessions): what is sent, and what the mirror
believes the service holds after success, SessionGone and failure (docs/algorithms.md §8)."""

from __future__ import annotations

import pytest
import torch

from orchestrator.sessions import SessionMirror, draft_rows
from specdec.engine.api import DraftResult
from specdec.errors import SessionGone


class Service:
    """Applies (base_len, append) to its committed sequence like an engine; scripted failures."""

    def __init__(self, fail: list[BaseException | None] | None = None) -> None:
        self.committed: list[int] = []
        self.calls: list[tuple[int, list[int]]] = []
        self.fail = list(fail or [])

    async def __call__(self, base: int, append: list[int]) -> int:
        self.calls.append((base, list(append)))
        error = self.fail.pop(0) if self.fail else None
        if isinstance(error, SessionGone):
            raise error
        if base > len(self.committed):
            raise SessionGone("behind the caller")
        self.committed = self.committed[:base] + list(append)
        if error is not None:  # applied, then failed (e.g. the answer was lost)
            raise error
        return len(self.committed)


async def test_calls_send_only_what_the_service_lacks():
    mirror, service = SessionMirror(), Service()
    assert await mirror.call([1, 2, 3], service) == 3
    assert await mirror.call([1, 2, 3, 4, 5], service) == 5
    assert await mirror.call([1, 2, 9], service) == 3  # diverges after two tokens: rolls back
    assert service.calls == [(0, [1, 2, 3]), (3, [4, 5]), (2, [9])]
    assert mirror.held == service.committed == [1, 2, 9]


async def test_session_gone_resends_everything_once():
    mirror, service = SessionMirror(), Service()
    await mirror.call([1, 2, 3], service)
    service.committed = []  # evicted
    assert await mirror.call([1, 2, 3, 4], service) == 4
    assert service.calls[-2:] == [(3, [4]), (0, [1, 2, 3, 4])]
    assert mirror.held == [1, 2, 3, 4]

    service.fail = [SessionGone("gone"), SessionGone("gone again")]
    with pytest.raises(SessionGone):
        await mirror.call([1, 2, 3, 4, 5], service)
    assert mirror.held == []  # the last attempt sent base_len 0: nothing is known to be held


@pytest.mark.parametrize("applied", [False, True])
async def test_a_failed_call_shrinks_the_mirror_to_what_is_held_either_way(applied):
    mirror, service = SessionMirror(), Service()
    await mirror.call([1, 2, 3, 4], service)
    if applied:
        service.fail = [RuntimeError("answer lost")]
    else:
        service.fail = [SessionGone("x"), SessionGone("y")]  # the resend with base_len 0 fails too
    with pytest.raises((RuntimeError, SessionGone)):
        await mirror.call([1, 2, 7, 8], service)
    assert service.committed[: len(mirror.held)] == mirror.held
    assert mirror.held == ([1, 2] if applied else [])
    # the next call resyncs from there and the service ends up holding the truth
    service.fail = []
    await mirror.call([1, 2, 7, 8, 9], service)
    assert service.committed == mirror.held == [1, 2, 7, 8, 9]


def test_draft_rows_must_be_there():
    rows = torch.rand(3, 6)
    assert torch.equal(draft_rows(DraftResult([1, 2], [-1, 0], rows), 2), rows[:2])
    with pytest.raises(RuntimeError, match="no draft distributions"):
        draft_rows(DraftResult([1, 2], [-1, 0], None), 1)
    with pytest.raises(RuntimeError, match="no draft distributions"):
        draft_rows(DraftResult([1, 2], [-1, 0], rows), 4)
