/* check_linear: the CUDA backend's linear_fp8, linear_fp4, linear_bf16 (with groups) and head
 * against their C twins (kern_cpu_create's table), with kern_linear's tolerance from
 * kernels/kernels.h: per element |y - y_cpu| <= 1e-2 * max(1, |y_cpu|), per row cosine >= 0.9999;
 * row padding of y must come back untouched and every output must be written (poisoned first).
 * Inputs: zeros, ones, arange, N(0,1), values past the (A) scale floor and past 448 per block,
 * block maxima on E4M3/E2M1 rounding ties and scale steps; weights with random, extreme
 * (+-448, subnormal, signed zero) codes and UE8M0 scales near both ends; rows 1, 3, 63, 127,
 * n off multiples of 32 (a partial last 32-row scale block for FP8), groups 8, padded strides.
 * Every case runs on the default backend (FP8/FP4 calls of up to 16 rows with bf16 output on the
 * weight-streaming kernel of moe_mma.cu, split over the blocks of a cluster where the shape has
 * few outputs, the rest on cuBLASLt) and a subset again on the plain GEMM kernel (simple_gemm);
 * the FP8/FP4 cases of up to 64 rows again with that kernel taking them all
 * (kern_cuda_set_stream, four and eight n8 tiles of rows).
 * With --bench: the ops at V4.1-Flash shapes next to the copy bandwidth and an 8192^3 BF16 GEMM
 * measured in the same run.
 * Exit 0: all match; 1: a mismatch (parameters and first mismatches printed); 2: setup error.
 * --bench times the ops even after a mismatch (under a banner), so one run brings numbers back. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/numfmt.h"
#include "kernels/cuda/backend_cuda.h"
#include "tests/gpu/check_util.h"
#include "tests/gpu/gpu_common.h"

static const char usage[] =
    "usage: check_linear [--bench] [--seed N]\n"
    "  CUDA linear_fp8, linear_fp4, linear_bf16, head against the C twins; --bench adds timings\n"
    "  (CHECK_LINEAR_BENCH=NAME times only the bench shapes whose name contains NAME)\n";

enum { OP_FP8, OP_FP4, OP_BF16, OP_HEAD, OP_COUNT };
static const char *const op_name[OP_COUNT] = {"linear_fp8", "linear_fp4", "linear_bf16", "head"};

/* Weight modes: UE8M0 scale bytes (FP8/FP4) or magnitudes (BF16) chosen so that x * w stays
 * moderate for the x mode each is paired with (the per-element bound is only meaningful when
 * fp32 rounding of the sum stays below 1e-2; the cosine bound holds regardless). */
enum { W_NORMAL, W_SMALL, W_LARGE, W_CODES, W_MODES };
static const char *const wmode_name[W_MODES] = {"normal", "small-scales", "large-scales",
                                                "extreme-codes"};

/* (x mode, weight mode) pairs every small shape runs */
static const int mode_pairs[][2] = {
    {CHK_ZEROS, W_NORMAL}, {CHK_ONES, W_NORMAL},  {CHK_ARANGE, W_CODES}, {CHK_NORMAL, W_NORMAL},
    {CHK_TINY, W_LARGE},   {CHK_LARGE, W_SMALL},  {CHK_EDGES, W_SMALL},
};
#define N_PAIRS (sizeof(mode_pairs) / sizeof(mode_pairs[0]))

typedef struct lin_case {
    int op;
    uint32_t m, n, k, groups;
    int out_f32, accumulate;
    uint32_t x_pad, y_pad;      /* extra elements per row of x and y */
    int xmode, wmode;
} lin_case;

typedef di_status (*linear_fn)(void *ctx, const kern_linear *p);

static linear_fn op_fn(const kern_backend *be, int op)
{
    switch (op) {
    case OP_FP8: return be->ops.linear_fp8;
    case OP_FP4: return be->ops.linear_fp4;
    case OP_BF16: return be->ops.linear_bf16;
    default: return be->ops.head;
    }
}

/* ---- weights ---- */

static uint8_t scale_byte(int op, int wmode, di_rng *rng)
{
    int base = op == OP_FP4 ? 124 : 118; /* |w| up to about 6-7 */
    if (wmode == W_SMALL)
        base -= 18;
    else if (wmode == W_LARGE)
        base += 9;
    return (uint8_t)(base + (int)di_rng_below(rng, wmode == W_NORMAL || wmode == W_CODES ? 4 : 9));
}

static uint8_t fp8_code(int wmode, di_rng *rng)
{
    static const uint8_t extreme[] = {0x00, 0x80, 0x01, 0x81, 0x07, 0x87, 0x08, 0x7e, 0xfe};
    if (wmode == W_CODES && di_rng_below(rng, 2))
        return extreme[di_rng_below(rng, sizeof(extreme))];
    uint8_t b = (uint8_t)di_rng_below(rng, 256);
    return (b & 0x7f) == 0x7f ? (uint8_t)(b ^ 1) : b; /* no NaN codes */
}

static uint8_t fp4_byte(int wmode, di_rng *rng)
{
    static const uint8_t extreme[] = {0x0, 0x8, 0x7, 0xf, 0x1, 0x9};
    if (wmode != W_CODES)
        return (uint8_t)di_rng_below(rng, 256);
    uint8_t lo = extreme[di_rng_below(rng, sizeof(extreme))];
    uint8_t hi = extreme[di_rng_below(rng, sizeof(extreme))];
    return (uint8_t)(lo | hi << 4);
}

