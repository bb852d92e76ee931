/* splitfire's CPU kernels: weight-only quantized matmul, fused residual add + RMSNorm, and paged
 * decode attention.
 *
 * Quantized matmul: y = x @ dequant(W)^T, W streamed as int8 or int4.
 * Decode reads every weight once per step, so its speed is the bytes moved: int8 moves a quarter
 * of float32, int4 an eighth. Weights are dequantized in registers (8 at a time, AVX2 + FMA) and
 * multiplied against up to MR activation rows, so a weight row is read from memory once per
 * call whatever the batch. Built at first use by `cpu_ops.py` with -march=native; without
 * AVX2/FMA the plain C loops below are what runs (same results, slower).
 *
 * Layouts (see engine/model/quant.py):
 *   int8: q int8 [N, K], w[n,k] = q[n,k] * s[n, k/gs]                     (gs % 8 == 0)
 *   int4: q uint8 [N, K/2]; each run of 16 bytes holds 32 weights, byte j = w[j] | w[j+16] << 4
 *         (GGUF Q4_0/Q4_1 order), w[n,k] = q[n,k] * s[n, k/gs] + m[n, k/gs] (gs % 32 == 0)
 *   fp8:  q float8_e4m3fn bytes [N, K], w[n,k] = e4m3(q[n,k]) * s[n, k/gs]   (gs % 8 == 0)
 *         The int8 loops run it with `f8` set: a code widens exactly, by the 256-entry table in
 *         plain C and, with AVX2, by placing its bits in a float16 (F16C) and scaling by 2^8.
 *
 * Threads take a matmul's row tiles `schedule(guided, 1)`, not in two fixed halves: a served worker
 * shares its cores with its own event loop, the router and the clients, and whichever thread loses
 * its core for a moment would otherwise hold the whole call up (with static halves one stream through
 * `splitfire up` ran 12.9-14.9 ms a token against 7.8 ms for the same step in process; guided: 9.7-9.8,
 * the in-process step unchanged). Each tile is computed the same way whichever thread takes it, so
 * results do not depend on the schedule.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) /* (every AVX2 CPU has F16C) */
#include <immintrin.h>
#define SF_AVX2 1
#else
#define SF_AVX2 0
#endif

#define NR 4      /* weight rows per task */
#define KIND_I8 0 /* weight formats (SfLinear.kind, gemm_panels) */
#define KIND_I4 1
#define KIND_F8 2
#define MAX_ACC 8 /* accumulators per tile: 4 x 1 or 2 x 4 */
#define INLINE static inline __attribute__((always_inline))

int sf_has_avx2(void) { return SF_AVX2; }

/* e4m3 (float8_e4m3fn) -> float: bits s.eeee.mmm, bias 7, no infinities, s.1111.111 is NaN. The
 * table is the reference every FP8 path is held to (tests compare it with torch's own widening). */
static float f8_table[256];
__attribute__((constructor)) static void f8_table_init(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 0x0F, m = b & 7;
        float v = e ? ldexpf(1.0f + (float)m / 8.0f, e - 7) : ldexpf((float)m / 8.0f, -6);
        if ((b & 0x7F) == 0x7F) v = NAN;
        f8_table[b] = (b & 0x80) ? -v : v;
    }
}
void sf_f8_table(float *out) { memcpy(out, f8_table, sizeof f8_table); }
#define F8(q) f8_table[(uint8_t)(q)]

#if SF_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline __m256 load_i8(const int8_t *p, __m256 scale) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))), scale);
}

/* 8 e4m3 codes -> 8 floats times `scale256` (the scale times 2^8): the code's sign to float16's sign,
 * its exponent and mantissa to the low exponent bits and top mantissa bits, so the float16 is the
 * e4m3 value / 2^8 exactly (subnormals included); the product equals F8(q) * scale bit for bit. */
static inline __m256 e4m3_div256(const int8_t *p) {
    /* (b << 8) >> 1 arithmetic leaves s.s.eeee.mmm.0000000: clearing the copied sign bit 14 gives the
     * float16 s.0eeee.mmm0000000 = the e4m3 value / 2^8 (3 integer ops) */
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(b, 8), 1), _mm_set1_epi16((short)0xBFFF));
    return _mm256_cvtph_ps(h);
}
static inline __m256 load_f8(const int8_t *p, __m256 scale256) { return _mm256_mul_ps(e4m3_div256(p), scale256); }

/* The int8 loops' weight load: int8 codes, or (f8, a constant at every call site) e4m3 codes. */
#define LOAD_W(f8, p, sc) ((f8) ? load_f8((p), (sc)) : load_i8((p), (sc)))
#define W_SCALE(f8, v) ((f8) ? (v) * 256.0f : (v))

/* 32 int4 weights (16 bytes) -> 4 vectors of 8 floats, q * s + m. */
static inline void load_i4(const uint8_t *p, __m256 s, __m256 m, __m256 out[4]) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(b, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    out[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), s, m);
    out[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo))), s, m);
    out[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), s, m);
    out[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi))), s, m);
}
#endif

#if SF_AVX2
/* AVX2 tiles. nrt (weight rows) and mrt (activation rows) are constants at every call site, so the
 * accumulators unroll into registers: 16 ymm hold nrt * mrt accumulators, the dequantized weight
 * vectors and the group's scale (and min). Scales are broadcast per group, not kept across groups. */
INLINE void avx_tile_i8(const float *x, int ldx, int K, const int8_t *q, const float *s, int gs, const int f8,
                        int n0, int m0, float *y, int ldy, const int nrt, const int mrt) {
    int groups = K / gs;
    __m256 acc[MAX_ACC];
    for (int a = 0; a < nrt * mrt; a++) acc[a] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256 sc[NR];
        for (int i = 0; i < nrt; i++) sc[i] = _mm256_set1_ps(W_SCALE(f8, s[(size_t)(n0 + i) * groups + g]));
        for (int k = g * gs; k < (g + 1) * gs; k += 8) {
            for (int i = 0; i < nrt; i++) {
                if ((k & 63) == 0) _mm_prefetch((const char *)(q + (size_t)(n0 + i + NR) * K + k), _MM_HINT_T0);
                __m256 w = LOAD_W(f8, q + (size_t)(n0 + i) * K + k, sc[i]);
                for (int r = 0; r < mrt; r++)
                    acc[i * mrt + r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (size_t)(m0 + r) * ldx + k), acc[i * mrt + r]);
            }
        }
    }
    for (int i = 0; i < nrt; i++)
        for (int r = 0; r < mrt; r++) y[(size_t)(m0 + r) * ldy + n0 + i] = hsum(acc[i * mrt + r]);
}

INLINE void avx_tile_i4(const float *x, int ldx, int K, const uint8_t *q, const float *s, const float *mn, int gs,
                        int n0, int m0, float *y, int ldy, const int nrt, const int mrt) {
    int groups = K / gs;
    __m256 acc[MAX_ACC];
    for (int a = 0; a < nrt * mrt; a++) acc[a] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        int g = k / gs;
        for (int i = 0; i < nrt; i++) {
            if ((k & 127) == 0) _mm_prefetch((const char *)(q + ((size_t)(n0 + i + NR) * K + k) / 2), _MM_HINT_T0);
            __m256 w[4];
            load_i4(q + ((size_t)(n0 + i) * K + k) / 2, _mm256_broadcast_ss(s + (size_t)(n0 + i) * groups + g),
                    _mm256_broadcast_ss(mn + (size_t)(n0 + i) * groups + g), w);
            for (int r = 0; r < mrt; r++) {
                const float *xr = x + (size_t)(m0 + r) * ldx + k;
                __m256 a = acc[i * mrt + r];
                for (int j = 0; j < 4; j++) a = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j), a);
                acc[i * mrt + r] = a;
            }
        }
    }
    for (int i = 0; i < nrt; i++)
        for (int r = 0; r < mrt; r++) y[(size_t)(m0 + r) * ldy + n0 + i] = hsum(acc[i * mrt + r]);
}

/* One activation row (decode at batch 1), four weight rows: w = q * s + m is never formed. Per group
 * sum(w x) = s * sum(q x) + m * sum(x), and sum(x) per group (`xs`) is the same for every weight row,
 * so it is computed once per call: 9 vector ops per 32 weights instead of 12, and the min term is
 * one dot product over groups per row. */
INLINE void avx_tile_i4_m1(const float *x, const float *xs, int K, const uint8_t *q, const float *s, const float *mn,
                           int gs, int n0, float *y) {
    int groups = K / gs;
    __m256 acc[NR];
    for (int i = 0; i < NR; i++) acc[i] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        int g = k / gs;
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        __m256 x2 = _mm256_loadu_ps(x + k + 16), x3 = _mm256_loadu_ps(x + k + 24);
        for (int i = 0; i < NR; i++) {
            if ((k & 127) == 0) _mm_prefetch((const char *)(q + ((size_t)(n0 + i + NR) * K + k) / 2), _MM_HINT_T0);
            __m128i b = _mm_loadu_si128((const __m128i *)(q + ((size_t)(n0 + i) * K + k) / 2));
            __m128i mask = _mm_set1_epi8(0x0F);
            __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
            __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), x0);
            p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo))), x1, p);
            p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), x2, p);
            p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi))), x3, p);
            acc[i] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(s + (size_t)(n0 + i) * groups + g), acc[i]);
        }
    }
    for (int i = 0; i < NR; i++) {
        const float *mr = mn + (size_t)(n0 + i) * groups;
        float m = 0.f;
        for (int g = 0; g < groups; g++) m += mr[g] * xs[g];
        y[n0 + i] = hsum(acc[i]) + m;
    }
}

/* Every activation row against weight rows n0..n0+NR: one row at a time 4 weight rows wide (four
 * independent FMA chains); more rows one weight row at a time against up to 8 activation rows, so
 * each weight is dequantized once per 8 rows (a speculative verification's 5 rows: once, not twice
 * as with passes of 4; 2 rows: two weight rows at a time, measured faster). Each case is a separate specialisation so nothing indexes the accumulators
 * at run time. */
#define AVX_ROWS(TILE, ...)                                                                       \
    do {                                                                                          \
        if (M == 1) { TILE(__VA_ARGS__, n0, 0, y, ldy, 4, 1); break; }                            \
        if (M == 2) {                                                                             \
            for (int h = 0; h < NR; h += 2) TILE(__VA_ARGS__, n0 + h, 0, y, ldy, 2, 2);           \
            break;                                                                                \
        }                                                                                         \
        for (int h = 0; h < NR; h++)                                                              \
            for (int m0 = 0; m0 < M; m0 += 8) switch (M - m0 < 8 ? M - m0 : 8) {                  \
                case 1: TILE(__VA_ARGS__, n0 + h, m0, y, ldy, 1, 1); break;                       \
                case 2: TILE(__VA_ARGS__, n0 + h, m0, y, ldy, 1, 2); break;                       \
                case 3: TILE(__VA_ARGS__, n0 + h, m0, y, ldy, 1, 3); break;                       \
                case 4: TILE(__VA_ARGS__, n0 + h, m0, y, ldy, 1, 4); break;                       \
                case 5: TILE(__VA_ARGS__, n0 + h, m0, y, ldy, 1, 5); break;                       \
                case 6: TILE(__VA_ARGS__, n0 + h, m0, y, ldy, 1, 6); break;                       \
                case 7: TILE(__VA_ARGS__, n0 + h, m0, y, ldy, 1, 7); break;                       \
                default: TILE(__VA_ARGS__, n0 + h, m0, y, ldy, 1, 8); break;                      \
            }                                                                                     \
    } while (0)
#endif

/* Plain C: the fallback without AVX2/FMA and for the last (N % tile) output rows. */
static void ref_tile_i8(const float *x, int ldx, int K, const int8_t *q, const float *s, int gs, int f8, int n0,
                        int nr, int m0, int mr, float *y, int ldy) {
    int groups = K / gs;
    for (int i = 0; i < nr; i++) {
        const int8_t *qr = q + (size_t)(n0 + i) * K;
        const float *sr = s + (size_t)(n0 + i) * groups;
        for (int r = 0; r < mr; r++) {
            const float *xr = x + (size_t)(m0 + r) * ldx;
            float total = 0.f;
            for (int g = 0; g < groups; g++) {
                float part = 0.f;
                for (int k = g * gs; k < (g + 1) * gs; k++) part += (f8 ? F8(qr[k]) : (float)qr[k]) * xr[k];
                total += part * sr[g];
            }
            y[(size_t)(m0 + r) * ldy + n0 + i] = total;
        }
    }
}

static void ref_tile_i4(const float *x, int ldx, int K, const uint8_t *q, const float *s, const float *mn, int gs,
                        int n0, int nr, int m0, int mr, float *y, int ldy) {
    int groups = K / gs;
    for (int i = 0; i < nr; i++) {
        const uint8_t *qr = q + (size_t)(n0 + i) * K / 2;
        const float *sr = s + (size_t)(n0 + i) * groups, *mnr = mn + (size_t)(n0 + i) * groups;
        for (int r = 0; r < mr; r++) {
            const float *xr = x + (size_t)(m0 + r) * ldx;
            float total = 0.f;
            for (int g = 0; g < groups; g++) {
                float qx = 0.f, xs = 0.f;
                for (int k = g * gs; k < (g + 1) * gs; k += 32) {
                    const uint8_t *b = qr + k / 2;
                    for (int j = 0; j < 16; j++) {
                        qx += (float)(b[j] & 0x0F) * xr[k + j] + (float)(b[j] >> 4) * xr[k + 16 + j];
                        xs += xr[k + j] + xr[k + 16 + j];
                    }
                }
                total += qx * sr[g] + xs * mnr[g];
            }
            y[(size_t)(m0 + r) * ldy + n0 + i] = total;
        }
    }
}

