/* check_index: the CUDA backend's indexer ops against their C twins (kern_cpu_create's table),
 * with kernels.h's tolerances:
 *   index_scores: each visible score within 1 bf16 ulp (-inf exactly), columns past the
 *     call's widest row untouched;
 *   index_candidates: the mask bytes exactly (kept blocks, the forced newest block, -inf picks
 *     dropped, ties to the lower block), padding past the widest row untouched;
 *   index_topk: the ids exactly (ties to the lower entry, -inf below every finite score,
 *     ascending, -1 padded).
 * Scores come from FP4 queries and keys as in the model (and once from queries that are not
 * FP4 values), with candidate masks; selections get ties on purpose (scores from a handful of
 * values), -inf runs, NaN, rows with nothing visible, k above and below the visible count.
 * Prefill shapes: long sequences (the block kernel from 16 rows of a sequence), several
 * sequences in one call (blocks of 8 rows cut at each sequence's end, short ones on the per-row
 * kernel in the same call), rows whose bound falls inside a tile or a span, head counts that
 * are not a multiple of 8, 64 heads (the per-row kernel); every scores case also runs with every
 * row on the per-row kernel (grouped by 8), which must give the same bits (FP4 queries).
 * The three ops also run chained as the forward runs them (scores -> candidates -> masked
 * scores -> top-k), each stage fed from the CPU's previous stage.
 * With --bench: scores and top-k at V4.1-Flash shapes (32 heads of 128, top-512) for 1, 8, 64
 * and 384 decode rows and 64 sequences of 6 rows, and the scores of a 4,096- and a 16,384-row
 * prefill chunk of one sequence (ratio-1 keys, row t sees t + 1) on the block kernel and on the
 * per-row kernel, next to the copy bandwidth and BF16 GEMM ceiling of the same run.
 * CHECK_INDEX_BENCH=prefill (for a profiler): only the prefill timings, no checks.
 * Exit 0: all match; 1: a mismatch (parameters and first mismatches printed); 2: setup error. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/numfmt.h"
#include "kernels/cuda/backend_cuda.h"
#include "tests/gpu/check_util.h"
#include "tests/gpu/gpu_common.h"

static const char usage[] =
    "usage: check_index [--bench] [--seed N]\n"
    "  CUDA index_scores, index_candidates, index_topk against the C twins; --bench adds\n"
    "  V4.1-Flash timings (decode rows and 4,096- and 16,384-row prefill chunks)\n"
    "  CHECK_INDEX_BENCH=prefill: only the prefill timings, no checks (for a profiler)\n";

#define MAX_SEQS 4
#define SHOW 5

/* ---- comparisons ---- */

static int32_t bf16_line(float f)
{
    uint16_t h = di_f32_to_bf16(f);
    int32_t mag = h & 0x7fff;
    return (h & 0x8000) ? -mag : mag;
}

/* Visible scores compared, and how many of them were bit-identical (a report: kernels.h allows
 * one ulp). */
static uint64_t g_scores, g_identical;

/* Scores: columns < width within one bf16 ulp (infinities and NaN exactly), the rest bit for
 * bit. */
static size_t cmp_scores(const char *what, const float *c, const float *g, uint32_t rows,
                         size_t stride, uint32_t width)
{
    size_t bad = 0;
    for (uint32_t t = 0; t < rows; t++)
        for (size_t e = 0; e < width; e++) {
            g_scores++;
            g_identical += memcmp(&c[t * stride + e], &g[t * stride + e], 4) == 0;
        }
    for (uint32_t t = 0; t < rows; t++)
        for (size_t e = 0; e < stride; e++) {
            float x = c[t * stride + e], y = g[t * stride + e];
            int ok;
            if (e >= width)
                ok = memcmp(&x, &y, 4) == 0;
            else if (isnan(x) || isnan(y) || isinf(x) || isinf(y))
                ok = (isnan(x) && isnan(y)) || x == y;
            else
                ok = abs(bf16_line(x) - bf16_line(y)) <= 1;
            if (!ok && bad++ < SHOW)
                fprintf(stderr, "MISMATCH %s: row %u entry %zu: cpu %.9g gpu %.9g\n", what, t, e,
                        (double)x, (double)y);
        }
    return bad;
}

/* ---- inputs ---- */

/* n bf16 numbers of FP4 values (procedure (B) of N(0,1) * scale), or plain N(0,1) bf16 */
static void fill_fp4_bf16(uint16_t *x, size_t n, int fp4, di_rng *rng)
{
    float f[32];
    for (size_t i = 0; i < n; i += 32) {
        for (int k = 0; k < 32; k++)
            f[k] = (float)di_rng_normal(rng);
        if (fp4)
            di_fakequant_fp4_b32(f, 32);
        for (int k = 0; k < 32 && i + k < n; k++)
            x[i + k] = di_f32_to_bf16(f[k]);
    }
}

