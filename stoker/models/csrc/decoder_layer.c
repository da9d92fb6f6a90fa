/* The whole decoder stack of a Llama-family model with GGML-quantized linear
 * layers, for one step's flattened batch of tokens, in one call.
 *
 * Why: on a small model one decode token is ~30 layers x (8 C calls + ~15
 * torch ops), and on a 135M model the Python and torch dispatch around them
 * cost as much as the matmuls. Here the stack runs inside ONE OpenMP parallel
 * region (llama.cpp's way): the threads stay up for all layers and meet at
 * barriers between the steps that depend on each other, so there is no
 * per-op dispatch and no fork/join per kernel.
 *
 * Per layer, for the step's n rows (decodes and prefill chunks alike):
 *   x = RMSNorm(h) -> int8; qkv = x Wqkv^T (+ bias); [Qwen3: q/k RMSNorm per head];
 *   RoPE on q, k from the model's own cos/sin tables; k, v written to the paged
 *   cache at the row's slot; attention of each row over its sequence's cache
 *   up to and including its own position; h += attn Wo^T;
 *   x = RMSNorm(h) -> int8; gu = x Wgu^T; a = silu(g) * u -> int8; h += a Wd^T.
 *
 * Batch invariance: a row's result never depends on the other rows. The
 * matmuls are ggml_quant.c's (bit-identical whatever m and the split, see
 * there, including the switch between its exact GEMM and tiles by m). Every
 * other reduction (norm sums, q.k dots, softmax sums, p.v sums) runs over one
 * row or one (row, head) in a fixed order written out here with explicit
 * partial sums (8 for the norms; the path's vector width for attention, whose
 * multiply-adds are explicit fused ones where the ISA has them), so it
 * vectorizes without the compiler reassociating or fusing anything (built
 * like ggml_quant.c: -ffp-contract=off, no -fassociative-math). Which thread
 * runs an item, and which heads share its block, never changes its
 * arithmetic. Attention treats a prefill row exactly as a decode
 * row of context position + 1, so a prompt token's attention is the same
 * computation whether its prompt came alone, chunked or next to others.
 *
 * fp32 activations; a KV cache of fp32 rows, of bf16 or fp16 rows (rounded
 * as torch rounds, widened exactly), or of int8 or fp8 e4m3 rows with their
 * float32 scale (stoker/models/kv_quant.py: quantized here as k and v are
 * written, as torch would, and read by attention as they are, the scale
 * applied to a key's q.k sum and to a value row).
 * The Python side (fused_decoder.py) checks that and builds the Model tables
 * once at load.
 */
#include <math.h>
#include <pthread.h>

#include "ggml_quant.c"
#include "subnormals.h"

#define MAX_PARTS 4
/* cache row formats, as fused_decoder.py passes them */
enum { KV_F32 = 0, KV_INT8 = 1, KV_BF16 = 2, KV_FP8 = 3, KV_F16 = 4 };
/* kv_quant.py's rows: one byte a value, then the row's float32 scale. */
static inline int kv_quantized(int format) { return format == KV_INT8 || format == KV_FP8; }
#define KV_PREFETCH_KEYS 32 /* how far ahead attention prefetches cache rows */
#define ATTEND_ROWS 16 /* rows of one sequence that attention serves together */
/* keys a p.v pass takes between loading and storing its output vectors (the
 * sum still runs key by key in order: any multiple of 8 gives the same result) */
#define PV_KEYS 32

/* One linear layer: row-stacked parts (a Q4_K_M qkv is Q4_K rows then Q6_K rows). */
typedef struct {
    int num_parts;
    int types[MAX_PARTS];
    const uint8_t *weights[MAX_PARTS];
    int starts[MAX_PARTS]; /* first output column of each part */
    int rows[MAX_PARTS];
    const float *bias; /* [out_features] or NULL */
    int in_features, out_features;
} Linear;

typedef struct {
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm; /* [head_dim] each, or NULL (Qwen3 has them) */
    Linear qkv, o_proj, gate_up, down;
} Layer;

typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *cos, *sin; /* [max_positions, head_dim] */
    int max_positions;
    const Layer *layers;
} Model;

/* One step: row r of the batch is at positions[r], writes its k and v at
 * slots[r] and attends through block table row_seq ? row_seq[r] : r. */
typedef struct {
    int n;
    const int64_t *positions, *slots;
    const int64_t *tables; /* [sequences, max_blocks] */
    int max_blocks;
    const int32_t *row_seq; /* NULL: one sequence per row (all decodes) */
    void *const *k_caches, *const *v_caches; /* per layer, [blocks, block_size, kv_heads, row] */
    int block_size;
    int kv_format; /* KV_F32, KV_INT8, KV_BF16, KV_FP8 (e4m3) or KV_F16 */
} Step;

/* Bytes of one (token, kv head) row of the cache. */
static inline size_t kv_row_bytes(const Step *S, int D) {
    return kv_quantized(S->kv_format) ? (size_t)D + sizeof(float)
           : S->kv_format == KV_F32   ? (size_t)D * sizeof(float)
                                      : (size_t)D * sizeof(uint16_t);
}

/* Where row `index` (in rows) of a cache starts. */
static inline uint8_t *kv_row_at(const Step *S, const void *cache, size_t index, int D) {
    return (uint8_t *)cache + index * kv_row_bytes(S, D);
}

/* A cache row's scale as attention applies it (1 for float rows): it
 * multiplies a key's q.k sum (over the row's values as av_load_kv reads them)
 * and a value row's values. An e4m3 byte is read as the fp16 with the same
 * sign, exponent and mantissa bits, 2^-8 times its value (exact, subnormals
 * included), so an fp8 row's scale carries the 2^8 back: the same products. */
static inline float kv_scale(const Step *S, const uint8_t *row, int D) {
    if (!kv_quantized(S->kv_format)) return 1.f;
    float scale;
    memcpy(&scale, row + D, sizeof scale);
    return S->kv_format == KV_FP8 ? scale * 256.f : scale;
}

/* The bits of x >= 0 (u, sign clear) rounded to nearest even into a float of
 * `mant` mantissa bits and exponent bias `bias`, subnormals included, without
 * the sign; the callers keep x within the format's range. */
static inline uint32_t round_to_narrow_float(uint32_t u, int mant, int bias) {
    const uint32_t min_normal = (uint32_t)(128 - bias) << 23;
    if (u < min_normal) { /* subnormal: whole steps of 2^(1 - bias - mant) */
        const uint32_t steps_bits = (uint32_t)(126 + bias + mant) << 23;
        float a, steps;
        memcpy(&a, &u, sizeof a);
        memcpy(&steps, &steps_bits, sizeof steps);
        return (uint32_t)lrintf(a * steps);
    }
    const int shift = 23 - mant;
    const uint32_t rounded = u + ((1u << (shift - 1)) - 1u) + ((u >> shift) & 1u);
    return (rounded - ((uint32_t)(127 - bias) << 23)) >> shift; /* exponent bias 127 -> bias */
}

/* fp32 -> fp16, round to nearest even (torch's .to(torch.float16)). */
static inline uint16_t float_to_half(float f) {
#if QUANT_SIMD
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return sign | 0x7E00u;  /* NaN */
    if (u >= 0x477FF000u) return sign | 0x7C00u; /* 65520 and up round to infinity */
    return sign | (uint16_t)round_to_narrow_float(u, 10, 15);
#endif
}

/* |x| <= 448 -> fp8 e4m3fn, round to nearest even (torch's .to(torch.float8_e4m3fn)). */
static inline uint8_t float_to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint8_t)(((u >> 24) & 0x80u) | round_to_narrow_float(u & 0x7FFFFFFFu, 3, 7));
}

/* x [D] into the cache row `index`: as kv_quant.quantize_rows (scale = max|x| / Q,
 * q = round-half-even(x * (Q / max|x|)), Q = 127 for int8, 448 for e4m3 clamped
 * first) for an int8 or fp8 cache; rounded to nearest even, as torch's
 * .to(torch.bfloat16) / .to(torch.float16), for a bf16 or fp16 one. */
