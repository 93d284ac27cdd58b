/* The handoff in-process: prompts prefilled by a PROMPT engine, handed off (object written,
 * read back, full blocks exported as store objects) and decoded by a fresh COMPLETION engine
 * give the tokens and logprobs of a NORMAL run bit for bit (tiny model, CPU backend,
 * temperature 0 and sampled, drafts on and off, prompt lengths around multiples of 128 and
 * over one chunk). Then the refusals: corrupt blocks, foreign executor state, bad drafts. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/engine/seq.h"
#include "common/kvfmt/kv_keys.h"
#include "common/model/kv_io.h"
#include "common/serve/backend.h"
#include "common/serve/handoff.h"
#include "common/serve/model_open.h"

#define MAX_OUT 16u
#define MAX_REQ 8u
#define CHUNK 256u

static const uint32_t k_lens[] = {127, 128, 129, 255, 257, 300, 5};
#define N_PROMPTS (sizeof k_lens / sizeof k_lens[0])

typedef struct req_out {
    int32_t tok[MAX_OUT];
    float lp[MAX_OUT];
    uint32_t n;
    sched_finish finish;
} req_out;

/* One handoff as the COMPLETION side sees it. */
typedef struct imported {
    void *obj;                  /* the handoff object (8-byte aligned) */
    kv_handoff h;
    void **blocks;              /* full blocks as store objects */
    size_t *bytes;
    uint32_t n_full;
} imported;

typedef struct rig {
    runner_exec *ex;
    engine *e;
    req_out out[MAX_REQ + 1];
    imported *imp;              /* [MAX_REQ + 1] by request id, COMPLETION only */
    uint32_t loads;
} rig;

static serve_model g_model;
static kern_backend g_be;

static void open_model(void)
{
    di_error err;
    serve_backend_options bo = {.threads = 1};
    cr_assert_eq(serve_backend_open("cpu", &bo, &g_be, &err), DI_OK, "%s", err.msg);
    serve_model_options o = {.config = "tiny", .weights_seed = 11};
    cr_assert_eq(serve_model_open(&o, &g_model, &err), DI_OK, "%s", err.msg);
}

static void close_model(void)
{
    serve_model_close(&g_model);
    serve_backend_close(&g_be);
}

static void on_output(void *ud, const engine_output *o)
{
    rig *r = ud;
    req_out *ro = &r->out[o->request_id];
    uint32_t nr;
    const runner_token *rt = runner_exec_tokens(r->ex, o->request_id, &nr);
    for (uint32_t t = 0; t < o->n_tokens && ro->n < MAX_OUT; t++) {
        cr_assert(t < nr && rt[t].token == o->tokens[t], "request %llu: token %u without its "
                  "sampler result", (unsigned long long)o->request_id, t);
        ro->tok[ro->n] = o->tokens[t];
        ro->lp[ro->n++] = rt[t].res.logprob;
    }
    if (o->finish != SCHED_FINISH_NONE)
        ro->finish = o->finish;
}

static di_status on_load(void *ud, fwd_kv *kv, const sched_seq_plan *p, di_error *err)
{
    rig *r = ud;
    imported *im = &r->imp[p->request_id];
    r->loads++;
    return handoff_load(kv, p, &im->h, (const void *const *)im->blocks, im->bytes, err);
}

