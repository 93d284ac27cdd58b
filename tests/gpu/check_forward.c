/* check_forward: the whole forward on the CUDA backend against the CPU backend.
 *
 * For the shipped small configs (tiny, small) it writes a random-weight checkpoint with the
 * di-mkmodel generator (runner_model_random), runs one fixed scenario (tests/forward/
 * fwd_scenario.h: chunked prefill of two prompts, single-row decode of both each followed by a
 * draft proposal, a speculative step of 1 + nextn rows, one more decode row; YOCO off, compact
 * and mask) on:
 *   ref:  the CPU backend (the C twins);
 *   pert: the CPU backend with every op's output moved by random noise as large as the
 *         tolerance kernels.h states for that op (bf16 1 ulp; linear 1e-2 * max(1, |y|) capped
 *         so the row cosine stays >= 0.9999; attention abs 2e-2 within the same cosine; MoE as
 *         stated; hc mixes abs 1e-5; router weights abs 1e-6; indexer scores 1 bf16 ulp), exact
 *         ops untouched; PERT_DRAWS runs with different noise;
 *   cuda: the CUDA backend, weights placed in device memory.
 * The pert runs measure what the per-op tolerances allow once the model propagates them
 * (FP8/FP4 re-quantisation, MoE picks that flip). For each quantity the CUDA run's median and
 * (from 32 items on) worst item error must stay within MARGIN x the largest value of that
 * statistic over the pert runs (never failing below a one-ulp relative L2):
 *   - the residual stream after every layer in its first step, and after every draft stage
 *     in every proposal (rows);
 *   - logits of every requested row and draft logits (relative L2 and 1 - cosine per row; the
 *     rows whose argmax differs, at most MARGIN x the most of any pert run);
 *   - draft confidences (absolute error);
 *   - caches, decoded (ring entries (A), compressed main entries (C), index keys (B), the
 *     compressor's fp32 pending tokens), per region; and the set of entries written, exactly.
 * Then the failure paths (every allocation of creation refused in turn, a KV pool twice the
 * device's memory, an allocation refused inside a step: DI_ENOMEM, nothing left allocated) and
 * the executor (runner_exec) with a fork done by the plan's copies on the device.
 *
 * --bench: a prefill chunk and decode steps at the V4.1-Flash width (see bench_forward);
 * CHECK_FORWARD_BENCH (a list of "long", "decode") keeps only those parts after the 4,096-token
 * chunk: "long" the 16,384-token chunk with its FP8 ceiling, "decode" the decode steps, the
 * device sampler, the whole-model line and the batch-invariance check. Unset: all of them.
 * Exit 0: all within tolerance; 1: a mismatch; 2: a setup error. The seed is printed first. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <unistd.h>

#include "common/model/forward.h"
#include "common/model/mkmodel.h"
#include "common/model/runner.h"
#include "common/sampling/sampler_backend.h"
#include "common/util/clock.h"
#include "kernels/cpu/numfmt.h"
#include "kernels/cuda/backend_cuda.h"
#include "tests/forward/fwd_scenario.h"
#include "tests/gpu/check_util.h"
#include "tests/gpu/fp8_ceiling.h"
#include "tests/gpu/gpu_common.h"

#define SHOW 5
#define MARGIN 2.0              /* allowed: MARGIN x what tolerance-sized noise gives */
#define KEEP_TOKENS 160

static const char usage[] =
    "usage: check_forward [--seed N] [--bench]\n"
    "The forward (prefill, decode, drafts, YOCO) on the CUDA backend against the CPU backend\n"
    "on random-weight tiny and small models; --bench adds V4.1-Flash-width step timings.\n";

/* ---- the perturbing backend: CPU ops, outputs moved within each op's tolerance ---- */

typedef struct pert_state {
    kern_ops inner;             /* the CPU backend's table */
    di_rng rng;
} pert_state;

static pert_state *pert_cur;

static double pert_u(void)
{
    return 2.0 * di_rng_uniform(&pert_cur->rng) - 1.0;
}

/* One bf16 unit in the last place up, down or not at all. */
static uint16_t ulp_move(uint16_t h)
{
    if ((h & 0x7f80) == 0x7f80)
        return h; /* inf, NaN */
    switch (di_rng_u32(&pert_cur->rng) % 3) {
    case 1: return (h & 0x7fff) == 0x7f7f ? h : (uint16_t)(h + 1);
    case 2: return (h & 0x7fff) == 0 ? h : (uint16_t)(h - 1);
    default: return h;
    }
}

static void ulp_rows(uint16_t *x, size_t rows, size_t n, size_t stride)
{
    for (size_t r = 0; r < rows; r++)
        for (size_t i = 0; i < n; i++)
            x[r * stride + i] = ulp_move(x[r * stride + i]);
}

/* v[i] += u * t_i, t_i = a * max(1, rel ? |v_i| : 0, rms_floor ? rms : 0), capped at
 * 0.02 * rms of the row (uniform noise of that size keeps the row cosine above 0.9999). */
static void noise_f32(float *v, size_t n, double a, int rel, int rms_floor)
{
    double ss = 0;
    for (size_t i = 0; i < n; i++)
        if (isfinite(v[i]))
            ss += (double)v[i] * v[i];
    double rms = n ? sqrt(ss / (double)n) : 0, cap = 0.02 * rms;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(v[i]))
            continue;
        double t = fmax(1.0, rel ? fabs(v[i]) : 0.0);
        t = a * (rms_floor ? fmax(t, rms) : t);
        v[i] += (float)(fmin(t, cap) * pert_u());
    }
}

static void noise_bf16(uint16_t *x, size_t n, double a, int rel, int rms_floor)
{
    float *v = chk_malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        v[i] = di_bf16_to_f32(x[i]);
    noise_f32(v, n, a, rel, rms_floor);
    for (size_t i = 0; i < n; i++)
        x[i] = di_f32_to_bf16(v[i]);
    free(v);
}

static di_status p_rmsnorm(void *ctx, const kern_rmsnorm *p)
{
    di_status st = pert_cur->inner.rmsnorm(ctx, p);
    if (st == DI_OK)
        ulp_rows(p->y, p->n_rows, p->dim, p->y_stride);
    return st;
}

static di_status p_rope(void *ctx, const kern_rope *p)
{
    di_status st = pert_cur->inner.rope(ctx, p);
    for (uint32_t r = 0; st == DI_OK && r < p->n_rows; r++)
        ulp_rows(p->x + r * p->row_stride + p->offset, p->n_heads, p->rope_dim, p->head_stride);
    return st;
}

static di_status lin_noise(di_status st, const kern_linear *p)
{
    size_t w = (size_t)(p->groups ? p->groups : 1) * p->n;
    for (uint32_t r = 0; st == DI_OK && r < p->m; r++) {
        if (p->out_f32)
            noise_f32((float *)p->y + r * p->y_stride, w, 1e-2, 1, 0);
        else
            noise_bf16((uint16_t *)p->y + r * p->y_stride, w, 1e-2, 1, 0);
    }
    return st;
}

static di_status p_linear_fp8(void *ctx, const kern_linear *p)
{
    return lin_noise(pert_cur->inner.linear_fp8(ctx, p), p);
}

static di_status p_linear_fp4(void *ctx, const kern_linear *p)
{
    return lin_noise(pert_cur->inner.linear_fp4(ctx, p), p);
}

static di_status p_linear_bf16(void *ctx, const kern_linear *p)
{
    return lin_noise(pert_cur->inner.linear_bf16(ctx, p), p);
}

static di_status p_head(void *ctx, const kern_linear *p)
{
    return lin_noise(pert_cur->inner.head(ctx, p), p);
}

static di_status p_sparse_attn(void *ctx, const kern_sparse_attn *p)
{
    di_status st = pert_cur->inner.sparse_attn(ctx, p);
    for (size_t h = 0; st == DI_OK && h < (size_t)p->n_rows * p->n_heads; h++)
        noise_bf16(p->out + h * p->head_dim, p->head_dim, 2e-2, 0, 0);
    return st;
}

static di_status p_moe_experts(void *ctx, const kern_moe_experts *p)
{
    di_status st = pert_cur->inner.moe_experts(ctx, p);
    for (uint32_t t = 0; st == DI_OK && t < p->n_rows; t++)
        noise_bf16(p->y + (size_t)t * p->dim, p->dim, 1e-2, 1, 1);
    return st;
}

static void abs_noise(float *v, size_t n, double a)
{
    for (size_t i = 0; i < n; i++)
        v[i] += (float)(a * pert_u());
}

static di_status p_hc_mixes(void *ctx, const kern_hc_mixes *p)
{
    di_status st = pert_cur->inner.hc_mixes(ctx, p);
    if (st == DI_OK) {
        size_t T = p->n_rows, hc = p->n_copies;
        abs_noise(p->pre, T * hc, 1e-5);
        abs_noise(p->post, T * hc, 1e-5);
        abs_noise(p->comb, T * hc * hc, 1e-5);
    }
    return st;
}

static di_status p_moe_gate(void *ctx, const kern_moe_gate *p)
{
    di_status st = pert_cur->inner.moe_gate(ctx, p);
    if (st == DI_OK)
        abs_noise(p->weights, (size_t)p->n_rows * p->top_k, 1e-6);
    return st;
}

static di_status p_engram_gate(void *ctx, const kern_engram_gate *p)
{
    di_status st = pert_cur->inner.engram_gate(ctx, p);
    if (st == DI_OK)
        ulp_rows(p->h, (size_t)p->n_rows * p->n_copies, p->dim, p->dim);
    return st;
}

static di_status p_index_scores(void *ctx, const kern_index_scores *p)
{
    di_status st = pert_cur->inner.index_scores(ctx, p);
    for (uint32_t t = 0; st == DI_OK && t < p->n_rows; t++)
        for (int32_t j = 0; j < p->n_visible[t]; j++) {
            float *s = &p->scores[t * p->stride + (size_t)j];
            if (isfinite(*s))
                *s = di_bf16_to_f32(ulp_move(di_f32_to_bf16(*s)));
        }
    return st;
}

static void pert_make(pert_state *s, const kern_backend *cpu, uint64_t seed, kern_backend *out)
{
    s->inner = cpu->ops;
    di_rng_init(&s->rng, seed);
    pert_cur = s;
    *out = *cpu;
    out->ops.rmsnorm = p_rmsnorm;
    out->ops.rope = p_rope;
    out->ops.linear_fp8 = p_linear_fp8;
    out->ops.linear_fp4 = p_linear_fp4;
    out->ops.linear_bf16 = p_linear_bf16;
    out->ops.head = p_head;
    out->ops.sparse_attn = p_sparse_attn;
    out->ops.moe_experts = p_moe_experts;
    out->ops.hc_mixes = p_hc_mixes;
    out->ops.moe_gate = p_moe_gate;
    out->ops.engram_gate = p_engram_gate;
    out->ops.index_scores = p_index_scores;
}

/* ---- one scenario on one backend ---- */

/* The residual stream after each layer in the first step that runs it (the first prompt chunk,
 * or the first with rows left by YOCO compaction), and after each draft stage in every
 * proposal (a proposal has few rows), from the dump hook. */
#define CAP_MAX 64
typedef struct capture {
    uint32_t n_layers;          /* backbone layers: later ids are draft stages */
    float *h[CAP_MAX];          /* [rows, hc, D] as floats */
    size_t n[CAP_MAX];          /* numbers */
    size_t w[CAP_MAX];          /* numbers per row (hc * D) */
} capture;

