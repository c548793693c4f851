"""bench.netns: a namespace per service, veth pairs between them, the delay relay in the hub, and
nothing left behind; and bench.bench_hosts run across them on the tiny pair.

Needs root and `ip` (iproute2): skipped, saying why, where a namespace cannot be made.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import netns
from bench.bench_hosts import stop

pytestmark = pytest.mark.slow  # starts processes in namespaces (tests/conftest.py, tiers)

ROOT = Path(__file__).resolve().parents[2]
ECHO = """
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen()
open(sys.argv[2] + ".tmp", "w").write(str(server.getsockname()[1]))
__import__("os").replace(sys.argv[2] + ".tmp", sys.argv[2])
connection, _ = server.accept()
while data := connection.recv(65536):
    connection.sendall(data)
"""


@pytest.fixture(scope="module", autouse=True)
def namespaces_here() -> None:
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"{process.args} exited with {process.returncode}"
        assert time.monotonic() < deadline, f"no {path} after {timeout:g} s"
        time.sleep(0.05)
    return path.read_text()


def _left_behind(net: netns.Network) -> set[str]:
    veths = {link.a_dev for link in net.links if link.a_ns is None}
    return (netns.namespace_names() & set(net.namespaces.values())) | (netns.link_names() & veths)


def test_a_relay_in_the_hub_reaches_a_spoke_with_the_delay_and_everything_goes_afterwards(tmp_path):
    delay_s = 0.02
    with netns.network("orchestrator", ("drafter", "verifier")) as net:
        names = set(net.namespaces.values())
        assert len(names) == 3 and names <= netns.namespace_names()
        ends = [*net.address.values(), *net.hub_side.values(), net.client_address]
        assert len(set(ends)) == 6 and all(ipaddress.ip_address(a) in netns.SUBNET for a in ends)
        for name in names:  # each namespace has its loopback up
            assert "UP" in netns.ip("-n", name, "-o", "link", "show", "lo").split(">")[0]
        echo = subprocess.Popen(
            [
                *net.exec("drafter"),
                sys.executable,
                "-c",
                ECHO,
                net.address["drafter"],
                str(tmp_path / "echo.port"),
            ]
        )
        relay = None
        try:
            port = int(_wait_for(tmp_path / "echo.port", echo))
            relay = subprocess.Popen(
                [
                    *net.exec("orchestrator"),
                    sys.executable,
                    "-m",
                    "bench.delay_proxy",
                    "--target",
                    f"{net.address['drafter']}:{port}",
                    "--delay-ms",
                    str(1e3 * delay_s),
                    "--host",
                    net.address["orchestrator"],
                    "--ready-file",
                    str(tmp_path / "relay.json"),
                ],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
            )
            ready = json.loads(_wait_for(tmp_path / "relay.json", relay))
            assert ready["host"] == net.address["orchestrator"]
            with socket.create_connection((net.address["orchestrator"], ready["port"]), timeout=10) as client:
                for payload in (b"ping", bytes(range(256)) * 1000):  # one small message, then several chunks
                    began = time.monotonic()
                    client.sendall(payload)
                    received = b""
                    while len(received) < len(payload):
                        chunk = client.recv(65536)
                        assert chunk, "the relay closed the connection"
                        received += chunk
                    elapsed = time.monotonic() - began
                    assert received == payload
                    assert 2 * delay_s <= elapsed < 2 * delay_s + 5
        finally:
            for process in (relay, echo):
                if process is not None:
                    stop(process)
    assert not _left_behind(net)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_nothing_is_left_when_the_body_raises_not_even_a_process_in_a_namespace(error):
    with pytest.raises(error, match="in the body"), netns.network() as net:
        sleeper = subprocess.Popen([*net.exec("verifier"), "sleep", "300"])
        deadline = time.monotonic() + 10
        while str(sleeper.pid) not in netns.ip("netns", "pids", net.namespaces["verifier"]).split():
            assert time.monotonic() < deadline, "the sleeper never showed up in its namespace"
            time.sleep(0.05)
        raise error("in the body")
    assert sleeper.wait(timeout=10) != 0  # killed on the way out
    assert not _left_behind(net)


def test_bench_hosts_across_namespaces_on_the_tiny_pair(tiny_dirs, tmp_path):
    from bench import bench_hosts

    out = tmp_path / "out"
    argv = ["--netns", "--delays-ms", "1", "--max-new-tokens", "3", "--warmup-tokens", "2",
            "--max-prompt-tokens", "24", "--dtype", "float32", "--draft", str(tiny_dirs["draft"]),
            "--target", str(tiny_dirs["target"]), "--startup-timeout", "300", "--out", str(out)]
    assert bench_hosts.main(argv) == 0
    saved = json.loads((out / "results.json").read_text())
    rows = saved["rows"]
    assert [(r["prompt"], r["config"]) for r in rows] == [
        (prompt, config)
        for prompt in ("open/code/0", "open/chat/0", "open/prose/0")
        for config in bench_hosts.CONFIGS
    ]
    assert all(r["delay_ms"] == 1.0 and r["tokens"] > 0 and r["tok_s"] > 0 for r in rows)
    assert saved["round_trip_ms"]["1"] >= 2.0  # one health check crosses the 1 ms relay twice
    network = saved["network"]
    assert saved["meta"]["network"] == network["mode"] == "namespaces"
    addresses = [
        *network["addresses"].values(),
        *network["engines"].values(),
        *network["relays"]["1"].values(),
    ]
    assert all(ipaddress.ip_address(a.rpartition(":")[0] or a) in netns.SUBNET for a in addresses)
    relay_host = network["addresses"]["orchestrator"]
    assert all(a.startswith(f"{relay_host}:") for a in network["relays"]["1"].values())
    assert not netns.namespace_names() & set(network["namespaces"].values())
    text = (out / "hosts.md").read_text()
    assert "Network: namespaces" in text and network["namespaces"]["drafter"] in text
    assert "| 1 ms |" in text
