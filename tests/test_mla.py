"""DeepSeek-V3 (and V2) specifics beyond the family-wide transformers comparison (test_model_families.py):
the absorbed decode path equals the up-projecting reference, the cache and the wire carry
latents only, routing equals transformers' router, and the config variants and refusals."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import drain, make_engine
from grpc_client import generate, greedy, stats
from hf_models import NONE, make_hf_model
from procs import address, start_worker, stop_all
from test_disaggregation import metric

from common.errors import ModelLoadError
from common.sampling_params import SamplingParams
from engine.model.attention import DecodeBatch
from engine.model.mla import MLAttention
from engine.model.model_config import ModelConfig
from engine.model.moe import route_grouped

SMALL = dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=64, num_attention_heads=4, kv_lora_rank=32,
             q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_hidden_layers=2,
             n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * j + 31 * salt) % 390 + 3 for j in range(n)]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_hf_model("deepseek_v3", tmp_path_factory.mktemp("deepseek") / "model")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_absorbed_decode_equals_up_projecting_reference(dtype):
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(SMALL)
    with torch.device("cpu"):
        attn = MLAttention(cfg, cfg.layers[0]).to(dtype)
    attn.kv_b.copy_(torch.randn_like(attn.kv_b) * 0.3)
    bs, blocks = 4, 12
    cache = torch.randn(blocks, 1, bs, 1, 32 + 8, dtype=dtype)
    lens = torch.tensor([3, 9, 17])  # inside one block, a few, and a partly filled last block
    width = 5
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in lens])
    mask = (torch.arange(width * bs)[None, :] < lens[:, None]).view(3, 1, 1, -1)
    d = DecodeBatch(0, tables, mask, lens)
    q_nope, q_rope = torch.randn(3, 4, 16, dtype=dtype), torch.randn(3, 4, 8, dtype=dtype)
    absorbed = attn.attend_absorbed(q_nope, q_rope, cache, d)
    reference = attn.attend_decode_expanded(q_nope, q_rope, cache, d)
    assert absorbed.shape == reference.shape == (3, 4, 16)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(absorbed, reference, atol=tol, rtol=tol)
    # Keys past a sequence's length cannot leak in: scribbling over them changes nothing.
    cache.view(blocks, -1)[tables[0, 1:]] = 1e3
    torch.testing.assert_close(attn.attend_absorbed(q_nope, q_rope, cache, d)[0], absorbed[0], atol=tol, rtol=tol)


def test_engine_decodes_equal_with_and_without_absorption(deepseek):
    """Whole-model: the default (absorbed) decode and the up-projecting one give transformers' tokens."""
    ps = [prompt(n, i) for i, n in enumerate((5, 40, 90))]
    outs = []
    for absorb in (True, False):
        engine = make_engine(deepseek.path)
        attns = [m for m in engine.model.modules() if isinstance(m, MLAttention)]
        assert attns and all(a.absorb for a in attns)
        for a in attns:
            a.absorb = absorb
        for i, p in enumerate(ps):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        outs.append(drain(engine))
    for i, p in enumerate(ps):
        assert outs[0][f"r{i}"].token_ids == outs[1][f"r{i}"].token_ids == deepseek.greedy(p, 8)


