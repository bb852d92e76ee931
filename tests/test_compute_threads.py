"""engine/compute_threads.py: one team of OpenMP threads per process.

Each case runs in a fresh interpreter (libgomp's pools live as long as their threads), confined to two
CPUs with two torch threads: a thread that has computed (the main thread loading a model, or a helper
thread kept alive as asyncio's executor threads are) leaves a pool behind, and a second thread's team
then sleeps at every barrier — counted as voluntary context switches over 400 parallel ops. The controls
(nothing released) show the count the release removes, so the test cannot pass on a runtime that never
throttled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import os, sys, threading
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
    import torch
    from engine.compute_threads import _libgomp, release_pool, releasing
    if _libgomp() is None:
        print("no-libgomp"); sys.exit()
    torch.set_num_threads(2)
    mode = sys.argv[1]
    a = torch.empty(1 << 21)  # (no parallel fill on this thread)
    parked = threading.Event()
    if mode.startswith("main"):
        a.add_(1)  # the main thread's team, as loading a model leaves one
        if mode == "main-release":
            assert release_pool()
    else:  # a helper thread computes, then stays alive (as an executor's thread does)
        done = threading.Event()
        def helper():
            fn = (lambda: a.add_(1))
            (releasing(fn) if mode == "helper-release" else fn)()
            done.set()
            parked.wait()
        threading.Thread(target=helper, daemon=True).start()
        done.wait()

    def switches():
        n = 0
        for t in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{t}/status") as f:
                n += sum(int(x.split()[1]) for x in f if x.startswith("voluntary_ctxt"))
        return n

    out = {}
    def work():  # the engine thread, named as the worker names it (its compute threads inherit the name)
        import ctypes
        from engine.compute_threads import ENGINE_THREAD, _engine_switches
        ctypes.CDLL(None).prctl(15, ENGINE_THREAD.encode(), 0, 0, 0)
        b = torch.zeros(1 << 20)
        b.add_(1)
        s0, e0 = switches(), _engine_switches()
        for _ in range(400):
            b.add_(1)
        out["n"], out["engine"] = switches() - s0, _engine_switches() - e0
    th = threading.Thread(target=work); th.start(); th.join()
    print(out["engine"], out["n"])
""")


def _switches(mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    res = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    if res.stdout.strip() == "no-libgomp":
        pytest.skip("torch here does not compute with libgomp")
    engine, everyone = map(int, res.stdout.split()[-2:])
    assert engine <= everyone
    return engine


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one team of one thread never waits")
@pytest.mark.parametrize("who", ["main", "helper"])
def test_a_released_pool_keeps_the_computing_threads_team_spinning(who: str) -> None:
    kept = _switches(f"{who}-keep")
    released = _switches(f"{who}-release")
    # kept: a sleep and a wake at (nearly) every one of the 400 ops' barriers; released: the team spins
    assert kept >= 300, f"control: the second pool did not throttle ({kept} switches) — the test shows nothing"
    assert released <= 40, f"{released} voluntary switches in 400 parallel ops after releasing ({kept} without)"


def test_releasing_returns_and_raises_as_the_function_does() -> None:
    from engine.compute_threads import releasing

    assert releasing(lambda x, y=1: x + y)(2, y=3) == 5

    def boom() -> None:
        raise ValueError("named")

    with pytest.raises(ValueError, match="named"):
        releasing(boom)()


def _share(**kw):
    from engine.compute_threads import TICK_S, CoreShare

    per_s = round(1 / TICK_S)  # ticks per second
    return CoreShare(frozenset({0, 1}), max_threads=2, **kw), per_s


def test_core_share_gives_up_a_thread_at_once_when_a_neighbour_takes_a_core() -> None:
    share, hz = _share()
    assert share.update(0.0, 0, 0) == 2
    # 1 s: the cores were busy 2 s worth, this process 1.9 s of it (its spinning team, the shell): others 0.1
    assert share.update(1.0, 2 * hz, round(1.9 * hz)) == 2
    assert abs(share.foreign - 0.1) < 0.02
    # next second: a neighbour took 0.7 of a core (the team got 1.3) -> one thread, at once
    assert share.update(2.0, 4 * hz, round(3.2 * hz)) == 1
    assert share.changes[-1][1] == 1
    # with one thread: its core and the neighbour's, both busy -> stays at one
    assert share.update(3.0, 6 * hz, round(4.2 * hz)) == 1


def test_core_share_takes_the_thread_back_only_after_the_cores_stayed_free() -> None:
    share, hz = _share(raise_after_s=2.0)
    share.update(0.0, 0, 0)
    share.update(1.0, 2 * hz, hz)  # a neighbour on a whole core
    assert share.current == 1
    busy, own = 2 * hz, hz
    seen = []
    for t in range(2, 7):  # the neighbour is gone: only this process's one thread
        busy, own = busy + hz, own + hz
        seen.append(share.update(float(t), busy, own))
    assert seen == [1, 1, 2, 2, 2]  # free from t=2: raised at t=4, 2 s later
    # a blip of others' use in between restarts the wait
    share2, _ = _share(raise_after_s=2.0)
    share2.update(0.0, 0, 0)
    share2.update(1.0, 2 * hz, hz)
    b, o = 2 * hz, hz
    out = []
    for t, other in zip(range(2, 8), [0, 0, 1, 0, 0, 0], strict=True):  # a full core taken again at t=4
        b, o = b + hz + other * hz, o + hz
        out.append(share2.update(float(t), b, o))
    assert out == [1, 1, 1, 1, 1, 2]


def test_core_share_never_goes_below_one_thread_or_above_the_maximum() -> None:
    share, hz = _share()
    share.update(0.0, 0, 0)
    assert share.update(1.0, 2 * hz, 0) == 1  # others took both cores
    share3, _ = _share()
    share3.update(0.0, 0, 0)
    assert share3.update(1.0, 0, 0) == 2  # idle cores: still the configured maximum, not more


def test_core_share_does_not_judge_a_window_the_engine_spent_idle() -> None:
    share, hz = _share(interval_s=0.5)
    share.update(0.0, 0, 0)
    # 10 s idle (no steps, no samples) while another process used both cores: no verdict on that
    assert share.update(10.0, 20 * hz, 0) == 2
    # from here on, windows of the interval: a neighbour on a whole core counts
    assert share.update(10.5, 20 * hz + hz, round(0.5 * hz)) == 1


def test_team_watch_says_so_once_when_the_compute_threads_sleep(caplog: pytest.LogCaptureFixture) -> None:
    from engine.compute_threads import TeamWatch

    w = TeamWatch(per_step_limit=30, min_steps=20)
    assert w.update(0, 0) is None
    assert w.update(10, 40) is None  # too few steps to judge yet
    assert w.update(40, 160) == 4.0  # a spinning team: 4 per step
    assert not w.warned
    with caplog.at_level("WARNING", logger="splitfire.engine"):
        assert w.update(60, 160 + 20 * 98) == 98.0  # throttled: ~100 per step
        assert w.update(80, 160 + 40 * 98) == 98.0
    assert w.warned
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "compute_threads_sleeping" in caplog.records[0].message
