/* The int8 dot-product rate a core can reach at all: twelve independent
 * vpdpbusd chains on zmm registers, no memory. A prefill or batched GEMM's
 * GOP/s over this is how much of the machine's arithmetic it uses.
 *
 *     gcc -O2 -fopenmp -mavx512f -mavx512bw -mavx512vnni docs/perf/ladder/int8_peak.c -o /tmp/int8_peak
 *     OMP_NUM_THREADS=2 /tmp/int8_peak
 *
 * GOP/s counts 2 operations per multiply-add, as lm_head.py does. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#define CHAIN(i) a##i = _mm512_dpbusd_epi32(a##i, u, s)

int main(int argc, char **argv) {
    const long rounds = argc > 1 ? atol(argv[1]) : 50000000L;
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        const double started = omp_get_wtime();
        long sink = 0;
#pragma omp parallel reduction(+ : sink)
        {
            const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-2);
            __m512i a0 = _mm512_set1_epi32(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
            __m512i a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
            for (long n = 0; n < rounds; n++) {
                CHAIN(0); CHAIN(1); CHAIN(2); CHAIN(3); CHAIN(4); CHAIN(5);
                CHAIN(6); CHAIN(7); CHAIN(8); CHAIN(9); CHAIN(10); CHAIN(11);
                /* keeps the twelve chains in registers (no store-and-reload between rounds) */
                __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6),
                                 "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
            }
            __m512i all = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                           _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
            all = _mm512_add_epi32(all, _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)));
            sink += _mm512_reduce_add_epi32(all);
        }
        const double seconds = omp_get_wtime() - started;
        const double ops = 2.0 * 64 * 12 * (double)rounds * omp_get_max_threads();
        if (ops / seconds > best) best = ops / seconds;
        if (sink == 42) printf(" ");
    }
    printf("%d threads: %.0f GOP/s int8 (%.2f G vpdpbusd zmm a second per thread)\n", omp_get_max_threads(), best / 1e9,
           best / 1e9 / 128 / omp_get_max_threads());
    return 0;
}
