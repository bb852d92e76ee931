"""Model-parallel ranks: one process per rank, rank 0 leading (vLLM's multiprocessing executor, no Ray).

Ranks are laid out `pp` pipeline stages of `tp` tensor-parallel ranks (rank = stage * tp + tp rank).
Rank 0 — the first stage's first rank — is the process that serves (a worker, or `splitfire
generate`): it owns the scheduler, the block manager and the services, and loads its own part of the
model. The other ranks are child processes (`python -m engine.ranks`) that load theirs and then only
run forwards. Each step, once rank 0 has prepared the batch, it sends the step's inputs — token ids,
positions, the attention metadata (block tables, KV rows) and the rows to sample — to every other
rank over a local connection (one pickled message; an idle rank blocks on it for as long as the
server is idle). Tensor parallel: every rank of a stage runs the same forward on its shard; the
collectives inside it (two all-reduces per block, the logits' all-gather) run within the stage
(`engine/model/collectives.py`: shared memory on a CPU host, a private gloo process group beside it;
NCCL on CUDA), so several groups can live in one process (tests) without global state. Pipeline
parallel: the step's batch goes in micro-batches; each stage takes a micro-batch's hidden states and
residual stream from the stage before (shared-memory channels), runs its layers and hands them on,
so every stage has a micro-batch to work on while the next takes the previous; the last stage sends
the sampled rows' logits back to rank 0, which samples.

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
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import torch

from common.errors import EngineError
from engine.engine_config import EngineConfig
from engine.model.collectives import (
    Collectives,
    ProcessGroupCollectives,
    SharedMemoryChannel,
    SharedMemoryCollectives,
    shared_memory_supported,
)
from engine.model.decoder import DecoderModel
from engine.model.kv_cache import KVCache, KVLayout
from engine.model.parallel import Shard, Stage

log = logging.getLogger("splitfire.engine")

COLLECTIVE_TIMEOUT_S = 300.0  # a step's collectives: far above any step, short enough to notice a hung rank
START_TIMEOUT_S = 600.0  # every rank connected and its shard loaded


class RankFailed(EngineError):
    """A rank of the model-parallel group died or stopped answering."""


class RankExtension(Protocol):
    """What a serving role adds to the ranks other than 0 (a prefill or decode worker's KV transfer:
    `worker/kv/rank.py`, `prefill_worker/kv_sender.py`). Rank 0 sends a step's `payload` beside its
    inputs (`RankGroup.attach`); a rank that got one runs the step with these hooks and answers with
    `after_forward`'s result (`RankGroup.collect`)."""

    def on_ready(self, kv: KVCache) -> Any:
        """The rank's KV cache exists: returns what rank 0 should know of it (`RankGroup.rank_info`)."""
        ...

    def before_forward(self, payload: Any) -> None: ...

    def after_layer(self, layer: int) -> None: ...

    def after_forward(self) -> Any: ...

    def close(self) -> None: ...


def _process_group(device: torch.device, rank: int, size: int, store: Any) -> Any:
    """A process group of its own (not torch.distributed's global one) over `store`."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _store(rank: int, world: int, port: int) -> Any:
    """The world's TCP store, served by rank 0 on a port the system picks (`port` 0: no window between
    choosing a free port and binding it); it must outlive every group made over it."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
                         wait_for_workers=False)


