#include <criterion/criterion.h>
#include <signal.h>

#include "common/engine/seq.h"

static const int32_t prompt5[5] = {11, 12, 13, 14, 15};

static seq *make_seq(uint32_t max_tokens, int32_t eos, bool ignore_eos, const int32_t *stops,
                     uint32_t n_stops)
{
    seq_params p = {
        .id = 7,
        .prompt = prompt5,
        .prompt_len = 5,
        .max_tokens = max_tokens,
        .stop_ids = stops,
        .n_stop_ids = n_stops,
        .eos = eos,
        .ignore_eos = ignore_eos,
        .token_capacity = 5 + max_tokens,
        .block_capacity = 8,
    };
    seq *s = NULL;
    di_error e;
    cr_assert_eq(seq_create(&p, NULL, &s, &e), DI_OK, "%s", e.msg);
    return s;
}

Test(seq, created_waiting_with_no_kv)
{
    seq *s = make_seq(10, -1, false, NULL, 0);
    cr_assert_eq(s->status, SEQ_WAITING);
    cr_assert_eq(s->len, 5);
    cr_assert_eq(s->num_tokens, 0);
    cr_assert_eq(s->n_blocks, 0);
    cr_assert_eq(s->state_slot, -1);
    cr_assert_eq(s->draft_slot, 0);
    cr_assert_eq(memcmp(s->tokens, prompt5, sizeof(prompt5)), 0);
    seq_destroy(s, NULL);
    seq_destroy(NULL, NULL);
}

/* Explainer Pass 2: 16,389 tokens need 129 blocks; Pass 3: 50,000 need 391. */
Test(seq, block_counts_of_the_explainer)
{
    cr_assert_eq(seq_blocks_for(16389), 129);
    cr_assert_eq(seq_blocks_for(16384), 128);
    cr_assert_eq(seq_blocks_for(50000), 391);
    cr_assert_eq(seq_blocks_for(0), 0);
    cr_assert_eq(seq_blocks_for(1), 1);
    /* ceil((len + inflight + drafts) / 128): 130 once the sum passes 16,512 */
    seq s = {.len = 16502, .inflight_rows = 6, .n_drafts = 5};
    cr_assert_eq(seq_reserve_blocks(&s), 130);
    s.len = 16501;
    cr_assert_eq(seq_reserve_blocks(&s), 129);
}

/* Explainer Pass 3, "When the verifier says no": 1,999 -> 2,005 -> 2,002. */
Test(seq, advance_then_commit_draft_rejection)
{
    seq s = {.num_tokens = 1999, .len = 2000};
    seq_advance_optimistically(&s, 6);
    cr_assert_eq(s.prev_num_tokens, 1999);
    cr_assert_eq(s.num_tokens, 2005);
    /* d1, d2 accepted and t sampled: 3 rows of KV are valid */
    seq_commit_processed_tokens(&s, 6, 3);
    cr_assert_eq(s.num_tokens, 2002);
    cr_assert_eq(s.num_tokens, s.prev_num_tokens + 3);
    /* two steps in flight (async): the commit of the first leaves the second's rows counted */
    seq a = {.num_tokens = 1999};
    seq_advance_optimistically(&a, 6);
    seq_advance_optimistically(&a, 6);
    seq_commit_processed_tokens(&a, 6, 3);
    cr_assert_eq(a.num_tokens, 2002 + 6);
}

Test(seq, stop_rules_in_order)
{
    const int32_t stops[2] = {900, 901};
    seq *s = make_seq(4, 2, false, stops, 2);
    cr_assert_eq(seq_append_token(s, 50, 1000), SEQ_RUNNING);
    cr_assert_eq(seq_append_token(s, 2, 1000), SEQ_FINISHED_STOPPED, "eos stops");
    seq_destroy(s, NULL);

    s = make_seq(4, 2, true, stops, 2);
    cr_assert_eq(seq_append_token(s, 2, 1000), SEQ_RUNNING, "ignore_eos: eos does not stop");
    cr_assert_eq(seq_append_token(s, 901, 1000), SEQ_FINISHED_STOPPED, "stop ids still do");
    seq_destroy(s, NULL);

    s = make_seq(3, -1, false, NULL, 0);
    cr_assert_eq(seq_append_token(s, 1, 1000), SEQ_RUNNING);
    cr_assert_eq(seq_append_token(s, 1, 1000), SEQ_RUNNING);
    cr_assert_eq(seq_append_token(s, 1, 1000), SEQ_FINISHED_LENGTH_CAPPED, "3rd of max 3");
    cr_assert_eq(seq_output_len(s), 3);
    seq_destroy(s, NULL);

    s = make_seq(100, -1, false, NULL, 0);
    cr_assert_eq(seq_append_token(s, 1, 7), SEQ_RUNNING, "len 6 < 7");
    cr_assert_eq(seq_append_token(s, 1, 7), SEQ_FINISHED_LENGTH_CAPPED, "len 7 == max_model_len");
    seq_destroy(s, NULL);

    s = make_seq(1, 2, false, NULL, 0);
    cr_assert_eq(seq_append_token(s, 2, 1000), SEQ_FINISHED_STOPPED, "a stop wins over length");
    seq_destroy(s, NULL);
}

