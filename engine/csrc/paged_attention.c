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

typedef struct {
    float *out;              /* [num_seqs, num_heads, head_dim] */
    const float *q;          /* [num_seqs, num_heads, head_dim] */
    const void *k_cache;     /* [num_blocks, block_size, num_kv_heads, head_dim], fp32 or bf16 */
    const void *v_cache;
    const int64_t *tables;   /* [num_seqs, table_width] block ids */
    const int64_t *lens;     /* [num_seqs] context lengths, the new token included */
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size, table_width, max_len;
    float scale;
    int first_item, last_item; /* this thread's share of the (sequence, KV head) items */
} Job;

typedef float v8 __attribute__((vector_size(32), aligned(4)));  /* unaligned loads through v8 pointers */
typedef uint16_t h8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u8x32 __attribute__((vector_size(32)));

/* Eight K/V values from row `row` starting at element 8j, as fp32: bf16 is fp32's top half. */
#define ROW_F32(row, j) (((const v8 *)(row))[j])
#define ROW_BF16(row, j) ((v8)(__builtin_convertvector(((const h8 *)(row))[j], u8x32) << 16))
#define ELEM_F32(row, d) (((const float *)(row))[d])
#define ELEM_BF16(row, d) bf16_to_f32(((const uint16_t *)(row))[d])

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x = {(uint32_t)h << 16};
    return x.f;
}

static inline float hsum(v8 x) {
    return (x[0] + x[4]) + (x[1] + x[5]) + (x[2] + x[6]) + (x[3] + x[7]);
}

/* The body of one work item for a head size known at compile time (a multiple of 16), so that
 * each K/V row is held in vector registers and reused by every query head of the group. */
#define ATTEND_ITEM(DIM, T, ROW)                                                                       \
    for (int t = 0; t < len; t++) {                                                                    \
        const T *k = (const T *)job->k_cache + table[t / bs] * block_stride + (t % bs) * token_stride     \
                     + head_offset;                                                                    \
        v8 kv[(DIM) / 8];                                                                              \
        for (int j = 0; j < (DIM) / 8; j++) kv[j] = ROW(k, j);                                         \
        for (int g = 0; g < group; g++) {                                                              \
            const v8 *qg = (const v8 *)(q + (size_t)g * (DIM));                                        \
            v8 a0 = {0}, a1 = {0};                                                                     \
            for (int j = 0; j < (DIM) / 8; j += 2) { a0 += qg[j] * kv[j]; a1 += qg[j + 1] * kv[j + 1]; } \
            scores[(size_t)g * len + t] = hsum(a0 + a1) * job->scale;                                  \
        }                                                                                              \
    }                                                                                                  \
    softmax_rows(scores, group, len);                                                                  \
    for (int i = 0; i < group * (DIM); i++) acc[i] = 0.0f;                                             \
    for (int t = 0; t < len; t++) {                                                                    \
        const T *v = (const T *)job->v_cache + table[t / bs] * block_stride + (t % bs) * token_stride     \
                     + head_offset;                                                                    \
        v8 vv[(DIM) / 8];                                                                              \
        for (int j = 0; j < (DIM) / 8; j++) vv[j] = ROW(v, j);                                         \
        for (int g = 0; g < group; g++) {                                                              \
            const float p = scores[(size_t)g * len + t];                                               \
            v8 *a = (v8 *)(acc + (size_t)g * (DIM));                                                   \
            for (int j = 0; j < (DIM) / 8; j++) a[j] += p * vv[j];                                     \
        }                                                                                              \
    }

/* Any other head size: plain loops. */
#define ATTEND_ITEM_GENERIC(DIM, T, ELEM)                                                               \
    for (int t = 0; t < len; t++) {                                                                    \
        const T *k = (const T *)job->k_cache + table[t / bs] * block_stride + (t % bs) * token_stride     \
                     + head_offset;                                                                    \
        for (int g = 0; g < group; g++) {                                                              \
            float dot = 0.0f;                                                                          \
            for (int d = 0; d < (DIM); d++) dot += q[(size_t)g * (DIM) + d] * ELEM(k, d);              \
            scores[(size_t)g * len + t] = dot * job->scale;                                            \
        }                                                                                              \
    }                                                                                                  \
    softmax_rows(scores, group, len);                                                                  \
    for (int i = 0; i < group * (DIM); i++) acc[i] = 0.0f;                                             \
    for (int t = 0; t < len; t++) {                                                                    \
        const T *v = (const T *)job->v_cache + table[t / bs] * block_stride + (t % bs) * token_stride     \
                     + head_offset;                                                                    \
        for (int g = 0; g < group; g++) {                                                              \
            const float p = scores[(size_t)g * len + t];                                               \
            for (int d = 0; d < (DIM); d++) acc[(size_t)g * (DIM) + d] += p * ELEM(v, d);              \
        }                                                                                              \
    }

static void softmax_rows(float *scores, int rows, int len) {
    for (int g = 0; g < rows; g++) {
        float *s = scores + (size_t)g * len, max = s[0], sum = 0.0f;
        for (int t = 1; t < len; t++) max = s[t] > max ? s[t] : max;
        for (int t = 0; t < len; t++) { s[t] = expf(s[t] - max); sum += s[t]; }
        const float inv = 1.0f / sum;
        for (int t = 0; t < len; t++) s[t] *= inv;
    }
}

static void attend(Job *job, int kv_bf16, float *restrict scores, float *restrict acc) {
    const int group = job->num_heads / job->num_kv_heads, dim = job->head_dim, bs = job->block_size;
    const size_t token_stride = (size_t)job->num_kv_heads * dim, block_stride = bs * token_stride;
    for (int item = job->first_item; item < job->last_item; item++) {
        const int seq = item / job->num_kv_heads, head = item % job->num_kv_heads;
        const int len = (int)job->lens[seq];
        const int64_t *table = job->tables + (size_t)seq * job->table_width;
        const float *restrict q = job->q + ((size_t)seq * job->num_heads + (size_t)head * group) * dim;
        const size_t head_offset = (size_t)head * dim;
        if (kv_bf16) {
            if (dim == 64) { ATTEND_ITEM(64, uint16_t, ROW_BF16) }
            else if (dim == 128) { ATTEND_ITEM(128, uint16_t, ROW_BF16) }
            else { ATTEND_ITEM_GENERIC(dim, uint16_t, ELEM_BF16) }
        } else {
            if (dim == 64) { ATTEND_ITEM(64, float, ROW_F32) }
            else if (dim == 128) { ATTEND_ITEM(128, float, ROW_F32) }
            else { ATTEND_ITEM_GENERIC(dim, float, ELEM_F32) }
        }
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
                           float scale, int num_threads, int kv_bf16) {
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
                   block_size, table_width, max_len, scale,
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
