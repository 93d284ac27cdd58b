/* MoE router, SwiGLU, experts and the Engram ops of the CPU backend against double-precision
 * formulations. */
#include <criterion/criterion.h>

#include "tests/forward/testutil.h"

Test(ops_moe, router_picks_by_biased_score_and_weights_by_raw_score)
{
    kern_backend be = test_backend(1);
    /* 6 experts, top 2. Scores s = sqrt(softplus(z)); bias flips the order of 0 and 4;
     * experts 2 and 3 tie exactly after the bias and the lower id wins. */
    float z[2 * 6] = {3.0f, -1.0f, 0.5f, 0.5f, 2.0f, -30.0f,
                      0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float bias[6] = {0.0f, 0.0f, 5.0f, 5.0f, 1.0f, 0.0f};
    int32_t ids[4];
    float w[4];
    kern_moe_gate p = {.n_rows = 2, .n_experts = 6, .top_k = 2, .logits = z, .bias = bias,
                       .temp = 1.0f, .route_scale = 1.5f, .ids = ids, .weights = w};
    cr_assert_eq(be.ops.moe_gate(be.ctx, &p), DI_OK);
    cr_assert_eq(ids[0], 2);
    cr_assert_eq(ids[1], 3);
    double s2 = sqrt(log1p(exp(0.5)));
    cr_assert(fabs(w[0] - 1.5 * s2 / (2 * s2)) < 1e-6);
    cr_assert(fabs(w[1] - 0.75) < 1e-6);
    cr_assert_eq(ids[2], 2, "all-zero logits: bias decides, ties to the lower id");
    cr_assert_eq(ids[3], 3);
    /* without bias expert 0 (z = 3) beats 4 (z = 2) */
    p.bias = NULL;
    p.n_rows = 1;
    cr_assert_eq(be.ops.moe_gate(be.ctx, &p), DI_OK);
    cr_assert_eq(ids[0], 0);
    cr_assert_eq(ids[1], 4);
    double a = sqrt(log1p(exp(3.0))), b = sqrt(log1p(exp(2.0)));
    cr_assert(fabs(w[0] - 1.5 * a / (a + b)) < 1e-6);
    cr_assert(fabs(w[1] - 1.5 * b / (a + b)) < 1e-6);
    kern_cpu_destroy(&be);
}

Test(ops_moe, swiglu_clamps_up_both_sides_and_gate_from_above_only)
{
    kern_backend be = test_backend(1);
    float gv[6] = {-20.0f, -3.0f, 0.0f, 2.0f, 12.0f, 50.0f};
    float uv[6] = {-15.0f, 1.0f, 4.0f, 11.0f, -0.5f, 30.0f};
    uint16_t g[6], u[6], h[12];
    for (int i = 0; i < 6; i++) {
        g[i] = di_f32_to_bf16(gv[i]);
        u[i] = di_f32_to_bf16(uv[i]);
    }
    float w[2] = {0.5f, 2.0f};
    uint16_t g2[12], u2[12];
    memcpy(g2, g, 12);
    memcpy(g2 + 6, g, 12);
    memcpy(u2, u, 12);
    memcpy(u2 + 6, u, 12);
    kern_swiglu p = {.n_rows = 2, .n = 6, .g = g2, .u = u2, .stride = 6, .w = w, .limit = 10.0f,
                     .h = h};
    cr_assert_eq(be.ops.swiglu(be.ctx, &p), DI_OK);
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 6; i++) {
            double gg = gv[i] > 10 ? 10 : gv[i]; /* no lower clamp on the gate */
            double uu = uv[i] < -10 ? -10 : (uv[i] > 10 ? 10 : uv[i]);
            double ref = gg / (1 + exp(-gg)) * uu * w[r];
            cr_assert(fabs(bfd(h[r * 6 + i]) - ref) <= fabs(ref) / 128 + 1e-12,
                      "row %d g %g u %g: %g vs %g", r, gv[i], uv[i], bfd(h[r * 6 + i]), ref);
        }
    cr_assert(bfd(h[0]) != 0.0 && fabs(bfd(h[0])) < 1e-5, "silu(-20) is tiny, not silu(-10)");
    kern_cpu_destroy(&be);
}

