#include "common/model/runner_exec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/sampling/sampler_backend.h"
#include "common/util/clock.h"
#include "common/util/machine.h"
#include "kernels/cpu/step_ahead.h"
#include "common/model/runner_exec_internal.h"

size_t rx_ahead_view(uint8_t *base, uint32_t E, uint32_t T, kern_step_ahead *v)
{
    size_t o = 0;
#define AH_ARRAY(field, type, count)                                                         \
    do {                                                                                     \
        v->field = (type *)(base ? base + o : NULL);                                         \
        o += ((size_t)(count) * sizeof(type) + 63) & ~(size_t)63;                            \
    } while (0)
    AH_ARRAY(base_len, int64_t, E);
    AH_ARRAY(accepted, int32_t, E);
    AH_ARRAY(tokens, int32_t, (size_t)E * RX_AH_STRIDE);
    AH_ARRAY(drafts, int32_t, (size_t)E * SEQ_MAX_NEXTN);
    AH_ARRAY(row0, uint32_t, E);
    AH_ARRAY(seqlen_k, int64_t, E);
    AH_ARRAY(ids, int32_t, T);
    AH_ARRAY(positions, int64_t, T);
    AH_ARRAY(live, uint8_t, T);
#undef AH_ARRAY
    return o;
}


const runner_exec_stats *runner_exec_get_stats(const runner_exec *ex)
{
    return &ex->stats;
}

const fwd_model *runner_exec_model(const runner_exec *ex)
{
    return ex->m;
}

fwd_kv *runner_exec_kv(const runner_exec *ex)
{
    return ex->kv;
}

rx_req *rx_find(const runner_exec *ex, uint64_t id)
{
    for (uint32_t i = 0; i < ex->n_reqs; i++)
        if (ex->reqs[i]->id == id)
            return ex->reqs[i];
    return NULL;
}

static di_status state_import(runner_exec *ex, rx_req *r, const uint8_t *src, size_t bytes,
                              di_error *err);

static void req_free(rx_req *r)
{
    if (!r)
        return;
    free(r->toks);
    free(r->forced);
    free(r->draft_logits);
    free(r);
}

di_status runner_exec_create(const runner_model *rm, const kern_backend *be,
                             const runner_exec_options *opt, runner_exec **out, di_error *err)
{
    if (!rm || !rm->w || !be || !opt || !out)
        return di_fail(err, DI_EINVAL, "executor: model, backend, options and output required");
    runner_exec *ex = calloc(1, sizeof(*ex));
    if (!ex)
        return di_fail(err, DI_ENOMEM, "executor");
    ex->rm = rm;
    ex->be = be;
    ex->opt = *opt;
    ex->opt.fwd.token_map = rm->token_map;
    ex->opt.fwd.token_map_pad = rm->token_map_pad;
    const model_config *c = &rm->w->config;
    ex->V = c->vocab_size;
    ex->nextn = c->n_mtp ? opt->fwd.nextn : 0;
    ex->max_entries = opt->fwd.max_rows;
    size_t E = ex->max_entries, T = opt->fwd.max_rows, nx = ex->nextn ? ex->nextn : 1;
    /* The host logits of a full step must fit this machine before any of it is allocated (the
     * draft rows' buffer is an upper bound a step touches only in part); the forward checks its
     * own scratch. */
    char what[64];
    snprintf(what, sizeof(what), "logits of steps of %zu rows:", T);
    di_status st = di_machine_check_memory(what, (uint64_t)T * ex->V * 4, err);
    if (st == DI_OK)
        st = fwd_model_create(rm->w, be, &ex->opt.fwd, &ex->m, err);
    if (st == DI_OK)
        st = fwd_run_create(ex->m, &ex->run, err);
    if (st == DI_OK)
        st = fwd_kv_create(fwd_model_geometry(ex->m), be, opt->n_blocks, opt->n_slots, &ex->kv,
                           err);
    if (st == DI_OK)
        st = sampler_workspace_new(ex->V, &ex->ws, err);
    if (st == DI_OK && opt->ahead) {
        kern_step_ahead v;
        ex->ah_bytes = rx_ahead_view(NULL, (uint32_t)E, (uint32_t)T, &v);
        if (!be->ops.step_ahead)
            st = di_fail(err, DI_EUNSUPPORTED, "executor: one step ahead needs the %s "
                         "backend's step_ahead entry", be->name ? be->name : "");
        else if (!(ex->ah_dev = be->ops.alloc(be->ctx, ex->ah_bytes)) ||
                 !(ex->ah_host = calloc(1, ex->ah_bytes)) ||
                 !(ex->ah_rows = calloc(T, sizeof(int32_t))))
            st = di_fail(err, DI_ENOMEM, "executor: step_ahead arrays of %zu bytes",
                         ex->ah_bytes);
    }
    if (st == DI_OK) {
        ex->fseqs = calloc(E, sizeof(fwd_seq));
        ex->lrows = calloc(T, sizeof(int32_t));
        ex->lbase = calloc(E, sizeof(int32_t));
        ex->logits = malloc(T * ex->V * sizeof(float));
        ex->dlogits = malloc(E * nx * ex->V * sizeof(float));
        ex->dtok = malloc(E * nx * sizeof(int32_t));
        ex->dconf = malloc(E * nx * sizeof(float));
        ex->dcum = malloc(E * nx * sizeof(float));
        ex->dreq = malloc(E * sizeof(fwd_draft_req));
        ex->dentry = malloc(E * sizeof(uint32_t));
        ex->drec = malloc(E * sizeof(rx_req *));
        if (!ex->fseqs || !ex->lrows || !ex->lbase || !ex->logits || !ex->dlogits ||
            !ex->dtok || !ex->dconf || !ex->dcum || !ex->dreq || !ex->dentry || !ex->drec)
            st = di_fail(err, DI_ENOMEM, "executor scratch for %zu rows", T);
    }
    if (st == DI_OK && opt->overlap && !opt->ahead)
        st = di_fail(err, DI_EINVAL, "executor: the overlap needs one step ahead (ahead)");
    if (st == DI_OK)
        st = rx_flights_create(ex, err);
    if (st != DI_OK) {
        runner_exec_free(ex);
        return st;
    }
    *out = ex;
    return DI_OK;
}

