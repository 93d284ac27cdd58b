/* One step ahead in the executor (runner_exec_options.ahead) on the CPU backend: on the engine
 * that plans step N+1 before it processes step N (sched_config.async), the rows the backend's
 * step_ahead op writes from step N's outcome give the same tokens, logprobs and finish
 * reasons as the scheduler's host fix-up alone, over greedy and seeded sampling, with drafts
 * on and off, requests ending at different steps, one joining mid-run and one aborted; the op
 * really wrote the rows (the executor's count); an op whose rows differ from the plan's fails
 * the step; a backend without the op is refused.
 *
 * The overlap (runner_exec_options.overlap: step N+1 issued before step N is collected) gives
 * the same outputs again, with the host sampler and with a backend `sample` entry (the host
 * sampler as the entry, its draws left in backend memory until collect), a request stopped by
 * a stop token in step N riding step N+1 without output; steps are counted as overlapped in
 * decode without drafts and never with drafts or in prompt steps; a wrong id written by the
 * op fails the step at collect. */
#include <criterion/criterion.h>
#include <string.h>

#include "common/engine/engine.h"
#include "common/model/runner.h"
#include "common/model/runner_exec.h"
#include "common/sampling/sampler_backend.h"
#include "kernels/cpu/backend.h"
#include "kernels/cpu/step_ahead.h"

#define N_REQ 4
#define MAX_OUT 32

static const uint32_t k_len[N_REQ] = {9, 4, 13, 6};      /* prompt lengths */
static const uint32_t k_max[N_REQ] = {10, 17, 13, 9};    /* max_tokens: they end apart */

typedef struct req_out {
    sampler_result res[MAX_OUT]; /* of each produced token */
    uint32_t n;
    sched_finish finish;
} req_out;

typedef struct run_cfg {
    uint32_t nextn;
    float temperature;
    uint64_t seed;
    int ahead;
    int overlap;
    int32_t stop;            /* a stop token of every request; -1 none */
    uint32_t max_tokens;     /* of every request; 0: k_max */
} run_cfg;

typedef struct rig {
    runner_exec *ex;
    engine *e;
    req_out out[N_REQ + 1];
} rig;

static runner_model g_rm;
static kern_backend g_be;

static void open_model(void)
{
    di_error err;
    cr_assert_eq(runner_model_random("tiny", 31, NULL, NULL, &g_rm, &err), DI_OK, "%s",
                 err.msg);
    cr_assert_eq(kern_cpu_create(1, &g_be, &err), DI_OK, "%s", err.msg);
}

static void close_model(void)
{
    kern_cpu_destroy(&g_be);
    runner_model_free(&g_rm);
}

TestSuite(ahead, .init = open_model, .fini = close_model, .timeout = 120);

/* Keeps every produced token's sampler result. */
static void on_output(void *ud, const engine_output *o)
{
    rig *r = ud;
    req_out *ro = &r->out[o->request_id];
    uint32_t nr;
    const runner_token *rt = runner_exec_tokens(r->ex, o->request_id, &nr);
    cr_assert_leq(o->n_tokens, nr, "request %llu: tokens without sampler results",
                  (unsigned long long)o->request_id);
    cr_assert_leq(ro->n + o->n_tokens, MAX_OUT);
    for (const runner_token *t = rt; t < rt + o->n_tokens; t++) {
        cr_assert_eq(t->token, o->tokens[t - rt]);
        ro->res[ro->n++] = t->res;
    }
    if (o->finish != SCHED_FINISH_NONE)
        ro->finish = o->finish;
}

