"""A small gRPC client for tests: collect a Generate stream, read Stats."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pbg


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    events: int = 0
    finish_reason: str = ""
    prefill_mode: str = ""
    prefill_reason: str = ""
    usage: pb.Usage | None = None


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    kw.setdefault("ignore_eos", True)
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


async def generate(address: str, ids: list[int], sampling: pb.SamplingParams, prefill: str = "", rid: str = "",
                   tenant: str = "", model: str = "") -> Collected:
    async with grpc.aio.insecure_channel(address) as ch:
        out = Collected()
        req = pb.GenerateRequest(request_id=rid, token_ids=ids, sampling=sampling, prefill_endpoint=prefill, tenant=tenant,
                                 model=model)
        async for ev in pbg.DecodeStub(ch).Generate(req):
            out.events += 1
            out.token_ids += ev.token_ids
            out.text += ev.text
            if ev.prefill_mode:
                out.prefill_mode, out.prefill_reason = ev.prefill_mode, ev.prefill_reason
            if ev.finish_reason:
                out.finish_reason, out.usage = ev.finish_reason, ev.usage
        return out


async def stats(address: str) -> pb.StatsResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        return await pbg.WorkerStub(ch).Stats(pb.StatsRequest())


async def wait_blocks_free(address: str, timeout: float = 10.0) -> pb.StatsResponse:
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while True:
        st = await stats(address)
        if st.kv_blocks_used == 0 and st.running == 0 and st.waiting == 0 and st.reserved == 0:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held after {timeout}s: {st}")
        await asyncio.sleep(0.05)


async def kill_while_decoding(proc, remaining_below: int, attempts: int = 1000) -> bool:
    """Kill a worker process once its engine is demonstrably mid-decode (fewer than
    `remaining_below` tokens left to generate, more than none). False if that never happened."""
    import asyncio

    addr = f"127.0.0.1:{proc.ports['grpc']}"
    for _ in range(attempts):
        st = await stats(addr)
        if 0 < st.decode_tokens_remaining < remaining_below:
            proc.kill()
            return True
        await asyncio.sleep(0.003)
    return False
