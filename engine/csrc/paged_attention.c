/* Decode attention for CPU straight from the paged KV cache (fp32 or bf16 K/V; q and out fp32).
 *
 * One query token per sequence attends its whole context, read in place from the blocks its
 * block table names: no gather into a padded copy, no mask, no per-group calls. Work items are
 * (sequence, KV head); the query heads that share a KV head are computed together, so each K/V
 * row is read once. Loaded with ctypes (see engine/cpu_kernels.py), which releases the GIL.
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>

#include "vexp.h"

typedef struct {
    float *out;              /* [num_seqs, num_heads, head_dim] */
    const float *q;          /* [num_seqs, num_heads, head_dim] */
    const void *k_cache;     /* [num_blocks, block_size, num_kv_heads, head_dim], fp32 or bf16 */
    const void *v_cache;
    const int64_t *tables;   /* [num_seqs, table_width] block ids */
    const int64_t *lens;     /* [num_seqs] context lengths, the new token included */
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size, table_width, max_len;
    float scale;
    float softcap;             /* > 0: attention logit soft-capping */
    int window;                /* > 0: each token attends only its last `window` positions */
    int first_item, last_item; /* this thread's share of the (sequence, KV head) items */
} Job;

/* Vectors as wide as the target has: 16 floats with AVX-512, otherwise 8 (AVX2, or what the compiler
 * makes of them). Loads go through these types unaligned. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

/* VW K/V values from row `row` starting at element VW*j, as fp32: bf16 is fp32's top half. */
#define ROW_F32(row, j) (((const vf *)(row))[j])
#define ROW_BF16(row, j) ((vf)(__builtin_convertvector(((const vh *)(row))[j], vu) << 16))
#define ELEM_F32(row, d) (((const float *)(row))[d])
#define ELEM_BF16(row, d) bf16_to_f32(((const uint16_t *)(row))[d])

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x = {(uint32_t)h << 16};
    return x.f;
}

static inline float hsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += x[i];
    return s;
}

/* Lane-pair sums of a then of b: [a0+a1, a2+a3, ..., b0+b1, b2+b3, ...]. */
static inline vf pair_sums(vf a, vf b) {
#if VW == 16
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
           + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14)
           + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

/* Lane i of the result: the sum of p[i]'s lanes. VW horizontal sums for the price of about two: each
 * level of pair sums halves the vectors, and the lanes come out in order. */
static inline vf transposed_sums(vf *p) {
    for (int n = VW; n > 1; n /= 2)
        for (int i = 0; i < n / 2; i++) p[i] = pair_sums(p[2 * i], p[2 * i + 1]);
    return p[0];
}

#ifndef PREFETCH
#define PREFETCH 8  /* tokens ahead: the rows of the next block are usually elsewhere */
#endif
static inline void prefetch_row(const void *row, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)row + off);
}

/* Row t of the attended keys: position first + t of the sequence (first > 0 under a sliding window). */
#define ROW_AT(cache, T, t) ((const T *)(cache) + table[((t) + first) / bs] * block_stride + (((t) + first) % bs) * token_stride + head_offset)

/* One work item for a head size and group size known at compile time (the head size a multiple of
 * VW): the group's queries and output sums stay in vector registers (all of them with AVX-512 at
 * head size 64 and up to 4 query heads per KV head), each K/V row is read once for the whole group,
 * and scores are formed VW tokens at a time, their horizontal sums done together. */