static void cap_hook(void *ud, const fwd_tensor *t)
{
    capture *c = ud;
    if (strcmp(t->name, "H") != 0 || t->layer < 0 || t->layer >= CAP_MAX || t->dims[0] == 0)
        return; /* dims[0] 0: a chunk YOCO compaction dropped whole */
    uint32_t l = (uint32_t)t->layer;
    if (c->h[l] && l < c->n_layers)
        return;
    size_t n = (size_t)t->dims[0] * (t->dims[1] ? t->dims[1] : 1) * (t->dims[2] ? t->dims[2] : 1);
    float *v = realloc(c->h[l], (c->n[l] + n) * sizeof(float));
    if (!v) {
        fprintf(stderr, "capture of %zu numbers: out of memory\n", n);
        exit(2);
    }
    const uint16_t *x = t->data;
    for (size_t i = 0; i < n; i++)
        v[c->n[l] + i] = di_bf16_to_f32(x[i]);
    c->h[l] = v;
    c->n[l] += n;
    c->w[l] = n / t->dims[0];
}

static void cap_free(capture *c)
{
    for (int i = 0; i < CAP_MAX; i++)
        free(c->h[i]);
    memset(c, 0, sizeof(*c));
}

static fwd_options scn_opts(const runner_model *rm, const scn_params *p, uint32_t max_rows)
{
    fwd_options o = {.nextn = p->nextn, .max_rows = max_rows, .yoco = p->yoco,
                     .keep_tokens = p->keep_tokens, .token_map = rm->token_map,
                     .token_map_pad = rm->token_map_pad};
    return o;
}

/* The model, run state and scenario KV of a run (free each whatever the status). */
static di_status scn_open(const runner_model *rm, const kern_backend *be, const fwd_options *o,
                          fwd_model **m, fwd_run **run, fwd_kv **kv, di_error *e)
{
    di_status st = fwd_model_create(rm->w, be, o, m, e);
    if (st == DI_OK)
        st = fwd_run_create(*m, run, e);
    if (st == DI_OK)
        st = fwd_kv_create(fwd_model_geometry(*m), be, SCN_BLOCKS, SCN_SLOTS, kv, e);
    return st;
}

static di_status run_scn(const runner_model *rm, const kern_backend *be, const scn_params *p,
                         capture *cap, scn_out *out, di_error *e)
{
    fwd_options o = scn_opts(rm, p, SCN_CHUNK);
    memset(out, 0, sizeof(*out));
    if (cap) {
        memset(cap, 0, sizeof(*cap));
        cap->n_layers = rm->w->config.n_layers;
        o.dump = cap_hook;
        o.dump_userdata = cap;
    }
    fwd_model *m = NULL;
    fwd_run *run = NULL;
    fwd_kv *kv = NULL;
    di_status st = scn_open(rm, be, &o, &m, &run, &kv, e);
    if (st == DI_OK)
        st = scn_run(run, kv, m, p, out, e);
    fwd_kv_free(kv);
    fwd_run_free(run);
    fwd_model_free(m);
    return st;
}

/* ---- comparisons ---- */

/* Relative L2 of every element one bf16 ulp off: a difference never worth a failure. */
#define FLOOR 0.0078125

/* Relative L2 error and 1 - cosine of x against c; *bad counts elements finite in one only. */
static void row_err(const float *c, const float *x, size_t n, double *rel, double *omc,
                    double *maxdev, int *bad)
{
    double d2 = 0, c2 = 0, x2 = 0, cx = 0, md = 0;
    for (size_t i = 0; i < n; i++) {
        if (isfinite(c[i]) != isfinite(x[i]))
            (*bad)++;
        if (!isfinite(c[i]) || !isfinite(x[i]))
            continue;
        double d = (double)x[i] - c[i];
        d2 += d * d;
        c2 += (double)c[i] * c[i];
        x2 += (double)x[i] * x[i];
        cx += (double)c[i] * x[i];
        md = fmax(md, fabs(d));
    }
    *rel = c2 > 0 ? sqrt(d2 / c2) : sqrt(d2);
    *omc = c2 > 0 && x2 > 0 ? 1.0 - cx / sqrt(c2 * x2) : (d2 > 0 ? 1.0 : 0.0);
    *maxdev = md;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Order statistics of per-item errors (sorts e). */
typedef struct dist {
    double med, p90, worst;
} dist;

static dist dist_of(double *e, size_t n)
{
    dist d = {0, 0, 0};
    if (n == 0)
        return d;
    qsort(e, n, sizeof(double), cmp_double);
    size_t i9 = (size_t)(0.9 * (double)n);
    d.med = e[n / 2];
    d.p90 = e[i9 < n ? i9 : n - 1];
    d.worst = e[n - 1];
    return d;
}

/* The CUDA run's median and worst item error each within MARGIN x the perturbed runs' (at least
 * floor). A random-weight model turns a one-ulp difference into a different MoE pick now and
 * then, which changes that row completely (and, through attention, the rows after it): the
 * median says whether the backend computes the same model, the worst catches garbage (from
 * WORST_MIN_ITEMS items on: the worst of a handful is one item's luck). The 90th percentile is
 * printed, not bounded: it falls between the rows a pick changed and those it did not, and
 * moves by more than 2x between two runs of the same noise. */
#define WORST_MIN_ITEMS 32      /* below this many items the worst is not bounded */

static size_t dist_check(const char *what, const char *metric, size_t n, dist g, dist p,
                         double floor)
{
    double tm = fmax(MARGIN * p.med, floor), tw = fmax(MARGIN * p.worst, floor);
    int worst_ok = n < WORST_MIN_ITEMS || g.worst <= tw;
    int ok = g.med <= tm && worst_ok;
    if (n < WORST_MIN_ITEMS)
        printf("  %s%s %s: median %.3g (max %.3g), worst %.3g (not bounded: %zu items)\n",
               ok ? "" : "FAIL ", what, metric, g.med, tm, g.worst, n);
    else
        printf("  %s%s %s: median %.3g (max %.3g), p90 %.3g, worst %.3g (max %.3g)\n",
               ok ? "" : "FAIL ", what, metric, g.med, tm, g.p90, g.worst, tw);
    return ok ? 0 : 1;
}

/* Perturbed runs (PERT_DRAWS draws of the noise): the budget of each statistic is MARGIN x its
 * largest value over the draws, so one lucky draw does not make it tight. */
#define PERT_DRAWS 6

static dist dist_max(dist a, dist b)
{
    dist d = {fmax(a.med, b.med), fmax(a.p90, b.p90), fmax(a.worst, b.worst)};
    return d;
}

/* n items of w floats: ref c, the perturbed draws p[k], CUDA g. */
static size_t cmp_items(const char *what, const float *c, const float *const *p, const float *g,
                        size_t n, size_t w, int with_cos)
{
    double *eg = chk_malloc(4 * (n ? n : 1) * sizeof(double));
    double *ep = eg + n, *og = ep + n, *op = og + n, md;
    int bad = 0, pbad = 0;
    for (size_t i = 0; i < n; i++)
        row_err(c + i * w, g + i * w, w, &eg[i], &og[i], &md, &bad);
    dist dg = dist_of(eg, n), cg = dist_of(og, n), dp = {0, 0, 0}, cp = {0, 0, 0};
    for (int k = 0; k < PERT_DRAWS; k++) {
        for (size_t i = 0; i < n; i++)
            row_err(c + i * w, p[k] + i * w, w, &ep[i], &op[i], &md, &pbad);
        dp = dist_max(dp, dist_of(ep, n));
        cp = dist_max(cp, dist_of(op, n));
    }
    size_t mism = 0;
    if (bad) {
        printf("FAIL %s: %d values finite in one run only\n", what, bad);
        mism++;
    }
    mism += dist_check(what, "rel L2", n, dg, dp, FLOOR);
    if (with_cos)
        mism += dist_check(what, "1-cos", n, cg, cp, FLOOR * FLOOR);
    free(eg);
    return mism;
}

/* Probabilities (draft confidences): the absolute error, median and worst as above. */
static size_t cmp_abs(const char *what, const float *c, const float *const *p, const float *g,
                      size_t n)
{
    double *eg = chk_malloc(2 * (n ? n : 1) * sizeof(double)), *ep = eg + n;
    for (size_t i = 0; i < n; i++)
        eg[i] = fabs((double)g[i] - c[i]);
    dist dg = dist_of(eg, n), dp = {0, 0, 0};
    for (int k = 0; k < PERT_DRAWS; k++) {
        for (size_t i = 0; i < n; i++)
            ep[i] = fabs((double)p[k][i] - c[i]);
        dp = dist_max(dp, dist_of(ep, n));
    }
    free(eg);
    return dist_check(what, "|cuda - cpu|", n, dg, dp, 1e-6);
}

static uint32_t argmax_gap(const float *v, size_t n, double *gap)
{
    uint32_t b = 0;
    double top = -INFINITY, second = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        if (v[i] > top) {
            second = top;
            top = v[i];
            b = (uint32_t)i;
        } else if (v[i] > second) {
            second = v[i];
        }
    }
    *gap = top - second;
    return b;
}

/* Rows of V logits: the statistics above, and the rows whose argmax differs from ref's: at
 * most MARGIN x the most any perturbed draw had (at least one row). */
static size_t cmp_logit_rows(const char *what, const float *c, const float *const *p,
                             const float *g, uint32_t n, uint32_t V, const int64_t *pos,
                             const int32_t *seq)
{
    size_t mism = cmp_items(what, c, p, g, n, V, 1), flips = 0, pflips = 0;
    for (int k = 0; k < PERT_DRAWS; k++) {
        size_t f = 0;
        for (uint32_t r = 0; r < n; r++) {
            double gap, gp;
            f += argmax_gap(c + (size_t)r * V, V, &gap) != argmax_gap(p[k] + (size_t)r * V, V, &gp);
        }
        pflips = f > pflips ? f : pflips;
    }
    for (uint32_t r = 0; r < n; r++) {
        double gap, gg;
        uint32_t ac = argmax_gap(c + (size_t)r * V, V, &gap);
        uint32_t ag = argmax_gap(g + (size_t)r * V, V, &gg);
        if (ag != ac && flips++ < SHOW)
            printf("    %s: sequence %d position %lld: argmax %u, the CPU's %u (top-2 gap %.3g)\n",
                   what, seq ? seq[r] : 0, pos ? (long long)pos[r] : (long long)r, ag, ac, gap);
    }
    double tol = fmax(MARGIN * (double)pflips, 1.0);
    int ok = (double)flips <= tol;
    printf("  %s%s: argmax differs on %zu of %u rows (max %.0f; perturbed draws up to %zu)\n",
           ok ? "" : "FAIL ", what, flips, n, tol, pflips);
    return mism + (ok ? 0 : 1);
}

/* The residual stream after each layer in its first step, rows compared as items. The early
 * layers have amplified nothing yet: a wrong op shows there first. */
static size_t cmp_layers(const char *what, const capture *c, const capture *p, const capture *g)
{
    const float *pk[PERT_DRAWS];
    size_t mism = 0, n = 0;
    for (int l = 0; l < CAP_MAX; l++) {
        if (!c->h[l])
            continue;
        char name[96];
        snprintf(name, sizeof name, "%s, stream after layer %d", what, l);
        int ok = g->h[l] && c->n[l] == g->n[l];
        for (int k = 0; k < PERT_DRAWS; k++) {
            ok = ok && p[k].h[l] && p[k].n[l] == c->n[l];
            pk[k] = p[k].h[l];
        }
        if (!ok) {
            printf("FAIL %s: missing or of another size\n", name);
            mism++;
            continue;
        }
        mism += cmp_items(name, c->h[l], pk, g->h[l], c->n[l] / c->w[l], c->w[l], 0);
        n++;
    }
    if (n == 0) {
        printf("FAIL %s: no layer was captured\n", what);
        mism++;
    }
    return mism;
}

/* One cache region's entries, decoded: the entries ref wrote (as items) and those written in
 * one run only. */
typedef struct region {
    char name[64];
    size_t w;                   /* numbers per entry */
    size_t n, cap;              /* entries collected */
    float *c, *g;               /* [cap, w] decoded */
    float *p[PERT_DRAWS];
    size_t entries, written_diff;
} region;

