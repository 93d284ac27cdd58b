/* The router's HTTP front end end to end on loopback with a real socket: routes, errors, keys,
 * limits, whole and streamed answers, stop strings, backend failures and client disconnect,
 * over the in-process test backend. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "router/api.h"
#include "router/testbackend.h"

#define KEY_GEN "sk-test-generate-0123456789"
#define KEY_READ "sk-test-readonly-0123456789"

typedef struct fixture {
    tok_tokenizer *tok;
    tb_backend *tb;
    tb_config tbc;
    api_ctx *api;
    http_server *srv;
    int port;
    char keyfile[64];
} fixture;

static fixture F;

static uint64_t request_timeout_ms; /* for the next start() */

static void start(const tb_config *tbc, bool keys, uint32_t per_key)
{
    memset(&F, 0, sizeof F);
    const char *path = tok_default_path();
    cr_assert_not_null(path, "no tokenizer (data/tokenizer)");
    di_error e = {0};
    cr_assert_eq(tok_load_file(path, &F.tok, &e), DI_OK, "%s", e.msg);
    F.tbc = *tbc;
    cr_assert_eq(tb_new(tbc, &F.tb, &e), DI_OK, "%s", e.msg);
    api_config ac = {.tok = F.tok,
                     .backend = tb_backend_iface(F.tb),
                     .limits = {.max_body_bytes = 65536, .max_depth = 16,
                                .max_prompt_tokens = 512, .max_output_tokens = 2048,
                                .vocab_size = tok_vocab_size(F.tok), .model = "dsv4-test"},
                     .add_bos = true,
                     .request_timeout_ms = request_timeout_ms};
    cr_assert_eq(api_new(&ac, &F.api, &e), DI_OK, "%s", e.msg);
    if (keys) {
        snprintf(F.keyfile, sizeof F.keyfile, "/tmp/di-router-keys-XXXXXX");
        int fd = mkstemp(F.keyfile);
        cr_assert_geq(fd, 0);
        dprintf(fd, "# name token scope\nalice " KEY_GEN "\nprom " KEY_READ " read\n");
        close(fd);
    }
    size_t n;
    const http_route *routes = api_routes(&n);
    http_config hc = {.listen = "127.0.0.1:0", .routes = routes, .n_routes = n, .app = F.api,
                      .max_body_bytes = 65536, .per_key_limit = per_key,
                      .max_connections = 64, .idle_timeout_s = 30,
                      .api_key_file = keys ? F.keyfile : NULL};
    cr_assert_eq(http_start(&hc, &F.srv, &F.port, &e), DI_OK, "%s", e.msg);
    cr_assert_gt(F.port, 0);
}

static void stop(void)
{
    http_stop(F.srv);
    tb_free(F.tb);
    api_free(F.api);
    tok_free(F.tok);
    if (F.keyfile[0])
        unlink(F.keyfile);
}

static tb_config fast(void)
{
    return (tb_config){.delay_ms = 0, .first_id = 1000, .span = 20000, .eos_id = 1,
                       .eos_at = -1, .fail_at = -1, .cached_tokens = 3};
}

/* ---- a tiny HTTP/1.1 client ---------------------------------------------------------------- */

static int dial(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)F.port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

static void send_req(int fd, const char *method, const char *path, const char *ctype,
                     const char *auth, const char *body)
{
    char head[1024];
    int n = snprintf(head, sizeof head,
                     "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%s%s%s%s%s%s"
                     "Content-Length: %zu\r\n\r\n",
                     method, path, ctype ? "Content-Type: " : "", ctype ? ctype : "",
                     ctype ? "\r\n" : "", auth ? "Authorization: Bearer " : "",
                     auth ? auth : "", auth ? "\r\n" : "", body ? strlen(body) : 0);
    cr_assert_eq(write(fd, head, (size_t)n), n);
    if (body && *body)
        cr_assert_eq(write(fd, body, strlen(body)), (ssize_t)strlen(body));
}