void runner_exec_free(runner_exec *ex)
{
    if (!ex)
        return;
    for (uint32_t i = 0; i < ex->n_reqs; i++)
        req_free(ex->reqs[i]);
    free(ex->reqs);
    sampler_workspace_free(ex->ws);
    rx_flights_free(ex);
    if (ex->ah_dev)
        ex->be->ops.free(ex->be->ctx, ex->ah_dev);
    free(ex->ah_host);
    free(ex->ah_rows);
    fwd_kv_free(ex->kv);
    fwd_run_free(ex->run);
    fwd_model_free(ex->m);
    free(ex->fseqs);
    free(ex->lrows);
    free(ex->lbase);
    free(ex->logits);
    free(ex->dlogits);
    free(ex->dtok);
    free(ex->dconf);
    free(ex->dcum);
    free(ex->dreq);
    free(ex->dentry);
    free(ex->drec);
    free(ex);
}

di_status runner_exec_add(runner_exec *ex, const runner_request *q, di_error *err)
{
    if (!ex || !q || !q->prompt || q->prompt_len == 0)
        return di_fail(err, DI_EINVAL, "request: empty prompt");
    if (rx_find(ex, q->id))
        return di_fail(err, DI_EEXIST, "request %llu already registered",
                       (unsigned long long)q->id);
    di_status st = sampling_params_validate(&q->params, ex->V, err);
    if (st != DI_OK)
        return st;
    for (uint32_t i = 0; i < q->prompt_len; i++)
        if (q->prompt[i] < 0 || (uint32_t)q->prompt[i] >= ex->V)
            return di_fail(err, DI_EINVAL, "prompt token %d at position %u outside the "
                           "vocabulary [0, %u)", q->prompt[i], i, ex->V);
    for (uint32_t i = 0; i < q->n_forced; i++)
        if (q->forced[i] < 0 || (uint32_t)q->forced[i] >= ex->V)
            return di_fail(err, DI_EINVAL, "teacher-forced token %d outside the vocabulary "
                           "[0, %u)", q->forced[i], ex->V);
    if (ex->n_reqs == ex->cap_reqs) {
        uint32_t cap = ex->cap_reqs ? 2 * ex->cap_reqs : 16;
        rx_req **n = realloc(ex->reqs, cap * sizeof(*n));
        if (!n)
            return di_fail(err, DI_ENOMEM, "request table");
        ex->reqs = n;
        ex->cap_reqs = cap;
    }
    rx_req *r = calloc(1, sizeof(*r));
    if (!r)
        return di_fail(err, DI_ENOMEM, "request");
    r->id = q->id;
    r->prompt_len = q->prompt_len;
    r->params = q->params;
    r->cap = q->prompt_len + q->max_tokens + RX_MAX_ROWS + 1;
    r->toks = calloc(r->cap, sizeof(int32_t));
    if (q->n_forced) {
        r->forced = malloc(q->n_forced * sizeof(int32_t));
        if (r->forced)
            memcpy(r->forced, q->forced, q->n_forced * sizeof(int32_t));
        r->n_forced = q->n_forced;
    }
    if (ex->nextn)
        r->draft_logits = malloc((size_t)ex->nextn * ex->V * sizeof(float));
    if (!r->toks || (q->n_forced && !r->forced) || (ex->nextn && !r->draft_logits)) {
        req_free(r);
        return di_fail(err, DI_ENOMEM, "request %llu", (unsigned long long)q->id);
    }
    memcpy(r->toks, q->prompt, q->prompt_len * sizeof(int32_t));
    if (q->state) {
        di_status st = state_import(ex, r, q->state, q->state_bytes, err);
        if (st != DI_OK) {
            req_free(r);
            return st;
        }
    }
    ex->reqs[ex->n_reqs++] = r;
    return DI_OK;
}

/* ---- executor state of a handoff ---------------------------------------------------------
 * u32 magic, u32 vocabulary, u32 tokens produced, u32 drafts k, i32 drafts[k],
 * f32 draft logits[k, vocabulary]; little-endian (the hosts this runs on). */

#define RX_STATE_MAGIC 0x53584944u /* "DIXS" */

size_t runner_exec_state_bytes(const runner_exec *ex)
{
    return 16 + (size_t)ex->nextn * sizeof(int32_t) + (size_t)ex->nextn * ex->V * sizeof(float);
}

