#include "kvstore/service.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "common/net/kv_client.h"
#include "common/net/kvstore.pb-c.h"
#include "common/util/clock.h"
#include "kvstore/tickets.h"

/* A ticket outlives the store's own lease or allocation by no more than the clock skew
 * between them: it expires this much earlier. */
#define TICKET_MARGIN_NS 5000000ull

struct kvsvc {
    kvsvc_config cfg;      /* worker_addr points at the copy below */
    uint8_t *worker_addr;  /* copy */
    kvt_table *tickets;    /* one-time transfer tickets */
    di_log_limit item_limit; /* item failures and corrupt-copy reports: 5 lines per 10 s */
};

di_status kvsvc_create(const kvsvc_config *cfg, kvsvc **out, di_error *err)
{
    kvsvc *s = calloc(1, sizeof(*s));
    if (!s)
        return di_fail(err, DI_ENOMEM, "cannot allocate the service");
    s->cfg = *cfg;
    if (!s->cfg.data_paths)
        s->cfg.data_paths = KVC_PATHS_UCX | KVC_PATHS_GRPC;
    di_log_limit_init(&s->item_limit, "item failures", DI_LOG_WARN, 5, 10000);
    s->worker_addr = malloc(cfg->worker_addr_len ? cfg->worker_addr_len : 1);
    if (!s->worker_addr || kvt_create(&s->tickets, err) != DI_OK) {
        kvsvc_free(s);
        return di_fail(err, DI_ENOMEM, "cannot allocate the service");
    }
    if (cfg->worker_addr_len)
        memcpy(s->worker_addr, cfg->worker_addr, cfg->worker_addr_len);
    *out = s;
    return DI_OK;
}

kvsvc *kvsvc_free(kvsvc *s)
{
    if (!s)
        return NULL;
    free(s->worker_addr);
    kvt_free(s->tickets);
    di_log_limit_flush(s->cfg.log, &s->item_limit, di_mono_ns(), 1);
    di_log_limit_destroy(&s->item_limit);
    free(s);
    return NULL;
}

uint64_t kvsvc_tickets(kvsvc *s)
{
    return kvt_count(s->tickets);
}

/* ---------------------------------------------------------------- the UCX data path */

/* A ticket's grant: the arena range it names. */
static di_status dp_begin(kvsvc *s, int kind, const ucxt_ticket *t, uint64_t len, ucxt_grant *g)
{
    uint64_t off = 0, bytes = 0, id = 0;
    di_status st = kvt_begin(s->tickets, kind, t, len, di_mono_ns(), &off, &bytes, &id);
    if (st != DI_OK)
        return st;
    g->addr = s->cfg.arena + off;
    g->len = bytes;
    g->token = (void *)(uintptr_t)id;
    return DI_OK;
}

static di_status dp_get_begin(void *ud, const ucxt_ticket *t, ucxt_grant *g)
{
    return dp_begin(ud, KVT_GET, t, 0, g);
}

static void dp_get_end(void *ud, void *token, di_status st)
{
    kvsvc *s = ud;
    uint64_t id = (uint64_t)(uintptr_t)token;
    if (kvt_end(s->tickets, KVT_GET, id, st)) {
        di_error e;
        kvs_release(s->cfg.store, id, &e);
    }
}

static di_status dp_put_begin(void *ud, const ucxt_ticket *t, uint64_t len, ucxt_grant *g)
{
    return dp_begin(ud, KVT_PUT, t, len, g);
}

static void dp_put_end(void *ud, void *token, di_status st)
{
    kvsvc *s = ud;
    kvt_end(s->tickets, KVT_PUT, (uint64_t)(uintptr_t)token, st);
}

void kvsvc_data_path(kvsvc *s, ucxt_server_ops *ops)
{
    *ops = (ucxt_server_ops){.get_begin = dp_get_begin, .get_end = dp_get_end,
                             .put_begin = dp_put_begin, .put_end = dp_put_end, .ud = s};
}

/* Expiry of a ticket for a grant that lasts ms from now. */
static uint64_t ticket_expiry(uint64_t ms)
{
    uint64_t now = di_mono_ns(), span = ms * 1000000ull;
    return span > TICKET_MARGIN_NS ? now + span - TICKET_MARGIN_NS : now;
}

void kvsvc_tick(kvsvc *s)
{
    di_log_limit_flush(s->cfg.log, &s->item_limit, di_mono_ns(), 0);
}

/* ---------------------------------------------------------------- helpers */

static di_status pack(const ProtobufCMessage *m, rpc_reply *r, di_error *err)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *p = malloc(n ? n : 1);
    if (!p)
        return di_fail(err, DI_ENOMEM, "cannot allocate a %zu-byte reply", n);
    protobuf_c_message_pack(m, p);
    r->data = p;
    r->len = n;
    return DI_OK;
}

