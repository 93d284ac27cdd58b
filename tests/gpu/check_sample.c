/* check_sample: the CUDA backend's sampler (kern_ops.sample, kernels/cuda/sample.cu) against
 * the host sampler (common/sampling) on the same logits: per row the token, its logprob, the
 * top logprobs, the kept mass M and the kept count must be identical, and a row the host
 * refuses (NaN or +inf logit, every token blocked) must be refused with the same status (its
 * message comes from the host sampler through sampler_sample_backend).
 * Rows: random logits of several spreads, and adversarial ones: every logit equal (ties
 * everywhere), logits on a coarse grid (ties at the force-top-k and top-k cuts), all -inf but
 * one, ascending logits (the host's sampled floor misses), signed zeros and huge magnitudes,
 * temperatures 0 (1e-5), 1e-3, 1, 100 and 1e4, top_p 1e-30 (the smallest prefix), 0.5, 0.9
 * and 1, top_k 1, 50 and the whole vocabulary, force top-k off, 1, 4,096 and the vocabulary,
 * blacklists, a banned EOS, grammar masks, up to 20 logprobs, draft rows, large positions;
 * vocabularies of 129,280 (V4.1), 1,000 and 37; batches of 1 to 64 rows per call.
 * With --bench: 64 rows of 129,280 on the device next to what it replaces (the logits copied
 * to the host and the host sampler), and the copy bandwidth of the same run.
 * Exit 0: all match; 1: a mismatch (parameters and first mismatches printed); 2: setup error. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/sampling/sampler.h"
#include "common/sampling/sampler_backend.h"
#include "kernels/cuda/backend_cuda.h"
#include "tests/gpu/check_util.h"
#include "tests/gpu/gpu_common.h"

static const char usage[] =
    "usage: check_sample [--bench] [--seed N]\n"
    "  the CUDA sampler against the host sampler (tokens, logprobs, masses identical);\n"
    "  --bench times 64 rows of 129,280 logits against download + host sampler\n";

#define MAX_ROWS 64

enum { L_NORMAL, L_EQUAL, L_GRID, L_ONE_FINITE, L_ASCENDING, L_ZEROS_HUGE, L_NAN, L_BLOCKED,
       L_KINDS };
static const char *const l_name[L_KINDS] = {"normal", "equal", "grid", "one-finite",
                                            "ascending", "zeros-huge", "nan", "blocked"};

typedef struct row_case {
    int kind;
    double spread;
    sampling_params p;
    int32_t blacklist[8];
    int mask;                   /* 1: a random grammar mask (about half the tokens) */
    uint32_t output_index;
    uint64_t position;
    uint32_t row;
    int draft;
} row_case;

static void fill_logits(float *x, uint32_t V, const row_case *rc, di_rng *rng)
{
    switch (rc->kind) {
    case L_EQUAL:
        for (uint32_t i = 0; i < V; i++)
            x[i] = 0.25f;
        break;
    case L_GRID:
        for (uint32_t i = 0; i < V; i++)
            x[i] = (float)floor(di_rng_normal(rng) * 2.0) * 0.5f;
        break;
    case L_ONE_FINITE:
    case L_BLOCKED:
        for (uint32_t i = 0; i < V; i++)
            x[i] = -INFINITY;
        if (rc->kind == L_ONE_FINITE)
            x[di_rng_below(rng, V)] = (float)di_rng_normal(rng);
        break;
    case L_ASCENDING:
        for (uint32_t i = 0; i < V; i++)
            x[i] = (float)i * 1e-3f;
        break;
    case L_ZEROS_HUGE:
        for (uint32_t i = 0; i < V; i++) {
            uint64_t r = di_rng_below(rng, 4);
            x[i] = r == 0 ? 0.0f : r == 1 ? -0.0f : (float)(di_rng_normal(rng) * 1e30);
        }
        break;
    default:
        for (uint32_t i = 0; i < V; i++)
            x[i] = (float)(di_rng_normal(rng) * rc->spread);
        if (rc->kind == L_NAN)
            x[di_rng_below(rng, V)] = di_rng_below(rng, 2) ? NAN : INFINITY;
        break;
    }
}

