"""Lossless weight compression: bfloat16 (and float16) tensors stored as a raw sign+mantissa plane and an
entropy-coded exponent plane, decoded bit-exact at load.

A bfloat16 weight is 1 sign bit, 8 exponent bits and 7 mantissa bits. Trained weights use a handful of
exponents (a few bits of entropy where 8 are stored) while sign and mantissa are close to uniform, so
only the exponents are worth coding (DFloat11's observation). Here each tensor becomes

- the **sign+mantissa plane**: one byte per weight (bfloat16: sign << 7 | mantissa), stored as is;
- the **exponent plane**: one byte per weight, entropy-coded in chunks of `CHUNK` weights, each decodable
  on its own, so a load decodes chunks on several threads. The coder (`CODERS`) is Huffman by default:
  raw DEFLATE of literals only (no LZ77 matching: `deflate_literals.py`, one block and code per chunk,
  written and read by C kernels with zlib as the reference and fallback); or rANS (`rans.py`,
  `splitfire compress --coder rans`), 0.4-2.4% fewer bytes and no faster to decode here
  (README: Lossless weight compression).

float16 (5 exponent bits) splits at the byte instead: its high byte (sign, exponent, 2 mantissa bits) is
the coded plane and its low byte the raw one.

Every other tensor (float32, integers, FP8, quantized codes) is stored as is. `splitfire compress
MODEL_DIR OUT_DIR` (`compress.py`) writes `weights-NNNNN.sfz` data files and `splitfire_compressed.json` (the
manifest: per tensor its dtype, shape, codec, byte ranges and the CRC-32 of its original bytes) beside
copies of the model's other files; `engine/loading/checkpoint.Checkpoint` reads such a directory like
a safetensors one. A chunk that fails to decode or a tensor whose CRC does not match is a
`ModelLoadError` naming the tensor: never wrong weights.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from common.errors import ModelLoadError
from engine.loading import deflate_literals, rans
from engine.loading.byte_counts import count_bytes

MANIFEST = "splitfire_compressed.json"
FORMAT = 1
CHUNK = 1 << 20  # weights per exponent chunk
SMALL_CHUNK = 1 << 14  # fewer exponents than this: one stream from zlib's Huffman-only deflate
CODEC_BF16 = "bf16-exponent-huffman"
CODEC_F16 = "f16-exponent-huffman"
CODEC_BF16_RANS = "bf16-exponent-rans"
CODEC_F16_RANS = "f16-exponent-rans"
CODEC_RAW = "raw"
# coder -> {dtype: codec}
CODERS = {"huffman": {torch.bfloat16: CODEC_BF16, torch.float16: CODEC_F16},
          "rans": {torch.bfloat16: CODEC_BF16_RANS, torch.float16: CODEC_F16_RANS}}
BF16_CODECS = (CODEC_BF16, CODEC_BF16_RANS)
RANS_CODECS = (CODEC_BF16_RANS, CODEC_F16_RANS)
_THREADS = 4
T = TypeVar("T")


@dataclass
class Entry:
    name: str
    dtype: str  # a checkpoint.DTYPES key
    shape: list[int]
    codec: str
    file: str
    plane: list[int]  # [offset, length] of the raw plane (the whole tensor for "raw")
    # [offset, length, weights, CRC-32 of its weights' bytes] per exponent chunk (the CRC: from this build on)
    chunks: list[list[int]] = field(default_factory=list)
    crc32: int = 0  # of the original tensor's bytes

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# -- planes -----------------------------------------------------------------------------------


def split(u: np.ndarray, codec: str) -> tuple[np.ndarray, np.ndarray]:
    """(raw plane, exponent plane) of uint16 bit patterns: the C kernel (`cpu_ops.c` sf_split16, one pass)
    where it is built, else `split_reference`; a test holds the two equal over every 16-bit pattern."""
    from engine.model.kernels import cpu_ops

    lib = cpu_ops.library()
    if lib is None:
        return split_reference(u, codec)
    u = np.ascontiguousarray(u, np.uint16)
    raw, coded = np.empty(u.size, np.uint8), np.empty(u.size, np.uint8)
    lib.sf_split16(u.ctypes.data, raw.ctypes.data, coded.ctypes.data, u.size, int(codec in BF16_CODECS))
    return raw.reshape(u.shape), coded.reshape(u.shape)


def split_reference(u: np.ndarray, codec: str) -> tuple[np.ndarray, np.ndarray]:
    """`split` in numpy (the plain reference)."""
    if codec in BF16_CODECS:
        return (((u >> 8) & 0x80) | (u & 0x7F)).astype(np.uint8), ((u >> 7) & 0xFF).astype(np.uint8)
    return (u & 0xFF).astype(np.uint8), (u >> 8).astype(np.uint8)


def join(plane: np.ndarray, exp: np.ndarray, codec: str, out: np.ndarray) -> None:
    """The uint16 bit patterns back into `out`: the C kernel (`cpu_ops.c` sf_join16, one pass) where it is
    built, else `join_reference`; a test holds the two equal over every 16-bit pattern."""
    from engine.model.kernels import cpu_ops

    lib = cpu_ops.library()
    if lib is None or not (plane.flags.c_contiguous and exp.flags.c_contiguous and out.flags.c_contiguous):
        join_reference(plane, exp, codec, out)
        return
    lib.sf_join16(plane.ctypes.data, exp.ctypes.data, out.ctypes.data, out.size, int(codec in BF16_CODECS))


def crc32(buf: np.ndarray, crc: int = 0) -> int:
    """zlib.crc32(buf, crc) of a contiguous array: the C kernel's carry-less-multiply folding (`cpu_ops.c`
    sf_crc32, ~2x zlib's speed here) where it was built with PCLMULQDQ, else zlib itself — the reference, which
    a test holds it equal to over lengths, alignments and starting values."""
    from engine.model.kernels import cpu_ops

    lib = cpu_ops.library()
    if lib is None or not lib.sf_has_pclmul() or not buf.flags.c_contiguous or buf.nbytes < 4096:
        return zlib.crc32(buf, crc)
    return int(lib.sf_crc32(buf.ctypes.data, buf.nbytes, crc))


def join_reference(plane: np.ndarray, exp: np.ndarray, codec: str, out: np.ndarray) -> None:
    """`split`'s inverse in numpy (the plain reference)."""
    if codec in BF16_CODECS:
        sm = plane.astype(np.uint16)
        np.bitwise_or((sm & 0x80) << 8, exp.astype(np.uint16) << 7, out=out)
        out |= sm & 0x7F
    else:
        np.bitwise_or(plane.astype(np.uint16), exp.astype(np.uint16) << 8, out=out)