static inline void kv_store(const Step *S, void *cache, size_t index, const float *restrict x, int D) {
    uint8_t *row = kv_row_at(S, cache, index, D);
    if (S->kv_format == KV_F32) {
        memcpy(row, x, sizeof(float) * D);
        return;
    }
    if (S->kv_format == KV_BF16 || S->kv_format == KV_F16) {
        uint16_t *restrict h = (uint16_t *)row;
        if (S->kv_format == KV_BF16)
            for (int d = 0; d < D; d++) h[d] = float_to_bf16(x[d]);
        else
            for (int d = 0; d < D; d++) h[d] = float_to_half(x[d]);
        return;
    }
    const float qmax = S->kv_format == KV_INT8 ? 127.f : 448.f;
    /* by eight lanes (D % 8 == 0): one lane's max chain was most of position_row */
    const float amax = absmax_row(x, D);
    const float inv = amax > 0.f ? qmax / amax : 0.f, scale = amax / qmax;
    if (S->kv_format == KV_INT8) {
        /* lrintf's round half even (|x * inv| <= 127 + an ulp), clamped to +-127 */
        for (int d = 0; d < D; d += 8) round_to_int8(load8(x + d) * inv, (int8_t *)row + d);
    } else {
        for (int d = 0; d < D; d++) {
            const float v = x[d] * inv;
            row[d] = float_to_e4m3(v > 448.f ? 448.f : v < -448.f ? -448.f : v);
        }
    }
    memcpy(row + D, &scale, sizeof scale);
}

/* Scratch shared by the threads for one call. */
typedef struct {
    float *normed, *qkv, *attn, *gate_up, *act; /* [n, width of each] */
    int8_t *qs32, *qs256;                       /* the rows of a linear's input as int8 */
    float *d32, *s32, *d256, *s256;
    int16_t *bsums32, *bsums256;
    float *attn_scratch; /* per thread: see attend */
    size_t attn_scratch_floats;
    int *group_starts; /* attention's row groups: rows group_starts[i] .. group_starts[i + 1] - 1 */
    int num_groups;
    int *group_order; /* the groups, most attention work (keys read over their rows) first */
    int16_t *isum32;       /* integer sums of qs32 per 32 (the exact kernels' offset term) */
    uint8_t *gemm_scratch; /* per thread: gemm_scratch_bytes(kmax, n); none for a small decode step */
    size_t gemm_scratch_size;
} Buffers;

/* ---- row operations: fixed summation order, vectorizable as written -------- */

/* Sum of a[i] * b[i] over 8 lanes then a fixed tree: d % 8 == 0. */
static inline float dot8(const float *restrict a, const float *restrict b, int d) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < d; i += 8)
        for (int j = 0; j < 8; j++) acc[j] = acc[j] + a[i + j] * b[i + j];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* As LlamaRMSNorm in fp32: out = weight * (x * 1 / sqrt(mean(x^2) + eps)). */
static inline void rms_norm_row(const float *restrict x, const float *restrict weight, float *restrict out, int dim,
                                float eps) {
    const float inv = 1.f / sqrtf(dot8(x, x, dim) / (float)dim + eps);
    for (int i = 0; i < dim; i++) out[i] = weight[i] * (x[i] * inv);
}

/* exp(x) for x <= 0 as 2^k * e^r, k = round(x / ln 2), r = x - k ln 2 with ln 2
 * split in two (k * LN2_HI is exact: 12 + 7 significant bits), e^r by a
 * degree-7 Taylor polynomial on |r| <= 0.35: a few ulp from expf, no fmaf (a
 * libm call where the ISA has no FMA), and it vectorizes. Accuracy matters
 * more than it seems: an error of 1e-5 in a softmax weight moves activations
 * across int8 rounding boundaries in the next matmul. */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float k = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-6f;
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* silu(g) = g / (1 + exp(-g)); exp(-|g|) keeps the polynomial in range and
 * exp(-g) = 1 / exp(g) covers g < 0. */
static inline float silu(float g) {
    const float e = exp_nonpositive(g < 0.f ? g : -g); /* exp(-|g|) */
    return g >= 0.f ? g / (1.f + e) : g * e / (e + 1.f);
}

/* ---- linear layers inside the parallel region --------------------------- */

static inline xq_t xq_for(const Buffers *b, int be, int k) {
    if (be == 32) return (xq_t){b->qs32, b->d32, b->s32, b->bsums32, k, b->isum32};
    return (xq_t){b->qs256, b->d256, b->s256, b->bsums256, k, NULL};
}

/* Row r of x (k = L->in_features wide) rounded to int8 for every block size L's parts use. */
static void quantize_input_row(const Linear *L, const Buffers *b, const float *x, int r) {
    int done32 = 0, done256 = 0;
    for (int p = 0; p < L->num_parts; p++) {
        const int be = block_elems(L->types[p]);
        if ((be == 32 && done32) || (be == 256 && done256)) continue;
        const xq_t xq = xq_for(b, be, L->in_features);
        quantize_row(x, 0, (size_t)r, L->in_features, be, &xq);
        if (be == 32) done32 = 1;
        else done256 = 1;
    }
}

/* Thread t's share of y[n rows] (= or +=) x W^T (+ bias), x already quantized. */
static void linear_thread(const Linear *L, const Buffers *b, int m, float *y, long y_stride, int accumulate, int t,
                          int nt) {
    for (int p = 0; p < L->num_parts; p++) {
        const int type = L->types[p], be = block_elems(type);
        const xq_t xq = xq_for(b, be, L->in_features);
        const size_t row_bytes = (size_t)(L->in_features / be) * ggml_quant_type_size(type);
        quant_matmul_thread(type, L->weights[p], row_bytes, &xq, m, L->rows[p], y + L->starts[p], y_stride, 0,
                            L->bias ? L->bias + L->starts[p] : NULL, accumulate,
                            b->gemm_scratch + b->gemm_scratch_size * (size_t)t, t, nt);
    }
}

/* ---- attention ----------------------------------------------------------- */

/* Attention's vectors: the path's widest (16 floats on AVX-512, 8 on AVX2 and
 * in the portable build), with a fused multiply-add where the ISA has one. The
 * heads of one row (one kv head's group) are served together, sharing each
 * load of a K or V row: as many as the registers hold (per head, eight score
 * accumulators for q.k, four vectors of the output for p.v). What a head
 * computes never depends on which heads share its block. */
#if QUANT_SIMD
typedef gemm_f av_t;
#define AV_LANES GEMM_LANES
#define AV_LOAD(p) GV_LOAD_F(p)
#define AV_STORE(p, v) GV_STORE_F(p, v)
#define AV_SET1(x) GV_SET1_F(x)
#define AV_ZERO() GV_ZERO_F()
#define AV_FMA(a, b, c) GV_FMADD(a, b, c)
#else
typedef f8 av_t;
#define AV_LANES 8
#define AV_LOAD(p) load8(p)
#define AV_STORE(p, v) store8(p, v)
#define AV_SET1(x) ((f8){0.f} + (x))
#define AV_ZERO() ((f8){0.f})
#define AV_FMA(a, b, c) ((a) * (b) + (c))
#endif
#if AV_LANES == 16
#define QK_HEADS 3
#define PV_HEADS 3
/* The first n (8 or 16) floats at p, zeros after: a head of 16k + 8 floats. */
ALWAYS_INLINE av_t av_load_n(const float *p, int n) {
    return n == 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)0xff, p);
}
ALWAYS_INLINE void av_store_n(float *p, av_t v, int n) {
    if (n == 16) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, (__mmask16)0xff, v);
}
/* Lanes 0-7 plus lanes 8-15. */
ALWAYS_INLINE f8 av_fold8(av_t a) {
    const __m256 lo = _mm512_castps512_ps256(a);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return (f8)_mm256_add_ps(lo, hi);
}
#else
#define QK_HEADS 1
#define PV_HEADS 2
/* Heads are whole vectors here (head_dim % 8 == 0). */
ALWAYS_INLINE av_t av_load_n(const float *p, int n) {
    (void)n;
    return AV_LOAD(p);
}
ALWAYS_INLINE void av_store_n(float *p, av_t v, int n) {
    (void)n;
    AV_STORE(p, v);
}
ALWAYS_INLINE f8 av_fold8(av_t a) { return (f8)a; }
#endif

