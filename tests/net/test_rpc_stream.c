/* Server streaming and reply-later calls (common/net/rpc.h) on loopback: message order,
 * replies sent from another thread, failures after some messages, a client cancel and a
 * vanished client reaching the handler's cancel function exactly once, server and client
 * deadlines, many concurrent streams, a server stopped mid-stream, a slow reader, and every
 * call handle freed afterwards (the server's live-call count back to zero). */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/net/rpc.h"
#include "tests/net/loopback.h"
#include "common/util/clock.h"

/* What the test service counts (one per test process). */
typedef struct test_svc {
    atomic_int cancels;          /* cancel functions run */
    atomic_int finished;         /* calls finished by producers */
    atomic_int writes_refused;   /* writes that failed with DI_ECANCELED or DI_ETIMEDOUT */
    atomic_int last_why;         /* the last cancel's reason */
    atomic_int sent;             /* messages written successfully */
    atomic_int started;          /* calls that reached a start function */
} test_svc;

static test_svc svc;

/* One call's producer: writes n messages (4-byte little-endian indexes) delay_us apart, then
 * finishes; with hold set it then waits for the cancel before finishing. */
typedef struct job {
    rpc_call *call;
    uint32_t n, delay_us, hold, fail;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int cancelled;
    int later;     /* reply-later unary: reply with the request bytes reversed */
    uint8_t req[64];
    size_t req_len;
} job;

static void on_cancel(void *ud, di_status why)
{
    job *j = ud;
    pthread_mutex_lock(&j->mu);
    j->cancelled++;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    atomic_fetch_add(&svc.cancels, 1);
    atomic_store(&svc.last_why, (int)why);
}

/* Waits up to us microseconds or until cancelled; returns 1 when cancelled. */
static int wait_cancel(job *j, uint64_t us)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    uint64_t ns = (uint64_t)until.tv_nsec + us * 1000ull;
    until.tv_sec += (time_t)(ns / 1000000000ull);
    until.tv_nsec = (long)(ns % 1000000000ull);
    pthread_mutex_lock(&j->mu);
    while (!j->cancelled)
        if (pthread_cond_timedwait(&j->cv, &j->mu, &until) != 0)
            break;
    int c = j->cancelled;
    pthread_mutex_unlock(&j->mu);
    return c;
}

static void *producer(void *arg)
{
    job *j = arg;
    if (j->later) {
        wait_cancel(j, j->delay_us);
        uint8_t rev[64];
        for (size_t i = 0; i < j->req_len; i++)
            rev[i] = j->req[j->req_len - 1 - i];
        rpc_call_finish(j->call, DI_OK, rev, j->req_len, NULL);
    } else {
        for (uint32_t i = 0; i < j->n; i++) {
            uint8_t m[4] = {(uint8_t)i, (uint8_t)(i >> 8), (uint8_t)(i >> 16), (uint8_t)(i >> 24)};
            di_error e;
            di_status st = rpc_call_write(j->call, m, sizeof(m), &e);
            if (st == DI_ECANCELED || st == DI_ETIMEDOUT || st == DI_EUNAVAIL) {
                atomic_fetch_add(&svc.writes_refused, 1);
                break;
            }
            cr_assert_eq(st, DI_OK, "%s", e.msg);
            atomic_fetch_add(&svc.sent, 1);
            if (j->delay_us && wait_cancel(j, j->delay_us))
                continue; /* the next write reports the cancel */
        }
        if (j->hold)
            while (!wait_cancel(j, 1000000))
                ;
        if (j->fail)
            rpc_call_finish(j->call, DI_ENOSPC, NULL, 0, "disk tier full after 2 messages");
        else
            rpc_call_finish(j->call, DI_OK, NULL, 0, NULL);
    }
    /* After finish the cancel function can no longer run: the job may go. */
    atomic_fetch_add(&svc.finished, 1);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
    return NULL;
}

