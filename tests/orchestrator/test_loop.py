"""The speculation loop through the real code path (tiny real models, real engines, in-process).

Cache correctness is checked against plain forwards with no cache at all: greedy output must be
Hugging Face's greedy generate, and seeded ERSD / autoregressive output must be the race
decoding of the target computed from full forwards (docs/algorithms.md §4) — also after sessions
are lost (SessionGone) and while the drafter is down (fallback).
"""

from __future__ import annotations

import asyncio
import math

import pytest

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.intervals import overlap, union
from orchestrator.scheduling import rank_acceptance_from_calibration
from orchestrator.speculation import Orchestrator
from orchestrator.store import MemoryStore, RedisStore
from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.errors import InvalidRequest, NotFound, Overloaded, SessionGone, StillRunning
from specdec.generation import GenerationRequest
from specdec.sampling import SamplingParams
from tests.orchestrator.helpers import FlakyDrafter, ForgetfulClient, hf_greedy, race_reference, slowed_model

GREEDY = SamplingParams(temperature=0.0)
SAMPLE = SamplingParams(temperature=1.0)
PROMPTS = [[1, 2, 3], [0], [4, 4, 1, 0, 2], [3, 5, 2, 2]]
SPEC_METHODS = [
    ("token", {"k": 3}),
    ("block", {"k": 4}),
    ("ersd", {"k": 3}),
    ("ersd", {"tree_budget": 6}),
    ("gsd-tree", {"k": 6}),
    ("rd", {"k": 3, "a": 0.5}),
    ("rd", {"k": 2, "a": 1.0}),
    ("rd", {"k": 2, "a": 0.0}),
    ("autoregressive", {}),
]


def _request(prompt, n, method, sampling=SAMPLE, seed=0, **kwargs) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), max_new_tokens=n, method=method, sampling=sampling,
                             seed=seed, stop_token_ids=[], **kwargs)


def _check_stats(result):
    stats, records = result.stats, result.iterations
    assert stats.iterations == len(records) > 0
    assert stats.new_tokens == len(result.token_ids) == sum(len(r.emitted) for r in records)
    assert stats.drafted_tokens == sum(r.num_drafted for r in records)
    assert stats.accepted_tokens == sum(r.accepted for r in records) <= stats.drafted_tokens
    assert stats.drafted_iterations == sum(r.drafted for r in records)
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert all(a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position, strict=False))
    assert stats.draft_seconds >= 0 and stats.verify_seconds > 0
    assert 0 <= stats.overlap_seconds <= min(stats.draft_seconds, stats.verify_seconds) + 1e-9
    assert stats.seconds >= stats.verify_seconds - 1e-6
    for r in records:
        for start, end in r.draft_intervals + r.verify_intervals:
            assert r.start <= start <= end <= r.end + 1e-6


# ------------------------------------------------------------------------------------------------
# cache correctness


@pytest.mark.parametrize("method,knobs", SPEC_METHODS, ids=[f"{m}-{k}" for m, k in SPEC_METHODS])
async def test_greedy_equals_hf_generate(make_orchestrator, loaded, method, knobs):
    orch = make_orchestrator()
    for prompt in PROMPTS[:3]:
        expected = hf_greedy(loaded["target"].model, prompt, 32)
        result = await orch.generate(_request(prompt, 32, method, GREEDY, seed=5, **knobs))
        assert result.token_ids == expected, (method, prompt)
        assert result.finish_reason == "length"
        _check_stats(result)
        if method != "autoregressive" and knobs.get("a") != 0.0:
            assert result.stats.drafted_tokens > 0


@pytest.mark.parametrize("method,knobs", [m for m in SPEC_METHODS if m[0] in ("ersd", "autoregressive")],
                         ids=lambda v: str(v))
