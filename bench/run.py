"""Benchmark harness: one draft/target pair, one prompt set, every decoding configuration.

    python -m bench.run --dtype int8 --max-new-tokens 48 --pipeline-max-k 0   # RESULTS.md's main run
    python -m bench.run --prompts builtin --num-prompts 2 --max-new-tokens 8 --repeats 1 \\
        --draft /path/tiny-draft --target /path/tiny-target       # a smoke run

What one run does, in order:
1. loads both models in this process (`--threads` torch threads, `--dtype`: float32 by default,
   int8 is the fast choice on a CPU; the baseline uses the same precision);
2. runs the analyser (specdec.analysis) on the same prompts: α, c, λ, best k, tree, a;
3. starts drafter and verifier as gRPC servers in their own processes, pinned to disjoint
   cores (`python -m specdec.cli serve ...`, as `specdec up` does), unless --no-grpc;
4. runs every configuration on every prompt with the same sampling parameters and seed,
   round-robin over configurations per prompt (the order rotates from prompt to prompt), for
   `--repeats` rounds: plain target decoding with HF `generate` (the baseline), HF assisted
   generation (`assistant_model=`), and our pipeline per method, in-process and over gRPC
   (over gRPC also pipelined: --pipeline-methods, with look-ahead guess variants:
   --pipeline-guesses, and with adaptive draft length: --pipeline-max-k);
5. reports medians over repeats: tokens/s, speedup vs the baseline, block efficiency (tokens per
   target forward pass), acceptance, per-iteration overhead, and the fraction of the analytic
   speedup achieved; writes results.json, analysis.json and PNG plots to --out.

Overhead per iteration = wall time − time during which some model was computing, where each
engine call's compute time (forward_seconds/verify_seconds the engines report) is placed at the
end of the call's client-side interval. It is orchestration + transport (+ thread hand-off).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.machine import cpu_model
from orchestrator.intervals import covered
from specdec.analysis import json_safe
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
from specdec.methods import SPECULATIVE_METHOD_NAMES

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results"
DEFAULT_DRAFT, DEFAULT_TARGET = DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
PIPELINE_METHODS = (*SPECULATIVE_METHOD_NAMES, "ersd-tree")  # ersd-tree: ersd drafting trees

Progress = Callable[[str], None]


@dataclass
class BenchSettings:
    draft: str = DEFAULT_DRAFT
    target: str = DEFAULT_TARGET
    prompts: str = "humaneval"
    num_prompts: int = 3
    max_new_tokens: int = 32
    repeats: int = 3
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234
    methods: tuple[str, ...] = ("token", "block", "ersd", "gsd-tree", "rd")
    k: int | None = None  # sequence draft length; None → the analyser's best k
    rd_sweep: tuple[float, ...] = (0.25, 0.5, 0.75)
    block_check_k: int | None = 8  # also run token and block at this k (block-efficiency check)
    sweep_repeats: int = 1  # repeats of the sweep / check configurations
    grpc: bool = True
    grpc_methods: tuple[str, ...] = ("token", "block", "ersd", "gsd-tree", "rd")
    # Also run these over gRPC in pipelined mode (pre-draft while verifying; rd only where K = k_max)
    # and, except rd, with adaptive pre-draft length up to pipeline_max_k tokens (0 = not).
    pipeline_methods: tuple[str, ...] = ("token", "block", "ersd", "rd")
    pipeline_max_k: int = 12
    # Look-ahead guesses of the pipelined rows, "bonus+rejection" (see GenerationRequest): one
    # row per entry; the adaptive rows use the first. Empty: one row with the orchestrator's
    # default (automatic by block length).
    pipeline_guesses: tuple[str, ...] = ()
    hf_assisted: bool = True
    analysis_prompts: int | None = None  # None → num_prompts
    analysis_tokens: int = 32
    threads: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    max_prompt_tokens: int = 256
    out_dir: str = str(DEFAULT_OUT)
    save_calibration: bool = True
    home: str | None = None
    server_timeout_s: float = 600.0


@dataclass
class RunConfig:
    name: str
    kind: str  # "baseline" | "hf-assisted" | "pipeline"
    transport: str = "inprocess"  # "inprocess" | "grpc"
    method: str | None = None
    k: int | None = None
    a: float | None = None
    tree_budget: int | None = None
    repeats: int = 1
    pipeline: bool = False
    pipeline_max_k: int = 0  # > 0: adaptive pre-draft length (pipelined only)
    bonus_guesses: int | None = None  # pipelined look-ahead guesses (None: the orchestrator's default)
    rejection_guesses: int | None = None


@dataclass
class RunRecord:
    config: str
    repeat: int
    prompt: str
    tokens: int
    seconds: float
    target_calls: int
    drafted: int = 0
    accepted: int = 0
    iterations: int = 0
    iteration_seconds: float = 0.0
    pre_drafts_used: int = 0
    pre_drafts_dropped: int = 0
    pre_draft_bonus_hits: tuple[int, ...] = ()  # used pre-drafts by rank of their guess
    pre_draft_rejection_hits: tuple[int, ...] = ()
    overlap_seconds: float = 0.0  # drafter and verifier both busy (the orchestrator's measure)
    verifier_busy_seconds: float = 0.0  # verifier calls in flight (the orchestrator's measure)
    busy_seconds: float = 0.0
    overhead_seconds: float = 0.0
    # Decode phase: everything after the step that produced the first new token(s), so that the
    # prompt's prefill (one pass per model, the same work for every method) is left out.
    decode_tokens: int = 0
    decode_seconds: float = 0.0


# RunRecord's fields read straight off a run's GenerationStats (record field: stats field), so a
# pipelined run's record is filled by one loop over specdec.generation.stats_values.
RECORD_FROM_STATS = {
    "target_calls": "iterations",
    "drafted": "drafted_tokens",
    "accepted": "accepted_tokens",
    "pre_drafts_used": "pre_drafts_used",
    "pre_drafts_dropped": "pre_drafts_dropped",
    "pre_draft_bonus_hits": "pre_draft_bonus_hits",
    "pre_draft_rejection_hits": "pre_draft_rejection_hits",
    "overlap_seconds": "overlap_seconds",
    "verifier_busy_seconds": "verify_seconds",
}


# ----------------------------------------------------------------------------------------------
# timing wrappers around the clients: per-call engine compute, for the overhead figure
# ----------------------------------------------------------------------------------------------
class CallLog:
    """Engine calls of the current iteration: (kind, start, end, compute seconds, extra)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, float, float, dict]] = []
        self.iterations = 0
        self.iteration_seconds = 0.0
        self.busy_seconds = 0.0

    def reset(self) -> None:
        self.calls.clear()
        self.iterations = 0
        self.iteration_seconds = 0.0
        self.busy_seconds = 0.0

    def on_iteration(self, record) -> None:
        intervals: list[tuple[float, float]] = []
        pending_score: tuple[float, float] | None = None
        for kind, start, end, compute, extra in self.calls:
            if kind == "score":
                pending_score = (start, end)
            elif kind == "draft":
                intervals.append((max(start, end - compute), end))
            elif kind == "verify":
                forward, verify_s = compute, extra.get("verify_seconds", 0.0)
                if extra.get("score_reused") and pending_score is not None:
                    s_start, s_end = pending_score
                    intervals.append((max(s_start, s_end - forward), s_end))
                    intervals.append((max(start, end - verify_s), end))
                else:
                    intervals.append((max(start, end - forward - verify_s), end))
                pending_score = None
        self.calls.clear()
        self.iterations += 1
        self.iteration_seconds += max(0.0, record.end - record.start)
        self.busy_seconds += covered(intervals)




