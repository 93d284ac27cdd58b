/* Parameters, their validation messages, and the random key. */
#include <string.h>

#include "tests/sampling/sampling_test.h"

Test(params, defaults)
{
    sampling_params p = sampling_params_default();
    cr_assert_eq(p.temperature, 1.0f);
    cr_assert_eq(p.top_p, 1.0f);
    cr_assert_eq(p.top_k, -1);
    cr_assert_eq(p.force_top_k, 4096u);
    cr_assert_eq(p.first_n_no_eos, 0u);
    cr_assert_eq(p.eos_id, -1);
    cr_assert_eq(p.n_blacklist, 0u);
    cr_assert_eq(p.n_logprobs, 0u);
    cr_assert_eq(p.seed, 0u);
    cr_assert_eq(sampling_params_validate(&p, 10, NULL), DI_OK);
}

/* One bad value per row: the field is set, validation fails with DI_EINVAL and this message. */
static void set_top_p(sampling_params *p) { p->top_p = 1.5f; }
static void set_top_p0(sampling_params *p) { p->top_p = 0.0f; }
static void set_top_p_nan(sampling_params *p) { p->top_p = NAN; }
static void set_temp_neg(sampling_params *p) { p->temperature = -0.5f; }
static void set_temp_inf(sampling_params *p) { p->temperature = INFINITY; }
static void set_top_k0(sampling_params *p) { p->top_k = 0; }
static void set_top_k_neg(sampling_params *p) { p->top_k = -2; }
static void set_logprobs(sampling_params *p) { p->n_logprobs = 21; }
static void set_eos_big(sampling_params *p) { p->eos_id = 10; }
static void set_eos_neg(sampling_params *p) { p->eos_id = -2; }
static const int32_t bad_list[] = {3, 12};
static void set_blacklist(sampling_params *p) { p->blacklist = bad_list, p->n_blacklist = 2; }
static const int32_t neg_list[] = {-1};
static void set_blacklist_neg(sampling_params *p) { p->blacklist = neg_list, p->n_blacklist = 1; }
static void set_blacklist_null(sampling_params *p) { p->n_blacklist = 3; }
static void set_blacklist_long(sampling_params *p) { p->blacklist = bad_list, p->n_blacklist = 11; }

Test(params, validation_messages)
{
    static const struct {
        void (*set)(sampling_params *);
        const char *msg;
    } rows[] = {
        {set_top_p, "top_p 1.5 outside (0, 1]"},
        {set_top_p0, "top_p 0 outside (0, 1]"},
        {set_top_p_nan, "top_p nan outside (0, 1]"},
        {set_temp_neg, "temperature -0.5 outside [0, inf)"},
        {set_temp_inf, "temperature inf outside [0, inf)"},
        {set_top_k0, "top_k 0 outside [1, 2147483647] (or -1 = off)"},
        {set_top_k_neg, "top_k -2 outside [1, 2147483647] (or -1 = off)"},
        {set_logprobs, "logprobs 21 outside [0, 20]"},
        {set_eos_big, "eos_id 10 outside [0, 10) (or -1 = none)"},
        {set_eos_neg, "eos_id -2 outside [0, 10) (or -1 = none)"},
        {set_blacklist, "blacklist[1] = 12 outside the vocabulary [0, 10)"},
        {set_blacklist_neg, "blacklist[0] = -1 outside the vocabulary [0, 10)"},
        {set_blacklist_null, "blacklist has 3 entries but no array"},
        {set_blacklist_long, "blacklist has 11 entries, more than the vocabulary (10)"},
    };
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        sampling_params p = sampling_params_default();
        rows[i].set(&p);
        di_error e;
        cr_assert_eq(sampling_params_validate(&p, 10, &e), DI_EINVAL, "row %zu", i);
        cr_assert_eq(e.code, DI_EINVAL);
        cr_assert_str_eq(e.msg, rows[i].msg);
    }
    sampling_params p = sampling_params_default();
    di_error e;
    cr_assert_eq(sampling_params_validate(&p, 0, &e), DI_EINVAL);
    cr_assert_eq(sampling_params_validate(NULL, 10, &e), DI_EINVAL);
}

Test(params, edge_values_accepted)
{
    sampling_params p = sampling_params_default();
    p.temperature = 0.0f;
    p.top_p = 1.0f;
    p.top_k = 1;
    p.force_top_k = 0;
    p.n_logprobs = 20;
    p.eos_id = 9;
    p.first_n_no_eos = UINT32_MAX;
    static const int32_t ok_list[] = {0, 9, 9};
    p.blacklist = ok_list;
    p.n_blacklist = 3;
    di_error e;
    cr_assert_eq(sampling_params_validate(&p, 10, &e), DI_OK, "%s", e.msg);
    p.top_p = 1e-30f; /* tiny but inside (0, 1] */
    cr_assert_eq(sampling_params_validate(&p, 10, &e), DI_OK, "%s", e.msg);
}

