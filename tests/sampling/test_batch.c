/* Batch invariance, failure isolation, threads and the integer mass. */
#include <pthread.h>
#include <string.h>

#include "tests/sampling/sampling_test.h"

enum { NROWS = 64 };

/* 64 rows over the V4.1 vocabulary with varied parameters, logits and masks. */
typedef struct batch {
    float *logits;                  /* [NROWS][V41_VOCAB] */
    uint32_t *masks;                /* [NROWS][(V + 31) / 32] */
    sampling_params params[NROWS];
    int32_t ban[NROWS][3];
    sampler_row rows[NROWS];
} batch;

static batch *batch_make(uint64_t seed)
{
    batch *b = calloc(1, sizeof(*b));
    const uint32_t words = (V41_VOCAB + 31) / 32;
    b->logits = malloc((size_t)NROWS * V41_VOCAB * sizeof(float));
    b->masks = malloc((size_t)NROWS * words * sizeof(uint32_t));
    di_rng r;
    di_rng_init(&r, seed);
    for (int i = 0; i < NROWS; i++) {
        float *l = b->logits + (size_t)i * V41_VOCAB;
        double sigma = (i % 4 == 0) ? 8.0 : 2.0; /* some peaked rows */
        test_normal_logits(l, V41_VOCAB, sigma, seed * 1000 + (uint64_t)i);
        sampling_params *p = &b->params[i];
        *p = sampling_params_default();
        p->seed = di_rng_u64(&r);
        p->temperature = (float)(di_rng_below(&r, 4) == 0 ? 0.0 : 0.2 + di_rng_uniform(&r));
        p->top_p = (float)(di_rng_below(&r, 2) ? 1.0 : 0.5 + 0.5 * di_rng_uniform(&r));
        p->top_k = di_rng_below(&r, 3) == 0 ? (int32_t)(1 + di_rng_below(&r, 50)) : -1;
        p->n_logprobs = (uint32_t)di_rng_below(&r, 21);
        p->eos_id = 1;
        p->first_n_no_eos = 1;
        for (int j = 0; j < 3; j++)
            b->ban[i][j] = (int32_t)di_rng_below(&r, V41_VOCAB);
        p->blacklist = b->ban[i];
        p->n_blacklist = 3;
        uint32_t *m = b->masks + (size_t)i * words;
        for (uint32_t w = 0; w < words; w++)
            m[w] = di_rng_u32(&r) | di_rng_u32(&r); /* about 3/4 allowed */
        b->rows[i] = (sampler_row){
            .logits = l,
            .n_vocab = V41_VOCAB,
            .params = p,
            .grammar_mask = i % 3 == 0 ? m : NULL,
            .output_index = (uint32_t)di_rng_below(&r, 3),
            .position = 1000 + di_rng_below(&r, 100000),
            .row = (uint32_t)di_rng_below(&r, 6),
            .draft = i % 5 == 0,
        };
    }
    return b;
}

static void batch_free(batch *b)
{
    free(b->logits);
    free(b->masks);
    free(b);
}

/* Bitwise equality of the meaningful part of two results. */
static void assert_same(const sampler_result *a, const sampler_result *b, int i)
{
    cr_assert_eq(a->err.code, b->err.code, "row %d", i);
    cr_assert_eq(a->token, b->token, "row %d: %d vs %d", i, a->token, b->token);
    cr_assert_eq(memcmp(&a->logprob, &b->logprob, sizeof(float)), 0, "row %d logprob", i);
    cr_assert_eq(a->n_top, b->n_top, "row %d", i);
    cr_assert_eq(memcmp(a->top_tokens, b->top_tokens, a->n_top * sizeof(int32_t)), 0);
    cr_assert_eq(memcmp(a->top_logprobs, b->top_logprobs, a->n_top * sizeof(float)), 0);
}

