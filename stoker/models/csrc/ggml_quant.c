/* Matrix products straight from GGUF (ggml) quantized weight blocks, for CPUs.
 *
 * The weights stay in their GGUF block layout; each row of x is quantized on
 * the fly, as llama.cpp's CPU backend does: per 32 elements to int8 with an
 * fp32 scale (plus the scaled block sum for the types with a min term), or per
 * 256 elements to Q8_K (int8, fp32 scale, int16 sums of 16) for the K-quants.
 * Within a block the products are integers (exact); across blocks they are
 * summed in fp32 in block order.
 *
 * Batch invariance: output (i, j) is always computed by one call of the tile
 * kernel, whose instruction sequence for one (i, j) pair does not depend on the
 * tile's shape (MR rows of x by NR rows of W just interleave MR * NR such
 * sequences sharing loads) nor on where the tile sits or which thread runs it.
 * So y[i, j] is bit-identical whatever m, the tiling and the thread count. This
 * needs the compiler to keep float operations as written: the library is built
 * with -ffp-contract=off and without -fassociative-math.
 *
 * The SIMD builds (AVX2, AVX-VNNI, AVX-512 VNNI) have a second pair of kernels
 * for every type (AVX2: but Q8_0): a blocked GEMM from 4 rows of x (8 on the
 * 256-bit paths: gemm_serves) and small tiles below that, both computing every
 * output with the same arithmetic (see "exact kernels" below, and exact_k for
 * the K-quants), so the choice by m changes no bit.
 *
 * One source, built once per ISA level with explicit -m flags by
 * stoker/models/quant/kernels.py: portable C, AVX2 (maddubs with the sign
 * trick), AVX-VNNI and AVX-512 VNNI (vpdpbusd on 256-bit vectors).
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_ISA 3
#elif defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_ISA 1
#else
#define QUANT_ISA 0
#endif
#define QUANT_SIMD (QUANT_ISA > 0)

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Asks for the line at p into L2 (hint T1), as the kernels here ask for what
 * they read next from memory (but the GEMM's panels of long rows: see
 * panel_prefetch). Into L1 (T0) the requests held L1's few miss
 * buffers and the prefetch instructions themselves stalled: the one-row
 * products, attention over a long context, the GEMM's and the tiles' weight
 * rows all ran 10-45% slower on Zen 4 (docs/perf/decode-step.md, "Prefetch
 * into L2"; T0 and NTA were worse for the row kernels too). */
ALWAYS_INLINE void prefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }

/* Eight floats (and eight int32): GCC/clang vector extensions, lowered to what
 * the ISA has (a ymm register on AVX2/AVX-512, two xmm on SSE2). Every
 * operation is lane by lane, so code on them does exactly the scalar
 * arithmetic of the same loop written out per element. */
#if defined(__GNUC__) && !defined(__clang__)
/* GCC notes that passing these by value without AVX differs in ABI: the
 * helpers below are static and inlined, so no call ever crosses an ABI. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int8_t i8x8 __attribute__((vector_size(8)));
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, (i32x8){__VA_ARGS__})
#endif

ALWAYS_INLINE f8 load8(const float *p) {
    f8 v;
    memcpy(&v, p, sizeof v);
    return v;
}
ALWAYS_INLINE void store8(float *p, f8 v) { memcpy(p, &v, sizeof v); }
ALWAYS_INLINE f8 select8(i32x8 mask, f8 a, f8 b) { return (f8)(((i32x8)a & mask) | ((i32x8)b & ~mask)); }
#if defined(__AVX2__)
/* vmaxps / vminps return their second operand when the first is not greater
 * (less): unordered and equal (+0 / -0) pairs included, which is exactly the
 * select below, in one instruction instead of a compare and three bit ops. */
ALWAYS_INLINE f8 max8(f8 a, f8 b) { return (f8)_mm256_max_ps((__m256)a, (__m256)b); }
ALWAYS_INLINE f8 min8(f8 a, f8 b) { return (f8)_mm256_min_ps((__m256)a, (__m256)b); }
#else
ALWAYS_INLINE f8 max8(f8 a, f8 b) { return select8(a > b, a, b); }
ALWAYS_INLINE f8 min8(f8 a, f8 b) { return select8(a < b, a, b); }
#endif

/* |v|, by clearing the sign bits. */
ALWAYS_INLINE f8 abs8(f8 v) {
    const i32x8 magnitude = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff,
                             0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
    return (f8)((i32x8)v & magnitude);
}

/* max |x[i]| over n values (n % 8 == 0), 0 for none: eight lanes, then across them. */
ALWAYS_INLINE float absmax_row(const float *x, int n) {
    f8 top = {0.f};
    for (int i = 0; i < n; i += 8) top = max8(top, abs8(load8(x + i)));
    float m = 0.f;
    for (int j = 0; j < 8; j++) m = top[j] > m ? top[j] : m;
    return m;
}

/* Eight vectors' lane totals under op (max8, or + as plus8), one a lane, in
 * the order of vector index: by shuffles across the vectors (24 operations),
 * not a chain of seven per vector. For max and integer sums, whose result
 * does not depend on the order. */
#define LANES_X8(T, OP)                                                                                                \
    ALWAYS_INLINE T lanes_##OP##_x8(const T a[8]) {                                                                   \
        const T b01 = OP(SHUFFLE8(a[0], a[1], 0, 1, 2, 3, 8, 9, 10, 11), SHUFFLE8(a[0], a[1], 4, 5, 6, 7, 12, 13, 14, 15)); \
        const T b23 = OP(SHUFFLE8(a[2], a[3], 0, 1, 2, 3, 8, 9, 10, 11), SHUFFLE8(a[2], a[3], 4, 5, 6, 7, 12, 13, 14, 15)); \
        const T b45 = OP(SHUFFLE8(a[4], a[5], 0, 1, 2, 3, 8, 9, 10, 11), SHUFFLE8(a[4], a[5], 4, 5, 6, 7, 12, 13, 14, 15)); \
        const T b67 = OP(SHUFFLE8(a[6], a[7], 0, 1, 2, 3, 8, 9, 10, 11), SHUFFLE8(a[6], a[7], 4, 5, 6, 7, 12, 13, 14, 15)); \
        const T c0 = OP(SHUFFLE8(b01, b23, 0, 2, 4, 6, 8, 10, 12, 14), SHUFFLE8(b01, b23, 1, 3, 5, 7, 9, 11, 13, 15));    \
        const T c1 = OP(SHUFFLE8(b45, b67, 0, 2, 4, 6, 8, 10, 12, 14), SHUFFLE8(b45, b67, 1, 3, 5, 7, 9, 11, 13, 15));    \
        return OP(SHUFFLE8(c0, c1, 0, 2, 4, 6, 8, 10, 12, 14), SHUFFLE8(c0, c1, 1, 3, 5, 7, 9, 11, 13, 15));              \
    }
ALWAYS_INLINE i32x8 plus8(i32x8 a, i32x8 b) { return a + b; }
LANES_X8(f8, max8)
LANES_X8(i32x8, plus8)
#undef LANES_X8

/* GGMLQuantizationType values. */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* Tile: MR rows of x by NR rows of W. */
#define MR_MAX 4
#define NR_MAX 2
/* Bytes of quantized x revisited per sweep over a thread's weight rows: they stay in L1d. */
#define X_CHUNK_BYTES 16384
/* Bytes of weights swept by all those x chunks before moving on: they stay in L2. */
#define W_BLOCK_BYTES (256 * 1024)

/* The path this build is: QUANT_ISA, or 4 for AVX-512 VNNI with the AMX tiles (amx_tiles.h). */
int ggml_quant_isa(void) {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && QUANT_ISA == 3
    return 4;
#else
    return QUANT_ISA;
#endif
}

ALWAYS_INLINE int block_elems(int type) { return type >= Q4_K ? 256 : 32; }

int ggml_quant_type_size(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

ALWAYS_INLINE float fp16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if QUANT_SIMD
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t u;
    if (exp == 0) {
        const float f = (float)man * 5.9604644775390625e-08f; /* man * 2^-24: exact */
        memcpy(&u, &f, sizeof u);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7F800000u | (man << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* The K-quants' 6-bit sub-block scale and min j (0..7), packed in 12 bytes. */
ALWAYS_INLINE void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* All eight 6-bit scales and mins of a K-quant super-block (scale_min_k4 for
 * j = 0..7), byte j of *sc and *mn, without branches: bytes 0-3 of both are the
 * low 6 bits of the first two words, bytes 4-7 take 4 bits from the third word
 * and their top 2 bits from the top of the first (scales) or second (mins). */
ALWAYS_INLINE void k_scales_mins(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | (((a >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | (((b >> 6) & 0x03030303u) << 4);
    *sc = (uint64_t)(a & 0x3F3F3F3Fu) | ((uint64_t)sc_hi << 32);
    *mn = (uint64_t)(b & 0x3F3F3F3Fu) | ((uint64_t)mn_hi << 32);
}

/* ---- quantized activations ------------------------------------------------ */

typedef struct {
    int8_t *qs;     /* [m, k] */
    float *d;       /* [m, k / block] scales */
    float *s;       /* [m, k / 32] d * sum(qs) per block (types with a min term) */
    int16_t *bsums; /* [m, k / 16] sums of 16 (K-quants) */
    int k;
    int16_t *isum; /* [m, k / 32] sum(qs) per 32 (the GEMM's offset term; K-quants: their mins'), or NULL where no GEMM runs */
} xq_t;

/* Bytes from one row of an xq_t's qs to the next: k and a cache line more, so
 * that the 16 rows an AMX tile loads (and the GEMM's tiles read side by side)
 * do not fall into one L1 set where k is a multiple of 4 KB. */
ALWAYS_INLINE size_t xq_stride(int k) { return (size_t)k + 64; }
/* Rows of x an AMX tile takes (amx_tiles.h); xq_t's qs holds AMX_ROWS - 1 rows
 * more than its product's, which a last group of tiles may load (amx_packed_rows). */
#define AMX_ROWS 16
ALWAYS_INLINE int8_t *xq_row(const xq_t *xq, size_t row) { return xq->qs + row * xq_stride(xq->k); }

/* (y + 1.5 * 2^23) - 1.5 * 2^23 rounds half to even for |y| < 2^22 without
 * libm: vroundps/rint's result in the default rounding mode. Then clamped to
 * +-127 and stored as int8; returns the integers. */
ALWAYS_INLINE i32x8 round_to_int8(f8 y, int8_t *out) {
    const f8 r = min8(max8((y + 12582912.f) - 12582912.f, (f8){0.f} - 127.f), (f8){0.f} + 127.f);
    const i32x8 q = __builtin_convertvector(r, i32x8); /* exact: r is a whole number */
    const i8x8 q8 = __builtin_convertvector(q, i8x8);
    memcpy(out, &q8, sizeof q8);
    return q;
}

/* Blocks b0 .. b0 + 7 of 32 fp32 values of a row, as the loop in quantize_row
 * computes each, with the eight blocks' maxima, scales and sums side by side
 * in lanes: a block alone is a chain of reductions and two divisions (its max
 * over lanes, d, 1 / d, its sum), which left the loop latency-bound at ~2.6
 * cycles a value. */
ALWAYS_INLINE void quantize_32x8(const float *v, int8_t *qs, float *d_out, float *s_out, int16_t *isum_out) {
    f8 block_max[8];
    for (int i = 0; i < 8; i++) {
        f8 a = {0.f};
        for (int e = 0; e < 32; e += 8) a = max8(a, abs8(load8(v + 32 * i + e)));
        block_max[i] = a;
    }
    const f8 d = lanes_max8_x8(block_max) / 127.f;
    const f8 id = select8(d != 0.f, 1.f / d, (f8){0.f});
    i32x8 block_sums[8];
    for (int i = 0; i < 8; i++) {
        i32x8 sum = {0};
        for (int e = 0; e < 32; e += 8) sum += round_to_int8(load8(v + 32 * i + e) * id[i], qs + 32 * i + e);
        block_sums[i] = sum;
    }
    const i32x8 sums = lanes_plus8_x8(block_sums);
    store8(d_out, d);
    store8(s_out, d * __builtin_convertvector(sums, f8));
    if (isum_out)
        for (int i = 0; i < 8; i++) isum_out[i] = (int16_t)sums[i];
}

/* A 256-value block (the K-quants'): one d, each value rounded by
 * round_to_int8, its 16 sums of 16 taken from the rounded integers in lanes
 * (lanes_plus8_x8) instead of read back and added a byte at a time, which
 * made quantize_row ~4% of a 1B prompt's time; and, where isum is given, its
 * 8 sums of 32. */
ALWAYS_INLINE void quantize_256(const float *v, int8_t *qs, float *d_out, int16_t *bsums, int16_t *isum) {
    const float d = absmax_row(v, 256) / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    for (int half = 0; half < 2; half++) {
        i32x8 group_sums[8];
        for (int g = 0; g < 8; g++) {
            const int e = 128 * half + 16 * g;
            group_sums[g] = round_to_int8(load8(v + e) * id, qs + e) + round_to_int8(load8(v + e + 8) * id, qs + e + 8);
        }
        const i32x8 sums = lanes_plus8_x8(group_sums);
        for (int g = 0; g < 8; g++) bsums[8 * half + g] = (int16_t)sums[g];
        if (isum)
            for (int j = 0; j < 4; j++) isum[4 * half + j] = (int16_t)(sums[2 * j] + sums[2 * j + 1]);
    }
    *d_out = d;
}

static void quantize_row(const void *x, int x_bf16, size_t row, int k, int be, const xq_t *xq) {
    const int nb = k / be;
    int8_t *qs = xq_row(xq, row);
    int b = 0;
    for (; !x_bf16 && be == 32 && b + 8 <= nb; b += 8)
        quantize_32x8((const float *)x + row * (size_t)k + (size_t)b * 32, qs + b * 32, xq->d + row * (size_t)nb + b,
                      xq->s + row * (size_t)nb + b, xq->isum ? xq->isum + row * (size_t)nb + b : NULL);
    for (; b < nb; b++) {
        float widened[256];
        const float *v = (const float *)x + row * (size_t)k + (size_t)b * be;
        if (x_bf16) {
            for (int e = 0; e < be; e++) widened[e] = bf16_to_float(((const uint16_t *)x)[row * (size_t)k + (size_t)b * be + e]);
            v = widened;
        }
        if (be == 256) {
            quantize_256(v, qs + b * 256, xq->d + row * (size_t)nb + b, xq->bsums + row * (size_t)(k / 16) + (size_t)b * 16,
                         xq->isum ? xq->isum + row * (size_t)(k / 32) + (size_t)b * 8 : NULL);
            continue;
        }
        const float d = absmax_row(v, be) / 127.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        i32x8 sum8 = {0};
        for (int e = 0; e < be; e += 8) sum8 += round_to_int8(load8(v + e) * id, qs + b * be + e);
        int sum = 0;
        for (int j = 0; j < 8; j++) sum += sum8[j];
        xq->d[row * (size_t)nb + b] = d;
        xq->s[row * (size_t)nb + b] = d * (float)sum;
        if (xq->isum) xq->isum[row * (size_t)nb + b] = (int16_t)sum;
    }
}

/* ---- ISA primitives: 32 quant values, their integer dot with 32 int8 of x,
 *      and the fp32 accumulator ------------------------------------------- */

#if QUANT_SIMD
typedef __m256i vq_t;
typedef __m256i isum_t;
typedef __m256 acc_t;

ALWAYS_INLINE vq_t nibbles32(const uint8_t *qs) { /* 16 bytes: low nibbles are 0..15, high 16..31 */
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}
ALWAYS_INLINE vq_t with_high_bits(vq_t q, const uint8_t *qh) { /* bit j of the u32 -> 0x10 in byte j */
    uint32_t h;
    memcpy(&h, qh, sizeof h);
#if QUANT_ISA == 3 /* the u32 is a byte mask as it stands: one masked add, not six shuffles and compares */
    return _mm256_mask_add_epi8(q, (__mmask32)h, q, _mm256_set1_epi8(0x10)); /* q < 16: + is or */
#else
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                            3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_or_si256(q, _mm256_and_si256(v, _mm256_set1_epi8(0x10)));
#endif
}
ALWAYS_INLINE vq_t minus(vq_t q, int c) { return _mm256_sub_epi8(q, _mm256_set1_epi8((char)c)); }
ALWAYS_INLINE vq_t load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
ALWAYS_INLINE vq_t abs32(vq_t q) { return _mm256_sign_epi8(q, q); }

/* Sum of u8 * s8 products, four adjacent pairs per int32 lane. */
ALWAYS_INLINE isum_t dot_u8s8(__m256i u, __m256i s) {
#if QUANT_ISA == 3
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif QUANT_ISA == 2
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
/* Signed weights: |w| as the unsigned operand, x takes w's sign. */
ALWAYS_INLINE isum_t dot_signed(vq_t q, vq_t aq, const int8_t *x) {
    return dot_u8s8(aq, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), q));
}
ALWAYS_INLINE isum_t dot_unsigned(vq_t q, const int8_t *x) {
    return dot_u8s8(q, _mm256_loadu_si256((const __m256i *)x));
}
/* Unsigned weights times x, each 16-bit pair sum weighted by the int16 in `scales`. */
ALWAYS_INLINE isum_t dot_scaled(vq_t q, const int8_t *x, __m256i scales) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)x)), scales);
}
ALWAYS_INLINE isum_t isum_zero(void) { return _mm256_setzero_si256(); }
ALWAYS_INLINE isum_t isum_add(isum_t a, isum_t b) { return _mm256_add_epi32(a, b); }
/* Sixteen int16 products, summed in pairs: the K-quants' per-16 sums of x times a per-16 weight term. */
ALWAYS_INLINE isum_t dot_i16(const int16_t *a, const int16_t *b) {
    return _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a), _mm256_loadu_si256((const __m256i *)b));
}
ALWAYS_INLINE isum_t isum_sub_times32(isum_t a, isum_t b) { return _mm256_sub_epi32(a, _mm256_slli_epi32(b, 5)); }
ALWAYS_INLINE acc_t acc_zero(void) { return _mm256_setzero_ps(); }
typedef __m256 scale_t; /* a float broadcast, so a product of scales is one vmulps */
ALWAYS_INLINE scale_t scale_of(float v) { return _mm256_set1_ps(v); }
ALWAYS_INLINE scale_t scale_mul(scale_t a, scale_t b) { return _mm256_mul_ps(a, b); }
ALWAYS_INLINE acc_t acc_add(acc_t acc, scale_t scale, isum_t p) {
    return _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc);
}
/* A float term (the min's) goes into lane 0, keeping all of a dot product's state in one register. */
ALWAYS_INLINE acc_t acc_add_scalar(acc_t acc, float v) {
    return _mm256_add_ps(acc, _mm256_setr_ps(v, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f));
}
ALWAYS_INLINE float acc_total(acc_t v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* Q6_K's two int16 scales per 32 values: lower 16 take lo, upper 16 take hi. */
ALWAYS_INLINE __m256i scales_pair(int lo, int hi) {
    return _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo));
}
ALWAYS_INLINE __m256i scale_one(int s) { return _mm256_set1_epi16((short)s); }
ALWAYS_INLINE vq_t q6_chunk(const uint8_t *ql, const uint8_t *qh, int hi_nibble, int shift) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    __m256i lo = _mm256_loadu_si256((const __m256i *)ql);
    if (hi_nibble) lo = _mm256_srli_epi16(lo, 4);
    const __m256i h = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)qh), shift), m2);
    return _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_slli_epi16(h, 4));
}
ALWAYS_INLINE vq_t q5k_chunk(const uint8_t *qs, const uint8_t *qh, int hi_nibble, int bit) {
    __m256i lo = _mm256_loadu_si256((const __m256i *)qs);
    if (hi_nibble) lo = _mm256_srli_epi16(lo, 4);
    lo = _mm256_and_si256(lo, _mm256_set1_epi8(0x0F));
    if (!qh) return lo;
    const __m256i h = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)qh), bit),
                                       _mm256_set1_epi8(0x01));
    return _mm256_or_si256(lo, _mm256_slli_epi16(h, 4));
}

