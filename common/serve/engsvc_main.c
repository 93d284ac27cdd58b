#include "common/serve/engsvc_main.h"

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/ep/group.h"
#include "common/ep/moe.h"
#include "common/serve/backend.h"
#include "common/serve/model_open.h"
#include "common/service/engine_opts.h"
#include "common/service/service.h"
#include "common/util/clock.h"

typedef struct eopts {
    svc_base_opts base;
    svc_engine_opts eng;
    uint64_t nextn;          /* drafts per step; 16 = the model's draft block size */
    uint64_t chunk;          /* prefill step budget, tokens */
    uint64_t max_seqs;
    uint64_t blocks;
    uint64_t max_waiting;
    uint64_t rpc_threads;
    uint64_t kvstore_deadline_ms;
    uint64_t step_delay_ms;  /* testing only */
    /* an expert-parallel rank group (with --ep-addr) */
    const char *ep_addr;
    int64_t ep_listen_fd;
    char *ep_token;
    uint64_t ep_timeout_ms;
    int ep_allow_remote;
    uint64_t ep_redundant;
    uint64_t eplb_interval;
    uint64_t ep_idle_ms;
    /* di-decode: one step ahead, the overlap */
    int ahead;
    int overlap;
} eopts;

#define EROWS(listen_def)                                                                     \
    SVC_BASE_ROWS(eopts, base, listen_def, "60s"), SVC_ENGINE_ROWS(eopts, eng),               \
    {"nextn", SVC_OPT_UINT, offsetof(eopts, nextn), "16", 0, 16, "N",                         \
     "drafts per decode step (as di-generate --nextn); 16 = the model's draft block size",    \
     NULL},                                                                                    \
    {"chunk", SVC_OPT_UINT, offsetof(eopts, chunk), "512", 128, 65536, "TOKENS",              \
     "prefill tokens per step (a multiple of 128)", NULL},                                    \
    {"max-seqs", SVC_OPT_UINT, offsetof(eopts, max_seqs), "16", 1, 1024, "N",                 \
     "requests computed at once", NULL},                                                       \
    {"blocks", SVC_OPT_UINT, offsetof(eopts, blocks), "1024", 16, 16777216, "N",              \
     "KV blocks of 128 positions in the pool", NULL},                                         \
    {"max-waiting", SVC_OPT_UINT, offsetof(eopts, max_waiting), "256", 1, 65536, "N",         \
     "requests queued at most; more are refused with EFULL", NULL},                           \
    {"rpc-threads", SVC_OPT_UINT, offsetof(eopts, rpc_threads), "4", 1, 64, "N",              \
     "gRPC worker threads", NULL},                                                             \
    {"kvstore-deadline", SVC_OPT_DURATION, offsetof(eopts, kvstore_deadline_ms), "10s", 10,   \
     600000, "DURATION", "deadline of each store call", NULL},                                \
    {"step-delay-ms", SVC_OPT_UINT, offsetof(eopts, step_delay_ms), "0", 0, 10000, "N",       \
     "TESTING ONLY: sleep N ms in every engine step (a slow rank on purpose)", NULL},       \
    {"ep-addr", SVC_OPT_HOSTPORT, offsetof(eopts, ep_addr), NULL, 0, 0, "HOST:PORT",          \
     "run as rank --rank of an expert-parallel group of --world; rank 0 listens here",       \
     NULL},                                                                                    \
    {"ep-listen-fd", SVC_OPT_INT, offsetof(eopts, ep_listen_fd), "-1", -1, 65535, "FD",       \
     "rank 0: an inherited socket already listening on --ep-addr (from a launcher)", NULL},   \
    {"ep-token-file", SVC_OPT_SECRET, offsetof(eopts, ep_token), NULL, 0, 0, "FILE",          \
     "the group token, 16..512 bytes, the same on every rank", "DI_EP_TOKEN"},               \
    {"ep-timeout", SVC_OPT_DURATION, offsetof(eopts, ep_timeout_ms), "60s", 100, 3600000,     \
     "DURATION", "deadline of the group's rendezvous and of every group call", NULL},        \
    {"ep-allow-remote", SVC_OPT_FLAG, offsetof(eopts, ep_allow_remote), NULL, 0, 0, NULL,     \
     "let the group meet on a non-loopback --ep-addr", NULL},                                 \
    {"ep-redundant", SVC_OPT_UINT, offsetof(eopts, ep_redundant), "0", 0, 65536, "N",         \
     "redundant expert slots at least (rounded up to fill every rank)", NULL},               \
    {"eplb-interval", SVC_OPT_UINT, offsetof(eopts, eplb_interval), "0", 0, 1048576, "N",     \
     "re-plan expert placement every N group steps from the measured loads; 0 = never",      \
     NULL},                                                                                    \
    {"ep-idle", SVC_OPT_DURATION, offsetof(eopts, ep_idle_ms), "10", 1, 1000, "DURATION",     \
     "an idle group votes this often: the longest a request waits for the group to wake",   \
     NULL}