/* One expert in double: W2 bf16(swiglu(W1 x, W3 x) * w) with FP8 activations (numfmt). */
static void ref_expert(int fmt, const uint8_t *w1, const uint8_t *s1, const uint8_t *w3,
                       const uint8_t *s3, const uint8_t *w2, const uint8_t *s2, uint32_t D,
                       uint32_t I, const uint16_t *x, double weight, double *out)
{
    float xq[256], h[256];
    for (uint32_t i = 0; i < D; i++)
        xq[i] = di_bf16_to_f32(x[i]);
    di_fakequant_fp8_b32(xq, D);
    for (uint32_t n = 0; n < I; n++) {
        double g = 0, u = 0;
        for (uint32_t k = 0; k < D; k++) {
            g += xq[k] * weight_at(fmt, w1, s1, D, n, k);
            u += xq[k] * weight_at(fmt, w3, s3, D, n, k);
        }
        g = di_bf16_round((float)g);
        u = di_bf16_round((float)u);
        g = g > 10 ? 10 : g;
        u = u > 10 ? 10 : (u < -10 ? -10 : u);
        h[n] = di_bf16_round((float)(g / (1 + exp(-g)) * u * weight));
    }
    di_fakequant_fp8_b32(h, I);
    for (uint32_t n = 0; n < D; n++) {
        double acc = 0;
        for (uint32_t k = 0; k < I; k++)
            acc += h[k] * weight_at(fmt, w2, s2, I, n, k);
        out[n] = di_bf16_round((float)acc);
    }
}

Test(ops_moe, experts_combine_routed_and_shared_outputs)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 41);
    const uint32_t D = 64, I = 32, E = 4, K = 2, T = 5;
    uint8_t *w[4][3], *s[4][3], *sw[3], *ss[3];
    kern_expert ex[4], sh;
    for (uint32_t e = 0; e < E; e++)
        for (int j = 0; j < 3; j++) {
            uint32_t n = j == 1 ? D : I, k = j == 1 ? I : D;
            w[e][j] = malloc(n * k / 2);
            s[e][j] = malloc(n * (k / 32));
            rand_fp4_weight(w[e][j], s[e][j], n, k, &r);
        }
    for (int j = 0; j < 3; j++) {
        uint32_t n = j == 1 ? D : I, k = j == 1 ? I : D;
        sw[j] = malloc(n * k);
        ss[j] = malloc(((n + 31) / 32) * (k / 32));
        rand_fp8_weight(sw[j], ss[j], n, k, &r);
    }
    for (uint32_t e = 0; e < E; e++)
        ex[e] = (kern_expert){w[e][0], s[e][0], w[e][2], s[e][2], w[e][1], s[e][1]};
    sh = (kern_expert){sw[0], ss[0], sw[2], ss[2], sw[1], ss[1]};
    uint16_t x[5 * 64], y[5 * 64];
    fill_bf16(x, T * D, FILL_NORMAL, &r, 1.0f);
    int32_t ids[5 * 2] = {3, 0, 1, 2, 0, 3, 2, 1, 3, 1};
    float wt[5 * 2] = {0.9f, 0.6f, 1.0f, 0.5f, 0.2f, 1.3f, 0.7f, 0.8f, 1.1f, 0.4f};
    kern_moe_experts p = {.n_rows = T, .dim = D, .inter = I, .shared_inter = I, .n_experts = E,
                          .top_k = K, .x = x, .ids = ids, .weights = wt, .experts = ex,
                          .shared = sh, .swiglu_limit = 10.0f, .y = y};
    cr_assert_eq(be.ops.moe_experts(be.ctx, &p), DI_OK);
    double o[64], acc[64];
    for (uint32_t t = 0; t < T; t++) {
        memset(acc, 0, sizeof(acc));
        double mag[64] = {0};
        for (uint32_t k = 0; k < K; k++) {
            int e = ids[t * K + k];
            ref_expert(KERN_W_FP4, w[e][0], s[e][0], w[e][2], s[e][2], w[e][1], s[e][1], D, I,
                       x + t * D, wt[t * K + k], o);
            for (uint32_t d = 0; d < D; d++) {
                acc[d] += o[d];
                mag[d] += fabs(o[d]);
            }
        }
        ref_expert(KERN_W_FP8, sw[0], ss[0], sw[2], ss[2], sw[1], ss[1], D, I, x + t * D, 1.0, o);
        for (uint32_t d = 0; d < D; d++) {
            acc[d] += o[d];
            mag[d] += fabs(o[d]);
            /* intermediate bf16 roundings may flip: allow a few ulps of the magnitudes */
            cr_assert(fabs(bfd(y[t * D + d]) - acc[d]) <= 3e-2 * mag[d] + 1e-6,
                      "row %u col %u: %g vs %g", t, d, bfd(y[t * D + d]), acc[d]);
        }
    }
    for (uint32_t e = 0; e < E; e++)
        for (int j = 0; j < 3; j++) {
            free(w[e][j]);
            free(s[e][j]);
        }
    for (int j = 0; j < 3; j++) {
        free(sw[j]);
        free(ss[j]);
    }
    kern_cpu_destroy(&be);
}

