/* Speculative verification: the accept coin, the resample, the bonus row and their errors. */
#include <string.h>

#include "tests/sampling/sampling_test.h"

enum { P0 = 16390 }; /* first decode row of r1 (explainer) */

/* A request's step with k drafts over one vocabulary: target rows 0..k, draft rows 0..k-1. */
typedef struct step {
    sampler_row target[SAMPLER_MAX_DRAFTS + 1];
    sampler_row draft[SAMPLER_MAX_DRAFTS];
    int32_t tokens[SAMPLER_MAX_DRAFTS];
    sampler_verify_in in;
} step;

static void step_init(step *s, uint32_t k, const float *const *tl, const float *const *dl,
                      const int32_t *tokens, uint32_t n, const sampling_params *tp,
                      const sampling_params *dp)
{
    memset(s, 0, sizeof(*s));
    for (uint32_t i = 0; i <= k; i++) {
        s->target[i] = test_row(tl[i], n, tp);
        s->target[i].position = P0;
        s->target[i].row = i;
        s->target[i].output_index = 5 + i;
    }
    for (uint32_t i = 0; i < k; i++) {
        s->draft[i] = test_row(dl[i], n, dp);
        s->draft[i].position = P0 + 1;
        s->draft[i].row = i;
        s->draft[i].draft = true;
        s->tokens[i] = tokens[i];
    }
    s->in = (sampler_verify_in){.target = s->target, .draft = s->draft, .draft_tokens = s->tokens,
                                .k = k};
}

static double coin(uint64_t seed, uint32_t row, sampler_case c)
{
    return sampler_uniform(seed, sampler_stream(P0, row, c));
}

/* The junior chef through sampler_verify: target on .2 in .6 under .2, draft on .5 in .3
 * under .2, draft token "on": t - d = log .4, so the coin (case 2 of row 0) passes below 0.4;
 * otherwise row 0 resamples "in" (the residual's 0.99997 share). */
Test(verify, junior_chef_accept_or_resample_in)
{
    enum { ON, IN, UNDER };
    const float target[] = {logf(0.2f), logf(0.6f), logf(0.2f)};
    const float draft[] = {logf(0.5f), logf(0.3f), logf(0.2f)};
    const float *tl[] = {target, target}, *dl[] = {draft};
    const int32_t tok[] = {ON};
    sampling_params p = sampling_params_default();
    p.n_logprobs = 2;
    sampler_workspace *ws = test_ws(3);
    int accepted = 0, rejected = 0;
    for (uint64_t seed = 0; seed < 300; seed++) {
        p.seed = seed;
        step s;
        step_init(&s, 1, tl, dl, tok, 3, &p, &p);
        sampler_result res[2];
        uint32_t na = 99;
        di_error e;
        cr_assert_eq(sampler_verify(&s.in, ws, res, &na, &e), DI_OK, "%s", e.msg);
        double u = coin(seed, 0, SAMPLER_CASE_ACCEPT);
        if (fabs(u - 0.4) < 1e-6)
            continue;
        if (u < 0.4) {
            cr_assert_eq(na, 1, "seed %llu coin %f", (unsigned long long)seed, u);
            cr_assert_eq(res[0].token, ON);
            cr_assert(fabs(res[0].logprob - log(0.2)) < 1e-5, "target logprob of the draft");
            /* The bonus row draws fresh from row 1 (case 0). */
            int32_t want;
            sampler_dist d = test_dist(&s.target[1], ws, 0);
            cr_assert_eq(sampler_dist_pick(&d, coin(seed, 1, SAMPLER_CASE_FRESH), &want, NULL),
                         DI_OK);
            cr_assert_eq(res[1].token, want);
            accepted++;
        } else {
            cr_assert_eq(na, 0);
            /* Residual: in .6 - .3c, under .2 (1 - c), c = e^-5e-5; "in" comes first. */
            double c = exp(-5e-5), r_in = 0.6 - 0.3 * c, r_under = 0.2 * (1 - c);
            double edge = r_in / (r_in + r_under), u1 = coin(seed, 0, SAMPLER_CASE_RESAMPLE);
            if (fabs(u1 - edge) < 1e-6)
                continue;
            cr_assert_eq(res[0].token, u1 < edge ? IN : UNDER, "resample u %f", u1);
            cr_assert(fabs(res[0].logprob - log(0.6)) < 1e-5 || res[0].token == UNDER);
            cr_assert_eq(res[0].n_top, 2);
            cr_assert_eq(res[0].top_tokens[0], IN);
            cr_assert_eq(res[0].top_tokens[1], ON, "ties to the lower id");
            rejected++;
        }
    }
    cr_assert(accepted > 80 && rejected > 140, "accepted %d rejected %d", accepted, rejected);
    sampler_workspace_free(ws);
}

