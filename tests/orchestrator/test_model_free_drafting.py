"""Model-free draft sources through the real orchestrator and verifier engine (tiny models).

- Every source × method keeps the target's law (chi-square against the exact law by enumeration),
  model-free drafts were really verified (drafted tokens by source), and a broken rule for
  deterministic drafts fails the same test (the negative control).
- ERSD's seeded identity holds for every source: the same seed gives target-only race decoding's
  tokens, whichever source drafted and however much of it was accepted.
- The suffix cache carries one request's tokens to the next; refusals name the fields.
- A streamed request's first token comes from a pass without a draft; a unary call drafts there.
"""

from __future__ import annotations

import os

import pytest
import torch

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.run import cache_partition
from orchestrator.speculation import Orchestrator
from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.errors import InvalidRequest
from specdec.generation import GenerationRequest
from specdec.methods import METHODS
from specdec.rpc.security import ANONYMOUS
from specdec.runtime.loading import load_model
from specdec.runtime.tiny import save_tiny_model
from specdec.sampling import SamplingParams
from specdec.verification.base import VerifyResult
from tests.orchestrator.helpers import (
    LENGTH,
    P_THRESHOLD,
    PROMPT,
    exact_distribution,
    p_values,
    race_reference,
    sample,
)

KEEPS_DRAFT_SOURCE_DEFAULT = True  # tests/orchestrator/conftest.py
SAMPLES = int(os.environ.get("SPECDEC_FIDELITY_SAMPLES", "1000"))
VOCAB = 6
SAMPLING = SamplingParams(1.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("model-free")
    target = load_model(save_tiny_model(root / "target", vocab_size=VOCAB, seed=111, num_layers=1), threads=1)
    draft = load_model(save_tiny_model(root / "draft", vocab_size=VOCAB, seed=222, num_layers=1), threads=1)
    return draft, target


@pytest.fixture(scope="module")
def exact(models):
    return exact_distribution(models[1].model, PROMPT, SAMPLING, VOCAB)


def orchestrator(models, *, drafter: bool, **config) -> tuple[Orchestrator, list]:
    draft, target = models
    client = InProcessDrafterClient(DrafterEngine(draft)) if drafter else None
    orch = Orchestrator(client, InProcessVerifierClient(VerifierEngine(target)),
                        OrchestratorConfig(pipeline=False, **config))
    records: list = []
    orch.on_iteration = records.append
    return orch, records


def drafted_by(records: list, source: str) -> int:
    return sum(r.num_drafted for r in records if r.source == source)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["token", "block", "ersd", "gsd-tree"])
@pytest.mark.parametrize("source", ["lookup", "suffix"])
async def test_each_model_free_source_keeps_the_target_law(models, exact, source, method):
    orch, records = orchestrator(models, drafter=False)
    knobs = {"draft_source": source, **({"k": 4} if method == "gsd-tree" else {})}
    samples = await sample(orch, method, knobs, SAMPLING, range(SAMPLES))
    assert drafted_by(records, source) > SAMPLES // 4, f"{source} drafted too little to test anything"
    joint, first = p_values(samples, exact)
    assert min(joint, first) > P_THRESHOLD, f"{source}/{method}: chi-square p = {joint:.2e} / {first:.2e}"


async def unseeded_samples(orch: Orchestrator, method: str, source: str | None) -> list[tuple]:
    """Requests with no seed, one after another: each finds the earlier ones in the suffix cache."""
    samples = []
    for _ in range(SAMPLES):
        request = GenerationRequest(prompt_ids=PROMPT, max_new_tokens=LENGTH, sampling=SAMPLING,
                                    method=method, stop_token_ids=[], draft_source=source)
        samples.append(tuple((await orch.generate(request)).token_ids))
    return samples


@pytest.mark.slow
@pytest.mark.parametrize("method", ["token", "ersd"])
async def test_the_shared_suffix_cache_keeps_the_target_law(models, exact, method):
    """Unseeded requests draft from the cache of earlier requests' outputs."""
    orch, records = orchestrator(models, drafter=False)
    samples = await unseeded_samples(orch, method, "suffix")
    assert drafted_by(records, "suffix") > SAMPLES // 4
    joint, first = p_values(samples, exact)
    assert min(joint, first) > P_THRESHOLD, f"suffix cache/{method}: chi-square p = {joint:.2e} / {first:.2e}"


