/* Causal attention of a prompt chunk over its sequence's paged context, for CPU (fp32 or bf16 q, K/V, out).
 *
 * The chunk's n_q query tokens sit at the last n_q positions of a context_len-token context whose K/V
 * (the chunk's own included: they are written before attention) live in the blocks the block table
 * names. Query token i sees keys [0, context_len - n_q + i]. PyTorch's fused CPU attention spends most
 * of a prefix hit's forward here at ~65 GFLOP/s on one core (bench/HISTORY.md, "Prefill attention");
 * this is the flash-attention loop written for the CPU's registers:
 *
 * - a row is one (query token, query head) pair of a KV head; the query heads sharing a KV head are
 *   rows of one tile, so each K/V row is read once for all of them (GQA for free);
 * - a tile of RT rows against KT keys: scores in RT x 2 vector registers, each key tile transposed
 *   once into a [head_dim][KT] buffer so that a score vector is a broadcast query element times a
 *   row of that buffer (no horizontal sums);
 * - online softmax per row (running max and sum, the output rescaled), fp32 throughout;
 * - P V with RB rows' output vectors held in registers while KT value rows stream past.
 *
 * Work items are (KV head, ITEM_ROWS consecutive rows); an item transposes the key tiles it needs once
 * for all its row tiles. Loaded with ctypes (engine/cpu_kernels.py), which releases the GIL; OpenMP
 * shares torch's thread pool, as in paged_attention.c.
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vexp.h"

#if defined(__AVX512F__)
#define VW 16
#define RT 12  /* rows a tile: RT x 2 score vectors + 2 key vectors fit AVX-512's 32 registers */
#define ACC_REGS 24
#else
#define VW 8
#define RT 6   /* AVX2 has 16 registers */
#define ACC_REGS 12
#endif
#define KT (2 * VW)      /* keys a tile */
#define ITEM_ROWS (8 * RT)
#define MAX_DIM 256

typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x = {(uint32_t)h << 16};
    return x.f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float load_elem(const void *base, size_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Horizontal max and sum by halving (in-order scalar loops would not vectorize without -ffast-math). */
#if VW == 16
#define LOW_HALF(x) __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
#define HIGH_HALF(x) __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15)
typedef float v8f __attribute__((vector_size(32)));
#else
#define LOW_HALF(x) (x)
#define HIGH_HALF(x) (x)
typedef vf v8f;
#endif
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int32_t v4i __attribute__((vector_size(16)));

static inline float hmax(vf x) {
    v8f a = LOW_HALF(x), b = HIGH_HALF(x);
    v8i gt = a > b;
    a = (v8f)(((v8i)a & gt) | ((v8i)b & ~gt));
    v4f c = __builtin_shufflevector(a, a, 0, 1, 2, 3), d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
    v4i gt4 = c > d;
    c = (v4f)(((v4i)c & gt4) | ((v4i)d & ~gt4));
    const float e = c[0] > c[1] ? c[0] : c[1], f = c[2] > c[3] ? c[2] : c[3];
    return e > f ? e : f;
}

static inline float hsum(vf x) {
    v8f a = VW == 16 ? LOW_HALF(x) + HIGH_HALF(x) : LOW_HALF(x);
    v4f c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline vf vmax(vf a, vf b) {
    const vi gt = a > b;
    return (vf)(((vi)a & gt) | ((vi)b & ~gt));
}

/* vexp (vexp.h) on a whole vector, lane by lane the same arithmetic. */
static inline vf vexp_v(vf x) {
    const vf lo = x - x - 87.3f, hi = x - x + 88.3f;
    x = vmax(x, lo);
    x = -vmax(-x, -hi);
    const vf shifted = x * VEXP_LOG2E + VEXP_SHIFT, n = shifted - VEXP_SHIFT;
    const vf r = (x - n * VEXP_LN2_HI) + n * VEXP_LN2_LO;
    const vi bits = (((vi)shifted - 0x4b400000) + 127) << 23;  /* 2^n */
    return VEXP_POLY(r) * (vf)bits;
}

/* cap * tanh(x / cap), as 1 - 2 / (e^(2x/cap) + 1) through vexp_v. */
static inline vf vsoftcap(vf x, float cap) {
    const vf e = vexp_v(x * (2.0f / cap));
    return (1.0f - 2.0f / (e + 1.0f)) * cap;
}

/* One row's scores against a key tile of nk vectors, of which keys [skip, visible) count (skip > 0 where a
 * sliding window starts inside the tile): updates the row's running max and sum, leaves the tile's
 * probabilities in p and returns the factor the row's output scales by (0 on a row's first tile: m starts
 * at -3e38). */
static inline __attribute__((always_inline)) float softmax_tile(vf *p, const int nk, int skip, int visible,
                                                               float *m, float *l) {
    vi keep[4];
    const int masked = visible < nk * VW || skip > 0;
    if (masked) {
        vi lane;
        for (int i = 0; i < VW; i++) lane[i] = i;
        for (int k = 0; k < nk; k++) {
            keep[k] = (lane + k * VW < visible) & (lane + k * VW >= skip);
            const vf floor = p[k] - p[k] - 3.0e38f;
            p[k] = (vf)(((vi)p[k] & keep[k]) | ((vi)floor & ~keep[k]));
        }
    }
    vf top = p[0];
    for (int k = 1; k < nk; k++) top = vmax(top, p[k]);
    const float tile_max = hmax(top), mx = tile_max > *m ? tile_max : *m;
    vf total = p[0] - p[0];
    for (int k = 0; k < nk; k++) {
        p[k] = vexp_v(p[k] - mx);
        if (masked) p[k] = (vf)((vi)p[k] & keep[k]);
        total += p[k];
    }
    const float alpha = vexp(*m - mx);
    *l = *l * alpha + hsum(total);
    *m = mx;
    return alpha;
}

typedef struct {
    void *out;                /* [n_q, num_heads, head_dim] contiguous, the dtype of q */
    const void *q;            /* [n_q, num_heads, head_dim] with strides q_token_stride, q_head_stride */
    const void *k_cache;      /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const void *v_cache;
    const int64_t *table;     /* the sequence's block ids, ceil(context_len / block_size) of them */
    int64_t q_token_stride, q_head_stride;
    int n_q, context_len, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int q_bf16, kv_bf16;
    int window;               /* > 0: query token at position p sees keys (p - window, p] (HF's sliding window) */
    float softcap;            /* > 0: scores pass through softcap * tanh(score / softcap) (Gemma 2) */
} Job;

typedef struct {  /* one thread's scratch, 64-byte aligned */
    float *q;      /* [ITEM_ROWS][dim], scaled */
    float *acc;    /* [ITEM_ROWS][dim] */
    float *kt;     /* [dim][KT]: a key tile transposed */
    float *vt;     /* [KT][dim] */
    float *p;      /* [RT][KT] */
    uint16_t *qh;  /* bf16 path: [ITEM_ROWS][dim] unscaled q */
    uint32_t *ktp; /* bf16 path: [dim / 2][KT_BF] dimension pairs of each key */
    uint32_t *vtp; /* bf16 path: [KT_BF / 2][dim] key pairs of each dimension */
    float m[ITEM_ROWS], l[ITEM_ROWS], alpha[RT];
    int qpos[ITEM_ROWS];
} Scratch;

static inline const void *kv_row(const Job *job, const void *cache, int t, int head) {
    const size_t token = (size_t)job->table[t / job->block_size] * job->block_size + t % job->block_size;
    const size_t elem = (token * job->num_kv_heads + head) * job->head_dim;
    return job->kv_bf16 ? (const void *)((const uint16_t *)cache + elem) : (const void *)((const float *)cache + elem);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define TRANSPOSE16 1
/* 16 x 16 32-bit elements transposed in registers: r[i][j] becomes r[j][i]. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* each 128-bit lane of r[i] now holds one row's 4 elements of column group i % 4 */
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}
#endif

/* Keys [t0, t0 + KT) of KV head `head` into kt, transposed ([dim][KT]); keys at or past `limit` are zeros. With
 * AVX-512, 16 keys' elements are transposed in registers (KT is 32 there; head_dim a multiple of 16). */
static void load_keys_transposed(const Job *job, Scratch *s, int head, int t0, int limit) {
    const int dim = job->head_dim;
#ifdef TRANSPOSE16
    for (int k0 = 0; k0 < KT; k0 += 16) {
        const void *rows[16];
        for (int j = 0; j < 16; j++) rows[j] = t0 + k0 + j < limit ? kv_row(job, job->k_cache, t0 + k0 + j, head) : NULL;
        for (int d0 = 0; d0 < dim; d0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++)
                r[j] = !rows[j] ? _mm512_setzero_si512()
                       : job->kv_bf16 ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                            _mm256_loadu_si256((const __m256i *)((const uint16_t *)rows[j] + d0))), 16)
                       : _mm512_loadu_si512((const float *)rows[j] + d0);
            transpose16(r);
            for (int d = 0; d < 16; d++) _mm512_storeu_si512(s->kt + (size_t)(d0 + d) * KT + k0, r[d]);
        }
    }
