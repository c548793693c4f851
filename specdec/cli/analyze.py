"""`specdec analyze`: the workload analyser's command (a typer sub-app the main CLI mounts).

The benchmark harness is a repo tool, not a command: `python -m bench.run` (bench/RESULTS.md).
An adapter only: parse options, load the models, call specdec.analysis, render.
Heavy imports (torch, transformers, matplotlib) happen inside the commands so `--help` is instant.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from specdec.cli.commands import SpecdecCommand, SpecdecGroup
from specdec.cli.common import apply_environment_defaults, err, fail
from specdec.cli.options import PRECISION_CHOICES, check_device, one_of
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

DEFAULT_DRAFT, DEFAULT_TARGET = DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
PROMPT_SETS = ("humaneval", "mtbench", "builtin")

analyze_app = typer.Typer(cls=SpecdecGroup, add_completion=False, pretty_exceptions_enable=False)


def _console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=max(console.width, 140))
    return console


def _resolve(name_or_path: str, role: str, home: Path | None) -> Path:
    from specdec import models

    try:
        path = Path(models.resolve_model(name_or_path, home))
    except models.ModelNotInstalled:
        raise fail(
            f"{role} model {name_or_path!r} is not installed; install it with: "
            f"specdec models install {name_or_path}"
        ) from None
    except (OSError, ValueError) as exc:
        raise fail(f"{role} model {name_or_path!r}: {exc}") from None
    if not path.exists():
        raise fail(f"{role} model {name_or_path!r}: no such file or directory, and not a registry name")
    return path


# ============================================================================================ analyze

DraftOpt = Annotated[str, typer.Option("--draft", help="Draft model: registry name or path.")]
TargetOpt = Annotated[str, typer.Option("--target", help="Target model: registry name or path.")]
PromptsOpt = Annotated[str, typer.Option("--prompts", help=f"Prompt set: {' | '.join(PROMPT_SETS)}.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", help="Sampling temperature (0 = greedy).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens; 0 = off.")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1]; 1 = off.")]
ThreadsOpt = Annotated[int, typer.Option("--threads", help="torch CPU threads per model.")]
DeviceOpt = Annotated[str, typer.Option("--device", callback=check_device,
                                        help="torch device of both models: cpu, cuda, cuda:N or mps.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", callback=one_of(PRECISION_CHOICES), help=(
    "Weights precision: auto | float32 | bfloat16 | float16 | int8 (as `specdec up --dtype`)."))]
HomeOpt = Annotated[
    Path | None,
    typer.Option(
        "--home",
        help="specdec home (models, datasets, calibration). Default: $SPECDEC_HOME or ~/.cache/specdec.",
        show_default=False,
    ),
]


@analyze_app.command("analyze", cls=SpecdecCommand)
def analyze(
    draft: DraftOpt = DEFAULT_DRAFT,
    target: TargetOpt = DEFAULT_TARGET,
    prompts: PromptsOpt = "humaneval",
    num_prompts: Annotated[
        int, typer.Option("--num-prompts", help="How many prompts of the set to use.")
    ] = 5,
    max_new_tokens: Annotated[
        int,
        typer.Option("--max-new-tokens", help="Tokens the target samples per prompt (measured positions)."),
    ] = 48,
    temperature: TemperatureOpt = 1.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the sampled continuations and simulations.")
    ] = 0,
    k_max: Annotated[int, typer.Option("--k-max", help="Largest draft length / RD k_max considered.")] = 16,
    max_budget: Annotated[int, typer.Option("--max-budget", help="Largest tree budget considered.")] = 32,
    rank_samples: Annotated[
        int,
        typer.Option(
            "--rank-samples", help="Monte Carlo nodes per measured row for the rank acceptance R(j)."
        ),
    ] = 256,
    threads: ThreadsOpt = 1,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Folder for analysis.json and the PNG plots. Default: $SPECDEC_HOME/analysis/DRAFT__TARGET.",
            show_default=False,
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the analysis as JSON on stdout instead of the report.")
    ] = False,
    save_calibration: Annotated[
        bool,
        typer.Option(
            "--save-calibration/--no-save-calibration",
            help="Also store the result as the pair's calibration "
            "($SPECDEC_HOME/calibration/DRAFT__TARGET.json), which the orchestrator then uses as its "
            "defaults for the pair (it says so on start). Off unless asked: analysing never changes "
            "how the service runs behind your back.",
        ),
    ] = False,
    home: HomeOpt = None,
) -> None:
    """Measure a draft/target pair (acceptance, divergences, entropies, rank acceptance, forward times)
    and report the best k, tree shape and RD draft probability a, expected speedups and the bounds."""
    apply_environment_defaults()  # also when analyze_app runs on its own, without the root callback
    from specdec.calibration import Calibration, pair_key
    from specdec.calibration import save_calibration as save
    from specdec.plots import plot_analysis
    from specdec.prompts import load_prompts, prompt_ids
    from specdec.sampling import SamplingParams, SamplingParamsError

    if prompts not in PROMPT_SETS:
        raise typer.BadParameter(f"choose one of {', '.join(PROMPT_SETS)}", param_hint="--prompts")
    try:
        sampling = SamplingParams(temperature, top_k, top_p)
    except SamplingParamsError as exc:
        raise typer.BadParameter(str(exc)) from None
    if num_prompts < 1 or max_new_tokens < 2:
        raise typer.BadParameter("need --num-prompts >= 1 and --max-new-tokens >= 2")
    draft_path = _resolve(draft, "draft", home)
    target_path = _resolve(target, "target", home)
    say = (
        (lambda message: err.print(f"[dim]{escape(message)}[/]")) if not json_out else (lambda message: None)
    )
    try:
        import torch
        from transformers.utils import logging as hf_logging

        from specdec.analysis import analyze as run_analysis
        from specdec.runtime.loading import load_model

        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads)
        say("loading models")
        target_model = load_model(target_path, device=device, dtype=dtype, threads=threads, home=home)
        draft_model = load_model(draft_path, device=device, dtype=dtype, threads=threads, home=home)
        if draft_model.info.vocab_size != target_model.info.vocab_size:
            raise ValueError(
                f"vocabularies differ: draft {draft_model.info.vocab_size}, "
                f"target {target_model.info.vocab_size}"
            )
        ids = [prompt_ids(p, target_model.tokenizer) for p in load_prompts(prompts, num_prompts, home)]
        result, _ = run_analysis(
            target_model.model,
            draft_model.model,
            ids,
            sampling,
            max_new_tokens=max_new_tokens,
            seed=seed,
            draft_id=draft_model.info.model_id,
            target_id=target_model.info.model_id,
            progress=say,
            k_max=k_max,
            max_budget=max_budget,
            rank_samples=rank_samples,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise fail(f"{type(exc).__name__}: {exc}") from None
    result.meta["prompt_set"] = prompts
    data = result.to_dict()
    key = pair_key(result.meta["draft_id"], result.meta["target_id"])
    from specdec.defaults import specdec_home

    out_dir = out or (Path(home) if home else specdec_home()) / "analysis" / key
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "analysis.json").write_text(json.dumps(data, indent=1))
    files = plot_analysis(data, out_dir)
    saved = save(Calibration.from_analysis(result), home) if save_calibration else None
    if json_out:
        sys.stdout.write(json.dumps(data, indent=1) + "\n")
        return
    render_analysis(data, _console())
    err.print(f"wrote {out_dir / 'analysis.json'} and {', '.join(f.name for f in files)} in {out_dir}")
    if saved is not None:
        err.print(f"calibration saved to {saved}")


def _f(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return f"{value:{spec}}"
    return str(value)


def render_analysis(data: dict[str, Any], console: Console) -> None:
    """The terminal report of an analysis (its to_dict() form)."""
    meta, acc, ent, timing = data["meta"], data["acceptance"], data["entropy"], data["timing"]
    plan, bounds = data["plan"], data["bounds"]
    s = meta["sampling"]
    console.print(
        f"[bold]{escape(str(meta['draft_id']))} → {escape(str(meta['target_id']))}[/]  "
        f"{meta['prompts']} prompts, {meta['rows']} measured positions, vocab {meta['vocab']}, "
        f"T={s['temperature']} top-k={s['top_k']} top-p={s['top_p']}"
    )

    t = Table(title="distributions (means over positions)", show_header=True)
    for col in ("α = 1−TV", "ERSD α", "D_HM", "KL(p‖q)", "μ = H[p]", "μ₂", "cross-entropy", "H[q]"):
        t.add_column(escape(col), justify="right")
    t.add_row(
        _f(acc["alpha"]),
        _f(acc["ersd_alpha"]),
        _f(acc["d_hm"]),
        _f(acc["kl"]),
        _f(ent["mu"]),
        _f(ent["mu2"]),
        _f(ent["cross_entropy"]),
        _f(ent["draft_entropy"]),
    )
    console.print(t)
    per_pos = acc["alpha_per_position"]
    console.print(
        "α per position: " + " ".join(f"{v:.2f}" for v in per_pos[:24]) + (" …" if len(per_pos) > 24 else "")
    )

    t = Table(title="forward time (median, seconds)")
    t.add_column("tokens", justify="right")
    t.add_column("target T_p(n)", justify="right")
    t.add_column("draft T_q(n)", justify="right")
    for n, v in timing["target_seconds"].items():
        t.add_row(n, f"{v:.4f}", f"{timing['draft_seconds'][n]:.4f}")
    console.print(t)
    console.print(
        f"c = T_p/T_q = {timing['c']:.3f}   λ = T_q/T_p = {timing['lambda']:.3f}   "
        f"(context {timing['context_len']} tokens, {timing['threads']} thread(s))"
    )

    t = Table(title="rank acceptance R(j) (Monte Carlo on measured rows)")
    t.add_column("j", justify="right")
    t.add_column("recursive rejection", justify="right")
    t.add_column("races (ERSD)", justify="right")
    for j, (g, e) in enumerate(
        zip(data["rank_acceptance"]["gsd"], data["rank_acceptance"]["ersd"], strict=False)
    ):
        t.add_row(str(j + 1), f"{g:.4f}", f"{e:.4f}")
    console.print(t)

    seq, rd = plan["sequence"], plan["rd"]
    console.print(
        f"[bold]best k[/] (formula) = {seq['best_k']} (speedup {seq['speedup']:.3f}); with measured "
        f"T_p(k+1): k = {seq['best_k_timed']} (speedup {seq['speedup_timed']:.3f})"
    )
    for kind, label in (("gsd", "gsd-tree"), ("ersd", "ersd tree")):
        tree = plan["tree"][kind]
        console.print(
            f"[bold]best {label}[/]: budget {tree['budget']}, depth {tree['depth']}, parents "
            f"{tree['parents']}, E\\[tokens] {tree['expected_tokens']:.3f}"
        )
    if not seq.get("pays_timed", True):
        ts = timing["target_seconds"]
        n = max(ts, key=int)
        console.print(
            f"[bold yellow]note:[/] with the measured forward times no draft length beats the target alone "
            f"here: a pass over {n} tokens costs {ts[n] / ts['1']:.1f}× a one-token pass "
            "(the formula assumes 1×)."
        )
    sched = rd["schedule"]
    console.print(
        f"[bold]RD[/]: best a (k=1, Toner et al.) = {rd['best_a_k1']:.3f}; best (a, k_max) = "
        f"({sched['a']:.3f}, {sched['k_max']}), α(a) = {sched['alpha']:.3f}; Lemma 4.3 "
        f"{'holds' if rd['lemma_4_3_holds'] else 'does not hold'} (λ = {rd['lambda']:.3f} vs "
        f"Σ_(p>q) q = {rd['lemma_4_3_threshold']:.3f})"
    )

    t = Table(title="expected speedup per method")
    for col in ("method", "k / budget / a", "E[tokens/iter]", "speedup (formula)", "speedup (timed)"):
        t.add_column(escape(col), justify="left" if col == "method" else "right")
    for name, m in plan["methods"].items():
        knobs = ", ".join(f"{k}={_f(m[k], '.3g')}" for k in ("k", "tree_budget", "a") if k in m)
        t.add_row(name, knobs, _f(m["expected_tokens"]), _f(m["speedup_formula"]), _f(m["speedup_timed"]))
    console.print(t)

    t = Table(title=f"bounds at budget {bounds['budget']} (expected tokens per iteration)")
    for col in (
        "Tunstall (GSD R)",
        "Tunstall (ERSD R)",
        "refined (GSD)",
        "refined (ERSD)",
        "speed of light",
        "SoL asymptotic",
        "SoL drafter",
    ):
        t.add_column(col, justify="right")
    t.add_row(
        _f(bounds["tunstall_gsd"]),
        _f(bounds["tunstall_ersd"]),
        _f(bounds["tunstall_refined_gsd"]),
        _f(bounds["tunstall_refined_ersd"]),
        _f(bounds["speed_of_light"]),
        _f(bounds["speed_of_light_asymptotic"]),
        _f(bounds["speed_of_light_drafter"]),
    )
    console.print(t)
    if bounds["speed_of_light"] is None and bounds.get("speed_of_light_min_p_cap") is not None:
        console.print(f"speed of light (Thm 1) needs P_cap ≥ {bounds['speed_of_light_min_p_cap']:.2f}")
