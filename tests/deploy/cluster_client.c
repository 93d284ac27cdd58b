/* cluster_client.c: the client side of the cluster tests (tests/deploy/test_cluster_pd.sh).
 *
 *   cluster-client load prefill|decode HOST:PORT
 *       one GetLoad of a rank (token: $DI_ENGINE_TOKEN); prints
 *       {"free_blocks","total_blocks","free_slots","total_slots","running","waiting"}
 *   cluster-client storm --http HOST:PORT --key-file F --grpc HOST:PORT --grpc-token-file F
 *                        [--requests N] [--concurrency C] [--max-tokens M] [--seed S]
 *       N streamed requests through the router (prompts of 8..200 random token ids,
 *       temperature 0.8, ignore_eos), each cancelled at a random point, four ways in turn:
 *       HTTP client disconnect after k events, HTTP disconnect after d < 800 ms, gRPC Abort after k
 *       tokens, gRPC client cancel after k tokens (k may pass the end: the request completes).
 *       Prints one JSON line of counts and the time taken; exits 1 when any request saw an
 *       error (an HTTP status other than 200, an error event, a gRPC status other than OK or
 *       CANCELLED, an Abort that failed).
 *   cluster-client generate --grpc HOST:PORT --grpc-token-file F --ids LIST --max-tokens N
 *                           --temperature T --top-p P --seed S [--logprobs K]
 *       one gRPC Generate (ignore_eos), one JSON line per message as it arrives:
 *       {"token":ID,"logprob":X,"top":{"ID":X,...}}, {"continued":{"from","to","after_tokens"}},
 *       and at the end {"finish":"LENGTH"|...,"instance":...} or {"error":"..."}
 *       (logprobs with 9 significant digits, as the router and di-generate print them).
 * Exit status: 0 done, 1 a failure, 2 bad usage.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "engine.pb-c.h"
#include "router.pb-c.h"
#include "common/net/rpc.h"
#include "common/util/clock.h"

#define MAX_REQUESTS 100000
#define MAX_THREADS 64
#define HTTP_IO_MS 120000 /* a stalled router fails the request after this long */

static int usage(const char *msg)
{
    fprintf(stderr, "cluster-client: %s (see --help)\n", msg);
    return 2;
}

static void help(void)
{
    puts("usage: cluster-client load prefill|decode HOST:PORT\n"
         "       cluster-client storm --http HOST:PORT --key-file F --grpc HOST:PORT\n"
         "                            --grpc-token-file F [--requests N] [--concurrency C]\n"
         "                            [--max-tokens M] [--seed S]\n"
         "       cluster-client generate --grpc HOST:PORT --grpc-token-file F --ids LIST\n"
         "                            --max-tokens N --temperature T --top-p P --seed S\n"
         "                            [--logprobs K]\n"
         "load: one GetLoad of a rank ($DI_ENGINE_TOKEN), as JSON.\n"
         "storm: N streamed requests through the router, each cancelled at a random point\n"
         "(HTTP disconnects and gRPC Abort/cancel in turn); one JSON line of counts.\n"
         "generate: one gRPC Generate, a JSON line per message as it arrives.");
}

/* ---- load ---- */

