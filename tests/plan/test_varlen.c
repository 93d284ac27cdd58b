/* MTP varlen: the explainer's worked examples, the rules one by one, the failure paths, and a
 * property test against an exhaustive search over every allocation of drafts. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "common/engine/varlen.h"
#include "common/util/philox.h"

#define TOL 1e-12

/* Up to 8 requests of up to 8 drafts, for building inputs in tests. */
typedef struct vcase {
    double conf[8][8];
    uint32_t nd[8];
    uint32_t n;
    varlen_request reqs[8];
} vcase;

static void vcase_bind(vcase *c)
{
    for (uint32_t i = 0; i < c->n; i++)
        c->reqs[i] = (varlen_request){.conf = c->conf[i], .num_drafts = c->nd[i]};
}

static varlen_plan run_ok(vcase *c, const varlen_graph_time *t, size_t nt, double sampler)
{
    vcase_bind(c);
    varlen_plan p;
    di_error e;
    cr_assert_eq(varlen_schedule(c->reqs, c->n, t, nt, sampler, &p, &e), DI_OK, "%s", e.msg);
    return p;
}

/* The explainer's W/X/Y/Z: confidences W .95 .90 .80, X .85 .60 .30, Y .50 .20 .10,
 * Z .30 .10 .05; graphs 4 rows 8.1 ms, 8 rows 8.6, 16 rows 12.0; sampler 0.4.
 * Ranking: W.95 W.90 X.85 W.80 X.60 Y.50 X.30 Z.30 (tie X before Z) Y.20 Y.10 Z.10 Z.05.
 * Tokens per ms by rows, computed by hand:
 *   4: 4/8.5 = .471   5: 4.95/9.0 = .550   6: 5.85/9.0 = .650   7: 6.70/9.0 = .744
 *   8: 7.50/9.0 = .833   9: 8.10/12.4 = .653  ...  16: 9.65/12.4 = .778
 * Best: 8 rows; the 4 extra rows go to W, W, X, W: W 3 drafts, X 1, Y 0, Z 0. */
static vcase wxyz(void)
{
    vcase c = {.n = 4, .nd = {3, 3, 3, 3},
               .conf = {{.95, .90, .80}, {.85, .60, .30}, {.50, .20, .10}, {.30, .10, .05}}};
    return c;
}

Test(varlen, explainer_wxyz_picks_8_rows)
{
    vcase c = wxyz();
    varlen_graph_time t[] = {{4, 8.1}, {8, 8.6}, {16, 12.0}};
    varlen_plan p = run_ok(&c, t, 3, 0.4);
    cr_assert_eq(p.rows, 8);
    cr_assert_eq(p.graph_rows, 8);
    const uint32_t want[] = {3, 1, 0, 0};
    for (int i = 0; i < 4; i++)
        cr_assert_eq(p.drafts[i], want[i], "request %d: %u drafts", i, p.drafts[i]);
    cr_assert_float_eq(p.expected_tokens, 7.50, TOL);
    cr_assert_float_eq(p.step_ms, 9.0, TOL);
    cr_assert_float_eq(p.tokens_per_ms, 7.50 / 9.0, TOL);
    varlen_plan_free(&p);
    cr_assert_null(p.drafts);
}

/* Same, with the 16-row graph at 10.4 ms: 16 rows give 9.65 / 10.8 = 0.894 tokens per ms,
 * above 8 rows' 0.833 and above 15 rows' 9.60 / 10.8 = 0.889; every request checks all 3. */
Test(varlen, explainer_wxyz_cheap_16_graph_checks_everything)
{
    vcase c = wxyz();
    varlen_graph_time t[] = {{16, 10.4}, {4, 8.1}, {8, 8.6}}; /* any order */
    varlen_plan p = run_ok(&c, t, 3, 0.4);
    cr_assert_eq(p.rows, 16);
    cr_assert_eq(p.graph_rows, 16);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(p.drafts[i], 3);
    cr_assert_float_eq(p.expected_tokens, 9.65, 1e-9);
    cr_assert_float_eq(p.tokens_per_ms, 9.65 / 10.8, 1e-9);
    cr_assert(fabs(p.tokens_per_ms - 0.894) < 0.0005);
    varlen_plan_free(&p);
}

