"""Pipelined speculation (orchestrator.drafting.model) through the real code path.

The drafter pre-drafts block n+1 from the speculative context committed + x_1..x_k + b while
the verifier checks block n; the block is used only when that context came true. Checked here:
greedy output is Hugging Face's greedy generate; with a seed the pipelined run emits exactly the
tokens of the sequential run (the pre-draft for context length L uses the drafter's stream of a
fresh draft at L); a chi-square test at T = 1 through the whole stack; and, with slowed models
and drafter = target, the pre-drafts are used and their calls overlap the verifier's.
"""

from __future__ import annotations

import asyncio
import time
from itertools import zip_longest
from types import SimpleNamespace

import pytest
import torch

from orchestrator.adaptation import PairEstimates
from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.drafting import DraftingContext, proposer_for
from orchestrator.drafting.model import ModelProposer, PreDraft, chain
from orchestrator.speculation import Orchestrator
from specdec.engine.api import DraftResult
from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.errors import InvalidRequest
from specdec.generation import GenerationRequest, GenerationStats
from specdec.methods import get_method
from specdec.runtime.loading import load_model
from specdec.runtime.tiny import save_tiny_model
from specdec.sampling import SamplingParams
from tests.orchestrator.helpers import (
    P_THRESHOLD,
    PROMPT,
    FlakyDrafter,
    exact_distribution,
    hf_greedy,
    make_run,
    p_values,
    sample,
)

GREEDY = SamplingParams(temperature=0.0)
SAMPLE = SamplingParams(temperature=1.0)
PROMPTS = [[1, 2, 3], [0], [4, 4, 1, 0, 2]]
PIPELINED = [
    ("token", {"k": 3}),
    ("block", {"k": 4}),
    ("ersd", {"k": 3}),
    ("rd", {"k": 2, "a": 1.0}),  # K = k_max at every position: always pipelined
    ("rd", {"k": 3, "a": 0.7}),  # pipelined only where the coins give K = k_max
]
IDS = [f"{m}-" + "-".join(f"{k}{v}" for k, v in knobs.items()) for m, knobs in PIPELINED]


def _request(prompt, n, method, sampling=SAMPLE, seed=0, **kwargs) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), max_new_tokens=n, method=method, sampling=sampling,
                             seed=seed, stop_token_ids=[], **kwargs)


def _check_records(result) -> None:
    stats, records = result.stats, result.iterations
    assert stats.new_tokens == len(result.token_ids) == sum(len(r.emitted) for r in records)
    assert stats.accepted_tokens == sum(r.accepted for r in records) <= stats.drafted_tokens
    assert 0 <= stats.overlap_seconds <= min(stats.draft_seconds, stats.verify_seconds) + 1e-9
    for r in records:
        for start, end in r.draft_intervals + r.verify_intervals:
            assert r.start <= start <= end <= r.end + 1e-6


@pytest.mark.parametrize("method,knobs", PIPELINED, ids=IDS)
async def test_greedy_pipelined_equals_hf_generate(make_orchestrator, loaded, method, knobs):
    orch = make_orchestrator(pipeline=True)
    for prompt in PROMPTS:
        expected = hf_greedy(loaded["target"].model, prompt, 24)
        result = await orch.generate(_request(prompt, 24, method, GREEDY, seed=5, **knobs))
        assert result.token_ids == expected, (method, prompt)
        _check_records(result)


@pytest.mark.parametrize("method,knobs", PIPELINED, ids=IDS)
async def test_seeded_pipelined_equals_sequential(make_orchestrator, method, knobs):
    """Same seed, same tokens: a kept pre-draft is the very block a fresh draft would be."""
    sequential, pipelined = make_orchestrator(), make_orchestrator(pipeline=True)
    used = dropped = 0
    for seed in range(6):
        prompt = PROMPTS[seed % len(PROMPTS)]
        a = await sequential.generate(_request(prompt, 20, method, SAMPLE, seed=seed, **knobs))
        b = await pipelined.generate(_request(prompt, 20, method, SAMPLE, seed=seed, **knobs))
        assert a.token_ids == b.token_ids, (method, seed)
        assert a.stats.pre_drafts_used == a.stats.pre_drafts_dropped == 0
        _check_records(b)
        used += b.stats.pre_drafts_used
        dropped += b.stats.pre_drafts_dropped
        assert b.stats.pre_drafts_used <= b.stats.iterations
    if method != "rd" or knobs["a"] == 1.0:
        assert used > 0, "no pre-draft was ever used: the test would not see a broken pipeline"
        assert dropped > 0, "no pre-draft was ever dropped: the resync path went untested"


