"""`splitfire up`: the whole system on one machine, in one command.

Starts Redis (if `redis-server` is installed; otherwise the router keeps affinity state
in process and says so), a `mooncake_master` for the KV cache the workers share (unless
`--no-kv-store`), the prefill and decode workers (or one colocated worker), and the router; prefixes every child's log lines with its name; on Ctrl-C or SIGTERM stops
the router first, then the workers, then Redis, so no child outlives it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STOP_TIMEOUT_S = 20.0


@dataclass
class Child:
    name: str
    argv: list[str]
    ready_text: str  # a line that says it is ready ("" with ready_port)
    env: dict[str, str] = field(default_factory=dict)
    ready_port: int = 0  # or: ready once this port accepts connections (mooncake_master prints nothing)
    proc: asyncio.subprocess.Process | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    log_task: asyncio.Task | None = None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _pick_port(preferred: int, taken: set[int]) -> int:
    port = preferred
    while port in taken or not _port_free(port) or not _port_free(port + 1000):
        port += 1
    taken.update({port, port + 1000})
    return port


def _explicit(spec: str, n_workers: int, flag: str, what: str) -> list[str]:
    """A 'LIST;LIST;...' spec: one entry per worker, in start order."""
    parts = [p.strip() for p in spec.split(";")]
    if len(parts) != n_workers:
        raise ValueError(f"{flag} names {len(parts)} {what} lists for {n_workers} workers")
    return parts


def plan_cpus(spec: str, n_workers: int) -> list[str]:
    """Core lists per worker, in start order: 'auto' splits the cores evenly, 'none' pins nothing,
    or an explicit 'LIST;LIST;...' (e.g. '0;1' or '0-3;4-7')."""
    if spec == "none":
        return [""] * n_workers
    if spec != "auto":
        return _explicit(spec, n_workers, "--cpus", "core")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n_workers:
        return [""] * n_workers  # fewer cores than workers: let the OS share them
    per = len(cores) // n_workers
    return [",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(n_workers)]


def gpu_count(device: str, dev: Path = Path("/dev")) -> int:
    """GPUs the workers could use. Without an NVIDIA (/dev/nvidia0...), WSL (/dev/dxg) or ROCm (/dev/kfd)
    device node no GPU is visible, and saying so needs no torch: importing it cost this supervisor
    1.4 s before any worker started, and ~285 MB for its whole life. With one, torch counts them
    (CUDA_VISIBLE_DEVICES and its UUID / MIG forms are its to interpret)."""
    if device == "cpu":
        return 0
    if not any(dev.glob("nvidia[0-9]*")) and not (dev / "dxg").exists() and not (dev / "kfd").exists():
        return 0
    import torch

    return torch.cuda.device_count()


def plan_gpus(spec: str, n_workers: int, device_count: int, per_worker: int | list[int] = 1) -> list[str]:
    """CUDA_VISIBLE_DEVICES per worker, in start order: 'auto' gives each worker its own GPUs, as many as
    its ranks (`per_worker`: one count for all, or one per worker), when there are enough (else all share
    what there is), 'none' leaves it unset, or 'LIST;LIST;...' (e.g. '0,1;2,3')."""
    if spec == "none" or device_count == 0:
        return [""] * n_workers
    if spec != "auto":
        return _explicit(spec, n_workers, "--gpus", "device")
    sizes = per_worker if isinstance(per_worker, list) else [per_worker] * n_workers
    if len(sizes) != n_workers:
        raise ValueError(f"{len(sizes)} rank counts for {n_workers} workers")
    if device_count < sum(sizes):
        return [""] * n_workers
    starts = [sum(sizes[:w]) for w in range(n_workers)]
    return [",".join(str(start + r) for r in range(n)) for start, n in zip(starts, sizes, strict=True)]


async def _pump(child: Child) -> None:
    assert child.proc is not None and child.proc.stdout is not None
    prefix = f"[{child.name}] ".encode()
    async for line in child.proc.stdout:
        if child.ready_text and child.ready_text.encode() in line:
            child.ready.set()
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.flush()


async def _start(child: Child) -> None:
    child.proc = await asyncio.create_subprocess_exec(
        *child.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **child.env}, start_new_session=True)
    child.log_task = asyncio.create_task(_pump(child))


async def _stop(child: Child) -> None:
    p = child.proc
    if p is None or p.returncode is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(p.wait(), STOP_TIMEOUT_S)
    except TimeoutError:
        p.kill()
        await p.wait()


async def _wait_ready(children: list[Child], timeout: float) -> None:
    async def one(c: Child) -> None:
        assert c.proc is not None
        probe = asyncio.create_task(_probe(c)) if c.ready_port else None
        ready = asyncio.create_task(c.ready.wait())
        died = asyncio.create_task(c.proc.wait())
        done, _ = await asyncio.wait({ready, died}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for t in (ready, died, probe):
            if t is not None:
                t.cancel()
        if not c.ready.is_set():
            raise RuntimeError(f"{c.name} {'exited' if died in done else 'did not become ready'}; see its log above")

    await asyncio.gather(*(one(c) for c in children))


async def _probe(c: Child) -> None:
    while c.proc is not None and c.proc.returncode is None:
        if not _port_free(c.ready_port):
            c.ready.set()
            return
        await asyncio.sleep(0.05)


async def up(args: argparse.Namespace) -> int:
    """Resolve the models, refuse a layout that cannot work, plan the children, run them until Ctrl-C."""
    from engine.loading.model_store import resolve_model

    # Each model fetched once, before any child would race to; several --model: each its own workers
    # (the same layout), one router in front (requests go to the workers of the model they name).
    model_dirs = [str(resolve_model(m)) for m in (args.model or [os.environ.get("SPLITFIRE_MODEL")])]
    refusal = _refusal(args, model_dirs)
    if refusal:
        print(f"splitfire up: {refusal}", flush=True)
        return 2
    fleet = Fleet(args, model_dirs)
    fleet.start_infrastructure()
    if fleet.planner_refusal():
        print(f"splitfire up: {fleet.planner_refusal()}", flush=True)
        return 2
    fleet.plan_workers()
    fleet.plan_routers()
    return await _run(fleet)


def _refusal(args: argparse.Namespace, model_dirs: list[str]) -> str | None:
    """Why these flags cannot make a fleet (the first reason), or None. Settles --shared-workers (colocated)."""
    names = [Path(d).name for d in model_dirs]
    stray = [i + 1 for i in (*args.served_names, *args.lora_by_model) if i >= len(model_dirs)]
    if stray:
        return (f"--served-model-name / --lora-modules after --model number {stray[0]}, but only {len(model_dirs)} "
                "given")
    if len(set(names)) != len(names):
        return f"two models in directories of the same name ({names}): the router tells their workers apart by it"
    lora_any = any(args.lora_by_model.values())
    if (args.max_loras is not None or args.max_lora_rank is not None or args.lora_dtype is not None) and not (
            lora_any or args.lora_root):
        return "--max-loras / --max-lora-rank / --lora-dtype need --lora-modules or --lora-root"
    if args.colocated and (args.prefill_tensor_parallel_size or args.decode_tensor_parallel_size
                           or args.prefill_pipeline_parallel_size or args.decode_pipeline_parallel_size):
        return ("--prefill/--decode-tensor/pipeline-parallel-size size disaggregated workers; with --colocated use "
                "--tensor-parallel-size / --pipeline-parallel-size")
    if args.shared_workers or args.max_loaded_models or args.model_memory_gb:
        if (not args.shared_workers or len(model_dirs) < 2 or args.shared_workers < 0
                or args.tensor_parallel_size * args.pipeline_parallel_size > 1):
            return ("--shared-workers N starts N colocated workers that each serve every --model (two or more; one "
                    "split over no ranks), loading them on demand within --max-loaded-models / --model-memory-gb")
        args.colocated = True
    if args.routers < 1:
        return "--routers must be at least 1"
    stray_planner = [k for k, default in PLANNER_DEFAULTS.items() if getattr(args, k) != default]
    if stray_planner and not args.planner:
        return f"--{stray_planner[0].replace('_', '-')} sizes workers only with --planner"
    return None


class Fleet:
    """The children `splitfire up` starts, planned in steps: Redis and the KV stores, the workers (their
    roles, cores, GPUs, parallelism and flags), the routers in front."""

    def __init__(self, args: argparse.Namespace, model_dirs: list[str]):
        self.args = args
        self.model_dirs = model_dirs
        self.names = [Path(d).name for d in model_dirs]
        self.exe = [sys.executable, "-m", "splitfire_cli"]
        self.taken: set[int] = set()
        self.common = ["--device", args.device, "--dtype", args.dtype, "--kv-cache-gb", str(args.kv_cache_gb),
                       "--host", "127.0.0.1"]
        self.infra: list[Child] = []
        self.workers: list[Child] = []
        self.routers: list[Child] = []
        self.redis_url = os.environ.get("REDIS_URL", "")
        self.kv_stores: list[list[str]] = [[] for _ in model_dirs]  # one store per model: blocks never mix
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        self.role_tp = {"prefill": args.prefill_tensor_parallel_size or tp,
                        "decode": args.decode_tensor_parallel_size or tp, "both": tp}
        self.role_pp = {"prefill": args.prefill_pipeline_parallel_size or pp,
                        "decode": args.decode_pipeline_parallel_size or pp, "both": pp}
        self.lora_any = any(args.lora_by_model.values())
        self.addrs: dict[str, list[str]] = {"prefill": [], "decode": [], "both": []}
        self.count: dict[str, int] = {}

    def start_infrastructure(self) -> None:
        """Redis (unless REDIS_URL is given, --no-redis, or no redis-server), and a KV store per model."""
        args = self.args
        if not self.redis_url and not args.no_redis and shutil.which("redis-server"):
            rport = _pick_port(6379, self.taken)
            self.infra.append(Child("redis", ["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save",
                                              "", "--appendonly", "no"], "Ready to accept connections"))
            self.redis_url = f"redis://127.0.0.1:{rport}/0"
        elif not self.redis_url:
            print("splitfire up: redis-server not found (or --no-redis): session affinity lives in the router's "
                  "memory", flush=True)
        if not args.no_kv_store:
            from kvtransfer.store import master_command

            for m in range(len(self.model_dirs)):
                mport, metrics = _pick_port(50055, self.taken), _pick_port(9003, self.taken)
                self.infra.append(Child("kv-store" + (f"-{m}" if m else ""), master_command(mport, metrics), "",
                                        ready_port=mport))
                self.kv_stores[m] = ["--kv-store", f"127.0.0.1:{mport}", "--kv-store-gb", str(args.kv_store_gb)]

    def planner_refusal(self) -> str | None:
        args = self.args
        if args.planner and (args.colocated or len(self.model_dirs) > 1 or not self.redis_url
                             or not args.planner_profile):
            return ("--planner sizes one model's prefill and decode workers: it needs --planner-profile, Redis (new "
                    "workers join the router through it) and neither --colocated nor several --model")
        return None

    def plan_workers(self) -> None:
        """Each worker's role, (first) model, cores and GPUs; the LoRA flags every worker shares."""
        args = self.args
        per_model = ["both"] if args.colocated else ["prefill"] * args.prefill + ["decode"] * args.decode
        roles = per_model * len(self.model_dirs)
        which = [m for m in range(len(self.model_dirs)) for _ in per_model]  # each worker's (first) model
        if args.shared_workers:  # N colocated workers serving every model: the i-th keeps model i resident
            roles = ["both"] * args.shared_workers
            which = [i % len(self.model_dirs) for i in range(args.shared_workers)]
        cpus = plan_cpus(args.cpus, len(roles))  # (a worker's ranks share its cores: engine/ranks.threads_per_rank)
        gpus = plan_gpus(args.gpus, len(roles), gpu_count(args.device),
                         [self.role_tp[r] * self.role_pp[r] for r in roles])
        if self.lora_any or args.lora_root:
            for flag, value in (("--max-loras", args.max_loras), ("--max-lora-rank", args.max_lora_rank),
                                ("--lora-dtype", args.lora_dtype)):
                if value is not None:
                    self.common += [flag, str(value)]
            for root in args.lora_root:
                self.common += ["--lora-root", root]
        for role, cores, devices, m in zip(roles, cpus, gpus, which, strict=True):
            child, addr = self.worker_child(role, m, cores, devices)
            self.workers.append(child)
            self.addrs[role].append(addr)

    def lora_args(self, m: int) -> list[str]:
        """A worker whose (first) model is model m: that model's --lora-modules (or slots for run-time loads)."""
        if not (self.lora_any or self.args.lora_root):
            return []
        return ["--lora-modules", *self.args.lora_by_model[m]] if self.args.lora_by_model.get(m) else ["--enable-lora"]

    def worker_child(self, role: str, m: int, cores: str, devices: str) -> tuple[Child, str]:
        args = self.args
        port = _pick_port({"prefill": 50061, "decode": 50051, "both": 50051}[role], self.taken)
        self.count[role] = self.count.get(role, -1) + 1
        name = {"both": "serve"}.get(role, role) + f"-{self.count[role]}"
        argv = [*self.exe, {"both": "serve"}.get(role, role), "--model", self.model_dirs[m], *self.common,
                *self.lora_args(m), *self.kv_stores[m], "--grpc-port", str(port)]
        if self.redis_url:  # KV events for the routers' exact prefix index (and self-registration, same address)
            argv += ["--redis-url", self.redis_url, "--advertise", f"127.0.0.1:{port}"]
        if self.role_tp[role] > 1:
            argv += ["--tensor-parallel-size", str(self.role_tp[role])]
        if self.role_pp[role] > 1:
            argv += ["--pipeline-parallel-size", str(self.role_pp[role])]
        if args.shared_workers:
            argv += [a for i, d in enumerate(self.model_dirs) if i != m for a in ("--on-demand-model", d)]
            if args.max_loaded_models:
                argv += ["--max-loaded-models", str(args.max_loaded_models)]
            if args.model_memory_gb:
                argv += ["--model-memory-gb", str(args.model_memory_gb)]
        if cores:
            argv += ["--cpus", cores]
        argv += args.worker_arg + (args.prefill_arg if role == "prefill" else args.decode_arg)
        return Child(name, argv, "worker ready", {"CUDA_VISIBLE_DEVICES": devices} if devices else {}), \
            f"127.0.0.1:{port}"

    def plan_routers(self) -> None:
        """--routers replicas on one port (SO_REUSEPORT: the kernel spreads connections over them)."""
        args, addrs = self.args, self.addrs
        served = [args.served_names.get(i) or n for i, n in enumerate(self.names)]
        argv = [*self.exe, "router", "--model", self.model_dirs[0], "--port", str(args.port), "--policy", args.policy,
                *(["--served-model-name", args.served_names[0]] if args.served_names.get(0) else []),
                *(f"--extra-model={n}={d}" for n, d in zip(served[1:], self.model_dirs[1:], strict=True)),
                *(["--prefill", *addrs["prefill"]] if addrs["prefill"] else []),
                *(["--decode", *addrs["decode"]] if addrs["decode"] else []),
                *(["--colocated", *addrs["both"]] if addrs["both"] else []),
                *(["--redis-url", self.redis_url] if self.redis_url else []),
                *(["--shared-kv-store"] if self.kv_stores[0] else []), *args.router_arg]
        if args.routers > 1 and not self.redis_url:
            print("splitfire up: --routers above 1 without Redis: each replica keeps its own affinity pins, quotas "
                  "and prefix index", flush=True)
        self.routers = [Child("router" if args.routers == 1 else f"router-{i}",
                              argv + (["--reuse-port"] if args.routers > 1 else []), "router ready")
                        for i in range(args.routers)]


