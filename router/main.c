/* di-router: the OpenAI-compatible front end of the cluster (router/api.c) and its gRPC API
 * (router/grpc_api.c), both over one backend: the prefill/decode client (router/pd_backend.c)
 * on the ranks of --prefill/--decode and of RegisterRank, or --test-backend. Thin: the options
 * table, then common/service's skeleton. --prefill and --decode repeat, so they are taken out
 * of argv here before the table parses the rest. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/service/service.h"
#include "common/tokenizer/tokenizer.h"
#include "common/util/clock.h"
#include "router/api.h"
#include "router/grpc_api.h"
#include "router/http.h"
#include "router/pd_backend.h"
#include "router/ranks.h"
#include "router/testbackend.h"

typedef struct router_opts {
    svc_base_opts base;
    const char *listen_http;
    const char *api_key_file;
    uint64_t per_key_limit;
    uint64_t max_body;
    uint64_t max_depth;
    uint64_t max_prompt;
    uint64_t max_output;
    uint64_t max_connections;
    uint64_t idle_timeout_ms;
    uint64_t request_timeout_ms;
    const char *model;
    const char *tokenizer;
    const char *policy;
    const char *kvstore;
    int no_bos;
    int test_backend;
    uint64_t test_delay_ms;
    uint64_t test_cached;
    char *grpc_token;
    char *admin_token;
    char *engine_token;
    uint64_t heartbeat_ms;
    uint64_t prefill_timeout_ms;
    uint64_t grpc_threads;
} router_opts;

static const svc_opt rows[] = {
    SVC_BASE_ROWS(router_opts, base, "127.0.0.1:0", "30s"),
    {"listen-http", SVC_OPT_HOSTPORT, offsetof(router_opts, listen_http), "127.0.0.1:8000", 0, 0,
     "HOST:PORT", "OpenAI HTTP API address; a non-loopback one needs --api-key-file", NULL},
    {"api-key-file", SVC_OPT_FILE, offsetof(router_opts, api_key_file), NULL, 0, 0, "FILE",
     "client keys, one 'NAME TOKEN [read|generate]' a line; without it, no auth", NULL},
    {"per-key-limit", SVC_OPT_UINT, offsetof(router_opts, per_key_limit), "64", 1, 100000, "N",
     "requests in flight per key; more are refused with 429", NULL},
    {"max-body", SVC_OPT_SIZE, offsetof(router_opts, max_body), "1MiB", 1024, 67108864, "SIZE",
     "largest request body; larger is 413", NULL},
    {"max-json-depth", SVC_OPT_UINT, offsetof(router_opts, max_depth), "32", 2, 1000, "N",
     "deepest JSON nesting accepted", NULL},
    {"max-prompt-tokens", SVC_OPT_UINT, offsetof(router_opts, max_prompt), "65536", 1, 1048576,
     "N", "longest prompt, in tokens", NULL},
    {"max-output-tokens", SVC_OPT_UINT, offsetof(router_opts, max_output), "8192", 1, 1048576,
     "N", "most tokens one request may generate (and the default max_tokens)", NULL},
    {"max-connections", SVC_OPT_UINT, offsetof(router_opts, max_connections), "512", 1, 65536,
     "N", "open HTTP connections at most", NULL},
    {"idle-timeout", SVC_OPT_DURATION, offsetof(router_opts, idle_timeout_ms), "60s", 1000,
     3600000, "DURATION", "an idle HTTP connection is closed after this", NULL},
    {"request-timeout", SVC_OPT_DURATION, offsetof(router_opts, request_timeout_ms), "30m", 1000,
     86400000, "DURATION", "a request still running after this is aborted (504, or the "
     "stream ends)", NULL},
    {"model", SVC_OPT_STRING, offsetof(router_opts, model), "deepseek-v4.1", 0, 0, "NAME",
     "the model name served (requests naming another get 404)", NULL},
    {"tokenizer", SVC_OPT_FILE, offsetof(router_opts, tokenizer), NULL, 0, 0, "FILE",
     "tokenizer.json (default: $DI_TOKENIZER, then the one under data/tokenizer)", NULL},
    {"policy", SVC_OPT_CHOICE, offsetof(router_opts, policy), "estimate", 0, 0, "POLICY",
     "prefill and decode placement", "estimate|round-robin"},
    {"kvstore", SVC_OPT_HOSTPORT, offsetof(router_opts, kvstore), NULL, 0, 0, "HOST:PORT",
     "KV store asked how much of a prompt it holds", NULL},
    {"no-bos", SVC_OPT_FLAG, offsetof(router_opts, no_bos), NULL, 0, 0, NULL,
     "do not prepend BOS to completion text prompts (as di-generate --no-bos)", NULL},
    {"test-backend", SVC_OPT_FLAG, offsetof(router_opts, test_backend), NULL, 0, 0, NULL,
     "TESTING ONLY: answer from an in-process backend of deterministic tokens", NULL},
    {"test-delay", SVC_OPT_DURATION, offsetof(router_opts, test_delay_ms), "0", 0, 60000,
     "DURATION", "with --test-backend: time per token", NULL},
    {"test-cached", SVC_OPT_UINT, offsetof(router_opts, test_cached), "0", 0, 1048576, "N",
     "with --test-backend: prompt tokens each request reports as served from the KV store "
     "(at most its prompt)", NULL},
    {"token-file", SVC_OPT_SECRET, offsetof(router_opts, grpc_token), NULL, 0, 0, "FILE",
     "bearer token gRPC clients of Generate/Abort must present; needed for a non-loopback "
     "--listen", "DI_ROUTER_TOKEN"},
    {"admin-token-file", SVC_OPT_SECRET, offsetof(router_opts, admin_token), NULL, 0, 0, "FILE",
     "bearer token of RegisterRank (ranks announcing themselves); without it RegisterRank is "
     "open only when no --token-file is set", "DI_ROUTER_ADMIN_TOKEN"},
    {"engine-token-file", SVC_OPT_SECRET, offsetof(router_opts, engine_token), NULL, 0, 0,
     "FILE", "bearer token the prefill/decode ranks and the KV store want", "DI_ENGINE_TOKEN"},
    {"heartbeat", SVC_OPT_DURATION, offsetof(router_opts, heartbeat_ms), "1s", 10, 60000,
     "DURATION", "interval of the GetLoad polls that are each rank's heartbeat", NULL},
    {"prefill-timeout", SVC_OPT_DURATION, offsetof(router_opts, prefill_timeout_ms), "120s",
     100, 3600000, "DURATION", "deadline of one Prefill call (a failure is retried once on "
     "another rank)", NULL},
    {"grpc-threads", SVC_OPT_UINT, offsetof(router_opts, grpc_threads), "4", 1, 64, "N",
     "worker threads of the gRPC API", NULL},
};

#define MAX_RANK_FLAGS 64

typedef struct router_app {
    router_opts o;
    const char *prefill[MAX_RANK_FLAGS];
    const char *decode[MAX_RANK_FLAGS];
    size_t n_prefill, n_decode;
    tok_tokenizer *tok;
    tb_backend *tb;
    rk_table *ranks;
    kvc_client *store;
    pd_backend *pd;
    api_ctx *api;
    http_server *http;
    gapi_server *grpc;
} router_app;

/* RegisterRank: a rank joins the table the flags fill. */
static di_status on_register(void *ud, int role, const char *addr, uint32_t *heartbeat_ms,
                             uint32_t *ranks, di_error *err)
{
    router_app *a = ud;
    if (!a->ranks)
        return di_fail(err, DI_EUNSUPPORTED, "this router serves --test-backend: no ranks");
    *heartbeat_ms = (uint32_t)a->o.heartbeat_ms;
    return rk_add(a->ranks, role == 0 ? PL_PREFILL : PL_DECODE, addr, true, ranks, err);
}

