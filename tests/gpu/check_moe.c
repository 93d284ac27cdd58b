/* check_moe: the CUDA backend's MoE ops against their C twins (kern_cpu_create's table), with
 * kernels.h's tolerances:
 *   moe_gate: ids exactly and weights within abs 1e-6; a differing pick is accepted only at a
 *     near-tie (the two experts' selection scores within 2 fp32 ulps), and reported;
 *   swiglu: bit for bit;
 *   moe_experts: |y - y_cpu| <= 1e-2 * max(1, |y_cpu|, rms of the row) per element and cosine
 *     >= 0.9999 per row (the hidden activations are re-quantised to FP8 inside the op, so an
 *     output small against its row can move by more than kern_linear's element bound).
 * Router inputs: N(0,1) logits at several spreads, ties (logits from a few values), NaN, huge and
 * very negative logits, with and without bias, top-k from 1 to all experts. Experts: the tiny and
 * small models' shapes and wider ones, rows 1, 3, 63, 127, repeated experts in a row, every
 * expert of a set routed or only a few, with and without the shared expert.
 * Both paths of moe_experts: the default backend (grouped path when the largest expert group
 * has at most 64 rows, in launches of groups of at most 16, with the shared expert when the call has at most 16 rows; cases on either side of it, groups of 0, 1 and many rows, widths off the
 * kernel's tiles, weights off alignment), a backend that always takes the grouped path (groups
 * past 16 rows split; its tensor-core kernel, the default), one that does so on the CUDA-core
 * kernel, and one that never does; each case checks the path taken (the backend's
 * counters) as well as the result. Up to the threshold's row count the pairs are bucketed on
 * the device (no read-back): those cases are also run on a backend that buckets on the host
 * (kern_cuda_config.moe_host_plan) and must give the same bits; the device bucketing alone is
 * compared with its C twin (kernels/cpu/moe_bucket.h) array by array, and an id out of range on
 * that path must surface at the next synchronisation.
 * With --bench: moe_experts at V4.1-Flash shapes (384 experts top-6, 5120 x 2304, the shared
 * expert; all 384 experts of one layer fit one H200: 7.2 GB) for 1, 8, 64 and 384 rows on
 * each path (the grouped one on both kernels), and the gate, next to the copy bandwidth and the BF16 GEMM ceiling of the same
 * run; GB/s counts the weights of the experts used (and the shared one) once.
 * Exit 0: all match; 1: a mismatch (parameters and first mismatches printed); 2: setup error. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/moe_bucket.h"
#include "kernels/cpu/numfmt.h"
#include "kernels/cuda/backend_cuda.h"
#include "tests/gpu/check_util.h"
#include "tests/gpu/gpu_common.h"

static const char usage[] =
    "usage: check_moe [--bench] [--seed N]\n"
    "  CUDA moe_gate, swiglu, moe_experts against the C twins; --bench adds V4.1-Flash timings\n"
    "  (CHECK_MOE_SWEEP=0 skips the checks and fails: the bench alone, for a profiler;\n"
    "  CHECK_MOE_BENCH_ROWS=N times only the calls of N rows, one of 1 8 64 384 4096 16384)\n";

#define SHOW 5

/* ---- moe_gate ---- */

typedef struct gate_case {
    uint32_t rows, experts, top_k;
    int mode;                   /* 0 N(0,1); 1 ties; 2 NaN; 3 huge and very negative */
    int bias;
    float temp;
} gate_case;

/* The twin's selection score of one expert (to judge a differing pick). */
static float gate_sel(const gate_case *gc, float z, float bias)
{
    double zt = (double)(z / gc->temp);
    double sp = zt > 0 ? zt + log1p(exp(-zt)) : log1p(exp(zt));
    float s = (float)sqrt((double)(float)sp);
    return s + bias;
}

static uint64_t g_near_ties;

static void check_gate(chk_env *env, const gate_case *gc)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    size_t nz = (size_t)gc->rows * gc->experts, nk = (size_t)gc->rows * gc->top_k;
    float *z = chk_malloc(nz * 4), *bias = chk_malloc(gc->experts * 4);
    for (size_t i = 0; i < nz; i++) {
        double v = di_rng_normal(&rng);
        z[i] = gc->mode == 1 ? (float)di_rng_below(&rng, 3) - 1.0f : (float)(v * 2.0);
        if (gc->mode == 2 && i % 53 == 7)
            z[i] = NAN;
        if (gc->mode == 3)
            z[i] = (float)(v * 60.0);
    }
    for (uint32_t e = 0; e < gc->experts; e++)
        bias[e] = gc->mode == 1 ? 0.0f : (float)(di_rng_normal(&rng) * 0.1);
    int32_t *ids = chk_malloc(nk * 4), *gids = chk_malloc(nk * 4);
    float *w = chk_malloc(nk * 4), *gw = chk_malloc(nk * 4);
    chk_poison(ids, nk * 4), chk_poison(w, nk * 4);
    char what[200];
    snprintf(what, sizeof(what), "moe_gate rows=%u experts=%u top_k=%u mode=%d bias=%d temp=%g "
             "seed=%" PRIu64, gc->rows, gc->experts, gc->top_k, gc->mode, gc->bias,
             (double)gc->temp, seed);
    float *dz = chk_dev_copy(env, z, nz * 4), *db = chk_dev_copy(env, bias, gc->experts * 4);
    int32_t *dids = chk_dev_copy(env, ids, nk * 4);
    float *dw = chk_dev_copy(env, w, nk * 4);
    kern_moe_gate p = {.n_rows = gc->rows, .n_experts = gc->experts, .top_k = gc->top_k,
                       .logits = dz, .bias = gc->bias ? db : NULL, .temp = gc->temp,
                       .route_scale = 1.5f, .ids = dids, .weights = dw};
    size_t bad = chk_gpu_status(env, env->gpu.ops.moe_gate(env->gpu.ctx, &p), what);
    chk_get(env, gids, dids, nk * 4);
    chk_get(env, gw, dw, nk * 4);
    p.logits = z, p.bias = gc->bias ? bias : NULL, p.ids = ids, p.weights = w;
    chk_cpu_status(env->cpu.ops.moe_gate(env->cpu.ctx, &p), what);
    for (uint32_t t = 0; !bad && t < gc->rows; t++) {
        int row_ok = 1;
        for (uint32_t k = 0; k < gc->top_k; k++) {
            int32_t a = ids[t * gc->top_k + k], b = gids[t * gc->top_k + k];
            if (a == b)
                continue;
            row_ok = 0;
            float sa = gate_sel(gc, z[t * gc->experts + a], gc->bias ? bias[a] : 0.0f);
            float sb = b >= 0 && (uint32_t)b < gc->experts
                           ? gate_sel(gc, z[t * gc->experts + b], gc->bias ? bias[b] : 0.0f) : NAN;
            if (fabsf(sa - sb) <= 2 * (nextafterf(fabsf(sa), INFINITY) - fabsf(sa))) {
                g_near_ties++;
                printf("note: %s row %u pick %u: cpu expert %d, gpu %d at a near-tie (%.9g vs %.9g)\n",
                       what, t, k, a, b, (double)sa, (double)sb);
            } else if (bad++ < SHOW) {
                fprintf(stderr, "MISMATCH %s: row %u pick %u: cpu expert %d (sel %.9g), gpu %d "
                        "(sel %.9g)\n", what, t, k, a, (double)sa, b, (double)sb);
            }
            break;
        }
        if (row_ok)
            bad += chk_cmp_f32_abs(what, w + t * gc->top_k, gw + t * gc->top_k, gc->top_k, 1e-6, NULL);
    }
    chk_count(env, bad);
    chk_dev_free(env, dz), chk_dev_free(env, db), chk_dev_free(env, dids), chk_dev_free(env, dw);
    free(z), free(bias), free(ids), free(gids), free(w), free(gw);
}

