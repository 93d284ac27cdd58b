/* sched.c: the scheduler's lifecycle, configuration, requests (add, abort, fork, release),
 * queues and the invariant check. Plans are built in sched_step.c and applied in
 * sched_process.c.
 */
#include "common/engine/sched_internal.h"

#include <assert.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* ---- tables ---- */

const sched_type_row sched_type_rows[SCHED_TYPE_COUNT] = {
    /*                  name          prefill decode votes  look   recompute hold */
    [SCHED_NORMAL] = {"normal", true, true, true, false, true, false},
    [SCHED_PROMPT] = {"prompt", true, false, false, true, false, true},
    [SCHED_COMPLETION] = {"completion", false, true, false, false, false, false},
};

static const char *const sched_preempt_names[SCHED_PREEMPT_COUNT] = {"stop", "recompute"};

static const char *const sched_finish_names[SCHED_FINISH_COUNT] = {
    [SCHED_FINISH_NONE] = "none",         [SCHED_FINISH_STOP] = "stop",
    [SCHED_FINISH_LENGTH] = "length",     [SCHED_FINISH_ABORT] = "abort",
    [SCHED_FINISH_PREEMPTED] = "preempted", [SCHED_FINISH_GRAMMAR] = "grammar",
    [SCHED_FINISH_FAILED] = "failed",     [SCHED_FINISH_HANDOFF] = "handoff",
};

/* Bounds of the integer fields of sched_config: one row each, checked by
 * sched_config_validate. */
typedef struct sched_field {
    const char *name;
    size_t offset;
    uint32_t min, max;
} sched_field;

#define SCHED_FIELD(f, lo, hi) {#f, offsetof(sched_config, f), lo, hi}
static const sched_field sched_fields[] = {
    SCHED_FIELD(max_num_batched_tokens, 1, 1u << 24),
    SCHED_FIELD(max_num_seqs, 1, 1u << 16),
    SCHED_FIELD(max_model_len, 2, 1u << 26),
    SCHED_FIELD(nextn, 0, SEQ_MAX_NEXTN),
    SCHED_FIELD(num_blocks, 2, 1u << 31),
    SCHED_FIELD(num_slots, 1, 1u << 20),
    SCHED_FIELD(prefill_attempt_interval, 1, 1u << 24),
    SCHED_FIELD(prefill_any_attempt_interval, 1, 1u << 24),
    SCHED_FIELD(graph_interval, 1, 4096),
    SCHED_FIELD(max_waiting, 1, 1u << 22),
    SCHED_FIELD(max_chunk_tokens, 0, 1u << 24),
    SCHED_FIELD(vocab_size, 0, 1u << 30),
};
#undef SCHED_FIELD

void sched_config_default(sched_config *c)
{
    *c = (sched_config){
        .type = SCHED_NORMAL,
        .max_num_batched_tokens = 32768,
        .max_num_seqs = 64,
        .max_model_len = 131072,
        .nextn = 5,
        .num_blocks = 1025,
        .num_slots = 128,
        .prefill_attempt_interval = 70,
        .prefill_any_attempt_interval = 100,
        .cache_usage_threshold = 0.9,
        .preempt_mode = SCHED_PREEMPT_STOP,
        .graph_interval = 8,
        .chunked_prefill = true,
        .async = false,
        .max_waiting = 4096,
        .max_chunk_tokens = 0,
        .eos_token = -1,
        .pad_token = 0,
        .vocab_size = 0,
    };
}

