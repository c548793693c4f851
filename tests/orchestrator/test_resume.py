"""Resume in process (orchestrator.speculation): a seeded request interrupted, by its client closing
the stream or by its orchestrator dying, continues token for token as the uninterrupted run; a
record is bound to its owner and never overwritten; one run at a time writes it (lease + holder)."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from orchestrator.store import MemoryStore
from specdec.errors import AlreadyExists, InvalidRequest, NotFound, PeerUnavailable, StillRunning
from specdec.generation import GenerationRequest
from specdec.sampling import SamplingParams

SAMPLE = SamplingParams(temperature=1.0)
N = 24
LEASE_S = 0.2
METHODS = [("token", {"k": 3}), ("block", {"k": 4}), ("ersd", {"k": 3}), ("rd", {"k": 3, "a": 0.5})]
IDS = [m for m, _ in METHODS]
ALICE, BOB = "token:alice", "token:bob"


def _request(request_id: str, method: str = "token", knobs: dict | None = None, seed: int = 11,
             n: int = N) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=n, method=method, sampling=SAMPLE,
                             seed=seed, stop_token_ids=[], request_id=request_id, **(knobs or {}))


async def _first_chunks(stream, chunks: int) -> list[int]:
    tokens: list[int] = []
    for _ in range(chunks):
        tokens += (await stream.__anext__()).token_ids
    return tokens


@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
@pytest.mark.parametrize("method,knobs", METHODS, ids=IDS)
async def test_a_closed_stream_resumes_exactly(make_orchestrator, method, knobs, pipeline):
    orch = make_orchestrator(pipeline=pipeline)
    reference = await orch.generate(_request("ref", method, knobs))
    assert len(reference.token_ids) == N and reference.stats.drafted_tokens > 0
    stream = orch.generate_stream(_request("cut", method, knobs))
    received = await _first_chunks(stream, 2)
    await stream.aclose()  # the client went away: the run hands its lease back at once
    record = await orch.store.get_request("cut")
    assert (record.status, record.lease_until, record.token_ids) == ("running", 0.0, received)
    assert 0 < len(received) < N

    chunks = [chunk async for chunk in orch.resume_stream("cut")]
    assert chunks[0].token_ids == received and chunks[0].result is None  # the stored tokens come first
    assert [t for chunk in chunks for t in chunk.token_ids] == reference.token_ids
    assert "".join(chunk.text for chunk in chunks) == reference.text
    result = chunks[-1].result
    assert (result.token_ids, result.text, result.seed) == (reference.token_ids, reference.text, 11)
    assert result.stats.new_tokens == N and result.stats.iterations == reference.stats.iterations
    assert (await orch.store.get_request("cut")).status == "done"
    again = await orch.resume("cut")  # finished: the stored result, nothing run
    assert again.token_ids == reference.token_ids and again.iterations == []


@pytest.mark.parametrize("method,knobs", METHODS, ids=IDS)
async def test_a_dead_orchestrators_request_resumes_exactly_after_its_lease(make_orchestrator, method, knobs):
    store = MemoryStore()
    reference = await make_orchestrator(store=store).generate(_request("ref", method, knobs))
    dying = make_orchestrator(store=store, resume_lease_seconds=LEASE_S)
    stream = dying.generate_stream(_request("dead", method, knobs))
    received = await _first_chunks(stream, 2)
    # `dying` and its stream are never touched again, as if its process had died mid-run: once its
    # run has paused for its reader (a chunk or two ahead, admission.paced), it makes no progress.
    async with asyncio.timeout(30):
        while dying.admission_stats()["paused"] != 1:
            await asyncio.sleep(0.01)
    survivor = make_orchestrator(store=store)
    with pytest.raises(StillRunning, match="'dead' is still running"):
        await survivor.resume("dead")
    await asyncio.sleep(LEASE_S)
    result = await survivor.resume("dead")
    assert result.token_ids[: len(received)] == received
    assert result.token_ids == reference.token_ids
    with pytest.raises(StillRunning, match="taken over"):  # the stalled run may not write any more
        async for _ in stream:  # the chunks it made before it stalled, then the refusal
            pass
    assert (await store.get_request("dead")).token_ids == reference.token_ids


async def test_a_live_run_is_not_resumed_twice(make_orchestrator):
    orch = make_orchestrator()
    stream = orch.generate_stream(_request("live", n=40))
    received = await _first_chunks(stream, 1)
    with pytest.raises(StillRunning, match="still running"):
        await orch.resume("live")
    with pytest.raises(StillRunning):
        await _first_chunks(orch.resume_stream("live"), 1)
    # The live run's progress only (it may run a chunk or two ahead of its reader): no second run wrote it.
    stored = (await orch.store.get_request("live")).token_ids
    rest = [t async for chunk in stream for t in chunk.token_ids]
    assert len(received + rest) == 40 and stored == (received + rest)[:len(stored)]
    assert len(stored) >= len(received)


class LosableVerifier:
    """The in-process verifier client, whose verify fails with PeerUnavailable while `lost` is set."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.lost = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def verify(self, request):
        if self.lost:
            raise PeerUnavailable("verifier lost (injected)")
        return await self.inner.verify(request)


