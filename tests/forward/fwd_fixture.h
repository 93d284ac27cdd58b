/* fwd_fixture.h: a random-weight model, KV storage and sequences for the forward tests. */
#ifndef DI_TESTS_FORWARD_FWD_FIXTURE_H
#define DI_TESTS_FORWARD_FWD_FIXTURE_H

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/forward.h"
#include "common/model/runner.h"
#include "common/util/philox.h"
#include "kernels/cpu/numfmt.h"
#include "kernels/cpu/backend.h"

#define FX_MAX_TOKENS 1024
#define FX_MAX_BLOCKS 16

typedef struct fx {
    kern_backend be;
    runner_model rm;
    fwd_model *m;
    fwd_run *run;
    fwd_kv *kv;
    const model_config *c;
    uint32_t next_block;        /* next unused block id in the pool */
    uint32_t next_slot;
} fx;

/* A sequence of the tests: its tokens, block table and slot. */
typedef struct fx_seq {
    int32_t toks[FX_MAX_TOKENS];
    uint32_t blocks[FX_MAX_BLOCKS];
    uint32_t slot;
    int64_t len;                /* tokens already processed (KV ready) */
    int64_t prompt_len;         /* for YOCO: the prompt's length; 0 = decode rows */
} fx_seq;

static inline void fx_open_opts(fx *f, const char *config, uint64_t seed, fwd_options o,
                                uint32_t n_blocks, uint32_t n_slots)
{
    di_error e;
    memset(f, 0, sizeof(*f));
    cr_assert_eq(kern_cpu_create(2, &f->be, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(runner_model_random(config, seed, NULL, NULL, &f->rm, &e), DI_OK, "%s", e.msg);
    o.token_map = f->rm.token_map;
    o.token_map_pad = f->rm.token_map_pad;
    cr_assert_eq(fwd_model_create(f->rm.w, &f->be, &o, &f->m, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(fwd_run_create(f->m, &f->run, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(fwd_kv_create(fwd_model_geometry(f->m), &f->be, n_blocks, n_slots, &f->kv, &e),
                 DI_OK, "%s", e.msg);
    f->c = fwd_model_config(f->m);
}

static inline fwd_options fx_default_opts(void)
{
    fwd_options o = {.nextn = 5, .max_rows = 2048, .yoco = FWD_YOCO_OFF, .token_map_pad = -1};
    return o;
}

static inline void fx_open(fx *f, uint64_t seed)
{
    fx_open_opts(f, "tiny", seed, fx_default_opts(), 256, 80);
}

static inline void fx_close(fx *f)
{
    fwd_kv_free(f->kv);
    fwd_run_free(f->run);
    fwd_model_free(f->m);
    runner_model_free(&f->rm);
    kern_cpu_destroy(&f->be);
}

/* A new sequence with n random tokens (ids 3 .. vocab-1) from seed, its own blocks and slot. */
static inline void fx_seq_new(fx *f, fx_seq *s, uint32_t n, uint64_t seed)
{
    memset(s, 0, sizeof(*s));
    di_rng r;
    di_rng_init(&r, seed);
    for (uint32_t i = 0; i < n && i < FX_MAX_TOKENS; i++)
        s->toks[i] = 3 + (int32_t)di_rng_below(&r, f->c->vocab_size - 3);
    uint32_t nb = (n + 127) / 128 + 1;
    cr_assert(nb <= FX_MAX_BLOCKS && f->next_block + nb <= f->kv->n_blocks);
    for (uint32_t b = 0; b < nb; b++) /* reversed ids: table entries differ from block ids */
        s->blocks[b] = f->kv->n_blocks - 1 - (f->next_block++);
    cr_assert(f->next_slot < f->kv->n_slots);
    s->slot = f->next_slot++;
}

/* The fwd_seq for the next n rows of s (positions len .. len+n-1). */
static inline fwd_seq fx_rows(const fx *f, const fx_seq *s, uint32_t n)
{
    uint32_t lb = f->c->n_engram_layers ? f->c->engram_max_ngram_size - 1 : 0;
    uint32_t h = s->len < (int64_t)lb ? (uint32_t)s->len : lb;
    fwd_seq q = {.n_rows = n, .pos0 = s->len, .tokens = s->toks + s->len,
                 .history = s->toks + s->len - h, .n_history = h, .blocks = s->blocks,
                 .n_blocks = FX_MAX_BLOCKS, .slot = s->slot, .prompt_len = s->prompt_len};
    return q;
}

/* Runs the next n rows of one sequence, logits of every row into out ([n, V]) when given. */
static inline void fx_step1(fx *f, fx_seq *s, uint32_t n, float *out)
{
    fwd_seq q = fx_rows(f, s, n);
    int32_t rows[FX_MAX_TOKENS];
    for (uint32_t i = 0; i < n; i++)
        rows[i] = (int32_t)i;
    fwd_step st = {.n_seqs = 1, .seqs = &q, .n_logit_rows = out ? n : 0, .logit_rows = rows};
    di_error e;
    cr_assert_eq(fwd_step_run(f->run, f->kv, &st, out, &e), DI_OK, "%s", e.msg);
    s->len += n;
}

#endif
