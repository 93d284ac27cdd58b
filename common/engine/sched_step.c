/* sched_step.c: building a step plan. The rules are in scheduler.h; the explainer's traces are
 * Pass 2 ("Prefill step 1: r0 whole, r1 cut", "Continuous batching") and Pass 3 ("When memory
 * runs out").
 *
 * Prefill is chosen in two phases so a vote can sit between them: sched_select_prefill only
 * counts (nothing changes), sched_commit_prefill applies the choice. A failed vote therefore
 * leaves the scheduler untouched.
 */
#include "common/engine/sched_internal.h"

#include <assert.h>
#include <stdlib.h>

static const uint32_t sched_block_zero[1] = {0};

bool sched_head_ready(const sched *s)
{
    if (s->wq_len == 0)
        return false;
    const seq *q = sched_wq_at(s, 0);
    return q->schedulable && q->inflight_steps == 0 && !q->release_pending;
}

bool sched_head_may_start(const sched *s)
{
    return sched_head_ready(s) && (sched_wq_at(s, 0)->reserved ||
                                   sched_cache_usage(s) <= s->cfg.cache_usage_threshold);
}

static bool sched_seq_ready(const seq *q)
{
    return q->schedulable && q->inflight_steps == 0 && !q->release_pending;
}

/* The plan slot the next schedule fills. */
static sched_step *sched_step_next(sched *s)
{
    sched_step *st = &s->steps[(s->step_first + s->n_in_flight) % 2];
    st->plan = (sched_plan){.step = s->step_no, .seqs = st->entries};
    return st;
}

static void sched_step_launch(sched *s, sched_step *st)
{
    st->in_flight = true;
    s->n_in_flight++;
    s->step_no++;
    s->stats.steps++;
    if (st->plan.prompt_run)
        s->stats.prompt_steps++;
    else
        s->stats.decode_steps++;
    if (st->plan.placeholder)
        s->stats.placeholder_steps++;
}

/* One fake row at position 0 in block 0 that routes nowhere: an idle rank still joins every
 * collective of the step. */
static void sched_placeholder(sched *s, sched_step *st, bool prompt)
{
    st->rows[0] = s->cfg.pad_token;
    st->entries[0] = (sched_seq_plan){
        .request_id = SCHED_PLACEHOLDER_ID,
        .seqlen_q = 1,
        .seqlen_k = 1,
        .tokens = st->rows,
        .block_table = sched_block_zero,
        .n_blocks = 1,
        .state_slot = -1,
    };
    st->seqs[0] = NULL;
    st->gens[0] = 0;
    sched_plan *p = &st->plan;
    p->prompt_run = prompt;
    p->process_now = prompt;
    p->placeholder = true;
    p->n_seqs = 1;
    p->n_rows = 1;
    p->graph_rows = prompt ? 0 : graph_sizes_select(&s->graphs, 1);
    p->padding_rows = prompt ? 0 : p->graph_rows - 1;
}

/* Makes q hold its reservation: blocks up to `want` and a state slot. The caller has checked
 * both are available. */
static void sched_reserve(sched *s, seq *q, uint32_t want)
{
    if (want > q->n_blocks) {
        di_status st = blkmgr_alloc(s->bm, want - q->n_blocks, q->blocks + q->n_blocks, NULL);
        assert(st == DI_OK);
        (void)st;
        q->n_blocks = want;
    }
    di_status st = slots_acquire(s->sl, q->id, &q->state_slot, NULL);
    assert(st == DI_OK);
    (void)st;
    q->draft_slot = (uint32_t)q->state_slot + 1;
    q->reserved = true;
    s->n_active++;
}

/* Fills the parts of a plan entry every kind of step shares, and marks q in flight. */
static sched_seq_plan *sched_entry(sched_step *st, uint32_t i, seq *q, uint32_t rows)
{
    sched_seq_plan *e = &st->entries[i];
    uint32_t first = q->num_tokens;
    seq_advance_optimistically(q, rows);
    *e = (sched_seq_plan){
        .request_id = q->id,
        .seqlen_q = rows,
        .seqlen_k = q->num_tokens,
        .first_position = first,
        .block_table = q->blocks,
        .n_blocks = q->n_blocks,
        .state_slot = q->state_slot,
        .draft_slot = q->draft_slot,
        .n_load = q->n_load,
        .load_window = q->load_window,
        .window_start = q->window_start,
    };
    q->n_load = 0;
    q->load_window = false;
    st->seqs[i] = q;
    st->gens[i] = q->gen;
    q->plan_idx = i;
    q->inflight_steps++;
    q->inflight_rows += rows;
    st->plan.n_rows += rows;
    return e;
}