Test(batch, row_alone_equals_row_in_batch_and_permutes, .timeout = 60)
{
    batch *b = batch_make(1);
    sampler_workspace *ws = test_ws(V41_VOCAB);
    sampler_result *all = malloc(NROWS * sizeof(*all));
    size_t failed = 99;
    di_error e;
    cr_assert_eq(sampler_sample_batch(b->rows, NROWS, ws, all, &failed, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(failed, 0);
    for (int i = 0; i < NROWS; i++) {
        sampler_workspace *fresh = test_ws(V41_VOCAB);
        sampler_result alone;
        cr_assert_eq(sampler_sample(&b->rows[i], fresh, &alone, &e), DI_OK, "%s", e.msg);
        assert_same(&alone, &all[i], i);
        sampler_workspace_free(fresh);
    }
    /* Reverse and shuffle the batch: results follow their rows, bit for bit. */
    sampler_row *perm = malloc(NROWS * sizeof(*perm));
    int idx[NROWS];
    di_rng r;
    di_rng_init(&r, 77);
    for (int i = 0; i < NROWS; i++)
        idx[i] = i;
    for (int i = NROWS - 1; i > 0; i--) {
        int j = (int)di_rng_below(&r, (uint64_t)i + 1), t = idx[i];
        idx[i] = idx[j];
        idx[j] = t;
    }
    for (int i = 0; i < NROWS; i++)
        perm[i] = b->rows[idx[i]];
    sampler_result *pres = malloc(NROWS * sizeof(*pres));
    cr_assert_eq(sampler_sample_batch(perm, NROWS, ws, pres, NULL, NULL), DI_OK);
    for (int i = 0; i < NROWS; i++)
        assert_same(&pres[i], &all[idx[i]], i);
    /* A smaller batch (rows 10..19 only) agrees too. */
    cr_assert_eq(sampler_sample_batch(b->rows + 10, 10, ws, pres, NULL, NULL), DI_OK);
    for (int i = 0; i < 10; i++)
        assert_same(&pres[i], &all[10 + i], 10 + i);
    free(pres);
    free(perm);
    free(all);
    sampler_workspace_free(ws);
    batch_free(b);
}

/* A fully blocked row and a row with bad parameters fail alone; their neighbours are right. */
Test(batch, failing_rows_leave_others_alone, .timeout = 60)
{
    batch *b = batch_make(2);
    sampler_workspace *ws = test_ws(V41_VOCAB);
    sampler_result *ref = malloc(NROWS * sizeof(*ref));
    cr_assert_eq(sampler_sample_batch(b->rows, NROWS, ws, ref, NULL, NULL), DI_OK);
    const uint32_t words = (V41_VOCAB + 31) / 32;
    uint32_t *zero = calloc(words, sizeof(uint32_t));
    sampler_row broken[NROWS];
    memcpy(broken, b->rows, sizeof broken);
    broken[5].grammar_mask = zero; /* nothing allowed */
    sampling_params bad = b->params[9];
    bad.top_p = 1.5f;
    broken[9].params = &bad;
    float *nan_row = malloc(V41_VOCAB * sizeof(float));
    memcpy(nan_row, b->rows[20].logits, V41_VOCAB * sizeof(float));
    nan_row[4242] = NAN;
    broken[20].logits = nan_row;
    sampler_result *res = malloc(NROWS * sizeof(*res));
    size_t failed = 0;
    cr_assert_eq(sampler_sample_batch(broken, NROWS, ws, res, &failed, NULL), DI_OK);
    cr_assert_eq(failed, 3);
    cr_assert_eq(res[5].err.code, DI_ERANGE);
    cr_assert(strstr(res[5].err.msg, "the grammar mask allows 0"), "%s", res[5].err.msg);
    cr_assert_eq(res[5].token, -1);
    cr_assert_eq(res[9].err.code, DI_EINVAL);
    cr_assert_str_eq(res[9].err.msg, "top_p 1.5 outside (0, 1]");
    cr_assert_eq(res[20].err.code, DI_ERANGE);
    cr_assert_str_eq(res[20].err.msg, "logit of token 4242 is nan: logits must be finite or -inf");
    for (int i = 0; i < NROWS; i++)
        if (i != 5 && i != 9 && i != 20)
            assert_same(&res[i], &ref[i], i);
    di_error e;
    cr_assert_eq(sampler_sample_batch(NULL, 3, ws, res, NULL, &e), DI_EINVAL);
    cr_assert_eq(sampler_sample_batch(b->rows, 3, NULL, res, NULL, &e), DI_EINVAL);
    cr_assert_eq(sampler_sample_batch(NULL, 0, NULL, NULL, &failed, &e), DI_OK);
    cr_assert_eq(failed, 0);
    free(nan_row);
    free(res);
    free(zero);
    free(ref);
    sampler_workspace_free(ws);
    batch_free(b);
}

typedef struct worker {
    const sampler_row *rows; /* this thread's rows */
    size_t n;
    sampler_result *out;
    di_status st;
} worker;

static void *work(void *arg)
{
    worker *w = arg;
    sampler_workspace *ws = NULL;
    w->st = sampler_workspace_new(V41_VOCAB, &ws, NULL);
    if (w->st == DI_OK)
        w->st = sampler_sample_batch(w->rows, w->n, ws, w->out, NULL, NULL);
    sampler_workspace_free(ws);
    return NULL;
}

/* Four threads on disjoint quarters, one workspace each, agree with one thread. */
Test(batch, threads_on_disjoint_rows, .timeout = 60)
{
    batch *b = batch_make(3);
    sampler_workspace *ws = test_ws(V41_VOCAB);
    sampler_result *ref = malloc(NROWS * sizeof(*ref)), *par = malloc(NROWS * sizeof(*par));
    cr_assert_eq(sampler_sample_batch(b->rows, NROWS, ws, ref, NULL, NULL), DI_OK);
    pthread_t th[4];
    worker w[4];
    for (int t = 0; t < 4; t++) {
        w[t] = (worker){.rows = b->rows + t * 16, .n = 16, .out = par + t * 16};
        cr_assert_eq(pthread_create(&th[t], NULL, work, &w[t]), 0);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(th[t], NULL);
        cr_assert_eq(w[t].st, DI_OK);
    }
    for (int i = 0; i < NROWS; i++)
        assert_same(&par[i], &ref[i], i);
    free(ref);
    free(par);
    sampler_workspace_free(ws);
    batch_free(b);
}

/* The integer total of a distribution is the same in every summation order; a float sum of
 * the same probabilities is not (the reason for integers). */
Test(batch, integer_mass_sum_order_free, .timeout = 60)
{
    float *l = malloc(V41_VOCAB * sizeof(float));
    test_normal_logits(l, V41_VOCAB, 1.0, 31);
    sampling_params p = sampling_params_default();
    p.force_top_k = 0;
    p.temperature = 2.0f;
    sampler_workspace *ws = test_ws(V41_VOCAB);
    sampler_row row = test_row(l, V41_VOCAB, &p);
    sampler_dist d = test_dist(&row, ws, 0);
    cr_assert_gt(d.n, 100000u);
    uint32_t *perm = malloc(d.n * sizeof(*perm));
    for (uint32_t i = 0; i < d.n; i++)
        perm[i] = i;
    di_rng r;
    di_rng_init(&r, 5);
    float fsum_first = 0;
    int float_orders_differ = 0;
    for (int round = 0; round < 20; round++) {
        for (uint32_t i = d.n - 1; i > 0; i--) {
            uint32_t j = (uint32_t)di_rng_below(&r, (uint64_t)i + 1), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        uint64_t isum = 0;
        float fsum = 0;
        for (uint32_t i = 0; i < d.n; i++) {
            isum += d.mass[perm[i]];
            fsum += (float)d.mass[perm[i]] / (float)d.total;
        }
        cr_assert_eq(isum, d.total, "order %d", round);
        if (round == 0)
            fsum_first = fsum;
        float_orders_differ |= fsum != fsum_first;
    }
    cr_assert(float_orders_differ, "float sums of 1e5 terms are expected to depend on order");
    free(perm);
    free(l);
    sampler_workspace_free(ws);
}
