/* bench_sampler: rows of 129,280 fp32 logits per second on one core, for a table of cases,
 * next to memcpy and read bandwidth over the same logits buffer measured in the same run.
 * Times are thread CPU time (the build machine is shared), so figures are per busy core.
 *
 * Usage: bench_sampler [--seconds S]   (S per case, default 0.3) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/sampling/sampler.h"
#include "common/util/clock.h"
#include "common/util/philox.h"

#define VOCAB 129280u
#define NROWS 32u /* distinct rows cycled through: 16.5 MB of logits, beyond the caches */

/* One benchmark case: how the logits look and which parameters sample them. */
typedef struct bench_case {
    const char *name;  /* printed label */
    double sigma;      /* logits ~ N(0, sigma^2) */
    double peak;       /* added to one token per row (0 = none) */
    float temperature; /* sampling temperature */
    float top_p;       /* top-p */
    uint32_t force;    /* force top-k (0 = off) */
    int mask;          /* 1: a grammar mask allowing about half the vocabulary */
} bench_case;

static const bench_case cases[] = {
    {"random T=1", 2.0, 0, 1.0f, 1.0f, 4096, 0},
    {"random T=1 top-p 0.9", 2.0, 0, 1.0f, 0.9f, 4096, 0},
    {"random T=0 (1e-5)", 2.0, 0, 0.0f, 1.0f, 4096, 0},
    {"peaked T=0.7", 1.0, 15.0, 0.7f, 1.0f, 4096, 0},
    {"peaked T=0.7 top-p 0.9", 1.0, 15.0, 0.7f, 0.9f, 4096, 0},
    {"random grammar mask", 2.0, 0, 1.0f, 0.9f, 4096, 1},
    {"random force top-k off", 2.0, 0, 1.0f, 1.0f, 0, 0},
};

static void fill_logits(float *l, const bench_case *c, uint64_t seed)
{
    di_rng r;
    di_rng_init(&r, seed);
    for (uint32_t row = 0; row < NROWS; row++) {
        float *x = l + (size_t)row * VOCAB;
        for (uint32_t i = 0; i < VOCAB; i++)
            x[i] = (float)(c->sigma * di_rng_normal(&r));
        if (c->peak != 0)
            x[di_rng_below(&r, VOCAB)] += (float)c->peak;
    }
}

/* Seconds of thread CPU time since t0. */
static double cpu_since(uint64_t t0)
{
    return (double)(di_thread_cpu_ns() - t0) * 1e-9;
}

static double bench_memcpy(const float *src, float *dst, size_t bytes, double seconds)
{
    uint64_t t0 = di_thread_cpu_ns();
    size_t reps = 0;
    do {
        memcpy(dst, src, bytes);
        reps++;
    } while (cpu_since(t0) < seconds);
    return (double)bytes * (double)reps / cpu_since(t0) / 1e9;
}

static double bench_read(const float *src, size_t bytes, double seconds, uint64_t *sink)
{
    const uint32_t *w = (const uint32_t *)src;
    size_t n = bytes / 4;
    uint64_t t0 = di_thread_cpu_ns(), acc = 0;
    size_t reps = 0;
    do {
        uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        for (size_t i = 0; i + 4 <= n; i += 4) {
            a0 += w[i];
            a1 += w[i + 1];
            a2 += w[i + 2];
            a3 += w[i + 3];
        }
        acc += a0 + a1 + a2 + a3;
        reps++;
    } while (cpu_since(t0) < seconds);
    *sink += acc;
    return (double)bytes * (double)reps / cpu_since(t0) / 1e9;
}

static int run_case(const bench_case *c, float *logits, uint32_t *mask, sampler_workspace *ws,
                    double seconds)
{
    fill_logits(logits, c, 1234);
    sampling_params p = sampling_params_default();
    p.temperature = c->temperature;
    p.top_p = c->top_p;
    p.force_top_k = c->force;
    p.n_logprobs = 5;
    uint64_t kept = 0, t0 = di_thread_cpu_ns();
    size_t rows = 0;
    do {
        p.seed = rows;
        sampler_row row = {.logits = logits + (size_t)(rows % NROWS) * VOCAB,
                           .n_vocab = VOCAB,
                           .params = &p,
                           .grammar_mask = c->mask ? mask : NULL,
                           .position = rows};
        sampler_result res;
        di_error e;
        if (sampler_sample(&row, ws, &res, &e) != DI_OK) {
            fprintf(stderr, "bench_sampler: %s: %s\n", c->name, e.msg);
            return 1;
        }
        kept += res.n_top;
        rows++;
    } while (cpu_since(t0) < seconds || rows < 2 * NROWS);
    double s = cpu_since(t0), rps = (double)rows / s;
    printf("%-26s %9.1f us/row %9.0f rows/s %7.2f GB/s logits\n", c->name, 1e6 / rps, rps,
           rps * VOCAB * sizeof(float) / 1e9);
    return kept == 0; /* every row reports top logprobs */
}

int main(int argc, char **argv)
{
    double seconds = 0.3;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: bench_sampler [--seconds S]\n"
                   "Times sampling rows of %u fp32 logits on one core (thread CPU time) for\n"
                   "several cases and prints memcpy/read bandwidth of the same buffer.\n", VOCAB);
            return 0;
        }
        if (!strcmp(argv[i], "--seconds") && i + 1 < argc) {
            seconds = atof(argv[++i]);
            if (!(seconds > 0 && seconds <= 60)) {
                fprintf(stderr, "bench_sampler: --seconds %s outside (0, 60]\n", argv[i]);
                return 2;
            }
            continue;
        }
        fprintf(stderr, "bench_sampler: unknown argument '%s' (try --help)\n", argv[i]);
        return 2;
    }
    size_t bytes = (size_t)NROWS * VOCAB * sizeof(float);
    float *logits = malloc(bytes), *copy = malloc(bytes);
    uint32_t *mask = malloc((VOCAB + 31) / 32 * sizeof(uint32_t));
    sampler_workspace *ws = NULL;
    di_error e;
    if (!logits || !copy || !mask || sampler_workspace_new(VOCAB, &ws, &e) != DI_OK) {
        fprintf(stderr, "bench_sampler: out of memory\n");
        return 1;
    }
    di_rng r;
    di_rng_init(&r, 99);
    for (uint32_t w = 0; w < (VOCAB + 31) / 32; w++)
        mask[w] = di_rng_u32(&r);
    memset(copy, 0, bytes);
    fill_logits(logits, &cases[0], 1);
    uint64_t sink = 0;
    double cp = bench_memcpy(logits, copy, bytes, seconds);
    double rd = bench_read(logits, bytes, seconds, &sink);
    printf("vocabulary %u, %u distinct rows (%.1f MB), thread CPU time\n", VOCAB, NROWS,
           bytes / 1e6);
    printf("baseline: memcpy %.2f GB/s (bytes copied), read %.2f GB/s [%llu]\n", cp, rd,
           (unsigned long long)(sink & 1));
    int bad = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        bad |= run_case(&cases[i], logits, mask, ws, seconds);
    sampler_workspace_free(ws);
    free(mask);
    free(copy);
    free(logits);
    return bad;
}
