/* One-step-ahead ("async") scheduling: step N+1 is scheduled before step N is processed
 * (explainer Pass 2, "The second decode step, under async scheduling"; Pass 3, "A request
 * finishes while async scheduling has it in flight"). */
#include <criterion/criterion.h>

#include "harness.h"

static h_log lg;

static void async_config(sched_config *c, sched_engine_type type)
{
    h_config(c);
    c->type = type;
    c->async = true;
}

static void add_cached(sched *s, uint64_t id, uint32_t kv, uint32_t out_len, uint32_t max_tokens)
{
    static int32_t tok[4096];
    for (uint32_t i = 0; i < kv + out_len; i++)
        tok[i] = 5 + (int32_t)(i % 50);
    sched_request r = {.id = id, .prompt = tok, .prompt_len = kv + 1 - out_len,
                       .output = tok + kv + 1 - out_len, .output_len = out_len,
                       .max_tokens = max_tokens, .kv_cached = kv, .window_cached = true};
    h_add_req(s, &r);
}

/* Step N+1 is scheduled before N is processed; a third schedule is refused; the fixup puts
 * N's sampled token and drafts into N+1's rows and takes the rejected drafts off. */
Test(sched_async, one_step_ahead_and_the_fixup)
{
    sched_config c;
    async_config(&c, SCHED_COMPLETION);
    sched *s = h_make(&c);
    add_cached(s, 1, 1999, 1, 1000);
    sched_plan *n0 = h_schedule(s);
    cr_assert_eq(n0->seqs[0].first_position, 1999);
    cr_assert(!n0->seqs[0].tokens_from_prev);
    sched_plan *n1 = h_schedule(s);
    cr_assert_neq(n1, n0);
    const sched_seq_plan *e = &n1->seqs[0];
    cr_assert(e->tokens_from_prev);
    cr_assert_eq(e->prev_index, 0);
    cr_assert_eq(e->first_position, 2005, "assumes step N accepted all 5 drafts");
    cr_assert_eq(e->seqlen_k, 2011);
    cr_assert_eq(sched_find(s, 1)->num_tokens, 2011);
    cr_assert_eq(sched_find(s, 1)->inflight_steps, 2);
    sched_plan *p2;
    di_error err;
    cr_assert_eq(sched_schedule(s, &p2, &err), DI_ESTATE);
    cr_assert(strstr(err.msg, "one step ahead"), "%s", err.msg);
    const sched_output *o;
    size_t n;
    cr_assert_eq(sched_process_outputs(s, n1, NULL, 0, &o, &n, &err), DI_ESTATE,
                 "steps are processed in order");

    /* step N accepts d1, d2 and samples 93: 3 of 6 rows valid */
    sched_seq_result r0 = {.n_tokens = 3, .tokens = {91, 92, 93}, .n_drafts = 5,
                           .drafts = {61, 62, 63, 64, 65}};
    h_process(s, n0, &r0, NULL, &lg);
    cr_assert_eq(sched_find(s, 1)->num_tokens, 2008, "2,011 - 3 rejected");
    sched_plan_fixup(n1, n0, &r0);
    cr_assert_eq(e->first_position, 2002);
    cr_assert_eq(e->seqlen_k, 2008);
    cr_assert_eq(e->tokens[0], 93);
    cr_assert_eq(e->tokens[1], 61);
    cr_assert_eq(e->tokens[5], 65);
    sched_seq_result r1 = {.n_tokens = 1, .tokens = {94}, .n_drafts = 5};
    h_process(s, n1, &r1, NULL, &lg);
    cr_assert_eq(sched_find(s, 1)->num_tokens, 2002 + 1);
    cr_assert_eq(sched_find(s, 1)->len, 2004);
    sched_destroy(s);
}

/* A request that finishes in step N rides N+1, produces nothing from it, and keeps its blocks
 * and slot until N+1 is processed. */