di_status runner_exec_export_state(const runner_exec *ex, uint64_t id, void *dst, size_t cap,
                                   size_t *n, di_error *err)
{
    const rx_req *r = ex ? rx_find(ex, id) : NULL;
    if (!r)
        return di_fail(err, DI_ENOENT, "executor state: request %llu is not registered",
                       (unsigned long long)id);
    size_t k = r->n_drafts, bytes = 16 + k * sizeof(int32_t) + k * ex->V * sizeof(float);
    if (!dst || cap < bytes)
        return di_fail(err, DI_EINVAL, "executor state: buffer of %zu bytes, %zu needed", cap,
                       bytes);
    uint32_t h[4] = {RX_STATE_MAGIC, ex->V, r->n_out, r->n_drafts};
    uint8_t *o = dst;
    memcpy(o, h, sizeof h);
    memcpy(o + 16, r->drafts, k * sizeof(int32_t));
    if (k)
        memcpy(o + 16 + k * sizeof(int32_t), r->draft_logits, k * ex->V * sizeof(float));
    *n = bytes;
    return DI_OK;
}

static di_status state_import(runner_exec *ex, rx_req *r, const uint8_t *src, size_t bytes,
                              di_error *err)
{
    uint32_t h[4];
    if (bytes < sizeof h)
        return di_fail(err, DI_EINVAL, "executor state: %zu bytes, too short", bytes);
    memcpy(h, src, sizeof h);
    size_t k = h[3], want = 16 + k * sizeof(int32_t) + k * (size_t)ex->V * sizeof(float);
    if (h[0] != RX_STATE_MAGIC || h[1] != ex->V)
        return di_fail(err, DI_EINVAL, "executor state: not one of this model (magic %08x, "
                       "vocabulary %u, want %u)", h[0], h[1], ex->V);
    if (k > ex->nextn || bytes != want)
        return di_fail(err, DI_EINVAL, "executor state: %zu drafts in %zu bytes (nextn %u, "
                       "%zu bytes expected)", k, bytes, ex->nextn, want);
    if (h[2] > r->cap - r->prompt_len)
        return di_fail(err, DI_EINVAL, "executor state: %u tokens produced, beyond max_tokens",
                       h[2]);
    r->n_out = h[2];
    r->n_drafts = (uint32_t)k;
    memcpy(r->drafts, src + 16, k * sizeof(int32_t));
    for (size_t i = 0; i < k; i++)
        if (r->drafts[i] < 0 || (uint32_t)r->drafts[i] >= ex->V)
            return di_fail(err, DI_EINVAL, "executor state: draft %zu is %d, outside the "
                           "vocabulary", i, r->drafts[i]);
    if (k)
        memcpy(r->draft_logits, src + 16 + k * sizeof(int32_t), k * ex->V * sizeof(float));
    return DI_OK;
}

const int32_t *runner_exec_drafts(const runner_exec *ex, uint64_t id, uint32_t *n)
{
    const rx_req *r = ex ? rx_find(ex, id) : NULL;
    *n = r ? r->n_drafts : 0;
    return r ? r->drafts : NULL;
}

void runner_exec_remove(runner_exec *ex, uint64_t id)
{
    for (uint32_t i = 0; ex && i < ex->n_reqs; i++)
        if (ex->reqs[i]->id == id) {
            req_free(ex->reqs[i]);
            ex->reqs[i] = ex->reqs[--ex->n_reqs];
            return;
        }
}

const runner_token *runner_exec_tokens(const runner_exec *ex, uint64_t id, uint32_t *n)
{
    rx_req *r = rx_find(ex, id);
    *n = r ? r->n_last : 0;
    return r ? r->last : NULL;
}

const char *runner_exec_error(const runner_exec *ex, uint64_t id)
{
    rx_req *r = rx_find(ex, id);
    return r ? r->err : "";
}

/* ---- one step --------------------------------------------------------------------------- */

/* The plan's fork copies, block to block and slot to slot, as backend copies (the KV storage
 * is backend memory: a device backend keeps it on the device). */
di_status rx_do_copies(runner_exec *ex, const sched_plan *plan, di_error *err)
{
    const kern_backend *be = ex->be;
    for (uint32_t i = 0; i < plan->n_copies; i++) {
        const sched_copy *c = &plan->copies[i];
        int block = c->kind == SCHED_COPY_BLOCK;
        kern_copy_rows cp = {.n_rows = 1,
                             .row_bytes = block ? ex->kv->block_bytes : ex->kv->slot_bytes,
                             .src = block ? fwd_kv_block(ex->kv, c->src)
                                          : fwd_kv_slot(ex->kv, c->src),
                             .dst = block ? fwd_kv_block(ex->kv, c->dst)
                                          : fwd_kv_slot(ex->kv, c->dst)};
        cp.src_stride = cp.dst_stride = cp.row_bytes;
        di_status st = be->ops.copy_rows(be->ctx, &cp);
        if (st != DI_OK)
            return di_fail(err, st, "plan copy %u (%s %u to %u) failed", i,
                           block ? "block" : "slot", c->src, c->dst);
    }
    return DI_OK;
}

