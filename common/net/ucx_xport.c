#include "common/net/ucx_xport.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucp/api/ucp.h>

#include "common/util/clock.h"

/* Active message ids: requests to the store, replies to the client. */
enum { AM_GET = 10, AM_PUT = 11, AM_DATA = 12, AM_ACK = 13 };

/* GET and PUT header. */
typedef struct req_hdr {
    uint64_t cookie;                   /* the client's (batch sequence << 32 | item) */
    uint8_t ticket[UCXT_TICKET_BYTES]; /* from the control call */
} req_hdr;

/* DATA and ACK header. */
typedef struct rep_hdr {
    uint64_t cookie;  /* the request's */
    int32_t status;   /* di_status */
    uint32_t zero;
    uint64_t len;     /* DATA: bytes that follow */
} rep_hdr;

struct client_batch;

struct ucxt_ctx {
    ucp_context_h context;       /* UCP context */
    ucp_worker_h worker;         /* its one worker */
    int threaded;                /* created with UCS_THREAD_MODE_MULTI and wakeup */
    pthread_t progress;          /* progress thread, when started */
    int progress_running;        /* 1 while the thread exists */
    atomic_int stop;             /* asks the progress thread to end */
    ucxt_server_ops ops;         /* the store's checks, once serving */
    atomic_uint_fast64_t refused; /* requests refused */
    atomic_int sending;          /* replies in flight: the progress thread must not sleep (a
                                    full shared-memory queue frees up without an event) */
    struct client_batch *active; /* client: the batch in progress, else NULL */
    uint32_t seq;                /* client: sequence of batches */
};