static void region_open(region *rg, const char *name, size_t w, size_t cap)
{
    memset(rg, 0, sizeof(*rg));
    snprintf(rg->name, sizeof rg->name, "%s", name);
    rg->w = w;
    rg->cap = cap;
    rg->c = chk_malloc((2 + PERT_DRAWS) * (cap ? cap : 1) * w * sizeof(float));
    rg->g = rg->c + cap * w;
    for (int k = 0; k < PERT_DRAWS; k++)
        rg->p[k] = rg->g + (size_t)(k + 1) * cap * w;
}

static int all_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

typedef void (*decode_fn)(const uint8_t *e, uint32_t dim, float *out);

static void dec_ring(const uint8_t *e, uint32_t dim, float *out) /* (A) */
{
    for (uint32_t i = 0; i < dim; i++)
        out[i] = di_e4m3_decode(e[i]) * di_ue8m0_decode(e[dim + i / 32]);
}

static void dec_main(const uint8_t *e, uint32_t dim, float *out) /* (C) */
{
    for (uint32_t i = 0; i < dim; i++)
        out[i] = di_e2m1_decode((uint8_t)(e[i / 2] >> (4 * (i & 1)))) *
                 di_e4m3_decode(e[dim / 2 + i / 16]);
}

static void dec_index(const uint8_t *e, uint32_t dim, float *out) /* (B) */
{
    for (uint32_t i = 0; i < dim; i++)
        out[i] = di_e2m1_decode((uint8_t)(e[i / 2] >> (4 * (i & 1)))) *
                 di_ue8m0_decode(e[dim / 2 + i / 32]);
}

static void dec_f32(const uint8_t *e, uint32_t n, float *out)
{
    memcpy(out, e, (size_t)n * sizeof(float));
}

/* The entry at byte offset off of every image (slots or blocks). */
static const uint8_t *image(const scn_out *o, int slots)
{
    return slots ? o->slots : o->blocks;
}

static void region_entry(region *rg, const scn_out *c, const scn_out *p, const scn_out *g,
                         int slots, size_t off, size_t bytes, decode_fn dec)
{
    const uint8_t *ec = image(c, slots) + off, *eg = image(g, slots) + off;
    rg->entries++;
    int zc = all_zero(ec, bytes);
    if (zc != all_zero(eg, bytes))
        rg->written_diff++;
    if (zc || rg->n == rg->cap)
        return;
    dec(ec, (uint32_t)rg->w, rg->c + rg->n * rg->w);
    dec(eg, (uint32_t)rg->w, rg->g + rg->n * rg->w);
    for (int k = 0; k < PERT_DRAWS; k++)
        dec(image(&p[k], slots) + off, (uint32_t)rg->w, rg->p[k] + rg->n * rg->w);
    rg->n++;
}

static size_t region_close(const char *what, region *rg)
{
    char name[160];
    snprintf(name, sizeof name, "%s, %s (%zu written)", what, rg->name, rg->n);
    size_t mism = cmp_items(name, rg->c, (const float *const *)rg->p, rg->g, rg->n, rg->w, 0);
    if (rg->written_diff) {
        printf("FAIL %s: %zu of %zu entries written in one cache only\n", name,
               rg->written_diff, rg->entries);
        mism++;
    }
    free(rg->c);
    return mism ? 1 : 0;
}

/* Every cache region of the three runs: a layer's rings (both slots), an owner's main entries
 * and index keys (every block), the compressor's pending tokens. Returns the regions failed. */
static size_t cmp_caches(const char *what, const fwd_model *m, const scn_out *c,
                         const scn_out *p, const scn_out *g)
{
    const kv_geometry *G = fwd_model_geometry(m);
    size_t bb = kv_block_bytes(G), sb = kv_state_slot_bytes(G), eb = kv_ring_entry_bytes(G);
    size_t rb = kv_ring_bytes(G);
    uint32_t hd = G->head_dim, id = G->index_head_dim;
    size_t fails = 0;
    region rg;
    char name[64];
    for (uint32_t l = 0; l < G->n_layers + G->n_draft_stages; l++) {
        snprintf(name, sizeof name, "ring of %s %u", l < G->n_layers ? "layer" : "draft stage",
                 l < G->n_layers ? l : l - G->n_layers);
        region_open(&rg, name, hd, (size_t)SCN_SLOTS * G->ring_positions);
        for (uint32_t s = 0; s < SCN_SLOTS; s++)
            for (uint32_t e = 0; e < G->ring_positions; e++)
                region_entry(&rg, c, p, g, 1, s * sb + l * rb + e * eb, eb, dec_ring);
        fails += region_close(what, &rg);
    }
    for (uint32_t k = 0; k < G->n_owners; k++)
        for (int idx = 0; idx < 2; idx++) {
            uint32_t per = kv_owner_entries_per_block(G, k);
            snprintf(name, sizeof name, "%s of owner %u (layer %u)",
                     idx ? "index keys" : "main entries", k, G->owner_layer[k]);
            region_open(&rg, name, idx ? id : hd, (size_t)SCN_BLOCKS * per);
            for (uint32_t b = 0; b < SCN_BLOCKS; b++)
                for (uint32_t e = 0; e < per; e++)
                    region_entry(&rg, c, p, g, 0,
                                 b * bb + (idx ? kv_owner_index_offset(G, k, e)
                                               : kv_owner_main_offset(G, k, e)),
                                 idx ? kv_index_entry_bytes(G) : kv_main_entry_bytes(G),
                                 idx ? dec_index : dec_main);
            fails += region_close(what, &rg);
        }
    size_t rings = (size_t)(G->n_layers + G->n_draft_stages) * rb;
    size_t tok = 2 * (size_t)hd * sizeof(float); /* one pending token: a then g */
    size_t n_tok = kv_compressor_state_bytes(G) / tok;
    if (n_tok) {
        region_open(&rg, "compressor pending tokens", 2 * (size_t)hd, SCN_SLOTS * n_tok);
        for (uint32_t s = 0; s < SCN_SLOTS; s++)
            for (size_t t = 0; t < n_tok; t++)
                region_entry(&rg, c, p, g, 1, s * sb + rings + t * tok, tok, dec_f32);
        fails += region_close(what, &rg);
    }
    return fails;
}

static size_t cmp_case(const char *what, const fwd_model *m, const scn_out *c, const scn_out *p,
                       const scn_out *g)
{
    int same = c->n_rows == g->n_rows && c->n_drafts == g->n_drafts &&
               c->blocks_bytes == g->blocks_bytes && c->slots_bytes == g->slots_bytes;
    const float *pl[PERT_DRAWS], *pd[PERT_DRAWS], *pc[PERT_DRAWS];
    for (int k = 0; k < PERT_DRAWS; k++) {
        same = same && p[k].n_rows == c->n_rows && p[k].n_drafts == c->n_drafts;
        pl[k] = p[k].logits;
        pd[k] = p[k].draft_logits;
        pc[k] = p[k].draft_conf;
    }
    if (!same) {
        printf("FAIL %s: the runs recorded different shapes\n", what);
        return 1;
    }
    char w[96];
    snprintf(w, sizeof w, "%s, logits", what);
    size_t mism = cmp_logit_rows(w, c->logits, pl, g->logits, c->n_rows, c->vocab, c->row_pos,
                                 c->row_seq);
    if (c->n_drafts) {
        snprintf(w, sizeof w, "%s, draft logits", what);
        mism += cmp_logit_rows(w, c->draft_logits, pd, g->draft_logits, c->n_drafts, c->vocab,
                               NULL, NULL);
        snprintf(w, sizeof w, "%s, draft confidences", what);
        mism += cmp_abs(w, c->draft_conf, pc, g->draft_conf, c->n_drafts);
    }
    return mism + cmp_caches(what, m, c, p, g);
}

/* ---- cases ---- */

typedef struct fwd_case {
    const char *config;
    fwd_yoco yoco;
} fwd_case;

static const fwd_case cases[] = {
    {"tiny", FWD_YOCO_OFF}, {"tiny", FWD_YOCO_COMPACT}, {"tiny", FWD_YOCO_MASK},
    {"small", FWD_YOCO_OFF},
};

static const char *const yoco_name[] = {"off", "compact", "mask"};

static void load_model(chk_env *env, const char *config, runner_model *rm)
{
    di_error e;
    if (runner_model_random(config, env->seed, NULL, NULL, rm, &e) != DI_OK) {
        fprintf(stderr, "random %s checkpoint: %s\n", config, e.msg);
        exit(2);
    }
}

/* The same scenario with graphs on (kern_cuda_graphs): logits, draft logits,
 * confidences, KV blocks and state slots identical to the eager run's, bit for bit. */
static size_t same_bytes(const char *what, const char *name, const void *a, const void *b,
                         size_t n)
{
    if (n == 0 || memcmp(a, b, n) == 0)
        return 0;
    const uint8_t *x = a, *y = b;
    size_t i = 0;
    while (x[i] == y[i])
        i++;
    printf("FAIL %s: graph replay differs from eager in %s at byte %zu of %zu\n", what, name, i,
           n);
    return 1;
}

static size_t check_graphs(chk_env *env, const runner_model *rm, const kern_backend *gpu,
                           const scn_params *p, const scn_out *eager, const char *case_name,
                           uint32_t split)
{
    scn_out g;
    di_error e;
    char what[96];
    snprintf(what, sizeof what, "%s, segments %s", case_name, split ? "of 7 ops" : "whole");
    kern_cuda_stats s0, s1;
    kern_cuda_get_stats(&env->gpu, &s0);
    di_status st = kern_cuda_graph_split(&env->gpu, split, &e);
    if (st == DI_OK)
        st = kern_cuda_graphs(&env->gpu, 1, &e);
    if (st == DI_OK)
        st = run_scn(rm, gpu, p, NULL, &g, &e);
    if (st == DI_OK)
        st = kern_cuda_sync(&env->gpu, &e);
    di_error e2;
    kern_cuda_graphs(&env->gpu, 0, &e2);
    kern_cuda_graph_split(&env->gpu, 0, &e2);
    kern_cuda_get_stats(&env->gpu, &s1);
    if (st != DI_OK) {
        printf("FAIL %s: run with graphs: %s\n", what, e.msg);
        return 1;
    }
    size_t bad = 0;
    if (g.n_rows != eager->n_rows || g.n_drafts != eager->n_drafts) {
        printf("FAIL %s: graphs gave %u logits rows and %u drafts, eager %u and %u\n", what,
               g.n_rows, g.n_drafts, eager->n_rows, eager->n_drafts);
        bad++;
    } else {
        size_t V = eager->vocab;
        bad += same_bytes(what, "logits", g.logits, eager->logits, (size_t)g.n_rows * V * 4);
        bad += same_bytes(what, "draft logits", g.draft_logits, eager->draft_logits,
                          (size_t)g.n_drafts * V * 4);
        bad += same_bytes(what, "draft confidences", g.draft_conf, eager->draft_conf,
                          (size_t)g.n_drafts * 4);
        bad += same_bytes(what, "KV blocks", g.blocks, eager->blocks,
                          g.blocks_bytes < eager->blocks_bytes ? g.blocks_bytes : eager->blocks_bytes);
        bad += same_bytes(what, "state slots", g.slots, eager->slots,
                          g.slots_bytes < eager->slots_bytes ? g.slots_bytes : eager->slots_bytes);
    }
    uint64_t launched = s1.graph_launches - s0.graph_launches;
    if (launched == 0) {
        printf("FAIL %s: graphs on, but no segment was launched as a graph\n", what);
        bad++;
    }
    printf("%s: with graphs %" PRIu64 " segments launched (%" PRIu64 " captured, %" PRIu64
           " kept graphs launched as they are): logits, drafts and KV %s the eager run's\n", what,
           launched, s1.graph_instantiations - s0.graph_instantiations,
           s1.graph_replays - s0.graph_replays, bad ? "DIFFER from" : "bit-identical to");
    scn_out_free(&g);
    return bad;
}

