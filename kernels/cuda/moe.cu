/* moe.cu: the mixture of experts (MODEL.md §2.8): the router (kern_moe_gate), SwiGLU with the
 * asymmetric clamp (kern_swiglu) and the routed FP4 experts with the shared FP8 expert
 * (kern_moe_experts). C twins: kernels/cpu/ops_moe.c.
 *
 *  - moe_gate, one warp per row: s = fp32(sqrt(fp32(softplus(z / temp)))) in double as the twin,
 *    sel = fp32(s + bias); each of the top_k picks is a warp reduction that reproduces the
 *    twin's scan (first unused expert, replaced only by a strictly larger sel: ties go to the
 *    lower expert, and a NaN wins only as the first unused expert); the weights as the twin
 *    (sum in double in pick order). Exact but for CUDA's and the C library's double log1p/exp
 *    differing by an ulp at an fp32 rounding tie (tolerance: ids exact except at near-ties,
 *    weights abs 1e-6).
 *  - swiglu: element-wise, the twin's double expressions: bit-identical.
 *  - moe_experts: up to cuda_ctx.moe_grouped_rows rows the (row, slot) pairs are bucketed by
 *    expert on the device (moe_bucket.cu: no read-back) and the routed experts take the
 *    grouped path, with the most groups there can be as the grid. Above, they are bucketed on
 *    the host (the ids are read back: one synchronisation per call); when the largest bucket
 *    has at most cuda_ctx.moe_grouped_rows pairs (default 64; groups of at most 16 per
 *    launch) and fits a block's shared memory, the routed experts take the grouped path
 *    (moe_grouped.cu: one launch for W1 and W3 with SwiGLU and the routing weight over every
 *    bucket, one for W2;
 *    on the tensor cores, moe_mma.cu, or on the CUDA cores with the FP4 weights dequantised in
 *    registers). Otherwise the rows are gathered into the work buffer in the twin's order and
 *    quantised by (A), one launch of the wide kernel (moe_wide.cu: tiles of up to 128 rows of
 *    one expert, BF16 tensor cores, the FP4 weight dequantised exactly in shared memory) runs
 *    W1 and W3 of every bucket, SwiGLU with the routing weight runs once over every pair, h is
 *    quantised by (A) and a second launch runs W2: the linear path's numbers in another sum
 *    order. With cuda_ctx.moe_per_expert, or weights off 16-byte alignment, or widths the wide
 *    kernel does not take, each routed expert runs the linear path of linear.cu instead (W1,
 *    W3, then W2, FP8 activations by (A), FP4 weights dequantised exactly, cuBLASLt BF16
 *    GEMM). The shared expert takes the grouped path as well (FP8
 *    weights, one group) when the routed experts do and the call has at most 16 rows, else
 *    the linear path on every row. One kernel sums each row's expert outputs in double in the
 *    twin's order (ascending expert, then the shared expert) and rounds once. Tolerance:
 *    kernels.h's moe_experts bound on either path.
 */
#include <cuda_runtime.h>
#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cpu/moe_bucket.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/moe_dev.cuh"
#include "kernels/cuda/moe_wide.h"
#include "kernels/cuda/numfmt_dev.cuh"

#define GATE_MAX_EXPERTS 4096         /* the twin's limit */

/* ---- device helpers ---- */

__device__ __forceinline__ double softplus_dev(double z)
{
    return z > 0 ? z + log1p(exp(-z)) : log1p(exp(z));
}

/* (value, index) of the better of two candidates (index -1: none): a number beats NaN, then the
 * larger value, then the lower index. A total order, so a butterfly gives every lane the same
 * winner. */
__device__ __forceinline__ void better(float &v, int32_t &i, float v2, int32_t i2)
{
    bool take;
    if (i2 < 0)
        take = false;
    else if (i < 0)
        take = true;
    else if (isnan(v2) != isnan(v))
        take = isnan(v);
    else if (isnan(v))
        take = i2 < i;
    else
        take = v2 > v || (v2 == v && i2 < i);
    if (take) {
        v = v2;
        i = i2;
    }
}

/* ---- kernels ---- */

/* One warp per row; s, sel and the picked flags of the row's experts in shared memory. */
__global__ void moe_gate_kernel(kern_moe_gate p)
{
    extern __shared__ __align__(16) uint8_t gate_smem[];
    const uint32_t E = p.n_experts, lane = threadIdx.x;
    float *s = (float *)gate_smem, *sel = s + E;
    uint8_t *used = (uint8_t *)(sel + E);
    const size_t t = blockIdx.x;
    const float *z = p.logits + t * E;
    for (uint32_t e = lane; e < E; e += 32) {
        float zt = __fdiv_rn(z[e], p.temp);
        float sp = (float)softplus_dev((double)zt);
        s[e] = (float)sqrt((double)sp);
        sel[e] = __fadd_rn(s[e], p.bias ? p.bias[e] : 0.0f);
        used[e] = 0;
    }
    __syncwarp();
    int32_t *ids = p.ids + t * p.top_k;
    double sum = 0.0;
    for (uint32_t k = 0; k < p.top_k; k++) {
        /* the twin's scan: candidate = first unused expert; a later one replaces it only when
         * strictly larger. Equal to the best non-NaN sel (lowest index on ties) unless the first
         * unused one is NaN, which then stays. */
        float v = 0.0f;
        int32_t i = -1, first = -1;
        for (uint32_t e = lane; e < E; e += 32) {
            if (used[e])
                continue;
            if (first < 0)
                first = (int32_t)e;
            better(v, i, sel[e], (int32_t)e);
        }
        for (int off = 16; off > 0; off /= 2) {
            float v2 = __shfl_xor_sync(0xffffffffu, v, off);
            int32_t i2 = __shfl_xor_sync(0xffffffffu, i, off);
            int32_t f2 = __shfl_xor_sync(0xffffffffu, first, off);
            better(v, i, v2, i2);
            first = first < 0 || (f2 >= 0 && f2 < first) ? f2 : first;
        }
        int32_t best = isnan(sel[first]) ? first : i;
        if (lane == 0) {
            used[best] = 1;
            ids[k] = best;
        }
        __syncwarp();
        sum += (double)s[best];
    }
    if (lane != 0)
        return;
    float norm = (float)(sum + 1e-20);
    for (uint32_t k = 0; k < p.top_k; k++) {
        float wk = (float)((double)s[ids[k]] / (double)norm);
        p.weights[t * p.top_k + k] = (float)((double)wk * (double)p.route_scale);
    }
}