/* Random parameters drawn from the adversarial values. */
static void draw_case(row_case *rc, uint32_t V, int kind, di_rng *rng)
{
    static const float temps[] = {0.0f, 1e-3f, 0.7f, 1.0f, 100.0f, 1e4f};
    static const float top_ps[] = {1e-30f, 0.5f, 0.9f, 1.0f, 1.0f};
    static const double spreads[] = {1.0, 3.0, 30.0, 1e-4};
    memset(rc, 0, sizeof(*rc));
    rc->kind = kind;
    rc->spread = spreads[di_rng_below(rng, 4)];
    rc->p = sampling_params_default();
    rc->p.temperature = temps[di_rng_below(rng, 6)];
    rc->p.top_p = top_ps[di_rng_below(rng, 5)];
    int32_t ks[] = {-1, -1, 1, 50, (int32_t)V};
    rc->p.top_k = ks[di_rng_below(rng, 5)];
    uint32_t fs[] = {SAMPLER_DEFAULT_FORCE_TOP_K, SAMPLER_DEFAULT_FORCE_TOP_K, 0, 1, V};
    rc->p.force_top_k = fs[di_rng_below(rng, 5)];
    uint32_t lps[] = {0, 0, 1, 5, SAMPLER_MAX_LOGPROBS};
    rc->p.n_logprobs = lps[di_rng_below(rng, 5)];
    rc->p.seed = di_rng_u64(rng);
    if (di_rng_below(rng, 4) == 0) {
        rc->p.n_blacklist = 1 + (uint32_t)di_rng_below(rng, 8);
        for (uint32_t i = 0; i < rc->p.n_blacklist; i++)
            rc->blacklist[i] = (int32_t)di_rng_below(rng, V);
    }
    if (di_rng_below(rng, 4) == 0) {
        rc->p.eos_id = (int32_t)di_rng_below(rng, V);
        rc->p.first_n_no_eos = 3;
        rc->output_index = (uint32_t)di_rng_below(rng, 6);
    }
    rc->mask = di_rng_below(rng, 5) == 0;
    rc->position = di_rng_below(rng, 3) ? di_rng_below(rng, 1u << 20) : di_rng_u64(rng) >> 8;
    rc->row = (uint32_t)di_rng_below(rng, 4);
    rc->draft = di_rng_below(rng, 6) == 0;
}

static int same_float(float a, float b)
{
    return memcmp(&a, &b, sizeof a) == 0;
}

