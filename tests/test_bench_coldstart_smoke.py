"""The cold-start benchmark runs end to end on the tiny model: `serve` becomes ready and answers,
`generate` produces a token, and every phase is reported (no timing assertions)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_coldstart_reports_every_phase(tiny_model_dir, tmp_path):
    import os

    # The weight cache on for the tiny model (its floor is 32 MB): the first start writes it, the later
    # ones map it, and must still answer.
    env = {**os.environ, "SPLITFIRE_WEIGHT_CACHE_MIN_MB": "0", "SPLITFIRE_HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-m", "loadtest.bench_coldstart", "--model", str(tiny_model_dir),
                          "--rounds", "1", "--kv-cache-gb", "0.01", "--threads", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    text = out.stdout
    for mark in ("engine ready", "worker ready", "first token", "first token (exit)", "read weight files, cold",
                 "peak RSS"):
        assert mark in text, text
    serve = text.split("serve, warm page cache")[1].split("serve, cold page cache")[0]
    times = [float(m) for m in re.findall(r"^  (?:engine ready|worker ready|first token)\s+([0-9.]+)$", serve, re.M)]
    assert len(times) >= 3 and times == sorted(times) and times[0] > 0  # phases in order
    mapped = re.findall(r"\(weights mapped from the cache\)\s+(\d)/1", text)
    # written by the first start, mapped by the cold serve and generate; the fourth row turns it off; the
    # collector rows (held / not held through start-up) map it
    assert mapped == ["0", "1", "1", "0", "1", "1"], text
    loads = dict(re.findall(r"^  (direct|staged)\s+([0-9.]+)  = ", text, re.M))
    assert loads.keys() == {"direct", "staged"} and all(float(v) > 0 for v in loads.values()), text