/* One thread per element: the twin's double expressions, rounded where it rounds. */
__global__ void swiglu_kernel(kern_swiglu p)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)p.n_rows * p.n)
        return;
    size_t r = i / p.n, c = i % p.n;
    float gv = dev_bf16_to_f32(p.g[r * p.stride + c]), uv = dev_bf16_to_f32(p.u[r * p.stride + c]);
    p.h[r * p.n + c] = dev_swiglu(gv, uv, p.limit, p.w != NULL, p.w ? p.w[r] : 1.0f);
}

/* Gathers the pairs' rows and routing weights in bucket order: xg[i] = x[pair[i] / top_k],
 * wg[i] = weights[pair[i]]. One block per pair. */
__global__ void moe_gather_kernel(const uint16_t *x, const float *weights, const int32_t *pair,
                                  uint32_t top_k, uint32_t dim, uint16_t *xg, float *wg)
{
    const size_t i = blockIdx.x, src = (size_t)(pair[i] / (int32_t)top_k);
    for (uint32_t d = threadIdx.x; d < dim; d += blockDim.x)
        xg[i * dim + d] = x[src * dim + d];
    if (threadIdx.x == 0)
        wg[i] = weights[pair[i]];
}

/* y[t][d] = bf16(fp32(sum of the row's expert outputs in the order of pos, then the shared
 * one)), the sum in double. pos[t][j]: row of the j-th output of row t in og. Also the
 * expert-parallel exchange's combine (ep.cu), whose twin sums the same way. */
__global__ void moe_combine_kernel(const uint16_t *og, const int32_t *pos, uint32_t top_k,
                                   const uint16_t *os, uint32_t dim, uint32_t n_rows, uint16_t *y)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_rows * dim)
        return;
    size_t t = i / dim, d = i % dim;
    double acc = 0.0;
    for (uint32_t j = 0; j < top_k; j++)
        acc += (double)dev_bf16_to_f32(og[(size_t)pos[t * top_k + j] * dim + d]);
    if (os)
        acc += (double)dev_bf16_to_f32(os[i]);
    y[i] = dev_f32_to_bf16((float)acc);
}

/* ---- launchers ---- */

static unsigned elem_grid(size_t n)
{
    return (unsigned)((n + CUDA_THREADS - 1) / CUDA_THREADS);
}

static di_status launch_moe_gate(cuda_ctx *c, const kern_moe_gate *p, cudaStream_t stream)
{
    size_t smem = (size_t)p->n_experts * 9;
    cuda_launch(c, "moe_gate_kernel", moe_gate_kernel, p->n_rows, 32, smem, stream, *p);
    return cuda_launched(c, "moe_gate_kernel");
}

static di_status launch_swiglu(cuda_ctx *c, const kern_swiglu *p, cudaStream_t stream)
{
    cuda_launch(c, "swiglu_kernel", swiglu_kernel, elem_grid((size_t)p->n_rows * p->n),
                CUDA_THREADS, 0, stream, *p);
    return cuda_launched(c, "swiglu_kernel");
}

static di_status launch_gather(cuda_ctx *c, const kern_moe_experts *p, const int32_t *pair,
                               uint32_t n_pairs, uint16_t *xg, float *wg, cudaStream_t stream)
{
    cuda_launch(c, "moe_gather_kernel", moe_gather_kernel, n_pairs, CUDA_THREADS, 0, stream, p->x,
                p->weights, pair, p->top_k, p->dim, xg, wg);
    return cuda_launched(c, "moe_gather_kernel");
}

di_status cuda_moe_combine(cuda_ctx *c, const uint16_t *og, const int32_t *pos, uint32_t top_k,
                           const uint16_t *os, uint32_t dim, uint32_t n_rows, uint16_t *y,
                           cudaStream_t stream)
{
    cuda_launch(c, "moe_combine_kernel", moe_combine_kernel, elem_grid((size_t)n_rows * dim),
                CUDA_THREADS, 0, stream, og, pos, top_k, os, dim, n_rows, y);
    return cuda_launched(c, "moe_combine_kernel");
}

/* ---- table entries: gate and SwiGLU ---- */

di_status cuda_op_moe_gate(void *ctx, const kern_moe_gate *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "moe_gate");
    if (st != DI_OK)
        return st;
    if (p->top_k < 1 || p->top_k > p->n_experts || p->n_experts > GATE_MAX_EXPERTS)
        return cuda_fail(c, DI_EINVAL, "moe_gate: top_k %u outside [1, n_experts %u] or more than "
                         "%d experts", p->top_k, p->n_experts, GATE_MAX_EXPERTS);
    if (p->n_rows == 0)
        return DI_OK;
    if (!p->logits || !p->ids || !p->weights)
        return cuda_fail(c, DI_EINVAL, "moe_gate: logits, ids or weights is NULL");
    if (p->n_rows > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "moe_gate: %u rows", p->n_rows);
    return launch_moe_gate(c, p, c->stream);
}

static di_status swiglu_check(cuda_ctx *c, const kern_swiglu *p)
{
    if (!p->g || !p->u || !p->h)
        return cuda_fail(c, DI_EINVAL, "swiglu: g, u or h is NULL");
    if (p->stride < p->n)
        return cuda_fail(c, DI_EINVAL, "swiglu: stride %zu below n %u", p->stride, p->n);
    if ((size_t)p->n_rows * p->n / CUDA_THREADS >= 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "swiglu: %u rows of %u", p->n_rows, p->n);
    return DI_OK;
}

