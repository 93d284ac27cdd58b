/* check_ep: the device side of the expert-parallel exchange (kernels/kern_ep.h).
 *  1. The combine kernel against its C twin: bit for bit, rows 1 .. 300, dim 64 and 4,096,
 *     top-k 1 .. 8, with and without the shared expert, outputs in random places (pos a
 *     permutation), inputs zeros, ones, arange, N(0,1), large, rounding edges, NaN/Inf; a pos
 *     out of range refused with nothing written.
 *  2. The exchange's arithmetic equals the one-rank moe_experts on the device in batch-invariant
 *     mode, bit for bit: the pairs split over two "ranks" by a placement with a redundant copy,
 *     each rank's pairs gathered (copy_rows) and run with moe_experts one expert a row without the
 *     shared expert, the shared expert with linear_fp8 + swiglu + linear_fp8, the outputs
 *     combined by ascending expert id. Rows 1, 7, 64, 65 and 200 (both moe_experts plans).
 * Exit 0: all match; 1: a mismatch; 2: setup error. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/numfmt.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/kern_ep.h"
#include "tests/gpu/check_util.h"
#include "tests/gpu/gpu_common.h"

static const char usage[] =
    "usage: check_ep [--seed N]\n"
    "  the CUDA expert-parallel combine against its C twin, and the exchange's arithmetic\n"
    "  against the one-rank moe_experts in batch-invariant mode (bit for bit)\n";

/* ---- 1. the combine against the twin ---- */

static void check_combine(chk_env *env, kern_ep_ops *xo, uint32_t rows, uint32_t dim,
                          uint32_t top_k, int shared, int mode)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    uint32_t n_outs = rows * top_k + 3; /* a few outputs nobody reads */
    size_t no = (size_t)n_outs * dim, ny = (size_t)rows * dim;
    uint16_t *outs = chk_malloc(no * 2), *sh = chk_malloc(ny * 2);
    uint16_t *y_c = chk_malloc(ny * 2), *y_g = chk_malloc(ny * 2);
    int32_t *pos = chk_malloc((size_t)rows * top_k * 4 + 4);
    chk_fill_bf16(outs, no, mode, &rng);
    chk_fill_bf16(sh, ny, mode == CHK_SPECIALS ? CHK_NORMAL : mode, &rng);
    for (uint32_t i = 0; i < n_outs; i++) /* a permutation of the first rows*top_k */
        if (i < rows * top_k)
            pos[i] = (int32_t)i;
    for (uint32_t i = rows * top_k; i > 1; i--) {
        uint32_t j = (uint32_t)di_rng_below(&rng, i);
        int32_t t = pos[i - 1];
        pos[i - 1] = pos[j];
        pos[j] = t;
    }
    chk_poison(y_c, ny * 2);
    kern_ep_combine c = {.n_rows = rows, .dim = dim, .top_k = top_k, .n_outs = n_outs,
                         .outs = outs, .pos = pos, .shared = shared ? sh : NULL, .y = y_c};
    chk_cpu_status(kern_ep_combine_ref(&c), "kern_ep_combine_ref");
    uint16_t *d_outs = chk_dev_copy(env, outs, no * 2), *d_sh = chk_dev_copy(env, sh, ny * 2);
    uint16_t *d_y = chk_dev_alloc(env, ny * 2);
    c.outs = d_outs, c.shared = shared ? d_sh : NULL, c.y = d_y;
    size_t bad = chk_gpu_status(env, xo->combine(xo->ctx, &c), "ep combine");
    chk_get(env, y_g, d_y, ny * 2);
    char what[160];
    snprintf(what, sizeof what, "ep combine rows %u dim %u top-%u shared %d %s (seed %llu)",
             rows, dim, top_k, shared, chk_mode_name[mode], (unsigned long long)seed);
    bad += chk_cmp_bf16_exact(what, y_c, y_g, ny);
    /* a position out of range: refused, y untouched */
    pos[rows * top_k - 1] = (int32_t)n_outs;
    chk_put(env, d_y, y_c, ny * 2);
    bad += chk_expect(env, xo->combine(xo->ctx, &c), DI_EINVAL, "ep combine, pos out of range");
    chk_get(env, y_g, d_y, ny * 2);
    bad += chk_cmp_bf16_exact("ep combine refused: y untouched", y_c, y_g, ny);
    chk_count(env, bad);
    chk_dev_free(env, d_outs), chk_dev_free(env, d_sh), chk_dev_free(env, d_y);
    free(outs), free(sh), free(y_c), free(y_g), free(pos);
}

