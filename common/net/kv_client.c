#include "common/net/kv_client.h"

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/net/kvstore.pb-c.h"
#include "common/net/rpc.h"
#include "common/net/ucx_xport.h"
#include "common/util/clock.h"

#define UCX_WINDOW 16 /* transfers in flight per batch */

/* One job of a batch: item `index` of the batch handed to pool_begin. */
typedef void (*job_fn)(void *batch, size_t index);

/* Helper threads that share a batch's per-item work (verifying objects as they arrive) with
 * the caller's thread. */
typedef struct work_pool {
    pthread_mutex_t mu;
    pthread_cond_t work;         /* an index was queued, or stop */
    pthread_cond_t idle;         /* outstanding reached 0 */
    size_t queue[KVC_MAX_BATCH]; /* FIFO of item indices */
    size_t head, tail;           /* queue[head..tail) */
    size_t outstanding;          /* queued or being worked on */
    job_fn fn;                   /* the batch's job */
    void *batch;                 /* its argument */
    int stop;                    /* ends the threads */
    pthread_t *threads;
    int n_threads;
} work_pool;

struct kvc_client {
    kvc_options o;            /* copy; strings point at the copies below */
    char *target, *token, *tls_ca, *tls_name, *tls_cert, *tls_key;
    rpc_client *rpc;          /* control channel */
    ucxt_ctx *ucx;            /* UCX context (created at the first connect) */
    ucxt_peer *peer;          /* endpoint to the store's worker */
    int connected;            /* 1 while peer matches info.store_id */
    int grpc;                 /* 1: bytes travel inside Get and Put (no peer) */
    kvc_store_info info;      /* from Connect */
    work_pool vp;             /* helpers (n_threads may be 0) */
    int vp_started;           /* vp initialised */
};

/* Commit and Abort requests have the same fields; commit_or_abort packs one struct with either
 * descriptor. */
_Static_assert(sizeof(Di__Kvstore__CommitRequest) == sizeof(Di__Kvstore__AbortRequest) &&
                   offsetof(Di__Kvstore__CommitRequest, alloc_ids) ==
                       offsetof(Di__Kvstore__AbortRequest, alloc_ids),
               "AbortRequest differs from CommitRequest");

di_status kvc_data_path_parse(const char *s, kvc_data_path *out, di_error *err)
{
    static const char *const names[] = {"auto", "ucx", "grpc"};
    for (int i = 0; s && i < 3; i++)
        if (strcmp(s, names[i]) == 0) {
            *out = (kvc_data_path)i;
            return DI_OK;
        }
    return di_fail(err, DI_EINVAL, "\"%s\" is not a data path (auto, ucx or grpc)",
                   s ? s : "(null)");
}

const char *kvc_data_path_name(kvc_data_path p)
{
    return p == KVC_PATH_UCX ? "ucx" : p == KVC_PATH_GRPC ? "grpc" : "auto";
}

void kvc_options_default(kvc_options *o)
{
    memset(o, 0, sizeof(*o));
    o->deadline_ms = 10000;
    o->lease_ms = 10000;
    o->verify = 1;
    o->verify_threads = 1;
}

/* ---------------------------------------------------------------- per-item work */

static void verify_item(const kv_geometry *g, kvc_item *it)
{
    di_status st = kvkey_object_verify(it->cls, &it->key, it->buf, it->bytes, g, &it->error);
    if (st != DI_OK) {
        it->status = st;
        di_error_prefix(&it->error, "%s read from the store failed verification: ",
                        kvkey_class_name(it->cls));
    }
}

/* What the verification jobs of one get batch need. */
typedef struct batch_ctx {
    kvc_client *c;
    kvc_item *items;
    const size_t *which;       /* transfer index -> item index */
} batch_ctx;

/* After a transfer: verify the bytes that arrived. */
static void job_verify(void *arg, size_t op)
{
    batch_ctx *b = arg;
    verify_item(&b->c->info.geometry, &b->items[b->which[op]]);
}

static void *pool_main(void *arg)
{
    work_pool *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->head == p->tail && !p->stop)
            pthread_cond_wait(&p->work, &p->mu);
        if (p->stop)
            break;
        size_t i = p->queue[p->head++];
        job_fn fn = p->fn;
        void *batch = p->batch;
        pthread_mutex_unlock(&p->mu);
        fn(batch, i);
        pthread_mutex_lock(&p->mu);
        if (--p->outstanding == 0)
            pthread_cond_broadcast(&p->idle);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void pool_start(work_pool *p, int n)
{
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->idle, NULL);
    p->threads = n > 0 ? calloc((size_t)n, sizeof(pthread_t)) : NULL;
    for (int i = 0; p->threads && i < n; i++)
        if (pthread_create(&p->threads[i], NULL, pool_main, p) == 0)
            p->n_threads++;
}

static void pool_stop(work_pool *p)
{
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads; i++)
        pthread_join(p->threads[i], NULL);
    free(p->threads);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->idle);
}

/* Sets the job of the coming pushes (the pool is idle between batches). */
static void pool_begin(work_pool *p, job_fn fn, void *batch)
{
    p->fn = fn;
    p->batch = batch;
    p->head = p->tail = 0;
}