async def _run(fleet: Fleet) -> int:
    """Start the groups in order (infrastructure, workers, routers), each ready before the next; then watch
    until Ctrl-C/SIGTERM or an unexpected exit, and stop in reverse order."""
    args = fleet.args
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started: list[Child] = []
    code = 0
    try:
        t0 = time.monotonic()
        for group in (fleet.infra, fleet.workers, fleet.routers):
            if not await _start_group(group, started, stop, args.start_timeout):
                return 130
        name = (await _served_name(args.port)) or "MODEL"
        print(_ready_banner(args.port, name, time.monotonic() - t0, fleet.addrs), flush=True)
        code = await _watch(fleet, started, stop)
    except RuntimeError as e:
        print(f"splitfire up: {e}", flush=True)
        code = 1
    finally:
        print("splitfire up: stopping ...", flush=True)
        for group in ([c for c in started if c in fleet.routers], [c for c in started if c in fleet.workers],
                      [c for c in started if c in fleet.infra]):
            await asyncio.gather(*(_stop(c) for c in group))
        for c in started:
            if c.log_task is not None:
                await asyncio.wait({c.log_task}, timeout=2)
        print("splitfire up: stopped", flush=True)
    return code


async def _start_group(group: list[Child], started: list[Child], stop: asyncio.Event, timeout: float) -> bool:
    """Start every child of `group` and wait until all are ready (RuntimeError naming one that is not);
    False when stopped meanwhile."""
    for c in group:
        await _start(c)
        started.append(c)
    waiter = asyncio.create_task(_wait_ready(group, timeout))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if stop.is_set():
        waiter.cancel()
        return False
    waiter.result()
    return True


