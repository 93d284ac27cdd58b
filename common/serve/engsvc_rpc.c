/* engsvc_rpc.c: the gRPC side of the engine service: requests parsed and checked, queued for
 * the engine thread; GetLoad, Health and Abort answered from the service's snapshot. */
#include <stdlib.h>
#include <string.h>

#include "common/net/decode.pb-c.h"
#include "common/net/engine.pb-c.h"
#include "common/net/prefill.pb-c.h"
#include "common/serve/engsvc_internal.h"
#include "common/util/clock.h"

/* ---- sampling parameters from the request --------------------------------------------- */

static di_status sampling_from_pb(const engsvc *s, const Di__Engine__SamplingParams *p,
                                  uint32_t prompt_len, sreq *r, di_error *err)
{
    const model_config *c = &s->cfg.rm->w->config;
    sampling_params sp = sampling_params_default();
    sp.eos_id = (int32_t)c->eos_token_id;
    uint32_t room = (uint32_t)(c->max_position_embeddings > prompt_len + 1
                                   ? c->max_position_embeddings - prompt_len - 1 : 0);
    if (room > sched_get_config(engine_sched(s->e))->max_model_len - prompt_len - 1)
        room = sched_get_config(engine_sched(s->e))->max_model_len - prompt_len - 1;
    r->max_tokens = 16;
    if (p) {
        if (p->has_temperature)
            sp.temperature = p->temperature;
        if (p->top_p != 0)
            sp.top_p = p->top_p;
        sp.top_k = p->top_k == 0 ? -1 : p->top_k;
        if (p->force_top_k)
            sp.force_top_k = p->force_top_k;
        sp.first_n_no_eos = p->first_n_no_eos;
        if (p->has_eos_id && p->eos_id != sp.eos_id) {
            if (p->eos_id < -1 || (p->eos_id >= 0 && (uint32_t)p->eos_id >= c->vocab_size))
                return di_fail(err, DI_EINVAL, "sampling.eos_id: %d, want -1 or a token id "
                               "below %u", p->eos_id, c->vocab_size);
            r->ignore_eos = true;
            if (p->eos_id >= 0)
                r->stop_ids[r->n_stop++] = p->eos_id;
        }
        sp.n_logprobs = p->n_logprobs;
        sp.seed = p->seed;
        if (p->max_tokens)
            r->max_tokens = p->max_tokens;
        if (p->n_blacklist) {
            if (p->n_blacklist > c->vocab_size)
                return di_fail(err, DI_EINVAL, "sampling.blacklist: %zu ids, the vocabulary has "
                               "%u", p->n_blacklist, c->vocab_size);
            r->blacklist = malloc(p->n_blacklist * sizeof(int32_t));
            if (!r->blacklist)
                return di_fail(err, DI_ENOMEM, "blacklist");
            for (size_t i = 0; i < p->n_blacklist; i++)
                r->blacklist[i] = (int32_t)(p->blacklist[i] > INT32_MAX ? -1
                                                                        : (int32_t)p->blacklist[i]);
            sp.blacklist = r->blacklist;
            sp.n_blacklist = (uint32_t)p->n_blacklist;
        }
        if (p->n_stop_ids + r->n_stop > 16)
            return di_fail(err, DI_EINVAL, "sampling.stop_ids: %zu ids, at most 16 with the end "
                           "token", p->n_stop_ids);
        for (size_t i = 0; i < p->n_stop_ids; i++) {
            if (p->stop_ids[i] >= c->vocab_size)
                return di_fail(err, DI_EINVAL, "sampling.stop_ids[%zu]: %u is outside the "
                               "vocabulary [0, %u)", i, p->stop_ids[i], c->vocab_size);
            r->stop_ids[r->n_stop++] = (int32_t)p->stop_ids[i];
        }
    }
    if (r->max_tokens < 1 || r->max_tokens > room)
        return di_fail(err, DI_EINVAL, "sampling.max_tokens: %u, want 1..%u for a prompt of %u "
                       "tokens", r->max_tokens, room, prompt_len);
    di_status st = sampling_params_validate(&sp, c->vocab_size, err);
    if (st != DI_OK) {
        di_error_prefix(err, "sampling: ");
        return st;
    }
    r->sp = sp;
    return DI_OK;
}

