"""The router benchmark harness runs end to end: fake upstream, router, minimal proxy (floor), the same
proxy on a bare asyncio server, and the paced upstream, each row with real numbers."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_router_harness_prints_router_and_floor_rows(tmp_path):
    out = subprocess.run([sys.executable, "-m", "loadtest.bench_router", "--duration", "1", "--concurrency", "1,4",
                          "--paced-ms", "1", "--paced-concurrency", "4", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.splitlines() if line.startswith("http")]
    rows = [r for r in lines if "(asyncio" not in r]
    bare = [r for r in lines if "(asyncio" in r]
    # label, concurrency, TTFT direct, TTFT routed, added, req/s direct, req/s routed, CPU, floor
    assert [(" ".join(r[:-8]), r[-8]) for r in rows] == [("http", "1"), ("http", "4"), ("http 1ms", "4")]
    for r in rows:
        req_s_direct, req_s_routed, cpu, floor = (float(x) for x in r[-4:])
        assert req_s_direct > 0 and req_s_routed > 0, r
        assert 0 < cpu < 1 and 0 < floor < 1 and math.isfinite(cpu), r  # CPU s per 1000 chunks, both measured
    # the bare-server floor: a row after each, its own TTFT, throughput and CPU (no floor column)
    assert [(" ".join(r[:-8]), r[-8]) for r in bare] == [("http (asyncio floor)", "1"), ("http (asyncio floor)", "4"),
                                                         ("http 1ms (asyncio floor)", "4")]
    for r in bare:
        ttft, req_s, cpu = float(r[-6]), float(r[-3]), float(r[-2])
        assert ttft > 0 and req_s > 0 and 0 < cpu < 1 and r[-1] == "-", r
