/* kernels.h: the backend table, one function pointer per numeric op of the V4.1 forward.
 *
 * The forward (common/model/forward*.c) is written once against this table. kernels/cpu fills
 * every entry but the optional `sample` with the plain C reference (kern_cpu_create); a device
 * backend later overrides the entries it supports and must match the CPU entry within the
 * tolerance stated at each op.
 *
 * Conventions shared by every op:
 *  - One POD params struct per op; the op reads it and never keeps a pointer to it.
 *  - "bf16" tensors are uint16_t arrays holding the upper 16 bits of an fp32 (numfmt.h).
 *    "f32" tensors are float arrays. Quantised tensors are uint8_t arrays in the formats of
 *    numfmt.h (E4M3, UE8M0, packed E2M1 with element 2i in the low nibble).
 *  - Shapes are given as [rows, cols] in row-major order; a `*_stride` field is the distance
 *    between consecutive rows in ELEMENTS of the tensor's dtype (bytes for byte tensors).
 *  - Tensor data (activations, weights, caches, scores, indices written by ops) lives in the
 *    backend's memory (alloc below). Step metadata (kern_seq arrays, positions, row lists,
 *    visible counts) is host memory: a device backend copies it as part of its launch.
 *  - Every op returns DI_OK, DI_ENOMEM when its scratch cannot be allocated, or
 *    DI_EUNSUPPORTED when the backend lacks that case (it never computes something approximate
 *    instead). Outputs are undefined after a failure. Shape violations are programming errors:
 *    the CPU backend asserts them.
 *  - Determinism: every output element is a pure function of the op's inputs for that row;
 *    it does not depend on how many rows or sequences share the call, on their order, or on
 *    the number of threads. This is what makes decode == prefill and batch invariance hold
 *    bit for bit on the CPU backend.
 *
 * Arithmetic of the CPU backend: every dot product and sum is accumulated in double (products
 * of two floats are exact there) and rounded once to fp32 where the math stores a value, then
 * to bf16 where MODEL.md stores bf16; transcendental functions (exp, sigmoid, softplus, sqrt,
 * cos/sin) are evaluated in double on fp32 inputs and rounded once. This makes results
 * independent of summation order and equal, bit for bit, to the independent NumPy reference
 * (tests/reference), which follows the same rule. The rounding points are named at each op.
 *
 * Tolerances (device vs CPU) are per op below: "exact" means bit-identical; "bf16 1ulp" means
 * each output may differ from the CPU value by one bf16 unit in the last place (summation order
 * differs); attention and GEMMs state abs/rel/cosine bounds. Note that FP8/FP4 quantisation
 * turns a one-ulp difference into a step of a quantisation level, so whole-model logits of two
 * backends agree only statistically, not within these per-op bounds.
 */
#ifndef DI_KERNELS_KERNELS_H
#define DI_KERNELS_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

/* ---- step metadata ------------------------------------------------------------------------ */

/* One sequence's share of a step: its rows are consecutive in every [T, ...] tensor and sit at
 * consecutive positions. Written by the forward from the engine's step plan. */
typedef struct kern_seq {
    uint32_t row0;              /* first row of this sequence in the step's tensors */
    uint32_t n_rows;            /* rows of this sequence (seqlen_q) */
    int64_t pos0;               /* absolute position of its first row */
    uint8_t *slot;              /* its state slot (rings + compressor state), backend memory */
    const uint32_t *blocks;     /* block table: block ids of its positions 128*i .. 128*i+127 */
    uint32_t n_blocks;          /* entries in `blocks` */
    int64_t window_lo;          /* rows at position >= window_lo read no window key below it
                                 * (YOCO mask/compact clip); 0 = no clip */
    int32_t ring_hi;            /* draft-block attention: -1 normally; otherwise rows read ring
                                 * positions [max(0, ring_hi-window+1), ring_hi] plus every row
                                 * of this sequence in the step (no causal mask) */
    const int32_t *history;     /* Engram: ids of positions pos0-n_history .. pos0-1 */
    uint32_t n_history;         /* min(pos0, max_ngram - 1) */
} kern_seq;

/* The paged KV pool and where one owner layer's entries sit inside a block (kv_layout.h). */
typedef struct kern_kv_pool {
    uint8_t *blocks;            /* block 0 at blocks, block b at blocks + b * block_bytes */
    size_t block_bytes;         /* kv_block_bytes (114,048 for V4.1-Flash) */
    uint32_t entries_per_block; /* block_tokens / ratio of the owner */
    size_t main_offset;         /* kv_owner_main_offset(owner, 0) */
    size_t main_entry_bytes;    /* head_dim/2 + head_dim/16 (288) */
    size_t index_offset;        /* kv_owner_index_offset(owner, 0) */
    size_t index_entry_bytes;   /* index_head_dim/2 + index_head_dim/32 (68) */
} kern_kv_pool;

/* ---- numerics ------------------------------------------------------------------------------ */

