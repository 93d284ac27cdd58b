/* fwd_scenario.h: one fixed forward scenario, run the same way on any backend, whose outputs
 * (logits of every requested row, draft logits and confidences, the KV blocks and state slots)
 * are brought back to the host for comparison; and a backend wrapper that counts and refuses
 * allocations. Shared by tests/forward/test_device.c (a host backend that places like a device
 * one, bit for bit) and tests/gpu/check_forward.c (the CUDA backend, within tolerance). No
 * Criterion here: failures come back as a di_status with the message.
 *
 * The scenario: two sequences with random prompts of 300 and 77 tokens; sequence 0's prompt in
 * chunks of at most 128 rows (one sequence per step), sequence 1's in one chunk; three decode
 * steps of one row for both; a draft proposal (fwd_draft, nextn drafts) for both; a
 * speculative step of 1 + nextn rows for both; one more decode row. Every token is fixed in
 * advance (the "drafts" of the speculative step and the draft sampler's picks included), so
 * two backends see the same inputs whatever their logits: the comparison measures the
 * numbers, never a different path. With YOCO on, the prompt rows ask only for the logits of
 * the rows in the keep window (compact mode cannot give the others).
 *
 * The executor scenario (scn_exec_*): runner_exec with two requests of one 150-token prompt;
 * request 1's prompt in two chunks, then request 2 forked from it by the plan's copies (its
 * second block and the slot) and one decode step of both, with request 1's drafts as rows.
 */
#ifndef DI_TESTS_FORWARD_FWD_SCENARIO_H
#define DI_TESTS_FORWARD_FWD_SCENARIO_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/forward.h"
#include "common/model/runner_exec.h"
#include "common/util/philox.h"

/* ---- a backend that counts (and can refuse) allocations ---- */

/* What the wrapper keeps. One wrapper at a time per program (the table's alloc has no room
 * for a second context: the wrapped ops keep the inner backend's ctx). */
typedef struct trk_state {
    kern_backend inner;         /* the wrapped backend (its alloc and free are called) */
    int64_t live;               /* allocations not yet freed */
    uint64_t n_allocs;          /* allocations asked for so far (refused ones included) */
    int64_t fail_at;            /* refuse allocation number fail_at (0-based); -1: never */
    uint64_t refused;           /* allocations refused */
} trk_state;

static trk_state *trk_current;

static void *trk_alloc(void *ctx, size_t bytes)
{
    trk_state *s = trk_current;
    if ((int64_t)s->n_allocs++ == s->fail_at) {
        s->refused++;
        return NULL;
    }
    void *p = s->inner.ops.alloc(ctx, bytes);
    if (p)
        s->live++;
    return p;
}

static void trk_free(void *ctx, void *p)
{
    trk_state *s = trk_current;
    if (p)
        s->live--;
    s->inner.ops.free(ctx, p);
}

/* *out = inner with counted alloc/free and the given device_memory flag. */
static inline void trk_wrap(trk_state *s, const kern_backend *inner, int device_memory,
                            kern_backend *out)
{
    memset(s, 0, sizeof(*s));
    s->inner = *inner;
    s->fail_at = -1;
    trk_current = s;
    *out = *inner;
    out->ops.alloc = trk_alloc;
    out->ops.free = trk_free;
    out->device_memory = device_memory;
}

/* ---- the scenario ---- */

#define SCN_SEQS 2
#define SCN_CHUNK 128
#define SCN_DECODE 3            /* single-row decode steps, each followed by a proposal */
#define SCN_PROPOSALS SCN_DECODE
#define SCN_MAX_TOKENS 512

typedef struct scn_params {
    const char *config;         /* shipped config name (for messages) */
    uint32_t nextn;             /* drafts per step; <= 5 */
    fwd_yoco yoco;
    uint32_t keep_tokens;       /* YOCO keep window */
    uint64_t seed;              /* the tokens */
} scn_params;

/* What a run brings back (host memory, owned). */
typedef struct scn_out {
    uint32_t vocab;
    uint32_t n_rows;            /* logits rows recorded */
    float *logits;              /* [n_rows, vocab] in the order requested */
    int64_t *row_pos;           /* [n_rows] position of each */
    int32_t *row_seq;           /* [n_rows] sequence of each */
    uint32_t n_drafts;          /* SCN_PROPOSALS * SCN_SEQS * nextn (0 without draft stages) */
    float *draft_logits;        /* [n_drafts, vocab] Markov-corrected draft logits */
    float *draft_conf;          /* [n_drafts] confidences */
    uint8_t *blocks;            /* [kv n_blocks * block_bytes] */
    size_t blocks_bytes;
    uint8_t *slots;             /* [kv n_slots * slot_bytes] */
    size_t slots_bytes;
} scn_out;

