/* The router's gRPC API on loopback over the in-process test backend: streamed tokens and
 * text, the HTTP API's validation, tokens, client cancel and Abort (the backend request
 * aborted exactly once), a backend failure mid-stream, and RegisterRank's admin check. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/net/rpc.h"
#include "router.pb-c.h"
#include "router/grpc_api.h"
#include "router/testbackend.h"

#define TOKEN "client-token-0123456789"
#define ADMIN "admin-token-0123456789"

typedef struct fixture {
    tok_tokenizer *tok;
    tb_backend *tb;
    tb_config tbc;
    gapi_server *srv;
    int port;
    char target[32];
    int regs;          /* RegisterRank calls seen */
    char reg_addr[128];
    int reg_role;
} fixture;

static fixture F;

static di_status on_register(void *ud, int role, const char *addr, uint32_t *hb, uint32_t *n,
                             di_error *err)
{
    fixture *f = ud;
    (void)err;
    f->regs++;
    f->reg_role = role;
    snprintf(f->reg_addr, sizeof f->reg_addr, "%s", addr);
    *hb = 1000;
    *n = 1;
    return DI_OK;
}

static void start(const tb_config *tbc)
{
    memset(&F, 0, sizeof F);
    di_error e = {0};
    cr_assert_eq(tok_load_file(tok_default_path(), &F.tok, &e), DI_OK, "%s", e.msg);
    F.tbc = *tbc;
    cr_assert_eq(tb_new(tbc, &F.tb, &e), DI_OK, "%s", e.msg);
    gapi_config gc = {.listen = "127.0.0.1:0", .tok = F.tok, .backend = tb_backend_iface(F.tb),
                      .limits = {.max_body_bytes = 65536, .max_depth = 16,
                                 .max_prompt_tokens = 512, .max_output_tokens = 2048,
                                 .vocab_size = tok_vocab_size(F.tok), .model = "dsv4-test"},
                      .add_bos = true, .request_timeout_ms = 60000, .token = TOKEN,
                      .admin_token = ADMIN, .on_register = on_register, .register_ud = &F,
                      .threads = 2};
    cr_assert_eq(gapi_start(&gc, &F.srv, &F.port, &e), DI_OK, "%s", e.msg);
    snprintf(F.target, sizeof F.target, "127.0.0.1:%d", F.port);
}

static void stop(void)
{
    gapi_stop(F.srv, 1000);
    tb_free(F.tb);
    tok_free(F.tok);
}

static tb_config cfg(uint32_t delay_ms)
{
    return (tb_config){.delay_ms = delay_ms, .first_id = 1000, .span = 5000, .eos_id = 1,
                       .eos_at = -1, .fail_at = -1};
}

static rpc_client *client(const char *token)
{
    rpc_client_config cc = {.target = F.target, .token = token};
    rpc_client *c = NULL;
    di_error e = {0};
    cr_assert_eq(rpc_client_open(&cc, &c, &e), DI_OK, "%s", e.msg);
    return c;
}

/* What one Generate stream brought. */
typedef struct outcome {
    char id[64];
    int32_t ids[256];
    float lps[256];
    uint32_t n_top[256];
    size_t n;
    char text[8192];
    int finish;
    uint32_t prompt_tokens, completion_tokens, cached;
    di_status st;
    char msg[320];
} outcome;

/* A request for prompt ids p[0..n) and max tokens. */
static Di__Router__GenerateRequest req_ids(uint32_t *p, size_t n, uint32_t max_tokens)
{
    Di__Router__GenerateRequest r = DI__ROUTER__GENERATE_REQUEST__INIT;
    r.prompt_ids = p;
    r.n_prompt_ids = n;
    r.max_tokens = max_tokens;
    return r;
}

static uint8_t *pack_req(const Di__Router__GenerateRequest *r, size_t *n)
{
    *n = di__router__generate_request__get_packed_size(r);
    uint8_t *b = malloc(*n + 1);
    di__router__generate_request__pack(r, b);
    return b;
}

