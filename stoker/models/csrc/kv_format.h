/* The KV cache's row formats, in one place: their codes, their sizes, how a
 * row is written (encode) and read (decode), and the exp that attention and
 * silu share. Included by paged_attention.c and decoder_layer.c, after
 * ggml_quant.c (its vector types and row helpers), so both read and write a
 * cache the same way.
 *
 * A (token, kv head) row of the cache holds head_dim values: float32, bf16 or
 * fp16, or for a quantized cache one byte each (int8, fp8 e4m3) then the
 * row's float32 scale (stoker/models/kv_quant.py, the Python reference).
 *
 * Adding a format: a code below, its case in kv_row_bytes, kv_encode_row and
 * av_load_kv (and FOR_KV_FORMAT), and its dtype in kv_quant.KV_FORMATS (a test
 * holds the two lists equal).
 */
#ifndef STOKER_KV_FORMAT_H
#define STOKER_KV_FORMAT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* The codes Python passes (kv_quant.KV_FORMATS). */
enum { KV_F32 = 0, KV_INT8 = 1, KV_BF16 = 2, KV_FP8 = 3, KV_F16 = 4 };

/* kv_quant.py's rows: one byte a value, then the row's float32 scale. */
static inline int kv_quantized(int format) { return format == KV_INT8 || format == KV_FP8; }

/* Bytes of one (token, kv head) row of the cache. */
static inline size_t kv_row_bytes(int format, int D) {
    return kv_quantized(format) ? (size_t)D + sizeof(float)
           : format == KV_F32   ? (size_t)D * sizeof(float)
                                : (size_t)D * sizeof(uint16_t);
}

/* A cache row's scale as attention applies it (1 for float rows): it
 * multiplies a key's q.k sum (over the row's values as av_load_kv reads them)
 * and a value row's values. An e4m3 byte is read as the fp16 with the same
 * sign, exponent and mantissa bits, 2^-8 times its value (exact, subnormals
 * included), so an fp8 row's scale carries the 2^8 back: the same products. */
static inline float kv_row_scale(int format, const uint8_t *row, int D) {
    if (!kv_quantized(format)) return 1.f;
    float scale;
    memcpy(&scale, row + D, sizeof scale);
    return format == KV_FP8 ? scale * 256.f : scale;
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


/* ---- encode ------------------------------------------------------------- */

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

/* x [D] into a cache row of `format`: as kv_quant.quantize_rows (scale = max|x| / Q,
 * q = round-half-even(x * (Q / max|x|)), Q = 127 for int8, 448 for e4m3 clamped
 * first) for an int8 or fp8 cache; rounded to nearest even, as torch's
 * .to(torch.bfloat16) / .to(torch.float16), for a bf16 or fp16 one. */
static inline void kv_encode_row(int format, uint8_t *restrict row, const float *restrict x, int D) {
    if (format == KV_F32) {
        memcpy(row, x, sizeof(float) * D);
        return;
    }
    if (format == KV_BF16 || format == KV_F16) {
        uint16_t *restrict h = (uint16_t *)row;
        if (format == KV_BF16)
            for (int d = 0; d < D; d++) h[d] = float_to_bf16(x[d]);
        else
            for (int d = 0; d < D; d++) h[d] = float_to_half(x[d]);
        return;
    }
    const float qmax = format == KV_INT8 ? 127.f : 448.f;
    /* by eight lanes (D % 8 == 0): one lane's max chain was most of position_row */
    const float amax = absmax_row(x, D);
    const float inv = amax > 0.f ? qmax / amax : 0.f, scale = amax / qmax;
    if (format == KV_INT8) {
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

/* ---- decode ------------------------------------------------------------- */

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
static inline void kv_widen(int kv_format, const uint8_t *row, int D, float scale, float *restrict buf) {
#define WIDEN(format) widen_row(row, format, D, scale, buf)
    FOR_KV_FORMAT(kv_format, WIDEN)
#undef WIDEN
}

#endif