static int cmd_load(int argc, char **argv)
{
    if (argc != 2 || (strcmp(argv[0], "prefill") && strcmp(argv[0], "decode")))
        return usage("load wants prefill|decode and HOST:PORT");
    rpc_client_config cfg = {.target = argv[1], .token = getenv("DI_ENGINE_TOKEN")};
    rpc_client *c = NULL;
    di_error e = {0};
    uint8_t *rep = NULL;
    size_t n = 0;
    const char *m = argv[0][0] == 'p' ? "/di.prefill.Prefill/GetLoad" : "/di.decode.Decode/GetLoad";
    if (rpc_client_open(&cfg, &c, &e) != DI_OK || rpc_client_call(c, m, "", 0, 5000, &rep, &n, &e)) {
        fprintf(stderr, "cluster-client: GetLoad %s: %s\n", argv[1], e.msg);
        rpc_client_close(c);
        return 1;
    }
    rpc_client_close(c);
    Di__Engine__Load *l = di__engine__load__unpack(NULL, n, rep);
    free(rep);
    if (!l) {
        fprintf(stderr, "cluster-client: GetLoad %s: the reply does not parse\n", argv[1]);
        return 1;
    }
    printf("{\"free_blocks\":%u,\"total_blocks\":%u,\"free_slots\":%u,\"total_slots\":%u,"
           "\"running\":%u,\"waiting\":%u}\n",
           l->free_blocks, l->total_blocks, l->free_slots, l->total_slots, l->running, l->waiting);
    di__engine__load__free_unpacked(l, NULL);
    return 0;
}

/* ---- storm ---- */

typedef struct storm {
    int http_port;
    const char *key, *grpc, *grpc_token;
    uint32_t requests, concurrency, max_tokens;
    uint64_t seed;
    atomic_uint next;
    /* counts */
    atomic_uint http_events, http_time, grpc_abort, grpc_cancel, completed, errors;
    atomic_uint aborts_found;
    pthread_mutex_t log_mu;
} storm;

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void fail_req(storm *s, uint32_t i, const char *fmt, const char *detail)
{
    atomic_fetch_add(&s->errors, 1);
    pthread_mutex_lock(&s->log_mu);
    fprintf(stderr, "cluster-client: request %u: ", i);
    fprintf(stderr, fmt, detail);
    fputc('\n', stderr);
    pthread_mutex_unlock(&s->log_mu);
}

/* Prompt ids as "a,b,c" into buf (len ids in [1000, 50000)). */
static void prompt_ids(uint64_t *r, uint32_t len, char *buf, size_t cap, uint32_t *ids)
{
    size_t o = 0;
    for (uint32_t k = 0; k < len; k++) {
        ids[k] = 1000 + (uint32_t)(rng_next(r) % 49000);
        o += (size_t)snprintf(buf + o, cap - o, k ? ",%u" : "%u", ids[k]);
    }
}

static int count_events(const char *b, size_t n)
{
    int k = 0;
    for (const char *p = b; (p = memmem(p, n - (size_t)(p - b), "data: ", 6)) != NULL; p += 6)
        k++;
    return k;
}

/* One HTTP stream, closed after `events` events or `ms` milliseconds (whichever is set). */
static void http_one(storm *s, uint32_t i, const char *ids, uint64_t seed, int events, int ms)
{
    char *req = malloc(8192);
    size_t blen = 0;
    char *body = malloc(6144);
    if (!req || !body) {
        free(req), free(body);
        fail_req(s, i, "%s", "out of memory");
        return;
    }
    blen = (size_t)snprintf(body, 6144,
                            "{\"prompt\":[%s],\"max_tokens\":%u,\"temperature\":0.8,"
                            "\"seed\":%" PRIu64 ",\"ignore_eos\":true,\"stream\":true}",
                            ids, s->max_tokens, seed);
    int rl = snprintf(req, 8192,
                      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      "Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                      "Content-Length: %zu\r\nConnection: close\r\n\r\n%s",
                      s->key, blen, body);
    free(body);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)s->http_port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        write(fd, req, (size_t)rl) != rl) {
        fail_req(s, i, "connect/send: %s", strerror(errno));
        if (fd >= 0)
            close(fd);
        free(req);
        return;
    }
    free(req);
    char *buf = NULL;
    size_t n = 0, cap = 0;
    uint64_t t0 = di_mono_ns();
    bool eof = false;
    for (;;) {
        if (events >= 0 && count_events(buf ? buf : "", n) >= events)
            break;
        int wait = HTTP_IO_MS;
        if (ms >= 0) {
            int64_t left = ms - (int64_t)((di_mono_ns() - t0) / 1000000u);
            if (left <= 0)
                break;
            wait = (int)left;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int pr = poll(&p, 1, wait);
        if (pr == 0 && ms >= 0)
            continue;
        if (pr <= 0) {
            fail_req(s, i, "%s", "no answer from the router");
            break;
        }
        if (n + 4097 > cap) {
            cap = cap ? cap * 2 : 16384;
            buf = realloc(buf, cap);
        }
        ssize_t r = read(fd, buf + n, 4096);
        if (r <= 0) {
            eof = true;
            break;
        }
        n += (size_t)r;
        buf[n] = '\0';
    }
    close(fd);
    if (buf && n >= 12) {
        buf[n] = '\0';
        if (strncmp(buf, "HTTP/1.1 200", 12) != 0)
            fail_req(s, i, "HTTP status: %.60s", buf);
        else if (strstr(buf, "\"error\""))
            fail_req(s, i, "error event: %.300s", strstr(buf, "\"error\""));
        else if (eof && strstr(buf, "data: [DONE]"))
            atomic_fetch_add(&s->completed, 1);
    }
    free(buf);
}