typedef struct resp {
    int status;
    char head[2048];
    char *body; /* de-chunked, NUL-terminated */
    size_t len;
} resp;

static resp read_resp(int fd)
{
    size_t cap = 1 << 16, n = 0;
    char *raw = malloc(cap);
    ssize_t k;
    while ((k = read(fd, raw + n, cap - n - 1)) > 0) {
        n += (size_t)k;
        if (n + 1 == cap)
            raw = realloc(raw, cap *= 2);
    }
    raw[n] = '\0';
    close(fd);
    resp r = {0};
    char *eoh = strstr(raw, "\r\n\r\n");
    cr_assert_not_null(eoh, "no response head in %zu bytes", n);
    size_t hl = (size_t)(eoh - raw);
    snprintf(r.head, sizeof r.head, "%.*s", (int)hl, raw);
    sscanf(raw, "HTTP/1.%*d %d", &r.status);
    char *b = eoh + 4;
    r.body = malloc(n + 1);
    if (strcasestr(r.head, "Transfer-Encoding: chunked")) {
        for (;;) {
            size_t cl = strtoul(b, &b, 16);
            b = strstr(b, "\r\n");
            if (!b || cl == 0)
                break;
            b += 2;
            memcpy(r.body + r.len, b, cl);
            r.len += cl;
            b += cl + 2;
        }
    } else {
        r.len = n - (size_t)(b - raw);
        memcpy(r.body, b, r.len);
    }
    r.body[r.len] = '\0';
    free(raw);
    return r;
}

static resp call(const char *method, const char *path, const char *ctype, const char *auth,
                 const char *body)
{
    int fd = dial();
    send_req(fd, method, path, ctype, auth, body);
    return read_resp(fd);
}

static resp post(const char *path, const char *body)
{
    return call("POST", path, "application/json", NULL, body);
}

static json_t *body_json(const resp *r)
{
    json_t *o = json_loads(r->body, 0, NULL);
    cr_assert_not_null(o, "not JSON: %s", r->body);
    return o;
}

static void expect_error(resp r, int status, const char *type)
{
    cr_expect_eq(r.status, status, "status %d, want %d: %s", r.status, status, r.body);
    json_t *o = body_json(&r);
    json_t *e = json_object_get(o, "error");
    cr_expect(json_is_string(json_object_get(e, "message")), "%s", r.body);
    cr_expect_str_eq(json_string_value(json_object_get(e, "type")), type, "%s", r.body);
    json_decref(o);
    free(r.body);
}

static void expect_healthy(void)
{
    resp r = call("GET", "/health", NULL, NULL, NULL);
    cr_assert_eq(r.status, 200, "the server stopped serving: %d", r.status);
    free(r.body);
}

/* The text the test backend's first n tokens decode to, for this prompt. */
static char *expected_text(const tok_ids *prompt, uint64_t seed, uint32_t n)
{
    int32_t *ids = malloc(n * sizeof *ids);
    for (uint32_t i = 0; i < n; i++)
        ids[i] = tb_token(&F.tbc, seed, prompt->v, prompt->n, i);
    char *s;
    size_t len;
    cr_assert_eq(tok_decode(F.tok, ids, n, TOK_DECODE_SKIP_SPECIAL, &s, &len, NULL), DI_OK);
    free(ids);
    return s;
}

static tok_ids prompt_ids(const char *text)
{
    tok_ids ids = {0};
    tok_ids_push(&ids, tok_bos_id(F.tok), NULL);
    cr_assert_eq(tok_encode(F.tok, text, strlen(text), &ids, NULL), DI_OK);
    return ids;
}

/* Parses the SSE body: concatenates text deltas, counts events, keeps the last JSON event. */
typedef struct sse {
    char text[65536];
    int n_events, done, n_usage, n_error;
    char finish[16];
    json_t *usage;
} sse;