/* Queues one index; without helper threads the job runs here and now. */
static void pool_push(work_pool *p, size_t i)
{
    if (p->n_threads == 0) {
        p->fn(p->batch, i);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->queue[p->tail++] = i;
    p->outstanding++;
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
}

/* The caller's thread takes jobs too, then waits until the helpers are done. */
static void pool_drain(work_pool *p)
{
    if (p->n_threads == 0)
        return;
    pthread_mutex_lock(&p->mu);
    while (p->outstanding > 0) {
        if (p->head < p->tail) {
            size_t i = p->queue[p->head++];
            pthread_mutex_unlock(&p->mu);
            p->fn(p->batch, i);
            pthread_mutex_lock(&p->mu);
            if (--p->outstanding == 0)
                pthread_cond_broadcast(&p->idle);
        } else
            pthread_cond_wait(&p->idle, &p->mu);
    }
    pthread_mutex_unlock(&p->mu);
}

/* ---------------------------------------------------------------- open / close */

static char *dup_or_null(const char *s, int *oom)
{
    if (!s)
        return NULL;
    char *d = strdup(s);
    if (!d)
        *oom = 1;
    return d;
}

di_status kvc_open(const kvc_options *o, kvc_client **out, di_error *err)
{
    if (!o || !o->target || !*o->target || !out)
        return di_fail(err, DI_EINVAL, "kvc_open: a store target host:port is required");
    kvc_client *c = calloc(1, sizeof(*c));
    if (!c)
        return di_fail(err, DI_ENOMEM, "cannot allocate a kvstore client");
    c->o = *o;
    int oom = 0;
    c->o.target = c->target = dup_or_null(o->target, &oom);
    c->o.token = c->token = dup_or_null(o->token, &oom);
    c->o.tls_ca_pem = c->tls_ca = dup_or_null(o->tls_ca_pem, &oom);
    c->o.tls_target_name = c->tls_name = dup_or_null(o->tls_target_name, &oom);
    c->o.tls_cert_pem = c->tls_cert = dup_or_null(o->tls_cert_pem, &oom);
    c->o.tls_key_pem = c->tls_key = dup_or_null(o->tls_key_pem, &oom);
    if (!c->o.deadline_ms)
        c->o.deadline_ms = 10000;
    if (!c->o.lease_ms)
        c->o.lease_ms = 10000;
    if (oom) {
        kvc_close(c);
        return di_fail(err, DI_ENOMEM, "cannot copy the client options");
    }
    if (!c->tls_cert != !c->tls_key) {
        kvc_close(c);
        return di_fail(err, DI_EINVAL, "a client certificate needs its key, and a key its "
                                       "certificate");
    }
    if (c->tls_cert && !c->tls_ca) {
        kvc_close(c);
        return di_fail(err, DI_EINVAL, "a client certificate needs TLS: give the store's CA too");
    }
    rpc_client_config rc = {.target = c->target, .token = c->token, .tls_ca_pem = c->tls_ca,
                            .tls_cert_pem = c->tls_cert, .tls_key_pem = c->tls_key,
                            .tls_target_name = c->tls_name,
                            .max_reply_bytes = KVC_GRPC_MAX_MESSAGE};
    if (o->data_path < KVC_PATH_AUTO || o->data_path > KVC_PATH_GRPC) {
        kvc_close(c);
        return di_fail(err, DI_EINVAL, "unknown data path %d", (int)o->data_path);
    }
    di_status st = rpc_client_open(&rc, &c->rpc, err);
    if (st != DI_OK) {
        kvc_close(c);
        return st;
    }
    pool_start(&c->vp, o->verify ? o->verify_threads : 0);
    c->vp_started = 1;
    *out = c;
    return DI_OK;
}

/* Closes the UCX endpoint. After a failed one (a transfer past its deadline, a peer lost) the
 * worker goes too: the requests of a transfer cut by a store that died never complete there,
 * and a new endpoint on that worker to the restarted store stalled its transfers. */
static void drop_transport(kvc_client *c)
{
    int failed = c->peer && ucxt_peer_failed(c->peer);
    c->peer = ucxt_peer_close(c->peer);
    if (failed)
        c->ucx = ucxt_destroy(c->ucx);
    c->connected = 0;
}

kvc_client *kvc_close(kvc_client *c)
{
    if (!c)
        return NULL;
    drop_transport(c);
    c->ucx = ucxt_destroy(c->ucx);
    c->rpc = rpc_client_close(c->rpc);
    if (c->vp_started)
        pool_stop(&c->vp);
    free(c->target);
    free(c->token);
    free(c->tls_ca);
    free(c->tls_name);
    if (c->tls_key)
        memset(c->tls_key, 0, strlen(c->tls_key));
    free(c->tls_key);
    free(c->tls_cert);
    free(c);
    return NULL;
}

void kvc_cancel(kvc_client *c)
{
    if (c && c->rpc)
        rpc_client_cancel(c->rpc);
}

/* ---------------------------------------------------------------- calls */

static uint32_t ms_until(uint64_t deadline_ns)
{
    uint64_t now = di_mono_ns();
    return now >= deadline_ns ? 1 : (uint32_t)((deadline_ns - now + 999999) / 1000000);
}

/* Methods retried after DI_EUNAVAIL until the deadline: repeating them is harmless (a lease
 * granted twice ends by its timeout). Alloc and Commit are not: a lost reply would turn into a
 * conflict with the caller's own allocation. */
static const char *const retry_unavailable[] = {"Connect", "Lookup", "Lease", "Get", "Release",
                                                "Delete", "Abort", "ReportCorrupt"};

static int may_retry(const char *method)
{
    for (size_t i = 0; i < sizeof(retry_unavailable) / sizeof(retry_unavailable[0]); i++)
        if (strcmp(method, retry_unavailable[i]) == 0)
            return 1;
    return 0;
}

/* Waits before the k-th retry (50 ms doubling to 500 ms), not past the deadline. 0 when no time
 * is left. A channel that is not connected (the store down or restarting) is waited on instead
 * of slept through: it reconnects while waited on, and the retry goes as soon as it has. */
static int backoff(kvc_client *c, unsigned k, uint64_t deadline_ns)
{
    uint64_t now = di_mono_ns();
    uint64_t ms = 50ull << (k < 4 ? k : 4);
    if (ms > 500)
        ms = 500;
    if (now + ms * 1000000ull >= deadline_ns)
        return 0;
    if (!rpc_client_connected(c->rpc)) {
        rpc_client_wait_connected(c->rpc, (uint32_t)ms);
        return 1;
    }
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)(ms * 1000000ull)};
    nanosleep(&ts, NULL);
    return 1;
}

/* One RPC: packs msg, calls method, returns the reply bytes. */
static di_status call_packed(kvc_client *c, const char *method, const ProtobufCMessage *msg,
                             uint64_t deadline_ns, uint8_t **reply, size_t *len, di_error *err)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf)
        return di_fail(err, DI_ENOMEM, "cannot allocate a %zu-byte request", n);
    protobuf_c_message_pack(msg, buf);
    char full[64];
    snprintf(full, sizeof(full), KVC_SERVICE "%s", method);
    di_status st;
    unsigned k = 0;
    do
        st = rpc_client_call(c->rpc, full, buf, n, ms_until(deadline_ns), reply, len, err);
    while (st == DI_EUNAVAIL && may_retry(method) && backoff(c, k++, deadline_ns));
    free(buf);
    if (st == DI_EUNAVAIL)
        drop_transport(c); /* the store may come back as another instance */
    return st;
}

/* One RPC with protobuf messages: packs req, calls method, unpacks the reply as desc. *out is
 * freed with protobuf_c_message_free_unpacked. */
static di_status call_msg(kvc_client *c, const char *method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *desc, uint64_t deadline_ns,
                          ProtobufCMessage **out, di_error *err)
{
    uint8_t *rep = NULL;
    size_t len = 0;
    di_status st = call_packed(c, method, req, deadline_ns, &rep, &len, err);
    if (st != DI_OK)
        return st;
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, len, rep);
    free(rep);
    if (!m)
        return di_fail(err, DI_EPROTO, "malformed %s from the store", desc->short_name);
    *out = m;
    return DI_OK;
}

/* Frees a reply whose result count is not the request's and says so. */
static di_status wrong_count(ProtobufCMessage *m, size_t got, size_t want, di_error *err)
{
    const char *name = m->descriptor->short_name;
    protobuf_c_message_free_unpacked(m, NULL);
    return di_fail(err, DI_EPROTO, "%s from the store has %zu results for %zu items", name, got,
                   want);
}

di_status kvc_call(kvc_client *c, const char *method, const void *req, size_t len,
                   uint8_t **reply, size_t *reply_len, di_error *err)
{
    if (!c || !method)
        return di_fail(err, DI_EINVAL, "kvc_call: NULL argument");
    char full[64];
    snprintf(full, sizeof(full), KVC_SERVICE "%s", method);
    return rpc_client_call(c->rpc, full, req, len, c->o.deadline_ms, reply, reply_len, err);
}

static void info_from(kvc_client *c, const Di__Kvstore__ConnectReply *r)
{
    kvc_store_info *in = &c->info;
    memset(in, 0, sizeof(*in));
    in->store_id = r->store_id;
    const Di__Kvstore__Geometry *g = r->geometry;
    kv_geometry *k = &in->geometry;
    k->block_tokens = g->block_tokens;
    k->head_dim = g->head_dim;
    k->index_head_dim = g->index_head_dim;
    k->window = g->window;
    k->ring_positions = g->ring_positions;
    k->n_layers = g->n_layers;
    k->n_draft_stages = g->n_draft_stages;
    k->n_owners = (uint32_t)g->n_owner_layer;
    for (size_t i = 0; i < g->n_owner_layer && i < KV_MAX_OWNERS; i++)
        k->owner_layer[i] = g->owner_layer[i];
    for (size_t i = 0; i < g->n_owner_ratio && i < KV_MAX_OWNERS; i++)
        k->owner_ratio[i] = g->owner_ratio[i];
    k->yoco_boundary = g->yoco_boundary;
    k->model_id = g->model_id;
    in->object_bytes[KVKEY_BLOCK] = r->block_bytes;
    in->object_bytes[KVKEY_WINDOW] = r->window_bytes;
    in->object_bytes[KVKEY_HANDOFF] = r->handoff_max_bytes;
    snprintf(in->durability, sizeof(in->durability), "%s", r->durability ? r->durability : "?");
    in->lease_max_ms = r->lease_max_ms;
    for (size_t c = 0; c < r->n_ttl_ms && c < KVKEY_CLASS_COUNT; c++)
        in->ttl_ms[c] = r->ttl_ms[c];
}