def encode_chunk(exp: np.ndarray, codec: str = CODEC_BF16) -> list[tuple[bytes, int]]:
    """(stream, exponents) of each stream a chunk is written as. Huffman: raw DEFLATE, literals only (the
    exponents' order-0 entropy is what there is to take), the chunk's two halves as two streams with one
    code — a load decodes them together. rANS: one stream (its 32 lanes are decoded together)."""
    if codec in RANS_CODECS:
        return [(rans.encode(exp), exp.size)]
    if exp.size < SMALL_CHUNK:  # (a code and header built in Python cost more than zlib's whole encode here)
        c = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
        return [(c.compress(exp.tobytes()) + c.flush(), exp.size)]
    return deflate_literals.encode_parts(exp, 2)


def entropy_bits(exp: np.ndarray) -> float:
    """Order-0 entropy of the exponent symbols, bits per weight: the bound any per-symbol coder meets."""
    counts = count_bytes(exp).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


# -- reading ----------------------------------------------------------------------------------


def read_manifest(model_dir: Path) -> dict[str, Entry]:
    path = model_dir / MANIFEST
    try:
        d = json.loads(path.read_text())
        if d.get("format") != FORMAT:
            raise ModelLoadError(f"{path}: compressed format {d.get('format')!r}; this build reads {FORMAT}")
        entries = {t["name"]: Entry(**t) for t in d["tensors"]}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: not a readable compressed-weights manifest: {e}") from e
    for e in entries.values():
        if not (model_dir / e.file).is_file():
            raise ModelLoadError(f"{model_dir}: data file {e.file} of tensor {e.name!r} is missing")
    return entries


_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    """One pool for every tensor's chunks (a pool per tensor cost more than small tensors' decoding)."""
    if not _POOL or _POOL[0]._max_workers != _THREADS:
        _POOL[:] = [ThreadPoolExecutor(_THREADS, thread_name_prefix="sf-decode")]
    return _POOL[0]


def _pages(size: int) -> mmap.mmap:
    """Private anonymous pages (not shared: those are shmem-backed, slower to fault in)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


_SCRATCH = threading.local()


def _scratch(size: int) -> mmap.mmap:
    """This thread's reusable direct-read buffer, grown (to a power of two) when `size` needs more."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < size:
        buf = _SCRATCH.buf = _pages(1 << max(20, (size - 1).bit_length()))
    return buf