typedef struct weights {
    void *w;                    /* codes or bf16 */
    uint8_t *scale;             /* NULL for bf16 */
    size_t w_bytes, s_bytes;
} weights;

static void make_weights(const lin_case *lc, di_rng *rng, weights *out)
{
    uint32_t groups = lc->groups ? lc->groups : 1;
    size_t rows = (size_t)groups * lc->n, kb = lc->k / 32;
    memset(out, 0, sizeof(*out));
    if (lc->op == OP_FP8 || lc->op == OP_FP4) {
        out->w_bytes = lc->op == OP_FP8 ? rows * lc->k : rows * lc->k / 2;
        out->s_bytes = lc->op == OP_FP8 ? (rows + 31) / 32 * kb : rows * kb;
        uint8_t *w = chk_malloc(out->w_bytes);
        out->scale = chk_malloc(out->s_bytes);
        for (size_t i = 0; i < out->w_bytes; i++)
            w[i] = lc->op == OP_FP8 ? fp8_code(lc->wmode, rng) : fp4_byte(lc->wmode, rng);
        for (size_t i = 0; i < out->s_bytes; i++)
            out->scale[i] = scale_byte(lc->op, lc->wmode, rng);
        out->w = w;
        return;
    }
    out->w_bytes = rows * lc->k * 2;
    uint16_t *w = chk_malloc(out->w_bytes);
    if (lc->wmode == W_CODES) {
        chk_fill_bf16(w, rows * lc->k, CHK_EDGES, rng);
        for (size_t i = 0; i < rows * lc->k; i++)
            w[i] = di_f32_to_bf16(di_bf16_to_f32(w[i]) * 0x1p-12f);
    } else {
        float s = lc->wmode == W_SMALL ? 1e-4f : (lc->wmode == W_LARGE ? 1e4f : 0.05f);
        chk_fill_bf16_fast(w, rows * lc->k, s, rng);
    }
    out->w = w;
}

/* ---- comparison with kern_linear's tolerance ---- */

static double y_at(const void *y, int out_f32, size_t i)
{
    return out_f32 ? (double)((const float *)y)[i] : (double)di_bf16_to_f32(((const uint16_t *)y)[i]);
}

static int same_bits(const void *a, const void *b, int out_f32, size_t i)
{
    size_t sz = out_f32 ? 4 : 2;
    return memcmp((const uint8_t *)a + i * sz, (const uint8_t *)b + i * sz, sz) == 0;
}

/* mismatches: elements out of tolerance, rows under the cosine bound, padding changed */
static size_t compare(const char *what, const lin_case *lc, const void *cpu, const void *gpu,
                      size_t ys, double *worst_ratio, double *worst_cos)
{
    uint32_t cols = (lc->groups ? lc->groups : 1) * lc->n;
    size_t bad = 0, shown = 0;
    for (uint32_t r = 0; r < lc->m; r++) {
        double dot = 0, nc = 0, ng = 0;
        for (size_t j = 0; j < ys; j++) {
            size_t i = (size_t)r * ys + j;
            if (j >= cols) { /* padding: never written */
                if (!same_bits(cpu, gpu, lc->out_f32, i) && shown++ < 5)
                    fprintf(stderr, "MISMATCH %s: padding y[%u][%zu] written\n", what, r, j);
                bad += !same_bits(cpu, gpu, lc->out_f32, i);
                continue;
            }
            double c = y_at(cpu, lc->out_f32, i), g = y_at(gpu, lc->out_f32, i);
            double tol = 1e-2 * (fabs(c) > 1.0 ? fabs(c) : 1.0);
            int ok = isfinite(c) && isfinite(g) ? fabs(g - c) <= tol
                                                : (isnan(c) && isnan(g)) || c == g;
            if (isfinite(c) && isfinite(g) && fabs(g - c) / tol > *worst_ratio)
                *worst_ratio = fabs(g - c) / tol;
            if (!ok) {
                if (shown++ < 5)
                    fprintf(stderr, "MISMATCH %s: y[%u][%zu] cpu %.9g gpu %.9g (tolerance %.3g)\n",
                            what, r, j, c, g, tol);
                bad++;
            }
            dot += c * g, nc += c * c, ng += g * g;
        }
        double cosv = nc == 0 && ng == 0 ? 1.0 : dot / sqrt(nc * ng);
        if (!(cosv >= 0.9999) && isfinite(nc) && isfinite(ng)) {
            if (shown++ < 5)
                fprintf(stderr, "MISMATCH %s: row %u cosine %.6f < 0.9999\n", what, r, cosv);
            bad++;
        }
        if (isfinite(cosv) && cosv < *worst_cos)
            *worst_cos = cosv;
    }
    return bad;
}

/* ---- one case ---- */

typedef struct sweep_stats {
    int cases, failed;
    double worst_ratio;         /* largest |y - y_cpu| / tolerance */
    double worst_cos;           /* smallest row cosine */
} sweep_stats;

