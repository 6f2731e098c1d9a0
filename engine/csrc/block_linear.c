/* y = x W^T for weights held as the 4- and 8-bit blocks they were shipped in (GGUF Q4_1 and Q8_0),
 * decoded in registers: the CPU path's small-batch (decode) linears.
 *
 * A decode step of a small model reads every weight once per step and does little arithmetic with it,
 * so on a CPU it is bound by memory: SmolLM2-135M's fp32 weights are 538 MB a step. The default model
 * ships as Q4_1 (token embedding Q8_0), and its fp32 weights are exactly those blocks decoded:
 * w = d * q + m (Q4_1) or w = d * q (Q8_0), d and m fp16, q a 4- or 8-bit integer. The product d * q is
 * exact in fp32 (at most 11 + 8 significant bits), so decoding here with one fused multiply-add rounds
 * exactly as the fp32 weights were rounded: the same weights, a fifth of the bytes. Products and sums
 * are fp32, as oneDNN's; only the order of the sum over the input dimension differs.
 *
 * Layout (engine/cpu_layers.py packs it): outputs in tiles of 16 (one AVX-512 register, one lane per
 * output), inputs in blocks of 32; each (tile, block) is one record, tiles outer, blocks inner:
 *   Q4_1: uint16 d[16], m[16] (fp16), uint8 q[16][16]: q[j][lane] holds input 2j (low nibble) and 2j+1
 *         (high nibble) of that lane's output; 320 bytes per 512 weights.
 *   Q8_0: uint16 d[16] (fp16), int8 q[32][16]: q[k][lane]; 544 bytes per 512 weights.
 * Each call computes two tiles (32 outputs) for up to 8 rows at a time, accumulators in registers; the
 * pairs of tiles are split over `num_threads` OpenMP threads.
 *
 * `pack_blocks` finds the blocks in fp32 weights and writes the records (engine/weight_blocks.py).
 *
 * Built with AVX-512 only: `block_linear_supported()` is 0 otherwise and the caller keeps oneDNN.
 */
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#define ROWS 8  /* rows per pass: 16 accumulators, 4 decoded weight registers, 4 scales */

typedef struct { uint16_t d[16], m[16]; uint8_t q[16][16]; } q4_record;
typedef struct { uint16_t d[16]; int8_t q[32][16]; } q8_record;