#else /* portable */
typedef struct {
    int8_t v[32];
} vq_t;
typedef int32_t isum_t;
typedef float acc_t;

ALWAYS_INLINE vq_t nibbles32(const uint8_t *qs) {
    vq_t q;
    for (int j = 0; j < 16; j++) {
        q.v[j] = (int8_t)(qs[j] & 0x0F);
        q.v[j + 16] = (int8_t)(qs[j] >> 4);
    }
    return q;
}
ALWAYS_INLINE vq_t with_high_bits(vq_t q, const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, sizeof h);
    for (int j = 0; j < 32; j++) q.v[j] = (int8_t)(q.v[j] | (((h >> j) & 1u) << 4));
    return q;
}
ALWAYS_INLINE vq_t minus(vq_t q, int c) {
    for (int j = 0; j < 32; j++) q.v[j] = (int8_t)(q.v[j] - c);
    return q;
}
ALWAYS_INLINE vq_t load32(const uint8_t *p) {
    vq_t q;
    memcpy(q.v, p, 32);
    return q;
}
ALWAYS_INLINE vq_t abs32(vq_t q) { return q; }
ALWAYS_INLINE isum_t dot_plain(const vq_t *q, const int8_t *x, int from, int to) {
    int32_t s = 0;
    for (int j = from; j < to; j++) s += (int32_t)q->v[j] * x[j];
    return s;
}
ALWAYS_INLINE isum_t dot_signed(vq_t q, vq_t aq, const int8_t *x) {
    (void)aq;
    return dot_plain(&q, x, 0, 32);
}
ALWAYS_INLINE isum_t dot_unsigned(vq_t q, const int8_t *x) { return dot_plain(&q, x, 0, 32); }
typedef struct {
    int lo, hi;
} scales_t;
ALWAYS_INLINE isum_t dot_scaled(vq_t q, const int8_t *x, scales_t sc) {
    return sc.lo * dot_plain(&q, x, 0, 16) + sc.hi * dot_plain(&q, x, 16, 32);
}
ALWAYS_INLINE isum_t isum_zero(void) { return 0; }
ALWAYS_INLINE isum_t isum_add(isum_t a, isum_t b) { return a + b; }
ALWAYS_INLINE isum_t dot_i16(const int16_t *a, const int16_t *b) {
    int32_t s = 0;
    for (int g = 0; g < 16; g++) s += (int32_t)a[g] * b[g];
    return s;
}
ALWAYS_INLINE isum_t isum_sub_times32(isum_t a, isum_t b) { return a - 32 * b; }
ALWAYS_INLINE acc_t acc_zero(void) { return 0.f; }
typedef float scale_t;
ALWAYS_INLINE scale_t scale_of(float v) { return v; }
ALWAYS_INLINE scale_t scale_mul(scale_t a, scale_t b) { return a * b; }
ALWAYS_INLINE acc_t acc_add(acc_t acc, scale_t scale, isum_t p) { return acc + scale * (float)p; }
ALWAYS_INLINE acc_t acc_add_scalar(acc_t acc, float v) { return acc + v; }
ALWAYS_INLINE float acc_total(acc_t v) { return v; }
ALWAYS_INLINE scales_t scales_pair(int lo, int hi) { return (scales_t){lo, hi}; }
ALWAYS_INLINE scales_t scale_one(int s) { return (scales_t){s, s}; }
ALWAYS_INLINE vq_t q6_chunk(const uint8_t *ql, const uint8_t *qh, int hi_nibble, int shift) {
    vq_t q;
    for (int l = 0; l < 32; l++) {
        const int lo = hi_nibble ? ql[l] >> 4 : ql[l] & 0x0F;
        q.v[l] = (int8_t)(lo | (((qh[l] >> shift) & 3) << 4));
    }
    return q;
}
ALWAYS_INLINE vq_t q5k_chunk(const uint8_t *qs, const uint8_t *qh, int hi_nibble, int bit) {
    vq_t q;
    for (int l = 0; l < 32; l++) {
        const int lo = hi_nibble ? qs[l] >> 4 : qs[l] & 0x0F;
        q.v[l] = (int8_t)(lo | (qh ? ((qh[l] >> bit) & 1) << 4 : 0));
    }
    return q;
}
#endif

#if QUANT_SIMD
typedef __m256i scales_t;
#endif

/* ---- one weight block, unpacked once per tile and reused for its MR rows of x */

typedef struct {
    vq_t q, aq; /* quant values (signed types: centred), |q| for the sign trick */
    float d, m;
} w32_t;

ALWAYS_INLINE int has_min32(int type) { return type == Q4_1 || type == Q5_1; }
ALWAYS_INLINE int is_signed32(int type) { return type == Q4_0 || type == Q5_0 || type == Q8_0; }

ALWAYS_INLINE void unpack32(const int type, const uint8_t *b, w32_t *w) {
    w->d = fp16_at(b);
    w->m = 0.f;
    switch (type) {
    case Q4_0: w->q = minus(nibbles32(b + 2), 8); break;
    case Q4_1: w->m = fp16_at(b + 2); w->q = nibbles32(b + 4); break;
    case Q5_0: w->q = minus(with_high_bits(nibbles32(b + 6), b + 2), 16); break;
    case Q5_1: w->m = fp16_at(b + 2); w->q = with_high_bits(nibbles32(b + 8), b + 4); break;
    default: w->q = load32(b + 2); break; /* Q8_0 */
    }
    if (is_signed32(type)) w->aq = abs32(w->q);
}

typedef struct {
    vq_t q[8];        /* 256 unsigned quant values, 32 per entry */
    scales_t sc[8];   /* the integer scale(s) of each entry's values */
    int16_t sc16[16]; /* Q6_K: signed scale per 16 values (its -32 offset goes through bsums) */
    int16_t mins16[16]; /* Q4_K, Q5_K: 6-bit min per 32 values, once per 16 (to pair with x's sums of 16) */
    float d, dmin;
} wk_t;

/* Q4_K / Q5_K sub-block j (0..7) of super-block sb: its 32 unsigned values, element e in byte e. */
ALWAYS_INLINE vq_t k_values(int type, const uint8_t *sb, int j) {
    const uint8_t *qh = type == Q5_K ? sb + 16 : NULL, *qs = type == Q5_K ? sb + 48 : sb + 16;
    return q5k_chunk(qs + 32 * (j >> 1), qh, j & 1, j);
}

/* Q6_K chunk j (0..7, values 32j .. 32j + 31) of super-block sb: 6-bit values as bytes. */
ALWAYS_INLINE vq_t q6_values(const uint8_t *sb, int j) {
    const int half = j >> 2, c = j & 3;
    return q6_chunk(sb + 64 * half + 32 * (c & 1), sb + 128 + 32 * half, c >> 1, 2 * c);
}

ALWAYS_INLINE void unpackk(const int type, const uint8_t *b, wk_t *w) {
    if (type == Q6_K) {
        const int8_t *sc = (const int8_t *)(b + 192);
        w->d = fp16_at(b + 208);
        w->dmin = 0.f;
        for (int j = 0; j < 8; j++) {
            w->q[j] = q6_values(b, j);
            w->sc[j] = scales_pair(sc[2 * j], sc[2 * j + 1]);
        }
        for (int g = 0; g < 16; g++) w->sc16[g] = sc[g];
        return;
    }
    /* Q4_K, Q5_K */
    w->d = fp16_at(b);
    w->dmin = fp16_at(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        scale_min_k4(b + 4, j, &sc, &mn);
        w->q[j] = k_values(type, b, j);
        w->sc[j] = scale_one(sc);
        w->mins16[2 * j] = w->mins16[2 * j + 1] = (int16_t)mn;
    }
}

/* ---- tile kernels ---------------------------------------------------------- */

/* Ask for `bytes` from p in the weight rows PREFETCH_ROWS on, where the thread
 * reads next what a tile reads at p now (a thread takes its weight rows in
 * order, a few at a time, each row row_bytes long). Tiles stream 2 to 8 rows
 * side by side, each a few hundred bytes to a few KB, so the hardware
 * prefetcher barely learns one stream before it ends, and in a decode step,
 * whose weights come from memory, most loads would wait on DRAM. (A fixed
 * +1024 bytes landed inside rows the tile already streams.) One-row products of
 * a weight larger than the caches on Zen 4, docs/perf/k-quants/prefetch.txt:
 * AVX-512 Q4_1 1.8x, Q6_K 2.3x, Q4_K 1.35x; AVX2 Q4_1 2.4x, Q6_K 2.7x, Q4_K 1.9x.
 * Only the tile of x's first row asks: the others find the rows in cache.
 * The tile kernels ask as they go only for one or two rows of x (m <= 2): in
 * their 3- and 4-row tiles the same asking cost an AVX2 Q4_K prefill 20%, so
 * for m > 2 matmul_thread asks for a pair's rows at once before its tiles.
 * Into L2 (prefetch_l2; into L1: 0.5B Q5_0 gate+up one row 21.6 rather than
 * 26.8 GB/s, 8B down Q4_K 27.3 rather than 32.9, the 0.5B's Q8_0 LM head at 3
 * rows 14.5 rather than 20.1). */
#define PREFETCH_ROWS 8
ALWAYS_INLINE void prefetch_ahead(const uint8_t *p, size_t row_bytes, int bytes) {
    for (int l = 0; l < bytes; l += 64) prefetch_l2(p + PREFETCH_ROWS * row_bytes + (size_t)l);
}

