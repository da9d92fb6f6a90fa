/* Decode attention straight from the paged KV cache, for CPUs.
 *
 * One query token per sequence. Each (sequence, kv head) pair reads its keys
 * and values block by block through the block table, so nothing is gathered
 * into a padded copy first: the cache is read exactly once per step.
 *
 * Layouts: q/out [seqs, heads, head_dim]; caches [blocks, block_size, kv_heads, row];
 * block_tables [seqs, max_blocks] (int64); context_lens [seqs] (int64).
 *
 * The cache holds float32 or bf16 rows (row = head_dim), or quantized rows
 * (stoker/models/kv_quant.py): head_dim int8 or fp8 e4m3 values then the row's
 * float32 scale (row = head_dim + 4 bytes). Quantized rows are widened here, a
 * row at a time as they are read; the cache is never dequantized as a whole.
 * Built by stoker/models/cpu_kernels.py with the system C compiler.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "subnormals.h"

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *block_tables, *context_lens;
    void *out;
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
    float scale;
    int is_bf16; /* q and out */
    int kv_type, row; /* the cache's KV_* type and elements per (token, kv head) row */
} Job; /* work items are (sequence, kv head) pairs */

enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8 = 3 };

static inline int kv_row_width(int D, int kv_type) { return kv_type >= KV_INT8 ? D + 4 : D; }

static inline int kv_elem_bytes(int kv_type) { return kv_type == KV_F32 ? 4 : kv_type == KV_BF16 ? 2 : 1; }

/* A quantized row's scale (its last four bytes); 1 for float rows. offset is in cache elements. */
static inline float kv_row_scale(const void *base, size_t offset, int D, int kv_type) {
    if (kv_type < KV_INT8) return 1.f;
    float s;
    memcpy(&s, (const uint8_t *)base + offset + D, sizeof s);
    return s;
}

