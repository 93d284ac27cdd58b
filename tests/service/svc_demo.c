/* di-svcdemo: a small service on the skeleton (common/service) for its tests. It serves
 * "/demo.Demo/Count" (server stream: request = uint32 n, uint32 delay_us little-endian; n
 * 4-byte messages delay_us apart) and "/demo.Demo/Ping" (unary echo) with rpc.h, and drains
 * with rpc_server_stop on SIGTERM. --ignore-cancel makes streams run to their end whatever
 * happens, to exercise the drain deadline. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/net/rpc.h"
#include "common/service/service.h"
#include "common/util/clock.h"

typedef struct demo_opts {
    svc_base_opts base;    /* --listen, --port-file, --ready-fd, --log-level, --drain */
    char *token;           /* client token (secret) or NULL */
    uint64_t threads;      /* server threads */
    int ignore_cancel;     /* streams ignore cancellation */
    uint64_t max_request;  /* largest request, bytes */
} demo_opts;

static const svc_opt demo_rows[] = {
    SVC_BASE_ROWS(demo_opts, base, "127.0.0.1:0", "30s"),
    {"token-file", SVC_OPT_SECRET, offsetof(demo_opts, token), NULL, 0, 0, "FILE",
     "client token (the file's first line)", "DI_DEMO_TOKEN"},
    {"threads", SVC_OPT_UINT, offsetof(demo_opts, threads), "2", 1, 64, "N",
     "server threads", NULL},
    {"ignore-cancel", SVC_OPT_FLAG, offsetof(demo_opts, ignore_cancel), NULL, 0, 0, NULL,
     "streams run to their end even when cancelled", NULL},
    {"max-request", SVC_OPT_SIZE, offsetof(demo_opts, max_request), "1KiB", 8, 1048576, "SIZE",
     "largest request", NULL},
};

typedef struct demo_app {
    demo_opts *o;
    rpc_server *srv;
    unsigned ticks;        /* periodic calls so far */
} demo_app;

typedef struct stream_job {
    rpc_call *call;
    uint32_t n, delay_us;
    int ignore_cancel;
    atomic_int cancelled;
} stream_job;

static void on_cancel(void *ud, di_status why)
{
    (void)why;
    atomic_store(&((stream_job *)ud)->cancelled, 1);
}

static void *produce(void *arg)
{
    stream_job *j = arg;
    di_status st = DI_OK;
    di_error e;
    di_error_clear(&e);
    for (uint32_t i = 0; i < j->n; i++) {
        if (!j->ignore_cancel && atomic_load(&j->cancelled)) {
            st = DI_ECANCELED;
            break;
        }
        uint8_t m[4] = {(uint8_t)i, (uint8_t)(i >> 8), (uint8_t)(i >> 16), (uint8_t)(i >> 24)};
        di_status w = rpc_call_write(j->call, m, sizeof(m), &e);
        if (w != DI_OK && !j->ignore_cancel) {
            st = w;
            break;
        }
        if (j->delay_us)
            usleep(j->delay_us);
    }
    rpc_call_finish(j->call, st, NULL, 0, st == DI_OK ? NULL : e.msg);
    free(j);
    return NULL;
}

static di_status s_count(void *svc, const rpc_request *req, rpc_call *call, di_error *err)
{
    demo_app *a = svc;
    if (req->len != 8)
        return di_fail(err, DI_EINVAL, "Count needs 8 bytes, got %zu", req->len);
    stream_job *j = calloc(1, sizeof(*j));
    if (!j)
        return di_fail(err, DI_ENOMEM, "cannot allocate a stream");
    j->call = call;
    memcpy(&j->n, req->data, 4);
    memcpy(&j->delay_us, req->data + 4, 4);
    j->ignore_cancel = a->o->ignore_cancel;
    rpc_call_on_cancel(call, on_cancel, j);
    pthread_t t;
    if (pthread_create(&t, NULL, produce, j) != 0) {
        rpc_call_finish(call, DI_ENOMEM, NULL, 0, "cannot start a producer");
        free(j);
        return DI_OK;
    }
    pthread_detach(t);
    return DI_OK;
}

static di_status h_ping(void *svc, const rpc_request *req, rpc_reply *reply, di_error *err)
{
    (void)svc;
    if (req->len && !(reply->data = malloc(req->len)))
        return di_fail(err, DI_ENOMEM, "cannot allocate the reply");
    if (req->len)
        memcpy(reply->data, req->data, req->len);
    reply->len = req->len;
    return DI_OK;
}

static di_status demo_start(void *app, const svc_ctx *ctx, int *port, di_error *err)
{
    demo_app *a = app;
    rpc_method sync[] = {{"/demo.Demo/Ping", h_ping, 5000, 1, (uint32_t)a->o->max_request,
                          RPC_ROLE_ENGINE}};
    rpc_async_method async[] = {{"/demo.Demo/Count", s_count, 1, 60000, 1,
                                 (uint32_t)a->o->max_request, RPC_ROLE_ENGINE}};
    rpc_server_config sc = {.listen = ctx->base->listen, .methods = sync, .n_methods = 1,
                            .async_methods = async, .n_async_methods = 1,
                            .svc = a, .threads = (unsigned)a->o->threads,
                            .engine_token = a->o->token};
    return rpc_server_start(&sc, &a->srv, port, err);
}

static void demo_drain(void *app, const svc_ctx *ctx, uint64_t deadline_ns)
{
    demo_app *a = app;
    uint64_t now = di_mono_ns();
    uint32_t grace = deadline_ns > now ? (uint32_t)((deadline_ns - now) / 1000000ull) : 0;
    unsigned live = a->srv ? rpc_server_live_calls(a->srv) : 0;
    di_log(&ctx->log, DI_LOG_INFO, "draining %u calls (grace %ums)", live, grace);
    a->srv = rpc_server_stop(a->srv, grace);
}

static void demo_tick(void *app, const svc_ctx *ctx)
{
    demo_app *a = app;
    a->ticks++;
    di_log(&ctx->log, DI_LOG_DEBUG, "tick %u: %u calls", a->ticks,
           a->srv ? rpc_server_live_calls(a->srv) : 0);
}

static void demo_stop(void *app, const svc_ctx *ctx)
{
    (void)ctx;
    demo_app *a = app;
    a->srv = rpc_server_stop(a->srv, 0);
}

int main(int argc, char **argv)
{
    demo_opts o;
    memset(&o, 0, sizeof(o));
    demo_app app = {.o = &o};
    svc_spec spec = {.name = "di-svcdemo",
                     .summary = "A streaming demo service on the service skeleton.",
                     .guard = "token-file",
                     .rows = demo_rows, .n_rows = sizeof(demo_rows) / sizeof(demo_rows[0]),
                     .opts = &o, .base_offset = offsetof(demo_opts, base), .app = &app,
                     .start = demo_start, .drain = demo_drain, .stop = demo_stop,
                     .tick = demo_tick, .tick_ms = 50};
    return svc_main(&spec, argc, argv);
}