static void rig_open(rig *r, sched_engine_type type, uint32_t nextn)
{
    const model_config *c = &g_model.rm.w->config;
    di_error err;
    sched_config sc;
    sched_config_default(&sc);
    sc.type = type;
    sc.prefill_attempt_interval = 1;
    sc.max_num_batched_tokens = CHUNK;
    sc.max_num_seqs = MAX_REQ;
    sc.max_model_len = 4096;
    sc.nextn = nextn;
    sc.num_blocks = 64;
    sc.num_slots = MAX_REQ + 1;
    sc.eos_token = (int32_t)c->eos_token_id;
    sc.pad_token = (int32_t)c->pad_token_id;
    sc.vocab_size = c->vocab_size;
    uint32_t rows = CHUNK > MAX_REQ * (1 + nextn) ? CHUNK : MAX_REQ * (1 + nextn);
    if (nextn && rows < MAX_REQ * c->dspark_block_size)
        rows = MAX_REQ * c->dspark_block_size;
    runner_exec_options eo = {.fwd = {.nextn = nextn, .max_rows = rows},
                              .n_blocks = sc.num_blocks, .n_slots = sc.num_slots,
                              .on_load = on_load, .load_userdata = r};
    cr_assert_eq(runner_exec_create(&g_model.rm, &g_be, &eo, &r->ex, &err), DI_OK, "%s",
                 err.msg);
    engine_config ec = {.sched = sc, .exec = runner_exec_executor(r->ex),
                        .on_output = on_output, .userdata = r};
    cr_assert_eq(engine_create(&ec, &r->e, &err), DI_OK, "%s", err.msg);
}

static void rig_close(rig *r)
{
    engine_destroy(r->e);
    runner_exec_free(r->ex);
}

static void prompt_of(uint32_t i, int32_t *p)
{
    for (uint32_t k = 0; k < k_lens[i]; k++)
        p[k] = (int32_t)(2 + (k * 7919u + i * 104729u) % 4000u);
}

static sampling_params params_for(float temp, uint64_t seed)
{
    sampling_params sp = sampling_params_default();
    sp.temperature = temp;
    sp.seed = seed;
    sp.n_logprobs = 3;
    sp.eos_id = (int32_t)g_model.rm.w->config.eos_token_id;
    return sp;
}

/* Adds prompt i as request i + 1. */
static void add_prompt(rig *r, uint32_t i, const sampling_params *sp, uint32_t max_tokens)
{
    int32_t p[512];
    prompt_of(i, p);
    di_error err;
    runner_request rq = {.id = i + 1, .prompt = p, .prompt_len = k_lens[i],
                         .max_tokens = max_tokens, .params = *sp};
    sched_request sr = {.id = i + 1, .prompt = p, .prompt_len = k_lens[i],
                        .max_tokens = max_tokens, .ignore_eos = true};
    cr_assert_eq(engine_add(r->e, &sr, &rq, NULL, &err), DI_OK, "%s", err.msg);
}

static void run_all(rig *r)
{
    di_error err;
    cr_assert_eq(engine_run(r->e, 10000, &err), DI_OK, "%s", err.msg);
}

/* Exports every held handoff of the PROMPT rig into imp (object read back and verified, full
 * blocks as store objects), releasing each. */
static void export_all(rig *r, imported *imp, uint32_t n)
{
    const kv_geometry *g = fwd_model_geometry(runner_exec_model(r->ex));
    for (uint64_t id = 1; id <= n; id++) {
        di_error err;
        kvkey key;
        char name[32];
        snprintf(name, sizeof name, "req-%llu", (unsigned long long)id);
        cr_assert_eq(kvkey_handoff(g->model_id, name, &key, &err), DI_OK, "%s", err.msg);
        size_t cap = handoff_max_bytes(r->ex, k_lens[id - 1] + 1), bytes = 0;
        imported *im = &imp[id];
        im->obj = aligned_alloc(8, (cap + 7) / 8 * 8);
        cr_assert_not_null(im->obj);
        cr_assert_eq(handoff_export(r->e, r->ex, id, key.b, im->obj, cap, &bytes, &im->n_full,
                                    &err), DI_OK, "%s", err.msg);
        cr_assert_eq(kv_handoff_read(g, im->obj, bytes, key.b, &im->h, &err), DI_OK, "%s",
                     err.msg);
        cr_assert_eq(im->h.kv_positions, k_lens[id - 1]);
        cr_assert_eq(im->h.n_output, 1);
        cr_assert_eq(im->n_full, k_lens[id - 1] / 128);
        im->blocks = calloc(im->n_full + 1, sizeof(void *));
        im->bytes = calloc(im->n_full + 1, sizeof(size_t));
        for (uint32_t b = 0; b < im->n_full; b++) {
            im->bytes[b] = kv_block_bytes(g);
            im->blocks[b] = aligned_alloc(8, im->bytes[b]);
            cr_assert_eq(handoff_block(r->e, r->ex, id, &im->h, b, im->blocks[b], im->bytes[b],
                                       &err), DI_OK, "%s", err.msg);
        }
        cr_assert_eq(handoff_block(r->e, r->ex, id, &im->h, im->n_full, im->blocks[0],
                                   kv_block_bytes(g), &err), DI_EINVAL, "no such full block");
        cr_assert_eq(engine_release(r->e, id, &err), DI_OK, "%s", err.msg);
        cr_assert_eq(handoff_export(r->e, r->ex, id, key.b, im->obj, cap, &bytes, NULL, &err),
                     DI_ENOENT, "released");
    }
}

