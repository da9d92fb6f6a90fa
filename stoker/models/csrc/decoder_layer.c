/* The whole decoder stack of a Llama-family model with GGML-quantized linear
 * layers, for one step's flattened batch of tokens, in one call.
 *
 * Why: on a small model one decode token is ~30 layers x (8 C calls + ~15
 * torch ops), and on a 135M model the Python and torch dispatch around them
 * cost as much as the matmuls. Here the stack runs inside ONE OpenMP parallel
 * region (llama.cpp's way): the threads stay up for all layers and meet at
 * barriers between the steps that depend on each other, so there is no
 * per-op dispatch and no fork/join per kernel.
 *
 * Per layer, for the step's n rows (decodes and prefill chunks alike):
 *   x = RMSNorm(h) -> int8; qkv = x Wqkv^T (+ bias); [Qwen3: q/k RMSNorm per head];
 *   RoPE on q, k from the model's own cos/sin tables; k, v written to the paged
 *   cache at the row's slot; attention of each row over its sequence's cache
 *   up to and including its own position; h += attn Wo^T;
 *   x = RMSNorm(h) -> int8; gu = x Wgu^T; a = silu(g) * u -> int8; h += a Wd^T.
 *
 * Batch invariance: a row's result never depends on the other rows. The
 * matmuls are ggml_quant.c's (bit-identical whatever m and the split, see
 * there, including the switch between its exact GEMM and tiles by m). Every
 * other reduction (norm sums, q.k dots, softmax sums, p.v sums) runs over one
 * row or one (row, head) in a fixed order written out here (attention's in
 * attention.h, the one the paged-attention kernels run too) with explicit
 * partial sums (8 for the norms; the path's vector width for attention, whose
 * multiply-adds are explicit fused ones where the ISA has them), so it
 * vectorizes without the compiler reassociating or fusing anything (built
 * like ggml_quant.c: -ffp-contract=off, no -fassociative-math). Which thread
 * runs an item, and which heads share its block, never changes its
 * arithmetic. Attention treats a prefill row exactly as a decode
 * row of context position + 1, so a prompt token's attention is the same
 * computation whether its prompt came alone, chunked or next to others.
 *
 * fp32 activations; a KV cache of fp32 rows, of bf16 or fp16 rows (rounded
 * as torch rounds, widened exactly), or of int8 or fp8 e4m3 rows with their
 * float32 scale (kv_format.h's codecs, stoker/models/kv_quant.py's rows:
 * quantized as k and v are written, as torch would, and read by attention as
 * they are, the scale applied to a key's q.k sum and to a value row).
 * The Python side (fused_decoder.py) checks that and builds the Model tables
 * once at load.
 *
 * LoRA adapters (stoker/models/lora.py): a step may carry each row's adapter.
 * The base matmul still runs once for all rows; then, per adapter, its rows
 * are shrunk through its A (h = A x, before the matmul's barrier) and its
 * B^T (scale folded in) adds h B^T to their output columns (after it), as
 * punica / S-LoRA group rows by adapter, in float32 with a fixed summation
 * order per row, so a row's update never depends on the other rows. A step
 * without adapters runs none of it.
 */
#include <math.h>
#include <pthread.h>

#include "ggml_quant.c"
#include "kv_format.h"
#include "attention.h"
#include "subnormals.h"

#define MAX_PARTS 4
/* One linear layer: row-stacked parts (a Q4_K_M qkv is Q4_K rows then Q6_K rows). */
typedef struct {
    int num_parts;
    int types[MAX_PARTS];
    const uint8_t *weights[MAX_PARTS];
    int starts[MAX_PARTS]; /* first output column of each part */
    int rows[MAX_PARTS];
    const float *bias; /* [out_features] or NULL */
    int in_features, out_features;
    int packed[MAX_PARTS]; /* 1: weights[p] is laid out by ggml_quant_pack */
} Linear;

/* An adapter's share of one linear: its modules' A stacked by rows, and per
 * module the output columns its B^T (rank_count x col_count) writes. */
#define LORA_MAX_MODULES 3
typedef struct {
    int rank; /* rows of a; 0: the adapter leaves this linear alone */
    const float *a; /* [rank, in_features] */
    int num_modules;
    int rank_start[LORA_MAX_MODULES], rank_count[LORA_MAX_MODULES];
    int col_start[LORA_MAX_MODULES], col_count[LORA_MAX_MODULES];
    const float *bt[LORA_MAX_MODULES];
} LoraLinear;

/* A layer's linears, in order: its adapters' tables and its panel claims are indexed by them. */
enum { LINEAR_QKV, LINEAR_O, LINEAR_GATE_UP, LINEAR_DOWN, LINEARS };
typedef struct {
    LoraLinear linears[LINEARS];
} LoraLayer;

typedef struct {
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm; /* [head_dim] each, or NULL (Qwen3 has them) */
    Linear qkv, o_proj, gate_up, down;
} Layer;

typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *cos, *sin; /* [max_positions, head_dim] */
    int max_positions;
    const Layer *layers;
} Model;

