/* The engine loop (engine.h) on the synthetic runner, synchronous and one step ahead: every
 * request ends with exactly one final output, the executor learns each request before its
 * first plan and forgets it exactly once, never while a plan that carries it can still run,
 * and an abort from any state gives every block, slot and record back. */
#include <criterion/criterion.h>
#include <string.h>

#include "common/engine/engine.h"
#include "common/engine/synth.h"
#include "tests/engine/faulty.h"

#define MAX_ID 512

/* An executor around the synthetic runner that checks the engine's contract. */
typedef struct probe {
    synth *y;
    uint32_t added[MAX_ID];   /* exec.add calls per id */
    uint32_t removed[MAX_ID]; /* exec.remove calls per id */
    uint32_t outputs[MAX_ID]; /* outputs per id */
    uint32_t finals[MAX_ID];  /* outputs with a finish reason */
    uint32_t tokens[MAX_ID];  /* tokens received */
    sched_finish finish[MAX_ID];
    uint64_t steps;           /* plans run */
    uint64_t fail_step;       /* the step (1-based) that fails, 0 = none */
    uint64_t refuse_id;       /* exec.add refuses this id, 0 = none */
} probe;

static di_status p_add(void *ctx, const sched_request *req, const void *args, di_error *err)
{
    probe *p = ctx;
    cr_assert(req->id < MAX_ID);
    if (req->id == p->refuse_id)
        return di_fail(err, DI_EINVAL, "request %llu refused", (unsigned long long)req->id);
    cr_assert_eq(p->added[req->id], p->removed[req->id], "request %llu added twice",
                 (unsigned long long)req->id);
    p->added[req->id]++;
    return DI_OK;
}

static void p_remove(void *ctx, uint64_t id)
{
    probe *p = ctx;
    cr_assert(id < MAX_ID);
    cr_assert_eq(p->added[id], p->removed[id] + 1, "request %llu removed without being added",
                 (unsigned long long)id);
    p->removed[id]++;
}

static di_status p_step(void *ctx, const sched_plan *plan, sched_seq_result *res, di_error *err)
{
    probe *p = ctx;
    if (++p->steps == p->fail_step)
        return di_fail(err, DI_EINTERNAL, "step %llu fails", (unsigned long long)p->steps);
    if (!plan->placeholder)
        for (uint32_t i = 0; i < plan->n_seqs; i++) {
            uint64_t id = plan->seqs[i].request_id;
            cr_assert_eq(p->added[id], p->removed[id] + 1,
                         "request %llu is in a plan but the executor does not hold it",
                         (unsigned long long)id);
        }
    engine_executor sx = synth_executor(p->y);
    return sx.step(sx.ctx, plan, res, err);
}

static void p_output(void *ud, const engine_output *o)
{
    probe *p = ud;
    uint64_t id = o->request_id;
    cr_assert(id < MAX_ID);
    cr_assert_eq(p->finals[id], 0, "request %llu: output after its final one",
                 (unsigned long long)id);
    cr_assert_eq((uintptr_t)o->user, (uintptr_t)id, "the user pointer comes back");
    if (o->entry >= 0)
        cr_assert_eq(o->plan->seqs[o->entry].request_id, id);
    p->outputs[id]++;
    p->tokens[id] += o->n_tokens;
    if (o->finish != SCHED_FINISH_NONE) {
        p->finals[id]++;
        p->finish[id] = o->finish;
    }
}

typedef struct rig {
    probe *p;
    engine *e;
    uint32_t blocks0, slots0;
} rig;