/* ---- prefill ---- */

/* Picks the prompt chunks of this step without changing anything: the first n sequences of
 * waiting with chunk sizes in s->chunk[0..n) and the blocks each must still reserve in
 * s->need (0 for one already reserved). Stops at the first sequence that cannot be scheduled
 * (the queue waits behind its head), when the budget is spent, and after a cut unless the
 * engine type keeps looking. */
static uint32_t sched_select_prefill(sched *s)
{
    const sched_config *c = &s->cfg;
    uint32_t budget = c->max_num_batched_tokens;
    uint32_t free_blocks = blkmgr_free_count(s->bm), free_slots = slots_free_count(s->sl);
    uint32_t active = s->n_active, n = 0;
    for (uint32_t i = 0; i < s->wq_len && budget > 0 && n < c->max_num_seqs; i++) {
        seq *q = sched_wq_at(s, i);
        if (!sched_seq_ready(q))
            break;
        uint32_t need = 0;
        if (!q->reserved) {
            uint32_t want = seq_reserve_blocks(q);
            need = want > q->n_blocks ? want - q->n_blocks : 0;
            if (active + 1 > c->max_num_seqs || need > free_blocks || free_slots == 0)
                break;
        }
        uint32_t remaining = q->len - q->num_tokens;
        uint32_t chunk = remaining < budget ? remaining : budget;
        if (c->max_chunk_tokens && chunk > c->max_chunk_tokens)
            chunk = c->max_chunk_tokens;
        if (c->max_chunk_tokens && chunk < remaining) {
            /* a cut chunk ends on a multiple of max_chunk_tokens (the engine copies the window
             * state there); when none fits the budget left, the prompt waits for the next step */
            uint32_t m = c->max_chunk_tokens, end = (q->num_tokens + chunk) / m * m;
            if (end > q->num_tokens)
                chunk = end - q->num_tokens;
            else if (q->num_tokens % m == 0)
                break;
        }
        if (chunk < remaining && !c->chunked_prefill)
            break;
        s->chunk[n] = chunk;
        s->need[n] = need;
        n++;
        budget -= chunk;
        if (!q->reserved) {
            free_blocks -= need;
            free_slots--;
            active++;
        }
        if (chunk < remaining && !s->type->look_after_cut)
            break; /* a cut prompt ends the step */
    }
    return n;
}

/* Applies sched_select_prefill's choice: the chosen sequences leave waiting, new ones
 * reserve their blocks and slot, and a sequence whose final chunk is scheduled is RUNNING. */
static void sched_commit_prefill(sched *s, sched_step *st, uint32_t n)
{
    uint32_t tokens = 0;
    for (uint32_t i = 0; i < n; i++) {
        seq *q = sched_wq_at(s, i);
        if (!q->reserved)
            sched_reserve(s, q, q->n_blocks + s->need[i]);
        uint32_t chunk = s->chunk[i];
        sched_seq_plan *e = sched_entry(st, i, q, chunk);
        e->tokens = q->tokens + e->first_position;
        e->sample = q->num_tokens == q->len;
        if (e->sample)
            seq_set_status(q, SEQ_RUNNING);
        tokens += chunk;
    }
    for (uint32_t i = 0; i < n; i++)
        sched_wq_at(s, i)->where = SEQ_IN_PREFILL;
    sched_wq_pop_front(s, n);
    sched_plan *p = &st->plan;
    p->prompt_run = true;
    p->process_now = true;
    p->n_seqs = n;
    s->stats.prefill_tokens += tokens;
}

/* A prompt step: the chosen chunks, or an empty (placeholder) prompt step. */
static void sched_prompt_step(sched *s, sched_step *st, uint32_t n)
{
    if (n)
        sched_commit_prefill(s, st, n);
    else
        sched_placeholder(s, st, true);
    s->decode_step = 0;
}

/* ---- decode ---- */

