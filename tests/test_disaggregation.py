"""Prefill and decode in two processes, K/V over Mooncake TCP: exact output, only new blocks
move, aborts and crashes leave nothing behind, bad input is refused."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import aiohttp
import grpc
import pytest
from grpc_client import generate, greedy, stats, wait_blocks_free
from procs import address, free_port, start_worker
from reference import Reference

from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pbg
from protos import trailers


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    # An 8-token step budget on the prefill side: prompts are chunked, each chunk's layers
    # are sent as they finish, and a long prompt takes long enough to abort mid-way.
    prefill = start_worker("prefill", tiny_model_dir, logs, "--max-num-batched-tokens", "8", "--max-num-seqs", "8")
    decode = start_worker("decode", tiny_model_dir, logs, "--local-prefill-max-tokens", "0", "--kv-quarantine", "0.5")
    both = start_worker("both", tiny_model_dir, logs)
    yield {"prefill": prefill, "decode": decode, "both": both, "logs": logs}
    for p in (prefill, decode, both):
        assert p.stop() == 0, p.log()[-2000:]


def prompt(i: int, n: int) -> list[int]:
    return [(31 * i + 7 * j) % 390 + 3 for j in range(n)]


async def until_prefill_under_way(addr: str) -> None:
    for _ in range(400):
        st = await stats(addr)
        if st.running == 1 and 0 < st.prompt_tokens_in_flight < 950:
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"the prefill should be under way: {st}")


def metric(p, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{p.ports['metrics']}/metrics", timeout=5).read().decode()
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", body, re.M):
        total += float(m.group(1))
    return total


async def test_disaggregated_output_equals_colocated_and_reference(cluster, tiny_model_dir):
    ref = Reference(tiny_model_dir)
    prompts = [prompt(i, n) for i, n in enumerate([5, 17, 40, 96, 150, 33])]
    pre = address(cluster["prefill"])
    disagg = await asyncio.gather(*(generate(address(cluster["decode"]), p, greedy(10), prefill=pre) for p in prompts))
    coloc = await asyncio.gather(*(generate(address(cluster["both"]), p, greedy(10)) for p in prompts))
    for p, d, c in zip(prompts, disagg, coloc, strict=True):
        assert d.prefill_mode == "remote"
        assert d.token_ids == c.token_ids == ref.greedy(p, 10)
        assert d.text == c.text
        assert d.usage.completion_tokens == 10 and d.usage.prompt_tokens == len(p)


async def test_second_turn_transfers_only_new_blocks(cluster):
    dec, pre = cluster["decode"], cluster["prefill"]
    turn1 = prompt(50, 70)
    first = await generate(address(dec), turn1, greedy(6), prefill=address(pre))
    bytes_before = metric(pre, "splitfire_worker_kv_transfer_bytes_total")
    hits_before = (await stats(address(pre))).prefix_hit_tokens
    turn2 = turn1 + first.token_ids + prompt(51, 60)  # 136 tokens: 4 blocks cached on decode
    second = await generate(address(dec), turn2, greedy(6), prefill=address(pre))
    assert second.prefill_mode == "remote" and second.usage.cached_tokens == 64
    page = 2 * 16 * 2 * 16 * 4  # k+v, slots, kv heads, head dim, fp32
    new_blocks = -(-len(turn2) // 16) - 4
    sent = metric(pre, "splitfire_worker_kv_transfer_bytes_total") - bytes_before
    assert sent == new_blocks * page * 2  # two layers
    # The prefill worker reused its own cached prefix too: only the new tokens were computed.
    assert (await stats(address(pre))).prefix_hit_tokens - hits_before == 64


async def test_abort_mid_prefill_and_mid_decode_frees_blocks_on_both(cluster):
    dec, pre = cluster["decode"], cluster["prefill"]
    long_prompt = prompt(77, 1000)  # 125 chunks of 8 tokens on the prefill worker
    task = asyncio.create_task(generate(address(dec), long_prompt, greedy(5), prefill=address(pre)))
    await until_prefill_under_way(address(pre))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Mid-decode: read a few events, then hang up.
    async with grpc.aio.insecure_channel(address(dec)) as ch:
        call = pbg.DecodeStub(ch).Generate(pb.GenerateRequest(token_ids=prompt(78, 40), sampling=greedy(900),
                                                              prefill_endpoint=address(pre)))
        got = 0
        async for ev in call:
            got += len(ev.token_ids)
            if got >= 5:
                break
        call.cancel()
    await wait_blocks_free(address(pre))
    await wait_blocks_free(address(dec))


async def test_prefill_worker_killed_mid_request(cluster, tiny_model_dir):
    dec = cluster["decode"]
    victim = start_worker("prefill", tiny_model_dir, cluster["logs"], "--max-num-batched-tokens", "8",
                          "--max-num-seqs", "8", name="victim")
    task = asyncio.create_task(generate(address(dec), prompt(90, 1000), greedy(5), prefill=address(victim)))
    await until_prefill_under_way(address(victim))
    t0 = time.monotonic()
    victim.kill()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await task
    assert time.monotonic() - t0 < 10
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "prefill worker" in err.value.details()
    # The router learns whom to blame from trailing metadata, not from the text.
    meta = dict(err.value.trailing_metadata() or ())
    assert (meta[trailers.FAILED_ENDPOINT], meta[trailers.FAILED_ROLE]) == (address(victim), "prefill")
    # The decode worker keeps serving, and the failed request's blocks come back after quarantine.
    ok = await generate(address(dec), prompt(91, 30), greedy(4), prefill=address(cluster["prefill"]))
    assert len(ok.token_ids) == 4
    await wait_blocks_free(address(dec))


async def test_bad_input_over_grpc_is_invalid_argument(cluster):
    dec, pre = address(cluster["decode"]), address(cluster["prefill"])
    async with grpc.aio.insecure_channel(dec) as ch:
        stub = pbg.DecodeStub(ch)
        cases = [
            pb.GenerateRequest(token_ids=[], sampling=greedy(4)),
            pb.GenerateRequest(token_ids=[5, 6], sampling=pb.SamplingParams(max_tokens=4, temperature=-1)),
            pb.GenerateRequest(token_ids=[5, 6], sampling=pb.SamplingParams(max_tokens=4, top_p=2)),
            pb.GenerateRequest(token_ids=[10**6], sampling=greedy(4), prefill_endpoint=pre),
            pb.GenerateRequest(token_ids=[5] * 5000, sampling=greedy(4), prefill_endpoint=pre),
        ]
        for req in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(req):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
    async with grpc.aio.insecure_channel(pre) as ch:
        stub = pbg.PrefillStub(ch)
        good = dict(segment="127.0.0.1:1", base_address=4096, num_blocks=100, num_layers=2, page_bytes=4096)
        cases = [
            pb.PrefillRequest(token_ids=[5] * 20, sampling=greedy(1),
                              destination=pb.KVDestination(**good, first_block=0, block_ids=[1, 500])),
            pb.PrefillRequest(token_ids=[5] * 20, sampling=greedy(1),
                              destination=pb.KVDestination(**good, first_block=0, block_ids=[1])),
            pb.PrefillRequest(token_ids=[5] * 20, sampling=greedy(1),
                              destination=pb.KVDestination(**{**good, "page_bytes": 8192}, block_ids=[1, 2])),
            pb.PrefillRequest(token_ids=[], sampling=greedy(1), destination=pb.KVDestination(**good)),
        ]
        for req in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
    assert cluster["decode"].alive and cluster["prefill"].alive
    ok = await generate(dec, prompt(3, 20), greedy(3), prefill=pre)
    assert len(ok.token_ids) == 3


async def test_conditional_disaggregation_prefills_short_suffix_locally(tiny_model_dir, tmp_path):
    pre = start_worker("prefill", tiny_model_dir, tmp_path)
    dec = start_worker("decode", tiny_model_dir, tmp_path, "--local-prefill-max-tokens", "64",
                       "--local-prefill-max-fraction", "0.5")
    try:
        base = prompt(5, 100)
        cold = await generate(address(dec), base, greedy(4), prefill=address(pre))
        assert (cold.prefill_mode, cold.prefill_reason) == ("remote", "uncached_tokens_above_threshold")
        warm = await generate(address(dec), base + cold.token_ids + prompt(6, 20), greedy(4), prefill=address(pre))
        assert (warm.prefill_mode, warm.prefill_reason) == ("local", "short_uncached_suffix")
        body = urllib.request.urlopen(f"http://127.0.0.1:{dec.ports['metrics']}/metrics", timeout=5).read().decode()
        assert 'splitfire_worker_prefill_mode_total{mode="local",reason="short_uncached_suffix",role="decode"} 1.0' in body
    finally:
        pre.stop()
        dec.stop()


async def _frames(worker, req: pb.GenerateRequest) -> list[tuple[int, bytes]]:
    """Decode.Generate over the worker's HTTP port, as the router reads it."""
    from protos import frames

    url = f"http://127.0.0.1:{worker.ports['metrics']}{frames.PATH}"
    async with aiohttp.ClientSession() as s, s.post(url, data=req.SerializeToString()) as r:
        assert r.status == 200 and r.headers["Content-Type"] == frames.CONTENT_TYPE
        return frames.FrameReader().feed(await r.read())


