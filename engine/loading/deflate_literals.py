"""Raw DEFLATE streams of literals only — how compressed.py codes an exponent plane — written and read
fast, with zlib as the plain reference on both sides.

zlib's own Huffman-only mode (`Z_HUFFMAN_ONLY`) starts a new block, with a new code and header, every
~32K symbols, and its inflate (~0.35 GB/s of symbols per core here) is a general LZ77 decoder. An
exponent plane's distribution does not change along a tensor, so `encode` writes one block per chunk:
the code built from the chunk's own counts (a Huffman code limited to DEFLATE's 15 bits), the header in
Python, the symbols in C (`cpu_ops.c` sf_deflate_literals). `decode` (`sf_inflate_literals`) reads any raw
DEFLATE stream of literals, table first (up to six literals per lookup); streams it does not take (a
length/distance pair, a corrupt one) go to zlib, which decides. A chunk is written as two such streams with
one code (`encode_parts`), which `decode_pair` reads together, their lookups interleaved. The output is ordinary DEFLATE: zlib
reads what `encode` writes, and the tests hold `decode` equal to zlib on both kinds of stream.
"""

from __future__ import annotations

import heapq
import zlib

import numpy as np

from engine.loading.byte_counts import count_bytes

EOB = 256
_ORDER = (16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15)


