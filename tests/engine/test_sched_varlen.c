/* MTP varlen in the scheduler (scheduler.h, "MTP varlen"; explainer Pass 2, "Choosing how many
 * drafts to check, worked in full"): the worked W/X/Y/Z example through a real step, requests
 * without confidences, the async lag of two rounds, block accounting by the actual rows, the
 * config and result checks, and the planner's reuse without allocation. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "common/util/philox.h"
#include "harness.h"

static h_log lg;

/* The explainer's table: 4 rows 8.1 ms, 8 rows 8.6 ms, 16 rows 12.0 ms (sizes 1 and 2 "don't
 * matter here" and are left out); sampler 0.4 ms. */
static const varlen_graph_time wxyz_times[] = {{4, 8.1}, {8, 8.6}, {16, 12.0}};

/* Four requests, nextn 3, max_num_seqs 4: the recorded sizes are 1, 2, 4, 8, 16. */
static void wxyz_config(sched_config *c, const varlen_graph_time *t, uint32_t nt)
{
    h_config(c);
    c->nextn = 3;
    c->max_num_seqs = 4;
    c->num_slots = 8;
    c->varlen = true;
    c->step_ms = t;
    c->n_step_ms = nt;
    c->sampler_ms = 0.4;
}

/* The explainer's confidences, already cumulative: W .95 .90 .80, X .85 .60 .30, Y .50 .20
 * .10, Z .30 .10 .05. */
static const float wxyz_conf[4][3] = {
    {.95f, .90f, .80f}, {.85f, .60f, .30f}, {.50f, .20f, .10f}, {.30f, .10f, .05f}};

/* A result with one sampled token, drafts 100 + 10 i + k and the given confidences (n_conf 0
 * when conf is NULL). */
static sched_seq_result result_with(uint32_t i, int32_t tok, uint32_t nextn, const float *conf)
{
    sched_seq_result r = {.n_tokens = 1, .tokens = {tok}, .n_drafts = nextn};
    for (uint32_t k = 0; k < nextn; k++)
        r.drafts[k] = 100 + 10 * (int32_t)i + (int32_t)k;
    if (conf) {
        r.n_conf = nextn;
        memcpy(r.draft_conf, conf, nextn * sizeof(float));
    }
    return r;
}

/* Prefills requests 1..n (prompts of len tokens) in one prompt step whose results carry
 * conf[i] (NULL rows: no confidences). */
static void prefill_with(sched *s, uint32_t n, uint32_t len, const float (*conf)[3])
{
    for (uint32_t i = 0; i < n; i++)
        h_add(s, 1 + i, len, 100);
    sched_plan *p = h_schedule(s);
    cr_assert(p->prompt_run);
    cr_assert_eq(p->n_seqs, n);
    sched_seq_result r[8];
    for (uint32_t i = 0; i < n; i++)
        r[i] = result_with(i, 50 + (int32_t)i, 3, conf ? conf[p->seqs[i].request_id - 1] : NULL);
    h_process(s, p, r, NULL, &lg);
}

/* Hand check (the explainer's worked example): ranking W.95 W.90 X.85 W.80 X.60 Y.50 X.30 Z.30
 * ...; tokens per ms 4 rows 4/8.5 = .471, 5: 4.95/9.0, 6: 5.85/9.0, 7: 6.70/9.0, 8: 7.50/9.0 =
 * .833, 9: 8.10/12.4 = .653, ..., 16: 9.65/12.4 = .778. Best 8 rows: W checks 3 drafts, X 1, Y
 * and Z none. */
Test(sched_varlen, worked_wxyz_example_through_a_step)
{
    sched_config c;
    wxyz_config(&c, wxyz_times, 3);
    sched *s = h_make(&c);
    prefill_with(s, 4, 40, wxyz_conf);
    sched_plan *p = h_schedule(s);
    cr_assert(!p->prompt_run);
    cr_assert_eq(p->n_seqs, 4);
    cr_assert_eq(p->n_rows, 8);
    cr_assert_eq(p->graph_rows, 8);
    cr_assert_eq(p->padding_rows, 0);
    static const uint32_t want[4] = {4, 2, 1, 1}; /* 1 + drafts: W 3, X 1, Y 0, Z 0 */
    for (uint64_t id = 1; id <= 4; id++) {
        int i = h_entry(p, id);
        cr_assert_geq(i, 0);
        const sched_seq_plan *e = &p->seqs[i];
        cr_assert_eq(e->seqlen_q, want[id - 1], "request %llu: %u rows", (unsigned long long)id,
                     e->seqlen_q);
        cr_assert_eq(e->first_position, 40);
        cr_assert_eq(e->seqlen_k, 40 + want[id - 1]);
        cr_assert_eq(e->tokens[0], 50 + (int32_t)(id - 1), "row 0 is the newest token");
        for (uint32_t k = 1; k < e->seqlen_q; k++) /* the first drafts, in order */
            cr_assert_eq(e->tokens[k], 100 + 10 * (int32_t)(id - 1) + (int32_t)(k - 1));
        const seq *q = sched_find(s, id);
        cr_assert_eq(q->num_tokens, 40 + want[id - 1]);
        cr_assert_eq(q->inflight_rows, want[id - 1]);
    }
    cr_assert_eq(sched_get_stats(s)->varlen_steps, 1);
    cr_assert_eq(sched_get_stats(s)->varlen_no_conf, 0);
    cr_assert_eq(sched_get_stats(s)->decode_rows, 8);
    h_process(s, p, NULL, NULL, &lg);
    sched_destroy(s);
}

