/* Attention straight from the paged KV cache, for CPUs, as a kernel of its own
 * for the torch-layer path (models/attention.py, CPUPagedAttention): the
 * fused decoder's attention (attention.h) behind two entry points, so both
 * paths compute a row's attention the same way, bit for bit.
 *
 * Layouts: q/out [rows, heads, head_dim], float32 or bf16 (widened to float32
 * here, the result rounded back); caches [blocks, block_size, kv_heads, row] of
 * a KV_* format (kv_format.h); block tables int64.
 *
 * Built like ggml_quant.c, once per ISA path (models/quant/kernels.py), so
 * STOKER_QUANT_ISA picks the path here too.
 */
#include "ggml_quant.c"
#include "kv_format.h"
#include "attention.h"
#include "subnormals.h"

/* Rows [group_starts[i], group_starts[i + 1]) share an attend call (one sequence's). */
typedef struct {
    const AttnLayer *layer;
    const int *group_starts;
    int num_groups, max_position;
} Work;

/* attend over every (group, kv head) of `work`, q and out as float32 [rows, heads, head_dim].
 * Returns 0, or 1 when memory ran out. */
static int attend_all(const Work *work, const float *q, float *out, int num_threads) {
    const AttnLayer *layer = work->layer;
    const int H = layer->num_heads, KVH = layer->num_kv_heads, D = layer->head_dim, G = H / KVH;
    const size_t scratch_bytes = (attend_scratch_floats(G, work->max_position, D) * sizeof(float) + 63) / 64 * 64;
    const int items = work->num_groups * KVH;
    int failed = 0;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const fp_mode_t caller = subnormals_off();
        float *scratch = aligned_alloc(64, scratch_bytes);
        if (!scratch) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < items; item++) {
                const int group = item / KVH, kvh = item % KVH;
                const int r0 = work->group_starts[group], nrows = work->group_starts[group + 1] - r0;
                attend(layer, q, (size_t)H * D, out, r0, nrows, kvh * G, G, scratch);
            }
            free(scratch);
        }
        fp_mode_restore(caller);
    }
    return failed;
}

/* attend_all for q and out of either dtype. Returns 0, or 1 when memory ran out. */
static int attend_rows(const Work *work, const void *q, void *out, int rows, int is_bf16, int num_threads) {
    if (!is_bf16) return attend_all(work, (const float *)q, (float *)out, num_threads);
    const size_t count = (size_t)rows * work->layer->num_heads * work->layer->head_dim;
    float *qf = malloc(sizeof(float) * count), *of = malloc(sizeof(float) * count);
    int failed = !qf || !of;
    if (!failed) {
        for (size_t i = 0; i < count; i++) qf[i] = bf16_to_float(((const uint16_t *)q)[i]);
        failed = attend_all(work, qf, of, num_threads);
        if (!failed)
            for (size_t i = 0; i < count; i++) ((uint16_t *)out)[i] = float_to_bf16(of[i]);
    }
    free(qf);
    free(of);
    return failed;
}

/* 1 if the kernels here serve this head size (attend's shapes; the group size is checked per call). */
int paged_attention_supported(int head_dim) { return attend_supported(head_dim, 1, 1); }

/* One query row per sequence, at its last position (context_lens[b] - 1).
 * Returns 0; 1 when memory ran out; 2 when the shapes are not served. */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
                           const int64_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, int max_blocks, float scale, int is_bf16, int kv_format,
                           int num_threads) {
    if (!attend_supported(head_dim, num_heads, num_kv_heads)) return 2;
    if (num_seqs < 1) return 0;
    int64_t *positions = malloc(sizeof(int64_t) * (size_t)num_seqs);
    int *group_starts = malloc(sizeof(int) * ((size_t)num_seqs + 1));
    int failed = !positions || !group_starts;
    if (!failed) {
        int max_position = 0;
        for (int b = 0; b < num_seqs; b++) {
            positions[b] = context_lens[b] - 1;
            if (positions[b] > max_position) max_position = (int)positions[b];
        }
        for (int b = 0; b <= num_seqs; b++) group_starts[b] = b;
        const AttnLayer layer = {head_dim, num_heads, num_kv_heads, scale, positions, block_tables, max_blocks,
                                 NULL, k_cache, v_cache, block_size, kv_format};
        const Work work = {&layer, group_starts, num_seqs, max_position};
        failed = attend_rows(&work, q, out, num_seqs, is_bf16, num_threads);
    }
    free(positions);
    free(group_starts);
    return failed;
}

/* One sequence's chunk: n query rows at positions context_len - n .. context_len - 1,
 * causal over the cache (the chunk's own keys already written). Returns as
 * paged_decode_attention. */
int paged_prefill_attention(const void *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
                            void *out, int n, int context_len, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, float scale, int is_bf16, int kv_format, int num_threads) {
    if (!attend_supported(head_dim, num_heads, num_kv_heads) || context_len < n) return 2;
    if (n < 1) return 0;
    const int num_groups = (n + ATTEND_ROWS - 1) / ATTEND_ROWS;
    int64_t *positions = malloc(sizeof(int64_t) * (size_t)n);
    int32_t *row_seq = calloc((size_t)n, sizeof(int32_t)); /* every row reads block_table */
    int *group_starts = malloc(sizeof(int) * ((size_t)num_groups + 1));
    int failed = !positions || !row_seq || !group_starts;
    if (!failed) {
        for (int r = 0; r < n; r++) positions[r] = context_len - n + r;
        for (int g = 0; g < num_groups; g++) group_starts[g] = g * ATTEND_ROWS;
        group_starts[num_groups] = n;
        const AttnLayer layer = {head_dim, num_heads, num_kv_heads, scale, positions, block_table, 0,
                                 row_seq, k_cache, v_cache, block_size, kv_format};
        const Work work = {&layer, group_starts, num_groups, context_len - 1};
        failed = attend_rows(&work, q, out, n, is_bf16, num_threads);
    }
    free(positions);
    free(row_seq);
    free(group_starts);
    return failed;
}
