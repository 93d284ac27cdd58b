/* The forward pass end to end on the tiny config: decode equals prefill bit for bit, batch
 * invariance, the KV bytes it writes, YOCO modes, the draft model, and refused inputs. */
#include <math.h>

#include "common/model/state.h"
#include "tests/forward/fwd_fixture.h"

#define N_PROMPT 300

static size_t vocab(const fx *f)
{
    return f->c->vocab_size;
}

/* Bit-for-bit comparison of two logits rows, with the first difference on failure. */
static void same_row(const float *a, const float *b, size_t n, const char *what, int64_t pos)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4) != 0)
            cr_assert_fail("%s: position %lld logit %zu: %.9g vs %.9g", what, (long long)pos, i,
                           a[i], b[i]);
}

Test(forward, prefill_logits_are_finite_and_reproducible, .timeout = 60)
{
    fx f;
    fx_open(&f, 7);
    fx_seq a, b;
    fx_seq_new(&f, &a, 40, 1);
    fx_seq_new(&f, &b, 40, 1);
    float *la = malloc(40 * vocab(&f) * 4), *lb = malloc(40 * vocab(&f) * 4);
    fx_step1(&f, &a, 40, la);
    fx_step1(&f, &b, 40, lb);
    double spread = 0;
    for (size_t i = 0; i < 40 * vocab(&f); i++) {
        cr_assert(isfinite(la[i]));
        spread += fabs(la[i] - la[i % vocab(&f)]);
    }
    cr_assert(spread > 0, "different positions give different logits");
    same_row(la, lb, 40 * vocab(&f), "second run", 0);
    free(la);
    free(lb);
    fx_close(&f);
}

/* One prefill over N tokens is the reference; token-by-token decode, chunked prefill across
 * block boundaries and 1 + nextn row decode steps must give the same bits at every position. */
Test(forward, decode_chunks_and_multi_row_steps_equal_one_prefill, .timeout = 120)
{
    fx f;
    fx_open(&f, 11);
    size_t V = vocab(&f);
    fx_seq ref, dec, chk, mtp;
    fx_seq_new(&f, &ref, N_PROMPT, 5);
    fx_seq_new(&f, &dec, N_PROMPT, 5);
    fx_seq_new(&f, &chk, N_PROMPT, 5);
    fx_seq_new(&f, &mtp, N_PROMPT, 5);
    float *lr = malloc(N_PROMPT * V * 4), *l = malloc(N_PROMPT * V * 4);
    fx_step1(&f, &ref, N_PROMPT, lr);
    /* token by token */
    for (int64_t p = 0; p < N_PROMPT; p++) {
        fx_step1(&f, &dec, 1, l);
        same_row(l, lr + p * V, V, "single-row decode", p);
    }
    /* chunks crossing the 128-token blocks and the 134-slot ring */
    static const uint32_t chunks[] = {7, 121, 1, 2, 64, 50, 55};
    int64_t p = 0;
    for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
        fx_step1(&f, &chk, chunks[c], l);
        for (uint32_t i = 0; i < chunks[c]; i++, p++)
            same_row(l + i * V, lr + p * V, V, "chunked prefill", p);
    }
    cr_assert_eq(p, N_PROMPT);
    /* a prefill of 100, then decode steps of 1 + nextn = 6 rows, and a final partial one */
    fx_step1(&f, &mtp, 100, NULL);
    for (p = 100; p < N_PROMPT;) {
        uint32_t n = N_PROMPT - p < 6 ? (uint32_t)(N_PROMPT - p) : 6;
        fx_step1(&f, &mtp, n, l);
        for (uint32_t i = 0; i < n; i++, p++)
            same_row(l + i * V, lr + p * V, V, "1 + nextn rows", p);
    }
    free(lr);
    free(l);
    fx_close(&f);
}

/* Rejected drafts write KV at positions the next step overwrites: a step that writes 6 rows,
 * of which only 2 are kept, followed by steps from the third, gives the same logits as if the
 * wrong rows had never been written. */
