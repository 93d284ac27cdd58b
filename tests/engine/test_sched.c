/* The scheduler, synchronous: the explainer's worked examples and the rules of DESIGN.md §3.
 * Async scheduling is in test_sched_async.c, random workloads in test_sched_random.c,
 * allocation faults in test_sched_faults.c. */
#include <criterion/criterion.h>

#include "harness.h"

static h_log lg;

/* ---- prefill ---- */

/* Explainer Pass 1, the order rail: budget 8; A = 6, B = 5, C = 4 tokens. Step 1: A whole and
 * B cut to 2, then stop (a cut prompt ends the step), C waits. Step 2: B's last 3 and all 4
 * of C. Steps 3-5 decode A, B, C; A's outputs are "and", "slept", ".", then the end token,
 * so A leaves after step 5 and step 6 decodes B and C. */
Test(sched, order_rail_budget_of_eight)
{
    sched_config c;
    h_config(&c);
    c.max_num_batched_tokens = 8;
    c.nextn = 0;
    sched *s = h_make(&c);
    h_add(s, 1, 6, 100); /* A */
    h_add(s, 2, 5, 100); /* B */
    h_add(s, 3, 4, 100); /* C */

    sched_plan *p = h_schedule(s);
    cr_assert(p->prompt_run && p->process_now && !p->placeholder);
    cr_assert_eq(p->n_seqs, 2);
    cr_assert_eq(p->seqs[0].request_id, 1);
    cr_assert_eq(p->seqs[0].seqlen_q, 6);
    cr_assert(p->seqs[0].sample);
    cr_assert_eq(p->seqs[1].request_id, 2);
    cr_assert_eq(p->seqs[1].seqlen_q, 2);
    cr_assert(!p->seqs[1].sample, "a cut chunk's sample is thrown away");
    cr_assert_eq(p->n_rows, 8);
    enum { AND = 501, SLEPT = 502, DOT = 503, EOS = 2 };
    sched_seq_result r[3] = {{.n_tokens = 1, .tokens = {AND}}, {.n_tokens = 1, .tokens = {77}}};
    size_t n;
    const sched_output *o = h_process(s, p, r, &n, &lg);
    cr_assert_eq(n, 1, "A gets 'and'; B gets nothing");
    cr_assert_eq(o[0].request_id, 1);
    cr_assert_eq(o[0].tokens[0], AND);
    cr_assert_eq(sched_find(s, 2)->num_tokens, 2);
    cr_assert_eq(sched_find(s, 2)->where, SEQ_IN_WAITING);

    p = h_schedule(s);
    cr_assert(p->prompt_run);
    cr_assert_eq(p->n_seqs, 2);
    cr_assert_eq(p->seqs[0].request_id, 2);
    cr_assert_eq(p->seqs[0].first_position, 2);
    cr_assert_eq(p->seqs[0].seqlen_q, 3);
    cr_assert_eq(p->seqs[1].request_id, 3);
    cr_assert_eq(p->seqs[1].seqlen_q, 4);
    cr_assert_eq(p->n_rows, 7);
    r[0] = (sched_seq_result){.n_tokens = 1, .tokens = {60}};
    r[1] = (sched_seq_result){.n_tokens = 1, .tokens = {61}};
    h_process(s, p, r, &n, &lg);
    cr_assert_eq(n, 2, "B and C get first tokens");

    const int32_t a_next[3] = {SLEPT, DOT, EOS};
    for (int step = 3; step <= 5; step++) {
        p = h_schedule(s);
        cr_assert(!p->prompt_run);
        cr_assert_eq(p->n_seqs, 3, "step %d decodes A, B, C", step);
        int a = h_entry(p, 1);
        cr_assert(a >= 0);
        for (uint32_t i = 0; i < 3; i++)
            r[i] = (sched_seq_result){.n_tokens = 1, .tokens = {70}};
        r[a].tokens[0] = a_next[step - 3];
        h_process(s, p, r, &n, &lg);
    }
    cr_assert_eq(lg.finals[1], 1);
    cr_assert_eq(lg.finish[1], SCHED_FINISH_STOP);
    cr_assert_eq(lg.tokens[1], 4, "and, slept, ., end");
    cr_assert_null(sched_find(s, 1), "A left");
    p = h_schedule(s);
    cr_assert_eq(p->n_seqs, 2, "step 6 decodes B and C");
    cr_assert_eq(h_entry(p, 1), -1);
    h_process(s, p, NULL, NULL, &lg);
    sched_destroy(s);
}

/* Explainer Pass 2, rank 0 of the long-context run: five prompts of 16,389 tokens, budget
 * 32,768, max_num_seqs 4, nextn 5. */