static di_status start_job(const rpc_request *req, rpc_call *call, job *proto, di_error *err)
{
    job *j = malloc(sizeof(*j));
    cr_assert(j);
    atomic_fetch_add(&svc.started, 1);
    *j = *proto;
    j->call = call;
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    if (req->len >= 8) {
        memcpy(&j->n, req->data, 4);
        memcpy(&j->delay_us, req->data + 4, 4);
    }
    j->req_len = req->len < sizeof(j->req) ? req->len : sizeof(j->req);
    if (j->req_len)
        memcpy(j->req, req->data, j->req_len);
    rpc_call_on_cancel(call, on_cancel, j);
    pthread_t t;
    if (pthread_create(&t, NULL, producer, j) != 0) {
        /* the call is ours: finish it, then report nothing more */
        rpc_call_finish(call, DI_ENOMEM, NULL, 0, "no thread");
        free(j);
        (void)err;
    }
    pthread_detach(t);
    return DI_OK;
}

static di_status s_count(void *s, const rpc_request *req, rpc_call *call, di_error *err)
{
    (void)s;
    job p = {0};
    return start_job(req, call, &p, err);
}

static di_status s_hold(void *s, const rpc_request *req, rpc_call *call, di_error *err)
{
    (void)s;
    job p = {.hold = 1};
    return start_job(req, call, &p, err);
}

static di_status s_fail(void *s, const rpc_request *req, rpc_call *call, di_error *err)
{
    (void)s;
    job p = {.fail = 1};
    return start_job(req, call, &p, err);
}

static di_status s_later(void *s, const rpc_request *req, rpc_call *call, di_error *err)
{
    (void)s;
    job p = {.later = 1, .delay_us = 50000};
    return start_job(req, call, &p, err);
}

static di_status s_later_slow(void *s, const rpc_request *req, rpc_call *call, di_error *err)
{
    (void)s;
    job p = {.later = 1, .delay_us = 2000000};
    return start_job(req, call, &p, err);
}

static di_status s_refuse(void *s, const rpc_request *req, rpc_call *call, di_error *err)
{
    (void)s;
    (void)req;
    (void)call;
    return di_fail(err, DI_EFULL, "queue full: 8 of 8 requests waiting");
}

/* Writes 1 KiB messages until a write fails (a client that does not read), then finishes
 * with that write's status. */
static atomic_int flood_written, flood_status;

static void *flood(void *arg)
{
    rpc_call *call = arg;
    static const uint8_t kib[1024];
    di_error e;
    di_status st = DI_OK;
    for (int i = 0; i < 1000000 && st == DI_OK; i++) {
        st = rpc_call_write(call, kib, sizeof(kib), &e);
        if (st == DI_OK)
            atomic_fetch_add(&flood_written, 1);
    }
    atomic_store(&flood_status, (int)st);
    rpc_call_finish(call, st, NULL, 0, st == DI_OK ? NULL : e.msg);
    return NULL;
}

static di_status s_flood(void *s, const rpc_request *req, rpc_call *call, di_error *err)
{
    (void)s;
    (void)req;
    pthread_t t;
    if (pthread_create(&t, NULL, flood, call) != 0)
        return di_fail(err, DI_ENOMEM, "no thread");
    pthread_detach(t);
    return DI_OK;
}

/* Finishes before returning from start, from inside the worker. */
static di_status s_now(void *s, const rpc_request *req, rpc_call *call, di_error *err)
{
    (void)s;
    (void)err;
    di_error e;
    cr_assert_eq(rpc_call_write(call, req->data, req->len, &e), DI_OK, "%s", e.msg);
    rpc_call_finish(call, DI_OK, NULL, 0, NULL);
    return DI_OK;
}

static di_status h_ping(void *s, const rpc_request *req, rpc_reply *reply, di_error *err)
{
    (void)s;
    (void)err;
    reply->data = malloc(req->len + 1);
    memcpy(reply->data, req->data, req->len);
    reply->len = req->len;
    return DI_OK;
}

/* A method answered at once, served by the same server. */
static const rpc_method sync_methods[] = {
    {"/t.S/Ping", h_ping, 5000, 1, 1024, RPC_ROLE_ENGINE},
};