/* Rows n0..n0+nr of W against every activation row. */
INLINE void rows_i8(const float *x, int ldx, int M, int K, const int8_t *q, const float *s, int gs, const int f8,
                    int n0, int nr, float *y, int ldy) {
#if SF_AVX2
    if (nr == NR) {
        AVX_ROWS(avx_tile_i8, x, ldx, K, q, s, gs, f8);
        return;
    }
#endif
    ref_tile_i8(x, ldx, K, q, s, gs, f8, n0, nr, 0, M, y, ldy);
}

static void rows_i4(const float *x, const float *xs, int ldx, int M, int K, const uint8_t *q, const float *s,
                    const float *mn, int gs, int n0, int nr, float *y, int ldy) {
#if SF_AVX2
    if (nr == NR && xs) {
        avx_tile_i4_m1(x, xs, K, q, s, mn, gs, n0, y);
        return;
    }
    if (nr == NR) {
        AVX_ROWS(avx_tile_i4, x, ldx, K, q, s, mn, gs);
        return;
    }
#endif
    ref_tile_i4(x, ldx, K, q, s, mn, gs, n0, nr, 0, M, y, ldy);
}

#if SF_AVX2
/* ---- Many activation rows: dequantize a panel of weight rows once, then a register-blocked GEMM ----
 * The tiles above re-read activation rows for every weight row (one x load per FMA), which holds a
 * step of 16 rows to ~40% of the FMA peak. Here each thread dequantizes PANEL weight rows into an
 * L1/L2-resident float buffer once per block of MC activation rows, and 3 weight rows x 4
 * activation rows of accumulators (12 of the 16 ymm) share every load: 7 loads per 12 FMAs.
 * The dequantized floats and each dot product's lane order are those of the tiles above, so the
 * results are bit-identical to them. */
#define PANEL 12
#define MC 64

INLINE void deq_row_i8(const int8_t *q, const float *s, int K, int gs, const int f8, float *out) {
    for (int g = 0; g < K / gs; g++) {
        __m256 sc = _mm256_set1_ps(W_SCALE(f8, s[g]));
        for (int k = g * gs; k < (g + 1) * gs; k += 8) _mm256_store_ps(out + k, LOAD_W(f8, q + k, sc));
    }
}

INLINE void deq_row_i4(const uint8_t *q, const float *s, const float *mn, int K, int gs, float *out) {
    for (int k = 0; k < K; k += 32) {
        __m256 w[4];
        load_i4(q + k / 2, _mm256_broadcast_ss(s + k / gs), _mm256_broadcast_ss(mn + k / gs), w);
        for (int j = 0; j < 4; j++) _mm256_store_ps(out + k + 8 * j, w[j]);
    }
}

INLINE void dot_tile(const float *x, int ldx, const float *w, int K, float *y, int ldy, const int nrt, const int mrt) {
    __m256 acc[12];
    for (int a = 0; a < nrt * mrt; a++) acc[a] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        __m256 wv[3];
        for (int i = 0; i < nrt; i++) {
            wv[i] = _mm256_load_ps(w + (size_t)i * K + k);
            __asm__("" : "+x"(wv[i]));
        }
        for (int r = 0; r < mrt; r++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)r * ldx + k);
            __asm__("" : "+x"(xv)); /* in registers: gcc otherwise folds a load into every FMA */
            for (int i = 0; i < nrt; i++) acc[i * mrt + r] = _mm256_fmadd_ps(wv[i], xv, acc[i * mrt + r]);
        }
    }
    for (int i = 0; i < nrt; i++)
        for (int r = 0; r < mrt; r++) y[(size_t)r * ldy + i] = hsum(acc[i * mrt + r]);
}

#define DOT_CASE(NRT)                                                                          \
    switch (mr) {                                                                              \
        case 1: dot_tile(xr, ldx, wr, K, yr, ldy, NRT, 1); break;                              \
        case 2: dot_tile(xr, ldx, wr, K, yr, ldy, NRT, 2); break;                              \
        case 3: dot_tile(xr, ldx, wr, K, yr, ldy, NRT, 3); break;                              \
        default: dot_tile(xr, ldx, wr, K, yr, ldy, NRT, 4); break;                             \
    }

/* Rows m0..m1 of x against the np (<= PANEL) dequantized weight rows in wbuf -> y columns n0.. */
static void panel_gemm(const float *x, int ldx, int m0, int m1, int K, const float *wbuf, int np, float *y, int ldy,
                       int n0) {
    for (int m = m0; m < m1; m += 4) {
        int mr = m1 - m < 4 ? m1 - m : 4;
        for (int i = 0; i < np; i += 3) {
            const float *xr = x + (size_t)m * ldx, *wr = wbuf + (size_t)i * K;
            float *yr = y + (size_t)m * ldy + n0 + i;
            switch (np - i < 3 ? np - i : 3) {
                case 1: DOT_CASE(1); break;
                case 2: DOT_CASE(2); break;
                default: DOT_CASE(3); break;
            }
        }
    }
}

/* Returns 0, or -1 when a thread's panel buffer could not be allocated (the caller then takes the tiles). */
static int gemm_panels(const float *x, int ldx, int M, int K, const void *q, const float *s, const float *mn, int N,
                       int gs, int kind, const float *bias, float *y, int ldy, int threads) {
    int panels = (N + PANEL - 1) / PANEL, failed = 0, groups = K / gs;
#pragma omp parallel num_threads(threads)
    {
        float *wbuf = (float *)aligned_alloc(64, sizeof(float) * PANEL * (size_t)K);
#pragma omp atomic
        failed += wbuf == NULL;
#pragma omp barrier
        if (!failed)
            for (int mc = 0; mc < M; mc += MC) {
                int m1 = M - mc < MC ? M : mc + MC;
#pragma omp for schedule(guided, 1)
                for (int p = 0; p < panels; p++) {
                    int n0 = p * PANEL, np = N - n0 < PANEL ? N - n0 : PANEL;
                    for (int i = 0; i < np; i++) {
                        size_t n = (size_t)(n0 + i);
                        if (kind == KIND_I4)
                            deq_row_i4((const uint8_t *)q + n * K / 2, s + n * groups, mn + n * groups, K, gs,
                                       wbuf + (size_t)i * K);
                        else if (kind == KIND_F8)
                            deq_row_i8((const int8_t *)q + n * K, s + n * groups, K, gs, 1, wbuf + (size_t)i * K);
                        else
                            deq_row_i8((const int8_t *)q + n * K, s + n * groups, K, gs, 0, wbuf + (size_t)i * K);
                    }
                    panel_gemm(x, ldx, mc, m1, K, wbuf, np, y, ldy, n0);
                    if (bias)
                        for (int m = mc; m < m1; m++)
                            for (int i = 0; i < np; i++) y[(size_t)m * ldy + n0 + i] += bias[n0 + i];
                }
            }
        free(wbuf);
    }
    return failed ? -1 : 0;
}
#endif

/* From this many activation rows the panel GEMM replaces the tiles; cpu_ops.py sets it (PANEL_MIN_ROWS). */
static int panel_min_rows = 8;
void sf_set_panel_min_rows(int rows) { panel_min_rows = rows; }

/* y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]); x rows ldx apart, y rows ldy apart.
 * Work is split over output rows, so each thread streams its own slice of W once. */
INLINE void gemm_i8(const float *x, int ldx, int M, int K, const int8_t *q, const float *s, int N, int gs,
                    const float *bias, float *y, int ldy, int threads, const int f8) {
#if SF_AVX2
    if (M >= panel_min_rows &&
        gemm_panels(x, ldx, M, K, q, s, NULL, N, gs, f8 ? KIND_F8 : KIND_I8, bias, y, ldy, threads) == 0)
        return;
#endif
    int tiles = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(guided, 1)
    for (int t = 0; t < tiles; t++) {
        int n0 = t * NR, nr = N - n0 < NR ? N - n0 : NR;
        rows_i8(x, ldx, M, K, q, s, gs, f8, n0, nr, y, ldy);
        if (bias)
            for (int m = 0; m < M; m++)
                for (int i = 0; i < nr; i++) y[(size_t)m * ldy + n0 + i] += bias[n0 + i];
    }
}

void sf_gemm_i8(const float *x, int ldx, int M, int K, const int8_t *q, const float *s, int N, int gs,
                const float *bias, float *y, int ldy, int threads) {
    gemm_i8(x, ldx, M, K, q, s, N, gs, bias, y, ldy, threads, 0);
}

/* q: float8_e4m3fn codes [N, K] (see the layouts above). */
void sf_gemm_f8(const float *x, int ldx, int M, int K, const uint8_t *q, const float *s, int N, int gs,
                const float *bias, float *y, int ldy, int threads) {
    gemm_i8(x, ldx, M, K, (const int8_t *)q, s, N, gs, bias, y, ldy, threads, 1);
}

void sf_gemm_i4(const float *x, int ldx, int M, int K, const uint8_t *q, const float *s, const float *mn, int N,
                int gs, const float *bias, float *y, int ldy, int threads) {
#if SF_AVX2
    if (M >= panel_min_rows && gemm_panels(x, ldx, M, K, q, s, mn, N, gs, KIND_I4, bias, y, ldy, threads) == 0) return;
#endif
    int tiles = (N + NR - 1) / NR;
    float xs_buf[1024], *xs = NULL; /* per-group sums of a single activation row (K <= 32768) */
    if (SF_AVX2 && M == 1 && K / gs <= 1024) {
        xs = xs_buf;
        for (int g = 0; g < K / gs; g++) {
            float t = 0.f;
            for (int j = 0; j < gs; j++) t += x[g * gs + j];
            xs[g] = t;
        }
    }
#pragma omp parallel for num_threads(threads) schedule(guided, 1)
    for (int t = 0; t < tiles; t++) {
        int n0 = t * NR, nr = N - n0 < NR ? N - n0 : NR;
        rows_i4(x, xs, ldx, M, K, q, s, mn, gs, n0, nr, y, ldy);
        if (bias)
            for (int m = 0; m < M; m++)
                for (int i = 0; i < nr; i++) y[(size_t)m * ldy + n0 + i] += bias[n0 + i];
    }
}

/* Rows of W as float32, for prefill-sized batches (then one float32 GEMM) and embedding lookups.
 * Group-at-a-time loops with a constant scale, which the compiler vectorises. */
INLINE void dequant_i8(const int8_t *q, const float *s, int K, int gs, const int64_t *rows, int nrows, float *out,
                       int threads, const int f8) {
    int groups = K / gs;
#pragma omp parallel for num_threads(threads) schedule(guided, 1)
    for (int i = 0; i < nrows; i++) {
        int64_t n = rows ? rows[i] : i;
        const int8_t *qr = q + (size_t)n * K;
        const float *sr = s + (size_t)n * groups;
        float *o = out + (size_t)i * K;
        for (int g = 0; g < groups; g++) {
            float sc = sr[g];
            const int8_t *qg = qr + (size_t)g * gs;
            float *og = o + (size_t)g * gs;
            for (int j = 0; j < gs; j++) og[j] = (f8 ? F8(qg[j]) : (float)qg[j]) * sc;
        }
    }
}

void sf_dequant_i8(const int8_t *q, const float *s, int N, int K, int gs, const int64_t *rows, int nrows,
                   float *out, int threads) {
    (void)N;
    dequant_i8(q, s, K, gs, rows, nrows, out, threads, 0);
}

/* e4m3 codes (through the table: the reference every FP8 path is held to). */
void sf_dequant_f8(const uint8_t *q, const float *s, int N, int K, int gs, const int64_t *rows, int nrows,
                   float *out, int threads) {
    (void)N;
    dequant_i8((const int8_t *)q, s, K, gs, rows, nrows, out, threads, 1);
}

void sf_dequant_i4(const uint8_t *q, const float *s, const float *mn, int N, int K, int gs, const int64_t *rows,
                   int nrows, float *out, int threads) {
    int groups = K / gs;
    (void)N;
#pragma omp parallel for num_threads(threads) schedule(guided, 1)
    for (int i = 0; i < nrows; i++) {
        int64_t n = rows ? rows[i] : i;
        const uint8_t *qr = q + (size_t)n * K / 2;
        float *o = out + (size_t)i * K;
        for (int k = 0; k < K; k += 32) {
            float sc = s[(size_t)n * groups + k / gs], m = mn[(size_t)n * groups + k / gs];
            const uint8_t *b = qr + k / 2;
            float *ok = o + k;
            for (int j = 0; j < 16; j++) ok[j] = (float)(b[j] & 0x0F) * sc + m;
            for (int j = 0; j < 16; j++) ok[16 + j] = (float)(b[j] >> 4) * sc + m;
        }
    }
}

/* ---- Fused residual add + RMSNorm (float32) ----
 * With h: x += h (x is the residual stream, updated in place); then out = x / rms(x) * w.
 * One pass per row instead of torch's five ops (add, pow, mean, rsqrt, mul), each with its own
 * dispatch: measured 40 us -> 2 us per call for a 576-wide row. */
