"""The benchmark's delay relay: bytes arrive whole and in order, each way no sooner than the delay."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from bench.delay_proxy import DelayProxy


def _echo_server() -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        connection, _ = server.accept()
        with connection:
            while data := connection.recv(65536):
                connection.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


@pytest.mark.parametrize("delay_s", [0.0, 0.03])
def test_round_trips_take_twice_the_delay_and_keep_the_bytes(delay_s):
    server, port = _echo_server()
    with server, DelayProxy(("127.0.0.1", port), delay_s) as proxy, \
            socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
        payload = bytes(range(256)) * 1000  # several chunks
        began = time.monotonic()
        client.sendall(payload)
        received = b""
        while len(received) < len(payload):
            received += client.recv(65536)
        elapsed = time.monotonic() - began
    assert received == payload
    assert elapsed >= 2 * delay_s
    assert elapsed < 2 * delay_s + 5


def test_a_negative_delay_is_refused():
    with pytest.raises(ValueError, match="delay_s"):
        DelayProxy(("127.0.0.1", 1), -0.001)


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--target", "127.0.0.1:1", "--delay-ms", "-1"], "--delay-ms"), (["--target", "nowhere"], "HOST:PORT")],
)
def test_the_relay_command_refuses_a_negative_delay_and_a_target_without_a_port(argv, message, capsys):
    from bench import delay_proxy

    with pytest.raises(SystemExit):
        delay_proxy.main(argv)
    assert message in capsys.readouterr().err


def test_hosts_summary_and_table_from_rows():
    from bench import bench_hosts

    rows = [{"delay_ms": d, "config": c, "tok_s": t, "ms_per_iteration": m}
            for d, c, t, m in ((0.0, "model", 10.0, 90.0), (0.0, "model", 12.0, 80.0),
                               (2.0, "model-seq", 8.0, 120.0))]
    summary = bench_hosts.summarize(rows)
    assert summary["0"]["model"] == {"tok_s": 11.0, "ms_per_iteration": 85.0, "runs": 2}
    meta = {"date": "d", "command": "c", "machine": "m", "draft": "a", "target": "b", "dtype": "int8",
            "max_new_tokens": 8, "temperature": 1.0, "rounds": 1}
    text = bench_hosts.render({"rows": rows, "round_trip_ms": {"0": 0.3, "2": 4.4}}, meta)
    assert "| 0 ms | 0.30 ms | 11.00 (85.0) | – | – |" in text
    assert "| 2 ms | 4.40 ms | – | 8.00 (120.0) | – |" in text
