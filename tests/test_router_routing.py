"""Placement: token-aware beats round-robin on skewed load, sessions stick (across routers
sharing Redis), and streams survive a decode worker dying mid-way."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
from procs import address, base_url, start_redis, start_router, start_worker

from common.sampling_params import SamplingParams
from router.api.protocol import GenRequest
from router.core.affinity import MemoryPinStore, SessionAffinity
from router.core.config import RouterConfig
from router.core.endpoints import EndpointRegistry
from router.core.load import Ticket
from router.core.metrics import RouterMetrics
from router.core.prefix_index import PrefixIndex
from router.placement.balancer import make_policy
from router.placement.dispatcher import Dispatcher

MODEL = "tiny"


def _peak_load(policy: str) -> int:
    """Replay one skewed workload through the real placement code; return the busiest endpoint's peak."""
    cfg = RouterConfig(colocated=["w0:1", "w1:1", "w2:1", "w3:1"], policy=policy, prefix_aware=False)
    reg = EndpointRegistry()
    for a in cfg.colocated:
        reg.add(a, "colocated")
    d = Dispatcher(cfg, reg, make_policy(policy), SessionAffinity(MemoryPinStore(), 60), PrefixIndex(10), None,
                   RouterMetrics(reg), None)
    rng = random.Random(7)
    live: list[tuple[int, Ticket]] = []

    async def main() -> None:
        for t in range(400):
            big = t % 10 == 0  # a few huge prompts among many small ones
            n = 6000 if big else rng.randint(50, 200)
            req = GenRequest(f"r{t}", "chat", MODEL, [1] * n, SamplingParams(max_tokens=100), False, False, "t", None,
                             False, {})
            route = await d.place(req, [], set())
            live.append((t + (60 if big else 8), Ticket(route, n, n, 100)))
            for end, ticket in [x for x in live if x[0] <= t]:
                ticket.close()
                live.remove((end, ticket))

    asyncio.run(main())
    return max(ep.peak_load for ep in reg.all())


