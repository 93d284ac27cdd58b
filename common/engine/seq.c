#include "common/engine/seq.h"

#include <assert.h>

/* Allowed transitions, one row per source state. The function performing each is named in
 * the diagram in seq.h. */
static const bool seq_transitions[SEQ_STATUS_COUNT][SEQ_STATUS_COUNT] = {
    [SEQ_WAITING] = {
        [SEQ_RUNNING] = true,
        [SEQ_FINISHED_ABORTED] = true,
        [SEQ_FINISHED_FAILED] = true,
    },
    [SEQ_RUNNING] = {
        [SEQ_WAITING] = true, /* recompute preemption */
        [SEQ_FINISHED_STOPPED] = true,
        [SEQ_FINISHED_LENGTH_CAPPED] = true,
        [SEQ_FINISHED_ABORTED] = true,
        [SEQ_FINISHED_PREEMPTED] = true,
        [SEQ_FINISHED_GRAMMAR_FAILED] = true,
        [SEQ_FINISHED_FAILED] = true,
        [SEQ_FINISHED_HANDOFF] = true,
    },
    /* every FINISHED_* row is empty: final states */
};

static const char *const seq_status_names[SEQ_STATUS_COUNT] = {
    [SEQ_WAITING] = "WAITING",
    [SEQ_RUNNING] = "RUNNING",
    [SEQ_FINISHED_STOPPED] = "FINISHED_STOPPED",
    [SEQ_FINISHED_LENGTH_CAPPED] = "FINISHED_LENGTH_CAPPED",
    [SEQ_FINISHED_ABORTED] = "FINISHED_ABORTED",
    [SEQ_FINISHED_PREEMPTED] = "FINISHED_PREEMPTED",
    [SEQ_FINISHED_GRAMMAR_FAILED] = "FINISHED_GRAMMAR_FAILED",
    [SEQ_FINISHED_FAILED] = "FINISHED_FAILED",
    [SEQ_FINISHED_HANDOFF] = "FINISHED_HANDOFF",
};

const char *seq_status_name(seq_status st)
{
    return (unsigned)st < SEQ_STATUS_COUNT ? seq_status_names[st] : "UNKNOWN";
}

bool seq_transition_allowed(seq_status from, seq_status to)
{
    if ((unsigned)from >= SEQ_STATUS_COUNT || (unsigned)to >= SEQ_STATUS_COUNT)
        return false;
    return seq_transitions[from][to];
}

void seq_set_status(seq *s, seq_status to)
{
    assert(seq_transition_allowed(s->status, to));
    s->status = to;
}

static di_status seq_params_validate(const seq_params *p, di_error *err)
{
    if (p->prompt_len == 0 || !p->prompt)
        return di_fail(err, DI_EINVAL, "request %llu: empty prompt", (unsigned long long)p->id);
    if (p->output_len && !p->output)
        return di_fail(err, DI_EINVAL, "request %llu: output_len %u without output tokens",
                       (unsigned long long)p->id, p->output_len);
    if (p->max_tokens == 0)
        return di_fail(err, DI_EINVAL, "request %llu: max_tokens must be at least 1",
                       (unsigned long long)p->id);
    if (p->output_len >= p->max_tokens)
        return di_fail(err, DI_EINVAL, "request %llu: %u tokens already generated, max_tokens %u",
                       (unsigned long long)p->id, p->output_len, p->max_tokens);
    if (p->n_stop_ids > SEQ_MAX_STOP_IDS)
        return di_fail(err, DI_EINVAL, "request %llu: %u stop ids, at most %u",
                       (unsigned long long)p->id, p->n_stop_ids, SEQ_MAX_STOP_IDS);
    if (p->n_stop_ids && !p->stop_ids)
        return di_fail(err, DI_EINVAL, "request %llu: n_stop_ids %u without stop ids",
                       (unsigned long long)p->id, p->n_stop_ids);
    uint64_t known = (uint64_t)p->prompt_len + p->output_len;
    if (p->token_capacity < known || p->token_capacity > (1u << 30))
        return di_fail(err, DI_EINVAL, "request %llu: token capacity %u outside [%llu, 2^30]",
                       (unsigned long long)p->id, p->token_capacity, (unsigned long long)known);
    if (p->block_capacity == 0 || p->block_capacity > (1u << 24))
        return di_fail(err, DI_EINVAL, "request %llu: block capacity %u outside [1, 2^24]",
                       (unsigned long long)p->id, p->block_capacity);
    return DI_OK;
}