static di_status rig_open(rig *r, const kern_backend *be, const run_cfg *c, di_error *err)
{
    const model_config *mc = &g_rm.w->config;
    memset(r, 0, sizeof(*r));
    sched_config sc;
    sched_config_default(&sc);
    sc.type = SCHED_NORMAL;
    sc.async = true;
    sc.prefill_attempt_interval = 1;
    sc.max_num_batched_tokens = 8; /* prompts cut over several steps */
    sc.max_num_seqs = N_REQ;
    sc.max_model_len = 4096;
    sc.nextn = c->nextn;
    sc.num_blocks = 64;
    sc.num_slots = N_REQ + 1;
    sc.eos_token = (int32_t)mc->eos_token_id;
    sc.pad_token = (int32_t)mc->pad_token_id;
    sc.vocab_size = mc->vocab_size;
    uint32_t rows = N_REQ * (mc->dspark_block_size > 1 + c->nextn ? mc->dspark_block_size
                                                                    : 1 + c->nextn);
    runner_exec_options eo = {.fwd = {.nextn = c->nextn, .max_rows = rows < 8 ? 8 : rows},
                              .n_blocks = sc.num_blocks, .n_slots = sc.num_slots,
                              .ahead = c->ahead || c->overlap, .overlap = c->overlap};
    di_status st = runner_exec_create(&g_rm, be, &eo, &r->ex, err);
    if (st != DI_OK)
        return st;
    engine_config ec = {.sched = sc, .exec = runner_exec_executor(r->ex),
                        .on_output = on_output, .userdata = r};
    st = engine_create(&ec, &r->e, err);
    if (st != DI_OK)
        runner_exec_free(r->ex);
    return st;
}

static void rig_close(rig *r)
{
    engine_destroy(r->e);
    runner_exec_free(r->ex);
}

static void add(rig *r, uint32_t i, const run_cfg *c)
{
    int32_t p[32];
    for (uint32_t k = 0; k < k_len[i]; k++)
        p[k] = (int32_t)(2 + (k * 7919u + i * 104729u) % 4000u);
    sampling_params sp = sampling_params_default();
    sp.temperature = c->temperature;
    sp.seed = c->seed + i;
    sp.n_logprobs = 2;
    uint32_t max = c->max_tokens ? c->max_tokens : k_max[i];
    runner_request rq = {.id = i + 1, .prompt = p, .prompt_len = k_len[i],
                         .max_tokens = max, .params = sp};
    sched_request sr = {.id = i + 1, .prompt = p, .prompt_len = k_len[i],
                        .max_tokens = max, .ignore_eos = true,
                        .stop_ids = &c->stop, .n_stop_ids = c->stop >= 0};
    di_error err;
    cr_assert_eq(engine_add(r->e, &sr, &rq, NULL, &err), DI_OK, "%s", err.msg);
}

/* Requests 1-3 from the start, request 4 after step 4, request 2 aborted after step 9.
 * Returns the first failure of a step (DI_OK when every step ran). */
static di_status scenario(rig *r, const run_cfg *c, di_error *err)
{
    for (uint32_t i = 0; i < 3; i++)
        add(r, i, c);
    for (uint32_t step = 1; engine_has_work(r->e); step++) {
        cr_assert_lt(step, 200, "the run does not end");
        di_status st = engine_step(r->e, NULL, err);
        if (st != DI_OK)
            return st;
        if (step == 4)
            add(r, 3, c);
        if (step == 9)
            cr_assert_eq(engine_abort(r->e, 2, err), DI_OK, "%s", err->msg);
    }
    return engine_flush(r->e, err);
}