static void run_case(chk_env *env, const kern_backend *gpu, const lin_case *lc, sweep_stats *ss)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    uint32_t groups = lc->groups ? lc->groups : 1;
    size_t kx = (size_t)groups * lc->k, xs = kx + lc->x_pad;
    size_t ys = (size_t)groups * lc->n + lc->y_pad, ysz = lc->out_f32 ? 4 : 2;
    size_t xbytes = lc->m * xs * 2, ybytes = lc->m * ys * ysz;
    char what[320];
    snprintf(what, sizeof(what),
             "%s%s m=%u n=%u k=%u groups=%u out=%s acc=%d x_stride=%zu y_stride=%zu x=%s w=%s "
             "seed=%" PRIu64,
             op_name[lc->op], gpu == &env->gpu ? "" : " (plain GEMM)", lc->m, lc->n, lc->k, groups,
             lc->out_f32 ? "f32" : "bf16", lc->accumulate, xs, ys, chk_mode_name[lc->xmode],
             wmode_name[lc->wmode], seed);

    uint16_t *x = chk_malloc(xbytes);
    chk_fill_u16(x, lc->m * xs, CHK_POISON_BF16);
    for (uint32_t r = 0; r < lc->m; r++)
        chk_fill_bf16(x + r * xs, kx, lc->xmode, &rng);
    weights wt;
    make_weights(lc, &rng, &wt);
    void *y = chk_malloc(ybytes), *ycpu = chk_malloc(ybytes), *ygpu = chk_malloc(ybytes);
    if (!lc->out_f32) {
        chk_fill_u16(y, lc->m * ys, CHK_POISON_BF16);
    } else {
        for (size_t i = 0; i < lc->m * ys; i++) {
            float v = lc->accumulate ? (float)(di_rng_normal(&rng) * 10.0) : 0.0f;
            uint32_t poison = CHK_POISON_F32_BITS;
            if (!lc->accumulate)
                memcpy(&v, &poison, 4);
            ((float *)y)[i] = v;
        }
    }
    memcpy(ycpu, y, ybytes);

    void *dx = chk_dev_alloc(env, xbytes), *dw = chk_dev_alloc(env, wt.w_bytes);
    void *ds = wt.scale ? chk_dev_alloc(env, wt.s_bytes) : NULL, *dy = chk_dev_alloc(env, ybytes);
    chk_put(env, dx, x, xbytes);
    chk_put(env, dw, wt.w, wt.w_bytes);
    if (ds)
        chk_put(env, ds, wt.scale, wt.s_bytes);
    chk_put(env, dy, y, ybytes);
    kern_linear p = {lc->m, lc->n, lc->k, lc->groups, dx, xs, dw, ds, lc->out_f32, lc->accumulate,
                     dy, ys};
    di_status st = op_fn(gpu, lc->op)(gpu->ctx, &p);
    di_error e;
    if (st == DI_OK) /* gpu may be another backend, on another stream than the copies */
        st = kern_cuda_sync((kern_backend *)gpu, &e);
    size_t bad = 0;
    if (st != DI_OK) {
        fprintf(stderr, "FAIL %s: CUDA op returned %s: %s\n", what, di_status_name(st),
                kern_cuda_last_error(gpu));
        bad = 1;
    }
    chk_get(env, ygpu, dy, ybytes);
    kern_linear pc = {lc->m, lc->n, lc->k, lc->groups, x, xs, wt.w, wt.scale, lc->out_f32,
                      lc->accumulate, ycpu, ys};
    if (op_fn(&env->cpu, lc->op)(env->cpu.ctx, &pc) != DI_OK) {
        fprintf(stderr, "%s: CPU op failed\n", what);
        exit(2);
    }
    if (!bad)
        bad = compare(what, lc, ycpu, ygpu, ys, &ss->worst_ratio, &ss->worst_cos);
    chk_count(env, bad);
    ss->cases++;
    ss->failed += bad != 0;
    chk_dev_free(env, dx);
    chk_dev_free(env, dw);
    chk_dev_free(env, ds);
    chk_dev_free(env, dy);
    free(x), free(wt.w), free(wt.scale), free(y), free(ycpu), free(ygpu);
}

/* ---- the sweep ---- */

typedef struct shape {
    int op;
    uint32_t m, n, k, groups;
    int full;                   /* every mode pair and output kind; else two cases */
} shape;

static const shape shapes[] = {
    {OP_FP8, 1, 64, 64, 1, 1},      {OP_FP8, 3, 33, 96, 1, 1},     {OP_FP8, 63, 100, 256, 1, 1},
    {OP_FP8, 127, 257, 512, 1, 1},  {OP_FP8, 64, 1280, 5120, 1, 0}, {OP_FP8, 8, 512, 5120, 1, 0},
    {OP_FP8, 5, 96, 8192, 1, 0},    {OP_FP8, 20, 40, 1024, 1, 1},  {OP_FP8, 40, 100, 3200, 1, 1},
    {OP_FP4, 33, 70, 2048, 1, 1},   {OP_FP4, 24, 260, 3136, 1, 1}, {OP_FP4, 1, 64, 64, 1, 1},
    {OP_FP4, 3, 33, 96, 1, 1},
    {OP_FP4, 63, 100, 256, 1, 1},   {OP_FP4, 127, 257, 512, 1, 1}, {OP_FP4, 8, 2304, 5120, 1, 0},
    {OP_BF16, 1, 64, 128, 8, 1},    {OP_BF16, 3, 33, 96, 8, 1},    {OP_BF16, 63, 64, 128, 1, 1},
    {OP_BF16, 127, 100, 256, 8, 1}, {OP_BF16, 8, 1024, 4096, 8, 0}, {OP_HEAD, 1, 1000, 256, 1, 1},
    {OP_HEAD, 3, 4097, 512, 1, 1},  {OP_HEAD, 63, 333, 5120, 1, 0}, {OP_HEAD, 1, 129280, 5120, 1, 0},
};
#define N_SHAPES (sizeof(shapes) / sizeof(shapes[0]))