#else
    for (int j = 0; j < KT; j++) {
        const void *k = t0 + j < limit ? kv_row(job, job->k_cache, t0 + j, head) : NULL;
        for (int d = 0; d < dim; d++)
            s->kt[(size_t)d * KT + j] = !k ? 0.0f : job->kv_bf16 ? bf16_to_f32(((const uint16_t *)k)[d])
                                                                 : ((const float *)k)[d];
    }
#endif
}

/* Keys [t0, t0 + KT) of KV head `head` into kt (transposed) and vt; keys at or past `limit` are zeros. */
static void load_key_tile(const Job *job, Scratch *s, int head, int t0, int limit) {
    const int dim = job->head_dim;
    load_keys_transposed(job, s, head, t0, limit);
    for (int j = 0; j < KT; j++) {
        const int t = t0 + j;
        float *v = s->vt + (size_t)j * dim;
        if (t >= limit) memset(v, 0, sizeof(float) * dim);
        else if (job->kv_bf16) {
            const uint16_t *vr = kv_row(job, job->v_cache, t, head);
            for (int d = 0; d < dim; d++) v[d] = bf16_to_f32(vr[d]);
        } else memcpy(v, kv_row(job, job->v_cache, t, head), sizeof(float) * dim);
    }
}

/* Rows [r0, r0 + RT) of the item against the key tile at t0: scores, online softmax, P V. Inlined once
 * per common head size, so that every loop bound is a constant and the sums stay in registers. */
