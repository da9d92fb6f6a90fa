/* The K-quants' GEMM on AMX-INT8 tiles, where the build targets AMX
 * (-mamx-tile -mamx-int8: the avx512_amx path) and the kernel lets this
 * process use the tile registers (amx_permitted). Included by ggml_quant.c
 * after the GEMM's tiles, which it stands beside.
 *
 * Why: a prompt's products are bound by the dots. AVX-512 VNNI takes 64
 * multiply-adds an instruction, plus a broadcast of x per four; one TDPBSSD
 * takes 16 rows of x by 16 columns by 64 values (16,384) on a unit of its own.
 *
 * The exact arithmetic (exact_k) needs each super-block's integer P = sum over
 * sub-blocks of scale * dot, then fp32 terms per super-block. Taking the tiles
 * out to memory after every 32-value sub-block (to multiply by its scale) left
 * the tile unit waiting on its own stores: a Q4_K product at 512 rows was only
 * 1.2x the VNNI GEMM, Q6_K 0.8x. Instead each value is multiplied by its scale
 * once per panel (amx_planes), as w = scale * q (Q6_K: scale * (q - 32)), at
 * most 13 bits, and split into two int8 planes, w = 64 * hi + lo with lo in
 * 0 .. 63. Then P = 64 * (x . hi) + x . lo over the whole super-block: four
 * TDPBSSD of 64 values a plane, accumulated in the tiles, and one store per
 * super-block. The same integer P (exact whatever the order of its sums), and
 * then gemm_tile_k's fp32 operations in its order, one lane per output: every
 * output is the VNNI GEMM's, bit for bit, and batch invariance holds across the
 * switch (which depends on m alone). The mins' term M (Q4_K, Q5_K) is the
 * vector units' as in gemm_tile_k. Packed Q4_K splits the scale instead (sc =
 * 8 * sh + sl: planes sh * q and sl * q, P = 8 * hi + lo), one multiply a
 * vector straight from the packed panel (amx_planes_q4_k_sb, packed_panels.h);
 * packed Q6_K splits the product as amx_planes does, but straight from its
 * packed panel too (amx_planes_q6_k_sb). Cheap enough that their tiles serve
 * from 16 rows, a super-block's planes made just before the tiles take them
 * while they stay in L1.
 *
 * The other types keep the VNNI GEMM: their exact arithmetic has an fp32 term
 * per 32-value block, so the tiles would go to memory every block; tried that
 * way, Q8_0, Q5_0 and Q4_0 products ran 0.8-1.1x the VNNI GEMM.
 *
 * Rows past the last whole AMX_ROWS (ggml_quant.c) of a call go through the
 * GEMM's tiles, or (packed) as one more group where that pays: amx_packed_rows. */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && QUANT_ISA == 3
#define AMX_TILES 1
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands a process the tile registers' state only on request (the
 * XTILEDATA permission, arch_prctl(ARCH_REQ_XCOMP_PERM)); granted once for
 * the whole process. 1 if granted, 0 if refused (then the VNNI GEMM serves). */
static int amx_permitted(void) {
    static volatile int state; /* 0 unknown, 1 granted, -1 refused */
    if (!state) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    }
    return state == 1;
}

/* From 64 rows: each panel's planes are made once per call, so the tiles
 * must have enough rows to pay for them. Against the VNNI GEMM, 2 threads, the
 * 1B rung's Q4_K products ran 0.6x at 16 rows, 0.9x at 32 and 1.2x at 64; Q6_K
 * 0.9x, 1.1x and 1.3x. */
#define AMX_MIN_ROWS 64
ALWAYS_INLINE int amx_serves(int type, int m) { return exact_k(type) && m >= AMX_MIN_ROWS && amx_permitted(); }

/* Packed Q4_K and Q6_K make their planes straight from the packed panel in one
 * pass (amx_planes_q4_k_sb, amx_planes_q6_k_sb: packed_panels.h), cheap enough
 * to pay from one group of 16 rows: a decode step of 16 sequences. Up to
 * AMX_FUSED_MAX_ROWS, each super-block's planes are made as the tiles take them
 * (in L1), for every pair of 16-row groups; past it, a panel's at once. */