class DataFile:
    """Positional reads of one data file, safe from several threads. `direct`: O_DIRECT, past the page cache
    (every byte from the device: what a cold load reads; offsets and lengths widened to the alignment).

    A direct read of up to `SCRATCH_MAX` bytes lands in its thread's scratch buffer, reused read after read
    (a fresh buffer per read cost page faults, zeroing and unmapping — TLB shootdowns across the decoding
    threads — ~9% of a cold load's CPU): what it returns is valid until that thread's next direct read,
    which is how the decoder uses it (copied, or joined, before the next read)."""

    ALIGN = 4096
    SCRATCH_MAX = 64 << 20

    def __init__(self, path: Path, direct: bool = False):
        self.path, self.direct = path, direct
        self.fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))

    def read(self, offset: int, length: int) -> memoryview:
        if not self.direct:
            data = os.pread(self.fd, length, offset)
            if len(data) != length:
                raise EOFError(f"{length - len(data)} bytes short at offset {offset}")
            return memoryview(data)
        a = self.ALIGN
        first, end = offset // a * a, -(-(offset + length) // a) * a
        size = max(end - first, a)
        buf = _scratch(size) if size <= self.SCRATCH_MAX else _pages(size)  # (page-aligned, as O_DIRECT wants)
        got = os.preadv(self.fd, [memoryview(buf)[:size]], first)
        if got < offset + length - first:
            raise EOFError(f"{offset + length - first - got} bytes short at offset {offset}")
        return memoryview(buf)[offset - first : offset - first + length]

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> DataFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _layout(e: Entry) -> tuple[list[list[int]], list[int]]:
    """(the groups of chunks decoded together — a Huffman chunk's two streams are read as a pair, a rANS
    chunk alone —, each chunk's first weight and the end), the entry's shape checked."""
    if e.codec not in (CODEC_BF16, CODEC_F16, *RANS_CODECS):
        raise ModelLoadError(f"tensor {e.name!r}: unknown codec {e.codec!r}")
    starts = np.cumsum([0] + [c[2] for c in e.chunks]).tolist()
    if starts[-1] != e.numel or e.plane[1] != e.numel:
        raise ValueError(f"chunks of {starts[-1]} weights and a plane of {e.plane[1]} bytes for {e.numel} weights")
    step = 1 if e.codec in RANS_CODECS else 2
    return [list(range(g, min(g + step, len(e.chunks)))) for g in range(0, len(e.chunks), step)], starts


def _each(fn: Callable[[list[int]], T], groups: list[list[int]]) -> list[T]:
    """`fn` over the groups: on the pool when there are several, here when one."""
    return list(map(fn, groups) if len(groups) <= 1 else _pool().map(fn, groups))


def _decode_chunks(f: DataFile, e: Entry, ids: list[int], starts: list[int], dst: np.ndarray) -> list[int]:
    """Chunks `ids` (consecutive) read, decoded and joined into `dst` (uint16: the weights from `starts[ids[0]]`
    on); the CRC-32 of each one's bytes, computed here while they are in cache, and checked against the chunk's
    own where the manifest has one. All of a tensor's chunks are read in one piece (its plane and chunks lie
    together): one request to the device, not three."""
    plane_at = e.plane[0]
    sizes = [e.chunks[i][2] for i in ids]
    read = f.read
    if len(ids) == len(e.chunks):
        at = min(plane_at, *(c[0] for c in e.chunks))
        end = max(plane_at + e.plane[1], *(c[0] + c[1] for c in e.chunks))
        whole = f.read(at, end - at)

        def read(offset: int, length: int) -> memoryview:
            return whole[offset - at : offset - at + length]

    coded = [bytes(read(e.chunks[i][0], e.chunks[i][1])) for i in ids]
    lo, hi = starts[ids[0]], starts[ids[-1]] + sizes[-1]
    plane = np.frombuffer(read(plane_at + lo, hi - lo), np.uint8)
    try:
        if e.codec in RANS_CODECS:
            exps = [rans.decode(c, n) for c, n in zip(coded, sizes, strict=True)]
        elif len(ids) == 2:
            exps = list(deflate_literals.decode_pair(coded[0], sizes[0], coded[1], sizes[1]))
        else:
            exps = [deflate_literals.decode(c, n) for c, n in zip(coded, sizes, strict=True)]
    except ValueError as err:
        raise ValueError(f"chunk {ids[0]}{'-' + str(ids[-1]) if len(ids) > 1 else ''}: {err}") from err
    crcs = []
    for i, n, exp in zip(ids, sizes, exps, strict=True):
        at = starts[i] - lo
        join(plane[at : at + n], exp, e.codec, dst[at : at + n])
        crcs.append(crc32(dst[at : at + n]))
        if len(e.chunks[i]) > 3 and crcs[-1] != e.chunks[i][3]:
            raise ValueError(f"chunk {i} fails its checksum")
    return crcs