/* One step: row r of the batch is at positions[r], writes its k and v at
 * slots[r] and attends through block table row_seq ? row_seq[r] : r. */
typedef struct {
    int n;
    const int64_t *positions, *slots;
    const int64_t *tables; /* [sequences, max_blocks] */
    int max_blocks;
    const int32_t *row_seq; /* NULL: one sequence per row (all decodes) */
    void *const *k_caches, *const *v_caches; /* per layer, [blocks, block_size, kv_heads, row] */
    int block_size;
    int kv_format; /* KV_* (kv_format.h) */
    const int32_t *row_lora;     /* [n]: each row's adapter, -1 for none; NULL: no adapters this step */
    const LoraLayer *const *loras; /* per adapter, its [num_layers] tables */
    int num_loras;
    int lora_width; /* the largest rank of any adapter's linear this step */
} Step;

/* Scratch shared by the threads for one call. */
typedef struct {
    float *normed, *qkv, *attn, *gate_up, *act; /* [n, width of each] */
    int8_t *qs32, *qs256;                       /* the rows of a linear's input as int8 */
    float *d32, *s32, *d256, *s256;
    int16_t *bsums32, *bsums256;
    float *attn_scratch; /* per thread: see attend */
    size_t attn_scratch_floats;
    int *group_starts; /* attention's row groups: rows group_starts[i] .. group_starts[i + 1] - 1 */
    int num_groups;
    int *group_order; /* the groups, most attention work (keys read over their rows) first */
    int16_t *isum32;       /* integer sums of qs32 per 32 (the exact kernels' offset term) */
    int16_t *isum256;      /* integer sums of qs256 per 32 (the K-quants' mins term) */
    uint8_t *gemm_scratch; /* per thread: gemm_scratch_bytes(kmax, n); none for a small decode step */
    size_t gemm_scratch_size;
    float *lora_h;    /* [n, lora_width]: a row's A x for the linear in hand */
    int *lora_rows;   /* the rows with an adapter, grouped by adapter: lora_rows[lora_starts[a] .. lora_starts[a + 1] - 1] */
    int *lora_starts; /* [num_loras + 1] */
    int private_rows; /* every thread keeps its own normed, act and int8 rows: see run_layers */
    int kmax;         /* the widest linear input: each private copy's row width */
    panel_claims_t *claims; /* [layer][LINEARS][MAX_PARTS][claim_slots]: each packed part's panels */
    int claim_slots;        /* the threads asked for */
} Buffers;

/* ---- row operations: fixed summation order, vectorizable as written -------- */

/* Sum of a[i] * b[i] over 8 lanes then a fixed tree: d % 8 == 0. */
static inline float dot8(const float *restrict a, const float *restrict b, int d) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < d; i += 8)
        for (int j = 0; j < 8; j++) acc[j] = acc[j] + a[i + j] * b[i + j];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* As LlamaRMSNorm in fp32: out = weight * (x * 1 / sqrt(mean(x^2) + eps)). */
static inline void rms_norm_row(const float *restrict x, const float *restrict weight, float *restrict out, int dim,
                                float eps) {
    const float inv = 1.f / sqrtf(dot8(x, x, dim) / (float)dim + eps);
    for (int i = 0; i < dim; i++) out[i] = weight[i] * (x[i] * inv);
}

/* silu(g) = g / (1 + exp(-g)); exp(-|g|) keeps the polynomial in range and
 * exp(-g) = 1 / exp(g) covers g < 0. */
static inline float silu(float g) {
    const float e = exp_nonpositive(g < 0.f ? g : -g); /* exp(-|g|) */
    return g >= 0.f ? g / (1.f + e) : g * e / (e + 1.f);
}

/* ---- linear layers inside the parallel region --------------------------- */

static inline xq_t xq_for(const Buffers *b, int be, int k) {
    if (be == 32) return (xq_t){.qs = b->qs32, .d = b->d32, .s = b->s32, .bsums = b->bsums32, .k = k, .isum = b->isum32};
    return (xq_t){.qs = b->qs256,
                  .d = b->d256,
                  .s = b->s256,
                  .bsums = b->bsums256,
                  .k = k,
                  .isum = b->isum256};
}

/* Row r of x (k = L->in_features wide) rounded to int8 for every block size L's parts use. */
static void quantize_input_row(const Linear *L, const Buffers *b, const float *x, int r) {
    int done32 = 0, done256 = 0;
    for (int p = 0; p < L->num_parts; p++) {
        const int be = block_elems(L->types[p]);
        if ((be == 32 && done32) || (be == 256 && done256)) continue;
        const xq_t xq = xq_for(b, be, L->in_features);
        quantize_row(x, 0, (size_t)r, L->in_features, be, &xq);
        if (be == 32) done32 = 1;
        else done256 = 1;
    }
}

