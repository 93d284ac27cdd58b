/* check_misc: the CUDA backend's hyper-connection ops (hc_mixes, hc_collapse, hc_expand), the
 * row gather (copy_rows) and the Engram ops (engram_hash, engram_lookup, engram_gate) against
 * their C twins (kern_cpu_create's table), with the tolerances of kernels/kernels.h:
 *   hc_mixes: abs 1e-5 on pre, post and comb;  hc_collapse, hc_expand: bit for bit;
 *   copy_rows: bytes, and every byte of the destination outside the copied rows untouched;
 *   engram_hash, engram_lookup: exact;  engram_gate: bf16 1 ulp.
 * Inputs: zeros, ones, arange, N(0,1), tiny, large, rounding edges, NaN/Inf; rows 1, 3, 63, 127
 * (and 1,500 for hc_mixes: a block per row);
 * hc 1, 2, 4 and 8; widths of the tiny and full models; padded strides; outputs poisoned;
 * Engram lookbacks across sequence starts and histories, tables stored and generated on demand
 * (row_fn), hash columns of one layer among several (hash_stride).
 * With --bench: the ops at V4.1-Flash shapes next to the copy bandwidth of the same run.
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
    "usage: check_misc [--bench] [--seed N]\n"
    "  CUDA hc_mixes, hc_collapse, hc_expand, copy_rows and Engram ops against the C twins;\n"
    "  --bench adds bandwidths at V4.1-Flash shapes\n";

/* ---- hc_mixes: pre/post/comb within abs 1e-5 ---- */

typedef struct mix_case {
    uint32_t rows, hc, dim;
    double fn_std;              /* spread of the mixing weights (1e-4 as the random models) */
    int mode;                   /* input mode of h */
    uint32_t iters;
} mix_case;

static void check_hc_mixes(chk_env *env, const mix_case *mc)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    uint32_t hc = mc->hc, width = hc * mc->dim, n_mix = (2 + hc) * hc;
    size_t hn = (size_t)mc->rows * width;
    uint16_t *h = chk_malloc(hn * 2);
    float *fn = chk_malloc((size_t)n_mix * width * 4), base[80], scale[3];
    chk_fill_bf16(h, hn, mc->mode, &rng);
    chk_fill_f32(fn, (size_t)n_mix * width, mc->fn_std, &rng);
    chk_fill_f32(base, n_mix, 1.0, &rng);
    chk_fill_f32(scale, 3, 1.0, &rng);
    size_t np = (size_t)mc->rows * hc, nc = (size_t)mc->rows * hc * hc;
    float *out_c = chk_malloc((2 * np + nc) * 4), *out_g = chk_malloc((2 * np + nc) * 4);
    chk_poison(out_c, (2 * np + nc) * 4);
    char what[256];
    snprintf(what, sizeof(what), "hc_mixes rows=%u hc=%u dim=%u fn_std=%g iters=%u mode=%s seed=%" PRIu64,
             mc->rows, hc, mc->dim, mc->fn_std, mc->iters, chk_mode_name[mc->mode], seed);

    uint16_t *dh = chk_dev_copy(env, h, hn * 2);
    float *dfn = chk_dev_copy(env, fn, (size_t)n_mix * width * 4);
    float *dbase = chk_dev_copy(env, base, n_mix * 4), *dscale = chk_dev_copy(env, scale, 12);
    float *dout = chk_dev_copy(env, out_c, (2 * np + nc) * 4);
    kern_hc_mixes p = {.n_rows = mc->rows, .n_copies = hc, .dim = mc->dim, .h = dh, .fn = dfn,
                       .base = dbase, .scale = dscale, .sinkhorn_iters = mc->iters, .eps = 1e-6,
                       .norm_eps = 1e-20f, .pre = dout, .post = dout + np, .comb = dout + 2 * np};
    size_t bad = chk_gpu_status(env, env->gpu.ops.hc_mixes(env->gpu.ctx, &p), what);
    chk_get(env, out_g, dout, (2 * np + nc) * 4);
    p.h = h, p.fn = fn, p.base = base, p.scale = scale;
    p.pre = out_c, p.post = out_c + np, p.comb = out_c + 2 * np;
    chk_cpu_status(env->cpu.ops.hc_mixes(env->cpu.ctx, &p), what);
    if (!bad)
        bad = chk_cmp_f32_abs(what, out_c, out_g, 2 * np + nc, 1e-5, NULL);
    chk_count(env, bad);
    chk_dev_free(env, dh), chk_dev_free(env, dfn), chk_dev_free(env, dbase);
    chk_dev_free(env, dscale), chk_dev_free(env, dout);
    free(h), free(fn), free(out_c), free(out_g);
}

/* ---- hc_collapse and hc_expand: exact; output padding untouched ---- */

typedef struct ce_case {
    uint32_t rows, hc, dim;
    uint32_t pre_stride;        /* 0: one pre row for every row */
    uint32_t out_pad;           /* collapse: extra elements per output row */
    int mode;
} ce_case;