Test(forward, rejected_draft_rows_are_overwritten_without_effect, .timeout = 60)
{
    fx f;
    fx_open(&f, 13);
    size_t V = vocab(&f);
    fx_seq ref, spec;
    fx_seq_new(&f, &ref, 260, 8);
    fx_seq_new(&f, &spec, 260, 8);
    float *lr = malloc(260 * V * 4), *l = malloc(6 * V * 4);
    fx_step1(&f, &ref, 260, lr);
    fx_step1(&f, &spec, 150, NULL);
    for (int round = 0; round < 15; round++) {
        /* 6 rows where rows 2..5 carry wrong tokens (rejected drafts) */
        int32_t keep[6];
        memcpy(keep, spec.toks + spec.len, sizeof(keep));
        for (int i = 2; i < 6; i++)
            spec.toks[spec.len + i] = 3 + (spec.toks[spec.len + i] + 17 * round) % 4000;
        int64_t p0 = spec.len;
        fx_step1(&f, &spec, 6, l);
        memcpy(spec.toks + p0, keep, sizeof(keep));
        spec.len = p0 + 2; /* commit 2 */
        for (int i = 0; i < 2; i++)
            same_row(l + i * V, lr + (p0 + i) * V, V, "accepted rows", p0 + i);
    }
    for (int64_t p = spec.len; p < 260; p++) {
        fx_step1(&f, &spec, 1, l);
        same_row(l, lr + p * V, V, "after rejections", p);
    }
    free(lr);
    free(l);
    fx_close(&f);
}

/* A request's logits alone equal its logits in a batch with 64 other requests at other
 * positions (prefill and decode steps mixed with them). */
Test(forward, batch_invariance_with_64_other_requests, .timeout = 120)
{
    fx f;
    fx_open(&f, 17);
    size_t V = vocab(&f);
    fx_seq solo, mine, other[64];
    fx_seq_new(&f, &solo, 160, 3);
    fx_seq_new(&f, &mine, 160, 3);
    float *ls = malloc(3 * V * 4), *lb = malloc(400 * V * 4);
    fx_step1(&f, &solo, 150, NULL);
    fx_step1(&f, &solo, 3, ls);
    di_rng r;
    di_rng_init(&r, 99);
    for (int i = 0; i < 64; i++)
        fx_seq_new(&f, &other[i], 140, 1000 + (uint64_t)i);
    /* batched prefill: mine with the first 10 others, then the rest in groups of 18 */
    for (int g = 0; g < 4; g++) {
        fwd_seq q[20];
        uint32_t n = 0;
        if (g == 0)
            q[n++] = fx_rows(&f, &mine, 150);
        int lo = g == 0 ? 0 : 10 + (g - 1) * 18, hi = g == 0 ? 10 : lo + 18;
        for (int i = lo; i < hi && i < 64; i++) {
            uint32_t len = 1 + (uint32_t)di_rng_below(&r, 130);
            q[n++] = fx_rows(&f, &other[i], len);
        }
        fwd_step st = {.n_seqs = n, .seqs = q};
        di_error e;
        cr_assert_eq(fwd_step_run(f.run, f.kv, &st, NULL, &e), DI_OK, "%s", e.msg);
        if (g == 0)
            mine.len += 150;
        for (uint32_t k = (g == 0); k < n; k++)
            other[lo + (int)k - (g == 0)].len += q[k].n_rows;
    }
    /* decode step: 3 rows of mine among 64 others of 1..6 rows, mine in the middle */
    fwd_seq q[65];
    int32_t rows[3];
    uint32_t n = 0, t = 0;
    for (int i = 0; i < 64; i++) {
        if (i == 32) {
            for (int k = 0; k < 3; k++)
                rows[k] = (int32_t)(t + (uint32_t)k);
            q[n++] = fx_rows(&f, &mine, 3);
            t += 3;
        }
        uint32_t len = 1 + (uint32_t)di_rng_below(&r, 6);
        q[n++] = fx_rows(&f, &other[i], len);
        t += len;
    }
    fwd_step st = {.n_seqs = n, .seqs = q, .n_logit_rows = 3, .logit_rows = rows};
    di_error e;
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, lb, &e), DI_OK, "%s", e.msg);
    for (int k = 0; k < 3; k++)
        same_row(lb + k * V, ls + k * V, V, "in a batch of 65", 150 + k);
    free(ls);
    free(lb);
    fx_close(&f);
}

