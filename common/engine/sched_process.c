/* sched_process.c: applying a step's results (explainer Pass 2, "Processing the output of
 * prefill step 1"; Pass 3, "When the verifier says no", "A request finishes while async
 * scheduling has it in flight").
 *
 * Results are validated first and applied after, so a bad result changes nothing.
 */
#include "common/engine/sched_internal.h"

#include <assert.h>

/* True when the entry's results are consumed: the sequence is still the one that was
 * scheduled (no recompute since) and has not ended (aborted, preempted, or finished in an
 * earlier step while this one was in flight). */
static bool sched_entry_live(const sched_step *st, uint32_t i)
{
    const seq *q = st->seqs[i];
    return q && q->gen == st->gens[i] && !seq_is_finished(q);
}

static di_status sched_check_ids(const sched *s, const int32_t *t, uint32_t n, uint32_t entry,
                                 const char *what, di_error *err)
{
    for (uint32_t k = 0; k < n; k++)
        if (t[k] < 0 || (s->cfg.vocab_size && (uint32_t)t[k] >= s->cfg.vocab_size))
            return di_fail(err, DI_EINVAL, "result %u: %s %u is token %d, outside the "
                           "vocabulary", entry, what, k, t[k]);
    return DI_OK;
}

/* Confidences come for none or all of the new drafts, in [0, 1], never increasing (each is
 * the chance that its draft and every earlier one pass). */
static di_status sched_check_conf(const sched_seq_result *r, uint32_t entry, uint64_t id,
                                  di_error *err)
{
    if (r->n_conf && r->n_conf != r->n_drafts)
        return di_fail(err, DI_EINVAL, "result %u (request %llu): %u confidences for %u drafts "
                       "(want none or one per draft)", entry, (unsigned long long)id, r->n_conf,
                       r->n_drafts);
    for (uint32_t k = 0; k < r->n_conf; k++) {
        float c = r->draft_conf[k];
        if (!(c >= 0.0f && c <= 1.0f))
            return di_fail(err, DI_EINVAL, "result %u (request %llu): confidence %u = %g outside "
                           "[0, 1]", entry, (unsigned long long)id, k, (double)c);
        if (k && c > r->draft_conf[k - 1])
            return di_fail(err, DI_EINVAL, "result %u (request %llu): confidence %u = %g exceeds "
                           "confidence %u = %g (they are cumulative)", entry,
                           (unsigned long long)id, k, (double)c, k - 1,
                           (double)r->draft_conf[k - 1]);
    }
    return DI_OK;
}

static di_status sched_check_result(const sched *s, const sched_step *st, uint32_t i,
                                    const sched_seq_result *r, di_error *err)
{
    const sched_seq_plan *e = &st->entries[i];
    if ((unsigned)r->status > SCHED_RESULT_GRAMMAR_FAILED)
        return di_fail(err, DI_EINVAL, "result %u (request %llu): status %d unknown", i,
                       (unsigned long long)e->request_id, (int)r->status);
    if (r->status != SCHED_RESULT_OK || !e->sample)
        return DI_OK;
    uint32_t lo = 1, hi = st->plan.prompt_run ? 1 : e->seqlen_q;
    if (r->n_tokens < lo || r->n_tokens > hi)
        return di_fail(err, DI_EINVAL, "result %u (request %llu): %u tokens, want %u..%u (the "
                       "rows scheduled)", i, (unsigned long long)e->request_id, r->n_tokens, lo,
                       hi);
    if (r->n_drafts > s->cfg.nextn)
        return di_fail(err, DI_EINVAL, "result %u (request %llu): %u drafts, nextn is %u", i,
                       (unsigned long long)e->request_id, r->n_drafts, s->cfg.nextn);
    di_status rc = sched_check_ids(s, r->tokens, r->n_tokens, i, "token", err);
    if (rc == DI_OK)
        rc = sched_check_ids(s, r->drafts, r->n_drafts, i, "draft", err);
    if (rc == DI_OK)
        rc = sched_check_conf(r, i, e->request_id, err);
    return rc;
}

static di_status sched_check_results(const sched *s, const sched_step *st,
                                     const sched_seq_result *results, size_t n_results,
                                     di_error *err)
{
    if (st->plan.placeholder)
        return DI_OK;
    if (n_results != st->plan.n_seqs || (!results && n_results))
        return di_fail(err, DI_EINVAL, "step %llu: %zu results for %u scheduled sequences",
                       (unsigned long long)st->plan.step, n_results, st->plan.n_seqs);
    for (uint32_t i = 0; i < st->plan.n_seqs; i++) {
        if (!sched_entry_live(st, i))
            continue;
        di_status rc = sched_check_result(s, st, i, &results[i], err);
        if (rc != DI_OK)
            return rc;
    }
    return DI_OK;
}

/* Appends up to n tokens, stopping at the first that ends the request; emits one output. */
static void sched_append(sched *s, seq *q, const int32_t *tokens, uint32_t n)
{
    seq_stop stop = SEQ_RUNNING;
    uint32_t k = 0;
    while (k < n && stop == SEQ_RUNNING)
        stop = seq_append_token(q, tokens[k++], s->cfg.max_model_len);
    s->stats.output_tokens += k;
    if (stop == SEQ_RUNNING && q->where == SEQ_IN_PREFILL && s->type->hold_after_prefill) {
        sched_emit(s, q, tokens, k, SCHED_FINISH_HANDOFF);
        sched_finish_seq(s, q, SEQ_FINISHED_HANDOFF);
        return;
    }
    sched_emit(s, q, tokens, k, sched_finish_of(stop));
    if (stop != SEQ_RUNNING)
        sched_finish_seq(s, q, stop);
    else if (q->where == SEQ_IN_PREFILL)
        sched_run_add(s, q); /* prefill done: it joins running */
}