static const rpc_async_method methods[] = {
    /* name, start, stream, default deadline (ms), idempotent, largest request, role */
    {"/t.S/Count", s_count, 1, 20000, 1, 1024, RPC_ROLE_ENGINE},
    {"/t.S/Hold", s_hold, 1, 20000, 1, 1024, RPC_ROLE_ENGINE},
    {"/t.S/Short", s_hold, 1, 300, 1, 1024, RPC_ROLE_ENGINE},
    {"/t.S/Fail", s_fail, 1, 20000, 1, 1024, RPC_ROLE_ENGINE},
    {"/t.S/Later", s_later, 0, 20000, 1, 1024, RPC_ROLE_ENGINE},
    {"/t.S/LaterSlow", s_later_slow, 0, 20000, 1, 1024, RPC_ROLE_ENGINE},
    {"/t.S/Refuse", s_refuse, 1, 20000, 1, 1024, RPC_ROLE_ENGINE},
    {"/t.S/Now", s_now, 1, 20000, 1, 1024, RPC_ROLE_ENGINE},
    {"/t.S/Flood", s_flood, 1, 20000, 1, 1024, RPC_ROLE_ENGINE},
};
#define N_METHODS (sizeof(methods) / sizeof(methods[0]))

static rpc_server *start_server(const char *token, int *port)
{
    rpc_server_config sc = {.listen = "127.0.0.1:0", .async_methods = methods,
                            .n_async_methods = N_METHODS,
                            .methods = sync_methods, .n_methods = 1,
                            .threads = 2, .engine_token = token};
    rpc_server *s = NULL;
    di_error e;
    cr_assert_eq(rpc_server_start(&sc, &s, port, &e), DI_OK, "%s", e.msg);
    return s;
}

static void count_req(uint8_t out[8], uint32_t n, uint32_t delay_us)
{
    memcpy(out, &n, 4);
    memcpy(out + 4, &delay_us, 4);
}

/* Waits (bounded) until the predicate on an atomic counter holds. */
static int wait_for(atomic_int *v, int want, uint32_t ms)
{
    uint64_t until = di_mono_ns() + (uint64_t)ms * 1000000ull;
    while (atomic_load(v) < want && di_mono_ns() < until)
        usleep(2000);
    return atomic_load(v) >= want;
}

static void expect_idle(rpc_server *s)
{
    uint64_t until = di_mono_ns() + 5000000000ull;
    while (rpc_server_live_calls(s) > 0 && di_mono_ns() < until)
        usleep(2000);
    cr_assert_eq(rpc_server_live_calls(s), 0, "call handles left alive");
}

static rpc_stream *open_count(rpc_client *c, const char *method, uint32_t n, uint32_t delay_us,
                              uint32_t timeout_ms)
{
    uint8_t req[8];
    count_req(req, n, delay_us);
    rpc_stream *st = NULL;
    di_error e;
    cr_assert_eq(rpc_stream_open(c, method, req, 8, timeout_ms, &st, &e), DI_OK, "%s", e.msg);
    return st;
}

/* Checks that every call handle is gone, then closes both ends. */
static void teardown(rpc_server *s, rpc_client *c)
{
    expect_idle(s);
    rpc_client_close(c);
    rpc_server_stop(s, 1000);
}

/* Reads a stream to its end; returns the number of messages, checks their order. */
static uint32_t read_all(rpc_stream *st, di_status *final, di_error *e)
{
    uint32_t got = 0;
    for (;;) {
        uint8_t *m = NULL;
        size_t len = 0;
        int done = 0;
        di_status r = rpc_stream_read(st, &m, &len, &done, e);
        if (done) {
            *final = r;
            return got;
        }
        cr_assert_eq(r, DI_OK);
        cr_assert_eq(len, 4);
        uint32_t idx;
        memcpy(&idx, m, 4);
        cr_assert_eq(idx, got, "message %u arrived as number %u", idx, got);
        free(m);
        got++;
    }
}

/* Reads the rest of a stream without checking it; returns the final status. */
static di_status drain(rpc_stream *st, di_error *e)
{
    uint32_t n = 0;
    return loopback_read_rest(st, &n, e);
}


TestSuite(rpc_stream, .timeout = 60);

