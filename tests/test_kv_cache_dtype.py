"""--kv-cache-dtype float16 and fp8 (e4m3): the C kernels store exactly torch's rounding of K and V
and attend over the widened values exactly as over a float32 cache holding them; engines with a
float16 or e4m3 cache compute what the float32 one does to that rounding, in every attention family,
and colocated and disaggregated serving agree (a worker pair that disagrees is refused by name). On
CUDA the cache is the model dtype or e4m3."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import drain, make_engine
from hf_models import make_hf_model

from common.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from engine.model.kernels import cpu_ops

needs_f16 = pytest.mark.skipif(not cpu_ops.kv_supported(torch.float16, 16),
                               reason="the C kernels read a float16 cache with the AVX2 + F16C build only")
E4M3 = torch.float8_e4m3fn


@needs_f16
@pytest.mark.parametrize("dtype", [torch.float16, E4M3])
@pytest.mark.parametrize("head_dim,window", [(64, 0), (16, 0), (24, 5), (128, 0)])
def test_decode_attention_over_16_or_8_bits_equals_float32_holding_the_same_values(head_dim, window, dtype):
    """The float16 and e4m3 kernels widen each value and then do the float32 kernel's arithmetic: bit-identical
    to running the float32 kernel on the widened cache (head dims of 64, 128, and 16/24: not a multiple
    of 64, so the value sum's partial register block runs)."""
    g = torch.Generator().manual_seed(head_dim)
    blocks, bs, kvh, heads = 12, 8, 2, 6
    cache16 = torch.randn(blocks, 2, bs, kvh, head_dim, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[:10].view(2, 5).to(torch.int64)
    lens = torch.tensor([37, 9], dtype=torch.int64)  # ragged, a partial last block, a tail of < 8 keys
    q = torch.randn(2, heads, head_dim, generator=g)
    out16 = cpu_ops.paged_decode(q, cache16, tables, lens, 0.3, window)
    out32 = cpu_ops.paged_decode(q, cache16.float(), tables, lens, 0.3, window)
    assert torch.equal(out16, out32)
    # and it is attention: softmax(q k / ...) v over each sequence's keys
    for b in range(2):
        keys = cache16.float()[tables[b]].transpose(0, 1).reshape(2, -1, kvh, head_dim)[:, : lens[b]]
        if window:
            keys = keys[:, -window:]
        k, v = keys[0].repeat_interleave(heads // kvh, 1), keys[1].repeat_interleave(heads // kvh, 1)
        ref = torch.einsum("hn,nhd->hd", torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) * 0.3, -1), v)
        torch.testing.assert_close(out16[b], ref, rtol=1e-5, atol=1e-5)


@needs_f16
def test_the_c_e4m3_store_rounds_as_torch_casts():
    """Nearest even, saturating at +-448, subnormals down to 2^-9, signed zeros: every float32 class, and
    every midpoint between neighbouring e4m3 values (where a wrong tie-break shows)."""
    g = torch.Generator().manual_seed(1)
    grid = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([torch.randn(20000, generator=g) * torch.exp(torch.randn(20000, generator=g) * 4), mids, -mids,
                   grid, torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, 480.0, 1e30, float("inf"), -float("inf"),
                                       2.0**-10, 2.0**-9, 3 * 2.0**-11, 1e-40])])
    ours = cpu_ops.e4m3_from_float(x)
    # (clamped first: torch 2.13's cast saturates, 2.11's gave NaN past 464 — seen on an H200 host)
    assert torch.equal(ours.view(torch.uint8), x.clamp(-448.0, 448.0).to(E4M3).view(torch.uint8))


@needs_f16
@pytest.mark.parametrize("dtype", [torch.float16, E4M3])
def test_rope_store_writes_torchs_rounding(dtype):
    g = torch.Generator().manual_seed(0)
    heads, kvh, d, bs = 4, 2, 16, 4
    qkv = torch.randn(3, (heads + 2 * kvh) * d, generator=g) * 40  # large enough to round visibly
    angles = torch.rand(3, 1, d // 2, generator=g)
    freqs = torch.polar(torch.ones_like(angles), angles)
    k_rows = torch.tensor([0, 9, 17], dtype=torch.int64)  # rows of K in the layer view [blocks * 2 * bs, kvh, d]
    c16, c32 = torch.zeros(3, 2, bs, kvh, d).to(dtype), torch.zeros(3, 2, bs, kvh, d)
    q16, q32 = qkv.clone(), qkv.clone()
    cpu_ops.rope_store(q16, heads, kvh, d, freqs, c16, k_rows, bs)
    cpu_ops.rope_store(q32, heads, kvh, d, freqs, c32, k_rows, bs)
    assert torch.equal(q16, q32)  # q and k roped alike
    assert torch.equal(c16.view(torch.uint8), c32.to(dtype).view(torch.uint8)) and c16.float().abs().sum() > 0


def _logprobs(engine, prompts, tokens=12):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2))
    return drain(engine)


