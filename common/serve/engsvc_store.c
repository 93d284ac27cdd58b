/* engsvc_store.c: the engine service's store calls, every one a job on the transfer thread of
 * its KV cache (kvcache.h): prefix admissions (di-prefill), the handoff put and its reply
 * (di-prefill), the handoff pull (di-decode), handoff deletes; and the events that bring their
 * outcomes back to the engine thread.
 *
 * A call's outcome is two-fold: the store's failure (unreachable, deadline: returned to the
 * transfer thread, which retries after a back-off) and the request's own (a handoff that is
 * not there, not this request's, already stored: kept in the call, never retried, no back-off).
 *
 * A request whose call is out is not ended by a cancel at once: the cancel cancels the call
 * if it has not started, and the request ends when the call's event comes (so that no job
 * ever writes into a freed request). */
#include <stdlib.h>
#include <string.h>

#include "common/net/prefill.pb-c.h"
#include "common/serve/engsvc_internal.h"
#include "common/serve/handoff.h"
#include "common/util/clock.h"

typedef enum call_kind {
    CALL_HANDOFF = 0,          /* put the handoff's full blocks, then the handoff object */
    CALL_PULL,                 /* get the handoff object and its blocks into the request */
    CALL_DELETE,               /* delete a handoff object */
} call_kind;

/* One store call of the service. */
typedef struct svc_call {
    call_kind kind;
    engsvc *s;
    sreq *r;                   /* HANDOFF, PULL: the request (alive while the call is out) */
    kvkey key;                 /* HANDOFF, DELETE: the handoff's key */
    void *obj;                 /* HANDOFF: the handoff object */
    size_t bytes;
    kv_handoff h;              /* HANDOFF: obj read back (block keys for the manifest) */
    uint32_t n_full;           /* HANDOFF: its full blocks */
    uint32_t first;            /* HANDOFF: the first one to put (those below came from the
                                  store as the prompt's hit: not copied, not put again) */
    void **bufs;               /* [n_full] the block objects (NULL below first) */
    uint64_t store_id;         /* HANDOFF: the store that took it (0: unknown) */
    uint64_t expires_ms;       /* HANDOFF: its latest expiry, wall clock (0: unknown) */
    di_status st;              /* the request's outcome (when the calls went through) */
    di_error err;
} svc_call;

static void call_free(svc_call *c)
{
    if (!c)
        return;
    for (uint32_t i = 0; c->bufs && i < c->n_full; i++)
        free(c->bufs[i]);
    free(c->bufs);
    free(c->obj);
    free(c);
}

/* ---- the calls (transfer thread) ------------------------------------------------------- */

static di_status call_handoff(svc_call *c, kvc_client *kv, di_error *err)
{
    engsvc *s = c->s;
    size_t bb = kv_block_bytes(&s->g);
    c->st = DI_OK;
    for (uint32_t i0 = c->first; i0 < c->n_full && c->st == DI_OK; i0 += KVC_MAX_BATCH) {
        uint32_t k = c->n_full - i0 < KVC_MAX_BATCH ? c->n_full - i0 : KVC_MAX_BATCH;
        kvc_item *items = calloc(k, sizeof(kvc_item));
        if (!items)
            return di_fail(err, DI_ENOMEM, "blocks");
        for (uint32_t i = 0; i < k; i++) {
            items[i] = (kvc_item){.cls = KVKEY_BLOCK, .buf = c->bufs[i0 + i], .cap = bb};
            memcpy(items[i].key.b, c->h.block_keys + (size_t)(i0 + i) * 32, 32);
        }
        di_status st = kvc_put(kv, items, k, err);
        for (uint32_t i = 0; st == DI_OK && c->st == DI_OK && i < k; i++)
            if (items[i].status != DI_OK && items[i].status != DI_EEXIST) {
                c->st = items[i].status;
                c->err = items[i].error;
                di_error_prefix(&c->err, "block %u: ", i0 + i);
            }
        free(items);
        if (st != DI_OK)
            return st;
    }
    if (c->st != DI_OK)
        return DI_OK;
    kvc_item it = {.cls = KVKEY_HANDOFF, .key = c->key, .buf = c->obj, .cap = c->bytes};
    di_status st = kvc_put(kv, &it, 1, err);
    if (st != DI_OK)
        return st;
    if (it.status == DI_EEXIST)
        c->st = di_fail(&c->err, DI_EEXIST, "a handoff for request_id %s is already stored",
                        c->r->rid);
    else if (it.status != DI_OK) {
        c->st = it.status;
        c->err = it.error;
    } else {
        /* the store that holds it and when it expires at the latest: its TTL counts from
         * the commit, which came before now; decode names the cause of a miss from them */
        kvc_store_info si;
        di_error ie;
        if (kvc_info(kv, &si, &ie) == DI_OK) {
            c->store_id = si.store_id;
            if (si.ttl_ms[KVKEY_HANDOFF])
                c->expires_ms = di_wall_ms() + si.ttl_ms[KVKEY_HANDOFF];
        }
    }
    return DI_OK;
}