/* Scores for the selections: mode 0 N(0,1) bf16-rounded; 1 few values (ties everywhere);
 * 2 runs of -inf and a few NaN; 3 all equal */
static void fill_sel_scores(float *s, size_t n, int mode, di_rng *rng)
{
    for (size_t i = 0; i < n; i++) {
        float v = di_bf16_round((float)di_rng_normal(rng));
        if (mode == 1)
            v = (float)di_rng_below(rng, 4);
        if (mode == 2 && (i / 13) % 3 == 1)
            v = -INFINITY;
        if (mode == 2 && i % 97 == 5)
            v = NAN;
        if (mode == 3)
            v = 0.5f;
        s[i] = v;
    }
}

/* ---- index_scores ---- */

typedef struct score_case {
    uint32_t n_seqs;
    chk_seq_shape seqs[MAX_SEQS];   /* n_entries: keys in the pool for the sequence */
    uint32_t heads, hd, ratio, per_block;
    int masked;                     /* random candidate mask of blocks of 8 */
    int fp4_q;                      /* queries are FP4 values (as in the model) */
    uint32_t stride_pad;
} score_case;

/* The backends with every row on the per-row kernel (kern_cuda_config.index_block_rows -1):
 * rows of a sequence 8 to a CTA (index_group_rows 8) and each row alone (set in main). */
static kern_backend *g_grouped, *g_rows;
/* CHECK_INDEX_BENCH=prefill: only the prefill timings (set in main). */
static int g_prefill_only;

static void check_scores(chk_env *env, const score_case *sc)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    uint32_t T = 0;
    for (uint32_t s = 0; s < sc->n_seqs; s++)
        T += sc->seqs[s].n_rows;
    chk_kv kv;
    chk_kv_shape ks = {.entries_per_block = sc->per_block, .dim = 32, .index_dim = sc->hd, .skew = 3};
    chk_kv_make(env, &kv, &ks, sc->n_seqs, sc->seqs, 8, &rng);
    int32_t *nv = chk_malloc(T * 4), *row_seq = chk_malloc(T * 4);
    uint32_t max_vis = 0;
    for (uint32_t s = 0; s < sc->n_seqs; s++)
        for (uint32_t i = 0; i < sc->seqs[s].n_rows; i++) {
            uint32_t t = kv.seqs_h[s].row0 + i;
            int64_t v = (sc->seqs[s].pos0 + i + 1) / sc->ratio;
            nv[t] = (int32_t)(v < sc->seqs[s].n_entries ? v : sc->seqs[s].n_entries);
            row_seq[t] = (int32_t)s;
            max_vis = (uint32_t)nv[t] > max_vis ? (uint32_t)nv[t] : max_vis;
        }
    size_t stride = max_vis + sc->stride_pad, cstride = max_vis / 8 + 3;
    size_t qn = (size_t)T * sc->heads * sc->hd;
    uint16_t *q = chk_malloc(qn * 2), *w = chk_malloc((size_t)T * sc->heads * 2);
    fill_fp4_bf16(q, qn, sc->fp4_q, &rng);
    chk_fill_bf16(w, (size_t)T * sc->heads, CHK_NORMAL, &rng);
    uint8_t *mask = chk_malloc((size_t)T * cstride);
    for (size_t i = 0; i < (size_t)T * cstride; i++)
        mask[i] = (uint8_t)(di_rng_below(&rng, 3) != 0);
    float *out = chk_malloc((size_t)T * stride * 4), *gout = chk_malloc((size_t)T * stride * 4);
    chk_poison(out, (size_t)T * stride * 4);
    double w_scale = pow((double)sc->hd, -0.5) * pow((double)sc->heads, -0.5);
    char what[256];
    snprintf(what, sizeof(what), "index_scores rows=%u seqs=%u heads=%u hd=%u ratio=%u per_block=%u "
             "masked=%d fp4_q=%d max_visible=%u seed=%" PRIu64, T, sc->n_seqs, sc->heads, sc->hd,
             sc->ratio, sc->per_block, sc->masked, sc->fp4_q, max_vis, seed);
    uint16_t *dq = chk_dev_copy(env, q, qn * 2), *dw = chk_dev_copy(env, w, (size_t)T * sc->heads * 2);
    uint8_t *dmask = chk_dev_copy(env, mask, (size_t)T * cstride);
    float *dout = chk_dev_copy(env, out, (size_t)T * stride * 4);
    kern_index_scores p = {.n_rows = T, .n_heads = sc->heads, .head_dim = sc->hd, .q = dq, .w = dw,
                           .w_scale = w_scale, .n_visible = nv, .row_seq = row_seq,
                           .seqs = kv.seqs_d, .pool = kv.pool_d,
                           .cand_mask = sc->masked ? dmask : NULL, .cand_stride = cstride,
                           .cand_block = 8, .scores = dout, .stride = stride};
    size_t bad = chk_gpu_status(env, env->gpu.ops.index_scores(env->gpu.ctx, &p), what);
    chk_get(env, gout, dout, (size_t)T * stride * 4);
    p.q = q, p.w = w, p.seqs = kv.seqs_h, p.pool = kv.pool_h, p.cand_mask = sc->masked ? mask : NULL;
    p.scores = out;
    chk_cpu_status(env->cpu.ops.index_scores(env->cpu.ctx, &p), what);
    if (!bad)
        bad = cmp_scores(what, out, gout, T, stride, max_vis);
    /* every row on the per-row kernel, the rows of a sequence 8 to a CTA (index_group_rows 8):
     * the same bits as the block kernel where the queries are FP4 values (exact block sums),
     * else the twin's tolerance */
    float *grouped = chk_malloc((size_t)T * stride * 4);
    chk_poison(grouped, (size_t)T * stride * 4);
    chk_put(env, dout, grouped, (size_t)T * stride * 4);
    p.q = dq, p.w = dw, p.seqs = kv.seqs_d, p.pool = kv.pool_d, p.cand_mask = sc->masked ? dmask : NULL;
    p.scores = dout;
    char w2[320];
    snprintf(w2, sizeof(w2), "%s (per-row kernel, rows of a sequence together)", what);
    di_error e;
    if (!bad)
        bad = chk_gpu_status(env, g_grouped->ops.index_scores(g_grouped->ctx, &p), w2);
    if (!bad)
        bad = chk_gpu_status(env, kern_cuda_sync(g_grouped, &e), w2);
    if (!bad) {
        chk_get(env, grouped, dout, (size_t)T * stride * 4);
        bad = sc->fp4_q ? chk_cmp_bytes(w2, gout, grouped, (size_t)T * stride * 4)
                        : cmp_scores(w2, out, grouped, T, stride, max_vis);
    }
    free(grouped);
    chk_count(env, bad);
    chk_dev_free(env, dq), chk_dev_free(env, dw), chk_dev_free(env, dmask), chk_dev_free(env, dout);
    chk_kv_free(env, &kv);
    free(nv), free(row_seq), free(q), free(w), free(mask), free(out), free(gout);
}