/* The paths a store offers (a store that names none offers UCX only). */
static uint32_t offered(const Di__Kvstore__ConnectReply *r)
{
    return r->data_paths ? r->data_paths : KVC_PATHS_UCX;
}

static di_status check_connect_reply(const Di__Kvstore__ConnectReply *r, di_error *err)
{
    if (!r)
        return di_fail(err, DI_EPROTO, "malformed ConnectReply from the store");
    if (!r->geometry || r->geometry->n_owner_layer > KV_MAX_OWNERS ||
        r->geometry->n_owner_layer != r->geometry->n_owner_ratio ||
        ((offered(r) & KVC_PATHS_UCX) && r->worker_address.len == 0))
        return di_fail(err, DI_EPROTO, "incomplete ConnectReply from the store");
    return DI_OK;
}

/* 1 when the target names this host by a loopback address. */
static int loopback_target(const char *t)
{
    return strncmp(t, "127.", 4) == 0 || strncmp(t, "localhost:", 10) == 0 ||
           strncmp(t, "[::1]:", 6) == 0;
}

/* Picks the data path: 1 for gRPC, 0 for UCX, or a failure when the store does not offer the
 * one asked for. */
static di_status choose_path(const kvc_client *c, uint32_t paths, int *grpc, di_error *err)
{
    kvc_data_path want = c->o.data_path;
    if (want == KVC_PATH_AUTO) {
        int near = loopback_target(c->target) || (c->o.rdma_devices && c->o.rdma_devices[0]);
        want = (paths & KVC_PATHS_UCX) && (near || !(paths & KVC_PATHS_GRPC)) ? KVC_PATH_UCX
                                                                               : KVC_PATH_GRPC;
    }
    unsigned bit = want == KVC_PATH_UCX ? KVC_PATHS_UCX : KVC_PATHS_GRPC;
    if (!(paths & bit))
        return di_fail(err, DI_EUNAVAIL, "the store does not offer the %s data path (its "
                       "--data-path)", kvc_data_path_name(want));
    *grpc = want == KVC_PATH_GRPC;
    return DI_OK;
}

/* The UCX endpoint to the store's worker. */
static di_status connect_ucx(kvc_client *c, const Di__Kvstore__ConnectReply *r, di_error *err)
{
    di_status st = DI_OK;
    if (!c->ucx)
        st = ucxt_create(0, c->o.rdma_devices, &c->ucx, err);
    /* Peer-failure handling where the transports have it (RDMA); shared memory lacks it. */
    int rdma = c->o.rdma_devices && c->o.rdma_devices[0];
    if (st == DI_OK)
        st = ucxt_peer_connect(c->ucx, r->worker_address.data, r->worker_address.len, rdma,
                               &c->peer, err);
    return st;
}

/* Connects (Connect RPC, and the UCX endpoint on that path) unless already connected. */
static di_status ensure_connected(kvc_client *c, uint64_t deadline_ns, di_error *err)
{
    if (c->connected && (c->grpc || !ucxt_peer_failed(c->peer)))
        return DI_OK;
    drop_transport(c);
    Di__Kvstore__ConnectRequest req = DI__KVSTORE__CONNECT_REQUEST__INIT;
    req.model_id = c->o.model_id;
    Di__Kvstore__ConnectReply *r = NULL;
    di_status st = call_msg(c, "Connect", &req.base, &di__kvstore__connect_reply__descriptor,
                            deadline_ns, (ProtobufCMessage **)&r, err);
    if (st != DI_OK)
        return st;
    st = check_connect_reply(r, err);
    int grpc = 0;
    if (st == DI_OK)
        st = choose_path(c, offered(r), &grpc, err);
    if (st == DI_OK && !grpc)
        st = connect_ucx(c, r, err);
    if (st != DI_OK && !grpc && c->o.data_path == KVC_PATH_AUTO &&
        (offered(r) & KVC_PATHS_GRPC)) {
        if (c->o.log)
            di_log(c->o.log, DI_LOG_DEBUG, "UCX to %s failed (%s); using gRPC", c->target,
                   err ? err->msg : "");
        grpc = 1;
        st = DI_OK;
    }
    if (st == DI_OK) {
        c->grpc = grpc;
        info_from(c, r);
        c->info.data_paths = offered(r);
        c->info.path = grpc ? KVC_PATH_GRPC : KVC_PATH_UCX;
        c->connected = 1;
    } else
        drop_transport(c);
    if (r)
        di__kvstore__connect_reply__free_unpacked(r, NULL);
    if (st != DI_OK)
        di_error_prefix(err, "connecting to the store at %s: ", c->target);
    return st;
}

di_status kvc_info(kvc_client *c, kvc_store_info *out, di_error *err)
{
    di_status st = ensure_connected(c, di_mono_ns() + c->o.deadline_ms * 1000000ull, err);
    if (st == DI_OK)
        *out = c->info;
    return st;
}

/* A reply's store id differs from ours: the store restarted; its new worker needs a new
 * endpoint. */
static di_status follow_restart(kvc_client *c, uint64_t store_id, uint64_t deadline_ns,
                                di_error *err)
{
    if (store_id == c->info.store_id)
        return DI_OK;
    drop_transport(c);
    di_status st = ensure_connected(c, deadline_ns, err);
    if (st == DI_OK && c->info.store_id != store_id)
        st = di_fail(err, DI_EUNAVAIL, "the store restarted during the call; retry");
    return st;
}

di_status kvc_lookup(kvc_client *c, const kvkey *keys, size_t n, uint32_t *blocks_hit,
                     uint32_t *windows, size_t max_windows, size_t *n_windows, di_error *err)
{
    if (!c || (n > 0 && !keys) || !blocks_hit || !n_windows || (max_windows > 0 && !windows))
        return di_fail(err, DI_EINVAL, "kvc_lookup: NULL argument");
    if (n > KVC_MAX_LOOKUP)
        return di_fail(err, DI_EINVAL, "%zu keys in one lookup, at most %u", n, KVC_MAX_LOOKUP);
    ProtobufCBinaryData *b = calloc(n ? n : 1, sizeof(*b));
    if (!b)
        return di_fail(err, DI_ENOMEM, "cannot allocate %zu keys", n);
    for (size_t i = 0; i < n; i++)
        b[i] = (ProtobufCBinaryData){KVKEY_BYTES, (uint8_t *)keys[i].b};
    Di__Kvstore__LookupRequest req = DI__KVSTORE__LOOKUP_REQUEST__INIT;
    req.n_block_keys = n;
    req.block_keys = b;
    Di__Kvstore__LookupReply *r = NULL;
    di_status st = call_msg(c, "Lookup", &req.base, &di__kvstore__lookup_reply__descriptor,
                            di_mono_ns() + c->o.deadline_ms * 1000000ull, (ProtobufCMessage **)&r,
                            err);
    free(b);
    if (st != DI_OK)
        return st;
    size_t nw = r->n_window_blocks < max_windows ? r->n_window_blocks : max_windows;
    for (size_t i = 0; i < nw; i++)
        windows[i] = r->window_blocks[i];
    *blocks_hit = r->blocks_hit;
    *n_windows = nw;
    di__kvstore__lookup_reply__free_unpacked(r, NULL);
    return DI_OK;
}