/* Layer l's linear `which` (LINEAR_QKV .. LINEAR_DOWN) and its parts' panel claims. */
static const Linear *layer_linear(const Layer *Ly, int which) {
    return which == LINEAR_QKV       ? &Ly->qkv
           : which == LINEAR_O       ? &Ly->o_proj
           : which == LINEAR_GATE_UP ? &Ly->gate_up
                                     : &Ly->down;
}
static panel_claims_t *linear_claims(const Buffers *b, int l, int which) {
    return b->claims + ((size_t)l * LINEARS + (size_t)which) * MAX_PARTS * (size_t)b->claim_slots;
}

/* Every packed part's panels split between the threads afresh: before the parallel region. */
static void claims_init(const Model *M, const Buffers *b) {
    for (int l = 0; l < M->num_layers; l++)
        for (int which = 0; which < LINEARS; which++) {
            const Linear *L = layer_linear(&M->layers[l], which);
            for (int p = 0; p < L->num_parts; p++)
                if (L->packed[p])
                    panel_claims_init(linear_claims(b, l, which) + (size_t)p * (size_t)b->claim_slots, b->claim_slots,
                                      (L->rows[p] + PACKED_PANEL - 1) / PACKED_PANEL);
        }
}

/* Thread t's share of layer l's linear `which`: y[n rows] (= or +=) x W^T (+ bias), x already quantized. */
static void linear_thread(const Layer *Ly, int l, int which, const Buffers *b, int m, float *y, long y_stride,
                          int accumulate, int t, int nt) {
    const Linear *L = layer_linear(Ly, which);
    for (int p = 0; p < L->num_parts; p++) {
        const int type = L->types[p], be = block_elems(type);
        const xq_t xq = xq_for(b, be, L->in_features);
        const size_t row_bytes = (size_t)(L->in_features / be) * ggml_quant_type_size(type);
        quant_matmul_thread(type, L->weights[p], L->packed[p], row_bytes, &xq, m, L->rows[p], y + L->starts[p], y_stride, 0,
                            L->bias ? L->bias + L->starts[p] : NULL, accumulate,
                            b->gemm_scratch + b->gemm_scratch_size * (size_t)t,
                            linear_claims(b, l, which) + (size_t)p * (size_t)b->claim_slots, b->claim_slots, t, nt);
    }
}

/* ---- LoRA: per adapter, its rows through A then B^T ------------------------- */

#define LORA_ROW_BLOCK 16 /* rows whose x stay in cache while a thread's rows of A pass over them */
#define LORA_COLS 64      /* output columns one expand item covers */

static inline const LoraLinear *lora_linear(const Step *S, int a, int layer, int which) {
    return &S->loras[a][layer].linears[which];
}