/* ---- Engram ---- */

Test(ops_moe, engram_hash_is_the_rolling_xor_with_sticky_padding)
{
    kern_backend be = test_backend(1);
    /* one layer, n-grams up to 3, 2 heads; map = id + 100 */
    int32_t map[50];
    for (int i = 0; i < 50; i++)
        map[i] = i + 100;
    uint64_t mult[3] = {3, 5, 7}, primes[4] = {67, 71, 73, 79}, offs[4] = {0, 67, 138, 211};
    int32_t ids[4] = {10, 11, 12, 13}, rs[4] = {0, 0, 1, 1};
    int32_t hist[2] = {8, 9};
    /* seq 0: rows 0-1 at positions 0-1 (lookback pads); seq 1: rows 2-3 at positions 2-3 with
     * history [8, 9] at positions 0-1 */
    kern_seq s[2] = {{.row0 = 0, .n_rows = 2, .pos0 = 0, .ring_hi = -1},
                     {.row0 = 2, .n_rows = 2, .pos0 = 2, .ring_hi = -1, .history = hist,
                      .n_history = 2}};
    int64_t out[4 * 4];
    kern_engram_hash p = {.n_rows = 4, .n_layers = 1, .max_ngram = 3, .n_heads = 2, .ids = ids,
                          .row_seq = rs, .seqs = s, .token_map = map, .vocab = 50, .pad_id = 102,
                          .multipliers = mult, .primes = primes, .offsets = offs, .out = out};
    cr_assert_eq(be.ops.engram_hash(be.ctx, &p), DI_OK);
    /* expected tokens (compressed) per row: [tok0, tok1, tok2] */
    uint64_t tok[4][3] = {{110, 102, 102}, {111, 110, 102}, {112, 109, 108}, {113, 112, 109}};
    for (int t = 0; t < 4; t++) {
        uint64_t r1 = (tok[t][0] * 3) ^ (tok[t][1] * 5), r2 = r1 ^ (tok[t][2] * 7);
        int64_t want[4] = {(int64_t)(r1 % 67), (int64_t)(r1 % 71 + 67), (int64_t)(r2 % 73 + 138),
                           (int64_t)(r2 % 79 + 211)};
        cr_assert_eq(memcmp(out + t * 4, want, sizeof(want)), 0, "row %d", t);
    }
    kern_cpu_destroy(&be);
}

static void table_row(void *ud, uint64_t row, uint8_t *codes, uint8_t *scales)
{
    for (int i = 0; i < 32; i++)
        codes[i] = (uint8_t)((row * 7 + (uint64_t)i) % 120);
    scales[0] = (uint8_t)(120 + row % 5);
}