@pytest.mark.parametrize("family,quantization", [("llama3", "int4"), ("llama3", None), ("qwen3", None),
                                                 ("deepseek_v3", None), ("gemma3", None)])
def test_engines_with_a_float16_cache_compute_the_float32_model(tmp_path, family, quantization):
    """Same prompts through the same model with a float32 and a float16 cache (the C loop, the module
    path's kernels, SDPA prefill, latent attention, sliding windows): the chosen tokens' logprobs agree
    to float16 rounding, and the cache really holds float16 (half the bytes per block)."""
    d = make_hf_model(family, tmp_path / family).path
    prompts = [[(11 * i + 5 * j) % 200 + 3 for j in range(4 + 9 * i)] for i in range(4)]
    f32 = make_engine(d, quantization=quantization, max_num_seqs=4)
    f16 = make_engine(d, quantization=quantization, max_num_seqs=4, kv_cache_dtype="float16")
    assert f16.kv.buffer.dtype == torch.float16 and f16.kv.layout.page_bytes * 2 == f32.kv.layout.page_bytes
    a, b = _logprobs(f32, prompts), _logprobs(f16, prompts)
    for k in a:
        first = [lp[1] for lp in a[k].logprobs[:3]]  # before any near-tie can send them down different paths
        torch.testing.assert_close(torch.tensor([lp[1] for lp in b[k].logprobs[:3]]), torch.tensor(first),
                                   rtol=0, atol=2e-2)
    same = sum(a[k].token_ids == b[k].token_ids for k in a)
    assert same >= 3, f"only {same}/4 greedy outputs equal the float32 cache's"


@pytest.mark.parametrize("family,quantization", [("llama3", "int4"), ("llama3", None), ("qwen3", None),
                                                 ("deepseek_v3", None), ("gemma3", None)])
def test_engines_with_an_e4m3_cache_compute_the_model_over_e4m3_rounded_keys_and_values(tmp_path, monkeypatch,
                                                                                           family, quantization):
    """An e4m3 cache (the C loop, the module path's kernels, SDPA prefill, latent attention, sliding windows)
    computes what a float32 cache holding torch's e4m3 rounding of every K and V computes: the same greedy
    tokens and logprobs to float32 sums — e4m3 is read back exactly, only stored rounded. (Against the
    unrounded float32 cache, 3 mantissa bits move this random model's near-ties: printed, not held.) The cache
    holds a quarter of float32's bytes per block."""
    from engine.model import attention, mla

    d = make_hf_model(family, tmp_path / family).path
    prompts = [[(11 * i + 5 * j) % 200 + 3 for j in range(4 + 9 * i)] for i in range(4)]
    f8 = make_engine(d, quantization=quantization, max_num_seqs=4, kv_cache_dtype="fp8")
    assert f8.kv.buffer.dtype == E4M3
    got = _logprobs(f8, prompts)
    exact = _logprobs(make_engine(d, quantization=quantization, max_num_seqs=4), prompts)
    store = attention.store_rows

    def rounded(flat, rows, values):
        store(flat, rows, values.to(E4M3).to(flat.dtype))

    with monkeypatch.context() as m:  # every K/V write through torch (no C store), rounded to e4m3 first
        m.setattr(attention, "store_rows", rounded)
        m.setattr(mla, "store_rows", rounded)
        m.setattr(cpu_ops, "kv_supported", lambda dtype, head_dim: False)
        sim_engine = make_engine(d, quantization=quantization, max_num_seqs=4)
        sim_engine.model.cpu_layers_off = "the float32 reference of an e4m3 cache"
        assert sim_engine.kv.layout.page_bytes == 4 * f8.kv.layout.page_bytes
        sim = _logprobs(sim_engine, prompts)
    for k in sim:
        assert got[k].token_ids == sim[k].token_ids, k
        torch.testing.assert_close(torch.tensor([lp[1] for lp in got[k].logprobs]),
                                   torch.tensor([lp[1] for lp in sim[k].logprobs]), rtol=0, atol=1e-3)
    same = sum(got[k].token_ids == exact[k].token_ids for k in exact)
    print(f"{family}: {same}/4 greedy outputs with an e4m3 cache equal the float32 cache's")