ALWAYS_INLINE void tile32(const int type, const int MR, const int NR, const uint8_t *w, size_t row_bytes,
                          const xq_t *xq, size_t i0, float *res) {
    const int ts = ggml_quant_type_size(type), k = xq->k, nb = k / 32;
    const int has_min = has_min32(type);
    acc_t acc[MR_MAX][NR_MAX];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = acc_zero();
    for (int b = 0; b < nb; b++) {
        w32_t wb[NR_MAX];
        scale_t wd[NR_MAX];
        for (int j = 0; j < NR; j++) {
            if (MR <= 2 && i0 == 0) prefetch_ahead(w + j * row_bytes + (size_t)b * ts, row_bytes, 1);
            unpack32(type, w + j * row_bytes + (size_t)b * ts, &wb[j]);
            wd[j] = scale_of(wb[j].d);
        }
        for (int i = 0; i < MR; i++) {
            const size_t row = i0 + i;
            const int8_t *x = xq_row(xq, row) + (size_t)b * 32;
            const scale_t dx = scale_of(xq->d[row * nb + b]);
            for (int j = 0; j < NR; j++) {
                const isum_t p = is_signed32(type) ? dot_signed(wb[j].q, wb[j].aq, x) : dot_unsigned(wb[j].q, x);
                acc[i][j] = acc_add(acc[i][j], scale_mul(wd[j], dx), p);
                if (has_min) acc[i][j] = acc_add_scalar(acc[i][j], wb[j].m * xq->s[row * nb + b]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) res[i * NR_MAX + j] = acc_total(acc[i][j]);
}

ALWAYS_INLINE void tilek(const int type, const int MR, const int NR, const uint8_t *w, size_t row_bytes,
                         const xq_t *xq, size_t i0, float *res) {
    const int ts = ggml_quant_type_size(type), k = xq->k, nb = k / 256;
    acc_t acc[MR_MAX][NR_MAX];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = acc_zero();
    for (int b = 0; b < nb; b++) {
        wk_t wb[NR_MAX];
        scale_t wd[NR_MAX], wdmin[NR_MAX];
        for (int j = 0; j < NR; j++) {
            if (MR <= 2 && i0 == 0) prefetch_ahead(w + j * row_bytes + (size_t)b * ts, row_bytes, ts);
            unpackk(type, w + j * row_bytes + (size_t)b * ts, &wb[j]);
            wd[j] = scale_of(wb[j].d);
            wdmin[j] = scale_of(-wb[j].dmin);
        }
        for (int i = 0; i < MR; i++) {
            const size_t row = i0 + i;
            const int8_t *x = xq_row(xq, row) + (size_t)b * 256;
            const int16_t *bs = xq->bsums + row * (k / 16) + (size_t)b * 16;
            const scale_t dxs = scale_of(xq->d[row * nb + b]);
            for (int j = 0; j < NR; j++) {
                isum_t p = isum_zero();
                for (int c = 0; c < 8; c++) p = isum_add(p, dot_scaled(wb[j].q[c], x + 32 * c, wb[j].sc[c]));
                if (type == Q6_K) { /* q - 32: the offset times x's sums of 16, in integers */
                    p = isum_sub_times32(p, dot_i16(wb[j].sc16, bs));
                    acc[i][j] = acc_add(acc[i][j], scale_mul(wd[j], dxs), p);
                } else {
                    acc[i][j] = acc_add(acc[i][j], scale_mul(wd[j], dxs), p);
                    acc[i][j] = acc_add(acc[i][j], scale_mul(wdmin[j], dxs), dot_i16(wb[j].mins16, bs));
                }
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++)
            res[i * NR_MAX + j] = acc_total(acc[i][j]);
}

/* One function per (type, MR, NR), so every loop bound above is a constant. */
#define TILE_FN(T, MR, NR)                                                                                   \
    static void tile_##T##_##MR##_##NR(const uint8_t *w, size_t rb, const xq_t *xq, size_t i0, float *res) { \
        if (block_elems(T) == 32) tile32(T, MR, NR, w, rb, xq, i0, res);                                     \
        else tilek(T, MR, NR, w, rb, xq, i0, res);                                                           \
    }
#define TILES_OF(T) \
    TILE_FN(T, 1, 1) TILE_FN(T, 2, 1) TILE_FN(T, 3, 1) TILE_FN(T, 4, 1) TILE_FN(T, 1, 2) TILE_FN(T, 2, 2) TILE_FN(T, 3, 2) TILE_FN(T, 4, 2)
TILES_OF(Q4_0)
TILES_OF(Q4_1)
TILES_OF(Q5_0)
TILES_OF(Q5_1)
TILES_OF(Q8_0)
TILES_OF(Q4_K)
TILES_OF(Q5_K)
TILES_OF(Q6_K)

typedef void (*tile_fn)(const uint8_t *, size_t, const xq_t *, size_t, float *);
#define TABLE_OF(T)                                                                                          \
    {tile_##T##_1_1, tile_##T##_1_2, tile_##T##_2_1, tile_##T##_2_2, tile_##T##_3_1, tile_##T##_3_2, tile_##T##_4_1, \
     tile_##T##_4_2}

static const tile_fn *tiles_for(int type) {
    static const tile_fn t40[] = TABLE_OF(Q4_0), t41[] = TABLE_OF(Q4_1), t50[] = TABLE_OF(Q5_0),
                         t51[] = TABLE_OF(Q5_1), t80[] = TABLE_OF(Q8_0), t4k[] = TABLE_OF(Q4_K),
                         t5k[] = TABLE_OF(Q5_K), t6k[] = TABLE_OF(Q6_K);
    switch (type) {
    case Q4_0: return t40;
    case Q4_1: return t41;
    case Q5_0: return t50;
    case Q5_1: return t51;
    case Q8_0: return t80;
    case Q4_K: return t4k;
    case Q5_K: return t5k;
    case Q6_K: return t6k;
    default: return NULL;
    }
}

/* y[row, j0 .. j0 + count - 1] from vals: plus bias, then stored as fp32 or bf16,
 * or added to y (a residual add in the same fp32 operation torch's `residual + y` performs). */
ALWAYS_INLINE void write_row(void *y, size_t row, long y_stride, int j0, const float *vals, int count, int y_bf16,
                             const float *bias, int accumulate) {
    for (int j = 0; j < count; j++) {
        const size_t at = row * (size_t)y_stride + (size_t)(j0 + j);
        float v = vals[j];
        if (bias) v = v + bias[j0 + j];
        if (y_bf16) ((uint16_t *)y)[at] = float_to_bf16(v);
        else if (accumulate) ((float *)y)[at] = ((float *)y)[at] + v;
        else ((float *)y)[at] = v;
    }
}

/* Thread t of nt's share of y = x @ W^T (+ bias) for already quantized x: a
 * contiguous range of weight-row pairs, taken in L2-sized blocks, each swept by
 * the rows of x in L1-sized chunks. The split depends only on n and nt, and
 * each y[i, j] comes from one tile call whatever the split (see the top), so
 * results do not depend on it. y is fp32, or bf16 when y_bf16. With bias,
 * y[i, j] = dot + bias[j]; with accumulate (fp32 only), y[i, j] += dot: a
 * residual add in the same fp32 operation torch's `residual + y` performs.
 * Shared by ggml_quant_matmul and the fused decoder (decoder_layer.c). */
static void matmul_thread(const tile_fn *tiles, const uint8_t *w, size_t row_bytes, const xq_t *xq, int m, int n,
                          void *y, long y_stride, int y_bf16, const float *bias, int accumulate, int t, int nt) {
    const int k = xq->k;
    const int pairs = (n + NR_MAX - 1) / NR_MAX;
    const int lo = (int)((long)pairs * t / nt), hi = (int)((long)pairs * (t + 1) / nt);
    const int m_chunk = X_CHUNK_BYTES / k > MR_MAX ? X_CHUNK_BYTES / k / MR_MAX * MR_MAX : MR_MAX;
    const long fit = W_BLOCK_BYTES / (NR_MAX * (long)row_bytes);
    const int w_pairs = fit > 1 ? (int)fit : 1;
    for (int p_block = lo; p_block < hi; p_block += w_pairs) {
        const int p_end = p_block + w_pairs < hi ? p_block + w_pairs : hi;
        for (int i_chunk = 0; i_chunk < m; i_chunk += m_chunk) {
            const int i_end = i_chunk + m_chunk < m ? i_chunk + m_chunk : m;
            for (int p = p_block; p < p_end; p++) {
                const int j0 = p * NR_MAX, nr = n - j0 < NR_MAX ? n - j0 : NR_MAX;
                const uint8_t *wp = w + (size_t)j0 * row_bytes;
                if (m > 2 && i_chunk == 0) prefetch_ahead(wp, row_bytes, (int)(nr * row_bytes)); /* see tile32 */
                for (int i0 = i_chunk; i0 < i_end; i0 += MR_MAX) {
                    const int mr = i_end - i0 < MR_MAX ? i_end - i0 : MR_MAX;
                    float res[MR_MAX * NR_MAX];
                    tiles[(mr - 1) * NR_MAX + (nr - 1)](wp, row_bytes, xq, (size_t)i0, res);
                    for (int i = 0; i < mr; i++)
                        write_row(y, (size_t)(i0 + i), y_stride, j0, res + i * NR_MAX, nr, y_bf16, bias, accumulate);
                }
            }
        }
    }
}

/* ---- exact kernels: a blocked GEMM and small tiles (the SIMD builds) ----
 *
 * Why: the tile kernels above unpack a weight block for at most MR_MAX rows of
 * x and spend ~5 vector instructions per 32 multiply-adds: right for one
 * decoding row, ~5x below what the cores can do on a prefill chunk or a large
 * decode batch. The GEMM unpacks a panel of GEMM_PANEL weight rows (32 on
 * AVX-512, 16 on AVX2) once into VNNI order (for each 4 k-values, the panel's
 * bytes side by side) and sweeps every row of x over it, each vpdpbusd doing a
 * multiply-add per column and k-value (64 on AVX-512; on AVX2 without VNNI,
 * maddubs + madd do the 32 of a 256-bit vpdpbusd).
 *
 * For the 32-value block types both kernels compute output (i, j) as: per 32-block b, the exact
 * integer dot isum of x's int8 with the block's values, then in fp32, block by
 * block in order,
 *     acc = fma(float(isum) * d_w, d_x, acc);   acc = fma(m_w, s_x, acc)  (Q4_1, Q5_1)
 * with no other rounding (one lane of a vector per output). The GEMM takes
 * the weights as unsigned bytes (the stored value plus the type's offset) and
 * x as signed, and takes the offset back out in integers (isum - offset *
 * sum(x)); the tiles take signed values with the sign trick. Same integer,
 * same float operations: so whichever kernel serves a call (by m alone), each
 * output is bit-identical, and batch invariance holds across the switch. */
#if QUANT_SIMD
#define EXACT_KERNELS 1
/* The GEMM's registers: GEMM_MR rows of x by two vectors of columns, an int32
 * and an fp32 accumulator each. AVX-512 has 32 registers of 16 lanes: 6 rows
 * by 32 columns. AVX2 has 16 of 8 lanes: 3 rows by 16 columns (12
 * accumulators, two weight vectors and a broadcast of x). The arithmetic per
 * output is the same either way: one lane's. */
#if QUANT_ISA == 3
#define GEMM_LANES 16
#define GEMM_MR 6
typedef __m512i gemm_i;
typedef __m512 gemm_f;
#define GV_LOAD_I(p) _mm512_loadu_si512((const void *)(p))
#define GV_LOAD_F(p) _mm512_loadu_ps(p)
#define GV_STORE_F(p, v) _mm512_storeu_ps(p, v)
#define GV_ADD_F(a, b) _mm512_add_ps(a, b)
#define GV_SET1_I(v) _mm512_set1_epi32(v)
#define GV_SET1_F(v) _mm512_set1_ps(v)
#define GV_ZERO_I() _mm512_setzero_si512()
#define GV_ZERO_F() _mm512_setzero_ps()
#define GV_ADD_I(a, b) _mm512_add_epi32(a, b)
#define GV_MULLO_I(a, b) _mm512_mullo_epi32(a, b)
#define GV_CVT(a) _mm512_cvtepi32_ps(a)
#define GV_MUL_F(a, b) _mm512_mul_ps(a, b)
#define GV_FMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define GV_DPBUSD(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define GV_DPWSSD(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define GEMM_LANES 8
#define GEMM_MR 3
typedef __m256i gemm_i;
typedef __m256 gemm_f;
#define GV_LOAD_I(p) _mm256_loadu_si256((const __m256i *)(p))
#define GV_LOAD_F(p) _mm256_loadu_ps(p)
#define GV_STORE_F(p, v) _mm256_storeu_ps(p, v)
#define GV_ADD_F(a, b) _mm256_add_ps(a, b)
#define GV_SET1_I(v) _mm256_set1_epi32(v)
#define GV_SET1_F(v) _mm256_set1_ps(v)
#define GV_ZERO_I() _mm256_setzero_si256()
#define GV_ZERO_F() _mm256_setzero_ps()
#define GV_ADD_I(a, b) _mm256_add_epi32(a, b)
#define GV_MULLO_I(a, b) _mm256_mullo_epi32(a, b)
#define GV_CVT(a) _mm256_cvtepi32_ps(a)
#define GV_MUL_F(a, b) _mm256_mul_ps(a, b)
#define GV_FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#if QUANT_ISA == 2
#define GV_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define GV_DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#else
/* maddubs sums two u8 * s8 products in int16: exact while the unsigned values
 * stay below 128 (127 * 127 * 2 fits), which holds for every type but Q8_0
 * (stored + 128): AVX2 builds leave Q8_0 to the tile kernels (exact_serves). */
#define GV_DPBUSD(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define GV_DPWSSD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif
#endif
#define GEMM_PANEL (2 * GEMM_LANES)

/* write_row for a tile's row held as two vectors (GEMM_PANEL columns from j0).
 * Whole fp32 rows go as vectors, in write_row's order of additions (bias, then
 * the residual): its loop over elements compiled to a memcpy (rep movsq), 5% of
 * a 16-row decode step. */
ALWAYS_INLINE void write_vectors(void *y, size_t row, long y_stride, int j0, gemm_f v0, gemm_f v1, int cols,
                                 int y_bf16, const float *bias, int accumulate) {
    if (cols == GEMM_PANEL && !y_bf16) {
        float *at = (float *)y + row * (size_t)y_stride + j0;
        if (bias) v0 = GV_ADD_F(v0, GV_LOAD_F(bias + j0)), v1 = GV_ADD_F(v1, GV_LOAD_F(bias + j0 + GEMM_LANES));
        if (accumulate) v0 = GV_ADD_F(GV_LOAD_F(at), v0), v1 = GV_ADD_F(GV_LOAD_F(at + GEMM_LANES), v1);
        GV_STORE_F(at, v0);
        GV_STORE_F(at + GEMM_LANES, v1);
        return;
    }
    float vals[GEMM_PANEL];
    GV_STORE_F(vals, v0);
    GV_STORE_F(vals + GEMM_LANES, v1);
    write_row(y, row, y_stride, j0, vals, cols, y_bf16, bias, accumulate);
}
/* Rows of x from which the GEMM serves a call, every type alike: below, the
 * small tiles (each weight block unpacked once per pair of rows) beat one
 * unpack of each panel for all rows. Since the K-quants' panel unpack works a
 * super-block at a time (4a71a63) and the tiles ask for the next panels' rows
 * (gemm_thread), the GEMM wins from 4 rows on Zen 4 with AVX-512, weights from
 * memory: 1.3-1.6x at 5-7 rows, 1.5-2.2x at 8-11 (the K-quants' tiles, once
 * kept to 11 rows and Q6_K's to 12), and at 4 (two passes of pair tiles, each
 * unpacking every weight block) 1.2-1.3x on the LM heads, Q4_K gate+up and
 * Q6_K down, level on Q4_K down; a whole 4-row decode step of the 1B rung
 * 1.2-1.3x (docs/perf/decode-step.md, "Four rows"). At 3 rows the tiles (a
 * pair and one row) stay: the GEMM was level or behind there (Q4_K gate+up
 * and down 15-20% behind). The 256-bit GEMM
 * (16 columns, 3 rows a tile) was measured only built for AVX2 on that Zen 4:
 * ahead of the tiles from 8 rows for the K-quants too (Q6_K 1.4x, Q4_K 1.2x
 * at 8); below 8 it was not measured there, so it keeps 8. Scratch is sized
 * by this (gemm_scratch_bytes). Four rows of Q6_K, where the streamed row
 * kernels serve, go to them instead (rows_take_four). */
#if QUANT_ISA == 3
#define GEMM_MIN_ROWS 4
#else
#define GEMM_MIN_ROWS 8
#endif

/* Q4_K and Q5_K: every value is d * sc * q - dmin * mn with q unsigned, sc and
 * mn 6-bit integers per 32 values, d and dmin per 256. Their exact kernels sum
 * per 256-value super-block, in integers, P = sum over sub-blocks of sc * dot
 * and M = sum of mn * (x's sum over the sub-block), then in fp32
 *     acc = fma(float(P) * d_w, d_x, acc);   acc = fma(float(M) * -dmin_w, d_x, acc)
 * with x rounded to int8 per 256 (as the tile kernels take it). Both integers
 * are exact whatever the summation order, so the GEMM and the small tiles
 * agree bit for bit here too.
 *
 * Q6_K: value d * sc * (q - 32), q 6-bit, sc a signed 8-bit scale per 16
 * values: P = sum over 16-value groups of sc * dot - 32 * sum of sc * (x's sum
 * over the group), in integers, then acc = fma(float(P) * d_w, d_x, acc). */
ALWAYS_INLINE int exact_k(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

ALWAYS_INLINE int exact_serves(int type) {
    return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || (type == Q8_0 && QUANT_ISA != 1) ||
           exact_k(type);
}
ALWAYS_INLINE int gemm_serves(int m) { return m >= GEMM_MIN_ROWS; }
ALWAYS_INLINE int gemm_offset(int type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q8_0 ? 128 : 0; }

/* A block's 32 stored values as unsigned bytes (value + gemm_offset), element e in byte e. */
ALWAYS_INLINE __m256i stored32(int type, const uint8_t *b) {
    switch (type) {
    case Q4_0: return nibbles32(b + 2);
    case Q4_1: return nibbles32(b + 4);
    case Q5_0: return with_high_bits(nibbles32(b + 6), b + 2);
    case Q5_1: return with_high_bits(nibbles32(b + 8), b + 4);
    default: return _mm256_xor_si256(load32(b + 2), _mm256_set1_epi8((char)0x80)); /* Q8_0: q + 128 */
    }
}

/* The GEMM's requests for weight rows ahead (the unpack's eight rows on, the
 * tiles' panels ahead): into L2 (prefetch_l2) while an unpacked panel takes at
 * most 256 KB (a quarter of this Zen 4's L2, half a Zen 3's); into L1, at 4-8
 * rows of x the products read their weights 10-45% slower. Panels of longer
 * rows (the 8B's down, k = 14336) keep L1: sent to L2, the rows asked for
 * evicted the panel being swept (Q6_K down 30% slower). */
#define PANEL_PREFETCH_L2_BYTES (256 * 1024)
ALWAYS_INLINE void panel_prefetch(const void *p, int nb) {
    if ((size_t)nb * 32 * GEMM_PANEL <= PANEL_PREFETCH_L2_BYTES) prefetch_l2(p);
    else __builtin_prefetch(p);
}

/* Q4_K / Q5_K's M of one row of x and a super-block, for two column vectors, from the
 * mins of sub-blocks 2i and 2i + 1 as int16 pairs (mins[i][v], as gemm_unpack_k stores
 * them): two sub-blocks a vpdpwssd against x's sums of 32 (sums32: the super-block's 8,
 * xq_t's isum, made once by quantize_row: summed from the sums of 16 per row,
 * tile and panel, they took ~40 scalar instructions of each row's fp32 step,
 * as many as its vector ones, and AMX tiles' products waited on them). */
ALWAYS_INLINE void k_mins_dots(const int16_t *sums32, const gemm_i mins[4][2], gemm_i mm[2]) {
    mm[0] = mm[1] = GV_ZERO_I();
    for (int i = 0; i < 4; i++) {
        int32_t pair; /* sub-blocks 2i and 2i + 1: int16 lanes as vpdpwssd pairs them */
        memcpy(&pair, sums32 + 2 * i, sizeof pair);
        const gemm_i xs = GV_SET1_I(pair);
        mm[0] = GV_DPWSSD(mm[0], mins[i][0], xs);
        mm[1] = GV_DPWSSD(mm[1], mins[i][1], xs);
    }
}

/* Bytes of one unpacked panel of k elements a column. */
ALWAYS_INLINE size_t gemm_panel_bytes(int k) {
    return (size_t)k * GEMM_PANEL + 2 * sizeof(float) * ((size_t)(k / 32) + (size_t)(k / 256)) * GEMM_PANEL;
}

/* A later panel's weight rows, asked for while this panel's tiles run: at 8-16
 * rows of x the unpack's own asking (eight rows ahead) left most of a step's
 * time with no weight bytes in flight, the tiles computing while nothing was
 * fetched, and then the unpack waiting on memory (the LM head's product at 16
 * rows spent ~40% of its time in the unpack). Block b of a tile's nb asks
 * for its even share of the tile's `lines` cache lines from `ahead` (none when
 * ahead is NULL). */
typedef struct {
    const uint8_t *ahead;
    size_t lines;
} panel_ahead_t;
/* Share `tile` of `tiles`: its even share of the `lines` cache lines from
 * `ahead`, the panel PANELS_AHEAD on (none when ahead is NULL). */
ALWAYS_INLINE panel_ahead_t ahead_share(const uint8_t *ahead, size_t lines, size_t tile, size_t tiles) {
    const size_t from = lines * tile / tiles, to = lines * (tile + 1) / tiles;
    return (panel_ahead_t){ahead ? ahead + 64 * from : NULL, to - from};
}
ALWAYS_INLINE void prefetch_share(panel_ahead_t pf, int b, int nb) {
    if (!pf.ahead) return;
    const panel_ahead_t share = ahead_share(pf.ahead, pf.lines, (size_t)b, (size_t)nb);
    for (size_t l = 0; l < share.lines; l++) panel_prefetch(share.ahead + 64 * l, nb);
}
/* prefetch_share into L2 whatever the row length, for share b of `shares`: the
 * AMX tiles' packed panels (amx_planes_q4_k_sb, amx_planes_q6_k_sb) sweep one
 * super-block's planes in L1, not an unpacked panel in L2, so no panel of theirs
 * is evicted by what they ask for. Into L1 (panel_prefetch past 256 KB), the
 * prefetches themselves stalled: the 1B's Q6_K LM head at 16 rows ran 1.7x as long. */
ALWAYS_INLINE void prefetch_share_l2(panel_ahead_t pf, int b, int shares) {
    if (!pf.ahead) return;
    const panel_ahead_t share = ahead_share(pf.ahead, pf.lines, (size_t)b, (size_t)shares);
    for (size_t l = 0; l < share.lines; l++) prefetch_l2(share.ahead + 64 * l);
}

#include "amx_tiles.h"

/* Bytes of one thread's GEMM scratch for m rows of k elements: none below
 * GEMM_MIN_ROWS, else one unpacked panel, and where the AMX tiles can serve m
 * rows (of a K-quant, packed or not) its planes. */
static size_t gemm_scratch_bytes(int k, int m) {
    if (m < GEMM_MIN_ROWS) return 0;
    return gemm_panel_bytes(k) + (amx_packed_rows(Q4_K, m) ? amx_planes_bytes(k) : 0);
}

/* The fp16 d (and, Q4_1/Q5_1, m) at the start of each weight row's block at
 * offset off, as by_column(dw, NR) and by_column(mw, NR) would hold them: the
 * NR dwords gathered once and converted by vector (exact, as the scalar
 * conversion is) instead of 2 * NR scalar conversions and inserts, which
 * competed with the dots' shuffles for one port. */
ALWAYS_INLINE void block_scales(const int NR, const uint8_t *const *wr, size_t off, __m256 *d, __m256 *m) {
    uint32_t dm[8];
    for (int j = 0; j < NR; j++) memcpy(&dm[j], wr[j] + off, sizeof dm[j]);
    /* Per 128-bit lane: the dwords' low halves (d) to bytes 0-7, high halves (m) to 8-15. */
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9,
                                           12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    if (NR == 8) {
        const __m256i v = _mm256_setr_epi32((int)dm[0], (int)dm[1], (int)dm[2], (int)dm[3], (int)dm[4], (int)dm[5],
                                            (int)dm[6], (int)dm[7]);
        const __m256i halves = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), 0xD8); /* d0-7 | m0-7 */
        *d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
        *m = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
    } else { /* NR == 4: lanes q and q + 4 both column q */
        const __m128i v = _mm_shuffle_epi8(_mm_setr_epi32((int)dm[0], (int)dm[1], (int)dm[2], (int)dm[3]),
                                           _mm256_castsi256_si128(split));
        const __m128 d4 = _mm_cvtph_ps(v), m4 = _mm_cvtph_ps(_mm_unpackhi_epi64(v, v));
        *d = _mm256_set_m128(d4, d4);
        *m = _mm256_set_m128(m4, m4);
    }
}

/* Eight 32-blocks' values (16 packed bytes at blocks[c] + qs_at: element e < 16
 * the low nibble of byte e, e >= 16 the high nibble of byte e - 16; Q5_0 / Q5_1
 * also bit e of the u32 at blocks[c] + qh_at as the value's 0x10, qh_at < 0 for
 * none) into the panel's eight dword rows at dst, as gemm_unpack lays out
 * stored32's bytes: dword t of the unpacked block is the low nibbles of packed
 * dword t for t < 4 and their high nibbles for t >= 4, so transposing the 16
 * packed bytes by dwords and splitting nibbles afterwards gives the same
 * panel with a third of the shuffles (8 instead of 8 inserts and 24: the
 * port they share with vpdpbusd, in a decode step that unpacks every weight).
 * Row t holds elements 4t .. 4t + 3 of each column, so its fifth bits are bits
 * 4t .. 4t + 3 of each column's u32: byte t / 2 of it, spread to the column's
 * four bytes by one shuffle for rows 2i and 2i + 1. Against one column at a
 * time (stored32, then the 24-shuffle transpose), the 0.5B rung's Q5_0 gate+up
 * from L3 runs 10% faster at 4 rows, 8% at 8 and 5% at 16 with AVX-512. */
ALWAYS_INLINE void nibble_panel(const uint8_t *const blocks[8], int qs_at, int qh_at, uint8_t *dst) {
    __m256i y[4]; /* columns c and c + 4 */
    for (int c = 0; c < 4; c++)
        y[c] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(blocks[c + 4] + qs_at)),
                                _mm_loadu_si128((const __m128i *)(blocks[c] + qs_at)));
    /* per 128-bit lane, columns (0, 1) | (4, 5): packed dwords 0, 1 and 2, 3; then (2, 3) | (6, 7) */
    const __m256i a0 = _mm256_unpacklo_epi32(y[0], y[1]), a1 = _mm256_unpackhi_epi32(y[0], y[1]);
    const __m256i a2 = _mm256_unpacklo_epi32(y[2], y[3]), a3 = _mm256_unpackhi_epi32(y[2], y[3]);
    const __m256i packed[4] = {_mm256_unpacklo_epi64(a0, a2), _mm256_unpackhi_epi64(a0, a2),
                               _mm256_unpacklo_epi64(a1, a3), _mm256_unpackhi_epi64(a1, a3)};
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i rows[8];
    for (int t = 0; t < 4; t++) {
        rows[t] = _mm256_and_si256(packed[t], low);
        rows[t + 4] = _mm256_and_si256(_mm256_srli_epi16(packed[t], 4), low);
    }
    if (qh_at >= 0) {
        uint32_t h[8];
        for (int c = 0; c < 8; c++) memcpy(&h[c], blocks[c] + qh_at, sizeof h[c]);
        /* dword c of qh: column c's u32, in the panel's column order (c0 .. c0 + 7) */
        const __m256i qh = _mm256_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3], (int)h[4], (int)h[5],
                                             (int)h[6], (int)h[7]);
        const __m256i low_bits = _mm256_set1_epi32(0x08040201), high_bits = _mm256_set1_epi32((int)0x80402010);
        const __m256i columns = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4,
                                                 4, 8, 8, 8, 8, 12, 12, 12, 12);
        for (int i = 0; i < 4; i++) {
            /* byte i of each column's u32 in all four of its bytes */
            const __m256i spread = _mm256_shuffle_epi8(qh, _mm256_add_epi8(columns, _mm256_set1_epi8((char)i)));
            for (int odd = 0; odd < 2; odd++) {
                const int t = 2 * i + odd;
                const __m256i bit = odd ? high_bits : low_bits;
#if QUANT_ISA == 3
                rows[t] = _mm256_mask_add_epi8(rows[t], _mm256_test_epi8_mask(spread, bit), rows[t],
                                               _mm256_set1_epi8(0x10));
#else
                const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
                rows[t] = _mm256_or_si256(rows[t], _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
#endif
            }
        }
    }
    for (int t = 0; t < 8; t++) _mm256_storeu_si256((__m256i *)(dst + (size_t)t * 4 * GEMM_PANEL), rows[t]);
}

