/* Placeholder rows (fwd_seq.placeholder): steps padded to the recorded graph sizes give the
 * real rows' logits, drafts, KV blocks and state slots of the unpadded steps bit for bit, write
 * nothing, run no expert and are asked for by the executor's pad_steps. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/engine/graphs.h"
#include "common/model/runner_exec.h"
#include "tests/forward/fwd_fixture.h"

#define PH_STEPS 6

/* A placeholder sequence whose ignored fields would write or read out of bounds if used. */
static const uint32_t g_bad_blocks[4] = {0xfffffff0u, 0xfffffff1u, 0xfffffff2u, 0xfffffff3u};

static fwd_seq placeholder(uint32_t n)
{
    return (fwd_seq){.n_rows = n, .placeholder = 1, .pos0 = (int64_t)1 << 40, .tokens = NULL,
                     .history = NULL, .n_history = 7, .blocks = g_bad_blocks, .n_blocks = 4,
                     .slot = 999999, .prompt_len = -5, .window_start = -1};
}

static size_t vocab_of(const fx *f)
{
    return f->c->vocab_size;
}

static void assert_kv_equal(const fx *a, const fx *b, const char *when)
{
    cr_assert_eq(memcmp(a->kv->blocks, b->kv->blocks, (size_t)a->kv->n_blocks * a->kv->block_bytes),
                 0, "%s: KV blocks differ", when);
    cr_assert_eq(memcmp(a->kv->slots, b->kv->slots, (size_t)a->kv->n_slots * a->kv->slot_bytes), 0,
                 "%s: state slots differ", when);
}

static di_status greedy(void *ud, uint32_t req, uint32_t i, const float *logits, uint32_t V,
                        int32_t *tok)
{
    (void)ud, (void)req, (void)i;
    uint32_t best = 0;
    for (uint32_t v = 1; v < V; v++)
        if (logits[v] > logits[best])
            best = v;
    *tok = (int32_t)best;
    return DI_OK;
}

/* Per-expert row counts of the backbone layers, as expert parallelism's EPLB window sees them
 * (common/ep/moe.c counts the rows its hook is handed). y is zeroed: only the counts matter. */
typedef struct moe_count {
    uint64_t n[16][64];         /* [layer][expert] */
    uint64_t rows;              /* rows handed to the hook, summed */
} moe_count;

static di_status count_moe(void *ud, uint32_t layer, const kern_moe_experts *p, di_error *err)
{
    (void)err;
    moe_count *c = ud;
    cr_assert(layer < 16 && p->n_experts <= 64);
    for (uint32_t t = 0; t < p->n_rows; t++)
        for (uint32_t k = 0; k < p->top_k; k++)
            c->n[layer][p->ids[(size_t)t * p->top_k + k]]++;
    c->rows += p->n_rows;
    memset(p->y, 0, (size_t)p->n_rows * p->dim * 2);
    return DI_OK;
}

/* One scenario step: which sequences run how many rows. */
typedef struct ph_plan {
    uint32_t rows[3];           /* rows of sequences 0..2 this step (0 = not in the step) */
} ph_plan;

/* Sequence 0 decodes 1 + nextn rows a step, sequence 1 one row until it ends after step 2,
 * sequence 2 joins at step 2 with its 20-token prompt, then decodes. */
static const ph_plan g_plan[PH_STEPS] = {
    {{60, 30, 0}}, {{6, 1, 0}}, {{6, 1, 20}}, {{6, 0, 1}}, {{6, 0, 1}}, {{1, 0, 1}},
};

typedef struct ph_run {
    fx f;
    fx_seq s[3];
    moe_count counts;
    float *logits;              /* [rows of the step, V] */
    int32_t dtok[5];
    float dconf[5], dcum[5];
    float *dlogits;             /* [5, V] */
} ph_run;

static void run_open(ph_run *r, fwd_options o, int count)
{
    memset(&r->counts, 0, sizeof(r->counts));
    if (count) {
        o.moe_fn = count_moe;
        o.moe_userdata = &r->counts;
    }
    fx_open_opts(&r->f, "tiny", 41, o, 64, 8);
    for (int i = 0; i < 3; i++)
        fx_seq_new(&r->f, &r->s[i], 400, 100 + (uint64_t)i);
    r->logits = malloc(128 * vocab_of(&r->f) * sizeof(float));
    r->dlogits = malloc(5 * vocab_of(&r->f) * sizeof(float));
    cr_assert(r->logits && r->dlogits);
}

static void run_close(ph_run *r)
{
    free(r->logits);
    free(r->dlogits);
    fx_close(&r->f);
}

