/* numfmt_cuda.cu: quantisation procedures (A), (B), (C) on the GPU, bit-identical to
 * kernels/cpu/numfmt.c. One warp per 32-value block ((A), (B)) or per two 16-value blocks
 * ((C)); the block maximum is a warp shuffle reduction. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/numfmt_cuda.h"
#include "kernels/cuda/numfmt_dev.cuh"

/* ---- kernels: each thread owns 4 consecutive values (one 16-byte load); 8 threads cover a
 * 32-value block, 4 threads a 16-value block ---- */

template <int PROC, bool FAKE>
__global__ void quant_kernel(float *x, size_t n, uint8_t *codes, uint8_t *scales)
{
    const int group = QUANT4_GROUP(PROC); /* threads per scale block */
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t i = t * 4;
    /* n is a multiple of the block, so a block's threads are all valid or all past the end;
     * the shuffles below still run on every lane */
    bool valid = i < n;
    float4 q4 = valid ? reinterpret_cast<const float4 *>(x)[t] : make_float4(0, 0, 0, 0);
    float v[4] = {q4.x, q4.y, q4.z, q4.w};
    uint8_t code[4], se;
    float deq[4];
    quant4_group<PROC>(v, code, deq, se);
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
