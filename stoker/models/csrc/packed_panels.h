/* Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 weights repacked once into the GEMM's panel order (included by
 * ggml_quant.c after the GEMM; every build packs and unpacks, the SIMD builds
 * multiply).
 *
 * Why: the GEMM unpacks every panel of GEMM_PANEL weight rows into VNNI order
 * on each call. A decode step of 16 sequences reads every weight once, so that
 * unpack is paid per step and shared by only 16 rows: on the 1B rung's 16-row
 * step it was ~26% of the time (docs/perf/decode-step.md), where the tiles
 * themselves run at the prompt GEMM's rate. Stored in panel order, the tile
 * reads the weights directly, whatever the row count, and the small row counts
 * (one row per decoding sequence) read the same bytes.
 *
 * Layout: the weight's rows in panels of P = PACKED_PANEL (32) columns, the last
 * one padded with zero columns; per panel, per 256-value super-block sb, a
 * stretch of bytes (the same in every build: a 256-bit build's GEMM takes a
 * panel as two of its 16 columns), PACKED_SB_Q4_K:
 *     d     fp16 [P]            the super-block scale, as stored
 *     dmin  fp16 [P]
 *     sc    u8   [8][P]         sub-block j's 6-bit scale of each column
 *     mn    u8   [4][P][2]      the 6-bit mins of sub-blocks 2i and 2i + 1
 *     qs    u8   [4][8][P][4]   pair i, dword t: each column's stored dword 8i + t
 * A stored Q4_K byte 32i + e holds sub-block 2i's value e in its low nibble and
 * sub-block 2i + 1's in its high one, so qs is the stored bytes transposed by
 * dwords (4 values of each nibble, the panel's columns side by side) and the
 * tile splits the nibbles as it loads them. 148 bytes a column and super-block
 * against the file's 144: the scales decoded to bytes and no 6-bit packing.
 * Q8_0, per 32-value block, PACKED_B_Q8_0 (34 bytes a column, as stored): d as
 * stored, fp16 [P], then the values + 128 (the GEMM's unsigned operand) as
 * u8 [8][P][4], dword t of each column: the GEMM's own panel, so its tile has
 * nothing to take apart.
 *
 * Q5_0, per 32-value block, PACKED_B_Q5_0 (22 bytes a column, as stored): d as
 * stored, fp16 [P]; the fifth bits as byte masks, u64 [8][2]: row t of the
 * GEMM's panel (the block's values 4t .. 4t + 3), columns 16g .. 16g + 15, bit
 * 4c + e the fifth bit of column 16g + c's value 4t + e; then the 16 stored
 * nibble bytes transposed by dwords, u8 [4][P][4] (dword t's low nibbles are
 * row t, its high ones row t + 4, as in nibble_panel). The tile splits the
 * nibbles as Q4_K's does and adds each row's fifth bits by one masked add
 * (AVX-512) or with_high_bits' spread of half a u64 (256-bit builds). Q4_0 is
 * the same without the masks, PACKED_B_Q4_0 (18 bytes a column, as stored).
 *
 * Q6_K, per super-block, PACKED_SB_Q6_K (210 bytes a column, as stored):
 *     d     fp16 [P]            as stored
 *     sc    i8   [16][P]        16-value group g's scale of each column
 *     ql    u8   [4][8][P][4]   the stored ql bytes 32s .. 32s + 31, by dwords
 *     qh    u8   [2][8][P][4]   the stored qh bytes 32h .. 32h + 31, by dwords
 * Chunk 4h + c of a super-block (its values 128h + 32c ..) is the low (c < 2)
 * or high nibbles of ql stretch 2h + (c & 1) with bits 2c, 2c + 1 of qh
 * stretch h as bits 4-5: the tile joins the two as it loads them (one
 * vpternlogd with AVX-512). At 16 rows the GEMM unpacked every Q6_K panel per
 * call and its tiles then read it again: on the 1B rung (its LM head and half
 * its v and down are Q6_K) Q6_K was ~31% of a 16-row step for a third of the
 * multiply-adds (docs/perf/decode-step.md, "Q6_K packed").
 *
 * Every output is the same integers and the same fp32 operations as
 * gemm_tile_k's or gemm_tile's (and so the small tiles'): bit for bit the unpacked kernels'
 * result, whatever the row count. */

#define PACKED_PANEL 32
#define PACKED_SB_Q4_K ((size_t)PACKED_PANEL * 148)
#define PACKED_B_Q8_0 ((size_t)PACKED_PANEL * 34) /* d fp16 [P], then q + 128 [8][P][4] */
#define PACKED_B_Q5_0 ((size_t)PACKED_PANEL * 22) /* d fp16 [P], fifth bits u64 [8][2], nibbles [4][P][4] */
#define PACKED_B_Q4_0 ((size_t)PACKED_PANEL * 18) /* d fp16 [P], nibbles [4][P][4] */
#define PACKED_SB_Q6_K ((size_t)PACKED_PANEL * 210)
#define PACKED_Q5_QH ((size_t)PACKED_PANEL * 2)
#define PACKED_Q6_SC ((size_t)PACKED_PANEL * 2)
#define PACKED_Q6_QL ((size_t)PACKED_PANEL * 18)
#define PACKED_Q6_QH ((size_t)PACKED_PANEL * 146)
#define PACKED_D 0
#define PACKED_DMIN ((size_t)PACKED_PANEL * 2)
#define PACKED_SC ((size_t)PACKED_PANEL * 4)
#define PACKED_MN ((size_t)PACKED_PANEL * 12)
#define PACKED_QS ((size_t)PACKED_PANEL * 20)

ALWAYS_INLINE int packable(int type) {
    return type == Q4_K || type == Q6_K || type == Q8_0 || type == Q5_0 || type == Q4_0;
}

/* Bytes of one panel of k-wide rows. */
ALWAYS_INLINE size_t packed_panel_bytes(int type, int k) {
    return type == Q8_0   ? (size_t)(k / 32) * PACKED_B_Q8_0
           : type == Q5_0 ? (size_t)(k / 32) * PACKED_B_Q5_0
           : type == Q4_0 ? (size_t)(k / 32) * PACKED_B_Q4_0
           : type == Q6_K ? (size_t)(k / 256) * PACKED_SB_Q6_K
                          : (size_t)(k / 256) * PACKED_SB_Q4_K;
}

/* Where a packed Q5_0 or Q4_0 block's nibbles start, and where the stored block's. */
ALWAYS_INLINE size_t packed_nibbles_at(int type) { return type == Q5_0 ? PACKED_Q5_QH + 128 : PACKED_Q5_QH; }
ALWAYS_INLINE int stored_nibbles_at(int type) { return type == Q5_0 ? 6 : 2; }

/* Byte `at` of row c's stored super-block as dword rows of a packed panel: the
 * `dwords` dwords from blk + at to dst's dword rows 0 .. dwords - 1 (stride P dwords), column c. */
