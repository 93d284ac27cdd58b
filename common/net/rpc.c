#include "common/net/rpc.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/clock.h"

#define STATUS_KEY "di-status"
#define AUTH_KEY "authorization"
#define BEARER "Bearer "

/* ================================================================== shared */

di_status rpc_status_from_grpc(int code)
{
    switch (code) {
    case GRPC_STATUS_OK:
        return DI_OK;
    case GRPC_STATUS_CANCELLED:
        return DI_ECANCELED;
    case GRPC_STATUS_INVALID_ARGUMENT:
        return DI_EINVAL;
    case GRPC_STATUS_DEADLINE_EXCEEDED:
        return DI_ETIMEDOUT;
    case GRPC_STATUS_NOT_FOUND:
        return DI_ENOENT;
    case GRPC_STATUS_ALREADY_EXISTS:
        return DI_EEXIST;
    case GRPC_STATUS_PERMISSION_DENIED:
        return DI_EPERM;
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
        return DI_EFULL;
    case GRPC_STATUS_FAILED_PRECONDITION:
        return DI_ESTATE;
    case GRPC_STATUS_OUT_OF_RANGE:
        return DI_ERANGE;
    case GRPC_STATUS_UNIMPLEMENTED:
        return DI_EUNSUPPORTED;
    case GRPC_STATUS_INTERNAL:
        return DI_EINTERNAL;
    case GRPC_STATUS_UNAVAILABLE:
        return DI_EUNAVAIL;
    case GRPC_STATUS_DATA_LOSS:
        return DI_ECORRUPT;
    case GRPC_STATUS_UNAUTHENTICATED:
        return DI_EAUTH;
    default:
        return DI_EIO;
    }
}

/* di_status from its name ("ENOSPC"); DI_OK when unknown. */
static di_status status_by_name(const char *s, size_t n)
{
    for (int v = -1; v >= -64; v--) {
        const char *name = di_status_name((di_status)v);
        if (strcmp(name, "EUNKNOWN") != 0 && strlen(name) == n && memcmp(name, s, n) == 0)
            return (di_status)v;
    }
    return DI_OK;
}

static int slice_is(grpc_slice s, const char *str)
{
    size_t n = strlen(str);
    return GRPC_SLICE_LENGTH(s) == n && memcmp(GRPC_SLICE_START_PTR(s), str, n) == 0;
}

/* Copies a byte buffer into one malloc'd array. */
static di_status buffer_to_bytes(grpc_byte_buffer *bb, uint8_t **out, size_t *len, size_t max,
                                 di_error *err)
{
    *out = NULL;
    *len = 0;
    if (!bb)
        return DI_OK;
    size_t n = grpc_byte_buffer_length(bb);
    if (n > max)
        return di_fail(err, DI_EFULL, "message of %zu bytes exceeds the limit of %zu", n, max);
    if (n == 0)
        return DI_OK;
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, bb))
        return di_fail(err, DI_EPROTO, "cannot read a message (bad compression?)");
    /* Slice by slice into one array: a single copy of the message. */
    uint8_t *p = malloc(n);
    size_t at = 0;
    grpc_slice s;
    while (grpc_byte_buffer_reader_next(&rd, &s)) {
        size_t k = GRPC_SLICE_LENGTH(s);
        if (p && at + k <= n)
            memcpy(p + at, GRPC_SLICE_START_PTR(s), k);
        at += k;
        grpc_slice_unref(s);
    }
    grpc_byte_buffer_reader_destroy(&rd);
    if (p && at != n) {
        free(p);
        return di_fail(err, DI_EPROTO, "a message of %zu bytes read as %zu", n, at);
    }
    if (!p)
        return di_fail(err, DI_ENOMEM, "cannot allocate a %zu-byte message", n);
    *out = p;
    *len = n;
    return DI_OK;
}