/* fp8 e4m3 (bias 7, no infinities; never NaN here: writers clamp to +-448). */
static inline float fp8_e4m3_to_float(uint8_t x) {
    const uint32_t mag = x & 0x7Fu;
    float v;
    if (mag >= 8u) {
        const uint32_t bits = (mag << 20) + (120u << 23); /* rebias the exponent, widen the mantissa */
        memcpy(&v, &bits, sizeof v);
    } else {
        v = (float)mag * (1.f / 512.f); /* subnormal: m * 2^-9 */
    }
    return (x & 0x80u) ? -v : v;
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

/* A cache row widened to float32 and scaled: what the row stands for. */
static inline void load_kv_row(const void *base, size_t offset, int D, int kv_type, float *restrict dst) {
    if (kv_type < KV_INT8) {
        load_row(base, offset, D, kv_type == KV_BF16, dst);
        return;
    }
    const float scale = kv_row_scale(base, offset, D, kv_type);
    const uint8_t *restrict src = (const uint8_t *)base + offset;
    if (kv_type == KV_INT8) {
        for (int d = 0; d < D; d++) dst[d] = (float)(int8_t)src[d] * scale;
    } else {
        for (int d = 0; d < D; d++) dst[d] = fp8_e4m3_to_float(src[d]) * scale;
    }
}

static inline void store_row(void *base, size_t offset, const float *restrict src, int n, int is_bf16) {
    if (is_bf16) {
        uint16_t *restrict dst = (uint16_t *)base + offset;
        for (int d = 0; d < n; d++) dst[d] = float_to_bf16(src[d]);
    } else {
        memcpy((float *)base + offset, src, (size_t)n * sizeof(float));
    }
}

/* One work item: sequence b, kv head kh and its G query heads, with the
 * item's slices of the thread's scratch. The layout is defined here once;
 * decode_scratch_floats sizes it. */
typedef struct {
    int b, kh, G, L;
    const int64_t *table;
    float *qf;     /* [G, D] the queries, widened */
    float *acc;    /* [G, D] the outputs being summed */
    float *slot;   /* [max(G, D)] a row of keys or values, or 1/sum per head */
    float *scores; /* [G, L] */
} Item;

static size_t decode_scratch_floats(int G, int D, int max_len) {
    return (size_t)2 * G * D + (size_t)(G > D ? G : D) + (size_t)G * max_len;
}

static inline Item item_start(const Job *job, int item, float *restrict scratch, int D) {
    const int KVH = job->num_kv_heads, G = job->num_heads / KVH;
    Item it;
    it.b = item / KVH;
    it.kh = item % KVH;
    it.G = G;
    it.L = (int)job->context_lens[it.b];
    it.table = job->block_tables + (size_t)it.b * job->max_blocks;
    it.qf = scratch;
    it.acc = it.qf + (size_t)G * D;
    it.slot = it.acc + (size_t)G * D;
    it.scores = it.slot + (G > D ? G : D);
    for (int g = 0; g < G; g++)
        load_row(job->q, ((size_t)it.b * job->num_heads + (size_t)it.kh * G + g) * D, D, job->is_bf16,
                 it.qf + (size_t)g * D);
    return it;
}

static inline __attribute__((always_inline)) void run_item_d(const Job *job, int item, float *restrict scratch, const int D) {
    const Item it = item_start(job, item, scratch, D);
    const int H = job->num_heads, KVH = job->num_kv_heads, BS = job->block_size;
    const int G = it.G, b = it.b, kh = it.kh, L = it.L;
    const int64_t *table = it.table;
    float *qf = it.qf, *acc = it.acc, *row = it.slot, *scores = it.scores;

    for (int t0 = 0; t0 < L; t0 += BS) {
        const size_t block_base = (size_t)table[t0 / BS] * BS;
        const int n = L - t0 < BS ? L - t0 : BS;
        for (int i = 0; i < n; i++) {
            load_kv_row(job->k_cache, ((block_base + i) * KVH + kh) * job->row, D, job->kv_type, row);
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
            load_kv_row(job->v_cache, ((block_base + i) * KVH + kh) * job->row, D, job->kv_type, row);
            for (int g = 0; g < G; g++) {
                const float p = scores[(size_t)g * L + t0 + i];
                float *restrict ag = acc + (size_t)g * D;
                for (int d = 0; d < D; d++) ag[d] += p * row[d];
            }
        }
    }
    for (int g = 0; g < G; g++)
        store_row(job->out, ((size_t)b * H + (size_t)kh * G + g) * D, acc + (size_t)g * D, D, job->is_bf16);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* AVX-512 path. Scores are computed 16 keys at a time: one vector of partial
 * products per key, then a transpose-and-add tree turns the 16 vectors into
 * the 16 scores with 15 adds, instead of a full horizontal sum per key (the
 * generic loop spends most of its time there). */

static inline __m512 hsum16(__m512 v[16]) {
    __m512 x[8], y[4], z[2];
    for (int j = 0; j < 8; j++)
        x[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++) {
        const __m512d a = _mm512_castps_pd(x[2 * j]), b = _mm512_castps_pd(x[2 * j + 1]);
        y[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int j = 0; j < 2; j++)
        z[j] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * j], y[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * j], y[2 * j + 1], 0xDD));
    /* lane i now holds the sum of v[i] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

/* 16 cache values as float32, not yet times their row's scale (callers fold
 * the scale into a score or a probability: one multiply per row, not per value). */
static inline __m512 load16(const void *base, size_t offset, int kv_type) {
    if (kv_type == KV_BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (kv_type == KV_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + offset))));
    if (kv_type == KV_FP8) {
        const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)base + offset)));
        const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7F));
        const __m512 normal =
            _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
        const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.f / 512.f));
        const __m512 v = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(mag, _mm512_set1_epi32(8)), sub, normal);
        const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
        return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
    }
    return _mm512_loadu_ps((const float *)base + offset);
}

/* Walks rows t = 0, 1, ... of one kv head through the block table without a
 * division per row (block_size need not be a power of two). */
typedef struct {
    const int64_t *table;
    size_t stride, block_base;
    int BS, in_block, block;
} RowCursor;

/* row: elements per (token, kv head) row of the cache (kv_row_width). */
static inline RowCursor cursor_start(const int64_t *table, int BS, int KVH, int kh, int row) {
    RowCursor c = {table, (size_t)KVH * row, 0, BS, 0, 0};
    c.block_base = (size_t)table[0] * BS * c.stride + (size_t)kh * row;
    return c;
}