async def test_the_http_token_stream_equals_the_grpc_one(cluster):
    """The same Generate handler behind both transports: same tokens, same usage, the prefill
    decision first; a failed prefill worker is named in the ERROR frame, as in gRPC trailers."""
    from protos import frames

    dec, pre = cluster["decode"], address(cluster["prefill"])
    ids = prompt(92, 40)
    via_grpc = await generate(address(dec), ids, greedy(6), prefill=pre)
    got = await _frames(dec, pb.GenerateRequest(token_ids=ids, sampling=greedy(6), prefill_endpoint=pre))
    assert all(kind == frames.EVENT for kind, _ in got)
    events = [pb.GenerateEvent.FromString(p) for _, p in got]
    assert (events[0].prefill_mode, list(events[0].token_ids)) == ("remote", [])  # said before prefilling
    assert [t for ev in events for t in ev.token_ids] == via_grpc.token_ids
    assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == 6
    dead = f"127.0.0.1:{free_port()}"
    got = await _frames(dec, pb.GenerateRequest(token_ids=prompt(93, 40), sampling=greedy(4), prefill_endpoint=dead))
    kind, payload = got[-1]
    err = json.loads(payload)
    assert kind == frames.ERROR and err["code"] == "UNAVAILABLE"
    assert (err["failed_endpoint"], err["failed_role"]) == (dead, "prefill")
    await wait_blocks_free(address(dec))