GUESSES = {"pipeline_bonus_guesses": 3, "pipeline_rejection_guesses": 2}
GUESSED = [("token", {"k": 1}), ("token", {"k": 3}), ("block", {"k": 2}),
           ("ersd", {"k": 1}), ("ersd", {"k": 3})]
GUESSED_IDS = [f"{m}-k{knobs['k']}" for m, knobs in GUESSED]


@pytest.mark.parametrize("method,knobs", GUESSED, ids=GUESSED_IDS)
async def test_seeded_pipelined_with_guesses_equals_sequential(make_orchestrator, method, knobs):
    """Several guesses per look-ahead: the block of the guess that came true is the fresh draft."""
    sequential, pipelined = make_orchestrator(), make_orchestrator(pipeline=True)
    bonus: list[int] = []
    rejection: list[int] = []
    for seed in range(8):
        prompt = PROMPTS[seed % len(PROMPTS)]
        a = await sequential.generate(_request(prompt, 20, method, SAMPLE, seed=seed, **knobs))
        b = await pipelined.generate(_request(prompt, 20, method, SAMPLE, seed=seed, **knobs, **GUESSES))
        assert a.token_ids == b.token_ids, (method, seed)
        _check_records(b)
        stats = b.stats
        assert sum(stats.pre_draft_bonus_hits) + sum(stats.pre_draft_rejection_hits) == stats.pre_drafts_used
        assert len(stats.pre_draft_bonus_hits) <= 3 and len(stats.pre_draft_rejection_hits) <= 2
        bonus = [x + y for x, y in zip_longest(bonus, stats.pre_draft_bonus_hits, fillvalue=0)]
        rejection = [x + y for x, y in zip_longest(rejection, stats.pre_draft_rejection_hits, fillvalue=0)]
    # The test sees every kind of guess come true (else a broken kind would go unnoticed). A
    # rejection guess needs exactly k - 1 accepted and the residual's token among the draft's
    # likeliest: with unrelated tiny models that is common only for short blocks.
    assert len(bonus) >= 2 and bonus[1] > 0, bonus
    if knobs["k"] <= 2:
        assert sum(rejection) > 0, rejection


@pytest.mark.parametrize("method,knobs", GUESSED, ids=GUESSED_IDS)
async def test_greedy_pipelined_with_guesses_equals_hf_generate(make_orchestrator, loaded, method, knobs):
    orch = make_orchestrator(pipeline=True, pipeline_bonus_guesses=2, pipeline_rejection_guesses=2)
    for prompt in PROMPTS:
        result = await orch.generate(_request(prompt, 20, method, GREEDY, seed=5, **knobs))
        assert result.token_ids == hf_greedy(loaded["target"].model, prompt, 20), (method, prompt)
        _check_records(result)


async def test_automatic_bonus_guesses_follow_the_block_length(make_orchestrator, engines):
    """Default: 2 bonus guesses for one-token blocks, 1 for longer ones; an explicit count wins."""
    seen: set[tuple[int, int, int]] = set()

    class Recording(InProcessDrafterClient):
        async def lookahead(self, request):
            seen.add((request.k, request.bonus_guesses, request.rejection_guesses))
            return await super().lookahead(request)

    for k, knobs in ((1, {}), (3, {}), (2, {"pipeline_bonus_guesses": 4, "pipeline_rejection_guesses": 1})):
        orch = make_orchestrator(drafter=Recording(engines["draft"]), pipeline=True)
        await orch.generate(_request(PROMPTS[0], 16, "token", SAMPLE, seed=2, k=k, **knobs))
    assert seen == {(1, 2, 0), (3, 1, 0), (2, 4, 1)}


async def test_guess_counts_are_validated_and_rd_makes_no_rejection_guesses(make_orchestrator, loaded):
    orch = make_orchestrator(pipeline=True)
    for field, value in (("pipeline_bonus_guesses", 0), ("pipeline_bonus_guesses", 17),
                         ("pipeline_rejection_guesses", -1), ("pipeline_rejection_guesses", 17)):
        with pytest.raises(InvalidRequest, match=field):
            await orch.generate(_request(PROMPTS[0], 4, "token", GREEDY, **{field: value}))
    result = await orch.generate(_request(PROMPTS[0], 16, "rd", SAMPLE, seed=1, k=2, a=1.0, **GUESSES))
    assert result.stats.pre_drafts_used > 0 and result.stats.pre_draft_rejection_hits == []


