"""Faults of the three-process pipeline: a refused model pair, a drafter killed mid-request, a dead
verifier, nothing listening. Real processes on loopback, every wait bounded.

Where `up` would (by design) stop everything when a child dies, the services are started one by
one with specdec.cli.processes — the same commands and helpers `up` uses.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess

import grpc
import pytest

from specdec.cli import processes
from specdec.rpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from .helpers import (
    CLI_TIMEOUT_S,
    ROOT,
    STARTUP_TIMEOUT_S,
    UpProcess,
    cli_argv,
    cli_env,
    invoke_cli,
    kill_pids,
    wait_gone,
)

pytestmark = pytest.mark.slow

LONG = 600  # new tokens of the request the drafter dies in (the tiny context holds 1024)


def test_vocabulary_mismatch_is_refused_at_startup(tiny_models, tmp_path) -> None:
    """Documented behaviour: the orchestrator refuses the pair when it starts; `up` reports it, exits 1."""
    up = UpProcess(tmp_path, "--draft", str(tiny_models.other_vocab), "--target", str(tiny_models.target))
    try:
        code = up.wait_exit(3 * STARTUP_TIMEOUT_S)
        stderr = up.stderr()
        assert code == 1, stderr
        assert "orchestrator (pid" in stderr and "exited with code 1" in stderr
        assert "vocabulary mismatch" in stderr and "vocab_size 6" in stderr and "vocab_size 8" in stderr
        assert not up.ready_file.exists()
        assert wait_gone(up.child_pids, 10) == [], "drafter/verifier survived the failed start"
    finally:
        up.stop()


@pytest.fixture(scope="module")
def services(tiny_models, tmp_path_factory):
    """Drafter, verifier and orchestrator as separate `specdec serve` processes (ports chosen by the OS).

    Shared by the next two tests, in file order: the first kills the drafter, the second the verifier.
    """
    supervisor = processes.Supervisor(tmp_path_factory.mktemp("services") / "logs")
    env = cli_env()
    try:
        common = ["--port", "0", "--threads", "1"]
        drafter = supervisor.start(supervisor.child(
            "drafter", ["drafter", "--model", str(tiny_models.draft), *common]), env)
        verifier = supervisor.start(supervisor.child(
            "verifier", ["verifier", "--model", str(tiny_models.target), *common]), env)
        for child in (drafter, verifier):
            processes.wait_ready(child, STARTUP_TIMEOUT_S)
        orchestrator = supervisor.start(supervisor.child(
            "orchestrator", ["orchestrator", "--drafter", drafter.address, "--verifier", verifier.address,
                             "--port", "0"]), env)
        processes.wait_ready(orchestrator, STARTUP_TIMEOUT_S)
        yield {"drafter": drafter, "verifier": verifier, "orchestrator": orchestrator}
    finally:
        pids = [c.pid for c in supervisor.children if c.pid]
        supervisor.stop(grace=5.0)
        kill_pids(wait_gone(pids, 5))


def test_drafter_killed_mid_request_the_request_completes(services) -> None:
    argv = cli_argv("generate", "--address", services["orchestrator"].address, "--stream", "--json",
                    "--seed", "5", "--ignore-eos", "--max-new-tokens", str(LONG), "--k", "2", "t1 t2 t3")
    # Unbuffered: communicate() below reads the pipe's descriptor itself, so a buffered readline()
    # would keep (and lose) whatever chunks arrived with the first one.
    client = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, env=cli_env(),
                              cwd=ROOT, stdin=subprocess.DEVNULL)
    try:
        first = json.loads(client.stdout.readline() or "{}")  # blocks until the first chunk: mid-request
        assert first.get("type") == "chunk", client.stderr.read() if client.poll() is not None else first
        services["drafter"].process.send_signal(signal.SIGKILL)
        stdout, stderr = client.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(timeout=10)
    assert client.returncode == 0, stderr.decode(errors="replace")
    lines = [first] + [json.loads(line) for line in stdout.splitlines() if line.strip()]
    result = lines[-1]
    assert result["type"] == "result" and result["finish_reason"] == "length"
    assert len(result["token_ids"]) == LONG == result["stats"]["new_tokens"]
    streamed = [t for line in lines[:-1] for t in line["token_ids"]]
    assert streamed == result["token_ids"]  # the chunks add up to the result
    assert result["stats"]["fallback_iterations"] > 0, "the drafter died before the request ended"
    assert result["stats"]["drafted_iterations"] > 0, "the kill landed before any speculation"


def test_dead_verifier_gives_unavailable_without_its_address(services) -> None:
    """Clients learn that the verifier is unavailable, not where it runs (issue 14)."""
    verifier = services["verifier"]
    verifier.process.send_signal(signal.SIGKILL)
    verifier.process.wait(timeout=30)
    request = generation_pb2.GenerationRequest(prompt="t1 t2", max_new_tokens=4)
    with grpc.insecure_channel(services["orchestrator"].address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(request, timeout=60)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert verifier.address not in caught.value.details()
        # token ids skip the tokenizer call: the verify call itself fails the same way
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(generation_pb2.GenerationRequest(prompt_ids=common_pb2.TokenIds(ids=[1, 2]),
                                                           max_new_tokens=4), timeout=60)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert verifier.address not in caught.value.details()
    # The CLI shows it as one line with the status code.
    result = invoke_cli("generate", "--address", services["orchestrator"].address, "t1")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: UNAVAILABLE") and verifier.address not in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_with_nothing_listening() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    result = invoke_cli("generate", "--address", address, "def quicksort")
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"error: UNAVAILABLE: no orchestrator answers at {address} (if it serves TLS, pass --tls-ca); "
        "start one with `specdec up` (or pass "
        "--address), or run in-process with --draft and --target")