/* A draft outside the target's kept top-k has t = -inf: it always fails, and the resample never
 * returns it. */
Test(verify, draft_outside_kept_set_always_fails)
{
    const float target[] = {3.0f, 2.0f, 1.0f, 0.0f};
    const float draft[] = {0.0f, 0.0f, 5.0f, 0.0f};
    const float *tl[] = {target, target}, *dl[] = {draft};
    const int32_t tok[] = {2};
    sampling_params tp = sampling_params_default(), dp = sampling_params_default();
    tp.force_top_k = 2;
    sampler_workspace *ws = test_ws(4);
    for (uint64_t seed = 0; seed < 200; seed++) {
        tp.seed = seed;
        step s;
        step_init(&s, 1, tl, dl, tok, 4, &tp, &dp);
        sampler_result res[2];
        uint32_t na;
        cr_assert_eq(sampler_verify(&s.in, ws, res, &na, NULL), DI_OK);
        cr_assert_eq(na, 0);
        cr_assert(res[0].token == 0 || res[0].token == 1, "got %d", res[0].token);
    }
    sampler_workspace_free(ws);
}

/* Identical target and draft: every draft passes (t = d), and the bonus row k draws fresh from
 * its own stream, exactly as sampler_sample does for row k. */
Test(verify, all_accepted_then_bonus)
{
    enum { V = 50, K = 5 };
    float logits[K + 1][V];
    const float *tl[K + 1], *dl[K];
    for (int i = 0; i <= K; i++) {
        test_normal_logits(logits[i], V, 1.0, 40 + (uint64_t)i);
        tl[i] = logits[i];
        if (i < K)
            dl[i] = logits[i];
    }
    sampling_params p = sampling_params_default();
    p.seed = 1;
    p.n_logprobs = 3;
    sampler_workspace *ws = test_ws(V);
    int32_t tok[K];
    for (int i = 0; i < K; i++) {
        sampler_row r = test_row(logits[i], V, &p);
        sampler_result res;
        cr_assert_eq(sampler_sample(&r, ws, &res, NULL), DI_OK);
        tok[i] = res.token;
    }
    step s;
    step_init(&s, K, tl, dl, tok, V, &p, &p);
    sampler_result res[K + 1];
    uint32_t na;
    di_error e;
    cr_assert_eq(sampler_verify(&s.in, ws, res, &na, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(na, K);
    for (int i = 0; i < K; i++) {
        cr_assert_eq(res[i].token, tok[i]);
        sampler_dist d = test_dist(&s.target[i], ws, 0);
        cr_assert(fabs(res[i].logprob - sampler_dist_logprob(&d, tok[i])) < 1e-6);
    }
    sampler_result bonus;
    cr_assert_eq(sampler_sample(&s.target[K], ws, &bonus, NULL), DI_OK);
    cr_assert_eq(res[K].token, bonus.token);
    cr_assert_eq(memcmp(&res[K].logprob, &bonus.logprob, sizeof(float)), 0);
    cr_assert_eq(res[K].n_top, 3);
    /* k = 0: just the bonus row, i.e. a plain sample of row 0. */
    s.in.k = 0;
    cr_assert_eq(sampler_verify(&s.in, ws, res, &na, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(na, 0);
    cr_assert_eq(sampler_sample(&s.target[0], ws, &bonus, NULL), DI_OK);
    cr_assert_eq(res[0].token, bonus.token);
    sampler_workspace_free(ws);
}

/* Rows after the first rejection are never looked at: a NaN row 2 does not matter when draft 0
 * fails, and is the request's error when the drafts before it pass. */
Test(verify, stops_at_first_rejection)
{
    const float good[] = {1.0f, 0.0f, 0.0f};
    const float bad[] = {1.0f, NAN, 0.0f};
    const float *tl[] = {good, good, bad}, *dl[] = {good, good};
    sampling_params p = sampling_params_default();
    sampling_params tp = p;
    tp.blacklist = (const int32_t[]){2};
    tp.n_blacklist = 1;
    sampler_workspace *ws = test_ws(3);
    const int32_t fail_first[] = {2, 0}; /* token 2 is blacklisted in the target: t = -inf */
    step s;
    step_init(&s, 2, tl, dl, fail_first, 3, &tp, &p);
    sampler_result res[3];
    memset(res, 0x33, sizeof res);
    uint32_t na;
    di_error e;
    cr_assert_eq(sampler_verify(&s.in, ws, res, &na, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(na, 0);
    cr_assert(res[0].token == 0 || res[0].token == 1);
    cr_assert_eq(res[1].token, 0x33333333, "nothing written past the result count");
    /* Same logits for target and draft: drafts 0 and 1 pass, row 2 is NaN. */
    const int32_t pass[] = {0, 1};
    step_init(&s, 2, tl, dl, pass, 3, &p, &p);
    memset(res, 0x33, sizeof res);
    na = 77;
    cr_assert_eq(sampler_verify(&s.in, ws, res, &na, &e), DI_ERANGE);
    cr_assert_str_eq(e.msg, "verify bonus row 2: logit of token 1 is nan: logits must be finite "
                            "or -inf");
    cr_assert_eq(na, 77, "untouched on failure");
    cr_assert_eq(res[0].token, 0x33333333, "untouched on failure");
    sampler_workspace_free(ws);
}

Test(verify, input_errors)
{
    const float l[] = {1.0f, 0.0f, -INFINITY};
    const float *tl[] = {l, l, l}, *dl[] = {l, l};
    const int32_t tok[] = {0, 1};
    sampling_params p = sampling_params_default();
    sampler_workspace *ws = test_ws(3);
    sampler_result res[3];
    uint32_t na;
    di_error e;
    step s;
    step_init(&s, 2, tl, dl, tok, 3, &p, &p);
    s.target[1].row = 2;
    cr_assert_eq(sampler_verify(&s.in, ws, res, &na, &e), DI_EINVAL);
    cr_assert_str_eq(e.msg, "verify row 1: needs row index 1 (has 2), position 16390 (has "
                            "16390), the first row's seed and draft = false");
    step_init(&s, 2, tl, dl, tok, 3, &p, &p);
    s.target[2].position = 5;
    cr_assert_eq(sampler_verify(&s.in, ws, res, &na, &e), DI_EINVAL);
    step_init(&s, 2, tl, dl, tok, 3, &p, &p);
    s.tokens[1] = 3;
    cr_assert_eq(sampler_verify(&s.in, ws, res, &na, &e), DI_EINVAL);
    cr_assert_str_eq(e.msg, "draft 1: token 3 outside [0, 3)");
    step_init(&s, 2, tl, dl, tok, 3, &p, &p);
    s.tokens[0] = 2; /* -inf under the draft's own logits */
    cr_assert_eq(sampler_verify(&s.in, ws, res, &na, &e), DI_EINVAL);
    cr_assert_str_eq(e.msg, "draft 0: token 2 has probability 0 under the draft's own "
                            "distribution");
    step_init(&s, 2, tl, dl, tok, 3, &p, &p);
    s.in.k = SAMPLER_MAX_DRAFTS + 1;
    cr_assert_eq(sampler_verify(&s.in, ws, res, &na, &e), DI_EINVAL);
    s.in.k = 2;
    s.in.draft = NULL;
    cr_assert_eq(sampler_verify(&s.in, ws, res, &na, &e), DI_EINVAL);
    cr_assert_eq(sampler_verify(NULL, ws, res, &na, &e), DI_EINVAL);
    step_init(&s, 2, tl, dl, tok, 3, &p, &p);
    cr_assert_eq(sampler_verify(&s.in, ws, NULL, &na, &e), DI_EINVAL);
    sampler_workspace_free(ws);
}
