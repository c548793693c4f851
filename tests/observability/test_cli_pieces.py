"""The CLI's observability pieces: what `up` passes to its children, and the per-process set-up."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.cli.observability import child_args, setup_observability


def test_child_args_share_the_trace_file_and_spread_metrics_ports(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert child_args("drafter") == []
    args = child_args("verifier", trace_file="spans.jsonl", otlp_endpoint="c:4317", metrics_port=9464)
    assert args == ["--trace-file", str(tmp_path / "spans.jsonl"), "--otlp-endpoint", "c:4317",
                    "--metrics-port", "9466", "--open-metrics"]
    assert child_args("orchestrator", metrics_port=9464, metrics_host="0.0.0.0") == [
        "--metrics-port", "9464", "--metrics-host", "0.0.0.0", "--open-metrics"]
    assert child_args("drafter", metrics_port=0) == ["--metrics-port", "0", "--open-metrics"]  # any free port
    token = tmp_path / "token"
    assert child_args("drafter", metrics_port=0, metrics_token_file=token) == [
        "--metrics-port", "0", "--metrics-token-file", str(token)]


def test_a_service_with_a_token_asks_for_it_on_metrics_unless_told_otherwise(tmp_path):
    """With auth on, /metrics requires a token: the service's own, unless --metrics-token-file names
    another or --open-metrics leaves it open (`up` then opens its children's too)."""
    from specdec.cli.observability import ObservabilityOptions

    auth, scrape = tmp_path / "auth", tmp_path / "scrape"
    auth.write_text("service-token\n")
    scrape.write_text("scrape-token\n")
    for path in (auth, scrape):
        path.chmod(0o600)
    assert ObservabilityOptions(metrics_port=0, auth_token_file=auth).metrics_token == "service-token"
    assert ObservabilityOptions(metrics_port=0, metrics_token_file=scrape,
                                auth_token_file=auth).metrics_token == "scrape-token"
    opened = ObservabilityOptions(metrics_port=0, auth_token_file=auth, open_metrics=True)
    assert opened.metrics_token is None and "--open-metrics" in opened.child_args("verifier")
    assert ObservabilityOptions(metrics_port=0).metrics_token is None  # no auth: open, as before


def test_setup_is_inert_without_options():
    obs = setup_observability("orchestrator")
    assert obs.tracing is None and obs.metrics_server is None
    assert obs.loop_observer is None and obs.server_interceptors == [] and obs.client_interceptors == []
    assert obs.service_observers == [] and obs.ready_info() == {}
    obs.shutdown()
    obs.shutdown()  # idempotent


def test_setup_with_trace_file_and_metrics(tmp_path):
    obs = setup_observability("verifier", trace_file=tmp_path / "t.jsonl", metrics_port=0)
    try:
        assert obs.tracing is not None and obs.tracing.service_name == "specdec-verifier"
        assert len(obs.service_observers) == 2 and obs.server_interceptors
        info = obs.ready_info()
        assert info["metrics_port"] == obs.metrics_port > 0
        assert info["metrics_url"].endswith(f":{obs.metrics_port}/metrics")
        assert info["tracing"] == [f"file:{Path(tmp_path / 't.jsonl').resolve()}"]
    finally:
        obs.shutdown()
    with pytest.raises(ValueError, match="role"):
        setup_observability("nobody")
