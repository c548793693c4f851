"""Serving benchmark: closed-loop clients against `specdec up` (batching on and off) and
`transformers serve --continuous-batching`, side by side in one run.

    python -m bench.bench_serving --levels 1,2,4,8,16,32 --seconds 60 \\
        --configs specdec,specdec-nobatch,hf-serve --dtype int8 --out bench/results/serving-DATE/

Configurations (run one after another, each its own server on free ports, started once, warmed up
with one request that is not counted, then every level; the server is stopped before the next):

    specdec          `specdec up --dtype D` (engines batch concurrent calls by default), plus
                     --extra-up-args
    specdec-nobatch  the same with `--no-batching` (engine calls one at a time)
    hf-serve         `transformers serve TARGET_DIR --continuous-batching --dtype F --device cpu`
                     (F = --hf-dtype, float32 by default: transformers serve has no CPU int8, so
                     compare it with `--dtype float32` specdec legs for the same precision), the
                     converted target folder as its forced model (loaded before it listens,
                     though its RSS only grows by the weights' size on the first request),
                     paged KV cache sized for the run (--cb-num-blocks, --cb-max-batch-tokens; left
                     alone it takes 90 % of the machine's RAM), plus --hf-serve-args

Load: our own asyncio load generator, not locust (locust's users are gevent greenlets and speak
HTTP; a gRPC server-streaming client and SSE time-to-first-token would both need custom glue, and
its rate/user model adds nothing to a closed loop). Each level runs N clients for --seconds: a
client sends a request, waits for the whole streamed answer, records it and sends the next; no new
request starts once the time is up, and the ones in flight are awaited for at most
--drain-timeout seconds (those still running are cancelled and count as errors, "timeout").
Every client has its own connection (a gRPC channel; an HTTP connection). specdec is driven over
GenerateStream (grpc.aio), transformers serve over its OpenAI-compatible legacy completions
endpoint `POST /v1/completions` with `"stream": true` (SSE, parsed with httpx).

What both systems see: the same prompt tokens. transformers serve's /v1/completions takes raw text
and tokenizes it with the target's tokenizer as `tokenizer(prompt)` (no chat template; its
/v1/chat/completions would apply one); the harness tokenizes each prompt text the same way and
sends specdec those ids (`prompt_ids`), and checks the prompt_tokens that transformers serve
reports against them (a mismatch is counted in `prompt_mismatches`). Chat prompts (--prompts
mtbench) get the target's chat template applied by the harness, as text, for both. Prompts are
taken in order from one shared cycle per configuration (each new request takes the next prompt),
so every configuration sees the same sequence; prompts longer than --max-prompt-tokens are left out
(text must be sent whole, so none is truncated).

Every request makes exactly --max-new-tokens tokens: specdec gets `stop_token_ids=[]`; transformers
serve gets an explicit `generation_config` without `eos_token_id` (its continuous batching then
disables EOS) with `do_sample` true, `temperature` T, `top_k` 0 and `top_p` 1 (T = 0: greedy).
specdec requests carry no seed by default (the server's defaults as a user gets them: a random seed
and the online draft length; a seed would fix k), `--seed S` gives request n the seed S + n.
transformers serve gets no seed (a per-request seed there reseeds torch's global generator, which
means nothing under continuous batching); its sampling parameters are shared by every request and
fixed by the first (the warm-up), which carries the same generation_config.

Per level and configuration:
    aggregate tok/s   new tokens of all completed requests / wall seconds from the level's start
                      until its last request finished (the drain included)
    request tok/s     per request: new tokens / latency (time to first token included); median
    TTFT              send → the first streamed chunk with output (specdec: the first
                      GenerateStream chunk with token ids; transformers serve: the first SSE
                      chunk with text); median and p99
    latency           send → the stream's end; p50 and p99
    ITL               inter-token latency: the gaps between a request's consecutive streamed chunks
                      with output (a speculative iteration's chunk carries several tokens; the gap
                      is what a reader of the stream waits); p50 and p99 over every gap of the level
    done, errors      requests completed; failed ones (gRPC/HTTP errors, error events, timeouts)
    RSS               resident memory of the serving processes (specdec: `up` and its three
                      services; transformers serve: its process), summed, before and after the level,
                      and its peak over samples every --rss-every seconds while the level ran
Percentiles interpolate linearly between order statistics (numpy's default).

Writes results.json (settings, machine, every request), table.md and throughput.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench.bench_iteration import start_up, stop_up
from bench.machine import cpu_model
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("specdec", "specdec-nobatch", "hf-serve")
DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32)
HF_PAGE_SIZE = 256  # transformers' ContinuousBatchingConfig.page_size default (tokens per cache block)

Say = Callable[[str], None]


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# prompts
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One prompt as both systems get it: `text` for transformers serve, `ids` (the target's
    tokenizer on that text) for specdec."""

    id: str
    text: str
    ids: tuple[int, ...]