di_status cuda_op_swiglu(void *ctx, const kern_swiglu *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "swiglu");
    if (st != DI_OK)
        return st;
    if (p->n_rows == 0 || p->n == 0)
        return DI_OK;
    if ((st = swiglu_check(c, p)) != DI_OK)
        return st;
    return launch_swiglu(c, p, c->stream);
}

/* ---- moe_experts ---- */

/* Where one call's buffers sit in the work buffer (byte offsets) and the host plan. */
typedef struct moe_plan {
    uint32_t n_pairs;
    uint32_t *count, *start;    /* [n_experts + 1] pairs per expert and their first index */
    int32_t *pair;              /* [n_pairs] (row * top_k + slot) in bucket order (host) */
    int32_t *pos;               /* [n_rows, top_k] index of each row's outputs, ascending expert */
    uint32_t max_count;         /* pairs of the largest bucket */
    int grouped;                /* 1: the routed experts take the grouped path */
    cuda_moe_group *groups;     /* [n_groups] the grouped path's groups (host); NULL otherwise */
    uint32_t n_groups;
    int aligned;                /* every used expert's w1, w3, w2 is 4-byte aligned */
    int aligned16;              /* ... and 16-byte aligned */
    int shared_grouped;         /* 1: the shared expert takes the grouped path too (grouped,
                                 * at most CUDA_MOE_GROUP_ROWS rows) */
    cuda_moe_group shared;      /* its one group: every row of x */
    int wide;                   /* 1: the routed experts take the wide kernel (moe_wide.cu) */
    cuda_moe_group *tiles;      /* [n_tiles] its tiles (host) */
    uint32_t n_tiles;
    size_t off_tiles;
    size_t off_pair, off_pos, off_groups, off_shared; /* metadata offsets */
    size_t xq, xg, wg, g, u, h, og, gs, us, hs, os, total; /* work offsets after the metadata */
    size_t xc, xcs, hc, hcs;    /* the grouped path's codes and scales (moe_mma.cu) */
} moe_plan;

static void plan_free(moe_plan *pl)
{
    free(pl->count);
    free(pl->start);
    free(pl->pair);
    free(pl->pos);
    free(pl->groups);
    free(pl->tiles);
}

/* Each used expert's bucket in pieces of at most `rows` pairs, ascending expert, into *out
 * (allocated; *n_out pieces). */
static di_status split_buckets(cuda_ctx *c, const kern_moe_experts *p, const moe_plan *pl,
                               uint32_t rows, cuda_moe_group **out, uint32_t *n_out)
{
    uint32_t n = 0;
    for (uint32_t e = 0; e < p->n_experts; e++)
        n += (pl->count[e] + rows - 1) / rows;
    cuda_moe_group *groups = (cuda_moe_group *)calloc(n ? n : 1, sizeof(cuda_moe_group));
    if (!groups)
        return cuda_fail(c, DI_ENOMEM, "moe_experts: %u groups", n);
    uint32_t at_group = 0;
    for (uint32_t e = 0; e < p->n_experts; e++) {
        const kern_expert *ex = &p->experts[e];
        for (uint32_t at = 0; at < pl->count[e]; at += rows) {
            uint32_t left = pl->count[e] - at;
            cuda_moe_group *g = &groups[at_group++];
            g->w1 = ex->w1, g->s1 = ex->w1_scale, g->w3 = ex->w3, g->s3 = ex->w3_scale;
            g->w2 = ex->w2, g->s2 = ex->w2_scale;
            g->start = pl->start[e] + at;
            g->n = left < rows ? left : rows;
        }
    }
    assert(at_group == n);
    *out = groups, *n_out = n;
    return DI_OK;
}

/* The wide kernel's tiles: buckets in pieces of at most CUDA_MOE_WIDE_ROWS pairs. No tiles (the
 * per-expert path) when it is turned off, a used expert's weights are off 16-byte alignment or
 * the widths do not fit the kernel. */
static di_status plan_tiles(cuda_ctx *c, const kern_moe_experts *p, moe_plan *pl)
{
    if (c->moe_per_expert || !cuda_moe_wide_fits(p->dim, p->inter) ||
        !cuda_moe_wide_fits(p->inter, p->dim))
        return DI_OK;
    uint32_t n = 0;
    for (uint32_t e = 0; e < p->n_experts; e++) {
        const kern_expert *ex = &p->experts[e];
        if (pl->count[e] && ((uintptr_t)ex->w1 % 16 || (uintptr_t)ex->w3 % 16 ||
                             (uintptr_t)ex->w2 % 16))
            return DI_OK;
        n += (pl->count[e] + CUDA_MOE_WIDE_ROWS - 1) / CUDA_MOE_WIDE_ROWS;
    }
    if (n > 65535u)
        return DI_OK;
    di_status st = split_buckets(c, p, pl, CUDA_MOE_WIDE_ROWS, &pl->tiles, &pl->n_tiles);
    pl->wide = st == DI_OK;
    return st;
}

/* The grouped path's groups: each used expert's bucket in pieces of at most
 * CUDA_MOE_GROUP_ROWS pairs, ascending expert. */
static di_status plan_groups(cuda_ctx *c, const kern_moe_experts *p, moe_plan *pl)
{
    di_status st = split_buckets(c, p, pl, CUDA_MOE_GROUP_ROWS, &pl->groups, &pl->n_groups);
    if (st != DI_OK)
        return st;
    pl->aligned = 1, pl->aligned16 = 1;
    for (uint32_t e = 0; e < p->n_experts; e++) {
        const kern_expert *ex = &p->experts[e];
        if (pl->count[e] && ((uintptr_t)ex->w1 % 4 || (uintptr_t)ex->w3 % 4 ||
                             (uintptr_t)ex->w2 % 4))
            pl->aligned = 0;
        if (pl->count[e] && ((uintptr_t)ex->w1 % 16 || (uintptr_t)ex->w3 % 16 ||
                             (uintptr_t)ex->w2 % 16))
            pl->aligned16 = 0;
    }
    return DI_OK;
}