Test(sched, long_context_rank_zero)
{
    sched_config c;
    h_config(&c);
    c.max_num_seqs = 4;
    c.num_slots = 8;
    c.prefill_attempt_interval = 70;
    c.prefill_any_attempt_interval = 100;
    sched *s = h_make(&c);
    uint32_t free0 = sched_free_blocks(s);
    h_add(s, 0, 16389, 8); /* r0 ends after 8 tokens so a slot opens for r4 */
    for (uint64_t id = 1; id <= 4; id++)
        h_add(s, id, 16389, 4096);

    /* Prefill step 1: r0 whole, r1 cut to 16,379; 129 blocks each; r2 not looked at. */
    sched_plan *p = h_schedule(s);
    cr_assert(p->prompt_run);
    cr_assert_eq(p->n_seqs, 2);
    cr_assert_eq(p->seqs[0].seqlen_q, 16389);
    cr_assert_eq(p->seqs[1].request_id, 1);
    cr_assert_eq(p->seqs[1].seqlen_q, 16379);
    cr_assert_eq(p->seqs[1].seqlen_k, 16379, "0 + 0 + 16,379");
    cr_assert_eq(p->n_rows, 32768);
    cr_assert_eq(sched_find(s, 0)->n_blocks, 129);
    cr_assert_eq(sched_find(s, 1)->n_blocks, 129, "all blocks on the first chunk");
    cr_assert_eq(sched_find(s, 1)->status, SEQ_WAITING, "r1 stays WAITING");
    cr_assert_eq(sched_find(s, 1)->where, SEQ_IN_PREFILL, "but leaves the queue");
    cr_assert(sched_find(s, 1)->state_slot >= 0, "and holds a state slot");
    cr_assert_eq(sched_find(s, 0)->status, SEQ_RUNNING);
    cr_assert_eq(sched_free_blocks(s), free0 - 258);
    size_t n;
    h_process(s, p, NULL, &n, &lg);
    cr_assert_eq(n, 1, "r0 gets one output, r1 none");
    cr_assert_eq(sched_find(s, 0)->num_tokens, 16389);
    cr_assert_eq(sched_find(s, 1)->num_tokens, 16379);
    cr_assert_eq(sched_num_running(s), 1);

    /* Prefill step 2 (the prompt step reset decode_step, so it is an ALL point again): r1's
     * last 10 tokens, r2 whole, r3 cut to the rest. */
    cr_assert_eq(sched_decode_step(s), 0);
    p = h_schedule(s);
    cr_assert(p->prompt_run);
    cr_assert_eq(p->n_seqs, 3);
    cr_assert_eq(p->seqs[0].request_id, 1);
    cr_assert_eq(p->seqs[0].seqlen_q, 10);
    cr_assert_eq(p->seqs[0].first_position, 16379);
    cr_assert_eq(p->seqs[0].seqlen_k, 16389);
    cr_assert_eq(p->seqs[1].seqlen_q, 16389);
    cr_assert_eq(p->seqs[2].request_id, 3);
    cr_assert_eq(p->seqs[2].seqlen_q, 32768 - 10 - 16389);
    h_process(s, p, NULL, NULL, &lg);

    /* Prefill step 3: r3's remainder; r4 stops at max_num_seqs (4 hold slots). */
    p = h_schedule(s);
    cr_assert(p->prompt_run);
    cr_assert_eq(p->n_seqs, 1);
    cr_assert_eq(p->seqs[0].request_id, 3);
    h_process(s, p, NULL, NULL, &lg);
    cr_assert_eq(sched_num_running(s), 4);
    cr_assert_eq(sched_num_waiting(s), 1);

    /* First decode step: 4 requests x 6 rows = 24, the largest graph for max_num_seqs 4. */
    p = h_schedule(s);
    cr_assert(!p->prompt_run);
    cr_assert_eq(p->n_seqs, 4);
    int r1 = h_entry(p, 1);
    cr_assert_eq(p->seqs[r1].seqlen_q, 6);
    cr_assert_eq(p->seqs[r1].first_position, 16389);
    cr_assert_eq(p->seqs[r1].seqlen_k, 16395);
    cr_assert_eq(p->n_rows, 24);
    cr_assert_eq(p->graph_rows, 24);
    cr_assert_eq(p->padding_rows, 0);
    h_process(s, p, NULL, NULL, &lg);

    /* r0 ends (8 tokens); r4 is admitted only after that, and at a vote point. */
    uint64_t prompt_at = 0;
    for (int i = 0; i < 200 && !prompt_at; i++) {
        uint32_t ds = sched_decode_step(s);
        p = h_schedule(s);
        if (p->prompt_run) {
            prompt_at = ds;
            cr_assert_eq(p->seqs[0].request_id, 4);
            cr_assert_null(sched_find(s, 0), "r0 left before r4 got its slot");
        }
        h_process(s, p, NULL, NULL, &lg);
    }
    cr_assert_eq(lg.finish[0], SCHED_FINISH_LENGTH);
    cr_assert_eq(prompt_at, 70, "r4 waits for the ALL point at decode step 70");
    sched_destroy(s);
}

/* The first engine steps are empty: nothing is schedulable at step 0, so the ALL vote fails,
 * the step is an empty decode step, and the next chance is decode step 70. */
Test(sched, empty_steps_until_the_next_all_point)
{
    sched_config c;
    h_config(&c);
    c.prefill_attempt_interval = 70;
    c.prefill_any_attempt_interval = 100;
    sched *s = h_make(&c);
    sched_request r = {.id = 5, .prompt = (int32_t[]){3, 4, 5}, .prompt_len = 3,
                       .max_tokens = 4, .hold = true};
    h_add_req(s, &r);
    for (int step = 0; step < 70; step++) {
        sched_plan *p = h_step(s, &lg);
        cr_assert(p->placeholder && !p->prompt_run, "step %d is an empty decode step", step);
        cr_assert_eq(p->n_rows, 1);
        cr_assert_eq(p->seqs[0].block_table[0], 0, "placeholder rows use block 0");
        cr_assert_eq(p->seqs[0].request_id, SCHED_PLACEHOLDER_ID);
        if (step == 1)
            cr_assert_eq(sched_set_schedulable(s, 5, NULL), DI_OK);
    }
    cr_assert_eq(sched_decode_step(s), 70);
    sched_plan *p = h_step(s, &lg);
    cr_assert(p->prompt_run, "the ALL point at decode step 70 starts prefill");
    cr_assert_eq(p->seqs[0].request_id, 5);
    sched_destroy(s);
}

/* A cut prompt ends a NORMAL step; a PROMPT engine keeps looking (the cut here comes from
 * max_chunk_tokens, which leaves budget). */
Test(sched, prompt_engine_keeps_looking_after_a_cut)
{
    for (int type = SCHED_NORMAL; type <= SCHED_PROMPT; type++) {
        sched_config c;
        h_config(&c);
        c.type = (sched_engine_type)type;
        c.max_num_batched_tokens = 1000;
        c.max_chunk_tokens = 100;
        sched *s = h_make(&c);
        h_add(s, 1, 300, 8);
        h_add(s, 2, 50, 8);
        h_add(s, 3, 50, 8);
        sched_plan *p = h_schedule(s);
        cr_assert(p->prompt_run);
        cr_assert_eq(p->seqs[0].seqlen_q, 100);
        if (type == SCHED_NORMAL) {
            cr_assert_eq(p->n_seqs, 1, "NORMAL stops at the cut");
        } else {
            cr_assert_eq(p->n_seqs, 3, "PROMPT keeps looking");
            cr_assert_eq(p->seqs[2].seqlen_q, 50);
        }
        h_process(s, p, NULL, NULL, &lg);
        cr_assert_eq(sched_find(s, 1)->where, SEQ_IN_WAITING);
        cr_assert_eq(sched_find(s, 1)->num_tokens, 100, "the cut prompt is at the front");
        p = h_schedule(s);
        cr_assert_eq(p->seqs[0].request_id, 1);
        h_process(s, p, NULL, NULL, &lg);
        sched_destroy(s);
    }
}

/* With max_chunk_tokens a cut chunk ends on a multiple of it (a KV-store engine copies the
 * window state there): the budget left after a prompt's last chunk is not a multiple of 128, so
 * the next prompt's chunk is shortened to end on one, or waits for the next step when none
 * fits. */
Test(sched, cut_chunks_end_on_a_multiple_of_max_chunk_tokens)
{
    sched_config c;
    h_config(&c);
    c.type = SCHED_PROMPT;
    c.max_num_batched_tokens = 300;
    c.max_chunk_tokens = 128;
    sched *s = h_make(&c);
    h_add(s, 1, 50, 8);
    h_add(s, 2, 400, 8);
    h_add(s, 3, 400, 8);
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_seqs, 2, "request 3 would get 122 tokens: none ends on 128, it waits");
    cr_assert_eq(p->seqs[0].seqlen_q, 50);
    cr_assert_eq(p->seqs[1].seqlen_q, 128);
    h_process(s, p, NULL, NULL, &lg);
    p = h_schedule(s);
    for (uint32_t i = 0; i < p->n_seqs; i++)
        cr_assert_eq((p->seqs[i].first_position + p->seqs[i].seqlen_q) % 128, 0,
                     "request %llu: a chunk to %u", (unsigned long long)p->seqs[i].request_id,
                     p->seqs[i].first_position + p->seqs[i].seqlen_q);
    h_process(s, p, NULL, NULL, &lg);
    sched_destroy(s);
}