/* A byte buffer that takes ownership of malloc'd bytes. */
static grpc_byte_buffer *bytes_to_buffer(uint8_t *data, size_t len)
{
    grpc_slice s = data ? grpc_slice_new(data, len, free) : grpc_empty_slice();
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

di_status rpc_load_file(const char *path, char **out, di_error *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return di_fail(err, DI_ENOENT, "cannot open %s", path);
    char *buf = malloc((1 << 20) + 1);
    if (!buf) {
        fclose(f);
        return di_fail(err, DI_ENOMEM, "cannot allocate a buffer for %s", path);
    }
    size_t n = fread(buf, 1, (1 << 20) + 1, f);
    int bad = ferror(f);
    fclose(f);
    if (bad || n > (1 << 20)) {
        free(buf);
        return di_fail(err, bad ? DI_EIO : DI_ERANGE, "%s: %s", path,
                       bad ? "read error" : "larger than 1 MiB");
    }
    buf[n] = '\0';
    *out = buf;
    return DI_OK;
}

/* gRPC is initialised once per process and never shut down. Each server and client still takes
 * and releases its own reference, but the first one taken stays: the release that brings the
 * count to zero runs grpc_shutdown, which joins gRPC's executor threads, and after a write that
 * filled a socket's send buffer (a reply or request of several MB) one of them is a backup
 * poller that waits up to 10 s for an event that no longer comes. A store that had sent a
 * 10 MB Get reply took that long to stop and missed its drain deadline. */
static pthread_once_t grpc_once = PTHREAD_ONCE_INIT;

static void grpc_hold(void)
{
    grpc_init();
}

/* Takes a gRPC reference (paired with grpc_shutdown). */
static void grpc_ref(void)
{
    pthread_once(&grpc_once, grpc_hold);
    grpc_init();
}

/* ================================================================== server */

/* What a completion-queue tag points at: a call slot or one batch of an asynchronous call. */
typedef enum tag_kind {
    TAG_SLOT = 1,   /* call_ctx: a new call arrived, or its reply batch completed */
    TAG_SEND = 2,   /* rpc_call: one stream message went out (or failed) */
    TAG_CLOSE = 3,  /* rpc_call: RECV_CLOSE_ON_SERVER: the call is over, cancelled or not */
    TAG_STATUS = 4, /* rpc_call: the final status batch completed */
} tag_kind;

typedef struct rpc_tag {
    tag_kind kind;
    struct rpc_call *call; /* NULL for TAG_SLOT */
} rpc_tag;

/* One call slot: requested from gRPC, then handled, then its reply sent. */
typedef struct call_ctx {
    rpc_tag tag;               /* first member: the slot's completion tag */
    struct rpc_server *srv;    /* owner */
    size_t method;             /* row of the method table */
    int sending;               /* 0: waiting for a call; 1: reply batch in flight */
    grpc_call *call;           /* the call, once it arrived */
    gpr_timespec deadline;     /* the client's deadline */
    grpc_metadata_array md;    /* the client's initial metadata */
    grpc_byte_buffer *payload; /* request message */
    grpc_byte_buffer *reply;   /* reply message (sent) */
    grpc_slice details;        /* status message (kept until the batch completes) */
    grpc_metadata trailer;     /* "di-status" */
    int cancelled;             /* RECV_CLOSE_ON_SERVER result */
    int unknown;               /* a call to a method not in the table */
    grpc_call_details details_in; /* unknown calls: the method name */
} call_ctx;

struct rpc_server {
    struct method_row *methods; /* both tables, synchronous rows first */
    size_t n_methods;
    void *svc;                 /* handed to handlers */
    char *engine_token;        /* copies; NULL when not configured */
    char *admin_token;
    rpc_error_fn on_error;
    void *on_error_ud;
    grpc_server *server;
    grpc_completion_queue *cq;
    void **handles;            /* registered method handles */
    pthread_t *threads;
    unsigned n_threads;
    atomic_int stopping;       /* no new call slots once set */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int shutdown_seen;         /* the shutdown tag came back */
    unsigned running;          /* calls being handled (until their reply batch started) */
    unsigned sending;          /* reply batches started and not yet completed */
    char shutdown_tag;         /* its address is the tag */
    struct rpc_call *live;     /* asynchronous calls not yet freed (guarded by mu) */
    unsigned n_live;           /* their number */
    pthread_cond_t timer_cv;   /* wakes the deadline thread (CLOCK_MONOTONIC) */
    pthread_t timer;           /* the deadline thread */
    int timer_started;
    int timer_stop;            /* set under mu to end the deadline thread */
};

/* A method of either table, as the server keeps it. */
typedef struct method_row {
    rpc_method m;        /* name, limits and role (handler NULL for asynchronous rows) */
    rpc_start_fn start;  /* asynchronous rows */
    int streaming;       /* 1: server stream */
} method_row;

/* A message waiting to go out on a stream. */
typedef struct msg_node {
    grpc_byte_buffer *bb;
    struct msg_node *next;
} msg_node;

/* An asynchronous call (rpc.h has its state diagram). Fields below `mu` are guarded by it. */
struct rpc_call {
    struct rpc_server *srv;     /* owner */
    grpc_call *call;            /* the gRPC call (one reference, dropped at free) */
    const rpc_method *m;        /* its table row */
    int streaming;              /* 1: server stream */
    uint64_t deadline_ns;       /* di_mono_ns() time at which the server cancels it */
    rpc_tag send_tag, close_tag, status_tag;
    pthread_mutex_t mu;
    unsigned refs;              /* handler (until finish) + each batch in flight */
    int finished;               /* rpc_call_finish was called */
    int cancelled;              /* a cancel was seen; nothing more is sent */
    di_status cancel_why;       /* DI_ECANCELED, DI_ETIMEDOUT or DI_EUNAVAIL (server stop) */
    int cancel_ran;             /* the cancel function was claimed to run */
    int cancel_running;         /* it is running now, on cancel_thread */
    pthread_t cancel_thread;
    pthread_cond_t cv;          /* signalled when cancel_running drops */
    void (*on_cancel)(void *, di_status);
    void *cancel_ud;
    int md_sent;                /* initial metadata went out with the first batch */
    int send_busy;              /* a message batch is in flight (gRPC allows one) */
    int status_started;         /* the status batch was started */
    msg_node *head, *tail;      /* queued messages */
    unsigned queued;            /* their number */
    grpc_byte_buffer *in_flight; /* the message being sent */
    di_status final_st;         /* what finish asked for */
    grpc_byte_buffer *final_reply; /* unary reply message (DI_OK only) */
    grpc_slice details;         /* status text */
    grpc_metadata trailer;      /* "di-status" */
    int close_cancelled;        /* RECV_CLOSE_ON_SERVER result */
    struct rpc_call *prev, *next; /* the server's live list (guarded by srv->mu) */
};

static void free_ctx(call_ctx *c)
{
    if (c->unknown)
        grpc_call_details_destroy(&c->details_in);
    if (c->call)
        grpc_call_unref(c->call);
    grpc_metadata_array_destroy(&c->md);
    if (c->payload)
        grpc_byte_buffer_destroy(c->payload);
    if (c->reply)
        grpc_byte_buffer_destroy(c->reply);
    grpc_slice_unref(c->details);
    grpc_slice_unref(c->trailer.value);
    free(c);
}

static void request_call(struct rpc_server *s, size_t m)
{
    if (atomic_load(&s->stopping))
        return;
    call_ctx *c = calloc(1, sizeof(*c));
    if (!c)
        return; /* one fewer slot for this method; the others still serve it */
    c->tag.kind = TAG_SLOT;
    c->srv = s;
    c->method = m;
    c->details = grpc_empty_slice();
    c->trailer.value = grpc_empty_slice();
    grpc_metadata_array_init(&c->md);
    if (grpc_server_request_registered_call(s->server, s->handles[m], &c->call, &c->deadline,
                                            &c->md, &c->payload, s->cq, s->cq, c) != GRPC_CALL_OK)
        free_ctx(c);
}

/* A slot for calls to methods outside the table, answered UNIMPLEMENTED. */
static void request_unknown(struct rpc_server *s)
{
    if (atomic_load(&s->stopping))
        return;
    call_ctx *c = calloc(1, sizeof(*c));
    if (!c)
        return;
    c->tag.kind = TAG_SLOT;
    c->srv = s;
    c->unknown = 1;
    c->details = grpc_empty_slice();
    c->trailer.value = grpc_empty_slice();
    grpc_metadata_array_init(&c->md);
    grpc_call_details_init(&c->details_in);
    if (grpc_server_request_call(s->server, &c->call, &c->details_in, &c->md, s->cq, s->cq, c) !=
        GRPC_CALL_OK)
        free_ctx(c);
}

/* Constant-time comparison of a presented token with a configured one. */
static int token_equal(const char *want, const uint8_t *got, size_t n)
{
    size_t w = strlen(want);
    unsigned diff = (unsigned)(w ^ n);
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned)(got[i] ^ (uint8_t)want[i < w ? i : 0]);
    return diff == 0;
}

static rpc_role caller_role(const struct rpc_server *s, const grpc_metadata_array *md)
{
    if (!s->engine_token && !s->admin_token)
        return RPC_ROLE_ADMIN; /* auth disabled */
    for (size_t i = 0; i < md->count; i++) {
        if (!slice_is(md->metadata[i].key, AUTH_KEY))
            continue;
        grpc_slice v = md->metadata[i].value;
        size_t n = GRPC_SLICE_LENGTH(v), b = strlen(BEARER);
        const uint8_t *p = GRPC_SLICE_START_PTR(v);
        if (n <= b || memcmp(p, BEARER, b) != 0)
            return RPC_ROLE_NONE;
        if (s->admin_token && token_equal(s->admin_token, p + b, n - b))
            return RPC_ROLE_ADMIN;
        if (s->engine_token && token_equal(s->engine_token, p + b, n - b))
            return RPC_ROLE_ENGINE;
        return RPC_ROLE_NONE;
    }
    return RPC_ROLE_NONE;
}

static di_status check_role(const struct rpc_server *s, const rpc_method *m, rpc_role role,
                            di_error *err)
{
    if (m->role == RPC_ROLE_ADMIN) {
        if (role == RPC_ROLE_ADMIN)
            return DI_OK;
        if (role == RPC_ROLE_ENGINE || !s->admin_token)
            return di_fail(err, DI_EPERM, "%s needs the admin token%s", m->name,
                           s->admin_token ? "" : " (the store has none configured)");
        return di_fail(err, DI_EAUTH, "%s: missing or wrong admin token", m->name);
    }
    if (role >= RPC_ROLE_ENGINE || !s->engine_token)
        return DI_OK;
    return di_fail(err, DI_EAUTH, "%s: missing or wrong token", m->name);
}