/* Reads the next block's id only when a row of it is wanted: the table may end there. */
static inline size_t cursor_next(RowCursor *c) {
    if (c->in_block == c->BS) {
        c->in_block = 0;
        c->block++;
        c->block_base += ((size_t)c->table[c->block] - (size_t)c->table[c->block - 1]) * c->BS * c->stride;
    }
    return c->block_base + (size_t)(c->in_block++) * c->stride;
}

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 64
#endif

/* Asks for a row's cache lines ahead of use: rows of one kv head are strided
 * and blocks scattered, which the hardware prefetcher does not follow. */
static inline void prefetch_row(const void *base, size_t offset, int row, int kv_type) {
    const int eb = kv_elem_bytes(kv_type);
    const char *p = (const char *)base + offset * eb;
    const int bytes = row * eb;
    for (int b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    _mm_prefetch(p + bytes - 1, _MM_HINT_T0); /* a 68-byte quantized row may end in a line of its own */
}

/* exp(x) for x <= 0, 16 lanes: the same polynomial as exp_nonpositive. */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, k);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}

/* Scores -> unnormalised probabilities exp(s - max), in place; returns 1 / their sum. */
static inline float softmax_unnormalised(float *s, int L) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int t = 0;
    for (; t + 16 <= L; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
    float m = _mm512_reduce_max_ps(vmax);
    for (; t < L; t++) m = fmaxf(m, s[t]);
    const __m512 vm = _mm512_set1_ps(m);
    __m512 vsum = _mm512_setzero_ps();
    for (t = 0; t + 16 <= L; t += 16) {
        const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
        _mm512_storeu_ps(s + t, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    float sum = _mm512_reduce_add_ps(vsum);
    for (; t < L; t++) { s[t] = exp_nonpositive(s[t] - m); sum += s[t]; }
    return 1.f / sum;
}

/* Adds p[t] * V[t] over all t into GC query heads' accumulators held in
 * registers, then stores them scaled by each head's 1 / sum. */
static inline __attribute__((always_inline)) void pv_heads(const Job *job, const int64_t *table, int kh, int L,
                                                            const float *scores, const float *inv_sum, int g0,
                                                            const int GC, const int D, float *restrict acc_out) {
    __m512 acc[4][8];
    for (int g = 0; g < GC; g++)
        for (int c = 0; c < D / 16; c++) acc[g][c] = _mm512_setzero_ps();
    const int kv_type = job->kv_type;
    RowCursor rows = cursor_start(table, job->block_size, job->num_kv_heads, kh, job->row);
    RowCursor ahead = rows;
    int fetched = 0;
    for (int t = 0; t < L; t++) {
        for (; fetched < L && fetched <= t + PREFETCH_ROWS; fetched++)
            prefetch_row(job->v_cache, cursor_next(&ahead), job->row, kv_type);
        const size_t off = cursor_next(&rows);
        const float vs = kv_row_scale(job->v_cache, off, D, kv_type);
        __m512 v[8];
        for (int c = 0; c < D / 16; c++) v[c] = load16(job->v_cache, off + (size_t)c * 16, kv_type);
        for (int g = 0; g < GC; g++) {
            const __m512 p = _mm512_set1_ps(scores[(size_t)(g0 + g) * L + t] * vs);
            for (int c = 0; c < D / 16; c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < GC; g++) {
        const __m512 inv = _mm512_set1_ps(inv_sum[g0 + g]);
        for (int c = 0; c < D / 16; c++)
            _mm512_storeu_ps(acc_out + (size_t)(g0 + g) * D + c * 16, _mm512_mul_ps(acc[g][c], inv));
    }
}

static inline __attribute__((always_inline)) void run_item_avx512(const Job *job, int item, float *restrict scratch,
                                                                   const int D) {
    const Item it = item_start(job, item, scratch, D);
    const int H = job->num_heads, KVH = job->num_kv_heads;
    const int G = it.G, b = it.b, kh = it.kh, L = it.L;
    const int64_t *table = it.table;
    float *qf = it.qf, *acc = it.acc, *inv_sum = it.slot, *scores = it.scores;
    const int kv_type = job->kv_type;
    const __m512 scale = _mm512_set1_ps(job->scale);

    RowCursor rows = cursor_start(table, job->block_size, KVH, kh, job->row);
    RowCursor ahead = rows;
    int fetched = 0; /* rows prefetched so far, kept PREFETCH_ROWS ahead */
    for (int t0 = 0; t0 < L; t0 += 16) {
        const int n = L - t0 < 16 ? L - t0 : 16;
        for (; fetched < L && fetched < t0 + 16 + PREFETCH_ROWS; fetched++)
            prefetch_row(job->k_cache, cursor_next(&ahead), job->row, kv_type);
        size_t offs[16];
        for (int i = 0; i < 16; i++) offs[i] = i < n ? cursor_next(&rows) : offs[0];
        __m512 kscale = scale; /* the softmax scale times each key row's own */
        if (kv_type >= KV_INT8) {
            float ks[16];
            for (int i = 0; i < 16; i++) ks[i] = kv_row_scale(job->k_cache, offs[i], D, kv_type);
            kscale = _mm512_mul_ps(scale, _mm512_loadu_ps(ks));
        }
        for (int g = 0; g < G; g++) {
            const float *qg = qf + (size_t)g * D;
            __m512 q[8];
            for (int c = 0; c < D / 16; c++) q[c] = _mm512_loadu_ps(qg + c * 16);
            __m512 part[16];
            for (int i = 0; i < 16; i++) {
                __m512 s = _mm512_mul_ps(q[0], load16(job->k_cache, offs[i], kv_type));
                for (int c = 1; c < D / 16; c++)
                    s = _mm512_fmadd_ps(q[c], load16(job->k_cache, offs[i] + (size_t)c * 16, kv_type), s);
                part[i] = s;
            }
            const __m512 sums = _mm512_mul_ps(hsum16(part), kscale);
            _mm512_mask_storeu_ps(scores + (size_t)g * L + t0, (__mmask16)((1u << n) - 1u), sums);
        }
    }
    for (int g = 0; g < G; g++) inv_sum[g] = softmax_unnormalised(scores + (size_t)g * L, L);
    /* Up to 4 heads (2 for D=128) per pass keep the accumulators in registers. */
    const int per_pass = D <= 64 ? 4 : 2;
    for (int g0 = 0; g0 < G; g0 += per_pass) {
        switch (G - g0 < per_pass ? G - g0 : per_pass) {
        case 1: pv_heads(job, table, kh, L, scores, inv_sum, g0, 1, D, acc); break;
        case 2: pv_heads(job, table, kh, L, scores, inv_sum, g0, 2, D, acc); break;
        case 3: pv_heads(job, table, kh, L, scores, inv_sum, g0, 3, D, acc); break;
        default: pv_heads(job, table, kh, L, scores, inv_sum, g0, 4, D, acc); break;
        }
    }
    for (int g = 0; g < G; g++)
        store_row(job->out, ((size_t)b * H + (size_t)kh * G + g) * D, acc + (size_t)g * D, D, job->is_bf16);
}
#endif

/* Head sizes known at compile time unroll the inner loops into a few vector
 * instructions; other sizes take the generic path. */
static void run_item(const Job *job, int item, float *restrict scratch) {
    switch (job->head_dim) {
#if defined(__AVX512F__)
    case 64: run_item_avx512(job, item, scratch, 64); break;
    case 128: run_item_avx512(job, item, scratch, 128); break;
#else
    case 64: run_item_d(job, item, scratch, 64); break;
    case 128: run_item_d(job, item, scratch, 128); break;
#endif
    default: run_item_d(job, item, scratch, job->head_dim); break;
    }
}

/* Returns 0 on success. OpenMP, not threads of our own: the process already
 * runs torch's libgomp, so both share one pool instead of fighting for cores. */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens, void *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int max_blocks, float scale, int is_bf16, int kv_type,
                           int num_threads) {
    const Job job = {q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads,
                     num_kv_heads, head_dim, block_size, max_blocks, scale, is_bf16,
                     kv_type, kv_row_width(head_dim, kv_type)};
    const int items = num_seqs * num_kv_heads;
    const int G = num_heads / num_kv_heads;
    int max_len = 0;
    for (int b = 0; b < num_seqs; b++)
        if (context_lens[b] > max_len) max_len = (int)context_lens[b];
    const size_t scratch_floats = decode_scratch_floats(G, head_dim, max_len);
    int failed = 0;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const fp_mode_t caller = subnormals_off();
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (!scratch) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 4)
            for (int item = 0; item < items; item++) run_item(&job, item, scratch);
            free(scratch);
        }
        fp_mode_restore(caller);
    }
    return failed;
}

