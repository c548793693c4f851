/* Fixed-order float32 attention for the int8 precision (docs/algorithms.md §14).
 *
 * A row's attention output must be bitwise the same whatever else its pass holds: other rows,
 * other sessions, padding, tree branches, keys it does not see. BLAS kernels choose their blocking
 * by shape, so their float32 sums do not promise that; this kernel fixes every sum's order by
 * what the row itself sees:
 *   - a score is one query-key dot product: 16 lanes over the head dimension (lane l sums the
 *     products at l, l + 16, ... in order, zeros past its end), then one fixed tree over the lanes;
 *   - the softmax runs over the row's visible keys in cache order, numbered 0, 1, 2, ... (the
 *     ordinal, not the buffer index, which padding and side branches shift): the maximum is
 *     exact in any order, each exponential is one function of one score, and the denominator
 *     sums lane (ordinal mod 16) by lane, then the same tree;
 *   - the output is sum_i p_i v_i over the ordinals in order, one lane per head dimension,
 *     divided by the denominator at the end.
 * Keys the row does not see take no part at all. Nothing depends on the thread count either: a
 * thread computes whole rows.
 *
 * Built at first use by specdec.runtime.fixed_attention (cc -O3 -march=native -fopenmp) and
 * called through ctypes. The 16 lanes are written out, so whatever width the compiler lowers them
 * to, the order is the same: AVX2 and AVX-512 builds give bitwise the same numbers (tested);
 * products and sums contract to FMAs where the CPU has them, so a CPU without FMA differs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lanes.h"

/* Four lane sums at once, each by the same tree as lane_sum (the same pairs added, only packed
 * into fewer vectors): sums[j] = lane_sum(x_j). */
