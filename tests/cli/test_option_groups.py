"""Option groups (specdec.cli.option_groups): the runs of options `serve` and `up` share, declared once.

In-process (typer's CliRunner): no model, no server.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer
from typer.testing import CliRunner

from specdec.cli import app
from specdec.cli.option_groups import (
    CudaGraphs,
    EngineBatching,
    EngineCapacity,
    OrchestratorLimits,
    RequestDefaults,
    ServerTls,
    Telemetry,
    takes_option_groups,
)


def _params(*path: str) -> dict[str, object]:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return {param.name: param for param in command.params}


def test_a_group_is_spread_into_its_options_in_place_and_handed_back_whole() -> None:
    toy = typer.Typer(add_completion=False)
    seen: dict[str, object] = {}

    @toy.command()
    @takes_option_groups
    def command(
        *,
        name: Annotated[str, typer.Option("--name")] = "x",
        capacity: EngineCapacity,
        last: Annotated[int, typer.Option("--last")] = 1,
    ) -> None:
        seen.update(name=name, capacity=capacity, last=last)

    result = CliRunner().invoke(toy, ["--max-sessions", "7", "--last", "2"])
    assert result.exit_code == 0, result.output
    assert seen == {"name": "x", "capacity": EngineCapacity(max_sessions=7), "last": 2}
    names = [param.name for param in typer.main.get_command(toy).params]
    assert names == ["name", *(f.name for f in dataclasses.fields(EngineCapacity)), "last"]


def test_serve_and_up_take_each_group_with_the_same_options() -> None:
    """The same flag, help and default wherever a group is taken (up words --metrics-port its own way)."""
    takers = {
        EngineCapacity: [("serve", "drafter"), ("serve", "verifier"), ("up",)],
        EngineBatching: [("serve", "drafter"), ("up",)],
        CudaGraphs: [("serve", "verifier"), ("up",)],
        RequestDefaults: [("serve", "orchestrator"), ("up",)],
        OrchestratorLimits: [("serve", "orchestrator"), ("up",)],
        Telemetry: [("serve", "drafter"), ("serve", "orchestrator"), ("up",)],
        ServerTls: [("serve", "verifier"), ("serve", "orchestrator"), ("up",)],
    }
    for group, paths in takers.items():
        first, *others = [_params(*path) for path in paths]
        for field in dataclasses.fields(group):
            want = first[field.name]
            for params in others:
                got = params[field.name]
                if field.name == "metrics_port" and params is others[-1]:
                    continue  # up: one port per service
                assert (got.opts, got.help, got.default) == (want.opts, want.help, want.default), field.name


def test_the_chat_turn_close_reaches_the_orchestrator_config_and_up_drops_it_without_a_cache() -> None:
    from specdec.cli.up import up_close_chat_turns

    assert OrchestratorLimits(close_chat_turns=False).config_fields == {"close_chat_turns": False}
    assert OrchestratorLimits().config_fields == {}
    flag = _params("serve", "orchestrator")["close_chat_turns"]
    assert (flag.opts, flag.secondary_opts) == (["--close-chat-turns"], ["--no-close-chat-turns"])
    assert up_close_chat_turns(None, 512.0) is None  # the orchestrator's default (on)
    assert up_close_chat_turns(False, 512.0) == "--no-close-chat-turns"
    assert up_close_chat_turns(True, 512.0) == "--close-chat-turns"
    assert up_close_chat_turns(True, 0.0) == up_close_chat_turns(None, 0.0) == "--no-close-chat-turns"