Test(sched_async, a_finished_request_rides_one_step)
{
    sched_config c;
    async_config(&c, SCHED_COMPLETION);
    sched *s = h_make(&c);
    uint32_t blocks0 = sched_free_blocks(s), slots0 = sched_free_slots(s);
    add_cached(s, 1, 300, 1, 1000);
    sched_plan *n0 = h_schedule(s);
    sched_plan *n1 = h_schedule(s);
    cr_assert_eq(h_entry(n1, 1), 0, "in both steps");
    sched_seq_result eos = {.n_tokens = 1, .tokens = {2}};
    size_t n;
    const sched_output *o = h_process(s, n0, &eos, &n, &lg);
    cr_assert_eq(n, 1);
    cr_assert_eq(o[0].finish, SCHED_FINISH_STOP);
    const seq *q = sched_find(s, 1);
    cr_assert_not_null(q, "still held by step N+1");
    cr_assert(q->release_pending);
    cr_assert_eq(sched_free_blocks(s), blocks0 - q->n_blocks, "deferred release");
    cr_assert_eq(sched_free_slots(s), slots0 - 1);
    cr_assert(!sched_has_work(s));
    sched_plan_fixup(n1, n0, &eos); /* it rides with its last token; the rows are wasted */
    cr_assert_eq(n1->seqs[0].tokens[0], 2);
    h_process(s, n1, &(sched_seq_result){.n_tokens = 1, .tokens = {7}}, &n, &lg);
    cr_assert_eq(n, 0, "nothing from the ride");
    cr_assert_null(sched_find(s, 1));
    cr_assert_eq(sched_free_blocks(s), blocks0);
    cr_assert_eq(sched_free_slots(s), slots0);
    sched_destroy(s);
}

/* Abort of a running request with two steps in flight: exactly one output, "abort", at once;
 * its blocks come back after the second step is processed. */
Test(sched_async, abort_while_in_flight)
{
    sched_config c;
    async_config(&c, SCHED_COMPLETION);
    sched *s = h_make(&c);
    uint32_t blocks0 = sched_free_blocks(s);
    add_cached(s, 1, 300, 1, 1000);
    add_cached(s, 2, 300, 1, 1000);
    sched_plan *n0 = h_schedule(s);
    sched_plan *n1 = h_schedule(s);
    h_abort(s, 1, &lg);
    cr_assert_not_null(sched_find(s, 1));
    cr_assert_lt(sched_free_blocks(s), blocks0 - 3, "request 1 still holds its blocks");
    h_process(s, n0, NULL, NULL, &lg);
    cr_assert_not_null(sched_find(s, 1), "step N+1 still holds it");
    sched_plan *n2 = h_schedule(s);
    cr_assert_eq(h_entry(n2, 1), -1);
    h_process(s, n1, NULL, NULL, &lg);
    cr_assert_null(sched_find(s, 1));
    h_process(s, n2, NULL, NULL, &lg);
    cr_assert_eq(lg.finals[1], 1);
    cr_assert_eq(lg.finish[1], SCHED_FINISH_ABORT);
    h_abort(s, 2, &lg);
    cr_assert_eq(sched_free_blocks(s), blocks0);
    sched_destroy(s);
}

/* A prompt step scheduled while a decode step is in flight must be processed before the next
 * schedule: prompt steps drain the pipeline. */
Test(sched_async, prompt_steps_drain_the_pipeline)
{
    sched_config c;
    async_config(&c, SCHED_NORMAL);
    sched *s = h_make(&c);
    h_add(s, 1, 50, 1000);
    h_step(s, &lg); /* prefill of 1 */
    sched_plan *d = h_schedule(s);
    cr_assert(!d->prompt_run && !d->process_now);
    h_add(s, 2, 50, 1000);
    sched_plan *pr = h_schedule(s);
    cr_assert(pr->prompt_run && pr->process_now);
    cr_assert_eq(pr->seqs[0].request_id, 2);
    h_process(s, d, NULL, NULL, &lg);
    sched_plan *x;
    di_error e;
    cr_assert_eq(sched_schedule(s, &x, &e), DI_ESTATE);
    cr_assert(strstr(e.msg, "prompt step"), "%s", e.msg);
    h_process(s, pr, NULL, NULL, &lg);
    cr_assert_eq(sched_num_in_flight(s), 0, "drained");
    sched_plan *next = h_schedule(s);
    for (uint32_t i = 0; i < next->n_seqs; i++)
        cr_assert(!next->seqs[i].tokens_from_prev, "nothing in flight before it");
    h_process(s, next, NULL, NULL, &lg);
    sched_destroy(s);
}