/* The explainer's variant: with the 16-row graph at 10.4 ms, 16 rows give 9.65 / 10.8 = .894
 * tokens per ms, the best: every request checks all 3 drafts. */
Test(sched_varlen, worked_example_with_a_cheap_16_row_graph_checks_everything)
{
    static const varlen_graph_time t[] = {{16, 10.4}, {4, 8.1}, {8, 8.6}}; /* any order */
    sched_config c;
    wxyz_config(&c, t, 3);
    sched *s = h_make(&c);
    prefill_with(s, 4, 40, wxyz_conf);
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_rows, 16);
    cr_assert_eq(p->graph_rows, 16);
    for (uint32_t i = 0; i < 4; i++)
        cr_assert_eq(p->seqs[i].seqlen_q, 4);
    h_process(s, p, NULL, NULL, &lg);
    sched_destroy(s);
}

/* The same confidences with varlen off: every request gets 1 + nextn rows (the default). */
Test(sched_varlen, off_by_default_every_draft_is_checked)
{
    sched_config c;
    wxyz_config(&c, wxyz_times, 3);
    sched_config d;
    sched_config_default(&d);
    cr_assert(!d.varlen, "varlen is off by default");
    c.varlen = false;
    sched *s = h_make(&c);
    prefill_with(s, 4, 40, wxyz_conf);
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_rows, 16);
    cr_assert_eq(sched_get_stats(s)->varlen_steps, 0);
    h_process(s, p, NULL, NULL, &lg);
    sched_destroy(s);
}

/* A request without confidences checks no drafts (the rule in scheduler.h); one with them is
 * planned as usual; once its results carry confidences it gets drafts too. */
Test(sched_varlen, requests_without_confidences_check_no_drafts)
{
    sched_config c;
    wxyz_config(&c, wxyz_times, 3);
    sched *s = h_make(&c);
    static const float none_for_x[4][3] = {{.95f, .90f, .80f}, {-1}, {.50f, .20f, .10f},
                                           {.30f, .10f, .05f}};
    for (uint32_t i = 0; i < 4; i++)
        h_add(s, 1 + i, 40, 100);
    sched_plan *p = h_schedule(s);
    sched_seq_result r[4];
    for (uint32_t i = 0; i < 4; i++) {
        uint64_t id = p->seqs[i].request_id;
        r[i] = result_with(i, 50, 3, id == 2 ? NULL : none_for_x[id - 1]);
    }
    h_process(s, p, r, NULL, &lg);
    cr_assert_eq(sched_find(s, 2)->n_conf, 0);
    cr_assert_eq(sched_find(s, 1)->n_conf, 3);
    cr_assert_float_eq(sched_find(s, 1)->draft_conf[1], 0.9, 1e-6, "stored on the sequence");

    /* W .95 .90 .80 Y .50 .20 .10 Z .30 .10 .05, X none: 4 rows 4/8.5 = .471, 5: 4.95/9,
     * 6: 5.85/9, 7: 6.65/9, 8: 7.15/9 = .794, 9: 7.45/12.4, ..., 13: 8.05/12.4: best 8 rows,
     * the 4 extra to W.95 W.90 W.80 Y.50 */
    p = h_schedule(s);
    cr_assert_eq(p->n_rows, 8);
    cr_assert_eq(p->seqs[h_entry(p, 1)].seqlen_q, 4);
    cr_assert_eq(p->seqs[h_entry(p, 2)].seqlen_q, 1, "no confidences: no drafts");
    cr_assert_eq(p->seqs[h_entry(p, 3)].seqlen_q, 2);
    cr_assert_eq(p->seqs[h_entry(p, 4)].seqlen_q, 1);
    cr_assert_eq(sched_get_stats(s)->varlen_no_conf, 1);
    for (uint32_t i = 0; i < 4; i++)
        r[i] = result_with(i, 60, 3, wxyz_conf[p->seqs[i].request_id - 1]);
    h_process(s, p, r, NULL, &lg);
    cr_assert_eq(sched_find(s, 2)->n_conf, 3);
    p = h_schedule(s);
    cr_assert_eq(p->n_rows, 8, "now the worked example");
    cr_assert_eq(p->seqs[h_entry(p, 2)].seqlen_q, 2);
    h_process(s, p, NULL, NULL, &lg);
    /* the default results carry no confidences: back to one row each */
    p = h_schedule(s);
    cr_assert_eq(p->n_rows, 4);
    h_process(s, p, NULL, NULL, &lg);
    sched_destroy(s);
}

