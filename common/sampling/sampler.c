/* sampler.c: sampling a row, a batch of rows, and verifying a request's drafts. */
#include <math.h>
#include <string.h>

#include "common/sampling/sampler_internal.h"

/* The result for the token at index idx of d, with the top n_logprobs of d. */
static void fill_result(const sampler_dist *d, uint32_t idx, uint32_t n_logprobs,
                        sampler_result *out)
{
    double log_total = log((double)d->total);
    di_error_clear(&out->err);
    out->token = d->ids[idx];
    out->logprob = (float)(log((double)d->mass[idx]) - log_total);
    out->n_top = n_logprobs < d->n ? n_logprobs : d->n;
    for (uint32_t i = 0; i < out->n_top; i++) {
        out->top_tokens[i] = d->ids[i];
        out->top_logprobs[i] = (float)(log((double)d->mass[i]) - log_total);
    }
}

static uint32_t index_of(const sampler_dist *d, int32_t token)
{
    for (uint32_t i = 0; i < d->n; i++)
        if (d->ids[i] == token)
            return i;
    return UINT32_MAX;
}

/* A keyed draw from d for row (position, row index) and case. */
static uint32_t keyed_pick(const sampler_dist *d, const sampler_row *row, uint32_t j,
                           sampler_case kase)
{
    double u = sampler_uniform(sampler_row_seed(row), sampler_stream(row->position, j, kase));
    return sampler_pick_index(d->mass, d->n, d->total, u);
}

di_status sampler_sample(const sampler_row *row, sampler_workspace *ws, sampler_result *out,
                         di_error *err)
{
    if (!out)
        return di_fail(err, DI_EINVAL, "sampler_sample: no result");
    sampler_dist d;
    di_status st = sampler_process_slot(row, ws, 0, &d, err);
    if (st != DI_OK)
        return st;
    fill_result(&d, keyed_pick(&d, row, row->row, SAMPLER_CASE_FRESH), row->params->n_logprobs,
                out);
    return DI_OK;
}

di_status sampler_sample_batch(const sampler_row *rows, size_t n, sampler_workspace *ws,
                               sampler_result *results, size_t *n_failed, di_error *err)
{
    if (n > 0 && (!rows || !results || !ws))
        return di_fail(err, DI_EINVAL, "sampler batch of %zu rows: rows, results and workspace "
                                       "are required", n);
    size_t failed = 0;
    for (size_t i = 0; i < n; i++) {
        sampler_result *r = &results[i];
        if (sampler_sample(&rows[i], ws, r, &r->err) != DI_OK) {
            r->token = -1;
            r->logprob = -INFINITY;
            r->n_top = 0;
            failed++;
        }
    }
    if (n_failed)
        *n_failed = failed;
    return DI_OK;
}

bool sampler_accept(double t, double d, double u)
{
    if (t == -INFINITY)
        return false;
    double a = t - d;
    return u < exp(a < 0.0 ? a : 0.0);
}

static di_status check_verify(const sampler_verify_in *in, const sampler_workspace *ws,
                              const sampler_result *results, const uint32_t *n_accepted,
                              di_error *err)
{
    if (!in || !ws || !results || !n_accepted)
        return di_fail(err, DI_EINVAL, "sampler_verify: input, workspace, results and count "
                                       "are required");
    if (in->k > SAMPLER_MAX_DRAFTS)
        return di_fail(err, DI_EINVAL, "%u drafts outside [0, %d]", in->k, SAMPLER_MAX_DRAFTS);
    if (!in->target || (in->k > 0 && (!in->draft || !in->draft_tokens)))
        return di_fail(err, DI_EINVAL, "sampler_verify: %u drafts need target rows, draft rows "
                                       "and draft tokens", in->k);
    const sampler_row *t0 = &in->target[0];
    for (uint32_t i = 0; i <= in->k; i++) {
        const sampler_row *t = &in->target[i];
        if (!t->params)
            return di_fail(err, DI_EINVAL, "verify row %u: params are required", i);
        if (t->row != i || t->position != t0->position || t->draft ||
            t->params->seed != t0->params->seed)
            return di_fail(err, DI_EINVAL,
                           "verify row %u: needs row index %u (has %u), position %llu (has %llu),"
                           " the first row's seed and draft = false", i, i, t->row,
                           (unsigned long long)t0->position, (unsigned long long)t->position);
        if (i < in->k && (in->draft_tokens[i] < 0 || (uint32_t)in->draft_tokens[i] >= t->n_vocab))
            return di_fail(err, DI_EINVAL, "draft %u: token %d outside [0, %u)", i,
                           in->draft_tokens[i], t->n_vocab);
    }
    return DI_OK;
}