/* ------------------------------------------------------------------------ */
/* Prefill attention for one sequence's chunk: n query tokens at positions
 * context_len - n ... context_len - 1, causal over everything before them,
 * keys and values read from the paged cache (the chunk's own already written).
 *
 * Work items are (kv head, tile of 16 query rows); a tile's G * 16 query
 * vectors share every key and value row they read. Keys are transposed 16 at
 * a time so each score vector is a run of broadcast FMAs with no horizontal
 * sums; values are widened to fp32 once per item. Returns 0 on success, 1 if
 * memory ran out, 2 if this build cannot serve the shape (the caller falls
 * back to torch). */
#if defined(__AVX512F__)
enum { PF_ROWS = 16 };

static inline __attribute__((always_inline)) void prefill_item(
    const void *q, const void *k_cache, const void *v_cache, const int64_t *table, void *out, int n,
    int context_len, int H, int KVH, int BS, float scale, int is_bf16, int kv_type, int item,
    float *restrict scratch, size_t kpad, const int D) {
    const int RW = kv_row_width(D, kv_type);
    const int G = H / KVH;
    const int tiles = (n + PF_ROWS - 1) / PF_ROWS;
    const int kh = item / tiles, r0 = (item % tiles) * PF_ROWS;
    const int rows = n - r0 < PF_ROWS ? n - r0 : PF_ROWS;
    const int start = context_len - n;            /* position of query row 0 */
    const int kend = start + r0 + rows;           /* keys this tile can see */
    const int RG = rows * G;                      /* query vectors, row-major then head */
    float *qf = scratch;                          /* [PF_ROWS * G + 3, D] */
    float *scores = qf + (size_t)(PF_ROWS * G + 3) * D; /* [PF_ROWS * G, kpad] */
    float *vbuf = scores + (size_t)PF_ROWS * G * kpad; /* [kpad, D] */
    float *ktT = vbuf + kpad * D;                 /* [D, 16] */
    float *inv_sum = ktT + (size_t)D * 16;        /* [PF_ROWS * G] */

    for (int r = 0; r < rows; r++)
        for (int g = 0; g < G; g++)
            load_row(q, ((size_t)(r0 + r) * H + (size_t)kh * G + g) * D, D, is_bf16, qf + (size_t)(r * G + g) * D);
    /* Pad the query vectors to a multiple of 4 so the register blocks need no tail. */
    const int RG4 = (RG + 3) & ~3;
    for (int j = RG; j < RG4; j++) memset(qf + (size_t)j * D, 0, (size_t)D * sizeof(float));

    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    RowCursor krows = cursor_start(table, BS, KVH, kh, RW);
    for (int t0 = 0; t0 < kend; t0 += 16) {
        const int nk = kend - t0 < 16 ? kend - t0 : 16;
        float krow[128] __attribute__((aligned(64)));
        for (int i = 0; i < 16; i++) {
            if (i < nk) {
                load_kv_row(k_cache, cursor_next(&krows), D, kv_type, krow);
                for (int d = 0; d < D; d++) ktT[d * 16 + i] = krow[d];
            } else {
                for (int d = 0; d < D; d++) ktT[d * 16 + i] = 0.f;
            }
        }
        for (int j = 0; j < RG4; j += 4) {
            __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
            const float *q0 = qf + (size_t)j * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
            for (int d = 0; d < D; d++) {
                const __m512 kv = _mm512_load_ps(ktT + d * 16);
                acc0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[d]), kv, acc0);
                acc1 = _mm512_fmadd_ps(_mm512_set1_ps(q1[d]), kv, acc1);
                acc2 = _mm512_fmadd_ps(_mm512_set1_ps(q2[d]), kv, acc2);
                acc3 = _mm512_fmadd_ps(_mm512_set1_ps(q3[d]), kv, acc3);
            }
            const __m512 accs[4] = {acc0, acc1, acc2, acc3};
            for (int u = 0; u < 4 && j + u < RG; u++) {
                const int pos = start + r0 + (j + u) / G; /* keys t <= pos are visible */
                const __mmask16 visible = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(t0)),
                                                                  _mm512_set1_epi32(pos));
                _mm512_storeu_ps(scores + (size_t)(j + u) * kpad + t0,
                                 _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), visible, accs[u], vscale));
            }
        }
    }
    for (int j = 0; j < RG; j++) {
        const int len = start + r0 + j / G + 1;
        float *s = scores + (size_t)j * kpad;
        inv_sum[j] = softmax_unnormalised(s, len);
        for (int t = len; t < kend; t++) s[t] = 0.f; /* so register blocks can run to kend */
    }
    RowCursor vrows = cursor_start(table, BS, KVH, kh, RW);
    for (int t = 0; t < kend; t++) load_kv_row(v_cache, cursor_next(&vrows), D, kv_type, vbuf + (size_t)t * D);

    for (int j = 0; j < RG; j += 4) {
        const int nu = RG - j < 4 ? RG - j : 4;
        const int len = start + r0 + (j + nu - 1) / G + 1; /* the block's longest row */
        __m512 acc[4][8];
        for (int u = 0; u < 4; u++)
            for (int c = 0; c < D / 16; c++) acc[u][c] = _mm512_setzero_ps();
        const float *p0 = scores + (size_t)j * kpad;
        for (int t = 0; t < len; t++) {
            __m512 v[8];
            for (int c = 0; c < D / 16; c++) v[c] = _mm512_loadu_ps(vbuf + (size_t)t * D + c * 16);
            for (int u = 0; u < 4; u++) {
                if (u >= nu) break;
                const __m512 p = _mm512_set1_ps(p0[(size_t)u * kpad + t]);
                for (int c = 0; c < D / 16; c++) acc[u][c] = _mm512_fmadd_ps(p, v[c], acc[u][c]);
            }
        }
        for (int u = 0; u < nu; u++) {
            const int r = (j + u) / G, g = (j + u) % G;
            const size_t o = ((size_t)(r0 + r) * H + (size_t)kh * G + g) * D;
            const __m512 inv = _mm512_set1_ps(inv_sum[j + u]);
            float res[128] __attribute__((aligned(64)));
            for (int c = 0; c < D / 16; c++) _mm512_store_ps(res + c * 16, _mm512_mul_ps(acc[u][c], inv));
            store_row(out, o, res, D, is_bf16);
        }
    }
}
#endif

