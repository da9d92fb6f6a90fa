/* Do the AMX tiles and the vector units run at once? One thread times, per
 * round, one super-block's tile work as amx_superblock does it for 32 rows
 * (32 TDPBSSD with their tile loads, stores and zeroing, everything in L1),
 * alone and followed by work for the vector units that does not depend on it:
 * the take of 32 rows (as amx_take: int32 sums to floats, the mins' dots), or
 * 240 FMAs on registers. If the two overlapped, a round of both would take about
 * as long as the longer; it takes the sum. Linux only (the tile permission).
 *
 *   gcc -O3 -march=sapphirerapids docs/perf/amx/overlap.c -o /tmp/overlap
 *   taskset -c 1 /tmp/overlap
 */
#include "tile_bench.h"

static float out[32][PANEL] __attribute__((aligned(64)));
static int16_t isum[32 * 64];
static float dx[32 * 8], d[PANEL];
static int32_t mins[8 * 4 * PANEL];
static __m512 registers[12];

__attribute__((noinline)) static void tiles(int sb, sums_t c) {
    const int8_t *xs = x + sb * 256, *h = hi + sb * 8 * 32 * PANEL, *l = lo + sb * 8 * 32 * PANEL;
    for (int half = 0; half < 2; half++) {
        sums_zeroed();
        for (int step = 0; step < 4; step++) {
            const size_t w = (size_t)(2 * step) * 32 * PANEL + (size_t)half * 64, xa = 64 * (size_t)step;
            _tile_loadd(6, h + w, 4 * PANEL);
            _tile_loadd(7, l + w, 4 * PANEL);
            _tile_loadd(4, xs + xa, X_STRIDE);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
            _tile_loadd(5, xs + xa + 16 * X_STRIDE, X_STRIDE);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
        }
        _tile_stored(0, c[half][0][0], 64);
        _tile_stored(1, c[half][0][1], 64);
        _tile_stored(2, c[half][1][0], 64);
        _tile_stored(3, c[half][1][1], 64);
    }
}

__attribute__((noinline)) static void take(int sb, sums_t c) {
    const __m512 d0 = _mm512_loadu_ps(d), d1 = _mm512_loadu_ps(d + 16);
    __m512i m[4][2];
    for (int i = 0; i < 4; i++)
        for (int v = 0; v < 2; v++) m[i][v] = _mm512_loadu_si512(mins + (sb * 4 + i) * PANEL + 16 * v);
    for (int r = 0; r < 32; r++) {
        const __m512 scale = _mm512_set1_ps(dx[r * 8 + sb]);
        __m512 o[2];
        for (int v = 0; v < 2; v++) {
            const __m512i p = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c[v][r / 16][0][r % 16]), 3),
                                               _mm512_load_si512(c[v][r / 16][1][r % 16]));
            o[v] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(p), v ? d1 : d0), scale,
                                   _mm512_load_ps(out[r] + 16 * v));
        }
        __m512i mm[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int i = 0; i < 4; i++) {
            int32_t pair;
            memcpy(&pair, isum + r * 64 + sb * 8 + 2 * i, sizeof pair);
            const __m512i xs = _mm512_set1_epi32(pair);
            for (int v = 0; v < 2; v++) mm[v] = _mm512_dpwssd_epi32(mm[v], m[i][v], xs);
        }
        for (int v = 0; v < 2; v++) {
            o[v] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(mm[v]), v ? d1 : d0), scale, o[v]);
            _mm512_store_ps(out[r] + 16 * v, o[v]);
        }
    }
}

__attribute__((noinline)) static void fmas(void) {
    __m512 a[12];
    for (int j = 0; j < 12; j++) a[j] = registers[j];
    const __m512 m = _mm512_set1_ps(1.0001f);
    for (int i = 0; i < 20; i++)
        for (int j = 0; j < 12; j++) a[j] = _mm512_fmadd_ps(a[j], m, m);
    for (int j = 0; j < 12; j++) registers[j] = a[j];
}

int main(void) {
    if (tiles_set_up()) return 1;
    const char *names[] = {"tiles", "take", "tiles, then take", "FMAs", "tiles, then FMAs"};
    const long rounds = 200000;
    for (int mode = 0; mode < 5; mode++) {
        double best = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            const double start = now();
            for (long i = 0; i < rounds; i++) {
                const int sb = (int)(i & 7);
                if (mode == 0 || mode == 2 || mode == 4) tiles(sb, sums[i & 1]);
                if (mode == 1 || mode == 2) take(sb, sums[(i + 1) & 1]);
                if (mode == 3 || mode == 4) fmas();
            }
            const double took = now() - start;
            best = took < best ? took : best;
        }
        printf("%-18s %6.1f ns a round\n", names[mode], best / rounds * 1e9);
    }
    return (int)out[3][3] == 12345;
}