def test_fp8_holds_twice_bfloat16s_tokens_per_byte(tmp_path):
    """KV tokens per GiB: e4m3 2x bfloat16 (and 4x float32) in the same --kv-cache-gb."""
    d = make_hf_model("llama3", tmp_path / "m").path
    tokens = {kv: make_engine(d, kv_cache_dtype=kv, kv_cache_gb=0.02).kv.layout.num_blocks
              for kv in ("bfloat16", "fp8", "float32")}
    assert tokens["fp8"] // 2 == tokens["bfloat16"] and tokens["fp8"] // 4 == tokens["float32"], tokens


@needs_f16
def test_attention_over_an_e4m3_cache_is_within_its_rounding_of_float32():
    """Decode attention reading e4m3 K and V (3 mantissa bits: a relative error of at most 2^-4 per value)
    against the float32 cache they were rounded from: outputs within 8% of the values' scale, the softmax
    weights within what the keys' rounding moves them."""
    g = torch.Generator().manual_seed(4)
    blocks, bs, kvh, heads, d = 16, 16, 2, 8, 64
    cache = torch.randn(blocks, 2, bs, kvh, d, generator=g)
    tables = torch.randperm(blocks, generator=g)[:16].view(2, 8).to(torch.int64)
    lens = torch.tensor([120, 77], dtype=torch.int64)
    q = torch.randn(2, heads, d, generator=g)
    exact = cpu_ops.paged_decode(q, cache, tables, lens, d**-0.5, 0)
    e4m3 = cpu_ops.paged_decode(q, cache.to(E4M3), tables, lens, d**-0.5, 0)
    err = (e4m3 - exact).abs().max().item()
    assert err < 0.08 * exact.abs().max().item(), err
    assert err > 0  # (not vacuous: the rounding is visible)


def test_the_default_is_the_model_dtype():
    assert EngineConfig(device="cpu").torch_kv_dtype == torch.float32
    assert EngineConfig(device="cpu", kv_cache_dtype="float32").torch_kv_dtype == torch.float32
    assert EngineConfig(device="cuda", dtype="bfloat16").torch_kv_dtype == torch.bfloat16
    assert EngineConfig(device="cpu", kv_cache_dtype="fp8").torch_kv_dtype == E4M3
    assert EngineConfig(device="cpu", kv_cache_dtype="fp8_e4m3").torch_kv_dtype == E4M3


def test_a_cache_dtype_other_than_the_models_or_fp8_is_refused_on_cuda():
    if torch.cuda.is_available():
        EngineConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8").validate()
    with pytest.raises(ValueError, match="kv-cache-dtype float16 differs from the model dtype"):
        EngineConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="float16").validate()
    with pytest.raises(ValueError, match="kv-cache-dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8_e5m2").validate()
    EngineConfig(device="cpu", kv_cache_dtype="float16").validate()
    EngineConfig(device="cpu", kv_cache_dtype="fp8").validate()


@pytest.mark.parametrize("kv", ["float16", "fp8"])
async def test_disaggregated_narrow_caches_continue_exactly_and_a_mismatch_is_refused(tiny_model_dir, tmp_path, kv):
    """Prefill and decode workers both at --kv-cache-dtype float16 or fp8 (real processes, Mooncake TCP): the
    transferred pages continue exactly as a colocated worker with that cache computes; a float32 prefill
    worker cannot write into the decode worker's cache, and says why (both types named) instead of sending
    pages of another size."""
    import grpc
    from grpc_client import generate, greedy
    from procs import address, start_worker

    args = ("--kv-cache-dtype", kv)
    pre = start_worker("prefill", tiny_model_dir, tmp_path, *args)
    pre32 = start_worker("prefill", tiny_model_dir, tmp_path)
    dec = start_worker("decode", tiny_model_dir, tmp_path, *args, "--local-prefill-max-tokens", "0")
    both = start_worker("both", tiny_model_dir, tmp_path, *args)
    try:
        prompts = [[(13 * i + 3 * j) % 390 + 3 for j in range(20 + 30 * i)] for i in range(3)]
        disagg = [await generate(address(dec), p, greedy(8), prefill=address(pre)) for p in prompts]
        coloc = [await generate(address(both), p, greedy(8)) for p in prompts]
        for d, c in zip(disagg, coloc, strict=True):
            assert d.prefill_mode == "remote"
            assert d.token_ids == c.token_ids and len(d.token_ids) == 8
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(address(dec), prompts[0], greedy(8), prefill=address(pre32))
        name = {"float16": "float16", "fp8": "float8_e4m3fn"}[kv]
        assert f"decode worker's KV cache holds {name}, this prefill worker's float32" in err.value.details()
    finally:
        for p in (pre, pre32, dec, both):
            assert p.stop() == 0, p.log()[-2000:]