def decode_into(model_dir: Path, e: Entry, out: torch.Tensor, direct: bool = False) -> None:
    """Fill `out` (contiguous, CPU, e's dtype and shape) with the tensor, checked against its CRC. Each pair
    of chunks is read and decoded by one task of the pool, so while one thread waits on the file's bytes
    another decodes (a cold load overlaps its reads with its decoding). `direct`: read with O_DIRECT."""
    dst = out.reshape(-1).view(torch.uint8).numpy() if out.numel() else np.zeros(0, np.uint8)
    try:
        with DataFile(model_dir / e.file, direct) as f:
            if e.codec == CODEC_RAW:
                dst[:] = np.frombuffer(f.read(*e.plane), np.uint8)
            else:
                groups, starts = _layout(e)
                u16 = dst.view(np.uint16)
                parts = _each(lambda ids: _decode_chunks(f, e, ids, starts, u16[starts[ids[0]] :]), groups)
                crcs = [c for part in parts for c in part]
                crc = crcs[0] if crcs else zlib.crc32(b"")
                for c, chunk_crc in zip(e.chunks[1:], crcs[1:], strict=True):
                    crc = crc32_combine(crc, chunk_crc, 2 * c[2])
    except (OSError, EOFError, ValueError, zlib.error) as err:
        raise ModelLoadError(f"{model_dir}: compressed tensor {e.name!r} is corrupt ({err})") from err
    if (crc32(dst) if e.codec == CODEC_RAW else crc) != e.crc32:
        raise ModelLoadError(f"{model_dir}: compressed tensor {e.name!r} fails its checksum: the data file is "
                             "corrupt (its weights were not used)")


def decodes_ranges(e: Entry) -> bool:
    """Whether a range of `e`'s weights can be decoded alone: a coded tensor whose chunks carry their own
    CRCs (manifests written before those decode whole, to check the tensor's)."""
    return e.codec != CODEC_RAW and all(len(c) > 3 for c in e.chunks)


def decode_range_into(model_dir: Path, e: Entry, lo: int, hi: int, out: torch.Tensor, direct: bool = False) -> None:
    """Weights [lo, hi) of the tensor (flat, row-major) into `out` (contiguous, hi - lo of e's dtype): only the
    chunks that hold them are read and decoded — a tensor-parallel rank's rows of a matrix cost its share of
    the decoding, not the whole tensor's — each checked against its own CRC (`decodes_ranges(e)` must hold)."""
    if not decodes_ranges(e):
        raise ValueError(f"tensor {e.name!r} has no per-chunk checksums: decode it whole")
    if not 0 <= lo <= hi <= e.numel or out.numel() != hi - lo:
        raise ValueError(f"weights [{lo}, {hi}) of tensor {e.name!r} ({e.numel}) into {out.numel()}")
    dst = out.reshape(-1).view(torch.int16).numpy().view(np.uint16) if out.numel() else np.zeros(0, np.uint16)
    try:
        with DataFile(model_dir / e.file, direct) as f:
            groups, starts = _layout(e)

            def one(ids: list[int]) -> None:
                a, b = starts[ids[0]], starts[ids[-1] + 1]
                if lo <= a and b <= hi:  # wholly inside: decoded in place
                    _decode_chunks(f, e, ids, starts, dst[a - lo :])
                    return
                tmp = np.empty(b - a, np.uint16)
                _decode_chunks(f, e, ids, starts, tmp)
                x, y = max(a, lo), min(b, hi)
                dst[x - lo : y - lo] = tmp[x - a : y - a]

            _each(one, [ids for ids in groups if starts[ids[0]] < hi and starts[ids[-1] + 1] > lo])
    except (OSError, EOFError, ValueError, zlib.error) as err:
        raise ModelLoadError(f"{model_dir}: compressed tensor {e.name!r} is corrupt ({err})") from err


def _gf2_times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_gf2_times(mat, mat[n]) for n in range(32))


@functools.lru_cache(maxsize=16)
def _crc_shift(nbytes: int) -> tuple[int, ...]:
    """The GF(2) operator that appends `nbytes` zero bytes to a CRC-32 register (zlib's crc32_combine)."""
    op = (0xEDB88320, *(1 << k for k in range(31)))  # one zero bit
    for _ in range(3):  # eight: one byte
        op = _gf2_square(op)
    out = tuple(1 << k for k in range(32))  # identity
    while nbytes:
        if nbytes & 1:
            out = tuple(_gf2_times(op, v) for v in out)
        nbytes >>= 1
        if nbytes:
            op = _gf2_square(op)
    return out


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc32(A), crc32(B) and len(B) (what zlib's crc32_combine computes; the stdlib
    module does not expose it). Chunks of one tensor share their length: its operator is built once."""
    return _gf2_times(_crc_shift(len2), crc1) ^ crc2


def fingerprint_parts(model_dir: Path) -> list[str]:
    """The weights' identity for `checkpoint.model_fingerprint`: each tensor's name, shape and CRC."""
    return [f"{e.name}:{e.dtype}:{e.shape}:{e.crc32}" for e in read_manifest(model_dir).values()]
