"""Decode-side stream coalescing: `--stream-interval N` sends the first token at once, then events
of at least N tokens, and the tokens are exactly those of an every-token stream — over gRPC, and on the
multiplexed connection, where the handler's direct path (decode_worker/service.py) must hold tokens
back the same way."""

from __future__ import annotations

import asyncio

import grpc
from grpc_client import greedy
from procs import address, start_worker
from reference import Reference

from protos import frames
from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pbg
from router.backends.mux_client import MuxClient


async def test_stream_interval_coalesces_events_without_changing_tokens(tiny_model_dir, tmp_path):
    w = start_worker("both", tiny_model_dir, tmp_path, "--stream-interval", "4")
    try:
        prompt = list(range(3, 40))
        async with grpc.aio.insecure_channel(address(w)) as ch:
            events = [ev async for ev in pbg.DecodeStub(ch).Generate(pb.GenerateRequest(token_ids=prompt,
                                                                                        sampling=greedy(21)))]
        client = MuxClient()
        try:
            conn = await client.connection("127.0.0.1", w.ports["metrics"])
            sid, stream = conn.open(pb.GenerateRequest(token_ids=prompt, sampling=greedy(21)).SerializeToString())
            muxed: list[pb.GenerateEvent] = []
            while not (muxed and muxed[-1].finish_reason):
                muxed += [pb.GenerateEvent.FromString(p) for k, p in await asyncio.wait_for(stream.take(), 10)
                          if k == frames.EVENT]
            conn.finish(sid, cancel=False)
        finally:
            await client.close()
        reference = Reference(tiny_model_dir).greedy(prompt, 21)
        for got in (events, muxed):
            sizes = [len(ev.token_ids) for ev in got]
            # (The first event is one token when the handler is already reading when it comes — as it was
            # over gRPC here every time; on the mux, started beside the router's other streams, a loaded
            # machine once let five more steps pass first, and they were merged into it, as designed.)
            first_ok = sizes[0] == 1 if got is events else sizes[0] >= 1
            assert first_ok and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 21, sizes
            assert len(got) <= 1 + 20 // 4 + 1
            assert [t for ev in got for t in ev.token_ids] == reference
            assert got[-1].finish_reason == "length"
        assert "sent_direct=" in w.log()
    finally:
        w.stop()
