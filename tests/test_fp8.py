"""FP8 weights kept FP8: block-FP8 checkpoints (DeepSeek-V3, Kimi-K2, Qwen3-*-FP8) and `--quantization fp8`
hold e4m3 codes in memory and compute exactly what their codes mean; the kernels (C on CPU, Triton
interpreted here and compiled on a GPU) are held to torch's own reading of e4m3."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import drain, make_engine
from hf_models import make_hf_model, write_block_fp8, write_dequantized

from common.errors import ModelLoadError
from common.sampling_params import SamplingParams
from engine.model import quant
from engine.model.kernels import cpu_ops

needs_kernel = pytest.mark.skipif(cpu_ops.library() is None, reason="no C compiler: the torch path runs instead")
GREEDY = dict(temperature=0.0, ignore_eos=True)
# Shapes whose every matmul reads whole 128-column blocks, as the published models' do, with the
# embeddings a small share of the bytes (as in DeepSeek-V3, where they are 0.3%).
QWEN3 = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
DEEPSEEK_V3 = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
                   qk_rope_head_dim=32, v_head_dim=64, moe_intermediate_size=256, n_routed_experts=16)


def prompts() -> list[list[int]]:
    return [[(11 * j + 37 * i) % 390 + 3 for j in range(n)] for i, n in enumerate((6, 45, 80))]


def greedy_tokens(engine, n: int = 8, logprobs: int = 0) -> dict[str, list[int]]:
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, logprobs=logprobs or None, **GREEDY))
    return {k: v.token_ids for k, v in drain(engine).items()}


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight the model holds, however it holds it: parameters, oneDNN-packed copies,
    quantized codes and scales (each storage once)."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if t is not None and t.numel():
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())

    for p in model.parameters():
        add(p)
    for m in model.modules():
        packed = getattr(m, "packed", None)
        for t in packed if isinstance(packed, tuple) else [packed]:
            for x in t if isinstance(t, list) else [t]:
                add(x)
        qs = getattr(m, "quantized", None)
        for group in (qs if isinstance(qs, tuple) else [qs]) if qs is not None else []:
            for w in group:
                add(w.q), add(w.scales), add(w.mins)
    add(getattr(model, "embed_quantized", None) and model.embed_quantized.q)
    return sum(seen.values())


@needs_kernel
def test_the_c_table_and_both_builds_widen_e4m3_as_torch_does(tmp_path):
    """Every e4m3 code (the NaN pair aside) widens to torch's value: the portable table, the AVX2
    float16 placement, and the plain build without AVX2 — dequantized bit for bit, and multiplied."""
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).float()
    table = cpu_ops.f8_table()
    assert torch.equal(table.isnan(), ref.isnan()) and torch.equal(table[~ref.isnan()], ref[~ref.isnan()])
    finite = codes[(codes & 0x7F) != 0x7F]
    q = finite[torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(0))].repeat(8)[:1920]
    qw = quant.QuantizedWeight("fp8", q.view(15, 128).view(torch.float8_e4m3fn).contiguous(),
                               torch.rand(15, 2) + 0.5, None, 64)
    assert torch.equal(qw.dequantize(), qw.dequantize_torch())
    base = cpu_ops.build(cpu_ops.BASELINE, tmp_path)
    assert base.sf_has_avx2() == 0
    torch.testing.assert_close(cpu_ops.f8_table(base), table, rtol=0, atol=0, equal_nan=True)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    w = qw.dequantize_torch()
    exact = x.double() @ w.double().T
    bound = 1e-6 * (x.double().abs() @ w.double().abs().T)  # float32 sums of 128 products, any order
    for lib in (cpu_ops.library(), base):
        out = torch.empty(3, 15)
        lib.sf_gemm_f8(x.data_ptr(), 128, 3, 128, qw.q.data_ptr(), qw.scales.data_ptr(), 15, 64, None,
                       out.data_ptr(), 15, 2)
        assert ((out.double() - exact).abs() <= bound).all()
        deq = torch.empty(15, 128)
        lib.sf_dequant_f8(qw.q.data_ptr(), qw.scales.data_ptr(), 15, 128, 64, None, 15, deq.data_ptr(), 2)
        assert torch.equal(deq, qw.dequantize_torch())


def test_block_scales_become_per_row_groups_exactly():
    """A checkpoint's 128 x 128 block scales, partial blocks included (576 = 4.5 blocks), read into the
    per-row layout: every weight is its code times its block's scale."""
    g = torch.Generator().manual_seed(3)
    n, k = 200, 576
    codes = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 5, generator=g) + 0.1
    qw = quant.from_block_fp8(codes, scale_inv, (128, 128))
    assert qw.kind == "fp8" and qw.group_size == 64 and qw.q.dtype == torch.float8_e4m3fn
    full = scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert torch.equal(qw.dequantize_torch(), codes.float() * full)
    with pytest.raises(ModelLoadError, match=r"needs \(2, 5\)"):
        quant.from_block_fp8(codes, scale_inv[:, :4], (128, 128))


def test_a_tensor_parallel_split_inside_a_scale_block_is_refused_by_name():
    qw = quant.quantize(torch.randn(64, 256), "fp8", 128)
    assert qw.narrow(range(0, 32), range(0, 128)).shape == (32, 128)  # rows anywhere, columns in whole blocks
    with pytest.raises(ModelLoadError, match=r"columns 0\.\.64 do not fall on its 128-column groups"):
        qw.narrow(None, range(0, 64))


