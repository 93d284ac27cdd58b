/* Cancellation and deadlines reach the engine: a streaming method feeds requests to a real
 * scheduler (common/engine) driven by one engine thread, as a decode service will. Each step's
 * tokens go out with rpc_call_write; a client cancel or the server's deadline posts an abort
 * to the engine thread, which calls sched_abort, frees the request's blocks and slot, and
 * finishes the call. Afterwards the scheduler holds nothing (free blocks and slots back to
 * their first values, no live request, invariants checked) and the server no call handle. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/engine/scheduler.h"
#include "common/net/rpc.h"
#include "common/util/clock.h"
#include "tests/net/loopback.h"

#define MAX_REQ 64

typedef struct engine engine;

/* One request slot: what the cancel function needs, stable while the call lives. */
typedef struct req_slot {
    engine *eng;
    uint64_t id;
    rpc_call *call;        /* NULL when free (guarded by eng->mu) */
    di_status abort_why;   /* set by the cancel function; the engine aborts (guarded) */
} req_slot;

struct engine {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    sched *s;              /* owned by the engine thread once it runs */
    req_slot slots[MAX_REQ];
    uint32_t adds[MAX_REQ];    /* pending additions: max_tokens by slot (0 = none) */
    int quit;
    atomic_int aborted;    /* sched_abort calls that found their request */
    atomic_int timed_out;  /* of those, for a deadline */
};

static engine eng;

static void on_cancel(void *ud, di_status why)
{
    req_slot *r = ud;
    pthread_mutex_lock(&r->eng->mu);
    r->abort_why = why;
    pthread_cond_signal(&r->eng->cv);
    pthread_mutex_unlock(&r->eng->mu);
}

static di_status s_generate(void *svc, const rpc_request *req, rpc_call *call, di_error *err)
{
    engine *e = svc;
    uint32_t max_tokens;
    if (req->len != 4)
        return di_fail(err, DI_EINVAL, "Generate needs 4 bytes");
    memcpy(&max_tokens, req->data, 4);
    pthread_mutex_lock(&e->mu);
    int free_slot = -1;
    for (int i = 0; i < MAX_REQ && free_slot < 0; i++)
        if (!e->slots[i].call && !e->adds[i])
            free_slot = i;
    if (free_slot < 0) {
        pthread_mutex_unlock(&e->mu);
        return di_fail(err, DI_EFULL, "%d requests in flight", MAX_REQ);
    }
    req_slot *r = &e->slots[free_slot];
    r->eng = e;
    r->id = (uint64_t)free_slot;
    r->call = call;
    r->abort_why = DI_OK;
    e->adds[free_slot] = max_tokens;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    rpc_call_on_cancel(call, on_cancel, r);
    return DI_OK;
}

/* A call to finish once the engine lock is released (finish waits for a running cancel
 * function, which takes that lock). */
typedef struct ending {
    rpc_call *call;
    di_status st;
} ending;

/* Takes additions and aborts from the mailbox (mu held). */
static void take_mail(engine *e, ending *ends, size_t *n_ends)
{
    for (int i = 0; i < MAX_REQ; i++) {
        req_slot *r = &e->slots[i];
        di_error err;
        if (e->adds[i]) {
            int32_t prompt[40];
            for (int k = 0; k < 40; k++)
                prompt[k] = 10 + k;
            sched_request rq = {.id = r->id, .prompt = prompt, .prompt_len = 40,
                                .max_tokens = e->adds[i], .ignore_eos = true};
            e->adds[i] = 0;
            if (sched_add_request(e->s, &rq, &err) != DI_OK) {
                ends[(*n_ends)++] = (ending){r->call, err.code};
                r->call = NULL;
            }
        }
        if (r->call && r->abort_why != DI_OK) {
            sched_output out;
            if (sched_abort(e->s, r->id, &out, &err) == DI_OK) {
                cr_assert_eq(out.finish, SCHED_FINISH_ABORT);
                atomic_fetch_add(&e->aborted, 1);
                if (r->abort_why == DI_ETIMEDOUT)
                    atomic_fetch_add(&e->timed_out, 1);
            }
            ends[(*n_ends)++] = (ending){r->call, r->abort_why};
            r->call = NULL;
        }
    }
}