static inline __attribute__((always_inline)) void tile_dim(Scratch *s, int r0, int rows, int t0, int window,
                                                           float softcap, const int dim) {
    const int nv = dim / VW;
    vf sc[RT][2];
    for (int r = 0; r < RT; r++) sc[r][0] = sc[r][1] = (vf){0};
    const float *q = s->q + (size_t)r0 * dim;
    for (int d = 0; d < dim; d++) {
        const vf k0 = ((const vf *)(s->kt + (size_t)d * KT))[0], k1 = ((const vf *)(s->kt + (size_t)d * KT))[1];
        for (int r = 0; r < RT; r++) {
            const float x = q[(size_t)r * dim + d];
            sc[r][0] += x * k0;
            sc[r][1] += x * k1;
        }
    }
    for (int r = 0; r < RT; r++) {
        float *p = s->p + (size_t)r * KT;
        /* the keys of the tile it sees: [skip, visible) */
        const int pos = r < rows ? s->qpos[r0 + r] : -1, visible = pos - t0 + 1;
        const int skip = window > 0 ? pos - window + 1 - t0 : 0;
        if (visible <= 0 || skip >= KT) {  /* a padding row, a row before this tile or whose window starts after it */
            for (int j = 0; j < KT; j++) p[j] = 0.0f;
            s->alpha[r] = 1.0f;
            continue;
        }
        vf row[2] = {sc[r][0], sc[r][1]};
        if (softcap > 0.0f) row[0] = vsoftcap(row[0], softcap), row[1] = vsoftcap(row[1], softcap);
        s->alpha[r] = softmax_tile(row, 2, skip, visible, s->m + r0 + r, s->l + r0 + r);
        ((vf *)p)[0] = row[0];
        ((vf *)p)[1] = row[1];
    }
    enum { RB_MAX = ACC_REGS };
    const int rb = ACC_REGS / nv > 0 ? ACC_REGS / nv : 1;
    for (int b = 0; b < RT; b += rb) {
        vf a[RB_MAX][MAX_DIM / VW];
        for (int r = 0; r < rb && b + r < RT; r++) {
            const vf *src = (const vf *)(s->acc + (size_t)(r0 + b + r) * dim);
            const float alpha = s->alpha[b + r];
            for (int j = 0; j < nv; j++) a[r][j] = src[j] * alpha;
        }
        for (int jk = 0; jk < KT; jk++) {
            const vf *v = (const vf *)(s->vt + (size_t)jk * dim);
            for (int r = 0; r < rb && b + r < RT; r++) {
                const float pr = s->p[(size_t)(b + r) * KT + jk];
                for (int j = 0; j < nv; j++) a[r][j] += pr * v[j];
            }
        }
        for (int r = 0; r < rb && b + r < RT; r++) {
            vf *dst = (vf *)(s->acc + (size_t)(r0 + b + r) * dim);
            for (int j = 0; j < nv; j++) dst[j] = a[r][j];
        }
    }
}

static void tile(const Job *job, Scratch *s, int r0, int rows, int t0) {
    if (job->head_dim == 64) tile_dim(s, r0, rows, t0, job->window, job->softcap, 64);
    else if (job->head_dim == 128) tile_dim(s, r0, rows, t0, job->window, job->softcap, 128);
    else tile_dim(s, r0, rows, t0, job->window, job->softcap, job->head_dim);
}

#if defined(__AVX512BF16__) && VW == 16
#define DPBF16 1
#define RT_BF 6             /* rows a tile: 6 x 4 score vectors */
#define NK_BF 4
#define KT_BF (NK_BF * VW)  /* keys a tile: softmax's fixed costs per row and tile spread over 64 keys */
/* The bf16 path: q, K and V are bf16 already, so Q K^T and P V run as bf16 pair dot products into fp32
 * sums (vdpbf16ps: twice the multiplies of an fp32 FMA). P is rounded to bf16 for P V, as torch's
 * fused attention does for bf16; max, exp and the running sums stay fp32. */