/* Reads a stream to its end into o (after `cancel_after` tokens it cancels, when >= 0). */
static void read_all(rpc_stream *s, outcome *o, long cancel_after)
{
    for (;;) {
        uint8_t *m = NULL;
        size_t len = 0;
        int done = 0;
        di_error e = {0};
        di_status st = rpc_stream_read(s, &m, &len, &done, &e);
        if (done) {
            o->st = st;
            snprintf(o->msg, sizeof o->msg, "%s", e.msg);
            free(m);
            return;
        }
        cr_assert_eq(st, DI_OK);
        Di__Router__GenerateReply *r = di__router__generate_reply__unpack(NULL, len, m);
        free(m);
        cr_assert_not_null(r);
        if (r->request_id && r->request_id[0])
            snprintf(o->id, sizeof o->id, "%s", r->request_id);
        if (r->token && o->n < 256) {
            cr_assert_eq(r->token->index, o->n);
            o->ids[o->n] = (int32_t)r->token->id;
            o->lps[o->n] = r->token->logprob;
            o->n_top[o->n] = (uint32_t)r->token->n_top;
            o->n++;
        }
        if (r->text)
            strncat(o->text, r->text, sizeof o->text - strlen(o->text) - 1);
        if (r->finish) {
            o->finish = r->finish;
            cr_assert_not_null(r->usage);
            o->prompt_tokens = r->usage->prompt_tokens;
            o->completion_tokens = r->usage->completion_tokens;
            o->cached = r->usage->cached_tokens;
        }
        di__router__generate_reply__free_unpacked(r, NULL);
        if (cancel_after >= 0 && (long)o->n == cancel_after)
            rpc_stream_cancel(s);
    }
}

static void generate(const char *token, const Di__Router__GenerateRequest *r, outcome *o,
                     long cancel_after)
{
    memset(o, 0, sizeof *o);
    rpc_client *c = client(token);
    size_t n;
    uint8_t *b = pack_req(r, &n);
    rpc_stream *s = NULL;
    di_error e = {0};
    cr_assert_eq(rpc_stream_open(c, GAPI_SERVICE "Generate", b, n, 20000, &s, &e), DI_OK, "%s",
                 e.msg);
    free(b);
    read_all(s, o, cancel_after);
    rpc_stream_close(s);
    rpc_client_close(c);
}

static void wait_aborted(uint64_t want)
{
    uint64_t started, aborted, running;
    for (int i = 0; i < 400; i++) {
        tb_counts(F.tb, &started, &aborted, &running);
        if (aborted >= want && running == 0 && gapi_live(F.srv) == 0)
            break;
        usleep(10000);
    }
    usleep(50000); /* a second abort would show up by now */
    tb_counts(F.tb, &started, &aborted, &running);
    cr_assert_eq(aborted, want, "aborts seen by the backend: %llu, want %llu",
                 (unsigned long long)aborted, (unsigned long long)want);
    cr_assert_eq(running, 0);
    cr_assert_eq(gapi_live(F.srv), 0);
}