def _stage_group(device: torch.device, store: Any, stage: int, tp_rank: int, tp: int) -> Any:
    import torch.distributed as dist

    return _process_group(device, tp_rank, tp, dist.PrefixStore(f"stage{stage}", store)) if tp > 1 else None


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
    if (config.torch_device.type != "cpu" or not shared_memory_supported() or not hidden or size < 2
            or os.environ.get("SPLITFIRE_TP_COLLECTIVES", "shm") == "gloo"):
        return 0
    rows = config.max_num_batched_tokens
    return min(max(rows * hidden, config.max_num_seqs * -(-vocab // size)) * 4, 64 * 2**20)


def _sampled_rows(config: EngineConfig) -> int:
    """The most rows a step samples: one per sequence, or a verification's k + 1 per drafting one."""
    return max(config.max_num_seqs, config.speculative_max_batch * (config.num_speculative_tokens + 1))


@dataclass(frozen=True)
class RankMain:
    """What the ranks other than 0 run: `python -m module RANK` with `env` added to the environment
    (this module's `follower`, or a serving role's main that gives it a `RankExtension`)."""

    module: str = "engine.ranks"
    env: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Names:
    """The shared-memory segments a group's ranks meet in (made by rank 0, named in the spec)."""

    collectives: list[str | None]  # per stage (tensor parallel within it)
    slot: int  # bytes per rank's collective slot
    hand_offs: list[list[str]]  # [stage][tp rank] -> to the same tp rank of the next stage
    hand_off_bytes: int
    logits: str  # the last stage's first rank -> rank 0
    logits_bytes: int


def threads_per_rank(config: EngineConfig, size: int) -> int:
    """CPU threads each rank computes with: --threads, else this process's cores shared out evenly."""
    if config.threads:
        return config.threads
    return max(1, len(os.sched_getaffinity(0)) // size)


class RankGroup:
    """Rank 0's side: starts the other ranks, sends them each step, stops them."""

    def __init__(self, config: EngineConfig, model_dir: Path, tp: int, pp: int = 1, hidden: int = 0,
                 vocab: int = 0, stages: list[range] | None = None, main: RankMain | None = None):
        """`hidden`, `vocab`: the model's, to size the shared-memory slots; `stages`: each pipeline
        stage's layers (`parallel.split_layers`); `main`: what the other ranks run."""
        self.tp, self.pp, self.size = tp, pp, tp * pp
        self.device = config.torch_device
        self.closing = False
        self.segments: list[Any] = []  # shared memory this process made (unlinked on close)
        self.store = _store(0, self.size, 0)  # (before the ranks start: they are told its port)
        port = self.store.port
        self.key = secrets.token_bytes(16)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(1.0)
        names = self._segments(config, hidden, vocab)
        self.stages = stages or [range(0)]
        spec = {"config": dataclasses.asdict(config), "model_dir": str(model_dir), "tp": tp, "pp": pp, "port": port,
                "address": list(self.listener.getsockname()), "key": self.key.hex(),
                "stages": [[s.start, s.stop] for s in self.stages] if stages else None,
                "names": dataclasses.asdict(names)}
        main = main or RankMain()
        env = {**os.environ, **main.env, "SPLITFIRE_RANK_SPEC": json.dumps(spec)}
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, self.size):
            self.procs.append(subprocess.Popen([sys.executable, "-m", main.module, str(rank)], env=env))
        self.conns: list[Connection] = []
        self.rank_info: list[Any] = []  # per rank from 1: its extension's `on_ready` (None without one)
        self._payload: Any = None  # the next step's, for the ranks' extensions
        self._answers_due = False
        self._accept(self.size - 1)
        self.group = _stage_group(self.device, self.store, 0, 0, tp)
        shm = self._shm_collectives
        self.shard = (Shard(0, tp, _collectives(self.group, tp, shm), config.enable_expert_parallel) if tp > 1
                      else Shard())
        self.stage = Stage(0, pp, self.stages[0]) if pp > 1 else Stage()
        self.hand_off = self._channels.get(names.hand_offs[0][0]) if pp > 1 else None
        self.logits_in = self._channels.get(names.logits) if pp > 1 else None
        log.info("event=ranks_started tensor_parallel=%d pipeline_parallel=%d stages=%s pids=%s", tp, pp,
                 [f"{s.start}-{s.stop - 1}" for s in self.stages] if stages else "-", [p.pid for p in self.procs])

    def _segments(self, config: EngineConfig, hidden: int, vocab: int) -> Names:
        """Make the shared memory the ranks meet in: each stage's collectives, the stage hand-offs, the
        logits' way back."""
        base = f"sf-mp-{os.getpid()}-{secrets.token_hex(4)}"
        slot = _shared_memory_slot(config, self.tp, hidden, vocab)
        collectives: list[str | None] = []
        self._shm_collectives: SharedMemoryCollectives | None = None
        for s in range(self.pp):
            name = f"{base}-c{s}" if slot else None
            if name is not None:
                try:
                    seg = SharedMemoryCollectives(name, 0, self.tp, slot, _NotYet(), create=True)
                except OSError as e:  # (a small /dev/shm, e.g. a container's 64 MB)
                    log.warning("event=tp_shared_memory_off bytes=%d error=%s (collectives through gloo)",
                                2 * self.tp * slot, e)
                    name = None
                else:
                    self.segments.append(seg)
                    if s == 0:
                        self._shm_collectives = seg  # (rank 0's own: it is stage 0's rank 0)
            collectives.append(name)
        hand_bytes = 2 * config.max_num_batched_tokens * hidden * 4
        logit_bytes = _sampled_rows(config) * vocab * 4
        hand_offs = [[f"{base}-h{s}-{r}" for r in range(self.tp)] for s in range(self.pp - 1)]
        self._channels: dict[str, SharedMemoryChannel] = {}
        if self.pp > 1:
            for name, size in [*((n, hand_bytes) for row in hand_offs for n in row), (f"{base}-logits", logit_bytes)]:
                self._channels[name] = SharedMemoryChannel(name, size, create=True)
                self.segments.append(self._channels[name])
        return Names(collectives, slot, hand_offs, hand_bytes, f"{base}-logits", logit_bytes)

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
        log.error("event=rank_failed rank=%d pid=%d rc=%s: the model-parallel group goes down with it", rank,
                  proc.pid, rc)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        os._exit(70)  # (EX_SOFTWARE) every stream on this endpoint fails over; nothing can finish here

    def setup(self, layout: KVLayout, max_positions: int, int8_activations: bool) -> None:
        """Every rank allocates its KV cache (rank 0 sized its blocks; a stage holds its own layers) and
        builds its RoPE tables; returns once all are ready to step."""
        self._send(("setup", layout, max_positions, int8_activations))
        for r, conn in enumerate(self.conns, start=1):
            try:
                ready = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError) as e:
                self.close()
                raise RankFailed(f"tensor parallel rank {r} exited while loading (see its log above)") from e
            if not (isinstance(ready, tuple) and ready[0] == "ready"):
                self.close()
                raise RankFailed(f"tensor parallel rank {r}: {ready}")
            self.rank_info.append(ready[1])
        # From here on a rank's death is fatal (during start-up it is an error the caller reports).
        for r, p in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch_rank, args=(r, p), daemon=True, name=f"rank-{r}-watch").start()

    def step(self, plan: tuple) -> None:
        """This step's inputs to every other rank (`ModelRunner.broadcast`; tensor parallel only), with
        the payload attached for their extensions, if any."""
        payload, self._payload = self._payload, None
        self._send(("step", plan, payload))
        self._answers_due = payload is not None

    def lora(self, op: tuple) -> None:
        """A LoRA adapter placed in or freed from a slot on rank 0: every other rank does the same with
        its own slices (between steps: the engine thread sends it). An install waits for every rank's
        answer: a rank that cannot take the adapter (under pipeline parallelism rank 0 reads only its own
        stage's layers) answers why, the ranks that took it drop it again, and LoRAError names the rank."""
        self._send(("lora", op))
        if op[0] != "install":
            return
        refused = []
        for r, conn in enumerate(self.conns, start=1):
            try:
                answer = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError) as e:
                raise RankFailed(f"tensor parallel rank {r} is gone: {e}") from e
            if answer is not None:
                refused.append(f"rank {r}: {answer}")
        if refused:
            self._send(("lora", ("drop", op[1])))
            from engine.loading.lora_adapters import LoRAError

            raise LoRAError("; ".join(refused))

    def land(self, op: tuple[list[int], list[int], list[tuple[int, int, int]]]) -> None:
        """K/V that landed in spare blocks: every other rank moves its sections into place
        (`KVCache.land`) before the next step (between steps: the engine thread sends it)."""
        self._send(("land", op))

    def attach(self, payload: Any) -> None:
        """Send `payload` with the next step (before the step runs: a `StepObserver.before_forward`)."""
        self._payload = payload

    def collect(self) -> list[Any]:
        """The other ranks' extensions' answers to the step that carried a payload (in rank order),
        once each has finished it; [] when the last step carried none."""
        if not self._answers_due:
            return []
        self._answers_due = False
        out = []
        for r, conn in enumerate(self.conns, start=1):
            try:
                out.append(pickle.loads(conn.recv_bytes()))
            except (EOFError, OSError) as e:
                raise RankFailed(f"tensor parallel rank {r} is gone: {e}") from e
        return out

    def pipeline(self, model: DecoderModel, kv: KVCache
                 ) -> Callable[[list[tuple], Callable[[int], None] | None], list[torch.Tensor]]:
        """`ModelRunner.pipeline`: the first stage's part of a step's micro-batches, and their logits back.
        With a layer hook (a prefill worker's KV writes), every stage calls it (its extension's
        `after_layer`) for each of its layers once all micro-batches are through them."""
        assert self.hand_off is not None and self.logits_in is not None
        out, back = self.hand_off, self.logits_in

        def run(plans: list[tuple], hook: Callable[[int], None] | None = None) -> list[torch.Tensor]:
            payload, self._payload = self._payload, None
            self._send(("pp", plans, payload))
            self._answers_due = payload is not None
            expected = sum(1 for plan in plans if plan[3])
            logits: list[torch.Tensor] = []
            for ids, positions, meta, _ in plans:
                x, residual = model(ids, positions, kv, meta)
                while not out.free():  # (the last stage may be waiting for rank 0 to take its logits)
                    if back.ready():
                        logits.append(back.recv()[0])
                out.send([x, residual])
            if hook is not None:
                for i in range(len(model.layers)):
                    hook(i)
            while len(logits) < expected:
                logits.append(back.recv()[0])
            return logits

        return run

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
        for seg in self.segments:
            seg.close()
        self.group = self.store = None