/* pre/post/comb like the mixes make them: positive, near 1/hc; NaN sprinkled for specials */
static void fill_coeffs(float *x, size_t n, float centre, int mode, di_rng *rng)
{
    for (size_t i = 0; i < n; i++) {
        x[i] = centre * (float)(0.5 + di_rng_uniform(rng));
        if (mode == CHK_SPECIALS && i % 7 == 3)
            x[i] = NAN;
        if (mode == CHK_LARGE)
            x[i] *= 1e30f;
    }
}

static void check_hc_collapse(chk_env *env, const ce_case *cc)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    size_t hn = (size_t)cc->rows * cc->hc * cc->dim, os = (size_t)cc->dim + cc->out_pad;
    size_t on = cc->rows * os, pn = cc->pre_stride ? (size_t)cc->rows * cc->pre_stride : cc->hc;
    uint16_t *h = chk_malloc(hn * 2), *oc = chk_malloc(on * 2), *og = chk_malloc(on * 2);
    float *pre = chk_malloc(pn * 4);
    chk_fill_bf16(h, hn, cc->mode, &rng);
    fill_coeffs(pre, pn, 1.0f / (float)cc->hc, cc->mode, &rng);
    chk_fill_u16(oc, on, CHK_POISON_BF16);
    char what[256];
    snprintf(what, sizeof(what), "hc_collapse rows=%u hc=%u dim=%u pre_stride=%u out_stride=%zu "
             "mode=%s seed=%" PRIu64, cc->rows, cc->hc, cc->dim, cc->pre_stride, os,
             chk_mode_name[cc->mode], seed);
    uint16_t *dh = chk_dev_copy(env, h, hn * 2), *dout = chk_dev_copy(env, oc, on * 2);
    float *dpre = chk_dev_copy(env, pre, pn * 4);
    kern_hc_collapse p = {.n_rows = cc->rows, .n_copies = cc->hc, .dim = cc->dim, .h = dh,
                          .pre = dpre, .pre_stride = cc->pre_stride, .out = dout, .out_stride = os};
    size_t bad = chk_gpu_status(env, env->gpu.ops.hc_collapse(env->gpu.ctx, &p), what);
    chk_get(env, og, dout, on * 2);
    p.h = h, p.pre = pre, p.out = oc;
    chk_cpu_status(env->cpu.ops.hc_collapse(env->cpu.ctx, &p), what);
    if (!bad)
        bad = chk_cmp_bf16_exact(what, oc, og, on);
    chk_count(env, bad);
    chk_dev_free(env, dh), chk_dev_free(env, dout), chk_dev_free(env, dpre);
    free(h), free(oc), free(og), free(pre);
}

static void check_hc_expand(chk_env *env, const ce_case *cc)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    uint32_t hc = cc->hc;
    size_t hn = (size_t)cc->rows * hc * cc->dim, yn = (size_t)cc->rows * cc->dim;
    uint16_t *h = chk_malloc(hn * 2), *y = chk_malloc(yn * 2);
    uint16_t *oc = chk_malloc(hn * 2), *og = chk_malloc(hn * 2);
    float *post = chk_malloc((size_t)cc->rows * hc * 4), *comb = chk_malloc((size_t)cc->rows * hc * hc * 4);
    chk_fill_bf16(h, hn, cc->mode, &rng);
    chk_fill_bf16(y, yn, cc->mode == CHK_SPECIALS ? CHK_NORMAL : cc->mode, &rng);
    fill_coeffs(post, (size_t)cc->rows * hc, 1.0f, cc->mode, &rng);
    fill_coeffs(comb, (size_t)cc->rows * hc * hc, 1.0f / (float)hc, cc->mode, &rng);
    chk_fill_u16(oc, hn, CHK_POISON_BF16);
    char what[256];
    snprintf(what, sizeof(what), "hc_expand rows=%u hc=%u dim=%u mode=%s seed=%" PRIu64, cc->rows,
             hc, cc->dim, chk_mode_name[cc->mode], seed);
    uint16_t *dh = chk_dev_copy(env, h, hn * 2), *dy = chk_dev_copy(env, y, yn * 2);
    uint16_t *dout = chk_dev_copy(env, oc, hn * 2);
    float *dpost = chk_dev_copy(env, post, (size_t)cc->rows * hc * 4);
    float *dcomb = chk_dev_copy(env, comb, (size_t)cc->rows * hc * hc * 4);
    kern_hc_expand p = {.n_rows = cc->rows, .n_copies = hc, .dim = cc->dim, .y = dy, .h = dh,
                        .post = dpost, .comb = dcomb, .out = dout};
    size_t bad = chk_gpu_status(env, env->gpu.ops.hc_expand(env->gpu.ctx, &p), what);
    chk_get(env, og, dout, hn * 2);
    p.y = y, p.h = h, p.post = post, p.comb = comb, p.out = oc;
    chk_cpu_status(env->cpu.ops.hc_expand(env->cpu.ctx, &p), what);
    if (!bad)
        bad = chk_cmp_bf16_exact(what, oc, og, hn);
    chk_count(env, bad);
    chk_dev_free(env, dh), chk_dev_free(env, dy), chk_dev_free(env, dout);
    chk_dev_free(env, dpost), chk_dev_free(env, dcomb);
    free(h), free(y), free(oc), free(og), free(post), free(comb);
}

