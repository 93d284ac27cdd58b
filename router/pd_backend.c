/* pd_backend.c: the prefill/decode client behind the router (see pd_backend.h). */
#include "router/pd_backend.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/kvfmt/kv_keys.h"
#include "common/util/clock.h"
#include "decode.pb-c.h"
#include "prefill.pb-c.h"

#define PD_MAX_CONTINUES 2 /* continuations of one request on another decode rank */

struct pd_backend {
    pd_config cfg;
    pthread_mutex_t mu;      /* guards the list, the counters and every request's cur/aborted */
    pthread_cond_t cv;       /* signalled when a request ends */
    pthread_t sweeper;       /* cancels prefill calls on ranks that left rotation */
    bool sweeping, stop_sweep;
    struct pd_req *head;     /* requests running */
    uint64_t next_handle, started, retries, running;
    uint64_t nonce;          /* makes request ids unique across router restarts */
    pthread_mutex_t store_mu; /* one store call at a time; guards the geometry below */
    bool have_geometry;
    uint64_t model_id;       /* the store's model id, for the chain keys */
    uint32_t store_block;    /* the store's tokens per block */
    uint64_t store_hits;     /* cached tokens found, summed */
};

/* What a request has when its calls end. */
typedef struct outcome {
    Di__Prefill__PrefillReply *pre; /* the prefill reply (unpacked) */
    Di__Engine__Finish finish;      /* from the last message */
} outcome;

/* One request. prompt is a copy; cur is the call in flight (under b->mu), cancelled by abort. */
typedef struct pd_req {
    pd_backend *b;
    uint64_t handle;
    rt_gen_req req;
    int32_t *prompt;
    rt_gen_cb cb;
    bool aborted;
    rpc_stream *cur;
    long prefill_rank;       /* rank index of the prefill call in flight, -1: none (b->mu) */
    bool rank_lost;          /* that call was cancelled because its rank left rotation */
    char id[64];
    size_t id_len;           /* length of the first id; a continuation appends "-cN" */
    uint32_t n_out;          /* tokens relayed */
    int32_t *out_ids;        /* the ids relayed, n_ids of them (n_ids < n_out: out of memory) */
    uint32_t n_ids, ids_cap;
    uint32_t continues;      /* continuations on another decode rank so far */
    uint32_t suffixes;       /* request ids used past the first ("-c1".."-cN") */
    outcome out;             /* what the calls brought (the request thread's) */
    struct pd_req *next;
} pd_req;

/* ---- the store: cached tokens of a prompt ---- */

/* Tokens of the prompt's leading full blocks the store holds; 0 without a store or when the
 * lookup fails (logged at debug). */
static uint32_t store_lookup(pd_backend *b, const int32_t *p, size_t n)
{
    if (!b->cfg.store)
        return 0;
    uint32_t cached = 0;
    di_error e = {0};
    pthread_mutex_lock(&b->store_mu);
    if (!b->have_geometry) {
        kvc_store_info info;
        if (kvc_info(b->cfg.store, &info, &e) == DI_OK && info.geometry.block_tokens > 0) {
            b->model_id = info.geometry.model_id;
            b->store_block = info.geometry.block_tokens;
            b->have_geometry = true;
        }
    }
    if (b->have_geometry && n >= b->store_block) {
        size_t m = n / b->store_block, nk = 0, nw = 0;
        if (m > KVC_MAX_LOOKUP)
            m = KVC_MAX_LOOKUP;
        kvkey *keys = malloc(m * sizeof *keys);
        uint32_t *win = malloc((m + 1) * sizeof *win);
        uint32_t hit = 0;
        if (keys && win &&
            kvkey_chain(b->model_id, b->store_block, p, n, keys, m, &nk, &e) == DI_OK &&
            kvc_lookup(b->cfg.store, keys, nk, &hit, win, m + 1, &nw, &e) == DI_OK)
            cached = hit * b->store_block;
        free(keys);
        free(win);
    }
    pthread_mutex_unlock(&b->store_mu);
    if (e.msg[0] && b->cfg.log)
        di_log(b->cfg.log, DI_LOG_DEBUG, "store lookup: %s (counting 0 cached tokens)", e.msg);
    return cached;
}

