/* testutil.h: inputs and independent double-precision formulations for the forward tests. */
#ifndef DI_TESTS_FORWARD_TESTUTIL_H
#define DI_TESTS_FORWARD_TESTUTIL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/philox.h"
#include "kernels/cpu/backend.h"
#include "kernels/cpu/numfmt.h"

/* Adversarial fill modes (STYLE.md H4): zeros, ones, arange, normal, values near the FP8
 * activation limits (large magnitudes and blocks under the 1e-4 amax floor), mixed signs. */
enum fill_mode {
    FILL_ZEROS,
    FILL_ONES,
    FILL_ARANGE,
    FILL_NORMAL,
    FILL_LIMITS,
    FILL_TINY,
    FILL_N_MODES,
};

static inline const char *fill_name(int mode)
{
    static const char *names[] = {"zeros", "ones", "arange", "normal", "limits", "tiny"};
    return names[mode];
}

static inline float fill_value(int mode, size_t i, di_rng *r, float sigma)
{
    switch (mode) {
    case FILL_ZEROS:
        return 0.0f;
    case FILL_ONES:
        return 1.0f;
    case FILL_ARANGE:
        return (float)((int)(i % 97) - 48) * 0.125f;
    case FILL_NORMAL:
        return (float)di_rng_normal(r) * sigma;
    case FILL_LIMITS: {
        static const float v[] = {448.0f, -447.0f, 1000.0f, 3.0e4f, -6.0f, 5.0f, 0.0f, 1e-3f};
        return v[(i * 7 + di_rng_below(r, 8)) % 8] * (float)(1 + di_rng_below(r, 3));
    }
    default: /* tiny: below the 1e-4 floor of procedure (A) */
        return (float)di_rng_normal(r) * 3e-6f;
    }
}

static inline void fill_f32(float *x, size_t n, int mode, di_rng *r, float sigma)
{
    for (size_t i = 0; i < n; i++)
        x[i] = fill_value(mode, i, r, sigma);
}

static inline void fill_bf16(uint16_t *x, size_t n, int mode, di_rng *r, float sigma)
{
    for (size_t i = 0; i < n; i++)
        x[i] = di_f32_to_bf16(fill_value(mode, i, r, sigma));
}

static inline double bfd(uint16_t h)
{
    return (double)di_bf16_to_f32(h);
}

/* A random FP8 weight [n, k] with UE8M0 32x32 scales near 2^-6 (values of order 0.1). */
static inline void rand_fp8_weight(uint8_t *w, uint8_t *s, uint32_t n, uint32_t k, di_rng *r)
{
    for (size_t i = 0; i < (size_t)n * k; i++) {
        uint8_t c = (uint8_t)di_rng_below(r, 256);
        if ((c & 0x7f) == 0x7f)
            c = 0x3c; /* no NaN codes */
        w[i] = c;
    }
    for (size_t i = 0; i < (size_t)((n + 31) / 32) * (k / 32); i++)
        s[i] = (uint8_t)(127 - 9 + di_rng_below(r, 3));
}

/* A random FP4 weight [n, k/2] packed with UE8M0 1x32 scales. */
static inline void rand_fp4_weight(uint8_t *w, uint8_t *s, uint32_t n, uint32_t k, di_rng *r)
{
    for (size_t i = 0; i < (size_t)n * k / 2; i++)
        w[i] = (uint8_t)di_rng_below(r, 256);
    for (size_t i = 0; i < (size_t)n * (k / 32); i++)
        s[i] = (uint8_t)(127 - 5 + di_rng_below(r, 3));
}

/* Weight value (n, kk) of a weight in the given kern_wfmt, decoded with numfmt. */
static inline double weight_at(int fmt, const void *w, const uint8_t *s, uint32_t k, uint32_t n,
                               uint32_t kk)
{
    if (fmt == KERN_W_FP8)
        return (double)di_e4m3_decode(((const uint8_t *)w)[(size_t)n * k + kk]) *
               (double)di_ue8m0_decode(s[(size_t)(n / 32) * (k / 32) + kk / 32]);
    if (fmt == KERN_W_FP4)
        return (double)di_e2m1_decode(di_e2m1_unpack((const uint8_t *)w + (size_t)n * (k / 2), kk)) *
               (double)di_ue8m0_decode(s[(size_t)n * (k / 32) + kk / 32]);
    return bfd(((const uint16_t *)w)[(size_t)n * k + kk]);
}

/* Does `got` (a bf16 or fp32 result) agree with the exact value `ref`, allowing bf16 rounding
 * (when bf16) plus an fp32 accumulation error proportional to `mag` (sum of |terms|)? */
static inline int close_to(double got, double ref, double mag, int is_bf16)
{
    double tol = 1e-6 * mag + 1e-30;
    if (is_bf16)
        tol += fabs(ref) * (1.0 / 256.0);
    return fabs(got - ref) <= tol;
}

static inline kern_backend test_backend(uint32_t threads)
{
    kern_backend be;
    di_error e;
    if (kern_cpu_create(threads, &be, &e) != DI_OK)
        abort();
    return be;
}

#endif
