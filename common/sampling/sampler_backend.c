/* sampler_backend.c: host side of the backend's sampler (sampler_backend.h). */
#include "common/sampling/sampler_backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/sampling/sampler_internal.h"

static void clear_bit(uint32_t *map, int32_t t)
{
    map[(uint32_t)t >> 5] &= ~(1u << ((uint32_t)t & 31));
}

di_status sampler_kern_row(const sampler_row *row, uint32_t *allowed, kern_sample_row *out,
                           di_error *err)
{
    if (!row || !row->params || !out)
        return di_fail(err, DI_EINVAL, "sampler_kern_row: row, params and output are required");
    di_status st = sampling_params_validate(row->params, row->n_vocab, err);
    if (st != DI_OK)
        return st;
    const sampling_params *p = row->params;
    bool eos_ban = p->eos_id >= 0 && row->output_index < p->first_n_no_eos;
    memset(out, 0, sizeof(*out));
    out->temperature = sampling_params_temperature(p);
    out->top_p = p->top_p;
    out->top_k = p->top_k;
    out->force_top_k = p->force_top_k;
    out->n_logprobs = p->n_logprobs;
    out->seed = sampler_row_seed(row);
    out->stream = sampler_stream(row->position, row->row, SAMPLER_CASE_FRESH);
    if (!row->grammar_mask && p->n_blacklist == 0 && !eos_ban)
        return DI_OK;
    if (!allowed)
        return di_fail(err, DI_EINVAL, "sampler_kern_row: the row blocks tokens and needs a "
                                       "bitmap");
    size_t words = ((size_t)row->n_vocab + 31) / 32;
    if (row->grammar_mask)
        memcpy(allowed, row->grammar_mask, words * sizeof(uint32_t));
    else
        memset(allowed, 0xff, words * sizeof(uint32_t));
    if (row->n_vocab % 32)
        allowed[words - 1] &= (1u << (row->n_vocab % 32)) - 1;
    for (uint32_t i = 0; i < p->n_blacklist; i++)
        clear_bit(allowed, p->blacklist[i]);
    if (eos_ban)
        clear_bit(allowed, p->eos_id);
    out->allowed = allowed;
    return DI_OK;
}

static void fail_result(sampler_result *r)
{
    r->token = -1;
    r->logprob = -INFINITY;
    r->n_top = 0;
}

/* A row the kernel refused: its logits on the host through the host sampler, for the same
 * status and message. */
static void host_row(const kern_backend *be, const float *logits, const sampler_row *row,
                     sampler_workspace *ws, sampler_result *r)
{
    float *x = malloc((size_t)row->n_vocab * sizeof(float));
    if (!x) {
        di_fail(&r->err, DI_ENOMEM, "out of memory for a row of %u logits", row->n_vocab);
        fail_result(r);
        return;
    }
    be->ops.to_host(be->ctx, x, logits, (size_t)row->n_vocab * sizeof(float));
    sampler_row h = *row;
    h.logits = x;
    if (sampler_sample(&h, ws, r, &r->err) != DI_OK)
        fail_result(r);
    free(x);
}

/* The kernel rows of n sampler rows, and the launch of the backend's entry: into out (host)
 * or, with out_dev, into backend memory without waiting. */
static di_status launch(const kern_backend *be, const float *logits, size_t stride,
                        const sampler_row *rows, size_t n, uint32_t ws_capacity,
                        kern_sample_out *out, kern_sample_out *out_dev, di_error *err)
{
    if (!be || !be->ops.sample)
        return di_fail(err, DI_EUNSUPPORTED, "backend %s cannot sample on its own memory",
                       be && be->name ? be->name : "(none)");
    if (!logits || !rows || (!out && !out_dev))
        return di_fail(err, DI_EINVAL, "sampler on the backend: logits, rows, results and "
                                       "workspace are required");
    uint32_t V = rows[0].n_vocab;
    if (V == 0 || V > ws_capacity || stride < V || n > UINT32_MAX)
        return di_fail(err, DI_EINVAL, "sampler on the backend: %zu rows of %u tokens, stride "
                                       "%zu, workspace %u", n, V, stride, ws_capacity);
    size_t words = ((size_t)V + 31) / 32;
    size_t maps = 0;
    for (size_t i = 0; i < n; i++) {
        const sampler_row *r = &rows[i];
        if (r->n_vocab != V || !r->params)
            return di_fail(err, DI_EINVAL, "sampler on the backend: row %zu has %u tokens, "
                                           "row 0 %u (or no params)", i, r->n_vocab, V);
        maps += r->grammar_mask || r->params->n_blacklist ||
                (r->params->eos_id >= 0 && r->output_index < r->params->first_n_no_eos);
    }
    uint8_t *mem = malloc(n * sizeof(kern_sample_row) + maps * words * sizeof(uint32_t));
    if (!mem)
        return di_fail(err, DI_ENOMEM, "out of memory for %zu sampler rows", n);
    kern_sample_row *kr = (kern_sample_row *)mem;
    uint32_t *map = (uint32_t *)(kr + n);
    di_status st = DI_OK;
    for (size_t i = 0; i < n && st == DI_OK; i++) {
        st = sampler_kern_row(&rows[i], map, &kr[i], err);
        if (st != DI_OK)
            di_error_prefix(err, "sampler row %zu: ", i);
        else if (kr[i].allowed)
            map += words;
    }
    if (st == DI_OK) {
        kern_sample ks = {.n_rows = (uint32_t)n, .n_vocab = V, .logits = logits,
                          .logits_stride = stride, .rows = kr, .out = out, .out_dev = out_dev};
        st = be->ops.sample(be->ctx, &ks);
        if (st != DI_OK)
            di_fail(err, st, "sampler on the backend %s failed", be->name ? be->name : "");
    }
    free(mem);
    return st;
}

