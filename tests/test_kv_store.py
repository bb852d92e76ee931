"""The cluster-wide KV tier on a real mooncake_master: a prefix computed on any worker is reused by
every worker, disaggregated or not; master outages cost only cache hits; tenants and models never
share blocks."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import aiohttp
import pytest
from grpc_client import generate, greedy, wait_blocks_free
from procs import address, base_url, start_kv_master, start_router, start_worker, stop_all
from reference import Reference

GB = "0.05"  # each worker lends 50 MiB to the pool


def prompt(i: int, n: int = 200) -> list[int]:
    return [(13 * i + 7 * j) % 390 + 3 for j in range(n)]


def full_blocks(p: list[int]) -> int:
    return (len(p) - 1) // 16 * 16  # reusable prefix: every full block but a last token left to compute


def metric(proc, name: str, **labels: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{proc.ports['metrics']}/metrics", timeout=5).read().decode()
    sel = "".join(f'.*{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for m in re.finditer(rf"^{name}{{([^}}]*)}} ([0-9.e+-]+)$", body, re.M):
        if re.match(sel, m.group(1)):
            total += float(m.group(2))
    return total


def published_count(proc) -> float:
    return metric(proc, "splitfire_worker_kv_store_blocks_total", op="published")


async def published(proc, blocks: float, timeout: float = 10.0) -> None:
    """Publishing runs in the background: wait until `proc` has published `blocks` blocks in all."""
    for _ in range(int(timeout / 0.05)):
        if published_count(proc) >= blocks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{proc.name} published {published_count(proc)} blocks, not {blocks}")


@pytest.fixture(scope="module")
def colocated(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("kv-store")
    master = start_kv_master(logs)
    store = f"127.0.0.1:{master.ports['rpc']}"
    a = start_worker("both", tiny_model_dir, logs, "--kv-store", store, "--kv-store-gb", GB, name="A", wait=False)
    b = start_worker("both", tiny_model_dir, logs, "--kv-store", store, "--kv-store-gb", GB, name="B", wait=False)
    for w in (a, b):
        w.wait_for("worker ready")
    yield {"a": a, "b": b, "master": master, "store": store, "logs": logs}
    assert stop_all(a, b) == [0, 0]
    master.stop()


async def test_a_prompt_computed_on_one_worker_is_served_from_the_store_on_another(colocated, tiny_model_dir):
    a, b = colocated["a"], colocated["b"]
    p = prompt(1)
    first = await generate(address(a), p, greedy(8))
    assert first.usage.cached_tokens == 0
    await published(a, len(p) // 16)
    second = await generate(address(b), p, greedy(8))
    assert second.token_ids == first.token_ids == Reference(tiny_model_dir).greedy(p, 8)
    assert second.usage.cached_tokens == full_blocks(p)  # every reusable block came from the store
    # B computed only the tail: its hits are all from the store tier, none local.
    assert metric(b, "splitfire_worker_prefix_hit_tokens", tier="store") >= full_blocks(p)
    assert metric(b, "splitfire_worker_prefix_hit_tokens", tier="local") == 0
    await wait_blocks_free(address(a))  # published blocks were unpinned
    await wait_blocks_free(address(b))


async def test_the_output_of_a_turn_is_published_for_the_next_turn(colocated):
    """Agents: turn 2's prompt is turn 1's prompt + reply + more; the reply's blocks are shared too."""
    a, b = colocated["a"], colocated["b"]
    turn1 = prompt(2, 60)
    before = published_count(a)
    r1 = await generate(address(a), turn1, greedy(60))
    await published(a, before + (len(turn1) + 59) // 16)
    turn2 = turn1 + r1.token_ids + prompt(3, 10)
    r2 = await generate(address(b), turn2, greedy(4))
    assert r2.usage.cached_tokens >= (len(turn1) + len(r1.token_ids) - 1) // 16 * 16


async def test_tenants_never_share_blocks_through_the_store(colocated):
    a, b = colocated["a"], colocated["b"]
    p = prompt(4)
    before = published_count(a)
    await generate(address(a), p, greedy(2), tenant="alice")
    await published(a, before + len(p) // 16)
    bob = await generate(address(b), p, greedy(2), tenant="bob")
    assert bob.usage.cached_tokens == 0
    alice = await generate(address(b), p, greedy(2), tenant="alice")
    assert alice.usage.cached_tokens == full_blocks(p)


async def test_another_model_or_layout_misses_instead_of_reading_wrong_blocks(colocated, tiny_model_dir, tmp_path):
    from tiny_model import make_tiny_llama

    a = colocated["a"]
    p = prompt(5)
    before = published_count(a)
    await generate(address(a), p, greedy(2))
    await published(a, before + len(p) // 16)
    other = make_tiny_llama(tmp_path / "other", seed=1)  # same architecture and tokenizer, other weights
    for model, extra in [(other, []), (tiny_model_dir, ["--block-size", "8"])]:
        w = start_worker("both", model, tmp_path, "--kv-store", colocated["store"], "--kv-store-gb", GB, *extra)
        try:
            got = await generate(address(w), p, greedy(4))
            assert got.usage.cached_tokens == 0
            assert got.token_ids == Reference(model).greedy(p, 4)
        finally:
            w.stop()


async def test_e4m3_caches_share_through_the_store_and_never_read_other_types(colocated, tiny_model_dir, tmp_path):
    """--kv-cache-dtype fp8 workers: their blocks are keyed by the cache type, so they miss a float32
    worker's published prompt (never read its pages as e4m3), and share their own: the second fp8 worker
    serves the prompt from the store with the first one's tokens."""
    a = colocated["a"]
    p = prompt(6)
    before = published_count(a)
    await generate(address(a), p, greedy(2))
    await published(a, before + len(p) // 16)
    args = ("--kv-store", colocated["store"], "--kv-store-gb", GB, "--kv-cache-dtype", "fp8")
    c = start_worker("both", tiny_model_dir, tmp_path, *args, name="C8")
    d = start_worker("both", tiny_model_dir, tmp_path, *args, name="D8")
    try:
        first = await generate(address(c), p, greedy(8))
        assert first.usage.cached_tokens == 0  # (a's float32 blocks are not an fp8 worker's)
        await published(c, len(p) // 16)
        second = await generate(address(d), p, greedy(8))
        assert second.usage.cached_tokens == full_blocks(p)
        assert second.token_ids == first.token_ids
    finally:
        assert stop_all(c, d) == [0, 0]


async def test_master_outage_costs_only_cache_hits_and_sharing_resumes_after_restart(tiny_model_dir, tmp_path):
    master = start_kv_master(tmp_path)
    port = master.ports["rpc"]
    store = f"127.0.0.1:{port}"
    a = start_worker("both", tiny_model_dir, tmp_path, "--kv-store", store, "--kv-store-gb", GB, name="A2", wait=False)
    b = start_worker("both", tiny_model_dir, tmp_path, "--kv-store", store, "--kv-store-gb", GB, name="B2", wait=False)
    c = None
    try:
        for w in (a, b):
            w.wait_for("worker ready")
        ref = Reference(tiny_model_dir)
        master.kill()
        # A worker that starts while the master is down serves too, and joins the store later.
        c = start_worker("both", tiny_model_dir, tmp_path, "--kv-store", store, "--kv-store-gb", GB, name="C2")
        # Mid-traffic without a master: every request is served (computed), none fails.
        for i in range(3):
            p = prompt(20 + i)
            for w in (a, b, c):
                got = await generate(address(w), p, greedy(4))
                assert got.token_ids == ref.greedy(p, 4)
        master = start_kv_master(tmp_path, port=port)
        await asyncio.sleep(4)  # the breaker re-probes the master every few seconds
        for k, (source, reader) in enumerate(((a, b), (b, c), (c, a))):
            p = prompt(30 + k)
            before = published_count(source)
            await generate(address(source), p, greedy(4))
            await published(source, before + len(p) // 16)
            got = await generate(address(reader), p, greedy(4))
            assert got.usage.cached_tokens == full_blocks(p) and got.token_ids == ref.greedy(p, 4)
    finally:
        running = [w for w in (a, b, c) if w is not None]
        assert stop_all(*running) == [0] * len(running)
        master.stop()


async def test_disaggregated_fleet_shares_every_prefix(tiny_model_dir, tmp_path):
    """2 prefill + 2 decode workers behind a random-policy router: after the first request, every
    repeat of a prompt is a cache hit on whichever pair it lands."""
    master = start_kv_master(tmp_path)
    store = ["--kv-store", f"127.0.0.1:{master.ports['rpc']}", "--kv-store-gb", GB]
    workers = [start_worker(role, tiny_model_dir, tmp_path, *store, *extra, name=f"{role}{i}", wait=False)
               for i, (role, extra) in enumerate([("prefill", []), ("prefill", []),
                                                  ("decode", ["--local-prefill-max-tokens", "0"]),
                                                  ("decode", ["--local-prefill-max-tokens", "0"])])]
    for w in workers:
        w.wait_for("worker ready")
    pre, dec = workers[:2], workers[2:]
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", "tiny", "--policy", "random",
                          "--prefill", *map(address, pre), "--decode", *map(address, dec))
    try:
        messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 12}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
        async with aiohttp.ClientSession() as s:
            async def ask() -> tuple[str, int, int]:
                async with s.post(base_url(router) + "/v1/chat/completions", json=body) as r:
                    out = await r.json()
                    assert r.status == 200, out
                u = out["usage"]
                return out["choices"][0]["message"]["content"], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]

            text, n, cached = await ask()
            assert cached == 0
            await asyncio.sleep(1.0)  # the first prompt's blocks are published in the background
            for _ in range(6):
                again, n2, cached = await ask()
                assert again == text and n2 == n
                assert cached >= 0.9 * ((n - 1) // 16 * 16), cached
    finally:
        router.stop()
        stop_all(*workers)
        master.stop()


def test_store_keys_commit_to_model_layout_and_tenant():
    from common.block_hash import block_hashes

    a, b = block_hashes("t1", list(range(64)), 16), block_hashes("t2", list(range(64)), 16)
    assert len(a) == 4 and not set(a) & set(b)
    assert block_hashes("t1", list(range(64)), 16)[:2] == block_hashes("t1", list(range(32)) + [9] * 32, 16)[:2]
    assert json.dumps([h.hex() for h in a])  # hex-encodable: they become store keys