/* Milliseconds left before the client's deadline (INT64_MAX when none). */
static int64_t ms_left(gpr_timespec deadline)
{
    if (gpr_time_cmp(deadline, gpr_inf_future(deadline.clock_type)) == 0)
        return INT64_MAX;
    gpr_timespec d = gpr_convert_clock_type(deadline, GPR_CLOCK_MONOTONIC);
    gpr_timespec left = gpr_time_sub(d, gpr_now(GPR_CLOCK_MONOTONIC));
    return (int64_t)left.tv_sec * 1000 + left.tv_nsec / 1000000;
}

/* ------------------------------------------------------- asynchronous calls */

static void free_msgs(struct rpc_call *c)
{
    while (c->head) {
        msg_node *n = c->head;
        c->head = n->next;
        grpc_byte_buffer_destroy(n->bb);
        free(n);
    }
    c->tail = NULL;
    c->queued = 0;
}

static void call_free(struct rpc_call *c)
{
    struct rpc_server *s = c->srv;
    pthread_mutex_lock(&s->mu);
    if (c->prev)
        c->prev->next = c->next;
    else
        s->live = c->next;
    if (c->next)
        c->next->prev = c->prev;
    s->n_live--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    free_msgs(c);
    if (c->in_flight)
        grpc_byte_buffer_destroy(c->in_flight);
    if (c->final_reply)
        grpc_byte_buffer_destroy(c->final_reply);
    grpc_slice_unref(c->details);
    grpc_slice_unref(c->trailer.value);
    grpc_call_unref(c->call);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
}

static void call_unref(struct rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    assert(c->refs > 0);
    unsigned left = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (left == 0)
        call_free(c);
}

/* Records a cancel (mu held). Returns 1 when the caller must run the cancel function (after
 * unlocking, holding a reference). */
static int mark_cancelled(struct rpc_call *c, di_status why)
{
    if (c->cancelled)
        return 0;
    c->cancelled = 1;
    c->cancel_why = why;
    free_msgs(c);
    if (!c->on_cancel || c->cancel_ran || c->finished)
        return 0;
    c->cancel_ran = 1;
    c->cancel_running = 1;
    c->cancel_thread = pthread_self();
    return 1;
}

/* Starts the next batch if none is in flight (mu held): the next queued message, else the
 * status once the handler finished. Initial metadata rides on the first batch. */
static void pump(struct rpc_call *c)
{
    if (c->send_busy || c->status_started || c->cancelled)
        return;
    grpc_op ops[3];
    memset(ops, 0, sizeof(ops));
    size_t n = 0;
    if (!c->md_sent)
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (c->head) {
        msg_node *node = c->head;
        c->head = node->next;
        if (!c->head)
            c->tail = NULL;
        c->queued--;
        c->in_flight = node->bb;
        free(node);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = c->in_flight;
        c->send_busy = 1;
        c->md_sent = 1;
        c->refs++;
        if (grpc_call_start_batch(c->call, ops, n, &c->send_tag, NULL) != GRPC_CALL_OK) {
            c->send_busy = 0;
            c->refs--;
            grpc_byte_buffer_destroy(c->in_flight);
            c->in_flight = NULL;
        }
        return;
    }
    if (!c->finished)
        return;
    if (c->final_reply) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = c->final_reply;
    }
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)di_status_grpc(c->final_st);
    ops[n].data.send_status_from_server.status_details = &c->details;
    ops[n].data.send_status_from_server.trailing_metadata_count = c->final_st == DI_OK ? 0 : 1;
    ops[n++].data.send_status_from_server.trailing_metadata = &c->trailer;
    c->status_started = 1;
    c->md_sent = 1;
    c->refs++;
    if (grpc_call_start_batch(c->call, ops, n, &c->status_tag, NULL) != GRPC_CALL_OK)
        c->refs--;
}

