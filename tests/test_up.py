"""`splitfire up`: one command brings the system up, serves, and stops without orphans."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest
from procs import free_port, spawn


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("layout", [["--prefill", "1", "--decode", "1"], ["--colocated"],
                                    ["--prefill", "1", "--decode", "1", "--tensor-parallel-size", "2"],
                                    ["--prefill", "1", "--decode", "1", "-ptp", "1", "--decode-tensor-parallel-size",
                                     "2"], ["--prefill", "1", "--decode", "1", "-ptp", "2", "-dtp", "1", "-ppp", "1", "-dpp", "2"]])
async def test_up_serves_a_streamed_chat_and_stops_cleanly(tiny_model_dir, tmp_path, layout):
    openai = pytest.importorskip("openai")
    port = free_port()
    p = spawn("up", ["up", "--model", str(tiny_model_dir), "--port", str(port), "--kv-cache-gb", "0.01",
                     "--served-model-name", "tiny", *layout], tmp_path)
    try:
        p.wait_for("splitfire is ready", timeout=120)
        assert "curl -N http://127.0.0.1:" in p.log() and "from openai import OpenAI" in p.log()
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        stream = await client.chat.completions.create(model="tiny", stream=True, max_tokens=5,
                                                      messages=[{"role": "user", "content": "hi"}])
        chunks = [c async for c in stream]
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        children = subprocess.run(["pgrep", "-P", str(p.popen.pid)], capture_output=True, text=True)
        pids = [int(x) for x in children.stdout.split()]
        assert len(pids) >= (3 if "--colocated" in layout else 4)  # redis, worker(s), router
        if any("tensor-parallel-size" in a for a in layout):  # the split workers' second ranks, and the KV store
            ranks = [int(x) for x in subprocess.run(["pgrep", "-f", "worker.kv.rank"], capture_output=True,
                                                     text=True).stdout.split()
                     if int(open(f"/proc/{x}/stat").read().split()[3]) in pids]
            assert len(ranks) == (2 if "--tensor-parallel-size" in layout else 1)  # -ptp 1 -dtp 2: decode's only
            assert any("mooncake_master" in open(f"/proc/{pid}/cmdline").read() for pid in pids)
            pids += ranks
    finally:
        p.popen.send_signal(signal.SIGTERM)
        assert p.popen.wait(60) == 0, p.log()[-3000:]
    assert "splitfire up: stopped" in p.log()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert not _listening(port)


def test_core_and_gpu_plans():
    from splitfire_cli.supervisor import plan_cpus, plan_gpus

    assert plan_gpus("auto", 2, 8) == ["0", "1"]
    assert plan_gpus("auto", 4, 2) == ["", "", "", ""]  # not enough GPUs: let them share
    assert plan_gpus("auto", 2, 0) == ["", ""]
    assert plan_gpus("0,1;2,3", 2, 4) == ["0,1", "2,3"]
    assert plan_gpus("auto", 2, 8, per_worker=4) == ["0,1,2,3", "4,5,6,7"]  # tensor parallel: a worker's ranks
    assert plan_gpus("auto", 2, 4, per_worker=4) == ["", ""]
    assert plan_gpus("auto", 2, 4, per_worker=[1, 2]) == ["0", "1,2"]  # -ptp 1 -dtp 2
    assert plan_gpus("auto", 3, 4, per_worker=[2, 2, 1]) == ["", "", ""]
    assert plan_cpus("0;1", 2) == ["0", "1"]
    assert plan_cpus("none", 3) == ["", "", ""]
    with pytest.raises(ValueError):
        plan_gpus("0;1;2", 2, 4)


def test_gpu_count_needs_no_torch_without_gpu_device_nodes(tmp_path):
    """No /dev/nvidia*, /dev/dxg or /dev/kfd: no GPU, said without importing torch (the supervisor's
    1.4 s and ~285 MB); with a node present, torch is asked (here: CPU torch, which counts 0)."""
    import subprocess
    import sys
    from pathlib import Path

    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "null").touch()
    (dev / "nvidiactl").touch()  # the control node alone is not a GPU
    root = Path(__file__).resolve().parent.parent
    code = ("import sys; from pathlib import Path; from splitfire_cli.supervisor import gpu_count; "
            f"print(gpu_count('auto', Path({str(dev)!r})), gpu_count('cpu'), 'torch' in sys.modules)")
    run = lambda: subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,  # noqa: E731
                                 check=True).stdout.split()
    assert run() == ["0", "0", "False"]
    (dev / "nvidia0").touch()
    assert run()[2] == "True"  # a GPU node: torch decides (CUDA_VISIBLE_DEVICES, MIG and UUIDs are its to read)


async def test_up_runs_router_replicas_on_one_port(tiny_model_dir, tmp_path):
    """`--routers 2`: both replicas bind the port (SO_REUSEPORT) and the kernel spreads connections over
    them; with Redis they share pins, quotas and the exact prefix index from the workers' KV events."""
    import aiohttp

    port = free_port()
    p = spawn("up", ["up", "--model", str(tiny_model_dir), "--port", str(port), "--kv-cache-gb", "0.01",
                     "--served-model-name", "tiny", "--colocated", "--no-kv-store", "--routers", "2"], tmp_path)
    try:
        p.wait_for("splitfire is ready", timeout=120)
        for _ in range(24):  # a new connection each: each lands on one replica or the other
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                    s.post(f"http://127.0.0.1:{port}/v1/completions",
                           json={"model": "tiny", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
        def served() -> dict[str, int]:
            log = p.log()
            return {name: sum(1 for line in log.splitlines() if line.startswith(f"[{name}]")
                              and "event=request_done" in line) for name in ("router-0", "router-1")}

        # a replica logs request_done after the last byte went out, and `up` relays its lines through a pipe:
        # the last line may reach the log a moment after the client read its answer
        deadline = time.monotonic() + 10
        while sum(served().values()) < 24 and time.monotonic() < deadline:
            time.sleep(0.05)
        counts = served()
        assert sum(counts.values()) == 24 and all(counts.values()), counts
        log = p.log()
        assert "event=kv_index_synced" in log  # (the workers publish KV events to the Redis up started)
    finally:
        p.popen.send_signal(signal.SIGTERM)
        assert p.popen.wait(60) == 0, p.log()[-3000:]
    assert not _listening(port)


async def test_up_planner_adds_a_decode_worker_under_load_and_drains_it_after(tiny_model_dir, tmp_path):
    """`--planner`: a load step makes the planner (`planner/decision.py`, from the router's /metrics) add a
    decode worker process, which joins the router through Redis; when the load falls it drains one (the
    newest) and no request fails."""
    import asyncio
    import json

    import aiohttp

    profile = tmp_path / "profile.json"  # one stream per decode worker within the ITL SLO
    profile.write_text(json.dumps({"prefill_tps": 1e6, "decode_itl": {"1": 0.01, "2": 0.5}}))
    port = free_port()
    p = spawn("up", ["up", "--model", str(tiny_model_dir), "--port", str(port), "--kv-cache-gb", "0.01",
                     "--served-model-name", "tiny", "--prefill", "1", "--decode", "1", "--no-kv-store",
                     "--planner", "--planner-profile", str(profile), "--planner-interval", "1", "--itl-slo", "0.1",
                     "--max-decode", "2", "--max-prefill", "1"], tmp_path)
    statuses: list[int] = []

    async def one(s: aiohttp.ClientSession) -> None:
        async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                          json={"model": "tiny", "prompt": "hi there", "max_tokens": 16, "ignore_eos": True}) as r:
            await r.read()
            statuses.append(r.status)

    async def load(rate: float, seconds: float, s: aiohttp.ClientSession) -> None:
        tasks = []
        for _ in range(int(rate * seconds)):
            tasks.append(asyncio.create_task(one(s)))
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks)

    try:
        p.wait_for("splitfire is ready", timeout=120)
        async with aiohttp.ClientSession() as s:
            await load(12, 6, s)
            p.wait_for("role=decode from=1 to=2", timeout=30)
            p.wait_for("[decode-1] splitfire decode worker ready", timeout=60)
            await load(1, 12, s)  # light load while the planner scales back down
            p.wait_for("role=decode from=2 to=1", timeout=60)
            await load(1, 3, s)
        assert statuses and all(st == 200 for st in statuses), statuses
        assert "exited; stopping everything" not in p.log()  # the drained worker's exit was expected
    finally:
        p.popen.send_signal(signal.SIGTERM)
        assert p.popen.wait(60) == 0, p.log()[-3000:]
