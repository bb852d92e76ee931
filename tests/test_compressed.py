"""Lossless weight compression (engine/loading/compressed.py, compress.py, `splitfire compress`): every
tensor reads back bit for bit, a corrupt chunk is refused naming its tensor, and a compressed model's
greedy tokens and logits equal the uncompressed model's exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from engine_helpers import drain, make_engine
from hf_models import FAMILIES, make_gemma3_multimodal, make_hf_model
from safetensors.torch import save_file

from common.errors import ModelLoadError
from common.sampling_params import SamplingParams
from engine.loading import compressed
from engine.loading.checkpoint import Checkpoint
from engine.loading.compress import compress_dir


def special_bf16(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Weights with NaN, +-Inf, +-0, subnormals and every exponent, beside normal values."""
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 0.05).to(dtype)
    bits = torch.arange(0, 1 << 16, 97, dtype=torch.int32).to(torch.int16)  # a sweep of bit patterns
    t[: bits.numel()] = bits.view(dtype)
    t[-6:] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40], dtype=torch.float32).to(dtype)
    return t


def test_planes_split_and_join_every_16_bit_pattern():
    u = np.arange(1 << 16, dtype=np.uint16)
    for codec in (compressed.CODEC_BF16, compressed.CODEC_F16):
        plane, exp = compressed.split(u, codec)  # the C kernel (when built)
        want = compressed.split_reference(u, codec)
        assert np.array_equal(plane, want[0]) and np.array_equal(exp, want[1]), codec
        out, ref = np.empty_like(u), np.empty_like(u)
        compressed.join(plane, exp, codec, out)  # the C kernel (when built)
        compressed.join_reference(plane, exp, codec, ref)
        assert np.array_equal(out, u) and np.array_equal(ref, u), codec