/* Floats d .. d + n - 1 (n = AV_LANES, or 8 for a 16k + 8 head's tail, zeros
 * after) of a K or V row stored as `format`: KV_F32 rows are floats (an fp32
 * cache, or rows key_rows widened); the cache's own int8, bf16, e4m3 (as the
 * fp16 of its bits, see kv_scale) and fp16 rows are converted in registers,
 * exactly. format is a constant at every call. */
ALWAYS_INLINE av_t av_load_kv(const void *row, int format, int d, int n) {
    if (format == KV_F32) return av_load_n((const float *)row + d, n);
#if AV_LANES == 16
    if (kv_quantized(format)) {
        const uint8_t *p = (const uint8_t *)row + d;
        const __m128i b = n == 16 ? _mm_loadu_si128((const __m128i *)p) : _mm_loadl_epi64((const __m128i *)p);
        if (format == KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
        const __m256i x = _mm256_cvtepu8_epi16(b);
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), 7),
                                          _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8));
        return _mm512_cvtph_ps(h);
    }
    const uint16_t *p = (const uint16_t *)row + d;
    const __m256i h =
        n == 16 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
    if (format == KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif QUANT_SIMD
    (void)n;
    if (kv_quantized(format)) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)row + d));
        if (format == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        const __m128i x = _mm_cvtepu8_epi16(b);
        return _mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), 7),
                                            _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8)));
    }
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + d));
    if (format == KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
    (void)n;
    av_t v;
    for (int j = 0; j < 8; j++) {
        const uint8_t *p = (const uint8_t *)row;
        uint16_t h;
        switch (format) {
        case KV_INT8: v[j] = (float)((const int8_t *)p)[d + j]; continue;
        case KV_BF16: v[j] = bf16_to_float(((const uint16_t *)p)[d + j]); continue;
        case KV_FP8: h = (uint16_t)(((p[d + j] & 0x7Fu) << 7) | ((p[d + j] & 0x80u) << 8)); break;
        default: memcpy(&h, p + 2 * (size_t)(d + j), sizeof h); break;
        }
        v[j] = fp16_at((const uint8_t *)&h);
    }
    return v;
#endif
}

/* CALL(f) with f the constant equal to `format`: one instantiation of an
 * inlined kernel per cache row format. */
#define FOR_KV_FORMAT(format, CALL)                                                                                    \
    switch (format) {                                                                                                  \
    case KV_INT8: CALL(KV_INT8); break;                                                                                \
    case KV_BF16: CALL(KV_BF16); break;                                                                                \
    case KV_FP8: CALL(KV_FP8); break;                                                                                  \
    case KV_F16: CALL(KV_F16); break;                                                                                  \
    default: CALL(KV_F32); break;                                                                                      \
    }

/* A cache row's values (as av_load_kv reads them) times scale into buf. */
ALWAYS_INLINE void widen_row(const void *row, int format, int D, float scale, float *restrict buf) {
    for (int d = 0; d < D; d += AV_LANES) {
        const int n = D - d < AV_LANES ? D - d : AV_LANES;
        av_store_n(buf + d, av_load_kv(row, format, d, n) * AV_SET1(scale), n);
    }
}
static inline void kv_widen(const Step *S, const uint8_t *row, int D, float scale, float *restrict buf) {
#define WIDEN(format) widen_row(row, format, D, scale, buf)
    FOR_KV_FORMAT(S->kv_format, WIDEN)
#undef WIDEN
}

/* Eight keys' eight-lane sums into their eight totals, each
 * ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), by shuffles across keys. */
ALWAYS_INLINE f8 sum_lanes_x8(const f8 a[8]) {
    /* b = lanes 0-3 + lanes 4-7, two keys a vector: [l0+l4, l1+l5, l2+l6, l3+l7] each */
#define HALVES(x, y) (SHUFFLE8(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE8(x, y, 4, 5, 6, 7, 12, 13, 14, 15))
#define PAIRS(x, y) (SHUFFLE8(x, y, 0, 2, 4, 6, 8, 10, 12, 14) + SHUFFLE8(x, y, 1, 3, 5, 7, 9, 11, 13, 15))
    const f8 b01 = HALVES(a[0], a[1]), b23 = HALVES(a[2], a[3]), b45 = HALVES(a[4], a[5]), b67 = HALVES(a[6], a[7]);
    /* [(l0+l4)+(l1+l5), (l2+l6)+(l3+l7)] per key, keys 0-3 and 4-7; then their sum per key */
    return PAIRS(PAIRS(b01, b23), PAIRS(b45, b67));
#undef HALVES
#undef PAIRS
}

#if AV_LANES == 16
typedef float f16v __attribute__((vector_size(64)));
/* sum_lanes_x8 of the eight keys' av_fold8, the same additions in the same
 * order, with two to four keys a vector: 24 shuffles and adds, not 37. */
