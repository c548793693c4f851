/* An int8 GEMM for a few rows on AVX-512 VNNI (docs/algorithms.md §14, "Which kernel runs a call").
 *
 * out[m][n] = float(Σ_k a[m][k] · w[n][k]) · scale[n], the exact int32 sum and one float product,
 * bitwise what fbgemm and torch._int_mm return for the same codes. fbgemm is memory-bound at one
 * row but slow from a few rows on (on a Zen 4, 2.3× its one-row time at 16 rows where the weights'
 * read alone would allow ~1.1×): this kernel streams each weight panel from memory once per call,
 * with up to 12 rows running over it as it streams, and keeps it in L2 for any further row blocks.
 * (Prefetching a panel ahead in software was tried, in 64-output panels during the later row blocks
 * and in these 32-output ones 512–4096 bytes ahead: no gain.)
 *
 * vpdpbusd multiplies unsigned bytes by signed bytes and adds each group of four products into an
 * int32 lane, without saturation. So the weights are packed as unsigned codes w + 128 and the
 * activations (integers in [-127, 127]) stay signed, broadcast four at a time:
 *     Σ_k (w + 128) · a = Σ_k w · a + 128 · Σ_k a,
 * and the row's own Σ_k a is taken off. Every term is an integer far inside int32 (|w|, |a| ≤ 127,
 * K ≤ 2^16), so the sum is exact in any order, and the thread count or the blocking cannot change it.
 *
 * Packed layout (specdec.runtime.int8.pack_for_vnni): panels of 32 outputs; per panel, per group of
 * 4 inputs, two 64-byte vectors (16 outputs × 4 inputs each). Inputs past k (to a multiple of 4)
 * and outputs past n (to a multiple of 32) hold zero weights; those outputs are not written.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#define PANEL 32 /* outputs per panel: two vectors of 16 int32 lanes */
#define ROWS 12  /* rows per block: 24 accumulators, 2 weight vectors, broadcasts from memory */

/* One row of a block: its two accumulators take the four codes of input group q. The broadcast
 * is a load operand of vpdpbusd, so a block needs only its accumulators and two weight vectors
 * in registers. The accumulators are named, not an array: GCC keeps them in registers only then
 * (an array spilled them to the stack and ran at half speed). */
#define DOT(r)                                                                            \
    if (rows > r) {                                                                       \
        __m512i b = _mm512_set1_epi32(*(const int32_t *)(a + r * k4 * 4 + q * 4));        \
        c##r##0 = _mm512_dpbusd_epi32(c##r##0, w0, b);                                    \
        c##r##1 = _mm512_dpbusd_epi32(c##r##1, w1, b);                                    \
    }
#define ZERO2(r) __m512i c##r##0 = _mm512_setzero_si512(), c##r##1 = c##r##0
#define STORE(r)                                                                          \
    if (rows > r) {                                                                       \
        __m512i acc[2] = {c##r##0, c##r##1};                                              \
        store_row(acc, row_sums[r], scale, out + r * n_out, columns);                     \
    }

static inline void store_row(const __m512i *acc, int32_t row_sum, const float *scale, float *row,
                             int64_t columns) {
    __m512i shift = _mm512_set1_epi32(128 * row_sum);
    for (int j = 0; j < 2; j++) {
        int64_t left = columns - 16 * j;
        if (left <= 0) break;
        __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[j], shift)),
                                     _mm512_loadu_ps(scale + 16 * j));
        if (left >= 16) _mm512_storeu_ps(row + 16 * j, value);
        else _mm512_mask_storeu_ps(row + 16 * j, (__mmask16)((1u << left) - 1), value);
    }
}

/* Up to ROWS rows over one panel, the panel read once. Twelve rows do 24 vpdpbusd per 128 bytes of
 * weights, so the compute of rows 7-12 runs while the panel streams in, where 6-row blocks over
 * 64-output panels read a panel at 6 rows and then ran the next block from L2 with the memory idle.
 * Streaming 28 layers' MLP weights on a Zen 4 (2 threads): 29 against 32 ms at 8 rows, 33 against
 * 36 at 10; level at 1-6 and at 24-64 rows. */
static inline __attribute__((always_inline)) void block(
        int rows, const int8_t *a, int64_t k4, const uint8_t *panel, const int32_t *row_sums,
        const float *scale, float *out, int64_t n_out, int64_t columns) {
    ZERO2(0); ZERO2(1); ZERO2(2); ZERO2(3); ZERO2(4); ZERO2(5);
    ZERO2(6); ZERO2(7); ZERO2(8); ZERO2(9); ZERO2(10); ZERO2(11);
    for (int64_t q = 0; q < k4; q++) {
        const __m512i *w = (const __m512i *)(panel + q * 2 * 64);
        __m512i w0 = _mm512_load_si512(w), w1 = _mm512_load_si512(w + 1);
        DOT(0) DOT(1) DOT(2) DOT(3) DOT(4) DOT(5) DOT(6) DOT(7) DOT(8) DOT(9) DOT(10) DOT(11)
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
    STORE(6) STORE(7) STORE(8) STORE(9) STORE(10) STORE(11)
}

#define CASE(r) case r: block(r, rows_a, k4, panel, row_sums + r0, s, o, n, columns); break;

/* The panels of a call, split over the threads: rows a [m, k4 * 4] int8 codes with their sums. */
static void gemm_panels(const int8_t *a, const int32_t *row_sums, int64_t m, int64_t k4,
                        const uint8_t *packed, int64_t n, const float *scale, float *out, int threads) {
    int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *panel = packed + p * k4 * 4 * PANEL;
        int64_t columns = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const int8_t *rows_a = a + r0 * k4 * 4;
            float *o = out + r0 * n + p * PANEL;
            const float *s = scale + p * PANEL;
            switch (m - r0 < ROWS ? m - r0 : ROWS) {
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
            CASE(7) CASE(8) CASE(9) CASE(10) CASE(11)
            default: block(ROWS, rows_a, k4, panel, row_sums + r0, s, o, n, columns); break;
            }
        }
    }
}

