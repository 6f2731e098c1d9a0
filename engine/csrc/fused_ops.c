/* Fused elementwise ops of a Llama-family decoder layer for the CPU path, fp32 or bf16.
 *
 * Unfused, HF's layer runs each of these as 4-10 small torch ops (casts, pow, mean, rsqrt, mul,
 * chunk, neg, cat, add), each with its own dispatch, allocation and pass over memory; in a decode
 * step that overhead, not arithmetic, is the time. Each function here is one pass and one call.
 * Results match HF's op by op: every intermediate that HF rounds to the model's dtype is rounded
 * here too (bf16: round to nearest even, as torch does), and sums and products are computed in
 * float in the same order (built with -ffp-contract=off, so no fused multiply-add changes a bit).
 * Loaded with ctypes (engine/cpu_kernels.py), which releases the GIL.
 *
 * Rows are split over `num_threads` OpenMP threads (torch's pool: the library links the libgomp torch
 * loaded) when there are enough of them to pay for the fork, as in a prefill; a decode step's few rows
 * run on the calling thread.
 *
 * dtype: 0 = float32, 1 = bfloat16. Rows are contiguous in the last dimension; the row stride is
 * given in elements where a row may be a slice of a wider tensor (the fused QKV output).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vexp.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#define PARALLEL_ROWS 16  /* fewer rows than this run on one thread */

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) {  /* branch-free, so that loops over it vectorize */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* A value as the model's dtype holds it: identity in fp32, rounded to bf16 and back in bf16. */
static inline float as_dtype(float f, int bf16) {
    if (!bf16) return f;
    /* bf16_round(f) << 16, kept in 32-bit lanes: no narrowing and widening between the vector ops */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u, quiet_nan = (u & 0xffff0000u) | 0x400000u;
    u = (u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float load(const void *base, size_t i, int bf16) {
    return bf16 ? bf16_load((const uint16_t *)base + i) : ((const float *)base)[i];
}

static inline void store(void *base, size_t i, float f, int bf16) {
    if (bf16) ((uint16_t *)base)[i] = bf16_round(f);
    else ((float *)base)[i] = f;
}

/* out = weight * normalize(x) per row (HF LlamaRMSNorm). With `residual` non-NULL, first
 * x = x + residual (rounded to the dtype, as HF's `residual + hidden_states`) and the sum is written
 * back to `residual`: the next residual stream. x is [rows, dim] contiguous, weight [dim]. */
static inline __attribute__((always_inline)) void rms_norm_row(void *out, const void *x, void *residual,
                                                                const void *weight, size_t base, int dim,
                                                                float eps, int bf16) {
    float sum_row[dim];
    float partial[16] = {0};  /* 16 running sums, so that the loop vectorizes (as torch's reduction) */
    for (int i = 0; i < dim; i++) {
        float v = load(x, base + i, bf16);
        if (residual != NULL) {
            v = as_dtype(v + load(residual, base + i, bf16), bf16);
            store(residual, base + i, v, bf16);
        }
        sum_row[i] = v;
    }
    for (int i = 0; i + 16 <= dim; i += 16)
        for (int j = 0; j < 16; j++) partial[j] += sum_row[i + j] * sum_row[i + j];
    for (int i = dim - dim % 16; i < dim; i++) partial[i % 16] += sum_row[i] * sum_row[i];
    float ss = 0.0f;
    for (int j = 0; j < 16; j++) ss += partial[j];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = 0; i < dim; i++)
        store(out, base + i, load(weight, i, bf16) * as_dtype(sum_row[i] * inv, bf16), bf16);
}

int rms_norm(void *out, const void *x, void *residual, const void *weight, int rows, int dim, float eps,
             int dtype, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        /* each branch inlines the row with a constant dtype, so that its loops specialize and vectorize */
        if (dtype == 1) rms_norm_row(out, x, residual, weight, (size_t)r * dim, dim, eps, 1);
        else rms_norm_row(out, x, residual, weight, (size_t)r * dim, dim, eps, 0);
    }
    return 0;
}

/* out[r, j] = silu(gate_up[r, j]) * gate_up[r, d + j] (HF LlamaMLP: act_fn(gate) * up, silu rounded
 * to the dtype before the product). gate_up is [rows, 2d] contiguous, out [rows, d]. */
static inline __attribute__((always_inline)) void silu_and_mul_row(void *out, const void *gate_up, size_t in,
                                                                    size_t o, int d, int bf16) {
    for (int j = 0; j < d; j++) {
        const float g = load(gate_up, in + j, bf16);
        const float s = as_dtype(g / (1.0f + vexp(-g)), bf16);
        store(out, o + j, s * load(gate_up, in + d + j, bf16), bf16);
    }
}

int silu_and_mul(void *out, const void *gate_up, int rows, int d, int dtype, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && rows >= PARALLEL_ROWS)
    {
#if defined(__SSE__)
        /* Flush denormals while this runs (MXCSR is per thread): gcc's vectorized exp met denormal operands,
         * and microcode assists made a 256-token MLP's SiLU 10x slower. A denormal silu(x), below 1.2e-38 in
         * magnitude, becomes 0. */
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040u);
#endif
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {
            if (dtype == 1) silu_and_mul_row(out, gate_up, (size_t)r * 2 * d, (size_t)r * d, d, 1);
            else silu_and_mul_row(out, gate_up, (size_t)r * 2 * d, (size_t)r * d, d, 0);
        }
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
    return 0;
}

/* Rotary embedding in place (HF apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, each product
 * and the sum rounded to the dtype). x: `rows` tokens of `heads` heads of `head_dim`, token t's head h
 * at x + t * row_stride + h * head_dim; cos, sin: [rows, head_dim] contiguous. */
static inline __attribute__((always_inline)) void rope_row(void *x, const void *cos, const void *sin, int t,
                                                            int heads, int head_dim, int64_t row_stride, int bf16) {
    const int half = head_dim / 2;
    const size_t cs = (size_t)t * head_dim;
    for (int h = 0; h < heads; h++) {
        const size_t base = (size_t)t * row_stride + (size_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            const float x1 = load(x, base + i, bf16), x2 = load(x, base + half + i, bf16);
            const float c1 = load(cos, cs + i, bf16), s1 = load(sin, cs + i, bf16);
            const float c2 = load(cos, cs + half + i, bf16), s2 = load(sin, cs + half + i, bf16);
            const float y1 = as_dtype(x1 * c1, bf16) + as_dtype(-x2 * s1, bf16);
            const float y2 = as_dtype(x2 * c2, bf16) + as_dtype(x1 * s2, bf16);
            store(x, base + i, y1, bf16);
            store(x, base + half + i, y2, bf16);
        }
    }
}

int rope(void *x, const void *cos, const void *sin, int rows, int heads, int head_dim, int64_t row_stride,
         int dtype, int num_threads) {
    if (head_dim % 2 != 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && rows >= PARALLEL_ROWS)
    for (int t = 0; t < rows; t++) {
        if (dtype == 1) rope_row(x, cos, sin, t, heads, head_dim, row_stride, 1);
        else rope_row(x, cos, sin, t, heads, head_dim, row_stride, 0);
    }
    return 0;
}