ALWAYS_INLINE void scatter_dwords(const uint8_t *blk, int dwords, uint8_t *dst, int c) {
    for (int t = 0; t < dwords; t++) memcpy(dst + ((size_t)t * PACKED_PANEL + c) * 4, blk + 4 * t, 4);
}
ALWAYS_INLINE void gather_dwords(const uint8_t *src, int dwords, uint8_t *blk, int c) {
    for (int t = 0; t < dwords; t++) memcpy(blk + 4 * t, src + ((size_t)t * PACKED_PANEL + c) * 4, 4);
}

/* Panel p of W (n rows of row_bytes) into dst: one thread's share of the packing. */
static void pack_panel_q4_k(const uint8_t *w, size_t row_bytes, int n, int k, int p, uint8_t *dst) {
    const int P = PACKED_PANEL, nsb = k / 256, j0 = p * P;
    memset(dst, 0, packed_panel_bytes(Q4_K, k));
    for (int c = 0; c < P && j0 + c < n; c++) {
        const uint8_t *row = w + (size_t)(j0 + c) * row_bytes;
        for (int sb = 0; sb < nsb; sb++) {
            const uint8_t *blk = row + (size_t)sb * 144;
            uint8_t *out = dst + (size_t)sb * PACKED_SB_Q4_K;
            memcpy(out + PACKED_D + 2 * c, blk, 2);
            memcpy(out + PACKED_DMIN + 2 * c, blk + 2, 2);
            uint64_t sc8, mn8;
            k_scales_mins(blk + 4, &sc8, &mn8);
            for (int j = 0; j < 8; j++) {
                out[PACKED_SC + (size_t)j * P + c] = (uint8_t)(sc8 >> (8 * j));
                out[PACKED_MN + ((size_t)(j / 2) * P + c) * 2 + (j & 1)] = (uint8_t)(mn8 >> (8 * j));
            }
            scatter_dwords(blk + 16, 32, out + PACKED_QS, c);
        }
    }
}

/* The inverse, for dequantizing a packed weight: rows j0 .. j0 + cols - 1 of W
 * from panel p (the 12-byte scale encoding rebuilt from the bytes). */
static void unpack_panel_q4_k(const uint8_t *src, int k, int p, int n, uint8_t *w, size_t row_bytes) {
    const int P = PACKED_PANEL, nsb = k / 256, j0 = p * P;
    for (int c = 0; c < P && j0 + c < n; c++) {
        uint8_t *row = w + (size_t)(j0 + c) * row_bytes;
        for (int sb = 0; sb < nsb; sb++) {
            uint8_t *blk = row + (size_t)sb * 144;
            const uint8_t *in = src + (size_t)sb * PACKED_SB_Q4_K;
            memcpy(blk, in + PACKED_D + 2 * c, 2);
            memcpy(blk + 2, in + PACKED_DMIN + 2 * c, 2);
            uint8_t sc[8], mn[8];
            for (int j = 0; j < 8; j++) {
                sc[j] = in[PACKED_SC + (size_t)j * P + c];
                mn[j] = in[PACKED_MN + ((size_t)(j / 2) * P + c) * 2 + (j & 1)];
            }
            uint8_t *s = blk + 4; /* scale_min_k4's encoding */
            for (int j = 0; j < 4; j++) {
                s[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
                s[j + 4] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
                s[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
            }
            gather_dwords(in + PACKED_QS, 32, blk + 16, c);
        }
    }
}

/* pack_panel_q4_k for Q6_K: d and the scales as stored, ql and qh by dwords. */
static void pack_panel_q6_k(const uint8_t *w, size_t row_bytes, int n, int k, int p, uint8_t *dst) {
    const int P = PACKED_PANEL, nsb = k / 256, j0 = p * P;
    memset(dst, 0, packed_panel_bytes(Q6_K, k));
    for (int c = 0; c < P && j0 + c < n; c++) {
        const uint8_t *row = w + (size_t)(j0 + c) * row_bytes;
        for (int sb = 0; sb < nsb; sb++) {
            const uint8_t *blk = row + (size_t)sb * 210;
            uint8_t *out = dst + (size_t)sb * PACKED_SB_Q6_K;
            memcpy(out + 2 * c, blk + 208, 2);
            for (int g = 0; g < 16; g++) out[PACKED_Q6_SC + (size_t)g * P + c] = blk[192 + g];
            scatter_dwords(blk, 32, out + PACKED_Q6_QL, c);
            scatter_dwords(blk + 128, 16, out + PACKED_Q6_QH, c);
        }
    }
}

/* unpack_panel_q4_k for Q6_K. */
static void unpack_panel_q6_k(const uint8_t *src, int k, int p, int n, uint8_t *w, size_t row_bytes) {
    const int P = PACKED_PANEL, nsb = k / 256, j0 = p * P;
    for (int c = 0; c < P && j0 + c < n; c++) {
        uint8_t *row = w + (size_t)(j0 + c) * row_bytes;
        for (int sb = 0; sb < nsb; sb++) {
            uint8_t *blk = row + (size_t)sb * 210;
            const uint8_t *in = src + (size_t)sb * PACKED_SB_Q6_K;
            memcpy(blk + 208, in + 2 * c, 2);
            for (int g = 0; g < 16; g++) blk[192 + g] = in[PACKED_Q6_SC + (size_t)g * P + c];
            gather_dwords(in + PACKED_Q6_QL, 32, blk, c);
            gather_dwords(in + PACKED_Q6_QH, 16, blk + 128, c);
        }
    }
}

/* pack_panel_q4_k for Q8_0: per 32-block, d as stored and the values + 128 (the GEMM's unsigned operand). */
static void pack_panel_q8_0(const uint8_t *w, size_t row_bytes, int n, int k, int p, uint8_t *dst) {
    const int P = PACKED_PANEL, nb = k / 32, j0 = p * P;
    memset(dst, 0, packed_panel_bytes(Q8_0, k));
    for (int c = 0; c < P && j0 + c < n; c++) {
        const uint8_t *row = w + (size_t)(j0 + c) * row_bytes;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * 34;
            uint8_t *out = dst + (size_t)b * PACKED_B_Q8_0;
            memcpy(out + 2 * c, blk, 2);
            uint8_t biased[32];
            for (int e = 0; e < 32; e++) biased[e] = (uint8_t)(blk[2 + e] ^ 0x80);
            scatter_dwords(biased, 8, out + 2 * (size_t)P, c);
        }
    }
}

/* unpack_panel_q4_k for Q8_0. */
static void unpack_panel_q8_0(const uint8_t *src, int k, int p, int n, uint8_t *w, size_t row_bytes) {
    const int P = PACKED_PANEL, nb = k / 32, j0 = p * P;
    for (int c = 0; c < P && j0 + c < n; c++) {
        uint8_t *row = w + (size_t)(j0 + c) * row_bytes;
        for (int b = 0; b < nb; b++) {
            uint8_t *blk = row + (size_t)b * 34;
            const uint8_t *in = src + (size_t)b * PACKED_B_Q8_0;
            memcpy(blk, in + 2 * c, 2);
            gather_dwords(in + 2 * (size_t)P, 8, blk + 2, c);
            for (int e = 0; e < 32; e++) blk[2 + e] ^= 0x80;
        }
    }
}

/* pack_panel_q4_k for Q5_0 and Q4_0: d as stored, (Q5_0) each column's u32 of fifth bits
 * spread over the rows' u64 masks (4 bits a column and row), the nibble bytes by dwords. */
static void pack_panel_nibbles(int type, const uint8_t *w, size_t row_bytes, int n, int k, int p, uint8_t *dst) {
    const int P = PACKED_PANEL, nb = k / 32, j0 = p * P, stored = ggml_quant_type_size(type);
    const size_t packed = packed_panel_bytes(type, 32);
    memset(dst, 0, packed_panel_bytes(type, k));
    for (int c = 0; c < P && j0 + c < n; c++) {
        const uint8_t *row = w + (size_t)(j0 + c) * row_bytes;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * stored;
            uint8_t *out = dst + (size_t)b * packed;
            memcpy(out + 2 * c, blk, 2);
            scatter_dwords(blk + stored_nibbles_at(type), 4, out + packed_nibbles_at(type), c);
            if (type != Q5_0) continue;
            uint32_t h;
            memcpy(&h, blk + 2, sizeof h);
            for (int t = 0; t < 8; t++) {
                uint64_t mask;
                uint8_t *at = out + PACKED_Q5_QH + (size_t)(2 * t + c / 16) * 8;
                memcpy(&mask, at, sizeof mask);
                mask |= (uint64_t)((h >> (4 * t)) & 0xF) << (4 * (c % 16));
                memcpy(at, &mask, sizeof mask);
            }
        }
    }
}

