/* Linear layers and fake quantisation of the CPU backend against independent formulations. */
#include <criterion/criterion.h>

#include "tests/forward/testutil.h"

/* Exhaustive over bf16 inputs: with a block amax of 448 the scale is 1, so the op must give
 * e4m3(x) for every bf16 x in [-448, 448]. */
Test(ops_linear, fp8_fakequant_matches_numfmt_for_every_bf16_value)
{
    kern_backend be = test_backend(2);
    uint16_t *row = malloc(65536 * 2 * sizeof(uint16_t));
    uint16_t *orig = malloc(65536 * 2 * sizeof(uint16_t));
    size_t n = 0;
    for (uint32_t u = 0; u < 65536; u++) {
        float v = di_bf16_to_f32((uint16_t)u);
        if (!(fabsf(v) <= 448.0f))
            continue;
        if (n % 32 == 0)
            row[n++] = di_f32_to_bf16(448.0f);
        row[n++] = (uint16_t)u;
    }
    while (n % 32)
        row[n++] = 0;
    memcpy(orig, row, n * 2);
    kern_fakequant fq = {.n_rows = 1, .n = (uint32_t)n, .x = row, .stride = n, .fmt = KERN_Q_FP8_B32};
    cr_assert_eq(be.ops.fakequant(be.ctx, &fq), DI_OK);
    for (size_t i = 0; i < n; i++) {
        float want = di_e4m3_round(di_bf16_to_f32(orig[i]));
        cr_assert_eq(di_bf16_to_f32(row[i]), want, "bf16 0x%04x -> %g, want %g", orig[i],
                     di_bf16_to_f32(row[i]), want);
    }
    free(row);
    free(orig);
    kern_cpu_destroy(&be);
}

Test(ops_linear, fakequant_all_formats_match_numfmt_on_adversarial_rows)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 11);
    const uint32_t rows = 63, n = 96;
    uint16_t *x = malloc((size_t)rows * n * 2);
    float *f = malloc((size_t)n * sizeof(float));
    for (int fmt = 0; fmt < 3; fmt++) {
        for (int mode = 0; mode < FILL_N_MODES; mode++) {
            fill_bf16(x, (size_t)rows * n, mode, &r, 3.0f);
            uint16_t *copy = malloc((size_t)rows * n * 2);
            memcpy(copy, x, (size_t)rows * n * 2);
            kern_fakequant fq = {.n_rows = rows, .n = n, .x = x, .stride = n, .fmt = (kern_qfmt)fmt};
            cr_assert_eq(be.ops.fakequant(be.ctx, &fq), DI_OK);
            for (uint32_t t = 0; t < rows; t++) {
                for (uint32_t i = 0; i < n; i++)
                    f[i] = di_bf16_to_f32(copy[(size_t)t * n + i]);
                if (fmt == KERN_Q_FP8_B32)
                    di_fakequant_fp8_b32(f, n);
                else if (fmt == KERN_Q_FP4_B32)
                    di_fakequant_fp4_b32(f, n);
                else
                    di_fakequant_fp4_b16(f, n);
                for (uint32_t i = 0; i < n; i++)
                    cr_assert_eq(di_bf16_to_f32(x[(size_t)t * n + i]), f[i],
                                 "fmt %d mode %s row %u col %u: %g vs %g", fmt, fill_name(mode),
                                 t, i, di_bf16_to_f32(x[(size_t)t * n + i]), f[i]);
            }
            free(copy);
        }
    }
    free(x);
    free(f);
    kern_cpu_destroy(&be);
}

/* Reference: fake-quantise the input row with numfmt (FP8/FP4 weights), then sum in double. */
static double ref_dot(int fmt, const uint16_t *x, const void *w, const uint8_t *s, uint32_t k,
                      uint32_t nrow, uint32_t koff, double *mag)
{
    float xf[1024];
    for (uint32_t i = 0; i < k; i++)
        xf[i] = di_bf16_to_f32(x[koff + i]);
    if (fmt != KERN_W_BF16)
        di_fakequant_fp8_b32(xf, k);
    double acc = 0, m = 0;
    for (uint32_t i = 0; i < k; i++) {
        double t = (double)xf[i] * weight_at(fmt, w, s, k, nrow, i);
        acc += t;
        m += fabs(t);
    }
    *mag = m;
    return acc;
}

typedef struct lin_case {
    int fmt;
    uint32_t m, n, k, groups;
    int out_f32;
} lin_case;

