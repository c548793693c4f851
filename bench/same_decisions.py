"""Seeded requests through the in-process loop (tiny models): the tokens and every iteration's decisions
(k, RD heads, method, drafted, accepted, source, fallback) and the pre-draft counts, as JSON, so two
checkouts can be compared decision by decision (a refactor that changes no behaviour gives identical
files). Nine method/source configurations x 3 seeds x T in {0, 1} x pipeline off/on; about a minute.

    python bench/same_decisions.py /tmp/after.json
    PYTHONPATH=/path/to/old/checkout python bench/same_decisions.py /tmp/before.json
    cmp /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import Orchestrator
from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.generation import GenerationRequest, GenerationResult
from specdec.runtime.loading import load_model
from specdec.runtime.tiny import save_tiny_model
from specdec.sampling import SamplingParams

CASES: list[tuple[str, dict[str, Any]]] = [
    ("token", {"k": 3}), ("block", {"k": 3}), ("ersd", {"k": 2}), ("gsd-tree", {"k": 4}),
    ("rd", {"k": 3, "a": 0.5}), ("token", {"k": 2, "draft_source": "lookup"}),
    ("ersd", {"k": 2, "draft_source": "suffix"}), ("token", {"draft_source": "hybrid"}),
    ("autoregressive", {}),
]
PROMPT = [1, 2, 3, 1, 2, 3, 4]


def decisions(result: GenerationResult) -> dict[str, Any]:
    its = [(i.k, i.heads, i.method, i.num_drafted, i.accepted, str(i.source), i.fallback)
           for i in result.iterations]
    return {"tokens": result.token_ids, "its": its,
            "pre": (result.stats.pre_drafts_used, result.stats.pre_drafts_dropped)}


async def main(path: str) -> None:
    root = Path(tempfile.mkdtemp())
    target = load_model(save_tiny_model(root / "t", vocab_size=40, seed=111, num_layers=2), threads=1)
    draft = load_model(save_tiny_model(root / "d", vocab_size=40, seed=222, num_layers=1), threads=1)
    out = []
    for pipeline in (False, True):
        drafter = InProcessDrafterClient(DrafterEngine(draft))
        orch = Orchestrator(drafter, InProcessVerifierClient(VerifierEngine(target)),
                            OrchestratorConfig(pipeline=pipeline))
        for method, knobs in CASES:
            for seed in range(3):
                for temperature in (0.0, 1.0):
                    request = GenerationRequest(
                        prompt_ids=PROMPT, max_new_tokens=24, method=method, seed=seed,
                        sampling=SamplingParams(temperature), stop_token_ids=[], **knobs)
                    out.append({"pipeline": pipeline, "method": method, "knobs": knobs, "seed": seed,
                                "temperature": temperature, **decisions(await orch.generate(request))})
        await orch.close()
    Path(path).write_text(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
