"""The Helm chart (deploy/helm/specdec) with the real helm: lint, render, validate every object
against the Kubernetes 1.37 schemas in strict mode, and check what the manifests promise."""

from __future__ import annotations

import copy
import json
import tarfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from .conftest import EXAMPLE_FILES, VALUES_CASES
from .tools import (
    CHART,
    EXAMPLES,
    KUBERNETES_VERSION,
    ROOT,
    HelmError,
    Tools,
    all_containers,
    arg_value,
    component,
    env_map,
    helm,
    objects,
    pod_labels,
    pod_spec,
    render,
    selects,
)

pytestmark = pytest.mark.timeout(120)
ENGINES = ("drafter", "verifier")
ROLES = ("orchestrator", *ENGINES)
# Custom resources: no schema in kubernetes-validate; checked field by field below instead.
CRD_KINDS = {"ServiceMonitor"}


def test_examples_exist() -> None:
    assert {path.name for path in EXAMPLE_FILES} >= {"values-gpu.yaml", "values-replicas.yaml",
                                                     "values-redis.yaml"}


@pytest.mark.parametrize("values_file", VALUES_CASES)
def test_helm_lint(tools: Tools, values_file: Path | None) -> None:
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values_file)] if values_file else [])
    out = helm(tools, *args)
    assert "1 chart(s) linted, 0 chart(s) failed" in out


@pytest.mark.parametrize("values_file", VALUES_CASES)
def test_every_object_validates_against_kubernetes_schemas(rendered: Any, values_file: Path | None) -> None:
    docs = rendered(values_file)
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget", "ConfigMap"} <= kinds
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {str(exc).splitlines()[0]}")


