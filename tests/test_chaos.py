"""The chaos suite (`python -m loadtest.chaos`) against its own cluster of real processes (tiny
model): kill -9 mid-stream and mid-prefill, a disconnect storm, Redis outage, overload, slowloris,
SIGTERM drain with new arrivals, worker restarts, 500 fuzzed bodies — every target met."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_chaos_suite_meets_its_targets(tmp_path):
    out = subprocess.run([sys.executable, "-m", "loadtest.chaos", "--logs", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.split() and line.split()[0] in ("kill_decode_mid_stream", "kill_prefill_mid_prefill",
                                                    "disconnect_storm", "redis_outage", "overload", "slowloris",
                                                    "sigterm_drain", "fuzz")}
    assert len(rows) == 8, out.stdout
    for name, r in rows.items():
        requests, _ok, _clean, server_errors, hangs, leaked = (int(x) for x in r[1:7])
        assert requests > 0 and server_errors == 0 and hangs == 0 and leaked == 0, (name, r)
    # Killed and drained workers' clients all got their whole answers (failover, retry elsewhere).
    for name in ("kill_decode_mid_stream", "kill_prefill_mid_prefill", "sigterm_drain"):
        assert rows[name][1] == rows[name][2], rows[name]
    assert float(rows["kill_decode_mid_stream"][8]) <= 3.0 and float(rows["sigterm_drain"][8]) <= 3.0
    assert float(rows["disconnect_storm"][7]) <= 1.5
    assert int(rows["overload"][3]) > 0  # the small router refused (503 no_capacity + Retry-After), nothing failed
