/* The engine against outputs of DeepSeek's published reference code (inference/model.py +
 * engram.py, rev dba1be0a, on the CPU) for the tiny released-format checkpoint in
 * tests/data/oracle/v41-tiny-b (README.md there): per prompt, the prefill logits of the last
 * position, 8 teacher-forced one-token decode steps and the DSpark drafts after each step.
 *
 * Tolerances come from the noise fields of expected.json (how far the SAME reference moves
 * under another torch thread count, plain torch.topk, or a fresh prefill instead of decode):
 *  - prompt 0 (7 tokens) is exact under every variant (0.0): every logit vector, the draft
 *    logits of step 0 and the confidence logits must be within BF16/FP8 rounding (TIGHT), and
 *    every argmax and draft token must agree;
 *  - prompts 1-3 move by up to 0.2-0.77 themselves, so they are compared robustly: with noise
 *    N = the largest of the prompt's fields, at least 7 of the 9 logit vectors within 2 N,
 *    the median correlation at least 0.95, the median top-20 overlap at least 13 of 20, and at
 *    least half of the comparable drafts the same (a draft is comparable while the drafts
 *    before it in its chain agree).
 * The figures are printed per prompt (cr_log_info) for the record.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/forward.h"
#include "common/model/runner.h"
#include "kernels/cpu/backend.h"

#define TIGHT 0.02          /* max-abs on prompt 0: a few BF16 steps of a logit near 4 */
#define N_STEPS 8
#define MAX_TOK 512
#define MAX_V 1024
#define MAX_DRAFT 8

typedef struct oracle {
    kern_backend be;
    runner_model rm;
    fwd_model *m;
    fwd_run *run;
    fwd_kv *kv;
    const model_config *c;
    json_t *doc;
} oracle;

typedef struct vec_cmp {
    double maxabs, corr;
    uint32_t top20;            /* overlap of the two top-20 sets */
    bool argmax_same;
} vec_cmp;

static const char *data_dir(void)
{
    static char dir[4096];
    const char *root = getenv("DI_SOURCE_ROOT");
    snprintf(dir, sizeof(dir), "%s/tests/data/oracle/v41-tiny-b", root ? root : ".");
    return dir;
}