/* ---- copy_rows: a gather between buffers, or the in-place compaction ---- */

typedef struct copy_case {
    uint32_t rows;              /* rows copied */
    size_t row_bytes, src_stride, dst_stride;
    uint32_t src_rows;          /* rows of the source buffer */
    int identity;               /* rows NULL */
    int in_place;               /* dst == src, rows strictly ascending */
    uint32_t dst_offset;        /* bytes from the buffer start to dst (misalignment) */
} copy_case;

static void check_copy_rows(chk_env *env, const copy_case *cc)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    size_t sbytes = (size_t)cc->src_rows * cc->src_stride + 64;
    size_t dbytes = cc->in_place ? sbytes : (size_t)cc->rows * cc->dst_stride + cc->dst_offset + 64;
    uint8_t *src = chk_malloc(sbytes), *dst = chk_malloc(dbytes), *out = chk_malloc(dbytes);
    for (size_t i = 0; i < sbytes; i++)
        src[i] = (uint8_t)di_rng_u32(&rng);
    chk_poison(dst, dbytes);
    int32_t *rows = chk_malloc((size_t)cc->rows * 4);
    if (cc->in_place) { /* strictly ascending, rows[i] >= i */
        uint32_t r = 0;
        for (uint32_t i = 0; i < cc->rows; i++) {
            uint32_t room = cc->src_rows - (cc->rows - i) - r;
            r += (uint32_t)di_rng_below(&rng, room + 1 > 3 ? 3 : room + 1);
            rows[i] = (int32_t)r++;
        }
    } else {
        for (uint32_t i = 0; i < cc->rows; i++)
            rows[i] = (int32_t)di_rng_below(&rng, cc->src_rows);
    }
    char what[256];
    snprintf(what, sizeof(what), "copy_rows rows=%u row_bytes=%zu src_stride=%zu dst_stride=%zu "
             "identity=%d in_place=%d dst_offset=%u seed=%" PRIu64, cc->rows, cc->row_bytes,
             cc->src_stride, cc->dst_stride, cc->identity, cc->in_place, cc->dst_offset, seed);
    uint8_t *dsrc = chk_dev_copy(env, src, sbytes);
    uint8_t *ddst = cc->in_place ? dsrc : chk_dev_copy(env, dst, dbytes);
    kern_copy_rows p = {.n_rows = cc->rows, .row_bytes = cc->row_bytes, .src = dsrc,
                        .src_stride = cc->src_stride, .rows = cc->identity ? NULL : rows,
                        .dst = ddst + (cc->in_place ? 0 : cc->dst_offset),
                        .dst_stride = cc->in_place ? cc->src_stride : cc->dst_stride};
    size_t bad = chk_gpu_status(env, env->gpu.ops.copy_rows(env->gpu.ctx, &p), what);
    chk_get(env, out, ddst, dbytes);
    uint8_t *cdst = cc->in_place ? src : dst;
    p.src = src;
    p.dst = cdst + (cc->in_place ? 0 : cc->dst_offset);
    chk_cpu_status(env->cpu.ops.copy_rows(env->cpu.ctx, &p), what);
    if (!bad)
        bad = chk_cmp_bytes(what, cdst, out, dbytes);
    chk_count(env, bad);
    chk_dev_free(env, dsrc);
    if (!cc->in_place)
        chk_dev_free(env, ddst);
    free(src), free(dst), free(out), free(rows);
}


/* ---- Engram: hash exact, lookup exact, gate bf16 1 ulp ---- */

typedef struct hash_case {
    uint32_t n_layers, max_ngram, heads;
    uint32_t n_seqs;
    uint32_t rows[4];
    int64_t pos0[4];
    uint32_t vocab, cvocab;
} hash_case;