static inline void scn_out_free(scn_out *o)
{
    free(o->logits);
    free(o->row_pos);
    free(o->row_seq);
    free(o->draft_logits);
    free(o->draft_conf);
    free(o->blocks);
    free(o->slots);
    memset(o, 0, sizeof(*o));
}

/* Rows the scenario asks logits for, at most (sizes scn_out). */
static inline uint32_t scn_max_rows(uint32_t nextn)
{
    return 300 + 77 + SCN_SEQS * (SCN_DECODE + 1 + nextn + 1);
}

/* Blocks and slots a scenario KV needs. */
#define SCN_BLOCKS 12
#define SCN_SLOTS SCN_SEQS

typedef struct scn_seq {
    int32_t toks[SCN_MAX_TOKENS];
    uint32_t blocks[5];
    uint32_t slot;
    int64_t len;                /* positions done */
    int64_t prompt_len;
} scn_seq;

typedef struct scn_ctx {
    fwd_run *run;
    fwd_kv *kv;
    const model_config *c;
    const scn_params *p;
    scn_seq seq[SCN_SEQS];
    scn_out *out;
    float *tmp;                 /* [SCN_CHUNK * SCN_SEQS, vocab] */
    di_error *err;
    uint32_t pad_to;            /* steps of fewer rows are padded to this many with placeholder
                                   rows (fwd_seq.placeholder); 0 = none */
} scn_ctx;

static inline fwd_seq scn_rows(const scn_ctx *x, const scn_seq *s, uint32_t n)
{
    uint32_t lb = x->c->n_engram_layers ? x->c->engram_max_ngram_size - 1 : 0;
    uint32_t h = s->len < (int64_t)lb ? (uint32_t)s->len : lb;
    int prompt = s->len < s->prompt_len;
    fwd_seq q = {.n_rows = n, .pos0 = s->len, .tokens = s->toks + s->len,
                 .history = s->toks + s->len - h, .n_history = h, .blocks = s->blocks,
                 .n_blocks = 5, .slot = s->slot, .prompt_len = prompt ? s->prompt_len : 0};
    return q;
}

/* One step over the given sequences, n rows each; logits of every row (of the keep window for
 * prompt rows under YOCO) appended to the output. */
static inline di_status scn_step(scn_ctx *x, const uint32_t *which, uint32_t n_seqs,
                                 const uint32_t *n)
{
    fwd_seq q[SCN_SEQS + 1];
    int32_t lrows[SCN_CHUNK * SCN_SEQS];
    int64_t lpos[SCN_CHUNK * SCN_SEQS];
    int32_t lseq[SCN_CHUNK * SCN_SEQS];
    uint32_t nl = 0, row = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        const scn_seq *s = &x->seq[which[i]];
        q[i] = scn_rows(x, s, n[i]);
        for (uint32_t j = 0; j < n[i]; j++, row++) {
            int64_t pos = s->len + j;
            if (x->p->yoco != FWD_YOCO_OFF && q[i].prompt_len &&
                pos < s->prompt_len - (int64_t)x->p->keep_tokens)
                continue;
            lrows[nl] = (int32_t)row;
            lpos[nl] = pos;
            lseq[nl] = (int32_t)which[i];
            nl++;
        }
    }
    fwd_step st = {.n_seqs = n_seqs, .seqs = q, .n_logit_rows = nl, .logit_rows = lrows};
    if (x->pad_to > row)
        q[st.n_seqs++] = (fwd_seq){.n_rows = x->pad_to - row, .placeholder = 1};
    di_status s = fwd_step_run(x->run, x->kv, &st, x->tmp, x->err);
    if (s != DI_OK)
        return s;
    scn_out *o = x->out;
    memcpy(o->logits + (size_t)o->n_rows * o->vocab, x->tmp, (size_t)nl * o->vocab * 4);
    memcpy(o->row_pos + o->n_rows, lpos, nl * sizeof(int64_t));
    memcpy(o->row_seq + o->n_rows, lseq, nl * sizeof(int32_t));
    o->n_rows += nl;
    for (uint32_t i = 0; i < n_seqs; i++)
        x->seq[which[i]].len += n[i];
    return DI_OK;
}