class TimedDrafter:
    def __init__(self, inner, log: CallLog) -> None:
        self.inner, self.log = inner, log

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def draft(self, request):
        return await self._timed(self.inner.draft(request))

    async def lookahead(self, request):
        return await self._timed(self.inner.lookahead(request))

    async def _timed(self, call):
        start = time.perf_counter()
        result = await call
        self.log.calls.append(("draft", start, time.perf_counter(), float(result.forward_seconds), {}))
        return result


class TimedVerifier:
    def __init__(self, inner, log: CallLog) -> None:
        self.inner, self.log = inner, log

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def score(self, request):
        start = time.perf_counter()
        await self.inner.score(request)
        self.log.calls.append(("score", start, time.perf_counter(), 0.0, {}))

    async def verify(self, request):
        start = time.perf_counter()
        outcome = await self.inner.verify(request)
        extra = {
            "verify_seconds": float(outcome.verify_seconds),
            "score_reused": bool(outcome.score_reused),
        }
        self.log.calls.append(("verify", start, time.perf_counter(), float(outcome.forward_seconds), extra))
        return outcome


# ----------------------------------------------------------------------------------------------
# runners
# ----------------------------------------------------------------------------------------------
class ForwardCounter:
    """Counts forward calls of a torch module (target passes of HF generate)."""

    def __init__(self, module) -> None:
        self.count = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:  # noqa: ARG002
        self.count += 1

    def close(self) -> None:
        self.handle.remove()


