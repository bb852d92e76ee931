"""The GPU benchmark harness runs end to end (CPU, tiny shapes) so it is ready when a GPU is."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_bench_gpu_harness_runs_on_cpu(quantization, tiny_model_dir):
    # (the first-token row once: it starts a real worker)
    extra = ["--quantization", quantization] if quantization else ["--first-token", str(tiny_model_dir)]
    out = subprocess.run([sys.executable, "-m", "loadtest.bench_gpu", "--device", "cpu", "--preset", "tiny,tiny-mla",
                          "--batches", "1,2", "--prefill-tokens", "48", "--context", "40", "--iters", "2", *extra],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"; weights {quantization or 'torch.float32'}; KV cache torch.float32" in out.stdout.splitlines()[0]
    for preset in ("tiny", "tiny-mla"):  # a Llama shape, and latent attention + experts
        rows = [line for line in out.stdout.splitlines() if line.split()[:1] == [preset]]
        assert [r.split()[2:5] for r in rows[:4]] == [["decode", "b=1", "eager"], ["decode", "b=1", "graph"],
                                                      ["decode", "b=2", "eager"], ["decode", "b=2", "graph"]]
        assert rows[4].split()[2:4] == ["prefill", "48"]
        assert all(float(r.split()[5]) > 0 for r in rows[:4]) and float(rows[4].split()[4]) > 0
    if not quantization:
        first = next(line for line in out.stdout.splitlines() if line.startswith("first token:"))
        marks = [float(x) for x in re.findall(r"([0-9.]+) s\b", first.split("(weights")[0])]
        assert "engine ready" in first and "first token" in first and marks == sorted(marks) and marks[0] > 0, first