/* DECODE: why the handoff is not in the store, from its manifest. */
static di_status handoff_missing(kvc_client *kv, const sreq *r, di_error *err)
{
    kvc_store_info si;
    di_error ie;
    uint64_t now = di_wall_ms();
    if (r->hstore && kvc_info(kv, &si, &ie) == DI_OK && si.store_id != r->hstore)
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

/* The handoff and its blocks into r, checked against the request. */
static di_status call_pull(svc_call *c, kvc_client *kv, di_error *err)
{
    engsvc *s = c->s;
    sreq *r = c->r;
    for (uint32_t i = 0; r->blocks && i < r->n_full; i++) /* an earlier attempt's */
        free(r->blocks[i]);
    free(r->blocks);
    free(r->bsz);
    r->blocks = NULL;
    r->bsz = NULL;
    r->n_full = 0;
    c->st = DI_OK;
    uint64_t t0 = di_mono_ns();
    kvc_item it = {.cls = KVKEY_HANDOFF, .buf = r->hobj, .cap = r->hbytes};
    memcpy(it.key.b, r->hkey, KVKEY_BYTES);
    di_status st = kvc_get(kv, &it, 1, err);
    if (st != DI_OK) {
        di_error_prefix(err, "pulling the handoff from the store: ");
        return st;
    }
    if (it.status == DI_ENOENT) {
        c->st = handoff_missing(kv, r, &c->err);
        return DI_OK;
    }
    if (it.status != DI_OK) {
        c->st = it.status;
        c->err = it.error;
        return DI_OK;
    }
    uint64_t bytes = it.bytes;
    if ((c->st = kv_handoff_read(&s->g, r->hobj, bytes, it.key.b, &r->h, &c->err)) != DI_OK)
        return DI_OK;
    const kv_handoff *h = &r->h;
    if (h->prompt_len != r->prompt_len ||
        memcmp(h->tokens, r->prompt, r->prompt_len * sizeof(int32_t)) != 0 ||
        h->n_output < 1 || h->tokens[h->prompt_len] != r->first_tok) {
        c->st = di_fail(&c->err, DI_EINVAL, "the handoff is not this request's (prompt or "
                        "first token differ)");
        return DI_OK;
    }
    if (h->n_output >= r->max_tokens) {
        c->st = di_fail(&c->err, DI_EINVAL, "sampling.max_tokens: %u, the handoff has %u "
                        "tokens already", r->max_tokens, h->n_output);
        return DI_OK;
    }
    uint32_t n_full = h->kv_positions / s->g.block_tokens;
    r->blocks = calloc(n_full + 1, sizeof(void *));
    r->bsz = calloc(n_full + 1, sizeof(size_t));
    kvc_item *items = calloc(n_full + 1, sizeof(kvc_item));
    if (!r->blocks || !r->bsz || !items) {
        free(items);
        return di_fail(err, DI_ENOMEM, "blocks");
    }
    r->n_full = n_full;
    size_t bb = kv_block_bytes(&s->g);
    for (uint32_t i = 0; i < n_full; i++) {
        r->blocks[i] = aligned_alloc(8, bb);
        if (!r->blocks[i]) {
            free(items);
            return di_fail(err, DI_ENOMEM, "block %u", i);
        }
        items[i] = (kvc_item){.cls = KVKEY_BLOCK, .buf = r->blocks[i], .cap = bb};
        memcpy(items[i].key.b, h->block_keys + (size_t)i * 32, 32);
    }
    st = DI_OK;
    for (uint32_t i0 = 0; st == DI_OK && c->st == DI_OK && i0 < n_full; i0 += KVC_MAX_BATCH) {
        uint32_t k = n_full - i0 < KVC_MAX_BATCH ? n_full - i0 : KVC_MAX_BATCH;
        st = kvc_get(kv, items + i0, k, err);
        if (st != DI_OK)
            di_error_prefix(err, "pulling blocks %u..%u from the store: ", i0, i0 + k - 1);
        for (uint32_t i = i0; st == DI_OK && c->st == DI_OK && i < i0 + k; i++) {
            if (items[i].status != DI_OK) {
                c->st = items[i].status;
                c->err = items[i].error;
                di_error_prefix(&c->err, "block %u from the store: ", i);
            }
            r->bsz[i] = items[i].bytes;
        }
    }
    free(items);
    r->pulled_bytes = bytes + (uint64_t)n_full * bb;
    r->pull_ns = di_mono_ns() - t0;
    return st;
}

static di_status call_delete(svc_call *c, kvc_client *kv, di_error *err)
{
    kvc_item it = {.cls = KVKEY_HANDOFF, .key = c->key};
    return kvc_delete(kv, &it, 1, err); /* the item's own status (absent) does not matter */
}

static di_status run_call(void *ctx, kvc_client *kv, di_error *err)
{
    svc_call *c = ctx;
    switch (c->kind) {
    case CALL_HANDOFF: return call_handoff(c, kv, err);
    case CALL_PULL: return call_pull(c, kv, err);
    default: return call_delete(c, kv, err);
    }
}

/* ---- submitting (engine thread) -------------------------------------------------------- */

static di_status submit(engsvc *s, svc_call *c, xfer_kind kind, uint64_t id,
                        const xfer_job_opts *o, di_error *err)
{
    return kvcache_call(s->kc, kind, id, run_call, c, c, o, err);
}

void engsvc_drop_handoff(engsvc *s, const sreq *r)
{
    svc_call *c = calloc(1, sizeof(*c));
    di_error err;
    if (!c)
        return;
    *c = (svc_call){.kind = CALL_DELETE, .s = s};
    if (kvkey_handoff(s->g.model_id, r->rid, &c->key, &err) != DI_OK ||
        submit(s, c, XFER_STORE, 0, NULL, &err) != DI_OK) {
        s->call_failures++;
        call_free(c); /* it expires with its TTL */
    }
}

/* PREFILL: the request ended with a handoff: the handoff object and its full blocks are
 * copied into host memory, the request's blocks and slot released, and the put goes out. */
void engsvc_handoff_submit(engsvc *s, sreq *r)
{
    di_error err;
    svc_call *c = calloc(1, sizeof(*c));
    size_t cap = handoff_max_bytes(s->ex, r->prompt_len + 1), bb = kv_block_bytes(&s->g);
    di_status st = c ? DI_OK : di_fail(&err, DI_ENOMEM, "handoff");
    if (st == DI_OK) {
        *c = (svc_call){.kind = CALL_HANDOFF, .s = s, .r = r};
        c->obj = aligned_alloc(8, (cap + 7) / 8 * 8);
        st = c->obj ? kvkey_handoff(s->g.model_id, r->rid, &c->key, &err)
                    : di_fail(&err, DI_ENOMEM, "handoff buffer");
    }
    if (st == DI_OK)
        st = handoff_export(s->e, s->ex, r->id, c->key.b, c->obj, cap, &c->bytes, &c->n_full,
                            &err);
    if (st == DI_OK)
        st = kv_handoff_read(&s->g, c->obj, c->bytes, c->key.b, &c->h, &err);
    if (st == DI_OK && c->n_full && !(c->bufs = calloc(c->n_full, sizeof(void *))))
        st = di_fail(&err, DI_ENOMEM, "blocks");
    c->first = r->cached / s->g.block_tokens;
    if (c->first > c->n_full)
        c->first = c->n_full;
    for (uint32_t i = c->first; st == DI_OK && i < c->n_full; i++) {
        if (!(c->bufs[i] = aligned_alloc(8, bb)))
            st = di_fail(&err, DI_ENOMEM, "block %u", i);
        else
            st = handoff_block(s->e, s->ex, r->id, &c->h, i, c->bufs[i], bb, &err);
    }
    di_error rel;
    engine_release(s->e, r->id, &rel); /* the KV is in host memory (or lost) */
    r->in_engine = false;
    /* one attempt: the caller waits on it, behind the prompt's block puts (which have had
     * their attempts when the store is down); the router retries a failed prefill elsewhere */
    static const xfer_job_opts once = {.max_attempts = 1};
    if (st == DI_OK && (st = submit(s, c, XFER_STORE, r->id, &once, &err)) == DI_OK) {
        r->job_out = true;
        return;
    }
    call_free(c);
    engsvc_unlink(s, r);
    di_error_prefix(&err, "handoff to the store: ");
    engsvc_end_req(s, r, st, NULL, 0, err.msg);
}

/* DECODE: the pull of r's handoff goes out; r enters the engine when it is in. */
di_status engsvc_pull_submit(engsvc *s, sreq *r, di_error *err)
{
    svc_call *c = calloc(1, sizeof(*c));
    if (!c)
        return di_fail(err, DI_ENOMEM, "pull");
    *c = (svc_call){.kind = CALL_PULL, .s = s, .r = r};
    di_status st = submit(s, c, XFER_LOAD, r->id, NULL, err);
    if (st != DI_OK) {
        free(c);
        return st;
    }
    r->job_out = true;
    return DI_OK;
}

/* ---- outcomes (engine thread) ---------------------------------------------------------- */

/* The reply of a stored handoff: the first token, its logprobs and the manifest. */
static void handoff_reply(engsvc *s, sreq *r, svc_call *c)
{
    Di__Engine__Token tok;
    Di__Engine__TokenLogprob tops[SAMPLER_MAX_LOGPROBS], *ptrs[SAMPLER_MAX_LOGPROBS];
    engsvc_token_pb(&tok, tops, ptrs, r->first.token, &r->first.res, 0);
    Di__Prefill__HandoffManifest man = DI__PREFILL__HANDOFF_MANIFEST__INIT;
    ProtobufCBinaryData *keys = calloc(c->n_full ? c->n_full : 1, sizeof(*keys));
    for (uint32_t i = 0; keys && i < c->n_full; i++)
        keys[i] = (ProtobufCBinaryData){32, (uint8_t *)c->h.block_keys + (size_t)i * 32};
    man.model_id = s->g.model_id;
    man.prompt_tokens = r->prompt_len;
    man.block_tokens = s->g.block_tokens;
    man.n_block_keys = keys ? c->n_full : 0;
    man.block_keys = keys;
    man.handoff_key = (ProtobufCBinaryData){32, c->key.b};
    man.handoff_bytes = c->bytes;
    man.store_id = c->store_id;
    man.handoff_expires_ms = c->expires_ms;
    Di__Prefill__PrefillReply rep = DI__PREFILL__PREFILL_REPLY__INIT;
    rep.request_id = r->rid;
    rep.first = &tok;
    rep.finish = DI__ENGINE__FINISH__FINISH_NONE;
    rep.handoff = &man;
    rep.cached_tokens = r->cached;
    rep.queue_ms = r->t_start ? (r->t_start - r->t_arrive) / 1000000u : 0;
    rep.compute_ms = r->t_start ? (di_mono_ns() - r->t_start) / 1000000u : 0;
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

static void handoff_done(engsvc *s, svc_call *c, di_status st, const di_error *e)
{
    sreq *r = c->r;
    di_error err = st != DI_OK ? *e : c->err;
    st = st != DI_OK ? st : c->st;
    r->job_out = false;
    engsvc_unlink(s, r);
    if (atomic_load(&r->cancelled)) { /* the caller is gone: nobody will take it */
        if (st == DI_OK)
            engsvc_drop_handoff(s, r);
        engsvc_end_req(s, r, (di_status)atomic_load(&r->cancel_why), NULL, 0,
                       "request cancelled");
    } else if (st != DI_OK) {
        if (st != DI_ECANCELED && st != DI_EEXIST)
            s->call_failures++;
        di_error_prefix(&err, "handoff to the store: ");
        engsvc_end_req(s, r, st, NULL, 0, err.msg);
    } else {
        handoff_reply(s, r, c);
    }
}

static void pull_done(engsvc *s, svc_call *c, di_status st, const di_error *e)
{
    sreq *r = c->r;
    di_error err = st != DI_OK ? *e : c->err;
    st = st != DI_OK ? st : c->st;
    r->job_out = false;
    if (atomic_load(&r->cancelled)) { /* nobody will take the handoff now */
        engsvc_drop_handoff(s, r);
        engsvc_unlink(s, r);
        engsvc_end_req(s, r, (di_status)atomic_load(&r->cancel_why), NULL, 0,
                       "request cancelled");
        return;
    }
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
        di_error terr; /* a response that is not stored costs nothing else */
        if (st == DI_OK && kvcache_track(s->kc, r->id, r->h.tokens,
                                         r->h.prompt_len + r->h.n_output, r->max_tokens,
                                         &terr) != DI_OK)
            s->call_failures++;
    } else if (st != DI_ECANCELED && st != DI_ENOENT && st != DI_EINVAL && st != DI_ECORRUPT) {
        s->call_failures++;
    }
    if (st == DI_OK || st == DI_ECORRUPT) /* in host memory now, or useless */
        engsvc_drop_handoff(s, r);
    if (st != DI_OK) {
        engsvc_unlink(s, r);
        engsvc_end_req(s, r, st, NULL, 0, err.msg);
        return;
    }
    r->in_engine = true;
}

/* PREFILL: the admission came back with the prefix the store gave: r enters the engine. */
static void admitted(engsvc *s, sreq *r, const kvcache_event *ev)
{
    di_error err;
    r->loading = false;
    r->cached = ev->kv_cached - ev->replay;
    runner_request rq = {.id = r->id, .prompt = r->prompt, .prompt_len = r->prompt_len,
                         .max_tokens = r->max_tokens, .params = r->sp};
    sched_request sr = {.id = r->id, .prompt = r->prompt, .prompt_len = r->prompt_len,
                        .max_tokens = r->max_tokens, .stop_ids = r->stop_ids,
                        .n_stop_ids = r->n_stop, .ignore_eos = r->ignore_eos,
                        .arrival_ns = r->t_arrive, .kv_cached = ev->kv_cached,
                        .replay = ev->replay, .window_cached = ev->window_cached};
    di_status st = engine_add(s->e, &sr, &rq, r, &err);
    if (st != DI_OK) {
        kvcache_forget(s->kc, r->id);
        engsvc_unlink(s, r);
        engsvc_end_req(s, r, st, NULL, 0, err.msg);
        return;
    }
    pthread_mutex_lock(&s->mu);
    s->cached_prompt_tokens += r->cached;
    pthread_mutex_unlock(&s->mu);
    r->in_engine = true;
}

void engsvc_take_events(engsvc *s)
{
    kvcache_event ev[32];
    size_t n;
    while ((n = kvcache_poll(s->kc, ev, 32)) > 0)
        for (size_t i = 0; i < n; i++) {
            if (ev[i].kind == KVCACHE_ADMIT) {
                admitted(s, ev[i].user, &ev[i]);
                continue;
            }
            svc_call *c = ev[i].user;
            if (c->kind == CALL_HANDOFF)
                handoff_done(s, c, ev[i].status, &ev[i].err);
            else if (c->kind == CALL_PULL)
                pull_done(s, c, ev[i].status, &ev[i].err);
            else if (ev[i].status != DI_OK && ev[i].status != DI_ECANCELED)
                s->call_failures++;
            call_free(c);
        }
}