/* ---- index_candidates and index_topk ---- */

typedef struct sel_case {
    uint32_t rows;
    uint32_t max_visible;       /* visible counts drawn in [0, max_visible] (row 0 gets it) */
    uint32_t k;                 /* top_blocks or index_topk */
    int mode;                   /* fill_sel_scores mode */
} sel_case;

static void sel_inputs(const sel_case *c, di_rng *rng, int32_t *nv, float *s, size_t stride)
{
    for (uint32_t t = 0; t < c->rows; t++) {
        nv[t] = t == 0 ? (int32_t)c->max_visible : (int32_t)di_rng_below(rng, c->max_visible + 1);
        if (t == 1)
            nv[t] = 0;
    }
    fill_sel_scores(s, (size_t)c->rows * stride, c->mode, rng);
}

static void check_candidates(chk_env *env, const sel_case *c)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    const uint32_t block = 8;
    size_t stride = c->max_visible + 5, mstride = (c->max_visible + block - 1) / block + 4;
    int32_t *nv = chk_malloc(c->rows * 4);
    float *s = chk_malloc((size_t)c->rows * stride * 4);
    sel_inputs(c, &rng, nv, s, stride);
    uint8_t *m = chk_malloc((size_t)c->rows * mstride), *gm = chk_malloc((size_t)c->rows * mstride);
    chk_poison(m, (size_t)c->rows * mstride);
    char what[200];
    snprintf(what, sizeof(what), "index_candidates rows=%u max_visible=%u top_blocks=%u mode=%d "
             "seed=%" PRIu64, c->rows, c->max_visible, c->k, c->mode, seed);
    float *ds = chk_dev_copy(env, s, (size_t)c->rows * stride * 4);
    uint8_t *dm = chk_dev_copy(env, m, (size_t)c->rows * mstride);
    kern_index_candidates p = {.n_rows = c->rows, .scores = ds, .stride = stride, .n_visible = nv,
                               .block = block, .top_blocks = c->k, .mask = dm, .mask_stride = mstride};
    size_t bad = chk_gpu_status(env, env->gpu.ops.index_candidates(env->gpu.ctx, &p), what);
    chk_get(env, gm, dm, (size_t)c->rows * mstride);
    p.scores = s, p.mask = m;
    chk_cpu_status(env->cpu.ops.index_candidates(env->cpu.ctx, &p), what);
    if (!bad)
        bad = chk_cmp_bytes(what, m, gm, (size_t)c->rows * mstride);
    chk_count(env, bad);
    chk_dev_free(env, ds), chk_dev_free(env, dm);
    free(nv), free(s), free(m), free(gm);
}