/* ---- swiglu ---- */

static void check_swiglu(chk_env *env, uint32_t rows, uint32_t n, uint32_t pad, int weighted,
                         float limit, int mode)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    size_t stride = (size_t)n + pad, in = rows * stride, on = (size_t)rows * n;
    uint16_t *g = chk_malloc(in * 2), *u = chk_malloc(in * 2), *h = chk_malloc(on * 2), *gh = chk_malloc(on * 2);
    float *w = chk_malloc(rows * 4);
    chk_fill_bf16(g, in, mode, &rng);
    chk_fill_bf16(u, in, mode == CHK_SPECIALS ? CHK_NORMAL : mode, &rng);
    chk_fill_f32(w, rows, 1.0, &rng);
    chk_fill_u16(h, on, CHK_POISON_BF16);
    char what[200];
    snprintf(what, sizeof(what), "swiglu rows=%u n=%u stride=%zu weighted=%d limit=%g mode=%s "
             "seed=%" PRIu64, rows, n, stride, weighted, (double)limit, chk_mode_name[mode], seed);
    uint16_t *dg = chk_dev_copy(env, g, in * 2), *du = chk_dev_copy(env, u, in * 2);
    uint16_t *dh = chk_dev_copy(env, h, on * 2);
    float *dw = chk_dev_copy(env, w, rows * 4);
    kern_swiglu p = {.n_rows = rows, .n = n, .g = dg, .u = du, .stride = stride,
                     .w = weighted ? dw : NULL, .limit = limit, .h = dh};
    size_t bad = chk_gpu_status(env, env->gpu.ops.swiglu(env->gpu.ctx, &p), what);
    chk_get(env, gh, dh, on * 2);
    p.g = g, p.u = u, p.w = weighted ? w : NULL, p.h = h;
    chk_cpu_status(env->cpu.ops.swiglu(env->cpu.ctx, &p), what);
    if (!bad)
        bad = chk_cmp_bf16_exact(what, h, gh, on);
    chk_count(env, bad);
    chk_dev_free(env, dg), chk_dev_free(env, du), chk_dev_free(env, dh), chk_dev_free(env, dw);
    free(g), free(u), free(h), free(gh), free(w);
}

/* ---- moe_experts ---- */

typedef struct expert_set {
    uint32_t n, dim, inter, shared_inter;
    uint32_t skew;              /* device weights and scales start this many bytes past an
                                 * allocation's (aligned) start */
    int low_scales;             /* experts_case.low_scales */
    kern_expert *h, *d;         /* [n] host and device weight pointers */
    kern_expert sh, sd;         /* shared expert */
    void **owned_h, **owned_d;  /* for freeing */
    uint32_t n_owned;
} expert_set;

/* One weight of `rows` x `cols`: FP4 (1x32 scales) or FP8 (32x32), random codes (no NaN) and
 * UE8M0 scales that keep |w| near 1/sqrt(cols) * a few. */
static void make_weight(chk_env *env, expert_set *s, int fp8, uint32_t rows, uint32_t cols,
                        di_rng *rng, const uint8_t **w_h, const uint8_t **sc_h,
                        const uint8_t **w_d, const uint8_t **sc_d)
{
    size_t wb = fp8 ? (size_t)rows * cols : (size_t)rows * cols / 2;
    size_t sb = fp8 ? (size_t)(rows + 31) / 32 * (cols / 32) : (size_t)rows * (cols / 32);
    uint8_t *w = chk_malloc(wb), *sc = chk_malloc(sb);
    for (size_t i = 0; i < wb; i++) {
        uint8_t b = (uint8_t)di_rng_u32(rng);
        w[i] = fp8 && (b & 0x7f) == 0x7f ? (uint8_t)(b ^ 1) : b;
    }
    int base = (int)(127 - (fp8 ? 9 : 2) - (int)round(log2(sqrt((double)cols))));
    for (size_t i = 0; i < sb; i++)
        sc[i] = (uint8_t)(base + (int)di_rng_below(rng, 3) - (s->low_scales && i % 4 == 3 ? 110 : 0));
    *w_h = w, *sc_h = sc;
    uint8_t *wd = chk_dev_alloc(env, wb + s->skew), *sd = chk_dev_alloc(env, sb + s->skew);
    chk_put(env, wd + s->skew, w, wb);
    chk_put(env, sd + s->skew, sc, sb);
    *w_d = wd + s->skew, *sc_d = sd + s->skew;
    s->owned_h[s->n_owned] = w, s->owned_d[s->n_owned++] = wd;
    s->owned_h[s->n_owned] = sc, s->owned_d[s->n_owned++] = sd;
}

static void make_expert(chk_env *env, expert_set *s, int fp8, uint32_t inter, kern_expert *h,
                        kern_expert *d, di_rng *rng)
{
    make_weight(env, s, fp8, inter, s->dim, rng, &h->w1, &h->w1_scale, &d->w1, &d->w1_scale);
    make_weight(env, s, fp8, inter, s->dim, rng, &h->w3, &h->w3_scale, &d->w3, &d->w3_scale);
    make_weight(env, s, fp8, s->dim, inter, rng, &h->w2, &h->w2_scale, &d->w2, &d->w2_scale);
}

static void experts_make(chk_env *env, expert_set *s, uint32_t n, uint32_t dim, uint32_t inter,
                         uint32_t shared_inter, uint32_t skew, int low_scales, di_rng *rng)
{
    memset(s, 0, sizeof(*s));
    s->n = n, s->dim = dim, s->inter = inter, s->shared_inter = shared_inter, s->skew = skew;
    s->low_scales = low_scales;
    s->h = chk_malloc(n * sizeof(kern_expert));
    s->d = chk_malloc(n * sizeof(kern_expert));
    s->owned_h = chk_malloc((n + 1) * 6 * sizeof(void *));
    s->owned_d = chk_malloc((n + 1) * 6 * sizeof(void *));
    for (uint32_t e = 0; e < n; e++)
        make_expert(env, s, 0, inter, &s->h[e], &s->d[e], rng);
    if (shared_inter)
        make_expert(env, s, 1, shared_inter, &s->sh, &s->sd, rng);
}

static void experts_free(chk_env *env, expert_set *s)
{
    for (uint32_t i = 0; i < s->n_owned; i++) {
        free(s->owned_h[i]);
        chk_dev_free(env, s->owned_d[i]);
    }
    free(s->h), free(s->d), free(s->owned_h), free(s->owned_d);
}

typedef struct experts_case {
    uint32_t rows, n_experts, top_k, dim, inter, shared_inter;
    uint32_t used;              /* ids drawn from the first `used` experts (0: all) */
    int repeat;                 /* a row may name the same expert twice */
    int xmode;
    uint32_t hot;               /* > 0: slot 0 of rows [0, hot) names expert 0 and no other
                                 * pick does, so expert 0's group has exactly `hot` rows */
    uint32_t skew;              /* expert_set.skew (1: weights off 4-byte alignment) */
    int low_scales;             /* 1: every fourth weight scale far below the others (2^-107
                                 * and less: the wide kernel's exact fp32 branch) */
} experts_case;

/* The backends moe_experts runs on besides env->gpu (which has the default threshold):
 * grouped path only (threshold past any group, groups above 16 rows split) and cuBLASLt path
 * only. Made in main. */