/* ---- 2. the exchange against the one-rank moe_experts ---- */

enum { E = 16, K = 6, DIM = 256, INTER = 128 };

typedef struct weights {
    kern_expert ex[E];          /* device pointers */
    kern_expert shared;
    void *mem[(E + 1) * 6];
    int n;
} weights;

/* One FP4 (1x32) or FP8 (32x32) weight of rows x cols on the device: random codes (no FP8
 * NaN) and scales near 1/sqrt(cols). */
static void weight(chk_env *env, weights *w, int fp8, uint32_t rows, uint32_t cols, di_rng *rng,
                   const uint8_t **data, const uint8_t **scale)
{
    size_t wb = fp8 ? (size_t)rows * cols : (size_t)rows * cols / 2;
    size_t sb = fp8 ? (size_t)(rows + 31) / 32 * (cols / 32) : (size_t)rows * (cols / 32);
    uint8_t *h = chk_malloc(wb + sb);
    for (size_t i = 0; i < wb; i++) {
        h[i] = (uint8_t)di_rng_u32(rng);
        if (fp8 && (h[i] & 0x7f) == 0x7f)
            h[i] ^= 1;
    }
    int base = 127 - (fp8 ? 9 : 2) - (int)lround(log2(sqrt((double)cols)));
    for (size_t i = 0; i < sb; i++)
        h[wb + i] = (uint8_t)(base + (int)di_rng_below(rng, 3));
    uint8_t *d = chk_dev_copy(env, h, wb + sb);
    free(h);
    w->mem[w->n++] = d;
    *data = d;
    *scale = d + wb;
}

static void expert(chk_env *env, weights *w, int fp8, uint32_t inter, kern_expert *x, di_rng *rng)
{
    weight(env, w, fp8, inter, DIM, rng, &x->w1, &x->w1_scale);
    weight(env, w, fp8, inter, DIM, rng, &x->w3, &x->w3_scale);
    weight(env, w, fp8, DIM, inter, rng, &x->w2, &x->w2_scale);
}

/* The slots of two ranks: rank 0 holds experts 0..8, rank 1 experts 9..15 and copies of 0 and
 * 3 (a redundant copy: expert 0's tokens alternate between the ranks). */
static void place(uint32_t e, uint32_t nth, uint32_t *rank)
{
    if ((e == 0 || e == 3) && nth % 2)
        *rank = 1;
    else
        *rank = e <= 8 ? 0 : 1;
}

