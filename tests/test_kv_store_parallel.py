"""The cluster-wide KV tier on model-parallel workers (a real mooncake_master): every rank publishes and
fetches its own part of a block, a block is used only when every part arrived, and workers split
differently miss each other's blocks instead of reading pages of another shape."""

from __future__ import annotations

import asyncio

import pytest
from grpc_client import generate, greedy, wait_blocks_free
from procs import address, start_kv_master, start_worker, stop_all
from reference import Reference
from test_kv_store import GB, full_blocks, metric, prompt, published, published_count

from worker.kv.tier_ranks import part_names, publishers

TP2 = ("--tensor-parallel-size", "2")


def test_each_rank_keys_its_own_layers_and_heads_and_replicas_publish_once():
    whole = [range(0, 4)]
    assert part_names(whole, [range(0, 2)], 4, 2) == [""]  # one rank: the keys of an unsplit worker
    assert part_names(whole, [range(0, 1), range(1, 2)], 4, 2) == ["H0-1/", "H1-2/"]
    # Four ranks over two KV heads: each head on two ranks, one object each, published by the first.
    four = part_names(whole, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)], 4, 2)
    assert four == ["H0-1/", "H0-1/", "H1-2/", "H1-2/"]
    assert publishers(four) == [True, False, True, False]
    # A latent cache (MLA) is whole on every rank: one object, rank 0 publishes, every rank reads it.
    assert part_names(whole, [range(0, 1)] * 2, 4, 1) == ["", ""]
    assert publishers(["", ""]) == [True, False]
    # Pipeline stages: each its own layers (rank = stage * tp + tp rank).
    assert part_names([range(0, 3), range(3, 4)], [range(0, 1), range(1, 2)], 4, 2) == [
        "L0-3.H0-1/", "L0-3.H1-2/", "L3-4.H0-1/", "L3-4.H1-2/"]


@pytest.fixture(scope="module")
def split_pair(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("kv-store-tp")
    master = start_kv_master(logs)
    store = f"127.0.0.1:{master.ports['rpc']}"
    flags = ("--kv-store", store, "--kv-store-gb", GB)
    a = start_worker("both", tiny_model_dir, logs, *TP2, *flags, name="tp-A", wait=False)
    b = start_worker("both", tiny_model_dir, logs, *TP2, *flags, name="tp-B", wait=False)
    for w in (a, b):
        w.wait_for("worker ready")
    yield {"a": a, "b": b, "store": store, "logs": logs}
    assert stop_all(a, b) == [0, 0]
    master.stop()


async def test_a_prompt_computed_on_one_two_rank_worker_is_served_from_the_store_on_another(split_pair,
                                                                                              tiny_model_dir):
    a, b = split_pair["a"], split_pair["b"]
    ref = Reference(tiny_model_dir)
    prompts = [prompt(i, n) for i, n in [(11, 200), (12, 70)]]
    firsts = await asyncio.gather(*(generate(address(a), p, greedy(8)) for p in prompts))
    await published(a, sum(len(p) // 16 for p in prompts))
    seconds = await asyncio.gather(*(generate(address(b), p, greedy(8)) for p in prompts))
    for p, first, second in zip(prompts, firsts, seconds, strict=True):
        assert first.usage.cached_tokens == 0
        assert second.token_ids == first.token_ids == ref.greedy(p, 8)
        assert second.usage.cached_tokens == full_blocks(p)  # both ranks' parts of every reusable block
    assert metric(b, "splitfire_worker_prefix_hit_tokens", tier="store") >= sum(full_blocks(p) for p in prompts)
    assert metric(b, "splitfire_worker_kv_store_blocks_total", op="fetch_failed") == 0
    await wait_blocks_free(address(a))  # published blocks were unpinned once every rank had read them
    await wait_blocks_free(address(b))


async def test_a_worker_split_otherwise_misses_instead_of_reading_pages_of_another_shape(split_pair,
                                                                                          tiny_model_dir):
    a = split_pair["a"]
    p = prompt(13)
    before = published_count(a)
    await generate(address(a), p, greedy(2))
    await published(a, before + len(p) // 16)
    one = start_worker("both", tiny_model_dir, split_pair["logs"], "--kv-store", split_pair["store"],
                       "--kv-store-gb", GB, name="tp1")
    try:
        got = await generate(address(one), p, greedy(4))
        assert got.usage.cached_tokens == 0
        assert got.token_ids == Reference(tiny_model_dir).greedy(p, 4)
        # ... and its own blocks are not read by the split workers either.
        q = prompt(14)
        await generate(address(one), q, greedy(2))
        await published(one, len(q) // 16)
        assert (await generate(address(split_pair["b"]), q, greedy(2))).usage.cached_tokens == 0
    finally:
        assert one.stop() == 0


async def test_latent_cache_on_two_ranks_and_pipeline_stages_share_through_the_store(tmp_path):
    """MLA: every rank holds the whole latent cache, so rank 0 publishes one object and both ranks read
    it. Pipeline parallel: each stage publishes and fetches its own layers."""
    from hf_models import make_hf_model

    master = start_kv_master(tmp_path)
    flags = ("--kv-store", f"127.0.0.1:{master.ports['rpc']}", "--kv-store-gb", GB)
    fam = make_hf_model("deepseek_v3", tmp_path / "mla")
    llama = make_hf_model("llama3", tmp_path / "llama")
    pp2 = ("--pipeline-parallel-size", "2")
    try:
        for model, split in [(fam, TP2), (llama, pp2)]:
            a = start_worker("both", model.path, tmp_path, *split, *flags, name=f"{model.path.name}-A", wait=False)
            b = start_worker("both", model.path, tmp_path, *split, *flags, name=f"{model.path.name}-B", wait=False)
            try:
                for w in (a, b):
                    w.wait_for("worker ready")
                p = prompt(15, 90)
                first = await generate(address(a), p, greedy(6))
                await published(a, len(p) // 16)
                second = await generate(address(b), p, greedy(6))
                assert second.token_ids == first.token_ids == model.greedy(p, 6)
                assert second.usage.cached_tokens == full_blocks(p), model.path.name
                assert metric(b, "splitfire_worker_kv_store_blocks_total", op="fetch_failed") == 0
            finally:
                assert stop_all(a, b) == [0, 0]
    finally:
        master.stop()