def test_the_validator_rejects_an_unknown_field(rendered: Any) -> None:
    """The strict validation above can fail: a typo deep in a pod spec is caught."""
    deployment = copy.deepcopy(component(rendered(), "Deployment", "drafter"))
    pod_spec(deployment)["containers"][0]["readinessprobe"] = {"grpc": {"port": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


# ------------------------------------------------------------------------------- placement


def _anti_affinity_terms(deployment: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    anti = pod_spec(deployment).get("affinity", {}).get("podAntiAffinity", {})
    return {"required": anti.get("requiredDuringSchedulingIgnoredDuringExecution", []),
            "preferred": [t["podAffinityTerm"]
                          for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]}


@pytest.mark.parametrize("mode", ["required", "preferred"])
def test_drafter_and_verifier_repel_each_other(rendered: Any, mode: str) -> None:
    docs = rendered(None, f"placement.separateEngines={mode}")
    for role, other in (("drafter", "verifier"), ("verifier", "drafter")):
        terms = _anti_affinity_terms(component(docs, "Deployment", role))
        assert terms["required" if mode == "preferred" else "preferred"] == []
        (term,) = terms[mode]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        other_labels = pod_labels(component(docs, "Deployment", other))
        own_labels = pod_labels(component(docs, "Deployment", role))
        orchestrator_labels = pod_labels(component(docs, "Deployment", "orchestrator"))
        assert selects(term["labelSelector"], other_labels), f"{role} does not repel {other}"
        assert not selects(term["labelSelector"], own_labels), f"{role} would repel its own replicas"
        assert not selects(term["labelSelector"], orchestrator_labels)


def test_default_placement_is_required_and_none_removes_it(rendered: Any) -> None:
    assert _anti_affinity_terms(component(rendered(), "Deployment", "drafter"))["required"]
    for role in ENGINES:
        assert "affinity" not in pod_spec(component(rendered(None, "placement.separateEngines=none"),
                                                    "Deployment", role))


def test_user_affinity_is_kept_next_to_the_engine_rule(rendered: Any) -> None:
    zone = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}
    docs = rendered(None, "verifier.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                          ".nodeSelectorTerms[0].matchExpressions[0].key=zone",
                    "verifier.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                    ".nodeSelectorTerms[0].matchExpressions[0].operator=In",
                    "verifier.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                    ".nodeSelectorTerms[0].matchExpressions[0].values[0]=a")
    affinity = pod_spec(component(docs, "Deployment", "verifier"))["affinity"]
    assert affinity["nodeAffinity"] == zone["nodeAffinity"]
    assert affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


def test_gpu_values_request_gpus_on_the_right_nodes(rendered: Any) -> None:
    docs = rendered(EXAMPLES / "values-gpu.yaml")
    for role in ENGINES:
        deployment = component(docs, "Deployment", role)
        container = pod_spec(deployment)["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert arg_value(container["args"], "--device") == "cuda"
        assert "nvidia.com/gpu.product" in pod_spec(deployment)["nodeSelector"]
        assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec(deployment)["tolerations"])
    assert pod_spec(component(docs, "Deployment", "verifier"))["nodeSelector"] == {
        "cloud.google.com/gke-nodepool": "a100-pool", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    default = pod_spec(component(rendered(), "Deployment", "verifier"))["containers"][0]
    assert arg_value(default["args"], "--device") == "cpu"
    assert "nvidia.com/gpu" not in default["resources"].get("limits", {})


# ---------------------------------------------------------------------------------- probes


@pytest.mark.parametrize("values_file", VALUES_CASES)
def test_probe_ports_are_the_ports_in_the_arguments(rendered: Any, values_file: Path | None) -> None:
    docs = rendered(values_file)
    tls = values_file is not None and "tls" in values_file.name
    for role in ROLES:
        container = pod_spec(component(docs, "Deployment", role))["containers"][0]
        port = int(arg_value(container["args"], "--port"))
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert named["grpc"] == port
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[probe_name]
            handler = probe.get("grpc") or probe.get("tcpSocket")
            assert handler["port"] == port, f"{role} {probe_name}"
            # Native gRPC health where the kubelet can speak it: every engine probe, the
            # orchestrator's readiness (NOT_SERVING until its verifier answers); plaintext only.
            wants_grpc = not tls and (role != "orchestrator" or probe_name == "readinessProbe")
            assert ("grpc" in probe) == wants_grpc, f"{role} {probe_name}: {probe}"
        if role != "orchestrator":  # model loading: minutes before the first liveness check
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
        if role == "orchestrator" and (http := arg_value(container["args"], "--http-port")):
            assert named["http"] == int(http)
        if metrics := arg_value(container["args"], "--metrics-port"):
            assert named["metrics"] == int(metrics)


# ------------------------------------------------------------------------------ environment


@pytest.mark.parametrize("values_file", VALUES_CASES)
def test_environment_of_every_container(rendered: Any, values_file: Path | None) -> None:
    docs = rendered(values_file)
    for role in ROLES:
        deployment = component(docs, "Deployment", role)
        for container in all_containers(deployment):
            env = env_map(container)
            assert env["HF_HUB_OFFLINE"] == "1"
            assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
            assert "k8s.pod.name=$(POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]
            names = [item["name"] for item in container["env"]]
            assert len(names) == len(set(names)), f"duplicate env in {role}: {names}"
            # $(POD_NAME) only expands when the variable is defined earlier in the list.
            assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
            if role in ENGINES:
                mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
                assert env["SPECDEC_HOME"] == mounts["models"]


def test_otlp_values_reach_every_container(rendered: Any) -> None:
    docs = rendered(EXAMPLES / "values-redis.yaml")
    for role in ROLES:
        for container in all_containers(component(docs, "Deployment", role)):
            env = env_map(container)
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
            assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
            assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
            assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.1"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env_map(
        pod_spec(component(rendered(), "Deployment", "drafter"))["containers"][0])


# ---------------------------------------------------------------------------------- models


def test_registry_models_are_installed_by_an_init_container(rendered: Any) -> None:
    docs = rendered()
    for role, model in (("drafter", "qwen2.5-coder-0.5b"), ("verifier", "qwen2.5-coder-1.5b")):
        spec = pod_spec(component(docs, "Deployment", role))
        (init,) = spec["initContainers"]
        assert init["command"] == ["specdec"] and init["args"] == ["models", "install", model]
        main = spec["containers"][0]
        assert arg_value(main["args"], "--model") == model
        assert env_map(init)["SPECDEC_HOME"] == env_map(main)["SPECDEC_HOME"]
        volume = next(v for v in spec["volumes"] if v["name"] == "models")
        claim = volume["persistentVolumeClaim"]["claimName"]
        assert claim in objects(docs, "PersistentVolumeClaim")


def test_engines_on_a_one_node_claim_are_recreated_not_surged(rendered: Any) -> None:
    """A surge pod on another node could never attach a ReadWriteOnce claim: Recreate instead."""
    for values_file, expected in ((None, "Recreate"), (EXAMPLES / "values-replicas.yaml", "RollingUpdate")):
        for role in ENGINES:
            strategy = component(rendered(values_file), "Deployment", role)["spec"]["strategy"]
            assert strategy["type"] == expected
    forced = rendered(None, "verifier.updateStrategy=RollingUpdate")
    assert component(forced, "Deployment", "verifier")["spec"]["strategy"]["type"] == "RollingUpdate"


def test_a_model_path_in_an_existing_claim_needs_no_install(rendered: Any) -> None:
    docs = rendered(None, "models.storage.type=existingClaim", "models.storage.existingClaim=llm-weights",
                    "drafter.model=/models/draft", "verifier.model=/models/target")
    assert objects(docs, "PersistentVolumeClaim") == {}
    for role in ENGINES:
        spec = pod_spec(component(docs, "Deployment", role))
        assert "initContainers" not in spec
        volume = next(v for v in spec["volumes"] if v["name"] == "models")
        assert volume["persistentVolumeClaim"]["claimName"] == "llm-weights"


# ----------------------------------------------------------------------- services and scaling


def test_headless_services_exist_only_for_scaled_engines(rendered: Any) -> None:
    default = objects(rendered(), "Service")
    assert not [name for name in default if name.endswith("-headless")]
    docs = rendered(EXAMPLES / "values-replicas.yaml")
    services = objects(docs, "Service")
    args = pod_spec(component(docs, "Deployment", "orchestrator"))["containers"][0]["args"]
    for role in ENGINES:
        headless = services[f"rel-specdec-{role}-headless"]
        assert headless["spec"]["clusterIP"] == "None"
        assert selects(headless["spec"]["selector"], pod_labels(component(docs, "Deployment", role)))
        port = headless["spec"]["ports"][0]["port"]
        assert arg_value(args, f"--{role}") == f"rel-specdec-{role}-headless:{port}"
        assert component(docs, "Deployment", role)["spec"]["replicas"] > 1
    only_drafters = objects(rendered(None, "drafter.replicas=2"), "Service")
    assert "rel-specdec-drafter-headless" in only_drafters
    assert "rel-specdec-verifier-headless" not in only_drafters
    default_args = pod_spec(component(rendered(), "Deployment", "orchestrator"))["containers"][0]["args"]
    assert arg_value(default_args, "--verifier") == "rel-specdec-verifier:50052"


@pytest.mark.parametrize("values_file", VALUES_CASES)
def test_every_service_reaches_named_ports_of_one_deployment(rendered: Any, values_file: Path | None) -> None:
    docs = rendered(values_file)
    deployments = objects(docs, "Deployment")
    for name, service in objects(docs, "Service").items():
        matched = [d for d in deployments.values() if selects(service["spec"]["selector"], pod_labels(d))]
        assert len(matched) == 1, f"Service {name} selects {[d['metadata']['name'] for d in matched]}"
        ports = {p["name"] for c in pod_spec(matched[0])["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service {name}: no container port {port['targetPort']}"


def test_several_orchestrators_need_a_shared_store(tools: Tools) -> None:
    with pytest.raises(HelmError, match="orchestrator.replicas > 1 needs a shared store"):
        render(tools, sets=["orchestrator.replicas=2"])


def test_redis_in_the_chart_is_the_orchestrators_store(rendered: Any) -> None:
    docs = rendered(EXAMPLES / "values-redis.yaml")
    redis = component(docs, "Service", "redis")
    port = redis["spec"]["ports"][0]["port"]
    env = env_map(pod_spec(component(docs, "Deployment", "orchestrator"))["containers"][0])
    assert env["SPECDEC_STORE_URL"] == f"redis://{redis['metadata']['name']}:{port}/0"
    assert component(docs, "Deployment", "redis")["spec"]["replicas"] == 1
    assert component(docs, "Deployment", "orchestrator")["spec"]["replicas"] == 2
    replicas_env = env_map(pod_spec(component(rendered(EXAMPLES / "values-replicas.yaml"), "Deployment",
                                              "orchestrator"))["containers"][0])
    assert replicas_env["SPECDEC_STORE_URL"].startswith("redis://redis-master.redis.svc")
    assert "SPECDEC_STORE_URL" not in env_map(pod_spec(component(rendered(), "Deployment",
                                                                 "orchestrator"))["containers"][0])


# --------------------------------------------------------------------------------- security


def _policy_for(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    labels = pod_labels(component(docs, "Deployment", role))
    (policy,) = [p for p in objects(docs, "NetworkPolicy").values()
                 if selects(p["spec"]["podSelector"], labels)]
    return policy


@pytest.mark.parametrize("values_file", VALUES_CASES)
def test_only_the_orchestrator_reaches_the_engines(rendered: Any, values_file: Path | None) -> None:
    docs = rendered(values_file)
    labels = {role: pod_labels(component(docs, "Deployment", role)) for role in ROLES}
    for role in ENGINES:
        policy = _policy_for(docs, role)
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        grpc_rules = [r for r in policy["spec"]["ingress"]
                      if {"port": "grpc", "protocol": "TCP"} in r["ports"]]
        (rule,) = grpc_rules
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}, "a namespaceSelector would open the port to other namespaces"
        assert selects(peer["podSelector"], labels["orchestrator"])
        for other in ENGINES:
            assert not selects(peer["podSelector"], labels[other])
        for other_rule in policy["spec"]["ingress"]:
            if other_rule is not rule:
                assert [p["port"] for p in other_rule["ports"]] == ["metrics"]
    if "redis" in {d["metadata"].get("labels", {}).get("app.kubernetes.io/component") for d in docs}:
        (rule,) = _policy_for(docs, "redis")["spec"]["ingress"]
        assert [selects(rule["from"][0]["podSelector"], labels[r]) for r in ROLES] == [True, False, False]


def test_orchestrator_ingress_can_be_restricted(rendered: Any) -> None:
    docs = rendered(EXAMPLES / "values-tls.yaml")
    grpc_rule = _policy_for(docs, "orchestrator")["spec"]["ingress"][0]
    apps = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}
    assert grpc_rule["from"] == [apps]
    assert "from" not in _policy_for(rendered(), "orchestrator")["spec"]["ingress"][0]


@pytest.mark.parametrize("values_file", VALUES_CASES)
def test_restrictive_security_context(rendered: Any, values_file: Path | None) -> None:
    for deployment in objects(rendered(values_file), "Deployment").values():
        spec = pod_spec(deployment)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for container in all_containers(deployment):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            if container["name"] != "redis":  # Redis writes only /data
                assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}


def test_tls_and_tokens_come_from_secrets(rendered: Any) -> None:
    docs = rendered(EXAMPLES / "values-tls.yaml")
    orchestrator = pod_spec(component(docs, "Deployment", "orchestrator"))["containers"][0]["args"]
    assert arg_value(orchestrator, "--tls-ca") == "/etc/specdec/tls/ca.crt"
    assert arg_value(orchestrator, "--engine-token-file") == "/etc/specdec/engine-token/token"
    assert arg_value(orchestrator, "--auth-token-file") == "/etc/specdec/client-token/token"
    assert arg_value(orchestrator, "--tenants-file") == "/etc/specdec/tenants/tenants"
    volumes = pod_spec(component(docs, "Deployment", "orchestrator"))["volumes"]
    assert {"secretName": "specdec-tenants", "defaultMode": 0o440} in [v.get("secret") for v in volumes]
    for role in ENGINES:
        spec = pod_spec(component(docs, "Deployment", role))
        args = spec["containers"][0]["args"]
        assert arg_value(args, "--auth-token-file") == "/etc/specdec/engine-token/token"
        assert "--tls-require-client-cert" in args
        secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert secrets == {"specdec-tls", "specdec-engine-token"}


def test_pod_disruption_budgets(rendered: Any) -> None:
    docs = rendered()
    budgets = objects(docs, "PodDisruptionBudget").values()
    for role in ROLES:
        labels = pod_labels(component(docs, "Deployment", role))
        (budget,) = [b for b in budgets if selects(b["spec"]["selector"], labels)]
        assert budget["spec"]["maxUnavailable"] == 1


# --------------------------------------------------------------------------- observability


def test_dashboard_configmap_is_the_dashboard_file(rendered: Any) -> None:
    (config_map,) = [c for c in objects(rendered(), "ConfigMap").values()
                     if c["metadata"]["name"].endswith("-dashboard")]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = ROOT / "deploy" / "grafana" / "specdec-dashboard.json"
    assert json.loads(config_map["data"]["specdec-dashboard.json"]) == json.loads(source.read_text())
    assert (CHART / "dashboards" / "specdec-dashboard.json").resolve() == source.resolve(), \
        "the chart's dashboard must be a link to deploy/grafana (one source of truth)"


def test_packaged_chart_carries_the_dashboard(tools: Tools, tmp_path: Path) -> None:
    """`helm package` follows the link too: the .tgz holds the dashboard's content, not a link."""
    helm(tools, "package", str(CHART), "--destination", str(tmp_path))
    (archive,) = tmp_path.glob("specdec-*.tgz")
    with tarfile.open(archive) as tgz:
        member = tgz.getmember("specdec/dashboards/specdec-dashboard.json")
        assert member.isfile()
        packaged = json.loads(tgz.extractfile(member).read())
    assert packaged == json.loads((ROOT / "deploy" / "grafana" / "specdec-dashboard.json").read_text())


def test_service_monitor_scrapes_the_three_metrics_ports(rendered: Any) -> None:
    docs = rendered(EXAMPLES / "values-replicas.yaml")
    (monitor,) = objects(docs, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = monitor["spec"]
    assert set(spec) <= {"jobLabel", "selector", "namespaceSelector", "endpoints"}
    assert [e["port"] for e in spec["endpoints"]] == ["metrics"]
    assert set(spec["endpoints"][0]) <= {"port", "path", "interval", "scrapeTimeout"}
    scraped = [s for s in objects(docs, "Service").values()
               if selects(spec["selector"], s["metadata"]["labels"])]
    assert sorted(s["metadata"]["labels"]["app.kubernetes.io/component"] for s in scraped) == sorted(ROLES)
    for service in scraped:
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    assert objects(rendered(), "ServiceMonitor") == {}


# ---------------------------------------------------------------------------------- schema


@pytest.mark.parametrize(("setting", "message"), [
    ("drafter.dtype=fp8", "/drafter/dtype"),
    ("placement.separateEngines=sometimes", "/placement/separateEngines"),
    ("verifier.gpu.count=-1", "/verifier/gpu/count"),
    ("models.storage.type=s3", "/models/storage/type"),
    ("drafter.modle=x", "'modle' not allowed"),
    ("orchestrator.draftSource=magic", "/orchestrator/draftSource"),
    ("verifier.enabled=false", "/verifier/enabled"),
    ("service.sessionAffinity=Sticky", "/service/sessionAffinity"),
])
def test_the_schema_rejects_bad_values(tools: Tools, setting: str, message: str) -> None:
    with pytest.raises(HelmError, match="values don't meet the specifications of the schema") as error:
        render(tools, sets=[setting])
    assert message in str(error.value)


def test_cross_field_checks_name_the_value(tools: Tools) -> None:
    with pytest.raises(HelmError, match="set models.storage.existingClaim"):
        render(tools, sets=["models.storage.type=existingClaim"])
    with pytest.raises(HelmError, match="tls.enabled needs tls.secretName"):
        render(tools, sets=["tls.enabled=true"])
    with pytest.raises(HelmError, match="orchestrator.draftSource model needs the draft model"):
        render(tools, sets=["drafter.enabled=false", "orchestrator.draftSource=model"])
    render(tools, sets=["orchestrator.draftSource=model"])  # with the drafter it is fine


# -------------------------------------------------------------------------- without a drafter

NO_DRAFTER = "drafter.enabled=false"


def _orchestrator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return pod_spec(component(docs, "Deployment", "orchestrator"))["containers"][0]


def _serve_orchestrator_params(args: list[str], **env: str) -> dict[str, Any]:
    """The rendered orchestrator args as the real `specdec serve orchestrator` parses them."""
    import typer

    from specdec.cli import app

    assert args[:2] == ["serve", "orchestrator"]
    command = typer.main.get_command(app).commands["serve"].commands["orchestrator"]
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        return command.make_context("orchestrator", list(args[2:])).params


def test_helm_lint_without_a_drafter(tools: Tools) -> None:
    out = helm(tools, "lint", "--strict", str(CHART), "--set", NO_DRAFTER)
    assert "1 chart(s) linted, 0 chart(s) failed" in out


@pytest.mark.parametrize("values_file", [None, EXAMPLES / "values-replicas.yaml"],
                         ids=["default", "replicas"])
def test_without_a_drafter_no_drafter_object_is_made(rendered: Any, values_file: Path | None) -> None:
    """drafter.enabled=false: no Deployment, Service (headless too), PDB, model claim or policy entry
    of the drafter; what is left validates strictly and every Service still reaches its pods."""
    docs = rendered(values_file, NO_DRAFTER)
    with_drafter = rendered(values_file)
    labelled = {doc["metadata"].get("labels", {}).get("app.kubernetes.io/component") for doc in docs}
    assert "drafter" not in labelled and {"orchestrator", "verifier"} <= labelled
    assert [d["metadata"]["name"] for d in docs if "drafter" in d["metadata"]["name"]] == []
    gone = {(d["kind"], d["metadata"]["name"]) for d in with_drafter} - {(d["kind"], d["metadata"]["name"])
                                                                          for d in docs}
    assert gone and all("drafter" in name for _, name in gone), gone
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    deployments = objects(docs, "Deployment")
    for name, service in objects(docs, "Service").items():
        matched = [d for d in deployments.values() if selects(service["spec"]["selector"], pod_labels(d))]
        assert len(matched) == 1, f"Service {name} selects {[d['metadata']['name'] for d in matched]}"
    if values_file is None:
        assert set(objects(docs, "PersistentVolumeClaim")) == {"rel-specdec-verifier-models"}
        budgets = objects(docs, "PodDisruptionBudget")
        assert sorted(b["metadata"]["labels"]["app.kubernetes.io/component"] for b in budgets.values()) == [
            "orchestrator", "verifier"]


def test_without_a_drafter_the_orchestrator_runs_with_drafter_none(rendered: Any) -> None:
    container = _orchestrator_container(rendered(None, NO_DRAFTER))
    assert arg_value(container["args"], "--drafter") == "none"
    assert arg_value(container["args"], "--verifier") == "rel-specdec-verifier:50052"
    assert env_map(container)["SPECDEC_DRAFT_SOURCE"] == "hybrid"
    params = _serve_orchestrator_params(container["args"], SPECDEC_DRAFT_SOURCE="hybrid")
    assert params["drafter"] == "none" and params["draft_source"] == "hybrid"
    lookup = _orchestrator_container(rendered(None, NO_DRAFTER, "orchestrator.draftSource=lookup"))
    assert env_map(lookup)["SPECDEC_DRAFT_SOURCE"] == "lookup"
    # With the drafter: its Service's address, and the draft source all the same.
    default = _orchestrator_container(rendered())
    assert arg_value(default["args"], "--drafter") == "rel-specdec-drafter:50051"
    assert env_map(default)["SPECDEC_DRAFT_SOURCE"] == "hybrid"
    assert _serve_orchestrator_params(default["args"])["drafter"] == "rel-specdec-drafter:50051"


def test_values_without_the_switch_keep_the_drafter(rendered: Any) -> None:
    """`helm upgrade --reuse-values` of a release from before drafter.enabled: no key means enabled."""
    docs = rendered(None, "drafter.enabled=null")
    assert component(docs, "Deployment", "drafter")
    assert arg_value(_orchestrator_container(docs)["args"], "--drafter") == "rel-specdec-drafter:50051"
    without_source = _orchestrator_container(rendered(None, "orchestrator.draftSource=null"))
    assert "SPECDEC_DRAFT_SOURCE" not in env_map(without_source)  # the orchestrator's own default


def test_without_a_drafter_the_verifier_is_placed_and_guarded_alone(rendered: Any) -> None:
    """No rule keeps the verifier away from a drafter that does not exist; the engines' policy selects
    the verifier alone; the verifier keeps its own values (resources included: documented)."""
    docs = rendered(None, NO_DRAFTER)
    verifier = component(docs, "Deployment", "verifier")
    assert "affinity" not in pod_spec(verifier)
    container = pod_spec(verifier)["containers"][0]
    assert container["resources"] == pod_spec(component(rendered(), "Deployment", "verifier"))[
        "containers"][0]["resources"]
    policy = _policy_for(docs, "verifier")
    assert policy["spec"]["podSelector"]["matchExpressions"][0]["values"] == ["verifier"]
    (rule,) = [r for r in policy["spec"]["ingress"] if {"port": "grpc", "protocol": "TCP"} in r["ports"]]
    assert selects(rule["from"][0]["podSelector"], pod_labels(component(docs, "Deployment", "orchestrator")))


def test_notes_say_there_is_no_draft_model(tools: Tools) -> None:
    out = helm(tools, "install", "rel", str(CHART), "--dry-run=client", "--namespace", "specdec",
               "--set", NO_DRAFTER, "--set", "orchestrator.draftSource=suffix")
    notes = out.split("NOTES:", 1)[1]
    assert "Draft model:  none (drafter.enabled=false): drafts are model-free (suffix)" in notes
    assert "9091" not in notes  # the drafter's metrics port
    with_drafter = helm(tools, "install", "rel", str(CHART), "--dry-run=client", "--namespace", "specdec")
    assert "Draft model:  qwen2.5-coder-0.5b (1 drafter pod(s))" in with_drafter.split("NOTES:", 1)[1]


def test_session_affinity_applies_to_the_orchestrator_service_only(rendered: Any) -> None:
    docs = rendered(None, "service.sessionAffinity=ClientIP")
    assert component(docs, "Service", "orchestrator")["spec"]["sessionAffinity"] == "ClientIP"
    for role in ENGINES:
        assert "sessionAffinity" not in component(docs, "Service", role)["spec"]
    assert "sessionAffinity" not in component(rendered(), "Service", "orchestrator")["spec"]


def test_the_prefix_cache_size_reaches_the_engines(tools: Tools) -> None:
    docs = render(tools, sets=["verifier.prefixCacheMb=256", "drafter.prefixCacheMb=0"])
    for role, value in (("verifier", "256"), ("drafter", "0")):
        args = pod_spec(component(docs, "Deployment", role))["containers"][0]["args"]
        assert arg_value(args, "--prefix-cache-mb") == value
    default = pod_spec(component(render(tools), "Deployment", "verifier"))["containers"][0]["args"]
    assert "--prefix-cache-mb" not in default  # the CLI's default
