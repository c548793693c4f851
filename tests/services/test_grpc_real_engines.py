"""The transport must not change results: real engines on tiny random models, over gRPC vs direct.

A speculative loop written here (draft → [score] → verify, sequence drafts) runs once against
the engines through gRPC servers on 127.0.0.1 and once against the same engines called
directly; with the same seed every draft, every draft row (bit for bit) and every emitted token
must agree. A chi-square test then checks, through gRPC, that method "token" at T = 1 yields
length-3 continuations distributed as the target model (exact probabilities by enumeration).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from scipy import stats as scipy_stats  # noqa: E402

from drafter_service.server import start_drafter_server  # noqa: E402
from orchestrator.clients.grpc_client import (  # noqa: E402
    GrpcDrafterClient,
    GrpcVerifierClient,
)
from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient  # noqa: E402
from orchestrator.server import start_orchestrator_server  # noqa: E402
from orchestrator.speculation import Orchestrator  # noqa: E402
from specdec.client import AsyncClient  # noqa: E402
from specdec.engine.api import DraftRequest, LookaheadRequest, ScoreRequest, VerifyRequest
from specdec.engine.drafter import DrafterEngine  # noqa: E402
from specdec.engine.verifier import VerifierEngine  # noqa: E402
from specdec.errors import InvalidRequest, SessionGone
from specdec.generation import GenerationRequest  # noqa: E402
from specdec.methods import get_method  # noqa: E402
from specdec.rpc.grpc_support import stop_server  # noqa: E402
from specdec.runtime.loading import load_model  # noqa: E402
from specdec.runtime.tiny import save_tiny_model  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.verification.base import MethodParams  # noqa: E402
from tests.helpers import use_draft_rows  # noqa: E402
from verifier_service.server import start_verifier_server  # noqa: E402

pytestmark = pytest.mark.timeout(300)

VOCAB = 6
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpc-tiny")
    target = load_model(save_tiny_model(root / "target", vocab_size=VOCAB, seed=11), threads=1)
    draft = load_model(save_tiny_model(root / "draft", vocab_size=VOCAB, seed=22), threads=1)
    return target, DrafterEngine(draft), VerifierEngine(target)


class Direct:
    """The engines called in-process, behind the same async surface as the gRPC clients."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name):
        method = getattr(self.engine, name)

        async def call(*args):
            return method(*args)

        return call


@dataclass
class Trace:
    tokens: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    rows: list[torch.Tensor | None] = field(default_factory=list)
    outcomes: list[tuple[list[int], list[int], list[bool], int]] = field(default_factory=list)


async def speculate(
    drafter,
    verifier,
    session: str,
    prompt: list[int],
    n_new: int,
    method: str,
    seed: int,
    k: int,
    sampling: SamplingParams,
    use_score: bool = False,
    release: bool = True,
) -> Trace:
    """Sequence-draft speculative decoding over the client protocol, tracking the session protocol."""
    committed = list(prompt)
    drafter_knows = verifier_knows = 0  # committed length each service was last told about
    params = MethodParams(seed=seed)
    spec = get_method(method)
    want = spec.needs_draft_rows
    strategy = spec.draft_strategy
    trace = Trace()
    for _ in range(4 * n_new + 4):  # bounded: every iteration emits at least one token
        if len(committed) - len(prompt) >= n_new:
            break
        draft = await drafter.draft(
            DraftRequest(
                session,
                drafter_knows,
                committed[drafter_knows:],
                list(range(-1, k - 1)),
                sampling,
                seed,
                strategy,
                want,
            )
        )
        drafter_knows = len(committed)
        if use_score:
            await verifier.score(
                ScoreRequest(
                    session, verifier_knows, committed[verifier_knows:], draft.tokens, draft.parents, sampling
                )
            )
        outcome = await verifier.verify(
            VerifyRequest(
                session,
                verifier_knows,
                committed[verifier_knows:],
                draft.tokens,
                draft.parents,
                method,
                params,
                sampling,
                draft.draft_probs,
            )
        )
        committed += outcome.tokens
        verifier_knows = len(committed)
        assert outcome.committed_len == len(committed)
        trace.drafts.append(draft.tokens)
        trace.rows.append(draft.draft_probs)
        trace.outcomes.append(
            (outcome.tokens, outcome.accepted_nodes, outcome.accept_flags, outcome.num_drafted)
        )
    trace.tokens = committed[len(prompt) :][:n_new]
    assert len(trace.tokens) == n_new
    if release:
        await drafter.release(session)
        await verifier.release(session)
    return trace