/* One call of n rows of V tokens: host sampler per row, device sampler over all. */
static void check_batch(chk_env *env, uint32_t V, uint32_t n, const int *kinds, int forced,
                        sampler_workspace *ws)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    size_t words = ((size_t)V + 31) / 32;
    float *x = chk_malloc((size_t)n * V * sizeof(float));
    uint32_t *masks = chk_malloc((size_t)n * words * sizeof(uint32_t));
    row_case rc[MAX_ROWS];
    sampler_row rows[MAX_ROWS];
    for (uint32_t i = 0; i < n; i++) {
        draw_case(&rc[i], V, kinds ? kinds[i] : (int)di_rng_below(&rng, L_NAN), &rng);
        if (forced >= 0)
            rc[i].p.force_top_k = (uint32_t)forced;
        rc[i].p.blacklist = rc[i].blacklist;
        fill_logits(x + (size_t)i * V, V, &rc[i], &rng);
        uint32_t *m = masks + (size_t)i * words;
        for (size_t w = 0; w < words; w++)
            m[w] = (uint32_t)di_rng_u64(&rng);
        rows[i] = (sampler_row){.logits = x + (size_t)i * V, .n_vocab = V, .params = &rc[i].p,
                                .grammar_mask = rc[i].mask ? m : NULL,
                                .output_index = rc[i].output_index,
                                .position = rc[i].position, .row = rc[i].row,
                                .draft = rc[i].draft};
    }
    /* the host */
    sampler_result want[MAX_ROWS];
    uint64_t want_total[MAX_ROWS];
    uint32_t want_n[MAX_ROWS];
    for (uint32_t i = 0; i < n; i++) {
        sampler_dist d;
        di_error e;
        want_total[i] = 0, want_n[i] = 0;
        if (sampler_process(&rows[i], ws, 0, &d, &e) == DI_OK)
            want_total[i] = d.total, want_n[i] = d.n;
        if (sampler_sample(&rows[i], ws, &want[i], &want[i].err) != DI_OK)
            want[i].token = -1;
    }
    /* the device: the raw entry (masses) and the helper (results, messages) */
    float *dx = chk_dev_copy(env, x, (size_t)n * V * sizeof(float));
    kern_sample_row kr[MAX_ROWS];
    kern_sample_out ko[MAX_ROWS];
    uint32_t *kmaps = chk_malloc((size_t)n * words * sizeof(uint32_t));
    for (uint32_t i = 0; i < n; i++) {
        di_error e;
        chk_cpu_status(sampler_kern_row(&rows[i], kmaps + (size_t)i * words, &kr[i], &e),
                       "sampler_kern_row");
    }
    kern_sample ks = {.n_rows = n, .n_vocab = V, .logits = dx, .logits_stride = V, .rows = kr,
                      .out = ko};
    char what[160];
    snprintf(what, sizeof what, "sample V=%u rows=%u seed=%" PRIu64, V, n, seed);
    size_t bad = chk_gpu_status(env, env->gpu.ops.sample(env->gpu.ctx, &ks), what);
    /* outcomes left in device memory (one step ahead): the same, read back later */
    kern_sample_out *dko = chk_dev_alloc(env, (size_t)n * sizeof(kern_sample_out));
    kern_sample_out ko2[MAX_ROWS];
    kern_sample ks2 = ks;
    ks2.out = NULL;
    ks2.out_dev = dko;
    bad += chk_gpu_status(env, env->gpu.ops.sample(env->gpu.ctx, &ks2), what);
    chk_get(env, ko2, dko, (size_t)n * sizeof(kern_sample_out));
    chk_dev_free(env, dko);
    for (uint32_t i = 0; i < n && !bad; i++) {
        const kern_sample_out *a = &ko[i], *b = &ko2[i];
        int same = a->status == b->status && a->token == b->token;
        if (same && a->status == KERN_SAMPLE_OK) {
            same = !memcmp(&a->logprob, &b->logprob, sizeof(float)) && a->n_top == b->n_top &&
                   a->total == b->total && a->n_kept == b->n_kept &&
                   !memcmp(a->top_tokens, b->top_tokens, a->n_top * sizeof(int32_t)) &&
                   !memcmp(a->top_logprobs, b->top_logprobs, a->n_top * sizeof(float));
        } else if (same) {
            same = a->token == 0;
        }
        if (!same) {
            printf("FAIL %s row %u: out_dev gives status %d token %d, out %d %d\n", what, i,
                   b->status, b->token, a->status, a->token);
            bad++;
        }
    }
    sampler_result got[MAX_ROWS];
    size_t n_failed = 0;
    di_error e;
    di_status st = sampler_sample_backend(&env->gpu, dx, V, rows, n, ws, got, &n_failed, &e);
    if (st != DI_OK) {
        printf("FAIL %s: sampler_sample_backend: %s\n", what, e.msg);
        bad++;
    }
    for (uint32_t i = 0; i < n && !bad; i++) {
        const row_case *c = &rc[i];
        char row_what[400];
        snprintf(row_what, sizeof row_what,
                 "%s row %u (%s spread %g T %g top_p %g top_k %d force %u logprobs %u "
                 "blacklist %u eos %d/%u mask %d draft %d position %" PRIu64 ")",
                 what, i, l_name[c->kind], c->spread, (double)c->p.temperature,
                 (double)c->p.top_p, c->p.top_k, c->p.force_top_k, c->p.n_logprobs,
                 c->p.n_blacklist, c->p.eos_id, c->output_index, c->mask, c->draft,
                 c->position);
        const sampler_result *w = &want[i], *g = &got[i];
        if (w->err.code != DI_OK) {
            int dev_refused = ko[i].status != KERN_SAMPLE_OK;
            if (!dev_refused || g->err.code != w->err.code || strcmp(g->err.msg, w->err.msg)) {
                printf("FAIL %s: host refuses (%s), device status %d, helper %s\n", row_what,
                       w->err.msg, ko[i].status, g->err.msg);
                bad++;
            }
            continue;
        }
        int ok = ko[i].status == KERN_SAMPLE_OK && g->err.code == DI_OK &&
                 g->token == w->token && ko[i].token == w->token && same_float(g->logprob, w->logprob) &&
                 g->n_top == w->n_top && ko[i].total == want_total[i] && ko[i].n_kept == want_n[i];
        for (uint32_t j = 0; ok && j < w->n_top; j++)
            ok = g->top_tokens[j] == w->top_tokens[j] &&
                 same_float(g->top_logprobs[j], w->top_logprobs[j]);
        if (!ok) {
            printf("FAIL %s: host token %d logprob %.9g n_top %u M %" PRIu64 " kept %u; device "
                   "status %d token %d logprob %.9g n_top %u M %" PRIu64 " kept %u (%s)\n",
                   row_what, w->token, (double)w->logprob, w->n_top, want_total[i], want_n[i],
                   ko[i].status, g->token, (double)g->logprob, g->n_top, ko[i].total,
                   ko[i].n_kept, g->err.msg);
            bad++;
        }
    }
    chk_count(env, bad);
    chk_dev_free(env, dx);
    free(x);
    free(masks);
    free(kmaps);
}

