"""Weight-only int8/int4 (and fp8's C kernels): the kernel equals dequantize-then-matmul, GGUF blocks are read exactly,
and quantized models serve (colocated, disaggregated, from a quantized GGUF)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from engine_helpers import drain, make_engine

from common.errors import ModelLoadError
from common.sampling_params import SamplingParams
from engine.loading import gguf_quants
from engine.model import quant
from engine.model.kernels import cpu_ops

needs_kernel = pytest.mark.skipif(cpu_ops.library() is None, reason="no C compiler: the torch path runs instead")


@needs_kernel
@pytest.mark.parametrize("kind,group", [("int8", 32), ("int8", 64), ("int8", 16), ("int4", 32), ("int4", 64),
                                        ("fp8", 64), ("fp8", 8)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 16, 67])
def test_kernel_equals_dequantize_then_matmul(kind, group, rows):
    g = torch.Generator().manual_seed(rows * 7 + group)
    n, k = 70, 192  # 70 output rows: two past the last full tile of 4, so the remainder path runs too
    qw = quant.quantize(torch.randn(n, k, generator=g), kind, group)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    ref = x @ qw.dequantize_torch().T + bias
    out = quant.linear(x, [qw], bias)
    assert out.shape == (rows, n)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("kind,group", [("int8", 32), ("int4", 32), ("fp8", 128)])
def test_results_do_not_depend_on_the_threads_or_their_schedule(kind, group):
    """Row tiles go to threads `schedule(guided, 1)` (a thread that loses its core leaves its tiles to the
    others): one thread, two, and more threads than cores — tiles, panels and dequantized rows — give the
    same bits."""
    g = torch.Generator().manual_seed(7)
    qw = quant.quantize(torch.randn(260, 256, generator=g), kind, group)
    xs = [torch.randn(rows, 256, generator=g) for rows in (1, 2, 5, 16, 130)]
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 5):
            torch.set_num_threads(threads)
            outs.append([quant.linear(x, [qw], None) for x in xs])
        for other in outs[1:]:
            for a, b in zip(outs[0], other, strict=True):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("kind,group", [("int8", 32), ("int8", 16), ("int4", 32), ("int4", 64), ("fp8", 64)])
def test_panel_gemm_equals_the_tiles_bit_for_bit(kind, group):
    """From PANEL_MIN_ROWS rows the AVX2 build dequantizes panels of 12 weight rows into a buffer and
    multiplies in 3x4 register blocks: the same floats in the same lane order as the tiles, so the
    same bits — across a panel remainder (76 weight rows = 6 x 12 + 4: a multiple of the tiles' 4,
    whose plain-C leftovers round differently), activation row blocks of 4 with 1-3 left over, and
    the 64-row activation blocks."""
    lib = cpu_ops.library()
    if not lib.sf_has_avx2():
        pytest.skip("the panel GEMM is AVX2-only")
    g = torch.Generator().manual_seed(group)
    qw = quant.quantize(torch.randn(76, 192, generator=g), kind, group)
    bias = torch.randn(76, generator=g)
    try:
        for rows in (2, 3, 8, 9, 13, 64, 70, 130):
            x = torch.randn(rows, 192, generator=g)
            lib.sf_set_panel_min_rows(1 << 30)
            tiles = quant.linear(x, [qw], bias)
            lib.sf_set_panel_min_rows(1)
            panel = quant.linear(x, [qw], bias)
            assert torch.equal(panel, tiles), rows
            torch.testing.assert_close(panel, x @ qw.dequantize_torch().T + bias, rtol=1e-5, atol=1e-4)
    finally:
        lib.sf_set_panel_min_rows(cpu_ops.PANEL_MIN_ROWS)


def _q8x_reference(x: torch.Tensor, qw: quant.QuantizedWeight) -> torch.Tensor:
    """The integer-dot kernel's arithmetic in torch: x rounded to int8 per 32 (scale max|x| / 127),
    multiplied by the integer codes, each block scaled by weight scale x activation scale, plus the
    int4 min term (min x activation scale x sum of the block's int8 activations)."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    d = blocks.abs().amax(-1) / 127
    xq = torch.round(blocks / torch.where(d > 0, d, 1).unsqueeze(-1))
    codes = (quant.unpack_int4(qw.q) if qw.kind == "int4" else qw.q).float().view(-1, k // 32, 32)
    dots = torch.einsum("mbj,nbj->mnb", xq, codes)  # exact in float32: small integers
    per_block = lambda t: t.repeat_interleave(qw.group_size // 32, dim=1)  # noqa: E731
    out = (dots * per_block(qw.scales).unsqueeze(0) * d.unsqueeze(1)).sum(-1)
    if qw.kind == "int4":
        out += ((xq.sum(-1) * d).unsqueeze(1) * per_block(qw.mins).unsqueeze(0)).sum(-1)
    return out


@needs_kernel
@pytest.mark.parametrize("kind,group", [("int8", 32), ("int8", 64), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("rows", [1, 2])
def test_int8_activation_kernel_computes_its_reference(kind, group, rows):
    if not cpu_ops.library().sf_has_avx2():
        pytest.skip("the integer-dot kernel needs AVX2")
    g = torch.Generator().manual_seed(rows * 31 + group)
    qw = quant.quantize(torch.randn(68, 256, generator=g), kind, group)  # 68 rows: 17 full tiles of 4
    x = torch.randn(rows, 256, generator=g)
    out = quant.linear(x, [qw], None, int8_activations=True)
    torch.testing.assert_close(out, _q8x_reference(x, qw), rtol=1e-5, atol=1e-4)
    exact = x @ qw.dequantize_torch().T
    assert (out - exact).abs().max() < 0.02 * exact.abs().max()  # the activation rounding, and no more


@needs_kernel
def test_mixed_format_row_blocks_and_the_large_batch_path():
    """A fused q/k/v whose parts were stored in different formats runs as separate blocks; past
    KERNEL_MAX_ROWS the weight is dequantized once and multiplied in float."""
    g = torch.Generator().manual_seed(0)
    parts = [quant.quantize(torch.randn(32, 128, generator=g), "int4", 32),
             quant.quantize(torch.randn(16, 128, generator=g), "int8", 128)]
    assert quant.concat_rows(parts) is None
    w = torch.cat([p.dequantize_torch() for p in parts])
    for rows in (1, 5, 20, quant.kernel_max_rows() + 9):
        x = torch.randn(rows, 128, generator=g)
        torch.testing.assert_close(quant.linear(x, parts, None), x @ w.T, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_kernel_dequantize_equals_torch_reference_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    for kind, group in (("int8", 32), ("int4", 32), ("int4", 128), ("fp8", 128), ("fp8", 16)):
        qw = quant.quantize(torch.randn(40, 256, generator=g), kind, group)
        assert torch.equal(qw.dequantize(), qw.dequantize_torch())
        rows = torch.tensor([39, 0, 7, 7])
        assert torch.equal(qw.dequantize(rows), qw.dequantize_torch()[rows])


def test_quantization_error_is_what_the_format_allows():
    w = torch.randn(64, 256)
    for kind, bound in (("int8", 1 / 127), ("int4", 1 / 15)):
        qw = quant.quantize(w, kind, 32)
        err = (qw.dequantize_torch() - w).abs()
        span = w.view(64, 8, 32).abs().amax(-1, keepdim=True) * (1 if kind == "int8" else 2)
        assert (err.view(64, 8, 32) <= span * bound / 2 + 1e-6).all()
    with pytest.raises(ModelLoadError, match="columns"):
        quant.quantize(torch.randn(4, 48), "int4", 32)


def _random_k_blocks(type_name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """K-quant blocks with random codes and sub-scales and sane fp16 super-scales (the gguf
    package cannot quantize K types)."""
    import gguf

    size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, type_name)][1]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    halves = rng.uniform(0.001, 0.05, size=(n_blocks, 2)).astype(np.float16).view(np.uint8)
    if type_name == "Q4_K":
        b[:, 0:4] = halves.reshape(n_blocks, 4)  # d, dmin
    else:
        b[:, 208:210] = halves[:, :2]  # d
    return b


@pytest.mark.parametrize("type_name", gguf_quants.SUPPORTED)
def test_gguf_blocks_dequantize_bit_exactly_like_the_gguf_package(type_name):
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(3)
    rows, cols = 6, 512
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    if type_name.endswith("_K"):
        raw = _random_k_blocks(type_name, rows * cols // 256, rng).reshape(rows, -1)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    expected = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    parts = gguf_quants.convert(raw, type_name, rows, cols)
    assert parts is not None
    qw = quant.QuantizedWeight.from_parts(*(torch.from_numpy(np.ascontiguousarray(parts[key])) if key in parts
                                            else None for key in ("qweight", "scales", "mins")))
    assert qw.kind == ("int4" if type_name.startswith("Q4") else "int8")
    assert np.array_equal(qw.dequantize_torch().numpy(), expected)
    assert np.array_equal(qw.dequantize().numpy(), expected)


def test_unsupported_gguf_types_are_left_to_float_conversion():
    assert gguf_quants.convert(np.zeros((1, 24), np.uint8), "Q5_1", 1, 32) is None
    assert gguf_quants.convert(np.zeros((1, 34), np.uint8), "Q8_0", 1, 48) is None  # 48 columns: no whole blocks


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_engine_with_quantized_weights_computes_the_dequantized_model(tiny_model_dir, tmp_path, kind):
    """--quantization runs exactly the model its codes mean: greedy tokens equal a float32 engine
    given the dequantized weights. Agreement with the original float32 weights is reported."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "dequantized"
    shutil.copytree(tiny_model_dir, d)
    w = load_file(str(d / "model.safetensors"))
    tied = "lm_head.weight" not in w
    for name, t in w.items():
        head = name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight")
        if t.ndim == 2 and (head or "embed_tokens" not in name):  # matmul weights; the LM head always int8
            k = "int8" if head else kind
            w[name] = quant.quantize(t, k, quant.group_size_for(t.shape[1], k)).dequantize_torch()
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[(17 * i + 5 * j) % 390 + 3 for j in range(12 + 9 * i)] for i in range(8)]
    out = {}
    for label, model, q in (("float", tiny_model_dir, None), ("dequantized", d, None), (kind, tiny_model_dir, kind)):
        engine = make_engine(model, quantization=q, cpu_activations="float")
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        out[label] = {k: r.token_ids for k, r in drain(engine).items()}
    lin = engine.model.layers[0].attn.qkv
    assert lin.quantized is not None and lin.weight is None and lin.quantized[0].kind == kind
    assert out[kind] == out["dequantized"]
    same = sum(out[kind][k] == out["float"][k] for k in out[kind])
    print(f"{kind}: {same}/8 greedy continuations identical to the float32 weights'")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_experts_compute_the_dequantized_model(tmp_path, kind):
    """MoE experts are quantized too (they are most of the bytes): a Qwen3-MoE engine with
    --quantization equals a float32 engine given every matmul weight dequantized (routers stay float)."""
    from hf_models import make_hf_model
    from safetensors.torch import load_file, save_file

    hf = make_hf_model("qwen3_moe", tmp_path / "moe")
    d = tmp_path / "dequantized"
    import shutil

    shutil.copytree(hf.path, d)
    w = load_file(str(d / "model.safetensors"))
    for name, t in w.items():
        if t.ndim == 2 and "embed_tokens" not in name and not name.endswith("mlp.gate.weight"):
            k = "int8" if name == "lm_head.weight" else kind
            w[name] = quant.quantize(t, k, quant.group_size_for(t.shape[1], k)).dequantize_torch()
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[(17 * i + 5 * j) % 390 + 3 for j in range(12 + 30 * i)] for i in range(4)]  # decode and >48-row prefill
    out = {}
    for label, model, q in (("dequantized", d, None), (kind, hf.path, kind)):
        engine = make_engine(model, quantization=q, cpu_activations="float")
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        out[label] = {k: r.token_ids for k, r in drain(engine).items()}
    experts = next(layer.mlp.experts for layer in engine.model.layers if hasattr(layer.mlp, "experts"))
    assert experts.quantized is not None and experts.gate_up is None and experts.quantized[0][0].kind == kind
    assert out[kind] == out["dequantized"]


def test_quantized_gguf_serves_at_its_own_precision(tmp_path, monkeypatch):
    """A Q4_0 + Q8_0 GGUF converts with its matmul weights still quantized (no float32 copy on
    disk) and computes what the file means: the same greedy tokens as transformers running the
    same file dequantized to float32."""
    pytest.importorskip("gguf")
    import transformers
    from gguf_writer import write_gguf
    from hf_models import HFModel
    from test_model_loading import _hf

    from engine.loading.gguf_convert import convert_gguf
    from engine.loading.model_store import resolve_model

    monkeypatch.setenv("SPLITFIRE_HOME", str(tmp_path / "home"))
    hf = _hf("qwen3", tmp_path / "hf")
    path = tmp_path / "q4.gguf"
    write_gguf(hf.path, path, quantize="Q4_0", embedding_quantize="Q8_0")
    model_dir = resolve_model(str(path))
    from engine.loading.checkpoint import Checkpoint

    ckpt = Checkpoint(model_dir)
    assert ckpt.info("model.layers.0.self_attn.q_proj.weight.qweight").dtype == torch.uint8
    assert ckpt.info("model.embed_tokens.weight.qweight").dtype == torch.int8
    assert not ckpt.has("model.layers.0.mlp.down_proj.weight")
    floats = tmp_path / "f32"
    floats.mkdir()
    convert_gguf(path, floats, keep_quantized=False)
    theirs = HFModel("f32", floats, transformers.AutoModelForCausalLM.from_pretrained(floats, dtype=torch.float32).eval(), {})
    engine = make_engine(model_dir, cpu_activations="float")
    assert engine.model.layers[0].mlp.gate_up.quantized[0].kind == "int4"
    assert engine.model.embed_quantized is not None
    prompt = list(range(3, 50))
    engine.add_request("q", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert drain(engine)["q"].token_ids == theirs.greedy(prompt, 8)


def test_other_quantization_configs_are_refused(tiny_model_dir, tmp_path):
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="gptq"):
        make_engine(d)
    with pytest.raises(ValueError, match="--quantization"):
        make_engine(tiny_model_dir, quantization="int3")


async def test_disaggregated_int8_equals_colocated_int8(tiny_model_dir, tmp_path):
    """Prefill and decode workers both at --quantization int8: the transferred KV continues exactly
    as a colocated int8 worker computes it."""
    from grpc_client import generate, greedy
    from procs import address, start_worker

    args = ("--quantization", "int8")
    pre = start_worker("prefill", tiny_model_dir, tmp_path, *args)
    dec = start_worker("decode", tiny_model_dir, tmp_path, *args, "--local-prefill-max-tokens", "0")
    both = start_worker("both", tiny_model_dir, tmp_path, *args)
    try:
        prompts = [[(13 * i + 3 * j) % 390 + 3 for j in range(20 + 30 * i)] for i in range(3)]
        disagg = await asyncio.gather(*(generate(address(dec), p, greedy(8), prefill=address(pre)) for p in prompts))
        coloc = await asyncio.gather(*(generate(address(both), p, greedy(8)) for p in prompts))
        for d, c in zip(disagg, coloc, strict=True):
            assert d.prefill_mode == "remote"
            assert d.token_ids == c.token_ids and len(d.token_ids) == 8
    finally:
        for p in (pre, dec, both):
            assert p.stop() == 0, p.log()[-2000:]


def test_perplexity_equals_transformers_on_the_same_text(tiny_model_dir):
    """loadtest.quality.perplexity runs our model, KV cache and attention over fixed windows; the
    same windows through transformers give the same number."""
    import math

    import transformers

    from loadtest import quality

    engine = make_engine(tiny_model_dir, kv_cache_gb=0.05)
    text = "The quick brown fox jumps over the lazy dog. " * 30
    ppl, scored = quality.perplexity(engine, text, window=64)
    ids = engine.tokenizer.encode(text)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 64):
            chunk = torch.tensor([ids[start : start + 65]])
            if chunk.shape[1] < 2:
                break
            logits = hf(chunk).logits[0, :-1]
            nll += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    assert scored == count == len(ids) - 1
    assert ppl == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_the_plain_c_fallback_computes_the_same(tmp_path):
    """cpu_ops.c built for baseline x86-64 (no AVX2/FMA), as a CPU without them runs it: the float
    matmul tiles, dequantization and decode attention give what the AVX2 build and torch give, and
    the integer-dot kernel declines (returns 1) so callers keep the float path."""
    import ctypes

    if cpu_ops.library() is None:
        pytest.skip("no C compiler")
    base = cpu_ops.build(cpu_ops.BASELINE, tmp_path)
    assert base.sf_has_avx2() == 0
    g = torch.Generator().manual_seed(5)
    for kind, group in (("int8", 32), ("int4", 32), ("int4", 64)):
        qw = quant.quantize(torch.randn(70, 128, generator=g), kind, group)
        ref_w = qw.dequantize_torch()
        for rows in (1, 3, 7):
            x = torch.randn(rows, 128, generator=g)
            out = torch.empty(rows, 70)
            if kind == "int8":
                base.sf_gemm_i8(x.data_ptr(), 128, rows, 128, qw.q.data_ptr(), qw.scales.data_ptr(), 70, group, None,
                                out.data_ptr(), 70, 2)
            else:
                base.sf_gemm_i4(x.data_ptr(), 128, rows, 128, qw.q.data_ptr(), qw.scales.data_ptr(),
                                qw.mins.data_ptr(), 70, group, None, out.data_ptr(), 70, 2)
            torch.testing.assert_close(out, x @ ref_w.T, rtol=1e-5, atol=1e-4)
            assert base.sf_gemm_q8x(x.data_ptr(), 128, rows, 128, qw.q.data_ptr(), qw.scales.data_ptr(),
                                    None if qw.mins is None else qw.mins.data_ptr(), 70, group, int(kind == "int4"),
                                    None, out.data_ptr(), 70, 2) == 1
        deq = torch.empty(70, 128)
        if kind == "int8":
            base.sf_dequant_i8(qw.q.data_ptr(), qw.scales.data_ptr(), 70, 128, group, None, 70, deq.data_ptr(), 2)
        else:
            base.sf_dequant_i4(qw.q.data_ptr(), qw.scales.data_ptr(), qw.mins.data_ptr(), 70, 128, group, None, 70,
                               deq.data_ptr(), 2)
        assert torch.equal(deq, ref_w)
    # Decode attention: 2 sequences, 4 heads over 2 kv heads, block size 4, ragged contexts.
    cache = torch.randn(6, 2, 4, 2, 16, generator=g)
    q = torch.randn(2, 4, 16, generator=g)
    tables = torch.tensor([[3, 1, 5], [0, 2, 4]])
    ctx = torch.tensor([9, 5])
    out = torch.empty(2, 4, 16)
    assert base.sf_paged_decode(q.data_ptr(), 64, 2, 4, 2, 16, cache.data_ptr(), 4, tables.data_ptr(), 3,
                                ctx.data_ptr(), ctypes.c_float(0.25), 0, out.data_ptr(), 0, 2) == 0
    # A float16 cache needs F16C: this build refuses it (-2) rather than misreading it, and so does its store.
    assert base.sf_paged_decode(q.data_ptr(), 64, 2, 4, 2, 16, cache.data_ptr(), 4, tables.data_ptr(), 3,
                                ctx.data_ptr(), ctypes.c_float(0.25), 0, out.data_ptr(), 1, 2) == -2
    assert base.sf_rope_store(q.data_ptr(), 1, 2, 1, 16, q.data_ptr(), cache.data_ptr(), ctx.data_ptr(), 4, 1) == -2
    for b in range(2):
        k = cache[tables[b]][:, 0].reshape(-1, 2, 16)[: ctx[b]]
        v = cache[tables[b]][:, 1].reshape(-1, 2, 16)[: ctx[b]]
        for h in range(4):
            w = torch.softmax(k[:, h // 2] @ q[b, h] * 0.25, 0)
            torch.testing.assert_close(out[b, h], w @ v[:, h // 2], rtol=1e-5, atol=1e-5)


def test_cpu_march_builds_the_kernels_for_another_architecture(tmp_path, monkeypatch):
    """SPLITFIRE_CPU_MARCH=haswell builds AVX2 + FMA code without AVX-512 (what an AVX2 host runs, on any
    newer machine): the AVX2 path is taken, no zmm register is used, the int4 tiles give torch's result;
    a value that is not an architecture name is refused naming the variable."""
    import shutil
    import subprocess

    if cpu_ops.library() is None:
        pytest.skip("no C compiler")
    monkeypatch.delenv("SPLITFIRE_CPU_MARCH", raising=False)
    assert cpu_ops.target_arch() == cpu_ops.NATIVE
    monkeypatch.setenv("SPLITFIRE_CPU_MARCH", "haswell")
    assert cpu_ops.target_arch() == ("-march=haswell",)
    lib = cpu_ops.build(cpu_ops.target_arch(), tmp_path)
    assert lib.sf_has_avx2() == 1
    if shutil.which("objdump"):
        so = next(tmp_path.glob("cpu_ops-*.so"))
        asm = subprocess.run(["objdump", "-d", str(so)], capture_output=True, text=True, check=True).stdout
        assert "%ymm" in asm and "%zmm" not in asm
    g = torch.Generator().manual_seed(7)
    qw = quant.quantize(torch.randn(70, 128, generator=g), "int4", 32)
    x = torch.randn(5, 128, generator=g)
    out = torch.empty(5, 70)
    lib.sf_gemm_i4(x.data_ptr(), 128, 5, 128, qw.q.data_ptr(), qw.scales.data_ptr(), qw.mins.data_ptr(), 70, 32,
                   None, out.data_ptr(), 70, 2)
    torch.testing.assert_close(out, x @ qw.dequantize_torch().T, rtol=1e-5, atol=1e-4)
    for bad in ("native -O0", "haswell;rm", "-mavx512f"):
        monkeypatch.setenv("SPLITFIRE_CPU_MARCH", bad)
        with pytest.raises(ValueError, match="SPLITFIRE_CPU_MARCH"):
            cpu_ops.target_arch()
