/* runner_exec_overlap.c: the executor's step as issue and collect (runner_exec_issue), and the
 * overlap: a decode step without drafts issued before the previous step is collected.
 *
 * Such a step's positions, key lengths, blocks, emissions and window commits are the plan's
 * (no draft can be rejected); only the token of each continuing row is step N's outcome. So at
 * its issue the host writes the plan's rows (the scheduler's guess for the continuing ones)
 * into mapped memory (kern_ops.alloc_mapped), gathers step N's sampled tokens into the
 * step_ahead op's input, runs the op (ids, positions and key lengths of the continuing rows),
 * and the forward embeds and hashes (Engram) the op's ids from there; the Engram lookback
 * before the row is step N-1's outcome or older, already on the host. The sampler draws into
 * mapped memory (kern_sample.out_dev) with the output index counting the tokens still in
 * flight (its EOS ban), and a mark follows the step (kern_ops.mark). Collect waits for that
 * mark only, not for the step issued after it, and reads the op's rows and the draws: the rows
 * must be the plan's after the host fix-up (sched_plan_fixup), then the requests' state takes
 * the outcomes. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/runner_exec_internal.h"
#include "common/sampling/sampler_backend.h"

di_status rx_flights_create(runner_exec *ex, di_error *err)
{
    const kern_backend *be = ex->be;
    uint32_t E = ex->max_entries, T = ex->opt.fwd.max_rows;
    for (int k = 0; k < 2; k++) {
        rx_flight *f = &ex->fl[k];
        f->res = calloc(E, sizeof(*f->res));
        f->lbase = calloc(E, sizeof(int32_t));
        if (!f->res || !f->lbase)
            return di_fail(err, DI_ENOMEM, "executor: results of a step of %u entries", E);
    }
    if (!ex->opt.overlap)
        return DI_OK;
    if (!be->ops.alloc_mapped || !be->ops.free_mapped || !be->ops.mark || !be->ops.wait_mark)
        return di_fail(err, DI_EUNSUPPORTED, "executor: the overlap needs the %s backend's "
                       "mapped memory and marks", be->name ? be->name : "");
    kern_step_ahead v;
    size_t ah = rx_ahead_view(NULL, E, T, &v);
    ex->gather = calloc(E, sizeof(int32_t));
    if (!ex->gather)
        return di_fail(err, DI_ENOMEM, "executor: overlap scratch");
    for (int k = 0; k < 2; k++) {
        rx_flight *f = &ex->fl[k];
        void *h = NULL;
        f->sres = calloc(T, sizeof(*f->sres));
        f->ah_check = calloc(E, 1);
        f->outs_dev = be->ops.alloc_mapped(be->ctx, T * sizeof(kern_sample_out), &h);
        f->outs_host = h;
        f->ah_dev = be->ops.alloc_mapped(be->ctx, ah, &f->ah_host);
        if (!f->sres || !f->ah_check || !f->outs_dev || !f->ah_dev)
            return di_fail(err, DI_ENOMEM, "executor: buffers of two steps in flight (%u rows)",
                           T);
    }
    return DI_OK;
}

void rx_flights_free(runner_exec *ex)
{
    for (int k = 0; k < 2; k++) {
        rx_flight *f = &ex->fl[k];
        free(f->res);
        free(f->lbase);
        free(f->sres);
        free(f->ah_check);
        if (f->outs_dev)
            ex->be->ops.free_mapped(ex->be->ctx, f->outs_dev);
        if (f->ah_dev)
            ex->be->ops.free_mapped(ex->be->ctx, f->ah_dev);
        memset(f, 0, sizeof(*f));
    }
    free(ex->gather);
    ex->gather = NULL;
}

/* The step in flight that the plan would follow: issued last and not collected. */
static rx_flight *in_flight(runner_exec *ex)
{
    for (int k = 0; k < 2; k++)
        if (ex->fl[k].plan && !ex->fl[k].placeholder && ex->fl[k].number == ex->stats.steps)
            return &ex->fl[k];
    return NULL;
}

/* 1 when the plan can be issued before `prev` (in flight) is collected: a decode step of one
 * row per entry without drafts, forced tokens, KV loads or logits for the caller, whose
 * continuing entries take a token prev sampled into backend memory. */