def _hf_generation_config(settings: BenchSettings, max_new_tokens: int, pad: int):
    from transformers import GenerationConfig

    greedy = settings.temperature == 0
    kwargs: dict[str, Any] = {
        "do_sample": not greedy,
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": 0,
        "eos_token_id": [],
        "pad_token_id": pad,
        "repetition_penalty": 1.0,
    }
    if not greedy:
        kwargs.update(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
    return GenerationConfig(**kwargs)


class _StepClock:
    """An HF streamer that only timestamps: generate() puts the prompt first, then new tokens."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.steps.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


def run_hf(target, draft, prompt: list[int], settings: BenchSettings, seed: int, assisted: bool) -> RunRecord:
    """HF generate (optionally assisted): tokens, seconds, target forward passes, decode phase."""
    import torch

    config = _hf_generation_config(settings, settings.max_new_tokens, pad=0)
    ids = torch.tensor([prompt], device=target.device)
    kwargs: dict[str, Any] = {}
    if assisted:
        draft.model.generation_config = _hf_generation_config(settings, settings.max_new_tokens, pad=0)
        kwargs["assistant_model"] = draft.model
    counter = ForwardCounter(target.model)
    clock = _StepClock()
    torch.manual_seed(seed)
    try:
        began = time.perf_counter()
        with torch.no_grad():
            out = target.model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=clock, **kwargs
            )
        ended = time.perf_counter()
    finally:
        counter.close()
    tokens = int(out.shape[1] - len(prompt))
    record = RunRecord("", 0, "", tokens, ended - began, counter.count)
    if clock.steps:
        first_time, first_tokens = clock.steps[0]
        record.decode_tokens, record.decode_seconds = tokens - first_tokens, ended - first_time
    return record


async def run_pipeline(
    orchestrator, log: CallLog, prompt: list[int], cfg: RunConfig, settings: BenchSettings, seed: int
) -> RunRecord:
    from specdec.generation import GenerationRequest, stats_values
    from specdec.sampling import SamplingParams

    request = GenerationRequest(
        prompt_ids=list(prompt),
        max_new_tokens=settings.max_new_tokens,
        sampling=SamplingParams(settings.temperature, settings.top_k, settings.top_p),
        stop_token_ids=[],
        seed=seed,
        method=cfg.method or "token",
        k=cfg.k,
        a=cfg.a,
        tree_budget=cfg.tree_budget,
        pipeline=cfg.pipeline,
        pipeline_max_k=cfg.pipeline_max_k,
        pipeline_bonus_guesses=cfg.bonus_guesses,
        pipeline_rejection_guesses=cfg.rejection_guesses,
    )
    log.reset()
    began = time.perf_counter()
    result = await orchestrator.generate(request)
    seconds = time.perf_counter() - began
    stats = stats_values(result.stats)
    from_stats = {field: stats[name] for field, name in RECORD_FROM_STATS.items()}
    first, last = result.iterations[0], result.iterations[-1]
    return RunRecord(
        config=cfg.name,
        repeat=0,
        prompt="",
        tokens=len(result.token_ids),
        seconds=seconds,
        **{field: tuple(v) if isinstance(v, list) else v for field, v in from_stats.items()},
        iterations=log.iterations,
        iteration_seconds=log.iteration_seconds,
        busy_seconds=log.busy_seconds,
        overhead_seconds=max(0.0, log.iteration_seconds - log.busy_seconds),
        decode_tokens=len(result.token_ids) - len(first.emitted),
        decode_seconds=max(0.0, last.end - first.end),
    )


# ----------------------------------------------------------------------------------------------
# configurations
# ----------------------------------------------------------------------------------------------
def build_configs(settings: BenchSettings, analysis) -> list[RunConfig]:
    plan = analysis.plan
    k = settings.k or int(plan["sequence"]["best_k_timed"])
    schedule = plan["rd"]["schedule"]
    a_star, rd_k = float(schedule["a"]), int(schedule["k_max"])
    budget = int(plan["tree"]["gsd"]["budget"])
    ersd_budget = int(plan["tree"]["ersd"]["budget"])
    main, extra = settings.repeats, min(settings.sweep_repeats, settings.repeats)

    def pipeline(method: str, transport: str, repeats: int, pipelined: bool = False, max_k: int = 0,
                 guesses: str | None = None, **kw) -> RunConfig:
        suffix = ",".join(
            f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}"
            for key, value in kw.items()
            if value is not None
        )
        prefix = "grpc" if transport == "grpc" else "inproc"
        name = f"{prefix}:{method}" + (f"({suffix})" if suffix else "")
        bonus = rejection = None
        if pipelined:
            name += f"+pipelined(adaptive ≤{max_k})" if max_k else "+pipelined"
            if guesses is not None:
                bonus, rejection = parse_guesses(guesses)
                name += f"[guesses {bonus}+{rejection}]"
        real = "ersd" if method == "ersd-tree" else method
        return RunConfig(name, "pipeline", transport, real, repeats=repeats, pipeline=pipelined,
                         pipeline_max_k=max_k, bonus_guesses=bonus, rejection_guesses=rejection, **kw)

    def for_method(method: str, transport: str, repeats: int, pipelined: bool = False,
                   max_k: int = 0, guesses: str | None = None) -> RunConfig:
        extra = {"pipelined": pipelined, "max_k": max_k, "guesses": guesses}
        if method == "rd":
            # RD pipelines only where K = k_max, so a = 1 (always draft k_max) is its pipelined form
            # when the analyser's a* is 0 (never draft: nothing to pipeline).
            a = 1.0 if pipelined and a_star == 0.0 else round(a_star, 4)
            k_rd = max(rd_k, k) if pipelined and a_star == 0.0 else rd_k
            return pipeline("rd", transport, repeats, k=k_rd, a=a, **extra)
        if method == "gsd-tree":
            return pipeline("gsd-tree", transport, repeats, tree_budget=budget, **extra)
        if method == "ersd-tree":
            return pipeline("ersd-tree", transport, repeats, tree_budget=ersd_budget, **extra)
        return pipeline(method, transport, repeats, k=k, **extra)

    configs = [RunConfig("baseline (HF generate)", "baseline", "-", repeats=main)]
    if settings.hf_assisted:
        configs.append(RunConfig("HF assisted (assistant_model)", "hf-assisted", "-", repeats=main))
    for method in settings.methods:
        configs.append(for_method(method, "inprocess", main))
    if settings.block_check_k and settings.block_check_k != k:
        for method in ("token", "block"):
            if method in settings.methods:
                configs.append(pipeline(method, "inprocess", extra, k=settings.block_check_k))
    if "rd" in settings.methods:
        for a in settings.rd_sweep:
            if abs(a - a_star) > 1e-3:
                configs.append(pipeline("rd", "inprocess", extra, k=rd_k, a=float(a)))
    if settings.grpc:
        for method in settings.grpc_methods:
            configs.append(for_method(method, "grpc", main))
        variants = list(dict.fromkeys(settings.pipeline_guesses)) or [None]
        for method in settings.pipeline_methods:
            # rd makes no rejection guesses: its variants differ in bonus guesses only
            seen: set[tuple[int, int] | None] = set()
            for guesses in variants:
                effective = None if guesses is None else parse_guesses(guesses)
                if method == "rd" and effective is not None:
                    effective = (effective[0], 0)
                if effective in seen:
                    continue
                seen.add(effective)
                configs.append(for_method(method, "grpc", main, pipelined=True, guesses=guesses))
            if settings.pipeline_max_k and method != "rd":
                max_k = settings.pipeline_max_k
                configs.append(for_method(method, "grpc", main, pipelined=True, max_k=max_k,
                                          guesses=variants[0]))
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate configuration names: {names}")
    return configs


def parse_guesses(text: str) -> tuple[int, int]:
    """ "2+1" → (2 bonus guesses, 1 rejection guess)."""
    try:
        bonus, rejection = (int(part) for part in text.split("+"))
    except ValueError:
        raise ValueError(f"pipeline guesses look like BONUS+REJECTION (e.g. 2+1), got {text!r}") from None
    if bonus < 1 or rejection < 0:
        raise ValueError(f"pipeline guesses need BONUS >= 1 and REJECTION >= 0, got {text!r}")
    return bonus, rejection


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------
def machine_description(threads: int) -> dict[str, Any]:
    import torch
    import transformers

    cpu = cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu,
        "cores": cores,
        "threads_per_model": threads,
        "gpu": torch.cuda.is_available(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _resolve(name_or_path: str, home: Path | None) -> Path:
    from specdec import models

    return Path(models.resolve_model(name_or_path, home))


class _GrpcPair:
    """Drafter and verifier servers in child processes pinned to disjoint cores."""

    def __init__(self, settings: BenchSettings, draft_path: Path, target_path: Path, log_dir: Path) -> None:
        from specdec.cli import processes

        self.processes = processes
        self.supervisor = processes.Supervisor(log_dir)
        draft_cores, target_cores = processes.default_core_split()
        self.cores = {"drafter": draft_cores, "verifier": target_cores}
        common = [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--device",
            settings.device,
            "--dtype",
            settings.dtype,
            "--threads",
            str(settings.threads),
            "--log-level",
            "warning",
        ]
        self.children = []
        for role, path, cores in (
            ("drafter", draft_path, draft_cores),
            ("verifier", target_path, target_cores),
        ):
            args = [role, "--model", str(path), "--cores", processes.format_cores(cores), *common]
            self.children.append(self.supervisor.child(role, args, cores))
        self.addresses: dict[str, str] = {}
        self.timeout = settings.server_timeout_s

    def start(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        for child in self.children:
            self.supervisor.start(child, env=env)
        for child in self.children:
            self.addresses[child.name] = self.processes.wait_ready(child, self.timeout)
        return self.addresses

    def stop(self) -> None:
        self.supervisor.stop(grace=10.0)


def run_bench(settings: BenchSettings, progress: Progress | None = None) -> dict[str, Any]:
    """Run the whole benchmark; returns the results dictionary (also written to out_dir)."""
    import torch

    from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
    from orchestrator.config import OrchestratorConfig
    from orchestrator.speculation import Orchestrator
    from specdec import analysis as analysis_mod
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine
    from specdec.prompts import load_prompts, prompt_ids
    from specdec.runtime.loading import load_model
    from specdec.sampling import SamplingParams

    say = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    began = time.perf_counter()
    out_dir = Path(settings.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    home = Path(settings.home) if settings.home else None
    torch.set_num_threads(settings.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    say(f"loading models ({settings.dtype}, {settings.threads} thread(s) each)")
    draft_path, target_path = _resolve(settings.draft, home), _resolve(settings.target, home)
    target = load_model(
        target_path, device=settings.device, dtype=settings.dtype, threads=settings.threads, home=home
    )
    draft = load_model(
        draft_path, device=settings.device, dtype=settings.dtype, threads=settings.threads, home=home
    )
    if draft.info.vocab_size != target.info.vocab_size:
        raise ValueError(
            f"vocabularies differ: draft {draft.info.vocab_size}, target {target.info.vocab_size}"
        )

    prompts = load_prompts(settings.prompts, settings.num_prompts, home)
    ids = [prompt_ids(p, target.tokenizer, settings.max_prompt_tokens) for p in prompts]
    sampling = SamplingParams(settings.temperature, settings.top_k, settings.top_p)

    n_analysis = settings.analysis_prompts or len(ids)
    say(f"analysing the pair on {n_analysis} prompt(s) × {settings.analysis_tokens} tokens")
    analysis, _ = analysis_mod.analyze(
        target.model,
        draft.model,
        ids[:n_analysis],
        sampling,
        max_new_tokens=settings.analysis_tokens,
        seed=settings.seed,
        draft_id=draft.info.model_id,
        target_id=target.info.model_id,
        progress=say,
        sim_ks=tuple(k for k in (1, 2, 4, settings.block_check_k, settings.k) if k),
    )
    configs = build_configs(settings, analysis)
    analysis_seconds = time.perf_counter() - began
    if settings.save_calibration:
        from specdec.calibration import Calibration, save_calibration

        say(f"calibration saved to {save_calibration(Calibration.from_analysis(analysis), home)}")

    logs = {"inprocess": CallLog(), "grpc": CallLog()}
    config = OrchestratorConfig()
    orchestrators = {
        "inprocess": Orchestrator(
            TimedDrafter(InProcessDrafterClient(DrafterEngine(draft)), logs["inprocess"]),
            TimedVerifier(InProcessVerifierClient(VerifierEngine(target)), logs["inprocess"]),
            config,
            on_iteration=logs["inprocess"].on_iteration,
        )
    }
    grpc_pair = None
    records: list[RunRecord] = []

    def collect(rounds: int) -> dict[str, Any]:
        return {
            "settings": asdict(settings),
            "machine": machine_description(settings.threads),
            "command": " ".join(["python -m bench.run", *to_argv(settings)]),
            "prompts": [p.id for p in prompts],
            "prompt_tokens": [len(i) for i in ids],
            "analysis_key_numbers": key_numbers(analysis),
            "configs": [asdict(c) for c in configs],
            "rounds_done": rounds,
            "summary": summarise(configs, records, analysis),
            "runs": [asdict(r) for r in records],
            "seconds": {"analysis": analysis_seconds, "total": time.perf_counter() - began},
        }

    loop = asyncio.new_event_loop()
    try:
        if any(c.transport == "grpc" for c in configs):
            from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient

            say("starting gRPC drafter and verifier servers (pinned to separate cores)")
            grpc_pair = _GrpcPair(
                settings, draft_path, target_path, Path(tempfile.mkdtemp(prefix="specdec-bench-"))
            )
            addresses = grpc_pair.start()
            orchestrators["grpc"] = Orchestrator(
                TimedDrafter(GrpcDrafterClient(addresses["drafter"], timeout_s=600), logs["grpc"]),
                TimedVerifier(GrpcVerifierClient(addresses["verifier"], timeout_s=600), logs["grpc"]),
                config,
                on_iteration=logs["grpc"].on_iteration,
            )
        for orch in orchestrators.values():
            loop.run_until_complete(orch.start())

        total = sum(c.repeats for c in configs) * len(ids)
        done = 0
        for repeat in range(settings.repeats):
            for pi, prompt in enumerate(ids):
                shift = (repeat * len(ids) + pi) % len(configs)
                for cfg in configs[shift:] + configs[:shift]:
                    if repeat >= cfg.repeats:
                        continue
                    seed = settings.seed + 1000 * repeat + pi
                    if cfg.kind == "pipeline":
                        record = loop.run_until_complete(
                            run_pipeline(
                                orchestrators[cfg.transport], logs[cfg.transport], prompt, cfg, settings, seed
                            )
                        )
                    else:
                        record = run_hf(
                            target, draft, prompt, settings, seed, assisted=cfg.kind == "hf-assisted"
                        )
                    record.config, record.repeat, record.prompt = cfg.name, repeat, prompts[pi].id
                    records.append(record)
                    done += 1
                    say(
                        f"[{done}/{total}] r{repeat} {prompts[pi].id:>14s} {cfg.name:40s} "
                        f"{record.tokens / record.seconds:6.2f} tok/s "
                        f"(decode {record.decode_tokens / max(record.decode_seconds, 1e-9):6.2f})"
                    )
            # A long run that is stopped early still leaves every finished round behind.
            partial = collect(repeat + 1)
            (out_dir / "results.partial.json").write_text(json.dumps(json_safe(partial), indent=1))
        for orch in orchestrators.values():
            loop.run_until_complete(orch.close())
    finally:
        loop.close()
        if grpc_pair is not None:
            grpc_pair.stop()

    results = collect(settings.repeats)
    write_outputs(results, analysis.to_dict(), out_dir)
    (out_dir / "results.partial.json").unlink(missing_ok=True)
    return results


def key_numbers(analysis) -> dict[str, Any]:
    plan = analysis.plan
    return {
        "alpha": analysis.acceptance["alpha"],
        "ersd_alpha": analysis.acceptance["ersd_alpha"],
        "d_hm": analysis.acceptance["d_hm"],
        "kl": analysis.acceptance["kl"],
        "t_p": analysis.timing.t_p,
        "t_q": analysis.timing.t_q,
        "c": analysis.timing.c,
        "lambda": analysis.timing.lam,
        "best_k": plan["sequence"]["best_k"],
        "best_k_timed": plan["sequence"]["best_k_timed"],
        "tree_budget": plan["tree"]["gsd"]["budget"],
        "tree_parents": plan["tree"]["gsd"]["parents"],
        "best_a": plan["rd"]["schedule"]["a"],
        "rd_k_max": plan["rd"]["schedule"]["k_max"],
        "best_a_k1": plan["rd"]["best_a_k1"],
        "lemma_4_3_holds": plan["rd"]["lemma_4_3_holds"],
        "lemma_4_3_threshold": plan["rd"]["lemma_4_3_threshold"],
    }


def _median_rate(
    rs: Sequence[RunRecord], tokens: Callable[[RunRecord], float], seconds: Callable[[RunRecord], float]
) -> float | None:
    """Median over repeats of (Σ tokens / Σ seconds) over the repeat's prompts."""
    per_repeat: dict[int, list[RunRecord]] = {}
    for r in rs:
        per_repeat.setdefault(r.repeat, []).append(r)
    values = [
        sum(tokens(x) for x in g) / sum(seconds(x) for x in g)
        for g in per_repeat.values()
        if sum(seconds(x) for x in g) > 0
    ]
    return statistics.median(values) if values else None


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def summarise(configs: Sequence[RunConfig], records: Sequence[RunRecord], analysis) -> list[dict[str, Any]]:
    """One row per configuration: medians over repeats.

    `tokens_per_second` is end to end (prefill included); `decode_tokens_per_second` leaves out
    the step that produced the first new token(s) — the prompt's prefill, the same for every
    method — and is what the speedups (and the analytic predictions) are about.
    """
    by_config: dict[str, list[RunRecord]] = {}
    for r in records:
        by_config.setdefault(r.config, []).append(r)

    def e2e(rs: Sequence[RunRecord]) -> float | None:
        return _median_rate(rs, lambda r: r.tokens, lambda r: r.seconds)

    def decode(rs: Sequence[RunRecord]) -> float | None:
        return _median_rate(rs, lambda r: r.decode_tokens, lambda r: r.decode_seconds)

    base_records = [r for r in records if r.config == configs[0].name]
    rows = []
    for cfg in configs:
        rs = by_config.get(cfg.name, [])
        # Compare with the baseline on the same repeats only (sweep configurations run fewer).
        base_same = [r for r in base_records if r.repeat < cfg.repeats] or base_records
        tps, dtps = e2e(rs), decode(rs)
        base_tps, base_dtps = e2e(base_same), decode(base_same)
        speedup = dtps / base_dtps if dtps and base_dtps else None
        calls = sum(r.target_calls for r in rs)
        drafted = sum(r.drafted for r in rs)
        iteration_seconds = sum(r.iteration_seconds for r in rs)
        iterations = sum(r.iterations for r in rs)
        overhead = sum(r.overhead_seconds for r in rs)
        row = {
            "name": cfg.name,
            "kind": cfg.kind,
            "transport": cfg.transport,
            "method": cfg.method,
            "k": cfg.k,
            "a": cfg.a,
            "tree_budget": cfg.tree_budget,
            "runs": len(rs),
            "repeats": cfg.repeats,
            "tokens_per_second": tps,
            "speedup_end_to_end": tps / base_tps if tps and base_tps else None,
            "decode_tokens_per_second": dtps,
            "speedup": speedup,
            "block_efficiency": sum(r.tokens for r in rs) / calls if calls else None,
            "acceptance": sum(r.accepted for r in rs) / drafted if drafted else None,
            "overhead_fraction": overhead / iteration_seconds if iteration_seconds else None,
            "overhead_ms_per_iteration": 1000 * overhead / iterations if iterations else None,
            "pipelined": cfg.pipeline,
            "pre_drafts_used": sum(r.pre_drafts_used for r in rs),
            "pre_drafts_dropped": sum(r.pre_drafts_dropped for r in rs),
            "pre_draft_bonus_hits": _rank_sums(r.pre_draft_bonus_hits for r in rs),
            "pre_draft_rejection_hits": _rank_sums(r.pre_draft_rejection_hits for r in rs),
            # share of the verifier's busy time during which the drafter was busy as well
            "overlap_share": _ratio(
                sum(r.overlap_seconds for r in rs), sum(r.verifier_busy_seconds for r in rs)
            ),
            "predicted_speedup": None,
            "predicted_speedup_timed": None,
            "fraction_of_analytic": None,
        }
        if cfg.kind == "pipeline" and cfg.method:
            pred = analysis.predict(cfg.method, k=cfg.k, a=cfg.a, tree_budget=cfg.tree_budget)
            row["predicted_speedup"] = pred["speedup_formula"]
            row["predicted_speedup_timed"] = pred["speedup_timed"]
            if speedup:
                row["fraction_of_analytic"] = speedup / pred["speedup_formula"]
        elif cfg.kind == "baseline":
            row["predicted_speedup"] = row["predicted_speedup_timed"] = 1.0
        rows.append(row)
    return rows


def write_outputs(results: dict[str, Any], analysis_dict: dict[str, Any], out_dir: Path) -> None:
    from bench.plots import plot_bench
    from specdec.plots import plot_analysis

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "analysis.json").write_text(json.dumps(analysis_dict, indent=1))
    measured_rd = []
    base = next((r for r in results["summary"] if r["kind"] == "baseline"), None)
    for row in results["summary"]:
        if row["method"] == "rd" and row["transport"] == "inprocess" and row["speedup"] and base:
            measured_rd.append((float(row["a"]), float(row["speedup"])))
    files = plot_analysis(analysis_dict, out_dir, measured_rd)
    files.append(plot_bench(results, out_dir / "bench_tps.png"))
    results["files"] = [str(Path(f).name) for f in files] + ["results.json", "analysis.json", "summary.md"]
    (out_dir / "results.json").write_text(json.dumps(json_safe(results), indent=1))
    (out_dir / "summary.md").write_text(summary_markdown(results))


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:{spec}}{suffix}"
    return str(value)