ALWAYS_INLINE f8 sum_lanes_x8_wide(const av_t a[8]) {
    f16v v[8];
    for (int i = 0; i < 8; i++) v[i] = (f16v)a[i];
    /* keys i and i + 1 in the two halves: lanes 0-7 + lanes 8-15 (av_fold8) */
#define FOLD(x, y)                                                                                                     \
    (__builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +                           \
     __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
    const f16v k01 = FOLD(v[0], v[1]), k23 = FOLD(v[2], v[3]), k45 = FOLD(v[4], v[5]), k67 = FOLD(v[6], v[7]);
#undef FOLD
    /* four keys a vector, per key [l0+l4, l1+l5, l2+l6, l3+l7] */
#define HALVES(x, y)                                                                                                   \
    (__builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +                         \
     __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
    const f16v k0123 = HALVES(k01, k23), k4567 = HALVES(k45, k67);
#undef HALVES
    /* eight keys, per key [(l0+l4)+(l1+l5), (l2+l6)+(l3+l7)] */
    const f16v pairs = __builtin_shufflevector(k0123, k4567, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                       __builtin_shufflevector(k0123, k4567, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return __builtin_shufflevector(pairs, pairs, 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(pairs, pairs, 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

/* q.k for np heads (q[h]) and eight keys k[i] (rows stored as format): per
 * (head, key), AV_LANES lane sums of q[d] * k[d] over d = lane, lane +
 * AV_LANES, ... in order (fused where the ISA has it), folded to eight lanes,
 * then sum_lanes_x8. np and format are constants at every call, so the
 * accumulators stay in registers. */
ALWAYS_INLINE void qk_x8(const float *const q[], int np, const void *const k[8], int format, int D, f8 out[]) {
    av_t a[QK_HEADS][8];
    for (int h = 0; h < np; h++)
        for (int i = 0; i < 8; i++) a[h][i] = AV_ZERO();
    for (int d = 0; d < D; d += AV_LANES) {
        const int n = D - d < AV_LANES ? D - d : AV_LANES;
        av_t x[QK_HEADS];
        for (int h = 0; h < np; h++) x[h] = av_load_n(q[h] + d, n);
        for (int i = 0; i < 8; i++) {
            const av_t key = av_load_kv(k[i], format, d, n);
            for (int h = 0; h < np; h++) a[h][i] = AV_FMA(x[h], key, a[h][i]);
        }
    }
    for (int h = 0; h < np; h++) {
#if AV_LANES == 16
        out[h] = sum_lanes_x8_wide(a[h]);
#else
        f8 folded[8];
        for (int i = 0; i < 8; i++) folded[i] = av_fold8(a[h][i]);
        out[h] = sum_lanes_x8(folded);
#endif
    }
}

/* qk_x8 with np and format as constants. */
ALWAYS_INLINE void qk_heads(const float *const q[], int np, const void *const k[8], int format, int D, f8 out[]) {
#define QK_NP(format)                                                                                                  \
    do {                                                                                                               \
        if (QK_HEADS >= 3 && np == 3) qk_x8(q, 3, k, format, D, out);                                                  \
        else if (QK_HEADS >= 2 && np == 2) qk_x8(q, 2, k, format, D, out);                                             \
        else qk_x8(q, 1, k, format, D, out);                                                                           \
    } while (0)
    FOR_KV_FORMAT(format, QK_NP)
#undef QK_NP
}

/* acc[h][d] += p[h][i] * (v[i][d] * scale[i]) for keys i < nk in order (rows
 * stored as format; scale[i] only for int8 and fp8 rows, others are 1 or come
 * scaled), np heads, four vectors of d at a time held in registers over the
 * keys: up to PV_KEYS of them, so a prompt's rows load and store their output
 * once every 32 keys, not every 8 (that traffic was ~20% of prefill p.v). */
ALWAYS_INLINE void pv_x8(float *const acc[], const float *const p[], int np, const void *const v[PV_KEYS],
                         const float scale[PV_KEYS], int format, int nk, int D) {
    int d = 0;
    for (; d + 4 * AV_LANES <= D; d += 4 * AV_LANES) {
        av_t c[PV_HEADS][4];
        for (int h = 0; h < np; h++)
            for (int s = 0; s < 4; s++) c[h][s] = AV_LOAD(acc[h] + d + s * AV_LANES);
        for (int i = 0; i < nk; i++) {
            av_t row[4];
            for (int s = 0; s < 4; s++) row[s] = av_load_kv(v[i], format, d + s * AV_LANES, AV_LANES);
            if (kv_quantized(format))
                for (int s = 0; s < 4; s++) row[s] = row[s] * AV_SET1(scale[i]);
            for (int h = 0; h < np; h++) {
                const av_t w = AV_SET1(p[h][i]);
                for (int s = 0; s < 4; s++) c[h][s] = AV_FMA(w, row[s], c[h][s]);
            }
        }
        for (int h = 0; h < np; h++)
            for (int s = 0; s < 4; s++) AV_STORE(acc[h] + d + s * AV_LANES, c[h][s]);
    }
    for (; d < D; d += AV_LANES) {
        const int n = D - d < AV_LANES ? D - d : AV_LANES;
        av_t c[PV_HEADS];
        for (int h = 0; h < np; h++) c[h] = av_load_n(acc[h] + d, n);
        for (int i = 0; i < nk; i++) {
            av_t row = av_load_kv(v[i], format, d, n);
            if (kv_quantized(format)) row = row * AV_SET1(scale[i]);
            for (int h = 0; h < np; h++) c[h] = AV_FMA(AV_SET1(p[h][i]), row, c[h]);
        }
        for (int h = 0; h < np; h++) av_store_n(acc[h] + d, c[h], n);
    }
}

/* pv_x8 with np and format as constants. */
ALWAYS_INLINE void pv_heads(float *const acc[], const float *const p[], int np, const void *const v[PV_KEYS],
                            const float scale[PV_KEYS], int format, int nk, int D) {
#define PV_NP(format)                                                                                                  \
    do {                                                                                                               \
        if (PV_HEADS >= 3 && np == 3) pv_x8(acc, p, 3, v, scale, format, nk, D);                                       \
        else if (PV_HEADS >= 2 && np == 2) pv_x8(acc, p, 2, v, scale, format, nk, D);                                  \
        else pv_x8(acc, p, 1, v, scale, format, nk, D);                                                                \
    } while (0)
    FOR_KV_FORMAT(format, PV_NP)
#undef PV_NP
}

/* ---- q.k against an int8 cache, in integers ---------------------------------
 * With an int8 cache, q is quantized too, per (row, head) as kv_store
 * quantizes a cache row (scale = max|q| / 127, round half even), and q.k is
 * summed in int32: exact, so its order is free and every path (and a prefill
 * row and a decode row) gets the same integer; the score is then
 * (float)sum * q's scale * (the key's scale * scale), in that order. llama.cpp
 * does the same for its q8_0 cache (q as q8_0). The integer sum lets a pass's
 * keys lie along the vector lanes (rows transposed by dwords, four values a
 * lane): one multiply-add then yields four products for each of 16 keys
 * (AVX-512) or 8, and no lane sums are left to fold. */
#define QK_INT8_HEADS 4 /* queries a pass over the keys serves */
#if QUANT_ISA == 3
#define KT_KEYS 16 /* keys a pass: the vector's int32 lanes */
typedef __m512i kt_t;
#elif QUANT_SIMD
#define KT_KEYS 8
typedef __m256i kt_t;
#else
#define KT_KEYS 8
typedef i32x8 kt_t; /* unused: the portable build sums the rows as stored */
#endif
#define KEY_PAD 16 /* scores rows are padded to this many keys: KT_KEYS on every path */

typedef uint8_t u8x8 __attribute__((vector_size(8)));

/* q [D] as int8 (qi), |qi| (qa), its scale and the sum of qi; D % 8 == 0, by
 * eight lanes (a decode item quantizes its queries for a few hundred keys: a
 * one-lane max chain cost a tenth of its time). */
static inline void quantize_query(const float *restrict q, int D, int8_t *restrict qi, uint8_t *restrict qa,
                                  float *scale, int32_t *sum) {
    const float amax = absmax_row(q, D);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    i32x8 sums = {0};
    for (int d = 0; d < D; d += 8) {
        /* round half even, as lrintf in the default mode: |q[d] * inv| <= 127 + an ulp */
        const i32x8 n = round_to_int8(load8(q + d) * inv, qi + d);
        const u8x8 a8 = __builtin_convertvector((n ^ (n >> 31)) - (n >> 31), u8x8); /* |n| */
        memcpy(qa + d, &a8, sizeof a8);
        sums += n;
    }
    int32_t s = 0;
    for (int j = 0; j < 8; j++) s += sums[j];
    *scale = amax / 127.f;
    *sum = s;
}

#if QUANT_ISA == 3
/* KT_KEYS int8 rows of D values (D % 16 == 0), transposed by dwords: kt[g]
 * lane i holds values 4g .. 4g + 3 of row i, offset by +128 (vpdpbusd's
 * unsigned operand; q.k then takes 128 * sum(q) back off). */
ALWAYS_INLINE void transpose_keys(const void *const rows[KT_KEYS], int D, kt_t *restrict kt) {
    for (int c = 0; c < D; c += 64) {
        const __mmask64 valid = D - c >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (D - c)) - 1);
        __m512i r[16], t[16], u[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_maskz_loadu_epi8(valid, (const int8_t *)rows[i] + c);
        for (int i = 0; i < 16; i += 2) {
            t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
            t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        }
        /* u[4G + k]: in each 128-bit lane L, dword 4L + k of rows 4G .. 4G + 3 */
        for (int i = 0; i < 16; i += 4) {
            u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
            u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
            u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
            u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
        }
        const __m512i offset = _mm512_set1_epi8((char)0x80);
        for (int k = 0; k < 4; k++) {
            const __m512i v01 = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(1, 0, 1, 0));
            const __m512i w01 = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(3, 2, 3, 2));
            const __m512i v23 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(1, 0, 1, 0));
            const __m512i w23 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(3, 2, 3, 2));
            kt[c / 4 + k] = _mm512_xor_si512(_mm512_shuffle_i32x4(v01, v23, _MM_SHUFFLE(2, 0, 2, 0)), offset);
            kt[c / 4 + 4 + k] = _mm512_xor_si512(_mm512_shuffle_i32x4(v01, v23, _MM_SHUFFLE(3, 1, 3, 1)), offset);
            kt[c / 4 + 8 + k] = _mm512_xor_si512(_mm512_shuffle_i32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)), offset);
            kt[c / 4 + 12 + k] = _mm512_xor_si512(_mm512_shuffle_i32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)), offset);
        }
    }
}

/* Scores of np queries (quantize_query's) and the keys in kt into out[h]
 * [KT_KEYS]: the integer q.k, times the query's scale, times key_scales. */
