"""Starting real splitfire processes for tests: free ports, readiness, clean shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.stack import free_port

ROOT = Path(__file__).resolve().parent.parent
STARTED: list[subprocess.Popen] = []  # every process a test started; conftest kills leftovers at exit


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    ports: dict[str, int] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log():
                return
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log()[-3000:]}")

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.popen.kill()
            self.popen.wait(10)

    def stop(self, timeout: float = 15.0) -> int:
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode


def stop_all(*procs: Proc, timeout: float = 15.0) -> list[int]:
    """SIGTERM every process first, then wait: their shutdowns overlap (a Mooncake engine alone
    takes ~1 s to tear down)."""
    for p in procs:
        if p.alive:
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.popen.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
    return [p.popen.returncode for p in procs]


def spawn(name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Proc:
    log_path = log_dir / f"{name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "MC_LOG_LEVEL": "ERROR", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    f = open(log_path, "w")
    popen = subprocess.Popen([sys.executable, "-m", "splitfire_cli", *args], stdout=f, stderr=subprocess.STDOUT,
                             env=full_env, cwd=ROOT, start_new_session=True)
    STARTED.append(popen)
    return Proc(name, popen, log_path)


def start_worker(role: str, model_dir: Path, log_dir: Path, *extra: str, name: str | None = None,
                 wait: bool = True) -> Proc:
    for attempt in range(3):
        grpc_port = free_port()
        metrics_port = free_port(avoid={grpc_port})
        cmd = {"prefill": "prefill", "decode": "decode", "both": "serve"}[role]
        args = [cmd, "--model", str(model_dir), "--device", "cpu", "--grpc-port", str(grpc_port),
                "--metrics-port", str(metrics_port), "--host", "127.0.0.1", "--kv-cache-gb", "0.01", "--threads", "1",
                *extra]
        p = spawn(name or f"{role}-{grpc_port}", args, log_dir)
        p.ports = {"grpc": grpc_port, "metrics": metrics_port}
        if not wait:
            return p
        try:
            p.wait_for("worker ready")
            return p
        except RuntimeError:
            # A port free when picked can be taken before the worker binds it (another test's process, a
            # Mooncake engine's own listener): pick again. Anything else is the test's failure.
            if "address already in use" not in p.log().lower() or attempt == 2:
                raise
    raise AssertionError("unreachable")


def address(p: Proc) -> str:
    return f"127.0.0.1:{p.ports['grpc']}"


def start_redis(log_dir: Path, port: int | None = None) -> Proc:
    import shutil

    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (make setup installs Debian's redis-server)")
    port = port or free_port()
    log_path = log_dir / f"redis-{port}.log"
    f = open(log_path, "w")
    popen = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    STARTED.append(popen)
    p = Proc(f"redis-{port}", popen, log_path, {"port": port})
    p.wait_for("Ready to accept connections", timeout=20)
    return p


def start_router(model_dir: Path, log_dir: Path, *extra: str, name: str | None = None) -> Proc:
    for attempt in range(3):
        port = free_port()
        p = spawn(name or f"router-{port}", ["router", "--model", str(model_dir), "--host", "127.0.0.1",
                                             "--port", str(port), "--health-interval", "0.5", *extra], log_dir)
        p.ports = {"http": port}
        try:
            p.wait_for("router ready")
            return p
        except RuntimeError:  # (the port taken between picking and binding: pick again, as start_worker does)
            if "address already in use" not in p.log().lower() or attempt == 2:
                raise
    raise AssertionError("unreachable")


def base_url(p: Proc) -> str:
    return f"http://127.0.0.1:{p.ports['http']}"


def start_kv_master(log_dir: Path, port: int | None = None) -> Proc:
    """A real mooncake_master (the cluster-wide KV store's control plane), ready to accept clients."""
    from kvtransfer.store import master_command

    port = port or free_port()
    log_path = log_dir / f"kv-master-{port}.log"
    f = open(log_path, "w")
    popen = subprocess.Popen(master_command(port, free_port(avoid={port})), stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    STARTED.append(popen)
    p = Proc(f"kv-master-{port}", popen, log_path, {"rpc": port})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {popen.returncode}:\n{p.log()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return p
        time.sleep(0.05)
    raise TimeoutError(f"mooncake_master not listening on {port}:\n{p.log()[-2000:]}")
