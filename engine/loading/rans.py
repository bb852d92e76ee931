"""rANS — the other entropy coder `splitfire compress --coder rans` can code an exponent plane with
(`compressed.py`; Huffman, as DEFLATE, is the default): order 0, one static frequency table per chunk.

A Huffman code spends a whole number of bits on each symbol; an asymmetric numeral system (Duda's rANS)
spends fractions, so it can get closer to the order-0 entropy. The stream here is `LANES` = 32 interleaved
32-bit states with 16-bit renormalization, each lane with its own words (so the decoder steps them
a vector at a time, with no lane waiting on another), frequencies quantized to `BITS` = 12 bits (a 4,096-slot table that fits
L1). Layout, little-endian:

    u8 BITS, u8 LANES, u16 k, k x u8 symbols (ascending), k x u16 frequencies (summing to 1 << BITS),
    LANES x u32 initial decoder states, LANES x u32 word counts, then each lane's 16-bit words in the
    order the decoder reads them, lane 0's first.

Symbol i belongs to lane i % LANES. The encoder runs from the last symbol to the first, each lane's state
starting at `L` = 2^16; the decoder's lanes must end at `L` with every word read, or the stream is refused.
The C kernels (`cpu_ops.c` sf_rans_encode / sf_rans_decode) are the fast path; `encode_reference` and
`decode_reference` are the plain Python reading of the same format, and the tests hold the two equal.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np

from engine.loading.byte_counts import count_bytes

BITS = 12
LANES = 32
L = 1 << 16
M = 1 << BITS


def quantize(counts: np.ndarray) -> np.ndarray:
    """Frequencies (256, int64) summing to `M`, each present symbol at least 1, chosen greedily to cost
    the fewest bits for `counts`: scaled and floored, then one unit at a time added where it saves the most
    (or taken where it costs the least) until they sum to M."""
    counts = np.asarray(counts, np.int64)
    present = counts > 0
    if not present.any():
        return np.zeros(256, np.int64)
    f = np.where(present, np.maximum(1, counts * M // counts.sum()), 0).astype(np.int64)
    c = counts.astype(np.float64)
    while (diff := M - int(f.sum())) != 0:
        if diff > 0:  # the symbol whose one more unit saves the most bits
            gain = np.where(present, c * np.log2((f + 1) / np.maximum(f, 1)), -np.inf)
            f[int(np.argmax(gain))] += 1
        else:  # the one whose one less unit costs the least (never below 1)
            loss = np.where(f > 1, c * np.log2(np.maximum(f, 2) / np.maximum(f - 1, 1)), np.inf)
            f[int(np.argmin(loss))] -= 1
    return f


def coded_bits(counts: np.ndarray, freqs: np.ndarray) -> float:
    """Bits the symbols cost under `freqs` (what the words come to, within a few bytes per lane)."""
    live = counts > 0
    return float(-(counts[live] * np.log2(freqs[live] / M)).sum())


def _stream(freqs: np.ndarray, states: list[int], lanes: list[np.ndarray]) -> bytes:
    syms = np.flatnonzero(freqs)
    return b"".join([struct.pack("<BBH", BITS, LANES, len(syms)), syms.astype(np.uint8).tobytes(),
                     freqs[syms].astype("<u2").tobytes(), struct.pack(f"<{LANES}I", *states),
                     struct.pack(f"<{LANES}I", *(len(w) for w in lanes)), *(w.astype("<u2").tobytes() for w in lanes)])


def parse(coded: bytes) -> tuple[np.ndarray, list[int], list[int], np.ndarray]:
    """(frequencies (256, uint32), the lanes' initial states, their word counts, all the words) of a stream;
    ValueError for one whose header is not this format's."""
    if len(coded) < 4:
        raise ValueError("rANS stream shorter than its header")
    bits, lanes, k = struct.unpack_from("<BBH", coded)
    if bits != BITS or lanes != LANES or not 0 <= k <= 256:
        raise ValueError(f"rANS stream of {bits} bits, {lanes} lanes, {k} symbols: this build reads {BITS}/{LANES}")
    at = 4 + 3 * k + 8 * LANES
    if len(coded) < at:
        raise ValueError(f"rANS stream of {len(coded)} bytes does not hold its header")
    counts = list(struct.unpack_from(f"<{LANES}I", coded, at - 4 * LANES))
    if len(coded) != at + 2 * sum(counts):
        raise ValueError(f"rANS stream of {len(coded)} bytes does not hold its header and {sum(counts)} words")
    syms = np.frombuffer(coded, np.uint8, k, 4)
    if k > 1 and not (np.diff(syms.astype(np.int64)) > 0).all():
        raise ValueError("rANS stream's symbols are not ascending")
    freqs = np.zeros(256, np.uint32)
    freqs[syms] = np.frombuffer(coded, "<u2", k, 4 + k)
    if int(freqs.sum()) != (M if k else 0) or (freqs[syms] == 0).any():
        raise ValueError("rANS stream's frequencies do not sum to its scale")
    states = list(struct.unpack_from(f"<{LANES}I", coded, 4 + 3 * k))
    return freqs, states, counts, np.frombuffer(coded, "<u2", offset=at)


def _kernels(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    from engine.model.kernels import cpu_ops

    return lib if lib is not None else cpu_ops.library()


def encode(data: np.ndarray, lib: ctypes.CDLL | None = None) -> bytes:
    """`data` (uint8) as one rANS stream: the C kernel (`lib`, default `cpu_ops.library()`) where it is
    built, else `encode_reference`."""
    lib = _kernels(lib)
    data = np.ascontiguousarray(data, np.uint8)
    if lib is None:
        return encode_reference(data)
    counts = count_bytes(data)
    freqs = quantize(counts)
    cum = np.concatenate([[0], np.cumsum(freqs)[:-1]]).astype(np.uint32)
    f32 = freqs.astype(np.uint32)
    cap = int(coded_bits(counts, freqs)) // (16 * LANES) + 64  # words per lane (a lane's share of the bound, and room)
    while True:
        words = np.empty(LANES * cap, np.uint16)
        states = np.empty(LANES, np.uint32)
        lens = np.empty(LANES, np.int64)
        rc = lib.sf_rans_encode(data.ctypes.data, data.size, f32.ctypes.data, cum.ctypes.data, words.ctypes.data, cap,
                                states.ctypes.data, lens.ctypes.data)
        if rc == 0:
            break
        if rc != -1:
            raise RuntimeError(f"sf_rans_encode returned {rc} for {data.size} symbols")
        cap *= 2  # (a lane whose symbols were rarer than the whole's: more room)
    return _stream(freqs, states.tolist(), [words[(j + 1) * cap - k : (j + 1) * cap] for j, k in enumerate(lens.tolist())])


def decode(coded: bytes, n: int, lib: ctypes.CDLL | None = None) -> np.ndarray:
    """The `n` symbols a stream holds (ValueError if it does not hold exactly that): the C kernel (`lib`,
    default `cpu_ops.library()`; AVX2 where built for it) where it is built, else `decode_reference`."""
    lib = _kernels(lib)
    if lib is None:
        return decode_reference(coded, n)
    freqs, states, counts, words = parse(coded)
    if not freqs.any():  # (no symbols: what an empty input encodes to)
        if n or words.size or any(v != L for v in states):
            raise ValueError(f"rANS stream of no symbols does not hold {n}")
        return np.empty(0, np.uint8)
    st = np.array(states, np.uint32)
    lens = np.array(counts, np.int64)
    padded = np.zeros(words.size + 2, np.uint16)  # (the decoder reads past each lane's last word; the AVX2 path 4 bytes)
    padded[: words.size] = words
    out = np.empty(n, np.uint8)
    rc = lib.sf_rans_decode(freqs.ctypes.data, st.ctypes.data, padded.ctypes.data, lens.ctypes.data, out.ctypes.data, n)
    if rc != 0:
        raise ValueError(f"rANS stream does not hold {n} symbols (sf_rans_decode: {rc})")
    return out


# -- the plain reference ----------------------------------------------------------------------


def encode_reference(data: np.ndarray) -> bytes:
    counts = np.bincount(np.asarray(data, np.uint8), minlength=256)
    freqs = quantize(counts)
    cum = [0] * 256
    for s in range(1, 256):
        cum[s] = cum[s - 1] + int(freqs[s - 1])
    x = [L] * LANES
    out: list[list[int]] = [[] for _ in range(LANES)]
    for i in range(len(data) - 1, -1, -1):
        s, j = int(data[i]), i % LANES
        f = int(freqs[s])
        if x[j] >= ((L >> BITS) << 16) * f:
            out[j].append(x[j] & 0xFFFF)
            x[j] >>= 16
        x[j] = (x[j] // f << BITS) + x[j] % f + cum[s]
    return _stream(freqs, x, [np.array(w[::-1], np.uint16) for w in out])


def decode_reference(coded: bytes, n: int) -> np.ndarray:
    freqs, x, counts, words = parse(coded)
    if not freqs.any() and n:
        raise ValueError(f"rANS stream of no symbols does not hold {n}")
    starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    p, end = starts[:-1], starts[1:]
    cum = np.concatenate([[0], np.cumsum(freqs.astype(np.int64))]).tolist()
    slot_sym = np.repeat(np.arange(256), freqs.astype(np.int64)).tolist()
    out = np.empty(n, np.uint8)
    for i in range(n):
        j = i % LANES
        slot = x[j] & (M - 1)
        s = slot_sym[slot]
        out[i] = s
        x[j] = int(freqs[s]) * (x[j] >> BITS) + slot - cum[s]
        if x[j] < L:
            if p[j] >= end[j]:
                raise ValueError(f"rANS stream's lane {j} ran out of words at symbol {i} of {n}")
            x[j] = (x[j] << 16) | int(words[p[j]])
            p[j] += 1
    if p != end or any(v != L for v in x):
        raise ValueError(f"rANS stream does not hold {n} symbols (words or states left over)")
    return out