/* Input embedding, expanded to the hyper-connection copies.
 * out[t, c, :] = table[ids[t], :] for c < n_copies. Exact. */
typedef struct kern_embed {
    uint32_t n_rows;            /* T */
    uint32_t dim;               /* D */
    uint32_t n_copies;          /* hc_mult (4) */
    uint32_t vocab;             /* rows of table; ids must be below it */
    const int32_t *ids;         /* [T] token ids (host) */
    const uint16_t *table;      /* [vocab, D] bf16 */
    uint16_t *out;              /* [T, n_copies, D] bf16 */
    const int32_t *ids_dev;     /* [T] token ids in backend memory, read instead of ids (which
                                 * may then be NULL): the ids a device op wrote (one step
                                 * ahead). An id outside [0, vocab) gives a zero row and fails
                                 * the op (CPU) or the next synchronisation (a device). NULL:
                                 * ids */
} kern_embed;

/* RMSNorm: r = fp32(1/sqrt(fp32(mean(x^2)) + eps)), y = bf16(fp32(fp32(x * r) * w)). y may
 * alias x. Tolerance: bf16 1ulp. */
typedef struct kern_rmsnorm {
    uint32_t n_rows;
    uint32_t dim;
    const uint16_t *x;          /* [n_rows, dim] bf16, row stride x_stride */
    size_t x_stride;
    const uint16_t *weight;     /* [dim] bf16; NULL = all ones */
    uint16_t *y;                /* [n_rows, dim] bf16, row stride y_stride */
    size_t y_stride;
    float eps;                  /* 1e-20 */
} kern_rmsnorm;

/* Rotary embedding, interleaved pairs, with optional YaRN (MODEL.md §2.4), in place.
 * For each row r and head h, the numbers x[r, h, offset + 2i], x[r, h, offset + 2i + 1]
 * (i < rope_dim/2) rotate by angle sign * pos[r] * f_i, sign = -1 when inverse.
 * f_i = base^(-2i/rope_dim), blended with f_i/factor over the YaRN ramp when yarn is set.
 * Angles in fp32 (pos * f_i rounded to fp32); cos/sin correctly rounded; math fp32; bf16 out.
 * Tolerance: bf16 1ulp. */
typedef struct kern_rope {
    uint32_t n_rows;
    uint32_t n_heads;
    uint16_t *x;                /* [n_rows, ...] bf16; head h of row r at x + r*row_stride + h*head_stride */
    size_t row_stride;
    size_t head_stride;
    uint32_t offset;            /* first rotated number inside a head (head_dim - rope_dim) */
    uint32_t rope_dim;          /* rotated numbers per head (even) */
    const int64_t *positions;   /* [n_rows] rotation positions (host) */
    int inverse;                /* 1: rotate by -angle */
    float base;                 /* rope_theta or compress_rope_theta */
    int yarn;                   /* apply the YaRN blend */
    float yarn_factor;          /* 16 */
    float yarn_orig_len;        /* original_max_position_embeddings, 65536 */
    float yarn_beta_fast;       /* 32 */
    float yarn_beta_slow;       /* 1 */
} kern_rope;

/* Hyper-connection mixes of one site for every row (MODEL.md §2.3 steps 1-7):
 * v = flatten(h[t]); r = fp32(1/sqrt(fp32(mean(v^2)) + norm_eps)); m = fp32(fp32(fn @ v) * r);
 * pre = fp32(sigmoid(m[0:hc]*scale[0] + base)) + eps; post = fp32(2*sigmoid(m[hc:2hc]*scale[1]
 * + base)); comb = fp32(Sinkhorn(m[2hc:]*scale[2] + base)) with `iters` iterations ending on
 * columns, in double. Tolerance: abs 1e-5 on pre/post/comb. */
typedef struct kern_hc_mixes {
    uint32_t n_rows;
    uint32_t n_copies;          /* hc (4) */
    uint32_t dim;               /* D */
    const uint16_t *h;          /* [T, hc, D] bf16 */
    const float *fn;            /* [(2+hc)*hc, hc*D] f32 */
    const float *base;          /* [(2+hc)*hc] f32 */
    const float *scale;         /* [3] f32 */
    uint32_t sinkhorn_iters;    /* 20 */
    double eps;                 /* hc_eps, 1e-6: Sinkhorn's in double, pre's as fp32 */
    float norm_eps;             /* rms_norm_eps, 1e-20 */
    float *pre;                 /* [T, hc] f32 */
    float *post;                /* [T, hc] f32 */
    float *comb;                /* [T, hc, hc] f32, comb[t][i][j] (input copy i -> output j) */
} kern_hc_mixes;

/* Collapse: out[t, :] = bf16(fp32( sum_c pre[t, c] * h[t, c, :] )).
 * Also gives the draft taps (pre = 1/hc for every copy is the fp32 mean). Exact given pre. */