static void check_engram_hash(chk_env *env, const hash_case *hc)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    uint32_t cols = (hc->max_ngram - 1) * hc->heads, T = 0;
    kern_seq seqs[4];
    int32_t *hist[4];
    for (uint32_t s = 0; s < hc->n_seqs; s++) {
        uint32_t nh = hc->pos0[s] < (int64_t)hc->max_ngram - 1 ? (uint32_t)hc->pos0[s] : hc->max_ngram - 1;
        hist[s] = chk_malloc((nh + 1) * 4);
        for (uint32_t i = 0; i < nh; i++)
            hist[s][i] = (int32_t)di_rng_below(&rng, hc->vocab);
        seqs[s] = (kern_seq){.row0 = T, .n_rows = hc->rows[s], .pos0 = hc->pos0[s],
                             .history = hist[s], .n_history = nh, .ring_hi = -1};
        T += hc->rows[s];
    }
    int32_t *ids = chk_malloc(T * 4), *row_seq = chk_malloc(T * 4);
    int32_t *map = chk_malloc(hc->vocab * 4);
    for (uint32_t s = 0, t = 0; s < hc->n_seqs; s++)
        for (uint32_t i = 0; i < hc->rows[s]; i++, t++) {
            ids[t] = (int32_t)di_rng_below(&rng, hc->vocab);
            row_seq[t] = (int32_t)s;
        }
    for (uint32_t v = 0; v < hc->vocab; v++)
        map[v] = (int32_t)di_rng_below(&rng, hc->cvocab);
    size_t nc = (size_t)hc->n_layers * cols;
    uint64_t *mult = chk_malloc(hc->n_layers * hc->max_ngram * 8), *primes = chk_malloc(nc * 8);
    uint64_t *offs = chk_malloc(nc * 8);
    for (uint32_t i = 0; i < hc->n_layers * hc->max_ngram; i++) /* odd, below 2^63 / cvocab */
        mult[i] = (di_rng_u64(&rng) % ((UINT64_C(1) << 63) / hc->cvocab / 2)) * 2 + 1;
    uint64_t acc = 0;
    for (size_t i = 0; i < nc; i++) {
        primes[i] = 1000 + di_rng_below(&rng, 16000000);
        offs[i] = acc;
        acc += primes[i];
    }
    size_t on = (size_t)T * nc;
    int64_t *out = chk_malloc(on * 8), *gout = chk_malloc(on * 8);
    chk_poison(out, on * 8);
    char what[200];
    snprintf(what, sizeof(what), "engram_hash layers=%u max_ngram=%u heads=%u seqs=%u rows=%u "
             "seed=%" PRIu64, hc->n_layers, hc->max_ngram, hc->heads, hc->n_seqs, T, seed);
    int64_t *dout = chk_dev_copy(env, out, on * 8);
    kern_engram_hash p = {.n_rows = T, .n_layers = hc->n_layers, .max_ngram = hc->max_ngram,
                          .n_heads = hc->heads, .ids = ids, .row_seq = row_seq, .seqs = seqs,
                          .token_map = map, .vocab = hc->vocab, .pad_id = map[2],
                          .multipliers = mult, .primes = primes, .offsets = offs, .out = dout};
    size_t bad = chk_gpu_status(env, env->gpu.ops.engram_hash(env->gpu.ctx, &p), what);
    chk_get(env, gout, dout, on * 8);
    p.out = out;
    chk_cpu_status(env->cpu.ops.engram_hash(env->cpu.ctx, &p), what);
    if (!bad)
        bad = chk_cmp_i64(what, out, gout, on);
    chk_count(env, bad);
    /* the step's ids in device memory (one step ahead): the same hashes */
    int32_t *dids = chk_dev_copy(env, ids, (size_t)T * 4);
    chk_poison(gout, on * 8);
    chk_put(env, dout, gout, on * 8);
    p.out = dout;
    p.ids = NULL;
    p.ids_dev = dids;
    snprintf(what + strlen(what), sizeof(what) - strlen(what), " ids_dev");
    bad = chk_gpu_status(env, env->gpu.ops.engram_hash(env->gpu.ctx, &p), what);
    chk_get(env, gout, dout, on * 8);
    if (!bad)
        bad = chk_cmp_i64(what, out, gout, on);
    chk_count(env, bad);
    chk_dev_free(env, dids);
    chk_dev_free(env, dout);
    for (uint32_t s = 0; s < hc->n_seqs; s++)
        free(hist[s]);
    free(ids), free(row_seq), free(map), free(mult), free(primes), free(offs), free(out), free(gout);
}

/* A table generated on demand: a pure function of the row (both backends get it). */
static void gen_row(void *ud, uint64_t row, uint8_t *codes, uint8_t *scales)
{
    uint32_t hd = *(const uint32_t *)ud;
    di_rng r;
    di_rng_init(&r, row * 7919 + 17);
    for (uint32_t i = 0; i < hd; i++)
        codes[i] = (uint8_t)di_rng_u32(&r);
    for (uint32_t i = 0; i < hd / 32; i++)
        scales[i] = (uint8_t)(110 + di_rng_below(&r, 30));
}