Test(grpc, streams_the_backend_tokens_text_and_usage, .timeout = 60)
{
    tb_config tc = cfg(0);
    start(&tc);
    uint32_t prompt[] = {11, 22, 33, 44};
    Di__Router__GenerateRequest r = req_ids(prompt, 4, 12);
    r.has_seed = 1;
    r.seed = 77;
    r.top_logprobs = 3;
    outcome o;
    generate(TOKEN, &r, &o, -1);
    cr_assert_eq(o.st, DI_OK, "%s", o.msg);
    cr_assert_str_eq(o.id, "gen-1");
    cr_assert_eq(o.n, 12);
    int32_t p32[] = {11, 22, 33, 44};
    char *want = NULL;
    size_t wn = 0;
    for (uint32_t i = 0; i < 12; i++) {
        cr_assert_eq(o.ids[i], tb_token(&F.tbc, 77, p32, 4, i), "token %u", i);
        cr_assert_float_eq(o.lps[i], -(float)(i + 1) / 1024, 1e-7);
        cr_assert_eq(o.n_top[i], 3);
    }
    cr_assert_eq(tok_decode(F.tok, o.ids, 12, TOK_DECODE_SKIP_SPECIAL, &want, &wn, NULL), DI_OK);
    cr_assert_str_eq(o.text, want);
    free(want);
    cr_assert_eq(o.finish, DI__ENGINE__FINISH__FINISH_LENGTH);
    cr_assert_eq(o.prompt_tokens, 4);
    cr_assert_eq(o.completion_tokens, 12);
    /* A text prompt is tokenised with BOS, as the HTTP API does. */
    Di__Router__GenerateRequest t = DI__ROUTER__GENERATE_REQUEST__INIT;
    t.prompt_text = "Hello, world";
    t.max_tokens = 3;
    generate(TOKEN, &t, &o, -1);
    cr_assert_eq(o.st, DI_OK, "%s", o.msg);
    tok_ids ids = {0};
    cr_assert_eq(tok_encode(F.tok, "Hello, world", strlen("Hello, world"), &ids, NULL), DI_OK);
    cr_assert_eq(o.prompt_tokens, ids.n + 1);
    tok_ids_free(&ids);
    stop();
}

Test(grpc, refuses_what_the_http_api_refuses, .timeout = 60)
{
    tb_config tc = cfg(0);
    start(&tc);
    uint32_t prompt[] = {11, 22};
    outcome o;
    Di__Router__GenerateRequest r = req_ids(prompt, 2, 0);
    r.has_temperature = 1;
    r.temperature = 2.5f;
    generate(TOKEN, &r, &o, -1);
    cr_assert_eq(o.st, DI_EINVAL, "%s", di_status_str(o.st));
    cr_assert(strstr(o.msg, "temperature"), "%s", o.msg);
    cr_assert_eq(o.n, 0);
    r.has_temperature = 0;
    r.max_tokens = 2049; /* over max_output_tokens */
    generate(TOKEN, &r, &o, -1);
    cr_assert_eq(o.st, DI_EINVAL);
    cr_assert(strstr(o.msg, "max_tokens"), "%s", o.msg);
    r.max_tokens = 0;
    prompt[1] = (uint32_t)tok_vocab_size(F.tok); /* outside the vocabulary */
    generate(TOKEN, &r, &o, -1);
    cr_assert_eq(o.st, DI_EINVAL);
    cr_assert(strstr(o.msg, "prompt"), "%s", o.msg);
    prompt[1] = 22;
    r.model = "another-model";
    generate(TOKEN, &r, &o, -1);
    cr_assert_eq(o.st, DI_ENOENT, "%s: %s", di_status_str(o.st), o.msg);
    r.model = NULL;
    r.top_logprobs = 21;
    generate(TOKEN, &r, &o, -1);
    cr_assert_eq(o.st, DI_EINVAL);
    r.top_logprobs = 0;
    r.n_prompt_ids = 0; /* no prompt at all */
    generate(TOKEN, &r, &o, -1);
    cr_assert_eq(o.st, DI_EINVAL);
    cr_assert(strstr(o.msg, "prompt"), "%s", o.msg);
    r.n_prompt_ids = 2;
    r.prompt_text = "both";
    generate(TOKEN, &r, &o, -1);
    cr_assert_eq(o.st, DI_EINVAL);
    r.prompt_text = NULL;
    uint32_t *big = calloc(513, sizeof *big); /* over max_prompt_tokens */
    for (int i = 0; i < 513; i++)
        big[i] = 100;
    r.prompt_ids = big;
    r.n_prompt_ids = 513;
    generate(TOKEN, &r, &o, -1);
    cr_assert_eq(o.st, DI_EINVAL);
    free(big);
    uint64_t started, aborted, running;
    tb_counts(F.tb, &started, &aborted, &running);
    cr_assert_eq(started, 0, "a refused request reached the backend");
    /* Garbage bytes are not a request. */
    rpc_client *c = client(TOKEN);
    rpc_stream *s = NULL;
    di_error e = {0};
    cr_assert_eq(rpc_stream_open(c, GAPI_SERVICE "Generate", "\xff\xff\xff", 3, 5000, &s, &e),
                 DI_OK);
    read_all(s, &o, -1);
    cr_assert_eq(o.st, DI_EPROTO, "%s", di_status_str(o.st));
    rpc_stream_close(s);
    rpc_client_close(c);
    stop();
}

