"""Bringing a whole splitfire deployment up for a benchmark (via `splitfire up`), and down again."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent


def serve_app(app: web.Application, port: int, banner: str) -> None:
    """Runs a benchmark's helper server (fake upstream, minimal proxy) on uvloop when installed, and
    prints the banner the harness waits for once it listens (a harness that took the banner for a bound
    port measured another process in CI when the bind then failed). Runs until the process is stopped."""
    from aiohttp import web

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print(banner, flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


def free_port(avoid: Collection[int] = ()) -> int:
    """A port nothing listens on, for a process started next to bind. Drawn below the kernel's ephemeral
    range (from /proc), so no outgoing connection can be handed it between now and the bind — the race
    that `bind(0)` then close leaves open (seen in CI as EADDRINUSE). `avoid`: ports already picked for
    the same process, not bound yet (two draws can meet: seen in CI as a worker given one port twice)."""
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    pick = random.Random()  # (its own: tests seed the global generator)
    for _ in range(200):
        port = pick.randrange(max(1024, low - 12000), low)
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (a machine whose low ports are all taken: the old way)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    def __init__(self, name: str, args: list[str], log_dir: Path, kv_store: bool = False):
        """`kv_store`: with the workers' shared KV store (mooncake_master); off unless a benchmark
        measures it, so every other row is what it names."""
        if not kv_store:
            args = [*args, "--no-kv-store"]
        self.name = name
        self.port = free_port()
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPLITFIRE_LOG_LEVEL": os.environ.get("SPLITFIRE_LOG_LEVEL", "WARNING")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "splitfire_cli", "up", "--port", str(self.port), *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "splitfire is ready" in self.log_path.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready in {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()

    def __enter__(self) -> Stack:
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