static void check_engram_lookup(chk_env *env, uint32_t rows, uint32_t cols, uint32_t hd,
                                uint32_t stride_extra, uint64_t table_rows, int generated)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    size_t hs = cols + stride_extra, tb = generated ? 1 : (size_t)table_rows * hd;
    int64_t *hash = chk_malloc((size_t)rows * hs * 8);
    for (size_t i = 0; i < (size_t)rows * hs; i++)
        hash[i] = (int64_t)di_rng_below(&rng, table_rows);
    hash[0] = 0, hash[(size_t)(rows - 1) * hs + cols - 1] = (int64_t)table_rows - 1;
    uint8_t *table = chk_malloc(tb), *scale = chk_malloc(tb / 32 + 1);
    for (size_t i = 0; !generated && i < tb; i++)
        table[i] = (uint8_t)di_rng_u32(&rng);
    for (size_t i = 0; !generated && i < tb / 32; i++)
        scale[i] = (uint8_t)(100 + di_rng_below(&rng, 50));
    size_t on = (size_t)rows * cols * hd;
    uint16_t *out = chk_malloc(on * 2), *gout = chk_malloc(on * 2);
    chk_fill_u16(out, on, CHK_POISON_BF16);
    char what[200];
    snprintf(what, sizeof(what), "engram_lookup rows=%u cols=%u hd=%u hash_stride=%zu table_rows=%" PRIu64
             " generated=%d seed=%" PRIu64, rows, cols, hd, hs, table_rows, generated, seed);
    int64_t *dhash = chk_dev_copy(env, hash, (size_t)rows * hs * 8);
    uint8_t *dtable = chk_dev_copy(env, table, tb), *dscale = chk_dev_copy(env, scale, tb / 32 + 1);
    uint16_t *dout = chk_dev_copy(env, out, on * 2);
    kern_engram_lookup p = {.n_rows = rows, .n_cols = cols, .head_dim = hd, .hash = dhash,
                            .hash_stride = hs, .table = generated ? NULL : dtable,
                            .table_scale = generated ? NULL : dscale, .table_rows = table_rows,
                            .row_fn = generated ? gen_row : NULL, .row_userdata = &hd, .out = dout};
    size_t bad = chk_gpu_status(env, env->gpu.ops.engram_lookup(env->gpu.ctx, &p), what);
    chk_get(env, gout, dout, on * 2);
    p.hash = hash, p.table = generated ? NULL : table, p.table_scale = generated ? NULL : scale;
    p.out = out;
    chk_cpu_status(env->cpu.ops.engram_lookup(env->cpu.ctx, &p), what);
    if (!bad)
        bad = chk_cmp_bf16_exact(what, out, gout, on);
    chk_count(env, bad);
    chk_dev_free(env, dhash), chk_dev_free(env, dtable), chk_dev_free(env, dscale);
    chk_dev_free(env, dout);
    free(hash), free(table), free(scale), free(out), free(gout);
}

static void check_engram_gate(chk_env *env, uint32_t rows, uint32_t hc, uint32_t dim, int mode,
                              int wmode)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    size_t hn = (size_t)rows * hc * dim, kn = (size_t)rows * (hc + 1) * dim;
    uint16_t *h = chk_malloc(hn * 2), *gh = chk_malloc(hn * 2), *kv = chk_malloc(kn * 2);
    uint16_t *qw = chk_malloc((size_t)hc * dim * 2), *kw = chk_malloc((size_t)hc * dim * 2);
    chk_fill_bf16(h, hn, mode, &rng);
    chk_fill_bf16(kv, kn, mode == CHK_ZEROS ? CHK_NORMAL : mode, &rng);
    chk_fill_bf16(qw, (size_t)hc * dim, wmode, &rng);
    chk_fill_bf16(kw, (size_t)hc * dim, wmode, &rng);
    char what[200];
    snprintf(what, sizeof(what), "engram_gate rows=%u hc=%u dim=%u h=%s weights=%s seed=%" PRIu64,
             rows, hc, dim, chk_mode_name[mode], chk_mode_name[wmode], seed);
    uint16_t *dh = chk_dev_copy(env, h, hn * 2), *dkv = chk_dev_copy(env, kv, kn * 2);
    uint16_t *dq = chk_dev_copy(env, qw, (size_t)hc * dim * 2), *dk = chk_dev_copy(env, kw, (size_t)hc * dim * 2);
    kern_engram_gate p = {.n_rows = rows, .n_copies = hc, .dim = dim, .h = dh, .kv = dkv,
                          .q_weight = dq, .k_weight = dk, .eps = 1e-20, .clamp = 1e-6};
    size_t bad = chk_gpu_status(env, env->gpu.ops.engram_gate(env->gpu.ctx, &p), what);
    chk_get(env, gh, dh, hn * 2);
    p.h = h, p.kv = kv, p.q_weight = qw, p.k_weight = kw;
    chk_cpu_status(env->cpu.ops.engram_gate(env->cpu.ctx, &p), what);
    if (!bad)
        bad = chk_cmp_bf16_ulp(what, h, gh, NULL, hn, 1);
    chk_count(env, bad);
    chk_dev_free(env, dh), chk_dev_free(env, dkv), chk_dev_free(env, dq), chk_dev_free(env, dk);
    free(h), free(gh), free(kv), free(qw), free(kw);
}

