#include "common/serve/engsvc.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/model/forward.h"
#include "common/net/decode.pb-c.h"
#include "common/net/prefill.pb-c.h"
#include "common/serve/engsvc_internal.h"
#include "common/serve/handoff.h"
#include "common/util/clock.h"

/* ---- helpers ---------------------------------------------------------------------------- */

static void logf_req(engsvc *s, const sreq *r, di_status st, const char *msg)
{
    if (s->cfg.log)
        di_log(s->cfg.log, DI_LOG_WARN, "request %s: %s: %s", r->rid, di_status_name(st), msg);
}

void engsvc_req_free(sreq *r)
{
    if (!r)
        return;
    free(r->prompt);
    free(r->blacklist);
    free(r->hobj);
    for (uint32_t i = 0; r->blocks && i < r->n_full; i++)
        free(r->blocks[i]);
    free(r->blocks);
    free(r->bsz);
    free(r);
}

void engsvc_on_cancel(void *ud, di_status why)
{
    sreq *r = ud;
    atomic_store(&r->cancel_why, (int)why);
    atomic_store(&r->cancelled, 1);
}

Di__Engine__Finish engsvc_finish_pb(sched_finish f)
{
    switch (f) {
    case SCHED_FINISH_NONE: return DI__ENGINE__FINISH__FINISH_NONE;
    case SCHED_FINISH_STOP: return DI__ENGINE__FINISH__FINISH_STOP;
    case SCHED_FINISH_LENGTH: return DI__ENGINE__FINISH__FINISH_LENGTH;
    case SCHED_FINISH_ABORT: return DI__ENGINE__FINISH__FINISH_ABORTED;
    case SCHED_FINISH_PREEMPTED: return DI__ENGINE__FINISH__FINISH_PREEMPTED;
    default: return DI__ENGINE__FINISH__FINISH_ERROR;
    }
}

/* A Token message for (token, sampler result) at output index idx. tops: [n_top] storage. */
void engsvc_token_pb(Di__Engine__Token *t, Di__Engine__TokenLogprob *tops,
                     Di__Engine__TokenLogprob **ptrs, int32_t tok, const sampler_result *res,
                     uint32_t idx)
{
    di__engine__token__init(t);
    t->id = (uint32_t)tok;
    t->index = idx;
    if (!res)
        return;
    t->logprob = res->logprob;
    for (uint32_t i = 0; i < res->n_top; i++) {
        di__engine__token_logprob__init(&tops[i]);
        tops[i].id = (uint32_t)res->top_tokens[i];
        tops[i].logprob = res->top_logprobs[i];
        ptrs[i] = &tops[i];
    }
    t->n_top = res->n_top;
    t->top = res->n_top ? ptrs : NULL;
}