/* ---- KV layout ---- */

typedef struct capture {
    int32_t layer;
    const char *name;
    uint16_t *data;
    uint64_t rows, cols;
} capture;

static void grab(void *ud, const fwd_tensor *t)
{
    capture *c = ud;
    if (t->layer != c->layer || strcmp(t->name, c->name) != 0 || t->dtype != FWD_BF16)
        return;
    free(c->data);
    c->rows = t->dims[0];
    c->cols = t->dims[1];
    c->data = malloc(c->rows * c->cols * 2);
    memcpy(c->data, t->data, c->rows * c->cols * 2);
}

Test(forward, ring_and_block_bytes_decode_to_the_values_the_forward_used, .timeout = 60)
{
    capture win = {.layer = 3, .name = "attn.kv"};
    fwd_options o = fx_default_opts();
    o.dump = grab;
    o.dump_userdata = &win;
    fx f;
    fx_open_opts(&f, "tiny", 19, o, 64, 4);
    const kv_geometry *g = fwd_model_geometry(f.m);
    fx_seq s;
    fx_seq_new(&f, &s, 200, 4);
    fx_step1(&f, &s, 200, NULL);
    cr_assert_eq(win.rows, 200);
    uint32_t hd = g->head_dim;
    const uint8_t *slot = fwd_kv_slot(f.kv, s.slot);
    /* the ring of layer 3 holds positions 66..199 at slot p mod 134 */
    cr_assert_eq(g->ring_positions, 134);
    for (int64_t p = 200 - 134; p < 200; p++) {
        const uint8_t *e = slot + state_ring_offset(g, 3) + (p % 134) * kv_ring_entry_bytes(g);
        float dec[64], want[64];
        di_dequant_fp8_b32(e, e + hd, hd, dec);
        for (uint32_t i = 0; i < hd; i++)
            want[i] = di_bf16_to_f32(win.data[p * hd + i]);
        di_fakequant_fp8_b32(want, hd);
        cr_assert_eq(memcmp(dec, want, hd * 4), 0, "ring entry of position %lld", (long long)p);
    }
    free(win.data);
    fx_close(&f);
}

Test(forward, compressed_entries_in_blocks_are_the_pooled_normed_roped_latents, .timeout = 60)
{
    capture lat = {.layer = 2, .name = "compress.main"};
    fwd_options o = fx_default_opts();
    o.dump = grab;
    o.dump_userdata = &lat;
    fx f;
    fx_open_opts(&f, "tiny", 23, o, 64, 4);
    const kv_geometry *g = fwd_model_geometry(f.m);
    fx_seq s;
    fx_seq_new(&f, &s, 301, 6);
    /* two chunks: the group (170, 171) straddles them through the pending state */
    fx_step1(&f, &s, 171, NULL);
    uint64_t first = lat.rows;
    cr_assert_eq(first, 85, "171 tokens complete 85 pairs");
    fx_step1(&f, &s, 130, NULL);
    cr_assert_eq(lat.rows, 65, "positions 171..300 complete entries 85..149");
    uint32_t hd = g->head_dim;
    /* layer 2 is owner 0 (ratio 2, 64 entries per block): entry j in block j/64 at j%64 */
    for (uint32_t k = 0; k < lat.rows; k++) {
        uint64_t j = 85 + k;
        uint32_t blk = state_entry_block(g, 0, j), off = state_entry_offset(g, 0, j);
        const uint8_t *e = fwd_kv_block(f.kv, s.blocks[blk]) + kv_owner_main_offset(g, 0, off);
        float dec[64], want[64];
        di_dequant_fp4_b16(e, e + hd / 2, hd, dec);
        for (uint32_t i = 0; i < hd; i++)
            want[i] = di_bf16_to_f32(lat.data[k * hd + i]);
        di_fakequant_fp4_b16(want, hd);
        cr_assert_eq(memcmp(dec, want, hd * 4), 0, "entry %llu", (unsigned long long)j);
    }
    free(lat.data);
    fx_close(&f);
}