static void check_topk(chk_env *env, const sel_case *c)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    size_t stride = c->max_visible + 3;
    int32_t *nv = chk_malloc(c->rows * 4);
    float *s = chk_malloc((size_t)c->rows * stride * 4);
    sel_inputs(c, &rng, nv, s, stride);
    size_t on = (size_t)c->rows * c->k + 1;
    int32_t *o = chk_malloc(on * 4), *go = chk_malloc(on * 4);
    chk_poison(o, on * 4);
    char what[200];
    snprintf(what, sizeof(what), "index_topk rows=%u max_visible=%u k=%u mode=%d seed=%" PRIu64,
             c->rows, c->max_visible, c->k, c->mode, seed);
    float *ds = chk_dev_copy(env, s, (size_t)c->rows * stride * 4);
    int32_t *dout = chk_dev_copy(env, o, on * 4);
    kern_index_topk p = {.n_rows = c->rows, .k = c->k, .scores = ds, .stride = stride,
                         .n_visible = nv, .out = dout};
    size_t bad = chk_gpu_status(env, env->gpu.ops.index_topk(env->gpu.ctx, &p), what);
    chk_get(env, go, dout, on * 4);
    p.scores = s, p.out = o;
    chk_cpu_status(env->cpu.ops.index_topk(env->cpu.ctx, &p), what);
    if (!bad)
        bad = chk_cmp_i32(what, o, go, on);
    chk_count(env, bad);
    chk_dev_free(env, ds), chk_dev_free(env, dout);
    free(nv), free(s), free(o), free(go);
}

/* ---- the chain of the forward: scores, candidates, masked scores, top-k ---- */

static void check_chain(chk_env *env, uint32_t rows, int64_t pos0, uint32_t top_blocks, uint32_t k)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    const uint32_t heads = 8, hd = 64, block = 8;
    chk_seq_shape ss[1] = {{.n_rows = rows, .pos0 = pos0, .n_entries = (uint32_t)(pos0 + rows), .has_slot = 1}};
    chk_kv kv;
    chk_kv_shape ks = {.entries_per_block = 128, .dim = 32, .index_dim = hd};
    chk_kv_make(env, &kv, &ks, 1, ss, 8, &rng);
    int32_t *nv = chk_malloc(rows * 4), *rs = chk_malloc(rows * 4);
    for (uint32_t t = 0; t < rows; t++)
        nv[t] = (int32_t)(pos0 + t + 1), rs[t] = 0;
    uint32_t width = (uint32_t)(pos0 + rows);
    size_t stride = width, cstride = (width + block - 1) / block;
    size_t qn = (size_t)rows * heads * hd;
    uint16_t *q = chk_malloc(qn * 2), *w = chk_malloc((size_t)rows * heads * 2);
    fill_fp4_bf16(q, qn, 1, &rng);
    chk_fill_bf16(w, (size_t)rows * heads, CHK_NORMAL, &rng);
    float *sc = chk_malloc((size_t)rows * stride * 4), *gsc = chk_malloc((size_t)rows * stride * 4);
    uint8_t *mask = chk_malloc((size_t)rows * cstride), *gmask = chk_malloc((size_t)rows * cstride);
    int32_t *tk = chk_malloc((size_t)rows * k * 4), *gtk = chk_malloc((size_t)rows * k * 4);
    float *dsc = chk_dev_alloc(env, (size_t)rows * stride * 4);
    uint8_t *dmask = chk_dev_alloc(env, (size_t)rows * cstride);
    int32_t *dtk = chk_dev_alloc(env, (size_t)rows * k * 4);
    uint16_t *dq = chk_dev_copy(env, q, qn * 2), *dw = chk_dev_copy(env, w, (size_t)rows * heads * 2);
    char what[200];
    snprintf(what, sizeof(what), "indexer chain rows=%u pos0=%" PRId64 " top_blocks=%u k=%u seed=%" PRIu64,
             rows, pos0, top_blocks, k, seed);
    size_t bad = 0;
    kern_index_scores ps = {.n_rows = rows, .n_heads = heads, .head_dim = hd, .w_scale = 0.04419417,
                            .n_visible = nv, .row_seq = rs, .cand_stride = cstride,
                            .cand_block = block, .stride = stride};
    kern_index_candidates pc = {.n_rows = rows, .stride = stride, .n_visible = nv, .block = block,
                                .top_blocks = top_blocks, .mask_stride = cstride};
    kern_index_topk pt = {.n_rows = rows, .k = k, .stride = stride, .n_visible = nv};
    /* the CPU chain, then each GPU stage on the CPU's previous output */
    ps.q = q, ps.w = w, ps.seqs = kv.seqs_h, ps.pool = kv.pool_h, ps.scores = sc;
    chk_cpu_status(env->cpu.ops.index_scores(env->cpu.ctx, &ps), what);
    pc.scores = sc, pc.mask = mask;
    chk_cpu_status(env->cpu.ops.index_candidates(env->cpu.ctx, &pc), what);
    ps.q = dq, ps.w = dw, ps.seqs = kv.seqs_d, ps.pool = kv.pool_d, ps.scores = dsc;
    bad += chk_gpu_status(env, env->gpu.ops.index_scores(env->gpu.ctx, &ps), what);
    chk_get(env, gsc, dsc, (size_t)rows * stride * 4);
    bad += cmp_scores(what, sc, gsc, rows, stride, width);
    chk_put(env, dsc, sc, (size_t)rows * stride * 4);
    pc.scores = dsc, pc.mask = dmask;
    bad += chk_gpu_status(env, env->gpu.ops.index_candidates(env->gpu.ctx, &pc), what);
    chk_get(env, gmask, dmask, (size_t)rows * cstride);
    bad += chk_cmp_bytes(what, mask, gmask, (size_t)rows * cstride);
    /* a re-indexing layer: its own scores inside the candidates, then top-k */
    ps.q = q, ps.w = w, ps.seqs = kv.seqs_h, ps.pool = kv.pool_h, ps.scores = sc, ps.cand_mask = mask;
    chk_cpu_status(env->cpu.ops.index_scores(env->cpu.ctx, &ps), what);
    pt.scores = sc, pt.out = tk;
    chk_cpu_status(env->cpu.ops.index_topk(env->cpu.ctx, &pt), what);
    chk_put(env, dmask, mask, (size_t)rows * cstride);
    ps.q = dq, ps.w = dw, ps.seqs = kv.seqs_d, ps.pool = kv.pool_d, ps.scores = dsc, ps.cand_mask = dmask;
    bad += chk_gpu_status(env, env->gpu.ops.index_scores(env->gpu.ctx, &ps), what);
    chk_get(env, gsc, dsc, (size_t)rows * stride * 4);
    bad += cmp_scores(what, sc, gsc, rows, stride, width);
    chk_put(env, dsc, sc, (size_t)rows * stride * 4);
    pt.scores = dsc, pt.out = dtk;
    bad += chk_gpu_status(env, env->gpu.ops.index_topk(env->gpu.ctx, &pt), what);
    chk_get(env, gtk, dtk, (size_t)rows * k * 4);
    bad += chk_cmp_i32(what, tk, gtk, (size_t)rows * k);
    chk_count(env, bad);
    chk_dev_free(env, dsc), chk_dev_free(env, dmask), chk_dev_free(env, dtk);
    chk_dev_free(env, dq), chk_dev_free(env, dw);
    chk_kv_free(env, &kv);
    free(nv), free(rs), free(q), free(w), free(sc), free(gsc), free(mask), free(gmask), free(tk), free(gtk);
}