static di_status request_id_check(const char *rid, di_error *err)
{
    size_t n = rid ? strlen(rid) : 0;
    if (n == 0 || n > RID_MAX)
        return di_fail(err, DI_EINVAL, "request_id: %zu bytes, want 1..%u", n, RID_MAX);
    for (size_t i = 0; i < n; i++)
        if (rid[i] < 0x21 || rid[i] > 0x7e)
            return di_fail(err, DI_EINVAL, "request_id: byte %zu is not printable ASCII", i);
    return DI_OK;
}

static di_status prompt_from_pb(const engsvc *s, const uint32_t *p, size_t n, sreq *r,
                                di_error *err)
{
    const model_config *c = &s->cfg.rm->w->config;
    uint32_t max_len = sched_get_config(engine_sched(s->e))->max_model_len;
    if (n == 0 || n >= max_len)
        return di_fail(err, DI_EINVAL, "prompt: %zu tokens, want 1..%u", n, max_len - 1);
    r->prompt = malloc(n * sizeof(int32_t));
    if (!r->prompt)
        return di_fail(err, DI_ENOMEM, "prompt of %zu tokens", n);
    for (size_t i = 0; i < n; i++) {
        if (p[i] >= c->vocab_size)
            return di_fail(err, DI_EINVAL, "prompt[%zu]: %u is outside the vocabulary [0, %u)",
                           i, p[i], c->vocab_size);
        r->prompt[i] = (int32_t)p[i];
    }
    r->prompt_len = (uint32_t)n;
    return DI_OK;
}

/* Queues a checked request (a gRPC worker). DI_EUNAVAIL while draining, DI_EFULL. On DI_OK the
 * engine thread owns r and will finish its call. */