/* Many decode steps replayed from kept graphs: prompts of 200 and 100 tokens, DEC_STEPS steps
 * of one row for both (sequence 1 crosses its first block boundary at 128 tokens), then
 * DEC_ALONE steps of sequence 1 alone (another row count: captured again, then kept). Run
 * eagerly and with graphs on (whole steps), every step's logits, the KV blocks and the state
 * slots compared bit for bit, and most steps launched from a kept graph, not captured. */
#define DEC_STEPS 40
#define DEC_ALONE 6

static di_status run_decode(const runner_model *rm, const kern_backend *be, const scn_params *p,
                            uint32_t pad_to, scn_out *out, di_error *e)
{
    fwd_options o = scn_opts(rm, p, SCN_CHUNK);
    const uint32_t V = rm->w->config.vocab_size, max_rows = 200 + 100 + 2 * DEC_STEPS + DEC_ALONE;
    memset(out, 0, sizeof(*out));
    out->vocab = V;
    out->logits = malloc((size_t)max_rows * V * sizeof(float));
    out->row_pos = malloc(max_rows * sizeof(int64_t));
    out->row_seq = malloc(max_rows * sizeof(int32_t));
    scn_ctx *x = calloc(1, sizeof(*x));
    float *tmp = malloc((size_t)SCN_CHUNK * SCN_SEQS * V * sizeof(float));
    if (!out->logits || !out->row_pos || !out->row_seq || !x || !tmp) {
        free(x), free(tmp);
        return di_fail(e, DI_ENOMEM, "decode scenario buffers");
    }
    fwd_model *m = NULL;
    fwd_run *run = NULL;
    fwd_kv *kv = NULL;
    di_status st = scn_open(rm, be, &o, &m, &run, &kv, e);
    if (st == DI_OK) {
        *x = (scn_ctx){.run = run, .kv = kv, .c = fwd_model_config(m), .p = p, .out = out,
                       .tmp = tmp, .err = e, .pad_to = pad_to};
        const int64_t plen[SCN_SEQS] = {200, 100};
        scn_seqs_init(x, plen);
    }
    for (uint32_t i = 0; i < SCN_SEQS && st == DI_OK; i++) {
        scn_seq *q = &x->seq[i];
        while (st == DI_OK && q->len < q->prompt_len) {
            int64_t left = q->prompt_len - q->len;
            uint32_t n = left < SCN_CHUNK ? (uint32_t)left : SCN_CHUNK;
            st = scn_step(x, &i, 1, &n);
        }
    }
    const uint32_t both[SCN_SEQS] = {0, 1}, one[SCN_SEQS] = {1, 1}, second = 1;
    for (uint32_t k = 0; k < DEC_STEPS && st == DI_OK; k++)
        st = scn_step(x, both, SCN_SEQS, one);
    for (uint32_t k = 0; k < DEC_ALONE && st == DI_OK; k++)
        st = scn_step(x, &second, 1, one);
    if (st == DI_OK) {
        out->blocks_bytes = (size_t)kv->n_blocks * kv->block_bytes;
        out->slots_bytes = (size_t)kv->n_slots * kv->slot_bytes;
        out->blocks = malloc(out->blocks_bytes);
        out->slots = malloc(out->slots_bytes);
        if (!out->blocks || !out->slots)
            st = di_fail(e, DI_ENOMEM, "decode scenario cache copies");
    }
    if (st == DI_OK) {
        be->ops.to_host(be->ctx, out->blocks, kv->blocks, out->blocks_bytes);
        be->ops.to_host(be->ctx, out->slots, kv->slots, out->slots_bytes);
    }
    free(tmp);
    free(x);
    fwd_kv_free(kv);
    fwd_run_free(run);
    fwd_model_free(m);
    return st;
}

/* The run with graphs g against the eager run a: its status, every logits row, the KV blocks
 * and state slots bit for bit, and (a prompt chunk and the first step of each row count being
 * captured) most later steps launched from kept graphs. Returns the failures, printed. */
static size_t same_decode(const char *what, di_status st, const di_error *e, const scn_out *g,
                          const scn_out *a, uint64_t inst, uint64_t kept)
{
    size_t bad = 0;
    if (st != DI_OK) {
        printf("FAIL %s: run with graphs: %s\n", what, e->msg);
        return 1;
    }
    if (g->n_rows != a->n_rows) {
        printf("FAIL %s: %u logits rows with graphs, %u eager\n", what, g->n_rows, a->n_rows);
        return 1;
    }
    for (uint32_t r = 0; r < a->n_rows && !bad; r++) {
        char name[64];
        snprintf(name, sizeof name, "logits of row %u", r);
        bad += same_bytes(what, name, g->logits + (size_t)r * a->vocab,
                          a->logits + (size_t)r * a->vocab, (size_t)a->vocab * 4);
    }
    bad += same_bytes(what, "KV blocks", g->blocks, a->blocks, a->blocks_bytes);
    bad += same_bytes(what, "state slots", g->slots, a->slots, a->slots_bytes);
    if (kept < DEC_STEPS / 2) {
        printf("FAIL %s: only %" PRIu64 " segments launched from kept graphs (%" PRIu64
               " captured)\n", what, kept, inst);
        bad++;
    }
    return bad;
}

static void check_replay(chk_env *env, const runner_model *rm, const char *config,
                         const kern_backend *gpu)
{
    char what[96];
    snprintf(what, sizeof what, "%s, %d decode steps replayed", config, DEC_STEPS + DEC_ALONE);
    scn_params p = {.config = config, .nextn = 3, .yoco = FWD_YOCO_OFF,
                    .keep_tokens = KEEP_TOKENS, .seed = env->seed + 29};
    scn_out a, g;
    di_error e, e2;
    di_status st = run_decode(rm, gpu, &p, 0, &a, &e);
    if (st == DI_OK)
        st = kern_cuda_sync(&env->gpu, &e);
    if (st != DI_OK) {
        printf("FAIL %s: eager run: %s\n", what, e.msg);
        scn_out_free(&a);
        chk_count(env, 1);
        return;
    }
    kern_cuda_stats s0, s1;
    kern_cuda_get_stats(&env->gpu, &s0);
    st = kern_cuda_graphs(&env->gpu, 1, &e);
    if (st == DI_OK)
        st = run_decode(rm, gpu, &p, 0, &g, &e);
    if (st == DI_OK)
        st = kern_cuda_sync(&env->gpu, &e);
    kern_cuda_graphs(&env->gpu, 0, &e2);
    kern_cuda_get_stats(&env->gpu, &s1);
    uint64_t inst = s1.graph_instantiations - s0.graph_instantiations;
    uint64_t kept = s1.graph_replays - s0.graph_replays;
    size_t bad = same_decode(what, st, &e, &g, &a, inst, kept);
    printf("%s: %" PRIu64 " segments captured, %" PRIu64 " launched from kept graphs; logits, KV "
           "and slots %s the eager run's; captures of a known op sequence by the first action "
           "that differed:", what, inst, kept, bad ? "DIFFER from" : "bit-identical to");
    for (int k = 0; k < 8; k++) {
        uint64_t n0 = 0;
        for (int j = 0; j < 8; j++)
            if (s0.graph_misses[j].n && !strcmp(s0.graph_misses[j].what, s1.graph_misses[k].what))
                n0 = s0.graph_misses[j].n;
        if (s1.graph_misses[k].n > n0)
            printf(" [%s] %" PRIu64, s1.graph_misses[k].what, s1.graph_misses[k].n - n0);
    }
    printf("\n");
    scn_out_free(&a);
    scn_out_free(&g);
    chk_count(env, bad);
}

/* Placeholder rows (fwd_seq.placeholder) on the device: the decode scenario above run eagerly
 * without padding, then with graphs on and every step of fewer than PAD_ROWS rows (both
 * sequences' 2 rows, then 1) padded to PAD_ROWS, both in batch-invariant mode: logits, KV
 * blocks and state slots identical bit for bit (the placeholders write nothing and the real
 * rows do not see them), and the padded steps of either batch launched from kept graphs. */
#define PAD_ROWS 8

static void check_padded(chk_env *env, const runner_model *rm, const char *config,
                         const kern_backend *gpu)
{
    char what[96];
    snprintf(what, sizeof what, "%s, decode steps padded to %d rows", config, PAD_ROWS);
    scn_params p = {.config = config, .nextn = 3, .yoco = FWD_YOCO_OFF,
                    .keep_tokens = KEEP_TOKENS, .seed = env->seed + 31};
    scn_out a = {0}, g = {0};
    di_error e, e2;
    kern_cuda_set_batch_invariant(&env->gpu, 1);
    di_status st = run_decode(rm, gpu, &p, 0, &a, &e);
    if (st == DI_OK)
        st = kern_cuda_sync(&env->gpu, &e);
    kern_cuda_stats s0, s1;
    kern_cuda_get_stats(&env->gpu, &s0);
    if (st == DI_OK)
        st = kern_cuda_graphs(&env->gpu, 1, &e);
    if (st == DI_OK)
        st = run_decode(rm, gpu, &p, PAD_ROWS, &g, &e);
    if (st == DI_OK)
        st = kern_cuda_sync(&env->gpu, &e);
    kern_cuda_graphs(&env->gpu, 0, &e2);
    kern_cuda_set_batch_invariant(&env->gpu, 0);
    kern_cuda_get_stats(&env->gpu, &s1);
    uint64_t inst = s1.graph_instantiations - s0.graph_instantiations;
    uint64_t kept = s1.graph_replays - s0.graph_replays;
    size_t bad = same_decode(what, st, &e, &g, &a, inst, kept);
    printf("%s: %" PRIu64 " segments captured, %" PRIu64 " launched from kept graphs; logits, "
           "KV and slots %s the unpadded eager run's\n", what, inst, kept,
           bad ? "DIFFER from" : "bit-identical to");
    scn_out_free(&a);
    scn_out_free(&g);
    chk_count(env, bad);
}

static void check_case(chk_env *env, const runner_model *rm, const fwd_case *k,
                       const kern_backend *gpu, trk_state *trk)
{
    char what[64];
    snprintf(what, sizeof what, "%s, YOCO %s", k->config, yoco_name[k->yoco]);
    scn_params p = {.config = k->config, .nextn = 3, .yoco = k->yoco,
                    .keep_tokens = KEEP_TOKENS, .seed = env->seed + 17};
    scn_out c, q[PERT_DRAWS], g;
    capture cc, cq[PERT_DRAWS], cg;
    di_error e;
    if (run_scn(rm, &env->cpu, &p, &cc, &c, &e) != DI_OK) {
        fprintf(stderr, "%s: CPU run: %s\n", what, e.msg);
        exit(2);
    }
    for (int d = 0; d < PERT_DRAWS; d++) {
        pert_state ps;
        kern_backend pb;
        pert_make(&ps, &env->cpu, env->seed * 31 + 977 * (uint64_t)d + 1, &pb);
        if (run_scn(rm, &pb, &p, &cq[d], &q[d], &e) != DI_OK) {
            fprintf(stderr, "%s: perturbed CPU run: %s\n", what, e.msg);
            exit(2);
        }
    }
    int64_t live0 = trk->live;
    di_status st = run_scn(rm, gpu, &p, &cg, &g, &e);
    size_t mism = 0;
    if (st == DI_OK)
        st = kern_cuda_sync(&env->gpu, &e);
    if (st != DI_OK) {
        printf("FAIL %s: CUDA run: %s (%s)\n", what, e.msg, kern_cuda_last_error(&env->gpu));
        mism = 1;
    } else {
        printf("%s: %u logits rows, %u drafts\n", what, c.n_rows, c.n_drafts);
        /* a model for the geometry (the comparison reads the cache layout) */
        fwd_options o = scn_opts(rm, &p, SCN_CHUNK);
        fwd_model *m = NULL;
        if (fwd_model_create(rm->w, &env->cpu, &o, &m, &e) != DI_OK) {
            fprintf(stderr, "%s: %s\n", what, e.msg);
            exit(2);
        }
        mism = cmp_layers(what, &cc, cq, &cg) + cmp_case(what, m, &c, q, &g);
        fwd_model_free(m);
        mism += check_graphs(env, rm, gpu, &p, &g, what, 0);
        mism += check_graphs(env, rm, gpu, &p, &g, what, 7); /* cut every 7 ops */
    }
    if (trk->live != live0) {
        printf("FAIL %s: %lld device allocations left after the run\n", what,
               (long long)(trk->live - live0));
        mism++;
    }
    chk_count(env, mism);
    scn_out_free(&c);
    scn_out_free(&g);
    cap_free(&cc);
    cap_free(&cg);
    for (int d = 0; d < PERT_DRAWS; d++) {
        scn_out_free(&q[d]);
        cap_free(&cq[d]);
    }
}