void sf_add_rmsnorm(float *x, const float *h, const float *w, float *out, int rows, int dim, float eps) {
    for (int r = 0; r < rows; r++) {
        float *xr = x + (size_t)r * dim;
        float *o = out + (size_t)r * dim;
        if (h) {
            const float *hr = h + (size_t)r * dim;
            for (int i = 0; i < dim; i++) xr[i] += hr[i];
        }
        double ss = 0.0;
        for (int i = 0; i < dim; i++) ss += (double)xr[i] * xr[i];
        float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
        for (int i = 0; i < dim; i++) o[i] = xr[i] * inv * w[i];
    }
}

/* ---- Paged decode attention (float32 cache) ----
 * One query token per sequence; its keys and values are read in place through the block table
 * (cache layout [blocks, 2, block_size, kv_heads, D]: K then V of a block), so nothing is gathered
 * or padded. Each task scores one query head's keys, then softmax, then the weighted sum of
 * values. `window` > 0 keeps the last `window` keys only (sliding-window layers). */
static inline float dot(const float *a, const float *b, int n) {
#if SF_AVX2
    if (n % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        return hsum(acc);
    }
#endif
    float s = 0.f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int n) {
#if SF_AVX2
    if (n % 8 == 0) {
        __m256 av = _mm256_set1_ps(a);
        for (int i = 0; i < n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        return;
    }
#endif
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

#if SF_AVX2
/* e^x for 8 floats, x <= 0 (softmax after subtracting the max): Cephes' expf polynomial on
 * x - n ln2, scaled by 2^n through the exponent bits; within 2 ulp of expf. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* scores[0..n) <- exp(scores - mx); returns their sum. */
static float exp_shift_sum(float *sc, int64_t n, float mx) {
    int64_t t = 0;
    float sum = 0.f;
#if SF_AVX2
    __m256 acc = _mm256_setzero_ps(), m = _mm256_set1_ps(mx);
    for (; t + 8 <= n; t += 8) {
        __m256 v = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), m));
        _mm256_storeu_ps(sc + t, v);
        acc = _mm256_add_ps(acc, v);
    }
    sum = hsum(acc);
#endif
    for (; t < n; t++) {
        sc[t] = expf(sc[t] - mx);
        sum += sc[t];
    }
    return sum;
}

/* KV cache element types (the `kvk` arguments below; cpu_ops.py KV_KINDS): float32, float16 or e4m3. */
#define KV_F32 0
#define KV_F16 1
#define KV_E4M3 2
#define KV_BYTES(kvk) ((kvk) == KV_F32 ? 4 : (kvk) == KV_F16 ? 2 : 1)

/* float -> e4m3 (float8_e4m3fn) bits, rounding to nearest even and saturating at +-448, as torch's cast:
 * a magic-number add at the spacing of the value's binade (2^(max(e, -6) - 3)) rounds in float32, then the
 * rounded value (exactly an e4m3 number) is encoded. */
static uint8_t f32_to_e4m3(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    float a = fabsf(f);
    if (a != a) return sign | 0x7F;
    if (a > 448.0f) return sign | 0x7E;
    int e = (int)((bits >> 23) & 0xFF) - 127;
    int se = (e < -6 ? -6 : e) - 3;
    uint32_t cbits = ((uint32_t)(se + 150) << 23) | 0x400000u;
    float c;
    memcpy(&c, &cbits, sizeof c);
    volatile float t = a + c; /* (volatile: the add and subtract must round, not fold away) */
    float r = t - c;
    if (r == 0.0f) return sign;
    uint32_t rb;
    memcpy(&rb, &r, sizeof rb);
    int er = (int)((rb >> 23) & 0xFF) - 127;
    if (er < -6) return sign | (uint8_t)(r * 512.0f); /* subnormal: r = m * 2^-9 */
    return sign | (uint8_t)(((er + 7) << 3) | ((rb >> 20) & 7));
}
void sf_e4m3_from_f32(const float *in, uint8_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_e4m3(in[i]);
}

#if SF_AVX2
/* 8 KV-cache numbers as floats: float32 as stored, float16 widened (F16C), or e4m3 placed in float16: the
 * value / 2^8, exactly (e4m3_div256). The 2^8 is folded into the score scale and applied once to each span's
 * output (E4M3_UNIT): no multiply per value. */
#define E4M3_UNIT 256.0f
INLINE __m256 load_kv8(const char *p, const int kvk) {
    if (kvk == KV_E4M3) return e4m3_div256((const int8_t *)p);
    return kvk == KV_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps((const float *)p);
}

/* q against 8 keys: eight independent FMA chains (one chain per key stalls on FMA latency), then a
 * transposing hadd tree leaves the 8 dot products in one vector (one reduction, not 8 hsums). */
INLINE __m256 dot8(const float *q, const char *const k[8], int D, const int kvk) {
    __m256 a[8];
    int esz = KV_BYTES(kvk);
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, load_kv8(k[j] + (size_t)i * esz, kvk), a[j]);
    }
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* Keys (or values) of one kv head in position order without a division per key: (block, offset)
 * stepped along. `plane` 0 = K, 1 = V; bytes throughout. */
typedef struct {
    const char *base;
    const int64_t *table;
    size_t block, plane, slot;
    int64_t blk;
    int off, bs;
} KeyWalk;

static inline KeyWalk key_walk(const char *cache, const int64_t *table, int64_t pos, int bs, size_t slot,
                               size_t head, int plane) {
    KeyWalk w = {cache + head, table, 2 * (size_t)bs * slot, (size_t)plane * bs * slot, slot, pos / bs,
                 (int)(pos % bs), bs};
    return w;
}

static inline const char *next_key(KeyWalk *w) {
    const char *p = w->base + w->table[w->blk] * w->block + w->plane + (size_t)w->off * w->slot;
    if (++w->off == w->bs) {
        w->off = 0;
        w->blk++;
    }
    return p;
}

/* One (sequence, kv head, range of keys) for the G query heads that share the kv head: each key and
 * value is read from memory once for all G (they re-read it from L1), not once per query head. Leaves
 * per head the range's max score m, sum of exp(score - m) l and unnormalized sum of exp(score - m) v,
 * which `sf_paged_decode` merges over ranges. sc: G x n scratch. */
typedef struct {
    const float *q;      /* the G heads' queries, D apart */
    const char *cache;   /* the layer cache, bytes */
    const int64_t *table;
    int64_t start, n;    /* first key position, number of keys */
    int bs, G, D;
    size_t slot, head;   /* bytes per token slot; byte offset of this kv head in a slot */
    float scale;
} Span;

#define V_CHUNK 32 /* values summed per pass over the G heads: 32 x D floats stay in L1 */

#if SF_AVX2
INLINE void span_avx(const Span *sp, float *sc, float *m, float *l, float *o, const int kvk) {
    int G = sp->G, D = sp->D, esz = KV_BYTES(kvk);
    int64_t n = sp->n, t = 0;
    float kscale = kvk == KV_E4M3 ? sp->scale * E4M3_UNIT : sp->scale; /* (keys read / 2^8: see load_kv8) */
    __m256 vscale = _mm256_set1_ps(kscale);
    KeyWalk kw = key_walk(sp->cache, sp->table, sp->start, sp->bs, sp->slot, sp->head, 0);
    for (int g = 0; g < G; g++) m[g] = -INFINITY;
    const char *nk[8];
    if (n >= 8)
        for (int j = 0; j < 8; j++) nk[j] = next_key(&kw);
    for (; t + 8 <= n; t += 8) {
        const char *k[8];
        for (int j = 0; j < 8; j++) k[j] = nk[j];
        if (t + 16 <= n) /* the next 8 keys' addresses, and their lines on the way while these compute */
            for (int j = 0; j < 8; j++) {
                nk[j] = next_key(&kw);
                for (int i = 0; i < D * esz; i += 64) _mm_prefetch(nk[j] + i, _MM_HINT_T0);
            }
        for (int g = 0; g < G; g++) {
            __m256 v = _mm256_mul_ps(dot8(sp->q + (size_t)g * D, k, D, kvk), vscale);
            _mm256_storeu_ps(sc + (size_t)g * n + t, v);
            float m8[8];
            _mm256_storeu_ps(m8, v);
            for (int j = 0; j < 8; j++) m[g] = fmaxf(m[g], m8[j]);
        }
    }
    for (; t < n; t++) {
        const char *k = next_key(&kw);
        for (int g = 0; g < G; g++) {
            __m256 acc = _mm256_setzero_ps();
            const float *qg = sp->q + (size_t)g * D;
            for (int i = 0; i < D; i += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), load_kv8(k + (size_t)i * esz, kvk), acc);
            float v = hsum(acc) * kscale;
            sc[(size_t)g * n + t] = v;
            m[g] = fmaxf(m[g], v);
        }
    }
    for (int g = 0; g < G; g++) l[g] = n ? exp_shift_sum(sc + (size_t)g * n, n, m[g]) : 0.f;
    memset(o, 0, sizeof(float) * (size_t)G * D);
    KeyWalk vw = key_walk(sp->cache, sp->table, sp->start, sp->bs, sp->slot, sp->head, 1);
    for (int64_t u0 = 0; u0 < n; u0 += V_CHUNK) {
        int c = n - u0 < V_CHUNK ? (int)(n - u0) : V_CHUNK;
        const char *v[V_CHUNK];
        for (int u = 0; u < c; u++) v[u] = next_key(&vw);
        for (int g = 0; g < G; g++) {
            const float *w = sc + (size_t)g * n + u0;
            float *og = o + (size_t)g * D;
            for (int d0 = 0; d0 < D; d0 += 64) {
                int nv = D - d0 < 64 ? (D - d0) / 8 : 8;
                __m256 acc[8];
                for (int i = 0; i < nv; i++) acc[i] = _mm256_loadu_ps(og + d0 + 8 * i);
                if (nv == 8) { /* (a constant count: the 8 accumulators stay in registers) */
                    for (int u = 0; u < c; u++) {
                        __m256 wu = _mm256_set1_ps(w[u]);
                        const char *vu = v[u] + (size_t)d0 * esz;
                        for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(wu, load_kv8(vu + (size_t)8 * i * esz, kvk), acc[i]);
                    }
                } else {
                    for (int u = 0; u < c; u++) {
                        __m256 wu = _mm256_set1_ps(w[u]);
                        const char *vu = v[u] + (size_t)d0 * esz;
                        for (int i = 0; i < nv; i++) acc[i] = _mm256_fmadd_ps(wu, load_kv8(vu + (size_t)8 * i * esz, kvk), acc[i]);
                    }
                }
                for (int i = 0; i < nv; i++) _mm256_storeu_ps(og + d0 + 8 * i, acc[i]);
            }
        }
    }
    if (kvk == KV_E4M3) /* the values were read / 2^8 */
        for (size_t i = 0; i < (size_t)G * D; i++) o[i] *= E4M3_UNIT;
}
#endif

/* The same in plain C, float32 cache only. */
static void span_ref(const Span *sp, float *sc, float *m, float *l, float *o) {
    int G = sp->G, D = sp->D;
    int64_t n = sp->n;
    for (int g = 0; g < G; g++) m[g] = -INFINITY;
    KeyWalk kw = key_walk(sp->cache, sp->table, sp->start, sp->bs, sp->slot, sp->head, 0);
    for (int64_t t = 0; t < n; t++) {
        const float *k = (const float *)next_key(&kw);
        for (int g = 0; g < G; g++) {
            float v = dot(sp->q + (size_t)g * D, k, D) * sp->scale;
            sc[(size_t)g * n + t] = v;
            m[g] = fmaxf(m[g], v);
        }
    }
    for (int g = 0; g < G; g++) l[g] = n ? exp_shift_sum(sc + (size_t)g * n, n, m[g]) : 0.f;
    memset(o, 0, sizeof(float) * (size_t)G * D);
    KeyWalk vw = key_walk(sp->cache, sp->table, sp->start, sp->bs, sp->slot, sp->head, 1);
    for (int64_t u = 0; u < n; u++) {
        const float *v = (const float *)next_key(&vw);
        for (int g = 0; g < G; g++) axpy(o + (size_t)g * D, sc[(size_t)g * n + u], v, D);
    }
}

/* Decode attention straight from the paged cache ([blocks, 2, bs, KVH, D], float32, or with `kvk`
 * float16 or e4m3: a half or a quarter of the bytes to stream). Work is split into (sequence, kv head, key range) tasks: one
 * range per pair when there are enough pairs for the threads, else each context cut into as many
 * ranges as keep every thread busy (one sequence with 3 kv heads on 2 threads: 6 tasks, not 3),
 * merged by their max scores (flash-decoding). Returns 0; -1 out of memory; -2 for a float16 or e4m3 cache this
 * build cannot read (needs AVX2 + F16C and D % 8 == 0: the caller checks first). */