def render_table(results: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    key = results["analysis_key_numbers"]
    console.print(
        f"[bold]{results['settings']['draft']} → {results['settings']['target']}[/]  "
        f"α={key['alpha']:.3f}  c={key['c']:.2f}  λ={key['lambda']:.3f}  best k={key['best_k_timed']}  "
        f"tree budget={key['tree_budget']}  a*={key['best_a']:.3f} (k_max={key['rd_k_max']})  "
        f"Lemma 4.3 {'holds' if key['lemma_4_3_holds'] else 'fails'}"
    )
    table = Table(title="benchmark (medians over repeats; speedup = decode tok/s vs the baseline's)")
    for column in (
        "configuration",
        "runs",
        "tok/s",
        "decode tok/s",
        "speedup",
        "tokens/target call",
        "acceptance",
        "overhead",
        "overlap",
        "pre-drafts used/dropped",
        "predicted",
        "achieved",
    ):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for row in results["summary"]:
        table.add_row(
            row["name"],
            str(row["runs"]),
            _fmt(row["tokens_per_second"]),
            _fmt(row["decode_tokens_per_second"]),
            _fmt(row["speedup"], ".2f", "×"),
            _fmt(row["block_efficiency"]),
            _fmt(row["acceptance"], ".3f"),
            _fmt(
                row["overhead_fraction"] * 100 if row["overhead_fraction"] is not None else None, ".1f", "%"
            ),
            _percent(row.get("overlap_share")),
            _predrafts(row),
            _fmt(row["predicted_speedup"], ".2f", "×"),
            _fmt(
                row["fraction_of_analytic"] * 100 if row["fraction_of_analytic"] is not None else None,
                ".0f",
                "%",
            ),
        )
    console.print(table)


def _percent(value: float | None) -> str:
    return _fmt(value * 100 if value is not None else None, ".0f", "%")


def _rank_sums(per_run) -> list[int]:
    """Element-wise sums of per-run counts by rank (lists of different lengths)."""
    total: list[int] = []
    for counts in per_run:
        for rank, count in enumerate(counts):
            if rank == len(total):
                total.append(0)
            total[rank] += int(count)
    return total


def _predrafts(row: dict[str, Any]) -> str:
    if not row.get("pipelined"):
        return "–"
    return f"{row.get('pre_drafts_used', 0)} / {row.get('pre_drafts_dropped', 0)}"


def markdown_table(results: dict[str, Any]) -> str:
    lines = [
        "| configuration | runs | tok/s (end to end) | decode tok/s | decode speedup | tokens / target call "
        "| acceptance | overhead | draft/verify overlap | pre-drafts used / dropped "
        "| predicted speedup (formula / timed) | achieved vs formula |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["summary"]:
        overhead = row["overhead_fraction"]
        frac = row["fraction_of_analytic"]
        lines.append(
            f"| {row['name']} | {row['runs']} | {_fmt(row['tokens_per_second'])} "
            f"| {_fmt(row['decode_tokens_per_second'])} | {_fmt(row['speedup'], '.2f', '×')} "
            f"| {_fmt(row['block_efficiency'])} | {_fmt(row['acceptance'], '.3f')} "
            f"| {_fmt(overhead * 100 if overhead is not None else None, '.1f', '%')} "
            f"| {_percent(row.get('overlap_share'))} | {_predrafts(row)} "
            f"| {_fmt(row['predicted_speedup'], '.2f', '×')} "
            f"/ {_fmt(row['predicted_speedup_timed'], '.2f', '×')} "
            f"| {_fmt(frac * 100 if frac is not None else None, '.0f', '%')} |"
        )
    return "\n".join(lines)


def summary_markdown(results: dict[str, Any]) -> str:
    """The run as Markdown: command, machine, key numbers of the analyser, the table."""
    key, m, st = results["analysis_key_numbers"], results["machine"], results["settings"]
    holds = "holds" if key["lemma_4_3_holds"] else "does not hold"
    lines = [
        f"# {st['draft']} → {st['target']}",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads_per_model']} torch thread(s) per model, "
        f"{st['dtype']}, GPU: {'yes' if m['gpu'] else 'no'}; torch {m['torch']}, "
        f"transformers {m['transformers']}.",
        "",
        f"Prompts ({st['prompts']}): {', '.join(results['prompts'])}; {st['max_new_tokens']} new tokens, "
        f"T={st['temperature']}, top-k={st['top_k']}, top-p={st['top_p']}, {st['repeats']} repeats.",
        "",
        f"Analyser: α = {key['alpha']:.3f}, ERSD α = {key['ersd_alpha']:.3f}, "
        f"T_p = {key['t_p'] * 1000:.0f} ms, T_q = {key['t_q'] * 1000:.0f} ms, c = {key['c']:.2f}, "
        f"λ = {key['lambda']:.3f}; best k = {key['best_k']} (formula) / {key['best_k_timed']} "
        f"(measured T_p(n)); tree budget {key['tree_budget']} {key['tree_parents']}; "
        f"RD a* = {key['best_a']:.3f} with k_max = {key['rd_k_max']} (k = 1: a* = {key['best_a_k1']:.3f}); "
        f"Lemma 4.3 {holds} (λ vs Σ_(p>q) q = {key['lemma_4_3_threshold']:.3f}).",
        "",
        markdown_table(results),
        "",
        f"Wall time: analysis {results['seconds']['analysis']:.0f} s, "
        f"total {results['seconds']['total']:.0f} s.",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------
def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _strings(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parser() -> argparse.ArgumentParser:
    d = BenchSettings()
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default=d.draft)
    p.add_argument("--target", default=d.target)
    p.add_argument("--prompts", default=d.prompts, choices=("humaneval", "mtbench", "builtin"))
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--methods", type=_strings, default=d.methods, help="comma-separated: " + ", ".join(PIPELINE_METHODS)
    )
    p.add_argument(
        "--k", type=int, default=None, help="sequence draft length (default: the analyser's best k)"
    )
    p.add_argument("--rd-sweep", type=_floats, default=d.rd_sweep, help="extra RD draft probabilities a")
    p.add_argument(
        "--block-check-k",
        type=int,
        default=d.block_check_k,
        help="also run token and block at this k (0 = off)",
    )
    p.add_argument("--sweep-repeats", type=int, default=d.sweep_repeats)
    p.add_argument("--no-grpc", dest="grpc", action="store_false")
    p.add_argument("--grpc-methods", type=_strings, default=d.grpc_methods)
    p.add_argument("--pipeline-methods", type=_strings, default=d.pipeline_methods,
                   help="also run these over gRPC pipelined (token, block, ersd, rd); '' = none")
    p.add_argument("--pipeline-max-k", type=int, default=d.pipeline_max_k,
                   help="cap of the adaptive pipelined variants (token, block, ersd); 0 = no such variants")
    p.add_argument("--pipeline-guesses", type=_strings, default=d.pipeline_guesses,
                   help="look-ahead guesses of the pipelined rows, BONUS+REJECTION, comma-separated "
                        "(one row per entry; the adaptive rows use the first); default: one row with "
                        "the orchestrator's automatic choice")
    p.add_argument("--no-hf-assisted", dest="hf_assisted", action="store_false")
    p.add_argument("--analysis-prompts", type=int, default=None)
    p.add_argument("--analysis-tokens", type=int, default=d.analysis_tokens)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per model")
    p.add_argument("--device", default=d.device)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--out", dest="out_dir", default=d.out_dir)
    p.add_argument("--no-save-calibration", dest="save_calibration", action="store_false")
    p.add_argument(
        "--server-timeout-s",
        type=float,
        default=d.server_timeout_s,
        help="seconds a gRPC server may take to load its model",
    )
    p.add_argument("--home", default=None, help="specdec home (default $SPECDEC_HOME or ~/.cache/specdec)")
    return p


def to_argv(settings: BenchSettings) -> list[str]:
    """The options that differ from the defaults (to print the exact command of a run)."""
    d = BenchSettings()
    argv: list[str] = []
    flags = {
        "grpc": "--no-grpc",
        "hf_assisted": "--no-hf-assisted",
        "save_calibration": "--no-save-calibration",
    }
    for name, value in asdict(settings).items():
        if value == getattr(d, name):
            continue
        if name in flags:
            argv.append(flags[name])
        elif isinstance(value, (list, tuple)):
            argv += [f"--{name.replace('_', '-')}", ",".join(str(v) for v in value)]
        elif name == "block_check_k" and value is None:
            argv += ["--block-check-k", "0"]
        elif name == "out_dir":
            argv += ["--out", str(value)]
        elif value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    values = vars(args)
    if values.get("block_check_k") == 0:
        values["block_check_k"] = None
    unknown = [m for m in values["methods"] if m not in PIPELINE_METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {', '.join(PIPELINE_METHODS)}")
    for guesses in values["pipeline_guesses"]:
        try:
            parse_guesses(guesses)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    return BenchSettings(**values)


def main(argv: list[str] | None = None) -> int:
    settings = settings_from_args(parser().parse_args(argv))
    results = run_bench(settings)
    render_table(results)
    print(f"results in {settings.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
