/* What overlap.c and tile_order.c share: one super-block's data for 32 rows as
 * amx_superblock reads it (x a row 2112 bytes apart, the hi and lo planes of
 * eight super-blocks, two sets of tile sums), a clock, and the tiles set up as
 * amx_begin sets them (16 rows of 64 bytes each) once Linux grants the state. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define PANEL 32
#define X_STRIDE 2112 /* k = 2048 plus a line, as xq_stride */

static int8_t x[32 * X_STRIDE] __attribute__((aligned(64)));
static int8_t hi[8 * 32 * PANEL * 8] __attribute__((aligned(64))), lo[8 * 32 * PANEL * 8] __attribute__((aligned(64)));
typedef int32_t sums_t[2][2][2][16][16]; /* [column half][row group][plane][row][column] */
static sums_t sums[2] __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* 0 once the tiles are configured and the data filled; 1 (said) if Linux refuses the tile state. */
static int tiles_set_up(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
        puts("no AMX tiles for this process");
        return 1;
    }
    static struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config __attribute__((aligned(64)));
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
    memset(x, 1, sizeof x), memset(hi, 1, sizeof hi), memset(lo, 1, sizeof lo);
    return 0;
}

/* The four sums' tiles zeroed (0, 1: row group 0's hi and lo; 2, 3: row group 1's). */
static inline void sums_zeroed(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}