static sse parse_sse(const char *body, bool chat)
{
    sse s = {0};
    const char *p = body;
    while ((p = strstr(p, "data: ")) != NULL) {
        p += 6;
        const char *end = strstr(p, "\n\n");
        cr_assert_not_null(end, "event without its blank line");
        if (strncmp(p, "[DONE]", 6) == 0) {
            s.done++;
            p = end;
            continue;
        }
        cr_expect_eq(s.done, 0, "an event after [DONE]");
        json_t *o = json_loadb(p, (size_t)(end - p), 0, NULL);
        cr_assert_not_null(o, "event not JSON: %.*s", (int)(end - p), p);
        s.n_events++;
        if (json_object_get(o, "error"))
            s.n_error++;
        json_t *u = json_object_get(o, "usage");
        if (json_is_object(u)) {
            s.n_usage++;
            s.usage = json_incref(u);
        }
        json_t *c = json_array_get(json_object_get(o, "choices"), 0);
        if (c) {
            json_t *t = chat ? json_object_get(json_object_get(c, "delta"), "content")
                             : json_object_get(c, "text");
            if (json_is_string(t))
                strncat(s.text, json_string_value(t), sizeof s.text - strlen(s.text) - 1);
            json_t *f = json_object_get(c, "finish_reason");
            if (json_is_string(f))
                snprintf(s.finish, sizeof s.finish, "%s", json_string_value(f));
        }
        json_decref(o);
        p = end;
    }
    return s;
}

/* ---- tests ------------------------------------------------------------------------------- */

Test(http, every_bad_request_is_a_4xx_and_serving_goes_on, .timeout = 60)
{
    tb_config c = fast();
    start(&c, false, 0);
    expect_error(call("GET", "/nope", NULL, NULL, NULL), 404, "invalid_request_error");
    resp r = call("GET", "/v1/completions", NULL, NULL, NULL);
    cr_expect(strcasestr(r.head, "Allow: POST") != NULL, "%s", r.head);
    expect_error(r, 405, "invalid_request_error");
    expect_error(call("DELETE", "/health", NULL, NULL, NULL), 405, "invalid_request_error");
    expect_error(call("POST", "/v1/completions", "text/plain", NULL, "{\"prompt\":\"a\"}"),
                 415, "invalid_request_error");
    expect_error(call("POST", "/v1/completions", NULL, NULL, "{\"prompt\":\"a\"}"), 415,
                 "invalid_request_error");
    expect_error(post("/v1/completions", "{\"prompt\":"), 400, "invalid_request_error");
    expect_error(post("/v1/completions", "{\"prompt\":\"a\",\"n\":3}"), 400,
                 "invalid_request_error");
    expect_error(post("/v1/completions", "{\"prompt\":[1,99999999]}"), 400,
                 "invalid_request_error");
    expect_error(post("/v1/completions", "{\"prompt\":\"\xff\"}"), 400, "invalid_request_error");
    expect_error(post("/v1/chat/completions", "{\"messages\":[{\"role\":\"x\"}]}"), 400,
                 "invalid_request_error");
    /* Over the body limit: by Content-Length, before any body is read. */
    char *big = malloc(70000);
    memset(big, 'a', 69999);
    big[69999] = '\0';
    memcpy(big, "{\"prompt\":\"", 11);
    expect_error(post("/v1/completions", big), 413, "invalid_request_error");
    free(big);
    int fd;
    /* Over the limit without a Content-Length (chunked upload): noticed as it arrives. */
    fd = dial();
    const char *h = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
    cr_assert_eq(write(fd, h, strlen(h)), (ssize_t)strlen(h));
    char chunk[8200];
    memset(chunk, ' ', sizeof chunk);
    memcpy(chunk, "2000\r\n", 6);
    memcpy(chunk + 6 + 0x2000, "\r\n", 2);
    for (int i = 0; i < 9; i++) /* 9 x 8 KiB > 64 KiB */
        if (write(fd, chunk, 6 + 0x2000 + 2) < 0)
            break;
    if (write(fd, "0\r\n\r\n", 5) < 0) {
    }
    expect_error(read_resp(fd), 413, "invalid_request_error");
    /* Nested too deep. */
    expect_error(post("/v1/completions", "{\"prompt\":\"a\",\"x\":[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}"),
                 400, "invalid_request_error");
    /* Garbage instead of HTTP: the server answers or closes, and serves the next client. */
    fd = dial();
    cr_assert_eq(write(fd, "\x16\x03\x01garbage\r\n\r\n", 14), 14);
    char buf[512];
    while (read(fd, buf, sizeof buf) > 0) {
    }
    close(fd);
    expect_healthy();
    stop();
}