def load_cases(prompt_set: str, count: int, tokenizer: Any, max_prompt_tokens: int) -> list[Case]:
    """The first `count` prompts of a set that fit in `max_prompt_tokens` (chat prompts templated)."""
    from specdec.prompts import load_prompts

    cases: list[Case] = []
    for prompt in load_prompts(prompt_set):
        text = prompt.text
        if prompt.chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        ids = tuple(tokenizer(text)["input_ids"])  # as transformers serve's /v1/completions does
        if 0 < len(ids) <= max_prompt_tokens:
            cases.append(Case(prompt.id, text, ids))
        if len(cases) == count:
            break
    if not cases:
        raise SystemExit(f"no prompt of {prompt_set!r} tokenizes to 1..{max_prompt_tokens} tokens")
    return cases


# ----------------------------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """One request as the load generator saw it (times in seconds; `start` from the level's start)."""

    client: int
    prompt: str
    start: float
    latency: float | None = None
    ttft: float | None = None
    tokens: int = 0
    prompt_tokens: int | None = None  # as the server reported it (transformers serve only)
    error: str | None = None
    gaps: list[float] = field(default_factory=list)  # between consecutive chunks with output


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between order statistics; None if empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must lie in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(
    records: Sequence[RequestRecord], elapsed: float, expected_prompt_tokens: dict[str, int]
) -> dict[str, Any]:
    """One level's figures from its request records and wall time (see the module docstring)."""
    ok = [r for r in records if r.error is None and r.latency is not None]
    tokens = sum(r.tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    latencies = [r.latency for r in ok if r.latency is not None]
    gaps = [gap for r in ok for gap in r.gaps]
    rates = [r.tokens / r.latency for r in ok if r.latency]
    mismatches = sum(
        1
        for r in ok
        if r.prompt_tokens is not None
        and r.prompt_tokens != expected_prompt_tokens.get(r.prompt, r.prompt_tokens)
    )
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            kind = r.error.split(":", 1)[0]
            errors[kind] = errors.get(kind, 0) + 1
    return {
        "requests": len(ok),
        "errors": len(records) - len(ok),
        "error_kinds": errors,
        "tokens": tokens,
        "mean_tokens": tokens / len(ok) if ok else None,
        "elapsed_s": elapsed,
        "aggregate_tok_s": tokens / elapsed if elapsed > 0 else 0.0,
        "request_tok_s_p50": statistics.median(rates) if rates else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "prompt_mismatches": mismatches,
    }


# ----------------------------------------------------------------------------------------------
# clients
# ----------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    tokens: int
    first_output_at: float | None  # time.perf_counter() of the first chunk with output
    prompt_tokens: int | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive chunks with output


def _gaps(arrivals: Sequence[float]) -> list[float]:
    """Seconds between consecutive arrivals."""
    return [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]


class Connection(Protocol):
    async def send(self, case: Case, n: int) -> Outcome: ...

    async def close(self) -> None: ...


class Backend(Protocol):
    def connect(self) -> Connection: ...


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float
    seed: int | None  # specdec only: request n gets seed + n
    method: str | None = None  # specdec only: the request's method (None: the server's default)
    salt_per_request: bool = False  # specdec only: request n gets cache_salt "<tag>-<n>" (no shared caches)


class SpecdecConnection:
    """One gRPC channel to the orchestrator; GenerateStream, no EOS stop, server defaults otherwise."""

    def __init__(self, address: str, sampling: Sampling, timeout_s: float, tag: str) -> None:
        from specdec.client import AsyncClient

        self.client = AsyncClient(address, timeout_s=timeout_s)
        self.sampling = sampling
        self.tag = tag

    async def send(self, case: Case, n: int) -> Outcome:
        from specdec.generation import GenerationRequest
        from specdec.sampling import SamplingParams

        s = self.sampling
        request = GenerationRequest(
            prompt_ids=list(case.ids),
            max_new_tokens=s.max_new_tokens,
            sampling=SamplingParams(temperature=s.temperature),
            stop_token_ids=[],
            method=s.method,
            seed=None if s.seed is None else s.seed + n,
            request_id=f"{self.tag}-{n}",
            cache_salt=f"{self.tag}-{n}" if s.salt_per_request else None,
        )
        arrivals: list[float] = []
        tokens = 0
        async for chunk in self.client.generate_stream(request):
            if chunk.token_ids:
                arrivals.append(time.perf_counter())
            tokens += len(chunk.token_ids)
            if chunk.result is not None:
                tokens = len(chunk.result.token_ids)
        return Outcome(tokens=tokens, first_output_at=arrivals[0] if arrivals else None,
                       gaps=_gaps(arrivals))

    async def close(self) -> None:
        await self.client.close()


@dataclass
class SpecdecBackend:
    address: str
    sampling: Sampling
    timeout_s: float
    tag: str

    def connect(self) -> SpecdecConnection:
        return SpecdecConnection(self.address, self.sampling, self.timeout_s, self.tag)


def hf_generation_config(sampling: Sampling) -> dict[str, Any]:
    """transformers serve's generation_config: no eos_token_id (continuous batching then disables
    EOS, like specdec's stop_token_ids=[]), pure sampling at T (greedy at T = 0)."""
    if sampling.temperature == 0:
        return {"do_sample": False, "max_new_tokens": sampling.max_new_tokens}
    return {
        "do_sample": True,
        "temperature": sampling.temperature,
        "top_k": 0,
        "top_p": 1.0,
        "max_new_tokens": sampling.max_new_tokens,
    }


async def sse_lines(response: Any) -> AsyncIterator[str]:
    """The lines of a server-sent event stream, split where SSE splits them (LF, CRLF) only.

    httpx's `aiter_lines` splits like str.splitlines, also at U+0085, U+2028 and U+2029, which a JSON
    encoder may leave raw inside a string: a model's text holding one (random bytes from a tiny
    model, say) broke its event in two and the harness counted a JSONDecodeError."""
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode("utf-8", errors="replace")
    if buffer:
        yield buffer.removesuffix(b"\r").decode("utf-8", errors="replace")


class HfServeConnection:
    """One HTTP connection to transformers serve; POST /v1/completions with SSE streaming."""

    def __init__(self, base_url: str, sampling: Sampling, timeout_s: float) -> None:
        import httpx

        self.client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=1),
        )
        self.body = {
            "max_tokens": sampling.max_new_tokens,
            "stream": True,
            # OpenAI's way to ask for the usage chunk; transformers 5.25 sends it only when asked.
            "stream_options": {"include_usage": True},
            "generation_config": json.dumps(hf_generation_config(sampling)),
        }

    async def send(self, case: Case, n: int) -> Outcome:
        arrivals: list[float] = []
        usage: dict[str, Any] | None = None
        body = {**self.body, "prompt": case.text}
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {r.status_code}: {detail}")
            async for line in sse_lines(r):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    message = json.loads(data)
                except json.JSONDecodeError:
                    raise RuntimeError(f"not a JSON event: {data[:200]!r}") from None
                if "error" in message:
                    raise RuntimeError(f"server error event: {message['error']}")
                choices = message.get("choices") or [{}]
                if choices[0].get("text"):
                    arrivals.append(time.perf_counter())
                if message.get("usage"):
                    usage = message["usage"]
        if usage is None:
            raise RuntimeError("stream ended without a usage chunk")
        return Outcome(
            tokens=int(usage["completion_tokens"]),
            first_output_at=arrivals[0] if arrivals else None,
            prompt_tokens=int(usage["prompt_tokens"]),
            gaps=_gaps(arrivals),
        )

    async def close(self) -> None:
        await self.client.aclose()