Test(params, temperature_zero_becomes_1e5)
{
    sampling_params p = sampling_params_default();
    p.temperature = 0.0f;
    cr_assert_eq(sampling_params_temperature(&p), 1e-5f);
    p.temperature = 0.4f;
    cr_assert_eq(sampling_params_temperature(&p), 0.4f);
}

Test(params, table_rows_match_fields)
{
    /* Each table row's offset addresses the field with its name; the table drives defaults. */
    sampling_params p;
    memset(&p, 0, sizeof p);
    size_t n = sampling_param_spec_count;
    cr_assert_eq(n, 6);
    const char *names[] = {"temperature", "top_p", "top_k", "force_top_k", "first_n_no_eos",
                           "logprobs"};
    const size_t offs[] = {offsetof(sampling_params, temperature),
                           offsetof(sampling_params, top_p), offsetof(sampling_params, top_k),
                           offsetof(sampling_params, force_top_k),
                           offsetof(sampling_params, first_n_no_eos),
                           offsetof(sampling_params, n_logprobs)};
    for (size_t i = 0; i < n; i++) {
        cr_assert_str_eq(sampling_param_specs[i].name, names[i]);
        cr_assert_eq(sampling_param_specs[i].offset, offs[i]);
        cr_assert(sampling_param_specs[i].help && sampling_param_specs[i].help[0]);
    }
}

/* The explainer's "random key" numbers: r1 (seed 1) prompt of 16,389 tokens. */
Test(key, explainer_positions_and_streams)
{
    cr_assert_eq(sampler_prefill_position(16389), 16389u);
    cr_assert_eq(sampler_stream(sampler_prefill_position(16389), 0, SAMPLER_CASE_FRESH), 49167u);
    /* First decode step: seqlen_k 16,395 with 6 rows (token + 5 drafts). */
    uint64_t p = sampler_decode_position(16395, 6);
    cr_assert_eq(p, 16390u);
    cr_assert_eq(sampler_stream(p, 0, SAMPLER_CASE_FRESH), 49170u);
    cr_assert_eq(sampler_stream(p, 0, SAMPLER_CASE_RESAMPLE), 49171u);
    cr_assert_eq(sampler_stream(p, 0, SAMPLER_CASE_ACCEPT), 49172u);
    /* Row 1 uses position P + 10,000,019: 3 * 10,016,409 = 30,049,227. */
    cr_assert_eq(sampler_stream(p, 1, SAMPLER_CASE_FRESH), 30049227u);
    cr_assert_eq(sampler_stream(p, 5, SAMPLER_CASE_ACCEPT), 3u * (16390u + 5u * 10000019u) + 2u);
    cr_assert_eq(sampler_draft_seed(1), 1000000008u);
    cr_assert_eq(sampler_draft_seed(UINT64_MAX), 1000000006u, "wraps mod 2^64");
    cr_assert_eq(sampler_uniform(1, 49167), di_philox_uniform(1, 49167, 0));
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

Test(key, streams_never_alias)
{
    /* Over positions 0..2047, rows 0..5 and the three cases, every stream is distinct (sorted,
     * no two neighbours equal). */
    enum { NP = 2048, NR = 6, N = NP * NR * 3 };
    uint64_t *s = malloc(N * sizeof(*s));
    size_t n = 0;
    for (uint64_t pos = 0; pos < NP; pos++)
        for (uint32_t r = 0; r < NR; r++)
            for (int c = 0; c < 3; c++)
                s[n++] = sampler_stream(pos, r, (sampler_case)c);
    qsort(s, n, sizeof(*s), cmp_u64);
    for (size_t i = 1; i < n; i++)
        cr_assert_neq(s[i], s[i - 1], "stream %llu repeats", (unsigned long long)s[i]);
    free(s);
}

Test(workspace, errors_and_null_free)
{
    sampler_workspace *ws = (sampler_workspace *)0x1;
    di_error e;
    cr_assert_eq(sampler_workspace_new(0, &ws, &e), DI_EINVAL);
    cr_assert_eq(ws, (sampler_workspace *)0x1, "untouched on failure");
    cr_assert_eq(sampler_workspace_new((1u << 30) + 1, &ws, &e), DI_EINVAL);
    cr_assert_eq(sampler_workspace_new(10, NULL, &e), DI_EINVAL);
    sampler_workspace_free(NULL);
}
