"""The chart's engines always have a token, and /metrics can ask for one and speak TLS (issue 29).

`serve drafter|verifier` refuses a non-loopback host (the chart's 0.0.0.0) without a token or mTLS,
so a chart whose engines had no token would not start: with no auth.engineTokenSecret the chart
makes a Secret with a random token and hands it to the engines and to the orchestrator.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest

from .conftest import VALUES_CASES
from .test_chart import ENGINES, _serve_orchestrator_params
from .tools import EXAMPLES, HelmError, Tools, arg_value, component, objects, pod_spec, render

pytestmark = pytest.mark.timeout(120)
TOKEN_PATH = "/etc/specdec/engine-token/token"


def _args(docs: list[dict[str, Any]], role: str) -> list[str]:
    return pod_spec(component(docs, "Deployment", role))["containers"][0]["args"]


def _secret_volume(docs: list[dict[str, Any]], role: str, volume: str) -> str:
    (found,) = [v["secret"]["secretName"] for v in pod_spec(component(docs, "Deployment", role))["volumes"]
                if v["name"] == volume]
    return found


@pytest.mark.parametrize("values_file", VALUES_CASES)
def test_engines_always_get_a_token_and_pass_the_serve_check(rendered: Any, values_file) -> None:
    from specdec.cli.options import refuse_open_engine
    from specdec.rpc.security import ServerSecurity

    docs = rendered(values_file)
    secret = _secret_volume(docs, "verifier", "engine-token")
    for role in ENGINES:
        if not [d for d in objects(docs, "Deployment").values() if d["metadata"]["name"].endswith(role)]:
            continue  # a values file without the drafter
        args = _args(docs, role)
        assert arg_value(args, "--auth-token-file") == TOKEN_PATH
        assert _secret_volume(docs, role, "engine-token") == secret
        host = arg_value(args, "--host")
        # What `serve` checks before loading anything: a token (the file's presence is checked at start).
        refuse_open_engine(role, host, ServerSecurity(tokens=("t",)), insecure_engine=False)
    assert arg_value(_args(docs, "orchestrator"), "--engine-token-file") == TOKEN_PATH
    assert _secret_volume(docs, "orchestrator", "engine-token") == secret


def test_without_a_named_secret_the_chart_makes_one_with_a_random_token(rendered: Any) -> None:
    docs = rendered()
    secrets = objects(docs, "Secret")
    (name,) = [n for n in secrets if n.endswith("-engine-token")]
    assert _secret_volume(docs, "verifier", "engine-token") == name
    token = base64.b64decode(secrets[name]["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    assert secrets[name]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # A Secret the operator names is used as is; none is made.
    tls_docs = rendered(EXAMPLES / "values-tls.yaml")
    assert not [n for n in objects(tls_docs, "Secret") if n.endswith("-engine-token")]
    assert _secret_volume(tls_docs, "drafter", "engine-token") == "specdec-engine-token"


def test_the_open_engine_check_would_refuse_the_chart_without_a_token() -> None:
    """The negative control of the test above: the chart's host with no token is refused (exit 2)."""
    import typer

    from specdec.cli.options import refuse_open_engine
    from specdec.rpc.security import ServerSecurity

    with pytest.raises(typer.Exit) as caught:
        refuse_open_engine("verifier", "0.0.0.0", ServerSecurity(), insecure_engine=False)
    assert caught.value.exit_code == 2


METRICS = ["observability.metrics.tokenSecret=specdec-metrics-token",
           "observability.serviceMonitor.enabled=true"]


def test_metrics_token_reaches_every_role_and_the_service_monitor(rendered: Any) -> None:
    docs = rendered(None, *METRICS)
    for role in ("orchestrator", *ENGINES):
        args = _args(docs, role)
        assert arg_value(args, "--metrics-token-file") == "/etc/specdec/metrics-token/token"
        assert "--metrics-tls" not in args
        assert _secret_volume(docs, role, "metrics-token") == "specdec-metrics-token"
        container = pod_spec(component(docs, "Deployment", role))["containers"][0]
        assert "/etc/specdec/metrics-token" in {m["mountPath"] for m in container["volumeMounts"]}
    params = _serve_orchestrator_params(_args(docs, "orchestrator"))
    assert str(params["metrics_token_file"]) == "/etc/specdec/metrics-token/token"
    (monitor,) = objects(docs, "ServiceMonitor").values()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer",
                                         "credentials": {"name": "specdec-metrics-token", "key": "token"}}
    assert "scheme" not in endpoint
    # Without the value nothing changes: no token flag, no authorization.
    plain = rendered(None, "observability.serviceMonitor.enabled=true")
    assert "--metrics-token-file" not in _args(plain, "verifier")
    (plain_monitor,) = objects(plain, "ServiceMonitor").values()
    assert "authorization" not in plain_monitor["spec"]["endpoints"][0]


def test_metrics_tls_uses_the_tls_secret_and_needs_it(rendered: Any, tools: Tools) -> None:
    docs = rendered(EXAMPLES / "values-tls.yaml", *METRICS, "observability.metrics.tls=true",
                    "observability.serviceMonitor.tlsServerName=metrics.specdec")
    for role in ("orchestrator", *ENGINES):
        assert "--metrics-tls" in _args(docs, role) and arg_value(_args(docs, role), "--tls-cert")
    (endpoint,) = next(iter(objects(docs, "ServiceMonitor").values()))["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"ca": {"secret": {"name": "specdec-tls", "key": "ca.crt"}},
                                     "serverName": "metrics.specdec"}
    with pytest.raises(HelmError, match="observability.metrics.tls .* needs tls.enabled"):
        render(tools, sets=["observability.metrics.tls=true"])