/* Builds the forward's step from the plan; records each entry's tokens by position. */
di_status rx_build_step(runner_exec *ex, const sched_plan *plan, fwd_step *st, di_error *err)
{
    const model_config *c = fwd_model_config(ex->m);
    uint32_t lb = c->n_engram_layers ? c->engram_max_ngram_size - 1 : 0;
    uint32_t n = 0, rows = 0, nl = 0;
    if (plan->n_seqs > ex->max_entries)
        return di_fail(err, DI_EINVAL, "plan of %u sequences exceeds %u", plan->n_seqs,
                       ex->max_entries);
    for (uint32_t i = 0; i < plan->n_seqs; i++) {
        const sched_seq_plan *p = &plan->seqs[i];
        ex->lbase[i] = -1;
        rx_req *r = p->request_id == SCHED_PLACEHOLDER_ID ? NULL : rx_find(ex, p->request_id);
        if (!r)
            return di_fail(err, DI_EINVAL, "plan entry %u: request %llu is not registered", i,
                           (unsigned long long)p->request_id);
        if ((p->n_load || p->load_window) && !ex->opt.on_load)
            return di_fail(err, DI_EUNSUPPORTED, "plan entry %u: loading KV from the store "
                           "needs a loader (runner_exec_options.on_load)", i);
        if ((uint64_t)p->first_position + p->seqlen_q > r->cap)
            return di_fail(err, DI_EINVAL, "plan entry %u: positions beyond the request's "
                           "max_tokens", i);
        memcpy(r->toks + p->first_position, p->tokens, p->seqlen_q * sizeof(int32_t));
        uint32_t h = p->first_position < lb ? p->first_position : lb;
        fwd_seq *f = &ex->fseqs[n++];
        *f = (fwd_seq){.n_rows = p->seqlen_q, .pos0 = p->first_position, .tokens = p->tokens,
                       .history = r->toks + p->first_position - h, .n_history = h,
                       .blocks = p->block_table, .n_blocks = p->n_blocks,
                       .slot = (uint32_t)p->state_slot,
                       .prompt_len = plan->prompt_run ? r->prompt_len + r->n_out : 0,
                       .window_start = p->window_start};
        if (p->sample) {
            ex->lbase[i] = (int32_t)nl;
            uint32_t first = plan->prompt_run ? p->seqlen_q - 1 : 0;
            for (uint32_t k = first; k < p->seqlen_q; k++)
                ex->lrows[nl++] = (int32_t)(rows + k);
        }
        rows += p->seqlen_q;
    }
    /* a decode step runs on its recorded graph size: the difference is placeholder rows */
    int pad = ex->opt.pad_steps > 0 || (ex->opt.pad_steps == 0 && ex->be->graphs);
    if (pad && !plan->prompt_run && plan->padding_rows &&
        (uint64_t)rows + plan->padding_rows <= ex->opt.fwd.max_rows)
        ex->fseqs[n++] = (fwd_seq){.n_rows = plan->padding_rows, .placeholder = 1};
    *st = (fwd_step){.n_seqs = n, .seqs = ex->fseqs, .n_logit_rows = nl, .logit_rows = ex->lrows};
    return DI_OK;
}

sampler_row rx_target_row(const runner_exec *ex, const rx_req *r, const float *logits,
                              uint64_t position, uint32_t row, uint32_t out_index)
{
    sampler_row s = {.logits = logits, .n_vocab = ex->V, .params = &r->params,
                     .output_index = out_index, .position = position, .row = row};
    return s;
}

/* The forced token's logprob under the processed distribution (sampling is skipped). */
static void forced_token(runner_exec *ex, rx_req *r, const sampler_row *row, int32_t tok,
                         runner_token *out)
{
    memset(out, 0, sizeof(*out));
    out->token = tok;
    out->res.token = tok;
    sampler_dist d;
    out->res.logprob = sampler_process(row, ex->ws, 0, &d, NULL) == DI_OK
                           ? (float)sampler_dist_logprob(&d, tok) : 0.0f;
}

/* Produced tokens of one sampled entry into r->last and the result. */
static di_status sample_entry(runner_exec *ex, const sched_plan *plan, uint32_t i, rx_req *r,
                              sched_seq_result *res, di_error *err)
{
    const sched_seq_plan *p = &plan->seqs[i];
    const float *lg = ex->logits + (size_t)ex->lbase[i] * ex->V;
    r->n_last = 0;
    if (plan->prompt_run) {
        sampler_row row = rx_target_row(ex, r, lg, sampler_prefill_position(p->seqlen_k), 0,
                                     r->n_out);
        if (r->n_out < r->n_forced) {
            forced_token(ex, r, &row, r->forced[r->n_out], &r->last[0]);
        } else {
            di_status st = sampler_sample(&row, ex->ws, &r->last[0].res, err);
            if (st != DI_OK)
                return st;
            r->last[0].token = r->last[0].res.token;
        }
        r->n_last = 1;
    } else {
        uint32_t k = p->seqlen_q - 1;
        const int32_t *drafts = p->tokens + 1;
        uint64_t P = sampler_decode_position(p->seqlen_k, p->seqlen_q);
        sampler_row rows[RX_MAX_ROWS];
        for (uint32_t j = 0; j <= k; j++)
            rows[j] = rx_target_row(ex, r, lg + (size_t)j * ex->V, P, j, r->n_out + j);
        if (r->n_out < r->n_forced) {
            /* accept drafts while they are the forced continuation */
            uint32_t a = 0;
            while (a < k && r->n_out + a + 1 < r->n_forced && drafts[a] == r->forced[r->n_out + a])
                a++;
            for (uint32_t j = 0; j < a; j++)
                forced_token(ex, r, &rows[j], drafts[j], &r->last[j]);
            if (r->n_out + a < r->n_forced) {
                forced_token(ex, r, &rows[a], r->forced[r->n_out + a], &r->last[a]);
            } else { /* the forced list ends here: sample this row fresh */
                di_status st = sampler_sample(&rows[a], ex->ws, &r->last[a].res, err);
                if (st != DI_OK)
                    return st;
                r->last[a].token = r->last[a].res.token;
            }
            r->n_last = a + 1;
        } else {
            /* verify the drafts the draft head produced (pad rows are not drafts) */
            uint32_t kk = k;
            if (r->n_drafts < k || memcmp(r->drafts, drafts, k * sizeof(int32_t)) != 0)
                kk = 0;
            sampler_row drows[SEQ_MAX_NEXTN];
            for (uint32_t j = 0; j < kk; j++)
                drows[j] = (sampler_row){.logits = r->draft_logits + (size_t)j * ex->V,
                                         .n_vocab = ex->V, .params = &r->params,
                                         .output_index = r->n_out + 1 + j, .position = P + 1,
                                         .row = j, .draft = true};
            sampler_result out[RX_MAX_ROWS];
            uint32_t a = 0;
            sampler_verify_in vin = {.target = rows, .draft = kk ? drows : NULL,
                                     .draft_tokens = drafts, .k = kk};
            if (kk == 0) {
                di_status st = sampler_sample(&rows[0], ex->ws, &out[0], err);
                if (st != DI_OK)
                    return st;
            } else {
                di_status st = sampler_verify(&vin, ex->ws, out, &a, err);
                if (st != DI_OK)
                    return st;
            }
            for (uint32_t j = 0; j <= a; j++) {
                r->last[j].res = out[j];
                r->last[j].token = out[j].token;
            }
            r->n_last = a + 1;
        }
    }
    res->status = SCHED_RESULT_OK;
    res->n_tokens = r->n_last;
    for (uint32_t j = 0; j < r->n_last; j++) {
        res->tokens[j] = r->last[j].token;
        if (ex->opt.on_logits)
            ex->opt.on_logits(ex->opt.logits_userdata, r->id,
                              (int64_t)p->first_position + (plan->prompt_run ? p->seqlen_q - 1 : j),
                              lg + (size_t)j * ex->V, ex->V);
    }
    r->n_out += r->n_last;
    return DI_OK;
}

