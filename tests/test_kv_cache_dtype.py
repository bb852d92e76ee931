"""--kv-cache-dtype float16 on CPU: the C kernels store exactly torch's float16 rounding of K and V
and attend over the widened values exactly as over a float32 cache holding them; engines with a
float16 cache compute what the float32 one does to that rounding, in every attention family, and
colocated and disaggregated serving agree. On CUDA the cache stays in the model dtype."""

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


@needs_f16
@pytest.mark.parametrize("head_dim,window", [(64, 0), (16, 0), (24, 5), (128, 0)])
def test_decode_attention_over_float16_equals_float32_holding_the_same_values(head_dim, window):
    """The float16 kernel widens each value and then does the float32 kernel's arithmetic: bit-identical
    to running the float32 kernel on the widened cache (head dims of 64, 128, and 16/24: not a multiple
    of 64, so the value sum's partial register block runs)."""
    g = torch.Generator().manual_seed(head_dim)
    blocks, bs, kvh, heads = 12, 8, 2, 6
    cache16 = torch.randn(blocks, 2, bs, kvh, head_dim, generator=g).half()
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
def test_rope_store_writes_torchs_float16_rounding():
    g = torch.Generator().manual_seed(0)
    heads, kvh, d, bs = 4, 2, 16, 4
    qkv = torch.randn(3, (heads + 2 * kvh) * d, generator=g) * 40  # large enough to round visibly
    angles = torch.rand(3, 1, d // 2, generator=g)
    freqs = torch.polar(torch.ones_like(angles), angles)
    k_rows = torch.tensor([0, 9, 17], dtype=torch.int64)  # rows of K in the layer view [blocks * 2 * bs, kvh, d]
    c16, c32 = torch.zeros(3, 2, bs, kvh, d).half(), torch.zeros(3, 2, bs, kvh, d)
    q16, q32 = qkv.clone(), qkv.clone()
    cpu_ops.rope_store(q16, heads, kvh, d, freqs, c16, k_rows, bs)
    cpu_ops.rope_store(q32, heads, kvh, d, freqs, c32, k_rows, bs)
    assert torch.equal(q16, q32)  # q and k roped alike
    assert torch.equal(c16, c32.half()) and c16.abs().sum() > 0


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


def test_the_default_is_the_model_dtype():
    assert EngineConfig(device="cpu").torch_kv_dtype == torch.float32
    assert EngineConfig(device="cpu", kv_cache_dtype="float32").torch_kv_dtype == torch.float32
    assert EngineConfig(device="cuda", dtype="bfloat16").torch_kv_dtype == torch.bfloat16


def test_a_cache_dtype_other_than_the_models_is_refused_on_cuda():
    with pytest.raises(ValueError, match="kv-cache-dtype float16 differs from the model dtype"):
        EngineConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="float16").validate()
    with pytest.raises(ValueError, match="kv-cache-dtype must be"):
        EngineConfig(kv_cache_dtype="fp8").validate()
    EngineConfig(device="cpu", kv_cache_dtype="float16").validate()


async def test_disaggregated_float16_caches_continue_exactly_and_a_mismatch_is_refused(tiny_model_dir, tmp_path):
    """Prefill and decode workers both at --kv-cache-dtype float16 (real processes, Mooncake TCP): the
    transferred pages continue exactly as a colocated float16 worker computes; a float32 prefill worker
    cannot write into a float16 decode worker's cache, and says why instead of sending half-sized pages."""
    import grpc
    from grpc_client import generate, greedy
    from procs import address, start_worker

    args = ("--kv-cache-dtype", "float16")
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
        assert "page size differs" in err.value.details()
    finally:
        for p in (pre, pre32, dec, both):
            assert p.stop() == 0, p.log()[-2000:]