async def test_seeded_race_decoding_equals_plain_forward_reference(make_orchestrator, loaded, method, knobs):
    """ERSD and autoregressive, seeded, T = 1: exactly the race decoding computed without a cache."""
    orch = make_orchestrator()
    for seed, prompt in [(3, PROMPTS[0]), (17, PROMPTS[2])]:
        expected = race_reference(loaded["target"].model, prompt, 30, seed, SAMPLE)
        result = await orch.generate(_request(prompt, 30, method, SAMPLE, seed=seed, **knobs))
        assert result.token_ids == expected
        assert result.seed == seed


@pytest.mark.parametrize("drafter", ["draft", "draft2", "self"])
async def test_ersd_with_seed_is_token_for_token_autoregressive(make_orchestrator, drafter):
    orch = make_orchestrator(drafter)
    for seed in (1, 99, 2**40 + 7):
        sampling = SamplingParams(temperature=0.9, top_k=5) if seed == 99 else SAMPLE
        reference = await orch.generate(_request(PROMPTS[1], 24, "autoregressive", sampling, seed=seed))
        for knobs in ({"k": 1}, {"k": 2}, {"k": 5}, {"tree_budget": 5}):
            result = await orch.generate(_request(PROMPTS[1], 24, "ersd", sampling, seed=seed, **knobs))
            assert result.token_ids == reference.token_ids, (drafter, seed, knobs)
            assert result.stats.drafted_tokens > 0


async def test_session_gone_mid_request_is_resent(make_orchestrator, engines, loaded):
    """Sessions released mid-request (drafter and verifier): the context is resent, output unchanged."""
    drafter = ForgetfulClient(InProcessDrafterClient(engines["draft"]), "draft", every=3)
    orch = make_orchestrator(drafter)
    orch.verifier = ForgetfulClient(InProcessVerifierClient(engines["verifier"]), "verify", every=4)
    prompt = PROMPTS[2]
    greedy = await orch.generate(_request(prompt, 32, "token", GREEDY, k=3))
    assert greedy.token_ids == hf_greedy(loaded["target"].model, prompt, 32)
    seeded = await orch.generate(_request(prompt, 32, "ersd", SAMPLE, seed=8, k=3))
    assert seeded.token_ids == race_reference(loaded["target"].model, prompt, 32, 8, SAMPLE)
    rd = await orch.generate(_request(prompt, 32, "rd", GREEDY, k=3, a=0.5))
    assert rd.token_ids == greedy.token_ids
    assert drafter.forgotten >= 3 and orch.verifier.forgotten >= 3


async def test_repeated_session_gone_fails_the_request(make_orchestrator, engines):
    class AlwaysGone:
        address = "gone"

        def __init__(self, inner):
            self.inner = inner

        async def info(self):
            return await self.inner.info()

        async def draft(self, request):
            raise SessionGone("gone (injected)")

        async def release(self, session_id):
            return None

        async def close(self):
            return None

    store = MemoryStore()
    orch = make_orchestrator(AlwaysGone(InProcessDrafterClient(engines["draft"])), store=store)
    with pytest.raises(SessionGone):
        await orch.generate(_request(PROMPTS[0], 8, "token", request_id="doomed"))
    record = await store.get_request("doomed")
    assert record.status == "failed" and "SessionGone" in record.error


