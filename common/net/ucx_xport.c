#include "common/net/ucx_xport.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>

#include "common/util/clock.h"

struct ucxt_ctx {
    ucp_context_h context;  /* UCP context */
    ucp_worker_h worker;    /* its one worker */
    int threaded;           /* created with UCS_THREAD_MODE_MULTI and wakeup */
    pthread_t progress;     /* progress thread, when started */
    int progress_running;   /* 1 while the thread exists */
    atomic_int stop;        /* asks the progress thread to end */
};

struct ucxt_region {
    ucxt_ctx *ctx;          /* owner */
    ucp_mem_h memh;         /* mapping */
    void *base;             /* start address */
    uint64_t bytes;         /* length */
    void *own;              /* malloc'd memory when UCX could not allocate */
};

struct ucxt_peer {
    ucxt_ctx *ctx;          /* owner */
    ucp_ep_h ep;            /* endpoint; NULL once force-closed */
    int peer_mode;          /* created with UCP_ERR_HANDLING_MODE_PEER */
    atomic_int failed;      /* set by the error callback or a deadline */
};

struct ucxt_rkey {
    ucp_rkey_h rkey;        /* unpacked key */
};

static di_status ucs_fail(di_error *err, ucs_status_t s, const char *what)
{
    di_status code = DI_EIO;
    switch (s) {
    case UCS_ERR_NO_MEMORY:
        code = DI_ENOMEM;
        break;
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT:
        code = DI_ETIMEDOUT;
        break;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_REJECTED:
    case UCS_ERR_CANCELED:
        code = DI_EUNAVAIL;
        break;
    case UCS_ERR_UNSUPPORTED:
        code = DI_EUNSUPPORTED;
        break;
    case UCS_ERR_INVALID_PARAM:
        code = DI_EINVAL;
        break;
    default:
        break;
    }
    return di_fail(err, code, "%s: UCX %s", what, ucs_status_string(s));
}

/* ---------------------------------------------------------------- context */

di_status ucxt_create(int threaded, ucxt_ctx **out, di_error *err)
{
    if (!out)
        return di_fail(err, DI_EINVAL, "ucxt_create: out is NULL");
    ucp_config_t *config = NULL;
    ucs_status_t s = ucp_config_read(NULL, NULL, &config);
    if (s != UCS_OK)
        return ucs_fail(err, s, "reading the UCX configuration");
    ucp_params_t params = {0};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | (threaded ? UCP_FEATURE_WAKEUP : 0);
    params.mt_workers_shared = threaded ? 1 : 0;
    ucxt_ctx *c = calloc(1, sizeof(*c));
    if (!c) {
        ucp_config_release(config);
        return di_fail(err, DI_ENOMEM, "cannot allocate a UCX context record");
    }
    s = ucp_init(&params, config, &c->context);
    ucp_config_release(config);
    if (s != UCS_OK) {
        free(c);
        return ucs_fail(err, s, "initialising UCX");
    }
    ucp_worker_params_t wp = {0};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = threaded ? UCS_THREAD_MODE_MULTI : UCS_THREAD_MODE_SINGLE;
    s = ucp_worker_create(c->context, &wp, &c->worker);
    if (s != UCS_OK) {
        ucp_cleanup(c->context);
        free(c);
        return ucs_fail(err, s, "creating a UCX worker");
    }
    c->threaded = threaded;
    *out = c;
    return DI_OK;
}

void ucxt_progress_stop(ucxt_ctx *c)
{
    if (!c || !c->progress_running)
        return;
    atomic_store(&c->stop, 1);
    ucp_worker_signal(c->worker);
    pthread_join(c->progress, NULL);
    c->progress_running = 0;
}

ucxt_ctx *ucxt_destroy(ucxt_ctx *c)
{
    if (!c)
        return NULL;
    ucxt_progress_stop(c);
    ucp_worker_destroy(c->worker);
    ucp_cleanup(c->context);
    free(c);
    return NULL;
}