ALWAYS_INLINE void qk_int8(const kt_t *restrict kt, const int8_t *const qi[], const uint8_t *const qa[],
                           const int32_t qsum[], const float qscale[], int np, int D, const float *key_scales,
                           float *const out[]) {
    (void)qa;
    __m512i a[QK_INT8_HEADS];
    for (int h = 0; h < np; h++) a[h] = _mm512_setzero_si512();
    for (int g = 0; g < D / 4; g++) {
        const __m512i k = kt[g];
        for (int h = 0; h < np; h++) {
            int32_t qd;
            memcpy(&qd, qi[h] + 4 * g, sizeof qd);
            a[h] = _mm512_dpbusd_epi32(a[h], k, _mm512_set1_epi32(qd));
        }
    }
    const __m512 ks = _mm512_loadu_ps(key_scales);
    for (int h = 0; h < np; h++) {
        const __m512i dot = _mm512_sub_epi32(a[h], _mm512_set1_epi32(128 * qsum[h]));
        _mm512_storeu_ps(out[h], _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(qscale[h])), ks));
    }
}
#elif QUANT_SIMD
/* Eight int8 rows of D values (D % 16 == 0), transposed by dwords: kt[g] lane
 * i holds values 4g .. 4g + 3 of row i; offset by +128 on the VNNI paths
 * (vpdpbusd's unsigned operand; q.k then takes 128 * sum(q) back off). */
ALWAYS_INLINE void transpose_keys(const void *const rows[KT_KEYS], int D, kt_t *restrict kt) {
    for (int c = 0; c < D; c += 32) {
        __m256i r[8], t[8], u[8];
        for (int i = 0; i < 8; i++) {
            const int8_t *p = (const int8_t *)rows[i] + c;
            r[i] = D - c >= 32 ? _mm256_loadu_si256((const __m256i *)p)
                               : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
        }
        for (int i = 0; i < 8; i += 2) {
            t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
            t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
            u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
            u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
            u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
            u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
        }
        for (int g = 0; g < 4; g++) {
            kt[c / 4 + g] = _mm256_permute2x128_si256(u[g], u[g + 4], 0x20);
            kt[c / 4 + g + 4] = _mm256_permute2x128_si256(u[g], u[g + 4], 0x31);
        }
#if QUANT_ISA == 2
        for (int g = 0; g < 8; g++) kt[c / 4 + g] = _mm256_xor_si256(kt[c / 4 + g], _mm256_set1_epi8((char)0x80));
#endif
    }
}

/* Scores of np queries (quantize_query's) and the keys in kt into out[h]
 * [KT_KEYS]: the integer q.k, times the query's scale, times key_scales. */
ALWAYS_INLINE void qk_int8(const kt_t *restrict kt, const int8_t *const qi[], const uint8_t *const qa[],
                           const int32_t qsum[], const float qscale[], int np, int D, const float *key_scales,
                           float *const out[]) {
#if QUANT_ISA == 2
    (void)qa;
#endif
    __m256i a[QK_INT8_HEADS];
    for (int h = 0; h < np; h++) a[h] = _mm256_setzero_si256();
    for (int g = 0; g < D / 4; g++) {
        const __m256i k = kt[g];
        for (int h = 0; h < np; h++) {
            int32_t qd;
            memcpy(&qd, qi[h] + 4 * g, sizeof qd);
#if QUANT_ISA == 2
            a[h] = _mm256_dpbusd_avx_epi32(a[h], k, _mm256_set1_epi32(qd));
#else
            int32_t ad; /* |q| times k with q's sign: maddubs' pairs stay within int16 */
            memcpy(&ad, qa[h] + 4 * g, sizeof ad);
            const __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi32(ad), _mm256_sign_epi8(k, _mm256_set1_epi32(qd)));
            a[h] = _mm256_add_epi32(a[h], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
        }
    }
    for (int h = 0; h < np; h++) {
#if QUANT_ISA == 2
        a[h] = _mm256_sub_epi32(a[h], _mm256_set1_epi32(128 * qsum[h]));
#else
        (void)qsum;
#endif
        _mm256_storeu_ps(out[h], _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a[h]), _mm256_set1_ps(qscale[h])),
                                               _mm256_loadu_ps(key_scales)));
    }
}
#endif

/* The same scores from the rows as stored: the portable build, and heads the
 * transposition does not take (head_dim % 16 != 0). */
ALWAYS_INLINE void qk_int8_rows(const void *const rows[KT_KEYS], const int8_t *const qi[], const float qscale[],
                                int np, int D, const float *key_scales, float *const out[]) {
    for (int h = 0; h < np; h++)
        for (int i = 0; i < KT_KEYS; i++) {
            const int8_t *k = (const int8_t *)rows[i];
            int32_t s = 0;
            for (int d = 0; d < D; d++) s += (int32_t)qi[h][d] * k[d];
            out[h][i] = ((float)s * qscale[h]) * key_scales[i];
        }
}

/* Scores of queries x0 .. x0 + np - 1 for keys t0 .. t0 + KT_KEYS - 1 into
 * scores[x * Lpad + t0 ..]; key_scales: each key's scale times the softmax scale. */
ALWAYS_INLINE void scores_int8(const kt_t *kt, const void *const rows[KT_KEYS], const float key_scales[KT_KEYS],
                               const int8_t *qi, const uint8_t *qa, const float *qscale, const int32_t *qsum, int x0,
                               int np, int D, float *scores, size_t Lpad, int t0) {
    const int8_t *qs[QK_INT8_HEADS];
    const uint8_t *as[QK_INT8_HEADS];
    float *out[QK_INT8_HEADS];
    for (int h = 0; h < np; h++) {
        qs[h] = qi + (size_t)(x0 + h) * D;
        as[h] = qa + (size_t)(x0 + h) * D;
        out[h] = scores + (size_t)(x0 + h) * Lpad + t0;
    }
#if QUANT_SIMD
    if (D % 16 == 0) qk_int8(kt, qs, as, qsum + x0, qscale + x0, np, D, key_scales, out);
    else qk_int8_rows(rows, qs, qscale + x0, np, D, key_scales, out);
#else
    (void)kt, (void)as, (void)qsum;
    qk_int8_rows(rows, qs, qscale + x0, np, D, key_scales, out);
#endif
}

/* The cache rows of keys t0 .. t0 + 7 (for kv head kvh) through the block
 * table, and their scales (kv_scale); keys past the context (t0 + i >= L) get
 * key t0's, and their results are never read. With `widen`, a cache of
 * narrower rows has them widened (times their scale where `scaled`: values, not
 * keys) into `widened` [8, D] and given as KV_F32 rows. A block holds its
 * tokens' rows one after another (all kv heads of a token together), so the
 * rows are walked by pointer and the table is read once a block: a decode row
 * runs this for every eight keys it reads, and indexing each row afresh put a
 * table load and a multiply-add chain on every key. */