typedef struct moe_backends {
    kern_backend grouped;
    kern_backend cores;         /* grouped path only, on its CUDA-core kernel */
    kern_backend unstaged;      /* grouped path only, tensor cores without the weight staging */
    kern_backend gemm;
    kern_backend host;          /* grouped path only, the pairs always bucketed on the host */
    kern_backend perexp;        /* large buckets expert by expert (cuBLASLt) instead of the
                                 * wide kernel */
    kern_backend perexp_never;  /* the same with the grouped path off (the bench) */
    kern_backend nosplit;       /* grouped path only, no split-k over blocks (kern_cuda_config
                                 * stream_splits = 1: the previous kernel's sums) */
    kern_backend wide[KERN_CUDA_WIDE_SHAPES]; /* [i]: the wide kernel's shape i
                                 * (kern_cuda_config.moe_wide_tile; [0] unused: env->gpu) */
} moe_backends;

static moe_backends g_be;
static uint64_t g_wide_cases;   /* moe_experts cases that took the wide kernel and passed */
static uint64_t g_device_vs_host; /* moe_experts cases whose device and host plans matched */
static uint64_t g_wide_shapes;  /* wide cases whose every kernel shape gave the default's bits */

/* The wide kernel's other shapes on the call p (device memory) against the default's output gy
 * (xn elements): the same bits, as the accumulation order is the same on every shape. Returns
 * mismatches. */
static size_t wide_shapes_match(chk_env *env, const char *what, kern_moe_experts p,
                                const uint16_t *poison, const uint16_t *gy, size_t xn)
{
    static const char *const names[KERN_CUDA_WIDE_SHAPES] = {
        "default", "first version (byte table)", "64x64 warps"};
    uint16_t *oy = chk_malloc(xn * 2);
    size_t bad = 0;
    for (int v = 1; v < KERN_CUDA_WIDE_SHAPES && !bad; v++) {
        kern_backend *be = &g_be.wide[v];
        kern_cuda_stats s0, s1;
        kern_cuda_get_stats(be, &s0);
        chk_put(env, p.y, poison, xn * 2);
        di_error err;
        if (be->ops.moe_experts(be->ctx, &p) != DI_OK || kern_cuda_sync(be, &err) != DI_OK) {
            fprintf(stderr, "FAIL %s: wide kernel shape %s: %s\n", what, names[v],
                    kern_cuda_last_error(be));
            bad++;
            break;
        }
        kern_cuda_get_stats(be, &s1);
        if (s1.moe_wide - s0.moe_wide != 1) {
            fprintf(stderr, "MISMATCH %s: shape %s did not take the wide kernel\n", what, names[v]);
            bad++;
        }
        chk_get(env, oy, p.y, xn * 2);
        for (size_t i = 0; !bad && i < xn; i++)
            if (oy[i] != gy[i]) {
                fprintf(stderr, "MISMATCH %s: y[%zu] wide shape %s 0x%04x, default 0x%04x\n", what,
                        i, names[v], oy[i], gy[i]);
                bad++;
            }
    }
    free(oy);
    return bad;
}

/* The path a backend must take: grouped when the call's rows (bucketed on the device) or its
 * largest group (bucketed on the host) are within its threshold. */
static int expect_grouped(const int32_t *ids, size_t n, uint32_t experts, int threshold,
                          uint32_t rows)
{
    if (threshold > 0 && rows <= (uint32_t)threshold)
        return 1;
    uint32_t *count = calloc(experts, sizeof(uint32_t)), max = 0;
    if (!count)
        return -1;
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= 0 && (uint32_t)ids[i] < experts && ++count[ids[i]] > max)
            max = count[ids[i]];
    free(count);
    return threshold > 0 && max <= (uint32_t)threshold;
}

/* Threshold of each backend of the checks (kern_cuda_config.moe_grouped_rows resolved). */
#define THR_DEFAULT 64
#define THR_ALWAYS (1 << 30)
#define THR_NEVER 0

/* moe_experts' tolerance (kernels.h): per element |y - y_cpu| <= 1e-2 * max(1, |y_cpu|, rms of
 * the row of y_cpu), per row cosine >= 0.9999. Returns mismatches; keeps the worst ratio of an
 * element's error to its bound, the worst cosine and the worst row error norm relative to the
 * row's norm. */
static size_t cmp_expert_rows(const char *what, const uint16_t *c, const uint16_t *g, uint32_t rows,
                              uint32_t n, double *worst_ratio, double *worst_cos, double *worst_rel)
{
    size_t bad = 0;
    for (uint32_t r = 0; r < rows; r++) {
        const uint16_t *cr = c + (size_t)r * n, *gr = g + (size_t)r * n;
        double dot = 0, nc = 0, ng = 0, ne = 0;
        for (uint32_t j = 0; j < n; j++) {
            double x = di_bf16_to_f32(cr[j]), y = di_bf16_to_f32(gr[j]);
            dot += x * y, nc += x * x, ng += y * y, ne += (x - y) * (x - y);
        }
        double rms = sqrt(nc / n), floor = rms > 1 ? rms : 1;
        for (uint32_t j = 0; j < n; j++) {
            double x = di_bf16_to_f32(cr[j]), y = di_bf16_to_f32(gr[j]);
            double tol = 1e-2 * (fabs(x) > floor ? fabs(x) : floor);
            int ok = isfinite(x) && isfinite(y) ? fabs(x - y) <= tol : (isnan(x) && isnan(y)) || x == y;
            if (isfinite(x) && isfinite(y) && fabs(x - y) / tol > *worst_ratio)
                *worst_ratio = fabs(x - y) / tol;
            if (!ok && bad++ < SHOW)
                fprintf(stderr, "MISMATCH %s: y[%u][%u] cpu %.6g gpu %.6g (tolerance %.3g, row rms "
                        "%.3g)\n", what, r, j, x, y, tol, rms);
        }
        double cs = nc == 0 && ng == 0 ? 1.0 : dot / sqrt(nc * ng);
        if (!(cs >= 0.9999) && isfinite(nc) && isfinite(ng) && bad++ < SHOW)
            fprintf(stderr, "MISMATCH %s: row %u cosine %.7f < 0.9999\n", what, r, cs);
        if (isfinite(cs) && cs < *worst_cos)
            *worst_cos = cs;
        if (nc > 0 && isfinite(ne) && sqrt(ne / nc) > *worst_rel)
            *worst_rel = sqrt(ne / nc);
    }
    return bad;
}