/* Refused inputs: a clear status, nothing launched. */
static void check_refusals(chk_env *env)
{
    float *dx = chk_dev_alloc(env, 64 * sizeof(float));
    kern_sample_row r = {.temperature = 1.0f, .top_p = 1.0f, .top_k = -1};
    kern_sample_out o;
    kern_sample ks = {.n_rows = 1, .n_vocab = 64, .logits = dx, .logits_stride = 64, .rows = &r,
                      .out = &o};
    size_t bad = 0;
    kern_sample k2 = ks;
    k2.logits_stride = 63;
    bad += chk_expect(env, env->gpu.ops.sample(env->gpu.ctx, &k2), DI_EINVAL, "stride < vocab");
    k2 = ks;
    k2.out = NULL;
    bad += chk_expect(env, env->gpu.ops.sample(env->gpu.ctx, &k2), DI_EINVAL, "out NULL");
    kern_sample_row r2 = r;
    r2.temperature = 0.0f;
    k2 = ks;
    k2.rows = &r2;
    bad += chk_expect(env, env->gpu.ops.sample(env->gpu.ctx, &k2), DI_EINVAL, "temperature 0");
    r2 = r;
    r2.top_p = 0.0f;
    bad += chk_expect(env, env->gpu.ops.sample(env->gpu.ctx, &k2), DI_EINVAL, "top_p 0");
    r2 = r;
    r2.n_logprobs = 21;
    bad += chk_expect(env, env->gpu.ops.sample(env->gpu.ctx, &k2), DI_EINVAL, "21 logprobs");
    bad += chk_expect(env, env->gpu.ops.sample(env->gpu.ctx, NULL), DI_EINVAL, "params NULL");
    bad += chk_expect(env, env->gpu.ops.sample(env->gpu.ctx, &ks), DI_OK, "a valid call after");
    kern_backend cpu = env->cpu;
    sampler_result res;
    di_error e;
    sampling_params p = sampling_params_default();
    sampler_row row = {.n_vocab = 64, .params = &p};
    sampler_workspace *ws = NULL;
    chk_cpu_status(sampler_workspace_new(64, &ws, &e), "workspace");
    bad += chk_expect(env, sampler_sample_backend(&cpu, dx, 64, &row, 1, ws, &res, NULL, &e),
                      DI_EUNSUPPORTED, "helper on a backend without sample");
    sampler_workspace_free(ws);
    chk_count(env, bad);
    chk_dev_free(env, dx);
}

static void sweep(chk_env *env)
{
    sampler_workspace *ws = NULL;
    di_error e;
    chk_cpu_status(sampler_workspace_new(129280, &ws, &e), "sampler workspace");
    check_refusals(env);
    const uint32_t vocabs[] = {129280, 1000, 37};
    /* every adversarial kind alone, in each vocabulary */
    for (int v = 0; v < 3; v++)
        for (int k = 0; k < L_KINDS; k++)
            for (int rep = 0; rep < 3; rep++) {
                int kinds[1] = {k};
                check_batch(env, vocabs[v], 1, kinds, -1, ws);
            }
    /* force top-k off, 1 and the vocabulary on every kind */
    const int forces[] = {0, 1, 129280};
    for (int f = 0; f < 3; f++)
        for (int k = 0; k < L_KINDS; k++) {
            int kinds[4] = {k, k, k, k};
            check_batch(env, 129280, 4, kinds, forces[f], ws);
        }
    /* mixed batches: random kinds and parameters, every row its own */
    for (int b = 0; b < 12; b++)
        check_batch(env, 129280, 64, NULL, -1, ws);
    for (int b = 0; b < 12; b++)
        check_batch(env, b % 2 ? 1000 : 37, 64, NULL, -1, ws);
    int kinds[64];
    for (int i = 0; i < 64; i++)
        kinds[i] = i % L_KINDS;
    check_batch(env, 129280, 64, kinds, -1, ws);
    sampler_workspace_free(ws);
}

