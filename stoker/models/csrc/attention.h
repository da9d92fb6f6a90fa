/* Attention over the paged KV cache, for CPUs: the one implementation that
 * the fused decoder (decoder_layer.c) and the paged-attention kernels
 * (paged_attention.c) both run. Included after ggml_quant.c and kv_format.h.
 *
 * attend serves rows of one sequence (a decode row, or up to ATTEND_ROWS rows
 * of a prompt chunk) and the query heads of one kv head's group. Every
 * reduction runs in a fixed order, so a (row, head) computes the same result
 * whichever rows, heads or thread share its call: a prefill row is exactly a
 * decode row at its position, whichever path or batch serves it.
 */
#ifndef STOKER_ATTENTION_H
#define STOKER_ATTENTION_H

#define KV_PREFETCH_KEYS 32 /* how far ahead attention prefetches cache rows */
#define ATTEND_ROWS 16 /* rows of one sequence that attention serves together */
/* keys a p.v pass takes between loading and storing its output vectors (the
 * sum still runs key by key in order: any multiple of 8 gives the same result) */
#define PV_KEYS 32

/* One layer's cache and the step's rows, as attend reads them. */
typedef struct {
    int head_dim, num_heads, num_kv_heads;
    float scale; /* of q.k */
    const int64_t *positions; /* [rows]: row r attends to keys 0 .. positions[r] (all in the cache) */
    const int64_t *tables;    /* [sequences, max_blocks] */
    int max_blocks;
    const int32_t *row_seq;        /* row r's sequence (its block table); NULL: sequence r */
    const void *k_cache, *v_cache; /* [blocks, block_size, kv_heads, kv_row_bytes] */
    int block_size;
    int kv_format; /* KV_* (kv_format.h) */
} AttnLayer;

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
ALWAYS_INLINE void key_rows(const AttnLayer *layer, const void *cache, const int64_t *table, int kvh, int KVH, int D, int t0,
                            int L, int widen, int scaled, const void *rows[8], float scales[8],
                            float *restrict widened) {
    const int BS = layer->block_size;
    const size_t row_bytes = kv_row_bytes(layer->kv_format, D), token_bytes = row_bytes * (size_t)KVH;
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
        scales[i] = kv_row_scale(layer->kv_format, row, D);
        rows[i] = row;
        if (widen) {
            kv_widen(layer->kv_format, row, D, scaled ? scales[i] : 1.f, widened + (size_t)i * D);
            rows[i] = widened + (size_t)i * D;
        }
        if (++offset < BS) row += token_bytes;
        else if (t0 + i + 1 < L) block++, offset = 0, row = BLOCK_ROW(block, 0);
    }
    /* The rows of keys KV_PREFETCH_KEYS ahead: a decode row reads its context
     * once, from memory, in rows spread over blocks where the hardware
     * prefetcher loses the stream, so the loads above would wait on DRAM.
     * Into L2 (prefetch_l2): into L1, a 1B decode row read a 2,000-token
     * context at ~6 GB/s a thread. 64 keys ahead was level with 32, 128 behind. */
    const int ahead = t0 + KV_PREFETCH_KEYS;
    if (ahead < L) {
        int pb = ahead / BS, po = ahead % BS;
        const uint8_t *next = BLOCK_ROW(pb, po);
        for (int i = 0; i < 8 && ahead + i < L; i++) {
            for (size_t line = 0; line < row_bytes; line += 64) prefetch_l2(next + line);
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
static void attend(const AttnLayer *layer, const float *restrict qkv, size_t qkv_w,
                   float *restrict attn, int r0, int nrows, int h0, int count, float *restrict scratch) {
    const int D = layer->head_dim, H = layer->num_heads, KVH = layer->num_kv_heads;
    const int kvh = h0 / (H / KVH), heads = nrows * count; /* (row, head) pairs, row-major */
    int lengths[ATTEND_ROWS], longest = 0;
    for (int j = 0; j < nrows; j++) {
        lengths[j] = (int)layer->positions[r0 + j] + 1;
        longest = lengths[j] > longest ? lengths[j] : longest;
    }
    const size_t Lpad = ((size_t)longest + KEY_PAD - 1) / KEY_PAD * KEY_PAD;
    const int64_t *table = layer->tables + (size_t)(layer->row_seq ? layer->row_seq[r0] : r0) * layer->max_blocks;
    const void *kc = layer->k_cache, *vc = layer->v_cache;
    float *scores = scratch, *acc = scratch + (size_t)heads * Lpad; /* [heads, Lpad], [heads, D] */
    float inv[ATTEND_ROWS * 64];
    float widened[PV_KEYS * 512]; /* narrower rows as floats */
    const void *rows[8];
    float row_scales[8];
    const int widen = nrows > 1 && layer->kv_format != KV_F32, format = widen ? KV_F32 : layer->kv_format;

    if (layer->kv_format == KV_INT8) {
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
                key_rows(layer, kc, table, kvh, KVH, D, t0 + c < longest ? t0 + c : t0, longest, 0, 0, krows + c,
                         key_scales + c, NULL);
            for (int i = 0; i < KT_KEYS; i++) key_scales[i] = key_scales[i] * layer->scale;
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
            key_rows(layer, kc, table, kvh, KVH, D, t0, longest, widen, 0, rows, row_scales, widened);
            const f8 key_scales = load8(row_scales) * layer->scale;
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
            key_rows(layer, vc, table, kvh, KVH, D, t0 + c, longest, widen, 1, vrows + c, vrow_scales + c,
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

/* 1 if attend serves these shapes (its loops and stack buffers assume them). */
static inline int attend_supported(int head_dim, int num_heads, int num_kv_heads) {
    return head_dim >= 8 && head_dim % 8 == 0 && head_dim <= 512 && num_kv_heads >= 1 && num_heads % num_kv_heads == 0
           && num_heads / num_kv_heads <= 64;
}

/* Floats of scratch one thread's attend calls need: up to ATTEND_ROWS rows of
 * `group` heads whose positions are at most max_position. */
static inline size_t attend_scratch_floats(int group, int max_position, int head_dim) {
    return (size_t)ATTEND_ROWS * group *
           (((size_t)max_position + KEY_PAD) / KEY_PAD * KEY_PAD + (size_t)head_dim + (size_t)head_dim / 2 + 2);
}

#endif
