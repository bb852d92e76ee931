"""Decode-side stream coalescing: `--stream-interval N` sends the first token at once, then events
of at least N tokens, and the tokens are exactly those of an every-token stream."""

from __future__ import annotations

import grpc
from grpc_client import greedy
from procs import address, start_worker
from reference import Reference

from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pbg


async def test_stream_interval_coalesces_events_without_changing_tokens(tiny_model_dir, tmp_path):
    w = start_worker("both", tiny_model_dir, tmp_path, "--stream-interval", "4")
    try:
        prompt = list(range(3, 40))
        async with grpc.aio.insecure_channel(address(w)) as ch:
            events = [ev async for ev in pbg.DecodeStub(ch).Generate(pb.GenerateRequest(token_ids=prompt,
                                                                                        sampling=greedy(21)))]
        sizes = [len(ev.token_ids) for ev in events]
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 21, sizes
        assert len(events) <= 1 + 20 // 4 + 1
        assert [t for ev in events for t in ev.token_ids] == Reference(tiny_model_dir).greedy(prompt, 21)
        assert events[-1].finish_reason == "length"
    finally:
        w.stop()