static int overlap_ok(const runner_exec *ex, const sched_plan *plan, const rx_flight *prev)
{
    if (!ex->opt.overlap || !prev || !prev->outs_on_dev || plan->prompt_run || ex->nextn ||
        ex->opt.on_logits || plan->n_seqs > ex->max_entries || plan->n_seqs == 0)
        return 0;
    const sched_plan *pp = prev->plan;
    for (uint32_t i = 0; i < plan->n_seqs; i++) {
        const sched_seq_plan *p = &plan->seqs[i];
        const rx_req *r = rx_find(ex, p->request_id);
        if (!r || p->seqlen_q != 1 || p->n_load || p->load_window ||
            r->n_out + r->uncommitted < r->n_forced)
            return 0;
        if (!p->tokens_from_prev) {
            if (r->uncommitted) /* its next token is in flight, but not as this row */
                return 0;
            continue;
        }
        if (p->prev_index >= pp->n_seqs || pp->seqs[p->prev_index].request_id != p->request_id ||
            prev->lbase[p->prev_index] < 0)
            return 0;
    }
    return 1;
}

/* The tokens of a step sampled on the host into its outcomes in mapped memory, for a
 * successor issued ahead of its collect. */
static void tokens_to_dev(rx_flight *f)
{
    for (uint32_t k = 0; k < f->n_logit; k++)
        f->outs_host[k].token = f->sres[k].err.code == DI_OK ? f->sres[k].token : 0;
    f->outs_on_dev = 1;
}

/* The sampled rows of the step just run (ex->lbase, logits in backend memory or on the host):
 * drawn into the flight's outcomes without touching the requests. */
static di_status sample_rows(runner_exec *ex, const sched_plan *plan, const fwd_step *st,
                             const float *dev_logits, rx_flight *f, di_error *err)
{
    uint32_t n = st->n_logit_rows;
    f->n_logit = n;
    if (n == 0)
        return DI_OK;
    sampler_row *rows = malloc(n * sizeof(*rows));
    if (!rows)
        return di_fail(err, DI_ENOMEM, "sampler rows of a %u-row step", n);
    for (uint32_t i = 0; i < plan->n_seqs; i++) {
        if (ex->lbase[i] < 0)
            continue;
        const sched_seq_plan *p = &plan->seqs[i];
        const rx_req *r = rx_find(ex, p->request_id);
        uint64_t pos = plan->prompt_run ? sampler_prefill_position(p->seqlen_k)
                                        : sampler_decode_position(p->seqlen_k, p->seqlen_q);
        const float *lg = dev_logits ? NULL : ex->logits + (size_t)ex->lbase[i] * ex->V;
        rows[ex->lbase[i]] = rx_target_row(ex, r, lg, pos, 0, r->n_out + r->uncommitted);
    }
    di_status s = DI_OK;
    if (dev_logits) {
        s = sampler_launch_backend(ex->be, dev_logits, ex->V, rows, n, ex->V, f->outs_dev, err);
        f->outs_on_dev = s == DI_OK;
    } else {
        for (uint32_t k = 0; k < n; k++) {
            sampler_result *o = &f->sres[k];
            di_error e;
            if (sampler_sample(&rows[k], ex->ws, o, &e) != DI_OK) {
                o->err = e;
                o->token = -1;
            } else {
                di_error_clear(&o->err);
            }
        }
        f->host_sampled = 1;
        tokens_to_dev(f);
    }
    free(rows);
    return s;
}

/* The rows of an overlapped step: the plan's, the continuing ones by the op from prev's
 * tokens on the device; the forward then reads the op's ids. */