static uint32_t cached_tokens(pd_backend *b, const int32_t *p, size_t n)
{
    uint32_t cached = store_lookup(b, p, n);
    pthread_mutex_lock(&b->store_mu);
    b->store_hits += cached;
    pthread_mutex_unlock(&b->store_mu);
    return cached;
}

/* ---- calls ---- */

typedef di_status (*msg_fn)(pd_req *q, const uint8_t *m, size_t n, di_error *err);

/* One server-streaming call (a unary method is the same on the wire: one message), with each
 * message handed to fn. Returns the call's final status, or fn's failure. */
static di_status run_call(pd_req *q, rpc_client *c, const char *method, const void *req,
                          size_t len, uint32_t timeout_ms, msg_fn fn, di_error *err)
{
    pd_backend *b = q->b;
    rpc_stream *s = NULL;
    di_status st = rpc_stream_open(c, method, req, len, timeout_ms, &s, err);
    if (st != DI_OK)
        return st;
    pthread_mutex_lock(&b->mu);
    q->cur = s;
    if (q->aborted)
        rpc_stream_cancel(s);
    pthread_mutex_unlock(&b->mu);
    for (;;) {
        uint8_t *m = NULL;
        size_t n = 0;
        int done = 0;
        st = rpc_stream_read(s, &m, &n, &done, err);
        if (done) {
            free(m);
            break;
        }
        st = fn(q, m, n, err);
        free(m);
        if (st != DI_OK) {
            rpc_stream_cancel(s);
            break;
        }
    }
    pthread_mutex_lock(&b->mu);
    q->cur = NULL;
    pthread_mutex_unlock(&b->mu);
    rpc_stream_close(s);
    return st;
}

static bool is_aborted(pd_req *q)
{
    pthread_mutex_lock(&q->b->mu);
    bool a = q->aborted;
    pthread_mutex_unlock(&q->b->mu);
    return a;
}

static void relay(pd_req *q, const Di__Engine__Token *tk)
{
    rt_gen_token t = {.id = (int32_t)tk->id, .logprob = tk->logprob};
    for (size_t k = 0; k < tk->n_top && k < RT_MAX_TOP && k < q->req.top_logprobs; k++) {
        t.top_ids[k] = (int32_t)tk->top[k]->id;
        t.top_lps[k] = tk->top[k]->logprob;
        t.n_top++;
    }
    if (q->n_ids == q->n_out) { /* kept for a continuation's prefill */
        if (q->n_ids == q->ids_cap) {
            uint32_t cap = q->ids_cap ? 2 * q->ids_cap : 64;
            int32_t *v = realloc(q->out_ids, cap * sizeof *v);
            if (v)
                q->out_ids = v, q->ids_cap = cap;
        }
        if (q->n_ids < q->ids_cap)
            q->out_ids[q->n_ids++] = t.id;
    }
    q->n_out++;
    q->cb.on_token(q->cb.ud, &t);
}

static di_status on_prefill_msg(pd_req *q, const uint8_t *m, size_t n, di_error *err)
{
    if (q->out.pre)
        return di_fail(err, DI_EPROTO, "Prefill sent more than one reply");
    q->out.pre = di__prefill__prefill_reply__unpack(NULL, n, m);
    if (!q->out.pre || !q->out.pre->first)
        return di_fail(err, DI_EPROTO, "PrefillReply does not parse or has no first token");
    return DI_OK;
}

