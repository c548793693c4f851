"""`specdec generate`: one prompt, N samples, from a running orchestrator or in-process.

The options become one GenerationRequest (`build_request`, the only place that maps flags to
request fields) and one GenerateRun (how to run it: server or in-process, output format);
`run_samples` then sends the request once per sample, varying only the seed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from specdec.cli.common import (
    CliError,
    describe_error,
    err,
    exit_now,
    fail,
    orchestrator_config,
    quiet_transformers,
    resolve_model,
)
from specdec.cli.observability import ObservabilityOptions, OtlpEndpointOpt, TraceFileOpt
from specdec.cli.options import (
    TOKEN_ENV,
    DtypeOpt,
    TlsCaOpt,
    TlsClientCertOpt,
    TlsClientKeyOpt,
    TlsServerNameOpt,
    TokenFileOpt,
    check_device,
    client_security,
    one_of,
)
from specdec.cli.processes import DEFAULT_ORCHESTRATOR_ADDRESS
from specdec.defaults import (
    AUTO_PRECISION,
    DEFAULT_A,
    DEFAULT_DRAFT_SOURCE,
    DEFAULT_K,
    DEFAULT_METHOD,
    DEFAULT_PIPELINE,
    DEFAULT_TREE_BUDGET,
    DRAFT_SOURCES,
)
from specdec.methods import METHOD_NAMES

if TYPE_CHECKING:
    from specdec.generation import GenerationRequest  # light, but not needed for --help
    from specdec.rpc.security import ClientSecurity  # imports grpc


@dataclass(frozen=True)
class GenerateRun:
    """How `generate` runs its request: everything the options set that is not part of the request."""

    address: str = DEFAULT_ORCHESTRATOR_ADDRESS  # server mode: the orchestrator to talk to
    draft: str | None = None  # in-process mode (both given): the models, loaded in this process
    target: str | None = None
    device: str = "cpu"  # in-process mode: torch device, dtype and CPU threads of both models
    dtype: str = AUTO_PRECISION
    threads: int | None = None
    timeout: float = 600.0  # server mode: seconds one request may take
    num_samples: int = 1
    as_json: bool = False
    stream: bool = False
    observability: ObservabilityOptions = field(default_factory=ObservabilityOptions)
    security: ClientSecurity | None = None  # server mode: TLS / mTLS and the token (None: plaintext)

    @property
    def in_process(self) -> bool:
        return self.draft is not None


def parse_prompt(prompt_text: str | None, prompt: str | None,
                 prompt_ids: str | None) -> tuple[str | None, list[int] | None]:
    """The prompt as (text, token ids), at most one of them; a usage error (exit 2) when given twice."""
    texts = [text for text in (prompt_text, prompt) if text is not None]
    if len(texts) > 1:
        raise typer.BadParameter("give the prompt once: as the argument or with --prompt",
                                 param_hint="--prompt")
    ids = parse_prompt_ids(prompt_ids)
    if texts and ids is not None:
        raise typer.BadParameter("give prompt text or --prompt-ids, not both", param_hint="--prompt-ids")
    return (texts[0] if texts else None), ids


def parse_prompt_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise typer.BadParameter("expected comma-separated integers, e.g. 1,2,3",
                                 param_hint="--prompt-ids") from None


def build_request(*, prompt: str | None, prompt_ids: list[int] | None, max_new_tokens: int,
                  temperature: float, top_k: int, top_p: float, stop: list[str] | None, ignore_eos: bool,
                  seed: int | None, method: str | None, k: int | None, tree_budget: int | None,
                  a: float | None, pipeline: bool | None, pipeline_max_k: int | None,
                  bonus_guesses: int | None, rejection_guesses: int | None, chat: bool = False,
                  system: str | None = None, draft_source: str | None = None,
                  cache_salt: str | None = None) -> GenerationRequest:
    """The request that `generate`'s options describe (one per run; samples vary only its seed).

    None leaves a setting to the orchestrator; --ignore-eos is an empty stop_token_ids list; --chat
    sends the prompt as the user's turn of a chat (after --system's, if given).
    Raises SamplingParamsError (a ValueError) when --temperature / --top-k / --top-p are out of range.
    """
    from specdec.generation import ChatMessage, GenerationRequest  # torch-free: server mode imports no torch
    from specdec.sampling_params import SamplingParams

    messages = None
    if chat:
        messages = [*([ChatMessage("system", system)] if system else []), ChatMessage("user", prompt or "")]
        prompt = None
    return GenerationRequest(
        messages=messages, prompt=prompt, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
        sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        stop=list(stop or []), stop_token_ids=[] if ignore_eos else None, seed=seed, method=method, k=k,
        tree_budget=tree_budget, a=a, pipeline=pipeline, pipeline_max_k=pipeline_max_k,
        pipeline_bonus_guesses=bonus_guesses, pipeline_rejection_guesses=rejection_guesses,
        draft_source=draft_source, cache_salt=cache_salt)


def sample_request(request: GenerationRequest, sample: int) -> GenerationRequest:
    """Sample i of a request: seed + i (reproducible runs), or a random seed each when none is given."""
    return replace(request, seed=None if request.seed is None else request.seed + sample)


def generate(
    prompt_text: Annotated[str | None, typer.Argument(
        help="Prompt text (or use --prompt / --prompt-ids).", show_default=False, metavar="PROMPT")] = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text.", show_default=False)] =
        None,
    prompt_ids: Annotated[str | None, typer.Option(
        "--prompt-ids", help="Prompt as comma-separated token ids, e.g. 1,2,3.", show_default=False)] = None,
    chat: Annotated[bool, typer.Option(
        "--chat", help="Send the prompt as the user's turn of a chat: the target's chat template (or the "
        "orchestrator's --chat-template) makes the prompt, ending with the assistant's turn.")] = False,
    system: Annotated[str | None, typer.Option(
        "--system", help="With --chat: a system message before the user's.", show_default=False)] = None,
    address: Annotated[str, typer.Option(
        "--address", envvar="SPECDEC_ADDRESS", help="Orchestrator to talk to (where `specdec up` listens by "
        "default; env SPECDEC_ADDRESS). Not used with --draft/--target.")] = DEFAULT_ORCHESTRATOR_ADDRESS,
    draft: Annotated[str | None, typer.Option(
        "--draft", help="Run IN-PROCESS, without servers, with this draft model (registry name or path); "
        "needs --target.", show_default=False)] = None,
    target: Annotated[str | None, typer.Option(
        "--target", help="Target model of in-process mode; needs --draft.", show_default=False)] = None,
    device: Annotated[str, typer.Option(
        "--device", callback=check_device, help="In-process mode: torch device of both models (cpu, cuda, "
        "cuda:N, mps).")] = "cpu",
    dtype: DtypeOpt = AUTO_PRECISION,
    threads: Annotated[int | None, typer.Option(
        "--threads", help="In-process mode: torch CPU threads. Default: torch's default.",
        show_default=False)] = None,
    method: Annotated[str | None, typer.Option(
        "--method", callback=one_of(METHOD_NAMES),
        help=f"Verification method: {' | '.join(METHOD_NAMES)}. Default: the orchestrator's "
        f"(its --default-method; {DEFAULT_METHOD} unless set).", show_default=False)] = None,
    k: Annotated[int | None, typer.Option(
        "--k", "-k", help="Draft length (token, block, ersd; rd's k_max) or tree budget (gsd-tree). "
        f"Default: the orchestrator's (its --default-k; {DEFAULT_K} unless set or calibrated, picked online "
        f"for requests without --seed under its --adaptive-k; {DEFAULT_TREE_BUDGET} nodes for gsd-tree).",
        show_default=False)] = None,
    draft_source: Annotated[str | None, typer.Option(
        "--draft-source", callback=one_of(DRAFT_SOURCES),
        help=f"Where drafts come from: {' | '.join(DRAFT_SOURCES)} (hybrid: per iteration a model-free "
        "draft from the request's own n-grams or recent requests when it pays, else the draft model, else "
        "a target-only step; the others: that source alone). Default: the orchestrator's (its "
        f"$SPECDEC_DRAFT_SOURCE; {DEFAULT_DRAFT_SOURCE} unless set).", show_default=False)] = None,
    cache_salt: Annotated[str | None, typer.Option(
        "--cache-salt", help="Share the engines' prefix caches only with requests of the same caller and "
        "this salt (at most 256 printable characters). Default: the caller's shared cache.",
        show_default=False)] = None,
    tree_budget: Annotated[int | None, typer.Option(
        "--tree-budget", help="Draft-tree node budget (gsd-tree; ersd drafts a tree when given). "
        "Default: the orchestrator's.", show_default=False)] = None,
    a: Annotated[float | None, typer.Option(
        "--a", help="RD drafting probability in [0, 1] (method rd). Default: the orchestrator's (its "
        f"--default-a; {DEFAULT_A:g} unless set or calibrated).",
        show_default=False)] = None,
    pipeline: Annotated[bool | None, typer.Option(
        "--pipeline/--no-pipeline", help="Pre-draft the next block while the verifier checks this one "
        "(token, block, ersd, rd at K = k_max; exact either way). Default: the orchestrator's "
        f"(its $SPECDEC_PIPELINE; {'on' if DEFAULT_PIPELINE else 'off'} unless set).",
        show_default=False)] = None,
    pipeline_max_k: Annotated[int | None, typer.Option(
        "--pipeline-max-k", help="With --pipeline (token, ersd): let a pre-drafted block grow until the "
        "verifier answers, up to this many tokens; 0 = pre-drafts have length k (block and rd always "
        "do: docs/algorithms.md §8). Default: the orchestrator's.", show_default=False)] = None,
    bonus_guesses: Annotated[int | None, typer.Option(
        "--bonus-guesses", help="With --pipeline: pre-draft the next block after this many guesses of the "
        "token the verifier adds after a fully accepted block (the drafter's likeliest). Default: the "
        "orchestrator's.", show_default=False)] = None,
    rejection_guesses: Annotated[int | None, typer.Option(
        "--rejection-guesses", help="With --pipeline (token, block, ersd): also pre-draft after this many "
        "guesses of the token that replaces a rejected last draft. Default: the orchestrator's.",
        show_default=False)] = None,
    temperature: Annotated[float, typer.Option(
        "--temperature", "-t", help="Sampling temperature; 0 = greedy.")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens; 0 = off.")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1]; 1 = off.")] = 1.0,
    seed: Annotated[int | None, typer.Option(
        "--seed", help="Seed; sample i uses seed + i, so runs are reproducible. Default: random (reported).",
        show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", help="New tokens to generate at most.")] = 64,
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", help="Stop when this text appears (repeatable); the output ends before it.",
        show_default=False)] = None,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos", help="Do not stop at the target's end-of-sequence tokens.")] = False,
    num_samples: Annotated[int, typer.Option("--num-samples", help="Independent samples of the prompt.")] = 1,
    as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON object per sample and line: token_ids (new tokens only), text, "
        "finish_reason, seed, method, stats. With --stream, chunk objects (type chunk) come first.")] = False,
    stream: Annotated[bool, typer.Option("--stream", help="Print the text as it is generated.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds one request may take (server mode).")] =
        600.0,
    trace_file: TraceFileOpt = None,
    otlp_endpoint: OtlpEndpointOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_client_cert: TlsClientCertOpt = None,
    tls_client_key: TlsClientKeyOpt = None,
    tls_server_name: TlsServerNameOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Generate a continuation of a prompt, from a running orchestrator or in-process.

    Without --draft/--target it talks to the orchestrator at --address (by default the one
    `specdec up` starts). With --draft and --target it loads both models in this process and
    runs the same orchestrator code without any server. Text goes to stdout, statistics to stderr.
    """
    prompt, ids = parse_prompt(prompt_text, prompt, prompt_ids)
    if chat and ids is not None:
        raise typer.BadParameter("a chat is text: give the prompt as text, not --prompt-ids",
                                 param_hint="--chat")
    if system is not None and not chat:
        raise typer.BadParameter("--system needs --chat", param_hint="--system")
    if (draft is None) != (target is None):
        raise typer.BadParameter("in-process mode needs both --draft and --target", param_hint="--draft")
    if num_samples < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--num-samples")
    security = None
    if draft is None:  # server mode: TLS / token checked now (one line and exit 1 or 2 when bad)
        security = client_security(tls_ca=tls_ca, tls_client_cert=tls_client_cert,
                                   tls_client_key=tls_client_key, tls_server_name=tls_server_name,
                                   token_file=token_file, token_env=TOKEN_ENV)
        if not security.uses_tls and security.token is None:
            security = None  # plaintext without a token: what None means
    run = GenerateRun(address=address, draft=draft, target=target, device=device, dtype=dtype,
                      threads=threads, timeout=timeout, num_samples=num_samples, as_json=as_json,
                      stream=stream, observability=ObservabilityOptions(trace_file, otlp_endpoint),
                      security=security)
    try:
        request = build_request(
            prompt=prompt, prompt_ids=ids, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, stop=stop, ignore_eos=ignore_eos, seed=seed, method=method, k=k,
            tree_budget=tree_budget, a=a, pipeline=pipeline, pipeline_max_k=pipeline_max_k,
            bonus_guesses=bonus_guesses, rejection_guesses=rejection_guesses, chat=chat, system=system,
            draft_source=draft_source, cache_salt=cache_salt)
    except ValueError as exc:  # SamplingParamsError: the line the orchestrator would answer with
        err.print(f"[bold red]error:[/] {escape(describe_error(exc))}")
        code = 1
    else:
        try:
            code = asyncio.run(run_samples(request, run))
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
    exit_now(code)
    raise typer.Exit(code)