/* unpack_panel_q4_k for Q5_0 and Q4_0. */
static void unpack_panel_nibbles(int type, const uint8_t *src, int k, int p, int n, uint8_t *w, size_t row_bytes) {
    const int P = PACKED_PANEL, nb = k / 32, j0 = p * P, stored = ggml_quant_type_size(type);
    const size_t packed = packed_panel_bytes(type, 32);
    for (int c = 0; c < P && j0 + c < n; c++) {
        uint8_t *row = w + (size_t)(j0 + c) * row_bytes;
        for (int b = 0; b < nb; b++) {
            uint8_t *blk = row + (size_t)b * stored;
            const uint8_t *in = src + (size_t)b * packed;
            memcpy(blk, in + 2 * c, 2);
            gather_dwords(in + packed_nibbles_at(type), 4, blk + stored_nibbles_at(type), c);
            if (type != Q5_0) continue;
            uint32_t h = 0;
            for (int t = 0; t < 8; t++) {
                uint64_t mask;
                memcpy(&mask, in + PACKED_Q5_QH + (size_t)(2 * t + c / 16) * 8, sizeof mask);
                h |= (uint32_t)((mask >> (4 * (c % 16))) & 0xF) << (4 * t);
            }
            memcpy(blk + 2, &h, sizeof h);
        }
    }
}

#if EXACT_KERNELS
/* AVX2's maddubs would saturate on Q8_0's values + 128: that path keeps its blocks on the tile kernels. */
ALWAYS_INLINE int packed_serves(int type) {
    return type == Q4_K || type == Q6_K || type == Q5_0 || type == Q4_0 || (type == Q8_0 && QUANT_ISA != 1);
}

#if QUANT_ISA == 3
#define PV_SC(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define PV_MN(p) _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define PV_D(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define PV_LOW4(v) _mm512_and_si512(v, _mm512_set1_epi8(0x0F))
#define PV_HIGH4(v) _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F))
#define PV_NEG(v) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)))
/* v's bytes + 0x10 where the u64 at p has their bit (v's values are nibbles: + is or) */
#define PV_FIFTH(v, p) _mm512_mask_add_epi8(v, (__mmask64)load_u64(p), v, _mm512_set1_epi8(0x10))
#define PV_SC8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#else
#define PV_SC(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define PV_MN(p) _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define PV_D(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define PV_LOW4(v) _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
#define PV_HIGH4(v) _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F))
#define PV_NEG(v) _mm256_xor_ps(v, _mm256_set1_ps(-0.f))
#define PV_FIFTH(v, p) with_high_bits(v, p) /* the u32 at p: 8 columns' bits */
#define PV_SC8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#endif

/* A packed Q6_K dword row's values of chunk c (0..3 of its half): ql's low (c < 2)
 * or high nibbles, qh's bits 2c and 2c + 1 as bits 4-5 (16-bit shifts: what
 * crosses into a neighbouring byte is masked off). */
ALWAYS_INLINE gemm_i q6_join(gemm_i ql, gemm_i qh, const int c) {
#if QUANT_ISA == 3
    const __m512i h = c == 0   ? _mm512_slli_epi16(qh, 4)
                      : c == 1 ? _mm512_slli_epi16(qh, 2)
                      : c == 2 ? qh
                               : _mm512_srli_epi16(qh, 2);
    const __m512i l = c >= 2 ? _mm512_srli_epi16(ql, 4) : ql;
    /* bits 0-3 from l, the rest from h (0xE4: c ? a : b) */
    return _mm512_ternarylogic_epi32(l, _mm512_and_si512(h, _mm512_set1_epi8(0x30)), _mm512_set1_epi8(0x0F), 0xE4);
#else
    const __m256i h = c == 0   ? _mm256_slli_epi16(qh, 4)
                      : c == 1 ? _mm256_slli_epi16(qh, 2)
                      : c == 2 ? qh
                               : _mm256_srli_epi16(qh, 2);
    const __m256i l = c >= 2 ? _mm256_srli_epi16(ql, 4) : ql;
    return _mm256_or_si256(_mm256_and_si256(l, _mm256_set1_epi8(0x0F)), _mm256_and_si256(h, _mm256_set1_epi8(0x30)));
#endif
}

/* Chunk j's ql and qh dword rows in a packed Q6_K super-block, at the tile's first column c0. */
ALWAYS_INLINE const uint8_t *q6_ql_rows(const uint8_t *in, int j, int c0) {
    return in + PACKED_Q6_QL + (size_t)(2 * (j / 4) + (j & 1)) * 8 * 4 * PACKED_PANEL + (size_t)c0 * 4;
}
ALWAYS_INLINE const uint8_t *q6_qh_rows(const uint8_t *in, int j, int c0) {
    return in + PACKED_Q6_QH + (size_t)(j / 4) * 8 * 4 * PACKED_PANEL + (size_t)c0 * 4;
}