/* Output kinds: bf16; f32; f32 accumulating. The head has no bf16 output. */
static void shape_cases(const shape *s, size_t ci, lin_case *lc)
{
    memset(lc, 0, sizeof(*lc));
    lc->op = s->op, lc->m = s->m, lc->n = s->n, lc->k = s->k, lc->groups = s->groups;
    size_t pair = ci % N_PAIRS, kind = ci / N_PAIRS;
    if (s->op == OP_HEAD)
        kind = 1 + kind % 2;
    lc->out_f32 = kind > 0;
    lc->accumulate = kind == 2;
    lc->xmode = mode_pairs[pair][0];
    lc->wmode = mode_pairs[pair][1];
    /* padded rows in some cases: x rows 7 apart past k (unaligned for the BF16 GEMM), y rows
     * 3 apart past n */
    lc->x_pad = (ci % 3 == 1) ? 7 : 0;
    lc->y_pad = (ci % 4 == 2) ? 3 : 0;
}

static void print_stats(const char *name, const sweep_stats *ss)
{
    printf("%-28s %4d cases, %d failed; worst |err|/tolerance %.3g, worst row cosine %.7f\n",
           name, ss->cases, ss->failed, ss->worst_ratio, ss->worst_cos);
}

static void sweep(chk_env *env, const kern_backend *simple)
{
    sweep_stats per_op[OP_COUNT], plain;
    for (int i = 0; i < OP_COUNT; i++)
        per_op[i] = (sweep_stats){0, 0, 0.0, 1.0};
    plain = (sweep_stats){0, 0, 0.0, 1.0};
    for (size_t si = 0; si < N_SHAPES; si++) {
        const shape *s = &shapes[si];
        size_t n_cases = s->full ? 3 * N_PAIRS : 2;
        for (size_t ci = 0; ci < n_cases; ci++) {
            lin_case lc;
            /* the two cases of a large shape: N(0,1) bf16 (or f32) out, and x past 448 */
            shape_cases(s, s->full ? ci : (ci == 0 ? 3 : N_PAIRS + 5), &lc);
            run_case(env, &env->gpu, &lc, &per_op[s->op]);
            if (s->full && ci % 2 == 0 && s->m * s->n < 200000)
                run_case(env, simple, &lc, &plain);
        }
    }
    for (int i = 0; i < OP_COUNT; i++)
        print_stats(op_name[i], &per_op[i]);
    print_stats("all ops on the plain GEMM", &plain);
    /* FP8/FP4 calls of 17-64 rows on the weight-streaming kernel (kern_cuda_set_stream) */
    sweep_stats wide = {0, 0, 0.0, 1.0};
    kern_cuda_stats w0, w1;
    kern_cuda_get_stats(&env->gpu, &w0);
    kern_cuda_set_stream(&env->gpu, 0, 64);
    for (size_t si = 0; si < N_SHAPES; si++) {
        const shape *sh = &shapes[si];
        if ((sh->op != OP_FP8 && sh->op != OP_FP4) || sh->m <= 16 || sh->m > 64)
            continue;
        for (size_t c = 0; c < (sh->full ? N_PAIRS : 2); c++) {
            lin_case lc;
            shape_cases(sh, sh->full ? c : (c == 0 ? 3 : 5), &lc); /* bf16 out */
            run_case(env, &env->gpu, &lc, &wide);
        }
    }
    kern_cuda_set_stream(&env->gpu, 0, 0);
    kern_cuda_get_stats(&env->gpu, &w1);
    print_stats("FP8/FP4 17-64 rows streamed", &wide);
    if (w1.linear_stream - w0.linear_stream != (uint64_t)wide.cases) {
        fprintf(stderr, "FAIL: %" PRIu64 " of %d cases of 17-64 rows took the weight-streaming "
                "kernel\n", w1.linear_stream - w0.linear_stream, wide.cases);
        chk_count(env, 1);
    }
    /* batch-invariant mode: the fixed 64-row chunks, padded strides, groups and accumulation
     * held to the same tolerance, on cases the default path passes above (a small shape's
     * every output kind, a large shape's two cases: at k >= 4096, arange x against
     * extreme-code weights cancels enough that another fp32 summation order can leave the
     * tolerance, whatever the path) */
    sweep_stats inv = {0, 0, 0.0, 1.0};
    kern_cuda_set_batch_invariant(&env->gpu, 1);
    for (size_t si = 0; si < N_SHAPES; si++) {
        const shape *sh = &shapes[si];
        for (size_t c = 0; c < (sh->full ? 3 : 2); c++) {
            lin_case lc;
            shape_cases(sh, sh->full ? c * (N_PAIRS + 1) : (c == 0 ? 3 : N_PAIRS + 5), &lc);
            run_case(env, &env->gpu, &lc, &inv);
        }
    }
    kern_cuda_set_batch_invariant(&env->gpu, 0);
    print_stats("all ops, batch-invariant mode", &inv);
}

/* ---- refused inputs ---- */

static size_t expect(const kern_backend *be, di_status got, di_status want, const char *what)
{
    if (got == want)
        return 0;
    fprintf(stderr, "FAIL %s: returned %s, expected %s (%s)\n", what, di_status_name(got),
            di_status_name(want), kern_cuda_last_error(be));
    return 1;
}

