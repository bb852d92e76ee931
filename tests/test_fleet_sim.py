"""loadtest/fleet_sim.py: the fleet simulation's cache accounting by hand, its invariants on the real
trace, and the planner comparison's output that other tools read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.fleet_sim import COST_MODELS, CostModel, cached_tokens, scaled, simulate
from loadtest.trace_replay import Scale, ideal_cached, read_trace

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "data" / "mooncake_traces" / "conversation_trace.jsonl"
MODEL = COST_MODELS["h200-llama3-8b"]
KW = dict(policy="token", ttft_slo=2.0, itl_slo=0.05)


def write_trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}) + "\n"
                            for t, n, o, h in rows))
    return path


def test_cached_blocks_by_hand(tmp_path):
    # One prefill worker, no eviction: a prompt reuses the leading blocks seen before, at most all but
    # its last (the engine computes at least one token).
    trace = write_trace(tmp_path / "t.jsonl", [(0, 1536, 4, [0, 1, 2]), (1000, 1536, 4, [0, 1, 3]),
                                               (2000, 2048, 4, [0, 1, 2, 4]), (3000, 1024, 4, [5, 6])])
    fleet, s = simulate(read_trace(trace), MODEL, prefill=1, decode=1, layout="disaggregated", store=False, **KW)
    assert [o.cached_blocks for o in fleet.out] == [0, 2, 3, 0]
    assert s["cached_blocks_share"] == pytest.approx(5 / 12)
    assert s["completed"] == 4
    # A prompt's compute shrinks with its hit: the third request's TTFT is under the first's.
    assert fleet.out[2].ttft < fleet.out[0].ttft


def test_a_trace_without_prefix_hashes_shares_nothing(tmp_path):
    # The varying-load traces record no prefix identity: the same prompt length twice is two prompts, every
    # 512-token block its own, so nothing is a cache hit (and nothing breaks for want of hash_ids).
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 4}) + "\n"
                             for t, n in ((0, 1536), (1000, 1536), (2000, 600))))
    reqs = read_trace(trace)
    assert [len(r.hash_ids) for r in reqs] == [3, 3, 2]
    ids = [h for r in reqs for h in r.hash_ids]
    assert len(set(ids)) == len(ids)
    assert not set(ids) & {h for r in read_trace(TRACE, limit=200) for h in r.hash_ids}
    _, s = simulate(reqs, MODEL, prefill=1, decode=1, layout="disaggregated", store=True, **KW)
    assert s["completed"] == 3 and s["cached_blocks_share"] == 0.0


def test_the_store_serves_what_another_prefill_worker_computed(tmp_path):
    rows = [(i * 1000, 2048, 4, [0, 1, 2, i + 10]) for i in range(6)]
    trace = read_trace(write_trace(tmp_path / "t.jsonl", rows))
    kw = dict(prefill=3, decode=1, layout="disaggregated", policy="round_robin", ttft_slo=2.0, itl_slo=0.05)
    _, without = simulate(trace, MODEL, store=False, **kw)
    _, with_store = simulate(trace, MODEL, store=True, **kw)
    # Round robin sends each to another worker: only the store lets the 2nd and 3rd reuse the prefix.
    assert with_store["cached_blocks_share"] > without["cached_blocks_share"]


def test_a_scaled_replay_is_simulated_in_its_own_tokens(tmp_path):
    """`--block 16 --speed 0.5`: the simulated requests are the ones trace_replay sends (its lengths, its
    arrivals), the sim's ideal equals the replay tool's, and a one-worker cache with room reaches it."""
    rows = [(i * 1000, 1536, 96, [0, 1, 2 + i]) for i in range(4)] + [(5000, 700, 3, [0, 9])]
    raw = read_trace(write_trace(tmp_path / "t.jsonl", rows))
    scale = Scale(16, 2, max_output=8)
    reqs = scaled(raw, scale, 0.5)
    assert [r.input_length for r in reqs] == [scale.input_tokens(r) for r in raw] == [48] * 4 + [22]
    assert [r.output_length for r in reqs] == [3, 3, 3, 3, 1] and reqs[1].at_s == 2.0
    measured = {"prefill_tps": 300.0, "decode_step_s": {"1": 0.016, "4": 0.035}, "profiled_context": 448,
                "kv_bytes_per_token": 46080.0, "kv_blocks": 1456, "block_size": 16}
    model = CostModel.from_measured(measured, store_blocks=2912)
    assert model.cache_blocks == 1456 and model.kv_tokens == 1456 * 16 and model.step_s(1, 448) == 0.016
    fleet, _ = simulate(reqs, model, prefill=1, decode=1, layout="disaggregated", store=False, block_tokens=16, **KW)
    got = cached_tokens(fleet)
    assert got["ideal_cached_tokens"] == sum(ideal_cached(raw, scale)) == 2 * 3 * 16 + 16
    assert got["cached_vs_ideal"] == 1.0


needs_trace = pytest.mark.skipif(not TRACE.is_file(), reason="../shared/data/mooncake_traces not present")


@needs_trace
def test_more_decode_workers_never_worsen_inter_token_time():
    reqs = read_trace(TRACE, limit=1500)
    itl = [simulate(reqs, MODEL, prefill=2, decode=d, layout="disaggregated", store=True, **KW)[1]["itl_p90_ms"]
           for d in (1, 2, 4)]
    assert itl[0] >= itl[1] >= itl[2]


@needs_trace
def test_colocated_completes_every_request_and_chunks_stretch_the_tail():
    reqs = read_trace(TRACE, limit=1500)
    _, colo = simulate(reqs, MODEL, prefill=2, decode=0, layout="colocated", store=True, **KW)
    _, disagg = simulate(reqs, MODEL, prefill=1, decode=1, layout="disaggregated", store=True, **KW)
    assert colo["completed"] == disagg["completed"] == 1500
    # A step carrying a 2,048-token prompt chunk is a long gap for every stream in it.
    assert colo["token_itl_p99_ms"] > disagg["token_itl_p99_ms"]


@needs_trace
def test_compare_planner_writes_what_other_tools_read(tmp_path):
    out = tmp_path / "cmp.json"
    subprocess.run([sys.executable, "-m", "loadtest.fleet_sim", "--trace", str(TRACE), "--window", "600",
                    "--compare-planner", "--max-workers", "3", "--interval", "30", "--startup", "30",
                    "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=240)
    d = json.loads(out.read_text())
    for name in ("planner", "best_static", "cpu_hpa"):
        assert 0.0 <= d[name]["slo_attainment"] <= 1.0
        assert d[name]["worker_hours"] > 0
    assert d["best_static"]["split"] in d["statics"]
    # Replicas over time: every entry within the limits.
    assert all(1 <= p <= 3 and 1 <= dd <= 3 for _, p, dd in d["planner"]["replicas"])


@needs_trace
def test_planner_only_runs_the_planner_passes_and_writes_its_decisions(tmp_path):
    out, log = tmp_path / "pl.json", tmp_path / "decisions.txt"
    subprocess.run([sys.executable, "-m", "loadtest.fleet_sim", "--trace", str(TRACE), "--window", "600",
                    "--compare-planner", "--planner-only", "--max-workers", "3", "--interval", "30", "--startup", "30",
                    "--decisions", str(log), "--json", str(out)], cwd=ROOT, check=True, capture_output=True,
                   timeout=240)
    d = json.loads(out.read_text())
    assert set(d) == {"planner", "settings"}  # (no static splits, HPA or clairvoyant)
    assert 0.0 <= d["planner"]["slo_attainment"] <= 1.0 and d["planner"]["first_pass"]["worker_hours"] > 0
    lines = log.read_text().splitlines()
    # one line per interval of the measured pass: its time, the fleet after the decision and why
    assert len(lines) == len(d["planner"]["replicas"]) > 10
    for line, (t, p, dd) in zip(lines, d["planner"]["replicas"], strict=True):
        assert line.split()[0] == f"{t:.0f}" and f"{p}P{dd}D  seen: " in line and "arrived" in line and "predicted" in line
    bad = subprocess.run([sys.executable, "-m", "loadtest.fleet_sim", "--trace", str(TRACE), "--planner-only"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--compare-planner" in bad.stderr


def test_decode_streams_by_hand(tmp_path):
    """Two streams on one decode worker, worked out by hand (the decode heap advances every running stream by one
    counter): A (11 tokens) starts alone at batch 1 (10 ms a step), B (21) joins 6 ms later: batch 2 (20 ms);
    A ends after its last 9.4 tokens at batch 2, B's last 10.6 run at batch 1 again."""
    model = CostModel(prefill_tps=1e6, decode_step_s={1: 0.01, 2: 0.02}, profiled_context=10**6,
                      kv_bytes_per_token=1.0, kv_bandwidth=1.0)
    reqs = read_trace(write_trace(tmp_path / "t.jsonl", [(0, 1000, 11, [1, 2]), (0, 1000, 21, [3, 4])]))
    fleet, _ = simulate(reqs, model, prefill=1, decode=1, layout="disaggregated", store=False, **KW)
    a, b = fleet.out
    assert a.ttft == pytest.approx(0.0062) and b.ttft == pytest.approx(0.0122)
    # (a stream joins its decode worker when its prefill ends — 6 and 12 ms — the transfer counted in its TTFT)
    assert a.done_at == pytest.approx(0.012 + 9.4 * 0.02)
    assert b.done_at == pytest.approx(0.012 + 9.4 * 0.02 + 10.6 * 0.01)
    assert a.itl == pytest.approx((a.done_at - 0.0062) / 10)


