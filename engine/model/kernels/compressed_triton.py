"""y = x @ W^T with W held compressed in device memory (`engine.model.compressed_weight.CompressedBF16`):
each program decodes its BLOCK_N x BLOCK_K tiles of W in registers — a sign+mantissa byte and a 4-bit
exponent code per weight, exponent = base + code, an escape (code 15) as 0 — with integer operations
only, and multiplies them in bfloat16 on the tensor cores with float32 sums. The escaped weights (rare)
are added by the program that owns their rows, after its dense tile (atomic adds into the tile it has
just stored, as the plain reference's `index_add_` does). The weights cross HBM at ~12 bits instead of
16 (a decode step of a bandwidth-bound model reads 0.75 of the bytes); nothing is materialised in
bfloat16 — except for many rows (prefill, decode steps of `DECOMPRESS_MIN_ROWS` sequences), where every
row block would decode the whole matrix again: there one program per tile writes the bfloat16 matrix, a
chunk of rows at a time (`decompress`, at most 256 MiB), for the vendor GEMM, and it is freed after.

Rows per program: one row (`GEMV_MAX_ROWS`: products in float32 registers, no dot; 32 x 256 tiles, the
fastest measured), else 16 up to 16 rows and 32 up to `DECOMPRESS_MIN_ROWS`.

Split-K (`split_k.split_k_for`): with a few rows (decode) there are too few (row, column) tiles to
fill the GPU, so each program takes a share of K and writes float32 partial sums that are added after.

`PLAIN=True` is the same kernel reading an ordinary bfloat16 W: on a matrix without escapes the two are
bit-identical in the Triton interpreter (same tiles, same order of accumulation); tests hold both close
to a float64 product, and `decompress` equal to `CompressedBF16.decompress` bit for bit. Activations are
taken in bfloat16 (the engine's dtype with `--compress-weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from common.sizing import DECOMPRESS_BUFFER_BYTES
from engine.model.kernels.split_k import split_k_for

# Rows from which the matrix is decoded to bfloat16 for torch's GEMM instead of in every row block's
# program: past one 32-row block. On an H200 (Llama-3-8B shapes inside CUDA graphs,
# an H200 run of bench_compressed_gemm, 2026-11-27) the tiles at 24 rows (one 32-row block) took
# 26-153 us against 30-210 us decoded + GEMM at 32 rows; at 64 rows decoding + GEMM (28-213 us) beat
# 64-row tiles (53-352 us, v4).
DECOMPRESS_MIN_ROWS = 33
# Rows up to which each row is its own program without a tensor-core dot (`_gemv_kernel`; the int4
# kernels' crossover: `quant_triton.GEMV_MAX_ROWS`).
GEMV_MAX_ROWS = 1
# Rows per program the row kernel takes (`compressed_linear(gemv=True, block_m=...)`; by default the fewest
# that hold the rows): 2 or 4 decode each weight once for that many rows, one FFMA per weight and row (SASS
# main loop at 32 x 256 / 8 warps, sm_90: 342 instructions per iteration at 1 row, 351 at 2, 434 at 4,
# no spills). Not yet timed on a GPU: GEMV_MAX_ROWS stays 1 (2-4 rows take the tiles) until it is
# (`gpu_check.sh OUT compressedrows`).
GEMV_ROWS = (1, 2, 4)
BLOCK_N = 64  # the embedding's decoder's tile (`rows`) and the many-rows path's chunk rounding (`matmul`)
BLOCK_K = 128
# The many-rows decoder's (`decompress`) tile and warps: block_n, block_k, warps. On an H200 16 x 512 / 4
# moved 3.46-3.82 TB/s over Llama-3-8B's four projections (as fast as torch's copy of the bfloat16 matrix)
# against 64 x 128 / 4's 3.22-3.38 (loadtest/results/compression/h200/bench_compressed_decoder_launches.txt).
DECOMPRESS_LAUNCH = (16, 512, 4)
ESC_CHUNK = 32  # escapes added per step of a program's escape loop


def block_m_for(rows: int) -> int:
    return 16 if rows <= 16 else 32


def gemv_rows_for(rows: int) -> int:
    """The row kernel's rows per program for `rows` rows: the fewest of GEMV_ROWS that hold them (else the most)."""
    return next((r for r in GEMV_ROWS if r >= rows), GEMV_ROWS[-1])


