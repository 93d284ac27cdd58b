/* grpc_api.c: Generate, Abort and RegisterRank on common/net/rpc (see grpc_api.h). */
#include "router/grpc_api.h"

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/net/rpc.h"
#include "common/service/options.h"
#include "router.pb-c.h"

struct gapi_server {
    gapi_config cfg;
    rpc_server *srv;
    pthread_mutex_t mu;         /* guards head and live */
    struct gsess *head;         /* streams alive, for Abort by id */
    unsigned live;
    atomic_uint_fast64_t next_id;
};

/* One Generate stream. Two references: the start's (dropped once the backend has the
 * request or refused it) and the backend's (dropped in on_finish). The last one finishes the
 * call. abort_sent makes the backend abort happen once; it waits for `started` (the handle). */
typedef struct gsess {
    gapi_server *g;
    rpc_call *call;
    pthread_mutex_t mu;  /* guards the fields below */
    int refs;
    uint64_t handle;     /* the backend's, valid once started */
    bool started, abort_wanted, abort_sent, finished;
    tok_stream *ts;      /* streaming detokeniser */
    oai_request req;     /* the checked request */
    uint32_t n_gen;      /* tokens streamed */
    di_status st;        /* the call's final status */
    char msg[320];       /* its message when not DI_OK */
    char id[32];         /* "gen-N" */
    struct gsess *next;
} gsess;

static void maybe_abort(gsess *s)
{
    pthread_mutex_lock(&s->mu);
    s->abort_wanted = true;
    bool send = s->started && !s->abort_sent && !s->finished;
    if (send)
        s->abort_sent = true;
    pthread_mutex_unlock(&s->mu);
    if (send)
        s->g->cfg.backend.abort(s->g->cfg.backend.self, s->handle);
}

static void on_cancel(void *ud, di_status why)
{
    (void)why;
    maybe_abort(ud);
}

