"""Statistical fidelity through the real code path: orchestrator → in-process clients → engines
(KV caches, tree attention, verification) on tiny real models.

The target's exact probability of every length-3 continuation of a prompt is enumerated with
plain forwards (no cache) and warp_logits; thousands of seeded completions per method must pass
a chi-square test against it at T = 1, and at T = 0 every method must reproduce the greedy
continuation. A deliberately broken verification rule run through the same path must fail the
same test, which shows the test has the power to notice.
"""

from __future__ import annotations

import asyncio
import itertools
import os

import pytest
import torch
from scipy.stats import chisquare

from orchestrator.api import GenerationRequest
from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from specdec.engine.verifier import VerifierEngine
from specdec.sampling import SamplingParams, warp_logits
from specdec.trees import DraftTree
from specdec.verification import needs_draft_probs
from specdec.verification.base import VerifyResult

pytestmark = pytest.mark.slow

PROMPT = [0, 3]
LENGTH = 3
# ~23 ms of CPU per 3-token completion with these engines (HF's per-forward overhead dominates):
# 1000 per method keeps the file near 4 CPU-minutes; the broken rule below fails at p ~ 1e-7 with
# 1000. Set SPECDEC_FIDELITY_SAMPLES higher for a stronger run.
SAMPLES = int(os.environ.get("SPECDEC_FIDELITY_SAMPLES", "1000"))
CONCURRENCY = 4
P_THRESHOLD = 1e-3
CONFIGS = [
    ("token", {"k": 2}),
    ("block", {"k": 3}),
    ("ersd", {"k": 2}),
    ("gsd-tree", {"k": 4}),
    ("rd", {"a": 0.0, "k": 1}),
    ("rd", {"a": 0.5, "k": 3}),
    ("rd", {"a": 1.0, "k": 2}),
    ("autoregressive", {}),
]
CONFIG_IDS = [f"{m}-" + "-".join(f"{k}{v}" for k, v in knobs.items()) for m, knobs in CONFIGS]


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


def chi_square_p(samples: list[tuple], exact: dict[tuple, float]) -> float:
    """Chi-square p-value; cells expected to hold fewer than 5 samples are pooled into one."""
    n = len(samples)
    counts: dict[tuple, int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    assert set(counts) <= set(exact), "a sample outside the support"
    observed, expected, rest_obs, rest_exp = [], [], 0, 0.0
    for key, p in exact.items():
        if n * p >= 5:
            observed.append(counts.get(key, 0))
            expected.append(n * p)
        else:
            rest_obs += counts.get(key, 0)
            rest_exp += n * p
    if rest_exp > 0:
        observed.append(rest_obs)
        expected.append(rest_exp)
    total = sum(expected)
    expected = [e * n / total for e in expected]  # float rounding of the enumeration
    return float(chisquare(observed, expected).pvalue)


@pytest.fixture(scope="module")
def exact_t1(loaded):
    return exact_distribution(loaded["target"].model, PROMPT, SamplingParams(1.0), 6)


@pytest.mark.parametrize("method,knobs", CONFIGS, ids=CONFIG_IDS)
async def test_output_is_distributed_as_the_target(make_orchestrator, exact_t1, method, knobs):
    orch = make_orchestrator()
    first = 1_000_000 * (CONFIGS.index((method, knobs)) + 1)  # distinct seeds for every sample
    seeds = range(first, first + SAMPLES)
    samples = await sample(orch, method, knobs, SamplingParams(1.0), seeds)
    p_value = chi_square_p(samples, exact_t1)
    assert p_value > P_THRESHOLD, f"{method} {knobs}: chi-square p = {p_value:.2e}"


@pytest.mark.parametrize("method,knobs", CONFIGS, ids=CONFIG_IDS)
async def test_greedy_is_the_argmax_continuation(make_orchestrator, loaded, method, knobs):
    exact = exact_distribution(loaded["target"].model, PROMPT, SamplingParams(0.0), 6)
    greedy = max(exact, key=exact.get)
    assert exact[greedy] == 1.0
    samples = await sample(make_orchestrator(), method, knobs, SamplingParams(0.0), range(8))
    assert set(samples) == {greedy}


def _rejection_samples_from_p(method, tree: DraftTree, target_probs, draft_probs, params,
                              source) -> VerifyResult:
    """BROKEN token verification: after a rejection it samples from P instead of norm((P - Q)+)."""
    for i, token in enumerate(tree.tokens):
        p = target_probs[i].double() / target_probs[i].double().sum()
        q = draft_probs[i].double() / draft_probs[i].double().sum()
        if not source.bernoulli(min(1.0, float(p[token] / q[token]))):
            y = source.categorical(p)
            return VerifyResult(list(tree.tokens[:i]) + [y], list(range(i)), [True] * i + [False])
    last = target_probs[len(tree)].double()
    return VerifyResult(list(tree.tokens) + [source.categorical(last / last.sum())], list(range(len(tree))),
                        [True] * len(tree))


async def test_a_broken_rule_is_caught(engines, loaded, exact_t1):
    broken = VerifierEngine(loaded["target"], verify_fn=_rejection_samples_from_p,
                            needs_draft_probs_fn=needs_draft_probs)
    orch = Orchestrator(InProcessDrafterClient(engines["draft"]), InProcessVerifierClient(broken),
                        OrchestratorConfig())
    samples = await sample(orch, "token", {"k": 2}, SamplingParams(1.0), range(SAMPLES))
    p_value = chi_square_p(samples, exact_t1)
    assert p_value < P_THRESHOLD, f"the broken rule was not noticed (p = {p_value:.2e})"