Test(ops_moe, engram_lookup_dequantises_rows_from_a_table_or_a_generator)
{
    kern_backend be = test_backend(1);
    uint8_t table[10 * 32], scale[10];
    for (uint64_t r = 0; r < 10; r++)
        table_row(NULL, r, table + r * 32, scale + r);
    int64_t hash[2 * 3] = {0, 9, 4, 4, 1, 7};
    uint16_t a[2 * 3 * 32], b[2 * 3 * 32];
    kern_engram_lookup p = {.n_rows = 2, .n_cols = 3, .head_dim = 32, .hash = hash,
                            .hash_stride = 3, .table = table, .table_scale = scale,
                            .table_rows = 10, .out = a};
    cr_assert_eq(be.ops.engram_lookup(be.ctx, &p), DI_OK);
    p.table = NULL, p.table_scale = NULL, p.row_fn = table_row, p.out = b;
    cr_assert_eq(be.ops.engram_lookup(be.ctx, &p), DI_OK);
    cr_assert_eq(memcmp(a, b, sizeof(a)), 0);
    for (int t = 0; t < 2; t++)
        for (int c = 0; c < 3; c++)
            for (int i = 0; i < 32; i++) {
                int64_t row = hash[t * 3 + c];
                float want = di_e4m3_decode(table[row * 32 + i]) * di_ue8m0_decode(scale[row]);
                cr_assert_eq(di_bf16_to_f32(a[(t * 3 + c) * 32 + i]), want);
            }
    kern_cpu_destroy(&be);
}

Test(ops_moe, engram_gate_matches_double)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 42);
    const uint32_t T = 3, hc = 4, D = 64;
    uint16_t *h = malloc(T * hc * D * 2), *h0 = malloc(T * hc * D * 2);
    uint16_t *kv = malloc(T * (hc + 1) * D * 2), qw[4 * 64], kw[4 * 64];
    fill_bf16(qw, hc * D, FILL_NORMAL, &r, 1.0f);
    fill_bf16(kw, hc * D, FILL_ONES, &r, 1.0f);
    for (int mode = 0; mode < FILL_N_MODES; mode++) {
        fill_bf16(h, T * hc * D, mode, &r, 1.0f);
        memcpy(h0, h, T * hc * D * 2);
        fill_bf16(kv, T * (hc + 1) * D, FILL_NORMAL, &r, 1.0f);
        kern_engram_gate p = {.n_rows = T, .n_copies = hc, .dim = D, .h = h, .kv = kv,
                              .q_weight = qw, .k_weight = kw, .eps = 1e-20f, .clamp = 1e-6f};
        cr_assert_eq(be.ops.engram_gate(be.ctx, &p), DI_OK);
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t c = 0; c < hc; c++) {
                const uint16_t *hh = h0 + (t * hc + c) * D, *key = kv + (t * (hc + 1) + c) * D;
                const uint16_t *val = kv + (t * (hc + 1) + hc) * D;
                double sh = 0, sk = 0, dot = 0;
                for (uint32_t d = 0; d < D; d++) {
                    sh += bfd(hh[d]) * bfd(hh[d]);
                    sk += bfd(key[d]) * bfd(key[d]);
                    dot += bfd(hh[d]) * bfd(qw[c * D + d]) * bfd(kw[c * D + d]) * bfd(key[d]);
                }
                dot *= 1 / sqrt(sh / D + 1e-20) / sqrt(sk / D + 1e-20) / sqrt((double)D);
                double mag = fabs(dot) > 1e-6 ? fabs(dot) : 1e-6;
                double sg = dot > 0 ? 1 : (dot < 0 ? -1 : 0);
                double gate = 1 / (1 + exp(-sg * sqrt(mag)));
                for (uint32_t d = 0; d < D; d++) {
                    double ref = bfd(hh[d]) + gate * bfd(val[d]);
                    double got = bfd(h[(t * hc + c) * D + d]);
                    cr_assert(fabs(got - ref) <= (fabs(bfd(hh[d])) + fabs(bfd(val[d]))) / 200 + 1e-30,
                              "mode %s row %u copy %u: %g vs %g", fill_name(mode), t, c, got, ref);
                }
            }
    }
    free(h);
    free(h0);
    free(kv);
    kern_cpu_destroy(&be);
}