int sf_paged_decode(const float *q, int ldq, int B, int H, int KVH, int D, const void *cache, int bs,
                    const int64_t *tables, int max_blocks, const int64_t *ctx_lens, float scale, int window,
                    float *out, int kvk, int threads) {
    int G = H / KVH, failed = 0;
    if (kvk != KV_F32 && (!SF_AVX2 || D % 8)) return -2;
    size_t esz = KV_BYTES(kvk), slot = (size_t)KVH * D * esz;
    int pairs = B * KVH, splits = pairs >= 2 * threads ? 1 : (2 * threads + pairs - 1) / pairs;
    size_t part = (size_t)G * (D + 2); /* per task: G maxima, G sums, G x D partial outputs */
    float *parts = (float *)malloc(sizeof(float) * part * (size_t)pairs * splits);
    if (!parts) return -1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int task = 0; task < pairs * splits; task++) {
        int pair = task / splits, s = task % splits, b = pair / KVH, kh = pair % KVH;
        int64_t ctx = ctx_lens[b];
        int64_t first = window > 0 && ctx > window ? ctx - window : 0, total = ctx - first;
        int64_t k0 = total * s / splits, k1 = total * (s + 1) / splits;
        float *m = parts + part * (size_t)task, *l = m + G, *o = l + G;
        Span sp = {q + (size_t)b * ldq + (size_t)kh * G * D, (const char *)cache, tables + (size_t)b * max_blocks,
                   first + k0, k1 - k0, bs, G, D, slot, (size_t)kh * D * esz, scale};
        float *sc = (float *)malloc(sizeof(float) * (size_t)G * (size_t)(sp.n > 0 ? sp.n : 1));
        if (!sc) {
            failed = 1;
            continue;
        }
#if SF_AVX2
        if (D % 8 == 0) {
            if (kvk == KV_F16)
                span_avx(&sp, sc, m, l, o, KV_F16);
            else if (kvk == KV_E4M3)
                span_avx(&sp, sc, m, l, o, KV_E4M3);
            else
                span_avx(&sp, sc, m, l, o, KV_F32);
        } else
#endif
            span_ref(&sp, sc, m, l, o);
        free(sc);
    }
    if (!failed)
        for (int pair = 0; pair < pairs; pair++) {
            int b = pair / KVH, kh = pair % KVH;
            for (int g = 0; g < G; g++) {
                float mx = -INFINITY, sum = 0.f;
                for (int s = 0; s < splits; s++) mx = fmaxf(mx, parts[part * ((size_t)pair * splits + s) + g]);
                float *dst = out + ((size_t)b * H + (size_t)kh * G + g) * D;
                memset(dst, 0, sizeof(float) * D);
                for (int s = 0; s < splits; s++) {
                    const float *m = parts + part * ((size_t)pair * splits + s), *l = m + G, *o = l + G;
                    if (l[g] == 0.f) continue; /* an empty range */
                    float w = expf(m[g] - mx);
                    sum += l[g] * w;
                    axpy(dst, w, o + (size_t)g * D, D);
                }
                float inv = 1.0f / sum;
                for (int i = 0; i < D; i++) dst[i] *= inv;
            }
        }
    free(parts);
    return failed ? -1 : 0;
}

/* ---- RoPE + KV store (float32 activations; float32, float16 or e4m3 cache by `kvk`) ----
 * qkv rows hold q (H heads), k (KVH heads), v (KVH heads) of D dims, pairs interleaved. q and k are
 * rotated in place by `freqs` ([T, D/2] (cos, sin) pairs, one row per token); k and v are then copied into
 * their cache slots (`k_rows[t]`: row of token t's K in the layer cache viewed as [rows, KVH, D],
 * its V `bs` rows later). Replaces seven torch ops per layer (float casts, complex views,
 * multiply, two index_copy_). Returns 0, or -2 for a float16 or e4m3 cache this build cannot write (needs
 * AVX2 + F16C, D % 8 == 0). */
int sf_rope_store(float *qkv, int T, int H, int KVH, int D, const float *freqs, void *cache, const int64_t *k_rows,
                  int bs, int kvk) {
    int row = (H + 2 * KVH) * D;
    size_t slot = (size_t)KVH * D;
    if (cache && kvk != KV_F32 && (!SF_AVX2 || D % 8)) return -2;
    for (int t = 0; t < T; t++) {
        float *x = qkv + (size_t)t * row;
        const float *f = freqs + (size_t)t * D; /* token t's D/2 (cos, sin) pairs */
        for (int h = 0; h < H + KVH; h++) {
            float *v = x + (size_t)h * D;
            for (int i = 0; i < D / 2; i++) {
                float a = v[2 * i], b = v[2 * i + 1], c = f[2 * i], s = f[2 * i + 1];
                v[2 * i] = a * c - b * s;
                v[2 * i + 1] = a * s + b * c;
            }
        }
        if (!cache) continue;
        const float *k = x + (size_t)H * D, *v = k + slot;
        size_t kr = (size_t)k_rows[t], vr = kr + (size_t)bs;
        if (kvk == KV_F32) {
            memcpy((float *)cache + kr * slot, k, sizeof(float) * slot);
            memcpy((float *)cache + vr * slot, v, sizeof(float) * slot);
            continue;
        }
        if (kvk == KV_E4M3) {
            sf_e4m3_from_f32(k, (uint8_t *)cache + kr * slot, (int64_t)slot);
            sf_e4m3_from_f32(v, (uint8_t *)cache + vr * slot, (int64_t)slot);
            continue;
        }
#if SF_AVX2
        uint16_t *ck = (uint16_t *)cache + kr * slot, *cv = (uint16_t *)cache + vr * slot;
        for (size_t i = 0; i < slot; i += 8) { /* round to nearest even, as torch's .half() */
            _mm_storeu_si128((__m128i *)(ck + i), _mm256_cvtps_ph(_mm256_loadu_ps(k + i), _MM_FROUND_TO_NEAREST_INT));
            _mm_storeu_si128((__m128i *)(cv + i), _mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT));
        }
#endif
    }
    return 0;
}

/* ---- SiLU(gate) * up (float32) ---- gate_up rows are [gate (I) | up (I)].
 * The reference: libm's expf per element (a batch-16 SmolLM2 step spent ~3% of its samples here, on one
 * thread while the other waited). */