static void check_experts(chk_env *env, kern_backend *be, int threshold, const experts_case *ec,
                          double *worst)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    expert_set es;
    experts_make(env, &es, ec->n_experts, ec->dim, ec->inter, ec->shared_inter, ec->skew,
                 ec->low_scales, &rng);
    size_t xn = (size_t)ec->rows * ec->dim, nk = (size_t)ec->rows * ec->top_k;
    uint16_t *x = chk_malloc(xn * 2), *y = chk_malloc(xn * 2), *gy = chk_malloc(xn * 2);
    chk_fill_bf16(x, xn, ec->xmode, &rng);
    chk_fill_u16(y, xn, CHK_POISON_BF16);
    int32_t *ids = chk_malloc(nk * 4);
    float *w = chk_malloc(nk * 4);
    uint32_t pool = ec->used ? ec->used : ec->n_experts;
    int repeat = ec->repeat || pool < ec->top_k; /* distinct picks need enough experts */
    for (uint32_t t = 0; t < ec->rows; t++)
        for (uint32_t k = 0; k < ec->top_k; k++) {
            int32_t e;
            int again;
            int hot = ec->hot && t < ec->hot && k == 0;
            do { /* distinct within a row unless repeats are asked for */
                e = hot ? 0 : (int32_t)(ec->hot ? 1 + di_rng_below(&rng, pool - 1)
                                                : di_rng_below(&rng, pool));
                again = 0;
                for (uint32_t j = 0; j < k && !repeat; j++)
                    again |= ids[t * ec->top_k + j] == e;
            } while (again);
            ids[t * ec->top_k + k] = e;
            w[t * ec->top_k + k] = (float)(0.2 + di_rng_uniform(&rng));
        }
    int want_grouped = expect_grouped(ids, nk, ec->n_experts, threshold, ec->rows);
    int want_device = be != &g_be.host && threshold > 0 && ec->rows <= (uint32_t)threshold;
    /* past the grouped path: the wide kernel unless turned off, widths off its 64-input step,
     * or weights off 16-byte alignment */
    int want_wide = want_grouped == 0 && be != &g_be.perexp && ec->dim % 64 == 0 &&
                    ec->inter % 64 == 0 && ec->skew % 16 == 0;
    char what[320];
    snprintf(what, sizeof(what), "moe_experts rows=%u experts=%u top_k=%u dim=%u inter=%u "
             "shared_inter=%u used=%u repeat=%d hot=%u skew=%u x=%s path=%s seed=%" PRIu64,
             ec->rows, ec->n_experts, ec->top_k, ec->dim, ec->inter, ec->shared_inter, pool,
             ec->repeat, ec->hot, ec->skew, chk_mode_name[ec->xmode],
             want_grouped ? (want_device ? "grouped, device plan" : "grouped")
                          : (want_wide ? "wide" : "cublaslt"), seed);
    uint16_t *dx = chk_dev_copy(env, x, xn * 2), *dy = chk_dev_copy(env, y, xn * 2);
    int32_t *dids = chk_dev_copy(env, ids, nk * 4);
    float *dw = chk_dev_copy(env, w, nk * 4);
    kern_moe_experts p = {.n_rows = ec->rows, .dim = ec->dim, .inter = ec->inter,
                          .shared_inter = ec->shared_inter, .n_experts = ec->n_experts,
                          .top_k = ec->top_k, .x = dx, .ids = dids, .weights = dw,
                          .experts = es.d, .shared = es.sd, .swiglu_limit = 10.0f, .y = dy};
    kern_cuda_stats s0, s1;
    kern_cuda_get_stats(be, &s0);
    di_status st = be->ops.moe_experts(be->ctx, &p);
    size_t bad = st != DI_OK;
    if (st != DI_OK)
        fprintf(stderr, "FAIL %s: CUDA op returned %s: %s\n", what, di_status_name(st),
                kern_cuda_last_error(be));
    di_error err;
    if (kern_cuda_sync(be, &err) != DI_OK && bad++ < SHOW)
        fprintf(stderr, "MISMATCH %s: %s\n", what, err.msg);
    kern_cuda_get_stats(be, &s1);
    uint64_t got_grouped = s1.moe_grouped - s0.moe_grouped, got_gemm = s1.moe_gemm - s0.moe_gemm;
    uint64_t got_device = s1.moe_device_plan - s0.moe_device_plan;
    uint64_t got_wide = s1.moe_wide - s0.moe_wide;
    if (!bad && (got_grouped != (uint64_t)(want_grouped == 1) ||
                 got_gemm != (uint64_t)(want_grouped == 0) ||
                 got_device != (uint64_t)want_device || got_wide != (uint64_t)want_wide)) {
        fprintf(stderr, "MISMATCH %s: took %" PRIu64 " grouped (%" PRIu64 " planned on the device), "
                "%" PRIu64 " cuBLASLt-path calls (%" PRIu64 " on the wide kernel)\n", what,
                got_grouped, got_device, got_gemm, got_wide);
        bad++;
    }
    chk_get(env, gy, dy, xn * 2);
    /* the device plan against the host plan on the same kernel: the same bits */
    if (!bad && want_device && (be == &env->gpu || be == &g_be.grouped)) {
        uint16_t *hy = chk_malloc(xn * 2);
        chk_put(env, dy, y, xn * 2); /* poisoned again */
        di_status hs = g_be.host.ops.moe_experts(g_be.host.ctx, &p);
        if (hs != DI_OK || kern_cuda_sync(&g_be.host, &err) != DI_OK) {
            fprintf(stderr, "FAIL %s: host-planned op: %s\n", what, kern_cuda_last_error(&g_be.host));
            bad++;
        }
        chk_get(env, hy, dy, xn * 2);
        for (size_t i = 0; !bad && i < xn; i++)
            if (hy[i] != gy[i]) {
                fprintf(stderr, "MISMATCH %s: y[%zu] device plan 0x%04x, host plan 0x%04x\n", what,
                        i, gy[i], hy[i]);
                bad++;
            }
        g_device_vs_host += !bad;
        free(hy);
    }
    if (!bad && want_wide && be == &env->gpu) {
        bad += wide_shapes_match(env, what, p, y, gy, xn);
        g_wide_shapes += !bad;
    }
    p.x = x, p.ids = ids, p.weights = w, p.experts = es.h, p.shared = es.sh, p.y = y;
    chk_cpu_status(env->cpu.ops.moe_experts(env->cpu.ctx, &p), what);
    if (!bad)
        bad = cmp_expert_rows(what, y, gy, ec->rows, ec->dim, &worst[0], &worst[1], &worst[2]);
    g_wide_cases += want_wide && !bad;
    chk_count(env, bad);
    chk_dev_free(env, dx), chk_dev_free(env, dy), chk_dev_free(env, dids), chk_dev_free(env, dw);
    experts_free(env, &es);
    free(x), free(y), free(gy), free(ids), free(w);
}

/* ---- the device bucketing against its twin ---- */


typedef struct bucket_case {
    uint32_t rows, top_k, experts, cap;
    uint32_t used;              /* ids drawn from the first `used` experts (0: all) */
    int repeat;                 /* a row may name an expert twice */
} bucket_case;

static size_t cmp_u32(const char *what, const char *name, const void *a, const void *b, size_t n)
{
    const uint32_t *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i]) {
            fprintf(stderr, "MISMATCH %s: %s[%zu] twin %u device %u\n", what, name, i, x[i], y[i]);
            return 1;
        }
    return 0;
}