/* The draft head's sampler: the request's parameters with the draft stream; the first draft
 * token sits at P + 2 and draft i is row i (sampler.h). */
typedef struct draft_ctx {
    runner_exec *ex;
    uint32_t q0;                /* draft request index of the call's request 0 */
} draft_ctx;

static di_status draft_sample(void *ud, uint32_t q, uint32_t i, const float *logits,
                              uint32_t vocab, int32_t *tok)
{
    draft_ctx *d = ud;
    runner_exec *ex = d->ex;
    const rx_req *r = ex->drec[d->q0 + q];
    sampler_row row = {.logits = logits, .n_vocab = vocab, .params = &r->params,
                       .output_index = r->n_out + i,
                       .position = (uint64_t)ex->dreq[d->q0 + q].pos + 2, .row = i,
                       .draft = true};
    sampler_result res;
    di_error e;
    di_status st = sampler_sample(&row, ex->ws, &res, &e);
    if (st != DI_OK)
        return st;
    *tok = res.token;
    return DI_OK;
}

/* New drafts for every entry that produced tokens: the draft stages from the last accepted
 * position; results get the drafts, the requests keep the draft logits for the verifier. */
static di_status propose(runner_exec *ex, const sched_plan *plan, sched_seq_result *results,
                         di_error *err)
{
    uint32_t n = 0, V = ex->V, nx = ex->nextn;
    for (uint32_t i = 0; i < plan->n_seqs; i++) {
        const sched_seq_plan *p = &plan->seqs[i];
        if (ex->lbase[i] < 0 || results[i].status != SCHED_RESULT_OK)
            continue;
        rx_req *r = rx_find(ex, p->request_id);
        uint32_t a = plan->prompt_run ? p->seqlen_q - 1 : results[i].n_tokens - 1;
        ex->dreq[n] = (fwd_draft_req){.slot = (uint32_t)p->state_slot,
                                      .pos = (int64_t)p->first_position + a,
                                      .next = results[i].tokens[results[i].n_tokens - 1]};
        ex->dentry[n] = i;
        ex->drec[n] = r;
        n++;
    }
    if (n == 0)
        return DI_OK;
    const model_config *c = fwd_model_config(ex->m);
    uint32_t per_call = ex->opt.fwd.max_rows / c->dspark_block_size;
    for (uint32_t q0 = 0; q0 < n; q0 += per_call) {
        uint32_t m = n - q0 < per_call ? n - q0 : per_call;
        fwd_draft_out out = {.tokens = ex->dtok + (size_t)q0 * nx,
                             .logits = ex->dlogits + (size_t)q0 * nx * V,
                             .confidence = ex->dconf + (size_t)q0 * nx,
                             .cumulative = ex->dcum + (size_t)q0 * nx};
        draft_ctx dc = {ex, q0};
        di_status st = fwd_draft(ex->run, ex->kv, m, ex->dreq + q0, nx, draft_sample, &dc, &out,
                                 err);
        if (st != DI_OK)
            return st;
    }
    for (uint32_t q = 0; q < n; q++) {
        rx_req *r = ex->drec[q];
        sched_seq_result *res = &results[ex->dentry[q]];
        memcpy(r->drafts, ex->dtok + (size_t)q * nx, nx * sizeof(int32_t));
        memcpy(r->draft_logits, ex->dlogits + (size_t)q * nx * V, (size_t)nx * V * sizeof(float));
        r->n_drafts = nx;
        res->n_drafts = nx;
        memcpy(res->drafts, r->drafts, nx * sizeof(int32_t));
        /* the confidence head's cumulative chances, for the scheduler's varlen */
        res->n_conf = nx;
        memcpy(res->draft_conf, ex->dcum + (size_t)q * nx, nx * sizeof(float));
    }
    return DI_OK;
}

