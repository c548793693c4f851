"""Step "batched": a session's rows and outcomes in a batched pass against the same session alone.

Per precision (bfloat16 and float32 on CUDA, float32 in the dry run), on a tiny random model:

- rows: four sessions with contexts of different lengths each extend a chain and a tree; each
  session's logits alone (TreeKVCache.forward) are compared with its logits inside one batched pass
  of all four (ForwardBatcher._batched_pass, the layout the engines use): max |Δ logit| and max
  total variation of the softmax rows;
- outcomes: the same seeded verify calls (method token, T = 1) on a batching VerifierEngine, once
  one call at a time and once all sessions at once from threads (their passes batched): the share
  of calls that emit the same tokens.

Float32 must agree to rounding (TV < 1e-4); bfloat16 is measured, not assumed (docs/algorithms.md
§14): a TV above 1e-2 would mean a wrong mask or layout and fails either way.
"""

from __future__ import annotations

import sys
import threading

from bench.device.common import StepArgs, StepResult, log, run_step, table
from bench.device.shapes import loaded_model

CONTEXTS = (5, 9, 17, 33)
CHAIN = [-1, 0, 1]
TREE = [-1, -1, 0, 0, 2]
BOUNDS = {"float32": 1e-4, "bfloat16": 1e-2}
OUTCOME_ROUNDS = 6


def rows_check(model, device: str) -> dict[str, float]:
    import torch

    from specdec.runtime.batch_config import BatchConfig
    from specdec.runtime.batching import ForwardBatcher, _Job
    from specdec.runtime.kv import TreeKVCache

    vocab = int(model.get_output_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(7)
    batcher = ForwardBatcher(model, BatchConfig())
    worst = {"max_abs_logit": 0.0, "max_tv": 0.0}
    for parents in (CHAIN, TREE):
        caches = []
        for context in CONTEXTS:
            kv = TreeKVCache(model, runner=batcher)
            kv.prefill(torch.randint(0, vocab, (context,), generator=generator).tolist())
            caches.append(kv)
        blocks = [torch.randint(0, vocab, (len(parents),), generator=generator).tolist() for _ in caches]
        alone = []
        for kv, block in zip(caches, blocks, strict=True):
            alone.append(kv.forward(kv.plan(block, parents)).float().cpu())
            kv.truncate(kv.prefix_len)
        jobs = [_Job(kv=kv, plan=kv.plan(block, parents)) for kv, block in zip(caches, blocks, strict=True)]
        together = [rows.float().cpu() for rows in batcher._batched_pass(jobs)]
        for a, b in zip(alone, together, strict=True):
            worst["max_abs_logit"] = max(worst["max_abs_logit"], float((a - b).abs().max()))
            tv = 0.5 * (a.double().softmax(-1) - b.double().softmax(-1)).abs().sum(-1).max()
            worst["max_tv"] = max(worst["max_tv"], float(tv))
    return worst


def outcomes_check(loaded, sessions: int) -> float:
    """Share of seeded verify calls that emit the same tokens batched (threads) as one at a time."""
    import torch

    from specdec.engine.api import VerifyRequest
    from specdec.engine.verifier import VerifierEngine
    from specdec.sampling import SamplingParams
    from specdec.verification.base import MethodParams

    vocab = loaded.info.vocab_size
    generator = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(0, vocab - 1, (CONTEXTS[i % len(CONTEXTS)],), generator=generator).tolist()
        for i in range(sessions)
    ]
    drafts = [
        [torch.randint(0, vocab - 1, (3,), generator=generator).tolist() for _ in range(OUTCOME_ROUNDS)]
        for _ in range(sessions)
    ]

    def run(engine: VerifierEngine, label: str, session: int, out: list) -> None:
        committed, known = list(prompts[session]), 0
        for round_, draft in enumerate(drafts[session]):
            q = torch.full((len(draft) + 1, vocab), 1.0 / vocab)  # a uniform drafter: rejections happen
            outcome = engine.verify(
                VerifyRequest(
                    f"{label}-{session}",
                    known,
                    committed[known:],
                    draft,
                    CHAIN,
                    "token",
                    MethodParams(seed=1000 * session + round_),
                    SamplingParams(1.0),
                    draft_probs=q,
                )
            )
            known = len(committed)
            committed += outcome.tokens
            out.append(tuple(outcome.tokens))

    alone: list[list] = [[] for _ in range(sessions)]
    engine = VerifierEngine(loaded)
    for s in range(sessions):
        run(engine, "alone", s, alone[s])
    together: list[list] = [[] for _ in range(sessions)]
    threads = [
        threading.Thread(target=run, args=(engine, "together", s, together[s])) for s in range(sessions)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if any(thread.is_alive() for thread in threads):
        raise RuntimeError("a batched verify did not finish within 120 s")
    pairs = [(a, b) for s in range(sessions) for a, b in zip(alone[s], together[s], strict=True)]
    batches = engine.stats()["batches"]
    log(f"batched: {len(pairs)} verify calls compared, engine ran {batches} passes")
    return sum(a == b for a, b in pairs) / len(pairs)


def step(args: StepArgs) -> StepResult:
    import torch

    if not args.cuda:
        torch.set_num_threads(1)
    dtypes = ("bfloat16", "float32") if args.cuda else ("float32",)
    rows, data, findings = [], {}, []
    for dtype in dtypes:
        loaded = loaded_model("tiny-target", args.device, dtype, seed=3)
        with torch.inference_mode():
            worst = rows_check(loaded.model, args.device)
        same = outcomes_check(loaded, 4 if args.tiny else 8)
        verdict = "pass" if worst["max_tv"] < BOUNDS[dtype] else "FAIL"
        data[dtype] = {**worst, "same_outcomes": same, "bound_tv": BOUNDS[dtype], "verdict": verdict}
        rows.append(
            [
                dtype,
                f"{worst['max_abs_logit']:.3g}",
                f"{worst['max_tv']:.3g}",
                f"{BOUNDS[dtype]:g}",
                f"{same:.3f}",
                verdict,
            ]
        )
        findings.append(
            f"{verdict if verdict != 'pass' else 'pass'} {dtype}: batched vs alone max TV "
            f"{worst['max_tv']:.3g}, same outcomes {same:.3f}"
        )
    text = (
        f"Tiny random model (shape tiny-target) on {args.device}; sessions with contexts {list(CONTEXTS)}, "
        f"a chain of {len(CHAIN)} and a tree of {len(TREE)} new entries; outcomes: seeded token verifies "
        "against a uniform draft, one at a time vs from threads at once.\n\n"
        + table(["precision", "max abs Δ logit", "max TV", "TV bound", "same outcomes", "verdict"], rows)
    )
    data["verdict"] = "fail" if any(r[-1] != "pass" for r in rows) else "pass"
    return StepResult(text, data, findings)


if __name__ == "__main__":
    sys.exit(run_step(step, description=__doc__))
