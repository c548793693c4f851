/* The 16-lane float vectors of specdec's fixed-order C kernels (attention_kernel.c, layer_kernels.c):
 * loads and stores, the one tree every lane sum takes, and the one exponential.
 *
 * The lanes are written out as a 64-byte vector type, so whatever width the compiler lowers them
 * to (AVX2 or AVX-512), every sum keeps its order and the numbers are the same. Included by those
 * sources; specdec.runtime.c_kernels copies it beside them and keys their builds by it too.
 */
#ifndef SPECDEC_LANES_H
#define SPECDEC_LANES_H

#include <stdint.h>
#include <string.h>

#define LANES 16
typedef float vec __attribute__((vector_size(64)));
typedef float vec_unaligned __attribute__((vector_size(64), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(64)));

static inline vec splat(float x) { return (vec){0} + x; }
static inline vec load(const float *p) { return *(const vec_unaligned *)p; }
static inline void store(float *p, vec x) { *(vec_unaligned *)p = x; }
/* The first n (< 16) floats at p, zeros after: a last chunk narrower than the lanes. */
static inline vec load_part(const float *p, int64_t n) {
    vec x = splat(0.0f);
    memcpy(&x, p, sizeof(float) * (size_t)n);
    return x;
}
static inline void store_part(float *p, vec x, int64_t n) { memcpy(p, &x, sizeof(float) * (size_t)n); }

/* The one tree every lane sum takes: lanes l and l + 8, then l + 4, l + 2, l + 1. */
static float lane_sum(vec x) {
    vec a = x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    vec b = a + __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    vec c = b + __builtin_shufflevector(b, b, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    return c[0] + c[1];
}

/* exp(x) lane by lane, x clamped to [-87, 88]: 2^n · poly(r), r = x − n ln 2, |r| ≤ ln 2 / 2; ~2 ulp.
 * 2^n is applied in two halves so that n = 127 near 88 stays inside the exponent field (below
 * that both halves are exact, so it is the one-step product). Inlined into a caller that adds to
 * its result, the compiler may fuse that add with the last product: a caller whose sum must see
 * the rounded value (the attention's denominator) calls it through a function of its own that is
 * not inlined. */
static inline vec exp_lanes(vec x) {
    const vec low = splat(-87.0f), high = splat(88.0f);
    const ivec below = x < low, above = x > high;
    x = (vec)(((ivec)low & below) | ((ivec)x & ~below));
    x = (vec)(((ivec)high & above) | ((ivec)x & ~above));
    const vec shifter = splat(12582912.0f); /* 1.5 · 2^23: adding it rounds to an integer */
    const vec n = (x * splat(1.44269504088896341f) + shifter) - shifter;
    vec r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vec p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = (p * r) * r + r + splat(1.0f);
    const ivec whole = __builtin_convertvector(n, ivec), half = whole >> 1;
    return p * (vec)((half + 127) << 23) * (vec)((whole - half + 127) << 23);
}

#endif