/* ---- refused inputs ---- */

static void check_refusals(chk_env *env)
{
    kern_ops *o = &env->gpu.ops;
    void *c = env->gpu.ctx;
    uint8_t *d = chk_dev_alloc(env, 1 << 16);
    size_t bad = 0;
    int32_t nv[2] = {10, -1}, rs[2] = {0, 0};
    kern_index_topk tk = {.n_rows = 2, .k = 4, .scores = (float *)d, .stride = 16,
                          .n_visible = nv, .out = (int32_t *)(d + 4096)};
    bad += chk_expect(env, o->index_topk(c, NULL), DI_EINVAL, "index_topk(NULL)");
    bad += chk_expect(env, o->index_topk(c, &tk), DI_EINVAL, "index_topk n_visible -1");
    nv[1] = 17;
    bad += chk_expect(env, o->index_topk(c, &tk), DI_EINVAL, "index_topk n_visible 17 > stride 16");
    nv[1] = 3;
    kern_index_candidates cd = {.n_rows = 2, .scores = (float *)d, .stride = 16, .n_visible = nv,
                                .block = 8, .top_blocks = 1, .mask = d + 8192, .mask_stride = 1};
    bad += chk_expect(env, o->index_candidates(c, &cd), DI_EINVAL,
                      "index_candidates 2 blocks in a mask stride of 1");
    cd.block = 0;
    bad += chk_expect(env, o->index_candidates(c, &cd), DI_EINVAL, "index_candidates block 0");
    kern_seq q = {.n_rows = 2, .n_blocks = 0};
    kern_index_scores sc = {.n_rows = 2, .n_heads = 65, .head_dim = 128, .q = (uint16_t *)d,
                            .w = (uint16_t *)d, .n_visible = nv, .row_seq = rs, .seqs = &q,
                            .scores = (float *)d, .stride = 16};
    bad += chk_expect(env, o->index_scores(c, &sc), DI_EUNSUPPORTED, "index_scores 65 heads");
    sc.n_heads = 4, sc.pool = (kern_kv_pool){.blocks = d, .block_bytes = 100, .entries_per_block = 4,
                                             .index_entry_bytes = 68};
    bad += chk_expect(env, o->index_scores(c, &sc), DI_EINVAL,
                      "index_scores 10 visible entries with an empty block table");
    bad += chk_expect(env, o->index_topk(c, &tk), DI_OK, "index_topk after refusals");
    chk_sync(env);
    chk_count(env, bad);
    printf("refused inputs: %s\n", bad ? "MISMATCHES" : "all refused with DI_EINVAL/EUNSUPPORTED");
    chk_dev_free(env, d);
}