async def run_samples(request: GenerationRequest, run: GenerateRun) -> int:
    """Run the samples of `request`; returns the exit code (errors are printed here as one line)."""
    client = obs = None
    try:
        try:
            obs = run.observability.setup("generate")
            if run.in_process:
                client = await _inprocess_orchestrator(run, obs.loop_observer)
            else:
                from specdec.client import AsyncClient  # the light client: no torch in server mode

                client = AsyncClient(run.address, timeout_s=run.timeout, interceptors=obs.client_interceptors,
                                     security=run.security)
            for sample in range(run.num_samples):
                if run.num_samples > 1 and not run.as_json:
                    err.print(f"[bold]── sample {sample + 1}/{run.num_samples}[/]")
                one = sample_request(request, sample)
                result = await (_stream_one(client, one, sample, run.as_json) if run.stream
                                else client.generate(one))
                if run.as_json:
                    print(json.dumps(result_json(result, sample)), flush=True)
                else:
                    if not run.stream:
                        print(result.text, flush=True)
                    err.print(f"[dim]{escape(_stats_line(result))}[/]")
        finally:
            if client is not None:
                await client.close()
            if obs is not None:
                obs.shutdown()  # flush spans
    except CliError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}")
        return 1
    except Exception as exc:  # noqa: BLE001 - engine / gRPC / parameter errors: one line, no traceback
        message = describe_error(exc)
        if not run.in_process and message.startswith("UNAVAILABLE") and not await _serving(run):
            tls_hint = "" if run.security is not None and run.security.uses_tls else (
                " (if it serves TLS, pass --tls-ca)")
            message = (f"UNAVAILABLE: no orchestrator answers at {run.address}{tls_hint}; start one with "
                       "`specdec up` (or pass --address), or run in-process with --draft and --target")
        elif not run.in_process and message.startswith("UNAUTHENTICATED"):
            message += f" (pass the orchestrator's token with --token-file or ${TOKEN_ENV})"
        err.print(f"[bold red]error:[/] {escape(message)}")
        return 1
    return 0