Test(http, keys_scopes_and_concurrency_limit, .timeout = 60)
{
    tb_config c = fast();
    c.delay_ms = 20;
    start(&c, true, 1);
    const char *body = "{\"prompt\":\"Hi\",\"max_tokens\":2}";
    expect_error(call("POST", "/v1/completions", "application/json", NULL, body), 401,
                 "authentication_error");
    expect_error(call("POST", "/v1/completions", "application/json", "sk-wrong-wrong-wrong-1",
                      body),
                 401, "authentication_error");
    expect_error(call("POST", "/v1/completions", "application/json", KEY_READ, body), 403,
                 "permission_error");
    resp r = call("GET", "/v1/models", NULL, KEY_READ, NULL);
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect(strstr(r.body, "dsv4-test") != NULL);
    free(r.body);
    expect_healthy(); /* health needs no key */

    /* One slow stream holds alice's only slot: a second request of hers is 429. */
    int fd = dial();
    send_req(fd, "POST", "/v1/completions", "application/json", KEY_GEN,
             "{\"prompt\":\"Hi\",\"max_tokens\":100,\"stream\":true}");
    char buf[64];
    cr_assert_gt(read(fd, buf, sizeof buf), 0); /* the stream has started */
    expect_error(call("POST", "/v1/completions", "application/json", KEY_GEN, body), 429,
                 "rate_limit_error");
    resp s = read_resp(fd);
    free(s.body);
    r = call("POST", "/v1/completions", "application/json", KEY_GEN, body);
    cr_expect_eq(r.status, 200, "the slot was not given back: %s", r.body);
    free(r.body);
    stop();
}