static const svc_opt k_prefill_rows[] = {EROWS("127.0.0.1:9480")};
static const svc_opt k_decode_rows[] = {
    EROWS("127.0.0.1:9490"),
    {"ahead", SVC_OPT_FLAG, offsetof(eopts, ahead), NULL, 0, 0, NULL,
     "one step ahead: step N+1 is scheduled before step N's outcome is processed (its rows "
     "written from that outcome on the backend); needs --nextn 0, not with --ep-addr", NULL},
    {"overlap", SVC_OPT_FLAG, offsetof(eopts, overlap), NULL, 0, 0, NULL,
     "--ahead, and decode step N+1 is issued before step N is collected: the host schedules, "
     "streams and stores step N while the device runs N+1 (helps when a device step takes "
     "longer than that host work); same outputs", NULL},
};

/* One step ahead is di-decode's: prompt steps drain the pipeline (they are processed at once),
 * so di-prefill would gain nothing; it names the flags rather than calling them unknown. */
static di_status prefill_refuses_ahead(int argc, char **argv, di_error *err)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--"))
            break;
        if (!strncmp(a, "--ahead", 7) && (!a[7] || a[7] == '='))
            return di_fail(err, DI_EINVAL, "--ahead: prompt steps drain the pipeline, so one "
                           "step ahead gives nothing in prefill; it is di-decode's");
        if (!strncmp(a, "--overlap", 9) && (!a[9] || a[9] == '='))
            return di_fail(err, DI_EINVAL, "--overlap: prompt steps drain the pipeline, so "
                           "the overlap gives nothing in prefill; it is di-decode's");
    }
    return DI_OK;
}

/* --ahead / --overlap: a single rank decoding without drafts (with drafts the one step ahead
 * scheduler may budget a request's last rows differently; a group steps in lockstep). mc NULL:
 * the options only (before the model is loaded). */
static di_status ahead_check(const eopts *o, const model_config *mc, di_error *err)
{
    if (!o->ahead && !o->overlap)
        return DI_OK;
    const char *flag = o->overlap ? "--overlap" : "--ahead";
    if (o->ep_addr)
        return di_fail(err, DI_EINVAL, "%s: not with --ep-addr (a rank group steps in "
                       "lockstep; run the group without it)", flag);
    uint64_t nextn = o->nextn == 16 && mc ? mc->dspark_block_size : o->nextn;
    if (mc && nextn && mc->n_mtp)
        return di_fail(err, DI_EINVAL, "%s: needs --nextn 0 (with drafts, one step ahead "
                       "may draw a request's last tokens differently)", flag);
    return DI_OK;
}