async def _inprocess_orchestrator(run: GenerateRun, observer: Any = None):
    """Both engines in this process behind the in-process transport (the same code path, no network)."""
    from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
    from orchestrator.speculation import Orchestrator
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine
    from specdec.runtime.compute_thread import ComputeThread
    from specdec.runtime.loading import load_model

    draft_path = resolve_model(run.draft, "draft")
    target_path = resolve_model(run.target, "target")
    quiet_transformers()

    async def load(role: str, path: Path):
        # Loaded on the thread that runs the model's passes: one OpenMP team a model
        # (specdec.runtime.compute_thread).
        compute = ComputeThread(run.threads, name=f"{role}-compute")
        try:
            loaded = await asyncio.to_thread(compute.call, load_model, path, run.device, run.dtype,
                                             run.threads)
        except (OSError, ValueError, RuntimeError, AssertionError) as exc:  # bad folder, dtype, device
            compute.shutdown()
            raise CliError(f"{role} model {path}: {exc}") from None
        loaded.compute = compute
        return loaded

    with err.status("loading the models …"):
        draft_model = await load("draft", draft_path)
        target_model = await load("target", target_path)
    orchestrator = Orchestrator(InProcessDrafterClient(DrafterEngine(draft_model)),
                                InProcessVerifierClient(VerifierEngine(target_model)), orchestrator_config(),
                                observer=observer)
    try:
        await orchestrator.start()
    except BaseException:
        await orchestrator.close()
        raise
    return orchestrator


