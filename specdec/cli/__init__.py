"""The `specdec` command line (typer): one module per command group, mounted by main.py."""

from specdec.cli.main import app

__all__ = ["app"]