/* Scratch for m rows of k4 * 4 codes and their sums (NULL where memory could not be had). */
static int8_t *scratch_rows(int64_t m, int64_t k4, int32_t **row_sums) {
    int8_t *a = aligned_alloc(64, (size_t)((m * k4 * 4 + 63) / 64 * 64 + 64));
    *row_sums = malloc(sizeof(int32_t) * (size_t)(m > 0 ? m : 1));
    if (a == NULL || *row_sums == NULL) {
        free(a);
        free(*row_sums);
        return NULL;
    }
    return a;
}

/* codes: [m, k] float32 integers in [-127, 127] (specdec.runtime.int8.quantize_rows); scale: n
 * padded to a multiple of PANEL (zeros past n); out: [m, n]. Returns 0, or 1 where the scratch
 * memory could not be had. */
int specdec_int8_gemm(const float *codes, int64_t m, int64_t k, const uint8_t *packed, int64_t n,
                      const float *scale, float *out, int threads) {
    int64_t k4 = (k + 3) / 4;
    int32_t *row_sums;
    int8_t *a = scratch_rows(m, k4, &row_sums);
    if (a == NULL) return 1;
    for (int64_t r = 0; r < m; r++) {
        int32_t sum = 0;
        for (int64_t i = 0; i < k; i++) {
            int8_t code = (int8_t)codes[r * k + i];
            a[r * k4 * 4 + i] = code;
            sum += code;
        }
        for (int64_t i = k; i < k4 * 4; i++) a[r * k4 * 4 + i] = 0; /* zero weights there too */
        row_sums[r] = sum;
    }
    gemm_panels(a, row_sums, m, k4, packed, n, scale, out, threads);
    free(a);
    free(row_sums);
    return 0;
}

/* The same product for float32 rows x [m, k], quantised here as quantize_rows does it, bitwise:
 * row_scale[r] = max(max_i |x_ri|, FLT_MIN) / levels (one float32 division), code = x / row_scale
 * (IEEE division) rounded to the nearest integer, ties to even. One pass over a row instead of
 * torch's five elementwise operators, each a call with its own overhead (about 3 ms of a one-row
 * pass of the default target, 6 ms at 16 rows). Returns 0, or 1 where the scratch memory could not
 * be had. */
int specdec_int8_quantize_gemm(const float *x, int64_t m, int64_t k, float levels,
                               const uint8_t *packed, int64_t n, const float *scale, float *out,
                               float *row_scale, int threads) {
    int64_t k4 = (k + 3) / 4;
    int32_t *row_sums;
    int8_t *a = scratch_rows(m, k4, &row_sums);
    if (a == NULL) return 1;
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * k;
        int8_t *codes = a + r * k4 * 4;
        __m512 top = _mm512_setzero_ps();
        for (int64_t i = 0; i < k; i += 16) {
            __mmask16 lanes = k - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1);
            top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes, row + i)));
        }
        float absmax = _mm512_reduce_max_ps(top);
        float row_step = (absmax > FLT_MIN ? absmax : FLT_MIN) / levels;
        __m512 step = _mm512_set1_ps(row_step);
        __m512i sums = _mm512_setzero_si512();
        for (int64_t i = 0; i < k; i += 16) {
            __mmask16 lanes = k - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1);
            __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(lanes, row + i), step),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i c = _mm512_cvtps_epi32(q);
            sums = _mm512_add_epi32(sums, c);
            _mm_mask_storeu_epi8(codes + i, lanes, _mm512_cvtepi32_epi8(c));
        }
        for (int64_t i = k; i < k4 * 4; i++) codes[i] = 0; /* zero weights there too */
        row_sums[r] = _mm512_reduce_add_epi32(sums);
        row_scale[r] = row_step;
    }
    gemm_panels(a, row_sums, m, k4, packed, n, scale, out, threads);
    free(a);
    free(row_sums);
    return 0;
}

int specdec_int8_gemm_available(void) { return 1; }

#else
/* Built for a CPU without AVX-512 VNNI: the kernel is not offered (fbgemm runs every call). */
int specdec_int8_gemm(const float *codes, int64_t m, int64_t k, const uint8_t *packed, int64_t n,
                      const float *scale, float *out, int threads) {
    (void)codes; (void)m; (void)k; (void)packed; (void)n; (void)scale; (void)out; (void)threads;
    return 2;
}

int specdec_int8_quantize_gemm(const float *x, int64_t m, int64_t k, float levels,
                               const uint8_t *packed, int64_t n, const float *scale, float *out,
                               float *row_scale, int threads) {
    (void)x; (void)m; (void)k; (void)levels; (void)packed; (void)n; (void)scale; (void)out;
    (void)row_scale; (void)threads;
    return 2;
}

int specdec_int8_gemm_available(void) { return 0; }
#endif
