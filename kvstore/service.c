#include "kvstore/service.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "common/net/kv_client.h"
#include "common/net/kvstore.pb-c.h"
#include "common/util/clock.h"

struct kvsvc {
    kvsvc_config cfg;      /* worker_addr and rkey point at the copies below */
    uint8_t *worker_addr;  /* copy */
    uint8_t *rkey;         /* copy */
    di_log_limit item_limit; /* item failures and corrupt-copy reports: 5 lines per 10 s */
};

di_status kvsvc_create(const kvsvc_config *cfg, kvsvc **out, di_error *err)
{
    kvsvc *s = calloc(1, sizeof(*s));
    if (!s)
        return di_fail(err, DI_ENOMEM, "cannot allocate the service");
    s->cfg = *cfg;
    di_log_limit_init(&s->item_limit, "item failures", DI_LOG_WARN, 5, 10000);
    s->worker_addr = malloc(cfg->worker_addr_len ? cfg->worker_addr_len : 1);
    s->rkey = malloc(cfg->rkey_len ? cfg->rkey_len : 1);
    if (!s->worker_addr || !s->rkey) {
        kvsvc_free(s);
        return di_fail(err, DI_ENOMEM, "cannot allocate the service");
    }
    if (cfg->worker_addr_len)
        memcpy(s->worker_addr, cfg->worker_addr, cfg->worker_addr_len);
    if (cfg->rkey_len)
        memcpy(s->rkey, cfg->rkey, cfg->rkey_len);
    *out = s;
    return DI_OK;
}

kvsvc *kvsvc_free(kvsvc *s)
{
    if (!s)
        return NULL;
    free(s->worker_addr);
    free(s->rkey);
    di_log_limit_flush(s->cfg.log, &s->item_limit, di_mono_ns(), 1);
    di_log_limit_destroy(&s->item_limit);
    free(s);
    return NULL;
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

/* A reply of per-item statuses, packed from st/errs. */
static di_status pack_statuses(const ProtobufCMessageDescriptor *desc, size_t n,
                               const di_status *st, const di_error *errs, rpc_reply *r,
                               di_error *err)
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
    /* Every ItemStatus reply has the same shape: base, n_results, results. */
    Di__Kvstore__CommitReply reply;
    memset(&reply, 0, sizeof(reply));
    protobuf_c_message_init(desc, &reply);
    reply.n_results = n;
    reply.results = ptrs;
    di_status rc = pack(&reply.base, r, err);
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
    rep.worker_address = (ProtobufCBinaryData){s->cfg.worker_addr_len, s->worker_addr};
    rep.rkey = (ProtobufCBinaryData){s->cfg.rkey_len, s->rkey};
    rep.arena_base = s->cfg.arena_base;
    rep.arena_bytes = s->cfg.arena_bytes;
    rep.geometry = &geo;
    rep.block_bytes = s->cfg.object_bytes[KVKEY_BLOCK];
    rep.window_bytes = s->cfg.object_bytes[KVKEY_WINDOW];
    rep.handoff_max_bytes = s->cfg.object_bytes[KVKEY_HANDOFF];
    rep.max_batch = KVC_MAX_BATCH;
    rep.lease_max_ms = s->cfg.lease_max_ms;
    rep.durability = (char *)kvdisk_durability_name(s->cfg.durability);
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
    (void)arg;
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
    if (st == DI_OK)
        res->remote_addr = s->cfg.arena_base + off;
    return st;
}

static const batch_kind alloc_kind = {"Alloc", &di__kvstore__alloc_result__descriptor,
                                      sizeof(Di__Kvstore__AllocResult),
                                      &di__kvstore__alloc_reply__descriptor, alloc_one};

static di_status h_alloc(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    UNPACK(Di__Kvstore__AllocRequest, di__kvstore__alloc_request__unpack, req, err);
    di_status st =
        run_batch(svc, req, &alloc_kind, NULL, (void *const *)msg->items, msg->n_items, r, err);
    di__kvstore__alloc_request__free_unpacked(msg, NULL);
    return st;
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
        kvs_commit(s->cfg.store, msg->alloc_ids, n, sc.st, sc.errs);
        for (size_t i = 0; i < n; i++)
            log_item(s, req, "Commit", i, sc.st[i], &sc.errs[i]);
        st = pack_statuses(&di__kvstore__commit_reply__descriptor, n, sc.st, sc.errs, r, err);
        scratch_free(&sc);
    }
    di__kvstore__commit_request__free_unpacked(msg, NULL);
    return st;
}

/* Per-id work of Abort and Release. */
typedef di_status (*id_fn)(kvs_store *store, uint64_t id, di_error *err);

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
        sc.st[i] = fn(s->cfg.store, ids[i], &sc.errs[i]);
    st = pack_statuses(reply, n, sc.st, sc.errs, r, err);
    scratch_free(&sc);
    return st;
}

static di_status h_abort(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    UNPACK(Di__Kvstore__AbortRequest, di__kvstore__abort_request__unpack, req, err);
    di_status st = id_batch(svc, msg->alloc_ids, msg->n_alloc_ids, "allocations", kvs_abort,
                            &di__kvstore__abort_reply__descriptor, r, err);
    di__kvstore__abort_request__free_unpacked(msg, NULL);
    return st;
}

static di_status lease_one(kvsvc *s, const rpc_request *req, const void *arg,
                           const void *item, size_t i, void *result, di_error *e)
{
    const Di__Kvstore__ObjRef *ref = item;
    Di__Kvstore__LeaseResult *res = result;
    uint32_t lease_ms = *(const uint32_t *)arg;
    int cls = 0;
    kvkey key;
    di_status st = check_ref(ref, i, &cls, &key, e);
    kvs_lease_info li;
    if (st == DI_OK)
        st = kvs_lease(s->cfg.store, cls, &key, lease_ms, req->deadline_ns, &li, e);
    if (st == DI_OK) {
        res->lease_id = li.lease_id;
        res->remote_addr = s->cfg.arena_base + li.offset;
        res->bytes = li.bytes;
        res->expires_in_ms = (uint32_t)li.expires_in_ms;
    }
    return st;
}

static const batch_kind lease_kind = {"Lease", &di__kvstore__lease_result__descriptor,
                                      sizeof(Di__Kvstore__LeaseResult),
                                      &di__kvstore__lease_reply__descriptor, lease_one};

static di_status h_lease(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    kvsvc *s = svc;
    UNPACK(Di__Kvstore__LeaseRequest, di__kvstore__lease_request__unpack, req, err);
    uint32_t lease_ms = msg->lease_ms ? msg->lease_ms : s->cfg.lease_default_ms;
    di_status st =
        run_batch(s, req, &lease_kind, &lease_ms, (void *const *)msg->items, msg->n_items, r, err);
    di__kvstore__lease_request__free_unpacked(msg, NULL);
    return st;
}

static di_status h_release(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    UNPACK(Di__Kvstore__ReleaseRequest, di__kvstore__release_request__unpack, req, err);
    di_status st = id_batch(svc, msg->lease_ids, msg->n_lease_ids, "leases", kvs_release,
                            &di__kvstore__release_reply__descriptor, r, err);
    di__kvstore__release_request__free_unpacked(msg, NULL);
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
