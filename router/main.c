/* di-router: the OpenAI-compatible front end of the cluster (router/api.c over a backend).
 * Thin: the options table, then common/service's skeleton. --prefill and --decode repeat, so
 * they are taken out of argv here before the table parses the rest. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/service/service.h"
#include "common/tokenizer/tokenizer.h"
#include "common/util/clock.h"
#include "router/api.h"
#include "router/http.h"
#include "router/placement.h"
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
};

#define MAX_RANK_FLAGS 64

typedef struct router_app {
    router_opts o;
    const char *prefill[MAX_RANK_FLAGS];
    const char *decode[MAX_RANK_FLAGS];
    size_t n_prefill, n_decode;
    tok_tokenizer *tok;
    tb_backend *tb;
    api_ctx *api;
    http_server *http;
    pl_table placement;
} router_app;

static di_status router_start(void *app, const svc_ctx *ctx, int *port, di_error *err)
{
    router_app *a = app;
    router_opts *o = &a->o;
    if (!o->api_key_file && !svc_hostport_is_loopback(o->listen_http))
        return di_fail(err, DI_EINVAL, "--listen-http %s is not loopback: give --api-key-file",
                       o->listen_http);
    if (!o->test_backend)
        return di_fail(err, DI_EINVAL, "the prefill/decode client is not built yet; only "
                       "--test-backend can serve (for testing)");
    pl_config pc = pl_config_default();
    di_status st = pl_init(&a->placement, &pc,
                           strcmp(o->policy, "round-robin") == 0 ? PL_POLICY_ROUND_ROBIN
                                                                 : PL_POLICY_ESTIMATE,
                           &ctx->log, err);
    size_t idx;
    for (size_t i = 0; st == DI_OK && i < a->n_prefill; i++)
        st = pl_add(&a->placement, PL_PREFILL, a->prefill[i], false, di_mono_ns(), &idx, err);
    for (size_t i = 0; st == DI_OK && i < a->n_decode; i++)
        st = pl_add(&a->placement, PL_DECODE, a->decode[i], false, di_mono_ns(), &idx, err);
    if (st != DI_OK)
        return st;
    const char *tp = o->tokenizer ? o->tokenizer : tok_default_path();
    if (!tp)
        return di_fail(err, DI_EINVAL, "no tokenizer: give --tokenizer or set DI_TOKENIZER");
    if ((st = tok_load_file(tp, &a->tok, err)) != DI_OK) {
        di_error_prefix(err, "--tokenizer %s: ", tp);
        return st;
    }
    tb_config tc = {.delay_ms = (uint32_t)o->test_delay_ms, .first_id = 1000, .span = 20000,
                    .eos_id = tok_eos_id(a->tok), .eos_at = -1, .fail_at = -1};
    if ((st = tb_new(&tc, &a->tb, err)) != DI_OK)
        return st;
    api_config ac = {.tok = a->tok,
                     .backend = tb_backend_iface(a->tb),
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
    di_log(&ctx->log, DI_LOG_INFO, "serving the OpenAI API on %s (port %d), model %s, test "
           "backend", o->listen_http, *port, o->model);
    return DI_OK;
}

static void router_stop(void *app, const svc_ctx *ctx)
{
    router_app *a = app;
    (void)ctx;
    http_stop(a->http); /* ends every stream: their backend requests are aborted */
    tb_free(a->tb);
    api_free(a->api);
    tok_free(a->tok);
    a->http = NULL, a->tb = NULL, a->api = NULL, a->tok = NULL;
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
                   "/v1/chat/completions,\nGET /v1/models, GET /health, GET /metrics "
                   "(docs/router.md).",
        .epilog = "  --prefill HOST:PORT  a prefill rank (repeat for more)\n"
                  "  --decode HOST:PORT   a decode rank (repeat for more)\n\n"
                  "The prefill/decode client is not built yet: only --test-backend serves, "
                  "with deterministic\ntokens, for testing. --listen is reserved for the gRPC "
                  "API (Generate, Abort), not served\nyet; --port-file and --ready-fd announce "
                  "the HTTP port.",
        .guard = NULL,
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