/* The grouped path when the largest bucket is within the backend's threshold and its groups
 * fit a block's shared memory. */
static int plan_use_grouped(cuda_ctx *c, const kern_moe_experts *p, const moe_plan *pl)
{
    uint32_t rows = pl->max_count < CUDA_MOE_GROUP_ROWS ? pl->max_count : CUDA_MOE_GROUP_ROWS;
    /* batch-invariant mode: the path must not depend on the group sizes */
    return c->moe_grouped_rows > 0 &&
           (c->batch_invariant || pl->max_count <= (uint32_t)c->moe_grouped_rows) &&
           cuda_moe_grouped_fits(c, rows, p->dim, p->inter);
}

/* The work buffer of a call: x's and h's codes, the experts' outputs and what each path keeps
 * (pl->grouped, pl->n_pairs set). */
static void plan_layout(const kern_moe_experts *p, moe_plan *pl)
{
    const size_t T = p->n_rows;
    /* the grouped path reads x quantised once per row; the cuBLASLt path gathers the rows and
     * keeps g and u */
    size_t D = p->dim, I = p->inter, S = p->shared_inter, P = pl->n_pairs, at = 0;
    size_t G = pl->grouped ? 1 : 0, L = 1 - G, W = pl->wide ? 1 : 0;
#define MOE_BUF(field, bytes) (pl->field = at, at += cuda_align_up(bytes))
    MOE_BUF(xq, (G * T + W * P) * D * 2);
    MOE_BUF(xg, L * P * D * 2);
    MOE_BUF(wg, L * P * 4);
    MOE_BUF(g, L * P * I * 2);
    MOE_BUF(u, L * P * I * 2);
    MOE_BUF(h, P * I * 2);
    MOE_BUF(og, P * D * 2);
    MOE_BUF(gs, (size_t)T * S * 2);
    MOE_BUF(us, (size_t)T * S * 2);
    MOE_BUF(hs, (size_t)T * S * 2);
    MOE_BUF(os, (size_t)T * D * 2);
    size_t HC = P * I > T * S ? P * I : T * S; /* h's codes: routed, then shared */
    MOE_BUF(xc, G * T * D * 2);
    MOE_BUF(xcs, G * T * (D / 32) * 4);
    MOE_BUF(hc, G * HC * 2);
    MOE_BUF(hcs, G * (HC / 32) * 4);
#undef MOE_BUF
    pl->total = at;
}

/* Buckets the pairs by expert exactly as the twin (pairs ascending inside a bucket) and lays
 * out the work buffer. ids: the host copy. */
static di_status plan_make(cuda_ctx *c, const kern_moe_experts *p, const int32_t *ids,
                           moe_plan *pl)
{
    memset(pl, 0, sizeof(*pl));
    uint32_t E = p->n_experts, K = p->top_k, T = p->n_rows;
    pl->n_pairs = T * K;
    pl->count = (uint32_t *)calloc(E + 1, sizeof(uint32_t));
    pl->start = (uint32_t *)calloc(E + 1, sizeof(uint32_t));
    pl->pair = (int32_t *)malloc((size_t)pl->n_pairs * sizeof(int32_t));
    pl->pos = (int32_t *)malloc((size_t)pl->n_pairs * sizeof(int32_t));
    if (!pl->count || !pl->start || !pl->pair || !pl->pos)
        return cuda_fail(c, DI_ENOMEM, "moe_experts: host plan of %u pairs", pl->n_pairs);
    for (uint32_t i = 0; i < pl->n_pairs; i++) {
        if (ids[i] < 0 || (uint32_t)ids[i] >= E)
            return cuda_fail(c, DI_EINVAL, "moe_experts: ids[%u] = %d outside [0, %u)", i, ids[i], E);
        pl->count[ids[i]]++;
    }
    for (uint32_t e = 0; e < E; e++) {
        const kern_expert *ex = &p->experts[e];
        if (pl->count[e] && (!ex->w1 || !ex->w2 || !ex->w3 || !ex->w1_scale || !ex->w2_scale ||
                             !ex->w3_scale))
            return cuda_fail(c, DI_EINVAL, "moe_experts: expert %u is routed to but has a NULL "
                             "weight", e);
    }
    for (uint32_t e = 1; e <= E; e++)
        pl->start[e] = pl->start[e - 1] + pl->count[e - 1];
    for (uint32_t e = 0; e < E; e++)
        pl->max_count = pl->count[e] > pl->max_count ? pl->count[e] : pl->max_count;
    uint32_t *fill = (uint32_t *)calloc(E, sizeof(uint32_t));
    if (!fill)
        return cuda_fail(c, DI_ENOMEM, "moe_experts: host plan");
    for (uint32_t i = 0; i < pl->n_pairs; i++) {
        uint32_t at = pl->start[ids[i]] + fill[ids[i]]++;
        pl->pair[at] = (int32_t)i;
    }
    free(fill);
    /* each row's outputs in ascending expert order (slots ascending within an expert): walk the
     * buckets in order and append to the row */
    uint32_t *seen = (uint32_t *)calloc(T ? T : 1, sizeof(uint32_t));
    if (!seen)
        return cuda_fail(c, DI_ENOMEM, "moe_experts: host plan");
    for (uint32_t i = 0; i < pl->n_pairs; i++) {
        uint32_t row = (uint32_t)pl->pair[i] / K;
        pl->pos[(size_t)row * K + seen[row]++] = (int32_t)i;
    }
    free(seen);
    pl->grouped = plan_use_grouped(c, p, pl);
    if (pl->grouped) {
        di_status st = plan_groups(c, p, pl);
        if (st != DI_OK)
            return st;
    } else {
        di_status st = plan_tiles(c, p, pl);
        if (st != DI_OK)
            return st;
    }
    /* the shared expert reads its FP8 weight once per group of rows: grouped only when all
     * rows make one group */
    pl->shared_grouped = pl->grouped && p->shared_inter && T <= CUDA_MOE_GROUP_ROWS &&
                         !c->batch_invariant && /* the mode: one path at every row count */
                         cuda_moe_grouped_fits(c, T, p->dim, p->shared_inter);
    if (pl->shared_grouped) {
        const kern_expert *sh = &p->shared;
        cuda_moe_group g = {sh->w1, sh->w1_scale, sh->w3, sh->w3_scale, sh->w2, sh->w2_scale,
                            0, T};
        pl->shared = g;
    }
    plan_layout(p, pl);
    return DI_OK;
}