Test(http, completion_whole_and_streamed_agree, .timeout = 60)
{
    tb_config c = fast();
    start(&c, false, 0);
    const char *prompt = "The quick brown fox";
    tok_ids ids = prompt_ids(prompt);
    char *want = expected_text(&ids, 42, 12);

    resp r = post("/v1/completions",
                  "{\"prompt\":\"The quick brown fox\",\"max_tokens\":12,\"seed\":42,"
                  "\"logprobs\":2}");
    cr_assert_eq(r.status, 200, "%s", r.body);
    json_t *o = body_json(&r);
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    cr_expect_str_eq(json_string_value(json_object_get(ch, "text")), want);
    cr_expect_str_eq(json_string_value(json_object_get(ch, "finish_reason")), "length");
    json_t *lp = json_object_get(json_object_get(ch, "logprobs"), "token_logprobs");
    cr_assert_eq(json_array_size(lp), 12);
    cr_expect((float)json_real_value(json_array_get(lp, 4)) == -5.0f / 1024.0f);
    json_t *u = json_object_get(o, "usage");
    cr_expect_eq(json_integer_value(json_object_get(u, "prompt_tokens")), (json_int_t)ids.n);
    cr_expect_eq(json_integer_value(json_object_get(u, "completion_tokens")), 12);
    cr_expect_eq(json_integer_value(
                     json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens")),
                 3);
    json_decref(o);
    free(r.body);

    r = post("/v1/completions",
             "{\"prompt\":\"The quick brown fox\",\"max_tokens\":12,\"seed\":42,\"stream\":true,"
             "\"stream_options\":{\"include_usage\":true}}");
    cr_assert_eq(r.status, 200, "%s", r.body);
    cr_expect(strcasestr(r.head, "Content-Type: text/event-stream") != NULL, "%s", r.head);
    sse s = parse_sse(r.body, false);
    cr_expect_str_eq(s.text, want);
    cr_expect_eq(s.done, 1);
    cr_expect_eq(s.n_usage, 1);
    cr_expect_str_eq(s.finish, "length");
    cr_expect_eq(json_integer_value(json_object_get(s.usage, "completion_tokens")), 12);
    json_decref(s.usage);
    free(r.body);

    /* Both requests show in /metrics, per instance and in total. */
    r = call("GET", "/metrics", NULL, NULL, NULL);
    cr_assert_eq(r.status, 200);
    cr_expect(strcasestr(r.head, "Content-Type: text/plain") != NULL, "%s", r.head);
    cr_expect(strstr(r.body, "vllm:generation_tokens_total{model_name=\"dsv4-test\"} 24\n") !=
                  NULL, "%s", r.body);
    cr_expect(strstr(r.body, "vllm:generation_tokens_total{model_name=\"dsv4-test\","
                             "rank=\"test:0\"} 24\n") != NULL, "%s", r.body);
    cr_expect(strstr(r.body, "vllm:prefix_cache_hits_total{model_name=\"dsv4-test\"} 6\n") !=
              NULL);
    cr_expect(strstr(r.body, "vllm:time_to_first_token_seconds_count{model_name=\"dsv4-test\"} "
                             "2\n") != NULL);
    cr_expect(strstr(r.body, "vllm:num_requests_running{model_name=\"dsv4-test\"} 0\n") != NULL);
    free(r.body);
    free(want);
    tok_ids_free(&ids);
    stop();
}

Test(http, chat_stream_and_stop_string, .timeout = 60)
{
    tb_config c = fast();
    start(&c, false, 0);
    /* The chat prompt the router renders. */
    json_t *msgs = json_loads("[{\"role\":\"user\",\"content\":\"Hello\"}]", 0, NULL);
    tok_ids ids = {0};
    cr_assert_eq(tok_chat_encode_json(F.tok, msgs, true, &ids, NULL), DI_OK);
    json_decref(msgs);
    char *want = expected_text(&ids, 7, 40);
    size_t wl = strlen(want);
    cr_assert_gt(wl, 20);
    /* A stop string from the middle of the output: the text ends right before it. */
    char stop_s[4] = "";
    for (size_t at = wl / 2; at + 3 <= wl && !stop_s[0]; at++)
        if (oai_utf8_valid(want + at, 3, NULL) && (want[at + 3] & 0xC0) != 0x80 &&
            (want[at] & 0xC0) != 0x80) {
            memcpy(stop_s, want + at, 3);
            stop_s[3] = '\0';
        }
    cr_assert(stop_s[0], "no whole characters to stop at in '%s'", want);
    size_t cut = (size_t)(strstr(want, stop_s) - want);
    json_t *req = json_pack("{s:[{s:s,s:s}],s:i,s:i,s:b,s:s}", "messages", "role", "user",
                            "content", "Hello", "max_tokens", 40, "seed", 7, "stream", 1,
                            "stop", stop_s);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    resp r = post("/v1/chat/completions", body);
    cr_assert_eq(r.status, 200, "%s", r.body);
    sse s = parse_sse(r.body, true);
    cr_expect(strlen(s.text) == cut && strncmp(s.text, want, cut) == 0,
              "text '%s', want the first %zu bytes of '%s' (stop '%s')", s.text, cut, want,
              stop_s);
    cr_expect_str_eq(s.finish, "stop");
    cr_expect_eq(s.done, 1);
    cr_expect(strstr(r.body, "\"role\":\"assistant\"") != NULL);
    free(r.body);
    free(body);
    free(want);
    tok_ids_free(&ids);
    stop();
}

Test(http, backend_failures, .timeout = 60)
{
    tb_config c = fast();
    c.refuse = 1;
    start(&c, false, 0);
    expect_error(post("/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":3}"), 503,
                 "server_error");
    stop();

    c = fast();
    c.fail_at = 3;
    start(&c, false, 0);
    /* Whole reply: the failure is the reply. */
    expect_error(post("/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":10}"), 503,
                 "server_error");
    /* Stream: three chunks, then an error event and [DONE]. */
    resp r = post("/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":10,\"stream\":true}");
    cr_assert_eq(r.status, 200, "%s", r.body);
    sse s = parse_sse(r.body, false);
    cr_expect_eq(s.n_error, 1, "%s", r.body);
    cr_expect_eq(s.done, 1);
    free(r.body);
    /* A failure before the first token of a stream is an HTTP error, not a stream. */
    stop();
    c = fast();
    c.fail_at = 0;
    start(&c, false, 0);
    expect_error(post("/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":10,\"stream\":true}"),
                 503, "server_error");
    expect_healthy();
    stop();
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

Test(http, client_disconnect_aborts_the_backend_once, .timeout = 60)
{
    tb_config c = fast();
    c.delay_ms = 10;
    start(&c, false, 0);
    for (int round = 0; round < 2; round++) {
        int fd = dial();
        send_req(fd, "POST", "/v1/completions", "application/json", NULL,
                 round == 0 ? "{\"prompt\":\"a\",\"max_tokens\":2000,\"stream\":true}"
                            : "{\"prompt\":\"a\",\"max_tokens\":2000}");
        if (round == 0) {
            char buf[64];
            cr_assert_gt(read(fd, buf, sizeof buf), 0);
        } else {
            struct timespec ts = {0, 100 * 1000000L};
            nanosleep(&ts, NULL);
        }
        close(fd);
        uint64_t started, aborted, running, t0 = now_ms();
        do {
            struct timespec ts = {0, 10 * 1000000L};
            nanosleep(&ts, NULL);
            tb_counts(F.tb, &started, &aborted, &running);
        } while (running > 0 && now_ms() - t0 < 5000);
        cr_expect_eq(running, 0, "round %d: the backend request still runs", round);
        cr_expect_eq(aborted, (uint64_t)round + 1, "round %d", round);
        cr_expect_lt(now_ms() - t0, 2000, "round %d: the abort took %llu ms", round,
                     (unsigned long long)(now_ms() - t0));
    }
    api_counts ac;
    api_get_counts(F.api, &ac);
    cr_expect_eq(ac.cancelled, 2);
    cr_expect_eq(ac.running, 0);
    expect_healthy();
    stop();
}

Test(http, requests_past_the_deadline_are_aborted, .timeout = 60)
{
    tb_config c = fast();
    c.delay_ms = 20;
    request_timeout_ms = 300;
    start(&c, false, 0);
    uint64_t t0 = now_ms();
    expect_error(post("/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":1000}"), 504,
                 "server_error");
    cr_expect_lt(now_ms() - t0, 3000);
    resp r = post("/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":1000,\"stream\":true}");
    cr_assert_eq(r.status, 200);
    sse s = parse_sse(r.body, false);
    cr_expect_str_eq(s.finish, "abort", "%s", r.body);
    cr_expect_eq(s.done, 1);
    free(r.body);
    uint64_t started, aborted, running, t1 = now_ms();
    do { /* the backend's thread counts the abort just after it reported the end */
        struct timespec ts = {0, 5 * 1000000L};
        nanosleep(&ts, NULL);
        tb_counts(F.tb, &started, &aborted, &running);
    } while (running > 0 && now_ms() - t1 < 5000);
    cr_expect_eq(aborted, 2);
    stop();
}