void sf_silu_mul_ref(const float *gate_up, float *out, int T, int I) {
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + (size_t)t * 2 * I, *u = g + I;
        float *o = out + (size_t)t * I;
        for (int i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

#if SF_AVX2
/* SiLU of 8 floats through exp8 on -|g| (its domain, x <= 0): g / (1 + e^-g) for g >= 0 and
 * g e^g / (1 + e^g) below, the same value; within a few ulp of the reference (a test bounds it). */
static inline __m256 silu8(__m256 g) {
    __m256 e = exp8(_mm256_or_ps(g, _mm256_set1_ps(-0.0f))); /* e^-|g| */
    __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), g); /* (sign of g picks g * e) */
    return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
#endif

void sf_silu_mul(const float *gate_up, float *out, int T, int I) {
#if SF_AVX2
    int vec = I & ~7;
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + (size_t)t * 2 * I, *u = g + I;
        float *o = out + (size_t)t * I;
        for (int i = 0; i < vec; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
        for (int i = vec; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
#else
    sf_silu_mul_ref(gate_up, out, T, I);
#endif
}

/* ---- Integer dot products: activations quantized to int8 per 32-block (as llama.cpp's Q8) ----
 * Dequantizing weights to float costs ~24 instructions per 32 weights; multiplying int4/int8 codes
 * by int8 activations with maddubs/madd costs ~12, which is what keeps llama.cpp's decode at the
 * memory-bandwidth floor on AVX2. Activations are rounded per block of 32 (scale = max|x| / 127), so
 * results differ from the float path by that rounding (measured: loadtest/bench_quant.py). */
#if SF_AVX2
typedef struct {
    int8_t *q;   /* [M, K] */
    float *d;    /* [M, K/32] block scales */
    float *sum;  /* [M, K/32] d * sum(q) of the block: the int4 min term's activation sum */
} QuantX;

static int quantize_x(const float *x, int ldx, int M, int K, QuantX *out) {
    int blocks = K / 32;
    out->q = (int8_t *)malloc((size_t)M * K);
    out->d = (float *)malloc(sizeof(float) * (size_t)M * blocks);
    out->sum = (float *)malloc(sizeof(float) * (size_t)M * blocks);
    if (!out->q || !out->d || !out->sum) return -1;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < blocks; b++) {
            const float *xb = x + (size_t)m * ldx + b * 32;
            float amax = 0.f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
            float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
            int8_t *qb = out->q + (size_t)m * K + b * 32;
            int total = 0;
            for (int j = 0; j < 32; j++) {
                qb[j] = (int8_t)lrintf(xb[j] * inv);
                total += qb[j];
            }
            out->d[(size_t)m * blocks + b] = d;
            out->sum[(size_t)m * blocks + b] = d * (float)total;
        }
    return 0;
}

static void free_x(QuantX *x) {
    free(x->q);
    free(x->d);
    free(x->sum);
}

static inline __m256i unpack_i4(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}

/* 32 products of unsigned codes (0..15) or |x| (0..127) with signed bytes, summed into 8 int32 lanes. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

INLINE void q8_tile(const QuantX *xq, int K, const void *q, const float *s, const float *mn, int gs, int n0, int m0,
                    float *y, int ldy, const int int4, const int nrt, const int mrt) {
    int groups = K / gs, blocks = K / 32;
    __m256 acc[MAX_ACC];
    float macc[MAX_ACC];
    for (int a = 0; a < nrt * mrt; a++) {
        acc[a] = _mm256_setzero_ps();
        macc[a] = 0.f;
    }
    for (int b = 0; b < blocks; b++) {
        int g = b * 32 / gs;
        __m256i xv[4], xabs[4];
        __m256 dx[4];
        for (int r = 0; r < mrt; r++) {
            size_t row = (size_t)(m0 + r);
            xv[r] = _mm256_loadu_si256((const __m256i *)(xq->q + row * K + b * 32));
            xabs[r] = _mm256_sign_epi8(xv[r], xv[r]);
            dx[r] = _mm256_set1_ps(xq->d[row * blocks + b]);
        }
        for (int i = 0; i < nrt; i++) {
            size_t n = (size_t)(n0 + i);
            __m256 ws = _mm256_set1_ps(s[n * groups + g]);
            if (int4 ? (b & 3) == 0 : (b & 1) == 0)
                _mm_prefetch((const char *)q + ((n + NR) * K + b * 32) / (int4 ? 2 : 1), _MM_HINT_T0);
            __m256i w = int4 ? unpack_i4((const uint8_t *)q + (n * K + b * 32) / 2)
                             : _mm256_loadu_si256((const __m256i *)((const int8_t *)q + n * K + b * 32));
            for (int r = 0; r < mrt; r++) {
                __m256i dotv = int4 ? dot_u8s8(w, xv[r]) : dot_u8s8(xabs[r], _mm256_sign_epi8(w, xv[r]));
                acc[i * mrt + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dotv), _mm256_mul_ps(ws, dx[r]), acc[i * mrt + r]);
                if (int4) macc[i * mrt + r] += mn[n * groups + g] * xq->sum[(size_t)(m0 + r) * blocks + b];
            }
        }
    }
    for (int i = 0; i < nrt; i++)
        for (int r = 0; r < mrt; r++) y[(size_t)(m0 + r) * ldy + n0 + i] = hsum(acc[i * mrt + r]) + macc[i * mrt + r];
}

#define Q8_ROWS(INT4)                                                                                         \
    do {                                                                                                      \
        if (M == 1) { q8_tile(&xq, K, q, s, mn, gs, n0, 0, y, ldy, INT4, 4, 1); break; }                      \
        for (int h = 0; h < NR; h += 2)                                                                       \
            for (int m0 = 0; m0 < M; m0 += 4) switch (M - m0 < 4 ? M - m0 : 4) {                              \
                case 1: q8_tile(&xq, K, q, s, mn, gs, n0 + h, m0, y, ldy, INT4, 2, 1); break;                 \
                case 2: q8_tile(&xq, K, q, s, mn, gs, n0 + h, m0, y, ldy, INT4, 2, 2); break;                 \
                case 3: q8_tile(&xq, K, q, s, mn, gs, n0 + h, m0, y, ldy, INT4, 2, 3); break;                 \
                default: q8_tile(&xq, K, q, s, mn, gs, n0 + h, m0, y, ldy, INT4, 2, 4); break;                \
            }                                                                                                 \
    } while (0)
#endif

/* y = x @ W^T (+ bias) with x rounded to int8 per 32-block. Needs AVX2, K % 32 == 0 and gs % 32 == 0
 * (returns 1 otherwise: the caller takes the float kernel); -1 when out of memory. */
int sf_gemm_q8x(const float *x, int ldx, int M, int K, const void *q, const float *s, const float *mn, int N, int gs,
                int int4, const float *bias, float *y, int ldy, int threads) {
#if SF_AVX2
    if (K % 32 || gs % 32) return 1;
    QuantX xq;
    if (quantize_x(x, ldx, M, K, &xq) != 0) {
        free_x(&xq);
        return -1;
    }
    int tiles = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(guided, 1)
    for (int t = 0; t < tiles; t++) {
        int n0 = t * NR, nr = N - n0 < NR ? N - n0 : NR;
        if (nr == NR) {
            if (int4) Q8_ROWS(1); else Q8_ROWS(0);
        } else if (int4) {
            ref_tile_i4(x, ldx, K, (const uint8_t *)q, s, mn, gs, n0, nr, 0, M, y, ldy);
        } else {
            ref_tile_i8(x, ldx, K, (const int8_t *)q, s, gs, 0, n0, nr, 0, M, y, ldy);
        }
        if (bias)
            for (int m = 0; m < M; m++)
                for (int i = 0; i < nr; i++) y[(size_t)m * ldy + n0 + i] += bias[n0 + i];
    }
    free_x(&xq);
    return 0;
#else
    (void)x; (void)ldx; (void)M; (void)K; (void)q; (void)s; (void)mn; (void)N; (void)gs; (void)int4; (void)bias;
    (void)y; (void)ldy; (void)threads;
    return 1;
#endif
}

/* ---- A whole decode step's decoder layers in one call ----
 * The same kernels as above, in the order `model.Block` calls them, without returning to Python
 * between them: a batch-1 SmolLM2 step made ~13 Python-level calls per layer (390 per step, ~4 ms
 * of a 16 ms step, measured). For plain pre-norm layers only: fused q|k|v and gate|up weights
 * quantized in one part each, float32 activations and KV cache, RMSNorm, SiLU, RoPE on q and k. */
typedef struct {
    const void *q;      /* codes: int8 [N, K], packed int4 [N, K/2] or e4m3 [N, K] */
    const float *s;     /* [N, K/gs] */
    const float *mn;    /* int4 mins [N, K/gs], else NULL */
    const float *bias;  /* [N] or NULL */
    int n, k, gs;
    int kind;           /* KIND_I8, KIND_I4 or KIND_F8 */
    int q8x;            /* int8-rounded activations allowed (at most `q8x_rows` rows) */
    const void *la;     /* LoRA adapters' A stacked by slot [S, lr, K], or NULL (lora.LoRAWeights) */
    const void *lb;     /* ... their B (scale folded in), transposed: [S, lr, N] */
    int lr;             /* rank capacity: the widest adapter this projection takes */
    int lhalf;          /* la and lb hold float16 (--lora-dtype float16), else float32 */
} SfLinear;

typedef struct {
    const float *attn_norm, *mlp_norm; /* [hidden] */
    SfLinear qkv, o, gate_up, down;
    void *cache;                       /* this layer's [blocks, 2, bs, KVH, D], of the type `kvk` names */
    int window;                        /* sliding window, 0 = none */
    int rope;                          /* which of the step's RoPE tables */
} SfLayer;

typedef struct {
    int hidden, heads, kv_heads, head_dim, inter, block_size, q8x_rows;
    int kvk;                           /* the KV cache's element type: KV_F32, KV_F16 or KV_E4M3 */
    float eps, scale;
} SfDims;

static int sf_linear(const SfLinear *w, const float *x, int M, float *y, int q8x_rows, int threads) {
    if (w->q8x && w->kind != KIND_F8 && M <= q8x_rows) {
        int rc = sf_gemm_q8x(x, w->k, M, w->k, w->q, w->s, w->mn, w->n, w->gs, w->kind == KIND_I4, w->bias, y, w->n,
                             threads);
        if (rc <= 0) return rc;
    }
    if (w->kind == KIND_I4)
        sf_gemm_i4(x, w->k, M, w->k, (const uint8_t *)w->q, w->s, w->mn, w->n, w->gs, w->bias, y, w->n, threads);
    else if (w->kind == KIND_F8)
        sf_gemm_f8(x, w->k, M, w->k, (const uint8_t *)w->q, w->s, w->n, w->gs, w->bias, y, w->n, threads);
    else
        sf_gemm_i8(x, w->k, M, w->k, (const int8_t *)w->q, w->s, w->n, w->gs, w->bias, y, w->n, threads);
    return 0;
}

/* LoRA deltas of a step's rows, in place: y[m] += (x[m] A[s]^T) B[s]^T for every row m whose adapter slot
 * s = row_slot[m] is >= 0 (-1: the base model), accumulated in float32. A step reads every present
 * adapter's factors once per row of it: memory-bound, hence float16 factors (half the bytes) as an option.
 * One body for both element types (LORA_ROWS below). */
static inline float sf_half(uint16_t h) { /* IEEE half -> float, portable (F16C does it in the vector path) */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#define F32_1(p) (*(p))
#define F16_1(p) sf_half(*(p))
#if SF_AVX2
#define F32_8(p) _mm256_loadu_ps(p)
#define F16_8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#endif

#if SF_AVX2
#define LORA_SHRINK4(T_, LOAD8, LOAD1)                                                                         \
    __m256 v0 = _mm256_setzero_ps(), v1 = v0, v2 = v0, v3 = v0;                                                \
    for (; k + 8 <= K; k += 8) {                                                                               \
        __m256 xv = _mm256_loadu_ps(xm + k);                                                                   \
        v0 = _mm256_fmadd_ps(xv, LOAD8(a0 + k), v0);                                                           \
        v1 = _mm256_fmadd_ps(xv, LOAD8(a1 + k), v1);                                                           \
        v2 = _mm256_fmadd_ps(xv, LOAD8(a2 + k), v2);                                                           \
        v3 = _mm256_fmadd_ps(xv, LOAD8(a3 + k), v3);                                                           \
    }                                                                                                          \
    float l0[8], l1[8], l2[8], l3[8];                                                                          \
    _mm256_storeu_ps(l0, v0); _mm256_storeu_ps(l1, v1); _mm256_storeu_ps(l2, v2); _mm256_storeu_ps(l3, v3);    \
    for (int j = 0; j < 8; j++) { s0 += l0[j]; s1 += l1[j]; s2 += l2[j]; s3 += l3[j]; }
#define LORA_EXPAND16(LOAD8)                                                                                   \
    for (; n + 16 <= n1; n += 16) {                                                                            \
        __m256 acc0 = _mm256_loadu_ps(ym + n), acc1 = _mm256_loadu_ps(ym + n + 8);                             \
        for (int r = 0; r < R; r++) {                                                                          \
            __m256 c = _mm256_set1_ps(tm[r]);                                                                  \
            acc0 = _mm256_fmadd_ps(c, LOAD8(bt + (size_t)r * N + n), acc0);                                    \
            acc1 = _mm256_fmadd_ps(c, LOAD8(bt + (size_t)r * N + n + 8), acc1);                                \
        }                                                                                                      \
        _mm256_storeu_ps(ym + n, acc0);                                                                        \
        _mm256_storeu_ps(ym + n + 8, acc1);                                                                    \
    }
#else
#define LORA_SHRINK4(T_, LOAD8, LOAD1)
#define LORA_EXPAND16(LOAD8)
#endif

#define LORA_ROWS(NAME, T_, LOAD8, LOAD1)                                                                      \
    static int NAME(const SfLinear *w, const float *x, int T, float *y, const int64_t *row_slot, int threads) { \
        int K = w->k, N = w->n, R = w->lr;                                                                     \
        float *t = (float *)calloc((size_t)T * (size_t)R, sizeof(float));                                      \
        if (!t) return -1;                                                                                     \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                      \
        for (int m = 0; m < T; m++) {                                                                          \
            int64_t sl = row_slot[m];                                                                          \
            if (sl < 0) continue;                                                                              \
            const float *xm = x + (size_t)m * K;                                                               \
            const T_ *a = (const T_ *)w->la + (size_t)sl * R * K;                                              \
            int r = 0;                                                                                         \
            for (; r + 4 <= R; r += 4) {                                                                       \
                const T_ *a0 = a + (size_t)r * K, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;                    \
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;                                              \
                int k = 0;                                                                                     \
                LORA_SHRINK4(T_, LOAD8, LOAD1)                                                                 \
                for (; k < K; k++) {                                                                           \
                    float xv = xm[k];                                                                          \
                    s0 += xv * LOAD1(a0 + k); s1 += xv * LOAD1(a1 + k);                                        \
                    s2 += xv * LOAD1(a2 + k); s3 += xv * LOAD1(a3 + k);                                        \
                }                                                                                              \
                float *tr = t + (size_t)m * R + r;                                                             \
                tr[0] = s0; tr[1] = s1; tr[2] = s2; tr[3] = s3;                                                \
            }                                                                                                  \
            for (; r < R; r++) {                                                                               \
                const T_ *ar = a + (size_t)r * K;                                                              \
                float acc = 0.0f;                                                                              \
                for (int k = 0; k < K; k++) acc += xm[k] * LOAD1(ar + k);                                      \
                t[(size_t)m * R + r] = acc;                                                                    \
            }                                                                                                  \
        }                                                                                                      \
        const int NB = 256;                                                                                    \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                      \
        for (int n0 = 0; n0 < N; n0 += NB) {                                                                   \
            int n1 = N - n0 < NB ? N : n0 + NB;                                                                \
            for (int m = 0; m < T; m++) {                                                                      \
                int64_t sl = row_slot[m];                                                                      \
                if (sl < 0) continue;                                                                          \
                float *ym = y + (size_t)m * N;                                                                 \
                const float *tm = t + (size_t)m * R;                                                           \
                const T_ *bt = (const T_ *)w->lb + (size_t)sl * R * N;                                         \
                int n = n0;                                                                                    \
                LORA_EXPAND16(LOAD8)                                                                           \
                for (; n < n1; n++) {                                                                          \
                    float acc = ym[n];                                                                         \
                    for (int r = 0; r < R; r++) acc += tm[r] * LOAD1(bt + (size_t)r * N + n);                  \
                    ym[n] = acc;                                                                               \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        free(t);                                                                                               \
        return 0;                                                                                              \
    }

LORA_ROWS(sf_lora_rows_f32, float, F32_8, F32_1)
LORA_ROWS(sf_lora_rows_f16, uint16_t, F16_8, F16_1)

static int sf_lora_rows(const SfLinear *w, const float *x, int T, float *y, const int64_t *row_slot, int threads) {
    return w->lhalf ? sf_lora_rows_f16(w, x, T, y, row_slot, threads) : sf_lora_rows_f32(w, x, T, y, row_slot, threads);
}

static int sf_linear_lora(const SfLinear *w, const float *x, int M, float *y, int q8x_rows, int threads,
                          const int64_t *row_slot) {
    int rc = sf_linear(w, x, M, y, q8x_rows, threads);
    if (rc == 0 && row_slot && w->la) rc = sf_lora_rows(w, x, M, y, row_slot, threads);
    return rc;
}

/* res [T, hidden]: the residual stream (the embeddings in, updated in place); h [T, hidden]: the last
 * layer's MLP output (the caller adds it and applies the final norm). One decode row per sequence,
 * `freqs[r]` the step's [T, D/2] (cos, sin) pairs of RoPE table r. Returns 0, -1 out of memory, or -2: a
 * float16 or e4m3 cache this build cannot use. */
/* aux (optional, EAGLE-3): [T, n_aux * hidden], the residual stream entering layers aux_layers[j] (ascending).
 * row_slot (optional): each row's LoRA adapter slot, -1 for the base model (NULL: no adapter rows). */
int sf_decode_layers(const SfDims *d, const SfLayer *layers, int n_layers, float *res, float *h, int T,
                     const float *const *freqs, const int64_t *k_rows, const int64_t *tables, int max_blocks,
                     const int64_t *ctx_lens, float *aux, const int *aux_layers, int n_aux, int threads,
                     const int64_t *row_slot) {
    int H = d->heads, KVH = d->kv_heads, D = d->head_dim;
    size_t hid = (size_t)d->hidden, qkv_n = (size_t)(H + 2 * KVH) * D, inter = (size_t)d->inter;
    size_t need = hid + qkv_n + (size_t)H * D + 2 * inter + inter;
    float *buf = (float *)malloc(sizeof(float) * need * (size_t)T);
    if (!buf) return -1;
    float *xn = buf, *qkv = xn + hid * T, *att = qkv + qkv_n * T, *gu = att + (size_t)H * D * T, *act = gu + 2 * inter * T;
    int rc = 0;
    for (int l = 0; l < n_layers && rc == 0; l++) {
        const SfLayer *L = layers + l;
        for (int j = 0; j < n_aux; j++) {
            if (aux_layers[j] != l) continue;
            for (int r = 0; r < T; r++) {
                float *dst = aux + ((size_t)r * n_aux + j) * hid;
                const float *a = res + (size_t)r * hid, *b = h + (size_t)r * hid;
                for (size_t i = 0; i < hid; i++) dst[i] = l ? a[i] + b[i] : a[i];
            }
        }
        sf_add_rmsnorm(res, l ? h : NULL, L->attn_norm, xn, T, (int)hid, d->eps);
        if ((rc = sf_linear_lora(&L->qkv, xn, T, qkv, d->q8x_rows, threads, row_slot))) break;
        if ((rc = sf_rope_store(qkv, T, H, KVH, D, freqs[L->rope], L->cache, k_rows, d->block_size, d->kvk))) break;
        if ((rc = sf_paged_decode(qkv, (int)qkv_n, T, H, KVH, D, L->cache, d->block_size, tables, max_blocks, ctx_lens,
                                  d->scale, L->window, att, d->kvk, threads)))
            break;
        if ((rc = sf_linear_lora(&L->o, att, T, h, d->q8x_rows, threads, row_slot))) break;
        sf_add_rmsnorm(res, h, L->mlp_norm, xn, T, (int)hid, d->eps);
        if ((rc = sf_linear_lora(&L->gate_up, xn, T, gu, d->q8x_rows, threads, row_slot))) break;
        sf_silu_mul(gu, act, T, (int)inter);
        if ((rc = sf_linear_lora(&L->down, act, T, h, d->q8x_rows, threads, row_slot))) break;
    }
    free(buf);
    return rc;
}

/* Lossless weight compression (engine/loading/compressed.py): 16-bit weights back from their two byte
 * planes. bfloat16: raw = sign << 7 | mantissa, coded = the exponent; float16: raw = the low byte, coded
 * = the high byte. One pass at memory speed; compressed.join's numpy expressions are the reference. */
void sf_join16(const uint8_t *raw, const uint8_t *coded, uint16_t *out, int64_t n, int bf16) {
    if (bf16) {
        for (int64_t i = 0; i < n; i++)
            out[i] = (uint16_t)(((raw[i] & 0x80u) << 8) | ((uint32_t)coded[i] << 7) | (raw[i] & 0x7Fu));
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = (uint16_t)(((uint32_t)coded[i] << 8) | raw[i]);
    }
}

/* sf_join16's inverse (compressed.split): 16-bit patterns into the raw plane (bf16: sign << 7 | mantissa;
 * float16: the low byte) and the coded plane (bf16: the exponent; float16: the high byte), one pass. */
void sf_split16(const uint16_t *in, uint8_t *raw, uint8_t *coded, int64_t n, int bf16) {
    if (bf16) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = in[i];
            raw[i] = (uint8_t)(((u >> 8) & 0x80u) | (u & 0x7Fu));
            coded[i] = (uint8_t)(u >> 7);
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            raw[i] = (uint8_t)in[i];
            coded[i] = (uint8_t)(in[i] >> 8);
        }
    }
}

/* counts[b] += how many of in[0..n) are b: four sub-histograms, so a run of one byte value (an exponent
 * plane is mostly a few) does not serialize on one counter's store-to-load forwarding. */
void sf_count_bytes(const uint8_t *in, int64_t n, int64_t *counts) {
    uint32_t h[4][256];
    memset(h, 0, sizeof(h));
    while (n > 0) { /* (in blocks: a uint32 counter cannot overflow within one) */
        int64_t m = n < (1LL << 30) ? n : (1LL << 30), i = 0;
        for (; i + 4 <= m; i += 4) {
            h[0][in[i]]++;
            h[1][in[i + 1]]++;
            h[2][in[i + 2]]++;
            h[3][in[i + 3]]++;
        }
        for (; i < m; i++) h[0][in[i]]++;
        for (int b = 0; b < 256; b++) {
            counts[b] += (int64_t)h[0][b] + h[1][b] + h[2][b] + h[3][b];
            h[0][b] = h[1][b] = h[2][b] = h[3][b] = 0;
        }
        in += m;
        n -= m;
    }
}

/* One activation row times a bfloat16 matrix held compressed in memory (engine/model/compressed_weight.py's
 * CompressedBF16): y[n] = sum_k x[k] * W[n, k], each weight rebuilt in registers from its sign+mantissa
 * byte (`plane`) and its 4-bit exponent code (in each run of 32 columns, code byte i holds column i low
 * and column i + 16 high; exponent = base + code; 15 an escape, 0 in the dense loop, its weight added
 * after from the row's CSR list). `sf_gemv_bf16` is the same loop on plain bfloat16 weights. The CPU half
 * of the compressed-weights question: does decoding in the kernel keep up with memory
 * (`python -m loadtest.bench_compressed_cpu`)? Rows are split over threads; the scalar tail and the
 * plain-C build (no AVX2) compute the same sums in another order. */
static inline float sf_bf16_f32(uint32_t bits16) {
    uint32_t u = bits16 << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t sf_cbf16_bits(uint8_t p, uint32_t code, int base) {
    return code == 15 ? 0u : (((uint32_t)(p & 0x80u) << 8) | ((uint32_t)(base + (int)code) << 7) | (p & 0x7Fu));
}

#if SF_AVX2
static inline __m256 sf_cbf16_8(__m128i p8, __m128i c8, __m256i vbase) {
    /* the low 8 bytes of p8 and c8: 8 weights as float32 (bfloat16 << 16), escapes as 0 */
    __m256i p = _mm256_cvtepu8_epi32(p8), c = _mm256_cvtepu8_epi32(c8);
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(p, _mm256_set1_epi32(0x80)), 24);
    __m256i man = _mm256_slli_epi32(_mm256_and_si256(p, _mm256_set1_epi32(0x7F)), 16);
    __m256i ex = _mm256_slli_epi32(_mm256_add_epi32(c, vbase), 23);
    __m256i bits = _mm256_or_si256(_mm256_or_si256(sign, man), ex);
    bits = _mm256_andnot_si256(_mm256_cmpeq_epi32(c, _mm256_set1_epi32(15)), bits);
    return _mm256_castsi256_ps(bits);
}
#endif

static float sf_cbf16_row(const float *x, int K, const uint8_t *p, const uint8_t *c, int base) {
    float acc = 0.0f;
    int k = 0;
#if SF_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    const __m256i vbase = _mm256_set1_epi32(base);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (; k + 32 <= K; k += 32) {
        __m128i cb = _mm_loadu_si128((const __m128i *)(c + k / 2));
        __m128i lo = _mm_and_si128(cb, low4), hi = _mm_and_si128(_mm_srli_epi16(cb, 4), low4);
        __m128i pa = _mm_loadu_si128((const __m128i *)(p + k)), pb = _mm_loadu_si128((const __m128i *)(p + k + 16));
        a0 = _mm256_fmadd_ps(sf_cbf16_8(pa, lo, vbase), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(sf_cbf16_8(_mm_srli_si128(pa, 8), _mm_srli_si128(lo, 8), vbase),
                             _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(sf_cbf16_8(pb, hi, vbase), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(sf_cbf16_8(_mm_srli_si128(pb, 8), _mm_srli_si128(hi, 8), vbase),
                             _mm256_loadu_ps(x + k + 24), a3);
    }
    acc = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; k < K; k++) {
        int run = k / 32, j = k % 32;
        uint32_t code = (c[run * 16 + j % 16] >> (j < 16 ? 0 : 4)) & 15u;
        acc += x[k] * sf_bf16_f32(sf_cbf16_bits(p[k], code, base));
    }
    return acc;
}

void sf_gemv_cbf16(const float *x, int K, const uint8_t *plane, const uint8_t *codes, int code_row, int base,
                   const int32_t *esc_start, const int32_t *esc_cols, const uint16_t *esc_vals, int N, float *y,
                   int threads) {
    #pragma omp parallel for schedule(guided, 16) num_threads(threads)
    for (int n = 0; n < N; n++) {
        float acc = sf_cbf16_row(x, K, plane + (int64_t)n * K, codes + (int64_t)n * code_row, base);
        for (int32_t e = esc_start[n]; e < esc_start[n + 1]; e++) acc += x[esc_cols[e]] * sf_bf16_f32(esc_vals[e]);
        y[n] = acc;
    }
}

void sf_gemv_bf16(const float *x, int K, const uint16_t *w, int N, float *y, int threads) {
    #pragma omp parallel for schedule(guided, 16) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const uint16_t *r = w + (int64_t)n * K;
        float acc = 0.0f;
        int k = 0;
#if SF_AVX2
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (; k + 16 <= K; k += 16) {
            __m256i b0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r + k)));
            __m256i b1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r + k + 8)));
            a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b0, 16)), _mm256_loadu_ps(x + k), a0);
            a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b1, 16)), _mm256_loadu_ps(x + k + 8), a1);
        }
        acc = hsum(_mm256_add_ps(a0, a1));