async def test_drafter_down_then_back(make_orchestrator, engines, loaded):
    """PeerUnavailable for some iterations: target-only steps, then speculation resumes; exact output."""
    prompt = PROMPTS[0]
    flaky = FlakyDrafter(InProcessDrafterClient(engines["draft"]), down_calls={1, 2, 3, 7})
    orch = make_orchestrator(flaky, drafter_retry_seconds=0.0)
    greedy = await orch.generate(_request(prompt, 32, "token", GREEDY, k=2))
    assert greedy.token_ids == hf_greedy(loaded["target"].model, prompt, 32)
    assert greedy.stats.fallback_iterations == flaky.refused == 4
    assert greedy.stats.drafted_iterations > 0
    fallback = [r for r in greedy.iterations if r.fallback]
    assert len(fallback) == 4 and all(r.method == "autoregressive" and r.num_drafted == 0 for r in fallback)

    # RD: the drafter is lost in the middle of an iteration (also in its extra pass) → exact anyway.
    flaky = FlakyDrafter(InProcessDrafterClient(engines["draft"]), down_calls=set(range(1, 40, 3)))
    orch = make_orchestrator(flaky, drafter_retry_seconds=0.0)
    rd = await orch.generate(_request(prompt, 32, "rd", GREEDY, k=3, a=0.7))
    assert rd.token_ids == greedy.token_ids and rd.stats.fallback_iterations == flaky.refused > 0

    flaky = FlakyDrafter(InProcessDrafterClient(engines["draft"]), down_calls=set(range(2, 6)))
    orch = make_orchestrator(flaky, drafter_retry_seconds=0.0)
    seeded = await orch.generate(_request(prompt, 30, "ersd", SAMPLE, seed=21, k=3))
    assert seeded.token_ids == race_reference(loaded["target"].model, prompt, 30, 21, SAMPLE)
    assert seeded.stats.fallback_iterations == 4


async def test_an_overloaded_drafter_is_shed_like_a_lost_one(make_orchestrator, engines, loaded):
    """Overloaded (its KV budget full of busy sessions) → target-only steps, exact output, no failure."""
    prompt = PROMPTS[0]
    flaky = FlakyDrafter(InProcessDrafterClient(engines["draft"]), down_calls={1, 2}, error=Overloaded)
    orch = make_orchestrator(flaky, drafter_retry_seconds=0.0)
    result = await orch.generate(_request(prompt, 16, "token", GREEDY, k=2))
    assert result.token_ids == hf_greedy(loaded["target"].model, prompt, 16)
    assert result.stats.fallback_iterations == flaky.refused == 2


async def test_drafter_backoff_limits_retries(make_orchestrator, engines):
    flaky = FlakyDrafter(InProcessDrafterClient(engines["draft"]), down_calls=set(range(1000)))
    orch = make_orchestrator(flaky, drafter_retry_seconds=30.0)
    result = await orch.generate(_request(PROMPTS[0], 12, "token", k=2))
    assert len(result.token_ids) == 12
    assert flaky.calls == 1  # tried once, then target-only for the backoff period
    assert result.stats.fallback_iterations == result.stats.iterations == 12


async def test_no_drafter_runs_target_only(make_orchestrator, loaded):
    orch = make_orchestrator(None)
    result = await orch.generate(_request(PROMPTS[0], 10, "rd", GREEDY, k=2, a=0.5))
    assert result.token_ids == hf_greedy(loaded["target"].model, PROMPTS[0], 10)
    assert result.stats.fallback_iterations == result.stats.iterations == 10
    plain = await orch.generate(_request(PROMPTS[0], 5, "autoregressive", GREEDY))
    assert plain.stats.fallback_iterations == 0


# ------------------------------------------------------------------------------------------------
# RD concurrency: real engines with an artificial per-forward sleep


@pytest.fixture
def slow_engines(model_dirs):
    return (DrafterEngine(slowed_model(model_dirs["draft"], 0.03)),
            VerifierEngine(slowed_model(model_dirs["target"], 0.03)))


async def test_rd_no_draft_steps_overlap_drafter_and_verifier(slow_engines):
    drafter, verifier = slow_engines
    orch = Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier),
                        OrchestratorConfig(pipeline=False))
    a0 = await orch.generate(_request(PROMPTS[0], 6, "rd", seed=4, k=2, a=0.0))
    assert all(r.heads == 0 and not r.drafted for r in a0.iterations)
    assert a0.stats.overlap_seconds > 0.5 * a0.stats.verify_seconds, a0.stats
    assert verifier.score_hits >= a0.stats.iterations  # verify reused the early score's rows

    a1 = await orch.generate(_request(PROMPTS[0], 6, "rd", seed=4, k=2, a=1.0))
    assert all(r.heads == 2 for r in a1.iterations)
    assert a1.stats.overlap_seconds <= 1e-9
    # K between 1 and k_max - 1: the drafter's extra pass overlaps the target's scoring pass
    mid = await orch.generate(_request(PROMPTS[0], 12, "rd", seed=4, k=3, a=0.6))
    partial = [r for r in mid.iterations if r.heads is not None and 1 <= r.heads < 3]
    assert partial and all(r.overlap_seconds > 0.01 for r in partial)