static void check_bucket(chk_env *env, const bucket_case *bc)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    const uint32_t P = bc->rows * bc->top_k, E = bc->experts, pool = bc->used ? bc->used : E;
    const uint32_t G = kern_moe_max_groups(P, E, bc->cap);
    int32_t *ids = chk_malloc((size_t)P * 4);
    for (uint32_t t = 0; t < bc->rows; t++)
        for (uint32_t k = 0; k < bc->top_k; k++) {
            int32_t e;
            int again;
            do {
                e = (int32_t)di_rng_below(&rng, pool);
                again = 0;
                for (uint32_t j = 0; j < k && !bc->repeat; j++)
                    again |= ids[t * bc->top_k + j] == e;
            } while (again);
            ids[t * bc->top_k + k] = e;
        }
    char what[200];
    snprintf(what, sizeof(what), "moe bucket rows=%u top_k=%u experts=%u used=%u cap=%u "
             "repeat=%d seed=%" PRIu64, bc->rows, bc->top_k, E, pool, bc->cap, bc->repeat, seed);
    /* the twin */
    size_t sizes[8] = {E * 4u, (E + 1) * 4u, P * 4u, P * 4u, G * 4u, G * 4u, G * 4u, 4};
    void *h[8], *d[8], *g[8];
    for (int i = 0; i < 8; i++) {
        h[i] = chk_malloc(sizes[i] ? sizes[i] : 4), g[i] = chk_malloc(sizes[i] ? sizes[i] : 4);
        d[i] = chk_dev_alloc(env, sizes[i] ? sizes[i] : 4);
        chk_poison(g[i], sizes[i]);
        chk_put(env, d[i], g[i], sizes[i]);
    }
    kern_moe_buckets tw = {h[0], h[1], h[2], h[3], h[4], h[5], h[6], 0};
    di_error err;
    size_t bad = 0;
    if (kern_moe_bucket(ids, bc->rows, bc->top_k, E, bc->cap, &tw, &err) != DI_OK) {
        fprintf(stderr, "FAIL %s: twin: %s\n", what, err.msg);
        bad++;
    }
    int32_t *dids = chk_dev_copy(env, ids, (size_t)P * 4);
    kern_cuda_buckets out = {d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]};
    if (kern_cuda_moe_bucket(&env->gpu, dids, bc->rows, bc->top_k, E, bc->cap, &out, &err) != DI_OK ||
        kern_cuda_sync(&env->gpu, &err) != DI_OK) {
        fprintf(stderr, "FAIL %s: device: %s\n", what, err.msg);
        bad++;
    }
    for (int i = 0; i < 8; i++)
        chk_get(env, g[i], d[i], sizes[i]);
    uint32_t n_groups = *(uint32_t *)g[7];
    if (!bad && n_groups != tw.n_groups) {
        fprintf(stderr, "MISMATCH %s: %u groups on the device, %u by the twin\n", what, n_groups,
                tw.n_groups);
        bad++;
    }
    static const char *names[] = {"count", "start", "pair", "pos", "group_expert", "group_start",
                                  "group_rows"};
    for (int i = 0; i < 7 && !bad; i++) {
        size_t n = i < 4 ? sizes[i] / 4 : tw.n_groups;
        bad += cmp_u32(what, names[i], h[i], g[i], n);
    }
    if (!bad && tw.n_groups > G) {
        fprintf(stderr, "MISMATCH %s: %u groups past the bound %u\n", what, tw.n_groups, G);
        bad++;
    }
    chk_count(env, bad);
    for (int i = 0; i < 8; i++)
        free(h[i]), free(g[i]), chk_dev_free(env, d[i]);
    chk_dev_free(env, dids);
    free(ids);
}

/* An id out of range on the device-planned path: the op cannot refuse it (it never reads the
 * ids), so the next synchronisation reports it, once. */
static size_t check_bucket_bad_id(chk_env *env)
{
    di_rng rng;
    chk_case_rng(env, &rng);
    expert_set es;
    experts_make(env, &es, 8, 64, 64, 0, 0, 0, &rng);
    size_t bad = 0;
    int32_t ids[4] = {0, 1, 2, 8};
    float w[4] = {1, 1, 1, 1};
    uint16_t *dx = chk_dev_alloc(env, 2 * 64 * 2), *dy = chk_dev_alloc(env, 2 * 64 * 2);
    int32_t *dids = chk_dev_copy(env, ids, sizeof(ids));
    float *dw = chk_dev_copy(env, w, sizeof(w));
    kern_moe_experts p = {.n_rows = 2, .dim = 64, .inter = 64, .n_experts = 8, .top_k = 2,
                          .x = dx, .ids = dids, .weights = dw, .experts = es.d,
                          .swiglu_limit = 10.0f, .y = dy};
    di_error err;
    bad += chk_expect(env, env->gpu.ops.moe_experts(env->gpu.ctx, &p), DI_OK,
                      "moe_experts id 8 of 8 on the device plan (queued)");
    bad += chk_expect(env, kern_cuda_sync(&env->gpu, &err), DI_EINVAL,
                      "the sync after it reports the id");
    bad += chk_expect(env, kern_cuda_sync(&env->gpu, &err), DI_OK, "and only once");
    chk_dev_free(env, dx), chk_dev_free(env, dy), chk_dev_free(env, dids), chk_dev_free(env, dw);
    experts_free(env, &es);
    return bad;
}

static void check_buckets(chk_env *env)
{
    static const bucket_case bcs[] = {
        {1, 6, 384, 1, 0, 0},   {8, 6, 384, 8, 0, 0},   {64, 6, 384, 8, 0, 0},
        {64, 6, 384, 16, 8, 0}, {3, 4, 16, 2, 0, 1},    {127, 2, 8, 16, 0, 0},
        {5, 5, 5, 3, 1, 1},     {33, 8, 4096, 8, 0, 0}, {1, 1, 1, 1, 0, 0},
        {40, 3, 7, 1, 0, 1},
    };
    int c0 = env->checks;
    for (size_t i = 0; i < sizeof(bcs) / sizeof(bcs[0]); i++)
        check_bucket(env, &bcs[i]);
    size_t bad = check_bucket_bad_id(env);
    chk_count(env, bad);
    printf("moe bucketing on the device: %d cases against the twin, a bad id %s\n",
           env->checks - c0, bad ? "NOT REPORTED" : "reported at the next synchronisation");
}

/* ---- refused inputs ---- */

static void check_refusals(chk_env *env)
{
    kern_ops *o = &env->gpu.ops;
    void *c = env->gpu.ctx;
    uint8_t *d = chk_dev_alloc(env, 1 << 16);
    size_t bad = 0;
    kern_moe_gate g = {.n_rows = 1, .n_experts = 8, .top_k = 9, .logits = (float *)d,
                       .temp = 1.0f, .route_scale = 1.5f, .ids = (int32_t *)(d + 4096),
                       .weights = (float *)(d + 8192)};
    bad += chk_expect(env, o->moe_gate(c, NULL), DI_EINVAL, "moe_gate(NULL)");
    bad += chk_expect(env, o->moe_gate(c, &g), DI_EINVAL, "moe_gate top_k 9 of 8");
    g.top_k = 2, g.n_experts = 5000;
    bad += chk_expect(env, o->moe_gate(c, &g), DI_EINVAL, "moe_gate 5000 experts");
    kern_swiglu sw = {.n_rows = 1, .n = 64, .g = (uint16_t *)d, .u = (uint16_t *)d, .stride = 32,
                      .h = (uint16_t *)(d + 4096)};
    bad += chk_expect(env, o->swiglu(c, &sw), DI_EINVAL, "swiglu stride 32 < n 64");
    /* ids outside the experts: the op reads them back and refuses */
    int32_t ids[2] = {0, 8};
    chk_put(env, d + 16384, ids, sizeof(ids));
    kern_expert ex[8];
    memset(ex, 0, sizeof(ex));
    kern_moe_experts me = {.n_rows = 1, .dim = 32, .inter = 32, .n_experts = 8, .top_k = 2,
                           .x = (uint16_t *)d, .ids = (int32_t *)(d + 16384),
                           .weights = (float *)(d + 8192), .experts = ex, .y = (uint16_t *)(d + 32768)};
    bad += chk_expect(env, o->moe_experts(c, &me), DI_EINVAL, "moe_experts id 8 of 8");
    ids[1] = 1;
    chk_put(env, d + 16384, ids, sizeof(ids));
    bad += chk_expect(env, o->moe_experts(c, &me), DI_EINVAL, "moe_experts routed to NULL weights");
    me.dim = 48;
    bad += chk_expect(env, o->moe_experts(c, &me), DI_EINVAL, "moe_experts dim 48");
    g.n_experts = 8;
    bad += chk_expect(env, o->moe_gate(c, &g), DI_OK, "moe_gate after refusals");
    chk_sync(env);
    chk_count(env, bad);
    printf("refused inputs: %s\n", bad ? "MISMATCHES" : "all refused with DI_EINVAL");
    chk_dev_free(env, d);
}