static void check_exchange(chk_env *env, const kern_ep_ops *xo, const weights *w, uint32_t T)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    const kern_ops *ops = &env->gpu.ops;
    void *ctx = env->gpu.ctx;
    size_t NP = (size_t)T * K, ny = (size_t)T * DIM;
    uint16_t *x = chk_malloc(ny * 2), *y1 = chk_malloc(ny * 2), *y2 = chk_malloc(ny * 2);
    int32_t *ids = chk_malloc(NP * 4), *src_row = chk_malloc(NP * 4), *pos = chk_malloc(NP * 4);
    int32_t *pid = chk_malloc(NP * 4);
    float *wts = chk_malloc(NP * 4), *pw = chk_malloc(NP * 4);
    chk_fill_bf16(x, ny, CHK_NORMAL, &rng);
    for (uint32_t t = 0; t < T; t++) /* K distinct experts a row, as the gate picks them */
        for (uint32_t k = 0; k < K; k++) {
            int32_t e;
            int dup;
            do {
                e = (int32_t)di_rng_below(&rng, E);
                dup = 0;
                for (uint32_t j = 0; j < k; j++)
                    dup |= ids[t * K + j] == e;
            } while (dup);
            ids[t * K + k] = e;
            wts[t * K + k] = (float)(0.05 + di_rng_uniform(&rng));
        }
    uint16_t *d_x = chk_dev_copy(env, x, ny * 2), *d_y = chk_dev_alloc(env, ny * 2);
    int32_t *d_ids = chk_dev_copy(env, ids, NP * 4);
    float *d_w = chk_dev_copy(env, wts, NP * 4);
    /* the one-rank call */
    kern_moe_experts one = {.n_rows = T, .dim = DIM, .inter = INTER, .shared_inter = INTER,
                            .n_experts = E, .top_k = K, .x = d_x, .ids = d_ids, .weights = d_w,
                            .experts = w->ex, .shared = w->shared, .swiglu_limit = 10.0f,
                            .y = d_y};
    size_t bad = chk_gpu_status(env, ops->moe_experts(ctx, &one), "moe_experts, one rank");
    chk_get(env, y1, d_y, ny * 2);
    /* the exchange: pairs by rank (rank 0's first), in row order within a rank */
    uint32_t nth[E] = {0}, cnt[2] = {0}, *rk = chk_malloc(NP * 4), *idx = chk_malloc(NP * 4);
    for (size_t i = 0; i < NP; i++) {
        place((uint32_t)ids[i], nth[ids[i]]++, &rk[i]);
        idx[i] = cnt[rk[i]]++;
    }
    for (size_t i = 0; i < NP; i++) {
        size_t g = (rk[i] ? cnt[0] : 0) + idx[i];
        src_row[g] = (int32_t)(i / K);
        pid[g] = ids[i];
        pw[g] = wts[i];
    }
    uint16_t *d_xg = chk_dev_alloc(env, NP * DIM * 2), *d_o = chk_dev_alloc(env, NP * DIM * 2);
    kern_copy_rows cp = {.n_rows = (uint32_t)NP, .row_bytes = DIM * 2, .src = d_x,
                         .src_stride = DIM * 2, .rows = src_row, .dst = d_xg,
                         .dst_stride = DIM * 2};
    bad += chk_gpu_status(env, ops->copy_rows(ctx, &cp), "copy_rows (gather)");
    int32_t *d_pid = chk_dev_copy(env, pid, NP * 4);
    float *d_pw = chk_dev_copy(env, pw, NP * 4);
    for (uint32_t r = 0, at = 0; r < 2; at += cnt[r], r++) {
        if (!cnt[r])
            continue;
        kern_moe_experts q = {.n_rows = cnt[r], .dim = DIM, .inter = INTER, .n_experts = E,
                              .top_k = 1, .x = d_xg + (size_t)at * DIM, .ids = d_pid + at,
                              .weights = d_pw + at, .experts = w->ex, .swiglu_limit = 10.0f,
                              .y = d_o + (size_t)at * DIM};
        bad += chk_gpu_status(env, ops->moe_experts(ctx, &q), "moe_experts, a rank's pairs");
    }
    uint16_t *d_s = chk_dev_alloc(env, (size_t)T * (INTER * 3 + DIM) * 2);
    uint16_t *g = d_s, *u = g + (size_t)T * INTER, *h = u + (size_t)T * INTER;
    uint16_t *sy = h + (size_t)T * INTER;
    kern_linear l = {.m = T, .n = INTER, .k = DIM, .groups = 1, .x = d_x, .x_stride = DIM,
                     .w = w->shared.w1, .w_scale = w->shared.w1_scale, .y = g, .y_stride = INTER};
    bad += chk_gpu_status(env, ops->linear_fp8(ctx, &l), "shared w1");
    l.w = w->shared.w3, l.w_scale = w->shared.w3_scale, l.y = u;
    bad += chk_gpu_status(env, ops->linear_fp8(ctx, &l), "shared w3");
    kern_swiglu sw = {.n_rows = T, .n = INTER, .g = g, .u = u, .stride = INTER, .limit = 10.0f,
                      .h = h};
    bad += chk_gpu_status(env, ops->swiglu(ctx, &sw), "shared swiglu");
    kern_linear l2 = {.m = T, .n = DIM, .k = INTER, .groups = 1, .x = h, .x_stride = INTER,
                      .w = w->shared.w2, .w_scale = w->shared.w2_scale, .y = sy,
                      .y_stride = DIM};
    bad += chk_gpu_status(env, ops->linear_fp8(ctx, &l2), "shared w2");
    for (uint32_t t = 0; t < T; t++) { /* a row's outputs by ascending expert id */
        uint32_t n = 0;
        for (int32_t e = 0; e < E; e++)
            for (uint32_t j = 0; j < K; j++)
                if (ids[t * K + j] == e) {
                    size_t i = (size_t)t * K + j;
                    pos[t * K + n++] = (int32_t)((rk[i] ? cnt[0] : 0) + idx[i]);
                }
    }
    chk_poison(y2, ny * 2);
    chk_put(env, d_y, y2, ny * 2);
    kern_ep_combine c = {.n_rows = T, .dim = DIM, .top_k = K, .n_outs = (uint32_t)NP,
                         .outs = d_o, .pos = pos, .shared = sy, .y = d_y};
    bad += chk_gpu_status(env, xo->combine(xo->ctx, &c), "ep combine");
    chk_get(env, y2, d_y, ny * 2);
    char what[128];
    snprintf(what, sizeof what, "exchange vs one rank, %u rows (seed %llu)", T,
             (unsigned long long)seed);
    bad += chk_cmp_bf16_exact(what, y1, y2, ny);
    chk_count(env, bad);
    void *dev[] = {d_x, d_y, d_ids, d_w, d_xg, d_o, d_pid, d_pw, d_s};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        chk_dev_free(env, dev[i]);
    free(x), free(y1), free(y2), free(ids), free(src_row), free(pos), free(pid), free(wts);
    free(pw), free(rk), free(idx);
}

