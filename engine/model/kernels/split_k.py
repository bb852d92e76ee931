"""Split-K on the GPU: how many splits fill the device, and one kernel that finishes a split product.

With a few activation rows (decode) a matrix has too few (row, column) tiles to keep every
multiprocessor reading weights, so the K loop is split over programs that each write float32
partials [SPLIT, M, N]. `reduce_partials` then sums the splits, adds the bias and stores the
output's dtype into a row-strided view in one launch, where `part.sum(0)`, `+ bias` and
`out.copy_` were three (each a few microseconds on an H200, against ~10 for a whole decode GEMV of
Llama-3-8B's fused qkv in FP8). `reduce_reference` is the plain torch form it is held to
(tests/test_triton_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SM_COUNT: dict[int, int] = {}


def splits_to_fill(device: torch.device, programs: int) -> int:
    """How many times `programs` programs must be split for two waves over the GPU's multiprocessors
    (1 on CPU, where the interpreter runs one program at a time). Shared by split-KV decode and split-K."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return max(-(-2 * _SM_COUNT[idx] // max(programs, 1)), 1)


def split_k_for(device: torch.device, programs: int, k_tiles: int) -> int:
    """K splits that give about two waves of programs over the GPU (`splits_to_fill`): a power of two,
    at most 8 and at most one per K tile; 1 on CPU."""
    want = splits_to_fill(device, programs)
    split = 1
    while split * 2 <= min(want, 8, k_tiles):
        split *= 2
    return split


@triton.jit
def store_tile(acc, rm, rn, M, N, bias_ptr, out_ptr, stride_om, part_ptr, pid_k, SPLIT_K: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    """A GEMM tile's epilogue: unsplit, acc (+ bias) stored in the output's dtype at rows `rm`, columns `rn`;
    split, its float32 partial stored as split `pid_k` of `part` [SPLIT_K, M, N] for `reduce_partials`."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)


@triton.jit
def _reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om,
                   SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + (s * M + row) * N + rn, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_partials(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] (row-strided view allowed) = part [SPLIT, M, N].sum(0) (+ bias), in one launch."""
    split, m, n = part.shape
    block = min(1024, triton.next_power_of_2(n))
    _reduce_kernel[(m, triton.cdiv(n, block))](part, bias if bias is not None else part, out, m, n, out.stride(0),
                                               SPLIT=split, HAS_BIAS=bias is not None, BLOCK=block)


def reduce_reference(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    total = part.sum(0)
    if bias is not None:
        total += bias.float()
    out.copy_(total)