void rx_take_draw(rx_req *r, const sampler_result *o, sched_seq_result *res)
{
    if (o->err.code != DI_OK) {
        res->status = SCHED_RESULT_FAILED;
        r->n_last = 0;
        snprintf(r->err, sizeof r->err, "%s", o->err.msg);
        return;
    }
    r->last[0].res = *o;
    r->last[0].token = o->token;
    r->n_last = 1;
    res->n_tokens = 1;
    res->tokens[0] = o->token;
    r->n_out++;
}

/* Entry i's result, cleared to OK, and its request with no error yet. */
rx_req *rx_result_open(runner_exec *ex, const sched_plan *plan, uint32_t i,
                           sched_seq_result *res)
{
    memset(res, 0, sizeof(*res));
    res->status = SCHED_RESULT_OK;
    rx_req *r = rx_find(ex, plan->seqs[i].request_id);
    r->err[0] = 0;
    return r;
}

/* 1 when the step can sample on the backend: it has the entry, the caller did not ask for
 * host sampling or the logits, and every sampled entry draws one fresh row (a prompt's last
 * row, or a decode row with no drafts to verify) with no forced token. */
int rx_device_sampling(const runner_exec *ex, const sched_plan *plan)
{
    if (!ex->be->ops.sample || ex->opt.host_sampling || ex->opt.on_logits)
        return 0;
    uint32_t sampled = 0;
    for (uint32_t i = 0; i < plan->n_seqs; i++) {
        if (ex->lbase[i] < 0)
            continue;
        const sched_seq_plan *p = &plan->seqs[i];
        const rx_req *r = rx_find(ex, p->request_id);
        if ((!plan->prompt_run && p->seqlen_q != 1) || r->n_out + r->uncommitted < r->n_forced)
            return 0;
        sampled++;
    }
    return sampled > 0;
}

/* The step with its rows sampled by the backend (device_sampling): the logits never reach
 * the host. The same tokens, logprobs and per-entry failures as sample_entry's. */
static di_status step_device_sampled(runner_exec *ex, const sched_plan *plan,
                                     const fwd_step *st, sched_seq_result *results,
                                     di_error *err)
{
    const float *logits = NULL;
    di_status s = fwd_step_run_keep(ex->run, ex->kv, st, &logits, err);
    if (s != DI_OK)
        return s;
    uint32_t n = st->n_logit_rows;
    sampler_row *rows = malloc(n * sizeof(*rows));
    sampler_result *out = malloc(n * sizeof(*out));
    if (!rows || !out) {
        free(rows);
        free(out);
        return di_fail(err, DI_ENOMEM, "sampler rows of a %u-row step", n);
    }
    for (uint32_t i = 0; i < plan->n_seqs; i++) {
        if (ex->lbase[i] < 0)
            continue;
        const sched_seq_plan *p = &plan->seqs[i];
        rx_req *r = rx_find(ex, p->request_id);
        uint64_t pos = plan->prompt_run ? sampler_prefill_position(p->seqlen_k)
                                        : sampler_decode_position(p->seqlen_k, p->seqlen_q);
        rows[ex->lbase[i]] = rx_target_row(ex, r, NULL, pos, 0, r->n_out);
    }
    s = sampler_sample_backend(ex->be, logits, ex->V, rows, n, ex->ws, out, NULL, err);
    for (uint32_t i = 0; s == DI_OK && i < plan->n_seqs; i++) {
        sched_seq_result *res = &results[i];
        rx_req *r = rx_result_open(ex, plan, i, res);
        if (ex->lbase[i] < 0)
            continue;
        rx_take_draw(r, &out[ex->lbase[i]], res);
    }
    free(rows);
    free(out);
    if (s != DI_OK)
        return s;
    return ex->nextn ? propose(ex, plan, results, err) : DI_OK;
}

static di_status ahead_fix(runner_exec *ex, const sched_plan *plan, di_error *err);

di_status rx_step_prepare(runner_exec *ex, const sched_plan *plan, fwd_step *st,
                          di_error *err)
{
    di_status s = rx_do_copies(ex, plan, err);
    if (s == DI_OK)
        s = rx_build_step(ex, plan, st, err);
    if (s == DI_OK && ex->opt.ahead && !plan->prompt_run)
        s = ahead_fix(ex, plan, err);
    for (uint32_t i = 0; s == DI_OK && i < plan->n_seqs; i++)
        if (plan->seqs[i].n_load || plan->seqs[i].load_window)
            s = ex->opt.on_load(ex->opt.load_userdata, ex->kv, &plan->seqs[i], err);
    return s;
}

di_status rx_step_finish(runner_exec *ex, const sched_plan *plan, const fwd_step *st,
                         sched_seq_result *results, di_error *err)
{
    if (rx_device_sampling(ex, plan))
        return step_device_sampled(ex, plan, st, results, err);
    di_status s = fwd_step_run(ex->run, ex->kv, st, ex->logits, err);
    if (s != DI_OK)
        return s;
    for (uint32_t i = 0; i < plan->n_seqs; i++) {
        sched_seq_result *res = &results[i];
        rx_req *r = rx_result_open(ex, plan, i, res);
        if (ex->lbase[i] < 0)
            continue; /* an earlier prompt chunk: nothing to sample */
        di_error e;
        if (sample_entry(ex, plan, i, r, res, &e) != DI_OK) {
            res->status = SCHED_RESULT_FAILED;
            res->n_tokens = 0;
            r->n_last = 0;
            snprintf(r->err, sizeof r->err, "%s", e.msg);
        }
    }
    return ex->nextn ? propose(ex, plan, results, err) : DI_OK;
}

