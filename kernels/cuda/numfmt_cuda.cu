/* numfmt_cuda.cu: quantisation procedures (A), (B), (C) on the GPU, bit-identical to
 * kernels/cpu/numfmt.c. One warp per 32-value block ((A), (B)) or per two 16-value blocks
 * ((C)); the block maximum is a warp shuffle reduction. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/numfmt_cuda.h"

/* ---- device helpers: the same arithmetic as numfmt.c ---- */

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

__device__ __forceinline__ float dev_ue8m0_decode(uint8_t e)
{
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
    if (c < 7 && a == mid[c] && (c & 1))
        c++;
    return sign | c;
}

__device__ __forceinline__ float dev_e2m1_decode(uint8_t code)
{
    const float v[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float r = v[code & 7];
    return (code & 8) ? -r : r;
}

/* the C twin's comparison chain, so NaN passes through unchanged (fminf/fmaxf would not) */
__device__ __forceinline__ float clampf(float x, float lo, float hi)
{
    return x < lo ? lo : (x > hi ? hi : x);
}

/* max over `width` consecutive lanes (width a power of two <= 32) */
__device__ __forceinline__ float group_max(float v, int width)
{
    for (int off = width / 2; off > 0; off /= 2)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

/* ---- kernels: each thread owns 4 consecutive values (one 16-byte load); 8 threads cover a
 * 32-value block, 4 threads a 16-value block ---- */

template <int PROC>
__device__ __forceinline__ void quant4(const float (&v)[4], float amax, uint8_t (&code)[4],
                                       float (&deq)[4], uint8_t &se)
{
    if (PROC == NUMFMT_FP8_B32) {
        se = dev_ue8m0_ceil(fmaxf(amax, 1e-4f) * (1.0f / 448.0f));
        float s = dev_ue8m0_decode(se), inv = 1.0f / s;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            code[k] = dev_e4m3_encode(clampf(v[k] * inv, -448.0f, 448.0f));
            deq[k] = dev_e4m3_decode(code[k]) * s;
        }
    } else if (PROC == NUMFMT_FP4_B32) {
        se = dev_ue8m0_ceil(fmaxf(amax, 6.0f * 1.1754943508222875e-38f) / 6.0f);
        float s = dev_ue8m0_decode(se), inv = 1.0f / s;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            code[k] = dev_e2m1_encode(clampf(v[k] * inv, -6.0f, 6.0f));
            deq[k] = dev_e2m1_decode(code[k]) * s;
        }
    } else {
        se = dev_e4m3_encode(clampf(fmaxf(amax, 6.0f / 512.0f) / 6.0f, -448.0f, 448.0f));
        float s = dev_e4m3_decode(se);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            code[k] = dev_e2m1_encode(clampf(v[k] / s, -6.0f, 6.0f));
            deq[k] = dev_e2m1_decode(code[k]) * s;
        }
    }
}

template <int PROC, bool FAKE>
__global__ void quant_kernel(float *x, size_t n, uint8_t *codes, uint8_t *scales)
{
    const int group = (PROC == NUMFMT_FP4_B16) ? 4 : 8; /* threads per scale block */
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t i = t * 4;
    /* n is a multiple of the block, so a block's threads are all valid or all past the end;
     * the shuffles below still run on every lane */
    bool valid = i < n;
    float4 q4 = valid ? reinterpret_cast<const float4 *>(x)[t] : make_float4(0, 0, 0, 0);
    float v[4] = {q4.x, q4.y, q4.z, q4.w};
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = group_max(amax, group);
    uint8_t code[4], se;
    float deq[4];
    quant4<PROC>(v, amax, code, deq, se);
    if (!valid)
        return;
    if (FAKE) {
        reinterpret_cast<float4 *>(x)[t] = make_float4(deq[0], deq[1], deq[2], deq[3]);
        return;
    }
    if ((threadIdx.x & (group - 1)) == 0)
        scales[i / (group * 4)] = se;
    if (PROC == NUMFMT_FP8_B32) {
        uint32_t w = (uint32_t)code[0] | ((uint32_t)code[1] << 8) | ((uint32_t)code[2] << 16) |
                     ((uint32_t)code[3] << 24);
        reinterpret_cast<uint32_t *>(codes)[t] = w;
    } else {
        uint16_t w = (uint16_t)((code[0] & 0x0f) | ((code[1] & 0x0f) << 4) |
                                ((code[2] & 0x0f) << 8) | ((code[3] & 0x0f) << 12));
        reinterpret_cast<uint16_t *>(codes)[t] = w;
    }
}

/* ---- launchers ---- */

static di_status check_args(const float *x, size_t n, numfmt_procedure proc, di_error *err)
{
    if (!x)
        return di_fail(err, DI_EINVAL, "numfmt: x is NULL");
    size_t blk = proc == NUMFMT_FP4_B16 ? 16 : 32;
    if (proc < NUMFMT_FP8_B32 || proc > NUMFMT_FP4_B16)
        return di_fail(err, DI_EINVAL, "numfmt: unknown procedure %d", (int)proc);
    if (n % blk != 0)
        return di_fail(err, DI_EINVAL, "numfmt: n %zu is not a multiple of %zu", n, blk);
    if ((uintptr_t)x % 16 != 0)
        return di_fail(err, DI_EINVAL, "numfmt: x must be 16-byte aligned");
    return DI_OK;
}

template <bool FAKE>
static di_status launch(float *x, size_t n, numfmt_procedure proc, uint8_t *codes,
                        uint8_t *scales, void *stream, di_error *err)
{
    if (n == 0)
        return DI_OK;
    const int threads = 256;
    size_t blocks = (n / 4 + threads - 1) / threads;
    if (blocks > 0x7fffffffu)
        return di_fail(err, DI_EINVAL, "numfmt: %zu values is too many for one launch", n);
    cudaStream_t s = (cudaStream_t)stream;
    switch (proc) {
    case NUMFMT_FP8_B32:
        quant_kernel<NUMFMT_FP8_B32, FAKE><<<(unsigned)blocks, threads, 0, s>>>(x, n, codes, scales);
        break;
    case NUMFMT_FP4_B32:
        quant_kernel<NUMFMT_FP4_B32, FAKE><<<(unsigned)blocks, threads, 0, s>>>(x, n, codes, scales);
        break;
    case NUMFMT_FP4_B16:
        quant_kernel<NUMFMT_FP4_B16, FAKE><<<(unsigned)blocks, threads, 0, s>>>(x, n, codes, scales);
        break;
    }
    return di_cuda_launch_status("numfmt quant_kernel", err);
}

extern "C" di_status numfmt_cuda_quant(const numfmt_quant_params *p, di_error *err)
{
    if (!p)
        return di_fail(err, DI_EINVAL, "numfmt: params are NULL");
    di_status st = check_args(p->x, p->n, p->procedure, err);
    if (st)
        return st;
    if (!p->codes || !p->scales)
        return di_fail(err, DI_EINVAL, "numfmt: codes or scales is NULL");
    if ((uintptr_t)p->codes % 4 != 0)
        return di_fail(err, DI_EINVAL, "numfmt: codes must be 4-byte aligned");
    return launch<false>((float *)p->x, p->n, p->procedure, p->codes, p->scales, p->stream, err);
}

extern "C" di_status numfmt_cuda_fakequant(float *x, size_t n, numfmt_procedure procedure,
                                           void *stream, di_error *err)
{
    di_status st = check_args(x, n, procedure, err);
    if (st)
        return st;
    return launch<true>(x, n, procedure, NULL, NULL, stream, err);
}