/* ---- the sweep ---- */

static void sweep(chk_env *env)
{
    static const gate_case gates[] = {
        {1, 384, 6, 0, 1, 1.0f},  {3, 384, 6, 1, 0, 1.0f},  {63, 384, 6, 2, 1, 1.0f},
        {127, 128, 3, 0, 1, 1.0f}, {5, 8, 2, 3, 1, 1.0f},   {7, 16, 4, 0, 0, 0.7f},
        {9, 5, 5, 1, 1, 1.0f},    {4, 1, 1, 0, 1, 1.0f},    {33, 4096, 8, 0, 1, 1.0f},
        {2, 384, 6, 3, 0, 2.0f},
    };
    int c0 = env->checks;
    for (size_t i = 0; i < sizeof(gates) / sizeof(gates[0]); i++)
        check_gate(env, &gates[i]);
    printf("moe_gate: %d cases, %" PRIu64 " picks differing at near-ties\n", env->checks - c0,
           g_near_ties);
    c0 = env->checks;
    static const uint32_t sw_rows[] = {1, 3, 63, 127};
    for (int mode = 0; mode < CHK_MODES; mode++)
        for (size_t r = 0; r < 4; r++)
            check_swiglu(env, sw_rows[r], r % 2 ? 2304 : 64, r == 2 ? 7 : 0, (mode + (int)r) % 2,
                         mode == CHK_ONES ? 0.0f : 10.0f, mode);
    printf("swiglu: %d cases\n", env->checks - c0);
    c0 = env->checks;
    static const experts_case ecs[] = {
        {1, 8, 2, 128, 64, 64, 0, 0, CHK_NORMAL, 0, 0, 0},
        {3, 8, 2, 128, 64, 64, 0, 1, CHK_EDGES, 0, 0, 0},
        {63, 16, 4, 256, 128, 128, 0, 0, CHK_NORMAL, 0, 0, 0},
        {127, 8, 2, 128, 64, 64, 0, 0, CHK_ARANGE, 0, 0, 0},
        {5, 64, 6, 1024, 512, 512, 0, 0, CHK_NORMAL, 0, 0, 0},
        {63, 64, 6, 1024, 512, 512, 0, 0, CHK_LARGE, 0, 0, 0},
        {17, 32, 6, 512, 256, 0, 7, 0, CHK_NORMAL, 0, 0, 0},
        {2, 4, 3, 96, 32, 32, 0, 1, CHK_ZEROS, 0, 0, 0},
        {9, 16, 4, 256, 128, 128, 0, 0, CHK_TINY, 0, 0, 0},
        /* a group of one launch's 16 rows and one split in two; the default threshold (64 rows
         * in the largest group) from both sides */
        {16, 64, 6, 256, 128, 128, 0, 0, CHK_NORMAL, 16, 0, 0},
        {17, 64, 6, 256, 128, 128, 0, 0, CHK_NORMAL, 17, 0, 0},
        {64, 64, 6, 256, 128, 128, 0, 0, CHK_NORMAL, 64, 0, 0},
        {65, 64, 6, 256, 128, 128, 0, 0, CHK_NORMAL, 65, 0, 0},
        /* one row over many experts (most with no rows); widths off the 64-output tile and
         * the 256-input step; weights off 4-byte alignment; V4.1-Flash widths */
        {1, 384, 6, 128, 64, 64, 0, 0, CHK_NORMAL, 0, 0, 0},
        {3, 16, 4, 160, 96, 64, 0, 0, CHK_EDGES, 0, 0, 0},
        {8, 32, 4, 96, 32, 32, 0, 0, CHK_NORMAL, 0, 1, 0},
        {4, 8, 2, 5120, 2304, 0, 0, 0, CHK_NORMAL, 0, 0, 0},
    };
    /* grouped path forced: groups past 16 rows split into several */
    static const experts_case grouped[] = {
        {63, 16, 4, 256, 128, 128, 4, 0, CHK_NORMAL, 0, 0, 0},
        {127, 8, 2, 128, 64, 64, 0, 0, CHK_ARANGE, 0, 0, 0},
        {40, 8, 2, 96, 32, 32, 0, 1, CHK_LARGE, 0, 1, 0},
        {32, 64, 6, 256, 128, 0, 0, 0, CHK_NORMAL, 32, 0, 0},
        {5, 8, 2, 128, 64, 0, 0, 0, CHK_SPECIALS, 0, 0, 0},
    };
    /* cuBLASLt path forced on small groups */
    static const experts_case gemm[] = {
        {3, 64, 6, 256, 128, 128, 0, 0, CHK_NORMAL, 0, 0, 0},
        {1, 8, 2, 128, 64, 64, 0, 0, CHK_EDGES, 0, 0, 0},
    };
    double worst[3] = {0, 1, 0}; /* |err|/tolerance, row cosine, row relative error */
    for (size_t i = 0; i < sizeof(ecs) / sizeof(ecs[0]); i++)
        check_experts(env, &env->gpu, THR_DEFAULT, &ecs[i], worst);
    for (size_t i = 0; i < sizeof(grouped) / sizeof(grouped[0]); i++) {
        check_experts(env, &g_be.grouped, THR_ALWAYS, &grouped[i], worst);
        check_experts(env, &g_be.cores, THR_ALWAYS, &grouped[i], worst);
        check_experts(env, &g_be.unstaged, THR_ALWAYS, &grouped[i], worst);
        check_experts(env, &g_be.host, THR_ALWAYS, &grouped[i], worst);
        check_experts(env, &g_be.nosplit, THR_ALWAYS, &grouped[i], worst);
    }
    for (size_t i = 0; i < sizeof(gemm) / sizeof(gemm[0]); i++)
        check_experts(env, &g_be.gemm, THR_NEVER, &gemm[i], worst);
    /* prefill-sized buckets (past the default threshold): the wide kernel by default, expert
     * by expert on cuBLASLt when turned off. Buckets split into 128-row tiles, outputs off the
     * 128-output block (192, 320), weight scales on the exact fp32 branch, x with specials,
     * V4.1-Flash widths, weights off 16-byte alignment (cuBLASLt path) */
    static const experts_case wide[] = {
        {600, 4, 2, 256, 192, 64, 0, 0, CHK_NORMAL, 0, 0, 0},
        {300, 16, 2, 320, 128, 64, 0, 0, CHK_LARGE, 200, 0, 0},
        {200, 8, 3, 1024, 512, 256, 0, 0, CHK_NORMAL, 0, 0, 1},
        {150, 4, 2, 128, 64, 0, 0, 0, CHK_SPECIALS, 150, 0, 0},
        {129, 4, 1, 5120, 2304, 0, 0, 0, CHK_NORMAL, 129, 0, 0},
        {100, 4, 2, 128, 64, 64, 0, 0, CHK_NORMAL, 100, 1, 0},
    };
    uint64_t wide0 = g_wide_cases;
    for (size_t i = 0; i < sizeof(wide) / sizeof(wide[0]); i++) {
        check_experts(env, &env->gpu, THR_DEFAULT, &wide[i], worst);
        check_experts(env, &g_be.perexp, THR_DEFAULT, &wide[i], worst);
    }
    printf("moe_experts: %" PRIu64 " cases on the wide kernel, %" PRIu64 " of them the same bits "
           "on its %d other shapes\n", g_wide_cases - wide0, g_wide_shapes,
           KERN_CUDA_WIDE_SHAPES - 1);
    if (g_wide_cases == wide0 || g_wide_shapes == 0) {
        fprintf(stderr, "FAIL moe_experts: no case took the wide kernel on every shape\n");
        chk_count(env, 1);
    }
    printf("moe_experts: %d cases (both paths, the grouped one on tensor cores staged and not, and on CUDA cores); worst |err|/tolerance %.3g, worst row cosine "
           "%.7f, worst row |y - y_cpu| / |y_cpu| %.3g\n", env->checks - c0, worst[0], worst[1],
           worst[2]);
    printf("moe_experts: %" PRIu64 " cases planned on the device gave the host plan's bits\n",
           g_device_vs_host);
    /* split-k over blocks taken by the default backend, never by the one without it */
    kern_cuda_stats sd, sn;
    kern_cuda_get_stats(&env->gpu, &sd);
    kern_cuda_get_stats(&g_be.nosplit, &sn);
    printf("moe_experts: %" PRIu64 " weight-streaming launches split over blocks (default "
           "backend), %" PRIu64 " without split-k\n", sd.stream_split, sn.stream_split);
    if (sd.stream_split == 0 || sn.stream_split != 0) {
        fprintf(stderr, "FAIL moe_experts: split-k over blocks taken %" PRIu64 " times by default, "
                "%" PRIu64 " times with stream_splits = 1\n", sd.stream_split, sn.stream_split);
        chk_count(env, 1);
    }
    check_refusals(env);
    check_buckets(env);
}