async def _watch(fleet: Fleet, started: list[Child], stop: asyncio.Event) -> int:
    """Until Ctrl-C (0), or a child exits that nobody asked to (1); with --planner, its scaler runs meanwhile."""
    drained: set[int] = set()  # workers the planner drained: their exit is expected
    planner_task = None
    if fleet.args.planner:
        scaler = LocalScaler(fleet.args, fleet.workers, started, drained,
                             lambda role: fleet.worker_child(role, 0, "", "")[0])
        planner_task = asyncio.create_task(scaler.run())
    code = 0
    while not stop.is_set():
        dead = [c.name for c in started if c.proc is not None and c.proc.returncode is not None
                and id(c) not in drained]
        if dead:
            print(f"splitfire up: {', '.join(dead)} exited; stopping everything", flush=True)
            code = 1
            break
        if planner_task is not None and planner_task.done():
            planner_task.result()  # (a planner that failed says why)
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.5)
        except TimeoutError:
            pass
    if planner_task is not None:
        planner_task.cancel()
    return code


# `--planner`'s own flags and their defaults (given without --planner, they are refused).
PLANNER_DEFAULTS = {"planner_profile": "", "planner_state": "", "planner_interval": 30.0, "planner_sample": 5.0,
                    "planner_startup": 30.0,
                    "ttft_slo": 2.0, "itl_slo": 0.1,
                    "min_prefill": 1, "max_prefill": 4, "min_decode": 1, "max_decode": 4}