static di_status issue_overlapped(runner_exec *ex, const sched_plan *plan, rx_flight *prev,
                                  rx_flight *f, fwd_step *st, di_error *err)
{
    const kern_backend *be = ex->be;
    kern_step_ahead h, d; /* one mapped block: the host writes the inputs, the op the rows */
    rx_ahead_view(f->ah_host, ex->max_entries, ex->opt.fwd.max_rows, &h);
    rx_ahead_view(f->ah_dev, ex->max_entries, ex->opt.fwd.max_rows, &d);
    int64_t *base_len = (int64_t *)h.base_len;
    int32_t *accepted = (int32_t *)h.accepted;
    uint32_t *row0 = (uint32_t *)h.row0;
    uint32_t n = 0, row = 0;
    for (uint32_t i = 0; i < st->n_seqs; i++) {
        const fwd_seq *s = &st->seqs[i];
        for (uint32_t j = 0; j < s->n_rows; j++) { /* placeholder rows: id 0 */
            h.ids[row + j] = s->placeholder ? 0 : s->tokens[j];
            h.positions[row + j] = s->placeholder ? (int64_t)j : s->pos0 + j;
            h.live[row + j] = !s->placeholder;
        }
        if (i < plan->n_seqs) {
            const sched_seq_plan *p = &plan->seqs[i];
            f->ah_check[i] = (uint8_t)p->tokens_from_prev;
            if (p->tokens_from_prev) {
                const sched_seq_plan *pe = &prev->plan->seqs[p->prev_index];
                base_len[n] = (int64_t)pe->first_position + pe->seqlen_q;
                accepted[n] = 1;
                row0[n] = row;
                ex->gather[n] = prev->lbase[p->prev_index];
                n++;
            }
        }
        row += s->n_rows;
    }
    if (n) {
        kern_copy_rows g = {.n_rows = n, .row_bytes = sizeof(int32_t),
                            .src = (const uint8_t *)prev->outs_dev +
                                   offsetof(kern_sample_out, token),
                            .src_stride = sizeof(kern_sample_out), .rows = ex->gather,
                            .dst = (int32_t *)d.tokens, .dst_stride = sizeof(int32_t)};
        di_status s = be->ops.copy_rows(be->ctx, &g);
        if (s != DI_OK)
            return di_fail(err, s, "overlap: gathering the previous step's %u tokens failed", n);
        d.n_seqs = n, d.nextn = 0, d.n_rows = row, d.out_stride = 1;
        if ((s = be->ops.step_ahead(be->ctx, &d)) != DI_OK)
            return di_fail(err, s, "overlap: the backend's fix-up of %u sequences failed", n);
        ex->stats.ahead_steps++;
        ex->stats.ahead_entries += n;
    }
    st->ids_dev = d.ids;
    f->overlapped = 1;
    return DI_OK;
}

/* An overlapped step: the plan's copies and rows, the op's rows of the continuing entries,
 * the forward on them, the draws into the flight. */
static di_status issue_overlapped_step(runner_exec *ex, const sched_plan *plan, rx_flight *prev,
                                       rx_flight *f, di_error *err)
{
    fwd_step st;
    di_status s = rx_do_copies(ex, plan, err);
    if (s == DI_OK)
        s = rx_build_step(ex, plan, &st, err);
    if (s == DI_OK)
        s = issue_overlapped(ex, plan, prev, f, &st, err);
    if (s != DI_OK)
        return s;
    memcpy(f->lbase, ex->lbase, plan->n_seqs * sizeof(int32_t));
    if (ex->be->ops.sample && !ex->opt.host_sampling) {
        const float *logits = NULL;
        s = fwd_step_run_keep(ex->run, ex->kv, &st, &logits, err);
        return s == DI_OK ? sample_rows(ex, plan, &st, logits, f, err) : s;
    }
    s = fwd_step_run(ex->run, ex->kv, &st, ex->logits, err);
    return s == DI_OK ? sample_rows(ex, plan, &st, NULL, f, err) : s;
}

/* A step issued after the previous one was collected: its draws deferred to collect when the
 * backend samples them and a successor may overlap it, else run whole now. */