/* Processes row into slot, prefixing a failure with the row's role. */
static di_status process_as(const sampler_row *row, sampler_workspace *ws, unsigned slot,
                            const char *role, uint32_t i, sampler_dist *d, di_error *err)
{
    di_status st = sampler_process_slot(row, ws, slot, d, err);
    if (st != DI_OK)
        di_error_prefix(err, "verify %s row %u: ", role, i);
    return st;
}

/* Checks draft i: DI_OK with *accepted set, or a failure. On acceptance res gets the draft;
 * on rejection res gets row i's resample. */
static di_status verify_one(const sampler_verify_in *in, uint32_t i, sampler_workspace *ws,
                            sampler_result *res, bool *accepted, di_error *err)
{
    const sampler_row *row = &in->target[i];
    sampler_dist t, d;
    di_status st = process_as(row, ws, 0, "target", i, &t, err);
    if (st == DI_OK)
        st = process_as(&in->draft[i], ws, 1, "draft", i, &d, err);
    if (st != DI_OK)
        return st;
    int32_t tok = in->draft_tokens[i];
    double lt = sampler_dist_logprob(&t, tok), ld = sampler_dist_logprob(&d, tok);
    if (ld == -INFINITY)
        return di_fail(err, DI_EINVAL, "draft %u: token %d has probability 0 under the draft's "
                                       "own distribution", i, tok);
    double u = sampler_uniform(sampler_row_seed(row),
                               sampler_stream(row->position, i, SAMPLER_CASE_ACCEPT));
    *accepted = sampler_accept(lt, ld, u);
    if (*accepted) {
        fill_result(&t, index_of(&t, tok), row->params->n_logprobs, res);
        return DI_OK;
    }
    di_status rs = sampler_residual_pick(&t, &d, row->n_vocab, ws,
                                         sampler_uniform(sampler_row_seed(row),
                                                         sampler_stream(row->position, i,
                                                                        SAMPLER_CASE_RESAMPLE)),
                                         &tok, err);
    if (rs != DI_OK)
        return rs;
    fill_result(&t, index_of(&t, tok), row->params->n_logprobs, res);
    return DI_OK;
}

di_status sampler_verify(const sampler_verify_in *in, sampler_workspace *ws,
                         sampler_result *results, uint32_t *n_accepted, di_error *err)
{
    di_status st = check_verify(in, ws, results, n_accepted, err);
    if (st != DI_OK)
        return st;
    sampler_result tmp[SAMPLER_MAX_DRAFTS + 1];
    for (uint32_t i = 0; i < in->k; i++) {
        bool accepted = false;
        st = verify_one(in, i, ws, &tmp[i], &accepted, err);
        if (st != DI_OK)
            return st;
        if (!accepted) {
            memcpy(results, tmp, (i + 1) * sizeof(*tmp));
            *n_accepted = i;
            return DI_OK;
        }
    }
    const sampler_row *bonus = &in->target[in->k];
    sampler_dist d;
    st = process_as(bonus, ws, 0, "bonus", in->k, &d, err);
    if (st != DI_OK)
        return st;
    fill_result(&d, keyed_pick(&d, bonus, in->k, SAMPLER_CASE_FRESH), bonus->params->n_logprobs,
                &tmp[in->k]);
    memcpy(results, tmp, (in->k + 1) * sizeof(*tmp));
    *n_accepted = in->k;
    return DI_OK;
}
