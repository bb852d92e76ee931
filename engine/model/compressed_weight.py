"""A bfloat16 matrix held losslessly compressed in device memory, for a matmul that decodes its tiles in
registers (`kernels/compressed_triton.py`) so the weights cross HBM at ~12 bits instead of 16.

The file format (`engine/loading/compressed.py`) Huffman-codes the exponents: close to their entropy, but
a variable-length code is decoded bit after bit, which a matmul tile cannot afford. In memory each weight
keeps its sign+mantissa byte (`plane`, as in the file) and a 4-bit code for its exponent: code c < 15
stands for exponent `base + c` — the band of 15 consecutive exponents that holds the most weights — and
15 is an escape. A trained or normal-initialized matrix's exponents sit in a narrow band, so escapes are
rare (none to a few hundred per million weights), and the whole is 0.75 of bfloat16 and a little more.

A tile decodes with integer operations only (no table, nothing data-dependent): an escape decodes to 0
there (so do the padding columns of the last run: their code is 15 too), and the escaped weights — kept
apart as (row, column, bfloat16 value), sorted by row with each row's first index in `esc_start` — are
added by the program that owns their rows, after its dense tile. (The first form looked 15 arbitrary
exponents up in a table and placed escapes tile by tile, ranked by a prefix sum in each tile: on an
H200 that matmul ran 25-170x slower than bfloat16.) `decompress` is the plain torch reference; `pack`
then `decompress` is bit-exact for every 16-bit pattern (NaN, Inf and subnormals included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.kernels import kernels

ESCAPE = 15


@dataclass
class CompressedBF16:
    plane: torch.Tensor  # uint8 [N, K]: sign << 7 | mantissa
    # uint8 [N, ceil(K / 32) * 16]: in each run of 32 columns, byte i holds column i's code (low nibble) and
    # column i + 16's (high): a tile's bytes are read contiguously and give two halves of 16-column runs.
    codes: torch.Tensor
    base: int  # the exponent of code 0 (code c < 15: exponent base + c)
    esc_rows: torch.Tensor  # int32 [E]: the escaped weights' rows (ascending),
    esc_cols: torch.Tensor  # int32 [E]: columns,
    esc_vals: torch.Tensor  # bfloat16 [E]: and values;
    esc_start: torch.Tensor  # int32 [N + 1]: row r's escapes are [esc_start[r], esc_start[r + 1])

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.plane.shape
        return int(n), int(k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.plane, self.codes, self.esc_rows, self.esc_cols,
                                                           self.esc_vals, self.esc_start))

    @property
    def num_escapes(self) -> int:
        return int(self.esc_vals.numel())

    def to(self, device: torch.device) -> CompressedBF16:
        return CompressedBF16(self.plane.to(device), self.codes.to(device), self.base, self.esc_rows.to(device),
                              self.esc_cols.to(device), self.esc_vals.to(device), self.esc_start.to(device))

    def decompress(self) -> torch.Tensor:
        """The bfloat16 matrix (the plain reference the kernel is held to)."""
        n, k = self.shape
        runs = self.codes.reshape(n, -1, 1, 16)
        codes = torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(n, -1)[:, :k].to(torch.int32)
        p = self.plane.to(torch.int32)
        bits = ((p & 0x80) << 8) | (((self.base + codes) & 0xFF) << 7) | (p & 0x7F)
        w = bits.to(torch.int16).view(torch.bfloat16)
        w[self.esc_rows.long(), self.esc_cols.long()] = self.esc_vals
        return w


# pack works through this many weights at a time: its int32 temporaries stay ~64 MiB each, not 4 bytes per
# weight of the whole matrix (an LM head of 128k x 8k would otherwise take ~16 GiB of the device at load).
PACK_CHUNK = 1 << 24


def pack(w: torch.Tensor, chunk: int = PACK_CHUNK) -> CompressedBF16:
    """A [N, K] bfloat16 matrix in the 4-bit exponent-code form, a chunk of rows at a time (the same result
    whatever the chunk)."""
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError(f"pack takes a 2-D bfloat16 matrix, not {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    w = w.contiguous()
    step = max(1, chunk // max(k, 1))

    def bits(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the 16 bits sign-extended to int32, the exponents) of a chunk of rows."""
        u = part.view(torch.int16).to(torch.int32)
        return u, (u >> 7) & 0xFF

    counts = torch.zeros(256, dtype=torch.int64, device=w.device)
    for r in range(0, n, step):
        counts += torch.bincount(bits(w[r:r + step])[1].reshape(-1), minlength=256)
    band = counts.cpu().unfold(0, ESCAPE, 1).sum(-1)  # weights in each band of 15 exponents [b, b + 15)
    base = int(torch.argmax(band))  # (the first of the fullest)
    plane = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    packed = torch.empty(n, -(-k // 32) * 16, dtype=torch.uint8, device=w.device)
    rows, cols = [], []
    for r in range(0, n, step):
        part = w[r:r + step]
        u, exp = bits(part)
        plane[r:r + step] = (((u >> 8) & 0x80) | (u & 0x7F)).to(torch.uint8)
        codes = exp - base
        esc = (codes < 0) | (codes >= ESCAPE)
        codes = torch.where(esc, ESCAPE, codes)
        er, ec = esc.nonzero(as_tuple=True)  # (row-major: ascending rows)
        rows.append(er + r)
        cols.append(ec)
        runs = torch.nn.functional.pad(codes, (0, -k % 32), value=ESCAPE).reshape(part.shape[0], -1, 2, 16)
        packed[r:r + step] = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(part.shape[0], -1).to(torch.uint8)
    esc_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64, device=w.device)
    esc_cols = torch.cat(cols) if cols else torch.zeros(0, dtype=torch.int64, device=w.device)
    start = torch.zeros(n + 1, dtype=torch.int64, device=w.device)
    start[1:] = torch.cumsum(torch.bincount(esc_rows, minlength=n), 0)
    return CompressedBF16(plane, packed, base, esc_rows.to(torch.int32), esc_cols.to(torch.int32),
                          w[esc_rows, esc_cols].contiguous(), start.to(torch.int32))


def embedding(ids: torch.Tensor, w: CompressedBF16) -> torch.Tensor:
    """W's rows `ids` in bfloat16 [*ids.shape, K] (a compressed embedding table's lookup): decoded by the
    GPU (or the interpreter in tests), elsewhere from W decompressed whole (the reference)."""
    gpu = kernels("compressed_triton", ids.device.type)
    if gpu is None:
        return w.decompress()[ids]
    return gpu.rows(w, ids)


def row_range(w: CompressedBF16, first: int, count: int) -> torch.Tensor:
    """Rows first .. first + count of W in bfloat16 (an expert's matrix of a compressed stack): decoded by
    the GPU, elsewhere from W decompressed whole (the reference)."""
    gpu = kernels("compressed_triton", w.plane.device.type)
    if gpu is None:
        return w.decompress()[first:first + count]
    return gpu.decompress(w, first, first + count)


def linear(x: torch.Tensor, w: CompressedBF16, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) in x's dtype: the Triton kernel decoding W's tiles in registers (CUDA, or
    the interpreter in tests; for many rows W decoded once by the GPU); elsewhere W decompressed first
    (the reference)."""
    gpu = kernels("compressed_triton", x.device.type)
    if gpu is None:
        return F.linear(x, w.decompress().to(x.dtype), bias)
    flat = x.reshape(-1, x.shape[-1])
    y = gpu.matmul(flat, w)
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