int paged_prefill_attention(const void *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
                            void *out, int n, int context_len, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, float scale, int is_bf16, int kv_type, int num_threads) {
#if defined(__AVX512F__)
    if (head_dim != 64 && head_dim != 128) return 2;
    if (n < 1 || context_len < n || num_kv_heads < 1 || num_heads % num_kv_heads) return 2;
    const int G = num_heads / num_kv_heads;
    const int tiles = (n + PF_ROWS - 1) / PF_ROWS;
    const int items = tiles * num_kv_heads;
    const size_t kpad = ((size_t)context_len + 15) & ~(size_t)15;
    const size_t scratch_floats = (size_t)(PF_ROWS * G + 3) * head_dim + (size_t)PF_ROWS * G * kpad
                                  + kpad * head_dim + (size_t)head_dim * 16 + (size_t)PF_ROWS * G;
    int failed = 0;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const fp_mode_t caller = subnormals_off();
        float *scratch = aligned_alloc(64, ((scratch_floats * sizeof(float)) + 63) & ~(size_t)63);
        if (!scratch) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < items; item++) {
                if (head_dim == 64)
                    prefill_item(q, k_cache, v_cache, block_table, out, n, context_len, num_heads, num_kv_heads,
                                 block_size, scale, is_bf16, kv_type, item, scratch, kpad, 64);
                else
                    prefill_item(q, k_cache, v_cache, block_table, out, n, context_len, num_heads, num_kv_heads,
                                 block_size, scale, is_bf16, kv_type, item, scratch, kpad, 128);
            }
            free(scratch);
        }
        fp_mode_restore(caller);
    }
    return failed;
#else
    (void)q; (void)k_cache; (void)v_cache; (void)block_table; (void)out; (void)n; (void)context_len;
    (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)block_size; (void)scale; (void)is_bf16;
    (void)kv_type; (void)num_threads;
    return 2;
#endif
}

/* 1 if paged_prefill_attention serves this head size in this build. */
int paged_prefill_supported(int head_dim) {
#if defined(__AVX512F__)
    return head_dim == 64 || head_dim == 128;
#else
    (void)head_dim;
    return 0;
#endif
}