static rig make(bool async, sched_engine_type type, double eos_rate)
{
    rig r = {.p = calloc(1, sizeof(probe))};
    synth_config sc = {.seed = 11, .nextn = 3, .vocab_size = 500, .eos_token = 2,
                       .accept_rate = 0.6, .eos_rate = eos_rate};
    di_error err;
    cr_assert_eq(synth_create(&sc, 64, NULL, &r.p->y, &err), DI_OK, "%s", err.msg);
    engine_config c = {.exec = {.ctx = r.p, .add = p_add, .remove = p_remove, .step = p_step},
                       .on_output = p_output, .userdata = r.p};
    sched_config_default(&c.sched);
    c.sched.type = type;
    c.sched.num_blocks = 257;
    c.sched.num_slots = 64;
    c.sched.max_num_seqs = 32;
    c.sched.nextn = 3;
    c.sched.max_num_batched_tokens = 256;
    c.sched.prefill_attempt_interval = 1;
    c.sched.prefill_any_attempt_interval = 1;
    c.sched.eos_token = 2;
    c.sched.async = async;
    cr_assert_eq(engine_create(&c, &r.e, &err), DI_OK, "%s", err.msg);
    r.blocks0 = sched_free_blocks(engine_sched(r.e));
    r.slots0 = sched_free_slots(engine_sched(r.e));
    return r;
}

static void add(rig *r, uint64_t id, uint32_t len, uint32_t max_tokens, bool hold)
{
    int32_t tok[1024];
    cr_assert(len <= 1024);
    for (uint32_t i = 0; i < len; i++)
        tok[i] = 3 + (int32_t)((id * 7 + i) % 400);
    sched_request q = {.id = id, .prompt = tok, .prompt_len = len, .max_tokens = max_tokens,
                       .hold = hold};
    di_error err;
    cr_assert_eq(engine_add(r->e, &q, NULL, (void *)(uintptr_t)id, &err), DI_OK, "%s", err.msg);
}

static void check(rig *r)
{
    di_error err;
    cr_assert_eq(sched_check(engine_sched(r->e), &err), DI_OK, "%s", err.msg);
}

static void step(rig *r)
{
    di_error err;
    cr_assert_eq(engine_step(r->e, NULL, &err), DI_OK, "%s", err.msg);
    check(r);
}

/* Runs to the end and checks that nothing is left: blocks, slots, records, executor state. */
static void drain(rig *r, uint64_t n_ids)
{
    di_error err;
    cr_assert_eq(engine_run(r->e, 10000, &err), DI_OK, "%s", err.msg);
    check(r);
    sched *s = engine_sched(r->e);
    cr_assert_eq(sched_num_live(s), 0);
    cr_assert_eq(sched_free_blocks(s), r->blocks0, "blocks leaked");
    cr_assert_eq(sched_free_slots(s), r->slots0, "slots leaked");
    const engine_stats *st = engine_get_stats(r->e);
    cr_assert_eq(st->live, 0, "%u request records left", st->live);
    cr_assert_eq(st->exec_added, st->exec_removed);
    for (uint64_t id = 1; id <= n_ids; id++)
        if (r->p->added[id])
            cr_assert_eq(r->p->removed[id], 1, "request %llu removed %u times",
                         (unsigned long long)id, r->p->removed[id]);
}

static void done(rig *r)
{
    engine_destroy(r->e);
    synth_destroy(r->p->y);
    free(r->p);
}

static void every_request_ends_once(bool async)
{
    rig r = make(async, SCHED_NORMAL, 0.02);
    for (uint64_t id = 1; id <= 40; id++)
        add(&r, id, 20 + (uint32_t)(id * 37 % 300), 5 + (uint32_t)(id % 30), false);
    drain(&r, 40);
    for (uint64_t id = 1; id <= 40; id++) {
        cr_assert_eq(r.p->finals[id], 1, "request %llu: %u final outputs",
                     (unsigned long long)id, r.p->finals[id]);
        cr_assert(r.p->finish[id] == SCHED_FINISH_STOP || r.p->finish[id] == SCHED_FINISH_LENGTH);
        cr_assert(r.p->tokens[id] >= 1 && r.p->tokens[id] <= 5 + id % 30);
    }
    done(&r);
}

Test(engine, sync_every_request_ends_once_and_nothing_leaks, .timeout = 60)
{
    every_request_ends_once(false);
}

Test(engine, async_every_request_ends_once_and_nothing_leaks, .timeout = 60)
{
    every_request_ends_once(true);
}

/* The same workload gives the same tokens through the loop, sync or async: the synthetic
 * runner draws per plan entry, so this checks the loop hands results and fixups through. */