/* ---- bench ---- */

typedef struct bench_arg {
    chk_env *env;
    kern_sample ks;
} bench_arg;

static di_status bench_call(void *arg, int i)
{
    (void)i;
    bench_arg *a = arg;
    return a->env->gpu.ops.sample(a->env->gpu.ctx, &a->ks);
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static void bench(chk_env *env)
{
    const uint32_t V = 129280, n = 64;
    di_rng rng;
    di_rng_init(&rng, env->seed ^ 0x5a3);
    size_t bytes = (size_t)n * V * sizeof(float);
    float *x = chk_malloc(bytes), *back = chk_malloc(bytes);
    chk_fill_f32(x, (size_t)n * V, 3.0, &rng);
    float *dx = chk_dev_copy(env, x, bytes);
    double copy = gpu_copy_gbs((size_t)256 << 20, 10);
    sampler_workspace *ws = NULL;
    di_error e;
    chk_cpu_status(sampler_workspace_new(V, &ws, &e), "sampler workspace");
    printf("\n%-52s %10s\n", "64 rows x 129,280 logits", "ms");
    static const struct {
        const char *name;
        uint32_t force, logprobs;
        float top_p;
        int32_t top_k;
    } cfg[] = {
        {"device sampler, defaults (force top-k 4,096)", SAMPLER_DEFAULT_FORCE_TOP_K, 0, 1.0f, -1},
        {"device sampler, top_p 0.9, top_k 50, 20 logprobs", SAMPLER_DEFAULT_FORCE_TOP_K, 20, 0.9f, 50},
        {"device sampler, force top-k off", 0, 0, 1.0f, -1},
    };
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        kern_sample_row kr[64];
        kern_sample_out ko[64];
        for (uint32_t i = 0; i < n; i++)
            kr[i] = (kern_sample_row){.temperature = 1.0f, .top_p = cfg[c].top_p,
                                      .top_k = cfg[c].top_k, .force_top_k = cfg[c].force,
                                      .n_logprobs = cfg[c].logprobs, .seed = i, .stream = 3 * i};
        bench_arg a = {env, {.n_rows = n, .n_vocab = V, .logits = dx, .logits_stride = V,
                             .rows = kr, .out = ko}};
        double ms = chk_time_ms(env, bench_call, &a, 3, 25);
        printf("%-52s %10.3f\n", cfg[c].name, ms);
    }
    /* what it replaces: the logits to the host, the host sampler on one thread */
    float dl[9];
    for (int r = 0; r < 9; r++) {
        double t0 = now_ms();
        env->gpu.ops.to_host(env->gpu.ctx, back, dx, bytes);
        chk_sync(env);
        dl[r] = (float)(now_ms() - t0);
    }
    sampling_params p = sampling_params_default();
    sampler_row rows[64];
    sampler_result res[64];
    for (uint32_t i = 0; i < n; i++)
        rows[i] = (sampler_row){.logits = back + (size_t)i * V, .n_vocab = V, .params = &p,
                                .position = 100, .row = 0};
    float hs[5];
    for (int r = 0; r < 5; r++) {
        double t0 = now_ms();
        sampler_sample_batch(rows, n, ws, res, NULL, &e);
        hs[r] = (float)(now_ms() - t0);
    }
    double d_ms = gpu_median(dl, 9), h_ms = gpu_median(hs, 5);
    printf("%-52s %10.3f  (%.0f GB/s; device copy %.0f GB/s)\n", "logits to the host (33 MB)",
           d_ms, (double)bytes / (d_ms * 1e-3) / 1e9, copy);
    printf("%-52s %10.3f\n", "host sampler, defaults, one thread", h_ms);
    sampler_workspace_free(ws);
    chk_dev_free(env, dx);
    free(x);
    free(back);
}

int main(int argc, char **argv)
{
    chk_env env;
    int want_bench = chk_init(&env, argc, argv, usage);
    sweep(&env);
    return chk_finish(&env, "check_sample", want_bench, bench);
}