class Servers:
    def __init__(self, drafter_engine, verifier_engine) -> None:
        self.engines = (drafter_engine, verifier_engine)

    async def __aenter__(self):
        self.drafter_server, dport = await start_drafter_server(self.engines[0])
        self.verifier_server, vport = await start_verifier_server(self.engines[1])
        self.drafter = GrpcDrafterClient(f"127.0.0.1:{dport}", timeout_s=60)
        self.verifier = GrpcVerifierClient(f"127.0.0.1:{vport}", timeout_s=60)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.drafter.close()
        await self.verifier.close()
        await stop_server(self.drafter_server, 1.0)
        await stop_server(self.verifier_server, 1.0)


CASES = [
    ("token", SamplingParams(temperature=1.0), 3),
    ("token", SamplingParams(temperature=0.8, top_k=4, top_p=0.9), 2),
    ("ersd", SamplingParams(temperature=1.0), 3),
    ("ersd", SamplingParams(temperature=0.0), 2),
]


@pytest.mark.parametrize(
    ("method", "sampling", "k"), CASES, ids=[f"{m}-T{s.temperature}-k{k}" for m, s, k in CASES]
)
async def test_grpc_gives_the_same_tokens_as_in_process(engines, method, sampling, k) -> None:
    _, drafter_engine, verifier_engine = engines
    async with Servers(drafter_engine, verifier_engine) as servers:
        assert (await servers.drafter.info()) == drafter_engine.info()
        assert (await servers.verifier.info()) == verifier_engine.info()
        outputs, accepted = set(), 0
        for seed in (0, 1, 2**63 + 17):
            args = (PROMPT, 16, method, seed, k, sampling)
            remote = await speculate(
                servers.drafter, servers.verifier, f"grpc-{method}-{seed}", *args, use_score=seed == 1
            )
            local = await speculate(
                Direct(drafter_engine), Direct(verifier_engine), f"local-{method}-{seed}", *args
            )
            assert remote.tokens == local.tokens
            assert remote.drafts == local.drafts and remote.outcomes == local.outcomes
            for a, b in zip(remote.rows, local.rows, strict=True):
                assert (a is None) == (b is None) == (method == "ersd")
                if a is not None:
                    assert a.dtype == torch.float32 and torch.equal(a, b)
            outputs.add(tuple(remote.tokens))
            accepted += sum(len(o[1]) for o in remote.outcomes)
        if not sampling.greedy:  # the comparison is not vacuous: drafts get accepted, seeds matter
            assert accepted > 0 and len(outputs) > 1


async def test_session_gone_over_grpc_then_resend(engines) -> None:
    _, drafter_engine, verifier_engine = engines
    async with Servers(drafter_engine, verifier_engine) as servers:
        sampling = SamplingParams()
        with pytest.raises(SessionGone):
            await servers.drafter.draft(DraftRequest("never-seen", 3, [], [-1], sampling, 0))
        with pytest.raises(SessionGone):
            await servers.verifier.verify(
                VerifyRequest("never-seen", 3, [], [], [], "ersd", MethodParams(), sampling)
            )
        draft = await servers.drafter.draft(DraftRequest("never-seen", 0, PROMPT, [-1], sampling, 0))
        assert len(draft.tokens) == 1
        assert await servers.verifier.tokenize("t1 t2") == [1, 2]
        assert await servers.verifier.decode([1, 2]) == "t1 t2"


