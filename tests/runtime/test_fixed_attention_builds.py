"""Builds of the fixed-order attention kernel with other flags than the runtime's: the vector width
the compiler lowers its 16 lanes to does not change a number. Kept apart from test_fixed_attention.py
because it runs the compiler itself (a slow-tier test), which would move that module's tests too."""

from __future__ import annotations

import ctypes
import platform
import subprocess
from importlib import resources
from pathlib import Path

import pytest
import torch

from specdec.runtime import c_kernels, fixed_attention
from specdec.runtime.fixed_attention import fixed_order_attention, load_kernel

from .test_fixed_attention import causal_mask, tensors


def _build_with(flags: list[str], out: Path) -> ctypes.CDLL:
    """The kernel's source built with other flags than the runtime's (a one-off library)."""
    package = resources.files("specdec.runtime")
    for name in (fixed_attention.SOURCE, *c_kernels.HEADERS):
        (out.parent / name).write_bytes(package.joinpath(name).read_bytes())
    source = out.parent / fixed_attention.SOURCE
    subprocess.run([str(c_kernels.compiler()), *flags, str(source), "-o", str(out)], check=True,
                   capture_output=True, timeout=300)
    library = ctypes.CDLL(str(out))
    library.specdec_fixed_order_attention.argtypes = load_kernel().specdec_fixed_order_attention.argtypes
    return library


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 vector widths")
def test_avx2_and_avx512_builds_compute_the_same_numbers(tmp_path, monkeypatch):
    """The order is written out lane by lane, so the vector width the compiler lowers 16 lanes to
    (two AVX2 registers, or one AVX-512) does not change a result: a fleet's hosts agree."""
    common = ["-O3", "-fPIC", "-shared", "-std=gnu11", "-fopenmp"]
    builds = {"avx2": ["-march=x86-64-v3"], "native": ["-march=native"]}
    if "avx512f" in c_kernels.cpu_flags().split():
        builds["avx512"] = ["-march=x86-64-v4"]
    outputs = {}
    query, key, value = tensors(batch=2, heads=12, kv_heads=2, rows=9, length=75, dim=128, seed=7)
    mask = causal_mask(9, 75, batch=2)
    for name, flags in builds.items():
        library = _build_with(common + flags, tmp_path / f"{name}.so")
        monkeypatch.setattr(fixed_attention, "load_kernel", lambda library=library: library)
        outputs[name] = fixed_order_attention(query, key, value, mask)
    for name, out in outputs.items():
        assert torch.equal(out, outputs["avx2"]), name


def test_the_shared_header_is_built_beside_each_source_and_keys_its_build(tmp_path, monkeypatch):
    """A kernel's source includes lanes.h: the build finds it in its scratch directory, and an
    edited header is a new build (a host never runs a library built from another header)."""
    package = tmp_path / "package"
    package.mkdir()
    for name in ("layer_kernels.c", *c_kernels.HEADERS):
        (package / name).write_bytes(resources.files("specdec.runtime").joinpath(name).read_bytes())
    monkeypatch.setattr(c_kernels.resources, "files", lambda _: package)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    c_kernels.compiled("layer_kernels.c", "probe")
    built = sorted((tmp_path / "home" / "kernels").glob("probe-*.so"))
    assert len(built) == 1
    with open(package / "lanes.h", "a") as header:
        header.write("/* edited */\n")
    assert c_kernels.compiled("layer_kernels.c", "probe").specdec_rms_norm
    assert len(sorted((tmp_path / "home" / "kernels").glob("probe-*.so"))) == 2