/* The head of waiting blocks the queue: a prompt that does not fit the free blocks holds back
 * a small one behind it. */
Test(sched, head_of_waiting_blocks_the_queue)
{
    sched_config c;
    h_config(&c);
    c.num_blocks = 11; /* 10 usable */
    sched *s = h_make(&c);
    h_add(s, 1, 128 * 6, 8);  /* takes 6 */
    h_add(s, 2, 128 * 6, 8);  /* needs 6, only 4 left */
    h_add(s, 3, 10, 8);       /* needs 1, but waits behind 2 */
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_seqs, 1);
    h_process(s, p, NULL, NULL, &lg);
    p = h_schedule(s);
    cr_assert(!p->prompt_run, "no prefill possible: decode");
    cr_assert_eq(p->n_seqs, 1);
    h_process(s, p, NULL, NULL, &lg);
    cr_assert_eq(sched_num_waiting(s), 2);
    sched_destroy(s);
}

/* Without chunked prefill a prompt runs whole, and a prompt over the budget is refused. */
Test(sched, chunked_prefill_off)
{
    sched_config c;
    h_config(&c);
    c.chunked_prefill = false;
    c.max_num_batched_tokens = 100;
    sched *s = h_make(&c);
    h_add(s, 1, 60, 8);
    h_add(s, 2, 60, 8);
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_seqs, 1, "60 + 60 > 100 and the second cannot be cut");
    cr_assert_eq(p->seqs[0].seqlen_q, 60);
    h_process(s, p, NULL, NULL, &lg);
    di_error e;
    int32_t tok[101] = {0};
    for (int i = 0; i < 101; i++)
        tok[i] = 5;
    sched_request r = {.id = 3, .prompt = tok, .prompt_len = 101, .max_tokens = 4};
    cr_assert_eq(sched_add_request(s, &r, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "chunked prefill is off"), "%s", e.msg);
    sched_destroy(s);
}

/* ---- decode ---- */

/* Explainer Pass 3, "Four running requests and an empty free list": outputs 3,000, 1,200, 400,
 * 50; the free list is empty and D must grow. Sizes (ours, nextn 0): totals 3,100, 1,300, 500
 * and 128 take 25 + 11 + 4 + 1 = 41 blocks, the whole pool; only D (128 positions) needs a new
 * block for its next row. Longest output first, served from the back: D, C, B run; A is out. */
static sched *four_running(sched_preempt_mode mode)
{
    sched_config c;
    h_config(&c);
    c.nextn = 0;
    c.num_blocks = 42;
    c.max_num_batched_tokens = 8192;
    c.preempt_mode = mode;
    sched *s = h_make(&c);
    static int32_t out[3000], prompt[100];
    for (int i = 0; i < 3000; i++)
        out[i] = 10 + i % 50;
    for (int i = 0; i < 100; i++)
        prompt[i] = 3;
    const uint32_t prompt_len[4] = {100, 100, 100, 78}, out_len[4] = {3000, 1200, 400, 50};
    for (uint64_t id = 0; id < 4; id++) {
        sched_request r = {.id = 10 + id, .prompt = prompt, .prompt_len = prompt_len[id],
                           .output = out, .output_len = out_len[id], .max_tokens = 10000};
        h_add_req(s, &r);
    }
    sched_plan *p = h_step(s, &lg);
    cr_assert_eq(p->n_seqs, 4);
    cr_assert_eq(sched_free_blocks(s), 0, "the free list is empty");
    cr_assert_eq(sched_find(s, 13)->num_tokens % 128, 0, "D needs a block for its next row");
    cr_assert_neq(sched_find(s, 12)->num_tokens % 128, 0);
    return s;
}

Test(sched, preemption_stops_the_longest_output)
{
    sched *s = four_running(SCHED_PREEMPT_STOP);
    size_t n;
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_preempted, 1);
    cr_assert_eq(p->n_seqs, 3);
    cr_assert_eq(p->seqs[0].request_id, 13, "D first");
    cr_assert_eq(p->seqs[1].request_id, 12, "then C");
    cr_assert_eq(p->seqs[2].request_id, 11, "then B");
    cr_assert_null(sched_find(s, 10), "A's blocks and slot are back");
    cr_assert_eq(sched_free_blocks(s), 25 - 1);
    const sched_output *o = h_process(s, p, NULL, &n, &lg);
    cr_assert_eq(o[0].request_id, 10, "the preemption output comes with the next outputs");
    cr_assert_eq(o[0].finish, SCHED_FINISH_PREEMPTED);
    cr_assert_eq(lg.finals[10], 1);
    cr_assert_eq(sched_get_stats(s)->preempted_stop, 1);
    sched_destroy(s);
}

Test(sched, preemption_by_recompute_keeps_the_output)
{
    sched *s = four_running(SCHED_PREEMPT_RECOMPUTE);
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_seqs, 3);
    const seq *a = sched_find(s, 10);
    cr_assert_not_null(a);
    cr_assert_eq(a->status, SEQ_WAITING);
    cr_assert_eq(a->where, SEQ_IN_WAITING);
    cr_assert_eq(a->num_tokens, 0, "its KV is dropped");
    cr_assert_eq(a->n_blocks, 0);
    cr_assert_eq(a->len, 3101, "its outputs stay, as prompt continuation");
    cr_assert_eq(seq_output_len(a), 3001);
    h_process(s, p, NULL, NULL, &lg);
    cr_assert_eq(lg.finals[10], 0, "no final output for a recomputed request");
    sched_destroy(s);
}

/* Prompts that hold their reservation between chunks must always be able to finish: they
 * need no new block. Here R decodes until a 640-token prompt A takes its 5 blocks and stops
 * after its first chunk (cache use 10 of 11 blocks, above the 0.9 threshold); R then runs out
 * of blocks and is preempted by recompute. Neither R's recompute nor the threshold may stall
 * A: before, R went in front of A and needed 7 of the 6 free blocks (the queue waited behind
 * it), or took its own reservation and pushed use to 11 of 11, which stopped every prefill
 * vote with nothing left running. Either way the engine ran empty steps forever (a soak found
 * it at seed 93304). */
static void assert_not_stalled(const sched *s)
{
    cr_assert(!sched_has_work(s), "stalled: %u waiting, %u running, %u free blocks",
              sched_num_waiting(s), sched_num_running(s), sched_free_blocks(s));
}

