"""One model across several ranks (tensor parallel, gloo on CPU): every split family equals transformers
token for token and in its logits, through the whole engine; a rank holds its share of the weights; a rank
that dies takes its group down at once."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from engine_helpers import drain
from grpc_client import generate, greedy
from hf_models import HFModel, make_hf_model
from multi_rank import GREEDY, N, prompts
from procs import address, start_worker, stop_all

from common.errors import ModelLoadError
from common.sampling_params import SamplingParams

DENSE = ["llama3", "mistral", "qwen2", "qwen3", "gemma3"]



@pytest.fixture(scope="module", params=DENSE)
def family(request, tmp_path_factory) -> HFModel:
    return make_hf_model(request.param, tmp_path_factory.mktemp(request.param) / "model")



def engine_logits(engine, prompt: list[int]) -> torch.Tensor:
    """Last-position logits of `prompt` through the engine's batch preparation and model, every rank
    taking part (the step's inputs go to the other ranks as the runner sends them)."""
    engine.add_request("logits", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    batch = engine.scheduler.schedule()
    ids, positions, meta, rows = engine.runner.prepare(batch)
    if engine.runner.broadcast is not None:
        engine.runner.broadcast((ids, positions, meta, rows))
    with torch.inference_mode():
        hidden = engine.model(ids, positions, engine.kv, meta)
        out = engine.model.logits(hidden.index_select(0, torch.tensor(rows)))[0]
    engine.abort("logits")
    return out


def test_two_ranks_equal_transformers_tokens_and_logits(family, engines):
    engine = engines(family.path, tensor_parallel_size=2)
    ps = prompts()
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=N, **GREEDY))
    out = drain(engine)
    for i, p in enumerate(ps):
        assert out[f"r{i}"].token_ids == family.greedy(p, N), f"{family.name}: prompt {i} ({len(p)} tokens)"
    for p in ps:
        torch.testing.assert_close(engine_logits(engine, p), family.logits(p), atol=1e-4, rtol=1e-4)


def test_shared_memory_collectives_equal_the_process_group(tmp_path, engines, monkeypatch):
    """The fast path (shared memory, the default on CPU) and its reference (gloo) give the same tokens and
    logits, chunked prefill included."""
    fam = make_hf_model("llama3", tmp_path / "m")
    from engine.model.collectives import ProcessGroupCollectives, SharedMemoryCollectives

    shm = engines(fam.path, tensor_parallel_size=2, max_num_seqs=2, max_num_batched_tokens=8)
    assert isinstance(shm.model.shard.group, SharedMemoryCollectives)
    monkeypatch.setenv("SPLITFIRE_TP_COLLECTIVES", "gloo")
    ref = engines(fam.path, tensor_parallel_size=2, max_num_seqs=2, max_num_batched_tokens=8)
    assert isinstance(ref.model.shard.group, ProcessGroupCollectives)
    for e in (shm, ref):
        for i, p in enumerate(prompts()):
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=N, **GREEDY))
    assert {k: v.token_ids for k, v in drain(shm).items()} == {k: v.token_ids for k, v in drain(ref).items()}
    for p in (prompts()[0], prompts()[1][:8]):
        torch.testing.assert_close(engine_logits(shm, p), engine_logits(ref, p), atol=1e-5, rtol=1e-5)


RANK_1 = """
import sys, torch
from engine.model.collectives import ProcessGroupCollectives, SharedMemoryCollectives
from engine.ranks import _process_group, _store
store = _store(1, 2, int(sys.argv[1]))
group = _process_group(torch.device("cpu"), 1, 2, store)
c = SharedMemoryCollectives(sys.argv[2], 1, 2, 4096, ProcessGroupCollectives(group, 2), create=False)
for n in (3, 1000, 5000):  # 5000 floats: past the 4096-byte slot, through gloo
    x = torch.arange(n, dtype=torch.float32) * 2
    c.all_reduce(x)
    g = c.all_gather(torch.full((2, n % 7 + 1), 5.0))
c.close()
import os
os._exit(0)  # (not gloo's teardown at interpreter exit, which raced rank 0's: "terminate called" seen once)
"""