#define ATTEND_FIXED(DIM, GROUP, T, ROW)                                                                \
    {                                                                                                  \
        enum { NV = (DIM) / VW };                                                                      \
        vf qv[GROUP][NV], part[GROUP][VW], acc[GROUP][NV];                                             \
        for (int g = 0; g < (GROUP); g++)                                                              \
            for (int j = 0; j < NV; j++) qv[g][j] = ((const vf *)(q + (size_t)g * (DIM)))[j];          \
        for (int t0 = 0; t0 < len; t0 += VW) {                                                         \
            const int n = len - t0 < VW ? len - t0 : VW;                                               \
            for (int i = 0; i < VW; i++) {                                                             \
                if (i >= n) {                                                                          \
                    for (int g = 0; g < (GROUP); g++) part[g][i] = (vf){0};                            \
                    continue;                                                                          \
                }                                                                                      \
                const T *k = ROW_AT(job->k_cache, T, t0 + i);                                          \
                if (t0 + i + PREFETCH < len) prefetch_row(ROW_AT(job->k_cache, T, t0 + i + PREFETCH), (DIM) * sizeof(T)); \
                vf kv[NV];                                                                             \
                for (int j = 0; j < NV; j++) kv[j] = ROW(k, j);                                        \
                for (int g = 0; g < (GROUP); g++) {                                                    \
                    vf a = qv[g][0] * kv[0];                                                           \
                    for (int j = 1; j < NV; j++) a += qv[g][j] * kv[j];                                \
                    part[g][i] = a;                                                                    \
                }                                                                                      \
            }                                                                                          \
            for (int g = 0; g < (GROUP); g++) {                                                        \
                const vf sums = transposed_sums(part[g]) * job->scale;                                 \
                float *dst = scores + (size_t)g * len + t0;                                            \
                if (n == VW) *(vf *)dst = sums;                                                        \
                else for (int i = 0; i < n; i++) dst[i] = sums[i];                                     \
            }                                                                                          \
        }                                                                                              \
        softmax_rows(scores, (GROUP), len, job->softcap);                                                            \
        for (int g = 0; g < (GROUP); g++)                                                              \
            for (int j = 0; j < NV; j++) acc[g][j] = (vf){0};                                          \
        for (int t = 0; t < len; t++) {                                                                \
            const T *v = ROW_AT(job->v_cache, T, t);                                                   \
            if (t + PREFETCH < len) prefetch_row(ROW_AT(job->v_cache, T, t + PREFETCH), (DIM) * sizeof(T)); \
            vf vv[NV];                                                                                 \
            for (int j = 0; j < NV; j++) vv[j] = ROW(v, j);                                            \
            for (int g = 0; g < (GROUP); g++) {                                                        \
                const float p = scores[(size_t)g * len + t];                                           \
                for (int j = 0; j < NV; j++) acc[g][j] += p * vv[j];                                   \
            }                                                                                          \
        }                                                                                              \
        for (int g = 0; g < (GROUP); g++)                                                              \
            for (int j = 0; j < NV; j++) ((vf *)(acc_out + (size_t)g * (DIM)))[j] = acc[g][j];         \
    }

/* A head size that is a multiple of VW with any group size: queries and sums through memory. */
#define ATTEND_ITEM(DIM, T, ROW)                                                                       \
    for (int t = 0; t < len; t++) {                                                                    \
        const T *k = ROW_AT(job->k_cache, T, t);                                                       \
        vf kv[(DIM) / VW];                                                                             \
        for (int j = 0; j < (DIM) / VW; j++) kv[j] = ROW(k, j);                                        \
        for (int g = 0; g < group; g++) {                                                              \
            const vf *qg = (const vf *)(q + (size_t)g * (DIM));                                        \
            vf a = qg[0] * kv[0];                                                                      \
            for (int j = 1; j < (DIM) / VW; j++) a += qg[j] * kv[j];                                   \
            scores[(size_t)g * len + t] = hsum(a) * job->scale;                                        \
        }                                                                                              \
    }                                                                                                  \
    softmax_rows(scores, group, len, job->softcap);                                                                \
    for (int i = 0; i < group * (DIM); i++) acc_out[i] = 0.0f;                                         \
    for (int t = 0; t < len; t++) {                                                                    \
        const T *v = ROW_AT(job->v_cache, T, t);                                                       \
        vf vv[(DIM) / VW];                                                                             \
        for (int j = 0; j < (DIM) / VW; j++) vv[j] = ROW(v, j);                                        \
        for (int g = 0; g < group; g++) {                                                              \
            const float p = scores[(size_t)g * len + t];                                               \
            vf *a = (vf *)(acc_out + (size_t)g * (DIM));                                               \
            for (int j = 0; j < (DIM) / VW; j++) a[j] += p * vv[j];                                    \
        }                                                                                              \
    }

/* Any other head size: plain loops. */
#define ATTEND_ITEM_GENERIC(DIM, T, ELEM)                                                               \
    for (int t = 0; t < len; t++) {                                                                    \
        const T *k = ROW_AT(job->k_cache, T, t);                                                       \
        for (int g = 0; g < group; g++) {                                                              \
            float dot = 0.0f;                                                                          \
            for (int d = 0; d < (DIM); d++) dot += q[(size_t)g * (DIM) + d] * ELEM(k, d);              \
            scores[(size_t)g * len + t] = dot * job->scale;                                            \
        }                                                                                              \
    }                                                                                                  \
    softmax_rows(scores, group, len, job->softcap);                                                                \
    for (int i = 0; i < group * (DIM); i++) acc_out[i] = 0.0f;                                         \
    for (int t = 0; t < len; t++) {                                                                    \
        const T *v = ROW_AT(job->v_cache, T, t);                                                       \
        for (int g = 0; g < group; g++) {                                                              \
            const float p = scores[(size_t)g * len + t];                                               \
            for (int d = 0; d < (DIM); d++) acc_out[(size_t)g * (DIM) + d] += p * ELEM(v, d);              \
        }                                                                                              \
    }