async def test_a_storm_of_cancelled_prompts_stops_computing_at_once(cluster):
    """Clients that go away while their prompts are queued or mid-prefill leave nothing running:
    the prefill worker is idle within moments and computes at most about a step per request
    after the cancel (an admit queued behind a running step once ran the whole prompt anyway)."""
    dec, pre = cluster["decode"], cluster["prefill"]
    # A long prompt keeps the engine stepping; the others are cancelled a few ms apart, so some
    # cancels land while their admit waits behind a running step.
    busy = asyncio.create_task(generate(address(dec), prompt(199, 900), greedy(4), prefill=address(pre)))
    await until_prefill_under_way(address(pre))
    calls = [busy]
    for i in range(12):
        calls.append(asyncio.create_task(generate(address(dec), prompt(200 + i, 600), greedy(4), prefill=address(pre))))
        await asyncio.sleep(0.004)
        calls[-1].cancel()
    busy.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    steps_at_cancel = metric(pre, "splitfire_worker_step_seconds_count")
    deadline = time.monotonic() + 5
    while True:
        st = await stats(address(pre))
        if st.running == 0 and st.waiting == 0 and st.prompt_tokens_in_flight == 0:
            break
        assert time.monotonic() < deadline, f"the prefill worker still computes cancelled prompts: {st}"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    wasted = metric(pre, "splitfire_worker_step_seconds_count") - steps_at_cancel
    # One prompt run to the end would be 75 steps (600 tokens, 8 per step); allow about one per request.
    assert wasted <= 13 + 2, wasted
    await wait_blocks_free(address(pre))
    await wait_blocks_free(address(dec))


async def test_cancelled_transfer_frees_blocks_on_proof_not_after_the_quarantine(cluster, tiny_model_dir):
    """A request cancelled mid-prefill: the prefill worker aborts it between two steps (its writes
    run inside steps) and says no write can still land, so the decode worker frees the blocks at
    once instead of holding them for its 30 s --kv-quarantine."""
    pre = cluster["prefill"]
    dec = start_worker("decode", tiny_model_dir, cluster["logs"], "--local-prefill-max-tokens", "0",
                       "--kv-quarantine", "30", name="long-quarantine")
    try:
        task = asyncio.create_task(generate(address(dec), prompt(94, 900), greedy(4), prefill=address(pre)))
        await until_prefill_under_way(address(pre))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        t0 = time.monotonic()
        await wait_blocks_free(address(dec), timeout=10)
        assert time.monotonic() - t0 < 5
        assert "settled=True" in dec.log()
    finally:
        dec.stop()