@pytest.mark.parametrize("strategy", ["sample", "race"])
async def test_lookahead_over_grpc_equals_in_process(engines, strategy) -> None:
    """Pipelined look-ahead: same guesses, drafts and rows (bit for bit; leaf rows restored as zeros)."""
    _, drafter_engine, verifier_engine = engines
    request = LookaheadRequest("la-grpc", 0, PROMPT + [4, 5], 2, SamplingParams(), 9, strategy,
                               want_distributions=True, bonus_guesses=3, rejection_guesses=2)
    async with Servers(drafter_engine, verifier_engine) as servers:
        remote = await servers.drafter.lookahead(request)
        with pytest.raises(InvalidRequest, match="bonus_guesses"):
            await servers.drafter.lookahead(LookaheadRequest("la-bad", 0, PROMPT, 1, SamplingParams(), 0,
                                                             bonus_guesses=99))
        with pytest.raises(SessionGone):
            await servers.drafter.lookahead(LookaheadRequest("la-never", 4, [], 1, SamplingParams(), 0))
    request.session_id = "la-local"
    local = drafter_engine.lookahead(request)
    assert len(remote.branches) == len(local.branches) == 5
    for a, b in zip(remote.branches, local.branches, strict=True):
        assert (a.replaces_last, a.token, a.draft.tokens) == (b.replaces_last, b.token, b.draft.tokens)
        assert torch.equal(a.draft.draft_probs, b.draft.draft_probs)


GUESSES = {"pipeline_bonus_guesses": 3, "pipeline_rejection_guesses": 2}
STACK_CASES = [("token", {"k": 3}), ("ersd", {"k": 3}), ("rd", {"k": 2, "a": 0.5}), ("gsd-tree", {"k": 4}),
               ("token", {"k": 1, **GUESSES}), ("ersd", {"k": 1, **GUESSES})]
STACK_IDS = [m + ("+guesses" if "pipeline_bonus_guesses" in knobs else "") for m, knobs in STACK_CASES]


@pytest.mark.parametrize(("method", "knobs"), STACK_CASES, ids=STACK_IDS)
async def test_full_stack_over_grpc_matches_in_process(engines, method, knobs) -> None:
    """AsyncClient → orchestrator server → Orchestrator on gRPC clients → drafter/verifier
    servers gives the same output as the Orchestrator on in-process clients (text prompt too)."""
    _, drafter_engine, verifier_engine = engines
    request = GenerationRequest(
        prompt="t1 t2 t3", max_new_tokens=12, seed=5, method=method, stop_token_ids=[], **knobs
    )
    local_orchestrator = Orchestrator(
        InProcessDrafterClient(drafter_engine), InProcessVerifierClient(verifier_engine)
    )
    local = await local_orchestrator.generate(request)
    await local_orchestrator.close()
    async with Servers(drafter_engine, verifier_engine) as servers:
        remote_orchestrator = Orchestrator(
            GrpcDrafterClient(servers.drafter.address), GrpcVerifierClient(servers.verifier.address)
        )
        server, port = await start_orchestrator_server(remote_orchestrator)
        try:
            async with AsyncClient(f"127.0.0.1:{port}", timeout_s=120) as client:
                remote = await client.generate(request)
                chunks = [chunk async for chunk in client.generate_stream(request)]
        finally:
            await stop_server(server, 1.0)
            await remote_orchestrator.close()
    assert len(local.token_ids) == 12
    assert (remote.token_ids, remote.text, remote.seed) == (local.token_ids, local.text, 5)
    assert [t for chunk in chunks for t in chunk.token_ids] == local.token_ids
    assert chunks[-1].result is not None and chunks[-1].result.token_ids == local.token_ids
    assert remote.stats.iterations == len(remote.iterations) > 0


# rd at a = 0.9: both tails rows (K < k_max, sent up front) and rejections (at a = 0.5 this pair
# accepts every draft).
LEAN_CASES = [("token", {"k": 3}), ("rd", {"k": 3, "a": 0.9}), ("gsd-tree", {"k": 4})]


@pytest.mark.parametrize(("method", "knobs"), LEAN_CASES, ids=[m for m, _ in LEAN_CASES])
async def test_lean_and_full_draft_rows_give_the_same_tokens_over_grpc(engines, monkeypatch, method, knobs):
    """docs/algorithms.md §12: seeded requests through orchestrator → gRPC → engines emit the same
    tokens whether Verify carries every draft row or each node's q plus the rows asked for."""
    _, drafter_engine, verifier_engine = engines
    tokens, asked = {}, {}
    async with Servers(drafter_engine, verifier_engine) as servers:
        for mode in ("lean", "full"):
            use_draft_rows(monkeypatch, mode)
            before = verifier_engine.stats()["draft_rows_requests"]
            orchestrator = Orchestrator(GrpcDrafterClient(servers.drafter.address),
                                        GrpcVerifierClient(servers.verifier.address))
            try:
                tokens[mode] = [(await orchestrator.generate(GenerationRequest(
                    prompt_ids=PROMPT, max_new_tokens=10, seed=seed, method=method, stop_token_ids=[],
                    sampling=SamplingParams(temperature=1.0), **knobs))).token_ids for seed in range(4)]
            finally:
                await orchestrator.close()
            asked[mode] = verifier_engine.stats()["draft_rows_requests"] - before
    assert tokens["lean"] == tokens["full"] and len({tuple(t) for t in tokens["full"]}) > 1
    assert asked["lean"] > 0 and asked["full"] == 0  # lean met rejections and fetched their rows