typedef struct kern_hc_collapse {
    uint32_t n_rows;
    uint32_t n_copies;
    uint32_t dim;
    const uint16_t *h;          /* [T, hc, D] bf16 */
    const float *pre;           /* [T, hc] f32, row stride pre_stride (0: one row for all) */
    size_t pre_stride;
    uint16_t *out;              /* [T, D] bf16, row stride out_stride */
    size_t out_stride;
} kern_hc_collapse;

/* Expand: out[t, j, :] = bf16(fp32( post[t, j] * y[t, :] + sum_i comb[t, i, j] * h[t, i, :] )).
 * out must not alias h. Exact given the inputs. */
typedef struct kern_hc_expand {
    uint32_t n_rows;
    uint32_t n_copies;
    uint32_t dim;
    const uint16_t *y;          /* [T, D] bf16 (sublayer output) */
    const uint16_t *h;          /* [T, hc, D] bf16 (stream before the sublayer) */
    const float *post;          /* [T, hc] */
    const float *comb;          /* [T, hc, hc] */
    uint16_t *out;              /* [T, hc, D] bf16 */
} kern_hc_expand;

/* Weight formats of kern_linear. */
typedef enum kern_wfmt {
    KERN_W_FP8 = 0,   /* E4M3 [n, k] + UE8M0 scale [ceil(n/32), k/32] (32x32 blocks) */
    KERN_W_FP4 = 1,   /* packed E2M1 [n, k/2] + UE8M0 scale [n, k/32] (1x32 blocks) */
    KERN_W_BF16 = 2,  /* bf16 [groups*n, k] */
} kern_wfmt;

/* Linear layer y = x @ W^T.
 *  linear_fp8 / linear_fp4: each row of x is fake-quantised by procedure (A) (E4M3, UE8M0
 *    per 32 inputs) and multiplied with the dequantised weight; fp32 accumulation; y bf16
 *    (or f32 when out_f32).
 *  linear_bf16: x and W bf16 taken exactly as fp32, fp32 accumulation; y bf16 or f32. With
 *    groups > 1 it is the grouped projection: row t's input is `groups` slices of k numbers,
 *    slice g multiplies weight rows [g*n, (g+1)*n), output columns [g*n, (g+1)*n).
 *  accumulate (f32 output only): y += result instead of y = result.
 * k must be a multiple of 32. Tolerance: |y - y_cpu| <= 1e-2 * max(1, |y_cpu|) per element and
 * cosine >= 0.9999 per row (a device accumulates in another order). */
typedef struct kern_linear {
    uint32_t m;                 /* rows */
    uint32_t n;                 /* outputs (per group) */
    uint32_t k;                 /* inputs (per group), multiple of 32 */
    uint32_t groups;            /* 1, or the o_groups of wo_a (bf16 only) */
    const uint16_t *x;          /* [m, groups*k] bf16, row stride x_stride */
    size_t x_stride;
    const void *w;              /* see kern_wfmt */
    const uint8_t *w_scale;     /* see kern_wfmt; NULL for bf16 */
    int out_f32;                /* 0: y bf16, 1: y f32 */
    int accumulate;             /* f32 only: add into y */
    void *y;                    /* [m, groups*n], row stride y_stride (elements) */
    size_t y_stride;
} kern_linear;

/* In-place fake quantisation of bf16 rows: x <- dequant(quant(x)) by a numfmt procedure.
 * Every dequantised value is exact in bf16. Exact. */
typedef enum kern_qfmt {
    KERN_Q_FP8_B32 = 0,         /* (A): E4M3, UE8M0 per 32 */
    KERN_Q_FP4_B32 = 1,         /* (B): E2M1, UE8M0 per 32 */
    KERN_Q_FP4_B16 = 2,         /* (C): E2M1, E4M3 per 16 */
} kern_qfmt;

typedef struct kern_fakequant {
    uint32_t n_rows;
    uint32_t n;                 /* numbers per row (multiple of the block) */
    uint16_t *x;                /* [n_rows, n] bf16, row stride `stride` */
    size_t stride;
    kern_qfmt fmt;
} kern_fakequant;

/* Window KV store (MODEL.md §2.5 step 3), in two calls around the layer's attention:
 *  - encode (kv != NULL): each row's kv vector is quantised by (A) into one ring entry
 *    (dim E4M3 codes, then dim/32 UE8M0 scales) in local[t]; attention reads this step's
 *    positions from local;
 *  - commit (commit = 1): for rows among the last ring_positions rows of their sequence, the
 *    entry local[t] is copied to ring slot pos mod ring_positions of the sequence's state slot
 *    (sequences with slot NULL are skipped). Committing after the attention keeps a long
 *    prefill chunk from overwriting ring positions that its own first rows still read.
 * Both may be done in one call. Exact (bytes). */