/* ---------------------------------------------------------------- batches */

static di_status check_items(const kvc_item *items, size_t n, int need_buf, di_error *err)
{
    if (n > 0 && !items)
        return di_fail(err, DI_EINVAL, "items is NULL");
    if (n > KVC_MAX_BATCH)
        return di_fail(err, DI_EINVAL, "%zu items in one batch, at most %u", n, KVC_MAX_BATCH);
    for (size_t i = 0; i < n; i++) {
        if (items[i].cls < 0 || items[i].cls >= (int)KVKEY_CLASS_COUNT)
            return di_fail(err, DI_EINVAL, "item %zu: unknown object class %d", i, items[i].cls);
        if (need_buf && (!items[i].buf || items[i].cap == 0))
            return di_fail(err, DI_EINVAL, "item %zu: no buffer", i);
    }
    return DI_OK;
}

/* Every item starts as "not processed", so that a batch failing before the store answered
 * for an item can never leave it looking successful. */
static void mark_pending(kvc_item *items, size_t n)
{
    for (size_t i = 0; i < n; i++)
        items[i].status = di_fail(&items[i].error, DI_EINTERNAL, "not processed");
}

static void mark_all(kvc_item *items, size_t n, di_status st, const di_error *e)
{
    for (size_t i = 0; i < n; i++)
        if (items[i].status == DI_OK || items[i].status == DI_EINTERNAL) {
            items[i].status = st;
            items[i].error = *e;
        }
}

static void set_item(kvc_item *it, int32_t status, const char *msg)
{
    it->status = (di_status)status;
    if (status != DI_OK)
        di_fail(&it->error, (di_status)status, "%s", msg ? msg : "");
    else
        di_error_clear(&it->error);
}

/* Refs of a batch, for Lease and Delete. */
static di_status make_refs(const kvc_item *items, size_t n, Di__Kvstore__ObjRef **refs,
                           Di__Kvstore__ObjRef ***ptrs, di_error *err)
{
    *refs = calloc(n ? n : 1, sizeof(**refs));
    *ptrs = calloc(n ? n : 1, sizeof(**ptrs));
    if (!*refs || !*ptrs) {
        free(*refs);
        free(*ptrs);
        return di_fail(err, DI_ENOMEM, "cannot allocate %zu refs", n);
    }
    for (size_t i = 0; i < n; i++) {
        di__kvstore__obj_ref__init(&(*refs)[i]);
        (*refs)[i].cls = (Di__Kvstore__ObjClass)items[i].cls;
        (*refs)[i].key = (ProtobufCBinaryData){KVKEY_BYTES, (uint8_t *)items[i].key.b};
        (*ptrs)[i] = &(*refs)[i];
    }
    return DI_OK;
}

static di_status release_ids(kvc_client *c, const uint64_t *ids, size_t n, kvc_item *items,
                             const size_t *which, uint64_t deadline_ns, di_error *err)
{
    if (n == 0)
        return DI_OK;
    Di__Kvstore__ReleaseRequest req = DI__KVSTORE__RELEASE_REQUEST__INIT;
    req.n_lease_ids = n;
    req.lease_ids = (uint64_t *)ids;
    Di__Kvstore__ReleaseReply *r = NULL;
    di_status st = call_msg(c, "Release", &req.base, &di__kvstore__release_reply__descriptor,
                            deadline_ns, (ProtobufCMessage **)&r, err);
    if (st != DI_OK)
        return st;
    if (r->n_results != n)
        return wrong_count(&r->base, r->n_results, n, err);
    for (size_t k = 0; items && k < n; k++) {
        kvc_item *it = &items[which[k]];
        if (r->results[k]->status != DI_OK && it->status == DI_OK)
            set_item(it, r->results[k]->status, r->results[k]->error);
    }
    di__kvstore__release_reply__free_unpacked(r, NULL);
    return DI_OK;
}

/* A ticket from a reply, or an error when it is not one. */
static di_status take_ticket(const ProtobufCBinaryData *b, ucxt_ticket *t, di_error *err)
{
    if (b->len != sizeof(t->b))
        return di_fail(err, DI_EPROTO, "the store sent a transfer ticket of %zu bytes", b->len);
    memcpy(t->b, b->data, sizeof(t->b));
    return DI_OK;
}

/* Lease RPC for a batch; fills the transfers of the granted items. release: the store releases
 * each lease once its bytes were sent. */
static di_status lease_batch(kvc_client *c, kvc_item *items, size_t n, int release,
                             uint64_t deadline_ns, ucxt_xfer *xs, size_t *which,
                             uint64_t *lease_ids, size_t *n_xs, uint64_t *store_id, di_error *err)
{
    Di__Kvstore__ObjRef *refs, **ptrs;
    di_status st = make_refs(items, n, &refs, &ptrs, err);
    if (st != DI_OK)
        return st;
    Di__Kvstore__LeaseRequest req = DI__KVSTORE__LEASE_REQUEST__INIT;
    req.n_items = n;
    req.items = ptrs;
    req.lease_ms = c->o.lease_ms;
    req.release_after_transfer = release;
    Di__Kvstore__LeaseReply *r = NULL;
    st = call_msg(c, "Lease", &req.base, &di__kvstore__lease_reply__descriptor, deadline_ns,
                  (ProtobufCMessage **)&r, err);
    free(refs);
    free(ptrs);
    if (st != DI_OK)
        return st;
    if (r->n_results != n)
        return wrong_count(&r->base, r->n_results, n, err);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        Di__Kvstore__LeaseResult *lr = r->results[i];
        set_item(&items[i], lr->status, lr->error);
        if (lr->status != DI_OK)
            continue;
        lease_ids[m] = lr->lease_id;
        which[m] = i;
        items[i].bytes = lr->bytes;
        xs[m] = (ucxt_xfer){.buf = items[i].buf, .len = items[i].cap};
        items[i].status = take_ticket(&lr->ticket, &xs[m].ticket, &items[i].error);
        if (items[i].status == DI_OK)
            items[i].status = DI_EINTERNAL; /* until its transfer completes */
        else
            xs[m].len = 0; /* not sent */
        m++;
    }
    *store_id = r->store_id;
    *n_xs = m;
    di__kvstore__lease_reply__free_unpacked(r, NULL);
    return DI_OK;
}

/* Items whose buffer cannot take the leased object fail here, before any transfer; the rest
 * are packed to the front of xs (get_which: their item indices). Returns how many remain. */
static size_t fitting(kvc_item *items, ucxt_xfer *xs, const size_t *which, size_t n,
                      size_t *get_which)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        kvc_item *it = &items[which[i]];
        if (it->status != DI_EINTERNAL)
            continue; /* no usable ticket */
        if (it->bytes > it->cap) {
            it->status = di_fail(&it->error, DI_ERANGE,
                                 "%s of %llu bytes does not fit a %llu-byte buffer",
                                 kvkey_class_name(it->cls), (unsigned long long)it->bytes,
                                 (unsigned long long)it->cap);
            continue;
        }
        xs[k] = xs[i];
        get_which[k++] = which[i];
    }
    return k;
}

/* The outcome of one transfer on its item. */
static void xfer_outcome(kvc_item *it, const ucxt_xfer *x, int is_get)
{
    if (x->status == DI_OK && is_get && x->got != it->bytes)
        it->status = di_fail(&it->error, DI_EPROTO, "%s: the store sent %llu bytes for a "
                             "%llu-byte object", kvkey_class_name(it->cls),
                             (unsigned long long)x->got, (unsigned long long)it->bytes);
    else if (x->status != DI_OK)
        it->status = di_fail(&it->error, x->status, "%s: the store refused or lost the %s (%s)",
                             kvkey_class_name(it->cls), is_get ? "read" : "write",
                             di_status_name(x->status));
}

