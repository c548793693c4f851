"""The chart's default values, run for real: every rendered container as a local process on tiny
models, Service names resolving to loopback. Each probe's port must answer SERVING, then text is
generated through the orchestrator's Service ports (gRPC and the OpenAI-compatible HTTP API).

The same again for a release without a drafter (drafter.enabled=false): two pods, the orchestrator
started with `--drafter none` and the draft source of its values."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .pods import (
    Cluster,
    complete_http,
    generate_grpc,
    render_on_free_ports,
    save_tiny_models,
    scrape,
    wait_ready,
)
from .tools import Tools, arg_value, component, pod_spec

pytestmark = pytest.mark.timeout(300)
# Three processes import torch and transformers at once on a busy 2-core machine: tens of seconds.
STARTUP_TIMEOUT_S = 180.0
# The releases run, one after the other (pytest ends one module-scoped cluster before the next):
# the default values, and no drafter with a draft source other than the default.
RELEASES = {
    "default": (),
    "no-drafter": ("drafter.enabled=false", "orchestrator.draftSource=lookup"),
}


@pytest.fixture(scope="module", params=list(RELEASES))
def cluster(request: pytest.FixtureRequest, tools: Tools,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The values of one release (models as paths in the volume, free ports), every pod started at once."""
    models = save_tiny_models(tmp_path_factory.mktemp("models-volume"))
    workdir = tmp_path_factory.mktemp("pods")
    docs = render_on_free_ports(tools, *RELEASES[request.param])
    running = Cluster(docs, workdir, volumes={"models": models}, release=request.param)
    try:
        running.start()
        wait_ready(running, STARTUP_TIMEOUT_S)
        yield running
    finally:
        running.stop()


def _has_drafter(cluster: Cluster) -> bool:
    return "drafter.enabled=false" not in RELEASES[cluster.release]


def test_rendered_pods_run_as_the_chart_says(cluster: Cluster) -> None:
    """What the kubelet would run: the image's specdec with the chart's flags, no init container."""
    engines = ["drafter", "verifier"] if _has_drafter(cluster) else ["verifier"]
    assert sorted(pod.component for pod in cluster.pods) == sorted(["orchestrator", *engines])
    for deployment in cluster.deployments:
        assert "initContainers" not in pod_spec(deployment)  # models are paths: nothing to install
    orchestrator = next(pod for pod in cluster.pods if pod.component == "orchestrator")
    if _has_drafter(cluster):
        drafter = pod_spec(component(cluster.docs, "Deployment", "drafter"))["containers"][0]
        drafter_port = arg_value(drafter["args"], "--port")
        assert arg_value(orchestrator.argv, "--drafter") == f"127.0.0.1:{drafter_port}"
        assert orchestrator.env["SPECDEC_DRAFT_SOURCE"] == "hybrid"
    else:
        assert arg_value(orchestrator.argv, "--drafter") == "none"
        assert orchestrator.env["SPECDEC_DRAFT_SOURCE"] == "lookup"
        # The orchestrator says so once it serves (right after its health turns SERVING).
        deadline = time.monotonic() + 30
        while "without a drafter (--drafter none): draft source lookup" not in orchestrator.log(100_000):
            assert time.monotonic() < deadline, orchestrator.log()
            time.sleep(0.2)
    assert orchestrator.env["HF_HUB_OFFLINE"] == "1"
    assert orchestrator.env["OTEL_RESOURCE_ATTRIBUTES"].startswith(
        f"k8s.namespace.name=specdec,k8s.pod.name={orchestrator.name},")
    assert Path(orchestrator.env["HOME"]).is_dir()  # the /tmp emptyDir, not the read-only image


def test_generate_through_the_orchestrator_service(cluster: Cluster) -> None:
    sample = generate_grpc(cluster)
    assert sample["text"].strip() and len(sample["token_ids"]) >= 1


def test_http_api_and_metrics_through_their_service_ports(cluster: Cluster) -> None:
    assert isinstance(complete_http(cluster), str)
    for role in sorted({pod.component for pod in cluster.pods}):
        assert "# TYPE" in scrape(cluster, role)