ALWAYS_INLINE void key_rows(const Step *S, const void *cache, const int64_t *table, int kvh, int KVH, int D, int t0,
                            int L, int widen, int scaled, const void *rows[8], float scales[8],
                            float *restrict widened) {
    const int BS = S->block_size;
    const size_t row_bytes = kv_row_bytes(S, D), token_bytes = row_bytes * (size_t)KVH;
    const uint8_t *const base = (const uint8_t *)cache + (size_t)kvh * row_bytes;
#define BLOCK_ROW(block, offset) (base + ((size_t)table[block] * (size_t)BS + (size_t)(offset)) * token_bytes)
    int block = t0 / BS, offset = t0 % BS; /* of key t0 + i: one division a chunk, not one a key */
    const uint8_t *row = BLOCK_ROW(block, offset);
    for (int i = 0; i < 8; i++) {
        if (t0 + i >= L) {
            rows[i] = rows[0];
            scales[i] = scales[0];
            continue;
        }
        scales[i] = kv_scale(S, row, D);
        rows[i] = row;
        if (widen) {
            kv_widen(S, row, D, scaled ? scales[i] : 1.f, widened + (size_t)i * D);
            rows[i] = widened + (size_t)i * D;
        }
        if (++offset < BS) row += token_bytes;
        else if (t0 + i + 1 < L) block++, offset = 0, row = BLOCK_ROW(block, 0);
    }
    /* The rows of keys KV_PREFETCH_KEYS ahead: a decode row reads its context
     * once, from memory, in rows spread over blocks where the hardware
     * prefetcher loses the stream, so the loads above would wait on DRAM. */
    const int ahead = t0 + KV_PREFETCH_KEYS;
    if (ahead < L) {
        int pb = ahead / BS, po = ahead % BS;
        const uint8_t *next = BLOCK_ROW(pb, po);
        for (int i = 0; i < 8 && ahead + i < L; i++) {
            for (size_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(next + line);
            if (++po < BS) next += token_bytes;
            else if (ahead + i + 1 < L) pb++, po = 0, next = BLOCK_ROW(pb, 0);
        }
    }
#undef BLOCK_ROW
}

/* Rows r0 .. r0 + nrows - 1 (all of one sequence: they read the same block
 * table), query heads h0 .. h0 + count - 1 (all of one kv head's group):
 * softmax(q k^T * scale) v over each row's context (its position + 1 keys, all
 * in the cache by now), eight keys at a time (q.k against an int8 cache:
 * KT_KEYS; p.v: PV_KEYS). The rows and heads share each chunk of K and V
 * rows, which is the point: a prompt's rows would otherwise each stream its
 * whole context from memory. What a (row, head) computes never
 * depends on which rows or heads share its item, so the grouping never changes
 * a result, and a prefill row computes exactly what a decode row does. Per
 * (row, head): scores by qk_x8, times (the key's scale times scale), or for
 * an int8 cache by scores_int8 (integer q.k, see there); weights
 * exp(score - max) summed in AV_LANES lanes by key index, folded to eight as
 * av_fold8, then the same tree; out = (p.v by pv_x8) / that sum. A lone row
 * (a decode) converts a narrower cache's rows in registers as it reads them;
 * rows that share each chunk widen it once: the same floats either way.
 * Scratch: nrows * count * (the longest context rounded up to KEY_PAD +
 * head_dim * 1.5 + 2) floats. */
static void attend(const Model *M, const Step *S, int layer, const float *restrict qkv, size_t qkv_w,
                   float *restrict attn, int r0, int nrows, int h0, int count, float *restrict scratch) {
    const int D = M->head_dim, H = M->num_heads, KVH = M->num_kv_heads;
    const int kvh = h0 / (H / KVH), heads = nrows * count; /* (row, head) pairs, row-major */
    int lengths[ATTEND_ROWS], longest = 0;
    for (int j = 0; j < nrows; j++) {
        lengths[j] = (int)S->positions[r0 + j] + 1;
        longest = lengths[j] > longest ? lengths[j] : longest;
    }
    const size_t Lpad = ((size_t)longest + KEY_PAD - 1) / KEY_PAD * KEY_PAD;
    const int64_t *table = S->tables + (size_t)(S->row_seq ? S->row_seq[r0] : r0) * S->max_blocks;
    const void *kc = S->k_caches[layer], *vc = S->v_caches[layer];
    float *scores = scratch, *acc = scratch + (size_t)heads * Lpad; /* [heads, Lpad], [heads, D] */
    float inv[ATTEND_ROWS * 64];
    float widened[PV_KEYS * 512]; /* narrower rows as floats */
    const void *rows[8];
    float row_scales[8];
    const int widen = nrows > 1 && S->kv_format != KV_F32, format = widen ? KV_F32 : S->kv_format;

    if (S->kv_format == KV_INT8) {
        /* after acc: the queries as int8 and |int8|, [heads, D] each, their scales and sums */
        int8_t *const qi = (int8_t *)(acc + (size_t)heads * D);
        uint8_t *const qa = (uint8_t *)qi + (size_t)heads * D;
        float *const qscale = (float *)(qa + (size_t)heads * D);
        int32_t *const qsum = (int32_t *)(qscale + heads);
        for (int x = 0; x < heads; x++)
            quantize_query(qkv + (size_t)(r0 + x / count) * qkv_w + (size_t)(h0 + x % count) * D, D,
                           qi + (size_t)x * D, qa + (size_t)x * D, &qscale[x], &qsum[x]);
        kt_t kt[512 / 4];
        const void *krows[KT_KEYS];
        float key_scales[KT_KEYS];
        for (int t0 = 0; t0 < longest; t0 += KT_KEYS) {
            for (int c = 0; c < KT_KEYS; c += 8) /* past the context: rows whose results are never read */
                key_rows(S, kc, table, kvh, KVH, D, t0 + c < longest ? t0 + c : t0, longest, 0, 0, krows + c,
                         key_scales + c, NULL);
            for (int i = 0; i < KT_KEYS; i++) key_scales[i] = key_scales[i] * M->scale;
#if QUANT_SIMD
            if (D % 16 == 0) transpose_keys(krows, D, kt);
#endif
            for (int j = 0; j < nrows; j++) {
                if (t0 >= lengths[j]) continue;
                for (int g = 0; g < count; g += QK_INT8_HEADS) {
                    const int np = count - g < QK_INT8_HEADS ? count - g : QK_INT8_HEADS, x0 = j * count + g;
#define SCORES(NP) scores_int8(kt, krows, key_scales, qi, qa, qscale, qsum, x0, NP, D, scores, Lpad, t0)
                    if (np == 4) SCORES(4);
                    else if (np == 3) SCORES(3);
                    else if (np == 2) SCORES(2);
                    else SCORES(1);
#undef SCORES
                }
            }
        }
    } else {
        for (int t0 = 0; t0 < longest; t0 += 8) {
            key_rows(S, kc, table, kvh, KVH, D, t0, longest, widen, 0, rows, row_scales, widened);
            const f8 key_scales = load8(row_scales) * M->scale;
            for (int j = 0; j < nrows; j++) {
                if (t0 >= lengths[j]) continue;
                const float *q = qkv + (size_t)(r0 + j) * qkv_w + (size_t)h0 * D;
                for (int g = 0; g < count; g += QK_HEADS) {
                    const int np = count - g < QK_HEADS ? count - g : QK_HEADS;
                    const float *qs[QK_HEADS];
                    f8 out[QK_HEADS];
                    for (int h = 0; h < np; h++) qs[h] = q + (size_t)(g + h) * D;
                    qk_heads(qs, np, rows, format, D, out);
                    for (int h = 0; h < np; h++)
                        store8(scores + (size_t)(j * count + g + h) * Lpad + t0, out[h] * key_scales);
                }
            }
        }
    }
    for (int x = 0; x < heads; x++) {
        float *sx = scores + x * Lpad;
        const int L = lengths[x / count];
        /* The max in four vectors, each its own dependency chain: a max is
         * exact, so any order gives the same m. */
        f8 top[4] = {{0}};
        for (int u = 0; u < 4; u++) top[u] = top[u] - INFINITY;
        int t = 0;
        for (; t + 32 <= L; t += 32)
            for (int u = 0; u < 4; u++) top[u] = max8(top[u], load8(sx + t + 8 * u));
        for (; t + 8 <= L; t += 8) top[0] = max8(top[0], load8(sx + t));
        top[0] = max8(max8(top[0], top[1]), max8(top[2], top[3]));
        float m = -INFINITY;
        for (int j = 0; j < 8; j++) m = top[0][j] > m ? top[0][j] : m;
        for (; t < L; t++) m = sx[t] > m ? sx[t] : m;
        /* Weights by whole vectors, the last one masked past L (its keys
         * weigh exactly 0, which leaves each lane's sum as it was): the same
         * operations, lane by lane, as one key at a time, without a scalar
         * tail, which cost as much as the vectors for short contexts. The
         * scores row is padded to KEY_PAD keys, a multiple of AV_LANES. */
        float lanes[AV_LANES] = {0.f};
        for (t = 0; t < L; t += AV_LANES)
            for (int j = 0; j < AV_LANES; j++) {
                const float w = exp_nonpositive(sx[t + j] - m);
                sx[t + j] = t + j < L ? w : 0.f;
                lanes[j] = lanes[j] + sx[t + j];
            }
        float l8[8]; /* lanes j and j + 8 first, as av_fold8 */
        for (int j = 0; j < 8; j++) l8[j] = lanes[j];
#if AV_LANES == 16
        for (int j = 0; j < 8; j++) l8[j] = l8[j] + lanes[j + 8];
#endif
        inv[x] = 1.f / (((l8[0] + l8[4]) + (l8[1] + l8[5])) + ((l8[2] + l8[6]) + (l8[3] + l8[7])));
    }
    for (size_t i = 0; i < (size_t)heads * D; i++) acc[i] = 0.f;
    const void *vrows[PV_KEYS];
    float vrow_scales[PV_KEYS];
    for (int t0 = 0; t0 < longest; t0 += PV_KEYS) {
        for (int c = 0; c < PV_KEYS && t0 + c < longest; c += 8)
            key_rows(S, vc, table, kvh, KVH, D, t0 + c, longest, widen, 1, vrows + c, vrow_scales + c,
                     widened + (size_t)c * D);
        for (int j = 0; j < nrows; j++) {
            if (t0 >= lengths[j]) continue;
            const int nk = lengths[j] - t0 < PV_KEYS ? lengths[j] - t0 : PV_KEYS;
            for (int g = 0; g < count; g += PV_HEADS) {
                const int np = count - g < PV_HEADS ? count - g : PV_HEADS;
                float *accs[PV_HEADS];
                const float *ps[PV_HEADS];
                for (int h = 0; h < np; h++) {
                    const int x = j * count + g + h;
                    accs[h] = acc + (size_t)x * D;
                    ps[h] = scores + x * Lpad + t0;
                }
                pv_heads(accs, ps, np, vrows, vrow_scales, format, nk, D);
            }
        }
    }
    for (int x = 0; x < heads; x++) {
        float *out = attn + (size_t)(r0 + x / count) * H * D + (size_t)(h0 + x % count) * D;
        for (int d = 0; d < D; d++) out[d] = acc[(size_t)x * D + d] * inv[x];
    }
}

/* q/k norm (Qwen3), RoPE on q and k in place in the qkv row, then k and v into the cache. */
static void position_row(const Model *M, const Step *S, const Layer *Ly, int layer, float *restrict row, int r) {
    const int D = M->head_dim, H = M->num_heads, KVH = M->num_kv_heads, half = D / 2;
    const float *c = M->cos + (size_t)S->positions[r] * D, *s = M->sin + (size_t)S->positions[r] * D;
    for (int h = 0; h < H + KVH; h++) {
        float *x = row + (size_t)h * D;
        const float *norm = h < H ? Ly->q_norm : Ly->k_norm;
        float v[512];
        if (norm) rms_norm_row(x, norm, v, D, M->eps);
        else memcpy(v, x, sizeof(float) * D);
        /* x * cos + rotate_half(x) * sin, as transformers' apply_rotary_pos_emb */
        for (int d = 0; d < half; d++) x[d] = v[d] * c[d] + (-v[d + half]) * s[d];
        for (int d = half; d < D; d++) x[d] = v[d] * c[d] + v[d - half] * s[d];
    }
    const size_t at = (size_t)S->slots[r] * KVH;
    for (int h = 0; h < KVH; h++) {
        kv_store(S, S->k_caches[layer], at + h, row + (size_t)(H + h) * D, D);
        kv_store(S, S->v_caches[layer], at + h, row + (size_t)(H + KVH + h) * D, D);
    }
}

/* ---- the stack --------------------------------------------------------------- */

static void run_layers(const Model *M, const Step *S, float *hidden, const Buffers *B) {
    const int n = S->n, hid = M->hidden, H = M->num_heads, D = M->head_dim, I = M->intermediate;
    const int qkv_w = (H + 2 * M->num_kv_heads) * D;
#if defined(_OPENMP)
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const int nt = 1, t = 0;
#endif
    float *attn_scratch = B->attn_scratch + (size_t)t * B->attn_scratch_floats;
    for (int l = 0; l < M->num_layers; l++) {
        const Layer *Ly = &M->layers[l];
        /* Each `omp for` ends in a barrier; a linear's output is read only after an explicit one. */
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++) {
            rms_norm_row(hidden + (size_t)r * hid, Ly->input_norm, B->normed + (size_t)r * hid, hid, M->eps);
            quantize_input_row(&Ly->qkv, B, B->normed, r);
        }
        linear_thread(&Ly->qkv, B, n, B->qkv, qkv_w, 0, t, nt);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++) position_row(M, S, Ly, l, B->qkv + (size_t)r * qkv_w, r);
        /* One item per group of a sequence's rows (all heads, one kv head after
         * another) when there are enough of them to keep the threads busy: a
         * token's kv heads share cache lines, which the next kv head then
         * finds in L2 instead of both threads fetching them from memory. Else
         * one per (group, kv head): its heads share K/V loads; else one per
         * (group, head). */
        const int G = B->num_groups, kv_group = H / M->num_kv_heads;
        const int per_item = G >= 2 * nt ? H : G * M->num_kv_heads >= 2 * nt ? kv_group : 1;
        const int per_call = per_item < kv_group ? per_item : kv_group;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < G * (H / per_item); item++) {
            const int group = B->group_order[item / (H / per_item)], h0 = item % (H / per_item) * per_item;
            const int r0 = B->group_starts[group], nrows = B->group_starts[group + 1] - r0;
            for (int h = h0; h < h0 + per_item; h += per_call)
                attend(M, S, l, B->qkv, (size_t)qkv_w, B->attn, r0, nrows, h, per_call, attn_scratch);
        }
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++) quantize_input_row(&Ly->o_proj, B, B->attn, r);
        linear_thread(&Ly->o_proj, B, n, hidden, hid, 1, t, nt); /* h = h + attn Wo^T */