typedef struct kern_ring_store {
    uint32_t n_rows;
    uint32_t dim;               /* head_dim (512) */
    const uint16_t *kv;         /* [T, dim] bf16 (normed, roped); NULL = local already encoded */
    int commit;                 /* copy local entries into the rings */
    uint32_t n_seqs;
    const kern_seq *seqs;       /* [n_seqs] (host) */
    size_t ring_offset;         /* byte offset of this layer's ring in a state slot */
    uint32_t ring_positions;    /* R (134) */
    uint8_t *local;             /* [T, dim + dim/32] bytes: this step's entries */
} kern_ring_store;

/* Ratio-r compressor pooling (MODEL.md §2.6, r > 1). Row t at position p contributes
 * (a[t], g[t]). Every row among the last `state_tokens` rows of its sequence is saved in the
 * compressor state slot p mod state_tokens (fp32 a[dim] then g[dim]) at state_offset of its
 * state slot (sequences with slot NULL, placeholder rows, save nothing). For each emitted
 * entry e (a row whose position p has (p+1) % r == 0), group j = p / r covers positions
 * j*r .. j*r+r-1; tokens before the sequence's pos0 come from the state, later ones from a/g.
 * latent[e][d] = bf16(fp32( sum_t fp32(softmax_t(g[., d])) * a[t][d] )), softmax and sum in
 * double. Exact given the inputs. */
typedef struct kern_compress_pool {
    uint32_t n_rows;
    uint32_t dim;               /* head_dim */
    uint32_t ratio;             /* r >= 2 */
    const float *a;             /* [T, dim] f32 */
    const float *g;             /* [T, dim] f32 */
    uint32_t n_seqs;
    const kern_seq *seqs;       /* (host) */
    const int32_t *row_seq;     /* [T] sequence index of each row (host) */
    size_t state_offset;        /* byte offset of this owner's pending tokens in a state slot */
    uint32_t state_tokens;      /* r - 1 + spare ring positions */
    uint32_t n_emit;
    const int32_t *emit_row;    /* [n_emit] row completing each group (host) */
    uint16_t *latent;           /* [n_emit, dim] bf16, before the compressor norm */
} kern_compress_pool;

/* Compressed-entry store: main entry e (roped latent, dim numbers) is quantised by (C) into
 * dim/2 bytes of E2M1 then dim/16 E4M3 scales; index key e (index_dim numbers) by (B) into
 * index_dim/2 bytes then index_dim/32 UE8M0. Entry id j of sequence s goes to block
 * seqs[s].blocks[j / entries_per_block], slot j % entries_per_block. Exact (bytes). */
typedef struct kern_compressed_store {
    uint32_t n_entries;
    uint32_t dim;               /* head_dim */
    uint32_t index_dim;         /* index_head_dim */
    const uint16_t *main;       /* [n, dim] bf16 */
    const uint16_t *index;      /* [n, index_dim] bf16; NULL: no index keys (not an owner) */
    const int64_t *entry_id;    /* [n] entry number j (host) */
    const int32_t *entry_seq;   /* [n] sequence index (host) */
    const kern_seq *seqs;       /* (host) */
    kern_kv_pool pool;
} kern_compressed_store;

/* Sparse attention with a learned sink (MODEL.md §2.5 steps 5-8). For row t of sequence s at
 * position p, the key set is
 *   window: positions max(0, p-window+1, lo) .. p where lo = window_lo if p >= window_lo else
 *           0; position q >= pos0 is read from local[row0 + q - pos0], else from the ring slot
 *           q mod ring_positions (draft blocks: see kern_seq.ring_hi);
 *   compressed: the ids topk[t, 0..topk_n) that are >= 0, read from the paged blocks.
 * s_e = fp32(fp32(q_h . kv_e) * scale). Key slots: the window (ascending position; normal rows
 * pad it with empty slots up to `window`), then topk[t, 0..topk_n) (-1 = empty slot), walked in
 * blocks of 64 slots with a running max m (from -1e30), per block m' = max(m, s in block),
 * p_e = fp32 exp(s_e - m'), sum = sum * exp(m - m') + sum p_e,
 * acc = acc * exp(m - m') + sum bf16(p_e) kv_e (fp32); finally sum += exp(sink_h - m) and
 * o_h = bf16(acc / sum) (MODEL.md §2.5 (a)-(d); empty slots count toward the 64 only).
 * Tolerance: abs 2e-2, cosine >= 0.9999 per head. */
typedef struct kern_sparse_attn {
    uint32_t n_rows;
    uint32_t n_heads;
    uint32_t head_dim;          /* 512 */
    uint32_t window;            /* 128 */
    uint32_t ring_positions;    /* 134 */
    const uint16_t *q;          /* [T, n_heads, head_dim] bf16 */
    const uint8_t *local;       /* [T, ring entry] this step's window entries (kern_ring_store) */
    size_t ring_offset;         /* this layer's ring in a state slot */
    const int32_t *topk;        /* [T, topk_n] entry ids ascending, -1 = none; NULL = no long range */
    uint32_t topk_n;
    kern_kv_pool pool;          /* the compressed source (main entries) */
    uint32_t n_seqs;
    const kern_seq *seqs;       /* (host) */
    const float *sink;          /* [n_heads] f32 */
    float scale;                /* head_dim^-0.5 */
    uint16_t *out;              /* [T, n_heads, head_dim] bf16 */
} kern_sparse_attn;