@pytest.mark.slow
async def test_hybrid_mixes_model_and_model_free_drafts_and_keeps_the_law(models, exact):
    """Unseeded requests (the timed choice) through an orchestrator with a draft model."""
    orch, records = orchestrator(models, drafter=True)
    samples = await unseeded_samples(orch, "token", None)
    assert drafted_by(records, "suffix") > 0 and drafted_by(records, "model") > 0, "both sources drafted"
    joint, first = p_values(samples, exact)
    assert min(joint, first) > P_THRESHOLD, f"hybrid: chi-square p = {joint:.2e} / {first:.2e}"


async def test_a_seeded_request_drafts_from_its_own_tokens_only(models):
    """Requests with one seed share random streams: a seeded request must not draft from another's
    continuation (docs/algorithms.md §15), though its tokens join the cache for unseeded readers."""
    orch, records = orchestrator(models, drafter=False)
    request = GenerationRequest(prompt_ids=[1, 2, 4, 0, 3, 5, 2], max_new_tokens=16, sampling=SAMPLING,
                                seed=5,
                                method="token", stop_token_ids=[], draft_source="suffix")
    first = await orch.generate(request)
    assert orch.suffix_caches.of(cache_partition(ANONYMOUS)).cached_requests == 1
    again = await orch.generate(request)
    assert again.token_ids == first.token_ids  # the same seed replays
    # Had the second run read the first from the cache, it would have drafted its whole continuation.
    drafts = [(r.position, r.num_drafted, r.accepted) for r in first.iterations]
    assert [(r.position, r.num_drafted, r.accepted) for r in again.iterations] == drafts
    assert any(n for _, n, _ in drafts), "the run drafted from its own n-grams"
    unseeded = await orch.generate(GenerationRequest(prompt_ids=request.prompt_ids, max_new_tokens=16,
                                                     sampling=SamplingParams(0.0), method="token",
                                                     stop_token_ids=[], draft_source="suffix"))
    assert unseeded.iterations[0].num_drafted >= 8, "an unseeded reader finds the seeded runs' tokens"


def _greedy_child(tree, target, draft, params, source) -> VerifyResult:
    """A broken rule for deterministic drafts: accept a child whenever the target gives it at least
    a fifth of its mass, without drawing (it over-accepts likely drafts)."""
    node, tokens, accepted, flags = -1, [], [], []
    while True:
        row = target.row(node + 1)
        children = tree.children(node)
        match = next((c for c in children if float(row[tree.tokens[c]]) >= 0.2), None)
        if match is None:
            tokens.append(source.categorical(row))
            flags += [False] if children else []
            return VerifyResult(tokens, accepted, flags)
        tokens.append(tree.tokens[match])
        accepted.append(match)
        flags.append(True)
        node = match


@pytest.mark.slow
async def test_negative_control_a_broken_deterministic_rule_fails(models, exact, monkeypatch):
    import specdec.methods as methods

    monkeypatch.setitem(methods.METHODS, "token", _with_rule(METHODS["token"], "tests.orchestrator."
                                                             "test_model_free_drafting:_greedy_child"))
    orch, records = orchestrator(models, drafter=False)
    samples = await sample(orch, "token", {"draft_source": "suffix"}, SAMPLING, range(SAMPLES))
    assert drafted_by(records, "suffix") > 0
    joint, first = p_values(samples, exact)
    assert min(joint, first) < P_THRESHOLD, f"a broken rule passed: p = {joint:.2e} / {first:.2e}"


def _with_rule(method, rule: str):
    import dataclasses

    return dataclasses.replace(method, deterministic_rule=rule)


@pytest.mark.parametrize("source", ["lookup", "suffix", "hybrid"])
async def test_ersd_seeded_identity_for_every_source(models, source):
    """Same seed ⇒ target-only race decoding's tokens, whatever the source drafted."""
    orch, records = orchestrator(models, drafter=source == "hybrid")
    prompt, n = [0, 3, 0, 3, 1], 12
    for seed in range(12):
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=n, sampling=SAMPLING, seed=seed,
                                    method="ersd", stop_token_ids=[], draft_source=source)
        result = await orch.generate(request)
        assert result.token_ids == race_reference(models[1].model, prompt, n, seed, SAMPLING), seed
    model_free = "lookup" if source == "hybrid" else source  # a seeded hybrid looks up its own n-grams
    assert drafted_by(records, model_free) > 0, "model-free drafts were verified"