class LocalScaler:
    """`splitfire up --planner`: every interval, the planner's decision (`planner/decision.py`, from the
    router's /metrics) applied to this machine's worker processes — a new worker joins the router through
    Redis once ready; the newest worker of a role drains on SIGTERM (finishes its requests, leaves)."""

    def __init__(self, args: argparse.Namespace, workers: list[Child], started: list[Child], drained: set[int],
                 new_worker: Callable[[str], Child]) -> None:
        self.args, self.workers, self.started, self.drained = args, workers, started, drained
        self.new_worker = new_worker

    def live(self, role: str) -> list[Child]:
        return [c for c in self.workers if c.name.startswith(role) and id(c) not in self.drained
                and c.proc is not None and c.proc.returncode is None]

    async def run(self) -> None:
        import aiohttp

        from planner.cli import watch
        from planner.decision import Limits, Planner
        from planner.profile import load
        from planner.state import resume, save

        a = self.args
        planner = Planner(load(a.planner_profile), a.ttft_slo, a.itl_slo,
                          Limits(a.min_prefill, a.max_prefill, a.min_decode, a.max_decode),
                          interval_s=a.planner_interval, lead_s=a.planner_startup)
        if a.planner_state and resume(planner, a.planner_state):
            print(f"splitfire up: event=planner_resumed state={a.planner_state} correction_prefill="
                  f"{planner.correction['prefill']:.3f} correction_decode={planner.correction['decode']:.3f}",
                  flush=True)
        url = f"http://127.0.0.1:{a.port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async for measured in watch(s, url, a.planner_interval, a.planner_sample):
                # The workers this process runs (a starting one counts: no second start for the same need).
                snap = measured.actuated(len(self.live("prefill")), len(self.live("decode")), at_s=time.time())
                d = planner.decide(snap)
                if a.planner_state:
                    save(planner, a.planner_state)
                for role, want in (("prefill", d.prefill), ("decode", d.decode)):
                    have = self.live(role)
                    if want != len(have):
                        print(f"splitfire up: event=planner_scale role={role} from={len(have)} to={want} "
                              f"reasons={'; '.join(d.reasons)}", flush=True)
                    for _ in range(want - len(have)):
                        c = self.new_worker(role)
                        self.workers.append(c)
                        await _start(c)
                        self.started.append(c)
                    for c in sorted(have, key=lambda c: -self.workers.index(c))[: max(len(have) - want, 0)]:
                        self.drained.add(id(c))
                        assert c.proc is not None
                        c.proc.send_signal(signal.SIGTERM)  # drains: no new requests, the running ones finish


