/* The backend sampler's host side (sampler_backend.h): the kernel row a sampler row becomes
 * (resolved temperature, seed and stream, the bitmap of allowed tokens), and
 * sampler_sample_backend through a backend whose `sample` entry is sampler_host_sample: the
 * same results as sampler_sample row by row, failures with the host's messages, refusals. The
 * CUDA kernel is held to the same results in tests/gpu/check_sample.c. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "common/sampling/sampler_backend.h"
#include "tests/sampling/sampling_test.h"

#define V 3000u

static sampler_workspace *g_ws; /* the host entry's workspace */

static void host_to_host(void *ctx, void *dst, const void *src, size_t bytes)
{
    (void)ctx;
    memcpy(dst, src, bytes);
}

static di_status failing_sample(void *ctx, const kern_sample *p)
{
    (void)ctx, (void)p;
    return DI_EINTERNAL;
}

static kern_backend host_backend(void)
{
    kern_backend be;
    memset(&be, 0, sizeof(be));
    be.name = "host";
    be.ctx = g_ws;
    be.ops.to_host = host_to_host;
    be.ops.sample = sampler_host_sample;
    return be;
}

static int bit(const uint32_t *m, int32_t t)
{
    return (m[t >> 5] >> (t & 31)) & 1;
}

Test(sampler_backend, kernel_row_resolves_parameters_and_the_bitmap)
{
    sampling_params p = sampling_params_default();
    p.temperature = 0.0f;
    p.top_p = 0.75f;
    p.top_k = 9;
    p.seed = 77;
    int32_t bl[2] = {5, 2999};
    p.blacklist = bl;
    p.n_blacklist = 2;
    p.eos_id = 40;
    p.first_n_no_eos = 2;
    uint32_t mask[(V + 31) / 32], map[(V + 31) / 32];
    for (uint32_t w = 0; w < (V + 31) / 32; w++)
        mask[w] = 0xF0F0F0F0u ^ w;
    mask[1] |= 1u << (40 - 32); /* EOS allowed by the grammar */
    sampler_row row = {.n_vocab = V, .params = &p, .grammar_mask = mask, .output_index = 1,
                       .position = 1234, .row = 2, .draft = true};
    kern_sample_row k;
    di_error e;
    cr_assert_eq(sampler_kern_row(&row, map, &k, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(k.temperature, SAMPLER_MIN_TEMPERATURE);
    cr_assert_eq(k.top_p, 0.75f);
    cr_assert_eq(k.top_k, 9);
    cr_assert_eq(k.seed, sampler_draft_seed(77));
    cr_assert_eq(k.stream, sampler_stream(1234, 2, SAMPLER_CASE_FRESH));
    cr_assert_eq(k.allowed, map);
    for (int32_t t = 0; t < (int32_t)V; t++) {
        int want = bit(mask, t) && t != 5 && t != 2999 && t != 40;
        cr_assert_eq(bit(map, t), want, "token %d", t);
    }
    cr_assert_eq(map[(V - 1) / 32] >> (V % 32), 0u, "bits past the vocabulary stay clear");
    /* past first_n_no_eos the EOS bit follows the grammar again; no mask, no list: no bitmap */
    row.output_index = 2;
    cr_assert_eq(sampler_kern_row(&row, map, &k, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(bit(map, 40), 1);
    row.grammar_mask = NULL;
    p.n_blacklist = 0;
    cr_assert_eq(sampler_kern_row(&row, map, &k, &e), DI_OK, "%s", e.msg);
    cr_assert_null(k.allowed);
    /* a row that blocks tokens needs the bitmap; bad parameters are refused */
    p.n_blacklist = 1;
    cr_assert_eq(sampler_kern_row(&row, NULL, &k, &e), DI_EINVAL);
    p.top_p = 1.5f;
    cr_assert_eq(sampler_kern_row(&row, map, &k, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "top_p"), "%s", e.msg);
}

/* Random rows with every parameter the sampler has; some rows NaN or fully blocked. */
Test(sampler_backend, backend_rows_equal_the_host_sampler_row_by_row)
{
    g_ws = test_ws(V);
    sampler_workspace *ws = test_ws(V);
    kern_backend be = host_backend();
    enum { N = 40 };
    static float x[N * V];
    static uint32_t masks[N][(V + 31) / 32];
    sampling_params p[N];
    int32_t bl[N][3];
    sampler_row rows[N];
    di_rng rng;
    di_rng_init(&rng, 99);
    for (uint32_t i = 0; i < N; i++) {
        float *r = x + (size_t)i * V;
        for (uint32_t t = 0; t < V; t++)
            r[t] = (float)(di_rng_normal(&rng) * (i % 3 ? 2.0 : 0.01));
        if (i % 7 == 3)
            r[di_rng_below(&rng, V)] = NAN;
        p[i] = sampling_params_default();
        p[i].temperature = (float)(i % 4) * 0.5f;
        p[i].top_p = i % 5 ? 0.9f : 1.0f;
        p[i].top_k = i % 6 ? -1 : 20;
        p[i].force_top_k = i % 8 == 1 ? 0 : 512;
        p[i].n_logprobs = i % 21;
        p[i].seed = di_rng_u64(&rng);
        for (int j = 0; j < 3; j++)
            bl[i][j] = (int32_t)di_rng_below(&rng, V);
        p[i].blacklist = bl[i];
        p[i].n_blacklist = i % 3;
        p[i].eos_id = (int32_t)di_rng_below(&rng, V);
        p[i].first_n_no_eos = i % 2;
        for (uint32_t w = 0; w < (V + 31) / 32; w++)
            masks[i][w] = i % 9 == 5 ? 0 : (uint32_t)di_rng_u64(&rng);
        rows[i] = (sampler_row){.n_vocab = V, .params = &p[i],
                                .grammar_mask = i % 4 == 2 || i % 9 == 5 ? masks[i] : NULL,
                                .output_index = 0, .position = 1000 + i, .row = i % 3,
                                .draft = i % 5 == 4};
    }
    sampler_result got[N];
    size_t failed = 0;
    di_error e;
    cr_assert_eq(sampler_sample_backend(&be, x, V, rows, N, ws, got, &failed, &e), DI_OK, "%s",
                 e.msg);
    size_t want_failed = 0;
    for (uint32_t i = 0; i < N; i++) {
        sampler_row h = rows[i];
        h.logits = x + (size_t)i * V;
        sampler_result want;
        di_status st = sampler_sample(&h, ws, &want, &want.err);
        cr_assert_eq(got[i].err.code, st, "row %u: %s", i, got[i].err.msg);
        if (st != DI_OK) {
            want_failed++;
            cr_assert_str_eq(got[i].err.msg, want.err.msg);
            cr_assert_eq(got[i].token, -1);
            continue;
        }
        cr_assert_eq(got[i].token, want.token, "row %u", i);
        cr_assert_eq(memcmp(&got[i].logprob, &want.logprob, sizeof(float)), 0, "row %u", i);
        cr_assert_eq(got[i].n_top, want.n_top, "row %u", i);
        cr_assert_eq(memcmp(got[i].top_tokens, want.top_tokens, want.n_top * 4), 0);
        cr_assert_eq(memcmp(got[i].top_logprobs, want.top_logprobs, want.n_top * 4), 0);
    }
    cr_assert_gt(want_failed, 1, "the rows include NaN and fully blocked ones");
    cr_assert_eq(failed, want_failed);
    sampler_workspace_free(ws);
    sampler_workspace_free(g_ws);
}

Test(sampler_backend, refusals_and_backend_failures)
{
    g_ws = test_ws(V);
    sampler_workspace *ws = test_ws(V);
    static float x[2 * V];
    sampling_params p = sampling_params_default();
    sampler_row rows[2] = {{.n_vocab = V, .params = &p}, {.n_vocab = V, .params = &p}};
    sampler_result res[2];
    di_error e;
    kern_backend be = host_backend();
    be.ops.sample = NULL;
    cr_assert_eq(sampler_sample_backend(&be, x, V, rows, 2, ws, res, NULL, &e),
                 DI_EUNSUPPORTED);
    be = host_backend();
    cr_assert_eq(sampler_sample_backend(&be, x, V - 1, rows, 2, ws, res, NULL, &e), DI_EINVAL);
    rows[1].n_vocab = V - 1;
    cr_assert_eq(sampler_sample_backend(&be, x, V, rows, 2, ws, res, NULL, &e), DI_EINVAL);
    rows[1].n_vocab = V;
    p.top_k = 0;
    cr_assert_eq(sampler_sample_backend(&be, x, V, rows, 2, ws, res, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "row 0"), "%s", e.msg);
    p.top_k = -1;
    be.ops.sample = failing_sample;
    cr_assert_eq(sampler_sample_backend(&be, x, V, rows, 2, ws, res, NULL, &e), DI_EINTERNAL);
    cr_assert(strstr(e.msg, "host"), "%s", e.msg);
    be = host_backend();
    size_t failed = 7;
    cr_assert_eq(sampler_sample_backend(&be, x, V, rows, 0, ws, res, &failed, &e), DI_OK);
    cr_assert_eq(failed, 0);
    sampler_workspace_free(ws);
    sampler_workspace_free(g_ws);
}
