/* sampling_test.h: helpers shared by the sampler's tests. Reference values here are computed
 * independently of the code under test (plain double softmax, qsort), never copied from it. */
#ifndef DI_TESTS_SAMPLING_TEST_H
#define DI_TESTS_SAMPLING_TEST_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>

#include "common/sampling/sampler.h"
#include "common/util/philox.h"

#define V41_VOCAB 129280u /* DeepSeek-V4.1 vocabulary */

static inline sampler_workspace *test_ws(uint32_t capacity)
{
    sampler_workspace *ws = NULL;
    di_error e;
    cr_assert_eq(sampler_workspace_new(capacity, &ws, &e), DI_OK, "%s", e.msg);
    return ws;
}

/* A plain row: position 0, row 0, no grammar, first output. */
static inline sampler_row test_row(const float *logits, uint32_t n, const sampling_params *p)
{
    return (sampler_row){.logits = logits, .n_vocab = n, .params = p};
}

/* The processed distribution of a row, asserting success. */
static inline sampler_dist test_dist(const sampler_row *row, sampler_workspace *ws,
                                     unsigned slot)
{
    sampler_dist d;
    di_error e;
    cr_assert_eq(sampler_process(row, ws, slot, &d, &e), DI_OK, "%s", e.msg);
    return d;
}

/* Probability of token under d (0 when absent). */
static inline double test_prob(const sampler_dist *d, int32_t token)
{
    return exp(sampler_dist_logprob(d, token));
}

/* Reference softmax of logits / T in double, no filtering. */
static inline void test_softmax(const float *logits, int n, double temperature, double *p)
{
    double mx = -INFINITY, z = 0;
    for (int i = 0; i < n; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    for (int i = 0; i < n; i++)
        z += p[i] = logits[i] == -INFINITY ? 0 : exp((logits[i] - mx) / temperature);
    for (int i = 0; i < n; i++)
        p[i] /= z;
}

/* order[0 .. n): token ids by probability descending, ties to the lower id (insertion sort). */
static inline void test_order(const double *p, int n, int *order)
{
    for (int i = 0; i < n; i++)
        order[i] = i;
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && p[order[j]] > p[order[j - 1]]; j--) {
            int x = order[j];
            order[j] = order[j - 1];
            order[j - 1] = x;
        }
}

/* Reference processed distribution (n <= 64): softmax at T, the shortest most-likely prefix
 * reaching top_p, renormalised into out (0 elsewhere); returns the kept count. */
static inline int test_processed(const float *logits, int n, double t, double top_p, double *out)
{
    double p[64];
    int order[64];
    cr_assert_leq(n, 64);
    test_softmax(logits, n, t, p);
    test_order(p, n, order);
    double cum = 0;
    int kept = 0;
    while (kept < n && cum < top_p)
        cum += p[order[kept++]];
    for (int i = 0; i < n; i++)
        out[i] = 0;
    for (int i = 0; i < kept; i++)
        out[order[i]] = p[order[i]] / cum;
    return kept;
}

/* Pearson's chi-square statistic of counts against probabilities p over n cells (cells with
 * p = 0 must be empty: a count there returns +inf). */
static inline double test_chi_square(const uint64_t *counts, const double *p, int n,
                                     uint64_t total)
{
    double x2 = 0;
    for (int i = 0; i < n; i++) {
        if (p[i] == 0) {
            if (counts[i])
                return INFINITY;
            continue;
        }
        double e = p[i] * (double)total, d = (double)counts[i] - e;
        x2 += d * d / e;
    }
    return x2;
}

/* n logits from N(0, sigma^2) with generator seed. */
static inline void test_normal_logits(float *out, uint32_t n, double sigma, uint64_t seed)
{
    di_rng r;
    di_rng_init(&r, seed);
    for (uint32_t i = 0; i < n; i++)
        out[i] = (float)(sigma * di_rng_normal(&r));
}

#endif