static di_status issue_after(runner_exec *ex, const sched_plan *plan, rx_flight *f,
                             di_error *err)
{
    fwd_step st;
    di_status s = rx_step_prepare(ex, plan, &st, err);
    if (s != DI_OK)
        return s;
    memcpy(f->lbase, ex->lbase, plan->n_seqs * sizeof(int32_t));
    int may_follow = ex->opt.overlap && !ex->nextn && !ex->opt.on_logits;
    if (may_follow && !plan->prompt_run && rx_device_sampling(ex, plan)) {
        const float *logits = NULL;
        s = fwd_step_run_keep(ex->run, ex->kv, &st, &logits, err);
        return s == DI_OK ? sample_rows(ex, plan, &st, logits, f, err) : s;
    }
    f->ran = 1;
    if ((s = rx_step_finish(ex, plan, &st, f->res, err)) != DI_OK || !may_follow)
        return s;
    f->n_logit = st.n_logit_rows; /* the tokens for an overlapped successor */
    for (uint32_t i = 0; i < plan->n_seqs; i++)
        if (f->lbase[i] >= 0) {
            const sched_seq_result *r = &f->res[i];
            f->sres[f->lbase[i]].token = r->status == SCHED_RESULT_OK && r->n_tokens
                                             ? r->tokens[r->n_tokens - 1] : 0;
            di_error_clear(&f->sres[f->lbase[i]].err);
        }
    tokens_to_dev(f);
    return DI_OK;
}

di_status runner_exec_issue(runner_exec *ex, const sched_plan *plan, bool ahead, bool *issued,
                            di_error *err)
{
    if (issued)
        *issued = false;
    if (!ex || !plan || !issued)
        return di_fail(err, DI_EINVAL, "issue: executor, plan and flag are required");
    if (plan->n_seqs > ex->max_entries)
        return di_fail(err, DI_EINVAL, "plan of %u sequences exceeds %u", plan->n_seqs,
                       ex->max_entries);
    rx_flight *f = NULL, *prev = in_flight(ex);
    for (int k = 0; k < 2; k++) {
        if (ex->fl[k].plan == plan)
            return di_fail(err, DI_ESTATE, "issue: the plan is already in flight");
        if (!ex->fl[k].plan && !f)
            f = &ex->fl[k];
    }
    if (ahead && (plan->placeholder || !overlap_ok(ex, plan, prev)))
        return DI_OK; /* the caller collects the previous step first */
    if (!f)
        return di_fail(err, DI_ESTATE, "issue: two steps in flight already");
    memset(f, 0, offsetof(rx_flight, res));
    f->n_logit = 0;
    f->plan = plan;
    if (plan->placeholder) { /* one rank: nothing to run */
        f->placeholder = 1;
        *issued = true;
        return DI_OK;
    }
    di_status s = ahead ? issue_overlapped_step(ex, plan, prev, f, err)
                        : issue_after(ex, plan, f, err);
    if (s != DI_OK) {
        f->plan = NULL;
        return s;
    }
    ex->stats.steps++;
    f->number = ex->stats.steps;
    if (ahead)
        ex->stats.overlap_steps++;
    *issued = true;
    if (f->ran) {
        rx_ahead_record(ex, plan, f->res, f->lbase, f->number);
        return DI_OK;
    }
    for (uint32_t i = 0; i < plan->n_seqs; i++)
        if (f->lbase[i] >= 0)
            rx_find(ex, plan->seqs[i].request_id)->uncommitted++;
    s = ex->be->ops.mark(ex->be->ctx, &f->mark); /* collect waits for this step only */
    return s == DI_OK ? DI_OK : di_fail(err, s, "issue: the %s backend's mark failed (%s)",
                                        ex->be->name, di_status_str(s));
}

/* Collect's cross-check of an overlapped step: the op's rows of each continuing entry whose
 * previous step produced a token must be the plan's after the host fix-up. */
static di_status check_rows(runner_exec *ex, const sched_plan *plan, rx_flight *f,
                            di_error *err)
{
    kern_step_ahead h; /* written by the op, read after the wait */
    rx_ahead_view(f->ah_host, ex->max_entries, ex->opt.fwd.max_rows, &h);
    uint32_t n = 0, row = 0;
    for (uint32_t i = 0; i < plan->n_seqs; row += plan->seqs[i].seqlen_q, i++) {
        if (!f->ah_check[i])
            continue;
        const sched_seq_plan *p = &plan->seqs[i];
        const rx_req *r = rx_find(ex, p->request_id);
        uint32_t s = n++;
        if (r->ah_res.status != SCHED_RESULT_OK || r->ah_res.n_tokens == 0)
            continue; /* it ended in the previous step: the rows ride, nothing to compare */
        if (h.seqlen_k[s] != (int64_t)p->seqlen_k || h.positions[row] != p->first_position ||
            h.ids[row] != p->tokens[0] || !h.live[row])
            return di_fail(err, DI_EINTERNAL, "overlap: entry %u (request %llu) ran on token "
                           "%d at position %lld, key length %lld from the device; the plan "
                           "says token %d at %lld, %u", i, (unsigned long long)p->request_id,
                           h.ids[row], (long long)h.positions[row], (long long)h.seqlen_k[s],
                           p->tokens[0], (long long)p->first_position, p->seqlen_k);
    }
    return DI_OK;
}