Test(sched, prompts_between_chunks_never_deadlock)
{
    sched_config c;
    h_config(&c);
    c.num_blocks = 12; /* 11 usable */
    c.nextn = 0;
    c.max_num_batched_tokens = 128;
    c.preempt_mode = SCHED_PREEMPT_RECOMPUTE;
    sched *s = h_make(&c);
    memset(&lg, 0, sizeof lg);
    h_add(s, 1, 100, 1000); /* R */
    bool added_a = false;
    uint32_t steps = 0;
    while (sched_has_work(s) && steps < 20000) {
        const seq *r = sched_find(s, 1);
        if (!added_a && r && r->n_blocks == 5) {
            h_add(s, 2, 640, 10); /* A */
            added_a = true;
        }
        h_step(s, &lg);
        steps++;
    }
    cr_assert(added_a);
    assert_not_stalled(s);
    cr_assert_eq(lg.finals[1], 1);
    cr_assert_eq(lg.finals[2], 1);
    cr_assert_eq(lg.finish[2], SCHED_FINISH_LENGTH);
    cr_assert_eq(sched_free_blocks(s), 11);
    sched_destroy(s);
}

/* A fork child holds its blocks from the fork on, so it must not queue behind a request that
 * waits for blocks: here (COMPLETION, 11 blocks) W needs 8 of the 6 free blocks, and once the
 * parent ends only the child could free any. Behind W the child never started: nothing ran
 * and the engine stalled. */
Test(sched, a_fork_child_never_waits_behind_a_stalled_head)
{
    sched_config c;
    h_config(&c);
    c.type = SCHED_COMPLETION;
    c.num_blocks = 12; /* 11 usable */
    c.nextn = 0;
    sched *s = h_make(&c);
    memset(&lg, 0, sizeof lg);
    static int32_t tok[1000];
    for (int i = 0; i < 1000; i++)
        tok[i] = 5;
    sched_request p = {.id = 1, .prompt = tok, .prompt_len = 600, .max_tokens = 5,
                       .kv_cached = 599, .window_cached = true};
    h_add_req(s, &p);
    h_step(s, &lg); /* P decodes with 5 blocks */
    sched_request w = {.id = 2, .prompt = tok, .prompt_len = 900, .max_tokens = 5,
                       .kv_cached = 899, .window_cached = true};
    h_add_req(s, &w);
    di_error e;
    sched_request child = {.id = 3, .max_tokens = 5};
    cr_assert_eq(sched_fork(s, 1, &child, &e), DI_OK, "%s", e.msg);
    h_check(s);
    for (uint32_t steps = 0; sched_has_work(s) && steps < 1000; steps++)
        h_step(s, &lg);
    assert_not_stalled(s);
    for (uint64_t id = 1; id <= 3; id++)
        cr_assert_eq(lg.finals[id], 1, "request %llu", (unsigned long long)id);
    cr_assert_eq(sched_free_blocks(s), 11);
    sched_destroy(s);
}

/* Explainer Pass 3, "When the verifier says no": a request with KV for 1,999 of 2,000 tokens
 * (a COMPLETION engine's handoff) decodes 6 rows; d1, d2 pass, d3 fails: 2,005 then 2,002. */
Test(sched, draft_commit_after_a_rejection)
{
    sched_config c;
    h_config(&c);
    c.type = SCHED_COMPLETION;
    sched *s = h_make(&c);
    static int32_t prompt[1999];
    for (int i = 0; i < 1999; i++)
        prompt[i] = 40;
    sched_request r = {.id = 1, .prompt = prompt, .prompt_len = 1999,
                       .output = (int32_t[]){41}, .output_len = 1, .max_tokens = 100,
                       .kv_cached = 1999, .window_cached = true};
    h_add_req(s, &r);
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_seqs, 1);
    const sched_seq_plan *e = &p->seqs[0];
    cr_assert_eq(e->first_position, 1999);
    cr_assert_eq(e->seqlen_q, 6);
    cr_assert_eq(e->seqlen_k, 2005);
    cr_assert_eq(e->n_load, 1999, "the runner loads the prompt KV first");
    cr_assert(e->load_window);
    cr_assert_eq(e->tokens[0], 41, "row 0 is the newest token");
    cr_assert_eq(e->tokens[1], 0, "no drafts yet: pad rows");
    cr_assert_eq(sched_find(s, 1)->num_tokens, 2005);
    cr_assert_eq(sched_find(s, 1)->prev_num_tokens, 1999);
    sched_seq_result res = {.n_tokens = 3, .tokens = {91, 92, 93}, .n_drafts = 5,
                            .drafts = {1, 2, 3, 4, 5}};
    size_t n;
    const sched_output *o = h_process(s, p, &res, &n, &lg);
    cr_assert_eq(sched_find(s, 1)->num_tokens, 2002);
    cr_assert_eq(sched_find(s, 1)->len, 2003);
    cr_assert_eq(o[0].n_tokens, 3);
    cr_assert_eq(o[0].n_generated, 4);
    p = h_schedule(s);
    cr_assert_eq(p->seqs[0].first_position, 2002, "t at 2,002 overwrites d3's KV");
    cr_assert_eq(p->seqs[0].tokens[0], 93);
    cr_assert_eq(p->seqs[0].tokens[1], 1, "this step checks the new drafts");
    cr_assert_eq(p->seqs[0].tokens[5], 5);
    h_process(s, p, NULL, NULL, &lg);
    sched_destroy(s);
}

/* A request two tokens from its limit gets 2 rows, not 1 + nextn. */
Test(sched, rows_shrink_near_the_limit)
{
    sched_config c;
    h_config(&c);
    c.type = SCHED_COMPLETION;
    sched *s = h_make(&c);
    sched_request r = {.id = 1, .prompt = (int32_t[]){5, 6, 7}, .prompt_len = 3,
                       .output = (int32_t[]){41}, .output_len = 1, .max_tokens = 3,
                       .kv_cached = 3, .window_cached = true};
    h_add_req(s, &r);
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->seqs[0].seqlen_q, 2, "two tokens left: 2 rows, not 6");
    h_process(s, p, &(sched_seq_result){.n_tokens = 1, .tokens = {50}}, NULL, &lg);
    p = h_schedule(s);
    cr_assert_eq(p->seqs[0].seqlen_q, 1);
    h_process(s, p, NULL, NULL, &lg);
    cr_assert_eq(lg.finish[1], SCHED_FINISH_LENGTH);
    sched_destroy(s);
}

/* Explainer Pass 3, "37 rows and a 40-row graph": max_num_seqs 64, nextn 5; six requests with
 * 6 rows and one a token from its limit with 1 row: 37 rows run on the 40-row graph with 3
 * padding rows. */
Test(sched, thirty_seven_rows_use_the_forty_row_graph)
{
    sched_config c;
    h_config(&c);
    c.type = SCHED_COMPLETION;
    c.max_num_seqs = 64;
    sched *s = h_make(&c);
    for (uint64_t id = 1; id <= 7; id++) {
        sched_request r = {.id = id, .prompt = (int32_t[]){5, 6, 7}, .prompt_len = 3,
                           .output = (int32_t[]){8}, .output_len = 1,
                           .max_tokens = id == 7 ? 2 : 100, .kv_cached = 3,
                           .window_cached = true};
        h_add_req(s, &r);
    }
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_seqs, 7);
    cr_assert_eq(p->n_rows, 37);
    cr_assert_eq(p->graph_rows, 40);
    cr_assert_eq(p->padding_rows, 3);
    h_process(s, p, NULL, NULL, &lg);
    sched_destroy(s);
}