/* Rows of q's next decode step: its newest token and nextn drafts, but no more rows than
 * tokens it may still produce (max_tokens, max_model_len), counting its rows in flight as
 * accepted. A request one token from its limit gets 1 row (explainer: 37 rows on a 40-row
 * graph). At least 1: a request that will end in the step in flight rides with one row. */
static uint32_t sched_decode_rows(const sched *s, const seq *q)
{
    uint64_t len = (uint64_t)q->len + q->inflight_rows;
    uint64_t out = len - q->prompt_len;
    uint64_t left = out < q->max_tokens ? q->max_tokens - out : 0;
    uint64_t room = len < s->cfg.max_model_len ? s->cfg.max_model_len - len : 0;
    if (room < left)
        left = room;
    if (left > s->rows)
        left = s->rows;
    return left ? (uint32_t)left : 1;
}

/* Blocks a decode step of `rows` rows needs beyond what q holds, after handing back the blocks
 * it no longer needs: those claimed for drafts when the next step has fewer rows (only blocks
 * past every position a step in flight writes). */
static uint32_t sched_fit_blocks(sched *s, seq *q, uint32_t rows)
{
    uint32_t want = seq_blocks_for((uint64_t)q->num_tokens + rows);
    if (q->n_blocks > want) {
        blkmgr_free(s->bm, q->blocks + want, q->n_blocks - want);
        q->n_blocks = want;
    }
    return want - q->n_blocks;
}

/* The blocks of q's next decode step with every draft checked (sched_decode_rows). */
static uint32_t sched_decode_need(sched *s, seq *q)
{
    return sched_fit_blocks(s, q, sched_decode_rows(s, q));
}

/* Schedules q's decode rows: its newest token then its drafts, padded. Under async, a sequence
 * in the step in flight gets pad tokens the fixup replaces. */
static void sched_decode_entry(sched *s, sched_step *st, seq *q, uint32_t rows)
{
    uint32_t i = st->plan.n_seqs++;
    bool from_prev = q->inflight_steps > 0;
    uint32_t prev_index = q->plan_idx;
    sched_seq_plan *e = sched_entry(st, i, q, rows);
    int32_t *t = st->rows + (size_t)i * s->rows;
    t[0] = from_prev ? s->cfg.pad_token : q->tokens[q->len - 1];
    for (uint32_t k = 1; k < rows; k++)
        t[k] = !from_prev && k - 1 < q->n_drafts ? q->drafts[k - 1] : s->cfg.pad_token;
    e->tokens = t;
    e->sample = true;
    e->tokens_from_prev = from_prev;
    e->prev_index = from_prev ? prev_index : 0;
}

/* q is served this step: it gets the blocks of every draft checked now; its entry is made
 * once the rows are known (sched_decode_entries). */
static void sched_serve(sched *s, seq *q, uint32_t need)
{
    if (need) {
        di_status rc = blkmgr_alloc(s->bm, need, q->blocks + q->n_blocks, NULL);
        assert(rc == DI_OK);
        (void)rc;
        q->n_blocks += need;
    }
    s->served[s->n_served++] = q;
}

/* MTP varlen over the served sequences: s->vl_drafts[i] drafts for s->served[i]. Each offers
 * its newest confidences, no more drafts than it may still produce tokens beyond its own row,
 * none without confidences (scheduler.h, "MTP varlen"). */
static void sched_varlen(sched *s)
{
    uint32_t n = s->n_served, no_conf = 0;
    for (uint32_t i = 0; i < n; i++) {
        const seq *q = s->served[i];
        uint32_t most = sched_decode_rows(s, q) - 1;
        s->vl_reqs[i] = (varlen_request){.conf = q->draft_conf,
                                         .num_drafts = q->n_conf < most ? q->n_conf : most};
        no_conf += q->n_conf == 0;
    }
    /* the confidences were checked when they arrived; n <= max_num_seqs <= largest graph */
    di_status rc = varlen_planner_run(s->vl, s->vl_reqs, n, s->vl_drafts, NULL, NULL);
    assert(rc == DI_OK);
    (void)rc;
    s->stats.varlen_steps++;
    s->stats.varlen_no_conf += no_conf;
}

/* The entries of the served sequences, in serving order: every draft checked (up to the
 * request's limit), or varlen's choice, whose unused blocks go back now. */