/* o = W2 swiglu(W1 x, W3 x, w) for n rows through the linear path: W1 and W3 here, the SwiGLU
 * and W2 by the caller (run_down). */
static di_status run_up(cuda_ctx *c, const kern_expert *ex, kern_wfmt fmt, uint32_t n,
                        uint32_t dim, uint32_t inter, const uint16_t *x, uint16_t *g, uint16_t *u)
{
    kern_linear l;
    memset(&l, 0, sizeof(l));
    l.m = n, l.n = inter, l.k = dim, l.groups = 1, l.x = x, l.x_stride = dim, l.y_stride = inter;
    l.w = ex->w1, l.w_scale = ex->w1_scale, l.y = g;
    di_status st = cuda_linear_run(c, &l, fmt);
    l.w = ex->w3, l.w_scale = ex->w3_scale, l.y = u;
    if (st == DI_OK)
        st = cuda_linear_run(c, &l, fmt);
    return st;
}

static di_status run_down(cuda_ctx *c, const kern_expert *ex, kern_wfmt fmt, uint32_t n,
                          uint32_t dim, uint32_t inter, const uint16_t *h, uint16_t *o)
{
    kern_linear l;
    memset(&l, 0, sizeof(l));
    l.m = n, l.n = dim, l.k = inter, l.groups = 1, l.x = h, l.x_stride = inter, l.y = o,
    l.y_stride = dim, l.w = ex->w2, l.w_scale = ex->w2_scale;
    return cuda_linear_run(c, &l, fmt);
}

static di_status experts_check(cuda_ctx *c, const kern_moe_experts *p)
{
    if (p->top_k < 1 || p->n_experts < 1 || p->dim == 0 || p->dim % 32 || p->inter == 0 ||
        p->inter % 32 || p->shared_inter % 32)
        return cuda_fail(c, DI_EINVAL, "moe_experts: top_k %u, %u experts, dim %u, inter %u, "
                         "shared_inter %u (widths must be positive multiples of 32)", p->top_k,
                         p->n_experts, p->dim, p->inter, p->shared_inter);
    if (!p->x || !p->ids || !p->weights || !p->experts || !p->y)
        return cuda_fail(c, DI_EINVAL, "moe_experts: x, ids, weights, experts or y is NULL");
    if (p->shared_inter && (!p->shared.w1 || !p->shared.w2 || !p->shared.w3 ||
                            !p->shared.w1_scale || !p->shared.w2_scale || !p->shared.w3_scale))
        return cuda_fail(c, DI_EINVAL, "moe_experts: a shared-expert weight is NULL");
    if ((uint64_t)p->n_rows * p->top_k > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "moe_experts: %u rows x top-%u", p->n_rows, p->top_k);
    return DI_OK;
}

/* The routed experts over the plan's buckets (cuBLASLt path): the rows gathered, up
 * projections, one SwiGLU over every pair, down projections. */
static di_status run_routed(cuda_ctx *c, const kern_moe_experts *p, const moe_plan *pl,
                            const uint8_t *dev, uint8_t *w)
{
    di_status st = launch_gather(c, p, (const int32_t *)(dev + pl->off_pair), pl->n_pairs,
                                 (uint16_t *)(w + pl->xg), (float *)(w + pl->wg), c->stream);
    uint16_t *xg = (uint16_t *)(w + pl->xg), *g = (uint16_t *)(w + pl->g);
    uint16_t *u = (uint16_t *)(w + pl->u), *h = (uint16_t *)(w + pl->h);
    uint16_t *og = (uint16_t *)(w + pl->og);
    const size_t D = p->dim, I = p->inter;
    for (uint32_t e = 0; st == DI_OK && e < p->n_experts; e++) {
        uint32_t n = pl->count[e], at = pl->start[e];
        if (n == 0)
            continue;
        st = run_up(c, &p->experts[e], KERN_W_FP4, n, p->dim, p->inter, xg + at * D, g + at * I, u + at * I);
    }
    kern_swiglu sw;
    memset(&sw, 0, sizeof(sw));
    sw.n_rows = pl->n_pairs, sw.n = p->inter, sw.g = g, sw.u = u, sw.stride = p->inter;
    sw.w = (const float *)(w + pl->wg), sw.limit = p->swiglu_limit, sw.h = h;
    if (st == DI_OK)
        st = launch_swiglu(c, &sw, c->stream);
    for (uint32_t e = 0; st == DI_OK && e < p->n_experts; e++) {
        uint32_t n = pl->count[e], at = pl->start[e];
        if (n)
            st = run_down(c, &p->experts[e], KERN_W_FP4, n, p->dim, p->inter, h + at * I,
                          og + at * D);
    }
    return st;
}

/* The routed experts on the wide kernel: the rows gathered and quantised by (A), W1 and W3 of
 * every tile in one launch, SwiGLU with the routing weight over every pair, h quantised by (A)
 * into g's buffer (free by then), W2 of every tile. tiles: their device copy. */