Test(rpc_stream, messages_arrive_in_order_then_ok)
{
    int port;
    rpc_server *s = start_server("tok", &port);
    rpc_client *c = loopback_client(port, "tok");
    di_error e;
    rpc_stream *st = open_count(c, "/t.S/Count", 500, 0, 10000);
    di_status fin;
    cr_assert_eq(read_all(st, &fin, &e), 500);
    cr_assert_eq(fin, DI_OK, "%s", e.msg);
    /* Reading after the end repeats the status. */
    uint8_t *m = NULL;
    size_t len = 0;
    int done = 0;
    cr_assert_eq(rpc_stream_read(st, &m, &len, &done, &e), DI_OK);
    cr_assert_eq(done, 1);
    rpc_stream_close(st);
    /* A start that finishes at once (message then status from the worker itself). */
    cr_assert_eq(rpc_stream_open(c, "/t.S/Now", "abcd", 4, 10000, &st, &e), DI_OK);
    cr_assert_eq(rpc_stream_read(st, &m, &len, &done, &e), DI_OK);
    cr_assert_eq(done, 0);
    cr_assert_eq(len, 4);
    cr_assert_eq(memcmp(m, "abcd", 4), 0);
    free(m);
    cr_assert_eq(rpc_stream_read(st, &m, &len, &done, &e), DI_OK);
    cr_assert_eq(done, 1);
    rpc_stream_close(st);
    cr_assert_eq(atomic_load(&svc.cancels), 0, "no call was cancelled");
    /* The table of methods answered at once works beside the asynchronous one. */
    cr_assert_eq(rpc_client_call(c, "/t.S/Ping", "pq", 2, 5000, &m, &len, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(len, 2);
    cr_assert_eq(memcmp(m, "pq", 2), 0);
    free(m);
    teardown(s, c);
}

Test(rpc_stream, failure_after_messages_and_refused_start)
{
    int port;
    rpc_server *s = start_server(NULL, &port);
    rpc_client *c = loopback_client(port, NULL);
    di_error e;
    rpc_stream *st = open_count(c, "/t.S/Fail", 2, 0, 10000);
    di_status fin;
    cr_assert_eq(read_all(st, &fin, &e), 2);
    cr_assert_eq(fin, DI_ENOSPC, "got %s", di_status_name(fin));
    cr_assert(strstr(e.msg, "disk tier full after 2 messages"), "%s", e.msg);
    rpc_stream_close(st);
    st = open_count(c, "/t.S/Refuse", 2, 0, 10000);
    cr_assert_eq(read_all(st, &fin, &e), 0);
    cr_assert_eq(fin, DI_EFULL, "got %s", di_status_name(fin));
    cr_assert(strstr(e.msg, "8 of 8 requests waiting"), "%s", e.msg);
    rpc_stream_close(st);
    teardown(s, c);
}

Test(rpc_stream, wrong_token_never_reaches_the_handler)
{
    int port;
    rpc_server *s = start_server("right", &port);
    rpc_client *c = loopback_client(port, "wrong");
    di_error e;
    rpc_stream *st = open_count(c, "/t.S/Count", 3, 0, 10000);
    di_status fin;
    cr_assert_eq(read_all(st, &fin, &e), 0);
    cr_assert_eq(fin, DI_EAUTH, "got %s", di_status_name(fin));
    rpc_stream_close(st);
    cr_assert_eq(atomic_load(&svc.sent), 0);
    teardown(s, c);
}

Test(rpc_stream, reply_later_from_another_thread)
{
    int port;
    rpc_server *s = start_server(NULL, &port);
    rpc_client *c = loopback_client(port, NULL);
    di_error e;
    uint8_t *reply = NULL;
    size_t len = 0;
    uint64_t t0 = di_mono_ns();
    cr_assert_eq(rpc_client_call(c, "/t.S/Later", "hello", 5, 10000, &reply, &len, &e), DI_OK,
                 "%s", e.msg);
    cr_assert_geq(di_mono_ns() - t0, 50000000ull, "the reply came before the producer's wait");
    cr_assert_eq(len, 5);
    cr_assert_eq(memcmp(reply, "olleh", 5), 0);
    free(reply);
    /* A deadline shorter than the producer's wait (2 s): the client sees ETIMEDOUT and the
     * handler its cancel; the late finish is harmless. (On a machine slow enough for the
     * deadline to pass before the call reaches the server, no handler starts at all.) */
    cr_assert_eq(rpc_client_call(c, "/t.S/LaterSlow", "x", 1, 200, &reply, &len, &e),
                 DI_ETIMEDOUT);
    expect_idle(s);
    int late = atomic_load(&svc.started) - 1;
    cr_assert_eq(atomic_load(&svc.finished), 1 + late);
    cr_assert_eq(atomic_load(&svc.cancels), late, "the started call was not cancelled once");
    rpc_client_close(c);
    rpc_server_stop(s, 1000);
}

typedef struct canceller {
    rpc_stream *st;
} canceller;

static void *cancel_soon(void *arg)
{
    canceller *k = arg;
    usleep(20000);
    rpc_stream_cancel(k->st);
    return NULL;
}

Test(rpc_stream, client_cancel_mid_stream_reaches_the_handler_once)
{
    int port;
    rpc_server *s = start_server(NULL, &port);
    rpc_client *c = loopback_client(port, NULL);
    di_error e;
    rpc_stream *st = open_count(c, "/t.S/Count", 100000, 1000, 30000);
    uint8_t *m = NULL;
    size_t len = 0;
    int done = 0;
    cr_assert_eq(rpc_stream_read(st, &m, &len, &done, &e), DI_OK);
    cr_assert_eq(done, 0);
    free(m);
    /* Cancel from another thread while this one reads. */
    canceller k = {st};
    pthread_t t;
    pthread_create(&t, NULL, cancel_soon, &k);
    di_status fin = drain(st, &e);
    cr_assert_eq(fin, DI_ECANCELED, "got %s", di_status_name(fin));
    pthread_join(t, NULL);
    rpc_stream_close(st);
    cr_assert(wait_for(&svc.cancels, 1, 5000), "the handler never saw the cancel");
    cr_assert(wait_for(&svc.finished, 1, 5000));
    cr_assert_eq(atomic_load(&svc.last_why), DI_ECANCELED);
    cr_assert_eq(atomic_load(&svc.writes_refused), 1, "the producer stopped at its next write");
    cr_assert_lt(atomic_load(&svc.sent), 10000);
    expect_idle(s);
    cr_assert_eq(atomic_load(&svc.cancels), 1, "cancel ran more than once");
    rpc_client_close(c);
    rpc_server_stop(s, 1000);
}

Test(rpc_stream, server_deadline_cancels_the_handler)
{
    int port;
    rpc_server *s = start_server(NULL, &port);
    rpc_client *c = loopback_client(port, NULL);
    di_error e;
    uint64_t t0 = di_mono_ns();
    /* The row's 300 ms deadline is shorter than the client's 20 s. */
    rpc_stream *st = open_count(c, "/t.S/Short", 1, 0, 20000);
    di_status fin;
    cr_assert_leq(read_all(st, &fin, &e), 1); /* none when the machine is slow */
    uint64_t took = di_mono_ns() - t0;
    cr_assert_eq(fin, DI_ETIMEDOUT, "got %s: %s", di_status_name(fin), e.msg);
    cr_assert_geq(took, 250000000ull);
    cr_assert_lt(took, 10000000000ull);
    rpc_stream_close(st);
    cr_assert(wait_for(&svc.finished, 1, 5000));
    cr_assert_eq(atomic_load(&svc.cancels), 1);
    cr_assert_eq(atomic_load(&svc.last_why), DI_ETIMEDOUT);
    teardown(s, c);
}

Test(rpc_stream, client_deadline_ends_the_stream)
{
    int port;
    rpc_server *s = start_server(NULL, &port);
    rpc_client *c = loopback_client(port, NULL);
    di_error e;
    rpc_stream *st = open_count(c, "/t.S/Hold", 1, 0, 200);
    di_status fin;
    cr_assert_leq(read_all(st, &fin, &e), 1); /* none when the machine is slow */
    cr_assert_eq(fin, DI_ETIMEDOUT, "got %s", di_status_name(fin));
    rpc_stream_close(st);
    expect_idle(s); /* the held call (if it reached the server) was cancelled and finished */
    cr_assert_eq(atomic_load(&svc.finished), atomic_load(&svc.started));
    cr_assert_eq(atomic_load(&svc.cancels), atomic_load(&svc.started));
    teardown(s, c);
}

#define N_STREAMS 32
#define N_MSGS 200

typedef struct reader {
    rpc_client *c;
    uint32_t got;
    di_status fin;
} reader;

static void *read_one(void *arg)
{
    reader *r = arg;
    uint8_t req[8];
    count_req(req, N_MSGS, 0);
    rpc_stream *st;
    di_error e;
    if (rpc_stream_open(r->c, "/t.S/Count", req, 8, 30000, &st, &e) != DI_OK) {
        r->fin = DI_EINTERNAL;
        return NULL;
    }
    r->got = read_all(st, &r->fin, &e);
    rpc_stream_close(st);
    return NULL;
}

Test(rpc_stream, many_concurrent_streams_on_one_client)
{
    int port;
    rpc_server *s = start_server(NULL, &port);
    rpc_client *c = loopback_client(port, NULL);
    reader r[N_STREAMS];
    pthread_t t[N_STREAMS];
    for (int i = 0; i < N_STREAMS; i++) {
        r[i] = (reader){.c = c};
        cr_assert_eq(pthread_create(&t[i], NULL, read_one, &r[i]), 0);
    }
    for (int i = 0; i < N_STREAMS; i++) {
        pthread_join(t[i], NULL);
        cr_assert_eq(r[i].fin, DI_OK, "stream %d: %s", i, di_status_name(r[i].fin));
        cr_assert_eq(r[i].got, N_MSGS, "stream %d got %u messages", i, r[i].got);
    }
    cr_assert(wait_for(&svc.finished, N_STREAMS, 5000));
    cr_assert_eq(atomic_load(&svc.cancels), 0);
    teardown(s, c);
}

/* The client lives in a child process forked before this process starts gRPC; it reads one
 * message, says so and is killed. */
Test(rpc_stream, vanished_client_cancels_the_handler)
{
    int to_child[2], from_child[2];
    cr_assert_eq(pipe(to_child), 0);
    cr_assert_eq(pipe(from_child), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlives a failed test */
        int port = 0;
        if (read(to_child[0], &port, sizeof(port)) != sizeof(port))
            _exit(3);
        char target[64];
        snprintf(target, sizeof(target), "127.0.0.1:%d", port);
        rpc_client_config cc = {.target = target};
        rpc_client *c = NULL;
        rpc_stream *st = NULL;
        di_error e;
        uint8_t req[8];
        count_req(req, 100000, 1000);
        if (rpc_client_open(&cc, &c, &e) != DI_OK ||
            rpc_stream_open(c, "/t.S/Count", req, 8, 30000, &st, &e) != DI_OK)
            _exit(4);
        uint8_t *m;
        size_t len;
        int done;
        if (rpc_stream_read(st, &m, &len, &done, &e) != DI_OK || done)
            _exit(5);
        char one = '1';
        if (write(from_child[1], &one, 1) != 1)
            _exit(6);
        for (;;)
            pause();
    }
    int port;
    rpc_server *s = start_server(NULL, &port);
    cr_assert_eq(write(to_child[1], &port, sizeof(port)), (ssize_t)sizeof(port));
    char one = 0;
    cr_assert_eq(read(from_child[0], &one, 1), 1, "the child never read a message");
    cr_assert_eq(atomic_load(&svc.cancels), 0);
    kill(pid, SIGKILL);
    int wst;
    waitpid(pid, &wst, 0);
    cr_assert(wait_for(&svc.cancels, 1, 10000), "the handler never learnt the client was gone");
    cr_assert(wait_for(&svc.finished, 1, 5000));
    expect_idle(s);
    cr_assert_eq(atomic_load(&svc.cancels), 1);
    rpc_server_stop(s, 1000);
}

Test(rpc_stream, server_stop_cancels_streams_in_flight)
{
    int port;
    rpc_server *s = start_server(NULL, &port);
    rpc_client *c = loopback_client(port, NULL);
    di_error e;
    rpc_stream *st = open_count(c, "/t.S/Hold", 1, 0, 30000);
    uint8_t *m = NULL;
    size_t len = 0;
    int done = 0;
    cr_assert_eq(rpc_stream_read(st, &m, &len, &done, &e), DI_OK);
    free(m);
    /* The handler holds the call until cancelled: stop must cancel it, wait for its finish and
     * return with nothing alive. */
    uint64_t t0 = di_mono_ns();
    rpc_server_stop(s, 100);
    cr_assert_lt(di_mono_ns() - t0, 5000000000ull);
    cr_assert_eq(atomic_load(&svc.cancels), 1);
    cr_assert_eq(atomic_load(&svc.last_why), DI_EUNAVAIL);
    cr_assert_eq(atomic_load(&svc.finished), 1);
    cr_assert_neq(drain(st, &e), DI_OK);
    rpc_stream_close(st);
    rpc_client_close(c);
}

Test(rpc_stream, stop_lets_a_stream_finish_within_the_grace_period)
{
    int port;
    rpc_server *s = start_server(NULL, &port);
    rpc_client *c = loopback_client(port, NULL);
    di_error e;
    rpc_stream *st = open_count(c, "/t.S/Count", 20, 5000, 30000);
    uint8_t *m = NULL;
    size_t len = 0;
    int done = 0;
    cr_assert_eq(rpc_stream_read(st, &m, &len, &done, &e), DI_OK);
    free(m);
    rpc_server_stop(s, 10000);
    cr_assert_eq(atomic_load(&svc.cancels), 0, "a stream within the grace was cancelled");
    cr_assert_eq(atomic_load(&svc.sent), 20);
    rpc_stream_close(st);
    rpc_client_close(c);
}

Test(rpc_stream, closing_an_unread_stream_cancels_it)
{
    int port;
    rpc_server *s = start_server(NULL, &port);
    rpc_client *c = loopback_client(port, NULL);
    rpc_stream *st = open_count(c, "/t.S/Hold", 1, 0, 30000);
    cr_assert(wait_for(&svc.sent, 1, 5000));
    rpc_stream_close(st);
    cr_assert(wait_for(&svc.finished, 1, 5000));
    cr_assert_eq(atomic_load(&svc.cancels), 1);
    teardown(s, c);
}

Test(rpc_stream, bad_rows_are_refused)
{
    rpc_async_method row = {"/t.S/X", NULL, 1, 1000, 1, 10, RPC_ROLE_ENGINE};
    rpc_server_config sc = {.listen = "127.0.0.1:0", .async_methods = &row,
                            .n_async_methods = 1, .threads = 1};
    rpc_server *s = NULL;
    di_error e;
    int port;
    cr_assert_eq(rpc_server_start(&sc, &s, &port, &e), DI_EINVAL, "a row without start");
    row.start = s_count;
    row.default_deadline_ms = 0;
    cr_assert_eq(rpc_server_start(&sc, &s, &port, &e), DI_EINVAL, "a row without a deadline");
    row.default_deadline_ms = 1000;
    row.role = RPC_ROLE_NONE;
    cr_assert_eq(rpc_server_start(&sc, &s, &port, &e), DI_EINVAL, "a row open to anyone");
    sc.async_methods = NULL;
    cr_assert_eq(rpc_server_start(&sc, &s, &port, &e), DI_EINVAL, "a count without a table");
    cr_assert_null(s);
}

Test(rpc_stream, a_reader_that_falls_behind_gets_efull_not_unbounded_memory)
{
    int port;
    rpc_server *s = start_server(NULL, &port);
    rpc_client *c = loopback_client(port, NULL);
    rpc_stream *st = open_count(c, "/t.S/Flood", 0, 0, 20000);
    uint64_t until = di_mono_ns() + 20000000000ull;
    while (atomic_load(&flood_status) == DI_OK && di_mono_ns() < until)
        usleep(5000);
    cr_assert_eq(atomic_load(&flood_status), DI_EFULL, "the producer was never stopped");
    /* The queue bound holds: what was accepted is the queue plus what gRPC took. */
    int written = atomic_load(&flood_written);
    cr_assert_lt(written, 1000000);
    uint32_t n = 0;
    di_error e;
    cr_assert_eq(loopback_read_rest(st, &n, &e), DI_EFULL, "%s", e.msg);
    cr_assert(strstr(e.msg, "slow reader"), "%s", e.msg);
    cr_assert_eq(n, (uint32_t)written, "every accepted message arrives before the status");
    rpc_stream_close(st);
    teardown(s, c);
}