/* ---- benchmark: V4.1-Flash ---- */

enum { B_E = 384, B_K = 6, B_D = 5120, B_I = 2304 };

typedef struct bench_arg {
    chk_env *env;
    kern_moe_experts p;
    kern_moe_gate g;
    int op;                     /* BENCH_OPS */
} bench_arg;

/* The timed ops: moe_experts forced onto each path, then moe_gate. */
enum { OP_MMA, OP_NOSPLIT, OP_HOST, OP_UNSTAGED, OP_CORES, OP_GEMM, OP_FIRST, OP_W64,
       OP_PEREXP, OP_GATE, BENCH_OPS };

static di_status bench_call(void *arg, int i)
{
    bench_arg *b = arg;
    kern_backend *g = &b->env->gpu;
    return b->op != OP_GATE ? g->ops.moe_experts(g->ctx, &b->p) : g->ops.moe_gate(g->ctx, &b->g);
}

static void bench(chk_env *env)
{
    double copy = gpu_copy_gbs((size_t)1 << 30, 20);
    double peak = chk_gemm_ceiling(env);
    di_rng rng;
    chk_case_rng(env, &rng);
    /* one expert's random FP4 weights, copied to all 384 (L2 holds none of them) */
    size_t w13 = (size_t)B_I * B_D / 2, w2 = (size_t)B_D * B_I / 2;
    size_t s13 = (size_t)B_I * (B_D / 32), s2 = (size_t)B_D * (B_I / 32);
    size_t per = 2 * (w13 + s13) + w2 + s2;
    uint8_t *h = chk_malloc(per);
    for (size_t i = 0; i < per; i++)
        h[i] = (uint8_t)di_rng_u32(&rng);
    for (size_t i = 2 * w13; i < 2 * w13 + 2 * s13; i++)
        h[i] = (uint8_t)(122 + di_rng_below(&rng, 3));
    for (size_t i = 2 * w13 + 2 * s13 + w2; i < per; i++)
        h[i] = (uint8_t)(122 + di_rng_below(&rng, 3));
    uint8_t *all = chk_dev_alloc(env, per * B_E);
    chk_put(env, all, h, per);
    for (uint32_t e = 1; e < B_E; e++) /* device to device */
        chk_put(env, all + per * e, all, per);
    kern_expert *ex = chk_malloc(B_E * sizeof(kern_expert));
    for (uint32_t e = 0; e < B_E; e++) {
        uint8_t *b = all + per * e;
        ex[e] = (kern_expert){.w1 = b, .w3 = b + w13, .w1_scale = b + 2 * w13,
                              .w3_scale = b + 2 * w13 + s13, .w2 = b + 2 * w13 + 2 * s13,
                              .w2_scale = b + 2 * w13 + 2 * s13 + w2};
    }
    size_t sh8 = (size_t)B_I * B_D, shs = (size_t)(B_I / 32) * (B_D / 32);
    uint8_t *hs = chk_malloc(3 * (sh8 + shs));
    for (size_t i = 0; i < 3 * (sh8 + shs); i++)
        hs[i] = (uint8_t)(i % (sh8 + shs) < sh8 ? (di_rng_u32(&rng) & 0x7e) : 115);
    uint8_t *sd = chk_dev_copy(env, hs, 3 * (sh8 + shs));
    kern_expert shared = {.w1 = sd, .w1_scale = sd + sh8, .w3 = sd + sh8 + shs,
                          .w3_scale = sd + 2 * sh8 + shs, .w2 = sd + 2 * (sh8 + shs),
                          .w2_scale = sd + 3 * sh8 + 2 * shs};
    free(h), free(hs);
    printf("\nmoe_experts at V4.1-Flash shapes: 384 routed FP4 experts top-6 (5120 x 2304), one "
           "shared FP8 expert; all 384 experts of one layer on this GPU (%.1f GB of weights)\n"
           "ceilings measured now: copy %.0f GB/s, BF16 GEMM 8192^3 %.0f TFLOP/s; bytes = the "
           "weights of the experts used, read once\n", (double)(per * B_E + 3 * (sh8 + shs)) / 1e9,
           copy, peak);
    printf("moe_experts grouped / cublaslt: the routed experts forced onto one path (the "
           "default takes the grouped one when the largest group has at most %d rows); grouped: "
           "the pairs bucketed on the device (no read-back), host plan: read back and bucketed "
           "on the host\n", THR_DEFAULT);
    printf("%-22s %5s %7s %9s %10s %9s %7s %7s %7s\n", "op", "rows", "experts", "max group", "us",
           "TFLOP/s", "GB/s", "of GEMM", "of copy");
    printf("moe_experts cublaslt: the pairs bucketed on the host, the routed experts on the wide "
           "kernel (moe_wide.cu: blocks of 128 x 128, warps of 64 x 32, FP4 by byte permutes); "
           "wide first version: FP4 pairs from a byte table in shared memory, the other wide "
           "rows its other shapes (kern_cuda_config.moe_wide_tile); per-expert: expert by "
           "expert on the linear path (dequantised weight, cuBLASLt BF16 GEMM), as before the "
           "wide kernel; prefill sizes (4,096 and 16,384 rows) time only these and the gate\n");
    static const uint32_t rows_list[] = {1, 8, 64, 384, 4096, 16384};
    const char *only = getenv("CHECK_MOE_BENCH_ROWS");
    for (int r = 0; r < 6; r++) {
        uint32_t T = rows_list[r];
        if (only && *only && strtoul(only, NULL, 10) != T)
            continue;
        size_t nk = (size_t)T * B_K;
        int32_t *ids = chk_malloc(nk * 4);
        float *w = chk_malloc(nk * 4);
        uint8_t used[B_E] = {0};
        uint32_t n_used = 0, group[B_E] = {0}, max_group = 0;
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t k = 0; k < B_K; k++) {
                int32_t e;
                int again;
                do {
                    e = (int32_t)di_rng_below(&rng, B_E);
                    again = 0;
                    for (uint32_t j = 0; j < k; j++)
                        again |= ids[t * B_K + j] == e;
                } while (again);
                ids[t * B_K + k] = e;
                w[t * B_K + k] = 1.0f / B_K;
                n_used += !used[e];
                used[e] = 1;
                max_group = ++group[e] > max_group ? group[e] : max_group;
            }
        uint16_t *hx = chk_malloc((size_t)T * B_D * 2);
        chk_fill_bf16_fast(hx, (size_t)T * B_D, 1.0f, &rng);
        float *hz = chk_malloc((size_t)T * B_E * 4);
        chk_fill_f32(hz, (size_t)T * B_E, 1.0, &rng);
        bench_arg b = {.env = env};
        b.p = (kern_moe_experts){.n_rows = T, .dim = B_D, .inter = B_I, .shared_inter = B_I,
                                 .n_experts = B_E, .top_k = B_K,
                                 .x = chk_dev_copy(env, hx, (size_t)T * B_D * 2),
                                 .ids = chk_dev_copy(env, ids, nk * 4),
                                 .weights = chk_dev_copy(env, w, nk * 4), .experts = ex,
                                 .shared = shared, .swiglu_limit = 10.0f,
                                 .y = chk_dev_alloc(env, (size_t)T * B_D * 2)};
        b.g = (kern_moe_gate){.n_rows = T, .n_experts = B_E, .top_k = B_K,
                              .logits = chk_dev_copy(env, hz, (size_t)T * B_E * 4), .temp = 1.0f,
                              .route_scale = 1.5f, .ids = chk_dev_alloc(env, nk * 4),
                              .weights = chk_dev_alloc(env, nk * 4)};
        static const char *const names[BENCH_OPS] = {"moe_experts grouped", "grouped, no split-k",
                                                     "grouped, host plan",
                                                     "grouped unstaged",
                                                     "grouped cuda-core",
                                                     "moe_experts cublaslt",
                                                     "wide first version", "wide 64x64 warps",
                                                     "cublaslt per-expert", "moe_gate"};
        for (int op = 0; op < BENCH_OPS; op++) {
            if (T > 384 && op < OP_GEMM)
                continue; /* groups of 16 at prefill sizes: not a path a prefill takes */
            if (T <= 384 && (op == OP_FIRST || op == OP_W64))
                continue; /* the wide kernel's shapes: prefill sizes only */
            b.op = op;
            /* the forced backends run on their own streams: time them as env->gpu */
            kern_backend keep = env->gpu;
            const int ex_op = op != OP_GATE;
            if (ex_op)
                env->gpu = op == OP_MMA        ? g_be.grouped
                           : op == OP_NOSPLIT  ? g_be.nosplit
                           : op == OP_HOST     ? g_be.host
                           : op == OP_UNSTAGED ? g_be.unstaged
                           : op == OP_CORES    ? g_be.cores
                           : op == OP_PEREXP   ? g_be.perexp_never
                           : op == OP_FIRST    ? g_be.wide[KERN_CUDA_WIDE_FIRST]
                           : op == OP_W64      ? g_be.wide[KERN_CUDA_WIDE_W64]
                                               : g_be.gemm;
            double ms = chk_time_ms(env, bench_call, &b, T > 384 ? 1 : 2,
                                    ex_op ? (T > 384 ? 3 : 7) : 30);
            env->gpu = keep;
            double flops = ex_op ? 2.0 * 3 * B_D * (double)B_I * (nk + T) : 0;
            double bytes = ex_op ? n_used * (double)per + 3.0 * (sh8 + shs) + 4.0 * T * B_D
                                  : T * (B_E * 4.0 + B_K * 8.0);
            if (ms <= 0) {
                printf("%-22s %5u failed (message above)\n", names[op], T);
                continue;
            }
            double tf = flops / (ms * 1e-3) / 1e12, gb = bytes / (ms * 1e-3) / 1e9;
            printf("%-22s %5u %7u %9u %10.1f %9.2f %7.0f %6.1f%% %6.1f%%\n", names[op], T, n_used,
                   max_group, ms * 1e3, tf, gb, 100 * tf / peak, 100 * gb / copy);
        }
        chk_dev_free(env, (void *)b.p.x), chk_dev_free(env, (void *)b.p.ids);
        chk_dev_free(env, (void *)b.p.weights), chk_dev_free(env, b.p.y);
        chk_dev_free(env, (void *)b.g.logits), chk_dev_free(env, b.g.ids), chk_dev_free(env, b.g.weights);
        free(ids), free(w), free(hx), free(hz);
    }
    chk_dev_free(env, all), chk_dev_free(env, sd);
    free(ex);
}