static di_status on_decode_msg(pd_req *q, const uint8_t *m, size_t n, di_error *err)
{
    Di__Decode__DecodeToken *d = di__decode__decode_token__unpack(NULL, n, m);
    if (!d || !d->token) {
        if (d)
            di__decode__decode_token__free_unpacked(d, NULL);
        return di_fail(err, DI_EPROTO, "DecodeToken does not parse or has no token");
    }
    if (q->out.finish != DI__ENGINE__FINISH__FINISH_NONE) {
        di__decode__decode_token__free_unpacked(d, NULL);
        return di_fail(err, DI_EPROTO, "Decode sent a token after the last one");
    }
    /* STOP's token is the EOS (the router sends no stop ids); ABORTED's is not an output. */
    if (d->finish != DI__ENGINE__FINISH__FINISH_STOP &&
        d->finish != DI__ENGINE__FINISH__FINISH_ABORTED)
        relay(q, d->token);
    q->out.finish = d->finish;
    di__decode__decode_token__free_unpacked(d, NULL);
    return DI_OK;
}

static void fill_sampling(Di__Engine__SamplingParams *sp, const rt_gen_req *r)
{
    sp->temperature = r->temperature;
    sp->has_temperature = 1;
    sp->top_p = r->top_p;
    sp->top_k = r->top_k;
    sp->seed = r->seed;
    sp->n_logprobs = r->top_logprobs;
    sp->max_tokens = r->max_tokens;
    if (r->ignore_eos) {
        sp->has_eos_id = 1;
        sp->eos_id = -1;
    }
}

static uint8_t *pack_prefill(const pd_req *q, size_t *len)
{
    Di__Engine__SamplingParams sp = DI__ENGINE__SAMPLING_PARAMS__INIT;
    fill_sampling(&sp, &q->req);
    Di__Prefill__PrefillRequest pr = DI__PREFILL__PREFILL_REQUEST__INIT;
    pr.request_id = (char *)q->id;
    pr.n_prompt = q->req.n_prompt;
    pr.prompt = (uint32_t *)q->prompt; /* token ids are >= 0: same bits */
    pr.sampling = &sp;
    *len = di__prefill__prefill_request__get_packed_size(&pr);
    uint8_t *buf = malloc(*len ? *len : 1);
    if (buf)
        di__prefill__prefill_request__pack(&pr, buf);
    return buf;
}

static uint8_t *pack_decode(const pd_req *q, const Di__Prefill__PrefillReply *pre, size_t *len)
{
    Di__Engine__SamplingParams sp = DI__ENGINE__SAMPLING_PARAMS__INIT;
    fill_sampling(&sp, &q->req);
    Di__Decode__DecodeRequest dr = DI__DECODE__DECODE_REQUEST__INIT;
    dr.request_id = (char *)q->id;
    dr.handoff = pre->handoff;
    dr.n_prompt = q->req.n_prompt;
    dr.prompt = (uint32_t *)q->prompt;
    dr.first = pre->first;
    dr.sampling = &sp;
    *len = di__decode__decode_request__get_packed_size(&dr);
    uint8_t *buf = malloc(*len ? *len : 1);
    if (buf)
        di__decode__decode_request__pack(&dr, buf);
    return buf;
}