async def test_request_override_and_validation(make_orchestrator, engines):
    orch = make_orchestrator(drafter="self")  # drafter = target: greedy acceptance is 100%
    off = await orch.generate(_request(PROMPTS[0], 16, "token", GREEDY, k=3))
    on = await orch.generate(_request(PROMPTS[0], 16, "token", GREEDY, k=3, pipeline=True))
    assert on.token_ids == off.token_ids
    assert off.stats.pre_drafts_used == 0 and on.stats.pre_drafts_used > 0
    assert on.stats.pre_drafts_dropped <= 1  # only a guess at the very end can go unused
    forced_off = await make_orchestrator(drafter="self", pipeline=True).generate(
        _request(PROMPTS[0], 16, "token", GREEDY, k=3, pipeline=False))
    assert forced_off.stats.pre_drafts_used == 0
    with pytest.raises(InvalidRequest, match="pipeline"):
        await orch.generate(_request(PROMPTS[0], 4, "token", GREEDY, pipeline="yes"))


@pytest.mark.parametrize("down", [{1}, {2}, {3, 4}], ids=["first-lookahead", "second-call", "used-then-down"])
async def test_drafter_lost_during_a_pre_draft(make_orchestrator, engines, loaded, down):
    """A lost look-ahead call costs only the look-ahead: the verified block stands, output is exact."""
    flaky = FlakyDrafter(InProcessDrafterClient(engines["self"]), down_calls=down)
    orch = make_orchestrator(drafter=flaky, pipeline=True, drafter_retry_seconds=0.0)
    result = await orch.generate(_request(PROMPTS[2], 20, "token", GREEDY, k=2))
    assert result.token_ids == hf_greedy(loaded["target"].model, PROMPTS[2], 20)
    assert flaky.refused == len(down)
    _check_records(result)


async def test_tree_methods_ignore_the_flag(make_orchestrator, loaded):
    orch = make_orchestrator(pipeline=True)
    for method, knobs in (("gsd-tree", {"k": 6}), ("ersd", {"tree_budget": 6})):
        result = await orch.generate(_request(PROMPTS[0], 12, method, GREEDY, **knobs))
        assert result.token_ids == hf_greedy(loaded["target"].model, PROMPTS[0], 12)
        assert result.stats.pre_drafts_used == result.stats.pre_drafts_dropped == 0


# ------------------------------------------------------------------------------------------------
# overlap with slowed models


@pytest.fixture
def slow_self_pair(model_dirs):
    """Verifier on the target, drafter on its own copy of the target; every forward sleeps."""
    sleep_s = 0.02

    def slow(loaded_model):
        loaded_model.model.register_forward_pre_hook(lambda module, args: time.sleep(sleep_s))
        return loaded_model

    return (DrafterEngine(slow(load_model(model_dirs["target"], threads=1))),
            VerifierEngine(slow(load_model(model_dirs["target"], threads=1))))


async def test_pipelined_drafts_overlap_verification(slow_self_pair, loaded):
    drafter, verifier = slow_self_pair
    results = {}
    for on in (False, True):
        orch = Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier),
                            OrchestratorConfig(pipeline=on))
        results[on] = await orch.generate(_request(PROMPTS[0], 24, "token", GREEDY, k=3))
    sequential, pipelined = results[False], results[True]
    assert pipelined.token_ids == sequential.token_ids == hf_greedy(loaded["target"].model, PROMPTS[0], 24)
    assert sequential.stats.overlap_seconds <= 1e-9
    assert pipelined.stats.pre_drafts_used >= 3, pipelined.stats
    assert pipelined.stats.overlap_seconds > 0.3 * pipelined.stats.verify_seconds, pipelined.stats
    # iterations that verified a pre-draft made no drafter call before the verifier's
    ahead = [r for r in pipelined.iterations[1:] if r.drafted and r.draft_intervals
             and min(s for s, _ in r.draft_intervals) >= min(s for s, _ in r.verify_intervals)]
    assert len(ahead) >= pipelined.stats.pre_drafts_used - 1
    _check_records(pipelined)