static inline __attribute__((always_inline)) void tile_bf16_dim(Scratch *s, int r0, int rows, int t0, float scale,
                                                               int window, float softcap, const int dim) {
    const int np = dim / 2, nv = dim / VW;
    __m512 sc[RT_BF][NK_BF];
    for (int r = 0; r < RT_BF; r++)
        for (int k = 0; k < NK_BF; k++) sc[r][k] = _mm512_setzero_ps();
    const uint32_t *q = (const uint32_t *)(s->qh + (size_t)r0 * dim);
    for (int d2 = 0; d2 < np; d2++) {
        __m512bh kv[NK_BF];
        for (int k = 0; k < NK_BF; k++) kv[k] = (__m512bh)_mm512_loadu_si512(s->ktp + (size_t)d2 * KT_BF + k * VW);
        for (int r = 0; r < RT_BF; r++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)q[(size_t)r * np + d2]);
            for (int k = 0; k < NK_BF; k++) sc[r][k] = _mm512_dpbf16_ps(sc[r][k], x, kv[k]);
        }
    }
    uint32_t ph[RT_BF][KT_BF / 2];
    for (int r = 0; r < RT_BF; r++) {
        const int pos = r < rows ? s->qpos[r0 + r] : -1, visible = pos - t0 + 1;
        const int skip = window > 0 ? pos - window + 1 - t0 : 0;
        if (visible <= 0 || skip >= KT_BF) {
            for (int j = 0; j < KT_BF / 2; j++) ph[r][j] = 0;
            s->alpha[r] = 1.0f;
            continue;
        }
        vf row[NK_BF];
        for (int k = 0; k < NK_BF; k++) row[k] = (vf)sc[r][k] * scale;
        if (softcap > 0.0f)
            for (int k = 0; k < NK_BF; k++) row[k] = vsoftcap(row[k], softcap);
        s->alpha[r] = softmax_tile(row, NK_BF, skip, visible, s->m + r0 + r, s->l + r0 + r);
        for (int k = 0; k < NK_BF; k += 2)
            _mm512_storeu_si512(ph[r] + k * VW / 2, (__m512i)_mm512_cvtne2ps_pbh((__m512)row[k + 1], (__m512)row[k]));
    }
    enum { RB_MAX = ACC_REGS };
    const int rb = ACC_REGS / nv > 0 ? ACC_REGS / nv : 1;
    for (int b = 0; b < RT_BF; b += rb) {
        __m512 a[RB_MAX][MAX_DIM / VW];
        for (int r = 0; r < rb && b + r < RT_BF; r++) {
            const float *src = s->acc + (size_t)(r0 + b + r) * dim;
            const __m512 alpha = _mm512_set1_ps(s->alpha[b + r]);
            for (int j = 0; j < nv; j++) a[r][j] = _mm512_mul_ps(_mm512_loadu_ps(src + j * VW), alpha);
        }
        for (int jp = 0; jp < KT_BF / 2; jp++) {
            __m512bh v[MAX_DIM / VW];
            for (int j = 0; j < nv; j++) v[j] = (__m512bh)_mm512_loadu_si512(s->vtp + (size_t)jp * dim + j * VW);
            for (int r = 0; r < rb && b + r < RT_BF; r++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)ph[b + r][jp]);
                for (int j = 0; j < nv; j++) a[r][j] = _mm512_dpbf16_ps(a[r][j], x, v[j]);
            }
        }
        for (int r = 0; r < rb && b + r < RT_BF; r++) {
            float *dst = s->acc + (size_t)(r0 + b + r) * dim;
            for (int j = 0; j < nv; j++) _mm512_storeu_ps(dst + j * VW, a[r][j]);
        }
    }
}

static void tile_bf16(const Job *job, Scratch *s, int r0, int rows, int t0) {
    if (job->head_dim == 64) tile_bf16_dim(s, r0, rows, t0, job->scale, job->window, job->softcap, 64);
    else if (job->head_dim == 128) tile_bf16_dim(s, r0, rows, t0, job->scale, job->window, job->softcap, 128);
    else tile_bf16_dim(s, r0, rows, t0, job->scale, job->window, job->softcap, job->head_dim);
}

/* Keys [t0, t0 + KT) as dimension pairs (for Q K^T) and key pairs (for P V); zeros at or past `limit`.
 * Vectorized: 16 keys' dimension pairs are transposed in registers (a scalar loop storing one element at a
 * stride was most of a short chunk's attention at long context), and two keys' values are interleaved by
 * widening 16-bit lanes to 32. */