struct ucxt_peer {
    ucxt_ctx *ctx;          /* owner */
    ucp_ep_h ep;            /* endpoint; NULL once force-closed */
    int peer_mode;          /* created with UCP_ERR_HANDLING_MODE_PEER */
    atomic_int failed;      /* set by the error callback or a deadline */
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

/* The transports of the KV data path, whatever the environment says (see the header). */
static ucs_status_t restrict_transports(ucp_config_t *config, const char *rdma_devices)
{
    int rdma = rdma_devices && rdma_devices[0];
    ucs_status_t s = ucp_config_modify(config, "TLS", rdma ? "posix,self,rc,ud" : "posix,self");
    if (s == UCS_OK)
        s = ucp_config_modify(config, "NET_DEVICES", rdma ? rdma_devices : "");
    /* Eager messages only: no rendezvous, so no remote key or memory registration is ever
     * exchanged in either direction. */
    if (s == UCS_OK)
        s = ucp_config_modify(config, "RNDV_THRESH", "inf");
    /* Endpoint and request ids on the wire go through UCX's checked map, never as pointers a
     * peer could forge. */
    if (s == UCS_OK)
        s = ucp_config_modify(config, "PROTO_INDIRECT_ID", "y");

    if (s == UCS_OK)
        s = ucp_config_modify(config, "WARN_UNUSED_ENV_VARS", "n");
    return s;
}

/* Set once per process, before the first context reads the environment. */
static pthread_once_t fifo_once = PTHREAD_ONCE_INIT;

static void deep_fifo(void)
{
    setenv("UCX_POSIX_FIFO_SIZE", "1024", 0);
}

di_status ucxt_create(int threaded, const char *rdma_devices, ucxt_ctx **out, di_error *err)
{
    if (!out)
        return di_fail(err, DI_EINVAL, "ucxt_create: out is NULL");
    /* A deep shared-memory queue: an object is 14 to 180 eager fragments, and each refill of a
     * full queue waits for the other process to be scheduled. UCX reads transport settings
     * from the environment only (ucp_config_modify does not reach them); an operator's own
     * value wins. */
    pthread_once(&fifo_once, deep_fifo);
    ucp_config_t *config = NULL;
    ucs_status_t s = ucp_config_read(NULL, NULL, &config);
    if (s != UCS_OK)
        return ucs_fail(err, s, "reading the UCX configuration");
    s = restrict_transports(config, rdma_devices);
    if (s != UCS_OK) {
        ucp_config_release(config);
        return ucs_fail(err, s, "restricting UCX's transports");
    }
    ucp_params_t params = {0};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_AM | (threaded ? UCP_FEATURE_WAKEUP : 0);
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

/* Replies stuck behind a full queue get no event when it drains: poll while any is in flight,
 * spinning briefly after progress, then every 200 us (a client that stops reading costs the
 * store a wakeup per poll, not a core). */
static void *progress_main(void *arg)
{
    ucxt_ctx *c = arg;
    unsigned idle = 0;
    while (!atomic_load(&c->stop)) {
        unsigned n = 0;
        while (ucp_worker_progress(c->worker) != 0)
            n++;
        idle = n ? 0 : idle + 1;
        if (atomic_load(&c->stop))
            break;
        if (atomic_load(&c->sending) > 0) {
            if (idle < 2000)
                sched_yield();
            else
                nanosleep(&(struct timespec){.tv_sec = 0, .tv_nsec = 200000}, NULL);
            continue;
        }
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


/* ---------------------------------------------------------------- serving */

/* One reply of the store in flight: its header lives here until the send completes. */
typedef struct srv_op {
    ucxt_ctx *c;
    rep_hdr h;        /* the reply header */
    void *token;      /* the grant's */
    int granted;      /* PUT: 1 while an end call is owed */
    int is_get;       /* GET or PUT */
    void *bounce;     /* GET: the object's bytes, copied out of the slot */
    int queued;       /* counted in sending */
    ucp_ep_h reply_ep; /* PUT: where the ACK goes */
} srv_op;

static void srv_finish(srv_op *op, ucs_status_t s)
{
    ucxt_ctx *c = op->c;
    if (op->queued)
        atomic_fetch_sub(&c->sending, 1);
    (void)s;
    free(op->bounce);
    free(op);
}

static void srv_sent(void *request, ucs_status_t s, void *user_data)
{
    (void)request;
    srv_finish(user_data, s);
}

/* Sends a DATA or ACK reply; op (malloc'd) is freed once it completed. */
static void srv_reply(srv_op *op, ucp_ep_h ep, unsigned am_id, const void *data, size_t len)
{
    ucp_request_param_t rp = {0};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = srv_sent;
    rp.user_data = op;
    void *req = ucp_am_send_nbx(ep, am_id, &op->h, sizeof(op->h), data, len, &rp);
    if (req == NULL)
        srv_finish(op, UCS_OK);
    else if (UCS_PTR_IS_ERR(req))
        srv_finish(op, UCS_PTR_STATUS(req));
    else {
        op->queued = 1;
        atomic_fetch_add(&op->c->sending, 1);
        ucp_request_free(req); /* completes (and calls srv_sent) later */
    }
}

static srv_op *srv_op_new(ucxt_ctx *c, const void *header, int is_get)
{
    srv_op *op = calloc(1, sizeof(*op));
    if (!op)
        return NULL;
    req_hdr h;
    memcpy(&h, header, sizeof(h));
    op->c = c;
    op->h.cookie = h.cookie;
    op->is_get = is_get;
    return op;
}

static int well_formed(size_t header_len, const ucp_am_recv_param_t *param)
{
    return header_len == sizeof(req_hdr) && (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) &&
           param->reply_ep != NULL;
}

static ucs_status_t on_get(void *arg, const void *header, size_t header_len, void *data,
                           size_t len, const ucp_am_recv_param_t *param)
{
    (void)data;
    ucxt_ctx *c = arg;
    srv_op *op = NULL;
    if (!well_formed(header_len, param) || len != 0 || !(op = srv_op_new(c, header, 1))) {
        atomic_fetch_add(&c->refused, 1);
        return UCS_OK; /* dropped; a request with data is not a GET */
    }
    req_hdr h;
    memcpy(&h, header, sizeof(h));
    ucxt_grant g = {0};
    di_status st = c->ops.get_begin(c->ops.ud, (const ucxt_ticket *)h.ticket, &g);
    op->h.status = st;
    if (st != DI_OK) {
        atomic_fetch_add(&c->refused, 1);
        srv_reply(op, param->reply_ep, AM_DATA, NULL, 0);
        return UCS_OK;
    }
    /* The bytes are copied out of the slot while the ticket holds it, and sent from the copy:
     * a client that stops reading its queue must not receive, later, whatever the slot holds
     * after its lease ended and the slot was reused. */
    op->bounce = malloc(g.len ? g.len : 1);
    if (op->bounce)
        memcpy(op->bounce, g.addr, g.len);
    c->ops.get_end(c->ops.ud, g.token, op->bounce ? DI_OK : DI_ENOMEM);
    op->h.status = op->bounce ? DI_OK : DI_ENOMEM;
    op->h.len = op->bounce ? g.len : 0;
    srv_reply(op, param->reply_ep, AM_DATA, op->bounce, op->h.len);
    return UCS_OK;
}

/* A PUT's bytes have landed (or failed): end the grant and acknowledge. */
static void put_landed(srv_op *op, ucs_status_t s, size_t got, uint64_t want)
{
    ucxt_ctx *c = op->c;
    di_status st = s == UCS_OK && got == want ? DI_OK : DI_EIO;
    c->ops.put_end(c->ops.ud, op->token, st);
    op->granted = 0;
    op->h.status = st;
    srv_reply(op, op->reply_ep, AM_ACK, NULL, 0);
}

static ucs_status_t on_put(void *arg, const void *header, size_t header_len, void *data,
                           size_t len, const ucp_am_recv_param_t *param)
{
    ucxt_ctx *c = arg;
    srv_op *op = NULL;
    /* Rendezvous (a peer that forces it) would exchange memory keys: never accepted. */
    if (!well_formed(header_len, param) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
        !(op = srv_op_new(c, header, 0))) {
        atomic_fetch_add(&c->refused, 1);
        return UCS_OK;
    }
    req_hdr h;
    memcpy(&h, header, sizeof(h));
    op->reply_ep = param->reply_ep;
    ucxt_grant g = {0};
    di_status st = c->ops.put_begin(c->ops.ud, (const ucxt_ticket *)h.ticket, len, &g);
    if (st == DI_OK && g.len != len) {
        c->ops.put_end(c->ops.ud, g.token, DI_EINVAL);
        st = DI_EINVAL;
    }
    if (st != DI_OK) {
        atomic_fetch_add(&c->refused, 1);
        op->h.status = st;
        srv_reply(op, op->reply_ep, AM_ACK, NULL, 0);
        return UCS_OK; /* the bytes (eager or rendezvous) are dropped */
    }
    op->granted = 1;
    op->token = g.token;
    op->h.len = len;
    memcpy(g.addr, data, len);
    put_landed(op, UCS_OK, len, len);
    return UCS_OK;
}

static di_status set_handler(ucxt_ctx *c, unsigned id, ucp_am_recv_callback_t cb, di_error *err)
{
    ucp_am_handler_param_t hp = {0};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = id;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = cb;
    hp.arg = c;
    ucs_status_t s = ucp_worker_set_am_recv_handler(c->worker, &hp);
    return s == UCS_OK ? DI_OK : ucs_fail(err, s, "registering a UCX message handler");
}

di_status ucxt_serve(ucxt_ctx *c, const ucxt_server_ops *ops, di_error *err)
{
    if (!c || !ops || !ops->get_begin || !ops->get_end || !ops->put_begin || !ops->put_end)
        return di_fail(err, DI_EINVAL, "ucxt_serve: NULL context or handler");
    if (c->progress_running)
        return di_fail(err, DI_ESTATE, "ucxt_serve: call it before the progress thread starts");
    c->ops = *ops;
    di_status st = set_handler(c, AM_GET, on_get, err);
    return st == DI_OK ? set_handler(c, AM_PUT, on_put, err) : st;
}

uint64_t ucxt_refused(const ucxt_ctx *c)
{
    return c ? atomic_load(&((ucxt_ctx *)c)->refused) : 0;
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
 * endpoint is then left to the worker's destruction, its request released). */
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
    ucp_request_free(req); /* a close still in flight is released when it ends, or with the
                            * worker */
}

ucxt_peer *ucxt_peer_close(ucxt_peer *p)
{
    if (!p)
        return NULL;
    close_ep(p);
    free(p);
    return NULL;
}


/* ---------------------------------------------------------------- client */

enum { X_IDLE, X_ASKED, X_DONE };

/* The batch a client's worker is running; its replies find it through ctx->active. */
typedef struct client_batch {
    ucxt_ctx *c;
    ucxt_xfer *x;
    size_t n;
    int is_put;
    uint32_t seq;
    uint8_t *state;          /* X_* per item */
    req_hdr *hdrs;           /* request headers (alive until the batch returns) */
    size_t *completed;       /* indices in completion order */
    size_t n_completed;
    size_t in_flight;        /* asked, not yet complete */
    const void *raw_hdr;     /* raw request: header to send instead */
    size_t raw_hdr_len;
} client_batch;

static void complete_item(client_batch *b, size_t i, di_status st)
{
    if (b->state[i] == X_ASKED)
        b->in_flight--;
    b->x[i].status = st;
    b->state[i] = X_DONE;
    b->completed[b->n_completed++] = i;
}

/* The item a reply names, or NULL for a stale or foreign reply. */
static client_batch *reply_batch(ucxt_ctx *c, const void *header, size_t header_len, int is_put,
                                 rep_hdr *h, size_t *index)
{
    client_batch *b = c->active;
    if (!b || header_len != sizeof(*h) || b->is_put != is_put)
        return NULL;
    memcpy(h, header, sizeof(*h));
    size_t i = (size_t)(h->cookie & 0xffffffffu);
    if ((uint32_t)(h->cookie >> 32) != b->seq || i >= b->n || b->state[i] != X_ASKED)
        return NULL;
    *index = i;
    return b;
}

static ucs_status_t on_data(void *arg, const void *header, size_t header_len, void *data,
                            size_t len, const ucp_am_recv_param_t *param)
{
    rep_hdr h;
    size_t i = 0;
    client_batch *b = reply_batch(arg, header, header_len, 0, &h, &i);
    if (!b)
        return UCS_OK;
    ucxt_xfer *x = &b->x[i];
    if (h.status != DI_OK || len != h.len || len > x->len) {
        complete_item(b, i, h.status != DI_OK ? (di_status)h.status : len > x->len ? DI_ERANGE : DI_EPROTO);
        x->got = len;
        return UCS_OK;
    }
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) { /* never sent by the store */
        complete_item(b, i, DI_EPROTO);
        return UCS_OK;
    }
    memcpy(x->buf, data, len);
    x->got = len;
    complete_item(b, i, DI_OK);
    return UCS_OK;
}

static ucs_status_t on_ack(void *arg, const void *header, size_t header_len, void *data,
                           size_t len, const ucp_am_recv_param_t *param)
{
    (void)data;
    (void)len;
    (void)param;
    rep_hdr h;
    size_t i = 0;
    client_batch *b = reply_batch(arg, header, header_len, 1, &h, &i);
    if (b)
        complete_item(b, i, (di_status)h.status);
    return UCS_OK;
}

/* Registers the client's reply handlers once per context. */
static di_status client_handlers(ucxt_ctx *c, di_error *err)
{
    if (c->seq != 0)
        return DI_OK;
    di_status st = set_handler(c, AM_DATA, on_data, err);
    if (st == DI_OK)
        st = set_handler(c, AM_ACK, on_ack, err);
    if (st == DI_OK)
        c->seq = 1;
    return st;
}

/* Sends item i's request (GET header only, PUT header and bytes). The request needs no
 * completion of its own: the reply completes the item. */
static void ask(client_batch *b, ucxt_peer *p, size_t i)
{
    ucxt_xfer *x = &b->x[i];
    req_hdr *h = &b->hdrs[i];
    h->cookie = (uint64_t)b->seq << 32 | (uint64_t)i;
    memcpy(h->ticket, x->ticket.b, sizeof(h->ticket));
    const void *hdr = h;
    size_t hlen = sizeof(*h);
    if (b->raw_hdr) {
        hdr = b->raw_hdr;
        hlen = b->raw_hdr_len;
    }
    ucp_request_param_t rp = {0};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_REPLY;
    void *req = ucp_am_send_nbx(p->ep, b->is_put ? AM_PUT : AM_GET, hdr, hlen,
                                b->is_put ? x->buf : NULL, b->is_put ? x->len : 0, &rp);
    if (UCS_PTR_IS_ERR(req)) {
        complete_item(b, i, DI_EIO);
        return;
    }
    if (req)
        ucp_request_free(req);
    b->state[i] = X_ASKED;
    b->in_flight++;
}

static di_status run_client(client_batch *b, ucxt_peer *p, uint32_t window, uint64_t deadline_ns,
                            ucxt_done_fn done, void *ud, di_error *err)
{
    ucxt_ctx *c = p->ctx;
    if (window == 0)
        window = 1;
    size_t next = 0, reported = 0;
    int timed_out = 0;
    c->active = b;
    while (reported < b->n) {
        while (!timed_out && next < b->n && b->in_flight < window && p->ep &&
               !atomic_load(&p->failed))
            ask(b, p, next++);
        if (reported < b->n_completed) {
            for (; reported < b->n_completed; reported++) {
                size_t i = b->completed[reported];
                if (b->x[i].status == DI_OK && done)
                    done(ud, i);
            }
            continue;
        }
        if (timed_out || !p->ep || atomic_load(&p->failed))
            break; /* nothing more will arrive */
        ucp_worker_progress(c->worker);
        if (!timed_out && di_mono_ns() >= deadline_ns) {
            timed_out = 1;
            atomic_store(&p->failed, 1);
            close_ep(p);
        }
    }
    c->active = NULL;
    if (timed_out)
        return di_fail(err, DI_ETIMEDOUT, "UCX %s of %zu objects passed its deadline",
                       b->is_put ? "put" : "get", b->n);
    if (reported < b->n)
        return di_fail(err, DI_EUNAVAIL, "the store's UCX endpoint failed; reconnect");
    return DI_OK;
}

static di_status run_items(ucxt_peer *p, ucxt_xfer *x, size_t n, int is_put, uint32_t window,
                           uint64_t deadline_ns, ucxt_done_fn done, void *ud, const void *raw_hdr,
                           size_t raw_hdr_len, di_error *err)
{
    if (!p || (n > 0 && !x))
        return di_fail(err, DI_EINVAL, "UCX transfer: NULL peer or items");
    if (!p->ep || atomic_load(&p->failed))
        return di_fail(err, DI_EUNAVAIL, "the store's UCX endpoint failed; reconnect");
    if (n > 0xffffffffu)
        return di_fail(err, DI_EINVAL, "UCX transfer: %zu objects in one batch", n);
    di_status st = client_handlers(p->ctx, err);
    if (st != DI_OK || n == 0)
        return st;
    client_batch b = {.c = p->ctx, .x = x, .n = n, .is_put = is_put, .seq = ++p->ctx->seq,
                      .raw_hdr = raw_hdr, .raw_hdr_len = raw_hdr_len};
    if (b.seq == 0)
        b.seq = p->ctx->seq = 1;
    b.state = calloc(n, 1);
    b.hdrs = calloc(n, sizeof(*b.hdrs));
    b.completed = calloc(n, sizeof(*b.completed));
    if (!b.state || !b.hdrs || !b.completed)
        st = di_fail(err, DI_ENOMEM, "cannot allocate a UCX batch of %zu", n);
    for (size_t i = 0; st == DI_OK && i < n; i++) {
        x[i].status = DI_EINTERNAL;
        x[i].got = 0;
    }
    if (st == DI_OK)
        st = run_client(&b, p, window, deadline_ns, done, ud, err);
    free(b.state);
    free(b.hdrs);
    free(b.completed);
    return st;
}

di_status ucxt_fetch(ucxt_peer *p, ucxt_xfer *x, size_t n, uint32_t window, uint64_t deadline_ns,
                     ucxt_done_fn done, void *ud, di_error *err)
{
    return run_items(p, x, n, 0, window, deadline_ns, done, ud, NULL, 0, err);
}

di_status ucxt_send(ucxt_peer *p, ucxt_xfer *x, size_t n, uint32_t window, uint64_t deadline_ns,
                    di_error *err)
{
    return run_items(p, x, n, 1, window, deadline_ns, NULL, NULL, NULL, 0, err);
}

di_status ucxt_raw_request(ucxt_peer *p, int is_put, const void *header, size_t header_len,
                           const void *data, size_t len, void *buf, uint64_t cap,
                           di_status *status, uint64_t *got, uint64_t deadline_ns, di_error *err)
{
    ucxt_xfer x = {.buf = is_put ? (void *)data : buf, .len = is_put ? len : cap};
    /* A header of the right size keeps the cookie the reply is matched by. */
    req_hdr h;
    int proper = header && header_len == sizeof(h);
    if (proper)
        memcpy(x.ticket.b, ((const req_hdr *)header)->ticket, sizeof(x.ticket.b));
    di_status st = run_items(p, &x, 1, is_put, 1, deadline_ns, NULL, NULL,
                             proper ? NULL : (header ? header : (const void *)""),
                             proper ? 0 : header_len, err);
    if (status)
        *status = x.status;
    if (got)
        *got = x.got;
    return st;
}