async def test_suffix_cache_carries_a_finished_request_to_the_next(models):
    orch, records = orchestrator(models, drafter=False)
    request = GenerationRequest(prompt_ids=[1, 2, 4, 0, 3, 5, 2], max_new_tokens=16,
                                sampling=SamplingParams(0.0),
                                method="token", stop_token_ids=[], draft_source="suffix")
    first = await orch.generate(request)
    before = len(records)
    second = await orch.generate(request)
    assert second.token_ids == first.token_ids  # greedy
    accepted = sum(r.accepted for r in records[before:] if r.source == "suffix")
    assert accepted >= len(second.token_ids) // 2, "the second run copies the first from the cache"
    assert second.stats.sources["suffix"].accepted_tokens == accepted
    assert orch.suffix_caches.of(cache_partition(ANONYMOUS)).cached_requests == 2


@pytest.mark.parametrize("request_fields, drafter, message", [
    ({"method": "rd", "draft_source": "lookup"}, True, "draft_source 'lookup' with method 'rd'"),
    ({"method": "token", "draft_source": "model"}, False, "without a draft model"),
    ({"method": "token", "draft_source": "ngram"}, True, "unknown source 'ngram'"),
])
async def test_refusals_name_the_fields(models, request_fields, drafter, message):
    orch, _ = orchestrator(models, drafter=drafter)
    await orch.start()
    with pytest.raises(InvalidRequest, match=message):
        await orch.generate(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=2, **request_fields))


async def test_rd_keeps_the_model_under_the_hybrid_default(models):
    orch, records = orchestrator(models, drafter=True)
    result = await orch.generate(GenerationRequest(prompt_ids=[0, 3, 0, 3, 0, 3], max_new_tokens=8,
                                                   method="rd", seed=3, stop_token_ids=[]))
    assert len(result.token_ids) == 8
    assert all(r.source in ("", "model") for r in records)


def test_deterministic_drafts_carry_no_rows(models):
    """A model-free verify sends tokens only; rows with it are refused (the engine's check)."""
    from specdec.engine.api import VerifyRequest
    from specdec.verification.base import MethodParams

    engine = VerifierEngine(models[1])
    request = VerifyRequest(session_id="s", base_len=0, append=[0, 3], tree_tokens=[0, 3],
                            tree_parents=[-1, 0], method="token", params=MethodParams(seed=1),
                            sampling=SAMPLING, deterministic=True,
                            draft_probs=torch.full((3, VOCAB), 1 / VOCAB))
    with pytest.raises(InvalidRequest, match="deterministic: a model-free draft carries no draft rows"):
        engine.verify(request)
    request.draft_probs = None
    outcome = engine.verify(request)
    assert 1 <= len(outcome.tokens) <= 3
    with pytest.raises(InvalidRequest, match="deterministic: method 'rd'"):
        engine.verify(VerifyRequest(session_id="t", base_len=0, append=[0], tree_tokens=[3],
                                    tree_parents=[-1], method="rd",
                                    params=MethodParams(seed=1, a=0.5, k_max=2), sampling=SAMPLING,
                                    deterministic=True))


async def test_a_streamed_request_first_token_comes_from_a_pass_without_a_draft(models):
    """The hybrid's rule for streamed requests (drafting.hybrid, "The first token"), through the real
    loop: with the suffix cache holding the whole answer, a unary call drafts in its prompt's pass, a
    stream makes its first token alone and drafts from its second pass on; both emit the same tokens."""
    orch, records = orchestrator(models, drafter=False)
    # Passes of the tiny target take a millisecond or two, noisily: a fixed W(n) = 10 ms · (1 + n/20)
    # keeps the choice off the clock (a draft then pays wherever the cache has the answer).
    orch.source_estimates.iteration_seconds = lambda positions: 0.01 * (1 + positions / 20)  # type: ignore[method-assign]
    request = GenerationRequest(prompt_ids=[1, 2, 4, 0, 3, 5, 2], max_new_tokens=16,
                                sampling=SamplingParams(0.0), method="token", stop_token_ids=[])
    first = await orch.generate(request)  # fills the suffix cache
    before = len(records)
    unary = await orch.generate(request)
    unary_records = records[before:]
    before = len(records)
    chunks = [chunk async for chunk in orch.generate_stream(request)]
    streamed_records = records[before:]
    assert unary.token_ids == first.token_ids == [t for chunk in chunks for t in chunk.token_ids]
    assert unary_records[0].num_drafted > 0, "a unary call drafts in its prompt's pass"
    assert streamed_records[0].num_drafted == 0 and chunks[0].token_ids == first.token_ids[:1]
    assert drafted_by(streamed_records[1:], "suffix") > 0, "the stream drafts after its first token"