/* max_num_seqs 4: a fifth prompt waits until one of the four finishes. */
Test(sched, fifth_prompt_waits_for_a_slot)
{
    sched_config c;
    h_config(&c);
    c.max_num_seqs = 4;
    c.nextn = 0;
    sched *s = h_make(&c);
    for (uint64_t id = 1; id <= 4; id++)
        h_add(s, id, 20, id == 3 ? 6 : 1000);
    h_add(s, 5, 20, 1000);
    bool seen5 = false;
    for (int step = 0; step < 12; step++) {
        sched_plan *p = h_schedule(s);
        if (h_entry(p, 5) >= 0) {
            seen5 = true;
            cr_assert_eq(lg.finals[3], 1, "only after request 3 finished");
        }
        cr_assert(sched_num_running(s) + (p->prompt_run ? p->n_seqs : 0) <= 4);
        h_process(s, p, NULL, NULL, &lg);
    }
    cr_assert(seen5);
    sched_destroy(s);
}

/* ---- stop rules, failures ---- */

Test(sched, stop_rules_and_tokens_after_a_stop)
{
    sched_config c;
    h_config(&c);
    c.type = SCHED_COMPLETION;
    sched *s = h_make(&c);
    sched_request base = {.prompt = (int32_t[]){5, 6, 7}, .prompt_len = 3,
                          .output = (int32_t[]){8}, .output_len = 1, .max_tokens = 100,
                          .kv_cached = 3, .window_cached = true};
    sched_request r = base;
    r.id = 1; /* eos (2) stops */
    h_add_req(s, &r);
    r.id = 2; /* ignore_eos: 2 does not stop */
    r.ignore_eos = true;
    h_add_req(s, &r);
    r = base;
    r.id = 3; /* stop id 44 */
    r.stop_ids = (int32_t[]){44};
    r.n_stop_ids = 1;
    h_add_req(s, &r);
    r = base;
    r.id = 4; /* max_tokens 3: one generated, 2 to go */
    r.max_tokens = 3;
    h_add_req(s, &r);
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_seqs, 4);
    sched_seq_result res[4];
    for (int i = 0; i < 4; i++) {
        uint64_t id = p->seqs[i].request_id;
        res[i] = (sched_seq_result){.n_tokens = 3, .tokens = {30, 2, 31}};
        if (id == 3)
            res[i] = (sched_seq_result){.n_tokens = 3, .tokens = {44, 45, 46}};
        if (id == 4)
            res[i] = (sched_seq_result){.n_tokens = 2, .tokens = {30, 31}};
    }
    size_t n;
    const sched_output *o = h_process(s, p, res, &n, &lg);
    cr_assert_eq(n, 4);
    for (size_t i = 0; i < n; i++) {
        switch (o[i].request_id) {
        case 1:
            cr_assert_eq(o[i].finish, SCHED_FINISH_STOP);
            cr_assert_eq(o[i].n_tokens, 2, "31 after the end token is dropped");
            break;
        case 2:
            cr_assert_eq(o[i].finish, SCHED_FINISH_NONE);
            cr_assert_eq(o[i].n_tokens, 3);
            break;
        case 3:
            cr_assert_eq(o[i].finish, SCHED_FINISH_STOP);
            cr_assert_eq(o[i].n_tokens, 1);
            break;
        default:
            cr_assert_eq(o[i].finish, SCHED_FINISH_LENGTH);
            cr_assert_eq(o[i].n_generated, 3);
        }
    }
    cr_assert_eq(sched_num_running(s), 1);
    sched_destroy(s);
}

Test(sched, max_model_len_caps_the_length)
{
    sched_config c;
    h_config(&c);
    c.max_model_len = 30;
    c.nextn = 0;
    sched *s = h_make(&c);
    h_add(s, 1, 25, 1000);
    for (int i = 0; i < 10 && sched_has_work(s); i++)
        h_step(s, &lg);
    cr_assert_eq(lg.finish[1], SCHED_FINISH_LENGTH);
    cr_assert_eq(lg.tokens[1], 5, "25 + 5 = max_model_len 30");
    di_error e;
    int32_t tok[30] = {0};
    sched_request r = {.id = 2, .prompt = tok, .prompt_len = 30, .max_tokens = 4};
    cr_assert_eq(sched_add_request(s, &r, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "max_model_len 30"), "%s", e.msg);
    sched_destroy(s);
}

Test(sched, per_request_failures_end_only_that_request)
{
    sched_config c;
    h_config(&c);
    c.nextn = 0;
    sched *s = h_make(&c);
    h_add(s, 1, 10, 100);
    h_add(s, 2, 10, 100);
    h_add(s, 3, 10, 100);
    h_step(s, &lg);
    sched_plan *p = h_schedule(s);
    sched_seq_result res[3];
    for (int i = 0; i < 3; i++) {
        uint64_t id = p->seqs[i].request_id;
        res[i] = (sched_seq_result){.n_tokens = 1, .tokens = {9}};
        if (id == 1)
            res[i].status = SCHED_RESULT_FAILED;
        if (id == 2)
            res[i].status = SCHED_RESULT_GRAMMAR_FAILED;
    }
    h_process(s, p, res, NULL, &lg);
    cr_assert_eq(lg.finish[1], SCHED_FINISH_FAILED);
    cr_assert_eq(lg.finish[2], SCHED_FINISH_GRAMMAR);
    cr_assert_eq(lg.finals[3], 0);
    cr_assert_eq(sched_num_running(s), 1);
    sched_destroy(s);
}

Test(sched, bad_results_change_nothing)
{
    sched_config c;
    h_config(&c);
    c.vocab_size = 1000;
    sched *s = h_make(&c);
    h_add(s, 1, 10, 100);
    h_step(s, &lg);
    sched_plan *p = h_schedule(s);
    const sched_output *o;
    size_t n;
    di_error e;
    sched_seq_result bad = {.n_tokens = 7, .tokens = {1}};
    cr_assert_eq(sched_process_outputs(s, p, &bad, 1, &o, &n, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "7 tokens"), "%s", e.msg);
    bad = (sched_seq_result){.n_tokens = 1, .tokens = {1000}};
    cr_assert_eq(sched_process_outputs(s, p, &bad, 1, &o, &n, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "vocabulary"), "%s", e.msg);
    bad = (sched_seq_result){.n_tokens = 1, .tokens = {1}, .n_drafts = 6};
    cr_assert_eq(sched_process_outputs(s, p, &bad, 1, &o, &n, &e), DI_EINVAL);
    cr_assert_eq(sched_process_outputs(s, p, &bad, 2, &o, &n, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "2 results for 1"), "%s", e.msg);
    h_check(s);
    cr_assert_eq(sched_num_in_flight(s), 1, "still in flight");
    h_process(s, p, NULL, NULL, &lg);
    sched_destroy(s);
}

