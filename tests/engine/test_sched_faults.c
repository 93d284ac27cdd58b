/* Allocation failures on purpose (sqlite's do_faultsim_test): an allocator that fails its Nth
 * call. For N = 1, 2, ... a workload runs until it completes with no fault injected; every call
 * that hits the fault must return DI_ENOMEM and change nothing, and at the end nothing has
 * leaked. The workload also shows that scheduling and processing never allocate. */
#include <criterion/criterion.h>

#include "common/engine/scheduler.h"
#include "common/engine/synth.h"
#include "tests/engine/faulty.h"

typedef struct snap {
    uint32_t blocks, slots, live, waiting, running;
} snap;

static snap take(const sched *s)
{
    return (snap){sched_free_blocks(s), sched_free_slots(s), sched_num_live(s),
                  sched_num_waiting(s), sched_num_running(s)};
}

static void same(const sched *s, snap a, const char *what)
{
    snap b = take(s);
    cr_assert(a.blocks == b.blocks && a.slots == b.slots && a.live == b.live &&
                  a.waiting == b.waiting && a.running == b.running,
              "%s changed the scheduler on DI_ENOMEM", what);
}

static void check(sched *s)
{
    di_error e;
    cr_assert_eq(sched_check(s, &e), DI_OK, "%s", e.msg);
}

/* An allocating call either succeeds or fails with DI_ENOMEM leaving everything as it was. */
static bool tolerate(sched *s, di_status st, snap before, const di_error *e, const char *what)
{
    if (st == DI_OK)
        return true;
    cr_assert_eq(st, DI_ENOMEM, "%s: %s", what, e->msg);
    cr_assert(strstr(e->msg, "out of memory"), "%s: %s", what, e->msg);
    same(s, before, what);
    check(s);
    return false;
}

static void add(sched *s, uint64_t id, uint32_t len)
{
    int32_t tok[300];
    for (uint32_t i = 0; i < len; i++)
        tok[i] = 3 + (int32_t)i % 50;
    sched_request r = {.id = id, .prompt = tok, .prompt_len = len, .max_tokens = 20};
    di_error e;
    tolerate(s, sched_add_request(s, &r, &e), take(s), &e, "add_request");
}

static void step(sched *s, synth *y, faulty *f)
{
    uint64_t calls = f->calls;
    sched_plan *p;
    di_error e;
    cr_assert_eq(sched_schedule(s, &p, &e), DI_OK, "%s", e.msg);
    const sched_seq_result *r = synth_run(y, p);
    const sched_output *o;
    size_t n;
    cr_assert_eq(sched_process_outputs(s, p, r, p->placeholder ? 0 : p->n_seqs, &o, &n, &e),
                 DI_OK, "%s", e.msg);
    cr_assert_eq(f->calls, calls, "a step allocated");
    check(s);
}

/* One run with the Nth allocation failing; false when no fault was injected. */
static bool run_once(uint64_t fail_at)
{
    faulty f = {.fail_at = fail_at};
    di_alloc a = {faulty_alloc, faulty_free, &f};
    sched_config c;
    sched_config_default(&c);
    c.num_blocks = 200;
    c.max_num_seqs = 16;
    c.num_slots = 16;
    c.max_waiting = 16;
    c.prefill_attempt_interval = 1;
    c.alloc = &a;
    sched *s = NULL;
    di_error e;
    di_status st = sched_create(&c, &s, &e);
    if (st != DI_OK) {
        cr_assert_eq(st, DI_ENOMEM, "create: %s", e.msg);
        cr_assert_null(s);
        cr_assert_eq(f.live, 0, "create leaked %lld allocations", (long long)f.live);
        return true;
    }
    synth_config sc = {.seed = 5, .nextn = 5, .vocab_size = 100, .eos_token = -1,
                       .accept_rate = 0.5};
    synth *y = NULL;
    st = synth_create(&sc, c.max_num_seqs, &a, &y, &e);
    if (st != DI_OK) {
        cr_assert_eq(st, DI_ENOMEM, "%s", e.msg);
        sched_destroy(s);
        cr_assert_eq(f.live, 0);
        return true;
    }
    uint32_t blocks0 = sched_free_blocks(s), slots0 = sched_free_slots(s);
    for (uint64_t id = 1; id <= 6; id++)
        add(s, id, 40 + 30 * (uint32_t)id);
    for (int i = 0; i < 6; i++)
        step(s, y, &f);
    for (uint64_t id = 1; id <= 6; id++) {
        const seq *q = sched_find(s, id);
        if (q && q->where == SEQ_IN_RUNNING) {
            snap before = take(s);
            st = sched_fork(s, id, &(sched_request){.id = 100 + id, .max_tokens = 5}, &e);
            tolerate(s, st, before, &e, "fork");
        }
    }
    for (uint64_t id = 7; id <= 9; id++)
        add(s, id, 50);
    for (int i = 0; i < 80 && sched_has_work(s); i++)
        step(s, y, &f);
    cr_assert(!sched_has_work(s));
    cr_assert_eq(sched_num_live(s), 0);
    cr_assert_eq(sched_free_blocks(s), blocks0);
    cr_assert_eq(sched_free_slots(s), slots0);
    synth_destroy(y);
    sched_destroy(s);
    cr_assert_eq(f.live, 0, "%lld allocations leaked (fault at call %llu)", (long long)f.live,
                 (unsigned long long)fail_at);
    return f.failed > 0;
}

Test(sched_faults, every_allocation_failure_is_clean, .timeout = 60)
{
    uint64_t n = 1;
    while (run_once(n))
        n++;
    cr_assert_gt(n, 20, "the workload allocates in many places (%llu)", (unsigned long long)n);
}

Test(sched_faults, vote_group_and_synth_out_of_memory)
{
    for (uint64_t n = 1; n <= 2; n++) {
        faulty f = {.fail_at = n};
        di_alloc a = {faulty_alloc, faulty_free, &f};
        vote_group *g = NULL;
        di_error e;
        cr_assert_eq(vote_group_create(4, 0, &a, &g, &e), DI_ENOMEM);
        cr_assert_null(g);
        cr_assert_eq(f.live, 0);
        synth *y = NULL;
        synth_config sc = {.vocab_size = 10};
        f = (faulty){.fail_at = n};
        cr_assert_eq(synth_create(&sc, 4, &a, &y, &e), DI_ENOMEM);
        cr_assert_eq(f.live, 0);
    }
}