/* Index of the first recorded size >= rows (g->count when none). */
static size_t sched_graph_index(const graph_sizes *g, uint32_t rows)
{
    size_t lo = 0, hi = g->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (g->sizes[mid] < rows)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* One entry of the varlen table: a recorded graph size, measured once, in range. seen[] marks
 * the sizes already measured (indexed like g->sizes). */
static di_status sched_check_step_ms(const sched_config *c, const graph_sizes *g, uint32_t i,
                                     bool *seen, di_error *err)
{
    const varlen_graph_time *t = &c->step_ms[i];
    size_t k = sched_graph_index(g, t->rows);
    if (t->rows == 0 || k == g->count || g->sizes[k] != t->rows)
        return di_fail(err, DI_EINVAL, "step_ms[%u]: %u rows is not a recorded graph size (powers "
                       "of 2 up to graph_interval %u, then its multiples, up to max_num_seqs x "
                       "(1 + nextn) = %u)", i, t->rows, c->graph_interval, g->max_rows);
    if (!(t->step_ms >= VARLEN_MIN_MS && t->step_ms <= VARLEN_MAX_MS))
        return di_fail(err, DI_EINVAL, "step_ms[%u]: %u rows take %g ms, outside [%g, %g] ms", i,
                       t->rows, t->step_ms, VARLEN_MIN_MS, VARLEN_MAX_MS);
    if (seen[k])
        return di_fail(err, DI_EINVAL, "step_ms[%u]: graph size %u is measured twice", i,
                       t->rows);
    seen[k] = true;
    return DI_OK;
}

/* MTP varlen settings (scheduler.h, "MTP varlen"). The other fields are valid already. */
static di_status sched_validate_varlen(const sched_config *c, di_error *err)
{
    if (!c->varlen)
        return DI_OK;
    if (c->nextn == 0)
        return di_fail(err, DI_EINVAL, "varlen needs nextn >= 1 (with no drafts there is "
                       "nothing to choose)");
    if (!c->step_ms || c->n_step_ms == 0)
        return di_fail(err, DI_EINVAL, "varlen needs the step-time table (step_ms: one time per "
                       "recorded graph size)");
    if (c->n_step_ms > SCHED_MAX_STEP_MS)
        return di_fail(err, DI_EINVAL, "step_ms has %u entries, more than %u", c->n_step_ms,
                       SCHED_MAX_STEP_MS);
    if (!(c->sampler_ms >= 0.0 && c->sampler_ms <= VARLEN_MAX_MS))
        return di_fail(err, DI_EINVAL, "sampler_ms %g outside [0, %g] ms", c->sampler_ms,
                       VARLEN_MAX_MS);
    graph_sizes g;
    di_status st = graph_sizes_init(&g, c->max_num_seqs, c->nextn, c->graph_interval, err);
    if (st != DI_OK)
        return st;
    bool *seen = calloc(g.count, sizeof(bool));
    if (!seen) {
        graph_sizes_free(&g);
        return di_fail(err, DI_ENOMEM, "out of memory checking step_ms");
    }
    uint32_t largest = 0;
    for (uint32_t i = 0; i < c->n_step_ms && st == DI_OK; i++) {
        st = sched_check_step_ms(c, &g, i, seen, err);
        if (c->step_ms[i].rows > largest)
            largest = c->step_ms[i].rows;
    }
    free(seen);
    graph_sizes_free(&g);
    if (st == DI_OK && largest < c->max_num_seqs)
        st = di_fail(err, DI_EINVAL, "step_ms: the largest graph measured (%u rows) cannot hold "
                     "one row for each of max_num_seqs %u requests; measure a graph of at least "
                     "%u rows", largest, c->max_num_seqs, c->max_num_seqs);
    return st;
}

di_status sched_config_validate(const sched_config *c, di_error *err)
{
    if (!c)
        return di_fail(err, DI_EINVAL, "no scheduler config");
    for (size_t i = 0; i < sizeof(sched_fields) / sizeof(sched_fields[0]); i++) {
        const sched_field *f = &sched_fields[i];
        uint32_t v;
        memcpy(&v, (const char *)c + f->offset, sizeof(v));
        if (v < f->min || v > f->max)
            return di_fail(err, DI_EINVAL, "%s %u outside [%u, %u]", f->name, v, f->min, f->max);
    }
    if ((unsigned)c->type >= SCHED_TYPE_COUNT)
        return di_fail(err, DI_EINVAL, "engine type %d unknown", (int)c->type);
    if ((unsigned)c->preempt_mode >= SCHED_PREEMPT_COUNT)
        return di_fail(err, DI_EINVAL, "preemption mode %d unknown", (int)c->preempt_mode);
    if (c->preempt_mode == SCHED_PREEMPT_RECOMPUTE && !sched_type_rows[c->type].recompute)
        return di_fail(err, DI_EINVAL, "preemption by recompute needs a NORMAL engine (a %s "
                       "engine has no prefill to recompute with)", sched_type_rows[c->type].name);
    if (!(c->cache_usage_threshold > 0.0 && c->cache_usage_threshold <= 1.0))
        return di_fail(err, DI_EINVAL, "cache_usage_threshold %g outside (0, 1]",
                       c->cache_usage_threshold);
    if (c->num_slots < c->max_num_seqs)
        return di_fail(err, DI_EINVAL, "num_slots %u below max_num_seqs %u", c->num_slots,
                       c->max_num_seqs);
    if (c->vocab_size && (c->eos_token >= (int64_t)c->vocab_size ||
                          c->pad_token >= (int64_t)c->vocab_size))
        return di_fail(err, DI_EINVAL, "eos %d or pad %d outside the vocabulary of %u",
                       c->eos_token, c->pad_token, c->vocab_size);
    if (c->pad_token < 0 || c->eos_token < -1)
        return di_fail(err, DI_EINVAL, "pad token %d must be >= 0, eos %d >= -1", c->pad_token,
                       c->eos_token);
    if (c->vote && (!c->vote->all || !c->vote->any || !c->vote->any_work))
        return di_fail(err, DI_EINVAL, "vote struct with a NULL collective");
    return sched_validate_varlen(c, err);
}

const char *sched_engine_type_name(sched_engine_type t)
{
    return (unsigned)t < SCHED_TYPE_COUNT ? sched_type_rows[t].name : "unknown";
}

int sched_engine_type_parse(const char *name)
{
    for (int i = 0; name && i < SCHED_TYPE_COUNT; i++)
        if (strcmp(name, sched_type_rows[i].name) == 0)
            return i;
    return -1;
}

const char *sched_preempt_mode_name(sched_preempt_mode m)
{
    return (unsigned)m < SCHED_PREEMPT_COUNT ? sched_preempt_names[m] : "unknown";
}

int sched_preempt_mode_parse(const char *name)
{
    for (int i = 0; name && i < SCHED_PREEMPT_COUNT; i++)
        if (strcmp(name, sched_preempt_names[i]) == 0)
            return i;
    return -1;
}

const char *sched_finish_name(sched_finish f)
{
    return (unsigned)f < SCHED_FINISH_COUNT ? sched_finish_names[f] : "unknown";
}

sched_finish sched_finish_of(seq_status st)
{
    switch (st) {
    case SEQ_FINISHED_STOPPED:
        return SCHED_FINISH_STOP;
    case SEQ_FINISHED_LENGTH_CAPPED:
        return SCHED_FINISH_LENGTH;
    case SEQ_FINISHED_ABORTED:
        return SCHED_FINISH_ABORT;
    case SEQ_FINISHED_PREEMPTED:
        return SCHED_FINISH_PREEMPTED;
    case SEQ_FINISHED_GRAMMAR_FAILED:
        return SCHED_FINISH_GRAMMAR;
    case SEQ_FINISHED_FAILED:
        return SCHED_FINISH_FAILED;
    case SEQ_FINISHED_HANDOFF:
        return SCHED_FINISH_HANDOFF;
    default:
        return SCHED_FINISH_NONE;
    }
}

/* ---- id map: open addressing, linear probing, backward-shift deletion ---- */

static uint32_t sched_map_home(const sched *s, uint64_t id)
{
    return (uint32_t)((id * 0x9E3779B97F4A7C15ull) >> 32) & s->map_mask;
}

seq *sched_map_get(const sched *s, uint64_t id)
{
    for (uint32_t i = sched_map_home(s, id);; i = (i + 1) & s->map_mask) {
        if (!s->map_vals[i])
            return NULL;
        if (s->map_keys[i] == id)
            return s->map_vals[i];
    }
}

static void sched_map_put(sched *s, seq *q)
{
    uint32_t i = sched_map_home(s, q->id);
    while (s->map_vals[i])
        i = (i + 1) & s->map_mask;
    s->map_keys[i] = q->id;
    s->map_vals[i] = q;
}

static void sched_map_del(sched *s, uint64_t id)
{
    uint32_t i = sched_map_home(s, id);
    while (s->map_vals[i] && s->map_keys[i] != id)
        i = (i + 1) & s->map_mask;
    assert(s->map_vals[i]);
    /* shift later members of the cluster back over the hole */
    for (uint32_t j = (i + 1) & s->map_mask; s->map_vals[j]; j = (j + 1) & s->map_mask) {
        uint32_t h = sched_map_home(s, s->map_keys[j]);
        bool movable = i <= j ? (h <= i || h > j) : (h <= i && h > j);
        if (movable) {
            s->map_keys[i] = s->map_keys[j];
            s->map_vals[i] = s->map_vals[j];
            i = j;
        }
    }
    s->map_vals[i] = NULL;
}

/* ---- queues ---- */

seq *sched_wq_at(const sched *s, uint32_t i)
{
    assert(i < s->wq_len);
    uint32_t k = s->wq_head + i;
    return s->wq[k >= s->wq_cap ? k - s->wq_cap : k];
}

static void sched_wq_push_back(sched *s, seq *q)
{
    assert(s->wq_len < s->wq_cap);
    uint32_t k = s->wq_head + s->wq_len;
    s->wq[k >= s->wq_cap ? k - s->wq_cap : k] = q;
    s->wq_len++;
    q->where = SEQ_IN_WAITING;
}

void sched_wq_push_front(sched *s, seq *q)
{
    assert(s->wq_len < s->wq_cap);
    s->wq_head = s->wq_head == 0 ? s->wq_cap - 1 : s->wq_head - 1;
    s->wq[s->wq_head] = q;
    s->wq_len++;
    q->where = SEQ_IN_WAITING;
}

void sched_wq_push_after_reserved(sched *s, seq *q)
{
    sched_wq_push_front(s, q);
    /* move it behind the leading run of reserved sequences, which keep their order */
    for (uint32_t i = 0; i + 1 < s->wq_len; i++) {
        uint32_t a = (s->wq_head + i) % s->wq_cap, b = (s->wq_head + i + 1) % s->wq_cap;
        if (!s->wq[b]->reserved)
            break;
        s->wq[a] = s->wq[b];
        s->wq[b] = q;
    }
}

void sched_wq_pop_front(sched *s, uint32_t n)
{
    assert(n <= s->wq_len);
    s->wq_head = (uint32_t)(((uint64_t)s->wq_head + n) % s->wq_cap);
    s->wq_len -= n;
}

/* Removes q from the middle of waiting: O(waiting), only for aborts. */
static void sched_wq_remove(sched *s, seq *q)
{
    uint32_t i = 0;
    while (i < s->wq_len && sched_wq_at(s, i) != q)
        i++;
    assert(i < s->wq_len);
    for (; i + 1 < s->wq_len; i++) {
        uint32_t a = (s->wq_head + i) % s->wq_cap, b = (s->wq_head + i + 1) % s->wq_cap;
        s->wq[a] = s->wq[b];
    }
    s->wq_len--;
}

void sched_run_add(sched *s, seq *q)
{
    assert(s->n_run < s->cfg.max_num_seqs);
    q->run_idx = s->n_run;
    s->run[s->n_run++] = q;
    q->where = SEQ_IN_RUNNING;
}

void sched_run_remove(sched *s, seq *q)
{
    assert(q->where == SEQ_IN_RUNNING && q->run_idx < s->n_run && s->run[q->run_idx] == q);
    seq *last = s->run[--s->n_run];
    s->run[q->run_idx] = last;
    last->run_idx = q->run_idx;
    q->where = SEQ_IN_NONE;
}

static void sched_all_add(sched *s, seq *q)
{
    q->all_prev = NULL;
    q->all_next = s->all;
    if (s->all)
        s->all->all_prev = q;
    s->all = q;
    s->n_live++;
    sched_map_put(s, q);
}

static void sched_destroy_seq(sched *s, seq *q)
{
    if (q->all_prev)
        q->all_prev->all_next = q->all_next;
    else
        s->all = q->all_next;
    if (q->all_next)
        q->all_next->all_prev = q->all_prev;
    s->n_live--;
    sched_map_del(s, q->id);
    seq_destroy(q, s->alloc);
}

/* ---- resources and endings ---- */

void sched_release_resources(sched *s, seq *q)
{
    assert(q->inflight_steps == 0);
    blkmgr_free(s->bm, q->blocks, q->n_blocks);
    q->n_blocks = 0;
    if (q->state_slot >= 0)
        slots_release(s->sl, q->state_slot);
    q->state_slot = -1;
    q->draft_slot = 0;
    q->reserved = false;
    q->release_pending = false;
}

void sched_settle(sched *s, seq *q)
{
    if (q->inflight_steps > 0) {
        q->release_pending = true;
        return;
    }
    sched_release_resources(s, q);
    if (seq_is_finished(q) && q->status != SEQ_FINISHED_HANDOFF)
        sched_destroy_seq(s, q);
}

void sched_finish_seq(sched *s, seq *q, seq_status to)
{
    assert(to >= SEQ_FINISHED_STOPPED);
    bool active = q->reserved && !seq_is_finished(q);
    if (q->where == SEQ_IN_WAITING)
        sched_wq_remove(s, q);
    else if (q->where == SEQ_IN_RUNNING)
        sched_run_remove(s, q);
    q->where = SEQ_IN_NONE;
    if (active)
        s->n_active--;
    seq_set_status(q, to);
    s->stats.requests_finished++;
    if (to != SEQ_FINISHED_HANDOFF)
        sched_settle(s, q);
}

void sched_emit(sched *s, const seq *q, const int32_t *tokens, uint32_t n, sched_finish f)
{
    if (s->outs_delivered) {
        s->n_outs = 0;
        s->n_out_tokens = 0;
        s->outs_delivered = false;
    }
    assert(s->n_outs < s->cap_outs && s->n_out_tokens + n <= s->cap_out_tokens);
    int32_t *dst = s->out_tokens + s->n_out_tokens;
    if (n)
        memcpy(dst, tokens, (size_t)n * sizeof(int32_t));
    s->n_out_tokens += n;
    s->outs[s->n_outs++] = (sched_output){
        .request_id = q->id,
        .tokens = n ? dst : NULL,
        .n_tokens = n,
        .finish = f,
        .n_generated = seq_output_len(q),
    };
}

/* ---- create / destroy ---- */

static uint32_t sched_pow2_at_least(uint64_t n)
{
    uint32_t p = 16;
    while (p < n)
        p <<= 1;
    return p;
}

static di_status sched_alloc_arrays(sched *s, di_error *err)
{
    const di_alloc *a = s->alloc;
    uint32_t m = s->cfg.max_num_seqs;
    s->wq = di_alloc_zero(a, s->wq_cap, sizeof(seq *));
    s->run = di_alloc_zero(a, m, sizeof(seq *));
    s->map_keys = di_alloc_zero(a, (size_t)s->map_mask + 1, sizeof(uint64_t));
    s->map_vals = di_alloc_zero(a, (size_t)s->map_mask + 1, sizeof(seq *));
    s->order = di_alloc_zero(a, m, sizeof(seq *));
    s->need = di_alloc_zero(a, m, sizeof(uint32_t));
    s->chunk = di_alloc_zero(a, m, sizeof(uint32_t));
    s->outs = di_alloc_zero(a, s->cap_outs, sizeof(sched_output));
    s->pend = di_alloc_zero(a, s->cap_copies, sizeof(sched_copy));
    s->out_tokens = di_alloc_zero(a, s->cap_out_tokens, sizeof(int32_t));
    s->served = di_alloc_zero(a, m, sizeof(seq *));
    bool ok = s->wq && s->run && s->map_keys && s->map_vals && s->order && s->need &&
              s->chunk && s->outs && s->out_tokens && s->pend && s->served;
    if (s->cfg.varlen) {
        s->vl_reqs = di_alloc_zero(a, m, sizeof(varlen_request));
        s->vl_drafts = di_alloc_zero(a, m, sizeof(uint32_t));
        s->step_ms = di_alloc_zero(a, s->cfg.n_step_ms, sizeof(varlen_graph_time));
        ok = ok && s->vl_reqs && s->vl_drafts && s->step_ms;
    }
    for (int i = 0; i < 2; i++) {
        sched_step *st = &s->steps[i];
        st->entries = di_alloc_zero(a, m, sizeof(sched_seq_plan));
        st->seqs = di_alloc_zero(a, m, sizeof(seq *));
        st->gens = di_alloc_zero(a, m, sizeof(uint32_t));
        st->rows = di_alloc_zero(a, (size_t)m * s->rows, sizeof(int32_t));
        st->copies = di_alloc_zero(a, s->cap_copies, sizeof(sched_copy));
        ok = ok && st->entries && st->seqs && st->gens && st->rows && st->copies;
    }
    if (!ok)
        return di_fail(err, DI_ENOMEM, "out of memory for the scheduler's queues (%u sequences)",
                       s->max_live);
    return DI_OK;
}

di_status sched_create(const sched_config *cfg, sched **out, di_error *err)
{
    di_status st = sched_config_validate(cfg, err);
    if (st != DI_OK)
        return st;
    sched *s = di_alloc_zero(cfg->alloc, 1, sizeof(*s));
    if (!s)
        return di_fail(err, DI_ENOMEM, "out of memory for the scheduler");
    s->cfg = *cfg;
    s->alloc = cfg->alloc;
    s->type = &sched_type_rows[cfg->type];
    s->vote = cfg->vote ? *cfg->vote : vote_local();
    s->cfg.vote = NULL; /* the copy above is what is used */
    s->rows = 1 + cfg->nextn;
    s->table_cap = seq_blocks_for((uint64_t)cfg->max_model_len + 2ull * s->rows) + 1;
    uint32_t m = cfg->max_num_seqs;
    s->max_live = cfg->max_waiting + 4 * m + cfg->num_slots;
    s->wq_cap = s->max_live;
    s->map_mask = sched_pow2_at_least(2ull * s->max_live) - 1;
    s->cap_outs = 3 * m + 1;
    s->cap_out_tokens = m * s->rows + 1;
    s->cap_copies = 2 * m;
    st = sched_alloc_arrays(s, err);
    if (st == DI_OK)
        st = blkmgr_create(cfg->num_blocks, s->alloc, &s->bm, err);
    if (st == DI_OK)
        st = slots_create(cfg->num_slots, s->alloc, &s->sl, err);
    if (st == DI_OK) {
        di_status gs = graph_sizes_init(&s->graphs, m, cfg->nextn, cfg->graph_interval, err);
        st = gs;
    }
    if (st == DI_OK && cfg->varlen) {
        memcpy(s->step_ms, cfg->step_ms, (size_t)cfg->n_step_ms * sizeof(varlen_graph_time));
        s->cfg.step_ms = s->step_ms;
        st = varlen_planner_create(s->step_ms, cfg->n_step_ms, cfg->sampler_ms, m,
                                   m * cfg->nextn, s->alloc, &s->vl, err);
    }
    if (st != DI_OK) {
        sched_destroy(s);
        return st;
    }
    *out = s;
    return DI_OK;
}

void sched_destroy(sched *s)
{
    if (!s)
        return;
    const di_alloc *a = s->alloc;
    while (s->all) {
        seq *q = s->all;
        s->all = q->all_next;
        seq_destroy(q, a);
    }
    blkmgr_destroy(s->bm);
    slots_destroy(s->sl);
    if (s->graphs.sizes)
        graph_sizes_free(&s->graphs);
    for (int i = 0; i < 2; i++) {
        di_alloc_release(a, s->steps[i].entries);
        di_alloc_release(a, s->steps[i].seqs);
        di_alloc_release(a, s->steps[i].gens);
        di_alloc_release(a, s->steps[i].rows);
        di_alloc_release(a, s->steps[i].copies);
    }
    di_alloc_release(a, s->wq);
    di_alloc_release(a, s->run);
    di_alloc_release(a, s->map_keys);
    di_alloc_release(a, s->map_vals);
    di_alloc_release(a, s->order);
    di_alloc_release(a, s->need);
    di_alloc_release(a, s->chunk);
    di_alloc_release(a, s->pend);
    di_alloc_release(a, s->outs);
    di_alloc_release(a, s->out_tokens);
    di_alloc_release(a, s->served);
    di_alloc_release(a, s->vl_reqs);
    di_alloc_release(a, s->vl_drafts);
    di_alloc_release(a, s->step_ms);
    varlen_planner_free(s->vl);
    di_alloc_release(a, s);
}

/* ---- requests ---- */

static di_status sched_check_tokens(const sched *s, const int32_t *t, uint32_t n,
                                    const char *what, uint64_t id, di_error *err)
{
    for (uint32_t i = 0; i < n; i++)
        if (t[i] < 0 || (s->cfg.vocab_size && (uint32_t)t[i] >= s->cfg.vocab_size))
            return di_fail(err, DI_EINVAL, "request %llu: %s token %u is %d, outside [0, %u)",
                           (unsigned long long)id, what, i, t[i],
                           s->cfg.vocab_size ? s->cfg.vocab_size : (uint32_t)INT32_MAX);
    return DI_OK;
}

/* The KV a request brings (prefix hit or handoff) must be consistent with its engine type. */
static di_status sched_check_cached(const sched *s, const sched_request *r, uint32_t total,
                                    di_error *err)
{
    unsigned long long id = (unsigned long long)r->id;
    if (r->replay > r->kv_cached)
        return di_fail(err, DI_EINVAL, "request %llu: replay %u exceeds kv_cached %u", id,
                       r->replay, r->kv_cached);
    if (!s->type->prefill) {
        if (r->kv_cached != total - 1 || r->replay || !r->window_cached)
            return di_fail(err, DI_EINVAL, "request %llu: a %s engine has no prefill: it needs "
                           "the KV of all but the newest token (kv_cached %u, want %u) and its "
                           "window state", id, s->type->name, r->kv_cached, total - 1);
        return DI_OK;
    }
    if (r->kv_cached > total - 1)
        return di_fail(err, DI_EINVAL, "request %llu: kv_cached %u leaves nothing to prefill in "
                       "%u tokens", id, r->kv_cached, total);
    if (r->kv_cached && !r->replay && !r->window_cached)
        return di_fail(err, DI_EINVAL, "request %llu: a hit of %u positions without its window "
                       "state must replay the last block (prefix_hit_compute)", id, r->kv_cached);
    if (r->replay && r->window_cached)
        return di_fail(err, DI_EINVAL, "request %llu: a replay rebuilds the window; "
                       "window_cached must be false", id);
    uint32_t compute = total - (r->kv_cached - r->replay);
    if (!s->cfg.chunked_prefill && compute > s->cfg.max_num_batched_tokens)
        return di_fail(err, DI_EINVAL, "request %llu: %u prompt tokens exceed the %u-token step "
                       "budget and chunked prefill is off", id, compute,
                       s->cfg.max_num_batched_tokens);
    return DI_OK;
}

static di_status sched_check_request(const sched *s, const sched_request *r, di_error *err)
{
    if (!r)
        return di_fail(err, DI_EINVAL, "no request");
    unsigned long long id = (unsigned long long)r->id;
    if (r->id == SCHED_PLACEHOLDER_ID)
        return di_fail(err, DI_EINVAL, "request id %llu is reserved for placeholders", id);
    if (r->prompt_len == 0 || !r->prompt)
        return di_fail(err, DI_EINVAL, "request %llu: empty prompt", id);
    if (r->output_len && !r->output)
        return di_fail(err, DI_EINVAL, "request %llu: output_len %u without output tokens", id,
                       r->output_len);
    if ((r->n_stop_ids && !r->stop_ids) || r->n_stop_ids > SEQ_MAX_STOP_IDS)
        return di_fail(err, DI_EINVAL, "request %llu: n_stop_ids %u without stop ids or above "
                       "%u", id, r->n_stop_ids, SEQ_MAX_STOP_IDS);
    uint64_t total = (uint64_t)r->prompt_len + r->output_len;
    if (total >= s->cfg.max_model_len)
        return di_fail(err, DI_EINVAL, "request %llu: %llu tokens leave no room under "
                       "max_model_len %u", id, (unsigned long long)total, s->cfg.max_model_len);
    uint32_t need = seq_blocks_for(total - 1 + s->rows);
    if (need > blkmgr_usable(s->bm))
        return di_fail(err, DI_EINVAL, "request %llu: %llu tokens need %u blocks, the cache has "
                       "%u", id, (unsigned long long)total, need, blkmgr_usable(s->bm));
    di_status st = sched_check_tokens(s, r->prompt, r->prompt_len, "prompt", r->id, err);
    if (st == DI_OK)
        st = sched_check_tokens(s, r->output, r->output_len, "output", r->id, err);
    if (st == DI_OK)
        st = sched_check_tokens(s, r->stop_ids, r->n_stop_ids, "stop", r->id, err);
    if (st == DI_OK && (r->n_drafts > s->cfg.nextn || (r->n_drafts && !r->drafts)))
        st = di_fail(err, DI_EINVAL, "request %llu: %u drafts, nextn is %u", id, r->n_drafts,
                     s->cfg.nextn);
    if (st == DI_OK)
        st = sched_check_tokens(s, r->drafts, r->n_drafts, "draft", r->id, err);
    if (st == DI_OK)
        st = sched_check_cached(s, r, (uint32_t)total, err);
    return st;
}

static di_status sched_check_room(const sched *s, uint64_t id, di_error *err)
{
    if (sched_map_get(s, id))
        return di_fail(err, DI_EEXIST, "request %llu is already live", (unsigned long long)id);
    if (s->wq_len >= s->cfg.max_waiting)
        return di_fail(err, DI_EFULL, "waiting queue full (%u requests); retry later",
                       s->cfg.max_waiting);
    if (s->n_live >= s->max_live || s->wq_len >= s->wq_cap)
        return di_fail(err, DI_EFULL, "%u live requests, the most this scheduler holds",
                       s->n_live);
    return DI_OK;
}

static seq_params sched_seq_params(const sched *s, const sched_request *r,
                                   const int32_t *prompt, uint32_t prompt_len)
{
    uint64_t cap = (uint64_t)prompt_len + r->max_tokens;
    if (cap > s->cfg.max_model_len)
        cap = s->cfg.max_model_len;
    return (seq_params){
        .id = r->id,
        .prompt = prompt,
        .prompt_len = prompt_len,
        .output = r->output,
        .output_len = r->output_len,
        .max_tokens = r->max_tokens,
        .stop_ids = r->stop_ids,
        .n_stop_ids = r->n_stop_ids,
        .eos = s->cfg.eos_token,
        .ignore_eos = r->ignore_eos,
        .has_grammar = r->has_grammar,
        .arrival_ns = r->arrival_ns,
        .token_capacity = (uint32_t)cap,
        .block_capacity = s->table_cap,
    };
}

di_status sched_add_request(sched *s, const sched_request *req, di_error *err)
{
    di_status st = sched_check_request(s, req, err);
    if (st == DI_OK)
        st = sched_check_room(s, req->id, err);
    if (st != DI_OK)
        return st;
    seq_params p = sched_seq_params(s, req, req->prompt, req->prompt_len);
    seq *q;
    st = seq_create(&p, s->alloc, &q, err);
    if (st != DI_OK)
        return st;
    q->num_tokens = req->kv_cached - req->replay;
    q->n_load = req->kv_cached;
    q->load_window = req->kv_cached && req->window_cached;
    q->window_start = req->replay ? q->num_tokens : 0;
    q->schedulable = !req->hold;
    if (req->n_drafts)
        seq_set_drafts(q, req->drafts, req->n_drafts);
    sched_all_add(s, q);
    sched_wq_push_back(s, q);
    s->stats.requests_added++;
    return DI_OK;
}

/* The live sequence with this id, or NULL with DI_ENOENT recorded in err. */
static seq *sched_lookup(const sched *s, uint64_t id, di_error *err)
{
    seq *q = sched_map_get(s, id);
    if (!q)
        di_fail(err, DI_ENOENT, "no live request %llu", (unsigned long long)id);
    return q;
}

di_status sched_abort(sched *s, uint64_t id, sched_output *out, di_error *err)
{
    seq *q = sched_lookup(s, id, err);
    if (!q)
        return DI_ENOENT;
    sched_output o = {.request_id = id, .n_generated = seq_output_len(q)};
    if (q->status == SEQ_FINISHED_HANDOFF) {
        sched_release_resources(s, q);
        sched_destroy_seq(s, q);
    } else if (!seq_is_finished(q)) {
        o.finish = SCHED_FINISH_ABORT;
        sched_finish_seq(s, q, SEQ_FINISHED_ABORTED);
    }
    /* else: finished, waiting only for its steps in flight; its final output went out */
    if (out)
        *out = o;
    return DI_OK;
}

di_status sched_release(sched *s, uint64_t id, di_error *err)
{
    seq *q = sched_lookup(s, id, err);
    if (!q)
        return DI_ENOENT;
    if (q->status != SEQ_FINISHED_HANDOFF)
        return di_fail(err, DI_ESTATE, "request %llu is %s, not a held handoff",
                       (unsigned long long)id, seq_status_name(q->status));
    sched_release_resources(s, q);
    sched_destroy_seq(s, q);
    return DI_OK;
}

di_status sched_set_schedulable(sched *s, uint64_t id, di_error *err)
{
    seq *q = sched_lookup(s, id, err);
    if (!q)
        return DI_ENOENT;
    if (q->status != SEQ_WAITING)
        return di_fail(err, DI_ESTATE, "request %llu is %s, not waiting", (unsigned long long)id,
                       seq_status_name(q->status));
    q->schedulable = true;
    return DI_OK;
}

/* Blocks and slot a fork needs now; DI_EFULL naming the missing one. */
static di_status sched_fork_room(const sched *s, uint32_t kv, uint32_t len, di_error *err)
{
    uint32_t fresh = (kv % SEQ_BLOCK_TOKENS ? 1 : 0) + seq_blocks_for(len) - seq_blocks_for(kv);
    if (s->n_active >= s->cfg.max_num_seqs)
        return di_fail(err, DI_EFULL, "fork: max_num_seqs %u sequences hold a slot",
                       s->cfg.max_num_seqs);
    if (slots_free_count(s->sl) == 0)
        return di_fail(err, DI_EFULL, "fork: no free state slot");
    if (blkmgr_free_count(s->bm) < fresh)
        return di_fail(err, DI_EFULL, "fork: %u blocks needed, %u free", fresh,
                       blkmgr_free_count(s->bm));
    if (s->n_pend + 2 > s->cap_copies)
        return di_fail(err, DI_EFULL, "fork: %u copies already wait for the next step",
                       s->n_pend);
    return DI_OK;
}

/* Gives the child its table (shared full blocks, a fresh copy of the partial one, a fresh
 * block for its newest position when needed) and slot, and queues the copies. */
static void sched_fork_take(sched *s, const seq *par, seq *q)
{
    uint32_t kv = par->len - 1;
    blkmgr_copy cp;
    di_status rc = blkmgr_fork(s->bm, par->blocks, kv, q->blocks, &cp, NULL);
    assert(rc == DI_OK);
    q->n_blocks = seq_blocks_for(kv);
    uint32_t want = seq_blocks_for(q->len);
    rc = blkmgr_alloc(s->bm, want - q->n_blocks, q->blocks + q->n_blocks, NULL);
    assert(rc == DI_OK);
    q->n_blocks = want;
    rc = slots_acquire(s->sl, q->id, &q->state_slot, NULL);
    assert(rc == DI_OK);
    (void)rc;
    q->draft_slot = (uint32_t)q->state_slot + 1;
    q->reserved = true;
    q->num_tokens = kv;
    q->window_start = par->window_start;
    s->n_active++;
    if (cp.dst) {
        blkmgr_share(s->bm, &cp.src, 1); /* held until the copy has run */
        s->pend[s->n_pend++] = (sched_copy){SCHED_COPY_BLOCK, cp.src, cp.dst};
    }
    s->pend[s->n_pend++] =
        (sched_copy){SCHED_COPY_SLOT, (uint32_t)par->state_slot, (uint32_t)q->state_slot};
}

di_status sched_fork(sched *s, uint64_t parent_id, const sched_request *child, di_error *err)
{
    seq *par = sched_lookup(s, parent_id, err);
    if (!par)
        return DI_ENOENT;
    if (par->where != SEQ_IN_RUNNING)
        return di_fail(err, DI_ESTATE, "request %llu is %s: only a decoding request can be "
                       "forked", (unsigned long long)parent_id, seq_status_name(par->status));
    if (!child)
        return di_fail(err, DI_EINVAL, "no child request");
    sched_request c = *child; /* the child's prompt is the parent's tokens so far */
    c.prompt = par->tokens;
    c.prompt_len = par->len;
    c.output = NULL;
    c.output_len = 0;
    c.kv_cached = par->len - 1; /* from the parent's blocks, not the store */
    c.replay = 0;
    c.window_cached = true;
    c.hold = false;
    di_status st = sched_check_request(s, &c, err);
    if (st == DI_OK)
        st = sched_check_room(s, c.id, err);
    if (st == DI_OK)
        st = sched_fork_room(s, par->len - 1, par->len, err);
    if (st != DI_OK)
        return st;
    seq_params p = sched_seq_params(s, &c, par->tokens, par->len);
    seq *q;
    st = seq_create(&p, s->alloc, &q, err);
    if (st != DI_OK)
        return st;
    sched_fork_take(s, par, q);
    sched_all_add(s, q);
    sched_wq_push_after_reserved(s, q); /* it holds its blocks: never behind a stalled head */
    s->stats.requests_added++;
    return DI_OK;
}

/* ---- queries ---- */

bool sched_has_work(const sched *s)
{
    return s->wq_len > 0 || s->n_run > 0;
}

di_status sched_group_has_work(sched *s, bool *out, di_error *err)
{
    bool any;
    di_status st = s->vote.any_work(s->vote.userdata, sched_has_work(s), &any, err);
    if (st != DI_OK)
        return st;
    *out = any;
    return DI_OK;
}

const sched_stats *sched_get_stats(const sched *s) { return &s->stats; }
const sched_config *sched_get_config(const sched *s) { return &s->cfg; }
uint32_t sched_free_blocks(const sched *s) { return blkmgr_free_count(s->bm); }
uint32_t sched_usable_blocks(const sched *s) { return blkmgr_usable(s->bm); }
uint32_t sched_free_slots(const sched *s) { return slots_free_count(s->sl); }
uint32_t sched_num_waiting(const sched *s) { return s->wq_len; }
uint32_t sched_num_running(const sched *s) { return s->n_run; }
uint32_t sched_num_live(const sched *s) { return s->n_live; }
uint32_t sched_num_in_flight(const sched *s) { return s->n_in_flight; }
uint32_t sched_decode_step(const sched *s) { return s->decode_step; }
const seq *sched_find(const sched *s, uint64_t id) { return sched_map_get(s, id); }

double sched_cache_usage(const sched *s)
{
    return (double)blkmgr_used(s->bm) / (double)blkmgr_usable(s->bm);
}

/* ---- the invariant check ---- */

/* In-flight entries of q in the unprocessed plans: count and rows. O(entries). */
static void sched_inflight_of(const sched *s, const seq *q, uint32_t *steps, uint32_t *rows)
{
    *steps = 0;
    *rows = 0;
    for (uint32_t k = 0; k < s->n_in_flight; k++) {
        const sched_step *st = &s->steps[(s->step_first + k) % 2];
        for (uint32_t i = 0; i < st->plan.n_seqs; i++)
            if (st->seqs[i] == q) {
                (*steps)++;
                *rows += st->entries[i].seqlen_q;
            }
    }
}

static di_status sched_check_seq(sched *s, const seq *q, uint32_t *n_where, uint32_t *active,
                                 di_error *err)
{
    di_status st = seq_check(q, err);
    if (st != DI_OK)
        return st;
    if (sched_map_get(s, q->id) != q)
        return di_fail(err, DI_EINTERNAL, "request %llu is not in the id map",
                       (unsigned long long)q->id);
    uint32_t steps, rows;
    sched_inflight_of(s, q, &steps, &rows);
    if (steps != q->inflight_steps || rows != q->inflight_rows)
        return di_fail(err, DI_EINTERNAL, "request %llu: %u steps / %u rows in flight, plans "
                       "hold %u / %u", (unsigned long long)q->id, q->inflight_steps,
                       q->inflight_rows, steps, rows);
    if (q->release_pending && q->inflight_steps == 0)
        return di_fail(err, DI_EINTERNAL, "request %llu: release pending with nothing in "
                       "flight", (unsigned long long)q->id);
    if (q->where == SEQ_IN_RUNNING && (q->run_idx >= s->n_run || s->run[q->run_idx] != q))
        return di_fail(err, DI_EINTERNAL, "request %llu: not at running[%u]",
                       (unsigned long long)q->id, q->run_idx);
    n_where[q->where]++;
    if (q->reserved && !seq_is_finished(q))
        (*active)++;
    blkmgr_check_owner(s->bm, q->blocks, q->n_blocks);
    if (q->state_slot >= 0)
        slots_check_claim(s->sl, q->state_slot, q->id);
    return DI_OK;
}

static di_status sched_check_queues(const sched *s, const uint32_t *n_where, uint32_t active,
                                    uint32_t live, di_error *err)
{
    if (live != s->n_live)
        return di_fail(err, DI_EINTERNAL, "%u sequences listed, %u counted live", live,
                       s->n_live);
    if (n_where[SEQ_IN_WAITING] != s->wq_len || n_where[SEQ_IN_RUNNING] != s->n_run)
        return di_fail(err, DI_EINTERNAL, "%u waiting / %u running sequences, queues hold %u / "
                       "%u", n_where[SEQ_IN_WAITING], n_where[SEQ_IN_RUNNING], s->wq_len,
                       s->n_run);
    for (uint32_t i = 0; i < s->wq_len; i++) {
        const seq *q = sched_wq_at(s, i);
        if (q->where != SEQ_IN_WAITING)
            return di_fail(err, DI_EINTERNAL, "waiting[%u] is not marked waiting", i);
        if (i > 0 && q->reserved && !sched_wq_at(s, i - 1)->reserved)
            return di_fail(err, DI_EINTERNAL, "waiting[%u] (request %llu) holds a reservation "
                           "behind one that does not", i, (unsigned long long)q->id);
    }
    if (active != s->n_active || active > s->cfg.max_num_seqs)
        return di_fail(err, DI_EINTERNAL, "%u sequences hold a slot (counter %u, max_num_seqs "
                       "%u)", active, s->n_active, s->cfg.max_num_seqs);
    if (s->n_in_flight > (s->cfg.async ? 2u : 1u))
        return di_fail(err, DI_EINTERNAL, "%u plans in flight", s->n_in_flight);
    uint32_t cells = 0;
    for (uint32_t i = 0; i <= s->map_mask; i++)
        cells += s->map_vals[i] != NULL;
    if (cells != s->n_live)
        return di_fail(err, DI_EINTERNAL, "id map holds %u, %u live", cells, s->n_live);
    return DI_OK;
}

/* The holds fork copies keep on their source blocks: pending, and in the plans in flight. */
static void sched_check_copy_holds(sched *s)
{
    for (uint32_t i = 0; i < s->n_pend; i++)
        if (s->pend[i].kind == SCHED_COPY_BLOCK)
            blkmgr_check_owner(s->bm, &s->pend[i].src, 1);
    for (uint32_t k = 0; k < s->n_in_flight; k++) {
        const sched_step *st = &s->steps[(s->step_first + k) % 2];
        for (uint32_t i = 0; i < st->plan.n_copies; i++)
            if (st->copies[i].kind == SCHED_COPY_BLOCK)
                blkmgr_check_owner(s->bm, &st->copies[i].src, 1);
    }
}

di_status sched_check(sched *s, di_error *err)
{
    uint32_t n_where[4] = {0}, active = 0, live = 0;
    blkmgr_check_begin(s->bm);
    slots_check_begin(s->sl);
    sched_check_copy_holds(s);
    for (const seq *q = s->all; q; q = q->all_next, live++) {
        di_status st = sched_check_seq(s, q, n_where, &active, err);
        if (st != DI_OK)
            return st;
    }
    di_status st = sched_check_queues(s, n_where, active, live, err);
    if (st == DI_OK)
        st = blkmgr_check_end(s->bm, err);
    if (st == DI_OK)
        st = slots_check_end(s->sl, err);
    return st;
}