static void check_refusals(chk_env *env)
{
    const kern_backend *g = &env->gpu;
    void *c = g->ctx;
    uint8_t *d = chk_dev_alloc(env, 1 << 16);
    size_t bad = 0;
    kern_linear ok = {2, 32, 64, 1, (uint16_t *)d, 64, d + 4096, d + 8192, 0, 0, d + 16384, 32};
    kern_linear p = ok;
    bad += expect(g, g->ops.linear_fp8(c, NULL), DI_EINVAL, "linear_fp8(NULL)");
    p.k = 48;
    bad += expect(g, g->ops.linear_fp8(c, &p), DI_EINVAL, "linear_fp8 k=48");
    p = ok, p.groups = 2, p.x_stride = 128, p.y_stride = 64;
    bad += expect(g, g->ops.linear_fp4(c, &p), DI_EINVAL, "linear_fp4 groups=2");
    p = ok, p.accumulate = 1;
    bad += expect(g, g->ops.linear_bf16(c, &p), DI_EINVAL, "linear_bf16 accumulate into bf16");
    p = ok;
    bad += expect(g, g->ops.head(c, &p), DI_EINVAL, "head with bf16 output");
    p = ok, p.x = NULL;
    bad += expect(g, g->ops.linear_bf16(c, &p), DI_EINVAL, "linear_bf16 x NULL");
    p = ok, p.w_scale = NULL;
    bad += expect(g, g->ops.linear_fp8(c, &p), DI_EINVAL, "linear_fp8 w_scale NULL");
    p = ok, p.x_stride = 63;
    bad += expect(g, g->ops.linear_fp8(c, &p), DI_EINVAL, "linear_fp8 x_stride 63 < k 64");
    p = ok, p.y_stride = 31;
    bad += expect(g, g->ops.linear_fp4(c, &p), DI_EINVAL, "linear_fp4 y_stride 31 < n 32");
    p = ok, p.m = 0;
    bad += expect(g, g->ops.linear_fp8(c, &p), DI_OK, "linear_fp8 m=0 (nothing to do)");
    /* and the backend still computes after the refusals */
    bad += expect(g, g->ops.linear_fp8(c, &ok), DI_OK, "linear_fp8 after refusals");
    chk_sync(env);
    chk_count(env, bad);
    printf("refused inputs: %s\n", bad ? "MISMATCHES" : "all refused with DI_EINVAL");
    chk_dev_free(env, d);
}

/* ---- batch invariance ----
 * kernels.h asks that a row's output not depend on how many rows share the call; the CPU
 * backend guarantees it, and cuBLASLt picks its algorithm (tiles, split-K) per m (and up to 16
 * rows take the weight-streaming kernel), so by default the CUDA linear ops may not: that is
 * printed. In batch-invariant mode (kern_cuda_set_batch_invariant) rows 5 and 70 alone must
 * equal, bit for bit, the same rows inside calls of 9, 64 and 100 rows (two 64-row chunks). */

static void batch_invariance(chk_env *env, int op, uint32_t n, uint32_t k, int out_f32, int bi)
{
    enum { BIG = 100, N_M = 3, N_ROWS = 2 };
    const uint32_t ms[N_M] = {9, 64, 100}, probe[N_ROWS] = {5, 70};
    di_rng rng;
    chk_case_rng(env, &rng);
    lin_case lc = {.op = op, .m = BIG, .n = n, .k = k, .groups = 1, .out_f32 = out_f32,
                   .wmode = W_NORMAL};
    weights wt;
    make_weights(&lc, &rng, &wt);
    size_t ysz = out_f32 ? 4 : 2;
    uint16_t *x = chk_malloc((size_t)BIG * k * 2);
    chk_fill_bf16(x, (size_t)BIG * k, CHK_NORMAL, &rng);
    uint8_t *yb = chk_malloc((size_t)BIG * n * ysz), *y1 = chk_malloc((size_t)N_ROWS * n * ysz);
    void *dx = chk_dev_alloc(env, (size_t)BIG * k * 2), *dw = chk_dev_alloc(env, wt.w_bytes);
    void *ds = wt.scale ? chk_dev_alloc(env, wt.s_bytes) : NULL;
    void *dyb = chk_dev_alloc(env, (size_t)BIG * n * ysz);
    void *dy1 = chk_dev_alloc(env, (size_t)N_ROWS * n * ysz);
    chk_put(env, dx, x, (size_t)BIG * k * 2);
    chk_put(env, dw, wt.w, wt.w_bytes);
    if (ds)
        chk_put(env, ds, wt.scale, wt.s_bytes);
    if (kern_cuda_set_batch_invariant(&env->gpu, bi) != DI_OK) {
        fprintf(stderr, "batch invariance: the mode cannot be set\n");
        exit(2);
    }
    linear_fn fn = op_fn(&env->gpu, op);
    for (int r = 0; r < N_ROWS; r++) {
        kern_linear p1 = {1, n, k, 1, (uint16_t *)dx + (size_t)probe[r] * k, k, dw, ds, out_f32,
                          0, (uint8_t *)dy1 + (size_t)r * n * ysz, n};
        if (fn(env->gpu.ctx, &p1) != DI_OK) {
            fprintf(stderr, "batch invariance probe: %s\n", kern_cuda_last_error(&env->gpu));
            exit(2);
        }
    }
    chk_get(env, y1, dy1, (size_t)N_ROWS * n * ysz);
    size_t differ_all = 0;
    for (int mi = 0; mi < N_M; mi++) {
        kern_linear pb = {ms[mi], n, k, 1, dx, k, dw, ds, out_f32, 0, dyb, n};
        if (fn(env->gpu.ctx, &pb) != DI_OK) {
            fprintf(stderr, "batch invariance probe: %s\n", kern_cuda_last_error(&env->gpu));
            exit(2);
        }
        chk_get(env, yb, dyb, (size_t)ms[mi] * n * ysz);
        for (int r = 0; r < N_ROWS; r++) {
            if (probe[r] >= ms[mi])
                continue;
            size_t differ = 0;
            double worst = 0;
            const uint8_t *one = y1 + (size_t)r * n * ysz;
            for (uint32_t j = 0; j < n; j++) {
                size_t i = (size_t)probe[r] * n + j;
                if (!same_bits(yb + (size_t)probe[r] * n * ysz, one, out_f32, j))
                    differ++;
                double d = fabs(y_at(yb, out_f32, i) - y_at(one, out_f32, j));
                worst = d > worst ? d : worst;
            }
            differ_all += differ;
            printf("batch invariance%s %s %ux%u (%s out): row %u alone vs in %u rows: %zu of %u "
                   "outputs differ (max |diff| %.3g)\n", bi ? " MODE" : "", op_name[op], n, k,
                   out_f32 ? "f32" : "bf16", probe[r], ms[mi], differ, n, worst);
        }
    }
    if (bi) {
        if (differ_all)
            fprintf(stderr, "FAIL batch-invariant mode: %s rows differ alone and in a batch\n",
                    op_name[op]);
        chk_count(env, differ_all);
    }
    kern_cuda_set_batch_invariant(&env->gpu, 0);
    chk_dev_free(env, dx);
    chk_dev_free(env, dw);
    chk_dev_free(env, ds);
    chk_dev_free(env, dyb);
    chk_dev_free(env, dy1);
    free(x), free(wt.w), free(wt.scale), free(yb), free(y1);
}