/* v[c] dword t -> v[t] dword c: eight columns' 32 bytes into the panel's eight dword rows. */
ALWAYS_INLINE void transpose_dwords(__m256i v[8]) {
    const __m256i a0 = _mm256_unpacklo_epi32(v[0], v[1]), a1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i a2 = _mm256_unpacklo_epi32(v[2], v[3]), a3 = _mm256_unpackhi_epi32(v[2], v[3]);
    const __m256i a4 = _mm256_unpacklo_epi32(v[4], v[5]), a5 = _mm256_unpackhi_epi32(v[4], v[5]);
    const __m256i a6 = _mm256_unpacklo_epi32(v[6], v[7]), a7 = _mm256_unpackhi_epi32(v[6], v[7]);
    const __m256i b0 = _mm256_unpacklo_epi64(a0, a2), b1 = _mm256_unpackhi_epi64(a0, a2);
    const __m256i b2 = _mm256_unpacklo_epi64(a1, a3), b3 = _mm256_unpackhi_epi64(a1, a3);
    const __m256i b4 = _mm256_unpacklo_epi64(a4, a6), b5 = _mm256_unpackhi_epi64(a4, a6);
    const __m256i b6 = _mm256_unpacklo_epi64(a5, a7), b7 = _mm256_unpackhi_epi64(a5, a7);
    v[0] = _mm256_permute2x128_si256(b0, b4, 0x20), v[1] = _mm256_permute2x128_si256(b1, b5, 0x20);
    v[2] = _mm256_permute2x128_si256(b2, b6, 0x20), v[3] = _mm256_permute2x128_si256(b3, b7, 0x20);
    v[4] = _mm256_permute2x128_si256(b0, b4, 0x31), v[5] = _mm256_permute2x128_si256(b1, b5, 0x31);
    v[6] = _mm256_permute2x128_si256(b2, b6, 0x31), v[7] = _mm256_permute2x128_si256(b3, b7, 0x31);
}

/* The 32 bytes at `at` of each of eight blocks, transposed by dwords (transpose_dwords). */
ALWAYS_INLINE void transposed_bytes(const uint8_t *const blocks[8], int at, __m256i v[8]) {
    for (int c = 0; c < 8; c++) v[c] = _mm256_loadu_si256((const __m256i *)(blocks[c] + at));
    transpose_dwords(v);
}

/* Eight rows of eight bytes (rows[c], byte j) to eight rows of eight (out[j], byte c): the
 * K-quants' per-sub-block scales of eight columns, from one row per column to one per sub-block. */
ALWAYS_INLINE void transpose_bytes8(const uint64_t rows[8], __m128i out[4]) {
    const __m128i t0 = _mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)rows[0]), _mm_cvtsi64_si128((long long)rows[1]));
    const __m128i t1 = _mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)rows[2]), _mm_cvtsi64_si128((long long)rows[3]));
    const __m128i t2 = _mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)rows[4]), _mm_cvtsi64_si128((long long)rows[5]));
    const __m128i t3 = _mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)rows[6]), _mm_cvtsi64_si128((long long)rows[7]));
    const __m128i u0 = _mm_unpacklo_epi16(t0, t1), u1 = _mm_unpackhi_epi16(t0, t1);
    const __m128i u2 = _mm_unpacklo_epi16(t2, t3), u3 = _mm_unpackhi_epi16(t2, t3);
    /* out[q]: sub-blocks 2q (low 8 bytes) and 2q + 1 (high 8) */
    out[0] = _mm_unpacklo_epi32(u0, u2), out[1] = _mm_unpackhi_epi32(u0, u2);
    out[2] = _mm_unpacklo_epi32(u1, u3), out[3] = _mm_unpackhi_epi32(u1, u3);
}

/* The 8 x 8 bytes of transpose_bytes8 widened to int32 (signed or not) at dst[j * GEMM_PANEL], eight a row. */
ALWAYS_INLINE void store_scales8(const __m128i t[4], int is_signed, int32_t *dst) {
    for (int q = 0; q < 4; q++) {
        const __m128i lo = t[q], hi = _mm_unpackhi_epi64(t[q], t[q]);
        _mm256_storeu_si256((__m256i *)(dst + (size_t)(2 * q) * GEMM_PANEL),
                            is_signed ? _mm256_cvtepi8_epi32(lo) : _mm256_cvtepu8_epi32(lo));
        _mm256_storeu_si256((__m256i *)(dst + (size_t)(2 * q + 1) * GEMM_PANEL),
                            is_signed ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi));
    }
}

/* Eight columns' unsigned bytes a[c] and b[c] (the low 8 bytes of each) as int16
 * pairs: dword c = a[c] | b[c] << 16, at dst. */
ALWAYS_INLINE void store_pairs8(__m128i a, __m128i b, int32_t *dst) {
    const __m128i a16 = _mm_cvtepu8_epi16(a), b16 = _mm_cvtepu8_epi16(b);
    _mm_storeu_si128((__m128i *)dst, _mm_unpacklo_epi16(a16, b16));
    _mm_storeu_si128((__m128i *)(dst + 4), _mm_unpackhi_epi16(a16, b16));
}

/* gemm_unpack_as for the K-quants, super-block by super-block for eight columns
 * at a time: the same panel, built with a third to a half of the work. The
 * values' bit operations act byte by byte and the transpose moves whole dwords,
 * so each stored 32-byte stretch (Q4_K and Q5_K: two sub-blocks' nibbles and all
 * eight sub-blocks' fifth bits; Q6_K: two chunks' low nibbles, four chunks' top
 * bits) is transposed once and split after, not transposed again per sub-block;
 * the 6-bit scales and mins of all eight sub-blocks are decoded at once per
 * column and transposed as bytes; d and dmin of eight columns are converted
 * together (block_scales). */
ALWAYS_INLINE void gemm_unpack_k(const int type, const uint8_t *w, size_t row_bytes, int cols, int nb,
                                 uint8_t *scratch) {
    static const uint8_t zero_superblock[256] = {0}; /* columns past cols */
    const int ts = ggml_quant_type_size(type), nsb = nb / 8;
    int32_t *sc_k = (int32_t *)(scratch + (size_t)nb * 32 * GEMM_PANEL), *mn_k = sc_k + (size_t)nb * GEMM_PANEL;
    float *d_k = (float *)(mn_k + (size_t)nb * GEMM_PANEL), *dmin_k = d_k + (size_t)nsb * GEMM_PANEL;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int c0 = 0; c0 < GEMM_PANEL; c0 += 8) {
        for (int sb = 0; sb < nsb; sb++) {
            const uint8_t *blocks[8];
            for (int c = 0; c < 8; c++) {
                blocks[c] = c0 + c < cols ? w + (size_t)(c0 + c) * row_bytes + (size_t)sb * ts : zero_superblock;
                /* the same super-block of the row eight on (see gemm_unpack_as) */
                const uint8_t *ahead = w + (size_t)(c0 + 8 + c) * row_bytes + (size_t)sb * ts;
                for (int l = 0; l < ts; l += 64) panel_prefetch(ahead + l, nb);
                panel_prefetch(ahead + ts - 1, nb);
            }
            __m128i t[4];
            uint64_t sc8[8], mn8[8];
            __m256 dv, mv;
            if (type == Q6_K) { /* sc_k, mn_k: the scales of each chunk's lower and upper 16 values */
                const __m128i evens_odds = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
                for (int c = 0; c < 8; c++) {
                    const __m128i s = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blocks[c] + 192)), evens_odds);
                    sc8[c] = (uint64_t)_mm_cvtsi128_si64(s);
                    mn8[c] = (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(s, s));
                }
                block_scales(8, blocks, 206, &mv, &dv); /* the dword at 206: d in its high half, in the block */
                _mm256_storeu_ps(d_k + (size_t)sb * GEMM_PANEL + c0, dv);
                _mm256_storeu_ps(dmin_k + (size_t)sb * GEMM_PANEL + c0, _mm256_setzero_ps());
            } else {
                for (int c = 0; c < 8; c++) k_scales_mins(blocks[c] + 4, &sc8[c], &mn8[c]);
                block_scales(8, blocks, 0, &dv, &mv);
                _mm256_storeu_ps(d_k + (size_t)sb * GEMM_PANEL + c0, dv);
                _mm256_storeu_ps(dmin_k + (size_t)sb * GEMM_PANEL + c0, _mm256_xor_ps(mv, _mm256_set1_ps(-0.f)));
            }
            const int is_signed = type == Q6_K;
            __m128i tm[4];
            transpose_bytes8(sc8, t);
            store_scales8(t, is_signed, sc_k + (size_t)sb * 8 * GEMM_PANEL + c0);
            transpose_bytes8(mn8, tm);
            if (type == Q6_K)
                store_scales8(tm, is_signed, mn_k + (size_t)sb * 8 * GEMM_PANEL + c0);
            else /* sub-blocks 2i and 2i + 1's mins: mn_k row sb * 4 + i */
                for (int i = 0; i < 4; i++)
                    store_pairs8(tm[i], _mm_unpackhi_epi64(tm[i], tm[i]), mn_k + (size_t)(sb * 4 + i) * GEMM_PANEL + c0);
            uint8_t *dst = scratch + (size_t)sb * 8 * 32 * GEMM_PANEL + (size_t)c0 * 4;
            __m256i high[8], lo[8];
            if (type == Q6_K) {
                for (int half = 0; half < 2; half++) {
                    transposed_bytes(blocks, 128 + 32 * half, high);
                    for (int piece = 0; piece < 2; piece++) {
                        transposed_bytes(blocks, 64 * half + 32 * piece, lo);
                        for (int nibble = 0; nibble < 2; nibble++) {
                            const int chunk = 2 * nibble + piece, shift = 2 * chunk;
                            uint8_t *out = dst + (size_t)(4 * half + chunk) * 32 * GEMM_PANEL;
                            for (int q = 0; q < 8; q++) {
                                const __m256i l4 = _mm256_and_si256(nibble ? _mm256_srli_epi16(lo[q], 4) : lo[q], low4);
                                const __m256i h2 = _mm256_and_si256(_mm256_srli_epi16(high[q], shift), _mm256_set1_epi8(0x03));
                                _mm256_storeu_si256((__m256i *)(out + (size_t)q * 4 * GEMM_PANEL),
                                                    _mm256_or_si256(l4, _mm256_slli_epi16(h2, 4)));
                            }
                        }
                    }
                }
                continue;
            }
            if (type == Q5_K) transposed_bytes(blocks, 16, high);
            const int qs_at = type == Q5_K ? 48 : 16;
            for (int pair = 0; pair < 4; pair++) {
                transposed_bytes(blocks, qs_at + 32 * pair, lo);
                for (int nibble = 0; nibble < 2; nibble++) {
                    const int j = 2 * pair + nibble;
                    uint8_t *out = dst + (size_t)j * 32 * GEMM_PANEL;
                    for (int q = 0; q < 8; q++) {
                        __m256i v = _mm256_and_si256(nibble ? _mm256_srli_epi16(lo[q], 4) : lo[q], low4);
                        if (type == Q5_K) {
                            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(high[q], j), _mm256_set1_epi8(0x01));
                            v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
                        }
                        _mm256_storeu_si256((__m256i *)(out + (size_t)q * 4 * GEMM_PANEL), v);
                    }
                }
            }
        }
    }
}