/* ---- failure paths ---- */

/* Every allocation of model, run and KV creation refused in turn; a KV pool twice the device's
 * memory; an allocation refused inside a step, then the same step. */
static void check_refusals(chk_env *env, const runner_model *rm, trk_state *trk,
                           const kern_backend *gpu)
{
    scn_params p = {.nextn = 3, .yoco = FWD_YOCO_OFF};
    fwd_options o = scn_opts(rm, &p, SCN_CHUNK);
    di_error e;
    uint64_t k = 0, refused = 0;
    size_t mism = 0;
    if (scn_refuse_creation(trk, rm->w, gpu, &o, &k, &e) != DI_OK) {
        printf("FAIL refused allocations at creation: %s\n", e.msg);
        mism++;
    } else {
        printf("creation with each of its %" PRIu64 " device allocations refused in turn: "
               "DI_ENOMEM, nothing left allocated\n", k);
    }
    fwd_model *m = NULL;
    fwd_run *run = NULL;
    fwd_kv *kv = NULL, *huge = NULL;
    if (fwd_model_create(rm->w, gpu, &o, &m, &e) != DI_OK || fwd_run_create(m, &run, &e) != DI_OK ||
        fwd_kv_create(fwd_model_geometry(m), gpu, SCN_BLOCKS, SCN_SLOTS, &kv, &e) != DI_OK) {
        fprintf(stderr, "refusals: %s\n", e.msg);
        exit(2);
    }
    size_t free_b = 0, total_b = 0;
    GPU_OK(cudaMemGetInfo(&free_b, &total_b));
    int64_t live = trk->live;
    const kv_geometry *G = fwd_model_geometry(m);
    uint64_t nb = 2 * (uint64_t)total_b / kv_block_bytes(G) + 1;
    nb = nb > UINT32_MAX ? UINT32_MAX : nb;
    di_status st = fwd_kv_create(G, gpu, (uint32_t)nb, 1, &huge, &e);
    if (st != DI_ENOMEM || huge || trk->live != live) {
        printf("FAIL a KV pool of %" PRIu64 " blocks (%.1f GB, device %.1f GB): %s, %lld "
               "allocations left\n", nb, (double)nb * kv_block_bytes(G) / 1e9, total_b / 1e9,
               di_status_name(st), (long long)(trk->live - live));
        mism++;
        fwd_kv_free(huge);
    } else {
        printf("a KV pool of %.1f GB on a %.1f GB device: %s\n",
               (double)nb * kv_block_bytes(G) / 1e9, total_b / 1e9, e.msg);
    }
    if (scn_refuse_in_step(trk, run, kv, fwd_model_config(m)->vocab_size, &refused, &e) != DI_OK) {
        printf("FAIL refused allocations in a step: %s\n", e.msg);
        mism++;
    } else {
        printf("a step with an allocation refused (%" PRIu64 " times): DI_ENOMEM, then the "
               "step runs\n", refused);
    }
    fwd_kv_free(kv);
    fwd_run_free(run);
    fwd_model_free(m);
    if (trk->live != 0) {
        printf("FAIL refusals: %lld device allocations left\n", (long long)trk->live);
        mism++;
    }
    chk_count(env, mism);
}

/* The executor on the device: two prompt chunks, then a request forked by the plan's copies
 * (copy_rows on the device) and a decode step of both. The forked request's first row must see
 * its parent's KV: its logits equal the parent's (same rows, same caches; within a one-ulp
 * relative L2 should a GEMM treat two rows of a call differently). Nothing may leak. */
static void check_executor(chk_env *env, const runner_model *rm, trk_state *trk,
                           const kern_backend *gpu)
{
    scn_exec x;
    di_error e;
    size_t mism = 0;
    di_status st = scn_exec_open(&x, rm, gpu, &e);
    if (st == DI_OK)
        st = scn_exec_steps(&x, &e);
    if (st == DI_OK)
        st = scn_exec_close(&x, &e);
    if (st == DI_OK)
        st = kern_cuda_sync(&env->gpu, &e);
    if (st != DI_OK) {
        printf("FAIL executor on the device: %s (%s)\n", e.msg, kern_cuda_last_error(&env->gpu));
        mism++;
    } else {
        int i1 = scn_exec_find(&x, 1, 150), i2 = scn_exec_find(&x, 2, 150);
        double rel = 1, omc, md;
        int bad = 0;
        if (i1 >= 0 && i2 >= 0)
            row_err(x.log.rows + (size_t)i1 * x.log.vocab, x.log.rows + (size_t)i2 * x.log.vocab,
                    x.log.vocab, &rel, &omc, &md, &bad);
        int ok = i1 >= 0 && i2 >= 0 && !bad && rel <= FLOOR;
        printf("  %sexecutor: the forked request's first logits against its parent's: rel L2 "
               "%.3g (max %.3g)\n", ok ? "" : "FAIL ", rel, FLOOR);
        mism += !ok;
    }
    if (x.ex || x.log.rows)
        scn_exec_free(&x);
    if (trk->live != 0) {
        printf("FAIL executor: %lld device allocations left\n", (long long)trk->live);
        mism++;
    }
    chk_count(env, mism);
}

/* ---- benchmark ---- */

/* The V4.1-Flash width with fewer layers: the whole checkpoint (computed below) fits neither
 * the GPU machine's disk nor the time of one run, and the generator writes about 30 M values a
 * second. So the checkpoint is generated with four layers (ratios 0, 2, 2, 1: a window-only
 * layer, a compressed-KV owner with the indexer, a layer reading that owner, the ratio-1 owner
 * with the candidate blocks), no draft stages and no Engram, ONE routed expert and a small
 * vocabulary; in memory it is then widened to the real geometry: 384 experts (each a view of
 * the generated one, so the device still holds and reads 384 distinct copies), top-6 routing
 * with a random router, and a 129,280-token embedding and head filled with random BF16. The
 * logits mean nothing; the bytes and the arithmetic are those of V4.1-Flash layers. */
#define BENCH_LAYERS 4
#define BENCH_EXPERTS 384
#define BENCH_TOPK 6
#define BENCH_VOCAB 129280
#define BENCH_CONTEXT 4096       /* prefill chunk, then decode at this position */
#define BENCH_PREFILL 16384      /* the prefill chunk, timed against the FP8 ceiling */
#define BENCH_MAX_SEQS 64
#define BENCH_REPS 5
#define BENCH_SPLIT 24 /* ops per graph segment in the split timing: about a layer */

static const uint32_t bench_ratios[BENCH_LAYERS] = {0, 2, 2, 1};

/* The shipped v41-flash config with the reductions above, written to path. */
static int bench_write_config(const char *path)
{
    const char *text = model_config_builtin_json("v41-flash");
    json_error_t je;
    json_t *root = text ? json_loads(text, 0, &je) : NULL;
    if (!root)
        return 0;
    json_t *t = json_object_get(root, "text_config");
    t = t ? t : root;
    json_t *ratios = json_array(), *owners = json_array();
    for (int l = 0; l < BENCH_LAYERS; l++)
        json_array_append_new(ratios, json_integer(bench_ratios[l]));
    json_array_append_new(owners, json_integer(1));
    json_array_append_new(owners, json_integer(3));
    json_object_set_new(t, "num_hidden_layers", json_integer(BENCH_LAYERS));
    json_object_set_new(t, "num_nextn_predict_layers", json_integer(0));
    json_object_set_new(t, "compress_ratios", ratios);
    json_object_set_new(t, "kv_source_layer_ids", owners);
    json_object_set(t, "index_source_layer_ids", owners);
    json_object_set_new(t, "candidate_source_layer_id", json_integer(3));
    json_object_set_new(t, "engram_layer_ids", json_array());
    json_object_set_new(t, "engram_num_embeddings", json_array());
    json_object_set_new(t, "dspark_target_layer_ids", json_array());
    json_object_set_new(t, "n_routed_experts", json_integer(1));
    json_object_set_new(t, "num_experts_per_tok", json_integer(1));
    json_object_set_new(t, "vocab_size", json_integer(8192));
    json_object_set_new(t, "dspark_noise_token_id", json_integer(8000));
    int ok = json_dump_file(root, path, JSON_INDENT(1)) == 0;
    json_decref(root);
    return ok;
}

/* n random BF16 values, magnitudes in [0.5, 2) * 2^-e, random signs (a fast fill). */
static uint16_t *bench_bf16(size_t n, int e, uint64_t seed)
{
    uint16_t *x = chk_malloc(n * sizeof(uint16_t));
    uint64_t s = seed | 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x[i] = (uint16_t)((s & 0x807f) | ((uint16_t)(126 + (s >> 20) % 2 - e) << 7));
    }
    return x;
}

static uint64_t tbytes(const model_tensor *t)
{
    return t->fmt == MODEL_WFMT_NONE ? 0 : model_tensor_data_bytes(t) + model_tensor_scale_bytes(t);
}

static uint64_t expert_bytes(const model_expert_weights *e)
{
    return tbytes(&e->w1) + tbytes(&e->w2) + tbytes(&e->w3);
}

/* Bytes of a layer's weights other than the routed experts, as placed (wo_a in BF16). */
static uint64_t dense_bytes(const model_layer_weights *L)
{
    const model_attn_weights *a = &L->attn;
    const model_tensor *t[] = {
        &L->attn_norm, &L->ffn_norm, &L->hc_attn.fn, &L->hc_attn.base, &L->hc_attn.scale,
        &L->hc_ffn.fn, &L->hc_ffn.base, &L->hc_ffn.scale, &a->wq_a, &a->q_norm, &a->wq_b,
        &a->wkv, &a->kv_norm, &a->wo_b, &a->attn_sink, &L->compressor.wkv,
        &L->compressor.wgate, &L->compressor.norm, &L->indexer.wq_b,
        &L->indexer.weights_proj, &L->indexer.wk, &L->indexer.k_norm, &L->ffn.gate,
        &L->ffn.gate_bias,
    };
    uint64_t b = a->wo_a.rows * a->wo_a.cols * 2 + expert_bytes(&L->ffn.shared);
    for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
        b += tbytes(t[i]);
    return b;
}

/* Multiply-adds x 2 of one prompt row at position p in the layers (linear layers with the
 * top-k and shared experts, attention over the window and the top-k, indexer scores). */