Test(grpc, needs_the_client_token, .timeout = 60)
{
    tb_config tc = cfg(0);
    start(&tc);
    uint32_t prompt[] = {11};
    Di__Router__GenerateRequest r = req_ids(prompt, 1, 2);
    outcome o;
    generate(NULL, &r, &o, -1);
    cr_assert_eq(o.st, DI_EAUTH, "%s", di_status_str(o.st));
    generate("client-token-0123456780", &r, &o, -1);
    cr_assert_eq(o.st, DI_EAUTH);
    generate(ADMIN, &r, &o, -1); /* the admin token includes the client's role */
    cr_assert_eq(o.st, DI_OK, "%s", o.msg);
    uint64_t started, aborted, running;
    tb_counts(F.tb, &started, &aborted, &running);
    cr_assert_eq(started, 1);
    stop();
}

Test(grpc, client_cancel_aborts_the_backend_once, .timeout = 60)
{
    tb_config tc = cfg(20);
    start(&tc);
    uint32_t prompt[] = {11, 12};
    Di__Router__GenerateRequest r = req_ids(prompt, 2, 1000);
    outcome o;
    generate(TOKEN, &r, &o, 3);
    cr_assert_eq(o.st, DI_ECANCELED, "%s", di_status_str(o.st));
    cr_assert_lt(o.n, 10);
    wait_aborted(1);
    stop();
}

/* Abort(id) through client c: the call's status, and *found from the reply. */
static di_status call_abort(rpc_client *c, const char *id, bool *found)
{
    Di__Engine__AbortRequest ar = DI__ENGINE__ABORT_REQUEST__INIT;
    ar.request_id = (char *)id;
    uint8_t ab[160];
    size_t an = di__engine__abort_request__pack(&ar, ab);
    uint8_t *rep = NULL;
    size_t rn = 0;
    di_error e = {0};
    di_status st = rpc_client_call(c, GAPI_SERVICE "Abort", ab, an, 5000, &rep, &rn, &e);
    if (st != DI_OK)
        return st;
    Di__Engine__AbortReply *ap = di__engine__abort_reply__unpack(NULL, rn, rep);
    free(rep);
    cr_assert_not_null(ap);
    *found = ap->found;
    di__engine__abort_reply__free_unpacked(ap, NULL);
    return DI_OK;
}

