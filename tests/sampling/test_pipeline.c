/* The pipeline on the explainer's worked examples and each filter on its own. */
#include <string.h>

#include "tests/sampling/sampling_test.h"

#define TOL 5e-4 /* the explainer prints three decimals */

/* "Picking a token": A 2.0, B 1.0, C 0.5, D -1.0 at temperature 0.5 -> 0.842, 0.114, 0.042,
 * 0.002 (e^4, e^2, e^1, e^-2 over their total 64.8). */
Test(pipeline, explainer_temperature_half)
{
    const float logits[] = {2.0f, 1.0f, 0.5f, -1.0f};
    sampling_params p = sampling_params_default();
    p.temperature = 0.5f;
    sampler_workspace *ws = test_ws(16);
    sampler_row row = test_row(logits, 4, &p);
    sampler_dist d = test_dist(&row, ws, 0);
    cr_assert_eq(d.n, 4);
    const double want[] = {0.842, 0.114, 0.042, 0.002};
    for (int t = 0; t < 4; t++) {
        cr_assert_eq(d.ids[t], t, "draw order is A, B, C, D");
        cr_assert(fabs(test_prob(&d, t) - want[t]) < TOL, "token %d: %f", t, test_prob(&d, t));
    }
    cr_assert_eq(d.mass[0], SAMPLER_MASS_ONE, "the top token's mass is 2^31");
    sampler_workspace_free(ws);
}

/* Top-p 0.9 keeps A and B (0.842 < 0.9 <= 0.956), renormalised to 0.881 / 0.119; A covers
 * [0, 0.881), B [0.881, 1): a draw of 0.93 picks B. */