static void free_imports(imported *imp, uint32_t n)
{
    for (uint32_t id = 1; id <= n; id++) {
        for (uint32_t b = 0; b < imp[id].n_full; b++)
            free(imp[id].blocks[b]);
        free(imp[id].blocks);
        free(imp[id].bytes);
        free(imp[id].obj);
    }
}

static void compare_case(float temp, uint64_t seed, uint32_t nextn)
{
    const uint32_t max_tokens = 12;
    sampling_params sp = params_for(temp, seed);
    rig normal = {0}, prompt = {0}, comp = {0};
    imported imp[MAX_REQ + 1];
    memset(imp, 0, sizeof imp);
    di_error err;

    rig_open(&normal, SCHED_NORMAL, nextn);
    for (uint32_t i = 0; i < N_PROMPTS; i++)
        add_prompt(&normal, i, &sp, max_tokens);
    run_all(&normal);

    rig_open(&prompt, SCHED_PROMPT, nextn);
    uint32_t free0 = sched_free_blocks(engine_sched(prompt.e));
    uint32_t slots0 = sched_free_slots(engine_sched(prompt.e));
    for (uint32_t i = 0; i < N_PROMPTS; i++)
        add_prompt(&prompt, i, &sp, max_tokens);
    run_all(&prompt);
    for (uint32_t id = 1; id <= N_PROMPTS; id++) {
        cr_assert_eq(prompt.out[id].finish, SCHED_FINISH_HANDOFF);
        cr_assert_eq(prompt.out[id].n, 1);
    }
    export_all(&prompt, imp, N_PROMPTS);
    cr_assert_eq(sched_free_blocks(engine_sched(prompt.e)), free0, "blocks back");
    cr_assert_eq(sched_free_slots(engine_sched(prompt.e)), slots0, "slots back");

    rig_open(&comp, SCHED_COMPLETION, nextn);
    comp.imp = imp;
    free0 = sched_free_blocks(engine_sched(comp.e));
    slots0 = sched_free_slots(engine_sched(comp.e));
    for (uint64_t id = 1; id <= N_PROMPTS; id++) {
        sched_request sr;
        runner_request rq;
        handoff_requests(&imp[id].h, id, &sr, &rq);
        sr.max_tokens = rq.max_tokens = max_tokens;
        sr.ignore_eos = true;
        rq.params = sp;
        cr_assert_eq(engine_add(comp.e, &sr, &rq, NULL, &err), DI_OK, "%s", err.msg);
        cr_assert_eq(engine_set_ready(comp.e, id, &err), DI_OK, "%s", err.msg);
    }
    run_all(&comp);
    cr_assert_eq(comp.loads, N_PROMPTS, "every request loaded its handoff once");
    cr_assert_eq(sched_free_blocks(engine_sched(comp.e)), free0, "blocks back");
    cr_assert_eq(sched_free_slots(engine_sched(comp.e)), slots0, "slots back");

    for (uint32_t id = 1; id <= N_PROMPTS; id++) {
        const req_out *a = &normal.out[id], *p = &prompt.out[id], *d = &comp.out[id];
        cr_assert_eq(a->n, max_tokens, "prompt %u: normal run gave %u tokens", id, a->n);
        cr_assert_eq(p->n + d->n, a->n, "prompt %u (%u tokens), T %.1f seed %llu nextn %u: "
                     "%u + %u tokens, want %u", id, k_lens[id - 1], temp,
                     (unsigned long long)seed, nextn, p->n, d->n, a->n);
        cr_assert_eq(d->finish, a->finish);
        for (uint32_t t = 0; t < a->n; t++) {
            int32_t tok = t == 0 ? p->tok[0] : d->tok[t - 1];
            float lp = t == 0 ? p->lp[0] : d->lp[t - 1];
            cr_assert_eq(tok, a->tok[t], "prompt %u (%u tokens), T %.1f seed %llu nextn %u: "
                         "token %u is %d, the normal run's %d", id, k_lens[id - 1], temp,
                         (unsigned long long)seed, nextn, t, tok, a->tok[t]);
            cr_assert(memcmp(&lp, &a->lp[t], sizeof lp) == 0, "prompt %u, T %.1f seed %llu "
                      "nextn %u: logprob %u is %.9g, the normal run's %.9g", id, temp,
                      (unsigned long long)seed, nextn, t, lp, a->lp[t]);
        }
    }
    rig_close(&normal);
    rig_close(&prompt);
    rig_close(&comp);
    free_imports(imp, N_PROMPTS);
}

