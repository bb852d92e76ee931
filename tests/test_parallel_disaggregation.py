"""Prefill and decode workers that are each split over tensor-parallel ranks: every rank of the prefill
worker writes its own heads of the prompt's pages into the same rank of the decode worker, over
Mooncake TCP. Output equals transformers; only new blocks move, from every rank; a prefill worker
split differently is refused by name; a prefill rank killed mid-prompt fails the request cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from grpc_client import generate, greedy, stats, wait_blocks_free
from hf_models import make_hf_model
from procs import address, start_worker
from reference import Reference
from test_disaggregation import metric, prompt, until_prefill_under_way

TP2 = ("--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    # An 8-token step budget on the prefill side: prompts go in chunks, each chunk's layers sent as
    # they finish by both ranks.
    prefill = start_worker("prefill", tiny_model_dir, logs, *TP2, "--max-num-batched-tokens", "8",
                           "--max-num-seqs", "8")
    decode = start_worker("decode", tiny_model_dir, logs, *TP2, "--local-prefill-max-tokens", "0",
                          "--kv-quarantine", "0.5")
    decode1 = start_worker("decode", tiny_model_dir, logs, "--local-prefill-max-tokens", "0",
                           "--kv-quarantine", "0.5", name="decode-tp1")
    yield {"prefill": prefill, "decode": decode, "decode1": decode1, "logs": logs}
    for p in (prefill, decode, decode1):
        assert p.stop() == 0, p.log()[-2000:]


async def test_two_rank_prefill_into_two_rank_decode_equals_transformers(cluster, tiny_model_dir):
    ref = Reference(tiny_model_dir)
    prompts = [prompt(i, n) for i, n in enumerate([5, 17, 40, 96, 150])]
    dec, pre = address(cluster["decode"]), address(cluster["prefill"])
    outs = await asyncio.gather(*(generate(dec, p, greedy(10), prefill=pre) for p in prompts))
    for p, out in zip(prompts, outs, strict=True):
        assert out.prefill_mode == "remote"
        assert out.token_ids == ref.greedy(p, 10)
    await wait_blocks_free(dec)


async def test_second_turn_moves_only_new_blocks_from_every_rank(cluster):
    dec, pre = cluster["decode"], cluster["prefill"]
    turn1 = prompt(50, 70)
    first = await generate(address(dec), turn1, greedy(6), prefill=address(pre))
    bytes_before = metric(pre, "splitfire_worker_kv_transfer_bytes_total")
    turn2 = turn1 + first.token_ids + prompt(51, 60)  # 136 tokens: 4 blocks cached on decode
    second = await generate(address(dec), turn2, greedy(6), prefill=address(pre))
    assert second.prefill_mode == "remote" and second.usage.cached_tokens == 64
    rank_page = 2 * 16 * 1 * 16 * 4  # k+v, slots, one of the two kv heads per rank, head dim, fp32
    new_blocks = -(-len(turn2) // 16) - 4
    sent = metric(pre, "splitfire_worker_kv_transfer_bytes_total") - bytes_before
    assert sent == new_blocks * rank_page * 2 * 2  # two layers, two ranks


async def test_a_prefill_worker_split_differently_is_refused_by_name(cluster):
    """A one-rank decode worker paired with the two-rank prefill worker: a clear INVALID_ARGUMENT, its
    blocks come back, and it keeps serving."""
    dec1, pre = address(cluster["decode1"]), address(cluster["prefill"])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(dec1, prompt(7, 40), greedy(4), prefill=pre)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--tensor-parallel-size" in err.value.details() and "1 tensor-parallel rank" in err.value.details()
    await wait_blocks_free(dec1)
    both_ok = await generate(address(cluster["decode"]), prompt(8, 40), greedy(4), prefill=pre)
    assert len(both_ok.token_ids) == 4


async def test_a_prefill_rank_killed_mid_prompt_fails_the_request_and_frees_the_blocks(cluster, tiny_model_dir):
    dec = cluster["decode"]
    victim = start_worker("prefill", tiny_model_dir, cluster["logs"], *TP2, "--max-num-batched-tokens", "8",
                          "--max-num-seqs", "8", name="victim")
    try:
        task = asyncio.create_task(generate(address(dec), prompt(90, 1000), greedy(5), prefill=address(victim)))
        await until_prefill_under_way(address(victim))
        pid = victim.popen.pid
        rank = next(int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()
                    if b"worker.kv_rank" in open(f"/proc/{c}/cmdline", "rb").read())
        t0 = time.monotonic()
        os.kill(rank, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await task
        assert time.monotonic() - t0 < 10
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "prefill worker" in err.value.details()
        assert await asyncio.to_thread(victim.popen.wait, 15) != 0
        assert "event=rank_failed rank=1" in victim.log()
        # The decode worker keeps serving; the failed request's blocks come back after the quarantine.
        ok = await generate(address(dec), prompt(91, 30), greedy(4), prefill=address(cluster["prefill"]))
        assert len(ok.token_ids) == 4
        await wait_blocks_free(address(dec))
    finally:
        victim.kill()


async def test_latent_attention_prefill_and_decode_over_two_ranks_equal_transformers(tmp_path):
    """DeepSeek-V3 (MLA, MoE): the latent cache is whole on every rank, so each rank sends its copy."""
    fam = make_hf_model("deepseek_v3", tmp_path / "model")
    pre = start_worker("prefill", fam.path, tmp_path, *TP2, "--max-num-batched-tokens", "16", "--max-num-seqs", "8")
    dec = start_worker("decode", fam.path, tmp_path, *TP2, "--local-prefill-max-tokens", "0")
    try:
        prompts = [prompt(i, n) for i, n in enumerate([9, 40, 70])]
        outs = await asyncio.gather(*(generate(address(dec), p, greedy(8), prefill=address(pre)) for p in prompts))
        for p, out in zip(prompts, outs, strict=True):
            assert out.prefill_mode == "remote"
            assert out.token_ids == fam.greedy(p, 8)
        assert (await stats(address(dec))).running == 0
    finally:
        assert pre.stop() == 0, pre.log()[-2000:]
        assert dec.stop() == 0, dec.log()[-2000:]