/* The ride step makes a request's span shrink: 6 rows from 2,042 end at 2,047; the ride row
 * planned at 2,048 takes block 17; step N then rejects every draft, so the next step (4 rows)
 * ends at 2,047 again and block 17 goes back. */
Test(sched_async, blocks_drafts_no_longer_need_go_back)
{
    sched_config c;
    async_config(&c, SCHED_COMPLETION);
    sched *s = h_make(&c);
    add_cached(s, 1, 2042, 1, 7);
    sched_plan *n0 = h_schedule(s);
    cr_assert_eq(n0->seqs[0].seqlen_q, 6);
    cr_assert_eq(sched_find(s, 1)->n_blocks, 16);
    sched_plan *n1 = h_schedule(s);
    cr_assert_eq(n1->seqs[0].seqlen_q, 1, "if N accepts all, nothing is left: a ride row");
    cr_assert_eq(sched_find(s, 1)->n_blocks, 17);
    uint32_t free1 = sched_free_blocks(s);
    sched_seq_result r0 = {.n_tokens = 1, .tokens = {50}, .n_drafts = 5};
    h_process(s, n0, &r0, NULL, &lg);
    sched_plan *n2 = h_schedule(s);
    cr_assert_eq(n2->seqs[0].seqlen_q, 4);
    cr_assert_eq(n2->seqs[0].seqlen_k, 2048);
    cr_assert_eq(sched_find(s, 1)->n_blocks, 16);
    cr_assert_eq(sched_free_blocks(s), free1 + 1, "block 17 is handed back");
    h_process(s, n1, &(sched_seq_result){.n_tokens = 1, .tokens = {51}}, NULL, &lg);
    h_process(s, n2, NULL, NULL, &lg);
    sched_destroy(s);
}

/* Preemption while the victim is in flight: its blocks come back only after that step, so the
 * request they would serve sits the step out instead of preempting more. Sizes (ours): a pool
 * of 3 blocks; A holds 2 (201 positions), D holds 1 and its next row (position 128) needs a
 * second. */
Test(sched_async, preempting_a_request_in_flight)
{
    sched_config c;
    async_config(&c, SCHED_COMPLETION);
    c.nextn = 0;
    c.num_blocks = 4;
    sched *s = h_make(&c);
    add_cached(s, 1, 200, 50, 1000); /* A: 50 outputs */
    add_cached(s, 2, 127, 1, 1000);  /* D: 1 output */
    sched_plan *n0 = h_schedule(s);
    cr_assert_eq(n0->n_seqs, 2);
    cr_assert_eq(sched_free_blocks(s), 0);
    sched_plan *n1 = h_schedule(s);
    cr_assert_eq(sched_find(s, 1)->status, SEQ_FINISHED_PREEMPTED, "A, the longest, is out");
    cr_assert(n1->placeholder, "D sits this step out");
    cr_assert_eq(n1->n_preempted, 1);
    cr_assert_eq(sched_get_stats(s)->sat_out, 1);
    cr_assert_eq(sched_free_blocks(s), 0, "A's blocks wait for step N");
    size_t n;
    const sched_output *o = h_process(s, n0, NULL, &n, &lg);
    cr_assert_eq(n, 2, "A's preemption and D's token");
    cr_assert_eq(sched_free_blocks(s), 2);
    h_process(s, n1, NULL, NULL, &lg);
    sched_plan *n2 = h_schedule(s);
    cr_assert_eq(n2->n_seqs, 1);
    cr_assert_eq(n2->seqs[0].request_id, 2);
    cr_assert_eq(n2->seqs[0].n_blocks, 2);
    h_process(s, n2, NULL, NULL, &lg);
    (void)o;
    cr_assert_eq(lg.finish[1], SCHED_FINISH_PREEMPTED);
    sched_destroy(s);
}

/* ---- sync and async give the same tokens ----
 * An oracle runner: the true token of request id at position p is f(id, p); a draft passes
 * only if it is the true token; the draft model guesses right with a fixed pseudo-chance per
 * position; the end token comes at fixed positions. Whatever the batching or the pipelining,
 * every request must produce f(id, L), f(id, L + 1), ... and end at the same place. The oracle
 * also checks that each row sits at the position it expects, which the async bookkeeping and
 * the fixup must get right. */