def test_shared_memory_collectives_sum_and_gather_with_the_fallback_past_a_slot(tmp_path):
    import subprocess
    import sys

    from engine.model.collectives import ProcessGroupCollectives, SharedMemoryCollectives
    from engine.ranks import _process_group, _store

    store = _store(0, 2, 0)  # (the store must outlive the group)
    name = f"sf-test-{os.getpid()}"
    c = SharedMemoryCollectives(name, 0, 2, 4096, None, create=True)  # type: ignore[arg-type]
    other = subprocess.Popen([sys.executable, "-c", RANK_1, str(store.port), name])
    group = _process_group(torch.device("cpu"), 0, 2, store)
    c.fallback = ProcessGroupCollectives(group, 2)
    for n in (3, 1000, 5000):
        x = torch.arange(n, dtype=torch.float32)
        assert c.all_reduce(x) is x
        assert torch.equal(x, torch.arange(n, dtype=torch.float32) * 3)
        g = c.all_gather(torch.full((2, n % 7 + 1), 1.0))
        assert torch.equal(g, torch.cat([torch.full((2, n % 7 + 1), 1.0), torch.full((2, n % 7 + 1), 5.0)], -1))
    assert other.wait(30) == 0
    c.close()


def test_four_ranks_with_fewer_kv_heads_than_ranks(tmp_path, engines):
    """2 KV heads over 4 ranks: each KV head is replicated on two ranks, each rank has one query head."""
    fam = make_hf_model("llama3", tmp_path / "m")
    engine = engines(fam.path, tensor_parallel_size=4)
    attn = engine.model.layers[0].attn
    assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=N, **GREEDY))
    out = drain(engine)
    assert [out[f"r{i}"].token_ids for i in range(3)] == [fam.greedy(p, N) for p in prompts()]


def test_chunked_prefill_prefix_hits_and_speculation_under_two_ranks(tmp_path, engines):
    fam = make_hf_model("qwen3", tmp_path / "m")
    engine = engines(fam.path, tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=16,
                     speculative="ngram")
    first = prompts()[2]
    engine.add_request("first", first, SamplingParams(max_tokens=N, **GREEDY))
    assert drain(engine)["first"].token_ids == fam.greedy(first, N)
    second = first[:60] + [9, 8, 7, 6, 5]  # 3 cached blocks, then new tokens in 16-token chunks
    repetitive = [11, 12, 13, 14] * 10  # prompt lookup drafts here
    engine.add_request("second", second, SamplingParams(max_tokens=N, **GREEDY))
    engine.add_request("rep", repetitive, SamplingParams(max_tokens=N, **GREEDY))
    out = drain(engine)
    assert out["second"].cached_tokens == 48
    assert out["second"].token_ids == fam.greedy(second, N)
    assert out["rep"].token_ids == fam.greedy(repetitive, N)
    assert engine.drafter is not None and engine.drafter.drafted > 0


def test_quantized_two_ranks_equal_one_rank(tmp_path, engines):
    """int8 weights quantized per rank (group-wise along each rank's columns) compute what the whole
    int8 model computes: the same groups, the same codes."""
    # o: 256 columns, down: 256 columns: 128 a rank, whole groups of the whole row's 128
    fam = make_hf_model("llama3", tmp_path / "m", intermediate_size=256, head_dim=64)
    one = engines(fam.path, quantization="int8")
    two = engines(fam.path, quantization="int8", tensor_parallel_size=2)
    for e in (one, two):
        for i, p in enumerate(prompts()):
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=N, **GREEDY))
    assert {k: v.token_ids for k, v in drain(one).items()} == {k: v.token_ids for k, v in drain(two).items()}


def test_quantized_gguf_two_ranks_equal_one_rank(tmp_path, engines, monkeypatch):
    """A Q4_0 GGUF (Q8_0 embedding) split in whole 32-weight blocks computes what it computes on one
    device, its codes never inflated to float."""
    pytest.importorskip("gguf")
    from gguf_writer import write_gguf

    from engine.loading.model_store import resolve_model

    monkeypatch.setenv("SPLITFIRE_HOME", str(tmp_path / "home"))
    fam = make_hf_model("qwen3", tmp_path / "hf", intermediate_size=128)  # down: 64 columns a rank, 2 blocks
    path = tmp_path / "q4.gguf"
    write_gguf(fam.path, path, quantize="Q4_0", embedding_quantize="Q8_0")
    model_dir = resolve_model(str(path))
    one = engines(model_dir, cpu_activations="float")
    two = engines(model_dir, cpu_activations="float", tensor_parallel_size=2)
    assert two.model.layers[0].mlp.down.quantized[0].kind == "int4"
    assert two.model.embed_quantized is not None
    for e in (one, two):
        for i, p in enumerate(prompts()):
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=N, **GREEDY))
    assert {k: v.token_ids for k, v in drain(one).items()} == {k: v.token_ids for k, v in drain(two).items()}