/* Explainer Pass 4 "Choose how many drafts to check": U, V, W with 2 drafts each; graphs
 * 4 rows 7.0 ms, 8 rows 7.6, 9 rows 9.5; sampler 0.4. The confidences were lost from the
 * explainer; reconstructed: U .9 .8, V .7 .4, W .5 .2. Ranking U.9 U.8 V.7 W.5 V.4 W.2.
 *   3: 3.0/7.4 = .405   4: 3.9/7.4 = .527   5: 4.7/8.0 = .588   6: 5.4/8.0 = .675
 *   7: 5.9/8.0 = .738   8: 6.3/8.0 = .788   9: 6.5/9.9 = .657
 * Rows 8 and 9 are the question's; 8 wins: U checks 2, V 2, W 1. */
Test(varlen, explainer_uvw_picks_8_of_9_rows)
{
    vcase c = {.n = 3, .nd = {2, 2, 2}, .conf = {{.9, .8}, {.7, .4}, {.5, .2}}};
    varlen_graph_time t[] = {{4, 7.0}, {8, 7.6}, {9, 9.5}};
    varlen_plan p = run_ok(&c, t, 3, 0.4);
    cr_assert_eq(p.rows, 8);
    const uint32_t want[] = {2, 2, 1};
    for (int i = 0; i < 3; i++)
        cr_assert_eq(p.drafts[i], want[i]);
    cr_assert_float_eq(p.tokens_per_ms, 6.3 / 8.0, TOL);
    varlen_plan_free(&p);
}

/* Explainer Pass 5 "Pick the verify lengths": A and B with 3 drafts; graphs 2 rows 6.0 ms,
 * 4 rows 6.1, 8 rows 9.0; sampler 0.2. Confidences lost; reconstructed: A .9 .7 .5,
 * B .6 .3 .1. Ranking A.9 A.7 B.6 A.5 B.3 B.1.
 *   2: 2.0/6.2 = .323   3: 2.9/6.3 = .460   4: 3.6/6.3 = .571   5: 4.2/9.2 = .457
 *   6: 4.7/9.2 = .511   7: 5.0/9.2 = .543   8: 5.1/9.2 = .554
 * Best 4 rows: A checks 2 drafts, B none. */
Test(varlen, explainer_two_requests_fill_the_4_row_graph)
{
    vcase c = {.n = 2, .nd = {3, 3}, .conf = {{.9, .7, .5}, {.6, .3, .1}}};
    varlen_graph_time t[] = {{2, 6.0}, {4, 6.1}, {8, 9.0}};
    varlen_plan p = run_ok(&c, t, 3, 0.2);
    cr_assert_eq(p.rows, 4);
    cr_assert_eq(p.graph_rows, 4);
    cr_assert_eq(p.drafts[0], 2);
    cr_assert_eq(p.drafts[1], 0);
    cr_assert_float_eq(p.tokens_per_ms, 3.6 / 6.3, TOL);
    varlen_plan_free(&p);
}

/* The sampler's time counts: with sampler 0 the 4-row graph of the example above still wins,
 * but a sampler time that dwarfs the graph times makes more tokens per step worth it. With
 * sampler 100 ms: 4 rows 3.6/106.1 = .0339, 8 rows 5.1/109.0 = .0468. */
Test(varlen, sampler_time_is_added_to_every_size)
{
    vcase c = {.n = 2, .nd = {3, 3}, .conf = {{.9, .7, .5}, {.6, .3, .1}}};
    varlen_graph_time t[] = {{2, 6.0}, {4, 6.1}, {8, 9.0}};
    varlen_plan p = run_ok(&c, t, 3, 100.0);
    cr_assert_eq(p.rows, 8);
    cr_assert_float_eq(p.step_ms, 109.0, TOL);
    varlen_plan_free(&p);
}

/* Ties between requests go to the lower request: two equal drafts, room for one. */
Test(varlen, ties_go_to_the_lower_request)
{
    vcase c = {.n = 3, .nd = {0, 1, 1}, .conf = {{0}, {.5}, {.5}}};
    varlen_graph_time t[] = {{3, 1.0}, {4, 1.0}, {5, 100.0}};
    varlen_plan p = run_ok(&c, t, 3, 0.0);
    cr_assert_eq(p.rows, 4);
    cr_assert_eq(p.drafts[0], 0);
    cr_assert_eq(p.drafts[1], 1);
    cr_assert_eq(p.drafts[2], 0);
    varlen_plan_free(&p);
}

