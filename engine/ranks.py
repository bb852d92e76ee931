"""Tensor-parallel ranks: one process per rank, rank 0 leading (vLLM's multiprocessing executor, no Ray).

Rank 0 is the process that serves (a worker, or `splitfire generate`): it owns the scheduler, the
block manager and the services, and loads its own shard of the model. The other ranks are child
processes (`python -m engine.ranks`) that load theirs and then only run forwards. Each step, once
rank 0 has prepared the batch, it sends the step's inputs — token ids, positions, the attention
metadata (block tables, KV rows) and the rows to sample — to every other rank over a local
connection (one pickled message; an idle rank blocks on it for as long as the server is idle), and
every rank runs the same forward on its shard. The collectives inside it (two all-reduces per block,
the logits' all-gather) run over a torch.distributed process group made for this group alone (gloo
on CPU; NCCL on CUDA), so several groups can live in one process (tests) without global state.

Failure: rank 0 watches its children; one that dies takes the group down at once — rank 0 logs which
and exits, so the router fails the endpoint's streams over as after a `kill -9`. The children die
with rank 0 (the kernel's parent-death signal) or when its connection closes. Collectives time out
after `COLLECTIVE_TIMEOUT_S` (a rank that hangs instead of dying).
"""

from __future__ import annotations

import dataclasses
import datetime
import hmac
import json
import logging
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from common.errors import EngineError
from engine.engine_config import EngineConfig
from engine.model.collectives import (
    Collectives,
    ProcessGroupCollectives,
    SharedMemoryCollectives,
    shared_memory_supported,
)
from engine.model.kv_cache import KVCache, KVLayout
from engine.model.parallel import Shard

log = logging.getLogger("splitfire.engine")

COLLECTIVE_TIMEOUT_S = 300.0  # a step's collectives: far above any step, short enough to notice a hung rank
START_TIMEOUT_S = 600.0  # every rank connected and its shard loaded


