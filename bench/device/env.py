"""Step "env": what the machine is and holds, read before anything is measured on it.

Python, torch and its CUDA build, the GPU (name, memory, driver), the versions of the packages the
services use, and whether the serving path imports with only what is installed (the image lacks
OpenTelemetry, Redis, FastAPI; the carried wheels add gRPC health/reflection and pydantic). On
CUDA also the two ceilings of docs/gpu.md: a bf16 matrix product's rate and a device copy's bandwidth.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys
import time

from bench.device.common import StepArgs, StepResult, run_step, table

PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "pydantic",
    "pydantic-settings",
    "numpy",
    "scipy",
    "typer",
    "rich",
    "prometheus-client",
    "pytest",
    "pytest-asyncio",
    "pytest-timeout",
    "opentelemetry-sdk",
    "redis",
    "fastapi",
)
SERVING = (
    "drafter_service.server",
    "verifier_service.server",
    "orchestrator.speculation",
    "orchestrator.clients.grpc_client",
    "specdec.cli.serve",
)
OPTIONAL = ("opentelemetry", "redis", "fastapi", "uvicorn", "pydantic")


def version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def ceilings() -> dict[str, float]:
    """bf16 matmul TFLOP/s and device-to-device copy GB/s (read + written), medians of a few runs."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(1 << 28, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    out = {}
    for label, run, work in (
        ("bf16_matmul_tflops", lambda: a @ b, 2 * 8192**3 / 1e12),
        ("copy_gb_per_s", lambda: dst.copy_(src), 2 * src.numel() * 4 / 1e9),
    ):
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[label] = work / sorted(times)[len(times) // 2]
    return out


def step(args: StepArgs) -> StepResult:
    import torch

    data: dict = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_threads": torch.get_num_threads(),
        "packages": {name: version(name) for name in PACKAGES},
    }
    findings = []
    if args.cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {args.device} but torch {torch.__version__} sees no CUDA device")
        props = torch.cuda.get_device_properties(0)
        data.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
        )
        data.update(ceilings())
        findings.append(
            f"{props.name}: bf16 matmul {data['bf16_matmul_tflops']:.0f} TFLOP/s, "
            f"copy {data['copy_gb_per_s']:.0f} GB/s"
        )
    imports = {}
    for module in SERVING:
        try:
            importlib.import_module(module)
            imports[module] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported: the steps that need it will fail too
            imports[module] = f"{type(exc).__name__}: {exc}"
            findings.append(f"FAIL import {module}: {exc}")
    data["serving_imports"] = imports
    data["optional_loaded"] = [name for name in OPTIONAL if name in sys.modules]
    rows = [
        ["python", data["python"]],
        ["platform", data["platform"]],
        ["torch", f"{data['torch']} (CUDA {data['torch_cuda']}, available: {data['cuda_available']})"],
    ]
    if args.cuda:
        rows += [
            [
                "GPU",
                f"{data['gpu']}, {data['gpu_memory_gib']} GiB, {data['multiprocessors']} SMs, "
                f"sm_{data['capability'].replace('.', '')}",
            ],
            ["bf16 matmul 8192³", f"{data['bf16_matmul_tflops']:.0f} TFLOP/s"],
            ["device copy 1 GiB", f"{data['copy_gb_per_s']:.0f} GB/s (read + written)"],
        ]
    rows += [[f"package {name}", v] for name, v in data["packages"].items()]
    rows += [[f"import {module}", status] for module, status in imports.items()]
    rows.append(["optional packages the serving path loaded", ", ".join(data["optional_loaded"]) or "none"])
    data["verdict"] = "fail" if any(s != "ok" for s in imports.values()) else "pass"
    return StepResult(table(["what", "value"], rows), data, findings)


if __name__ == "__main__":
    sys.exit(run_step(step, description=__doc__))