int main(int argc, char **argv)
{
    chk_env env;
    int want_bench = chk_init(&env, argc, argv, usage);
    kern_cuda_config always = {.moe_grouped_rows = THR_ALWAYS}, never = {.moe_grouped_rows = -1};
    kern_cuda_config cores = {.moe_grouped_rows = THR_ALWAYS, .moe_cuda_cores = 1};
    kern_cuda_config unstaged = {.moe_grouped_rows = THR_ALWAYS, .moe_unstaged = 1};
    kern_cuda_config host = {.moe_grouped_rows = THR_ALWAYS, .moe_host_plan = 1};
    kern_cuda_config perexp = {.moe_per_expert = 1};
    kern_cuda_config perexp_never = {.moe_grouped_rows = -1, .moe_per_expert = 1};
    kern_cuda_config nosplit = {.moe_grouped_rows = THR_ALWAYS, .stream_splits = 1};
    di_error e;
    if (kern_cuda_create(&always, &g_be.grouped, &e) != DI_OK ||
        kern_cuda_create(&cores, &g_be.cores, &e) != DI_OK ||
        kern_cuda_create(&unstaged, &g_be.unstaged, &e) != DI_OK ||
        kern_cuda_create(&never, &g_be.gemm, &e) != DI_OK ||
        kern_cuda_create(&host, &g_be.host, &e) != DI_OK ||
        kern_cuda_create(&perexp, &g_be.perexp, &e) != DI_OK ||
        kern_cuda_create(&perexp_never, &g_be.perexp_never, &e) != DI_OK ||
        kern_cuda_create(&nosplit, &g_be.nosplit, &e) != DI_OK) {
        fprintf(stderr, "CUDA backend (moe path forced): %s\n", e.msg);
        return 2;
    }
    for (int v = 1; v < KERN_CUDA_WIDE_SHAPES; v++) {
        kern_cuda_config shape = {.moe_wide_tile = v};
        if (kern_cuda_create(&shape, &g_be.wide[v], &e) != DI_OK) {
            fprintf(stderr, "CUDA backend (wide kernel shape %d): %s\n", v, e.msg);
            return 2;
        }
    }
    const char *sw = getenv("CHECK_MOE_SWEEP");
    if (sw && !strcmp(sw, "0"))
        chk_count(&env, 1); /* nothing checked: not a pass */
    else
        sweep(&env);
    int rc = chk_finish(&env, "check_moe", want_bench, bench);
    kern_cuda_destroy(&g_be.grouped);
    kern_cuda_destroy(&g_be.cores);
    kern_cuda_destroy(&g_be.unstaged);
    kern_cuda_destroy(&g_be.gemm);
    kern_cuda_destroy(&g_be.nosplit);
    for (int v = 1; v < KERN_CUDA_WIDE_SHAPES; v++)
        kern_cuda_destroy(&g_be.wide[v]);
    kern_cuda_destroy(&g_be.host);
    kern_cuda_destroy(&g_be.perexp);
    kern_cuda_destroy(&g_be.perexp_never);
    return rc;
}