Test(engine, sync_and_async_stop_the_same_requests_for_length, .timeout = 60)
{
    rig a = make(false, SCHED_NORMAL, 0.0), b = make(true, SCHED_NORMAL, 0.0);
    for (uint64_t id = 1; id <= 10; id++) {
        add(&a, id, 50 + (uint32_t)id * 13, 12, false);
        add(&b, id, 50 + (uint32_t)id * 13, 12, false);
    }
    drain(&a, 10);
    drain(&b, 10);
    for (uint64_t id = 1; id <= 10; id++) {
        cr_assert_eq(a.p->tokens[id], 12);
        cr_assert_eq(b.p->tokens[id], 12);
        cr_assert_eq(a.p->finish[id], SCHED_FINISH_LENGTH);
        cr_assert_eq(b.p->finish[id], SCHED_FINISH_LENGTH);
    }
    done(&a);
    done(&b);
}

/* Aborts request 1 at a given point and checks: one final output "abort", executor state
 * removed once, everything back at the end. */
static void abort_now(rig *r, uint64_t id)
{
    di_error err;
    uint32_t finals = r->p->finals[id];
    cr_assert_eq(engine_abort(r->e, id, &err), DI_OK, "%s", err.msg);
    check(r);
    cr_assert_eq(r->p->finals[id], finals + 1);
    cr_assert_eq(r->p->finish[id], SCHED_FINISH_ABORT);
    cr_assert_eq(engine_abort(r->e, id, &err), DI_ENOENT, "a second abort finds nothing");
}

static void abort_from(bool async, int where)
{
    rig r = make(async, SCHED_NORMAL, 0.0);
    switch (where) {
    case 0: /* waiting, never scheduled */
        add(&r, 1, 100, 10, false);
        abort_now(&r, 1);
        cr_assert_eq(r.p->removed[1], 1, "nothing in flight: removed at once");
        break;
    case 1: /* held (its KV is loading) */
        add(&r, 1, 100, 10, true);
        add(&r, 2, 50, 4, false);
        step(&r);
        cr_assert_eq(sched_find(engine_sched(r.e), 1)->where, SEQ_IN_WAITING);
        abort_now(&r, 1);
        break;
    case 2: /* between chunks: 700 tokens with a 256-token budget */
        add(&r, 1, 700, 10, false);
        step(&r);
        step(&r);
        cr_assert_eq(r.p->tokens[1], 0, "still in prefill");
        abort_now(&r, 1);
        break;
    case 3: /* running (decoding), with its step in flight when async */
        add(&r, 1, 60, 50, false);
        add(&r, 2, 60, 50, false);
        for (int i = 0; i < 6; i++)
            step(&r);
        cr_assert_gt(r.p->tokens[1], 0, "decoding");
        if (async)
            cr_assert_eq(sched_num_in_flight(engine_sched(r.e)), 1, "a step in flight");
        abort_now(&r, 1);
        if (async)
            cr_assert_eq(r.p->removed[1], 0, "kept until its step in flight is processed");
        step(&r);
        cr_assert_eq(r.p->removed[1], 1);
        break;
    }
    drain(&r, 2);
    cr_assert_eq(r.p->finals[1], 1);
    cr_assert_eq(r.p->finish[1], SCHED_FINISH_ABORT);
    done(&r);
}

Test(engine, abort_while_waiting) { abort_from(false, 0); abort_from(true, 0); }
Test(engine, abort_while_held) { abort_from(false, 1); abort_from(true, 1); }
Test(engine, abort_between_chunks) { abort_from(false, 2); abort_from(true, 2); }
Test(engine, abort_while_running_or_in_flight) { abort_from(false, 3); abort_from(true, 3); }

Test(engine, abort_after_the_end_finds_nothing)
{
    rig r = make(true, SCHED_NORMAL, 0.0);
    add(&r, 1, 30, 3, false);
    drain(&r, 1);
    di_error err;
    cr_assert_eq(engine_abort(r.e, 1, &err), DI_ENOENT);
    cr_assert_eq(r.p->finals[1], 1);
    cr_assert_eq(r.p->removed[1], 1);
    done(&r);
}