di_status ucxt_worker_address(ucxt_ctx *c, void **buf, size_t *len, di_error *err)
{
    ucp_address_t *addr = NULL;
    size_t n = 0;
    ucs_status_t s = ucp_worker_get_address(c->worker, &addr, &n);
    if (s != UCS_OK)
        return ucs_fail(err, s, "getting the UCX worker address");
    void *copy = malloc(n);
    if (copy)
        memcpy(copy, addr, n);
    ucp_worker_release_address(c->worker, addr);
    if (!copy)
        return di_fail(err, DI_ENOMEM, "cannot copy the worker address");
    *buf = copy;
    *len = n;
    return DI_OK;
}

static void *progress_main(void *arg)
{
    ucxt_ctx *c = arg;
    while (!atomic_load(&c->stop)) {
        while (ucp_worker_progress(c->worker) != 0)
            ;
        if (atomic_load(&c->stop))
            break;
        ucs_status_t s = ucp_worker_arm(c->worker);
        if (s == UCS_ERR_BUSY)
            continue;
        if (s == UCS_OK)
            ucp_worker_wait(c->worker);
    }
    return NULL;
}

di_status ucxt_progress_start(ucxt_ctx *c, di_error *err)
{
    if (!c->threaded || c->progress_running)
        return di_fail(err, DI_ESTATE, "progress thread needs a threaded context, started once");
    atomic_store(&c->stop, 0);
    if (pthread_create(&c->progress, NULL, progress_main, c) != 0)
        return di_fail(err, DI_ENOMEM, "cannot start the UCX progress thread");
    c->progress_running = 1;
    return DI_OK;
}

/* ---------------------------------------------------------------- regions */

static di_status map_memory(ucxt_region *r, void *addr, unsigned flags, di_error *err)
{
    ucp_mem_map_params_t mp = {0};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = addr;
    mp.length = r->bytes;
    mp.flags = flags;
    ucs_status_t s = ucp_mem_map(r->ctx->context, &mp, &r->memh);
    if (s != UCS_OK)
        return ucs_fail(err, s, "mapping memory with UCX");
    ucp_mem_attr_t attr = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
    s = ucp_mem_query(r->memh, &attr);
    if (s != UCS_OK) {
        ucp_mem_unmap(r->ctx->context, r->memh);
        return ucs_fail(err, s, "querying mapped memory");
    }
    r->base = attr.address;
    return DI_OK;
}

di_status ucxt_region_map(ucxt_ctx *c, uint64_t bytes, ucxt_region **out, di_error *err)
{
    if (!c || bytes == 0 || !out)
        return di_fail(err, DI_EINVAL, "ucxt_region_map: empty region or NULL argument");
    ucxt_region *r = calloc(1, sizeof(*r));
    if (!r)
        return di_fail(err, DI_ENOMEM, "cannot allocate a region record");
    r->ctx = c;
    r->bytes = bytes;
    di_error first;
    if (map_memory(r, NULL, UCP_MEM_MAP_ALLOCATE, &first) != DI_OK) {
        if (posix_memalign(&r->own, 4096, bytes) != 0) {
            free(r);
            return di_fail(err, DI_ENOMEM, "cannot allocate %llu bytes of DRAM tier (%s)",
                           (unsigned long long)bytes, first.msg);
        }
        di_status st = map_memory(r, r->own, 0, err);
        if (st != DI_OK) {
            free(r->own);
            free(r);
            return st;
        }
    }
    *out = r;
    return DI_OK;
}

void *ucxt_region_base(const ucxt_region *r)
{
    return r->base;
}

uint64_t ucxt_region_bytes(const ucxt_region *r)
{
    return r->bytes;
}

int ucxt_region_allocated(const ucxt_region *r)
{
    return r->own == NULL;
}