static void sched_decode_entries(sched *s, sched_step *st)
{
    if (s->cfg.varlen && s->n_served)
        sched_varlen(s);
    for (uint32_t i = 0; i < s->n_served; i++) {
        seq *q = s->served[i];
        uint32_t rows = sched_decode_rows(s, q);
        if (s->cfg.varlen) {
            assert(s->vl_drafts[i] < rows);
            rows = 1 + s->vl_drafts[i];
            uint32_t need = sched_fit_blocks(s, q, rows);
            assert(need == 0); /* it holds the blocks of every draft */
            (void)need;
        }
        sched_decode_entry(s, st, q, rows);
    }
}

/* Preempts q (scheduler.h): stop, or back to the front of waiting (recompute). Returns the blocks
 * that come back only once its step in flight is processed (0 when they are free now). */
static uint32_t sched_preempt(sched *s, sched_step *st, seq *q)
{
    uint32_t deferred = q->inflight_steps ? q->n_blocks : 0;
    st->plan.n_preempted++;
    bool stop = s->cfg.preempt_mode == SCHED_PREEMPT_STOP || !s->type->recompute ||
                q->has_grammar;
    if (stop) {
        s->stats.preempted_stop++;
        sched_emit(s, q, NULL, 0, SCHED_FINISH_PREEMPTED);
        sched_finish_seq(s, q, SEQ_FINISHED_PREEMPTED);
        return deferred;
    }
    s->stats.preempted_recompute++;
    sched_run_remove(s, q);
    s->n_active--;
    seq_set_status(q, SEQ_WAITING);
    q->gen++;
    q->n_preempted++;
    q->num_tokens = 0;
    q->prev_num_tokens = 0;
    q->n_drafts = 0;
    q->n_conf = 0;
    q->n_load = 0;
    q->load_window = false;
    q->window_start = 0;
    q->reserved = false;
    sched_wq_push_after_reserved(s, q);
    sched_settle(s, q);
    return deferred;
}