def test_a_compressed_checkpoint_over_two_ranks_equals_the_plain_one(tmp_path, engines):
    """`splitfire compress`'s output split over two ranks: each rank decodes its rows' chunks (and its
    columns from whole tensors) to the same weights, so tokens and logprobs equal the plain bfloat16 split."""
    from engine.loading.compress import compress_dir

    fam = make_hf_model("llama3", tmp_path / "fp32", intermediate_size=128)
    plain = tmp_path / "bf16"
    fam.model.to(torch.bfloat16).save_pretrained(plain)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (plain / f).write_bytes((fam.path / f).read_bytes())
    (plain / "config.json").write_text(json.dumps({**fam.config, "torch_dtype": "bfloat16"}))
    compress_dir(plain, tmp_path / "z", chunk=1 << 12)  # (chunks small enough that a rank's rows skip some)
    outs = []
    for d in (plain, tmp_path / "z"):
        e = engines(d, dtype="bfloat16", tensor_parallel_size=2)
        for i, p in enumerate(prompts()):
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=N, logprobs=2, **GREEDY))
        outs.append({k: (v.token_ids, v.logprobs) for k, v in drain(e).items()})
    assert outs[0] == outs[1]


def test_a_rank_holds_its_share_of_the_weights(tmp_path, engines):
    fam = make_hf_model("llama3", tmp_path / "m", intermediate_size=128, hidden_size=128)

    def nbytes(model) -> tuple[int, int]:
        total = replicated = 0
        for name, p in model.named_parameters():
            n = p.numel() * p.element_size()
            total += n
            replicated += n if "norm" in name else 0
        for m in model.modules():  # oneDNN-packed weights replace their parameters
            packed = getattr(m, "packed", None)
            total += packed.numel() * packed.element_size() if packed is not None else 0
        return total, replicated

    whole, _ = nbytes(engines(fam.path).model)
    part, replicated = nbytes(engines(fam.path, tensor_parallel_size=2).model)
    assert part <= whole / 2 + replicated + 64, (part, whole, replicated)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_mixture_of_experts_over_two_ranks_equals_transformers(tmp_path, engines, name, expert_parallel):
    """Every expert split across the ranks, or (expert parallel) each rank holding half of the experts
    whole; shared experts (Qwen2-MoE's, gated) split; routing identical to one device."""
    fam = make_hf_model(name, tmp_path / "m")
    engine = engines(fam.path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    moe = next(layer.mlp for layer in engine.model.layers if hasattr(layer.mlp, "local"))
    if expert_parallel:
        assert len(moe.local) == moe.cfg.num_experts // 2
    else:
        assert len(moe.columns) == moe.cfg.intermediate_size // 2
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=N, **GREEDY))
    out = drain(engine)
    assert [out[f"r{i}"].token_ids for i in range(3)] == [fam.greedy(p, N) for p in prompts()]
    for p in prompts()[:2]:
        torch.testing.assert_close(engine_logits(engine, p), fam.logits(p), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_latent_attention_over_two_ranks_equals_transformers(tmp_path, engines, name, expert_parallel):
    """DeepSeek-V3 (q LoRA, sigmoid grouped routing, shared expert) and V2 (plain q projection, softmax
    groups): heads split, the latent cache whole on each rank, experts split or placed."""
    fam = make_hf_model(name, tmp_path / "m")
    engine = engines(fam.path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    assert engine.model.layers[0].attn.heads == fam.config["num_attention_heads"] // 2
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=N, **GREEDY))
    out = drain(engine)
    assert [out[f"r{i}"].token_ids for i in range(3)] == [fam.greedy(p, N) for p in prompts()]
    for p in prompts()[:2]:
        torch.testing.assert_close(engine_logits(engine, p), fam.logits(p), atol=1e-4, rtol=1e-4)


