"""Runs batches: every router replica looks for unfinished batches, takes a lease on one, and sends its lines
through the serving path at the batch priority (`--batch-priority`: below interactive requests, so they wait
and are shed first), `--batch-concurrency` at a time.

A lease is a Redis key set if absent with a `--batch-lease` expiry (30 s), renewed every third of it (`Lease`);
without Redis, an exclusive `flock` on the batch's lock file under the shared directory, held while it runs (the
kernel drops it when the process dies: replicas on one host, or a volume whose locks span hosts). A replica that
dies stops renewing, and another takes the batch over within the expiry; a restarted router takes its own batches
back. Nothing is sent twice: each result line's id carries its input line's number (`batch_req_<batch>_<line>`),
and a batch picked up again first reads the lines it already has (a torn last line, from a crash mid-write, is cut
off and sent again).

A line that is not JSON, or does not name the batch's endpoint, or asks to stream, fails alone (a line in
the error file); so does one the model path refuses (its 4xx in the error file, as OpenAI's shape has it).
A line refused because the fleet is busy (429 or 503) is not failed: it waits and is sent again.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from router.batch.store import TERMINAL, Batch, Batches, Files

log = logging.getLogger("splitfire.router")

# (endpoint, body, the batch owner's key id, priority) -> (HTTP status, JSON body)
Answer = Callable[[str, dict[str, Any], str, int], Awaitable[tuple[int, dict[str, Any]]]]
LEASE_TTL_S = 30.0


class Lease:
    """Which replica runs which batch: a Redis key per batch (SET NX PX, renewed while held), or, without
    Redis, an exclusive lock on `<lock_dir>/<batch>.lock` held while it runs."""

    _RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) "
              "else return 0 end")
    _DROP = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"

    def __init__(self, redis: Any, lock_dir: Path, ttl_s: float = LEASE_TTL_S):
        self.redis = redis
        self.lock_dir = lock_dir
        self.ttl_ms = int(ttl_s * 1000)
        self.owner = secrets.token_hex(8)
        self.held: dict[str, int] = {}  # batch -> the lock file's descriptor (-1 with Redis)

    async def take(self, batch_id: str) -> bool:
        if batch_id in self.held:
            return False
        if self.redis is not None:
            if not await self.redis.set(f"splitfire:batch-lease:{batch_id}", self.owner, nx=True, px=self.ttl_ms):
                return False
            self.held[batch_id] = -1
            return True
        fd = os.open(self.lock_dir / f"{batch_id}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.held[batch_id] = fd
        return True

    async def keep(self, batch_id: str) -> bool:
        if self.redis is None:
            return batch_id in self.held
        return bool(await self.redis.eval(self._RENEW, 1, f"splitfire:batch-lease:{batch_id}", self.owner,
                                          self.ttl_ms))

    async def drop(self, batch_id: str) -> None:
        fd = self.held.pop(batch_id, None)
        if fd is not None and fd >= 0:
            os.close(fd)  # (releases the lock)
        if self.redis is not None:
            await self.redis.eval(self._DROP, 1, f"splitfire:batch-lease:{batch_id}", self.owner)


def line_id(batch_id: str, n: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{n}"


def line_problem(obj: Any, endpoint: str) -> str | None:
    """Why an input line cannot be sent, or None."""
    if not isinstance(obj, dict):
        return "a line must be a JSON object with custom_id, method, url and body"
    if not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        return "'custom_id' must be a non-empty string"
    if obj.get("method") != "POST":
        return "'method' must be POST"
    if obj.get("url") != endpoint:
        return f"'url' must be the batch's endpoint {endpoint}, got {obj.get('url')!r}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "'body' must be a JSON object"
    if body.get("stream"):
        return "'stream' is not supported in a batch (results are written to the output file)"
    if "priority" in body:
        return "'priority' is the batch's (--batch-priority); leave it out of the lines"
    return None


def _done(path: Path) -> tuple[set[int], int]:
    """The input lines a results file already holds, and how many; a torn last line is cut off."""
    if not path.exists():
        return set(), 0
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        raw = raw[: raw.rfind(b"\n") + 1]
        path.write_bytes(raw)  # (a crash mid-write: that line is sent again)
    lines = {int(json.loads(line)["id"].rsplit("_", 1)[1]) for line in raw.splitlines() if line.strip()}
    return lines, len(lines)


class BatchRunner:
    def __init__(self, batches: Batches, files: Files, answer: Answer, lease: Lease, concurrency: int, priority: int,
                 poll_s: float = 1.0, busy: Callable[[], bool] = lambda: False, busy_concurrency: int | None = None,
                 quiet_s: float = 1.0, pause_s: float = 0.0):
        self.batches = batches
        self.files = files
        self.answer = answer
        self.lease = lease
        self.concurrency = concurrency
        self.priority = priority
        self.poll_s = poll_s
        # Yielding: while `busy()` (more important requests run or wait at this router) and for `quiet_s` after,
        # the batch pauses (no new line) for the first `pause_s` of that busy stretch, then keeps at most
        # `busy_concurrency` lines under way — a burst of interactive traffic has the fleet to itself, steady
        # traffic cannot starve the batch.
        self.busy = busy
        self.busy_concurrency = concurrency if busy_concurrency is None else busy_concurrency
        self.quiet_s = quiet_s
        self.pause_s = pause_s
        self._busy_at = -math.inf
        self._busy_since = -math.inf  # when the current busy stretch began
        self.running: dict[str, asyncio.Task] = {}
        self.finished: set[str] = set()  # batches seen ended: never read again by the poll

    async def run(self) -> None:
        while True:
            for b in self.batches.all(skip=self.finished):
                if b.status in TERMINAL:
                    self.finished.add(b.id)
                    continue
                if b.id in self.running:
                    continue
                if await self.lease.take(b.id):
                    log.info("event=batch_taken batch=%s tenant=%s status=%s", b.id, b.tenant, b.status)
                    self.running[b.id] = asyncio.create_task(self._guarded(b.id))
            await asyncio.sleep(self.poll_s)

    async def stop(self) -> None:
        tasks = list(self.running.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _guarded(self, batch_id: str) -> None:
        keeper = asyncio.create_task(self._keep(batch_id, asyncio.current_task()))
        try:
            await self._run(batch_id)
        except asyncio.CancelledError:
            log.info("event=batch_paused batch=%s (resumed by the next replica to take it)", batch_id)
            raise
        except Exception:
            log.exception("event=batch_error batch=%s", batch_id)
            b = self.batches.load(batch_id)
            self._end(b, "failed", errors=[{"code": "internal_error", "message": "the batch runner failed; see the "
                                                                                 "router's log"}])
        finally:
            keeper.cancel()
            self.running.pop(batch_id, None)
            await asyncio.shield(self.lease.drop(batch_id))

    async def _keep(self, batch_id: str, runner: asyncio.Task | None) -> None:
        while True:
            await asyncio.sleep(self.lease.ttl_ms / 3000)
            if not await self.lease.keep(batch_id):
                log.warning("event=batch_lease_lost batch=%s", batch_id)
                if runner is not None:
                    runner.cancel()
                return

    def _end(self, b: Batch, status: str, errors: list[dict[str, Any]] | None = None) -> None:
        now = int(time.time())
        if status != "failed":
            b.status = "finalizing"
            b.times["finalizing_at"] = now
            self.batches.save(b)
            for kind, attr in (("output", "output_file_id"), ("errors", "error_file_id")):
                path = self.batches.results(b.id, kind)
                if path.exists() and path.stat().st_size:
                    meta = self.files.adopt(b.tenant, f"{b.id}_{kind}.jsonl", path)
                    setattr(b, attr, meta.id)
                path.unlink(missing_ok=True)
        if errors:
            b.errors = {"object": "list", "data": errors}
        b.status = status
        b.times[f"{status}_at"] = int(time.time())
        self.batches.save(b)
        log.info("event=batch_done batch=%s status=%s total=%d completed=%d failed=%d", b.id, status,
                 b.request_counts["total"], b.request_counts["completed"], b.request_counts["failed"])

    async def _run(self, batch_id: str) -> None:
        b = self.batches.load(batch_id)
        if b.status == "validating":
            try:
                meta = self.files.get(b.tenant, b.input_file_id)
                with open(self.files.data(meta), "rb") as f:
                    total = sum(1 for line in f if line.strip())
            except Exception as e:
                self._end(b, "failed", [{"code": "invalid_input_file", "message": str(e)}])
                return
            if total == 0:
                self._end(b, "failed", [{"code": "empty_file", "message": "the input file has no lines"}])
                return
            b.request_counts = {"total": total, "completed": 0, "failed": 0}
            b.status = "in_progress"
            b.times["in_progress_at"] = int(time.time())
            self.batches.save(b)
        out, errs = self.batches.results(b.id, "output"), self.batches.results(b.id, "errors")
        done_ok, ok = _done(out)
        done_bad, bad = _done(errs)
        done = done_ok | done_bad
        b.request_counts.update(completed=ok, failed=bad)
        self.batches.save(b)
        tasks: set[asyncio.Task] = set()
        stopped = ""

        meta = self.files.get(b.tenant, b.input_file_id)
        with open(self.files.data(meta), "rb") as f:
            for n, raw in enumerate(f):
                if not raw.strip() or n in done:
                    continue
                if self.batches.cancel_asked(b.id) is not None:
                    stopped = "cancelled"
                    break
                if time.time() > b.expires_at:
                    stopped = "expired"
                    break
                await self._room(tasks)
                t = asyncio.create_task(self._line(b, n, raw, out, errs))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*list(tasks))
        if not stopped and self.batches.cancel_asked(b.id) is not None:
            stopped = "cancelled"
        if stopped == "cancelled":
            b.times.setdefault("cancelling_at", self.batches.cancel_asked(b.id) or int(time.time()))
        self._end(b, stopped or "completed")

    def limit(self) -> int:
        """Lines that may be under way now: while more important work is here (or was, within `quiet_s`: the gap
        between one interactive request and the next is not idle) none for the stretch's first `pause_s`, then
        `busy_concurrency`; else `concurrency`."""
        now = time.monotonic()
        if self.busy():
            if now - self._busy_at >= self.quiet_s:
                self._busy_since = now
            self._busy_at = now
        if now - self._busy_at >= self.quiet_s:
            return self.concurrency
        return 0 if now - self._busy_since < self.pause_s else self.busy_concurrency

    async def _room(self, tasks: set[asyncio.Task]) -> None:
        """Wait until fewer than `limit()` lines are under way (re-read every 50 ms while waiting: interactive
        traffic comes and goes without the lines finishing)."""
        while len(tasks) >= self.limit():
            if tasks:
                await asyncio.wait(set(tasks), timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            else:  # (a limit of 0: paused until the router is quiet)
                await asyncio.sleep(0.05)

    async def _line(self, b: Batch, n: int, raw: bytes, out: Path, errs: Path) -> None:
        rid = line_id(b.id, n)
        record: dict[str, Any]
        problem: str | None
        try:
            obj = json.loads(raw)
        except ValueError as e:
            obj, problem = None, f"line {n + 1} is not JSON: {e}"
        else:
            problem = line_problem(obj, b.endpoint)
        custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
        if problem is not None:
            record = {"id": rid, "custom_id": custom_id, "response": None,
                      "error": {"code": "invalid_request", "message": problem}}
            ok = False
        else:
            assert isinstance(obj, dict)
            delay = 0.5
            while True:
                status, body = await self.answer(b.endpoint, obj["body"], b.key_id, self.priority)
                if status not in (429, 503) or self.batches.cancel_asked(b.id) is not None:
                    break
                await asyncio.sleep(delay)  # the fleet is busy (or this band is shed): wait, never fail the line
                delay = min(delay * 2, 10.0)
            ok = status == 200
            record = {"id": rid, "custom_id": custom_id,
                      "response": {"status_code": status, "request_id": str(body.get("id", rid)), "body": body},
                      "error": None if ok else {"code": str((body.get("error") or {}).get("code") or status),
                                                "message": str((body.get("error") or {}).get("message") or "")}}
        with open(out if ok else errs, "a") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        b.request_counts["completed" if ok else "failed"] += 1
        self.batches.save(b)