typedef struct app {
    engsvc_kind kind;
    eopts o;
    kern_backend be;
    serve_model sm;
    kvc_client *kv;             /* the store, for stores (one client per thread) */
    kvc_client *kv_load;        /* the store, for loads */
    engsvc *svc;
    rpc_server *srv;
    char model_name[64];
} app;

static void rpc_error(void *ud, const char *method, const char *peer, di_status st,
                      const char *msg)
{
    const svc_ctx *ctx = ud;
    if (st != DI_ECANCELED)
        di_log(&ctx->log, DI_LOG_INFO, "%s from %s: %s: %s", method, peer, di_status_name(st),
               msg);
}

/* The group's options: all of them only with --ep-addr, which needs --world 2 or more. */
static di_status ep_check(const eopts *o, di_error *err)
{
    if (!o->ep_addr) {
        if (o->ep_token || o->ep_listen_fd >= 0 || o->ep_allow_remote || o->ep_redundant ||
            o->eplb_interval)
            return di_fail(err, DI_EINVAL, "--ep-token-file, --ep-listen-fd, "
                           "--ep-allow-remote, --ep-redundant and --eplb-interval need "
                           "--ep-addr (a rank group)");
        return DI_OK;
    }
    if (o->eng.world < 2)
        return di_fail(err, DI_EINVAL, "--ep-addr: a rank group needs --world 2 or more");
    if (!o->ep_token)
        return di_fail(err, DI_EINVAL, "--ep-addr: the group token is missing: give "
                       "--ep-token-file FILE or $DI_EP_TOKEN");
    if (o->ep_listen_fd >= 0 && o->eng.rank != 0)
        return di_fail(err, DI_EINVAL, "--ep-listen-fd is rank 0's (this is rank %llu)",
                       (unsigned long long)o->eng.rank);
    if (o->ep_listen_fd >= 0 && o->ep_listen_fd < 3)
        return di_fail(err, DI_EINVAL, "--ep-listen-fd: %lld is a standard stream",
                       (long long)o->ep_listen_fd);
    if (o->ep_idle_ms * 2 > o->ep_timeout_ms)
        return di_fail(err, DI_EINVAL, "--ep-idle: %llu ms is more than half of --ep-timeout",
                       (unsigned long long)o->ep_idle_ms);
    return DI_OK;
}