def follower(rank: int, extension: RankExtension | None = None) -> None:
    """A rank other than 0: load this rank's part, then run forwards as rank 0 sends them (with
    `extension`'s hooks around a step that carries a payload for it)."""
    if sys.platform == "linux":  # die with rank 0, whatever kills it
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    from common.logs import setup_logging

    setup_logging()
    f = Follower(rank, json.loads(os.environ["SPLITFIRE_RANK_SPEC"]), extension)
    f.start()
    try:
        f.serve()
    finally:
        f.close()


class Follower:
    """One rank other than 0, in steps: `start` (join rank 0, load this rank's part and its adapters, say
    ready), `serve` (each message from rank 0: an adapter change, landed pages, a tensor-parallel step, or a
    pipeline stage's micro-batches), `close`."""

    def __init__(self, rank: int, spec: dict[str, Any], extension: RankExtension | None):
        self.rank, self.spec, self.extension = rank, spec, extension
        self.config = EngineConfig(**spec["config"])
        self.tp, self.pp = spec["tp"], spec["pp"]
        self.names = Names(**spec["names"])
        self.stage_index, self.tp_rank = divmod(rank, self.tp)
        self.device = self.config.torch_device
        self.loras: Any = None

    def start(self) -> None:
        from engine.loading.weights import load_model

        spec, names, s, tp, pp, config = self.spec, self.names, self.stage_index, self.tp, self.pp, self.config
        sock = socket.create_connection(tuple(spec["address"]))
        self.conn = Connection(sock.detach())
        self.conn.send_bytes(bytes.fromhex(spec["key"]) + self.rank.to_bytes(4, "big"))
        torch.set_num_threads(threads_per_rank(config, tp * pp))
        self.store = _store(self.rank, tp * pp, spec["port"])
        self.group = _stage_group(self.device, self.store, s, self.tp_rank, tp)
        self.shm = (SharedMemoryCollectives(names.collectives[s], self.tp_rank, tp, names.slot, _NotYet(), create=False)
                    if names.collectives[s] else None)
        shard = (Shard(self.tp_rank, tp, _collectives(self.group, tp, self.shm), config.enable_expert_parallel)
                 if tp > 1 else Shard())
        stage = Stage(s, pp, range(*spec["stages"][s])) if pp > 1 else Stage()
        self.take = (SharedMemoryChannel(names.hand_offs[s - 1][self.tp_rank], names.hand_off_bytes, False)
                     if s > 0 else None)
        self.give = (SharedMemoryChannel(names.hand_offs[s][self.tp_rank], names.hand_off_bytes, False)
                     if s < pp - 1 else None)
        self.logits_out = (SharedMemoryChannel(names.logits, names.logits_bytes, False)
                           if pp > 1 and stage.last and self.tp_rank == 0 else None)
        self.model = self._checked("cannot load its part", lambda: load_model(
            spec["model_dir"], self.device, config.torch_dtype, config.quantization, shard=shard, stage=stage,
            compress_weights=config.compress_weights))
        _, layout, max_positions, int8_activations = pickle.loads(self.conn.recv_bytes())
        layout = dataclasses.replace(layout, num_layers=len(self.model.layers))
        self.model.build_rope_cache(max_positions, self.device, config.torch_dtype)
        self.model.set_int8_activations(int8_activations)
        self.kv = KVCache(layout, self.device)
        if config.lora:  # the same adapters in the same slots as rank 0, this rank's slices of them
            self._start_loras()
        ext = self.extension
        info = self._checked("cannot start its KV transfer", lambda: ext.on_ready(self.kv)) if ext is not None else None
        self.conn.send_bytes(pickle.dumps(("ready", info)))
        log.info("event=rank_ready rank=%d of=%d stage=%d layers=%s kv_blocks=%d", self.rank, tp * pp, s,
                 f"{self.model.layer_ids.start}-{self.model.layer_ids.stop - 1}", layout.num_blocks)

    def _checked(self, what: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, or rank 0 told why not (then the error raised here too)."""
        try:
            return fn()
        except Exception as e:
            self.conn.send_bytes(pickle.dumps(f"{what}: {type(e).__name__}: {e}"))
            raise

    def _start_loras(self) -> None:
        from engine.loras import LoRAManager

        c = self.config
        self.loras = LoRAManager(self.model, c.max_loras, c.max_lora_rank, c.lora_dtype == "float16")
        for name, path in c.lora_modules.items():
            self._checked(f"cannot load --lora-modules {name}={path}", lambda n=name, p=path: self.loras.load(n, p))

    def serve(self) -> None:
        with torch.inference_mode():
            while True:
                try:
                    msg = pickle.loads(self.conn.recv_bytes())
                except EOFError:
                    return  # rank 0 closed the group
                if msg is None:
                    return
                kind, plan = msg[0], msg[1]
                if kind == "lora":
                    self._lora(plan)
                elif kind == "land":
                    landing, dst, sections = plan
                    self.kv.land(landing, dst, [(h, n) for r, h, n in sections if r == self.rank])
                elif kind == "step":  # tensor parallel only: the stage is the whole model
                    self._step(plan, msg[2])
                else:  # "pp": the step's micro-batches, in order
                    self._stage(plan, msg[2] if len(msg) > 2 else None)

    def _lora(self, plan: tuple) -> None:
        from engine.loading.lora_adapters import LoRAError, read_adapter

        loras = self.loras
        assert loras is not None
        if plan[0] == "install":  # answered: None, or why this rank's layers cannot take it
            _, name, path, slot = plan
            try:
                loras.install(read_adapter(name, path, self.model, self.config.max_lora_rank), slot=slot)
            except LoRAError as e:
                self.conn.send_bytes(pickle.dumps(str(e)))
            else:
                self.conn.send_bytes(pickle.dumps(None))
        elif plan[0] == "drop":  # another rank refused it: dropped where it was taken
            if plan[1] in loras.adapters:
                loras.free_now(plan[1])
        else:
            loras.free_now(plan[1])

    def _rows(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _step(self, plan: tuple, payload: Any) -> None:
        """A tensor-parallel step (with `payload`: the extension's hooks around it, answered after the logits'
        collective, when rank 0 is past it)."""
        ids, positions, meta, rows = plan
        ext = self.extension
        if payload is None or ext is None:
            hidden = self.model(ids, positions, self.kv, meta)
        else:
            ext.before_forward(payload)
            hidden = self.model(ids, positions, self.kv, meta, ext.after_layer)
        if rows:
            self.model.logits(hidden.index_select(0, self._rows(rows)))
        if payload is not None:
            self.conn.send_bytes(pickle.dumps(ext.after_forward() if ext is not None else None))

    def _stage(self, plan: list, payload: Any) -> None:
        """This pipeline stage's layers over each micro-batch: hidden states taken from the stage before and
        given to the next, the last stage's logits to rank 0."""
        ext = self.extension
        if payload is not None and ext is not None:
            ext.before_forward(payload)
        for ids, positions, meta, rows in plan:
            carry = tuple(self.take.recv()) if self.take is not None else None
            out = self.model(ids, positions, self.kv, meta, carry=carry)
            if self.give is not None:
                self.give.send(list(out))
            elif rows:
                logits = self.model.logits(out.index_select(0, self._rows(rows)))
                if self.logits_out is not None:
                    self.logits_out.send([logits])
        if payload is not None:  # this stage's layers are computed for every micro-batch: its writes
            if ext is not None:
                for i in range(len(self.model.layers)):
                    ext.after_layer(i)
            self.conn.send_bytes(pickle.dumps(ext.after_forward() if ext is not None else None))

    def close(self) -> None:
        for seg in (getattr(self, n, None) for n in ("shm", "take", "give", "logits_out")):
            if seg is not None:
                seg.close()
        if self.extension is not None:
            self.extension.close()
        self.group = self.store = None


if __name__ == "__main__":
    follower(int(sys.argv[1]))
