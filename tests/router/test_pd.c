/* The prefill/decode backend and the rank table against fake di-prefill and di-decode servers
 * (small gRPC servers here that implement the protos with deterministic tokens): relaying,
 * the handoff passed from prefill to decode, the retry of a failed prefill on another rank,
 * abort reaching the downstream call at once, a decode rank dying mid-stream (an error, or a
 * continuation on another decode rank when a real di-kvstore holds the prompt's first block),
 * and ranks that stop answering heartbeats, leave rotation and come back. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kvfmt/kv_keys.h"
#include "common/kvfmt/kv_layout.h"
#include "common/util/clock.h"
#include "decode.pb-c.h"
#include "prefill.pb-c.h"
#include "proc.h"
#include "router/pd_backend.h"
#include "tests/kvstore/harness.h"
#include "tests/kvstore/helpers.h"

#define ENGINE_TOKEN "engine-token-0123456789"

/* ---- fake ranks ---- */

typedef struct fake {
    pl_role role;
    rpc_server *srv;
    int port;
    char addr[32];
    atomic_int fail;        /* Prefill/Decode fail with this di_status (0: succeed) */
    atomic_int delay_ms;    /* prefill: before the reply; decode: before each token */
    atomic_int draining;    /* GetLoad says draining */
    atomic_int calls;       /* Prefill or Decode calls */
    atomic_int cancels;     /* of those, cancelled */
    atomic_int tokens;      /* decode tokens sent */
    atomic_int bad_handoff; /* decode calls whose handoff or first token was wrong */
} fake;

/* When set, the fake prefill stores a handoff object under the request's real handoff key,
 * as di-prefill does, and keeps the last request id. */
static kvc_client *g_store;
static kvc_store_info g_info;
static pthread_mutex_t g_rid_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_rid[64];

static int32_t tok_of(uint64_t seed, const uint32_t *p, size_t n, uint32_t i)
{
    uint64_t h = seed * 31 + i * 7;
    for (size_t k = 0; k < n; k++)
        h = h * 1000003 + p[k];
    return 1000 + (int32_t)(h % 5000);
}

static void key_of(const char *id, uint8_t key[32])
{
    memset(key, 0, 32);
    memcpy(key, id, strlen(id) < 32 ? strlen(id) : 32);
}

typedef struct job {
    fake *f;
    rpc_call *call;
    uint8_t *req;
    size_t len;
} job;

static void count_cancel(void *ud, di_status why)
{
    (void)why;
    atomic_fetch_add(&((fake *)ud)->cancels, 1);
}

/* Sleeps ms in 5 ms steps; false when the call was cancelled. */
static bool nap(rpc_call *c, int ms)
{
    for (int t = 0; t < ms; t += 5) {
        if (rpc_call_cancelled(c))
            return false;
        usleep(5000);
    }
    return !rpc_call_cancelled(c);
}

static void *prefill_job(void *arg)
{
    job *j = arg;
    fake *f = j->f;
    rpc_call *call = j->call;
    Di__Prefill__PrefillRequest *r = di__prefill__prefill_request__unpack(NULL, j->len, j->req);
    free(j->req);
    free(j);
    if (!nap(call, atomic_load(&f->delay_ms)) || !r) {
        di__prefill__prefill_request__free_unpacked(r, NULL);
        rpc_call_finish(call, DI_ECANCELED, NULL, 0, "cancelled");
        return NULL;
    }
    if (atomic_load(&f->fail)) {
        di__prefill__prefill_request__free_unpacked(r, NULL);
        rpc_call_finish(call, (di_status)atomic_load(&f->fail), NULL, 0, "injected failure");
        return NULL;
    }
    if (g_store) {
        kvkey hk;
        uint8_t *obj = malloc(4224);
        cr_assert_eq(kvkey_handoff(g_info.geometry.model_id, r->request_id, &hk, NULL), DI_OK);
        th_fill_object(obj, 4224, KV_HANDOFF_MAGIC, &g_info.geometry, &hk, 0);
        di_error pe = {0};
        cr_assert_eq(kvc_put1(g_store, KVKEY_HANDOFF, &hk, obj, 4224, &pe), DI_OK, "%s", pe.msg);
        free(obj);
        pthread_mutex_lock(&g_rid_mu);
        snprintf(g_rid, sizeof g_rid, "%s", r->request_id);
        pthread_mutex_unlock(&g_rid_mu);
    }
    Di__Engine__Token first = DI__ENGINE__TOKEN__INIT;
    first.id = (uint32_t)tok_of(r->sampling->seed, r->prompt, r->n_prompt, 0);
    first.logprob = -0.5f;
    uint8_t key[32];
    key_of(r->request_id, key);
    Di__Prefill__HandoffManifest hm = DI__PREFILL__HANDOFF_MANIFEST__INIT;
    hm.model_id = 42;
    hm.prompt_tokens = (uint32_t)r->n_prompt;
    hm.block_tokens = 128;
    hm.handoff_key = (ProtobufCBinaryData){32, key};
    hm.handoff_bytes = 4096;
    Di__Prefill__PrefillReply rep = DI__PREFILL__PREFILL_REPLY__INIT;
    rep.request_id = r->request_id;
    rep.first = &first;
    rep.handoff = &hm;
    rep.compute_ms = 1;
    uint8_t buf[512];
    size_t n = di__prefill__prefill_reply__pack(&rep, buf);
    di__prefill__prefill_request__free_unpacked(r, NULL);
    rpc_call_finish(call, DI_OK, buf, n, NULL);
    return NULL;
}