/* The next message of a Generate stream, or NULL at its end (*fs: its final status, or
 * EPROTO for a message that does not parse). */
static Di__Router__GenerateReply *next_reply(rpc_stream *st, di_status *fs, di_error *e)
{
    uint8_t *m = NULL;
    size_t mn = 0;
    int done = 0;
    *fs = rpc_stream_read(st, &m, &mn, &done, e);
    if (done) {
        free(m);
        return NULL;
    }
    Di__Router__GenerateReply *r = di__router__generate_reply__unpack(NULL, mn, m);
    free(m);
    if (!r)
        *fs = di_fail(e, DI_EPROTO, "a GenerateReply does not parse");
    return r;
}

/* One gRPC stream: Abort (abort = true) or a client cancel after `tokens` tokens. */
static void grpc_one(storm *s, uint32_t i, rpc_client *c, rpc_client *ac, const uint32_t *ids,
                     uint32_t n_ids, uint64_t seed, int tokens, bool abort)
{
    Di__Router__GenerateRequest g = DI__ROUTER__GENERATE_REQUEST__INIT;
    g.prompt_ids = (uint32_t *)ids;
    g.n_prompt_ids = n_ids;
    g.max_tokens = s->max_tokens;
    g.temperature = 0.8f;
    g.has_temperature = 1;
    g.seed = seed;
    g.has_seed = 1;
    g.ignore_eos = 1;
    size_t len = di__router__generate_request__get_packed_size(&g);
    uint8_t *buf = malloc(len);
    if (!buf) {
        fail_req(s, i, "%s", "out of memory");
        return;
    }
    di__router__generate_request__pack(&g, buf);
    rpc_stream *st = NULL;
    di_error e = {0};
    if (rpc_stream_open(c, "/di.router.Router/Generate", buf, len, HTTP_IO_MS, &st, &e) != DI_OK) {
        free(buf);
        fail_req(s, i, "Generate: %s", e.msg);
        return;
    }
    free(buf);
    char rid[64] = "";
    int seen = 0;
    bool cancelled = false, finished = false;
    di_status fs = DI_OK;
    for (;;) {
        if (!cancelled && rid[0] && seen >= tokens) {
            cancelled = true;
            if (abort) {
                Di__Engine__AbortRequest ar = DI__ENGINE__ABORT_REQUEST__INIT;
                ar.request_id = rid;
                uint8_t ab[96];
                size_t al = di__engine__abort_request__pack(&ar, ab);
                uint8_t *rep = NULL;
                size_t rn = 0;
                di_error ae = {0};
                if (rpc_client_call(ac, "/di.router.Router/Abort", ab, al, 5000, &rep, &rn, &ae))
                    fail_req(s, i, "Abort: %s", ae.msg);
                Di__Engine__AbortReply *r = di__engine__abort_reply__unpack(NULL, rn, rep);
                if (r && r->found)
                    atomic_fetch_add(&s->aborts_found, 1);
                if (r)
                    di__engine__abort_reply__free_unpacked(r, NULL);
                free(rep);
            } else {
                rpc_stream_cancel(st);
            }
        }
        Di__Router__GenerateReply *r = next_reply(st, &fs, &e);
        if (!r)
            break;
        if (r->request_id && r->request_id[0])
            snprintf(rid, sizeof rid, "%s", r->request_id);
        if (r->token)
            seen++;
        if (r->finish != DI__ENGINE__FINISH__FINISH_NONE)
            finished = r->finish == DI__ENGINE__FINISH__FINISH_LENGTH;
        di__router__generate_reply__free_unpacked(r, NULL);
    }
    rpc_stream_close(st);
    if (fs != DI_OK && !(fs == DI_ECANCELED && cancelled && !abort))
        fail_req(s, i, "Generate ended with: %s", e.msg[0] ? e.msg : di_status_str(fs));
    else if (finished && fs == DI_OK)
        atomic_fetch_add(&s->completed, 1);
}

