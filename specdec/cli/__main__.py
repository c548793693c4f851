"""`python -m specdec.cli`: the same as the `specdec` command."""

from specdec.cli.main import app

app()