/* ---- one step ahead (runner_exec_options.ahead) -------------------------------------------
 * An entry that continues the previous step (tokens_from_prev, the request sampled there with
 * a result) gets its rows from the backend's step_ahead op over that step's outcome: the last
 * accepted token and the new drafts at the positions after the accepted ones, and its key
 * length. The op runs once per row count (its sequences share one nextn); its rows must be
 * the plan's (the scheduler's fix-up) and the step runs on the op's. */

/* 1 when entry p of the step continues the request's latest step with a usable outcome. */
static int ahead_entry(const runner_exec *ex, const sched_seq_plan *p, const rx_req *r)
{
    const sched_seq_result *o = &r->ah_res;
    return p->tokens_from_prev && r->ah_step == ex->stats.steps && r->ah_step &&
           o->status == SCHED_RESULT_OK && o->n_tokens > 0 && o->n_tokens <= r->ah_q;
}

static di_status ahead_fix(runner_exec *ex, const sched_plan *plan, di_error *err)
{
    const kern_backend *be = ex->be;
    uint32_t total = 0, fixed = 0, ks = 0; /* ks: bit k for entries of k drafts to fix */
    for (uint32_t i = 0; i < plan->n_seqs; i++) {
        const sched_seq_plan *p = &plan->seqs[i];
        total += p->seqlen_q;
        if (p->tokens_from_prev && ahead_entry(ex, p, rx_find(ex, p->request_id)))
            ks |= 1u << (p->seqlen_q - 1);
    }
    for (uint32_t k = 0; k <= SEQ_MAX_NEXTN; k++) {
        if (!(ks >> k & 1))
            continue;
        kern_step_ahead h, d;
        rx_ahead_view(ex->ah_host, ex->max_entries, ex->opt.fwd.max_rows, &h);
        /* the op's inputs, written here on the host mirror */
        int64_t *base_len = (int64_t *)h.base_len;
        int32_t *accepted = (int32_t *)h.accepted, *toks = (int32_t *)h.tokens;
        int32_t *drafts = (int32_t *)h.drafts;
        uint32_t *row0 = (uint32_t *)h.row0;
        uint32_t n = 0, row = 0;
        for (uint32_t i = 0; i < plan->n_seqs; row += plan->seqs[i].seqlen_q, i++) {
            const sched_seq_plan *p = &plan->seqs[i];
            const rx_req *r = rx_find(ex, p->request_id);
            if (p->seqlen_q != k + 1 || !ahead_entry(ex, p, r))
                continue;
            const sched_seq_result *o = &r->ah_res;
            /* the sequence's length before step N: its row 0 (at ah_base) was already
             * known, the accepted tokens follow it */
            base_len[n] = r->ah_base + 1;
            accepted[n] = (int32_t)o->n_tokens;
            memcpy(toks + (size_t)n * RX_AH_STRIDE, o->tokens,
                   o->n_tokens * sizeof(int32_t));
            /* drafts the previous step did not propose keep the plan's pad rows */
            for (uint32_t j = 0; j < k; j++)
                drafts[(size_t)n * k + j] =
                    j < o->n_drafts ? o->drafts[j] : p->tokens[1 + j];
            row0[n] = row;
            n++;
        }
        if (n == 0)
            continue;
        h.n_seqs = n;
        h.nextn = k;
        h.n_rows = total;
        h.out_stride = RX_AH_STRIDE;
        be->ops.from_host(be->ctx, ex->ah_dev, ex->ah_host, ex->ah_bytes);
        rx_ahead_view(ex->ah_dev, ex->max_entries, ex->opt.fwd.max_rows, &d);
        d.n_seqs = h.n_seqs, d.nextn = h.nextn, d.n_rows = h.n_rows, d.out_stride = h.out_stride;
        di_status st = be->ops.step_ahead(be->ctx, &d);
        if (st != DI_OK)
            return di_fail(err, st, "step ahead: the backend's fix-up of %u sequences of %u "
                           "rows failed", n, k + 1);
        be->ops.to_host(be->ctx, ex->ah_host, ex->ah_dev, ex->ah_bytes);
        n = 0;
        row = 0;
        for (uint32_t i = 0; i < plan->n_seqs; row += plan->seqs[i].seqlen_q, i++) {
            const sched_seq_plan *p = &plan->seqs[i];
            rx_req *r = rx_find(ex, p->request_id);
            if (p->seqlen_q != k + 1 || !ahead_entry(ex, p, r))
                continue;
            if (h.seqlen_k[n] != (int64_t)p->seqlen_k || h.positions[row] != p->first_position ||
                memcmp(h.ids + row, p->tokens, p->seqlen_q * sizeof(int32_t)) != 0)
                return di_fail(err, DI_EINTERNAL, "step ahead: entry %u (request %llu) got key "
                               "length %lld at position %lld, first token %d from the device, "
                               "the plan says %u at %lld, token %d", i,
                               (unsigned long long)p->request_id, (long long)h.seqlen_k[n],
                               (long long)h.positions[row], h.ids[row], p->seqlen_k,
                               (long long)p->first_position, p->tokens[0]);
            for (uint32_t j = 0; j <= k; j++)
                if (!h.live[row + j] || h.positions[row + j] != p->first_position + j)
                    return di_fail(err, DI_EINTERNAL, "step ahead: entry %u row %u not live "
                                   "at its position", i, j);
            /* the step runs on the device's rows: copied where the forward reads them */
            memcpy(r->toks + p->first_position, h.ids + row, p->seqlen_q * sizeof(int32_t));
            memcpy(ex->ah_rows + row, h.ids + row, p->seqlen_q * sizeof(int32_t));
            ex->fseqs[i].tokens = ex->ah_rows + row;
            ex->fseqs[i].pos0 = h.positions[row];
            n++;
            fixed++;
        }
    }
    if (fixed) {
        ex->stats.ahead_steps++;
        ex->stats.ahead_entries += fixed;
    }
    return DI_OK;
}