static void sweep_engram(chk_env *env)
{
    static const hash_case hcs[] = {
        {1, 3, 2, 1, {5, 0, 0, 0}, {0, 0, 0, 0}, 4096, 3000},
        {2, 4, 4, 3, {1, 3, 40, 0}, {0, 1, 2, 0}, 8192, 6000},
        {2, 4, 8, 4, {1, 1, 63, 2}, {5000, 3, 100, 1}, 129280, 99092},
        {1, 8, 3, 2, {127, 1}, {0, 9}, 1000, 999},
        {3, 2, 1, 1, {3, 0, 0, 0}, {7, 0, 0, 0}, 50, 7},
    };
    int c0 = env->checks;
    for (size_t i = 0; i < sizeof(hcs) / sizeof(hcs[0]); i++)
        check_engram_hash(env, &hcs[i]);
    printf("engram_hash: %d cases\n", env->checks - c0);
    c0 = env->checks;
    check_engram_lookup(env, 1, 24, 256, 24, 5000, 0);
    check_engram_lookup(env, 3, 4, 32, 0, 4062, 0);
    check_engram_lookup(env, 63, 12, 64, 12, 48400, 0);
    check_engram_lookup(env, 127, 24, 256, 0, 300, 0);
    check_engram_lookup(env, 5, 24, 256, 24, 384006168, 1);
    check_engram_lookup(env, 2, 4, 32, 0, 7, 1);
    printf("engram_lookup: %d cases\n", env->checks - c0);
    c0 = env->checks;
    static const uint32_t rows[] = {1, 3, 63, 127};
    for (int mode = 0; mode < CHK_MODES; mode++)
        for (size_t r = 0; r < 4; r++)
            check_engram_gate(env, rows[r], r == 1 ? 2 : 4, r % 2 ? 5120 : 128, mode,
                              mode % 2 ? CHK_ONES : CHK_NORMAL);
    printf("engram_gate: %d cases\n", env->checks - c0);
}

/* ---- refused inputs ---- */

static void check_refusals(chk_env *env)
{
    kern_ops *o = &env->gpu.ops;
    void *c = env->gpu.ctx;
    uint8_t *d = chk_dev_alloc(env, 1 << 16);
    float *f = (float *)d;
    uint16_t *h = (uint16_t *)(d + 32768);
    size_t bad = 0;
    kern_hc_mixes mx = {.n_rows = 1, .n_copies = 9, .dim = 32, .h = h, .fn = f, .base = f,
                        .scale = f, .sinkhorn_iters = 20, .pre = f, .post = f, .comb = f};
    bad += chk_expect(env, o->hc_mixes(c, NULL), DI_EINVAL, "hc_mixes(NULL)");
    bad += chk_expect(env, o->hc_mixes(c, &mx), DI_EINVAL, "hc_mixes n_copies 9");
    mx.n_copies = 4, mx.sinkhorn_iters = 0;
    bad += chk_expect(env, o->hc_mixes(c, &mx), DI_EINVAL, "hc_mixes 0 Sinkhorn iterations");
    mx.sinkhorn_iters = 20, mx.fn = NULL;
    bad += chk_expect(env, o->hc_mixes(c, &mx), DI_EINVAL, "hc_mixes fn NULL");
    kern_hc_expand ex = {.n_rows = 1, .n_copies = 4, .dim = 32, .y = h, .h = h, .post = f,
                         .comb = f, .out = h};
    bad += chk_expect(env, o->hc_expand(c, &ex), DI_EINVAL, "hc_expand out aliasing h");
    kern_hc_collapse co = {.n_rows = 1, .n_copies = 4, .dim = 32, .h = h, .pre = f,
                           .pre_stride = 2, .out = h + 512, .out_stride = 32};
    bad += chk_expect(env, o->hc_collapse(c, &co), DI_EINVAL, "hc_collapse pre_stride 2 < 4");
    int32_t rows[2] = {0, -1};
    kern_copy_rows cr = {.n_rows = 2, .row_bytes = 8, .src = d, .src_stride = 8, .rows = rows,
                         .dst = d + 4096, .dst_stride = 8};
    bad += chk_expect(env, o->copy_rows(c, &cr), DI_EINVAL, "copy_rows row -1");
    rows[1] = 1, cr.src_stride = 4;
    bad += chk_expect(env, o->copy_rows(c, &cr), DI_EINVAL, "copy_rows src_stride 4 < 8");
    cr.src_stride = 8;
    kern_seq q = {.row0 = 0, .n_rows = 1, .pos0 = 5, .n_history = 0, .ring_hi = -1};
    int32_t ids[1] = {3}, rs[1] = {0}, map[8] = {0};
    uint64_t m[3] = {1, 3, 5}, pr[4] = {7, 11, 13, 17}, of[4] = {0};
    kern_engram_hash eh = {.n_rows = 1, .n_layers = 1, .max_ngram = 3, .n_heads = 2, .ids = ids,
                           .row_seq = rs, .seqs = &q, .token_map = map, .vocab = 8,
                           .multipliers = m, .primes = pr, .offsets = of, .out = (int64_t *)d};
    bad += chk_expect(env, o->engram_hash(c, &eh), DI_EINVAL, "engram_hash lookback without history");
    q.pos0 = 0, ids[0] = 8;
    bad += chk_expect(env, o->engram_hash(c, &eh), DI_EINVAL, "engram_hash token 8 of 8");
    eh.max_ngram = 9;
    bad += chk_expect(env, o->engram_hash(c, &eh), DI_EINVAL, "engram_hash max_ngram 9");
    kern_engram_lookup el = {.n_rows = 1, .n_cols = 2, .head_dim = 48, .hash = (int64_t *)d,
                             .hash_stride = 2, .table = d, .table_scale = d, .table_rows = 4,
                             .out = h};
    bad += chk_expect(env, o->engram_lookup(c, &el), DI_EINVAL, "engram_lookup head_dim 48");
    el.head_dim = 32, el.table = NULL;
    bad += chk_expect(env, o->engram_lookup(c, &el), DI_EINVAL, "engram_lookup no table, no row_fn");
    bad += chk_expect(env, o->copy_rows(c, &cr), DI_OK, "copy_rows after refusals");
    chk_sync(env);
    chk_count(env, bad);
    printf("refused inputs: %s\n", bad ? "MISMATCHES" : "all refused with DI_EINVAL");
    chk_dev_free(env, d);
}