di_status ucxt_region_rkey(ucxt_region *r, void **buf, size_t *len, di_error *err)
{
    void *packed = NULL;
    size_t n = 0;
    ucs_status_t s = ucp_rkey_pack(r->ctx->context, r->memh, &packed, &n);
    if (s != UCS_OK)
        return ucs_fail(err, s, "packing the remote key");
    void *copy = malloc(n);
    if (copy)
        memcpy(copy, packed, n);
    ucp_rkey_buffer_release(packed);
    if (!copy)
        return di_fail(err, DI_ENOMEM, "cannot copy the remote key");
    *buf = copy;
    *len = n;
    return DI_OK;
}

ucxt_region *ucxt_region_unmap(ucxt_region *r)
{
    if (!r)
        return NULL;
    ucp_mem_unmap(r->ctx->context, r->memh);
    free(r->own);
    free(r);
    return NULL;
}

/* ---------------------------------------------------------------- peers */

static void peer_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    (void)status;
    ucxt_peer *p = arg;
    atomic_store(&p->failed, 1);
}

static ucs_status_t make_ep(ucxt_peer *p, const void *addr, int peer_mode)
{
    ucp_ep_params_t ep = {0};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = addr;
    ep.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (peer_mode) {
        ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.err_handler.cb = peer_error;
        ep.err_handler.arg = p;
    }
    return ucp_ep_create(p->ctx->worker, &ep, &p->ep);
}

di_status ucxt_peer_connect(ucxt_ctx *c, const void *addr, size_t len, int peer_errors,
                            ucxt_peer **out, di_error *err)
{
    if (!c || !addr || len == 0 || !out)
        return di_fail(err, DI_EINVAL, "ucxt_peer_connect: empty address or NULL argument");
    ucxt_peer *p = calloc(1, sizeof(*p));
    if (!p)
        return di_fail(err, DI_ENOMEM, "cannot allocate a peer record");
    p->ctx = c;
    p->peer_mode = peer_errors ? 1 : 0;
    ucs_status_t s = make_ep(p, addr, p->peer_mode);
    if (s != UCS_OK && p->peer_mode) {
        p->peer_mode = 0;
        s = make_ep(p, addr, 0);
    }
    if (s != UCS_OK) {
        free(p);
        return ucs_fail(err, s, "connecting to the store's UCX worker");
    }
    *out = p;
    return DI_OK;
}

int ucxt_peer_failed(const ucxt_peer *p)
{
    return atomic_load(&p->failed);
}

/* Closes the endpoint: forced in PEER mode (outstanding requests complete as cancelled);
 * otherwise a normal close, waited for at most a second (a dead peer never answers, and the
 * endpoint is then left to the worker's destruction). */
static void close_ep(ucxt_peer *p)
{
    if (!p->ep)
        return;
    ucp_request_param_t rp = {0};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = p->peer_mode ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void *req = ucp_ep_close_nbx(p->ep, &rp);
    p->ep = NULL;
    if (req == NULL || UCS_PTR_IS_ERR(req))
        return;
    uint64_t until = di_mono_ns() + 1000000000ull;
    while (ucp_request_check_status(req) == UCS_INPROGRESS && (p->peer_mode || di_mono_ns() < until))
        ucp_worker_progress(p->ctx->worker);
    if (ucp_request_check_status(req) != UCS_INPROGRESS)
        ucp_request_free(req);
}

ucxt_peer *ucxt_peer_close(ucxt_peer *p)
{
    if (!p)
        return NULL;
    close_ep(p);
    free(p);
    return NULL;
}

di_status ucxt_rkey_unpack(ucxt_peer *p, const void *buf, size_t len, ucxt_rkey **out,
                           di_error *err)
{
    if (!p || !p->ep || !buf || len == 0 || !out)
        return di_fail(err, DI_EINVAL, "ucxt_rkey_unpack: empty key or closed peer");
    ucxt_rkey *k = calloc(1, sizeof(*k));
    if (!k)
        return di_fail(err, DI_ENOMEM, "cannot allocate a key record");
    ucs_status_t s = ucp_ep_rkey_unpack(p->ep, buf, &k->rkey);
    if (s != UCS_OK) {
        free(k);
        return ucs_fail(err, s, "unpacking the store's remote key");
    }
    *out = k;
    return DI_OK;
}