def huffman_lengths(counts: np.ndarray, limit: int) -> np.ndarray:
    """Code lengths of a Huffman code for `counts` (symbols counted zero get none), none longer than
    `limit`: counts are halved (rounding up) until the code fits, which costs a fraction of a percent on
    the rare distributions that need it."""
    counts = counts.astype(np.int64)
    while True:
        lens = _huffman(counts)
        if lens.max(initial=0) <= limit:
            return lens
        counts = np.where(counts > 0, (counts + 1) // 2, 0)


def _huffman(counts: np.ndarray) -> np.ndarray:
    lens = np.zeros(len(counts), np.int64)
    live = [int(s) for s in np.flatnonzero(counts)]
    if len(live) == 1:
        lens[live[0]] = 1
        return lens
    heap = [(int(counts[s]), s, [s]) for s in live]
    heapq.heapify(heap)
    while len(heap) > 1:
        a, ka, sa = heapq.heappop(heap)
        b, kb, sb = heapq.heappop(heap)
        for s in sa + sb:
            lens[s] += 1
        heapq.heappush(heap, (a + b, min(ka, kb), sa + sb))
    return lens


def canonical_codes(lens: np.ndarray) -> np.ndarray:
    """Each symbol's canonical code (RFC 1951 3.2.2), bit-reversed: DEFLATE sends a code's first bit first."""
    lens = lens.astype(np.int64)
    count = np.bincount(lens, minlength=16)
    count[0] = 0
    nxt, code = [0] * 16, 0
    for n in range(1, 16):
        code = (code + int(count[n - 1])) << 1
        nxt[n] = code
    out = np.zeros(len(lens), np.uint16)
    for s, n in enumerate(lens.tolist()):
        if n:
            c, nxt[n] = nxt[n], nxt[n] + 1
            out[s] = int(f"{c:0{n}b}"[::-1], 2)
    return out


class _Bits:
    def __init__(self) -> None:
        self.value = 0
        self.count = 0

    def put(self, v: int, n: int) -> None:
        self.value |= v << self.count
        self.count += n

    def put_code(self, code: np.ndarray, lens: np.ndarray, s: int) -> None:
        self.put(int(code[s]), int(lens[s]))


def _runs(lens: list[int]) -> list[tuple[int, int, int]]:
    """The code lengths as code-length symbols: (symbol, extra bits' value, extra bits)."""
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(lens):
        v, j = lens[i], i
        while j < len(lens) and lens[j] == v:
            j += 1
        run = j - i
        if v == 0:
            while run >= 11:
                k = min(run, 138)
                out.append((18, k - 11, 7))
                run -= k
            if run >= 3:
                out.append((17, run - 3, 3))
                run = 0
            out.extend((0, 0, 0) for _ in range(run))
        else:
            out.append((v, 0, 0))
            run -= 1
            while run >= 3:
                k = min(run, 6)
                out.append((16, k - 3, 2))
                run -= k
            out.extend((v, 0, 0) for _ in range(run))
        i = j
    return out


def block_header(lens: np.ndarray) -> _Bits:
    """A final dynamic-Huffman block's header for literal/end-of-block code lengths `lens` (257), with
    one distance code of one bit (RFC 1951 allows it; nothing uses it)."""
    runs = _runs([int(x) for x in lens] + [1])
    cl_counts = np.bincount([s for s, _, _ in runs], minlength=19)
    cl_lens = huffman_lengths(cl_counts, 7)
    cl_codes = canonical_codes(cl_lens)
    ncode = 19
    while ncode > 4 and cl_lens[_ORDER[ncode - 1]] == 0:
        ncode -= 1
    b = _Bits()
    b.put(1, 1)  # BFINAL
    b.put(2, 2)  # dynamic Huffman codes
    b.put(len(lens) - 257, 5)
    b.put(0, 5)  # one distance code
    b.put(ncode - 4, 4)
    for s in _ORDER[:ncode]:
        b.put(int(cl_lens[s]), 3)
    for s, extra, n in runs:
        b.put_code(cl_codes, cl_lens, s)
        if n:
            b.put(extra, n)
    return b


def encode(data: np.ndarray) -> bytes:
    """`data` (uint8) as one raw DEFLATE block of literals; zlib's Huffman-only deflate without the C kernels."""
    return encode_parts(data, 1)[0][0]


def encode_parts(data: np.ndarray, parts: int) -> list[tuple[bytes, int]]:
    """`data` cut into `parts` near-equal pieces, each its own raw DEFLATE stream of one block, all with the
    code of `data`'s counts (the same header): (stream, bytes it holds) each. `decode_pair` reads two such
    streams together."""
    from engine.model.kernels import cpu_ops

    lib = cpu_ops.library()
    pieces = [np.ascontiguousarray(data[i * data.size // parts : (i + 1) * data.size // parts]) for i in range(parts)]
    if lib is None or not data.size:
        out = []
        for p in pieces:
            c = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
            out.append((c.compress(p.tobytes()) + c.flush(), p.size))
        return out
    counts = np.append(count_bytes(data), 1)  # (257: the end-of-block symbol once)
    lens = huffman_lengths(counts, 15)
    codes = canonical_codes(lens)
    header = block_header(lens)
    head = header.value.to_bytes((header.count + 7) // 8 or 1, "little")
    lens8 = lens.astype(np.uint8)
    streams = []
    for p in pieces:
        cap = len(head) + (int((count_bytes(p) * lens[:256]).sum()) + int(lens[EOB]) + 7) // 8 + 8
        out = np.zeros(cap, np.uint8)
        out[: len(head)] = np.frombuffer(head, np.uint8)
        n = lib.sf_deflate_literals(p.ctypes.data, p.size, codes.ctypes.data, lens8.ctypes.data, out.ctypes.data,
                                    cap, header.count)
        if n < 0:
            raise RuntimeError(f"sf_deflate_literals: {cap} bytes were too few")  # (cap is the exact size + 8)
        streams.append((out[:n].tobytes(), p.size))
    return streams


def decode(coded: bytes, n: int) -> np.ndarray:
    """The `n` bytes a raw DEFLATE stream holds (ValueError or zlib.error if it does not hold exactly that)."""
    from engine.model.kernels import cpu_ops

    lib = cpu_ops.library()
    if lib is not None and n:
        out = np.empty(n, np.uint8)
        src = np.frombuffer(coded, np.uint8)
        if lib.sf_inflate_literals(src.ctypes.data, len(coded), out.ctypes.data, n) == n:
            return out
    got = np.frombuffer(zlib.decompress(coded, -15), np.uint8)  # (an LZ77 or a corrupt stream: zlib decides)
    if got.size != n:
        raise ValueError(f"decoded to {got.size} bytes, not {n}")
    return got


def decode_pair(a: bytes, na: int, b: bytes, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """Two streams at once (`sf_inflate_literals2`: one table, lookups interleaved) when they are single
    blocks with the same code (`encode_parts`); else, or if either is not what it should be, `decode` each."""
    from engine.model.kernels import cpu_ops

    lib = cpu_ops.library()
    if lib is not None and na and nb and a and b:
        oa, ob = np.empty(na, np.uint8), np.empty(nb, np.uint8)
        sa, sb = np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)
        if lib.sf_inflate_literals2(sa.ctypes.data, len(a), oa.ctypes.data, na, sb.ctypes.data, len(b),
                                    ob.ctypes.data, nb) == 0:
            return oa, ob
    return decode(a, na), decode(b, nb)
