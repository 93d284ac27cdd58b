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
    uint8_t sign = signbit(x) ? 0x80 : 0x00;
    float a = fabsf(x);
    if (a >= 448.0f)
        return sign | 0x7e;
    if (a < 0.015625f)
        return sign | (uint8_t)rintf(a * 512.0f);
    int e;
    float f = frexpf(a, &e);
    float m = rintf(f * 16.0f) - 8.0f;
    int exp_field = e - 1 + 7;
    if (m >= 8.0f) {
        m = 0.0f;
        exp_field++;
    }
    int code = (exp_field << 3) | (int)m;
    return sign | (uint8_t)(code > 0x7e ? 0x7e : code);
}

__device__ __forceinline__ float dev_e4m3_decode(uint8_t code)
{
    int e = (code >> 3) & 0x0f, m = code & 0x07;
    float v;
    if (e == 0x0f && m == 0x07)
        v = __int_as_float(0x7fc00000);
    else if (e == 0)
        v = ldexpf((float)m, -9);
    else
        v = ldexpf(1.0f + (float)m / 8.0f, e - 7);
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

/* ---- kernels: one thread per value; a warp covers 32 consecutive values ---- */

template <int PROC, bool FAKE>
__global__ void quant_kernel(float *x, size_t n, uint8_t *codes, uint8_t *scales)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    int lane = threadIdx.x & 31;
    /* n is a multiple of 32 for (A)/(B) and of 16 for (C); a warp past the end of a (C)
     * tensor with n % 32 == 16 still runs its shuffles with zeros */
    bool valid = i < n;
    float v = valid ? x[i] : 0.0f;
    const int width = (PROC == NUMFMT_FP4_B16) ? 16 : 32;
    float amax = group_max(fabsf(v), width);
    uint8_t code;
    float deq;
    if (PROC == NUMFMT_FP8_B32) {
        uint8_t se = dev_ue8m0_ceil(fmaxf(amax, 1e-4f) * (1.0f / 448.0f));
        float s = dev_ue8m0_decode(se);
        code = dev_e4m3_encode(clampf(v * (1.0f / s), -448.0f, 448.0f));
        deq = dev_e4m3_decode(code) * s;
        if (!FAKE && lane == 0 && valid)
            scales[i / 32] = se;
    } else if (PROC == NUMFMT_FP4_B32) {
        uint8_t se = dev_ue8m0_ceil(fmaxf(amax, 6.0f * 1.1754943508222875e-38f) / 6.0f);
        float s = dev_ue8m0_decode(se);
        code = dev_e2m1_encode(clampf(v * (1.0f / s), -6.0f, 6.0f));
        deq = dev_e2m1_decode(code) * s;
        if (!FAKE && lane == 0 && valid)
            scales[i / 32] = se;
    } else {
        uint8_t se = dev_e4m3_encode(clampf(fmaxf(amax, 6.0f / 512.0f) / 6.0f, -448.0f, 448.0f));
        float s = dev_e4m3_decode(se);
        code = dev_e2m1_encode(clampf(v / s, -6.0f, 6.0f));
        deq = dev_e2m1_decode(code) * s;
        if (!FAKE && (lane & 15) == 0 && valid)
            scales[i / 16] = se;
    }
    if (FAKE) {
        if (valid)
            x[i] = deq;
        return;
    }
    if (PROC == NUMFMT_FP8_B32) {
        if (valid)
            codes[i] = code;
    } else {
        uint8_t hi = (uint8_t)__shfl_down_sync(0xffffffffu, (int)code, 1);
        if (valid && (lane & 1) == 0)
            codes[i / 2] = (uint8_t)((code & 0x0f) | ((hi & 0x0f) << 4));
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
    return DI_OK;
}

template <bool FAKE>
static di_status launch(float *x, size_t n, numfmt_procedure proc, uint8_t *codes,
                        uint8_t *scales, void *stream, di_error *err)
{
    if (n == 0)
        return DI_OK;
    const int threads = 256;
    size_t blocks = (n + threads - 1) / threads;
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