ALWAYS_INLINE uint64_t load_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* s[r] += the dots of x's rows with sub-block 2i + high (pair: pair i's 8 dword rows, at the tile's first column). */
ALWAYS_INLINE void packed_dots(const int MR, const int high, const int8_t *const *x, int b, const uint8_t *pair,
                               gemm_i s[GEMM_MR][2]) {
    for (int t = 0; t < 8; t++) {
        const gemm_i raw0 = GV_LOAD_I(pair + (size_t)t * 4 * PACKED_PANEL);
        const gemm_i raw1 = GV_LOAD_I(pair + (size_t)t * 4 * PACKED_PANEL + 4 * GEMM_LANES);
        gemm_dot_rows(MR, x, b, t, high ? PV_HIGH4(raw0) : PV_LOW4(raw0), high ? PV_HIGH4(raw1) : PV_LOW4(raw1), s);
    }
}

/* A tile's rows of x, its outputs zeroed. */
ALWAYS_INLINE void packed_tile_start(const int MR, const xq_t *xq, const size_t *at, const int8_t *x[GEMM_MR],
                                     gemm_f out[GEMM_MR][2]) {
    for (int r = 0; r < MR; r++) {
        x[r] = xq_row(xq, at[r]);
        out[r][0] = out[r][1] = GV_ZERO_F();
    }
}

/* out[r] += float(P) * d_w * d_x: the term of unit u of a row's units (a Q4_K
 * super-block, a Q8_0 block; d: the fp16 d of the tile's columns). */
ALWAYS_INLINE void packed_d_term(const int MR, const xq_t *xq, const size_t *at, int units, int u, const uint8_t *d,
                                 gemm_i p[GEMM_MR][2], gemm_f out[GEMM_MR][2]) {
    const gemm_f d0 = PV_D(d), d1 = PV_D(d + 2 * GEMM_LANES);
    for (int r = 0; r < MR; r++) {
        const gemm_f dx = GV_SET1_F(xq->d[at[r] * (size_t)units + u]);
        out[r][0] = GV_FMADD(GV_MUL_F(GV_CVT(p[r][0]), d0), dx, out[r][0]);
        out[r][1] = GV_FMADD(GV_MUL_F(GV_CVT(p[r][1]), d1), dx, out[r][1]);
    }
}

/* MR rows of x (at[]) by GEMM_PANEL columns of a packed panel from column c0:
 * gemm_tile_k's Q4_K arithmetic, the weights read where they lie. */
ALWAYS_INLINE void packed_tile_q4_k(const int MR, const xq_t *xq, const size_t *at, int nsb, const uint8_t *panel,
                                    int c0, panel_ahead_t pf, gemm_f out[GEMM_MR][2]) {
    const int k = xq->k, P = PACKED_PANEL;
    const int8_t *x[GEMM_MR];
    packed_tile_start(MR, xq, at, x, out);
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *in = panel + (size_t)sb * PACKED_SB_Q4_K;
        gemm_i p[GEMM_MR][2], s[GEMM_MR][2];
        for (int r = 0; r < MR; r++) p[r][0] = p[r][1] = s[r][0] = s[r][1] = GV_ZERO_I();
        for (int j = 0; j < 8; j++) {
            const int b = sb * 8 + j;
            prefetch_share(pf, b, nsb * 8);
            packed_dots(MR, j & 1, x, b, in + PACKED_QS + (size_t)(j / 2) * 8 * 4 * P + (size_t)c0 * 4, s);
            const uint8_t *sc = in + PACKED_SC + (size_t)j * P + c0;
            gemm_scale_into(MR, PV_SC(sc), PV_SC(sc + GEMM_LANES), s, p);
        }
        packed_d_term(MR, xq, at, nsb, sb, in + PACKED_D + 2 * (size_t)c0, p, out);
        const uint8_t *dmin = in + PACKED_DMIN + 2 * (size_t)c0;
        const gemm_f m0 = PV_NEG(PV_D(dmin)), m1 = PV_NEG(PV_D(dmin + 2 * GEMM_LANES));
        gemm_i mnv[4][2];
        for (int i = 0; i < 4; i++) {
            const uint8_t *mi = in + PACKED_MN + ((size_t)i * P + c0) * 2;
            mnv[i][0] = PV_MN(mi);
            mnv[i][1] = PV_MN(mi + 2 * GEMM_LANES);
        }
        for (int r = 0; r < MR; r++) {
            const gemm_f dx = GV_SET1_F(xq->d[at[r] * (size_t)nsb + sb]);
            /* M, as gemm_tile_k (its term after P's, as there) */
            gemm_i mm[2];
            k_mins_dots(xq->isum + at[r] * (size_t)(k / 32) + (size_t)sb * 8, (const gemm_i(*)[2])mnv, mm);
            out[r][0] = GV_FMADD(GV_MUL_F(GV_CVT(mm[0]), m0), dx, out[r][0]);
            out[r][1] = GV_FMADD(GV_MUL_F(GV_CVT(mm[1]), m1), dx, out[r][1]);
        }
    }
}

/* Chunk j = 4h + c of a packed Q6_K super-block (c a constant: its shifts are
 * immediates; a loop over c, branching on it, read one row of the 1B's down from
 * L3 at 0.81-0.89x the blocks' speed, against 1.09-1.10x so): the dots of each
 * 16-value group, from -32 times x's sum over it, times the group's scale into p. */
ALWAYS_INLINE void packed_chunk_q6_k(const int MR, const int c, const int8_t *const *x, const int16_t *const *bs,
                                     const uint8_t *in, int sb, int h, int c0, gemm_i p[GEMM_MR][2]) {
    const int j = 4 * h + c, b = sb * 8 + j, P = PACKED_PANEL;
    const uint8_t *ql = q6_ql_rows(in, j, c0), *qh = q6_qh_rows(in, j, c0);
    gemm_i s[GEMM_MR][2];
    for (int g = 0; g < 2; g++) { /* the chunk's values 16g .. 16g + 15: dword rows 4g .. 4g + 3 */
        for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = GV_SET1_I(-32 * (int32_t)bs[r][2 * j + g]);
#pragma GCC unroll 4
        for (int t = 4 * g; t < 4 * g + 4; t++) {
            const uint8_t *l = ql + (size_t)t * 4 * P, *q = qh + (size_t)t * 4 * P;
            gemm_dot_rows(MR, x, b, t, q6_join(GV_LOAD_I(l), GV_LOAD_I(q), c),
                          q6_join(GV_LOAD_I(l + 4 * GEMM_LANES), GV_LOAD_I(q + 4 * GEMM_LANES), c), s);
        }
        const uint8_t *sc = in + PACKED_Q6_SC + (size_t)(2 * j + g) * P + c0;
        gemm_scale_into(MR, PV_SC8(sc), PV_SC8(sc + GEMM_LANES), s, p);
    }
}

/* MR rows of x by GEMM_PANEL columns of a packed Q6_K panel from column c0:
 * gemm_tile_k's Q6_K arithmetic, the values joined as they load. */
