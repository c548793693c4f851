"""`specdec up` warms its orchestrator up before it says ready (OrchestratorConfig.warm_up_tokens): the
warm-up request runs through the real services, the log says so, and it stays out of the orchestrator's
request metrics and spans; the first user's request is then served as usual."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from .helpers import UpProcess, json_lines, run_cli

WARM_UP_TOKENS = 6


def _requests_total(url: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specdec_requests_total{"))


@pytest.mark.timeout(600)
def test_up_warms_up_before_it_is_ready_and_the_warm_up_is_not_a_users_request(tiny_models, tmp_path,
                                                                                monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_WARM_UP_TOKENS", str(WARM_UP_TOKENS))  # the suite turns it off
    trace = tmp_path / "spans.jsonl"
    up = UpProcess(tmp_path, "--draft", str(tiny_models.draft), "--target", str(tiny_models.target),
                   "--trace-file", str(trace), "--metrics-port", "0")
    try:
        info = up.wait_ready()
        log = (up.log_dir / "orchestrator.log").read_text()
        match = re.search(r"orchestrator warm-up: (\d+) tokens in [\d.]+ s \((\d+) iterations", log)
        assert match is not None, log
        assert int(match.group(1)) == WARM_UP_TOKENS and int(match.group(2)) >= 1
        metrics = info["metrics"]["orchestrator"]
        assert _requests_total(metrics) == 0  # the warm-up is no user's request
        result = run_cli("generate", "--address", info["orchestrator"], "--json", "--max-new-tokens", "5",
                         "--ignore-eos", "t1 t2 t3 t1 t2")
        assert result.returncode == 0, result.stderr
        (line,) = json_lines(result.stdout)
        assert len(line["token_ids"]) == 5
        assert _requests_total(metrics) == 1
    finally:
        up.stop()
    spans = [json.loads(row) for row in trace.read_text().splitlines() if row.strip()]
    requests = [s for s in spans if s["name"] == "specdec.request"]
    assert len(requests) == 1  # the user's; none for the warm-up
    assert not any(str(s["attributes"].get("specdec.request_id", "")).startswith("specdec-warm-up")
                   for s in spans if s["name"].startswith("specdec."))
