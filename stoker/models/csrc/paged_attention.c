/* Decode attention straight from the paged KV cache, for CPUs.
 *
 * One query token per sequence. Each (sequence, kv head) pair reads its keys
 * and values block by block through the block table, so nothing is gathered
 * into a padded copy first: the cache is read exactly once per step.
 *
 * Layouts: q/out [seqs, heads, head_dim]; caches [blocks, block_size, kv_heads, head_dim];
 * block_tables [seqs, max_blocks] (int64); context_lens [seqs] (int64).
 * Built by stoker/models/cpu_kernels.py with the system C compiler.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *block_tables, *context_lens;
    void *out;
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
    float scale;
    int is_bf16;
} Job; /* work items are (sequence, kv head) pairs */

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* exp for x <= 0 as 2^k * 2^f with a degree-6 polynomial for 2^f (relative
 * error ~2e-7, like expf): glibc's expf does not vectorize here, this does. */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float t = x * 1.44269504088896341f;
    const float k = floorf(t);
    const float f = t - k;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline void load_row(const void *base, size_t offset, int n, int is_bf16, float *restrict dst) {
    if (is_bf16) {
        /* bf16 is the top half of an fp32: widen by shifting, a loop that vectorizes. */
        const uint16_t *restrict src = (const uint16_t *)base + offset;
        uint32_t *restrict wide = (uint32_t *)dst;
        for (int d = 0; d < n; d++) wide[d] = (uint32_t)src[d] << 16;
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

static inline __attribute__((always_inline)) void run_item_d(const Job *job, int item, float *restrict scratch, const int D) {
    const int H = job->num_heads, KVH = job->num_kv_heads, BS = job->block_size;
    const int G = H / KVH;
    const int b = item / KVH, kh = item % KVH;
    const int L = (int)job->context_lens[b];
    const int64_t *table = job->block_tables + (size_t)b * job->max_blocks;
    float *qf = scratch;               /* [G, D] */
    float *acc = qf + (size_t)G * D;   /* [G, D] */
    float *row = acc + (size_t)G * D;  /* [D] */
    float *scores = row + D;           /* [G, L] */

    for (int g = 0; g < G; g++)
        load_row(job->q, ((size_t)b * H + (size_t)kh * G + g) * D, D, job->is_bf16, qf + (size_t)g * D);

    for (int t0 = 0; t0 < L; t0 += BS) {
        const size_t block_base = (size_t)table[t0 / BS] * BS;
        const int n = L - t0 < BS ? L - t0 : BS;
        for (int i = 0; i < n; i++) {
            load_row(job->k_cache, ((block_base + i) * KVH + kh) * D, D, job->is_bf16, row);
            for (int g = 0; g < G; g++) {
                const float *restrict qg = qf + (size_t)g * D;
                float s = 0.f;
                for (int d = 0; d < D; d++) s += qg[d] * row[d];
                scores[(size_t)g * L + t0 + i] = s * job->scale;
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float *sg = scores + (size_t)g * L;
        float m = -INFINITY, sum = 0.f;
        for (int t = 0; t < L; t++) m = fmaxf(m, sg[t]);
        for (int t = 0; t < L; t++) { sg[t] = exp_nonpositive(sg[t] - m); sum += sg[t]; }
        float inv = 1.f / sum;
        for (int t = 0; t < L; t++) sg[t] *= inv;
    }
    memset(acc, 0, (size_t)G * D * sizeof(float));
    for (int t0 = 0; t0 < L; t0 += BS) {
        const size_t block_base = (size_t)table[t0 / BS] * BS;
        const int n = L - t0 < BS ? L - t0 : BS;
        for (int i = 0; i < n; i++) {
            load_row(job->v_cache, ((block_base + i) * KVH + kh) * D, D, job->is_bf16, row);
            for (int g = 0; g < G; g++) {
                const float p = scores[(size_t)g * L + t0 + i];
                float *restrict ag = acc + (size_t)g * D;
                for (int d = 0; d < D; d++) ag[d] += p * row[d];
            }
        }
    }
    for (int g = 0; g < G; g++) {
        size_t o = ((size_t)b * H + (size_t)kh * G + g) * D;
        if (job->is_bf16) {
            uint16_t *dst = (uint16_t *)job->out + o;
            for (int d = 0; d < D; d++) dst[d] = bf16_round(acc[(size_t)g * D + d]);
        } else {
            memcpy((float *)job->out + o, acc + (size_t)g * D, (size_t)D * sizeof(float));
        }
    }
}

/* Head sizes known at compile time unroll the inner loops into a few vector
 * instructions; other sizes take the generic path. */
static void run_item(const Job *job, int item, float *restrict scratch) {
    switch (job->head_dim) {
    case 64: run_item_d(job, item, scratch, 64); break;
    case 128: run_item_d(job, item, scratch, 128); break;
    default: run_item_d(job, item, scratch, job->head_dim); break;
    }
}

/* Returns 0 on success. OpenMP, not threads of our own: the process already
 * runs torch's libgomp, so both share one pool instead of fighting for cores. */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens, void *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int max_blocks, float scale, int is_bf16, int num_threads) {
    const Job job = {q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads,
                     num_kv_heads, head_dim, block_size, max_blocks, scale, is_bf16};
    const int items = num_seqs * num_kv_heads;
    const int G = num_heads / num_kv_heads;
    int max_len = 0;
    for (int b = 0; b < num_seqs; b++)
        if (context_lens[b] > max_len) max_len = (int)context_lens[b];
    const size_t scratch_floats = (size_t)2 * G * head_dim + head_dim + (size_t)G * max_len;
    int failed = 0;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (!scratch) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 4)
            for (int item = 0; item < items; item++) run_item(&job, item, scratch);
            free(scratch);
        }
    }
    return failed;
}
