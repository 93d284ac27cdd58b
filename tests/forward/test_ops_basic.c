/* Embedding, RMSNorm, RoPE and hyper-connection ops against double-precision formulations. */
#include <criterion/criterion.h>

#include "tests/forward/testutil.h"

static int bf16_close(double got, double ref)
{
    return fabs(got - ref) <= fabs(ref) / 256.0 + 1e-30;
}

Test(ops_basic, embed_copies_rows_to_every_copy)
{
    kern_backend be = test_backend(1);
    uint16_t table[5 * 32], out[3 * 4 * 32];
    for (int i = 0; i < 5 * 32; i++)
        table[i] = di_f32_to_bf16((float)i);
    int32_t ids[3] = {4, 0, 4};
    kern_embed p = {.n_rows = 3, .dim = 32, .n_copies = 4, .vocab = 5, .ids = ids,
                    .table = table, .out = out};
    cr_assert_eq(be.ops.embed(be.ctx, &p), DI_OK);
    for (int t = 0; t < 3; t++)
        for (int c = 0; c < 4; c++)
            cr_assert_eq(memcmp(out + (t * 4 + c) * 32, table + ids[t] * 32, 64), 0);
    kern_cpu_destroy(&be);
}

Test(ops_basic, rmsnorm_matches_double_and_zero_rows_stay_zero)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 3);
    const uint32_t rows = 63, dim = 96;
    uint16_t *x = malloc(rows * dim * 2), *y = malloc(rows * dim * 2), w[96];
    fill_bf16(w, dim, FILL_NORMAL, &r, 1.0f);
    for (int mode = 0; mode < FILL_N_MODES; mode++) {
        fill_bf16(x, rows * dim, mode, &r, 5.0f);
        kern_rmsnorm p = {.n_rows = rows, .dim = dim, .x = x, .x_stride = dim, .weight = w,
                          .y = y, .y_stride = dim, .eps = 1e-20f};
        cr_assert_eq(be.ops.rmsnorm(be.ctx, &p), DI_OK);
        for (uint32_t t = 0; t < rows; t++) {
            double ss = 0;
            for (uint32_t i = 0; i < dim; i++)
                ss += bfd(x[t * dim + i]) * bfd(x[t * dim + i]);
            double inv = 1.0 / sqrt(ss / dim + 1e-20);
            for (uint32_t i = 0; i < dim; i++) {
                double ref = bfd(w[i]) * bfd(x[t * dim + i]) * inv;
                double got = bfd(y[t * dim + i]);
                cr_assert(!isnan(got));
                cr_assert(bf16_close(got, ref) || fabs(got - ref) <= 1e-6 * fabs(ref) + 1e-30,
                          "mode %s row %u col %u: %g vs %g", fill_name(mode), t, i, got, ref);
            }
        }
    }
    free(x);
    free(y);
    kern_cpu_destroy(&be);
}

/* The spec's YaRN facts for base 160000: lo = 15, hi = 25 (MODEL.md §2.4), with the op's
 * rounding contract: fp32 base frequency, fp32(f / 16), blend in double rounded once. */
static float yarn_freq(int i, double base, int yarn)
{
    float f = (float)pow(base, -2.0 * i / 64.0);
    if (!yarn)
        return f;
    double ramp = (i - 15.0) / 10.0;
    ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
    double scaled = (float)((double)f / 16.0);
    return (float)((double)f * (1 - ramp) + scaled * ramp);
}

Test(ops_basic, rope_rotates_adjacent_pairs_of_the_last_numbers_with_yarn)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 4);
    const uint32_t rows = 5, heads = 3, hd = 128;
    int64_t pos[5] = {0, 1, 127, 16389, 1000000};
    uint16_t *x = malloc(rows * heads * hd * 2), *orig = malloc(rows * heads * hd * 2);
    for (int yarn = 0; yarn < 2; yarn++) {
        double base = yarn ? 160000.0 : 10000.0;
        fill_bf16(x, rows * heads * hd, FILL_NORMAL, &r, 1.0f);
        memcpy(orig, x, rows * heads * hd * 2);
        kern_rope p = {.n_rows = rows, .n_heads = heads, .x = x, .row_stride = heads * hd,
                       .head_stride = hd, .offset = hd - 64, .rope_dim = 64, .positions = pos,
                       .base = (float)base, .yarn = yarn, .yarn_factor = 16,
                       .yarn_orig_len = 65536, .yarn_beta_fast = 32, .yarn_beta_slow = 1};
        cr_assert_eq(be.ops.rope(be.ctx, &p), DI_OK);
        for (uint32_t t = 0; t < rows; t++)
            for (uint32_t h = 0; h < heads; h++) {
                const uint16_t *a = orig + (t * heads + h) * hd, *b = x + (t * heads + h) * hd;
                cr_assert_eq(memcmp(a, b, (hd - 64) * 2), 0, "numbers before the rope part change");
                for (int i = 0; i < 32; i++) {
                    float ang = (float)pos[t] * yarn_freq(i, base, yarn);
                    double c = cos((double)ang), s = sin((double)ang);
                    double x0 = bfd(a[hd - 64 + 2 * i]), x1 = bfd(a[hd - 64 + 2 * i + 1]);
                    double r0 = x0 * c - x1 * s, r1 = x0 * s + x1 * c;
                    double mag = fabs(x0) + fabs(x1);
                    cr_assert(fabs(bfd(b[hd - 64 + 2 * i]) - r0) <= fabs(r0) / 256 + 1e-6 * mag,
                              "yarn %d pos %lld pair %d: %g vs %g", yarn, (long long)pos[t], i,
                              bfd(b[hd - 64 + 2 * i]), r0);
                    cr_assert(fabs(bfd(b[hd - 64 + 2 * i + 1]) - r1) <= fabs(r1) / 256 + 1e-6 * mag);
                }
            }
        /* inverse undoes it up to bf16 rounding */
        p.inverse = 1;
        cr_assert_eq(be.ops.rope(be.ctx, &p), DI_OK);
        for (size_t i = 0; i < rows * heads * hd; i += 2) {
            double mag = fabs(bfd(orig[i])) + fabs(bfd(orig[i + 1]));
            cr_assert(fabs(bfd(x[i]) - bfd(orig[i])) <= 0.01 * mag + 1e-30);
            cr_assert(fabs(bfd(x[i + 1]) - bfd(orig[i + 1])) <= 0.01 * mag + 1e-30);
        }
    }
    free(x);
    free(orig);
    kern_cpu_destroy(&be);
}

