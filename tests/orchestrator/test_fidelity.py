"""Statistical fidelity through the real code path: orchestrator → in-process clients → engines
(KV caches, tree attention, verification) on tiny real models.

The target's exact probability of every length-3 continuation of a prompt is enumerated with
plain forwards (no cache) and warp_logits; thousands of seeded completions per method must pass
a chi-square test against it at T = 1, and at T = 0 every method must reproduce the greedy
continuation. A deliberately broken verification rule run through the same path must fail the
same test, which shows the test has the power to notice.
"""

from __future__ import annotations

import os

import pytest

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.runtime.loading import load_model
from specdec.runtime.prefix_cache import PrefixStore
from specdec.runtime.tiny import save_tiny_model
from specdec.sampling import SamplingParams
from specdec.trees import DraftTree
from specdec.verification.base import Rows, VerifyResult
from specdec.verification.lean import LeanDraft, LeanRows
from tests.helpers import use_draft_rows
from tests.orchestrator.helpers import P_THRESHOLD, PROMPT, exact_distribution, p_values, sample

pytestmark = pytest.mark.slow

# A 3-token completion costs ~15 ms of CPU with these engines (HF's per-forward Python overhead
# dominates; one-layer models keep it down): 1000 per method keeps the file near 2.5 CPU-minutes.
# With the 2-layer pair, the broken rule below already failed at p ~ 2e-6 from 800 samples.
# Set SPECDEC_FIDELITY_SAMPLES higher for a stronger run.
SAMPLES = int(os.environ.get("SPECDEC_FIDELITY_SAMPLES", "1000"))
VOCAB = 6
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


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A one-layer target/draft pair of its own (cheaper forwards than the two-layer models)."""
    root = tmp_path_factory.mktemp("fidelity-models")
    target = load_model(save_tiny_model(root / "target", vocab_size=VOCAB, seed=111, num_layers=1), threads=1)
    draft = load_model(save_tiny_model(root / "draft", vocab_size=VOCAB, seed=222, num_layers=1), threads=1)
    # Prefix caches on, in one-token blocks: every sample's session starts from the cached prompt entry.
    return (target, draft, VerifierEngine(target, prefix_cache=PrefixStore(64 << 20, block_tokens=1)),
            DrafterEngine(draft, prefix_cache=PrefixStore(64 << 20, block_tokens=1)))


def make_orchestrator(pair, verifier: VerifierEngine | None = None) -> Orchestrator:
    _, _, verifier_engine, drafter_engine = pair
    return Orchestrator(InProcessDrafterClient(drafter_engine),
                        InProcessVerifierClient(verifier or verifier_engine),
                        OrchestratorConfig(pipeline=False))  # pipelined: test_pipeline.py


@pytest.fixture(scope="module")
def exact_t1(pair):
    return exact_distribution(pair[0].model, PROMPT, SamplingParams(1.0), VOCAB)


def test_the_pair_is_worth_testing(pair, exact_t1):
    """The check has teeth only if draft and target differ and the target is spread out."""
    exact_draft = exact_distribution(pair[1].model, PROMPT, SamplingParams(1.0), VOCAB)
    tv = 0.5 * sum(abs(exact_t1[key] - exact_draft[key]) for key in exact_t1)
    assert tv > 0.2
    assert sum(1 for p in exact_t1.values() if p * SAMPLES >= 5) > 50


@pytest.mark.parametrize("method,knobs", CONFIGS, ids=CONFIG_IDS)
async def test_output_is_distributed_as_the_target(pair, exact_t1, method, knobs):
    orch = make_orchestrator(pair)
    first = 1_000_000 * (CONFIGS.index((method, knobs)) + 1)  # distinct seeds for every sample
    seeds = range(first, first + SAMPLES)
    samples = await sample(orch, method, knobs, SamplingParams(1.0), seeds)
    joint, first = p_values(samples, exact_t1)
    assert min(joint, first) > P_THRESHOLD, f"{method} {knobs}: chi-square p = {joint:.2e} / {first:.2e}"
    assert pair[2].stats()["prefix_cache_hits"] >= SAMPLES // 2  # the samples ran on cache hits


@pytest.mark.parametrize("method,knobs", CONFIGS, ids=CONFIG_IDS)
async def test_greedy_is_the_argmax_continuation(pair, method, knobs):
    exact = exact_distribution(pair[0].model, PROMPT, SamplingParams(0.0), VOCAB)
    greedy = max(exact, key=exact.get)
    assert exact[greedy] == 1.0
    samples = await sample(make_orchestrator(pair), method, knobs, SamplingParams(0.0), range(8))
    assert set(samples) == {greedy}


async def test_full_draft_rows_are_distributed_as_the_target(pair, exact_t1, monkeypatch):
    """The tests above send the draft rows lean (the default, docs/algorithms.md §12); full rows too."""
    use_draft_rows(monkeypatch, "full")
    seeds = range(50_000_000, 50_000_000 + SAMPLES)
    samples = await sample(make_orchestrator(pair), "token", {"k": 2}, SamplingParams(1.0), seeds)
    joint, first = p_values(samples, exact_t1)
    assert min(joint, first) > P_THRESHOLD, f"token, full rows: chi-square p = {joint:.2e} / {first:.2e}"


def _rejection_samples_from_p(method, tree: DraftTree, target_probs, draft_probs, params,
                              source) -> VerifyResult:
    """BROKEN token verification: after a rejection it samples from P instead of norm((P - Q)+).
    The draft rows come lean by default (docs/algorithms.md §12): q is read through their view."""
    vocab = target_probs.shape[1]
    draft = (LeanRows(tree, draft_probs, vocab) if isinstance(draft_probs, LeanDraft)
             else Rows(draft_probs, "draft"))
    for i, token in enumerate(tree.tokens):
        p = target_probs[i].double() / target_probs[i].double().sum()
        q = draft.at([i], [token])[0]
        if not source.bernoulli(min(1.0, float(p[token]) / q)):
            y = source.categorical(p)
            return VerifyResult(list(tree.tokens[:i]) + [y], list(range(i)), [True] * i + [False])
    last = target_probs[len(tree)].double()
    return VerifyResult(list(tree.tokens) + [source.categorical(last / last.sum())], list(range(len(tree))),
                        [True] * len(tree))


async def test_a_broken_rule_is_caught(pair, exact_t1):
    broken = VerifierEngine(pair[0], verify_fn=_rejection_samples_from_p)
    orch = make_orchestrator(pair, broken)
    samples = await sample(orch, "token", {"k": 2}, SamplingParams(1.0), range(SAMPLES))
    joint, first = p_values(samples, exact_t1)
    assert min(joint, first) < P_THRESHOLD, f"the broken rule was not noticed (p = {joint:.2e} / {first:.2e})"