Test(forward, slot_layout_on_the_full_geometry)
{
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    /* position 16,389 -> ring slot 41; entry 8,194 of the ratio-2 owner -> block 128 offset 2;
     * entry 16,389 of the ratio-1 owner -> block 128 offset 5 (explainer, "What goes in") */
    cr_assert_eq(kv_ring_slot(&g, 16389), 41);
    cr_assert_eq(state_entry_block(&g, 0, 8194), 128);
    cr_assert_eq(state_entry_offset(&g, 0, 8194), 2);
    cr_assert_eq(state_entry_block(&g, 3, 16389), 128);
    cr_assert_eq(state_entry_offset(&g, 3, 16389), 5);
    /* rings of 40 layers and 3 stages, then 3 pending-token rings of 7 tokens */
    cr_assert_eq(state_ring_offset(&g, 39), 39 * 134 * 528);
    cr_assert_eq(state_draft_ring_offset(&g, 0), 40 * 134 * 528);
    cr_assert_eq(state_compressor_tokens(&g, 0), 7, "ratio + 5 slots (explainer)");
    cr_assert_eq(state_compressor_offset(&g, 2), 43 * 134 * 528 + 2 * 7 * 2 * 512 * 4);
    cr_assert_eq(state_compressor_offset(&g, 2) + 7 * 2 * 512 * 4, kv_state_slot_bytes(&g),
                 "the slot ends with the last owner's pending tokens");
    cr_assert_eq(kv_ring_bytes(&g) * 20, 1415040, "layers below the boundary: 1,415,040 bytes");
}

/* ---- YOCO truncation ---- */

static void open_yoco(fx *f, fwd_yoco mode, uint32_t keep)
{
    fwd_options o = fx_default_opts();
    o.yoco = mode;
    o.keep_tokens = keep;
    fx_open_opts(f, "tiny", 29, o, 64, 8);
}

/* Prompt of 300 in chunks (one wholly before the keep window), keep 140: compact and mask
 * give the same logits on the kept rows, and the same decode logits afterwards. */
Test(forward, yoco_compact_equals_mask_on_kept_rows_and_after, .timeout = 120)
{
    fx fc, fm, fo;
    open_yoco(&fc, FWD_YOCO_COMPACT, 140);
    open_yoco(&fm, FWD_YOCO_MASK, 140);
    open_yoco(&fo, FWD_YOCO_OFF, 0);
    size_t V = vocab(&fc);
    fx *all[3] = {&fc, &fm, &fo};
    fx_seq s[3];
    float *l[3];
    static const uint32_t chunks[] = {100, 90, 110}; /* keep window starts at 160 */
    for (int k = 0; k < 3; k++) {
        fx_seq_new(all[k], &s[k], 310, 42);
        s[k].prompt_len = 300;
        l[k] = malloc(110 * V * 4);
        for (int c = 0; c < 3; c++)
            fx_step1(all[k], &s[k], chunks[c], c == 2 ? l[k] : NULL);
    }
    /* the last chunk is positions 190..299, all kept */
    same_row(l[0], l[1], 110 * V, "compact vs mask, kept prompt rows", 190);
    int differs = memcmp(l[0], l[2], 110 * V * 4) != 0;
    cr_assert(differs, "truncation changes the kept rows' logits (windows are clipped)");
    for (int k = 0; k < 3; k++)
        s[k].prompt_len = 0;
    for (int step = 0; step < 8; step++) {
        for (int k = 0; k < 2; k++)
            fx_step1(all[k], &s[k], 1, l[k]);
        same_row(l[0], l[1], V, "compact vs mask, decode", s[0].len - 1);
    }
    for (int k = 0; k < 3; k++) {
        free(l[k]);
        fx_close(all[k]);
    }
}