/* Indexer scores (MODEL.md §2.7): for row t and entry j < n_visible[t],
 * I = bf16( sum_h e_h ) (fp32 sum), e_h = bf16( bf16(w[t,h] * w_scale) * max(0, bf16(q[t,h] . k_j)) )
 * (the dot in fp32, each rounding as the reference's BF16 tensors do) with k_j the key of entry
 * j of the row's sequence (paged blocks); entries j >= n_visible[t] and entries outside the
 * candidate mask (when given) get -inf. q is already FP4 fake-quantised; w is the bf16
 * weights_proj output; w_scale = index_head_dim^-0.5 * index_n_heads^-0.5 exactly (double).
 * Only columns [0, max n_visible) are written. Tolerance: bf16 1ulp. */
typedef struct kern_index_scores {
    uint32_t n_rows;
    uint32_t n_heads;           /* index_n_heads (32) */
    uint32_t head_dim;          /* index_head_dim (128) */
    const uint16_t *q;          /* [T, n_heads, head_dim] bf16 */
    const uint16_t *w;          /* [T, n_heads] bf16 head weights (weights_proj output) */
    double w_scale;             /* factor applied to each weight (product rounded to fp32) */
    const int32_t *n_visible;   /* [T] visible entries (host) */
    const int32_t *row_seq;     /* [T] sequence of each row (host) */
    const kern_seq *seqs;       /* (host) */
    kern_kv_pool pool;          /* the key owner's index entries */
    const uint8_t *cand_mask;   /* [T, cand_stride] 1 = block kept; NULL = no mask */
    size_t cand_stride;
    uint32_t cand_block;        /* entries per candidate block */
    float *scores;              /* [T, stride] f32 */
    size_t stride;
} kern_index_scores;

/* Candidate blocks (layer 20): block b = entries [b*block, (b+1)*block), score = max of its
 * entries; the block of the newest visible entry counts as +inf; keep the best
 * min(top_blocks, ceil(n_visible/block)) blocks (ties: lower block), drop -inf picks.
 * mask[t, b] = 1 for kept blocks, 0 otherwise (columns up to ceil(max n_visible/block)). Exact. */
typedef struct kern_index_candidates {
    uint32_t n_rows;
    const float *scores;        /* [T, stride] from kern_index_scores */
    size_t stride;
    const int32_t *n_visible;   /* [T] (host) */
    uint32_t block;             /* candidate_block_size (8) */
    uint32_t top_blocks;        /* candidate_topk_blocks (2048) */
    uint8_t *mask;              /* [T, mask_stride] */
    size_t mask_stride;
} kern_index_candidates;

/* Top-k: out[t] = the min(k, n_visible[t]) entries with the best scores (ties: lower entry;
 * -inf ranks below every finite score), sorted ascending, padded with -1 to k. Exact. */
typedef struct kern_index_topk {
    uint32_t n_rows;
    uint32_t k;                 /* index_topk (512) */
    const float *scores;        /* [T, stride] */
    size_t stride;
    const int32_t *n_visible;   /* [T] (host) */
    int32_t *out;               /* [T, k] */
} kern_index_topk;

/* MoE router (MODEL.md §2.8) on precomputed fp32 logits z = x @ W_gate^T:
 * s = fp32(sqrt(fp32(softplus(z / temp)))) (double); pick the top_k of fp32(s + bias) (ties:
 * lower expert); w = fp32(fp32(s / fp32(sum of picked s + 1e-20)) * route_scale). ids in rank
 * order. Tolerance: exact ids except at near-ties, weights abs 1e-6. */
typedef struct kern_moe_gate {
    uint32_t n_rows;
    uint32_t n_experts;
    uint32_t top_k;
    const float *logits;        /* [T, n_experts] f32 */
    const float *bias;          /* [n_experts] f32; NULL = zeros */
    float temp;                 /* gate_temp, 1.0 */
    float route_scale;          /* 1.5 */
    int32_t *ids;               /* [T, top_k] expert ids */
    float *weights;             /* [T, top_k] routing weights */
} kern_moe_gate;

/* SwiGLU with the asymmetric clamp: with g' = min(g, limit) and u' = clamp(u, -limit, limit),
 * silu = fp32(g' * sigmoid(g')) (double), h = bf16(fp32(fp32(silu * u') * w[row])) (limit 0 =
 * no clamp; w NULL = 1). Exact given the inputs. */
