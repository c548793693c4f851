"""The checked-in generated code is exactly what the .proto files compile to, and it imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from proto import generate

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    fresh = generate.generate(out_root=tmp_path)
    checked_in = generate.generated_files(ROOT)
    names = sorted(p.name for p in fresh)
    assert names == sorted(p.name for p in checked_in), (
        "generated file set differs: run `python -m proto.generate`"
    )
    assert len(names) == 3 * len(generate.proto_files(ROOT)) == 12
    stale = [p.name for p in fresh if p.read_bytes() != (ROOT / generate.PROTO_DIR / p.name).read_bytes()]
    assert not stale, f"generated code drifted from the .proto files: {stale}; run `python -m proto.generate`"


def test_generated_modules_import_from_a_checkout(tmp_path: Path) -> None:
    """With only the repository root on sys.path (cwd elsewhere) every generated module imports."""
    code = (
        "import proto.specdec.v1.common_pb2, proto.specdec.v1.drafter_pb2_grpc, "
        "proto.specdec.v1.verifier_pb2_grpc, proto.specdec.v1.generation_pb2_grpc, proto.convert\n"
        "from proto.specdec.v1 import drafter_pb2\n"
        "assert drafter_pb2.DESCRIPTOR.name == 'proto/specdec/v1/drafter.proto'\n"
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
    from proto.specdec.v1 import drafter_pb2, generation_pb2, verifier_pb2

    def rpcs(module, name):
        service = module.DESCRIPTOR.services_by_name[name]
        return {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}

    assert rpcs(drafter_pb2, "DrafterService") == {
        n: (False, False) for n in ("Info", "Draft", "Lookahead", "Release")
    }
    assert rpcs(verifier_pb2, "VerifierService") == {
        n: (False, False) for n in ("Info", "Score", "Verify", "Tokenize", "Decode", "Release")
    }
    assert rpcs(generation_pb2, "GenerationService") == {
        "Generate": (False, False),
        "GenerateStream": (False, True),
    }
