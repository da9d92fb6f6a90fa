/* Element-wise steps of a decoder layer fused into one pass each, for CPUs.
 *
 * Unfused, each is a chain of torch kernels that each read and write the
 * whole tensor (and in bf16 widen and round it again). Here a row is read
 * once; every intermediate is rounded where the unfused ops round it, in
 * transformers' order, so results match them up to fp32 summation order and
 * exp's last bits. Rows are split over OpenMP threads, shared with torch's
 * pool. Built by stoker/models/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Rounds v to the tensor's dtype and back (a no-op for fp32), so intermediate
 * results carry the same precision as in the unfused torch ops. */
static inline float as_dtype(float v, int is_bf16) { return is_bf16 ? bf16_to_float(float_to_bf16(v)) : v; }

static inline float load(const void *base, size_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store(void *base, size_t i, float v, int is_bf16) {
    if (is_bf16) ((uint16_t *)base)[i] = float_to_bf16(v);
    else ((float *)base)[i] = v;
}

/* exp(x) as 2^k * e^r with k = round(x / ln 2) and r = x - k ln 2 (ln 2 split in
 * two so r keeps its low bits), e^r by a degree-7 Taylor polynomial on
 * |r| <= 0.35: within a few ulp of expf, and it vectorizes. */
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float k = floorf(x * 1.44269504088896341f + 0.5f);
    float r = fmaf(-k, 0.693145751953125f, x);
    r = fmaf(-k, 1.428606765330187e-6f, r);
    float p = 1.f / 5040.f;
    p = fmaf(p, r, 1.f / 720.f);
    p = fmaf(p, r, 1.f / 120.f);
    p = fmaf(p, r, 1.f / 24.f);
    p = fmaf(p, r, 1.f / 6.f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.f);
    p = fmaf(p, r, 1.f);
    const uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline __attribute__((always_inline)) void rms_norm_row(const void *x, const void *weight, void *out,
                                                                size_t base, int dim, float eps, const int is_bf16) {
    float sum = 0.f;
    for (int d = 0; d < dim; d++) {
        const float v = load(x, base + d, is_bf16);
        sum += v * v;
    }
    const float inv = 1.f / sqrtf(sum / (float)dim + eps);
    for (int d = 0; d < dim; d++) {
        const float normed = as_dtype(load(x, base + d, is_bf16) * inv, is_bf16);
        store(out, base + d, load(weight, d, is_bf16) * normed, is_bf16);
    }
}

/* out[r] = weight * dtype(x[r] * rsqrt(mean(x[r]^2) + eps)), as LlamaRMSNorm. */
void rms_norm(const void *x, const void *weight, void *out, int rows, int dim, float eps, int is_bf16,
              int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        if (is_bf16) rms_norm_row(x, weight, out, (size_t)r * dim, dim, eps, 1);
        else rms_norm_row(x, weight, out, (size_t)r * dim, dim, eps, 0);
    }
}

/* One row; is_bf16 is a constant at each call so the loop vectorizes. */
static inline __attribute__((always_inline)) void silu_mul_row(const void *gate_up, void *out, size_t in, size_t o,
                                                                int inter, const int is_bf16) {
    for (int i = 0; i < inter; i++) {
        const float g = load(gate_up, in + i, is_bf16);
        const float act = as_dtype(g / (1.f + exp_approx(-g)), is_bf16);
        store(out, o + i, act * load(gate_up, in + inter + i, is_bf16), is_bf16);
    }
}

/* gate_up [rows, 2 * inter] (gate then up) -> out [rows, inter] = silu(gate) * up. */
void silu_mul(const void *gate_up, void *out, int rows, int inter, int is_bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const size_t in = (size_t)r * 2 * inter, o = (size_t)r * inter;
        if (is_bf16) silu_mul_row(gate_up, out, in, o, inter, 1);
        else silu_mul_row(gate_up, out, in, o, inter, 0);
    }
}

/* out [tokens, heads, head_dim] = x * cos + rotate_half(x) * sin, x laid out
 * the same but with rows row_stride elements apart (a slice of the fused qkv
 * output); cos/sin are [positions, head_dim] tables. head_dim <= 512. */
void rotary(const void *x, void *out, const void *cos_table, const void *sin_table, const int64_t *positions,
            int tokens, int heads, int head_dim, int row_stride, int is_bf16, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int t = 0; t < tokens; t++) {
        const size_t table = (size_t)positions[t] * head_dim;
        float c[512], s[512];
        for (int d = 0; d < head_dim; d++) {
            c[d] = load(cos_table, table + d, is_bf16);
            s[d] = load(sin_table, table + d, is_bf16);
        }
        for (int h = 0; h < heads; h++) {
            const size_t src = (size_t)t * row_stride + (size_t)h * head_dim;
            const size_t dst = ((size_t)t * heads + h) * head_dim;
            float v[512];
            for (int d = 0; d < head_dim; d++) v[d] = load(x, src + d, is_bf16);
            for (int d = 0; d < half; d++) {
                const float a = as_dtype(v[d] * c[d], is_bf16), b = as_dtype(-v[d + half] * s[d], is_bf16);
                store(out, dst + d, a + b, is_bf16);
            }
            for (int d = half; d < head_dim; d++) {
                const float a = as_dtype(v[d] * c[d], is_bf16), b = as_dtype(v[d - half] * s[d], is_bf16);
                store(out, dst + d, a + b, is_bf16);
            }
        }
    }
}
