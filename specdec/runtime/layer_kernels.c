/* Row-wise float32 kernels for the int8 precision's layers (docs/algorithms.md §14): the RMS norm
 * and the gated MLP's middle, each one pass over a row where torch takes four to six operators
 * (each a call with its own overhead in a decode step, and each a pass over [rows, 8960] floats in
 * a prefill).
 *
 * A row's result depends on that row alone, in one fixed order (a row's squares summed in 16 lanes,
 * element i in lane i mod 16, chunk after chunk, then one tree over the lanes), whatever the row
 * count, the thread count or the vector width the compiler lowers the lanes to: rows stay bitwise
 * the same in every pass shape. The numbers are not torch's bitwise (its sum and its exp take other
 * orders), so a model runs these kernels in every pass or in none (specdec.runtime.layer_kernels).
 *
 * Built at first use by specdec.runtime.c_kernels (cc -O3 -march=native -fopenmp), called through
 * ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
typedef float vec __attribute__((vector_size(64)));
typedef float vec_unaligned __attribute__((vector_size(64), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(64)));

static inline vec splat(float x) { return (vec){0} + x; }
static inline vec load(const float *p) { return *(const vec_unaligned *)p; }
static inline void store(float *p, vec x) { *(vec_unaligned *)p = x; }
/* The first n (< 16) floats at p, zeros after: a row's last chunk when its width is not a multiple of 16. */
static inline vec load_part(const float *p, int64_t n) {
    vec x = splat(0.0f);
    memcpy(&x, p, sizeof(float) * (size_t)n);
    return x;
}
static inline void store_part(float *p, vec x, int64_t n) { memcpy(p, &x, sizeof(float) * (size_t)n); }

/* The one tree over the lanes: l and l + 8, then + 4, + 2, + 1. */
static float lane_sum(vec x) {
    vec a = x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    vec b = a + __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    vec c = b + __builtin_shufflevector(b, b, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    return c[0] + c[1];
}

/* out = weight · (x · (1 / sqrt(mean(x²) + eps))) for one row of `cols` values, as transformers'
 * Llama-family RMS norms compute it in float32. */
static void rms_norm_row(const float *row, int64_t cols, const float *weight, float eps, float *o) {
    const int64_t whole = cols / LANES * LANES;
    vec squares = splat(0.0f);
    for (int64_t c = 0; c < whole; c += LANES) {
        const vec v = load(row + c);
        squares = squares + v * v;
    }
    if (whole < cols) {
        const vec v = load_part(row + whole, cols - whole);
        squares = squares + v * v;
    }
    const vec scale = splat(1.0f / sqrtf(lane_sum(squares) / (float)cols + eps));
    for (int64_t c = 0; c < whole; c += LANES) store(o + c, load(weight + c) * (load(row + c) * scale));
    if (whole < cols)
        store_part(o + whole, load_part(weight + whole, cols - whole) * (load_part(row + whole, cols - whole) * scale),
                   cols - whole);
}

/* Rows from PARALLEL_ROWS on (a prefill chunk) are split over the threads; fewer (a decode or verify
 * pass: microseconds of work) run on the calling thread with no OpenMP region at all, not even one
 * whose `if` clause fails, which still passes through libgomp's team start. */
#define PARALLEL_ROWS 16

void specdec_rms_norm(const float *x, int64_t rows, int64_t cols, const float *weight, float eps,
                      float *out, int threads) {
    if (rows < PARALLEL_ROWS) {
        for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * cols, cols, weight, eps, out + r * cols);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * cols, cols, weight, eps, out + r * cols);
}

/* exp(x) lane by lane, x clamped to [-87, 88]: 2^n · poly(r), r = x − n ln 2, |r| ≤ ln 2 / 2; ~2 ulp.
 * 2^n is applied in two halves so that n = 127 near 88 stays inside the exponent field. */
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

/* silu(g) · u for g = P[r, j] · s_r and u = P[r, I + j] · s_r, j < I: the gated MLP's middle from
 * the product P [rows, 2I] of its shared gate-and-up weight and each row's scale. */
static inline vec silu_mul(vec gate, vec up, vec scale) {
    const vec g = gate * scale, u = up * scale;
    return g / (splat(1.0f) + exp_lanes(-g)) * u;
}

/* One row of the middle. */
static void silu_mul_row(const float *gate, int64_t inner, float row_scale, float *o) {
    const int64_t whole = inner / LANES * LANES;
    const float *up = gate + inner;
    const vec scale = splat(row_scale);
    for (int64_t c = 0; c < whole; c += LANES) store(o + c, silu_mul(load(gate + c), load(up + c), scale));
    if (whole < inner)
        store_part(o + whole, silu_mul(load_part(gate + whole, inner - whole), load_part(up + whole, inner - whole),
                                       scale), inner - whole);
}

void specdec_silu_mul(const float *product, const float *row_scale, int64_t rows, int64_t inner,
                      float *out, int threads) {
    if (rows < PARALLEL_ROWS) {
        for (int64_t r = 0; r < rows; r++) silu_mul_row(product + r * 2 * inner, inner, row_scale[r], out + r * inner);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) silu_mul_row(product + r * 2 * inner, inner, row_scale[r], out + r * inner);
}
