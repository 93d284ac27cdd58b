/* The transfer thread (transfer.h) with a store that fails and one that hangs: jobs finish
 * once each, a failure touches only its request, back-off then retry, and the engine loop
 * keeps stepping while a request's KV loads (the request held until it is in place). */
#include <criterion/criterion.h>
#include <pthread.h>
#include <string.h>

#include "common/engine/engine.h"
#include "common/engine/synth.h"
#include "common/serve/transfer.h"
#include "common/util/clock.h"

#define MAX_ID 64

/* A store whose behaviour per request the test sets. */
typedef struct fake_store {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t fail_first[MAX_ID]; /* this many calls of the request fail */
    bool fail_always[MAX_ID];
    bool gate[MAX_ID];           /* calls of the request wait until the gate opens */
    uint32_t calls[MAX_ID];
    uint32_t entered[MAX_ID];    /* calls begun (before the gate) */
    uint64_t order[256];         /* request ids in call order */
    uint32_t n_order;
} fake_store;

static di_status fake_call(void *ctx, xfer_kind kind, uint64_t id, void *job, di_error *err)
{
    fake_store *f = ctx;
    pthread_mutex_lock(&f->mu);
    f->entered[id]++;
    while (f->gate[id])
        pthread_cond_wait(&f->cv, &f->mu);
    uint32_t n = f->calls[id]++;
    if (f->n_order < 256)
        f->order[f->n_order++] = id;
    bool fail = f->fail_always[id] || n < f->fail_first[id];
    pthread_mutex_unlock(&f->mu);
    (*(int *)job)++;
    if (fail)
        return di_fail(err, DI_EUNAVAIL, "store down for request %llu", (unsigned long long)id);
    return DI_OK;
}

static fake_store *fake_new(void)
{
    fake_store *f = calloc(1, sizeof(*f));
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    return f;
}