static void *storm_thread(void *arg)
{
    storm *s = arg;
    rpc_client_config cc = {.target = s->grpc, .token = s->grpc_token};
    rpc_client *c = NULL, *ac = NULL;
    di_error e = {0};
    if (rpc_client_open(&cc, &c, &e) != DI_OK || rpc_client_open(&cc, &ac, &e) != DI_OK) {
        fail_req(s, 0, "gRPC client: %s", e.msg);
        rpc_client_close(c);
        return NULL;
    }
    char *ids = malloc(4096);
    uint32_t idv[300];
    for (uint32_t i; ids && (i = atomic_fetch_add(&s->next, 1)) < s->requests;) {
        uint64_t r = s->seed * 1000003u + i;
        uint32_t len = 8 + (uint32_t)(rng_next(&r) % 193); /* a third over one block */
        prompt_ids(&r, len, ids, 4096, idv);
        uint64_t seed = rng_next(&r) >> 1;
        int k = (int)(rng_next(&r) % (s->max_tokens + 3)); /* past the end now and then */
        switch (i % 4) {
        case 0:
            atomic_fetch_add(&s->http_events, 1);
            http_one(s, i, ids, seed, k + 1, -1); /* k tokens, after the first event or so */
            break;
        case 1:
            atomic_fetch_add(&s->http_time, 1);
            http_one(s, i, ids, seed, -1, (int)(rng_next(&r) % 800));
            break;
        case 2:
            atomic_fetch_add(&s->grpc_abort, 1);
            grpc_one(s, i, c, ac, idv, len, seed, k, true);
            break;
        default:
            atomic_fetch_add(&s->grpc_cancel, 1);
            grpc_one(s, i, c, ac, idv, len, seed, k, false);
        }
    }
    free(ids);
    rpc_client_close(ac);
    rpc_client_close(c);
    return NULL;
}

static bool parse_u32(const char *v, uint32_t lo, uint32_t hi, uint32_t *out)
{
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi)
        return false;
    *out = (uint32_t)x;
    return true;
}

static char *read_token(const char *path)
{
    char *t = NULL;
    di_error e = {0};
    if (rpc_load_file(path, &t, &e) != DI_OK) {
        fprintf(stderr, "cluster-client: %s: %s\n", path, e.msg);
        return NULL;
    }
    size_t n = strlen(t);
    while (n && (t[n - 1] == '\n' || t[n - 1] == '\r' || t[n - 1] == ' '))
        t[--n] = '\0';
    return t;
}