/* Weight rows w[0 .. cols-1] (cols <= GEMM_PANEL) into the panel: q [nb][8][PANEL][4]
 * bytes, then d and m [nb][PANEL] floats (Q4_K, Q5_K: sc [nb][PANEL] int32, an
 * area mn of [nb][PANEL] dwords whose first nb / 2 rows hold the mins of
 * sub-blocks 2i and 2i + 1 as an int16 pair per column (row sb * 4 + i), then
 * d and -dmin [nb / 8][PANEL] floats; Q6_K: the scales of each chunk's lower
 * and upper 16 values in place of sc and mn); columns past cols are zero.
 * Eight columns at a time: their blocks' 8 dwords (4 values each) transposed in registers
 * (the K-quants' super-blocks in gemm_unpack_k). */
ALWAYS_INLINE void gemm_unpack_as(const int type, const uint8_t *w, size_t row_bytes, int cols, int nb,
                                  uint8_t *scratch) {
    static const uint8_t zero_block[24] = {0}; /* columns past cols: d = m = 0 (and the 4- and 5-bit types' values 0) */
    if (exact_k(type)) {
        gemm_unpack_k(type, w, row_bytes, cols, nb, scratch);
        return;
    }
    const int ts = ggml_quant_type_size(type), has_min = has_min32(type);
    float *d = (float *)(scratch + (size_t)nb * 32 * GEMM_PANEL), *mn = d + (size_t)nb * GEMM_PANEL;
    for (int c0 = 0; c0 < GEMM_PANEL; c0 += 8) {
        for (int b = 0; b < nb; b++) {
            __m256i v[8];
            const uint8_t *blocks[8];
            /* The same stretch of the next eight rows (past the panel's last eight, the
             * next panel's first): rows of a few hundred bytes end before the hardware
             * prefetcher has learned them, and a decode step reads each weight from memory. */
            for (int c = 0; c < 8; c++)
                panel_prefetch(w + (size_t)(c0 + 8 + c) * row_bytes + (size_t)b * row_bytes / (size_t)nb, nb);
            if (type != Q8_0) { /* transposed while packed: see nibble_panel */
                for (int c = 0; c < 8; c++)
                    blocks[c] = c0 + c < cols ? w + (size_t)(c0 + c) * row_bytes + (size_t)b * ts : zero_block;
                __m256 dv, mv;
                block_scales(8, blocks, 0, &dv, &mv);
                _mm256_storeu_ps(d + b * GEMM_PANEL + c0, dv);
                _mm256_storeu_ps(mn + b * GEMM_PANEL + c0, has_min ? mv : _mm256_setzero_ps());
                /* each of these blocks ends with its 16 packed bytes, Q5_0 / Q5_1's u32 of fifth bits just before */
                const int qs_at = ts - 16, qh_at = type == Q5_0 || type == Q5_1 ? qs_at - 4 : -1;
                nibble_panel(blocks, qs_at, qh_at, scratch + (size_t)b * 32 * GEMM_PANEL + (size_t)c0 * 4);
                continue;
            }
            for (int c = 0; c < 8; c++) {
                const int col = c0 + c;
                v[c] = _mm256_setzero_si256();
                blocks[c] = zero_block;
                if (col < cols) {
                    blocks[c] = w + (size_t)col * row_bytes + (size_t)b * ts;
                    v[c] = stored32(type, blocks[c]);
                }
            }
            __m256 dv, mv; /* the eight columns' d (and m) converted together */
            block_scales(8, blocks, 0, &dv, &mv);
            _mm256_storeu_ps(d + b * GEMM_PANEL + c0, dv);
            _mm256_storeu_ps(mn + b * GEMM_PANEL + c0, has_min ? mv : _mm256_setzero_ps());
            transpose_dwords(v);
            uint8_t *dst = scratch + (size_t)b * 32 * GEMM_PANEL + (size_t)c0 * 4;
            for (int t = 0; t < 8; t++) _mm256_storeu_si256((__m256i *)(dst + (size_t)t * 4 * GEMM_PANEL), v[t]);
        }
    }
}

/* gemm_unpack_as compiled once per type (its branches on the type fold away):
 * one body for all left the K-quants' loop ~7% slower once the Q4 path was added. */
static void gemm_unpack(int type, const uint8_t *w, size_t row_bytes, int cols, int nb, uint8_t *scratch) {
#define UNPACK_AS(T)                                                                                                   \
    case T: gemm_unpack_as(T, w, row_bytes, cols, nb, scratch); break;
    switch (type) {
        UNPACK_AS(Q4_0)
        UNPACK_AS(Q4_1)
        UNPACK_AS(Q5_0)
        UNPACK_AS(Q5_1)
        UNPACK_AS(Q8_0)
        UNPACK_AS(Q4_K)
        UNPACK_AS(Q5_K)
        UNPACK_AS(Q6_K)
    default: break;
    }
#undef UNPACK_AS
}

/* s[r] += the dots of x's rows (values 4t .. 4t + 3 of block b) with the two column vectors w0, w1. */
ALWAYS_INLINE void gemm_dot_rows(const int MR, const int8_t *const *x, int b, int t, gemm_i w0, gemm_i w1,
                                 gemm_i s[GEMM_MR][2]) {
    for (int r = 0; r < MR; r++) {
        int32_t four;
        memcpy(&four, x[r] + (size_t)b * 32 + 4 * t, sizeof four);
        const gemm_i xb = GV_SET1_I(four);
        s[r][0] = GV_DPBUSD(s[r][0], w0, xb);
        s[r][1] = GV_DPBUSD(s[r][1], w1, xb);
    }
}

/* s[r] += the dots of x's rows with the panel's values t0*4 .. t1*4 - 1 of block b. */
ALWAYS_INLINE void gemm_dots(const int MR, const int8_t *const *x, int b, const uint8_t *q, int t0, int t1,
                             gemm_i s[GEMM_MR][2]) {
    for (int t = t0; t < t1; t++)
        gemm_dot_rows(MR, x, b, t, GV_LOAD_I(q + t * 4 * GEMM_PANEL), GV_LOAD_I(q + t * 4 * GEMM_PANEL + 4 * GEMM_LANES),
                      s);
}

/* MR (<= GEMM_MR) rows of x (at[]) by the unpacked panel: out[r][0] its first GEMM_LANES columns, out[r][1] the rest. */
ALWAYS_INLINE void gemm_tile(const int MR, const xq_t *xq, const size_t *at, int nb, int offset, int has_min,
                             const uint8_t *scratch, panel_ahead_t pf, gemm_f out[GEMM_MR][2]) {
    const float *d = (const float *)(scratch + (size_t)nb * 32 * GEMM_PANEL), *mn = d + (size_t)nb * GEMM_PANEL;
    const int8_t *x[GEMM_MR];
    for (int r = 0; r < MR; r++) {
        x[r] = xq_row(xq, at[r]);
        out[r][0] = out[r][1] = GV_ZERO_F();
    }
    for (int b = 0; b < nb; b++) {
        gemm_i s[GEMM_MR][2];
        for (int r = 0; r < MR; r++)
            s[r][0] = s[r][1] = GV_SET1_I(offset ? -offset * (int)xq->isum[at[r] * (size_t)nb + b] : 0);
        prefetch_share(pf, b, nb);
        gemm_dots(MR, x, b, scratch + (size_t)b * 32 * GEMM_PANEL, 0, 8, s);
        const gemm_f d0 = GV_LOAD_F(d + b * GEMM_PANEL), d1 = GV_LOAD_F(d + b * GEMM_PANEL + GEMM_LANES);
        for (int r = 0; r < MR; r++) {
            const gemm_f dx = GV_SET1_F(xq->d[at[r] * (size_t)nb + b]);
            out[r][0] = GV_FMADD(GV_MUL_F(GV_CVT(s[r][0]), d0), dx, out[r][0]);
            out[r][1] = GV_FMADD(GV_MUL_F(GV_CVT(s[r][1]), d1), dx, out[r][1]);
        }
        if (has_min) {
            const gemm_f m0 = GV_LOAD_F(mn + b * GEMM_PANEL), m1 = GV_LOAD_F(mn + b * GEMM_PANEL + GEMM_LANES);
            for (int r = 0; r < MR; r++) {
                const gemm_f sx = GV_SET1_F(xq->s[at[r] * (size_t)nb + b]);
                out[r][0] = GV_FMADD(m0, sx, out[r][0]);
                out[r][1] = GV_FMADD(m1, sx, out[r][1]);
            }
        }
    }
}

/* p[r] += s[r] * the integer scales (sc0, sc1) of the panel's two column vectors (then s is zeroed). */
ALWAYS_INLINE void gemm_scale_into(const int MR, const gemm_i sc0, const gemm_i sc1, gemm_i s[GEMM_MR][2],
                                   gemm_i p[GEMM_MR][2]) {
    for (int r = 0; r < MR; r++) {
        p[r][0] = GV_ADD_I(p[r][0], GV_MULLO_I(s[r][0], sc0));
        p[r][1] = GV_ADD_I(p[r][1], GV_MULLO_I(s[r][1], sc1));
        s[r][0] = s[r][1] = GV_ZERO_I();
    }
}

/* gemm_tile for the K-quants: per super-block, the integers P and M (see
 * exact_k), then their fp32 terms. The terms of x's sums cost no vpmulld of
 * their own: Q4_K and Q5_K's M takes one vpdpwssd per two sub-blocks (mins
 * against x's sums of 32, int16 pairs), and Q6_K's -32 offset rides in each
 * group's dot, which starts from -32 * x's sum instead of zero. As a vpmulld
 * and a vpaddd per product they cost a 512-row Q4_K product ~20% and Q6_K's
 * ~30% of its time on Zen 4 (docs/perf/quantized.md, "Prefill on the 3B rung"). */
ALWAYS_INLINE void gemm_tile_k(const int type, const int MR, const xq_t *xq, const size_t *at, int nb, const uint8_t *scratch,
                               panel_ahead_t pf, gemm_f out[GEMM_MR][2]) {
    const int k = xq->k, nsb = nb / 8;
    const int32_t *sc = (const int32_t *)(scratch + (size_t)nb * 32 * GEMM_PANEL), *mn = sc + (size_t)nb * GEMM_PANEL;
    const float *d = (const float *)(mn + (size_t)nb * GEMM_PANEL), *dmin = d + (size_t)nsb * GEMM_PANEL;
    const int8_t *x[GEMM_MR];
    for (int r = 0; r < MR; r++) {
        x[r] = xq_row(xq, at[r]);
        out[r][0] = out[r][1] = GV_ZERO_F();
    }
    for (int sb = 0; sb < nsb; sb++) {
        gemm_i p[GEMM_MR][2];
        for (int r = 0; r < MR; r++) p[r][0] = p[r][1] = GV_ZERO_I();
        gemm_i s[GEMM_MR][2];
        for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = GV_ZERO_I();
        /* Q6_K: each 16-value group's dot starts from -32 * x's sum over the group, so
         * the scaled sum is P itself (its -32 offset taken with the scale's vpmulld). */
        int32_t offset32[GEMM_MR][16];
        if (type == Q6_K)
            for (int r = 0; r < MR; r++) {
                const int16_t *bs = xq->bsums + at[r] * (size_t)(k / 16) + (size_t)sb * 16;
                for (int g = 0; g < 16; g++) offset32[r][g] = -32 * (int32_t)bs[g];
            }
        for (int j = 0; j < 8; j++) {
            const int b = sb * 8 + j;
            const uint8_t *q = scratch + (size_t)b * 32 * GEMM_PANEL;
            prefetch_share(pf, b, nb);
            const int32_t *scb = sc + (size_t)b * GEMM_PANEL;
            if (type == Q6_K) { /* a scale per 16 values: the lower 16 with sc, the upper with mn */
                const int32_t *mnb = mn + (size_t)b * GEMM_PANEL;
                for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = GV_SET1_I(offset32[r][2 * j]);
                gemm_dots(MR, x, b, q, 0, 4, s);
                gemm_scale_into(MR, GV_LOAD_I(scb), GV_LOAD_I(scb + GEMM_LANES), s, p);
                for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = GV_SET1_I(offset32[r][2 * j + 1]);
                gemm_dots(MR, x, b, q, 4, 8, s);
                gemm_scale_into(MR, GV_LOAD_I(mnb), GV_LOAD_I(mnb + GEMM_LANES), s, p);
            } else {
                gemm_dots(MR, x, b, q, 0, 8, s);
                gemm_scale_into(MR, GV_LOAD_I(scb), GV_LOAD_I(scb + GEMM_LANES), s, p);
            }
        }
        const gemm_f d0 = GV_LOAD_F(d + sb * GEMM_PANEL), d1 = GV_LOAD_F(d + sb * GEMM_PANEL + GEMM_LANES);
        const gemm_f m0 = GV_LOAD_F(dmin + sb * GEMM_PANEL), m1 = GV_LOAD_F(dmin + sb * GEMM_PANEL + GEMM_LANES);
        gemm_i mins[4][2];
        for (int i = 0; i < 4 && type != Q6_K; i++) {
            mins[i][0] = GV_LOAD_I(mn + (size_t)(sb * 4 + i) * GEMM_PANEL);
            mins[i][1] = GV_LOAD_I(mn + (size_t)(sb * 4 + i) * GEMM_PANEL + GEMM_LANES);
        }
        for (int r = 0; r < MR; r++) {
            const gemm_f dx = GV_SET1_F(xq->d[at[r] * (size_t)nsb + sb]);
            if (type == Q6_K) {
                out[r][0] = GV_FMADD(GV_MUL_F(GV_CVT(p[r][0]), d0), dx, out[r][0]);
                out[r][1] = GV_FMADD(GV_MUL_F(GV_CVT(p[r][1]), d1), dx, out[r][1]);
                continue;
            }
            /* M, two sub-blocks a vpdpwssd: their mins against x's sums of 32 (at most 32 * 128, an int16) */
            gemm_i mm[2];
            k_mins_dots(xq->isum + at[r] * (size_t)(k / 32) + (size_t)sb * 8, (const gemm_i(*)[2])mins, mm);
            out[r][0] = GV_FMADD(GV_MUL_F(GV_CVT(p[r][0]), d0), dx, out[r][0]);
            out[r][1] = GV_FMADD(GV_MUL_F(GV_CVT(p[r][1]), d1), dx, out[r][1]);
            out[r][0] = GV_FMADD(GV_MUL_F(GV_CVT(mm[0]), m0), dx, out[r][0]);
            out[r][1] = GV_FMADD(GV_MUL_F(GV_CVT(mm[1]), m1), dx, out[r][1]);
        }
    }
}

/* The GEMM's tile for each row count 1 .. GEMM_MR: every loop over rows has a
 * constant bound, so the rows past the last full tile compute no row twice
 * (16 rows once took three tiles of 6, the last repeating a row twice). One
 * output's arithmetic is one lane's whatever MR. */
typedef void (*gemm_tile_fn)(int type, const xq_t *xq, const size_t *at, int nb, const uint8_t *scratch,
                             panel_ahead_t pf, gemm_f out[GEMM_MR][2]);
#define GEMM_TILE_FN(MR)                                                                                             \
    static void gemm_tile_##MR(int type, const xq_t *xq, const size_t *at, int nb, const uint8_t *scratch,           \
                               panel_ahead_t pf, gemm_f out[GEMM_MR][2]) {                                           \
        if (exact_k(type)) gemm_tile_k(type, MR, xq, at, nb, scratch, pf, out);                                      \
        else gemm_tile(MR, xq, at, nb, gemm_offset(type), has_min32(type), scratch, pf, out);                        \
    }