enum { O_IDS = 48, O_MAXTOK = 700 };

static uint32_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (uint32_t)x;
}

static int32_t truth(uint64_t id, uint32_t p)
{
    if (mix(id * 1000003 + p) % 397 == 0 && p > 40)
        return 2; /* the end token */
    return 10 + (int32_t)(mix(id * 7919 + p * 31) % 900);
}

static int32_t guess(uint64_t id, uint32_t p)
{
    int32_t t = truth(id, p);
    return mix(id * 31 + p * 7 + 5) % 10 < 7 ? t : (t == 2 ? 11 : t + 1);
}

typedef struct oracle {
    uint32_t known[O_IDS];      /* tokens the oracle has produced up to, per request */
    bool done[O_IDS];           /* its final output was seen */
    int32_t out[O_IDS][O_MAXTOK];
    uint32_t n_out[O_IDS];
    sched_finish fin[O_IDS];
    sched_seq_result res[256];
    uint64_t from_prev;         /* entries whose rows came from the step in flight */
    uint64_t accepted;          /* drafts that passed */
    uint64_t preempted;         /* recompute preemptions of the run */
} oracle;

static void oracle_entry(oracle *o, const sched_plan *p, const sched_seq_plan *e,
                         sched_seq_result *r)
{
    uint64_t id = e->request_id;
    *r = (sched_seq_result){.n_tokens = 1, .tokens = {11}};
    if (id >= O_IDS || o->done[id] || !e->sample)
        return;
    uint32_t end = e->first_position + e->seqlen_q; /* the row at end - 1 predicts end */
    if (p->prompt_run) {
        r->tokens[0] = truth(id, end);
        o->known[id] = end + 1;
    } else {
        cr_assert_eq(e->first_position, o->known[id] - 1, "request %llu: row 0 at %u, want %u",
                     (unsigned long long)id, e->first_position, o->known[id] - 1);
        cr_assert_eq(e->seqlen_k, end);
        o->from_prev += e->tokens_from_prev;
        uint32_t a = 0;
        while (a + 1 < e->seqlen_q && e->tokens[1 + a] == truth(id, e->first_position + 1 + a))
            a++;
        for (uint32_t k = 0; k < a; k++)
            r->tokens[k] = e->tokens[1 + k];
        r->tokens[a] = truth(id, e->first_position + 1 + a);
        r->n_tokens = a + 1;
        o->accepted += a;
        o->known[id] = e->first_position + 2 + a;
    }
    r->n_drafts = 5;
    for (uint32_t k = 0; k < 5; k++)
        r->drafts[k] = guess(id, o->known[id] + k);
}

static const sched_seq_result *oracle_run(oracle *o, const sched_plan *p)
{
    for (uint32_t i = 0; i < p->n_seqs; i++)
        oracle_entry(o, p, &p->seqs[i], &o->res[i]);
    return o->res;
}

static void oracle_take(oracle *o, sched *s, sched_plan *p, const sched_seq_result *r)
{
    const sched_output *outs;
    size_t n;
    di_error e;
    cr_assert_eq(sched_process_outputs(s, p, r, p->placeholder ? 0 : p->n_seqs, &outs, &n, &e),
                 DI_OK, "%s", e.msg);
    h_check(s);
    for (size_t i = 0; i < n; i++) {
        uint64_t id = outs[i].request_id;
        cr_assert(!o->done[id], "output after the final one");
        for (uint32_t k = 0; k < outs[i].n_tokens; k++)
            o->out[id][o->n_out[id]++] = outs[i].tokens[k];
        if (outs[i].finish != SCHED_FINISH_NONE) {
            o->done[id] = true;
            o->fin[id] = outs[i].finish;
        }
    }
}