Test(forward, yoco_compact_refuses_logits_of_dropped_prompt_rows, .timeout = 60)
{
    fx f;
    open_yoco(&f, FWD_YOCO_COMPACT, 140);
    fx_seq s;
    fx_seq_new(&f, &s, 300, 43);
    s.prompt_len = 300;
    fwd_seq q = fx_rows(&f, &s, 300);
    int32_t rows[2] = {299, 10};
    float *l = malloc(2 * vocab(&f) * 4);
    fwd_step st = {.n_seqs = 1, .seqs = &q, .n_logit_rows = 2, .logit_rows = rows};
    di_error e;
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, l, &e), DI_EUNSUPPORTED);
    cr_assert(strstr(e.msg, "prompt logprobs") != NULL, "%s", e.msg);
    st.n_logit_rows = 1; /* the last row alone is fine */
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, l, &e), DI_OK, "%s", e.msg);
    free(l);
    fx_close(&f);
}

Test(forward, yoco_keep_tokens_below_the_ring_is_rejected, .timeout = 60)
{
    kern_backend be;
    runner_model rm;
    di_error e;
    cr_assert_eq(kern_cpu_create(1, &be, &e), DI_OK);
    cr_assert_eq(runner_model_random("tiny", 1, NULL, NULL, &rm, &e), DI_OK, "%s", e.msg);
    fwd_options o = fx_default_opts();
    fwd_model *m = NULL;
    for (int mode = FWD_YOCO_COMPACT; mode <= FWD_YOCO_MASK; mode++) {
        o.yoco = (fwd_yoco)mode;
        o.keep_tokens = 133; /* ring = 128 + 5 + 1 = 134 */
        cr_assert_eq(fwd_model_create(rm.w, &be, &o, &m, &e), DI_EINVAL);
        cr_assert(strstr(e.msg, "134") != NULL, "%s", e.msg);
        cr_assert_null(m);
        o.keep_tokens = 134;
        cr_assert_eq(fwd_model_create(rm.w, &be, &o, &m, &e), DI_OK, "%s", e.msg);
        fwd_model_free(m);
        m = NULL;
    }
    runner_model_free(&rm);
    kern_cpu_destroy(&be);
}

/* ---- draft model ---- */

static di_status greedy(void *ud, uint32_t req, uint32_t i, const float *logits, uint32_t V,
                        int32_t *tok)
{
    uint32_t best = 0;
    for (uint32_t v = 1; v < V; v++)
        if (logits[v] > logits[best])
            best = v;
    *tok = (int32_t)best;
    (*(int *)ud)++;
    return DI_OK;
}

static void propose(fx *f, fx_seq *s, int32_t *tok, float *conf, float *cum, float *logits)
{
    fwd_draft_req q = {.slot = s->slot, .pos = s->len - 1, .next = s->toks[s->len]};
    fwd_draft_out out = {.tokens = tok, .logits = logits, .confidence = conf, .cumulative = cum};
    int calls = 0;
    di_error e;
    cr_assert_eq(fwd_draft(f->run, f->kv, 1, &q, 5, greedy, &calls, &out, &e), DI_OK, "%s",
                 e.msg);
    cr_assert_eq(calls, 5, "one sampler call per draft");
}

Test(forward, draft_confidences_are_probabilities_and_the_draft_is_deterministic, .timeout = 60)
{
    fx f1, f2;
    fx_open(&f1, 31);
    fx_open(&f2, 31);
    fx_seq a, b;
    fx_seq_new(&f1, &a, 200, 9);
    fx_seq_new(&f2, &b, 200, 9);
    fx_step1(&f1, &a, 150, NULL);
    fx_step1(&f2, &b, 150, NULL);
    int32_t t1[5], t2[5];
    float c1[5], c2[5], u1[5], u2[5];
    size_t V = vocab(&f1);
    float *l1 = malloc(5 * V * 4), *l2 = malloc(5 * V * 4);
    propose(&f1, &a, t1, c1, u1, l1);
    propose(&f2, &b, t2, c2, u2, l2);
    for (int i = 0; i < 5; i++) {
        cr_assert(c1[i] > 0.0f && c1[i] < 1.0f, "confidence %d = %g", i, c1[i]);
        cr_assert(u1[i] <= (i ? u1[i - 1] : 1.0f), "cumulative products never increase");
        cr_assert(t1[i] >= 0 && (uint32_t)t1[i] < V);
    }
    cr_assert_eq(memcmp(t1, t2, sizeof(t1)), 0, "same seed, same drafts");
    cr_assert_eq(memcmp(c1, c2, sizeof(c1)), 0);
    cr_assert_eq(memcmp(l1, l2, 5 * V * 4), 0);
    /* proposing again from the same state gives the same result (the draft writes no KV) */
    int32_t t3[5];
    float c3[5], u3[5];
    propose(&f1, &a, t3, c3, u3, l2);
    cr_assert_eq(memcmp(t1, t3, sizeof(t1)), 0);
    cr_assert_eq(memcmp(l1, l2, 5 * V * 4), 0);
    /* a different context changes the drafts' logits */
    fx_step1(&f1, &a, 1, NULL);
    propose(&f1, &a, t3, c3, u3, l2);
    cr_assert_neq(memcmp(l1, l2, 5 * V * 4), 0);
    free(l1);
    free(l2);
    fx_close(&f1);
    fx_close(&f2);
}