GEMM_TILE_FN(1)
GEMM_TILE_FN(2)
GEMM_TILE_FN(3)
#if GEMM_MR == 6
GEMM_TILE_FN(4)
GEMM_TILE_FN(5)
GEMM_TILE_FN(6)
static const gemm_tile_fn gemm_tiles[GEMM_MR] = {gemm_tile_1, gemm_tile_2, gemm_tile_3,
                                                 gemm_tile_4, gemm_tile_5, gemm_tile_6};
#else
static const gemm_tile_fn gemm_tiles[GEMM_MR] = {gemm_tile_1, gemm_tile_2, gemm_tile_3};
#endif
#undef GEMM_TILE_FN

/* A tile's mr rows of output (columns j0 .. j0 + cols - 1) into y, by write_vectors. */
ALWAYS_INLINE void write_tile(int mr, const size_t *at, gemm_f out[GEMM_MR][2], void *y, long y_stride, int j0,
                              int cols, int y_bf16, const float *bias, int accumulate) {
    for (int r = 0; r < mr; r++) write_vectors(y, at[r], y_stride, j0, out[r][0], out[r][1], cols, y_bf16, bias, accumulate);
}

/* Thread t of nt's share of the GEMM: a contiguous range of panels, each
 * unpacked once into scratch (gemm_scratch_bytes(k, m)) and swept by all m rows,
 * GEMM_MR at a time and the rest in one smaller tile, the tiles asking for the
 * rows of the panel PANELS_AHEAD on as they go (prefetch_share). (Tiles of near-equal row
 * counts, 5 and 6 for 512 rows, made a 512-row product 2-3% slower.) */
/* How many panels ahead of the one unpacked the tiles ask for rows (see
 * prefetch_share): one was 4-8% slower than two on 8-16 rows (the first
 * panel's tiles run out before all its lines arrive). */
#define PANELS_AHEAD 2
static void gemm_thread(int type, const uint8_t *w, size_t row_bytes, const xq_t *xq, int m, int n, void *y,
                        long y_stride, int y_bf16, const float *bias, int accumulate, uint8_t *scratch, int t,
                        int nt) {
    const int nb = xq->k / 32;
    const int panels = (n + GEMM_PANEL - 1) / GEMM_PANEL;
    const int lo = (int)((long)panels * t / nt), hi = (int)((long)panels * (t + 1) / nt);
    /* rows 0 .. m_amx - 1 on the AMX tiles where they serve, the rest on the GEMM's */
    const int m_amx = amx_serves(type, m) && lo < hi ? m - m % AMX_ROWS : 0;
#if AMX_TILES
    if (m_amx) amx_begin();
#endif
    for (int p = lo; p < hi; p++) {
        const int j0 = p * GEMM_PANEL, cols = n - j0 < GEMM_PANEL ? n - j0 : GEMM_PANEL;
        gemm_unpack(type, w + (size_t)j0 * row_bytes, row_bytes, cols, nb, scratch);
#if AMX_TILES
        if (m_amx) {
            amx_planes(type, nb, scratch, amx_hi(scratch, xq->k), amx_lo(scratch, xq->k));
            amx_panel(type, 6, xq, m_amx, m, nb, scratch, NULL, (panel_ahead_t){NULL, 0}, y, y_stride, j0, cols, y_bf16,
                      bias, accumulate);
        }
#endif
        /* The rows of the panel PANELS_AHEAD on (contiguous in W), asked for in even
         * shares by this panel's tiles; none past the thread's last panel. */
        const int ja = j0 + PANELS_AHEAD * GEMM_PANEL;
        const int ahead_cols = p + PANELS_AHEAD < hi ? (n - ja < GEMM_PANEL ? n - ja : GEMM_PANEL) : 0;
        const size_t ahead_lines = ((size_t)ahead_cols * row_bytes + 63) / 64;
        const int tiles = (m - m_amx + GEMM_MR - 1) / GEMM_MR;
        for (int i0 = m_amx; i0 < m; i0 += GEMM_MR) {
            const int mr = m - i0 < GEMM_MR ? m - i0 : GEMM_MR;
            /* The next tile's stretch of y: rows of y lie more than 2 KB apart
             * (576 floats already), beyond the stride the hardware prefetcher follows,
             * and a prompt's y is larger than L2, so each write_row would wait. */
            const size_t y_elem = y_bf16 ? 2 : 4;
            for (int r = i0 + GEMM_MR; r < i0 + 2 * GEMM_MR && r < m; r++) {
                const char *next = (const char *)y + ((size_t)r * (size_t)y_stride + (size_t)j0) * y_elem;
                __builtin_prefetch(next, 1);
                __builtin_prefetch(next + y_elem * GEMM_PANEL - 1, 1);
            }
            size_t at[GEMM_MR];
            for (int r = 0; r < mr; r++) at[r] = (size_t)(i0 + r);
            gemm_f out[GEMM_MR][2];
            const uint8_t *ahead = ahead_cols ? w + (size_t)ja * row_bytes : NULL;
            const panel_ahead_t pf = ahead_share(ahead, ahead_lines, (size_t)((i0 - m_amx) / GEMM_MR), (size_t)tiles);
            gemm_tiles[mr - 1](type, xq, at, nb, scratch, pf, out);
            write_tile(mr, at, out, y, y_stride, j0, cols, y_bf16, bias, accumulate);
        }
    }
#if AMX_TILES
    if (m_amx) amx_end();
#endif
}

/* Lane q of the result: the sum of the 8 int32 lanes of p[q]. */
ALWAYS_INLINE __m256i lane_totals(const __m256i p[8]) {
    const __m256i h0 = _mm256_hadd_epi32(p[0], p[1]), h1 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i h2 = _mm256_hadd_epi32(p[4], p[5]), h3 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i g0 = _mm256_hadd_epi32(h0, h1), g1 = _mm256_hadd_epi32(h2, h3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
}

/* Lane q = v[q % NR] (NR 8 or 4). */
ALWAYS_INLINE __m256 by_column(const float *v, const int NR) {
    if (NR == 8) return _mm256_setr_ps(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
    const __m128 h = _mm_setr_ps(v[0], v[1], v[2], v[3]);
    return _mm256_set_m128(h, h);
}
/* Lane q = v[q / NR] (NR 8 or 4). */
ALWAYS_INLINE __m256 by_row(const float *v, const int NR) {
    if (NR == 8) return _mm256_set1_ps(v[0]);
    return _mm256_set_m128(_mm_set1_ps(v[1]), _mm_set1_ps(v[0]));
}

/* The signed 32-blocks' dots are taken with their stored values (value +
 * gemm_offset, unsigned, as the GEMM takes them) and the offset times x's
 * block sum taken back out of the integer totals here, lane q of `totals`
 * being row rows[q / NR]'s: the same integers as the sign trick's
 * |w| . sign(x, w) without its two sign operations per 32 values. */
ALWAYS_INLINE __m256i minus_offset(const int type, __m256i totals, const xq_t *xq, const size_t *rows, int b, int nb,
                                   const int NR) {
    const int offset = gemm_offset(type);
    if (!offset) return totals;
    const int o0 = offset * (int)xq->isum[rows[0] * (size_t)nb + b];
    if (NR == 8) return _mm256_sub_epi32(totals, _mm256_set1_epi32(o0));
    const int o1 = offset * (int)xq->isum[rows[1] * (size_t)nb + b];
    return _mm256_sub_epi32(totals, _mm256_set_m128i(_mm_set1_epi32(o1), _mm_set1_epi32(o0)));
}

/* MR rows of x (rows[]) by NR weight rows (wr[]), MR * NR == 8: lane q of res is
 * output (q / NR, q % NR), with the GEMM's arithmetic. */
ALWAYS_INLINE void exact_tile(const int type, const int MR, const int NR, const uint8_t *const *wr, const xq_t *xq,
                              const size_t *rows, float *res) {
    const int ts = ggml_quant_type_size(type), k = xq->k, nb = k / 32;
    __m256 acc = _mm256_setzero_ps();
    const int8_t *x[2];
    for (int i = 0; i < MR; i++) x[i] = xq_row(xq, rows[i]);
    for (int b = 0; b < nb; b++) {
        float dx[2], sx[2];
        __m256i p[8];
        /* Each weight block's dots right after its unpack: only the 8 integer sums stay live. */
        for (int j = 0; j < NR; j++) {
            if (rows[0] == 0) prefetch_ahead(wr[j] + (size_t)b * ts, (size_t)nb * ts, 1);
            const __m256i q = stored32(type, wr[j] + (size_t)b * ts);
            for (int i = 0; i < MR; i++) p[i * NR + j] = dot_unsigned(q, x[i] + (size_t)b * 32);
        }
        for (int i = 0; i < MR; i++) {
            dx[i] = xq->d[rows[i] * (size_t)nb + b];
            sx[i] = xq->s[rows[i] * (size_t)nb + b];
        }
        __m256 dw, mw;
        block_scales(NR, wr, (size_t)b * ts, &dw, &mw);
        const __m256 isum = _mm256_cvtepi32_ps(minus_offset(type, lane_totals(p), xq, rows, b, nb, NR));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(isum, dw), by_row(dx, NR), acc);
        if (has_min32(type)) acc = _mm256_fmadd_ps(mw, by_row(sx, NR), acc);
    }
    _mm256_storeu_ps(res, acc);
}

/* exact_tile for Q4_K / Q5_K: per super-block, each output's integers P and M
 * (see exact_k), then the GEMM's fp32 terms. The mins go through registers
 * (no int16 array stored and read back as a vector: a store-forwarding stall
 * per weight row and super-block). */
ALWAYS_INLINE void exact_tile_k(const int type, const int MR, const int NR, const uint8_t *const *wr,
                                const xq_t *xq, const size_t *rows, float *res) {
    const int ts = ggml_quant_type_size(type), k = xq->k, nsb = k / 256;
    __m256 acc = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        float dx[2];
        __m256i p[8], mp[8], xsum[2];
        for (int i = 0; i < MR; i++) /* lane c: x's sum over sub-block c */
            xsum[i] = _mm256_madd_epi16(
                _mm256_loadu_si256((const __m256i *)(xq->bsums + rows[i] * (size_t)(k / 16) + (size_t)sb * 16)),
                _mm256_set1_epi16(1));
        for (int j = 0; j < NR; j++) {
            const uint8_t *blk = wr[j] + (size_t)sb * ts;
            if (rows[0] == 0) prefetch_ahead(blk, (size_t)nsb * ts, ts);
            uint64_t sc8, mn8;
            k_scales_mins(blk + 4, &sc8, &mn8);
            for (int i = 0; i < MR; i++) p[i * NR + j] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i q = k_values(type, blk, c), scale = scale_one((int)((sc8 >> (8 * c)) & 0xFF));
                for (int i = 0; i < MR; i++) {
                    const int8_t *xc = xq_row(xq, rows[i]) + (size_t)sb * 256 + 32 * c;
                    p[i * NR + j] = _mm256_add_epi32(p[i * NR + j], dot_scaled(q, xc, scale));
                }
            }
            const __m256i mins = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn8));
            for (int i = 0; i < MR; i++) mp[i * NR + j] = _mm256_mullo_epi32(mins, xsum[i]);
        }
        for (int i = 0; i < MR; i++) dx[i] = xq->d[rows[i] * (size_t)nsb + sb];
        __m256 dw, dmin;
        block_scales(NR, wr, (size_t)sb * ts, &dw, &dmin); /* d and dmin open the super-block */
        const __m256 mw = _mm256_xor_ps(dmin, _mm256_set1_ps(-0.f)); /* -dmin, as the GEMM's unpack negates it */
        const __m256 pt = _mm256_cvtepi32_ps(lane_totals(p)), mt = _mm256_cvtepi32_ps(lane_totals(mp));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(pt, dw), by_row(dx, NR), acc);
        acc = _mm256_fmadd_ps(_mm256_mul_ps(mt, mw), by_row(dx, NR), acc);
    }
    _mm256_storeu_ps(res, acc);
}

/* exact_tile for Q6_K: per super-block, each output's integer P (see exact_k),
 * then the GEMM's fp32 term. */
ALWAYS_INLINE void exact_tile_q6k(const int MR, const int NR, const uint8_t *const *wr, const xq_t *xq,
                                  const size_t *rows, float *res) {
    const int ts = ggml_quant_type_size(Q6_K), k = xq->k, nsb = k / 256;
    __m256 acc = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        float dw[8], dx[2];
        __m256i p[8];
        for (int j = 0; j < NR; j++) {
            const uint8_t *blk = wr[j] + (size_t)sb * ts;
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int i = 0; i < MR; i++) p[i * NR + j] = _mm256_setzero_si256();
            if (rows[0] == 0) prefetch_ahead(blk, (size_t)nsb * ts, ts);
            for (int c = 0; c < 8; c++) {
                const __m256i q = q6_values(blk, c), scale = scales_pair(sc[2 * c], sc[2 * c + 1]);
                for (int i = 0; i < MR; i++) {
                    const int8_t *xc = xq_row(xq, rows[i]) + (size_t)sb * 256 + 32 * c;
                    p[i * NR + j] = _mm256_add_epi32(p[i * NR + j], dot_scaled(q, xc, scale));
                }
            }
            dw[j] = fp16_at(blk + 208);
            /* P - 32 * sum of sc * x's sums of 16 (exact in int32 in any order), taken off each
             * lane before the lane totals: no second set of eight accumulators, which the
             * 256-bit builds' sixteen registers do not hold beside the first */
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
            for (int i = 0; i < MR; i++) {
                const __m256i offset = _mm256_madd_epi16(
                    sc16, _mm256_loadu_si256((const __m256i *)(xq->bsums + rows[i] * (size_t)(k / 16) + (size_t)sb * 16)));
                p[i * NR + j] = _mm256_sub_epi32(p[i * NR + j], _mm256_slli_epi32(offset, 5));
            }
        }
        for (int i = 0; i < MR; i++) dx[i] = xq->d[rows[i] * (size_t)nsb + sb];
        const __m256i total = lane_totals(p);
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(total), by_column(dw, NR)), by_row(dx, NR), acc);
    }
    _mm256_storeu_ps(res, acc);
}

/* One or two rows of x (MR) by 8 weight rows, the 8 rows read one after
 * another instead of side by side. The tiles below walk their rows block by
 * block: 8 (or 4) short streams at once. A decode step's weights come from
 * memory, and on rows of 1-2 KB (k = 2048: the 1B rung's attention, gate, up
 * and LM head) the hardware prefetcher learns none of those streams before it
 * ends, so most loads waited on DRAM. Here a thread's weights are one
 * sequential stream (its groups of 8 rows are adjacent), also asked for
 * STREAM_AHEAD bytes ahead into L2, and each block is unpacked once for both
 * rows of a pair. Each (weight row, unit)'s integer sums wait in pbuf (mbuf:
 * the K-quants' min terms; a pair's folded to 4 lanes a row, exact in int32,
 * so they fit where one row's do); then the fp32 terms run unit by unit
 * exactly as in the tiles: the same integers and float operations in the same
 * order, so every output keeps its bits and batch invariance across 1, 2 and
 * 4+ rows of x holds. Three rows of x (and four of Q6_K, rows_take_four)
 * share each unpack too, each pair of rows' sums in arrays of its own
 * (rows_store): as a pair and a lone row, three took 1.6-1.9x a pair's time.
 * Serves rows of up to ROWS_UNITS units (k = 14,336: an 8B's down, which on
 * the tiles read Q6_K at ~35 GB/s from L3 against ~55 here), and the types
 * whose one-row product waits on memory: Q4_0 / Q4_1 /
 * Q5_0 / Q5_1 unpack enough per byte to be bound by their instructions, where
 * the extra stores cost more than the stream saves (docs/perf/decode-step.md). */
#define ROWS_UNITS 56
#define STREAM_AHEAD 8192
ALWAYS_INLINE int rows_serve(int type, int k) {
    return (exact_k(type) || type == Q8_0) && k / block_elems(type) <= ROWS_UNITS;
}
/* Four rows of x through the streamed row kernels instead of the GEMM: Q6_K
 * only. With AVX-512 its four-row product read 1B and 8B weights from memory
 * 1.2-1.7x faster so than through the GEMM's panels; Q4_K's went either way
 * (1B gate+up +13%, 8B gate+up -12%) and Q8_0's rows of 896 lost 25%. */
