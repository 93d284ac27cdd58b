/* Indexer scores, candidate blocks and top-k of the CPU backend against brute force. */
#include <criterion/criterion.h>

#include "tests/forward/testutil.h"

/* (score desc, index asc) order for qsort. */
typedef struct ranked {
    float s;
    int32_t i;
} ranked;

static int by_rank(const void *a, const void *b)
{
    const ranked *x = a, *y = b;
    if (x->s != y->s)
        return x->s > y->s ? -1 : 1;
    return x->i - y->i;
}

static int cmp_i32(const void *a, const void *b)
{
    return *(const int32_t *)a - *(const int32_t *)b;
}

/* Brute-force top-k: sort everything, keep min(k, n), sort ids, pad -1. */
static void ref_topk(const float *sc, int32_t n, uint32_t k, int32_t *out)
{
    ranked *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(ranked));
    for (int32_t i = 0; i < n; i++)
        v[i] = (ranked){sc[i], i};
    qsort(v, (size_t)n, sizeof(ranked), by_rank);
    uint32_t m = (uint32_t)n < k ? (uint32_t)n : k;
    for (uint32_t i = 0; i < m; i++)
        out[i] = v[i].i;
    qsort(out, m, sizeof(int32_t), cmp_i32);
    for (uint32_t i = m; i < k; i++)
        out[i] = -1;
    free(v);
}

/* Score patterns: random, all equal, few distinct values (many ties), -inf holes, arange. */
static float pattern(int mode, int32_t i, di_rng *r)
{
    switch (mode) {
    case 0:
        return di_bf16_round((float)di_rng_normal(r));
    case 1:
        return 0.5f;
    case 2:
        return (float)di_rng_below(r, 3);
    case 3:
        return di_rng_below(r, 3) == 0 ? -INFINITY : di_bf16_round((float)di_rng_normal(r));
    default:
        return (float)(i % 17);
    }
}

Test(ops_index, topk_equals_brute_force_with_ties_and_infinities)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 31);
    static const int32_t sizes[] = {0, 1, 3, 5, 63, 64, 65, 127, 300};
    const uint32_t K = 64, T = 9;
    size_t stride = 300;
    float *sc = malloc(T * stride * sizeof(float));
    int32_t nv[9], out[9 * 64], ref[64];
    for (int mode = 0; mode < 5; mode++) {
        for (uint32_t t = 0; t < T; t++) {
            nv[t] = sizes[t];
            for (size_t i = 0; i < stride; i++)
                sc[t * stride + i] = pattern(mode, (int32_t)i, &r);
        }
        kern_index_topk p = {.n_rows = T, .k = K, .scores = sc, .stride = stride,
                             .n_visible = nv, .out = out};
        cr_assert_eq(be.ops.index_topk(be.ctx, &p), DI_OK);
        for (uint32_t t = 0; t < T; t++) {
            ref_topk(sc + t * stride, nv[t], K, ref);
            cr_assert_eq(memcmp(ref, out + t * K, K * 4), 0, "mode %d n %d differs", mode, nv[t]);
        }
    }
    free(sc);
    kern_cpu_destroy(&be);
}

Test(ops_index, candidate_blocks_pin_the_newest_block_and_break_ties_low)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 32);
    static const int32_t sizes[] = {1, 3, 8, 9, 63, 127, 200};
    const uint32_t T = 7, blk = 8, keep = 4;
    size_t stride = 200, mstride = 25;
    float *sc = malloc(T * stride * sizeof(float));
    uint8_t mask[7 * 25];
    int32_t nv[7];
    for (int mode = 0; mode < 5; mode++) {
        for (uint32_t t = 0; t < T; t++) {
            nv[t] = sizes[t];
            for (size_t i = 0; i < stride; i++)
                sc[t * stride + i] = pattern(mode, (int32_t)i, &r);
        }
        kern_index_candidates p = {.n_rows = T, .scores = sc, .stride = stride, .n_visible = nv,
                                   .block = blk, .top_blocks = keep, .mask = mask,
                                   .mask_stride = mstride};
        cr_assert_eq(be.ops.index_candidates(be.ctx, &p), DI_OK);
        for (uint32_t t = 0; t < T; t++) {
            int32_t nb = (nv[t] + 7) / 8;
            ranked b[25];
            for (int32_t k = 0; k < nb; k++) {
                float m = -INFINITY;
                for (int32_t e = k * 8; e < (k + 1) * 8 && e < nv[t]; e++)
                    m = sc[t * stride + e] > m ? sc[t * stride + e] : m;
                b[k] = (ranked){m, k};
            }
            b[(nv[t] - 1) / 8].s = INFINITY;
            ranked sorted[25];
            memcpy(sorted, b, sizeof(ranked) * (size_t)nb);
            qsort(sorted, (size_t)nb, sizeof(ranked), by_rank);
            uint8_t want[25] = {0};
            for (int32_t k = 0; k < nb && k < (int32_t)keep; k++)
                want[sorted[k].i] = sorted[k].s != -INFINITY;
            cr_assert(mask[t * mstride + (nv[t] - 1) / 8], "newest block kept");
            cr_assert_eq(memcmp(want, mask + t * mstride, (size_t)nb), 0, "mode %d n %d", mode,
                         nv[t]);
        }
    }
    free(sc);
    kern_cpu_destroy(&be);
}