static inline __attribute__((always_inline)) void q4_pass(int rows, const float *x, long ldx, float *y, long ldy,
                                                          const q4_record *w0, const q4_record *w1, int blocks) {
    __m512 acc[ROWS][2];
    for (int r = 0; r < rows; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(15);
    for (int b = 0; b < blocks; b++) {
        const q4_record *a = w0 + b, *c = w1 + b;
        const __m512 da = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)a->d));
        const __m512 ma = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)a->m));
        const __m512 dc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d));
        const __m512 mc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->m));
        const float *xb = x + (long)b * 32;
        for (int j = 0; j < 16; j++) {
            const __m512i qa = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)a->q[j]));
            const __m512i qc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c->q[j]));
            const __m512 a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(qa, low)), da, ma);
            const __m512 a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(qa, 4)), da, ma);
            const __m512 c0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(qc, low)), dc, mc);
            const __m512 c1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(qc, 4)), dc, mc);
            for (int r = 0; r < rows; r++) {
                const __m512 x0 = _mm512_set1_ps(xb[r * ldx + 2 * j]);
                const __m512 x1 = _mm512_set1_ps(xb[r * ldx + 2 * j + 1]);
                acc[r][0] = _mm512_fmadd_ps(x0, a0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(x0, c0, acc[r][1]);
                acc[r][0] = _mm512_fmadd_ps(x1, a1, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(x1, c1, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

static inline __attribute__((always_inline)) void q8_pass(int rows, const float *x, long ldx, float *y, long ldy,
                                                          const q8_record *w0, const q8_record *w1, int blocks) {
    __m512 acc[ROWS][2];
    for (int r = 0; r < rows; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const q8_record *a = w0 + b, *c = w1 + b;
        const __m512 da = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)a->d));
        const __m512 dc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d));
        const float *xb = x + (long)b * 32;
        for (int k = 0; k < 32; k++) {
            const __m512 a0 = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)a->q[k]))), da);
            const __m512 c0 = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c->q[k]))), dc);
            for (int r = 0; r < rows; r++) {
                const __m512 x0 = _mm512_set1_ps(xb[r * ldx + k]);
                acc[r][0] = _mm512_fmadd_ps(x0, a0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(x0, c0, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

/* One pair of tiles for all rows, in passes of ROWS; each row count gets its own unrolled copy. */
#define DISPATCH(pass, record)                                                                       \
    static void pass##_pair(int m, const float *x, long ldx, float *y, long ldy, const record *w0,   \
                            const record *w1, int blocks) {                                          \
        for (int r0 = 0; r0 < m; r0 += ROWS) {                                                       \
            const float *xr = x + (long)r0 * ldx;                                                    \
            float *yr = y + (long)r0 * ldy;                                                          \
            switch (m - r0 < ROWS ? m - r0 : ROWS) {                                                 \
            case 1: pass(1, xr, ldx, yr, ldy, w0, w1, blocks); break;                                \
            case 2: pass(2, xr, ldx, yr, ldy, w0, w1, blocks); break;                                \
            case 3: pass(3, xr, ldx, yr, ldy, w0, w1, blocks); break;                                \
            case 4: pass(4, xr, ldx, yr, ldy, w0, w1, blocks); break;                                \
            case 5: pass(5, xr, ldx, yr, ldy, w0, w1, blocks); break;                                \
            case 6: pass(6, xr, ldx, yr, ldy, w0, w1, blocks); break;                                \
            case 7: pass(7, xr, ldx, yr, ldy, w0, w1, blocks); break;                                \
            default: pass(8, xr, ldx, yr, ldy, w0, w1, blocks); break;                               \
            }                                                                                        \
        }                                                                                            \
    }
DISPATCH(q4_pass, q4_record)
DISPATCH(q8_pass, q8_record)

int block_linear_supported(void) { return 1; }

/* fp16 <-> fp32 with AVX-512F's conversions (the scalar ones need F16C, which the build does not ask for). */
static inline uint16_t to_half(float f) {
    const __m256i h = _mm512_cvtps_ph(_mm512_set1_ps(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return (uint16_t)_mm256_extract_epi16(h, 0);
}

static inline float from_half(uint16_t h) { return _mm512_cvtss_f32(_mm512_cvtph_ps(_mm256_set1_epi16((short)h))); }

/* Solves one block of 32 weights x as d * q + m (Q4_1, q in 0..15) or d * q (Q8_0, q in -128..127) with
 * fp16 d and m, trying the estimated d and its two fp16 neighbours; 0 and d, m, q[32] if exact, else -1.
 * q * d is exact in fp32 (at most 8 + 11 significant bits), so the sum rounds once, as the decoder did. */
static int solve_block(const float *x, int kind, uint16_t *d_out, uint16_t *m_out, int *q) {
    float lo = x[0], hi = x[0], amax = 0.0f;
    for (int i = 0; i < 32; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    }
    float m = 0.0f;
    int qmin = -128, qmax = 127;
    uint16_t estimate;
    if (kind == 0) {
        *m_out = to_half(lo);
        m = from_half(*m_out);
        if (m != lo)
            return -1;
        qmin = 0, qmax = 15;
        estimate = to_half((hi - lo) / 15.0f);
    } else {
        estimate = to_half(amax / 127.0f);
    }
    const uint16_t candidates[3] = {estimate, (uint16_t)(estimate + 1), estimate ? (uint16_t)(estimate - 1) : 0};
    for (int c = 0; c < 3; c++) {
        const float d = from_half(candidates[c]);
        if (!(d >= 0.0f) || isinf(d))
            continue;
        /* q from the reciprocal, rounded half away from zero: any q it gets wrong fails the check below. */
        const float inv = d > 0.0f ? 1.0f / d : 0.0f;
        int exact = 1;
        for (int i = 0; i < 32; i++) {  /* no early exit: the loop vectorizes */
            float v = (x[i] - m) * inv;
            v = v < qmin ? qmin : (v > qmax ? qmax : v);
            q[i] = (int)(v + (v >= 0.0f ? 0.5f : -0.5f));
            exact &= (float)q[i] * d + m == x[i];
        }
        if (exact) {
            *d_out = candidates[c];
            return 0;
        }
    }
    return -1;
}

/* Packs w [n, k] (fp32, rows contiguous) into the records described at the top; 0 if every block is
 * exactly `kind`, else -1 (out is then garbage). n % 16 == 0, k % 32 == 0. */
int pack_blocks(uint8_t *out, const float *w, int n, int k, int kind) {
    if (n % 16 != 0 || k % 32 != 0 || (kind != 0 && kind != 1))
        return -1;
    const int blocks = k / 32;
    for (int t = 0; t < n / 16; t++) {
        for (int b = 0; b < blocks; b++) {
            const long index = (long)t * blocks + b;
            q4_record *r4 = (q4_record *)out + index;
            q8_record *r8 = (q8_record *)out + index;
            for (int lane = 0; lane < 16; lane++) {
                int q[32];
                uint16_t d, m = 0;
                if (solve_block(w + (long)(16 * t + lane) * k + 32L * b, kind, &d, &m, q) != 0)
                    return -1;
                if (kind == 0) {
                    r4->d[lane] = d, r4->m[lane] = m;
                    for (int j = 0; j < 16; j++)
                        r4->q[j][lane] = (uint8_t)(q[2 * j] | (q[2 * j + 1] << 4));
                } else {
                    r8->d[lane] = d;
                    for (int i = 0; i < 32; i++)
                        r8->q[i][lane] = (int8_t)q[i];
                }
            }
        }
    }
    return 0;
}

/* y[m, n] = sum_k x[m, k] w[n, k]; x rows ldx apart, y rows ldy apart (elements); n % 32 == 0,
 * k % 32 == 0. kind: 0 = Q4_1, 1 = Q8_0. Returns 0, or -1 for a shape or kind it cannot compute. */
int block_linear(float *y, const float *x, const void *w, int m, int n, int k, long ldx, long ldy, int kind,
                 int num_threads) {
    if (m < 0 || n % 32 != 0 || k % 32 != 0 || (kind != 0 && kind != 1))
        return -1;
    if (m == 0)
        return 0;
    const int blocks = k / 32, pairs = n / 32;
    const long tile = (long)blocks * (kind == 0 ? sizeof(q4_record) : sizeof(q8_record));
    if (num_threads < 1)
        num_threads = 1;
    if (num_threads > pairs)
        num_threads = pairs;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int p = 0; p < pairs; p++) {
        const char *w0 = (const char *)w + 2 * p * tile;
        float *yp = y + 32L * p;
        if (kind == 0)
            q4_pass_pair(m, x, ldx, yp, ldy, (const q4_record *)w0, (const q4_record *)(w0 + tile), blocks);
        else
            q8_pass_pair(m, x, ldx, yp, ldy, (const q8_record *)w0, (const q8_record *)(w0 + tile), blocks);
    }
    return 0;
}

#else

int block_linear_supported(void) { return 0; }

int pack_blocks(uint8_t *out, const float *w, int n, int k, int kind) {
    (void)out, (void)w, (void)n, (void)k, (void)kind;
    return -1;
}

int block_linear(float *y, const float *x, const void *w, int m, int n, int k, long ldx, long ldy, int kind,
                 int num_threads) {
    (void)y, (void)x, (void)w, (void)m, (void)n, (void)k, (void)ldx, (void)ldy, (void)kind, (void)num_threads;
    return -1;
}

#endif