static double bench_row_flops(const model_config *c, int64_t p)
{
    double D = c->dim, H = c->n_heads, hd = c->head_dim, q = c->q_lora_rank;
    double G = c->o_groups, olr = c->o_lora_rank, ih = c->index_n_heads, id = c->index_head_dim;
    double inter = c->moe_inter_dim, f = 0;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        const model_layer_role *r = &c->roles[l];
        double lin = q * D + H * hd * q + hd * D + G * olr * (H * hd / G) + D * G * olr +
                     c->n_routed_experts * D + (BENCH_TOPK + 1) * 3 * inter * D;
        double keys = fmin((double)p + 1, c->window);
        if (r->ratio) /* the KV source's entries visible at p, at most top-k of them */
            keys += fmin(floor((double)(p + 1) / c->roles[r->kv_source].ratio), c->index_topk);
        if (r->owns_compressor)
            lin += (r->ratio > 1 ? 2 : 1) * hd * D;
        if (r->owns_indexer) {
            double vis = floor((double)(p + 1) / c->roles[r->index_key_source].ratio);
            lin += ih * id * q + ih * D;
            f += 2 * ih * id * vis;
        }
        f += 2 * lin + 2 * 2 * H * hd * keys;
    }
    return f;
}

typedef struct bench_ctx {
    kern_backend *be;           /* the CUDA backend the model runs on */
    fwd_run *run;
    fwd_kv *kv;
    float *logits;
    uint32_t vocab;
    chk_env *env;
} bench_ctx;

/* Median wall time (ms) of reps runs of a step after one warm-up; -1 on failure. */
static double bench_step_ms(bench_ctx *b, const fwd_step *st, int reps)
{
    double t[16];
    di_error e;
    for (int i = 0; i <= reps; i++) {
        uint64_t t0 = di_mono_ns();
        if (fwd_step_run(b->run, b->kv, st, b->logits, &e) != DI_OK) {
            printf("bench step failed: %s\n", e.msg);
            return -1;
        }
        if (i)
            t[i - 1] = (double)(di_mono_ns() - t0) / 1e6;
    }
    qsort(t, (size_t)reps, sizeof(double), cmp_double);
    return t[reps / 2];
}

static double bench_profile(bench_ctx *b, const fwd_step *st, const char *what, uint32_t layers);

/* A failure seen by the bench (batch invariance, the long prefill; the exit code reports it). */
static int g_bench_failures;

/* The prefill chunk: BENCH_PREFILL tokens of a new sequence (slot 1, the KV blocks
 * after the decode steps' ones) against the FP8 GEMM rate of the chunk's main shapes measured
 * now, and its per-op profile. */
static void bench_prefill_long(bench_ctx *b, const model_config *c)
{
    const uint32_t T = BENCH_PREFILL, nb = T / 128, first = BENCH_CONTEXT / 128 + BENCH_MAX_SEQS + 1;
    const chk_fp8_shape shapes[] = {
        {T, 2 * c->moe_inter_dim, c->dim, "MoE up (W1 | W3)"},
        {T, c->dim, c->moe_inter_dim, "MoE down (W2)"},
        {T, c->n_heads * c->head_dim, c->q_lora_rank, "attention wq_b"},
    };
    int block = 0;
    double fp8 = chk_fp8_ceiling(b->env, shapes, sizeof(shapes) / sizeof(shapes[0]), &block);
    int32_t *toks = chk_malloc(T * sizeof(int32_t));
    uint32_t *tab = chk_malloc(nb * sizeof(uint32_t));
    for (uint32_t i = 0; i < T; i++)
        toks[i] = (int32_t)(3 + (i * 104729u) % (c->vocab_size - 3));
    for (uint32_t k = 0; k < nb; k++)
        tab[k] = first + k;
    fwd_seq q = {.n_rows = T, .tokens = toks, .blocks = tab, .n_blocks = nb, .slot = 1};
    int32_t last = (int32_t)T - 1;
    fwd_step ps = {.n_seqs = 1, .seqs = &q, .n_logit_rows = 1, .logit_rows = &last};
    double ms = bench_step_ms(b, &ps, 3);
    if (ms > 0 && fp8 > 0) {
        double fl = 0;
        for (int64_t p = 0; p < T; p++)
            fl += bench_row_flops(c, p);
        double tf = fl / (ms / 1e3) / 1e12;
        printf("  prefill chunk of %u tokens: %.1f ms (%.1f ms per layer), %.0f tokens/s, %.1f "
               "TFLOP/s = %.1f%% of the FP8 GEMM rate of the chunk's shapes measured now (%.0f "
               "TFLOP/s, %s; target 40%%)\n", T, ms, ms / c->n_layers, T / (ms / 1e3), tf,
               100.0 * tf / fp8, fp8, block ? "128-block scales" : "per-tensor scales");
        bench_profile(b, &ps, "prefill chunk of 16,384", c->n_layers);
    } else {
        printf("  prefill chunk of %u tokens: %s\n", T, ms > 0 ? "no FP8 ceiling" : "failed");
        g_bench_failures++;
    }
    free(toks);
    free(tab);
}

/* One more run of a step with the backend's per-op profile on: each op's device time (from
 * its start to the next op's start) per step and per layer, and its share of the step. */
static double bench_profile(bench_ctx *b, const fwd_step *st, const char *what, uint32_t layers)
{
    di_error e;
    kern_cuda_op_time t[48];
    size_t n = 0;
    if (kern_cuda_profile(b->be, 1, &e) != DI_OK ||
        fwd_step_run(b->run, b->kv, st, b->logits, &e) != DI_OK ||
        kern_cuda_profile_read(b->be, t, 48, &n, &e) != DI_OK) {
        printf("    profile of %s: %s\n", what, e.msg);
        kern_cuda_profile(b->be, 0, &e);
        return -1;
    }
    kern_cuda_profile(b->be, 0, &e);
    double total = 0;
    for (size_t i = 0; i < n; i++)
        total += t[i].ms;
    printf("    per-op device time of one %s (profiled: %.2f ms in all)\n", what, total);
    printf("    %-18s %6s %10s %12s %7s\n", "op", "calls", "ms", "ms per layer", "share");
    double head = 0;
    for (size_t i = 0; i < n; i++) {
        printf("    %-18s %6u %10.3f %12.3f %6.1f%%\n", t[i].op, t[i].calls, t[i].ms,
               t[i].ms / layers, 100.0 * t[i].ms / total);
        if (strcmp(t[i].op, "head") == 0)
            head = t[i].ms;
    }
    return head;
}

/* Launch overhead of a step: the eager step, the same step with graphs on (logged, captured
 * once, then its kept graph launched as it is), and the graph launched again with no host work
 * (the step's device time), with the host time spent issuing each and the logits download
 * alone, next to the step's floor at the copy bandwidth. */
static void bench_graphs(bench_ctx *b, const fwd_step *st, uint32_t n, double eager_ms,
                         double floor_ms)
{
    di_error e;
    kern_cuda_stats s0, s1;
    double dl[16], rp[16];
    size_t bytes = (size_t)n * b->vocab * sizeof(float);
    /* host issue time of the eager step */
    kern_cuda_get_stats(b->be, &s0);
    if (fwd_step_run(b->run, b->kv, st, b->logits, &e) != DI_OK) {
        printf("    graphs: eager step failed: %s\n", e.msg);
        return;
    }
    kern_cuda_get_stats(b->be, &s1);
    double eager_host = (double)(s1.op_host_ns - s0.op_host_ns) / 1e6;
    uint64_t eager_syncs = s1.syncs - s0.syncs;
    /* the logits download alone (from a buffer of the same size) */
    void *dev = b->be->ops.alloc(b->be->ctx, bytes);
    if (!dev) {
        printf("    graphs: no device buffer of %zu bytes\n", bytes);
        return;
    }
    for (int i = 0; i < BENCH_REPS; i++) {
        uint64_t t0 = di_mono_ns();
        b->be->ops.to_host(b->be->ctx, b->logits, dev, bytes);
        dl[i] = (double)(di_mono_ns() - t0) / 1e6;
    }
    b->be->ops.free(b->be->ctx, dev);
    qsort(dl, BENCH_REPS, sizeof(double), cmp_double);
    if (kern_cuda_graphs(b->be, 1, &e) != DI_OK) {
        printf("    graphs: %s\n", e.msg);
        return;
    }
    kern_cuda_get_stats(b->be, &s0);
    double gms = bench_step_ms(b, st, BENCH_REPS);
    kern_cuda_get_stats(b->be, &s1);
    kern_cuda_graphs(b->be, 0, &e);
    if (gms < 0)
        return;
    double reps = BENCH_REPS + 1;
    double ghost = (double)(s1.op_host_ns - s0.op_host_ns) / 1e6 / reps;
    double gend = (double)(s1.graph_host_ns - s0.graph_host_ns) / 1e6 / reps;
    double segs = (double)(s1.graph_launches - s0.graph_launches) / reps;
    double inst = (double)(s1.graph_instantiations - s0.graph_instantiations);
    double kept = (double)(s1.graph_replays - s0.graph_replays);
    for (int i = 0; i < BENCH_REPS; i++) {
        uint64_t t0 = di_mono_ns();
        if (kern_cuda_graph_relaunch(b->be, &e) != DI_OK || kern_cuda_sync(b->be, &e) != DI_OK) {
            printf("    graphs: relaunch: %s\n", e.msg);
            return;
        }
        rp[i] = (double)(di_mono_ns() - t0) / 1e6;
    }
    qsort(rp, BENCH_REPS, sizeof(double), cmp_double);
    double replay = rp[BENCH_REPS / 2], down = dl[BENCH_REPS / 2];
    /* segments of about a layer's ops: the device starts while the host captures the rest */
    kern_cuda_get_stats(b->be, &s0);
    double sms = -1;
    if (kern_cuda_graph_split(b->be, BENCH_SPLIT, &e) == DI_OK &&
        kern_cuda_graphs(b->be, 1, &e) == DI_OK)
        sms = bench_step_ms(b, st, BENCH_REPS);
    kern_cuda_graphs(b->be, 0, &e);
    kern_cuda_graph_split(b->be, 0, &e);
    kern_cuda_stats s2;
    kern_cuda_get_stats(b->be, &s2);
    printf("    launch overhead, %u rows: eager step %.3f ms (host issuing %.3f ms, %" PRIu64
           " host waits); with graphs %.3f ms (host logging the ops %.3f ms + %.3f ms finding and "
           "launching the kept graph; %.1f segments per step, %" PRIu64 " nodes in the last, %.0f "
           "captured and %.0f launched as kept in %d steps); the graph relaunched alone %.3f ms; "
           "logits download %.3f ms; step minus replay minus download: eager %.3f ms, graphs "
           "%.3f ms; floor at the copy bandwidth %.3f ms: replay %.1f%% of copy\n",
           n, eager_ms, eager_host, eager_syncs, gms, ghost, gend, segs, s1.graph_nodes, inst,
           kept, BENCH_REPS + 1, replay, down, eager_ms - replay - down, gms - replay - down,
           floor_ms, 100.0 * floor_ms / replay);
    printf("    with graphs cut every %d ops: %.3f ms a step (%.1f segments a step, %.0f "
           "captured and %.0f launched as kept in %d steps, host %.3f ms logging + %.3f ms "
           "finding and launching a step)\n", BENCH_SPLIT, sms,
           (double)(s2.graph_launches - s0.graph_launches) / reps,
           (double)(s2.graph_instantiations - s0.graph_instantiations),
           (double)(s2.graph_replays - s0.graph_replays), BENCH_REPS + 1,
           (double)(s2.op_host_ns - s0.op_host_ns) / 1e6 / reps,
           (double)(s2.graph_host_ns - s0.graph_host_ns) / 1e6 / reps);
}

/* The widened weights (see above): views, not copies, of the generated checkpoint. */
typedef struct bench_weights {
    model_weights w;
    model_layer_weights layers[BENCH_LAYERS];
    model_expert_weights *experts;  /* [BENCH_LAYERS * BENCH_EXPERTS] */
    uint16_t *table;                /* [BENCH_VOCAB, dim]: embedding and head */
    uint16_t *gate;                 /* [BENCH_EXPERTS, dim] */
    float *bias;                    /* [BENCH_EXPERTS] zeros */
} bench_weights;