#define AMX_FUSED_MAX_ROWS 64
/* Rows the AMX tiles take of a packed product of m rows: whole groups of 16,
 * and from AMX_PAD_MIN_ROWS left over one more group (x's rows past m are
 * loaded and their sums dropped: xq_t's qs holds AMX_ROWS - 1 rows more).
 * Before, a decode step of 15 sequences (the 16th prefilling) took the VNNI
 * tiles on all 15 rows, the LM head's 215 MB among them. Against the VNNI tiles
 * on the rest, one thread, the 1B's Q4_K and Q6_K products with the weight in
 * L3 paid from 10 rows (1.09x, 1.02x at 9), the Q6_K LM head from memory
 * from 13 (1.02x slower at 12, 1.03x faster at 13, 1.11x at 15); 1-6 rows left
 * after 16 or 64 cost less on the VNNI tiles than a group on the AMX ones (17
 * rows 1.03x, 70 rows 1.05x slower padded). */
#define AMX_PAD_MIN_ROWS 13
ALWAYS_INLINE int amx_packed_rows(int type, int m) {
    if ((type != Q4_K && type != Q6_K) || !amx_permitted()) return 0; /* the other packed types: the VNNI tiles */
    const int whole = m - m % AMX_ROWS;
    return m % AMX_ROWS >= AMX_PAD_MIN_ROWS ? whole + AMX_ROWS : whole;
}

/* Bytes of the two planes of a panel of k values a column, and where they lie:
 * after gemm_panel_bytes' panel in a thread's scratch. */
ALWAYS_INLINE size_t amx_planes_bytes(int k) { return 2 * (size_t)k * GEMM_PANEL; }
ALWAYS_INLINE int8_t *amx_hi(uint8_t *scratch, int k) { return (int8_t *)(scratch + gemm_panel_bytes(k)); }
ALWAYS_INLINE int8_t *amx_lo(uint8_t *scratch, int k) { return amx_hi(scratch, k) + (size_t)k * GEMM_PANEL; }

/* The unpacked K-quant panel (gemm_unpack_k's scratch: values by dword rows,
 * int32 scales a column per 32 values, Q6_K's upper 16 in the mins' place)
 * as the planes hi and lo of w = scale * value, in the same dword-row order:
 * each 64 bytes are 16 columns' 4 values, widened to int16 (32 a vector),
 * multiplied by their column's scale (each scale repeated for its 4 values),
 * then split. */
static void amx_planes(int type, int nb, const uint8_t *scratch, int8_t *hi, int8_t *lo) {
    const int32_t *sc = (const int32_t *)(scratch + (size_t)nb * 32 * GEMM_PANEL), *mn = sc + (size_t)nb * GEMM_PANEL;
    /* int16 lane 4c + e of a widened half (8 columns) takes column c's scale, an int32's low half: lane 2c */
    __m512i spread[2];
    for (int half = 0; half < 2; half++) {
        int16_t idx[32];
        for (int l = 0; l < 32; l++) idx[l] = (int16_t)(2 * (8 * half + l / 4));
        spread[half] = _mm512_loadu_si512(idx);
    }
    const __m512i low6 = _mm512_set1_epi16(63), offset = _mm512_set1_epi16(type == Q6_K ? 32 : 0);
    for (int b = 0; b < nb; b++)
        for (int t = 0; t < 8; t++) {
            /* Q6_K: rows 0-3 (values 0-15) take sc, rows 4-7 mn */
            const int32_t *scale = (type == Q6_K && t >= 4 ? mn : sc) + (size_t)b * GEMM_PANEL;
            const size_t at = (size_t)b * 32 * GEMM_PANEL + (size_t)t * 4 * GEMM_PANEL;
            for (int v = 0; v < 2; v++) { /* columns 16v .. 16v + 15 */
                const __m512i s = _mm512_loadu_si512(scale + GEMM_LANES * v);
                const __m512i q = _mm512_loadu_si512(scratch + at + 64 * (size_t)v);
                for (int half = 0; half < 2; half++) {
                    const __m256i bytes = half ? _mm512_extracti64x4_epi64(q, 1) : _mm512_castsi512_si256(q);
                    const __m512i w = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(bytes), offset),
                                                         _mm512_permutexvar_epi16(spread[half], s));
                    const size_t out = at + 64 * (size_t)v + 32 * (size_t)half;
                    _mm256_storeu_si256((__m256i *)(hi + out), _mm512_cvtepi16_epi8(_mm512_srai_epi16(w, 6)));
                    _mm256_storeu_si256((__m256i *)(lo + out), _mm512_cvtepi16_epi8(_mm512_and_si512(w, low6)));
                }
            }
        }
}