ALWAYS_INLINE int rows_take_four(int type, int k, int m) { return m == 4 && type == Q6_K && rows_serve(type, k); }
/* One vector of sums for pbuf: one row's as they are, a pair's folded to 4 lanes each. */
ALWAYS_INLINE __m256i rows_pack(const int MR, const __m256i *p) {
    if (MR == 1) return p[0];
    const __m128i f0 = _mm_add_epi32(_mm256_castsi256_si128(p[0]), _mm256_extracti128_si256(p[0], 1));
    const __m128i f1 = _mm_add_epi32(_mm256_castsi256_si128(p[1]), _mm256_extracti128_si256(p[1], 1));
    return _mm256_set_m128i(f1, f0);
}
/* v[j] = rows_pack of weight row j's sums: lane j of out[i] is x row i's total. */
ALWAYS_INLINE void rows_totals(const int MR, const __m256i v[8], __m256i *out) {
    if (MR == 1) {
        out[0] = lane_totals(v);
        return;
    }
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    out[0] = _mm256_permute2x128_si256(a, b, 0x20);
    out[1] = _mm256_permute2x128_si256(a, b, 0x31);
}
/* Rows of x in pairs: pair h holds rows 2h and 2h + 1, or row 2h alone when it is the last. */
ALWAYS_INLINE int rows_in_pair(const int MR, int h) { return MR - 2 * h < 2 ? MR - 2 * h : 2; }
/* The sums of one pair of rows of x: [weight row][unit]. */
typedef __m256i pair_sums_t[8][ROWS_UNITS];
/* MR rows' sums p[0 .. MR - 1] for (weight row j, unit u) into buf[h][j][u], one rows_pack a pair. */
ALWAYS_INLINE void rows_store(const int MR, const __m256i *p, pair_sums_t *const buf[2], int j, int u) {
    for (int h = 0; 2 * h < MR; h++) (*buf[h])[j][u] = rows_pack(rows_in_pair(MR, h), p + 2 * h);
}
/* Unit u's totals of the MR rows stored by rows_store: lane j of totals[i] is row i's with weight row j. */
ALWAYS_INLINE void rows_load_totals(const int MR, pair_sums_t *const buf[2], int u, __m256i *totals) {
    for (int h = 0; 2 * h < MR; h++) {
        __m256i v[8];
        for (int j = 0; j < 8; j++) v[j] = (*buf[h])[j][u];
        rows_totals(rows_in_pair(MR, h), v, totals + 2 * h);
    }
}
#if QUANT_ISA == 3
/* exact_rows' integer sums for one K-quant super-block with AVX-512, for
 * MR rows of x (xu[i]: the unit's 256 values), 64 values a step: vpdpbusd
 * gives lanes of four products (|lane| <= 4 * 63 * 127 < 2^15, so a lane is
 * its own low int16) and vpdpwssd adds lane * scale, the scale the low int16
 * of its dword and the high one zero. The same integers as dot_scaled's,
 * unpacked with fewer instructions (Q6_K: one vpternlogd joins each 64
 * values' two parts). The 256-bit kernels read 1B weights at ~39 GB/s from
 * L3 as from memory, while a plain read made 50-60 GB/s on this Zen 4 when
 * its memory was quick; from L3 these take Q6_K to ~60 GB/s and Q4_K to
 * ~45 (docs/perf/decode-step.md, "The one-row kernels' own ceiling"). p[i]
 * holds P as lanes to add. */
ALWAYS_INLINE __m256i fold512(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
/* Lanes 0-7 of `all` at a, 8-15 at b (Q4_K: each sub-block's scale over its 32 values). */
ALWAYS_INLINE __m512i scale_halves(__m512i all, int a, int b) {
    return _mm512_permutexvar_epi32(_mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a), all);
}
/* Lanes 4g .. 4g + 3 of the result at base + g (Q6_K: a scale per 16 values). */
ALWAYS_INLINE __m512i scale_quarters(__m512i all, int base) {
    const int a = base, b = base + 1, c = base + 2, d = base + 3;
    return _mm512_permutexvar_epi32(_mm512_set_epi32(d, d, d, d, c, c, c, c, b, b, b, b, a, a, a, a), all);
}
ALWAYS_INLINE void k_unit_sums512(const int type, const int MR, const uint8_t *blk, uint64_t sc8,
                                  const int8_t *const *xu, __m256i *p) {
    const __m512i all = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8)), low4 = _mm512_set1_epi8(0x0F);
    const __m512i by4 = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0x0004000400040004LL,
                                         0x0004000400040004LL, 0, 0, 0, 0); /* upper half: the high nibbles */
    const uint8_t *qs = type == Q5_K ? blk + 48 : blk + 16;
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16))); /* Q5_K */
    __m512i acc[4];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_si512();
    for (int pair = 0; pair < 4; pair++) { /* sub-blocks 2 pair (low nibbles) and 2 pair + 1 (high) */
        const __m512i packed = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * pair)));
        __m512i q = _mm512_and_si512(_mm512_srlv_epi16(packed, by4), low4);
        if (type == Q5_K) { /* sub-block j's fifth bits: bit j of qh's bytes */
            const __m512i bit = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi8((char)(1 << (2 * pair))),
                                                        _mm512_set1_epi8((char)(1 << (2 * pair + 1))));
            q = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(qh, bit), q, _mm512_set1_epi8(0x10));
        }
        const __m512i scale = scale_halves(all, 2 * pair, 2 * pair + 1);
        for (int i = 0; i < MR; i++) {
            const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(xu[i] + 64 * pair));
            acc[i] = _mm512_dpwssd_epi32(acc[i], d, scale);
        }
    }
    for (int i = 0; i < MR; i++) p[i] = fold512(acc[i]);
}
/* Q6_K: 64 values a step, their low nibbles from 64 bytes of ql and bits 4-5
 * from qh shifted per 256-bit half (as q6_chunk), joined by one vpternlogd. */
ALWAYS_INLINE void q6k_unit_sums512(const int MR, const uint8_t *blk, const int8_t *const *xu, __m256i *p) {
    const __m512i all = _mm512_cvtepu16_epi32(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192))));
    const __m512i bits45 = _mm512_set1_epi8(0x30), low4 = _mm512_set1_epi8(0x0F);
    const __m512i up_lo = _mm512_set_epi64(0x0002000200020002LL, 0x0002000200020002LL, 0x0002000200020002LL,
                                           0x0002000200020002LL, 0x0004000400040004LL, 0x0004000400040004LL,
                                           0x0004000400040004LL, 0x0004000400040004LL); /* chunk 0 << 4, 1 << 2 */
    const __m512i down_hi = _mm512_set_epi64(0x0002000200020002LL, 0x0002000200020002LL, 0x0002000200020002LL,
                                             0x0002000200020002LL, 0, 0, 0, 0); /* chunk 2 as is, 3 >> 2 */
    __m512i acc[4];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_si512();
    for (int half = 0; half < 2; half++) {
        const __m512i ql = _mm512_loadu_si512(blk + 64 * half);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half)));
        const __m512i h01 = _mm512_and_si512(_mm512_sllv_epi16(qh, up_lo), bits45);
        const __m512i h23 = _mm512_and_si512(_mm512_srlv_epi16(qh, down_hi), bits45);
        /* bits 0-3 from the first operand, the rest from the second (0xE4: c ? a : b) */
        const __m512i q01 = _mm512_ternarylogic_epi32(ql, h01, low4, 0xE4);
        const __m512i q23 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), h23, low4, 0xE4);
        const __m512i s01 = scale_quarters(all, 8 * half), s23 = scale_quarters(all, 8 * half + 4);
        for (int i = 0; i < MR; i++) {
            const int8_t *x = xu[i] + 128 * half;
            const __m512i d01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q01, _mm512_loadu_si512(x));
            const __m512i d23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q23, _mm512_loadu_si512(x + 64));
            acc[i] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc[i], d01, s01), d23, s23);
        }
    }
    for (int i = 0; i < MR; i++) p[i] = fold512(acc[i]);
}
#endif

ALWAYS_INLINE void exact_rows(const int type, const int MR, const uint8_t *const *wr, const xq_t *xq,
                              const size_t *rows, float *res) {
    const int is_q6 = type == Q6_K, is_k = type == Q4_K || type == Q5_K;
    const int ts = ggml_quant_type_size(type), k = xq->k, unit = block_elems(type), nu = k / unit;
    const int8_t *x[4];
    const int16_t *bsums[4];
    for (int i = 0; i < MR; i++) {
        x[i] = xq_row(xq, rows[i]);
        bsums[i] = xq->bsums + rows[i] * (size_t)(k / 16);
    }
    /* each pair of rows of x its own arrays: as planes of one array, three rows of Q4_K ran 6% slower */
    pair_sums_t p01, p23, m01, m23;
    pair_sums_t *const pbuf[2] = {&p01, &p23}, *const mbuf[2] = {&m01, &m23};
    __m256i xsum[4][ROWS_UNITS];
    if (is_k)
        for (int i = 0; i < MR; i++)
            for (int u = 0; u < nu; u++) /* lane c: x's sum over sub-block c */
                xsum[i][u] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bsums[i] + (size_t)u * 16)),
                                               _mm256_set1_epi16(1));
    for (int j = 0; j < 8; j++)
        for (int u = 0; u < nu; u++) {
            const uint8_t *blk = wr[j] + (size_t)u * ts;
            /* Only the first rows of x stream the weights; a lone row after pairs finds them in cache. */
            if (rows[0] == 0)
                for (int l = 0; l < ts; l += 64) prefetch_l2(blk + STREAM_AHEAD + l);
            __m256i p[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                            _mm256_setzero_si256()};
            const int8_t *xu[4];
            for (int i = 0; i < MR; i++) xu[i] = x[i] + (size_t)u * unit;
            if (is_q6) {
                const int8_t *sc = (const int8_t *)(blk + 192);
#if QUANT_ISA == 3
                q6k_unit_sums512(MR, blk, xu, p);
#else
                for (int c = 0; c < 8; c++) {
                    const __m256i q = q6_values(blk, c), scale = scales_pair(sc[2 * c], sc[2 * c + 1]);
                    for (int i = 0; i < MR; i++)
                        p[i] = _mm256_add_epi32(p[i], dot_scaled(q, xu[i] + 32 * c, scale));
                }
#endif
                const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
                for (int i = 0; i < MR; i++) {
                    const __m256i offset =
                        _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(bsums[i] + (size_t)u * 16)));
                    p[i] = _mm256_sub_epi32(p[i], _mm256_slli_epi32(offset, 5));
                }
            } else if (is_k) {
                uint64_t sc8, mn8;
                k_scales_mins(blk + 4, &sc8, &mn8);
#if QUANT_ISA == 3
                k_unit_sums512(type, MR, blk, sc8, xu, p);
#else
                for (int c = 0; c < 8; c++) {
                    const __m256i q = k_values(type, blk, c), scale = scale_one((int)((sc8 >> (8 * c)) & 0xFF));
                    for (int i = 0; i < MR; i++)
                        p[i] = _mm256_add_epi32(p[i], dot_scaled(q, xu[i] + 32 * c, scale));
                }
#endif
                const __m256i mins = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn8));
                __m256i mp[4];
                for (int i = 0; i < MR; i++) mp[i] = _mm256_mullo_epi32(mins, xsum[i][u]);
                rows_store(MR, mp, mbuf, j, u);
            } else { /* the offset comes out of the totals below (minus_offset) */
                const __m256i q = stored32(type, blk);
                for (int i = 0; i < MR; i++) p[i] = dot_unsigned(q, xu[i]);
            }
            rows_store(MR, p, pbuf, j, u);
        }
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int u = 0; u < nu; u++) {
        __m256i totals[4];
        __m256 pt[4], mt[4], dx[4];
        rows_load_totals(MR, pbuf, u, totals);
        for (int i = 0; i < MR; i++) pt[i] = _mm256_cvtepi32_ps(minus_offset(type, totals[i], xq, rows + i, u, nu, 8));
        for (int i = 0; i < MR; i++) dx[i] = _mm256_set1_ps(xq->d[rows[i] * (size_t)nu + u]);
        if (is_q6) {
            float dw[8];
            for (int j = 0; j < 8; j++) dw[j] = fp16_at(wr[j] + (size_t)u * ts + 208);
            const __m256 dwv = by_column(dw, 8);
            for (int i = 0; i < MR; i++) acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(pt[i], dwv), dx[i], acc[i]);
            continue;
        }
        __m256 dw, mw;
        block_scales(8, wr, (size_t)u * ts, &dw, &mw);
        if (is_k) {
            rows_load_totals(MR, mbuf, u, totals);
            for (int i = 0; i < MR; i++) mt[i] = _mm256_cvtepi32_ps(totals[i]);
        }
        for (int i = 0; i < MR; i++) {
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(pt[i], dw), dx[i], acc[i]);
            if (is_k) /* mw holds dmin: the tiles' -dmin */
                acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(mt[i], _mm256_xor_ps(mw, _mm256_set1_ps(-0.f))), dx[i], acc[i]);
            else if (has_min32(type))
                acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xq->s[rows[i] * (size_t)nu + u]), acc[i]);
        }
    }
    for (int i = 0; i < MR; i++) _mm256_storeu_ps(res + 8 * i, acc[i]);
}

/* The small tile for a type (constant in each function below, so this folds away). */
ALWAYS_INLINE void exact_tile_of(const int type, const int MR, const int NR, const uint8_t *const *wr,
                                 const xq_t *xq, const size_t *rows, float *res) {
    if (type == Q6_K)
        exact_tile_q6k(MR, NR, wr, xq, rows, res);
    else if (exact_k(type))
        exact_tile_k(type, MR, NR, wr, xq, rows, res);
    else
        exact_tile(type, MR, NR, wr, xq, rows, res);
}

/* The small tiles of a type, and the streamed row kernel for MR rows of x
 * (exact_rows). Only the types rows_serve takes get row kernels, and only
 * Q6_K one for four rows (rows_take_four): each instance is compiled for
 * every ISA at a server's first start. */
#define EXACT_TILE_FNS(T)                                                                                      \
    static void exact_##T##_1_8(const uint8_t *const *wr, const xq_t *xq, const size_t *rows, float *res) {   \
        exact_tile_of(T, 1, 8, wr, xq, rows, res);                                                            \
    }                                                                                                          \
    static void exact_##T##_2_4(const uint8_t *const *wr, const xq_t *xq, const size_t *rows, float *res) {   \
        exact_tile_of(T, 2, 4, wr, xq, rows, res);                                                            \
    }
#define ROWS_FN(T, MR)                                                                                         \
    static void rows_##T##_##MR(const uint8_t *const *wr, const xq_t *xq, const size_t *rows, float *res) {   \
        exact_rows(T, MR, wr, xq, rows, res);                                                                 \
    }
#define ROWS_FNS(T) ROWS_FN(T, 1) ROWS_FN(T, 2) ROWS_FN(T, 3)
EXACT_TILE_FNS(Q4_0)
EXACT_TILE_FNS(Q4_1)
EXACT_TILE_FNS(Q5_0)
EXACT_TILE_FNS(Q5_1)
EXACT_TILE_FNS(Q8_0)
EXACT_TILE_FNS(Q4_K)
EXACT_TILE_FNS(Q5_K)
EXACT_TILE_FNS(Q6_K)
ROWS_FNS(Q8_0)
ROWS_FNS(Q4_K)
ROWS_FNS(Q5_K)
ROWS_FNS(Q6_K)
ROWS_FN(Q6_K, 4)

typedef void (*exact_fn)(const uint8_t *const *, const xq_t *, const size_t *, float *);

/* [0]: one row by 8 columns, [1]: two rows by 4 (the tiles); [2] .. [5]: one to four rows by 8,
 * their weight rows streamed (exact_rows), NULL where rows_serve or rows_take_four never asks. */
static const exact_fn *exact_tiles_for(int type) {
#define TILES(T) exact_##T##_1_8, exact_##T##_2_4
#define ROWS(T) rows_##T##_1, rows_##T##_2, rows_##T##_3
    static const exact_fn t40[] = {TILES(Q4_0), NULL, NULL, NULL, NULL}, t41[] = {TILES(Q4_1), NULL, NULL, NULL, NULL},
                          t50[] = {TILES(Q5_0), NULL, NULL, NULL, NULL}, t51[] = {TILES(Q5_1), NULL, NULL, NULL, NULL},
                          t80[] = {TILES(Q8_0), ROWS(Q8_0), NULL}, t4k[] = {TILES(Q4_K), ROWS(Q4_K), NULL},
                          t5k[] = {TILES(Q5_K), ROWS(Q5_K), NULL}, t6k[] = {TILES(Q6_K), ROWS(Q6_K), rows_Q6_K_4};
#undef TILES
#undef ROWS
    switch (type) {
    case Q4_0: return t40;
    case Q4_1: return t41;
    case Q5_0: return t50;
    case Q5_1: return t51;
    case Q4_K: return t4k;
    case Q5_K: return t5k;
    case Q6_K: return t6k;
    default: return t80;
    }
}

/* Rows rows[0] and rows[1] of x by the 8 weight rows wr (output columns j0 ..), as two 2 x 4 tiles. */
static void pair_tiles(const exact_fn *fns, const uint8_t *const *wr, const xq_t *xq, const size_t rows[2], int j0,
                       int n, void *y, long y_stride, int y_bf16, const float *bias, int accumulate) {
    for (int half = 0; half < 2 && j0 + 4 * half < n; half++) {
        const int jh = j0 + 4 * half, count = n - jh < 4 ? n - jh : 4;
        float res[8];
        fns[1](wr + 4 * half, xq, rows, res);
        write_row(y, rows[0], y_stride, jh, res, count, y_bf16, bias, accumulate);
        write_row(y, rows[1], y_stride, jh, res + 4, count, y_bf16, bias, accumulate);
    }
}

