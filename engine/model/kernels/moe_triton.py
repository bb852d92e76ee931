"""Routed experts as two grouped GEMMs (the GPU path behind `moe.Experts`).

The step's (token, choice) slots are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M, so every BLOCK_M-row tile belongs to one expert: a program multiplies its
tile by that expert's weights only, and experts no token chose cost no program. All index
arithmetic stays on the device with sizes bounded in advance (T*k + E*(BLOCK_M-1) padded
slots), so a step needs no host sync and the same launch fits a captured CUDA graph.
The torch reference is `moe.grouped_experts_reference`; tests hold the two equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import triton
import triton.language as tl

from engine.model.kernels.quant_triton import dequant_halves, dequant_tile, packed_group


class QuantizedStack(Protocol):
    """What the kernel reads of `quant.QuantizedStack` (kernels import nothing above them): a layer's
    experts' int8/int4 matrices stacked, codes [E, N, K or K/2], scales and mins [E, N, G]."""

    kind: str
    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, s_ptr, m_ptr, c_ptr, rows_ptr, tile_expert_ptr, scale_ptr,
    N, K, stride_am, stride_we, stride_wn, stride_wk, stride_se, groups, stride_cm,
    GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr, INT4: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[slot] = A[row(slot)] @ W[expert(tile)]^T (* scale[slot]) for one BLOCK_M x BLOCK_N tile.
    rows[slot] < 0 marks padding. GATHER: A's row is rows[slot]; else A is already in slot order.
    QUANT: W is quantized (codes at w_ptr, per-group scales/mins at s_ptr/m_ptr, `stride_se` apart
    per expert), dequantized in registers by `quant_triton.dequant_halves` (PACKED: a power-of-two group)
    or `dequant_tile`."""
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:
        return  # a tile past the step's padded slots
    slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + slots)
    valid = rows >= 0
    a_rows = rows if GATHER else slots
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k = k0 * BLOCK_K + tl.arange(0, BLOCK_K)
        if QUANT and PACKED:  # in the activations' dtype: bf16 tensor cores on CUDA
            w_a, k_a, w_b, k_b = dequant_halves(w_ptr + e * stride_we, s_ptr + e * stride_se, m_ptr + e * stride_se,
                                                n, k0 * BLOCK_K, N, K, groups, GROUP, INT4, BLOCK_N, BLOCK_K)
            a_a = tl.load(a_ptr + a_rows[:, None] * stride_am + k_a[None, :],
                          mask=valid[:, None] & (k_a[None, :] < K), other=0.0)
            a_b = tl.load(a_ptr + a_rows[:, None] * stride_am + k_b[None, :],
                          mask=valid[:, None] & (k_b[None, :] < K), other=0.0)
            acc += tl.dot(a_a, tl.trans(w_a.to(a_a.dtype)))
            acc += tl.dot(a_b, tl.trans(w_b.to(a_b.dtype)))
        elif QUANT:
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=valid[:, None] & (k[None, :] < K),
                        other=0.0)
            w = dequant_tile(w_ptr + e * stride_we, s_ptr + e * stride_se, m_ptr + e * stride_se, n, k, N, K,
                             groups, GROUP, INT4)
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
        else:
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=valid[:, None] & (k[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + e * stride_we + n[None, :] * stride_wn + k[:, None] * stride_wk,
                        mask=(k[:, None] < K) & (n[None, :] < N), other=0.0)
            acc += tl.dot(a, w)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + slots, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + slots[:, None] * stride_cm + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (n[None, :] < N))


def align_to_experts(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded slot layout for `ids` [T, k].

    Returns (slot_of [P]: the flattened (token, choice) index each padded slot holds, -1 for
    padding; tile_expert [P / block_m]: the expert of each tile, -1 past the end; dest [T*k]: the
    padded slot of each flattened pair). P = T*k + E*(block_m - 1), rounded up to block_m.
    """
    flat = ids.flatten()
    n = flat.numel()
    dev = flat.device
    # (Not bincount: on CUDA it reads the largest id back to size its output, a host sync that
    # would keep decode steps of every MoE model out of CUDA graphs.)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    seg_start = torch.cumsum(padded, 0) - padded  # each expert's first padded slot
    order = torch.argsort(flat, stable=True)
    first_of_expert = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - first_of_expert[sorted_e]
    dest_sorted = seg_start[sorted_e] + rank
    total = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    slot_of = torch.full((total,), -1, dtype=torch.long, device=dev)
    slot_of[dest_sorted] = order
    dest = torch.empty(n, dtype=torch.long, device=dev)
    dest[order] = dest_sorted
    tile_start = torch.arange(0, total, block_m, device=dev)
    ends = torch.cumsum(padded, 0)
    tile_expert = torch.searchsorted(ends, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, torch.full_like(tile_expert, -1))
    return slot_of, tile_expert, dest