/* COMPLETION: a request arrives with only its first token (no drafts, no confidences): its
 * first decode step is one row. */
Test(sched_varlen, completion_admission_starts_without_drafts)
{
    sched_config c;
    wxyz_config(&c, wxyz_times, 3);
    c.type = SCHED_COMPLETION;
    sched *s = h_make(&c);
    static int32_t tok[64];
    for (int i = 0; i < 64; i++)
        tok[i] = 5 + i;
    for (uint64_t id = 1; id <= 2; id++) {
        sched_request r = {.id = id, .prompt = tok, .prompt_len = 30, .output = tok + 30,
                           .output_len = 1, .max_tokens = 50, .kv_cached = 30,
                           .window_cached = true};
        h_add_req(s, &r);
    }
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_seqs, 2);
    cr_assert_eq(p->n_rows, 2);
    cr_assert_eq(p->graph_rows, 2, "the recorded size 2, though the table starts at 4");
    cr_assert_eq(sched_get_stats(s)->varlen_no_conf, 2);
    sched_destroy(s);
}

/* Rows never exceed what a request may still produce: one token from max_tokens, it gets one
 * row whatever its confidences. */
Test(sched_varlen, drafts_stay_within_the_request_limit)
{
    static const varlen_graph_time t[] = {{4, 1.0}, {8, 1.0}, {16, 1.0}}; /* rows are free */
    sched_config c;
    wxyz_config(&c, t, 3);
    sched *s = h_make(&c);
    static const float sure[3] = {1.0f, 1.0f, 1.0f};
    h_add(s, 1, 40, 3); /* 3 tokens: the prefill's, then at most 2 */
    h_add(s, 2, 40, 100);
    sched_plan *p = h_schedule(s);
    sched_seq_result r[2] = {result_with(0, 50, 3, sure), result_with(1, 51, 3, sure)};
    h_process(s, p, r, NULL, &lg);
    p = h_schedule(s);
    cr_assert_eq(p->seqs[h_entry(p, 1)].seqlen_q, 2, "2 tokens left: 1 draft at most");
    cr_assert_eq(p->seqs[h_entry(p, 2)].seqlen_q, 4);
    cr_assert_eq(p->n_rows, 6);
    cr_assert_eq(p->graph_rows, 8);
    h_process(s, p, NULL, NULL, &lg);
    sched_destroy(s);
}

/* Blocks follow the actual rows. A request at position 126 would need a second block for 4
 * rows (126..129); with a table where one row is cheap (1 row: 1 / 5.4 = .185 tokens per ms;
 * 4 rows with drafts of .01: 1.03 / 8.5 = .121) varlen gives it one row, and it holds one
 * block. With confident drafts (4 rows: 3.97 / 8.5 = .467) it gets 4 rows and two blocks. */
Test(sched_varlen, blocks_follow_the_actual_rows)
{
    static const varlen_graph_time t[] = {{1, 5.0}, {2, 8.0}, {4, 8.1}, {8, 8.6}, {16, 12.0}};
    sched_config c;
    wxyz_config(&c, t, 5);
    c.num_blocks = 64;
    sched *s = h_make(&c);
    uint32_t free0 = sched_free_blocks(s);
    static const float low[1][3] = {{.01f, .01f, .01f}};
    prefill_with(s, 1, 126, low);
    const seq *q = sched_find(s, 1);
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->seqs[0].seqlen_q, 1);
    cr_assert_eq(p->seqs[0].first_position, 126);
    cr_assert_eq(p->graph_rows, 1);
    cr_assert_eq(q->n_blocks, 1, "positions up to 126 only");
    cr_assert_eq(sched_free_blocks(s), free0 - 1);
    static const float high[3] = {.99f, .99f, .99f};
    sched_seq_result r = result_with(0, 51, 3, high);
    h_process(s, p, &r, NULL, &lg);
    p = h_schedule(s);
    cr_assert_eq(p->seqs[0].seqlen_q, 4);
    cr_assert_eq(p->seqs[0].first_position, 127);
    cr_assert_eq(q->n_blocks, 2, "positions 127..130 cross into the second block");
    cr_assert_eq(sched_free_blocks(s), free0 - 2);
    h_process(s, p, NULL, NULL, &lg);
    h_abort(s, 1, &lg);
    cr_assert_eq(sched_free_blocks(s), free0);
    sched_destroy(s);
}