static void bench_widen(const model_weights *src, bench_weights *b)
{
    const model_config *c = &src->config;
    size_t D = c->dim;
    b->w = *src;
    b->w.config.vocab_size = BENCH_VOCAB;
    b->w.config.n_routed_experts = BENCH_EXPERTS;
    b->w.config.n_activated_experts = BENCH_TOPK;
    b->table = bench_bf16((size_t)BENCH_VOCAB * D, 0, 12345);
    b->gate = bench_bf16((size_t)BENCH_EXPERTS * D, 7, 777); /* ~ N(0, 1/D) scale */
    b->bias = calloc(BENCH_EXPERTS, sizeof(float));
    b->experts = chk_malloc((size_t)BENCH_LAYERS * BENCH_EXPERTS * sizeof(model_expert_weights));
    model_tensor big = src->embed;
    big.rows = BENCH_VOCAB;
    big.data = b->table;
    b->w.embed = big;
    big.name = src->head.name;
    b->w.head = big;
    for (uint32_t l = 0; l < BENCH_LAYERS; l++) {
        model_layer_weights *L = &b->layers[l];
        *L = src->layers[l];
        L->ffn.n_experts = BENCH_EXPERTS;
        L->ffn.experts = b->experts + (size_t)l * BENCH_EXPERTS;
        for (uint32_t e = 0; e < BENCH_EXPERTS; e++)
            L->ffn.experts[e] = src->layers[l].ffn.experts[0];
        L->ffn.gate.rows = BENCH_EXPERTS;
        L->ffn.gate.data = b->gate;
        if (L->ffn.gate_bias.fmt != MODEL_WFMT_NONE) {
            L->ffn.gate_bias.rows = BENCH_EXPERTS;
            L->ffn.gate_bias.data = b->bias;
        }
    }
    b->w.layers = b->layers;
}

static void bench_unwiden(bench_weights *b)
{
    free(b->experts);
    free(b->table);
    free(b->gate);
    free(b->bias);
}

/* A decode step of the n sequences first .. first + n - 1 (one row each, position
 * BENCH_CONTEXT) sharing the prompt's blocks, each with a block and a slot of its own. */
typedef struct bench_dstep {
    uint32_t tables[BENCH_MAX_SEQS][BENCH_CONTEXT / 128 + 1];
    fwd_seq seqs[BENCH_MAX_SEQS];
    int32_t toks[BENCH_MAX_SEQS], rows[BENCH_MAX_SEQS];
    fwd_step st;
} bench_dstep;

static void bench_dstep_make(bench_dstep *d, uint32_t first, uint32_t n)
{
    uint32_t nb = BENCH_CONTEXT / 128;
    for (uint32_t j = 0; j < n; j++) {
        uint32_t i = first + j;
        for (uint32_t k = 0; k < nb; k++)
            d->tables[j][k] = k;
        d->tables[j][nb] = nb + i;
        d->toks[j] = (int32_t)(5 + 97 * i);
        d->rows[j] = (int32_t)j;
        d->seqs[j] = (fwd_seq){.n_rows = 1, .pos0 = BENCH_CONTEXT, .tokens = &d->toks[j],
                               .blocks = d->tables[j], .n_blocks = nb + 1, .slot = i};
    }
    d->st = (fwd_step){.n_seqs = n, .seqs = d->seqs, .n_logit_rows = n, .logit_rows = d->rows};
}

/* The weights a decode step of n rows reads: every layer's dense weights, the distinct
 * experts the rows pick (expected for uniform routing: E (1 - (1 - k/E)^n), in *used), the
 * head */
static double bench_decode_bytes(const bench_weights *bw, uint32_t n, double *used)
{
    const model_config *c = &bw->w.config;
    *used = BENCH_EXPERTS * (1.0 - pow(1.0 - (double)BENCH_TOPK / BENCH_EXPERTS, n));
    double bytes = (double)c->vocab_size * c->dim * 2;
    for (uint32_t l = 0; l < c->n_layers; l++)
        bytes += (double)dense_bytes(&bw->layers[l]) +
                 *used * (double)expert_bytes(&bw->layers[l].ffn.experts[0]);
    return bytes;
}

/* Decode steps of n sequences and their report line; the step's median ms (-1 on failure)
 * and the head's profiled ms in *head_ms. */
static double bench_decode(bench_ctx *b, const bench_weights *bw, uint32_t n, double copy_gbs,
                           double *head_ms)
{
    const model_config *c = &bw->w.config;
    static bench_dstep d;
    bench_dstep_make(&d, 0, n);
    fwd_step st = d.st;
    double ms = bench_step_ms(b, &st, BENCH_REPS);
    *head_ms = 0;
    if (ms < 0)
        return -1;
    double used, bytes = bench_decode_bytes(bw, n, &used);
    double ideal = bytes / (copy_gbs * 1e9) * 1e3;
    printf("  decode %2u rows: %8.2f ms per step (%.2f ms per layer, head included), %8.1f "
           "tokens/s; weights read %.2f GB (%.0f experts per layer expected) in %.2f ms at the "
           "copy bandwidth: %.1f%% of it\n", n, ms, ms / c->n_layers, n / (ms / 1e3),
           bytes / 1e9, used, ideal, 100.0 * ideal / ms);
    bench_graphs(b, &st, n, ms, ideal);
    char what[48];
    snprintf(what, sizeof what, "decode step of %u rows", n);
    *head_ms = bench_profile(b, &st, what, c->n_layers);
    return ms;
}

/* The decode steps again with the weight-streaming kernel without split-k over blocks (its
 * previous version), for the comparison in one run. */
static void bench_decode_prev(bench_ctx *b, const bench_weights *bw, const uint32_t *ns,
                              size_t count, double copy_gbs)
{
    if (kern_cuda_set_stream(b->be, 1, 0) != DI_OK)
        return;
    for (size_t i = 0; i < count; i++) {
        static bench_dstep d;
        bench_dstep_make(&d, 0, ns[i]);
        fwd_step st = d.st;
        double ms = bench_step_ms(b, &st, BENCH_REPS), used;
        double ideal = bench_decode_bytes(bw, ns[i], &used) / (copy_gbs * 1e9) * 1e3;
        if (ms > 0)
            printf("  decode %2u rows without split-k over blocks: %8.2f ms per step, %.1f%% of "
                   "copy\n", ns[i], ms,
                   100.0 * ideal / ms);
    }
    kern_cuda_set_stream(b->be, 0, 0);
}


/* Sampling after a decode step of n rows, both ways: the logits copied to the host and the
 * host sampler (one thread), or left on the device for the device sampler
 * (fwd_step_run_keep + sampler_sample_backend); medians of BENCH_REPS, the tokens of the
 * two compared. *dev_ms gets the device way's step. */
static double bench_sampling(bench_ctx *b, uint32_t n, double *dev_ms)
{
    static bench_dstep d;
    bench_dstep_make(&d, 0, n);
    sampler_workspace *ws = NULL;
    di_error e;
    *dev_ms = -1;
    if (sampler_workspace_new(b->vocab, &ws, &e) != DI_OK) {
        printf("  sampling bench: %s\n", e.msg);
        return -1;
    }
    sampling_params p[BENCH_MAX_SEQS];
    sampler_row rows[BENCH_MAX_SEQS];
    sampler_result host[BENCH_MAX_SEQS], dev[BENCH_MAX_SEQS];
    for (uint32_t i = 0; i < n; i++) {
        p[i] = sampling_params_default();
        p[i].seed = 1000 + i;
        rows[i] = (sampler_row){.logits = b->logits + (size_t)i * b->vocab, .n_vocab = b->vocab,
                                .params = &p[i], .position = BENCH_CONTEXT + 1};
    }
    double th[16], td[16];
    di_status st = DI_OK;
    for (int r = 0; r <= BENCH_REPS && st == DI_OK; r++) {
        uint64_t t0 = di_mono_ns();
        st = fwd_step_run(b->run, b->kv, &d.st, b->logits, &e);
        if (st == DI_OK)
            st = sampler_sample_batch(rows, n, ws, host, NULL, &e);
        uint64_t t1 = di_mono_ns();
        const float *dl = NULL;
        if (st == DI_OK)
            st = fwd_step_run_keep(b->run, b->kv, &d.st, &dl, &e);
        if (st == DI_OK)
            st = sampler_sample_backend(b->be, dl, b->vocab, rows, n, ws, dev, NULL, &e);
        uint64_t t2 = di_mono_ns();
        if (r) {
            th[r - 1] = (double)(t1 - t0) / 1e6;
            td[r - 1] = (double)(t2 - t1) / 1e6;
        }
    }
    sampler_workspace_free(ws);
    if (st != DI_OK) {
        printf("  sampling bench: %s\n", e.msg);
        return -1;
    }
    uint32_t same = 0;
    for (uint32_t i = 0; i < n; i++)
        same += host[i].token == dev[i].token && host[i].logprob == dev[i].logprob;
    qsort(th, BENCH_REPS, sizeof(double), cmp_double);
    qsort(td, BENCH_REPS, sizeof(double), cmp_double);
    printf("  decode %u rows and their sampling: logits to the host + host sampler %.2f ms; "
           "logits kept on the device + device sampler %.2f ms (%.2f ms less); the same token "
           "and logprob in %u of %u rows\n", n, th[BENCH_REPS / 2], td[BENCH_REPS / 2],
           th[BENCH_REPS / 2] - td[BENCH_REPS / 2], same, n);
    if (same != n) {
        printf("FAIL the device sampler drew other tokens than the host sampler on the same "
               "logits\n");
        g_bench_failures++;
    }
    *dev_ms = td[BENCH_REPS / 2];
    return th[BENCH_REPS / 2];
}

/* Batch invariance of the whole forward: the logits of sequences 0, 17, 42 and 63 alone
 * against the same rows of a 64-row decode step, bit for bit, in batch-invariant mode
 * (asserted) and without it (printed); a second 64-row step checks that steps repeat exactly.
 * Then the mode's cost on the 1- and 64-row steps. */
static void bench_invariance(bench_ctx *b, uint32_t n)
{
    static bench_dstep d;
    static const uint32_t probe[] = {0, 17, 42, 63};
    size_t V = b->vocab;
    float *all = malloc((size_t)n * V * sizeof(float)), *again = malloc((size_t)n * V * 4);
    if (!all || !again) {
        printf("  batch invariance: out of memory\n");
        free(all);
        free(again);
        return;
    }
    di_error e;
    double ms[2][2] = {{-1, -1}, {-1, -1}};
    for (int bi = 1; bi >= 0; bi--) {
        kern_cuda_set_batch_invariant(b->be, bi);
        bench_dstep_make(&d, 0, n);
        di_status st = fwd_step_run(b->run, b->kv, &d.st, all, &e);
        if (st == DI_OK)
            st = fwd_step_run(b->run, b->kv, &d.st, again, &e);
        int repeat = st == DI_OK && memcmp(all, again, (size_t)n * V * 4) == 0;
        size_t differ = 0;
        for (size_t pi = 0; pi < sizeof probe / sizeof probe[0] && st == DI_OK; pi++) {
            uint32_t q = probe[pi];
            if (q >= n)
                continue;
            bench_dstep_make(&d, q, 1);
            st = fwd_step_run(b->run, b->kv, &d.st, again, &e);
            if (st != DI_OK)
                break;
            size_t dq = 0;
            double worst = 0;
            for (size_t j = 0; j < V; j++) {
                float x = all[(size_t)q * V + j], y = again[j];
                dq += memcmp(&x, &y, 4) != 0;
                worst = fabs((double)x - y) > worst ? fabs((double)x - y) : worst;
            }
            differ += dq;
            printf("  batch invariance%s: sequence %u alone vs in %u rows: %zu of %zu logits "
                   "differ (max |diff| %.3g)\n", bi ? " MODE" : " (default)", q, n, dq, V, worst);
        }
        if (st != DI_OK) {
            printf("  batch invariance: %s\n", e.msg);
            break;
        }
        printf("  batch invariance%s: a second %u-row step %s the first bit for bit\n",
               bi ? " MODE" : " (default)", n, repeat ? "repeats" : "DOES NOT repeat");
        if (bi && (differ || !repeat)) {
            printf("FAIL batch-invariant mode: a request's logits depend on its batch\n");
            g_bench_failures++;
        }
        bench_dstep_make(&d, 0, n);
        fwd_step big = d.st;
        ms[bi][1] = bench_step_ms(b, &big, BENCH_REPS);
        bench_dstep_make(&d, 0, 1);
        fwd_step one = d.st;
        ms[bi][0] = bench_step_ms(b, &one, BENCH_REPS);
    }
    kern_cuda_set_batch_invariant(b->be, 0);
    kern_cuda_stats cs;
    kern_cuda_get_stats(b->be, &cs);
    printf("  batch-invariant mode's cost: decode %u rows %.2f ms against %.2f (%+.1f%%), 1 row "
           "%.2f ms against %.2f (%+.1f%%); %" PRIu64 " GEMM chunks in the mode so far\n", n,
           ms[1][1], ms[0][1], 100.0 * (ms[1][1] / ms[0][1] - 1), ms[1][0], ms[0][0],
           100.0 * (ms[1][0] / ms[0][0] - 1), cs.gemm_invariant);
    free(all);
    free(again);
}