static inline float sum8(const float *acc) {
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* out[p][q] = dot8(a[p], x[q], d) for 2 rows of A and 4 rows of x, side by side:
 * each pair's sum in dot8's order (8 lanes, then its tree), but eight
 * independent chains instead of one, which a single dot8 is bound by. */
static inline void dot8_2x4(const float *restrict a0, const float *restrict a1, const float *const x[4], int d,
                            float out[2][4]) {
    float acc[2][4][8];
    for (int p = 0; p < 2; p++)
        for (int q = 0; q < 4; q++)
            for (int l = 0; l < 8; l++) acc[p][q][l] = 0.f;
    const float *restrict x0 = x[0], *restrict x1 = x[1], *restrict x2 = x[2], *restrict x3 = x[3];
    for (int i = 0; i < d; i += 8)
        for (int l = 0; l < 8; l++) {
            const float u = a0[i + l], v = a1[i + l];
            acc[0][0][l] = acc[0][0][l] + u * x0[i + l];
            acc[0][1][l] = acc[0][1][l] + u * x1[i + l];
            acc[0][2][l] = acc[0][2][l] + u * x2[i + l];
            acc[0][3][l] = acc[0][3][l] + u * x3[i + l];
            acc[1][0][l] = acc[1][0][l] + v * x0[i + l];
            acc[1][1][l] = acc[1][1][l] + v * x1[i + l];
            acc[1][2][l] = acc[1][2][l] + v * x2[i + l];
            acc[1][3][l] = acc[1][3][l] + v * x3[i + l];
        }
    for (int p = 0; p < 2; p++)
        for (int q = 0; q < 4; q++) out[p][q] = sum8(acc[p][q]);
}

/* Thread t's share of h[r] = A x_r (x [n, in], rows x_stride apart) for every row
 * with an adapter that adapts linear `which`: items are the adapters' rows of A,
 * taken two at a time over four rows at a time (a missing one repeats the first
 * and its result is dropped). */
static void lora_shrink(const Step *S, const Buffers *B, int layer, int which, const float *x, long x_stride, int in,
                        int t, int nt) {
    int total = 0;
    for (int a = 0; a < S->num_loras; a++)
        if (B->lora_starts[a + 1] > B->lora_starts[a]) total += lora_linear(S, a, layer, which)->rank;
    const int lo = (int)((long)total * t / nt), hi = (int)((long)total * (t + 1) / nt);
    const int W = S->lora_width;
    for (int a = 0, first = 0; a < S->num_loras && first < hi; a++) {
        const int g0 = B->lora_starts[a], g1 = B->lora_starts[a + 1];
        const LoraLinear *L = lora_linear(S, a, layer, which);
        if (g1 == g0 || L->rank == 0) continue;
        const int j0 = lo > first ? lo - first : 0, j1 = hi - first < L->rank ? hi - first : L->rank;
        for (int b0 = g0; b0 < g1; b0 += LORA_ROW_BLOCK) {
            const int b1 = b0 + LORA_ROW_BLOCK < g1 ? b0 + LORA_ROW_BLOCK : g1;
            for (int j = j0; j < j1; j += 2) {
                const int pair = j + 1 < j1;
                const float *a0 = L->a + (size_t)j * in, *a1 = pair ? a0 + in : a0;
                for (int i = b0; i < b1; i += 4) {
                    const int rows = b1 - i < 4 ? b1 - i : 4;
                    const float *xs[4];
                    for (int q = 0; q < 4; q++) xs[q] = x + (size_t)B->lora_rows[i + (q < rows ? q : 0)] * x_stride;
                    float out[2][4];
                    dot8_2x4(a0, a1, xs, in, out);
                    for (int q = 0; q < rows; q++) {
                        float *h = B->lora_h + (size_t)B->lora_rows[i + q] * W + j;
                        h[0] = out[0][q];
                        if (pair) h[1] = out[1][q];
                    }
                }
            }
        }
        first += L->rank;
    }
}

/* y[q][c] += sum over j of h[q][j] * bt[j, c] for c < width (16, or 8 at a
 * module's end: its columns are a multiple of 8) and up to 4 rows side by side
 * (a missing row repeats the first and is not written). Called with a
 * constant width, so each is its own unrolled loop. */
static inline void expand_tile(const float *restrict bt, int cols, int rank, const float *const h[4],
                               float *const y[4], int rows, int width) {
    float acc[4][16];
    for (int q = 0; q < 4; q++)
        for (int c = 0; c < 16; c++) acc[q][c] = 0.f;
    for (int j = 0; j < rank; j++) {
        const float *restrict b = bt + (size_t)j * cols;
        const float h0 = h[0][j], h1 = h[1][j], h2 = h[2][j], h3 = h[3][j];
        for (int c = 0; c < width; c++) {
            acc[0][c] = acc[0][c] + b[c] * h0;
            acc[1][c] = acc[1][c] + b[c] * h1;
            acc[2][c] = acc[2][c] + b[c] * h2;
            acc[3][c] = acc[3][c] + b[c] * h3;
        }
    }
    for (int q = 0; q < rows; q++)
        for (int c = 0; c < width; c++) y[q][c] = y[q][c] + acc[q][c];
}

/* Thread t's share of y[r, module columns] += h[r, module's ranks] B^T for those
 * rows: items are LORA_COLS columns of one adapter's module. Each output
 * element sums over the rank in order, then is added once. */
static void lora_expand(const Step *S, const Buffers *B, int layer, int which, float *y, long y_stride, int t,
                        int nt) {
    int total = 0;
    for (int a = 0; a < S->num_loras; a++) {
        const LoraLinear *L = lora_linear(S, a, layer, which);
        if (B->lora_starts[a + 1] == B->lora_starts[a] || L->rank == 0) continue;
        for (int m = 0; m < L->num_modules; m++) total += (L->col_count[m] + LORA_COLS - 1) / LORA_COLS;
    }
    const int lo = (int)((long)total * t / nt), hi = (int)((long)total * (t + 1) / nt);
    const int W = S->lora_width;
    int item = 0;
    for (int a = 0; a < S->num_loras && item < hi; a++) {
        const LoraLinear *L = lora_linear(S, a, layer, which);
        const int g0 = B->lora_starts[a], g1 = B->lora_starts[a + 1];
        if (g1 == g0 || L->rank == 0) continue;
        for (int m = 0; m < L->num_modules; m++) {
            const int cols = L->col_count[m], rank = L->rank_count[m];
            for (int c0 = 0; c0 < cols; c0 += LORA_COLS, item++) {
                if (item < lo || item >= hi) continue;
                const int c1 = c0 + LORA_COLS < cols ? c0 + LORA_COLS : cols;
                for (int i = g0; i < g1; i += 4) {
                    const int rows = g1 - i < 4 ? g1 - i : 4;
                    const float *h[4];
                    float *out[4];
                    for (int q = 0; q < 4; q++) {
                        const int r = B->lora_rows[i + (q < rows ? q : 0)];
                        h[q] = B->lora_h + (size_t)r * W + L->rank_start[m];
                        out[q] = y + (size_t)r * y_stride + L->col_start[m];
                    }
                    for (int c = c0; c < c1; c += 16) {
                        float *at[4] = {out[0] + c, out[1] + c, out[2] + c, out[3] + c};
                        if (c + 16 <= c1) expand_tile(L->bt[m] + c, cols, rank, h, at, rows, 16);
                        else expand_tile(L->bt[m] + c, cols, rank, h, at, rows, 8);
                    }
                }
            }
        }
    }
}

/* q/k norm (Qwen3), RoPE on q and k in place in the qkv row, then k and v into the cache. */
static void position_row(const Model *M, const Step *S, const Layer *Ly, int layer, float *restrict row, int r) {
    const int D = M->head_dim, H = M->num_heads, KVH = M->num_kv_heads, half = D / 2;
    const float *c = M->cos + (size_t)S->positions[r] * D, *s = M->sin + (size_t)S->positions[r] * D;
    for (int h = 0; h < H + KVH; h++) {
        float *x = row + (size_t)h * D;
        const float *norm = h < H ? Ly->q_norm : Ly->k_norm;
        float v[512];
        if (norm) rms_norm_row(x, norm, v, D, M->eps);
        else memcpy(v, x, sizeof(float) * D);
        /* x * cos + rotate_half(x) * sin, as transformers' apply_rotary_pos_emb */
        for (int d = 0; d < half; d++) x[d] = v[d] * c[d] + (-v[d + half]) * s[d];
        for (int d = half; d < D; d++) x[d] = v[d] * c[d] + v[d - half] * s[d];
    }
    const size_t at = (size_t)S->slots[r] * KVH;
    const size_t row_bytes = kv_row_bytes(S->kv_format, D);
    uint8_t *k_cache = S->k_caches[layer], *v_cache = S->v_caches[layer];
    for (int h = 0; h < KVH; h++) {
        kv_encode_row(S->kv_format, k_cache + (at + h) * row_bytes, row + (size_t)(H + h) * D, D);
        kv_encode_row(S->kv_format, v_cache + (at + h) * row_bytes, row + (size_t)(H + KVH + h) * D, D);
    }
}

/* ---- the stack --------------------------------------------------------------- */

/* A step of at most this many rows runs with private_rows when it has several threads. */
#define PRIVATE_ROWS_MAX 4

/* The row work that turns a layer's state into a linear's int8 input. */
typedef enum { INPUT_NORM, ATTN_OUT, POST_NORM, ACTIVATION } RowOp;

static void row_op(RowOp op, const Model *M, const Layer *Ly, const float *hidden, const Buffers *B, int r) {
    const int hid = M->hidden, I = M->intermediate;
    switch (op) {
    case INPUT_NORM:
    case POST_NORM:
        rms_norm_row(hidden + (size_t)r * hid, op == INPUT_NORM ? Ly->input_norm : Ly->post_norm,
                     B->normed + (size_t)r * hid, hid, M->eps);
        quantize_input_row(op == INPUT_NORM ? &Ly->qkv : &Ly->gate_up, B, B->normed, r);
        break;
    case ATTN_OUT:
        quantize_input_row(&Ly->o_proj, B, B->attn, r);
        break;
    case ACTIVATION: {
        const float *gu = B->gate_up + (size_t)r * 2 * I;
        float *a = B->act + (size_t)r * I;
        for (int i = 0; i < I; i++) a[i] = silu(gu[i]) * gu[I + i];
        quantize_input_row(&Ly->down, B, B->act, r);
        break;
    }
    }
}

/* Every row's `op` before a linear. Shared buffers: the rows split between the
 * threads, then a barrier (the linear reads every row). private_rows: each
 * thread does every row into its own copy and goes straight on to its share
 * of the linear; a decode row left the other threads waiting at that barrier
 * anyway, and a barrier is where a thread that the OS descheduled stalls all
 * the others. Either way each row is the same computation, so the same bits. */
static void rows_before_linear(RowOp op, const Model *M, const Layer *Ly, const float *hidden, const Buffers *B,
                               int n) {
    if (B->private_rows) {
        for (int r = 0; r < n; r++) row_op(op, M, Ly, hidden, B, r);
        return;
    }
#pragma omp for schedule(static)
    for (int r = 0; r < n; r++) row_op(op, M, Ly, hidden, B, r);
}

/* The per-row inputs of the linears and each one's width in elements: with
 * private_rows, lay_out places a copy of them per thread and thread_buffers
 * points thread t at its own (`M` and `kmax` in scope where it is expanded). */
#define PRIVATE_ROW_FIELDS(X)         \
    X(normed, float, M->hidden)       \
    X(act, float, M->intermediate)    \
    X(qs32, int8_t, xq_stride(kmax))  \
    X(qs256, int8_t, xq_stride(kmax)) \
    X(d32, float, kmax / 32)          \
    X(s32, float, kmax / 32)          \
    X(d256, float, kmax / 32)         \
    X(s256, float, kmax / 32)         \
    X(bsums32, int16_t, kmax / 16)    \
    X(bsums256, int16_t, kmax / 16)   \
    X(isum32, int16_t, kmax / 32)     \
    X(isum256, int16_t, kmax / 32)

/* Thread t's view of the step's buffers: with private_rows, its own copy of
 * the per-row inputs of the linears. */
static Buffers thread_buffers(const Buffers *B, const Model *M, int n, int t) {
    Buffers own = *B;
    if (!B->private_rows) return own;
    const size_t rows = (size_t)n * (size_t)t;
    const int kmax = B->kmax;
#define PAST_OTHER_COPIES(field, type, width) own.field += rows * (size_t)(width);
    PRIVATE_ROW_FIELDS(PAST_OTHER_COPIES)
#undef PAST_OTHER_COPIES
    return own;
}

static void run_layers(const Model *M, const Step *S, float *hidden, const Buffers *shared) {
    const int n = S->n, hid = M->hidden, H = M->num_heads, D = M->head_dim, I = M->intermediate;
    const int qkv_w = (H + 2 * M->num_kv_heads) * D;
#if defined(_OPENMP)
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const int nt = 1, t = 0;
#endif
    const Buffers own = thread_buffers(shared, M, n, t), *B = &own;
    float *attn_scratch = B->attn_scratch + (size_t)t * B->attn_scratch_floats;
    const int lora = S->row_lora != NULL; /* the same for every thread: they meet at the same barriers */
    for (int l = 0; l < M->num_layers; l++) {
        const Layer *Ly = &M->layers[l];
        const AttnLayer attn_layer = {D, H, M->num_kv_heads, M->scale, S->positions, S->tables, S->max_blocks,
                                      S->row_seq, S->k_caches[l], S->v_caches[l], S->block_size, S->kv_format};
        /* Each `omp for` ends in a barrier; a linear's output is read only after an explicit one. */
        rows_before_linear(INPUT_NORM, M, Ly, hidden, B, n);
        if (lora) lora_shrink(S, B, l, LINEAR_QKV, B->normed, hid, hid, t, nt);
        linear_thread(Ly, l, LINEAR_QKV, B, n, B->qkv, qkv_w, 0, t, nt);
#pragma omp barrier
        if (lora) {
            lora_expand(S, B, l, LINEAR_QKV, B->qkv, qkv_w, t, nt);
#pragma omp barrier
        }
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++) position_row(M, S, Ly, l, B->qkv + (size_t)r * qkv_w, r);
        /* One item per group of a sequence's rows (all heads, one kv head after
         * another) when there are enough of them to keep the threads busy: a
         * token's kv heads share cache lines, which the next kv head then
         * finds in L2 instead of both threads fetching them from memory. Else
         * one per (group, kv head): its heads share K/V loads; else one per
         * (group, head). */
        const int G = B->num_groups, kv_group = H / M->num_kv_heads;
        const int per_item = G >= 2 * nt ? H : G * M->num_kv_heads >= 2 * nt ? kv_group : 1;
        const int per_call = per_item < kv_group ? per_item : kv_group;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < G * (H / per_item); item++) {
            const int group = B->group_order[item / (H / per_item)], h0 = item % (H / per_item) * per_item;
            const int r0 = B->group_starts[group], nrows = B->group_starts[group + 1] - r0;
            for (int h = h0; h < h0 + per_item; h += per_call)
                attend(&attn_layer, B->qkv, (size_t)qkv_w, B->attn, r0, nrows, h, per_call, attn_scratch);
        }
        rows_before_linear(ATTN_OUT, M, Ly, hidden, B, n);
        if (lora) lora_shrink(S, B, l, LINEAR_O, B->attn, H * D, H * D, t, nt);
        linear_thread(Ly, l, LINEAR_O, B, n, hidden, hid, 1, t, nt); /* h = h + attn Wo^T */
#pragma omp barrier
        if (lora) {
            lora_expand(S, B, l, LINEAR_O, hidden, hid, t, nt);
#pragma omp barrier
        }
        rows_before_linear(POST_NORM, M, Ly, hidden, B, n);
        if (lora) lora_shrink(S, B, l, LINEAR_GATE_UP, B->normed, hid, hid, t, nt);
        linear_thread(Ly, l, LINEAR_GATE_UP, B, n, B->gate_up, 2L * I, 0, t, nt);
#pragma omp barrier
        if (lora) {
            lora_expand(S, B, l, LINEAR_GATE_UP, B->gate_up, 2L * I, t, nt);
#pragma omp barrier
        }
        rows_before_linear(ACTIVATION, M, Ly, hidden, B, n);
        if (lora) lora_shrink(S, B, l, LINEAR_DOWN, B->act, I, I, t, nt);
        linear_thread(Ly, l, LINEAR_DOWN, B, n, hidden, hid, 1, t, nt); /* h = h + act Wd^T */
#pragma omp barrier
        if (lora) {
            lora_expand(S, B, l, LINEAR_DOWN, hidden, hid, t, nt);
#pragma omp barrier
        }
    }
}