/* Tiles 0-3: C, 16 rows by 16 int32: row group g (of two) times the hi plane
 * at 2g, the lo plane at 2g + 1; 4, 5: A, row group g's 16 rows of x by 64
 * bytes; 6, 7: B, the hi and lo planes' 16 dword rows of 16 columns. Per thread
 * (tile state is); amx_end releases it. */
static void amx_begin(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = AMX_ROWS, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}
ALWAYS_INLINE void amx_end(void) { _tile_release(); }

/* c[h][g][plane][r][q]: row 16g + r of x with column 16h + q of the hi / lo plane, over
 * one super-block: x and the planes from where that super-block starts. The tile
 * registers are not renamed: a load into a tile waits for the TDPBSSDs that read
 * it. So each source is loaded for the next step as soon as its last reader has
 * issued, the next half's first ones before this half's stores: one super-block
 * of 32 rows in a loop (docs/perf/amx/tile_order.c) 389-394 -> 356-366 ns, a
 * 512-token prefill of the 1B rung on one thread 1.045x as fast (paired). */
typedef int32_t amx_c_t[2][2][2][AMX_ROWS][GEMM_LANES];
ALWAYS_INLINE void amx_superblock(const int G, const int8_t *x, size_t x_stride, const int8_t *hi,
                                  const int8_t *lo, amx_c_t c, panel_ahead_t pf) {
/* step's 64 values (two 32-value blocks' dword rows) of column half h in the planes */
#define AMX_W_AT(h, step) ((size_t)(2 * (step)) * 32 * GEMM_PANEL + (size_t)(h) * 4 * GEMM_LANES)
    _tile_loadd(6, hi + AMX_W_AT(0, 0), 4 * GEMM_PANEL);
    _tile_loadd(4, x, (long)x_stride);
    if (G == 2) _tile_loadd(5, x + AMX_ROWS * x_stride, (long)x_stride);
    _tile_loadd(7, lo + AMX_W_AT(0, 0), 4 * GEMM_PANEL);
    for (int h = 0; h < 2; h++) {
        _tile_zero(0);
        _tile_zero(1);
        if (G == 2) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int step = 0; step < 4; step++) {
            /* each source tile reloaded for the next step (the next half's first) once its last reader has issued */
            const int next_h = step < 3 ? h : h + 1, next_step = step < 3 ? step + 1 : 0, more = next_h < 2;
            _tile_dpbssd(0, 4, 6);
            if (G == 2) _tile_dpbssd(2, 5, 6);
            if (more) _tile_loadd(6, hi + AMX_W_AT(next_h, next_step), 4 * GEMM_PANEL);
            _tile_dpbssd(1, 4, 7);
            if (more) _tile_loadd(4, x + 64 * (size_t)next_step, (long)x_stride);
            if (G == 2) {
                _tile_dpbssd(3, 5, 7);
                if (more) _tile_loadd(5, x + 64 * (size_t)next_step + AMX_ROWS * x_stride, (long)x_stride);
            }
            if (more) _tile_loadd(7, lo + AMX_W_AT(next_h, next_step), 4 * GEMM_PANEL);
            prefetch_share_l2(pf, 4 * h + step, 8);
        }
        _tile_stored(0, c[h][0][0], 4 * GEMM_LANES);
        if (G == 2) _tile_stored(2, c[h][1][0], 4 * GEMM_LANES);
        _tile_stored(1, c[h][0][1], 4 * GEMM_LANES);
        if (G == 2) _tile_stored(3, c[h][1][1], 4 * GEMM_LANES);
    }