@dataclass
class HfServeBackend:
    base_url: str
    sampling: Sampling
    timeout_s: float

    def connect(self) -> HfServeConnection:
        return HfServeConnection(self.base_url, self.sampling, self.timeout_s)


# ----------------------------------------------------------------------------------------------
# the load generator
# ----------------------------------------------------------------------------------------------
@dataclass
class LevelRun:
    clients: int
    seconds: float
    elapsed: float
    records: list[RequestRecord] = field(default_factory=list)


async def measure(
    connection: Connection, case: Case, n: int, client: int, t0: float, hard_stop: float
) -> RequestRecord:
    """Send one request and time it; a failure or a request still running at `hard_stop` is an error."""
    began = time.perf_counter()
    record = RequestRecord(client=client, prompt=case.id, start=began - t0)
    try:
        outcome = await asyncio.wait_for(connection.send(case, n), timeout=max(hard_stop - began, 1e-3))
    except TimeoutError:
        record.error = "timeout: still running at the end of the drain"
    except Exception as exc:  # noqa: BLE001 (any failure of a request is an error)
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    else:
        record.latency = time.perf_counter() - began
        record.tokens = outcome.tokens
        record.prompt_tokens = outcome.prompt_tokens
        record.gaps = outcome.gaps
        if outcome.first_output_at is not None:
            record.ttft = outcome.first_output_at - began
    return record


