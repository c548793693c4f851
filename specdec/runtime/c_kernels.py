"""Building specdec's C kernels: once per machine, with the system's C compiler, into the specdec home.

Each kernel (`attention_kernel.c`, `int8_gemm_kernel.c`, `layer_kernels.c`) is built with
`cc -O3 -march=native -fopenmp` (or one thread without OpenMP) beside the header they share
(`lanes.h`: the 16-lane vectors, the lane-sum tree and the exponential), keyed by its source, that
header, the compiler and the CPU's flags, and called through ctypes, which lets go of the GIL for
the call; its OpenMP threads are torch's (one runtime in the process).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from specdec.defaults import specdec_home
from specdec.runtime.cpuinfo import cpuinfo_field

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11")
HEADERS = ("lanes.h",)  # included by the sources: copied beside each build, part of its key
OPENMP = "-fopenmp"  # work split over torch's threads (its OpenMP runtime); without it, one thread


class KernelUnavailable(RuntimeError):
    """A C kernel cannot be built or loaded on this machine (the message says why)."""


def compiler() -> Path:
    """The C compiler: $CC, else cc, else gcc (resolved; KernelUnavailable where there is none)."""
    named = os.environ.get("CC")
    found = shutil.which(named) if named else (shutil.which("cc") or shutil.which("gcc"))
    if not found:
        raise KernelUnavailable(f"no C compiler found ({'CC=' + named if named else 'cc, gcc'}): "
                                "install gcc, or set CC")
    return Path(found).resolve()


def cpu_flags() -> str:
    """This CPU's feature flags (what -march=native compiles for), else its architecture."""
    return cpuinfo_field("flags") or platform.machine()


def _build(cc: Path, source_name: str, source: bytes, library: Path, headers: dict[str, bytes]) -> None:
    """Compile `source` (beside `headers`) into `library` (atomically: a concurrent start sees all
    of it or none)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        source_path = Path(scratch) / source_name
        source_path.write_bytes(source)
        for name, text in headers.items():
            (Path(scratch) / name).write_bytes(text)
        built = Path(scratch) / library.name
        errors = []
        for flags in ((*FLAGS, OPENMP), FLAGS):  # a compiler without OpenMP (clang without libomp)
            try:
                result = subprocess.run([str(cc), *flags, str(source_path), "-o", str(built)],
                                        capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as error:
                raise KernelUnavailable(f"the C compiler {cc} does not run: {error}") from error
            if result.returncode == 0:
                break
            errors.append(result.stderr.strip()[-1000:])
        else:
            raise KernelUnavailable(f"{cc} could not build {source_name}: {errors[-1]}")
        if errors:
            log.warning("%s was built without OpenMP (one thread): %s", source_name, errors[0])
        os.replace(built, library)
    log.info("built %s: %s", source_name, library)


def compiled(source_name: str, stem: str) -> ctypes.CDLL:
    """specdec.runtime's C source `source_name`, built on first use (~0.2 s) into <specdec
    home>/kernels (or the temp directory where the home is not writable) as `<stem>-<key>.so`, and
    loaded; else KernelUnavailable saying why."""
    package = resources.files("specdec.runtime")
    source = package.joinpath(source_name).read_bytes()
    headers = {name: package.joinpath(name).read_bytes() for name in HEADERS}
    cc = compiler()
    stamp = cc.stat()  # the compiler's identity without running it (a start runs no process)
    identity = f"{cc} {stamp.st_size} {stamp.st_mtime_ns} {' '.join(FLAGS)} {OPENMP}"
    key = hashlib.sha256(b"\0".join([source, *headers.values(), identity.encode(),
                                      cpu_flags().encode()])).hexdigest()[:16]
    name = f"{stem}-{key}.so"
    places = [specdec_home() / "kernels", Path(tempfile.gettempdir()) / f"specdec-kernels-{os.getuid()}"]
    library = next((place / name for place in places if (place / name).exists()), None)
    for place in places if library is None else []:
        try:
            _build(cc, source_name, source, place / name, headers)
        except OSError as error:  # not writable: the next place
            log.info("cannot build %s in %s: %s", source_name, place, error)
            continue
        library = place / name
        break
    if library is None:
        raise KernelUnavailable(f"no writable directory to build {source_name} in: "
                                + ", ".join(map(str, places)))
    try:
        return ctypes.CDLL(str(library))
    except OSError as error:
        raise KernelUnavailable(f"could not load {library}: {error}") from error
