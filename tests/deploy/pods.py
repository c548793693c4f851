"""Run a rendered release's pods as local processes, the way the kubelet would run their containers.

Each Deployment's (first) container becomes one process: its command and args, its env (with
$(VAR) expanded as Kubernetes does, fieldRefs filled in), the image's ENV underneath (read from
deploy/Containerfile). What a cluster provides is simulated, and nothing else:
- volumes: every mountPath becomes a folder of the test (the models volume the caller's folder);
- Services: a Service's name and port, wherever they appear in args or env, become 127.0.0.1 and
  the container port its targetPort names (a kube-proxy of one node);
- the listen host 0.0.0.0 becomes 127.0.0.1 (nothing is exposed beyond this machine);
- the image's `specdec` is this checkout's `python -m specdec.cli`.

With `image=` the pods run as containers of that image instead (podman, host network, the pod's
user, read-only root file system and dropped capabilities as its securityContext says): the
same check against a built image (tests/deploy/test_image.py, opt-in).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.cli.processes import check_health

from .tools import ROOT, Tools, component, pod_labels, pod_spec, render, selects

CONTAINERFILE = ROOT / "deploy" / "Containerfile"
NAMESPACE = "specdec"
LOOPBACK = "127.0.0.1"
TINY_CONTEXT = 1024
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def image_env(containerfile: Path = CONTAINERFILE) -> dict[str, str]:
    """The ENV of the Containerfile's last stage (what every container starts with)."""
    text = re.sub(r"\\\n", " ", containerfile.read_text())
    stages = re.split(r"^FROM\s", text, flags=re.MULTILINE)
    env: dict[str, str] = {}
    for line in stages[-1].splitlines():
        if line.startswith("ENV "):
            for item in shlex.split(line[4:]):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, others kept, $$ is a literal $."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR.sub(one, text)