Test(seq, state_machine_table)
{
    struct {
        seq_status from, to;
        bool ok;
    } rows[] = {
        {SEQ_WAITING, SEQ_RUNNING, true},
        {SEQ_WAITING, SEQ_FINISHED_ABORTED, true},
        {SEQ_WAITING, SEQ_FINISHED_FAILED, true},
        {SEQ_WAITING, SEQ_FINISHED_STOPPED, false},
        {SEQ_WAITING, SEQ_FINISHED_PREEMPTED, false},
        {SEQ_RUNNING, SEQ_WAITING, true},
        {SEQ_RUNNING, SEQ_FINISHED_STOPPED, true},
        {SEQ_RUNNING, SEQ_FINISHED_LENGTH_CAPPED, true},
        {SEQ_RUNNING, SEQ_FINISHED_ABORTED, true},
        {SEQ_RUNNING, SEQ_FINISHED_PREEMPTED, true},
        {SEQ_RUNNING, SEQ_FINISHED_GRAMMAR_FAILED, true},
        {SEQ_RUNNING, SEQ_FINISHED_FAILED, true},
        {SEQ_RUNNING, SEQ_FINISHED_HANDOFF, true},
        {SEQ_RUNNING, SEQ_RUNNING, false},
        {SEQ_FINISHED_ABORTED, SEQ_WAITING, false},
        {SEQ_FINISHED_PREEMPTED, SEQ_WAITING, false},
        {SEQ_FINISHED_STOPPED, SEQ_RUNNING, false},
        {SEQ_FINISHED_HANDOFF, SEQ_FINISHED_ABORTED, false},
        {SEQ_STATUS_COUNT, SEQ_WAITING, false},
    };
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
        cr_assert_eq(seq_transition_allowed(rows[i].from, rows[i].to), rows[i].ok,
                     "%s -> %s", seq_status_name(rows[i].from), seq_status_name(rows[i].to));
    cr_assert_str_eq(seq_status_name(SEQ_FINISHED_LENGTH_CAPPED), "FINISHED_LENGTH_CAPPED");
    cr_assert_str_eq(seq_status_name((seq_status)99), "UNKNOWN");
}

Test(seq, illegal_transition_aborts, .signal = SIGABRT)
{
    seq *s = make_seq(4, -1, false, NULL, 0);
    seq_set_status(s, SEQ_FINISHED_STOPPED); /* WAITING cannot stop */
}

Test(seq, check_finds_broken_fields)
{
    seq *s = make_seq(4, -1, false, NULL, 0);
    di_error e;
    s->where = SEQ_IN_WAITING;
    cr_assert_eq(seq_check(s, &e), DI_OK, "%s", e.msg);

    s->num_tokens = 200; /* KV past the (empty) block table */
    cr_assert_eq(seq_check(s, &e), DI_EINTERNAL);
    cr_assert(strstr(e.msg, "do not cover"), "%s", e.msg);
    s->num_tokens = 0;

    s->state_slot = 3; /* a slot without a reservation, and no draft slot */
    cr_assert_eq(seq_check(s, &e), DI_EINTERNAL);
    s->draft_slot = 4;
    cr_assert_eq(seq_check(s, &e), DI_EINTERNAL);
    cr_assert(strstr(e.msg, "reserved"), "%s", e.msg);
    s->state_slot = -1;
    s->draft_slot = 0;

    s->status = SEQ_RUNNING; /* running needs a slot */
    cr_assert_eq(seq_check(s, &e), DI_EINTERNAL);
    s->status = SEQ_WAITING;

    s->inflight_steps = 1; /* a step in flight with no rows */
    cr_assert_eq(seq_check(s, &e), DI_EINTERNAL);
    s->inflight_steps = 0;

    s->where = SEQ_IN_RUNNING; /* a waiting sequence in the running list */
    cr_assert_eq(seq_check(s, &e), DI_EINTERNAL);
    cr_assert(strstr(e.msg, "request 7"), "%s", e.msg);
    seq_destroy(s, NULL);
}

Test(seq, create_rejects_bad_params)
{
    seq *s = (seq *)0x1;
    di_error e;
    seq_params p = {.id = 1, .prompt = prompt5, .prompt_len = 5, .max_tokens = 4,
                    .token_capacity = 9, .block_capacity = 1};
    seq_params bad = p;
    bad.prompt_len = 0;
    cr_assert_eq(seq_create(&bad, NULL, &s, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "empty prompt"), "%s", e.msg);
    bad = p;
    bad.max_tokens = 0;
    cr_assert_eq(seq_create(&bad, NULL, &s, &e), DI_EINVAL);
    bad = p;
    bad.token_capacity = 4;
    cr_assert_eq(seq_create(&bad, NULL, &s, &e), DI_EINVAL);
    bad = p;
    bad.n_stop_ids = SEQ_MAX_STOP_IDS + 1;
    bad.stop_ids = prompt5;
    cr_assert_eq(seq_create(&bad, NULL, &s, &e), DI_EINVAL);
    bad = p;
    bad.output_len = 4;
    bad.output = prompt5;
    cr_assert_eq(seq_create(&bad, NULL, &s, &e), DI_EINVAL, "4 generated of max 4");
    cr_assert_eq(s, (seq *)0x1, "output untouched on failure");
}

static void *fail_alloc(void *ud, size_t n)
{
    (void)ud;
    (void)n;
    return NULL;
}

static void never_free(void *ud, void *p)
{
    (void)ud;
    (void)p;
    cr_assert_fail("nothing was allocated");
}

Test(seq, create_out_of_memory)
{
    di_alloc a = {fail_alloc, never_free, NULL};
    seq_params p = {.id = 1, .prompt = prompt5, .prompt_len = 5, .max_tokens = 4,
                    .token_capacity = 9, .block_capacity = 1};
    seq *s = NULL;
    di_error e;
    cr_assert_eq(seq_create(&p, &a, &s, &e), DI_ENOMEM);
    cr_assert_null(s);
}