@triton.jit
def _weights(plane_ptr, rn, kk, code, base, N, K):
    """bfloat16 weights of rows `rn`, columns `kk` from their planes and codes; 0 at escapes (code 15: also
    every column and row outside the matrix, whose codes are loaded as 15 or padded with it)."""
    plane = tl.load(plane_ptr + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0).to(tl.int32)
    # sign << 15 | mantissa is p + (p & 0x80) * 0xFF (0x80 + 0x7F80 = 0x8000); the exponent added in place
    bits = plane + (plane & 0x80) * 0xFF + ((base + code) << 7)
    bits = tl.where(code == 15, 0, bits)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _weights_f32(plane_ptr, rn, kk, code, base, N, K, SELECT: tl.constexpr):
    """`_weights` widened to float32, built as float32 bits directly (a bfloat16 is the top half of its
    float32): the sign+mantissa byte read as a signed byte and shifted 16 puts the mantissa at bits 16-22
    and copies of the sign above it; keep bit 31 of those and put an exponent in between. SELECT: the
    exponent base + code, 0 at escapes — the weights themselves. Else the exponent is 112 + code, ORed in
    (no add): the weights times 2^(112 - base), which the caller scales back once per sum (exact: a power
    of two); an escape (code 15) decodes as its own sign and mantissa at exponent 127, which the escape
    loop takes back out (`_add_escapes` SUBTRACT)."""
    plane = tl.load(plane_ptr.to(tl.pointer_type(tl.int8)) + rn[:, None] * K + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0).to(tl.int32)
    if SELECT:
        bits = ((plane << 16) & -2139095041) | (code * 8388608 + (base << 23))  # (-2139095041: 0x807FFFFF)
        bits = tl.where(code == 15, 0, bits)
    else:
        bits = ((plane << 16) & -2139095041) | (code << 23) | (112 << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _weights_unselected(plane_ptr, rn, kk, code, base, N, K):
    """`_weights` without its escape select, for a decoder that stores every escape in its place after
    (`_decompress_kernel`): the sign+mantissa byte read as a signed byte keeps its sign at bit 15 and its
    mantissa at bits 0-6, the exponent base + code ORed in between; an escape (code 15) decodes as
    whatever base + 15 makes of it, never read."""
    plane = tl.load(plane_ptr.to(tl.pointer_type(tl.int8)) + rn[:, None] * K + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0).to(tl.int32)
    bits = (plane & 0x807F) | ((base + code) << 7)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _weights_scaled(plane_ptr, rn, kk, code, N, K):
    """`_weights` times 2^(112 - base) in bfloat16 for the tensor-core tiles, the fast decode's form: the
    sign+mantissa byte read as a signed byte keeps its sign at bit 15 and its mantissa at bits 0-6, and
    the exponent 112 + code is ORed in (no add, no select); an escape (code 15) decodes as its own sign
    and mantissa at exponent 127, taken back out by the escape loop (`_stand_in`). The caller scales the
    sums back by `_unscale(base)`."""
    plane = tl.load(plane_ptr.to(tl.pointer_type(tl.int8)) + rn[:, None] * K + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0).to(tl.int32)
    bits = (plane & 0x807F) | (code << 7) | (112 << 7)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _unscale(base):
    """2^(base - 112) in float32 (exponent field base + 15): what the fast decode's sums are scaled back by."""
    return ((base + 15) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _stand_in(v, base):
    """The value the fast decode gave escaped weight `v` (bfloat16), scaled back, in float32: v's sign and
    mantissa at exponent base + 15."""
    sm = v.to(tl.int16, bitcast=True).to(tl.int32) & 0x807F  # (sign-extended: bit 15 kept)
    return ((sm | ((base + 15) << 7)) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _code_bytes(codes_ptr, rn, k0, j, N, code_row):
    """The code bytes of rows `rn` for the K tile at `k0` (byte j: columns k0 + (j//16)*32 + j%16 and +16);
    255 (two escapes) outside the matrix."""
    cj = k0 // 2 + j
    return tl.load(codes_ptr + rn[:, None] * code_row + cj[None, :], mask=(rn[:, None] < N) & (cj[None, :] < code_row),
                   other=255).to(tl.int32)


@triton.jit
def _weight_halves(w_ptr, plane_ptr, codes_ptr, rn, k0, j, k_a, k_b, base, N, K, code_row, PLAIN: tl.constexpr,
                   FAST: tl.constexpr = False):
    """The K tile at `k0` of rows `rn` as its two halves (columns `k_a`, `k_b`) in bfloat16: decoded from the
    planes and codes (`FAST`: times 2^(112 - base), escapes as stand-ins), or (`PLAIN`) read from an
    ordinary bfloat16 matrix at `w_ptr`."""
    if PLAIN:
        w_a = tl.load(w_ptr + rn[:, None] * K + k_a[None, :], mask=(rn[:, None] < N) & (k_a[None, :] < K), other=0.0)
        w_b = tl.load(w_ptr + rn[:, None] * K + k_b[None, :], mask=(rn[:, None] < N) & (k_b[None, :] < K), other=0.0)
    else:
        byte = _code_bytes(codes_ptr, rn, k0, j, N, code_row)
        if FAST:  # (times 2^(112 - base), escapes as stand-ins: `_weights_scaled`)
            w_a = _weights_scaled(plane_ptr, rn, k_a, byte & 0x0F, N, K)
            w_b = _weights_scaled(plane_ptr, rn, k_b, byte >> 4, N, K)
        else:
            w_a = _weights(plane_ptr, rn, k_a, byte & 0x0F, base, N, K)
            w_b = _weights(plane_ptr, rn, k_b, byte >> 4, base, N, K)
    return w_a, w_b


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, plane_ptr, codes_ptr, esc_start_ptr, esc_rows_ptr, esc_cols_ptr, esc_vals_ptr,
                   y_ptr, M, N, K, base, stride_xm, code_row,
                   PLAIN: tl.constexpr, ESCAPES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, F32_DOT: tl.constexpr, ESC_CHUNK: tl.constexpr,
                   FAST: tl.constexpr):
    """Program (m, n, s): rows m, columns n, the s-th share of K; float32 sums into y [SPLIT_K, M, N].
    Each K tile is two halves of 16-column runs (a code byte's low and high nibbles: `CompressedBF16.codes`),
    one dot each. Then the program of share 0 adds its columns' escapes into the tile it stored."""
    HALF: tl.constexpr = BLOCK_K // 2
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, HALF)
    xrows = rm[:, None] < M
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per, K), BLOCK_K):
        k_a = k0 + (j // 16) * 32 + j % 16
        k_b = k_a + 16
        x_a = tl.load(x_ptr + rm[:, None] * stride_xm + k_a[None, :], mask=xrows & (k_a[None, :] < K),
                      other=0.0).to(tl.bfloat16)
        x_b = tl.load(x_ptr + rm[:, None] * stride_xm + k_b[None, :], mask=xrows & (k_b[None, :] < K),
                      other=0.0).to(tl.bfloat16)
        w_a, w_b = _weight_halves(w_ptr, plane_ptr, codes_ptr, rn, k0, j, k_a, k_b, base, N, K, code_row, PLAIN,
                                  FAST and not PLAIN)
        if F32_DOT:  # (the interpreter: its bfloat16 dot is wrong; the same exact products in float32)
            acc += tl.dot(x_a.to(tl.float32), tl.trans(w_a.to(tl.float32)))
            acc += tl.dot(x_b.to(tl.float32), tl.trans(w_b.to(tl.float32)))
        else:
            acc += tl.dot(x_a, tl.trans(w_a))
            acc += tl.dot(x_b, tl.trans(w_b))
    if FAST and not PLAIN:
        acc = acc * _unscale(base)
    out = y_ptr + pid_k * M * N
    tl.store(out + rm[:, None] * N + rn[None, :], acc, mask=xrows & (rn[None, :] < N))
    if ESCAPES:
        if pid_k == 0:
            _add_escapes(out, x_ptr, rm, xrows, stride_xm, N, pid_n * BLOCK_N, esc_start_ptr, esc_rows_ptr,
                         esc_cols_ptr, esc_vals_ptr, BLOCK_N, ESC_CHUNK, base, FAST and not PLAIN)


@triton.jit
def _add_escapes(out, x_ptr, rm, xrows, stride_xm, N, n0, esc_start_ptr, esc_rows_ptr, esc_cols_ptr, esc_vals_ptr,
                 BLOCK_N: tl.constexpr, ESC_CHUNK: tl.constexpr, base, SUBTRACT: tl.constexpr):
    """out[m, r] += x[m, c] * v for each escape (r, c, v) of rows n0 .. n0 + BLOCK_N and each row m of
    `rm` where `xrows`, into the tile the program has just stored (the barrier: every thread's store is
    in before any thread adds). SUBTRACT: the tile decoded the escape as v's sign and mantissa at exponent
    base + 15, scaled back (the fast decode: `_weights_f32` without SELECT, `_weights_scaled`); that
    product is taken back out with the same add (both products of two bfloat16 values, exact in float32)."""
    tl.debug_barrier()
    lo = tl.load(esc_start_ptr + n0)
    hi = tl.load(esc_start_ptr + tl.minimum(n0 + BLOCK_N, N))
    e = tl.arange(0, ESC_CHUNK)
    for e0 in range(lo, hi, ESC_CHUNK):
        em = e0 + e < hi
        r = tl.load(esc_rows_ptr + e0 + e, mask=em, other=0)
        c = tl.load(esc_cols_ptr + e0 + e, mask=em, other=0)
        v = tl.load(esc_vals_ptr + e0 + e, mask=em, other=0.0)
        both = xrows & em[None, :]
        xv = tl.load(x_ptr + rm[:, None] * stride_xm + c[None, :], mask=both, other=0.0).to(tl.bfloat16).to(tl.float32)
        add = xv * v.to(tl.float32)[None, :]
        if SUBTRACT:
            add -= xv * _stand_in(v, base)[None, :]
        tl.atomic_add(out + rm[:, None] * N + r[None, :], add, mask=both)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, plane_ptr, codes_ptr, esc_start_ptr, esc_rows_ptr, esc_cols_ptr, esc_vals_ptr,
                 y_ptr, M, N, K, base, stride_xm, code_row,
                 PLAIN: tl.constexpr, ESCAPES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, ESC_CHUNK: tl.constexpr, F32_BITS: tl.constexpr,
                 ESC_SELECT: tl.constexpr, ROWS: tl.constexpr = 1, ESC_ROWS: tl.constexpr = 2):
    """Program (rows, n, s): ROWS activation rows (decode steps of 1, 2 or 4 sequences), products summed in
    float32 registers shaped like the weight tile — no tensor-core dot (a few rows would use a sixteenth of
    it or less) and no change of the decoded weights' layout; each weight decoded once for its ROWS rows —
    reduced once at the end; then escapes as `_matmul_kernel` (ESC_ROWS: max(ROWS, 2), the escape loop's
    block of rows, the ones past ROWS masked)."""
    HALF: tl.constexpr = BLOCK_K // 2
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = pid_m * ROWS
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, HALF)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per
    if ROWS == 1:
        acc = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
    else:
        rs = row + tl.arange(0, ROWS)
        acc3 = tl.zeros([ROWS, BLOCK_N, HALF], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per, K), BLOCK_K):
        k_a = k0 + (j // 16) * 32 + j % 16
        k_b = k_a + 16
        if ROWS == 1:
            x_a = tl.load(x_ptr + row * stride_xm + k_a, mask=k_a < K, other=0.0).to(tl.bfloat16).to(tl.float32)
            x_b = tl.load(x_ptr + row * stride_xm + k_b, mask=k_b < K, other=0.0).to(tl.bfloat16).to(tl.float32)
        else:
            live = rs[:, None] < M
            x_a = tl.load(x_ptr + rs[:, None] * stride_xm + k_a[None, :], mask=live & (k_a[None, :] < K),
                          other=0.0).to(tl.bfloat16).to(tl.float32)
            x_b = tl.load(x_ptr + rs[:, None] * stride_xm + k_b[None, :], mask=live & (k_b[None, :] < K),
                          other=0.0).to(tl.bfloat16).to(tl.float32)
        if F32_BITS and not PLAIN:
            byte = _code_bytes(codes_ptr, rn, k0, j, N, code_row)
            w_a = _weights_f32(plane_ptr, rn, k_a, byte & 0x0F, base, N, K, ESC_SELECT)
            w_b = _weights_f32(plane_ptr, rn, k_b, byte >> 4, base, N, K, ESC_SELECT)
        else:
            w_a, w_b = _weight_halves(w_ptr, plane_ptr, codes_ptr, rn, k0, j, k_a, k_b, base, N, K, code_row,
                                      PLAIN)
        if ROWS == 1:
            acc += w_a.to(tl.float32) * x_a[None, :]
            acc += w_b.to(tl.float32) * x_b[None, :]
        else:
            acc3 += w_a.to(tl.float32)[None, :, :] * x_a[:, None, :]
            acc3 += w_b.to(tl.float32)[None, :, :] * x_b[:, None, :]
    out = y_ptr + pid_k * M * N
    if ROWS == 1:
        total = tl.sum(acc, axis=1)
        if F32_BITS and not PLAIN and not ESC_SELECT:  # (weights decoded times 2^(112 - base): scaled back)
            total = total * _unscale(base)
        tl.store(out + row * N + rn, total, mask=rn < N)
    else:
        totals = tl.sum(acc3, axis=2)
        if F32_BITS and not PLAIN and not ESC_SELECT:
            totals = totals * _unscale(base)
        tl.store(out + rs[:, None] * N + rn[None, :], totals, mask=(rs[:, None] < M) & (rn[None, :] < N))
    if ESCAPES:
        if pid_k == 0:
            rm = row + tl.arange(0, ESC_ROWS)  # (the escape loop takes a block of rows: these, the rest masked)
            _add_escapes(out, x_ptr, rm, (rm[:, None] < row + ROWS) & (rm[:, None] < M), stride_xm, N,
                         pid_n * BLOCK_N, esc_start_ptr, esc_rows_ptr, esc_cols_ptr, esc_vals_ptr, BLOCK_N, ESC_CHUNK,
                         base, F32_BITS and not PLAIN and not ESC_SELECT)


@triton.jit
def _decompress_kernel(plane_ptr, codes_ptr, esc_start_ptr, esc_rows_ptr, esc_cols_ptr, esc_vals_ptr, w_ptr, n0, n1,
                       N, K, base, code_row, ESCAPES: tl.constexpr, ESC_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SELECT: tl.constexpr):
    """w [n1 - n0, K] bfloat16 = rows n0 .. n1 of the compressed matrix decoded, a tile per program, then
    the tile's escapes stored in their places (after a barrier: the tile's own stores are in first).
    SELECT: escapes decoded as 0 first (`_weights`, the reference), else as anything (`_weights_unselected`:
    no select per weight; the escape loop overwrites them)."""
    HALF: tl.constexpr = BLOCK_K // 2
    first = n0 + tl.program_id(0) * BLOCK_N
    rn = first + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    j = tl.arange(0, HALF)
    k_a = k0 + (j // 16) * 32 + j % 16
    k_b = k_a + 16
    byte = _code_bytes(codes_ptr, rn, k0, j, n1, code_row)
    rows = rn[:, None] < n1
    out = w_ptr + (rn[:, None] - n0) * K
    if SELECT:
        w_a = _weights(plane_ptr, rn, k_a, byte & 0x0F, base, n1, K)
        w_b = _weights(plane_ptr, rn, k_b, byte >> 4, base, n1, K)
    else:
        w_a = _weights_unselected(plane_ptr, rn, k_a, byte & 0x0F, base, n1, K)
        w_b = _weights_unselected(plane_ptr, rn, k_b, byte >> 4, base, n1, K)
    tl.store(out + k_a[None, :], w_a, mask=rows & (k_a[None, :] < K))
    tl.store(out + k_b[None, :], w_b, mask=rows & (k_b[None, :] < K))
    if ESCAPES:
        tl.debug_barrier()
        lo = tl.load(esc_start_ptr + first)
        hi = tl.load(esc_start_ptr + tl.minimum(first + BLOCK_N, n1))
        e = tl.arange(0, ESC_CHUNK)
        for e0 in range(lo, hi, ESC_CHUNK):
            c = tl.load(esc_cols_ptr + e0 + e, mask=e0 + e < hi, other=-1)
            here = (e0 + e < hi) & (c >= k0) & (c < k0 + BLOCK_K)
            r = tl.load(esc_rows_ptr + e0 + e, mask=here, other=0)
            tl.store(w_ptr + (r - n0) * K + c, tl.load(esc_vals_ptr + e0 + e, mask=here, other=0.0), mask=here)


@triton.jit
def _rows_kernel(ids_ptr, plane_ptr, codes_ptr, esc_start_ptr, esc_cols_ptr, esc_vals_ptr, out_ptr, T, N, K, base,
                 code_row, ESCAPES: tl.constexpr, ESC_CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """out [T, K] bfloat16 = the rows `ids` of the compressed matrix (an embedding lookup), a BLOCK_T x
    BLOCK_K tile per program, then each row's escapes in the tile's columns (after a barrier)."""
    HALF: tl.constexpr = BLOCK_K // 2
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < T
    rn = tl.load(ids_ptr + t, mask=live, other=0)
    k0 = tl.program_id(1) * BLOCK_K
    j = tl.arange(0, HALF)
    k_a = k0 + (j // 16) * 32 + j % 16
    k_b = k_a + 16
    byte = _code_bytes(codes_ptr, rn, k0, j, N, code_row)
    out = out_ptr + t[:, None] * K
    tl.store(out + k_a[None, :], _weights(plane_ptr, rn, k_a, byte & 0x0F, base, N, K),
             mask=live[:, None] & (k_a[None, :] < K))
    tl.store(out + k_b[None, :], _weights(plane_ptr, rn, k_b, byte >> 4, base, N, K),
             mask=live[:, None] & (k_b[None, :] < K))
    if ESCAPES:
        tl.debug_barrier()
        e = tl.arange(0, ESC_CHUNK)
        for i in tl.static_range(BLOCK_T):
            ti = tl.program_id(0) * BLOCK_T + i
            if ti < T:
                row = tl.load(ids_ptr + ti)
                lo = tl.load(esc_start_ptr + row)
                hi = tl.load(esc_start_ptr + row + 1)
                for e0 in range(lo, hi, ESC_CHUNK):
                    c = tl.load(esc_cols_ptr + e0 + e, mask=e0 + e < hi, other=-1)
                    here = (e0 + e < hi) & (c >= k0) & (c < k0 + BLOCK_K)
                    tl.store(out_ptr + ti * K + c, tl.load(esc_vals_ptr + e0 + e, mask=here, other=0.0), mask=here)


def rows(w, ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` (any shape) of a `CompressedBF16` in bfloat16, [*ids.shape, K], decoded by the GPU with
    their escapes (an embedding lookup; no host read, so it runs inside a captured graph)."""
    n, k = w.shape
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), k, dtype=torch.bfloat16, device=w.plane.device)
    if flat.numel():
        _rows_kernel[(triton.cdiv(flat.numel(), 16), triton.cdiv(k, BLOCK_K))](
            flat, w.plane, w.codes, w.esc_start, w.esc_cols, w.esc_vals, out, flat.numel(), n, k, w.base,
            w.codes.shape[1], ESCAPES=w.num_escapes > 0, ESC_CHUNK=ESC_CHUNK, BLOCK_T=16, BLOCK_K=BLOCK_K)
    return out.reshape(*ids.shape, k)


# The many-rows path decodes at most this many weights at a time: a bfloat16 buffer of 256 MiB, not the
# whole matrix (an LM head of 128k x 4k would take 1 GiB); the engine's activation profile counts it
# before sizing the KV cache. 64 MiB cut Llama-3-8B's gate_up (117M weights) into four GEMMs: the 8B
# prefill of 2048 tokens on an H200 took 72.7 ms against 65.4-65.6 at 256 MiB (plain 58.6;
# loadtest/results/compression/h200/bench_gpu_llama3_prefill.txt).
DECOMPRESS_CHUNK = DECOMPRESS_BUFFER_BYTES // 2  # (1 << 27; `splitfire plan` reserves the same bytes)


def decompress(w, n0: int = 0, n1: int | None = None, decode: str = "auto", block_n: int | None = None,
               block_k: int | None = None, warps: int | None = None) -> torch.Tensor:
    """Rows n0 .. n1 (all by default) of a `CompressedBF16` in bfloat16, decoded by the GPU with their
    escapes (equal to `w.decompress()[n0:n1]` bit for bit; no host read of the escape index). `decode`:
    "select" zeroes escapes as it decodes (the reference), "fast" leaves them to the escape stores that
    follow; "auto": DECOMPRESS_DECODE. The same bits either way. The tile (block_n x block_k, a multiple
    of 32) and warps: DECOMPRESS_LAUNCH unless given."""
    if decode not in ("auto", "fast", "select"):
        raise ValueError(f"decompress's decode must be auto, fast or select, got {decode!r}")
    select = (DECOMPRESS_DECODE if decode == "auto" else decode) == "select"
    block_n, block_k = block_n or DECOMPRESS_LAUNCH[0], block_k or DECOMPRESS_LAUNCH[1]
    if block_k % 32:
        raise ValueError(f"block_k must be a multiple of 32 (the code bytes' runs), got {block_k}")
    n, k = w.shape
    n1 = n if n1 is None else n1
    out = torch.empty(n1 - n0, k, dtype=torch.bfloat16, device=w.plane.device)
    _decompress_kernel[(triton.cdiv(n1 - n0, block_n), triton.cdiv(k, block_k))](
        w.plane, w.codes, w.esc_start, w.esc_rows, w.esc_cols, w.esc_vals, out, n0, n1, n, k, w.base,
        w.codes.shape[1], ESCAPES=w.num_escapes > 0, ESC_CHUNK=ESC_CHUNK, BLOCK_N=block_n, BLOCK_K=block_k,
        SELECT=select, num_warps=warps or DECOMPRESS_LAUNCH[2])
    return out


def matmul(x: torch.Tensor, w, decode: str = "auto") -> torch.Tensor:
    """x [M, K] @ W^T in float32 (or, from `DECOMPRESS_MIN_ROWS` rows, in x's dtype): the kernel that
    decodes tiles in registers, or the matrix decoded (a chunk of rows at a time) for torch's GEMM.
    `decode`: the kernel's (`compressed_linear`) or the decoder's (`decompress`)."""
    if x.shape[0] < DECOMPRESS_MIN_ROWS:
        return compressed_linear(x, w, decode=decode)
    n, k = w.shape
    step = max(BLOCK_N, DECOMPRESS_CHUNK // k // BLOCK_N * BLOCK_N)
    if step >= n:
        return F.linear(x, decompress(w, decode=decode).to(x.dtype))
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for n0 in range(0, n, step):
        y[:, n0:n0 + step] = F.linear(x, decompress(w, n0, min(n, n0 + step), decode=decode).to(x.dtype))
    return y


# Launch shapes (block_n, block_k, warps, stages) per kernel, the fastest on an H200 over Llama-3-8B's
# four projections. The row kernel with its fast decode: 32 x 256 with 8 warps, 1.11-1.24x of torch's
# bfloat16 time against 1.13-1.66x with 4 warps (bench_compressed_gemm_v6_decodes: 8 warps faster on every
# projection; the 8B decode step 6.43-6.50 ms against 6.76-6.92 with 4 warps below K 8192). The tiles:
# 16 rows 1.90-2.32x with 64 x 64 / 8 warps (bench_compressed_gemm_v4).
GEMV_LAUNCH = (32, 256, 8, 3)
TILES_LAUNCH = (64, 64, 8, 3)
DECODES = ("auto", "fast", "select", "bfloat16")
# What "auto" takes per kernel: the row kernel's fast decode (bench_compressed_gemm_v6_decodes: 1.11-1.24x
# of torch against 1.38-2.06x); the tiles' (16-32 rows, H200, bench_compressed_gemm_v7_tiles_fast: 7-21%
# under select on every projection; the 8B decode step at batch 32 12.54-12.59 ms against 14.26-14.27).
# The decoder (`decompress`, prefill): "fast" skips the escape select (its escapes are stored after):
# 1-4% less time per decode + GEMM at 512 rows, the same at 2048 (bench_compressed_decoder_v7: the
# decoder moves bytes at the copy's rate either way; the select was not its limit).
GEMV_DECODE = "fast"
TILES_DECODE = "fast"
DECOMPRESS_DECODE = "fast"
STAND_IN_MAX_BASE = 128


def stand_ins_fit(base: int) -> bool:
    """Whether the fast decode may let escapes decode as stand-ins: scaled back, a stand-in has exponent
    base + 15, below 2^17 from base 128, so x * stand-in in the escape loop stays finite."""
    return base <= STAND_IN_MAX_BASE


def compressed_linear(x: torch.Tensor, w, plain: torch.Tensor | None = None, block_n: int | None = None,
                      block_k: int | None = None, warps: int | None = None, stages: int | None = None,
                      split_k: int | None = None, block_m: int | None = None,
                      gemv: bool | None = None, decode: str = "auto") -> torch.Tensor:
    """x [M, K] @ W^T in float32, W a `CompressedBF16` (decoded per tile in the kernel, escapes added by
    the tiles' programs), or with `plain` (a bfloat16 [N, K]) the same kernel reading it as is. The
    kernel (one row per program up to GEMV_MAX_ROWS rows, else tensor-core tiles), tile shape, warps,
    pipeline stages and K split are launch choices (the packing does not depend on them).
    `decode`: "fast" ORs each weight's exponent in as 112 + code (weights times 2^(112 - base), the sums
    scaled back once) and lets an escape decode as a finite stand-in that its escape add takes back out
    (no add or select per weight; when the band's top exponent keeps that stand-in small, else as
    "select"): float32 bits in the row kernel (`_weights_f32`), bfloat16 in the tiles (`_weights_scaled`);
    "select" adds base + code and selects escapes to 0; "bfloat16" (the row kernel's reference) widens
    each weight through bfloat16 (`_weights`), as the tiles' select decode does; "auto": GEMV_DECODE or
    TILES_DECODE. The same weights whichever: the sums differ only by the stand-ins' rounding."""
    n, k = w.shape
    m = x.shape[0]
    one_row = m <= GEMV_MAX_ROWS if gemv is None else gemv
    default = GEMV_LAUNCH if one_row else TILES_LAUNCH
    block_n, block_k = block_n or default[0], block_k or default[1]
    warps, stages = warps or default[2], stages or default[3]
    if block_k % 32:
        raise ValueError(f"block_k must be a multiple of 32 (the code bytes' runs), got {block_k}")
    x = x.contiguous()
    bm = (block_m or gemv_rows_for(m)) if one_row else block_m or block_m_for(m)
    if one_row and bm not in GEMV_ROWS:
        raise ValueError(f"the row kernel takes {GEMV_ROWS} rows per program (block_m), got {bm}")
    grid_m, grid_n = triton.cdiv(m, bm), triton.cdiv(n, block_n)
    split = split_k or split_k_for(x.device, grid_m * grid_n, triton.cdiv(k, block_k))
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    args = (x, plain if plain is not None else w.plane, w.plane, w.codes, w.esc_start, w.esc_rows, w.esc_cols,
            w.esc_vals, part, m, n, k, w.base, x.stride(0), w.codes.shape[1])
    consts = dict(PLAIN=plain is not None, ESCAPES=plain is None and w.num_escapes > 0, BLOCK_N=block_n,
                  BLOCK_K=block_k, SPLIT_K=split, ESC_CHUNK=ESC_CHUNK, num_warps=warps, num_stages=stages)
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
    if decode == "auto":
        decode = GEMV_DECODE if one_row else TILES_DECODE
    fast = decode == "fast" and stand_ins_fit(w.base)
    if one_row:
        _gemv_kernel[(grid_m, grid_n, split)](*args, **consts, F32_BITS=decode != "bfloat16", ESC_SELECT=not fast,
                                              ROWS=bm, ESC_ROWS=max(bm, 2))
    else:  # (the tiles decode to bfloat16 either way: "select" and "bfloat16" are the same decode there)
        _matmul_kernel[(grid_m, grid_n, split)](*args, BLOCK_M=bm, F32_DOT=x.device.type != "cuda", FAST=fast,
                                                **consts)
    return part[0] if split == 1 else part.sum(0)