/* The prefill/decode client: ranks from the flags, the store when given. */
static di_status start_pd(router_app *a, const svc_ctx *ctx, rt_backend *out, di_error *err)
{
    router_opts *o = &a->o;
    if ((a->n_prefill == 0 || a->n_decode == 0) && !o->admin_token)
        return di_fail(err, DI_EINVAL, "give --prefill and --decode ranks, or "
                       "--admin-token-file for ranks that register (or --test-backend)");
    rk_config rc = {.placement = pl_config_default(),
                    .policy = strcmp(o->policy, "round-robin") == 0 ? PL_POLICY_ROUND_ROBIN
                                                                    : PL_POLICY_ESTIMATE,
                    .engine_token = o->engine_token, .log = &ctx->log};
    rc.placement.heartbeat_ns = o->heartbeat_ms * 1000000ull;
    di_status st = rk_new(&rc, &a->ranks, err);
    for (size_t i = 0; st == DI_OK && i < a->n_prefill; i++)
        st = rk_add(a->ranks, PL_PREFILL, a->prefill[i], false, NULL, err);
    for (size_t i = 0; st == DI_OK && i < a->n_decode; i++)
        st = rk_add(a->ranks, PL_DECODE, a->decode[i], false, NULL, err);
    if (st == DI_OK)
        rk_poll_once(a->ranks); /* loads before the first request */
    if (st == DI_OK && o->kvstore) {
        kvc_options ko;
        kvc_options_default(&ko);
        ko.target = o->kvstore;
        ko.token = o->engine_token;
        ko.log = &ctx->log;
        st = kvc_open(&ko, &a->store, err);
    }
    pd_config pc = {.ranks = a->ranks, .store = a->store,
                    .prefill_timeout_ms = (uint32_t)o->prefill_timeout_ms,
                    .decode_timeout_ms = (uint32_t)o->request_timeout_ms, .block_tokens = 128,
                    .log = &ctx->log};
    if (st == DI_OK && (st = pd_new(&pc, &a->pd, err)) == DI_OK)
        *out = pd_backend_iface(a->pd);
    return st;
}

