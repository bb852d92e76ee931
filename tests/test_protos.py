"""The committed generated gRPC code matches `protos/splitfire.proto`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current(tmp_path):
    (tmp_path / "protos").mkdir()
    (tmp_path / "protos" / "splitfire.proto").write_bytes((ROOT / "protos" / "splitfire.proto").read_bytes())
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--grpc_python_out=.",
                    "--pyi_out=.", "protos/splitfire.proto"], cwd=tmp_path, check=True)
    for name in ("splitfire_pb2.py", "splitfire_pb2_grpc.py", "splitfire_pb2.pyi"):
        fresh = (tmp_path / "protos" / name).read_text()
        assert (ROOT / "protos" / name).read_text() == fresh, f"protos/{name} is stale: run `make protos`"