Test(ops_index, scores_match_double_and_honour_visibility_and_mask)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 33);
    const uint32_t nh = 3, id = 64, T = 4, n_ent = 70;
    size_t eb = id / 2 + id / 32;
    /* one block of 128 entries; keys FP4 (B) of random vectors */
    uint8_t *pool = calloc(2, 128 * eb);
    float x[64];
    for (uint32_t e = 0; e < n_ent; e++) {
        fill_f32(x, id, FILL_NORMAL, &r, 1.0f);
        di_quant_fp4_b32(x, id, pool + 128 * eb + e * eb, pool + 128 * eb + e * eb + id / 2);
    }
    uint32_t blocks[1] = {1};
    kern_seq s = {.row0 = 0, .n_rows = T, .pos0 = 0, .blocks = blocks, .n_blocks = 1,
                  .ring_hi = -1};
    uint16_t q[4 * 3 * 64], w[4 * 3];
    fill_bf16(q, T * nh * id, FILL_NORMAL, &r, 1.0f);
    fill_bf16(w, T * nh, FILL_NORMAL, &r, 1.0f);
    int32_t nv[4] = {0, 1, 33, 70}, rs[4] = {0, 0, 0, 0};
    uint8_t mask[4 * 9];
    for (int i = 0; i < 36; i++)
        mask[i] = (uint8_t)(i % 3 != 1);
    float sc[4 * 70];
    for (int masked = 0; masked < 2; masked++) {
        kern_index_scores p = {.n_rows = T, .n_heads = nh, .head_dim = id, .q = q, .w = w,
                               .w_scale = 0.0883883f, .n_visible = nv, .row_seq = rs, .seqs = &s,
                               .pool = {.blocks = pool, .block_bytes = 128 * eb,
                                        .entries_per_block = 128, .index_offset = 0,
                                        .index_entry_bytes = eb},
                               .cand_mask = masked ? mask : NULL, .cand_stride = 9,
                               .cand_block = 8, .scores = sc, .stride = 70};
        cr_assert_eq(be.ops.index_scores(be.ctx, &p), DI_OK);
        for (uint32_t t = 0; t < T; t++)
            for (int32_t e = 0; e < 70; e++) {
                float got = sc[t * 70 + e];
                if (e >= nv[t] || (masked && !mask[t * 9 + e / 8])) {
                    cr_assert(isinf(got) && got < 0, "row %u entry %d must be -inf", t, e);
                    continue;
                }
                float k[64];
                const uint8_t *ke = pool + 128 * eb + e * eb;
                di_dequant_fp4_b32(ke, ke + id / 2, id, k);
                double ref = 0, mag = 0;
                float rounded = 0.0f; /* MODEL.md §2.7: the reference's BF16 roundings */
                for (uint32_t h = 0; h < nh; h++) {
                    double d = 0;
                    for (uint32_t i = 0; i < id; i++)
                        d += bfd(q[(t * nh + h) * id + i]) * k[i];
                    double wh = (double)(float)(bfd(w[t * nh + h]) * 0.0883883f);
                    ref += wh * (d > 0 ? d : 0);
                    mag += fabs(wh * d);
                    float db = di_bf16_round((float)d), wb = di_bf16_round((float)wh);
                    rounded += di_bf16_round(wb * (db > 0.0f ? db : 0.0f));
                }
                cr_assert_eq(got, di_bf16_round(rounded), "row %u entry %d: %g vs %g", t, e,
                             got, di_bf16_round(rounded));
                cr_assert(fabs(got - ref) <= fabs(ref) / 64 + mag / 128,
                          "row %u entry %d: %g vs the exact %g", t, e, got, ref);
                cr_assert_eq(got, di_bf16_round(got), "scores are bf16 values");
            }
    }
    free(pool);
    kern_cpu_destroy(&be);
}