/* ---- abort ---- */

/* Explainer Pass 3: a 50,000-token prompt in a NORMAL engine, budget 32,768, aborted between
 * its chunks. It reserved all 391 blocks and a slot on the first chunk; the abort returns them
 * all and emits exactly one output, finish "abort". */
Test(sched, abort_between_chunks_returns_391_blocks)
{
    sched_config c;
    h_config(&c);
    sched *s = h_make(&c);
    uint32_t blocks0 = sched_free_blocks(s), slots0 = sched_free_slots(s);
    h_add(s, 77, 50000, 100);
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->seqs[0].seqlen_q, 32768);
    cr_assert_eq(sched_find(s, 77)->n_blocks, 391);
    cr_assert_eq(sched_free_blocks(s), blocks0 - 391);
    cr_assert_eq(sched_free_slots(s), slots0 - 1);
    size_t n;
    h_process(s, p, NULL, &n, &lg);
    cr_assert_eq(n, 0);
    cr_assert_eq(sched_find(s, 77)->where, SEQ_IN_WAITING, "between chunks");
    h_abort(s, 77, &lg);
    di_error e;
    cr_assert_eq(sched_free_blocks(s), blocks0, "all 391 blocks back");
    cr_assert_eq(sched_free_slots(s), slots0, "and the slot");
    cr_assert_eq(sched_num_live(s), 0);
    cr_assert_eq(sched_abort(s, 77, NULL, &e), DI_ENOENT, "exactly once");
    cr_assert(!sched_has_work(s));
    for (int i = 0; i < 3; i++)
        h_step(s, &lg); /* nothing more for 77: h_log asserts no output after the final */
    cr_assert_eq(lg.finals[77], 1);
    sched_destroy(s);
}

/* A prompt between chunks already holds every block it needs, so a cache over the usage
 * threshold must not stop its next chunk: with only its own blocks in the pool (usage 100%)
 * the second chunk still runs at the next vote point and the request finishes. */
Test(sched, prompt_between_chunks_continues_over_the_cache_threshold)
{
    sched_config c;
    h_config(&c);
    c.num_blocks = 2; /* block 0 + the prompt's one block */
    c.max_num_batched_tokens = 32;
    c.nextn = 0;
    sched *s = h_make(&c);
    h_add(s, 5, 40, 4);
    sched_plan *p = h_schedule(s);
    cr_assert(p->prompt_run);
    cr_assert_eq(p->seqs[0].seqlen_q, 32);
    size_t n;
    h_process(s, p, NULL, &n, &lg);
    cr_assert_eq(sched_cache_usage(s), 1.0, "the pool is full of the prompt's own block");
    p = h_schedule(s);
    cr_assert(p->prompt_run, "the cut prompt continues instead of idling in decode");
    cr_assert_eq(p->seqs[0].seqlen_q, 8);
    h_process(s, p, NULL, &n, &lg);
    for (int i = 0; i < 10 && sched_has_work(s); i++)
        h_step(s, &lg);
    cr_assert_eq(lg.finals[5], 1, "the request finished");
    cr_assert_eq(lg.tokens[5], 4);
    sched_destroy(s);
}

/* Abort from every place a request can be, synchronously: waiting, in a prompt step not yet
 * processed, running. */
Test(sched, abort_from_every_queue)
{
    sched_config c;
    h_config(&c);
    sched *s = h_make(&c);
    uint32_t blocks0 = sched_free_blocks(s), slots0 = sched_free_slots(s);
    h_add(s, 1, 100, 50);
    h_add(s, 2, 100, 50);
    sched_plan *p = h_schedule(s); /* both in the prompt step */
    h_abort(s, 2, &lg);
    cr_assert_not_null(sched_find(s, 2), "held until its prompt step is processed");
    h_process(s, p, NULL, NULL, &lg);
    cr_assert_null(sched_find(s, 2));
    h_add(s, 3, 100, 50); /* waiting, never scheduled */
    h_abort(s, 3, &lg);
    h_step(s, &lg);
    h_abort(s, 1, &lg); /* running */
    for (uint64_t id = 1; id <= 3; id++) {
        cr_assert_eq(lg.finals[id], 1);
        cr_assert_eq(lg.finish[id], SCHED_FINISH_ABORT);
    }
    cr_assert_eq(sched_free_blocks(s), blocks0);
    cr_assert_eq(sched_free_slots(s), slots0);
    sched_destroy(s);
}

/* ---- fork, handoff ---- */

Test(sched, fork_shares_the_parents_blocks)
{
    sched_config c;
    h_config(&c);
    c.nextn = 0;
    sched *s = h_make(&c);
    uint32_t blocks0 = sched_free_blocks(s);
    h_add(s, 1, 300, 100);
    h_step(s, &lg); /* prefill: 300 positions of KV, 301 tokens */
    const seq *par = sched_find(s, 1);
    cr_assert_eq(par->num_tokens, 300);
    di_error e;
    sched_request child = {.id = 2, .max_tokens = 5};
    cr_assert_eq(sched_fork(s, 1, &child, &e), DI_OK, "%s", e.msg);
    h_check(s);
    const seq *ch = sched_find(s, 2);
    cr_assert_eq(ch->status, SEQ_WAITING);
    cr_assert_eq(ch->len, 301, "its prompt is the parent's tokens so far");
    cr_assert_eq(ch->num_tokens, 300, "with the parent's KV counted");
    cr_assert_eq(ch->blocks[0], par->blocks[0]);
    cr_assert_eq(ch->blocks[1], par->blocks[1]);
    cr_assert_neq(ch->blocks[2], par->blocks[2], "the partial block is a copy");
    cr_assert_eq(sched_free_blocks(s), blocks0 - 3 - 1);
    cr_assert_eq(sched_fork(s, 1, &child, &e), DI_EEXIST);
    cr_assert_eq(sched_fork(s, 2, &(sched_request){.id = 3, .max_tokens = 5}, &e), DI_ESTATE,
                 "a waiting child cannot be forked");
    cr_assert_eq(sched_fork(s, 9, &(sched_request){.id = 3, .max_tokens = 5}, &e), DI_ENOENT);

    cr_assert(ch->state_slot >= 0 && ch->state_slot != par->state_slot, "its own slot");
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_copies, 2, "the next plan carries the copies");
    cr_assert_eq(p->copies[0].kind, SCHED_COPY_BLOCK);
    cr_assert_eq(p->copies[0].src, par->blocks[2]);
    cr_assert_eq(p->copies[0].dst, ch->blocks[2]);
    cr_assert_eq(p->copies[1].kind, SCHED_COPY_SLOT);
    cr_assert_eq(p->copies[1].src, (uint32_t)par->state_slot);
    cr_assert_eq(p->copies[1].dst, (uint32_t)ch->state_slot);
    int i = h_entry(p, 2);
    cr_assert(p->prompt_run && i >= 0);
    cr_assert_eq(p->seqs[i].seqlen_q, 1, "only the newest token lacks KV");
    cr_assert_eq(p->seqs[i].first_position, 300);
    h_process(s, p, NULL, NULL, &lg);
    cr_assert_eq(ch->where, SEQ_IN_RUNNING);
    p = h_schedule(s);
    cr_assert_eq(p->n_copies, 0, "copies go once");
    h_process(s, p, NULL, NULL, &lg);
    for (int k = 0; k < 10 && sched_has_work(s); k++)
        h_step(s, &lg);
    cr_assert_eq(lg.finish[2], SCHED_FINISH_LENGTH);
    sched_abort(s, 1, NULL, NULL);
    cr_assert_eq(sched_free_blocks(s), blocks0);
    sched_destroy(s);
}