/* UCX fetch completions feed the verification jobs. */
static void on_fetched(void *ud, size_t k)
{
    batch_ctx *b = ud;
    b->items[b->which[k]].status = DI_OK;
    if (b->c->o.verify)
        pool_push(&b->c->vp, k);
}

/* One pass of a get: lease, transfer with verification, release. */
static di_status grpc_batch(kvc_client *c, kvc_item *items, size_t n, int is_get,
                            uint64_t deadline, di_error *err);

static di_status get_once(kvc_client *c, kvc_item *items, size_t n, uint64_t deadline,
                          di_error *err)
{
    di_status st = ensure_connected(c, deadline, err);
    if (st == DI_OK && c->grpc)
        return grpc_batch(c, items, n, 1, deadline, err);
    mark_pending(items, n);
    ucxt_xfer *xs = calloc(n, sizeof(*xs));
    size_t *which = calloc(n, sizeof(*which)), *get_which = calloc(n, sizeof(*get_which));
    uint64_t *ids = calloc(n, sizeof(*ids)), *left = calloc(n, sizeof(*left));
    if (!xs || !which || !get_which || !ids || !left)
        st = di_fail(err, DI_ENOMEM, "cannot allocate a batch of %zu", n);
    size_t m = 0, g = 0;
    uint64_t store_id = 0;
    if (st == DI_OK)
        st = ensure_connected(c, deadline, err);
    if (st == DI_OK)
        st = lease_batch(c, items, n, 1, deadline, xs, which, ids, &m, &store_id, err);
    if (st == DI_OK)
        st = follow_restart(c, store_id, deadline, err);
    if (st == DI_OK && m > 0) {
        g = fitting(items, xs, which, m, get_which);
        batch_ctx b = {.c = c, .items = items, .which = get_which};
        pool_begin(&c->vp, job_verify, &b);
        st = ucxt_fetch(c->peer, xs, g, UCX_WINDOW, deadline, on_fetched, &b, err);
        pool_drain(&c->vp);
        if (st != DI_OK)
            drop_transport(c);
        for (size_t k = 0; st == DI_OK && k < g; k++)
            xfer_outcome(&items[get_which[k]], &xs[k], 1);
    }
    /* The store released every lease whose bytes it sent; release the others now (else they
     * wait for their timeout). */
    size_t nl = 0;
    for (size_t k = 0; k < m; k++)
        if (items[which[k]].status != DI_OK)
            left[nl++] = ids[k];
    di_error rerr;
    if (nl > 0)
        release_ids(c, left, nl, NULL, NULL, deadline, &rerr);
    if (st != DI_OK)
        mark_all(items, n, st, err);
    free(xs);
    free(which);
    free(get_which);
    free(ids);
    free(left);
    return st;
}

/* Tells the store which objects failed verification here; it checks its DRAM copies again
 * and drops the bad ones. Per-item answers are not needed: the caller reads again. */
static di_status report_corrupt(kvc_client *c, const kvc_item *items, size_t n,
                                uint64_t deadline_ns, di_error *err)
{
    Di__Kvstore__ObjRef *refs, **ptrs;
    di_status st = make_refs(items, n, &refs, &ptrs, err);
    if (st != DI_OK)
        return st;
    Di__Kvstore__ReportCorruptRequest req = DI__KVSTORE__REPORT_CORRUPT_REQUEST__INIT;
    req.n_items = n;
    req.items = ptrs;
    Di__Kvstore__ReportCorruptReply *r = NULL;
    st = call_msg(c, "ReportCorrupt", &req.base, &di__kvstore__report_corrupt_reply__descriptor,
                  deadline_ns, (ProtobufCMessage **)&r, err);
    free(refs);
    free(ptrs);
    if (st == DI_OK)
        di__kvstore__report_corrupt_reply__free_unpacked(r, NULL);
    return st;
}

/* ---------------------------------------------------------------- the gRPC data path */

/* Object bytes an item moves: a put's size; a get's class size (the handoff maximum), or its
 * buffer when that is smaller. */
static uint64_t item_bytes(const kvc_client *c, const kvc_item *it, int is_get)
{
    uint64_t b = c->info.object_bytes[it->cls];
    return !is_get || !b || it->cap < b ? it->cap : b;
}

/* How many leading items of items[0..n) one message carries (at least one). */
static size_t chunk_of(const kvc_client *c, const kvc_item *items, size_t n, int is_get)
{
    uint64_t sum = 0;
    size_t k = 0;
    for (; k < n; k++) {
        uint64_t b = item_bytes(c, &items[k], is_get);
        if (k > 0 && sum + b > KVC_GRPC_MAX_DATA)
            break;
        sum += b;
    }
    return k;
}

/* A Get reply is read without protobuf-c, straight from the reply bytes into the callers'
 * buffers (one copy less than unpacking, and no allocation per object). The wire format:
 * GetReply {1: store_id varint, 2: GetResult (length-delimited)...}, GetResult {1: status
 * sint32 (zigzag varint), 2: error string, 3: data bytes}; other fields are skipped. */
typedef struct wire {
    const uint8_t *p, *end;
} wire;

static int wire_varint(wire *w, uint64_t *v)
{
    uint64_t x = 0;
    for (int sh = 0; sh < 64 && w->p < w->end; sh += 7) {
        uint8_t b = *w->p++;
        x |= (uint64_t)(b & 0x7f) << sh;
        if (!(b & 0x80)) {
            *v = x;
            return 1;
        }
    }
    return 0;
}

/* The next field: number, wire type, value (varint) or length and bytes (length-delimited).
 * 0 when the bytes are not a well-formed field. */
static int wire_field(wire *w, uint32_t *num, int *type, uint64_t *v, const uint8_t **data)
{
    uint64_t tag;
    if (!wire_varint(w, &tag) || (tag >> 3) == 0 || (tag >> 3) > UINT32_MAX)
        return 0;
    *num = (uint32_t)(tag >> 3);
    *type = (int)(tag & 7);
    size_t left = (size_t)(w->end - w->p);
    switch (*type) {
    case 0:
        return wire_varint(w, v);
    case 1:
    case 5:
        *v = *type == 1 ? 8 : 4;
        if (left < *v)
            return 0;
        w->p += *v;
        return 1;
    case 2:
        if (!wire_varint(w, v) || *v > (uint64_t)(w->end - w->p))
            return 0;
        *data = w->p;
        w->p += *v;
        return 1;
    default:
        return 0;
    }
}

/* One GetResult into its item (status, message, bytes copied into the buffer). 0: malformed. */
static int take_result(kvc_item *it, const uint8_t *p, size_t len)
{
    wire w = {p, p + len};
    int64_t status = 0;
    const uint8_t *msg = NULL, *data = NULL;
    uint64_t msg_len = 0, data_len = 0;
    while (w.p < w.end) {
        uint32_t num;
        int type;
        uint64_t v = 0;
        const uint8_t *d = NULL;
        if (!wire_field(&w, &num, &type, &v, &d))
            return 0;
        if (num == 1 && type == 0)
            status = (int64_t)(v >> 1) ^ -(int64_t)(v & 1);
        else if (num == 2 && type == 2) {
            msg = d;
            msg_len = v;
        } else if (num == 3 && type == 2) {
            data = d;
            data_len = v;
        }
    }
    if (status != DI_OK) {
        it->status = di_fail(&it->error, (di_status)status, "%.*s",
                             (int)(msg_len < 1024 ? msg_len : 1024), msg ? (const char *)msg : "");
        return 1;
    }
    if (data_len > it->cap) {
        it->status = di_fail(&it->error, DI_ERANGE, "%s of %llu bytes does not fit a %llu-byte "
                             "buffer", kvkey_class_name(it->cls), (unsigned long long)data_len,
                             (unsigned long long)it->cap);
        return 1;
    }
    if (data_len)
        memcpy(it->buf, data, data_len);
    it->bytes = data_len;
    it->status = DI_OK;
    di_error_clear(&it->error);
    return 1;
}

