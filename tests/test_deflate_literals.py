"""The exponent planes' DEFLATE codec (`engine/loading/deflate_literals.py`, `cpu_ops.c`
sf_deflate_literals / sf_inflate_literals) against zlib, the reference both ways: zlib reads every stream
`encode` writes, the C decoder reads every stream zlib writes (Huffman-only: several dynamic blocks, stored
and fixed-code blocks) to the same bytes, streams with LZ77 matches go to zlib, and corrupted streams
never give wrong bytes silently or touch memory outside their buffers."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from engine.loading import deflate_literals as dl
from engine.model.kernels import cpu_ops

rng = np.random.default_rng(0)


def exponents(n: int, std: float) -> np.ndarray:
    u = torch.from_numpy((rng.standard_normal(n) * std).astype(np.float32)).to(torch.bfloat16).view(torch.int16)
    return ((u.numpy().view(np.uint16) >> 7) & 0xFF).astype(np.uint8)


SAMPLES = {
    "normal-init exponents": exponents(1 << 18, 0.02),
    "wide exponents": exponents(1 << 16, 30.0) ^ exponents(1 << 16, 1e-3),
    "uniform bytes (stored blocks)": rng.integers(0, 256, 70_000, dtype=np.uint8),
    "one symbol": np.full(5000, 7, np.uint8),
    "two symbols": rng.integers(0, 2, 100_000, dtype=np.uint8),
    "a few bytes (fixed codes)": np.array([5, 6, 5, 9], np.uint8),
    "15-bit codes": np.minimum(rng.geometric(0.55, 400_000), 255).astype(np.uint8),
}


def zlib_huffman(data: np.ndarray, strategy: int = zlib.Z_HUFFMAN_ONLY) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15, 9, strategy)
    return c.compress(data.tobytes()) + c.flush()


def c_decode(coded: bytes, n: int) -> int:
    """The C decoder's own answer: bytes written, or a negative SF_INF_* (no zlib fallback)."""
    lib = cpu_ops.library()
    out = np.empty(max(n, 1), np.uint8)
    src = np.frombuffer(coded, np.uint8) if coded else np.zeros(1, np.uint8)
    rc = lib.sf_inflate_literals(src.ctypes.data, len(coded), out.ctypes.data, n)
    if rc == n:
        c_decode.last = out[:n]  # type: ignore[attr-defined]
    return rc


@pytest.fixture(autouse=True)
def _kernels():
    if cpu_ops.library() is None:
        pytest.skip("no C compiler: the codec is zlib alone")


@pytest.mark.parametrize("name", SAMPLES)
def test_zlib_reads_what_encode_writes_and_so_does_the_c_decoder(name):
    data = SAMPLES[name]
    coded = dl.encode(data)
    assert zlib.decompress(coded, -15) == data.tobytes()
    assert c_decode(coded, data.size) == data.size and np.array_equal(c_decode.last, data)  # type: ignore[attr-defined]
    assert np.array_equal(dl.decode(coded, data.size), data)
    # one block with the chunk's own code: no larger than zlib's Huffman-only blocks (a few header bytes)
    assert len(coded) <= len(zlib_huffman(data)) + 64


@pytest.mark.parametrize("name", SAMPLES)
def test_the_c_decoder_reads_zlibs_huffman_only_streams(name):
    data = SAMPLES[name]
    coded = zlib_huffman(data)
    assert c_decode(coded, data.size) == data.size and np.array_equal(c_decode.last, data)  # type: ignore[attr-defined]


