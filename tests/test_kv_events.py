"""KV events and the exact prefix index every router replica builds from them (worker/kv/events.py,
router/kv_events.py): the events replay to the block manager's own cache, gaps and restarts resync,
and two routers over the same workers place a conversation's next turn where its prefix is cached —
also the one that just restarted."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from procs import address, base_url, start_redis, start_router, start_worker

from common.block_hash import block_hashes
from common.sampling_params import SamplingParams
from engine.batch.block_manager import BlockManager
from engine.batch.sequence import Sequence
from router.core.endpoints import EndpointRegistry
from router.core.prefix_index import PrefixIndex
from router.placement.kv_events import OP_BYTES, ExactPrefixIndex, WorkerView


def replay(ops: bytes, into: set[bytes]) -> None:
    for i in range(0, len(ops), OP_BYTES):
        op, h = ops[i : i + 1], ops[i + 1 : i + OP_BYTES]
        if op == b"+":
            into.add(h)
        else:
            into.discard(h)


def test_events_replay_to_the_block_managers_own_cache():
    rng = random.Random(0)
    bm = BlockManager(48, 4)
    bm.enable_kv_events()
    seen: set[bytes] = set()
    live: list[Sequence] = []
    last_seq = 0
    for step in range(400):
        r = rng.random()
        if r < 0.45 and len(live) < 6:  # a new prompt, often sharing a prefix with an earlier one
            base = [1, 2, 3, 4, 5, 6, 7, 8] if rng.random() < 0.5 else []
            seq = Sequence(f"s{step}", base + [rng.randrange(9, 60) for _ in range(rng.randrange(1, 14))],
                           SamplingParams())
            if bm.allocate(seq, seq.num_tokens):
                bm.mark_computed(seq, seq.num_tokens - seq.num_computed_tokens)
                live.append(seq)
        elif r < 0.8 and live:  # a decode step
            seq = rng.choice(live)
            seq.output_token_ids.append(rng.randrange(9, 60))
            if bm.grow(seq, seq.num_tokens):
                bm.mark_computed(seq, 1)
        elif r < 0.98 and live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free_seq(seq)
        else:
            bm.reset_prefix_cache()
        if rng.random() < 0.3:
            end, ops = bm.take_kv_events()
            assert end - last_seq == len(ops) // OP_BYTES  # numbered one by one, none skipped
            last_seq = end
            replay(ops, seen)
            assert seen == set(bm.hash_to_block)
    seq_now, hashes = bm.kv_snapshot()
    end, ops = bm.take_kv_events()
    replay(ops, seen)
    assert seq_now == end and seen == set(hashes) == set(bm.hash_to_block)


def _index() -> tuple[ExactPrefixIndex, WorkerView]:
    idx = ExactPrefixIndex(PrefixIndex(100), EndpointRegistry(), None, None)  # type: ignore[arg-type]
    v = idx.views["w:1"] = WorkerView(stream="s", epoch="e1", seq=3, blocks={b"a" * 16}, synced=True)
    return idx, v


def test_index_applies_in_order_skips_what_it_has_and_resyncs_on_a_gap_or_restart():
    idx, v = _index()
    h1, h2, h3 = b"1" * 16, b"2" * 16, b"3" * 16
    # Entry with events 3..5: 3 is already in the snapshot, 4 and 5 are new.
    assert idx._apply("w:1", v, {b"epoch": b"e1", b"seq": b"5", b"n": b"3",
                                 b"ops": b"-" + b"a" * 16 + b"+" + h1 + b"+" + h2})
    assert v.blocks == {b"a" * 16, h1, h2} and v.seq == 5
    assert idx.matched_blocks("w:1", [b"a" * 16, h1, h3]) == 2
    # Events 8..9 after 5: 6 and 7 were lost -> resync, and the fallback answers meanwhile.
    assert not idx._apply("w:1", v, {b"epoch": b"e1", b"seq": b"9", b"n": b"2", b"ops": b"+" + h3 + b"-" + h1})
    assert not v.synced and idx.gaps == 1
    assert idx.matched_blocks("w:1", [b"a" * 16]) == 0  # (the fallback has not seen it)
    idx, v = _index()
    assert not idx._apply("w:1", v, {b"epoch": b"e2", b"seq": b"1", b"n": b"1", b"ops": b"+" + h1})
    assert not v.synced  # a restarted worker: a new epoch, numbered from 1 again


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("kv-events")
    redis = start_redis(logs)
    url = f"redis://127.0.0.1:{redis.ports['port']}/0"
    workers = [start_worker("both", tiny_model_dir, logs, "--redis-url", url, name=f"w{i}") for i in range(2)]
    common = ["--served-model-name", "tiny", "--colocated", *(address(w) for w in workers), "--redis-url", url,
              "--enable-cache-reset"]
    routers = [start_router(tiny_model_dir, logs, *common, name=f"router{i}") for i in range(2)]
    yield {"redis": redis, "workers": workers, "routers": routers, "common": common, "logs": logs,
           "tiny": tiny_model_dir}
    for p in (*routers, *workers, redis):
        p.stop()


async def _complete(s: aiohttp.ClientSession, router, prompt: list[int]) -> str:
    async with s.post(f"{base_url(router)}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}) as r:
        assert r.status == 200, await r.text()
        return r.headers["X-Splitfire-Decode"]


async def _spread(s: aiohttp.ClientSession, router, count: int, salt: int) -> tuple[list[list[int]], list[str]]:
    """`count` 96-token conversations sent at once through `router` until they land on both workers (what
    the tests need to mean something: one router alone would send each to the worker holding its
    prefix). On a loaded machine the requests can arrive one after another, each done before the next is
    placed, and then load puts them all on one worker: a few tries with fresh prompts."""
    for attempt in range(5):
        conversations = [[(salt * j + 5 * i + 31 * attempt) % 390 + 3 for j in range(96)] for i in range(count)]
        first = await asyncio.gather(*(_complete(s, router, c) for c in conversations))
        if len(set(first)) == 2:
            return conversations, first
    raise AssertionError(f"{count} concurrent requests never spread over both workers: {first}")


async def _synced(s: aiohttp.ClientSession, router) -> dict[str, dict]:
    for _ in range(100):
        async with s.get(f"{base_url(router)}/health") as r:
            eps = {e["address"]: e.get("kv_index", {}) for e in (await r.json())["endpoints"]}
        if all(v.get("synced") for v in eps.values()):
            return eps
        await asyncio.sleep(0.1)
    raise AssertionError(f"not synced: {eps}")


async def test_a_second_turn_on_the_other_replica_finds_its_prefix(fleet):
    r1, r2 = fleet["routers"]
    async with aiohttp.ClientSession() as s:
        await _synced(s, r1)
        await _synced(s, r2)
        conversations, first = await _spread(s, r1, 8, 11)  # at once: spread by load
        await asyncio.sleep(0.5)  # the events reach Redis and router 2
        views = await _synced(s, r2)
        assert sum(v["blocks"] for v in views.values()) >= 8 * 5
        async with s.get(f"{base_url(r2)}/metrics") as r:
            text = await r.text()
        for series in ("splitfire_router_kv_index_synced{", "splitfire_router_kv_index_blocks{",
                       "splitfire_router_kv_index_events_total", "splitfire_router_kv_index_resyncs_total"):
            assert series in text, series
        second = [await _complete(s, r2, c + [5, 6, 7]) for c in conversations]
        assert second == first  # each next turn where its 96-token prefix is cached


async def test_a_restarted_replica_bootstraps_from_the_workers(fleet):
    r1, r2 = fleet["routers"]
    r2.stop()
    r2 = fleet["routers"][1] = start_router(fleet["tiny"], fleet["logs"], *fleet["common"], name="router1b")
    async with aiohttp.ClientSession() as s:
        conversations, first = await _spread(s, r1, 6, 13)
        await asyncio.sleep(0.5)
        await _synced(s, r2)
        second = [await _complete(s, r2, c + [9]) for c in conversations]
        assert second == first
        # An eviction is seen by both: a reset drops every cached block from both views.
        async with s.post(f"{base_url(r1)}/reset_prefix_cache") as r:
            assert r.status == 200
        for router in (r1, r2):
            for _ in range(50):
                views = await _synced(s, router)
                if all(v["blocks"] == 0 for v in views.values()):
                    break
                await asyncio.sleep(0.1)
            assert all(v["blocks"] == 0 for v in views.values()), views


def test_block_hashes_match_between_router_and_worker():
    # The router hashes prompts with the workers' own scope, so the events' hashes are its hashes.
    from common.block_hash import cache_scope

    seq = Sequence("x", list(range(40)), SamplingParams(), tenant="acme", adapter="sql")
    assert block_hashes(cache_scope("acme", "sql"), list(range(40)), 16) == block_hashes(seq.scope, list(range(40)), 16)


async def test_a_worker_that_leaves_takes_its_blocks_out_of_the_index():
    registry = EndpointRegistry()
    registry.add("w:1", "decode")
    idx = ExactPrefixIndex(PrefixIndex(100), registry, None, None, block_ms=1)  # type: ignore[arg-type]
    idx.views["w:1"] = WorkerView(stream="s1", epoch="e", seq=1, blocks={b"a" * 16}, synced=True)
    idx.views["w:2"] = WorkerView(stream="s2", epoch="e", seq=1, blocks={b"a" * 16}, synced=True)
    registry.by_address.pop(("decode", "w:1"))  # (discovery removed it)
    await idx.step()  # w:2 was never in the registry either: both views go; nothing left to read
    assert idx.views == {} and idx.matched_blocks("w:1", [b"a" * 16]) == 0
