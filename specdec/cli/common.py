"""What every command shares: the two consoles, one-line errors, model resolution, the process
environment and exit.

Heavy imports (torch, transformers, grpc) happen inside the functions so that importing the CLI
stays fast, and nothing here changes the environment at import time: the commands call
`apply_environment_defaults` (the root callback does, for every command of `specdec`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True, highlight=False, soft_wrap=True)  # one error = one line, even when piped
out = Console(highlight=False, soft_wrap=True)

# Defaults of the process environment while a command runs (a value the user set wins):
# models come from the local store (`specdec models install`), never from the Hugging Face hub.
ENVIRONMENT_DEFAULTS = {"HF_HUB_OFFLINE": "1"}


def apply_environment_defaults() -> None:
    """Set ENVIRONMENT_DEFAULTS where unset; called when a command starts, never at import."""
    for name, value in ENVIRONMENT_DEFAULTS.items():
        os.environ.setdefault(name, value)


class CliError(Exception):
    """A failure the user can act on; printed as one line."""


def fail(message: str, exit_code: int = 1) -> typer.Exit:
    """Print 'error: …' (plain text, no markup) and return the Exit to raise."""
    err.print(f"[bold red]error:[/] {escape(message)}")
    return typer.Exit(exit_code)


def describe_error(exc: BaseException) -> str:
    """'CODE: message' for engine and gRPC errors, the same on both transports."""
    import grpc

    from specdec.rpc.status import RemoteError, status_for  # torch-free: server mode imports no torch

    if isinstance(exc, RemoteError):
        return f"{exc.code.name}: {exc.details} ({exc.address})"
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return f"{code.name}: {message}".replace(" (UNAVAILABLE)", "")


def resolve_model(name_or_path: str, role: str) -> Path:
    """Registry name or path → a local model path (converting a GGUF once); CliError when missing."""
    from specdec import models

    try:
        with err.status(f"preparing {role} model {name_or_path} …"):
            path = Path(models.resolve_model(name_or_path))
    except models.ModelNotInstalled:
        raise CliError(f"{role} model {name_or_path!r} is not installed; install it with: "
                       f"specdec models install {name_or_path}") from None
    except (OSError, ValueError) as exc:
        raise CliError(f"{role} model {name_or_path!r}: {exc}") from None
    if not path.exists():
        raise CliError(f"{role} model {name_or_path!r}: no such file or directory, and not a registry "
                       f"name ({', '.join(models.REGISTRY)}); see `specdec models list`")
    return path


def quiet_transformers() -> None:
    """No per-file progress bars from transformers: the CLI shows its own spinner."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def setup_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def orchestrator_config(default_method: str | None = None, default_k: int | None = None,
                        default_a: float | None = None, store_url: str | None = None,
                        draft_rows: str | None = None, adaptive_k: bool | None = None,
                        max_active_requests: int | None = None, queue_timeout_s: float | None = None,
                        request_ttl_seconds: int | None = None, max_prompt_bytes: int | None = None,
                        chat_template: str | None = None, draft_model_max_requests: int | None = None):
    """OrchestratorConfig from the environment (SPECDEC_*), overridden by the options given."""
    from orchestrator.config import OrchestratorConfig

    given = {"default_method": default_method, "default_k": default_k, "default_a": default_a,
             "store_url": store_url, "draft_rows": draft_rows, "adaptive_k": adaptive_k,
             "max_active_requests": max_active_requests, "queue_timeout_s": queue_timeout_s,
             "request_ttl_seconds": request_ttl_seconds, "max_prompt_bytes": max_prompt_bytes,
             "chat_template": chat_template, "draft_model_max_requests": draft_model_max_requests}
    try:
        return OrchestratorConfig(**{key: value for key, value in given.items() if value is not None})
    except ValueError as exc:  # pydantic's ValidationError: one short line per bad field
        errors = exc.errors() if hasattr(exc, "errors") else [{"loc": (), "msg": str(exc)}]
        parts = [f"{'.'.join(map(str, e['loc'])) or 'setting'}: {e['msg'].removeprefix('Value error, ')}"
                 for e in errors]
        raise CliError("bad orchestrator setting: " + "; ".join(parts)) from None


def running_as_program() -> bool:
    """Whether this process is the `specdec` program (the console script or `python -m specdec.cli`),
    not a caller of the app inside its own process (e.g. tests with typer's CliRunner)."""
    argv0 = Path(sys.argv[0])
    return argv0.name == "specdec" or argv0.resolve() == Path(__file__).with_name("__main__.py").resolve()


def exit_now(code: int) -> None:
    """Exit at once when running as the `specdec` program (not when called in-process, e.g. by tests).

    Everything is stopped and flushed by then; skipping the interpreter's teardown saves the
    seconds torch and grpc take to unwind, which matters when `up` stops its services.
    """
    if not running_as_program():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