#pragma omp barrier
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++) {
            rms_norm_row(hidden + (size_t)r * hid, Ly->post_norm, B->normed + (size_t)r * hid, hid, M->eps);
            quantize_input_row(&Ly->gate_up, B, B->normed, r);
        }
        linear_thread(&Ly->gate_up, B, n, B->gate_up, 2L * I, 0, t, nt);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++) {
            const float *gu = B->gate_up + (size_t)r * 2 * I;
            float *a = B->act + (size_t)r * I;
            for (int i = 0; i < I; i++) a[i] = silu(gu[i]) * gu[I + i];
            quantize_input_row(&Ly->down, B, B->act, r);
        }
        linear_thread(&Ly->down, B, n, hidden, hid, 1, t, nt); /* h = h + act Wd^T */
#pragma omp barrier
    }
}

static int linear_ok(const Linear *L, int in, int out) {
    if (L->in_features != in || L->out_features != out || L->num_parts < 1 || L->num_parts > MAX_PARTS) return 0;
    int next = 0;
    for (int p = 0; p < L->num_parts; p++) {
        if (!tiles_for(L->types[p]) || in % block_elems(L->types[p]) || L->starts[p] != next) return 0;
        next += L->rows[p];
    }
    return next == out;
}

/* Rows x [n, D] written as a cache of `format` writes them (into `cache`, n
 * rows), then read back as attention reads them, times their scale, into
 * out [n, D]: the row format's round trip, for the tests. */
void decoder_kv_round_trip(int format, const float *x, int n, int D, void *cache, float *out) {
    Step S;
    memset(&S, 0, sizeof S);
    S.kv_format = format;
    const fp_mode_t caller = subnormals_off(); /* as decoder_forward runs */
    for (int r = 0; r < n; r++) {
        kv_store(&S, cache, (size_t)r, x + (size_t)r * D, D);
        const uint8_t *row = kv_row_at(&S, cache, (size_t)r, D);
        kv_widen(&S, row, D, kv_scale(&S, row, D), out + (size_t)r * D);
    }
    fp_mode_restore(caller);
}

