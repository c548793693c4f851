"""The container image (deploy/Containerfile).

Always: the file itself is checked (non-root user that matches the chart, HF_HUB_OFFLINE, the
specdec entry point, the CUDA / CPU torch switch, COPY sources that exist, no model baked in).

Opt-in, since CI must never depend on a container build (no registry is reachable here: the base
image has to be made locally, docs/kubernetes.md "The image"):
  SPECDEC_IMAGE_BUILD=1   build the image with podman (extra `podman build` arguments in
                          SPECDEC_IMAGE_BUILD_ARGS, e.g. --build-arg BASE_IMAGE=localhost/base)
  SPECDEC_IMAGE=TAG       run the chart's default pods as containers of TAG (the built one when
                          SPECDEC_IMAGE_BUILD=1), probes SERVING, then generate through them
  SPECDEC_PODMAN_ARGS     extra `podman run` arguments (e.g. --runtime runc --ulimit nofile=1024:1024)
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from .pods import (
    CONTAINERFILE,
    Cluster,
    complete_http,
    generate_grpc,
    image_env,
    render_on_free_ports,
    save_tiny_models,
    wait_ready,
)
from .tools import CHART, ROOT, Tools

BUILD_TAG = "localhost/specdec:test"
BUILD_TIMEOUT_S = 1800


def instructions(path: Path = CONTAINERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Containerfile, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    result = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def chart_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def test_runs_as_the_chart_user_not_root() -> None:
    users = [rest for keyword, rest in final_stage() if keyword == "USER"]
    assert users, "the image must set a USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root USER (runAsNonRoot needs a numeric uid)"
    security = chart_values()["podSecurityContext"]
    assert (int(uid), int(gid or uid)) == (security["runAsUser"], security["runAsGroup"])


def test_environment_is_offline_and_points_at_the_model_volume() -> None:
    env = image_env()
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["SPECDEC_HOME"] == chart_values()["models"]["mountPath"]
    from specdec.cli.processes import CHILD_ENV_DEFAULTS  # the pods' processes get what `up` gives

    assert env["MALLOC_ARENA_MAX"] == CHILD_ENV_DEFAULTS["MALLOC_ARENA_MAX"]


def test_entrypoint_is_specdec_and_the_chart_ports_are_exposed() -> None:
    stage = final_stage()
    (entrypoint,) = [rest for keyword, rest in stage if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["specdec"]
    assert 'specdec = "specdec.cli:app"' in (ROOT / "pyproject.toml").read_text()
    exposed = {int(port) for keyword, rest in stage if keyword == "EXPOSE" for port in rest.split()}
    values = chart_values()
    assert exposed >= {values["orchestrator"]["port"], values["drafter"]["port"], values["verifier"]["port"],
                       values["orchestrator"]["http"]["port"]}


def test_the_running_image_has_a_c_compiler_for_the_attention_kernel() -> None:
    """The int8 attention kernel is built for the node's CPU at first start (not in the build
    stage, whose CPU may be another), so the final stage installs gcc before dropping root."""
    stage = final_stage()
    installs = [i for i, (keyword, rest) in enumerate(stage)
                if keyword == "RUN" and re.search(r"apt-get install\b.*\bgcc\b", rest)]
    user = max(i for i, (keyword, _) in enumerate(stage) if keyword == "USER")
    assert installs and installs[0] < user
    import tomllib

    from specdec.runtime.c_kernels import HEADERS
    from specdec.runtime.fixed_attention import SOURCE

    # the sources and the header they include ship in the package
    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert {"*.c", "*.h"} <= set(shipped["specdec.runtime"])
    assert all((ROOT / "specdec" / "runtime" / name).exists() for name in (SOURCE, *HEADERS))


def test_every_copy_source_exists_and_no_model_is_baked_in() -> None:
    for keyword, rest in instructions():
        if keyword == "COPY" and "--from=" not in rest:
            *sources, _destination = shlex.split(rest)
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                assert source not in ("tests", "bench", "models", "."), f"COPY {source}: not for the image"
        if keyword == "RUN":
            assert "models install" not in rest, "models are installed at deploy time, not baked in"


@pytest.mark.parametrize(("variant", "index"), [
    ("cpu", "https://download.pytorch.org/whl/cpu"),
    ("cu128", "https://download.pytorch.org/whl/cu128"),
    ("pypi", "https://pypi.org/simple"),
])
def test_torch_variant_picks_the_index(tmp_path: Path, variant: str, index: str) -> None:
    """The build's torch step, run by sh with pip replaced by echo: the index each variant uses."""
    (step,) = [rest for keyword, rest in instructions() if keyword == "RUN" and "TORCH_VARIANT" in rest]
    build_args = [rest for keyword, rest in instructions() if keyword == "ARG"]
    assert "TORCH_VARIANT=cpu" in build_args, "the CPU torch is the default"
    env = {"PATH": os.environ.get("PATH", ""), "TORCH_VARIANT": variant, "TORCH_VERSION": "2.13.0",
           "TORCH_INDEX_URL": ""}
    done = subprocess.run(["sh", "-c", step.replace("pip install", "echo pip install")], env=env,
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert f"--index-url {index} " in done.stdout and "torch==2.13.0" in done.stdout
    bad = subprocess.run(["sh", "-c", step.replace("pip install", "echo pip install")],
                         env={**env, "TORCH_VARIANT": "cuda"}, capture_output=True, text=True, timeout=30,
                         check=False)
    assert bad.returncode != 0 and "TORCH_VARIANT=cuda" in bad.stderr


# ------------------------------------------------------------------------------ opt-in: podman


@pytest.fixture(scope="module")
def image() -> str:
    if os.environ.get("SPECDEC_IMAGE_BUILD") == "1":
        if shutil.which("podman") is None:
            pytest.fail("SPECDEC_IMAGE_BUILD=1 but podman is not installed")
        argv = ["podman", "build", "-f", str(CONTAINERFILE), "-t", BUILD_TAG,
                *shlex.split(os.environ.get("SPECDEC_IMAGE_BUILD_ARGS", "")), str(ROOT)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        assert done.returncode == 0, f"{shlex.join(argv)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return BUILD_TAG
    if tag := os.environ.get("SPECDEC_IMAGE"):
        return tag
    pytest.skip("opt-in: SPECDEC_IMAGE_BUILD=1 (build with podman) or SPECDEC_IMAGE=TAG (an image built "
                "from deploy/Containerfile)")


def test_image_user_and_environment(image: str) -> None:
    argv = ["podman", "run", "--rm", *shlex.split(os.environ.get("SPECDEC_PODMAN_ARGS", "")),
            "--entrypoint", "sh", image, "-c",
            'id -u; echo "$HF_HUB_OFFLINE"; specdec --help >/dev/null && echo ok']
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(chart_values()["podSecurityContext"]["runAsUser"]), "1", "ok"]


@pytest.fixture(scope="module")
def containers(image: str, tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    models = save_tiny_models(tmp_path_factory.mktemp("models-volume"))
    for path in [models, *models.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)  # the image's user reads and may write
    running = Cluster(render_on_free_ports(tools), tmp_path_factory.mktemp("containers"),
                      volumes={"models": models}, image=image,
                      podman_args=shlex.split(os.environ.get("SPECDEC_PODMAN_ARGS", "")))
    try:
        running.start()
        wait_ready(running, 300.0)
        yield running
    finally:
        running.stop()


@pytest.mark.timeout(900)
def test_pods_as_containers_generate(containers: Cluster) -> None:
    for pod in containers.pods:
        assert "--read-only" in pod.argv and "--cap-drop" in pod.argv
    assert generate_grpc(containers)["text"].strip()
    assert isinstance(complete_http(containers), str)