static void *decode_job(void *arg)
{
    job *j = arg;
    fake *f = j->f;
    rpc_call *call = j->call;
    Di__Decode__DecodeRequest *r = di__decode__decode_request__unpack(NULL, j->len, j->req);
    free(j->req);
    free(j);
    uint8_t key[32];
    if (!r || !r->handoff || !r->first || !r->sampling ||
        (key_of(r->request_id, key), r->handoff->handoff_key.len != 32) ||
        memcmp(r->handoff->handoff_key.data, key, 32) != 0 ||
        r->first->id != (uint32_t)tok_of(r->sampling->seed, r->prompt, r->n_prompt, 0)) {
        atomic_fetch_add(&f->bad_handoff, 1);
        di__decode__decode_request__free_unpacked(r, NULL);
        rpc_call_finish(call, DI_EINVAL, NULL, 0, "bad handoff");
        return NULL;
    }
    di_status st = (di_status)atomic_load(&f->fail);
    for (uint32_t i = 1; st == DI_OK && i < r->sampling->max_tokens; i++) {
        if (!nap(call, atomic_load(&f->delay_ms))) {
            st = DI_ECANCELED;
            break;
        }
        Di__Engine__Token t = DI__ENGINE__TOKEN__INIT;
        t.id = (uint32_t)tok_of(r->sampling->seed, r->prompt, r->n_prompt, i);
        t.logprob = -(float)i / 8;
        t.index = i;
        Di__Decode__DecodeToken dt = DI__DECODE__DECODE_TOKEN__INIT;
        dt.token = &t;
        dt.output_tokens = i + 1;
        dt.finish = i + 1 == r->sampling->max_tokens ? DI__ENGINE__FINISH__FINISH_LENGTH
                                                     : DI__ENGINE__FINISH__FINISH_NONE;
        uint8_t buf[128];
        size_t n = di__decode__decode_token__pack(&dt, buf);
        st = rpc_call_write(call, buf, n, NULL);
        atomic_fetch_add(&f->tokens, 1);
    }
    di__decode__decode_request__free_unpacked(r, NULL);
    rpc_call_finish(call, st, NULL, 0, st == DI_OK ? NULL : "injected failure");
    return NULL;
}

static di_status start_job(void *svc, const rpc_request *rq, rpc_call *call, di_error *err)
{
    fake *f = svc;
    atomic_fetch_add(&f->calls, 1);
    job *j = calloc(1, sizeof *j);
    j->f = f;
    j->call = call;
    j->req = malloc(rq->len + 1);
    memcpy(j->req, rq->data, rq->len);
    j->len = rq->len;
    rpc_call_on_cancel(call, count_cancel, f);
    pthread_t th;
    pthread_create(&th, NULL, f->role == PL_PREFILL ? prefill_job : decode_job, j);
    pthread_detach(th);
    return DI_OK;
}

static di_status get_load(void *svc, const rpc_request *rq, rpc_reply *reply, di_error *err)
{
    fake *f = svc;
    Di__Engine__Load l = DI__ENGINE__LOAD__INIT;
    l.free_blocks = 10000;
    l.total_blocks = 10000;
    l.draining = atomic_load(&f->draining);
    reply->len = di__engine__load__get_packed_size(&l);
    reply->data = malloc(reply->len + 1);
    di__engine__load__pack(&l, reply->data);
    return DI_OK;
}

static void fake_start(fake *f, pl_role role, int port)
{
    f->role = role;
    const char *svc = role == PL_PREFILL ? "/di.prefill.Prefill/" : "/di.decode.Decode/";
    static char names[2][3][48];
    snprintf(names[role][0], 48, "%sGetLoad", svc);
    snprintf(names[role][1], 48, "%s%s", svc, role == PL_PREFILL ? "Prefill" : "Decode");
    rpc_method m[] = {{names[role][0], get_load, 1000, 1, 4096, RPC_ROLE_ENGINE}};
    rpc_async_method am[] = {
        {names[role][1], start_job, role == PL_DECODE, 60000, 0, 1 << 20, RPC_ROLE_ENGINE}};
    char listen[32];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    rpc_server_config sc = {.listen = listen, .methods = m, .n_methods = 1, .async_methods = am,
                            .n_async_methods = 1, .svc = f, .threads = 2,
                            .engine_token = ENGINE_TOKEN};
    di_error e = {0};
    di_status st = DI_EUNAVAIL;
    for (int i = 0; i < 100 && st != DI_OK; i++) { /* a restart may wait for the port */
        st = rpc_server_start(&sc, &f->srv, &f->port, &e);
        if (st != DI_OK)
            usleep(20000);
    }
    cr_assert_eq(st, DI_OK, "%s", e.msg);
    snprintf(f->addr, sizeof f->addr, "127.0.0.1:%d", f->port);
}