def _hot_prefix(roles: dict[str, int], shared_store: bool, n: int = 480, prefix: int = 2000,
                suffix: int = 50) -> tuple[float, float]:
    """`n` concurrent requests sharing a `prefix`-token system prompt, placed by the real placement code
    (each attempt's load ticket and prefix-index entries as `Attempt` makes them; a decode worker's
    first event says the prompt is prefilled remotely). (in-flight tokens max / min over the decode-side
    endpoints, prompt tokens expected cached / the ideal: every request but each worker's first hits)."""
    from common.block_hash import block_hashes
    from router.placement.attempt import Attempt

    reg = EndpointRegistry()
    eps = {role: [reg.add(f"{role}{i}:1", role) for i in range(k)] for role, k in roles.items()}
    cfg = RouterConfig(policy="token", shared_kv_store=shared_store,
                       **{role: [e.address for e in es] for role, es in eps.items()})
    index = PrefixIndex(100_000, shared_store)
    d = Dispatcher(cfg, reg, make_policy("token"), SessionAffinity(MemoryPinStore(), 60), index, None,
                   RouterMetrics(reg), None)
    rng = random.Random(3)
    system = [rng.randrange(3, 300) for _ in range(prefix)]
    cached, attempts = 0, []

    async def main() -> None:
        nonlocal cached
        for i in range(n):
            ids = system + [rng.randrange(3, 300) for _ in range(suffix)]
            hashes = block_hashes("t", ids, 16)
            req = GenRequest(f"r{i}", "chat", MODEL, ids, SamplingParams(max_tokens=200), False, False, "t", None,
                             False, {})
            route = await d.place(req, hashes, set())
            prefiller = route.prefill or route.decode
            cached += index.cached_tokens(prefiller.address, hashes, (len(ids) - 1) // 16, 16)
            a = Attempt(0, route, None, reg, index, hashes, len(ids), 0, 200)  # type: ignore[arg-type]
            a.on_prefill_mode("remote")
            attempts.append(a)  # all in flight at once

    asyncio.run(main())
    decoders = eps.get("decode") or eps["colocated"]
    loads = [e.load() for e in decoders]
    prefillers = len(eps.get("prefill") or decoders)
    full = prefix // 16 * 16
    return max(loads) / min(loads), cached / ((n - prefillers) * full)


@pytest.mark.parametrize("roles", [{"colocated": 4}, {"decode": 4, "prefill": 2}], ids=["colocated", "pd"])
@pytest.mark.parametrize("shared_store", [False, True], ids=["own-caches", "kv-store"])
def test_a_hot_prefix_is_spread_while_cache_hits_stay_high(roles, shared_store):
    """480 concurrent requests behind one 2,000-token agent system prompt: the token policy's cost (load +
    uncached prompt tokens) sends the next request to a cold worker once the warm one's load exceeds the
    prefix's recompute (or, with a KV store, fetch) cost, so every worker computes the prefix once and
    then hits it; the load stays even."""
    imbalance, hit = _hot_prefix(roles, shared_store)
    assert imbalance <= 1.5 and hit >= 0.9, (imbalance, hit)


def test_token_policy_beats_round_robin_on_skewed_load():
    token, rr, rnd = _peak_load("token"), _peak_load("round_robin"), _peak_load("random")
    assert token < rr and token < rnd, (token, rr, rnd)


@pytest.fixture(scope="module")
def pd4(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd4")
    redis = start_redis(logs)
    workers = {
        "p0": start_worker("prefill", tiny_model_dir, logs, name="p0"),
        "p1": start_worker("prefill", tiny_model_dir, logs, name="p1"),
        "d0": start_worker("decode", tiny_model_dir, logs, name="d0"),
        "d1": start_worker("decode", tiny_model_dir, logs, name="d1"),
    }
    redis_url = f"redis://127.0.0.1:{redis.ports['port']}/0"
    common = ["--served-model-name", MODEL, "--prefill", address(workers["p0"]), address(workers["p1"]),
              "--decode", address(workers["d0"]), address(workers["d1"]), "--redis-url", redis_url]
    r1 = start_router(tiny_model_dir, logs, *common, name="router1")
    r2 = start_router(tiny_model_dir, logs, *common, name="router2")
    yield {"redis": redis, "workers": workers, "routers": (r1, r2), "logs": logs, "tiny": tiny_model_dir}
    for p in (r1, r2, *workers.values(), redis):
        p.stop()


async def chat(router, messages, session: str | None = None, max_tokens: int = 8, stream: bool = False):
    headers = {"x-session-affinity": session} if session else {}
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as s, s.post(base_url(router) + "/v1/chat/completions", json=body,
                                                    headers=headers) as r:
        assert r.status == 200, await r.text()
        served = (r.headers["X-Splitfire-Prefill"], r.headers["X-Splitfire-Decode"])
        if not stream:
            return (await r.json())["choices"][0]["message"]["content"], served
        return await sse_text(r), served


async def sse_text(r: aiohttp.ClientResponse) -> str:
    """The content of a chat completion stream; fails on an error event."""
    text = ""
    async for line in r.content:
        if line.startswith(b"data: {"):
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            if obj["choices"]:
                text += obj["choices"][0]["delta"].get("content") or ""
    return text


async def metric(router, name: str, **labels: str) -> float:
    """One sample from the router's /metrics (0 when absent)."""
    want = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else name
    async with aiohttp.ClientSession() as s, s.get(base_url(router) + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_ten_turn_session_stays_on_one_pair_across_two_routers(pd4):
    r1, r2 = pd4["routers"]
    messages = [{"role": "system", "content": "You are a tool-using agent. " * 8}]
    pairs = set()
    ok_before = await metric(r1, "splitfire_router_requests_total", route="/v1/chat/completions", status="200")
    ttft_before = await metric(r1, "splitfire_router_ttft_seconds_count")
    itl_before = await metric(r1, "splitfire_router_inter_token_seconds_count")
    for turn in range(10):
        messages.append({"role": "user", "content": f"step {turn}: call the tool"})
        text, served = await chat(r1 if turn % 2 == 0 else r2, messages, session="agent-42")
        pairs.add(served)
        messages.append({"role": "assistant", "content": text})
    assert len(pairs) == 1, pairs
    prefill, decode = next(iter(pairs))
    assert await metric(r1, "splitfire_router_requests_total", route="/v1/chat/completions",
                        status="200") == ok_before + 5
    # TTFT once per request; an inter-token gap for each of the other 7 tokens (a chunk of n
    # tokens counts n gaps; a first read that already held several tokens counts fewer: under load
    # the worker's stream delivers what piled up in one read).
    assert await metric(r1, "splitfire_router_ttft_seconds_count") == ttft_before + 5
    assert 5 * 4 <= await metric(r1, "splitfire_router_inter_token_seconds_count") - itl_before <= 5 * 7
    for role, ep in (("prefill", prefill), ("decode", decode)):
        assert await metric(r1, "splitfire_router_routing_decisions_total", policy="token", role=role,
                            endpoint=ep) >= 5
    await chat(r1, messages[:2], stream=True)  # the streaming path observes them too
    assert await metric(r1, "splitfire_router_ttft_seconds_count") == ttft_before + 6
    # Another session is free to land elsewhere; a third router-independent check: the pin is in Redis.
    import redis

    pinned = redis.Redis(port=pd4["redis"].ports["port"]).get("splitfire:affinity:default:agent-42").decode()
    assert pinned == "|".join(next(iter(pairs)))


async def test_killing_the_pinned_decode_moves_the_session(pd4):
    r1, _ = pd4["routers"]
    messages = [{"role": "user", "content": "remember me"}]
    _, served = await chat(r1, messages, session="movable")
    victim_name = next(n for n, p in pd4["workers"].items() if address(p) == served[1])
    pd4["workers"][victim_name].kill()
    try:
        text, served2 = await chat(r1, messages, session="movable", stream=True)
        assert served2[1] != served[1] and text
        _, served3 = await chat(r1, messages, session="movable")
        assert served3 == served2  # re-pinned to the new pair
    finally:
        pd4["workers"][victim_name] = start_worker("decode", pd4["tiny"], pd4["logs"], "--grpc-port",
                                                   served[1].rsplit(":", 1)[1], name=victim_name + "-restarted")


async def test_decode_killed_mid_stream_client_text_equals_uninterrupted(tiny_model_dir, tmp_path):
    d0 = start_worker("both", tiny_model_dir, tmp_path, name="c0")
    d1 = start_worker("both", tiny_model_dir, tmp_path, name="c1")
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--colocated", address(d0),
                          address(d1))
    try:
        messages = [{"role": "user", "content": "Count forever"}]
        reference, _ = await chat(router, messages, max_tokens=600)
        body = {"model": MODEL, "messages": messages, "max_tokens": 600, "temperature": 0, "stream": True,
                "ignore_eos": True}
        serving: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def read_stream() -> str:
            async with aiohttp.ClientSession() as s, s.post(base_url(router) + "/v1/chat/completions", json=body) as r:
                serving.set_result(r.headers["X-Splitfire-Decode"])
                return await sse_text(r)

        reader = asyncio.create_task(read_stream())
        victim = d0 if address(d0) == await serving else d1
        # Kill it while the request is demonstrably mid-decode on the worker (not just mid-read here).
        from grpc_client import kill_while_decoding

        killed = await kill_while_decoding(victim, 560)
        text = await reader
        assert killed
        assert text == reference
        metrics = await (await aiohttp.ClientSession().get(base_url(router) + "/metrics")).text()
        assert 'splitfire_router_retries_total{kind="failover"} 1.0' in metrics
    finally:
        for p in (router, d0, d1):
            p.stop()


def test_failover_resumes_after_the_text_the_client_already_has(tiny_model_dir):
    from common.tokenizer import Tokenizer
    from router.placement.resume import resume_point

    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode("lazy 🚀🔥 dog")
    # The dead worker held back the bytes of an unfinished emoji: resume before that emoji's tokens.
    partial = next(k for k in range(len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    sent = tok.decode(ids[: partial - 1])
    keep, skip = resume_point(tok, ids[: partial + 1], sent)
    assert tok.decode(ids[:keep]) == sent and skip == 0
    # Text held back in the middle of a token (a possible stop string): keep fewer tokens and skip
    # the characters the client already has from the regenerated token.
    full = tok.decode(ids)
    keep, skip = resume_point(tok, ids, full[:-2])
    kept = tok.decode(ids[:keep])
    assert keep < len(ids) and full[:-2].startswith(kept) and skip == len(full) - 2 - len(kept)


def test_a_prefix_cached_elsewhere_costs_a_fetch_with_a_shared_kv_store():
    """Placement: a local hit is cheapest, a block only the fleet has seen (the shared KV store) is
    cheaper than computing, and without a shared store it counts for nothing."""
    from common.block_hash import block_hashes
    from router.core.prefix_index import STORE_HIT_COST, PrefixIndex

    hashes = block_hashes("", list(range(160)), 16)  # 10 blocks
    for shared in (False, True):
        idx = PrefixIndex(1000, shared_store=shared)
        idx.insert("a", hashes[:8])
        idx.insert("b", hashes[:3])
        assert idx.cached_tokens("a", hashes, 9, 16) == 8 * 16
        expected_b = 3 * 16 + (int(5 * 16 * (1 - STORE_HIT_COST)) if shared else 0)
        assert idx.cached_tokens("b", hashes, 9, 16) == expected_b
        assert idx.cached_tokens("c", hashes, 9, 16) == (int(8 * 16 * (1 - STORE_HIT_COST)) if shared else 0)


def test_round_robin_visits_every_prefill_decode_pair():
    """With 2 + 2 workers, consecutive requests cover all four (prefill, decode) pairs (one counter for
    both roles sent request k to pair k % 2: two of the four, forever)."""
    cfg = RouterConfig(prefill=["p0:1", "p1:1"], decode=["d0:1", "d1:1"], policy="round_robin", prefix_aware=False)
    reg = EndpointRegistry()
    for a in cfg.prefill:
        reg.add(a, "prefill")
    for a in cfg.decode:
        reg.add(a, "decode")
    d = Dispatcher(cfg, reg, make_policy("round_robin"), SessionAffinity(MemoryPinStore(), 60), PrefixIndex(10),
                   None, RouterMetrics(reg), None)
    req = GenRequest("r", "chat", MODEL, [1] * 20, SamplingParams(max_tokens=4), False, False, "t", None, False, {})

    async def pairs() -> set[tuple[str, str]]:
        out = set()
        for _ in range(8):
            route = await d.place(req, [], set())
            out.add((route.prefill.address, route.decode.address))
        return out

    assert asyncio.run(pairs()) == {(p, q) for p in cfg.prefill for q in cfg.decode}


def test_the_fleet_block_size_is_what_workers_report_and_a_mismatch_is_refused():
    reg = EndpointRegistry()
    a, b = reg.add("w0:1", "colocated"), reg.add("w1:1", "colocated")
    assert reg.block_size == 16 and not reg.block_size_learned  # the default until a worker reports
    assert reg.admit_block_size(a, 32) and reg.block_size == 32
    assert not reg.admit_block_size(b, 16) and reg.block_size == 32


def test_router_and_engine_hash_blocks_identically():
    from common.block_hash import block_hashes
    from common.sampling_params import SamplingParams
    from engine.batch.block_manager import BlockManager
    from engine.batch.sequence import Sequence

    rng = random.Random(1)
    for tenant in ("", "acme", "t\u00e9n\u00e4nt"):
        ids = [rng.randrange(0, 1 << 20) for _ in range(rng.randrange(32, 300))]
        seq = Sequence("s", ids, SamplingParams(max_tokens=1), tenant=tenant)
        bm = BlockManager(64, 16)
        assert bm.allocate(seq, len(ids))
        seq.num_computed_tokens = len(ids)
        bm.register_computed(seq)
        assert seq.block_hashes == block_hashes(tenant, ids, 16)  # what the router indexes


def test_list_flags_accept_repeats_and_lists():
    import argparse

    from router.core.config import add_router_args

    parser = argparse.ArgumentParser()
    add_router_args(parser)
    args = parser.parse_args(["--openai-upstream", "http://a:1", "--openai-upstream", "http://b:1",
                                      "http://c:1", "--colocated", "x:1", "--colocated", "y:1"])
    assert args.openai_upstream == ["http://a:1", "http://b:1", "http://c:1"]
    assert args.colocated == ["x:1", "y:1"]


async def test_prefix_aware_placement_follows_the_cache_on_a_block_size_32_fleet(tiny_model_dir, tmp_path):
    """No session header: a conversation's next turn goes to the worker holding its prefix (the
    router learns the fleet's block size, 32, from the workers), and reports the hit."""
    workers = [start_worker("both", tiny_model_dir, tmp_path, "--block-size", "32", name=f"bs32-{i}") for i in range(2)]
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--colocated",
                          *(address(w) for w in workers), name="bs32-router")
    try:
        assert "reported=" not in router.log()  # no worker was refused
        async with aiohttp.ClientSession() as s:

            async def turn_of(conv: int, turn: int) -> tuple[str, dict]:
                words = " ".join(f"w{conv}x{i}" for i in range(60 + 10 * turn))  # each turn extends the last
                body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 2,
                        "temperature": 0}
                async with s.post(base_url(router) + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    return r.headers["X-Splitfire-Decode"], (await r.json())["usage"]

            # The first turns arrive together: load spreads them over both workers.
            placed = {c: where for c, (where, _) in enumerate(await asyncio.gather(*(turn_of(c, 0) for c in range(4))))}
            assert len(set(placed.values())) == 2
            for turn in (1, 2):  # later turns, one at a time: each follows its own prefix
                for conv in range(4):
                    where, usage = await turn_of(conv, turn)
                    assert where == placed[conv], (conv, turn)
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                    assert cached >= 64 and cached % 32 == 0, usage
    finally:
        router.stop()
        for w in workers:
            w.stop()


def test_workers_hosting_several_models_get_a_model_where_it_is_loaded_and_no_borrowed_prefix_hits():
    """Two workers each serving models a and b (--on-demand-model): a request for a goes where a is loaded;
    for b, loaded on both, a worker's cached blocks count only for its first model (whose KV events it
    publishes), so w0's blocks (model a's) do not draw b's request to the busier w0."""
    from common.block_hash import block_hashes
    from router.backends.backend import Route

    cfg = RouterConfig(colocated=["w0:1", "w1:1"], policy="token")
    reg = EndpointRegistry()
    w0, w1 = reg.add("w0:1", "colocated"), reg.add("w1:1", "colocated")
    w0.served_model, w0.hosted, w0.resident = "a", {"a", "b"}, {"a", "b"}
    w1.served_model, w1.hosted, w1.resident = "b", {"a", "b"}, {"b"}
    index = PrefixIndex(100)
    ids = list(range(3, 163))  # 10 blocks
    hashes = block_hashes("t", ids, 16)
    index.insert("w0:1", hashes)
    d = Dispatcher(cfg, reg, make_policy("token"), SessionAffinity(MemoryPinStore(), 60), index, None,
                   RouterMetrics(reg), None)
    Ticket(Route(w0, None), 30, 30, 0)  # w0 is busier

    def req(pool: str) -> GenRequest:
        r = GenRequest("r", "chat", pool, ids, SamplingParams(max_tokens=4), False, False, "t", None, False, {})
        r.pool = pool
        return r

    async def main() -> tuple[str, str]:
        a = await d.place(req("a"), hashes, set())
        b = await d.place(req("b"), hashes, set())
        return a.decode.address, b.decode.address

    assert asyncio.run(main()) == ("w0:1", "w1:1")
    w0.served_model = "b"  # (w0's published blocks are now b's: its hits count, and outweigh its load)
    assert asyncio.run(main())[1] == "w0:1"