def test_copies_of_a_trace_share_its_shape_but_no_prefix(tmp_path):
    from loadtest.fleet_sim import superposed

    reqs = read_trace(write_trace(tmp_path / "t.jsonl", [(0, 1024, 5, [1, 2]), (1000, 512, 5, [1])]))
    three = superposed(reqs, 3, spread_s=60.0)
    assert [r.at_s for r in three] == [0.0, 1.0, 20.0, 21.0, 40.0, 41.0]
    assert len({h for r in three for h in r.hash_ids}) == 2 * 3  # each copy its own blocks
    assert [r.hash_ids for r in three[:2]] == [(1, 2), (1,)]  # (the first copy keeps the trace's)
    with pytest.raises(ValueError, match="copies"):
        superposed(reqs, 0)


@needs_trace
def test_static_splits_find_the_cheapest_and_give_up_on_hopeless_ones():
    from loadtest.fleet_sim import Fleet, clairvoyant_windows, static_splits

    reqs = read_trace(TRACE, limit=800)
    kw = dict(KW, store=False)
    found = static_splits(reqs, MODEL, 0.9, 4, kw, quiet=True)
    good = {k: v for k, v in found.items() if v["slo_attainment"] >= 0.9}
    cheapest = min(good, key=lambda k: good[k]["worker_hours"])
    p, d = (int(x) for x in cheapest.removesuffix("D").split("P"))
    for smaller in ((p - 1, d), (p, d - 1)):  # one worker fewer of either role misses the target
        if min(smaller) >= 1:
            _, s = simulate(reqs, MODEL, prefill=smaller[0], decode=smaller[1], layout="disaggregated", **kw)
            assert s["slo_attainment"] < 0.9
    hopeless = [v for v in found.values() if v["gave_up"]]
    assert all(v["completed"] < len(reqs) for v in hopeless)
    # (a fleet told to give up after n misses stops there)
    fleet = Fleet(reqs, MODEL, prefill=1, decode=1, layout="disaggregated", **kw)
    fleet.give_up_after = 5
    fleet.run()
    assert fleet.misses == 6
    summ, plan = clairvoyant_windows(reqs, MODEL, 0.9, 120.0, 4, kw, warmup=60.0)
    assert len(plan) == int(max(r.at_s for r in reqs) // 120) + 1 and summ["completed"] == len(reqs)


def test_a_clairvoyant_schedule_starts_its_workers_a_start_up_ahead_and_pays_for_them(tmp_path):
    """`foreseen`: a worker the plan needs in interval k is started a start-up before it (and kept while needed within
    a start-up); run by the schedule scaler, the fleet's extra prefill worker is paid from its start, not its first
    request — the bound the planner is compared with pays what any autoscaler pays."""
    from loadtest.fleet_sim import Scaler, foreseen, run_scaled
    from planner.decision import Limits

    plan = [(1, 1), (1, 1), (2, 1), (1, 1), (1, 3), (1, 1)]
    assert [foreseen(plan, k, 0.0, 30.0) for k in range(6)] == plan
    assert [foreseen(plan, k, 30.0, 30.0) for k in range(6)] == [(1, 1), (2, 1), (2, 1), (1, 3), (1, 3), (1, 1)]
    assert foreseen(plan, 0, 45.0, 30.0) == (2, 1)  # (a start-up of 1.5 intervals: started two intervals ahead)
    assert foreseen(plan, 9, 30.0, 30.0) == (1, 1)  # (past the plan: its last interval)
    reqs = read_trace(write_trace(tmp_path / "t.jsonl", [(t * 1000, 600, 4, []) for t in range(0, 200, 25)]))
    kw = dict(KW, store=False)
    for startup in (0.0, 30.0):
        summ, scaler = run_scaled(reqs, MODEL, Scaler("schedule", 30.0, startup, Limits(), plan=plan),
                                  foreseen(plan, 0, startup, 30.0), **kw)
        assert summ["completed"] == len(reqs)
        # 1P1D throughout, one more prefill worker for an interval and two more decode workers for one, each of
        # them for a start-up longer when started ahead
        extra_s = 30.0 + 2 * 30.0 + 3 * startup
        ends = summ["worker_hours"] * 3600 - extra_s
        assert ends / 2 == pytest.approx(175.0, abs=0.5)  # (1P1D until the last request is done, at 175 s and a bit)
        # (the fleet after each tick, from the first at 30 s: interval 1)
        assert [(p, d) for _, p, d in scaler.history][:5] == ([(1, 1), (2, 1), (1, 1), (1, 3), (1, 1)] if not startup
                                                              else [(2, 1), (2, 1), (1, 3), (1, 3), (1, 1)])