Test(sched, fork_without_a_block_for_the_copy)
{
    sched_config c;
    h_config(&c);
    c.nextn = 0;
    c.num_blocks = 4;
    sched *s = h_make(&c);
    h_add(s, 1, 300, 100); /* 3 blocks: the pool */
    h_step(s, &lg);
    di_error e;
    cr_assert_eq(sched_fork(s, 1, &(sched_request){.id = 2, .max_tokens = 5}, &e), DI_EFULL);
    cr_assert(strstr(e.msg, "fork"), "%s", e.msg);
    cr_assert_eq(sched_num_live(s), 1);
    h_check(s);
    sched_destroy(s);
}

Test(sched, prompt_engine_holds_the_kv_for_the_handoff)
{
    sched_config c;
    h_config(&c);
    c.type = SCHED_PROMPT;
    sched *s = h_make(&c);
    uint32_t blocks0 = sched_free_blocks(s), slots0 = sched_free_slots(s);
    h_add(s, 1, 200, 100);
    h_add(s, 2, 200, 100);
    size_t n;
    sched_plan *p = h_schedule(s);
    const sched_output *o = h_process(s, p, NULL, &n, &lg);
    cr_assert_eq(n, 2);
    cr_assert_eq(o[0].finish, SCHED_FINISH_HANDOFF);
    cr_assert_eq(o[0].n_tokens, 1, "with the first token");
    cr_assert_eq(sched_find(s, 1)->status, SEQ_FINISHED_HANDOFF);
    cr_assert(!sched_has_work(s));
    cr_assert_eq(sched_free_blocks(s), blocks0 - 4, "held for the store");
    cr_assert_eq(sched_release(s, 1, NULL), DI_OK);
    sched_output out;
    cr_assert_eq(sched_abort(s, 2, &out, NULL), DI_OK, "abort of a held handoff releases it");
    cr_assert_eq(out.finish, SCHED_FINISH_NONE, "its final output was the handoff");
    cr_assert_eq(sched_free_blocks(s), blocks0);
    cr_assert_eq(sched_free_slots(s), slots0);
    di_error e;
    cr_assert_eq(sched_release(s, 1, &e), DI_ENOENT);
    h_add(s, 3, 20, 10);
    cr_assert_eq(sched_release(s, 3, &e), DI_ESTATE);
    sched_destroy(s);
}

/* A prefix hit: the first chunk loads the cached KV and, on a replay, starts 128 back. */
Test(sched, prefix_hit_with_a_replay)
{
    sched_config c;
    h_config(&c);
    sched *s = h_make(&c);
    static int32_t tok[10000];
    for (int i = 0; i < 10000; i++)
        tok[i] = 1 + i % 900;
    sched_request r = {.id = 1, .prompt = tok, .prompt_len = 10000, .max_tokens = 10,
                       .kv_cached = 9856, .replay = 128};
    h_add_req(s, &r);
    sched_plan *p = h_schedule(s);
    const sched_seq_plan *e = &p->seqs[0];
    cr_assert_eq(e->n_load, 9856);
    cr_assert(!e->load_window);
    cr_assert_eq(e->first_position, 9728);
    cr_assert_eq(e->seqlen_q, 272);
    cr_assert_eq(e->window_start, 9728);
    cr_assert_eq(e->n_blocks, 79, "all blocks of the prompt");
    h_process(s, p, NULL, NULL, &lg);
    p = h_schedule(s);
    cr_assert_eq(p->seqs[0].n_load, 0, "loaded once");
    cr_assert_eq(p->seqs[0].window_start, 9728);
    h_process(s, p, NULL, NULL, &lg);
    di_error err;
    r.id = 2;
    r.replay = 0;
    cr_assert_eq(sched_add_request(s, &r, &err), DI_EINVAL, "a hit without its window");
    r.window_cached = true;
    r.replay = 128;
    cr_assert_eq(sched_add_request(s, &r, &err), DI_EINVAL, "replay and window both");
    sched_destroy(s);
}

/* ---- the vote, one rank ---- */

typedef struct spy {
    sched *s;
    uint32_t n;
    uint32_t at[64];  /* decode step of each call */
    char op[64];      /* 'A' all, 'Y' any */
} spy;

static di_status spy_all(void *ud, bool flag, bool *out, di_error *err)
{
    spy *y = ud;
    if (y->n < 64) {
        y->at[y->n] = sched_decode_step(y->s);
        y->op[y->n++] = 'A';
    }
    *out = flag;
    return DI_OK;
}

static di_status spy_any(void *ud, bool flag, bool *out, di_error *err)
{
    spy *y = ud;
    if (y->n < 64) {
        y->at[y->n] = sched_decode_step(y->s);
        y->op[y->n++] = 'Y';
    }
    *out = flag;
    return DI_OK;
}

/* ALL at decode steps 0, 70, 140; ANY at 100 and 200; a prompt step resets the count and is
 * followed by the second vote. */
Test(sched, vote_points_and_reset)
{
    static spy y;
    vote v = {spy_all, spy_any, spy_any, &y, 0, 1};
    sched_config c;
    h_config(&c);
    c.nextn = 0;
    c.prefill_attempt_interval = 70;
    c.prefill_any_attempt_interval = 100;
    c.vote = &v;
    sched *s = h_make(&c);
    y.s = s;
    h_add(s, 1, 10, 100000);
    h_step(s, &lg); /* decode step 0: ALL (wants), second vote any(picked), prompt step */
    cr_assert_eq(y.n, 2);
    cr_assert_eq(y.op[0], 'A');
    cr_assert_eq(y.op[1], 'Y', "the second vote: did any rank schedule prefill");
    y.n = 0;
    for (int i = 0; i < 210; i++)
        h_step(s, &lg);
    const char want_op[] = {'A', 'A', 'Y', 'A', 'Y'};
    const uint32_t want_at[] = {0, 70, 100, 140, 200};
    cr_assert_eq(y.n, 5, "no one wants prefill: one vote per point, no second vote");
    for (int i = 0; i < 5; i++) {
        cr_assert_eq(y.op[i], want_op[i], "call %d", i);
        cr_assert_eq(y.at[i], want_at[i], "call %d", i);
    }
    for (int i = 0; i < 5; i++)
        h_step(s, &lg); /* the ALL point at 210, nobody wants */
    /* a prompt arrives at decode step 215; the ALL point at 280 takes it and resets */
    h_add(s, 2, 10, 100000);
    y.n = 0;
    for (int i = 0; i < 67; i++)
        h_step(s, &lg);
    cr_assert_eq(y.n, 3, "ALL at 280 (wants) and its second vote, then ALL at 0 again");
    cr_assert_eq(y.at[0], 280);
    cr_assert_eq(y.op[1], 'Y');
    cr_assert_eq(y.at[2], 0, "the prompt step reset the count");
    cr_assert_eq(y.op[2], 'A');
    sched_destroy(s);
}