ALWAYS_INLINE void packed_tile_q6_k(const int MR, const xq_t *xq, const size_t *at, int nsb, const uint8_t *panel,
                                    int c0, panel_ahead_t pf, gemm_f out[GEMM_MR][2]) {
    const int k = xq->k;
    const int8_t *x[GEMM_MR];
    packed_tile_start(MR, xq, at, x, out);
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *in = panel + (size_t)sb * PACKED_SB_Q6_K;
        const int16_t *bs[GEMM_MR];
        for (int r = 0; r < MR; r++) bs[r] = xq->bsums + at[r] * (size_t)(k / 16) + (size_t)sb * 16;
        gemm_i p[GEMM_MR][2];
        for (int r = 0; r < MR; r++) p[r][0] = p[r][1] = GV_ZERO_I();
        for (int h = 0; h < 2; h++) {
            prefetch_share(pf, sb * 8 + 4 * h, nsb * 8);
            packed_chunk_q6_k(MR, 0, x, bs, in, sb, h, c0, p);
            prefetch_share(pf, sb * 8 + 4 * h + 1, nsb * 8);
            packed_chunk_q6_k(MR, 1, x, bs, in, sb, h, c0, p);
            prefetch_share(pf, sb * 8 + 4 * h + 2, nsb * 8);
            packed_chunk_q6_k(MR, 2, x, bs, in, sb, h, c0, p);
            prefetch_share(pf, sb * 8 + 4 * h + 3, nsb * 8);
            packed_chunk_q6_k(MR, 3, x, bs, in, sb, h, c0, p);
        }
        packed_d_term(MR, xq, at, nsb, sb, in + PACKED_D + 2 * (size_t)c0, p, out);
    }
}

/* MR rows of x by GEMM_PANEL columns of a packed Q8_0 panel from column c0: gemm_tile's
 * Q8_0 arithmetic (each block's dot from -128 times x's sum, then one fma). */
ALWAYS_INLINE void packed_tile_q8_0(const int MR, const xq_t *xq, const size_t *at, int nb, const uint8_t *panel,
                                    int c0, panel_ahead_t pf, gemm_f out[GEMM_MR][2]) {
    const int P = PACKED_PANEL;
    const int8_t *x[GEMM_MR];
    packed_tile_start(MR, xq, at, x, out);
    for (int b = 0; b < nb; b++) {
        const uint8_t *in = panel + (size_t)b * PACKED_B_Q8_0;
        gemm_i s[GEMM_MR][2];
        for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = GV_SET1_I(-128 * (int)xq->isum[at[r] * (size_t)nb + b]);
        prefetch_share(pf, b, nb);
        const uint8_t *q = in + 2 * (size_t)P + (size_t)c0 * 4;
        for (int t = 0; t < 8; t++)
            gemm_dot_rows(MR, x, b, t, GV_LOAD_I(q + (size_t)t * 4 * P), GV_LOAD_I(q + (size_t)t * 4 * P + 4 * GEMM_LANES),
                          s);
        packed_d_term(MR, xq, at, nb, b, in + 2 * (size_t)c0, s, out);
    }
}

/* Rows t (v[0], v[1]: the tile's two column vectors) and t + 4 (v[2], v[3]) of a packed
 * Q5_0 or Q4_0 block's GEMM_PANEL columns from c0: the values + gemm_offset. */
ALWAYS_INLINE void nibble_rows(const int type, const uint8_t *block, int c0, int t, gemm_i v[4]) {
    const uint8_t *q = block + packed_nibbles_at(type) + (size_t)c0 * 4 + (size_t)t * 4 * PACKED_PANEL;
    const gemm_i raw0 = GV_LOAD_I(q), raw1 = GV_LOAD_I(q + 4 * GEMM_LANES);
    v[0] = PV_LOW4(raw0), v[1] = PV_LOW4(raw1), v[2] = PV_HIGH4(raw0), v[3] = PV_HIGH4(raw1);
    if (type != Q5_0) return;
    const uint8_t *h = block + PACKED_Q5_QH + (size_t)(c0 / 16) * 8, *lo = h + (size_t)t * 16, *hi = lo + 64;
    /* the second vector's columns: the next half of the u64 (256-bit) or the next u64 */
    v[0] = PV_FIFTH(v[0], lo);
    v[1] = PV_FIFTH(v[1], lo + GEMM_LANES / 2);
    v[2] = PV_FIFTH(v[2], hi);
    v[3] = PV_FIFTH(v[3], hi + GEMM_LANES / 2);
}

/* MR rows of x by GEMM_PANEL columns of a packed Q5_0 or Q4_0 panel from column c0:
 * gemm_tile's arithmetic (the values + gemm_offset, so each block's dot from -offset
 * times x's sum), the values put together as they load. */
ALWAYS_INLINE void packed_tile_nibbles(const int type, const int MR, const xq_t *xq, const size_t *at, int nb,
                                       const uint8_t *panel, int c0, panel_ahead_t pf, gemm_f out[GEMM_MR][2]) {
    const int8_t *x[GEMM_MR];
    const int offset = gemm_offset(type);
    packed_tile_start(MR, xq, at, x, out);
    for (int b = 0; b < nb; b++) {
        const uint8_t *in = panel + (size_t)b * packed_panel_bytes(type, 32);
        gemm_i s[GEMM_MR][2];
        for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = GV_SET1_I(-offset * (int)xq->isum[at[r] * (size_t)nb + b]);
        prefetch_share(pf, b, nb);
        for (int t = 0; t < 4; t++) {
            gemm_i v[4];
            nibble_rows(type, in, c0, t, v);
            gemm_dot_rows(MR, x, b, t, v[0], v[1], s);
            gemm_dot_rows(MR, x, b, t + 4, v[2], v[3], s);
        }
        packed_d_term(MR, xq, at, nb, b, in + 2 * (size_t)c0, s, out);
    }
}
ALWAYS_INLINE void packed_tile_q5_0(const int MR, const xq_t *xq, const size_t *at, int nb, const uint8_t *panel,
                                    int c0, panel_ahead_t pf, gemm_f out[GEMM_MR][2]) {
    packed_tile_nibbles(Q5_0, MR, xq, at, nb, panel, c0, pf, out);
}
ALWAYS_INLINE void packed_tile_q4_0(const int MR, const xq_t *xq, const size_t *at, int nb, const uint8_t *panel,
                                    int c0, panel_ahead_t pf, gemm_f out[GEMM_MR][2]) {
    packed_tile_nibbles(Q4_0, MR, xq, at, nb, panel, c0, pf, out);
}

/* From PACKED_EXPAND_ROWS rows, a packed Q5_0 or Q4_0 panel's GEMM_PANEL columns from c0 are
 * put together once into the GEMM's unpacked panel (gemm_tile's scratch: the
 * values + gemm_offset by dword rows, d as floats) and swept by the GEMM's own
 * tiles: a prompt's many tiles would each take the values apart again (Q5_0
 * 5-9% slower than the GEMM at 512 rows). The same integers and floats, so the
 * same bits. */