/* One step with a synthetic runner: every row samples token 7. */
static void step(engine *e, ending *ends, size_t *n_ends)
{
    sched_plan *plan = NULL;
    di_error err;
    cr_assert_eq(sched_schedule(e->s, &plan, &err), DI_OK, "%s", err.msg);
    static sched_seq_result res[MAX_REQ * 2];
    size_t n = plan->placeholder ? 0 : plan->n_seqs;
    cr_assert_leq(n, MAX_REQ * 2);
    for (size_t i = 0; i < n; i++)
        res[i] = (sched_seq_result){.n_tokens = 1, .tokens = {7}};
    const sched_output *outs = NULL;
    size_t n_outs = 0;
    cr_assert_eq(sched_process_outputs(e->s, plan, n ? res : NULL, n, &outs, &n_outs, &err),
                 DI_OK, "%s", err.msg);
    cr_assert_eq(sched_check(e->s, &err), DI_OK, "%s", err.msg);
    for (size_t i = 0; i < n_outs; i++) {
        req_slot *r = &e->slots[outs[i].request_id];
        if (!r->call)
            continue;
        for (uint32_t k = 0; k < outs[i].n_tokens; k++)
            rpc_call_write(r->call, &outs[i].tokens[k], 4, NULL); /* a cancel shows up next */
        if (outs[i].finish != SCHED_FINISH_NONE) {
            ends[(*n_ends)++] = (ending){r->call, DI_OK};
            r->call = NULL;
        }
    }
}

