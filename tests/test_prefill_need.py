"""loadtest/prefill_need.py: the fluid need per interval, the hindsight windows and the online rules, by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest.prefill_need import needs, online, windows

ROOT = Path(__file__).resolve().parent.parent


def test_an_intervals_need_is_the_fewest_workers_whose_backlog_stays_within_the_budget():
    # 3 s of work in the first second: 1 worker leaves 2 s queued (over its 1 s budget), 2 workers leave 1 (within 2)
    assert needs([3.0, 0.0, 0.0, 0.0], 1.0, 4, 1.0) == [2]
    # 6 s at the end of an interval: 3 workers (3 s left, within 3 x 1); the next interval inherits those 3 s, which
    # 1 worker would still hold 2 s of after its first second, 2 workers 1 s: 2
    assert needs([0, 0, 0, 6.0, 0, 0, 0, 0], 1.0, 4, 1.0) == [3, 2]
    assert needs([0.0] * 8, 1.0, 4, 1.0) == [1, 1]  # (an idle interval: one worker)


def test_windows_hold_their_most_and_online_rules_only_see_the_past():
    assert windows([3, 2, 1, 1, 5], 2) == 3 * 2 + 1 * 2 + 5
    # decided two intervals ahead from the last one seen, the trace served once before (its last intervals first):
    # the burst at interval 2 is held only at interval 4, too late, and interval 2 is short by 3
    r = online([1, 1, 4, 1, 1, 1], 1, 2)
    assert (r.worker_intervals, r.short_intervals, r.short_workers) == (1 + 1 + 1 + 1 + 4 + 1, 1, 3)
    # looking back far enough holds the burst all along (the earlier pass saw it): never short
    r = online([1, 1, 4, 1, 1, 1], 6, 2)
    assert (r.worker_intervals, r.short_intervals) == (6 * 4, 0)


def test_the_command_reads_a_trace_and_writes_its_needs(tmp_path):
    trace = tmp_path / "t.jsonl"
    # 37,223 tokens/s per worker (the H200 cost model): 60 prompts of 37,223 tokens in one second are ~60 s of work
    rows = [{"timestamp": 30_000, "input_length": 37_223, "output_length": 4} for _ in range(60)]
    rows += [{"timestamp": 150_000, "input_length": 100, "output_length": 4}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "need.json"
    subprocess.run([sys.executable, "-m", "loadtest.prefill_need", "--trace", str(trace), "--ttft-slo", "3",
                    "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=60)
    d = json.loads(out.read_text())
    # a burst of ~60 s of work with a budget of 3 - 1.005 s per prompt: n workers hold (60.3 - n) within n x 1.995
    # -> n >= 20.2: 21 workers in the first minute; the next two minutes are nearly idle (1)
    assert d["need"] == [21, 1, 1] and d["per_interval"] == 23 and d["per_window"] == 21 * 3
    bad = subprocess.run([sys.executable, "-m", "loadtest.prefill_need", "--trace", str(trace), "--ttft-slo", "0.5"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "longer than the TTFT SLO" in bad.stderr
