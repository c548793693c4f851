"""Step "fidelity": the output law per method through real services on the device, by chi-square.

For each precision (bfloat16 and float32 on CUDA; float32 in the CPU dry run) a drafter and a verifier
process (`specdec serve drafter|verifier --device D --dtype P`, tiny random models of
specdec.runtime.tiny, all processes on the one GPU) serve on 127.0.0.1; the orchestrator's loop in
this process calls them over gRPC. Every method's length-3 continuations of one prompt are tested
against the target's exact law at that precision (every continuation enumerated with plain forwards
of the same model on the same device, warped in float64), jointly and on the first token, as
tests/orchestrator/test_fidelity.py does on the CPU. p < 1e-3 is reported as a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.device.common import StepArgs, StepResult, log, run_step, table
from specdec.verification.fidelity import chi_square_p

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 6
PROMPT = [0, 3]
LENGTH = 3
P_THRESHOLD = 1e-3
CONCURRENCY = 16
METHODS = (
    ("token", {"k": 2}),
    ("block", {"k": 3}),
    ("ersd", {"k": 2}),
    ("gsd-tree", {"k": 4}),
    ("rd", {"k": 3, "a": 0.5}),
    ("autoregressive", {}),
)
TINY_METHODS = (("token", {"k": 2}), ("gsd-tree", {"k": 4}))
SAMPLES, TINY_SAMPLES = 1000, 60


class Service:
    """One service process (own process group, log file) that writes {"port": N} to its ready file
    once serving; stopped by `stop`. `Service.serve` is a `specdec serve ROLE` process."""

    def __init__(self, work: Path, name: str, argv: list[str]) -> None:
        self.name = name
        self.ready = work / f"{self.name}.ready.json"
        self.log_path = work / f"{self.name}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as sink:
            self.process = subprocess.Popen(
                [*argv, "--ready-file", str(self.ready)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    @classmethod
    def serve(cls, work: Path, role: str, model: Path, device: str, dtype: str) -> Service:
        argv = [sys.executable, "-m", "specdec.cli", "serve", role, "--model", str(model), "--device", device,
                "--dtype", dtype, "--host", "127.0.0.1", "--port", "0"]
        if device == "cpu":
            argv += ["--threads", "1"]
        return cls(work, f"{role}-{dtype}", argv)

    def address(self, deadline: float) -> str:
        while time.monotonic() < deadline:
            if self.ready.exists():
                with contextlib.suppress(json.JSONDecodeError):
                    return f"127.0.0.1:{json.loads(self.ready.read_text())['port']}"
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"serve {self.name} exited with {self.process.returncode}: "
                    f"{self.log_path.read_text(errors='replace')[-1500:]}"
                )
            time.sleep(0.2)
        raise RuntimeError(
            f"serve {self.name} not ready in time: {self.log_path.read_text(errors='replace')[-1500:]}"
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def exact_law(model_dir: Path, device: str, dtype: str) -> dict[tuple, float]:
    """P(x1 x2 x3 | PROMPT) of the target at `dtype` on `device`, one batched plain forward, float64 warp."""
    import torch

    from specdec.runtime.loading import load_model
    from specdec.sampling import SamplingParams, warp_logits

    model = load_model(model_dir, device=device, dtype=dtype).model
    pairs = list(itertools.product(range(VOCAB), repeat=LENGTH - 1))
    with torch.no_grad():
        ids = torch.tensor([PROMPT + list(p) for p in pairs], device=device)
        rows = warp_logits(model(ids).logits.double().cpu(), SamplingParams(1.0))
    n = len(PROMPT)
    return {
        (a, b, c): float(rows[i, n - 1, a] * rows[i, n, b] * rows[i, n + 1, c])
        for i, (a, b) in enumerate(pairs)
        for c in range(VOCAB)
    }


async def sample_methods(
    drafter: str, verifier: str, methods, samples: int, args: StepArgs
) -> dict[str, list]:
    from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient
    from orchestrator.config import OrchestratorConfig
    from orchestrator.speculation import Orchestrator
    from specdec.generation import GenerationRequest
    from specdec.sampling import SamplingParams

    orchestrator = Orchestrator(
        GrpcDrafterClient(drafter, timeout_s=60),
        GrpcVerifierClient(verifier, timeout_s=60),
        OrchestratorConfig(draft_source="model"),
    )
    out: dict[str, list] = {}
    try:
        await orchestrator.start()
        for method, knobs in methods:

            async def one(seed: int, method: str = method, knobs: dict = knobs) -> tuple:
                request = GenerationRequest(
                    prompt_ids=PROMPT,
                    max_new_tokens=LENGTH,
                    sampling=SamplingParams(1.0),
                    seed=seed,
                    method=method,
                    stop_token_ids=[],
                    draft_source="model",
                    **knobs,
                )
                return tuple((await orchestrator.generate(request)).token_ids)

            got: list[tuple] = []
            name = f"{method}-" + "-".join(f"{k}{v}" for k, v in knobs.items())
            try:
                for start in range(0, samples, CONCURRENCY):
                    if args.left_s() < 15:
                        break
                    got += await asyncio.gather(
                        *(one(s) for s in range(start, min(samples, start + CONCURRENCY)))
                    )
            except Exception as error:  # noqa: BLE001 - one method's failure must not hide the others'
                got = [error]
            out[name] = got
    finally:
        await orchestrator.close()
    return out


def step(args: StepArgs) -> StepResult:
    from specdec.runtime.tiny import save_tiny_model

    dtypes = ("bfloat16", "float32") if args.cuda else ("float32",)
    methods = TINY_METHODS if args.tiny else METHODS
    # A rerun of what an earlier check left unmeasured: SPECDEC_FIDELITY_DTYPES / _METHODS (names).
    if os.environ.get("SPECDEC_FIDELITY_DTYPES"):
        dtypes = tuple(d for d in os.environ["SPECDEC_FIDELITY_DTYPES"].split(",") if d)
    if os.environ.get("SPECDEC_FIDELITY_METHODS"):
        chosen = set(os.environ["SPECDEC_FIDELITY_METHODS"].split(","))
        methods = tuple(m for m in METHODS if m[0] in chosen)
    samples = TINY_SAMPLES if args.tiny else SAMPLES
    work = Path(tempfile.mkdtemp(prefix="specdec-device-fidelity-"))
    target = save_tiny_model(work / "target", vocab_size=VOCAB, seed=111, num_layers=1)
    draft = save_tiny_model(work / "draft", vocab_size=VOCAB, seed=222, num_layers=1)
    services = {
        dtype: (
            Service.serve(work, "drafter", draft, args.device, dtype),
            Service.serve(work, "verifier", target, args.device, dtype),
        )
        for dtype in dtypes
    }
    rows, data, findings = [], {}, []
    try:
        for dtype, (drafter, verifier) in services.items():
            deadline = time.monotonic() + max(10.0, args.left_s() - 20)
            addresses = drafter.address(deadline), verifier.address(deadline)
            log(f"fidelity: {dtype} services ready at {addresses}")
            exact = exact_law(target, args.device, dtype)
            first: dict[tuple, float] = {}
            for key, p in exact.items():
                first[key[:1]] = first.get(key[:1], 0.0) + p
            got = asyncio.run(sample_methods(*addresses, methods, samples, args))
            for name, values in got.items():
                if not values:
                    continue
                if isinstance(values[0], Exception):
                    rows.append([dtype, name, 0, "–", "–", "ERROR"])
                    data[f"{dtype}/{name}"] = {"samples": 0, "error": str(values[0]), "verdict": "ERROR"}
                    findings.append(f"ERROR {dtype} {name}: {values[0]}")
                    for service in (drafter, verifier):
                        log(f"fidelity: {service.name} log (tail):\n"
                            f"{service.log_path.read_text(errors='replace')[-3000:]}")
                    continue
                joint, lead = chi_square_p(values, exact), chi_square_p([v[:1] for v in values], first)
                verdict = "pass" if min(joint, lead) >= P_THRESHOLD else "FAIL"
                rows.append([dtype, name, len(values), f"{joint:.3g}", f"{lead:.3g}", verdict])
                data[f"{dtype}/{name}"] = {
                    "samples": len(values),
                    "p_joint": joint,
                    "p_first": lead,
                    "verdict": verdict,
                }
                if verdict != "pass":
                    findings.append(f"FAIL {dtype} {name}: p = {joint:.3g} (joint), {lead:.3g} (first token)")
    finally:
        for pair in services.values():
            for service in pair:
                service.stop()
    if not rows:
        raise RuntimeError("no method sampled within the budget")
    findings.insert(
        0,
        f"{sum(r[-1] == 'pass' for r in rows)}/{len(rows)} method x precision checks pass "
        f"(p >= {P_THRESHOLD:g})",
    )
    text = (
        f"Tiny random pair (vocabulary {VOCAB}, one layer), drafter and verifier as `specdec serve` "
        f"processes on {args.device}, the orchestrator's loop over gRPC; prompt {PROMPT}, {LENGTH} new "
        f"tokens at T = 1, up to {samples} seeded requests per method ({CONCURRENCY} at a time).\n\n"
        + table(["precision", "method", "samples", "p (joint)", "p (first token)", "verdict"], rows)
    )
    return StepResult(
        text, {"checks": data, "verdict": "fail" if any(r[-1] != "pass" for r in rows) else "pass"}, findings
    )


if __name__ == "__main__":
    sys.exit(run_step(step, description=__doc__))