#endif
        for (; k < K; k++) acc += x[k] * sf_bf16_f32(r[k]);
        y[n] = acc;
    }
}

/* Raw DEFLATE streams of literals only (what compressed.py writes for exponent chunks), decoded
 * table-first: a 4,096-entry table indexed by the next 12 bits gives up to six literals and the bits they
 * take at once (an exponent plane's codes are mostly 1-6 bits long), codes longer than
 * that are decoded one bit at a time (puff's canonical walk); stored and fixed-code blocks are read too.
 * A stream that uses a length/distance pair (LZ77, not written by compressed.py) answers SF_INF_UNSUPPORTED
 * and the caller hands it to zlib; a corrupt one answers SF_INF_CORRUPT — never a read or write out of
 * bounds. zlib.decompress is the reference (tests hold the two equal, corrupted streams included). */
#define SF_INF_LUT 12
#define SF_INF_CORRUPT (-1)
#define SF_INF_UNSUPPORTED (-2)

typedef struct {
    const uint8_t *in;
    int64_t n, pos; /* pos may run past n: zero bits are read there, and `sf_inf_overrun` says so */
    uint64_t buf;
    int cnt;
} sf_bits;

static inline void sf_inf_refill(sf_bits *b) {
    if (b->pos + 8 <= b->n) {
        uint64_t w;
        memcpy(&w, b->in + b->pos, 8);
        b->buf |= w << b->cnt;
        b->pos += (63 - b->cnt) >> 3;
        b->cnt |= 56;
    } else {
        while (b->cnt <= 56) {
            uint64_t byte = b->pos < b->n ? b->in[b->pos] : 0;
            b->buf |= byte << b->cnt;
            b->pos++;
            b->cnt += 8;
        }
    }
}

static inline int sf_inf_overrun(const sf_bits *b) { return b->pos * 8 - b->cnt > b->n * 8; }

static inline uint32_t sf_inf_take(sf_bits *b, int k) { /* k <= 32 bits, after a refill */
    uint32_t v = (uint32_t)(b->buf & ((1ull << k) - 1));
    b->buf >>= k;
    b->cnt -= k;
    return v;
}

typedef struct {
    uint16_t count[16];  /* codes of each length */
    uint16_t symbol[288]; /* symbols ordered by code */
    int lut_bits; /* SF_INF_LUT, or fewer for a short stream (building the table costs 2^bits entries) */
    uint64_t lut[1 << SF_INF_LUT];
} sf_huff;

/* The table's entries: bits 0-47 up to six literals, 48-52 the bits they take, 53-55 how many (1-6).
 * With none: byte 0 says what the next code is: 0 the end of the block (its length in bits 48-52), 1 a
 * code longer than the table (walked bit by bit), 2 a length symbol (LZ77: unsupported). */
#define SF_INF_EOB 0u
#define SF_INF_SLOW 1u
#define SF_INF_LEN 2u
#define SF_INF_MAXSYM 6

static int sf_inf_build(sf_huff *h, const uint8_t *len, int n, int with_lut) {
    int offs[16];
    uint32_t one[1 << SF_INF_LUT]; /* one code per entry: symbol (or what) | length << 24 | literal << 29 */
    memset(h->count, 0, sizeof h->count);
    for (int s = 0; s < n; s++) h->count[len[s]]++;
    h->count[0] = 0;
    int left = 1;
    for (int l = 1; l < 16; l++) {
        left = (left << 1) - h->count[l];
        if (left < 0) return SF_INF_CORRUPT; /* over-subscribed */
    }
    offs[1] = 0;
    for (int l = 1; l < 15; l++) offs[l + 1] = offs[l] + h->count[l];
    for (int s = 0; s < n; s++)
        if (len[s]) h->symbol[offs[len[s]]++] = (uint16_t)s;
    if (!with_lut) return 0; /* (the code-length code: walked bit by bit) */
    const int lb = h->lut_bits, size = 1 << lb;
    for (int i = 0; i < size; i++) one[i] = SF_INF_SLOW; /* (also what an incomplete code leaves) */
    int code = 0, k = 0;
    for (int l = 1; l <= lb; l++) { /* canonical codes, shortest first; the table is bit-reversed */
        for (int c = 0; c < h->count[l]; c++, code++) {
            int s = h->symbol[k + c], r = 0;
            for (int b = 0; b < l; b++) r |= ((code >> b) & 1) << (l - 1 - b);
            uint32_t e = s < 256 ? ((uint32_t)s | (1u << 29)) : (s == 256 ? SF_INF_EOB : SF_INF_LEN);
            e |= (uint32_t)l << 24;
            for (int i = r; i < size; i += 1 << l) one[i] = e;
        }
        k += h->count[l];
        code <<= 1;
    }
    for (int i = 0; i < size; i++) { /* as many literals per entry as its bits wholly hold */
        uint32_t e = one[i];
        if ((e >> 29) == 0) {
            h->lut[i] = (uint64_t)(e & 0xFF) | ((uint64_t)((e >> 24) & 31) << 48);
            continue;
        }
        uint64_t syms = e & 0xFF;
        uint32_t bits = (e >> 24) & 31, cnt = 1; /* (bits <= lb) */
        while (cnt < SF_INF_MAXSYM) {
            uint32_t f = one[(uint32_t)i >> bits];
            uint32_t fl = (f >> 24) & 31;
            if ((f >> 29) == 0 || fl == 0 || (int)(bits + fl) > lb) break; /* not a literal wholly known */
            syms |= (uint64_t)(f & 0xFF) << (8 * cnt);
            bits += fl;
            cnt++;
        }
        h->lut[i] = syms | ((uint64_t)bits << 48) | ((uint64_t)cnt << 53);
    }
    return 0;
}