# ------------------------------------------------------------------------------------------------
# fidelity at T = 1 (same machinery and thresholds as test_fidelity.py)

SAMPLES = 1500  # the pre-drafted-only negative control below needs them (at 1000 it passed at p = 0.016)
# k = 1: a pre-draft fits in 3 tokens; rd at a = 1 draws K = k_max everywhere, so it always pipelines
FIDELITY = [("token", {"k": 1}), ("block", {"k": 1}), ("ersd", {"k": 1}), ("rd", {"k": 1, "a": 1.0}),
            ("token", {"k": 1, **GUESSES}), ("ersd", {"k": 1, **GUESSES})]
FIDELITY_IDS = [m + ("+guesses" if "pipeline_bonus_guesses" in knobs else "") for m, knobs in FIDELITY]


@pytest.fixture(scope="module")
def fidelity_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline-fidelity")
    target = load_model(save_tiny_model(root / "target", vocab_size=6, seed=111, num_layers=1), threads=1)
    draft = load_model(save_tiny_model(root / "draft", vocab_size=6, seed=222, num_layers=1), threads=1)
    return target, VerifierEngine(target), DrafterEngine(draft)


@pytest.mark.slow
@pytest.mark.parametrize("method,knobs", FIDELITY, ids=FIDELITY_IDS)
async def test_pipelined_output_is_distributed_as_the_target(fidelity_pair, method, knobs):
    target, verifier, drafter = fidelity_pair
    stats = []
    orch = Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier),
                        OrchestratorConfig(pipeline=True),
                        on_iteration=None)
    first = 7_000_000 + 1_000_000 * FIDELITY.index((method, knobs))
    real_generate = orch.generate

    async def generate(request):
        result = await real_generate(request)
        stats.append(result.stats)
        return result

    orch.generate = generate
    samples = await sample(orch, method, knobs, SamplingParams(1.0), range(first, first + SAMPLES))
    exact = exact_distribution(target.model, PROMPT, SamplingParams(1.0), 6)
    joint, first_p = p_values(samples, exact)
    assert min(joint, first_p) > P_THRESHOLD, f"{method}: chi-square p = {joint:.2e} / {first_p:.2e}"
    used = sum(s.pre_drafts_used for s in stats)
    assert used > SAMPLES // 10, f"pre-drafts used in only {used} of {SAMPLES} requests"


@pytest.mark.slow
@pytest.mark.parametrize("method, broken", [("token", False), ("ersd", False), ("token", True)],
                         ids=["token", "ersd", "token-broken"])
async def test_predrafted_only_output_is_distributed_as_the_target(
    fidelity_pair, method, broken, monkeypatch
):
    """Requests whose draft length is picked online (no k, no seed) verify a block only when a
    look-ahead pre-drafted it, and take target-only steps while the drafter looks ahead otherwise
    (orchestrator.drafting.model, pre-drafted only); both kinds must be in the sample. An
    unseeded request draws its seed from `secrets`: a counter here, so every request's streams are
    distinct and known.

    Negative case (`broken`): the same loop, but a pre-draft is verified only when its first token is
    not 0 — the choice to draft now reads the draft's value, which biases token verification (the
    verified drafts no longer follow q), and the chi-square test must fail. Its drafter is a copy of
    the target, so that many iterations draft (the bias shows only in those)."""
    import orchestrator.run as run_module

    seeds = iter(range(13_000_000 + 1_000_000 * ["token", "ersd"].index(method), 14_000_000 + 10**6))
    monkeypatch.setattr(run_module, "secrets", SimpleNamespace(randbits=lambda bits: next(seeds)))
    if broken:
        honest = ModelProposer.has_predraft
        monkeypatch.setattr(ModelProposer, "has_predraft",
                            lambda self, committed, k: honest(self, committed, k)
                            and self.predraft.draft.tokens[0] != 0)
    target, verifier, drafter = fidelity_pair
    if broken:
        drafter = DrafterEngine(load_model(target.directory, threads=1))
    orch = Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier),
                        OrchestratorConfig(pipeline=True))
    kinds = {"drafted": 0, "steps": 0}

    async def one() -> tuple:
        result = await orch.generate(GenerationRequest(
            prompt_ids=PROMPT, max_new_tokens=4, sampling=SAMPLE, method=method, stop_token_ids=[]))
        drafted = sum(r.drafted for r in result.iterations)
        assert result.stats.pre_drafts_used == drafted  # never a fresh draft
        kinds["drafted"] += drafted
        kinds["steps"] += len(result.iterations) - drafted
        return tuple(result.token_ids[:3])

    samples: list[tuple] = []
    for _ in range(0, SAMPLES, 8):
        samples += await asyncio.gather(*(one() for _ in range(8)))
    exact = exact_distribution(target.model, PROMPT, SamplingParams(1.0), 6)
    joint, first_p = p_values(samples, exact)
    assert min(kinds.values()) > SAMPLES // 10, kinds
    if broken:
        assert min(joint, first_p) < P_THRESHOLD, f"a draft-dependent choice passed: p = {joint:.2e}"
    else:
        assert min(joint, first_p) > P_THRESHOLD, f"{method}: chi-square p = {joint:.2e} / {first_p:.2e}"