/* ---- the sweep ---- */

#define SQ(n, p, e) {.n_rows = (n), .pos0 = (p), .n_entries = (e), .has_slot = 1}

static void sweep(chk_env *env)
{
    static const score_case scs[] = {
        {2, {SQ(1, 3000, 3001), SQ(1, 700, 701)}, 32, 128, 1, 128, 0, 1, 0},
        {3, {SQ(1, 5000, 2501), SQ(3, 10, 6), SQ(1, 0, 1)}, 32, 128, 2, 64, 1, 1, 5},
        {1, {SQ(63, 100, 82)}, 4, 32, 2, 64, 0, 1, 1},
        {2, {SQ(127, 0, 128), SQ(2, 900, 901)}, 8, 64, 1, 128, 1, 1, 0},
        {1, {SQ(5, 600, 606)}, 20, 96, 1, 8, 0, 1, 3},
        {2, {SQ(3, 400, 404), SQ(1, 64, 65)}, 32, 128, 1, 128, 1, 0, 0},
        {1, {SQ(2, 62, 64)}, 64, 256, 1, 2, 0, 1, 0},
        /* decode steps of 1 + 5 rows: a sequence's rows scored together */
        {3, {SQ(6, 3000, 3006), SQ(6, 1000, 1006), SQ(1, 77, 78)}, 32, 128, 1, 128, 1, 1, 0},
        /* prefill: one sequence from position 0 (ratio 2: its first row sees nothing) */
        {1, {SQ(300, 0, 150)}, 32, 128, 2, 128, 0, 1, 0},
        /* bounds crossing the 512-entry span of a block CTA, candidate mask */
        {1, {SQ(200, 450, 650)}, 32, 128, 1, 64, 1, 1, 3},
        /* three sequences: blocks cut at 45 and 37 rows, a 3-row one on the per-row kernel */
        {3, {SQ(45, 100, 145), SQ(3, 40, 43), SQ(37, 600, 637)}, 32, 128, 1, 128, 0, 1, 0},
        /* ratio 2 with a 17-row sequence seeing 2-10 entries, masked */
        {2, {SQ(70, 1000, 535), SQ(17, 3, 10)}, 32, 128, 2, 128, 1, 1, 2},
        /* 20 heads (three n-tiles of 8, the last half padding) of 96, blocks of 8 entries */
        {1, {SQ(24, 50, 74)}, 20, 96, 1, 8, 0, 1, 1},
        /* queries that are not FP4 values on the block kernel */
        {1, {SQ(40, 0, 40)}, 8, 64, 1, 16, 0, 0, 0},
        /* 64 heads: the per-row kernel at any row count */
        {1, {SQ(20, 10, 30)}, 64, 256, 1, 32, 0, 1, 0},
        /* a long sequence: three spans */
        {2, {SQ(1100, 0, 1100), SQ(16, 5, 21)}, 8, 64, 1, 128, 0, 1, 0},
    };
    int c0 = env->checks;
    for (size_t i = 0; i < sizeof(scs) / sizeof(scs[0]); i++)
        check_scores(env, &scs[i]);
    printf("index_scores: %d cases; %" PRIu64 " of %" PRIu64 " scores bit-identical, the rest "
           "within 1 bf16 ulp\n", env->checks - c0, g_identical, g_scores);
    static const sel_case cands[] = {
        {1, 8, 16, 0},     {3, 100, 4, 1},    {63, 700, 16, 0},   {5, 3000, 32, 1},
        {4, 1000, 2048, 2}, {7, 257, 1, 3},   {2, 5000, 300, 2},  {9, 64, 0, 0},
        {2, 20000, 2048, 1},
    };
    c0 = env->checks;
    for (size_t i = 0; i < sizeof(cands) / sizeof(cands[0]); i++)
        check_candidates(env, &cands[i]);
    printf("index_candidates: %d cases\n", env->checks - c0);
    static const sel_case topks[] = {
        {1, 1, 512, 0},    {3, 600, 512, 0},  {63, 700, 64, 1},  {5, 3000, 512, 2},
        {4, 513, 512, 3},  {7, 100, 5, 1},    {2, 20000, 512, 0}, {9, 40, 1, 2},
        {2, 70000, 512, 1},
    };
    c0 = env->checks;
    for (size_t i = 0; i < sizeof(topks) / sizeof(topks[0]); i++)
        check_topk(env, &topks[i]);
    printf("index_topk: %d cases\n", env->checks - c0);
    c0 = env->checks;
    check_chain(env, 1, 5000, 32, 128);
    check_chain(env, 40, 300, 16, 64);
    check_chain(env, 3, 2, 32, 128);
    printf("indexer chain: %d cases\n", env->checks - c0);
    check_refusals(env);
}

