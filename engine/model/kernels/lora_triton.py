"""LoRA deltas of a mixed batch on the GPU: punica's SGMV as two Triton kernels (the GPU path behind
`lora.LoRAWeights`).

A step's rows come in runs of one adapter (`lora.LoRARows.segments`; base-model rows belong to none).
Each run is cut into BLOCK_M-row tiles, so every tile belongs to one adapter slot. `shrink` multiplies a
tile by its slot's A (`[R, in]`) into a float32 `[rows, R]` buffer; `expand` multiplies that by the slot's
B (`[out, R]`) and adds the result into the projection's output rows in place — two launches per
projection whatever the number of adapters, each program touching only its own adapter's factors, and
base rows costing nothing. The torch reference is `lora.segment_deltas`; tests hold the two equal (in the
Triton interpreter on a CPU host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_K = 32
BLOCK_N = 64


@triton.jit
def _tile(tile_slot_ptr, tile_row_ptr, tile_end_ptr, BLOCK_M: tl.constexpr):
    """This program's tile: its adapter slot, its rows and which of them lie inside its run."""
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M)
    return slot, rows, rows < tl.load(tile_end_ptr + tile)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, xa_ptr, tile_slot_ptr, tile_row_ptr, tile_end_ptr, K, R,
                   stride_xm, stride_as, stride_ar, stride_xam,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """xa[rows, :R] = x[rows] @ A[slot]^T for one tile of one run."""
    slot, rows, rmask = _tile(tile_slot_ptr, tile_row_ptr, tile_end_ptr, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k = k0 * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                    mask=(r[None, :] < R) & kmask[:, None], other=0.0)
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
    tl.store(xa_ptr + rows[:, None] * stride_xam + r[None, :], acc, mask=rmask[:, None] & (r[None, :] < R))


@triton.jit
def _expand_kernel(xa_ptr, b_ptr, out_ptr, tile_slot_ptr, tile_row_ptr, tile_end_ptr, N, R,
                   stride_xam, stride_bs, stride_bn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[rows, n-tile] += xa[rows, :R] @ B[slot][n-tile]^T for one tile of one run."""
    pid_n = tl.program_id(1)
    slot, rows, rmask = _tile(tile_slot_ptr, tile_row_ptr, tile_end_ptr, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    xa = tl.load(xa_ptr + rows[:, None] * stride_xam + r[None, :], mask=rmask[:, None] & (r[None, :] < R), other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + n[None, :] * stride_bn + r[:, None],
                mask=nmask[None, :] & (r[:, None] < R), other=0.0)
    delta = tl.dot(xa, b.to(tl.float32))
    optrs = out_ptr + rows[:, None] * stride_om + n[None, :]
    omask = rmask[:, None] & nmask[None, :]
    cur = tl.load(optrs, mask=omask, other=0.0)
    tl.store(optrs, (cur.to(tl.float32) + delta).to(cur.dtype), mask=omask)


def tiles(segments: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each run cut into BLOCK_M-row tiles: (slot, first row, run end) per tile, as device tensors."""
    slots, firsts, ends = [], [], []
    for start, end, slot in segments:
        for row in range(start, end, BLOCK_M):
            slots.append(slot)
            firsts.append(row)
            ends.append(end)
    return tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (slots, firsts, ends))


def sgmv(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         segments: list[tuple[int, int, int]]) -> None:
    """out[rows of a run] += (x[rows] A[slot]^T) B[slot]^T for every run, in place. x `[rows, in]`, out
    `[rows, out]` (contiguous rows), A `[slots, R, in]`, B `[slots, out, R]`."""
    if not segments:
        return
    x = x.contiguous()
    a, b = a.contiguous(), b.contiguous()
    assert out.stride(1) == 1 and a.shape[2] == x.shape[1] and b.shape[1] == out.shape[1]
    slot, first, end = tiles(segments, x.device)
    R = a.shape[1]
    block_r = max(16, triton.next_power_of_2(R))
    xa = torch.empty(x.shape[0], R, dtype=torch.float32, device=x.device)
    n_tiles = slot.numel()
    _shrink_kernel[(n_tiles,)](x, a, xa, slot, first, end, x.shape[1], R, x.stride(0), a.stride(0), a.stride(1),
                               xa.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K)
    N = out.shape[1]
    _expand_kernel[(n_tiles, triton.cdiv(N, BLOCK_N))](xa, b, out, slot, first, end, N, R, xa.stride(0),
                                                       b.stride(0), b.stride(1), out.stride(0), BLOCK_M=BLOCK_M,
                                                       BLOCK_R=block_r, BLOCK_N=BLOCK_N)