/* Runs scenario step k, padded with `pad` placeholder rows (0: none); logits of every real row.
 * Returns the real rows. */
static uint32_t run_step(ph_run *r, uint32_t k, uint32_t pad)
{
    fwd_seq q[4];
    int32_t lr[128];
    uint32_t n = 0, rows = 0;
    for (int i = 0; i < 3; i++) {
        uint32_t m = g_plan[k].rows[i];
        if (!m)
            continue;
        q[n++] = fx_rows(&r->f, &r->s[i], m);
        for (uint32_t j = 0; j < m; j++, rows++)
            lr[rows] = (int32_t)rows;
    }
    if (pad)
        q[n++] = placeholder(pad);
    fwd_step st = {.n_seqs = n, .seqs = q, .n_logit_rows = rows, .logit_rows = lr};
    di_error e;
    cr_assert_eq(fwd_step_run(r->f.run, r->f.kv, &st, r->logits, &e), DI_OK, "step %u: %s", k,
                 e.msg);
    for (int i = 0; i < 3; i++)
        r->s[i].len += g_plan[k].rows[i];
    if (k > 0) { /* a proposal from sequence 0's newest position */
        fwd_draft_req dq = {.slot = r->s[0].slot, .pos = r->s[0].len - 1,
                            .next = r->s[0].toks[r->s[0].len]};
        fwd_draft_out out = {.tokens = r->dtok, .logits = r->dlogits, .confidence = r->dconf,
                             .cumulative = r->dcum};
        cr_assert_eq(fwd_draft(r->f.run, r->f.kv, 1, &dq, 5, greedy, NULL, &out, &e), DI_OK,
                     "step %u: %s", k, e.msg);
    }
    return rows;
}

/* Placeholder rows for a step of `rows` rows: up to the recorded size of a 4-sequence, nextn 5
 * engine, and at least 3 (a step of a recorded size gets 3 more; a prompt step too). */
static uint32_t pad_for(const graph_sizes *g, uint32_t rows)
{
    uint32_t size = graph_sizes_select(g, rows);
    return size > rows ? size - rows : 3;
}

Test(placeholder, padded_steps_equal_unpadded_steps_bit_for_bit, .timeout = 120)
{
    ph_run *a = calloc(2, sizeof(ph_run)), *b = a + 1;
    cr_assert_not_null(a);
    run_open(a, fx_default_opts(), 0);
    run_open(b, fx_default_opts(), 0);
    graph_sizes g;
    di_error e;
    cr_assert_eq(graph_sizes_init(&g, 4, 5, 8, &e), DI_OK, "%s", e.msg);
    size_t V = vocab_of(&a->f);
    for (uint32_t k = 0; k < PH_STEPS; k++) {
        uint32_t rows = run_step(a, k, 0);
        cr_assert_eq(run_step(b, k, pad_for(&g, rows)), rows);
        cr_assert_eq(memcmp(a->logits, b->logits, rows * V * sizeof(float)), 0,
                     "step %u: logits differ", k);
        char when[32];
        snprintf(when, sizeof(when), "step %u", k);
        assert_kv_equal(&a->f, &b->f, when);
        if (k == 0)
            continue;
        cr_assert_eq(memcmp(a->dtok, b->dtok, sizeof(a->dtok)), 0, "step %u: drafts differ", k);
        cr_assert_eq(memcmp(a->dconf, b->dconf, sizeof(a->dconf)), 0, "step %u: confidences", k);
        cr_assert_eq(memcmp(a->dcum, b->dcum, sizeof(a->dcum)), 0, "step %u: cumulative", k);
        cr_assert_eq(memcmp(a->dlogits, b->dlogits, 5 * V * sizeof(float)), 0,
                     "step %u: draft logits differ", k);
    }
    graph_sizes_free(&g);
    run_close(a);
    run_close(b);
    free(a);
}

/* YOCO compact truncation moves the rows at the boundary layer: the placeholder rows stay
 * last and still write nothing. A 200-token prompt (66 rows dropped) with placeholder rows,
 * then two decode steps of 1 + nextn rows, each padded. */