ucxt_rkey *ucxt_rkey_free(ucxt_rkey *k)
{
    if (!k)
        return NULL;
    ucp_rkey_destroy(k->rkey);
    free(k);
    return NULL;
}

di_status ucxt_rkey_ptr(ucxt_rkey *k, uint64_t remote, void **local, di_error *err)
{
    if (!k || !local)
        return di_fail(err, DI_EINVAL, "ucxt_rkey_ptr: NULL argument");
    void *p = NULL;
    ucs_status_t s = ucp_rkey_ptr(k->rkey, remote, &p);
    if (s != UCS_OK)
        return di_fail(err, DI_EUNSUPPORTED, "the remote memory is not mapped here: UCX %s",
                       ucs_status_string(s));
    *local = p;
    return DI_OK;
}

/* ---------------------------------------------------------------- transfers */

/* One operation in flight. */
typedef struct inflight {
    void *req;            /* UCX request; NULL when the slot is free */
    size_t index;         /* which op */
    atomic_int done;      /* set by the completion callback */
    ucs_status_t status;  /* its status */
} inflight;

static void op_done(void *request, ucs_status_t status, void *user_data)
{
    (void)request;
    inflight *f = user_data;
    f->status = status;
    atomic_store(&f->done, 1);
}

/* The batch loop shared by gets and puts. */
typedef struct batch {
    ucxt_peer *p;
    ucxt_rkey *k;
    const ucxt_op *ops;
    size_t n;
    int is_get;
    uint64_t deadline_ns;
    ucxt_done_fn done;
    void *ud;
    ucs_status_t first_error; /* first failure seen */
    int timed_out;            /* the deadline passed and the endpoint was closed */
} batch;

static void finish_op(batch *b, size_t index, ucs_status_t s)
{
    if (s == UCS_OK) {
        if (b->done)
            b->done(b->ud, index);
    } else if (b->first_error == UCS_OK)
        b->first_error = s;
}

/* Starts op i in slot f; returns 1 when it is in flight, 0 when it completed at once. */
static int issue(batch *b, inflight *f, size_t i)
{
    const ucxt_op *op = &b->ops[i];
    ucp_request_param_t rp = {0};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = op_done;
    rp.user_data = f;
    atomic_store(&f->done, 0);
    f->index = i;
    void *req = b->is_get ? ucp_get_nbx(b->p->ep, op->local, op->len, op->remote, b->k->rkey, &rp)
                          : ucp_put_nbx(b->p->ep, op->local, op->len, op->remote, b->k->rkey, &rp);
    if (req == NULL) {
        finish_op(b, i, UCS_OK);
        return 0;
    }
    if (UCS_PTR_IS_ERR(req)) {
        finish_op(b, i, UCS_PTR_STATUS(req));
        return 0;
    }
    f->req = req;
    return 1;
}

/* Collects completed slots; returns how many completed. */
static size_t reap(batch *b, inflight *slots, uint32_t window)
{
    size_t n = 0;
    for (uint32_t s = 0; s < window; s++) {
        inflight *f = &slots[s];
        if (!f->req || !atomic_load(&f->done))
            continue;
        ucp_request_free(f->req);
        f->req = NULL;
        finish_op(b, f->index, f->status);
        n++;
    }
    return n;
}

static void check_deadline(batch *b)
{
    if (b->timed_out || di_mono_ns() < b->deadline_ns)
        return;
    b->timed_out = 1;
    atomic_store(&b->p->failed, 1);
    close_ep(b->p); /* forced: outstanding requests complete as cancelled */
}