@dataclass
class Pod:
    name: str
    component: str
    argv: list[str]
    env: dict[str, str]
    probe_ports: dict[str, int]  # probe name → the port it checks
    probe_kinds: dict[str, str]  # probe name → grpc | tcpSocket
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    log_handle: Any = field(default=None, repr=False)

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Cluster:
    """The Deployments of a render, as processes on loopback; stop() always ends them all."""

    def __init__(self, docs: list[dict[str, Any]], workdir: Path, volumes: dict[str, Path],
                 image: str | None = None, podman_args: list[str] | None = None,
                 release: str = "default") -> None:
        self.docs = docs
        self.release = release  # which values the test rendered (a name of its own, for its checks)
        self.image = image  # None: local processes; else containers of this image (podman)
        self.podman_args = podman_args or []
        self.workdir = workdir
        self.volumes = volumes  # volume name → local folder (others get a fresh folder per pod)
        self.deployments = [d for d in docs if d["kind"] == "Deployment"]
        self.services = [d for d in docs if d["kind"] == "Service"]
        self.pods: list[Pod] = []

    # -------------------------------------------------------------------------------- addresses
    def _container_port(self, service: dict[str, Any], target: Any) -> int:
        """The container port a Service's targetPort means (a number, or a port name)."""
        if isinstance(target, int):
            return target
        for deployment in self.deployments:
            if selects(service["spec"]["selector"], pod_labels(deployment)):
                for container in pod_spec(deployment)["containers"]:
                    for port in container.get("ports", []):
                        if port.get("name") == target:
                            return int(port["containerPort"])
        raise AssertionError(f"Service {service['metadata']['name']}: no pod has a port named {target}")

    def service_address(self, name: str, port_name: str) -> str:
        """Where a client on this machine reaches Service `name`'s port `port_name`."""
        service = next(s for s in self.services if s["metadata"]["name"] == name)
        port = next(p for p in service["spec"]["ports"] if p["name"] == port_name)
        return f"{LOOPBACK}:{self._container_port(service, port.get('targetPort', port['port']))}"

    def _rewrite_hosts(self, text: str) -> str:
        for service in self.services:
            name = service["metadata"]["name"]
            for port in service["spec"]["ports"]:
                local = self._container_port(service, port.get("targetPort", port["port"]))
                for host in (f"{name}.{NAMESPACE}.svc.cluster.local", f"{name}.{NAMESPACE}.svc",
                             f"{name}.{NAMESPACE}", name):
                    pattern = rf"(?<![\w.-]){re.escape(host)}:{port['port']}(?!\d)"
                    text = re.sub(pattern, f"{LOOPBACK}:{local}", text)
        return text

    # ------------------------------------------------------------------------------------ pods
    def _write_secret(self, spec: dict[str, Any], volume_name: str, local: Path) -> None:
        """A Secret volume whose Secret the chart itself renders (the engine token) becomes its files,
        as the kubelet would mount them: owner-only for local processes; readable by the container's
        user (another uid, as fsGroup would allow) for podman."""
        volume = next((v for v in spec.get("volumes", []) if v["name"] == volume_name), {})
        name = volume.get("secret", {}).get("secretName")
        secret = next((d for d in self.docs if d["kind"] == "Secret" and d["metadata"]["name"] == name), None)
        if secret is None:
            return
        for key, value in (secret.get("data") or {}).items():
            path = local / key
            path.write_bytes(base64.b64decode(value))
            path.chmod(0o600 if self.image is None else 0o644)

    def _pod(self, deployment: dict[str, Any]) -> Pod:
        spec = pod_spec(deployment)
        (container,) = spec["containers"]
        name = f"{deployment['metadata']['name']}-0"
        root = self.workdir / name
        paths: dict[str, Path] = {}
        for mount in container.get("volumeMounts", []):
            local = self.volumes.get(mount["name"]) or root / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            self._write_secret(spec, mount["name"], local)
            paths[mount["mountPath"]] = local

        # One pass over all mount paths, longest first (/tmp/x before /tmp), so that a replacement
        # (itself under /tmp) is never rewritten again.
        longest_first = sorted(paths, key=len, reverse=True)
        alternatives = "|".join(re.escape(path) for path in longest_first)
        mounts = re.compile(f"(?<![\\w/])({alternatives})(?=/|$|[^\\w])") if paths else None

        def localize(text: str) -> str:
            if mounts is not None and self.image is None:
                text = mounts.sub(lambda match: str(paths[match.group(1)]), text)
            text = self._rewrite_hosts(text)
            return LOOPBACK if text == "0.0.0.0" else text

        env: dict[str, str] = {}
        if self.image is None:  # a container starts with its image's ENV
            env = {key: localize(value) for key, value in image_env().items() if key != "PATH"}
        fields = {"metadata.name": name, "metadata.namespace": NAMESPACE, "spec.nodeName": "node-0",
                  "status.podIP": LOOPBACK}
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = localize(expand(item["value"], env))
            elif "fieldRef" in item.get("valueFrom", {}):
                env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                raise AssertionError(f"{name}: env {item['name']} needs a Secret or ConfigMap: {item}")
        command = [expand(part, env) for part in container.get("command", [])]
        args = [localize(expand(part, env)) for part in container.get("args", [])]
        assert command == ["specdec"], f"{name}: expected the image's specdec command, got {command}"
        env.update(NO_COLOR="1", COLUMNS="200", TERM="dumb")
        if self.image is None:
            env.update(PATH=os.environ.get("PATH", ""), PYTHONPATH=str(ROOT))
            argv = [sys.executable, "-m", "specdec.cli", *args]
        else:
            argv = self._podman_argv(name, spec, container, paths, env, args)
            env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/root")}
        probes = {key: container[key] for key in ("startupProbe", "readinessProbe", "livenessProbe")
                  if key in container}
        return Pod(name=name, component=pod_labels(deployment)["app.kubernetes.io/component"],
                   argv=argv, env=env,
                   probe_ports={k: int((p.get("grpc") or p["tcpSocket"])["port"]) for k, p in probes.items()},
                   probe_kinds={k: "grpc" if "grpc" in p else "tcpSocket" for k, p in probes.items()},
                   log_path=root / "log.txt")

    def _podman_argv(self, name: str, spec: dict[str, Any], container: dict[str, Any], paths: dict[str, Path],
                     env: dict[str, str], args: list[str]) -> list[str]:
        """`podman run` of one container as the pod spec says (user, file system, capabilities)."""
        pod_context = spec.get("securityContext", {})
        context = {**pod_context, **container.get("securityContext", {})}
        argv = ["podman", "run", "--rm", "--name", name, "--network", "host", "--entrypoint", "specdec",
                "--security-opt", "no-new-privileges", *self.podman_args]
        if "runAsUser" in context:
            argv += ["--user", f"{context['runAsUser']}:{context.get('runAsGroup', context['runAsUser'])}"]
        if context.get("readOnlyRootFilesystem"):
            argv.append("--read-only")
        for capability in context.get("capabilities", {}).get("drop", []):
            argv += ["--cap-drop", capability]
        for mount_path, local in paths.items():
            local.chmod(0o777)  # the container's user is not this one: as fsGroup would allow
            argv += ["-v", f"{local}:{mount_path}"]
        for key, value in env.items():
            argv += ["-e", f"{key}={value}"]
        return [*argv, self.image, *args]

    def start(self) -> None:
        """Start every pod at once (like a fresh install: no ordering between them)."""
        for deployment in self.deployments:
            pod = self._pod(deployment)
            pod.log_handle = open(pod.log_path, "wb")  # noqa: SIM115 - closed in stop()
            pod.process = subprocess.Popen(pod.argv, env=pod.env, cwd=self.workdir, stdin=subprocess.DEVNULL,
                                           stdout=pod.log_handle, stderr=subprocess.STDOUT,
                                           start_new_session=True)
            self.pods.append(pod)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every pod, then SIGKILL what is left after `grace_s` (bounded)."""
        for pod in self.pods:
            if pod.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pod.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for pod in self.pods:
            if pod.process is None:
                continue
            try:
                pod.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pod.process.pid, signal.SIGKILL)
                pod.process.wait(timeout=10)
            if self.image is not None:  # a killed `podman run` may leave its container behind
                subprocess.run(["podman", "rm", "--force", "--time", "0", pod.name], capture_output=True,
                               timeout=60, check=False)
            if pod.log_handle is not None:
                pod.log_handle.close()

    def logs(self) -> str:
        return "\n".join(f"----- {pod.name} ({shlex.join(pod.argv)}):\n{pod.log()}" for pod in self.pods)


# ------------------------------------------------------------------------- running a release


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on loopback now (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def probe_answers(pod: Pod, probe: str) -> bool:
    """One probe as the kubelet runs it: gRPC health SERVING, or the TCP port accepting."""
    address = f"127.0.0.1:{pod.probe_ports[probe]}"
    if pod.probe_kinds[probe] == "grpc":
        try:
            return check_health(address, timeout=1.0) == "SERVING"
        except Exception:  # noqa: BLE001 - not listening yet, or not healthy yet
            return False
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", pod.probe_ports[probe])) == 0


def wait_ready(cluster: Cluster, timeout_s: float) -> None:
    """Until every pod's startup, readiness and liveness probes pass (bounded; fails early when a
    pod exits, with every pod's log)."""
    deadline = time.monotonic() + timeout_s
    pending = {(pod.name, probe): pod for pod in cluster.pods for probe in pod.probe_ports}
    while pending:
        for (name, probe), pod in list(pending.items()):
            if not pod.alive():
                raise AssertionError(f"pod {name} exited with {pod.process.returncode}:\n{cluster.logs()}")
            if probe_answers(pod, probe):
                del pending[(name, probe)]
        if pending and time.monotonic() > deadline:
            raise AssertionError(f"probes still failing after {timeout_s:.0f}s: {sorted(pending)}\n"
                                 f"{cluster.logs()}")
        time.sleep(0.5)