/* The results of a Get reply into items[0..n), each object verified on the helpers as it lands.
 * A reply from a restarted store is followed first (its geometry is what objects verify
 * against). */
static di_status take_get_reply(kvc_client *c, kvc_item *items, size_t n, const uint8_t *rep,
                                size_t len, size_t *which, uint64_t deadline, di_error *err)
{
    wire w = {rep, rep + len};
    batch_ctx b = {.c = c, .items = items, .which = which};
    pool_begin(&c->vp, job_verify, &b);
    size_t got = 0;
    di_status st = DI_OK;
    while (st == DI_OK && w.p < w.end) {
        uint32_t num;
        int type;
        uint64_t v = 0;
        const uint8_t *d = NULL;
        if (!wire_field(&w, &num, &type, &v, &d))
            st = di_fail(err, DI_EPROTO, "malformed GetReply from the store");
        else if (num == 1 && type == 0 && got == 0)
            st = follow_restart(c, v, deadline, err);
        else if (num == 2 && type == 2 && got >= n)
            st = di_fail(err, DI_EPROTO, "GetReply from the store has more than %zu results", n);
        else if (num == 2 && type == 2 && !take_result(&items[got], d, (size_t)v))
            st = di_fail(err, DI_EPROTO, "malformed GetResult %zu from the store", got);
        else if (num == 2 && type == 2) {
            if (items[got].status == DI_OK && c->o.verify) {
                which[got] = got;
                pool_push(&c->vp, got);
            }
            got++;
        }
    }
    pool_drain(&c->vp);
    if (st == DI_OK && got != n)
        st = di_fail(err, DI_EPROTO, "GetReply from the store has %zu results for %zu items", got,
                     n);
    return st;
}

/* One Get call for items[0..n) (one message's worth). */
static di_status grpc_get_chunk(kvc_client *c, kvc_item *items, size_t n, uint64_t deadline,
                                di_error *err)
{
    Di__Kvstore__ObjRef *refs, **ptrs;
    size_t *which = calloc(n, sizeof(*which));
    di_status st = which ? make_refs(items, n, &refs, &ptrs, err)
                         : di_fail(err, DI_ENOMEM, "cannot allocate a batch of %zu", n);
    if (st != DI_OK) {
        free(which);
        return st;
    }
    Di__Kvstore__GetRequest req = DI__KVSTORE__GET_REQUEST__INIT;
    req.n_items = n;
    req.items = ptrs;
    uint8_t *rep = NULL;
    size_t len = 0;
    st = call_packed(c, "Get", &req.base, deadline, &rep, &len, err);
    free(refs);
    free(ptrs);
    if (st == DI_OK)
        st = take_get_reply(c, items, n, rep, len, which, deadline, err);
    free(rep);
    free(which);
    return st;
}

/* One Put call for items[0..n) (one message's worth). */
static di_status grpc_put_chunk(kvc_client *c, kvc_item *items, size_t n, uint64_t deadline,
                                di_error *err)
{
    Di__Kvstore__PutItem *pi = calloc(n, sizeof(*pi));
    Di__Kvstore__PutItem **ptrs = calloc(n, sizeof(*ptrs));
    size_t m = 0;
    di_status st = DI_OK;
    if (!pi || !ptrs)
        st = di_fail(err, DI_ENOMEM, "cannot allocate a batch of %zu", n);
    for (size_t i = 0; st == DI_OK && i < n; i++) {
        if (items[i].cap > KVC_GRPC_MAX_DATA) {
            items[i].status = di_fail(&items[i].error, DI_ERANGE, "%s of %llu bytes: the gRPC "
                                      "data path carries at most %u bytes per message",
                                      kvkey_class_name(items[i].cls),
                                      (unsigned long long)items[i].cap, KVC_GRPC_MAX_DATA);
            continue;
        }
        di__kvstore__put_item__init(&pi[m]);
        pi[m].cls = (Di__Kvstore__ObjClass)items[i].cls;
        pi[m].key = (ProtobufCBinaryData){KVKEY_BYTES, items[i].key.b};
        pi[m].data = (ProtobufCBinaryData){items[i].cap, items[i].buf};
        ptrs[m] = &pi[m];
        m++;
    }
    Di__Kvstore__PutReply *r = NULL;
    if (st == DI_OK && m > 0) {
        Di__Kvstore__PutRequest req = DI__KVSTORE__PUT_REQUEST__INIT;
        req.n_items = m;
        req.items = ptrs;
        st = call_msg(c, "Put", &req.base, &di__kvstore__put_reply__descriptor, deadline,
                      (ProtobufCMessage **)&r, err);
        if (st == DI_OK && r->n_results != m)
            st = wrong_count(&r->base, r->n_results, m, err);
        else if (st == DI_OK) {
            for (size_t i = 0, k = 0; i < n; i++)
                if (items[i].cap <= KVC_GRPC_MAX_DATA) {
                    set_item(&items[i], r->results[k]->status, r->results[k]->error);
                    k++;
                }
            uint64_t sid = r->store_id;
            di__kvstore__put_reply__free_unpacked(r, NULL);
            st = follow_restart(c, sid, deadline, err);
        }
    }
    free(pi);
    free(ptrs);
    return st;
}

/* A get or put on the gRPC path: one Get, or one Put (allocation, copy, commit), per
 * message's worth of objects. */
static di_status grpc_batch(kvc_client *c, kvc_item *items, size_t n, int is_get,
                            uint64_t deadline, di_error *err)
{
    if (is_get)
        mark_pending(items, n);
    di_status st = ensure_connected(c, deadline, err);
    for (size_t at = 0, k = 0; st == DI_OK && at < n; at += k) {
        k = chunk_of(c, items + at, n - at, is_get);
        st = (is_get ? grpc_get_chunk : grpc_put_chunk)(c, items + at, k, deadline, err);
    }
    if (st != DI_OK)
        mark_all(items, n, st, err);
    return st;
}

di_status kvc_get(kvc_client *c, kvc_item *items, size_t n, di_error *err)
{
    if (!c)
        return di_fail(err, DI_EINVAL, "kvc_get: client is NULL");
    di_status st = check_items(items, n, 1, err);
    if (st != DI_OK || n == 0)
        return st;
    uint64_t deadline = di_mono_ns() + c->o.deadline_ms * 1000000ull;
    st = get_once(c, items, n, deadline, err);
    size_t nbad = 0;
    for (size_t i = 0; st == DI_OK && i < n; i++)
        nbad += items[i].status == DI_ECORRUPT;
    if (nbad == 0)
        return st;
    /* A copy failed verification: report it (the store drops a bad DRAM copy) and read those
     * objects once more, which gets the disk copy, a clean transfer or a miss. */
    kvc_item *again = calloc(nbad, sizeof(*again));
    size_t *pos = calloc(nbad, sizeof(*pos));
    size_t k = 0;
    for (size_t i = 0; again && pos && i < n; i++)
        if (items[i].status == DI_ECORRUPT) {
            pos[k] = i;
            again[k++] = items[i];
        }
    di_error re;
    if (again && pos && report_corrupt(c, again, nbad, deadline, &re) == DI_OK &&
        get_once(c, again, nbad, deadline, &re) == DI_OK)
        for (k = 0; k < nbad; k++)
            items[pos[k]] = again[k];
    free(again);
    free(pos);
    return DI_OK;
}