/* Prefill with one retry elsewhere. DI_OK with out->pre and *pre_rank. */
static di_status do_prefill(pd_req *q, uint32_t cached, outcome *out, rk_pick *pre_rank,
                            di_error *err)
{
    pd_backend *b = q->b;
    size_t n;
    uint8_t *buf = pack_prefill(q, &n);
    if (!buf)
        return di_fail(err, DI_ENOMEM, "cannot build the prefill request");
    size_t exclude = SIZE_MAX;
    di_status st = DI_EUNAVAIL;
    for (int attempt = 0; attempt < 2; attempt++) {
        rk_pick p = rk_pick_prefill(b->cfg.ranks, q->req.n_prompt, cached, exclude);
        if (p.idx < 0) {
            if (attempt == 0)
                di_fail(err, DI_EUNAVAIL, "no prefill rank can take the request");
            break; /* keep the first attempt's error */
        }
        if (attempt > 0) {
            pthread_mutex_lock(&b->mu);
            b->retries++;
            pthread_mutex_unlock(&b->mu);
        }
        uint64_t t0 = di_mono_ns();
        uint64_t computed = q->req.n_prompt > cached ? q->req.n_prompt - cached : 0;
        di_error e = {0};
        pthread_mutex_lock(&b->mu);
        q->prefill_rank = p.idx;
        q->rank_lost = false;
        pthread_mutex_unlock(&b->mu);
        st = run_call(q, p.client, "/di.prefill.Prefill/Prefill", buf, n,
                      b->cfg.prefill_timeout_ms, on_prefill_msg, &e);
        pthread_mutex_lock(&b->mu);
        q->prefill_rank = -1;
        bool lost = q->rank_lost && !q->aborted;
        pthread_mutex_unlock(&b->mu);
        if (lost && st != DI_OK)
            st = di_fail(&e, DI_EUNAVAIL, "left rotation (missed heartbeats) with the call in "
                         "flight");
        if (st == DI_OK && !out->pre)
            st = di_fail(&e, DI_EPROTO, "Prefill ended without a reply");
        bool cancelled = !lost && (st == DI_ECANCELED || is_aborted(q));
        double secs = out->pre && out->pre->compute_ms ? out->pre->compute_ms / 1000.0
                                                       : (double)(di_mono_ns() - t0) * 1e-9;
        /* A cancel of ours is not the rank's fault. */
        rk_prefill_done(b->cfg.ranks, (size_t)p.idx, computed, secs, st == DI_OK || cancelled);
        if (st == DI_OK) {
            *pre_rank = p;
            break;
        }
        if (out->pre) {
            di__prefill__prefill_reply__free_unpacked(out->pre, NULL);
            out->pre = NULL;
        }
        di_fail(err, st, "prefill rank %s: %s", p.addr, e.msg[0] ? e.msg : di_status_str(st));
        if (b->cfg.log)
            di_log(b->cfg.log, DI_LOG_INFO, "request %s: %s", q->id, err->msg);
        if (cancelled || st == DI_EINVAL)
            break; /* aborted, or a request no rank would take */
        exclude = (size_t)p.idx;
    }
    free(buf);
    return st;
}

/* A rank that leaves rotation while a prefill call waits on it (a cut link gives no reset)
 * would hold the request until --prefill-timeout: the sweeper cancels such calls so that
 * do_prefill retries them on another rank at once. Nothing has reached the client yet. */
