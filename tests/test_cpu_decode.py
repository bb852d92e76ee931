"""The decode step's layers in one C call (engine/model/cpu_decode.py) compute exactly what the module
path computes: same tokens and bit-identical logprobs, for int8, int4 and fp8 weights, int8 activations,
a sliding window, q/k/v biases and tied embeddings; models it cannot run say why and keep the
module path."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import drain, make_engine
from hf_models import make_hf_model

from common.sampling_params import SamplingParams
from engine.model.cpu_decode import supported
from engine.model.kernels import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.library() is None, reason="no C compiler: the module path runs instead")

PROMPTS = [[(13 * i + 7 * j) % 300 + 3 for j in range(5 + 11 * i)] for i in range(5)]  # 5..49 tokens, ragged


def _run(model_dir, fused: bool, **kw) -> tuple[dict, object]:
    engine = make_engine(model_dir, **kw)
    if not fused:
        engine.model.cpu_layers_off = "off for the comparison"
    # EAGLE-3's capture of the residual stream entering layers 0 and 2, compared too
    model, forward, aux = engine.model, engine.model.forward, []
    model.aux_layers = (0, 2)

    def recording(*a, **k):
        hidden = forward(*a, **k)
        aux.append(model.aux_out.clone())
        return hidden

    model.forward = recording
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3))
    out: dict = {k: r.logprobs for k, r in drain(engine).items()}
    assert all(len(v) == 20 for v in out.values())
    out["aux"] = aux
    return out, engine.model


@pytest.mark.parametrize("family,quantization,activations,kv", [
    ("llama3", "int4", "float", "float32"),
    ("llama3", "int8", "float", "auto"),
    ("llama3", "fp8", "float", "float32"),
    ("llama3", "int4", "int8", "float32"),
    ("llama3", "int4", "float", "float16"),
    ("mistral", "int4", "float", "float16"),  # sliding window of 12 keys
    ("mistral", "int4", "float", "float32"),
    ("qwen2", "int8", "float", "float32"),  # q/k/v biases, tied embeddings
])
def test_c_layer_loop_equals_the_module_path(tmp_path, family, quantization, activations, kv):
    if kv == "float16" and not cpu_ops.kv_supported(torch.float16, 16):
        pytest.skip("a float16 KV cache in C needs the AVX2 build")
    d = make_hf_model(family, tmp_path / family).path
    kw = dict(quantization=quantization, cpu_activations=activations, max_num_seqs=8, kv_cache_dtype=kv)
    fused, model = _run(d, True, **kw)
    plain, plain_model = _run(d, False, **kw)
    assert model.cpu_layers is not None and model.cpu_layers.steps >= 19  # every decode step of the batch ran in C
    assert plain_model.cpu_layers is None
    assert [a.shape[1] for a in fused["aux"]] == [2 * model.cfg.hidden_size] * len(fused["aux"])
    aux_f, aux_p = fused.pop("aux"), plain.pop("aux")
    assert len(aux_f) == len(aux_p) and all(torch.equal(a, b) for a, b in zip(aux_f, aux_p, strict=True))
    assert fused == plain  # tokens and logprobs, bit for bit


def test_models_the_loop_cannot_run_keep_the_module_path(tmp_path):
    for family, quantization, reason in (("llama3", None, "not quantized"), ("qwen3", "int4", "q/k"),
                                         ("qwen3_moe", "int4", "experts"), ("deepseek_v3", None, "latent")):
        d = make_hf_model(family, tmp_path / family).path
        engine = make_engine(d, quantization=quantization)
        assert reason in (supported(engine.model, engine.kv.layout.dtype) or "")
        engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(drain(engine)["a"].token_ids) == 4
        assert engine.model.cpu_layers is None and reason in (engine.model.cpu_layers_off or "")


def test_short_chunks_and_verifications_run_in_the_loop_too(tiny_model_dir):
    """16-token prompt chunks and speculative verifications (several rows of one sequence) go through
    the loop's per-row causal attention: logprobs equal the module path's (SDPA) to float rounding,
    and speculation stays lossless."""
    def run(fused: bool, logprobs: bool = True, **kw):
        engine = make_engine(tiny_model_dir, quantization="int4", max_num_seqs=8, **kw)
        if not fused:
            engine.model.cpu_layers_off = "off for the comparison"
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                         logprobs=0 if logprobs else None))
        return {k: r.logprobs if logprobs else r.token_ids for k, r in drain(engine).items()}, engine

    chunked, eng = run(True, max_num_batched_tokens=16)
    plain, _ = run(False, max_num_batched_tokens=16)
    assert eng.model.cpu_layers.steps > 20  # the prompt chunks ran in C too (16-row steps)
    for k in plain:
        assert [t for t, _, _ in chunked[k]] == [t for t, _, _ in plain[k]]
        torch.testing.assert_close(torch.tensor([lp for _, lp, _ in chunked[k]]),
                                   torch.tensor([lp for _, lp, _ in plain[k]]), rtol=1e-4, atol=1e-4)
    base, _ = run(False, logprobs=False)  # (requests with logprobs are not speculated)
    spec, eng = run(True, logprobs=False, speculative="ngram", speculative_max_batch=8)
    assert spec == base and eng.drafter.accepted > 0


def test_vectorized_silu_mul_within_a_few_ulp_of_the_reference():
    """`silu_mul` (exponentials 8 at a time) against its reference (libm's expf per element): rows of
    odd widths (a scalar tail), both signs, tiny and huge gates, NaN and infinities; within 4 ulp, and
    where the reference underflows to zero (gates below -87) within 1e-30."""
    g = torch.Generator().manual_seed(3)
    for t, i in ((1, 8), (3, 1536), (16, 1539), (2, 5)):
        gate = torch.randn(t, i, generator=g) * torch.tensor([0.01, 1.0, 8.0, 40.0]).repeat(i // 4 + 1)[:i]
        gate[0, : min(i, 6)] = torch.tensor([0.0, -0.0, 88.0, -88.0, -200.0, 1e-30])[: min(i, 6)]
        up = torch.randn(t, i, generator=g)
        gu = torch.cat([gate, up], dim=1).contiguous()
        fast, ref = cpu_ops.silu_mul(gu), cpu_ops.silu_mul(gu, reference=True)
        ulp = (torch.nextafter(ref.abs(), torch.tensor(float("inf"))) - ref.abs()).clamp(min=1e-45)
        assert (((fast - ref).abs() <= 4 * ulp) | ((fast - ref).abs() <= 1e-30)).all(), (fast - ref).abs().max()
    special = torch.tensor([[float("nan"), float("inf"), float("-inf"), 1.0, 1.0, 1.0, 1.0, 1.0,
                             2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    fast, ref = cpu_ops.silu_mul(special), cpu_ops.silu_mul(special, reference=True)
    assert torch.isnan(fast[0, 0]) and torch.isnan(ref[0, 0])
    assert fast[0, 1] == ref[0, 1] == float("inf")