static di_status run_routed_wide(cuda_ctx *c, const kern_moe_experts *p, const moe_plan *pl,
                                 const uint8_t *dev, uint8_t *w)
{
    di_status st = launch_gather(c, p, (const int32_t *)(dev + pl->off_pair), pl->n_pairs,
                                 (uint16_t *)(w + pl->xg), (float *)(w + pl->wg), c->stream);
    uint16_t *xg = (uint16_t *)(w + pl->xg), *xq = (uint16_t *)(w + pl->xq);
    uint16_t *g = (uint16_t *)(w + pl->g), *u = (uint16_t *)(w + pl->u);
    uint16_t *h = (uint16_t *)(w + pl->h), *og = (uint16_t *)(w + pl->og);
    if (st == DI_OK)
        st = cuda_fakequant_rows(c, KERN_Q_FP8_B32, xg, p->dim, xq, p->dim, pl->n_pairs, p->dim);
    cuda_moe_wide wd;
    memset(&wd, 0, sizeof(wd));
    wd.tiles = (const cuda_moe_group *)(dev + pl->off_tiles), wd.n_tiles = pl->n_tiles;
    wd.a = xq, wd.k = p->dim, wd.n_out = p->inter, wd.up = 1, wd.y0 = g, wd.y1 = u;
    wd.ldy = p->inter;
    if (st == DI_OK)
        st = cuda_moe_wide_run(c, &wd);
    kern_swiglu sw;
    memset(&sw, 0, sizeof(sw));
    sw.n_rows = pl->n_pairs, sw.n = p->inter, sw.g = g, sw.u = u, sw.stride = p->inter;
    sw.w = (const float *)(w + pl->wg), sw.limit = p->swiglu_limit, sw.h = h;
    if (st == DI_OK)
        st = launch_swiglu(c, &sw, c->stream);
    if (st == DI_OK)
        st = cuda_fakequant_rows(c, KERN_Q_FP8_B32, h, p->inter, g, p->inter, pl->n_pairs,
                                 p->inter);
    wd.a = g, wd.k = p->inter, wd.n_out = p->dim, wd.up = 0, wd.y0 = og, wd.y1 = NULL;
    wd.ldy = p->dim;
    if (st == DI_OK)
        st = cuda_moe_wide_run(c, &wd);
    return st;
}

/* The codes buffers of the grouped path's tensor-core kernel. */
static void grouped_codes(const moe_plan *pl, uint8_t *w, cuda_moe_grouped *g)
{
    g->xc = w + pl->xc, g->xcs = (float *)(w + pl->xcs);
    g->hc = w + pl->hc, g->hcs = (float *)(w + pl->hcs);
}

/* The routed experts on the grouped path: x quantised by (A) once per row, then
 * cuda_moe_grouped_run over the plan's groups. groups: their device copy. */
static di_status run_routed_grouped(cuda_ctx *c, const kern_moe_experts *p, const moe_plan *pl,
                                    const cuda_moe_group *groups, const int32_t *pair,
                                    const uint32_t *n_groups_dev, uint8_t *w)
{
    uint16_t *xq = (uint16_t *)(w + pl->xq);
    di_status st = cuda_fakequant_rows(c, KERN_Q_FP8_B32, p->x, p->dim, xq, p->dim, p->n_rows,
                                       p->dim);
    if (st != DI_OK)
        return st;
    cuda_moe_grouped g;
    memset(&g, 0, sizeof(g));
    g.n_groups = pl->n_groups, g.n_groups_dev = n_groups_dev, g.groups = groups;
    g.aligned = pl->aligned;
    g.aligned16 = pl->aligned16 && !c->moe_unstaged;
    g.max_rows = pl->max_count < CUDA_MOE_GROUP_ROWS ? pl->max_count : CUDA_MOE_GROUP_ROWS;
    g.dim = p->dim, g.inter = p->inter, g.top_k = p->top_k, g.n_pairs = pl->n_pairs;
    g.xq = xq, g.pair = pair, g.weights = p->weights, g.limit = p->swiglu_limit;
    g.h = (uint16_t *)(w + pl->h), g.og = (uint16_t *)(w + pl->og);
    grouped_codes(pl, w, &g);
    return cuda_moe_grouped_run(c, &g);
}

/* The shared expert on the grouped path (FP8 weights, no routing weight): its one group reads
 * the rows of x that run_routed_grouped quantised. group: its device copy. */
static di_status run_shared_grouped(cuda_ctx *c, const kern_moe_experts *p, const moe_plan *pl,
                                    const cuda_moe_group *group, uint8_t *w)
{
    const kern_expert *sh = &p->shared;
    cuda_moe_grouped g;
    memset(&g, 0, sizeof(g));
    g.n_groups = 1, g.groups = group, g.max_rows = p->n_rows, g.fp8 = 1;
    g.aligned = (uintptr_t)sh->w1 % 8 == 0 && (uintptr_t)sh->w3 % 8 == 0 &&
                (uintptr_t)sh->w2 % 8 == 0;
    g.aligned16 = (uintptr_t)sh->w1 % 16 == 0 && (uintptr_t)sh->w3 % 16 == 0 &&
                  (uintptr_t)sh->w2 % 16 == 0 && !c->moe_unstaged;
    g.dim = p->dim, g.inter = p->shared_inter, g.top_k = p->top_k, g.n_pairs = p->n_rows;
    g.xq = (const uint16_t *)(w + pl->xq), g.pair = NULL, g.weights = NULL;
    g.limit = p->swiglu_limit;
    g.h = (uint16_t *)(w + pl->hs), g.og = (uint16_t *)(w + pl->os);
    grouped_codes(pl, w, &g);
    return cuda_moe_grouped_run(c, &g);
}