static void sched_fail(sched *s, seq *q, sched_result_status rs)
{
    seq_status to = rs == SCHED_RESULT_GRAMMAR_FAILED && q->status == SEQ_RUNNING
                        ? SEQ_FINISHED_GRAMMAR_FAILED
                        : SEQ_FINISHED_FAILED;
    sched_emit(s, q, NULL, 0, sched_finish_of(to));
    sched_finish_seq(s, q, to);
}

/* Applies one live entry. A cut prompt is returned (it goes back to the front of waiting once
 * every entry is applied, so several cuts keep their order); otherwise NULL. */
static seq *sched_apply(sched *s, const sched_step *st, uint32_t i, const sched_seq_result *r)
{
    seq *q = st->seqs[i];
    const sched_seq_plan *e = &st->entries[i];
    bool prompt = st->plan.prompt_run;
    if (r->status == SCHED_RESULT_FAILED ||
        (r->status == SCHED_RESULT_GRAMMAR_FAILED && e->sample)) {
        sched_fail(s, q, r->status);
        return NULL;
    }
    if (prompt && !e->sample)
        return q; /* a non-final chunk: its sampled token is thrown away */
    if (!prompt)
        seq_commit_processed_tokens(q, e->seqlen_q, r->n_tokens);
    seq_set_drafts(q, r->drafts, r->n_drafts);
    seq_set_draft_conf(q, r->draft_conf, r->n_conf);
    sched_append(s, q, r->tokens, r->n_tokens);
    return NULL;
}

di_status sched_process_outputs(sched *s, const sched_plan *plan,
                                const sched_seq_result *results, size_t n_results,
                                const sched_output **outs, size_t *n_outs, di_error *err)
{
    if (s->n_in_flight == 0)
        return di_fail(err, DI_ESTATE, "no step is in flight");
    sched_step *st = &s->steps[s->step_first];
    if (!plan || plan != &st->plan)
        return di_fail(err, DI_ESTATE, "step %llu processed out of order: process step %llu "
                       "first", plan ? (unsigned long long)plan->step : 0ull,
                       (unsigned long long)st->plan.step);
    di_status rc = sched_check_results(s, st, results, n_results, err);
    if (rc != DI_OK)
        return rc;
    if (s->outs_delivered) {
        s->n_outs = 0;
        s->n_out_tokens = 0;
        s->outs_delivered = false;
    }
    uint32_t n_cut = 0;
    for (uint32_t i = 0; i < st->plan.n_seqs; i++) {
        seq *q = st->seqs[i];
        if (!q)
            continue; /* placeholder */
        const sched_seq_plan *e = &st->entries[i];
        q->inflight_steps--;
        q->inflight_rows -= e->seqlen_q;
        seq *cut = NULL;
        if (sched_entry_live(st, i))
            cut = sched_apply(s, st, i, &results[i]);
        else if (q->release_pending && q->inflight_steps == 0)
            sched_settle(s, q); /* rode a step after it ended, or was recomputed */
        if (cut)
            s->order[n_cut++] = cut;
    }
    while (n_cut > 0)
        sched_wq_push_front(s, s->order[--n_cut]);
    for (uint32_t i = 0; i < st->plan.n_copies; i++) /* the copies have run */
        if (st->copies[i].kind == SCHED_COPY_BLOCK)
            blkmgr_free(s->bm, &st->copies[i].src, 1);
    st->in_flight = false;
    s->step_first = (s->step_first + 1) % 2;
    s->n_in_flight--;
    s->outs_delivered = true;
    *outs = s->outs;
    *n_outs = s->n_outs;
    return DI_OK;
}

void sched_plan_fixup(sched_plan *next, const sched_plan *prev,
                      const sched_seq_result *prev_results)
{
    for (uint32_t i = 0; i < next->n_seqs; i++) {
        sched_seq_plan *e = &next->seqs[i];
        if (!e->tokens_from_prev)
            continue;
        assert(prev && e->prev_index < prev->n_seqs &&
               prev->seqs[e->prev_index].request_id == e->request_id);
        const sched_seq_plan *pe = &prev->seqs[e->prev_index];
        const sched_seq_result *r = &prev_results[e->prev_index];
        if (r->status != SCHED_RESULT_OK || r->n_tokens == 0 || r->n_tokens > pe->seqlen_q)
            continue; /* it ended in prev: the rows ride with pad tokens */
        int32_t *t = (int32_t *)e->tokens; /* the scheduler's row buffer of this plan */
        t[0] = r->tokens[r->n_tokens - 1];
        for (uint32_t k = 1; k < e->seqlen_q && k - 1 < r->n_drafts; k++)
            t[k] = r->drafts[k - 1];
        uint32_t rejected = pe->seqlen_q - r->n_tokens;
        e->first_position -= rejected;
        e->seqlen_k -= rejected;
    }
}