static int sf_inf_slow(sf_bits *b, const sf_huff *h) { /* one symbol, bit by bit (puff's decode) */
    int code = 0, first = 0, index = 0;
    for (int l = 1; l < 16; l++) {
        code |= (int)sf_inf_take(b, 1);
        int count = h->count[l];
        if (code - first < count) return h->symbol[index + (code - first)];
        index += count;
        first = (first + count) << 1;
        code <<= 1;
    }
    return SF_INF_CORRUPT; /* ran out of codes */
}

static int sf_inf_dynamic(sf_bits *b, sf_huff *lit, uint8_t *lens_out, int *nlen_out, int with_lut) {
    static const uint8_t order[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};
    uint8_t lens[320];
    sf_huff *cl = malloc(sizeof(sf_huff));
    if (!cl) return SF_INF_CORRUPT;
    sf_inf_refill(b);
    int nlen = (int)sf_inf_take(b, 5) + 257, ndist = (int)sf_inf_take(b, 5) + 1, ncode = (int)sf_inf_take(b, 4) + 4;
    int rc = 0;
    if (nlen > 286 || ndist > 30) { rc = SF_INF_CORRUPT; goto done; }
    memset(lens, 0, 19);
    for (int i = 0; i < ncode; i++) {
        sf_inf_refill(b);
        lens[order[i]] = (uint8_t)sf_inf_take(b, 3);
    }
    if ((rc = sf_inf_build(cl, lens, 19, 0))) goto done;
    for (int i = 0; i < nlen + ndist;) {
        sf_inf_refill(b);
        int s = sf_inf_slow(b, cl);
        if (s < 0) { rc = SF_INF_CORRUPT; goto done; }
        if (s < 16) { lens[i++] = (uint8_t)s; continue; }
        int rep, val = 0;
        if (s == 16) {
            if (i == 0) { rc = SF_INF_CORRUPT; goto done; }
            val = lens[i - 1];
            rep = 3 + (int)sf_inf_take(b, 2);
        } else if (s == 17) {
            rep = 3 + (int)sf_inf_take(b, 3);
        } else {
            rep = 11 + (int)sf_inf_take(b, 7);
        }
        if (i + rep > nlen + ndist) { rc = SF_INF_CORRUPT; goto done; }
        while (rep--) lens[i++] = (uint8_t)val;
    }
    if (lens[256] == 0) { rc = SF_INF_CORRUPT; goto done; } /* no end-of-block code */
    if (lens_out) {
        memcpy(lens_out, lens, (size_t)nlen);
        *nlen_out = nlen;
    }
    rc = sf_inf_build(lit, lens, nlen, with_lut);
done:
    free(cl);
    return sf_inf_overrun(b) ? SF_INF_CORRUPT : rc;
}

static int64_t sf_inf_codes(sf_bits *b, const sf_huff *h, uint8_t *out, int64_t o, int64_t on) {
    /* The bit reader in locals: stores through `out` (a byte pointer may alias anything) would otherwise
     * make the compiler reload it from memory after every write (3x slower). */
    const uint64_t mask = (1u << h->lut_bits) - 1;
    const uint64_t *lut = h->lut;
    const uint8_t *in = b->in;
    const int64_t n = b->n, fast_end = b->n - 8;
    uint64_t buf = b->buf;
    int64_t pos = b->pos;
    int cnt = b->cnt;
    int64_t rc;
    for (;;) {
        if (cnt < 3 * SF_INF_LUT) {
            if (pos <= fast_end) {
                uint64_t w;
                memcpy(&w, in + pos, 8);
                buf |= w << cnt;
                pos += (63 - cnt) >> 3;
                cnt |= 56;
            } else {
                b->buf = buf, b->pos = pos, b->cnt = cnt;
                sf_inf_refill(b);
                if (sf_inf_overrun(b) && b->pos > n + 16) return SF_INF_CORRUPT;
                buf = b->buf, pos = b->pos, cnt = b->cnt;
            }
        }
        uint64_t e = lut[buf & mask];
        uint32_t c = (uint32_t)(e >> 53) & 7;
        if (c) {
            int bits = (int)((e >> 48) & 31);
            if (o + 8 <= on) {
                memcpy(out + o, &e, 8); /* (the literals are the low bytes; the rest is overwritten next) */
            } else {
                if (o + (int64_t)c > on) return SF_INF_CORRUPT; /* more output than the caller expects */
                for (uint32_t k = 0; k < c; k++) out[o + k] = (uint8_t)(e >> (8 * k));
            }
            o += c;
            buf >>= bits;
            cnt -= bits;
            continue;
        }
        b->buf = buf, b->pos = pos, b->cnt = cnt;
        uint32_t what = (uint32_t)(e & 0xFF);
        if (what == SF_INF_EOB) {
            sf_inf_take(b, (int)((e >> 48) & 31));
            rc = o;
        } else if (what == SF_INF_LEN) {
            return SF_INF_UNSUPPORTED;
        } else {
            int s = sf_inf_slow(b, h);
            if (s < 0 || sf_inf_overrun(b)) return SF_INF_CORRUPT;
            if (s > 256) return SF_INF_UNSUPPORTED;
            if (s < 256) {
                if (o >= on) return SF_INF_CORRUPT;
                out[o++] = (uint8_t)s;
                buf = b->buf, pos = b->pos, cnt = b->cnt;
                continue;
            }
            rc = o;
        }
        return sf_inf_overrun(b) ? SF_INF_CORRUPT : rc;
    }
}

/* Decodes the raw DEFLATE stream in[0..n) into out[0..on); returns the bytes written or a negative SF_INF_*. */
int64_t sf_inflate_literals(const uint8_t *in, int64_t n, uint8_t *out, int64_t on) {
    sf_bits b = {in, n, 0, 0, 0};
    sf_huff *h = malloc(sizeof(sf_huff));
    if (!h) return SF_INF_CORRUPT;
    h->lut_bits = on < (1 << 16) ? 9 : SF_INF_LUT;
    int64_t o = 0;
    int last = 0;
    while (!last) {
        sf_inf_refill(&b);
        last = (int)sf_inf_take(&b, 1);
        int type = (int)sf_inf_take(&b, 2);
        if (type == 0) { /* stored: byte-aligned LEN, NLEN, then the bytes */
            int drop = b.cnt & 7;
            sf_inf_take(&b, drop);
            sf_inf_refill(&b);
            uint32_t len = sf_inf_take(&b, 16), nlen = sf_inf_take(&b, 16);
            if ((len ^ 0xFFFFu) != nlen || o + len > on) { o = SF_INF_CORRUPT; break; }
            int64_t at = b.pos - b.cnt / 8; /* the bit buffer holds whole bytes here: hand them back */
            if (at < 0 || at + len > n) { o = SF_INF_CORRUPT; break; }
            memcpy(out + o, in + at, len);
            o += len;
            b.pos = at + len;
            b.buf = 0;
            b.cnt = 0;
            continue;
        }
        int rc = 0;
        if (type == 1) {
            uint8_t lens[288];
            for (int s = 0; s < 288; s++) lens[s] = s < 144 ? 8 : s < 256 ? 9 : s < 280 ? 7 : 8;
            rc = sf_inf_build(h, lens, 288, 1);
        } else if (type == 2) {
            rc = sf_inf_dynamic(&b, h, NULL, NULL, 1);
        } else {
            rc = SF_INF_CORRUPT;
        }
        if (rc) { o = rc; break; }
        o = sf_inf_codes(&b, h, out, o, on);
        if (o < 0) break;
    }
    free(h);
    return o;
}

/* The other way: n literals, each coded by code[s] (bit-reversed, as DEFLATE sends a code's first bit
 * first) of len[s] bits, then the end-of-block code (symbol 256), appended to a stream whose first
 * `bits` bits (the block header, written by compressed.py) are already in out. Returns the stream's
 * bytes, or -1 when `cap` is too small. zlib.decompress reads what it writes (tested). */
int64_t sf_deflate_literals(const uint8_t *in, int64_t n, const uint16_t *code, const uint8_t *len, uint8_t *out,
                            int64_t cap, int64_t bits) {
    int64_t pos = bits >> 3;
    int cnt = (int)(bits & 7);
    uint64_t acc = cnt ? (uint64_t)(out[pos] & ((1u << cnt) - 1)) : 0;
    for (int64_t i = 0; i <= n; i++) {
        int s = i < n ? in[i] : 256;
        acc |= (uint64_t)code[s] << cnt;
        cnt += len[s];
        if (cnt >= 32) {
            if (pos + 4 > cap) return -1;
            uint32_t w = (uint32_t)acc;
            memcpy(out + pos, &w, 4);
            pos += 4;
            acc >>= 32;
            cnt -= 32;
        }
    }
    while (cnt > 0) {
        if (pos + 1 > cap) return -1;
        out[pos++] = (uint8_t)acc;
        acc >>= 8;
        cnt -= 8;
    }
    return pos;
}

/* Two streams coded alike — the halves of one chunk, each a single final dynamic block with the same code
 * (deflate_literals.encode_pair) — decoded together: one table, the two streams' lookups interleaved in
 * one loop, so each one's chain of dependent loads (lookup -> bits -> next lookup) hides the other's
 * latency. Returns 0 when both decoded to exactly on1 and on2 bytes; anything else (another shape of
 * stream, codes that differ, a corrupt stream) returns negative and the caller decodes them one by one. */
int64_t sf_inflate_literals2(const uint8_t *in1, int64_t n1, uint8_t *out1, int64_t on1,
                             const uint8_t *in2, int64_t n2, uint8_t *out2, int64_t on2) {
    sf_bits b1 = {in1, n1, 0, 0, 0}, b2 = {in2, n2, 0, 0, 0};
    sf_huff *h = malloc(2 * sizeof(sf_huff));
    if (!h) return SF_INF_CORRUPT;
    sf_huff *h2 = h + 1;
    h->lut_bits = h2->lut_bits = (on1 < (1 << 16) || on2 < (1 << 16)) ? 9 : SF_INF_LUT;
    uint8_t lens1[320], lens2[320];
    int nl1 = 0, nl2 = 0;
    int64_t rc = SF_INF_UNSUPPORTED;
    sf_inf_refill(&b1);
    sf_inf_refill(&b2);
    if (sf_inf_take(&b1, 3) != 5 || sf_inf_take(&b2, 3) != 5) goto done; /* BFINAL = 1, BTYPE = 2 */
    /* (the second header is read only to check it is the first's: its table would be the same) */
    if (sf_inf_dynamic(&b1, h, lens1, &nl1, 1) || sf_inf_dynamic(&b2, h2, lens2, &nl2, 0)) goto done;
    if (nl1 != nl2 || memcmp(lens1, lens2, (size_t)nl1)) goto done;
    {
        const uint64_t mask = (1u << h->lut_bits) - 1;
        const uint64_t *lut = h->lut;
        const int64_t end1 = n1 - 8, end2 = n2 - 8;
        uint64_t x1 = b1.buf, x2 = b2.buf;
        int64_t p1 = b1.pos, p2 = b2.pos, o1 = 0, o2 = 0;
        int c1 = b1.cnt, c2 = b2.cnt;
        for (;;) {
            while (o1 + 8 <= on1 && o2 + 8 <= on2 && p1 <= end1 && p2 <= end2) {
                /* Branch-free refills (a refill when the buffer is full re-ORs the same bits): a
                 * data-dependent "is it low?" branch mispredicted often enough to cost more. */
                uint64_t w1, w2;
                memcpy(&w1, in1 + p1, 8);
                memcpy(&w2, in2 + p2, 8);
                x1 |= w1 << c1;
                x2 |= w2 << c2;
                p1 += (63 - c1) >> 3;
                p2 += (63 - c2) >> 3;
                c1 |= 56;
                c2 |= 56;
                uint64_t e1 = lut[x1 & mask], e2 = lut[x2 & mask];
                uint32_t k1 = (uint32_t)(e1 >> 53) & 7, k2 = (uint32_t)(e2 >> 53) & 7;
                if (!k1 || !k2) break;
                memcpy(out1 + o1, &e1, 8);
                memcpy(out2 + o2, &e2, 8);
                o1 += k1;
                o2 += k2;
                int s1 = (int)((e1 >> 48) & 31), s2 = (int)((e2 >> 48) & 31);
                x1 >>= s1;
                c1 -= s1;
                x2 >>= s2;
                c2 -= s2;
            }
            b1.buf = x1, b1.pos = p1, b1.cnt = c1, b2.buf = x2, b2.pos = p2, b2.cnt = c2;
            /* A code longer than the table in either stream: walk it, and go on together; anything else
             * (an end of block, the streams' or outputs' ends) is left to the one-stream loop below. */
            int walked = 0;
            sf_bits *bs[2] = {&b1, &b2};
            uint8_t *outs[2] = {out1, out2};
            int64_t *os[2] = {&o1, &o2}, ons[2] = {on1, on2};
            for (int j = 0; j < 2; j++) {
                sf_bits *b = bs[j];
                if (b->pos > b->n - 8 || *os[j] + 8 > ons[j]) continue;
                if (b->cnt < 3 * SF_INF_LUT) sf_inf_refill(b);
                uint64_t e = lut[b->buf & mask];
                if (((e >> 53) & 7) || (e & 0xFF) != SF_INF_SLOW) continue;
                int sym = sf_inf_slow(b, h);
                if (sym < 0 || sym > 256) { rc = sym < 0 ? SF_INF_CORRUPT : SF_INF_UNSUPPORTED; goto done; }
                if (sym == 256) { /* (an end of block reached the long way: put the bits back is not possible) */
                    rc = SF_INF_UNSUPPORTED;
                    goto done;
                }
                outs[j][(*os[j])++] = (uint8_t)sym;
                walked = 1;
            }
            if (!walked) break;
            x1 = b1.buf, p1 = b1.pos, c1 = b1.cnt, x2 = b2.buf, p2 = b2.pos, c2 = b2.cnt;
        }
        int64_t r1 = sf_inf_codes(&b1, h, out1, o1, on1), r2 = sf_inf_codes(&b2, h, out2, o2, on2);
        rc = (r1 == on1 && r2 == on2) ? 0 : (r1 < 0 ? r1 : r2 < 0 ? r2 : SF_INF_CORRUPT);
    }
done:
    free(h);
    return rc;
}