/* Ends a request's call and frees it (engine thread, no lock held). */
void engsvc_end_req(engsvc *s, sreq *r, di_status st, const void *reply, size_t len,
                    const char *msg)
{
    if (st != DI_OK && st != DI_ECANCELED)
        logf_req(s, r, st, msg ? msg : "");
    rpc_call_finish(r->call, st, reply, len, msg);
    engsvc_req_free(r);
    pthread_mutex_lock(&s->mu);
    s->live--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* The request list is written by the engine thread only, under mu (Abort reads it). */
void engsvc_unlink(engsvc *s, sreq *r)
{
    pthread_mutex_lock(&s->mu);
    for (sreq **p = &s->reqs; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            r->next = NULL;
            break;
        }
    pthread_mutex_unlock(&s->mu);
}

/* ---- the engine thread ----------------------------------------------------------------- */

static void on_output(void *ud, const engine_output *o)
{
    engsvc *s = ud;
    sreq *r = o->user;
    uint32_t nr;
    const runner_token *rt = runner_exec_tokens(s->ex, o->request_id, &nr);
    if (s->cfg.kind == ENGSVC_PREFILL) {
        if (o->n_tokens && nr && rt[0].token == o->tokens[0])
            r->first = rt[0];
        else if (o->n_tokens)
            r->first = (runner_token){.token = o->tokens[0]};
    } else {
        for (uint32_t t = 0; t < o->n_tokens; t++) {
            const sampler_result *res = t < nr && rt[t].token == o->tokens[t] ? &rt[t].res : NULL;
            bool last = t + 1 == o->n_tokens;
            Di__Engine__Token tok;
            Di__Engine__TokenLogprob tops[SAMPLER_MAX_LOGPROBS], *ptrs[SAMPLER_MAX_LOGPROBS];
            engsvc_token_pb(&tok, tops, ptrs, o->tokens[t], res, r->n_out);
            Di__Decode__DecodeToken m = DI__DECODE__DECODE_TOKEN__INIT;
            m.token = &tok;
            m.finish = last ? engsvc_finish_pb(o->finish) : DI__ENGINE__FINISH__FINISH_NONE;
            m.output_tokens = ++r->n_out;
            if (!r->reported) {
                m.kv_bytes_pulled = r->pulled_bytes;
                m.kv_pull_us = r->pull_ns / 1000u;
                r->reported = true;
            }
            if (last && o->finish == SCHED_FINISH_FAILED)
                m.finish = DI__ENGINE__FINISH__FINISH_ERROR;
            uint8_t buf[4096];
            size_t n = di__decode__decode_token__pack(&m, buf);
            di_error e;
            if (rpc_call_write(r->call, buf, n, &e) != DI_OK && !atomic_load(&r->cancelled)) {
                atomic_store(&r->cancel_why, DI_ECANCELED);
                atomic_store(&r->cancelled, 1); /* the client is gone or not reading */
            }
        }
    }
    if (s->cfg.kind == ENGSVC_DECODE && o->n_tokens == 0 && o->finish != SCHED_FINISH_NONE &&
        o->finish != SCHED_FINISH_ABORT) {
        /* an end without a token (preempted, failed): the last message carries the finish */
        Di__Decode__DecodeToken m = DI__DECODE__DECODE_TOKEN__INIT;
        m.finish = o->finish == SCHED_FINISH_FAILED ? DI__ENGINE__FINISH__FINISH_ERROR
                                                    : engsvc_finish_pb(o->finish);
        m.output_tokens = r->n_out;
        uint8_t buf[64];
        di_error e;
        (void)rpc_call_write(r->call, buf, di__decode__decode_token__pack(&m, buf), &e);
    }
    if (o->finish != SCHED_FINISH_NONE)
        kvcache_finished(s->kc, o->request_id, o->finish); /* the response's KV to the store */
    if (o->finish == SCHED_FINISH_HANDOFF) {
        r->handed = true;
    } else if (o->finish != SCHED_FINISH_NONE) {
        r->done = true;
        r->finish = o->finish;
        if (o->finish == SCHED_FINISH_FAILED) {
            r->fail = DI_EINTERNAL;
            snprintf(r->fail_msg, sizeof r->fail_msg, "the step failed: %s",
                     runner_exec_error(s->ex, o->request_id));
        }
    }
}

/* PREFILL: a request whose first token ended it (or that failed): the reply has no handoff. */
static void prefill_done(engsvc *s, sreq *r)
{
    engsvc_unlink(s, r);
    if (r->finish == SCHED_FINISH_FAILED) {
        engsvc_end_req(s, r, r->fail, NULL, 0, r->fail_msg);
        return;
    }
    if (r->finish == SCHED_FINISH_ABORT) {
        engsvc_end_req(s, r, DI_ECANCELED, NULL, 0, "aborted");
        return;
    }
    Di__Engine__Token tok;
    Di__Engine__TokenLogprob tops[SAMPLER_MAX_LOGPROBS], *ptrs[SAMPLER_MAX_LOGPROBS];
    engsvc_token_pb(&tok, tops, ptrs, r->first.token, &r->first.res, 0);
    Di__Prefill__PrefillReply rep = DI__PREFILL__PREFILL_REPLY__INIT;
    rep.request_id = r->rid;
    rep.first = &tok;
    rep.finish = engsvc_finish_pb(r->finish);
    rep.cached_tokens = r->cached;
    rep.queue_ms = r->t_start ? (r->t_start - r->t_arrive) / 1000000u : 0;
    rep.compute_ms = r->t_start ? (di_mono_ns() - r->t_start) / 1000000u : 0;
    uint8_t buf[4096];
    size_t n = di__prefill__prefill_reply__pack(&rep, buf);
    engsvc_end_req(s, r, DI_OK, buf, n, NULL);
}

static di_status on_load(void *ud, fwd_kv *kv, const sched_seq_plan *p, di_error *err)
{
    engsvc *s = ud;
    if (s->cfg.kind == ENGSVC_PREFILL) /* a prefix hit */
        return kvcache_load(s->kc, kv, p, err);
    for (sreq *r = s->reqs; r; r = r->next)
        if (r->id == p->request_id)
            return handoff_load(kv, p, &r->h, (const void *const *)r->blocks, r->bsz, err);
    return di_fail(err, DI_EINTERNAL, "load of request %llu: no such request",
                   (unsigned long long)p->request_id);
}

/* Starts a queued request (engine thread): PREFILL asks the store for its prefix, DECODE
 * pulls its handoff; either enters the engine when that is done (engsvc_take_events). */
static void admit(engsvc *s, sreq *r)
{
    di_error err;
    di_status st;
    r->id = ++s->next_id;
    pthread_mutex_lock(&s->mu);
    r->next = s->reqs;
    s->reqs = r;
    pthread_mutex_unlock(&s->mu);
    if (s->cfg.kind == ENGSVC_PREFILL) {
        r->loading = true;
        /* max_tokens 1: a PROMPT engine stores no response */
        st = kvcache_admit(s->kc, r->id, r->prompt, r->prompt_len, 1, r, &err);
        r->loading = st == DI_OK;
    } else {
        st = engsvc_pull_submit(s, r, &err);
    }
    if (st != DI_OK) {
        if (s->cfg.kind == ENGSVC_DECODE)
            engsvc_drop_handoff(s, r);
        engsvc_unlink(s, r);
        engsvc_end_req(s, r, st, NULL, 0, err.msg);
    }
}

/* Ends cancelled requests; with abort_all, every request (the drain's deadline passed). */
static void reap_cancels(engsvc *s, bool abort_all)
{
    sreq *r = s->reqs;
    while (r) {
        sreq *next = r->next;
        if ((atomic_load(&r->cancelled) || abort_all) && r->job_out) {
            /* its store call ends it: cancel the call if it has not started */
            if (!atomic_load(&r->cancelled)) {
                atomic_store(&r->cancel_why, (int)DI_EUNAVAIL);
                atomic_store(&r->cancelled, 1);
            }
            kvcache_forget(s->kc, r->id);
        } else if (atomic_load(&r->cancelled) || abort_all) {
            di_error err;
            kvcache_forget(s->kc, r->id); /* its admission, its copies */
            if (r->in_engine)
                (void)engine_abort(s->e, r->id, &err);
            engsvc_unlink(s, r);
            di_status why = abort_all && !atomic_load(&r->cancelled)
                                ? DI_EUNAVAIL : (di_status)atomic_load(&r->cancel_why);
            engsvc_end_req(s, r, why, NULL, 0,
                    why == DI_EUNAVAIL ? "the service is stopping: request aborted"
                                       : "request cancelled");
        }
        r = next;
    }
}

static void publish_load(engsvc *s)
{
    sched *q = engine_sched(s->e);
    uint64_t queued = 0;
    uint32_t loading = 0; /* waiting for their prefix or handoff from the store */
    for (sreq *r = s->reqs; r; r = r->next) {
        if (s->cfg.kind == ENGSVC_PREFILL && !r->t_start)
            queued += r->prompt_len;
        loading += r->loading || (s->cfg.kind == ENGSVC_DECODE && r->job_out);
    }
    pthread_mutex_lock(&s->mu);
    s->queued_prompt_tokens = queued;
    s->running = sched_num_running(q);
    s->waiting = sched_num_waiting(q) + loading;
    s->free_blocks = sched_free_blocks(q);
    s->total_blocks = sched_usable_blocks(q);
    s->free_slots = sched_free_slots(q);
    s->total_slots = sched_get_config(q)->num_slots;
    uint64_t now = di_mono_ns();
    double steps_per_s = loadrate_per_s(&s->decode_rate, now);
    s->prefill_tps = loadrate_per_s(&s->prefill_rate, now);
    kvcache_stats ks = kvcache_get_stats(s->kc);
    s->computed_prompt_tokens = s->prefill_tokens;
    s->store_failures = s->call_failures + ks.load_failures + ks.store_failures;
    s->decode_ms = steps_per_s > 0 ? 1e3 / steps_per_s : 0;
    s->decode_steps = sched_get_stats(q)->decode_steps;
    s->steps_issued_ahead = engine_get_stats(s->e)->issued_ahead;
    pthread_mutex_unlock(&s->mu);
}

/* The engine or the rank group failed (engine thread): every request ends with st and msg,
 * new ones are refused, Health says NOT_SERVING, and no step runs again. */
static void fail_all(engsvc *s, di_status st, const char *msg, di_log_level level)
{
    if (s->cfg.log)
        di_log(s->cfg.log, level, "%s%s", level == DI_LOG_ERROR ? "engine step failed: " : "",
               msg);
    pthread_mutex_lock(&s->mu);
    s->draining = true;
    if (!s->broken) {
        s->broken = true;
        snprintf(s->broken_msg, sizeof s->broken_msg, "%s", msg);
    }
    pthread_mutex_unlock(&s->mu);
    for (sreq *r = s->reqs, *next; r; r = next) {
        next = r->next;
        kvcache_forget(s->kc, r->id);
        if (r->job_out) { /* ends when its store call completes */
            atomic_store(&r->cancel_why, (int)st);
            atomic_store(&r->cancelled, 1);
            continue;
        }
        engsvc_unlink(s, r);
        engsvc_end_req(s, r, st, NULL, 0, msg);
    }
}

/* One step of the engine; in a rank group every rank runs it when any rank has work, and a
 * rank that ran no plan ends its (placeholder) group step at once. */
static di_status step(engsvc *s, di_error *err)
{
    for (sreq *r = s->reqs; r; r = r->next)
        if (!r->t_start && r->in_engine)
            r->t_start = di_mono_ns();
    uint64_t t0 = di_mono_ns(), p0 = sched_get_stats(engine_sched(s->e))->prefill_tokens;
    uint64_t d0 = sched_get_stats(engine_sched(s->e))->decode_steps;
    bool ran = false;
    di_status st = engine_step(s->e, &ran, err);
    if (st == DI_OK && s->grp && !ran)
        st = engsvc_ep_step_end(s, err);
    if (s->cfg.step_delay_ms && ran) { /* testing only: a slow rank on purpose */
        struct timespec ds = {(time_t)(s->cfg.step_delay_ms / 1000),
                              (long)(s->cfg.step_delay_ms % 1000) * 1000000L};
        nanosleep(&ds, NULL);
    }
    if (st == DI_OK && !engine_has_work(s->e))
        st = engine_flush(s->e, err);
    uint64_t dt = di_mono_ns() - t0;
    const sched_stats *ss = sched_get_stats(engine_sched(s->e));
    if (ss->prefill_tokens > p0) {
        s->prefill_tokens += ss->prefill_tokens - p0;
        loadrate_add(&s->prefill_rate, t0 + dt, (double)(ss->prefill_tokens - p0), dt);
    }
    else if (ss->decode_steps > d0)
        loadrate_add(&s->decode_rate, t0 + dt, (double)(ss->decode_steps - d0), dt);
    return st;
}

static void *engine_main(void *arg)
{
    engsvc *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        /* a rank of a group waits at most idle_ms, then votes: the others may have work */
        bool grp = s->grp && !s->broken;
        uint64_t vote_at = di_mono_ns() + (uint64_t)s->ep.idle_ms * 1000000u;
        while (!s->inbox && !s->stopping && !s->abort_all &&
               !(engine_has_work(s->e) && !s->broken) && !s->kv_note &&
               !(grp && (s->group_busy || di_mono_ns() >= vote_at))) {
            bool cancels = false;
            for (sreq *r = s->reqs; r && !cancels; r = r->next)
                cancels = atomic_load(&r->cancelled);
            if (cancels)
                break;
            struct timespec ts = di_realtime_in_ms(grp && s->ep.idle_ms < 20 ? s->ep.idle_ms
                                                                             : 20);
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        }
        bool broken = s->broken;
        s->kv_note = false;
        sreq *in = s->inbox;
        s->inbox = s->inbox_tail = NULL;
        s->n_inbox = 0;
        bool stopping = s->stopping, abort_all = s->abort_all || stopping;
        pthread_mutex_unlock(&s->mu);
        while (in) {
            sreq *r = in;
            in = in->next;
            r->next = NULL;
            if (abort_all || broken || atomic_load(&r->cancelled)) {
                if (s->cfg.kind == ENGSVC_DECODE)
                    engsvc_drop_handoff(s, r);
                char msg[300];
                snprintf(msg, sizeof msg, "%s", abort_all ? "the service is stopping"
                                                : atomic_load(&r->cancelled) ? "request cancelled"
                                                                             : s->broken_msg);
                engsvc_end_req(s, r, abort_all || !atomic_load(&r->cancelled) ? DI_EUNAVAIL
                                                                                : DI_ECANCELED,
                               NULL, 0, msg);
                continue;
            }
            admit(s, r);
        }
        engsvc_take_events(s);
        reap_cancels(s, abort_all);
        if (abort_all) {
            pthread_mutex_lock(&s->mu);
            s->abort_all = false;
            pthread_mutex_unlock(&s->mu);
        }
        if (stopping) {
            di_error err;
            engine_flush(s->e, &err);
            /* the store calls still out end their requests; bounded by their deadlines */
            uint64_t until = di_mono_ns() + 60000000000ull;
            while (s->reqs && di_mono_ns() < until) {
                (void)kvcache_wait(s->kc, 100000000ull, &err);
                engsvc_take_events(s);
                reap_cancels(s, true);
            }
            /* the deletes and stores still out: finished (or given their deadlines) */
            (void)kvcache_wait(s->kc, 10000000000ull, &err);
            engsvc_take_events(s);
            publish_load(s);
            engsvc_ep_leave(s);
            return NULL;
        }
        bool work = !broken && engine_has_work(s->e);
        if (s->grp && !broken) {
            di_error err;
            uint32_t leaver;
            di_status st = engsvc_ep_vote(s, work, false, &s->group_busy, &leaver, &err);
            if (st != DI_OK) {
                fail_all(s, st, err.msg, DI_LOG_ERROR);
                continue;
            }
            if (leaver != UINT32_MAX && !s->group_busy) { /* it leaves now: the group ends */
                pthread_mutex_lock(&s->mu);
                bool quiet = s->draining;
                pthread_mutex_unlock(&s->mu);
                char msg[200];
                snprintf(msg, sizeof msg, "rank group (rank %u of %u): rank %u left the group "
                         "(it stopped)", s->cfg.rank, s->cfg.world, leaver);
                fail_all(s, DI_EUNAVAIL, msg, quiet ? DI_LOG_INFO : DI_LOG_WARN);
                continue;
            }
            work = s->group_busy;
        }
        if (work || (s->cfg.ahead && !broken)) {
            /* one step ahead, no work left (an abort took the last request): the step in
             * flight is processed, so what it carries is released */
            di_error err;
            di_status st = work ? step(s, &err) : engine_flush(s->e, &err);
            if (st != DI_OK) { /* the engine is unusable: fail everything, refuse the rest */
                fail_all(s, st, err.msg, DI_LOG_ERROR);
                continue;
            }
        }
        for (sreq *r = s->reqs, *next; r; r = next) {
            next = r->next;
            if (r->handed) {
                r->handed = false;
                engsvc_handoff_submit(s, r);
            } else if (r->done && s->cfg.kind == ENGSVC_PREFILL)
                prefill_done(s, r);
            else if (r->done) {
                engsvc_unlink(s, r);
                if (r->finish == SCHED_FINISH_FAILED)
                    engsvc_end_req(s, r, r->fail, NULL, 0, r->fail_msg);
                else if (r->finish == SCHED_FINISH_ABORT)
                    engsvc_end_req(s, r, DI_ECANCELED, NULL, 0, "aborted");
                else
                    engsvc_end_req(s, r, DI_OK, NULL, 0, NULL);
            }
        }
        publish_load(s);
    }
}