static di_status run_shared(cuda_ctx *c, const kern_moe_experts *p, const moe_plan *pl, uint8_t *w)
{
    uint16_t *gs = (uint16_t *)(w + pl->gs), *us = (uint16_t *)(w + pl->us);
    uint16_t *hs = (uint16_t *)(w + pl->hs), *os = (uint16_t *)(w + pl->os);
    di_status st = run_up(c, &p->shared, KERN_W_FP8, p->n_rows, p->dim, p->shared_inter, p->x, gs, us);
    kern_swiglu sw;
    memset(&sw, 0, sizeof(sw));
    sw.n_rows = p->n_rows, sw.n = p->shared_inter, sw.g = gs, sw.u = us, sw.stride = p->shared_inter;
    sw.limit = p->swiglu_limit, sw.h = hs;
    if (st == DI_OK)
        st = launch_swiglu(c, &sw, c->stream);
    if (st == DI_OK)
        st = run_down(c, &p->shared, KERN_W_FP8, p->n_rows, p->dim, p->shared_inter, hs, os);
    return st;
}

/* ---- moe_experts without a synchronisation: the pairs bucketed on the device ---- */

/* Most pairs of a group on the device-planned path: 8 keeps the groups of a decode step on the
 * n8 tile (buckets of 9 to 16 pairs, rare at decode sizes, read the weight twice). */
#define MOE_DEVICE_CAP 8

static uint32_t device_cap(const kern_moe_experts *p)
{
    return p->n_rows < MOE_DEVICE_CAP ? p->n_rows : MOE_DEVICE_CAP;
}

/* The device-planned path: no more rows than the grouped path's threshold (with the ids of
 * kern_moe_gate, distinct per row, no bucket is larger), its bucketing within one block's
 * shared memory, its groups within a block's. */
static int device_plan_ok(cuda_ctx *c, const kern_moe_experts *p)
{
    return !c->moe_host_plan && c->moe_grouped_rows > 0 &&
           p->n_rows <= (uint32_t)c->moe_grouped_rows &&
           cuda_moe_bucket_smem(p->n_experts, p->n_rows * p->top_k) <= CUDA_BUCKET_SMEM &&
           cuda_moe_grouped_fits(c, device_cap(p), p->dim, p->inter);
}

/* Replaces t's device copy by one of n experts; queued work may read the old one. */
static di_status table_resize(cuda_ctx *c, cuda_expert_table *t, uint32_t n)
{
    di_status st = cuda_graph_break(c);
    if (st == DI_OK)
        st = cuda_check(c, cudaStreamSynchronize(c->stream), "expert table: cudaStreamSynchronize");
    if (st != DI_OK)
        return st;
    if (t->dev)
        cudaFree(t->dev);
    free(t->copy);
    memset(t, 0, sizeof(*t));
    size_t bytes = (size_t)n * sizeof(kern_expert);
    t->copy = (kern_expert *)malloc(bytes);
    cudaError_t e = cudaMalloc((void **)&t->dev, bytes);
    if (!t->copy || e != cudaSuccess) {
        cudaGetLastError();
        free(t->copy);
        if (e == cudaSuccess)
            cudaFree(t->dev);
        memset(t, 0, sizeof(*t));
        return cuda_fail(c, DI_ENOMEM, "expert table of %u experts", n);
    }
    t->n = n;
    return cuda_graph_resume(c);
}

/* The device copy of the call's expert table: kept per caller array and compared with it on
 * every call (the forward's tables never change, so after the first step nothing is copied). */
static di_status expert_table(cuda_ctx *c, const kern_moe_experts *p,
                              const cuda_expert_table **out)
{
    const uint32_t E = p->n_experts;
    const size_t bytes = (size_t)E * sizeof(kern_expert);
    cuda_expert_table *t = NULL;
    for (uint32_t i = 0; i < CUDA_EXPERT_TABLES && !t; i++)
        if (c->experts[i].host == p->experts && c->experts[i].n == E)
            t = &c->experts[i];
    if (t && memcmp(t->copy, p->experts, bytes) == 0) {
        *out = t;
        return DI_OK;
    }
    if (!t) {
        t = &c->experts[c->experts_next];
        c->experts_next = (c->experts_next + 1) % CUDA_EXPERT_TABLES;
        di_status st = table_resize(c, t, E);
        if (st != DI_OK)
            return st;
    }
    memcpy(t->copy, p->experts, bytes);
    t->host = p->experts;
    t->complete = 1, t->aligned = 1, t->aligned16 = 1;
    for (uint32_t e = 0; e < E; e++) {
        const kern_expert *x = &t->copy[e];
        if (!x->w1 || !x->w2 || !x->w3 || !x->w1_scale || !x->w2_scale || !x->w3_scale)
            t->complete = 0;
        if ((uintptr_t)x->w1 % 4 || (uintptr_t)x->w3 % 4 || (uintptr_t)x->w2 % 4)
            t->aligned = 0;
        if ((uintptr_t)x->w1 % 16 || (uintptr_t)x->w3 % 16 || (uintptr_t)x->w2 % 16)
            t->aligned16 = 0;
    }
    *out = t;
    return cuda_upload(c, t->dev, t->copy, bytes);
}

/* The grouped path with the bucketing on the device: the grouped launches take the most groups
 * there can be as their grid and the blocks past the written ones return. The same groups'
 * numbers as the host plan's path (a row's result depends on nothing else in the call). */