/* Equal tokens per ms keep the shorter prefix: a draft of confidence 0 on a graph that costs
 * the same adds a row and no token. */
Test(varlen, equal_rates_keep_fewer_rows)
{
    vcase c = {.n = 1, .nd = {1}, .conf = {{0.0}}};
    varlen_graph_time t[] = {{2, 1.0}};
    varlen_plan p = run_ok(&c, t, 1, 0.0);
    cr_assert_eq(p.rows, 1);
    cr_assert_eq(p.graph_rows, 2, "1 row runs on the smallest size that fits, 2");
    cr_assert_eq(p.drafts[0], 0);
    varlen_plan_free(&p);
}

/* The largest graph caps the rows, and a request's drafts are a prefix: with every draft
 * certain and a flat cost, all the room goes to request 0 first (ties to the lower request,
 * then the earlier draft). */
Test(varlen, largest_graph_caps_rows_and_drafts_stay_in_order)
{
    vcase c = {.n = 2, .nd = {3, 3}, .conf = {{1, 1, 1}, {1, 1, 1}}};
    varlen_graph_time t[] = {{2, 1.0}, {4, 1.0}};
    varlen_plan p = run_ok(&c, t, 2, 0.0);
    cr_assert_eq(p.rows, 4);
    cr_assert_eq(p.drafts[0], 2);
    cr_assert_eq(p.drafts[1], 0);
    varlen_plan_free(&p);
}

/* Requests without drafts still get their row; equal confidences within a request are fine. */
Test(varlen, requests_without_drafts_and_flat_confidences)
{
    vcase c = {.n = 3, .nd = {0, 2, 0}, .conf = {{0}, {.5, .5}, {0}}};
    varlen_graph_time t[] = {{3, 1.0}, {5, 1.0}};
    varlen_plan p = run_ok(&c, t, 2, 0.0);
    cr_assert_eq(p.rows, 5);
    cr_assert_eq(p.drafts[1], 2);
    cr_assert_float_eq(p.expected_tokens, 4.0, TOL);
    varlen_plan_free(&p);
}

/* ---- failure paths: DI_EINVAL with the condition named, output untouched -------------- */

static void expect_einval(vcase *c, const varlen_graph_time *t, size_t nt, double sampler,
                          const char *needle)
{
    vcase_bind(c);
    varlen_plan p;
    memset(&p, 0xab, sizeof(p));
    varlen_plan before = p;
    di_error e = {0};
    cr_assert_eq(varlen_schedule(c->reqs, c->n, t, nt, sampler, &p, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, needle) != NULL, "message '%s' lacks '%s'", e.msg, needle);
    cr_assert(memcmp(&p, &before, sizeof(p)) == 0, "output touched on failure");
}

Test(varlen, table_too_small_for_one_row_each_is_an_error)
{
    vcase c = {.n = 5, .nd = {0, 0, 0, 0, 0}};
    varlen_graph_time t[] = {{2, 1.0}, {4, 2.0}};
    expect_einval(&c, t, 2, 0.0, "largest graph (4 rows) cannot hold one row for each of 5");
}

Test(varlen, bad_confidences_are_errors)
{
    varlen_graph_time t[] = {{8, 1.0}};
    vcase up = {.n = 2, .nd = {0, 2}, .conf = {{0}, {.4, .5}}};
    expect_einval(&up, t, 1, 0.0, "confidences[1][1] = 0.5 exceeds confidences[1][0] = 0.4");
    vcase big = {.n = 1, .nd = {1}, .conf = {{1.5}}};
    expect_einval(&big, t, 1, 0.0, "outside [0, 1]");
    vcase neg = {.n = 1, .nd = {1}, .conf = {{-0.1}}};
    expect_einval(&neg, t, 1, 0.0, "outside [0, 1]");
    vcase nan = {.n = 1, .nd = {1}, .conf = {{NAN}}};
    expect_einval(&nan, t, 1, 0.0, "outside [0, 1]");
    vcase many = {.n = 1, .nd = {VARLEN_MAX_DRAFTS + 1}, .conf = {{0}}};
    expect_einval(&many, t, 1, 0.0, "more than");
    vcase none = {.n = 0};
    expect_einval(&none, t, 1, 0.0, "no requests");
}