def _gemm(a: torch.Tensor, w: torch.Tensor | QuantizedStack, rows: torch.Tensor, tile_expert: torch.Tensor,
          out_rows: int, gather: bool, scale: torch.Tensor | None, block_m: int, block_n: int,
          block_k: int) -> torch.Tensor:
    c_dtype = a.dtype
    if not isinstance(w, torch.Tensor):
        n, k = w.scales.shape[1], w.q.shape[2] * (2 if w.kind == "int4" else 1)
        groups = w.scales.shape[2]
        ptrs = (w.q, w.scales, w.mins if w.mins is not None else w.scales)
        strides = (w.q.stride(0), 0, 0, w.scales.stride(0))
        quant = dict(QUANT=True, GROUP=w.group_size, INT4=w.kind == "int4", PACKED=packed_group(w.group_size))
    else:
        n, k, groups = w.shape[1], w.shape[2], 1
        ptrs = (w, w, w)  # (no scales or mins)
        strides = (w.stride(0), w.stride(1), w.stride(2), 0)
        quant = dict(QUANT=False, GROUP=1, INT4=False, PACKED=False)
    c = torch.empty(out_rows, n, dtype=c_dtype, device=a.device)
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, *ptrs, c, rows, tile_expert, scale if scale is not None else rows,
        n, k, a.stride(0), *strides, groups, c.stride(0),
        GATHER=gather, HAS_SCALE=scale is not None, **quant, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return c


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor | QuantizedStack,
                  w_down: torch.Tensor | QuantizedStack, act: Callable[[torch.Tensor], torch.Tensor],
                  block_m: int = 64, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]). x: [T, H]; w_gate_up: [E, 2I, H]; w_down: [E, H, I]
    (float, or each a `QuantizedStack` of the experts' int8/int4 matrices)."""
    t, k = ids.shape
    stacked = w_gate_up if isinstance(w_gate_up, torch.Tensor) else w_gate_up.scales
    num_experts, inter = stacked.shape[0], stacked.shape[1] // 2
    slot_of, tile_expert, _ = align_to_experts(ids, num_experts, block_m)
    token_rows = torch.where(slot_of >= 0, slot_of // k, slot_of)
    gate_up = _gemm(x, w_gate_up, token_rows, tile_expert, slot_of.numel(), True, None, block_m, block_n, block_k)
    h = act(gate_up[:, :inter]) * gate_up[:, inter:]
    slot_weight = torch.where(slot_of >= 0, weights.flatten()[slot_of.clamp(min=0)], torch.zeros_like(slot_of, dtype=weights.dtype))
    down = _gemm(h, w_down, slot_of, tile_expert, slot_of.numel(), False, slot_weight, block_m, block_n, block_k)
    # Padding rows (garbage, never stored) go to a spare row t that is dropped.
    target = torch.where(slot_of >= 0, slot_of // k, torch.full_like(slot_of, t))
    down = torch.where((slot_of >= 0)[:, None], down, torch.zeros((), dtype=down.dtype, device=down.device))
    return torch.zeros(t + 1, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, target, down)[:t]