/* ---- the sweeps ---- */

static void sweep_hc(chk_env *env)
{
    static const uint32_t rows[] = {1, 3, 63, 127};
    int c0 = env->checks;
    for (int mode = 0; mode < CHK_MODES; mode++)
        for (size_t r = 0; r < 4; r++) {
            mix_case mc = {rows[r], 4, r == 3 ? 128 : 5120, mode % 3 == 0 ? 1e-4 : 1e-2, mode, 20};
            if (rows[r] == 127 && mode > 3)
                mc.dim = 64;
            check_hc_mixes(env, &mc);
        }
    static const mix_case odd[] = {
        {3, 1, 96, 1e-2, CHK_NORMAL, 20}, {5, 2, 64, 1.0, CHK_NORMAL, 3},
        {2, 8, 160, 1e-2, CHK_NORMAL, 20}, {7, 4, 32, 10.0, CHK_NORMAL, 1},
        {1, 4, 5120, 0.5, CHK_LARGE, 20},
        {1500, 4, 4096, 1e-4, CHK_NORMAL, 20}, /* enough rows for a block per row, and for */
        {1203, 4, 5120, 1e-2, CHK_LARGE, 20},  /* the rows kernel (a last group of 3 rows) */
    };
    for (size_t i = 0; i < sizeof(odd) / sizeof(odd[0]); i++)
        check_hc_mixes(env, &odd[i]);
    printf("hc_mixes: %d cases\n", env->checks - c0);
    c0 = env->checks;
    for (int mode = 0; mode < CHK_MODES; mode++)
        for (size_t r = 0; r < 4; r++) {
            uint32_t hc = r == 1 ? 2 : (r == 2 && mode == CHK_NORMAL ? 8 : 4);
            ce_case cc = {rows[r], hc, r % 2 ? 5120 : 96, r == 0 ? 0u : hc + (r == 3 ? 3u : 0u),
                          r == 2 ? 5u : 0u, mode};
            check_hc_collapse(env, &cc);
            check_hc_expand(env, &cc);
        }
    printf("hc_collapse, hc_expand: %d cases\n", env->checks - c0);
}

static void sweep_copy(chk_env *env)
{
    static const copy_case cases[] = {
        {1, 16, 16, 16, 4, 0, 0, 0},        {3, 3, 5, 7, 9, 0, 0, 1},
        {63, 10240, 10240, 10240, 100, 0, 0, 0}, {127, 66, 66, 70, 200, 0, 0, 2},
        {64, 1024, 1024, 1024, 64, 1, 0, 0}, {17, 40960, 40960, 40960, 40, 0, 1, 0},
        {5, 8, 8, 8, 5, 0, 1, 0},           {100, 528, 528, 528, 300, 0, 1, 0},
        {9, 4, 12, 4, 30, 0, 0, 8},         {33, 2, 2, 6, 33, 1, 0, 0},
    };
    int c0 = env->checks;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        check_copy_rows(env, &cases[i]);
    printf("copy_rows: %d cases\n", env->checks - c0);
}

/* ---- benchmark ---- */

enum { B_ROWS = 384, B_HC = 4, B_DIM = 5120, B_SETS = 8 };

typedef struct bench_arg {
    chk_env *env;
    int op;                     /* 0 mixes, 1 collapse, 2 expand */
    uint16_t *h[B_SETS], *out[B_SETS], *y;
    float *fn, *base, *scale, *coef;
    uint32_t rows;
} bench_arg;