/* ---- benchmark: V4.1-Flash decode ---- */

enum { B_HEADS = 32, B_HD = 128, B_TOPK = 512, B_PER_BLOCK = 128, B_POOL = 4096,
       B_KEY = B_HD / 2 + B_HD / 32 };

typedef struct bench_arg {
    chk_env *env;
    kern_backend *be;           /* the backend of the scores */
    kern_index_scores s;
    kern_index_topk k;
    int op;
} bench_arg;

static di_status bench_call(void *arg, int i)
{
    bench_arg *b = arg;
    kern_backend *g = &b->env->gpu;
    return b->op == 0 ? b->be->ops.index_scores(b->be->ctx, &b->s)
                      : g->ops.index_topk(g->ctx, &b->k);
}

/* n_seqs sequences of `per` rows each (the rows of a sequence share its keys), `visible`
 * ratio-1 keys per row; causal: one prefill chunk from position 0 (row t sees t + 1 keys,
 * `visible` = per), its scores on the block kernel and on the per-row kernel. */
static void bench_rows(chk_env *env, uint32_t n_seqs, uint32_t per, uint32_t visible, int causal,
                       double copy, double peak)
{
    const uint32_t rows = n_seqs * per;
    di_rng rng;
    chk_case_rng(env, &rng);
    size_t block_bytes = 128 + (size_t)B_PER_BLOCK * B_KEY;
    uint8_t *h = chk_malloc(block_bytes * B_POOL);
    for (size_t i = 0; i < block_bytes * B_POOL; i++)
        h[i] = (uint8_t)di_rng_u32(&rng);
    for (uint32_t b = 0; b < B_POOL; b++) /* scales near 2^-2 */
        for (uint32_t e = 0; e < B_PER_BLOCK; e++)
            for (uint32_t k = 0; k < B_HD / 32; k++)
                h[b * block_bytes + 128 + e * B_KEY + B_HD / 2 + k] = (uint8_t)(125 + di_rng_below(&rng, 3));
    uint8_t *blocks = chk_dev_copy(env, h, block_bytes * B_POOL);
    free(h);
    uint32_t nb = (visible + B_PER_BLOCK - 1) / B_PER_BLOCK;
    uint32_t *tables = chk_malloc((size_t)n_seqs * nb * 4);
    kern_seq *seqs = chk_malloc(n_seqs * sizeof(kern_seq));
    int32_t *nv = chk_malloc(rows * 4), *rs = chk_malloc(rows * 4);
    for (uint32_t q = 0; q < n_seqs; q++) {
        for (uint32_t b = 0; b < nb; b++)
            tables[(size_t)q * nb + b] = (uint32_t)di_rng_below(&rng, B_POOL);
        seqs[q] = (kern_seq){.row0 = q * per, .n_rows = per, .pos0 = causal ? 0 : visible - per,
                             .blocks = tables + (size_t)q * nb, .n_blocks = nb, .ring_hi = -1};
    }
    double seen = 0; /* visible (row, key) pairs */
    for (uint32_t r = 0; r < rows; r++) {
        nv[r] = causal ? (int32_t)(r % per + 1) : (int32_t)visible, rs[r] = (int32_t)(r / per);
        seen += nv[r];
    }
    size_t qn = (size_t)rows * B_HEADS * B_HD;
    uint16_t *hq = chk_malloc(qn * 2);
    fill_fp4_bf16(hq, qn, 1, &rng);
    bench_arg b = {.env = env};
    float *scores = chk_dev_alloc(env, (size_t)rows * visible * 4);
    b.s = (kern_index_scores){.n_rows = rows, .n_heads = B_HEADS, .head_dim = B_HD,
                              .q = chk_dev_copy(env, hq, qn * 2),
                              .w = chk_dev_copy(env, hq, (size_t)rows * B_HEADS * 2),
                              .w_scale = 1.0 / 64, .n_visible = nv, .row_seq = rs, .seqs = seqs,
                              .scores = scores, .stride = visible};
    b.s.pool = (kern_kv_pool){.blocks = blocks, .block_bytes = block_bytes,
                              .entries_per_block = B_PER_BLOCK, .index_offset = 128,
                              .index_entry_bytes = B_KEY};
    b.k = (kern_index_topk){.n_rows = rows, .k = B_TOPK, .scores = scores, .stride = visible,
                            .n_visible = nv, .out = chk_dev_alloc(env, (size_t)rows * B_TOPK * 4)};
    char label[32];
    snprintf(label, sizeof(label), "%u x %u", n_seqs, per);
    /* decode: scores (default: rows alone), scores (rows together), top-k; causal: scores
     * (default: the block kernel), scores on the per-row kernel */
    static const int ops[2][3] = {{0, 2, 1}, {0, 3, -1}};
    for (int oi = 0; oi < 3; oi++) {
        int op = ops[causal != 0][oi];
        if (op < 0 || (op == 2 && per == 1))
            continue;
        b.op = op == 1;
        b.be = op == 2 ? g_grouped : op == 3 ? g_rows : &env->gpu;
        double ms = chk_time_ms_on(env, b.be, bench_call, &b, 3, 20);
        double flops = op != 1 ? 2.0 * B_HEADS * B_HD * seen : 0;
        double bytes = op != 1 ? n_seqs * (double)visible * B_KEY +
                                     rows * ((double)visible * 4 + B_HEADS * B_HD * 2.0)
                               : rows * (double)visible * 4;
        const char *name = op == 1   ? "index_topk 512"
                           : op == 2 ? "  rows together"
                           : op == 3 ? "  per-row kernel"
                           : causal  ? "index_scores blk"
                                     : "index_scores";
        if (ms <= 0) {
            printf("%-16s %9s %8u failed (message above)\n", name, label, visible);
            continue;
        }
        double tf = flops / (ms * 1e-3) / 1e12, gb = bytes / (ms * 1e-3) / 1e9;
        printf("%-16s %9s %8u %9.1f %9.2f %7.0f %6.1f%% %6.1f%%\n", name, label, visible, ms * 1e3,
               tf, gb, 100 * tf / peak, 100 * gb / copy);
    }
    chk_dev_free(env, blocks), chk_dev_free(env, scores), chk_dev_free(env, (void *)b.s.q);
    chk_dev_free(env, (void *)b.s.w), chk_dev_free(env, b.k.out);
    free(tables), free(seqs), free(nv), free(rs), free(hq);
}