/* ---- benchmark ---- */

#define MAX_SETS 32
#define ROTATE_BYTES ((size_t)256 << 20) /* > 4 x the 60 MB L2 */

typedef struct bench_shape {
    const char *name;
    int op;
    uint32_t n, k;
} bench_shape;

static const bench_shape bench_shapes[] = {
    {"wq_a", OP_FP8, 1280, 5120},      {"wq_b", OP_FP8, 32768, 1280},
    {"wkv", OP_FP8, 512, 5120},        {"wo_b", OP_FP8, 5120, 8192},
    {"expert w1", OP_FP4, 2304, 5120}, {"expert8 w1", OP_FP8, 2304, 5120},
    {"head", OP_HEAD, 129280, 5120},
};
static const uint32_t bench_m[] = {1, 8, 64, 384, 4096};

typedef struct bench_run {
    linear_fn fn;
    void *ctx;
    kern_linear p[MAX_SETS];
    int sets;
} bench_run;

static di_status bench_call(void *arg, int i)
{
    bench_run *b = arg;
    return b->fn(b->ctx, &b->p[i % b->sets]);
}

/* Device buffers of `bytes` holding the host pattern. */
static void *dev_copy_of(chk_env *env, const void *host, size_t bytes)
{
    void *d = chk_dev_alloc(env, bytes);
    chk_put(env, d, host, bytes);
    return d;
}

typedef struct bench_row {
    const char *name;
    uint32_t n, k, m;
    double op_ms, prev_ms, op_flops, op_bytes, gemm_ms, gemm_bytes;
} bench_row;