#undef AMX_W_AT
}

/* P = 2^shift * hi + lo of row r, column half h, from the tiles' sums (shift: 6 for
 * amx_planes' and amx_planes_q6_k_sb's planes, 3 for amx_planes_q4_k_sb's). */
ALWAYS_INLINE gemm_i amx_p(const int shift, amx_c_t c, int h, int r) {
    return GV_ADD_I(_mm512_slli_epi32(GV_LOAD_I(c[h][r / AMX_ROWS][0][r % AMX_ROWS]), shift),
                    GV_LOAD_I(c[h][r / AMX_ROWS][1][r % AMX_ROWS]));
}

/* gemm_tile_k's fp32 terms of super-block sb: P's, then M's (Q4_K, Q5_K) as there. */
ALWAYS_INLINE void amx_take(int rows, int type, const int shift, const xq_t *xq, size_t r0, int sb, int nb,
                            const uint8_t *scratch, amx_c_t c, float out[2 * AMX_ROWS][GEMM_PANEL]) {
    const int k = xq->k, nsb = nb / 8;
    const int32_t *mn = (const int32_t *)(scratch + (size_t)nb * 32 * GEMM_PANEL) + (size_t)nb * GEMM_PANEL;
    const float *d = (const float *)(mn + (size_t)nb * GEMM_PANEL), *dmin = d + (size_t)nsb * GEMM_PANEL;
    const gemm_f d0 = GV_LOAD_F(d + sb * GEMM_PANEL), d1 = GV_LOAD_F(d + sb * GEMM_PANEL + GEMM_LANES);
    const gemm_f m0 = GV_LOAD_F(dmin + sb * GEMM_PANEL), m1 = GV_LOAD_F(dmin + sb * GEMM_PANEL + GEMM_LANES);
    gemm_i mins[4][2];
    for (int i = 0; i < 4; i++) {
        mins[i][0] = GV_LOAD_I(mn + (size_t)(sb * 4 + i) * GEMM_PANEL);
        mins[i][1] = GV_LOAD_I(mn + (size_t)(sb * 4 + i) * GEMM_PANEL + GEMM_LANES);
    }
    for (int r = 0; r < rows; r++) {
        const size_t row = r0 + (size_t)r;
        const gemm_f dx = GV_SET1_F(xq->d[row * (size_t)nsb + sb]);
        gemm_f o0 = GV_FMADD(GV_MUL_F(GV_CVT(amx_p(shift, c, 0, r)), d0), dx, GV_LOAD_F(out[r]));
        gemm_f o1 = GV_FMADD(GV_MUL_F(GV_CVT(amx_p(shift, c, 1, r)), d1), dx, GV_LOAD_F(out[r] + GEMM_LANES));
        if (type != Q6_K) {
            gemm_i mm[2];
            k_mins_dots(xq->isum + row * (size_t)(k / 32) + (size_t)sb * 8, (const gemm_i(*)[2])mins, mm);
            o0 = GV_FMADD(GV_MUL_F(GV_CVT(mm[0]), m0), dx, o0);
            o1 = GV_FMADD(GV_MUL_F(GV_CVT(mm[1]), m1), dx, o1);
        }
        GV_STORE_F(out[r], o0);
        GV_STORE_F(out[r] + GEMM_LANES, o1);
    }
}

/* The stretches of y that the next group of rows will write: rows of y lie a
 * row of n outputs apart (64 KB for the 1B's gate and up), and a prompt's y is
 * larger than L2, so each write_row waited for its line: asked for while the
 * group before runs, the 1B's 512-row gate+up ran 1.09x as fast. */