di_status runner_exec_collect(runner_exec *ex, const sched_plan *plan,
                              sched_seq_result *results, di_error *err)
{
    if (!ex || !plan || (!results && plan->n_seqs))
        return di_fail(err, DI_EINVAL, "collect: executor, plan and results are required");
    rx_flight *f = NULL;
    for (int k = 0; k < 2; k++)
        if (ex->fl[k].plan == plan)
            f = &ex->fl[k];
    if (!f)
        return di_fail(err, DI_ESTATE, "collect: the plan is not in flight");
    for (int k = 0; k < 2; k++)
        if (ex->fl[k].plan && &ex->fl[k] != f && !ex->fl[k].placeholder && !f->placeholder &&
            ex->fl[k].number < f->number)
            return di_fail(err, DI_ESTATE, "collect: an earlier step is still in flight");
    if (f->placeholder || f->ran) {
        if (f->ran)
            memcpy(results, f->res, plan->n_seqs * sizeof(*results));
        for (uint32_t i = 0; f->ran && ex->opt.overlap && i < plan->n_seqs; i++) {
            const sched_seq_result *o = &f->res[i];
            if (f->lbase[i] < 0 || o->status != SCHED_RESULT_OK || !o->n_tokens)
                continue; /* below: the next row's token for the Engram lookback */
            const sched_seq_plan *p = &plan->seqs[i];
            rx_req *r = rx_find(ex, p->request_id);
            uint64_t next = (uint64_t)p->first_position +
                            (plan->prompt_run ? p->seqlen_q : o->n_tokens);
            if (r && next < r->cap)
                r->toks[next] = o->tokens[o->n_tokens - 1];
        }
        f->plan = NULL;
        return DI_OK;
    }
    /* the step's own work, not the step issued after it */
    di_status s = ex->be->ops.wait_mark(ex->be->ctx, f->mark);
    if (s != DI_OK)
        di_fail(err, s, "collect: the %s backend failed in the step (%s)", ex->be->name,
                di_status_str(s));
    if (s == DI_OK && f->overlapped)
        s = check_rows(ex, plan, f, err);
    for (uint32_t k = 0; s == DI_OK && !f->host_sampled && k < f->n_logit; k++)
        sampler_backend_result(&f->outs_host[k], &f->sres[k]);
    /* the requests take the outcomes, in flight no more */
    for (uint32_t i = 0; i < plan->n_seqs; i++) {
        sched_seq_result *res = &results[i];
        if (f->lbase[i] < 0) {
            rx_result_open(ex, plan, i, res);
            continue;
        }
        rx_req *r = rx_find(ex, plan->seqs[i].request_id);
        r->uncommitted--;
        if (s != DI_OK)
            continue;
        rx_result_open(ex, plan, i, res);
        const sampler_result *o = &f->sres[f->lbase[i]];
        rx_take_draw(r, o, res);
        if (o->err.code != DI_OK)
            continue;
        /* the next row's token, for the Engram lookback of steps issued before this one's
         * successor is collected */
        const sched_seq_plan *p = &plan->seqs[i];
        uint64_t next = (uint64_t)p->first_position + p->seqlen_q;
        if (next < r->cap)
            r->toks[next] = o->token;
    }
    f->plan = NULL;
    if (s == DI_OK)
        rx_ahead_record(ex, plan, results, f->lbase, f->number);
    return s;
}

di_status runner_exec_step(runner_exec *ex, const sched_plan *plan, sched_seq_result *results,
                           di_error *err)
{
    if (!ex || !plan || (!results && plan->n_seqs))
        return di_fail(err, DI_EINVAL, "step: executor, plan and results are required");
    bool issued;
    di_status s = runner_exec_issue(ex, plan, false, &issued, err);
    return s == DI_OK ? runner_exec_collect(ex, plan, results, err) : s;
}
