"""A bfloat16 matrix held losslessly compressed in device memory, for a matmul that decodes its tiles in
registers (`kernels/compressed_triton.py`) so the weights cross HBM at ~12 bits instead of 16.

The file format (`engine/loading/compressed.py`) Huffman-codes the exponents: close to their entropy, but
a variable-length code is decoded bit after bit, which a matmul tile cannot afford. In memory each weight
keeps its sign+mantissa byte (`plane`, as in the file) and a 4-bit code for its exponent: the index of one
of the tensor's 15 most frequent exponents (`table`), or 15 — an escape, whose exponent is stored apart
(`escapes`). A trained or normal-initialized matrix's exponents sit in a narrow band, so escapes are rare
(none to a few per million weights), and the whole is 0.75 of bfloat16 and a little more.

Escapes are stored tile by tile in the kernel's own tiling (`block_n` rows x `block_k` columns, tiles in
row-major order of tiles, weights in row-major order inside a tile), with each tile's first escape's
index (`tile_start`): a program decoding a tile finds its escapes' places by a prefix sum of its escape
flags. `decompress` is the plain torch reference; `pack` then `decompress` is bit-exact for every 16-bit
pattern (NaN, Inf and subnormals included).
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
    codes: torch.Tensor  # uint8 [N, K // 2]: weight 2j's code in the low nibble of byte j, 2j+1's in the high
    table: torch.Tensor  # int32 [16]: the exponent of each code (15: unused)
    escapes: torch.Tensor  # int32 [E]: escaped weights' exponents, tile by tile
    tile_start: torch.Tensor  # int32 [tiles + 1]: each tile's first escape in `escapes`
    block_n: int
    block_k: int

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.plane.shape
        return int(n), int(k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.plane, self.codes, self.table, self.escapes,
                                                           self.tile_start))

    def to(self, device: torch.device) -> CompressedBF16:
        return CompressedBF16(self.plane.to(device), self.codes.to(device), self.table.to(device),
                              self.escapes.to(device), self.tile_start.to(device), self.block_n, self.block_k)

    def decompress(self) -> torch.Tensor:
        """The bfloat16 matrix (the plain reference the kernel is held to)."""
        n, k = self.shape
        codes = torch.stack([self.codes & 0x0F, self.codes >> 4], dim=-1).reshape(n, k).long()
        exp = self.table.long()[codes]
        esc = codes == ESCAPE
        exp[esc] = self.escapes.long()[_rank(esc, self.block_n, self.block_k)]
        p = self.plane.to(torch.int32)
        bits = ((p & 0x80) << 8) | (exp.to(torch.int32) << 7) | (p & 0x7F)
        return bits.to(torch.int16).view(torch.bfloat16)


def _tile_order(n: int, k: int, block_n: int, block_k: int, device: torch.device) -> torch.Tensor:
    """Each weight's place in the escape order: tile by tile (row-major over tiles), row-major inside."""
    rows = torch.arange(n, device=device)[:, None]
    cols = torch.arange(k, device=device)[None, :]
    tiles_k = -(-k // block_k)
    tile = (rows // block_n) * tiles_k + cols // block_k
    return (tile * (block_n * block_k) + (rows % block_n) * block_k + cols % block_k).reshape(-1)


def _rank(esc: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """Index into `escapes` of each escaped weight (in `esc`'s row-major order): its rank in tile order."""
    n, k = esc.shape
    order = _tile_order(n, k, block_n, block_k, esc.device)[esc.reshape(-1)]
    return torch.argsort(torch.argsort(order))


def pack(w: torch.Tensor, block_n: int = 32, block_k: int = 32) -> CompressedBF16:
    """A [N, K] bfloat16 matrix (K even) in the 4-bit exponent-code form, escapes in `block_n` x `block_k`
    tiles (the kernel's tiling)."""
    if w.dtype != torch.bfloat16 or w.dim() != 2 or w.shape[1] % 2:
        raise ValueError(f"pack takes a 2-D bfloat16 matrix with an even number of columns, not {w.dtype} "
                         f"{tuple(w.shape)}")
    n, k = w.shape
    u = w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    exp = (u >> 7) & 0xFF
    plane = (((u >> 8) & 0x80) | (u & 0x7F)).to(torch.uint8)
    counts = torch.bincount(exp.reshape(-1), minlength=256)
    top = [int(e) for e in torch.argsort(counts, descending=True, stable=True)[:ESCAPE] if counts[e] > 0]
    table = torch.zeros(16, dtype=torch.int32)
    lut = torch.full((256,), ESCAPE, dtype=torch.int64)
    for i, e in enumerate(top):
        table[i] = e
        lut[e] = i
    codes = lut.to(w.device)[exp]
    esc = codes == ESCAPE
    order = _tile_order(n, k, block_n, block_k, w.device)
    flat = esc.reshape(-1)
    escapes = exp.reshape(-1)[flat][torch.argsort(order[flat])].to(torch.int32)
    tiles = -(-n // block_n) * -(-k // block_k)
    per_tile = torch.bincount(order[flat] // (block_n * block_k), minlength=tiles)
    tile_start = torch.zeros(tiles + 1, dtype=torch.int32, device=w.device)
    tile_start[1:] = torch.cumsum(per_tile, 0)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return CompressedBF16(plane, packed, table.to(w.device), escapes, tile_start, block_n, block_k)


def linear(x: torch.Tensor, w: CompressedBF16, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) in x's dtype: the Triton kernel decoding W's tiles in registers (CUDA, or
    the interpreter in tests); elsewhere W decompressed first (the reference)."""
    gpu = kernels("compressed_triton", x.device.type)
    if gpu is None:
        return F.linear(x, w.decompress().to(x.dtype), bias)
    flat = x.reshape(-1, x.shape[-1])
    y = gpu.compressed_linear(flat, w)
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