Test(forward, draft_of_a_request_is_independent_of_its_batch, .timeout = 60)
{
    fx f;
    fx_open(&f, 37);
    fx_seq a, b;
    fx_seq_new(&f, &a, 200, 10);
    fx_seq_new(&f, &b, 200, 11);
    fx_step1(&f, &a, 170, NULL);
    fx_step1(&f, &b, 90, NULL);
    size_t V = vocab(&f);
    int32_t t1[5], t2[10];
    float c1[5], u1[5], c2[10], u2[10];
    float *l1 = malloc(5 * V * 4), *l2 = malloc(10 * V * 4);
    propose(&f, &a, t1, c1, u1, l1);
    fwd_draft_req q[2] = {{.slot = b.slot, .pos = b.len - 1, .next = b.toks[b.len]},
                          {.slot = a.slot, .pos = a.len - 1, .next = a.toks[a.len]}};
    fwd_draft_out out = {.tokens = t2, .logits = l2, .confidence = c2, .cumulative = u2};
    int calls = 0;
    di_error e;
    cr_assert_eq(fwd_draft(f.run, f.kv, 2, q, 5, greedy, &calls, &out, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(memcmp(t1, t2 + 5, sizeof(t1)), 0);
    cr_assert_eq(memcmp(c1, c2 + 5, sizeof(c1)), 0);
    cr_assert_eq(memcmp(l1, l2 + 5 * V, 5 * V * 4), 0);
    free(l1);
    free(l2);
    fx_close(&f);
}

/* ---- refused inputs ---- */

Test(forward, bad_steps_are_refused_with_the_rule, .timeout = 60)
{
    fx f;
    fx_open(&f, 41);
    fx_seq s, t;
    fx_seq_new(&f, &s, 20, 12);
    fx_seq_new(&f, &t, 20, 13);
    fwd_seq q = fx_rows(&f, &s, 10);
    fwd_step st = {.n_seqs = 1, .seqs = &q};
    di_error e;
    int32_t bad[10];
    memcpy(bad, s.toks, sizeof(bad));
    bad[4] = (int32_t)f.c->vocab_size;
    q.tokens = bad;
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "outside the vocabulary") != NULL, "%s", e.msg);
    q = fx_rows(&f, &s, 10);
    q.n_blocks = 0;
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "block table") != NULL, "%s", e.msg);
    q = fx_rows(&f, &s, 10);
    q.slot = 9999;
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, NULL, &e), DI_EINVAL);
    q = fx_rows(&f, &s, 10);
    q.pos0 = 5;
    q.n_history = 0; /* position 5 needs 2 lookback tokens */
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "history") != NULL, "%s", e.msg);
    q = fx_rows(&f, &s, 10);
    q.pos0 = (int64_t)f.c->max_position_embeddings;
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "context limit") != NULL, "%s", e.msg);
    fwd_seq two[2] = {fx_rows(&f, &s, 5), fx_rows(&f, &t, 5)};
    two[1].slot = two[0].slot;
    fwd_step st2 = {.n_seqs = 2, .seqs = two};
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st2, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "share state slot") != NULL, "%s", e.msg);
    q = fx_rows(&f, &s, 10);
    int32_t rows[1] = {10};
    float logits[1];
    fwd_step st3 = {.n_seqs = 1, .seqs = &q, .n_logit_rows = 1, .logit_rows = rows};
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st3, logits, &e), DI_EINVAL);
    cr_assert_eq(fwd_step_run(f.run, f.kv, NULL, NULL, &e), DI_EINVAL);
    fx_close(&f);
}