# ------------------------------------------------------------------------------------------------
# adaptive draft length: a pre-draft grows until the verifier answers (pipeline_max_k > 0)


async def test_adaptive_predrafts_grow_while_the_verifier_works(model_dirs, loaded):
    """Drafter = target (greedy pre-drafts come true); a verifier 10x slower lets them grow past k."""

    def slowed(sleep_s: float):
        loaded_model = load_model(model_dirs["target"], threads=1)
        loaded_model.model.register_forward_pre_hook(lambda module, args: time.sleep(sleep_s))
        return loaded_model

    orch = Orchestrator(InProcessDrafterClient(DrafterEngine(slowed(0.005))),
                        InProcessVerifierClient(VerifierEngine(slowed(0.05))),
                        OrchestratorConfig(pipeline=True, pipeline_max_k=6))
    result = await orch.generate(_request(PROMPTS[0], 30, "token", GREEDY, k=2))
    assert result.token_ids == hf_greedy(loaded["target"].model, PROMPTS[0], 30)
    assert result.stats.pre_drafts_used >= 2, result.stats
    lengths = [r.num_drafted for r in result.iterations]
    assert max(lengths) > 2 and all(n <= 6 for n in lengths), lengths
    _check_records(result)


@pytest.mark.parametrize("method,knobs", PIPELINED[:3], ids=IDS[:3])
async def test_adaptive_greedy_equals_hf_generate(make_orchestrator, loaded, method, knobs):
    orch = make_orchestrator(pipeline=True, pipeline_max_k=5)
    for prompt in PROMPTS:
        result = await orch.generate(_request(prompt, 20, method, GREEDY, seed=3, **knobs))
        assert result.token_ids == hf_greedy(loaded["target"].model, prompt, 20), (method, prompt)
        _check_records(result)


async def test_adaptive_cap_is_validated(make_orchestrator):
    orch = make_orchestrator(pipeline=True)
    with pytest.raises(InvalidRequest, match="pipeline_max_k"):
        await orch.generate(_request(PROMPTS[0], 4, "token", GREEDY, pipeline_max_k=10_000))


ADAPTIVE_SAMPLES = 1000