static void fake_stop(fake *f)
{
    f->srv = rpc_server_stop(f->srv, 0);
}

/* ---- the router side ---- */

static rk_table *ranks_new(uint32_t heartbeat_ms)
{
    rk_config rc = {.placement = pl_config_default(), .policy = PL_POLICY_ESTIMATE,
                    .engine_token = ENGINE_TOKEN};
    rc.placement.heartbeat_ns = (uint64_t)heartbeat_ms * 1000000;
    rk_table *t = NULL;
    di_error e = {0};
    cr_assert_eq(rk_new(&rc, &t, &e), DI_OK, "%s", e.msg);
    return t;
}

static void add(rk_table *t, fake *f)
{
    di_error e = {0};
    cr_assert_eq(rk_add(t, f->role, f->addr, false, NULL, &e), DI_OK, "%s", e.msg);
}

/* Waits until the poller has taken n rounds more. */
static void polls(rk_table *t, uint64_t n)
{
    uint64_t want = rk_polls(t) + n;
    for (int i = 0; i < 1000 && rk_polls(t) < want; i++)
        usleep(5000);
    cr_assert_geq(rk_polls(t), want);
}

static pd_backend *backend(rk_table *t, uint32_t prefill_ms)
{
    pd_config pc = {.ranks = t, .prefill_timeout_ms = prefill_ms, .decode_timeout_ms = 20000,
                    .block_tokens = 128};
    pd_backend *b = NULL;
    di_error e = {0};
    cr_assert_eq(pd_new(&pc, &b, &e), DI_OK, "%s", e.msg);
    return b;
}

/* What the callbacks saw. */
typedef struct seen {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t ids[256];
    size_t n;
    int finishes;
    rt_finish reason;
    di_status st;
    char msg[320];
    char instance[64];
    int continues;                   /* on_continue calls */
    char from[64], to[64];           /* the last one's ranks */
    uint32_t after;                  /* and its tokens so far */
} seen;

