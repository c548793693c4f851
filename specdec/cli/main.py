"""`specdec` command line: the root app, mounting one module per command group.

    specdec models install                  # the default draft/target pair         (cli.models)
    specdec up                              # drafter + verifier + orchestrator     (cli.up)
    specdec generate "def quicksort"        # talks to `up` at 127.0.0.1:50050       (cli.generate)
    specdec generate --draft D --target T "def quicksort"   # in-process, no servers
    specdec serve drafter|verifier|orchestrator ...         # one service, what `up` runs (cli.serve)
    specdec analyze                         # measure a pair, calibrate it          (cli.analyze)
    specdec trace-report | trace-collect    # spans of a run                        (cli.observability)

Shared pieces: cli.options (option types, parse helpers), cli.common (consoles, one-line
errors, model resolution, environment defaults, exit). The CLI is an adapter only: it parses
options, builds configs / clients / engines and calls the orchestrator; process supervision
lives in cli.processes. Heavy imports (torch, transformers, grpc) happen inside the
commands so that `--help` answers at once, and importing the CLI changes no environment
variable (the root callback sets the defaults when a command runs).

Errors are one line on stderr ("error: CODE: message") and a non-zero exit code, never a
Python traceback. Text goes to stdout, progress and statistics to stderr.
"""

from __future__ import annotations

import typer

from specdec.cli import observability
from specdec.cli.analyze import analyze_app
from specdec.cli.commands import SpecdecCommand, SpecdecGroup
from specdec.cli.common import apply_environment_defaults
from specdec.cli.generate import generate
from specdec.cli.models import models_app
from specdec.cli.serve import serve_app
from specdec.cli.up import up

app = typer.Typer(
    cls=SpecdecGroup,
    name="specdec",
    help="Distributed exact speculative decoding: a draft model and a target model in separate gRPC "
    "services, and an orchestrator whose output is distributed exactly as the target model's own.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


@app.callback()
def _root() -> None:
    # No docstring: the app's help above stays the help of `specdec`.
    apply_environment_defaults()


app.add_typer(models_app, name="models")
app.add_typer(serve_app, name="serve")
app.add_typer(analyze_app)  # specdec analyze
app.command(cls=SpecdecCommand)(up)
app.command(cls=SpecdecCommand)(generate)
observability.register_commands(app)  # specdec trace-report, trace-collect (listed after up/generate)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