static void release(gsess *s)
{
    pthread_mutex_lock(&s->mu);
    int left = --s->refs;
    pthread_mutex_unlock(&s->mu);
    if (left > 0)
        return;
    gapi_server *g = s->g;
    pthread_mutex_lock(&g->mu);
    for (gsess **p = &g->head; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            break;
        }
    g->live--;
    pthread_mutex_unlock(&g->mu);
    rpc_call_finish(s->call, s->st, NULL, 0, s->msg);
    tok_stream_free(s->ts);
    oai_request_free(&s->req);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* Packs and queues one reply; a cancelled or overrun stream asks for the abort. */
static void send_reply(gsess *s, const Di__Router__GenerateReply *m)
{
    size_t n = di__router__generate_reply__get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    di_error e = {0};
    di_status st = DI_ENOMEM;
    if (buf) {
        di__router__generate_reply__pack(m, buf);
        st = rpc_call_write(s->call, buf, n, &e);
        free(buf);
    }
    if (st == DI_OK)
        return;
    if (st != DI_ECANCELED) { /* a reader too slow (EFULL) or no memory: the request fails */
        pthread_mutex_lock(&s->mu);
        if (s->st == DI_OK) {
            s->st = st;
            snprintf(s->msg, sizeof s->msg, "stream: %.300s",
                     e.msg[0] ? e.msg : di_status_str(st));
        }
        pthread_mutex_unlock(&s->mu);
    }
    maybe_abort(s);
}

static void on_token(void *ud, const rt_gen_token *t)
{
    gsess *s = ud;
    const char *d = "";
    size_t dn = 0;
    pthread_mutex_lock(&s->mu);
    if (tok_stream_push(s->ts, t->id, &d, &dn, NULL) != DI_OK)
        d = "", dn = 0; /* an id the tokenizer lacks adds no text */
    char *text = strndup(d, dn);
    uint32_t index = s->n_gen++;
    pthread_mutex_unlock(&s->mu);
    Di__Engine__TokenLogprob tops[RT_MAX_TOP], *topp[RT_MAX_TOP];
    uint32_t nt = t->n_top < s->req.top_logprobs ? t->n_top : s->req.top_logprobs;
    for (uint32_t k = 0; k < nt && k < RT_MAX_TOP; k++) {
        di__engine__token_logprob__init(&tops[k]);
        tops[k].id = (uint32_t)t->top_ids[k];
        tops[k].logprob = t->top_lps[k];
        topp[k] = &tops[k];
    }
    Di__Engine__Token tk = DI__ENGINE__TOKEN__INIT;
    tk.id = (uint32_t)t->id;
    tk.logprob = t->logprob;
    tk.index = index;
    tk.n_top = nt;
    tk.top = nt ? topp : NULL;
    Di__Router__GenerateReply m = DI__ROUTER__GENERATE_REPLY__INIT;
    m.token = &tk;
    m.text = text ? text : (char *)"";
    send_reply(s, &m);
    free(text);
}

/* The request continues on another decode rank: one message with `continued` says so. */
static void on_continue(void *ud, const char *from, const char *to, uint32_t n_done)
{
    gsess *s = ud;
    Di__Router__Continued c = DI__ROUTER__CONTINUED__INIT;
    c.from_instance = (char *)(from ? from : "");
    c.to_instance = (char *)(to ? to : "");
    c.after_tokens = n_done;
    Di__Router__GenerateReply m = DI__ROUTER__GENERATE_REPLY__INIT;
    m.text = (char *)"";
    m.continued = &c;
    send_reply(s, &m);
}

static void on_finish(void *ud, rt_finish reason, uint32_t cached, const char *instance,
                      di_status st, const char *msg)
{
    gsess *s = ud;
    if (reason == RT_FINISH_ERROR) {
        pthread_mutex_lock(&s->mu);
        s->st = st == DI_OK ? DI_EINTERNAL : st;
        snprintf(s->msg, sizeof s->msg, "%s", msg && msg[0] ? msg : di_status_str(s->st));
        s->finished = true;
        pthread_mutex_unlock(&s->mu);
        release(s);
        return;
    }
    const char *tail = "";
    size_t tn = 0;
    pthread_mutex_lock(&s->mu);
    tok_stream_finish(s->ts, &tail, &tn, NULL);
    char *text = strndup(tail, tn);
    Di__Router__Usage u = DI__ROUTER__USAGE__INIT;
    u.prompt_tokens = (uint32_t)s->req.prompt_ids.n;
    u.completion_tokens = s->n_gen;
    u.cached_tokens = cached;
    pthread_mutex_unlock(&s->mu);
    Di__Router__GenerateReply m = DI__ROUTER__GENERATE_REPLY__INIT;
    m.text = text ? text : (char *)"";
    m.finish = reason == RT_FINISH_ABORT ? DI__ENGINE__FINISH__FINISH_ABORTED
               : reason == RT_FINISH_EOS ? DI__ENGINE__FINISH__FINISH_STOP
                                         : DI__ENGINE__FINISH__FINISH_LENGTH;
    m.usage = &u;
    m.instance = (char *)(instance ? instance : "");
    send_reply(s, &m);
    free(text);
    pthread_mutex_lock(&s->mu);
    s->finished = true;
    pthread_mutex_unlock(&s->mu);
    release(s);
}

/* The request as the HTTP API's JSON body, so that oai_parse checks it. NULL: no memory. */
static char *request_json(const Di__Router__GenerateRequest *r)
{
    json_t *o = json_object();
    if (!o)
        return NULL;
    if (r->model && r->model[0])
        json_object_set_new(o, "model", json_string(r->model));
    if (r->prompt_text && r->prompt_text[0]) {
        json_object_set_new(o, "prompt", json_stringn(r->prompt_text, strlen(r->prompt_text)));
    } else {
        json_t *a = json_array();
        for (size_t i = 0; a && i < r->n_prompt_ids; i++)
            json_array_append_new(a, json_integer((json_int_t)r->prompt_ids[i]));
        json_object_set_new(o, "prompt", a);
    }
    if (r->max_tokens)
        json_object_set_new(o, "max_tokens", json_integer(r->max_tokens));
    if (r->has_temperature)
        json_object_set_new(o, "temperature", json_real(r->temperature));
    if (r->top_p != 0)
        json_object_set_new(o, "top_p", json_real(r->top_p));
    if (r->top_k != 0)
        json_object_set_new(o, "top_k", json_integer(r->top_k));
    if (r->has_seed)
        json_object_set_new(o, "seed", json_integer((json_int_t)r->seed));
    if (r->top_logprobs)
        json_object_set_new(o, "logprobs", json_integer(r->top_logprobs));
    if (r->ignore_eos)
        json_object_set_new(o, "ignore_eos", json_true());
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

static di_status generate_start(void *svc, const rpc_request *rq, rpc_call *call, di_error *err)
{
    gapi_server *g = svc;
    Di__Router__GenerateRequest *r =
        di__router__generate_request__unpack(NULL, rq->len, rq->data);
    if (!r)
        return di_fail(err, DI_EPROTO, "GenerateRequest does not parse");
    if (r->prompt_text && r->prompt_text[0] && r->n_prompt_ids) {
        di__router__generate_request__free_unpacked(r, NULL);
        return di_fail(err, DI_EINVAL, "prompt: give prompt_text or prompt_ids, not both");
    }
    if (r->seed > (uint64_t)INT64_MAX && r->has_seed) {
        di__router__generate_request__free_unpacked(r, NULL);
        return di_fail(err, DI_EINVAL, "seed: %llu is over 2^63-1",
                       (unsigned long long)r->seed);
    }
    char *body = request_json(r);
    di__router__generate_request__free_unpacked(r, NULL);
    if (!body)
        return di_fail(err, DI_ENOMEM, "cannot build the request");
    gsess *s = calloc(1, sizeof *s);
    if (!s) {
        free(body);
        return di_fail(err, DI_ENOMEM, "cannot allocate the request");
    }
    oai_error oe = {0};
    oai_limits lim = g->cfg.limits;
    lim.max_body_bytes = strlen(body) + 1; /* the gRPC server bounded the message already */
    di_status st = oai_parse(OAI_COMPLETION, body, strlen(body), &lim, &s->req, &oe);
    free(body);
    if (st == DI_OK)
        st = oai_tokenize(&s->req, g->cfg.tok, g->cfg.add_bos, &lim, &oe);
    if (st != DI_OK) {
        oai_request_free(&s->req);
        free(s);
        if (oe.param[0] && !strstr(oe.message, oe.param))
            return di_fail(err, st, "%s: %s", oe.param, oe.message);
        return di_fail(err, st, "%s", oe.message);
    }
    if (tok_stream_new(g->cfg.tok, TOK_DECODE_SKIP_SPECIAL, &s->ts, NULL) != DI_OK) {
        oai_request_free(&s->req);
        free(s);
        return di_fail(err, DI_ENOMEM, "cannot allocate the detokeniser");
    }
    pthread_mutex_init(&s->mu, NULL);
    s->g = g;
    s->call = call;
    s->refs = 1;
    snprintf(s->id, sizeof s->id, "gen-%llu",
             (unsigned long long)atomic_fetch_add(&g->next_id, 1));
    pthread_mutex_lock(&g->mu);
    s->next = g->head;
    g->head = s;
    g->live++;
    pthread_mutex_unlock(&g->mu);
    /* From here the call is ours: every path ends in release(). */
    Di__Router__GenerateReply first = DI__ROUTER__GENERATE_REPLY__INIT;
    first.request_id = s->id;
    send_reply(s, &first);
    rpc_call_on_cancel(call, on_cancel, s);
    rt_gen_req br = oai_gen_req(&s->req);
    rt_gen_cb cb = {on_token, on_finish, s, on_continue};
    uint64_t handle = 0;
    di_error be = {0};
    s->refs = 2;
    st = g->cfg.backend.generate(g->cfg.backend.self, &br, &cb, &handle, &be);
    if (st != DI_OK) {
        s->st = st;
        snprintf(s->msg, sizeof s->msg, "%s", be.msg[0] ? be.msg : di_status_str(st));
        s->refs = 1; /* no callback will come */
        release(s);
        return DI_OK;
    }
    pthread_mutex_lock(&s->mu);
    s->handle = handle;
    s->started = true;
    bool wanted = s->abort_wanted;
    pthread_mutex_unlock(&s->mu);
    if (wanted)
        maybe_abort(s);
    release(s);
    return DI_OK;
}

static di_status abort_handler(void *svc, const rpc_request *rq, rpc_reply *reply,
                               di_error *err)
{
    gapi_server *g = svc;
    Di__Engine__AbortRequest *r = di__engine__abort_request__unpack(NULL, rq->len, rq->data);
    if (!r)
        return di_fail(err, DI_EPROTO, "AbortRequest does not parse");
    size_t idlen = r->request_id ? strlen(r->request_id) : 0;
    if (idlen < 1 || idlen > 128) {
        di__engine__abort_request__free_unpacked(r, NULL);
        return di_fail(err, DI_EINVAL, "request_id: want 1..128 bytes, got %zu", idlen);
    }
    Di__Engine__AbortReply out = DI__ENGINE__ABORT_REPLY__INIT;
    gsess *hit = NULL;
    pthread_mutex_lock(&g->mu);
    for (gsess *s = g->head; s && !hit; s = s->next)
        if (strcmp(s->id, r->request_id) == 0) {
            pthread_mutex_lock(&s->mu);
            if (s->refs > 0) { /* a reference keeps it alive while it is aborted */
                s->refs++;
                hit = s;
            }
            pthread_mutex_unlock(&s->mu);
        }
    pthread_mutex_unlock(&g->mu);
    if (hit) {
        out.found = true;
        maybe_abort(hit);
        release(hit);
    }
    di__engine__abort_request__free_unpacked(r, NULL);
    size_t n = di__engine__abort_reply__get_packed_size(&out);
    reply->data = n ? malloc(n) : NULL;
    if (n && !reply->data)
        return di_fail(err, DI_ENOMEM, "cannot allocate the reply");
    if (n)
        di__engine__abort_reply__pack(&out, reply->data);
    reply->len = n;
    return DI_OK;
}

static di_status register_handler(void *svc, const rpc_request *rq, rpc_reply *reply,
                                  di_error *err)
{
    gapi_server *g = svc;
    if (!g->cfg.on_register)
        return di_fail(err, DI_EUNSUPPORTED, "this router takes no registrations");
    Di__Router__RegisterRequest *r =
        di__router__register_request__unpack(NULL, rq->len, rq->data);
    if (!r)
        return di_fail(err, DI_EPROTO, "RegisterRequest does not parse");
    char host[256];
    int port = 0;
    di_status st = DI_OK;
    if (r->role != DI__ROUTER__ROLE__ROLE_PREFILL && r->role != DI__ROUTER__ROLE__ROLE_DECODE)
        st = di_fail(err, DI_EINVAL, "role: %d is neither prefill (0) nor decode (1)", r->role);
    else if (!r->address || strlen(r->address) < 3 || strlen(r->address) > 127)
        st = di_fail(err, DI_EINVAL, "address: want HOST:PORT of 3..127 bytes");
    else if (svc_parse_hostport(r->address, host, sizeof host, &port, err) != DI_OK || port == 0)
        st = di_fail(err, DI_EINVAL, "address %s: want HOST:PORT with a port 1..65535",
                     r->address);
    Di__Router__RegisterReply out = DI__ROUTER__REGISTER_REPLY__INIT;
    if (st == DI_OK)
        st = g->cfg.on_register(g->cfg.register_ud, r->role, r->address, &out.heartbeat_ms,
                                &out.ranks, err);
    di__router__register_request__free_unpacked(r, NULL);
    if (st != DI_OK)
        return st;
    size_t n = di__router__register_reply__get_packed_size(&out);
    reply->data = malloc(n ? n : 1);
    if (!reply->data)
        return di_fail(err, DI_ENOMEM, "cannot allocate the reply");
    di__router__register_reply__pack(&out, reply->data);
    reply->len = n;
    return DI_OK;
}

static void log_error(void *ud, const char *method, const char *peer, di_status st,
                      const char *msg)
{
    const di_logger *log = ud;
    if (log)
        di_log(log, DI_LOG_DEBUG, "%s from %s: %s: %s", method, peer, di_status_str(st), msg);
}

di_status gapi_start(const gapi_config *cfg, gapi_server **out, int *port, di_error *err)
{
    if (!cfg || !cfg->listen || !cfg->tok || !cfg->backend.generate || !cfg->backend.abort ||
        !cfg->limits.model || cfg->threads < 1 || cfg->request_timeout_ms < 1)
        return di_fail(err, DI_EINVAL, "gapi_start: listen, tok, backend, limits.model, "
                       "threads >= 1 and request_timeout_ms >= 1 are required");
    gapi_server *g = calloc(1, sizeof *g);
    if (!g)
        return di_fail(err, DI_ENOMEM, "cannot allocate the gRPC API");
    g->cfg = *cfg;
    pthread_mutex_init(&g->mu, NULL);
    atomic_init(&g->next_id, 1);
    const rpc_method methods[] = {
        {GAPI_SERVICE "Abort", abort_handler, 5000, 1, 4096, RPC_ROLE_ENGINE},
        {GAPI_SERVICE "RegisterRank", register_handler, 5000, 1, 4096, RPC_ROLE_ADMIN},
    };
    const rpc_async_method async[] = {
        {GAPI_SERVICE "Generate", generate_start, 1, cfg->request_timeout_ms, 0,
         (uint32_t)(cfg->limits.max_body_bytes + 16 * (size_t)cfg->limits.max_prompt_tokens),
         RPC_ROLE_ENGINE},
    };
    rpc_server_config sc = {.listen = cfg->listen, .methods = methods, .n_methods = 2,
                            .async_methods = async, .n_async_methods = 1, .svc = g,
                            .threads = cfg->threads, .engine_token = cfg->token,
                            .admin_token = cfg->admin_token, .on_error = log_error,
                            .on_error_ud = (void *)cfg->log};
    di_status st = rpc_server_start(&sc, &g->srv, port, err);
    if (st != DI_OK) {
        pthread_mutex_destroy(&g->mu);
        free(g);
        return st;
    }
    *out = g;
    return DI_OK;
}

void gapi_stop(gapi_server *g, uint32_t grace_ms)
{
    if (!g)
        return;
    rpc_server_stop(g->srv, grace_ms);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

unsigned gapi_live(gapi_server *g)
{
    pthread_mutex_lock(&g->mu);
    unsigned n = g->live;
    pthread_mutex_unlock(&g->mu);
    return n;
}