/* A finished request rides the step already scheduled: its executor state stays until that
 * step is processed (p_step asserts it on every plan). */
Test(engine, a_request_that_ends_keeps_its_executor_state_while_it_rides_a_step)
{
    rig r = make(true, SCHED_NORMAL, 0.3);
    for (uint64_t id = 1; id <= 30; id++)
        add(&r, id, 40, 40, false);
    drain(&r, 30);
    done(&r);
}

/* A held request waits until engine_set_ready. */
Test(engine, a_held_request_waits_for_its_kv)
{
    rig r = make(false, SCHED_NORMAL, 0.0);
    add(&r, 2, 40, 4, false); /* a held head of waiting keeps the queue behind it waiting */
    add(&r, 1, 40, 4, true);
    di_error err;
    for (int i = 0; i < 10; i++)
        step(&r);
    cr_assert_eq(r.p->tokens[1], 0, "held: never scheduled");
    cr_assert_eq(r.p->finals[2], 1);
    cr_assert_eq(engine_set_ready(r.e, 1, &err), DI_OK, "%s", err.msg);
    drain(&r, 2);
    cr_assert_eq(r.p->tokens[1], 4);
    done(&r);
}

/* PROMPT engine: a finished prefill is held (finish "handoff") until release or abort. */
Test(engine, a_handoff_is_held_until_release_or_abort)
{
    rig r = make(false, SCHED_PROMPT, 0.0);
    add(&r, 1, 300, 10, false);
    add(&r, 2, 200, 10, false);
    di_error err;
    cr_assert_eq(engine_run(r.e, 100, &err), DI_OK, "%s", err.msg);
    sched *s = engine_sched(r.e);
    cr_assert_eq(r.p->finish[1], SCHED_FINISH_HANDOFF);
    cr_assert_eq(r.p->finish[2], SCHED_FINISH_HANDOFF);
    cr_assert_lt(sched_free_blocks(s), r.blocks0, "the handoffs keep their blocks");
    cr_assert_eq(r.p->removed[1] + r.p->removed[2], 0, "and their executor state");
    cr_assert_eq(engine_release(r.e, 1, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(engine_release(r.e, 1, &err), DI_ENOENT);
    uint32_t finals2 = r.p->finals[2];
    cr_assert_eq(engine_abort(r.e, 2, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(r.p->finals[2], finals2, "an abort after the handoff adds no output");
    drain(&r, 2);
    done(&r);
}

/* Failure paths: the executor refuses a request; a duplicate id; a step that fails. */
Test(engine, failures_leave_nothing_behind)
{
    rig r = make(false, SCHED_NORMAL, 0.0);
    r.p->refuse_id = 3;
    di_error err;
    int32_t tok[4] = {5, 6, 7, 8};
    sched_request q = {.id = 3, .prompt = tok, .prompt_len = 4, .max_tokens = 2};
    cr_assert_eq(engine_add(r.e, &q, NULL, (void *)3, &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "refused"), "%s", err.msg);
    add(&r, 1, 10, 3, false);
    q.id = 1;
    cr_assert_eq(engine_add(r.e, &q, NULL, (void *)1, &err), DI_EEXIST);
    q.id = 4;
    q.prompt_len = 0; /* the scheduler refuses it after the executor took it */
    cr_assert_eq(engine_add(r.e, &q, NULL, (void *)4, &err), DI_EINVAL);
    cr_assert_eq(r.p->added[4], 1);
    cr_assert_eq(r.p->removed[4], 1, "the executor forgets what the scheduler refused");
    cr_assert_eq(engine_get_stats(r.e)->live, 1);
    r.p->fail_step = 2;
    step(&r);
    cr_assert_eq(engine_step(r.e, NULL, &err), DI_EINTERNAL);
    cr_assert(strstr(err.msg, "step 2 fails"), "%s", err.msg);
    cr_assert_eq(engine_step(r.e, NULL, &err), DI_ESTATE, "a failed engine stays stopped");
    cr_assert_eq(engine_add(r.e, &q, NULL, NULL, &err), DI_ESTATE);
    engine_destroy(r.e);
    cr_assert_eq(r.p->removed[1], 1, "destroy forgets every live request once");
    synth_destroy(r.p->y);
    free(r.p);
}

Test(engine, bad_config_is_refused)
{
    engine_config c = {0};
    sched_config_default(&c.sched);
    engine *e = NULL;
    di_error err;
    cr_assert_eq(engine_create(&c, &e, &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "step"), "%s", err.msg);
    c.exec.step = p_step;
    c.sched.num_slots = 0;
    cr_assert_eq(engine_create(&c, &e, &err), DI_EINVAL);
    cr_assert_null(e);
    engine_destroy(NULL);
}

/* ---- allocation failures (sqlite's do_faultsim_test) ---- */

/* One run with the Nth allocation failing: every call either succeeds or fails with
 * DI_ENOMEM leaving nothing behind; steps never allocate; at the end nothing has leaked and
 * the executor forgot every request it learnt. False when no fault was injected. */
static bool fault_run(uint64_t fail_at)
{
    faulty f = {.fail_at = fail_at};
    di_alloc a = {faulty_alloc, faulty_free, &f};
    probe *p = calloc(1, sizeof(*p));
    synth_config sc = {.seed = 4, .nextn = 2, .vocab_size = 100, .eos_token = -1,
                       .accept_rate = 0.5};
    di_error err;
    cr_assert_eq(synth_create(&sc, 16, NULL, &p->y, &err), DI_OK);
    engine_config c = {.exec = {.ctx = p, .add = p_add, .remove = p_remove, .step = p_step},
                       .on_output = p_output, .userdata = p};
    sched_config_default(&c.sched);
    c.sched.num_blocks = 120;
    c.sched.num_slots = 16;
    c.sched.max_num_seqs = 8;
    c.sched.nextn = 2;
    c.sched.prefill_attempt_interval = 1;
    c.sched.async = fail_at % 2;
    c.sched.alloc = &a;
    engine *e = NULL;
    di_status st = engine_create(&c, &e, &err);
    if (st == DI_OK) {
        int32_t tok[200];
        for (int i = 0; i < 200; i++)
            tok[i] = 3 + i % 90;
        for (uint64_t id = 1; id <= 12; id++) {
            sched_request q = {.id = id, .prompt = tok, .prompt_len = 20 + 13 * (uint32_t)id,
                               .max_tokens = 6};
            st = engine_add(e, &q, NULL, (void *)(uintptr_t)id, &err);
            cr_assert(st == DI_OK || st == DI_ENOMEM, "add %llu: %s", (unsigned long long)id,
                      err.msg);
            if (st != DI_OK)
                cr_assert_eq(p->added[id], p->removed[id], "a refused request is forgotten");
            if (id == 6) { /* request 1 is waiting (or was refused) */
                st = engine_abort(e, 1, &err);
                cr_assert(st == DI_OK || st == DI_ENOENT, "%s", err.msg);
            }
        }
        while (engine_has_work(e)) {
            uint64_t calls = f.calls;
            cr_assert_eq(engine_step(e, NULL, &err), DI_OK, "%s", err.msg);
            cr_assert_eq(f.calls, calls, "a step allocated");
        }
        cr_assert_eq(engine_flush(e, &err), DI_OK);
        cr_assert_eq(engine_get_stats(e)->live, 0);
        engine_destroy(e);
    } else {
        cr_assert_eq(st, DI_ENOMEM, "%s", err.msg);
        cr_assert_null(e);
    }
    for (uint64_t id = 1; id < MAX_ID; id++)
        cr_assert_eq(p->added[id], p->removed[id], "request %llu", (unsigned long long)id);
    cr_assert_eq(f.live, 0, "%lld allocations leaked (fault at call %llu)", (long long)f.live,
                 (unsigned long long)fail_at);
    synth_destroy(p->y);
    free(p);
    return f.failed > 0;
}

Test(engine, every_allocation_failure_is_clean, .timeout = 60)
{
    uint64_t n = 1;
    while (fault_run(n))
        n++;
    cr_assert_gt(n, 10, "the workload allocates in many places (%llu)", (unsigned long long)n);
}