static void on_token(void *ud, const rt_gen_token *t)
{
    seen *s = ud;
    pthread_mutex_lock(&s->mu);
    if (s->n < 256)
        s->ids[s->n++] = t->id;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void on_finish(void *ud, rt_finish reason, uint32_t cached, const char *instance,
                      di_status st, const char *msg)
{
    seen *s = ud;
    (void)cached;
    pthread_mutex_lock(&s->mu);
    s->finishes++;
    s->reason = reason;
    s->st = st;
    snprintf(s->msg, sizeof s->msg, "%s", msg ? msg : "");
    snprintf(s->instance, sizeof s->instance, "%s", instance ? instance : "");
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void on_continue(void *ud, const char *from, const char *to, uint32_t n_done)
{
    seen *s = ud;
    pthread_mutex_lock(&s->mu);
    s->continues++;
    snprintf(s->from, sizeof s->from, "%s", from);
    snprintf(s->to, sizeof s->to, "%s", to);
    s->after = n_done;
    pthread_mutex_unlock(&s->mu);
}

static const uint32_t PROMPT[] = {5, 6, 7, 8, 9};

/* Starts a request for p[0..n) (seed 99). */
static di_status gen_prompt(pd_backend *b, seen *s, const int32_t *p, size_t n,
                            uint32_t max_tokens, uint64_t *handle)
{
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    rt_gen_req r = {.prompt = p, .n_prompt = n, .max_tokens = max_tokens, .temperature = 1,
                    .top_p = 1, .top_k = -1, .seed = 99};
    rt_gen_cb cb = {on_token, on_finish, s, on_continue};
    di_error e = {0};
    uint64_t h;
    return pd_backend_iface(b).generate(b, &r, &cb, handle ? handle : &h, &e);
}

static di_status gen(pd_backend *b, seen *s, uint32_t max_tokens, uint64_t *handle)
{
    int32_t p[5];
    for (int i = 0; i < 5; i++)
        p[i] = (int32_t)PROMPT[i];
    return gen_prompt(b, s, p, 5, max_tokens, handle);
}

/* Waits for the end (or for n tokens when n > 0); returns the seconds waited. */
static double wait_for(seen *s, size_t n)
{
    uint64_t t0 = di_mono_ns();
    pthread_mutex_lock(&s->mu);
    while (!s->finishes && (n == 0 || s->n < n) && di_mono_ns() - t0 < 20000000000ull) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 10000000;
        if (ts.tv_nsec >= 1000000000)
            ts.tv_sec++, ts.tv_nsec -= 1000000000;
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    pthread_mutex_unlock(&s->mu);
    return (double)(di_mono_ns() - t0) * 1e-9;
}

static fake P1, P2, D1, D2;

static void reset_fakes(void)
{
    memset(&P1, 0, sizeof P1);
    memset(&P2, 0, sizeof P2);
    memset(&D1, 0, sizeof D1);
    memset(&D2, 0, sizeof D2);
}

/* Fresh fakes (P2 too when two_prefill), a table polling every 100 ms with P1 (P2) and D1
 * added and polled, and a backend with that prefill deadline. */
static rk_table *setup(bool two_prefill, uint32_t prefill_ms, pd_backend **b)
{
    reset_fakes();
    fake_start(&P1, PL_PREFILL, 0);
    if (two_prefill)
        fake_start(&P2, PL_PREFILL, 0);
    fake_start(&D1, PL_DECODE, 0);
    rk_table *t = ranks_new(100);
    add(t, &P1);
    if (two_prefill)
        add(t, &P2);
    add(t, &D1);
    polls(t, 2); /* a round that began before the adds does not count */
    *b = backend(t, prefill_ms);
    return t;
}

static void teardown(rk_table *t, pd_backend *b)
{
    pd_free(b);
    rk_free(t);
    fake_stop(&P1);
    fake_stop(&P2);
    fake_stop(&D1);
    fake_stop(&D2);
}

Test(pd, relays_prefill_then_decode_tokens, .timeout = 60)
{
    pd_backend *b;
    rk_table *t = setup(false, 5000, &b);
    seen s;
    cr_assert_eq(gen(b, &s, 8, NULL), DI_OK);
    wait_for(&s, 0);
    usleep(50000); /* a second on_finish would show by now */
    cr_assert_eq(s.finishes, 1);
    cr_assert_eq(s.st, DI_OK, "%s", s.msg);
    cr_assert_eq(s.reason, RT_FINISH_LENGTH);
    cr_assert_eq(s.n, 8);
    for (uint32_t i = 0; i < 8; i++)
        cr_assert_eq(s.ids[i], tok_of(99, PROMPT, 5, i), "token %u", i);
    cr_assert_str_eq(s.instance, D1.addr);
    cr_assert_eq(atomic_load(&D1.bad_handoff), 0);
    /* max_tokens 1: prefill's token alone, no decode call. */
    cr_assert_eq(gen(b, &s, 1, NULL), DI_OK);
    wait_for(&s, 0);
    cr_assert_eq(s.reason, RT_FINISH_LENGTH);
    cr_assert_eq(s.n, 1);
    cr_assert_eq(atomic_load(&D1.calls), 1);
    teardown(t, b);
}

Test(pd, a_failed_prefill_is_retried_once_on_another_rank, .timeout = 60)
{
    pd_backend *b;
    rk_table *t = setup(true, 5000, &b);
    atomic_store(&P1.fail, DI_EIO);
    seen s;
    cr_assert_eq(gen(b, &s, 4, NULL), DI_OK);
    wait_for(&s, 0);
    cr_assert_eq(s.st, DI_OK, "%s", s.msg);
    cr_assert_eq(s.n, 4);
    cr_assert_eq(atomic_load(&P1.calls), 1);
    cr_assert_eq(atomic_load(&P2.calls), 1);
    uint64_t started, retries, running;
    pd_counts(b, &started, &retries, &running);
    cr_assert_eq(retries, 1);
    /* Both failing: two calls in all, then the error. */
    atomic_store(&P2.fail, DI_EIO);
    int before = atomic_load(&P1.calls) + atomic_load(&P2.calls);
    cr_assert_eq(gen(b, &s, 4, NULL), DI_OK);
    wait_for(&s, 0);
    cr_assert_eq(s.reason, RT_FINISH_ERROR);
    cr_assert_eq(s.st, DI_EIO, "%s", di_status_str(s.st));
    cr_assert(strstr(s.msg, "prefill rank"), "%s", s.msg);
    cr_assert_eq(atomic_load(&P1.calls) + atomic_load(&P2.calls), before + 2);
    cr_assert_eq(s.n, 0);
    /* A slow prefill runs into its deadline and is retried elsewhere. */
    atomic_store(&P1.fail, 0);
    atomic_store(&P2.fail, 0);
    pd_free(b);
    b = backend(t, 300);
    atomic_store(&P1.delay_ms, 5000);
    atomic_store(&P2.delay_ms, 5000);
    cr_assert_eq(gen(b, &s, 4, NULL), DI_OK);
    double secs = wait_for(&s, 0);
    cr_assert_eq(s.st, DI_ETIMEDOUT, "%s", di_status_str(s.st));
    cr_assert_lt(secs, 3.0);
    teardown(t, b);
}

Test(pd, abort_cancels_the_downstream_call_at_once, .timeout = 60)
{
    pd_backend *b;
    rk_table *t = setup(false, 30000, &b);
    rt_backend bi = pd_backend_iface(b);
    /* During prefill. */
    atomic_store(&P1.delay_ms, 10000);
    seen s;
    uint64_t h;
    cr_assert_eq(gen(b, &s, 50, &h), DI_OK);
    usleep(200000);
    bi.abort(b, h);
    double secs = wait_for(&s, 0);
    cr_assert_eq(s.reason, RT_FINISH_ABORT, "%d %s", s.reason, s.msg);
    cr_assert_lt(secs, 2.0, "abort took %.3f s", secs);
    cr_assert_eq(atomic_load(&P1.calls), 1, "an aborted prefill must not be retried");
    for (int i = 0; i < 200 && atomic_load(&P1.cancels) < 1; i++)
        usleep(5000);
    cr_assert_eq(atomic_load(&P1.cancels), 1);
    /* During decode. */
    atomic_store(&P1.delay_ms, 0);
    atomic_store(&D1.delay_ms, 30);
    cr_assert_eq(gen(b, &s, 200, &h), DI_OK);
    wait_for(&s, 4);
    bi.abort(b, h);
    bi.abort(b, h);
    secs = wait_for(&s, 0);
    cr_assert_eq(s.reason, RT_FINISH_ABORT);
    cr_assert_lt(secs, 2.0);
    cr_assert_lt(s.n, 100);
    for (int i = 0; i < 200 && atomic_load(&D1.cancels) < 1; i++)
        usleep(5000);
    cr_assert_eq(atomic_load(&D1.cancels), 1);
    bi.abort(b, h); /* after the end: nothing */
    teardown(t, b);
}

Test(pd, a_decode_rank_that_dies_mid_stream_ends_with_an_error, .timeout = 60)
{
    pd_backend *b;
    rk_table *t = setup(false, 5000, &b);
    atomic_store(&D1.delay_ms, 20);
    seen s;
    cr_assert_eq(gen(b, &s, 200, NULL), DI_OK);
    wait_for(&s, 4);
    fake_stop(&D1);
    wait_for(&s, 0);
    cr_assert_eq(s.finishes, 1);
    cr_assert_eq(s.reason, RT_FINISH_ERROR);
    cr_assert_neq(s.st, DI_OK);
    cr_assert(strstr(s.msg, "decode rank"), "%s", s.msg);
    cr_assert_geq(s.n, 4);
    cr_assert_lt(s.n, 200);
    /* A decode rank that fails its calls: the error is relayed with its status. */
    fake_start(&D1, PL_DECODE, D1.port);
    for (int i = 0; i < 1000 && rk_health(t, 1) != PL_HEALTHY; i++)
        usleep(10000); /* back once the channel reconnects and two polls pass */
    cr_assert_eq(rk_health(t, 1), PL_HEALTHY);
    atomic_store(&D1.fail, DI_EFULL);
    atomic_store(&D1.delay_ms, 0);
    cr_assert_eq(gen(b, &s, 10, NULL), DI_OK);
    wait_for(&s, 0);
    cr_assert_eq(s.reason, RT_FINISH_ERROR);
    cr_assert_eq(s.st, DI_EFULL, "%s: %s", di_status_str(s.st), s.msg);
    cr_assert_eq(s.n, 1); /* prefill's token only */
    teardown(t, b);
}

/* Stops the decode fake running the request (the one with a call); returns it. */
static fake *stop_the_busy_decode(void)
{
    fake *f = atomic_load(&D1.calls) ? &D1 : atomic_load(&D2.calls) ? &D2 : NULL;
    cr_assert_not_null(f, "no decode rank has the request");
    fake_stop(f);
    return f;
}

/* A small real di-kvstore in a fresh directory; its Info in g_info. Returns a client. */
static kvc_client *store_up(th_store *st)
{
    static const char *const args[] = {
        "--block-bytes", "4224", "--window-bytes", "8320", "--handoff-max-bytes", "16512",
        "--dram-bytes", "8MiB", "--memtable-bytes", "2MiB", NULL};
    char dir[256];
    th_tmpdir(dir);
    th_store_start(st, dir, args);
    kvc_client *c = th_client(st, NULL);
    di_error e = {0};
    cr_assert_eq(kvc_info(c, &g_info, &e), DI_OK, "%s", e.msg);
    return c;
}

/* Fresh fakes P1, D1 (and D2 when two_decode), a table polling every 100 ms with them, and a
 * backend with the store client c. */
static rk_table *store_rig(kvc_client *c, bool two_decode, pd_backend **b)
{
    reset_fakes();
    fake_start(&P1, PL_PREFILL, 0);
    fake_start(&D1, PL_DECODE, 0);
    if (two_decode)
        fake_start(&D2, PL_DECODE, 0);
    rk_table *t = ranks_new(100);
    add(t, &P1);
    add(t, &D1);
    if (two_decode)
        add(t, &D2);
    polls(t, 2);
    pd_config pc = {.ranks = t, .store = c, .prefill_timeout_ms = 5000,
                    .decode_timeout_ms = 20000, .block_tokens = 128};
    di_error e = {0};
    cr_assert_eq(pd_new(&pc, b, &e), DI_OK, "%s", e.msg);
    return t;
}

Test(pd, a_decode_rank_that_dies_mid_stream_continues_on_another_from_the_store, .timeout = 90)
{
    th_store st;
    kvc_client *c = store_up(&st);
    kvc_store_info info = g_info;
    di_error e = {0};
    uint32_t bt = info.geometry.block_tokens;
    size_t n = 2 * (size_t)bt + 5;
    int32_t *p = malloc((n + 64) * sizeof *p);
    for (size_t i = 0; i < n; i++)
        p[i] = (int32_t)(100 + (i * 7919) % 50000);
    kvkey key;
    size_t nk;
    cr_assert_eq(kvkey_chain(info.geometry.model_id, bt, p, n, &key, 1, &nk, &e), DI_OK);
    uint8_t *obj = malloc(4224); /* the prompt's first block is in the store */
    th_fill_object(obj, 4224, KV_BLOCK_MAGIC, &info.geometry, &key, 0);
    cr_assert_eq(kvc_put1(c, KVKEY_BLOCK, &key, obj, 4224, &e), DI_OK, "%s", e.msg);
    free(obj);

    pd_backend *b = NULL;
    rk_table *t = store_rig(c, true, &b);
    atomic_store(&D1.delay_ms, 20);
    atomic_store(&D2.delay_ms, 20);

    seen s;
    const uint32_t max = 40;
    cr_assert_eq(gen_prompt(b, &s, p, n, max, NULL), DI_OK);
    wait_for(&s, 5);
    fake *dead = stop_the_busy_decode(), *live = dead == &D1 ? &D2 : &D1;
    wait_for(&s, 0);
    cr_assert_eq(s.finishes, 1);
    cr_assert_eq(s.reason, RT_FINISH_LENGTH, "%d: %s", s.reason, s.msg);
    cr_assert_eq(s.n, max, "%zu tokens", s.n);
    cr_assert_eq(s.continues, 1);
    cr_assert_str_eq(s.from, dead->addr);
    cr_assert_str_eq(s.to, live->addr);
    cr_assert_str_eq(s.instance, live->addr);
    uint32_t k = s.after;
    cr_assert(k >= 5 && k < max, "continued after %u tokens", k);
    cr_assert_eq(atomic_load(&P1.calls), 2, "one prefill, one for the continuation");
    cr_assert_eq(atomic_load(&live->bad_handoff), 0);
    /* Before the failure: the request's own tokens; after it: those of a request for the
     * prompt plus the k tokens sent (the fakes' tokens are a function of the prompt), with
     * the rest of max_tokens. */
    uint32_t up[4096];
    cr_assert_lt(n + max, 4096);
    for (size_t i = 0; i < n; i++)
        up[i] = (uint32_t)p[i];
    for (uint32_t i = 0; i < k; i++)
        cr_assert_eq(s.ids[i], tok_of(99, up, n, i), "token %u", i);
    for (uint32_t i = 0; i < k; i++)
        up[n + i] = (uint32_t)s.ids[i];
    for (uint32_t i = k; i < max; i++)
        cr_assert_eq(s.ids[i], tok_of(99, up, n + k, i - k), "token %u after the move", i);

    /* The dead rank back; a prompt whose blocks the store lacks: an error that says why. */
    fake_start(dead, PL_DECODE, dead->port);
    size_t di = (size_t)(dead == &D1 ? 1 : 2);
    for (int i = 0; i < 1000 && rk_health(t, di) != PL_HEALTHY; i++)
        usleep(10000);
    cr_assert_eq(rk_health(t, di), PL_HEALTHY);
    atomic_store(&D1.calls, 0);
    atomic_store(&D2.calls, 0);
    p[0] ^= 1;
    cr_assert_eq(gen_prompt(b, &s, p, n, max, NULL), DI_OK);
    wait_for(&s, 5);
    stop_the_busy_decode();
    wait_for(&s, 0);
    cr_assert_eq(s.reason, RT_FINISH_ERROR);
    cr_assert_eq(s.continues, 0);
    cr_assert(strstr(s.msg, "not continued: the store holds none"), "%s", s.msg);
    cr_assert_lt(s.n, max);

    pd_free(b);
    rk_free(t);
    fake_stop(&P1);
    fake_stop(&D1);
    fake_stop(&D2);
    kvc_close(c);
    th_store_stop(&st);
    free(p);
}

/* Whether the store holds a handoff for request id rid. */
static bool handoff_stored(kvc_client *c, const char *rid)
{
    kvkey hk;
    cr_assert_eq(kvkey_handoff(g_info.geometry.model_id, rid, &hk, NULL), DI_OK);
    uint8_t buf[4224];
    uint64_t n = 0;
    di_error e = {0};
    di_status st = kvc_get1(c, KVKEY_HANDOFF, &hk, buf, sizeof buf, &n, &e);
    cr_assert(st == DI_OK || st == DI_ENOENT, "%s", e.msg);
    return st == DI_OK;
}

Test(pd, a_handoff_no_decode_took_is_deleted_from_the_store, .timeout = 90)
{
    th_store st;
    kvc_client *c = store_up(&st), *fc = th_client(&st, NULL);
    g_store = fc;
    pd_backend *b = NULL;
    rk_table *t = store_rig(c, false, &b);
    /* A decode rank that refuses the request before loading anything: the router deletes the
     * handoff. A finished request's handoff is left to the decode rank (it took it). */
    atomic_store(&D1.fail, DI_EINVAL);
    seen s;
    cr_assert_eq(gen(b, &s, 10, NULL), DI_OK);
    wait_for(&s, 0);
    cr_assert_eq(s.reason, RT_FINISH_ERROR);
    char rid[64];
    pthread_mutex_lock(&g_rid_mu);
    snprintf(rid, sizeof rid, "%s", g_rid);
    pthread_mutex_unlock(&g_rid_mu);
    cr_assert(rid[0]);
    bool gone = false;
    for (int i = 0; i < 400 && !(gone = !handoff_stored(c, rid)); i++)
        usleep(5000); /* deleted right after the finish */
    cr_assert(gone, "the handoff of %s is still in the store", rid);
    atomic_store(&D1.fail, 0);
    cr_assert_eq(gen(b, &s, 10, NULL), DI_OK);
    wait_for(&s, 0);
    cr_assert_eq(s.reason, RT_FINISH_LENGTH, "%s", s.msg);
    pthread_mutex_lock(&g_rid_mu);
    snprintf(rid, sizeof rid, "%s", g_rid);
    pthread_mutex_unlock(&g_rid_mu);
    usleep(200000);
    cr_assert(handoff_stored(c, rid), "a finished request's handoff was deleted");
    g_store = NULL;
    pd_free(b);
    rk_free(t);
    fake_stop(&P1);
    fake_stop(&D1);
    kvc_close(fc);
    kvc_close(c);
    th_store_stop(&st);
}

Test(pd, ranks_that_miss_heartbeats_leave_rotation_and_come_back, .timeout = 90)
{
    reset_fakes();
    fake_start(&P1, PL_PREFILL, 0);
    fake_start(&P2, PL_PREFILL, 0);
    fake_start(&D1, PL_DECODE, 0);
    rk_table *t = ranks_new(100);
    add(t, &P1); /* index 0 */
    add(t, &P2); /* index 1 */
    add(t, &D1); /* index 2 */
    polls(t, 2);
    cr_assert_eq(rk_health(t, 0), PL_HEALTHY);
    cr_assert_eq(rk_health(t, 1), PL_HEALTHY);
    pd_backend *b = backend(t, 5000);
    /* P1 goes silent: out after 5 missed heartbeats; work goes to P2 meanwhile. */
    int port = P1.port;
    fake_stop(&P1);
    for (int i = 0; i < 400 && rk_health(t, 0) != PL_OUT; i++)
        usleep(10000);
    cr_assert_eq(rk_health(t, 0), PL_OUT);
    cr_assert_neq(rk_health(t, 1), PL_OUT);
    seen s;
    for (int k = 0; k < 3; k++) {
        cr_assert_eq(gen(b, &s, 2, NULL), DI_OK);
        wait_for(&s, 0);
        cr_assert_eq(s.st, DI_OK, "%s", s.msg);
    }
    cr_assert_eq(atomic_load(&P2.calls), 3);
    uint64_t started, retries, running;
    pd_counts(b, &started, &retries, &running);
    cr_assert_eq(retries, 0, "an OUT rank was tried");
    /* It answers again: back in rotation after 2 good heartbeats. */
    fake_start(&P1, PL_PREFILL, port);
    for (int i = 0; i < 1000 && rk_health(t, 0) != PL_HEALTHY; i++)
        usleep(10000);
    cr_assert_eq(rk_health(t, 0), PL_HEALTHY);
    /* A draining rank leaves rotation too. */
    atomic_store(&P2.draining, 1);
    for (int i = 0; i < 400 && rk_health(t, 1) != PL_OUT; i++)
        usleep(10000);
    cr_assert_eq(rk_health(t, 1), PL_OUT);
    int p1 = atomic_load(&P1.calls);
    cr_assert_eq(gen(b, &s, 2, NULL), DI_OK);
    wait_for(&s, 0);
    cr_assert_eq(s.st, DI_OK, "%s", s.msg);
    cr_assert_eq(atomic_load(&P1.calls), p1 + 1);
    /* Every rank of a role out: generate refuses at once. */
    fake_stop(&D1);
    for (int i = 0; i < 400 && rk_health(t, 2) != PL_OUT; i++)
        usleep(10000);
    di_status st = gen(b, &s, 2, NULL);
    cr_assert_eq(st, DI_EUNAVAIL, "%s", di_status_str(st));
    pd_free(b);
    rk_free(t);
    fake_stop(&P1);
    fake_stop(&P2);
}

/* A rank that leaves rotation while a prefill call waits on it (a cut link answers nothing):
 * the call is cancelled and the request retried on another rank at once, not after the
 * prefill deadline. */
Test(pd, a_prefill_waiting_on_a_rank_that_left_rotation_is_retried_at_once, .timeout = 60)
{
    pd_backend *b;
    rk_table *t = setup(true, 30000, &b);
    atomic_store(&P1.delay_ms, 20000);
    atomic_store(&P2.delay_ms, 20000);
    seen s;
    cr_assert_eq(gen(b, &s, 4, NULL), DI_OK);
    for (int i = 0; i < 400 && atomic_load(&P1.calls) + atomic_load(&P2.calls) < 1; i++)
        usleep(5000);
    fake *hung = atomic_load(&P1.calls) ? &P1 : &P2, *other = hung == &P1 ? &P2 : &P1;
    size_t hung_idx = hung == &P1 ? 0 : 1;
    atomic_store(&other->delay_ms, 0);
    atomic_store(&hung->draining, 1); /* its heartbeats now fail: out of rotation */
    double secs = wait_for(&s, 0);
    cr_assert_eq(s.st, DI_OK, "%s", s.msg);
    cr_assert_eq(s.n, 4);
    cr_assert_lt(secs, 10.0, "the retry waited %.1f s", secs);
    cr_assert_eq(rk_health(t, hung_idx), PL_OUT);
    cr_assert_eq(atomic_load(&other->calls), 1);
    uint64_t started, retries, running;
    pd_counts(b, &started, &retries, &running);
    cr_assert_eq(retries, 1);
    for (int i = 0; i < 400 && atomic_load(&hung->cancels) < 1; i++)
        usleep(5000);
    cr_assert_eq(atomic_load(&hung->cancels), 1, "the call on the rank that left was cancelled");
    atomic_store(&hung->delay_ms, 0);
    teardown(t, b);
}

Test(pd, registration_adds_a_rank_once, .timeout = 30)
{
    reset_fakes();
    fake_start(&P1, PL_PREFILL, 0);
    rk_table *t = ranks_new(100);
    uint32_t n = 0;
    di_error e = {0};
    cr_assert_eq(rk_add(t, PL_PREFILL, P1.addr, true, &n, &e), DI_OK);
    cr_assert_eq(n, 1);
    cr_assert_eq(rk_add(t, PL_PREFILL, P1.addr, true, &n, &e), DI_OK);
    cr_assert_eq(n, 1, "registering again must not add a second rank");
    cr_assert_eq(rk_add(t, PL_DECODE, "", true, &n, &e), DI_EINVAL);
    polls(t, 2);
    cr_assert_eq(rk_health(t, 0), PL_HEALTHY);
    rk_free(t);
    fake_stop(&P1);
}

/* POST a JSON body to the router; the status, and the response in out. */
static int http_post(int port, const char *path, const char *body, char *out, size_t cap)
{
    char req[1024];
    snprintf(req, sizeof req, "POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
             "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s", path,
             strlen(body), body);
    return proc_http(port, req, out, cap);
}

Test(pd, di_router_serves_http_through_prefill_and_decode_ranks, .timeout = 90)
{
    reset_fakes();
    fake_start(&P1, PL_PREFILL, 0);
    fake_start(&D1, PL_DECODE, 0);
    setenv("DI_ENGINE_TOKEN", ENGINE_TOKEN, 1);
    char *extra[] = {"--prefill", P1.addr, "--decode", D1.addr, "--heartbeat", "100ms", NULL};
    int port;
    pid_t pid = proc_start_router_backend(false, extra, &port);
    char out[8192];
    const char *body = "{\"prompt\":[5,6,7,8,9],\"max_tokens\":6,\"seed\":99}";
    int st = http_post(port, "/v1/completions", body, out, sizeof out);
    cr_expect_eq(st, 200, "%s", out);
    cr_expect(strstr(out, "\"finish_reason\":\"length\"") || strstr(out, "\"finish_reason\": "
              "\"length\""), "%s", out);
    cr_expect(strstr(out, "\"completion_tokens\":6") || strstr(out, "\"completion_tokens\": 6"),
              "%s", out);
    cr_expect_eq(atomic_load(&P1.calls), 1);
    cr_expect_eq(atomic_load(&D1.calls), 1);
    cr_expect_eq(atomic_load(&D1.bad_handoff), 0);
    /* The decode rank gone: the request fails with a 5xx, not a hang. */
    fake_stop(&D1);
    st = http_post(port, "/v1/completions", body, out, sizeof out);
    cr_expect(st >= 500 && st <= 504, "status %d: %s", st, out);
    cr_expect_eq(proc_stop(pid), 0);
    fake_stop(&P1);
}