# ------------------------------------------------------------------------------------------------
# stop conditions, streaming, statistics


async def test_max_new_tokens_truncates(make_orchestrator):
    orch = make_orchestrator()
    for n in (1, 2, 5):
        result = await orch.generate(_request(PROMPTS[0], n, "block", GREEDY, k=4))
        assert len(result.token_ids) == n and result.finish_reason == "length"


async def test_eos_of_the_target_stops(make_orchestrator, engines):
    orch = make_orchestrator()
    eos = engines["verifier"].info().eos_token_ids
    assert eos
    for seed in range(40):
        request = GenerationRequest(prompt_ids=PROMPTS[0], max_new_tokens=60, method="token", k=3, seed=seed)
        result = await orch.generate(request)
        if result.finish_reason == "eos":
            assert result.token_ids[-1] in eos
            assert not set(result.token_ids[:-1]) & set(eos)
            unstopped = await orch.generate(_request(PROMPTS[0], 60, "token", seed=seed, k=3))
            assert unstopped.token_ids[: len(result.token_ids)] == result.token_ids
            break
    else:
        pytest.fail("no seed produced EOS within 60 tokens")
    custom = await orch.generate(
        GenerationRequest(prompt_ids=PROMPTS[0], max_new_tokens=40, seed=1, stop_token_ids=[3]))
    assert custom.finish_reason == "eos" and custom.token_ids[-1] == 3
    assert 3 not in custom.token_ids[:-1]


async def test_stop_strings_cut_text_and_tokens(make_orchestrator, engines):
    orch = make_orchestrator()
    full = await orch.generate(_request(PROMPTS[2], 24, "ersd", seed=12, k=3))
    words = full.text.split()
    stop = f"{words[5][1:]} {words[6]}"  # spans two tokens, starts inside one
    decode = engines["verifier"].decode
    fewest = next(n for n in range(1, 25) if stop in decode(full.token_ids[:n]))
    result = await orch.generate(_request(PROMPTS[2], 24, "ersd", seed=12, k=3, stop=["zz", stop]))
    assert result.finish_reason == "stop"
    assert result.text == full.text[: full.text.find(stop)]
    assert result.token_ids == full.token_ids[:fewest]  # the fewest tokens whose text holds the stop


async def test_stream_chunks_add_up_to_the_result(make_orchestrator):
    orch = make_orchestrator()
    full = await orch.generate(_request(PROMPTS[2], 24, "gsd-tree", seed=12, k=5))
    stop = " ".join(full.text.split()[6:8])
    chunks = [c async for c in orch.generate_stream(
        _request(PROMPTS[2], 24, "gsd-tree", seed=12, k=5, stop=[stop]))]
    result = chunks[-1].result
    assert result is not None and all(c.result is None for c in chunks[:-1])
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert "".join(c.text for c in chunks) == result.text
    assert len(chunks) == result.stats.iterations
    assert result.finish_reason == "stop" and stop not in result.text