static di_status start(void *ud, const svc_ctx *ctx, int *port, di_error *err)
{
    app *a = ud;
    eopts *o = &a->o;
    di_status st = svc_engine_check(&o->eng, err);
    if (st != DI_OK)
        return st;
    if (!o->eng.kvstore)
        return di_fail(err, DI_EINVAL, "--kvstore: required (the handoff goes through the "
                       "store)");
    if (o->chunk % 128)
        return di_fail(err, DI_EINVAL, "--chunk: %llu is not a multiple of 128",
                       (unsigned long long)o->chunk);
    if ((st = ep_check(o, err)) != DI_OK)
        return st;
    if ((st = ahead_check(o, NULL, err)) != DI_OK)
        return st;
    serve_backend_options bo = {.threads = (uint32_t)o->eng.threads};
    if ((st = serve_backend_open(o->eng.backend, &bo, &a->be, err)) != DI_OK) {
        di_error_prefix(err, "--backend %s: ", o->eng.backend);
        return st;
    }
    /* a rank of a group loads only its own slots' experts (docs/ep.md) */
    model_load_options lo = {0};
    ep_expert_filter ef = {.rank = (uint32_t)o->eng.rank, .world = (uint32_t)o->eng.world,
                           .min_redundant = (uint32_t)o->ep_redundant};
    if (o->ep_addr) {
        lo.keep_expert = ep_moe_keep_expert;
        lo.keep_expert_userdata = &ef;
    }
    serve_model_options mo = {.model_dir = o->eng.model_dir, .config = o->eng.config,
                              .weights_seed = o->eng.weights_seed, .load = &lo};
    if ((st = serve_model_open(&mo, &a->sm, err)) != DI_OK) {
        di_error_prefix(err, "%s: ", o->eng.model_dir ? "--model" : "--config");
        return st;
    }
    if ((st = ahead_check(o, &a->sm.rm.w->config, err)) != DI_OK)
        return st;
    const char *name = o->eng.model_dir ? o->eng.model_dir : o->eng.config;
    const char *slash = strrchr(name, '/');
    snprintf(a->model_name, sizeof a->model_name, "%s", slash && slash[1] ? slash + 1 : name);
    kvc_options ko;
    kvc_options_default(&ko);
    ko.target = o->eng.kvstore;
    ko.token = o->eng.kvstore_token;
    ko.deadline_ms = (uint32_t)o->kvstore_deadline_ms;
    ko.model_id = kv_model_id(a->sm.rm.w->config.model_id, KV_YOCO_DEFAULT); /* as engsvc runs */
    if ((st = kvc_open(&ko, &a->kv, err)) != DI_OK ||
        (st = kvc_open(&ko, &a->kv_load, err)) != DI_OK) {
        di_error_prefix(err, "--kvstore %s: ", o->eng.kvstore);
        return st;
    }
    engsvc_config ec = {.kind = a->kind, .rm = &a->sm.rm, .be = &a->be,
                        .model_name = a->model_name, .kv = a->kv, .kv_load = a->kv_load,
                        .kv_target = o->eng.kvstore,
                        .nextn = o->nextn == 16 ? UINT32_MAX : (uint32_t)o->nextn,
                        .chunk = (uint32_t)o->chunk, .max_seqs = (uint32_t)o->max_seqs,
                        .num_blocks = (uint32_t)o->blocks,
                        .max_waiting = (uint32_t)o->max_waiting, .rank = (uint32_t)o->eng.rank,
                        .world = (uint32_t)o->eng.world,
                        .ahead = o->ahead != 0, .overlap = o->overlap != 0,
                        .step_delay_ms = (uint32_t)o->step_delay_ms, .log = &ctx->log};
    engsvc_ep ep = {.addr = o->ep_addr, .listen_fd = (int)o->ep_listen_fd, .token = o->ep_token,
                    .timeout_ms = (uint32_t)o->ep_timeout_ms,
                    .allow_remote = o->ep_allow_remote != 0,
                    .redundant = (uint32_t)o->ep_redundant,
                    .eplb_interval = (uint32_t)o->eplb_interval,
                    .idle_ms = (uint32_t)o->ep_idle_ms};
    if (o->ep_addr) {
        ec.ep = &ep;
        di_log(&ctx->log, DI_LOG_INFO, "joining the rank group at %s as rank %llu of %llu",
               o->ep_addr, (unsigned long long)o->eng.rank, (unsigned long long)o->eng.world);
    }
    if ((st = engsvc_create(&ec, &a->svc, err)) != DI_OK)
        return st;
    size_t nm, na;
    const rpc_method *m = engsvc_methods(a->kind, &nm);
    const rpc_async_method *am = engsvc_async_methods(a->kind, &na);
    rpc_server_config sc = {.listen = o->base.listen, .methods = m, .n_methods = nm,
                            .async_methods = am, .n_async_methods = na, .svc = a->svc,
                            .threads = (unsigned)o->rpc_threads, .engine_token = o->eng.token,
                            .on_error = rpc_error, .on_error_ud = (void *)ctx};
    if ((st = rpc_server_start(&sc, &a->srv, port, err)) != DI_OK) {
        di_error_prefix(err, "--listen %s: ", o->base.listen);
        return st;
    }
    di_log(&ctx->log, DI_LOG_INFO, "serving %s on port %d (model %s, backend %s, rank %llu of "
           "%llu%s)", a->kind == ENGSVC_PREFILL ? "prefill" : "decode", *port, a->model_name,
           a->be.name, (unsigned long long)o->eng.rank, (unsigned long long)o->eng.world,
           o->ep_addr ? ", expert-parallel group" : "");
    return DI_OK;
}