@pytest.mark.parametrize("coder", ["huffman", "rans"])
def test_round_trip_is_bit_exact(tmp_path, coder):
    src, dst = tmp_path / "m", tmp_path / "z"
    src.mkdir()
    tensors = {
        "odd.bf16": special_bf16(3 * 1031 * 7, torch.bfloat16).reshape(3, 1031, 7),
        "odd.f16": special_bf16(5 * 4001, torch.float16).reshape(5, 4001),
        "big.bf16": (torch.randn(700, 3001) * 0.02).to(torch.bfloat16),  # several 64k-weight chunks
        "f32": torch.randn(17, 3),
        "i64": torch.arange(10),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
    }
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    stats = compress_dir(src, dst, chunk=1 << 16, coder=coder)
    assert (dst / "config.json").read_text() == "{}" and not list(dst.glob("*.safetensors"))
    assert stats.by_kind["bfloat16"][1] < 0.8 * stats.by_kind["bfloat16"][0]  # normal weights: ~2.7 bits of exponent
    codecs = {e.codec for e in compressed.read_manifest(dst).values()}
    assert {*compressed.CODERS[coder].values(), compressed.CODEC_RAW} <= codecs
    ck = Checkpoint(dst)
    for name, t in tensors.items():
        got = ck.get(name)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    part = ck.read_part("big.bf16", range(10, 20), range(5, 9))  # a tensor-parallel rank's slice
    assert torch.equal(part.view(torch.int16), tensors["big.bf16"][10:20, 5:9].view(torch.int16))
    # Decoded ahead: reading the manifest's first tensor starts the next ones; each is then copied out.
    ahead = Checkpoint(dst)
    names = list(ahead.compressed)
    ahead.get(names[0])
    small = [n for n in names[1:] if len(ahead.compressed[n].chunks) <= 2]
    assert set(ahead._ahead) == set(small) and "big.bf16" not in small  # (several chunk pairs: decoded when asked)
    ahead.skip(small[-1])
    assert small[-1] not in ahead._ahead
    names.remove(small[-1])
    names.append(small[-1])
    for name in names[1:-1]:
        got = ahead.get(name)
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensors[name].reshape(-1).view(torch.uint8)), name
    assert not ahead._ahead
    ahead.close()
    # Read past the page cache (O_DIRECT: offsets and lengths widened to 4 KiB, what a cold load reads).
    try:
        compressed.DataFile(next(dst.glob("*.sfz")), direct=True).close()
    except OSError:
        return  # (a filesystem without O_DIRECT, e.g. tmpfs: the rest is the plain reads above)
    for name, e in compressed.read_manifest(dst).items():
        out = torch.empty(e.shape, dtype=tensors[name].dtype)
        compressed.decode_into(dst, e, out, direct=True)
        assert torch.equal(out.reshape(-1).view(torch.uint8), tensors[name].reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("coder", ["huffman", "rans"])
def test_a_corrupt_chunk_is_refused_naming_its_tensor(tmp_path, coder):
    src, dst = tmp_path / "m", tmp_path / "z"
    src.mkdir()
    b = torch.randn(4, 4).to(torch.bfloat16)
    save_file({"a": (torch.randn(300, 300) * 0.02).to(torch.bfloat16), "b": b}, str(src / "model.safetensors"))
    compress_dir(src, dst, chunk=1 << 14, coder=coder)
    entry = compressed.read_manifest(dst)["a"]
    data = bytearray((dst / entry.file).read_bytes())
    off, length = entry.chunks[2][:2]
    data[off + length // 2] ^= 0x5A  # one flipped byte inside the third exponent chunk
    (dst / entry.file).write_bytes(bytes(data))
    ck = Checkpoint(dst)
    with pytest.raises(ModelLoadError, match="'a'"):
        ck.get("a")
    assert torch.equal(ck.get("b").view(torch.int16), b.view(torch.int16))  # the other tensor is untouched
    # A flipped byte in the raw plane decodes, but the checksum catches it.
    data = bytearray((dst / entry.file).read_bytes())
    data[off + length // 2] ^= 0x5A
    data[entry.plane[0] + 7] ^= 0x01
    (dst / entry.file).write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="checksum"):
        Checkpoint(dst).get("a")


@pytest.mark.parametrize("coder", ["huffman", "rans"])
def test_a_row_slice_decodes_only_the_chunks_that_hold_it(tmp_path, coder, monkeypatch):
    """A tensor-parallel rank's rows of a matrix: only the chunks holding them are read and decoded (each
    checked against its own CRC), so a rank decodes its share; a corrupt chunk elsewhere does not touch the
    slice, one inside it is refused naming the tensor; a manifest without per-chunk CRCs decodes whole."""
    src, dst = tmp_path / "m", tmp_path / "z"
    src.mkdir()
    w = (torch.randn(700, 3001) * 0.02).to(torch.bfloat16)
    save_file({"w": w}, str(src / "model.safetensors"))
    compress_dir(src, dst, chunk=1 << 16, coder=coder)
    decoded: list[int] = []
    real = compressed._decode_chunks

    def counting(f, e, ids, starts, out):
        decoded.append(sum(e.chunks[i][2] for i in ids))
        return real(f, e, ids, starts, out)

    monkeypatch.setattr(compressed, "_decode_chunks", counting)
    for rows, cols in [(range(100, 200), None), (range(0, 1), range(7, 9)), (range(350, 700), None),
                       (range(699, 700), range(0, 3001))]:
        decoded.clear()
        part = Checkpoint(dst).read_part("w", rows, cols)
        want = w[rows.start : rows.stop]
        want = want[:, cols.start : cols.stop] if cols is not None else want
        assert torch.equal(part.view(torch.int16), want.contiguous().view(torch.int16)), (rows, cols)
        assert sum(decoded) <= len(rows) * 3001 + 2 * (1 << 16), (rows, sum(decoded))  # its share, not 2.1M
    entry = compressed.read_manifest(dst)["w"]
    data = bytearray((dst / entry.file).read_bytes())
    off, length = entry.chunks[-1][:2]  # (the last rows' chunk)
    data[off + length // 2] ^= 0x5A
    (dst / entry.file).write_bytes(bytes(data))
    part = Checkpoint(dst).read_part("w", range(0, 50), None)  # far from the corrupt chunk: read
    assert torch.equal(part.view(torch.int16), w[:50].view(torch.int16))
    with pytest.raises(ModelLoadError, match="'w'"):
        Checkpoint(dst).read_part("w", range(690, 700), None)
    data[off + length // 2] ^= 0x5A  # restored; a sign/mantissa byte of row 695 flipped: decodes, CRC refuses
    data[entry.plane[0] + 695 * 3001 + 5] ^= 0x01
    (dst / entry.file).write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="checksum"):
        Checkpoint(dst).read_part("w", range(690, 700), None)
    data[entry.plane[0] + 695 * 3001 + 5] ^= 0x01  # restored; then the manifest as an older build wrote it
    (dst / entry.file).write_bytes(bytes(data))
    manifest = json.loads((dst / compressed.MANIFEST).read_text())
    for t in manifest["tensors"]:
        t["chunks"] = [c[:3] for c in t["chunks"]]
    (dst / compressed.MANIFEST).write_text(json.dumps(manifest))
    decoded.clear()
    part = Checkpoint(dst).read_part("w", range(100, 200), None)
    assert torch.equal(part.view(torch.int16), w[100:200].view(torch.int16))
    assert sum(decoded) == w.numel()  # (whole: the tensor's CRC is all there is to check)


@pytest.fixture(scope="module", params=[*FAMILIES, "gemma3-multimodal"])
def bf16_pair(request, tmp_path_factory):
    """A transformers-built model of every family saved in bfloat16, and its compressed copy."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3-multimodal":  # (a vision tower's weights beside the text model's)
        hf = make_gemma3_multimodal(root / "fp32")
    else:
        hf = make_hf_model(request.param, root / "fp32")
    plain = root / "bf16"
    hf.model.to(torch.bfloat16).save_pretrained(plain)
    for f in (hf.path / "tokenizer.json", hf.path / "tokenizer_config.json"):
        if f.is_file():
            (plain / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((hf.path / "config.json").read_text())  # (as make_hf_model wrote it)
    (plain / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    compress_dir(plain, root / "z")
    return request.param, plain, root / "z"


def test_compressed_model_gives_identical_tokens_and_logits(bf16_pair):
    name, plain, packed = bf16_pair
    prompts = [[(7 * j + 31 * i) % 390 + 3 for j in range(n)] for i, n in enumerate((5, 40))]
    dirs = [plain, packed]
    if name in ("llama3", "qwen3_moe"):  # (and through the other coder)
        compress_dir(plain, packed.parent / "rans", chunk=1 << 14, coder="rans")
        dirs.append(packed.parent / "rans")
        assert any(e.codec in compressed.RANS_CODECS for e in compressed.read_manifest(dirs[-1]).values())
    outs = []
    for d in dirs:
        engine = make_engine(d, dtype="bfloat16")
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3))
        outs.append(drain(engine))
    for out in outs[1:]:
        for rid in outs[0]:
            assert outs[0][rid].token_ids == out[rid].token_ids, name
            assert outs[0][rid].logprobs == out[rid].logprobs, name  # the same floats, not close ones


def test_splitfire_compress_cli(tmp_path, capsys):
    from splitfire_cli import main

    src = tmp_path / "m"
    src.mkdir()
    save_file({"w": (torch.randn(256, 256) * 0.02).to(torch.bfloat16)}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    assert main(["compress", str(src), str(tmp_path / "z")]) == 0
    out = capsys.readouterr().out
    assert "bfloat16:" in out and "entropy bound" in out
    assert compressed.MANIFEST in {p.name for p in (tmp_path / "z").iterdir()}
    with pytest.raises(ModelLoadError, match="already compressed"):
        compress_dir(tmp_path / "z", tmp_path / "zz")
    with pytest.raises(ModelLoadError, match="another directory"):
        compress_dir(src, src / ".")
    assert main(["compress", str(src), str(src)]) != 0 and "another directory" in capsys.readouterr().err


def test_crc32_combine_equals_zlib_over_the_joined_bytes():
    """A tensor's CRC is combined from its chunks' (computed where each was decoded): zlib is the reference."""
    import os
    import zlib

    from engine.loading.compressed import crc32_combine

    for la, lb in [(0, 5), (7, 0), (1, 1), (1000, 2**21), (2**20 + 3, 77)]:
        a, b = os.urandom(la), os.urandom(lb)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b), (la, lb)


def test_byte_counts_equal_numpys():
    from engine.loading.byte_counts import count_bytes

    rng = np.random.default_rng(3)
    for data in (np.zeros(0, np.uint8), np.full(7, 200, np.uint8), rng.integers(0, 256, 100_003, dtype=np.uint8),
                 (rng.standard_normal(70_001) * 3).astype(np.int64).clip(0, 255).astype(np.uint8)):
        assert np.array_equal(count_bytes(data), np.bincount(data, minlength=256))


def test_the_crc_kernel_equals_zlib():
    """`cpu_ops.c` sf_crc32 (carry-less-multiply folding where built with PCLMULQDQ, a table otherwise), which
    checks every decoded chunk, against zlib.crc32: lengths around its 16- and 64-byte steps, unaligned
    starts, a running CRC carried in; the portable build too."""
    import os
    import zlib

    from engine.model.kernels import cpu_ops

    lib = cpu_ops.library()
    if lib is None:
        pytest.skip("no C compiler: zlib computes every CRC")
    data = np.frombuffer(os.urandom((1 << 16) + 64), np.uint8)
    libs = [lib]
    if lib.sf_has_pclmul():  # (else the native build already is the table path)
        import tempfile
        from pathlib import Path

        libs.append(cpu_ops.build(cpu_ops.BASELINE, Path(tempfile.mkdtemp())))
    for n in (0, 1, 15, 16, 17, 63, 64, 65, 79, 80, 127, 128, 129, 1000, 4097, 1 << 16):
        for start in (0, 1, 7, 16):
            part = data[start : start + n]
            for crc in (0, 0xDEADBEEF):
                want = zlib.crc32(part, crc)
                for one in libs:
                    assert one.sf_crc32(part.ctypes.data, part.size, crc) == want, (n, start, crc)
    assert compressed.crc32(data) == zlib.crc32(data) and compressed.crc32(data[3:], 5) == zlib.crc32(data[3:], 5)