/* -- rANS (engine/loading/rans.py): an order-0 coder of bytes, SF_RANS_LANES interleaved 32-bit states, 16-bit
 * renormalization, frequencies quantized to SF_RANS_BITS bits. Symbol i belongs to lane i % LANES and each lane
 * has its own words, so no lane's renormalization waits on another's. The encoder runs backwards and writes a
 * lane's words from the end of that lane's part of its buffer, so the decoder reads each lane's forwards. rans.py
 * holds the plain reference of both directions and writes/reads the stream's header. */
#define SF_RANS_BITS 12
#define SF_RANS_LANES 32
#define SF_RANS_VECS (SF_RANS_LANES / 8)
#define SF_RANS_L (1u << 16)

/* Encode in[0..n) with freq/cum (256 each; freq of a present symbol >= 1, the freqs summing to 1 << BITS).
 * Lane j's words go to words[j * cap + cap - k_j .. (j + 1) * cap), k_j to counts[j], its final state to
 * states[j]. Returns 0, or -1 when cap words per lane are too few, -2 for a symbol of frequency 0. */
int64_t sf_rans_encode(const uint8_t *in, int64_t n, const uint32_t *freq, const uint32_t *cum, uint16_t *words,
                       int64_t cap, uint32_t *states, int64_t *counts) {
    uint32_t x[SF_RANS_LANES];
    int64_t p[SF_RANS_LANES];
    for (int j = 0; j < SF_RANS_LANES; j++) x[j] = SF_RANS_L, p[j] = (j + 1) * cap;
    for (int64_t i = n - 1; i >= 0; i--) {
        int j = (int)(i % SF_RANS_LANES);
        uint32_t f = freq[in[i]], s = x[j];
        if (!f) return -2;
        /* (64-bit: a symbol of frequency 1 << BITS makes the bound 2^32) */
        if ((uint64_t)s >= ((uint64_t)(SF_RANS_L >> SF_RANS_BITS) << 16) * f) {
            if (p[j] == j * cap) return -1;
            words[--p[j]] = (uint16_t)s;
            s >>= 16;
        }
        x[j] = ((s / f) << SF_RANS_BITS) + (s % f) + cum[in[i]];
    }
    for (int j = 0; j < SF_RANS_LANES; j++) states[j] = x[j], counts[j] = (j + 1) * cap - p[j];
    return 0;
}

/* Decode n symbols from the lanes' states and words (lane j's counts[j] words at words + offset_j, the lanes'
 * parts one after another; the buffer holds two words more past the last, read and never used). The slot table
 * packs, per slot, the symbol (8 bits), its frequency - 1 (12) and slot - cum (12) into one uint32 (16 KiB:
 * in L1). Returns 0 when every word was read and every lane ended where the encoder started (L); negative for
 * a stream that is not that. */
__attribute__((optimize("no-tree-slp-vectorize", "no-tree-vectorize")))
int64_t sf_rans_decode(const uint32_t *freq, const uint32_t *states, const uint16_t *words, const int64_t *counts,
                       uint8_t *out, int64_t n) {
    uint32_t *tab = malloc(sizeof(uint32_t) << SF_RANS_BITS);
    if (!tab) return -3;
    uint32_t c = 0;
    for (uint32_t s = 0; s < 256; s++) {
        uint32_t f = freq[s];
        if (f && (f > (1u << SF_RANS_BITS) || c + f > (1u << SF_RANS_BITS))) { free(tab); return -1; }
        for (uint32_t k = 0; k < f; k++) tab[c + k] = s | ((f - 1) << 8) | (k << 20);
        c += f;
    }
    if (c != (1u << SF_RANS_BITS)) { free(tab); return -1; }
    const uint32_t mask = (1u << SF_RANS_BITS) - 1;
    uint32_t x[SF_RANS_LANES], w[SF_RANS_LANES];
    int64_t p[SF_RANS_LANES], end[SF_RANS_LANES], room = INT64_MAX, at = 0;
    for (int j = 0; j < SF_RANS_LANES; j++) {
        x[j] = states[j];
        if (x[j] < SF_RANS_L || counts[j] < 0) { free(tab); return -1; }
        p[j] = at;
        at += counts[j];
        end[j] = at;
        w[j] = words[p[j]]; /* (the word after a lane's part is the next lane's, or the padding) */
        if (counts[j] < room) room = counts[j];
    }
    int64_t i = 0;
#if SF_AVX2
    /* Eight lanes to a vector, four vectors: a group of 32 symbols is four table gathers, four word gathers and
     * the arithmetic on whole vectors; the four chains (gather -> multiply -> compare -> blend) overlap. */
    if (SF_RANS_LANES % 32 == 0 && at < (1LL << 30)) {
        __m256i X[SF_RANS_VECS], P[SF_RANS_VECS];
        int32_t p32[SF_RANS_LANES];
        for (int j = 0; j < SF_RANS_LANES; j++) p32[j] = (int32_t)p[j];
        for (int v = 0; v < SF_RANS_VECS; v++) {
            X[v] = _mm256_loadu_si256((const __m256i *)(x + 8 * v));
            P[v] = _mm256_loadu_si256((const __m256i *)(p32 + 8 * v));
        }
        const __m256i m12 = _mm256_set1_epi32((int)mask), lo16 = _mm256_set1_epi32(0xFFFF), one = _mm256_set1_epi32(1);
        const __m256i zero = _mm256_setzero_si256(), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (; i + SF_RANS_LANES <= n; i += SF_RANS_LANES) {
            if (room < 1) {
                for (int v = 0; v < SF_RANS_VECS; v++) _mm256_storeu_si256((__m256i *)(p32 + 8 * v), P[v]);
                room = INT64_MAX;
                for (int j = 0; j < SF_RANS_LANES; j++) room = end[j] - p32[j] < room ? end[j] - p32[j] : room;
                if (room < 1) break;
            }
            __m256i B[SF_RANS_VECS];
            for (int v = 0; v < SF_RANS_VECS; v++) {
                __m256i e = _mm256_i32gather_epi32((const int *)tab, _mm256_and_si256(X[v], m12), 4);
                B[v] = _mm256_and_si256(e, _mm256_set1_epi32(0xFF));
                __m256i f = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(e, 8), m12), one);
                __m256i st = _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(X[v], SF_RANS_BITS)),
                                              _mm256_srli_epi32(e, 20));
                __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(st, 16), zero);
                __m256i w = _mm256_and_si256(_mm256_i32gather_epi32((const int *)words, P[v], 2), lo16);
                X[v] = _mm256_blendv_epi8(st, _mm256_or_si256(_mm256_slli_epi32(st, 16), w), need);
                P[v] = _mm256_sub_epi32(P[v], need);
            }
            for (int v = 0; v < SF_RANS_VECS; v += 4) {
                __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(B[v], B[v + 1]), _mm256_packus_epi32(B[v + 2], B[v + 3]));
                _mm256_storeu_si256((__m256i *)(out + i + 8 * v), _mm256_permutevar8x32_epi32(b, order));
            }
            room--;
        }
        for (int v = 0; v < SF_RANS_VECS; v++) {
            _mm256_storeu_si256((__m256i *)(x + 8 * v), X[v]);
            _mm256_storeu_si256((__m256i *)(p32 + 8 * v), P[v]);
        }
        for (int j = 0; j < SF_RANS_LANES; j++) p[j] = p32[j], w[j] = words[p32[j]];
    }
#endif
    /* Groups of LANES symbols while every lane has a group's worth of words left (a lane reads at most one per
     * symbol), so nothing is bounds-checked inside: each lane steps its state, takes its preloaded word when it
     * renormalizes (masks, not a ?: the compiler turns into a branch that mispredicts on ~1 symbol in 6) and
     * loads its next word off the state's chain. */
    for (; i + SF_RANS_LANES <= n; i += SF_RANS_LANES) {
        if (room < 1) {
            room = INT64_MAX;
            for (int j = 0; j < SF_RANS_LANES; j++) room = end[j] - p[j] < room ? end[j] - p[j] : room;
            if (room < 1) break;
        }
        for (int j = 0; j < SF_RANS_LANES; j++) {
            uint32_t e = tab[x[j] & mask];
            out[i + j] = (uint8_t)e;
            uint32_t s = (((e >> 8) & mask) + 1) * (x[j] >> SF_RANS_BITS) + (e >> 20);
            uint32_t need = s < SF_RANS_L, m = 0u - need;
            x[j] = (s & ~m) | (((s << 16) | w[j]) & m);
            p[j] += need;
            w[j] = words[p[j]];
        }
        room--;
    }
    for (; i < n; i++) {
        int j = (int)(i % SF_RANS_LANES);
        uint32_t e = tab[x[j] & mask], s;
        out[i] = (uint8_t)e;
        s = (((e >> 8) & mask) + 1) * (x[j] >> SF_RANS_BITS) + (e >> 20);
        if (s < SF_RANS_L) {
            if (p[j] >= end[j]) { free(tab); return -2; }
            s = (s << 16) | words[p[j]++];
        }
        x[j] = s;
    }
    free(tab);
    for (int j = 0; j < SF_RANS_LANES; j++)
        if (p[j] != end[j] || x[j] != SF_RANS_L) return -2;
    return 0;
}

/* -- CRC-32 (zlib's: the reflected polynomial 0xEDB88320) of a loaded tensor's bytes, as zlib.crc32(buf, crc)
 * computes it (compressed.py checks a decoded chunk against the manifest's). With PCLMULQDQ: four 16-byte lanes
 * folded by carry-less multiplication 64 bytes at a time, then folded to one lane, to 64 bits and Barrett-reduced
 * (the method of Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", with its constants for
 * this polynomial, as Chromium's zlib does it); a byte-at-a-time table for the rest and without it. Tested
 * against zlib over lengths and alignments, both builds. */
#if defined(__PCLMUL__) && defined(__SSE4_1__)
#include <immintrin.h>
#endif
static uint32_t sf_crc_table[256];
static int sf_crc_table_ready = 0;

static uint32_t sf_crc32_bytes(uint32_t crc, const uint8_t *p, int64_t n) {
    if (!sf_crc_table_ready) { /* (idempotent: threads racing here write the same values) */
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0xEDB88320u : c >> 1;
            sf_crc_table[i] = c;
        }
        sf_crc_table_ready = 1;
    }
    crc = ~crc;
    for (int64_t i = 0; i < n; i++) crc = sf_crc_table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

#if defined(__PCLMUL__) && defined(__SSE4_1__)
/* The CRC register (not inverted) over n bytes, n a multiple of 16 and at least 64. */
static uint32_t sf_crc32_fold(const uint8_t *buf, int64_t n, uint32_t crc) {
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);
    const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00)), x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20)), x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    __m128i x0 = k1k2, x5, x6, x7, x8;
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    buf += 64;
    n -= 64;
    while (n >= 64) {
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
        x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
        x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
        x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
        x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), _mm_loadu_si128((const __m128i *)(buf + 0x00)));
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), _mm_loadu_si128((const __m128i *)(buf + 0x10)));
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), _mm_loadu_si128((const __m128i *)(buf + 0x20)));
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), _mm_loadu_si128((const __m128i *)(buf + 0x30)));
        buf += 64;
        n -= 64;
    }
    x0 = k3k4; /* four lanes into one */
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
    while (n >= 16) {
        x2 = _mm_loadu_si128((const __m128i *)buf);
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        buf += 16;
        n -= 16;
    }
    x2 = _mm_clmulepi64_si128(x1, x0, 0x10); /* 128 bits to 64 */
    x3 = _mm_setr_epi32(~0, 0, ~0, 0);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    x0 = k5k0;
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, x3);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(x1, x0, 0x00), x2);
    x0 = poly; /* Barrett reduction to 32 */
    x2 = _mm_and_si128(x1, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
    x2 = _mm_and_si128(x2, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}
#endif

int sf_has_pclmul(void) {
#if defined(__PCLMUL__) && defined(__SSE4_1__)
    return 1;
#else
    return 0;
#endif
}

/* zlib.crc32(buf[0..n), crc). */
uint32_t sf_crc32(const uint8_t *buf, int64_t n, uint32_t crc) {
#if defined(__PCLMUL__) && defined(__SSE4_1__)
    if (n >= 64) {
        int64_t m = n & ~(int64_t)15;
        crc = ~sf_crc32_fold(buf, m, ~crc);
        buf += m;
        n -= m;
    }
#endif
    return sf_crc32_bytes(crc, buf, n);
}