/* 1 if this build can run the model (shapes the loops above assume), else 0. */
int decoder_model_ok(const Model *M) {
    const int D = M->head_dim, H = M->num_heads, KVH = M->num_kv_heads;
    if (M->num_layers < 1 || D < 8 || D % 8 || D > 512 || KVH < 1 || H % KVH || H / KVH > 64 || M->hidden % 32)
        return 0;
    for (int l = 0; l < M->num_layers; l++) {
        const Layer *Ly = &M->layers[l];
        if (!linear_ok(&Ly->qkv, M->hidden, (H + 2 * KVH) * D) || !linear_ok(&Ly->o_proj, H * D, M->hidden) ||
            !linear_ok(&Ly->gate_up, M->hidden, 2 * M->intermediate) ||
            !linear_ok(&Ly->down, M->intermediate, M->hidden))
            return 0;
        if ((Ly->q_norm == NULL) != (Ly->k_norm == NULL)) return 0;
    }
    return 1;
}

typedef struct {
    long keys;
    int group;
} GroupWork;

static int more_work_first(const void *a, const void *b) {
    const GroupWork *x = a, *y = b;
    if (x->keys != y->keys) return x->keys > y->keys ? -1 : 1;
    return x->group - y->group;
}

/* Attention's groups, the sequences with the most attention work (keys read
 * over their rows) first, each sequence's groups together in their order
 * (malloc'd; NULL if group_starts is). The threads take items in order as
 * they come free: decode rows of 100 to 1000+ keys taken in batch order left
 * one thread waiting at every layer's barrier for the other's last long item;
 * a prompt's groups stay together because each reads the same keys, which
 * the next finds in cache. Which thread serves an item never changes what it
 * computes. */
static int *order_groups(const Step *S, const int *group_starts, int num_groups) {
    if (!group_starts) return NULL;
    int *order = malloc(sizeof(int) * ((size_t)num_groups + 1));
    GroupWork *work = malloc(sizeof(GroupWork) * ((size_t)num_groups + 1));
    if (order && work) {
        for (int first = 0; first < num_groups;) {
            int end = first + 1; /* groups first .. end - 1: one sequence's */
            while (end < num_groups && S->row_seq &&
                   S->row_seq[group_starts[end]] == S->row_seq[group_starts[first]])
                end++;
            long keys = 0;
            for (int r = group_starts[first]; r < group_starts[end]; r++) keys += S->positions[r] + 1;
            for (int g = first; g < end; g++) work[g] = (GroupWork){keys, g};
            first = end;
        }
        qsort(work, (size_t)num_groups, sizeof *work, more_work_first);
        for (int g = 0; g < num_groups; g++) order[g] = work[g].group;
    } else {
        free(order);
        order = NULL;
    }
    free(work);
    return order;
}

/* Places B's buffers for rows rows in block, each 64-byte aligned, and
 * returns the bytes they take (with block NULL, only the bytes). B's
 * attn_scratch_floats and gemm_scratch_size are set first. */
static size_t lay_out(Buffers *B, char *block, const Model *M, size_t rows, int kmax, int num_threads) {
    const int H = M->num_heads, D = M->head_dim, qkv_w = (H + 2 * M->num_kv_heads) * D, I = M->intermediate;
    size_t used = 0;
#define PLACE(field, type, count)                                         \
    B->field = block ? (type *)(void *)(block + used) : NULL;             \
    used += (sizeof(type) * (size_t)(count) + 63) / 64 * 64
    PLACE(normed, float, rows * M->hidden);
    PLACE(qkv, float, rows * qkv_w);
    PLACE(attn, float, rows * H * D);
    PLACE(gate_up, float, rows * 2 * I);
    PLACE(act, float, rows * I);
    PLACE(qs32, int8_t, rows * kmax);
    PLACE(qs256, int8_t, rows * kmax);
    PLACE(d32, float, rows * (kmax / 32));
    PLACE(s32, float, rows * (kmax / 32));
    PLACE(d256, float, rows * (kmax / 32));
    PLACE(s256, float, rows * (kmax / 32));
    PLACE(bsums32, int16_t, rows * (kmax / 16));
    PLACE(bsums256, int16_t, rows * (kmax / 16));
    PLACE(isum32, int16_t, rows * (kmax / 32));
    PLACE(attn_scratch, float, B->attn_scratch_floats * (size_t)num_threads);
    PLACE(gemm_scratch, uint8_t, B->gemm_scratch_size * (size_t)num_threads);
    PLACE(group_starts, int, rows + 1);
#undef PLACE
    return used;
}

/* The buffers of a call stay allocated for the next: a prompt chunk's come to
 * megabytes, and fresh ones came from the kernel on every call, each page
 * faulted in and zeroed again where the linears and row loops first wrote
 * them (half the page faults of an offline prefill, by perf). One block, the
 * largest a call has needed, for one call at a time: a call that finds it
 * taken allocates its own. */
static pthread_mutex_t step_block_lock = PTHREAD_MUTEX_INITIALIZER;
static char *step_block;
static size_t step_block_bytes;

/* The kept block, at least bytes (a multiple of 64) long, held until step_block_give_back; NULL if another call holds it or memory ran out. */
static char *step_block_take(size_t bytes) {
    if (pthread_mutex_trylock(&step_block_lock) != 0) return NULL;
    if (bytes > step_block_bytes) {
        free(step_block);
        step_block = aligned_alloc(64, bytes);
        step_block_bytes = step_block ? bytes : 0;
    }
    if (!step_block) pthread_mutex_unlock(&step_block_lock);
    return step_block;
}

static void step_block_give_back(void) { pthread_mutex_unlock(&step_block_lock); }

/* hidden [n, M->hidden] in, the last layer's output out (in place).
 * Returns 0; 1 when memory ran out; 3 when a position is outside the rotary tables. */
int decoder_forward(const Model *M, const Step *S, float *hidden, int num_threads) {
    const int n = S->n, H = M->num_heads, D = M->head_dim;
    if (n == 0) return 0;
    int max_pos = 0;
    for (int r = 0; r < n; r++) {
        if (S->positions[r] < 0 || S->positions[r] >= M->max_positions) return 3;
        if (S->positions[r] > max_pos) max_pos = (int)S->positions[r];
    }
    if (num_threads < 1) num_threads = 1;
    int kmax = M->hidden > H * D ? M->hidden : H * D;
    kmax = kmax > M->intermediate ? kmax : M->intermediate;
    Buffers B;
    const size_t rows = (size_t)n;
    B.attn_scratch_floats =
        (size_t)ATTEND_ROWS * (H / M->num_kv_heads) *
        (((size_t)max_pos + KEY_PAD) / KEY_PAD * KEY_PAD + (size_t)D + (size_t)D / 2 + 2);
    B.gemm_scratch_size = gemm_scratch_bytes(kmax, n);
    const size_t total = lay_out(&B, NULL, M, rows, kmax, num_threads);
    char *block = step_block_take(total), *own = NULL;
    if (!block) block = own = aligned_alloc(64, total);
    if (!block) return 1;
    lay_out(&B, block, M, rows, kmax, num_threads);
    /* Consecutive rows of one sequence (a prompt chunk, a verification), up to ATTEND_ROWS at a time. */
    B.num_groups = 0;
    for (int r = 0; r < n; r++) {
        const int start = B.num_groups ? B.group_starts[B.num_groups - 1] : 0;
        if (r == 0 || !S->row_seq || S->row_seq[r] != S->row_seq[r - 1] || r - start == ATTEND_ROWS)
            B.group_starts[B.num_groups++] = r;
    }
    B.group_starts[B.num_groups] = n;
    B.group_order = order_groups(S, B.group_starts, B.num_groups);
    const int rc = B.group_order ? 0 : 1;
    if (rc == 0) {
#pragma omp parallel num_threads(num_threads)
        {
            const fp_mode_t caller = subnormals_off();
            run_layers(M, S, hidden, &B);
            fp_mode_restore(caller);
        }
    }
    free(B.group_order);
    if (own)
        free(own);
    else
        step_block_give_back();
    return rc;
}