/* softcap > 0: scores pass through cap * tanh(score / cap) first (Gemma 2's attention logit soft-capping). */
static void softmax_rows(float *scores, int rows, int len, float softcap) {
    for (int g = 0; g < rows; g++) {
        float *s = scores + (size_t)g * len;
        if (softcap > 0.0f)
            for (int t = 0; t < len; t++) {  /* tanh(x) = 1 - 2 / (e^2x + 1): vexp vectorizes, tanhf does not */
                const float e = vexp(2.0f * s[t] / softcap);
                s[t] = softcap * (1.0f - 2.0f / (e + 1.0f));
            }
        float max = s[0], sum = 0.0f;
        for (int t = 1; t < len; t++) max = s[t] > max ? s[t] : max;
        for (int t = 0; t < len; t++) s[t] = vexp(s[t] - max);  /* vectorizes; expf does not */
        for (int t = 0; t < len; t++) sum += s[t];
        const float inv = 1.0f / sum;
        for (int t = 0; t < len; t++) s[t] *= inv;
    }
}

/* Compile-time head and group sizes for the common shapes (head size 64 or 128; 1 to 4 query heads per
 * KV head, or 8), the runtime-group loop for other groups, plain loops for other head sizes. */
#define ATTEND_DIM(DIM, T, ROW)                                                                        \
    switch (group) {                                                                                   \
        case 1: ATTEND_FIXED(DIM, 1, T, ROW) break;                                                    \
        case 2: ATTEND_FIXED(DIM, 2, T, ROW) break;                                                    \
        case 3: ATTEND_FIXED(DIM, 3, T, ROW) break;                                                    \
        case 4: ATTEND_FIXED(DIM, 4, T, ROW) break;                                                    \
        case 8: ATTEND_FIXED(DIM, 8, T, ROW) break;                                                    \
        default: { ATTEND_ITEM(DIM, T, ROW) } break;                                                   \
    }
#define ATTEND_DISPATCH(T, ROW, ELEM)                                                                  \
    {                                                                                                  \
        if (dim == 64) { ATTEND_DIM(64, T, ROW) }                                                      \
        else if (dim == 128) { ATTEND_DIM(128, T, ROW) }                                               \
        else { ATTEND_ITEM_GENERIC(dim, T, ELEM) }                                                     \
    }

static void attend(Job *job, int kv_bf16, float *restrict scores, float *restrict acc) {
    const int group = job->num_heads / job->num_kv_heads, dim = job->head_dim, bs = job->block_size;
    const size_t token_stride = (size_t)job->num_kv_heads * dim, block_stride = bs * token_stride;
    for (int item = job->first_item; item < job->last_item; item++) {
        const int seq = item / job->num_kv_heads, head = item % job->num_kv_heads;
        /* a sliding window of W tokens sees the last W positions, the new token's included (HF's kv > q - W) */
        const int full = (int)job->lens[seq], first = job->window > 0 && full > job->window ? full - job->window : 0;
        const int len = full - first;
        const int64_t *table = job->tables + (size_t)seq * job->table_width;
        const float *restrict q = job->q + ((size_t)seq * job->num_heads + (size_t)head * group) * dim;
        const size_t head_offset = (size_t)head * dim;
        float *restrict acc_out = acc;
        if (kv_bf16) ATTEND_DISPATCH(uint16_t, ROW_BF16, ELEM_BF16)
        else ATTEND_DISPATCH(float, ROW_F32, ELEM_F32)
        float *out = job->out + ((size_t)seq * job->num_heads + (size_t)head * group) * dim;
        for (int i = 0; i < group * dim; i++) out[i] = acc[i];
    }
}

/* Returns 0 on success, -1 when scratch memory could not be had. Work is split over OpenMP threads:
 * the library links libgomp.so.1, which resolves to the copy PyTorch already loaded, so this kernel
 * shares torch's thread pool instead of fighting its spinning workers for the cores. */
int paged_decode_attention(float *out, const float *q, const void *k_cache, const void *v_cache,
                           const int64_t *tables, const int64_t *lens, int num_seqs, int num_heads,
                           int num_kv_heads, int head_dim, int block_size, int table_width, int max_len,
                           float scale, int num_threads, int kv_bf16, int window, float softcap) {
    const int items = num_seqs * num_kv_heads, group = num_heads / num_kv_heads;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > items) num_threads = items > 0 ? items : 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        int thread = 0, threads = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        threads = omp_get_num_threads();
#endif
        Job job = {out, q, k_cache, v_cache, tables, lens, num_seqs, num_heads, num_kv_heads, head_dim,
                   block_size, table_width, max_len, scale, softcap, window,
                   (int)((int64_t)items * thread / threads), (int)((int64_t)items * (thread + 1) / threads)};
        float *scores = malloc(sizeof(float) * (size_t)group * (max_len > 0 ? max_len : 1));
        float *acc = malloc(sizeof(float) * (size_t)group * head_dim);
        if (scores == NULL || acc == NULL) failed = 1;
        else attend(&job, kv_bf16, scores, acc);
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
