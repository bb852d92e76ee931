"""Every Triton kernel compiles for a CUDA GPU (sm_90) on this CPU-only machine, spill-free.

The interpreted tests (test_triton_kernels.py, test_compressed_weight.py) check what the kernels compute;
none of them compiles a kernel, so a kernel could pass them all and fail on its first GPU launch — the
compressed embedding and expert kernels had never been compiled when they were written. Here each launch
the engine's wrappers make (`loadtest/triton_aot.py`: the wrappers called with CPU tensors, the kernels
swapped for recorders) is compiled by `triton.compile` for sm_90 through Triton's own argument binding.
In a subprocess: other test modules put the kernels in interpreter mode at import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.is_file(), reason="this Triton has no bundled ptxas (no NVIDIA backend)")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    return env


def test_every_kernel_launch_compiles_for_sm90_without_spills(tmp_path):
    out = tmp_path / "aot.txt"
    proc = subprocess.run([sys.executable, "-m", "loadtest.triton_aot", "--arch", "90", "--out", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    failed = [line for line in proc.stderr.splitlines() if "FAILED" in line or "Error" in line]
    assert proc.returncode == 0, "\n".join(failed)[-6000:] or proc.stderr[-4000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| _")]
    # every kernel module's kernels, several launch shapes each (capture_all refuses a kernel never launched)
    assert len(rows) >= 40, out.read_text()
    kernels = {row.split()[1] for row in rows}
    for name in ("_gemv_kernel", "_matmul_kernel", "_decompress_kernel", "_rows_kernel", "_grouped_gemm_kernel",
                 "_wo_gemm_kernel", "_mla_decode_kernel", "_decode_attention_kernel", "_prefill_attention_kernel"):
        assert name in kernels
    loops: dict[str, list[int]] = {}  # main-loop instructions by launch label ("kernel [case]")
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert "FAILED" not in row, row
        assert cells[1] == "sm_90" and int(cells[3]) > 0, row
        assert int(cells[4]) == 0, f"registers spilled to local memory: {row}"
        if "_matmul_kernel" in row or "_grouped_gemm" in row:  # (the CUDA path multiplies on tensor cores)
            assert cells[9] == "yes", row
        loops.setdefault(cells[0].split("]")[0] + "]", []).append(int(cells[10]))
    # The fast decode's point, in the compiled code: fewer instructions per main-loop iteration than the
    # select decode, in the row kernel, the tiles and the experts (each kernel's default decode is its case
    # without a suffix; triton_aot adds a case for the other).
    for case in ("_gemv_kernel [compressed 1 rows", "_matmul_kernel [compressed 16 rows",
                 "_grouped_gemm_kernel [MoE compressed experts"):
        fast, select = (loops.get(f"{case}, {d} decode]", loops.get(f"{case}]")) for d in ("fast", "select"))
        assert fast and select and fast is not select, (case, sorted(k for k in loops if k.startswith(case)))
        assert 0 < max(fast) < min(select), (case, fast, select)


_BROKEN = '''
import triton
import triton.language as tl


@triton.jit
def _broken_kernel(x_ptr, n):
    # a runtime bound for arange: the interpreter runs it, the compiler refuses it
    i = tl.arange(0, n)
    tl.store(x_ptr + i, i)
'''


def test_a_kernel_that_does_not_compile_is_reported_by_name(tmp_path):
    """The check fails for a kernel that only the compiler refuses, naming it and the compiler's reason."""
    (tmp_path / "broken_mod.py").write_text(_BROKEN)
    script = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from broken_mod import _broken_kernel\n"
        "from loadtest.triton_aot import Launch, compile_launch\n"
        "r = compile_launch(Launch('toy', 'broken_mod', '_broken_kernel', _broken_kernel,"
        " (torch.zeros(8, dtype=torch.int32), 8), {}), 90)\n"
        "print('OK' if r.ok else 'FAILED ' + r.error)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("FAILED"), proc.stdout
    assert "constexpr" in proc.stdout
