"""Prefill and decode workers that are each split over tensor-parallel ranks: every rank of the prefill
worker writes its own heads of the prompt's pages into the decode rank that holds them, over Mooncake
TCP — the same rank when both are split alike, head slices when they are not (TP=2 into TP=1 and TP=1
into TP=2). Output equals transformers; only new blocks move, from every rank; a decode worker whose
pages do not fit is refused by name; a prefill rank killed mid-prompt fails the request cleanly."""

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


async def test_two_rank_prefill_into_one_rank_decode_equals_transformers(cluster, tiny_model_dir):
    """Split differently: each prefill rank writes its KV head into its slice of every row of the one-rank
    decode worker's pages; tokens equal transformers, and exactly the prompt's pages move (both ranks)."""
    ref = Reference(tiny_model_dir)
    dec1, pre = cluster["decode1"], cluster["prefill"]
    prompts = [prompt(i + 20, n) for i, n in enumerate([7, 33, 90])]
    before = metric(pre, "splitfire_worker_kv_transfer_bytes_total")
    entries_before = metric(pre, "splitfire_worker_kv_transfer_entries_total")
    outs = await asyncio.gather(*(generate(address(dec1), p, greedy(10), prefill=address(pre)) for p in prompts))
    for p, out in zip(prompts, outs, strict=True):
        assert out.prefill_mode == "remote"
        assert out.token_ids == ref.greedy(p, 10)
    page = 2 * 16 * 2 * 16 * 4  # k+v, slots, both kv heads, head dim, fp32: the decode worker's page
    blocks = sum(-(-len(p) // 16) for p in prompts)
    assert metric(pre, "splitfire_worker_kv_transfer_bytes_total") - before == blocks * page * 2  # two layers
    # Each rank's pages went whole into spare blocks of the decode worker (moved into place there): at
    # most one entry per source page (2,048 bytes: k+v, 16 slots, one head), not one per 64-byte row.
    entries = metric(pre, "splitfire_worker_kv_transfer_entries_total") - entries_before
    assert entries * 2048 <= blocks * page * 2, entries
    assert dec1.log().count("landed=True") >= len(prompts)
    await wait_blocks_free(address(dec1))


async def test_two_rank_prefill_into_one_rank_decode_row_by_row_equals_transformers(cluster, tiny_model_dir):
    """The same with landing off on the decode side (--no-kv-landing): each prefill rank writes its head
    into every row of the decode worker's pages; same tokens, no spare blocks taken."""
    ref = Reference(tiny_model_dir)
    rows = start_worker("decode", tiny_model_dir, cluster["logs"], "--local-prefill-max-tokens", "0",
                        "--kv-quarantine", "0.5", "--no-kv-landing", name="decode-rows")
    try:
        pre = cluster["prefill"]
        p = prompt(27, 40)
        entries_before = metric(pre, "splitfire_worker_kv_transfer_entries_total")
        out = await generate(address(rows), p, greedy(10), prefill=address(pre))
        assert out.prefill_mode == "remote" and out.token_ids == ref.greedy(p, 10)
        # 3 blocks x 2 layers x 2 ranks, 32 rows each (k and v of 16 slots)
        assert metric(pre, "splitfire_worker_kv_transfer_entries_total") - entries_before == 3 * 2 * 2 * 32
        assert "landed=True" not in rows.log()
        await wait_blocks_free(address(rows))
    finally:
        assert rows.stop() == 0, rows.log()[-2000:]


async def test_one_rank_prefill_into_two_rank_decode_equals_transformers(cluster, tiny_model_dir):
    ref = Reference(tiny_model_dir)
    pre1 = start_worker("prefill", tiny_model_dir, cluster["logs"], "--max-num-batched-tokens", "8",
                        "--max-num-seqs", "8", name="prefill-tp1")
    try:
        dec = address(cluster["decode"])
        prompts = [prompt(i + 30, n) for i, n in enumerate([5, 48, 120])]
        outs = await asyncio.gather(*(generate(dec, p, greedy(10), prefill=address(pre1)) for p in prompts))
        for p, out in zip(prompts, outs, strict=True):
            assert out.prefill_mode == "remote"
            assert out.token_ids == ref.greedy(p, 10)
        await wait_blocks_free(dec)
        # The one rank holds both KV heads, each decode rank one: its heads are gathered into staged
        # pages (worker/kv/staging.py) and sent whole, at most one entry per destination page (a 2,048-byte
        # page: k+v, 16 slots, one head of 16 floats), not one per 64-byte row.
        sent = metric(pre1, "splitfire_worker_kv_transfer_bytes_total")
        entries = metric(pre1, "splitfire_worker_kv_transfer_entries_total")
        assert sent > 0 and entries * 2048 <= sent, (entries, sent)
    finally:
        assert pre1.stop() == 0, pre1.log()[-2000:]


async def test_a_decode_worker_whose_pages_do_not_fit_is_refused_by_name(cluster, tiny_model_dir):
    """A float16 KV cache on the decode side: a clear INVALID_ARGUMENT naming both KV dtypes and the flag that
    sets them (checked before the page layout), its blocks come back, and the prefill worker keeps serving."""
    dec16 = start_worker("decode", tiny_model_dir, cluster["logs"], "--local-prefill-max-tokens", "0",
                         "--kv-cache-dtype", "float16", "--kv-quarantine", "0.5", name="decode-fp16")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(address(dec16), prompt(7, 40), greedy(4), prefill=address(cluster["prefill"]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details()
        assert "KV cache holds float16" in details and "float32" in details and "--kv-cache-dtype" in details
        await wait_blocks_free(address(dec16))
    finally:
        assert dec16.stop() == 0, dec16.log()[-2000:]
    both_ok = await generate(address(cluster["decode"]), prompt(8, 40), greedy(4), prefill=address(cluster["prefill"]))
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
                    if b"worker.kv.rank" in open(f"/proc/{c}/cmdline", "rb").read())
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
    dec1 = start_worker("decode", fam.path, tmp_path, "--local-prefill-max-tokens", "0", name="mla-decode-tp1")
    try:
        prompts = [prompt(i, n) for i, n in enumerate([9, 40, 70])]
        for d in (dec, dec1):  # split alike (each rank its copy), then into one rank (rank 0's copy)
            outs = await asyncio.gather(*(generate(address(d), p, greedy(8), prefill=address(pre)) for p in prompts))
            for p, out in zip(prompts, outs, strict=True):
                assert out.prefill_mode == "remote"
                assert out.token_ids == fam.greedy(p, 8)
            assert (await stats(address(d))).running == 0
    finally:
        assert pre.stop() == 0, pre.log()[-2000:]
        assert dec.stop() == 0, dec.log()[-2000:]
        assert dec1.stop() == 0, dec1.log()[-2000:]


async def test_four_rank_prefill_into_two_rank_decode_lands_on_every_rank_equals_transformers(tmp_path):
    """Four KV heads: each prefill rank holds one, each decode rank two. Every prefill rank sends its
    pages whole into the decode rank's spare blocks and both decode ranks move their sections into place
    (rank 1 on rank 0's word, between steps); tokens equal transformers, one entry per run of pages."""
    fam = make_hf_model("llama3", tmp_path / "model", num_key_value_heads=4)
    pre = start_worker("prefill", fam.path, tmp_path, "--tensor-parallel-size", "4", "--max-num-batched-tokens", "32",
                       "--max-num-seqs", "8")
    dec = start_worker("decode", fam.path, tmp_path, *TP2, "--local-prefill-max-tokens", "0")
    try:
        prompts = [prompt(i + 60, n) for i, n in enumerate([9, 40, 70])]
        outs = await asyncio.gather(*(generate(address(dec), p, greedy(8), prefill=address(pre)) for p in prompts))
        for p, out in zip(prompts, outs, strict=True):
            assert out.prefill_mode == "remote"
            assert out.token_ids == fam.greedy(p, 8)
        src_page = 2 * 16 * 1 * 16 * 4  # k+v, slots, one head, head dim, fp32
        sent = metric(pre, "splitfire_worker_kv_transfer_bytes_total")
        entries = metric(pre, "splitfire_worker_kv_transfer_entries_total")
        assert sent == sum(-(-len(p) // 16) for p in prompts) * src_page * 3 * 4  # three layers, four ranks
        assert entries * src_page <= sent, (entries, sent)
        assert dec.log().count("landed=True") == len(prompts)
        await wait_blocks_free(address(dec))
    finally:
        assert pre.stop() == 0, pre.log()[-2000:]
        assert dec.stop() == 0, dec.log()[-2000:]


async def test_pipeline_stages_on_either_side_equal_transformers(tmp_path):
    """Pipeline parallel prefill and decode workers (three layers: stages of 2 and 1, or 1 and 2): each
    stage's ranks write their own layers into the decode ranks holding them (`Route.layers`), into one
    rank, into two stages, and from two tensor-parallel ranks into two stages (landing blocks moved into
    place on both stages); chunked prompts; tokens equal transformers; exactly the prompt's pages move."""
    fam = make_hf_model("llama3", tmp_path / "model")
    pp2 = ("--pipeline-parallel-size", "2")
    chunked = ("--max-num-batched-tokens", "16", "--max-num-seqs", "8")
    pre_pp = start_worker("prefill", fam.path, tmp_path, *pp2, *chunked, name="prefill-pp2")
    pre_tp = start_worker("prefill", fam.path, tmp_path, *TP2, *chunked, name="prefill-tp2")
    dec_pp = start_worker("decode", fam.path, tmp_path, *pp2, "--local-prefill-max-tokens", "0", name="decode-pp2")
    dec1 = start_worker("decode", fam.path, tmp_path, "--local-prefill-max-tokens", "0", name="decode-one")
    try:
        page = 2 * 16 * 2 * 16 * 4  # k+v, slots, both kv heads, head dim, fp32
        for k, (pre, dec) in enumerate(((pre_pp, dec1), (pre_pp, dec_pp), (pre_tp, dec_pp))):
            prompts = [prompt(i + 70 + 10 * k, n) for i, n in enumerate([9, 40, 70])]  # (none cached yet)
            before = metric(pre, "splitfire_worker_kv_transfer_bytes_total")
            outs = await asyncio.gather(*(generate(address(dec), p, greedy(8), prefill=address(pre)) for p in prompts))
            for p, out in zip(prompts, outs, strict=True):
                assert out.prefill_mode == "remote"
                assert out.token_ids == fam.greedy(p, 8), (pre.name, dec.name)
            sent = metric(pre, "splitfire_worker_kv_transfer_bytes_total") - before
            assert sent == sum(-(-len(p) // 16) for p in prompts) * page * 3, (pre.name, dec.name)  # three layers
            await wait_blocks_free(address(dec))
        assert dec_pp.log().count("landed=True") == len(prompts)  # (from the two-rank prefill worker)
    finally:
        for w in (pre_pp, pre_tp, dec_pp, dec1):
            assert w.stop() == 0, w.log()[-2000:]