/* ---- async: the confidences lag two rounds ---- */

/* Two requests, nextn 2, sizes 1, 2, 4, 6: 2 or 4 rows cost the same and 6 rows are slow, so
 * every step checks exactly the two best drafts, all of one request's when its confidences
 * beat the other's. */
static const varlen_graph_time lag_times[] = {{2, 1.0}, {4, 1.0}, {6, 100.0}};
static const float hi2[3] = {.9f, .8f}, lo2[3] = {.2f, .1f};

static sched_seq_result lag_result(uint32_t nextn, bool high)
{
    sched_seq_result r = {.n_tokens = 1, .tokens = {70}, .n_drafts = nextn, .drafts = {71, 72},
                          .n_conf = nextn};
    memcpy(r.draft_conf, high ? hi2 : lo2, sizeof(float) * nextn);
    return r;
}

/* The drafts request `id` checks in plan p. */
static uint32_t drafts_of(const sched_plan *p, uint64_t id)
{
    int i = h_entry(p, id);
    cr_assert_geq(i, 0);
    return p->seqs[i].seqlen_q - 1;
}

Test(sched_varlen, async_uses_the_confidences_of_two_rounds_back)
{
    sched_config c;
    h_config(&c);
    c.nextn = 2;
    c.max_num_seqs = 2;
    c.num_slots = 4;
    c.async = true;
    c.varlen = true;
    c.step_ms = lag_times;
    c.n_step_ms = 3;
    sched *s = h_make(&c);
    h_add(s, 1, 20, 100);
    h_add(s, 2, 20, 100);
    /* step 0 (prompt, processed at once): A high, B low */
    sched_plan *p0 = h_schedule(s);
    cr_assert(p0->process_now);
    sched_seq_result r[2];
    for (int i = 0; i < 2; i++)
        r[i] = lag_result(2, p0->seqs[i].request_id == 1);
    h_process(s, p0, r, NULL, &lg);
    /* step 1 from step 0's confidences: A checks both drafts */
    sched_plan *p1 = h_schedule(s);
    cr_assert_eq(drafts_of(p1, 1), 2);
    cr_assert_eq(drafts_of(p1, 2), 0);
    sched_seq_result r1[2]; /* step 1 will say: A low, B high */
    for (int i = 0; i < 2; i++)
        r1[i] = lag_result(2, p1->seqs[i].request_id == 2);
    /* step 2 is scheduled while step 1 runs: still step 0's confidences */
    sched_plan *p2 = h_schedule(s);
    cr_assert_eq(drafts_of(p2, 1), 2, "step 1's confidences are not known yet");
    cr_assert_eq(drafts_of(p2, 2), 0);
    h_process(s, p1, r1, NULL, &lg);
    sched_plan_fixup(p2, p1, r1);
    sched_seq_result r2[2]; /* step 2 will say: A high, B low */
    for (int i = 0; i < 2; i++)
        r2[i] = lag_result(2, p2->seqs[i].request_id == 1);
    /* step 3, scheduled while step 2 runs: step 1's confidences (two rounds back), though
     * the drafts it checks come from step 2 */
    sched_plan *p3 = h_schedule(s);
    cr_assert_eq(drafts_of(p3, 1), 0);
    cr_assert_eq(drafts_of(p3, 2), 2, "B, as step 1 said, not A as step 2 will say");
    cr_assert(p3->seqs[h_entry(p3, 2)].tokens_from_prev);
    h_process(s, p2, r2, NULL, &lg);
    sched_plan_fixup(p3, p2, r2);
    cr_assert_eq(p3->seqs[h_entry(p3, 2)].tokens[1], 71, "the fixup copies step 2's drafts");
    /* step 4: step 2's confidences */
    sched_plan *p4 = h_schedule(s);
    cr_assert_eq(drafts_of(p4, 1), 2);
    cr_assert_eq(drafts_of(p4, 2), 0);
    h_process(s, p3, NULL, NULL, &lg);
    h_process(s, p4, NULL, NULL, &lg);
    h_abort(s, 1, &lg);
    h_abort(s, 2, &lg);
    cr_assert_eq(sched_num_live(s), 0);
    sched_destroy(s);
}

/* ---- config and result checks ---- */

static void expect_config_error(const sched_config *c, const char *needle)
{
    sched *s = NULL;
    di_error e = {0};
    cr_assert_eq(sched_create(c, &s, &e), DI_EINVAL, "want a refusal naming '%s'", needle);
    cr_assert_null(s);
    cr_assert(strstr(e.msg, needle) != NULL, "message '%s' lacks '%s'", e.msg, needle);
}