/* Alloc RPC; fills the transfers of granted items (EEXIST items are done). */
static di_status alloc_batch(kvc_client *c, kvc_item *items, size_t n, uint64_t deadline_ns,
                             ucxt_xfer *xs, size_t *which, uint64_t *ids, size_t *n_xs,
                             uint64_t *store_id, di_error *err)
{
    Di__Kvstore__AllocItem *ai = calloc(n, sizeof(*ai));
    Di__Kvstore__AllocItem **ptrs = calloc(n, sizeof(*ptrs));
    if (!ai || !ptrs) {
        free(ai);
        free(ptrs);
        return di_fail(err, DI_ENOMEM, "cannot allocate a batch of %zu", n);
    }
    for (size_t i = 0; i < n; i++) {
        di__kvstore__alloc_item__init(&ai[i]);
        ai[i].cls = (Di__Kvstore__ObjClass)items[i].cls;
        ai[i].key = (ProtobufCBinaryData){KVKEY_BYTES, items[i].key.b};
        ai[i].bytes = items[i].cap;
        ptrs[i] = &ai[i];
    }
    Di__Kvstore__AllocRequest req = DI__KVSTORE__ALLOC_REQUEST__INIT;
    req.n_items = n;
    req.items = ptrs;
    Di__Kvstore__AllocReply *r = NULL;
    di_status st = call_msg(c, "Alloc", &req.base, &di__kvstore__alloc_reply__descriptor,
                            deadline_ns, (ProtobufCMessage **)&r, err);
    free(ai);
    free(ptrs);
    if (st != DI_OK)
        return st;
    if (r->n_results != n)
        return wrong_count(&r->base, r->n_results, n, err);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        Di__Kvstore__AllocResult *ar = r->results[i];
        set_item(&items[i], ar->status, ar->error);
        if (ar->status != DI_OK)
            continue;
        xs[m] = (ucxt_xfer){.buf = items[i].buf, .len = items[i].cap};
        ids[m] = ar->alloc_id;
        which[m++] = i;
        items[i].status = take_ticket(&ar->ticket, &xs[m - 1].ticket, &items[i].error);
    }
    *store_id = r->store_id;
    *n_xs = m;
    di__kvstore__alloc_reply__free_unpacked(r, NULL);
    return DI_OK;
}

static di_status commit_or_abort(kvc_client *c, const char *method, const uint64_t *ids, size_t m,
                                 kvc_item *items, const size_t *which, uint64_t deadline_ns,
                                 di_error *err)
{
    if (m == 0)
        return DI_OK;
    Di__Kvstore__CommitRequest req = DI__KVSTORE__COMMIT_REQUEST__INIT;
    req.n_alloc_ids = m;
    req.alloc_ids = (uint64_t *)ids;
    if (strcmp(method, "Abort") == 0)
        req.base.descriptor = &di__kvstore__abort_request__descriptor; /* same fields */
    Di__Kvstore__CommitReply *r = NULL;
    di_status st = call_msg(c, method, &req.base, &di__kvstore__commit_reply__descriptor,
                            deadline_ns, (ProtobufCMessage **)&r, err);
    if (st != DI_OK)
        return st;
    if (!items) {
        di__kvstore__commit_reply__free_unpacked(r, NULL);
        return DI_OK;
    }
    if (r->n_results != m)
        return wrong_count(&r->base, r->n_results, m, err);
    for (size_t k = 0; k < m; k++)
        set_item(&items[which[k]], r->results[k]->status, r->results[k]->error);
    di__kvstore__commit_reply__free_unpacked(r, NULL);
    return DI_OK;
}

/* After the transfers of a put: commit the items the store acknowledged, abort the others. */
static di_status settle_put(kvc_client *c, kvc_item *items, const ucxt_xfer *xs,
                            const size_t *which, const uint64_t *ids, size_t m,
                            uint64_t deadline, di_error *err)
{
    uint64_t *ok_ids = calloc(m, sizeof(*ok_ids)), *bad_ids = calloc(m, sizeof(*bad_ids));
    size_t *ok_which = calloc(m, sizeof(*ok_which));
    if (!ok_ids || !bad_ids || !ok_which) {
        free(ok_ids);
        free(bad_ids);
        free(ok_which);
        return di_fail(err, DI_ENOMEM, "cannot allocate a batch of %zu", m);
    }
    size_t nok = 0, nbad = 0;
    for (size_t k = 0; k < m; k++) {
        kvc_item *it = &items[which[k]];
        if (it->status == DI_OK && xs[k].status == DI_OK) {
            ok_ids[nok] = ids[k];
            ok_which[nok++] = which[k];
            continue;
        }
        if (it->status == DI_OK)
            xfer_outcome(it, &xs[k], 0);
        bad_ids[nbad++] = ids[k];
    }
    di_error aerr;
    commit_or_abort(c, "Abort", bad_ids, nbad, NULL, NULL, deadline, &aerr);
    di_status st = commit_or_abort(c, "Commit", ok_ids, nok, items, ok_which, deadline, err);
    free(ok_ids);
    free(bad_ids);
    free(ok_which);
    return st;
}

di_status kvc_put(kvc_client *c, kvc_item *items, size_t n, di_error *err)
{
    if (!c)
        return di_fail(err, DI_EINVAL, "kvc_put: client is NULL");
    di_status st = check_items(items, n, 1, err);
    if (st != DI_OK || n == 0)
        return st;
    mark_pending(items, n);
    uint64_t deadline = di_mono_ns() + c->o.deadline_ms * 1000000ull;
    st = ensure_connected(c, deadline, err);
    if (st == DI_OK && c->grpc)
        return grpc_batch(c, items, n, 0, deadline, err);
    ucxt_xfer *xs = calloc(n, sizeof(*xs));
    size_t *which = calloc(n, sizeof(*which));
    uint64_t *ids = calloc(n, sizeof(*ids));
    if (!xs || !which || !ids)
        st = di_fail(err, DI_ENOMEM, "cannot allocate a batch of %zu", n);
    size_t m = 0;
    uint64_t store_id = 0;
    if (st == DI_OK)
        st = ensure_connected(c, deadline, err);
    if (st == DI_OK)
        st = alloc_batch(c, items, n, deadline, xs, which, ids, &m, &store_id, err);
    if (st == DI_OK)
        st = follow_restart(c, store_id, deadline, err);
    if (st == DI_OK && m > 0) {
        /* Items without a usable ticket are not sent (their xfer length is cleared). */
        for (size_t k = 0; k < m; k++)
            if (items[which[k]].status != DI_OK)
                xs[k].len = 0;
        st = ucxt_send(c->peer, xs, m, UCX_WINDOW, deadline, err);
        if (st != DI_OK) {
            drop_transport(c);
            di_error aerr;
            commit_or_abort(c, "Abort", ids, m, NULL, which, deadline, &aerr);
        } else
            st = settle_put(c, items, xs, which, ids, m, deadline, err);
    }
    if (st != DI_OK) {
        for (size_t k = 0; k < m; k++) /* allocated: their fate is the batch's */
            items[which[k]].status = DI_EINTERNAL;
        mark_all(items, n, st, err);
    }
    free(xs);
    free(which);
    free(ids);
    return st;
}

/* The Delete RPC of a batch whose refs are made. */
static di_status delete_batch(kvc_client *c, kvc_item *items, size_t n, Di__Kvstore__ObjRef **ptrs,
                              di_error *err);

di_status kvc_delete(kvc_client *c, kvc_item *items, size_t n, di_error *err)
{
    if (!c)
        return di_fail(err, DI_EINVAL, "kvc_delete: client is NULL");
    di_status st = check_items(items, n, 0, err);
    if (st != DI_OK || n == 0)
        return st;
    mark_pending(items, n);
    Di__Kvstore__ObjRef *refs, **ptrs;
    st = make_refs(items, n, &refs, &ptrs, err);
    if (st == DI_OK) {
        st = delete_batch(c, items, n, ptrs, err);
        free(refs);
        free(ptrs);
    }
    if (st != DI_OK)
        mark_all(items, n, st, err);
    return st;
}

