"""Batching keeps the product exact: many sessions with different methods share engine passes.

The engines batch by default (specdec.runtime.batching). Here requests of five methods run at
once, so single passes mix sessions of different methods, cache lengths and tree masks; each
method's continuations must still pass the chi-square test against the target's enumerated
distribution, and greedy outputs must equal those of engines that run every pass alone.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.generation import GenerationRequest
from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.loading import load_model
from specdec.runtime.tiny import save_tiny_model
from specdec.sampling import SamplingParams
from tests.orchestrator.helpers import LENGTH, P_THRESHOLD, PROMPT, exact_distribution, p_values

VOCAB = 6
SAMPLES = int(os.environ.get("SPECDEC_FIDELITY_SAMPLES", "1000"))
MIXED = [
    ("token", {"k": 2}),
    ("block", {"k": 3}),
    ("ersd", {"k": 2}),
    ("gsd-tree", {"k": 4}),
    ("rd", {"a": 0.5, "k": 3}),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("batched-models")
    target = load_model(save_tiny_model(root / "target", vocab_size=VOCAB, seed=111, num_layers=1), threads=1)
    draft = load_model(save_tiny_model(root / "draft", vocab_size=VOCAB, seed=222, num_layers=1), threads=1)
    return target, draft


def orchestrator(models, batching: BatchConfig,
                 **config) -> tuple[Orchestrator, DrafterEngine, VerifierEngine]:
    target, draft = models
    drafter, verifier = DrafterEngine(draft, batching=batching), VerifierEngine(target, batching=batching)
    orch = Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier),
                        OrchestratorConfig(**config))
    return orch, drafter, verifier


def request(method: str, knobs: dict, seed: int | None, sampling: SamplingParams, n: int = LENGTH,
            prompt: list[int] = PROMPT) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, max_new_tokens=n, sampling=sampling, seed=seed, method=method,
                             stop_token_ids=[], **knobs)


def shared_passes(*engines) -> None:
    """The test only means something if passes were actually shared."""
    for engine in engines:
        stats = engine.stats()
        assert stats["batch_calls"] > stats["batches"] > 0, stats


@pytest.mark.slow
async def test_mixed_methods_in_shared_passes_are_distributed_as_the_target(models):
    orch, drafter, verifier = orchestrator(models, BatchConfig(window_ms=20), pipeline=False)
    exact = exact_distribution(models[0].model, PROMPT, SamplingParams(1.0), VOCAB)
    samples: dict[int, list[tuple]] = {i: [] for i in range(len(MIXED))}

    async def one(index: int, seed: int) -> None:
        method, knobs = MIXED[index]
        result = await orch.generate(request(method, knobs, seed, SamplingParams(1.0)))
        assert len(result.token_ids) == LENGTH
        samples[index].append(tuple(result.token_ids))

    for start in range(0, SAMPLES, 2):  # 2 requests per method at once: 10 sessions in flight
        await asyncio.gather(*(one(i, 7_000_000 * (i + 1) + seed)
                               for seed in range(start, min(start + 2, SAMPLES)) for i in range(len(MIXED))))
    for index, (method, knobs) in enumerate(MIXED):
        joint, first = p_values(samples[index], exact)
        assert min(joint, first) > P_THRESHOLD, f"{method} {knobs} batched: p = {joint:.2e} / {first:.2e}"
    shared_passes(drafter, verifier)
    assert verifier._batcher.stats.largest_batch >= 3


@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
async def test_greedy_outputs_equal_the_unbatched_engines(models, pipeline):
    """Eight concurrent greedy requests (mixed methods, different prompts and lengths)."""
    prompts = [[0, 3], [1, 2, 3, 4, 5], [5], [2, 2, 2, 2, 2, 2, 2, 1], [4, 1], [3, 0, 1], [1], [0, 0, 5, 5]]
    cases = [(MIXED[i % len(MIXED)], prompt, 8 + 3 * i) for i, prompt in enumerate(prompts)]

    async def run(batching: BatchConfig) -> tuple[list[list[int]], DrafterEngine, VerifierEngine]:
        orch, drafter, verifier = orchestrator(models, batching, pipeline=pipeline, adaptive_k=False)
        results = await asyncio.gather(*(
            orch.generate(request(method, knobs, 5, SamplingParams(0.0), n, prompt))
            for (method, knobs), prompt, n in cases))
        return [r.token_ids for r in results], drafter, verifier

    batched, drafter, verifier = await run(BatchConfig(window_ms=20))
    alone, *_ = await run(BatchConfig(enabled=False))
    assert batched == alone
    assert [len(tokens) for tokens in batched] == [n for *_, n in cases]
    shared_passes(drafter, verifier)
