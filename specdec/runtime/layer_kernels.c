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

#include "lanes.h"

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