def test_code_lengths_stay_within_deflates_limit_and_match_zlibs_size():
    counts = np.array([2 ** i for i in range(24)] + [1] * 10, np.int64)  # a 33-bit-deep Huffman tree unbounded
    lens = dl.huffman_lengths(counts, 15)
    assert lens.max() == 15 and (2.0 ** -lens[lens > 0]).sum() <= 1.0  # a prefix code (Kraft)
    data = rng.permutation(np.repeat(np.arange(34, dtype=np.uint8), counts // 64 + 1))
    coded = dl.encode(data)
    assert zlib.decompress(coded, -15) == data.tobytes()
    assert c_decode(coded, data.size) == data.size and np.array_equal(c_decode.last, data)  # type: ignore[attr-defined]


def test_streams_with_lz77_matches_go_to_zlib():
    data = np.frombuffer(b"exponents repeat, exponents repeat, " * 200, np.uint8)
    coded = zlib_huffman(data, zlib.Z_DEFAULT_STRATEGY)
    assert c_decode(coded, data.size) == -2  # SF_INF_UNSUPPORTED
    assert np.array_equal(dl.decode(coded, data.size), data)


def test_a_wrong_length_or_corrupt_stream_is_an_error_never_wrong_bytes():
    data = SAMPLES["normal-init exponents"][:50_000]
    coded = bytearray(dl.encode(data))
    with pytest.raises(ValueError, match="not 49999"):
        dl.decode(bytes(coded), data.size - 1)
    assert c_decode(bytes(coded[: len(coded) // 2]), data.size) < 0  # truncated
    wrong = 0
    for _ in range(300):  # random flips: the C decoder either refuses, or agrees with zlib byte for byte
        bad = bytearray(coded)
        for _ in range(int(rng.integers(1, 4))):
            bad[int(rng.integers(0, len(bad)))] ^= 1 << int(rng.integers(0, 8))
        rc = c_decode(bytes(bad), data.size)
        try:
            ref = zlib.decompress(bytes(bad), -15)
        except zlib.error:
            ref = None
        if rc == data.size:
            assert ref is not None and ref == c_decode.last.tobytes()  # type: ignore[attr-defined]
            wrong += not np.array_equal(c_decode.last, data)  # type: ignore[attr-defined]
        else:  # refused: so does zlib (or it decodes to another length)
            assert ref is None or len(ref) != data.size, rc
    assert wrong < 300  # (a flip in a literal's code decodes to other literals: the tensor CRC catches those)


def c_decode_pair(a: bytes, na: int, b: bytes, nb: int) -> tuple[int, np.ndarray, np.ndarray]:
    lib = cpu_ops.library()
    oa, ob = np.empty(max(na, 1), np.uint8), np.empty(max(nb, 1), np.uint8)
    sa, sb = np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)
    rc = lib.sf_inflate_literals2(sa.ctypes.data, len(a), oa.ctypes.data, na, sb.ctypes.data, len(b), ob.ctypes.data,
                                  nb)
    return rc, oa[:na], ob[:nb]


@pytest.mark.parametrize("name", [n for n, d in SAMPLES.items() if d.size > 1])
def test_two_halves_with_one_code_decode_together_equal_zlib(name):
    """`encode_parts(data, 2)`: zlib reads each half; the two-stream C loop (codes longer than its table
    walked in the middle of the interleaved loop: "15-bit codes") gives the same bytes."""
    data = SAMPLES[name]
    (a, na), (b, nb) = dl.encode_parts(data, 2)
    assert na + nb == data.size and zlib.decompress(a, -15) + zlib.decompress(b, -15) == data.tobytes()
    rc, x, y = c_decode_pair(a, na, b, nb)
    assert rc == 0 and np.array_equal(np.concatenate([x, y]), data)
    x, y = dl.decode_pair(a, na, b, nb)
    assert np.array_equal(np.concatenate([x, y]), data)


def test_two_streams_that_do_not_share_a_code_are_decoded_one_by_one():
    one, other = SAMPLES["normal-init exponents"], SAMPLES["two symbols"]
    a, b = dl.encode(one), dl.encode(other)
    assert c_decode_pair(a, one.size, b, other.size)[0] < 0  # (different headers: not together)
    x, y = dl.decode_pair(a, one.size, b, other.size)
    assert np.array_equal(x, one) and np.array_equal(y, other)
    z = zlib_huffman(other)  # zlib's own, several blocks
    x, y = dl.decode_pair(a, one.size, z, other.size)
    assert np.array_equal(x, one) and np.array_equal(y, other)


def test_a_corrupt_half_is_an_error_never_wrong_bytes_in_the_pair_path():
    data = SAMPLES["normal-init exponents"][:80_000]
    (a, na), (b, nb) = dl.encode_parts(data, 2)
    for _ in range(200):
        bad = bytearray(b)
        bad[int(rng.integers(0, len(bad)))] ^= 1 << int(rng.integers(0, 8))
        rc, x, y = c_decode_pair(a, na, bytes(bad), nb)
        try:
            ref = zlib.decompress(bytes(bad), -15)
        except zlib.error:
            ref = None
        if rc == 0:
            assert np.array_equal(x, data[:na]) and ref == y.tobytes()
        else:
            assert rc < 0
    with pytest.raises((ValueError, zlib.error)):
        dl.decode_pair(a, na, b[: len(b) // 2], nb)