static int linear_ok(const Linear *L, int in, int out) {
    if (L->in_features != in || L->out_features != out || L->num_parts < 1 || L->num_parts > MAX_PARTS) return 0;
    int next = 0;
    for (int p = 0; p < L->num_parts; p++) {
        if (!tiles_for(L->types[p]) || in % block_elems(L->types[p]) || L->starts[p] != next) return 0;
        next += L->rows[p];
    }
    return next == out;
}

/* Rows x [n, D] written as a cache of `format` writes them (into `cache`, n
 * rows), then read back as attention reads them, times their scale, into
 * out [n, D]: the row format's round trip, for the tests. */
void decoder_kv_round_trip(int format, const float *x, int n, int D, void *cache, float *out) {
    const fp_mode_t caller = subnormals_off(); /* as decoder_forward runs */
    for (int r = 0; r < n; r++) {
        uint8_t *row = (uint8_t *)cache + (size_t)r * kv_row_bytes(format, D);
        kv_encode_row(format, row, x + (size_t)r * D, D);
        kv_widen(format, row, D, kv_row_scale(format, row, D), out + (size_t)r * D);
    }
    fp_mode_restore(caller);
}

/* 1 if this build can run the model (shapes the loops above assume), else 0. */
int decoder_model_ok(const Model *M) {
    const int D = M->head_dim, H = M->num_heads, KVH = M->num_kv_heads;
    if (M->num_layers < 1 || !attend_supported(D, H, KVH) || M->hidden % 32)
        return 0;
    for (int l = 0; l < M->num_layers; l++) {
        const Layer *Ly = &M->layers[l];
        if (!linear_ok(&Ly->qkv, M->hidden, (H + 2 * KVH) * D) || !linear_ok(&Ly->o_proj, H * D, M->hidden) ||
            !linear_ok(&Ly->gate_up, M->hidden, 2 * M->intermediate) ||
            !linear_ok(&Ly->down, M->intermediate, M->hidden))
            return 0;
        if ((Ly->q_norm == NULL) != (Ly->k_norm == NULL)) return 0;
    }
    return 1;
}