Test(pipeline, explainer_top_p_cut_and_pick)
{
    const float logits[] = {2.0f, 1.0f, 0.5f, -1.0f};
    sampling_params p = sampling_params_default();
    p.temperature = 0.5f;
    p.top_p = 0.9f;
    sampler_workspace *ws = test_ws(16);
    sampler_row row = test_row(logits, 4, &p);
    sampler_dist d = test_dist(&row, ws, 0);
    cr_assert_eq(d.n, 2);
    cr_assert(fabs(test_prob(&d, 0) - 0.881) < TOL);
    cr_assert(fabs(test_prob(&d, 1) - 0.119) < TOL);
    cr_assert_eq(sampler_dist_logprob(&d, 2), -INFINITY);
    cr_assert_eq(sampler_dist_logprob(&d, 3), -INFINITY);
    const struct {
        double u;
        int32_t token;
    } picks[] = {{0.93, 1}, {0.0, 0}, {0.5, 0}, {0.880, 0}, {0.882, 1}, {0.999999, 1}};
    for (size_t i = 0; i < sizeof(picks) / sizeof(picks[0]); i++) {
        int32_t tok = -7;
        cr_assert_eq(sampler_dist_pick(&d, picks[i].u, &tok, NULL), DI_OK);
        cr_assert_eq(tok, picks[i].token, "u %g picked %d", picks[i].u, tok);
    }
    /* Keyed end to end: the token is B exactly when the row's own uniform is past 0.881. */
    int seen[2] = {0, 0};
    for (uint64_t seed = 0; seed < 400; seed++) {
        p.seed = seed;
        sampler_row r = test_row(logits, 4, &p);
        r.position = 16389;
        double u = sampler_uniform(seed, sampler_stream(16389, 0, SAMPLER_CASE_FRESH));
        if (fabs(u - 0.881) < 1e-3)
            continue; /* too close to the edge for a three-decimal reference */
        sampler_result res;
        di_error e;
        cr_assert_eq(sampler_sample(&r, ws, &res, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(res.token, u < 0.881 ? 0 : 1, "seed %llu u %f", (unsigned long long)seed, u);
        seen[res.token]++;
    }
    cr_assert(seen[0] > 300 && seen[1] > 20, "A %d B %d", seen[0], seen[1]);
    sampler_workspace_free(ws);
}

/* "Sampling and verification", worked by hand. Logits 3, 2, 2, 0, -1 at temperature 1:
 * weights 1, e^-1, e^-1, e^-3, e^-4 = 1, .3679, .3679, .0498, .0183 (total 1.8039), so
 * p = .5543, .2039, .2039, .0276, .0102. Top-p 0.8: .5543, then .7583 (< .8), then .9622: keep
 * tokens 0, 1, 2, renormalised .5761, .2119, .2119. Tokens 1 and 2 tie; the tie rule puts 1
 * first, so 0 covers [0, .5761), 1 [.5761, .7881), 2 [.7881, 1). The draw 0.55 picks token 0: the
 * tie rule does not matter for this draw (nor for the cut: both tied tokens are kept). It
 * matters for draws in [.5761, 1): 0.70 picks token 1, the lower id. */
Test(pipeline, explainer_five_token_exercise)
{
    const float logits[] = {3.0f, 2.0f, 2.0f, 0.0f, -1.0f};
    sampling_params p = sampling_params_default();
    p.top_p = 0.8f;
    sampler_workspace *ws = test_ws(8);
    sampler_row row = test_row(logits, 5, &p);
    sampler_dist d = test_dist(&row, ws, 0);
    cr_assert_eq(d.n, 3);
    cr_assert_eq(d.ids[0], 0);
    cr_assert_eq(d.ids[1], 1, "tie to the lower id");
    cr_assert_eq(d.ids[2], 2);
    cr_assert(fabs(test_prob(&d, 0) - 0.5761) < 1e-4);
    cr_assert(fabs(test_prob(&d, 1) - 0.2119) < 1e-4);
    cr_assert(fabs(test_prob(&d, 2) - 0.2119) < 1e-4);
    int32_t tok;
    cr_assert_eq(sampler_dist_pick(&d, 0.55, &tok, NULL), DI_OK);
    cr_assert_eq(tok, 0);
    cr_assert_eq(sampler_dist_pick(&d, 0.70, &tok, NULL), DI_OK);
    cr_assert_eq(tok, 1);
    cr_assert_eq(sampler_dist_pick(&d, 0.80, &tok, NULL), DI_OK);
    cr_assert_eq(tok, 2);
    /* Then draft token 2 with draft probability 0.5 and coin 0.75: t = log .2119, d = log .5,
     * exp(t - d) = .4239 <= .75: rejected. (A coin of 0.40 would pass.) */
    double t = sampler_dist_logprob(&d, 2);
    cr_assert_not(sampler_accept(t, log(0.5), 0.75));
    cr_assert(sampler_accept(t, log(0.5), 0.40));
    /* The exercise gives only the draft's 0.5 on token 2; we complete it as .3, .2, .5 on
     * tokens 0, 1, 2 (a reconstruction). Residual max(p_t - p_d e^-5e-5, 0): token 0
     * .5761 - .3 = .2761, token 1 .2119 - .2 = .0119, token 2 0; normalised .9587 / .0413. */
    const float draft_logits[] = {logf(0.3f), logf(0.2f), logf(0.5f), -INFINITY, -INFINITY};
    sampling_params dp = sampling_params_default();
    sampler_row drow = test_row(draft_logits, 5, &dp);
    sampler_dist dd = test_dist(&drow, ws, 1);
    cr_assert(fabs(test_prob(&dd, 2) - 0.5) < 1e-6);
    cr_assert_eq(sampler_residual_pick(&d, &dd, 5, ws, 0.5, &tok, NULL), DI_OK);
    cr_assert_eq(tok, 0);
    cr_assert_eq(sampler_residual_pick(&d, &dd, 5, ws, 0.95, &tok, NULL), DI_OK);
    cr_assert_eq(tok, 0, ".95 < .9587");
    cr_assert_eq(sampler_residual_pick(&d, &dd, 5, ws, 0.97, &tok, NULL), DI_OK);
    cr_assert_eq(tok, 1);
    sampler_workspace_free(ws);
}

/* "Accepting a draft": t = log 0.3, d = log 0.6, draw 0.42: exp(min(t - d, 0)) = 0.5 > 0.42,
 * so the draft passes. */
Test(pipeline, explainer_accept_rule)
{
    cr_assert(sampler_accept(log(0.3), log(0.6), 0.42));
    cr_assert(sampler_accept(log(0.3), log(0.6), 0.49));
    cr_assert_not(sampler_accept(log(0.3), log(0.6), 0.51));
    cr_assert(sampler_accept(log(0.6), log(0.3), 0.999999), "t > d always passes");
    cr_assert_not(sampler_accept(-INFINITY, log(0.3), 0.0), "t = -inf never passes");
    cr_assert_not(sampler_accept(-INFINITY, -INFINITY, 0.0));
}

/* "The junior chef": target on .2 in .6 under .2, draft on .5 in .3 under .2. Residual: on 0,
 * in .6 - .3 e^-5e-5 = .30002, under .2 (1 - e^-5e-5) = 1e-5; so "in" is the replacement except
 * for the top 3.3e-5 of draws, the documented e^(-5e-5) effect. */
Test(pipeline, explainer_junior_chef_residual)
{
    enum { ON, IN, UNDER };
    const float target[] = {logf(0.2f), logf(0.6f), logf(0.2f)};
    const float draft[] = {logf(0.5f), logf(0.3f), logf(0.2f)};
    sampling_params p = sampling_params_default();
    sampler_workspace *ws = test_ws(4);
    sampler_row tr = test_row(target, 3, &p), dr = test_row(draft, 3, &p);
    sampler_dist td = test_dist(&tr, ws, 0), dd = test_dist(&dr, ws, 1);
    int32_t tok;
    const double us[] = {0.0, 0.3, 0.5, 0.9, 0.9999};
    for (size_t i = 0; i < sizeof(us) / sizeof(us[0]); i++) {
        cr_assert_eq(sampler_residual_pick(&td, &dd, 3, ws, us[i], &tok, NULL), DI_OK);
        cr_assert_eq(tok, IN, "u %g", us[i]);
    }
    cr_assert_eq(sampler_residual_pick(&td, &dd, 3, ws, 0.999999, &tok, NULL), DI_OK);
    cr_assert_eq(tok, UNDER, "the e^-5e-5 sliver of 'under'");
    /* Identical distributions still leave a residual (the factor's purpose): it is the target
     * scaled by 1 - e^-5e-5, so the draw follows the target. */
    cr_assert_eq(sampler_residual_pick(&td, &td, 3, ws, 0.1, &tok, NULL), DI_OK);
    cr_assert_eq(tok, IN);
    cr_assert_eq(sampler_residual_pick(&td, &td, 3, ws, 0.9, &tok, NULL), DI_OK);
    cr_assert_eq(tok, UNDER, "order in, on, under: ties to the lower id; .9 is past .8");
    di_error e;
    cr_assert_eq(sampler_residual_pick(&td, &dd, 3, ws, 1.0, &tok, &e), DI_EINVAL);
    cr_assert_eq(sampler_residual_pick(&td, &dd, 3, ws, -0.1, &tok, &e), DI_EINVAL);
    sampler_workspace_free(ws);
}

/* Temperature 0 is 1e-5 and still draws: logits 0 and -1e-5 have odds e^1 : 1, about 73% and
 * 27% (the explainer's figure). */
Test(pipeline, temperature_zero_still_draws)
{
    const float logits[] = {0.0f, -1e-5f, -1.0f, -3.0f};
    sampling_params p = sampling_params_default();
    p.temperature = 0.0f;
    sampler_workspace *ws = test_ws(4);
    enum { N = 20000 };
    uint64_t counts[4] = {0};
    for (uint64_t s = 0; s < N; s++) {
        p.seed = s;
        sampler_row row = test_row(logits, 4, &p);
        row.position = 100;
        sampler_result r;
        cr_assert_eq(sampler_sample(&row, ws, &r, NULL), DI_OK);
        counts[r.token]++;
    }
    double want = 1.0 / (1.0 + exp(-(double)1e-5f / (double)1e-5f));
    cr_assert(fabs(want - 0.731) < 1e-3);
    cr_assert_eq(counts[2] + counts[3], 0);
    double got = (double)counts[0] / N;
    cr_assert(fabs(got - want) < 0.015, "token 0 won %.4f, want %.4f", got, want);
    sampler_workspace_free(ws);
}

Test(pipeline, same_seed_same_tokens_different_seeds_differ)
{
    enum { V = 1000 };
    float *logits = malloc(V * sizeof(float));
    test_normal_logits(logits, V, 1.0, 5);
    sampling_params p = sampling_params_default();
    sampler_workspace *ws = test_ws(V);
    int32_t first[64];
    int distinct = 0;
    for (int s = 0; s < 64; s++) {
        p.seed = (uint64_t)s;
        sampler_row row = test_row(logits, V, &p);
        sampler_result a, b;
        cr_assert_eq(sampler_sample(&row, ws, &a, NULL), DI_OK);
        cr_assert_eq(sampler_sample(&row, ws, &b, NULL), DI_OK);
        cr_assert_eq(a.token, b.token);
        cr_assert_eq(memcmp(&a.logprob, &b.logprob, sizeof(float)), 0);
        first[s] = a.token;
        int seen = 0;
        for (int j = 0; j < s; j++)
            seen |= first[j] == a.token;
        distinct += !seen;
    }
    cr_assert(distinct > 40, "64 seeds gave only %d distinct tokens", distinct);
    /* One seed, successive positions: also different draws. */
    p.seed = 9;
    distinct = 0;
    for (uint64_t pos = 0; pos < 64; pos++) {
        sampler_row row = test_row(logits, V, &p);
        row.position = pos;
        sampler_result a;
        cr_assert_eq(sampler_sample(&row, ws, &a, NULL), DI_OK);
        int seen = 0;
        for (uint64_t j = 0; j < pos; j++)
            seen |= first[j] == a.token;
        first[pos] = a.token;
        distinct += !seen;
    }
    cr_assert(distinct > 40, "64 positions gave only %d distinct tokens", distinct);
    free(logits);
    sampler_workspace_free(ws);
}

Test(pipeline, blacklist_blocks_tokens)
{
    const float logits[] = {0.0f, 1.0f, 2.0f, 9.0f, 8.5f, 0.5f};
    static const int32_t ban[] = {3, 4, 3};
    sampling_params p = sampling_params_default();
    p.blacklist = ban;
    p.n_blacklist = 3;
    sampler_workspace *ws = test_ws(8);
    sampler_row row = test_row(logits, 6, &p);
    sampler_dist d = test_dist(&row, ws, 0);
    cr_assert_eq(d.n, 4);
    cr_assert_eq(sampler_dist_logprob(&d, 3), -INFINITY);
    cr_assert_eq(sampler_dist_logprob(&d, 4), -INFINITY);
    cr_assert_eq(d.ids[0], 2, "the best allowed token leads");
    for (uint64_t s = 0; s < 300; s++) {
        p.seed = s;
        sampler_result r;
        cr_assert_eq(sampler_sample(&row, ws, &r, NULL), DI_OK);
        cr_assert(r.token != 3 && r.token != 4);
    }
    sampler_workspace_free(ws);
}

Test(pipeline, eos_banned_for_first_n_outputs)
{
    const float logits[] = {0.0f, 0.0f, 40.0f, 0.0f}; /* EOS (2) has all the mass */
    sampling_params p = sampling_params_default();
    p.eos_id = 2;
    p.first_n_no_eos = 2;
    sampler_workspace *ws = test_ws(4);
    for (uint32_t out = 0; out < 4; out++) {
        sampler_row row = test_row(logits, 4, &p);
        row.output_index = out;
        sampler_dist d = test_dist(&row, ws, 0);
        if (out < 2) {
            cr_assert_eq(sampler_dist_logprob(&d, 2), -INFINITY, "output %u", out);
            cr_assert_eq(d.n, 3);
        } else {
            cr_assert_eq(d.ids[0], 2);
            cr_assert_eq(d.n, 1, "others weigh e^-40 < 2^-31 of EOS: mass 0");
        }
    }
    sampler_workspace_free(ws);
}

Test(pipeline, grammar_mask_allows_only_its_bits)
{
    enum { V = 70 };
    float logits[V];
    for (int i = 0; i < V; i++)
        logits[i] = (float)(V - i) * 0.1f; /* low ids are the most likely */
    uint32_t mask[3] = {0, 0, 0};
    const int allowed[] = {33, 40, 69};
    for (int i = 0; i < 3; i++)
        mask[allowed[i] / 32] |= 1u << (allowed[i] % 32);
    sampling_params p = sampling_params_default();
    sampler_workspace *ws = test_ws(V);
    sampler_row row = test_row(logits, V, &p);
    row.grammar_mask = mask;
    sampler_dist d = test_dist(&row, ws, 0);
    cr_assert_eq(d.n, 3);
    cr_assert_eq(d.ids[0], 33);
    cr_assert_eq(d.ids[1], 40);
    cr_assert_eq(d.ids[2], 69);
    for (int t = 0; t < V; t++)
        if (t != 33 && t != 40 && t != 69)
            cr_assert_eq(sampler_dist_logprob(&d, t), -INFINITY);
    sampler_workspace_free(ws);
}

static int cmp_logit_desc(const void *a, const void *b, void *ctx)
{
    const float *l = ctx;
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    float x = l[i], y = l[j];
    if (x != y)
        return x > y ? -1 : 1;
    return (i > j) - (i < j);
}

/* The kept set of force top-k equals the first k of a full sort by (logit desc, id asc),
 * computed here with qsort_r. */
static void check_force_top_k(const float *logits, uint32_t n, uint32_t k)
{
    int32_t *order = malloc(n * sizeof(*order));
    for (uint32_t i = 0; i < n; i++)
        order[i] = (int32_t)i;
    qsort_r(order, n, sizeof(*order), cmp_logit_desc, (void *)logits);
    sampling_params p = sampling_params_default();
    p.force_top_k = k;
    p.temperature = 1e30f; /* every kept token gets mass 2^31: the dist is exactly the set */
    sampler_workspace *ws = test_ws(n);
    sampler_row row = test_row(logits, n, &p);
    sampler_dist d = test_dist(&row, ws, 0);
    uint32_t want = k < n ? k : n;
    cr_assert_eq(d.n, want, "kept %u, want %u", d.n, want);
    char *in = calloc(n, 1);
    for (uint32_t i = 0; i < d.n; i++)
        in[d.ids[i]] = 1;
    for (uint32_t i = 0; i < want; i++)
        cr_assert(in[order[i]], "token %d (rank %u) missing", order[i], i);
    /* Equal masses: draw order is by id. */
    for (uint32_t i = 1; i < d.n; i++)
        cr_assert_lt(d.ids[i - 1], d.ids[i]);
    free(in);
    free(order);
    sampler_workspace_free(ws);
}

Test(pipeline, force_top_k_ties_to_lower_id)
{
    const float equal[10] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    check_force_top_k(equal, 10, 3);
    const float some[] = {5, 3, 3, 3, 1, -0.0f, 0.0f, -0.0f, 3, 5};
    check_force_top_k(some, 10, 1);
    check_force_top_k(some, 10, 3);
    check_force_top_k(some, 10, 5);
    check_force_top_k(some, 10, 7);
    check_force_top_k(some, 10, 8); /* -0 and +0 tie: id 5 before id 6 */
    check_force_top_k(some, 10, 9);
    check_force_top_k(some, 10, 10);
    /* The V4.1 vocabulary: random logits, then heavy ties (16 distinct values). */
    float *l = malloc(V41_VOCAB * sizeof(float));
    test_normal_logits(l, V41_VOCAB, 3.0, 11);
    check_force_top_k(l, V41_VOCAB, 4096);
    check_force_top_k(l, V41_VOCAB, 1);
    for (uint32_t i = 0; i < V41_VOCAB; i++)
        l[i] = (float)((i * 2654435761u) >> 28) - 8.0f;
    check_force_top_k(l, V41_VOCAB, 4096);
    check_force_top_k(l, V41_VOCAB, 100000);
    /* Structured to fool a strided sample: every 128th token (where a sample of the
     * vocabulary would look) is high, too few of them to fill k; the exact set still comes out
     * (the selection must look again below its first guess). Likewise every 16th. */
    for (uint32_t i = 0; i < V41_VOCAB; i++)
        l[i] = i % 128 == 0 ? 10.0f : (float)(i % 7);
    check_force_top_k(l, V41_VOCAB, 4096);
    for (uint32_t i = 0; i < V41_VOCAB; i++)
        l[i] = i % 16 == 0 ? 10.0f + (float)(i % 5) : -(float)(i % 3);
    check_force_top_k(l, V41_VOCAB, 4096);
    check_force_top_k(l, V41_VOCAB, 9000);
    /* Negative logits only, with -inf sprinkled in. */
    test_normal_logits(l, V41_VOCAB, 1.0, 12);
    for (uint32_t i = 0; i < V41_VOCAB; i++)
        l[i] = i % 97 == 0 ? -INFINITY : -fabsf(l[i]) - 100.0f;
    check_force_top_k(l, V41_VOCAB, 4096);
    free(l);
}

Test(pipeline, force_top_k_off_keeps_all)
{
    enum { V = 5000 };
    float logits[V];
    test_normal_logits(logits, V, 0.5, 3);
    sampling_params p = sampling_params_default();
    p.force_top_k = 0;
    sampler_workspace *ws = test_ws(V);
    sampler_row row = test_row(logits, V, &p);
    cr_assert_eq(test_dist(&row, ws, 0).n, V);
    p.force_top_k = 4096;
    cr_assert_eq(test_dist(&row, ws, 0).n, 4096);
    sampler_workspace_free(ws);
}

Test(pipeline, top_k_on_the_sorted_distribution)
{
    const float logits[] = {1.0f, 2.0f, 2.0f, 2.0f, 0.0f};
    sampling_params p = sampling_params_default();
    p.top_k = 2;
    sampler_workspace *ws = test_ws(8);
    sampler_row row = test_row(logits, 5, &p);
    sampler_dist d = test_dist(&row, ws, 0);
    cr_assert_eq(d.n, 2);
    cr_assert_eq(d.ids[0], 1);
    cr_assert_eq(d.ids[1], 2, "ties to the lower id");
    cr_assert(fabs(test_prob(&d, 1) - 0.5) < 1e-9);
    p.top_k = 1;
    d = test_dist(&row, ws, 0);
    cr_assert_eq(d.n, 1);
    cr_assert_eq(d.ids[0], 1);
    p.top_k = 100; /* more than the vocabulary */
    cr_assert_eq(test_dist(&row, ws, 0).n, 5);
    sampler_workspace_free(ws);
}

/* Four equal logits: each token has mass 2^31, total 2^33, so "reaches p" is exact: p = 0.25
 * keeps one token, the next float above 0.25 keeps two, 0.75 three, 1 all four. */
Test(pipeline, top_p_edges)
{
    const float equal[] = {0.5f, 0.5f, 0.5f, 0.5f};
    sampling_params p = sampling_params_default();
    sampler_workspace *ws = test_ws(64);
    sampler_row row = test_row(equal, 4, &p);
    const struct {
        float p;
        uint32_t n;
    } rows[] = {{1.0f, 4},
                {0.75f, 3},
                {nextafterf(0.75f, 1.0f), 4},
                {0.5f, 2},
                {nextafterf(0.25f, 1.0f), 2},
                {0.25f, 1},
                {1e-6f, 1},
                {1e-30f, 1},
                {1e-45f, 1}};
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        p.top_p = rows[i].p;
        sampler_dist d = test_dist(&row, ws, 0);
        cr_assert_eq(d.n, rows[i].n, "top_p %.9g kept %u", (double)rows[i].p, d.n);
        cr_assert_eq(d.ids[0], 0);
    }
    /* A tiny p keeps exactly the single most likely token. */
    float logits[50];
    test_normal_logits(logits, 50, 2.0, 8);
    int best = 0;
    for (int i = 1; i < 50; i++)
        best = logits[i] > logits[best] ? i : best;
    p.top_p = 1e-6f;
    sampler_row r2 = test_row(logits, 50, &p);
    sampler_dist d = test_dist(&r2, ws, 0);
    cr_assert_eq(d.n, 1);
    cr_assert_eq(d.ids[0], best);
    cr_assert_eq(sampler_dist_logprob(&d, best), 0.0);
    sampler_workspace_free(ws);
}

/* Logprobs are those of the processed distribution: a double softmax over the kept tokens
 * (after top-p, renormalised) computed here; -inf for banned and cut tokens. */
Test(pipeline, logprobs_of_processed_distribution)
{
    enum { V = 40 };
    float logits[V];
    test_normal_logits(logits, V, 1.5, 21);
    static const int32_t ban[] = {7};
    sampling_params p = sampling_params_default();
    p.temperature = 0.8f;
    p.top_p = 0.9f;
    p.n_logprobs = 5;
    p.blacklist = ban;
    p.n_blacklist = 1;
    float masked[V];
    memcpy(masked, logits, sizeof masked);
    masked[7] = -INFINITY;
    double ref[V];
    int order[V];
    int kept = test_processed(masked, V, 0.8, 0.9f, ref);
    test_order(ref, V, order);
    sampler_workspace *ws = test_ws(V);
    sampler_row row = test_row(logits, V, &p);
    sampler_dist d = test_dist(&row, ws, 0);
    cr_assert_eq(d.n, (uint32_t)kept);
    for (int i = 0; i < kept; i++) {
        double want = log(ref[order[i]]);
        cr_assert(fabs(sampler_dist_logprob(&d, order[i]) - want) < 1e-5, "token %d", order[i]);
    }
    for (int i = kept; i < V; i++)
        cr_assert_eq(sampler_dist_logprob(&d, order[i]), -INFINITY);
    for (uint64_t s = 0; s < 50; s++) {
        p.seed = s;
        sampler_result r;
        cr_assert_eq(sampler_sample(&row, ws, &r, NULL), DI_OK);
        cr_assert_eq(r.n_top, 5);
        cr_assert(fabs(r.logprob - sampler_dist_logprob(&d, r.token)) < 1e-6);
        for (int i = 0; i < 5; i++) {
            cr_assert_eq(r.top_tokens[i], order[i]);
            cr_assert(fabs(r.top_logprobs[i] - log(ref[order[i]])) < 1e-5);
        }
    }
    /* Fewer kept tokens than asked: n_top is the kept count. */
    p.top_p = 1e-6f;
    sampler_result r;
    cr_assert_eq(sampler_sample(&row, ws, &r, NULL), DI_OK);
    cr_assert_eq(r.n_top, 1);
    cr_assert_eq(r.logprob, 0.0f);
    sampler_workspace_free(ws);
}

/* Blacklist + EOS ban + grammar mask leave nothing: a per-row DI_ERANGE with a message, the
 * result untouched. */
Test(pipeline, every_token_blocked_is_an_error)
{
    const float logits[] = {1.0f, 2.0f, 3.0f, 4.0f};
    static const int32_t ban[] = {0, 1};
    uint32_t mask = 0x7; /* tokens 0, 1, 2 */
    sampling_params p = sampling_params_default();
    p.blacklist = ban;
    p.n_blacklist = 2;
    p.eos_id = 2;
    p.first_n_no_eos = 1;
    sampler_workspace *ws = test_ws(4);
    sampler_row row = test_row(logits, 4, &p);
    row.grammar_mask = &mask;
    sampler_result r;
    memset(&r, 0x5a, sizeof r);
    di_error e;
    cr_assert_eq(sampler_sample(&row, ws, &r, &e), DI_ERANGE);
    cr_assert_str_eq(e.msg, "every token of 4 is blocked (the grammar mask allows 3, blacklist "
                            "2, EOS banned, -inf logits 0): no token can be sampled; the "
                            "request fails");
    unsigned char *bytes = (unsigned char *)&r;
    for (size_t i = 0; i < sizeof r; i++)
        cr_assert_eq(bytes[i], 0x5a, "result untouched");
    /* The second output may be EOS: the row samples EOS. */
    row.output_index = 1;
    cr_assert_eq(sampler_sample(&row, ws, &r, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(r.token, 2);
    /* Every logit -inf from the model is the same failure. */
    const float none[] = {-INFINITY, -INFINITY};
    sampling_params q = sampling_params_default();
    sampler_row r2 = test_row(none, 2, &q);
    cr_assert_eq(sampler_sample(&r2, ws, &r, &e), DI_ERANGE);
    cr_assert(strstr(e.msg, "-inf logits 2"), "%s", e.msg);
    sampler_workspace_free(ws);
}

Test(pipeline, bad_logits_and_arguments)
{
    float logits[] = {1.0f, NAN, 0.0f};
    sampling_params p = sampling_params_default();
    sampler_workspace *ws = test_ws(3);
    sampler_row row = test_row(logits, 3, &p);
    sampler_result r;
    di_error e;
    cr_assert_eq(sampler_sample(&row, ws, &r, &e), DI_ERANGE);
    cr_assert_str_eq(e.msg, "logit of token 1 is nan: logits must be finite or -inf");
    logits[1] = INFINITY;
    cr_assert_eq(sampler_sample(&row, ws, &r, &e), DI_ERANGE);
    logits[1] = -INFINITY;
    cr_assert_eq(sampler_sample(&row, ws, &r, &e), DI_OK);
    cr_assert_eq(r.token == 0 || r.token == 2, 1);
    row.n_vocab = 4; /* beyond the workspace */
    cr_assert_eq(sampler_sample(&row, ws, &r, &e), DI_EINVAL);
    cr_assert_str_eq(e.msg, "sampler row: n_vocab 4 outside [1, 3] (workspace)");
    row.n_vocab = 3;
    p.top_p = 2.0f;
    cr_assert_eq(sampler_sample(&row, ws, &r, &e), DI_EINVAL);
    cr_assert_str_eq(e.msg, "top_p 2 outside (0, 1]");
    p.top_p = 1.0f;
    row.logits = NULL;
    cr_assert_eq(sampler_sample(&row, ws, &r, &e), DI_EINVAL);
    row.logits = logits;
    cr_assert_eq(sampler_sample(&row, NULL, &r, &e), DI_EINVAL);
    cr_assert_eq(sampler_sample(&row, ws, NULL, &e), DI_EINVAL);
    sampler_dist d;
    cr_assert_eq(sampler_process(&row, ws, 2, &d, &e), DI_EINVAL);
    cr_assert_eq(sampler_process(&row, ws, 0, NULL, &e), DI_EINVAL);
    d = test_dist(&row, ws, 0);
    int32_t tok = 77;
    cr_assert_eq(sampler_dist_pick(&d, 1.0, &tok, &e), DI_EINVAL);
    cr_assert_str_eq(e.msg, "uniform 1 outside [0, 1)");
    cr_assert_eq(sampler_dist_pick(&d, NAN, &tok, &e), DI_EINVAL);
    sampler_dist empty = {0};
    cr_assert_eq(sampler_dist_pick(&empty, 0.5, &tok, &e), DI_EINVAL);
    cr_assert_eq(tok, 77, "untouched on failure");
    sampler_workspace_free(ws);
}

/* Slots 0 and 1 hold two distributions at once. */
Test(pipeline, two_slots_independent)
{
    const float a[] = {0.0f, 5.0f}, b[] = {5.0f, 0.0f};
    sampling_params p = sampling_params_default();
    sampler_workspace *ws = test_ws(2);
    sampler_row ra = test_row(a, 2, &p), rb = test_row(b, 2, &p);
    sampler_dist da = test_dist(&ra, ws, 0), db = test_dist(&rb, ws, 1);
    cr_assert_eq(da.ids[0], 1);
    cr_assert_eq(db.ids[0], 0);
    sampler_workspace_free(ws);
}

/* The key of a row, written out by hand: u = philox(seed, 3 * (P + j * 10,000,019) + 0) for
 * row j; a draft row uses seed + 1,000,000,007. The token is the one sampler_dist_pick gives
 * for that u. */
Test(pipeline, rows_and_draft_rows_use_their_keys)
{
    enum { V = 1000 };
    float *logits = malloc(V * sizeof(float));
    test_normal_logits(logits, V, 0.3, 17);
    sampling_params p = sampling_params_default();
    p.seed = 123456789;
    sampler_workspace *ws = test_ws(V);
    sampler_row row = test_row(logits, V, &p);
    sampler_dist d = test_dist(&row, ws, 0);
    int differ = 0;
    for (uint32_t j = 0; j < 6; j++) {
        for (int draft = 0; draft < 2; draft++) {
            row.position = 16390;
            row.row = j;
            row.draft = draft;
            uint64_t seed = draft ? 123456789ull + 1000000007ull : 123456789ull;
            double u = di_philox_uniform(seed, 3ull * (16390ull + j * 10000019ull), 0);
            int32_t want, want_other;
            cr_assert_eq(sampler_dist_pick(&d, u, &want, NULL), DI_OK);
            sampler_result r;
            cr_assert_eq(sampler_sample(&row, ws, &r, NULL), DI_OK);
            cr_assert_eq(r.token, want, "row %u draft %d", j, draft);
            double u_other = di_philox_uniform(seed ^ 1, 3ull * (16390ull + j * 10000019ull), 0);
            cr_assert_eq(sampler_dist_pick(&d, u_other, &want_other, NULL), DI_OK);
            differ += want_other != want;
        }
    }
    cr_assert_gt(differ, 8, "another key gives other tokens");
    free(logits);
    sampler_workspace_free(ws);
}