async def run_level(
    backend: Backend,
    next_case: Callable[[], tuple[int, Case]],
    clients: int,
    seconds: float,
    drain_timeout: float,
    progress: Say | None = None,
) -> LevelRun:
    """`clients` closed-loop clients for `seconds`, then the drain (bounded by `drain_timeout`)."""
    t0 = time.perf_counter()
    stop_at = t0 + seconds
    hard_stop = stop_at + drain_timeout
    records: list[RequestRecord] = []

    async def client(index: int) -> None:
        connection = backend.connect()
        try:
            while time.perf_counter() < stop_at:
                n, case = next_case()
                records.append(await measure(connection, case, n, index, t0, hard_stop))
        finally:
            await connection.close()

    async def ticker() -> None:
        while True:
            await asyncio.sleep(10.0)
            done = sum(r.error is None for r in records)
            if progress is not None:
                progress(
                    f"    {time.perf_counter() - t0:5.0f} s: {done} done, {len(records) - done} errors"
                )

    tick = asyncio.create_task(ticker()) if progress is not None and seconds >= 20 else None
    try:
        await asyncio.gather(*(client(i) for i in range(clients)))
    finally:
        if tick is not None:
            tick.cancel()
    return LevelRun(clients=clients, seconds=seconds, elapsed=time.perf_counter() - t0, records=records)


async def warm_up(backend: Backend, case: Case, timeout_s: float) -> RequestRecord:
    """One request before the first level (not counted): loads what loads lazily, and fixes
    transformers serve's shared sampling parameters."""
    connection = backend.connect()
    try:
        now = time.perf_counter()
        return await measure(connection, case, -1, 0, now, now + timeout_s)
    finally:
        await connection.close()


def prompt_cycle(cases: Sequence[Case]) -> Callable[[], tuple[int, Case]]:
    """Request number and prompt of the next request: one shared cycle over the prompts."""
    counter: Iterator[int] = itertools.count()

    def next_case() -> tuple[int, Case]:
        n = next(counter)
        return n, cases[n % len(cases)]

    return next_case