typedef struct {
    long keys;
    int group;
} GroupWork;

static int more_work_first(const void *a, const void *b) {
    const GroupWork *x = a, *y = b;
    if (x->keys != y->keys) return x->keys > y->keys ? -1 : 1;
    return x->group - y->group;
}

/* Attention's groups, the sequences with the most attention work (keys read
 * over their rows) first, each sequence's groups together in their order
 * (malloc'd; NULL if group_starts is). The threads take items in order as
 * they come free: decode rows of 100 to 1000+ keys taken in batch order left
 * one thread waiting at every layer's barrier for the other's last long item;
 * a prompt's groups stay together because each reads the same keys, which
 * the next finds in cache. Which thread serves an item never changes what it
 * computes. */
static int *order_groups(const Step *S, const int *group_starts, int num_groups) {
    if (!group_starts) return NULL;
    int *order = malloc(sizeof(int) * ((size_t)num_groups + 1));
    GroupWork *work = malloc(sizeof(GroupWork) * ((size_t)num_groups + 1));
    if (order && work) {
        for (int first = 0; first < num_groups;) {
            int end = first + 1; /* groups first .. end - 1: one sequence's */
            while (end < num_groups && S->row_seq &&
                   S->row_seq[group_starts[end]] == S->row_seq[group_starts[first]])
                end++;
            long keys = 0;
            for (int r = group_starts[first]; r < group_starts[end]; r++) keys += S->positions[r] + 1;
            for (int g = first; g < end; g++) work[g] = (GroupWork){keys, g};
            first = end;
        }
        qsort(work, (size_t)num_groups, sizeof *work, more_work_first);
        for (int g = 0; g < num_groups; g++) order[g] = work[g].group;
    } else {
        free(order);
        order = NULL;
    }
    free(work);
    return order;
}