class RankFailed(EngineError):
    """A rank of the tensor-parallel group died or stopped answering."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_group(device: torch.device, rank: int, size: int, port: int) -> tuple[Any, Any]:
    """A process group of its own (not torch.distributed's global one) over a TCP store on rank 0, and
    the store (which must outlive the group)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
    return group, store


class _NotYet:
    """A shared-memory group's fallback until the process group exists (nothing runs before it does)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("collective before the process group exists")

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("collective before the process group exists")


def _collectives(group: Any, size: int, shm: SharedMemoryCollectives | None) -> Collectives:
    reference = ProcessGroupCollectives(group, size)
    if shm is None:
        return reference
    shm.fallback = reference
    return shm


def _shared_memory_slot(config: EngineConfig, size: int, hidden: int, vocab: int) -> int:
    """Bytes of a rank's slot for the shared-memory collectives (0: use the process group): the largest
    all-reduce (a step's tokens x hidden) or logits all-gather (a step's sampled rows x the rank's
    vocabulary slice) in float32, capped at 64 MiB (larger ones go through the process group).
    SPLITFIRE_TP_COLLECTIVES=gloo turns them off."""
    if (config.torch_device.type != "cpu" or not shared_memory_supported() or not hidden
            or os.environ.get("SPLITFIRE_TP_COLLECTIVES", "shm") == "gloo"):
        return 0
    rows = config.max_num_batched_tokens
    return min(max(rows * hidden, config.max_num_seqs * -(-vocab // size)) * 4, 64 * 2**20)


def threads_per_rank(config: EngineConfig, size: int) -> int:
    """CPU threads each rank computes with: --threads, else this process's cores shared out evenly."""
    if config.threads:
        return config.threads
    return max(1, len(os.sched_getaffinity(0)) // size)


class RankGroup:
    """Rank 0's side: starts the other ranks, sends them each step, stops them."""

    def __init__(self, config: EngineConfig, model_dir: Path, size: int, hidden: int = 0, vocab: int = 0):
        """`hidden`, `vocab`: the model's, to size the shared-memory collectives' slots."""
        self.size = size
        self.device = config.torch_device
        self.closing = False
        port = _free_port()
        self.key = secrets.token_bytes(16)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(1.0)
        self.shm: SharedMemoryCollectives | None = None
        shm = _shared_memory_slot(config, size, hidden, vocab)
        if shm:
            name = f"sf-tp-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                self.shm = SharedMemoryCollectives(name, 0, size, shm, _NotYet(), create=True)
            except OSError as e:  # (a small /dev/shm, e.g. a container's 64 MB)
                log.warning("event=tp_shared_memory_off bytes=%d error=%s (collectives through gloo)",
                            2 * size * shm, e)
        spec = {"config": dataclasses.asdict(config), "model_dir": str(model_dir), "size": size, "port": port,
                "address": list(self.listener.getsockname()), "key": self.key.hex(),
                "shm": [self.shm.shm.name, self.shm.slot_bytes] if self.shm is not None else None}
        env = {**os.environ, "SPLITFIRE_RANK_SPEC": json.dumps(spec)}
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            self.procs.append(subprocess.Popen([sys.executable, "-m", "engine.ranks", str(rank)], env=env))
        self.conns: list[Connection] = []
        self._accept(size - 1)
        self.group, self.store = _process_group(self.device, 0, size, port)
        self.shard = Shard(0, size, _collectives(self.group, size, self.shm), config.enable_expert_parallel)
        log.info("event=ranks_started tensor_parallel=%d pids=%s", size, [p.pid for p in self.procs])

    def _accept(self, n: int) -> None:
        """The other ranks' connections, in rank order: each first sends the group's key and its rank
        (anything else connecting is dropped unread)."""
        by_rank: dict[int, Connection] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(by_rank) < n:
            dead = [r for r, p in enumerate(self.procs, start=1) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.close()
                raise RankFailed(f"tensor parallel: rank(s) {dead} exited while starting (see the log above)" if dead
                                 else f"tensor parallel: {n - len(by_rank)} rank(s) did not connect in "
                                      f"{START_TIMEOUT_S:.0f} s")
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            conn = Connection(sock.detach())
            hello = conn.recv_bytes(64) if conn.poll(10) else b""
            if len(hello) == 20 and hmac.compare_digest(hello[:16], self.key):
                by_rank[int.from_bytes(hello[16:], "big")] = conn
            else:
                conn.close()
        self.conns = [by_rank[r] for r in range(1, n + 1)]

    def _watch_rank(self, rank: int, proc: subprocess.Popen) -> None:
        rc = proc.wait()
        if self.closing:
            return
        log.error("event=rank_failed rank=%d pid=%d rc=%s: the tensor-parallel group goes down with it", rank,
                  proc.pid, rc)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        os._exit(70)  # (EX_SOFTWARE) every stream on this endpoint fails over; nothing can finish here

    def setup(self, layout: KVLayout, max_positions: int, int8_activations: bool) -> None:
        """Every rank allocates its KV cache (rank 0 sized it) and builds its RoPE tables; returns once all are
        ready to step."""
        self._send(("setup", layout, max_positions, int8_activations))
        for r, conn in enumerate(self.conns, start=1):
            try:
                ready = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError) as e:
                self.close()
                raise RankFailed(f"tensor parallel rank {r} exited while loading (see its log above)") from e
            if ready != "ready":
                self.close()
                raise RankFailed(f"tensor parallel rank {r}: {ready}")
        # From here on a rank's death is fatal (during start-up it is an error the caller reports).
        for r, p in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch_rank, args=(r, p), daemon=True, name=f"rank-{r}-watch").start()

    def step(self, plan: tuple) -> None:
        """This step's inputs to every other rank (`ModelRunner.broadcast`)."""
        self._send(plan)

    def _send(self, msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for r, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise RankFailed(f"tensor parallel rank {r} is gone: {e}") from e

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
                conn.close()
            except OSError:
                pass  # (already gone: it is being reaped below)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        self.listener.close()
        if self.shm is not None:
            self.shm.close()
        self.group = self.store = None


def follower(rank: int) -> None:
    """A rank other than 0: load this rank's shard, then run forwards as rank 0 sends them."""
    spec = json.loads(os.environ["SPLITFIRE_RANK_SPEC"])
    if sys.platform == "linux":  # die with rank 0, whatever kills it
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    from common.logs import setup_logging
    from engine.loading.weights import load_model

    setup_logging()
    config = EngineConfig(**spec["config"])
    size = spec["size"]
    sock = socket.create_connection(tuple(spec["address"]))
    conn = Connection(sock.detach())
    conn.send_bytes(bytes.fromhex(spec["key"]) + rank.to_bytes(4, "big"))
    device = config.torch_device
    torch.set_num_threads(threads_per_rank(config, size))
    group, store = _process_group(device, rank, size, spec["port"])
    shm = (SharedMemoryCollectives(spec["shm"][0], rank, size, spec["shm"][1], _NotYet(), create=False)
           if spec["shm"] else None)
    try:
        model = load_model(spec["model_dir"], device, config.torch_dtype, config.quantization,
                           shard=Shard(rank, size, _collectives(group, size, shm), config.enable_expert_parallel))
    except Exception as e:
        conn.send_bytes(pickle.dumps(f"cannot load its shard: {type(e).__name__}: {e}"))
        raise
    _, layout, max_positions, int8_activations = pickle.loads(conn.recv_bytes())
    model.build_rope_cache(max_positions, device, config.torch_dtype)
    model.set_int8_activations(int8_activations)
    kv = KVCache(layout, device)
    conn.send_bytes(pickle.dumps("ready"))
    log.info("event=rank_ready rank=%d of=%d kv_blocks=%d", rank, size, layout.num_blocks)
    with torch.inference_mode():
        while True:
            try:
                plan = pickle.loads(conn.recv_bytes())
            except EOFError:
                return  # rank 0 closed the group
            if plan is None:
                break
            ids, positions, meta, rows = plan
            hidden = model(ids, positions, kv, meta)
            if rows:
                model.logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=device)))
    if shm is not None:
        shm.close()
    del group, store


if __name__ == "__main__":
    follower(int(sys.argv[1]))