def test_a_split_that_does_not_divide_is_refused_by_name(tmp_path, engines):
    fam = make_hf_model("llama3", tmp_path / "m")  # 4 heads
    with pytest.raises(ModelLoadError, match="tensor parallel size 3 does not divide the attention heads"):
        engines(fam.path, tensor_parallel_size=3)


def test_splitfire_generate_with_two_ranks(tmp_path):
    from splitfire_cli import main

    fam = make_hf_model("gemma3", tmp_path / "m")
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p, "max_tokens": N, **GREEDY}) + "\n" for p in prompts()))
    rc = main(["generate", "--model", str(fam.path), "--device", "cpu", "--kv-cache-gb", "0.01", "-tp", "2",
               "--input", str(src), "--output", str(dst), "--quiet"])
    assert rc == 0
    assert [json.loads(line)["token_ids"] for line in dst.read_text().splitlines()] == [
        fam.greedy(p, N) for p in prompts()]


async def test_a_served_two_rank_worker_streams_and_dies_with_a_rank(tmp_path):
    """`splitfire serve -tp 2` answers as transformers does; killing rank 1 mid-decode takes the worker
    down within seconds, with a log line naming the rank, and the stream fails instead of hanging (the
    router fails such streams over, as after a kill -9 of the worker)."""
    import asyncio

    import grpc

    fam = make_hf_model("llama3", tmp_path / "m")
    worker = start_worker("both", fam.path, tmp_path, "--tensor-parallel-size", "2")
    try:
        p = prompts()[1]
        got = await generate(address(worker), p, greedy(N, ignore_eos=True))
        assert got.token_ids == fam.greedy(p, N)
        children = [int(c) for c in open(f"/proc/{worker.popen.pid}/task/{worker.popen.pid}/children").read().split()]
        ranks = [c for c in children if b"engine.ranks" in open(f"/proc/{c}/cmdline", "rb").read()]
        assert len(ranks) == 1
        long = asyncio.create_task(generate(address(worker), p, greedy(900, ignore_eos=True)))
        await asyncio.sleep(0.5)
        assert not long.done()
        os.kill(ranks[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(long, 15)
        assert await asyncio.to_thread(worker.popen.wait, 15) != 0
        assert time.monotonic() - t0 < 10
        assert "event=rank_failed rank=1" in worker.log()
    finally:
        stop_all(worker)


async def test_a_stream_on_a_worker_whose_rank_dies_fails_over_through_the_router(tiny_model_dir, tmp_path):
    """Two colocated TP=2 workers behind a router: rank 1 of the one serving a stream is killed mid-decode;
    its worker exits, the router resumes the stream on the other, the client's text equals an uninterrupted
    reply, and the survivor holds no KV blocks afterwards."""
    import asyncio

    import aiohttp
    from grpc_client import stats, wait_blocks_free
    from procs import base_url, start_router
    from test_router_routing import MODEL, chat, sse_text

    workers = [start_worker("both", tiny_model_dir, tmp_path, "--tensor-parallel-size", "2", name=f"tp{i}")
               for i in range(2)]
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--colocated",
                          *(address(w) for w in workers))
    try:
        messages = [{"role": "user", "content": "Count forever"}]
        reference, _ = await chat(router, messages, max_tokens=400)
        body = {"model": MODEL, "messages": messages, "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        serving: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def read_stream() -> str:
            async with aiohttp.ClientSession() as s, s.post(base_url(router) + "/v1/chat/completions", json=body) as r:
                serving.set_result(r.headers["X-Splitfire-Decode"])
                return await sse_text(r)

        reader = asyncio.create_task(read_stream())
        served = await serving
        victim = next(w for w in workers if address(w) == served)
        for _ in range(1000):  # mid-decode: fewer than 360 of the 400 tokens left
            if 0 < (await stats(address(victim))).decode_tokens_remaining < 360:
                break
            await asyncio.sleep(0.003)
        pid = victim.popen.pid
        rank = next(int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()
                    if b"engine.ranks" in open(f"/proc/{c}/cmdline", "rb").read())
        os.kill(rank, signal.SIGKILL)
        assert await reader == reference
        assert await asyncio.to_thread(victim.popen.wait, 15) != 0
        survivor = next(w for w in workers if w is not victim)
        await wait_blocks_free(address(survivor))
    finally:
        stop_all(router, *workers)