#define PACKED_EXPAND_ROWS 32
/* Q6_K too (its values joined from two planes), but not where the AMX tiles
 * serve it: they, and packed Q4_K's, make their planes from the packed panel
 * itself (amx_planes_packed), and the rows past the last 16 take the packed tiles. */
ALWAYS_INLINE int packed_expands(int type, int m) {
    return (type == Q5_0 || type == Q4_0 || (type == Q6_K && !amx_packed_rows(Q6_K, m))) &&
           m >= PACKED_EXPAND_ROWS;
}
#if QUANT_ISA == 3
#define PV_STORE_I(p, v) _mm512_storeu_si512((void *)(p), v)
#else
#define PV_STORE_I(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#endif
ALWAYS_INLINE void packed_expand_nibbles(const int type, const uint8_t *panel, int nb, int c0, uint8_t *scratch) {
    float *d = (float *)(scratch + (size_t)nb * 32 * GEMM_PANEL);
    for (int b = 0; b < nb; b++) {
        const uint8_t *in = panel + (size_t)b * packed_panel_bytes(type, 32);
        uint8_t *dst = scratch + (size_t)b * 32 * GEMM_PANEL;
        for (int t = 0; t < 4; t++) {
            gemm_i v[4];
            nibble_rows(type, in, c0, t, v);
            uint8_t *row = dst + (size_t)t * 4 * GEMM_PANEL, *row4 = dst + (size_t)(t + 4) * 4 * GEMM_PANEL;
            PV_STORE_I(row, v[0]);
            PV_STORE_I(row + 4 * GEMM_LANES, v[1]);
            PV_STORE_I(row4, v[2]);
            PV_STORE_I(row4 + 4 * GEMM_LANES, v[3]);
        }
        GV_STORE_F(d + (size_t)b * GEMM_PANEL, PV_D(in + 2 * (size_t)c0));
        GV_STORE_F(d + (size_t)b * GEMM_PANEL + GEMM_LANES, PV_D(in + 2 * (size_t)(c0 + GEMM_LANES)));
    }
}

/* packed_expand_nibbles for Q6_K: gemm_unpack_k's panel (the values by dword rows,
 * each 32 values' lower and upper 16's scales as int32 in the places of the
 * scales and the mins, d as floats, dmin zero). */
static void packed_expand_q6_k(const uint8_t *panel, int nb, int c0, uint8_t *scratch) {
    const int nsb = nb / 8, P = PACKED_PANEL;
    int32_t *sc = (int32_t *)(scratch + (size_t)nb * 32 * GEMM_PANEL), *mn = sc + (size_t)nb * GEMM_PANEL;
    float *d = (float *)(mn + (size_t)nb * GEMM_PANEL), *dmin = d + (size_t)nsb * GEMM_PANEL;
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *in = panel + (size_t)sb * PACKED_SB_Q6_K;
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) { /* unrolled: q6_join's shifts by constants */
            const uint8_t *ql = q6_ql_rows(in, j, c0), *qh = q6_qh_rows(in, j, c0);
            uint8_t *dst = scratch + (size_t)(sb * 8 + j) * 32 * GEMM_PANEL;
            for (int t = 0; t < 8; t++)
                for (int v = 0; v < 2; v++) {
                    const size_t at = (size_t)t * 4 * P + 4 * (size_t)GEMM_LANES * v;
                    PV_STORE_I(dst + (size_t)t * 4 * GEMM_PANEL + 4 * (size_t)GEMM_LANES * v,
                               q6_join(GV_LOAD_I(ql + at), GV_LOAD_I(qh + at), j % 4));
                }
            const uint8_t *s = in + PACKED_Q6_SC + (size_t)(2 * j) * P + c0;
            for (int v = 0; v < 2; v++) {
                PV_STORE_I(sc + (size_t)(sb * 8 + j) * GEMM_PANEL + GEMM_LANES * v, PV_SC8(s + GEMM_LANES * v));
                PV_STORE_I(mn + (size_t)(sb * 8 + j) * GEMM_PANEL + GEMM_LANES * v, PV_SC8(s + P + GEMM_LANES * v));
            }
        }
        for (int v = 0; v < 2; v++) {
            const uint8_t *dv = in + PACKED_D + 2 * (size_t)(c0 + GEMM_LANES * v);
            GV_STORE_F(d + (size_t)sb * GEMM_PANEL + GEMM_LANES * v, PV_D(dv));
            GV_STORE_F(dmin + (size_t)sb * GEMM_PANEL + GEMM_LANES * v, GV_ZERO_F());
        }
    }
}

#if AMX_TILES
/* A packed Q4_K panel straight to the AMX planes (amx_tiles.h), no unpacked
 * copy between: w = sc * q split by the scale, sc = 8 * sh + sl, as the planes
 * hi = sh * q and lo = sl * q (each at most 7 * 15 = 105), so that P = 8 * (x .
 * hi) + x . lo, the same integer. An int16 lane holds two values of one column
 * (a dword row's bytes) whose products are below 256, so one vpmullw by the
 * column's sh (in both halves of its dword) makes both bytes: no carry crosses.
 * The mins as int16 pairs and d, -dmin as floats go where amx_take reads them
 * (gemm_unpack_k's places). Made through the unpacked panel and amx_planes
 * (each value widened to int16, multiplied, split), the planes cost more than
 * 16 rows' dots: the tiles served from 64 rows only. */
