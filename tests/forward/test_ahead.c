/* One step ahead in the executor (runner_exec_options.ahead) on the CPU backend: on the engine
 * that plans step N+1 before it processes step N (sched_config.async), the rows the backend's
 * step_ahead op writes from step N's outcome give the same tokens, logprobs and finish
 * reasons as the scheduler's host fix-up alone, over greedy and seeded sampling, with drafts
 * on and off, requests ending at different steps, one joining mid-run and one aborted; the op
 * really wrote the rows (the executor's count); an op whose rows differ from the plan's fails
 * the step; a backend without the op is refused. */
#include <criterion/criterion.h>
#include <string.h>

#include "common/engine/engine.h"
#include "common/model/runner.h"
#include "common/model/runner_exec.h"
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
                              .ahead = c->ahead};
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
    runner_request rq = {.id = i + 1, .prompt = p, .prompt_len = k_len[i],
                         .max_tokens = k_max[i], .params = sp};
    sched_request sr = {.id = i + 1, .prompt = p, .prompt_len = k_len[i],
                        .max_tokens = k_max[i], .ignore_eos = true};
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
    const run_cfg cfgs[] = {{0, 0.0f, 1, 0}, {3, 0.0f, 1, 0}, {0, 0.9f, 5, 0}, {3, 0.9f, 5, 0}};
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

Test(ahead, rows_that_differ_from_the_plan_fail_the_step)
{
    kern_backend be = g_be;
    be.ops.step_ahead = bad_step_ahead;
    run_cfg c = {2, 0.0f, 1, 1};
    rig r;
    di_error err;
    cr_assert_eq(rig_open(&r, &be, &c, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(scenario(&r, &c, &err), DI_EINTERNAL);
    cr_assert(strstr(err.msg, "step ahead: entry"), "%s", err.msg);
    rig_close(&r);

    be.ops.step_ahead = NULL;
    cr_assert_eq(rig_open(&r, &be, &c, &err), DI_EUNSUPPORTED);
    cr_assert(strstr(err.msg, "step_ahead"), "%s", err.msg);
}