def render_on_free_ports(tools: Tools, *sets: str) -> list[dict[str, Any]]:
    """The default values, but the models given as paths in the volume (/models/draft and
    /models/target: tiny_models) and every port one that is free on this machine; `sets` are
    more --set values (e.g. drafter.enabled=false)."""
    grpc0, http0, metrics0, grpc1, metrics1, grpc2, metrics2 = free_ports(7)
    return render(tools, sets=[
        "drafter.model=/models/draft", "verifier.model=/models/target",
        f"orchestrator.port={grpc0}", f"orchestrator.http.port={http0}",
        f"orchestrator.metricsPort={metrics0}",
        f"drafter.port={grpc1}", f"drafter.metricsPort={metrics1}",
        f"verifier.port={grpc2}", f"verifier.metricsPort={metrics2}",
        *sets,
    ])


def save_tiny_models(root: Path) -> Path:
    """The content of the models volume: two tiny random models sharing a vocabulary of 8."""
    from specdec.runtime.tiny import save_tiny_model

    save_tiny_model(root / "draft", vocab_size=8, seed=1, max_position_embeddings=TINY_CONTEXT)
    save_tiny_model(root / "target", vocab_size=8, seed=2, max_position_embeddings=TINY_CONTEXT)
    return root


def generate_grpc(cluster: Cluster, prompt: str = "t1 t2") -> dict[str, Any]:
    """`specdec generate` (this checkout's CLI, as a user would run it) through the orchestrator's
    Service gRPC port; the one sample's JSON."""
    name = component(cluster.docs, "Service", "orchestrator")["metadata"]["name"]
    address = cluster.service_address(name, "grpc")
    argv = [sys.executable, "-m", "specdec.cli", "generate", "--address", address, prompt,
            "--max-new-tokens", "4", "--seed", "7", "--json"]
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "NO_COLOR": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          stdin=subprocess.DEVNULL, env=env)
    assert done.returncode == 0, f"{done.stderr}\n{cluster.logs()}"
    (sample,) = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return sample