/* The whole model from the per-layer figures: (step - head) / layers per layer, times the
 * full model's layers, plus the head (and sampling) once, next to the explainer's figures. */
static void bench_whole(uint32_t layers, uint32_t full_layers, double prefill_ms,
                        double prefill_head, double dec_ms, double dec_head, double dev_step_ms,
                        uint32_t n)
{
    if (prefill_ms <= 0 || dec_ms <= 0 || prefill_head < 0 || dec_head < 0)
        return;
    double lp = (prefill_ms - prefill_head) / layers, ld = (dec_ms - dec_head) / layers;
    double wp = lp * full_layers + prefill_head, wd = ld * full_layers + dec_head;
    printf("  whole model (%u layers from the %u measured, one H200, every expert on it): "
           "prefill %.1f ms per %d-token chunk = %.0f tokens/s per GPU (explainer: ~87,000 "
           "tokens/s per GPU at a 32K chunk); decode %u sequences %.1f ms per step = %.1f "
           "steps/s, %.0f tokens/s (explainer: 13.2 ms per step at 64 sequences on EP64, 64 "
           "GPUs sharing the experts)\n", full_layers, layers, wp, BENCH_CONTEXT,
           BENCH_CONTEXT / (wp / 1e3), n, wd, 1e3 / wd, n * 1e3 / wd);
    if (dev_step_ms > 0) {
        double wdd = ld * full_layers + (dev_step_ms - ld * layers);
        printf("  the same decode step with the device sampler (its logits never leave the "
               "device; sampling included): %.1f ms = %.1f steps/s, %.0f tokens/s\n", wdd,
               1e3 / wdd, n * 1e3 / wdd);
    }
}

/* Whether CHECK_FORWARD_BENCH asks for this part of the bench (unset: every part). */
static int bench_part(const char *name)
{
    const char *want = getenv("CHECK_FORWARD_BENCH");
    if (!want)
        return 1;
    size_t n = strlen(name);
    for (const char *p = strstr(want, name); p; p = strstr(p + 1, name))
        if ((p == want || p[-1] == ',' || p[-1] == ' ') && (p[n] == 0 || p[n] == ',' || p[n] == ' '))
            return 1;
    return 0;
}

static void bench_forward(chk_env *env)
{
    printf("\n== check_forward --bench: V4.1-Flash width, %d layers ==\n", BENCH_LAYERS);
    double copy = gpu_copy_gbs((size_t)1 << 30, 20);
    double peak = chk_gemm_ceiling(env);
    printf("ceilings: device copy %.0f GB/s, BF16 GEMM 8192^3 %.0f TFLOP/s\n", copy, peak);
    di_error e;
    model_config full = {0};
    mkmodel_options mo;
    mkmodel_options_default(&mo);
    mo.max_bytes = 0;
    mkmodel_plan plan;
    if (model_config_resolve("v41-flash", &full, &e) == DI_OK &&
        mkmodel_plan_for(&full, &mo, &plan, &e) == DI_OK)
        printf("the whole V4.1-Flash checkpoint: %.1f GB (%" PRIu64 " parameters, Engram "
               "tables seeded): beyond the 64 GiB disk and the run's time at ~30 M generated "
               "values/s, hence %d layers at full width\n", plan.bytes / 1e9, plan.params,
               BENCH_LAYERS);
    char dir[] = "/tmp/di-bench-XXXXXX", path[64];
    if (!mkdtemp(dir)) {
        printf("bench: no temporary directory\n");
        return;
    }
    snprintf(path, sizeof path, "%s/bench.json", dir);
    runner_model rm = {0};
    uint64_t t0 = di_mono_ns();
    int ok = bench_write_config(path);
    if (!ok || runner_model_random(path, env->seed, NULL, NULL, &rm, &e) != DI_OK) {
        printf("bench: checkpoint: %s\n", ok ? e.msg : "config");
        unlink(path);
        rmdir(dir);
        return;
    }
    unlink(path);
    rmdir(dir);
    printf("checkpoint generated and mapped in %.1f s\n", (double)(di_mono_ns() - t0) / 1e9);
    bench_weights bw;
    bench_widen(rm.w, &bw);
    const model_config *c = &bw.w.config;
    fwd_options o = {.nextn = 0, .max_rows = BENCH_PREFILL, .token_map_pad = -1};
    fwd_model *m = NULL;
    bench_ctx b = {.be = &env->gpu, .vocab = c->vocab_size, .env = env};
    t0 = di_mono_ns();
    di_status st = fwd_model_create(&bw.w, &env->gpu, &o, &m, &e);
    if (st == DI_OK)
        st = fwd_run_create(m, &b.run, &e);
    if (st == DI_OK)
        st = fwd_kv_create(fwd_model_geometry(m), &env->gpu,
                           BENCH_CONTEXT / 128 + BENCH_MAX_SEQS + 1 + BENCH_PREFILL / 128,
                           BENCH_MAX_SEQS, &b.kv, &e);
    b.logits = malloc((size_t)BENCH_MAX_SEQS * c->vocab_size * sizeof(float));
    if (st != DI_OK || !b.logits) {
        printf("bench: %s\n", st != DI_OK ? e.msg : "logits");
    } else {
        uint64_t dense = 0, ex = expert_bytes(&bw.layers[0].ffn.experts[0]);
        for (uint32_t l = 0; l < c->n_layers; l++)
            dense += dense_bytes(&bw.layers[l]);
        printf("weights placed in %.1f s: %.2f GB per layer on average (%.2f GB of 384 experts), "
               "embedding and head %.2f GB\n", (double)(di_mono_ns() - t0) / 1e9,
               (dense + (double)BENCH_EXPERTS * ex * c->n_layers) / c->n_layers / 1e9,
               (double)BENCH_EXPERTS * ex / 1e9, 2.0 * c->vocab_size * c->dim * 2 / 1e9);
        /* the prompt: one chunk of BENCH_CONTEXT rows, logits of its last row */
        int32_t *toks = chk_malloc(BENCH_CONTEXT * sizeof(int32_t));
        uint32_t tab[BENCH_CONTEXT / 128];
        for (uint32_t i = 0; i < BENCH_CONTEXT; i++)
            toks[i] = (int32_t)(3 + (i * 7919u) % (c->vocab_size - 3));
        for (uint32_t k = 0; k < BENCH_CONTEXT / 128; k++)
            tab[k] = k;
        fwd_seq q = {.n_rows = BENCH_CONTEXT, .tokens = toks, .blocks = tab,
                     .n_blocks = BENCH_CONTEXT / 128, .slot = 0};
        int32_t last = BENCH_CONTEXT - 1;
        fwd_step ps = {.n_seqs = 1, .seqs = &q, .n_logit_rows = 1, .logit_rows = &last};
        double ms = bench_step_ms(&b, &ps, 3), prefill_head = -1;
        if (ms > 0) {
            double fl = 0;
            for (int64_t p = 0; p < BENCH_CONTEXT; p++)
                fl += bench_row_flops(c, p);
            printf("  prefill chunk of %d tokens: %.1f ms (%.1f ms per layer), %.0f tokens/s, "
                   "%.1f TFLOP/s = %.1f%% of the BF16 GEMM ceiling\n", BENCH_CONTEXT, ms,
                   ms / c->n_layers, BENCH_CONTEXT / (ms / 1e3), fl / (ms / 1e3) / 1e12,
                   100.0 * fl / (ms / 1e3) / 1e12 / peak);
            prefill_head = bench_profile(&b, &ps, "prefill chunk", c->n_layers);
            if (bench_part("long"))
                bench_prefill_long(&b, c);
            /* every decode sequence starts from the prompt's rings and pending state */
            for (uint32_t i = 1; i < BENCH_MAX_SEQS && st == DI_OK; i++) {
                kern_copy_rows cp = {.n_rows = 1, .row_bytes = b.kv->slot_bytes,
                                     .src = fwd_kv_slot(b.kv, 0), .src_stride = b.kv->slot_bytes,
                                     .dst = fwd_kv_slot(b.kv, i), .dst_stride = b.kv->slot_bytes};
                st = env->gpu.ops.copy_rows(env->gpu.ctx, &cp);
            }
            const uint32_t ns[] = {1, 8, 64};
            double dec_ms = -1, dec_head = -1, dev_ms = -1;
            const int decode = bench_part("decode");
            for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]) && st == DI_OK && decode; i++)
                dec_ms = bench_decode(&b, &bw, ns[i], copy, &dec_head);
            if (decode)
                bench_decode_prev(&b, &bw, ns, sizeof(ns) / sizeof(ns[0]), copy);
            if (st == DI_OK && decode) {
                bench_sampling(&b, BENCH_MAX_SEQS, &dev_ms);
                bench_whole(c->n_layers, full.n_layers ? full.n_layers : 40, ms, prefill_head,
                            dec_ms, dec_head, dev_ms, BENCH_MAX_SEQS);
                bench_invariance(&b, BENCH_MAX_SEQS);
            }
        }
        free(toks);
    }
    free(b.logits);
    fwd_kv_free(b.kv);
    fwd_run_free(b.run);
    fwd_model_free(m);
    bench_unwiden(&bw);
    runner_model_free(&rm);
}

int main(int argc, char **argv)
{
    chk_env env;
    int bench = chk_init(&env, argc, argv, usage);
    if (env.gpu.device_memory != 1) {
        printf("FAIL the CUDA backend does not say device_memory\n");
        env.failures++;
    }
    trk_state trk;
    kern_backend gpu;
    trk_wrap(&trk, &env.gpu, 1, &gpu);
    const char *loaded = NULL;
    runner_model rm = {0};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        if (!loaded || strcmp(loaded, cases[i].config) != 0) {
            if (loaded)
                runner_model_free(&rm);
            load_model(&env, cases[i].config, &rm);
            loaded = cases[i].config;
        }
        check_case(&env, &rm, &cases[i], &gpu, &trk);
        if (cases[i].yoco == FWD_YOCO_OFF) {
            check_replay(&env, &rm, cases[i].config, &gpu);
            check_padded(&env, &rm, cases[i].config, &gpu);
        }
    }
    runner_model_free(&rm);
    load_model(&env, "tiny", &rm);
    check_refusals(&env, &rm, &trk, &gpu);
    check_executor(&env, &rm, &trk, &gpu);
    runner_model_free(&rm);
    int rc = chk_finish(&env, "check_forward", bench, bench_forward);
    return rc ? rc : (g_bench_failures ? 1 : 0);
}