static di_status enqueue(engsvc *s, sreq *r, di_error *err)
{
    pthread_mutex_lock(&s->mu);
    di_status st = DI_OK;
    if (s->broken)
        st = di_fail(err, DI_EUNAVAIL, "this rank cannot serve (%s): send the request to "
                     "another instance", s->broken_msg);
    else if (s->draining || s->stopping)
        st = di_fail(err, DI_EUNAVAIL, "draining: send the request to another instance");
    else if (s->n_inbox + s->live >= s->cfg.max_waiting + s->cfg.max_seqs)
        st = di_fail(err, DI_EFULL, "%u requests queued or running: retry elsewhere",
                     s->n_inbox + s->live);
    if (st == DI_OK) {
        r->t_arrive = di_mono_ns();
        if (s->inbox_tail)
            s->inbox_tail->next = r;
        else
            s->inbox = r;
        s->inbox_tail = r;
        s->n_inbox++;
        s->live++;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* ---- the gRPC methods ------------------------------------------------------------------ */

/* The fields both requests carry: a new record with request_id, prompt and sampling checked.
 * DI_OK with *out, or the failure (nothing allocated). */
static di_status request_new(const engsvc *s, const char *rid, const uint32_t *prompt,
                             size_t n, const Di__Engine__SamplingParams *sampling, uint32_t prio,
                             sreq **out, di_error *err)
{
    sreq *r = calloc(1, sizeof(*r));
    di_status st = r ? request_id_check(rid, err) : di_fail(err, DI_ENOMEM, "request");
    if (st == DI_OK)
        st = prompt_from_pb(s, prompt, n, r, err);
    if (st == DI_OK)
        st = sampling_from_pb(s, sampling, r->prompt_len, r, err);
    if (st == DI_OK && prio > 7)
        st = di_fail(err, DI_EINVAL, "priority: %u, want 0..7", prio);
    if (st != DI_OK) {
        engsvc_req_free(r);
        return st;
    }
    snprintf(r->rid, sizeof r->rid, "%s", rid);
    *out = r;
    return DI_OK;
}

/* Hands a checked request to the engine thread, which then owns the call; a refusal (draining,
 * full) ends the call here. */
static di_status request_queue(engsvc *s, sreq *r, rpc_call *call, di_error *err)
{
    r->call = call;
    rpc_call_on_cancel(call, engsvc_on_cancel, r);
    di_status st = enqueue(s, r, err);
    if (st != DI_OK) { /* the call is ours again */
        rpc_call_finish(call, st, NULL, 0, err->msg);
        engsvc_req_free(r);
    }
    return DI_OK;
}

static di_status prefill_start(void *svc, const rpc_request *req, rpc_call *call, di_error *err)
{
    engsvc *s = svc;
    Di__Prefill__PrefillRequest *m = di__prefill__prefill_request__unpack(NULL, req->len,
                                                                            req->data);
    if (!m)
        return di_fail(err, DI_EINVAL, "PrefillRequest: not a valid message");
    sreq *r = NULL;
    di_status st = request_new(s, m->request_id, m->prompt, m->n_prompt, m->sampling,
                               m->priority, &r, err);
    di__prefill__prefill_request__free_unpacked(m, NULL);
    return st == DI_OK ? request_queue(s, r, call, err) : st;
}

/* The manifest and the first token of a Decode request, into r. */
static di_status decode_fields(const engsvc *s, const Di__Decode__DecodeRequest *m, sreq *r,
                               di_error *err)
{
    const Di__Prefill__HandoffManifest *h = m->handoff;
    if (!h || h->handoff_key.len != KVKEY_BYTES)
        return di_fail(err, DI_EINVAL, "handoff.handoff_key: want %u bytes", KVKEY_BYTES);
    if (h->model_id != s->g.model_id)
        return di_fail(err, DI_EINVAL, "handoff.model_id: %016llx, this engine runs %016llx",
                       (unsigned long long)h->model_id, (unsigned long long)s->g.model_id);
    if (h->handoff_bytes == 0 || h->handoff_bytes > HANDOFF_GET_MAX)
        return di_fail(err, DI_EINVAL, "handoff.handoff_bytes: %llu, want 1..%llu",
                       (unsigned long long)h->handoff_bytes,
                       (unsigned long long)HANDOFF_GET_MAX);
    if (!m->first || m->first->id >= s->cfg.rm->w->config.vocab_size)
        return di_fail(err, DI_EINVAL, "first: the first token is missing or outside the "
                       "vocabulary");
    if (r->max_tokens < 2)
        return di_fail(err, DI_EINVAL, "sampling.max_tokens: %u leaves nothing to decode",
                       r->max_tokens);
    r->first_tok = (int32_t)m->first->id;
    r->hbytes = h->handoff_bytes;
    r->hexpires_ms = h->handoff_expires_ms;
    r->hstore = h->store_id;
    memcpy(r->hkey, h->handoff_key.data, KVKEY_BYTES);
    r->hobj = aligned_alloc(8, (h->handoff_bytes + 7) / 8 * 8);
    if (!r->hobj)
        return di_fail(err, DI_ENOMEM, "handoff of %llu bytes",
                       (unsigned long long)h->handoff_bytes);
    return DI_OK;
}

static di_status decode_start(void *svc, const rpc_request *req, rpc_call *call, di_error *err)
{
    engsvc *s = svc;
    Di__Decode__DecodeRequest *m = di__decode__decode_request__unpack(NULL, req->len, req->data);
    if (!m)
        return di_fail(err, DI_EINVAL, "DecodeRequest: not a valid message");
    sreq *r = NULL;
    di_status st = request_new(s, m->request_id, m->prompt, m->n_prompt, m->sampling,
                               m->priority, &r, err);
    if (st == DI_OK && (st = decode_fields(s, m, r, err)) != DI_OK)
        engsvc_req_free(r);
    di__decode__decode_request__free_unpacked(m, NULL);
    return st == DI_OK ? request_queue(s, r, call, err) : st;
}

static di_status pack_reply(const ProtobufCMessage *m, rpc_reply *reply, di_error *err)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    reply->data = n ? malloc(n) : NULL;
    if (n && !reply->data)
        return di_fail(err, DI_ENOMEM, "reply");
    reply->len = n ? protobuf_c_message_pack(m, reply->data) : 0;
    return DI_OK;
}

static di_status get_load(void *svc, const rpc_request *req, rpc_reply *reply, di_error *err)
{
    (void)req;
    engsvc *s = svc;
    Di__Engine__Load l = DI__ENGINE__LOAD__INIT;
    pthread_mutex_lock(&s->mu);
    l.rank = s->cfg.rank;
    l.world = s->cfg.world;
    l.queued_prompt_tokens = s->queued_prompt_tokens;
    l.running = s->running;
    l.waiting = s->waiting + s->n_inbox;
    l.free_blocks = s->free_blocks;
    l.total_blocks = s->total_blocks;
    l.free_slots = s->free_slots;
    l.total_slots = s->total_slots;
    l.prefill_tokens_per_s = s->prefill_tps;
    l.decode_step_ms = s->decode_ms;
    l.draining = s->draining;
    l.prompt_tokens_cached = s->cached_prompt_tokens;
    l.prompt_tokens_computed = s->computed_prompt_tokens;
    l.store_failures = s->store_failures;
    l.decode_steps = s->decode_steps;
    l.steps_issued_ahead = s->steps_issued_ahead;
    pthread_mutex_unlock(&s->mu);
    return pack_reply(&l.base, reply, err);
}

static di_status health(void *svc, const rpc_request *req, rpc_reply *reply, di_error *err)
{
    (void)req;
    engsvc *s = svc;
    Di__Engine__HealthReply h = DI__ENGINE__HEALTH_REPLY__INIT;
    pthread_mutex_lock(&s->mu);
    h.serving = !s->draining && !s->stopping;
    pthread_mutex_unlock(&s->mu);
    h.model = (char *)(s->cfg.model_name ? s->cfg.model_name : "");
    h.model_id = s->g.model_id;
    h.backend = (char *)s->cfg.be->name;
    h.uptime_ms = (di_mono_ns() - s->t0) / 1000000u;
    return pack_reply(&h.base, reply, err);
}

static di_status abort_req(void *svc, const rpc_request *req, rpc_reply *reply, di_error *err)
{
    engsvc *s = svc;
    Di__Engine__AbortRequest *m = di__engine__abort_request__unpack(NULL, req->len, req->data);
    if (!m)
        return di_fail(err, DI_EINVAL, "AbortRequest: not a valid message");
    di_status st = request_id_check(m->request_id, err);
    Di__Engine__AbortReply a = DI__ENGINE__ABORT_REPLY__INIT;
    if (st == DI_OK) {
        /* the inbox and the request list are walked under the lock; a found request is only
         * marked, the engine thread ends it */
        pthread_mutex_lock(&s->mu);
        for (sreq *r = s->inbox; r; r = r->next)
            if (strcmp(r->rid, m->request_id) == 0 && !atomic_load(&r->cancelled)) {
                atomic_store(&r->cancel_why, DI_ECANCELED);
                atomic_store(&r->cancelled, 1);
                a.found = 1;
            }
        for (sreq *r = s->reqs; r; r = r->next)
            if (strcmp(r->rid, m->request_id) == 0 && !atomic_load(&r->cancelled)) {
                atomic_store(&r->cancel_why, DI_ECANCELED);
                atomic_store(&r->cancelled, 1);
                a.found = 1;
            }
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        st = pack_reply(&a.base, reply, err);
    }
    di__engine__abort_request__free_unpacked(m, NULL);
    return st;
}

static const rpc_method k_prefill_methods[] = {
    {"/di.prefill.Prefill/GetLoad", get_load, 1000, 1, 64, RPC_ROLE_ENGINE},
    {"/di.prefill.Prefill/Health", health, 1000, 1, 64, RPC_ROLE_ENGINE},
    {"/di.prefill.Prefill/Abort", abort_req, 5000, 1, 1024, RPC_ROLE_ENGINE},
};
static const rpc_method k_decode_methods[] = {
    {"/di.decode.Decode/GetLoad", get_load, 1000, 1, 64, RPC_ROLE_ENGINE},
    {"/di.decode.Decode/Health", health, 1000, 1, 64, RPC_ROLE_ENGINE},
    {"/di.decode.Decode/Abort", abort_req, 5000, 1, 1024, RPC_ROLE_ENGINE},
};
static const rpc_async_method k_prefill_async[] = {
    {"/di.prefill.Prefill/Prefill", prefill_start, 0, 120000, 0, MAX_REQUEST_BYTES,
     RPC_ROLE_ENGINE},
};
static const rpc_async_method k_decode_async[] = {
    {"/di.decode.Decode/Decode", decode_start, 1, 600000, 0, MAX_REQUEST_BYTES, RPC_ROLE_ENGINE},
};

const rpc_method *engsvc_methods(engsvc_kind kind, size_t *n)
{
    *n = 3;
    return kind == ENGSVC_PREFILL ? k_prefill_methods : k_decode_methods;
}

const rpc_async_method *engsvc_async_methods(engsvc_kind kind, size_t *n)
{
    *n = 1;
    return kind == ENGSVC_PREFILL ? k_prefill_async : k_decode_async;
}
