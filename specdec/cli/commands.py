"""The click classes of every `specdec` command and group: what their --help and options share.

  * Options are grouped in help panels by what they are about (HELP_PANELS, one table for all
    commands, so the same flag sits in the same panel everywhere).
  * Boolean flags show as flags: no `<bool>` type column (typer prints one for is_flag options).
  * Every option of the `serve` commands can also be set by an environment variable,
    SPECDEC_<FLAG> (`--http-port` → SPECDEC_HTTP_PORT), which is how containers are configured; a
    flag on the command line wins over the variable. Help shows the variable's name.

Commands register with `cls=SpecdecCommand` (or ServeCommand) and apps with `cls=SpecdecGroup`.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand, TyperGroup

ENV_PREFIX = "SPECDEC_"

HELP_PANELS: dict[str, tuple[str, ...]] = {
    "Models and placement": (
        "--model", "--draft", "--target", "--device", "--drafter-device", "--verifier-device", "--dtype",
        "--threads", "--drafter-threads", "--verifier-threads", "--cores", "--drafter-cores",
        "--verifier-cores", "--no-pin", "--threads-beside-drafter", "--verifier-shares-cores",
        "--cuda-graphs", "--kv-slots", "--kv-slot-tokens"),
    "Prompt and output": ("--prompt", "--prompt-ids", "--chat", "--system", "--json", "--stream",
                          "--num-samples"),
    "Sampling": ("--temperature", "--top-k", "--top-p", "--seed", "--max-new-tokens", "--stop",
                 "--ignore-eos"),
    "Speculation": (
        "--method", "--k", "--tree-budget", "--a", "--pipeline", "--pipeline-max-k", "--bonus-guesses",
        "--rejection-guesses", "--default-method", "--default-k", "--default-a", "--draft-rows",
        "--adaptive-k", "--draft-source", "--draft-model-max-requests", "--cache-salt"),
    "Network": ("--address", "--host", "--port", "--drafter-port", "--verifier-port", "--drafter",
                "--verifier", "--max-message-mb", "--timeout", "--peer-timeout"),
    "HTTP API (OpenAI-compatible)": ("--http-port", "--no-http", "--served-model-name", "--chat-template",
                                     "--close-chat-turns"),
    "Capacity, batching and store": (
        "--max-sessions", "--session-ttl", "--kv-cache-mb", "--prefix-cache-mb", "--admission-timeout",
        "--batching", "--max-batch-tokens", "--batch-window-ms", "--batch-window-share", "--batch-layout",
        "--prefill-chunk-share",
        "--max-active-requests", "--queue-timeout",
        "--request-ttl", "--max-prompt-bytes", "--store-url", "--store-timeout", "--store-outage-grace",
        "--max-requests-per-caller", "--stream-idle-timeout"),
    "Security (TLS, tokens)": (
        "--tls-cert", "--tls-key", "--tls-client-ca", "--tls-require-client-cert", "--tls-ca",
        "--tls-client-cert", "--tls-client-key", "--tls-server-name", "--auth-token-file",
        "--engine-token-file", "--token-file", "--tenants-file", "--insecure-engine",
        "--max-chat-template-kb", "--chat-template-timeout"),
    "Observability": ("--trace-file", "--otlp-endpoint", "--metrics-port", "--metrics-host",
                      "--metrics-token-file", "--open-metrics", "--metrics-tls", "--log-level"),
    "Process": ("--ready-file", "--log-dir", "--startup-timeout", "--drafter-restarts", "--restarts"),
}
PANEL_OF = {flag: panel for panel, flags in HELP_PANELS.items() for flag in flags}


def env_name(option: Any) -> str:
    """SPECDEC_<LONG FLAG>: `--tls-cert` → SPECDEC_TLS_CERT."""
    flag = next((opt for opt in option.opts if opt.startswith("--")), option.opts[0])
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _dress(params: list[Any], *, environment: bool) -> list[Any]:
    """Panels and flag display (and env variables for `serve`), set once per parameter."""
    for param in params:
        if getattr(param, "param_type_name", None) != "option":  # typer's own (vendored) click classes
            continue
        if param.is_flag and param.metavar is None:
            param.metavar = ""  # a flag takes no value: show none
        if getattr(param, "rich_help_panel", None) is None:
            panel = next((PANEL_OF[opt] for opt in param.opts if opt in PANEL_OF), None)
            if panel is not None:
                param.rich_help_panel = panel  # type: ignore[attr-defined]
        if environment and param.envvar is None and param.name != "help":
            param.envvar = env_name(param)
            param.show_envvar = True
    return params


class SpecdecCommand(TyperCommand):
    """A command whose help groups its options in panels and shows flags as flags."""

    environment = False

    def get_params(self, ctx: Any) -> list[Any]:
        return _dress(super().get_params(ctx), environment=self.environment)


class ServeCommand(SpecdecCommand):
    """A `serve` command: every option can also come from SPECDEC_<FLAG>."""

    environment = True


class SpecdecGroup(TyperGroup):
    """A command group whose own --help shows its flags as flags."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _dress(super().get_params(ctx), environment=False)