int main(int argc, char **argv)
{
    chk_env env;
    chk_init(&env, argc, argv, usage);
    kern_ep_ops xo;
    di_error e;
    if (kern_ep_ops_cuda(&env.gpu, &xo, &e) != DI_OK) {
        fprintf(stderr, "check_ep: %s\n", e.msg);
        return 2;
    }
    kern_ep_ops bad;
    if (kern_ep_ops_cuda(&env.cpu, &bad, &e) != DI_EINVAL) {
        fprintf(stderr, "check_ep: the CPU backend was taken for a CUDA one\n");
        return 1;
    }
    static const uint32_t rows[] = {1, 3, 17, 300}, dims[] = {64, 4096}, ks[] = {1, 2, 6, 8};
    static const int modes[] = {CHK_ZEROS, CHK_ONES, CHK_ARANGE, CHK_NORMAL, CHK_LARGE,
                                CHK_EDGES, CHK_SPECIALS};
    for (size_t r = 0; r < 4; r++)
        for (size_t d = 0; d < 2; d++)
            for (size_t k = 0; k < 4; k++)
                for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++)
                    check_combine(&env, &xo, rows[r], dims[d], ks[k], (int)((r + k + m) % 2),
                                  modes[m]);
    /* pinned host memory: allocated, written, freed */
    uint8_t *pin = xo.host_alloc(xo.ctx, 1 << 20);
    if (!pin) {
        fprintf(stderr, "check_ep: pinned allocation failed\n");
        return 2;
    }
    memset(pin, 1, 1 << 20);
    xo.host_free(xo.ctx, pin);
    if (kern_cuda_set_batch_invariant(&env.gpu, 1) != DI_OK) {
        fprintf(stderr, "check_ep: batch-invariant mode refused\n");
        return 2;
    }
    weights w = {0};
    di_rng rng;
    chk_case_rng(&env, &rng);
    for (uint32_t x = 0; x < E; x++)
        expert(&env, &w, 0, INTER, &w.ex[x], &rng);
    expert(&env, &w, 1, INTER, &w.shared, &rng);
    static const uint32_t ts[] = {1, 7, 64, 65, 200};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
        check_exchange(&env, &xo, &w, ts[i]);
    for (int i = 0; i < w.n; i++)
        chk_dev_free(&env, w.mem[i]);
    return chk_finish(&env, "check_ep", 0, NULL);
}