static void run(const run_cfg *c, rig *r)
{
    di_error err;
    cr_assert_eq(rig_open(r, &g_be, c, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(scenario(r, c, &err), DI_OK, "%s", err.msg);
}

Test(ahead, the_ops_rows_give_the_same_outputs)
{
    const run_cfg cfgs[] = {{0, 0.0f, 1, 0, 0, -1, 0}, {3, 0.0f, 1, 0, 0, -1, 0},
                            {0, 0.9f, 5, 0, 0, -1, 0}, {3, 0.9f, 5, 0, 0, -1, 0}};
    for (size_t k = 0; k < sizeof cfgs / sizeof cfgs[0]; k++) {
        run_cfg off = cfgs[k], on = cfgs[k];
        on.ahead = 1;
        rig a, b;
        run(&off, &a);
        run(&on, &b);
        const runner_exec_stats *sa = runner_exec_get_stats(a.ex), *sb = runner_exec_get_stats(b.ex);
        cr_assert_eq(sa->ahead_entries, 0);
        cr_assert_eq(sb->steps, sa->steps, "nextn %u: the same steps", on.nextn);
        /* every decode step after the first of a sequence continues the previous one */
        cr_assert_gt(sb->ahead_steps, sb->steps / 2, "nextn %u: %llu of %llu steps", on.nextn,
                     (unsigned long long)sb->ahead_steps, (unsigned long long)sb->steps);
        cr_assert_gt(sb->ahead_entries, 20, "nextn %u", on.nextn);
        for (uint32_t id = 1; id <= N_REQ; id++) {
            const req_out *x = &a.out[id], *y = &b.out[id];
            cr_assert_eq(y->finish, x->finish, "nextn %u request %u", on.nextn, id);
            cr_assert_eq(y->n, x->n, "nextn %u request %u", on.nextn, id);
            for (uint32_t t = 0; t < x->n; t++) {
                const sampler_result *p = &x->res[t], *q = &y->res[t];
                cr_assert(q->token == p->token && q->logprob == p->logprob &&
                          q->n_top == p->n_top && p->n_top >= 1 &&
                          !memcmp(q->top_tokens, p->top_tokens, p->n_top * sizeof(int32_t)) &&
                          !memcmp(q->top_logprobs, p->top_logprobs, p->n_top * sizeof(float)),
                          "nextn %u request %u token %u: %d (%g) against %d (%g)", on.nextn, id,
                          t, q->token, q->logprob, p->token, p->logprob);
            }
        }
        /* the requests ended as set: by length, request 2 by the abort */
        cr_assert_eq(b.out[1].finish, SCHED_FINISH_LENGTH);
        cr_assert_eq(b.out[1].n, k_max[0]);
        cr_assert_eq(b.out[2].finish, SCHED_FINISH_ABORT);
        cr_assert_lt(b.out[2].n, k_max[1]);
        cr_assert_eq(b.out[3].n, k_max[2]);
        cr_assert_eq(b.out[4].n, k_max[3]);
        rig_close(&a);
        rig_close(&b);
    }
}

/* A step_ahead op that writes a wrong token into the first row it fixes. */
static di_status bad_step_ahead(void *ctx, const kern_step_ahead *p)
{
    di_status st = kern_step_ahead_run(p, NULL);
    if (st == DI_OK && p->n_seqs)
        p->ids[p->row0[0]] ^= 1;
    return st;
}

/* The scenario on a backend whose op writes a wrong id fails with `want` in the message;
 * returns the steps the executor overlapped before. */
static uint64_t bad_op_fails(const run_cfg *c, const char *want)
{
    kern_backend be = g_be;
    be.ops.step_ahead = bad_step_ahead;
    rig r;
    di_error err;
    cr_assert_eq(rig_open(&r, &be, c, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(scenario(&r, c, &err), DI_EINTERNAL);
    cr_assert(strstr(err.msg, want), "%s", err.msg);
    uint64_t n = runner_exec_get_stats(r.ex)->overlap_steps;
    rig_close(&r);
    return n;
}

Test(ahead, rows_that_differ_from_the_plan_fail_the_step)
{
    run_cfg c = {2, 0.0f, 1, 1, 0, -1, 0};
    bad_op_fails(&c, "step ahead: entry");
    kern_backend be = g_be;
    rig r;
    di_error err;
    be.ops.step_ahead = NULL;
    cr_assert_eq(rig_open(&r, &be, &c, &err), DI_EUNSUPPORTED);
    cr_assert(strstr(err.msg, "step_ahead"), "%s", err.msg);
}

/* ---- the overlap ---- */

static sampler_workspace *g_ws; /* the host sampler as the backend's `sample` entry */

static di_status host_sample(void *ctx, const kern_sample *p)
{
    (void)ctx;
    return sampler_host_sample(g_ws, p);
}

/* Outputs of two runs equal, token by token, and the finish reasons. */
static void same_outputs(const rig *a, const rig *b, const char *what)
{
    for (uint32_t id = 1; id <= N_REQ; id++) {
        const req_out *x = &a->out[id], *y = &b->out[id];
        cr_assert_eq(y->finish, x->finish, "%s request %u: finish %d against %d", what, id,
                     y->finish, x->finish);
        cr_assert_eq(y->n, x->n, "%s request %u: %u tokens against %u", what, id, y->n, x->n);
        for (uint32_t t = 0; t < x->n; t++) {
            const sampler_result *p = &x->res[t], *q = &y->res[t];
            cr_assert(q->token == p->token && q->logprob == p->logprob &&
                      q->n_top == p->n_top &&
                      !memcmp(q->top_tokens, p->top_tokens, p->n_top * sizeof(int32_t)) &&
                      !memcmp(q->top_logprobs, p->top_logprobs, p->n_top * sizeof(float)),
                      "%s request %u token %u: %d (%g) against %d (%g)", what, id, t, q->token,
                      q->logprob, p->token, p->logprob);
        }
    }
}

static void run_on(const kern_backend *be, const run_cfg *c, rig *r)
{
    di_error err;
    cr_assert_eq(rig_open(r, be, c, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(scenario(r, c, &err), DI_OK, "%s", err.msg);
}

Test(ahead, the_overlap_gives_the_same_outputs)
{
    di_error err;
    cr_assert_eq(sampler_workspace_new(g_rm.w->config.vocab_size, &g_ws, &err), DI_OK);
    kern_backend dev = g_be; /* draws left in backend memory until collect */
    dev.ops.sample = host_sample;
    const run_cfg cfgs[] = {{0, 0.0f, 1, 0, 0, -1, 0}, {0, 0.9f, 5, 0, 0, -1, 0}};
    for (size_t k = 0; k < sizeof cfgs / sizeof cfgs[0]; k++)
        for (int d = 0; d < 2; d++) {
            const kern_backend *be = d ? &dev : &g_be;
            run_cfg off = cfgs[k], on = cfgs[k];
            on.overlap = 1;
            rig a, b;
            run_on(be, &off, &a);
            run_on(be, &on, &b);
            char what[64];
            snprintf(what, sizeof what, "temperature %g, %s sampler", (double)on.temperature,
                     d ? "backend" : "host");
            same_outputs(&a, &b, what);
            const runner_exec_stats *sa = runner_exec_get_stats(a.ex),
                                    *sb = runner_exec_get_stats(b.ex);
            cr_assert_eq(sa->overlap_steps, 0);
            cr_assert_eq(sb->steps, sa->steps, "%s: the same steps", what);
            /* most decode steps follow a decode step whose tokens stay in backend memory */
            cr_assert_gt(sb->overlap_steps, sb->steps / 2, "%s: %llu of %llu steps", what,
                         (unsigned long long)sb->overlap_steps, (unsigned long long)sb->steps);
            cr_assert_eq(engine_get_stats(b.e)->issued_ahead, sb->overlap_steps);
            cr_assert_eq(b.out[2].finish, SCHED_FINISH_ABORT, "%s", what);
            cr_assert_eq(b.out[4].n, k_max[3], "%s: the request that joined", what);
            rig_close(&a);
            rig_close(&b);
        }
    sampler_workspace_free(g_ws);
    g_ws = NULL;
}

Test(ahead, a_stop_token_in_step_n_rides_step_n_plus_1_without_output)
{
    /* the stop token: request 1's third greedy token in a run without it */
    run_cfg c = {0, 0.0f, 1, 0, 0, -1, 0};
    rig a, b;
    run_on(&g_be, &c, &a);
    c.stop = a.out[1].res[2].token;
    rig_close(&a);
    run_on(&g_be, &c, &a);
    c.overlap = 1;
    run_on(&g_be, &c, &b);
    same_outputs(&a, &b, "stop token");
    cr_assert_eq(b.out[1].finish, SCHED_FINISH_STOP);
    cr_assert_leq(b.out[1].n, 3);
    cr_assert_gt(runner_exec_get_stats(b.ex)->overlap_steps, 0);
    rig_close(&a);
    rig_close(&b);
}

Test(ahead, no_overlap_with_drafts_or_in_prompt_steps)
{
    run_cfg c = {3, 0.0f, 1, 0, 1, -1, 0}; /* drafts: every step waits for the previous */
    rig r;
    run_on(&g_be, &c, &r);
    cr_assert_gt(runner_exec_get_stats(r.ex)->ahead_steps, 0);
    cr_assert_eq(runner_exec_get_stats(r.ex)->overlap_steps, 0);
    cr_assert_eq(engine_get_stats(r.e)->issued_ahead, 0);
    rig_close(&r);
    run_cfg p = {0, 0.0f, 1, 0, 1, -1, 1}; /* one token each: prompt steps only */
    run_on(&g_be, &p, &r);
    cr_assert_gt(runner_exec_get_stats(r.ex)->steps, 4);
    cr_assert_eq(runner_exec_get_stats(r.ex)->overlap_steps, 0);
    for (uint32_t id = 1; id <= N_REQ; id++)
        cr_assert(r.out[id].n == 1 || r.out[id].finish == SCHED_FINISH_ABORT, "request %u", id);
    rig_close(&r);
}

Test(ahead, a_wrong_id_from_the_op_fails_the_overlapped_step_at_collect)
{
    run_cfg c = {0, 0.0f, 1, 0, 1, -1, 0};
    cr_assert_gt(bad_op_fails(&c, "overlap: entry"), 0);
    di_error err;
    runner_exec_options eo = {.fwd = {.max_rows = 8}, .n_blocks = 8, .n_slots = 2,
                              .overlap = 1};
    runner_exec *ex;
    cr_assert_eq(runner_exec_create(&g_rm, &g_be, &eo, &ex, &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "overlap"), "%s", err.msg);
}

/* A backend whose marks report a failure the device found: the overlapped step fails at
 * collect with the backend named. */
static di_status failing_wait(void *ctx, uint64_t mark)
{
    (void)ctx, (void)mark;
    return DI_EINVAL;
}

Test(ahead, a_failure_found_by_the_device_fails_the_step_at_collect)
{
    kern_backend be = g_be;
    be.ops.wait_mark = failing_wait;
    run_cfg c = {0, 0.0f, 1, 0, 1, -1, 0};
    rig r;
    di_error err;
    cr_assert_eq(rig_open(&r, &be, &c, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(scenario(&r, &c, &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "collect: the cpu backend failed"), "%s", err.msg);
    rig_close(&r);
    be.ops.wait_mark = NULL; /* no marks: the overlap is refused at create */
    runner_exec_options eo = {.fwd = {.max_rows = 8}, .n_blocks = 8, .n_slots = 2, .ahead = 1,
                              .overlap = 1};
    runner_exec *ex;
    cr_assert_eq(runner_exec_create(&g_rm, &be, &eo, &ex, &err), DI_EUNSUPPORTED);
    cr_assert(strstr(err.msg, "marks"), "%s", err.msg);
}

/* Issue and collect out of order are refused. */
Test(ahead, collect_before_issue_and_issue_twice_are_refused)
{
    runner_exec_options eo = {.fwd = {.max_rows = 8}, .n_blocks = 8, .n_slots = 2, .ahead = 1,
                              .overlap = 1};
    runner_exec *ex;
    di_error err;
    cr_assert_eq(runner_exec_create(&g_rm, &g_be, &eo, &ex, &err), DI_OK, "%s", err.msg);
    sched_plan p = {.placeholder = true}, q = {.placeholder = true}, t = {.placeholder = true};
    sched_seq_result res[1];
    bool issued;
    cr_assert_eq(runner_exec_collect(ex, &p, res, &err), DI_ESTATE);
    cr_assert(strstr(err.msg, "not in flight"), "%s", err.msg);
    cr_assert_eq(runner_exec_issue(ex, &p, false, &issued, &err), DI_OK, "%s", err.msg);
    cr_assert(issued);
    cr_assert_eq(runner_exec_issue(ex, &p, false, &issued, &err), DI_ESTATE);
    cr_assert_eq(runner_exec_issue(ex, &q, false, &issued, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(runner_exec_issue(ex, &t, false, &issued, &err), DI_ESTATE);
    cr_assert(strstr(err.msg, "two steps in flight"), "%s", err.msg);
    cr_assert_eq(runner_exec_collect(ex, &p, res, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(runner_exec_collect(ex, &q, res, &err), DI_OK, "%s", err.msg);
    runner_exec_free(ex);
}
