"""The batch runner yields to interactive traffic: while more important requests hold or wait for an admission slot
at this router (and for `quiet_s` after), at most `--batch-busy-concurrency` lines are under way; when the router
is quiet again the batch goes back to `--batch-concurrency`. Every line still runs exactly once. (The serving path
is the router's `answer`; here a function that records how many lines it holds at once — the runner's scheduling
is what is under test, with the router's real Admission, file store and batch store.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from router.batch.runner import BatchRunner, Lease
from router.batch.store import Batches, Files
from router.core.metrics import EndpointRegistry, RouterMetrics
from router.tenancy.admission import Admission


async def _batch(root: Path, lines: int) -> tuple[Files, Batches, str]:
    files, batches = Files(root, 1 << 20, 10), Batches(root, 10)

    async def body():
        for i in range(lines):
            yield (json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "m", "prompt": "hi", "max_tokens": 1}}) + "\n").encode()

    staged, size = await files.stage(body())
    meta = files.commit("t", staged, size, "in.jsonl", "batch")
    return files, batches, batches.create("t", "k", "/v1/completions", meta.id, None).id


def test_batch_lines_yield_to_interactive_requests_and_come_back_when_quiet(tmp_path):
    async def main() -> None:
        files, batches, batch_id = await _batch(tmp_path, 120)
        admission = Admission(64, 64, 30.0, RouterMetrics(EndpointRegistry()))
        held, most = 0, {"busy": 0, "quiet": 0}
        phase = "busy"
        seen: list[str] = []

        async def answer(endpoint: str, body: dict, key_id: str, priority: int) -> tuple[int, dict]:
            nonlocal held
            held += 1
            most[phase] = max(most[phase], held)
            await asyncio.sleep(0.01)
            held -= 1
            seen.append(endpoint)
            return 200, {"id": f"cmpl-{len(seen)}"}

        runner = BatchRunner(batches, files, answer, Lease(None, batches.dir), concurrency=16, priority=1_000_000,
                             busy=lambda: admission.outranked(1_000_000), busy_concurrency=1, quiet_s=0.2)
        async with admission.slot("u", 1.0, 0):  # an interactive request under way
            task = asyncio.create_task(runner._run(batch_id))
            await asyncio.sleep(0.4)
            assert 0 < len(seen) < 120
        phase = "quiet"
        await task
        assert most["busy"] == 1 and most["quiet"] == 16
        b = batches.load(batch_id)
        assert b.status == "completed" and b.request_counts == {"total": 120, "completed": 120, "failed": 0}
        assert b.output_file_id is not None
        lines = files.data(files.get("t", b.output_file_id)).read_text().splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in lines) == sorted(f"l{i}" for i in range(120))

    asyncio.run(main())


def test_a_busy_concurrency_of_zero_pauses_the_batch_while_interactive_requests_are_there(tmp_path):
    async def main() -> None:
        files, batches, batch_id = await _batch(tmp_path, 40)
        admission = Admission(64, 64, 30.0, RouterMetrics(EndpointRegistry()))
        seen: list[str] = []

        async def answer(endpoint: str, body: dict, key_id: str, priority: int) -> tuple[int, dict]:
            await asyncio.sleep(0.01)
            seen.append(endpoint)
            return 200, {"id": f"cmpl-{len(seen)}"}

        runner = BatchRunner(batches, files, answer, Lease(None, batches.dir), concurrency=16, priority=1_000_000,
                             busy=lambda: admission.outranked(1_000_000), busy_concurrency=0, quiet_s=0.2)
        async with admission.slot("u", 1.0, 0):  # an interactive request under way: not one line starts
            task = asyncio.create_task(runner._run(batch_id))
            await asyncio.sleep(0.4)
            assert seen == []
        await task  # quiet: the batch runs to the end
        b = batches.load(batch_id)
        assert b.status == "completed" and b.request_counts == {"total": 40, "completed": 40, "failed": 0}

    asyncio.run(main())


def test_a_burst_of_interactive_requests_pauses_the_batch_and_steady_traffic_lets_one_line_run(tmp_path):
    """`pause_s`: for the first `pause_s` of a stretch of interactive traffic no batch line starts (a burst has
    the fleet to itself); after it `busy_concurrency` lines run (steady traffic cannot starve the batch); a quiet
    gap longer than `quiet_s` ends the stretch, and the next one pauses again."""
    async def main() -> None:
        files, batches, batch_id = await _batch(tmp_path, 400)
        admission = Admission(64, 64, 30.0, RouterMetrics(EndpointRegistry()))
        held, most = 0, 0
        seen: list[str] = []

        async def answer(endpoint: str, body: dict, key_id: str, priority: int) -> tuple[int, dict]:
            nonlocal held, most
            held += 1
            most = max(most, held)
            await asyncio.sleep(0.01)
            held -= 1
            seen.append(endpoint)
            return 200, {"id": f"cmpl-{len(seen)}"}

        runner = BatchRunner(batches, files, answer, Lease(None, batches.dir), concurrency=16, priority=1_000_000,
                             busy=lambda: admission.outranked(1_000_000), busy_concurrency=1, quiet_s=0.2,
                             pause_s=0.5)
        async with admission.slot("u", 1.0, 0):  # a stretch of interactive traffic begins
            task = asyncio.create_task(runner._run(batch_id))
            await asyncio.sleep(0.4)
            assert seen == []  # within pause_s: paused
            await asyncio.sleep(0.5)
            assert seen and most == 1  # past pause_s: one line at a time
        await asyncio.sleep(0.3)  # quiet for longer than quiet_s: the stretch is over
        async with admission.slot("u", 1.0, 0):  # a new burst: paused again
            await asyncio.sleep(0.05)  # (the lines already under way finish)
            n = len(seen)
            await asyncio.sleep(0.3)
            assert len(seen) == n < 400
        await task
        assert batches.load(batch_id).request_counts == {"total": 400, "completed": 400, "failed": 0}

    asyncio.run(main())