static di_status run_batch(batch *b, uint32_t window, di_error *err)
{
    if (window == 0)
        window = 1;
    inflight *slots = calloc(window, sizeof(*slots));
    if (!slots)
        return di_fail(err, DI_ENOMEM, "cannot allocate %u transfer slots", window);
    size_t next = 0, active = 0;
    while (next < b->n || active > 0) {
        for (uint32_t s = 0; s < window && next < b->n; s++) {
            if (slots[s].req || b->first_error != UCS_OK || b->timed_out || !b->p->ep ||
                atomic_load(&b->p->failed))
                continue;
            active += (size_t)issue(b, &slots[s], next++);
        }
        if (next < b->n && (b->first_error != UCS_OK || b->timed_out || !b->p->ep ||
                            atomic_load(&b->p->failed)))
            next = b->n; /* stop issuing; drain what is in flight */
        if (active == 0)
            continue;
        ucp_worker_progress(b->p->ctx->worker);
        active -= reap(b, slots, window);
        if (active > 0)
            check_deadline(b);
    }
    free(slots);
    if (b->timed_out)
        return di_fail(err, DI_ETIMEDOUT, "UCX %s of %zu objects passed its deadline",
                       b->is_get ? "get" : "put", b->n);
    if (b->first_error != UCS_OK)
        return ucs_fail(err, b->first_error, b->is_get ? "UCX get" : "UCX put");
    if (atomic_load(&b->p->failed) || !b->p->ep)
        return di_fail(err, DI_EUNAVAIL, "the store's UCX endpoint failed; reconnect");
    return DI_OK;
}

static di_status check_batch_args(ucxt_peer *p, ucxt_rkey *k, const ucxt_op *ops, size_t n,
                                  di_error *err)
{
    if (!p || !k || (n > 0 && !ops))
        return di_fail(err, DI_EINVAL, "UCX transfer: NULL peer, key or ops");
    if (!p->ep || atomic_load(&p->failed))
        return di_fail(err, DI_EUNAVAIL, "the store's UCX endpoint failed; reconnect");
    return DI_OK;
}

di_status ucxt_get(ucxt_peer *p, ucxt_rkey *k, const ucxt_op *ops, size_t n, uint32_t window,
                   uint64_t deadline_ns, ucxt_done_fn done, void *ud, di_error *err)
{
    di_status st = check_batch_args(p, k, ops, n, err);
    if (st != DI_OK)
        return st;
    batch b = {.p = p, .k = k, .ops = ops, .n = n, .is_get = 1, .deadline_ns = deadline_ns,
               .done = done, .ud = ud, .first_error = UCS_OK};
    return run_batch(&b, window, err);
}

di_status ucxt_put(ucxt_peer *p, ucxt_rkey *k, const ucxt_op *ops, size_t n, uint32_t window,
                   uint64_t deadline_ns, di_error *err)
{
    di_status st = check_batch_args(p, k, ops, n, err);
    if (st != DI_OK)
        return st;
    batch b = {.p = p, .k = k, .ops = ops, .n = n, .is_get = 0, .deadline_ns = deadline_ns,
               .first_error = UCS_OK};
    st = run_batch(&b, window, err);
    if (st != DI_OK)
        return st;
    /* Remote completion: the bytes are in the store's memory once the flush completes. */
    inflight f = {0};
    ucp_request_param_t rp = {0};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = op_done;
    rp.user_data = &f;
    void *req = ucp_ep_flush_nbx(p->ep, &rp);
    if (UCS_PTR_IS_ERR(req))
        return ucs_fail(err, UCS_PTR_STATUS(req), "flushing UCX puts");
    if (req == NULL)
        return DI_OK;
    while (!atomic_load(&f.done)) {
        ucp_worker_progress(p->ctx->worker);
        if (!b.timed_out && di_mono_ns() >= deadline_ns) {
            b.timed_out = 1;
            atomic_store(&p->failed, 1);
            close_ep(p);
        }
    }
    ucp_request_free(req);
    if (b.timed_out)
        return di_fail(err, DI_ETIMEDOUT, "flushing UCX puts passed the deadline");
    if (f.status != UCS_OK)
        return ucs_fail(err, f.status, "flushing UCX puts");
    return DI_OK;
}