def http_json(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:  # noqa: S310 - loopback only
        return reply.status, json.loads(reply.read() or b"null")


def complete_http(cluster: Cluster, prompt: str = "t1 t2") -> str:
    """A completion through the orchestrator's Service HTTP port (the model id from /v1/models).

    ignore_eos: a first token that is the tiny model's EOS (about one request in ten) would end it
    with no text. The check is on the token count, not the text: four sampled tokens of the tiny
    random model can all decode to nothing (special or whitespace tokens), as one CI run found."""
    service = component(cluster.docs, "Service", "orchestrator")["metadata"]["name"]
    base = f"http://{cluster.service_address(service, 'http')}"
    status, models = http_json(f"{base}/v1/models")
    assert status == 200
    status, reply = http_json(f"{base}/v1/completions", {"model": models["data"][0]["id"], "prompt": prompt,
                                                         "max_tokens": 4, "ignore_eos": True})
    assert status == 200
    assert reply["usage"]["completion_tokens"] == 4, reply
    assert reply["choices"][0]["finish_reason"] == "length", reply
    return reply["choices"][0]["text"]


def scrape(cluster: Cluster, role: str) -> str:
    """/metrics of a role through its Service's metrics port (what the ServiceMonitor scrapes)."""
    name = component(cluster.docs, "Service", role)["metadata"]["name"]
    with urllib.request.urlopen(f"http://{cluster.service_address(name, 'metrics')}/metrics",  # noqa: S310
                                timeout=30) as reply:
        assert reply.status == 200
        return reply.read().decode()