#define UNPACK(type, fn, req, err)                                                        \
    type *msg = fn(NULL, (req)->len, (req)->data);                                        \
    if (!msg)                                                                             \
        return di_fail(err, DI_EPROTO, "malformed " #type " (%zu bytes)", (req)->len);

static di_status check_key(const ProtobufCBinaryData *b, size_t i, kvkey *out, di_error *err)
{
    if (b->len != KVKEY_BYTES)
        return di_fail(err, DI_EINVAL, "item %zu: key of %zu bytes, keys are %u bytes", i,
                       b->len, KVKEY_BYTES);
    memcpy(out->b, b->data, KVKEY_BYTES);
    return DI_OK;
}

static di_status check_ref(const Di__Kvstore__ObjRef *r, size_t i, int *cls, kvkey *key,
                           di_error *err)
{
    if (!r || (int)r->cls < 0 || (int)r->cls >= (int)KVKEY_CLASS_COUNT)
        return di_fail(err, DI_EINVAL, "item %zu: unknown object class %d", i, r ? (int)r->cls : -1);
    *cls = (int)r->cls;
    return check_key(&r->key, i, key, err);
}

static di_status check_count(size_t n, size_t max, const char *what, di_error *err)
{
    if (n > max)
        return di_fail(err, DI_EINVAL, "%zu %s in one request, at most %zu", n, what, max);
    return DI_OK;
}

/* Failures worth a log line: faults, not misses or duplicates. */
static int notable(di_status st)
{
    return st == DI_ECORRUPT || st == DI_EIO || st == DI_ENOSPC || st == DI_EFULL ||
           st == DI_ENOMEM || st == DI_EINTERNAL || st == DI_ETIMEDOUT;
}

static void log_item(kvsvc *s, const rpc_request *req, const char *what, size_t i,
                     di_status st, const di_error *e)
{
    if (notable(st))
        di_log_limited(s->cfg.log, &s->item_limit, di_mono_ns(),
                       "%s item %zu from %s: %s (%s)", what, i, req->peer, e->msg,
                       di_status_name(st));
}

static int past_deadline(const rpc_request *req)
{
    return di_mono_ns() > req->deadline_ns;
}

/* CommitReply, AbortReply, ReleaseReply and DeleteReply have the same fields; pack_statuses
 * fills one struct and packs it with the descriptor of the reply at hand. */
#define SAME_SHAPE(T)                                                                        \
    _Static_assert(sizeof(T) == sizeof(Di__Kvstore__CommitReply) &&                         \
                       offsetof(T, n_results) == offsetof(Di__Kvstore__CommitReply, n_results) && \
                       offsetof(T, results) == offsetof(Di__Kvstore__CommitReply, results),  \
                   #T " differs from CommitReply")
SAME_SHAPE(Di__Kvstore__AbortReply);
SAME_SHAPE(Di__Kvstore__ReleaseReply);
SAME_SHAPE(Di__Kvstore__DeleteReply);
SAME_SHAPE(Di__Kvstore__ReportCorruptReply);

/* The ItemStatus messages of st/errs (the messages point into errs); free both arrays. */
static di_status status_list(size_t n, const di_status *st, const di_error *errs,
                             Di__Kvstore__ItemStatus **items_out,
                             Di__Kvstore__ItemStatus ***ptrs_out, di_error *err)
{
    Di__Kvstore__ItemStatus *items = calloc(n ? n : 1, sizeof(*items));
    Di__Kvstore__ItemStatus **ptrs = calloc(n ? n : 1, sizeof(*ptrs));
    if (!items || !ptrs) {
        free(items);
        free(ptrs);
        return di_fail(err, DI_ENOMEM, "cannot allocate %zu results", n);
    }
    for (size_t i = 0; i < n; i++) {
        di__kvstore__item_status__init(&items[i]);
        items[i].status = st[i];
        items[i].error = st[i] == DI_OK ? (char *)"" : (char *)errs[i].msg;
        ptrs[i] = &items[i];
    }
    *items_out = items;
    *ptrs_out = ptrs;
    return DI_OK;
}

/* A reply of per-item statuses, packed from st/errs. */
static di_status pack_statuses(const ProtobufCMessageDescriptor *desc, size_t n,
                               const di_status *st, const di_error *errs, rpc_reply *r,
                               di_error *err)
{
    Di__Kvstore__ItemStatus *items, **ptrs;
    di_status rc = status_list(n, st, errs, &items, &ptrs, err);
    if (rc != DI_OK)
        return rc;
    /* Every ItemStatus reply has the same shape: base, n_results, results. */
    Di__Kvstore__CommitReply reply;
    memset(&reply, 0, sizeof(reply));
    protobuf_c_message_init(desc, &reply);
    reply.n_results = n;
    reply.results = ptrs;
    rc = pack(&reply.base, r, err);
    free(items);
    free(ptrs);
    return rc;
}

/* Per-item scratch: statuses and messages. */
typedef struct scratch {
    di_status *st;
    di_error *errs;
} scratch;

static di_status scratch_alloc(scratch *sc, size_t n, di_error *err)
{
    sc->st = calloc(n ? n : 1, sizeof(*sc->st));
    sc->errs = calloc(n ? n : 1, sizeof(*sc->errs));
    if (!sc->st || !sc->errs) {
        free(sc->st);
        free(sc->errs);
        return di_fail(err, DI_ENOMEM, "cannot allocate %zu results", n);
    }
    return DI_OK;
}

static void scratch_free(scratch *sc)
{
    free(sc->st);
    free(sc->errs);
}

/* ---------------------------------------------------------------- engine methods */

static di_status h_connect(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    UNPACK(Di__Kvstore__ConnectRequest, di__kvstore__connect_request__unpack, req, err);
    uint64_t want = msg->model_id;
    di__kvstore__connect_request__free_unpacked(msg, NULL);
    if (want && want != s->cfg.geometry.model_id)
        return di_fail(err, DI_EINVAL, "this store holds KV of model %016llx, not %016llx",
                       (unsigned long long)s->cfg.geometry.model_id, (unsigned long long)want);
    const kv_geometry *g = &s->cfg.geometry;
    Di__Kvstore__Geometry geo = DI__KVSTORE__GEOMETRY__INIT;
    geo.block_tokens = g->block_tokens;
    geo.head_dim = g->head_dim;
    geo.index_head_dim = g->index_head_dim;
    geo.window = g->window;
    geo.ring_positions = g->ring_positions;
    geo.n_layers = g->n_layers;
    geo.n_draft_stages = g->n_draft_stages;
    geo.n_owner_layer = g->n_owners;
    geo.owner_layer = (uint32_t *)g->owner_layer;
    geo.n_owner_ratio = g->n_owners;
    geo.owner_ratio = (uint32_t *)g->owner_ratio;
    geo.yoco_boundary = g->yoco_boundary;
    geo.model_id = g->model_id;
    Di__Kvstore__ConnectReply rep = DI__KVSTORE__CONNECT_REPLY__INIT;
    rep.store_id = s->cfg.store_id;
    if (s->cfg.data_paths & KVC_PATHS_UCX)
        rep.worker_address = (ProtobufCBinaryData){s->cfg.worker_addr_len, s->worker_addr};
    rep.data_paths = s->cfg.data_paths;
    rep.max_message_bytes = KVC_GRPC_MAX_MESSAGE;
    rep.geometry = &geo;
    rep.block_bytes = s->cfg.object_bytes[KVKEY_BLOCK];
    rep.window_bytes = s->cfg.object_bytes[KVKEY_WINDOW];
    rep.handoff_max_bytes = s->cfg.object_bytes[KVKEY_HANDOFF];
    rep.max_batch = KVC_MAX_BATCH;
    rep.lease_max_ms = s->cfg.lease_max_ms;
    rep.durability = (char *)kvdisk_durability_name(s->cfg.durability);
    kvs_stats st;
    kvs_get_stats(s->cfg.store, &st);
    rep.n_ttl_ms = KVKEY_CLASS_COUNT;
    rep.ttl_ms = st.ttl_ms;
    return pack(&rep.base, r, err);
}

/* Copies and checks a list of keys. */
static di_status keys_from(const ProtobufCBinaryData *b, size_t n, kvkey **out, di_error *err)
{
    di_status st = check_count(n, KVC_MAX_LOOKUP, "keys", err);
    if (st != DI_OK)
        return st;
    kvkey *keys = malloc((n ? n : 1) * sizeof(*keys));
    if (!keys)
        return di_fail(err, DI_ENOMEM, "cannot allocate %zu keys", n);
    for (size_t i = 0; i < n && st == DI_OK; i++)
        st = check_key(&b[i], i, &keys[i], err);
    if (st != DI_OK) {
        free(keys);
        return st;
    }
    *out = keys;
    return DI_OK;
}

static di_status h_lookup(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    UNPACK(Di__Kvstore__LookupRequest, di__kvstore__lookup_request__unpack, req, err);
    kvkey *keys = NULL;
    di_status st = keys_from(msg->block_keys, msg->n_block_keys, &keys, err);
    size_t n = msg->n_block_keys;
    di__kvstore__lookup_request__free_unpacked(msg, NULL);
    if (st != DI_OK)
        return st;
    uint32_t *windows = malloc((n ? n : 1) * sizeof(uint32_t));
    if (!windows) {
        free(keys);
        return di_fail(err, DI_ENOMEM, "cannot allocate the lookup reply");
    }
    uint32_t hit = 0;
    size_t nw = 0;
    kvs_lookup(s->cfg.store, keys, n, &hit, windows, n, &nw);
    Di__Kvstore__LookupReply rep = DI__KVSTORE__LOOKUP_REPLY__INIT;
    rep.blocks_hit = hit;
    rep.n_window_blocks = nw;
    rep.window_blocks = windows;
    st = pack(&rep.base, r, err);
    free(keys);
    free(windows);
    return st;
}

/* AllocResult and LeaseResult start alike, and so do AllocReply and LeaseReply: one batch
 * loop fills either. */
typedef struct result_head {
    ProtobufCMessage base;
    int32_t status;
    char *error;
} result_head;
#define SAME_HEAD(T)                                                                           \
    _Static_assert(offsetof(T, status) == offsetof(result_head, status) &&                    \
                       offsetof(T, error) == offsetof(result_head, error),                    \
                   #T " does not start like result_head")
SAME_HEAD(Di__Kvstore__AllocResult);
SAME_HEAD(Di__Kvstore__LeaseResult);
_Static_assert(sizeof(Di__Kvstore__AllocReply) == sizeof(Di__Kvstore__LeaseReply) &&
                   offsetof(Di__Kvstore__AllocReply, store_id) ==
                       offsetof(Di__Kvstore__LeaseReply, store_id) &&
                   offsetof(Di__Kvstore__AllocReply, results) ==
                       offsetof(Di__Kvstore__LeaseReply, results),
               "AllocReply differs from LeaseReply");

/* The argument of an Alloc or Lease batch: the tickets its reply points into. */
typedef struct batch_arg {
    uint32_t lease_ms;      /* Lease */
    int release;            /* Lease: release after the transfer */
    ucxt_ticket *tickets;   /* one per item */
} batch_arg;

/* Handles item i of a batch into its result message; arg is the batch's own argument. */
typedef di_status (*item_fn)(kvsvc *s, const rpc_request *req, const void *arg,
                             const void *item, size_t i, void *result, di_error *e);

/* The shape of an Alloc or Lease batch: a result per item, then a reply with the store id. */
typedef struct batch_kind {
    const char *what;                           /* "Alloc" */
    const ProtobufCMessageDescriptor *result;   /* AllocResult */
    size_t result_size;                         /* sizeof it */
    const ProtobufCMessageDescriptor *reply;    /* AllocReply */
    item_fn fn;                                 /* per-item work */
} batch_kind;

static di_status run_batch(kvsvc *s, const rpc_request *req, const batch_kind *k,
                           const void *arg, void *const *items, size_t n, rpc_reply *r,
                           di_error *err)
{
    scratch sc;
    di_status st = check_count(n, KVC_MAX_BATCH, "items", err);
    if (st == DI_OK)
        st = scratch_alloc(&sc, n, err);
    if (st != DI_OK)
        return st;
    uint8_t *res = calloc(n ? n : 1, k->result_size);
    void **ptrs = calloc(n ? n : 1, sizeof(*ptrs));
    if (!res || !ptrs)
        st = di_fail(err, DI_ENOMEM, "cannot allocate %zu results", n);
    for (size_t i = 0; st == DI_OK && i < n; i++) {
        result_head *h = (result_head *)(res + i * k->result_size);
        protobuf_c_message_init(k->result, h);
        ptrs[i] = h;
        di_status ist = past_deadline(req)
                            ? di_fail(&sc.errs[i], DI_ETIMEDOUT, "deadline passed before this item")
                            : k->fn(s, req, arg, items[i], i, h, &sc.errs[i]);
        h->status = ist;
        h->error = ist == DI_OK ? (char *)"" : sc.errs[i].msg;
        log_item(s, req, k->what, i, ist, &sc.errs[i]);
    }
    if (st == DI_OK) {
        Di__Kvstore__LeaseReply rep;
        protobuf_c_message_init(k->reply, &rep);
        rep.store_id = s->cfg.store_id;
        rep.n_results = n;
        rep.results = (Di__Kvstore__LeaseResult **)ptrs;
        st = pack(&rep.base, r, err);
    }
    free(res);
    free(ptrs);
    scratch_free(&sc);
    return st;
}

static di_status alloc_one(kvsvc *s, const rpc_request *req, const void *arg,
                           const void *item, size_t i, void *result, di_error *e)
{
    (void)req;
    const Di__Kvstore__AllocItem *it = item;
    Di__Kvstore__AllocResult *res = result;
    int cls = it->cls;
    kvkey key;
    uint64_t off = 0;
    if (cls < 0 || cls >= (int)KVKEY_CLASS_COUNT)
        return di_fail(e, DI_EINVAL, "item %zu: unknown object class %d", i, cls);
    di_status st = check_key(&it->key, i, &key, e);
    if (st == DI_OK)
        st = kvs_alloc(s->cfg.store, cls, &key, it->bytes, &res->alloc_id, &off, e);
    if (st != DI_OK)
        return st;
    ucxt_ticket *t = ((const batch_arg *)arg)->tickets + i;
    st = kvt_issue(s->tickets, KVT_PUT, res->alloc_id, off, it->bytes,
                   ticket_expiry(s->cfg.alloc_timeout_ms), 0, t, e);
    if (st != DI_OK) {
        di_error ae;
        kvs_abort(s->cfg.store, res->alloc_id, &ae);
        return st;
    }
    res->ticket = (ProtobufCBinaryData){sizeof(t->b), t->b};
    return DI_OK;
}

static const batch_kind alloc_kind = {"Alloc", &di__kvstore__alloc_result__descriptor,
                                      sizeof(Di__Kvstore__AllocResult),
                                      &di__kvstore__alloc_reply__descriptor, alloc_one};

/* DI_OK when the store offers the data path `path` (KVC_PATHS_*). */
static di_status path_offered(const kvsvc *s, unsigned path, di_error *err)
{
    if (s->cfg.data_paths & path)
        return DI_OK;
    return di_fail(err, DI_EPERM, "this store moves KV bytes over %s only (--data-path): use %s",
                   path == KVC_PATHS_UCX ? "gRPC" : "UCX",
                   path == KVC_PATHS_UCX ? "Get and Put" : "Alloc, Lease and UCX");
}

static di_status h_alloc(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    if (path_offered(svc, KVC_PATHS_UCX, err) != DI_OK)
        return DI_EPERM;
    UNPACK(Di__Kvstore__AllocRequest, di__kvstore__alloc_request__unpack, req, err);
    batch_arg a = {.tickets = calloc(msg->n_items ? msg->n_items : 1, sizeof(ucxt_ticket))};
    di_status st = a.tickets ? run_batch(svc, req, &alloc_kind, &a, (void *const *)msg->items,
                                         msg->n_items, r, err)
                             : di_fail(err, DI_ENOMEM, "cannot allocate %zu tickets", msg->n_items);
    free(a.tickets);
    di__kvstore__alloc_request__free_unpacked(msg, NULL);
    return st;
}

/* Commits the allocations whose bytes landed through their tickets; the others fail. */
static void commit_landed(kvsvc *s, const uint64_t *ids, size_t n, scratch *sc)
{
    uint64_t *ok = malloc(n * sizeof(*ok));
    size_t *at = malloc(n * sizeof(*at));
    di_status *ost = malloc(n * sizeof(*ost));
    di_error *oerr = malloc(n * sizeof(*oerr));
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        di_status st = kvt_settle_put(s->tickets, ids[i]);
        if (st == DI_OK && ok && at && ost && oerr) {
            ok[m] = ids[i];
            at[m++] = i;
            continue;
        }
        if (st == DI_OK)
            sc->st[i] = di_fail(&sc->errs[i], DI_ENOMEM, "cannot allocate the commit");
        else if (st == DI_EBUSY)
            sc->st[i] = di_fail(&sc->errs[i], DI_EBUSY,
                                "allocation %llu: its bytes are still arriving; commit after "
                                "the store acknowledged them",
                                (unsigned long long)ids[i]);
        else {
            di_error ae;
            sc->st[i] = di_fail(&sc->errs[i], DI_ESTATE,
                                "allocation %llu: no bytes arrived with its ticket; the "
                                "allocation is dropped, put the object again",
                                (unsigned long long)ids[i]);
            kvs_abort(s->cfg.store, ids[i], &ae);
        }
    }
    if (m > 0) {
        kvs_commit(s->cfg.store, ok, m, ost, oerr);
        for (size_t k = 0; k < m; k++) {
            sc->st[at[k]] = ost[k];
            sc->errs[at[k]] = oerr[k];
        }
    }
    free(ok);
    free(at);
    free(ost);
    free(oerr);
}

static di_status h_commit(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    UNPACK(Di__Kvstore__CommitRequest, di__kvstore__commit_request__unpack, req, err);
    size_t n = msg->n_alloc_ids;
    scratch sc;
    di_status st = check_count(n, KVC_MAX_BATCH, "allocations", err);
    if (st == DI_OK)
        st = scratch_alloc(&sc, n, err);
    if (st == DI_OK) {
        commit_landed(s, msg->alloc_ids, n, &sc);
        for (size_t i = 0; i < n; i++)
            log_item(s, req, "Commit", i, sc.st[i], &sc.errs[i]);
        st = pack_statuses(&di__kvstore__commit_reply__descriptor, n, sc.st, sc.errs, r, err);
        scratch_free(&sc);
    }
    di__kvstore__commit_request__free_unpacked(msg, NULL);
    return st;
}

/* Per-id work of Abort and Release. */
typedef di_status (*id_fn)(kvsvc *s, uint64_t id, di_error *err);

static di_status abort_one(kvsvc *s, uint64_t id, di_error *err)
{
    if (kvt_settle_put(s->tickets, id) == DI_EBUSY)
        return di_fail(err, DI_EBUSY, "allocation %llu: its bytes are still arriving",
                       (unsigned long long)id);
    return kvs_abort(s->cfg.store, id, err);
}

/* A lease whose get is in flight is released when the get ends. */
static di_status release_one(kvsvc *s, uint64_t id, di_error *err)
{
    return kvt_release_get(s->tickets, id) ? kvs_release(s->cfg.store, id, err) : DI_OK;
}

/* Runs fn on every id and packs the statuses with the reply descriptor. */
static di_status id_batch(kvsvc *s, const uint64_t *ids, size_t n, const char *what, id_fn fn,
                          const ProtobufCMessageDescriptor *reply, rpc_reply *r, di_error *err)
{
    scratch sc;
    di_status st = check_count(n, KVC_MAX_BATCH, what, err);
    if (st == DI_OK)
        st = scratch_alloc(&sc, n, err);
    if (st != DI_OK)
        return st;
    for (size_t i = 0; i < n; i++)
        sc.st[i] = fn(s, ids[i], &sc.errs[i]);
    st = pack_statuses(reply, n, sc.st, sc.errs, r, err);
    scratch_free(&sc);
    return st;
}

static di_status h_abort(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    UNPACK(Di__Kvstore__AbortRequest, di__kvstore__abort_request__unpack, req, err);
    di_status st = id_batch(svc, msg->alloc_ids, msg->n_alloc_ids, "allocations", abort_one,
                            &di__kvstore__abort_reply__descriptor, r, err);
    di__kvstore__abort_request__free_unpacked(msg, NULL);
    return st;
}

static di_status lease_one(kvsvc *s, const rpc_request *req, const void *arg,
                           const void *item, size_t i, void *result, di_error *e)
{
    const Di__Kvstore__ObjRef *ref = item;
    Di__Kvstore__LeaseResult *res = result;
    const batch_arg *a = arg;
    int cls = 0;
    kvkey key;
    di_status st = check_ref(ref, i, &cls, &key, e);
    kvs_lease_info li;
    if (st == DI_OK)
        st = kvs_lease(s->cfg.store, cls, &key, a->lease_ms, req->deadline_ns, &li, e);
    if (st != DI_OK)
        return st;
    ucxt_ticket *t = a->tickets + i;
    st = kvt_issue(s->tickets, KVT_GET, li.lease_id, li.offset, li.bytes,
                   ticket_expiry(li.expires_in_ms), a->release, t, e);
    if (st != DI_OK) {
        di_error re;
        kvs_release(s->cfg.store, li.lease_id, &re);
        return st;
    }
    res->lease_id = li.lease_id;
    res->bytes = li.bytes;
    res->expires_in_ms = (uint32_t)li.expires_in_ms;
    res->ticket = (ProtobufCBinaryData){sizeof(t->b), t->b};
    return DI_OK;
}

static const batch_kind lease_kind = {"Lease", &di__kvstore__lease_result__descriptor,
                                      sizeof(Di__Kvstore__LeaseResult),
                                      &di__kvstore__lease_reply__descriptor, lease_one};

static di_status h_lease(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    UNPACK(Di__Kvstore__LeaseRequest, di__kvstore__lease_request__unpack, req, err);
    batch_arg a = {.lease_ms = msg->lease_ms ? msg->lease_ms : s->cfg.lease_default_ms,
                   .release = msg->release_after_transfer,
                   .tickets = calloc(msg->n_items ? msg->n_items : 1, sizeof(ucxt_ticket))};
    di_status st = a.tickets ? run_batch(s, req, &lease_kind, &a, (void *const *)msg->items,
                                         msg->n_items, r, err)
                             : di_fail(err, DI_ENOMEM, "cannot allocate %zu tickets", msg->n_items);
    free(a.tickets);
    di__kvstore__lease_request__free_unpacked(msg, NULL);
    return st;
}

static di_status h_release(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    UNPACK(Di__Kvstore__ReleaseRequest, di__kvstore__release_request__unpack, req, err);
    di_status st = id_batch(svc, msg->lease_ids, msg->n_lease_ids, "leases", release_one,
                            &di__kvstore__release_reply__descriptor, r, err);
    di__kvstore__release_request__free_unpacked(msg, NULL);
    return st;
}

/* ---------------------------------------------------------------- the gRPC data path */

/* The per-item scratch of a batch of n items, after the count check. */
static di_status batch_scratch(size_t n, scratch *sc, di_error *err)
{
    di_status st = check_count(n, KVC_MAX_BATCH, "items", err);
    return st == DI_OK ? scratch_alloc(sc, n, err) : st;
}

/* Takes the ticket just issued for one object and begins its transfer here: from now on the
 * slot is held as if a UCX transfer ran (Release, Commit and Abort by anyone wait for it), and
 * g names the exact range. On failure the ticket is dropped. */
static di_status hold(kvsvc *s, int kind, uint64_t id, const ucxt_ticket *t, uint64_t len,
                      ucxt_grant *g, size_t i, di_error *e)
{
    di_status st = dp_begin(s, kind, t, len, g);
    if (st == DI_OK)
        return DI_OK;
    if (kind == KVT_GET)
        kvt_release_get(s->tickets, id);
    else
        kvt_settle_put(s->tickets, id);
    return di_fail(e, st, "item %zu: the store could not hold the object for the copy (%s)", i,
                   di_status_name(st));
}

/* Leases one object of a Get and holds it for the copy into the reply; room: object bytes the
 * reply may still take. */
static di_status get_one(kvsvc *s, const rpc_request *req, const Di__Kvstore__ObjRef *ref,
                         size_t i, uint64_t room, uint64_t *id, ProtobufCBinaryData *data,
                         di_error *e)
{
    int cls = 0;
    kvkey key;
    kvs_lease_info li;
    di_status st = check_ref(ref, i, &cls, &key, e);
    if (st == DI_OK)
        st = kvs_lease(s->cfg.store, cls, &key, s->cfg.lease_default_ms, req->deadline_ns, &li, e);
    if (st != DI_OK)
        return st;
    ucxt_ticket t;
    if (li.bytes > room)
        st = di_fail(e, DI_EFULL, "item %zu: the reply is full (%u bytes of objects per message); "
                     "ask for it in another call", i, KVC_GRPC_MAX_DATA);
    else
        st = kvt_issue(s->tickets, KVT_GET, li.lease_id, li.offset, li.bytes,
                       ticket_expiry(li.expires_in_ms), 1, &t, e);
    if (st != DI_OK) {
        di_error re;
        kvs_release(s->cfg.store, li.lease_id, &re);
        return st;
    }
    ucxt_grant g;
    st = hold(s, KVT_GET, li.lease_id, &t, 0, &g, i, e);
    if (st != DI_OK) {
        di_error re;
        kvs_release(s->cfg.store, li.lease_id, &re);
        return st;
    }
    *id = li.lease_id;
    *data = (ProtobufCBinaryData){g.len, g.addr};
    return DI_OK;
}

static di_status h_get(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    if (path_offered(s, KVC_PATHS_GRPC, err) != DI_OK)
        return DI_EPERM;
    UNPACK(Di__Kvstore__GetRequest, di__kvstore__get_request__unpack, req, err);
    size_t n = msg->n_items;
    scratch sc;
    di_status st = batch_scratch(n, &sc, err);
    if (st != DI_OK) {
        di__kvstore__get_request__free_unpacked(msg, NULL);
        return st;
    }
    Di__Kvstore__GetResult *res = calloc(n ? n : 1, sizeof(*res));
    Di__Kvstore__GetResult **ptrs = calloc(n ? n : 1, sizeof(*ptrs));
    uint64_t *ids = calloc(n ? n : 1, sizeof(*ids));
    if (!res || !ptrs || !ids)
        st = di_fail(err, DI_ENOMEM, "cannot allocate %zu results", n);
    uint64_t used = 0;
    for (size_t i = 0; st == DI_OK && i < n; i++) {
        di__kvstore__get_result__init(&res[i]);
        ptrs[i] = &res[i];
        sc.st[i] = past_deadline(req)
                       ? di_fail(&sc.errs[i], DI_ETIMEDOUT, "deadline passed before this item")
                       : get_one(s, req, msg->items[i], i, KVC_GRPC_MAX_DATA - used, &ids[i],
                                 &res[i].data, &sc.errs[i]);
        used += res[i].data.len;
        res[i].status = sc.st[i];
        res[i].error = sc.st[i] == DI_OK ? (char *)"" : sc.errs[i].msg;
        log_item(s, req, "Get", i, sc.st[i], &sc.errs[i]);
    }
    if (st == DI_OK) {
        Di__Kvstore__GetReply rep = DI__KVSTORE__GET_REPLY__INIT;
        rep.store_id = s->cfg.store_id;
        rep.n_results = n;
        rep.results = ptrs;
        st = pack(&rep.base, r, err);
    }
    /* The copies are in the reply: end the holds, which releases the leases. */
    for (size_t i = 0; res && ids && i < n; i++)
        if (sc.st[i] == DI_OK)
            dp_get_end(s, (void *)(uintptr_t)ids[i], DI_OK);
    free(res);
    free(ptrs);
    free(ids);
    scratch_free(&sc);
    di__kvstore__get_request__free_unpacked(msg, NULL);
    return st;
}

/* Allocates one object of a Put and copies its bytes into the slot, through a ticket held
 * until the commit. */
static di_status put_one(kvsvc *s, const Di__Kvstore__PutItem *it, size_t i, uint64_t *id,
                         di_error *e)
{
    int cls = it->cls;
    kvkey key;
    uint64_t off = 0;
    if (cls < 0 || cls >= (int)KVKEY_CLASS_COUNT)
        return di_fail(e, DI_EINVAL, "item %zu: unknown object class %d", i, cls);
    di_status st = check_key(&it->key, i, &key, e);
    if (st == DI_OK)
        st = kvs_alloc(s->cfg.store, cls, &key, it->data.len, id, &off, e);
    if (st != DI_OK)
        return st;
    ucxt_ticket t;
    ucxt_grant g;
    st = kvt_issue(s->tickets, KVT_PUT, *id, off, it->data.len,
                   ticket_expiry(s->cfg.alloc_timeout_ms), 0, &t, e);
    if (st == DI_OK)
        st = hold(s, KVT_PUT, *id, &t, it->data.len, &g, i, e);
    if (st != DI_OK) {
        di_error ae;
        kvs_abort(s->cfg.store, *id, &ae);
        return st;
    }
    memcpy(g.addr, it->data.data, it->data.len);
    return DI_OK;
}

static di_status h_put(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    if (path_offered(s, KVC_PATHS_GRPC, err) != DI_OK)
        return DI_EPERM;
    UNPACK(Di__Kvstore__PutRequest, di__kvstore__put_request__unpack, req, err);
    size_t n = msg->n_items;
    scratch sc, cs;
    di_status st = batch_scratch(n, &sc, err);
    if (st == DI_OK && scratch_alloc(&cs, n, err) != DI_OK) {
        scratch_free(&sc);
        st = DI_ENOMEM;
    }
    if (st != DI_OK) {
        di__kvstore__put_request__free_unpacked(msg, NULL);
        return st;
    }
    uint64_t *ids = calloc(n ? n : 1, sizeof(*ids));
    size_t *at = calloc(n ? n : 1, sizeof(*at));
    size_t m = 0;
    if (!ids || !at)
        st = di_fail(err, DI_ENOMEM, "cannot allocate %zu results", n);
    for (size_t i = 0; st == DI_OK && i < n; i++) {
        sc.st[i] = past_deadline(req)
                       ? di_fail(&sc.errs[i], DI_ETIMEDOUT, "deadline passed before this item")
                       : put_one(s, msg->items[i], i, &ids[m], &sc.errs[i]);
        if (sc.st[i] == DI_OK)
            at[m++] = i;
    }
    if (st == DI_OK && m > 0) {
        kvs_commit(s->cfg.store, ids, m, cs.st, cs.errs);
        for (size_t k = 0; k < m; k++) {
            sc.st[at[k]] = cs.st[k];
            sc.errs[at[k]] = cs.errs[k];
            dp_put_end(s, (void *)(uintptr_t)ids[k], DI_ECANCELED); /* drops the ticket */
        }
    }
    for (size_t i = 0; st == DI_OK && i < n; i++)
        log_item(s, req, "Put", i, sc.st[i], &sc.errs[i]);
    Di__Kvstore__ItemStatus *items = NULL, **iptrs = NULL;
    if (st == DI_OK)
        st = status_list(n, sc.st, sc.errs, &items, &iptrs, err);
    if (st == DI_OK) {
        Di__Kvstore__PutReply rep = DI__KVSTORE__PUT_REPLY__INIT;
        rep.store_id = s->cfg.store_id;
        rep.n_results = n;
        rep.results = iptrs;
        st = pack(&rep.base, r, err);
    }
    free(items);
    free(iptrs);
    free(ids);
    free(at);
    scratch_free(&sc);
    scratch_free(&cs);
    di__kvstore__put_request__free_unpacked(msg, NULL);
    return st;
}

/* Per-object work of Delete and ReportCorrupt. */
typedef di_status (*ref_fn)(kvs_store *store, int cls, const kvkey *key, di_error *err);

/* Runs fn on every ref and packs the statuses with the reply descriptor; log_as names the
 * items whose DI_OK is worth a (rate-limited) warning. */
static di_status ref_batch(kvsvc *s, const rpc_request *req, Di__Kvstore__ObjRef **refs,
                           size_t n, ref_fn fn, const char *log_as,
                           const ProtobufCMessageDescriptor *reply, rpc_reply *r, di_error *err)
{
    scratch sc;
    di_status st = check_count(n, KVC_MAX_BATCH, "items", err);
    if (st == DI_OK)
        st = scratch_alloc(&sc, n, err);
    if (st != DI_OK)
        return st;
    for (size_t i = 0; i < n; i++) {
        int cls = 0;
        kvkey key;
        sc.st[i] = check_ref(refs[i], i, &cls, &key, &sc.errs[i]);
        if (sc.st[i] == DI_OK)
            sc.st[i] = fn(s->cfg.store, cls, &key, &sc.errs[i]);
        if (sc.st[i] == DI_OK && log_as)
            di_log_limited(s->cfg.log, &s->item_limit, di_mono_ns(), "%s from %s: %s", log_as,
                           req->peer, sc.errs[i].msg);
    }
    st = pack_statuses(reply, n, sc.st, sc.errs, r, err);
    scratch_free(&sc);
    return st;
}

static di_status h_delete(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    UNPACK(Di__Kvstore__DeleteRequest, di__kvstore__delete_request__unpack, req, err);
    di_status st = ref_batch(svc, req, msg->items, msg->n_items, kvs_delete, NULL,
                             &di__kvstore__delete_reply__descriptor, r, err);
    di__kvstore__delete_request__free_unpacked(msg, NULL);
    return st;
}

static di_status h_report_corrupt(void *svc, const rpc_request *req, rpc_reply *r,
                                  di_error *err)
{
    UNPACK(Di__Kvstore__ReportCorruptRequest, di__kvstore__report_corrupt_request__unpack, req,
           err);
    di_status st = ref_batch(svc, req, msg->items, msg->n_items, kvs_report_corrupt,
                             "corrupt copy reported", &di__kvstore__report_corrupt_reply__descriptor,
                             r, err);
    di__kvstore__report_corrupt_request__free_unpacked(msg, NULL);
    return st;
}

/* ---------------------------------------------------------------- admin methods */

static di_status h_stats(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    UNPACK(Di__Kvstore__StatsRequest, di__kvstore__stats_request__unpack, req, err);
    di__kvstore__stats_request__free_unpacked(msg, NULL);
    kvs_stats st;
    kvs_get_stats(s->cfg.store, &st);
    Di__Kvstore__ClassStats cs[KVKEY_CLASS_COUNT];
    Di__Kvstore__ClassStats *cp[KVKEY_CLASS_COUNT];
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++) {
        di__kvstore__class_stats__init(&cs[c]);
        cs[c].cls = (Di__Kvstore__ObjClass)c;
        cs[c].objects = st.idx.cls[c].objects;
        cs[c].bytes = st.idx.cls[c].bytes;
        cs[c].dram_objects = st.idx.cls[c].dram_objects;
        cs[c].dram_bytes = st.idx.cls[c].dram_bytes;
        cs[c].dram_slots = st.slab[c].slots;
        cs[c].dram_slot_limit = st.slab[c].limit;
        cs[c].dram_slots_used = st.slab[c].used;
        cs[c].slot_bytes = st.slab[c].slot_bytes;
        cs[c].writing = st.idx.cls[c].writing;
        cs[c].ttl_ms = st.ttl_ms[c];
        cp[c] = &cs[c];
    }
    Di__Kvstore__StatsReply rep = DI__KVSTORE__STATS_REPLY__INIT;
    rep.n_classes = KVKEY_CLASS_COUNT;
    rep.classes = cp;
    rep.dram_capacity = st.dram_capacity;
    rep.dram_arena_bytes = st.dram_arena_bytes;
    rep.disk_capacity = st.idx.disk_capacity;
    rep.disk_used = st.idx.disk_used;
    rep.disk_deleting = st.idx.disk_deleting;
    rep.disk_sst_bytes = st.disk.sst_bytes;
    rep.disk_memtable_bytes = st.disk.memtable_bytes;
    rep.lease_hits = st.idx.lease_hits;
    rep.lease_misses = st.idx.lease_misses;
    rep.lookup_blocks = st.idx.lookup_blocks;
    rep.lookup_hits = st.idx.lookup_hits;
    rep.dram_evictions = st.idx.dram_evictions;
    rep.disk_evictions = st.idx.disk_evictions;
    rep.expirations = st.idx.expirations;
    rep.corrupt_dropped = st.idx.corrupt_dropped;
    rep.deletes = st.idx.deletes;
    rep.commits = st.idx.commits;
    rep.commit_failures = st.idx.commit_failures;
    rep.alloc_reclaimed = st.idx.alloc_reclaimed;
    rep.promotions = st.idx.promotions;
    rep.leases_active = st.idx.leases_active;
    rep.leases_timed_out = st.idx.leases_timed_out;
    rep.get_bytes = st.get_bytes;
    rep.put_bytes = st.put_bytes;
    rep.get_bytes_per_s = st.get_bytes_per_s;
    rep.put_bytes_per_s = st.put_bytes_per_s;
    rep.uptime_ms = st.uptime_ms;
    rep.durability = (char *)kvdisk_durability_name(s->cfg.durability);
    rep.store_id = s->cfg.store_id;
    rep.model_id = s->cfg.geometry.model_id;
    rep.disk_files_lost = st.disk.files_lost;
    rep.disk_meta_bad = st.disk_meta_bad;
    return pack(&rep.base, r, err);
}

static di_status pack_ttls(kvsvc *s, rpc_reply *r, di_error *err)
{
    kvs_stats st;
    kvs_get_stats(s->cfg.store, &st);
    Di__Kvstore__TtlReply rep = DI__KVSTORE__TTL_REPLY__INIT;
    rep.n_ttl_ms = KVKEY_CLASS_COUNT;
    rep.ttl_ms = st.ttl_ms;
    return pack(&rep.base, r, err);
}

static di_status h_ttl(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    UNPACK(Di__Kvstore__TtlRequest, di__kvstore__ttl_request__unpack, req, err);
    di_status st = DI_OK;
    if (msg->set)
        st = kvs_set_ttl(s->cfg.store, (int)msg->cls, msg->ttl_ms, err);
    di__kvstore__ttl_request__free_unpacked(msg, NULL);
    return st == DI_OK ? pack_ttls(s, r, err) : st;
}

static di_status h_capacity(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    UNPACK(Di__Kvstore__CapacityRequest, di__kvstore__capacity_request__unpack, req, err);
    di_status st = DI_OK;
    if (msg->set)
        st = kvs_set_capacity(s->cfg.store, (int)msg->tier, msg->bytes, err);
    di__kvstore__capacity_request__free_unpacked(msg, NULL);
    if (st != DI_OK)
        return st;
    kvs_stats ks;
    kvs_get_stats(s->cfg.store, &ks);
    Di__Kvstore__CapacityReply rep = DI__KVSTORE__CAPACITY_REPLY__INIT;
    rep.dram_bytes = ks.dram_capacity;
    rep.dram_arena_bytes = ks.dram_arena_bytes;
    rep.disk_bytes = ks.idx.disk_capacity;
    return pack(&rep.base, r, err);
}

static void inspect_entry(kvsvc *s, int cls, const kvkey *key, Di__Kvstore__InspectEntry *e)
{
    kvidx_info info;
    uint64_t now;
    kvs_inspect(s->cfg.store, cls, key, &info, &now);
    di__kvstore__inspect_entry__init(e);
    e->present = info.present;
    e->in_dram = info.resident;
    e->bytes = info.bytes;
    e->leases = info.pins;
    e->expires_in_ms = !info.present                  ? 0
                       : info.expires_ms == UINT64_MAX ? -1
                                                       : (int64_t)(info.expires_ms - now);
}

static di_status h_inspect(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    UNPACK(Di__Kvstore__InspectRequest, di__kvstore__inspect_request__unpack, req, err);
    kvkey *keys = NULL;
    size_t n = msg->n_block_keys;
    di_status st = keys_from(msg->block_keys, n, &keys, err);
    di__kvstore__inspect_request__free_unpacked(msg, NULL);
    if (st != DI_OK)
        return st;
    Di__Kvstore__InspectEntry *ent = calloc(2 * (n ? n : 1), sizeof(*ent));
    Di__Kvstore__InspectEntry **ptrs = calloc(2 * (n ? n : 1), sizeof(*ptrs));
    if (!ent || !ptrs)
        st = di_fail(err, DI_ENOMEM, "cannot allocate %zu entries", 2 * n);
    for (size_t i = 0; st == DI_OK && i < n; i++) {
        inspect_entry(s, KVKEY_BLOCK, &keys[i], &ent[i]);
        inspect_entry(s, KVKEY_WINDOW, &keys[i], &ent[n + i]);
        ptrs[i] = &ent[i];
        ptrs[n + i] = &ent[n + i];
    }
    if (st == DI_OK) {
        Di__Kvstore__InspectReply rep = DI__KVSTORE__INSPECT_REPLY__INIT;
        rep.n_blocks = n;
        rep.blocks = ptrs;
        rep.n_windows = n;
        rep.windows = ptrs + n;
        st = pack(&rep.base, r, err);
    }
    free(ent);
    free(ptrs);
    free(keys);
    return st;
}

static di_status h_evict(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    UNPACK(Di__Kvstore__EvictRequest, di__kvstore__evict_request__unpack, req, err);
    uint64_t evicted = 0, skipped = 0;
    di_status st = check_count(msg->n_items, KVC_MAX_BATCH, "items", err);
    if (st == DI_OK && msg->n_items == 0)
        kvs_evict(s->cfg.store, msg->class_mask & 7u, msg->dram_only, &evicted, &skipped);
    for (size_t i = 0; st == DI_OK && i < msg->n_items; i++) {
        int cls = 0;
        kvkey key;
        st = check_ref(msg->items[i], i, &cls, &key, err);
        if (st != DI_OK)
            break;
        di_error e;
        di_status ist = kvs_evict_key(s->cfg.store, cls, &key, msg->dram_only, &e);
        evicted += ist == DI_OK;
        skipped += ist == DI_EBUSY;
    }
    di__kvstore__evict_request__free_unpacked(msg, NULL);
    if (st != DI_OK)
        return st;
    Di__Kvstore__EvictReply rep = DI__KVSTORE__EVICT_REPLY__INIT;
    rep.evicted = evicted;
    rep.skipped_leased = skipped;
    return pack(&rep.base, r, err);
}

static di_status h_compact(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    UNPACK(Di__Kvstore__CompactRequest, di__kvstore__compact_request__unpack, req, err);
    di__kvstore__compact_request__free_unpacked(msg, NULL);
    Di__Kvstore__CompactReply rep = DI__KVSTORE__COMPACT_REPLY__INIT;
    kvs_compact(s->cfg.store, &rep.expired, &rep.sst_bytes_before, &rep.sst_bytes_after);
    return pack(&rep.base, r, err);
}

/* ---------------------------------------------------------------- the table */

/* name, handler, default deadline (ms), idempotent, largest request (bytes), role */
static const rpc_method methods[] = {
    {KVC_SERVICE "Connect", h_connect, 5000, 1, 4 << 10, RPC_ROLE_ENGINE},
    {KVC_SERVICE "Lookup", h_lookup, 5000, 1, 1 << 20, RPC_ROLE_ENGINE},
    {KVC_SERVICE "Alloc", h_alloc, 10000, 0, 256 << 10, RPC_ROLE_ENGINE},
    {KVC_SERVICE "Commit", h_commit, 60000, 0, 64 << 10, RPC_ROLE_ENGINE},
    {KVC_SERVICE "Abort", h_abort, 5000, 1, 64 << 10, RPC_ROLE_ENGINE},
    {KVC_SERVICE "Lease", h_lease, 30000, 0, 256 << 10, RPC_ROLE_ENGINE},
    {KVC_SERVICE "Get", h_get, 30000, 1, 256 << 10, RPC_ROLE_ENGINE},
    {KVC_SERVICE "Put", h_put, 60000, 0, KVC_GRPC_MAX_MESSAGE, RPC_ROLE_ENGINE},
    {KVC_SERVICE "Release", h_release, 5000, 0, 64 << 10, RPC_ROLE_ENGINE},
    {KVC_SERVICE "Delete", h_delete, 30000, 1, 256 << 10, RPC_ROLE_ENGINE},
    {KVC_SERVICE "ReportCorrupt", h_report_corrupt, 30000, 1, 256 << 10, RPC_ROLE_ENGINE},
    {KVC_SERVICE "Stats", h_stats, 5000, 1, 1 << 10, RPC_ROLE_ADMIN},
    {KVC_SERVICE "Ttl", h_ttl, 5000, 1, 1 << 10, RPC_ROLE_ADMIN},
    {KVC_SERVICE "Capacity", h_capacity, 30000, 1, 1 << 10, RPC_ROLE_ADMIN},
    {KVC_SERVICE "Inspect", h_inspect, 10000, 1, 1 << 20, RPC_ROLE_ADMIN},
    {KVC_SERVICE "Evict", h_evict, 60000, 1, 256 << 10, RPC_ROLE_ADMIN},
    {KVC_SERVICE "Compact", h_compact, 600000, 1, 1 << 10, RPC_ROLE_ADMIN},
};

const rpc_method *kvsvc_methods(size_t *n)
{
    *n = sizeof(methods) / sizeof(methods[0]);
    return methods;
}