Test(placeholder, padded_steps_match_under_yoco_compaction, .timeout = 120)
{
    fwd_options o = fx_default_opts();
    o.yoco = FWD_YOCO_COMPACT;
    o.keep_tokens = 134;
    fx f[2];
    fx_seq s[2];
    size_t V = 0;
    float *l[2];
    for (int k = 0; k < 2; k++) {
        fx_open_opts(&f[k], "tiny", 59, o, 16, 2);
        fx_seq_new(&f[k], &s[k], 220, 7);
        s[k].prompt_len = 200;
        V = f[k].c->vocab_size;
        l[k] = malloc(6 * V * sizeof(float));
        cr_assert_not_null(l[k]);
    }
    static const uint32_t rows[3] = {200, 6, 6};
    for (uint32_t step = 0; step < 3; step++) {
        for (int k = 0; k < 2; k++) {
            fwd_seq q[2] = {fx_rows(&f[k], &s[k], rows[step]), placeholder(5 + step)};
            int32_t lr[6];
            uint32_t n = step == 0 ? 1 : 6; /* the prompt's last row, or every decode row */
            for (uint32_t i = 0; i < n; i++)
                lr[i] = (int32_t)(rows[step] - n + i);
            fwd_step st = {.n_seqs = k ? 2 : 1, .seqs = q, .n_logit_rows = n, .logit_rows = lr};
            di_error e;
            cr_assert_eq(fwd_step_run(f[k].run, f[k].kv, &st, l[k], &e), DI_OK, "%s", e.msg);
            s[k].len += rows[step];
            if (step == 0)
                s[k].prompt_len = 0;
        }
        uint32_t n = step == 0 ? 1 : 6;
        cr_assert_eq(memcmp(l[0], l[1], n * V * sizeof(float)), 0, "step %u: logits differ", step);
        assert_kv_equal(&f[0], &f[1], "YOCO compact");
    }
    for (int k = 0; k < 2; k++) {
        free(l[k]);
        fx_close(&f[k]);
    }
}

Test(placeholder, expert_loads_do_not_count_placeholder_rows, .timeout = 120)
{
    ph_run *a = calloc(2, sizeof(ph_run)), *b = a + 1;
    cr_assert_not_null(a);
    run_open(a, fx_default_opts(), 1);
    run_open(b, fx_default_opts(), 1);
    uint64_t live = 0;
    for (uint32_t k = 0; k < 4; k++) {
        uint32_t rows = run_step(a, k, 0);
        cr_assert_eq(run_step(b, k, 5 + k), rows);
        live += rows;
        cr_assert_eq(memcmp(a->logits, b->logits, rows * vocab_of(&a->f) * sizeof(float)), 0,
                     "step %u: logits differ", k);
    }
    uint32_t L = a->f.c->n_layers;
    cr_assert_eq(b->counts.rows, live * L, "the hook got %llu rows, the steps had %llu live rows "
                 "in each of %u layers", (unsigned long long)b->counts.rows,
                 (unsigned long long)live, L);
    cr_assert_eq(memcmp(a->counts.n, b->counts.n, sizeof(a->counts.n)), 0,
                 "per-expert loads differ with padding");
    uint64_t picks = 0;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t x = 0; x < 64; x++)
            picks += b->counts.n[l][x];
    cr_assert_eq(picks, live * L * a->f.c->n_activated_experts);
    run_close(a);
    run_close(b);
    free(a);
}

Test(placeholder, a_step_of_placeholder_rows_writes_nothing, .timeout = 120)
{
    fx f;
    fx_open_opts(&f, "tiny", 43, fx_default_opts(), 64, 8);
    fx_seq s;
    fx_seq_new(&f, &s, 300, 5);
    fx_step1(&f, &s, 40, NULL); /* KV and slots not all zero */
    size_t kb = (size_t)f.kv->n_blocks * f.kv->block_bytes, sb = (size_t)f.kv->n_slots * f.kv->slot_bytes;
    uint8_t *blocks = malloc(kb), *slots = malloc(sb);
    cr_assert(blocks && slots);
    memcpy(blocks, f.kv->blocks, kb);
    memcpy(slots, f.kv->slots, sb);
    /* 140 rows: past the ring (134 positions), groups of every ratio complete, compressed
     * entries of ratio 1 visible to the indexer if they were stored; two sequences of them */
    fwd_seq q[2] = {placeholder(140), placeholder(3)};
    fwd_step st = {.n_seqs = 2, .seqs = q};
    di_error e;
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, NULL, &e), DI_OK, "%s", e.msg);
    const float *kept = (const float *)&e;
    cr_assert_eq(fwd_step_run_keep(f.run, f.kv, &st, &kept, &e), DI_OK, "%s", e.msg);
    cr_assert_null(kept, "no logits for a step of placeholder rows");
    cr_assert_eq(memcmp(blocks, f.kv->blocks, kb), 0, "placeholder rows wrote KV blocks");
    cr_assert_eq(memcmp(slots, f.kv->slots, sb), 0, "placeholder rows wrote state slots");
    /* the sequence goes on as if the placeholder steps had not run */
    size_t V = f.c->vocab_size;
    float *l1 = malloc(V * 4), *l2 = malloc(V * 4);
    cr_assert(l1 && l2);
    fx_step1(&f, &s, 1, l1);
    fx g;
    fx_open_opts(&g, "tiny", 43, fx_default_opts(), 64, 8);
    fx_seq s2;
    fx_seq_new(&g, &s2, 300, 5);
    fx_step1(&g, &s2, 40, NULL);
    fx_step1(&g, &s2, 1, l2);
    cr_assert_eq(memcmp(l1, l2, V * 4), 0, "logits after placeholder steps differ");
    free(l1);
    free(l2);
    free(blocks);
    free(slots);
    fx_close(&g);
    fx_close(&f);
}

