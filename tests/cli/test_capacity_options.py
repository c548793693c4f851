"""The capacity options: --kv-cache-mb / --admission-timeout / --max-sessions on the engines,
--max-active-requests / --queue-timeout on the orchestrator, all on `up` (passed on to its
children); the CLI's spelled-out defaults agree with the configs', and MiB become KV tokens."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from specdec.cli import app, options
from specdec.cli.common import CliError, orchestrator_config


def _command(*path: str):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def _help(*path: str) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "220", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return re.sub(r"\s+", " ", result.output)


def test_the_cli_defaults_agree_with_the_configs() -> None:
    from orchestrator.config import OrchestratorConfig
    from specdec.engine.sessions import SessionConfig

    sessions, orchestrator = SessionConfig(), OrchestratorConfig()
    assert options.DEFAULT_MAX_SESSIONS == sessions.max_sessions == 1024
    assert options.DEFAULT_ADMISSION_TIMEOUT_S == sessions.admission_timeout_s
    assert options.DEFAULT_MAX_ACTIVE_REQUESTS == orchestrator.max_active_requests
    assert options.DEFAULT_QUEUE_TIMEOUT_S == orchestrator.queue_timeout_s
    assert options.DEFAULT_KV_CACHE_MB == 2048


@pytest.mark.parametrize("path", [("serve", "drafter"), ("serve", "verifier"), ("up",)])
def test_engine_capacity_options_in_the_help(path) -> None:
    text = _help(*path)
    for flag, default in (("--kv-cache-mb", "2048.0"), ("--admission-timeout", "30.0"),
                          ("--max-sessions", "1024")):
        assert re.search(rf"{flag} .*?\[default: {re.escape(default)}\]", text), (flag, path)
    assert "RESOURCE_EXHAUSTED" in text and "0 = no limit" in text


@pytest.mark.parametrize("path", [("serve", "orchestrator"), ("up",)])
def test_orchestrator_admission_options_in_the_help(path) -> None:
    text = _help(*path)
    assert "--max-active-requests" in text and "$SPECDEC_MAX_ACTIVE_REQUESTS, else 64" in text
    assert "--queue-timeout" in text and "$SPECDEC_QUEUE_TIMEOUT_S, else 60" in text


@pytest.mark.parametrize("args", [["serve", "drafter", "--kv-cache-mb", "-1"],
                                  ["serve", "verifier", "--admission-timeout", "-1"],
                                  ["serve", "orchestrator", "--max-active-requests", "0"],
                                  ["up", "--queue-timeout", "-1"]])
def test_bad_values_are_usage_errors(args) -> None:
    result = CliRunner().invoke(app, args, env={"COLUMNS": "220"})
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


def test_orchestrator_config_takes_the_admission_options(monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_MAX_ACTIVE_REQUESTS", "5")
    assert orchestrator_config().max_active_requests == 5  # the environment, when no option is given
    config = orchestrator_config(max_active_requests=2, queue_timeout_s=1.5)
    assert (config.max_active_requests, config.queue_timeout_s) == (2, 1.5)


def test_kv_cache_mb_becomes_tokens_of_the_model() -> None:
    from specdec.cli.serve import kv_budget_tokens
    from specdec.runtime.tiny import build_tiny_model

    model = build_tiny_model(hidden_size=16, num_layers=2)  # 2 layers x 2 x 1 KV head x 8 x 4 B = 128 B
    assert kv_budget_tokens(1.0, model) == 1024 * 1024 // 128
    assert kv_budget_tokens(0, model) is None
    with pytest.raises(CliError, match=r"--kv-cache-mb 0\.0001 holds no token of this model \(128 bytes"):
        kv_budget_tokens(0.0001, model)


def test_up_passes_the_capacity_options_to_its_children(tmp_path, monkeypatch) -> None:
    """`up` with a fake supervisor: the arguments of each child parse as that `serve` command's."""
    from specdec.cli import processes
    from specdec.cli import up as up_module

    captured: dict[str, list[str]] = {}

    class FakeSupervisor:
        def __init__(self, log_dir) -> None:
            self.children: list[SimpleNamespace] = []
            self.stop_requested = threading.Event()
            self.log_dir = tmp_path

        def install_signal_handlers(self) -> None:
            pass

        def child(self, name: str, args: list[str], cores=None) -> SimpleNamespace:
            captured[name] = args
            return SimpleNamespace(name=name, address="127.0.0.1:1", info={}, pid=1, cores=cores)

        def start(self, child: SimpleNamespace) -> SimpleNamespace:
            self.children.append(child)
            return child

        def supervise(self, *args, **kwargs) -> None:
            return None  # as if Ctrl-C came at once

        def stop(self) -> None:
            pass

    monkeypatch.setattr(up_module, "resolve_model", lambda name, role: Path(name))
    monkeypatch.setattr(processes, "Supervisor", FakeSupervisor)
    monkeypatch.setattr(processes, "wait_ready", lambda *args, **kwargs: None)
    monkeypatch.setattr(processes, "port_in_use", lambda host, port: False)
    result = CliRunner().invoke(app, ["up", "--no-pin", "--kv-cache-mb", "512", "--admission-timeout", "5",
                                      "--max-sessions", "64", "--max-active-requests", "8",
                                      "--queue-timeout", "2.5", "--prefill-chunk-share", "0.5"],
                                env={"COLUMNS": "220"})
    assert result.exit_code == 0, result.output
    for role in ("drafter", "verifier"):
        args = captured[role]
        assert args[0] == role
        assert args[args.index("--kv-cache-mb") + 1] == "512.0"
        assert args[args.index("--admission-timeout") + 1] == "5.0"
        assert args[args.index("--max-sessions") + 1] == "64"
        params = _command("serve", role).make_context(role, args[1:]).params
        assert params["kv_cache_mb"] == 512.0 and params["admission_timeout"] == 5.0
        assert params["max_sessions"] == 64 and params["prefill_chunk_share"] == 0.5
    args = captured["orchestrator"]
    params = _command("serve", "orchestrator").make_context("orchestrator", args[1:]).params
    assert (params["max_active_requests"], params["queue_timeout"]) == (8, 2.5)