/* Times `op` (weight format of the shape) and the BF16 GEMM of the same shape alone. */
static void bench_shape_m(chk_env *env, const bench_shape *bs, uint32_t m, bench_row *row)
{
    di_rng rng;
    chk_case_rng(env, &rng);
    int out_f32 = bs->op == OP_HEAD;
    size_t ysz = out_f32 ? 4 : 2, kb = bs->k / 32;
    size_t x_bytes = (size_t)m * bs->k * 2, y_bytes = (size_t)m * bs->n * ysz;
    size_t wq_bytes = bs->op == OP_FP8 ? (size_t)bs->n * bs->k
                                       : (bs->op == OP_FP4 ? (size_t)bs->n * bs->k / 2 : 0);
    size_t s_bytes = bs->op == OP_FP8 ? (size_t)(bs->n + 31) / 32 * kb
                                      : (bs->op == OP_FP4 ? (size_t)bs->n * kb : 0);
    size_t wb_bytes = (size_t)bs->n * bs->k * 2;

    /* host patterns: N(0,1)-like x, bf16 weights, codes without NaN, scales near 2^-8 */
    uint16_t *hx = chk_malloc(x_bytes), *hwb = chk_malloc(wb_bytes);
    chk_fill_bf16_fast(hx, x_bytes / 2, 1.0f, &rng);
    chk_fill_bf16_fast(hwb, wb_bytes / 2, 0.05f, &rng);
    uint8_t *hq = chk_malloc(wq_bytes + 1), *hs = chk_malloc(s_bytes + 1);
    for (size_t i = 0; i < wq_bytes; i++) {
        uint8_t b = (uint8_t)di_rng_u32(&rng);
        hq[i] = (bs->op == OP_FP8 && (b & 0x7f) == 0x7f) ? (uint8_t)(b ^ 1) : b;
    }
    for (size_t i = 0; i < s_bytes; i++)
        hs[i] = (uint8_t)(bs->op == OP_FP8 ? 118 + di_rng_below(&rng, 4) : 124 + di_rng_below(&rng, 4));

    size_t op_set = x_bytes + y_bytes + (bs->op == OP_HEAD ? wb_bytes : wq_bytes + s_bytes);
    size_t gemm_set = x_bytes + y_bytes + wb_bytes;
    int op_sets = (int)((ROTATE_BYTES + op_set - 1) / op_set);
    int gemm_sets = (int)((ROTATE_BYTES + gemm_set - 1) / gemm_set);
    op_sets = op_sets > MAX_SETS ? MAX_SETS : op_sets;
    gemm_sets = gemm_sets > MAX_SETS ? MAX_SETS : gemm_sets;

    bench_run op = {.fn = op_fn(&env->gpu, bs->op), .ctx = env->gpu.ctx, .sets = op_sets};
    bench_run gemm = {.fn = env->gpu.ops.linear_bf16, .ctx = env->gpu.ctx, .sets = gemm_sets};
    for (int s = 0; s < op_sets; s++) {
        const void *w = bs->op == OP_HEAD ? dev_copy_of(env, hwb, wb_bytes)
                                          : dev_copy_of(env, hq, wq_bytes);
        const uint8_t *sc = s_bytes ? dev_copy_of(env, hs, s_bytes) : NULL;
        op.p[s] = (kern_linear){m, bs->n, bs->k, 1, dev_copy_of(env, hx, x_bytes), bs->k, w, sc,
                                out_f32, 0, chk_dev_alloc(env, y_bytes), bs->n};
    }
    for (int s = 0; s < gemm_sets; s++)
        gemm.p[s] = (kern_linear){m, bs->n, bs->k, 1, dev_copy_of(env, hx, x_bytes), bs->k,
                                  dev_copy_of(env, hwb, wb_bytes), NULL, out_f32, 0,
                                  chk_dev_alloc(env, y_bytes), bs->n};
    free(hx), free(hwb), free(hq), free(hs);

    int reps = 25;
    row->name = bs->name, row->n = bs->n, row->k = bs->k, row->m = m;
    row->op_flops = 2.0 * m * bs->n * bs->k;
    row->op_ms = chk_time_ms(env, bench_call, &op, op_sets < 3 ? 3 : op_sets, reps);
    /* the other setting: up to 16 rows without split-k over blocks, 17-64 rows on the
     * weight-streaming kernel */
    row->prev_ms = -1;
    if (bs->op != OP_HEAD && m <= 64 &&
        kern_cuda_set_stream(&env->gpu, m <= 16, m <= 16 ? 16 : 64) == DI_OK) {
        row->prev_ms = chk_time_ms(env, bench_call, &op, op_sets < 3 ? 3 : op_sets, reps);
        kern_cuda_set_stream(&env->gpu, 0, 0);
    }
    row->gemm_ms = chk_time_ms(env, bench_call, &gemm, gemm_sets < 3 ? 3 : gemm_sets, reps);
    row->op_bytes = (double)x_bytes + y_bytes + (bs->op == OP_HEAD ? wb_bytes : wq_bytes + s_bytes);
    row->gemm_bytes = (double)x_bytes + y_bytes + wb_bytes;

    for (int s = 0; s < op_sets; s++) {
        chk_dev_free(env, (void *)op.p[s].x);
        chk_dev_free(env, (void *)op.p[s].w);
        chk_dev_free(env, (void *)op.p[s].w_scale);
        chk_dev_free(env, op.p[s].y);
    }
    for (int s = 0; s < gemm_sets; s++) {
        chk_dev_free(env, (void *)gemm.p[s].x);
        chk_dev_free(env, (void *)gemm.p[s].w);
        chk_dev_free(env, gemm.p[s].y);
    }
}