def result_json(result, sample: int) -> dict[str, Any]:
    """The --json line of one sample (token_ids are the new tokens only)."""
    stats = asdict(result.stats)
    stats["tokens_per_second"] = result.stats.tokens_per_second
    stats["acceptance_rate"] = result.stats.acceptance_rate
    for name, source in result.stats.sources.items():  # by draft source: the rate and tokens per draft
        stats["sources"][name].update(acceptance_rate=source.acceptance_rate,
                                      mean_accepted=source.mean_accepted)
    return {"type": "result", "sample": sample, "request_id": result.request_id,
            "token_ids": list(result.token_ids), "text": result.text, "finish_reason": result.finish_reason,
            "seed": result.seed, "method": result.method, "stats": stats}


def _stats_line(result) -> str:
    s = result.stats
    line = (f"{s.new_tokens} tokens in {s.seconds:.2f}s ({s.tokens_per_second:.1f} tok/s) · "
            f"{result.method} · {s.iterations} iterations")
    if s.drafted_tokens:
        line += f" · accepted {s.accepted_tokens}/{s.drafted_tokens} ({100 * s.acceptance_rate:.0f}%)"
    line += _sources_part(s.sources)
    looked_ahead = s.pre_drafts_used + s.pre_drafts_dropped
    if looked_ahead:
        line += f" · pre-drafts used {s.pre_drafts_used}/{looked_ahead}"
    if s.fallback_iterations:
        line += f" · {s.fallback_iterations} target-only (drafter down)"
    return line + f" · finish {result.finish_reason} · seed {result.seed}"