/* Places B's buffers for rows rows in block, each 64-byte aligned, and
 * returns the bytes they take (with block NULL, only the bytes). B's
 * attn_scratch_floats and gemm_scratch_size are set first. */
static size_t lay_out(Buffers *B, char *block, const Model *M, const Step *S, size_t rows, int kmax,
                      int num_threads) {
    const int H = M->num_heads, D = M->head_dim, qkv_w = (H + 2 * M->num_kv_heads) * D, I = M->intermediate;
    const size_t copies = B->private_rows ? (size_t)num_threads : 1;
    size_t used = 0;
#define PLACE(field, type, count)                                         \
    B->field = block ? (type *)(void *)(block + used) : NULL;             \
    used += (sizeof(type) * (size_t)(count) + 63) / 64 * 64
/* AMX_ROWS - 1 rows more: the AMX tiles' last group may load qs rows past the step's (amx_packed_rows) */
#define PLACE_COPIES(field, type, width) PLACE(field, type, (copies * rows + AMX_ROWS - 1) * (size_t)(width));
    PRIVATE_ROW_FIELDS(PLACE_COPIES)
#undef PLACE_COPIES
    PLACE(qkv, float, rows * qkv_w);
    PLACE(attn, float, rows * H * D);
    PLACE(gate_up, float, rows * 2 * I);
    PLACE(attn_scratch, float, B->attn_scratch_floats * (size_t)num_threads);
    PLACE(gemm_scratch, uint8_t, B->gemm_scratch_size * (size_t)num_threads);
    PLACE(group_starts, int, rows + 1);
    const int lora = S->row_lora != NULL;
    PLACE(lora_h, float, lora ? rows * (size_t)S->lora_width : 0);
    PLACE(lora_rows, int, lora ? rows : 0);
    PLACE(lora_starts, int, lora ? S->num_loras + 1 : 0);
    PLACE(claims, panel_claims_t, (size_t)M->num_layers * LINEARS * MAX_PARTS * (size_t)num_threads);
#undef PLACE
    return used;
}