class _LateVerifier:
    """Answers verify calls 80 ms late (without holding the engine), so pre-drafts have time to grow
    although 8 concurrent requests share the one drafter engine."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def verify(self, request):
        outcome = await self.inner.verify(request)
        await asyncio.sleep(0.08)
        return outcome



@pytest.mark.parametrize("method", ["token", "block", "ersd", "rd"])
async def test_adaptive_length_only_where_it_is_exact(make_orchestrator, engines, loaded, method):
    """Block and rd ignore pipeline_max_k: every verified block has length k (a grown pre-draft is
    not exact for block verification, orchestrator.drafting.model); token and ersd blocks grow."""
    seen: list[int] = []

    class Recording(InProcessDrafterClient):
        async def lookahead(self, request):
            seen.append(request.k)
            return await super().lookahead(request)

    orch = make_orchestrator(drafter=Recording(engines["self"]), pipeline=True, pipeline_max_k=6)
    orch.verifier = _LateVerifier(orch.verifier)  # time for the pre-drafts to grow, where they may
    knobs = {"k": 2, "a": 1.0} if method == "rd" else {"k": 2}
    result = await orch.generate(_request(PROMPTS[0], 24, method, GREEDY, **knobs))
    assert result.token_ids == hf_greedy(loaded["target"].model, PROMPTS[0], 24)
    lengths = [r.num_drafted for r in result.iterations if r.drafted]
    assert result.stats.pre_drafts_used > 0, result.stats
    if get_method(method).adaptive_length:
        assert max(lengths) > 2 and set(seen) == {1}, (lengths, seen)  # look-aheads of one, then growth
    else:
        assert set(lengths) == {2} and set(seen) == {2}, (lengths, seen)
    _check_records(result)


def _look_ahead(method: str, config: OrchestratorConfig) -> tuple:
    run = make_run(method=method, config=config)
    proposer = proposer_for(run, DraftingContext(config, PairEstimates))
    assert isinstance(proposer, ModelProposer) and proposer.pipelined
    return run, proposer


def test_growth_follows_the_registry():
    for method in ("token", "block", "ersd", "rd"):
        _, strategy = _look_ahead(method, OrchestratorConfig(pipeline=True, pipeline_max_k=4))
        assert strategy.growing == (method in ("token", "ersd"))
        assert not _look_ahead(method, OrchestratorConfig(pipeline=True))[1].growing


def test_a_grown_pre_draft_is_not_taken_for_a_fixed_length_method():
    rows = torch.rand(4, 6)
    for method, taken in (("token", True), ("block", False)):
        run, strategy = _look_ahead(method, OrchestratorConfig(pipeline=True, pipeline_max_k=4))
        grown = DraftResult([1, 2, 3], [-1, 0, 1], rows)
        strategy.predraft = PreDraft(run.committed, grown)
        step = SimpleNamespace(committed=run.committed, counts=GenerationStats())
        assert (strategy.take(step, 2) is grown) == taken  # type: ignore[arg-type]
        stats = step.counts  # what the loop adds to the run's statistics
        assert (stats.pre_drafts_used, stats.pre_drafts_dropped) == (int(taken), int(not taken))
        assert strategy.predraft is None


def test_chained_one_token_drafts_keep_the_row_layout():
    steps = [DraftResult([t], [-1], torch.full((2, 6), float(t))) for t in (3, 1, 4)]
    chained = chain(steps, want_rows=True)
    assert (chained.tokens, chained.parents) == ([3, 1, 4], [-1, 0, 1])
    assert chained.draft_probs[:, 0].tolist() == [3.0, 1.0, 4.0, 0.0]  # each step's first row; leaf row zero
    assert chain(steps, want_rows=False).draft_probs is None


@pytest.mark.slow
@pytest.mark.parametrize("method", ["token", "ersd"])  # sampled rows chained / races (block: as token)
async def test_adaptive_output_is_distributed_as_the_target(fidelity_pair, method):
    """5 tokens per request, the first 3 tested: pre-drafts of 1 to 3 tokens (by timing) are in them.

    The drafter runs a copy of the target, so that whole pre-drafts come true often (the bonus
    guess is the drafter's argmax); the acceptance rules still see the chained draft rows, and a
    row out of place would change acceptance away from 1 and show in the test.
    """
    target, verifier, _ = fidelity_pair
    drafter = DrafterEngine(load_model(target.directory, threads=1))
    orch = Orchestrator(InProcessDrafterClient(drafter), _LateVerifier(InProcessVerifierClient(verifier)),
                        OrchestratorConfig(pipeline=True, pipeline_max_k=3))
    first = 11_000_000 + 1_000_000 * ["token", "ersd"].index(method)
    lengths: list[int] = []

    async def one(seed: int) -> tuple:
        result = await orch.generate(GenerationRequest(
            prompt_ids=PROMPT, max_new_tokens=5, sampling=SAMPLE, seed=seed, method=method, k=1,
            stop_token_ids=[]))
        lengths.extend(r.num_drafted for r in result.iterations[1:] if r.drafted)
        return tuple(result.token_ids[:3])

    samples: list[tuple] = []
    for start in range(first, first + ADAPTIVE_SAMPLES, 8):
        samples += await asyncio.gather(*(one(s) for s in range(start, start + 8)))
    exact = exact_distribution(target.model, PROMPT, SamplingParams(1.0), 6)
    joint, first_p = p_values(samples, exact)
    assert min(joint, first_p) > P_THRESHOLD, f"{method}: chi-square p = {joint:.2e} / {first_p:.2e}"
    grown = sum(n > 1 for n in lengths)
    assert grown > ADAPTIVE_SAMPLES // 10, f"only {grown} grown pre-drafts verified"