typedef struct kern_swiglu {
    uint32_t n_rows;
    uint32_t n;
    const uint16_t *g;          /* [n_rows, n] bf16, row stride `stride` */
    const uint16_t *u;          /* [n_rows, n] bf16, row stride `stride` */
    size_t stride;
    const float *w;             /* [n_rows] per-row weight; NULL = 1 */
    float limit;                /* swiglu_limit (10) */
    uint16_t *h;                /* [n_rows, n] bf16, row stride n */
} kern_swiglu;

/* One expert's three projections. Routed: FP4 (1x32 scales); shared: FP8 (32x32). */
typedef struct kern_expert {
    const uint8_t *w1, *w1_scale; /* [inter, dim] gate projection */
    const uint8_t *w3, *w3_scale; /* [inter, dim] up projection */
    const uint8_t *w2, *w2_scale; /* [dim, inter] down projection */
} kern_expert;

/* Routed experts + shared expert + combine (MODEL.md §2.8): for each row,
 * y = bf16( sum over its experts of out_e + out_shared ) (the sum in double), where
 * out_e = bf16(W2_e bf16(swiglu(W1_e x, W3_e x, w_e))) with FP8 activations (linear_fp4) and
 * the shared expert the same with FP8 weights and weight 1. Tolerance: |y - y_cpu| <= 1e-2 *
 * max(1, |y_cpu|, rms of the row of y_cpu) per element, cosine >= 0.9999 per row. (The hidden
 * activations are re-quantised to FP8 before W2: a one-ulp difference of W1 x or W3 x can move
 * one of them by a quantisation step, which moves every output of the row a little, so an
 * output small against its row may miss kern_linear's per-element bound.) */
typedef struct kern_moe_experts {
    uint32_t n_rows;
    uint32_t dim;
    uint32_t inter;             /* moe_intermediate_size */
    uint32_t shared_inter;      /* inter * n_shared_experts; 0 = no shared expert */
    uint32_t n_experts;
    uint32_t top_k;
    const uint16_t *x;          /* [T, dim] bf16 (ffn-normed) */
    const int32_t *ids;         /* [T, top_k] from kern_moe_gate */
    const float *weights;       /* [T, top_k] */
    const kern_expert *experts; /* [n_experts] FP4 (host array of weight pointers) */
    kern_expert shared;         /* FP8 */
    float swiglu_limit;
    uint16_t *y;                /* [T, dim] bf16 */
} kern_moe_experts;

/* Engram n-gram hashing (MODEL.md §2.9): for row t at position p of sequence s and lookback
 * i < max_ngram, tok_i = map[id at p-i] (from the step's rows or seqs[s].history); from the
 * first i with p-i < 0 on, tok_i = pad. R_0 = tok_0*M_0, R_i = R_{i-1} ^ (tok_i*M_i) (uint64);
 * out[t, l, (n-1)*heads + k] = R_n mod primes[l][(n-1)*heads+k] + offsets[l][same].
 * Exact. */
typedef struct kern_engram_hash {
    uint32_t n_rows;
    uint32_t n_layers;          /* Engram layers */
    uint32_t max_ngram;         /* 4 */
    uint32_t n_heads;           /* 8 */
    const int32_t *ids;         /* [T] (host) */
    const int32_t *row_seq;     /* [T] (host) */
    const kern_seq *seqs;       /* (host) */
    const int32_t *token_map;   /* [vocab] compressed id of each token (host) */
    uint32_t vocab;
    int32_t pad_id;             /* compressed pad id (token_map[pad_token_id]) */
    const uint64_t *multipliers;/* [n_layers, max_ngram] (host) */
    const uint64_t *primes;     /* [n_layers, (max_ngram-1)*n_heads] (host) */
    const uint64_t *offsets;    /* [n_layers, (max_ngram-1)*n_heads] (host) */
    int64_t *out;               /* [T, n_layers, (max_ngram-1)*n_heads] */
    const int32_t *ids_dev;     /* [T] the step's row ids in backend memory, read instead of
                                 * ids (history stays host): as kern_embed.ids_dev. NULL: ids */
} kern_engram_hash;

/* Fills one Engram table row: head_dim E4M3 codes and head_dim/32 UE8M0 scales. For tables
 * that are generated on demand instead of stored. */
typedef void (*kern_engram_row_fn)(void *userdata, uint64_t row, uint8_t *codes, uint8_t *scales);

/* Engram lookup: out[t, c*head_dim + i] = dequant(table row hash[t, c])[i], bf16. Exact. */
typedef struct kern_engram_lookup {
    uint32_t n_rows;
    uint32_t n_cols;            /* (max_ngram-1) * n_heads (24) */
    uint32_t head_dim;          /* 256 */
    const int64_t *hash;        /* [T, hash_stride]: this layer's row ids at column 0.. */
    size_t hash_stride;
    const uint8_t *table;       /* [rows, head_dim] E4M3, or NULL with row_fn */
    const uint8_t *table_scale; /* [rows, head_dim/32] UE8M0 */
    uint64_t table_rows;
    kern_engram_row_fn row_fn;  /* generator when table is NULL */
    void *row_userdata;
    uint16_t *out;              /* [T, n_cols*head_dim] bf16 */
} kern_engram_lookup;