Test(placeholder, bad_placeholder_steps_are_refused, .timeout = 60)
{
    fx f;
    fwd_options o = fx_default_opts();
    o.max_rows = 16;
    fx_open_opts(&f, "tiny", 47, o, 16, 4);
    fx_seq s;
    fx_seq_new(&f, &s, 64, 5);
    fwd_seq q[3] = {fx_rows(&f, &s, 4), placeholder(4), fx_rows(&f, &s, 4)};
    float logits[1];
    int32_t lr[1] = {5};
    di_error e;
    fwd_step st = {.n_seqs = 2, .seqs = q, .n_logit_rows = 1, .logit_rows = lr};
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, logits, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "logit row 5 is a placeholder row") != NULL, "%s", e.msg);
    q[2].slot = s.slot + 1;
    st = (fwd_step){.n_seqs = 3, .seqs = q};
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "sequence 2 follows placeholder rows") != NULL, "%s", e.msg);
    q[1].n_rows = 0;
    st = (fwd_step){.n_seqs = 2, .seqs = q};
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "sequence 1: no placeholder rows") != NULL, "%s", e.msg);
    q[1].n_rows = 13; /* 4 + 13 > max_rows 16 */
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "17 rows exceeds max_rows 16") != NULL, "%s", e.msg);
    q[1].n_rows = 12;
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, NULL, &e), DI_OK, "%s", e.msg);
    fx_close(&f);
}

/* ---- the executor ---- */

typedef struct row_log {
    uint32_t rows[16];          /* rows of each step (from the first layer's attention input) */
    uint32_t n;
} row_log;

static void log_rows(void *ud, const fwd_tensor *t)
{
    row_log *l = ud;
    if (t->layer == 0 && strcmp(t->name, "attn_in") == 0 && l->n < 16)
        l->rows[l->n++] = (uint32_t)t->dims[0];
}

typedef struct exec_run {
    sched_seq_result res[5][2];
    int32_t toks[5][2];
    uint8_t *blocks, *slots;
    size_t kb, sb;
    row_log log;
} exec_run;

/* Two requests with 2 drafts a step (nextn 2): a prompt step of both, then four decode steps
 * of 1 + 2 rows each, planned on graphs of 8 rows (2 placeholder rows a step). */