/* Thread t of nt's share for fewer rows than gemm_serves: groups of 8 weight rows,
 * rows of x two at a time (exact_rows' pairs where rows_serve, else 2 x 4
 * tiles), an odd last one alone (1 x 8: exact_rows or the tile); where
 * rows_serve, three rows (four of Q6_K) go through exact_rows together. The
 * last group's missing weight rows repeat its last one and are not written.
 * One row alone (a single stream's decode) takes 1 x 8. (It once took the
 * 2 x 4 tile with itself twice, streaming four weight rows instead of eight:
 * 4-5% faster on Zen 4 before the tiles prefetched the rows ahead. With the
 * prefetch, 1 x 8 decodes the default model 23% faster on an Emerald Rapids,
 * docs/perf/quantized.md.) */
static void exact_tiles_thread(int type, const uint8_t *w, size_t row_bytes, const xq_t *xq, int m, int n, void *y,
                               long y_stride, int y_bf16, const float *bias, int accumulate, int t, int nt) {
    const exact_fn *fns = exact_tiles_for(type);
    const int groups = (n + 7) / 8, stream_rows = rows_serve(type, xq->k);
    const int lo = (int)((long)groups * t / nt), hi = (int)((long)groups * (t + 1) / nt);
    for (int g = lo; g < hi; g++) {
        const int j0 = g * 8, count = n - j0 < 8 ? n - j0 : 8; /* the group's columns */
        const uint8_t *wr[8];
        for (int j = 0; j < 8; j++) wr[j] = w + (size_t)(j0 + j < n ? j0 + j : n - 1) * row_bytes;
        int i = 0;
        if (stream_rows && (m == 3 || rows_take_four(type, xq->k, m))) { /* each block unpacked once for all rows */
            const size_t rows[4] = {0, 1, 2, 3};
            float res[32];
            fns[m + 1](wr, xq, rows, res);
            for (int r = 0; r < m; r++)
                write_row(y, rows[r], y_stride, j0, res + 8 * r, count, y_bf16, bias, accumulate);
            continue;
        }
        for (; i + 2 <= m; i += 2) {
            const size_t rows[2] = {(size_t)i, (size_t)i + 1};
            if (stream_rows) {
                float res[16];
                fns[3](wr, xq, rows, res);
                write_row(y, rows[0], y_stride, j0, res, count, y_bf16, bias, accumulate);
                write_row(y, rows[1], y_stride, j0, res + 8, count, y_bf16, bias, accumulate);
            } else {
                pair_tiles(fns, wr, xq, rows, j0, n, y, y_stride, y_bf16, bias, accumulate);
            }
        }
        if (i < m) {
            const size_t rows[1] = {(size_t)i};
            float res[8];
            fns[stream_rows ? 2 : 0](wr, xq, rows, res);
            write_row(y, rows[0], y_stride, j0, res, count, y_bf16, bias, accumulate);
        }
    }
}
#else
#define EXACT_KERNELS 0
ALWAYS_INLINE int exact_serves(int type) {
    (void)type;
    return 0;
}
static size_t gemm_scratch_bytes(int k, int m) {
    (void)k, (void)m;
    return 0;
}
ALWAYS_INLINE int amx_packed_rows(int type, int m) {
    (void)type, (void)m;
    return 0;
}
#endif

/* A product's packed panels shared out between its threads. Each thread's
 * range starts as the static split's, and its owner takes panels from the
 * front, asking for the panel PANELS_AHEAD on as before; a thread with none
 * of its own left takes another's from the back, one at a time. Served, the
 * front end and the clients run on the engine's cores: a thread taken off its
 * core left the others waiting at the barrier after the product until it was
 * back (libgomp's waits: 12% of a served 16-stream run's engine samples, 6.6%
 * with the claims; docs/perf/quantized.md). One word a range (next << 32 | end,
 * a cache line of its own), changed by compare-and-swap: no panel is taken
 * twice, none is left. Whichever thread takes a panel computes it the same
 * way: the same bits. */
typedef struct {
    _Alignas(64) _Atomic uint64_t range;
} panel_claims_t;

/* slots ranges over panels: the static split for `slots` threads. Before the threads start. */
static void panel_claims_init(panel_claims_t *claims, int slots, int panels) {
    for (int s = 0; s < slots; s++) {
        const uint64_t lo = (uint64_t)((long)panels * s / slots), hi = (uint64_t)((long)panels * (s + 1) / slots);
        atomic_init(&claims[s].range, lo << 32 | hi);
    }
}

/* Thread t's next panel (t < slots: a team has at most the threads asked for):
 * the front of range t, else the back of another; -1 when all are empty. *end:
 * range t's end as taken (a stolen panel's own index: the thief asks for no
 * panel ahead). A range only shrinks, so once t's is empty only the others' are
 * looked at. */
static int panel_claim(panel_claims_t *claims, int slots, int t, int *end) {
    uint64_t v = atomic_load_explicit(&claims[t].range, memory_order_relaxed);
    while ((uint32_t)(v >> 32) < (uint32_t)v)
        if (atomic_compare_exchange_weak_explicit(&claims[t].range, &v, v + ((uint64_t)1 << 32), memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *end = (int)(uint32_t)v;
            return (int)(v >> 32);
        }
    for (int i = 1; i < slots; i++) {
        panel_claims_t *other = &claims[(t + i) % slots];
        uint64_t v = atomic_load_explicit(&other->range, memory_order_relaxed);
        while ((uint32_t)(v >> 32) < (uint32_t)v)
            if (atomic_compare_exchange_weak_explicit(&other->range, &v, v - 1, memory_order_relaxed,
                                                      memory_order_relaxed)) {
                *end = (int)(uint32_t)v - 1;
                return *end;
            }
    }
    return -1;
}

#include "packed_panels.h"

/* Thread t of nt's share of y = x @ W^T (+ bias; = or +=) for already quantized x
 * (with xq->isum filled where exact_serves): the exact kernels where this build
 * has them for the type (the GEMM from gemm_serves' rows, with one unpacked
 * panel of scratch per thread, gemm_scratch_bytes(k, m)), else the tile kernels;
 * or, packed (w laid out by ggml_quant_pack), the tiles that read the panels in place. */
static void quant_matmul_thread(int type, const uint8_t *w, int packed, size_t row_bytes, const xq_t *xq, int m, int n,
                                void *y, long y_stride, int y_bf16, const float *bias, int accumulate, uint8_t *scratch,
                                panel_claims_t *claims, int slots, int t, int nt) {
#if EXACT_KERNELS
    if (packed) {
        packed_thread(type, w, xq, m, n, y, y_stride, y_bf16, bias, accumulate, scratch, claims, slots, t);
        return;
    }
    if (exact_serves(type)) {
        if (gemm_serves(m) && !rows_take_four(type, xq->k, m))
            gemm_thread(type, w, row_bytes, xq, m, n, y, y_stride, y_bf16, bias, accumulate, scratch, t, nt);
        else
            exact_tiles_thread(type, w, row_bytes, xq, m, n, y, y_stride, y_bf16, bias, accumulate, t, nt);
        return;
    }
#endif
    (void)scratch, (void)packed, (void)claims, (void)slots;
    matmul_thread(tiles_for(type), w, row_bytes, xq, m, n, y, y_stride, y_bf16, bias, accumulate, t, nt);
}

/* 1 if this build computes `type` with the exact kernels (GEMM and small tiles). */
int ggml_quant_exact_kernels(int type) { return exact_serves(type); }

/* bytes (rounded up to whole cache lines) at a 64-byte boundary, for free(). */
static void *aligned_64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* y = x @ W^T for W in ggml blocks or packed: ggml_quant_matmul's body. */
static int matmul_call(int type, const void *x, int x_bf16, int m, int k, const uint8_t *w, int packed, int n, void *y,
                       long y_stride, int num_threads) {
    const tile_fn *tiles = tiles_for(type);
    const int be = block_elems(type);
    if (tiles == NULL || k <= 0 || k % be || m < 0 || n < 0 || (packed && !packed_serves(type))) return 2;
    if (m == 0 || n == 0) return 0;
    const size_t row_bytes = (size_t)(k / be) * ggml_quant_type_size(type);
    const int threads = num_threads > 0 ? num_threads : 1, exact = exact_serves(type);
    /* x's int8 rows and the scratch on cache lines: a tile load (amx_tiles.h) of rows
     * straddling two lines took 1.4x as long */
    /* (AMX_ROWS - 1 rows more of qs: the AMX tiles' last group may load rows past m, amx_packed_rows) */
    xq_t xq = {.qs = aligned_64(((size_t)m + AMX_ROWS - 1) * xq_stride(k)),
               .d = malloc(sizeof(float) * (size_t)m * (k / 32)),
               .s = malloc(sizeof(float) * (size_t)m * (k / 32)),
               .bsums = malloc(sizeof(int16_t) * (size_t)m * (k / 16)),
               .k = k,
               .isum = exact ? malloc(sizeof(int16_t) * (size_t)m * (k / 32)) : NULL};
    const size_t scratch_bytes =
        exact && (!packed || packed_expands(type, m) || amx_packed_rows(type, m)) ? gemm_scratch_bytes(k, m) : 0;
    uint8_t *scratch = scratch_bytes ? aligned_64(scratch_bytes * (size_t)threads) : NULL;
    panel_claims_t *claims = packed ? aligned_64(sizeof *claims * (size_t)threads) : NULL;
    int rc = 0;
    if (!xq.qs || !xq.d || !xq.s || !xq.bsums || (exact && !xq.isum) || (scratch_bytes && !scratch) ||
        (packed && !claims)) {
        rc = 1;
        goto done;
    }
    if (claims) panel_claims_init(claims, threads, (n + PACKED_PANEL - 1) / PACKED_PANEL);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int i = 0; i < m; i++) quantize_row(x, x_bf16, (size_t)i, k, be, &xq);
        /* (implicit barrier) */
#if defined(_OPENMP)
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
        const int nt = 1, t = 0;
#endif
        quant_matmul_thread(type, w, packed, row_bytes, &xq, m, n, y, y_stride, x_bf16, NULL, 0,
                            scratch ? scratch + scratch_bytes * (size_t)t : NULL, claims, threads, t, nt);
    }
done:
    free(claims);
    free(xq.qs);
    free(xq.d);
    free(xq.s);
    free(xq.bsums);
    free(xq.isum);
    free(scratch);
    return rc;
}

/* y[m, n] (row stride y_stride elements, x's dtype) = x[m, k] @ W^T, W [n, row_bytes] in ggml blocks.
 * Returns 0, 1 when scratch memory could not be allocated, 2 for an unsupported type or shape. */
int ggml_quant_matmul(int type, const void *x, int x_bf16, int m, int k, const uint8_t *w, int n, void *y,
                      long y_stride, int num_threads) {
    return matmul_call(type, x, x_bf16, m, k, w, 0, n, y, y_stride, num_threads);
}

/* The same with W as ggml_quant_pack laid it out: the same result, bit for bit. */
int ggml_quant_matmul_packed(int type, const void *x, int x_bf16, int m, int k, const uint8_t *packed, int n, void *y,
                             long y_stride, int num_threads) {
    return matmul_call(type, x, x_bf16, m, k, packed, 1, n, y, y_stride, num_threads);
}

/* 1 if this build multiplies `type` from weights that ggml_quant_pack laid out. */
int ggml_quant_packed_serves(int type) { return packed_serves(type); }

/* Bytes of an n x k weight of `type` packed (the same layout in every build), 0 where
 * no such weight is packed (the type, or a k that is no whole block of it). */
size_t ggml_quant_packed_bytes(int type, int n, int k) {
    if (!packable(type) || n <= 0 || k <= 0 || k % block_elems(type)) return 0;
    return (size_t)((n + PACKED_PANEL - 1) / PACKED_PANEL) * packed_panel_bytes(type, k);
}

/* W (n rows of ggml blocks) into dst (ggml_quant_packed_bytes), or back with
 * unpack: dst then receives the blocks from the packed w. Returns 2 where this
 * build packs no such weight. */
int ggml_quant_pack(int type, const uint8_t *w, int n, int k, uint8_t *dst, int unpack, int num_threads) {
    if (!ggml_quant_packed_bytes(type, n, k)) return 2;
    const size_t row_bytes = (size_t)(k / block_elems(type)) * (size_t)ggml_quant_type_size(type);
    const size_t panel = packed_panel_bytes(type, k);
    const int panels = (n + PACKED_PANEL - 1) / PACKED_PANEL, threads = num_threads > 0 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int p = 0; p < panels; p++) {
        if (type == Q8_0 && unpack) unpack_panel_q8_0(w + (size_t)p * panel, k, p, n, dst, row_bytes);
        else if (type == Q8_0) pack_panel_q8_0(w, row_bytes, n, k, p, dst + (size_t)p * panel);
        else if ((type == Q5_0 || type == Q4_0) && unpack)
            unpack_panel_nibbles(type, w + (size_t)p * panel, k, p, n, dst, row_bytes);
        else if (type == Q5_0 || type == Q4_0) pack_panel_nibbles(type, w, row_bytes, n, k, p, dst + (size_t)p * panel);
        else if (type == Q6_K && unpack) unpack_panel_q6_k(w + (size_t)p * panel, k, p, n, dst, row_bytes);
        else if (type == Q6_K) pack_panel_q6_k(w, row_bytes, n, k, p, dst + (size_t)p * panel);
        else if (unpack) unpack_panel_q4_k(w + (size_t)p * panel, k, p, n, dst, row_bytes);
        else pack_panel_q4_k(w, row_bytes, n, k, p, dst + (size_t)p * panel);
    }
    (void)threads;
    return 0;
}

/* ---- dequantization, in gguf-py's operation order so results match it bit for bit */

static void dequantize_block(int type, const uint8_t *b, float *out) {
    switch (type) {
    case Q4_0:
    case Q4_1: {
        const float d = fp16_at(b), m = type == Q4_1 ? fp16_at(b + 2) : 0.f;
        const uint8_t *qs = b + (type == Q4_1 ? 4 : 2);
        for (int j = 0; j < 16; j++) {
            const int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
            if (type == Q4_0) {
                out[j] = d * (float)(lo - 8);
                out[j + 16] = d * (float)(hi - 8);
            } else {
                out[j] = d * (float)lo + m;
                out[j + 16] = d * (float)hi + m;
            }
        }
        break;
    }
    case Q5_0:
    case Q5_1: {
        const float d = fp16_at(b), m = type == Q5_1 ? fp16_at(b + 2) : 0.f;
        const uint8_t *qhp = b + (type == Q5_1 ? 4 : 2), *qs = qhp + 4;
        uint32_t qh;
        memcpy(&qh, qhp, sizeof qh);
        for (int j = 0; j < 32; j++) {
            const int q = (j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4) | (int)(((qh >> j) & 1u) << 4);
            out[j] = type == Q5_0 ? d * (float)(q - 16) : d * (float)q + m;
        }
        break;
    }
    case Q8_0: {
        const float d = fp16_at(b);
        for (int j = 0; j < 32; j++) out[j] = (float)((const int8_t *)(b + 2))[j] * d;
        break;
    }
    case Q4_K:
    case Q5_K: {
        const float d = fp16_at(b), dmin = fp16_at(b + 2);
        const uint8_t *qh = type == Q5_K ? b + 16 : NULL, *qs = type == Q5_K ? b + 48 : b + 16;
        for (int s = 0; s < 8; s++) {
            int sc, mn;
            scale_min_k4(b + 4, s, &sc, &mn);
            const float dl = d * (float)sc, ml = dmin * (float)mn;
            for (int l = 0; l < 32; l++) {
                const uint8_t byte = qs[32 * (s >> 1) + l];
                const int q = ((s & 1) ? byte >> 4 : byte & 0x0F) | (qh ? ((qh[l] >> s) & 1) << 4 : 0);
                out[32 * s + l] = dl * (float)q - ml;
            }
        }
        break;
    }
    default: { /* Q6_K */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = fp16_at(b + 208);
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t lb = ql[64 * h + 32 * (c & 1) + l];
                    const int q = ((c >> 1) ? lb >> 4 : lb & 0x0F) | (((qh[32 * h + l] >> (2 * c)) & 3) << 4);
                    const int e = 128 * h + 32 * c + l;
                    out[e] = (d * (float)sc[e / 16]) * (float)(q - 32);
                }
        break;
    }
    }
}

/* out[r, k] (fp32 or bf16) = the rows `rows` of W dequantized. Returns 2 for an unsupported type or shape. */
int ggml_quant_dequantize_rows(int type, const uint8_t *w, int k, const int64_t *rows, int r, void *out,
                               int out_bf16, int num_threads) {
    const int be = block_elems(type), ts = ggml_quant_type_size(type);
    if (ts == 0 || k <= 0 || k % be) return 2;
    const size_t row_bytes = (size_t)(k / be) * ts;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (r > 1)
    for (int i = 0; i < r; i++) {
        const uint8_t *src = w + (size_t)rows[i] * row_bytes;
        for (int b = 0; b < k / be; b++) {
            float block[256];
            dequantize_block(type, src + (size_t)b * ts, block);
            const size_t at = (size_t)i * k + (size_t)b * be;
            for (int e = 0; e < be; e++) {
                if (out_bf16) ((uint16_t *)out)[at + e] = float_to_bf16(block[e]);
                else ((float *)out)[at + e] = block[e];
            }
        }
    }
    return 0;
}