@pytest.mark.parametrize("family, variant", [
    # No q LoRA (q projected from the hidden state), RoPE dims half-split in the checkpoint, plain RoPE,
    # one expert group, unnormalised top-k weights, two shared experts.
    ("deepseek_v3", dict(q_lora_rank=NONE, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False,
                         n_shared_experts=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("deepseek_v3", dict(rope_interleave=False, first_k_dense_replace=0)),
    # DeepSeek-V2 with plain top-k ("greedy") and a q LoRA.
    ("deepseek_v2", dict(topk_method="greedy", n_group=None, topk_group=None, q_lora_rank=48,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
])
def test_config_variants_equal_transformers(family, variant, tmp_path):
    fam = make_hf_model(family, tmp_path / "model", seed=3, **variant)
    engine = make_engine(fam.path)
    ps = [prompt(n, i) for i, n in enumerate((7, 60))]
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    out = drain(engine)
    for i, p in enumerate(ps):
        assert out[f"r{i}"].token_ids == fam.greedy(p, 6), variant


@pytest.mark.parametrize("fields, named", [
    ({"norm_topk_prob": True}, "norm_topk_prob"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_deepseek_v2_outside_what_is_implemented_is_refused(fields, named):
    v2 = {**SMALL, "architectures": ["DeepseekV2ForCausalLM"], "topk_method": "greedy"}
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_dict({**v2, **fields})


def test_grouped_routing_equals_transformers_router():
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    c = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, n_group=4, topk_group=2,
                                      num_experts_per_tok=3, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(c)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.5)  # steers choices hard
    x = torch.randn(64, 32, generator=g)
    logits, theirs_w, theirs_ids = router(x)
    ours_w, ours_ids = route_grouped(logits, router.e_score_correction_bias, 3, 4, 2, True, 2.5)
    o_ids, o_order = ours_ids.sort(dim=-1)
    t_ids, t_order = theirs_ids.sort(dim=-1)
    assert torch.equal(o_ids, t_ids)
    torch.testing.assert_close(ours_w.gather(1, o_order), theirs_w.gather(1, t_order))
    # The bias chose differently from the raw scores somewhere: the test exercises it.
    plain_ids = torch.sigmoid(logits).topk(3, dim=-1).indices.sort(dim=-1).values
    assert not torch.equal(plain_ids, t_ids)


def test_kv_cache_is_latent_sized(deepseek):
    engine = make_engine(deepseek.path)
    layout = engine.kv.layout
    assert (layout.planes, layout.num_kv_heads, layout.head_dim) == (1, 1, 32 + 8)
    assert layout.page_bytes == layout.block_size * (32 + 8) * 4
    assert engine.kv.layer(0).shape == (layout.num_blocks, 1, layout.block_size, 1, 40)


async def test_transfer_moves_exactly_the_latents(deepseek, tmp_path):
    """A 1,000-token prompt: layers x blocks x block_size x (kv_lora_rank + qk_rope_head_dim) x 4 bytes."""
    pre = start_worker("prefill", deepseek.path, tmp_path, "--max-num-batched-tokens", "256", wait=False)
    dec = start_worker("decode", deepseek.path, tmp_path, "--local-prefill-max-tokens", "0", wait=False)
    try:
        for w in (pre, dec):
            w.wait_for("worker ready")
        ids = prompt(1000, 5)
        before = metric(pre, "splitfire_worker_kv_transfer_bytes_total")
        got = await generate(address(dec), ids, greedy(4), prefill=address(pre))
        assert got.prefill_mode == "remote"
        assert got.token_ids == deepseek.greedy(ids, 4)
        sent = metric(pre, "splitfire_worker_kv_transfer_bytes_total") - before
        layers, blocks, block_size = 3, -(-1000 // 16), 16
        assert sent == layers * blocks * block_size * (32 + 8) * 4
        assert (await stats(address(pre))).running == 0
    finally:
        assert stop_all(pre, dec) == [0, 0], pre.log()[-1000:] + dec.log()[-1000:]


def test_kimi_k2_model_type_and_mtp_layers_load(deepseek, tmp_path):
    """Kimi-K2 ships the architecture under model_type "kimi_k2"; DeepSeek-V3 files append the
    multi-token-prediction module as a layer past num_hidden_layers, which is skipped."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "kimi"
    shutil.copytree(deepseek.path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="kimi_k2", num_nextn_predict_layers=1, scoring_func="sigmoid", topk_method="noaux_tc")
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.input_layernorm.weight"] = torch.ones(64)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    engine = make_engine(d)
    p = prompt(30)
    engine.add_request("r", p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert drain(engine)["r"].token_ids == deepseek.greedy(p, 5)


@pytest.mark.parametrize("fields, named", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"attention_bias": True}, "attention_bias"),
    ({"n_group": 3}, "n_group=3"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type 'dynamic'"),
    ({"model_type": "deepseek_v2"}, "model_type 'deepseek_v2'"),
])
def test_what_is_not_implemented_is_refused_by_name(fields, named):
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_dict({**SMALL, **fields})


def test_yarn_softmax_scale_follows_mscale_all_dim():
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    rope = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
    ours = ModelConfig.from_dict({**SMALL, "max_position_embeddings": 163840, "rope_parameters": rope})
    c = transformers.DeepseekV3Config(**{k: v for k, v in SMALL.items() if k != "architectures"},
                                      max_position_embeddings=163840, rope_parameters=dict(rope))
    assert ours.scale == pytest.approx(DeepseekV3Attention(c, 0).scaling, rel=1e-12)
    assert ours.scale != pytest.approx((16 + 8) ** -0.5)


def test_unknown_deepseek2_gguf_gating_is_refused():
    from pathlib import Path

    from engine.loading.gguf_convert import _deepseek2_config

    fields = {"rope.dimension_count": 8, "block_count": 2, "expert_gating_func": 3}
    with pytest.raises(ModelLoadError, match="expert_gating_func=3"):
        _deepseek2_config(lambda key, default=None: fields.get(key, default), set(), {}, Path("x.gguf"))


def test_deepseek_v3_gguf_pre_tokenizer_splits_like_llama_cpp():
    """llama.cpp's three DeepSeek-V3 splits in order: numbers in runs of up to 3, CJK runs, then words
    (a punctuation mark may lead a Latin word) and punctuation."""
    from tokenizers import Regex, pre_tokenizers

    from engine.loading.gguf_convert import _PRE_SPLITS

    seq = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated")
                                   for r in _PRE_SPLITS["deepseek-v3"]])
    pieces = [p for p, _ in seq.pre_tokenize_str("Hello, world! 12345 你好ab.cd\n\n  x")]
    assert pieces == ["Hello", ",", " world", "!", " ", "123", "45", " ", "你好", "ab", ".cd", "\n\n", " ", " x"]


async def test_latent_blocks_are_shared_through_the_kv_store(deepseek, tmp_path):
    """The cluster-wide KV tier on a real mooncake_master moves latent pages like any others: a prompt
    computed on worker A is served from the store on worker B, with transformers' tokens."""
    from procs import start_kv_master
    from test_kv_store import full_blocks, metric, published

    master = start_kv_master(tmp_path)
    store = ["--kv-store", f"127.0.0.1:{master.ports['rpc']}", "--kv-store-gb", "0.05"]
    a = start_worker("both", deepseek.path, tmp_path, *store, name="mla-A", wait=False)
    b = start_worker("both", deepseek.path, tmp_path, *store, name="mla-B", wait=False)
    try:
        for w in (a, b):
            w.wait_for("worker ready")
        ids = prompt(200, 9)
        first = await generate(address(a), ids, greedy(6))
        await published(a, len(ids) // 16)
        second = await generate(address(b), ids, greedy(6))
        assert second.token_ids == first.token_ids == deepseek.greedy(ids, 6)
        assert second.usage.cached_tokens == full_blocks(ids)
        assert metric(b, "splitfire_worker_prefix_hit_tokens", tier="store") >= full_blocks(ids)
    finally:
        assert stop_all(a, b) == [0, 0], a.log()[-1000:] + b.log()[-1000:]
        master.stop()


@pytest.mark.parametrize("queries, context", [(5, 37), (12, 12), (1, 20)])  # after a prefix; a whole prompt
def test_absorbed_chunk_equals_up_projecting_chunk(queries, context):
    """Short chunks (speculative verifications, small steps after a long prefix) attend absorbed:
    equal to the up-projecting reference, causal mask and prefix included."""
    torch.manual_seed(queries)
    cfg = ModelConfig.from_dict(SMALL)
    attn = MLAttention(cfg, cfg.layers[0]).double()
    attn.kv_b.copy_(torch.randn_like(attn.kv_b) * 0.3)
    latents = torch.randn(context, 32 + 8, dtype=torch.float64)
    q_nope, q_rope = torch.randn(queries, 4, 16, dtype=torch.float64), torch.randn(queries, 4, 8, dtype=torch.float64)
    q_pos = torch.arange(context - queries, context)[:, None]
    mask = None if queries == context else torch.arange(context)[None, :] <= q_pos
    absorbed = attn.attend_absorbed_chunk(q_nope, q_rope, latents, mask)
    torch.testing.assert_close(absorbed, attn.attend_expanded(q_nope, q_rope, latents, mask), atol=1e-12, rtol=1e-12)
    # The cost rule: short chunks absorb, long ones expand (here rank 32: below 32 rows), never with absorb off.
    assert attn.absorbs(5) and not attn.absorbs(64)
    attn.absorb = False
    assert not attn.absorbs(5)