/* The draft sampler: the token fixed in advance for draft i of the request. */
static di_status scn_draft_pick(void *ud, uint32_t req, uint32_t i, const float *logits,
                                uint32_t vocab, int32_t *token)
{
    const scn_ctx *x = ud;
    (void)logits;
    (void)vocab;
    const scn_seq *s = &x->seq[req];
    *token = s->toks[s->len + 1 + i];
    return DI_OK;
}

static inline di_status scn_propose(scn_ctx *x)
{
    const model_config *c = x->c;
    uint32_t nx = x->p->nextn;
    if (c->n_mtp == 0 || nx == 0)
        return DI_OK;
    fwd_draft_req rq[SCN_SEQS];
    for (uint32_t i = 0; i < SCN_SEQS; i++)
        rq[i] = (fwd_draft_req){.slot = x->seq[i].slot, .pos = x->seq[i].len - 1,
                                .next = x->seq[i].toks[x->seq[i].len]};
    int32_t tok[SCN_SEQS * 8];
    float cum[SCN_SEQS * 8];
    scn_out *o = x->out;
    fwd_draft_out d = {.tokens = tok,
                       .logits = o->draft_logits + (size_t)o->n_drafts * c->vocab_size,
                       .confidence = o->draft_conf + o->n_drafts, .cumulative = cum};
    di_status s = fwd_draft(x->run, x->kv, SCN_SEQS, rq, nx, scn_draft_pick, x, &d, x->err);
    if (s == DI_OK)
        o->n_drafts += SCN_SEQS * nx;
    return s;
}

/* The sequences' tokens (random from p->seed), blocks, slots and prompt lengths. */
static inline void scn_seqs_init(scn_ctx *x, const int64_t *prompt_len)
{
    di_rng r;
    di_rng_init(&r, x->p->seed);
    for (uint32_t i = 0; i < SCN_SEQS; i++) {
        scn_seq *s = &x->seq[i];
        for (uint32_t t = 0; t < SCN_MAX_TOKENS; t++)
            s->toks[t] = 3 + (int32_t)di_rng_below(&r, x->c->vocab_size - 3);
        for (uint32_t b = 0; b < 5; b++) /* reversed, interleaved: ids differ from entries */
            s->blocks[b] = SCN_BLOCKS - 1 - (2 * b + i);
        s->slot = SCN_SLOTS - 1 - i;
        s->prompt_len = prompt_len[i];
    }
}

/* Runs the scenario on a model made with the nextn, YOCO mode and keep window of p and
 * max_rows >= SCN_CHUNK, with KV storage of SCN_BLOCKS blocks and SCN_SLOTS slots, zeroed. out is
 * filled on success (free with scn_out_free); on failure it holds what was recorded. */
