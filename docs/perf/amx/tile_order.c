/* What one super-block's tile work for 32 rows costs (as amx_superblock does
 * it: 32 TDPBSSD, 24 tile loads, 8 stores, everything in L1), and what each
 * part adds: the same loop without the stores, with x loaded once, with the
 * TDPBSSDs alone; then in the order amx_superblock now issues it (each source
 * reloaded as soon as its last reader has issued, the next half's first before
 * this half's stores) against the order before. Linux only (the tile permission).
 *
 *   gcc -O3 -march=sapphirerapids docs/perf/amx/tile_order.c -o /tmp/tile_order
 *   taskset -c 1 /tmp/tile_order
 */
#include "tile_bench.h"


static int MODE; /* 0 the order before, 1 no stores, 2 x loaded once, 3 TDPBSSDs alone, 4 the order now */

__attribute__((noinline)) static void tiles(int sb, sums_t c) {
    const int8_t *xs = x + sb * 256, *h = hi + sb * 8 * 32 * PANEL, *l = lo + sb * 8 * 32 * PANEL;
    if (MODE == 4) {
        _tile_loadd(6, h, 4 * PANEL);
        _tile_loadd(4, xs, X_STRIDE);
        _tile_loadd(5, xs + 16 * X_STRIDE, X_STRIDE);
        _tile_loadd(7, l, 4 * PANEL);
        for (int half = 0; half < 2; half++) {
            sums_zeroed();
            for (int step = 0; step < 4; step++) {
                const int nh = step < 3 ? half : half + 1, ns = step < 3 ? step + 1 : 0, more = nh < 2;
                const size_t wn = (size_t)(2 * ns) * 32 * PANEL + (size_t)nh * 64, xn = 64 * (size_t)ns;
                _tile_dpbssd(0, 4, 6);
                _tile_dpbssd(2, 5, 6);
                if (more) _tile_loadd(6, h + wn, 4 * PANEL);
                _tile_dpbssd(1, 4, 7);
                if (more) _tile_loadd(4, xs + xn, X_STRIDE);
                _tile_dpbssd(3, 5, 7);
                if (more) _tile_loadd(5, xs + xn + 16 * X_STRIDE, X_STRIDE);
                if (more) _tile_loadd(7, l + wn, 4 * PANEL);
            }
            _tile_stored(0, c[half][0][0], 64);
            _tile_stored(2, c[half][1][0], 64);
            _tile_stored(1, c[half][0][1], 64);
            _tile_stored(3, c[half][1][1], 64);
        }
        return;
    }
    const int loads = MODE != 3, stores = MODE != 1 && MODE != 3, x_each_step = MODE != 2;
    for (int half = 0; half < 2; half++) {
        sums_zeroed();
        for (int step = 0; step < 4; step++) {
            const size_t w = (size_t)(2 * step) * 32 * PANEL + (size_t)half * 64, xa = 64 * (size_t)step;
            const int load_x = loads && (x_each_step || (step == 0 && half == 0));
            if (loads) _tile_loadd(6, h + w, 4 * PANEL);
            if (loads) _tile_loadd(7, l + w, 4 * PANEL);
            if (load_x) _tile_loadd(4, xs + xa, X_STRIDE);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
            if (load_x) _tile_loadd(5, xs + xa + 16 * X_STRIDE, X_STRIDE);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
        }
        if (stores) {
            _tile_stored(0, c[half][0][0], 64);
            _tile_stored(1, c[half][0][1], 64);
            _tile_stored(2, c[half][1][0], 64);
            _tile_stored(3, c[half][1][1], 64);
        }
    }
}

int main(void) {
    if (tiles_set_up()) return 1;
    const char *names[] = {"the order before", "  without the stores", "  x loaded once", "  TDPBSSDs alone",
                           "the order now"};
    const long rounds = 200000;
    for (int mode = 0; mode < 5; mode++) {
        MODE = mode;
        double best = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            const double start = now();
            for (long i = 0; i < rounds; i++) tiles((int)(i & 7), sums[i & 1]);
            const double took = now() - start;
            best = took < best ? took : best;
        }
        printf("%-22s %6.1f ns a round\n", names[mode], best / rounds * 1e9);
    }
    return (int)sums[0][0][0][0][0][0] == 12345;
}