static void *sweep_thread(void *arg)
{
    pd_backend *b = arg;
    pthread_mutex_lock(&b->mu);
    while (!b->stop_sweep) {
        for (pd_req *q = b->head; q; q = q->next)
            if (q->prefill_rank >= 0 && q->cur && !q->aborted && !q->rank_lost &&
                rk_health(b->cfg.ranks, (size_t)q->prefill_rank) == PL_OUT) {
                q->rank_lost = true;
                rpc_stream_cancel(q->cur);
            }
        struct timespec ts = di_realtime_in_ms(100);
        pthread_cond_timedwait(&b->cv, &b->mu, &ts);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

static rt_finish finish_of(Di__Engine__Finish f)
{
    return f == DI__ENGINE__FINISH__FINISH_STOP      ? RT_FINISH_EOS
           : f == DI__ENGINE__FINISH__FINISH_ABORTED ? RT_FINISH_ABORT
                                                     : RT_FINISH_LENGTH;
}

/* Decode on rank r with the prefill reply in q->out. DI_OK with *reason; else err names the
 * rank and the tokens relayed so far. */
static di_status decode_on(pd_req *q, const rk_pick *r, uint32_t blocks, rt_finish *reason,
                           di_error *err)
{
    pd_backend *b = q->b;
    outcome *o = &q->out;
    size_t n;
    uint8_t *buf = pack_decode(q, o->pre, &n);
    di_error e = {0};
    di_status st = buf ? run_call(q, r->client, "/di.decode.Decode/Decode", buf, n,
                                  b->cfg.decode_timeout_ms, on_decode_msg, &e)
                       : di_fail(&e, DI_ENOMEM, "cannot build the decode request");
    free(buf);
    bool preempted = st == DI_OK && o->finish == DI__ENGINE__FINISH__FINISH_PREEMPTED;
    if (st == DI_OK && o->finish == DI__ENGINE__FINISH__FINISH_NONE)
        st = di_fail(&e, DI_EPROTO, "the decode stream ended without a finish");
    if (st == DI_OK && o->finish == DI__ENGINE__FINISH__FINISH_ERROR)
        st = di_fail(&e, DI_EINTERNAL, "the decode rank reported an error");
    if (preempted)
        st = di_fail(&e, DI_EFULL, "the decode rank preempted the request (out of KV blocks)");
    bool cancelled = st == DI_ECANCELED || is_aborted(q);
    /* A cancel of ours or a preemption is not the rank's fault. */
    rk_decode_done(b->cfg.ranks, (size_t)r->idx, blocks, st == DI_OK || cancelled || preempted);
    if (st == DI_OK)
        *reason = finish_of(o->finish);
    else
        di_fail(err, st, "decode rank %s after %u tokens: %s", r->addr, q->n_out,
                e.msg[0] ? e.msg : di_status_str(st));
    return st;
}

/* A decode failure a continuation may repair: the rank failed, died or preempted the request,
 * not the caller (abort, deadline) nor the request itself (EINVAL). */
static bool may_continue(pd_req *q, di_status st)
{
    return st != DI_ECANCELED && st != DI_ETIMEDOUT && st != DI_EINVAL && !is_aborted(q) &&
           q->continues < PD_MAX_CONTINUES && q->n_out >= 1;
}

/* The decode rank *r failed after q->n_out tokens (err says how). When the store holds the
 * prompt's KV (at least its first block) and another decode rank can take the request, the
 * prompt plus the tokens relayed so far is prefilled again (the prefill rank loads what the
 * store has) and decoded there with the rest of max_tokens; the seed stream is keyed by
 * position, so the draws go on where they were. Returns DI_OK with *reason and *r the new
 * rank, or a failure with err (the first failure's message, and why it was not continued). */
static di_status continue_decode(pd_req *q, uint32_t blocks, rk_pick *r, rt_finish *reason,
                                 di_error *err)
{
    pd_backend *b = q->b;
    di_status failed = err->code != DI_OK ? err->code : DI_EINTERNAL;
    char why[sizeof err->msg];
    snprintf(why, sizeof why, "%s", err->msg);
    uint32_t done = q->n_out;
    q->continues++;
    if (done >= q->req.max_tokens) { /* every token is out: only the finish was lost */
        *reason = RT_FINISH_LENGTH;
        return DI_OK;
    }
    const char *why_not = NULL; /* why it cannot be continued: then no more tries */
    uint32_t hit = 0;
    rk_pick next = {.idx = -1};
    size_t n0 = q->req.n_prompt, n = n0 + done;
    int32_t *p = NULL;
    if (q->n_ids != done)
        why_not = "out of memory";
    else if ((hit = store_lookup(b, q->prompt, q->req.n_prompt)) == 0)
        why_not = "the store holds none of the prompt's KV";
    else if ((next = rk_pick_decode(b->cfg.ranks, blocks, (size_t)r->idx)).idx < 0)
        why_not = "no other decode rank can take it";
    else if ((p = malloc(n * sizeof *p)) == NULL)
        why_not = "out of memory";
    if (why_not) {
        if (next.idx >= 0) /* the pick's reservation back */
            rk_decode_done(b->cfg.ranks, (size_t)next.idx, blocks, true);
        q->continues = PD_MAX_CONTINUES;
        return di_fail(err, failed, "%.250s; not continued: %s", why, why_not);
    }
    memcpy(p, q->prompt, n0 * sizeof *p);
    memcpy(p + n0, q->out_ids, done * sizeof *p);
    if (b->cfg.log)
        di_log(b->cfg.log, DI_LOG_INFO, "request %s: %s; continuing on decode rank %s "
               "(the store holds %u prompt tokens)", q->id, why, next.addr, hit);
    /* The continuation is a request of its own: prompt + tokens so far, the rest to make. */
    int32_t *p0 = q->prompt;
    uint32_t max0 = q->req.max_tokens;
    q->prompt = p, q->req.prompt = p, q->req.n_prompt = n, q->req.max_tokens = max0 - done;
    snprintf(q->id + q->id_len, sizeof q->id - q->id_len, "-c%u", ++q->suffixes);
    if (q->out.pre)
        di__prefill__prefill_reply__free_unpacked(q->out.pre, NULL);
    q->out = (outcome){0};
    rk_pick pre = {.idx = -1};
    di_error e = {0};
    bool decoded = false;
    di_status st = do_prefill(q, hit, &q->out, &pre, &e);
    if (st == DI_OK) {
        if (q->cb.on_continue)
            q->cb.on_continue(q->cb.ud, r->addr, next.addr, done);
        *r = next;
        Di__Engine__Finish f = q->out.pre->finish;
        if (f != DI__ENGINE__FINISH__FINISH_STOP)
            relay(q, q->out.pre->first);
        if (f != DI__ENGINE__FINISH__FINISH_NONE)
            *reason = finish_of(f);
        else if (q->req.max_tokens <= 1)
            *reason = RT_FINISH_LENGTH;
        else if (!q->out.pre->handoff)
            st = di_fail(&e, DI_EPROTO, "prefill rank %s: no handoff manifest", pre.addr);
        else if (!is_aborted(q))
            st = decode_on(q, r, blocks, reason, &e), decoded = true;
    }
    if (!decoded) /* the pick's reservation back; no call was made, nothing to judge */
        rk_decode_done(b->cfg.ranks, (size_t)next.idx, blocks, true);
    q->prompt = p0, q->req.prompt = p0, q->req.n_prompt = n0, q->req.max_tokens = max0;
    free(p);
    if (st != DI_OK)
        di_fail(err, st, "%.150s; continuing: %.150s", why, e.msg[0] ? e.msg : di_status_str(st));
    return st;
}

/* Deletes the handoff objects of this request's ids (its own, then "-c1".."-cN") from the
 * store: after an abort between a prefill's reply and the decode call, or a decode that ended
 * before loading it, no rank would, and the store would hold them until their TTL. A handoff
 * a decode rank took is gone already; deleting it again does nothing. */
static void drop_handoffs(pd_req *q)
{
    pd_backend *b = q->b;
    if (!b->cfg.store)
        return;
    char id[sizeof q->id];
    pthread_mutex_lock(&b->store_mu);
    for (uint32_t k = 0; b->have_geometry && k <= q->suffixes; k++) {
        snprintf(id, sizeof id, "%.*s", (int)q->id_len, q->id);
        if (k)
            snprintf(id + q->id_len, sizeof id - q->id_len, "-c%u", k);
        kvkey key;
        di_error e = {0};
        if (kvkey_handoff(b->model_id, id, &key, &e) == DI_OK &&
            kvc_delete1(b->cfg.store, KVKEY_HANDOFF, &key, &e) != DI_OK && e.code != DI_ENOENT &&
            b->cfg.log)
            di_log(b->cfg.log, DI_LOG_DEBUG, "request %s: deleting its handoff: %s", id, e.msg);
    }
    pthread_mutex_unlock(&b->store_mu);
}

static void run(pd_req *q)
{
    pd_backend *b = q->b;
    outcome *o = &q->out;
    di_error err = {0};
    rk_pick pre_rank = {.idx = -1}, dec_rank = {.idx = -1};
    uint32_t cached = cached_tokens(b, q->prompt, q->req.n_prompt);
    rt_finish reason = RT_FINISH_ERROR;
    di_status st = do_prefill(q, cached, o, &pre_rank, &err);
    const char *instance = NULL;
    if (st == DI_OK) {
        cached = o->pre->cached_tokens;
        instance = pre_rank.addr;
        Di__Engine__Finish f = o->pre->finish;
        if (f != DI__ENGINE__FINISH__FINISH_STOP)
            relay(q, o->pre->first);
        if (f != DI__ENGINE__FINISH__FINISH_NONE)
            reason = finish_of(f);
        else if (q->req.max_tokens <= 1)
            reason = RT_FINISH_LENGTH;
        else if (!o->pre->handoff)
            st = di_fail(&err, DI_EPROTO, "prefill rank %s: no handoff manifest",
                         pre_rank.addr);
    }
    if (st == DI_OK && reason == RT_FINISH_ERROR && !is_aborted(q)) {
        uint32_t bt = b->cfg.block_tokens;
        uint32_t blocks = (uint32_t)((q->req.n_prompt + q->req.max_tokens + bt - 1) / bt);
        dec_rank = rk_pick_decode(b->cfg.ranks, blocks, SIZE_MAX);
        if (dec_rank.idx < 0)
            st = di_fail(&err, DI_EUNAVAIL, "no decode rank can take the request (%u blocks)",
                         blocks);
        else
            st = decode_on(q, &dec_rank, blocks, &reason, &err);
        while (st != DI_OK && may_continue(q, st))
            st = continue_decode(q, blocks, &dec_rank, &reason, &err);
        if (dec_rank.idx >= 0)
            instance = dec_rank.addr;
    }
    if (is_aborted(q) && (st != DI_OK || reason == RT_FINISH_ERROR))
        st = DI_OK, reason = RT_FINISH_ABORT;
    if (st != DI_OK) {
        reason = RT_FINISH_ERROR;
        if (b->cfg.log)
            di_log(b->cfg.log, DI_LOG_INFO, "request %s: %s", q->id, err.msg);
    }
    if (o->pre)
        di__prefill__prefill_reply__free_unpacked(o->pre, NULL);
    q->cb.on_finish(q->cb.ud, reason, cached, instance, st, st == DI_OK ? "" : err.msg);
    /* after the finish: the client does not wait for the store */
    if (reason == RT_FINISH_ABORT || reason == RT_FINISH_ERROR || q->suffixes > 0)
        drop_handoffs(q);
}

static void *req_thread(void *arg)
{
    pd_req *q = arg;
    pd_backend *b = q->b;
    run(q);
    pthread_mutex_lock(&b->mu);
    for (pd_req **p = &b->head; *p; p = &(*p)->next)
        if (*p == q) {
            *p = q->next;
            break;
        }
    b->running--;
    free(q->prompt);
    free(q->out_ids);
    free(q);
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

static di_status pd_generate(void *self, const rt_gen_req *req, const rt_gen_cb *cb,
                             uint64_t *handle, di_error *err)
{
    pd_backend *b = self;
    if (rk_usable(b->cfg.ranks, PL_PREFILL) == 0 || rk_usable(b->cfg.ranks, PL_DECODE) == 0)
        return di_fail(err, DI_EUNAVAIL, "no prefill or no decode rank is in rotation");
    pd_req *q = calloc(1, sizeof *q);
    int32_t *p = malloc((req->n_prompt ? req->n_prompt : 1) * sizeof *p);
    if (!q || !p) {
        free(q);
        free(p);
        return di_fail(err, DI_ENOMEM, "cannot allocate the request");
    }
    memcpy(p, req->prompt, req->n_prompt * sizeof *p);
    q->b = b;
    q->prefill_rank = -1;
    q->req = *req;
    q->req.prompt = p;
    q->prompt = p;
    q->cb = *cb;
    pthread_mutex_lock(&b->mu);
    q->handle = ++b->next_handle;
    int idn = snprintf(q->id, sizeof q->id, "rt-%016llx-%llu", (unsigned long long)b->nonce,
                       (unsigned long long)q->handle);
    q->id_len = idn > 0 && (size_t)idn < sizeof q->id ? (size_t)idn : strlen(q->id);
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_t th;
    if (pthread_create(&th, &at, req_thread, q) != 0) {
        pthread_mutex_unlock(&b->mu);
        pthread_attr_destroy(&at);
        free(p);
        free(q);
        return di_fail(err, DI_ENOMEM, "cannot start a request thread");
    }
    pthread_attr_destroy(&at);
    q->next = b->head;
    b->head = q;
    b->started++;
    b->running++;
    *handle = q->handle;
    pthread_mutex_unlock(&b->mu); /* the thread's first lock waits for this */
    return DI_OK;
}

static void pd_abort(void *self, uint64_t handle)
{
    pd_backend *b = self;
    pthread_mutex_lock(&b->mu);
    for (pd_req *q = b->head; q; q = q->next)
        if (q->handle == handle) {
            q->aborted = true;
            if (q->cur)
                rpc_stream_cancel(q->cur);
            break;
        }
    pthread_mutex_unlock(&b->mu);
}

di_status pd_new(const pd_config *cfg, pd_backend **out, di_error *err)
{
    if (!cfg || !cfg->ranks || cfg->prefill_timeout_ms < 1 || cfg->decode_timeout_ms < 1 ||
        cfg->block_tokens < 1)
        return di_fail(err, DI_EINVAL, "pd_new: ranks, timeouts >= 1 ms and block_tokens >= 1 "
                       "are required");
    pd_backend *b = calloc(1, sizeof *b);
    if (!b)
        return di_fail(err, DI_ENOMEM, "cannot allocate the backend");
    b->cfg = *cfg;
    pthread_mutex_init(&b->mu, NULL);
    pthread_mutex_init(&b->store_mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    b->nonce = ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16);
    if (pthread_create(&b->sweeper, NULL, sweep_thread, b) != 0) {
        pthread_cond_destroy(&b->cv);
        pthread_mutex_destroy(&b->store_mu);
        pthread_mutex_destroy(&b->mu);
        free(b);
        return di_fail(err, DI_ENOMEM, "cannot start the backend's sweeper thread");
    }
    b->sweeping = true;
    *out = b;
    return DI_OK;
}

void pd_free(pd_backend *b)
{
    if (!b)
        return;
    pthread_mutex_lock(&b->mu);
    for (pd_req *q = b->head; q; q = q->next) {
        q->aborted = true;
        if (q->cur)
            rpc_stream_cancel(q->cur);
    }
    while (b->running > 0)
        pthread_cond_wait(&b->cv, &b->mu);
    b->stop_sweep = true;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    if (b->sweeping)
        pthread_join(b->sweeper, NULL);
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->store_mu);
    pthread_mutex_destroy(&b->mu);
    free(b);
}

uint64_t pd_store_hits(pd_backend *b)
{
    pthread_mutex_lock(&b->store_mu);
    uint64_t n = b->store_hits;
    pthread_mutex_unlock(&b->store_mu);
    return n;
}

rt_backend pd_backend_iface(pd_backend *b)
{
    return (rt_backend){.generate = pd_generate, .abort = pd_abort, .self = b};
}

void pd_counts(pd_backend *b, uint64_t *started, uint64_t *retries, uint64_t *running)
{
    pthread_mutex_lock(&b->mu);
    *started = b->started;
    *retries = b->retries;
    *running = b->running;
    pthread_mutex_unlock(&b->mu);
}