Test(sched_varlen, bad_configs_are_refused_with_the_reason)
{
    sched_config c;
    wxyz_config(&c, wxyz_times, 3);
    sched_config x = c;
    x.nextn = 0;
    expect_config_error(&x, "varlen needs nextn >= 1");
    x = c;
    x.step_ms = NULL;
    expect_config_error(&x, "step-time table");
    x = c;
    x.n_step_ms = 0;
    expect_config_error(&x, "step-time table");
    static const varlen_graph_time not_recorded[] = {{4, 8.1}, {12, 9.0}};
    x = c;
    x.step_ms = not_recorded;
    x.n_step_ms = 2;
    expect_config_error(&x, "step_ms[1]: 12 rows is not a recorded graph size");
    static const varlen_graph_time beyond[] = {{4, 8.1}, {32, 9.0}};
    x.step_ms = beyond;
    expect_config_error(&x, "step_ms[1]: 32 rows is not a recorded graph size");
    static const varlen_graph_time twice[] = {{4, 8.1}, {8, 9.0}, {4, 8.0}};
    x.step_ms = twice;
    x.n_step_ms = 3;
    expect_config_error(&x, "graph size 4 is measured twice");
    static const varlen_graph_time small[] = {{1, 8.1}, {2, 9.0}};
    x.step_ms = small;
    x.n_step_ms = 2;
    expect_config_error(&x, "largest graph measured (2 rows) cannot hold one row for each of "
                            "max_num_seqs 4");
    static const varlen_graph_time slow[] = {{4, 0.0}};
    x.step_ms = slow;
    x.n_step_ms = 1;
    expect_config_error(&x, "step_ms[0]: 4 rows take 0 ms");
    static const varlen_graph_time nan_ms[] = {{4, NAN}};
    x.step_ms = nan_ms;
    expect_config_error(&x, "step_ms[0]: 4 rows take nan ms");
    x = c;
    x.sampler_ms = -1;
    expect_config_error(&x, "sampler_ms -1");
    x.sampler_ms = INFINITY;
    expect_config_error(&x, "sampler_ms inf");
    /* off: the table is not looked at */
    x = c;
    x.varlen = false;
    x.step_ms = NULL;
    x.nextn = 0;
    sched *s = h_make(&x);
    sched_destroy(s);
}

/* The scheduler keeps its own copy of the table. */
Test(sched_varlen, the_table_is_copied)
{
    varlen_graph_time t[3];
    memcpy(t, wxyz_times, sizeof(t));
    sched_config c;
    wxyz_config(&c, t, 3);
    sched *s = h_make(&c);
    memset(t, 0, sizeof(t));
    cr_assert_eq(sched_get_config(s)->step_ms[2].rows, 16);
    prefill_with(s, 4, 40, wxyz_conf);
    sched_plan *p = h_schedule(s);
    cr_assert_eq(p->n_rows, 8);
    h_process(s, p, NULL, NULL, &lg);
    sched_destroy(s);
}

static void expect_result_error(sched *s, sched_plan *p, const sched_seq_result *r,
                                const char *needle)
{
    const sched_output *o;
    size_t n;
    di_error e = {0};
    cr_assert_eq(sched_process_outputs(s, p, r, p->n_seqs, &o, &n, &e), DI_EINVAL, "%s",
                 needle);
    cr_assert(strstr(e.msg, needle) != NULL, "message '%s' lacks '%s'", e.msg, needle);
    h_check(s);
}

Test(sched_varlen, bad_confidences_in_results_are_refused)
{
    sched_config c;
    wxyz_config(&c, wxyz_times, 3);
    sched *s = h_make(&c);
    h_add(s, 1, 40, 100);
    sched_plan *p = h_schedule(s);
    static const float ok[3] = {.9f, .5f, .5f};
    sched_seq_result r = result_with(0, 50, 3, ok);
    r.n_conf = 2;
    expect_result_error(s, p, &r, "2 confidences for 3 drafts");
    r = result_with(0, 50, 3, ok);
    r.draft_conf[2] = .6f;
    expect_result_error(s, p, &r, "confidence 2 = 0.6 exceeds confidence 1 = 0.5");
    r = result_with(0, 50, 3, ok);
    r.draft_conf[0] = 1.5f;
    expect_result_error(s, p, &r, "confidence 0 = 1.5 outside [0, 1]");
    r.draft_conf[0] = NAN;
    expect_result_error(s, p, &r, "outside [0, 1]");
    r.draft_conf[0] = -0.1f;
    expect_result_error(s, p, &r, "outside [0, 1]");
    /* nothing changed: the good result still applies */
    r = result_with(0, 50, 3, ok);
    h_process(s, p, &r, NULL, &lg);
    cr_assert_eq(sched_find(s, 1)->n_conf, 3);
    sched_destroy(s);
}

/* ---- no allocation per step ---- */

typedef struct count_alloc {
    uint64_t allocs;
} count_alloc;

static void *ca_alloc(void *ud, size_t n)
{
    ((count_alloc *)ud)->allocs++;
    return malloc(n);
}