/* Engram gate and residual update (MODEL.md §2.9 module steps 3-4), in place on h:
 * for copy c: w = qw[c]*kw[c]; rstd = rsqrt(mean(h_c^2)+eps) * rsqrt(mean(key_c^2)+eps);
 * dot = (sum_d h_c*w*key_c) * rstd / sqrt(D); gate = sigmoid(sign(dot)*sqrt(max(|dot|, clamp)));
 * h_c <- bf16(fp32(h_c + gate * value)); the rounding points are those of the reference:
 * dot = fp32(fp32(fp32(sum) * fp32(r_h * r_k)) / fp32(sqrt(D))), gate = fp32(sigmoid(.)).
 * Tolerance: bf16 1ulp. */
typedef struct kern_engram_gate {
    uint32_t n_rows;
    uint32_t n_copies;
    uint32_t dim;
    uint16_t *h;                /* [T, hc, D] bf16, in place */
    const uint16_t *kv;         /* [T, (hc+1)*D] bf16: key copy c at c*D, value at hc*D */
    const uint16_t *q_weight;   /* [hc, D] bf16 */
    const uint16_t *k_weight;   /* [hc, D] bf16 */
    double eps;                 /* rms_norm_eps 1e-20, added in double */
    double clamp;               /* 1e-6 */
} kern_engram_gate;

/* Row gather: dst row i = src row rows[i] (rows NULL: row i), row_bytes bytes each. dst may
 * be src itself for a compaction (rows strictly ascending, so rows[i] >= i): rows are then
 * moved in ascending order. Otherwise the two must not overlap. Exact. */
typedef struct kern_copy_rows {
    uint32_t n_rows;
    size_t row_bytes;
    const void *src;
    size_t src_stride;          /* bytes */
    const int32_t *rows;        /* [n_rows] source rows (host); NULL = identity */
    void *dst;
    size_t dst_stride;          /* bytes */
} kern_copy_rows;

/* ---- sampling on the backend ------------------------------------------------------------ */

/* Sampling from logits that stay in backend memory: each row's token drawn exactly as
 * common/sampling's sampler_sample draws it (sampler.h steps 1-10: force top-k with ties to the
 * lower id, temperature, integer masses floor(w * 2^31), draw order, top-k, top-p, the keyed
 * Philox draw), with its processed logprob and top logprobs. Only integer sums follow the
 * exponentials, so no result depends on a reduction order. Blacklist, a banned EOS and a
 * grammar mask arrive as one bitmap of allowed tokens (sampler_kern_row builds it). This entry
 * is optional: the CPU backend leaves it NULL and the caller runs common/sampling on host
 * logits, which is its reference (tests/gpu/check_sample.c). */
#define KERN_SAMPLE_MAX_TOP 20

typedef enum kern_sample_status {
    KERN_SAMPLE_OK = 0,
    KERN_SAMPLE_BAD_LOGIT = 1,   /* a logit is NaN or +inf (sampler.h: DI_ERANGE) */
    KERN_SAMPLE_ALL_BLOCKED = 2, /* no token may be drawn (DI_ERANGE) */
} kern_sample_status;

/* One row's parameters, already validated and resolved (sampling_params, sampler_row). */
typedef struct kern_sample_row {
    float temperature;          /* > 0 and finite: the temperature used (0 already made 1e-5) */
    float top_p;                /* (0, 1]; 1 = off */
    int32_t top_k;              /* <= 0 = off */
    uint32_t force_top_k;       /* 0 = off */
    uint32_t n_logprobs;        /* 0 .. KERN_SAMPLE_MAX_TOP */
    uint64_t seed;              /* key of the draw (the draft seed for a draft row) */
    uint64_t stream;            /* counter of the draw: sampler_stream(position, row, case) */
    const uint32_t *allowed;    /* host [(n_vocab + 31) / 32]: bit t % 32 of word t / 32 set =
                                 * token t may be drawn; NULL = every token */
} kern_sample_row;

/* One row's outcome (host memory). */
typedef struct kern_sample_out {
    int32_t status;             /* kern_sample_status; the rest is undefined unless OK */
    int32_t token;              /* the drawn token; 0 when the row failed */
    float logprob;              /* log(m / M) of the token, rounded once to fp32 */
    uint32_t n_top;             /* min(n_logprobs, n_kept) */
    uint64_t total;             /* M: the kept tokens' integer mass */
    uint32_t n_kept;            /* tokens of non-zero mass after top-k and top-p */
    uint32_t pad;
    int32_t top_tokens[KERN_SAMPLE_MAX_TOP];  /* the first n_top tokens in draw order */
    float top_logprobs[KERN_SAMPLE_MAX_TOP];  /* their logprobs */
} kern_sample_out;