static di_status router_start(void *app, const svc_ctx *ctx, int *port, di_error *err)
{
    router_app *a = app;
    router_opts *o = &a->o;
    if (!o->api_key_file && !svc_hostport_is_loopback(o->listen_http))
        return di_fail(err, DI_EINVAL, "--listen-http %s is not loopback: give --api-key-file",
                       o->listen_http);
    const char *tp = o->tokenizer ? o->tokenizer : tok_default_path();
    di_status st;
    if (!tp)
        return di_fail(err, DI_EINVAL, "no tokenizer: give --tokenizer or set DI_TOKENIZER");
    if ((st = tok_load_file(tp, &a->tok, err)) != DI_OK) {
        di_error_prefix(err, "--tokenizer %s: ", tp);
        return st;
    }
    rt_backend be;
    if (o->test_backend) {
        tb_config tc = {.delay_ms = (uint32_t)o->test_delay_ms, .first_id = 1000,
                        .span = 20000, .eos_id = tok_eos_id(a->tok), .eos_at = -1,
                        .fail_at = -1, .cached_tokens = (uint32_t)o->test_cached};
        if ((st = tb_new(&tc, &a->tb, err)) != DI_OK)
            return st;
        be = tb_backend_iface(a->tb);
    } else if ((st = start_pd(a, ctx, &be, err)) != DI_OK) {
        return st;
    }
    api_config ac = {.tok = a->tok,
                     .backend = be,
                     .limits = {.max_body_bytes = o->max_body,
                                .max_depth = (int)o->max_depth,
                                .max_prompt_tokens = (uint32_t)o->max_prompt,
                                .max_output_tokens = (uint32_t)o->max_output,
                                .vocab_size = tok_vocab_size(a->tok),
                                .model = o->model},
                     .add_bos = !o->no_bos,
                     .request_timeout_ms = o->request_timeout_ms};
    if ((st = api_new(&ac, &a->api, err)) != DI_OK)
        return st;
    size_t n;
    const http_route *routes = api_routes(&n);
    http_config hc = {.listen = o->listen_http, .routes = routes, .n_routes = n, .app = a->api,
                      .max_body_bytes = o->max_body, .per_key_limit = (uint32_t)o->per_key_limit,
                      .max_connections = (uint32_t)o->max_connections,
                      .idle_timeout_s = (uint32_t)(o->idle_timeout_ms / 1000),
                      .api_key_file = o->api_key_file};
    if ((st = http_start(&hc, &a->http, port, err)) != DI_OK)
        return st;
    gapi_config gc = {.listen = o->base.listen, .tok = a->tok, .backend = be,
                      .limits = ac.limits, .add_bos = ac.add_bos,
                      .request_timeout_ms = (uint32_t)o->request_timeout_ms,
                      .token = o->grpc_token, .admin_token = o->admin_token,
                      .on_register = on_register, .register_ud = a,
                      .threads = (unsigned)o->grpc_threads, .log = &ctx->log};
    int gport = 0;
    if ((st = gapi_start(&gc, &a->grpc, &gport, err)) != DI_OK) {
        di_error_prefix(err, "--listen %s: ", o->base.listen);
        return st;
    }
    di_log(&ctx->log, DI_LOG_INFO, "serving the OpenAI API on %s (port %d) and the gRPC API "
           "on %s (port %d), model %s, %s", o->listen_http, *port, o->base.listen, gport,
           o->model, o->test_backend ? "test backend" : "prefill/decode ranks");
    return DI_OK;
}