TestSuite(handoff, .init = open_model, .fini = close_model, .timeout = 240);

Test(handoff, greedy_without_drafts_equals_a_normal_run)
{
    compare_case(0.0f, 1, 0);
}

Test(handoff, greedy_with_drafts_equals_a_normal_run)
{
    compare_case(0.0f, 1, 5);
}

Test(handoff, sampled_without_drafts_equals_a_normal_run)
{
    compare_case(0.8f, 7, 0);
    compare_case(0.8f, 12345, 0);
}

Test(handoff, sampled_with_drafts_equals_a_normal_run)
{
    compare_case(0.8f, 7, 5);
    compare_case(0.8f, 12345, 3);
}

/* A block stored under another key, a block for another position, a handoff whose plan entry
 * does not match: refused before the slot is touched. */
Test(handoff, corrupt_or_misplaced_blocks_are_refused)
{
    sampling_params sp = params_for(0.0f, 1);
    rig prompt = {0};
    imported imp[MAX_REQ + 1];
    memset(imp, 0, sizeof imp);
    di_error err;
    rig_open(&prompt, SCHED_PROMPT, 5);
    add_prompt(&prompt, 4, &sp, 4); /* 257 tokens: two full blocks and a partial one */
    run_all(&prompt);
    cr_assert_eq(handoff_export(prompt.e, prompt.ex, 99, (uint8_t[32]){0}, NULL, 0, NULL, NULL,
                                &err), DI_ENOENT);
    const kv_geometry *g = fwd_model_geometry(runner_exec_model(prompt.ex));
    kvkey key;
    cr_assert_eq(kvkey_handoff(g->model_id, "x", &key, &err), DI_OK);
    size_t cap = handoff_max_bytes(prompt.ex, 258), bytes;
    imported *im = &imp[5];
    im->obj = aligned_alloc(8, (cap + 7) / 8 * 8);
    cr_assert_eq(handoff_export(prompt.e, prompt.ex, 5, key.b, im->obj, cap, &bytes, &im->n_full,
                                &err), DI_OK, "%s", err.msg);
    cr_assert_eq(handoff_export(prompt.e, prompt.ex, 5, key.b, im->obj, 1000, &bytes, NULL,
                                &err), DI_EINVAL, "buffer too small");
    cr_assert_eq(kv_handoff_read(g, im->obj, bytes, key.b, &im->h, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(im->n_full, 2);
    size_t bb = kv_block_bytes(g);
    void *b0 = aligned_alloc(8, bb), *b1 = aligned_alloc(8, bb);
    cr_assert_eq(handoff_block(prompt.e, prompt.ex, 5, &im->h, 0, b0, bb, &err), DI_OK);
    cr_assert_eq(handoff_block(prompt.e, prompt.ex, 5, &im->h, 1, b1, bb, &err), DI_OK);

    /* a scratch pool to import into */
    fwd_kv *kv;
    cr_assert_eq(fwd_kv_create(g, &g_be, 8, 2, &kv, &err), DI_OK, "%s", err.msg);
    uint32_t table[3] = {1, 2, 3};
    sched_seq_plan p = {.request_id = 5, .block_table = table, .n_blocks = 3, .state_slot = 1,
                        .n_load = 257, .load_window = true};
    const void *swapped[2] = {b1, b0};
    size_t sizes[2] = {bb, bb};
    cr_assert_eq(handoff_load(kv, &p, &im->h, swapped, sizes, &err), DI_ECORRUPT);
    cr_assert(strstr(err.msg, "handoff block 0"), "%s", err.msg);
    const void *ok[2] = {b0, b1};
    ((uint8_t *)b1)[KV_HEADER_BYTES + 5] ^= 1; /* one payload bit */
    cr_assert_eq(handoff_load(kv, &p, &im->h, ok, sizes, &err), DI_ECORRUPT);
    cr_assert(strstr(err.msg, "handoff block 1"), "%s", err.msg);
    ((uint8_t *)b1)[KV_HEADER_BYTES + 5] ^= 1;
    p.n_load = 256;
    cr_assert_eq(handoff_load(kv, &p, &im->h, ok, sizes, &err), DI_EINVAL, "wrong n_load");
    p.n_load = 257;
    p.n_blocks = 2;
    cr_assert_eq(handoff_load(kv, &p, &im->h, ok, sizes, &err), DI_EINVAL, "table too short");
    p.n_blocks = 3;
    cr_assert_eq(handoff_load(kv, &p, &im->h, ok, sizes, &err), DI_OK, "%s", err.msg);

    /* executor state of another model, or cut short, is refused by runner_exec_add */
    runner_request rq;
    sched_request sr;
    handoff_requests(&im->h, 5, &sr, &rq);
    rq.max_tokens = 4;
    rq.params = sp;
    uint8_t *bad = malloc(im->h.exec_bytes);
    memcpy(bad, im->h.exec, im->h.exec_bytes);
    bad[4] ^= 1; /* vocabulary */
    rq.state = bad;
    cr_assert_eq(runner_exec_add(prompt.ex, &(runner_request){0}, &err), DI_EINVAL);
    rq.id = 77;
    cr_assert_eq(runner_exec_add(prompt.ex, &rq, &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "executor state"), "%s", err.msg);
    bad[4] ^= 1;
    rq.state_bytes -= 4;
    cr_assert_eq(runner_exec_add(prompt.ex, &rq, &err), DI_EINVAL);
    rq.state_bytes += 4;
    cr_assert_eq(runner_exec_add(prompt.ex, &rq, &err), DI_OK, "%s", err.msg);
    runner_exec_remove(prompt.ex, 77);
    free(bad);

    /* drafts beyond nextn are refused by the scheduler */
    sr.n_drafts = 6;
    sr.id = 78;
    sr.max_tokens = 4;
    int32_t d[6] = {2, 3, 4, 5, 6, 7};
    sr.drafts = d;
    cr_assert_eq(sched_add_request(engine_sched(prompt.e), &sr, &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "drafts"), "%s", err.msg);

    cr_assert_eq(engine_release(prompt.e, 5, &err), DI_OK);
    fwd_kv_free(kv);
    free(b0);
    free(b1);
    free(im->obj);
    rig_close(&prompt);
}