typedef struct {
    const char *y;      /* the first row's first column */
    size_t stride;      /* bytes between rows */
    size_t bytes;       /* of a row's stretch */
    int rows;           /* how many */
} amx_ahead_t;

/* Defined with the packed layout (packed_panels.h): super-block sb of a packed
 * Q4_K (Q6_K) panel as planes at hi, lo (one super-block's) and its mins and
 * scales (its d) in scratch, as amx_planes_packed makes a whole panel's; asking
 * for pf's lines (prefetch_share_l2) evenly as it goes. */
static void amx_planes_q4_k_sb(const uint8_t *panel, int sb, int nb, uint8_t *scratch, int8_t *hi, int8_t *lo,
                               panel_ahead_t pf);
static void amx_planes_q6_k_sb(const uint8_t *panel, int sb, int nb, uint8_t *scratch, int8_t *hi, int8_t *lo,
                               panel_ahead_t pf);

/* Rows r0 .. r0 + 16G - 1 of x by the panel (planes and scratch) into out (the
 * first `rows` of them: the others' sums are not taken), super-block by
 * super-block: the tiles take super-block i into one of two buffers, then the
 * vector units take i - 1's from the other; each asks for its share of `ahead`.
 * (On the Xeon measured, the tiles and the vector units do not run at once: a
 * loop of tile products and an independent loop of FMAs took the sum of their
 * times.) With `packed` (a packed Q4_K or Q6_K panel) each super-block's planes
 * are made just before the tiles take them, into hi and lo, which then hold one
 * super-block: they stay in L1, where a whole panel's (128 KB at k = 2048) went
 * to L2 and back.
 *
 * The packed panel PANELS_AHEAD on (`pf`) is asked for half as a super-block's
 * planes are made, half between the tiles' steps. All of it asked for by the
 * plane makers, the requests came in bursts that filled the core's miss buffers
 * (a third of the Q4_K plane maker's samples fell on the instruction after its
 * prefetch) while the tiles' stretch asked for nothing: split so, the 1B's Q6_K
 * LM head at 16 rows ran 1.2x as fast and its decode step 1.15x. All of it
 * between the tiles' steps, or half during the take instead: no faster than
 * before; all of it during the take: 1.3x slower. */
ALWAYS_INLINE void amx_rows(const int G, int rows, int type, const int shift, const xq_t *xq, size_t r0, int nb,
                            uint8_t *scratch, int8_t *hi, int8_t *lo, const uint8_t *packed, panel_ahead_t pf,
                            const amx_ahead_t *ahead, float out[2 * AMX_ROWS][GEMM_PANEL]) {
    const int nsb = nb / 8;
    const int8_t *x = xq_row(xq, r0);
    const size_t sb_plane = 8 * 32 * GEMM_PANEL;
    /* on cache lines: a bare loop of TDPBSSDs whose sums were stored 16 bytes off a line ran 1.2x as long */
    amx_c_t c[2] __attribute__((aligned(64)));
    for (int r = 0; r < G * AMX_ROWS; r++) {
        GV_STORE_F(out[r], GV_ZERO_F());
        GV_STORE_F(out[r] + GEMM_LANES, GV_ZERO_F());
    }
    for (int sb = 0; sb <= nsb; sb++) {
        if (sb < nsb && packed) {
            /* this super-block's share of the panel ahead, in two halves (above) */
            const panel_ahead_t share = ahead_share(pf.ahead, pf.lines, (size_t)sb, (size_t)nsb);
            const panel_ahead_t to_planes = ahead_share(share.ahead, share.lines, 0, 2);
            const panel_ahead_t to_tiles = ahead_share(share.ahead, share.lines, 1, 2);
            if (type == Q4_K) amx_planes_q4_k_sb(packed, sb, nb, scratch, hi, lo, to_planes);
            else amx_planes_q6_k_sb(packed, sb, nb, scratch, hi, lo, to_planes);
            amx_superblock(G, x + (size_t)sb * 256, xq_stride(xq->k), hi, lo, c[sb % 2], to_tiles);
        } else if (sb < nsb) {
            amx_superblock(G, x + (size_t)sb * 256, xq_stride(xq->k), hi + sb * sb_plane, lo + sb * sb_plane,
                           c[sb % 2], (panel_ahead_t){NULL, 0});
        }
        if (sb) amx_take(rows, type, shift, xq, r0, sb - 1, nb, scratch, c[(sb - 1) % 2], out);
        for (int r = ahead->rows * sb / (nsb + 1); r < ahead->rows * (sb + 1) / (nsb + 1); r++) {
            __builtin_prefetch(ahead->y + (size_t)r * ahead->stride, 1);
            __builtin_prefetch(ahead->y + (size_t)r * ahead->stride + ahead->bytes - 1, 1);
        }
    }
}