async def test_text_prompt_and_statistics(make_orchestrator):
    seen = []
    store = MemoryStore()
    orch = make_orchestrator(store=store, on_iteration=seen.append)
    result = await orch.generate(GenerationRequest(prompt="t1 t2 t3", max_new_tokens=20, method="rd", k=3,
                                                   a=0.5, stop_token_ids=[]))
    assert result.seed is not None and len(result.token_ids) == 20
    assert seen == result.iterations
    assert {r.method for r in seen} == {"rd"} and all(r.a == 0.5 and r.k == 3 for r in seen)
    assert [r.position for r in seen] == [3 + sum(len(x.emitted) for x in seen[:i]) for i in range(len(seen))]
    _check_stats(result)
    calibration = await store.get_calibration(orch.pair_key)
    assert calibration["rd:drafted_tokens"] == result.stats.drafted_tokens
    assert calibration["rd:accepted_tokens"] == result.stats.accepted_tokens
    assert math.isclose(result.stats.tokens_per_second, 20 / result.stats.seconds)


# ------------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("changes,field", [
    ({"prompt_ids": []}, "prompt"),
    ({"prompt_ids": None, "prompt": ""}, "prompt"),
    ({"prompt": "t1"}, "prompt"),  # both text and ids
    ({"method": "beam"}, "method"),
    ({"k": 0}, "k"),
    ({"k": 17}, "k"),
    ({"tree_budget": 0}, "tree_budget"),
    ({"a": -0.1}, "a"),
    ({"a": 1.5}, "a"),
    ({"a": float("nan")}, "a"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 5000}, "max_new_tokens"),
    ({"prompt_ids": [1] * 128}, "prompt"),
    ({"prompt_ids": [1, 6]}, "prompt_ids"),
    ({"stop_token_ids": [9]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"),
])
async def test_invalid_requests_name_the_field(make_orchestrator, changes, field):
    orch = make_orchestrator()
    fields = {"prompt_ids": [1, 2], "max_new_tokens": 4, "method": "rd"} | changes
    with pytest.raises(InvalidRequest, match=field):
        await orch.generate(GenerationRequest(**fields))


async def test_vocabulary_mismatch_is_refused(make_orchestrator):
    orch = make_orchestrator("vocab5")
    with pytest.raises(InvalidRequest, match="vocabulary mismatch"):
        await orch.start()


async def test_context_window_ends_generation(make_orchestrator):
    orch = make_orchestrator()
    result = await orch.generate(_request([1] * 125, 10, "token", k=4))
    assert len(result.token_ids) == 3 and result.finish_reason == "length"


# ------------------------------------------------------------------------------------------------
# store, resume after an orchestrator's death


LEASE_S = 0.2  # the dying orchestrators' resume lease: a dead run's record is resumable after it


async def _die_after(orch, request, chunks: int):
    """Consume `chunks` chunks, then abandon the stream without closing it (as a dead process would).

    The caller keeps the returned generator referenced, so its clean-up cannot run before the
    resume (the event loop closes it at the end of the test).
    """
    stream = orch.generate_stream(request)
    for _ in range(chunks):
        await stream.__anext__()
    async with asyncio.timeout(30):  # its run stops once it has paused for its reader (admission.paced)
        while orch.admission_stats()["paused"] != 1:
            await asyncio.sleep(0.01)
    return stream


@pytest.mark.parametrize("backend", ["memory", "redis"])
@pytest.mark.slow  # starts processes (tests/conftest.py, tiers)
async def test_resume_after_orchestrator_death(make_orchestrator, loaded, request, backend):
    def new_store():
        if backend == "memory":
            return shared
        return RedisStore(request.getfixturevalue("redis_url"), prefix=f"test-resume-{id(request)}")

    shared = MemoryStore()
    prompt = PROMPTS[3]
    req = _request(prompt, 30, "ersd", SAMPLE, seed=31, k=2, request_id=f"resume-{backend}")
    first = make_orchestrator(store=new_store(), resume_lease_seconds=LEASE_S)
    abandoned = await _die_after(first, req, 3)
    record = await first.store.get_request(req.request_id)
    assert record.status == "running" and 3 <= len(record.token_ids) < 30

    second = make_orchestrator(store=new_store())
    with pytest.raises(StillRunning, match="still running"):  # its lease has not run out yet
        await second.resume(req.request_id)
    await asyncio.sleep(LEASE_S)
    resumed = await second.resume(req.request_id)
    assert resumed.token_ids[: len(record.token_ids)] == record.token_ids
    # exact: the same seeded race decoding as an uninterrupted run
    assert resumed.token_ids == race_reference(loaded["target"].model, prompt, 30, 31, SAMPLE)
    assert resumed.stats.new_tokens == 30 and resumed.stats.iterations > len(resumed.iterations)
    done = await second.store.get_request(req.request_id)
    assert done.status == "done" and done.token_ids == resumed.token_ids and done.text == resumed.text
    third = make_orchestrator(store=new_store())
    again = await third.resume(req.request_id)  # finished: returned as stored
    assert again.token_ids == resumed.token_ids and again.finish_reason == "length"
    assert abandoned is not None
    for orch in (first, second, third):
        await orch.store.close()


