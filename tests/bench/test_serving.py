"""bench.bench_serving: its statistics and load generator on synthetic requests, and the harness end
to end on tiny random models (structure, not numbers): both specdec legs always, the transformers
serve leg where its packages (fastapi, uvicorn, openai, httpx) are installed."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.bench_serving import (  # noqa: E402
    Case,
    Outcome,
    RequestRecord,
    Sampling,
    hf_cb_args,
    hf_generation_config,
    main,
    parse_configs,
    parse_levels,
    percentile,
    prompt_cycle,
    render,
    run_level,
    sse_lines,
    summarize,
)

MAX_NEW_TOKENS = 12


# ----------------------------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------------------------
def test_percentile_interpolates_between_order_statistics() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    values = [4.0, 1.0, 3.0, 2.0]  # order does not matter
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)  # numpy's "linear"
    with pytest.raises(ValueError):
        percentile(values, 101)


def record(latency: float | None, tokens: int, ttft: float | None = 0.1, error: str | None = None,
           prompt: str = "p", prompt_tokens: int | None = None) -> RequestRecord:
    return RequestRecord(client=0, prompt=prompt, start=0.0, latency=latency, ttft=ttft, tokens=tokens,
                         prompt_tokens=prompt_tokens, error=error)


def test_summary_counts_completed_requests_only() -> None:
    records = [
        record(1.0, 10, ttft=0.1),
        record(2.0, 10, ttft=0.3),
        record(4.0, 20, ttft=0.2, prompt="q", prompt_tokens=7),
        record(None, 0, ttft=None, error="timeout: still running at the end of the drain"),
        record(None, 0, ttft=None, error="RuntimeError: HTTP 500"),
        record(3.0, 5, ttft=None, prompt="q", prompt_tokens=8),  # no output chunk, prompt mismatch
    ]
    s = summarize(records, elapsed=5.0, expected_prompt_tokens={"p": 3, "q": 7})
    assert s["requests"] == 4 and s["errors"] == 2
    assert s["error_kinds"] == {"timeout": 1, "RuntimeError": 1}
    assert s["tokens"] == 45 and s["mean_tokens"] == pytest.approx(45 / 4)
    assert s["aggregate_tok_s"] == pytest.approx(9.0)  # 45 tokens / 5 s
    assert s["request_tok_s_p50"] == pytest.approx((5.0 + 5.0) / 2)  # rates 10, 5, 5, 5/3
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["ttft_p99_s"] == pytest.approx(0.298)
    assert s["latency_p50_s"] == pytest.approx(2.5) and s["latency_p99_s"] == pytest.approx(3.97)
    assert s["prompt_mismatches"] == 1


def test_inter_token_latency_pools_the_gaps_of_completed_requests() -> None:
    from bench.bench_serving import _gaps

    assert _gaps([1.0, 1.5, 3.0]) == [0.5, 1.5] and _gaps([2.0]) == [] and _gaps([]) == []
    done = [record(2.0, 10, ttft=0.1), record(3.0, 10, ttft=0.2)]
    done[0].gaps, done[1].gaps = [0.1, 0.2, 0.3], [0.4, 1.0]
    failed = record(None, 0, error="timeout: x")
    failed.gaps = [50.0]  # a failed request's gaps are not counted
    s = summarize([*done, failed], elapsed=5.0, expected_prompt_tokens={})
    assert s["itl_p50_s"] == pytest.approx(0.3) and s["itl_p99_s"] == pytest.approx(0.976)
    assert summarize([failed], 1.0, {})["itl_p99_s"] is None


def test_a_specdec_stream_gives_its_gaps_and_a_salt_of_its_own_when_asked() -> None:
    """SpecdecConnection: gaps between chunks with tokens (empty chunks are not output), and with
    salt_per_request each request its own cache_salt (--serving-fresh)."""
    from types import SimpleNamespace

    from bench.bench_serving import Case, Sampling, SpecdecConnection

    sent = []

    class Client:
        async def generate_stream(self, request):
            sent.append(request)
            for ids in ([1, 2], [], [3], [4, 5]):
                await asyncio.sleep(0.01)
                yield SimpleNamespace(token_ids=ids, result=None)

        async def close(self) -> None:
            return None

    async def run(salted: bool):
        connection = SpecdecConnection.__new__(SpecdecConnection)
        connection.client, connection.tag = Client(), "lvl"
        connection.sampling = Sampling(5, 0.0, None, salt_per_request=salted)
        return await connection.send(Case("p", "t", (1, 2)), 7)

    outcome = asyncio.run(run(True))
    assert outcome.tokens == 5 and len(outcome.gaps) == 2
    assert outcome.gaps[0] >= 0.015 and outcome.gaps[1] >= 0.005  # the first spans the empty chunk
    asyncio.run(run(False))
    assert [request.cache_salt for request in sent] == ["lvl-7", None]


def test_summary_of_a_level_without_completions() -> None:
    s = summarize([record(None, 0, error="timeout: x")], elapsed=2.0, expected_prompt_tokens={})
    assert s["requests"] == 0 and s["errors"] == 1 and s["aggregate_tok_s"] == 0.0
    assert s["request_tok_s_p50"] is None and s["ttft_p50_s"] is None and s["latency_p99_s"] is None


def test_options_and_transformers_serve_settings() -> None:
    assert parse_levels("1,2, 4") == [1, 2, 4]
    assert parse_configs("specdec,hf-serve") == ["specdec", "hf-serve"]
    for bad in ("0,1", ""):
        with pytest.raises(Exception):  # noqa: B017 (argparse's type error)
            parse_levels(bad)
    with pytest.raises(Exception):  # noqa: B017
        parse_configs("specdec,vllm")
    sampled = hf_generation_config(Sampling(48, 1.0, None))
    assert sampled["do_sample"] and sampled["top_k"] == 0 and sampled["top_p"] == 1.0
    assert "eos_token_id" not in sampled  # no EOS stop, as specdec's stop_token_ids=[]
    assert hf_generation_config(Sampling(48, 0.0, None)) == {"do_sample": False, "max_new_tokens": 48}
    # 32 requests of at most 512 + 48 tokens in 256-token blocks, plus a margin
    assert hf_cb_args([], 32, 512, 48) == ["--cb-num-blocks", str(32 * 3 + 4), "--cb-max-batch-tokens", "512"]
    assert hf_cb_args(["--cb-num-blocks", "9"], 32, 512, 48) == ["--cb-max-batch-tokens", "512"]


# ----------------------------------------------------------------------------------------------
# the load generator on a fake server
# ----------------------------------------------------------------------------------------------
class FakeConnection:
    """Answers after `delay` s with 4 tokens; prompt "fail" raises, prompt "hang" never answers."""

    opened = 0
    closed = 0

    def __init__(self, delay: float) -> None:
        self.delay = delay
        FakeConnection.opened += 1

    async def send(self, case: Case, n: int) -> Outcome:
        if case.id == "fail":
            raise RuntimeError("HTTP 500: boom")
        await asyncio.sleep(3600 if case.id == "hang" else self.delay)
        return Outcome(tokens=4, first_output_at=None)

    async def close(self) -> None:
        FakeConnection.closed += 1


class FakeBackend:
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def connect(self) -> FakeConnection:
        return FakeConnection(self.delay)


def test_closed_loop_clients_stop_on_time_and_bound_the_drain() -> None:
    FakeConnection.opened = FakeConnection.closed = 0
    cases = [Case("ok", "a", (1,)), Case("fail", "b", (2,)), Case("ok2", "c", (3,)), Case("hang", "d", (4,))]
    run = asyncio.run(run_level(FakeBackend(0.02), prompt_cycle(cases), 3, 0.3, 0.2))
    assert FakeConnection.opened == FakeConnection.closed == 3  # one connection per client
    assert 0.3 <= run.elapsed < 0.3 + 0.2 + 0.2
    by_prompt: dict[str, list[RequestRecord]] = {}
    for r in run.records:
        by_prompt.setdefault(r.prompt, []).append(r)
    # every "hang" request ties its client up until the drain's end, where it is cut off
    hangs = by_prompt["hang"]
    assert 1 <= len(hangs) <= 3 and all(r.error and r.error.startswith("timeout") for r in hangs)
    assert all(r.error == "RuntimeError: HTTP 500: boom" for r in by_prompt["fail"])
    done = [r for r in run.records if r.error is None]
    assert done and all(r.tokens == 4 and r.latency >= 0.02 and r.ttft is None for r in done)
    assert all(r.start < 0.3 for r in run.records)  # nothing starts after the level's time
    s = summarize(run.records, run.elapsed, {})
    assert s["requests"] == len(done) and s["errors"] == len(run.records) - len(done)


async def test_sse_lines_split_only_where_server_sent_events_do() -> None:
    """A completion whose text holds U+2028 or U+0085 (a JSON encoder may leave them raw) stays one
    event, also across chunk boundaries; str.splitlines, which httpx's aiter_lines follows, cuts it."""
    event = "data: " + json.dumps({"choices": [{"text": "a\u2028b\x85c"}]}, ensure_ascii=False)
    stream = (event + "\r\n\ndata: [DONE]\n\n").encode()

    class Response:
        async def aiter_bytes(self):
            for i in range(0, len(stream), 7):
                yield stream[i:i + 7]

    lines = [line async for line in sse_lines(Response())]
    assert lines == [event, "", "data: [DONE]", ""]
    assert json.loads(lines[0][5:])["choices"][0]["text"] == "a\u2028b\x85c"
    assert len(event.splitlines()) == 3  # the split that broke it