static void bench(chk_env *env)
{
    double copy = gpu_copy_gbs((size_t)1 << 30, 20);
    double peak = chk_gemm_ceiling(env);
    size_t n_rows = sizeof(bench_shapes) / sizeof(bench_shapes[0]) * (sizeof(bench_m) / sizeof(bench_m[0]));
    bench_row *rows = chk_malloc(n_rows * sizeof(*rows));
    size_t r = 0;
    const char *only = getenv("CHECK_LINEAR_BENCH"); /* names containing this, when set */
    for (size_t s = 0; s < sizeof(bench_shapes) / sizeof(bench_shapes[0]); s++)
        for (size_t i = 0; i < sizeof(bench_m) / sizeof(bench_m[0]); i++) {
            if (only && *only && !strstr(bench_shapes[s].name, only))
                continue;
            bench_shape_m(env, &bench_shapes[s], bench_m[i], &rows[r++]);
            fprintf(stderr, "bench %s m=%u done\n", bench_shapes[s].name, bench_m[i]);
        }
    kern_cuda_stats st;
    kern_cuda_get_stats(&env->gpu, &st);
    printf("\nLinear ops (whole op: FP8/FP4 up to 16 rows the weight-streaming kernel with "
           "split-k over blocks where the shape has few outputs, else quantise x + dequantise W "
           "+ cuBLASLt; other: up to 16 rows the kernel without split-k, 17-64 rows the kernel "
           "instead of cuBLASLt; GEMM: the BF16 GEMM of the same shape alone; the times are "
           "from the host's issue of the op to its end)\n");
    printf("ceilings measured now: copy %.0f GB/s, BF16 GEMM 8192^3 %.0f TFLOP/s; GB/s counts each"
           " input once and the output once;\nroof%% = max(TFLOP/s / GEMM ceiling, GB/s / copy)."
           " Inputs rotate over >= 256 MB per shape (one set when larger).\n",
           copy, peak);
    printf("%-10s %12s %5s | %9s %8s %7s %5s %8s | %9s %8s %7s %5s\n", "weight", "n x k", "m",
           "op us", "TFLOP/s", "GB/s", "roof%", "other us", "GEMM us", "TFLOP/s", "GB/s", "roof%");
    for (size_t i = 0; i < r; i++) {
        bench_row *b = &rows[i];
        if (b->op_ms <= 0 || b->gemm_ms <= 0) {
            printf("%-10s %7ux%-5u %5u | failed (message above)\n", b->name, b->n, b->k, b->m);
            continue;
        }
        double otf = b->op_flops / (b->op_ms * 1e-3) / 1e12, ogb = b->op_bytes / (b->op_ms * 1e-3) / 1e9;
        double gtf = b->op_flops / (b->gemm_ms * 1e-3) / 1e12, ggb = b->gemm_bytes / (b->gemm_ms * 1e-3) / 1e9;
        double oroof = fmax(otf / peak, ogb / copy) * 100, groof = fmax(gtf / peak, ggb / copy) * 100;
        char shape[32];
        snprintf(shape, sizeof(shape), "%ux%u", b->n, b->k);
        printf("%-10s %12s %5u | %9.1f %8.1f %7.0f %5.0f %8.1f | %9.1f %8.1f %7.0f %5.0f\n",
               b->name, shape, b->m, b->op_ms * 1e3, otf, ogb, oroof, b->prev_ms * 1e3,
               b->gemm_ms * 1e3, gtf, ggb, groof);
    }
    printf("GEMMs so far: %" PRIu64 " cuBLASLt, %" PRIu64 " plain kernel; %" PRIu64
           " cuBLASLt plans built\n",
           st.gemm_cublaslt, st.gemm_simple, st.plans_built);
    /* the routed expert's matrix in FP4 against the same matrix in FP8, on the same path */
    for (size_t i = 0; i < r; i++)
        for (size_t j = 0; j < r; j++)
            if (!strcmp(rows[i].name, "expert w1") && !strcmp(rows[j].name, "expert8 w1") &&
                rows[i].m == rows[j].m && rows[i].op_ms > 0 && rows[j].op_ms > 0)
                printf("expert w1 2304x5120, m = %u: FP4 %.1f us, FP8 %.1f us: FP4 takes %.2fx "
                       "the FP8 time (%s; the other setting %.2fx); their bytes at the copy "
                       "bandwidth: FP4 %.1f us (%.0f%% reached), FP8 %.1f us (%.0f%%)\n",
                       rows[i].m, rows[i].op_ms * 1e3, rows[j].op_ms * 1e3,
                       rows[i].op_ms / rows[j].op_ms,
                       rows[i].m <= 16 ? "both on the weight-streaming kernel"
                                       : "both dequantised, then cuBLASLt",
                       rows[j].prev_ms > 0 ? rows[i].prev_ms / rows[j].prev_ms : 0.0,
                       rows[i].op_bytes / (copy * 1e3),
                       100 * rows[i].op_bytes / (copy * 1e3) / (rows[i].op_ms * 1e3),
                       rows[j].op_bytes / (copy * 1e3),
                       100 * rows[j].op_bytes / (copy * 1e3) / (rows[j].op_ms * 1e3));
    free(rows);
}

int main(int argc, char **argv)
{
    chk_env env;
    int want_bench = chk_init(&env, argc, argv, usage);
    kern_backend simple;
    kern_cuda_config cfg = {.simple_gemm = 1};
    di_error e;
    if (kern_cuda_create(&cfg, &simple, &e) != DI_OK) {
        fprintf(stderr, "CUDA backend (plain GEMM): %s\n", e.msg);
        return 2;
    }
    sweep(&env, &simple);
    check_refusals(&env);
    for (int bi = 0; bi < 2; bi++) {
        batch_invariance(&env, OP_FP8, 512, 5120, 0, bi);
        batch_invariance(&env, OP_FP4, 2304, 5120, 0, bi);
        batch_invariance(&env, OP_BF16, 1000, 5120, 1, bi);
    }
    kern_cuda_stats st;
    kern_cuda_get_stats(&env.gpu, &st);
    printf("check_linear: %d CUDA-vs-C cases, %d with mismatches; GEMMs: %" PRIu64
           " cuBLASLt, %" PRIu64 " plain kernel (no cuBLASLt algorithm for the shape); %" PRIu64
           " FP8/FP4 calls on the weight-streaming kernel, %" PRIu64
           " launches of it split over blocks\n",
           env.checks, env.failures, st.gemm_cublaslt, st.gemm_simple, st.linear_stream,
           st.stream_split);
    if (st.linear_stream == 0 || st.stream_split == 0) {
        fprintf(stderr, "FAIL: no linear call took the weight-streaming kernel%s\n",
                st.linear_stream ? " split over blocks" : "");
        env.failures++;
    }
    kern_cuda_destroy(&simple);
    int rc = env.failures ? 1 : 0;
    if (want_bench) {
        if (rc)
            printf("\nTIMINGS OF OPS THAT FAILED THEIR CHECKS: read them as the cost only\n");
        bench(&env);
    }
    chk_fini(&env);
    return rc;
}