static void load_key_tile_bf16(const Job *job, Scratch *s, int head, int t0, int limit) {
    const int dim = job->head_dim, np = dim / 2;
    for (int k0 = 0; k0 < KT_BF; k0 += 16) {
        const uint32_t *rows[16];
        for (int j = 0; j < 16; j++)
            rows[j] = t0 + k0 + j < limit ? (const uint32_t *)kv_row(job, job->k_cache, t0 + k0 + j, head) : NULL;
        for (int p0 = 0; p0 < np; p0 += 16) {
            const __mmask16 m = np - p0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (np - p0)) - 1);
            __m512i r[16];
            for (int j = 0; j < 16; j++)
                r[j] = rows[j] ? _mm512_maskz_loadu_epi32(m, rows[j] + p0) : _mm512_setzero_si512();
            transpose16(r);
            for (int d2 = 0; d2 < 16 && p0 + d2 < np; d2++)
                _mm512_storeu_si512(s->ktp + (size_t)(p0 + d2) * KT_BF + k0, r[d2]);
        }
    }
    for (int jp = 0; jp < KT_BF / 2; jp++) {
        const int t = t0 + 2 * jp;
        const uint16_t *v0 = t < limit ? kv_row(job, job->v_cache, t, head) : NULL;
        const uint16_t *v1 = t + 1 < limit ? kv_row(job, job->v_cache, t + 1, head) : NULL;
        uint32_t *dst = s->vtp + (size_t)jp * dim;
        for (int d = 0; d < dim; d += 16) {
            const __m512i lo = v0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + d)))
                                  : _mm512_setzero_si512();
            const __m512i hi = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + d)))
                                  : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}
#endif

/* Rows [first, first + rows) of KV head `head`: row i is query token i / group, head head * group + i % group. */
static void item(const Job *job, Scratch *s, int head, int first, int rows) {
    const int dim = job->head_dim, group = job->num_heads / job->num_kv_heads;
    const int padded = (rows + RT - 1) / RT * RT, offset = job->context_len - job->n_q;
#ifdef DPBF16
    const int dot_bf16 = job->q_bf16 && job->kv_bf16;
#else
    const int dot_bf16 = 0;
#endif
    for (int i = 0; i < padded; i++) {
        float *qr = s->q + (size_t)i * dim;
        uint16_t *qh = s->qh + (size_t)i * dim;
        s->m[i] = -3.0e38f, s->l[i] = 0.0f;
        memset(s->acc + (size_t)i * dim, 0, sizeof(float) * dim);
        if (i >= rows) {
            memset(qr, 0, sizeof(float) * dim);
            memset(qh, 0, sizeof(uint16_t) * dim);
            continue;
        }
        const int token = (first + i) / group, h = head * group + (first + i) % group;
        s->qpos[i] = offset + token;
        const size_t base = (size_t)token * job->q_token_stride + (size_t)h * job->q_head_stride;
        if (dot_bf16) memcpy(qh, (const uint16_t *)job->q + base, sizeof(uint16_t) * dim);
        else for (int d = 0; d < dim; d++) qr[d] = load_elem(job->q, base + d, job->q_bf16) * job->scale;
    }
    const int last_key = s->qpos[rows - 1];  /* rows go by token, so the last row sees the most */
#ifdef DPBF16
    const int kt = dot_bf16 ? KT_BF : KT, rt = dot_bf16 ? RT_BF : RT;
#else
    const int kt = KT, rt = RT;
#endif
    /* under a sliding window the first row's window starts at its position - window + 1; no row sees before */
    const int first_key = job->window > 0 && s->qpos[0] - job->window + 1 > 0 ? s->qpos[0] - job->window + 1 : 0;
    for (int t0 = first_key / kt * kt; t0 <= last_key; t0 += kt) {
#ifdef DPBF16
        if (dot_bf16) load_key_tile_bf16(job, s, head, t0, last_key + 1);
        else
#endif
        load_key_tile(job, s, head, t0, last_key + 1);
        for (int r0 = 0; r0 < rows; r0 += rt) {
            const int n = rows - r0 < rt ? rows - r0 : rt;
            if (s->qpos[r0 + n - 1] < t0) continue;
            if (job->window > 0 && s->qpos[r0] - job->window + 1 >= t0 + kt) continue;  /* all its windows start later */
#ifdef DPBF16
            if (dot_bf16) tile_bf16(job, s, r0, n, t0);
            else
#endif
            tile(job, s, r0, n, t0);
        }
    }
    for (int i = 0; i < rows; i++) {
        const int token = (first + i) / group, h = head * group + (first + i) % group;
        const size_t base = ((size_t)token * job->num_heads + h) * dim;
        const float inv = 1.0f / s->l[i], *a = s->acc + (size_t)i * dim;
        if (job->q_bf16) for (int d = 0; d < dim; d++) ((uint16_t *)job->out)[base + d] = f32_to_bf16(a[d] * inv);
        else for (int d = 0; d < dim; d++) ((float *)job->out)[base + d] = a[d] * inv;
    }
}