static void drain(void *ud, const svc_ctx *ctx, uint64_t deadline_ns)
{
    app *a = ud;
    uint32_t left = engsvc_drain(a->svc, deadline_ns);
    if (left)
        di_log(&ctx->log, DI_LOG_WARN, "drain: %u requests ended with UNAVAILABLE at the "
               "deadline", left);
    a->srv = rpc_server_stop(a->srv, 1000);
}

static void stop(void *ud, const svc_ctx *ctx)
{
    (void)ctx;
    app *a = ud;
    a->srv = rpc_server_stop(a->srv, 0);
    engsvc_destroy(a->svc);
    a->svc = NULL;
    a->kv = kvc_close(a->kv);
    a->kv_load = kvc_close(a->kv_load);
    serve_model_close(&a->sm);
    serve_backend_close(&a->be);
}

/* --rank hostname (a StatefulSet pod): the number the host name ends in, put in argv's place
 * before the options are parsed. DI_OK; DI_EINVAL (no such number), DI_EIO. */
static di_status rank_from_hostname(int argc, char **argv, char *buf, size_t cap, di_error *err)
{
    for (int i = 1; i < argc; i++) {
        bool eq = !strcmp(argv[i], "--rank=hostname");
        if (!eq && !(!strcmp(argv[i], "--rank") && i + 1 < argc &&
                     !strcmp(argv[i + 1], "hostname")))
            continue;
        char host[256] = {0};
        if (gethostname(host, sizeof host - 1) != 0)
            return di_fail(err, DI_EIO, "--rank hostname: gethostname: %s", strerror(errno));
        uint32_t rank;
        di_status st = ep_rank_from_hostname(host, &rank, err);
        if (st != DI_OK) {
            di_error_prefix(err, "--rank hostname: ");
            return st;
        }
        snprintf(buf, cap, eq ? "--rank=%u" : "%u", rank);
        argv[eq ? i : i + 1] = buf;
    }
    return DI_OK;
}

int engsvc_program(engsvc_kind kind, int argc, char **argv)
{
    app a = {.kind = kind};
    char rank_buf[32];
    di_error err;
    if (rank_from_hostname(argc, argv, rank_buf, sizeof rank_buf, &err) != DI_OK) {
        fprintf(stderr, "%s: %s\n", kind == ENGSVC_PREFILL ? "di-prefill" : "di-decode",
                err.msg);
        return 2;
    }
    bool pre = kind == ENGSVC_PREFILL;
    if (pre && prefill_refuses_ahead(argc, argv, &err) != DI_OK) {
        fprintf(stderr, "di-prefill: %s\n", err.msg);
        return 2;
    }
    svc_spec spec = {
        .name = pre ? "di-prefill" : "di-decode",
        .summary = pre ? "The prefill service: Prefill(prompt) computes the prompt's KV, samples "
                         "the first token and leaves\nthe handoff for decode in the KV store; "
                         "GetLoad, Health, Abort."
                       : "The decode service: Decode(handoff) pulls a prefill's handoff from the "
                         "KV store and streams the\nrest of the output; GetLoad, Health, Abort.",
        .epilog = "With the same model flags it loads the same weights as di-generate. Without "
                  "--token-file it serves\nloopback only. SIGTERM drains: no new requests, the "
                  "work in flight finishes or fails by --drain.",
        .guard = "token-file",
        .rows = pre ? k_prefill_rows : k_decode_rows,
        .n_rows = pre ? sizeof k_prefill_rows / sizeof k_prefill_rows[0]
                      : sizeof k_decode_rows / sizeof k_decode_rows[0],
        .opts = &a.o,
        .base_offset = offsetof(eopts, base),
        .app = &a,
        .start = start,
        .drain = drain,
        .stop = stop,
    };
    return svc_main(&spec, argc, argv);
}