async def _served_name(port: int) -> str | None:
    import aiohttp

    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/v1/models") as r:
            return (await r.json())["data"][0]["id"]
    except Exception:
        return None


def _ready_banner(port: int, model: str, took: float, addrs: dict[str, list[str]]) -> str:
    layout = (f"{len(addrs['prefill'])} prefill + {len(addrs['decode'])} decode workers" if addrs["decode"]
              else f"{len(addrs['both'])} colocated worker(s)")
    return f"""
================================================================================
 splitfire is ready on http://127.0.0.1:{port}  ({layout}, model {model}, {took:.0f}s)

 curl:
   curl -N http://127.0.0.1:{port}/v1/chat/completions -H 'Content-Type: application/json' \\
     -d '{{"model": "{model}", "stream": true, "temperature": 0, "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

 openai client (pip install openai):
   from openai import OpenAI
   client = OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="unused")
   for chunk in client.chat.completions.create(model="{model}", stream=True, temperature=0,
           messages=[{{"role": "user", "content": "What is the capital of France?"}}]):
       print(chunk.choices[0].delta.content or "", end="", flush=True)

 Ctrl-C stops everything.
================================================================================
"""


class _OfLastModel(argparse.Action):
    """A flag that belongs to the --model given last before it (to the first when none is yet):
    `up --model A --lora-modules a=DIR --model B --served-model-name b --lora-modules b1=DIR`. Stored as
    {model index: value} (`--lora-modules`: the NAME=PATH items, repeatable)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        i = max(len(namespace.model or []) - 1, 0)
        table = dict(getattr(namespace, self.dest) or {})
        if self.nargs == "+":
            table[i] = [*table.get(i, []), *values]
        elif i in table:
            parser.error(f"{option_string} given twice for model {i + 1}")
        else:
            table[i] = values
        setattr(namespace, self.dest, table)


def add_subcommand(sub) -> None:
    p = sub.add_parser("up", help="run the whole system locally: Redis, workers, router")
    p.add_argument("--model", action="append", default=None,
                   help="default: $SPLITFIRE_MODEL or smollm2-135m-instruct; repeat to serve several models, each with "
                        "its own workers in the layout below, one router in front (a request's `model` picks them: "
                        "the first as --served-model-name says, the others by their directory's name)")
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument("--planner", action="store_true",
                   help="size the prefill and decode workers from the router's metrics and the SLOs below "
                        "(`planner/decision.py`): add worker processes, drain them (needs Redis, --planner-profile)")
    d = PLANNER_DEFAULTS
    p.add_argument("--planner-profile", default=d["planner_profile"], help="from `splitfire planner profile`")
    p.add_argument("--planner-state", default=d["planner_state"], metavar="FILE",
                   help="--planner: keep what it learns (corrections, load average) in FILE across restarts")
    p.add_argument("--planner-interval", type=float, default=d["planner_interval"], help="seconds between decisions")
    p.add_argument("--planner-sample", type=float, default=d["planner_sample"],
                   help="--planner: seconds between reads of the router's /metrics within an interval (its bursts)")
    p.add_argument("--planner-startup", type=float, default=d["planner_startup"],
                   help="--planner: seconds a new worker takes to serve (the load is predicted this far ahead)")
    p.add_argument("--ttft-slo", type=float, default=d["ttft_slo"], help="--planner: seconds (p90)")
    p.add_argument("--itl-slo", type=float, default=d["itl_slo"], help="--planner: seconds (p90)")
    for flag in ("min_prefill", "max_prefill", "min_decode", "max_decode"):
        p.add_argument("--" + flag.replace("_", "-"), type=int, default=d[flag], help="--planner: workers of the role")
    p.add_argument("--routers", type=int, default=1,
                   help="router replicas sharing the port (SO_REUSEPORT); with Redis they share affinity pins, quotas "
                        "and the exact prefix index built from the workers' KV events")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--colocated", action="store_true", help="one colocated worker instead of prefill + decode")
    p.add_argument("--shared-workers", type=int, default=0, metavar="N",
                   help="with several --model: N colocated workers that each serve every model, the i-th keeping "
                        "model i mod M resident and loading the others when a request names them")
    p.add_argument("--max-loaded-models", type=int, default=0,
                   help="--shared-workers: models resident at once per worker (0: no limit)")
    p.add_argument("--model-memory-gb", type=float, default=0.0,
                   help="--shared-workers: GiB of weights + KV cache per worker's resident models (0: no limit)")
    for kind, short, what, split in (
            ("tensor", "t", "ranks", "each worker splits the model across this many ranks (GPUs, or CPU processes "
             "sharing its cores); each prefill rank writes its KV heads into the decode ranks holding them"),
            ("pipeline", "p", "stages", "each worker splits the layers into this many stages, each of "
             "--tensor-parallel-size processes (CPU hosts); each prefill stage writes its layers into the decode "
             "ranks holding them")):
        p.add_argument(f"--{kind}-parallel-size", f"-{short}p", type=int, default=1, help=split)
        for role in ("prefill", "decode"):
            p.add_argument(f"--{role}-{kind}-parallel-size", f"-{role[0]}{short}p", type=int, default=0,
                           metavar="N", help=f"{role} workers' {what}, when not --{kind}-parallel-size's")
    p.add_argument("--cpus", default="auto", help="auto (split cores across workers), none, or 'LIST;LIST;...'")
    p.add_argument("--gpus", default="auto", help="auto (one GPU per worker when there are enough), none, or "
                   "'LIST;LIST;...' of CUDA_VISIBLE_DEVICES values")
    p.add_argument("--policy", default="token", choices=["token", "round_robin", "random"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--served-model-name", action=_OfLastModel, dest="served_names", default={},
                   help="name clients send for the --model given last before it (default: the model directory's)")
    p.add_argument("--no-redis", action="store_true", help="do not start Redis; keep affinity in the router")
    p.add_argument("--no-kv-store", action="store_true",
                   help="do not start mooncake_master: no KV cache shared between workers")
    p.add_argument("--kv-store-gb", type=float, default=1.0, help="memory each worker lends to the shared KV store")
    p.add_argument("--lora-modules", nargs="+", action=_OfLastModel, dest="lora_by_model", default={},
                   metavar="NAME=PATH", help="LoRA adapters of the --model given last before it, served by its "
                   "workers (a request names one as its model)")
    p.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                   help="adapters may be loaded at run time (POST /v1/load_lora_adapter) from under this directory")
    p.add_argument("--max-loras", type=int, default=None, help="adapters resident at once per worker (default 4; "
                   "with --lora-modules or --lora-root)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="default 16; with --lora-modules or --lora-root")
    p.add_argument("--lora-dtype", default=None, choices=["float32", "float16"],
                   help="the adapter factors the CPU decode loop reads (default float32; float16: half the bytes)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                   help="extra flag for every worker, e.g. --worker-arg=--max-num-seqs=32 (repeatable)")
    p.add_argument("--prefill-arg", action="append", default=[], metavar="FLAG", help="extra flag for prefill workers")
    p.add_argument("--router-arg", action="append", default=[], metavar="FLAG",
                   help="extra flag for the router, e.g. --router-arg=--api-keys=keys.json (repeatable)")
    p.add_argument("--decode-arg", action="append", default=[], metavar="FLAG",
                   help="extra flag for decode and colocated workers")
    p.set_defaults(func=lambda a: asyncio.run(up(a)))