def _sources_part(sources) -> str:
    """Acceptance by draft source, most drafted tokens first: accepted / drafted tokens, the rate and the
    mean accepted length (tokens per draft), e.g. " · lookup 40/44 (91%, 5.0/draft) · model 10/20 (50%,
    2.5/draft)". "" when no source drafted (a target-only run, an orchestrator without sources)."""
    drafted = sorted(((name, src) for name, src in sources.items() if src.drafts),
                     key=lambda item: (-item[1].drafted_tokens, item[0]))
    return "".join(f" · {name} {src.accepted_tokens}/{src.drafted_tokens} ({100 * src.acceptance_rate:.0f}%, "
                   f"{src.mean_accepted:.1f}/draft)" for name, src in drafted)


async def _stream_one(client, request, sample: int, as_json: bool):
    result = None
    async for chunk in client.generate_stream(request):
        if as_json and chunk.token_ids:
            print(json.dumps({"type": "chunk", "sample": sample, "token_ids": list(chunk.token_ids),
                              "text": chunk.text}), flush=True)
        elif not as_json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        if chunk.result is not None:
            result = chunk.result
    if not as_json:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if result is None:
        raise CliError("the stream ended without a result")
    return result


async def _serving(run: GenerateRun) -> bool:
    """Whether the orchestrator itself answers (tells 'not running' from 'its peer is down')."""
    from specdec.client import AsyncClient

    try:
        async with AsyncClient(run.address, security=run.security) as probe:
            return await probe.is_serving(2.0)
    except Exception:  # noqa: BLE001 - a bad address: not serving either
        return False
