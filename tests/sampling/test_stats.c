/* Statistical tests: draws follow the processed distribution, and speculative accept/resample
 * reproduces the target's. Seeds are fixed, so each run sees the same numbers; the chi-square
 * bound (40 for at most 7 degrees of freedom, a p-value near 1e-6) is generous on purpose. */
#include <string.h>

#include "tests/sampling/sampling_test.h"

#define CHI2_BOUND 40.0

Test(stats, draws_follow_processed_distribution, .timeout = 60)
{
    enum { V = 8, N = 100000 };
    const float logits[V] = {1.0f, 0.2f, -0.5f, 1.3f, 0.0f, -2.0f, 0.7f, -1.0f};
    sampling_params p = sampling_params_default();
    p.temperature = 0.7f;
    p.top_p = 0.96f;
    p.seed = 3;
    double want[V];
    /* By hand: logits / 0.7 exponentiated total 16.414; p = .3903 (3), .2542 (0), .1656 (6),
     * .0811 (1), .0609 (4), .0298 (2), .0146 (7), .0035 (5); the prefix reaches .96 at the
     * sixth token (.9521 before it, .9819 with it), so 6 of 8 stay. */
    int kept = test_processed(logits, V, 0.7, 0.96f, want);
    cr_assert_eq(kept, 6);
    sampler_workspace *ws = test_ws(V);
    uint64_t counts[V] = {0};
    for (uint64_t pos = 0; pos < N; pos++) {
        sampler_row row = test_row(logits, V, &p);
        row.position = pos;
        sampler_result r;
        cr_assert_eq(sampler_sample(&row, ws, &r, NULL), DI_OK);
        counts[r.token]++;
    }
    double x2 = test_chi_square(counts, want, V, N);
    cr_assert_lt(x2, CHI2_BOUND, "chi-square %f over positions", x2);
    /* Over seeds at one position as well. */
    memset(counts, 0, sizeof counts);
    for (uint64_t s = 0; s < N; s++) {
        p.seed = s * 0x9E3779B97F4A7C15ull;
        sampler_row row = test_row(logits, V, &p);
        sampler_result r;
        cr_assert_eq(sampler_sample(&row, ws, &r, NULL), DI_OK);
        counts[r.token]++;
    }
    x2 = test_chi_square(counts, want, V, N);
    cr_assert_lt(x2, CHI2_BOUND, "chi-square %f over seeds", x2);
    sampler_workspace_free(ws);
}

/* The draft head proposes two tokens from q0, q1 (draft seed, as the head would), the target
 * verifies them: the first output follows p0, the second (when draft 0 passed) follows p1, the
 * bonus (when both passed) p2; draft 0 passes with probability sum_x min(p0(x), q0(x)). The
 * target's row 0 has top-p 0.9, so some drafts fall outside its kept set. */
Test(stats, speculative_reproduces_target, .timeout = 60)
{
    enum { V = 6, N = 60000, K = 2, P = 700 };
    const float t0[V] = {2.0f, 1.0f, 0.5f, 0.0f, -1.0f, 0.3f};
    const float t1[V] = {-1.0f, 0.0f, 1.5f, 1.4f, 0.2f, 0.0f};
    const float t2[V] = {0.0f, 0.0f, 0.0f, 1.0f, 1.0f, 2.0f};
    const float q0[V] = {0.5f, 1.5f, 0.5f, 1.0f, 0.0f, 0.0f};
    const float q1[V] = {0.0f, 0.0f, 2.5f, 0.0f, 0.0f, 0.0f};
    const float *tl[K + 1] = {t0, t1, t2}, *ql[K] = {q0, q1};
    sampling_params tp0 = sampling_params_default(), tp = tp0, dp = tp0;
    tp0.top_p = 0.9f;
    double want[K + 1][V], q[K][V];
    cr_assert_eq(test_processed(t0, V, 1.0, 0.9f, want[0]), 4, "row 0 keeps 4 (hand check)");
    test_processed(t1, V, 1.0, 1.0, want[1]);
    test_processed(t2, V, 1.0, 1.0, want[2]);
    test_softmax(q0, V, 1.0, q[0]);
    test_softmax(q1, V, 1.0, q[1]);
    double accept0 = 0;
    for (int x = 0; x < V; x++)
        accept0 += fmin(want[0][x], q[0][x]);
    sampler_workspace *ws = test_ws(V);
    uint64_t counts[K + 1][V];
    memset(counts, 0, sizeof counts);
    uint64_t n_at[K + 1] = {0}, passed0 = 0;
    for (uint64_t s = 0; s < N; s++) {
        /* Row 0 has top-p 0.9, rows 1 and 2 none; every target row has the request's seed. */
        tp0.seed = tp.seed = dp.seed = s;
        sampler_row target[K + 1], draft[K];
        int32_t tokens[K];
        for (uint32_t i = 0; i <= K; i++) {
            target[i] = test_row(tl[i], V, i == 0 ? &tp0 : &tp);
            target[i].position = P;
            target[i].row = i;
        }
        for (uint32_t i = 0; i < K; i++) {
            draft[i] = test_row(ql[i], V, &dp);
            draft[i].position = P + 1;
            draft[i].row = i;
            draft[i].draft = true;
            sampler_result r;
            cr_assert_eq(sampler_sample(&draft[i], ws, &r, NULL), DI_OK);
            tokens[i] = r.token;
        }
        sampler_verify_in in = {.target = target, .draft = draft, .draft_tokens = tokens, .k = K};
        sampler_result res[K + 1];
        uint32_t na;
        di_error e;
        cr_assert_eq(sampler_verify(&in, ws, res, &na, &e), DI_OK, "%s", e.msg);
        passed0 += na >= 1;
        for (uint32_t i = 0; i <= na; i++) {
            counts[i][res[i].token]++;
            n_at[i]++;
        }
    }
    for (int i = 0; i <= K; i++) {
        double x2 = test_chi_square(counts[i], want[i], V, n_at[i]);
        cr_assert_lt(x2, CHI2_BOUND, "output %d: chi-square %f over %llu", i, x2,
                     (unsigned long long)n_at[i]);
    }
    double rate = (double)passed0 / N;
    cr_assert(fabs(rate - accept0) < 0.01, "draft 0 passed %.4f, want %.4f", rate, accept0);
    cr_assert_gt(n_at[2], 1000u, "both drafts passed often enough to test the bonus row");
    sampler_workspace_free(ws);
}