async def test_a_failed_request_resumes(make_orchestrator, engines):
    """A run that failed mid-way (its verifier lost) keeps its tokens; Resume continues it exactly."""
    reference = await make_orchestrator().generate(_request("ref", "ersd", {"k": 2}))
    verifier = LosableVerifier(InProcessVerifierClient(engines["verifier"]))
    config = OrchestratorConfig(pipeline=False)
    orch = Orchestrator(InProcessDrafterClient(engines["draft"]), verifier, config)
    stream = orch.generate_stream(_request("failing", "ersd", {"k": 2}))
    received = await _first_chunks(stream, 2)
    verifier.lost = True
    with pytest.raises(PeerUnavailable, match="injected"):
        await stream.__anext__()
    record = await orch.store.get_request("failing")
    assert (record.status, record.token_ids, record.lease_until) == ("failed", received, 0.0)
    assert "PeerUnavailable" in record.error
    verifier.lost = False
    assert (await orch.resume("failing")).token_ids == reference.token_ids


async def test_generate_never_overwrites_a_stored_request(make_orchestrator):
    orch = make_orchestrator()
    await orch.generate(_request("x", n=10), owner=ALICE)
    before = (await orch.store.get_request("x", ALICE)).to_json()
    with pytest.raises(AlreadyExists, match="request_id 'x' already exists; Resume continues it"):
        await orch.generate(_request("x", seed=99, n=30), owner=ALICE)
    assert (await orch.store.get_request("x", ALICE)).to_json() == before


async def test_request_ids_are_scoped_to_their_owner(make_orchestrator):
    """Another identity's request_id is neither refused (which would reveal it) nor touched: Generate
    creates the caller's own request, and each owner's Resume sees its own."""
    orch = make_orchestrator()
    alice = await orch.generate(_request("same", seed=1, n=10), owner=ALICE)
    before = (await orch.store.get_request("same", ALICE)).to_json()
    bob = await orch.generate(_request("same", seed=2, n=14), owner=BOB)
    assert (len(alice.token_ids), len(bob.token_ids)) == (10, 14)
    assert (await orch.store.get_request("same", ALICE)).to_json() == before
    assert (await orch.resume("same", owner=ALICE)).token_ids == alice.token_ids
    assert (await orch.resume("same", owner=BOB)).token_ids == bob.token_ids
    with pytest.raises(NotFound, match="no stored request 'same'"):
        await orch.resume("same", owner="anonymous")


async def test_a_record_is_bound_to_its_owner(make_orchestrator):
    orch = make_orchestrator()
    stream = orch.generate_stream(_request("mine"), owner=ALICE)
    await _first_chunks(stream, 1)
    await stream.aclose()
    before = (await orch.store.get_request("mine", ALICE)).to_json()
    messages = []
    for request_id, owner in (("mine", BOB), ("mine", "anonymous"), ("absent", ALICE)):
        with pytest.raises(NotFound) as info:
            await orch.resume(request_id, owner=owner)
        messages.append(str(info.value).replace(repr(request_id), "ID"))
    assert messages == ["request_id: no stored request ID"] * 3  # another's record reads as missing
    assert (await orch.store.get_request("mine", ALICE)).to_json() == before
    result = await orch.resume("mine", owner=ALICE)
    assert len(result.token_ids) == N


async def test_resume_bounds_its_request_id_before_the_store_reads_it(make_orchestrator):
    """Resume caps request_id as Generate does (max_request_id_chars): a 1 MB id is refused at once."""
    orch = make_orchestrator()
    reads = []
    real_get = orch.store.get_request

    async def get_request(request_id, *owner):
        reads.append(len(request_id))
        return await real_get(request_id, *owner)

    orch.store.get_request = get_request
    with pytest.raises(InvalidRequest, match="request_id: 1000000 characters; at most 128 are allowed"):
        await orch.resume("x" * 1_000_000, owner=ALICE)
    with pytest.raises(InvalidRequest, match="request_id: give the id"):
        await orch.resume("", owner=ALICE)
    with pytest.raises(InvalidRequest, match="printable ASCII"):
        await orch.resume("a b", owner=ALICE)
    assert reads == []


class SlowReadStore(MemoryStore):
    """Reads take a moment, so two Resumes both read the record before either takes it over."""

    async def get_request(self, request_id, owner="anonymous"):
        record = await super().get_request(request_id, owner)
        await asyncio.sleep(0.05)
        return record


async def test_of_two_concurrent_resumes_one_runs(make_orchestrator):
    orch = make_orchestrator(store=SlowReadStore())
    reference = await orch.generate(_request("ref"))
    stream = orch.generate_stream(_request("twice"))
    await _first_chunks(stream, 1)
    await stream.aclose()
    outcomes = await asyncio.gather(orch.resume("twice"), orch.resume("twice"), return_exceptions=True)
    assert sorted(type(o).__name__ for o in outcomes) == ["GenerationResult", "StillRunning"]
    assert "taken over by another run just now" in str(next(o for o in outcomes if isinstance(o, Exception)))
    assert next(o for o in outcomes if not isinstance(o, Exception)).token_ids == reference.token_ids