/* Requests arrive over the first steps; returns after every request ended. */
static void oracle_drive(oracle *o, bool async, bool recompute)
{
    sched_config c;
    h_config(&c);
    c.async = async;
    c.max_num_seqs = 16;
    c.num_slots = 32;
    c.max_num_batched_tokens = 700;
    c.num_blocks = recompute ? 40 : 2000;
    c.preempt_mode = recompute ? SCHED_PREEMPT_RECOMPUTE : SCHED_PREEMPT_STOP;
    sched *s = h_make(&c);
    static int32_t prompt[600];
    sched_plan *prev = NULL;
    const sched_seq_result *prev_r = NULL;
    static sched_seq_result keep[256];
    for (int step = 0; step < 5000; step++) {
        if (step < O_IDS) {
            uint64_t id = (uint64_t)step;
            uint32_t len = 20 + mix(id) % 500;
            for (uint32_t i = 0; i < len; i++)
                prompt[i] = truth(id, i);
            sched_request r = {.id = id, .prompt = prompt, .prompt_len = len,
                               .max_tokens = 100 + mix(id + 99) % 500};
            h_add_req(s, &r);
        }
        if (!sched_has_work(s) && !prev && step >= O_IDS)
            break;
        sched_plan *p = sched_has_work(s) || step < O_IDS ? h_schedule(s) : NULL;
        if (prev) {
            oracle_take(o, s, prev, prev_r);
            if (p)
                sched_plan_fixup(p, prev, prev_r);
            prev = NULL;
        }
        if (!p)
            continue;
        const sched_seq_result *r = oracle_run(o, p);
        if (!async || p->process_now) {
            oracle_take(o, s, p, r);
        } else {
            memcpy(keep, r, sizeof(sched_seq_result) * p->n_seqs);
            prev = p;
            prev_r = keep;
        }
    }
    cr_assert_eq(sched_num_live(s), 0);
    cr_assert_eq(sched_free_blocks(s), sched_usable_blocks(s));
    o->preempted = sched_get_stats(s)->preempted_recompute;
    sched_destroy(s);
}

Test(sched_async, sync_and_async_give_the_same_tokens, .timeout = 60)
{
    static oracle sync_o, async_o, recompute_o, async_recompute_o;
    oracle_drive(&sync_o, false, false);
    oracle_drive(&async_o, true, false);
    oracle_drive(&recompute_o, false, true);
    oracle_drive(&async_recompute_o, true, true);
    cr_assert_eq(sync_o.from_prev, 0);
    cr_assert_gt(async_o.from_prev, 300, "the async run pipelined (%llu entries)",
                 (unsigned long long)async_o.from_prev);
    cr_assert_gt(sync_o.accepted, 1000, "drafts were accepted");
    cr_assert_gt(recompute_o.preempted, 10, "the small cache preempted (%llu)",
                 (unsigned long long)recompute_o.preempted);
    cr_assert_gt(async_recompute_o.preempted, 10);
    uint32_t stops = 0;
    for (int id = 0; id < O_IDS; id++) {
        cr_assert(sync_o.done[id] && async_o.done[id], "request %d finished", id);
        cr_assert_eq(sync_o.fin[id], async_o.fin[id], "request %d", id);
        cr_assert_eq(sync_o.n_out[id], async_o.n_out[id], "request %d", id);
        cr_assert_eq(memcmp(sync_o.out[id], async_o.out[id], sync_o.n_out[id] * 4), 0,
                     "request %d: the tokens differ", id);
        cr_assert_eq(recompute_o.n_out[id], sync_o.n_out[id], "request %d after recompute", id);
        cr_assert_eq(memcmp(sync_o.out[id], recompute_o.out[id], sync_o.n_out[id] * 4), 0);
        cr_assert_eq(async_recompute_o.n_out[id], sync_o.n_out[id], "request %d", id);
        cr_assert_eq(memcmp(sync_o.out[id], async_recompute_o.out[id], sync_o.n_out[id] * 4),
                     0, "request %d after recompute under async", id);
        stops += sync_o.fin[id] == SCHED_FINISH_STOP;
        uint32_t len = 20 + mix((uint64_t)id) % 500;
        for (uint32_t k = 0; k < sync_o.n_out[id]; k++)
            cr_assert_eq(sync_o.out[id][k], truth((uint64_t)id, len + k));
    }
    cr_assert(stops > 0 && stops < O_IDS, "both end kinds occur (%u stops)", stops);
}