di_status seq_create(const seq_params *p, const di_alloc *a, seq **out, di_error *err)
{
    di_status st = seq_params_validate(p, err);
    if (st != DI_OK)
        return st;
    /* struct, then tokens, block table and stop ids, each aligned for its type */
    size_t off_tokens = sizeof(seq);
    size_t off_blocks = off_tokens + (size_t)p->token_capacity * sizeof(int32_t);
    size_t off_stops = off_blocks + (size_t)p->block_capacity * sizeof(uint32_t);
    size_t total = off_stops + (size_t)p->n_stop_ids * sizeof(int32_t);
    unsigned char *mem = di_alloc_mem(a, total);
    if (!mem)
        return di_fail(err, DI_ENOMEM, "request %llu: out of memory for a %u-token sequence",
                       (unsigned long long)p->id, p->token_capacity);
    seq *s = (seq *)mem;
    *s = (seq){
        .id = p->id,
        .status = SEQ_WAITING,
        .where = SEQ_IN_NONE,
        .tokens = (int32_t *)(mem + off_tokens),
        .prompt_len = p->prompt_len,
        .len = p->prompt_len + p->output_len,
        .cap_tokens = p->token_capacity,
        .max_tokens = p->max_tokens,
        .blocks = (uint32_t *)(mem + off_blocks),
        .cap_blocks = p->block_capacity,
        .state_slot = -1,
        .stop_ids = (int32_t *)(mem + off_stops),
        .n_stop_ids = p->n_stop_ids,
        .eos = p->eos,
        .ignore_eos = p->ignore_eos,
        .has_grammar = p->has_grammar,
        .schedulable = true,
        .arrival_ns = p->arrival_ns,
    };
    memcpy(s->tokens, p->prompt, (size_t)p->prompt_len * sizeof(int32_t));
    if (p->output_len)
        memcpy(s->tokens + p->prompt_len, p->output, (size_t)p->output_len * sizeof(int32_t));
    if (p->n_stop_ids)
        memcpy(s->stop_ids, p->stop_ids, (size_t)p->n_stop_ids * sizeof(int32_t));
    *out = s;
    return DI_OK;
}

void seq_destroy(seq *s, const di_alloc *a)
{
    di_alloc_release(a, s);
}

void seq_advance_optimistically(seq *s, uint32_t rows)
{
    s->prev_num_tokens = s->num_tokens;
    s->num_tokens += rows;
}

void seq_commit_processed_tokens(seq *s, uint32_t rows, uint32_t valid)
{
    assert(valid <= rows && rows <= s->num_tokens);
    s->num_tokens -= rows - valid;
}

static bool seq_is_stop_token(const seq *s, int32_t token)
{
    if (token == s->eos && s->eos >= 0 && !s->ignore_eos)
        return true;
    for (uint32_t i = 0; i < s->n_stop_ids; i++)
        if (s->stop_ids[i] == token)
            return true;
    return false;
}

seq_stop seq_append_token(seq *s, int32_t token, uint32_t max_model_len)
{
    assert(!seq_is_finished(s) && s->len < s->cap_tokens);
    s->tokens[s->len++] = token;
    if (seq_is_stop_token(s, token))
        return SEQ_FINISHED_STOPPED;
    if (seq_output_len(s) >= s->max_tokens || s->len >= max_model_len)
        return SEQ_FINISHED_LENGTH_CAPPED;
    return SEQ_RUNNING;
}

void seq_set_drafts(seq *s, const int32_t *drafts, uint32_t n)
{
    assert(n <= SEQ_MAX_NEXTN);
    if (n)
        memcpy(s->drafts, drafts, (size_t)n * sizeof(int32_t));
    s->n_drafts = n;
    s->n_conf = 0;
}

void seq_set_draft_conf(seq *s, const float *conf, uint32_t n)
{
    assert(n == 0 || n == s->n_drafts);
    for (uint32_t i = 0; i < n; i++)
        s->draft_conf[i] = conf[i];
    s->n_conf = n;
}

