"""`splitfire plan`: sizing from config.json alone. Parameter counts are held to transformers' own
models (tiny ones built here) and to the published totals of the built-in configs."""

from __future__ import annotations

import pytest
from hf_models import make_hf_model

from common import sizing


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gemma3", "qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3"])
def test_parameter_count_equals_transformers_model(family, tmp_path):
    fam = make_hf_model(family, tmp_path / "m")
    ours = sum(sizing.read_model(str(fam.path)).params().values())
    theirs = sum(p.numel() for p in fam.model.parameters())
    small = sum(p.numel() for p in fam.model.parameters() if p.dim() == 1)  # norms and biases: not counted
    assert theirs - small <= ours <= theirs, (ours, theirs, small)


@pytest.mark.parametrize(("name", "billions"), [("deepseek-v3", 671), ("kimi-k2", 1026), ("llama-3.1-70b", 70.6),
                                                 ("llama-3.1-405b", 405.9), ("qwen3-235b-a22b", 235),
                                                 ("llama-4-scout", 107.8)])
def test_builtin_configs_have_their_published_sizes(name, billions):
    # (Llama 4 Scout: 109B with its vision tower, which a text-only plan leaves out; Kimi K2: "1T".)
    assert sum(sizing.read_model(name).params().values()) / 1e9 == pytest.approx(billions, rel=0.01)


def test_kv_bytes_and_the_smallest_layout():
    llama = sizing.read_model("llama-3.1-70b")
    h100 = sizing.DEVICES["h100-80gb"]
    p = sizing.plan(llama, h100, sizing.Layout(tp=4))
    assert p.kv_bytes_per_token == 80 * 2 * 2 * 128 * 2  # layers x (K, V) x 8/4 heads x head_dim x bfloat16
    assert p.weight_bytes == pytest.approx(sum(llama.params().values()) * 2 / 4, rel=0.01)
    assert sizing.smallest(llama, h100).layout == sizing.Layout(tp=4)
    # 8 KV heads over 16 ranks: replicated, never fewer than one a rank.
    assert sizing.plan(llama, h100, sizing.Layout(tp=16)).kv_bytes_per_token == 80 * 2 * 1 * 128 * 2
    # A latent cache is replicated on every TP rank, split only by pipeline stages.
    ds = sizing.read_model("deepseek-v3")
    assert sizing.plan(ds, h100, sizing.Layout(tp=8, pp=2)).kv_bytes_per_token == 31 * (512 + 64) * 2
    # Expert parallel moves top-k hidden states; tensor parallel alone does not.
    assert (sizing.plan(ds, h100, sizing.Layout(8, 2, ep=True)).comm_bytes_per_token
            > sizing.plan(ds, h100, sizing.Layout(8, 2)).comm_bytes_per_token)


def test_too_big_says_by_how_much():
    p = sizing.plan(sizing.read_model("llama-3.1-405b"), sizing.DEVICES["h100-80gb"], sizing.Layout(tp=2))
    assert not p.fits
    assert "exceed the device by" in sizing.render(p)


def test_plan_command(capsys):
    from splitfire_cli import main

    assert main(["plan", "--model", "llama-4-scout", "--gpu", "h200", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "TP2 x PP1 (2 devices)" in out and "KV tokens that fit" in out
    with pytest.raises(ValueError, match="not a built-in name"):
        sizing.read_model("no-such-model")


def test_reads_the_config_splitfire_serves(tmp_path):
    """The same numbers for a model directory as the engine's own shapes: KV bytes per token equal the
    engine's KV layout page bytes per token."""
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine

    fam = make_hf_model("qwen3", tmp_path / "m")
    eng = LLMEngine(EngineConfig(model=str(fam.path), device="cpu", kv_cache_gb=0.01, threads=1))
    layout = eng.kv.layout
    per_token = layout.page_bytes * layout.num_layers // layout.block_size
    p = sizing.plan(sizing.read_model(str(fam.path)), sizing.DEVICES["h100-80gb"], sizing.Layout(),
                    kv_cache_dtype="float32")
    assert p.kv_bytes_per_token == per_token


def test_compressed_weights_free_a_quarter_of_the_matmul_bytes_for_kv(capsys):
    """`--compress-weights`: every matrix's bytes at COMPRESSED_RATIO (attention, MLPs, stacked experts, the
    embedding and LM head); the bytes freed become KV tokens."""
    from splitfire_cli import main

    llama = sizing.read_model("llama-3.1-70b")
    h100, tp2 = sizing.DEVICES["h100-80gb"], sizing.Layout(tp=2)
    plain, packed = sizing.plan(llama, h100, tp2), sizing.plan(llama, h100, tp2, compress_weights=True)
    assert packed.weight_bytes == pytest.approx(plain.weight_bytes * sizing.COMPRESSED_RATIO, rel=1e-6)
    moe, tp8 = sizing.read_model("qwen3-235b-a22b"), sizing.Layout(tp=8)  # (the experts too)
    p_moe, c_moe = sizing.plan(moe, h100, tp8), sizing.plan(moe, h100, tp8, compress_weights=True)
    assert c_moe.weight_bytes == pytest.approx(p_moe.weight_bytes * sizing.COMPRESSED_RATIO, rel=1e-6)
    assert c_moe.step_ms_b1 < p_moe.step_ms_b1
    # (less the many-rows decoder's transient bfloat16 buffer, reserved beside the activations)
    assert packed.reserve_bytes == plain.reserve_bytes + sizing.DECOMPRESS_BUFFER_BYTES
    freed = (plain.weight_bytes - packed.weight_bytes - sizing.DECOMPRESS_BUFFER_BYTES) / plain.kv_bytes_per_token
    assert packed.kv_tokens - plain.kv_tokens == pytest.approx(freed, abs=1)
    assert packed.step_ms_b1 < plain.step_ms_b1 * 0.8  # (bandwidth-bound: a quarter fewer weight bytes)
    with pytest.raises(ValueError, match="bfloat16 weights, not int8"):
        sizing.plan(llama, h100, tp2, "int8", compress_weights=True)
    assert main(["plan", "--model", "llama-3.1-70b", "--tp", "2", "--compress-weights"]) == 0
    assert "--compress-weights frees" in capsys.readouterr().out
