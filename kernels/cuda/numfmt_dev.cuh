/* numfmt_dev.cuh: device versions of the number formats of kernels/cpu/numfmt.h, shared by every
 * .cu file that quantises or dequantises. Each helper does the same arithmetic as its C twin, so
 * results are bit-identical (tests/gpu/check_numfmt.c and check_basic.c compare them).
 * Included by .cu files only. */
#ifndef DI_KERNELS_CUDA_NUMFMT_DEV_CUH
#define DI_KERNELS_CUDA_NUMFMT_DEV_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/numfmt_cuda.h"

/* ---- BF16 (di_bf16_to_f32, di_f32_to_bf16) ---- */

__device__ __forceinline__ float dev_bf16_to_f32(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

/* round to nearest even; NaN stays NaN with its sign (the C twin's rule, bit for bit) */
__device__ __forceinline__ uint16_t dev_f32_to_bf16(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---- E4M3, UE8M0, E2M1: the same arithmetic as numfmt.c ---- */

__device__ __forceinline__ uint8_t dev_e4m3_encode(float x)
{
    if (isnan(x))
        return 0x7f;
    uint32_t bits = __float_as_uint(x);
    uint8_t sign = (bits >> 24) & 0x80;
    float a = fabsf(x);
    if (a >= 448.0f)
        return sign | 0x7e;
    if (a < 0.015625f) /* below 2^-6: subnormal steps of 2^-9, rintf rounds half to even */
        return sign | (uint8_t)rintf(a * 512.0f);
    /* normal: keep 3 of the 23 mantissa bits, round half to even on the 20 dropped */
    uint32_t ab = bits & 0x7fffffffu;
    int exp_field = (int)(ab >> 23) - 127 + 7;
    uint32_t q = (ab >> 20) & 7u, rem = ab & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (q & 1u)))
        q++;
    if (q == 8u) {
        q = 0;
        exp_field++;
    }
    int code = (exp_field << 3) | (int)q;
    return sign | (uint8_t)(code > 0x7e ? 0x7e : code);
}

__device__ __forceinline__ float dev_e4m3_decode(uint8_t code)
{
    uint32_t e = (code >> 3) & 0x0fu, m = code & 0x07u;
    float v;
    if (e == 0x0fu && m == 0x07u)
        v = __int_as_float(0x7fc00000);
    else if (e == 0)
        v = (float)m * (1.0f / 512.0f);
    else
        v = __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (code & 0x80) ? -v : v;
}

__device__ __forceinline__ uint8_t dev_ue8m0_ceil(float x)
{
    uint32_t u = __float_as_uint(x);
    uint32_t e = (u >> 23) & 0xffu;
    if (u & 0x7fffffu)
        e++;
    return (uint8_t)(e > 0xfe ? 0xfe : e);
}

/* 2^(e-127); 0 gives the subnormal 2^-127 and 0xff NaN, as di_ue8m0_decode */
__device__ __forceinline__ float dev_ue8m0_decode(uint8_t e)
{
    if (e == 0xff)
        return __int_as_float(0x7fc00000);
    return e == 0 ? 5.877471754111438e-39f : __uint_as_float((uint32_t)e << 23);
}

__device__ __forceinline__ uint8_t dev_e2m1_encode(float x)
{
    uint8_t sign = (x < 0.0f) ? 0x08 : 0x00;
    float a = fabsf(x);
    if (isnan(a))
        return 0x07;
    const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    uint8_t c = 0;
#pragma unroll
    for (int i = 0; i < 7; i++)
        c += (a > mid[i]) ? 1 : 0;
    /* a tie sits exactly on a midpoint, where c counts the midpoints below it; the C twin moves
     * ties at the odd codes (midpoints 0.75, 1.75, 3.5) up to the even code. Written without
     * indexing mid[] at run time, which would put it in local memory. */
    if ((c == 1 && a == 0.75f) || (c == 3 && a == 1.75f) || (c == 5 && a == 3.5f))
        c++;
    return sign | c;
}

/* E2M1 code (low 4 bits) to its value: 0, 0.5 for codes 0 and 1, then (1 + m/2) * 2^(e-1)
 * built from bits (no table, so no local memory); code 8 is -0 as in the C twin */
__device__ __forceinline__ float dev_e2m1_decode(uint8_t code)
{
    uint32_t c = code & 7u;
    float r = c < 2u ? 0.5f * (float)c : __uint_as_float(((c >> 1) + 126u) << 23 | (c & 1u) << 22);
    return (code & 8) ? -r : r;
}

/* the C twin's comparison chain, so NaN passes through unchanged (fminf/fmaxf would not) */
__device__ __forceinline__ float dev_clampf(float x, float lo, float hi)
{
    return x < lo ? lo : (x > hi ? hi : x);
}

/* max over `width` consecutive lanes (width a power of two <= 32); every lane must call it */
__device__ __forceinline__ float dev_group_max(float v, int width)
{
    for (int off = width / 2; off > 0; off /= 2)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

/* One thread's 4 consecutive values of a block whose maximum magnitude is amax (NaN ignored,
 * as the C twins' `if (v > a)` does): the codes, the dequantised values and the scale byte of
 * procedure PROC. */
template <int PROC>
__device__ __forceinline__ void quant4(const float (&v)[4], float amax, uint8_t (&code)[4],
                                       float (&deq)[4], uint8_t &se)
{
    if (PROC == NUMFMT_FP8_B32) {
        se = dev_ue8m0_ceil(fmaxf(amax, 1e-4f) * (1.0f / 448.0f));
        float s = dev_ue8m0_decode(se), inv = 1.0f / s;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            code[k] = dev_e4m3_encode(dev_clampf(v[k] * inv, -448.0f, 448.0f));
            deq[k] = dev_e4m3_decode(code[k]) * s;
        }
    } else if (PROC == NUMFMT_FP4_B32) {
        se = dev_ue8m0_ceil(fmaxf(amax, 6.0f * 1.1754943508222875e-38f) / 6.0f);
        float s = dev_ue8m0_decode(se), inv = 1.0f / s;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            code[k] = dev_e2m1_encode(dev_clampf(v[k] * inv, -6.0f, 6.0f));
            deq[k] = dev_e2m1_decode(code[k]) * s;
        }
    } else {
        se = dev_e4m3_encode(dev_clampf(fmaxf(amax, 6.0f / 512.0f) / 6.0f, -448.0f, 448.0f));
        float s = dev_e4m3_decode(se);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            code[k] = dev_e2m1_encode(dev_clampf(v[k] / s, -6.0f, 6.0f));
            deq[k] = dev_e2m1_decode(code[k]) * s;
        }
    }
}

/* Threads per scale block when each thread owns 4 consecutive numbers. */
#define QUANT4_GROUP(PROC) ((PROC) == NUMFMT_FP4_B16 ? 4 : 8)

/* quant4 for the block this thread's 4 numbers belong to: the block maximum is a shuffle over
 * the QUANT4_GROUP(PROC) consecutive lanes that own the block. Every lane of the warp must call
 * it (lanes past the data with zeros). */
template <int PROC>
__device__ __forceinline__ void quant4_group(const float (&v)[4], uint8_t (&code)[4],
                                             float (&deq)[4], uint8_t &se)
{
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = dev_group_max(amax, QUANT4_GROUP(PROC));
    quant4<PROC>(v, amax, code, deq, se);
}

#endif