async def test_resume_of_a_sampled_rd_request_continues_from_its_tokens(make_orchestrator):
    store = MemoryStore()
    req = _request(PROMPTS[0], 20, "rd", SAMPLE, seed=5, k=3, a=0.5, request_id="rd-resume")
    abandoned = await _die_after(make_orchestrator(store=store, resume_lease_seconds=LEASE_S), req, 2)
    stored = (await store.get_request("rd-resume")).token_ids
    await asyncio.sleep(LEASE_S)
    resumed = await make_orchestrator(store=store).resume("rd-resume")
    assert resumed.token_ids[: len(stored)] == stored and len(resumed.token_ids) == 20
    chunks = [c async for c in make_orchestrator(store=store).resume_stream("rd-resume")]
    assert len(chunks) == 1 and chunks[0].result.token_ids == resumed.token_ids
    assert abandoned is not None


async def test_resume_unknown_request(make_orchestrator):
    with pytest.raises(NotFound, match="request_id: no stored request 'nope'"):
        await make_orchestrator().resume("nope")


async def test_concurrent_requests_share_the_engines(make_orchestrator, loaded):
    orch = make_orchestrator()
    requests = [_request(p, 16, "ersd", SAMPLE, seed=i, k=2) for i, p in enumerate(PROMPTS)]
    results = await asyncio.gather(*(orch.generate(r) for r in requests))
    for i, (prompt, result) in enumerate(zip(PROMPTS, results, strict=True)):
        assert result.token_ids == race_reference(loaded["target"].model, prompt, 16, i, SAMPLE)


async def test_calibrated_tree_shapes(make_orchestrator):
    store = MemoryStore()
    warm = make_orchestrator(store=store)
    for seed in range(4):
        await warm.generate(_request(PROMPTS[0], 12, "gsd-tree", seed=seed, k=6))
    counts = await store.get_calibration(warm.pair_key)
    assert counts["gsd-tree:rank_trials@0"] >= counts["gsd-tree:rank_trials@1"] > 0
    calibrated = make_orchestrator(store=store, calibration_min_samples=5)
    result = await calibrated.generate(_request(PROMPTS[0], 4, "gsd-tree", seed=9, k=6, request_id="cal"))
    used = (await store.get_request("cal")).params["rank_acceptance"]
    measured = {key.split(":", 1)[1]: v for key, v in counts.items() if key.startswith("gsd-tree:")}
    assert used == rank_acceptance_from_calibration(measured, calibrated.config.rank_acceptance, 5)
    assert used != calibrated.config.rank_acceptance
    assert len(result.token_ids) == 4


def test_overlap_arithmetic():
    draft = [(0.0, 1.0), (2.0, 3.0)]
    verify = [(0.5, 2.5), (2.4, 2.6)]  # overlapping verifier calls count once
    assert union(verify) == [(0.5, 2.6)]
    assert overlap(draft, verify) == pytest.approx(0.5 + 0.6)
    assert overlap([(0.0, 1.0)], [(1.0, 2.0)]) == 0.0