static di_status run_device_planned(cuda_ctx *c, const kern_moe_experts *p,
                                    const cuda_expert_table *tab)
{
    const uint32_t T = p->n_rows, K = p->top_k, E = p->n_experts, P = T * K, cap = device_cap(p);
    moe_plan pl;
    memset(&pl, 0, sizeof(pl));
    pl.n_pairs = P, pl.grouped = 1, pl.max_count = cap;
    pl.n_groups = kern_moe_max_groups(P, E, cap);
    pl.aligned = tab->aligned, pl.aligned16 = tab->aligned16;
    pl.shared_grouped = p->shared_inter && T <= CUDA_MOE_GROUP_ROWS &&
                        !c->batch_invariant && /* the mode: one path at every row count */
                        cuda_moe_grouped_fits(c, T, p->dim, p->shared_inter);
    if (pl.shared_grouped) {
        const kern_expert *sh = &p->shared;
        cuda_moe_group g = {sh->w1, sh->w1_scale, sh->w3, sh->w3_scale, sh->w2, sh->w2_scale,
                            0, T};
        pl.shared = g;
    }
    plan_layout(p, &pl);
    size_t at = pl.total, off_pair, off_pos, off_groups, off_n, off_shared;
#define MOE_META(var, bytes) (var = at, at += cuda_align_up(bytes))
    MOE_META(off_pair, (size_t)P * 4);
    MOE_META(off_pos, (size_t)P * 4);
    MOE_META(off_groups, (size_t)pl.n_groups * sizeof(cuda_moe_group));
    MOE_META(off_n, 4);
    MOE_META(off_shared, sizeof(cuda_moe_group));
#undef MOE_META
    uint8_t *w = NULL;
    di_status st = cuda_work(c, at, &w);
    if (st == DI_OK && pl.shared_grouped)
        st = cuda_upload(c, w + off_shared, &pl.shared, sizeof(pl.shared));
    cuda_moe_bucket b;
    memset(&b, 0, sizeof(b));
    b.ids = p->ids, b.n_rows = T, b.top_k = K, b.n_experts = E, b.cap = cap;
    b.pair = (int32_t *)(w + off_pair), b.pos = (int32_t *)(w + off_pos);
    b.n_groups = (uint32_t *)(w + off_n);
    b.experts = tab->dev, b.groups = (cuda_moe_group *)(w + off_groups);
    b.error = c->err_flag_dev;
    if (st == DI_OK)
        st = cuda_moe_bucket_run(c, &b);
    if (st == DI_OK)
        st = run_routed_grouped(c, p, &pl, b.groups, b.pair, b.n_groups, w);
    if (st == DI_OK && pl.shared_grouped)
        st = run_shared_grouped(c, p, &pl, (const cuda_moe_group *)(w + off_shared), w);
    else if (st == DI_OK && p->shared_inter)
        st = run_shared(c, p, &pl, w);
    if (st == DI_OK)
        st = cuda_moe_combine(c, (const uint16_t *)(w + pl.og), b.pos, p->top_k,
                              p->shared_inter ? (const uint16_t *)(w + pl.os) : NULL, p->dim,
                              p->n_rows, p->y, c->stream);
    return st;
}

di_status cuda_op_moe_experts(void *ctx, const kern_moe_experts *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "moe_experts");
    if (st != DI_OK)
        return st;
    if (p->n_rows == 0)
        return DI_OK;
    if ((st = experts_check(c, p)) != DI_OK)
        return st;
    const cuda_expert_table *tab = NULL;
    if (device_plan_ok(c, p) && (st = expert_table(c, p, &tab)) != DI_OK)
        return st;
    if (tab && tab->complete) {
        st = run_device_planned(c, p, tab);
        if (st == DI_OK)
            c->stats.moe_grouped++, c->stats.moe_device_plan++;
        else
            di_error_prefix(&c->last, "moe_experts: ");
        return st;
    }
    size_t n_pairs = (size_t)p->n_rows * p->top_k;
    int32_t *ids = (int32_t *)malloc(n_pairs * sizeof(int32_t));
    if (!ids)
        return cuda_fail(c, DI_ENOMEM, "moe_experts: host copy of %zu ids", n_pairs);
    moe_plan pl;
    memset(&pl, 0, sizeof(pl));
    st = cuda_download(c, ids, p->ids, n_pairs * sizeof(int32_t));
    if (st == DI_OK)
        st = plan_make(c, p, ids, &pl);
    free(ids);
    uint8_t *dev = NULL, *w = NULL;
    cuda_meta_reset(c);
    if (st == DI_OK)
        st = cuda_meta_push(c, pl.pair, n_pairs * sizeof(int32_t), &pl.off_pair);
    if (st == DI_OK)
        st = cuda_meta_push(c, pl.pos, n_pairs * sizeof(int32_t), &pl.off_pos);
    if (st == DI_OK && pl.grouped)
        st = cuda_meta_push(c, pl.groups, (size_t)pl.n_groups * sizeof(cuda_moe_group),
                            &pl.off_groups);
    if (st == DI_OK && pl.shared_grouped)
        st = cuda_meta_push(c, &pl.shared, sizeof(cuda_moe_group), &pl.off_shared);
    if (st == DI_OK && pl.wide)
        st = cuda_meta_push(c, pl.tiles, (size_t)pl.n_tiles * sizeof(cuda_moe_group),
                            &pl.off_tiles);
    if (st == DI_OK)
        st = cuda_meta_upload(c, 1, pl.total, &dev, &w);
    if (st == DI_OK)
        st = pl.grouped ? run_routed_grouped(c, p, &pl,
                                             (const cuda_moe_group *)(dev + pl.off_groups),
                                             (const int32_t *)(dev + pl.off_pair), NULL, w)
          : pl.wide  ? run_routed_wide(c, p, &pl, dev, w)
                     : run_routed(c, p, &pl, dev, w);
    if (st == DI_OK && pl.grouped)
        c->stats.moe_grouped++;
    else if (st == DI_OK)
        c->stats.moe_gemm++, c->stats.moe_wide += pl.wide;
    if (st == DI_OK && pl.shared_grouped)
        st = run_shared_grouped(c, p, &pl, (const cuda_moe_group *)(dev + pl.off_shared), w);
    else if (st == DI_OK && p->shared_inter)
        st = run_shared(c, p, &pl, w);
    if (st == DI_OK)
        st = cuda_moe_combine(c, (const uint16_t *)(w + pl.og), (const int32_t *)(dev + pl.off_pos),
                              p->top_k, p->shared_inter ? (const uint16_t *)(w + pl.os) : NULL,
                              p->dim, p->n_rows, p->y, c->stream);
    plan_free(&pl);
    if (st != DI_OK)
        di_error_prefix(&c->last, "moe_experts: ");
    return st;
}