static inline di_status scn_run(fwd_run *run, fwd_kv *kv, const fwd_model *m,
                                const scn_params *p, scn_out *out, di_error *err)
{
    const model_config *c = fwd_model_config(m);
    const kern_backend *be = kv->be;
    uint32_t V = c->vocab_size, nx = p->nextn;
    scn_ctx *x = calloc(1, sizeof(*x));
    memset(out, 0, sizeof(*out));
    out->vocab = V;
    uint32_t maxr = scn_max_rows(nx);
    out->logits = malloc((size_t)maxr * V * sizeof(float));
    out->row_pos = malloc(maxr * sizeof(int64_t));
    out->row_seq = malloc(maxr * sizeof(int32_t));
    size_t nd = (size_t)SCN_PROPOSALS * SCN_SEQS * (nx ? nx : 1);
    out->draft_logits = malloc(nd * V * sizeof(float));
    out->draft_conf = malloc(nd * sizeof(float));
    out->blocks_bytes = (size_t)kv->n_blocks * kv->block_bytes;
    out->slots_bytes = (size_t)kv->n_slots * kv->slot_bytes;
    out->blocks = malloc(out->blocks_bytes);
    out->slots = malloc(out->slots_bytes);
    float *tmp = malloc((size_t)SCN_CHUNK * SCN_SEQS * V * sizeof(float));
    if (!x || !out->logits || !out->row_pos || !out->row_seq || !out->draft_logits ||
        !out->draft_conf || !out->blocks || !out->slots || !tmp) {
        free(x);
        free(tmp);
        scn_out_free(out);
        return di_fail(err, DI_ENOMEM, "scenario buffers");
    }
    *x = (scn_ctx){.run = run, .kv = kv, .c = c, .p = p, .out = out, .tmp = tmp, .err = err};
    const int64_t plen[SCN_SEQS] = {300, 77};
    scn_seqs_init(x, plen);
    di_status st = DI_OK;
    /* prompts: sequence 0 in chunks, sequence 1 in one */
    for (uint32_t i = 0; i < SCN_SEQS && st == DI_OK; i++) {
        scn_seq *s = &x->seq[i];
        while (st == DI_OK && s->len < s->prompt_len) {
            int64_t left = s->prompt_len - s->len;
            uint32_t n = left < SCN_CHUNK ? (uint32_t)left : SCN_CHUNK;
            st = scn_step(x, &i, 1, &n);
        }
    }
    const uint32_t both[SCN_SEQS] = {0, 1}, one[SCN_SEQS] = {1, 1};
    const uint32_t spec[SCN_SEQS] = {1 + nx, 1 + nx};
    for (uint32_t k = 0; k < SCN_DECODE && st == DI_OK; k++) {
        st = scn_step(x, both, SCN_SEQS, one);
        if (st == DI_OK) /* a proposal after every decode step */
            st = scn_propose(x);
    }
    if (st == DI_OK)
        st = scn_step(x, both, SCN_SEQS, spec);
    if (st == DI_OK)
        st = scn_step(x, both, SCN_SEQS, one);
    if (st == DI_OK) {
        be->ops.to_host(be->ctx, out->blocks, kv->blocks, out->blocks_bytes);
        be->ops.to_host(be->ctx, out->slots, kv->slots, out->slots_bytes);
    }
    free(tmp);
    free(x);
    return st;
}

/* ---- the executor ---- */

#define EX_MAX_LOGITS 16

/* Logits rows the executor hands out (on_logits), in order. */
typedef struct scn_exec_log {
    uint32_t n, vocab;
    uint64_t req[EX_MAX_LOGITS];
    int64_t pos[EX_MAX_LOGITS];
    float *rows;                /* [EX_MAX_LOGITS, vocab] */
    int overflow;               /* more rows came than fit */
} scn_exec_log;

static void scn_on_logits(void *ud, uint64_t id, int64_t pos, const float *logits, uint32_t vocab)
{
    scn_exec_log *l = ud;
    if (l->n == EX_MAX_LOGITS) {
        l->overflow = 1;
        return;
    }
    l->req[l->n] = id;
    l->pos[l->n] = pos;
    memcpy(l->rows + (size_t)l->n * vocab, logits, vocab * sizeof(float));
    l->n++;
}

/* One executor run: its results per step, the logits, the KV bytes at the end. */
typedef struct scn_exec {
    runner_exec *ex;
    const kern_backend *be;
    int32_t prompt[150];
    scn_exec_log log;
    sched_seq_result res[3][2];
    uint8_t *blocks, *slots;
    size_t blocks_bytes, slots_bytes;
} scn_exec;

static inline void scn_exec_free(scn_exec *x)
{
    runner_exec_free(x->ex);
    free(x->log.rows);
    free(x->blocks);
    free(x->slots);
    memset(x, 0, sizeof(*x));
}

/* The executor on be with both requests registered. */
static inline di_status scn_exec_open(scn_exec *x, const runner_model *rm, const kern_backend *be,
                                      di_error *err)
{
    memset(x, 0, sizeof(*x));
    x->be = be;
    uint32_t V = rm->w->config.vocab_size;
    x->log.vocab = V;
    x->log.rows = malloc((size_t)EX_MAX_LOGITS * V * sizeof(float));
    if (!x->log.rows)
        return di_fail(err, DI_ENOMEM, "logits log");
    runner_exec_options o = {.fwd = {.nextn = 3, .max_rows = 128, .token_map_pad = -1},
                             .n_blocks = 8, .n_slots = 4, .on_logits = scn_on_logits,
                             .logits_userdata = &x->log};
    di_status st = runner_exec_create(rm, be, &o, &x->ex, err);
    for (int i = 0; i < 150; i++)
        x->prompt[i] = 3 + (i * 37) % (int32_t)(V - 3);
    for (uint64_t id = 1; id <= 2 && st == DI_OK; id++) {
        runner_request q = {.id = id, .prompt = x->prompt, .prompt_len = 150, .max_tokens = 16,
                            .params = sampling_params_default()};
        st = runner_exec_add(x->ex, &q, err);
    }
    if (st != DI_OK)
        scn_exec_free(x);
    return st;
}