static void bench(chk_env *env)
{
    double copy = gpu_copy_gbs((size_t)1 << 30, 20);
    double peak = chk_gemm_ceiling(env);
    printf("\nceilings measured now: copy %.0f GB/s, BF16 GEMM 8192^3 %.0f TFLOP/s; bytes = keys "
           "read once per sequence, q read and scores written per row (top-k: scores read)\n",
           copy, peak);
    const char *hdr = "%-16s %9s %8s %9s %9s %7s %7s %7s\n";
    if (!g_prefill_only) {
        printf("indexer at V4.1-Flash decode shapes (32 heads of 128, one sequence per row, "
               "ratio-1 keys)\n");
        printf(hdr, "op", "seqs x rows", "visible", "us", "TFLOP/s", "GB/s", "of GEMM", "of copy");
        bench_rows(env, 1, 1, 16384, 0, copy, peak);
        bench_rows(env, 8, 1, 16384, 0, copy, peak);
        bench_rows(env, 64, 1, 16384, 0, copy, peak);
        bench_rows(env, 64, 6, 16384, 0, copy, peak);
        bench_rows(env, 64, 1, 65536, 0, copy, peak);
        bench_rows(env, 384, 1, 16384, 0, copy, peak);
    }
    printf("\nindex_scores of a prefill chunk (one sequence from position 0, ratio-1 keys: row t "
           "sees t + 1; FLOPs of the visible pairs, all rows x rows columns written)\n");
    printf(hdr, "op", "seqs x rows", "visible", "us", "TFLOP/s", "GB/s", "of GEMM", "of copy");
    bench_rows(env, 1, 4096, 4096, 1, copy, peak);
    bench_rows(env, 1, 16384, 16384, 1, copy, peak);
}

int main(int argc, char **argv)
{
    chk_env env;
    int want_bench = chk_init(&env, argc, argv, usage);
    kern_backend grouped, alone;
    kern_cuda_config cfg = {.index_group_rows = 8, .index_block_rows = -1};
    kern_cuda_config cfg1 = {.index_block_rows = -1};
    di_error e;
    if (kern_cuda_create(&cfg, &grouped, &e) != DI_OK) {
        fprintf(stderr, "CUDA backend (index_group_rows 8): %s\n", e.msg);
        return 2;
    }
    if (kern_cuda_create(&cfg1, &alone, &e) != DI_OK) {
        fprintf(stderr, "CUDA backend (index_block_rows -1): %s\n", e.msg);
        kern_cuda_destroy(&grouped);
        return 2;
    }
    g_grouped = &grouped, g_rows = &alone;
    const char *only = getenv("CHECK_INDEX_BENCH");
    g_prefill_only = only && strcmp(only, "prefill") == 0;
    if (!g_prefill_only)
        sweep(&env);
    int rc = chk_finish(&env, "check_index", want_bench, bench);
    kern_cuda_destroy(&alone);
    kern_cuda_destroy(&grouped);
    return rc;
}