/* Rows 0 .. m16 - 1 (whole AMX_ROWS) of x by the panel's planes (amx_hi, amx_lo:
 * made by the caller, P = 2^shift * hi + lo; or, given `packed`, a super-block
 * at a time by amx_rows) and its mins and scales in the unpacked panel's places
 * at scratch into y's columns j0 .. j0 + cols - 1, as write_tile writes the
 * GEMM's: 32 rows at a time (each weight tile taken by two of x), 16 for an
 * odd last group. */
static void amx_panel(int type, const int shift, const xq_t *xq, int m16, int m, int nb, uint8_t *scratch,
                      const uint8_t *packed, panel_ahead_t pf, void *y, long y_stride, int j0, int cols, int y_bf16,
                      const float *bias, int accumulate) {
    int8_t *hi = amx_hi(scratch, xq->k), *lo = amx_lo(scratch, xq->k);
    float out[2 * AMX_ROWS][GEMM_PANEL] __attribute__((aligned(64)));
    for (int r0 = 0; r0 < m16;) {
        const int G = m16 - r0 >= 2 * AMX_ROWS ? 2 : 1;
        const int next = r0 + G * AMX_ROWS, left = (m < m16 ? m : m16) - next;
        const int next_rows = left < 2 * AMX_ROWS ? (left > 0 ? left : 0) : 2 * AMX_ROWS;
        const size_t y_elem = y_bf16 ? 2 : 4;
        const amx_ahead_t ahead = {(const char *)y + ((size_t)next * (size_t)y_stride + (size_t)j0) * y_elem,
                                   (size_t)y_stride * y_elem, (size_t)cols * y_elem, next_rows};
        /* the first group's planes ask for the panel ahead (packed), the others read what it brought */
        const panel_ahead_t group_pf = r0 ? (panel_ahead_t){NULL, 0} : pf;
        /* rows past m (the last group's, amx_packed_rows): loaded by the tiles, their sums dropped */
        const int rows = m - r0 < G * AMX_ROWS ? m - r0 : G * AMX_ROWS;
        if (G == 2) amx_rows(2, rows, type, shift, xq, (size_t)r0, nb, scratch, hi, lo, packed, group_pf, &ahead, out);
        else amx_rows(1, rows, type, shift, xq, (size_t)r0, nb, scratch, hi, lo, packed, group_pf, &ahead, out);
        for (int r = 0; r < rows; r++)
            write_vectors(y, (size_t)(r0 + r), y_stride, j0, GV_LOAD_F(out[r]), GV_LOAD_F(out[r] + GEMM_LANES), cols,
                          y_bf16, bias, accumulate);
        r0 += G * AMX_ROWS;
    }
}
#else
#define AMX_TILES 0
ALWAYS_INLINE int amx_serves(int type, int m) {
    (void)type, (void)m;
    return 0;
}
ALWAYS_INLINE int amx_packed_rows(int type, int m) {
    (void)type, (void)m;
    return 0;
}
ALWAYS_INLINE size_t amx_planes_bytes(int k) {
    (void)k;
    return 0;
}
#endif