def test_prompt_cycle_is_shared_and_numbers_requests() -> None:
    cases = [Case("a", "a", (1,)), Case("b", "b", (2,))]
    next_case = prompt_cycle(cases)
    assert [(n, c.id) for n, c in (next_case() for _ in range(3))] == [(0, "a"), (1, "b"), (2, "a")]


# ----------------------------------------------------------------------------------------------
# end to end on tiny models
# ----------------------------------------------------------------------------------------------
def save_byte_model(directory: Path, seed: int) -> Path:
    """A tiny random Qwen2 model with a byte-level BPE tokenizer (256 bytes, no merges, EOS).

    Not specdec.runtime.tiny's word-level tokenizer: transformers serve loads tokenizers with
    AutoProcessor, which in transformers 5 picks the architecture's class (Qwen2Tokenizer) and
    turns the word-level vocabulary's text into no tokens at all; a byte-level vocabulary is
    read the same by Qwen2Tokenizer and by specdec's loader, so both systems get the same ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    from specdec.runtime.tiny import build_tiny_model

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    build_tiny_model(vocab_size=len(vocab), seed=seed, max_position_embeddings=512).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def byte_pair(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serving-tiny")
    return {"target": save_byte_model(root / "target", 5), "draft": save_byte_model(root / "draft", 6)}


def run_harness(byte_pair: dict[str, Path], out: Path, configs: str) -> dict:
    argv = [
        "--levels", "1,2", "--seconds", "2", "--configs", configs,
        "--draft", str(byte_pair["draft"]), "--target", str(byte_pair["target"]),
        "--dtype", "float32", "--prompts", "builtin", "--max-new-tokens", str(MAX_NEW_TOKENS),
        "--drain-timeout", "60", "--startup-timeout", "120", "--rss-every", "0.5", "--out", str(out),
    ]
    assert main(argv) == 0
    return json.loads((out / "results.json").read_text())


def check_results(results: dict, out: Path, configs: list[str]) -> None:
    assert set(results) == {"meta", "machine", "configs"}
    assert results["meta"]["command"].startswith("python -m bench.bench_serving --levels 1,2")
    assert results["machine"]["cores"] >= 1 and results["machine"]["cpu"]
    assert list(results["configs"]) == configs
    for name, config in results["configs"].items():
        assert config["warmup"]["error"] is None and config["warmup"]["tokens"] == MAX_NEW_TOKENS
        assert [level["clients"] for level in config["levels"]] == [1, 2]
        for level in config["levels"]:
            assert level["errors"] == 0, (name, level["error_kinds"], level["records"][:2])
            assert level["requests"] >= level["clients"] and level["tokens"] > 0
            assert level["aggregate_tok_s"] > 0 and level["request_tok_s_p50"] > 0
            assert level["elapsed_s"] >= 2.0
            for key in ("ttft_p50_s", "ttft_p99_s", "latency_p50_s", "latency_p99_s"):
                assert level[key] is not None and level[key] > 0, key
            assert level["ttft_p50_s"] <= level["latency_p50_s"]
            assert level["prompt_mismatches"] == 0
            for snapshot in (level["rss_before"], level["rss_after"]):
                assert snapshot["total_bytes"] > 0 and snapshot["processes"]
            samples = level["rss_samples"]  # sampled while the level ran, the first at its start
            assert len(samples) >= 2 and samples[0][0] < 1.0 and all(b > 0 for _, b in samples)
            assert level["rss_peak_bytes"] == max(b for _, b in samples)
            # every request makes exactly the tokens asked for (no EOS stop)
            assert {r["tokens"] for r in level["records"]} == {MAX_NEW_TOKENS}
            assert len({r["client"] for r in level["records"]}) == level["clients"]
    table = (out / "table.md").read_text()
    assert table == render(results) and "Command: `python -m bench.bench_serving" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "clients" not in line]
    assert len(rows) == 2 * len(configs) + 2  # the full table + the throughput pivot
    assert (out / "throughput.png").stat().st_size > 0


@pytest.mark.slow
def test_specdec_with_and_without_batching_end_to_end(byte_pair, tmp_path) -> None:
    out = tmp_path / "out"
    results = run_harness(byte_pair, out, "specdec,specdec-nobatch")
    check_results(results, out, ["specdec", "specdec-nobatch"])
    up = results["configs"]["specdec"]["levels"][0]["rss_before"]["processes"]
    assert {name.split("[")[0] for name in up} >= {"up", "drafter", "verifier", "orchestrator"}
    assert results["configs"]["specdec-nobatch"]["command"].endswith("--no-batching")


HF_SERVE_PACKAGES = ("fastapi", "uvicorn", "openai", "httpx")
MISSING = [name for name in HF_SERVE_PACKAGES if importlib.util.find_spec(name) is None]


@pytest.mark.slow
@pytest.mark.skipif(
    bool(MISSING),
    reason=f"transformers serve leg needs {', '.join(MISSING)} (pip install -e '.[bench]')",
)
def test_transformers_serve_end_to_end(byte_pair, tmp_path) -> None:
    if shutil.which("transformers") is None and importlib.util.find_spec("transformers.cli") is None:
        pytest.skip("this transformers has no `transformers serve`")
    out = tmp_path / "out"
    results = run_harness(byte_pair, out, "hf-serve")
    check_results(results, out, ["hf-serve"])
    config = results["configs"]["hf-serve"]
    assert config["precision"] == "float32" and "--continuous-batching" in config["command"]
    prompt_tokens = results["meta"]["prompt_ids"]
    for level in config["levels"]:  # the server tokenized the text to as many ids as specdec gets
        assert all(r["prompt_tokens"] == prompt_tokens[r["prompt"]] for r in level["records"])