static void amx_planes_q4_k_sb(const uint8_t *panel, int sb, int nb, uint8_t *scratch, int8_t *hi, int8_t *lo,
                               panel_ahead_t pf) {
    const int nsb = nb / 8, P = PACKED_PANEL;
    int32_t *mn = (int32_t *)(scratch + (size_t)nb * 32 * GEMM_PANEL) + (size_t)nb * GEMM_PANEL;
    float *d = (float *)(mn + (size_t)nb * GEMM_PANEL), *dmin = d + (size_t)nsb * GEMM_PANEL;
    const __m512i seven = _mm512_set1_epi32(7);
    const uint8_t *in = panel + (size_t)sb * PACKED_SB_Q4_K;
    for (int i = 0; i < 4; i++) { /* sub-blocks 2i (low nibbles) and 2i + 1 (high) */
        __m512i sh[2][2], sl[2][2]; /* [high][column half v]: each column's piece in both int16 lanes */
        for (int high = 0; high < 2; high++)
            for (int v = 0; v < 2; v++) {
                const __m512i s = PV_SC(in + PACKED_SC + (size_t)(2 * i + high) * P + GEMM_LANES * v);
                const __m512i h = _mm512_srli_epi32(s, 3), l = _mm512_and_si512(s, seven);
                sh[high][v] = _mm512_or_si512(h, _mm512_slli_epi32(h, 16));
                sl[high][v] = _mm512_or_si512(l, _mm512_slli_epi32(l, 16));
            }
        const uint8_t *pair = in + PACKED_QS + (size_t)i * 8 * 4 * P;
        for (int t = 0; t < 8; t++) {
            prefetch_share_l2(pf, i * 8 + t, 32);
            for (int v = 0; v < 2; v++) {
                const __m512i raw = GV_LOAD_I(pair + (size_t)t * 4 * P + 4 * GEMM_LANES * v);
                const __m512i q[2] = {PV_LOW4(raw), PV_HIGH4(raw)};
                for (int high = 0; high < 2; high++) {
                    const size_t out =
                        (size_t)(2 * i + high) * 32 * GEMM_PANEL + (size_t)t * 4 * GEMM_PANEL + 4 * (size_t)GEMM_LANES * v;
                    PV_STORE_I(hi + out, _mm512_mullo_epi16(q[high], sh[high][v]));
                    PV_STORE_I(lo + out, _mm512_mullo_epi16(q[high], sl[high][v]));
                }
            }
        }
    }
    for (int i = 0; i < 4; i++) {
        const uint8_t *mi = in + PACKED_MN + (size_t)i * P * 2;
        PV_STORE_I(mn + (size_t)(sb * 4 + i) * GEMM_PANEL, PV_MN(mi));
        PV_STORE_I(mn + (size_t)(sb * 4 + i) * GEMM_PANEL + GEMM_LANES, PV_MN(mi + 2 * GEMM_LANES));
    }
    GV_STORE_F(d + (size_t)sb * GEMM_PANEL, PV_D(in + PACKED_D));
    GV_STORE_F(d + (size_t)sb * GEMM_PANEL + GEMM_LANES, PV_D(in + PACKED_D + 2 * GEMM_LANES));
    GV_STORE_F(dmin + (size_t)sb * GEMM_PANEL, PV_NEG(PV_D(in + PACKED_DMIN)));
    GV_STORE_F(dmin + (size_t)sb * GEMM_PANEL + GEMM_LANES, PV_NEG(PV_D(in + PACKED_DMIN + 2 * GEMM_LANES)));
}

/* amx_planes_q4_k_sb for a packed Q6_K panel: w = sc * (q - 32), each of the
 * 16-value group's signed scale, split as amx_planes splits it (w = 64 * hi + lo,
 * lo in 0 .. 63, hi in -64 .. 64). An int16 lane holds two values of one column,
 * each taken out to an int16 of its own (the low byte by mask, the high by a
 * shift), multiplied by the column's scale and split; the two planes' bytes are
 * put back in their lanes by one masked blend each. No mins; d as floats where
 * amx_take reads it. Through the unpacked panel and amx_planes (widened and
 * narrowed by vpmovzxbw and vpmovwb, a panel at a time), the tiles paid only from
 * 64 rows; at 16 the VNNI tiles also scale every 16-value group's dots per row. */
static void amx_planes_q6_k_sb(const uint8_t *panel, int sb, int nb, uint8_t *scratch, int8_t *hi, int8_t *lo,
                               panel_ahead_t pf) {
    const int P = PACKED_PANEL;
    const int32_t *mn = (const int32_t *)(scratch + (size_t)nb * 32 * GEMM_PANEL) + (size_t)nb * GEMM_PANEL;
    float *d = (float *)(mn + (size_t)nb * GEMM_PANEL);
    const __m512i low_byte = _mm512_set1_epi16(0x00FF), thirty_two = _mm512_set1_epi16(32);
    const __m512i low6 = _mm512_set1_epi8(63);
    const __mmask64 high_bytes = 0xAAAAAAAAAAAAAAAAull;
    const uint8_t *in = panel + (size_t)sb * PACKED_SB_Q6_K;
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) { /* unrolled: q6_join's shifts by constants */
        const uint8_t *ql = q6_ql_rows(in, j, 0), *qh = q6_qh_rows(in, j, 0);
        for (int g = 0; g < 2; g++) { /* dword rows 4g .. 4g + 3: the 16-value group 2j + g */
            __m512i s[2]; /* [column half v]: each column's scale in both int16 lanes of its dword */
            for (int v = 0; v < 2; v++) {
                const __m512i s32 = PV_SC8(in + PACKED_Q6_SC + (size_t)(2 * j + g) * P + GEMM_LANES * v);
                s[v] = _mm512_or_si512(_mm512_and_si512(s32, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(s32, 16));
            }
            for (int t = 4 * g; t < 4 * g + 4; t++) {
                prefetch_share_l2(pf, j * 8 + t, 64);
                for (int v = 0; v < 2; v++) {
                    const size_t at = (size_t)t * 4 * P + 4 * (size_t)GEMM_LANES * v;
                    const __m512i q = q6_join(GV_LOAD_I(ql + at), GV_LOAD_I(qh + at), j % 4);
                    const __m512i even = _mm512_sub_epi16(_mm512_and_si512(q, low_byte), thirty_two);
                    const __m512i odd = _mm512_sub_epi16(_mm512_srli_epi16(q, 8), thirty_two);
                    const __m512i we = _mm512_mullo_epi16(even, s[v]), wo = _mm512_mullo_epi16(odd, s[v]);
                    const size_t out =
                        (size_t)j * 32 * GEMM_PANEL + (size_t)t * 4 * GEMM_PANEL + 4 * (size_t)GEMM_LANES * v;
                    /* bits 6-13 of each: the low byte's by a right shift, the high byte's by a left one */
                    PV_STORE_I(hi + out, _mm512_mask_blend_epi8(high_bytes, _mm512_srli_epi16(we, 6),
                                                                _mm512_slli_epi16(wo, 2)));
                    const __m512i lo_bytes = _mm512_mask_blend_epi8(high_bytes, we, _mm512_slli_epi16(wo, 8));
                    PV_STORE_I(lo + out, _mm512_and_si512(lo_bytes, low6));
                }
            }
        }
    }
    GV_STORE_F(d + (size_t)sb * GEMM_PANEL, PV_D(in + PACKED_D));
    GV_STORE_F(d + (size_t)sb * GEMM_PANEL + GEMM_LANES, PV_D(in + PACKED_D + 2 * GEMM_LANES));
}

/* A whole packed panel's planes (Q4_K or Q6_K), for prompts: made once, taken by every group of rows. */
static void amx_planes_packed(int type, const uint8_t *panel, int nb, uint8_t *scratch) {
    int8_t *hi = amx_hi(scratch, nb * 32), *lo = amx_lo(scratch, nb * 32);
    for (int sb = 0; sb < nb / 8; sb++) {
        int8_t *h = hi + (size_t)sb * 8 * 32 * GEMM_PANEL, *l = lo + (size_t)sb * 8 * 32 * GEMM_PANEL;
        if (type == Q4_K) amx_planes_q4_k_sb(panel, sb, nb, scratch, h, l, (panel_ahead_t){NULL, 0});
        else amx_planes_q6_k_sb(panel, sb, nb, scratch, h, l, (panel_ahead_t){NULL, 0});
    }
}
#endif

