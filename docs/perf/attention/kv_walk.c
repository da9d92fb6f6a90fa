/* How fast can a decode step read an int8 KV cache laid out as stoker lays it?
 * 32 sequences x 614 keys x 30 layers x (K, V), blocks of 16 tokens in random
 * order, each token's 3 kv-head rows side by side (64 int8 values + a float32
 * scale: 68 bytes a row). No arithmetic beyond touching every row.
 *   gcc -O2 -march=native -fopenmp kv_walk.c -o kv_walk
 *   OMP_NUM_THREADS=2 ./kv_walk ORDER LAYOUT PREFETCH_KEYS
 * ORDER 0: one kv head after another (three passes over a block, as attend
 * walks a decode row); 1: all kv heads of a token together (one pass).
 * LAYOUT 0: scales inside the rows (stoker's); 1: 64-byte rows, scales after
 * the block's rows. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define BS 16
#define KVH 3
enum { SEQS = 32, KEYS = 614, LAYERS = 30 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 4) return fprintf(stderr, "usage: kv_walk ORDER LAYOUT PREFETCH_KEYS\n"), 2;
    const int order = atoi(argv[1]), layout = atoi(argv[2]), ahead = atoi(argv[3]);
    const int blocks_per_seq = (KEYS + BS - 1) / BS, row_bytes = layout ? 64 : 68;
    const long items = (long)SEQS * LAYERS * 2, nblocks = items * blocks_per_seq;
    const size_t token_bytes = (size_t)KVH * row_bytes;
    const size_t block_bytes = (BS * token_bytes + (layout ? BS * KVH * 4 : 0) + 63) / 64 * 64;
    uint8_t *mem = aligned_alloc(4096, nblocks * block_bytes);
    memset(mem, 1, nblocks * block_bytes);
    int64_t *table = malloc(sizeof(int64_t) * nblocks);
    for (long i = 0; i < nblocks; i++) table[i] = i;
    srand(1);
    for (long i = nblocks - 1; i > 0; i--) {
        long j = rand() % (i + 1);
        int64_t t = table[i];
        table[i] = table[j], table[j] = t;
    }
#define ROW(tab, t, h) (mem + (tab)[(t) / BS] * block_bytes + ((t) % BS) * token_bytes + (size_t)(h) * row_bytes)
    double best = 1e9;
    long sink = 0;
    for (int rep = 0; rep < 5; rep++) {
        const double t0 = now();
        long total = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : total)
        for (long item = 0; item < items; item++) {
            const int64_t *tab = table + item * blocks_per_seq;
            __m512i acc = _mm512_setzero_si512();
            float scales = 0;
            for (int pass = 0; pass < (order ? 1 : KVH); pass++)
                for (int t = 0; t < KEYS; t++)
                    for (int h = order ? 0 : pass; h < (order ? KVH : pass + 1); h++) {
                        if (ahead && t + ahead < KEYS && (!order || h == 0)) {
                            const uint8_t *next = ROW(tab, t + ahead, h);
                            for (size_t line = 0; line < (order ? token_bytes : (size_t)row_bytes) + 63; line += 64)
                                _mm_prefetch((const char *)next + line, _MM_HINT_T0);
                        }
                        const uint8_t *row = ROW(tab, t, h);
                        acc = _mm512_add_epi32(acc, _mm512_loadu_si512(row));
                        float s;
                        memcpy(&s, layout ? mem + tab[t / BS] * block_bytes + BS * token_bytes + ((t % BS) * KVH + h) * 4
                                          : row + 64,
                               4);
                        scales += s;
                    }
            total += _mm512_reduce_add_epi32(acc) + (long)scales;
        }
        const double elapsed = now() - t0;
        sink += total;
        if (elapsed < best) best = elapsed;
    }
    const double useful = (double)items * KEYS * KVH * 68;
    printf("order %d layout %d prefetch %d: %.2f ms a step, %.1f GB/s of rows and scales (%ld)\n", order, layout, ahead,
           best * 1e3, useful / best / 1e9, sink % 7);
    return 0;
}