@pytest.mark.parametrize("family,overrides", [("qwen3", QWEN3), ("deepseek_v3", DEEPSEEK_V3)])
def test_a_block_fp8_checkpoint_stays_fp8_and_computes_its_dequantized_model(family, overrides, tmp_path):
    """The published layout (e4m3, one scale per 128 x 128 block): held as e4m3 codes (resident weight
    bytes at most 0.55x the same model in bfloat16, measured in the process), and greedy tokens equal to
    an engine given the dequantized float32 weights — widening e4m3 is exact, only the sums' order differs."""
    hf = make_hf_model(family, tmp_path / "hf", **overrides)
    write_block_fp8(hf.path, tmp_path / "fp8", block=128)
    write_dequantized(tmp_path / "fp8", tmp_path / "deq")
    fp8 = make_engine(tmp_path / "fp8", kv_cache_gb=0.02)
    layer = fp8.model.layers[-1]
    linears = [layer.attn.o] + ([layer.mlp.down] if hasattr(layer.mlp, "down") else [])
    assert all(lin.quantized is not None and lin.quantized[0].kind == "fp8" for lin in linears)
    if family == "deepseek_v3":
        experts = layer.mlp.experts
        assert experts.quantized is not None and experts.quantized[0][0].kind == "fp8"
    deq = make_engine(tmp_path / "deq", kv_cache_gb=0.02)
    assert greedy_tokens(fp8) == greedy_tokens(deq)
    fp8_bf16 = make_engine(tmp_path / "fp8", dtype="bfloat16", kv_cache_gb=0.02)
    plain_bf16 = make_engine(tmp_path / "deq", dtype="bfloat16", kv_cache_gb=0.02)
    ratio = resident_weight_bytes(fp8_bf16.model) / resident_weight_bytes(plain_bf16.model)
    print(f"{family}: resident weight bytes {ratio:.3f}x bfloat16")
    assert ratio <= 0.55


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe"])
def test_quantization_fp8_computes_its_dequantized_model(family, tmp_path):
    """`--quantization fp8` on a float checkpoint: every matmul weight e4m3 with a scale per row per
    group (experts too; routers, embeddings and the LM head stay float), greedy tokens equal to an
    engine given those weights dequantized."""
    from safetensors.torch import load_file, save_file

    hf = make_hf_model(family, tmp_path / "hf", intermediate_size=128)
    d = tmp_path / "dequantized"
    import shutil

    shutil.copytree(hf.path, d)
    w = load_file(str(d / "model.safetensors"))
    for name, t in w.items():
        if (t.ndim == 2 and "embed_tokens" not in name and name != "lm_head.weight"
                and not name.endswith("mlp.gate.weight")):
            w[name] = quant.quantize(t, "fp8", quant.group_size_for(t.shape[1], "fp8")).dequantize_torch()
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    ours = make_engine(hf.path, quantization="fp8")
    assert ours.model.layers[0].attn.qkv.quantized[0].kind == "fp8"
    assert ours.model.lm_head.quantized is None
    assert greedy_tokens(ours) == greedy_tokens(make_engine(d))


def test_fp8_over_two_ranks_equals_one_rank(tmp_path):
    """A block-FP8 checkpoint split over two ranks (rows anywhere, columns in whole blocks) computes what
    it computes on one device."""
    hf = make_hf_model("qwen3", tmp_path / "hf", **QWEN3)
    write_block_fp8(hf.path, tmp_path / "fp8", block=128)
    one = make_engine(tmp_path / "fp8", threads=1)
    two = make_engine(tmp_path / "fp8", threads=1, tensor_parallel_size=2)
    try:
        assert two.model.layers[0].attn.o.quantized[0].kind == "fp8"
        assert greedy_tokens(one) == greedy_tokens(two)
    finally:
        two.close()


def test_a_split_inside_an_fp8_block_is_refused_naming_the_tensor(tmp_path):
    """o_proj's 256 columns over 4 ranks are 64 a rank: inside the 128-column scale blocks."""
    hf = make_hf_model("qwen3", tmp_path / "hf", **{**QWEN3, "num_key_value_heads": 4})
    write_block_fp8(hf.path, tmp_path / "fp8", block=128)
    with pytest.raises(ModelLoadError, match=r"o_proj\.weight.*128-column groups"):
        make_engine(tmp_path / "fp8", threads=1, tensor_parallel_size=4)



def test_splitfire_plan_counts_the_bytes_the_engine_holds(tmp_path):
    """`splitfire plan` sizes an FP8 checkpoint as the engine holds it: e4m3 matmuls with a float32 scale per
    row per 128 columns, the embedding and LM head in bfloat16 — within 3% of the engine's own resident bytes
    (norms and routers aside)."""
    from common import sizing

    hf = make_hf_model("qwen3", tmp_path / "hf", **QWEN3)
    write_block_fp8(hf.path, tmp_path / "fp8", block=128)
    engine = make_engine(tmp_path / "fp8", dtype="bfloat16")
    p = sizing.plan(sizing.read_model(str(tmp_path / "fp8")), sizing.DEVICES["h100-80gb"], sizing.Layout())
    assert p.weight_format == "fp8"
    held = resident_weight_bytes(engine.model)
    assert abs(p.weight_bytes - held) <= 0.03 * held, (p.weight_bytes, held)


def test_an_e4m3_kv_cache_split_over_two_ranks_equals_one_rank(tmp_path):
    """--kv-cache-dtype fp8 with the KV heads split over two tensor-parallel ranks: each rank stores and reads
    its own heads' e4m3 pages, the same tokens as one rank."""
    hf = make_hf_model("llama3", tmp_path / "hf")
    one = make_engine(hf.path, threads=1, kv_cache_dtype="fp8")
    two = make_engine(hf.path, threads=1, kv_cache_dtype="fp8", tensor_parallel_size=2)
    try:
        assert two.kv.buffer.dtype == torch.float8_e4m3fn
        assert greedy_tokens(one) == greedy_tokens(two)
    finally:
        two.close()