static void run_case(kern_backend *be, const lin_case *c, int mode, di_rng *r)
{
    uint32_t G = c->groups, K = c->k * G, N = c->n * G;
    uint16_t *x = malloc((size_t)c->m * K * 2);
    fill_bf16(x, (size_t)c->m * K, mode, r, 2.0f);
    size_t wbytes = c->fmt == KERN_W_BF16 ? (size_t)N * c->k * 2
                    : c->fmt == KERN_W_FP8 ? (size_t)c->n * c->k : (size_t)c->n * c->k / 2;
    uint8_t *w = malloc(wbytes);
    uint8_t *s = malloc((size_t)(c->n + 31) * c->k);
    if (c->fmt == KERN_W_FP8)
        rand_fp8_weight(w, s, c->n, c->k, r);
    else if (c->fmt == KERN_W_FP4)
        rand_fp4_weight(w, s, c->n, c->k, r);
    else
        fill_bf16((uint16_t *)w, (size_t)N * c->k, FILL_NORMAL, r, 0.2f);
    size_t esz = c->out_f32 ? 4 : 2;
    void *y = malloc((size_t)c->m * N * esz);
    kern_linear l = {.m = c->m, .n = c->n, .k = c->k, .groups = G, .x = x, .x_stride = K,
                     .w = w, .w_scale = c->fmt == KERN_W_BF16 ? NULL : s, .out_f32 = c->out_f32,
                     .y = y, .y_stride = N};
    di_status st = c->fmt == KERN_W_FP8   ? be->ops.linear_fp8(be->ctx, &l)
                   : c->fmt == KERN_W_FP4 ? be->ops.linear_fp4(be->ctx, &l)
                                          : be->ops.linear_bf16(be->ctx, &l);
    cr_assert_eq(st, DI_OK);
    for (uint32_t m = 0; m < c->m; m++)
        for (uint32_t g = 0; g < G; g++)
            for (uint32_t n = 0; n < c->n; n++) {
                double mag;
                double ref = ref_dot(c->fmt, x + (size_t)m * K, w, s, c->k, g * c->n + n,
                                     g * c->k, &mag);
                size_t idx = (size_t)m * N + g * c->n + n;
                double got = c->out_f32 ? ((float *)y)[idx] : bfd(((uint16_t *)y)[idx]);
                cr_assert(close_to(got, ref, mag, !c->out_f32),
                          "fmt %d m %u n %u k %u groups %u mode %s at (%u, %u, %u): %.9g vs %.9g",
                          c->fmt, c->m, c->n, c->k, G, fill_name(mode), m, g, n, got, ref);
            }
    free(x);
    free(w);
    free(s);
    free(y);
}

Test(ops_linear, all_formats_match_double_reference_on_awkward_shapes)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 5);
    static const lin_case cases[] = {
        {KERN_W_FP8, 1, 1, 32, 1, 0},    {KERN_W_FP8, 3, 17, 64, 1, 0},
        {KERN_W_FP8, 63, 40, 96, 1, 0},  {KERN_W_FP8, 127, 33, 32, 1, 1},
        {KERN_W_FP4, 1, 5, 64, 1, 0},    {KERN_W_FP4, 63, 19, 96, 1, 0},
        {KERN_W_FP4, 3, 32, 32, 1, 1},   {KERN_W_BF16, 3, 7, 32, 4, 0},
        {KERN_W_BF16, 63, 16, 64, 2, 1}, {KERN_W_BF16, 127, 3, 96, 1, 1},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        for (int mode = 0; mode < FILL_N_MODES; mode++)
            run_case(&be, &cases[i], mode, &r);
    kern_cpu_destroy(&be);
}

Test(ops_linear, accumulate_adds_into_f32_output)
{
    kern_backend be = test_backend(1);
    uint16_t x[32], w[2 * 32];
    for (int i = 0; i < 32; i++) {
        x[i] = di_f32_to_bf16(1.0f);
        w[i] = di_f32_to_bf16(0.5f);
        w[32 + i] = di_f32_to_bf16(-1.0f);
    }
    float y[2] = {10.0f, 100.0f};
    kern_linear l = {.m = 1, .n = 2, .k = 32, .groups = 1, .x = x, .x_stride = 32, .w = w,
                     .out_f32 = 1, .accumulate = 1, .y = y, .y_stride = 2};
    cr_assert_eq(be.ops.linear_bf16(be.ctx, &l), DI_OK);
    cr_assert_eq(y[0], 26.0f);
    cr_assert_eq(y[1], 68.0f);
    kern_cpu_destroy(&be);
}

/* A row's output does not depend on the other rows of the call nor on the thread count. */
Test(ops_linear, rows_are_independent_of_batch_and_threads)
{
    kern_backend b1 = test_backend(1), b2 = test_backend(2);
    di_rng r;
    di_rng_init(&r, 9);
    const uint32_t M = 127, N = 45, K = 160;
    uint16_t *x = malloc((size_t)M * K * 2);
    fill_bf16(x, (size_t)M * K, FILL_NORMAL, &r, 1.0f);
    uint8_t *w = malloc((size_t)N * K), *s = malloc((size_t)2 * K);
    rand_fp8_weight(w, s, N, K, &r);
    uint16_t *all = malloc((size_t)M * N * 2), one[64];
    kern_linear l = {.m = M, .n = N, .k = K, .groups = 1, .x = x, .x_stride = K, .w = w,
                     .w_scale = s, .y = all, .y_stride = N};
    cr_assert_eq(b2.ops.linear_fp8(b2.ctx, &l), DI_OK);
    for (uint32_t m = 0; m < M; m += 7) {
        kern_linear l1 = l;
        l1.m = 1;
        l1.x = x + (size_t)m * K;
        l1.y = one;
        cr_assert_eq(b1.ops.linear_fp8(b1.ctx, &l1), DI_OK);
        cr_assert_eq(memcmp(one, all + (size_t)m * N, N * 2), 0, "row %u differs", m);
    }
    free(x);
    free(w);
    free(s);
    free(all);
    kern_cpu_destroy(&b1);
    kern_cpu_destroy(&b2);
}