Test(forward, bad_model_options_are_refused, .timeout = 60)
{
    kern_backend be;
    runner_model rm;
    di_error e;
    cr_assert_eq(kern_cpu_create(1, &be, &e), DI_OK);
    cr_assert_eq(runner_model_random("tiny", 1, NULL, NULL, &rm, &e), DI_OK, "%s", e.msg);
    fwd_model *m = NULL;
    fwd_options o = fx_default_opts();
    o.nextn = 6; /* the draft block is 5 */
    cr_assert_eq(fwd_model_create(rm.w, &be, &o, &m, &e), DI_EINVAL);
    o = fx_default_opts();
    o.max_rows = 0;
    cr_assert_eq(fwd_model_create(rm.w, &be, &o, &m, &e), DI_EINVAL);
    o = fx_default_opts();
    int32_t *map = calloc(rm.w->config.vocab_size, sizeof(int32_t));
    map[7] = (int32_t)rm.w->config.engram_compressed_vocab_size;
    o.token_map = map;
    cr_assert_eq(fwd_model_create(rm.w, &be, &o, &m, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "token 7") != NULL, "%s", e.msg);
    /* a weight missing from the checkpoint view */
    model_weights *w = rm.w;
    model_tensor saved = w->layers[3].attn.wq_b;
    w->layers[3].attn.wq_b.fmt = MODEL_WFMT_NONE;
    o.token_map = NULL;
    cr_assert_eq(fwd_model_create(w, &be, &o, &m, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "layer 3") && strstr(e.msg, "wq_b") && strstr(e.msg, "missing"),
              "%s", e.msg);
    w->layers[3].attn.wq_b = saved;
    cr_assert_null(m);
    free(map);
    runner_model_free(&rm);
    kern_cpu_destroy(&be);
}

/* Bounded replay: rows at or after window_start read no ring entry below it, so a chunk that
 * starts at a block boundary with window_start there does not depend on the state slot's
 * previous content (here zeroed, as when the stored window state is missing). */
Test(forward, window_start_makes_a_chunk_independent_of_the_missing_window_state, .timeout = 60)
{
    fx f;
    fx_open(&f, 43);
    size_t V = vocab(&f);
    fx_seq a, b;
    fx_seq_new(&f, &a, 256, 14);
    fx_seq_new(&f, &b, 256, 14);
    float *la = malloc(128 * V * 4), *lb = malloc(128 * V * 4);
    fx_step1(&f, &a, 128, NULL);
    fx_step1(&f, &b, 128, NULL);
    memset(fwd_kv_slot(f.kv, b.slot), 0, f.kv->slot_bytes);
    fx_seq *seqs[2] = {&a, &b};
    float *outs[2] = {la, lb};
    for (int k = 0; k < 2; k++) {
        fwd_seq q = fx_rows(&f, seqs[k], 128);
        q.window_start = 128;
        int32_t rows[128];
        for (int i = 0; i < 128; i++)
            rows[i] = i;
        fwd_step st = {.n_seqs = 1, .seqs = &q, .n_logit_rows = 128, .logit_rows = rows};
        di_error e;
        cr_assert_eq(fwd_step_run(f.run, f.kv, &st, outs[k], &e), DI_OK, "%s", e.msg);
    }
    same_row(la, lb, 128 * V, "replayed chunk", 128);
    fwd_seq q = fx_rows(&f, &a, 4);
    q.window_start = 999;
    fwd_step st = {.n_seqs = 1, .seqs = &q};
    di_error e;
    cr_assert_eq(fwd_step_run(f.run, f.kv, &st, NULL, &e), DI_EINVAL);
    free(la);
    free(lb);
    fx_close(&f);
}
