"""The rANS exponent coder (`engine/loading/rans.py`, `cpu_ops.c` sf_rans_encode / sf_rans_decode): the C
kernels write the plain reference's bytes and read back what it reads — the AVX2 decoder and the portable
one both — over skewed, uniform, one-symbol and short inputs; the frequencies cost what the order-0 bound
says within a fraction of a percent; corrupted streams are refused or read exactly as the reference reads
them, never past their buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.loading import compressed, rans
from engine.model.kernels import cpu_ops

rng = np.random.default_rng(1)


def exponents(n: int, std: float) -> np.ndarray:
    u = torch.from_numpy((rng.standard_normal(n) * std).astype(np.float32)).to(torch.bfloat16).view(torch.int16)
    return ((u.numpy().view(np.uint16) >> 7) & 0xFF).astype(np.uint8)


SAMPLES = {
    "normal-init exponents": exponents(20_011, 0.02),
    "wide exponents (rare symbols)": exponents(9_000, 30.0) ^ exponents(9_000, 1e-3),
    "uniform bytes": rng.integers(0, 256, 7_001, dtype=np.uint8),
    "one symbol": np.full(5_000, 7, np.uint8),
    "two symbols, skewed": (rng.random(6_000) < 0.002).astype(np.uint8),
    "shorter than the lanes": np.array([5, 6, 5, 9, 200], np.uint8),
    "empty": np.zeros(0, np.uint8),
}


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """This machine's build (AVX2 where it has it) and the portable one (-march=x86-64: the scalar loop)."""
    native = cpu_ops.library()
    if native is None:
        pytest.skip("no C compiler: the reference is the only path")
    return {"native": native, "portable": cpu_ops.build(cpu_ops.BASELINE, tmp_path_factory.mktemp("baseline"))}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_the_kernels_write_and_read_what_the_reference_does(name, kernels):
    data = SAMPLES[name]
    ref = rans.encode_reference(data)
    assert np.array_equal(rans.decode_reference(ref, data.size), data)
    for which, lib in kernels.items():
        assert rans.encode(data, lib) == ref, which  # byte for byte
        assert np.array_equal(rans.decode(ref, data.size, lib), data), which


def test_a_large_plane_round_trips_near_the_entropy_bound(kernels):
    exp = exponents(1 << 20, 0.02)
    coded = rans.encode(exp, kernels["native"])
    for lib in kernels.values():
        assert np.array_equal(rans.decode(coded, exp.size, lib), exp)
    bits = 8 * len(coded) / exp.size
    bound = compressed.entropy_bits(exp)
    assert bound <= bits < bound * 1.005  # (12-bit frequencies, 32 lanes' headers: within half a percent)
    with pytest.raises(ValueError):
        rans.decode(coded, exp.size + 1, kernels["native"])  # not the count it holds
    with pytest.raises(ValueError):
        rans.decode(coded, exp.size - 32, kernels["native"])


def test_quantized_frequencies_sum_to_the_scale_and_keep_every_symbol():
    for counts in (np.bincount(SAMPLES["wide exponents (rare symbols)"], minlength=256),
                   np.ones(256, np.int64), np.eye(256, dtype=np.int64)[3] * 10**9,
                   np.r_[np.full(255, 1), 10**12]):
        f = rans.quantize(counts)
        assert f.sum() == rans.M and ((f > 0) == (counts > 0)).all()


def test_corrupted_streams_are_refused_or_read_as_the_reference_reads_them(kernels):
    data = SAMPLES["wide exponents (rare symbols)"][:3_000]
    good = rans.encode(data, kernels["native"])
    _, _, counts, _ = rans.parse(good)
    words_at = len(good) - 2 * sum(counts)
    refused = 0
    for trial in range(150):
        bad = bytearray(good)
        for _ in range(1 + trial % 3):
            at = int(rng.integers(words_at - 4 * rans.LANES if trial % 5 == 0 else words_at, len(bad)))
            bad[at] ^= 1 << int(rng.integers(8))
        try:
            want = rans.decode_reference(bytes(bad), data.size)
        except ValueError:
            want = None
        for which, lib in kernels.items():
            if want is None:
                with pytest.raises(ValueError):
                    rans.decode(bytes(bad), data.size, lib)
            else:
                assert np.array_equal(rans.decode(bytes(bad), data.size, lib), want), (trial, which)
        refused += want is None
    assert refused > 100  # (a flipped bit almost always leaves a lane off its end state or its words)
    for cut in (0, 3, words_at - 1, len(good) - 1):
        with pytest.raises(ValueError):
            rans.decode(good[:cut], data.size, kernels["native"])
