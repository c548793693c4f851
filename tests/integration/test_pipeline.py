"""`specdec up` end to end: three real processes on loopback with tiny random models.

One pipeline serves the whole module (starting it dominates the cost); the last test stops it
with SIGTERM and checks that nothing is left behind.
"""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from specdec.cli.processes import check_health
from specdec.rpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from .helpers import TINY_CONTEXT, UpProcess, invoke_cli, json_lines, pid_alive, run_cli, wait_gone

pytestmark = pytest.mark.slow

VOCAB = 8
RPC_TIMEOUT_S = 60.0
SERVED_NAME = "tiny-pair"
# The tiny word-level tokenizer knows only t0..t7 (and has no chat template of its own).
CHAT_TEMPLATE = ("{% for m in messages %}t2 {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}t3{% endif %}")


@pytest.fixture(scope="module")
def pipeline(tiny_models, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("up")
    template = workdir / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    up = UpProcess(workdir, "--draft", str(tiny_models.draft), "--target", str(tiny_models.target),
                   "--trace-file", str(workdir / "spans.jsonl"), "--metrics-port", "0",
                   "--served-model-name", SERVED_NAME, "--chat-template", str(template))
    up.trace_file = workdir / "spans.jsonl"
    try:
        up.wait_ready()
        yield up
    finally:
        up.stop()


@pytest.fixture(scope="module")
def stub(pipeline):
    with grpc.insecure_channel(pipeline.info["orchestrator"]) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


def _cores(pid: int) -> str:
    with open(f"/proc/{pid}/status") as handle:
        return next(line.split(":", 1)[1].strip() for line in handle if line.startswith("Cpus_allowed_list"))


def test_up_starts_three_healthy_processes(pipeline) -> None:
    info = pipeline.info
    pids = info["pids"]
    assert set(pids) == {"drafter", "verifier", "orchestrator"}
    assert len({pids["drafter"], pids["verifier"], pids["orchestrator"], info["pid"]}) == 4
    for name in ("drafter", "verifier", "orchestrator"):
        assert pid_alive(pids[name]), name
        assert info[name].startswith("127.0.0.1:")
        assert check_health(info[name], timeout=10.0) == "SERVING", name
    if len(os.sched_getaffinity(0)) >= 2:  # pinned to different cores by default
        assert _cores(pids["drafter"]) != _cores(pids["verifier"])
    err = pipeline.stderr()
    assert "specdec generate --address " + info["orchestrator"] in err  # the example command


def test_generate_json_over_the_pipeline(pipeline) -> None:
    result = run_cli("generate", "--address", pipeline.info["orchestrator"], "--json", "--seed", "7",
                     "--max-new-tokens", "12", "--ignore-eos", "--method", "block", "t1 t2 t3")
    assert result.returncode == 0, result.stderr
    (line,) = json_lines(result.stdout)
    assert line["seed"] == 7 and line["method"] == "block" and line["finish_reason"] == "length"
    assert len(line["token_ids"]) == 12 and all(0 <= t < VOCAB for t in line["token_ids"])
    # Word-level tiny tokenizer; its special tokens (t0 unknown, the last one EOS) are no text.
    assert line["text"].split() == [f"t{t}" for t in line["token_ids"] if t not in (0, VOCAB - 1)]
    stats = line["stats"]
    assert stats["new_tokens"] == 12 and stats["iterations"] >= 1
    assert stats["accepted_tokens"] <= stats["drafted_tokens"]


def test_generate_streams_text(pipeline) -> None:
    result = invoke_cli("generate", "--address", pipeline.info["orchestrator"], "--stream", "--seed", "3",
                        "--ignore-eos", "-n", "9", "--method", "rd", "--a", "0.5", "t4")
    assert result.exit_code == 0, result.output
    words = result.stdout.split()  # 9 tokens; the special ones (t0 unknown, EOS) are no text
    assert 0 < len(words) <= 9 and all(w in {f"t{i}" for i in range(1, VOCAB - 1)} for w in words), words
    assert "9 tokens" in result.stderr and "seed 3" in result.stderr  # the statistics line


def _request(**fields) -> generation_pb2.GenerationRequest:
    fields.setdefault("prompt", "t1 t2")
    fields.setdefault("max_new_tokens", 4)
    return generation_pb2.GenerationRequest(**fields)


def _call_code(stub, request) -> tuple[grpc.StatusCode, str]:
    try:
        stub.Generate(request, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


BAD_REQUESTS = {
    "empty prompt": (_request(prompt=""), "prompt"),
    "no prompt at all": (generation_pb2.GenerationRequest(max_new_tokens=4), "prompt"),
    "negative temperature": (_request(sampling=common_pb2.SamplingParams(temperature=-0.5)), "temperature"),
    "top_p zero": (_request(sampling=common_pb2.SamplingParams(top_p=0.0)), "top_p"),
    "top_p above one": (_request(sampling=common_pb2.SamplingParams(top_p=1.5)), "top_p"),
    "k zero": (_request(k=0), "k"),
    "k too large": (_request(k=1000), "k"),
    "unknown method": (_request(method="beam"), "method"),
    "a negative": (_request(method="rd", a=-0.1), "a"),
    "a above one": (_request(method="rd", a=1.5), "a"),
    "max_new_tokens zero": (_request(max_new_tokens=0), "max_new_tokens"),
    "token id outside the vocabulary": (_request(prompt=None, prompt_ids=common_pb2.TokenIds(ids=[1, 99])),
                                        "prompt_ids"),
    "prompt longer than the context window": (
        _request(prompt=None, prompt_ids=common_pb2.TokenIds(ids=[1] * (TINY_CONTEXT + 5))), "prompt"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_inputs_get_invalid_argument_naming_the_field(stub, case) -> None:
    request, field = BAD_REQUESTS[case]
    code, details = _call_code(stub, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (case, code, details)
    assert field in details, (case, details)


def test_bad_input_on_the_stream_too(stub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.GenerateStream(_request(sampling=common_pb2.SamplingParams(temperature=-1.0)),
                                 timeout=RPC_TIMEOUT_S))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in caught.value.details()


def test_the_pipeline_still_serves_after_bad_requests(stub) -> None:
    reply = stub.Generate(_request(seed=3, max_new_tokens=6, stop_token_ids=common_pb2.TokenIds()),
                          timeout=RPC_TIMEOUT_S)
    assert len(reply.token_ids) == 6 and reply.finish_reason == "length"


def test_cli_prints_one_line_errors(pipeline) -> None:
    address = pipeline.info["orchestrator"]
    result = run_cli("generate", "--address", address, "--k", "100000", "t1")  # the server's limit
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # exactly one line
    assert result.stderr.startswith("error: INVALID_ARGUMENT: k")
    assert "Traceback" not in result.stderr
    result = invoke_cli("generate", "--address", address, "--temperature", "-1", "t1")
    assert result.exit_code == 1 and "INVALID_ARGUMENT" in result.stderr and "temperature" in result.stderr


def test_every_service_serves_metrics(pipeline) -> None:
    import urllib.request

    metrics = pipeline.info["metrics"]
    assert set(metrics) == {"drafter", "verifier", "orchestrator"}
    for name, url in metrics.items():
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert reply.status == 200, name
            assert b"specdec" in reply.read(), name
        assert url in pipeline.stderr()


def test_the_openai_package_completes_chats_and_streams_over_http(pipeline) -> None:
    import openai

    base = pipeline.info["http"]
    assert base and base.startswith("http://127.0.0.1:")
    with openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=RPC_TIMEOUT_S) as client:
        assert [m.id for m in client.models.list().data] == [SERVED_NAME]
        completion = client.completions.create(model=SERVED_NAME, prompt="t1 t2", max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True, "k": 2})
        assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 6
        streamed = client.completions.create(model=SERVED_NAME, prompt="t1 t2", max_tokens=6, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True, "k": 2})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.choices[0].text
        chat = client.chat.completions.create(model=SERVED_NAME, max_tokens=5, seed=3,
                                              messages=[{"role": "user", "content": "t4 t5"}])
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage.prompt_tokens == 4  # t2 t4 t5 t3: the template's words around the content
        pieces = client.chat.completions.create(model=SERVED_NAME, max_tokens=5, seed=3, stream=True,
                                                messages=[{"role": "user", "content": "t4 t5"}])
        assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == \
            chat.choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="top_p"):
            client.completions.create(model=SERVED_NAME, prompt="t1", max_tokens=2, top_p=2.0)
    # The orchestrator's /metrics counted them by route and status (serve wires its HttpMetrics in).
    served = _http_requests(pipeline.info["metrics"]["orchestrator"])
    assert served[("/v1/models", "200")] >= 1 and served[("/v1/completions", "400")] >= 1
    assert served[("/v1/completions", "200")] >= 2 and served[("/v1/chat/completions", "200")] >= 2


def _http_requests(url: str) -> dict[tuple[str, str], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    families = text_string_to_metric_families(text)
    return {(s.labels["route"], s.labels["status"]): s.value for family in families
            for s in family.samples if s.name == "specdec_http_requests_total"}


def test_a_dead_drafter_is_restarted_on_its_address(pipeline, stub) -> None:
    """Kill -9 the drafter: `up` keeps serving (target-only meanwhile) and brings it back on its port."""
    import json
    import time

    old_pid, address = pipeline.info["pids"]["drafter"], pipeline.info["drafter"]
    os.kill(old_pid, signal.SIGKILL)
    assert wait_gone([old_pid], 10) == []
    # draft_source "model": a model-free draft (the hybrid default's choice for a seeded request whose
    # own n-grams match) would count as drafted without the drafter.
    request = generation_pb2.GenerationRequest(prompt_ids=common_pb2.TokenIds(ids=[1, 2]), max_new_tokens=6,
                                               seed=3, method="token", stop_token_ids=common_pb2.TokenIds(),
                                               draft_source="model")
    assert len(stub.Generate(request, timeout=RPC_TIMEOUT_S).token_ids) == 6  # served either way
    ready = pipeline.log_dir / "drafter.ready.json"
    deadline = time.monotonic() + 120
    new_pid = None
    while time.monotonic() < deadline and pipeline.process.poll() is None:
        if ready.exists():
            try:
                new_pid = json.loads(ready.read_text())["pid"]
            except (ValueError, KeyError):
                new_pid = None
        if new_pid and new_pid != old_pid and "drafter healthy again" in pipeline.stderr():
            break
        time.sleep(0.2)
    assert new_pid and new_pid != old_pid, pipeline.stderr()
    assert pipeline.process.poll() is None and "drafter healthy again" in pipeline.stderr()
    assert check_health(address) == "SERVING"
    pipeline.info["pids"]["drafter"] = new_pid  # the SIGTERM test checks that this one goes too
    deadline = time.monotonic() + 30  # the orchestrator retries the drafter every second
    while True:
        result = stub.Generate(request, timeout=RPC_TIMEOUT_S)
        assert len(result.token_ids) == 6
        if result.stats.drafted_tokens > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert result.stats.drafted_tokens > 0, "the orchestrator never drafted with the restarted drafter"


def test_sigterm_stops_every_process(pipeline) -> None:
    children = list(pipeline.info["pids"].values())
    pipeline.process.send_signal(signal.SIGTERM)
    assert pipeline.wait_exit(60) == 0, pipeline.stderr()
    assert wait_gone(children, 10) == [], "children survived `specdec up`"
    assert not pipeline.ready_file.exists()
    assert "all services stopped" in pipeline.stderr()
    # The services flushed their spans on the way out; all three wrote to the one trace file.
    from orchestrator.tracing import read_spans

    spans = read_spans(pipeline.trace_file)
    assert {"specdec-orchestrator", "specdec-drafter", "specdec-verifier"} <= {s["service"] for s in spans}
    assert any(s["name"] == "specdec.iteration" for s in spans)