static void oracle_open(oracle *o)
{
    di_error e;
    char path[4200];
    memset(o, 0, sizeof(*o));
    cr_assert_eq(kern_cpu_create(2, &o->be, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(runner_model_load(data_dir(), NULL, &o->rm, &e), DI_OK, "%s", e.msg);
    o->c = &o->rm.w->config;
    cr_assert(o->rm.token_map, "the checkpoint's engram_token_map.json is loaded");
    fwd_options opt = {.nextn = o->c->dspark_block_size, .max_rows = MAX_TOK,
                       .yoco = FWD_YOCO_OFF, .token_map = o->rm.token_map,
                       .token_map_pad = o->rm.token_map_pad};
    cr_assert_eq(fwd_model_create(o->rm.w, &o->be, &opt, &o->m, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(fwd_run_create(o->m, &o->run, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(fwd_kv_create(fwd_model_geometry(o->m), &o->be, 8, 1, &o->kv, &e), DI_OK, "%s",
                 e.msg);
    cr_assert(o->c->vocab_size <= MAX_V && o->c->dspark_block_size <= MAX_DRAFT);
    snprintf(path, sizeof(path), "%s/expected.json", data_dir());
    json_error_t je;
    o->doc = json_load_file(path, 0, &je);
    cr_assert(o->doc, "%s: %s", path, je.text);
}

static void oracle_close(oracle *o)
{
    json_decref(o->doc);
    fwd_kv_free(o->kv);
    fwd_run_free(o->run);
    fwd_model_free(o->m);
    runner_model_free(&o->rm);
    kern_cpu_destroy(&o->be);
}

static uint32_t ints(const json_t *a, int32_t *out, uint32_t cap)
{
    cr_assert(json_is_array(a) && json_array_size(a) <= cap);
    for (size_t i = 0; i < json_array_size(a); i++)
        out[i] = (int32_t)json_integer_value(json_array_get(a, i));
    return (uint32_t)json_array_size(a);
}

static void floats(const json_t *a, float *out, uint32_t n)
{
    cr_assert(json_is_array(a) && json_array_size(a) == n, "expected %u numbers", n);
    for (uint32_t i = 0; i < n; i++)
        out[i] = (float)json_number_value(json_array_get(a, i));
}

static uint32_t argmax(const float *v, uint32_t n)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

static void top20(const float *v, uint32_t n, uint8_t *in)
{
    memset(in, 0, n);
    for (uint32_t k = 0; k < 20 && k < n; k++) {
        uint32_t best = UINT32_MAX;
        for (uint32_t i = 0; i < n; i++)
            if (!in[i] && (best == UINT32_MAX || v[i] > v[best]))
                best = i;
        in[best] = 1;
    }
}

static vec_cmp compare(const float *got, const float *ref, uint32_t n)
{
    vec_cmp r = {0};
    double sg = 0, sr = 0, sgg = 0, srr = 0, sgr = 0;
    for (uint32_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        r.maxabs = d > r.maxabs ? d : r.maxabs;
        sg += got[i], sr += ref[i], sgg += (double)got[i] * got[i];
        srr += (double)ref[i] * ref[i], sgr += (double)got[i] * ref[i];
    }
    double cov = sgr - sg * sr / n, vg = sgg - sg * sg / n, vr = srr - sr * sr / n;
    r.corr = cov / sqrt(vg * vr);
    uint8_t a[MAX_V], b[MAX_V];
    top20(got, n, a);
    top20(ref, n, b);
    for (uint32_t i = 0; i < n; i++)
        r.top20 += a[i] && b[i];
    r.argmax_same = argmax(got, n) == argmax(ref, n);
    return r;
}

static di_status greedy(void *ud, uint32_t req, uint32_t i, const float *logits, uint32_t vocab,
                        int32_t *token)
{
    (void)ud, (void)req, (void)i;
    *token = (int32_t)argmax(logits, vocab);
    return DI_OK;
}

/* One step of `n` rows at positions pos .. pos+n-1 of the sequence toks; last row's logits. */
static void step(oracle *o, const int32_t *toks, int64_t pos, uint32_t n, float *logits)
{
    static const uint32_t blocks[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    uint32_t lb = o->c->n_engram_layers ? o->c->engram_max_ngram_size - 1 : 0;
    uint32_t h = pos < (int64_t)lb ? (uint32_t)pos : lb;
    fwd_seq q = {.n_rows = n, .pos0 = pos, .tokens = toks + pos, .history = toks + pos - h,
                 .n_history = h, .blocks = blocks, .n_blocks = 8, .slot = 0,
                 .prompt_len = pos == 0 ? n : 0};
    int32_t row = (int32_t)n - 1;
    fwd_step st = {.n_seqs = 1, .seqs = &q, .n_logit_rows = 1, .logit_rows = &row};
    di_error e;
    cr_assert_eq(fwd_step_run(o->run, o->kv, &st, logits, &e), DI_OK, "%s", e.msg);
}

/* Runs prompt i of expected.json and checks it (tight: prompt 0's rules). */
static void run_prompt(uint32_t pi)
{
    oracle o;
    oracle_open(&o);
    const json_t *p = json_array_get(json_object_get(o.doc, "prompts"), pi);
    cr_assert(p, "prompt %u in expected.json", pi);
    const uint32_t V = o.c->vocab_size, B = o.c->dspark_block_size;
    int32_t toks[MAX_TOK];
    uint32_t L = ints(json_object_get(p, "ids"), toks, MAX_TOK - N_STEPS - 1);
    int32_t forced[N_STEPS];
    cr_assert_eq(ints(json_object_get(p, "greedy_tokens"), forced, N_STEPS), N_STEPS);
    memcpy(toks + L, forced, sizeof(forced));

    /* noise: the largest of the reference's own spreads on this prompt */
    const json_t *pn = json_object_get(p, "prefill_noise");
    double noise = json_number_value(json_object_get(pn, "maxabs_with_plain_torch_topk"));
    const char *key;
    json_t *v;
    json_object_foreach(json_object_get(pn, "maxabs_vs_other_torch_thread_counts"), key, v)
        noise = fmax(noise, json_number_value(v));
    size_t k;
    json_array_foreach(json_object_get(p, "decode_vs_fresh_prefill_maxabs"), k, v)
        noise = fmax(noise, json_number_value(v));
    const bool tight = noise == 0.0;

    static float got[MAX_V], ref[MAX_V];
    vec_cmp vc[1 + N_STEPS];
    step(&o, toks, 0, L, got);
    floats(json_object_get(p, "prefill_logits"), ref, V);
    vc[0] = compare(got, ref, V);
    uint32_t draft_same = 0, draft_total = 0;
    double draft_maxabs = 0, conf_maxabs = 0;
    for (uint32_t s = 0; s < N_STEPS; s++) {
        const json_t *ds = json_array_get(json_object_get(p, "decode_steps"), s);
        cr_assert_eq(json_integer_value(json_object_get(ds, "position")), L + s);
        step(&o, toks, L + s, 1, got);
        floats(json_object_get(ds, "logits"), ref, V);
        vc[1 + s] = compare(got, ref, V);

        /* drafts after the main model processed position L + s */
        const json_t *dr = json_array_get(json_object_get(p, "drafts"), s);
        cr_assert_eq(json_integer_value(json_object_get(dr, "position")), L + s);
        fwd_draft_req rq = {.slot = 0, .pos = L + s,
                            .next = (int32_t)json_integer_value(json_object_get(dr, "next_token"))};
        int32_t dtok[MAX_DRAFT], want[MAX_DRAFT];
        static float dlog[MAX_DRAFT * MAX_V], rlog[MAX_V];
        float conf[MAX_DRAFT], cum[MAX_DRAFT], want_conf[MAX_DRAFT];
        fwd_draft_out out = {.tokens = dtok, .logits = dlog, .confidence = conf, .cumulative = cum};
        di_error e;
        cr_assert_eq(fwd_draft(o.run, o.kv, 1, &rq, B, greedy, NULL, &out, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(ints(json_object_get(dr, "draft_ids"), want, MAX_DRAFT), B);
        floats(json_object_get(dr, "confidence_logits"), want_conf, B);
        for (uint32_t i = 0; i < B; i++) {
            /* the drafts of a chain are comparable only while the chain agrees */
            bool chain = true;
            for (uint32_t j = 0; j < i; j++)
                chain = chain && dtok[j] == want[j];
            if (!chain)
                break;
            draft_total++;
            draft_same += dtok[i] == want[i];
            double c = log((double)conf[i] / (1.0 - conf[i]));
            conf_maxabs = fmax(conf_maxabs, fabs(c - want_conf[i]));
        }
        if (s == 0) {
            const json_t *dl = json_object_get(dr, "draft_logits_step0");
            /* logits i depend on the drafts before i (Markov correction) */
            for (uint32_t i = 0; i < B && (i == 0 || dtok[i - 1] == want[i - 1]); i++) {
                floats(json_array_get(dl, i), rlog, V);
                draft_maxabs = fmax(draft_maxabs, compare(dlog + (size_t)i * V, rlog, V).maxabs);
            }
        }
    }

    /* the record */
    char line[1024];
    size_t at = 0;
    uint32_t n_argmax = 0, within = 0;
    double corr[1 + N_STEPS], top[1 + N_STEPS], worst = 0;
    for (uint32_t i = 0; i < 1 + N_STEPS; i++) {
        at += (size_t)snprintf(line + at, sizeof(line) - at, " %.3f/%.4f", vc[i].maxabs, vc[i].corr);
        n_argmax += vc[i].argmax_same;
        within += vc[i].maxabs <= 2 * noise;
        corr[i] = vc[i].corr;
        top[i] = vc[i].top20;
        worst = fmax(worst, vc[i].maxabs);
    }
    for (uint32_t i = 0; i < 1 + N_STEPS; i++) /* sort for the medians */
        for (uint32_t j = i + 1; j < 1 + N_STEPS; j++) {
            if (corr[j] < corr[i]) {
                double t = corr[i]; corr[i] = corr[j]; corr[j] = t;
            }
            if (top[j] < top[i]) {
                double t = top[i]; top[i] = top[j]; top[j] = t;
            }
        }
    cr_log_info("oracle prompt %u (%u tokens, noise %.3f): max-abs/corr prefill, 8 decode steps:%s;"
                " argmax %u/9; median top-20 overlap %.0f; drafts %u/%u same, draft logits step 0"
                " max-abs %.4f, confidence logits max-abs %.4f", pi, L, noise, line, n_argmax,
                top[N_STEPS / 2], draft_same, draft_total, draft_maxabs, conf_maxabs);
    if (tight) {
        cr_expect(worst <= TIGHT, "prompt %u: logits max-abs %.4f > %.3f:%s", pi, worst, TIGHT, line);
        cr_expect_eq(n_argmax, 1 + N_STEPS, "prompt %u: argmax agrees on %u of 9", pi, n_argmax);
        cr_expect(draft_same == draft_total && draft_total == N_STEPS * B,
                  "prompt %u: drafts agree on %u of %u (of %u)", pi, draft_same, draft_total,
                  N_STEPS * B);
        cr_expect(draft_maxabs <= TIGHT, "prompt %u: draft logits max-abs %.4f", pi, draft_maxabs);
        cr_expect(conf_maxabs <= TIGHT, "prompt %u: confidence max-abs %.4f", pi, conf_maxabs);
    } else {
        cr_expect(within >= 7, "prompt %u: %u of 9 logit vectors within 2 x noise %.3f:%s", pi,
                  within, noise, line);
        cr_expect(corr[N_STEPS / 2] >= 0.95, "prompt %u: median correlation %.4f", pi,
                  corr[N_STEPS / 2]);
        cr_expect(top[N_STEPS / 2] >= 13, "prompt %u: median top-20 overlap %.0f", pi,
                  top[N_STEPS / 2]);
        cr_expect(2 * draft_same >= draft_total && draft_total > 0,
                  "prompt %u: drafts agree on %u of %u", pi, draft_same, draft_total);
    }
    oracle_close(&o);
}

Test(oracle, prompt0_exact, .timeout = 120)
{
    run_prompt(0);
}

Test(oracle, prompt1_robust, .timeout = 120)
{
    run_prompt(1);
}

Test(oracle, prompt2_robust, .timeout = 120)
{
    run_prompt(2);
}

Test(oracle, prompt3_robust, .timeout = 120)
{
    run_prompt(3);
}
