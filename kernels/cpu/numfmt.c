#include "kernels/cpu/numfmt.h"

#include <math.h>

/* ---- E4M3 ---- */

uint8_t di_e4m3_encode(float x)
{
    if (isnan(x))
        return 0x7f;
    uint8_t sign = signbit(x) ? 0x80 : 0x00;
    float a = fabsf(x);
    if (a >= 448.0f)
        return sign | 0x7e;
    if (a < 0.015625f) { /* below 2^-6: subnormal, steps of 2^-9 */
        float m = rintf(a * 512.0f); /* exact scaling, round to nearest even */
        /* m == 8 is the smallest normal, whose code 0x08 is m itself */
        return sign | (uint8_t)m;
    }
    int e;
    float f = frexpf(a, &e);         /* a = f * 2^e, f in [0.5, 1) */
    float m = rintf(f * 16.0f) - 8;  /* mantissa 0..8 of 1.mmm * 2^(e-1) */
    int exp_field = e - 1 + 7;
    if (m >= 8) {
        m = 0;
        exp_field++;
    }
    uint8_t code = (uint8_t)((exp_field << 3) | (int)m);
    if (code > 0x7e)
        code = 0x7e;
    return sign | code;
}

float di_e4m3_decode(uint8_t code)
{
    int sign = code & 0x80;
    int e = (code >> 3) & 0x0f;
    int m = code & 0x07;
    float v;
    if (e == 0x0f && m == 0x07) {
        v = NAN;
    } else if (e == 0) {
        v = ldexpf((float)m, -9);
    } else {
        v = ldexpf(1.0f + (float)m / 8.0f, e - 7);
    }
    return sign ? -v : v;
}

float di_e4m3_round(float x)
{
    if (x > 448.0f)
        x = 448.0f;
    if (x < -448.0f)
        x = -448.0f;
    return di_e4m3_decode(di_e4m3_encode(x));
}

/* ---- E2M1 ---- */

static const float e2m1_values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

uint8_t di_e2m1_encode(float x)
{
    uint8_t sign = (x < 0) ? 0x08 : 0x00;
    float a = fabsf(x);
    if (!(a == a)) /* NaN: the format has none; saturate */
        return 0x07;
    /* midpoints between consecutive codes; a tie goes to the even code */
    static const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    uint8_t c = 0;
    while (c < 7 && a > mid[c])
        c++;
    if (c < 7 && a == mid[c] && (c & 1))
        c++; /* tie between codes c and c+1: c is odd, take the even c+1 */
    return sign | c;
}

float di_e2m1_decode(uint8_t code)
{
    float v = e2m1_values[code & 0x07];
    return (code & 0x08) ? -v : v;
}

void di_e2m1_pack(const uint8_t *codes, size_t n, uint8_t *packed)
{
    for (size_t i = 0; i + 1 < n; i += 2)
        packed[i / 2] = (uint8_t)((codes[i] & 0x0f) | ((codes[i + 1] & 0x0f) << 4));
}

/* ---- block procedures ---- */

static float block_amax(const float *x, size_t n)
{
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > m)
            m = a;
    }
    return m;
}

static inline float clampf(float x, float lo, float hi)
{
    return x < lo ? lo : (x > hi ? hi : x);
}

/* (A) scale byte for one block of 32 */
static uint8_t fp8_scale(const float *x)
{
    float a = block_amax(x, 32);
    if (a < 1e-4f)
        a = 1e-4f;
    return di_ue8m0_ceil(a * (1.0f / 448.0f));
}

void di_quant_fp8_b32(const float *x, size_t n, uint8_t *codes, uint8_t *scales)
{
    for (size_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
        uint8_t se = fp8_scale(xb);
        float inv = 1.0f / di_ue8m0_decode(se); /* exact: power of two */
        for (int i = 0; i < 32; i++)
            codes[b * 32 + i] = di_e4m3_encode(clampf(xb[i] * inv, -448.0f, 448.0f));
        scales[b] = se;
    }
}

void di_dequant_fp8_b32(const uint8_t *codes, const uint8_t *scales, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = di_e4m3_decode(codes[i]) * di_ue8m0_decode(scales[i / 32]);
}

static uint8_t fp4_b32_scale(const float *x)
{
    float a = block_amax(x, 32);
    const float floor_v = 6.0f * 1.1754943508222875e-38f; /* 6 * 2^-126 */
    if (a < floor_v)
        a = floor_v;
    return di_ue8m0_ceil(a / 6.0f);
}

void di_quant_fp4_b32(const float *x, size_t n, uint8_t *packed, uint8_t *scales)
{
    uint8_t codes[32];
    for (size_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
        uint8_t se = fp4_b32_scale(xb);
        float inv = 1.0f / di_ue8m0_decode(se);
        for (int i = 0; i < 32; i++)
            codes[i] = di_e2m1_encode(clampf(xb[i] * inv, -6.0f, 6.0f));
        di_e2m1_pack(codes, 32, packed + b * 16);
        scales[b] = se;
    }
}

void di_dequant_fp4_b32(const uint8_t *packed, const uint8_t *scales, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = di_e2m1_decode(di_e2m1_unpack(packed, i)) * di_ue8m0_decode(scales[i / 32]);
}

static uint8_t fp4_b16_scale(const float *x)
{
    float a = block_amax(x, 16);
    const float floor_v = 6.0f / 512.0f; /* 6 * 2^-9 */
    if (a < floor_v)
        a = floor_v;
    return di_e4m3_encode(clampf(a / 6.0f, -448.0f, 448.0f));
}

void di_quant_fp4_b16(const float *x, size_t n, uint8_t *packed, uint8_t *scales)
{
    uint8_t codes[16];
    for (size_t b = 0; b < n / 16; b++) {
        const float *xb = x + b * 16;
        uint8_t se = fp4_b16_scale(xb);
        float s = di_e4m3_decode(se);
        for (int i = 0; i < 16; i++)
            codes[i] = di_e2m1_encode(clampf(xb[i] / s, -6.0f, 6.0f));
        di_e2m1_pack(codes, 16, packed + b * 8);
        scales[b] = se;
    }
}

void di_dequant_fp4_b16(const uint8_t *packed, const uint8_t *scales, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = di_e2m1_decode(di_e2m1_unpack(packed, i)) * di_e4m3_decode(scales[i / 16]);
}

void di_fakequant_fp8_b32(float *x, size_t n)
{
    uint8_t codes[32], se;
    for (size_t b = 0; b < n / 32; b++) {
        di_quant_fp8_b32(x + b * 32, 32, codes, &se);
        di_dequant_fp8_b32(codes, &se, 32, x + b * 32);
    }
}

void di_fakequant_fp4_b32(float *x, size_t n)
{
    uint8_t packed[16], se;
    for (size_t b = 0; b < n / 32; b++) {
        di_quant_fp4_b32(x + b * 32, 32, packed, &se);
        di_dequant_fp4_b32(packed, &se, 32, x + b * 32);
    }
}

void di_fakequant_fp4_b16(float *x, size_t n)
{
    uint8_t packed[8], se;
    for (size_t b = 0; b < n / 16; b++) {
        di_quant_fp4_b16(x + b * 16, 16, packed, &se);
        di_dequant_fp4_b16(packed, &se, 16, x + b * 16);
    }
}