/* units: the weight's 256-value super-blocks (Q4_K, Q6_K) or 32-value blocks (Q8_0, Q5_0, Q4_0) a row. */
typedef void (*packed_tile_fn)(const xq_t *xq, const size_t *at, int units, const uint8_t *panel, int c0,
                               panel_ahead_t pf, gemm_f out[GEMM_MR][2]);
#define PACKED_TILE_FN(T, MR)                                                                                        \
    static void packed_tile_##T##_##MR(const xq_t *xq, const size_t *at, int units, const uint8_t *panel, int c0,  \
                                       panel_ahead_t pf, gemm_f out[GEMM_MR][2]) {                                   \
        packed_tile_##T(MR, xq, at, units, panel, c0, pf, out);                                                      \
    }
#if GEMM_MR == 6
#define PACKED_TILES(T)                                                                                              \
    PACKED_TILE_FN(T, 1) PACKED_TILE_FN(T, 2) PACKED_TILE_FN(T, 3) PACKED_TILE_FN(T, 4) PACKED_TILE_FN(T, 5)       \
        PACKED_TILE_FN(T, 6) static const packed_tile_fn packed_tiles_##T[GEMM_MR] = {                              \
            packed_tile_##T##_1, packed_tile_##T##_2, packed_tile_##T##_3,                                           \
            packed_tile_##T##_4, packed_tile_##T##_5, packed_tile_##T##_6};
#else
#define PACKED_TILES(T)                                                                                              \
    PACKED_TILE_FN(T, 1) PACKED_TILE_FN(T, 2) PACKED_TILE_FN(T, 3) static const packed_tile_fn                     \
        packed_tiles_##T[GEMM_MR] = {packed_tile_##T##_1, packed_tile_##T##_2, packed_tile_##T##_3};
#endif
/* The tiles of 1 .. GEMM_MR rows. */
PACKED_TILES(q4_k)
PACKED_TILES(q6_k)
PACKED_TILES(q8_0)
PACKED_TILES(q5_0)
PACKED_TILES(q4_0)
#undef PACKED_TILES
#undef PACKED_TILE_FN

/* Thread t's share of y = x @ W^T (+ bias; = or +=) for already quantized x and
 * W packed (n rows): its range of the packed panels in `claims` and what it
 * takes from the others' (panel_claim), each swept by all m rows GEMM_MR at a
 * time (a 256-bit build: each half of it), the tiles asking for the panel
 * PANELS_AHEAD on as they go. The same y writes as
 * gemm_thread, without its unpack (but a prompt's Q5_0 / Q4_0 panels,
 * packed_expands: into `scratch`, one GEMM panel a thread). */
static void packed_thread(int type, const uint8_t *packed, const xq_t *xq, int m, int n, void *y, long y_stride,
                          int y_bf16, const float *bias, int accumulate, uint8_t *scratch, panel_claims_t *claims,
                          int slots, int t) {
    const int units = xq->k / block_elems(type), halves = PACKED_PANEL / GEMM_PANEL;
    const size_t panel_bytes = packed_panel_bytes(type, xq->k);
    const packed_tile_fn *tiles_of = type == Q8_0   ? packed_tiles_q8_0
                                     : type == Q5_0 ? packed_tiles_q5_0
                                     : type == Q4_0 ? packed_tiles_q4_0
                                     : type == Q6_K ? packed_tiles_q6_k
                                                    : packed_tiles_q4_k;
    const int expanded = packed_expands(type, m);
    /* rows 0 .. m_amx - 1 on the AMX tiles (amx_tiles.h; m_amx may pass m: amx_packed_rows), the rest on
     * the packed tiles (or, expanded, the GEMM's) */
    const int m_amx = amx_packed_rows(type, m), m_vnni = m_amx < m ? m_amx : m;
    const int tiles = halves * ((m - m_vnni + GEMM_MR - 1) / GEMM_MR);
#if AMX_TILES
    if (m_amx) amx_begin();
#endif
    for (int p, end; (p = panel_claim(claims, slots, t, &end)) >= 0;) {
        const uint8_t *panel = packed + (size_t)p * panel_bytes;
        const size_t ahead_lines = p + PANELS_AHEAD < end ? panel_bytes / 64 : 0;
        int tile = 0;
        for (int h = 0; h < halves; h++) {
            const int j0 = p * PACKED_PANEL + h * GEMM_PANEL;
            if (j0 >= n) break;
            const int cols = n - j0 < GEMM_PANEL ? n - j0 : GEMM_PANEL;
            if (expanded && type == Q5_0) packed_expand_nibbles(Q5_0, panel, units, h * GEMM_PANEL, scratch);
            else if (expanded && type == Q4_0) packed_expand_nibbles(Q4_0, panel, units, h * GEMM_PANEL, scratch);
            else if (expanded && type == Q6_K) packed_expand_q6_k(panel, units * 8, h * GEMM_PANEL, scratch);
#if AMX_TILES
            const int fused = m_amx <= AMX_FUSED_MAX_ROWS;
            if (m_amx && !fused) amx_planes_packed(type, panel, units * 8, scratch);
            if (m_amx)
                amx_panel(type, type == Q4_K ? 3 : 6, xq, m_amx, m, units * 8, scratch, fused ? panel : NULL,
                          ahead_share(ahead_lines ? panel + PANELS_AHEAD * panel_bytes : NULL, ahead_lines, 0, 1), y,
                          y_stride, j0, cols, y_bf16, bias, accumulate);
#endif
            for (int i0 = m_vnni; i0 < m; i0 += GEMM_MR, tile++) {
                const int mr = m - i0 < GEMM_MR ? m - i0 : GEMM_MR;
                size_t at[GEMM_MR];
                for (int r = 0; r < mr; r++) at[r] = (size_t)(i0 + r);
                const uint8_t *ahead = ahead_lines ? panel + PANELS_AHEAD * panel_bytes : NULL;
                const panel_ahead_t pf = ahead_share(ahead, ahead_lines, (size_t)tile, (size_t)tiles);
                gemm_f out[GEMM_MR][2];
                if (expanded) gemm_tiles[mr - 1](type, xq, at, xq->k / 32, scratch, pf, out);
                else tiles_of[mr - 1](xq, at, units, panel, h * GEMM_PANEL, pf, out);
                write_tile(mr, at, out, y, y_stride, j0, cols, y_bf16, bias, accumulate);
            }
        }
    }
#if AMX_TILES
    if (m_amx) amx_end();
#endif
}
#else
ALWAYS_INLINE int packed_serves(int type) {
    (void)type;
    return 0;
}
ALWAYS_INLINE int packed_expands(int type, int m) {
    (void)type, (void)m;
    return 0;
}
#endif