static int sched_by_output_desc(const void *a, const void *b)
{
    const seq *x = *(seq *const *)a, *y = *(seq *const *)b;
    uint32_t lx = seq_output_len(x), ly = seq_output_len(y);
    if (lx != ly)
        return lx > ly ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* The free list cannot serve everyone (explainer Pass 3, "Four running requests and an empty
 * free list"): longest output first, serve from the back, preempt from the front. */
static void sched_decode_short(sched *s, sched_step *st)
{
    uint32_t n = s->n_run;
    memcpy(s->order, s->run, (size_t)n * sizeof(seq *));
    qsort(s->order, n, sizeof(seq *), sched_by_output_desc);
    uint32_t l = 0, r = n, pending = 0;
    while (l < r) {
        seq *q = s->order[r - 1];
        uint32_t need = sched_decode_need(s, q);
        while (need > blkmgr_free_count(s->bm) && l < r - 1 &&
               blkmgr_free_count(s->bm) + pending < need)
            pending += sched_preempt(s, st, s->order[l++]);
        uint32_t free_now = blkmgr_free_count(s->bm);
        if (need <= free_now)
            sched_serve(s, q, need);
        else if (free_now + pending >= need)
            s->stats.sat_out++; /* its blocks come back after the step in flight */
        else
            pending += sched_preempt(s, st, q);
        r--;
    }
}

/* COMPLETION: admit waiting requests whose prompt KV is cached, while blocks, slots,
 * max_num_seqs and the cache threshold allow; the head blocks the queue. */
static void sched_admit(sched *s)
{
    while (s->wq_len && sched_head_may_start(s)) {
        seq *q = sched_wq_at(s, 0);
        uint32_t want = seq_blocks_for((uint64_t)q->num_tokens + sched_decode_rows(s, q));
        uint32_t need = want > q->n_blocks ? want - q->n_blocks : 0;
        if (need > blkmgr_free_count(s->bm))
            break;
        if (!q->reserved && (s->n_active >= s->cfg.max_num_seqs || slots_free_count(s->sl) == 0))
            break;
        sched_wq_pop_front(s, 1);
        if (q->reserved) { /* a fork child: it holds its slot already */
            di_status rc = blkmgr_alloc(s->bm, need, q->blocks + q->n_blocks, NULL);
            assert(rc == DI_OK);
            (void)rc;
            q->n_blocks = want;
        } else {
            sched_reserve(s, q, want);
        }
        seq_set_status(q, SEQ_RUNNING);
        sched_run_add(s, q);
        s->served[s->n_served++] = q;
    }
}

static void sched_build_decode(sched *s, sched_step *st)
{
    uint32_t total = 0;
    s->n_served = 0;
    for (uint32_t i = 0; i < s->n_run; i++)
        total += sched_decode_need(s, s->run[i]);
    if (total <= blkmgr_free_count(s->bm)) {
        for (uint32_t i = 0; i < s->n_run; i++) {
            seq *q = s->run[i];
            sched_serve(s, q, sched_decode_need(s, q));
        }
    } else {
        sched_decode_short(s, st);
    }
    if (!s->type->prefill)
        sched_admit(s);
    sched_decode_entries(s, st);
    s->decode_step++;
    if (st->plan.n_seqs == 0) {
        uint32_t preempted = st->plan.n_preempted;
        sched_placeholder(s, st, false);
        st->plan.n_preempted = preempted;
        return;
    }
    sched_plan *p = &st->plan;
    p->graph_rows = graph_sizes_select(&s->graphs, p->n_rows);
    assert(p->graph_rows >= p->n_rows);
    p->padding_rows = p->graph_rows - p->n_rows;
    s->stats.decode_rows += p->n_rows;
}

/* ---- the step type ---- */

/* NORMAL: at an ALL or ANY point the group votes on prefill; if it passes, each rank picks its
 * chunks and a second vote asks whether any rank picked any. *prompt tells the caller to run
 * the prompt step with s->chunk/s->need holding *n chunks. Nothing changes here. */
static di_status sched_normal_vote(sched *s, bool *prompt, uint32_t *n, di_error *err)
{
    *prompt = false;
    *n = 0;
    vote_fn point = NULL;
    if (s->decode_step % s->cfg.prefill_attempt_interval == 0)
        point = s->vote.all;
    else if (s->decode_step % s->cfg.prefill_any_attempt_interval == 0)
        point = s->vote.any;
    if (!point)
        return DI_OK;
    /* A head that already holds its blocks (a prompt between chunks) needs no more memory:
     * it wants prefill whatever the cache usage, or a full cache would park it forever. */
    bool want = sched_head_may_start(s);
    bool agree;
    s->stats.votes++;
    di_status st = point(s->vote.userdata, want, &agree, err);
    if (st != DI_OK || !agree)
        return st;
    uint32_t chosen = sched_select_prefill(s);
    bool did;
    s->stats.votes++;
    st = s->vote.any(s->vote.userdata, chosen > 0, &did, err);
    if (st != DI_OK)
        return st;
    *prompt = did;
    *n = chosen;
    return DI_OK;
}

di_status sched_schedule(sched *s, sched_plan **out, di_error *err)
{
    uint32_t limit = s->cfg.async ? 2 : 1;
    if (s->n_in_flight >= limit)
        return di_fail(err, DI_ESTATE, "step %llu is unprocessed; process it before scheduling "
                       "step %llu (%s)", (unsigned long long)s->steps[s->step_first].plan.step,
                       (unsigned long long)s->step_no,
                       s->cfg.async ? "async allows one step ahead" : "async is off");
    if (s->n_in_flight && s->steps[s->step_first].plan.process_now)
        return di_fail(err, DI_ESTATE, "prompt step %llu must be processed before the next "
                       "schedule", (unsigned long long)s->steps[s->step_first].plan.step);
    bool prompt = false;
    uint32_t n = 0;
    if (s->type->votes) {
        di_status st = sched_normal_vote(s, &prompt, &n, err);
        if (st != DI_OK)
            return st;
    } else if (s->type->prefill) {
        prompt = true;
        n = sched_select_prefill(s);
    }
    sched_step *st = sched_step_next(s);
    /* the fork copies go before this step's forward */
    memcpy(st->copies, s->pend, (size_t)s->n_pend * sizeof(sched_copy));
    st->plan.n_copies = s->n_pend;
    st->plan.copies = st->copies;
    s->n_pend = 0;
    if (prompt)
        sched_prompt_step(s, st, n);
    else
        sched_build_decode(s, st);
    sched_step_launch(s, st);
    *out = &st->plan;
    return DI_OK;
}