static void router_stop(void *app, const svc_ctx *ctx)
{
    router_app *a = app;
    (void)ctx;
    http_stop(a->http); /* ends every stream: their backend requests are aborted */
    gapi_stop(a->grpc, 0);
    tb_free(a->tb);
    pd_free(a->pd);
    kvc_close(a->store);
    rk_free(a->ranks);
    api_free(a->api);
    tok_free(a->tok);
    a->http = NULL, a->grpc = NULL, a->tb = NULL, a->pd = NULL, a->store = NULL;
    a->ranks = NULL, a->api = NULL, a->tok = NULL;
}

/* Takes every "--prefill X" / "--decode X" (or =X) out of argv into the app. Returns the new
 * argc, or -1 after printing a usage error. */
static int take_rank_flags(router_app *a, int argc, char **argv)
{
    int w = 1;
    for (int i = 1; i < argc; i++) {
        const char *names[2] = {"--prefill", "--decode"};
        int hit = -1;
        const char *val = NULL;
        for (int k = 0; k < 2 && hit < 0; k++) {
            size_t n = strlen(names[k]);
            if (strcmp(argv[i], names[k]) == 0) {
                hit = k;
                val = i + 1 < argc ? argv[++i] : NULL;
            } else if (strncmp(argv[i], names[k], n) == 0 && argv[i][n] == '=') {
                hit = k;
                val = argv[i] + n + 1;
            }
        }
        if (hit < 0) {
            argv[w++] = argv[i];
            continue;
        }
        char host[256];
        int port;
        di_error e = {0};
        if (!val || svc_parse_hostport(val, host, sizeof host, &port, &e) != DI_OK || port == 0) {
            fprintf(stderr, "di-router: %s: want HOST:PORT with a port 1..65535%s%s\n",
                    hit ? "--decode" : "--prefill", e.msg[0] ? ": " : "", e.msg);
            return -1;
        }
        size_t *cnt = hit ? &a->n_decode : &a->n_prefill;
        if (*cnt == MAX_RANK_FLAGS) {
            fprintf(stderr, "di-router: more than %d %s ranks\n", MAX_RANK_FLAGS,
                    hit ? "decode" : "prefill");
            return -1;
        }
        (hit ? a->decode : a->prefill)[(*cnt)++] = val;
    }
    argv[w] = NULL;
    return w;
}

int main(int argc, char **argv)
{
    static router_app app;
    int n = take_rank_flags(&app, argc, argv);
    if (n < 0)
        return 2;
    svc_spec spec = {
        .name = "di-router",
        .summary = "The OpenAI-compatible front end: POST /v1/completions, POST "
                   "/v1/chat/completions,\nGET /v1/models, GET /health, GET /metrics on "
                   "--listen-http, and the gRPC API\n(di.router.Router: Generate, Abort, "
                   "RegisterRank) on --listen (docs/router.md).",
        .epilog = "  --prefill HOST:PORT  a prefill rank (repeat for more)\n"
                  "  --decode HOST:PORT   a decode rank (repeat for more)\n\n"
                  "Requests are served by the prefill and decode ranks given here or "
                  "registered through\nRegisterRank (with --admin-token-file), "
                  "polled with GetLoad every --heartbeat;\n--test-backend serves "
                  "deterministic tokens instead, for testing. --port-file and\n--ready-fd "
                  "announce the HTTP port; the gRPC port is logged.",
        .guard = "token-file",
        .rows = rows,
        .n_rows = sizeof rows / sizeof rows[0],
        .opts = &app.o,
        .base_offset = offsetof(router_opts, base),
        .app = &app,
        .start = router_start,
        .stop = router_stop,
    };
    return svc_main(&spec, n, argv);
}