/* ---- misuse ---- */

Test(sched, api_misuse_is_refused)
{
    sched_config c;
    h_config(&c);
    c.max_waiting = 2;
    c.num_blocks = 20;
    c.vocab_size = 1000;
    sched *s = h_make(&c);
    di_error e;
    sched_plan *p = h_schedule(s);
    sched_plan *p2 = NULL;
    cr_assert_eq(sched_schedule(s, &p2, &e), DI_ESTATE, "sync: process first");
    cr_assert_null(p2);
    cr_assert(strstr(e.msg, "unprocessed"), "%s", e.msg);
    h_process(s, p, NULL, NULL, &lg);
    const sched_output *o;
    size_t n;
    cr_assert_eq(sched_process_outputs(s, p, NULL, 0, &o, &n, &e), DI_ESTATE, "twice");

    int32_t tok[4000];
    for (int i = 0; i < 4000; i++)
        tok[i] = 5;
    sched_request r = {.id = 1, .prompt = tok, .prompt_len = 10, .max_tokens = 5};
    h_add_req(s, &r);
    cr_assert_eq(sched_add_request(s, &r, &e), DI_EEXIST);
    r.id = 2;
    r.prompt_len = 0;
    cr_assert_eq(sched_add_request(s, &r, &e), DI_EINVAL);
    r.prompt_len = 3000; /* 24 blocks, the cache has 19 */
    cr_assert_eq(sched_add_request(s, &r, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "the cache has 19"), "%s", e.msg);
    r.prompt_len = 10;
    tok[3] = 1000;
    cr_assert_eq(sched_add_request(s, &r, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "prompt token 3"), "%s", e.msg);
    tok[3] = 5;
    r.id = SCHED_PLACEHOLDER_ID;
    cr_assert_eq(sched_add_request(s, &r, &e), DI_EINVAL);
    r.id = 2;
    h_add_req(s, &r);
    r.id = 3;
    cr_assert_eq(sched_add_request(s, &r, &e), DI_EFULL, "max_waiting 2");
    cr_assert(strstr(e.msg, "waiting queue full"), "%s", e.msg);
    cr_assert_eq(sched_set_schedulable(s, 99, &e), DI_ENOENT);
    cr_assert_eq(sched_num_live(s), 2);
    sched_destroy(s);
    sched_destroy(NULL);
}

/* output_len counts tokens already generated; without the tokens themselves the request is
 * refused, not taken as a shorter one whose KV claims run past its length. */
Test(sched, output_len_without_output_tokens_is_refused)
{
    sched_config c;
    h_config(&c);
    sched *s = h_make(&c);
    di_error e;
    int32_t tok[10] = {5, 5, 5, 5, 5, 5, 5, 5, 5, 5};
    sched_request r = {.id = 1, .prompt = tok, .prompt_len = 10, .output_len = 5,
                       .max_tokens = 20, .kv_cached = 14, .window_cached = true};
    cr_assert_eq(sched_add_request(s, &r, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "output_len 5"), "%s", e.msg);
    r.n_stop_ids = 2; /* the same for stop ids */
    r.output_len = 0;
    r.kv_cached = 0;
    r.window_cached = false;
    cr_assert_eq(sched_add_request(s, &r, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "n_stop_ids 2"), "%s", e.msg);
    cr_assert_eq(sched_num_live(s), 0);
    h_check(s);
    sched_destroy(s);
}

Test(sched, config_validation)
{
    sched_config c;
    h_config(&c);
    di_error e;
    sched *s = (sched *)0x1;
    sched_config b = c;
    b.max_num_seqs = 0;
    cr_assert_eq(sched_create(&b, &s, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "max_num_seqs 0"), "%s", e.msg);
    b = c;
    b.num_slots = 10;
    cr_assert_eq(sched_create(&b, &s, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "num_slots"), "%s", e.msg);
    b = c;
    b.type = SCHED_COMPLETION;
    b.preempt_mode = SCHED_PREEMPT_RECOMPUTE;
    cr_assert_eq(sched_create(&b, &s, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "recompute"), "%s", e.msg);
    b = c;
    b.cache_usage_threshold = 1.5;
    cr_assert_eq(sched_create(&b, &s, &e), DI_EINVAL);
    b = c;
    b.nextn = SEQ_MAX_NEXTN + 1;
    cr_assert_eq(sched_create(&b, &s, &e), DI_EINVAL);
    b = c;
    b.num_blocks = 1;
    cr_assert_eq(sched_create(&b, &s, &e), DI_EINVAL);
    cr_assert_eq(s, (sched *)0x1, "untouched");
    cr_assert_eq(sched_engine_type_parse("completion"), SCHED_COMPLETION);
    cr_assert_eq(sched_engine_type_parse("decode"), -1);
    cr_assert_eq(sched_preempt_mode_parse("recompute"), SCHED_PREEMPT_RECOMPUTE);
    cr_assert_str_eq(sched_finish_name(SCHED_FINISH_ABORT), "abort");
}

/* COMPLETION requests must bring their prompt KV; admission respects max_num_seqs. */
Test(sched, completion_admission)
{
    sched_config c;
    h_config(&c);
    c.type = SCHED_COMPLETION;
    c.max_num_seqs = 2;
    c.num_slots = 2;
    sched *s = h_make(&c);
    di_error e;
    sched_request r = {.id = 1, .prompt = (int32_t[]){5, 6, 7}, .prompt_len = 3,
                       .max_tokens = 50};
    cr_assert_eq(sched_add_request(s, &r, &e), DI_EINVAL, "no prompt KV");
    cr_assert(strstr(e.msg, "no prefill"), "%s", e.msg);
    r.kv_cached = 2;
    r.window_cached = true;
    for (uint64_t id = 1; id <= 3; id++) {
        r.id = id;
        h_add_req(s, &r);
    }
    sched_plan *p = h_schedule(s);
    cr_assert(!p->prompt_run);
    cr_assert_eq(p->n_seqs, 2, "max_num_seqs 2");
    cr_assert_eq(p->seqs[0].first_position, 2);
    cr_assert_eq(p->seqs[0].tokens[0], 7, "the newest token is row 0");
    h_process(s, p, NULL, NULL, &lg);
    cr_assert_eq(sched_num_waiting(s), 1);
    sched_destroy(s);
}