typedef struct kern_sample {
    uint32_t n_rows;
    uint32_t n_vocab;           /* >= 1 */
    const float *logits;        /* [n_rows, n_vocab] f32 (backend memory), row stride below */
    size_t logits_stride;       /* >= n_vocab */
    const kern_sample_row *rows; /* host [n_rows] */
    kern_sample_out *out;       /* host [n_rows], written before the op returns */
    kern_sample_out *out_dev;   /* backend or mapped memory (alloc_mapped) [n_rows]: when set
                                 * the outcomes are written there in stream order and the op
                                 * returns without waiting (out unused): the caller reads them
                                 * after a mark, and the tokens may feed later ops (one step
                                 * ahead) */
} kern_sample;

/* ---- the table ----------------------------------------------------------------------------- */

struct kern_step_ahead; /* kernels/cpu/step_ahead.h */

typedef struct kern_ops {
    /* memory: backend allocations (64-byte aligned, zeroed) and host transfers */
    void *(*alloc)(void *ctx, size_t bytes);
    void (*free)(void *ctx, void *p);
    void (*to_host)(void *ctx, void *dst, const void *src, size_t bytes);
    void (*from_host)(void *ctx, void *dst, const void *src, size_t bytes);
    /* mapped memory and marks (one step ahead: the host reads step N's outcome while step N+1
     * is queued behind it): alloc_mapped returns memory both the ops and the host address
     * (the host at *host; zeroed; host writes are seen by ops queued after them, op writes by
     * the host after wait_mark of a mark made after the op); mark records the work queued so
     * far; wait_mark waits for the work before that mark only, and returns a failure the
     * device found in it (or since). NULL on a backend without them */
    void *(*alloc_mapped)(void *ctx, size_t bytes, void **host);
    void (*free_mapped)(void *ctx, void *p);
    di_status (*mark)(void *ctx, uint64_t *mark);
    di_status (*wait_mark)(void *ctx, uint64_t mark);

    di_status (*embed)(void *ctx, const kern_embed *p);
    di_status (*rmsnorm)(void *ctx, const kern_rmsnorm *p);
    di_status (*rope)(void *ctx, const kern_rope *p);
    di_status (*hc_mixes)(void *ctx, const kern_hc_mixes *p);
    di_status (*hc_collapse)(void *ctx, const kern_hc_collapse *p);
    di_status (*hc_expand)(void *ctx, const kern_hc_expand *p);
    di_status (*linear_fp8)(void *ctx, const kern_linear *p);
    di_status (*linear_fp4)(void *ctx, const kern_linear *p);
    di_status (*linear_bf16)(void *ctx, const kern_linear *p);
    di_status (*head)(void *ctx, const kern_linear *p); /* vocabulary projection, bf16 W, f32 y */
    di_status (*fakequant)(void *ctx, const kern_fakequant *p);
    di_status (*ring_store)(void *ctx, const kern_ring_store *p);
    di_status (*compress_pool)(void *ctx, const kern_compress_pool *p);
    di_status (*compressed_store)(void *ctx, const kern_compressed_store *p);
    di_status (*sparse_attn)(void *ctx, const kern_sparse_attn *p);
    di_status (*index_scores)(void *ctx, const kern_index_scores *p);
    di_status (*index_candidates)(void *ctx, const kern_index_candidates *p);
    di_status (*index_topk)(void *ctx, const kern_index_topk *p);
    di_status (*moe_gate)(void *ctx, const kern_moe_gate *p);
    di_status (*swiglu)(void *ctx, const kern_swiglu *p);
    di_status (*moe_experts)(void *ctx, const kern_moe_experts *p);
    di_status (*engram_hash)(void *ctx, const kern_engram_hash *p);
    di_status (*engram_lookup)(void *ctx, const kern_engram_lookup *p);
    di_status (*engram_gate)(void *ctx, const kern_engram_gate *p);
    di_status (*copy_rows)(void *ctx, const kern_copy_rows *p);
    /* optional (NULL on the CPU backend): sampling from backend-memory logits, above */
    di_status (*sample)(void *ctx, const kern_sample *p);
    /* the one-step-ahead fix-up of step N+1's rows from step N's outcome, on backend memory
     * (kernels/cpu/step_ahead.h: contract and C twin) */
    di_status (*step_ahead)(void *ctx, const struct kern_step_ahead *p);
} kern_ops;

/* A backend: its name, its state (thread pool, lookup tables) and its table. */
typedef struct kern_backend {
    const char *name;           /* "cpu" or "cuda" */
    void *ctx;                  /* passed as the first argument of every op */
    kern_ops ops;
    int device_memory;          /* 1: the ops read tensors only from memory of `alloc` (a device
                                 * backend), so a caller holding host tensors (the forward's
                                 * weights) copies them there first; 0: host memory will do */
    int graphs;                 /* 1: the backend keeps recorded graphs per step shape (CUDA
                                 * graphs on), so decode steps padded to the recorded sizes
                                 * replay them (runner_exec_options.pad_steps); 0: none */
} kern_backend;

#endif
