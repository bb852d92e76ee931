"""The layers' import contracts (`make lint`: pyproject's [tool.importlinter]) catch what they forbid: a copy of
the packages with a violation planted for each contract under test fails exactly those contracts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("splitfire_cli", "loadtest", "router", "prefill_worker", "decode_worker", "planner", "worker", "engine",
            "kvtransfer", "protos", "common")
# contract id -> (file, the planted line): each an import the contract forbids
PLANTED = {
    "router-rooms": ("router/api/errors.py", "import router.app.server"),
    "engine-layers": ("engine/model/layers.py", "import engine.handoff"),
    "common-is-torch-free": ("common/errors.py", "import torch"),
    "router-reaches-workers-through-protos": ("router/core/endpoints.py", "import engine.outputs"),
}


def test_each_contract_fails_on_a_planted_violation(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "results"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for rel, line in PLANTED.values():
        path = tmp_path / rel
        path.write_text(path.read_text() + f"\n{line}  # planted by tests/test_layers.py\n")
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache", "--config", str(tmp_path / "pyproject.toml")], cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode != 0 and "Analyzed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    import tomllib

    names = {c["id"]: c["name"] for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
             ["contracts"]}
    text = " ".join(proc.stdout.split())  # (the report wraps long contract names)
    for cid, name in names.items():  # (a planted upward import may also close a cycle: "acyclic" either way)
        verdict = "BROKEN" if cid in PLANTED else None if cid == "acyclic" else "KEPT"
        if verdict is not None:
            assert f"{' '.join(name.split())} {verdict}" in text, (cid, verdict, proc.stdout[-4000:])