/* The buffers of a call stay allocated for the next: a prompt chunk's come to
 * megabytes, and fresh ones came from the kernel on every call, each page
 * faulted in and zeroed again where the linears and row loops first wrote
 * them (half the page faults of an offline prefill, by perf). One block, the
 * largest a call has needed, for one call at a time: a call that finds it
 * taken allocates its own. */
static pthread_mutex_t step_block_lock = PTHREAD_MUTEX_INITIALIZER;
static char *step_block;
static size_t step_block_bytes;

/* The kept block, at least bytes (a multiple of 64) long, held until step_block_give_back; NULL if another call holds it or memory ran out. */
static char *step_block_take(size_t bytes) {
    if (pthread_mutex_trylock(&step_block_lock) != 0) return NULL;
    if (bytes > step_block_bytes) {
        free(step_block);
        step_block = aligned_alloc(64, bytes);
        step_block_bytes = step_block ? bytes : 0;
    }
    if (!step_block) pthread_mutex_unlock(&step_block_lock);
    return step_block;
}

static void step_block_give_back(void) { pthread_mutex_unlock(&step_block_lock); }

/* The rows with an adapter, grouped by adapter in row order (a counting sort). */
static void group_lora_rows(const Step *S, const Buffers *B) {
    for (int a = 0; a <= S->num_loras; a++) B->lora_starts[a] = 0;
    for (int r = 0; r < S->n; r++)
        if (S->row_lora[r] >= 0) B->lora_starts[S->row_lora[r] + 1]++;
    for (int a = 0; a < S->num_loras; a++) B->lora_starts[a + 1] += B->lora_starts[a];
    for (int a = S->num_loras; a > 0; a--) B->lora_starts[a] = B->lora_starts[a - 1];
    B->lora_starts[0] = 0;
    for (int r = 0; r < S->n; r++)
        if (S->row_lora[r] >= 0) B->lora_rows[B->lora_starts[S->row_lora[r] + 1]++] = r;
}

/* hidden [n, M->hidden] in, the last layer's output out (in place).
 * Returns 0; 1 when memory ran out; 3 when a position is outside the rotary tables;
 * 4 when a row names an adapter the step does not carry. */
int decoder_forward(const Model *M, const Step *S, float *hidden, int num_threads) {
    const int n = S->n, H = M->num_heads, D = M->head_dim;
    if (n == 0) return 0;
    int max_pos = 0;
    for (int r = 0; r < n; r++) {
        if (S->positions[r] < 0 || S->positions[r] >= M->max_positions) return 3;
        if (S->positions[r] > max_pos) max_pos = (int)S->positions[r];
        if (S->row_lora && (S->row_lora[r] < -1 || S->row_lora[r] >= S->num_loras)) return 4;
    }
    if (num_threads < 1) num_threads = 1;
    int kmax = M->hidden > H * D ? M->hidden : H * D;
    kmax = kmax > M->intermediate ? kmax : M->intermediate;
    Buffers B;
    const size_t rows = (size_t)n;
    B.attn_scratch_floats = attend_scratch_floats(H / M->num_kv_heads, max_pos, D);
    B.gemm_scratch_size = gemm_scratch_bytes(kmax, n);
    B.private_rows = num_threads > 1 && n <= PRIVATE_ROWS_MAX;
    B.kmax = kmax;
    B.claim_slots = num_threads;
    const size_t total = lay_out(&B, NULL, M, S, rows, kmax, num_threads);
    char *block = step_block_take(total), *own = NULL;
    if (!block) block = own = aligned_alloc(64, total);
    if (!block) return 1;
    lay_out(&B, block, M, S, rows, kmax, num_threads);
    claims_init(M, &B);
    if (S->row_lora) group_lora_rows(S, &B);
    /* Consecutive rows of one sequence (a prompt chunk, a verification), up to ATTEND_ROWS at a time. */
    B.num_groups = 0;
    for (int r = 0; r < n; r++) {
        const int start = B.num_groups ? B.group_starts[B.num_groups - 1] : 0;
        if (r == 0 || !S->row_seq || S->row_seq[r] != S->row_seq[r - 1] || r - start == ATTEND_ROWS)
            B.group_starts[B.num_groups++] = r;
    }
    B.group_starts[B.num_groups] = n;
    B.group_order = order_groups(S, B.group_starts, B.num_groups);
    const int rc = B.group_order ? 0 : 1;
    if (rc == 0) {
#pragma omp parallel num_threads(num_threads)
        {
            const fp_mode_t caller = subnormals_off();
            run_layers(M, S, hidden, &B);
            fp_mode_restore(caller);
        }
    }
    free(B.group_order);
    if (own)
        free(own);
    else
        step_block_give_back();
    return rc;
}