static void fake_open_gate(fake_store *f, uint64_t id)
{
    pthread_mutex_lock(&f->mu);
    f->gate[id] = false;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

/* Opens gate 1 after 50 ms. */
static void *open_later(void *arg)
{
    nanosleep(&(struct timespec){0, 50000000}, NULL);
    fake_open_gate(arg, 1);
    return NULL;
}

static xfer *make(fake_store *f, uint32_t attempts, uint64_t backoff_ns)
{
    xfer_config c = {.store = {.ctx = f, .call = fake_call}, .max_jobs = 32,
                     .max_attempts = attempts, .backoff_ns = backoff_ns,
                     .max_backoff_ns = 8 * backoff_ns};
    xfer *x = NULL;
    di_error err;
    cr_assert_eq(xfer_create(&c, &x, &err), DI_OK, "%s", err.msg);
    return x;
}

/* Polls until n jobs have finished (at most 20 s). */
static size_t collect(xfer *x, xfer_done *out, size_t n)
{
    size_t got = 0;
    uint64_t end = di_mono_ns() + 20000000000ull;
    while (got < n && di_mono_ns() < end) {
        got += xfer_poll(x, out + got, n - got);
        if (got < n)
            nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    cr_assert_eq(got, n, "%zu of %zu jobs finished", got, n);
    return got;
}

Test(transfer, jobs_finish_once_each_in_order, .timeout = 60)
{
    fake_store *f = fake_new();
    xfer *x = make(f, 1, 1000000);
    int jobs[10] = {0};
    di_error err;
    for (uint64_t id = 1; id <= 10; id++)
        cr_assert_eq(xfer_submit(x, XFER_STORE, id, &jobs[id - 1], &err), DI_OK, "%s", err.msg);
    xfer_done d[10];
    collect(x, d, 10);
    for (int i = 0; i < 10; i++) {
        cr_assert_eq(d[i].request_id, (uint64_t)i + 1);
        cr_assert_eq(d[i].status, DI_OK);
        cr_assert_eq(d[i].job, &jobs[i]);
        cr_assert_eq(jobs[i], 1, "called once");
    }
    cr_assert_eq(xfer_poll(x, d, 10), 0, "nothing twice");
    xfer_stats s = xfer_get_stats(x);
    cr_assert_eq(s.done_ok, 10);
    cr_assert_eq(s.pending, 0);
    xfer_destroy(x);
    free(f);
}

/* Request 2's calls always fail: it alone fails, after max_attempts calls and back-offs; the
 * jobs before and after it are stored. */
Test(transfer, a_failure_touches_only_its_request, .timeout = 60)
{
    fake_store *f = fake_new();
    f->fail_always[2] = true;
    xfer *x = make(f, 3, 1000000);
    int jobs[3] = {0};
    di_error err;
    for (uint64_t id = 1; id <= 3; id++)
        cr_assert_eq(xfer_submit(x, XFER_LOAD, id, &jobs[id - 1], &err), DI_OK);
    xfer_done d[3];
    collect(x, d, 3);
    cr_assert_eq(d[0].status, DI_OK);
    cr_assert_eq(d[1].request_id, 2);
    cr_assert_eq(d[1].status, DI_EUNAVAIL);
    cr_assert_eq(d[1].attempts, 3);
    cr_assert(strstr(d[1].err.msg, "store down for request 2"), "%s", d[1].err.msg);
    cr_assert_eq(d[2].status, DI_OK, "the store is tried again after the back-off");
    xfer_stats s = xfer_get_stats(x);
    cr_assert_eq(s.failed, 1);
    cr_assert_eq(s.retries, 2);
    cr_assert_eq(s.backoffs, 3);
    xfer_destroy(x);
    free(f);
}

/* A store down for two calls: the job waits out 10 + 20 ms of back-off and succeeds. */
Test(transfer, back_off_then_the_store_is_tried_again, .timeout = 60)
{
    fake_store *f = fake_new();
    f->fail_first[1] = 2;
    xfer *x = make(f, 5, 10000000);
    int job = 0;
    di_error err;
    uint64_t t0 = di_mono_ns();
    cr_assert_eq(xfer_submit(x, XFER_STORE, 1, &job, &err), DI_OK);
    xfer_done d;
    collect(x, &d, 1);
    uint64_t dt = di_mono_ns() - t0;
    cr_assert_eq(d.status, DI_OK);
    cr_assert_eq(d.attempts, 3);
    cr_assert_geq(dt, 30000000, "waited %llu ns, less than the back-offs",
                  (unsigned long long)dt);
    cr_assert_eq(xfer_get_stats(x).backoffs, 2);
    xfer_destroy(x);
    free(f);
}

Test(transfer, cancel_and_destroy_with_jobs_queued, .timeout = 60)
{
    fake_store *f = fake_new();
    f->gate[1] = true; /* the first job hangs in the store: the rest stay queued */
    xfer *x = make(f, 1, 1000000);
    int jobs[4] = {0};
    di_error err;
    cr_assert_eq(xfer_submit(x, XFER_LOAD, 1, &jobs[0], &err), DI_OK);
    cr_assert_eq(xfer_submit(x, XFER_LOAD, 2, &jobs[1], &err), DI_OK);
    cr_assert_eq(xfer_submit(x, XFER_STORE, 2, &jobs[2], &err), DI_OK);
    cr_assert_eq(xfer_submit(x, XFER_STORE, 3, &jobs[3], &err), DI_OK);
    cr_assert_eq(xfer_wait(x, 20000000, &err), DI_ETIMEDOUT);
    cr_assert_eq(xfer_cancel(x, 2), 2);
    xfer_done d[4];
    cr_assert_eq(xfer_poll(x, d, 4), 2);
    cr_assert_eq(d[0].status, DI_ECANCELED);
    cr_assert_eq(d[1].status, DI_ECANCELED);
    cr_assert_eq(jobs[1] + jobs[2], 0, "canceled jobs never reach the store");
    fake_open_gate(f, 1);
    cr_assert_eq(xfer_wait(x, 20000000000ull, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(xfer_poll(x, d, 4), 2);
    /* destroy with one job in the store and one queued: it waits for the first, drops the
     * second without calling the store */
    pthread_mutex_lock(&f->mu);
    f->gate[1] = true;
    pthread_mutex_unlock(&f->mu);
    int hung = 0, queued = 0;
    cr_assert_eq(xfer_submit(x, XFER_STORE, 1, &hung, &err), DI_OK);
    cr_assert_eq(xfer_submit(x, XFER_STORE, 5, &queued, &err), DI_OK);
    for (bool in = false; !in;) { /* until job 1 is in the store */
        pthread_mutex_lock(&f->mu);
        in = f->entered[1] == 2;
        pthread_mutex_unlock(&f->mu);
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    pthread_t opener;
    pthread_create(&opener, NULL, open_later, f);
    xfer_destroy(x);
    pthread_join(opener, NULL);
    cr_assert_eq(hung, 1);
    cr_assert_eq(queued, 0, "a queued job is dropped at destroy");
    free(f);
}

Test(transfer, bad_config_and_a_full_queue_are_refused)
{
    fake_store *f = fake_new();
    xfer *x = NULL;
    di_error err;
    xfer_config c = {.store = {.ctx = f, .call = fake_call}, .max_jobs = 2, .max_attempts = 1,
                     .backoff_ns = 10, .max_backoff_ns = 5};
    cr_assert_eq(xfer_create(&c, &x, &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "back-off"), "%s", err.msg);
    c.max_backoff_ns = 10;
    c.max_attempts = 0;
    cr_assert_eq(xfer_create(&c, &x, &err), DI_EINVAL);
    c.max_attempts = 1;
    c.store.call = NULL;
    cr_assert_eq(xfer_create(&c, &x, &err), DI_EINVAL);
    cr_assert_null(x);
    c.store.call = fake_call;
    f->gate[1] = true;
    cr_assert_eq(xfer_create(&c, &x, &err), DI_OK, "%s", err.msg);
    int j = 0;
    cr_assert_eq(xfer_submit(x, XFER_STORE, 1, &j, &err), DI_OK);
    cr_assert_eq(xfer_submit(x, XFER_STORE, 1, &j, &err), DI_OK);
    cr_assert_eq(xfer_submit(x, XFER_STORE, 1, &j, &err), DI_EFULL);
    cr_assert_eq(xfer_submit(x, XFER_STORE, 1, NULL, &err), DI_EINVAL);
    fake_open_gate(f, 1);
    xfer_destroy(x);
    xfer_destroy(NULL);
    free(f);
}

/* ---- with the engine loop ---- */

typedef struct outs {
    uint32_t tokens[MAX_ID];
    sched_finish finish[MAX_ID];
    uint32_t finals[MAX_ID];
} outs;

static void on_out(void *ud, const engine_output *o)
{
    outs *w = ud;
    w->tokens[o->request_id] += o->n_tokens;
    if (o->finish != SCHED_FINISH_NONE) {
        w->finish[o->request_id] = o->finish;
        w->finals[o->request_id]++;
    }
}

/* Request 1 decodes; request 2's KV load hangs in the store: the engine keeps stepping request
 * 1 while 2 is held; request 3's load fails: only 3 ends (failed by the service: abort). When
 * 2's load arrives it is made ready and runs. Nothing leaks. */
Test(transfer, the_engine_steps_while_a_request_loads_and_a_failed_load_ends_only_it,
     .timeout = 60)
{
    fake_store *f = fake_new();
    f->gate[2] = true;
    f->fail_always[3] = true;
    xfer *x = make(f, 2, 1000000);
    synth *y = NULL;
    di_error err;
    synth_config sc = {.seed = 3, .nextn = 2, .vocab_size = 100, .eos_token = -1,
                       .accept_rate = 0.5};
    cr_assert_eq(synth_create(&sc, 16, NULL, &y, &err), DI_OK);
    outs w = {0};
    engine_config c = {.exec = synth_executor(y), .on_output = on_out, .userdata = &w};
    sched_config_default(&c.sched);
    c.sched.num_blocks = 65;
    c.sched.num_slots = 16;
    c.sched.max_num_seqs = 8;
    c.sched.nextn = 2;
    c.sched.prefill_attempt_interval = 1;
    c.sched.prefill_any_attempt_interval = 1;
    engine *e = NULL;
    cr_assert_eq(engine_create(&c, &e, &err), DI_OK, "%s", err.msg);
    uint32_t blocks0 = sched_free_blocks(engine_sched(e));
    int32_t tok[300];
    for (int i = 0; i < 300; i++)
        tok[i] = 5 + i % 50;
    sched_request r1 = {.id = 1, .prompt = tok, .prompt_len = 40, .max_tokens = 60};
    cr_assert_eq(engine_add(e, &r1, NULL, NULL, &err), DI_OK, "%s", err.msg);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(engine_step(e, NULL, &err), DI_OK, "%s", err.msg);
    int job2 = 0, job3 = 0;
    for (uint64_t id = 2; id <= 3; id++) { /* a 256-token prefix hit each, loaded first */
        sched_request r = {.id = id, .prompt = tok, .prompt_len = 300, .max_tokens = 5,
                           .hold = true, .kv_cached = 256, .window_cached = true};
        cr_assert_eq(engine_add(e, &r, NULL, NULL, &err), DI_OK, "%s", err.msg);
    }
    /* one thread runs the jobs in order: 3's load first, or it would wait behind 2's (a call
     * that hangs holds the queue for its deadline) */
    cr_assert_eq(xfer_submit(x, XFER_LOAD, 3, &job3, &err), DI_OK);
    cr_assert_eq(xfer_submit(x, XFER_LOAD, 2, &job2, &err), DI_OK);
    uint32_t before = w.tokens[1];
    bool failed3 = false;
    for (int i = 0; i < 15 || (!failed3 && i < 5000); i++) {
        if (engine_has_work(e))
            cr_assert_eq(engine_step(e, NULL, &err), DI_OK, "%s", err.msg);
        xfer_done d;
        while (xfer_poll(x, &d, 1)) {
            cr_assert_eq(d.request_id, 3, "only request 3's load can finish: 2 hangs");
            cr_assert_eq(d.status, DI_EUNAVAIL);
            cr_assert_eq(engine_abort(e, 3, &err), DI_OK, "%s", err.msg);
            failed3 = true;
        }
        if (!failed3)
            nanosleep(&(struct timespec){0, 2000000}, NULL);
    }
    cr_assert_gt(w.tokens[1], before, "request 1 kept decoding while 2 was loading");
    cr_assert_eq(w.tokens[2], 0, "request 2 is held while its KV loads");
    cr_assert(failed3, "request 3's load failed");
    cr_assert_eq(w.finish[3], SCHED_FINISH_ABORT);
    fake_open_gate(f, 2);
    xfer_done d;
    collect(x, &d, 1);
    cr_assert_eq(d.request_id, 2);
    cr_assert_eq(d.status, DI_OK);
    cr_assert_eq(engine_set_ready(e, 2, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(engine_run(e, 1000, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(w.tokens[2], 5);
    for (uint64_t id = 1; id <= 3; id++)
        cr_assert_eq(w.finals[id], 1);
    cr_assert_eq(sched_free_blocks(engine_sched(e)), blocks0, "blocks leaked");
    cr_assert_eq(engine_get_stats(e)->live, 0);
    engine_destroy(e);
    synth_destroy(y);
    xfer_destroy(x);
    free(f);
}

/* A load that must not wait (a prefix hit: the request goes on without it) completes with
 * DI_EUNAVAIL and no call while the store backs off; a store job behind the back-off waits and
 * is tried again; per-job attempts override the config's. */
Test(transfer, a_no_wait_load_is_skipped_during_a_back_off_and_a_store_job_waits)
{
    fake_store *f = fake_new();
    f->fail_first[1] = 1; /* the store job of request 1 fails once, then succeeds */
    xfer *x = make(f, 3, 400000000ull); /* 400 ms: far longer than the skip takes */
    int j1 = 0, j2 = 0, j3 = 0;
    di_error err;
    cr_assert_eq(xfer_submit(x, XFER_STORE, 1, &j1, &err), DI_OK);
    cr_assert_eq(xfer_wait(x, 0, &err), DI_ETIMEDOUT, "the store job waits in its back-off");
    xfer_job_opts nw = {.max_attempts = 1, .no_wait = true};
    cr_assert_eq(xfer_submit_opts(x, XFER_LOAD, 2, &j2, &nw, &err), DI_OK);
    xfer_done d[4];
    size_t n = 0;
    uint64_t t0 = di_mono_ns();
    while (n == 0 && di_mono_ns() - t0 < 5000000000ull) {
        n = xfer_poll(x, d, 4);
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    cr_assert_eq(n, 1);
    cr_assert_eq(d[0].request_id, 2);
    cr_assert_eq(d[0].status, DI_EUNAVAIL, "%s", d[0].err.msg);
    cr_assert_eq(d[0].attempts, 0, "no call during the back-off");
    cr_assert_eq(j2, 0);
    cr_assert(strstr(d[0].err.msg, "backing off"), "%s", d[0].err.msg);
    /* after the back-off: the store job is retried and succeeds, the store is used again */
    cr_assert_eq(xfer_wait(x, 10000000000ull, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(xfer_poll(x, d, 4), 1);
    cr_assert_eq(d[0].request_id, 1);
    cr_assert_eq(d[0].status, DI_OK);
    cr_assert_eq(d[0].attempts, 2);
    cr_assert_eq(xfer_submit_opts(x, XFER_LOAD, 3, &j3, &nw, &err), DI_OK);
    cr_assert_eq(xfer_wait(x, 10000000000ull, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(xfer_poll(x, d, 4), 1);
    cr_assert_eq(d[0].status, DI_OK, "the back-off ended with the success");
    cr_assert_eq(j3, 1);
    xfer_stats s = xfer_get_stats(x);
    cr_assert_eq(s.skipped, 1);
    cr_assert_eq(s.pending, 0);
    xfer_destroy(x);
    free(f);
}