static inline void lane_sums4(vec a, vec b, vec c, vec d, float *sums) {
    vec ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
           + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vec cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
           + __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vec e = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
          + __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    vec f = e + __builtin_shufflevector(e, e, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    sums[0] = f[0] + f[1];
    sums[1] = f[4] + f[5];
    sums[2] = f[8] + f[9];
    sums[3] = f[12] + f[13];
}

/* The lanes of q . k over `dim` in the fixed order above (a last partial chunk's missing lanes
 * are zeros); lane_sum of them is the score. */
static inline vec dot_lanes(const float *q, const float *k, int dim) {
    const int whole = dim / LANES * LANES;
    vec acc = splat(0.0f);
    for (int c = 0; c < whole; c += LANES) acc = acc + load(q + c) * load(k + c);
    if (whole < dim) acc = acc + load_part(q + whole, dim - whole) * load_part(k + whole, dim - whole);
    return acc;
}

/* Scores of the `group` query heads at q, q + q_head, ... against each seen key, scale and bias
 * applied: scores[g * stride + i]. The key loop is outside, so a key is read once for the group,
 * and four heads' lane sums are packed together; the common head dimensions get their own copy
 * of the loop, fully unrolled (the arithmetic of a score is the same in every copy: the order
 * above). */
#define SCORE_LOOP(DIM)                                                                            \
    for (int i = 0; i < seen; i++) {                                                               \
        const float *k = keys + index[i] * k_row;                                                  \
        int g = 0;                                                                                 \
        for (; g + 4 <= group; g += 4) {                                                           \
            float sums[4];                                                                         \
            lane_sums4(dot_lanes(q + g * q_head, k, DIM), dot_lanes(q + (g + 1) * q_head, k, DIM), \
                       dot_lanes(q + (g + 2) * q_head, k, DIM),                                    \
                       dot_lanes(q + (g + 3) * q_head, k, DIM), sums);                             \
            for (int j = 0; j < 4; j++) scores[(g + j) * stride + i] = sums[j] * scale + bias[i];  \
        }                                                                                          \
        for (; g < group; g++)                                                                     \
            scores[g * stride + i] = lane_sum(dot_lanes(q + g * q_head, k, DIM)) * scale + bias[i]; \
    }
static void group_scores(const float *q, int64_t q_head, int group, const float *keys, int64_t k_row,
                         const int *index, const float *bias, int seen, int dim, float scale,
                         float *restrict scores, int stride) {
    if (dim == 128) {
        SCORE_LOOP(128)
    } else if (dim == 64) {
        SCORE_LOOP(64)
    } else {
        SCORE_LOOP(dim)
    }
}

/* exp(x) lane by lane (lanes.h; x <= 0 here), not inlined: the denominator adds the rounded value
 * it stores, which an inlined call could fuse with its last product. */
__attribute__((noinline)) static vec exp_apart(vec x) { return exp_lanes(x); }

/* o_g = sum_i p_gi v_i / denominator_g over the seen keys in order, one lane per head dimension,
 * for a head dimension DIM that is a multiple of 16: two heads at a time, so that a value row is
 * read once for both (accumulators in registers; each head's sums are the ones the general loop
 * below adds, in the same order). */
#define WEIGHTED_SUMS(DIM)                                                                         \
    {                                                                                              \
        int g = 0;                                                                                 \
        for (; g + 2 <= group; g += 2) {                                                           \
            vec first[DIM / LANES], second[DIM / LANES];                                           \
            const float *p0 = all_scores + (int64_t)g * padded, *p1 = p0 + padded;                 \
            for (int c = 0; c < DIM / LANES; c++) first[c] = second[c] = splat(0.0f);              \
            for (int i = 0; i < seen; i++) {                                                       \
                const vec a = splat(p0[i]), b = splat(p1[i]);                                      \
                const float *v = values + index[i] * v_row;                                        \
                for (int c = 0; c < DIM / LANES; c++) {                                            \
                    const vec x = load(v + c * LANES);                                             \
                    first[c] = first[c] + a * x;                                                   \
                    second[c] = second[c] + b * x;                                                 \
                }                                                                                  \
            }                                                                                      \
            float *o = o_row + (int64_t)(h * group + g) * DIM;                                     \
            for (int c = 0; c < DIM / LANES; c++) {                                                \
                store(o + c * LANES, first[c] / splat(denominators[g]));                           \
                store(o + DIM + c * LANES, second[c] / splat(denominators[g + 1]));                \
            }                                                                                      \
        }                                                                                          \
        for (; g < group; g++) {                                                                   \
            vec sums[DIM / LANES];                                                                 \
            const float *p0 = all_scores + (int64_t)g * padded;                                    \
            for (int c = 0; c < DIM / LANES; c++) sums[c] = splat(0.0f);                           \
            for (int i = 0; i < seen; i++) {                                                       \
                const vec a = splat(p0[i]);                                                        \
                const float *v = values + index[i] * v_row;                                        \
                for (int c = 0; c < DIM / LANES; c++) sums[c] = sums[c] + a * load(v + c * LANES); \
            }                                                                                      \
            float *o = o_row + (int64_t)(h * group + g) * DIM;                                     \
            for (int c = 0; c < DIM / LANES; c++) store(o + c * LANES, sums[c] / splat(denominators[g])); \
        }                                                                                          \
    }

/* Mask kinds: 0 none (causal: row r sees keys 0 .. L - R + r), 1 additive float (a key is seen when
 * its value is above -1e30, and the value is added to its score), 2 boolean (nonzero: seen). */
static int visible_keys(const void *mask, int kind, int64_t offset, int rows, int row, int length,
                        int *index, float *bias) {
    int n = 0;
    if (kind == 0) {
        int last = length - rows + row;
        for (int j = 0; j <= last && j < length; j++) { index[n] = j; bias[n++] = 0.0f; }
    } else if (kind == 1) {
        const float *m = (const float *)mask + offset;
        for (int j = 0; j < length; j++)
            if (m[j] > -1e30f) { index[n] = j; bias[n++] = m[j]; }
    } else {
        const uint8_t *m = (const uint8_t *)mask + offset;
        for (int j = 0; j < length; j++)
            if (m[j]) { index[n] = j; bias[n++] = 0.0f; }
    }
    return n;
}

/* softmax(q k^T * scale + mask) v for query [B, Hq, R, D], key/value [B, Hkv, L, D] (strides in
 * elements, the last dimension contiguous), mask [B or 1, 1, R, L] (last dimension contiguous;
 * mask_batch_stride 0 broadcasts), into out [B, R, Hq, D] contiguous. Returns 0, or -1 when
 * scratch memory could not be had. */
int specdec_fixed_order_attention(
    const float *query, int64_t q_batch, int64_t q_head, int64_t q_row,
    const float *key, int64_t k_batch, int64_t k_head, int64_t k_row,
    const float *value, int64_t v_batch, int64_t v_head, int64_t v_row,
    const void *mask, int mask_kind, int64_t mask_batch, int64_t mask_row,
    float *out, int batch, int heads, int kv_heads, int rows, int length, int dim, float scale,
    int threads) {
    const int group = heads / kv_heads;
    const int padded = (length + LANES - 1) / LANES * LANES;
    const int tasks = batch * kv_heads * rows;
    const int chunks = (dim + LANES - 1) / LANES;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int *index = malloc(sizeof(int) * (size_t)length);
        float *bias = malloc(sizeof(float) * (size_t)length);
        float *all_scores = malloc(sizeof(float) * (size_t)padded * (size_t)group);
        float *denominators = malloc(sizeof(float) * (size_t)group);
        vec *acc = aligned_alloc(sizeof(vec), sizeof(vec) * (size_t)chunks);
        if (!index || !bias || !all_scores || !denominators || !acc) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; task++) {
            if (failed) continue;
            const int b = task / (kv_heads * rows), h = task / rows % kv_heads, r = task % rows;
            const int seen = visible_keys(mask, mask_kind, b * mask_batch + r * mask_row, rows, r,
                                          length, index, bias);
            const float *keys = key + b * k_batch + h * k_head;
            const float *values = value + b * v_batch + h * v_head;
            float *o_row = out + ((int64_t)b * rows + r) * heads * dim;
            if (seen == 0) {
                memset(o_row + (int64_t)h * group * dim, 0, sizeof(float) * (size_t)(group * dim));
                continue;
            }
            const float *q_group = query + b * q_batch + (int64_t)h * group * q_head + r * q_row;
            group_scores(q_group, q_head, group, keys, k_row, index, bias, seen, dim, scale, all_scores,
                         padded);
            for (int g = 0; g < group; g++) { /* softmax numerators in place, and denominators */
                float *scores = all_scores + (int64_t)g * padded;
                float top = -3.4e38f;
                for (int i = 0; i < seen; i++)
                    if (scores[i] > top) top = scores[i];
                const int blocks = (seen + LANES - 1) / LANES;
                for (int i = seen; i < blocks * LANES; i++) scores[i] = top;
                vec total = splat(0.0f);
                for (int blk = 0; blk < blocks; blk++) {
                    vec p = exp_apart(load(scores + blk * LANES) - splat(top));
                    if (blk == blocks - 1)
                        for (int l = seen - blk * LANES; l < LANES; l++) p[l] = 0.0f;
                    store(scores + blk * LANES, p);
                    total = total + p;
                }
                denominators[g] = lane_sum(total);
            }
            if (dim == 128) {
                WEIGHTED_SUMS(128)
            } else if (dim == 64) {
                WEIGHTED_SUMS(64)
            } else {
                const int whole = dim / LANES, rest = dim - whole * LANES;
                for (int g = 0; g < group; g++) {
                    const float *scores = all_scores + (int64_t)g * padded;
                    const vec denominator = splat(denominators[g]);
                    float *o = o_row + (int64_t)(h * group + g) * dim;
                    for (int c = 0; c < chunks; c++) acc[c] = splat(0.0f);
                    for (int i = 0; i < seen; i++) {
                        const vec p = splat(scores[i]);
                        const float *v = values + index[i] * v_row;
                        for (int c = 0; c < whole; c++) acc[c] = acc[c] + p * load(v + c * LANES);
                        if (rest) acc[whole] = acc[whole] + p * load_part(v + whole * LANES, rest);
                    }
                    for (int c = 0; c < whole; c++) store(o + c * LANES, acc[c] / denominator);
                    if (rest) {
                        const vec last = acc[whole] / denominator;
                        memcpy(o + whole * LANES, &last, sizeof(float) * (size_t)rest);
                    }
                }
            }
        }
        free(index);
        free(bias);
        free(all_scores);
        free(denominators);
        free(acc);
    }
    return failed ? -1 : 0;
}