static di_status delete_batch(kvc_client *c, kvc_item *items, size_t n, Di__Kvstore__ObjRef **ptrs,
                              di_error *err)
{
    di_status st;
    Di__Kvstore__DeleteRequest req = DI__KVSTORE__DELETE_REQUEST__INIT;
    req.n_items = n;
    req.items = ptrs;
    Di__Kvstore__DeleteReply *r = NULL;
    st = call_msg(c, "Delete", &req.base, &di__kvstore__delete_reply__descriptor,
                  di_mono_ns() + c->o.deadline_ms * 1000000ull, (ProtobufCMessage **)&r, err);
    if (st != DI_OK)
        return st;
    if (r->n_results != n)
        return wrong_count(&r->base, r->n_results, n, err);
    for (size_t i = 0; i < n; i++)
        set_item(&items[i], r->results[i]->status, r->results[i]->error);
    di__kvstore__delete_reply__free_unpacked(r, NULL);
    return DI_OK;
}

/* ---------------------------------------------------------------- single objects */

static di_status single(di_status st, const kvc_item *it, di_error *err)
{
    if (st != DI_OK)
        return st;
    if (it->status != DI_OK && err)
        *err = it->error;
    return it->status;
}

di_status kvc_get1(kvc_client *c, int cls, const kvkey *key, void *buf, uint64_t cap,
                   uint64_t *bytes, di_error *err)
{
    if (!key)
        return di_fail(err, DI_EINVAL, "kvc_get1: key is NULL");
    kvc_item it = {.cls = cls, .key = *key, .buf = buf, .cap = cap};
    di_status st = single(kvc_get(c, &it, 1, err), &it, err);
    if (st == DI_OK && bytes)
        *bytes = it.bytes;
    return st;
}

di_status kvc_put1(kvc_client *c, int cls, const kvkey *key, const void *obj, uint64_t bytes,
                   di_error *err)
{
    if (!key)
        return di_fail(err, DI_EINVAL, "kvc_put1: key is NULL");
    kvc_item it = {.cls = cls, .key = *key, .buf = (void *)obj, .cap = bytes};
    return single(kvc_put(c, &it, 1, err), &it, err);
}

di_status kvc_delete1(kvc_client *c, int cls, const kvkey *key, di_error *err)
{
    if (!key)
        return di_fail(err, DI_EINVAL, "kvc_delete1: key is NULL");
    kvc_item it = {.cls = cls, .key = *key};
    return single(kvc_delete(c, &it, 1, err), &it, err);
}

/* ---------------------------------------------------------------- explicit leases */

di_status kvc_acquire(kvc_client *c, int cls, const kvkey *key, uint32_t lease_ms, kvc_lease *out,
                      di_error *err)
{
    if (!c || !key || !out || cls < 0 || cls >= (int)KVKEY_CLASS_COUNT)
        return di_fail(err, DI_EINVAL, "kvc_acquire: bad class or NULL argument");
    uint64_t deadline = di_mono_ns() + c->o.deadline_ms * 1000000ull;
    di_status st = ensure_connected(c, deadline, err);
    if (st != DI_OK)
        return st;
    Di__Kvstore__ObjRef ref = DI__KVSTORE__OBJ_REF__INIT, *ptr = &ref;
    ref.cls = (Di__Kvstore__ObjClass)cls;
    ref.key = (ProtobufCBinaryData){KVKEY_BYTES, (uint8_t *)key->b};
    Di__Kvstore__LeaseRequest req = DI__KVSTORE__LEASE_REQUEST__INIT;
    req.n_items = 1;
    req.items = &ptr;
    req.lease_ms = lease_ms;
    Di__Kvstore__LeaseReply *r = NULL;
    st = call_msg(c, "Lease", &req.base, &di__kvstore__lease_reply__descriptor, deadline,
                  (ProtobufCMessage **)&r, err);
    if (st != DI_OK)
        return st;
    if (r->n_results != 1)
        return wrong_count(&r->base, r->n_results, 1, err);
    Di__Kvstore__LeaseResult *lr = r->results[0];
    st = (di_status)lr->status;
    if (st != DI_OK)
        di_fail(err, st, "%s", lr->error);
    else {
        *out = (kvc_lease){.lease_id = lr->lease_id, .bytes = lr->bytes,
                           .expires_in_ms = lr->expires_in_ms};
        st = take_ticket(&lr->ticket, (ucxt_ticket *)out->ticket, err);
    }
    uint64_t sid = r->store_id;
    di__kvstore__lease_reply__free_unpacked(r, NULL);
    if (st == DI_OK)
        st = follow_restart(c, sid, deadline, err);
    return st;
}

di_status kvc_read(kvc_client *c, int cls, const kvkey *key, const kvc_lease *l, void *buf,
                   uint64_t cap, di_error *err)
{
    if (!c || !key || !l || !buf)
        return di_fail(err, DI_EINVAL, "kvc_read: NULL argument");
    if (l->bytes > cap)
        return di_fail(err, DI_ERANGE, "object of %llu bytes does not fit a %llu-byte buffer",
                       (unsigned long long)l->bytes, (unsigned long long)cap);
    uint64_t deadline = di_mono_ns() + c->o.deadline_ms * 1000000ull;
    if (c->connected && c->grpc) { /* the lease pins the object: read it with Get */
        kvc_item it = {.cls = cls, .key = *key, .buf = buf, .cap = cap};
        di_status st = grpc_batch(c, &it, 1, 1, deadline, err);
        if (st == DI_OK && it.status == DI_ECORRUPT) {
            di_error re;
            report_corrupt(c, &it, 1, deadline, &re);
        }
        if (st == DI_OK && it.status != DI_OK && err)
            *err = it.error;
        return st != DI_OK ? st : it.status;
    }
    if (!c->connected || ucxt_peer_failed(c->peer))
        return di_fail(err, DI_EUNAVAIL, "the store connection was lost; acquire again");
    ucxt_xfer x = {.buf = buf, .len = cap};
    memcpy(x.ticket.b, l->ticket, sizeof(x.ticket.b));
    kvc_item it = {.cls = cls, .key = *key, .buf = buf, .bytes = l->bytes, .status = DI_OK};
    di_status st = ucxt_fetch(c->peer, &x, 1, 1, deadline, NULL, NULL, err);
    if (st != DI_OK) {
        drop_transport(c);
        return st;
    }
    xfer_outcome(&it, &x, 1);
    if (it.status == DI_OK && c->o.verify) {
        size_t which = 0;
        batch_ctx b = {.c = c, .items = &it, .which = &which};
        job_verify(&b, 0);
    }
    if (it.status == DI_ECORRUPT) {
        di_error re; /* the store drops a bad DRAM copy once this lease ends */
        report_corrupt(c, &it, 1, deadline, &re);
    }
    if (it.status != DI_OK && err)
        *err = it.error;
    return it.status;
}

di_status kvc_release(kvc_client *c, const kvc_lease *l, di_error *err)
{
    if (!c || !l)
        return di_fail(err, DI_EINVAL, "kvc_release: NULL argument");
    kvc_item it = {.status = DI_OK};
    size_t which = 0;
    di_status st = release_ids(c, &l->lease_id, 1, &it, &which,
                               di_mono_ns() + c->o.deadline_ms * 1000000ull, err);
    if (st != DI_OK)
        return st;
    if (it.status != DI_OK && err)
        *err = it.error;
    return it.status;
}