static int supported(int head_dim) { return head_dim > 0 && head_dim % VW == 0 && head_dim <= MAX_DIM; }

int prefill_attention_supported(int head_dim) { return supported(head_dim); }

/* Returns 0 on success, -1 when scratch memory could not be had, -2 for a shape this kernel does not
 * take (a head size that is not a multiple of the vector width, or over MAX_DIM). */
int paged_prefill_attention(void *out, const void *q, const void *k_cache, const void *v_cache,
                            const int64_t *table, int64_t q_token_stride, int64_t q_head_stride, int n_q,
                            int context_len, int num_heads, int num_kv_heads, int head_dim, int block_size,
                            float scale, int num_threads, int q_bf16, int kv_bf16, int window, float softcap) {
    if (!supported(head_dim) || num_kv_heads < 1 || num_heads % num_kv_heads != 0 || n_q < 1 || n_q > context_len)
        return -2;
    const Job job = {out, q, k_cache, v_cache, table, q_token_stride, q_head_stride, n_q, context_len,
                     num_heads, num_kv_heads, head_dim, block_size, scale, q_bf16, kv_bf16, window, softcap};
    const int rows = n_q * (num_heads / num_kv_heads), per_head = (rows + ITEM_ROWS - 1) / ITEM_ROWS;
    const int items = per_head * num_kv_heads;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > items) num_threads = items;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        Scratch *s = aligned_alloc(64, (sizeof(Scratch) + 63) / 64 * 64);
        /* q, acc, kt, vt, p as floats; qh, ktp, vtp */
        const size_t floats = (size_t)2 * ITEM_ROWS * head_dim + 2 * (size_t)KT * head_dim + RT * KT
                              + (size_t)ITEM_ROWS * head_dim / 2 + (size_t)2 * KT * head_dim;
        float *buf = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
        const int ok = s != NULL && buf != NULL;
        if (ok) {
            s->q = buf;
            s->acc = s->q + (size_t)ITEM_ROWS * head_dim;
            s->kt = s->acc + (size_t)ITEM_ROWS * head_dim;
            s->vt = s->kt + (size_t)KT * head_dim;
            s->p = s->vt + (size_t)KT * head_dim;
            s->qh = (uint16_t *)(s->p + RT * KT);
            s->ktp = (uint32_t *)(s->qh + (size_t)ITEM_ROWS * head_dim);
            s->vtp = s->ktp + (size_t)KT * head_dim;  /* KT_BF = 2 KT keys, dim / 2 pairs each */
        }
        failed |= !ok;
        /* every thread meets the loop (a worksharing loop must be); the last rows' items do the most
         * work (they see the most keys), so they are handed out first */
#pragma omp for schedule(dynamic, 1)
        for (int it = items - 1; it >= 0; it--) {
            const int head = it % num_kv_heads, chunk = it / num_kv_heads, first = chunk * ITEM_ROWS;
            if (ok) item(&job, s, head, first, rows - first < ITEM_ROWS ? rows - first : ITEM_ROWS);
        }
        free(s);
        free(buf);
    }
    return failed ? -1 : 0;
}