/* A row's outcome as the result (OK only). */
static void ok_result(const kern_sample_out *o, sampler_result *r)
{
    di_error_clear(&r->err);
    r->token = o->token;
    r->logprob = o->logprob;
    r->n_top = o->n_top;
    for (uint32_t j = 0; j < o->n_top; j++) {
        r->top_tokens[j] = o->top_tokens[j];
        r->top_logprobs[j] = o->top_logprobs[j];
    }
}

di_status sampler_sample_backend(const kern_backend *be, const float *logits, size_t stride,
                                 const sampler_row *rows, size_t n, sampler_workspace *ws,
                                 sampler_result *results, size_t *n_failed, di_error *err)
{
    if (be && be->ops.sample && n == 0)
        return n_failed ? (*n_failed = 0, DI_OK) : DI_OK;
    if (be && be->ops.sample && (!results || !ws))
        return di_fail(err, DI_EINVAL, "sampler on the backend: logits, rows, results and "
                                       "workspace are required");
    kern_sample_out *out = n ? malloc(n * sizeof(*out)) : NULL;
    if (n && !out)
        return di_fail(err, DI_ENOMEM, "out of memory for %zu sampler rows", n);
    di_status st = launch(be, logits, stride, rows, n, ws ? ws->capacity : 0, out, NULL, err);
    size_t failed = 0;
    for (size_t i = 0; i < n && st == DI_OK; i++) {
        sampler_result *r = &results[i];
        if (out[i].status != KERN_SAMPLE_OK) {
            host_row(be, logits + i * stride, &rows[i], ws, r);
            failed += r->err.code != DI_OK;
            continue;
        }
        ok_result(&out[i], r);
    }
    free(out);
    if (st == DI_OK && n_failed)
        *n_failed = failed;
    return st;
}

di_status sampler_launch_backend(const kern_backend *be, const float *logits, size_t stride,
                                 const sampler_row *rows, size_t n, uint32_t ws_capacity,
                                 kern_sample_out *out_dev, di_error *err)
{
    if (n == 0)
        return DI_OK;
    if (!out_dev)
        return di_fail(err, DI_EINVAL, "sampler on the backend: no output array");
    return launch(be, logits, stride, rows, n, ws_capacity, NULL, out_dev, err);
}

void sampler_backend_result(const kern_sample_out *o, sampler_result *r)
{
    if (o->status == KERN_SAMPLE_OK) {
        ok_result(o, r);
        return;
    }
    di_fail(&r->err, DI_ERANGE, "%s", o->status == KERN_SAMPLE_BAD_LOGIT
                                           ? "a logit is NaN or +inf: logits must be finite or "
                                             "-inf (found by the backend's sampler)"
                                           : "no token may be drawn: every token is blocked "
                                             "(found by the backend's sampler)");
    fail_result(r);
}

static int row_has_bad(const float *x, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (isnan(x[i]) || x[i] == INFINITY)
            return 1;
    return 0;
}

di_status sampler_host_sample(void *ctx, const kern_sample *p)
{
    sampler_workspace *ws = ctx;
    kern_sample_out *outs = p ? (p->out_dev ? p->out_dev : p->out) : NULL; /* host memory */
    if (!ws || !p || (p->n_rows && (!p->logits || !p->rows || !outs)) ||
        p->n_vocab == 0 || p->n_vocab > ws->capacity || p->logits_stride < p->n_vocab)
        return DI_EINVAL;
    for (uint32_t i = 0; i < p->n_rows; i++) {
        const kern_sample_row *k = &p->rows[i];
        kern_sample_out *o = &outs[i];
        if (k->n_logprobs > KERN_SAMPLE_MAX_TOP)
            return DI_EINVAL;
        sampling_params sp = sampling_params_default();
        sp.temperature = k->temperature;
        sp.top_p = k->top_p;
        sp.top_k = k->top_k > 0 ? k->top_k : -1;
        sp.force_top_k = k->force_top_k;
        sp.n_logprobs = k->n_logprobs;
        sampler_row r = {.logits = p->logits + (size_t)i * p->logits_stride,
                         .n_vocab = p->n_vocab, .params = &sp, .grammar_mask = k->allowed};
        sampler_dist d;
        di_error e;
        di_status st = sampler_process(&r, ws, 0, &d, &e);
        memset(o, 0, sizeof(*o));
        if (st == DI_ERANGE) {
            o->status = row_has_bad(r.logits, r.n_vocab) ? KERN_SAMPLE_BAD_LOGIT
                                                         : KERN_SAMPLE_ALL_BLOCKED;
            continue;
        }
        if (st != DI_OK)
            return st;
        uint32_t at = sampler_pick_index(d.mass, d.n, d.total, sampler_uniform(k->seed, k->stream));
        double log_total = log((double)d.total);
        o->status = KERN_SAMPLE_OK;
        o->token = d.ids[at];
        o->logprob = (float)(log((double)d.mass[at]) - log_total);
        o->n_top = k->n_logprobs < d.n ? k->n_logprobs : d.n;
        o->total = d.total;
        o->n_kept = d.n;
        for (uint32_t j = 0; j < o->n_top; j++) {
            o->top_tokens[j] = d.ids[j];
            o->top_logprobs[j] = (float)(log((double)d.mass[j]) - log_total);
        }
    }
    return DI_OK;
}