/* ---- the executor: the runner's step, then the cache's copies of what it computed ---- */

static di_status svc_exec_add(void *ctx, const sched_request *req, const void *args,
                              di_error *err)
{
    engsvc *s = ctx;
    return s->rx.add(s->rx.ctx, req, args, err);
}

static void svc_exec_remove(void *ctx, uint64_t id)
{
    engsvc *s = ctx;
    s->rx.remove(s->rx.ctx, id);
}

static di_status svc_exec_step(void *ctx, const sched_plan *plan, sched_seq_result *results,
                               di_error *err)
{
    engsvc *s = ctx;
    di_status st = s->rx.step(s->rx.ctx, plan, results, err);
    if (st == DI_OK)
        st = kvcache_after_step(s->kc, runner_exec_kv(s->ex), plan, results, err);
    if (st == DI_OK && s->grp) /* the group step ends with this rank's forward */
        st = engsvc_ep_step_end(s, err);
    return st;
}

/* One step ahead: the runner's issue. A plan issued ahead runs before the collect of the one
 * in flight, whose KV copies (kvcache_after_step) then read the slot one position later: a
 * decode step without drafts writes position p when its predecessor reached p, and a window
 * state at p stays exact until the slot has processed p + (ring_positions - window), nextn + 1
 * spare ring slots (kv_io.h); completed blocks are not written again. */