/* Keeps each sampled entry's outcome for the next step's op. */
void rx_ahead_record(runner_exec *ex, const sched_plan *plan, const sched_seq_result *res,
                     const int32_t *lbase, uint64_t number)
{
    for (uint32_t i = 0; i < plan->n_seqs; i++) {
        rx_req *r = rx_find(ex, plan->seqs[i].request_id);
        if (!r)
            continue;
        r->ah_step = number;
        r->ah_base = plan->seqs[i].first_position;
        r->ah_q = plan->seqs[i].seqlen_q;
        r->ah_res = res[i];
        if (lbase[i] < 0 || res[i].status != SCHED_RESULT_OK)
            r->ah_res.n_tokens = 0;
    }
}

/* ---- step-time measurement (MTP varlen's table) ----------------------------------------- */

di_status runner_exec_time_step(runner_exec *ex, uint32_t rows, uint32_t reps, double *ms,
                                di_error *err)
{
    if (!ex || !ms || rows == 0 || rows > ex->opt.fwd.max_rows || reps == 0)
        return di_fail(err, DI_EINVAL, "step timing: %u rows (1..%u) and %u runs (>= 1)", rows,
                       ex ? ex->opt.fwd.max_rows : 0, reps);
    uint32_t per = 1 + ex->nextn, n = (rows + per - 1) / per;
    fwd_kv *kv = NULL;
    uint32_t *blocks = malloc(n * sizeof(uint32_t));
    int32_t *toks = malloc(rows * sizeof(int32_t));
    di_status st = blocks && toks ? DI_OK : di_fail(err, DI_ENOMEM, "step timing");
    if (st == DI_OK) /* scratch KV of its own: block 0 unused, one block and slot each */
        st = fwd_kv_create(fwd_model_geometry(ex->m), ex->be, n + 1, n, &kv, err);
    if (st == DI_OK) {
        for (uint32_t i = 0; i < rows; i++) {
            toks[i] = (int32_t)(1 + i % (ex->V - 1));
            ex->lrows[i] = (int32_t)i;
        }
        for (uint32_t j = 0; j < n; j++) {
            blocks[j] = j + 1;
            uint32_t r = rows - j * per < per ? rows - j * per : per;
            ex->fseqs[j] = (fwd_seq){.n_rows = r, .pos0 = 0, .tokens = toks + j * per,
                                     .blocks = blocks + j, .n_blocks = 1, .slot = j};
        }
    }
    fwd_step step = {.n_seqs = n, .seqs = ex->fseqs, .n_logit_rows = rows,
                     .logit_rows = ex->lrows};
    double best = 0;
    for (uint32_t k = 0; st == DI_OK && k <= reps; k++) { /* run 0 warms up */
        uint64_t t0 = di_mono_ns();
        st = fwd_step_run(ex->run, kv, &step, ex->logits, err);
        double t = (double)(di_mono_ns() - t0) / 1e6;
        if (k == 1 || (k > 1 && t < best))
            best = t;
    }
    fwd_kv_free(kv);
    free(blocks);
    free(toks);
    if (st == DI_OK)
        *ms = best;
    return st;
}

static di_status exec_add(void *ctx, const sched_request *req, const void *args, di_error *err)
{
    const runner_request *rq = args;
    if (!rq || rq->id != req->id || rq->prompt_len != req->prompt_len)
        return di_fail(err, DI_EINVAL, "request %llu: the runner needs its runner_request",
                       (unsigned long long)req->id);
    return runner_exec_add(ctx, rq, err);
}

static void exec_remove(void *ctx, uint64_t id)
{
    runner_exec_remove(ctx, id);
}

static di_status exec_step(void *ctx, const sched_plan *plan, sched_seq_result *results,
                           di_error *err)
{
    return runner_exec_step(ctx, plan, results, err);
}

static di_status exec_issue(void *ctx, const sched_plan *plan, bool ahead, bool *issued,
                            di_error *err)
{
    return runner_exec_issue(ctx, plan, ahead, issued, err);
}

static di_status exec_collect(void *ctx, const sched_plan *plan, sched_seq_result *results,
                              di_error *err)
{
    return runner_exec_collect(ctx, plan, results, err);
}

engine_executor runner_exec_executor(runner_exec *ex)
{
    return (engine_executor){.ctx = ex, .add = exec_add, .remove = exec_remove,
                             .step = exec_step, .issue = exec_issue, .collect = exec_collect};
}