/* Runs the claimed cancel function (no lock held; a reference held by the caller). */
static void run_cancel(struct rpc_call *c)
{
    c->on_cancel(c->cancel_ud, c->cancel_why);
    pthread_mutex_lock(&c->mu);
    c->cancel_running = 0;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* A completion of one of the call's batches, on a worker thread. */
static void async_event(rpc_tag *t, int success)
{
    struct rpc_call *c = t->call;
    int run = 0;
    pthread_mutex_lock(&c->mu);
    switch (t->kind) {
    case TAG_SEND:
        c->send_busy = 0;
        grpc_byte_buffer_destroy(c->in_flight);
        c->in_flight = NULL;
        if (success)
            pump(c);
        break;
    case TAG_CLOSE:
        /* The call is over. Cancelled: by the client, its connection, the server's deadline
         * (already marked) or the server stopping. */
        if (c->close_cancelled || !success)
            run = mark_cancelled(c, atomic_load(&c->srv->stopping) ? DI_EUNAVAIL : DI_ECANCELED);
        break;
    default: /* TAG_STATUS */
        break;
    }
    pthread_mutex_unlock(&c->mu);
    if (run)
        run_cancel(c);
    call_unref(c);
}

void rpc_call_on_cancel(rpc_call *c, void (*fn)(void *ud, di_status why), void *ud)
{
    pthread_mutex_lock(&c->mu);
    assert(!c->finished && !c->on_cancel);
    c->on_cancel = fn;
    c->cancel_ud = ud;
    int run = c->cancelled && fn && !c->cancel_ran;
    if (run) {
        c->cancel_ran = 1;
        c->cancel_running = 1;
        c->cancel_thread = pthread_self();
    }
    pthread_mutex_unlock(&c->mu);
    if (run)
        run_cancel(c); /* the handler's reference keeps c alive */
}

int rpc_call_cancelled(rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    int v = c->cancelled;
    pthread_mutex_unlock(&c->mu);
    return v;
}

uint64_t rpc_call_deadline_ns(const rpc_call *c)
{
    return c->deadline_ns;
}

di_status rpc_call_write(rpc_call *c, const void *msg, size_t len, di_error *err)
{
    if (!c->streaming)
        return di_fail(err, DI_ESTATE, "%s is not a streaming method", c->m->name);
    if (len > (size_t)INT32_MAX || (len > 0 && !msg))
        return di_fail(err, len > 0 && !msg ? DI_EINVAL : DI_ERANGE,
                       "%s: a stream message of %zu bytes", c->m->name, len);
    msg_node *node = malloc(sizeof(*node));
    uint8_t *copy = len ? malloc(len) : NULL;
    if (!node || (len && !copy)) {
        free(node);
        free(copy);
        return di_fail(err, DI_ENOMEM, "%s: cannot queue a %zu-byte message", c->m->name, len);
    }
    if (len)
        memcpy(copy, msg, len);
    node->bb = bytes_to_buffer(copy, len);
    node->next = NULL;
    di_status st = DI_OK;
    pthread_mutex_lock(&c->mu);
    if (c->finished)
        st = di_fail(err, DI_ESTATE, "%s: write after finish", c->m->name);
    else if (c->cancelled)
        st = di_fail(err, c->cancel_why, "%s: the call was %s", c->m->name,
                     c->cancel_why == DI_ETIMEDOUT ? "past its deadline" : "cancelled");
    else if (c->queued >= RPC_STREAM_MAX_QUEUED)
        st = di_fail(err, DI_EFULL, "%s: %u messages wait for a slow reader", c->m->name,
                     c->queued);
    else {
        if (c->tail)
            c->tail->next = node;
        else
            c->head = node;
        c->tail = node;
        c->queued++;
        pump(c);
    }
    pthread_mutex_unlock(&c->mu);
    if (st != DI_OK) {
        grpc_byte_buffer_destroy(node->bb);
        free(node);
    }
    return st;
}

void rpc_call_finish(rpc_call *c, di_status st, const void *reply, size_t len, const char *msg)
{
    grpc_byte_buffer *bb = NULL;
    if (st == DI_OK && !c->streaming) {
        uint8_t *copy = len ? malloc(len) : NULL;
        if (len && !copy) {
            st = DI_ENOMEM;
            msg = "cannot copy the reply";
        } else {
            if (len)
                memcpy(copy, reply, len);
            bb = bytes_to_buffer(copy, len);
        }
    }
    pthread_mutex_lock(&c->mu);
    assert(!c->finished);
    /* After finish returns the cancel function neither runs nor will: wait for a running one
     * (unless it is this thread, finishing from inside it). */
    while (c->cancel_running && !pthread_equal(c->cancel_thread, pthread_self()))
        pthread_cond_wait(&c->cv, &c->mu);
    c->finished = 1;
    if (!c->cancelled) {
        c->final_st = st;
        c->final_reply = bb;
        bb = NULL;
        grpc_slice_unref(c->details);
        c->details = grpc_slice_from_copied_string(st == DI_OK || !msg ? "" : msg);
        c->trailer.key = grpc_slice_from_static_string(STATUS_KEY);
        c->trailer.value = grpc_slice_from_static_string(di_status_name(st));
        pump(c);
    }
    pthread_mutex_unlock(&c->mu);
    if (bb)
        grpc_byte_buffer_destroy(bb);
    if (st != DI_OK && c->srv->on_error) {
        char *peer = grpc_call_get_peer(c->call);
        c->srv->on_error(c->srv->on_error_ud, c->m->name, peer ? peer : "?", st, msg ? msg : "");
        gpr_free(peer);
    }
    call_unref(c); /* the handler's reference */
}

/* Cancels the calls whose deadline passed; sleeps until the next deadline. */
static void *timer_main(void *arg)
{
    struct rpc_server *s = arg;
    pthread_mutex_lock(&s->mu);
    while (!s->timer_stop) {
        uint64_t now = di_mono_ns(), next = now + 1000000000ull;
        struct rpc_call *due = NULL;
        for (struct rpc_call *c = s->live; c && !due; c = c->next) {
            pthread_mutex_lock(&c->mu);
            if (c->refs > 0 && !c->cancelled) {
                if (c->deadline_ns <= now) {
                    c->refs++;
                    due = c;
                } else if (c->deadline_ns < next)
                    next = c->deadline_ns;
            }
            pthread_mutex_unlock(&c->mu);
        }
        if (due) {
            pthread_mutex_unlock(&s->mu);
            pthread_mutex_lock(&due->mu);
            int run = mark_cancelled(due, DI_ETIMEDOUT);
            pthread_mutex_unlock(&due->mu);
            grpc_call_cancel_with_status(due->call, GRPC_STATUS_DEADLINE_EXCEEDED,
                                         "deadline exceeded", NULL);
            if (run)
                run_cancel(due);
            call_unref(due);
            pthread_mutex_lock(&s->mu);
            continue;
        }
        struct timespec until = {.tv_sec = (time_t)(next / 1000000000ull),
                                 .tv_nsec = (long)(next % 1000000000ull)};
        pthread_cond_timedwait(&s->timer_cv, &s->mu, &until);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Hands a checked call to the row's start function. */
static void async_begin(call_ctx *ctx, rpc_request *req)
{
    struct rpc_server *s = ctx->srv;
    const method_row *row = &s->methods[ctx->method];
    const rpc_method *m = &row->m;
    struct rpc_call *c = calloc(1, sizeof(*c));
    if (!c)
        return; /* ctx->call stays: handle_call answers ENOMEM */
    c->srv = s;
    c->call = ctx->call;
    ctx->call = NULL;
    c->m = m;
    c->streaming = row->streaming;
    c->deadline_ns = req->deadline_ns;
    c->send_tag = (rpc_tag){TAG_SEND, c};
    c->close_tag = (rpc_tag){TAG_CLOSE, c};
    c->status_tag = (rpc_tag){TAG_STATUS, c};
    c->details = grpc_empty_slice();
    c->trailer.value = grpc_empty_slice();
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->refs = 2; /* the handler and the close batch */
    pthread_mutex_lock(&s->mu);
    c->next = s->live;
    if (s->live)
        s->live->prev = c;
    s->live = c;
    s->n_live++;
    pthread_cond_signal(&s->timer_cv);
    pthread_mutex_unlock(&s->mu);
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->close_cancelled;
    if (grpc_call_start_batch(c->call, &op, 1, &c->close_tag, NULL) != GRPC_CALL_OK) {
        pthread_mutex_lock(&c->mu);
        c->refs--;
        c->cancelled = 1; /* cannot learn of a cancel: treat the call as gone */
        c->cancel_why = DI_EINTERNAL;
        pthread_mutex_unlock(&c->mu);
    }
    di_error e;
    di_error_clear(&e);
    di_status st = row->start(s->svc, req, c, &e);
    if (st != DI_OK)
        rpc_call_finish(c, st, NULL, 0, e.msg);
}

/* Checks the call and runs its handler. *taken: an asynchronous start took the call (nothing
 * more to send from here). */
static di_status run_handler(call_ctx *c, const char *peer, rpc_reply *reply, int *taken,
                             di_error *err)
{
    struct rpc_server *s = c->srv;
    const method_row *row = &s->methods[c->method];
    const rpc_method *m = &row->m;
    rpc_role role = caller_role(s, &c->md);
    di_status st = check_role(s, m, role, err);
    if (st != DI_OK)
        return st;
    int64_t left = ms_left(c->deadline);
    if (left <= 0)
        return di_fail(err, DI_ETIMEDOUT, "%s: the deadline passed before the call was served",
                       m->name);
    if (left > (int64_t)m->default_deadline_ms)
        left = m->default_deadline_ms;
    uint8_t *data = NULL;
    size_t len = 0;
    st = buffer_to_bytes(c->payload, &data, &len, m->max_request_bytes, err);
    if (st != DI_OK) {
        di_error_prefix(err, "%s: ", m->name);
        return st;
    }
    rpc_request req = {.method = m->name, .data = data, .len = len, .role = role,
                       .deadline_ns = di_mono_ns() + (uint64_t)left * 1000000ull, .peer = peer};
    if (row->start) {
        async_begin(c, &req);
        free(data);
        *taken = c->call == NULL;
        return *taken ? DI_OK : di_fail(err, DI_ENOMEM, "%s: cannot allocate the call", m->name);
    }
    st = m->handler(s->svc, &req, reply, err);
    free(data);
    return st;
}

static void handle_call(call_ctx *c)
{
    struct rpc_server *s = c->srv;
    char *peer = grpc_call_get_peer(c->call);
    rpc_reply reply = {0};
    di_error e;
    di_error_clear(&e);
    di_status st;
    if (c->unknown)
        st = di_fail(&e, DI_EUNSUPPORTED, "unknown method %.*s",
                     (int)GRPC_SLICE_LENGTH(c->details_in.method),
                     (const char *)GRPC_SLICE_START_PTR(c->details_in.method));
    else {
        int taken = 0;
        st = run_handler(c, peer ? peer : "?", &reply, &taken, &e);
        if (taken) {
            gpr_free(peer);
            free_ctx(c);
            return;
        }
    }
    if (st != DI_OK) {
        free(reply.data);
        reply.data = NULL;
        if (s->on_error)
            s->on_error(s->on_error_ud, c->unknown ? "?" : s->methods[c->method].m.name,
                        peer ? peer : "?", st, e.msg);
    }
    gpr_free(peer);
    grpc_op ops[4];
    memset(ops, 0, sizeof(ops));
    size_t n = 0;
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (st == DI_OK && !c->unknown && !s->methods[c->method].streaming) {
        c->reply = bytes_to_buffer(reply.data, reply.len);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = c->reply;
    }
    c->details = grpc_slice_from_copied_string(st == DI_OK ? "" : e.msg);
    c->trailer.key = grpc_slice_from_static_string(STATUS_KEY);
    c->trailer.value = grpc_slice_from_static_string(di_status_name(st));
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)di_status_grpc(st);
    ops[n].data.send_status_from_server.status_details = &c->details;
    ops[n].data.send_status_from_server.trailing_metadata_count = st == DI_OK ? 0 : 1;
    ops[n++].data.send_status_from_server.trailing_metadata = &c->trailer;
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n++].data.recv_close_on_server.cancelled = &c->cancelled;
    c->sending = 1;
    pthread_mutex_lock(&s->mu);
    s->sending++;
    pthread_mutex_unlock(&s->mu);
    if (grpc_call_start_batch(c->call, ops, n, c, NULL) != GRPC_CALL_OK) {
        free_ctx(c);
        pthread_mutex_lock(&s->mu);
        s->sending--;
        pthread_mutex_unlock(&s->mu);
    }
}

static void *worker_main(void *arg)
{
    struct rpc_server *s = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        if (ev.tag == &s->shutdown_tag) {
            pthread_mutex_lock(&s->mu);
            s->shutdown_seen = 1;
            pthread_cond_broadcast(&s->cv);
            pthread_mutex_unlock(&s->mu);
            continue;
        }
        rpc_tag *t = ev.tag;
        if (t->kind != TAG_SLOT) {
            async_event(t, ev.success);
            continue;
        }
        call_ctx *c = ev.tag;
        if (c->sending) {
            free_ctx(c);
            pthread_mutex_lock(&s->mu);
            s->sending--;
            pthread_cond_broadcast(&s->cv);
            pthread_mutex_unlock(&s->mu);
            continue;
        }
        if (!ev.success) {
            free_ctx(c);
            continue;
        }
        pthread_mutex_lock(&s->mu);
        s->running++;
        pthread_mutex_unlock(&s->mu);
        if (c->unknown) /* keep a slot open for the next call */
            request_unknown(s);
        else
            request_call(s, c->method);
        handle_call(c);
        pthread_mutex_lock(&s->mu);
        s->running--;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

/* A table row names a method, has its function, a size limit, a deadline and a role. */
static int row_ok(const char *name, int has_fn, uint32_t max_request, uint32_t deadline_ms,
                  rpc_role role)
{
    return name && name[0] == '/' && has_fn && max_request > 0 && deadline_ms > 0 &&
           (role == RPC_ROLE_ENGINE || role == RPC_ROLE_ADMIN);
}

static di_status check_server_config(const rpc_server_config *cfg, di_error *err)
{
    if (!cfg || !cfg->listen || (!cfg->methods && cfg->n_methods) ||
        (!cfg->async_methods && cfg->n_async_methods) ||
        cfg->n_methods + cfg->n_async_methods == 0 || cfg->threads == 0)
        return di_fail(err, DI_EINVAL, "server config needs an address, methods and threads");
    if (!cfg->tls_cert_pem != !cfg->tls_key_pem)
        return di_fail(err, DI_EINVAL, "TLS needs both a certificate and its key");
    if (cfg->tls_client_ca_pem && !cfg->tls_cert_pem)
        return di_fail(err, DI_EINVAL, "a client CA needs a server certificate too");
    for (size_t i = 0; i < cfg->n_methods; i++) {
        const rpc_method *m = &cfg->methods[i];
        if (!row_ok(m->name, m->handler != NULL, m->max_request_bytes, m->default_deadline_ms,
                    m->role))
            return di_fail(err, DI_EINVAL, "method row %zu (%s) is incomplete", i,
                           m->name ? m->name : "?");
    }
    for (size_t i = 0; i < cfg->n_async_methods; i++) {
        const rpc_async_method *m = &cfg->async_methods[i];
        if (!row_ok(m->name, m->start != NULL, m->max_request_bytes, m->default_deadline_ms,
                    m->role))
            return di_fail(err, DI_EINVAL, "asynchronous method row %zu (%s) is incomplete", i,
                           m->name ? m->name : "?");
    }
    return DI_OK;
}

static grpc_server_credentials *server_credentials(const rpc_server_config *cfg)
{
    if (!cfg->tls_cert_pem)
        return grpc_insecure_server_credentials_create();
    grpc_ssl_pem_key_cert_pair pair = {.private_key = cfg->tls_key_pem,
                                       .cert_chain = cfg->tls_cert_pem};
    return grpc_ssl_server_credentials_create_ex(
        cfg->tls_client_ca_pem, &pair, 1,
        cfg->tls_client_ca_pem ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                               : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
        NULL);
}

static void free_server(struct rpc_server *s)
{
    free(s->methods);
    free(s->handles);
    free(s->threads);
    free(s->engine_token);
    free(s->admin_token);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_cond_destroy(&s->timer_cv);
    free(s);
}

static di_status create_server(struct rpc_server *s, const rpc_server_config *cfg, int *port,
                               di_error *err)
{
    uint32_t max = 0;
    for (size_t i = 0; i < s->n_methods; i++)
        if (s->methods[i].m.max_request_bytes > max)
            max = s->methods[i].m.max_request_bytes;
    /* No SO_REUSEPORT (gRPC's default on Linux): a second server on a port in use must fail,
     * not share the port's connections with the first. */
    grpc_arg arg[2] = {{.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                        .value.integer = (int)max},
                       {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_ALLOW_REUSEPORT,
                        .value.integer = 0}};
    grpc_channel_args args = {.num_args = 2, .args = arg};
    s->server = grpc_server_create(&args, NULL);
    s->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(s->server, s->cq, NULL);
    for (size_t i = 0; i < s->n_methods; i++)
        s->handles[i] = grpc_server_register_method(s->server, s->methods[i].m.name, NULL,
                                                    GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    grpc_server_credentials *creds = server_credentials(cfg);
    int bound = creds ? grpc_server_add_http2_port(s->server, cfg->listen, creds) : 0;
    if (creds)
        grpc_server_credentials_release(creds);
    if (bound == 0)
        return di_fail(err, DI_EUNAVAIL,
                       "cannot listen on %s (port in use, not a local address, or bad TLS "
                       "certificate/key)",
                       cfg->listen);
    *port = bound;
    return DI_OK;
}

di_status rpc_server_start(const rpc_server_config *cfg, rpc_server **out, int *port,
                           di_error *err)
{
    di_status st = check_server_config(cfg, err);
    if (st != DI_OK)
        return st;
    struct rpc_server *s = calloc(1, sizeof(*s));
    if (!s)
        return di_fail(err, DI_ENOMEM, "cannot allocate the server");
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->timer_cv, &ca);
    pthread_condattr_destroy(&ca);
    size_t n_rows = cfg->n_methods + cfg->n_async_methods;
    s->methods = calloc(n_rows, sizeof(method_row));
    s->handles = calloc(n_rows, sizeof(void *));
    s->threads = calloc(cfg->threads, sizeof(pthread_t));
    s->engine_token = cfg->engine_token ? strdup(cfg->engine_token) : NULL;
    s->admin_token = cfg->admin_token ? strdup(cfg->admin_token) : NULL;
    if (!s->methods || !s->handles || !s->threads || (cfg->engine_token && !s->engine_token) ||
        (cfg->admin_token && !s->admin_token)) {
        free_server(s);
        return di_fail(err, DI_ENOMEM, "cannot allocate the server tables");
    }
    for (size_t i = 0; i < cfg->n_methods; i++)
        s->methods[i].m = cfg->methods[i];
    for (size_t i = 0; i < cfg->n_async_methods; i++) {
        const rpc_async_method *a = &cfg->async_methods[i];
        method_row *r = &s->methods[cfg->n_methods + i];
        r->m = (rpc_method){.name = a->name, .default_deadline_ms = a->default_deadline_ms,
                            .idempotent = a->idempotent, .max_request_bytes = a->max_request_bytes,
                            .role = a->role};
        r->start = a->start;
        r->streaming = a->streaming;
    }
    s->n_methods = n_rows;
    s->svc = cfg->svc;
    s->on_error = cfg->on_error;
    s->on_error_ud = cfg->on_error_ud;
    grpc_ref();
    int bound = 0;
    st = create_server(s, cfg, &bound, err);
    if (st != DI_OK) {
        grpc_server_destroy(s->server);
        grpc_completion_queue_shutdown(s->cq);
        while (grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN)
            ;
        grpc_completion_queue_destroy(s->cq);
        free_server(s);
        grpc_shutdown();
        return st;
    }
    grpc_server_start(s->server);
    for (unsigned t = 0; t < cfg->threads; t++) {
        for (size_t m = 0; m < s->n_methods; m++)
            request_call(s, m);
        request_unknown(s);
    }
    for (unsigned t = 0; t < cfg->threads; t++)
        if (pthread_create(&s->threads[t], NULL, worker_main, s) == 0)
            s->n_threads++;
    s->timer_started = pthread_create(&s->timer, NULL, timer_main, s) == 0;
    if (s->n_threads > 0 && !s->timer_started) {
        *out = s;
        rpc_server_stop(s, 0);
        *out = NULL;
        return di_fail(err, DI_ENOMEM, "cannot start the server threads");
    }
    *out = s;
    if (port)
        *port = bound;
    return DI_OK;
}

rpc_server *rpc_server_stop(rpc_server *s, uint32_t grace_ms)
{
    if (!s)
        return NULL;
    atomic_store(&s->stopping, 1);
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += grace_ms / 1000;
    until.tv_nsec += (long)(grace_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    /* Calls in flight finish and their replies go out (up to the grace period); then the
     * remaining calls are cancelled and idle client connections closed, which gRPC waits for
     * before it reports the shutdown. */
    pthread_mutex_lock(&s->mu);
    while (!s->shutdown_seen && (s->running > 0 || s->sending > 0 || s->n_live > 0))
        if (pthread_cond_timedwait(&s->cv, &s->mu, &until) != 0)
            break;
    pthread_mutex_unlock(&s->mu);
    grpc_server_cancel_all_calls(s->server);
    /* Handlers still running will start their reply batches, and asynchronous handlers,
     * told by their cancel functions, finish their calls: the queue must stay open. */
    pthread_mutex_lock(&s->mu);
    while (!s->shutdown_seen || s->running > 0 || s->n_live > 0)
        pthread_cond_wait(&s->cv, &s->mu);
    s->timer_stop = 1;
    pthread_cond_signal(&s->timer_cv);
    pthread_mutex_unlock(&s->mu);
    if (s->timer_started)
        pthread_join(s->timer, NULL);
    grpc_server_destroy(s->server);
    grpc_completion_queue_shutdown(s->cq);
    for (unsigned t = 0; t < s->n_threads; t++)
        pthread_join(s->threads[t], NULL);
    grpc_completion_queue_destroy(s->cq);
    free_server(s);
    grpc_shutdown();
    return NULL;
}

unsigned rpc_server_live_calls(rpc_server *s)
{
    pthread_mutex_lock(&s->mu);
    unsigned n = s->running + s->sending + s->n_live;
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* ================================================================== client */

struct rpc_client {
    grpc_channel *channel;
    grpc_completion_queue *cq;  /* pluck queue */
    char *target;
    grpc_metadata auth;         /* "authorization: Bearer ..." */
    int has_auth;
    uint32_t max_reply;
    pthread_mutex_t mu;         /* guards current */
    grpc_call *current;         /* call in flight, for rpc_client_cancel */
};

di_status rpc_client_open(const rpc_client_config *cfg, rpc_client **out, di_error *err)
{
    if (!cfg || !cfg->target || !*cfg->target || !out)
        return di_fail(err, DI_EINVAL, "rpc client needs a target host:port");
    if (!cfg->tls_cert_pem != !cfg->tls_key_pem)
        return di_fail(err, DI_EINVAL, "a client certificate needs its key (and vice versa)");
    rpc_client *c = calloc(1, sizeof(*c));
    if (!c || !(c->target = strdup(cfg->target))) {
        free(c);
        return di_fail(err, DI_ENOMEM, "cannot allocate an rpc client");
    }
    pthread_mutex_init(&c->mu, NULL);
    c->max_reply = cfg->max_reply_bytes ? cfg->max_reply_bytes : 64u << 20;
    grpc_ref();
    grpc_arg args[4];
    size_t na = 0;
    args[na++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                            .value.integer = (int)c->max_reply};
    /* Reconnect quickly after a server restart: fail-fast calls see UNAVAILABLE during backoff.
     * (Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC also takes it as the connect timeout, and a
     * loaded server would then look unreachable.) */
    args[na++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
                            .value.integer = 100};
    args[na++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                            .value.integer = 1000};
    if (cfg->tls_target_name)
        args[na++] = (grpc_arg){.type = GRPC_ARG_STRING, .key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG,
                                .value.string = (char *)cfg->tls_target_name};
    grpc_channel_args ca = {.num_args = na, .args = args};
    grpc_channel_credentials *creds;
    if (cfg->tls_ca_pem) {
        grpc_ssl_pem_key_cert_pair pair = {.private_key = cfg->tls_key_pem,
                                           .cert_chain = cfg->tls_cert_pem};
        creds = grpc_ssl_credentials_create(cfg->tls_ca_pem, cfg->tls_cert_pem ? &pair : NULL,
                                            NULL, NULL);
    } else
        creds = grpc_insecure_credentials_create();
    c->channel = grpc_channel_create(cfg->target, creds, &ca);
    grpc_channel_credentials_release(creds);
    c->cq = grpc_completion_queue_create_for_pluck(NULL);
    if (cfg->token) {
        size_t n = strlen(BEARER) + strlen(cfg->token) + 1;
        char *v = malloc(n);
        if (v) {
            snprintf(v, n, "%s%s", BEARER, cfg->token);
            c->auth.key = grpc_slice_from_static_string(AUTH_KEY);
            c->auth.value = grpc_slice_from_copied_string(v);
            c->has_auth = 1;
            free(v);
        }
    }
    if (cfg->token && !c->has_auth) {
        rpc_client_close(c);
        return di_fail(err, DI_ENOMEM, "cannot allocate the token header");
    }
    *out = c;
    return DI_OK;
}

rpc_client *rpc_client_close(rpc_client *c)
{
    if (!c)
        return NULL;
    if (c->channel)
        grpc_channel_destroy(c->channel);
    if (c->cq) {
        grpc_completion_queue_shutdown(c->cq);
        while (grpc_completion_queue_pluck(c->cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL)
                   .type != GRPC_QUEUE_SHUTDOWN)
            ;
        grpc_completion_queue_destroy(c->cq);
    }
    if (c->has_auth)
        grpc_slice_unref(c->auth.value);
    pthread_mutex_destroy(&c->mu);
    free(c->target);
    free(c);
    grpc_shutdown();
    return NULL;
}

const char *rpc_client_target(const rpc_client *c)
{
    return c->target;
}

void rpc_client_cancel(rpc_client *c)
{
    pthread_mutex_lock(&c->mu);
    if (c->current)
        grpc_call_cancel(c->current, NULL);
    pthread_mutex_unlock(&c->mu);
}

int rpc_client_connected(rpc_client *c)
{
    return grpc_channel_check_connectivity_state(c->channel, 0) == GRPC_CHANNEL_READY;
}

int rpc_client_wait_connected(rpc_client *c, uint32_t timeout_ms)
{
    gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                         gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
    grpc_connectivity_state s = grpc_channel_check_connectivity_state(c->channel, 1);
    while (s != GRPC_CHANNEL_READY && s != GRPC_CHANNEL_SHUTDOWN) {
        char tag; /* its address: this waiter's event on the shared pluck queue */
        grpc_channel_watch_connectivity_state(c->channel, s, deadline, c->cq, &tag);
        /* The watch completes by its deadline at the latest; plucking polls the channel. */
        grpc_event ev = grpc_completion_queue_pluck(c->cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME),
                                                    NULL);
        if (ev.type != GRPC_OP_COMPLETE || !ev.success)
            break; /* the deadline passed without a change */
        s = grpc_channel_check_connectivity_state(c->channel, 1);
    }
    return s == GRPC_CHANNEL_READY;
}

size_t rpc_clients_wait_connected(rpc_client *const *cs, size_t n, uint32_t timeout_ms,
                                  int *connected)
{
    gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                         gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    size_t up = 0, pending = 0;
    for (size_t i = 0; i < n; i++) {
        grpc_connectivity_state s = grpc_channel_check_connectivity_state(cs[i]->channel, 1);
        connected[i] = s == GRPC_CHANNEL_READY;
        up += (size_t)connected[i];
        if (s != GRPC_CHANNEL_READY && s != GRPC_CHANNEL_SHUTDOWN) {
            /* the tag is the channel's index + 1 (not NULL) */
            grpc_channel_watch_connectivity_state(cs[i]->channel, s, deadline, cq,
                                                  (void *)(uintptr_t)(i + 1));
            pending++;
        }
    }
    /* Every watch completes by the deadline at the latest; waiting polls every channel. */
    while (pending > 0) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type != GRPC_OP_COMPLETE)
            break;
        pending--;
        size_t i = (size_t)(uintptr_t)ev.tag - 1;
        grpc_connectivity_state s = grpc_channel_check_connectivity_state(cs[i]->channel, 1);
        if (s == GRPC_CHANNEL_READY) {
            connected[i] = 1;
            up++;
        } else if (ev.success && s != GRPC_CHANNEL_SHUTDOWN &&
                   gpr_time_cmp(gpr_now(GPR_CLOCK_MONOTONIC), deadline) < 0) {
            grpc_channel_watch_connectivity_state(cs[i]->channel, s, deadline, cq, ev.tag);
            pending++;
        }
    }
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(cq);
    return up;
}

/* Status of a finished call: the server's di-status when present, else the gRPC code. */
static di_status call_status(rpc_client *c, const char *method, grpc_status_code code,
                             grpc_slice details, const grpc_metadata_array *trailer, di_error *err)
{
    di_status st = DI_OK;
    for (size_t i = 0; i < trailer->count; i++)
        if (slice_is(trailer->metadata[i].key, STATUS_KEY))
            st = status_by_name((const char *)GRPC_SLICE_START_PTR(trailer->metadata[i].value),
                                GRPC_SLICE_LENGTH(trailer->metadata[i].value));
    if (st == DI_OK)
        st = rpc_status_from_grpc(code);
    const char *short_name = strrchr(method, '/');
    short_name = short_name ? short_name + 1 : method;
    int n = (int)GRPC_SLICE_LENGTH(details);
    const char *d = (const char *)GRPC_SLICE_START_PTR(details);
    if (st == DI_EUNAVAIL && code == GRPC_STATUS_UNAVAILABLE)
        return di_fail(err, st, "%s: %s unavailable: %.*s", short_name, c->target, n, d);
    return di_fail(err, st, "%s: %.*s", short_name, n, d);
}

di_status rpc_client_call(rpc_client *c, const char *method, const void *req, size_t len,
                          uint32_t timeout_ms, uint8_t **reply, size_t *reply_len, di_error *err)
{
    if (!c || !method || (len > 0 && !req) || !reply || !reply_len)
        return di_fail(err, DI_EINVAL, "rpc_client_call: NULL argument");
    gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                         gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
    grpc_slice mslice = grpc_slice_from_copied_string(method);
    grpc_call *call = grpc_channel_create_call(c->channel, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq,
                                               mslice, NULL, deadline, NULL);
    grpc_slice_unref(mslice);
    uint8_t *copy = NULL;
    if (len > 0) {
        copy = malloc(len);
        if (!copy) {
            grpc_call_unref(call);
            return di_fail(err, DI_ENOMEM, "cannot allocate a %zu-byte request", len);
        }
        memcpy(copy, req, len);
    }
    grpc_byte_buffer *send = bytes_to_buffer(copy, len);
    grpc_byte_buffer *recv = NULL;
    grpc_metadata_array init_md, trailer;
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trailer);
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = c->has_auth ? 1 : 0;
    ops[0].data.send_initial_metadata.metadata = c->has_auth ? &c->auth : NULL;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trailer;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    pthread_mutex_lock(&c->mu);
    c->current = call;
    pthread_mutex_unlock(&c->mu);
    di_status st = DI_OK;
    if (grpc_call_start_batch(call, ops, 6, call, NULL) != GRPC_CALL_OK)
        st = di_fail(err, DI_EINTERNAL, "cannot start a gRPC call to %s", method);
    else
        grpc_completion_queue_pluck(c->cq, call, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    pthread_mutex_lock(&c->mu);
    c->current = NULL;
    pthread_mutex_unlock(&c->mu);
    if (st == DI_OK && code != GRPC_STATUS_OK)
        st = call_status(c, method, code, details, &trailer, err);
    uint8_t *out = NULL;
    size_t out_len = 0;
    if (st == DI_OK)
        st = buffer_to_bytes(recv, &out, &out_len, c->max_reply, err);
    grpc_byte_buffer_destroy(send);
    if (recv)
        grpc_byte_buffer_destroy(recv);
    grpc_metadata_array_destroy(&init_md);
    grpc_metadata_array_destroy(&trailer);
    grpc_slice_unref(details);
    grpc_call_unref(call);
    if (st != DI_OK)
        return st;
    *reply = out;
    *reply_len = out_len;
    return DI_OK;
}

/* ------------------------------------------------------------ client streams */

struct rpc_stream {
    rpc_client *c;
    grpc_call *call;
    grpc_completion_queue *cq;   /* the stream's own pluck queue */
    char *method;                /* for messages */
    grpc_byte_buffer *send;      /* the request */
    grpc_byte_buffer *recv;      /* the message being received */
    grpc_metadata_array init_md, trailer;
    grpc_status_code code;
    grpc_slice details;
    int start_pending;           /* the send batch is not plucked yet */
    int status_pending;          /* the status batch is not plucked yet */
    int done;                    /* the final status is known */
    di_error final;              /* it */
    char tags[3];                /* their addresses: send batch, status batch, one read */
};

di_status rpc_stream_open(rpc_client *c, const char *method, const void *req, size_t len,
                          uint32_t timeout_ms, rpc_stream **out, di_error *err)
{
    if (!c || !method || (len > 0 && !req) || !out)
        return di_fail(err, DI_EINVAL, "rpc_stream_open: NULL argument");
    rpc_stream *s = calloc(1, sizeof(*s));
    uint8_t *copy = len ? malloc(len) : NULL;
    if (!s || (len && !copy) || !(s->method = strdup(method))) {
        if (s)
            free(s->method);
        free(s);
        free(copy);
        return di_fail(err, DI_ENOMEM, "cannot allocate a stream to %s", method);
    }
    if (len)
        memcpy(copy, req, len);
    s->c = c;
    s->send = bytes_to_buffer(copy, len);
    s->details = grpc_empty_slice();
    grpc_metadata_array_init(&s->init_md);
    grpc_metadata_array_init(&s->trailer);
    s->cq = grpc_completion_queue_create_for_pluck(NULL);
    gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                         gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
    grpc_slice mslice = grpc_slice_from_copied_string(method);
    s->call = grpc_channel_create_call(c->channel, NULL, GRPC_PROPAGATE_DEFAULTS, s->cq, mslice,
                                       NULL, deadline, NULL);
    grpc_slice_unref(mslice);
    grpc_op ops[4];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = c->has_auth ? 1 : 0;
    ops[0].data.send_initial_metadata.metadata = c->has_auth ? &c->auth : NULL;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = s->send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &s->init_md;
    s->start_pending = grpc_call_start_batch(s->call, ops, 4, &s->tags[0], NULL) == GRPC_CALL_OK;
    grpc_op st;
    memset(&st, 0, sizeof(st));
    st.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    st.data.recv_status_on_client.trailing_metadata = &s->trailer;
    st.data.recv_status_on_client.status = &s->code;
    st.data.recv_status_on_client.status_details = &s->details;
    s->status_pending = grpc_call_start_batch(s->call, &st, 1, &s->tags[1], NULL) == GRPC_CALL_OK;
    if (!s->start_pending || !s->status_pending) {
        rpc_stream_close(s);
        return di_fail(err, DI_EINTERNAL, "cannot start a gRPC stream to %s", method);
    }
    *out = s;
    return DI_OK;
}

static void pluck(rpc_stream *s, int i)
{
    grpc_completion_queue_pluck(s->cq, &s->tags[i], gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
}

/* Waits for the status and records it as the final result. */
static void stream_end(rpc_stream *s)
{
    if (s->start_pending)
        pluck(s, 0);
    s->start_pending = 0;
    if (s->status_pending)
        pluck(s, 1);
    s->status_pending = 0;
    s->done = 1;
    di_error_clear(&s->final);
    if (s->code != GRPC_STATUS_OK)
        call_status(s->c, s->method, s->code, s->details, &s->trailer, &s->final);
}

di_status rpc_stream_read(rpc_stream *s, uint8_t **msg, size_t *len, int *done, di_error *err)
{
    if (!s || !msg || !len || !done)
        return di_fail(err, DI_EINVAL, "rpc_stream_read: NULL argument");
    if (!s->done) {
        grpc_op op;
        memset(&op, 0, sizeof(op));
        op.op = GRPC_OP_RECV_MESSAGE;
        op.data.recv_message.recv_message = &s->recv;
        s->recv = NULL;
        if (grpc_call_start_batch(s->call, &op, 1, &s->tags[2], NULL) == GRPC_CALL_OK)
            pluck(s, 2);
        if (s->recv) {
            uint8_t *out = NULL;
            size_t n = 0;
            di_status st = buffer_to_bytes(s->recv, &out, &n, s->c->max_reply, err);
            grpc_byte_buffer_destroy(s->recv);
            s->recv = NULL;
            if (st == DI_OK) {
                *msg = out;
                *len = n;
                *done = 0;
                return DI_OK;
            }
            grpc_call_cancel(s->call, NULL);
            stream_end(s);
            s->final = *err; /* the local failure is the stream's result */
            *done = 1;
            return st;
        }
        stream_end(s);
    }
    *done = 1;
    if (s->final.code == DI_OK)
        return DI_OK;
    if (err)
        *err = s->final;
    return s->final.code;
}

void rpc_stream_cancel(rpc_stream *s)
{
    if (s)
        grpc_call_cancel(s->call, NULL);
}

rpc_stream *rpc_stream_close(rpc_stream *s)
{
    if (!s)
        return NULL;
    if (s->call) {
        if (!s->done)
            grpc_call_cancel(s->call, NULL);
        if (s->start_pending)
            pluck(s, 0);
        if (s->status_pending)
            pluck(s, 1);
        grpc_call_unref(s->call);
    }
    grpc_completion_queue_shutdown(s->cq);
    while (grpc_completion_queue_pluck(s->cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL)
               .type != GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(s->cq);
    grpc_byte_buffer_destroy(s->send);
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trailer);
    grpc_slice_unref(s->details);
    free(s->method);
    free(s);
    return NULL;
}