static di_status svc_exec_issue(void *ctx, const sched_plan *plan, bool ahead, bool *issued,
                                di_error *err)
{
    engsvc *s = ctx;
    return s->rx.issue(s->rx.ctx, plan, ahead, issued, err);
}

/* The runner's collect, then the service's work after the step (as svc_exec_step). */
static di_status svc_exec_collect(void *ctx, const sched_plan *plan,
                                  sched_seq_result *results, di_error *err)
{
    engsvc *s = ctx;
    di_status st = s->rx.collect(s->rx.ctx, plan, results, err);
    if (st == DI_OK)
        st = kvcache_after_step(s->kc, runner_exec_kv(s->ex), plan, results, err);
    return st;
}

/* A transfer job finished (transfer thread): wake the engine thread. */
static void kv_notify(void *ud)
{
    engsvc *s = ud;
    pthread_mutex_lock(&s->mu);
    s->kv_note = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* ---- lifecycle -------------------------------------------------------------------------- */

di_status engsvc_create(const engsvc_config *cfg, engsvc **out, di_error *err)
{
    if (!cfg || !cfg->rm || !cfg->rm->w || !cfg->be || !cfg->kv || !out)
        return di_fail(err, DI_EINVAL, "engine service: model, backend and store required");
    engsvc *s = calloc(1, sizeof(*s));
    if (!s)
        return di_fail(err, DI_ENOMEM, "engine service");
    s->cfg = *cfg;
    engsvc_config *c = &s->cfg;
    const model_config *mc = &cfg->rm->w->config;
    if (c->nextn == UINT32_MAX)
        c->nextn = mc->n_mtp ? mc->dspark_block_size : 0;
    if (c->nextn && !mc->n_mtp)
        c->nextn = 0;
    c->chunk = c->chunk ? c->chunk : 512;
    c->max_seqs = c->max_seqs ? c->max_seqs : 16;
    c->num_blocks = c->num_blocks ? c->num_blocks : 1024;
    c->max_waiting = c->max_waiting ? c->max_waiting : 256;
    c->world = c->world ? c->world : 1;
    c->ahead = c->ahead || c->overlap;
    if (c->ahead && (cfg->kind != ENGSVC_DECODE || cfg->ep || c->nextn)) {
        free(s);
        return di_fail(err, DI_EINVAL, "engine service: one step ahead is for a decode "
                       "service of one rank without drafts (nextn 0)");
    }
    s->t0 = di_mono_ns();
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    sched_config sc;
    sched_config_default(&sc);
    sc.type = cfg->kind == ENGSVC_PREFILL ? SCHED_PROMPT : SCHED_COMPLETION;
    sc.prefill_attempt_interval = 1;
    sc.max_num_batched_tokens = c->chunk;
    sc.max_num_seqs = c->max_seqs;
    sc.max_model_len = mc->max_position_embeddings < UINT32_MAX
                           ? (uint32_t)mc->max_position_embeddings : UINT32_MAX;
    sc.nextn = c->nextn;
    sc.num_blocks = c->num_blocks;
    sc.num_slots = c->max_seqs + 1;
    sc.max_waiting = c->max_waiting;
    sc.eos_token = (int32_t)mc->eos_token_id;
    sc.pad_token = (int32_t)mc->pad_token_id;
    sc.vocab_size = mc->vocab_size;
    sc.async = c->ahead;
    uint32_t rows = c->chunk > c->max_seqs * (1 + c->nextn) ? c->chunk
                                                            : c->max_seqs * (1 + c->nextn);
    if (c->nextn && rows < c->max_seqs * mc->dspark_block_size)
        rows = c->max_seqs * mc->dspark_block_size;
    /* prompt rows truncated as every engine does by default (the KV id includes the mode) */
    uint32_t ring = kv_ring_positions_for(mc->window, c->nextn, 0);
    runner_exec_options eo = {.fwd = {.nextn = c->nextn, .max_rows = rows,
                                      .yoco = FWD_YOCO_DEFAULT,
                                      .keep_tokens = ring > 140 ? ring : 140},
                              .n_blocks = sc.num_blocks, .n_slots = sc.num_slots,
                              .on_load = on_load, .load_userdata = s,
                              .ahead = c->ahead, .overlap = c->overlap};
    di_status st = engsvc_ep_open(s, &eo.fwd, err);
    if (st == DI_OK)
        st = runner_exec_create(cfg->rm, cfg->be, &eo, &s->ex, err);
    if (st == DI_OK) {
        s->g = *fwd_model_geometry(runner_exec_model(s->ex));
        /* prompts cut at every multiple of 128, so that the window state there can be copied
         * while the ring still holds it (kvcache.h) */
        if (cfg->kind == ENGSVC_PREFILL)
            sc.max_chunk_tokens = s->g.block_tokens;
        kvcache_options ko = {.client = cfg->kv, .load_client = cfg->kv_load,
                              .target = cfg->kv_target,
                              .always_compute = eo.fwd.keep_tokens > s->g.ring_positions
                                                    ? eo.fwd.keep_tokens : s->g.ring_positions,
                              .store_prompt = cfg->kind == ENGSVC_PREFILL,
                              .store_response = cfg->kind == ENGSVC_DECODE,
                              .max_jobs = 4 * (c->max_waiting + c->max_seqs) + 64,
                              .backoff_ns = cfg->kv_backoff_ns,
                              .max_backoff_ns = cfg->kv_max_backoff_ns,
                              .log = cfg->log, .notify = kv_notify, .notify_ud = s};
        st = kvcache_create(&ko, &s->g, &s->kc, err);
    }
    if (st == DI_OK) {
        s->rx = runner_exec_executor(s->ex);
        engine_config ec = {.sched = sc, .exec = {.ctx = s, .add = svc_exec_add,
                                                  .remove = svc_exec_remove,
                                                  .step = svc_exec_step,
                                                  .issue = c->ahead ? svc_exec_issue : NULL,
                                                  .collect = c->ahead ? svc_exec_collect
                                                                      : NULL},
                            .on_output = on_output, .userdata = s};
        st = engine_create(&ec, &s->e, err);
    }
    if (st == DI_OK) {
        publish_load(s);
        if (pthread_create(&s->thr, NULL, engine_main, s) != 0)
            st = di_fail(err, DI_EINTERNAL, "engine thread");
        else
            s->thr_started = true;
    }
    if (st != DI_OK) {
        engsvc_destroy(s);
        return st;
    }
    *out = s;
    return DI_OK;
}

void engsvc_destroy(engsvc *s)
{
    if (!s)
        return;
    if (s->thr_started) {
        pthread_mutex_lock(&s->mu);
        s->stopping = true;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->thr, NULL);
    }
    engine_destroy(s->e);
    kvcache_destroy(s->kc);
    runner_exec_free(s->ex);
    engsvc_ep_close(s);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

uint32_t engsvc_live(engsvc *s)
{
    pthread_mutex_lock(&s->mu);
    uint32_t n = s->live;
    pthread_mutex_unlock(&s->mu);
    return n;
}

uint32_t engsvc_drain(engsvc *s, uint64_t deadline_ns)
{
    pthread_mutex_lock(&s->mu);
    s->draining = true;
    while (s->live && di_mono_ns() < deadline_ns) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    uint32_t left = s->live;
    if (left) {
        s->abort_all = true;
        pthread_cond_broadcast(&s->cv);
        while (s->live)
            pthread_cond_wait(&s->cv, &s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return left;
}