static int cmd_storm(int argc, char **argv)
{
    storm s = {.requests = 200, .concurrency = 8, .max_tokens = 24, .seed = 1};
    const char *http = NULL, *keyf = NULL, *tokf = NULL;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint32_t x;
        if (!v)
            return usage("every storm option wants a value");
        i++;
        if (!strcmp(a, "--http"))
            http = v;
        else if (!strcmp(a, "--key-file"))
            keyf = v;
        else if (!strcmp(a, "--grpc"))
            s.grpc = v;
        else if (!strcmp(a, "--grpc-token-file"))
            tokf = v;
        else if (!strcmp(a, "--requests") && parse_u32(v, 1, MAX_REQUESTS, &s.requests))
            ;
        else if (!strcmp(a, "--concurrency") && parse_u32(v, 1, MAX_THREADS, &s.concurrency))
            ;
        else if (!strcmp(a, "--max-tokens") && parse_u32(v, 1, 4096, &s.max_tokens))
            ;
        else if (!strcmp(a, "--seed") && parse_u32(v, 0, UINT32_MAX, &x))
            s.seed = x;
        else
            return usage("storm: an unknown option or a value out of range");
    }
    const char *colon = http ? strrchr(http, ':') : NULL;
    uint32_t port = 0;
    if (!colon || !parse_u32(colon + 1, 1, 65535, &port) || !keyf || !s.grpc || !tokf)
        return usage("storm wants --http HOST:PORT, --key-file, --grpc and --grpc-token-file");
    s.http_port = (int)port;
    char *key = read_token(keyf), *tok = read_token(tokf);
    if (!key || !tok) {
        free(key), free(tok);
        return 1;
    }
    s.key = key;
    s.grpc_token = tok;
    pthread_mutex_init(&s.log_mu, NULL);
    pthread_t th[MAX_THREADS];
    uint64_t t0 = di_mono_ns();
    uint32_t started = 0;
    for (; started < s.concurrency; started++)
        if (pthread_create(&th[started], NULL, storm_thread, &s) != 0)
            break;
    for (uint32_t i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    double secs = (double)(di_mono_ns() - t0) * 1e-9;
    printf("{\"requests\":%u,\"concurrency\":%u,\"http_disconnect_events\":%u,"
           "\"http_disconnect_time\":%u,\"grpc_abort\":%u,\"grpc_cancel\":%u,"
           "\"aborts_found\":%u,\"completed\":%u,\"errors\":%u,\"seconds\":%.1f}\n",
           s.requests, started, s.http_events, s.http_time, s.grpc_abort, s.grpc_cancel,
           s.aborts_found, s.completed, s.errors, secs);
    pthread_mutex_destroy(&s.log_mu);
    free(key);
    free(tok);
    return s.errors || started == 0 ? 1 : 0;
}

/* ---- generate ---- */

