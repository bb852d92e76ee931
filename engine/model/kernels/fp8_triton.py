"""FP8 x FP8 GEMM for block-FP8 weights on GPUs with FP8 tensor cores (sm_89, sm_90): w8a8.

The published FP8 checkpoints (DeepSeek-V3, Kimi-K2, Qwen3-*-FP8) were calibrated for exactly this:
activations quantized to e4m3 per token per 128 columns with a dynamic scale (amax / 448), weights
e4m3 with a scale per 128 x 128 block (kept here per row: `engine.model.quant`'s fp8 layout). One
program multiplies a BLOCK_M x BLOCK_N tile; every BLOCK_K step lies inside one scale group, so its
FP8 dot (float32 sums) is scaled by the activation rows' and weight rows' scales of that group
before it joins the accumulator: C = sum_g (A_g @ W_g^T) * a_s[:, g] * w_s[:, g].

`quantize_activations` rounds to nearest even explicitly (`round_e4m3`): the Triton interpreter's own
float -> e4m3 cast truncates, so the kernel rounds to the e4m3 grid in float32 first and the cast
is then exact on every backend; the result equals torch's `.to(torch.float8_e4m3fn)` bit for bit.

Where the GPU has no FP8 tensor cores (sm_80), and for small batches, FP8 weights take the
weight-only path (`quant_triton`: codes widened exactly in registers, activations unquantized).
`method_for` decides; `w8a8_reference` is the plain torch computation both kernels are held to.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.model.kernels.split_k import reduce_partials, split_k_for, store_tile

FP8_MAX = 448.0
_E4M3_MAX = tl.constexpr(448.0)  # (the same, as the kernels may read it)
# The rows for which an FP8-capable GPU takes the w8a8 kernel; outside them weight-only (`quant_triton`: from
# 128 rows the codes are widened once to the model's dtype for the vendor GEMM). Measured on an H200
# (`bash loadtest/gpu_check.sh OUT fp8gemm`, loadtest/results/quantization/h200/): w8a8 beats weight-only from one
# row (Llama-3-8B's fused gate/up at 4 rows: 35.6 us, 80% of copy bandwidth, against 57.2 for bfloat16 and ~80 for
# the weight-only kernels), and loses to widening + cuBLAS at prefill sizes (gate/up at 2,048 rows: 947 us at its
# best tile against 691 for the bfloat16 GEMM alone): its per-group rescaling each K step keeps the tensor cores
# from accumulating across steps. Between 256 and 511 rows w8a8 is kept on an estimate, not a timing: gate/up at
# 256 rows took 144 us against the bfloat16 GEMM's 89 plus widening's ~350 MB of traffic (~84 us at copy bandwidth).
W8A8_MIN_ROWS = 1
W8A8_MAX_ROWS = 512
# (Quantizing the activations inside the GEMM instead of by `quantize_activations` first, to save a launch,
# measured 3-5x slower per matrix at 4-64 rows on the H200 — Llama-3-8B's decode step 12.9 ms against 4.5 — and
# was taken out.)


# e4m3 widened by the GPU's own conversion (sm_89 and later) instead of by bit placement: opt-in with
# SPLITFIRE_E4M3_NATIVE=1 (read at import; kernels compiled with it need an FP8-capable GPU) until it is timed on
# a device — the H200 ran the e4m3 KV cache 1.28x slower than bfloat16's at 16k context and batch 8, and the
# one-row FP8 weight kernel at 35-46% of copy bandwidth, both with the bit placement; the cvt compiles their sm_90
# main loops 42-58% shorter (loadtest/results/gpu-decode/compile-only/triton_aot_e4m3_native.txt). Exact either way.
E4M3_NATIVE = tl.constexpr(os.environ.get("SPLITFIRE_E4M3_NATIVE", "") == "1")


@triton.jit
def e4m3_to_float(code):
    """e4m3 bytes (any integer type) -> float32, exactly: sign, exponent and mantissa placed in a float16
    (e4m3's bias 7 against float16's 15 leaves the value / 2^8, subnormals included), then x 2^8 — on any
    GPU, no FP8 instructions needed (weights on sm_80, an FP8 KV cache everywhere). The NaN pattern reads
    as +-480 (nothing stored here holds it: casts saturate at 448). With E4M3_NATIVE: the hardware's cvt."""
    if E4M3_NATIVE:
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    b = code.to(tl.uint16) & 0xFF
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def e4m3_bits(v):
    """float32 -> e4m3 bytes (uint8): rounded to nearest even and saturated (`round_e4m3`), then encoded
    from the rounded float's own bits (normal: exponent + 7 and the top 3 mantissa bits; below 2^-6 a
    multiple of 2^-9). Equals torch's `.to(torch.float8_e4m3fn)`, on any backend."""
    sign = ((v.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.int32)
    a = tl.abs(round_e4m3(v))
    bits = a.to(tl.uint32, bitcast=True)
    e = (bits >> 23).to(tl.int32) - 127
    normal = ((e + 7) << 3) | ((bits >> 20) & 7).to(tl.int32)
    code = tl.where(e < -6, (a * 512.0).to(tl.int32), normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def round_e4m3(v):
    """v (float32) rounded to the nearest e4m3 value, ties to even, saturating at +-448: a magic-number
    add at the spacing of v's binade (2^(max(e, -6) - 3): e4m3's 3 mantissa bits, subnormals below
    2^-6) rounds in float32 exactly as the hardware cast rounds."""
    a = tl.abs(v)
    e = (a.to(tl.uint32, bitcast=True) >> 23).to(tl.int32) - 127
    se = tl.maximum(e, -6) - 3
    c = (((se + 150) << 23) | 0x400000).to(tl.uint32).to(tl.float32, bitcast=True)  # 1.5 * 2^(se + 23)
    r = tl.minimum((a + c) - c, _E4M3_MAX)
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, groups, GROUP: tl.constexpr):
    """One (row, group): scale = amax / 448 (1e-12 at least), q = e4m3(x / scale)."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    k = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / _E4M3_MAX, 1e-12)
    q = round_e4m3(tl.math.div_rn(x, scale))
    tl.store(q_ptr + row * K + k, q.to(tl.float8e4nv), mask=k < K)
    tl.store(s_ptr + row * groups + g, scale)


@triton.jit
def _w8a8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, c_ptr, part_ptr, M, N, K, stride_am, stride_cm, groups,
                 GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per
    for k0 in range(k_start, tl.minimum(k_start + k_per, K), BLOCK_K):
        kk = k0 + rk
        g = k0 // GROUP
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        a_s = tl.load(as_ptr + rm * groups + g, mask=rm < M, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        w_s = tl.load(ws_ptr + rn * groups + g, mask=rn < N, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * a_s[:, None] * w_s[None, :]
    store_tile(acc, rm, rn, M, N, bias_ptr, c_ptr, stride_cm, part_ptr, pid_k, SPLIT_K, HAS_BIAS)


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` multiplies e4m3 in its tensor cores (compute capability 8.9 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def method_for(rows: int, device: torch.device) -> str:
    """'w8a8' or 'weight-only' for a step of `rows` activation rows on `device`."""
    return "w8a8" if fp8_tensor_cores(device) and W8A8_MIN_ROWS <= rows < W8A8_MAX_ROWS else "weight-only"


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], float32 scales [M, K / group]), one scale per row per `group`."""
    m, k = x.shape
    if k % group or group & (group - 1):
        raise ValueError(f"activations of {k} columns in groups of {group}: a power-of-two group dividing K")
    x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, k // group, dtype=torch.float32, device=x.device)
    _quantize_kernel[(m, k // group)](x, q, s, m, k, x.stride(0), k // group, GROUP=group)
    return q, s


def w8a8_tiles(m: int, n: int, k: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages, K splits) for `m` rows of an [N, K] matrix: the row tile no taller
    than the rows need (16 is the dot's least); with few rows BLOCK_N 64 and the K loop split until the
    programs make two waves over the GPU (`split_k`) — one 64 x 128 tile per program and no split left an
    H200 two-thirds idle on Llama-3-8B's fused qkv at one row (48 programs on 132 multiprocessors: 32% of
    copy bandwidth)."""
    if m >= 256:  # (measured best or within 3% at 256 and 2,048 rows: 128 x 128 with 8 warps took 1.4-1.6x)
        return 64, 128, 4, 3, 1
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return block_m, block_n, 4, 4 if block_m <= 32 else 3, split_k_for(device, programs, triton.cdiv(k, 128))


def w8a8_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int, bias: torch.Tensor | None,
              out: torch.Tensor, block_m: int | None = None, block_n: int | None = None, block_k: int = 128,
              warps: int | None = None, stages: int | None = None, split_k: int | None = None) -> None:
    """out [M, N] (row-strided view allowed) = e4m3(x) @ W^T (+ bias): x quantized per row per group, W the
    e4m3 codes `q` [N, K] with `scales` [N, K / group_size]. BLOCK_K is cut to the group when larger; the
    launch choices not given are `w8a8_tiles`'. Split over K, the float32 partials are summed by
    `split_k.reduce_partials`."""
    m, k = x.shape
    n = q.shape[0]
    auto = w8a8_tiles(m, n, k, x.device)
    block_m, block_n = block_m or auto[0], block_n or auto[1]
    warps, stages, split = warps or auto[2], stages or auto[3], split_k or auto[4]
    block_k = min(block_k, group_size)
    if group_size % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide the scale group {group_size}")
    if k % group_size:
        raise ValueError(f"{k} columns in groups of {group_size}: a group must divide K")
    a, a_s = quantize_activations(x, group_size)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else scales
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _w8a8_kernel[grid](a, a_s, q, scales, bias if bias is not None else scales, out, part, m, n, k, a.stride(0),
                       out.stride(0), k // group_size, GROUP=group_size, HAS_BIAS=bias is not None,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps, num_stages=stages)
    if split > 1:
        reduce_partials(part, bias, out)


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The w8a8 product in plain torch (float32): activations rounded to e4m3 per row per group (torch's
    cast), each group's dot of codes scaled by both scales, summed over the groups."""
    m, k = x.shape
    g = k // group_size
    xf = x.float().view(m, g, group_size)
    xs = (xf.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    xq = (xf / xs.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    wq = q.float().view(q.shape[0], g, group_size)
    dots = torch.einsum("mgk,ngk->mng", xq, wq)
    out = (dots * xs.unsqueeze(1) * scales.float().unsqueeze(0)).sum(-1)
    return out if bias is None else out + bias.float()