static inline sched_seq_plan scn_entry(uint64_t id, uint32_t pos, uint32_t n, const int32_t *toks,
                                       const uint32_t *table, uint32_t slot, bool sample)
{
    sched_seq_plan p = {.request_id = id, .seqlen_q = n, .seqlen_k = pos + n,
                        .first_position = pos, .tokens = toks, .block_table = table,
                        .n_blocks = 2, .state_slot = (int32_t)slot, .sample = sample};
    return p;
}

/* The three steps. DI_EINTERNAL when the results are not those the scenario needs. */
static inline di_status scn_exec_steps(scn_exec *x, di_error *err)
{
    const uint32_t ta[2] = {1, 2}, tb[2] = {1, 3};
    sched_seq_plan s1 = scn_entry(1, 0, 128, x->prompt, ta, 0, false);
    sched_plan p1 = {.prompt_run = true, .n_seqs = 1, .seqs = &s1, .n_rows = 128};
    di_status st = runner_exec_step(x->ex, &p1, x->res[0], err);
    if (st != DI_OK)
        return st;
    sched_seq_plan s2 = scn_entry(1, 128, 22, x->prompt + 128, ta, 0, true);
    sched_plan p2 = {.step = 1, .prompt_run = true, .n_seqs = 1, .seqs = &s2, .n_rows = 22};
    if ((st = runner_exec_step(x->ex, &p2, x->res[1], err)) != DI_OK)
        return st;
    const sched_seq_result *r = &x->res[1][0];
    if (r->status != SCHED_RESULT_OK || r->n_tokens != 1 || r->n_drafts != 3)
        return di_fail(err, DI_EINTERNAL, "prompt result: status %d, %u tokens, %u drafts",
                       (int)r->status, r->n_tokens, r->n_drafts);
    int32_t rows[4] = {r->tokens[0], r->drafts[0], r->drafts[1], r->drafts[2]};
    sched_seq_plan s3[2] = {scn_entry(1, 150, 4, rows, ta, 0, true),
                            scn_entry(2, 150, 4, rows, tb, 1, true)};
    const sched_copy cp[2] = {{SCHED_COPY_BLOCK, 2, 3}, {SCHED_COPY_SLOT, 0, 1}};
    sched_plan p3 = {.step = 2, .n_seqs = 2, .seqs = s3, .n_rows = 8, .n_copies = 2,
                     .copies = cp};
    if ((st = runner_exec_step(x->ex, &p3, x->res[2], err)) != DI_OK)
        return st;
    if (x->log.overflow)
        return di_fail(err, DI_EINTERNAL, "more than %d logits rows", EX_MAX_LOGITS);
    return DI_OK;
}

/* The KV bytes into x (host copies). */
static inline di_status scn_exec_close(scn_exec *x, di_error *err)
{
    fwd_kv *kv = runner_exec_kv(x->ex);
    x->blocks_bytes = (size_t)kv->n_blocks * kv->block_bytes;
    x->slots_bytes = (size_t)kv->n_slots * kv->slot_bytes;
    x->blocks = malloc(x->blocks_bytes);
    x->slots = malloc(x->slots_bytes);
    if (!x->blocks || !x->slots)
        return di_fail(err, DI_ENOMEM, "KV copies");
    x->be->ops.to_host(x->be->ctx, x->blocks, kv->blocks, x->blocks_bytes);
    x->be->ops.to_host(x->be->ctx, x->slots, kv->slots, x->slots_bytes);
    return DI_OK;
}

/* Index in the log of the logits of request id at position pos; -1 when none. */
static inline int scn_exec_find(const scn_exec *x, uint64_t id, int64_t pos)
{
    for (uint32_t i = 0; i < x->log.n; i++)
        if (x->log.req[i] == id && x->log.pos[i] == pos)
            return (int)i;
    return -1;
}

/* ---- refused allocations ---- */