/* MODEL.md §2.3 in double. */
static void ref_mixes(const uint16_t *h, const float *fn, const float *base, const float *scale,
                      uint32_t D, double pre[4], double post[4], double comb[16])
{
    uint32_t W = 4 * D;
    double ss = 0, m[24];
    for (uint32_t i = 0; i < W; i++)
        ss += bfd(h[i]) * bfd(h[i]);
    double rs = 1.0 / sqrt(ss / W + 1e-20);
    for (int i = 0; i < 24; i++) {
        double acc = 0;
        for (uint32_t k = 0; k < W; k++)
            acc += (double)fn[(size_t)i * W + k] * bfd(h[k]);
        m[i] = acc * rs;
    }
    for (int c = 0; c < 4; c++) {
        pre[c] = 1 / (1 + exp(-(m[c] * scale[0] + base[c]))) + 1e-6;
        post[c] = 2 / (1 + exp(-(m[4 + c] * scale[1] + base[4 + c])));
    }
    double S[16];
    for (int i = 0; i < 4; i++) {
        double mx = -1e300, sum = 0;
        for (int j = 0; j < 4; j++) {
            S[i * 4 + j] = m[8 + i * 4 + j] * scale[2] + base[8 + i * 4 + j];
            mx = S[i * 4 + j] > mx ? S[i * 4 + j] : mx;
        }
        for (int j = 0; j < 4; j++)
            sum += (S[i * 4 + j] = exp(S[i * 4 + j] - mx));
        for (int j = 0; j < 4; j++)
            S[i * 4 + j] = S[i * 4 + j] / sum + 1e-6;
    }
    for (int it = 0; it < 20; it++) {
        if (it) {
            for (int i = 0; i < 4; i++) {
                double sum = 0;
                for (int j = 0; j < 4; j++)
                    sum += S[i * 4 + j];
                for (int j = 0; j < 4; j++)
                    S[i * 4 + j] /= sum + 1e-6;
            }
        }
        for (int j = 0; j < 4; j++) {
            double sum = 0;
            for (int i = 0; i < 4; i++)
                sum += S[i * 4 + j];
            for (int i = 0; i < 4; i++)
                S[i * 4 + j] /= sum + 1e-6;
        }
    }
    memcpy(comb, S, sizeof(S));
}

Test(ops_basic, hc_mixes_match_double_and_comb_columns_sum_to_one)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 8);
    const uint32_t rows = 3, D = 64, W = 4 * D;
    uint16_t *h = malloc(rows * W * 2);
    float *fn = malloc(24 * W * sizeof(float)), base[24], scale[3] = {0.7f, 1.3f, 2.0f};
    fill_f32(fn, 24 * W, FILL_NORMAL, &r, 0.05f);
    fill_f32(base, 24, FILL_NORMAL, &r, 0.5f);
    float pre[12], post[12], comb[48];
    for (int mode = 0; mode < FILL_N_MODES; mode++) {
        fill_bf16(h, rows * W, mode, &r, 1.0f);
        kern_hc_mixes p = {.n_rows = rows, .n_copies = 4, .dim = D, .h = h, .fn = fn,
                           .base = base, .scale = scale, .sinkhorn_iters = 20, .eps = 1e-6f,
                           .norm_eps = 1e-20f, .pre = pre, .post = post, .comb = comb};
        cr_assert_eq(be.ops.hc_mixes(be.ctx, &p), DI_OK);
        for (uint32_t t = 0; t < rows; t++) {
            double rp[4], rq[4], rc[16];
            ref_mixes(h + t * W, fn, base, scale, D, rp, rq, rc);
            for (int c = 0; c < 4; c++) {
                cr_assert(fabs(pre[t * 4 + c] - rp[c]) < 1e-5, "mode %s pre %g vs %g",
                          fill_name(mode), pre[t * 4 + c], rp[c]);
                cr_assert(fabs(post[t * 4 + c] - rq[c]) < 1e-5);
            }
            for (int j = 0; j < 4; j++) {
                double col = 0;
                for (int i = 0; i < 4; i++) {
                    cr_assert(fabs(comb[t * 16 + i * 4 + j] - rc[i * 4 + j]) < 1e-5,
                              "comb %d %d: %g vs %g", i, j, comb[t * 16 + i * 4 + j], rc[i * 4 + j]);
                    col += comb[t * 16 + i * 4 + j];
                }
                cr_assert(fabs(col - 1.0) < 1e-4, "column %d sums to %g", j, col);
            }
        }
    }
    free(h);
    free(fn);
    kern_cpu_destroy(&be);
}