Test(varlen, bad_tables_and_sampler_are_errors)
{
    vcase c = {.n = 1, .nd = {0}};
    varlen_graph_time dup[] = {{4, 1.0}, {4, 2.0}};
    expect_einval(&c, dup, 2, 0.0, "appears twice");
    varlen_graph_time zero[] = {{0, 1.0}};
    expect_einval(&c, zero, 1, 0.0, "graph size 0");
    varlen_graph_time slow[] = {{4, 0.0}};
    expect_einval(&c, slow, 1, 0.0, "must be > 0");
    varlen_graph_time inf[] = {{4, INFINITY}};
    expect_einval(&c, inf, 1, 0.0, "must be > 0");
    expect_einval(&c, NULL, 0, 0.0, "empty");
    varlen_graph_time ok[] = {{4, 1.0}};
    expect_einval(&c, ok, 1, -0.1, "sampler_ms");
    expect_einval(&c, ok, 1, NAN, "sampler_ms");
}

/* ---- property: the scan's choice is the best of every allocation ------------------------ */

/* Exhaustive oracle: the best tokens per ms over every (d_0..d_{n-1}), d_i <= nd_i, whose
 * rows fit the largest graph. Independent of the scan (no ranking involved). */
static double oracle_best(const vcase *c, const varlen_graph_time *t, size_t nt, double sampler)
{
    uint32_t d[8] = {0};
    double best = 0.0;
    for (;;) {
        uint32_t rows = c->n;
        double tokens = c->n;
        for (uint32_t i = 0; i < c->n; i++) {
            rows += d[i];
            for (uint32_t k = 0; k < d[i]; k++)
                tokens += c->conf[i][k];
        }
        uint32_t fit = UINT32_MAX; /* the smallest size that holds the rows */
        double ms = INFINITY;
        for (size_t g = 0; g < nt; g++)
            if (t[g].rows >= rows && t[g].rows < fit)
                fit = t[g].rows, ms = t[g].step_ms + sampler;
        if (isfinite(ms) && tokens / ms > best)
            best = tokens / ms;
        uint32_t i = 0; /* next allocation, odometer style */
        while (i < c->n && d[i] == c->nd[i])
            d[i++] = 0;
        if (i == c->n)
            return best;
        d[i]++;
    }
}

Test(varlen, property_scan_matches_exhaustive_search)
{
    di_rng rng;
    di_rng_init(&rng, 20240611);
    for (int iter = 0; iter < 400; iter++) {
        vcase c = {.n = 1 + (uint32_t)di_rng_below(&rng, 4)};
        for (uint32_t i = 0; i < c.n; i++) {
            c.nd[i] = (uint32_t)di_rng_below(&rng, 4);
            double prev = 1.0;
            for (uint32_t k = 0; k < c.nd[i]; k++) {
                /* coarse values make ties between requests common */
                prev = prev * (double)di_rng_below(&rng, 5) / 4.0;
                c.conf[i][k] = prev;
            }
        }
        varlen_graph_time t[7]; /* random sizes, random (not always growing) times */
        size_t nt = 0;
        for (uint32_t r = 1; r <= 15 && nt < 6; r++)
            if (di_rng_below(&rng, 3) == 0)
                t[nt++] = (varlen_graph_time){r, 1.0 + (double)di_rng_below(&rng, 40) / 4.0};
        if (nt == 0 || t[nt - 1].rows < c.n) /* 6 sizes end at >= 6 rows, so nt < 6 here */
            t[nt++] = (varlen_graph_time){16, 11.0};
        double sampler = (double)di_rng_below(&rng, 3) / 2.0;
        varlen_plan p = run_ok(&c, t, nt, sampler);
        uint32_t largest = 0, sum = 0;
        for (size_t g = 0; g < nt; g++)
            largest = t[g].rows > largest ? t[g].rows : largest;
        for (uint32_t i = 0; i < c.n; i++) {
            cr_assert_leq(p.drafts[i], c.nd[i]);
            sum += p.drafts[i];
        }
        cr_assert_eq(p.rows, c.n + sum);
        cr_assert_leq(p.rows, largest, "rows %u beyond the largest graph %u", p.rows, largest);
        cr_assert_geq(p.graph_rows, p.rows);
        double best = oracle_best(&c, t, nt, sampler);
        cr_assert(fabs(p.tokens_per_ms - best) <= 1e-9 * best,
                  "iteration %d: scan %.12g, exhaustive best %.12g", iter, p.tokens_per_ms, best);
        varlen_plan_free(&p);
    }
}
