"""The loaded-weights cache (engine/loading/weight_cache.py): a second start maps the cached tensors instead
of reading the checkpoint, and computes exactly what a checkpoint load computes — dense, tied,
quantized (GGUF-style and --quantization), mixture-of-experts and latent-attention models; a
changed checkpoint or option misses, a corrupt cache is replaced."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import drain, make_engine
from hf_models import make_hf_model

from common.sampling_params import SamplingParams
from engine.loading import weight_cache
from engine.loading.checkpoint import Checkpoint

PROMPTS = [[(11 * i + 3 * j) % 300 + 3 for j in range(6 + 9 * i)] for i in range(4)]


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITFIRE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPLITFIRE_WEIGHT_CACHE_MIN_MB", "0")  # the tiny models are far below the default floor


def _greedy(model_dir, **kw) -> tuple[dict, object]:
    engine = make_engine(model_dir, **kw)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    return {k: r.logprobs for k, r in drain(engine).items()}, engine


def _no_checkpoint_reads(monkeypatch):
    def refuse(self, name, out):
        raise AssertionError(f"read {name} from the checkpoint: the cache should have served it")

    monkeypatch.setattr(Checkpoint, "_read", refuse)


@pytest.mark.parametrize("family,quantization", [("llama3", None), ("qwen2", "int4"), ("qwen3_moe", "int8"),
                                                 ("deepseek_v3", None), ("gemma3", None)])
def test_a_mapped_start_computes_what_a_checkpoint_load_computes(tmp_path, monkeypatch, family, quantization):
    d = make_hf_model(family, tmp_path / family).path
    monkeypatch.setenv("SPLITFIRE_WEIGHT_CACHE", "0")
    want, _ = _greedy(d, quantization=quantization)
    monkeypatch.setenv("SPLITFIRE_WEIGHT_CACHE", "1")
    first, engine = _greedy(d, quantization=quantization)  # loads the checkpoint, writes the cache
    assert engine.model.weight_mapping is None
    path = weight_cache.cache_path(d, torch.float32, quantization)
    assert path.is_file()
    with monkeypatch.context() as m:
        _no_checkpoint_reads(m)
        second, engine = _greedy(d, quantization=quantization)
    assert engine.model.weight_mapping is not None
    assert first == want and second == want  # tokens and logprobs, bit for bit
    # The parameters are views of the mapping, not copies.
    norm = engine.model.layers[0].attn_norm.weight
    base = torch.frombuffer(engine.model.weight_mapping, dtype=torch.uint8)
    assert base.data_ptr() <= norm.data_ptr() < base.data_ptr() + base.numel()


def test_changes_miss_the_cache_and_a_corrupt_cache_is_replaced(tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    want, _ = _greedy(d, quantization="int8")
    path = weight_cache.cache_path(d, torch.float32, "int8")
    assert path.is_file()
    assert weight_cache.cache_path(d, torch.float32, "int4") != path  # another option: another entry
    assert weight_cache.cache_path(d, torch.bfloat16, "int8") != path
    (d / "model.safetensors").touch()  # a rewritten checkpoint (new mtime)
    assert weight_cache.cache_path(d, torch.float32, "int8") != path
    old, path = path, weight_cache.cache_path(d, torch.float32, "int8")
    _greedy(d, quantization="int8")
    assert path.is_file() and not old.exists()  # the stale entry is replaced, not kept beside it
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    got, engine = _greedy(d, quantization="int8")
    assert got == want and engine.model.weight_mapping is None  # loaded from the checkpoint instead
    assert path.is_file() and path.stat().st_size == len(data)  # and rewritten whole
    got, engine = _greedy(d, quantization="int8")
    assert got == want and engine.model.weight_mapping is not None
    monkeypatch.setenv("SPLITFIRE_WEIGHT_CACHE_MIN_MB", "32")
    assert not weight_cache.enabled(d)  # small checkpoints skip it by default


def test_a_mapped_start_gives_back_the_pages_packing_copied(tmp_path):
    """Float weights are packed for oneDNN (a copy), so the mapped originals' pages are given back: a
    mapped start adds about the model's size to RSS, as reading the checkpoint does, not twice it."""
    from engine_helpers import load_memory
    from tiny_model import make_tiny_llama

    from engine.model.layers import cpu_packing_supported

    if not cpu_packing_supported(torch.float32):
        pytest.skip("this CPU does not pack float32 weights for oneDNN: nothing is copied")
    d = make_tiny_llama(tmp_path / "big", layers=3, hidden=1024, heads=8, kv_heads=8, intermediate=4096, tie=False)
    size = (d / "model.safetensors").stat().st_size
    env = {"SPLITFIRE_HOME": str(tmp_path / "home"), "SPLITFIRE_WEIGHT_CACHE_MIN_MB": "0"}
    first, second = load_memory(d, env), load_memory(d, env)
    assert (first.mapped, second.mapped) == (False, True)  # the first writes the cache, the second maps it
    assert second.rss_added < 1.3 * size and second.peak_added < 1.3 * size, (size, second)


def test_a_compressed_checkpoint_is_cached_like_any_other(tmp_path, monkeypatch):
    """`splitfire compress`'s output: the first start decodes it and writes the cache, the second maps the
    cache (no tensor decoded) and computes what the uncompressed bfloat16 checkpoint computes; a rewritten
    data file misses."""
    import json

    from engine.loading import compressed
    from engine.loading.compress import compress_dir

    hf = make_hf_model("llama3", tmp_path / "fp32")
    plain = tmp_path / "bf16"
    hf.model.to(torch.bfloat16).save_pretrained(plain)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (plain / f).write_bytes((hf.path / f).read_bytes())
    (plain / "config.json").write_text(json.dumps({**hf.config, "torch_dtype": "bfloat16"}))
    packed = tmp_path / "z"
    compress_dir(plain, packed)
    monkeypatch.setenv("SPLITFIRE_WEIGHT_CACHE", "0")
    want, _ = _greedy(plain, dtype="bfloat16")
    monkeypatch.setenv("SPLITFIRE_WEIGHT_CACHE", "1")
    first, engine = _greedy(packed, dtype="bfloat16")
    assert engine.model.weight_mapping is None
    path = weight_cache.cache_path(packed, torch.bfloat16, None)
    assert path.is_file()
    with monkeypatch.context() as m:
        def refuse(*a, **k):
            raise AssertionError("decoded a compressed tensor: the cache should have served it")

        m.setattr(compressed, "decode_into", refuse)
        second, engine = _greedy(packed, dtype="bfloat16")
    assert engine.model.weight_mapping is not None
    assert first == want and second == want  # tokens and logprobs, bit for bit
    (packed / "weights-00000.sfz").touch()
    assert weight_cache.cache_path(packed, torch.bfloat16, None) != path
