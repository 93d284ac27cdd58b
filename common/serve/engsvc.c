#include "common/serve/engsvc.h"

#include <stdlib.h>
#include <string.h>

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

/* Deletes request r's handoff from the store (decode ends before loading it, or prefill's
 * caller is gone): nobody will take it. */
void engsvc_drop_handoff(engsvc *s, const sreq *r)
{
    kvkey key;
    di_error err;
    if (kvkey_handoff(s->g.model_id, r->rid, &key, &err) == DI_OK)
        (void)kvc_delete1(s->cfg.kv, KVKEY_HANDOFF, &key, &err);
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

/* The store that holds a handoff and when it expires at the latest: its TTL counts from the
 * commit, which came before now. Decode names the cause of a miss from them. */
static void handoff_expiry(engsvc *s, Di__Prefill__HandoffManifest *man)
{
    kvc_store_info si;
    di_error err;
    if (kvc_info(s->cfg.kv, &si, &err) != DI_OK)
        return;
    man->store_id = si.store_id;
    if (si.ttl_ms[KVKEY_HANDOFF])
        man->handoff_expires_ms = di_wall_ms() + si.ttl_ms[KVKEY_HANDOFF];
}

/* DECODE: why the handoff is not in the store, from its manifest. */
static di_status handoff_missing(engsvc *s, const sreq *r, di_error *err)
{
    kvc_store_info si;
    di_error ie;
    uint64_t now = di_wall_ms();
    if (r->hstore && kvc_info(s->cfg.kv, &si, &ie) == DI_OK && si.store_id != r->hstore)
        return di_fail(err, DI_ENOENT, "the handoff is not in the store: the store restarted "
                       "after prefill put it there (store %016llx, then %016llx)",
                       (unsigned long long)r->hstore, (unsigned long long)si.store_id);
    if (r->hexpires_ms && now >= r->hexpires_ms)
        return di_fail(err, DI_ENOENT, "the handoff expired in the store (its handoff TTL) "
                       "%llu ms before decode asked for it",
                       (unsigned long long)(now - r->hexpires_ms));
    return di_fail(err, DI_ENOENT, "the handoff is not in the store (expired, or already "
                   "taken)");
}

/* PREFILL: the handoff into the store, then the reply. */
static void prefill_handoff(engsvc *s, sreq *r)
{
    di_error err;
    kvkey key;
    size_t cap = handoff_max_bytes(s->ex, r->prompt_len + 1), bytes = 0;
    void *obj = aligned_alloc(8, (cap + 7) / 8 * 8);
    uint8_t *blk = malloc(kv_block_bytes(&s->g));
    kv_handoff h;
    uint32_t n_full = 0;
    kvc_item *items = NULL;
    void **bufs = NULL;
    di_status st = obj && blk ? DI_OK : di_fail(&err, DI_ENOMEM, "handoff buffers");
    if (st == DI_OK)
        st = kvkey_handoff(s->g.model_id, r->rid, &key, &err);
    if (st == DI_OK)
        st = handoff_export(s->e, s->ex, r->id, key.b, obj, cap, &bytes, &n_full, &err);
    if (st == DI_OK)
        st = kv_handoff_read(&s->g, obj, bytes, key.b, &h, &err);
    /* the full blocks, in batches of KVC_MAX_BATCH */
    if (st == DI_OK && n_full) {
        items = calloc(n_full, sizeof(kvc_item));
        bufs = calloc(n_full, sizeof(void *));
        if (!items || !bufs)
            st = di_fail(&err, DI_ENOMEM, "blocks");
        for (uint32_t i = 0; st == DI_OK && i < n_full; i++) {
            bufs[i] = aligned_alloc(8, kv_block_bytes(&s->g));
            if (!bufs[i]) {
                st = di_fail(&err, DI_ENOMEM, "block %u", i);
                break;
            }
            st = handoff_block(s->e, s->ex, r->id, &h, i, bufs[i], kv_block_bytes(&s->g), &err);
            items[i] = (kvc_item){.cls = KVKEY_BLOCK, .buf = bufs[i],
                                  .cap = kv_block_bytes(&s->g)};
            memcpy(items[i].key.b, h.block_keys + (size_t)i * 32, 32);
        }
        for (uint32_t i0 = 0; st == DI_OK && i0 < n_full; i0 += KVC_MAX_BATCH) {
            uint32_t k = n_full - i0 < KVC_MAX_BATCH ? n_full - i0 : KVC_MAX_BATCH;
            st = kvc_put(s->cfg.kv, items + i0, k, &err);
            for (uint32_t i = i0; st == DI_OK && i < i0 + k; i++)
                if (items[i].status != DI_OK && items[i].status != DI_EEXIST) {
                    st = items[i].status;
                    err = items[i].error;
                }
        }
    }
    if (st == DI_OK) {
        st = kvc_put1(s->cfg.kv, KVKEY_HANDOFF, &key, obj, bytes, &err);
        if (st == DI_EEXIST)
            st = di_fail(&err, DI_EEXIST, "a handoff for request_id %s is already stored",
                         r->rid);
    }
    di_error rel;
    engine_release(s->e, r->id, &rel);
    engsvc_unlink(s, r);
    if (st == DI_OK && atomic_load(&r->cancelled)) { /* the caller is gone */
        engsvc_drop_handoff(s, r);
        engsvc_end_req(s, r, (di_status)atomic_load(&r->cancel_why), NULL, 0, "request cancelled");
    } else if (st != DI_OK) {
        di_error_prefix(&err, "handoff to the store: ");
        engsvc_end_req(s, r, st, NULL, 0, err.msg);
    } else {
        Di__Engine__Token tok;
        Di__Engine__TokenLogprob tops[SAMPLER_MAX_LOGPROBS], *ptrs[SAMPLER_MAX_LOGPROBS];
        engsvc_token_pb(&tok, tops, ptrs, r->first.token, &r->first.res, 0);
        Di__Prefill__HandoffManifest man = DI__PREFILL__HANDOFF_MANIFEST__INIT;
        ProtobufCBinaryData *keys = calloc(n_full ? n_full : 1, sizeof(*keys));
        for (uint32_t i = 0; keys && i < n_full; i++)
            keys[i] = (ProtobufCBinaryData){32, (uint8_t *)h.block_keys + (size_t)i * 32};
        man.model_id = s->g.model_id;
        man.prompt_tokens = r->prompt_len;
        man.block_tokens = s->g.block_tokens;
        man.n_block_keys = keys ? n_full : 0;
        man.block_keys = keys;
        man.handoff_key = (ProtobufCBinaryData){32, key.b};
        man.handoff_bytes = bytes;
        handoff_expiry(s, &man);
        Di__Prefill__PrefillReply rep = DI__PREFILL__PREFILL_REPLY__INIT;
        rep.request_id = r->rid;
        rep.first = &tok;
        rep.finish = DI__ENGINE__FINISH__FINISH_NONE;
        rep.handoff = &man;
        rep.cached_tokens = r->cached;
        rep.queue_ms = (r->t_start - r->t_arrive) / 1000000u;
        rep.compute_ms = (di_mono_ns() - r->t_start) / 1000000u;
        size_t n = di__prefill__prefill_reply__get_packed_size(&rep);
        uint8_t *buf = malloc(n ? n : 1);
        if (buf) {
            n = di__prefill__prefill_reply__pack(&rep, buf);
            engsvc_end_req(s, r, DI_OK, buf, n, NULL);
        } else {
            engsvc_end_req(s, r, DI_ENOMEM, NULL, 0, "reply");
        }
        free(buf);
        free(keys);
    }
    for (uint32_t i = 0; bufs && i < n_full; i++)
        free(bufs[i]);
    free(bufs);
    free(items);
    free(obj);
    free(blk);
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

/* DECODE: the handoff and its blocks from the store, checked against the request. */
static di_status decode_fetch(engsvc *s, sreq *r, di_error *err)
{
    kvkey key;
    memcpy(key.b, r->hkey, KVKEY_BYTES);
    uint64_t cap = r->hbytes, bytes = 0, t0 = di_mono_ns();
    di_status st = kvc_get1(s->cfg.kv, KVKEY_HANDOFF, &key, r->hobj, cap, &bytes, err);
    if (st == DI_ENOENT)
        return handoff_missing(s, r, err);
    if (st != DI_OK) {
        di_error_prefix(err, "pulling the handoff from the store: ");
        return st;
    }
    st = kv_handoff_read(&s->g, r->hobj, bytes, key.b, &r->h, err);
    if (st != DI_OK)
        return st;
    const kv_handoff *h = &r->h;
    if (h->prompt_len != r->prompt_len ||
        memcmp(h->tokens, r->prompt, r->prompt_len * sizeof(int32_t)) != 0 ||
        h->n_output < 1 || h->tokens[h->prompt_len] != r->first_tok)
        return di_fail(err, DI_EINVAL, "the handoff is not this request's (prompt or first "
                       "token differ)");
    if (h->n_output >= r->max_tokens)
        return di_fail(err, DI_EINVAL, "sampling.max_tokens: %u, the handoff has %u tokens "
                       "already", r->max_tokens, h->n_output);
    r->n_full = h->kv_positions / s->g.block_tokens;
    r->blocks = calloc(r->n_full + 1, sizeof(void *));
    r->bsz = calloc(r->n_full + 1, sizeof(size_t));
    kvc_item *items = calloc(r->n_full + 1, sizeof(kvc_item));
    if (!r->blocks || !r->bsz || !items) {
        free(items);
        return di_fail(err, DI_ENOMEM, "blocks");
    }
    size_t bb = kv_block_bytes(&s->g);
    for (uint32_t i = 0; i < r->n_full; i++) {
        r->blocks[i] = aligned_alloc(8, bb);
        if (!r->blocks[i]) {
            free(items);
            return di_fail(err, DI_ENOMEM, "block %u", i);
        }
        items[i] = (kvc_item){.cls = KVKEY_BLOCK, .buf = r->blocks[i], .cap = bb};
        memcpy(items[i].key.b, h->block_keys + (size_t)i * 32, 32);
    }
    st = DI_OK;
    for (uint32_t i0 = 0; st == DI_OK && i0 < r->n_full; i0 += KVC_MAX_BATCH) {
        uint32_t k = r->n_full - i0 < KVC_MAX_BATCH ? r->n_full - i0 : KVC_MAX_BATCH;
        st = kvc_get(s->cfg.kv, items + i0, k, err);
        if (st != DI_OK)
            di_error_prefix(err, "pulling blocks %u..%u from the store: ", i0, i0 + k - 1);
        for (uint32_t i = i0; st == DI_OK && i < i0 + k; i++) {
            if (items[i].status != DI_OK) {
                st = items[i].status;
                *err = items[i].error;
                di_error_prefix(err, "block %u from the store: ", i);
            }
            r->bsz[i] = items[i].bytes;
        }
    }
    free(items);
    r->pulled_bytes = bytes + (uint64_t)r->n_full * bb;
    r->pull_ns = di_mono_ns() - t0;
    return st;
}

static di_status on_load(void *ud, fwd_kv *kv, const sched_seq_plan *p, di_error *err)
{
    engsvc *s = ud;
    for (sreq *r = s->reqs; r; r = r->next)
        if (r->id == p->request_id)
            return handoff_load(kv, p, &r->h, (const void *const *)r->blocks, r->bsz, err);
    return di_fail(err, DI_EINTERNAL, "load of request %llu: no such request",
                   (unsigned long long)p->request_id);
}

/* Adds a queued request to the engine (engine thread). */
static void admit(engsvc *s, sreq *r)
{
    di_error err;
    di_status st = DI_OK;
    r->id = ++s->next_id;
    pthread_mutex_lock(&s->mu);
    r->next = s->reqs;
    s->reqs = r;
    pthread_mutex_unlock(&s->mu);
    if (s->cfg.kind == ENGSVC_PREFILL) {
        runner_request rq = {.id = r->id, .prompt = r->prompt, .prompt_len = r->prompt_len,
                             .max_tokens = r->max_tokens, .params = r->sp};
        sched_request sr = {.id = r->id, .prompt = r->prompt, .prompt_len = r->prompt_len,
                            .max_tokens = r->max_tokens, .stop_ids = r->stop_ids,
                            .n_stop_ids = r->n_stop, .ignore_eos = r->ignore_eos,
                            .arrival_ns = r->t_arrive};
        st = engine_add(s->e, &sr, &rq, r, &err);
    } else {
        st = decode_fetch(s, r, &err);
        if (st == DI_OK) {
            sched_request sr;
            runner_request rq;
            handoff_requests(&r->h, r->id, &sr, &rq);
            sr.max_tokens = rq.max_tokens = r->max_tokens;
            sr.stop_ids = r->stop_ids;
            sr.n_stop_ids = r->n_stop;
            sr.ignore_eos = r->ignore_eos;
            sr.arrival_ns = r->t_arrive;
            rq.params = r->sp;
            r->n_out = r->h.n_output;
            st = engine_add(s->e, &sr, &rq, r, &err);
            if (st == DI_OK)
                st = engine_set_ready(s->e, r->id, &err);
        }
        if (st == DI_OK || st == DI_ECORRUPT) /* in host memory now, or useless */
            engsvc_drop_handoff(s, r);
    }
    if (st != DI_OK) {
        engsvc_unlink(s, r);
        engsvc_end_req(s, r, st, NULL, 0, err.msg);
        return;
    }
    r->in_engine = true;
}

/* Ends cancelled requests; with abort_all, every request (the drain's deadline passed). */
static void reap_cancels(engsvc *s, bool abort_all)
{
    sreq *r = s->reqs;
    while (r) {
        sreq *next = r->next;
        if (atomic_load(&r->cancelled) || abort_all) {
            di_error err;
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
    for (sreq *r = s->reqs; r; r = r->next)
        if (s->cfg.kind == ENGSVC_PREFILL && !r->t_start)
            queued += r->prompt_len;
    pthread_mutex_lock(&s->mu);
    s->queued_prompt_tokens = queued;
    s->running = sched_num_running(q);
    s->waiting = sched_num_waiting(q);
    s->free_blocks = sched_free_blocks(q);
    s->total_blocks = sched_usable_blocks(q);
    s->free_slots = sched_free_slots(q);
    s->total_slots = sched_get_config(q)->num_slots;
    uint64_t now = di_mono_ns();
    double steps_per_s = loadrate_per_s(&s->decode_rate, now);
    s->prefill_tps = loadrate_per_s(&s->prefill_rate, now);
    s->decode_ms = steps_per_s > 0 ? 1e3 / steps_per_s : 0;
    pthread_mutex_unlock(&s->mu);
}

static void *engine_main(void *arg)
{
    engsvc *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->inbox && !s->stopping && !s->abort_all && !engine_has_work(s->e)) {
            bool cancels = false;
            for (sreq *r = s->reqs; r && !cancels; r = r->next)
                cancels = atomic_load(&r->cancelled);
            if (cancels)
                break;
            struct timespec ts = di_realtime_in_ms(20);
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        }
        sreq *in = s->inbox;
        s->inbox = s->inbox_tail = NULL;
        s->n_inbox = 0;
        bool stopping = s->stopping, abort_all = s->abort_all || stopping;
        pthread_mutex_unlock(&s->mu);
        while (in) {
            sreq *r = in;
            in = in->next;
            r->next = NULL;
            if (abort_all || atomic_load(&r->cancelled)) {
                if (s->cfg.kind == ENGSVC_DECODE)
                    engsvc_drop_handoff(s, r);
                engsvc_end_req(s, r, abort_all ? DI_EUNAVAIL : DI_ECANCELED, NULL, 0,
                        abort_all ? "the service is stopping" : "request cancelled");
                continue;
            }
            admit(s, r);
        }
        reap_cancels(s, abort_all);
        if (abort_all) {
            pthread_mutex_lock(&s->mu);
            s->abort_all = false;
            pthread_mutex_unlock(&s->mu);
        }
        if (stopping) {
            di_error err;
            engine_flush(s->e, &err);
            publish_load(s);
            return NULL;
        }
        if (engine_has_work(s->e)) {
            for (sreq *r = s->reqs; r; r = r->next)
                if (!r->t_start)
                    r->t_start = di_mono_ns();
            di_error err;
            uint64_t t0 = di_mono_ns(), p0 = sched_get_stats(engine_sched(s->e))->prefill_tokens;
            uint64_t d0 = sched_get_stats(engine_sched(s->e))->decode_steps;
            di_status st = engine_step(s->e, NULL, &err);
            if (st == DI_OK && !engine_has_work(s->e))
                st = engine_flush(s->e, &err);
            uint64_t dt = di_mono_ns() - t0;
            const sched_stats *ss = sched_get_stats(engine_sched(s->e));
            if (ss->prefill_tokens > p0)
                loadrate_add(&s->prefill_rate, t0 + dt, (double)(ss->prefill_tokens - p0), dt);
            else if (ss->decode_steps > d0)
                loadrate_add(&s->decode_rate, t0 + dt, (double)(ss->decode_steps - d0), dt);
            if (st != DI_OK) { /* the engine is unusable: fail everything, refuse the rest */
                if (s->cfg.log)
                    di_log(s->cfg.log, DI_LOG_ERROR, "engine step failed: %s", err.msg);
                pthread_mutex_lock(&s->mu);
                s->draining = true;
                pthread_mutex_unlock(&s->mu);
                while (s->reqs) {
                    sreq *r = s->reqs;
                    engsvc_unlink(s, r);
                    engsvc_end_req(s, r, st, NULL, 0, err.msg);
                }
                continue;
            }
        }
        for (sreq *r = s->reqs, *next; r; r = next) {
            next = r->next;
            if (r->handed)
                prefill_handoff(s, r);
            else if (r->done && s->cfg.kind == ENGSVC_PREFILL)
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
                              .on_load = on_load, .load_userdata = s};
    di_status st = runner_exec_create(cfg->rm, cfg->be, &eo, &s->ex, err);
    if (st == DI_OK) {
        s->g = *fwd_model_geometry(runner_exec_model(s->ex));
        engine_config ec = {.sched = sc, .exec = runner_exec_executor(s->ex),
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
    runner_exec_free(s->ex);
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