Test(ops_basic, hc_collapse_and_expand_match_double)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 12);
    const uint32_t rows = 127, D = 32;
    uint16_t *h = malloc(rows * 4 * D * 2), *y = malloc(rows * D * 2);
    uint16_t *x = malloc(rows * D * 2), *h2 = malloc(rows * 4 * D * 2);
    float *pre = malloc(rows * 4 * 4), *post = malloc(rows * 4 * 4), *comb = malloc(rows * 16 * 4);
    for (int mode = 0; mode < FILL_N_MODES; mode++) {
        fill_bf16(h, rows * 4 * D, mode, &r, 1.0f);
        fill_bf16(y, rows * D, FILL_NORMAL, &r, 1.0f);
        fill_f32(pre, rows * 4, FILL_NORMAL, &r, 1.0f);
        fill_f32(post, rows * 4, FILL_NORMAL, &r, 1.0f);
        fill_f32(comb, rows * 16, FILL_NORMAL, &r, 1.0f);
        kern_hc_collapse c = {.n_rows = rows, .n_copies = 4, .dim = D, .h = h, .pre = pre,
                              .pre_stride = 4, .out = x, .out_stride = D};
        kern_hc_expand e = {.n_rows = rows, .n_copies = 4, .dim = D, .y = y, .h = h,
                            .post = post, .comb = comb, .out = h2};
        cr_assert_eq(be.ops.hc_collapse(be.ctx, &c), DI_OK);
        cr_assert_eq(be.ops.hc_expand(be.ctx, &e), DI_OK);
        for (uint32_t t = 0; t < rows; t++)
            for (uint32_t d = 0; d < D; d++) {
                double ref = 0, mag = 0;
                for (int k = 0; k < 4; k++) {
                    ref += (double)pre[t * 4 + k] * bfd(h[(t * 4 + k) * D + d]);
                    mag += fabs((double)pre[t * 4 + k] * bfd(h[(t * 4 + k) * D + d]));
                }
                cr_assert(close_to(bfd(x[t * D + d]), ref, mag, 1));
                for (int j = 0; j < 4; j++) {
                    double o = (double)post[t * 4 + j] * bfd(y[t * D + d]), om = fabs(o);
                    for (int i = 0; i < 4; i++) {
                        double term = (double)comb[t * 16 + i * 4 + j] * bfd(h[(t * 4 + i) * D + d]);
                        o += term;
                        om += fabs(term);
                    }
                    cr_assert(close_to(bfd(h2[(t * 4 + j) * D + d]), o, om, 1),
                              "expand mode %s: %g vs %g", fill_name(mode),
                              bfd(h2[(t * 4 + j) * D + d]), o);
                }
            }
    }
    free(h);
    free(y);
    free(x);
    free(h2);
    free(pre);
    free(post);
    free(comb);
    kern_cpu_destroy(&be);
}

Test(ops_basic, copy_rows_gathers_and_compacts_in_place)
{
    kern_backend be = test_backend(1);
    uint16_t src[4 * 3], dst[2 * 5] = {0};
    for (int i = 0; i < 12; i++)
        src[i] = (uint16_t)i;
    int32_t rows[2] = {3, 1};
    kern_copy_rows p = {.n_rows = 2, .row_bytes = 6, .src = src, .src_stride = 6, .rows = rows,
                        .dst = dst, .dst_stride = 10};
    cr_assert_eq(be.ops.copy_rows(be.ctx, &p), DI_OK);
    cr_assert_eq(dst[0], 9);
    cr_assert_eq(dst[2], 11);
    cr_assert_eq(dst[5], 3);
    cr_assert_eq(dst[3], 0);
    int32_t keep[2] = {1, 3};
    kern_copy_rows c = {.n_rows = 2, .row_bytes = 6, .src = src, .src_stride = 6, .rows = keep,
                        .dst = src, .dst_stride = 6};
    cr_assert_eq(be.ops.copy_rows(be.ctx, &c), DI_OK);
    cr_assert_eq(src[0], 3);
    cr_assert_eq(src[3], 9);
    cr_assert_eq(src[5], 11);
    kern_cpu_destroy(&be);
}