static int cmd_generate(int argc, char **argv)
{
    const char *target = NULL, *tokf = NULL, *idl = NULL;
    uint32_t max = 0, lp = 0, seed = 0;
    float temp = 1, top_p = 1;
    for (int i = 0; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        char *end;
        if (!strcmp(a, "--grpc"))
            target = v;
        else if (!strcmp(a, "--grpc-token-file"))
            tokf = v;
        else if (!strcmp(a, "--ids"))
            idl = v;
        else if (!strcmp(a, "--max-tokens") && parse_u32(v, 1, 1u << 20, &max))
            ;
        else if (!strcmp(a, "--logprobs") && parse_u32(v, 0, 20, &lp))
            ;
        else if (!strcmp(a, "--seed") && parse_u32(v, 0, UINT32_MAX, &seed))
            ;
        else if (!strcmp(a, "--temperature") && (temp = strtof(v, &end), *end == '\0'))
            ;
        else if (!strcmp(a, "--top-p") && (top_p = strtof(v, &end), *end == '\0'))
            ;
        else
            return usage("generate: an unknown option or a bad value");
    }
    if (argc % 2 || !target || !tokf || !idl || !max)
        return usage("generate wants --grpc, --grpc-token-file, --ids and --max-tokens");
    size_t n = 1;
    for (const char *p = idl; *p; p++)
        n += *p == ',';
    uint32_t *ids = calloc(n, sizeof *ids);
    char *tok = read_token(tokf);
    if (!ids || !tok) {
        free(ids), free(tok);
        return 1;
    }
    const char *p = idl;
    for (size_t k = 0; k < n; k++) {
        char *end;
        ids[k] = (uint32_t)strtoul(p, &end, 10);
        if (end == p || (*end != ',' && *end != '\0')) {
            free(ids), free(tok);
            return usage("--ids: not a comma-separated list of token ids");
        }
        p = end + (*end == ',');
    }
    Di__Router__GenerateRequest g = DI__ROUTER__GENERATE_REQUEST__INIT;
    g.prompt_ids = ids;
    g.n_prompt_ids = n;
    g.max_tokens = max;
    g.temperature = temp;
    g.has_temperature = 1;
    g.top_p = top_p;
    g.seed = seed;
    g.has_seed = 1;
    g.top_logprobs = lp;
    g.ignore_eos = 1;
    size_t len = di__router__generate_request__get_packed_size(&g);
    uint8_t *buf = malloc(len);
    rpc_client_config cc = {.target = target, .token = tok};
    rpc_client *c = NULL;
    rpc_stream *st = NULL;
    di_error e = {0};
    di_status fs = DI_ENOMEM;
    if (buf) {
        di__router__generate_request__pack(&g, buf);
        fs = rpc_client_open(&cc, &c, &e);
        if (fs == DI_OK)
            fs = rpc_stream_open(c, "/di.router.Router/Generate", buf, len, HTTP_IO_MS, &st, &e);
    }
    free(buf);
    free(ids);
    for (; fs == DI_OK;) {
        Di__Router__GenerateReply *r = next_reply(st, &fs, &e);
        if (!r)
            break;
        if (r->token) {
            printf("{\"token\":%u,\"logprob\":%.9g,\"top\":{", r->token->id,
                   (double)r->token->logprob);
            for (size_t k = 0; k < r->token->n_top; k++)
                printf("%s\"%u\":%.9g", k ? "," : "", r->token->top[k]->id,
                       (double)r->token->top[k]->logprob);
            printf("}}\n");
        }
        if (r->continued)
            printf("{\"continued\":{\"from\":\"%s\",\"to\":\"%s\",\"after_tokens\":%u}}\n",
                   r->continued->from_instance, r->continued->to_instance,
                   r->continued->after_tokens);
        if (r->finish != DI__ENGINE__FINISH__FINISH_NONE)
            printf("{\"finish\":\"%s\",\"instance\":\"%s\"}\n",
                   r->finish == DI__ENGINE__FINISH__FINISH_LENGTH ? "LENGTH"
                   : r->finish == DI__ENGINE__FINISH__FINISH_STOP ? "STOP"
                                                                  : "ABORTED",
                   r->instance ? r->instance : "");
        fflush(stdout);
        di__router__generate_reply__free_unpacked(r, NULL);
    }
    if (fs != DI_OK) {
        /* the message as a JSON string: quotes and backslashes escaped */
        printf("{\"error\":\"");
        for (const char *q = e.msg[0] ? e.msg : di_status_str(fs); *q; q++)
            printf(*q == '"' || *q == '\\' ? "\\%c" : "%c", *q);
        printf("\"}\n");
    }
    rpc_stream_close(st);
    rpc_client_close(c);
    free(tok);
    return fs == DI_OK ? 0 : 1;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        help();
        return 0;
    }
    if (argc >= 2 && !strcmp(argv[1], "load"))
        return cmd_load(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "storm"))
        return cmd_storm(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "generate"))
        return cmd_generate(argc - 2, argv + 2);
    return usage("say load, storm or generate");
}