# ----------------------------------------------------------------------------------------------
# servers
# ----------------------------------------------------------------------------------------------
def rss(root_pid: int, names: dict[int, str] | None = None) -> dict[str, Any]:
    """Resident memory (bytes) of a process and its descendants: the sum and each process."""
    import psutil

    names = names or {}
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"total_bytes": 0, "processes": {}}
    out: dict[str, int] = {}
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            out[f"{names.get(p.pid) or p.name()}[{p.pid}]"] = p.memory_info().rss
    return {"total_bytes": sum(out.values()), "processes": out}


class PeakRss:
    """Samples a server's summed RSS every `every` seconds on a thread while a level runs: its peak
    (memory that grows and falls back within a level shows only here) and the samples."""

    def __init__(self, server: Server, every: float) -> None:
        self.server, self.every = server, every
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._began = time.perf_counter()

    def _run(self) -> None:
        while True:
            self.samples.append((time.perf_counter() - self._began, self.server.rss()["total_bytes"]))
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_bytes(self) -> int:
        return max((b for _, b in self.samples), default=0)


class Server(Protocol):
    name: str
    command: list[str]

    def start(self) -> None: ...

    def backend(self, sampling: Sampling, timeout_s: float) -> Backend: ...

    def rss(self) -> dict[str, Any]: ...

    def stop(self) -> None: ...