/* Model, run and KV creation (SCN_BLOCKS, SCN_SLOTS) on the tracked backend be with each of
 * its allocations refused in turn, until one pass needs no refusal. DI_OK when every refusal
 * gave DI_ENOMEM with a message and left nothing allocated; else DI_EINTERNAL saying which
 * did not. *n_allocs: the allocations creation makes. */
static inline di_status scn_refuse_creation(trk_state *trk, const model_weights *w,
                                            const kern_backend *be, const fwd_options *o,
                                            uint64_t *n_allocs, di_error *err)
{
    for (uint64_t k = 0; k < 100000; k++) {
        trk->fail_at = (int64_t)k;
        trk->n_allocs = 0;
        trk->refused = 0;
        di_error e = {0};
        fwd_model *m = NULL;
        fwd_run *run = NULL;
        fwd_kv *kv = NULL;
        di_status st = fwd_model_create(w, be, o, &m, &e);
        if (st == DI_OK)
            st = fwd_run_create(m, &run, &e);
        if (st == DI_OK)
            st = fwd_kv_create(fwd_model_geometry(m), be, SCN_BLOCKS, SCN_SLOTS, &kv, &e);
        int done = trk->refused == 0;
        fwd_kv_free(kv);
        fwd_run_free(run);
        fwd_model_free(m);
        trk->fail_at = -1;
        if (done && st != DI_OK)
            return di_fail(err, DI_EINTERNAL, "creation without a refusal failed: %s", e.msg);
        if (!done && (st != DI_ENOMEM || !e.msg[0]))
            return di_fail(err, DI_EINTERNAL, "allocation %llu refused: status %s, message "
                           "'%s'", (unsigned long long)k, di_status_name(st), e.msg);
        if (trk->live != 0)
            return di_fail(err, DI_EINTERNAL, "allocation %llu refused: %lld left allocated",
                           (unsigned long long)k, (long long)trk->live);
        if (done) {
            *n_allocs = k;
            return DI_OK;
        }
    }
    return di_fail(err, DI_EINTERNAL, "creation never succeeded");
}

/* A 64-row prompt step (positions 0..63, block 1, slot 0, logits of the last row) with each of
 * the first eight allocations it makes refused in turn, then with none. DI_OK when every
 * refused run gave DI_ENOMEM, at least one was refused and the last run succeeded; else
 * DI_EINTERNAL saying which did not. (The run keeps the buffers a step grows, so leaks show
 * once the run is freed.) */
static inline di_status scn_refuse_in_step(trk_state *trk, fwd_run *run, fwd_kv *kv,
                                           uint32_t vocab, uint64_t *refused, di_error *err)
{
    int32_t toks[64];
    for (int i = 0; i < 64; i++)
        toks[i] = 3 + i;
    uint32_t blocks[1] = {1};
    fwd_seq q = {.n_rows = 64, .tokens = toks, .blocks = blocks, .n_blocks = 1, .slot = 0};
    int32_t row = 63;
    fwd_step step = {.n_seqs = 1, .seqs = &q, .n_logit_rows = 1, .logit_rows = &row};
    float *logits = malloc((size_t)vocab * sizeof(float));
    if (!logits)
        return di_fail(err, DI_ENOMEM, "logits");
    di_status bad = DI_OK;
    *refused = 0;
    for (uint64_t k = 0; k < 8 && bad == DI_OK; k++) {
        trk->n_allocs = 0;
        trk->refused = 0;
        trk->fail_at = (int64_t)k;
        di_error e = {0};
        di_status st = fwd_step_run(run, kv, &step, logits, &e);
        if (trk->refused && st != DI_ENOMEM)
            bad = di_fail(err, DI_EINTERNAL, "step with allocation %llu refused: %s (%s)",
                          (unsigned long long)k, di_status_name(st), e.msg);
        *refused += trk->refused;
    }
    trk->fail_at = -1;
    if (bad == DI_OK && *refused == 0)
        bad = di_fail(err, DI_EINTERNAL, "the step allocated nothing of its own");
    di_error e = {0};
    di_status st = bad == DI_OK ? fwd_step_run(run, kv, &step, logits, &e) : DI_OK;
    if (bad == DI_OK && st != DI_OK)
        bad = di_fail(err, DI_EINTERNAL, "the step after the refusals: %s", e.msg);
    free(logits);
    return bad;
}

#endif