Test(grpc, abort_by_id_ends_the_stream_once, .timeout = 60)
{
    tb_config tc = cfg(20);
    start(&tc);
    uint32_t prompt[] = {11, 12};
    Di__Router__GenerateRequest r = req_ids(prompt, 2, 1000);
    rpc_client *c = client(TOKEN);
    size_t n;
    uint8_t *b = pack_req(&r, &n);
    rpc_stream *s = NULL;
    di_error e = {0};
    cr_assert_eq(rpc_stream_open(c, GAPI_SERVICE "Generate", b, n, 20000, &s, &e), DI_OK);
    free(b);
    uint8_t *m = NULL;
    size_t len = 0;
    int done = 0;
    cr_assert_eq(rpc_stream_read(s, &m, &len, &done, &e), DI_OK);
    Di__Router__GenerateReply *first = di__router__generate_reply__unpack(NULL, len, m);
    free(m);
    cr_assert_not_null(first);
    char id[64];
    snprintf(id, sizeof id, "%s", first->request_id);
    di__router__generate_reply__free_unpacked(first, NULL);
    /* Abort it twice from another client, and an unknown id once. */
    rpc_client *c2 = client(TOKEN);
    for (int k = 0; k < 3; k++) {
        bool found = false;
        cr_assert_eq(call_abort(c2, k < 2 ? id : "gen-999", &found), DI_OK);
        if (k == 0 || k == 2)
            cr_assert_eq(found, k == 0, "abort %d", k);
    }
    outcome o;
    memset(&o, 0, sizeof o);
    read_all(s, &o, -1);
    cr_assert_eq(o.st, DI_OK, "%s", o.msg);
    cr_assert_eq(o.finish, DI__ENGINE__FINISH__FINISH_ABORTED);
    cr_assert_lt(o.n, 100);
    wait_aborted(1);
    /* Abort needs the client token too. */
    rpc_client *c3 = client(NULL);
    bool found;
    cr_assert_eq(call_abort(c3, id, &found), DI_EAUTH);
    rpc_client_close(c3);
    rpc_stream_close(s);
    rpc_client_close(c2);
    rpc_client_close(c);
    stop();
}

Test(grpc, a_backend_failure_ends_the_stream_with_its_status, .timeout = 60)
{
    tb_config tc = cfg(0);
    tc.fail_at = 4;
    start(&tc);
    uint32_t prompt[] = {11, 12};
    Di__Router__GenerateRequest r = req_ids(prompt, 2, 10);
    outcome o;
    generate(TOKEN, &r, &o, -1);
    cr_assert_neq(o.st, DI_OK);
    cr_assert_eq(o.n, 4, "tokens before the failure: %zu", o.n);
    cr_assert_eq(o.finish, 0);
    stop();
    tc = cfg(0);
    tc.refuse = 1;
    start(&tc);
    generate(TOKEN, &r, &o, -1);
    cr_assert_eq(o.st, DI_EUNAVAIL, "%s", di_status_str(o.st));
    cr_assert_eq(gapi_live(F.srv), 0);
    stop();
}

Test(grpc, register_rank_needs_the_admin_token_and_a_good_address, .timeout = 60)
{
    tb_config tc = cfg(0);
    start(&tc);
    const struct {
        const char *token;
        int role;
        const char *addr;
        di_status want;
    } cases[] = {
        {TOKEN, 1, "127.0.0.1:7001", DI_EPERM},
        {NULL, 1, "127.0.0.1:7001", DI_EAUTH},
        {ADMIN, 1, "127.0.0.1:0", DI_EINVAL},
        {ADMIN, 1, "127.0.0.1:70000", DI_EINVAL},
        {ADMIN, 1, "nocolon", DI_EINVAL},
        {ADMIN, 7, "127.0.0.1:7001", DI_EINVAL},
        {ADMIN, 1, "127.0.0.1:7001", DI_OK},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        rpc_client *c = client(cases[i].token);
        Di__Router__RegisterRequest rr = DI__ROUTER__REGISTER_REQUEST__INIT;
        rr.role = cases[i].role;
        rr.address = (char *)cases[i].addr;
        uint8_t b[256];
        size_t n = di__router__register_request__pack(&rr, b);
        uint8_t *rep = NULL;
        size_t rn = 0;
        di_error e = {0};
        di_status st = rpc_client_call(c, GAPI_SERVICE "RegisterRank", b, n, 5000, &rep, &rn,
                                       &e);
        cr_assert_eq(st, cases[i].want, "case %zu: %s (%s)", i, di_status_str(st), e.msg);
        free(rep);
        rpc_client_close(c);
    }
    cr_assert_eq(F.regs, 1);
    cr_assert_str_eq(F.reg_addr, "127.0.0.1:7001");
    cr_assert_eq(F.reg_role, 1);
    stop();
}