class SpecdecServer:
    """`specdec up` on free ports (bench_iteration.start_up), with or without batching."""

    def __init__(self, name: str, up_args: list[str], out: Path) -> None:
        self.name = name
        self.up_args = up_args
        self.out = out
        self.command = ["specdec", "up", *up_args]
        self.process: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}

    def start(self) -> None:
        ready = self.out / f"{self.name}.ready.json"
        ready.unlink(missing_ok=True)
        self.process = start_up(None, ready, self.out / f"{self.name}.log", self.up_args)
        self.info = json.loads(ready.read_text())

    def backend(self, sampling: Sampling, timeout_s: float) -> SpecdecBackend:
        return SpecdecBackend(self.info["orchestrator"], sampling, timeout_s, self.name)

    def rss(self) -> dict[str, Any]:
        assert self.process is not None
        names = {int(pid): name for name, pid in self.info.get("pids", {}).items()}
        names[self.process.pid] = "up"
        return rss(self.process.pid, names)

    def stop(self) -> None:
        if self.process is not None:
            stop_up(self.process)
            self.process = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HfServeServer:
    """`transformers serve TARGET --continuous-batching` (same interpreter), the target forced, so
    it is loaded before the server listens: ready when GET /health answers 200 (its /v1/models
    answers 500 offline)."""

    def __init__(self, target_dir: Path, dtype: str, cb_args: list[str], extra: list[str], out: Path,
                 startup_timeout: float) -> None:
        self.name = "hf-serve"
        self.port = free_port()
        self.out = out
        self.startup_timeout = startup_timeout
        self.args = [
            str(target_dir), "--continuous-batching", "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--device", "cpu", *cb_args, *extra,
        ]
        self.command = ["transformers", "serve", *self.args]
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import httpx

        argv = [sys.executable, "-m", "transformers.cli.transformers", "serve", *self.args]
        log = self.out / f"{self.name}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        with log.open("w") as sink:
            self.process = subprocess.Popen(
                argv, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"`transformers serve` did not start:\n{log.read_text()[-5000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)

    def backend(self, sampling: Sampling, timeout_s: float) -> HfServeBackend:
        return HfServeBackend(self.base_url, sampling, timeout_s)

    def rss(self) -> dict[str, Any]:
        assert self.process is not None
        return rss(self.process.pid, {self.process.pid: "transformers-serve"})

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        # SIGTERM: after SIGINT uvicorn shuts down but the process waits on its batching thread.
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def hf_cb_args(extra: list[str], clients: int, max_prompt_tokens: int, max_new_tokens: int) -> list[str]:
    """Paged-cache flags for transformers serve unless --hf-serve-args sets them: enough blocks for
    `clients` requests of the longest prompt plus the new tokens, and specdec's default batch
    token budget (its default sizes the cache from free memory: 90 % of the machine's RAM on a CPU)."""
    from specdec.runtime.batch_config import DEFAULT_MAX_BATCH_TOKENS

    args: list[str] = []
    if "--cb-num-blocks" not in extra:
        per_request = math.ceil((max_prompt_tokens + max_new_tokens) / HF_PAGE_SIZE)
        args += ["--cb-num-blocks", str(clients * per_request + 4)]
    if "--cb-max-batch-tokens" not in extra:
        args += ["--cb-max-batch-tokens", str(DEFAULT_MAX_BATCH_TOKENS)]
    return args


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    import psutil
    import torch
    import transformers

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_model(),
        "cores": cores,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": torch.cuda.is_available(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"levels must be positive integers, got {text!r}")
    return levels


def parse_configs(text: str) -> list[str]:
    configs = [x.strip() for x in text.split(",") if x.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or not configs:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    return configs


def resolve_dir(name_or_path: str) -> Path:
    """A registry name or path → the HF folder specdec loads (a GGUF is converted once)."""
    from specdec.models import resolve_model
    from specdec.runtime.loading import resolve_model_dir

    return resolve_model_dir(resolve_model(name_or_path))


def levels_of(config: str, args: argparse.Namespace) -> list[int]:
    """The client levels a configuration runs: --levels, capped for hf-serve by --hf-max-clients (its
    float32 requests take ~30 s each at one client here, so 32 clients would take many minutes a round)."""
    if config == "hf-serve" and args.hf_max_clients is not None:
        return [n for n in args.levels if n <= args.hf_max_clients] or args.levels[:1]
    return list(args.levels)


def build_server(config: str, args: argparse.Namespace, target_dir: Path) -> Server:
    extra_up = shlex.split(args.extra_up_args)
    up = ["--draft", args.draft, "--target", args.target, "--dtype", args.dtype, *extra_up]
    if config == "specdec":
        return SpecdecServer(config, up, args.out)
    if config == "specdec-nobatch":
        return SpecdecServer(config, [*up, "--no-batching"], args.out)
    extra = shlex.split(args.hf_serve_args)
    cb = hf_cb_args(extra, max(levels_of("hf-serve", args)), args.max_prompt_tokens, args.max_new_tokens)
    return HfServeServer(target_dir, args.hf_dtype, cb, extra, args.out, args.startup_timeout)


def run_config(
    server: Server, cases: list[Case], args: argparse.Namespace, progress: Say
) -> dict[str, Any]:
    """Start the server, warm it up, run every level, stop it; the configuration's results."""
    sampling = Sampling(args.max_new_tokens, args.temperature, args.seed)
    timeout_s = args.seconds + args.drain_timeout + 60
    expected = {c.id: len(c.ids) for c in cases}
    progress(f"[{server.name}] starting: {shlex.join(server.command)}")
    began = time.perf_counter()
    server.start()
    startup = time.perf_counter() - began
    progress(f"[{server.name}] ready in {startup:.1f} s; RSS {server.rss()['total_bytes'] / 2**20:.0f} MB")
    levels: list[dict[str, Any]] = []
    try:
        backend = server.backend(sampling, timeout_s)
        warm = asyncio.run(warm_up(backend, cases[0], timeout_s))
        if warm.error is not None:
            raise SystemExit(f"[{server.name}] warm-up request failed: {warm.error}")
        progress(f"[{server.name}] warm-up request: {warm.tokens} tokens in {warm.latency:.1f} s")
        next_case = prompt_cycle(cases)
        for clients in levels_of(server.name, args):
            before = server.rss()
            progress(f"[{server.name}] {clients} client(s) for {args.seconds:g} s …")
            with PeakRss(server, args.rss_every) as sampler:
                run = asyncio.run(
                    run_level(backend, next_case, clients, args.seconds, args.drain_timeout, progress)
                )
            after = server.rss()
            summary = summarize(run.records, run.elapsed, expected)
            levels.append(
                {
                    "clients": clients,
                    "seconds": args.seconds,
                    **summary,
                    "rss_before": before,
                    "rss_after": after,
                    "rss_peak_bytes": sampler.peak_bytes,
                    "rss_samples": sampler.samples,
                    "records": [asdict(r) for r in run.records],
                }
            )
            progress(f"[{server.name}] {clients} client(s): {brief(summary, before, after)}, "
                     f"peak {sampler.peak_bytes / 2**20:.0f} MB")
            if summary["prompt_mismatches"]:
                progress(f"[{server.name}] WARNING: {summary['prompt_mismatches']} prompt token mismatches")
    finally:
        progress(f"[{server.name}] stopping")
        server.stop()
    return {
        "command": shlex.join(server.command),
        "precision": args.hf_dtype if server.name == "hf-serve" else args.dtype,
        "startup_s": startup,
        "warmup": asdict(warm),
        "levels": levels,
    }


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def mb(snapshot: dict[str, Any]) -> str:
    return f"{snapshot['total_bytes'] / 2**20:.0f}"


def brief(summary: dict[str, Any], before: dict[str, Any], after: dict[str, Any]) -> str:
    return (
        f"{summary['aggregate_tok_s']:.2f} tok/s, {summary['requests']} done, {summary['errors']} errors, "
        f"TTFT p50 {fmt(summary['ttft_p50_s'])} s, latency p50 {fmt(summary['latency_p50_s'])} s, "
        f"RSS {mb(before)} → {mb(after)} MB"
    )


def render(results: dict[str, Any]) -> str:
    """table.md: the command, the machine, the settings, one row per configuration and level."""
    meta, m = results["meta"], results["machine"]
    lines = [
        f"# Serving benchmark ({meta['date']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, GPU {'yes' if m['gpu'] else 'no'}; "
        f"torch {m['torch']}, transformers {m['transformers']}.",
        "",
        f"Models: {meta['draft']} → {meta['target']}. {meta['max_new_tokens']} new tokens per request "
        f"(no EOS stop), T = {meta['temperature']:g}, {meta['prompts']} prompts ({meta['num_prompts']}, "
        f"≤ {meta['max_prompt_tokens']} tokens, one shared cycle), {meta['seconds']:g} s per level, "
        f"closed-loop clients, drain ≤ {meta['drain_timeout']:g} s.",
        "",
    ]
    for name, config in results["configs"].items():
        lines.append(f"- {name} ({config['precision']}): `{config['command']}`")
    lines += [
        "",
        "| config | clients | agg tok/s | req tok/s p50 | TTFT p50 s | TTFT p99 s | latency p50 s | "
        "latency p99 s | done | errors | RSS before → after MB | RSS peak MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, config in results["configs"].items():
        for level in config["levels"]:
            lines.append(
                f"| {name} | {level['clients']} | {level['aggregate_tok_s']:.2f} | "
                f"{fmt(level['request_tok_s_p50'])} | {fmt(level['ttft_p50_s'], '.3f')} | "
                f"{fmt(level['ttft_p99_s'], '.3f')} | "
                f"{fmt(level['latency_p50_s'])} | {fmt(level['latency_p99_s'])} | {level['requests']} | "
                f"{level['errors']} | {mb(level['rss_before'])} → {mb(level['rss_after'])} | "
                f"{level['rss_peak_bytes'] / 2**20:.0f} |"
            )
    names = list(results["configs"])
    clients = sorted({lv["clients"] for c in results["configs"].values() for lv in c["levels"]})
    lines += ["", "Aggregate tok/s by clients:", "", "| clients | " + " | ".join(names) + " |",
              "|---:|" + "---:|" * len(names)]
    for n in clients:
        cells = []
        for name in names:
            hit = [lv for lv in results["configs"][name]["levels"] if lv["clients"] == n]
            cells.append(f"{hit[0]['aggregate_tok_s']:.2f}" if hit else "–")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "agg tok/s: new tokens of completed requests / the level's wall time, drain included; req tok/s: "
        "one request's tokens / its latency; TTFT: to the first streamed chunk with output; RSS: the "
        "serving processes summed (peak: sampled every --rss-every s during the level).",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> Path:
    """Aggregate tok/s per configuration against clients (log2 axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    ticks: set[int] = set()
    for name, config in results["configs"].items():
        xs = [lv["clients"] for lv in config["levels"]]
        ys = [lv["aggregate_tok_s"] for lv in config["levels"]]
        ticks.update(xs)
        ax.plot(xs, ys, marker="o", label=f"{name} ({config['precision']})")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    if ticks:
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
    ax.set_xlabel("concurrent clients (closed loop)")
    ax.set_ylabel("aggregate new tokens/s")
    meta = results["meta"]
    ax.set_title(f"{meta['draft']} → {meta['target']}, {meta['max_new_tokens']} tokens", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_serving", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--levels", type=parse_levels, default=list(DEFAULT_LEVELS), help="clients per level")
    p.add_argument("--seconds", type=float, default=60.0, help="how long each level starts requests")
    p.add_argument("--hf-max-clients", type=int, default=None,
                   help="run hf-serve only at levels up to this many clients (default: every level)")
    p.add_argument("--configs", type=parse_configs, default=list(CONFIGS), help=", ".join(CONFIGS))
    p.add_argument("--draft", default=DEFAULT_DRAFT_MODEL)
    p.add_argument("--target", default=DEFAULT_TARGET_MODEL)
    p.add_argument("--dtype", default="int8", help="precision of the specdec legs (default int8)")
    p.add_argument("--hf-dtype", default="float32", help="precision of transformers serve (no CPU int8)")
    p.add_argument("--prompts", default="humaneval", help="prompt set: humaneval | mtbench | builtin")
    p.add_argument("--num-prompts", type=int, default=164)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="leave out longer prompts")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="specdec request n gets seed + n (fixes k)")
    p.add_argument("--drain-timeout", type=float, default=300.0,
                   help="seconds in-flight requests may take after a level's time is up")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--rss-every", type=float, default=5.0,
                   help="seconds between RSS samples during a level (the table's peak)")
    p.add_argument(
        "--extra-up-args", default="", help='extra `specdec up` flags, e.g. "--max-batch-tokens 256"'
    )
    p.add_argument(
        "--hf-serve-args", default="", help='extra `transformers serve` flags, e.g. "--cb-num-blocks 64"'
    )
    p.add_argument("--out", type=Path, default=None, help="folder for results.json, table.md, throughput.png")
    return p


def run(args: argparse.Namespace, argv: Sequence[str], progress: Say = say) -> dict[str, Any]:
    """The whole benchmark: every configuration at every level; writes the files to args.out."""
    from specdec.runtime.tokenizers import load_tokenizer

    args.out = args.out or Path(tempfile.mkdtemp(prefix="specdec-serving-"))
    args.out.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_dir(args.target)
    if args.draft:
        resolve_dir(args.draft)  # convert once here, not in `up`'s startup timeout
    cases = load_cases(args.prompts, args.num_prompts, load_tokenizer(target_dir), args.max_prompt_tokens)
    lengths = [len(c.ids) for c in cases]
    progress(
        f"{len(cases)} prompts ({args.prompts}), {min(lengths)}–{max(lengths)} tokens (median "
        f"{statistics.median(lengths):g}); levels {args.levels}, {args.seconds:g} s each; "
        f"configs {args.configs}"
    )
    results: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "command": "python -m bench.bench_serving " + shlex.join(list(argv)),
            "draft": args.draft,
            "target": args.target,
            "target_dir": str(target_dir),
            "dtype": args.dtype,
            "hf_dtype": args.hf_dtype,
            "prompts": args.prompts,
            "num_prompts": len(cases),
            "max_prompt_tokens": args.max_prompt_tokens,
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
            "levels": args.levels,
            "seconds": args.seconds,
            "drain_timeout": args.drain_timeout,
            "prompt_ids": {c.id: len(c.ids) for c in cases},
        },
        "machine": machine(),
        "configs": {},
    }
    for config in args.configs:
        server = build_server(config, args, target_dir)
        results["configs"][config] = run_config(server, cases, args, progress)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))  # partial results survive
    (args.out / "table.md").write_text(render(results))
    plot(results, args.out / "throughput.png")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    results = run(args, argv)
    print(render(results))
    say(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