# ------------------------------------------------------------------------------------ fidelity


def exact_continuations(model, prompt: list[int], length: int) -> dict[tuple[int, ...], float]:
    """P(x_1..x_length | prompt) for every continuation, from full forwards of the target (float64)."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        prefixes = list(probs)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1, :].double()
        rows = torch.softmax(logits, dim=-1)
        probs = {p + (x,): probs[p] * float(rows[i, x]) for i, p in enumerate(prefixes) for x in range(VOCAB)}
    return probs


def chi_square(counts: dict, exact: dict[tuple[int, ...], float], samples: int):
    """Pearson's test with the rare continuations pooled so every bin expects at least 5 samples."""
    observed, expected, rest_obs, rest_exp = [], [], 0, 0.0
    for cont in sorted(exact, key=exact.get, reverse=True):
        if exact[cont] * samples >= 5:
            observed.append(counts.get(cont, 0))
            expected.append(exact[cont] * samples)
        else:
            rest_obs += counts.get(cont, 0)
            rest_exp += exact[cont] * samples
    if rest_exp > 0:
        observed.append(rest_obs)
        expected.append(rest_exp)
    return scipy_stats.chisquare(observed, expected), len(observed)


SAMPLES, LENGTH, WORKERS = 2000, 3, 4


@pytest.mark.slow
async def test_token_method_fidelity_over_grpc(engines) -> None:
    target, drafter_engine, verifier_engine = engines
    exact = exact_continuations(target.model, PROMPT, LENGTH)
    assert abs(sum(exact.values()) - 1) < 1e-9
    counts = dict.fromkeys(exact, 0)
    accepted = 0
    began = time.monotonic()
    async with Servers(drafter_engine, verifier_engine) as servers:

        async def worker(w: int) -> None:
            # One session per worker; each sample resends the prompt with base_len = 0.
            nonlocal accepted
            for seed in range(w, SAMPLES, WORKERS):
                trace = await speculate(
                    servers.drafter,
                    servers.verifier,
                    f"fid-{w}",
                    PROMPT,
                    LENGTH,
                    "token",
                    seed,
                    3,
                    SamplingParams(temperature=1.0),
                    release=False,
                )
                counts[tuple(trace.tokens)] += 1
                accepted += sum(len(o[1]) for o in trace.outcomes)

        await asyncio.gather(*(worker(w) for w in range(WORKERS)))
    elapsed = time.monotonic() - began
    assert sum(counts.values()) == SAMPLES and accepted > 0
    result, bins = chi_square(counts, exact, SAMPLES)
    print(
        f"fidelity over gRPC: {SAMPLES} samples in {elapsed:.1f} s, {bins} bins, p = {result.pvalue:.3g}, "
        f"accepted drafts {accepted}"
    )
    assert result.pvalue > 1e-3


def test_chi_square_has_power_against_a_wrong_distribution(engines) -> None:
    """Guards the check itself: the reference is normalised, and samples from a plausible wrong
    distribution (the draft model's own, what a verifier that accepted everything would give)
    are rejected at the sample size used above."""
    target, drafter_engine, _ = engines
    exact = exact_continuations(target.model, PROMPT, LENGTH)
    wrong = exact_continuations(drafter_engine.loaded.model, PROMPT, LENGTH)
    assert len(exact) == VOCAB**LENGTH and abs(sum(exact.values()) - 1) < 1e-12
    generator = torch.Generator().manual_seed(0)
    keys = list(wrong)
    draws = torch.multinomial(
        torch.tensor([wrong[c] for c in keys]), SAMPLES, replacement=True, generator=generator
    )
    counts: dict = {}
    for i in draws.tolist():
        counts[keys[i]] = counts.get(keys[i], 0) + 1
    assert chi_square(counts, exact, SAMPLES)[0].pvalue < 1e-6