static di_status bench_call(void *varg, int i)
{
    bench_arg *a = varg;
    kern_backend *g = &a->env->gpu;
    int s = i % B_SETS;
    if (a->op == 0) {
        kern_hc_mixes p = {.n_rows = a->rows, .n_copies = B_HC, .dim = B_DIM, .h = a->h[s],
                           .fn = a->fn, .base = a->base, .scale = a->scale, .sinkhorn_iters = 20,
                           .eps = 1e-6, .norm_eps = 1e-20f, .pre = a->coef,
                           .post = a->coef + a->rows * B_HC, .comb = a->coef + 2 * a->rows * B_HC};
        return g->ops.hc_mixes(g->ctx, &p);
    }
    if (a->op == 1) {
        kern_hc_collapse p = {.n_rows = a->rows, .n_copies = B_HC, .dim = B_DIM, .h = a->h[s],
                              .pre = a->coef, .pre_stride = B_HC, .out = a->out[s],
                              .out_stride = B_DIM};
        return g->ops.hc_collapse(g->ctx, &p);
    }
    kern_hc_expand p = {.n_rows = a->rows, .n_copies = B_HC, .dim = B_DIM, .y = a->y, .h = a->h[s],
                        .post = a->coef, .comb = a->coef + a->rows * B_HC, .out = a->out[s]};
    return g->ops.hc_expand(g->ctx, &p);
}

static void bench(chk_env *env)
{
    double copy = gpu_copy_gbs((size_t)1 << 30, 20);
    bench_arg a = {.env = env};
    di_rng rng;
    chk_case_rng(env, &rng);
    size_t hn = (size_t)4096 * B_HC * B_DIM, fnn = (size_t)24 * B_HC * B_DIM;
    uint16_t *h = chk_malloc(hn * 2);
    chk_fill_bf16_fast(h, hn, 1.0f, &rng);
    for (int s = 0; s < B_SETS; s++) {
        a.h[s] = chk_dev_copy(env, h, hn * 2);
        a.out[s] = chk_dev_alloc(env, hn * 2);
    }
    a.y = chk_dev_copy(env, h, (size_t)4096 * B_DIM * 2);
    float *f = chk_malloc(fnn * 4);
    chk_fill_f32(f, fnn, 1e-4, &rng);
    a.fn = chk_dev_copy(env, f, fnn * 4);
    for (size_t i = 0; i < 4096 * 24; i++)
        f[i] = 0.25f;
    a.base = chk_dev_copy(env, f, 24 * 4);
    a.scale = chk_dev_copy(env, f, 3 * 4);
    a.coef = chk_dev_copy(env, f, (size_t)4096 * 24 * 4);
    free(h), free(f);
    static const uint32_t rows[] = {64, 384, 4096};
    static const char *const names[] = {"hc_mixes", "hc_collapse", "hc_expand"};
    printf("\n%-12s %6s %9s %9s %10s %8s\n", "op", "rows", "us", "GB/s", "copy GB/s", "of copy");
    for (int op = 0; op < 3; op++)
        for (int r = 0; r < 3; r++) {
            a.op = op;
            a.rows = rows[r];
            double ms = chk_time_ms(env, bench_call, &a, 3, 20);
            /* bytes once: h [rows, 4, D] bf16 in; mixes: fn once; collapse: [rows, D] out;
             * expand: y in and [rows, 4, D] out */
            double hbytes = (double)rows[r] * B_HC * B_DIM * 2;
            double bytes = op == 0 ? hbytes + fnn * 4.0
                                   : (op == 1 ? hbytes + hbytes / B_HC : 2 * hbytes + hbytes / B_HC);
            if (ms <= 0) {
                printf("%-12s %6u failed (message above)\n", names[op], rows[r]);
                continue;
            }
            double gbs = bytes / (ms * 1e-3) / 1e9;
            printf("%-12s %6u %9.1f %9.0f %10.0f %7.0f%%\n", names[op], rows[r], ms * 1e3, gbs,
                   copy, 100.0 * gbs / copy);
        }
    printf("(hc 4, D 5120; GB/s = bytes read and written once / time; inputs rotate over %d sets)\n",
           B_SETS);
    for (int s = 0; s < B_SETS; s++) {
        chk_dev_free(env, a.h[s]);
        chk_dev_free(env, a.out[s]);
    }
    chk_dev_free(env, a.y), chk_dev_free(env, a.fn), chk_dev_free(env, a.base);
    chk_dev_free(env, a.scale), chk_dev_free(env, a.coef);
}

int main(int argc, char **argv)
{
    chk_env env;
    int want_bench = chk_init(&env, argc, argv, usage);
    sweep_hc(&env);
    sweep_copy(&env);
    sweep_engram(&env);
    check_refusals(&env);
    return chk_finish(&env, "check_misc", want_bench, bench);
}
