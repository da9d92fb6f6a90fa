/* Subnormal floats off for the calling thread, while the C kernels compute.
 *
 * An operation with a subnormal input or result (below 1.2e-38) takes a
 * microcode assist on Intel cores, ~100 cycles instead of one; AMD's do not
 * slow down. Attention makes them: a softmax weight near e^-87 times a small
 * value of v. A 512-token prefill of a 1B random-weight model spent 67% of its
 * time in the fused decoder's attention for that on an Emerald Rapids
 * (docs/perf/quantized.md). With FTZ (results flushed to zero) and DAZ
 * (inputs read as zero) set, such terms are zero, deterministically: a row's
 * result still depends on nothing but the row, so batch invariance holds, and
 * what changes is below 1.2e-38 of a sum that holds a weight of 1.
 *
 * Each thread sets its own MXCSR at the start of a parallel region and puts
 * the caller's back at the end, so torch's threads and the caller see no change. */
#ifndef STOKER_SUBNORMALS_H
#define STOKER_SUBNORMALS_H

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned int fp_mode_t;
static inline fp_mode_t subnormals_off(void) {
    const fp_mode_t saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040u); /* FTZ (bit 15) | DAZ (bit 6) */
    return saved;
}
static inline void fp_mode_restore(fp_mode_t saved) { _mm_setcsr(saved); }
#else
typedef int fp_mode_t;
static inline fp_mode_t subnormals_off(void) { return 0; }
static inline void fp_mode_restore(fp_mode_t saved) { (void)saved; }
#endif

#endif