static void *engine_main(void *arg)
{
    engine *e = arg;
    ending ends[MAX_REQ * 2];
    pthread_mutex_lock(&e->mu);
    while (!e->quit) {
        size_t n_ends = 0;
        take_mail(e, ends, &n_ends);
        int work = sched_has_work(e->s);
        if (work)
            step(e, ends, &n_ends);
        pthread_mutex_unlock(&e->mu);
        for (size_t i = 0; i < n_ends; i++)
            rpc_call_finish(ends[i].call, ends[i].st, NULL, 0,
                            ends[i].st == DI_OK ? NULL : "request aborted in the engine");
        if (work)
            usleep(1000); /* the forward's time */
        pthread_mutex_lock(&e->mu);
        if (!work && !n_ends && !e->quit)
            pthread_cond_wait(&e->cv, &e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

static const rpc_async_method methods[] = {
    /* name, start, stream, default deadline (ms), idempotent, largest request, role */
    {"/t.E/Generate", s_generate, 1, 30000, 0, 64, RPC_ROLE_ENGINE},
    {"/t.E/Short", s_generate, 1, 300, 0, 64, RPC_ROLE_ENGINE},
};

static pthread_t engine_thread;
static uint32_t blocks0, slots0;

static rpc_server *start(int *port)
{
    sched_config c;
    sched_config_default(&c);
    c.num_blocks = 513;
    c.num_slots = 64;
    c.max_num_seqs = 64;
    c.nextn = 0;
    di_error e;
    pthread_mutex_init(&eng.mu, NULL);
    pthread_cond_init(&eng.cv, NULL);
    cr_assert_eq(sched_create(&c, &eng.s, &e), DI_OK, "%s", e.msg);
    blocks0 = sched_free_blocks(eng.s);
    slots0 = sched_free_slots(eng.s);
    cr_assert_eq(pthread_create(&engine_thread, NULL, engine_main, &eng), 0);
    rpc_server_config sc = {.listen = "127.0.0.1:0", .async_methods = methods,
                            .n_async_methods = 2, .svc = &eng, .threads = 2};
    rpc_server *s = NULL;
    cr_assert_eq(rpc_server_start(&sc, &s, port, &e), DI_OK, "%s", e.msg);
    return s;
}

/* Stops everything and checks the scheduler let go of every block and slot. */
static void finish_all(rpc_server *s)
{
    uint64_t until = di_mono_ns() + 10000000000ull;
    while (rpc_server_live_calls(s) > 0 && di_mono_ns() < until)
        usleep(2000);
    cr_assert_eq(rpc_server_live_calls(s), 0, "call handles left alive");
    rpc_server_stop(s, 1000);
    pthread_mutex_lock(&eng.mu);
    eng.quit = 1;
    pthread_cond_signal(&eng.cv);
    pthread_mutex_unlock(&eng.mu);
    pthread_join(engine_thread, NULL);
    cr_assert_eq(sched_num_live(eng.s), 0, "requests left in the scheduler");
    cr_assert_eq(sched_free_blocks(eng.s), blocks0, "blocks not returned");
    cr_assert_eq(sched_free_slots(eng.s), slots0, "slots not returned");
    di_error e;
    cr_assert_eq(sched_check(eng.s, &e), DI_OK, "%s", e.msg);
    sched_destroy(eng.s);
}

static rpc_stream *generate(rpc_client *c, const char *method, uint32_t max_tokens)
{
    rpc_stream *st = NULL;
    di_error e;
    cr_assert_eq(rpc_stream_open(c, method, &max_tokens, 4, 30000, &st, &e), DI_OK);
    return st;
}

/* Reads n tokens (each 7). */
static void read_tokens(rpc_stream *st, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *m = NULL;
        size_t len = 0;
        int done = 0;
        di_error e;
        cr_assert_eq(rpc_stream_read(st, &m, &len, &done, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(done, 0, "the stream ended after %u tokens", i);
        cr_assert_eq(len, 4);
        int32_t t;
        memcpy(&t, m, 4);
        cr_assert_eq(t, 7);
        free(m);
    }
}

TestSuite(engine_cancel, .timeout = 60);

Test(engine_cancel, a_request_runs_to_its_length)
{
    int port;
    rpc_server *s = start(&port);
    rpc_client *c = loopback_client(port, NULL);
    rpc_stream *st = generate(c, "/t.E/Generate", 50);
    uint32_t n = 0;
    di_error e;
    cr_assert_eq(loopback_read_rest(st, &n, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(n, 50);
    rpc_stream_close(st);
    rpc_client_close(c);
    finish_all(s);
    cr_assert_eq(atomic_load(&eng.aborted), 0);
}

Test(engine_cancel, a_client_cancel_aborts_the_request_in_the_scheduler)
{
    int port;
    rpc_server *s = start(&port);
    rpc_client *c = loopback_client(port, NULL);
    rpc_stream *st = generate(c, "/t.E/Generate", 100000);
    read_tokens(st, 5);
    rpc_stream_cancel(st);
    uint32_t n = 0;
    di_error e;
    cr_assert_eq(loopback_read_rest(st, &n, &e), DI_ECANCELED);
    rpc_stream_close(st);
    uint64_t until = di_mono_ns() + 10000000000ull;
    while (atomic_load(&eng.aborted) < 1 && di_mono_ns() < until)
        usleep(2000);
    cr_assert_eq(atomic_load(&eng.aborted), 1, "the engine never aborted the request");
    rpc_client_close(c);
    finish_all(s);
}

Test(engine_cancel, the_deadline_aborts_the_request_in_the_scheduler)
{
    int port;
    rpc_server *s = start(&port);
    rpc_client *c = loopback_client(port, NULL);
    rpc_stream *st = generate(c, "/t.E/Short", 100000);
    uint32_t n = 0;
    di_error e;
    cr_assert_eq(loopback_read_rest(st, &n, &e), DI_ETIMEDOUT, "%s", e.msg);
    cr_assert_gt(n, 0);
    rpc_stream_close(st);
    rpc_client_close(c);
    finish_all(s);
    cr_assert_eq(atomic_load(&eng.aborted), 1);
    cr_assert_eq(atomic_load(&eng.timed_out), 1);
}

#define N_CONC 16

Test(engine_cancel, many_requests_half_cancelled)
{
    int port;
    rpc_server *s = start(&port);
    rpc_client *c = loopback_client(port, NULL);
    rpc_stream *st[N_CONC];
    for (int i = 0; i < N_CONC; i++)
        st[i] = generate(c, "/t.E/Generate", i % 2 ? 100000 : 30);
    for (int i = 0; i < N_CONC; i++) {
        read_tokens(st[i], 3);
        if (i % 2)
            rpc_stream_cancel(st[i]);
    }
    for (int i = 0; i < N_CONC; i++) {
        uint32_t n = 3;
        di_error e;
        di_status fin = loopback_read_rest(st[i], &n, &e);
        if (i % 2)
            cr_assert_eq(fin, DI_ECANCELED, "stream %d: %s", i, di_status_name(fin));
        else {
            cr_assert_eq(fin, DI_OK, "stream %d: %s", i, e.msg);
            cr_assert_eq(n, 30);
        }
        rpc_stream_close(st[i]);
    }
    rpc_client_close(c);
    uint64_t until = di_mono_ns() + 10000000000ull;
    while (atomic_load(&eng.aborted) < N_CONC / 2 && di_mono_ns() < until)
        usleep(2000);
    finish_all(s);
    cr_assert_eq(atomic_load(&eng.aborted), N_CONC / 2);
}