static void ca_free(void *ud, void *p)
{
    (void)ud;
    free(p);
}

/* With varlen on, decode steps allocate nothing: the planner's scratch is made at create. */
Test(sched_varlen, decode_steps_allocate_nothing)
{
    count_alloc ca = {0};
    di_alloc a = {ca_alloc, ca_free, &ca};
    sched_config c;
    wxyz_config(&c, wxyz_times, 3);
    c.alloc = &a;
    sched *s = h_make(&c);
    prefill_with(s, 4, 40, wxyz_conf);
    uint64_t before = ca.allocs;
    for (int k = 0; k < 20; k++) {
        sched_plan *p = h_schedule(s);
        sched_seq_result r[4];
        for (uint32_t i = 0; i < p->n_seqs; i++)
            r[i] = result_with(i, 60, 3, wxyz_conf[(p->seqs[i].request_id + k) % 4]);
        h_process(s, p, r, NULL, &lg);
    }
    cr_assert_eq(ca.allocs, before, "%llu allocations in 20 decode steps",
                 (unsigned long long)(ca.allocs - before));
    cr_assert_eq(sched_get_stats(s)->varlen_steps, 20);
    sched_destroy(s);
}

/* ---- the planner: the same plans as varlen_schedule, reused without allocating ---- */

Test(sched_varlen, planner_matches_varlen_schedule_and_reuses_its_scratch)
{
    count_alloc ca = {0};
    di_alloc a = {ca_alloc, ca_free, &ca};
    varlen_graph_time t[] = {{1, 5.0}, {2, 5.1}, {4, 5.3}, {8, 6.0}, {16, 6.8}, {24, 8.0},
                             {32, 9.5}, {40, 11.0}};
    varlen_planner *pl;
    di_error e;
    cr_assert_eq(varlen_planner_create(t, 8, 0.3, 8, 40, &a, &pl, &e), DI_OK, "%s", e.msg);
    uint64_t made = ca.allocs;
    di_rng rng;
    di_rng_init(&rng, 77);
    for (int iter = 0; iter < 500; iter++) {
        double conf[8][5];
        varlen_request reqs[8];
        uint32_t n = 1 + (uint32_t)di_rng_below(&rng, 8);
        for (uint32_t i = 0; i < n; i++) {
            uint32_t nd = (uint32_t)di_rng_below(&rng, 6);
            double run = 1.0;
            for (uint32_t k = 0; k < nd; k++) {
                run *= (double)di_rng_below(&rng, 5) / 4.0; /* coarse: many ties */
                conf[i][k] = run;
            }
            reqs[i] = (varlen_request){.conf = conf[i], .num_drafts = nd};
        }
        uint32_t drafts[8];
        varlen_summary sum;
        cr_assert_eq(varlen_planner_run(pl, reqs, n, drafts, &sum, &e), DI_OK, "%s", e.msg);
        varlen_plan ref;
        cr_assert_eq(varlen_schedule(reqs, n, t, 8, 0.3, &ref, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(sum.rows, ref.rows);
        cr_assert_eq(sum.graph_rows, ref.graph_rows);
        cr_assert_eq(sum.tokens_per_ms, ref.tokens_per_ms);
        for (uint32_t i = 0; i < n; i++)
            cr_assert_eq(drafts[i], ref.drafts[i], "iteration %d request %u", iter, i);
        varlen_plan_free(&ref);
    }
    cr_assert_eq(ca.allocs, made, "runs allocate nothing");
    /* capacity and bad input: refused, outputs untouched */
    double c1[1] = {0.5};
    varlen_request big[9];
    for (int i = 0; i < 9; i++)
        big[i] = (varlen_request){.conf = c1, .num_drafts = 1};
    uint32_t d[9] = {7, 7, 7, 7, 7, 7, 7, 7, 7};
    cr_assert_eq(varlen_planner_run(pl, big, 9, d, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "more than the planner's 8"), "%s", e.msg);
    cr_assert_eq(d[0], 7);
    double up[2] = {0.2, 0.4};
    varlen_request bad = {.conf = up, .num_drafts = 2};
    cr_assert_eq(varlen_planner_run(pl, &bad, 1, d, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "exceeds"), "%s", e.msg);
    varlen_planner_free(pl);
    varlen_planner_free(NULL);
    cr_assert_eq(varlen_planner_create(t, 8, 0.3, 0, 0, NULL, &pl, &e), DI_EINVAL);
    cr_assert_eq(varlen_planner_create(t, 8, 0.3, 2, 200, NULL, &pl, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "200 drafts"), "%s", e.msg);
}

/* Every allocation of sched_create failing in turn: DI_ENOMEM, nothing leaked (the counting
 * allocator sees every block freed). */
typedef struct fail_alloc {
    uint64_t n, fail_at, live;
} fail_alloc;

static void *fa_alloc(void *ud, size_t n)
{
    fail_alloc *f = ud;
    if (++f->n == f->fail_at)
        return NULL;
    f->live++;
    return malloc(n);
}

static void fa_free(void *ud, void *p)
{
    ((fail_alloc *)ud)->live--;
    free(p);
}

Test(sched_varlen, create_fails_cleanly_at_every_allocation)
{
    for (uint64_t k = 1;; k++) {
        fail_alloc f = {.fail_at = k};
        di_alloc a = {fa_alloc, fa_free, &f};
        sched_config c;
        wxyz_config(&c, wxyz_times, 3);
        c.alloc = &a;
        sched *s = NULL;
        di_error e;
        di_status st = sched_create(&c, &s, &e);
        if (st == DI_OK) {
            cr_assert_gt(k, 10, "the run without a fault");
            sched_destroy(s);
            cr_assert_eq(f.live, 0);
            break;
        }
        cr_assert_eq(st, DI_ENOMEM, "allocation %llu: %s", (unsigned long long)k, e.msg);
        cr_assert_null(s);
        cr_assert_eq(f.live, 0, "allocation %llu failed: %llu blocks leaked",
                     (unsigned long long)k, (unsigned long long)f.live);
    }
}

/* ---- the synthetic runner's confidences (di-sim's acceptance model) ---- */

/* A decode plan of one entry with nextn draft rows holding real drafts 11, 12, ... */
static const sched_seq_result *synth_one_step(synth *y, uint32_t nextn)
{
    static int32_t rows[16];
    static sched_seq_plan e;
    static sched_plan p;
    for (uint32_t k = 0; k <= nextn; k++)
        rows[k] = 10 + (int32_t)k;
    e = (sched_seq_plan){.request_id = 1, .seqlen_q = 1 + nextn, .tokens = rows, .sample = true};
    p = (sched_plan){.n_seqs = 1, .seqs = &e, .n_rows = 1 + nextn};
    return synth_run(y, &p);
}

/* Exact confidences for a flat rate a are a, a^2, ..., a^nextn; a bias shifts each per-draft
 * chance; noise stays within its amplitude and never makes them increase. */
Test(sched_varlen, synth_confidences_follow_the_acceptance_model)
{
    synth_config sc = {.seed = 3, .nextn = 5, .vocab_size = 1000, .eos_token = -1,
                       .accept_rate = 0.7, .confidences = true};
    synth *y;
    di_error e;
    cr_assert_eq(synth_create(&sc, 4, NULL, &y, &e), DI_OK, "%s", e.msg);
    const sched_seq_result *r = synth_one_step(y, 5);
    cr_assert_eq(r->status, SCHED_RESULT_OK);
    cr_assert_eq(r->n_conf, 5);
    for (uint32_t k = 0; k < 5; k++)
        cr_assert_float_eq(r->draft_conf[k], pow(0.7, k + 1), 1e-6, "draft %u: %g", k,
                           (double)r->draft_conf[k]);
    synth_destroy(y);
    sc.conf_bias = -0.3;
    cr_assert_eq(synth_create(&sc, 4, NULL, &y, &e), DI_OK, "%s", e.msg);
    r = synth_one_step(y, 5);
    for (uint32_t k = 0; k < 5; k++)
        cr_assert_float_eq(r->draft_conf[k], pow(0.4, k + 1), 1e-6);
    synth_destroy(y);
    sc.conf_bias = 0;
    sc.conf_noise = 0.2;
    sc.accept_spread = 0.25;
    cr_assert_eq(synth_create(&sc, 4, NULL, &y, &e), DI_OK, "%s", e.msg);
    int differ = 0;
    for (int step = 0; step < 200; step++) {
        r = synth_one_step(y, 5);
        double run = 1.0;
        for (uint32_t k = 0; k < 5; k++) {
            double p = synth_draft_chance(y, r->drafts[k]);
            cr_assert(p >= 0.45 - 1e-12 && p <= 0.95 + 1e-12, "chance %g", p);
            double c = r->draft_conf[k], prev = k ? r->draft_conf[k - 1] : 1.0;
            cr_assert(c <= prev && c >= 0, "draft %u: %g after %g", k, c, prev);
            double lo = run * (p - 0.2 > 0 ? p - 0.2 : 0), hi = run * (p + 0.2 < 1 ? p + 0.2 : 1);
            cr_assert(c >= lo * (1 - 1e-6) && c <= hi * (1 + 1e-6), "draft %u: %g not in [%g, "
                      "%g]", k, c, lo, hi);
            differ += fabs(c - run * p) > 1e-3;
            run = c;
        }
    }
    cr_assert_gt(differ, 100, "the noise shows");
    synth_destroy(y);
    synth_config bad = sc;
    bad.conf_bias = 1.5;
    cr_assert_eq(synth_create(&bad, 4, NULL, &y, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "confidence bias 1.5"), "%s", e.msg);
    bad = sc;
    bad.conf_noise = -0.1;
    cr_assert_eq(synth_create(&bad, 4, NULL, &y, &e), DI_EINVAL);
    bad = sc;
    bad.accept_spread = 2;
    cr_assert_eq(synth_create(&bad, 4, NULL, &y, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "acceptance spread 2"), "%s", e.msg);
}

/* ---- the planner's ranking against a plain comparison sort ---- */

typedef struct oracle_draft {
    double conf;
    uint32_t req, idx;
} oracle_draft;

static int oracle_cmp(const void *pa, const void *pb)
{
    const oracle_draft *a = pa, *b = pb;
    if (a->conf != b->conf)
        return a->conf > b->conf ? -1 : 1;
    if (a->req != b->req)
        return a->req < b->req ? -1 : 1;
    return a->idx < b->idx ? -1 : a->idx > b->idx;
}

/* The scan of varlen.h over a qsort ranking: the draft counts of the best prefix. */
static uint32_t oracle_plan(const varlen_request *reqs, uint32_t n, const varlen_graph_time *t,
                            size_t nt, double sampler, uint32_t *drafts)
{
    static oracle_draft r[8 * 8];
    size_t total = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t d = 0; d < reqs[i].num_drafts; d++)
            r[total++] = (oracle_draft){reqs[i].conf[d], i, d};
    qsort(r, total, sizeof(r[0]), oracle_cmp);
    double tokens = n, best = -1;
    size_t best_k = 0, g = 0;
    for (size_t k = 0; n + k <= t[nt - 1].rows; k++) {
        while (t[g].rows < n + k)
            g++;
        double rate = tokens / (t[g].step_ms + sampler);
        if (rate > best) {
            best = rate;
            best_k = k;
        }
        if (k == total)
            break;
        tokens += r[k].conf;
    }
    memset(drafts, 0, n * sizeof(*drafts));
    for (size_t k = 0; k < best_k; k++)
        drafts[r[k].req]++;
    return n + (uint32_t)best_k;
}

/* Confidences that differ only far below their leading bits (a relative 1e-13), exact
 * duplicates, floats and full doubles: the ranking, hence the plan, is that of a comparison
 * sort by (confidence, request, draft). */
Test(sched_varlen, planner_ranking_is_exact_for_nearly_equal_confidences)
{
    static const varlen_graph_time t[] = {{2, 3.0}, {4, 3.1}, {8, 3.3}, {16, 4.1}, {24, 4.6},
                                          {32, 5.4}, {40, 5.9}, {48, 6.8}, {56, 7.0}, {64, 7.7}};
    varlen_planner *pl;
    di_error e;
    cr_assert_eq(varlen_planner_create(t, 10, 0.2, 8, 64, NULL, &pl, &e), DI_OK, "%s", e.msg);
    di_rng rng;
    di_rng_init(&rng, 4242);
    static const double base[4] = {0.9, 0.6, 0.3, 0.1};
    int moved = 0;
    for (int iter = 0; iter < 2000; iter++) {
        double conf[8][8];
        varlen_request reqs[8];
        uint32_t n = 1 + (uint32_t)di_rng_below(&rng, 8);
        int mode = iter % 3; /* 0: tiny perturbations, 1: floats, 2: duplicates */
        for (uint32_t i = 0; i < n; i++) {
            uint32_t nd = (uint32_t)di_rng_below(&rng, 9);
            double prev = 1.0;
            for (uint32_t k = 0; k < nd; k++) {
                double c = base[di_rng_below(&rng, 4)];
                if (mode == 0)
                    c += 1e-13 * (double)di_rng_below(&rng, 5);
                else if (mode == 1)
                    c = (float)(c * di_rng_uniform(&rng));
                c = c < prev ? c : prev; /* cumulative: never increasing */
                conf[i][k] = prev = c;
            }
            reqs[i] = (varlen_request){.conf = conf[i], .num_drafts = nd};
        }
        uint32_t got[8], want[8];
        varlen_summary sum;
        cr_assert_eq(varlen_planner_run(pl, reqs, n, got, &sum, &e), DI_OK, "%s", e.msg);
        uint32_t rows = oracle_plan(reqs, n, t, 10, 0.2, want);
        cr_assert_eq(sum.rows, rows, "iteration %d: %u rows, the comparison sort %u", iter,
                     sum.rows, rows);
        for (uint32_t i = 0; i < n; i++)
            cr_assert_eq(got[i], want[i], "iteration %d request %u", iter, i);
        moved += mode == 0 && rows > n && rows < n + 8 * 8;
    }
    cr_assert_gt(moved, 100, "partial plans among the perturbed cases: %d", moved);
    varlen_planner_free(pl);
}
