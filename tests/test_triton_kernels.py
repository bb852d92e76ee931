"""Triton kernels against the torch reference path. Without a GPU they run in the Triton
interpreter (TRITON_INTERPRET=1) at small shapes, so CI checks kernel logic on every change;
with CUDA they run compiled at model shapes in bfloat16."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at import
triton = pytest.importorskip("triton")

from engine.model.attention import AttentionMetadata, DecodeBatch, paged_attention, write_kv  # noqa: E402
from engine.model.kernels import triton_ops  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
# The whole engine on the GPU code path with its tensors on the CPU: kernels interpreted. On a CUDA host
# tests/test_cuda_engine.py runs the engine on the device instead (compiled kernels, graphs replayed).
ON_CPU_ONLY = pytest.mark.skipif(CUDA, reason="the GPU code path on CPU tensors, interpreted: "
                                 "tests/test_cuda_engine.py covers the engine on a GPU")
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = dict(atol=2e-2, rtol=2e-2) if CUDA else dict(atol=1e-5, rtol=1e-5)
HEAD_DIM = 128 if CUDA else 16


def _cache(num_blocks: int, block_size: int, kv_heads: int, dim: int) -> torch.Tensor:
    return torch.randn(num_blocks, 2, block_size, kv_heads, dim, device=DEV, dtype=DTYPE)


def within_bf16(ours: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor) -> None:
    """On CUDA (bfloat16): ours is no further from the float32 result than the torch bfloat16 reference
    is, give or take twice; on CPU (float32) the two agree to TOL."""
    if not CUDA:
        torch.testing.assert_close(ours, reference, **TOL)
        return
    ours_err = (ours.float() - exact).abs().max().item()
    ref_err = (reference.float() - exact).abs().max().item()
    assert ours_err <= 2 * ref_err + 1e-2, f"error {ours_err:.4f} vs the torch bfloat16 path's {ref_err:.4f}"


@pytest.mark.parametrize("splits", [1, 4])  # split-KV: 4 programs per sequence, some with no keys at short contexts
@pytest.mark.parametrize("window", [0, 5, 20])  # 0: full attention; else a sliding window of that many keys
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 8])
def test_paged_decode_attention_matches_torch(group, block_size, window, splits):
    torch.manual_seed(group * 100 + block_size)
    kv_heads = 2
    # Ragged contexts, on and around block boundaries, as after prefix-cache hits of any length; the
    # last spans several 64-key tiles per split.
    ctx = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 3 * block_size, 5 * block_size + 3,
                        40 * block_size + 5], device=DEV)
    b = len(ctx)
    nb = int(-(-ctx.max() // block_size))
    cache = _cache(b * nb, block_size, kv_heads, HEAD_DIM)
    perm = torch.randperm(b * nb, device=DEV).view(b, nb)  # scattered, not consecutive, pages
    q = torch.randn(b, kv_heads * group, HEAD_DIM, device=DEV, dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    ours = triton_ops.paged_decode_attention(q, cache, perm, ctx, scale, window=window, splits=splits)
    mask = (torch.arange(nb * block_size, device=DEV)[None, :] < ctx[:, None]).view(b, 1, 1, -1)
    meta = AttentionMetadata(block_size, torch.empty(0), torch.empty(0), [], [DecodeBatch(0, perm, mask)])
    ref = paged_attention(q, cache, meta, scale, window or None)
    torch.testing.assert_close(ours, ref, **TOL)


def test_decode_splits_fill_the_gpu_and_none_on_cpu():
    assert triton_ops.decode_splits(torch.device("cpu"), 1) == 1
    if CUDA:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert triton_ops.decode_splits(DEV, 8) == 16  # batch 1 x 8 kv heads: 16 splits (the cap)
        assert triton_ops.decode_splits(DEV, 4 * sms) == 1  # enough programs already


def test_store_kv_matches_torch():
    torch.manual_seed(1)
    block_size, kv_heads = 16, 4
    cache_a = _cache(8, block_size, kv_heads, HEAD_DIM)
    cache_b = cache_a.clone()
    pairs = torch.randperm(8 * block_size, device=DEV)[:37]  # distinct (block, slot) pairs
    blocks, slots = pairs // block_size, pairs % block_size
    t = len(pairs)
    k = torch.randn(t, kv_heads, HEAD_DIM, device=DEV, dtype=DTYPE)
    v = torch.randn(t, kv_heads, HEAD_DIM, device=DEV, dtype=DTYPE)
    triton_ops.store_kv(cache_a, k, v, blocks, slots)
    rows = blocks * 2 * block_size + slots
    write_kv(cache_b, k, v, AttentionMetadata(block_size, rows, rows + block_size, [], []))
    torch.testing.assert_close(cache_a, cache_b, atol=0, rtol=0)


@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_rms_norm_matches_torch(with_residual):
    torch.manual_seed(2)
    x = torch.randn(7, 96, device=DEV, dtype=DTYPE)
    w = torch.randn(96, device=DEV, dtype=DTYPE)
    res = torch.randn(7, 96, device=DEV, dtype=DTYPE) if with_residual else None
    expected_in = x.float() + (res.float() if res is not None else 0)
    expected = (expected_in * torch.rsqrt(expected_in.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(DTYPE)
    res_copy = res.clone() if res is not None else None
    out = triton_ops.rms_norm(x, w, 1e-5, res_copy)
    torch.testing.assert_close(out, expected, **TOL)
    if with_residual:
        torch.testing.assert_close(res_copy, expected_in.to(DTYPE), **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_matches_complex_reference(monkeypatch, dtype):
    """`triton_ops.rope` against `rope.plain_rope` (the float32 complex multiply): q and k roped together as a view of
    the fused qkv rows (row stride past the heads), a latent head narrower than a power of two's pairs (MLA's rope
    part of 48), attention-scaled frequencies; and `apply_rope` takes the kernel where the Triton kernels run."""
    from engine.model import rope as rope_module
    from engine.model.rope import plain_rope

    torch.manual_seed(3)
    dtype = DTYPE if CUDA else dtype
    for t, heads, dim, extra in ((11, 6, HEAD_DIM, 3 * HEAD_DIM), (5, 1, 48, 0)):
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=DEV) / dim))
        ang = torch.outer(torch.arange(64, dtype=torch.float32, device=DEV), inv)
        pos = torch.tensor([0, 1, 2, 15, 16, 17, 31, 32, 40, 63, 5][:t], device=DEV)
        freqs = torch.polar(torch.full_like(ang, 1.2), ang)[pos].unsqueeze(1)
        rows = torch.randn(t, heads * dim + extra, device=DEV).to(dtype)
        x = rows[:, : heads * dim].view(t, heads, dim)
        expected = plain_rope(x, freqs)
        ours = triton_ops.rope(x, freqs)
        tol = dict(atol=0, rtol=4 * torch.finfo(dtype).eps) if dtype != torch.float32 else dict(atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ours, expected, **tol)
        assert (ours == expected).float().mean() > 0.9
    monkeypatch.setattr(rope_module, "kernels", lambda name, device_type: triton_ops)
    torch.testing.assert_close(rope_module.apply_rope(x, freqs), ours, atol=0, rtol=0)
    monkeypatch.setattr(rope_module, "norm_rope_kernels", lambda: False)
    torch.testing.assert_close(rope_module.apply_rope(x, freqs), expected, atol=0, rtol=0)


@ON_CPU_ONLY
def test_engine_on_triton_kernels_equals_reference(tiny_model_dir, monkeypatch):
    """The whole engine with the Triton kernels in the seam (interpreted on CPU): paged prefill
    (chunked, after prefix hits), decode attention and KV store; greedy output equals the plain
    full-recompute reference."""
    from engine_helpers import drain, make_engine
    from reference import Reference

    from common.sampling_params import SamplingParams
    from engine.model.kernels import kernels

    monkeypatch.setenv("SPLITFIRE_KERNELS", "triton")
    kernels.cache_clear()
    try:
        engine = make_engine(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=24)
        ref = Reference(tiny_model_dir)
        shared = list(range(100, 140))
        rounds = [[list(range(3, 20)), shared + [5, 6], [7, 8, 9]], [shared + [9, 10, 11, 12], shared]]
        for r, prompts in enumerate(rounds):  # the second round hits the first round's cached blocks
            for i, p in enumerate(prompts):
                engine.add_request(f"t{r}{i}", p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
            out = drain(engine)
            for i, p in enumerate(prompts):
                assert out[f"t{r}{i}"].token_ids == ref.greedy(p, 5), (r, i)
        assert engine.blocks.prefix_hit_tokens > 0
    finally:
        kernels.cache_clear()


@pytest.mark.parametrize("window", [0, 7, 24])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_prefill_attention_matches_torch(group, window):
    """Several segments in one launch: a fresh prompt, a prompt after a prefix-cache hit, and a later
    chunk of a chunked prefill; lengths straddle block and tile boundaries."""
    from engine.model.attention import PrefillSegment

    torch.manual_seed(10 + group)
    block_size, kv_heads = 16, 2
    cache = _cache(64, block_size, kv_heads, HEAD_DIM)
    specs = [(37, 37), (21, 16 + 21), (16, 3 * 16 + 5)]  # (new tokens, context)
    tables, segs, metas, row = [], [], [], 0
    pages = torch.randperm(64, device=DEV).tolist()
    for new, ctx in specs:
        nb = -(-ctx // block_size)
        blocks = [pages.pop() for _ in range(nb)]
        tables.append(blocks)
        segs.append((row, new, ctx))
        metas.append(PrefillSegment(row, new, ctx, torch.tensor(blocks, device=DEV)))
        row += new
    q = torch.randn(row, kv_heads * group, HEAD_DIM, device=DEV, dtype=DTYPE)
    max_nb = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (max_nb - len(t)) for t in tables], device=DEV)
    scale = HEAD_DIM**-0.5
    ours = triton_ops.paged_prefill_attention(q, cache, table, torch.tensor(segs, device=DEV), scale,
                                              torch.empty_like(q), max_q_len=max(s[1] for s in specs), block_m=16,
                                              window=window)
    meta = AttentionMetadata(block_size, torch.empty(0), torch.empty(0), metas, [])
    ref = paged_attention(q, cache, meta, scale, window or None)
    torch.testing.assert_close(ours, ref, **TOL)


@pytest.mark.parametrize("tokens, top_k, experts", [(1, 2, 8), (7, 2, 5), (33, 4, 16)])
def test_fused_experts_match_torch(tokens, top_k, experts):
    """The grouped-GEMM MoE kernel equals the per-expert torch loop: any routing, padding tiles,
    experts nobody chose."""
    import torch.nn.functional as F

    from engine.model.kernels import moe_triton
    from engine.model.moe import grouped_experts_reference, route

    torch.manual_seed(tokens)
    hidden, inter = (1024, 512) if CUDA else (64, 32)
    x = torch.randn(tokens, hidden, device=DEV, dtype=DTYPE)
    weights, ids = route(torch.randn(tokens, experts, device=DEV), top_k, renormalize=True)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=DTYPE) * 0.05
    w_down = torch.randn(experts, hidden, inter, device=DEV, dtype=DTYPE) * 0.05
    blocks = {} if CUDA else dict(block_m=16, block_n=32, block_k=32)
    ours = moe_triton.fused_experts(x, ids, weights.to(DTYPE), w_gate_up, w_down, F.silu, **blocks)
    ref = grouped_experts_reference(x, ids, weights.to(DTYPE), w_gate_up, w_down, F.silu)
    torch.testing.assert_close(ours, ref, **TOL)


@pytest.mark.parametrize("kind,group", [("int8", 32), ("int4", 32), ("int4", 64), ("fp8", 32)])
@pytest.mark.parametrize("tokens, top_k, experts", [(1, 2, 8), (9, 4, 6)])
def test_fused_quantized_experts_match_the_per_expert_loop(kind, group, tokens, top_k, experts):
    """Quantized experts stacked per projection through the same grouped kernel (dequantized in
    registers) equal the per-expert loop over their dequantized weights."""
    import torch.nn.functional as F

    from engine.model import quant
    from engine.model.kernels import moe_triton
    from engine.model.moe import grouped_experts, route

    torch.manual_seed(tokens + experts)
    hidden, inter = (1024, 512) if CUDA else (64, 64)
    x = torch.randn(tokens, hidden, device=DEV, dtype=DTYPE)
    weights, ids = route(torch.randn(tokens, experts, device=DEV), top_k, renormalize=True)

    def experts_of(n: int, k: int) -> list[quant.QuantizedWeight]:
        return [quant.quantize(torch.randn(n, k) * 0.05, kind, group).to(DEV) for _ in range(experts)]

    gate_up, down = experts_of(2 * inter, hidden), experts_of(hidden, inter)
    stacks = quant.QuantizedStack.of(gate_up), quant.QuantizedStack.of(down)
    assert stacks[0] is not None and stacks[1] is not None
    blocks = {} if CUDA else dict(block_m=16, block_n=32, block_k=32)
    ours = moe_triton.fused_experts(x, ids, weights.to(DTYPE), *stacks, F.silu, **blocks)
    gu = [w.dequantize_torch().to(DTYPE) for w in stacks[0].parts()]  # (views of the stacks: the same bytes)
    dn = [w.dequantize_torch().to(DTYPE) for w in stacks[1].parts()]
    ref = grouped_experts(x, ids, weights.to(DTYPE), experts, lambda e, r: F.linear(r, gu[e]),
                          lambda e, r: F.linear(r, dn[e]), F.silu)
    gu32 = [w.dequantize_torch().float() for w in stacks[0].parts()]
    dn32 = [w.dequantize_torch().float() for w in stacks[1].parts()]
    exact = grouped_experts(x.float(), ids, weights.float(), experts, lambda e, r: F.linear(r, gu32[e]),
                            lambda e, r: F.linear(r, dn32[e]), F.silu)
    within_bf16(ours, ref, exact)
    assert torch.equal(gu[1], gate_up[1].dequantize_torch().to(DTYPE))
    # Mixed formats cannot be stacked: such experts keep the per-expert loop.
    other = "int4" if kind == "int8" else "int8"
    assert quant.QuantizedStack.of([gate_up[0], quant.quantize(torch.randn(2 * inter, hidden), other, 32)]) is None


def test_expert_alignment_gives_every_pair_one_slot_and_every_tile_one_expert():
    from engine.model.kernels.moe_triton import align_to_experts

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 0]], device=DEV)
    slot_of, tile_expert, dest = align_to_experts(ids, num_experts=6, block_m=4)
    flat = ids.flatten()
    assert sorted(slot_of[slot_of >= 0].tolist()) == list(range(flat.numel()))
    assert torch.equal(slot_of[dest], torch.arange(flat.numel(), device=DEV))
    for tile, e in enumerate(tile_expert.tolist()):
        members = slot_of[tile * 4 : (tile + 1) * 4]
        members = members[members >= 0]
        if e < 0:
            assert members.numel() == 0
        else:
            assert (flat[members] == e).all()
    assert tile_expert.tolist()[:4] == [0, 1, 2, 3]  # one 4-slot tile each (expert 3 fills its own)
    assert (tile_expert >= 0).sum() == 4  # experts 4 and 5: chosen by nobody, no tile


@pytest.mark.parametrize("family, overrides, kernel_module, kernel_fn, min_calls", [
    # Qwen3-MoE: the grouped-experts kernel, two MoE layers every step.
    ("qwen3_moe", {}, "moe_triton", "fused_experts", 2 * 5),
    # DeepSeek-V3: the latent decode kernel (its dims must be >= 16), three layers every decode step.
    ("deepseek_v3", {"qk_rope_head_dim": 16}, "mla_triton", "mla_decode", 3 * 3),
])
@ON_CPU_ONLY
def test_engine_on_triton_kernels_equals_transformers(family, overrides, kernel_module, kernel_fn, min_calls, tmp_path,
                                                      monkeypatch):
    """A model through the whole engine with every Triton kernel in its seam (interpreted on CPU)
    gives transformers' greedy tokens, and the kernel under test ran every step."""
    import importlib

    from engine_helpers import drain, make_engine
    from hf_models import make_hf_model

    from common.sampling_params import SamplingParams
    from engine.model.kernels import kernels

    hf = make_hf_model(family, tmp_path / "m", **overrides)
    monkeypatch.setenv("SPLITFIRE_KERNELS", "triton")
    kernels.cache_clear()
    try:
        module = importlib.import_module(f"engine.model.kernels.{kernel_module}")
        calls = []
        kernel = getattr(module, kernel_fn)
        monkeypatch.setattr(module, kernel_fn, lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
        engine = make_engine(hf.path, max_num_batched_tokens=32, max_num_seqs=4)
        ps = [list(range(3, 40)), [5, 6, 7]]
        for i, p in enumerate(ps):
            engine.add_request(f"m{i}", p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        out = drain(engine)
        for i, p in enumerate(ps):
            assert out[f"m{i}"].token_ids == hf.greedy(p, 4)
        assert len(calls) >= min_calls
    finally:
        kernels.cache_clear()


# method None: the kernel's own choice for the rows; split_k None: the device's choice (1 on CPU)
@pytest.mark.parametrize("method,split_k", [(None, None), ("gemv", None), ("gemv", 4), ("dot", None), ("dot", 4),
                                            ("dequant", None), ("per_weight", None), ("per_weight", 2)])
@pytest.mark.parametrize("kind,group", [("int8", 32), ("int8", 16), ("int8", 56), ("int4", 32), ("int4", 64),
                                        ("fp8", 64), ("fp8", 56)])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_weight_only_gemm_matches_dequantize_then_matmul(kind, group, rows, method, split_k):
    """Every method (one row per program, tensor-core tiles, dequantize then GEMM, per-weight reads)
    equals dequantize-then-matmul; group 56 (not a power of two) is per-weight reads only."""
    from engine.model import quant
    from engine.model.kernels import quant_triton

    if not quant_triton.packed_group(group) and method not in (None, "per_weight"):
        pytest.skip("packed reads take power-of-two groups only")

    torch.manual_seed(rows + group)
    n, k = 80, 448  # neither a multiple of the tiles; K split 4 ways leaves a share with no tile
    qw = quant.quantize(torch.randn(n, k), kind, group).to(DEV)
    x = torch.randn(rows, k, device=DEV, dtype=DTYPE)
    bias = torch.randn(n, device=DEV, dtype=DTYPE)
    w = qw.dequantize_torch().float()
    exact = x.float() @ w.T + bias.float()
    out = torch.empty(rows, n + 8, device=DEV, dtype=DTYPE)[:, 4 : 4 + n]  # a row-strided output view
    quant_triton.wo_gemm(x, qw.kind, qw.q, qw.scales, qw.mins, qw.group_size, bias, out, split_k=split_k,
                         method=method)
    if CUDA:  # against what the torch path computes in bfloat16 (weights dequantized to bfloat16)
        within_bf16(out, torch.nn.functional.linear(x, w.to(DTYPE), bias), exact)
    else:  # products summed in another order than the reference's matmul: float32 rounding
        torch.testing.assert_close(out, exact.to(DTYPE), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("heads", [4, 20])  # one head tile, and two with padding
def test_mla_decode_kernel_matches_the_torch_absorbed_path(heads, splits):
    """The latent-attention decode kernel reads pages in place through the block table; it equals
    MLAttention's torch path (which gathers them) over ragged contexts."""
    from engine.model.attention import DecodeBatch
    from engine.model.kernels import mla_triton
    from engine.model.mla import MLAttention
    from engine.model.model_config import ModelConfig

    rank, rope, bs = (512, 64, 16) if CUDA else (32, 16, 16)
    cfg = ModelConfig.from_dict({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
                                 "num_attention_heads": heads, "kv_lora_rank": rank, "q_lora_rank": 32,
                                 "qk_nope_head_dim": 16, "qk_rope_head_dim": rope, "v_head_dim": 16,
                                 "num_hidden_layers": 1, "n_routed_experts": 4, "n_group": 1, "topk_group": 1,
                                 "num_experts_per_tok": 2})
    torch.manual_seed(heads)
    attn = MLAttention(cfg, cfg.layers[0]).to(device=DEV, dtype=DTYPE)
    attn.kv_b.copy_(torch.randn_like(attn.kv_b) * 0.2)
    blocks = 24
    cache = torch.randn(blocks, 1, bs, 1, rank + rope, device=DEV, dtype=DTYPE)
    ctx = torch.tensor([1, bs, bs + 1, 3 * bs - 1, 5 * bs + 3], device=DEV)
    width = 6
    tables = torch.stack([torch.randperm(blocks, device=DEV)[:width] for _ in ctx])
    mask = (torch.arange(width * bs, device=DEV)[None, :] < ctx[:, None]).view(len(ctx), 1, 1, -1)
    d = DecodeBatch(0, tables, mask, ctx)
    q_nope = torch.randn(len(ctx), heads, 16, device=DEV, dtype=DTYPE)
    q_rope = torch.randn(len(ctx), heads, rope, device=DEV, dtype=DTYPE)
    assert mla_triton.supported(rank, rope, bs)
    q_c = torch.bmm(q_nope.transpose(0, 1), attn.w_uk()).transpose(0, 1)
    o_c = mla_triton.mla_decode(q_c, q_rope, cache, tables, ctx, attn.scale, splits=splits)
    ours = torch.bmm(o_c.transpose(0, 1), attn.w_uv().transpose(1, 2)).transpose(0, 1)
    reference = attn.attend_decode_expanded(q_nope, q_rope, cache, d)
    exact = attn.float().attend_decode_expanded(q_nope.float(), q_rope.float(), cache.float(), d).float()
    within_bf16(ours, reference, exact)


@pytest.fixture
def gpu_code_path(monkeypatch):
    """The forward as it runs on CUDA: Triton kernels in every seam (interpreted here), no CPU C kernels."""
    from engine.model.kernels import cpu_ops, kernels

    monkeypatch.setenv("SPLITFIRE_KERNELS", "triton")
    monkeypatch.setenv("SPLITFIRE_CPU_KERNELS", "0")
    caches = (kernels, cpu_ops.library, cpu_ops.kv_supported)
    for c in caches:
        c.cache_clear()
    yield
    monkeypatch.undo()
    for c in caches:
        c.cache_clear()


@pytest.mark.parametrize("family,gguf", [("llama3", None), ("qwen3", "Q4_0"), ("gemma3", None), ("mixtral", None),
                                         ("qwen2_moe", None), ("deepseek_v3", None), ("qwen3_moe", "Q8_0"),
                                         ("qwen3_moe", "Q4_0")])
@ON_CPU_ONLY
def test_decode_forward_on_the_gpu_path_holds_no_host_sync(family, gguf, tmp_path, monkeypatch, gpu_code_path):
    """What a CUDA graph cannot record — a value read back to the host or an op sized by the data — is
    absent from every bucket's decode forward on the GPU code path: dense, sliding-window, quantized,
    mixture-of-experts (the grouped-GEMM's expert counts used to come from `bincount`, which reads the
    largest id back on CUDA, so every MoE model decoded eagerly) and latent attention."""
    from engine_helpers import make_engine
    from hf_models import make_hf_model

    from engine.batch.graph_runner import HostSyncProbe

    hf = make_hf_model(family, tmp_path / family)
    path = hf.path
    if gguf:
        from gguf_writer import write_gguf

        from engine.loading.model_store import resolve_model

        monkeypatch.setenv("SPLITFIRE_HOME", str(tmp_path / "home"))
        write_gguf(hf.path, tmp_path / "m.gguf", quantize=gguf, embedding_quantize="Q8_0")
        path = resolve_model(str(tmp_path / "m.gguf"))
    engine = make_engine(path, decode_graphs="on", max_num_seqs=4)
    graphs = engine.runner.graphs
    with torch.inference_mode():
        for b in graphs.buckets:
            assert graphs.host_syncs(b) == [], (family, b)
    # A whole step (prompt chunks and decodes together, then greedy sampling) reads back once: the
    # sampled tokens. More would stall the GPU every step while the host waits to launch the next one.
    from common.sampling_params import SamplingParams

    engine.add_request("a", list(range(3, 30)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()
    engine.add_request("b", list(range(5, 20)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for _ in range(3):
        probe = HostSyncProbe("cpu")
        with probe:
            engine.step()
        assert probe.seen == ["tolist"], (family, probe.seen)
    # The probe is not blind: the reference expert loop reads its counts back (it stays on CPU).
    probe = HostSyncProbe("cpu")
    with probe:
        torch.bincount(torch.tensor([1, 2])).tolist()
    assert probe.seen == ["bincount", "tolist"]


@ON_CPU_ONLY
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_padded_decode_buckets_equal_eager_on_the_gpu_path(family, tmp_path, gpu_code_path):
    """What a CUDA graph replays — the padded bucket forward — gives the eager tokens on the GPU code
    path too, for experts (padding rows route to experts of their own) and latent attention."""
    from engine_helpers import drain, make_engine
    from hf_models import make_hf_model

    from common.sampling_params import SamplingParams

    hf = make_hf_model(family, tmp_path / family)
    prompts = [[(13 * i + 7 * j) % 300 + 3 for j in range(5 + 9 * i)] for i in range(3)]

    def run(mode: str) -> dict[str, list[int]]:
        engine = make_engine(hf.path, decode_graphs=mode, max_num_seqs=4)
        for i, p in enumerate(prompts):  # staggered lengths: the batch shrinks across buckets 4 -> 2 -> 1
            engine.add_request(str(i), p, SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True))
        out = {k: v.token_ids for k, v in drain(engine).items()}
        assert (engine.runner.graphs is not None and engine.runner.graphs.replays > 0) == (mode == "on")
        return out

    assert run("on") == run("off")


@ON_CPU_ONLY
def test_quantized_moe_gguf_on_the_gpu_path_equals_the_cpu_path(tmp_path, monkeypatch):
    """A 4-bit mixture-of-experts GGUF through the whole engine on the GPU code path (grouped kernel over
    stacked quantized experts, interpreted) gives the CPU path's greedy tokens, which other tests hold
    to transformers on the same dequantized weights."""
    from engine_helpers import drain, make_engine
    from gguf_writer import write_gguf
    from hf_models import make_hf_model

    from common.sampling_params import SamplingParams
    from engine.loading.model_store import resolve_model
    from engine.model.kernels import cpu_ops, kernels, moe_triton

    monkeypatch.setenv("SPLITFIRE_HOME", str(tmp_path / "home"))
    hf = make_hf_model("qwen3_moe", tmp_path / "hf")
    write_gguf(hf.path, tmp_path / "m.gguf", quantize="Q4_0", embedding_quantize="Q8_0")
    path = resolve_model(str(tmp_path / "m.gguf"))
    prompts = [list(range(3, 40)), [5, 6, 7]]

    def greedy() -> tuple[dict[str, list[int]], object]:
        engine = make_engine(path, max_num_batched_tokens=32, max_num_seqs=4, cpu_activations="float")
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        return {k: v.token_ids for k, v in drain(engine).items()}, engine

    want, cpu_engine = greedy()
    assert cpu_engine.model.layers[0].mlp.experts.stacked is None
    calls = []
    kernel = moe_triton.fused_experts
    monkeypatch.setattr(moe_triton, "fused_experts", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    caches = (kernels, cpu_ops.library, cpu_ops.kv_supported)
    with monkeypatch.context() as m:
        m.setenv("SPLITFIRE_KERNELS", "triton")
        m.setenv("SPLITFIRE_CPU_KERNELS", "0")
        for c in caches:
            c.cache_clear()
        try:
            got, engine = greedy()
        finally:
            for c in caches:
                c.cache_clear()
    experts = engine.model.layers[0].mlp.experts
    assert experts.stacked is not None and experts.stacked[0].kind == "int4"
    assert experts.quantized[0][0].q.untyped_storage().data_ptr() == experts.stacked[0].q.untyped_storage().data_ptr()
    assert got == want and len(calls) >= 2 * 5


@ON_CPU_ONLY
@pytest.mark.parametrize("family", ["llama3", "mixtral", "deepseek_v3", "gemma3"])
def test_16_bit_engine_on_the_gpu_path_equals_the_torch_path(family, tmp_path, monkeypatch):
    """The kernels' 16-bit storage (half loads, `.to(element_ty)` stores, float32 accumulation) through
    the whole engine with decode graphs: Triton (interpreted) and torch paths give the same greedy tokens
    for dense, experts, latent attention and sliding windows. float16 stands in for CUDA's bfloat16
    here: the interpreter multiplies bfloat16 `tl.dot` operands as raw bits (triton-lang/triton#11584)."""
    from engine_helpers import drain, make_engine
    from hf_models import make_hf_model

    from common.sampling_params import SamplingParams
    from engine.model.kernels import cpu_ops, kernels

    hf = make_hf_model(family, tmp_path / family)
    monkeypatch.setenv("SPLITFIRE_CPU_KERNELS", "0")
    caches = (kernels, cpu_ops.library, cpu_ops.kv_supported)
    outs = {}
    try:
        for backend in ("torch", "triton"):
            monkeypatch.setenv("SPLITFIRE_KERNELS", backend)
            for c in caches:
                c.cache_clear()
            engine = make_engine(hf.path, dtype="float16", max_num_seqs=4, max_num_batched_tokens=32,
                                 decode_graphs="on")
            assert engine.model.embed.weight.dtype == torch.float16
            for i, p in enumerate([list(range(3, 40)), [5, 6, 7]]):
                engine.add_request(str(i), p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
            outs[backend] = {k: v.token_ids for k, v in drain(engine).items()}
            assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    finally:
        monkeypatch.undo()
        for c in caches:
            c.cache_clear()
    assert outs["triton"] == outs["torch"]


@pytest.mark.parametrize("rank,out_features", [(8, 40), (48, 96)])
def test_lora_sgmv_matches_the_segment_reference(rank, out_features):
    """Runs of rows of several adapters (one longer than a tile, one adapter twice), base rows between
    them, a rank that is not a power of two: the kernels' deltas equal `lora.segment_deltas`'."""
    from engine.model.kernels import lora_triton
    from engine.model.lora import LoRARows, segment_deltas

    g = torch.Generator().manual_seed(rank)
    slots, in_features = 4, 72
    row_slots = [-1, 2, 2, 2] + [0] * 21 + [-1, -1, 3, 1, 1, 2, -1]
    x = torch.randn(len(row_slots), in_features, generator=g).to(DEV, DTYPE)
    a = torch.randn(slots, rank, in_features, generator=g).to(DEV, DTYPE)
    b = torch.randn(slots, out_features, rank, generator=g).to(DEV, DTYPE)
    base = torch.randn(len(row_slots), out_features, generator=g).to(DEV, DTYPE)
    segments = LoRARows.build(row_slots, DEV).segments
    assert len(segments) == 5 and any(end - start > lora_triton.BLOCK_M for start, end, _ in segments)
    ref, ours = base.clone(), base.clone()
    segment_deltas(x, ref, a, b, segments)
    lora_triton.sgmv(x, ours, a, b, segments)
    torch.testing.assert_close(ours, ref, **(dict(atol=5e-2, rtol=2e-2) if CUDA else dict(atol=1e-4, rtol=1e-4)))
    assert torch.equal(ours[0], base[0]) and torch.equal(ours[-1], base[-1])  # base rows untouched


@ON_CPU_ONLY
@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
def test_adapters_on_the_triton_path_equal_peft(family, tmp_path_factory, monkeypatch):
    """The engine with every kernel on the Triton path (interpreted), LoRA deltas by the SGMV kernels: two
    adapters and the base in one batch equal peft's greedy tokens. DeepSeek-V3: kv_b adapters too, around
    the latent-attention decode kernel (`kernels/mla_triton.py`)."""
    pytest.importorskip("peft")
    from engine_helpers import make_engine
    from hf_models import make_hf_model
    from test_lora import adapter, batch_equals_peft

    from engine.model.kernels import kernels, lora_triton, mla_triton

    # (DeepSeek-V3 with a 16-dim RoPE key: the latent decode kernel's dimensions are powers of two >= 16)
    base = make_hf_model(family, tmp_path_factory.mktemp("lora-base") / "model",
                         **({} if family == "llama3" else {"qk_rope_head_dim": 16}))
    targets = {} if family == "llama3" else {"targets": ("q_a_proj", "kv_b_proj", "o_proj")}
    a1, pm1 = adapter(base, tmp_path_factory, "one", seed=1, **targets)
    a2, pm2 = adapter(base, tmp_path_factory, "two", seed=2, r=4, rslora=True, **targets)
    calls: list[int] = []
    kernel = lora_triton.sgmv
    monkeypatch.setattr(lora_triton, "sgmv", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    latent: list[int] = []
    mla = mla_triton.mla_decode
    monkeypatch.setattr(mla_triton, "mla_decode", lambda *a, **kw: latent.append(1) or mla(*a, **kw))
    monkeypatch.setenv("SPLITFIRE_KERNELS", "triton")
    kernels.cache_clear()
    try:
        eng = make_engine(base.path, lora_modules={"one": str(a1), "two": str(a2)}, max_num_batched_tokens=32, max_num_seqs=8,
                          threads=1, quantization=None)
        which = {"b0": ("", base.model), "o0": ("one", pm1), "t0": ("two", pm2), "o1": ("one", pm1)}
        batch_equals_peft(eng, base, which, [5, 30, 12, 21], 5)
        assert calls  # the deltas went through the kernels
        assert bool(latent) == (family == "deepseek_v3")  # (and the latent decode through its kernel)
    finally:
        kernels.cache_clear()


@pytest.mark.parametrize("group", [16, 128])
def test_fp8_activation_quantization_rounds_as_torch_casts(group):
    """Per token per group: scale = amax / 448, codes = e4m3(x / scale) rounded to nearest even — bit for
    bit torch's cast (the interpreter's own cast truncates; the kernel rounds on the e4m3 grid first)."""
    from engine.model.kernels import fp8_triton

    g = torch.Generator().manual_seed(group)
    x = (torch.randn(37, 4 * group, generator=g) * torch.exp(torch.randn(37, 1, generator=g) * 2)).to(DEV)
    x[3] = 0.0  # an all-zero row: the scale floor, codes 0
    q, s = fp8_triton.quantize_activations(x, group)
    xf = x.float().view(37, 4, group)
    want_s = (xf.abs().amax(-1) / 448.0).clamp(min=1e-12)
    want_q = (xf / want_s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).view(37, -1)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("split", [None, 3])  # None: the launch's own choice (1 on CPU); 3: K split, a part short
@pytest.mark.parametrize("rows", [1, 19, 70])
@pytest.mark.parametrize("group", [32, 128])
def test_w8a8_gemm_equals_its_reference(rows, group, split):
    """FP8 x FP8 with both scales per group (a tile of rows and weight rows, partial at the edges) equals
    the plain torch computation of the same codes and scales, and is within FP8's rounding of the exact
    product (the reason it needs the per-group activation scales at all)."""
    from engine.model import quant
    from engine.model.kernels import fp8_triton

    g = torch.Generator().manual_seed(rows + group)
    n, k = 90, 4 * group
    qw = quant.quantize(torch.randn(n, k, generator=g) * 0.05, "fp8", group).to(DEV)
    x = torch.randn(rows, k, generator=g).to(DEV)
    bias = torch.randn(n, generator=g).to(DEV)
    out = torch.empty(rows, n + 6, device=DEV)[:, 3 : 3 + n]
    blocks = {} if CUDA else dict(block_m=16, block_n=32, block_k=min(group, 64))
    fp8_triton.w8a8_gemm(x, qw.q, qw.scales, group, bias, out, split_k=split, **blocks)
    ref = fp8_triton.w8a8_reference(x, qw.q, qw.scales, group, bias)
    # Interpreted: float32 sums, another order. Compiled for Hopper's tensor cores: FP8 products are
    # accumulated inside each group with about 14 significant bits (DeepSeek-V3's report, 3.3.2; seen on an
    # H200: 3.4e-4 on outputs of ~1), which is why each group's sum is promoted to float32 at once.
    tol = dict(atol=2e-3 * ref.abs().max().item(), rtol=0) if CUDA else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.float(), ref, **tol)
    exact = x.float() @ qw.dequantize_torch().float().T + bias
    assert (out - exact).abs().max() < 0.05 * exact.abs().max()


@ON_CPU_ONLY
@pytest.mark.parametrize("method", ["weight-only", "w8a8"])
def test_fp8_checkpoint_on_the_gpu_path(method, tmp_path, monkeypatch):
    """A block-FP8 checkpoint through the whole engine on the GPU code path (interpreted). Weight-only
    (every GPU): the CPU path's greedy tokens and logits — e4m3 widens exactly on both. w8a8 (GPUs with
    FP8 tensor cores; forced here for every step): the greedy tokens and teacher-forced logits (96
    positions) of the same engine with every FP8 matmul computed by `w8a8_reference` in torch, and
    logits within e4m3's activation rounding of the exact model's."""
    from engine_helpers import drain, make_engine
    from hf_models import make_hf_model, write_block_fp8

    from common.sampling_params import SamplingParams
    from engine.model.kernels import cpu_ops, fp8_triton, kernels
    from loadtest.quality import window_hidden

    hf = make_hf_model("llama3", tmp_path / "hf", hidden_size=128, intermediate_size=256, head_dim=32)
    write_block_fp8(hf.path, tmp_path / "fp8", block=32)
    prompts = [[(7 * j + 3 * i) % 390 + 3 for j in range(n)] for i, n in enumerate((40, 9))]
    forced = [(5 * j * j + 11 * j) % 390 + 3 for j in range(97)]

    def run(module_path: bool = False) -> tuple[dict[str, list[int]], torch.Tensor]:
        engine = make_engine(tmp_path / "fp8", max_num_batched_tokens=128, max_num_seqs=4, cpu_activations="float",
                             kv_cache_gb=0.02)
        if module_path:  # (every matmul through quant.linear: not the fused C decode loop)
            engine.model.cpu_layers_off = "every matmul through quant.linear"
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        tokens = {k: v.token_ids for k, v in drain(engine).items()}
        with torch.inference_mode():
            logits = engine.model.logits(window_hidden(engine, forced)[:-1])
        return tokens, logits

    want, want_logits = run()
    if method == "w8a8":  # the w8a8 numerics in plain torch on the CPU path: every FP8 matmul by the reference
        from engine_helpers import simulate_w8a8

        with monkeypatch.context() as m:
            simulate_w8a8(m)
            sim, sim_logits = run(module_path=True)
    calls = []
    gemm = fp8_triton.w8a8_gemm
    monkeypatch.setattr(fp8_triton, "w8a8_gemm", lambda *a, **kw: calls.append(1) or gemm(*a, **kw))
    if method == "w8a8":
        monkeypatch.setattr(fp8_triton, "fp8_tensor_cores", lambda device: True)
        monkeypatch.setattr(fp8_triton, "W8A8_MIN_ROWS", 1)
    caches = (kernels, cpu_ops.library, cpu_ops.kv_supported)
    with monkeypatch.context() as m:
        m.setenv("SPLITFIRE_KERNELS", "triton")
        m.setenv("SPLITFIRE_CPU_KERNELS", "0")
        for c in caches:
            c.cache_clear()
        try:
            got, logits = run()
        finally:
            for c in caches:
                c.cache_clear()
    if method == "weight-only":
        assert got == want and not calls
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
        return
    assert calls
    # The kernels compute the w8a8 numerics exactly as the torch reference does (sums in another order):
    assert got == sim
    assert (logits.argmax(-1) == sim_logits.argmax(-1)).float().mean().item() >= 0.99
    assert (logits - sim_logits).abs().mean() < 1e-3 * sim_logits.std()
    # ... and those numerics stay near the exact model (e4m3 activations: 3 mantissa bits, ~3.6% rms per
    # element; this random model's attention is near one-hot, so its logits move more than a trained one's).
    err = (logits - want_logits).abs()
    agree = (logits.argmax(-1) == want_logits.argmax(-1)).float().mean().item()
    print(f"w8a8 vs exact: top-1 agreement {agree:.3f}, mean |logit error| {err.mean():.3f} "
          f"(logit std {want_logits.std():.3f})")
    assert err.mean() < 0.2 * want_logits.std()


E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("window,splits", [(0, 1), (0, 4), (5, 1)])
def test_attention_over_an_e4m3_cache_matches_torch(window, splits):
    """Decode and prefill attention reading an e4m3 cache as bytes (widened exactly in registers) equal the
    torch path reading the same cache (widened by torch), for split-KV and a sliding window."""
    from engine.model.attention import PrefillSegment

    torch.manual_seed(window + splits)
    block_size, kv_heads, group = 16, 2, 4
    ctx = torch.tensor([1, block_size + 1, 5 * block_size + 3, 12 * block_size + 5], device=DEV)
    b, nb = len(ctx), 13
    cache = _cache(b * nb, block_size, kv_heads, HEAD_DIM).to(E4M3)
    perm = torch.randperm(b * nb, device=DEV).view(b, nb)
    q = torch.randn(b, kv_heads * group, HEAD_DIM, device=DEV, dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    ours = triton_ops.paged_decode_attention(q, cache, perm, ctx, scale, window=window, splits=splits)
    mask = (torch.arange(nb * block_size, device=DEV)[None, :] < ctx[:, None]).view(b, 1, 1, -1)
    meta = AttentionMetadata(block_size, torch.empty(0), torch.empty(0), [], [DecodeBatch(0, perm, mask)])
    torch.testing.assert_close(ours, paged_attention(q, cache, meta, scale, window or None), **TOL)
    # prefill: a fresh prompt and a chunk after cached blocks
    specs, tables, segs, metas, row = [(21, 21), (16, 3 * 16 + 5)], [], [], [], 0
    for new, c in specs:
        blocks = perm[len(tables), : -(-c // block_size)].tolist()
        tables.append(blocks + [0] * (nb - len(blocks)))
        segs.append((row, new, c))
        metas.append(PrefillSegment(row, new, c, torch.tensor(blocks, device=DEV)))
        row += new
    qp = torch.randn(row, kv_heads * group, HEAD_DIM, device=DEV, dtype=DTYPE)
    ours = triton_ops.paged_prefill_attention(qp, cache, torch.tensor(tables, device=DEV),
                                              torch.tensor(segs, device=DEV), scale, torch.empty_like(qp),
                                              max_q_len=21, block_m=16, window=window)
    ref = paged_attention(qp, cache, AttentionMetadata(block_size, torch.empty(0), torch.empty(0), metas, []), scale,
                          window or None)
    torch.testing.assert_close(ours, ref, **TOL)


def test_store_kv_into_an_e4m3_cache_rounds_as_torch_casts():
    torch.manual_seed(2)
    block_size, kv_heads = 16, 4
    cache_a = torch.zeros(8, 2, block_size, kv_heads, HEAD_DIM, device=DEV, dtype=E4M3)
    cache_b = cache_a.clone()
    pairs = torch.randperm(8 * block_size, device=DEV)[:37]
    blocks, slots = pairs // block_size, pairs % block_size
    k = torch.randn(37, kv_heads, HEAD_DIM, device=DEV, dtype=DTYPE) * 200  # past 448 too: saturates
    v = torch.randn(37, kv_heads, HEAD_DIM, device=DEV, dtype=DTYPE) * 1e-2  # subnormals
    triton_ops.store_kv(cache_a, k, v, blocks, slots)
    rows = blocks * 2 * block_size + slots
    write_kv(cache_b, k, v, AttentionMetadata(block_size, rows, rows + block_size, [], []))
    assert torch.equal(cache_a.view(torch.uint8), cache_b.view(torch.uint8))
    assert cache_a.float().abs().max() == 448


def test_mla_decode_kernel_over_an_e4m3_latent_cache_matches_the_torch_path():
    from engine.model.kernels import mla_triton
    from engine.model.mla import MLAttention
    from engine.model.model_config import ModelConfig

    heads, rank, rope, bs = 4, 32, 16, 16
    cfg = ModelConfig.from_dict({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
                                 "num_attention_heads": heads, "kv_lora_rank": rank, "q_lora_rank": 32,
                                 "qk_nope_head_dim": 16, "qk_rope_head_dim": rope, "v_head_dim": 16,
                                 "num_hidden_layers": 1, "n_routed_experts": 4, "n_group": 1, "topk_group": 1,
                                 "num_experts_per_tok": 2})
    torch.manual_seed(5)
    attn = MLAttention(cfg, cfg.layers[0]).to(device=DEV, dtype=DTYPE)
    attn.kv_b.copy_(torch.randn_like(attn.kv_b) * 0.2)
    cache = torch.randn(24, 1, bs, 1, rank + rope, device=DEV).to(E4M3)
    ctx = torch.tensor([1, bs + 1, 5 * bs + 3], device=DEV)
    tables = torch.stack([torch.randperm(24, device=DEV)[:6] for _ in ctx])
    mask = (torch.arange(6 * bs, device=DEV)[None, :] < ctx[:, None]).view(len(ctx), 1, 1, -1)
    q_nope = torch.randn(len(ctx), heads, 16, device=DEV, dtype=DTYPE)
    q_rope = torch.randn(len(ctx), heads, rope, device=DEV, dtype=DTYPE)
    q_c = torch.bmm(q_nope.transpose(0, 1), attn.w_uk()).transpose(0, 1)
    o_c = mla_triton.mla_decode(q_c, q_rope, cache, tables, ctx, attn.scale, splits=2)
    ours = torch.bmm(o_c.transpose(0, 1), attn.w_uv().transpose(1, 2)).transpose(0, 1)
    reference = attn.attend_decode_expanded(q_nope, q_rope, cache, DecodeBatch(0, tables, mask, ctx))
    torch.testing.assert_close(ours, reference, **(TOL if not CUDA else dict(atol=3e-2, rtol=3e-2)))


@ON_CPU_ONLY
@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
def test_an_e4m3_kv_cache_on_the_gpu_path_equals_the_cpu_path(family, tmp_path, gpu_code_path):
    """--kv-cache-dtype fp8 through the whole engine on the GPU code path (Triton store, decode, prefill and
    latent-attention kernels over the cache's bytes, interpreted) gives the CPU path's greedy tokens: both
    round K and V to nearest even on store and widen exactly on read."""
    from engine_helpers import drain, make_engine
    from hf_models import make_hf_model

    from common.sampling_params import SamplingParams
    from engine.model.kernels import cpu_ops, kernels

    hf = make_hf_model(family, tmp_path / family, **({"qk_rope_head_dim": 16} if family == "deepseek_v3" else {}))
    prompts = [list(range(3, 40)), [5, 6, 7]]

    def run() -> dict[str, list[int]]:
        engine = make_engine(hf.path, kv_cache_dtype="fp8", max_num_seqs=4, max_num_batched_tokens=32)
        assert engine.kv.buffer.dtype == E4M3
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        return {k: v.token_ids for k, v in drain(engine).items()}

    gpu = run()
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SPLITFIRE_KERNELS", "torch")
        m.delenv("SPLITFIRE_CPU_KERNELS")
        for c in (kernels, cpu_ops.library, cpu_ops.kv_supported):
            c.cache_clear()
        cpu = run()
    assert gpu == cpu


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split,m,n", [(1, 1, 70), (4, 3, 1500), (8, 1, 2048)])
def test_the_split_k_reduction_equals_its_reference(split, m, n, bias):
    """One launch summing the splits' float32 partials, adding the bias and storing the output's dtype into
    a row-strided view: what part.sum(0) + bias, out.copy_ computed in three."""
    from engine.model.kernels import split_k

    g = torch.Generator().manual_seed(split * n + m)
    part = torch.randn(split, m, n, generator=g).to(DEV)
    b = torch.randn(n, generator=g).to(DEV, DTYPE) if bias else None
    outs = [torch.full((m, n + 5), 7.0, device=DEV, dtype=DTYPE) for _ in range(2)]
    split_k.reduce_partials(part, b, outs[0][:, 2:2 + n])
    split_k.reduce_reference(part, b, outs[1][:, 2:2 + n])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5 if not CUDA else 8e-3)
    assert (outs[0][:, :2] == 7.0).all() and (outs[0][:, 2 + n:] == 7.0).all()


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_norm_layer_equals_its_plain_ops(monkeypatch, gemma, dtype):
    """`layers.RMSNorm` on the Triton kernel (the residual add and the norm in one launch) against its own torch ops
    (`plain`, `plain_add_forward`), both orders: Llama's (cast, then scaled in the model dtype) and Gemma's (scaled by
    1 + w in float32, then cast). The residual stream is updated in place to the same rounded sum; the norms agree
    to within four units in the last place of the dtype (the row's sum of squares is reduced in another order, and
    its reciprocal square root is not torch's), most of them bit for bit."""
    from engine.model import layers

    torch.manual_seed(5)
    rows, dim = 9, 96
    norm = layers.RMSNorm(dim, 1e-6, gemma=gemma).to(DEV)
    norm.load(torch.randn(dim) * 0.1 + (0.0 if gemma else 1.0), "w")
    if not gemma:
        norm.weight.data = norm.weight.data.to(dtype)
    monkeypatch.setattr(layers, "kernels", lambda name, device_type: triton_ops)  # (CUDA's choice, on any device)
    monkeypatch.setattr(norm, "_fused", lambda x: False)  # (float32 on the CPU: the C kernels' turn otherwise)
    x = (torch.randn(rows, dim, device=DEV) * 3).to(dtype)
    h = torch.randn(rows, dim, device=DEV).to(dtype)
    ulp = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(norm(x), norm.plain(x), atol=0, rtol=ulp)
    res_ours, res_plain = x.clone(), x.clone()
    out_ours, res_ours = norm.add_forward(h, res_ours)
    out_plain, res_plain = norm.plain_add_forward(h, res_plain)
    # (the interpreter narrows float32 to bfloat16 by truncation where a GPU rounds to nearest: one unit apart there)
    truncates = dtype == torch.bfloat16 and not CUDA
    torch.testing.assert_close(res_ours, res_plain, atol=0, rtol=torch.finfo(dtype).eps if truncates else 0)
    torch.testing.assert_close(out_ours, out_plain, atol=0, rtol=ulp)
    if not truncates:
        assert (out_ours == out_plain).float().mean() > 0.75  # (most of them bit for bit)
    # the layer takes the kernel only for rows it can launch on: a 3-D input goes to torch's ops
    assert norm._triton(x.view(3, 3, dim)) is None and norm._triton(x) is triton_ops
    monkeypatch.setattr(layers, "norm_rope_kernels", lambda: False)
    assert norm._triton(x) is None