static void run_exec(const runner_model *rm, const kern_backend *be, int pad_steps, exec_run *out)
{
    di_error e;
    runner_exec *ex = NULL;
    memset(&out->log, 0, sizeof(out->log));
    runner_exec_options o = {.fwd = {.nextn = 2, .max_rows = 128, .token_map_pad = -1,
                                     .dump = log_rows, .dump_userdata = &out->log},
                             .n_blocks = 5, .n_slots = 2, .pad_steps = pad_steps};
    cr_assert_eq(runner_exec_create(rm, be, &o, &ex, &e), DI_OK, "%s", e.msg);
    uint32_t V = rm->w->config.vocab_size;
    int32_t prompt[2][50];
    for (int r = 0; r < 2; r++) {
        for (int i = 0; i < 50; i++)
            prompt[r][i] = 3 + (i * (37 + 4 * r)) % (int32_t)(V - 3);
        runner_request q = {.id = (uint64_t)r + 1, .prompt = prompt[r], .prompt_len = 50,
                            .max_tokens = 32, .params = sampling_params_default()};
        q.params.temperature = 0.0f;
        cr_assert_eq(runner_exec_add(ex, &q, &e), DI_OK, "%s", e.msg);
    }
    const uint32_t tables[2][2] = {{1, 2}, {3, 4}};
    sched_seq_plan s[2];
    for (int r = 0; r < 2; r++)
        s[r] = (sched_seq_plan){.request_id = (uint64_t)r + 1, .seqlen_q = 50, .seqlen_k = 50,
                                .tokens = prompt[r], .block_table = tables[r], .n_blocks = 2,
                                .state_slot = r, .sample = true};
    sched_plan p = {.prompt_run = true, .n_seqs = 2, .seqs = s, .n_rows = 100};
    cr_assert_eq(runner_exec_step(ex, &p, out->res[0], &e), DI_OK, "%s", e.msg);
    int64_t len[2] = {50, 50};
    for (uint32_t k = 1; k < 5; k++) {
        int32_t tok[2][3];
        for (int r = 0; r < 2; r++) {
            const sched_seq_result *prev = &out->res[k - 1][r];
            cr_assert_eq(prev->status, SCHED_RESULT_OK);
            cr_assert(prev->n_tokens >= 1);
            len[r] += k == 1 ? 0 : prev->n_tokens;
            uint32_t nd = 0;
            const int32_t *d = runner_exec_drafts(ex, (uint64_t)r + 1, &nd);
            cr_assert_eq(nd, 2);
            tok[r][0] = prev->tokens[prev->n_tokens - 1];
            tok[r][1] = d[0];
            tok[r][2] = d[1];
            s[r].seqlen_q = 3;
            s[r].first_position = len[r];
            s[r].seqlen_k = (uint32_t)len[r] + 3;
            s[r].tokens = tok[r];
        }
        sched_plan d = {.step = k, .n_seqs = 2, .seqs = s, .n_rows = 6, .graph_rows = 8,
                        .padding_rows = 2};
        cr_assert_eq(runner_exec_step(ex, &d, out->res[k], &e), DI_OK, "%s", e.msg);
        for (int r = 0; r < 2; r++)
            out->toks[k][r] = out->res[k][r].tokens[0];
    }
    fwd_kv *kv = runner_exec_kv(ex);
    out->kb = (size_t)kv->n_blocks * kv->block_bytes;
    out->sb = (size_t)kv->n_slots * kv->slot_bytes;
    out->blocks = malloc(out->kb);
    out->slots = malloc(out->sb);
    cr_assert(out->blocks && out->slots);
    memcpy(out->blocks, kv->blocks, out->kb);
    memcpy(out->slots, kv->slots, out->sb);
    runner_exec_free(ex);
}

Test(placeholder, the_executor_pads_decode_steps_to_the_graph_size, .timeout = 120)
{
    di_error e;
    kern_backend cpu;
    runner_model rm;
    cr_assert_eq(kern_cpu_create(2, &cpu, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(runner_model_random("tiny", 53, NULL, NULL, &rm, &e), DI_OK, "%s", e.msg);
    kern_backend graphs = cpu; /* a backend that says it keeps graphs */
    graphs.graphs = 1;
    exec_run *x = calloc(4, sizeof(exec_run));
    cr_assert_not_null(x);
    run_exec(&rm, &cpu, -1, &x[0]);    /* never */
    run_exec(&rm, &cpu, 0, &x[1]);     /* default on a backend without graphs: no padding */
    run_exec(&rm, &graphs, 0, &x[2]);  /* default with graphs: padded */
    run_exec(&rm, &cpu, 1, &x[3]);     /* always */
    static const uint32_t plain[5] = {100, 6, 6, 6, 6}, padded[5] = {100, 8, 8, 8, 8};
    for (int k = 0; k < 4; k++) {
        const uint32_t *want = k < 2 ? plain : padded;
        cr_assert_eq(x[k].log.n, 5, "run %d: %u steps", k, x[k].log.n);
        for (int i = 0; i < 5; i++)
            cr_assert_eq(x[k].log.rows[i], want[i], "run %d step %d: %u rows, want %u", k, i,
                         x[k].log.rows[i], want[i]);
    }
    for (int k = 1; k < 4; k++) {
        cr_assert_eq(memcmp(x[0].res, x[k].res, sizeof(x[0].res)), 0, "run %d: results differ", k);
        cr_assert_eq(memcmp(x[0].toks, x[k].toks, sizeof(x[0].toks)), 0, "run %d: tokens", k);
        cr_assert_eq(memcmp(x[0].blocks, x[k].blocks, x[0].kb), 0, "run %d: KV blocks differ", k);
        cr_assert_eq(memcmp(x[0].slots, x[k].slots, x[0].sb), 0, "run %d: state slots differ", k);
    }
    for (int k = 0; k < 4; k++) {
        free(x[k].blocks);
        free(x[k].slots);
    }
    free(x);
    runner_model_free(&rm);
    kern_cpu_destroy(&cpu);
}
