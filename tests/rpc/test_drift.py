"""The checked-in generated code is exactly what the .proto files compile to, and it imports."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _load_generator() -> ModuleType:
    """proto/generate.py is a repo script (no package named proto exists): load it by path."""
    spec = importlib.util.spec_from_file_location("specdec_proto_generate", ROOT / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load_generator()

# What a generator writes about its own version, not about the contract: a newer grpcio-tools (a
# dev dependency, `>=`) stamps its version into the *_pb2_grpc.py files and its protoc's into the
# *_pb2.py ones. The checked-in code keeps the stamps it was made with (the oldest runtime it
# accepts); everything else must match byte for byte.
_VERSION_STAMPS = (
    re.compile(rb"^GRPC_GENERATED_VERSION = '[^']*'$", re.MULTILINE),
    re.compile(rb"^# Protobuf Python Version: .*$", re.MULTILINE),
    re.compile(rb"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,"),
)


def _without_version_stamps(code: bytes) -> bytes:
    for stamp in _VERSION_STAMPS:
        code = stamp.sub(lambda match: match.group(1) if match.groups() else b"<version>", code)
    return code


def test_version_stamps_alone_are_masked() -> None:
    """The mask hides the generator's version and nothing else (a changed field still shows)."""
    grpc_file = ROOT / generate.GENERATED_DIR / "common_pb2_grpc.py"
    pb2_file = ROOT / generate.GENERATED_DIR / "common_pb2.py"
    for path, old, new in ((grpc_file, rb"GRPC_GENERATED_VERSION = '", rb"GRPC_GENERATED_VERSION = '9."),
                           (pb2_file, rb"# Protobuf Python Version: ", rb"# Protobuf Python Version: 9."),
                           (pb2_file, b"Domain.PUBLIC,\n    ", b"Domain.PUBLIC,\n    19")):
        code = path.read_bytes()
        assert old in code
        assert _without_version_stamps(code.replace(old, new, 1)) == _without_version_stamps(code)
    code = pb2_file.read_bytes()
    renamed = code.replace(b"specdec/v1/common.proto", b"specdec/v1/other.proto", 1)
    assert _without_version_stamps(renamed) != _without_version_stamps(code)


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    fresh = generate.generate(out_root=tmp_path)
    checked_in = generate.generated_files(ROOT)
    names = sorted(p.name for p in fresh)
    assert names == sorted(p.name for p in checked_in), (
        "generated file set differs: run `python proto/generate.py`"
    )
    assert len(names) == 3 * len(generate.proto_files(ROOT)) == 12
    stale = [p.name for p in fresh if _without_version_stamps(p.read_bytes())
             != _without_version_stamps((ROOT / generate.GENERATED_DIR / p.name).read_bytes())]
    assert not stale, f"generated code drifted from the .proto files: {stale}; run `python proto/generate.py`"


def test_generated_modules_import_from_a_checkout(tmp_path: Path) -> None:
    """With only the repository root on sys.path (cwd elsewhere) every generated module imports."""
    code = (
        "import specdec.rpc.v1.common_pb2, specdec.rpc.v1.drafter_pb2_grpc, "
        "specdec.rpc.v1.verifier_pb2_grpc, specdec.rpc.v1.generation_pb2_grpc, specdec.rpc.convert\n"
        "from specdec.rpc.v1 import drafter_pb2\n"
        "assert drafter_pb2.DESCRIPTOR.name == 'specdec/v1/drafter.proto'\n"
        "assert drafter_pb2.DESCRIPTOR.package == 'specdec.v1'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr


def test_services_and_rpcs() -> None:
    from specdec.rpc.v1 import drafter_pb2, generation_pb2, verifier_pb2

    def rpcs(module, name):
        service = module.DESCRIPTOR.services_by_name[name]
        return {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}

    assert rpcs(drafter_pb2, "DrafterService") == {
        n: (False, False) for n in ("Info", "Draft", "Lookahead", "DraftRows", "Release")
    }
    assert rpcs(verifier_pb2, "VerifierService") == {
        n: (False, False)
        for n in ("Info", "Score", "Verify", "Tokenize", "ApplyChatTemplate", "Decode", "Release")
    }
    assert rpcs(generation_pb2, "GenerationService") == {
        "Generate": (False, False),
        "GenerateStream": (False, True),
        "Resume": (False, False),
        "ResumeStream": (False, True),
    }


def test_no_top_level_proto_or_bench_module_is_installed(tmp_path: Path) -> None:
    """Outside the checkout, `import proto` / `import bench` must not find this project's code
    (proto-plus owns the top-level name `proto`; bench/ is a repo tool)."""
    code = (
        "import importlib.util, sys\n"
        "for name in ('proto', 'bench'):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    where = str(spec.origin or spec.submodule_search_locations) if spec else ''\n"
        f"    assert not where.startswith({str(ROOT)!r}), (name, where)\n"
        "import specdec.rpc.v1.generation_pb2\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