/* The rules of seq_check, one predicate per row so a failure names its rule. */
static di_status seq_check_lengths(const seq *s, di_error *err)
{
    if (s->prompt_len == 0 || s->len < s->prompt_len || s->len > s->cap_tokens)
        return di_fail(err, DI_EINTERNAL, "lengths: prompt %u, len %u, capacity %u",
                       s->prompt_len, s->len, s->cap_tokens);
    if (seq_output_len(s) > s->max_tokens)
        return di_fail(err, DI_EINTERNAL, "%u outputs exceed max_tokens %u", seq_output_len(s),
                       s->max_tokens);
    if (s->n_blocks > s->cap_blocks || s->n_drafts > SEQ_MAX_NEXTN)
        return di_fail(err, DI_EINTERNAL, "block table %u of %u, %u drafts", s->n_blocks,
                       s->cap_blocks, s->n_drafts);
    if (s->n_conf && s->n_conf != s->n_drafts)
        return di_fail(err, DI_EINTERNAL, "%u confidences for %u drafts", s->n_conf,
                       s->n_drafts);
    /* a prefix hit's KV is still in the store until its first chunk is scheduled */
    bool kv_in_store = s->n_load && !s->reserved;
    if (!kv_in_store && (uint64_t)s->n_blocks * SEQ_BLOCK_TOKENS < s->num_tokens)
        return di_fail(err, DI_EINTERNAL, "%u blocks do not cover num_tokens %u", s->n_blocks,
                       s->num_tokens);
    if (s->inflight_steps == 0 ? s->inflight_rows != 0 : s->inflight_rows < s->inflight_steps)
        return di_fail(err, DI_EINTERNAL, "%u steps but %u rows in flight", s->inflight_steps,
                       s->inflight_rows);
    return DI_OK;
}

static di_status seq_check_slot(const seq *s, di_error *err)
{
    uint32_t want_draft = s->state_slot >= 0 ? (uint32_t)s->state_slot + 1 : 0;
    if (s->draft_slot != want_draft)
        return di_fail(err, DI_EINTERNAL, "draft slot %u with state slot %d", s->draft_slot,
                       s->state_slot);
    bool holds = s->state_slot >= 0;
    if (s->status == SEQ_RUNNING && (!holds || !s->reserved))
        return di_fail(err, DI_EINTERNAL, "running without a slot or reservation");
    if (s->status == SEQ_WAITING && !s->release_pending && holds != s->reserved)
        return di_fail(err, DI_EINTERNAL, "waiting: slot %d but reserved %d", s->state_slot,
                       (int)s->reserved);
    if (s->reserved && s->status == SEQ_WAITING &&
        (uint64_t)s->n_blocks * SEQ_BLOCK_TOKENS < s->len)
        return di_fail(err, DI_EINTERNAL, "reserved %u blocks for %u tokens", s->n_blocks,
                       s->len);
    if (seq_is_finished(s) && s->status != SEQ_FINISHED_HANDOFF && !s->release_pending &&
        (holds || s->n_blocks))
        return di_fail(err, DI_EINTERNAL, "finished, nothing in flight, still holds %u blocks "
                       "and slot %d", s->n_blocks, s->state_slot);
    return DI_OK;
}

static di_status seq_check_place(const seq *s, di_error *err)
{
    bool ok;
    switch (s->status) {
    case SEQ_WAITING:
        ok = s->where == SEQ_IN_WAITING || s->where == SEQ_IN_PREFILL;
        break;
    case SEQ_RUNNING:
        ok = s->where == SEQ_IN_RUNNING || s->where == SEQ_IN_PREFILL;
        break;
    default:
        ok = s->where == SEQ_IN_NONE;
    }
    if (!ok)
        return di_fail(err, DI_EINTERNAL, "status %s in queue %d", seq_status_name(s->status),
                       (int)s->where);
    if (s->where == SEQ_IN_RUNNING && s->num_tokens != s->len - 1 + s->inflight_rows)
        return di_fail(err, DI_EINTERNAL, "decoding with num_tokens %u, len %u, %u rows in "
                       "flight (want len - 1 + rows)", s->num_tokens, s->len, s->inflight_rows);
    if (s->where == SEQ_IN_WAITING && s->num_tokens >= s->len)
        return di_fail(err, DI_EINTERNAL, "waiting with nothing left to prefill (%u of %u)",
                       s->num_tokens, s->len);
    return DI_OK;
}

di_status seq_check(const seq *s, di_error *err)
{
    di_status st = seq_check_lengths(s, err);
    if (st == DI_OK)
        st = seq_check_slot(s, err);
    if (st == DI_OK)
        st = seq_check_place(s, err);
    if (st != DI_OK)
        di_error_prefix(err, "request %llu (%s): ", (unsigned long long)s->id,
                        seq_status_name(s->status));
    return st;
}
